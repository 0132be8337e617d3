"""`Indexer`: the DeepSeek-V4 lightning indexer's top-k selection over a compressed-key cache.

The layer fixes ``k``, the cache capacity and the head shape, and owns the buffers its device path
writes (selected indices, their scores, and the per-key score scratch), one set per batch size.
After one eager call with a batch size, the same call can be captured in a CUDA graph: it
allocates nothing and reads the live lengths on the device, so a replayed graph follows the
cache as it grows.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from ..ops import indexer as indexer_ops
from ..runtime import arrays, workspace


class IndexerBuffers(NamedTuple):
    """Device buffers of one batch size: ``indices`` int32 ``[B, k]``, ``scores`` fp32 ``[B, k]``
    (the selected scores), ``workspace`` fp32 ``[B, capacity]`` (every live score) and
    ``key_range`` uint32 ``[B, 2]`` (zero between calls; see `fp4kit.ops.indexer.score_topk`)."""

    indices: object
    scores: object
    workspace: object
    key_range: object


def _positive_int(name: str, value, upper: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}")
    if not 1 <= int(value) <= upper:
        raise ValueError(f"{name}: expected 1 <= {name} <= {upper}, got {int(value)}")
    return int(value)


class Indexer:
    """Top-``k`` compressed-key selection for one decode token per sequence.

    Parameters
    ----------
    k : int in [1, 4096]
        Entries selected per sequence (V4: ``index_topk``).
    capacity : int
        C, the number of rows of the preallocated compressed-key cache ``keys [B, C, head_dim]``.
    heads : int
        H, index heads (V4: 64); a multiple of 8 up to 64.
    head_dim : int
        D (V4: 128); a multiple of 32 up to 128.
    """

    def __init__(self, k: int, *, capacity: int, heads: int, head_dim: int):
        self.k = indexer_ops.check_k(k)
        self.capacity = _positive_int("capacity", capacity, indexer_ops.MAX_CAPACITY)
        self.heads = _positive_int("heads", heads, indexer_ops.MAX_HEADS)
        self.head_dim = _positive_int("head_dim", head_dim, indexer_ops.MAX_HEAD_DIM)
        if self.heads % 8:
            raise ValueError(f"heads: expected a multiple of 8 up to {indexer_ops.MAX_HEADS}, got {self.heads}")
        if self.head_dim % 32:
            raise ValueError(f"head_dim: expected a multiple of 32 up to {indexer_ops.MAX_HEAD_DIM}, got {self.head_dim}")
        self._buffers = workspace.BufferCache()

    def buffers(self, batch: int) -> IndexerBuffers:
        """The device buffers for ``batch`` sequences on the current device (created on first use)."""
        import cupy

        return self._buffers.get(
            (cupy.cuda.Device().id, int(batch)),
            lambda: IndexerBuffers(cupy.empty((batch, self.k), np.int32), cupy.empty((batch, self.k), np.float32),
                                   cupy.empty((batch, self.capacity), np.float32), cupy.zeros((batch, 2), np.uint32)))

    def _check_config(self, q, keys):
        q = arrays.as_array(q, "q")
        keys = arrays.as_array(keys, "keys")
        if q.ndim != 3 or tuple(q.shape[1:]) != (self.heads, self.head_dim):
            raise ValueError(f"q: expected shape (B, {self.heads}, {self.head_dim}) for this Indexer, "
                             f"got {arrays.describe(q)}")
        if keys.ndim != 3 or tuple(keys.shape[1:]) != (self.capacity, self.head_dim):
            raise ValueError(f"keys: expected shape (B, {self.capacity}, {self.head_dim}) for this Indexer, "
                             f"got {arrays.describe(keys)}")
        return q, keys

    def score_topk(self, q, w, keys, lengths, *, w_scale: float = 1.0, return_scores: bool = False,
                   query_rope=None):
        """Selected indices int32 ``[B, k]`` (ascending, ``-1`` padded) for q ``[B, H, D]`` bf16,
        w ``[B, H]`` fp32 or bf16 (times ``w_scale``), keys ``[B, C, D]`` (or ``[1, C, D]``, one
        cache for every row) bf16 and lengths ``[B]`` int32 (see `fp4kit.ops.indexer.score_topk`).

        On the device the result is the layer's buffer for this batch size, overwritten by the
        next call with the same batch size; with ``return_scores`` the selected scores buffer is
        returned too, as ``(indices, scores)``. ``query_rope`` (`fp4kit.ops.indexer.QueryRope`): ``q``
        is the raw projection, rotated by the scoring launch itself.
        """
        q, keys = self._check_config(q, keys)
        if arrays.is_device_array(q):
            import cupy

            with cupy.cuda.Device(q.device.id):
                buf = self.buffers(q.shape[0])
            indices, scores = indexer_ops.score_topk(q, w, keys, lengths, self.k, w_scale=w_scale,
                                                     out_indices=buf.indices, out_scores=buf.scores,
                                                     workspace=buf.workspace,
                                                     key_range=buf.key_range
                                                     if self.capacity <= indexer_ops.KEY_RANGE_MAX_CAPACITY else None,
                                                     query_rope=query_rope)
        else:
            indices, scores = indexer_ops.score_topk(q, w, keys, lengths, self.k, w_scale=w_scale,
                                                     query_rope=query_rope)
        return (indices, scores) if return_scores else indices
