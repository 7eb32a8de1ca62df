"""Every ISA branch of cpu_ops.c compiles, for every CPU the code has a branch for, and the
build's failures are errors that are remembered, not silent fallbacks.

A build with -march=native only ever compiles the branches of the machine it runs on: these
compile the others too (compile-only; the host need not run them), with warnings as errors so
that an unused branch cannot rot either."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpu import cpu_isa, native

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")

# Each x86 level the code has a branch for, by the CPUs that have it.
X86_TARGETS = {
    "x86-64": ["-march=x86-64"],  # SSE2 only: the portable branches
    "x86-64-v2": ["-march=x86-64-v2"],
    "ivybridge": ["-march=ivybridge"],  # F16C without AVX2
    "haswell": ["-march=haswell"],  # AVX2 + FMA + F16C
    "avx2-no-fma": ["-mavx2", "-mno-fma"],
    "skylake-avx512": ["-march=skylake-avx512"],  # AVX-512 without VNNI
    "icelake-server": ["-march=icelake-server"],  # AVX-512 VNNI
    "cooperlake": ["-march=cooperlake"],  # AVX-512 VNNI and BF16
    "sapphirerapids": ["-march=sapphirerapids"],  # AVX-512 VNNI, BF16, AMX
    "alderlake": ["-march=alderlake"],  # 256-bit AVX-VNNI, no AVX-512
    "znver3": ["-march=znver3"],  # AVX2, no AVX-512
    **{f"level-{level}": list(cpu_isa._X86_TARGETS[level]) for level in cpu_isa.LEVELS},
}
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def _compile(compiler: str, target: list[str]) -> str | None:
    """None, or what the compiler said."""
    # -O1: the errors a branch can hide (undeclared names, intrinsics outside their target) show
    # at any level, in half the time of the build's -O3
    flags = [f for f in native.FLAGS if f not in ("-shared", "-O3")] + ["-O1"]
    result = subprocess.run(
        [compiler, *flags, *target, *WARNINGS, "-c", str(native.SOURCE), "-o", os.devnull],
        capture_output=True,
        text=True,
    )
    return None if result.returncode == 0 else (result.stderr or result.stdout)[-1500:]


@pytest.mark.slow
@needs_gcc
def test_every_x86_branch_compiles_with_warnings_as_errors():
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        messages = pool.map(lambda target: _compile("gcc", target), X86_TARGETS.values())
        said = dict(zip(X86_TARGETS, messages, strict=True))
    broken = {name: message for name, message in said.items() if message is not None}
    assert not broken, "\n\n".join(f"[{name}]\n{message}" for name, message in broken.items())


@pytest.mark.slow
def test_the_portable_branch_compiles_for_aarch64():
    """No x86 intrinsic outside its guard: the kernels build on other architectures (.ci/run
    installs Debian's gcc-aarch64-linux-gnu)."""
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        if os.environ.get("CI"):
            pytest.fail("CI has no aarch64-linux-gnu-gcc: .ci/run installs gcc-aarch64-linux-gnu")
        pytest.skip("needs aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu)")
    assert _compile(compiler, []) is None


def test_host_levels_follow_the_cpu_flags(monkeypatch):
    cpus = {
        "sse4_2 avx f16c": ("portable",),  # Ivy Bridge
        "avx2 fma f16c bmi2": ("portable", "avx2"),  # Haswell, Zen 3
        "avx2 fma f16c avx512f avx512bw avx512cd avx512dq avx512vl": (
            "portable",
            "avx2",
            "avx512",
        ),  # Skylake-SP
        "avx2 fma f16c avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx_vnni": (
            cpu_isa.LEVELS  # Sapphire Rapids: every level
        ),
        "avx2 fma f16c avx512f avx512_vnni avx_vnni": (  # no BW/VL: not v4
            "portable",
            "avx2",
            "avx2_vnni",
        ),
        "avx2 fma f16c avx_vnni": ("portable", "avx2", "avx2_vnni"),  # Alder Lake
        "avx2 fma f16c avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx512_bf16": (
            "portable",
            "avx2",
            "avx512",
            "avx512_vnni",
        ),  # Zen 4: AVX-512 VNNI without AVX-VNNI
    }
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)
    for flags, levels in cpus.items():
        monkeypatch.setattr(cpu_isa, "cpuinfo_lines", lambda f=flags: [f"flags\t: fpu {f}\n"])
        assert cpu_isa.host_levels() == levels, flags


def test_a_level_the_cpu_does_not_run_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_isa, "host_levels", lambda: ("portable", "avx2"))
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="this CPU runs portable, avx2 only"):
        cpu_isa.chosen_level()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="choose auto or one of portable, avx2"):
        cpu_isa.chosen_level()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "auto")
    assert cpu_isa.chosen_level() == "avx2"


@needs_gcc
def test_a_failed_build_is_an_error_and_is_not_retried(tmp_path, monkeypatch):
    """A compiler that fails on the source fails every load with its message, and only the
    first process runs it (the failure is kept in the cache beside the libraries)."""
    source = tmp_path / "cpu_ops.c"
    source.write_text(native.SOURCE.read_text() + "\nint broken(void) { return undeclared; }\n")
    calls = tmp_path / "calls"
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec gcc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setattr(native, "SOURCE", source)
    monkeypatch.delenv("PIPELINE_SERVE_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("PIPELINE_SERVE_CACHE", str(tmp_path / "cache"))
    native.reset()
    try:
        for _ in range(2):
            with pytest.raises(native.KernelBuildError, match=r"undeclared\W+undeclared") as e:
                native.load()
            assert "PIPELINE_SERVE_NATIVE=0" in str(e.value)
            native.reset()
    finally:
        native.reset()
    builds = [line for line in calls.read_text().splitlines() if "--version" not in line]
    assert len(builds) == 1


def test_without_a_compiler_the_torch_path_serves_with_a_warning(tmp_path):
    code = "from gpu import native; print(native.kernel_set())"
    env = {"PATH": str(tmp_path), "PIPELINE_SERVE_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "torch"
    assert "no C compiler" in result.stdout + result.stderr


@needs_gcc
def test_the_install_step_fails_on_a_broken_build(tmp_path):
    """The Makefile's install step builds the kernels for real: a broken build stops it."""
    cc = tmp_path / "cc"
    cc.write_text(
        '#!/bin/sh\ncase "$*" in *--version*) exec gcc "$@";; esac\necho "cc: boom" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "PIPELINE_SERVE_CACHE": str(tmp_path / "cache")}
    env.pop("PIPELINE_SERVE_NATIVE", None)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "gpu.native"], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "cc: boom" in result.stderr
