"""pipeline-bench serve --profile against `pipeline-serve dummy`: the trace and report paths end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from perf.cli import main
from tests.e2e.test_openai_tiny import ROOT, http_get
from tests.server.live import free_port


def test_bench_profiles_a_dummy_server(tmp_path, capsys):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "dummy",
                "--port",
                str(port),
                "--log-format",
                "json",
                "--enable-per-request-metrics",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, log_path.read_text()[-3000:]
                try:
                    if http_get(port, "/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.1)
            out = tmp_path / "bench.json"
            code = main(
                [
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
            )
            assert code == 0
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 16 and run["errors"] == 0 and run["mean_output_tokens"] == 32
    assert set(run["stages"]) == {"render", "schedule", "execute", "detokenize"}
    assert run["stages"]["render"]["spans"] == 16
    assert run["overhead"]["tokens"] == 16 * 32 and run["overhead"]["overhead_us_per_token"] > 0
    assert run["overhead"]["cpu_s_server"] > 0
    stages = run["request_stage_ms"]  # each request's own time in each stage, from its metrics
    assert {"render", "queue", "prefill", "decode", "detokenize"} <= set(stages)
    assert stages["decode"]["mean"] > 0
    charts = set(os.listdir(tmp_path / "charts"))
    assert {"ttft_cdf.png", "itl_cdf.png", "throughput.png", "gantt_concurrency_8.png"} <= charts
    assert "us per generated token" in capsys.readouterr().out
