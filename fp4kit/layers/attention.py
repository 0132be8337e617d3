"""`SparseAttention`: the DeepSeek-V4 sparse decode attention of one layer.

The layer holds the per-head attention-sink logits and, on the device, the buffers its calls
write (the output and the split-candidate scratch, one set per device and batch size), so that
after one eager call the same call can be captured in a CUDA graph. Positions, compressed lengths
and the selected indices are device arrays that the kernel reads: a captured step stays valid as
they change.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..ops import attention as attention_ops
from ..runtime import arrays, workspace


class SparseAttention:
    """Sparse decode attention over a sliding window and selected compressed entries (K = V).

    Parameters
    ----------
    heads : int
        Query heads ``Hq`` (64 for V4-Flash, 128 for V4-Pro).
    head_dim : int
        Latent head dimension ``D``, a multiple of 16 up to 512 (V4: 512).
    scale : float, optional
        Softmax scale, default ``head_dim ** -0.5``.
    sink : fp32 ``[heads]``, optional
        Attention-sink logits (host or device); default zeros on the host. A host sink is copied
        once to each device the layer is called on (at the first call there, which must be eager).
    out_dtype : bfloat16 (default) or float32
        dtype of the output buffers.
    """

    def __init__(self, heads: int, head_dim: int, *, scale: float | None = None, sink=None,
                 out_dtype=arrays.BF16):
        for name, value in (("heads", heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if head_dim % 16 or head_dim > attention_ops.MAX_HEAD_DIM:
            raise ValueError(f"head_dim: expected a multiple of 16 up to {attention_ops.MAX_HEAD_DIM}, got {head_dim}")
        self.heads, self.head_dim = int(heads), int(head_dim)
        self.scale = attention_ops._scale_value(scale, self.head_dim)
        out_dtype = np.dtype(out_dtype)
        if out_dtype not in attention_ops.OUT_DTYPES:
            raise TypeError(f"out_dtype: expected bfloat16 or float32, got {out_dtype}")
        self.out_dtype = out_dtype
        self._buffers = workspace.BufferCache()
        self._sink_copies: dict[int, object] = {}
        self.sink = np.zeros(self.heads, np.float32) if sink is None else sink

    @property
    def sink(self):
        """Attention-sink logits, fp32 ``[heads]`` (host or device)."""
        return self._sink

    @sink.setter
    def sink(self, value) -> None:
        value = arrays.as_array(value, "sink")
        if value.dtype != np.float32 or tuple(value.shape) != (self.heads,):
            raise ValueError(f"sink: expected float32 [heads={self.heads}], got {arrays.describe(value)}")
        arrays.check_contiguous("sink", value)
        self._sink = value
        self._sink_copies = {}

    def _sink_for(self, q):
        """The sink in the memory of ``q``."""
        where = arrays.device_id(q)
        if arrays.device_id(self._sink) == where:
            return self._sink
        if where is None:  # host call with a device sink: the numpy backend has nothing to keep in order
            import cupy

            return cupy.asnumpy(self._sink)
        copy = self._sink_copies.get(where)
        if copy is None:
            import cupy

            with cupy.cuda.Device(where):
                copy = cupy.asarray(self._sink)
            self._sink_copies[where] = copy
        return copy

    def __call__(self, q, swa, pos, comp, comp_len, indices, *, out=None, query_norm=None):
        """Attention output ``[B, heads, head_dim]`` for one decode token per sequence.

        Arguments as in `fp4kit.ops.attention.sparse_decode_attention` (``q`` bf16
        ``[B, heads, head_dim]``, ``swa`` ``[B, W, D]``, ``pos`` int32 ``[B]``, ``comp``
        ``[B, C, D]``, ``comp_len`` int32 ``[B]``, ``indices`` int32 ``[B, N]``, or None for every
        live entry). On the device,
        without ``out`` the result is a buffer owned by the layer and overwritten by the next call
        with the same batch size (what a captured decode step wants); pass ``out`` to keep results.
        ``query_norm`` (`fp4kit.ops.attention.QueryNorm`): ``q`` is the raw projection, normed and
        rotated by the attention launch itself.
        """
        q = arrays.as_array(q, "q")
        if q.ndim != 3 or tuple(q.shape[1:]) != (self.heads, self.head_dim):
            raise ValueError(
                f"q: expected [B, heads={self.heads}, head_dim={self.head_dim}], got {arrays.describe(q)}"
            )
        sink = self._sink_for(q)
        if not arrays.is_device_array(q):
            return attention_ops.sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink, scale=self.scale,
                                                         out=out, out_dtype=self.out_dtype if out is None else None,
                                                         query_norm=query_norm)
        import cupy

        swa = arrays.as_array(swa, "swa")
        if indices is None:  # every live entry: N = C
            comp = arrays.as_array(comp, "comp")
            selected = comp.shape[1] if comp.ndim == 3 else 0
        else:
            indices = arrays.as_array(indices, "indices")
            selected = indices.shape[1] if indices.ndim == 2 else 0
        batch, device = q.shape[0], arrays.device_id(q)
        candidates = (swa.shape[1] if swa.ndim == 3 else 0) + selected
        splits = attention_ops.num_splits_for(q, candidates)
        if out is None:
            out = self._buffers.get(("out", device, batch),
                                    lambda: cupy.empty((batch, self.heads, self.head_dim), self.out_dtype))
        size = attention_ops.workspace_size(batch, self.heads, self.head_dim, splits)
        ws = None
        if size:
            ws = self._buffers.get(("workspace", device, batch, splits), lambda: cupy.empty(size, np.float32))
        return attention_ops.sparse_decode_attention(q, swa, pos, comp, comp_len, indices, sink, scale=self.scale,
                                                     out=out, num_splits=splits, workspace=ws, query_norm=query_norm)

    def prefill(self, q, kv, start, window: int, comp, comp_len, indices, *, out=None):
        """Attention output ``[T, heads, head_dim]`` of T consecutive prompt tokens of one sequence
        at once, with this layer's sink and scale (`fp4kit.ops.attention.sparse_prefill_attention`:
        ``kv [L, D]`` the sequence's K = V rows, ``start`` int32 ``[1]`` the first token's position,
        ``comp [C, D]``, ``comp_len [T]`` and ``indices [T, N]`` per query)."""
        q = arrays.as_array(q, "q")
        return attention_ops.sparse_prefill_attention(q, kv, start, window, comp, comp_len, indices, self._sink_for(q),
                                                      scale=self.scale, out=out,
                                                      out_dtype=self.out_dtype if out is None else None)
