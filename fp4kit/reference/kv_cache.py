"""KV cache specification: the sliding-window ring buffer, the compressor and the preallocated
compressed-KV buffer of one DeepSeek-V4 attention layer, for a batch of sequences.

State per sequence ``b``: ``pos[b]`` tokens appended so far; the ring buffer ``swa[b]`` holds token
``p`` at slot ``p % W`` (the last ``W`` tokens); the compressed buffer ``comp[b]`` holds
``comp_len[b]`` entries, entry ``i`` summarising tokens ``[i*R, (i+1)*R)`` (``R`` = ratio 4 or 128).

The compressor (ratio ``R``; ``coff = 2`` when ``R == 4``: overlapping windows, else 1) takes per
token a key/value vector ``c`` and gate scores ``z`` of ``coff * D`` channels (the layer's learned
projections of the hidden state) and a learned per-slot bias ``ape[R, coff * D]``. When token ``p``
completes a block (``(p + 1) % R == 0``) it emits, per channel ``d``::

    entry[d] = sum_j softmax_j(z_j[ch] + ape[j % R][ch]) * c_j[ch]

over the block's ``R`` tokens with ``ch = coff==2 ? D + d : d`` and, for ``R == 4`` and blocks
after the first, also over the previous block's 4 tokens with ``ch = d`` (one softmax over the 8).
Then RMSNorm over ``D`` (``norm_weight``, ``eps``) and RoPE on the last ``rope_dim`` channels
(adjacent pairs, angle = block start position * theta**(-2i / rope_dim)); the entry is stored at
``comp[b, comp_len[b]]``. A sequence whose compressed buffer is full records the overflow (the
kernels set ``KV_COMP_OVERFLOW`` in the device status word) and the entry is dropped: never an
overwrite.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .elementwise import rope_inv_freq

BF16 = np.dtype(ml_dtypes.bfloat16)


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def append_swa(swa, pos, kv, counts=None) -> None:
    """Write ``kv [B, T, D]`` into the ring buffers ``swa [B, W, D]`` at slots ``(pos + i) % W``
    (only each sequence's first ``counts[b]`` tokens; when more than ``W``, the last ``W`` win)."""
    b_, t, _ = kv.shape
    w = swa.shape[1]
    for b in range(b_):
        n = t if counts is None else int(counts[b])
        for i in range(max(0, n - w), n):
            swa[b, (int(pos[b]) + i) % w] = kv[b, i]


def rope(x: np.ndarray, position: int, rope_dim: int, theta) -> np.ndarray:
    """Rotate the last ``rope_dim`` channels of ``x`` (adjacent pairs) by ``position``; ``theta``: the
    base, or the pairs' inverse frequencies (`fp4kit.reference.elementwise.rope_inv_freq`)."""
    if rope_dim == 0:
        return x
    y = x.copy()
    d = x.shape[-1]
    angle = position * rope_inv_freq(rope_dim, theta)
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[..., d - rope_dim :: 2], x[..., d - rope_dim + 1 :: 2]
    y[..., d - rope_dim :: 2] = a * c - b * s
    y[..., d - rope_dim + 1 :: 2] = a * s + b * c
    return y


def compress_block(kv_state, score_state, ape, block_end: int, ratio: int, norm_weight, eps, rope_dim, theta):
    """The entry of the block ending at position ``block_end`` from the state slots (float64)."""
    d = norm_weight.shape[0]
    slots = kv_state.shape[0]
    rows, chans = [], []
    for p in range(block_end - ratio + 1, block_end + 1):
        rows.append(p)
        chans.append(d if coff(ratio) == 2 else 0)
    if coff(ratio) == 2 and block_end + 1 >= 2 * ratio:
        for p in range(block_end - 2 * ratio + 1, block_end - ratio + 1):
            rows.append(p)
            chans.append(0)
    z = np.stack([score_state[p % slots, c : c + d] + ape[p % ratio, c : c + d] for p, c in zip(rows, chans)])
    v = np.stack([kv_state[p % slots, c : c + d] for p, c in zip(rows, chans)])
    z = z.astype(np.float64)
    w = np.exp(z - z.max(0))
    entry = (w / w.sum(0) * v).sum(0)
    entry = entry / np.sqrt((entry**2).mean() + eps) * norm_weight.astype(np.float64)
    return rope(entry, block_end - ratio + 1, rope_dim, theta)


def append_compressed(comp, comp_len, kv_state, score_state, pos, c, z, ape, ratio, norm_weight, *, eps=1e-6,
                      rope_dim=64, theta=10000.0, counts=None) -> int:
    """Feed ``c, z [B, T, coff*D]`` to the compressors; emit entries into ``comp [B, C, D]``.

    Returns the number of sequences whose compressed buffer overflowed (their entries dropped).
    """
    b_, t, _ = c.shape
    cap = comp.shape[1]
    slots = kv_state.shape[1]
    overflowed = 0
    for b in range(b_):
        n = t if counts is None else int(counts[b])
        for i in range(n):
            p = int(pos[b]) + i
            kv_state[b, p % slots] = c[b, i]
            score_state[b, p % slots] = z[b, i]
            if (p + 1) % ratio == 0:
                if comp_len[b] >= cap:
                    overflowed += 1
                    continue
                entry = compress_block(kv_state[b], score_state[b], ape, p, ratio, norm_weight, eps, rope_dim, theta)
                comp[b, comp_len[b]] = entry.astype(comp.dtype)
                comp_len[b] += 1
    return overflowed


def rewind(pos, comp_len, tokens, ratio: int, capacity: int) -> bool:
    """`fp4kit.layers.KVCache.rewind` in place: ``pos -= n`` with ``n = tokens`` clamped to
    ``[0, min(1, pos)]``, then ``comp_len = min(pos // ratio, capacity)`` (when not None). Returns
    whether a token count lay outside ``[0, 1]`` (the kernel records it in the status word)."""
    tokens = np.asarray(tokens)
    n = np.clip(tokens, 0, 1).astype(pos.dtype)
    pos[...] = np.maximum(pos - n, 0)
    if comp_len is not None:
        comp_len[...] = np.minimum(pos // ratio, capacity)
    return bool(((tokens < 0) | (tokens > 1)).any())


def advance(pos, t: int, counts=None) -> None:
    pos += t if counts is None else np.asarray(counts, pos.dtype)
