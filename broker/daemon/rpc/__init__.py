"""The gRPC ``Broker`` service by area (data, topics, groups, pops); ``broker.daemon.service`` composes them."""
