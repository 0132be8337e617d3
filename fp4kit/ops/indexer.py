"""Lightning indexer: validate inputs, pick the backend, launch ``raw_kernels/indexer.cu``.

`score_topk` scores every live compressed key of each sequence for one decode token,
``score[b, t] = sum_h w[b, h] * ReLU(q[b, h] . keys[b, t])`` for ``t < lengths[b]``, and selects the
``k`` best (see `fp4kit.reference.indexer` for the exact rules: ties to the lower index, NaN as
-inf, indices ascending, ``-1`` padding).

numpy inputs run the reference; CuPy (or CUDA DLPack) inputs run two kernels on CuPy's current
stream: the tensor-core scoring kernel (grid sized for the capacity, blocks past the live length
exit at once) and the radix-select top-k: one block per sequence for short caches or large batches,
a thread-block cluster of 8 blocks per sequence for long caches (`select_kernel`, `TOPK_SELECT`;
both give the same result bit for bit). ``lengths`` stays on the device
and is never read by the host, so the call can be captured in a CUDA graph and replayed while the
lengths grow; with ``out_indices``, ``out_scores`` and ``workspace`` given nothing is allocated.

Status word: a NaN live score (ranked as -inf), or a length outside ``[0, capacity]`` (clamped),
or-s `fp4kit.runtime.status.INDEXER_INPUT` into the device status word; the numpy backend records
the same value in the host word.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from ..reference import elementwise as ew_ref
from ..reference import indexer as ref
from ..runtime import arrays, loader, status
from . import elementwise as ew_ops

_MODULE = "indexer"
_SCORE_THREADS = 128
_KEYS_PER_BLOCK = 128
_TOPK_THREADS = 1024
_REGISTER_CAPACITY = 32 * _TOPK_THREADS  # indexer_topk_registers holds up to 32 scores per thread
_SMALL_TOPK_THREADS = 256  # indexer_topk_registers_small: 8 warps, up to 32 scores per thread
_CLUSTER_BLOCKS = 8  # indexer_topk_cluster: blocks per sequence (one thread-block cluster)
_CLUSTER_CAPACITY = 16 * _TOPK_THREADS * _CLUSTER_BLOCKS  # ... holding up to 16 scores per thread
_SMALL_CLUSTER_CAPACITY = 16 * _SMALL_TOPK_THREADS * _CLUSTER_BLOCKS  # indexer_topk_cluster_small: 256 threads a block

#: capacities from this one select in a cluster of 8 blocks per sequence: the one-block select
#: reads the row with one SM and builds its histograms with 1024 threads, which at 32768 entries is
#: ~17 µs (H200, decode-step profile); the cluster gives each SM an eighth and costs one cluster
#: barrier per radix pass (4 at most) plus one for the output positions. Below this one block
#: holds at most 8 scores per thread, and the barriers are expected to cost about what the split
#: saves (an estimate, to be replaced by a measured crossover). The capacity, not the live length,
#: decides: lengths stay on the device.
CLUSTER_MIN_CAPACITY = 8192
#: capacities up to this one select in one block of 256 threads (`indexer_topk_registers_small`)
#: instead of 1024: the same radix passes, the same selection bit for bit, with 8 warps at each
#: barrier and block scan instead of 32 (0: never; at most 32 * 256). H200, score_topk (scores +
#: select) graph-replayed, same run: 2048 entries, 1024 live, k = 512: 14.81 -> 10.19 us at B = 1,
#: 16.74 -> 11.68 at B = 8; 8192 live, k = 2048: 18.26 -> 15.51; the v4-flash-slice step 0.576 ->
#: 0.567 ms at batch 1, 1.419 -> 1.409 at batch 8. It also beats the cluster select where both
#: run (taken first): another run, 8192 live entries, k = 2048: 15.47 us against 18.82 (cluster)
#: and 18.18 (1024 threads); k = 512 14.98 against 17.29 (B = 8: 22.91 against 25.37); 4096 live,
#: k = 512: 13.00 against 17.77
TOPK_SMALL_MAX_CAPACITY = 32 * _SMALL_TOPK_THREADS
#: cluster selects of capacities up to this one run in blocks of 256 threads (`indexer_topk_cluster_small`)
#: instead of 1024: the same passes, the same selection bit for bit, with 8 warps at every barrier
#: and block scan instead of 32 (0: never; at most 16 * 256 * 8)
CLUSTER_SMALL_MAX_CAPACITY = _SMALL_CLUSTER_CAPACITY
#: and only while the clusters of all rows fit in one wave (8 * B blocks <= SMs): when the rows alone
#: fill the GPU, spreading each over 8 SMs only adds barriers and blocks
CLUSTER_MAX_WAVES = 1
#: "auto" (the rule above), "block" or "cluster": a knob to force either path (tests, benchmarks);
#: "cluster" is refused above the capacity the cluster kernel holds in registers
TOPK_SELECT = "auto"
#: the `Indexer` layer passes its ``key_range`` buffer (the select's passes from the highest bit in
#: which a row's scores differ) for capacities up to this one (0: never). H200, score_topk
#: graph-replayed, same run, without -> with: capacity 2048, 1024 live, k = 512: 12.07 -> 11.03 us at
#: B = 1, 13.39 -> 12.68 at B = 8 (a pass fewer); capacity 32768: 1024 live 16.53 -> 15.71, 8192 live
#: 18.56 -> 18.65, but 32768 live 19.81 -> 20.37 (k = 512) and 18.01 -> 20.63 (k = 2048): the scoring
#: kernel's two atomics per warp (2048 on one pair of words at 32768 live) cost more than the pass
KEY_RANGE_MAX_CAPACITY = 8192
_U32 = np.uint32
_I32 = np.int32

MAX_K = 4096
MAX_HEADS = 64
MAX_HEAD_DIM = 128
MAX_BATCH = 65535  # gridDim.y of the scoring kernel
MAX_CAPACITY = 2**31 - 1  # int32 indices


def check_k(k) -> int:
    """``k`` as a Python int; an integer in [1, `MAX_K`] (bool is refused)."""
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k: expected an integer, got {type(k).__name__}")
    if not 1 <= int(k) <= MAX_K:
        raise ValueError(f"k: expected 1 <= k <= {MAX_K}, got {int(k)}")
    return int(k)


def _intake(x, name: str, dtypes, ndim: int):
    """``x`` as an array of one of ``dtypes`` (a dtype or a tuple of them) and ``ndim`` dimensions."""
    x = arrays.as_array(x, name)
    allowed = [np.dtype(d) for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,))]
    if x.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(d.name for d in allowed)}, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got {arrays.describe(x)}")
    arrays.check_contiguous(name, x)
    arrays.check_aligned(name, x)
    return x


def check_inputs(q, w, keys, lengths, k):
    """Validated ``(q, w, keys, lengths, k)``; raises with the argument's name on any mismatch.

    q : bf16 ``[B, H, D]``, H a multiple of 8 in [8, 64], D a multiple of 32 in [32, 128]
    w : fp32 or bf16 ``[B, H]``
    keys : bf16 ``[B, C, D]`` or ``[1, C, D]`` (one cache shared by every row), C >= 1
    lengths : int32 ``[B]``
    k : int in [1, 4096]
    All C-contiguous, in one memory (host or one device), device arrays 16-byte aligned.
    """
    q = _intake(q, "q", arrays.BF16, 3)
    w = _intake(w, "w", (np.float32, arrays.BF16), 2)
    keys = _intake(keys, "keys", arrays.BF16, 3)
    lengths = _intake(lengths, "lengths", np.int32, 1)
    k = check_k(k)
    bsz, heads, dim = q.shape
    if heads % 8 or not 8 <= heads <= MAX_HEADS:
        raise ValueError(f"q: expected a multiple of 8 in [8, {MAX_HEADS}] heads, got shape {tuple(q.shape)}")
    if dim % 32 or not 32 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected a head dimension that is a multiple of 32 in [32, {MAX_HEAD_DIM}], "
                         f"got shape {tuple(q.shape)}")
    if bsz > MAX_BATCH:
        raise ValueError(f"q: at most {MAX_BATCH} sequences per call, got shape {tuple(q.shape)}")
    if tuple(w.shape) != (bsz, heads):
        raise ValueError(f"w: expected shape {(bsz, heads)} to match q {tuple(q.shape)}, got {arrays.describe(w)}")
    if keys.shape[0] not in (bsz, 1) or keys.shape[2] != dim:
        raise ValueError(f"keys: expected shape ({bsz}, C, {dim}) or (1, C, {dim}) (shared by every row) to match "
                         f"q {tuple(q.shape)}, got {arrays.describe(keys)}")
    if not 1 <= keys.shape[1] <= MAX_CAPACITY:
        raise ValueError(f"keys: expected a capacity C in [1, {MAX_CAPACITY}], got shape {tuple(keys.shape)}")
    if tuple(lengths.shape) != (bsz,):
        raise ValueError(f"lengths: expected shape ({bsz},) to match q {tuple(q.shape)}, got {arrays.describe(lengths)}")
    arrays.check_same_device(q=q, w=w, keys=keys, lengths=lengths)
    return q, w, keys, lengths, k


def _outputs(out_indices, out_scores, workspace, bsz: int, capacity: int, k: int, like):
    xp = arrays.array_module(like)
    if out_indices is None:
        out_indices = xp.empty((bsz, k), np.int32)
    else:
        arrays.check_out("out_indices", out_indices, (bsz, k), np.int32, like)
    if out_scores is None:
        out_scores = xp.empty((bsz, k), np.float32)
    else:
        arrays.check_out("out_scores", out_scores, (bsz, k), np.float32, like)
    if workspace is None:
        workspace = xp.empty((bsz, capacity), np.float32)
    else:
        arrays.check_out("workspace", workspace, (bsz, capacity), np.float32, like)
    return out_indices, out_scores, workspace


def select_kernel(bsz: int, capacity: int, sms: int, compute_capability: int = 90) -> str:
    """The top-k kernel for ``bsz`` rows of ``capacity`` entries on a GPU of ``sms`` SMs: one block
    of 256 threads per row up to `TOPK_SMALL_MAX_CAPACITY` entries, the cluster select (sm_90+) for
    longer rows while the clusters fit in one wave, else one block of 1024 threads per row
    (registers up to 32768 entries, global memory beyond). `TOPK_SELECT` forces the cluster, or
    ("block") one block per row."""
    if TOPK_SELECT not in ("auto", "block", "cluster"):
        raise ValueError(f"TOPK_SELECT: expected 'auto', 'block' or 'cluster', got {TOPK_SELECT!r}")
    fits = capacity <= _CLUSTER_CAPACITY and compute_capability >= 90
    if TOPK_SELECT == "cluster":
        if not fits:
            raise ValueError(f"TOPK_SELECT='cluster': the cluster select needs sm_90+ and a capacity up to "
                             f"{_CLUSTER_CAPACITY}, got capacity {capacity} on compute capability {compute_capability}")
        return _cluster_kernel(capacity)
    if capacity <= min(TOPK_SMALL_MAX_CAPACITY, 32 * _SMALL_TOPK_THREADS):  # before the cluster: faster
        return "indexer_topk_registers_small"
    if (TOPK_SELECT == "auto" and fits and capacity >= CLUSTER_MIN_CAPACITY
            and bsz * _CLUSTER_BLOCKS <= CLUSTER_MAX_WAVES * sms):
        return _cluster_kernel(capacity)
    return "indexer_topk_registers" if capacity <= _REGISTER_CAPACITY else "indexer_topk_global"


def _cluster_kernel(capacity: int) -> str:
    """The cluster select's build for ``capacity``: 256-thread blocks up to `CLUSTER_SMALL_MAX_CAPACITY`."""
    small = capacity <= min(CLUSTER_SMALL_MAX_CAPACITY, _SMALL_CLUSTER_CAPACITY)
    return "indexer_topk_cluster_small" if small else "indexer_topk_cluster"


class QueryRope(NamedTuple):
    """The RoPE an index query gets between its projection and the scores (no norm),
    `fp4kit.ops.elementwise.rmsnorm_rope(q, None, positions + offset, normalize=False,
    rope_dim=rope_dim, theta=theta)`: ``positions`` int32 ``[B]`` read on the device, ``offset``
    added to each, ``theta`` the RoPE base or the channel pairs' inverse frequencies."""
    positions: object
    rope_dim: int
    theta: object = 10000.0
    offset: int = 0


def _check_query_rope(rope, q) -> QueryRope:
    if not isinstance(rope, QueryRope):
        raise TypeError(f"query_rope: expected a fp4kit.ops.indexer.QueryRope, got {type(rope).__name__}")
    batch, _, dim = q.shape
    positions, offset = ew_ops.check_rope_positions("query_rope", rope.positions, rope.offset, batch, q)
    rope_dim = rope.rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, numbers.Integral) or not 0 < rope_dim <= dim \
            or rope_dim % 2:
        raise ValueError(f"query_rope.rope_dim: expected an even number in [2, {dim}], got {rope_dim!r}")
    return QueryRope(positions, int(rope_dim), rope.theta, offset)


def score_topk(q, w, keys, lengths, k: int, *, w_scale: float = 1.0, out_indices=None, out_scores=None,
               workspace=None, key_range=None, query_rope=None):
    """Indices and scores of the ``k`` highest-scoring live keys of each sequence.

    Parameters
    ----------
    q : bf16 ``[B, H, D]``
        Index queries of the decode token (H a multiple of 8 up to 64, D a multiple of 32 up to 128).
    w : fp32 or bf16 ``[B, H]``
        Per-head weights; the scores use ``w * w_scale`` in fp32.
    keys : bf16 ``[B, C, D]``, or ``[1, C, D]``
        The preallocated compressed-key cache; only entries ``t < lengths[b]`` are read. One cache
        ``[1, C, D]`` is scored by every row: the ``B`` query positions of one sequence's prefill,
        each with its own ``lengths[b]`` (the entries complete at its position).
    lengths : int32 ``[B]``
        Live entries per sequence, in the same memory as the other inputs (on the device for
        device inputs: read by the kernels, never by the host). Clamped to ``[0, C]``; a length
        outside that range is recorded in the status word.
    k : int in [1, 4096]
    w_scale : float, optional
        A factor on every head weight (e.g. the 1/sqrt(D H) of DeepSeek-V4), applied in the kernel
        (no launch of its own); 1 by default.
    out_indices : int32 ``[B, k]``, optional
        Receives the selected indices in **ascending index order**, then ``-1`` in the slots past
        ``min(k, lengths[b])``.
    out_scores : fp32 ``[B, k]``, optional
        Receives the score of each selected index (NaN reported as ``-inf``), ``-inf`` in padding.
    workspace : fp32 ``[B, C]``, optional
        Scratch for the scores; after the call ``workspace[b, :lengths[b]]`` holds every live score
        (the rest is left as it was). Allocated per call when not given.
    key_range : uint32 ``[B, 2]``, optional
        Zero before the first call (``cupy.zeros``) and left zero by every call: the scoring kernel
        gathers each row's lowest and highest score key in it and the select, having read them, puts
        the zeros back. With it the select's radix passes start at the highest bit in which the
        live scores differ instead of at the sign bit (one pass fewer where the scores share their
        sign and exponent, as they do here); the selection is the same bit for bit. One buffer per
        concurrent call (a stream), like ``workspace``. Without it the passes cover every bit.
    query_rope : `QueryRope`, optional
        ``q`` is the index query projection's raw output: each head's last ``rope_dim`` channels are
        rotated first, as `fp4kit.ops.elementwise.rmsnorm_rope` with ``normalize=False`` rotates
        them (the same bits); on the device by the scoring launch as it stages the query (one
        launch less).

    Returns
    -------
    (indices, scores)
        ``out_indices`` and ``out_scores`` (or new arrays in the memory of the inputs).

    All arguments are validated before anything runs. On the device the two launches go to
    CuPy's current stream with no host synchronisation; with every output given the call
    allocates nothing and can be captured in a CUDA graph (call it once eagerly first: the first
    call compiles the kernels).
    """
    q, w, keys, lengths, k = check_inputs(q, w, keys, lengths, k)
    if isinstance(w_scale, (bool, np.bool_)) or not isinstance(w_scale, numbers.Real):
        raise TypeError(f"w_scale: expected a real number, got {type(w_scale).__name__}")
    if not np.isfinite(w_scale):
        raise ValueError(f"w_scale: expected a finite number, got {w_scale!r}")
    bsz, capacity = q.shape[0], keys.shape[1]
    shared = keys.shape[0] == 1  # one cache for every row (the same offsets when B = 1)
    out_indices, out_scores, workspace = _outputs(out_indices, out_scores, workspace, bsz, capacity, k, q)
    if key_range is not None:
        arrays.check_out("key_range", key_range, (bsz, 2), np.uint32, q)
    if query_rope is not None:
        query_rope = _check_query_rope(query_rope, q)
    if not arrays.is_device_array(q):
        if query_rope is not None:
            q = ew_ref.rmsnorm_rope(q, None, query_rope.positions + np.int32(query_rope.offset), normalize=False,
                                    rope_dim=query_rope.rope_dim, theta=query_rope.theta)
        w32 = w.astype(np.float32) * np.float32(w_scale)  # as the kernel: bf16 -> fp32 exactly, one fp32 product
        s = ref.scores(q, w32, np.broadcast_to(keys, (bsz, *keys.shape[1:])), lengths)
        n = ref.live_lengths(lengths, capacity)
        for b in range(bsz):
            workspace[b, : n[b]] = s[b, : n[b]]
        if ref.has_nan(s, lengths) or ref.lengths_out_of_range(lengths, capacity):
            status.record_host(status.INDEXER_INPUT)
        indices, values = ref.topk(s, lengths, k)
        out_indices[...] = indices
        out_scores[...] = values
        return out_indices, out_scores
    if bsz == 0:
        return out_indices, out_scores
    heads, dim = q.shape[1], q.shape[2]
    scores_kernel = loader.get_kernel(_MODULE, "indexer_scores", block=_SCORE_THREADS)
    grid = (-(-capacity // _KEYS_PER_BLOCK), bsz)
    w_bf16 = _I32(w.dtype == arrays.BF16)
    ranges = key_range if key_range is not None else np.uint64(0)  # null: passes over every bit
    if query_rope is None:
        rope_args = (0, _I32(0), 0, _U32(0))
    else:
        rope_args = (query_rope.positions, _I32(query_rope.offset),
                     ew_ops.rope_table(query_rope.theta, query_rope.rope_dim, q, "query_rope.theta"),
                     _U32(query_rope.rope_dim))
    scores_kernel.launch(grid, _SCORE_THREADS, (q, w, w_bf16, np.float32(w_scale), keys, lengths, workspace,
                                               _U32(heads), _U32(dim), _U32(capacity), _U32(shared), ranges,
                                               *rope_args))
    device = arrays.device_id(q)
    name = select_kernel(bsz, capacity, loader.sm_count(device), int(loader.compute_capability(device)))
    threads = _SMALL_TOPK_THREADS if name.endswith("_small") else _TOPK_THREADS
    topk_kernel = loader.get_kernel(_MODULE, name, block=threads)
    blocks = bsz * _CLUSTER_BLOCKS if "_cluster" in name else bsz  # clusters: blocks 8b .. 8b+7
    topk_kernel(blocks, threads, (workspace, lengths, _U32(capacity), _U32(k), _I32(capacity % 4 == 0),
                                        out_indices, out_scores, status.device_word(), ranges))
    return out_indices, out_scores
