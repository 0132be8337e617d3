"""NVFP4 checkpoints: safetensors load/save in the ModelOpt and compressed-tensors layouts.

Two on-disk layouts describe a quantized linear layer of logical weight ``[N, K]`` stored under
the prefix ``P`` (e.g. ``model.layers.0.mlp.down_proj``):

========================  ===========================  ==============================================
ModelOpt (load and save)  compressed-tensors (load)    content
========================  ===========================  ==============================================
``P.weight``              ``P.weight_packed``          ``U8 [N, K/2]``: E2M1 codes, element ``2i`` in
                                                       the low nibble
``P.weight_scale``        ``P.weight_scale``           ``F8_E4M3 [N, K/16]``: block scales, linear
                                                       (never swizzled on disk)
``P.weight_scale_2``      ``P.weight_global_scale``    ``F32 []`` (or ``[1]``): ModelOpt stores the
                                                       *decode* scale ``1/S``; compressed-tensors the
                                                       *encode* scale ``S`` (a divisor)
``P.input_scale``         ``P.input_global_scale``     optional static activation scale, decode
                                                       (ModelOpt) or encode (compressed-tensors)
========================  ===========================  ==============================================

Leading dimensions (``[E, N, K/2]`` expert stacks) are accepted; every other tensor of the
checkpoint (embeddings, norms, biases, routers, ...) is returned as-is in ``Checkpoint.extra``.

One module per concern:

========================  ======================================================================
`safetensors_io`          the container: validating reader, atomic writer, the files of a folder
`modelopt`                the ModelOpt layout: decode scales, exact encode scales, `save_nvfp4`,
                          ``hf_quant_config.json`` and ``config.json``'s ``quantization_config``
`compressed_tensors`      the compressed-tensors layout (read)
`layout`                  what a layout is (`Layout`) and what a loaded checkpoint holds (`Checkpoint`)
`reader`                  `CheckpointFiles` (headers validated, data on demand), `load_nvfp4`
`validation`              checks of block-scale bytes and scalar scales
`fusion`                  `fuse_rows`: concatenating quantized shards without re-quantizing
`deepseek`                official DeepSeek-V4 (FP8 / MXFP4, UE8M0 scales) and V3 (FP8) weights
                          to NVFP4, exactly where MXFP4 allows (``fp4kit convert``)
========================  ======================================================================

Every name below is importable from ``fp4kit.checkpoint``.
"""

from .compressed_tensors import COMPRESSED_TENSORS
from .fusion import fuse_rows
from .layout import Layout
from .modelopt import (
    METADATA_KEY,
    MODELOPT,
    QUANT_CONFIG_NAME,
    decode_scale,
    encode_scale_from_decode,
    hf_quantization_config,
    quant_config,
    save_nvfp4,
    to_modelopt_tensors,
    write_quant_config,
)
from .reader import LAYOUTS, Checkpoint, CheckpointFiles, QuantizedPrefix, load_nvfp4
from .safetensors_io import (
    DTYPES,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    SafetensorsFile,
    TensorInfo,
    checkpoint_files,
    read_safetensors,
    write_safetensors,
)
from .validation import check_block_scale_bytes, check_positive_finite

__all__ = [
    "COMPRESSED_TENSORS",
    "DTYPES",
    "INDEX_NAME",
    "LAYOUTS",
    "METADATA_KEY",
    "MODELOPT",
    "QUANT_CONFIG_NAME",
    "SINGLE_FILE_NAME",
    "Checkpoint",
    "CheckpointFiles",
    "Layout",
    "QuantizedPrefix",
    "SafetensorsFile",
    "TensorInfo",
    "check_block_scale_bytes",
    "check_positive_finite",
    "checkpoint_files",
    "decode_scale",
    "encode_scale_from_decode",
    "fuse_rows",
    "hf_quantization_config",
    "load_nvfp4",
    "quant_config",
    "read_safetensors",
    "save_nvfp4",
    "to_modelopt_tensors",
    "write_quant_config",
    "write_safetensors",
]
