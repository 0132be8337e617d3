"""The compressed-tensors NVFP4 layout (read only).

``P.weight_packed`` (U8 ``[N, K/2]``), ``P.weight_scale`` (F8_E4M3 ``[N, K/16]``, linear),
``P.weight_global_scale`` and the optional ``P.input_global_scale``: fp32 scalars holding the
*encode* scale ``S`` (a divisor: ``x ≈ e2m1 * block_scale / S``), used as they are. An optional
``P.weight_shape`` (I64 or I32 ``[2]``) records the logical ``[N, K]`` and is checked against the
packed tensor.
"""

from __future__ import annotations

from .layout import Layout

COMPRESSED_TENSORS = Layout(
    name="compressed-tensors",
    title="compressed-tensors NVFP4",
    packed="weight_packed",
    block_scales="weight_scale",
    global_scale="weight_global_scale",
    input_scale="input_global_scale",
    stores_decode=False,
    # weight_scale is shared with ModelOpt, so it marks nothing here
    markers=("weight_packed", "weight_global_scale", "input_global_scale"),
)

#: the optional record of the logical shape ``[N, K]``
WEIGHT_SHAPE = "weight_shape"
