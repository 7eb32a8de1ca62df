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


@pytest.mark.parametrize(
    ("http_log_level", "shown"),
    [
        ("warning", ["warning from hypercorn"]),
        ("debug", ["debug from hypercorn", "warning from hypercorn"]),
    ],
)
def test_uvicorn_log_level_sets_the_http_servers_own(
    capsys: pytest.CaptureFixture[str], http_log_level: str, shown: list[str]
) -> None:
    """--uvicorn-log-level: Hypercorn's lines at their own level, above or below --log-level;
    the server's own lines keep --log-level."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_server_logging("json", "info", http_log_level)
        logging.getLogger("hypercorn.error").debug("debug from hypercorn")
        logging.getLogger("hypercorn.error").warning("warning from hypercorn")
        logging.getLogger("quart.app").debug("debug from quart")
        structlog.get_logger("server").debug("debug from the server")
        structlog.get_logger("server").info("info from the server")
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("hypercorn").setLevel(logging.NOTSET)
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    assert [json.loads(line)["event"] for line in lines] == [*shown, "info from the server"]
