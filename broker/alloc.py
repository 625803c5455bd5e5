"""Allocator tuning for the hot paths.

Requests and pull answers are multi-MB buffers that live for one call. glibc serves such sizes
with mmap and returns them (or trims the heap) on free, so every request page-faults its
buffers in again: measured here, the daemon spent 2-3x more CPU in the kernel than in Python
on pulls. Raising the mmap threshold (to its 32 MiB maximum) and the trim threshold keeps those
buffers in the heap for reuse. Process-wide; set ``TIDEMARK_MALLOC_TUNING=0`` to leave glibc's
defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30
_done = False


def tune() -> bool:
    """Apply the tuning once per process; False when disabled or not glibc."""
    global _done
    if _done or os.environ.get("TIDEMARK_MALLOC_TUNING", "1") == "0":
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
