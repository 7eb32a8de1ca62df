"""pipeline-bench lora's pieces: the random adapters it writes are ones the server serves, and the
goal table says whether the median pair met it."""

from __future__ import annotations

from perf import lora_bench
from stages.lora import read_adapter
from stages.text.checkpoint import load_model_config
from tests.stages.tiny import build_tiny_chat_model


def test_written_adapters_pass_the_servers_checks(tmp_path):
    base = build_tiny_chat_model(tmp_path / "base")
    paths = lora_bench.write_adapters(str(base), str(tmp_path / "adapters"), count=2, rank=8)
    model = load_model_config(str(base))
    for path in paths:
        spec = read_adapter(path, model, max_rank=8)
        assert spec.rank == 8 and spec.scaling == 2.0
        assert spec.layers == frozenset(range(model.num_layers))
        assert len(spec.target_modules) == 7


def test_table_reports_each_pair_and_the_median_against_the_goal():
    rows = [
        {"repeat": i, "base_tok_per_s": 100.0, "lora_tok_per_s": v, "ratio": v / 100.0}
        | {"base_itl_p50_ms": 10.0, "lora_itl_p50_ms": 12.0, "errors": 0}
        for i, v in enumerate((90.0, 80.0, 70.0))
    ]
    report = {"concurrency": 32, "num_adapters": 4, "rank": 8, "threads": 2, "rows": rows}
    report |= {"median_ratio": 0.8, "goal": lora_bench.GOAL, "met": False}
    table = lora_bench.format_table(report)
    assert "| 2 | 100.0 | 80.0 | 0.80 | 10 / 12 | 0 |" in table
    assert "median adapters / base: 0.80 (goal >= 0.85: missed)" in table
