"""The demo's last part: one namespace over two shards (docs/shards.md), a failover in one while
the other serves, a group and a transaction over both, a queue moved between them, all through
one client bootstrapped from a single node."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import crc32c

from broker.cli.node_process import NodeProcess
from broker.client import BrokerClient, BrokerError, Message
from broker.group_slots import slot_of

CLUSTER = "shop"
QUEUES = 4


def _master(nodes: list[NodeProcess]) -> NodeProcess | None:
    for node in nodes:
        try:
            with BrokerClient(node.address, timeout_s=1.0) as c:
                st = c.status()
        except BrokerError:
            continue
        if st["role"] == "master" and (st.get("coordinator") or {}).get("leader") == st.get("node_id"):
            return node
    return None


def _key_on(owners: list[str], shard: str) -> str:
    return next(k for k in (f"cart-{i}" for i in range(10_000)) if owners[crc32c.crc32c(k.encode()) % len(owners)] == shard)


def run(work: str, etcd_endpoint: str, say: Callable[[str], None], wait: Callable[..., None]) -> list[NodeProcess]:
    """Shards s1 (node-c, node-d) and s2 (node-e); returns the nodes (the caller stops them)."""
    config = {"coordinator.endpoints": etcd_endpoint, "coordinator.cluster": CLUSTER}
    s1 = [NodeProcess(f"{work}/{n}", config={**config, "coordinator.shard": "s1"}) for n in ("node-c", "node-d")]
    s2 = [NodeProcess(f"{work}/node-e", config={**config, "coordinator.shard": "s2"})]
    nodes = [*s1, *s2]
    s1[0].start()
    s2[0].start()
    wait(lambda: _master(s1[:1]) is not None and _master(s2) is not None)
    s1[1].start()
    with BrokerClient(s1[0].address) as c:
        wait(lambda: len(c.status()["coordinator"]["insync"]) == 2)
    with BrokerClient(s2[0].address) as c:  # one client, bootstrapped from s2's only node
        c.create_topic("carts", queues=QUEUES)
        owners = [q["shard"] for q in c.describe_topic("carts")["queues"]]
        shards = {s["shard"]: s for s in c.cluster_status()["shards"]}
        say(f"12. cluster {CLUSTER!r}: shard s1 (master {shards['s1']['master']}, 2 nodes) and s2 (master "
            f"{shards['s2']['master']}, 1 node); topic 'carts' created on node-e and placed in etcd: queues "
            + ", ".join(f"{q}->{s}" for q, s in enumerate(owners)))
        probe = [Message(body=b"probe", key=f"probe-{i}") for i in range(32)]

        def all_writable() -> bool:
            try:
                c.send("carts", probe)
            except BrokerError:
                return False
            return True

        wait(all_writable)
        sent = c.send("carts", [Message(body=f"item {i}".encode(), key=f"cart-{i % 100}") for i in range(1000)])
        on = {s: sum(1 for r in sent if owners[r.queue_id] == s) for s in ("s1", "s2")}
        say(f"12b. one send of 1,000 keyed messages from a client that knows one node: split per shard, {on['s1']} "
            f"to s1's master and {on['s2']} to s2's, side by side; each key keeps its queue")
        acks: list[float] = []
        stop = threading.Event()
        key2 = _key_on(owners, "s2")

        def steady() -> None:  # s2's queue, through s1's failover, on the same client
            while not stop.is_set():
                c.send("carts", [Message(body=b"steady", key=key2)])
                acks.append(time.monotonic())

        t = threading.Thread(target=steady, daemon=True)
        t.start()
        time.sleep(0.5)
        m1 = _master(s1)
        assert m1 is not None
        m1.kill9()
        killed = time.monotonic()
        c.send("carts", [Message(body=b"after the failover", key=_key_on(owners, "s1"))])
        served = time.monotonic() - killed
        time.sleep(0.5)
        stop.set()
        t.join(10)
        around = [a for a in acks if a >= killed - 0.5]
        gap = max((b - a for a, b in itertools.pairwise(around)), default=0.0)
        say(f"13. kill -9 of s1's master: its queues served again {served:.2f}s later (etcd elected its slave; the "
            f"client's routes still named the dead node); s2's queue took {len(around)} sends meanwhile, longest gap "
            f"{gap * 1000:.0f} ms")
        m1 = _master(s1)
        assert m1 is not None
        with BrokerClient(m1.address) as c1:
            _group_over_shards(c, c1, owners, say, wait)
        _transaction_over_shards(c, owners, say)
        _move_queue(c, owners, say)
        _move_slot(c, say)
    return nodes


def _move_queue(c: BrokerClient, owners: list[str], say: Callable[[str], None]) -> None:
    """Step 16: a queue of s1 moves to s2 under a keyed producer, no data copied; a rebalance after."""
    key = _key_on(owners, "s1")
    q = c.pick_queue("carts", key)
    acks: list[float] = []
    sent: list[int] = []
    stop = threading.Event()

    def producer() -> None:
        while not stop.is_set():
            sent.append(c.send("carts", [Message(body=b"moving", key=key)], ack="replica")[0].queue_offset)
            acks.append(time.monotonic())

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    time.sleep(0.3)
    asked = time.monotonic()
    segments = c.move_queue("carts", q, "s2")
    time.sleep(0.3)
    stop.set()
    t.join(10)
    after = [a for a in acks if a >= asked]
    pause = (after[0] - asked) if after else 0.0
    pause = max([pause, *(b - a for a, b in itertools.pairwise(after))])
    offsets = [m.queue_offset for r in c.iter_pull("carts", q, 0) for m in r]
    whole = offsets == list(range(len(offsets))) and set(sent) <= set(offsets)
    rebalanced = c.rebalance()
    say(f"16. queue {q} of 'carts' moved from s1 to s2 with no data copied: sealed on s1 at offset "
        f"{segments[0]['end']}, continued on s2 from there; a keyed ack=replica producer paused {pause * 1000:.0f} ms "
        f"and its {len(sent)} messages are read back across both segments, offsets 0..{len(offsets) - 1} "
        f"{'all there' if whole else 'NOT CONTIGUOUS'}; then `cluster rebalance` evened the shards out with "
        f"{len(rebalanced)} move(s)")


def _move_slot(c: BrokerClient, say: Callable[[str], None]) -> None:
    """Step 17: the slot coordinating group 'billing' moves to the other shard, offsets and all."""
    slot = slot_of("billing")
    before = [c.committed_offset("billing", "carts", q) for q in range(QUEUES)]
    source = c.describe_group("billing")["shard"]
    target = "s2" if source == "s1" else "s1"
    started = time.monotonic()
    c.move_slot(slot, target)
    took = time.monotonic() - started
    after = [c.committed_offset("billing", "carts", q) for q in range(QUEUES)]
    say(f"17. the slot of group 'billing' ({slot}) moved from {source} to {target} in {took:.2f}s (`cluster move-slot`; a "
        f"drain moves every slot of its shard): committed offsets {after} "
        f"{'went along' if after == before else f'CHANGED from {before}'}; {c.describe_group('billing')['shard']} "
        "coordinates it now")


def _transaction_over_shards(c: BrokerClient, owners: list[str], say: Callable[[str], None]) -> None:
    """Step 15: one transaction over queues of both shards, invisible on each until it commits."""
    keys = {shard: _key_on(owners, shard) for shard in ("s1", "s2")}
    queues = {shard: c.pick_queue("carts", key) for shard, key in keys.items()}
    ends = {shard: c.pull("carts", q, 0, max_messages=1).max_offset for shard, q in queues.items()}

    def visible() -> dict[str, int]:
        return {shard: sum(1 for _ in c.iter_pull("carts", q, ends[shard])) for shard, q in queues.items()}

    with c.transaction("checkout-1") as tx:
        tx.send("carts", [Message(body=f"paid on {shard}".encode(), key=key) for shard, key in keys.items()])
        before = visible()
    after = visible()
    say(f"15. transaction 'checkout-1' over both shards (coordinator {getattr(tx, 'coordinator', '?')}, the id's "
        f"slot): its message on each shard invisible to read_committed readers until the commit ({before}), then "
        f"visible on both ({after}): two-phase commit, prepared on the participant, decided on the coordinator")


def _group_over_shards(c2: BrokerClient, c1: BrokerClient, owners: list[str], say: Callable[[str], None],
                       wait: Callable[..., None]) -> None:
    """Step 14: one consumer group, a member bootstrapped from each shard's node, over both shards."""
    total = sum(c2.list_topics()["carts"]["stable_offsets"])
    members = [c.consumer("billing", "carts", auto_offset_reset="earliest") for c in (c2, c1)]
    try:
        wait(lambda: sum(len(m.assignment) for m in members) == QUEUES and all(m.assignment for m in members))
        seen: set[tuple[int, int]] = set()
        read = 0

        def everything() -> bool:
            nonlocal read
            for m in members:
                got = m.poll(100)
                read += len(got)
                seen.update((msg.queue_id, msg.queue_offset) for msg in got)
            return read >= total

        wait(everything)
        for m in members:
            m.commit()
        held = [sorted(q for _, q in m.assignment) for m in members]
        described = c2.describe_group("billing")
        lag = sum(q["lag"] for q in described["queues"])
    finally:
        for m in members:
            m.close()
    twice = read - len(seen)
    say(f"14. group 'billing': a member bootstrapped from each shard's node; they share the {QUEUES} queues of both "
        f"shards ({' and '.join(str(h) for h in held)}; queue shards {owners}); {read} messages read, {twice} twice; "
        f"committed to the group's coordinator shard, lag {lag} as any node describes it")
