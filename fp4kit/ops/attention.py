"""DeepSeek-V4 sparse decode attention: validate inputs, pick the backend, launch
``raw_kernels/attention.cu``.

`sparse_prefill_attention` is the same kernel for T consecutive prompt tokens of one sequence
(each over its own window of the sequence's K = V rows and its own selection).

`sparse_decode_attention` takes numpy arrays (runs `fp4kit.reference.attention`, the
specification) or device arrays (CuPy, or any CUDA DLPack producer: runs the kernels on CuPy's
current stream and returns CuPy arrays). Every input is validated before anything launches. The
device path reads no device value on the host (positions, lengths and indices are read by the
kernel; the grid is sized from shapes only), so it can be captured in a CUDA graph: run it once
eagerly first (the first call compiles), and give it preallocated ``out=`` and ``workspace=``
buffers (or use `fp4kit.layers.attention.SparseAttention`, which owns them).

Launch plan. Blocks own 16 query heads and a contiguous split of the ``W + N`` candidates. When
the batch alone does not fill the GPU (e.g. batch 1: 4 blocks of 16 heads for 64 heads), the
candidates are cut into ``num_splits`` splits whose partial results (fp32, in ``workspace``) a
second step merges with the sink; with one split the first kernel writes the output itself. With
`FUSED_COMBINE` (the default) that merge is done inside the attention kernel, counting arrivals
in a per-stream counter buffer that is zeroed once when it is made and back at zero after every
launch: when the grid has at most one block per SM (`SPREAD_MERGE`), the splits of each (row, head
group) wait for each other and each merges a share of the outputs; otherwise the last split to
finish merges them all. Without it a second kernel (``sparse_decode_combine``) merges. Both paths give the same bits. `default_num_splits` picks the count from the shapes and the SM count. Results are
deterministic for a given count; different counts differ by rounding only (fp32 sums, bf16
probabilities).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from ..reference import attention as ref
from ..reference import elementwise as ew_ref
from ..runtime import arrays, loader, status
from ..runtime import workspace as scratch
from . import elementwise as ew_ops

_MODULE = "attention"
_THREADS = 256
_COMBINE_THREADS = 128
_WARPS = _THREADS // 32
HEADS_PER_BLOCK = 16
_TILE_ROWS = 32
_SCORE_LD = _TILE_ROWS + 8
_PROB_LD = _TILE_ROWS + 8
#: the kernels' head-dimension limit (8 warps x 4 chunks of 16 columns)
MAX_HEAD_DIM = 512
#: candidates compacted by one block (its shared-memory list); more candidates need more splits
MAX_CANDIDATES_PER_SPLIT = 2048
#: the smallest split `default_num_splits` makes (one 32-row tile)
MIN_CANDIDATES_PER_SPLIT = 32
#: the most splits `default_num_splits` makes
MAX_DEFAULT_SPLITS = 12
_MAX_BATCH = 65535  # gridDim.z
_I32_MAX = 2**31 - 1
#: merge the splits inside the attention kernel (one launch) instead of in sparse_decode_combine
#: (two launches); the same arithmetic in the same order, so the same bits. Read at each launch.
FUSED_COMBINE = True
#: arrival counters per stream, one per (query row, head group); a call needing more uses the
#: separate combine kernel
MAX_FUSED_GROUPS = 1 << 16
#: in the fused merge, every split block merges a 1/S share of its (row, head group)'s outputs
#: after waiting for the others at the arrival counter, instead of the last block to arrive merging
#: them all (the same bits). Waiting blocks need the whole grid resident at once, so it is used only
#: for grids of at most one block per SM of the device (the kernel fits two, so a process that gets
#: half the SMs, e.g. an MPS client limited to 50 %, still holds the grid; with less, turn it off),
#: and from `SPREAD_MIN_SPLITS` splits
#: (H100, batch 1 and 2 at 10 splits: 14.6 -> 12.5 µs, batch 4 at 8: 16.6 -> 15.3; batch 8 at 4
#: splits slower, 20.3 -> 21.8: the last block reads only 4 partials, and every split would wait for
#: the slowest; with the merge item in one round trip, H200: batch 1 12.3 -> 10.6). Read at each launch.
SPREAD_MERGE = True
SPREAD_MIN_SPLITS = 8
#: `default_num_splits` raises a smaller count to `SPREAD_MIN_SPLITS` where that grid would spread
#: its merge and every split keeps at least `SPREAD_MIN_ROWS` candidates (the window-only and
#: ratio-128 layers' 129-192 candidates: 5-6 splits merged by the last block before)
RAISE_TO_SPREAD = True
SPREAD_MIN_ROWS = 16
_I32 = np.int32
_F32 = np.float32
OUT_DTYPES = (arrays.BF16, np.dtype(np.float32))


def smem_bytes(head_dim: int, chunk: int) -> int:
    """Dynamic shared memory of one attention block (``attn_smem_bytes`` in attention.cu)."""
    return (2 * _TILE_ROWS * (head_dim + 8) * 2 + _WARPS * HEADS_PER_BLOCK * _SCORE_LD * 4
            + HEADS_PER_BLOCK * _PROB_LD * 2 + HEADS_PER_BLOCK * 4 + _WARPS * 4 + chunk * 4)


def min_num_splits(candidates: int) -> int:
    """The fewest splits for ``candidates = W + N`` (one block compacts at most 2048)."""
    return max(1, -(-candidates // MAX_CANDIDATES_PER_SPLIT))


def default_num_splits(batch: int, heads: int, candidates: int, sm_count: int) -> int:
    """Splits of the ``W + N`` candidates so that the grid covers about one wave of ``sm_count`` SMs.

    One split when ``batch x ceil(heads / 16)`` blocks already fill three quarters of the SMs
    (e.g. batch 32 with 64 heads on 132 SMs); otherwise one split per 32-row tile of candidates,
    at most as many as one wave holds and at most `MAX_DEFAULT_SPLITS`, and raised to
    `SPREAD_MIN_SPLITS` where that grid spreads its merge (`RAISE_TO_SPREAD`).
    H100, 64 heads of 512, window 128, every split count in one run (`scripts/attention_splits.py
    --batches=1,2,4 --entries=32,128,256`), batch 1: 129-256 candidates 8.5-8.6 µs in 8-16 splits
    against 9.8-11.7 in 4-6 (the last block merging); 384 candidates 8.6 in 12 splits (one tile
    each), 10.1 in 10; 640 candidates 10.4 in 12, 10.6 in 10, 10.3 in 16 (but 11.2 at batch 2,
    10.8 in 10-11), 12.3 in 20 (past 16 splits the merge takes three round trips); batch 4 at 8.
    """
    low = min_num_splits(candidates)
    blocks = max(1, batch * -(-heads // HEADS_PER_BLOCK))
    if candidates == 0 or 4 * blocks >= 3 * sm_count:
        return low
    tiles = -(-candidates // MIN_CANDIDATES_PER_SPLIT)
    splits = max(low, min(tiles, MAX_DEFAULT_SPLITS, max(1, sm_count // blocks)))
    if (RAISE_TO_SPREAD and splits < SPREAD_MIN_SPLITS and candidates >= SPREAD_MIN_SPLITS * SPREAD_MIN_ROWS
            and spreads_merge((SPREAD_MIN_SPLITS, blocks, 1), sm_count)):
        return SPREAD_MIN_SPLITS
    return splits


def spreads_merge(grid: tuple[int, int, int], sm_count: int) -> bool:
    """Whether a fused launch of ``grid = (splits, head groups, rows)`` merges its splits in every
    split block (`SPREAD_MERGE`): from `SPREAD_MIN_SPLITS` splits, at most one block per SM."""
    splits, groups, rows = grid
    return SPREAD_MERGE and splits >= SPREAD_MIN_SPLITS and splits * groups * rows <= sm_count


def workspace_size(batch: int, heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of scratch needed for ``num_splits`` splits (0 for one split): the partial
    outputs ``[B, S, Hq, D]`` and their running max and sum ``[B, S, Hq, 2]``."""
    if num_splits <= 1:
        return 0
    return batch * num_splits * heads * (head_dim + 2)


def num_splits_for(q, candidates: int) -> int:
    """`default_num_splits` for a device array ``q [B, Hq, D]`` on its device's SM count."""
    return default_num_splits(q.shape[0], q.shape[1], candidates, loader.sm_count(arrays.device_id(q)))


def _take(name: str, x, dtype, layout: str, shape: tuple):
    """``x`` as an array of ``dtype`` whose shape matches ``shape`` (None entries free)."""
    x = arrays.as_array(x, name)
    dtype = np.dtype(dtype)
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype.name} {layout}, got {arrays.describe(x)}")
    if x.ndim != len(shape) or any(want is not None and have != want for have, want in zip(x.shape, shape)):
        raise ValueError(f"{name}: expected {dtype.name} {layout}, got {arrays.describe(x)}")
    arrays.check_contiguous(name, x)
    return x


def _scale_value(scale, head_dim: int) -> float:
    if scale is None:
        return ref.default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a positive finite Python or numpy number (or None), got {type(scale).__name__}")
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale: expected a positive finite number, got {value!r}")
    return value


def _out_dtype(out, out_dtype) -> np.dtype:
    if out_dtype is not None:
        dtype = np.dtype(out_dtype)
        if dtype not in OUT_DTYPES:
            raise TypeError(f"out_dtype: expected bfloat16 or float32, got {dtype}")
        if out is not None and getattr(out, "dtype", dtype) != dtype:
            raise ValueError(f"out: expected dtype {dtype.name} (out_dtype), got {out.dtype}")
        return dtype
    if out is not None and getattr(out, "dtype", None) in OUT_DTYPES:
        return np.dtype(out.dtype)
    if out is not None and hasattr(out, "dtype"):
        raise ValueError(f"out: expected dtype bfloat16 or float32, got {out.dtype}")
    return arrays.BF16


def _splits_value(num_splits, candidates: int) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits: expected a positive int or None, got {type(num_splits).__name__}")
    num_splits = int(num_splits)
    low, high = min_num_splits(candidates), max(1, candidates)
    if not low <= num_splits <= high:
        raise ValueError(
            f"num_splits: expected {low} <= num_splits <= {high} for W + N = {candidates} candidates "
            f"(a split compacts at most {MAX_CANDIDATES_PER_SPLIT}), got {num_splits}"
        )
    return num_splits


def _take_queries(q, rows: str, what: str, unit: str):
    """``q`` as bf16 ``[rows, Hq, D]`` (``what`` they are), D a multiple of 16 up to `MAX_HEAD_DIM`,
    at most 65535 rows (the grid's z dimension, counted in ``unit``), C-contiguous."""
    q = arrays.as_array(q, "q")
    if q.dtype != arrays.BF16:
        raise TypeError(f"q: expected dtype bfloat16 [{rows}, Hq, D], got {arrays.describe(q)}")
    if q.ndim != 3:
        raise ValueError(f"q: expected bfloat16 [{rows}, Hq, D] ({what}), got {arrays.describe(q)}")
    if q.shape[2] % 16 or not 16 <= q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dimension D must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got shape {tuple(q.shape)}")
    if q.shape[0] > _MAX_BATCH:
        raise ValueError(f"q: at most {_MAX_BATCH} {unit} per call, got shape {tuple(q.shape)}")
    arrays.check_contiguous("q", q)
    return q


def _validate(q, swa, pos, comp, comp_len, indices, sink):
    q = _take_queries(q, "B", "one decode token per sequence", "sequences")
    batch, heads, head_dim = q.shape
    b, d = f"B={batch}", f"D={head_dim}"
    swa = _take("swa", swa, arrays.BF16, f"[{b}, W, {d}]", (batch, None, head_dim))
    pos = _take("pos", pos, np.int32, f"[{b}]", (batch,))
    comp = _take("comp", comp, arrays.BF16, f"[{b}, C, {d}]", (batch, None, head_dim))
    comp_len = _take("comp_len", comp_len, np.int32, f"[{b}]", (batch,))
    if indices is not None:  # None: every live entry (N = C)
        indices = _take("indices", indices, np.int32, f"[{b}, N] or None", (batch, None))
    sink = _take("sink", sink, np.float32, f"[Hq={heads}]", (heads,))
    window, capacity = swa.shape[1], comp.shape[1]
    selected = _selected(indices, capacity)
    if window + selected > _I32_MAX or capacity > _I32_MAX:
        raise ValueError(f"swa, comp, indices: W + N and C must be below 2**31, got W={window}, N={selected}, C={capacity}")
    arrays.check_same_device(q=q, swa=swa, pos=pos, comp=comp, comp_len=comp_len, indices=indices, sink=sink)
    for name, x in (("q", q), ("swa", swa), ("comp", comp)):
        arrays.check_aligned(name, x, 16)
    for name, x in (("pos", pos), ("comp_len", comp_len), ("indices", indices), ("sink", sink)):
        if x is not None:
            arrays.check_aligned(name, x, 4)
    return q, swa, pos, comp, comp_len, indices, sink


def _selected(indices, capacity: int) -> int:
    """N, the compressed candidates of a row: the selection's length, or every entry (None)."""
    return capacity if indices is None else indices.shape[1]


def _check_workspace(ws, needed: int, like):
    ws = arrays.as_array(ws, "workspace")
    if ws.dtype != np.float32 or ws.ndim != 1 or ws.size < needed:
        raise ValueError(f"workspace: expected a 1-D float32 array of at least {needed} elements, got {arrays.describe(ws)}")
    arrays.check_contiguous("workspace", ws)
    arrays.check_aligned("workspace", ws, 16)
    if arrays.device_id(ws) != arrays.device_id(like):
        raise ValueError(f"workspace: expected an array on the same device as q, got one {arrays.describe(ws)}")
    return ws


class QueryNorm(NamedTuple):
    """The RMSNorm (no weight) and RoPE a query gets between its projection and the attention,
    `fp4kit.ops.elementwise.rmsnorm_rope(q, None, positions + offset, eps=eps, rope_dim=rope_dim,
    theta=theta)`: ``positions`` int32 ``[B]`` read on the device, ``offset`` added to each (e.g.
    the attention's own ``pos``, tokens written, with ``offset=-1``: the query is the last token
    written), ``theta`` the RoPE base or the channel pairs' inverse frequencies
    (`fp4kit.ops.elementwise.rope_table`)."""
    positions: object
    eps: float = 1e-6
    rope_dim: int = 0
    theta: object = 10000.0
    offset: int = 0


def _check_query_norm(norm, q) -> QueryNorm:
    if not isinstance(norm, QueryNorm):
        raise TypeError(f"query_norm: expected a fp4kit.ops.attention.QueryNorm, got {type(norm).__name__}")
    batch, _, head_dim = q.shape
    positions, offset = ew_ops.check_rope_positions("query_norm", norm.positions, norm.offset, batch, q)
    rope_dim = int(norm.rope_dim)
    if rope_dim < 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"query_norm.rope_dim: expected an even number in [0, {head_dim}], got {norm.rope_dim}")
    return QueryNorm(positions, float(norm.eps), rope_dim, norm.theta, offset)


def sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink, *, scale: float | None = None, out=None,
                            out_dtype=None, num_splits: int | None = None, workspace=None, query_norm=None):
    """One decode step of DeepSeek-V4 sparse attention (MQA over a shared latent, K = V).

    For each sequence ``b`` and head ``h``: one softmax over the valid window slots and the valid
    selected compressed entries, with the sink logit ``sink[h]`` in the normaliser only
    (`fp4kit.reference.attention` is the specification; fp32 accumulation on the device).

    Parameters
    ----------
    q : bf16 ``[B, Hq, D]``
        Query heads of the one decode token of each sequence; D a multiple of 16, at most 512.
    swa : bf16 ``[B, W, D]``
        Sliding-window ring buffer: token ``t`` at slot ``t % W``.
    pos : int32 ``[B]``
        Tokens written per sequence (device memory on the device path); the valid slots are
        ``0 .. min(pos, W) - 1``, all of them once the ring has wrapped. A negative position
        counts as 0 and, like a ``comp_len`` outside ``[0, C]`` (clamped), is recorded in the
        status word (`fp4kit.runtime.status.KV_INPUT`).
    comp : bf16 ``[B, C, D]``
        Compressed cache of capacity ``C``.
    comp_len : int32 ``[B]``
        Live compressed length; entries at or beyond ``min(comp_len, C)`` are ignored.
    indices : int32 ``[B, N]`` or None
        Selected compressed entries; ``-1`` (and any index outside ``[0, comp_len)``) is ignored,
        an index given twice counts twice. None: every live entry, in order (what the indices
        ``0 .. C-1`` select, and the same bits on the device, with ``N = C``; no index list to build).
    sink : fp32 ``[Hq]``
        Attention-sink logit per head (``-inf``: none). It adds ``exp(sink - m)`` to the
        normaliser and has no value vector.
    scale : float, optional
        Softmax scale (a static hyperparameter), default ``D ** -0.5``.
    out : bf16 or fp32 ``[B, Hq, D]``, optional
        Written in place and returned; on the device every element is written.
    out_dtype : bfloat16 (default) or float32
        The result dtype when ``out`` is not given.
    num_splits : int, optional
        Device path: splits of the ``W + N`` candidates (default `default_num_splits`).
    workspace : fp32 1-D array of at least `workspace_size` elements, optional
        Device path, ``num_splits > 1``: scratch for the partial results. Without it a per-stream
        buffer of `fp4kit.runtime.workspace` is used, which a later, larger call may replace:
        pass one explicitly for a call captured in a CUDA graph.
    query_norm : `QueryNorm`, optional
        ``q`` is the query projection's raw output: each head gets its RMSNorm and RoPE first, as
        `fp4kit.ops.elementwise.rmsnorm_rope` computes them (the same bits); on the device inside
        this launch, as each block loads its heads (one launch less).

    Returns
    -------
    ``[B, Hq, D]`` in ``out_dtype``: ``sum_j p_j v_j``; a head of a sequence with no valid row gets 0.

    All inputs live in one place (host, or one CUDA device); device work runs on CuPy's current
    stream without a host synchronisation.
    """
    q, swa, pos, comp, comp_len, indices, sink = _validate(q, swa, pos, comp, comp_len, indices, sink)
    if query_norm is not None:
        query_norm = _check_query_norm(query_norm, q)
    head_dim = q.shape[2]
    candidates = swa.shape[1] + _selected(indices, comp.shape[1])
    scale = _scale_value(scale, head_dim)
    dtype = _out_dtype(out, out_dtype)
    if out is not None:
        arrays.check_out("out", out, q.shape, dtype, q)
    splits = _splits_value(num_splits, candidates)

    if not arrays.is_device_array(q) and ((pos < 0).any() or (comp_len < 0).any() or (comp_len > comp.shape[1]).any()):
        status.record_host(status.KV_INPUT)  # positions are data: counted as 0 / clamped, and recorded

    if not arrays.is_device_array(q):
        if workspace is not None:
            _check_workspace(workspace, 0, q)
        if query_norm is not None:
            q = ew_ref.rmsnorm_rope(q, None, query_norm.positions + np.int32(query_norm.offset), eps=query_norm.eps,
                                    rope_dim=query_norm.rope_dim, theta=query_norm.theta)
        result = ref.sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink, scale)
        return arrays.host_result(result.astype(dtype), out)

    return _launch(q, swa, pos, comp, comp_len, indices, sink, scale, dtype, out, splits, workspace,
                   window=swa.shape[1], capacity=comp.shape[1], query_norm=query_norm)


def _launch(q, swa, pos, comp, comp_len, indices, sink, scale, dtype, out, splits, workspace, *, window: int,
            capacity: int, start=None, kv_rows: int = 0, query_norm: QueryNorm | None = None):
    """The device launches of a validated call (``start``: the prefill form, see attention.cu)."""
    import cupy

    if query_norm is None:
        norm_args = (0, _I32(0), 0, _I32(0), _F32(0.0))
    else:
        norm_args = (query_norm.positions, _I32(query_norm.offset),
                     ew_ops.rope_table(query_norm.theta, query_norm.rope_dim, q, "query_norm.theta"),
                     _I32(query_norm.rope_dim), _F32(query_norm.eps))

    batch, heads, head_dim = q.shape
    selected = _selected(indices, capacity)
    candidates = window + selected
    if splits is None:
        splits = num_splits_for(q, candidates)
    needed = workspace_size(batch, heads, head_dim, splits)
    if workspace is not None:
        workspace = _check_workspace(workspace, needed, q)
    out = cupy.empty(q.shape, dtype=dtype) if out is None else out
    if q.size == 0:
        return out
    if splits > 1 and workspace is None:
        workspace = _shared_workspace(needed)
    chunk = -(-candidates // splits)
    shared = smem_bytes(head_dim, chunk)
    kernel = loader.get_kernel(_MODULE, "sparse_decode_attention", block=_THREADS)
    if splits > 1:
        partial_rows = batch * splits * heads
        part_o = workspace[: partial_rows * head_dim]
        part_ml = workspace[partial_rows * head_dim: partial_rows * (head_dim + 2)]
    else:
        part_o = part_ml = 0  # null: the single split writes the output directly
    out_f32 = _I32(dtype == np.float32)
    scale_log2 = _F32(scale * math.log2(math.e))
    grid = (splits, -(-heads // HEADS_PER_BLOCK), batch)
    fused = splits > 1 and FUSED_COMBINE and batch * grid[1] <= MAX_FUSED_GROUPS
    counters = _arrival_counters() if fused else 0
    spread = fused and spreads_merge(grid, loader.sm_count(arrays.device_id(q)))
    kernel.launch(grid, _THREADS, (q, swa, 0 if pos is None else pos, comp, comp_len,
                                   0 if indices is None else indices, sink, out, part_o,
                                   part_ml, _I32(heads), _I32(head_dim), _I32(window), _I32(capacity),
                                   _I32(selected), _I32(chunk), scale_log2, out_f32, status.device_word(),
                                   0 if start is None else start, _I32(kv_rows), counters, _I32(spread),
                                   *norm_args),
                  shared_mem=shared)
    if splits > 1 and not fused:
        combine = loader.get_kernel(_MODULE, "sparse_decode_combine", block=_COMBINE_THREADS)
        combine.launch((heads, batch), _COMBINE_THREADS, (part_o, part_ml, sink, out, _I32(heads), _I32(head_dim),
                                                          _I32(splits), out_f32))
    return out


def sparse_prefill_attention(q, kv, start, window: int, comp, comp_len, indices, sink, *, scale: float | None = None,
                             out=None, out_dtype=None, num_splits: int | None = None, workspace=None):
    """Sparse attention of ``T`` consecutive prompt tokens of one sequence at once: for each, what
    `sparse_decode_attention` gives it when the prompt is decoded token by token
    (`fp4kit.reference.attention.prefill_attention` is the specification).

    Parameters
    ----------
    q : bf16 ``[T, Hq, D]``
        Query heads of the T tokens (positions ``start .. start + T - 1``).
    kv : bf16 ``[L, D]``
        The K = V row of every token of the sequence so far (``L >= start + T``); query ``t``'s
        window is the rows of the ``window`` tokens ending at it (``kv[max(0, p + 1 - window) : p +
        1]`` at position ``p = start + t``).
    start : int32 ``[1]``
        Position of the first query token, in the same memory as ``q`` (on the device it is read
        by the kernel only). On the device a query past ``L`` attends to the rows that exist and is
        recorded in the status word (`fp4kit.runtime.status.KV_INPUT`); on the host it is an error.
    window : int
        Sliding-window length ``W`` (a static hyperparameter).
    comp : bf16 ``[C, D]``
        The sequence's compressed entries.
    comp_len : int32 ``[T]``
        Entries complete at each query's position.
    indices : int32 ``[T, N]`` or None
        Each query's selection (-1 pads; duplicates count twice); None: every entry complete at the
        query (``N = C``).
    sink, scale, out, out_dtype, num_splits, workspace
        As in `sparse_decode_attention` (``out [T, Hq, D]``; splits of the ``W + N`` candidates).
    """
    q = _take_queries(q, "T", "the query heads of the prompt's tokens", "query tokens")
    tokens, heads, head_dim = q.shape
    t, d = f"T={tokens}", f"D={head_dim}"
    kv = _take("kv", kv, arrays.BF16, f"[L, {d}]", (None, head_dim))
    start = _take("start", start, np.int32, "[1]", (1,))
    comp = _take("comp", comp, arrays.BF16, f"[C, {d}]", (None, head_dim))
    comp_len = _take("comp_len", comp_len, np.int32, f"[{t}]", (tokens,))
    if indices is not None:  # None: every entry complete at the query (N = C)
        indices = _take("indices", indices, np.int32, f"[{t}, N] or None", (tokens, None))
    sink = _take("sink", sink, np.float32, f"[Hq={heads}]", (heads,))
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or not 1 <= window <= _I32_MAX:
        raise ValueError(f"window: expected a positive int below 2**31, got {window!r}")
    window = int(window)
    selected = _selected(indices, comp.shape[0])
    if window + selected > _I32_MAX or max(kv.shape[0], comp.shape[0]) > _I32_MAX:
        raise ValueError(f"kv, comp, indices: L, C and W + N must be below 2**31, got L={kv.shape[0]}, "
                         f"C={comp.shape[0]}, W + N={window + selected}")
    arrays.check_same_device(q=q, kv=kv, start=start, comp=comp, comp_len=comp_len, indices=indices, sink=sink)
    for name, x in (("q", q), ("kv", kv), ("comp", comp)):
        arrays.check_aligned(name, x, 16)
    for name, x in (("start", start), ("comp_len", comp_len), ("indices", indices), ("sink", sink)):
        if x is not None:
            arrays.check_aligned(name, x, 4)
    scale = _scale_value(scale, head_dim)
    dtype = _out_dtype(out, out_dtype)
    if out is not None:
        arrays.check_out("out", out, q.shape, dtype, q)
    splits = _splits_value(num_splits, window + selected)

    if not arrays.is_device_array(q):
        if workspace is not None:
            _check_workspace(workspace, 0, q)
        first = int(start[0])
        if first < 0:
            raise ValueError(f"start: expected a non-negative position, got {first}")
        if (comp_len < 0).any() or (comp_len > comp.shape[0]).any():
            status.record_host(status.KV_INPUT)  # lengths are data: clamped, and recorded
        result = ref.prefill_attention(q, kv, first, window, comp, comp_len, indices, sink, scale)
        return arrays.host_result(result.astype(dtype), out)
    return _launch(q, kv, None, comp, comp_len, indices, sink, scale, dtype, out, splits, workspace,
                   window=window, capacity=comp.shape[0], start=start, kv_rows=kv.shape[0])


def _arrival_counters():
    """The fused combine's counters for the current device and stream: zeroed once when made
    (outside any capture), then zero between launches, each merging block resetting its own."""
    return scratch.stream_buffer("sparse_decode_attention.counters", MAX_FUSED_GROUPS, np.uint32, zeroed=True)


def _shared_workspace(elements: int):
    return scratch.device_buffer("sparse_decode_attention", elements * 4)[: elements * 4].view(np.float32)
