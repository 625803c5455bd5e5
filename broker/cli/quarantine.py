"""``tidemark log quarantine DATA_DIR``: what was cut from the commit log and kept in ``quarantine/``.

Two cuts keep what they remove (``broker/storage/quarantine.py``): recovery's torn tail
(``torn-S-E.broken``) and a divergence from a new master (``diverged-S-E.log``: after an unclean
election it can hold writes that were acknowledged). The daemon never reads them back and nothing
deletes them; this is how an operator sees what they hold before deciding.

Reads only (it may run beside a live daemon). One line per file: its kind, its offsets, its bytes,
its valid batches and their records, each run of batches that fail their checks (stepped over, as ``log
verify`` does) or is cut short (the end of the walk), then one line per topic and queue: records,
queue offsets, epochs and store times. ``--records`` prints instead one JSON object per record of
the valid batches (topic, queue, queue offset, store time, producer id, sequence, flags, key,
properties, body in base64; a key or properties that are not UTF-8 in base64 too), and each
run of damaged batches as one line on stderr, so the records can be checked against the master's log or
sent again. Records of ``__`` topics are the broker's own (topic changes, offsets, timers, pop
leases): ``"system": true``, not to be sent again.

Exit 0; 1 when something could not be read: a file that cannot be opened or is not a regular
file (a FIFO, a symlink: refused, never waited on or followed), a name that is not a cut log range
(named, not read), a ``diverged-`` file with a damaged batch (it held whole batches
when kept; a ``torn-`` file is damaged by nature); 2 when DATA_DIR or its quarantine is not a
directory this user can read.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from broker.cli.verify import walk_file
from broker.logformat import batch as bf
from broker.logformat.scan import Damage, Stop
from broker.logformat.system_records import SYSTEM_PREFIX
from broker.storage.quarantine import QUARANTINE

NAME = re.compile(r"^(torn|diverged)-([0-9]{20})-([0-9]{20})\.(broken|log)$")  # ASCII digits (\d takes any script's)
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


def _batches(path: str, start: int, problems: list[str]) -> Iterator[tuple[bf.BatchHeader, memoryview]]:
    """Every valid batch of a cut range at its original offsets; each damaged one named in ``problems``
    (a run of whole ones stepped over, as ``log verify`` does; one cut short ends the walk)."""
    with walk_file(path, start, CHUNK_BYTES) as (end, walk):
        for item in walk:
            if isinstance(item, Damage):
                problems.append(f"offset {item.first.offset}: {item.first.problem.value}: {item.first.error}{item.more}")
            elif isinstance(item, Stop):  # the end of the walk
                problems.append(f"offset {item.offset}: {item.problem.value}: {item.error}; "
                                f"{end - item.offset} bytes from there to the end not read")
            else:
                yield item


def _cut_ranges(qdir: str) -> Iterator[tuple[str, str, int, int]]:
    """(path, kind, start, declared end) of each cut log range; other names as kind ``""``."""
    for name in sorted(os.listdir(qdir)):
        m = NAME.match(name)
        path = os.path.join(qdir, name)
        if m is None or os.path.isdir(path):  # a FIFO or a symlink so named is refused when opened
            yield path, "", 0, 0
        else:
            yield path, m.group(1), int(m.group(2)), int(m.group(3))


def _summary(path: str, kind: str, start: int, end: int, problems: list[str]) -> list[str]:
    queues: dict[tuple[str, int], QueueSummary] = {}
    batches = records = 0
    for h, _ in _batches(path, start, problems):
        batches += 1
        records += h.record_count
        queues.setdefault((h.topic, h.queue_id), QueueSummary()).add(h)
    size = os.path.getsize(path)
    lines = [f"{path}: {kind}, offsets [{start}, {end}), {size} bytes; {batches} valid batches, {records} records"]
    if size != end - start:
        lines[0] += f"; the name says {end - start} bytes"
    lines += [f"  {p}" for p in problems]
    for (topic, q), s in sorted(queues.items()):
        lines.append(f"  {topic}/{q}: {s.records} records, queue offsets [{s.first_queue_offset}, {s.next_queue_offset}), "
                     f"epochs {','.join(str(e) for e in sorted(s.epochs))}, store time {s.first_store_ms}..{s.last_store_ms} ms"
                     + ("; the broker's own records (not to be sent again)" if topic.startswith(SYSTEM_PREFIX) else ""))
    return lines


def _text_or_b64(name: str, raw: memoryview, row: dict[str, object]) -> None:
    """``row[name]``: the UTF-8 text, or None and ``row[name_b64]`` when the bytes are not UTF-8."""
    try:
        row[name] = bytes(raw).decode("utf-8") if len(raw) else None
    except UnicodeDecodeError:
        row[name], row[name + "_b64"] = None, base64.b64encode(raw).decode("ascii")


def _records(path: str, start: int, out: IO[str], problems: list[str]) -> None:
    for h, batch in _batches(path, start, problems):
        for i, (_, key, props, body) in enumerate(bf.iter_records(batch, h)):
            row: dict[str, object] = {
                "file": os.path.basename(path), "topic": h.topic, "queue_id": h.queue_id,
                "queue_offset": h.base_queue_offset + i, "commit_offset": h.base_offset, "epoch": h.epoch,
                "store_time_ms": h.store_time_ms, "producer_id": h.producer_id,
                "sequence": h.base_sequence + i if h.base_sequence >= 0 else h.base_sequence,
                "flags": h.flags, "system": h.topic.startswith(SYSTEM_PREFIX),
            }
            _text_or_b64("key", key, row)
            try:
                row["properties"] = bf.decode_props(props) if len(props) else {}
            except (ValueError, struct.error):  # not UTF-8, or not properties at all: the bytes as they are
                row["properties"], row["properties_b64"] = None, base64.b64encode(props).decode("ascii")
            row["body_b64"] = base64.b64encode(body).decode("ascii")
            out.write(json.dumps(row) + "\n")


def show_quarantine(data_dir: str, *, records: bool, out: IO[str], err: IO[str]) -> int:
    try:
        return _show(data_dir, records, out, err)
    except BrokenPipeError:  # a reader that stopped early (``| head``): nothing more to say to it
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _show(data_dir: str, records: bool, out: IO[str], err: IO[str]) -> int:
    qdir = os.path.join(data_dir, QUARANTINE)
    for path, must_exist in ((data_dir, True), (qdir, False)):
        try:
            if not stat.S_ISDIR(os.stat(path).st_mode):
                err.write(f"tidemark: {path}: not a directory\n")
                return 2
        except FileNotFoundError:
            if must_exist:
                err.write(f"tidemark: {path}: no such directory\n")
                return 2
        except OSError as exc:
            err.write(f"tidemark: {path}: {exc.strerror or exc}\n")
            return 2
    if not os.path.isdir(qdir):
        if not records:
            out.write(f"{qdir}: none (nothing was ever cut from this node's log)\n")
        return 0
    failed = False
    total_bytes = files = 0
    try:
        ranges = list(_cut_ranges(qdir))
    except OSError as exc:
        err.write(f"tidemark: {qdir}: {exc.strerror or exc}\n")
        return 1
    for path, kind, start, end in ranges:
        if not kind:
            failed = True
            err.write(f"{path}: not a cut log range (a file named torn-S-E.broken or diverged-S-E.log); not read\n")
            continue
        problems: list[str] = []
        try:
            if records:
                _records(path, start, out, problems)
            else:
                out.write("\n".join(_summary(path, kind, start, end, problems)) + "\n")
            files += 1
            total_bytes += os.path.getsize(path)
        except BrokenPipeError:
            raise
        except OSError as exc:
            failed = True
            err.write(f"{path}: {exc.strerror or exc}\n")
            continue
        if records:
            for p in problems:
                err.write(f"{path}: {p}\n")
        if problems and kind == "diverged":  # whole batches when kept: damage since (a torn one is damaged by nature)
            failed = True
    if not records:
        out.write(f"{qdir}: {files} cut log ranges, {total_bytes} bytes\n")
    return 1 if failed else 0
