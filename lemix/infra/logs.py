"""structlog setup shared by every service's `__main__` (called once, at start)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_level: str = "info", log_format: str = "console") -> None:
    """structlog to stderr at `log_level`: console lines or one JSON object per line.

    stdout stays free for the one `SERVING ... address=HOST:PORT` line that
    `lemix up` reads.
    """
    renderer: structlog.types.Processor
    tracebacks: list[structlog.types.Processor] = []
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
        tracebacks = [structlog.processors.dict_tracebacks]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[log_level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
