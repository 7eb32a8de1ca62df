"""pipeline-bench dp's pieces: the shared-prefix workload, the per-engine cache counters of
/metrics, and the cache-aware over round-robin ratios."""

from __future__ import annotations

from perf import dp_bench

METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 800.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_every_request_starts_with_one_of_the_groups_prefixes():
    args = dp_bench.DpBenchArgs(groups=3, num_requests=30, prefix_words=50)
    rows = dp_bench.workload(args, seed=1)
    assert rows == dp_bench.workload(args, seed=1) and rows != dp_bench.workload(args, seed=2)
    systems = {row["messages"][0]["content"] for row in rows}
    assert len(systems) == 3 and all(len(s.split()) == 52 for s in systems)
    questions = {row["messages"][1]["content"] for row in rows}
    assert len(questions) == 30


def test_the_hit_rate_comes_from_the_counters_deltas_over_every_engine():
    after = dp_bench.parse_cache_counters(METRICS)
    assert after == {0: (1000.0, 800.0), 1: (600.0, 0.0)}
    before = {0: (500.0, 400.0), 1: (100.0, 0.0)}
    summary = dp_bench.cache_summary(before, after)
    assert summary == {"prefix_cache_hit_rate": 400 / 1000, "prompt_tokens_per_engine": [500, 500]}


def test_ratios_pair_each_repeat_and_the_table_shows_them():
    runs = [
        {"policy": "cache_aware", "repeat": 0, "prefix_cache_hit_rate": 0.8, "request_per_s": 3.0,
         "ttft_p50_ms": 100.0, "prompt_tokens_per_engine": [1, 2], "output_tok_per_s": 24.0,
         "errors": 0},
        {"policy": "round_robin", "repeat": 0, "prefix_cache_hit_rate": 0.4, "request_per_s": 2.0,
         "ttft_p50_ms": 200.0, "prompt_tokens_per_engine": [2, 1], "output_tok_per_s": 16.0,
         "errors": 0},
    ]  # fmt: skip
    ratios = dp_bench.ratios(runs)
    assert ratios == {"prefix_cache_hit_rate": 2.0, "request_per_s": 1.5, "ttft_p50_ms": 0.5}
    table = dp_bench.format_table({"runs": runs, "ratios": ratios})
    assert "| cache_aware | 1 | 80.0% | 1 / 2 |" in table and "prefix_cache_hit_rate 2.00x" in table
