"""Standard-library records (Hypercorn's) come out through structlog, in the server's format."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from server.logs import configure_server_logging


def test_stdlib_records_are_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_server_logging("json", "info")
        logging.getLogger("hypercorn.error").info("Running on %s", "http://127.0.0.1:1")
        logging.getLogger("hypercorn.error").debug("not shown at info")
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "Running on http://127.0.0.1:1"
    assert record["level"] == "info"
    assert record["stage"] == "server"
