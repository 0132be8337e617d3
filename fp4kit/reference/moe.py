"""Mixture-of-Experts specification: DeepSeek routing and the NVFP4 expert computation.

Routing (`route`), per token:

1. ``logits = x @ gate_weight^T`` (fp32 inputs, float64 here; the kernel accumulates in fp32);
2. ``scores = f(logits)`` with ``f`` = ``"sqrtsoftplus"`` (V4: ``sqrt(log(1 + exp(l)))``),
   ``"sigmoid"`` (V3) or ``"softmax"`` (over the experts);
3. selection uses ``scores + bias`` (the noaux bias, selection only); with ``n_group > 1`` (V3) the
   experts form ``n_group`` groups, a group scores the sum of its two best selection scores, and
   only the ``topk_group`` best groups stay eligible;
4. the ``top_k`` eligible experts with the largest selection scores, ties to the lower expert id;
   **hash routing** (V4's first layers) instead reads the ids from ``tid2eid[token_id]`` (an id
   outside ``[0, vocab)`` reads row 0; the layers record it as a status event);
5. ``weights = scores[ids]`` (unbiased), divided by their sum when ``renormalize``, times
   ``routed_scale``.

Experts (`moe`): every (token, slot) pair runs its expert ``e``:
``h = A_x @ W13[e]^T`` (bf16 result; W13 rows interleave gate and up in chunks of 16), the fused
SwiGLU (+ clamp) with the routing weight as row factor when ``weight_before_down`` (V4) and the
NVFP4 quantization of all rows with one global scale (W4A4) or a bf16 rounding (W4A16),
``y = A_h @ W2[e]^T``, and ``out[t] = sum over slots of y`` (times the routing weight when the
weight is applied after the down projection, V3), plus the shared expert.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..formats import Nvfp4Tensor
from . import gemm as gemm_ref
from . import quant as quant_ref
from .elementwise import token_rows

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
BF16 = np.dtype(ml_dtypes.bfloat16)


def scores_from_logits(logits: np.ndarray, score_func: str) -> np.ndarray:
    """Router scores ``[T, E]`` from logits, in float64."""
    z = np.asarray(logits, np.float64)
    if score_func == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, z))
    if score_func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if score_func == "softmax":
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")


def top_k_lowest_index_ties(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values per row, descending; equal values: lower index first."""
    order = np.lexsort((np.broadcast_to(np.arange(values.shape[-1]), values.shape), -values), axis=-1)
    return order[..., :k]


def route(
    x,
    gate_weight,
    *,
    top_k: int,
    score_func: str = "sqrtsoftplus",
    bias=None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scale: float = 1.0,
    tid2eid=None,
    token_ids=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids ``[T, top_k]`` (int32) and routing weights ``[T, top_k]`` (fp32)."""
    logits = np.asarray(x).astype(np.float64) @ np.asarray(gate_weight).astype(np.float64).T
    scores = scores_from_logits(logits, score_func)
    t, e = scores.shape
    if tid2eid is not None:
        rows, _ = token_rows(token_ids, len(tid2eid))  # out of range: row 0 (a status event)
        ids = np.asarray(tid2eid)[rows].astype(np.int64)
    else:
        sel = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
        if n_group > 1:
            groups = sel.reshape(t, n_group, e // n_group)
            group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)
            keep = top_k_lowest_index_ties(group_score, topk_group)
            mask = np.zeros((t, n_group), bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            sel = np.where(np.repeat(mask, e // n_group, axis=-1), sel, -np.inf)
        ids = top_k_lowest_index_ties(sel, top_k)
    weights = np.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return ids.astype(np.int32), (weights * routed_scale).astype(np.float32)


def moe(
    x,
    ids: np.ndarray,
    weights: np.ndarray,
    w13,
    w2,
    *,
    limit: float | None = None,
    weight_before_down: bool = True,
    mode: str = "w4a4",
    w13_row_decode=None,
    layout: str = "interleaved",
) -> np.ndarray:
    """Routed-expert output ``[T, H]`` in float32 (before the shared expert).

    ``w13`` / ``w2`` are sequences of per-expert `Nvfp4Tensor` (``[2I, H]`` in ``layout`` and
    ``[H, I]``); ``w13_row_decode`` an optional sequence of per-row decode vectors.
    """
    x = np.asarray(x)
    t, k = ids.shape
    a_x = quant_ref.quantize(x) if mode == "w4a4" else x.astype(BF16)
    flat_ids = ids.reshape(-1)
    token_of = np.repeat(np.arange(t), k)
    # L1 for every (token, slot) row, in token-major order (the kernels use expert order; the
    # rows are independent, so the order does not change any value)
    h = np.empty((t * k, w13[0].shape[0]), BF16)
    for e in np.unique(flat_ids):
        rows = np.nonzero(flat_ids == e)[0]
        a = take_rows(a_x, token_of[rows])
        rd = None if w13_row_decode is None else w13_row_decode[e]
        h[rows] = gemm_ref.gemm(a, w13[e], None, rd, BF16)
    row_scale = weights.reshape(-1).astype(np.float32) if weight_before_down else None
    if mode == "w4a4":
        a_h = quant_ref.swiglu_quantize(h, layout, limit, None, row_scale)
    else:
        a_h = quant_ref.swiglu(h, layout, limit, row_scale).astype(BF16)
    y = np.empty((t * k, w2[0].shape[0]), np.float32)
    for e in np.unique(flat_ids):
        rows = np.nonzero(flat_ids == e)[0]
        y[rows] = gemm_ref.gemm(take_rows(a_h, rows), w2[e], None, None, np.float32)
    y = y.reshape(t, k, -1)
    if not weight_before_down:
        y = y * weights[..., None]
    return y.sum(1, dtype=np.float64).astype(np.float32)


def take_rows(a, rows):
    """Rows ``rows`` of an activation: a bf16 / fp32 array, or an `Nvfp4Tensor` with linear scales
    (its global scale shared by every row)."""
    if isinstance(a, Nvfp4Tensor):
        return Nvfp4Tensor(np.asarray(a.packed)[rows], np.asarray(a.block_scales)[rows], np.asarray(a.global_scale),
                           "linear", (len(rows), a.shape[-1]))
    return np.asarray(a)[rows]


def dispatch(counts, tickets, ids, weights):
    """The device dispatch of a routed batch: ``(offsets [E+1], active [A], slot_row [P], row_token [P],
    row_weight [P])`` for ``P = T * top_k`` (token, slot) pairs, all uint32 but ``row_weight`` fp32.

    ``counts [E]`` are the pairs per expert and ``tickets [T, top_k]`` each pair's rank among the pairs
    of its expert (`fp4kit.reference.dist.tickets` gives them in pair order; the router's atomics give
    them in any order). ``offsets`` is the exclusive prefix sum of ``counts``; ``active`` lists the
    experts with a pair, in id order; pair ``p`` goes to sorted row ``offsets[ids[p]] + tickets[p]``,
    which holds its token ``p // top_k`` and its routing weight.

    Counts that do not sum to ``P``, or a ticket at or past its expert's count, are another call's
    (overlapping calls of one layer share its counters; `dispatch_is_consistent` is False and the
    kernel records ``MOE_DISPATCH``): every row stays in ``[0, P)``. Counts off: all offsets 0, no
    active expert, pair ``p`` at row ``p``. A ticket off: its pair at row ``P - 1``. Rows written by
    several pairs keep the last pair's token and weight (the kernel's pair order: any).
    """
    counts = np.asarray(counts).astype(np.int64)
    ids = np.asarray(ids)
    top_k = ids.shape[-1]
    flat = ids.reshape(-1).astype(np.int64)
    pairs = flat.size
    if counts.sum() != pairs:
        offsets = np.zeros(counts.size + 1, np.uint32)
        active = np.zeros(0, np.uint32)
        slot_row = np.arange(pairs, dtype=np.uint32)
    else:
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
        active = np.nonzero(counts)[0].astype(np.uint32)
        rows = offsets[flat].astype(np.int64) + np.asarray(tickets).reshape(-1)
        slot_row = np.where(rows < offsets[flat + 1], rows, pairs - 1).astype(np.uint32)
    row_token = np.empty(pairs, np.uint32)
    row_weight = np.empty(pairs, np.float32)
    row_token[slot_row] = np.arange(pairs) // top_k
    row_weight[slot_row] = np.asarray(weights, np.float32).reshape(-1)
    return offsets, active, slot_row, row_token, row_weight


def dispatch_is_consistent(counts, tickets, ids) -> bool:
    """Whether the counts sum to the call's pairs and every ticket lies below its expert's count
    (else the dispatch kernel records `fp4kit.runtime.status.MOE_DISPATCH`)."""
    counts = np.asarray(counts).astype(np.int64)
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    if counts.sum() != flat.size:
        return False
    return bool((np.asarray(tickets).reshape(-1).astype(np.int64) < counts[flat]).all())


def combine(y, slot_row, weights, weighted: bool, shared=None) -> np.ndarray:
    """Routed results back in token order, with the combine kernel's arithmetic: bf16 ``[T, H]`` with
    ``out[t] = sum over slots j of y[slot_row[t, j]]`` (times ``weights[t, j]`` when ``weighted``: the
    weight applied after the down projection, V3), accumulated in fp32 in slot order (a fused
    multiply-add per weighted term), plus ``shared[t]`` (bf16) in fp32, rounded once to bf16.

    ``y`` fp32 ``[P, H]`` in sorted-row order, ``slot_row`` ``[T * top_k]``, ``weights`` fp32 ``[T, top_k]``.
    The fused multiply-add is formed in float64 (the product of two fp32 values is exact there) and
    rounded once to fp32, which equals the hardware's single rounding except for a float64 rounding
    landing on an fp32 tie (probability about 2^-29 per term).
    """
    y = np.asarray(y, np.float32)
    weights = np.asarray(weights, np.float32)
    t, k = weights.shape
    rows = np.asarray(slot_row).reshape(t, k).astype(np.int64)
    acc = np.zeros((t, y.shape[1]), np.float32)
    for j in range(k):
        v = y[rows[:, j]]
        if weighted:
            acc = (v.astype(np.float64) * weights[:, j, None].astype(np.float64) + acc).astype(np.float32)
        else:
            acc = acc + v  # fp32 add, round to nearest
    if shared is not None:
        acc = acc + np.asarray(shared).astype(np.float32)
    return acc.astype(BF16)
