"""`Linear`: an NVFP4 linear layer, ``y = x @ W^T (+ b)``.

The layer owns its NVFP4 weight, its global scales (on the device), an optional bias, and the
buffers its decode path writes (the quantized activation and the output, one set per input
shape), so that after one eager call the same call can be captured in a CUDA graph.

Modes:

* ``"w4a4"``: the activation is quantized to NVFP4 first, with its amax computed on the device
  (one fused launch) or with a static calibrated ``input_scale``; then the NVFP4 x NVFP4 GEMM.
* ``"w4a16"``: the bf16 activation goes straight into the GEMM.
"""

from __future__ import annotations

import numpy as np

from ..formats import Nvfp4Tensor, fuse_rows, to_linear, to_tiled
from ..ops import elementwise as ew_ops
from ..ops import gemm as gemm_ops
from ..ops import quant as quant_ops
from ..runtime import arrays, workspace

MODES = ("w4a4", "w4a16")


class Linear:
    """NVFP4 linear layer.

    Parameters
    ----------
    weight : Nvfp4Tensor ``[N, K]``
        Any layout. A device weight is converted once to the tiled GEMM layout, which replaces it
        (`Linear.weight` is then tiled; `fp4kit.formats.to_linear` gives the checkpoint layout back).
    bias : fp32 or bf16 ``[N]``, optional
    mode : "w4a4" or "w4a16"
    input_scale : 0-d fp32 array, optional
        Static encode scale ``S_a`` of the activation (W4A4), in the weight's memory. ``None``
        computes it from each input's amax on the device.
    row_decode : fp32 ``[N]``, optional
        Per-row decode factors of a fused weight whose shards had different global scales.
    """

    def __init__(self, weight: Nvfp4Tensor, *, bias=None, mode: str = "w4a4", input_scale=None, row_decode=None):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if not isinstance(weight, Nvfp4Tensor) or len(weight.shape) != 2:
            got = type(weight).__name__ + (f" of shape {tuple(weight.shape)}" if hasattr(weight, "shape") else "")
            raise TypeError(f"weight: expected a 2-D Nvfp4Tensor [N, K], got {got} "
                            "(Linear.from_float quantizes a float weight)")
        if input_scale is not None:
            input_scale = arrays.as_scalar_fp32("input_scale", input_scale, weight.packed)
        if arrays.is_device_array(weight.packed):
            weight = to_tiled(weight)
        self.weight, self.bias, self.mode = weight, bias, mode
        self.input_scale, self.row_decode = input_scale, row_decode
        self._buffers = workspace.BufferCache()
        #: output widths of the layers this one concatenates (`concatenate`); one part otherwise
        self.split_sizes = [weight.shape[0]]
        #: rows up to which the graph-capturable decode GEMM is used (above: cuBLAS prefill); raise
        #: it to capture large-M calls in a CUDA graph
        self.decode_max_m = None  # the GEMM's default for the device (see fp4kit.ops.gemm)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @classmethod
    def from_float(cls, weight, *, bias=None, mode: str = "w4a4", input_scale=None) -> "Linear":
        """Quantize a bf16/fp16/fp32 ``[N, K]`` weight (on the GPU for device arrays)."""
        weight = arrays.as_array(weight, "weight")
        if weight.ndim != 2 or weight.shape[1] % 16:
            raise ValueError(f"weight: expected [N, K] with K a multiple of 16, got shape {tuple(weight.shape)}")
        return cls(quant_ops.quantize(weight), bias=bias, mode=mode, input_scale=input_scale)

    @classmethod
    def from_checkpoint(cls, checkpoint, prefix: str, *, mode: str = "w4a4", static_input_scale: bool = True,
                        bias: str | None = None) -> "Linear":
        """The layer ``prefix`` of a loaded `fp4kit.checkpoint.Checkpoint`.

        ``static_input_scale`` uses the checkpoint's calibrated ``input_scale`` when it has one
        (W4A4); otherwise the activation scale is computed per call. ``bias`` names an
        unquantized tensor of the checkpoint to use as bias.
        """
        if prefix not in checkpoint.weights:
            raise KeyError(f"prefix: no quantized weight {prefix!r} in the checkpoint; have {sorted(checkpoint.weights)[:8]}")
        input_scale = checkpoint.input_scales.get(prefix) if static_input_scale else None
        return cls(checkpoint.weights[prefix], bias=None if bias is None else checkpoint.extra[bias],
                   mode=mode, input_scale=input_scale)

    @classmethod
    def concatenate(cls, parts: list["Linear"]) -> "Linear":
        """One layer computing several layers of the same input: their weights' rows one after
        another (`fp4kit.formats.fuse_rows`, every byte kept, a decode factor per row), so one
        activation quantization and one GEMM replace one of each per part. Output columns
        ``[sum(N_i)]`` in the order of ``parts`` (`split_sizes` gives the N_i).

        The parts must share in_features, mode and a dynamic input scale (``input_scale=None``:
        each would compute the same scale from the same input), and all have a bias or none.
        """
        if not parts or not all(isinstance(p, Linear) for p in parts):
            raise TypeError(f"parts: expected a non-empty list of Linear, got {[type(p).__name__ for p in parts]}")
        first = parts[0]
        for i, p in enumerate(parts):
            if p.in_features != first.in_features or p.mode != first.mode:
                raise ValueError(f"parts[{i}]: expected in_features={first.in_features} and mode={first.mode!r} "
                                 f"like parts[0], got {p.in_features} and {p.mode!r}")
            if p.input_scale is not None:
                raise ValueError(f"parts[{i}]: a static input_scale cannot be shared; concatenate layers "
                                 "that compute the activation scale per call (input_scale=None)")
            if (p.bias is None) != (first.bias is None):
                raise ValueError(f"parts[{i}]: expected all parts with a bias or none")
        weight, row_decode = fuse_rows([to_linear(p.weight) for p in parts], "concatenated",
                                       row_decodes=[p.row_decode for p in parts])
        bias = None
        if first.bias is not None:
            xp = arrays.array_module(first.bias)
            bias = xp.concatenate([p.bias.astype(np.float32, copy=False) for p in parts])
        fused = cls(weight, bias=bias, mode=first.mode, row_decode=row_decode)
        fused.decode_max_m = first.decode_max_m
        fused.split_sizes = [p.out_features for p in parts]
        return fused

    def split(self, y) -> list:
        """The outputs of the concatenated parts (`concatenate`) in ``y [..., N]`` (`split_columns`),
        on the device into this layer's buffer for the shape (one launch; overwritten by the next
        call with that shape)."""
        out = None
        if arrays.is_device_array(y) and len(self.split_sizes) > 1 and y.size > y.shape[-1]:
            import cupy

            out = self._buffers.get(("split", tuple(y.shape)), lambda: cupy.empty(y.size, arrays.BF16))
        return split_columns(y, self.split_sizes, out=out)

    def call_split(self, x) -> list:
        """``split(self(x))`` without the split: on the device, for more than one row, the GEMM
        writes the parts column-blocked (`fp4kit.ops.gemm.gemm` ``column_blocks``) into this
        layer's buffer for the shape, so each part comes out C-contiguous with no split launch
        (overwritten by the next call with that shape)."""
        x = arrays.as_array(x, "x")
        if len(self.split_sizes) == 1 or not arrays.is_device_array(x) or x.size == x.shape[-1]:
            return self.split(self(x))  # one row: the parts are views of the output
        import cupy

        lead = tuple(x.shape[:-1])
        out = self._buffers.get(("parts", lead), lambda: cupy.empty(x.size // x.shape[-1] * self.out_features,
                                                                     arrays.BF16))
        return gemm_ops.gemm(self._input(x), self.weight, bias=self.bias, row_decode=self.row_decode, out=out,
                             decode_max_m=self.decode_max_m, column_blocks=self.split_sizes)

    def _output_buffer(self, lead: tuple):
        import cupy

        return self._buffers.get(("out", lead), lambda: cupy.empty((*lead, self.out_features), arrays.BF16))

    def _activation_buffer(self, lead: tuple) -> Nvfp4Tensor:
        import cupy

        k = self.in_features
        return self._buffers.get(("act", lead), lambda: Nvfp4Tensor(
            cupy.empty((*lead, k // 2), np.uint8), cupy.empty((*lead, k // 16), np.uint8),
            cupy.empty((), np.float32), "linear", (*lead, k)))

    def gemm(self, a, *, out=None):
        """The GEMM alone on an activation already in the layer's input format: an Nvfp4Tensor
        (W4A4, e.g. from a fused quantizing kernel) or bf16 (W4A16)."""
        data = a.packed if isinstance(a, Nvfp4Tensor) else a
        if out is None and arrays.is_device_array(data):
            out = self._output_buffer(tuple(a.shape[:-1]))
        return gemm_ops.gemm(a, self.weight, bias=self.bias, row_decode=self.row_decode, out=out,
                             decode_max_m=self.decode_max_m)

    def __call__(self, x, *, out=None):
        """``y[..., N]`` for ``x[..., K]``.

        W4A4 quantizes ``x`` (bf16, fp16 or fp32) first; W4A16 takes bf16. On the device, without
        ``out`` the result is a buffer owned by the layer and overwritten by the next call with the
        same input shape (what a captured decode step wants); pass ``out`` to keep results.
        """
        return self.gemm(self._input(x), out=out)

    def _input(self, x):
        """The GEMM's activation for ``x``: ``x`` itself (W4A16), or ``x`` quantized (W4A4)."""
        x = arrays.as_array(x, "x")
        if self.mode == "w4a16":
            return x
        act = self._activation_buffer(tuple(x.shape[:-1])) if arrays.is_device_array(x) else None
        return quant_ops.quantize(x, global_scale=self.input_scale, out=act)


def split_columns(y, sizes, *, out=None) -> list:
    """``y [..., sum(sizes)]`` (bf16) as consecutive column blocks of these widths, each
    C-contiguous: views where they already are (one row), else filled by one launch into ``out``
    (`fp4kit.ops.elementwise.split_columns`; numpy: copies)."""
    if sum(sizes) != y.shape[-1]:
        raise ValueError(f"sizes: expected widths adding up to y's last dimension {y.shape[-1]}, got {list(sizes)}")
    lead = tuple(y.shape[:-1])
    parts = ew_ops.split_columns(y.reshape(-1, y.shape[-1]), sizes, out=out)
    return [p.reshape(*lead, p.shape[-1]) for p in parts]
