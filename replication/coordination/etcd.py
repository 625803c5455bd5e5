"""The etcd operations the coordinator uses, each one request with a deadline (``etcd3aio``).

Why ``etcd3aio``: it speaks etcd's gRPC API on ``grpc.aio`` (which we already run), takes several
endpoints, TLS with client certificates, and user/password auth with token refresh, and its
transactions take etcd's own compare and request messages. ``etcd3`` 0.12 breaks on protobuf ≥ 4,
``aetcd`` has neither TLS nor several endpoints, ``etcd3gw`` goes through the JSON gateway.

Every read is one transaction of range requests, so the coordinator decides from one consistent
revision; every write is one transaction whose compares make it a compare-and-swap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3aio import Etcd3Client, EtcdError, TokenRefresher
from etcd3aio.kv import KVService, SortOrder, SortTarget, prefix_range_end

from broker.config import Config
from replication.coordination import records as rec

DELETE_EVENT = 1  # mvccpb.Event.EventType.DELETE


RANGE_PAGE_KEYS = 1000  # a range read's page: a placement is ~0.9 KB for 16 queues, so ~1 MB a page
# a page of the cluster's copy is not an election's step: it may take longer than a coordinator's round
# (10,000 topics read by 20 nodes at once under 200 nodes' rounds timed out at 500 ms a page)
RANGE_PAGE_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """etcd did not answer in time (or refused): nothing is known about the request's outcome."""


@dataclass
class Entry:
    value: bytes
    version: int  # 0: absent
    create_revision: int = 0
    lease: int = 0


ABSENT = Entry(b"", 0)


@dataclass
class View:
    """The coordinator's keys at one etcd revision."""

    revision: int
    leader: Entry
    epoch: Entry
    insync: Entry
    switchover: Entry
    nodes: dict[str, Entry] = field(default_factory=dict)
    sharded: Entry = field(default_factory=lambda: ABSENT)  # the cluster root's ``sharded`` marker (records.py)
    # a shard's node: the keys a one-pair cluster keeps at the root, until they are upgraded into a shard
    pair_leader: Entry = field(default_factory=lambda: ABSENT)
    pair_epoch: Entry = field(default_factory=lambda: ABSENT)
    pair_insync: Entry = field(default_factory=lambda: ABSENT)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Etcd:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.shard = config["coordinator.shard"]
        self.root = rec.prefix(config["coordinator.cluster"])
        self.prefix = rec.prefix(config["coordinator.cluster"], self.shard)
        timeout_ms = config["coordinator.request_timeout_ms"] or config["coordinator.lease_ttl_ms"] // 4
        self.timeout_s = timeout_ms / 1000.0
        self._client: Etcd3Client | None = None
        self._refresher: TokenRefresher | None = None

    def key(self, name: str) -> bytes:
        return (self.prefix + name).encode()

    def root_key(self, name: str) -> bytes:
        return (self.root + name).encode()

    # -- connection -------------------------------------------------------------------------------
    async def connect(self) -> None:
        c = self.config
        tls: dict[str, bytes | None] = {}
        if c["coordinator.tls_ca_file"]:
            tls["ca_cert"] = _read_file(c["coordinator.tls_ca_file"])
            if c["coordinator.tls_cert_file"]:
                tls["cert_chain"] = _read_file(c["coordinator.tls_cert_file"])
                tls["cert_key"] = _read_file(c["coordinator.tls_key_file"])
        endpoints = [e.partition("://")[2].rstrip("/") for e in c["coordinator.endpoints"]]
        server_name: str | None = c["coordinator.tls_server_name"] or None
        self._client = Etcd3Client(endpoints, rpc_max_attempts=1, tls_server_name=server_name, **tls)  # type: ignore[arg-type]
        await self._client.connect()

    async def authenticate(self) -> None:
        """Log in (when configured); the token is refreshed in the background from then on."""
        c = self.config
        if not c["coordinator.username"] or self._refresher is not None or self._client is None:
            return
        password = _read_file(c["coordinator.password_file"]).decode().strip()
        refresher = self._client.token_refresher(c["coordinator.username"], password)
        await self._call(refresher.__aenter__())
        self._refresher = refresher

    async def close(self) -> None:
        if self._refresher is not None:
            with contextlib.suppress(Exception):
                await self._refresher.__aexit__(None, None, None)
        if self._client is not None:
            await self._client.close()

    async def _call(self, coro, timeout_s: float = 0.0):  # type: ignore[no-untyped-def]
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                return await coro
        except (TimeoutError, EtcdError, OSError, grpc.RpcError) as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}"[:300]) from None

    @property
    def _kv(self) -> KVService:
        assert self._client is not None and self._client.kv is not None
        return self._client.kv

    # -- leases -----------------------------------------------------------------------------------
    async def grant(self, ttl_s: int) -> int:
        assert self._client is not None and self._client.lease is not None
        resp = await self._call(self._client.lease.grant(ttl_s))
        return int(resp.ID)

    async def renew(self, lease_id: int) -> int:
        """One keep-alive round trip; the TTL etcd gives the lease now (0: it is gone)."""
        assert self._client is not None and self._client.lease is not None
        call = self._client.lease.keep_alive(lease_id)
        try:
            resp = await self._call(call.read())
        finally:
            call.cancel()
        if resp is None or not hasattr(resp, "TTL"):
            raise Unreachable("the keep-alive stream ended without an answer")
        return int(resp.TTL)

    async def revoke(self, lease_id: int) -> None:
        assert self._client is not None and self._client.lease is not None
        with contextlib.suppress(Unreachable):
            await self._call(self._client.lease.revoke(lease_id))

    # -- reads ------------------------------------------------------------------------------------
    async def view(self) -> View:
        kv = self._kv
        names = ("leader", "epoch", "insync", "switchover")
        ops = [kv.txn_op_get(self.key(n)) for n in names]
        nodes = self.key("nodes/")
        ops.append(kv.txn_op_get(nodes, range_end=prefix_range_end(nodes)))
        roots = ("sharded", "leader", "epoch", "insync") if self.shard else ("sharded",)
        ops += [kv.txn_op_get(self.root_key(n)) for n in roots]
        resp = await self._call(kv.txn([], ops))

        def entry(r: Any) -> Entry:
            kvs = r.response_range.kvs
            return Entry(kvs[0].value, kvs[0].version, kvs[0].create_revision, kvs[0].lease) if kvs else ABSENT

        leader, epoch, insync, switchover = (entry(r) for r in resp.responses[:len(names)])
        node_entries = {kv_.key.decode()[len(nodes):]: Entry(kv_.value, kv_.version, kv_.create_revision, kv_.lease)
                        for kv_ in resp.responses[len(names)].response_range.kvs}
        view = View(resp.header.revision, leader, epoch, insync, switchover, nodes=node_entries)
        at_root = [entry(r) for r in resp.responses[len(names) + 1:]]
        view.sharded = at_root[0]
        if self.shard:
            view.pair_leader, view.pair_epoch, view.pair_insync = at_root[1:]
        return view

    # -- writes (each a compare-and-swap; the answer says whether it applied) -----------------------
    async def campaign(self, view: View, leader: rec.Leader, lease_id: int, insync: rec.InSync | None) -> int:
        """Take the leader key with ``leader.epoch``: only if nobody holds it and neither the epoch
        nor the in-sync set changed since ``view`` (so the eligibility we checked still holds).
        Returns the key's create revision (the transaction's revision), 0 when it did not apply."""
        kv = self._kv
        compare = [kv.txn_compare_create_revision(self.key("leader"), 0),
                   kv.txn_compare_version(self.key("epoch"), view.epoch.version),
                   kv.txn_compare_version(self.key("insync"), view.insync.version),
                   kv.txn_compare_version(self.key("switchover"), view.switchover.version)]
        success = [kv.txn_op_put(self.key("leader"), rec.encode(leader), lease=lease_id),
                   kv.txn_op_put(self.key("epoch"), str(leader.epoch).encode())]
        if not self.shard:  # a one-pair node never campaigns in a cluster of shards
            compare.append(kv.txn_compare_create_revision(self.root_key("sharded"), 0))
        else:  # nor a shard's node beside a one-pair cluster's keys not yet upgraded (upgrade_pair)
            compare.append(kv.txn_compare_create_revision(self.root_key("epoch"), 0))
            if not view.sharded.version:
                compare.append(kv.txn_compare_create_revision(self.root_key("sharded"), 0))
                success.append(kv.txn_op_put(self.root_key("sharded"), rec.encode(rec.Sharded())))
        if insync is not None:
            success.append(kv.txn_op_put(self.key("insync"), rec.encode(insync)))
        if view.switchover.version:
            success.append(kv.txn_op_delete(self.key("switchover")))
        resp = await self._call(kv.txn(compare, success))
        return int(resp.header.revision) if resp.succeeded else 0

    # -- a cluster of shards: placement (docs/shards.md) --------------------------------------------
    async def range_prefix(self, prefix: str, end: str = "") -> tuple[int, list[tuple[str, bytes]]]:
        """Every key under ``prefix`` (or in [``prefix``, ``end``)) and the revision they were read at.
        Read in pages of ``RANGE_PAGE_KEYS`` keys at the first page's revision: one answer holding
        10,000 topics' placements (8.8 MB) passed gRPC's 4 MiB message limit."""
        start, stop = prefix.encode(), end.encode() if end else prefix_range_end(prefix.encode())
        revision, out = 0, list[tuple[str, bytes]]()
        while True:
            resp = await self._call(self._kv.get(start, range_end=stop, revision=revision, limit=RANGE_PAGE_KEYS,
                                                 sort_order=SortOrder.ASCEND, sort_target=SortTarget.KEY),
                                    timeout_s=max(self.timeout_s, RANGE_PAGE_TIMEOUT_S))
            revision = revision or int(resp.header.revision)
            out.extend((kv_.key.decode(), kv_.value) for kv_ in resp.kvs)
            if not resp.more or not resp.kvs:
                return revision, out
            start = resp.kvs[-1].key + b"\0"  # the next key after the last one read

    async def watch_prefix(self, prefix: str, start_revision: int, end: str = ""
                           ) -> AsyncIterator[tuple[int, list[tuple[str, bytes | None]], bool]]:
        """Changes under ``prefix`` (or in [``prefix``, ``end``)) from ``start_revision``: (revision,
        [(key, value or None when deleted)], compacted). ``compacted``: etcd no longer holds the
        revisions asked for."""
        assert self._client is not None and self._client.watch is not None
        key = prefix.encode()
        try:
            async for resp in self._client.watch.watch(key, range_end=end.encode() if end else prefix_range_end(key),
                                                       start_revision=start_revision):
                events = [(ev.kv.key.decode(), None if ev.type == DELETE_EVENT else ev.kv.value) for ev in resp.events]
                yield int(resp.header.revision), events, bool(resp.compact_revision or resp.canceled)
        except (EtcdError, OSError, grpc.RpcError) as exc:
            raise Unreachable(f"watch: {type(exc).__name__}: {exc}"[:300]) from None

    async def placed_at(self, topic: str) -> int:
        """The revision ``topic``'s placement record was last written at (0: etcd holds none), read
        linearizably: what a node's watched copy must reach before it may say the topic is unknown."""
        resp = await self._call(self._kv.get(self.root_key(f"topics/{topic}"), keys_only=True))
        return int(resp.kvs[0].mod_revision) if resp.kvs else 0

    async def create_placements(self, records: dict[str, bytes]) -> int:
        """Each topic's placement record, only if none of them exists (all or none); the revision
        they were written at, 0 when one existed."""
        kv = self._kv
        compare = [kv.txn_compare_create_revision(self.root_key(f"topics/{t}"), 0) for t in records]
        success = [kv.txn_op_put(self.root_key(f"topics/{t}"), v) for t, v in records.items()]
        resp = await self._call(kv.txn(compare, success))
        return int(resp.header.revision) if resp.succeeded else 0

    async def create_slot(self, slot: int, record: bytes) -> int:
        """A group slot's shard, only if the slot has none yet; the revision written at, 0 when one
        was given meanwhile."""
        kv = self._kv
        key = self.root_key(f"slots/{slot}")
        resp = await self._call(kv.txn([kv.txn_compare_create_revision(key, 0)], [kv.txn_op_put(key, record)]))
        return int(resp.header.revision) if resp.succeeded else 0

    async def replace_slot(self, slot: int, expected: bytes, record: bytes, leader_revision: int = 0) -> int:
        """Replace a group slot's record (a move's steps) if it still holds ``expected`` and, given
        ``leader_revision``, while our leader key still stands; the revision written at, 0 if not."""
        return await self._replace(self.root_key(f"slots/{slot}"), expected, record, leader_revision)

    async def replace_placement(self, topic: str, expected: bytes, record: bytes, leader_revision: int = 0) -> int:
        """Replace a topic's record (a tombstone on delete, a move's steps) if it still holds
        ``expected`` and, given ``leader_revision``, while our leader key still stands (a move's
        seal: a deposed master cannot write it); the revision written at, 0 when either failed."""
        return await self._replace(self.root_key(f"topics/{topic}"), expected, record, leader_revision)

    async def _replace(self, key: bytes, expected: bytes, record: bytes, leader_revision: int) -> int:
        kv = self._kv
        compare = [kv.txn_compare_value(key, expected)]
        if leader_revision:
            compare.append(kv.txn_compare_create_revision(self.key("leader"), leader_revision))
        resp = await self._call(kv.txn(compare, [kv.txn_op_put(key, record)]))
        return int(resp.header.revision) if resp.succeeded else 0

    async def set_draining(self, shard: str, draining: bool) -> int:
        """Mark ``shard`` draining (new queues avoid it, a rebalance moves its queues away), or not;
        the revision written at."""
        kv = self._kv
        key = self.root_key(f"state/draining/{shard}")
        op = kv.txn_op_put(key, b"{}") if draining else kv.txn_op_delete(key)
        resp = await self._call(kv.txn([], [op]))
        return int(resp.header.revision)

    async def upgrade_pair(self, view: View) -> bool:
        """A one-pair cluster's keys into this shard's, in place: its epoch counter and in-sync set
        move under ``shards/<shard>/`` (so epochs keep growing and only the pair's in-sync nodes
        may be elected), and the root's ``sharded`` marker keeps a one-pair node from campaigning
        there again. Only while no master of the pair holds the root's leader key, and nothing
        changed since ``view``."""
        kv = self._kv
        compare = [kv.txn_compare_create_revision(self.root_key("leader"), 0),
                   kv.txn_compare_version(self.root_key("epoch"), view.pair_epoch.version),
                   kv.txn_compare_version(self.root_key("insync"), view.pair_insync.version),
                   kv.txn_compare_create_revision(self.root_key("sharded"), 0),
                   kv.txn_compare_create_revision(self.key("epoch"), 0),
                   kv.txn_compare_create_revision(self.key("leader"), 0)]
        success = [kv.txn_op_put(self.key("epoch"), view.pair_epoch.value),
                   kv.txn_op_put(self.root_key("sharded"), rec.encode(rec.Sharded(self.shard))),
                   kv.txn_op_delete(self.root_key("epoch")),
                   kv.txn_op_delete(self.root_key("insync")),
                   kv.txn_op_delete(self.root_key("switchover"))]
        if view.pair_insync.version:
            success.append(kv.txn_op_put(self.key("insync"), view.pair_insync.value))
        resp = await self._call(kv.txn(compare, success))
        return bool(resp.succeeded)

    async def set_insync(self, leader_revision: int, insync: rec.InSync) -> bool:
        """Write the in-sync set, only while our leader key (``leader_revision``) still stands."""
        kv = self._kv
        resp = await self._call(kv.txn([kv.txn_compare_create_revision(self.key("leader"), leader_revision)],
                                       [kv.txn_op_put(self.key("insync"), rec.encode(insync))]))
        return bool(resp.succeeded)

    async def resign(self, leader_revision: int, insync: rec.InSync | None = None) -> bool:
        """Give up the leader key (a switchover), with the in-sync set the successor must be in."""
        kv = self._kv
        success = [kv.txn_op_delete(self.key("leader"))]
        if insync is not None:
            success.append(kv.txn_op_put(self.key("insync"), rec.encode(insync)))
        resp = await self._call(kv.txn([kv.txn_compare_create_revision(self.key("leader"), leader_revision)], success))
        return bool(resp.succeeded)

    async def publish_topology(self, topology: rec.Topology, lease_id: int) -> None:
        """Where this shard serves (its master writes it, bound to its lease: gone with it)."""
        await self._call(self._kv.put(self.root_key(f"topology/{self.shard}"), rec.encode(topology), lease=lease_id))

    async def register(self, node: rec.Node, lease_id: int) -> None:
        await self._call(self._kv.put(self.key(f"nodes/{node.node_id}"), rec.encode(node), lease=lease_id))

    async def request_switchover(self, switchover: rec.Switchover, lease_id: int) -> bool:
        """Ask for a handover; refused while another request stands."""
        kv = self._kv
        resp = await self._call(kv.txn([kv.txn_compare_create_revision(self.key("switchover"), 0)],
                                       [kv.txn_op_put(self.key("switchover"), rec.encode(switchover), lease=lease_id)]))
        return bool(resp.succeeded)

    async def cancel_switchover(self, version: int) -> None:
        kv = self._kv
        await self._call(kv.txn([kv.txn_compare_version(self.key("switchover"), version)],
                                [kv.txn_op_delete(self.key("switchover"))]))
