"""Python client: ``from broker.client import BrokerClient, Message``.

Sends are batched per queue and encoded once; each batch carries this client's random producer
id and a per-queue sequence, so a retried request (transient failure) lands exactly once.
Pulled batches decode lazily: ``pull()`` returns a sequence whose items are built on access.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import crc32c
import grpc

from broker import alloc
from broker.client.consumer import Consumer
from broker.client.errors import BrokerError, error_for, from_rpc_error
from broker.client.local_reads import LocalPullResponse, SegmentFiles, mark_not_local, not_local
from broker.client.messages import Message, PoppedMessage, PopResult, PullResult, Receipt, Receipts, SendGroup, encode_messages
from broker.client.pull_wire import parse_pull_response
from broker.errors import shown
from broker.logformat import batch as bf
from broker.logformat.timer_props import TIMER_TOPIC
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

# replica is sent as 0 (ACK_UNSPECIFIED), which every server version reads as replica
ACKS = {"replica": pb.ACK_UNSPECIFIED, "leader": pb.ACK_LEADER, "flush": pb.ACK_FLUSH}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# For Send the request is idempotent (producer id + sequences), so an unknown outcome is retried too.
SEND_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
SEQUENCE_MAX = 0x7FFFFFFF - (1 << 24)  # a new producer id before the 31-bit sequence runs out
RETRIES_MAX = 5  # attempts with a single address; with several, retries go on until the call's deadline
CONNECT_S = 1.0  # with several addresses, a node that takes no connection within this is skipped
BACKOFF_MIN_S = 0.02
BACKOFF_MAX_S = 0.1
FAILED_MEMORY_S = 5.0  # a node that failed us this lately is tried last
# a redirect to a node that failed us this lately is not followed (the node naming it may not have
# noticed yet); after that it is: a node back from a restart would otherwise wait FAILED_MEMORY_S
REDIRECT_DOUBT_S = 1.0
# a ping every 500 ms, answered within 500 ms: a call on a node that falls silent ends within ~1 s
KEEPALIVE = [("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 500),
             ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
             # a BDP ping in flight (60 s timeout by default) would hold the keepalive pings back
             ("grpc.http2.bdp_probe", 0), ("grpc.http2.ping_timeout_ms", 500)]
MESSAGE_BYTES_MAX = 256 << 20
T = TypeVar("T")


@dataclass
class _Producer:
    producer_id: int = field(default_factory=lambda: random.getrandbits(63) or 1)
    sequences: dict[tuple[str, int], int] = field(default_factory=dict)


def _answered(exc: grpc.RpcError) -> bool:
    """The node itself answered (a refusal after the append, outcome unknown): it is alive."""
    try:
        trailing = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:
        return False
    return any(key == "tidemark-outcome" for key, _ in trailing)


def _redirect(exc: grpc.RpcError) -> str | None:
    """A write refused because this node is not (or no longer) the master carries ``tidemark-master``:
    the master's client address, or '' while the node does not know it. None: another refusal."""
    try:
        trailing = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # not every RpcError carries metadata
        return None
    for key, value in trailing:
        if key == "tidemark-master":
            return str(value)
    return None


COLD_PULLS_REMOTE = 16  # iter_pull(local_reads=True): pulls over gRPC after PullLocal refused a tiered range


def _local_request(req: pb.PullRequest) -> pb.PullLocalRequest:
    return pb.PullLocalRequest(topic=req.topic, queue_id=req.queue_id, offset=req.offset, max_messages=req.max_messages,
                               max_wait_ms=req.max_wait_ms, max_bytes=req.max_bytes)


def _request(cls: Callable[..., T], **fields: Any) -> T:
    """A request message; a value the field cannot hold (a negative offset, a huge queue id) is the
    caller's mistake, reported as INVALID_ARGUMENT rather than protobuf's ValueError."""
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        bad = ", ".join(f"{k}={v!r}"[:200] for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and v < 0)
        raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"{bad or exc}: out of range for {cls.__name__}") from None


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _channel_credentials(root_certificates: bytes | None, ca_file: str | None, cert_file: str | None,
                         key_file: str | None) -> grpc.ChannelCredentials | None:
    if ca_file:
        root_certificates = _read(ca_file)
    if root_certificates is None and not cert_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                        private_key=_read(key_file) if key_file else None,
                                        certificate_chain=_read(cert_file) if cert_file else None)


class BrokerClient:
    """A connection to a Tidemark pair (DESIGN §8): ``BrokerClient("host:7600")`` or a list of
    addresses (it finds and follows the master). Sends are idempotent (a random producer id and
    sequence numbers), reads see what is confirmed. Every failure raises a ``BrokerError``
    subclass carrying the gRPC code. Use it in a ``with`` block, or ``close()`` it."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout_s: float = 30.0,
        root_certificates: bytes | None = None,
        token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        follow_master: bool = True,
    ) -> None:
        """TLS when ``tls_ca_file`` (or ``root_certificates``, the CA's PEM bytes) is given; a client
        certificate with ``tls_cert_file`` + ``tls_key_file``; ``token`` is sent as a bearer token."""
        self._options: dict[str, Any] = {"timeout_s": timeout_s, "root_certificates": root_certificates, "token": token,
                                          "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
                                          "tls_key_file": tls_key_file, "follow_master": follow_master}
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("at least one broker address is needed")
        if bool(tls_cert_file) != bool(tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        self.timeout_s = timeout_s
        self.follow_master = follow_master  # False: a refusal by a node that is not the master is an error
        self._credentials = _channel_credentials(root_certificates, tls_ca_file, tls_cert_file, tls_key_file)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._current = 0
        self._failed: dict[str, float] = {}  # address -> when it last failed us (monotonic)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.BrokerStub | None = None
        self._lock = threading.Lock()
        self._producer = _Producer()
        self._segment_files = SegmentFiles()  # local reads (local_reads.py)
        self._queues: dict[str, int] = {}
        self._round_robin = itertools.count()
        alloc.tune()  # see broker.alloc: multi-MB request buffers stay in the heap
        self._connect(0)

    # -- connection ----------------------------------------------------------------------------
    def _connect(self, index: int) -> None:
        if self._channel is not None:
            # grpc's close() waits for the connectivity poller a readiness check (_unready) started:
            # 200 ms, paid on every redirect and on every hop between nodes during a failover
            try:
                threading.Thread(target=self._channel.close, name="tidemark-channel-close", daemon=True).start()
            except RuntimeError:  # no thread to be had: pay the wait here
                self._channel.close()
        self._current = index % len(self.addresses)
        address = self.addresses[self._current]
        options = [("grpc.max_receive_message_length", MESSAGE_BYTES_MAX), ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
                   *KEEPALIVE]
        self._checked = False  # whether this channel connected once
        if self._credentials is not None:
            self._channel = grpc.secure_channel(address, self._credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.BrokerStub(self._channel)
        # Pull responses read by hand: each run of batches a span of the received bytes (pull_wire.py)
        self._stub.Pull = self._channel.unary_unary("/tidemark.v1.Broker/Pull",
                                                    request_serializer=pb.PullRequest.SerializeToString,
                                                    response_deserializer=parse_pull_response, _registered_method=True)

    def close(self) -> None:
        """Close the channel (also at the end of a ``with`` block); the client is not usable after.
        Up to 200 ms with several addresses (grpc's close waits for the readiness check's poller)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._segment_files.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, *, retry: bool = True, timeout_s: float | None = None,
              retryable: tuple[grpc.StatusCode, ...] = RETRYABLE) -> Any:
        """One call within ``timeout_s`` overall, whatever happens to the nodes (DESIGN §11).

        A write refused by a node that is not the master (it names the master, or '' while there
        is none yet) was not executed: it goes to the named master or the next address. With
        several addresses a node that does not accept a connection within ``CONNECT_S`` is skipped,
        and keepalive pings end a call on a node that falls silent within about a second; failures
        in ``retryable`` are retried until the deadline (with one address: ``RETRIES_MAX`` times)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        delay = BACKOFF_MIN_S
        failures = 0  # retryable failures; refusals by a node that is not the master do not count
        redirects = 0
        refused: grpc.RpcError | None = None  # the last "not the master" refusal
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and refused is not None:  # the deadline passed waiting for a master: say why
                raise from_rpc_error(refused) from None
            if self._unready(min(CONNECT_S, left)) and left > CONNECT_S:
                self._failed[self.addresses[self._current]] = time.monotonic()
                self._rotate()
                continue
            assert self._stub is not None
            try:
                result = getattr(self._stub, method)(request, timeout=max(left, 0.001), metadata=self._metadata)
                self._checked = True
                self._failed.pop(self.addresses[self._current], None)
                return result
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                master = _redirect(exc) if code == grpc.StatusCode.FAILED_PRECONDITION and self.follow_master else None
                in_time = deadline - time.monotonic() > 0
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not _answered(exc):
                    self._failed[self.addresses[self._current]] = time.monotonic()
                if master is not None and in_time:  # not executed here: to the master, or wait for one
                    refused = exc
                    redirects += 1
                    if master and master != self.addresses[self._current] and not self._failed_lately(master, REDIRECT_DOUBT_S):
                        if master not in self.addresses:
                            self.addresses.append(master)
                        if redirects > 1:  # two nodes naming each other (views in flux): not in a tight loop
                            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                            delay = min(delay * 2, BACKOFF_MAX_S)
                        self._connect(self.addresses.index(master))
                        continue
                else:
                    failures += 1
                    if not (retry and code in retryable and in_time
                            and (len(self.addresses) > 1 or failures < RETRIES_MAX)):
                        raise from_rpc_error(exc) from None
                if len(self.addresses) > 1:
                    self._rotate()
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, BACKOFF_MAX_S)

    @property
    def current_address(self) -> str:
        """The node this client talks to now (the last call's, after redirects and retries)."""
        return self.addresses[self._current]

    def _rotate(self) -> None:
        """To the next address that has not failed us lately (if all have, the one that failed
        longest ago); with one address, reconnect to it."""
        n = len(self.addresses)
        order = [(self._current + k) % n for k in range(1, n + 1)]
        fresh = [i for i in order if not self._failed_lately(self.addresses[i])]
        if fresh:
            index = fresh[0]
        else:
            index = min(order, key=lambda i: self._failed.get(self.addresses[i], 0.0))
        if index != self._current or n == 1:
            self._connect(index)

    def _failed_lately(self, address: str, within_s: float = FAILED_MEMORY_S) -> bool:
        """``address`` failed us less than ``within_s`` ago."""
        return time.monotonic() - self._failed.get(address, -within_s) < within_s

    def _unready(self, wait_s: float) -> bool:
        """With several addresses: the current node did not take a connection within ``wait_s``."""
        if self._checked or len(self.addresses) < 2 or wait_s <= 0:
            return False
        try:
            grpc.channel_ready_future(self._channel).result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            return True
        self._checked = True
        return False

    # -- topics --------------------------------------------------------------------------------
    def create_topic(self, name: str, queues: int = 1) -> None:
        """Create ``name`` with ``queues`` queues (ALREADY_EXISTS if it exists; names: 1-127 of
        [A-Za-z0-9._-], not starting with ``__``)."""
        self._call("CreateTopic", _request(pb.CreateTopicRequest, name=name, queues=queues), retry=False)
        self._queues[name] = queues

    def create_topics(self, topics: Mapping[str, int]) -> None:
        """Create every topic of ``topics`` (name → queues) in one call, all or none (at most 1,000)."""
        request = pb.CreateTopicsRequest(topics=[_request(pb.CreateTopicRequest, name=n, queues=q) for n, q in topics.items()])
        self._call("CreateTopics", request, retry=False)
        self._queues.update(topics)

    def delete_topic(self, name: str) -> None:
        """Delete ``name``: its messages become unreadable and their space is reclaimed by retention."""
        self._call("DeleteTopic", _request(pb.DeleteTopicRequest, name=name), retry=False)
        self._queues.pop(name, None)

    def list_topics(self, include_system: bool = False) -> dict[str, dict[str, Any]]:
        """Every topic: ``{name: {"queues": n, "max_offsets": [next queue offset of each queue]}}``
        (system topics, ``__...``, only with ``include_system``)."""
        resp = self._call("ListTopics", pb.ListTopicsRequest(include_system=include_system))
        return {t.name: {"queues": t.queues, "max_offsets": list(t.queue_max_offsets)} for t in resp.topics}

    def _queue_count(self, topic: str) -> int:
        if topic not in self._queues:
            topics = self.list_topics(include_system=True)
            if topic not in topics:
                raise error_for(grpc.StatusCode.NOT_FOUND, f"unknown topic {shown(topic)}")
            self._queues[topic] = topics[topic]["queues"]
        return self._queues[topic]

    # -- send ----------------------------------------------------------------------------------
    def pick_queue(self, topic: str, key: str | None) -> int:
        """A key always maps to ``crc32c(key) % queues``; keyless sends rotate over the queues."""
        queues = self._queue_count(topic)
        if key is None:
            return next(self._round_robin) % queues
        return crc32c.crc32c(key.encode()) % queues

    def send(self, topic: str, messages: Sequence[Message], ack: str = "replica",
             timeout_ms: int | None = None) -> Sequence[Receipt]:
        """Send in one request: one batch per queue. Keyless messages of one call share a queue
        (the next in round-robin order), so a call makes one batch, not one per message."""
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}")
        if not messages:
            return Receipts(topic, 0, [])
        queues = self._queue_count(topic)
        sticky = next(self._round_robin) % queues
        by_queue: dict[int, list[int]] = {}
        delayed: dict[int, list[int]] = {}  # timer messages not yet due, by target queue
        crc = crc32c.crc32c
        now_ms = int(time.time() * 1000)
        for i, m in enumerate(messages):
            q = sticky if m.key is None else crc(m.key.encode()) % queues
            target = by_queue if m.deliver_at_ms is None or m.deliver_at_ms <= now_ms else delayed
            group = target.get(q)
            if group is None:
                target[q] = [i]
            else:
                group.append(i)
        topic_bytes = len(topic.encode())
        with self._lock:
            if any(v > SEQUENCE_MAX for v in self._producer.sequences.values()):
                self._producer = _Producer()
            # filled in place: constructing sub-messages separately would copy every payload twice
            request = pb.SendRequest(ack=ACKS[ack], timeout_ms=timeout_ms or 0)
            groups: list[SendGroup] = []
            for queue_id, idxs in by_queue.items():
                records, positions = encode_messages(messages, idxs)
                seq = self._producer.sequences.get((topic, queue_id), 0)
                request.batches.add(topic=topic, queue_id=queue_id, producer_id=self._producer.producer_id,
                                    base_sequence=seq, record_count=len(idxs), records_crc=crc(records),
                                    records=records)
                groups.append(SendGroup(queue_id, idxs, positions, seq))
            timer_seq = self._producer.sequences.get((TIMER_TOPIC, 0), 0)
            for queue_id, idxs in delayed.items():  # one sequence for __timer: batches follow each other
                records, positions = encode_messages(messages, idxs, timer_target=(topic, queue_id))
                request.batches.add(topic=topic, queue_id=queue_id, producer_id=self._producer.producer_id,
                                    base_sequence=timer_seq, record_count=len(idxs), records_crc=crc(records),
                                    records=records, delayed=True)
                groups.append(SendGroup(queue_id, idxs, positions, timer_seq, [messages[i].deliver_at_ms or 0 for i in idxs]))
                timer_seq += len(idxs)
            try:
                resp = self._call("Send", request, retryable=SEND_RETRYABLE)
            except BrokerError:
                self._producer = _Producer()  # outcome unknown after every retry: never reuse these sequences
                raise
            for g, r in zip(groups, resp.receipts, strict=True):
                if g.deliver is not None:
                    self._producer.sequences[(TIMER_TOPIC, 0)] = g.base_sequence + len(g.idxs)
                    g.records_at = r.commit_offset + bf.HEADER_BYTES + len(TIMER_TOPIC)
                else:
                    self._producer.sequences[(topic, g.queue_id)] = g.base_sequence + len(g.idxs)
                    g.records_at = r.commit_offset + bf.HEADER_BYTES + topic_bytes
                g.base_queue_offset = r.base_queue_offset
                g.duplicate = r.duplicate
        return Receipts(topic, len(messages), groups)

    # -- pull ----------------------------------------------------------------------------------
    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 1000,
             max_wait_ms: int = 0, max_bytes: int = 0, *, local_reads: bool = False) -> PullResult:
        """Up to ``max_messages`` from ``offset`` of one queue (what is confirmed), decoded lazily;
        ``max_wait_ms``: wait that long for the first one; ``next_offset`` says where to go on.
        An offset removed by retention, or beyond the end, raises ``OutOfRange``.
        ``local_reads``: on the node's host, read the batches from its segment files when it can
        (``broker/client/local_reads.py``; the same answer, without moving the bytes through gRPC)."""
        req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=offset, max_messages=max_messages,
                             max_wait_ms=max_wait_ms, max_bytes=max_bytes)
        timeout_s = self.timeout_s + max_wait_ms / 1000.0
        if local_reads and not_local(self.current_address) is None:
            try:
                local = self._read_local(self._call("PullLocal", _local_request(req), timeout_s=timeout_s))
            except BrokerError as exc:
                self._local_refused(exc.code, exc)
                local = None
            if local is not None:
                return PullResult(local)
        return PullResult(self._call("Pull", req, timeout_s=timeout_s))

    def _read_local(self, response: pb.PullLocalResponse) -> LocalPullResponse | None:
        return self._segment_files.read(self.current_address, response)

    def _local_refused(self, code: grpc.StatusCode, exc: Exception) -> None:
        """A ``PullLocal`` refused: the pull goes over gRPC (UNIMPLEMENTED: an older node, never
        again from it; FAILED_PRECONDITION: a range in tiered storage), or the error stands."""
        if code == grpc.StatusCode.UNIMPLEMENTED:
            mark_not_local(self.current_address, "the node does not serve PullLocal")
        elif code != grpc.StatusCode.FAILED_PRECONDITION:
            raise exc from None

    def pull_future(self, topic: str, queue_id: int, offset: int, max_messages: int = 1000,
                    max_wait_ms: int = 0) -> grpc.Future:
        """A pull in flight on the current node (no retries, no redirects): ``result()`` is the raw
        response, ``cancel()`` ends it. For callers that wait on something else at the same time."""
        req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=offset, max_messages=max_messages,
                       max_wait_ms=max_wait_ms)
        assert self._stub is not None
        return self._stub.Pull.future(req, timeout=self.timeout_s + max_wait_ms / 1000.0, metadata=self._metadata)

    def iter_pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 5000,
                  max_wait_ms: int = 0, max_bytes: int = 0, *, stop_at_end: bool = True,
                  local_reads: bool = False) -> Iterator[PullResult]:
        """Pull continuously from ``offset``, keeping the next request in flight while the caller
        works on the current result (fetch pipelining). Stops at the queue's end unless told not to.
        ``local_reads``: as for ``pull``."""
        timeout = self.timeout_s + max_wait_ms / 1000.0

        remote_left = 0  # after a range in tiered storage, this many pulls go over gRPC before trying again

        def request(at: int) -> tuple[Any, bool, Any]:
            nonlocal remote_left
            req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=at, max_messages=max_messages,
                                 max_wait_ms=max_wait_ms, max_bytes=max_bytes)
            assert self._stub is not None
            local = local_reads and not remote_left and not_local(self.current_address) is None
            remote_left = max(0, remote_left - 1)
            if local:
                return req, True, self._stub.PullLocal.future(_local_request(req), timeout=timeout, metadata=self._metadata)
            return req, False, self._stub.Pull.future(req, timeout=timeout, metadata=self._metadata)

        pending = request(offset)
        while True:
            req, local, future = pending
            try:
                response = future.result()
                if local:
                    response = self._read_local(response)
            except grpc.RpcError as exc:
                if not local:
                    raise from_rpc_error(exc) from None
                self._local_refused(exc.code(), from_rpc_error(exc))  # type: ignore[attr-defined]
                remote_left = COLD_PULLS_REMOTE  # a tiered range: keep the pipeline on gRPC through it
                response = None
            if response is None:  # not readable locally: this one over gRPC
                try:
                    assert self._stub is not None
                    response = self._stub.Pull(req, timeout=timeout, metadata=self._metadata)
                except grpc.RpcError as exc:
                    raise from_rpc_error(exc) from None
            result = PullResult(response)
            if not len(result) and stop_at_end:
                return
            pending = request(result.next_offset)
            yield result

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset whose message was stored at or after ``timestamp_ms`` (the end
        of the queue if none was)."""
        return int(self._call("OffsetForTime", _request(pb.OffsetForTimeRequest,
            topic=topic, queue_id=queue_id, timestamp_ms=timestamp_ms)).offset)

    # -- consumer offsets ----------------------------------------------------------------------
    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Store ``offset`` (the next one to consume) as ``group``'s position on one queue."""
        self.commit_offsets(group, {(topic, queue_id): offset})

    def commit_offsets(self, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Store several positions of ``group`` at once: ``{(topic, queue_id): offset}``."""
        req = _request(pb.CommitOffsetRequest, offsets=[_request(pb.CommittedOffset, group=group, topic=t, queue_id=q, offset=o)
                                                        for (t, q), o in offsets.items()])
        self._call("CommitOffset", req)

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        """``group``'s stored position on one queue, or None if it never committed one."""
        resp = self._call("GetOffset", _request(pb.GetOffsetRequest, group=group, topic=topic, queue_id=queue_id))
        return int(resp.offset) if resp.found else None

    # -- consumer groups (DESIGN §12) ------------------------------------------------------------
    def clone(self) -> BrokerClient:
        """A new client with the same addresses and options, on a channel of its own."""
        return BrokerClient(list(self.addresses), **self._options)

    def consumer(self, group: str, topics: Sequence[str] | str, *, session_timeout_ms: int = 10_000,
                 auto_offset_reset: str = "latest", max_poll_interval_ms: int = 300_000,
                 max_messages: int = 1000, client_id: str | None = None,
                 on_assigned: Callable[[set[tuple[str, int]]], None] | None = None,
                 on_revoked: Callable[[set[tuple[str, int]]], None] | None = None) -> Consumer:
        """A subscribe-mode member of ``group``: the master shares the topics' queues among the
        group's members (see ``broker/client/consumer.py``). Use it as a context manager."""
        return Consumer(self, group, [topics] if isinstance(topics, str) else list(topics),
                        session_timeout_ms=session_timeout_ms, auto_offset_reset=auto_offset_reset,
                        max_poll_interval_ms=max_poll_interval_ms, max_messages=max_messages, client_id=client_id,
                        on_assigned=on_assigned, on_revoked=on_revoked)

    def list_groups(self) -> list[dict[str, Any]]:
        """Every group with live members, committed offsets or pop state: name, members, topics, lag."""
        resp = self._call("ListGroups", pb.ListGroupsRequest())
        return [{"name": g.name, "members": g.members, "topics": list(g.topics), "lag": g.lag} for g in resp.groups]

    def describe_group(self, group: str) -> dict[str, Any]:
        """Members and their queues, and per queue: committed offset, end, lag, owner, pop leases."""
        g = self._call("DescribeGroup", _request(pb.DescribeGroupRequest, group=group)).group
        return {
            "name": g.name, "generation": g.generation, "rebalances": g.rebalances,
            "dlq_messages": g.dlq_messages, "redeliveries": g.redeliveries,
            "members": [{"member_id": m.member_id, "client_id": m.client_id, "topics": list(m.topics),
                         "assigned": [(r.topic, r.queue_id) for r in m.assigned],
                         "session_timeout_ms": m.session_timeout_ms, "last_heartbeat_ms_ago": m.last_heartbeat_ms_ago}
                        for m in g.members],
            "queues": [{"topic": q.topic, "queue_id": q.queue_id,
                        "committed_offset": q.committed_offset if q.has_committed else None,
                        "end_offset": q.end_offset, "lag": q.lag, "owner": q.owner, "in_flight": q.in_flight,
                        "pop_offset": q.pop_offset} for q in g.queues],
        }

    def reset_offsets(self, group: str, topic: str, to: str) -> dict[int, int]:
        """Commit new offsets for every queue of ``topic``: ``to`` is ``earliest``, ``latest``,
        ``time:MS`` or ``offset:N``. Refused (FAILED_PRECONDITION) while the group has live members.
        Returns queue id -> the offset committed."""
        kind, _, value = to.partition(":")
        kinds = {"earliest": pb.RESET_TO_EARLIEST, "latest": pb.RESET_TO_LATEST, "time": pb.RESET_TO_TIME, "offset": pb.RESET_TO_OFFSET}
        if kind not in kinds or (kind in ("time", "offset")) != bool(value) or (value and not value.lstrip("-").isdigit()):
            raise ValueError(f"reset target must be earliest, latest, time:MS or offset:N, got {to!r}")
        resp = self._call("ResetOffsets", _request(pb.ResetOffsetsRequest, group=group, topic=topic, to=kinds[kind],
                                                   value=int(value or 0)), retry=False)
        return {o.queue_id: o.offset for o in resp.offsets}

    def describe_topic(self, name: str) -> dict[str, Any]:
        """Queues with their min/max offsets, stored bytes, local and tiered ranges."""
        resp = self._call("DescribeTopic", _request(pb.DescribeTopicRequest, name=name))
        return {"name": resp.name, "topic_id": resp.topic_id,
                "queues": [{"queue_id": q.queue_id, "min_offset": q.min_offset, "max_offset": q.max_offset,
                            "bytes": q.bytes, "local_min_offset": q.local_min_offset,
                            "tiered_end_offset": q.tiered_end_offset} for q in resp.queues]}

    # -- pop mode (DESIGN §12) ---------------------------------------------------------------------
    def pop(self, group: str, topic: str, max_messages: int = 32, invisible_ms: int = 30_000, max_wait_ms: int = 0,
            *, start: str = "latest") -> PopResult:
        """Lease up to ``max_messages`` of ``topic`` for ``group``, from any of its queues: each comes
        back (``delivery_count`` + 1) after ``invisible_ms`` unless acked; ``max_wait_ms``: wait this
        long for one. A new group starts at ``start`` (``latest`` or ``earliest``)."""
        if start not in ("latest", "earliest"):
            raise ValueError(f"start must be 'latest' or 'earliest', got {start!r}")
        req = _request(pb.PopRequest, group=group, topic=topic, max_messages=max_messages, invisible_ms=invisible_ms,
                       max_wait_ms=max_wait_ms, start_earliest=start == "earliest", as_runs=True)
        resp = self._call("Pop", req, timeout_s=self.timeout_s + max_wait_ms / 1000.0)
        return PopResult(topic, resp)

    def ack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str) -> dict[str, str]:
        """End these leases for good (one call, one record). Returns the handles that could not be
        acked, with the reason: a lease that expired or was nacked (the message is or will be
        delivered again), or one an ack had already ended ("the message was acked": it is done; after
        an UNAVAILABLE this call is retried, and an earlier attempt whose answer was lost may have
        acked it); for a whole ``PopResult``, the handles of its runs in which some message could not be."""
        return self._end("Ack", pb.AckRequest, group, messages)

    def nack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str,
             delay_ms: int = 0) -> dict[str, str]:
        """Give these leases back: delivered again after ``delay_ms``. Returns refusals as ``ack``."""
        return self._end("Nack", pb.NackRequest, group, messages, delay_ms=delay_ms)

    def _end(self, method: str, request_type: Any, group: str, messages: Any, **fields: Any) -> dict[str, str]:
        if isinstance(messages, PopResult):
            handles = messages.receipt_handles()
        else:
            items = [messages] if isinstance(messages, (str, PoppedMessage)) else list(messages)
            handles = [m if isinstance(m, str) else m.receipt_handle for m in items]
        resp = self._call(method, _request(request_type, group=group, receipt_handles=handles, **fields))
        return {r.receipt_handle: r.message for r in resp.results if r.code != 0}

    def change_invisible(self, group: str, message: PoppedMessage | str, invisible_ms: int) -> str:
        """Extend (or shorten) one lease to ``invisible_ms`` from now; returns its new receipt handle
        (also set on ``message``); the old one stops working."""
        handle = message if isinstance(message, str) else message.receipt_handle
        resp = self._call("ChangeInvisible", _request(pb.ChangeInvisibleRequest, group=group, receipt_handle=handle,
                                                       invisible_ms=invisible_ms), retry=False)
        if isinstance(message, PoppedMessage):
            message.receipt_handle = resp.receipt_handle
        return str(resp.receipt_handle)

    # -- timers --------------------------------------------------------------------------------
    def cancel_timer(self, receipt: Receipt | int) -> dict[str, Any]:
        """Cancel a scheduled message (its receipt, or its ``timer_offset``) before it fires.
        A fired, cancelled or firing timer: FAILED_PRECONDITION; an unknown one: NOT_FOUND."""
        offset = receipt if isinstance(receipt, int) else receipt.timer_offset
        if offset is None:
            raise ValueError("this receipt is not a timer message's (it has no timer_offset)")
        resp = self._call("CancelTimer", _request(pb.CancelTimerRequest, timer_offset=offset), retry=False)
        return {"timer_offset": offset, "deliver_at_ms": resp.deliver_at_ms, "topic": resp.topic,
                "queue_id": resp.queue_id}

    # -- admin ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The connected node's status (DESIGN §8): role, epoch, offsets, replicas, timers, errors...
        as a dict (``typed_status()`` gives the same as the ``NodeStatus`` message)."""
        return dict(json.loads(self._call("Status", pb.StatusRequest()).json))

    def typed_status(self) -> pb.NodeStatus:
        """The connected node's status as the typed ``tidemark.v1.NodeStatus`` message."""
        return self._call("Status", pb.StatusRequest()).status

    def promote(self, unclean: bool = False) -> int:
        """Make the connected node (a slave) the master; returns its new epoch."""
        return int(self._call("Promote", pb.PromoteRequest(unclean=unclean), retry=False).epoch)

    def demote(self, master: str) -> None:
        """Make the connected node (a master) a slave of ``master``."""
        self._call("Demote", _request(pb.DemoteRequest, master=master), retry=False)


