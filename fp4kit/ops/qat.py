"""DeepSeek-V4's simulated activation quantization, in place, where the activations are stored.

The official inference rounds two kinds of rows through a low-precision format and back, so that
each layer sees the values it was trained on (`fp4kit.reference.qat` is the specification):

* a KV latent row's channels outside RoPE through E4M3, a power-of-two scale per 64
  (`latent_rows`, `latent_window`, `latent_entries`);
* an indexer row (a query head, or a compressed key) rotated by the Hadamard matrix of its width,
  then through E2M1, a power-of-two scale per 32 (`index_rows`, `index_entries`).

Each function takes the rows where a model keeps them: every row of an array, the row a decode
step wrote into a sliding-window ring, or the compressed entries a step emitted (the counts
before and after the compressor's append). numpy arrays run the reference; device arrays launch
``raw_kernels/qat.cu`` on CuPy's current stream, bit for bit the reference, reading the positions
and counts on the device (no host sync: a decode step that uses them can be captured).
"""

from __future__ import annotations

import math

import numpy as np

from ..formats import E2M1_MAX, E4M3_MAX
from ..reference import qat as ref
from ..runtime import arrays, loader

_MODULE = "qat"
_THREADS = 256  # raw_kernels/qat.cu kThreads
_WARPS = _THREADS // 32
_U32 = np.uint32
# the index kernels by lanes' width V (d = 32 V channels per row)
_INDEX_ROWS = {1: "qat_index_rows_v1", 2: "qat_index_rows_v2", 4: "qat_index_rows_v4", 8: "qat_index_rows_v8"}
_INDEX_ENTRIES = {1: "qat_index_entries_v1", 2: "qat_index_entries_v2", 4: "qat_index_entries_v4",
                  8: "qat_index_entries_v8"}
# the format constants as the reference computes them (fp32)
_FP8 = (np.float32(1.0 / E4M3_MAX), np.float32(ref.FP8_AMAX_FLOOR))
_FP4 = (np.float32(1.0 / E2M1_MAX), np.float32(ref.FP4_AMAX_FLOOR))


def _bf16(name: str, x, ndim: int):
    x = arrays.as_array(x, name)
    if x.dtype != arrays.BF16 or x.ndim != ndim:
        raise ValueError(f"{name}: expected a bfloat16 array of {ndim} dimensions, got {arrays.describe(x)}")
    arrays.check_contiguous(name, x)
    return x


def _latent_width(name: str, d: int, rope_dim) -> None:
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, (int, np.integer)) or not 0 <= rope_dim <= d:
        raise ValueError(f"rope_dim: expected an int in [0, {d}], got {rope_dim!r}")
    if (d - rope_dim) % 64 or d % 2:
        raise ValueError(f"{name}: the channels outside RoPE ({d} - {rope_dim}) must be a multiple of 64")


def _index_width(name: str, d: int) -> int:
    if d not in (32, 64, 128, 256):
        raise ValueError(f"{name}: expected rows of 32, 64, 128 or 256 channels (a power of two the Hadamard "
                         f"rotation and the blocks of 32 need), got {d}")
    return d // 32


def _counts(name: str, a, b: int):
    a = arrays.as_array(a, name)
    if a.dtype != np.int32 or a.shape != (b,):
        raise ValueError(f"{name}: expected int32 [{b}], got {arrays.describe(a)}")
    return a


def _max_new(max_new) -> int:
    if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
        raise ValueError(f"max_new: expected a positive int (the most entries one call may have emitted), "
                         f"got {max_new!r}")
    return int(max_new)


def latent_rows(x, rope_dim: int):
    """Every row of bf16 ``x [..., D]``: its first ``D - rope_dim`` channels through E4M3 (a
    power-of-two scale per 64), in place; returns ``x``."""
    x = arrays.as_array(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x: expected a bfloat16 array of rows, got {arrays.describe(x)}")
    _bf16("x", x, x.ndim)
    d = x.shape[-1]
    _latent_width("x", d, rope_dim)
    if not arrays.is_device_array(x):
        x[..., : d - rope_dim] = ref.fp8_simulate(x[..., : d - rope_dim], 64)
        return x
    rows = x.size // d if d else 0
    if rows and d > rope_dim:
        loader.get_kernel(_MODULE, "qat_latent_rows")(rows, _THREADS, (x, _U32(d), _U32(rope_dim), *_FP8))
    return x


def latent_window(swa, positions, rope_dim: int):
    """The row each sequence's decode step wrote into the sliding-window ring ``swa [B, window,
    D]`` (bf16; slot ``positions[b] % window``, ``positions`` int32 ``[B]``): as `latent_rows`."""
    swa = _bf16("swa", swa, 3)
    b, window, d = swa.shape
    _latent_width("swa", d, rope_dim)
    positions = _counts("positions", positions, b)
    arrays.check_same_device(swa=swa, positions=positions)
    if not arrays.is_device_array(swa):
        slots = (np.arange(b), np.asarray(positions) % window)
        swa[slots] = latent_rows(swa[slots], rope_dim)
        return swa
    if b and window and d > rope_dim:
        loader.get_kernel(_MODULE, "qat_latent_window")(
            b, _THREADS, (swa, positions, _U32(window), _U32(d), _U32(rope_dim), *_FP8))
    return swa


def _entries(name: str, comp, before, after, max_new):
    comp = _bf16(name, comp, 3)
    b = comp.shape[0]
    before, after = _counts("before", before, b), _counts("after", after, b)
    arrays.check_same_device(**{name: comp, "before": before, "after": after})
    return comp, before, after, _max_new(max_new)


def _host_entries(comp, before, after, fn) -> None:
    cap = comp.shape[1]
    for s, (lo, hi) in enumerate(zip(np.minimum(before, cap), np.minimum(after, cap))):
        if hi > lo:
            comp[s, lo:hi] = fn(comp[s, lo:hi])


def latent_entries(comp, before, after, rope_dim: int, max_new: int = 1):
    """The compressed entries ``before[b] .. after[b] - 1`` of each sequence of ``comp [B, cap,
    D]`` (bf16; counts int32 ``[B]``, entries past ``cap`` are not stored): as `latent_rows`.
    ``max_new`` bounds ``after - before`` (one per decode step; ``t // ratio + 1`` for ``t`` tokens)."""
    comp, before, after, max_new = _entries("comp", comp, before, after, max_new)
    b, cap, d = comp.shape
    _latent_width("comp", d, rope_dim)
    if not arrays.is_device_array(comp):
        _host_entries(comp, before, after, lambda rows: latent_rows(rows.copy(), rope_dim))
        return comp
    if b and cap and d > rope_dim:
        loader.get_kernel(_MODULE, "qat_latent_entries").launch(
            (b, max_new), _THREADS, (comp, before, after, _U32(cap), _U32(d), _U32(rope_dim), *_FP8))
    return comp


def index_rows(x):
    """Every row of bf16 ``x [..., d]`` (d = 32 .. 256, a power of two): rotated by the Hadamard
    matrix of order d, then through E2M1 (a power-of-two scale per 32), in place; returns ``x``."""
    x = arrays.as_array(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x: expected a bfloat16 array of rows, got {arrays.describe(x)}")
    _bf16("x", x, x.ndim)
    d = x.shape[-1]
    v = _index_width("x", d)
    if not arrays.is_device_array(x):
        x[...] = ref.fp4_simulate(ref.hadamard(x), 32)
        return x
    rows = x.size // d
    if rows:
        loader.get_kernel(_MODULE, _INDEX_ROWS[v])(
            -(-rows // _WARPS), _THREADS, (x, _U32(rows), np.float64(math.sqrt(d)), *_FP4))
    return x


def index_entries(comp, before, after, max_new: int = 1):
    """The compressed index keys ``before[b] .. after[b] - 1`` of each sequence of ``comp [B,
    cap, d]``: as `index_rows` (counts and ``max_new`` as `latent_entries` takes them)."""
    comp, before, after, max_new = _entries("comp", comp, before, after, max_new)
    b, cap, d = comp.shape
    v = _index_width("comp", d)
    if not arrays.is_device_array(comp):
        _host_entries(comp, before, after, lambda rows: index_rows(rows.copy()))
        return comp
    if b and cap:
        loader.get_kernel(_MODULE, _INDEX_ENTRIES[v]).launch(
            (b, -(-max_new // _WARPS)), _THREADS, (comp, before, after, _U32(cap), np.float64(math.sqrt(d)), *_FP4))
    return comp
