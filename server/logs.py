"""Logging for the server process: the project's structlog set-up, and the standard-library
records of Hypercorn and Quart sent through it, so that every line has one format."""

from __future__ import annotations

import logging

import structlog

from pipeline.logs import configure_logging

# The records' own loggers have filtered them already (Hypercorn's at --uvicorn-log-level).
_UNFILTERED = structlog.make_filtering_bound_logger(logging.NOTSET)
HTTP_SERVER_LOGGER = "hypercorn"


class _StructlogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger = structlog.wrap_logger(None, wrapper_class=_UNFILTERED)
        if record.exc_info:
            logger.log(record.levelno, record.getMessage(), exc_info=record.exc_info)
        else:
            logger.log(record.levelno, record.getMessage())


def _level(name: str) -> int:
    # uvicorn's "trace" is below debug; the standard library stops at debug
    return logging.DEBUG if name == "trace" else logging.getLevelNamesMapping()[name.upper()]


def configure_server_logging(
    log_format: str, log_level: str, http_log_level: str | None = None
) -> None:
    """structlog at `log_level`; Hypercorn's own lines at `http_log_level` (vLLM's
    --uvicorn-log-level), or at `log_level` when it is None."""
    configure_logging(log_format, log_level, stage="server")
    root = logging.getLogger()
    root.handlers[:] = [_StructlogHandler()]
    root.setLevel(_level(log_level))
    logging.getLogger(HTTP_SERVER_LOGGER).setLevel(
        logging.NOTSET if http_log_level is None else _level(http_log_level)
    )
