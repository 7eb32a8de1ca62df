"""What an engine reports between its start and its first request: the KV cache's size (vLLM's
vllm:num_blocks reads the cache from the start, not 0 until schedule's first step)."""

from __future__ import annotations


def test_a_fresh_engine_reports_its_whole_cache_free(pipeline):
    engine, _ = pipeline()
    stats = engine.stats()
    assert engine.num_blocks > 0
    assert stats["num_blocks"] == stats["num_free_blocks"] == engine.num_blocks
    assert stats["kv_cache_usage_perc"] == 0
