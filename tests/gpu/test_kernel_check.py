"""`pipeline-bench kernels`: every Triton kernel compiled for sm_80 and sm_90 without a GPU.

CI catches here what the interpreter accepts but a GPU's compiler rejects or runs badly: a
compile error, a register spill, a CTA that does not fit an SM, a grid over CUDA's limits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf import kernel_check

REPO = Path(__file__).resolve().parents[2]
KERNELS = {
    "_paged_decode_kernel",
    "_paged_decode_reduce_kernel",
    "_paged_prefill_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_mul_kernel",
    "_write_kv_kernel",
}


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, list]:
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path_factory.mktemp("kernels") / "kernels.json"
    # Compiling, not interpreting: the interpreter is chosen when triton is first imported.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "perf.cli", "kernels", "--json", str(out)],
        cwd=REPO,
        env=env | {"TRITON_DEFAULT_FP_FUSION": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, json.loads(out.read_text()) if out.exists() else []


@pytest.mark.slow
def test_every_kernel_compiles_for_both_architectures_without_spills(check) -> None:  # type: ignore[no-untyped-def]
    result, rows = check
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    shapes = {shape.name for shape in kernel_check.default_shapes()}
    covered = {(r["kernel"], r["arch"], r["shape"]) for r in rows}
    assert covered == {(k, a, s) for k in KERNELS for a in (80, 90) for s in shapes}
    assert all(r["ok"] and r["spill_bytes"] == 0 and r["ctas_per_sm"] > 0 for r in rows)
    assert "0 rows fail" in result.stdout


@pytest.mark.slow
def test_16_bit_attention_runs_on_tensor_cores(check) -> None:  # type: ignore[no-untyped-def]
    _result, rows = check
    attention = [
        v
        for r in rows
        if r["kernel"] in ("_paged_decode_kernel", "_paged_prefill_kernel")
        for v in r["variant_list"]
    ]
    sixteen_bit = [v for v in attention if " fp32/" not in v["first_label"]]
    assert sixteen_bit and all(v["tensor_cores"] for v in sixteen_bit)


@pytest.mark.slow
def test_the_reduce_is_bounded_at_a_million_token_context(check) -> None:  # type: ignore[no-untyped-def]
    # The check's steps include decodes at a 1M-token max_model_len. The split count is capped
    # and the reduce merges partitions a chunk at a time, so every variant it meets is small
    # (the per-head design before took 255 registers and spilled 15.5 KB there).
    assert any(
        step.max_model_len == kernel_check.LONG_CONTEXT
        for step in kernel_check.steps_for(kernel_check.SMOLLM2)
    )
    _result, rows = check
    reduce = [r for r in rows if r["kernel"] == "_paged_decode_reduce_kernel"]
    assert reduce and max(r["registers"] for r in reduce) <= 64


def test_the_check_refuses_an_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="choose from"):
        kernel_check.main((75,), (), None)


def test_occupancy_follows_registers_warps_and_shared_memory() -> None:
    from gpu.kernels.aot import ctas_per_sm

    assert ctas_per_sm(90, 32, 4, 0) == 16  # 64 warps an SM
    assert ctas_per_sm(90, 128, 4, 0) == 4  # 128 registers x 128 threads: 4 CTAs fill 64k
    assert ctas_per_sm(90, 255, 4, 0) == 2
    assert ctas_per_sm(80, 32, 4, 100 * 1024) == 1  # 164 KB of shared memory on an A100
    assert ctas_per_sm(90, 32, 4, 100 * 1024) == 2  # 228 KB on an H100


STARTUP_COVERS_A_MIXED_RUN = """
import torch
from perf import kernel_check as k
shapes = k.default_shapes()
cases = [(s, torch.bfloat16, torch.bfloat16) for s in shapes]
cases += [(shapes[0], act, cache) for act, cache in k.dtype_pairs(90) if (act, cache) != cases[0][1:]]
for shape, act, cache in cases:
    print(shape.name, act, cache, *k.variants_outside_startup(90, shape, act, cache))
"""


@pytest.mark.slow
def test_a_mixed_run_compiles_nothing_after_startup() -> None:
    # gpu.kernels.startup compiles one launch of each kernel; then decodes of every batch size
    # 1-256 at several context bounds up to 1M, prefill chunks of 1-8192 tokens and chunks mixed
    # with decodes meet no variant outside that set, for every shape and, on SmolLM2, every
    # activation/cache dtype pair.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", STARTUP_COVERS_A_MIXED_RUN],
        cwd=REPO,
        env=env | {"TRITON_DEFAULT_FP_FUSION": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.split("\n")[:-1]
    assert len(lines) == len(kernel_check.default_shapes()) + len(kernel_check.dtype_pairs()) - 1
    for line in lines:
        startup, steps, new = map(int, line.split()[-3:])
        # Seven kernels, the norm with and without the residual add.
        assert (startup, new) == (len(KERNELS) + 1, 0), line
        assert steps > 256, line
