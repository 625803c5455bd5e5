"""``python -m broker.cli``: the ``tidemark`` command."""

import sys

from broker.cli import main

sys.exit(main())
