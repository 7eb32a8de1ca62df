"""The CPU kernel levels the suite runs: each one this host runs, where there is a compiler."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from gpu.cpu_isa import ISA_ENV, host_levels

# Without a compiler the native tests skip (the torch path serves, with a warning); with one, a
# broken build fails them.
NATIVE_LEVELS = host_levels() if shutil.which("gcc") else ()


@contextmanager
def native_level(level: str) -> Iterator[str]:
    """The native kernels of `level` loaded for the block (a model built inside keeps its
    layout); the level before it loaded again after."""
    from gpu import native

    before = os.environ.get(ISA_ENV)
    os.environ[ISA_ENV] = level
    native.reset()
    try:
        yield level
    finally:
        if before is None:
            os.environ.pop(ISA_ENV, None)
        else:
            os.environ[ISA_ENV] = before
        native.reset()
