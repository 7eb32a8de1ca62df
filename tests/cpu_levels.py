"""The CPU kernel levels the suite runs: each one this host runs, where there is a compiler."""

from __future__ import annotations

import shutil

from gpu.cpu_isa import host_levels

# Without a compiler the native tests skip (the torch path serves, with a warning); with one, a
# broken build fails them.
NATIVE_LEVELS = host_levels() if shutil.which("gcc") else ()
