"""DeepSeek-V4 sparse decode attention specification (MQA over one shared latent, K = V).

One query token per sequence. For sequence ``b`` and query head ``h``, the candidate rows are

* the **window**: the ring buffer ``swa[b]`` of ``W`` slots; ``pos[b]`` tokens have been written,
  token ``t`` at slot ``t % W``, so the valid slots are ``0 .. min(max(pos[b], 0), W) - 1``
  (all ``W`` once the ring has wrapped; a negative position counts as 0);
* the **selected compressed entries**: the rows ``comp[b, i]`` for each ``i`` in ``indices[b]``
  with ``0 <= i < min(max(comp_len[b], 0), C)``. ``-1`` (padding), any other negative index, an
  index at or beyond the live length ``comp_len[b]`` and (should ``comp_len`` exceed the
  capacity) an index at or beyond the capacity ``C`` are ignored. **An index that appears twice
  counts twice**: the selection is used as given, not deduplicated (as a gather by index does).

`prefill_attention` states the same for ``T`` consecutive prompt tokens of one sequence at once
(each over its causal window and the entries complete at its position), the specification of a
batched prefill: it equals decoding the prompt token by token.

Each valid row ``k_j`` is both key and value. With logits ``l_j = scale * <q[b, h], k_j>`` and
the per-head attention-sink logit ``s_h``, one softmax runs over the union of the valid rows plus
the sink, and the sink contributes to the normaliser only (it has no value vector):

    m   = max(s_h, max_j l_j)
    o   = sum_j exp(l_j - m) k_j / (exp(s_h - m) + sum_j exp(l_j - m))

**No valid row gives o = 0** (the empty sum over a positive normaliser, or 0 by definition when
the sink is ``-inf`` as well). A sink of ``-inf`` turns the sink off. Everything is computed in
float64 from the exact values of the bf16 inputs; the kernels accumulate in fp32 and are compared
with this reference by ``calc_diff`` (`fp4kit.reference.gemm.calc_diff`).
"""

from __future__ import annotations

import numpy as np


def default_scale(head_dim: int) -> float:
    """The softmax scale used when none is given: ``head_dim ** -0.5``."""
    return float(head_dim) ** -0.5


def window_slots(pos: int, window: int) -> np.ndarray:
    """The valid ring slots of a sequence that has written ``pos`` tokens into a ``window``-slot ring."""
    return np.arange(min(max(int(pos), 0), int(window)), dtype=np.int64)


def selected_entries(indices, comp_len: int, capacity: int) -> np.ndarray:
    """The valid entries of one sequence's selection, in the given order, duplicates kept
    (``indices`` None: every live entry, in order)."""
    live = min(max(int(comp_len), 0), int(capacity))
    if indices is None:
        return np.arange(live, dtype=np.int64)
    idx = np.asarray(indices).astype(np.int64).reshape(-1)
    return idx[(idx >= 0) & (idx < live)]


def valid_rows(swa_b, pos: int, comp_b, comp_len: int, indices_b) -> np.ndarray:
    """The valid K = V rows of one sequence as float64 ``[n, D]``: window rows, then entries."""
    window = np.asarray(swa_b)[window_slots(pos, np.shape(swa_b)[0])]
    comp = np.asarray(comp_b)[selected_entries(indices_b, comp_len, np.shape(comp_b)[0])]
    return np.concatenate([window, comp]).astype(np.float64)


def attend(q_b, rows, sink, scale: float) -> np.ndarray:
    """Softmax attention of the heads ``q_b [Hq, D]`` over ``rows [n, D]`` (K = V) with the sink."""
    q = np.asarray(q_b).astype(np.float64)
    sink = np.asarray(sink).astype(np.float64)
    if rows.shape[0] == 0:
        return np.zeros_like(q)
    logits = scale * (q @ rows.T)  # [Hq, n]
    m = np.maximum(sink, logits.max(axis=1))
    weights = np.exp(logits - m[:, None])
    with np.errstate(invalid="ignore"):  # a -inf sink with -inf m only arises with no rows
        sink_term = np.where(np.isneginf(sink), 0.0, np.exp(sink - m))
    denominator = sink_term + weights.sum(axis=1)
    return (weights @ rows) / denominator[:, None]


def sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink, scale: float | None = None) -> np.ndarray:
    """The attention output as float64 ``[B, Hq, D]`` (see the module docstring).

    Parameters
    ----------
    q : ``[B, Hq, D]`` query heads of the one decode token per sequence
    swa : ``[B, W, D]`` sliding-window ring buffer
    pos : int ``[B]`` tokens written so far per sequence
    comp : ``[B, C, D]`` compressed cache (capacity ``C``)
    comp_len : int ``[B]`` live compressed length per sequence
    indices : int ``[B, N]`` selected compressed entries (-1 = padding), or None: every live entry
    sink : ``[Hq]`` attention-sink logit per head
    scale : softmax scale, default ``D ** -0.5``
    """
    q = np.asarray(q)
    batch, _, head_dim = q.shape
    scale = default_scale(head_dim) if scale is None else float(scale)
    pos, comp_len = np.asarray(pos), np.asarray(comp_len)
    indices = None if indices is None else np.asarray(indices)
    out = np.empty(q.shape, np.float64)
    for b in range(batch):
        rows = valid_rows(swa[b], pos[b], comp[b], comp_len[b], None if indices is None else indices[b])
        out[b] = attend(q[b], rows, sink, scale)
    return out


def prefill_attention(q, kv, start: int, window: int, comp, comp_len, indices, sink,
                      scale: float | None = None) -> np.ndarray:
    """Attention of ``T`` consecutive query tokens of one sequence as float64 ``[T, Hq, D]``: what
    `sparse_decode_attention` gives each of them when the prompt is decoded token by token.

    Query ``t`` sits at position ``p = start + t``. Its window is the rows of the ``window`` tokens
    ending at ``p`` itself (``kv[max(0, p + 1 - window) : p + 1]``: the decode step appends a token
    before it attends); its compressed rows are ``comp[i]`` for each ``i`` in ``indices[t]`` with
    ``0 <= i < min(comp_len[t], C)`` (the entries complete at ``p``; duplicates count twice, -1
    pads), in one softmax with the sink.

    Parameters
    ----------
    q : ``[T, Hq, D]`` query heads of the T tokens
    kv : ``[start + T, D]`` (or longer) the K = V row of every token of the sequence so far
    start : position of the first query token
    window : sliding-window length ``W``
    comp : ``[C, D]`` compressed entries of the sequence
    comp_len : int ``[T]`` entries complete at each query's position
    indices : int ``[T, N]`` the selection of each query (-1 = padding), or None: every entry complete at it
    sink, scale : as in `sparse_decode_attention`
    """
    q, kv = np.asarray(q), np.asarray(kv)
    t_count, _, head_dim = q.shape
    if kv.shape[0] < start + t_count:
        raise ValueError(f"kv: expected at least start + T = {start + t_count} rows, got {kv.shape[0]}")
    scale = default_scale(head_dim) if scale is None else float(scale)
    out = np.empty(q.shape, np.float64)
    for t in range(t_count):
        p = start + t
        rows = np.concatenate([kv[max(0, p + 1 - window): p + 1],
                               np.asarray(comp)[selected_entries(None if indices is None else indices[t], comp_len[t],
                                                                 np.shape(comp)[0])]])
        out[t] = attend(q[t], rows.astype(np.float64), sink, scale)
    return out
