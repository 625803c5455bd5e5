"""Shared fixtures: real daemon processes on loopback ports, each in its own data directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker.procs import DaemonProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def spawn(tmp_path: Any) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons (``spawn(name, config=..., env=...)``); all are killed at teardown."""
    started: list[DaemonProcess] = []

    def make(name: str = "node", *, start: bool = True, **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(str(tmp_path / name), **kwargs)
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in started:
        d.kill9()


@pytest.fixture
def daemon(spawn: Callable[..., DaemonProcess]) -> DaemonProcess:
    return spawn("node")
