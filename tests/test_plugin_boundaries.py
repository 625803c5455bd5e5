"""Plugins meet the broker only through its ports (DESIGN §9, issue 36), checked on their source as
the import contracts check their imports: no plugin assigns an attribute of the store or reads an
underscore member of an object not its own, every entry point takes the typed ``PluginHost``, and
the store members plugins reach are the ones listed here: a new reach into the store is a decision
made in this file, not an accident of ``Any``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("replication", "tieredstore", "spark_connector")
# store.<member> reached by plugins: the ports (register_*, set_redirect, adopt_cluster,
# raise_metadata_fence, set_role, fence) and the state they read, each a typed component
SURFACE = frozenset({
    "adopt_cluster", "appender", "check_free_space", "closing", "data_dir", "dispatcher", "epoch", "epochs",
    "fence", "fenced_reason", "flush_offsets", "identity", "incidents", "log", "master_address", "metadata_fence", "permit",
    "raise_metadata_fence", "reads", "register_cold_reader", "register_confirm_rule",
    "register_master_silence", "register_placement", "register_retention_floor", "register_role_controller",
    "register_role_listener", "register_txn_peers",
    "register_status_provider", "retention", "role", "set_redirect", "set_role", "views", "wait_metadata_applied",
    "watermarks", "writes",
})


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for package in PLUGINS:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _is_store(node: ast.expr) -> bool:
    """``store`` or ``<anything>.store``."""
    return (isinstance(node, ast.Name) and node.id == "store") or (isinstance(node, ast.Attribute) and node.attr == "store")


def test_plugins_never_assign_store_attributes() -> None:
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and _is_store(t.value)]
    assert not found, found


def test_plugins_never_touch_underscore_members_of_others() -> None:
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
             for path, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
             and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not found, found


def test_entry_points_take_the_typed_host() -> None:
    attaches = [(path, node) for path, tree in _sources() for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.name == "attach"]
    assert len(attaches) == 2, [str(p) for p, _ in attaches]
    for path, fn in attaches:
        assert fn.args.args[0].annotation is not None and ast.unparse(fn.args.args[0].annotation) == "PluginHost", path


def test_the_store_members_plugins_reach_are_the_listed_ones() -> None:
    reached = {node.attr for _, tree in _sources() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and _is_store(node.value)}
    assert reached <= SURFACE, sorted(reached - SURFACE)
    assert SURFACE - reached == set(), f"listed but no longer reached (remove them): {sorted(SURFACE - reached)}"
