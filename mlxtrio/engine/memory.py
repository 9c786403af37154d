"""Giving memory back when the engine goes idle. Engine thread only.

A long prefill leaves hundreds of MB of freed scratch behind: in MLX's buffer
cache, and on Linux in glibc's heap, which keeps freed pages in the process.
Left there, the process would hold them beside the prefix cache's KV for as
long as it runs, and the cache's byte budget would no longer describe the
process's memory.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any


def release_buffers() -> int:
    """Give MLX's cache of freed buffers back when the engine goes idle (a
    long prefill leaves attention scratch there); returns the bytes MLX's
    arrays hold then: weights, the prefix cache's KV, little else."""
    import mlx.core as mx

    mx.clear_cache()
    _trim_heap()
    return int(mx.get_active_memory())


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps a long
    prefill's freed scratch otherwise: ~150 MB of RSS after a 12k-token
    prompt on the embedded model). A no-op where there is no glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl, or no libc.so.6
        return None
