"""The daemon's plugins and pre-start hooks, found through entry points (DESIGN §9).

``broker`` never imports its plugins; what ``pip install`` put in the environment decides what is
attached. A plugin that cannot be imported (a dependency missing or broken) refuses the start in
one line naming the plugin and the module, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from broker.invariant import StartupRefused

PLUGINS = "tidemark.plugins"      # attach(daemon): replication, tieredstore
PRESTART = "tidemark.prestart"    # hook(config, lock): a slave's bootstrap from its master


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
