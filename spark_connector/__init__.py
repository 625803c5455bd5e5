"""spark_connector: not implemented yet (see README status table)."""
