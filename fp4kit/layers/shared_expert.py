"""`SharedExpert`: DeepSeek's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, in NVFP4.

Gate and up run as one GEMM over a fused weight ``W13 [2I, H]`` whose rows interleave the two
projections in chunks of 16: rows ``32j .. 32j+15`` are gate rows ``16j .. 16j+15`` and rows
``32j+16 .. 32j+31`` are the matching up rows. The GEMM output is then in the ``"interleaved"``
layout of `fp4kit.swiglu_quantize`: one launch applies the clamp, SwiGLU, the amax and the NVFP4
quantization of the down-projection input (W4A4), or SwiGLU to bf16 (W4A16).

When gate and up were quantized separately with different global scales (checkpoints), the fused
weight keeps every byte and carries a per-row decode vector instead of one global scale, so the
result is exact (no re-quantization).
"""

from __future__ import annotations

from ..formats import Nvfp4Tensor, fuse_rows, interleave_rows  # noqa: F401 (interleave_rows: re-exported)
from ..ops import quant as quant_ops
from ..runtime import arrays, workspace
from .linear import MODES, Linear


def fuse_gate_up(gate: Nvfp4Tensor, up: Nvfp4Tensor) -> tuple[Nvfp4Tensor, object]:
    """Interleave two NVFP4 weights ``[I, H]`` into ``W13 [2I, H]`` without touching a byte.

    Returns the fused tensor (global scale 1) and a per-row fp32 decode vector ``[2I]`` (``1 / S``
    of the shard each row came from), which the GEMM applies exactly (`fp4kit.formats.fuse_rows`).
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Nvfp4Tensor) or len(t.shape) != 2:
            raise ValueError(f"{name}: expected a 2-D Nvfp4Tensor")
    if gate.shape != up.shape:
        raise ValueError(f"gate/up: expected equal shapes, got {gate.shape} and {up.shape}")
    return fuse_rows([gate, up], "interleaved")


class SharedExpert:
    """``down(swiglu(gate_up(x)))`` with NVFP4 weights.

    Parameters
    ----------
    gate_up : Linear ``[2I, H]`` over the interleaved fused weight
    down : Linear ``[H, I]``
    limit : float, optional
        DeepSeek-V4 ``swiglu_limit``: gate clamped to ``<= limit``, up to ``[-limit, limit]``.
    """

    def __init__(self, gate_up: Linear, down: Linear, *, limit: float | None = None):
        if gate_up.out_features != 2 * down.in_features:
            raise ValueError(
                f"down: expected in_features {gate_up.out_features // 2} (half of gate_up's {gate_up.out_features}), "
                f"got {down.in_features}"
            )
        if down.out_features != gate_up.in_features:
            raise ValueError(f"down: expected out_features {gate_up.in_features} (gate_up's in_features: the "
                             f"output has the input's hidden size), got {down.out_features}")
        if gate_up.mode != down.mode:
            raise ValueError(f"gate_up and down must share a mode, got {gate_up.mode!r} and {down.mode!r}")
        quant_ops.check_limit(limit)
        self.gate_up, self.down, self.limit = gate_up, down, limit
        self._buffers = workspace.BufferCache()

    @property
    def mode(self) -> str:
        return self.down.mode

    @classmethod
    def from_float(cls, w_gate, w_up, w_down, *, limit: float | None = None, mode: str = "w4a4") -> "SharedExpert":
        """Quantize float weights ``w_gate, w_up [I, H]`` and ``w_down [H, I]`` (on the GPU for device
        arrays); gate and up share one global scale."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        w_gate, w_up, w_down = (arrays.as_array(w, n) for w, n in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down")))
        if w_gate.ndim != 2 or w_gate.shape[0] % 16 or w_gate.shape[1] % 16 or w_up.shape != w_gate.shape:
            raise ValueError(f"w_gate, w_up: expected equal shapes [I, H] with I and H multiples of 16, "
                             f"got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
        if tuple(w_down.shape) != tuple(w_gate.shape[::-1]):
            raise ValueError(f"w_down: expected shape [H, I] = {tuple(w_gate.shape[::-1])} for w_gate [I, H] = "
                             f"{tuple(w_gate.shape)}, got {tuple(w_down.shape)}")
        w13 = interleave_rows(w_gate, w_up)
        return cls(Linear.from_float(w13, mode=mode), Linear.from_float(w_down, mode=mode), limit=limit)

    @classmethod
    def from_checkpoint(cls, checkpoint, prefix: str, *, limit: float | None = None, mode: str = "w4a4",
                        names=("gate_proj", "up_proj", "down_proj")) -> "SharedExpert":
        """``{prefix}.gate_proj / up_proj / down_proj`` of a loaded checkpoint; gate and up are fused
        exactly even when their global scales differ."""
        gate_name, up_name, down_name = (f"{prefix}.{n}" for n in names)
        for name in (gate_name, up_name, down_name):
            if name not in checkpoint.weights:
                raise KeyError(f"checkpoint: no quantized weight {name!r}")
        fused, row_decode = fuse_gate_up(checkpoint.weights[gate_name], checkpoint.weights[up_name])
        input_scale = checkpoint.input_scales.get(gate_name)
        gate_up = Linear(fused, mode=mode, input_scale=input_scale, row_decode=row_decode)
        down = Linear.from_checkpoint(checkpoint, down_name, mode=mode)
        return cls(gate_up, down, limit=limit)

    def __call__(self, x, *, out=None, x_act=None):
        """``[..., H]`` to ``[..., H]`` (bf16). On the device the intermediates live in buffers owned
        by the layers (one set per input shape), so the call can be captured in a CUDA graph.

        ``x_act``: ``x`` already quantized as ``gate_up`` would quantize it (W4A4 with a dynamic
        input scale; the MoE passes its own quantized input), so it is not quantized twice."""
        if x_act is not None and (self.mode != "w4a4" or self.gate_up.input_scale is not None):
            raise ValueError("x_act: only a W4A4 shared expert with a dynamic input scale takes a quantized input")
        h = self.gate_up(x) if x_act is None else self.gate_up.gemm(x_act)
        act = self._activation_buffer(h) if arrays.is_device_array(h) else None
        if self.mode == "w4a4":
            a = quant_ops.swiglu_quantize(h, layout="interleaved", limit=self.limit,
                                          global_scale=self.down.input_scale, out=act)
        else:
            a = quant_ops.swiglu(h, layout="interleaved", limit=self.limit, out=act)
        return self.down.gemm(a, out=out)

    def _activation_buffer(self, h):
        lead, inner = tuple(h.shape[:-1]), h.shape[-1] // 2
        if self.mode == "w4a4":
            return self.down._activation_buffer(lead)
        import cupy

        return self._buffers.get(lead, lambda: cupy.empty((*lead, inner), arrays.BF16))
