"""perf/gpu_check.sh's shell logic (a dry run, and the whole run on CPU on a tiny shape) and its
report against the issue's goals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf.gpu_report import build_report, format_markdown

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "gpu_check.sh"


def run_script(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )


def test_a_dry_run_names_every_gpu_step(tmp_path):
    result = run_script("--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    steps = [line.split("]")[0].lstrip("[") for line in lines]
    assert steps == [
        "tests", "model", "roofline_b1", "roofline_b64", "roofline_b256", "serve", "serve_c1",
        "serve_c256", "report",
    ]  # fmt: skip
    tests, model, serve = lines[0], lines[1], lines[5]
    # a prediction for each decode batch the model bench measures, at its context
    assert "roofline --model llama-3-8b --gpu h200 --batch 64 --context 512" in lines[3]
    assert "-m cuda" in tests and "tests/gpu/test_kernels.py" in tests
    assert "--device cuda --random-weights llama-3-8b" in model
    assert "--batches 1,64,256" in model and "--prefill-tokens 2048" in model
    assert "--random-weights llama-3-8b --device cuda" in serve
    assert "--concurrency 256" in lines[7]
    assert not (tmp_path / "gpu_check.json").exists()


def test_an_unknown_option_is_refused(tmp_path):
    result = run_script("--fast", out=tmp_path)
    assert result.returncode == 2 and "unknown option --fast" in result.stderr


@pytest.mark.slow
def test_the_whole_check_runs_on_cpu_and_writes_one_json_and_one_table(tmp_path):
    result = run_script("--cpu", out=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["ran"] and report["tests"]["failures"] == 0
    assert {r["mode"] for r in report["model"]["rows"]} == {"prefill", "decode"}
    assert [r["concurrency"] for r in report["serve"]] == [1, 4]
    assert all(r["completed"] > 0 for r in report["serve"])
    assert set(report["step_seconds"]) >= {"tests", "model", "serve_start", "serve_c1"}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| decode | 1 |" in table and "| 4 | 8 |" in table


def test_the_report_says_the_fraction_of_each_goal(tmp_path):
    (tmp_path / "model.json").write_text(
        json.dumps(
            {
                "device": "cuda",
                "bandwidth_gb_s": 4800.0,
                "rows": [
                    {"mode": "decode", "batch": 1, "context": 512, "weights": "bf16",
                     "tok_per_s": 150.0, "eager_tok_per_s": 100.0, "baseline_tok_per_s": 0.0,
                     "roofline_fraction": 0.56, "step_ms": 6.7},
                ],
            }
        )
    )  # fmt: skip
    run = {
        "concurrency": 256,
        "completed": 1024,
        "output_tok_per_s": 10_000.0,
        "ttft_ms": {"p50": 80.0},
        "itl_ms": {"p50": 20.0, "p99": 40.0},
    }
    (tmp_path / "serve_c256.json").write_text(json.dumps({"runs": [run]}))
    report = build_report(tmp_path)
    assert report["goals"]["batch1_roofline_goal_reached"] == pytest.approx(0.8)
    assert report["goals"]["c256_throughput_goal_reached"] == pytest.approx(0.8)
    table = format_markdown(report)
    assert "CUDA tests: did not run" in table
    assert "| decode | 1 | 512 | 150 | 100 | 1.50 | 6.70 | - | - | 56% |" in table
    assert "0.80 of the 12,500 goal" in table


def test_the_report_sets_the_roofline_prediction_beside_each_decode_step(tmp_path):
    from perf.roofline import main as roofline_main

    rows = [
        {"mode": "decode", "batch": b, "context": 512, "weights": "bf16", "tok_per_s": 1.0,
         "eager_tok_per_s": None, "baseline_tok_per_s": 0.0, "roofline_fraction": 0.5,
         "step_ms": ms}
        for b, ms in ((1, 9.0), (64, 12.0))
    ]  # fmt: skip
    (tmp_path / "model.json").write_text(
        json.dumps({"device": "cuda", "bandwidth_gb_s": 4800.0, "rows": rows})
    )
    assert (
        roofline_main(
            str(tmp_path / "roofline_b64.json"),
            model="llama-3-8b",
            gpu="h200",
            batch=64,
            context=512,
        )
        == 0
    )
    predicted = json.loads((tmp_path / "roofline_b64.json").read_text())["step_s"] * 1e3
    report = build_report(tmp_path)
    decode1, decode64 = report["model"]["rows"]
    assert "predicted_step_ms" not in decode1  # no prediction for it: none made
    assert decode64["predicted_step_ms"] == pytest.approx(predicted)
    table = format_markdown(report)
    assert f"| 12.00 | {predicted:.2f} | {predicted / 12.0:.2f} | 50% |" in table
    assert "`pipeline-bench roofline --gpu h200`" in table
