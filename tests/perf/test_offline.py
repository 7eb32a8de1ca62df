"""pipeline-bench offline on the null model: throughput, per-stage figures, overhead, the Gantt chart."""

from __future__ import annotations

import json

import pytest

from perf.cli import main
from tests.stages.tiny import build_tiny_chat_model


def test_offline_dummy_reports_where_time_goes(tmp_path, capsys):
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "offline.json"
    code = main(
        [
            "offline",
            str(model),
            "--dummy",
            "--concurrency",
            "1,8",
            "--num-requests",
            "8",
            "--prompt-tokens",
            "20",
            "--max-tokens",
            "16",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "charts"),
        ]
    )
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 8]
    for run in runs:
        assert run["completed"] == 8 and run["output_tok_per_s"] > 0
        stages = run["stages"]
        # the stages', and the server's own: pipeline-bench's process drives the engine here
        assert set(stages) == {"render", "schedule", "execute", "detokenize", "server"}
        assert stages["render"]["spans"] == 8  # one render span per request
        assert stages["execute"]["spans"] >= 16  # at least one step per output token
        assert 0 < stages["schedule"]["busy_fraction"] <= 1
        overhead = run["overhead"]
        assert overhead["tokens"] == 8 * 16
        assert (
            overhead["overhead_us_per_token"] > 0 and overhead["cpu_s_forward"] == 0
        )  # null model
        # the stages and the process driving them add up to the whole
        assert overhead["total_us_per_token"] == pytest.approx(
            overhead["overhead_us_per_token"] + overhead["front_end_us_per_token"]
        )
        assert overhead["total_us_per_token"] == pytest.approx(
            overhead["cpu_s_total"] / overhead["tokens"] * 1e6
        )
        # Every output delivered is followed from its step's plan to its delivery (but those of
        # the last step, whose stages may record their spans after the window is read), and the
        # parts of each view add up to its whole.
        figures = run["attribution"]
        path, period = figures["path"], figures["period"]
        delivered = stages["server"]["spans"]
        assert delivered >= 16  # at least one output a token at c=1, merged ones aside
        assert delivered - run["concurrency"] <= path["count"] <= delivered
        for view in (path, period):
            parts = [v["mean_ms"] for k, v in view.items() if k not in ("count", "total")]
            assert min(parts) >= 0 and sum(parts) == pytest.approx(view["total"]["mean_ms"])
        assert path["deliver"]["mean_ms"] > 0 and path["plan"]["mean_ms"] > 0
        assert period["count"] >= 8
    # Eight requests in flight share steps: the mean batch grows with concurrency.
    assert runs[1]["stages"]["execute"]["mean_batch"] > runs[0]["stages"]["execute"]["mean_batch"]
    assert (tmp_path / "charts" / "stages_gantt.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "us per generated token" in printed
    assert "by process (us per token): " in printed and "schedule " in printed
    assert (
        "the time between two tokens" in printed and "server: chunk encoded and written" in printed
    )
