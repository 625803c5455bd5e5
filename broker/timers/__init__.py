"""Timer (delayed) messages: records, timer log, rolling wheel, snapshots, firing (DESIGN §5)."""
