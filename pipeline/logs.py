"""structlog set-up shared by every process: JSON when not on a terminal (journald), console otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def _stderr_logger(*args: Any) -> structlog.WriteLogger:
    """A logger on whatever sys.stderr is when the line is written (it may be swapped, by pytest
    or by a daemon's redirection, after logging was configured).

    Each line is one write, its newline included: the stages share one stderr, and under
    PYTHONUNBUFFERED (set by most container images) PrintLogger's print() writes a line and its
    newline separately, so two processes' lines could run together into one that is not JSON."""
    return structlog.WriteLogger(sys.stderr)


def configure_logging(log_format: str = "auto", level: str = "info", **bound: Any) -> None:
    """Configure structlog for this process and bind fields (e.g. stage=) to every line.

    log_format: "json", "console", or "auto" (console on a terminal, else JSON).
    """
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if bound:
        structlog.contextvars.bind_contextvars(**bound)
