"""`pipeline-bench long-prompt` measures the streams before, during and after a long prompt's
prefill, for each share it is given (timings are the benchmark's business, not this test's)."""

from __future__ import annotations

import pytest

from perf.long_prompt_bench import LongPromptArgs, format_table, run_long_prompt_bench
from tests.stages.tiny import build_tiny_chat_model


@pytest.mark.slow
def test_each_share_reports_the_streams_and_the_long_prompt(tmp_path):
    args = LongPromptArgs(
        model_path=str(build_tiny_chat_model(tmp_path / "model")),
        shares=(0.33, 1.0),
        streams=2,
        prompt_tokens=300,
        stream_tokens=8,
        settle_s=1.5,
        long_prefill_token_threshold=64,
        threads=1,
    )
    report = run_long_prompt_bench(args)
    assert [row["long_prefill_share"] for row in report["rows"]] == [0.33, 1.0]
    for row in report["rows"]:
        assert row["streams_tok_s_before"] > 0 and row["streams_tok_s_after"] > 0
        assert row["long_prompt_ttft_s"] > 0
    assert "during/before" in format_table(report)
