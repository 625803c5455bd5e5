"""Consumer groups (DESIGN §12): subscribe-mode membership and assignment on the master."""
