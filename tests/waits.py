"""How tests wait: until a condition holds (``wait_until``), or while one must keep holding for a
bounded time (``holds_for``: "nothing happens" checks). No test sleeps a fixed time and hopes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.05


def wait_until(probe: Callable[[], T], timeout_s: float = 30.0, what: str = "", *, poll_s: float = POLL_S,
               accept: Callable[[T], object] = bool, observe: Callable[[], object] | None = None,
               transient: Callable[[Exception], bool] | None = None) -> T:
    """Call ``probe`` until ``accept`` (by default: truth) takes its result, and return that result.

    After ``timeout_s`` it fails with an AssertionError naming ``what`` and the last observation:
    ``observe()`` when given (say, a status), else the probe's last result. An exception for which
    ``transient`` is true counts as "not yet" (and is the observation); any other propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = probe()
        except Exception as exc:
            if transient is None or not transient(exc):
                raise
            last: object = exc
        else:
            if accept(value):
                return value
            last = value
        left = deadline - time.monotonic()
        if left <= 0:
            if observe is not None:
                try:
                    last = observe()
                except Exception as exc:  # the message must still say what was awaited
                    last = exc
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or 'the condition'}; "
                                 f"last observed: {last!r}")
        time.sleep(min(poll_s, left))


def holds_for(probe: Callable[[], object], seconds: float, what: str = "", *, poll_s: float = POLL_S) -> int:
    """Check ``probe`` again and again for ``seconds``; fail at the first falsy result, naming ``what``
    and that result (a probe may also raise its own AssertionError). Returns how many checks passed."""
    start = time.monotonic()
    checks = 0
    while True:
        value = probe()
        if not value:
            raise AssertionError(f"{what or 'the condition'} stopped holding after {time.monotonic() - start:.2f} s "
                                 f"({checks} checks passed): {value!r}")
        checks += 1
        left = start + seconds - time.monotonic()
        if left <= 0:
            return checks
        time.sleep(min(poll_s, left))
