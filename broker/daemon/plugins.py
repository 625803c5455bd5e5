"""The daemon's plugins and pre-start hooks, found through entry points (DESIGN §9).

``broker`` never imports its plugins; what ``pip install`` put in the environment decides what is
attached. A plugin that cannot be imported (a dependency missing or broken) refuses the start in
one line naming the plugin and the module, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

from broker.config import Config
from broker.invariant import StartupRefused
from broker.security.auth import TokenSource
from broker.store import Store

PLUGINS = "tidemark.plugins"      # attach(daemon): replication, tieredstore
PRESTART = "tidemark.prestart"    # hook(config, lock): a slave's bootstrap from its master


class PluginHost(Protocol):
    """What an ``attach(host)`` entry point gets: the daemon, seen only through these members.
    Plugins reach the store through its ports (``register_...``, ``set_redirect`` and the like;
    broker/ports.py) and read its state; they never assign its attributes
    (tests/test_plugin_boundaries.py)."""

    store: Store
    config: Config
    tokens: TokenSource | None
    on_start: list[Callable[[], None]]  # run once the daemon serves
    on_stop: list[Callable[[], None]]  # run before the store stops

    def add_blocking_servicer(self, add: Callable[[Any, Any], None], servicer: Any, streams: dict[str, bool]) -> None:
        """A servicer of plain (thread-blocking) methods on the daemon's asyncio server."""
        ...


def load(group: str) -> list[tuple[str, Callable[..., Any]]]:
    """Every entry point of ``group`` as (name, object), in the environment's order."""
    loaded = []
    for point in entry_points(group=group):
        try:
            loaded.append((point.name, point.load()))
        except ImportError as exc:
            missing = f"the module {exc.name!r} is not installed" if exc.name else str(exc)
            raise StartupRefused(f"plugin {point.name} ({point.value}) cannot be loaded: {missing}; "
                                 "install tidemark again with its dependencies (pip install tidemark)") from None
    return loaded
