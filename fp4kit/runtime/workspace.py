"""Preallocated device scratch, one set per (device, stream).

Grid-wide reductions write one partial per thread block. The buffer is allocated once per
stream and kept for the life of the process, so a captured CUDA graph keeps pointing at live
memory and no step allocates. Launches on one stream are ordered, so they can share it;
launches on different streams get different buffers.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

PARTIALS_CAPACITY = 1 << 14  # uint32 words: more than any co-resident grid

_lock = threading.Lock()
_buffers: dict[tuple[str, int, int], object] = {}


def _per_stream(kind: str, n: int, dtype, zeroed: bool = False):
    import cupy

    key = (kind, cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    buf = _buffers.get(key)
    if buf is None:
        with _lock:
            buf = _buffers.get(key)
            if buf is None:
                buf = zeros_outside_capture(n, dtype) if zeroed else cupy.empty(n, dtype=dtype)
                _buffers[key] = buf
    return buf


def stream_buffer(name: str, n: int, dtype, *, zeroed: bool = False):
    """A fixed ``[n]`` device buffer for the current device and stream, made once and never
    reallocated (a captured graph keeps pointing at it); ``zeroed`` zeroes it once, outside any
    capture (for counters that the kernels using them reset themselves)."""
    return _per_stream("stream:" + name, n, dtype, zeroed)


def partials():
    """``uint32[PARTIALS_CAPACITY]`` scratch for the current device and stream."""
    return _per_stream("partials", PARTIALS_CAPACITY, "uint32")


def scalar():
    """An fp32 0-d scratch value for the current device and stream (a result nobody reads)."""
    return _per_stream("scalar", 1, "float32").reshape(())


def zeros_outside_capture(n: int, dtype):
    """A zeroed device array whose zeroing is never part of a CUDA graph being captured.

    A lazily created buffer may first be needed while the current stream is capturing; a fill
    issued on that stream would become a graph node and re-zero the buffer on every replay.
    The buffer is allocated and filled on a private side stream instead, which is then
    synchronised (allowed under CuPy's relaxed capture mode). Allocating on the side stream
    matters: CuPy's pool caches blocks per stream, and a block the current stream just freed may
    still be written by its queued kernels, which would land after a side-stream fill.
    """
    import cupy

    return made_outside_capture(lambda: cupy.zeros(n, dtype=dtype))


def made_outside_capture(make):
    """``make()``'s device array, made (allocated and written) on a private side stream as
    `zeros_outside_capture` makes its zeros: never a node of a graph being captured."""
    import cupy

    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        buf = make()
    side.synchronize()
    return buf


#: a layer keeps its buffers (`BufferCache`) up to this many bytes each: a decode step's outputs.
#: A larger one made outside a graph capture (a batched prefill's: every projection's output at
#: 4096 tokens, e.g. 335 MB for the 40960-wide query projection) is made per call from CuPy's pool
#: and returned there when the caller drops it, so the layers share that memory instead of each
#: holding its own (a 4096-token prefill of the 4-layer example held 2.7 GB of them)
KEEP_MAX_BYTES = 16 << 20


def _capturing(buf) -> bool:
    """Whether ``buf`` is a CuPy array made while the current stream is being captured."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(buf, cupy.ndarray) and cupy.cuda.get_current_stream().is_capturing()


class BufferCache:
    """The buffers a layer owns, one per key (device, batch size, ...), made on first use and then
    kept: the next call with the same key allocates nothing, and a CUDA graph captured over a call
    keeps pointing at live memory. A buffer of more than `KEEP_MAX_BYTES` made outside a capture is
    not kept: each call makes its own (one made during a capture is kept, since the graph writes it
    at every replay)."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def get(self, key, make: Callable[[], object]):
        """The buffer for ``key``, made by ``make()`` the first time (every time when it is larger
        than `KEEP_MAX_BYTES` and made outside a capture)."""
        buf = self._buffers.get(key)
        if buf is None:
            buf = make()
            if getattr(buf, "nbytes", 0) <= KEEP_MAX_BYTES or _capturing(buf):
                self._buffers[key] = buf
        return buf

    def peek(self, key):
        """The buffer for ``key`` if one was made, else None (makes nothing)."""
        return self._buffers.get(key)

    def __len__(self) -> int:
        return len(self._buffers)


def device_buffer(name: str, nbytes: int):
    """A uint8 device buffer of at least ``nbytes``, reused across calls on this device and stream.

    For work that is not captured in a graph (e.g. the prefill GEMM's dequantized weight): it
    grows when a call needs more, so a caller must not keep a view across calls.
    """
    return _growing("buffer:" + name, nbytes, keep_outgrown=False)


_retired: list = []  # superseded capturable buffers: a captured graph may still point at them


def capturable_buffer(name: str, nbytes: int):
    """A uint8 device buffer of at least ``nbytes`` for the current device and stream that a
    captured CUDA graph may keep using: it grows in powers of two when a call needs more, and a
    buffer it outgrows is kept alive (not reused) for the life of the process."""
    return _growing("capturable:" + name, 1 << max(0, nbytes - 1).bit_length(), keep_outgrown=True)


def _growing(kind: str, nbytes: int, keep_outgrown: bool):
    import cupy

    key = (kind, cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    buf = _buffers.get(key)
    if buf is None or buf.size < nbytes:
        with _lock:
            buf = _buffers.get(key)
            if buf is None or buf.size < nbytes:
                old = _buffers.pop(key, None)
                if old is not None and keep_outgrown:
                    _retired.append(old)
                old = buf = None  # no reference left here: an outgrown device_buffer is freed before the larger one is made
                buf = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
                _buffers[key] = buf
    return buf
