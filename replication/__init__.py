"""Master/slave replication (DESIGN §4), plugged into the daemon through ``replication.plugin``.

- ``master``: the ``Replication`` stream servicer: handshake, divergence point, log shipping,
  replica acks, the in-sync set and the confirm offset it yields.
- ``follower``: the slave's side: connect, truncate to the divergence point, append raw bytes,
  fsync, acknowledge; reconnect with backoff.
- ``roles``: promote and demote.
"""
