"""pipeline-bench serve --profile against `pipeline-serve dummy`: the trace and report paths end to end."""

from __future__ import annotations

import json
import os

from perf.cli import main
from tests.e2e.serving import running_server
from tests.server.live import free_port


def test_bench_profiles_a_dummy_server(tmp_path, capsys):
    port = free_port()
    with running_server(["dummy", "--enable-per-request-metrics"], port, tmp_path / "serve.log"):
        out = tmp_path / "bench.json"
        argv = [
            "serve",
            "--url",
            f"http://127.0.0.1:{port}",
            "--concurrency",
            "8",
            "--num-requests",
            "16",
            "--max-tokens",
            "32",
            "--prompt-tokens",
            "40",
            "--profile",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "charts"),
        ]
        assert main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 16 and run["errors"] == 0 and run["mean_output_tokens"] == 32
    assert set(run["stages"]) == {"render", "schedule", "execute", "detokenize", "server"}
    delivered = run["stages"]["server"]["spans"]  # but the last step's, maybe recorded late:
    assert delivered - 8 <= run["attribution"]["path"]["count"] <= delivered
    assert run["stages"]["render"]["spans"] == 16
    assert run["overhead"]["tokens"] == 16 * 32 and run["overhead"]["overhead_us_per_token"] > 0
    assert run["overhead"]["cpu_s_server"] > 0
    stages = run["request_stage_ms"]  # each request's own time in each stage, from its metrics
    assert {"render", "queue", "prefill", "decode", "detokenize"} <= set(stages)
    assert stages["decode"]["mean"] > 0
    charts = set(os.listdir(tmp_path / "charts"))
    assert {"ttft_cdf.png", "itl_cdf.png", "throughput.png", "gantt_concurrency_8.png"} <= charts
    assert "us per generated token" in capsys.readouterr().out
