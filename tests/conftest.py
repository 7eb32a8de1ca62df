"""Suite-wide guards: no test may leave a process or a `pserve.*` name behind."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from pipeline.names import names_in_shm, pid_alive


@pytest.fixture(autouse=True, scope="session")
def no_leftovers():
    before = set(names_in_shm())
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)
    # Names of a live process other than this one belong to someone else running on the machine.
    left = sorted(
        name
        for name in set(names_in_shm()) - before
        if (pid := int(name.removeprefix("sem.").split(".")[1])) == os.getpid()
        or not pid_alive(pid)
    )
    assert not left, f"the suite left shared-memory names behind: {left}"
