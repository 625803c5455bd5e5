"""Tidemark broker: commit log, views, recovery, gRPC service, client and CLI.

The face of the package: ``broker.client`` (``BrokerClient``, ``Message``) for applications,
``broker.store.Store`` for the daemon, ``broker.cli`` for the ``tidemark`` command.
"""
