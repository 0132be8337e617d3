"""L2 prefetch tables: device arrays whose bytes a kernel asks the L2 to fetch ahead of their use.

At decode sizes a step alternates between weight-streaming GEMMs, which keep HBM busy, and latency
chains (norms, the indexer, attention), during which it idles. A kernel at the start of such a
chain can put the next GEMM's weights on their way into the L2 (``cp.async.bulk.prefetch.L2``,
``raw_kernels/common/l2_prefetch.cuh``), so that GEMM reads them from there. The kernels that take a
table (``prefetch=`` of `fp4kit.ops.elementwise.rmsnorm_rope` and ``rmsnorm_rope_pair``) spread its
chunks over all their threads after their own work. A prefetch is only a hint: results never
depend on it, and arrays that do not fit the L2 (60 MiB on the H200, shared with everything else
the chain touches) gain little.

The table is u64 ``[2 + 2 * MAX_RANGES]``: the number of ranges, the chunk size in bytes, then
(address, bytes) per range; the bytes of a range are its array's rounded down to a multiple of 16
(the instruction's unit).
"""

from __future__ import annotations

import numpy as np

from . import arrays

#: ranges per table (``l2::kMaxRanges``)
MAX_RANGES = 4
#: bytes per prefetch instruction: small enough that a table of a few tens of MB spreads over the
#: SMs of a 64-block launch, large enough that each thread issues one or two
CHUNK_BYTES = 16 << 10


def table(ranges: list[tuple[int, int]], chunk: int = CHUNK_BYTES) -> np.ndarray:
    """The u64 table of ``ranges`` [(address, bytes)] (host array): addresses must be multiples of
    16; bytes are rounded down to a multiple of 16 and empty ranges dropped."""
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 16 or chunk % 16 \
            or chunk >= 1 << 32:
        raise ValueError(f"chunk: expected a multiple of 16 bytes in [16, 2**32), got {chunk!r}")
    kept = []
    for i, (addr, nbytes) in enumerate(ranges):
        if addr % 16:
            raise ValueError(f"ranges[{i}]: the address must be a multiple of 16, got {addr:#x}")
        if nbytes < 0:
            raise ValueError(f"ranges[{i}]: expected a non-negative size, got {nbytes}")
        if nbytes // 16:
            kept.append((addr, nbytes // 16 * 16))
    if len(kept) > MAX_RANGES:
        raise ValueError(f"ranges: at most {MAX_RANGES} non-empty ranges per table, got {len(kept)}")
    out = np.zeros(2 + 2 * MAX_RANGES, np.uint64)
    out[0], out[1] = len(kept), chunk
    for i, (addr, nbytes) in enumerate(kept):
        out[2 + 2 * i], out[3 + 2 * i] = addr, nbytes
    return out


def assignment(tab: np.ndarray, grid: int, threads: int) -> list[tuple[int, int, int, int]]:
    """The prefetches of ``tab`` as a launch of ``grid`` blocks of ``threads`` issues them
    (``l2::prefetch_share``), as (block, thread, address, bytes): chunk c of the ranges laid end to
    end goes to block c % grid, thread (c // grid) % threads. The specification of the kernel side,
    checked on the CPU (every byte once, every block a share)."""
    n, chunk = int(tab[0]), int(tab[1])
    total = grid * threads
    out = []
    first = 0
    for i in range(n):
        addr, nbytes = int(tab[2 + 2 * i]), int(tab[3 + 2 * i])
        chunks = -(-nbytes // chunk)
        for me in range(total):  # the same walk as the kernel's, thread by thread
            c = first + (me + total - first % total) % total
            while c < first + chunks:
                offset = (c - first) * chunk
                out.append((me % grid, me // grid, addr + offset, min(chunk, nbytes - offset)))
                c += total
        first += chunks
    return out


class L2Prefetch:
    """A device table of the bytes of up to `MAX_RANGES` device arrays (C-contiguous, on the
    current device), built once (e.g. when a layer is built) and passed to the kernels that prefetch
    it. ``nbytes``: the bytes it covers."""

    def __init__(self, device_arrays: list, chunk: int = CHUNK_BYTES):
        import cupy

        ranges = []
        for i, a in enumerate(device_arrays):
            if not isinstance(a, cupy.ndarray):
                raise TypeError(f"arrays[{i}]: expected a cupy.ndarray, got {type(a).__name__}")
            arrays.check_contiguous(f"arrays[{i}]", a)
            ranges.append((int(a.data.ptr), int(a.nbytes)))
        host = table(ranges, chunk)
        self.ranges = int(host[0])
        self.nbytes = int(sum(int(host[3 + 2 * i]) for i in range(self.ranges)))
        self.table = cupy.asarray(host)
        self._arrays = list(device_arrays)  # the table points into them: keep them alive

    def __repr__(self) -> str:
        return f"L2Prefetch({self.ranges} ranges, {self.nbytes / 1e6:.1f} MB)"


def check(prefetch, name: str = "prefetch"):
    """``prefetch`` as a launch argument: its device table, or 0 for None."""
    if prefetch is None:
        return 0
    if not isinstance(prefetch, L2Prefetch):
        raise TypeError(f"{name}: expected an fp4kit.runtime.prefetch.L2Prefetch or None, got {type(prefetch).__name__}")
    return prefetch.table
