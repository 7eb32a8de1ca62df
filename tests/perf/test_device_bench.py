"""pipeline-bench model on a random-weight shape, with --device and a given roofline bandwidth."""

from __future__ import annotations

import json

import pytest

from perf.cli import main

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def test_model_bench_on_random_weights(tmp_path, capsys):
    config = tmp_path / "shape" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(SHAPE))
    out = tmp_path / "model.json"
    argv = [
        "model", "--random-weights", str(config), "--device", "cpu", "--weights", "bf16",
        "--batches", "1,4", "--context", "32", "--prefill-tokens", "48", "--steps", "2",
        "--peak-bandwidth-gb-s", "1000", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["bandwidth_gb_s"] == 1000
    decode = [r for r in report["rows"] if r["mode"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 4]
    for row in decode:
        # The roofline is the bytes a step reads over the given bandwidth, per measured second.
        ideal_s = row["bytes_per_step"] / 1000e9
        assert row["roofline_fraction"] == pytest.approx(ideal_s / (row["step_ms"] / 1e3))
        assert row["eager_tok_per_s"] is None  # CPU steps are eager: there is no graph to compare
    assert "1000.0 GB/s" in capsys.readouterr().out


def test_random_weights_replace_the_model(tmp_path):
    with pytest.raises(SystemExit):
        main(["model", "some.gguf", "--random-weights", "llama-3-8b", "--device", "cpu"])
