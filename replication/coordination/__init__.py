"""Automatic failover on etcd (DESIGN §11): leases, the leader key, the epoch and the in-sync set.

``records.py`` is the key layout and what each key holds; ``etcd.py`` the few etcd operations we
use (one transaction each); ``coordinator.py`` the loop that renews the lease, grants the write
permit, elects, follows and shrinks or grows the in-sync set. Spec: docs/formats/etcd-keys.md.
"""
