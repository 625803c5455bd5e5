"""Exceptions in the daemon's log as one bounded line: type, message cut short, and the frames
the error passed through (file:line function), never a frame's local variables, which hold users'
messages, keys and tokens. Both log formats use it (``logsetup``), so a background thread's
failure is as bounded as a request's."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import MutableMapping
from typing import Any

SHOWN_MAX = 200     # characters of an exception message in the log
FRAMES_MAX = 12     # the innermost frames of a traceback


def bounded(text: str, limit: int = SHOWN_MAX) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def kind(exc: BaseException) -> str:
    """The exception's type as a reader finds it: ``ValueError``, ``struct.error``."""
    module = type(exc).__module__
    return type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"


def frames(exc: BaseException) -> str:
    """``file.py:123 fn < ...``: the innermost frames first, at most ``FRAMES_MAX``."""
    stack = traceback.extract_tb(exc.__traceback__)[-FRAMES_MAX:]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def exc_info_to_fields(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: ``exc_info`` (``log.exception``) becomes ``error``, ``message`` and
    ``where`` fields of the same line."""
    info = event.pop("exc_info", None)
    if info is True:
        info = sys.exc_info()
    if isinstance(info, BaseException):
        exc: BaseException | None = info
    elif isinstance(info, tuple) and len(info) == 3:
        exc = info[1]
    else:
        exc = None
    if exc is not None:
        event.setdefault("error", kind(exc))
        event["exception"] = bounded(str(exc))
        event["where"] = frames(exc)
    return event
