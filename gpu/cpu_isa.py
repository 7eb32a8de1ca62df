"""The ISA levels the CPU kernels (gpu/native) are built for, which of them this CPU runs, and
the one a process uses. Torch-free, so that the test suite can list the levels at collection.

PIPELINE_SERVE_CPU_ISA picks the level (default `auto`: the highest this CPU runs); a level the
CPU does not run is an error, not an illegal instruction later.
"""

from __future__ import annotations

import os
import platform

ISA_ENV = "PIPELINE_SERVE_CPU_ISA"
# Lowest first (cpu_ops.c's branches); `auto` takes the last one the CPU runs. avx2_vnni is
# AVX2 with AVX-VNNI's 256-bit vpdpbusd (Alder Lake and later Intel cores, Zen 5): not a step
# below avx512, which Zen 4 runs without it.
LEVELS = ("portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni")
# Each level's target (x86-64-v3 is AVX2 + FMA + F16C, v4 adds AVX-512 F/BW/CD/DQ/VL), tuned
# for this CPU, and every /proc/cpuinfo flag it needs.
_X86_TARGETS = {
    "portable": ("-march=x86-64",),
    "avx2": ("-march=x86-64-v3",),
    "avx2_vnni": ("-march=x86-64-v3", "-mavxvnni"),
    "avx512": ("-march=x86-64-v4",),
    "avx512_vnni": ("-march=x86-64-v4", "-mavx512vnni"),
}
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_X86_FEATURES = {
    "portable": (),
    "avx2": _AVX2,
    "avx2_vnni": (*_AVX2, "avx_vnni"),
    "avx512": _AVX512,
    "avx512_vnni": (*_AVX512, "avx512_vnni"),
}


def cpuinfo_lines() -> list[str]:
    """/proc/cpuinfo's model name and flags lines (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return [ln for ln in f if ln.startswith(("model name", "flags"))]
    except OSError:
        return []


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def host_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first (only `portable` off x86)."""
    if not is_x86():
        return ("portable",)
    flags = {flag for line in cpuinfo_lines() if line.startswith("flags") for flag in line.split()}
    return tuple(
        level for level in LEVELS if all(feature in flags for feature in _X86_FEATURES[level])
    )


def chosen_level() -> str:
    """PIPELINE_SERVE_CPU_ISA's level, or the highest this CPU runs for `auto` (the default)."""
    requested = os.environ.get(ISA_ENV) or "auto"
    runs = host_levels()
    if requested == "auto":
        return runs[-1]
    if requested not in LEVELS:
        raise ValueError(f"{ISA_ENV}={requested!r}: choose auto or one of {', '.join(LEVELS)}")
    if requested not in runs:
        raise ValueError(
            f"{ISA_ENV}={requested}: this CPU runs {', '.join(runs)} only "
            f"({requested} would stop on an illegal instruction)"
        )
    return requested


def target_flags(level: str) -> tuple[str, ...]:
    """The compiler's target flags for a level's build."""
    if not is_x86():
        return ()
    return (*_X86_TARGETS[level], "-mtune=native")
