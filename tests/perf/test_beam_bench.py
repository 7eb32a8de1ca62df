"""pipeline-bench beam's pieces: the two kinds of request and the interleaved table."""

from __future__ import annotations

from perf import beam_bench


def test_both_kinds_ask_for_the_same_tokens_and_prompts_are_their_own():
    args = beam_bench.BeamBenchArgs()
    beam, sampling = beam_bench._body("beam", 3, args), beam_bench._body("sampling", 3, args)
    assert beam["use_beam_search"] and "use_beam_search" not in sampling
    for body in (beam, sampling):
        assert body["n"] == 4 and body["ignore_eos"] and body["max_tokens"] == 64
    assert beam["prompt"] == sampling["prompt"]
    assert beam_bench._body("beam", 4, args)["prompt"] != beam["prompt"]


def test_the_row_totals_tokens_over_time_and_compares_the_kinds():
    run = {"output_tokens": 256, "elapsed_s": 2.0, "output_tok_per_s": 128.0, "latency_p50_s": 2}
    slow = {**run, "elapsed_s": 4.0, "output_tok_per_s": 64.0, "latency_p50_s": 4}
    row = beam_bench._row(8, {"beam": [run, run], "sampling": [slow, run]})
    assert row["beam_tok_per_s"] == 128.0
    assert row["sampling_tok_per_s"] == 512 / 6
    assert row["ratio"] == 128.0 / (512 / 6)
    table = beam_bench.format_table({"width": 4, "max_tokens": 64, "rows": [row]})
    assert "| 8 | 128.0 | 85.3 | 1.50 |" in table
