"""pipeline-bench model runs on a tiny model and writes the rows other tools read."""

from __future__ import annotations

import json

from perf.cli import main
from perf.model_bench import weight_bytes_read
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
