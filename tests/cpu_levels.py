"""The CPU kernel levels the suite runs: each one this host runs, where there is a compiler and
the torch path was not asked for (PIPELINE_SERVE_NATIVE=0, as .ci/run runs the model tests)."""

from __future__ import annotations

import os
import shutil

from gpu.cpu_isa import host_levels

# Without a compiler the native tests skip (the torch path serves, with a warning); with one, a
# broken build fails them.
NATIVE = shutil.which("gcc") is not None and os.environ.get("PIPELINE_SERVE_NATIVE") != "0"
NATIVE_LEVELS = host_levels() if NATIVE else ()
