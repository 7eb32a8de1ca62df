"""Logging for the server process: the project's structlog set-up, and the standard-library
records of Hypercorn and Quart sent through it, so that every line has one format."""

from __future__ import annotations

import logging

import structlog

from pipeline.logs import configure_logging


class _StructlogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger = structlog.get_logger(record.name)
        if record.exc_info:
            logger.log(record.levelno, record.getMessage(), exc_info=record.exc_info)
        else:
            logger.log(record.levelno, record.getMessage())


def configure_server_logging(log_format: str, log_level: str) -> None:
    configure_logging(log_format, log_level, stage="server")
    root = logging.getLogger()
    root.handlers[:] = [_StructlogHandler()]
    root.setLevel(logging.getLevelNamesMapping()[log_level.upper()])
