"""What the master sends one replica next, apart from how its stream waits and writes.

A stream is two loops around this: the blocking one of ``master.py`` (a thread per replica, on the
separate ``replication.listen`` server) and the one on the client port's event loop
(``master_loop.py``), where the append that wakes it, the send and the replica's acks all run on
the same thread, with no hand-off between threads on a write's path to the slave.

Each step is one of: the next whole batches (at most ``replication.chunk_bytes`` unless one batch
is bigger, and only while less than ``replication.window_bytes`` is sent and not yet
acknowledged), a heartbeat (the confirm offset moved, or ``HEARTBEAT_S`` passed), or nothing:
then the stream waits (``wait``, ``wait_async``) for the log to grow, an ack to open the window, or the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc

from broker.config import Config
from broker.store import Store
from proto import tidemark_pb2 as pb
from replication.confirm import InSyncSet, Replica
from replication.protocol import HEARTBEAT_S, Refused, read_whole_batches

WINDOW_FULL_WAIT_S = 0.01  # with the window full, a blocking stream looks again this often (one on the loop is woken by the ack)


def sent_stamp_us(monotonic_s: float) -> int:
    """A ``sent_at_us`` stamp: our monotonic clock, which the slave echoes in its ack."""
    return int(monotonic_s * 1_000_000)


@dataclass(frozen=True)
class Wait:
    """Nothing to send now: wait until the log grows past ``offset`` (None: only the timeout), at
    most ``timeout_s``."""

    offset: int | None
    timeout_s: float


class Shipper:
    def __init__(self, store: Store, config: Config, insync: InSyncSet, replica: Replica, pos: int) -> None:
        self.store = store
        self.insync = insync
        self.replica = replica
        self.pos = pos
        self._chunk_bytes = config["replication.chunk_bytes"]
        self._window_bytes = config["replication.window_bytes"]
        self._last_sent = 0.0
        self._last_confirm = -1

    def streaming(self) -> bool:
        """Whether the stream goes on: we are an unfenced master, not closing, the replica connected."""
        store = self.store
        return self.replica.connected and store.role == "master" and not store.closing and not store.fenced_reason

    def behind_bytes(self) -> int:
        """How far the replica's next message starts behind our log end."""
        return self.store.log.max_offset - self.pos

    def _window_full(self) -> bool:
        return self.pos - self.replica.acked_offset >= self._window_bytes

    def next_message(self) -> pb.MasterMessage | None:
        """The message to send now, or None (then ``wait()``)."""
        store, replica = self.store, self.replica
        end = store.log.max_offset
        if self.pos < end and not self._window_full():
            data = read_whole_batches(store, self.pos, self._chunk_bytes)
            if not data:  # never sent as an empty message again and again: the stream ends, saying why
                if self.pos < store.log.min_offset:  # retention removed it under a slave that lagged this far
                    raise Refused(grpc.StatusCode.OUT_OF_RANGE, f"the log at {self.pos} was removed (it starts at "
                                  f"{store.log.min_offset} now): bootstrap needed")
                raise Refused(grpc.StatusCode.DATA_LOSS, f"no whole batch could be read at {self.pos} (log end {end})")
            start, self.pos = self.pos, self.pos + len(data)
            replica.sent_end = self.pos  # before the send: the ack may come back before we resume
            return self._message(start, data, end)
        now = time.monotonic()
        if store.watermarks.confirm_offset != self._last_confirm or now - self._last_sent >= HEARTBEAT_S:
            return self._message(self.pos, b"", end)
        return None

    def next_messages(self, chunks_max: int) -> list[pb.MasterMessage]:
        """Up to ``chunks_max`` messages at once (a read from the disk in a worker: one hop for
        many chunks); stops at a heartbeat, a full window or the log end."""
        out: list[pb.MasterMessage] = []
        while len(out) < chunks_max:
            msg = self.next_message()
            if msg is None:
                break
            out.append(msg)
            if not msg.data.batches:
                break
        return out

    def _message(self, start: int, data: bytes, end: int) -> pb.MasterMessage:
        now = time.monotonic()
        if self.pos >= end:
            self.insync.sent_to_end(self.replica, self.pos)
        self._last_sent, self._last_confirm = now, self.store.watermarks.confirm_offset
        return pb.MasterMessage(data=pb.Data(start_offset=start, batches=data, confirm_offset=self._last_confirm,
                                             epoch=self.store.epoch, master_end=end, sent_at_us=sent_stamp_us(now)))

    def wait(self) -> None:
        """Block (a thread's stream) after ``next_message`` returned None."""
        w = self._wait()
        if w.offset is None:
            time.sleep(w.timeout_s)
        else:
            self.store.appender.wait_appended(w.offset, w.timeout_s)

    async def wait_async(self, acked: asyncio.Event | None = None) -> None:
        """``wait`` for a stream on the event loop. With the window full, ``acked`` (set by each ack
        that arrives after the stream last cleared it) wakes it; otherwise it looks again every
        ``WINDOW_FULL_WAIT_S``."""
        if acked is not None and self._window_full():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked.wait(), self._heartbeat_wait_s())
            return
        w = self._wait()
        if w.offset is None:
            await asyncio.sleep(w.timeout_s)
        else:
            await self.store.appender.wait_appended_async(w.offset, w.timeout_s)

    def _wait(self) -> Wait:
        if self._window_full():
            return Wait(None, WINDOW_FULL_WAIT_S)
        return Wait(self.pos, self._heartbeat_wait_s())

    def _heartbeat_wait_s(self) -> float:
        """Until the heartbeat's time, and at most half of it (a moved confirm offset is noticed)."""
        return min(max(0.0, self._last_sent + HEARTBEAT_S - time.monotonic()), HEARTBEAT_S / 2)
