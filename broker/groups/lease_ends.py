"""Ending leases: ack, nack, a changed lease (pop mode, DESIGN §12). An ack of a run names it by
its one handle; a lease that ended already is refused per handle (FAILED_PRECONDITION: the message
is or will be delivered again)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from broker.errors import BrokerError, invalid, shown
from broker.groups import receipts
from broker.groups.pop_locks import QueueKey
from broker.groups.pop_parts import FAILED_PRECONDITION, REASONS, TWICE, PopParts, now_ms, record_batch
from broker.logformat import pop_records as pr
from broker.ports import IncomingBatch
from broker.views.pop_leases import ENDED, NOT_LEASED

EndResult = list[tuple[str, int, str]] | BrokerError  # a call's ends: (handle, code, why) of each refused, or its error


@dataclass(slots=True)
class Ends:
    """Calls' handles to end, decoded (``LeaseEnds.resolve_ends``)."""

    calls: list[list[str]]
    results: list[EndResult]  # per call: its refusals so far, or its error
    resolved: list[receipts.Handle]
    owner: list[tuple[int, int]]  # per resolved handle: its call and its place in it

    def keys(self, group: str) -> list[QueueKey]:
        return [(group, h.topic, h.queue_id) for h in self.resolved]


class LeaseEnds(PopParts):
    def _resolve(self, group: str, handles: list[str]) -> list[receipts.Handle]:
        """Decode every handle; a malformed one, or one from another cluster or a future epoch,
        refuses the whole call (INVALID_ARGUMENT) before anything changes."""
        self.check_group(group)
        if not handles:
            raise invalid("no receipt handles")
        if len(handles) > self.config["groups.pop_messages_max"]:
            raise invalid(f"{len(handles)} receipt handles in one call; at most groups.pop_messages_max "
                          f"({self.config['groups.pop_messages_max']})")
        out = []
        cluster, epoch = self.cluster, self.store.epoch
        decoder = receipts.Decoder()
        messages, messages_max = 0, self.config["groups.pop_window_max"]
        for text in handles:
            try:
                h = decoder.decode(text)
            except ValueError as exc:
                raise invalid(f"receipt handle {shown(text)}: {exc}") from None
            if h.cluster != cluster:
                raise invalid(f"receipt handle {shown(text)} is from another cluster")
            if h.epoch > epoch:
                raise invalid(f"receipt handle {shown(text)} names epoch {h.epoch}, newer than this master's {epoch}")
            messages += h.length
            if messages > messages_max:
                raise invalid(f"the receipt handles name more than groups.pop_window_max ({messages_max}) messages")
            out.append(h)
        return out

    def _current(self, group: str, resolved: list[receipts.Handle], now: int) -> tuple[dict[tuple[str, int], np.ndarray],
                                                                                        list[tuple[int, str]]]:
        """Under the view lock: the offsets whose leases the handles still name, per (topic, queue),
        and (index, reason) for every other handle."""
        by_lease: dict[tuple[str, int, int], list[int]] = {}
        for i, h in enumerate(resolved):
            by_lease.setdefault((h.topic, h.queue_id, h.tag), []).append(i)
        ok: dict[tuple[str, int], list[np.ndarray]] = {}
        refused: list[tuple[int, str]] = []
        for (topic, q, tag), idxs in by_lease.items():
            if len(idxs) == 1:  # one run of a lease (a consumer acking what one pop gave it): no repeats
                h = resolved[idxs[0]]
                offsets = np.arange(h.offset, h.offset + h.length, dtype=np.int64)
                lengths = np.array([h.length], dtype=np.int64)
                owner = np.zeros(offsets.size, dtype=np.int64)
            else:
                firsts = np.fromiter((resolved[i].offset for i in idxs), dtype=np.int64, count=len(idxs))
                lengths = np.fromiter((resolved[i].length for i in idxs), dtype=np.int64, count=len(idxs))
                owner = np.repeat(np.arange(len(idxs)), lengths)  # the handle each offset comes from
                offsets = (np.repeat(firsts, lengths) + np.arange(owner.size)
                           - np.repeat(np.cumsum(lengths) - lengths, lengths))
            pq = self.view.queue(group, topic, q)
            reasons = pq.check(offsets, tag, now) if pq is not None else np.full(offsets.size, NOT_LEASED, np.int8)
            if len(idxs) > 1:
                _, first = np.unique(offsets, return_index=True)
                repeated = np.ones(offsets.size, dtype=bool)
                repeated[first] = False
                reasons[(reasons == 0) & repeated] = TWICE
            bad = np.flatnonzero(reasons)
            if bad.size:
                n_bad = np.bincount(owner[bad], minlength=len(idxs))
                shown_at = {int(owner[j]): int(reasons[j]) for j in bad[::-1].tolist()}  # the first reason of each
                for k, why in sorted(shown_at.items()):
                    text = REASONS[why]
                    if lengths[k] > 1:
                        text = f"{n_bad[k]} of the run's {lengths[k]} messages: {text}"
                    refused.append((idxs[k], text))
            good = offsets[reasons == 0]
            if len(idxs) > 1:  # several runs, in the handles' order
                good = np.sort(good)
            if good.size:
                ok.setdefault((topic, q), []).append(good)
        return {k: _merged(v) for k, v in ok.items()}, refused

    def _end(self, group: str, handles: list[str], kind: str, delay_ms: int = 0) -> list[tuple[str, int, str]]:
        """Ack (``pr.ACK``) or nack (``pr.NACK``) leases; return (handle, grpc code, reason) for each
        handle whose lease had ended already (the others are done)."""
        (result,) = self._end_many(group, [handles], kind, delay_ms)
        if isinstance(result, BrokerError):
            raise result
        return result

    def _end_many(self, group: str, calls: list[list[str]], kind: str,
                  delay_ms: int = 0) -> list[EndResult]:
        """``_end`` for several calls' handles in one record; each call gets its own refusals, or
        its own error (a malformed handle refuses its call alone, before anything changes)."""
        ends = self.resolve_ends(group, calls)
        if not ends.resolved:
            return ends.results
        end = 0
        with self.locks.holding(ends.keys(group)):
            batch, ended = self.ends_record(group, ends, kind, now_ms(), delay_ms)
            if batch is not None:
                end = self._append([batch])
                self.locks.appended([(group, t, q) for t, q in ended], end)
        if end:
            self._durable(end)
        return ends.results

    def resolve_ends(self, group: str, calls: list[list[str]], *, empty_ok: bool = False) -> Ends:
        """Every call's handles decoded (no lock held): a call with a malformed one gets its error
        as its result; a handle repeated from an earlier call is refused (ended already).
        ``empty_ok``: a call without handles (a pop carrying no acks) ends nothing, unrefused."""
        self.check_group(group)
        ends = Ends(calls, [], [], [])
        earlier: set[str] = set()  # handles of the calls before: a repeat in a later call ends nothing more
        for c, handles in enumerate(calls):
            if not handles and empty_ok:
                ends.results.append([])
                continue
            try:
                mine = self._resolve(group, handles)
            except BrokerError as exc:
                ends.results.append(exc)
                continue
            repeats: list[tuple[str, int, str]] = []
            for j, h in enumerate(mine):
                if handles[j] in earlier:
                    repeats.append((handles[j], FAILED_PRECONDITION, REASONS[ENDED]))
                else:
                    ends.resolved.append(h)
                    ends.owner.append((c, j))
            earlier.update(handles)
            ends.results.append(repeats)
        return ends

    def ends_record(self, group: str, ends: Ends, kind: str, now: int,
                    delay_ms: int = 0) -> tuple[IncomingBatch | None, dict[tuple[str, int], np.ndarray]]:
        """With the locks of ``ends.keys`` held: the record ending the leases the handles still
        name (None: none does) and the offsets it ends per (topic, queue); every other handle's
        refusal is added to its call's result."""
        with self.view.lock:
            ok, refused = self._current(group, ends.resolved, now)
        for i, why in refused:
            c, j = ends.owner[i]
            call_result = ends.results[c]
            assert isinstance(call_result, list)
            call_result.append((ends.calls[c][j], FAILED_PRECONDITION, why))
        if not ok:
            return None, ok
        items = [[t, q, pr.to_runs(offs)] for (t, q), offs in sorted(ok.items())]
        record: dict[str, object]
        if kind == pr.ACK:
            record = {"g": group, "acks": items}
        else:
            record = {"g": group, "nacks": items, "until": now + delay_ms}
        return record_batch(kind, record), ok

    def ack_many(self, group: str, calls: list[list[str]]) -> list[EndResult]:
        """Acks of several calls in one record (``_end_many``)."""
        return self._end_many(group, calls, pr.ACK)

    def ack(self, group: str, handles: list[str]) -> list[tuple[str, int, str]]:
        return self._end(group, handles, pr.ACK)

    def nack(self, group: str, handles: list[str], delay_ms: int) -> list[tuple[str, int, str]]:
        if delay_ms:
            self._check_duration("delay_ms", delay_ms)
        return self._end(group, handles, pr.NACK, delay_ms)

    def change_invisible(self, group: str, handle: str, invisible_ms: int) -> str:
        """Move one lease's deadline to now + ``invisible_ms``; return its new handle."""
        self._check_duration("invisible_ms", invisible_ms)
        (h,) = self._resolve(group, [handle])
        if h.length != 1:
            raise invalid("change_invisible takes one message's receipt handle, not a run's")
        key = (group, h.topic, h.queue_id)
        with self.locks.holding([key]):
            now = now_ms()
            with self.view.lock:
                _, refused = self._current(group, [h], now)
            if refused:
                raise BrokerError("FAILED_PRECONDITION", refused[0][1])
            tag = secrets.randbits(63) + 1
            record = {"g": group, "t": h.topic, "q": h.queue_id, "o": h.offset, "until": now + invisible_ms, "tag": tag}
            end = self._append([record_batch(pr.INVISIBLE, record)])
            self.locks.appended([key], end)
        self._durable(end)
        return receipts.encode(h._replace(epoch=self.store.epoch, tag=tag))


def _merged(parts: list[np.ndarray]) -> np.ndarray:
    """Ascending distinct offsets (each part is: a lease's repeats are refused) merged into one: the
    parts of different leases of a queue are disjoint, most often runs one after another."""
    if len(parts) == 1:
        return parts[0]
    joined = np.concatenate(sorted(parts, key=lambda a: int(a[0])))
    return joined if bool(np.all(joined[1:] > joined[:-1])) else np.unique(joined)
