"""The client's connection: addresses, channels, retries, redirects to the master, deadlines.

The public ``BrokerClient`` (client.py) is this plus one class per area of the API."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from broker import alloc
from broker.client.errors import BrokerError, DeadlineExceeded, Owner, Unavailable, error_for, from_rpc_error
from broker.client.local_reads import SegmentFiles
from broker.client.pull_wire import parse_pull_response
from broker.client.routes import RouteTable
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

# replica is sent as 0 (ACK_UNSPECIFIED), which every server version reads as replica
ACKS = {"replica": pb.ACK_UNSPECIFIED, "leader": pb.ACK_LEADER, "flush": pb.ACK_FLUSH}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# For Send the request is idempotent (producer id + sequences), so an unknown outcome is retried too.
SEND_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
SEQUENCE_MAX = 0x7FFFFFFF - (1 << 24)  # a new producer id before the 31-bit sequence runs out
# failures after which a call may have taken effect (its answer was lost, or it was cut short after
# the node stored it; not a call gRPC never sent: ``_never_sent``): a later refusal by a node that is
# not the master does not make it "not done" (``_given_up``)
INDETERMINATE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
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
FAN_OUT_THREADS = 8  # a send spanning shards: requests to this many shards at once
ROUTE_HOPS_MAX = 3  # refusals naming another owner followed by one call (routes in flux: then it fails)
T = TypeVar("T")
# One operation's deadline (monotonic seconds) over every call it makes, on every shard: set by
# ``ClientCore.within``, read by ``_call`` (and carried into the fan-out pool's threads)
CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tidemark_call_deadline", default=None)
TURN_LEFT_MIN_S = 0.05  # a send part that gets its shard's turn with less left than this is not sent


POLLER_STOP_S = 1.0  # a channel's close waits at most this long for gRPC's connectivity poller to stop


def _close_channel(channel: grpc.Channel) -> None:
    """Close ``channel`` once gRPC's connectivity poller (the thread a readiness check starts, which
    looks at the channel every 200 ms until nothing is subscribed) has stopped: a channel closed
    under it makes it raise "Cannot invoke RPC: Channel closed!" in its own thread (a race in gRPC's
    Python channel; tests fail on an exception in any thread). The poller's state is gRPC's own
    (``_connectivity_state``): without it, the channel is closed at once as before."""
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + POLLER_STOP_S
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.close()


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


def _moving(exc: grpc.RpcError) -> bool:
    """A write refused because its queue is moving between shards (nothing stored): retried until
    the call's deadline, on the same node."""
    try:
        trailing = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:
        return False
    return any(key == "tidemark-retry" and value == "moving" for key, value in trailing)


def _never_sent(exc: grpc.RpcError) -> bool:
    """The channel had no connection to send the call on (gRPC's own words): it did nothing."""
    return (exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            and (exc.details() or "").startswith("failed to connect to all addresses"))  # type: ignore[attr-defined]


def _given_up(method: str, refused: grpc.RpcError, unknown: grpc.RpcError | None) -> BrokerError:
    """The error of a call that ends on a refusal by a node that is not the master (nothing was
    done there). When an earlier attempt of it failed in a way that leaves its outcome unknown (its
    answer lost with the node), the call's outcome is unknown too: DEADLINE_EXCEEDED, naming
    both, never the refusal alone (a caller takes FAILED_PRECONDITION for "not done", and a
    commit whose first attempt was applied would be taken for refused)."""
    if unknown is None:
        return from_rpc_error(refused)
    return error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: an attempt failed with "
                     f"{unknown.code().name} ({unknown.details() or ''}), so whether it took effect is not "  # type: ignore[attr-defined]
                     f"known; then, until the deadline, no master took it: {refused.details() or ''}")  # type: ignore[attr-defined]


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
                               max_wait_ms=req.max_wait_ms, max_bytes=req.max_bytes, isolation=req.isolation)


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


class ClientCore:
    """A connection to a Tidemark pair; see ``BrokerClient``."""

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
        self._routes = RouteTable()  # a cluster of shards: which shard writes each queue (routes.py)
        self._pop_turn = itertools.count()  # a cluster of shards: the shard a pop asks first rotates
        self._shard_cores: dict[str, ClientCore] = {}  # a connection per shard, made when first needed
        self._shards_lock = threading.Lock()
        self._send_locks: dict[str, threading.Lock] = {}  # sends to one shard, one at a time (their sequences)
        self._shard_producers: dict[str, _Producer] = {}  # a producer id per shard, used under its lock
        self._pool: ThreadPoolExecutor | None = None  # a send over several shards: a request to each at once
        alloc.tune()  # see broker.alloc: multi-MB request buffers stay in the heap
        self._connect(0)

    def _connect(self, index: int) -> None:
        if self._channel is not None:
            # closed once the connectivity poller a readiness check (_unready) started has stopped:
            # up to 400 ms, not paid on every redirect and every hop between nodes during a failover
            try:
                threading.Thread(target=_close_channel, args=(self._channel,), name="tidemark-channel-close",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: pay the wait here
                _close_channel(self._channel)
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
        Up to 400 ms with several addresses, right after a readiness check (its poller stops first)."""
        if self._channel is not None:
            _close_channel(self._channel)
            self._channel = None
        with self._shards_lock:
            cores, self._shard_cores = list(self._shard_cores.values()), {}
        for core in cores:
            core.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._segment_files.close()

    def __enter__(self) -> Any:
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
        in ``retryable`` are retried until the deadline (with one address: ``RETRIES_MAX`` times).
        A call that ends on a "not the master" refusal after an attempt whose outcome is unknown
        (``INDETERMINATE``) ends DEADLINE_EXCEEDED: the refusal alone would say "not done"."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        outer = CALL_DEADLINE.get()
        if outer is not None:  # a call of a longer operation: within what is left of it
            if outer <= time.monotonic():
                raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} was not made: the deadline of the "
                                "operation it belongs to had passed")
            deadline = min(deadline, outer)
        delay = BACKOFF_MIN_S
        failures = 0  # retryable failures; refusals by a node that is not the master do not count
        redirects = 0
        refused: grpc.RpcError | None = None  # the last "not the master" refusal
        unknown: grpc.RpcError | None = None  # the last failure after which the call may have taken effect
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and refused is not None:  # the deadline passed waiting for a master: say why
                raise _given_up(method, refused, unknown) from None
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
                not_master = _redirect(exc) if code == grpc.StatusCode.FAILED_PRECONDITION else None
                master = not_master if self.follow_master else None
                in_time = deadline - time.monotonic() > 0
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not _answered(exc):
                    self._failed[self.addresses[self._current]] = time.monotonic()
                if code in INDETERMINATE and not _moving(exc) and not _never_sent(exc):
                    unknown = exc
                if code == grpc.StatusCode.UNAVAILABLE and in_time and retry and _moving(exc):
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))  # not stored: the same again
                    delay = min(delay * 2, BACKOFF_MAX_S)
                    continue
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
                        raise (_given_up(method, exc, unknown) if not_master is not None else from_rpc_error(exc)) from None
                if len(self.addresses) > 1:
                    self._rotate()
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, BACKOFF_MAX_S)

    @contextlib.contextmanager
    def within(self, timeout_s: float | None = None) -> Iterator[float]:
        """One operation of several calls (a send over shards: its parts, route requests, hops),
        all within ``timeout_s`` (the client's) overall; inside another, the earlier of the two
        deadlines holds. Yields the deadline (``time.monotonic()`` seconds)."""
        outer = CALL_DEADLINE.get()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        if outer is not None and (outer < deadline or not timeout_s):  # no own timeout: the outer one's
            deadline = outer
        token = CALL_DEADLINE.set(deadline)
        try:
            yield deadline
        finally:
            CALL_DEADLINE.reset(token)

    # -- a cluster of shards (docs/shards.md): each queue's calls go to its shard ------------------
    @property
    def sharded(self) -> bool:
        """Whether the cluster is several shards (asked of a node once)."""
        if self._routes.sharded is None:
            self._learn_routes([])
        return bool(self._routes.sharded)

    def _learn_routes(self, topics: list[str]) -> None:
        """Ask a node where ``topics``' queues are (an older node that does not know: not sharded)."""
        try:
            resp = self._call("GetRoutes", pb.GetRoutesRequest(topics=topics))
        except BrokerError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            if self._routes.sharded is None:  # an older node; never back from sharded (one met mid-upgrade)
                self._routes.sharded = False
            return
        self._routes.learn(resp)

    def _ask_masters(self, topic: str, shards: Iterable[str]) -> None:
        """Shards passed over for want of a master (as last heard) are looked up again now and
        then (``RouteTable.ask_for_masters``); a failure here is only a later try."""
        if self._routes.ask_for_masters(shards):
            with contextlib.suppress(BrokerError):
                self._learn_routes([topic])

    def _shard_of(self, topic: str, queue: int, offset: int | None = None) -> str | None:
        """The shard writing ``queue`` of ``topic``, or given ``offset`` the one holding it (a queue
        that moved has a segment on each shard it was on); None: not a cluster of shards, or not placed."""
        if not self.sharded:
            return None
        shard = self._routes.owner(topic, queue) if offset is None else self._routes.reader(topic, queue, offset)
        if shard is None:
            self._learn_routes([topic])
            shard = self._routes.owner(topic, queue) if offset is None else self._routes.reader(topic, queue, offset)
        return shard

    def _named_elsewhere(self, topic: str, queue: int, owner: Owner, offset: int | None) -> None:
        """A refusal named ``owner``: for a write the queue's writer (that route updated); for a read
        at ``offset`` the shard holding it: from a copy of etcd newer than our routes (a move, maybe)
        the topic's routes are asked for again; else, for a queue that never moved, it is the writer."""
        if offset is not None and owner.revision > self._routes.revision:  # etcd changed since: a move, maybe
            self._routes.master_named(owner.shard, owner.master)
            self._learn_routes([topic])
        elif offset is None or not self._routes.has_segments(topic, queue):
            self._routes.moved(topic, queue, owner.shard, owner.master)
        else:
            self._routes.master_named(owner.shard, owner.master)

    def _shard_core(self, shard: str | None) -> ClientCore:
        """The connection to ``shard``'s nodes (this one for None)."""
        if shard is None:
            return self
        addresses = self._routes.addresses(shard)
        with self._shards_lock:
            core = self._shard_cores.get(shard)
            if core is not None:
                core.addresses.extend(a for a in addresses if a not in core.addresses)
                return core
        if not addresses:
            self._learn_routes([])
            addresses = self._routes.addresses(shard)
            if not addresses:
                raise error_for(grpc.StatusCode.UNAVAILABLE, f"shard {shard!r} has no node with a lease in etcd now")
        with self._shards_lock:
            core = self._shard_cores.get(shard)
            if core is None:
                core = self._shard_cores[shard] = ClientCore(addresses, **self._options)
            return core

    def _shard_lock(self, shard: str) -> threading.Lock:
        with self._shards_lock:
            lock = self._send_locks.get(shard)
            if lock is None:
                lock = self._send_locks[shard] = threading.Lock()
            return lock

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on the fan-out pool, in a copy of the caller's context (the deadline of the
        operation it belongs to goes along; a pool thread keeps none of its own)."""
        return self._fan_out().submit(contextvars.copy_context().run, fn, *args)

    def _fan_out(self) -> ThreadPoolExecutor:
        with self._shards_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=FAN_OUT_THREADS, thread_name_prefix="tidemark-shards")
            return self._pool

    def _routed(self, topic: str, queue: int, call: Callable[[ClientCore], T], offset: int | None = None,
                timeout_s: float | None = None) -> T:
        """``call`` on the connection to the shard writing ``queue`` (given ``offset``: holding it); a
        refusal naming another shard updates the routes and goes there (no other round trip to etcd).
        Route requests, hops and calls all within ``timeout_s`` (the client's; a long-poll passes its own)."""
        hops = 0
        named: str | None = None
        with self.within(timeout_s) as deadline:
            while True:
                shard = named if named is not None else self._shard_of(topic, queue, offset)
                try:
                    return call(self._shard_core(shard))
                except BrokerError as exc:
                    if isinstance(exc, (Unavailable, DeadlineExceeded)) and shard is not None:
                        self._routes.doubt(shard)
                    if exc.owner is None or hops >= ROUTE_HOPS_MAX or time.monotonic() >= deadline:
                        raise
                    hops += 1
                    self._named_elsewhere(topic, queue, exc.owner, offset)
                    named = exc.owner.shard

    def _coordinated(self, group: str, call: Callable[[ClientCore], T], timeout_s: float | None = None) -> T:
        """``call`` on the connection to the shard coordinating ``group`` (this one outside a cluster
        of shards); the first goes to any node, whose refusal names the coordinator. Hops and calls
        all within ``timeout_s`` (the client's; a parked heartbeat passes its own)."""
        with self.within(timeout_s) as deadline:
            if not self.sharded:
                return call(self)
            hops = 0
            while True:
                shard = self._routes.group_shard(group)
                try:
                    core = self._shard_core(shard)
                except BrokerError:  # no node of the shard holds a lease now (removed?): any node names the coordinator
                    if shard is None or hops >= ROUTE_HOPS_MAX or time.monotonic() >= deadline:
                        raise
                    hops += 1
                    self._routes.forget_group(group)
                    continue
                try:
                    return call(core)
                except BrokerError as exc:
                    if exc.owner is None or hops >= ROUTE_HOPS_MAX or time.monotonic() >= deadline:
                        raise
                    hops += 1
                    self._routes.group_moved(group, exc.owner.shard, exc.owner.master)

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
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            ready.cancel()  # its poller stops now: left on, it polls the channel after we close it and raises
            return True
        self._checked = True
        return False
