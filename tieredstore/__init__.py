"""tieredstore: not implemented yet (see README status table)."""
