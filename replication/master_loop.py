"""The master's replication stream on the client port's event loop (the default: no ``replication.listen``).

The same stream as ``MasterSide.Stream`` (handshake, shipping and acks are shared with it), run as
coroutines. A send's append runs on this loop, so the stream wakes on the loop, reads what was
appended and hands it to gRPC without crossing a thread; the slave's acks are read on the loop
too, and the confirm offset they move releases the waiting sends there. Measured on a pair at
full ack=replica load, the stream run in a thread of its own (bridged to the loop) spent about
2.3 ms of a write's path to the slave and back in hand-offs between threads: waking the shipping
thread, its message waiting for the busy loop, an ack passed to a reader thread and back.

What runs on the loop is short: the handshake, an ack's bookkeeping, and reading one chunk
(``replication.chunk_bytes``) at a time from the page cache (within ``commitlog.cache_window_bytes``
of the log end). A slave catching up from further back reads in a worker thread, so a cold
segment's disk reads never hold the loop. Only those: a worker waits for the interpreter lock
while the loop is busy, so at full load a slave read that way from one chunk behind stayed 200-400
MiB behind (in sync 19% of the time); it reads ``COLD_READ_CHUNKS`` chunks per hop. At most
``STREAMS_MAX`` streams are open at once; more are refused (RESOURCE_EXHAUSTED), and a slave
refused retries with its backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import structlog

from proto import tidemark_pb2 as pb
from replication.confirm import Replica
from replication.master import MasterSide
from replication.protocol import Refused
from replication.shipping import Shipper

log = structlog.get_logger("replication.master")
STREAMS_MAX = 32  # replication streams at once on the client port (slaves reconnecting are a handful)
COLD_READ_CHUNKS = 8  # chunks read per hop to a worker (a slave beyond the cache window)


class LoopReplication:
    """The ``Replication`` servicer for the asyncio server: ``Stream`` as coroutines, ``Snapshot``
    as ``MasterSide``'s blocking generator (the daemon runs it in a thread: ``add_blocking_servicer``)."""

    def __init__(self, side: MasterSide) -> None:
        self.side = side
        self._streams = 0  # open streams (all on the loop's thread)

    def Snapshot(self, request: pb.SnapshotRequest, context: Any) -> Iterator[pb.SnapshotChunk]:
        return self.side.Snapshot(request, context)

    async def Stream(self, request_iterator: AsyncIterator[pb.SlaveMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MasterMessage]:
        if self._streams >= STREAMS_MAX:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{STREAMS_MAX} replication streams are open already")
        self._streams += 1
        side = self.side
        try:
            first = await anext(aiter(request_iterator), None)
            replica, start, welcome = side.handshake(first, context.peer())
        except Refused as r:
            self._streams -= 1
            await context.abort(r.code, r.details)
            return
        acked = asyncio.Event()  # set by each ack: a stream whose window is full waits for it
        reading = asyncio.ensure_future(self._read_acks(request_iterator, replica, acked))
        loop = asyncio.get_running_loop()
        try:
            yield welcome
            shipper = Shipper(side.store, side.config, side.insync, replica, start)
            cached_bytes = side.config["commitlog.cache_window_bytes"]
            while shipper.streaming():
                acked.clear()  # before the window is looked at: an ack from now on wakes the wait
                # a worker waits for the interpreter lock while the loop is busy: only cold reads go there
                if shipper.behind_bytes() <= cached_bytes:
                    msg = shipper.next_message()
                    if msg is None:
                        await shipper.wait_async(acked)
                    else:
                        yield msg
                    continue
                msgs = await loop.run_in_executor(None, shipper.next_messages, COLD_READ_CHUNKS)
                if not msgs:
                    await shipper.wait_async(acked)
                for msg in msgs:
                    if not shipper.streaming():  # fenced, demoted or closing meanwhile: not another chunk
                        break
                    yield msg
            if replica.evicted:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replication protocol violation: {replica.evicted}")
        except Refused as r:
            await context.abort(r.code, r.details)
        finally:
            self._streams -= 1
            reading.cancel()
            side.ended(replica)

    async def _read_acks(self, request_iterator: AsyncIterator[pb.SlaveMessage], replica: Replica, acked: asyncio.Event) -> None:
        try:
            async for msg in request_iterator:
                if not self.side.on_ack(msg, replica):
                    break
                acked.set()
        except grpc.RpcError:
            pass
        except Exception as exc:  # never silently: the stream ends and the log says why
            log.error("replica_acks_failed", node=replica.node_id, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.side.reader_ended(replica)
            acked.set()  # a stream waiting for the window to open learns at once that it ends
