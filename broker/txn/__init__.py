"""Transactions on the master (DESIGN §14): the service that begins and ends them, the sweeper of
their timeouts, and the check-back streams. Their state is a view of the log (views/transactions.py)."""
