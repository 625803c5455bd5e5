"""Spark-free tests of the connector's tlsCaFile / tokenFile options against a TLS + token daemon."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from spark_connector import OptionError, QueueRange, TidemarkDataSource, parse_options, read_partition
from spark_connector.schema import spark_schema
from tests.certs import CA
from tests.procs import DaemonProcess, free_port

pytestmark = pytest.mark.xdist_group("spark")  # make test's workers: one Spark JVM at a time

TOKEN = "spark-token-0123456789abcdef"


def test_options_are_parsed_and_kept_for_both_modes() -> None:
    """tlsCaFile and tokenFile (any case) survive for_batch/for_streaming; an empty path names the option."""
    o = parse_options({"broker": "h:1", "subscribe": "t", "TLSCAFILE": "/ca.pem", "tokenfile": "/tok"})
    for mode in (o.for_batch(), o.for_streaming()):
        assert (mode.tls_ca_file, mode.token_file) == ("/ca.pem", "/tok")
    with pytest.raises(OptionError, match="'tokenFile'"):
        parse_options({"broker": "h:1", "subscribe": "t", "tokenFile": " "})


def test_reader_plans_and_reads_over_tls_with_a_token(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Planning and read_partition (what executors run) connect with TLS and the token; without them they fail."""
    ca = CA.create(tmp_path, "ca")
    leaf = ca.issue("server")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    d = spawn("node", credentials=grpc.ssl_channel_credentials(Path(ca.cert).read_bytes()), config={
        "tls.cert_file": leaf.cert, "tls.key_file": leaf.key, "replication.listen": f"127.0.0.1:{free_port()}",
        "auth.token_file": str(token_file), "auth.require_for_reads": "true"})
    with BrokerClient(d.address, tls_ca_file=ca.cert, token=TOKEN) as c:
        c.create_topic("t", queues=2)
        c.send("t", [Message(body=b"%d" % i) for i in range(10)], ack="flush")
    options = {"broker": d.address, "subscribe": "t", "tlsCaFile": ca.cert, "tokenFile": str(token_file)}
    reader = TidemarkDataSource(options).reader(spark_schema(False))
    parts = [pickle.loads(pickle.dumps(p)) for p in reader.partitions()]  # as executors receive them
    assert all(isinstance(p, QueueRange) and p.tls_ca_file == ca.cert for p in parts)
    rows = sum(b.num_rows for p in parts for b in read_partition(p))
    assert rows == 10
    p = parts[0]
    assert isinstance(p, QueueRange)
    no_token = QueueRange(p.brokers, p.topic, p.queue_id, p.start, p.end, False, True, ca.cert, None)
    with pytest.raises(BrokerError, match="UNAUTHENTICATED"):
        list(read_partition(no_token))
    plaintext = QueueRange(p.brokers, p.topic, p.queue_id, p.start, p.end, False, True, None, str(token_file))
    with pytest.raises(BrokerError, match="UNAVAILABLE"):
        list(read_partition(plaintext))
