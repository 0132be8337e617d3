"""Token sampling specification: the truncated distribution, the Philox numbers and the draw.

For each row ``b`` of logits ``[B, V]`` with parameters ``T = temperature[b]``, ``k = top_k[b]``,
``p = top_p[b]`` and ``m = min_p[b]`` (scalars broadcast to every row):

* **Canonical logits.** NaN is read as ``-inf``. ``-inf`` is an ordinary mask value.
* **Special rows (no draw).** The result is the *greedy* token, the lowest id holding the row's
  largest canonical logit, when ``T == 0`` (any ``T`` below the smallest normal fp32, 1.18e-38,
  counts as 0: the kernels run with ``-ftz``), when the row holds a ``+inf`` (the lowest-id
  ``+inf`` token is certain), or when the row has no finite logit and no ``+inf`` (token 0).
* **Distribution.** Otherwise ``P_i = softmax((l_i - l_max) / T)``. Order the tokens by
  "larger probability first, equal probabilities: lower id first". Every filter keeps a *prefix*
  of that order, so the kept set is the shortest of the three prefixes:

  1. top-k (``k > 0``): the first ``k`` tokens;
  2. top-p (``p < 1``), over the renormalised top-k survivors: the shortest prefix whose
     probability is ``>= p * P(top-k set)``;
  3. min-p (``m > 0``): the tokens with ``P_i >= m * max_j P_j`` (a ratio, so renormalising first
     does not change it).

  The kept probabilities are renormalised to sum to 1 (`probabilities`).
* **Draw (exponential race / Gumbel-max).** Token ``i`` gets the 32-bit Philox word ``x_i`` (see
  `philox_words`), ``u_i = ((x_i >> 8) | 1) * 2**-24`` in ``(0, 1)`` (exact in fp32), the Gumbel
  number ``g_i = -log(-log(u_i))``, and the result is the kept token with the largest
  ``(l_i - l_max) / T + g_i`` (equivalently ``log P_i + g_i``), ties to the lower id. This is an
  exact draw from the renormalised kept distribution, up to the 2**-23 resolution of ``u``.
* **Random numbers.** Philox4x32-10 with key ``(seed_lo, seed_hi)`` and counter
  ``(i // 4, b, offset_lo, offset_hi)``; token ``i`` takes word ``i % 4``. ``seed`` and ``offset`` are
  uint64; every call advances ``offset`` by one, so each call, row and token has its own numbers.
* **Invalid per-row values** (only possible in device arrays, which are not read on the host) are
  replaced before use: ``T`` NaN or negative -> 0 (greedy); ``k < 0`` -> 0 (off); ``p`` NaN or
  outside ``(0, 1]`` -> 1 (off); ``m`` NaN or outside ``[0, 1)`` -> 0 (off). Each replacement, a NaN
  or ``+inf`` logit, and a row with no finite logit are reported as a status event
  (`row_events`).

The reference computes in float64; the kernels compute ``(l - l_max) * (1 / T)`` in fp32, race
with the equivalent key ``exp(d_i) / -log(u_i)`` in fp32 (one accurate log, fast exp and divide:
~1e-6 relative) and keep the top-p masses in 36-bit fixed point, so they can differ from it only
when two candidates (or a cumulative mass and its target) lie within rounding of each other.
"""

from __future__ import annotations

import numpy as np

FLT_MIN = float(np.finfo(np.float32).tiny)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 of counters ``[..., 4]`` (uint32 words) under keys ``[..., 2]``; uint32 ``[..., 4]``.

    Word order as in Random123: ``counter = (c0, c1, c2, c3)``, ``key = (k0, k1)``.
    """
    c = np.asarray(counter, np.uint64) & _LO
    k = np.asarray(key, np.uint64) & _LO
    c0, c1, c2, c3 = (c[..., j].copy() for j in range(4))
    k0, k1 = k[..., 0].copy(), k[..., 1].copy()
    k0, k1 = np.broadcast_arrays(k0, k1)
    k0, k1 = k0.copy(), k1.copy()
    for r in range(10):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _LO, (p0 >> _S32) ^ c3 ^ k1, p0 & _LO
        if r < 9:
            k0 = (k0 + _W0) & _LO
            k1 = (k1 + _W1) & _LO
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def philox_words(seed: int, offset: int, rows: int, vocab: int) -> np.ndarray:
    """The Philox word of every (row, token) of one call: uint32 ``[rows, vocab]``."""
    seed, offset = int(seed) % 2**64, int(offset) % 2**64
    groups = -(-vocab // 4)
    ctr = np.zeros((rows, groups, 4), np.uint64)
    ctr[..., 0] = np.arange(groups, dtype=np.uint64)[None, :]
    ctr[..., 1] = np.arange(rows, dtype=np.uint64)[:, None]
    ctr[..., 2] = offset & 0xFFFFFFFF
    ctr[..., 3] = offset >> 32
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64)
    return philox4x32_10(ctr, key).reshape(rows, groups * 4)[:, :vocab]


def uniforms(words) -> np.ndarray:
    """``((x >> 8) | 1) * 2**-24``: odd multiples of 2**-24 in (0, 1), exact in fp32 (float64 here)."""
    w = np.asarray(words, np.uint32)
    return ((w >> np.uint32(8)) | np.uint32(1)).astype(np.float64) * 2.0**-24


def gumbel(words) -> np.ndarray:
    return -np.log(-np.log(uniforms(words)))


def _per_row(name: str, value, rows: int, dtype) -> np.ndarray:
    a = np.asarray(value, dtype=dtype)
    if a.ndim == 0:
        return np.full(rows, a, dtype=dtype)
    if a.shape != (rows,):
        raise ValueError(f"{name}: expected a scalar or shape ({rows},), got shape {a.shape}")
    return a


def sanitize(rows: int, temperature, top_k, top_p, min_p):
    """Per-row ``(T, k, p, m, invalid)`` with the invalid-value replacements of the module docstring."""
    t = _per_row("temperature", temperature, rows, np.float64)
    k = _per_row("top_k", top_k, rows, np.int64)
    p = _per_row("top_p", top_p, rows, np.float64)
    m = _per_row("min_p", min_p, rows, np.float64)
    bad_t = np.isnan(t) | (t < 0)
    bad_k = k < 0
    bad_p = np.isnan(p) | (p <= 0) | (p > 1)
    bad_m = np.isnan(m) | (m < 0) | (m >= 1)
    t = np.where(bad_t | (t < FLT_MIN), 0.0, t)
    return (t, np.where(bad_k, 0, k), np.where(bad_p, 1.0, p), np.where(bad_m, 0.0, m),
            bad_t | bad_k | bad_p | bad_m)


def canonical(logits) -> np.ndarray:
    """Logits as float64 with NaN -> -inf."""
    x = np.asarray(logits).astype(np.float64)
    return np.where(np.isnan(x), -np.inf, x)


def greedy(logits) -> np.ndarray:
    """int32 ``[B]``: the lowest id holding each row's largest canonical logit (token 0 if none)."""
    return np.argmax(canonical(logits), axis=-1).astype(np.int32)


def row_events(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """bool ``[B]``: a NaN or ``+inf`` logit, no finite logit, or an invalid per-row parameter."""
    x = np.asarray(logits).astype(np.float64)
    bad = np.isnan(x).any(-1) | np.isposinf(x).any(-1) | ~np.isfinite(x).any(-1)
    return bad | sanitize(x.shape[0], temperature, top_k, top_p, min_p)[4]


def _special_rows(c: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Rows whose result is the greedy token: T == 0, a +inf logit, or no finite logit."""
    return (t == 0) | np.isposinf(c).any(-1) | ~np.isfinite(c).any(-1)


def probabilities(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The renormalised kept distribution, float64 ``[B, V]`` (rows sum to 1).

    A special row (greedy, ``+inf``, no finite logit) is one-hot on its greedy token.
    """
    c = canonical(logits)
    rows, vocab = c.shape
    t, k, p, m, _ = sanitize(rows, temperature, top_k, top_p, min_p)
    out = np.zeros((rows, vocab), np.float64)
    special = _special_rows(c, t)
    g = np.argmax(c, axis=-1)
    for b in range(rows):
        if special[b]:
            out[b, g[b]] = 1.0
            continue
        z = (c[b] - c[b].max()) / t[b]
        w = np.exp(z)
        prob = w / w.sum()
        order = np.lexsort((np.arange(vocab), -prob))  # larger first, then lower id
        sorted_p = prob[order]
        n = vocab
        if k[b] > 0:
            n = min(n, int(k[b]))
        if p[b] < 1:
            cum = np.cumsum(sorted_p[:n])
            target = p[b] * cum[-1]
            n = min(n, int(np.searchsorted(cum, target, side="left")) + 1)
        if m[b] > 0:
            n = min(n, int(np.count_nonzero(prob >= m[b] * prob.max())))
        kept = order[:n]
        out[b, kept] = prob[kept] / prob[kept].sum()
    return out


def kept_mask(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """bool ``[B, V]``: the tokens that can be drawn (probability > 0 after truncation)."""
    return probabilities(logits, temperature, top_k, top_p, min_p) > 0


def sample(logits, seed: int, offset: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """One draw per row with the Philox numbers of ``(seed, offset)``: int32 ``[B]``.

    The race runs in float64 over ``log P_i + g_i`` of the kept tokens (ties to the lower id).
    """
    c = canonical(logits)
    rows, vocab = c.shape
    t = sanitize(rows, temperature, top_k, top_p, min_p)[0]
    prob = probabilities(logits, temperature, top_k, top_p, min_p)
    g = gumbel(philox_words(seed, offset, rows, vocab))
    with np.errstate(divide="ignore"):
        score = np.where(prob > 0, np.log(prob) + g, -np.inf)
    tokens = np.argmax(score, axis=-1).astype(np.int32)
    special = _special_rows(c, t)
    tokens[special] = np.argmax(c[special], axis=-1) if special.any() else tokens[special]
    return tokens
