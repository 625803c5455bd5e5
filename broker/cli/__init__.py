"""The ``tidemark`` command (DESIGN §8): ``main.py`` parses and dispatches; ``demo.py`` runs the
main job; ``verify.py`` is ``log verify``; ``node_process.py`` runs a daemon as a child process."""

from broker.cli.main import main

__all__ = ["main"]
