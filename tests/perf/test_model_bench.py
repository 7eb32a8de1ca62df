"""pipeline-bench model runs on a tiny model and writes the rows other tools read."""

from __future__ import annotations

import json

import pytest

from perf.cli import main
from perf.model_bench import weight_bytes_read
from tests.cpu_levels import NATIVE_LEVELS
from tests.stages.tiny import build_tiny_chat_model


def test_model_bench_rows(tmp_path, capsys):
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "model.json"
    argv = [
        "model",
        str(model),
        "--weights",
        "fp32,int4",
        "--batches",
        "1,4",
        "--context",
        "32",
        "--prefill-tokens",
        "48",
        "--steps",
        "2",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mode"], r["weights"], r["batch"]) for r in rows} == {
        ("prefill", "fp32", 1),
        ("decode", "fp32", 1),
        ("decode", "fp32", 4),
        ("prefill", "int4", 1),
        ("decode", "int4", 1),
        ("decode", "int4", 4),
    }
    for row in rows:
        assert row["tok_per_s"] > 0 and row["baseline_tok_per_s"] > 0
        assert set(row) >= {
            "mode",
            "batch",
            "context",
            "weights",
            "tok_per_s",
            "baseline_tok_per_s",
            "roofline_fraction",
        }
        if row["mode"] == "decode":
            assert row["roofline_fraction"] > 0
    assert "memory read bandwidth" in capsys.readouterr().out


def test_bytes_read_follow_the_path_the_rows_take(tmp_path):
    from gpu.runner import ModelRunner, RunnerConfig

    model = build_tiny_chat_model(tmp_path / "model")
    runner = ModelRunner.from_path(
        str(model), RunnerConfig(quantization="int4", kv_cache_bytes=1 << 20)
    )
    thin, thick = weight_bytes_read(runner.model, 1), weight_bytes_read(runner.model, 64)
    assert thin < thick  # int4 codes for a decode, the dense bf16 copy for a big batch


def test_verify_rows_time_steps_that_verify_drafts(tmp_path, capsys):
    """--verify-drafts K adds, per batch, a step where every sequence verifies K drafts, with its
    cost in decode steps; and that step does verify them: drafts equal to the greedy tokens are
    all accepted, and the bonus token comes out."""
    from dataclasses import replace

    import numpy as np

    from gpu.runner import ModelRunner, RunnerConfig
    from perf.model_bench import verify_batch

    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "model.json"
    argv = ["model", str(model), "--weights", "fp32", "--batches", "1,4", "--context", "32"]
    argv += ["--steps", "2", "--no-baseline", "--verify-drafts", "2", "--json", str(out)]
    assert main(argv) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["mode"] == "verify2"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["decode_steps"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "verify2 fp32 batch 4: one step costs" in capsys.readouterr().out

    runner = ModelRunner.from_path(str(model), RunnerConfig(kv_cache_bytes=1 << 22))
    step = verify_batch(runner, 4, 32, 2, np.random.default_rng(0))
    inputs = step.input_ids.reshape(4, 3).copy()
    for drafted in range(2):  # put each greedy token in as the next draft
        got = runner.step(replace(step, input_ids=inputs.reshape(-1)))
        starts = np.cumsum(got.num_tokens) - got.num_tokens
        inputs[:, drafted + 1] = got.token_ids[starts + drafted]
        runner.free(np.arange(4))
    got = runner.step(replace(step, input_ids=inputs.reshape(-1)))
    assert got.num_tokens.tolist() == [3, 3, 3, 3]  # both drafts accepted, and the bonus


@pytest.mark.skipif(not NATIVE_LEVELS, reason="needs a C compiler")
def test_model_bench_measures_each_cpu_kernel_level_in_one_run(tmp_path, capsys):
    """--cpu-isa runs the same points at each level asked for, and every row names its level:
    how AVX2 speed is measured on an AVX-512 machine."""
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "model.json"
    levels = sorted({NATIVE_LEVELS[0], NATIVE_LEVELS[-1]})
    argv = ["model", str(model), "--weights", "int4", "--batches", "2", "--context", "16"]
    argv += ["--prefill-tokens", "16", "--steps", "1", "--no-baseline"]
    assert main([*argv, "--cpu-isa", ",".join(levels), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["kernels"], r["mode"]) for r in rows) == sorted(
        (level, mode) for level in levels for mode in ("prefill", "decode")
    )
    table = capsys.readouterr().out
    assert all(f"decode   {level}" in table for level in levels)
    # Each level's quantized linears against their bounds: a GEMV's bytes/s against a read of its
    # weights, a GEMM's int8 MAC/s against the dot instruction's peak (none in the portable build)
    kernels = json.loads(out.read_text())["kernels"]
    for level in levels:
        mine = [r for r in kernels if r["kernels"] == level]
        kinds = {r["kernel"] for r in mine}
        assert kinds >= {"Q4Linear model.layers.*.mlp.down_proj", "all, in the model's order"}
        assert {r["rows"] for r in mine} == {1, 16}
        for r in mine:
            assert r["achieved"] > 0 and r["unit"] == ("B/s" if r["rows"] == 1 else "MAC/s")
            assert (r["bound"] > 0) == (r["rows"] == 1 or level != "portable")
    assert "of bound" in table
