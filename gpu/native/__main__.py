"""`python -m gpu.native`: build and load the CPU kernels of the chosen level, as `make install`
does, and say which serve; the compiler's message and exit status 1 where the build fails."""

from __future__ import annotations

import sys

from gpu import native
from gpu.cpu_isa import host_levels


def main() -> int:
    try:
        kernels = native.kernel_set()
    except (native.KernelBuildError, ValueError) as e:
        print(f"pipeline-serve: {e}", file=sys.stderr)
        return 1
    print(f"CPU kernels: {kernels} (this CPU runs {', '.join(host_levels())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
