"""What an on-disk NVFP4 layout is: the tensor-name suffixes of a quantized prefix and which scale
its scalars hold. `fp4kit.checkpoint.modelopt` and `fp4kit.checkpoint.compressed_tensors` each
define one."""

from __future__ import annotations

from dataclasses import dataclass


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
