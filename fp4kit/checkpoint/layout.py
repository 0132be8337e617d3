"""What an on-disk NVFP4 layout is (the tensor-name suffixes of a quantized prefix and which scale
its scalars hold; `fp4kit.checkpoint.modelopt` and `fp4kit.checkpoint.compressed_tensors` each
define one), and what a loaded checkpoint holds (`Checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import Nvfp4Tensor


@dataclass(frozen=True)
class Layout:
    """The tensors of a quantized linear layer ``P`` in one layout.

    Attributes
    ----------
    name : str
        ``"modelopt"`` or ``"compressed-tensors"`` (`Checkpoint.layout`).
    title : str
        For messages.
    packed, block_scales, global_scale, input_scale : str
        Suffixes of ``P.<suffix>``: E2M1 codes ``U8 [..., K/2]``, block scales
        ``F8_E4M3 [..., K/16]``, the weight's global scale and the optional static activation
        scale (fp32 or bf16 scalars).
    stores_decode : bool
        True: the scalars hold the decode scale ``1/S``; False: the encode scale ``S``.
    markers : tuple of str
        Suffixes whose presence marks ``P`` as quantized in this layout.
    """

    name: str
    title: str
    packed: str
    block_scales: str
    global_scale: str
    input_scale: str
    stores_decode: bool
    markers: tuple[str, ...]

    def parts(self) -> dict[str, str]:
        """Role -> suffix, in the order they are checked."""
        return {"packed": self.packed, "block_scales": self.block_scales, "global": self.global_scale,
                "input": self.input_scale}


@dataclass
class Checkpoint:
    """An NVFP4 checkpoint in memory.

    Attributes
    ----------
    layout : "modelopt" or "compressed-tensors"
    weights : dict[str, Nvfp4Tensor]
        Keyed by prefix (``model.layers.0.mlp.down_proj``); packed ``uint8 [..., K/2]``, linear
        block scales ``uint8 [..., K/16]``, ``global_scale`` the 0-d fp32 encode scale ``S``.
    input_scales : dict[str, array]
        Static activation encode scales ``S_a`` (0-d fp32), for the prefixes that have one.
    extra : dict[str, array]
        Every other tensor, in its stored dtype (bf16 as ``ml_dtypes.bfloat16`` on the host;
        on a device, float8 tensors travel as ``uint8``).
    quant_config : dict or None
        ``hf_quant_config.json``, when present.
    files : list[Path]
    decode_scales : dict[str, 0-d fp32 numpy array]
        ModelOpt layout: every stored decode scale (``P.weight_scale_2``, ``P.input_scale``) as it
        was on disk, by tensor name. `save_nvfp4` writes these back unchanged where the weight's
        ``S`` is still the one they gave (``fp32(1/fp32(1/D))`` is not always ``D``).
    """

    layout: str
    weights: dict[str, Nvfp4Tensor] = field(default_factory=dict)
    input_scales: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    quant_config: dict | None = None
    files: list[Path] = field(default_factory=list)
    decode_scales: dict[str, Any] = field(default_factory=dict)
