"""`pipeline-bench ring` runs end to end and writes the JSON other tools read."""

from __future__ import annotations

import json

from perf.cli import main


def test_ring_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "ring.json"
    assert main(["ring", "--sizes", "64,70000", "--scale", "0.01", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["transport"] for r in rows} == {"ring", "mp_queue", "zmq_msgspec"}
    assert {r["size_bytes"] for r in rows} == {64, 70000}
    keys = {
        "msgs_per_s",
        "gb_per_s",
        "lat_busy_p50_us",
        "lat_busy_p99_us",
        "lat_sleep_p50_us",
        "lat_sleep_p99_us",
        "cpu_s",
    }
    for row in rows:
        assert keys <= set(row)
        assert row["msgs_per_s"] > 0 and row["lat_sleep_p50_us"] > 0
    assert "ring / zmq_msgspec" in capsys.readouterr().out
