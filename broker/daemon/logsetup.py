"""structlog set-up: console or JSON lines on stderr, level from ``log.level``."""

from __future__ import annotations

import logging
import sys

import structlog

from broker import logsafe

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "console") -> None:
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:  # exceptions never reach it (exc_info_to_fields): no renderer of local variables runs
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            logsafe.exc_info_to_fields,  # an exception: one bounded line, in both formats
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # one write per line (PrintLogger: two)
        cache_logger_on_first_use=False,
    )
