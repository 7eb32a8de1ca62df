"""`pipeline-bench chaos` with template bombs and non-readers: requests whose own chat templates
loop for minutes or take a gigabyte are each refused with a 400 naming the limit, streams left
unread are each aborted, and the streams beside them, under stage kills, lose nothing and write
the text of an uninterrupted run."""

from __future__ import annotations

import asyncio

import pytest

from perf.chaos import ChaosArgs, run_chaos
from tests.stages.tiny import build_tiny_chat_model


@pytest.mark.slow
def test_template_bombs_are_refused_beside_streams_under_kills(tmp_path):
    args = ChaosArgs(
        model_path=str(build_tiny_chat_model(tmp_path / "model")),
        dummy=True,
        streams=3,
        kills=2,
        kill_interval_s=1.5,
        stages=("render", "detokenize"),
        max_tokens=8,
        num_prompts=4,
        template_bombs=2,
        non_readers=2,
    )
    report = asyncio.run(run_chaos(args))
    assert report["kills"] == 2 and report["completed"] > 0
    assert report["misnamed_kills"] == 0  # each kill blamed on the stage killed
    assert (report["lost"], report["wrong_text"]) == (0, 0), report["errors"]
    assert report["template_bombs_refused"] == 2
    assert report["non_readers_aborted"] == 2
    assert report["kv_blocks_held_after"] == 0 and not report["shm_names_left"]
