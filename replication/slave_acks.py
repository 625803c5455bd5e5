"""The slave's acknowledgements, off its receive loop (a pipelined slave).

The receive loop appends each chunk the master sends and goes on to the next one; this thread
waits for the group-commit flusher to make what was appended durable and then answers with the
flushed offset. Appends, the fsync and the acknowledgement overlap: while one fsync runs, the
chunks that arrive meanwhile are appended, and the next fsync covers them all with one ack. A
heartbeat with nothing to flush is answered at once (the master learns we are alive).

An fsync slower than ``HEARD_EVERY_S`` does not silence us: while it runs, an ack every
``HEARD_EVERY_S`` repeats the flushed offset with the stamp of the newest message received. The
master's failsafe asks whether we still hear it (DESIGN §11), not how fast our disk is; waiting for
the fsync that covers a chunk received during the previous one left up to two fsyncs between acks.

How far the slave may run ahead of its fsyncs is bounded by the master's send window (bytes
sent and not yet acknowledged), not here.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import structlog

from broker.store.watermarks import Watermarks
from broker.threads import NamedThread
from proto import tidemark_pb2 as pb
from replication.protocol import HEARTBEAT_S

log = structlog.get_logger("replication.slave_acks")
PUT_RETRY_S = 0.1
FLUSH_WAIT_MS = 30_000  # an fsync that takes longer than this ends the stream (the follower reconnects)
HEARD_EVERY_S = HEARTBEAT_S  # while an fsync runs, say we hear the master at least this often


class FlushAcks:
    def __init__(self, watermarks: Watermarks, out: queue.Queue[object], coordinator_unreachable_ms: Callable[[], int],
                 on_error: Callable[[str], None], on_acked: Callable[[float], None]) -> None:
        self._wm = watermarks
        self._out = out
        self._unreachable_ms = coordinator_unreachable_ms
        self._on_error = on_error
        self._on_acked = on_acked
        self._cond = threading.Condition()
        # what the next ack must cover: the highest log end wanted, and when the master sent the
        # newest message wanting it (None: nothing wanted since the last ack)
        self._pending: tuple[int, float] | None = None
        # the master's stamp on the newest message received: every ack carries it, flushed or not
        # (the master's failsafe asks "does the slave still hear me?", not "what has it stored?")
        self._heard_stamp_us = 0
        self._stopped = False
        self.error = ""
        self._thread = NamedThread(target=self._run, name="follower-acks", daemon=True)

    def start(self) -> FlushAcks:
        self._thread.start()
        return self

    def want(self, end: int, heard_at: float, sent_at_us: int = 0) -> None:
        """Acknowledge once log end ``end`` (as of a message stamped ``sent_at_us`` by the master,
        sent at ``heard_at`` on our monotonic clock: send_clock.py) is flushed;
        ``on_acked(heard_at)`` is called once that acknowledgement is queued."""
        with self._cond:
            if self._pending is not None:
                end = max(end, self._pending[0])
            self._pending = (end, heard_at)
            self._heard_stamp_us = max(self._heard_stamp_us, sent_at_us)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(FLUSH_WAIT_MS / 1000.0 + 5)

    def _put(self, msg: pb.SlaveMessage) -> bool:
        """Queue an ack; a full queue (the stream stopped sending) never holds a stopping acker."""
        while not self._stopped:
            try:
                self._out.put(msg, timeout=PUT_RETRY_S)
                return True
            except queue.Full:
                continue
        return False

    def _ack(self) -> bool:
        """Queue an ack: the flushed offset, and the stamp of the newest message received."""
        with self._cond:
            heard_stamp_us = self._heard_stamp_us
        return self._put(pb.SlaveMessage(ack=pb.ReplicaAck(
            flushed_offset=self._wm.flushed_offset, coordinator_unreachable_ms=self._unreachable_ms(),
            heard_sent_at_us=heard_stamp_us)))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending is not None or self._stopped)
                    if self._stopped or self._pending is None:
                        return
                    (target, heard_at), self._pending = self._pending, None
                deadline = time.monotonic() + FLUSH_WAIT_MS / 1000.0
                while not self._wm.wait_flushed(target, HEARD_EVERY_S):
                    if self._stopped:
                        return
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"offset {target} not flushed within {FLUSH_WAIT_MS} ms")
                    if not self._ack():  # the fsync is slow: we still hear the master, and say so
                        return
                if self._ack():
                    self._on_acked(heard_at)
        except Exception as exc:  # never silently: the stream ends and the follower says why
            if self._stopped:  # a stop gave up the wait: nobody reads the ack any more
                return
            self.error = f"acknowledging flushed data failed: {type(exc).__name__}: {exc}"
            log.error("slave_acks_failed", error=self.error)
            self._on_error(self.error)
