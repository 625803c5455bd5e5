"""``tidemark log quarantine DATA_DIR``: what was cut from the commit log and kept in ``quarantine/``.

Two cuts keep what they remove (``broker/storage/quarantine.py``): recovery's torn tail
(``torn-S-E.broken``) and a divergence from a new master (``diverged-S-E.log``: after an unclean
election it can hold writes that were acknowledged). The daemon never reads them back and nothing
deletes them; this is how an operator sees what they hold before deciding.

Reads only (it may run beside a live daemon). One line per file: its kind, its offsets, its bytes,
the whole valid batches and their records from its start (and where and why the walk stopped, for a
torn tail), then one line per topic and queue: records, queue offsets, epochs and store times.
``--records`` prints instead one JSON object per record of the valid batches (topic, queue, queue
offset, store time, producer id, sequence, key, properties, body in base64), so the records can be
checked against the master's log or sent again. Exit 0; 1 when a file there is not named as a cut
log range (named, not read); 2 when DATA_DIR is not a directory.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from broker.logformat import batch as bf
from broker.logformat.scan import Mode, Scan
from broker.storage.quarantine import QUARANTINE

NAME = re.compile(r"^(torn|diverged)-(\d{20})-(\d{20})\.(broken|log)$")
CHUNK_BYTES = 8 << 20


@dataclass
class QueueSummary:
    records: int = 0
    first_queue_offset: int = -1
    next_queue_offset: int = 0
    epochs: set[int] = field(default_factory=set)
    first_store_ms: int = 0
    last_store_ms: int = 0

    def add(self, h: bf.BatchHeader) -> None:
        if self.first_queue_offset < 0:
            self.first_queue_offset = h.base_queue_offset
            self.first_store_ms = h.store_time_ms
        self.records += h.record_count
        self.next_queue_offset = max(self.next_queue_offset, h.next_queue_offset)
        self.epochs.add(h.epoch)
        self.last_store_ms = max(self.last_store_ms, h.store_time_ms)


@contextmanager
def _batches(path: str, start: int) -> Iterator[Scan]:
    """A scan of the file's whole valid batches, at their original offsets."""
    with open(path, "rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(offset - start)
            return f.read(length)

        yield Scan(read, start, start + os.fstat(f.fileno()).st_size, mode=Mode.TORN_TAIL, verify_body=True,
                   check_offsets=True, chunk_bytes=CHUNK_BYTES, path=path)


def _cut_ranges(qdir: str) -> Iterator[tuple[str, str, int, int]]:
    """(path, kind, start, declared end) of each cut log range; other names as kind ``""``."""
    for name in sorted(os.listdir(qdir)):
        m = NAME.match(name)
        path = os.path.join(qdir, name)
        if m is None:
            yield path, "", 0, 0
        else:
            yield path, m.group(1), int(m.group(2)), int(m.group(3))


def _summary(path: str, kind: str, start: int, end: int) -> list[str]:
    size = os.path.getsize(path)
    queues: dict[tuple[str, int], QueueSummary] = {}
    batches = records = 0
    with _batches(path, start) as scan:
        for h, _ in scan:
            batches += 1
            records += h.record_count
            queues.setdefault((h.topic, h.queue_id), QueueSummary()).add(h)
    lines = [f"{path}: {kind}, offsets [{start}, {end}), {size} bytes; {batches} whole batches, {records} records"]
    if size != end - start:
        lines[0] += f"; the name says {end - start} bytes"
    if scan.stop is not None:
        lines[0] += f"; valid up to offset {scan.stop.offset} ({scan.stop.problem.value}: {scan.stop.error})"
    for (topic, q), s in sorted(queues.items()):
        lines.append(f"  {topic}/{q}: {s.records} records, queue offsets [{s.first_queue_offset}, {s.next_queue_offset}), "
                     f"epochs {','.join(str(e) for e in sorted(s.epochs))}, store time {s.first_store_ms}..{s.last_store_ms} ms")
    return lines


def _records(path: str, start: int, out: IO[str]) -> None:
    with _batches(path, start) as scan:
        for h, batch in scan:
            for i, (_, key, props, body) in enumerate(bf.iter_records(batch, h)):
                out.write(json.dumps({
                    "file": os.path.basename(path), "topic": h.topic, "queue_id": h.queue_id,
                    "queue_offset": h.base_queue_offset + i, "commit_offset": h.base_offset, "epoch": h.epoch,
                    "store_time_ms": h.store_time_ms, "producer_id": h.producer_id,
                    "sequence": h.base_sequence + i if h.base_sequence >= 0 else h.base_sequence,
                    "key": bytes(key).decode("utf-8", "replace") if len(key) else None,
                    "properties": bf.decode_props(props) if len(props) else {},
                    "body_b64": base64.b64encode(body).decode("ascii"),
                }) + "\n")


def show_quarantine(data_dir: str, *, records: bool, out: IO[str], err: IO[str]) -> int:
    if not os.path.isdir(data_dir):
        err.write(f"tidemark: {data_dir}: not a directory\n")
        return 2
    qdir = os.path.join(data_dir, QUARANTINE)
    if not os.path.isdir(qdir):
        if not records:
            out.write(f"{qdir}: none (nothing was ever cut from this node's log)\n")
        return 0
    unknown = 0
    total_bytes = files = 0
    for path, kind, start, end in _cut_ranges(qdir):
        if not kind:
            unknown += 1
            err.write(f"{path}: not a cut log range (named torn-S-E.broken or diverged-S-E.log); not read\n")
            continue
        files += 1
        total_bytes += os.path.getsize(path)
        if records:
            _records(path, start, out)
        else:
            out.write("\n".join(_summary(path, kind, start, end)) + "\n")
    if not records:
        out.write(f"{qdir}: {files} cut log ranges, {total_bytes} bytes\n")
    return 1 if unknown else 0
