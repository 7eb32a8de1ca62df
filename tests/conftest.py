"""Suite-wide guards: no test may leave a process or a `pserve.*` name behind."""

from __future__ import annotations

import multiprocessing

import pytest

from pipeline.names import names_in_shm


@pytest.fixture(autouse=True, scope="session")
def no_leftovers():
    before = set(names_in_shm())
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)
    left = sorted(set(names_in_shm()) - before)
    assert not left, f"the suite left shared-memory names behind: {left}"
