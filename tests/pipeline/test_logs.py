"""Log lines from the stage processes, which share one stderr, stay one JSON document a line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
import structlog
from pipeline.logs import configure_logging
configure_logging("json", stage="w{n}")
log = structlog.get_logger()
for i in range({lines}):
    log.info("a line", i=i, padding="x" * 200)
"""


def test_lines_of_processes_sharing_stderr_never_run_together(tmp_path):
    """Unbuffered stderr (PYTHONUNBUFFERED, as container images set it) is where a line and its
    newline written apart interleave with another process's line."""
    log_path = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines = 1500
    with open(log_path, "w") as shared:
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER.format(n=n, lines=lines)], stderr=shared, env=env
            )
            for n in range(4)
        ]
        assert [writer.wait(60) for writer in writers] == [0] * 4
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert sorted(record["stage"] for record in records) == sorted(
        f"w{n}" for n in range(4) for _ in range(lines)
    )
