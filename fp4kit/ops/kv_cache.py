"""KV-cache launchers for ``raw_kernels/kv_cache.cu``; `fp4kit.layers.KVCache` validates shapes
once and owns the buffers."""

from __future__ import annotations

import numpy as np

from ..runtime import arrays, loader, status

_MODULE = "kv_cache"
_U32 = np.uint32


def append_swa(swa, pos, kv, counts) -> None:
    b, t, d = kv.shape
    loader.get_kernel(_MODULE, "kv_append_swa", block=64).launch(
        (t, b), 64, (kv, 0 if counts is None else counts, swa, pos, _U32(t), _U32(swa.shape[1]), _U32(d),
                        status.device_word()))


def compress(c, z, counts, ape, norm_weight, kv_state, score_state, comp, comp_len, pos, *, ratio, eps, rope_dim,
             rope_table, advance: bool = False, report_counts: bool = False) -> None:
    """The compressor over the new tokens; with ``advance`` it also moves the positions on (what
    `advance` does), so a compressing cache appends in two launches (one without a window append);
    with ``report_counts`` it records a count out of range (which `append_swa` does otherwise).
    ``rope_table``: the entries' RoPE frequencies (`fp4kit.ops.elementwise.rope_table`)."""
    b, t, _ = c.shape
    d = comp.shape[2]
    suffix = "bf16" if c.dtype == arrays.BF16 else "f32"
    loader.get_kernel(_MODULE, f"kv_compress_{suffix}")(
        b, 256, (c, z, 0 if counts is None else counts, ape, norm_weight, kv_state, score_state, comp, comp_len, pos,
                 _U32(t), _U32(d), _U32(ratio), _U32(comp.shape[1]), np.float32(eps), _U32(rope_dim),
                 rope_table, status.device_word(), np.int32(int(advance) | 2 * int(report_counts))))


def compress_pair(first, second, counts) -> None:
    """`compress` of two caches in one launch (``kv_compress2_bf16``), each part ``(c, z, args)``
    with bf16 ``c``, ``z [B, T, coff*D]`` of the same B and T and ``args`` the keyword arguments
    of `compress` after ``counts`` (both with ``advance``; the same ``eps``)."""
    b, t, _ = first[0].shape
    params = []
    for c, z, a in (first, second):
        flags = int(a["advance"]) | 2 * int(a["report_counts"])
        params += [c, z, a["ape"], a["norm_weight"], a["kv_state"], a["score_state"], a["comp"], a["comp_len"], a["pos"],
                   _U32(a["comp"].shape[2]), _U32(a["ratio"]), _U32(a["comp"].shape[1]), _U32(a["rope_dim"]),
                   a["rope_table"], np.int32(flags)]
    loader.get_kernel(_MODULE, "kv_compress2_bf16")(
        2 * b, 256, (*params, 0 if counts is None else counts, _U32(b), _U32(t), np.float32(first[2]["eps"]),
                     status.device_word()))


def advance(pos, counts, t: int) -> None:
    loader.get_kernel(_MODULE, "kv_advance", block=256)(1, 256, (pos, 0 if counts is None else counts,
                                                                   _U32(pos.shape[0]), _U32(t), status.device_word()))


def rewind(pos, comp_len, tokens, ratio: int, capacity: int) -> None:
    """``kv_rewind``: each sequence's position back by ``tokens[b]`` (0 or 1), its compressed
    length (``comp_len``, or None without a compressor) to the entries complete there."""
    loader.get_kernel(_MODULE, "kv_rewind", block=256)(1, 256, (pos, 0 if comp_len is None else comp_len, tokens,
                                                                  _U32(pos.shape[0]), _U32(max(ratio, 1)),
                                                                  _U32(capacity), status.device_word()))
