"""Lightning-indexer specification (DeepSeek-V4 CSA layers): scores and top-k selection.

For one decode token per sequence ``b``:

* ``score[b, t] = sum_h w[b, h] * ReLU(q[b, h, :] . keys[b, t, :])`` for ``t < n_b``, where
  ``n_b = clamp(lengths[b], 0, C)`` is the live number of compressed keys and ``C`` the capacity of
  the key cache. ``ReLU(x) = 0 if x < 0 else x``, so a NaN dot product stays NaN.
* **Arithmetic.** The reference computes every dot product, ReLU, weight product and the sum over
  heads in float64, then rounds the score once to fp32 and flushes an fp32 subnormal to zero (the
  kernels run with ``-ftz=true``). The kernels accumulate the dot products in fp32 on the tensor
  cores and the head sum in fp32 (a fixed order, so they are deterministic); they agree with this
  reference to rounding, and bit for bit whenever every partial sum is exactly representable in
  fp32 (e.g. small integers times powers of two, which the GPU tests use for exact comparisons).
* **Canonical scores.** Selection and the returned values use ``canonical(score)``: NaN becomes
  ``-inf`` (the op records a NaN in the status word), ``-0.0`` becomes ``+0.0``. ``±inf`` are
  ordinary values.
* **Top-k.** The ``min(k, n_b)`` live entries that come first in the order "larger score first,
  equal scores: lower index first", i.e. the first entries of a full stable sort by descending
  score. The selected set is therefore exactly defined even with ties.
* **Output.** ``indices`` int32 ``[B, k]``: the selected indices in **ascending index order**
  (convenient for a gather in attention), then ``-1`` in the slots past ``min(k, n_b)``;
  ``values`` fp32 ``[B, k]``: the canonical score of each selected index, ``-inf`` in the padding.
"""

from __future__ import annotations

import numpy as np

from . import fp32

PAD_INDEX = -1


def live_lengths(lengths, capacity: int) -> np.ndarray:
    """``clamp(lengths, 0, capacity)`` as int64: the entries each row really scores."""
    return np.clip(np.asarray(lengths, np.int64), 0, capacity)


def canonical(scores) -> np.ndarray:
    """fp32 scores as the selection sees them: NaN -> -inf, -0.0 -> +0.0."""
    s = np.asarray(scores, np.float32)
    s = np.where(np.isnan(s), np.float32(-np.inf), s).astype(np.float32)
    return (s + np.float32(0)).astype(np.float32)  # -0 + +0 = +0 in round-to-nearest


def scores(q, w, keys, lengths) -> np.ndarray:
    """Index scores fp32 ``[B, C]``; entries at or past a row's live length are ``-inf``.

    Parameters
    ----------
    q : ``[B, H, D]`` (any float dtype, bf16 in the op)
    w : ``[B, H]`` per-head weights
    keys : ``[B, C, D]`` the compressed-key cache
    lengths : ``[B]`` integer live lengths (clamped to ``[0, C]``)
    """
    q = np.asarray(q).astype(np.float64)
    w = np.asarray(w).astype(np.float64)
    keys = np.asarray(keys)
    bsz, capacity = keys.shape[0], keys.shape[1]
    n = live_lengths(lengths, capacity)
    out = np.full((bsz, capacity), -np.inf, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(bsz):
            if n[b] == 0:
                continue
            dots = q[b] @ keys[b, : n[b]].astype(np.float64).T  # [H, n]
            relu = np.where(dots < 0, 0.0, dots)
            s = (w[b][:, None] * relu).sum(axis=0)
            out[b, : n[b]] = fp32.ftz(s.astype(np.float32))
    return out


def topk(scores, lengths, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices int32 ``[B, k]`` and values fp32 ``[B, k]`` of the top ``k`` live scores per row.

    A full stable sort by descending canonical score (ties: lower index first); the selected
    indices are returned in ascending order, padded with -1 (values -inf).
    """
    scores = np.asarray(scores, np.float32)
    bsz, capacity = scores.shape
    n = live_lengths(lengths, capacity)
    indices = np.full((bsz, k), PAD_INDEX, np.int32)
    values = np.full((bsz, k), -np.inf, np.float32)
    for b in range(bsz):
        s = canonical(scores[b, : n[b]])
        order = np.lexsort((np.arange(n[b]), -s.astype(np.float64)))  # last key is primary
        chosen = np.sort(order[:k])
        indices[b, : chosen.size] = chosen
        values[b, : chosen.size] = s[chosen]
    return indices, values


def score_topk(q, w, keys, lengths, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`scores` then `topk`: the lightning indexer of one decode step."""
    return topk(scores(q, w, keys, lengths), lengths, k)


def has_nan(scores, lengths) -> bool:
    """True if a live score is NaN (the op records it in the status word)."""
    scores = np.asarray(scores, np.float32)
    n = live_lengths(lengths, scores.shape[1])
    return any(bool(np.isnan(scores[b, : n[b]]).any()) for b in range(scores.shape[0]))


def lengths_out_of_range(lengths, capacity: int) -> bool:
    """True if a length lies outside ``[0, capacity]`` (it is clamped; the op records it)."""
    lengths = np.asarray(lengths, np.int64)
    return bool(((lengths < 0) | (lengths > capacity)).any())
