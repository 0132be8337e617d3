"""The ModelOpt NVFP4 layout (load and save), as Hugging Face checkpoints exported by ModelOpt use it.

A quantized linear layer of logical weight ``[N, K]`` under the prefix ``P``:

=====================  ===========================================================================
``P.weight``           ``U8 [N, K/2]``: E2M1 codes, element ``2i`` in the low nibble
``P.weight_scale``     ``F8_E4M3 [N, K/16]``: block scales, linear (never swizzled on disk)
``P.weight_scale_2``   ``F32 []``: the *decode* scale ``1/S`` (older exports: BF16, or shape ``[1]``)
``P.input_scale``      optional static activation decode scale ``1/S_a``
=====================  ===========================================================================

``hf_quant_config.json`` beside the files says what was written::

    {"producer": {"name": "fp4kit", "version": ...},
     "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                      "kv_cache_quant_algo": null, "exclude_modules": [...]}}

Exact global scales. fp4kit works with the encode scale ``S`` (``Nvfp4Tensor.global_scale``);
ModelOpt stores ``fp32(1/S)``, and ``fp32(1/fp32(1/S))`` differs from ``S`` in the last bit for
about a quarter of all values. `save_nvfp4` therefore also records every encode scale it turns
into a decode scale in the safetensors ``__metadata__`` under `METADATA_KEY`, as JSON
``{decode-scale tensor name: "0x" + the 8 hex digits of S's fp32 bits}``. On load the recorded
``S`` is used when it is consistent with the stored tensor (``fp32(1/S)`` equals it bit for bit);
otherwise (a file from another producer, or an edited one: a warning says so)
``S = min(fp32(1 / decode), FLT_MAX)`` with one IEEE fp32 division.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..formats import BLOCK_SIZE, Nvfp4Tensor
from .layout import Layout
from .safetensors_io import DTYPES, SINGLE_FILE_NAME, SafetensorsFile, read_json, write_safetensors
from .validation import check_block_scale_bytes, check_positive_finite

MODELOPT = Layout(
    name="modelopt",
    title="ModelOpt NVFP4",
    packed="weight",
    block_scales="weight_scale",
    global_scale="weight_scale_2",
    input_scale="input_scale",
    stores_decode=True,
    markers=("weight_scale_2", "input_scale", "weight_scale"),
)

#: ``__metadata__`` key holding the exact encode scales written by `save_nvfp4`
METADATA_KEY = "fp4kit.global_scales"
QUANT_CONFIG_NAME = "hf_quant_config.json"

_F32 = np.float32
_FLT_MAX = np.finfo(np.float32).max


# --------------------------------------------------------------------------------------------
# Decode scales and the exact encode scales behind them
# --------------------------------------------------------------------------------------------


def decode_scale(encode_scale) -> np.ndarray:
    """``fp32(1 / S)``: ModelOpt's ``weight_scale_2`` / ``input_scale`` (0-d fp32, IEEE division)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.asarray(_F32(1) / np.asarray(encode_scale, _F32).reshape(()), _F32)


def encode_scale_from_decode(decode) -> np.ndarray:
    """``min(fp32(1 / decode), FLT_MAX)`` (0-d fp32): ``S`` from a stored ModelOpt decode scale.

    The clamp only matters for a subnormal decode scale (an all-zero tensor), whose reciprocal
    overflows; it mirrors the ``min(2688 / amax, FLT_MAX)`` of the quantization recipe.
    """
    with np.errstate(divide="ignore", over="ignore"):
        s = _F32(1) / np.asarray(decode, _F32).reshape(())
    return np.asarray(np.minimum(s, _FLT_MAX), _F32)


def _scale_from_hex(text) -> np.ndarray | None:
    try:
        bits = int(text, 16)
    except (TypeError, ValueError):
        return None
    if not 0 <= bits < 2**32:
        return None
    return np.array(bits, np.uint32).view(_F32)


def _scale_to_hex(s: np.ndarray) -> str:
    return f"0x{int(np.asarray(s, _F32).reshape(()).view(np.uint32)):08x}"


def read_quant_config(folder: Path) -> dict | None:
    """``hf_quant_config.json`` in ``folder``, or None; it must say NVFP4 with group size 16."""
    config_path = folder / QUANT_CONFIG_NAME
    if not config_path.is_file():
        return None
    config = read_json(config_path)
    quant = config.get("quantization")
    quant = quant if isinstance(quant, dict) else {}
    algo, group = quant.get("quant_algo"), quant.get("group_size", BLOCK_SIZE)
    if algo != "NVFP4" or group != BLOCK_SIZE:
        raise ValueError(
            f"{config_path}: expected quant_algo 'NVFP4' with group_size {BLOCK_SIZE}, "
            f"got quant_algo {algo!r} with group_size {group!r}"
        )
    return config


def recorded_encode_scales(files: list[SafetensorsFile]) -> dict[str, str]:
    """The exact encode scales `save_nvfp4` recorded in the files' ``__metadata__`` (name -> hex)."""
    recorded: dict[str, str] = {}
    for f in files:
        text = f.metadata.get(METADATA_KEY)
        if text is None:
            continue
        try:
            table = json.loads(text)
            if not isinstance(table, dict):
                raise ValueError("not an object")
        except ValueError as e:
            warnings.warn(f"{f.path}: ignoring unreadable __metadata__[{METADATA_KEY!r}] ({e})", stacklevel=4)
            continue
        recorded.update(table)
    return recorded


def encode_scale(stored: np.ndarray, recorded: str | None, where: str) -> np.ndarray:
    """The encode scale ``S`` behind a stored (validated) decode scale: the recorded exact one when
    its reciprocal is the stored value bit for bit, else ``min(fp32(1 / stored), FLT_MAX)``."""
    if recorded is not None:
        encode = _scale_from_hex(recorded)
        if encode is not None and decode_scale(encode).view(np.uint32) == stored.view(np.uint32):
            return encode
        warnings.warn(
            f"{where}: __metadata__[{METADATA_KEY!r}] records encode scale {recorded!r}, whose "
            f"reciprocal is not the stored decode scale {float(stored)!r}; using 1 / the stored value",
            stacklevel=4,
        )
    return encode_scale_from_decode(stored)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _host_scalar(name: str, value) -> np.ndarray:
    if not hasattr(value, "dtype"):
        raise TypeError(f"{name}: expected a 0-d float32 array, got {type(value).__name__}")
    v = _host(value)
    if v.dtype != np.float32 or v.size != 1:
        raise ValueError(f"{name}: expected a 0-d float32 array, got shape {v.shape}, dtype {v.dtype}")
    return v.reshape(())


def to_modelopt_tensors(
    weights: dict[str, Nvfp4Tensor],
    *,
    input_scales: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and ``__metadata__`` of a ModelOpt NVFP4 safetensors file (host arrays).

    Parameters
    ----------
    weights : dict[str, Nvfp4Tensor]
        Keyed by prefix; any scale layout, host or device (swizzled scales are unswizzled).
        Written as ``P.weight`` (U8), ``P.weight_scale`` (F8_E4M3, linear) and
        ``P.weight_scale_2`` (F32 ``[]``, ``fp32(1/S)``).
    input_scales : dict[str, 0-d fp32 array], optional
        Static activation *encode* scales ``S_a`` by prefix (each prefix must be in
        ``weights``); written as ``P.input_scale = fp32(1/S_a)``.
    extra : dict[str, array], optional
        Unquantized tensors written as they are (any dtype of `DTYPES`).

    Returns
    -------
    tensors : dict[str, numpy array]
    metadata : dict[str, str]
        ``{"format": "pt", METADATA_KEY: JSON of the exact encode scales}`` (the ``format`` entry
        is what Hugging Face loaders expect of a file with metadata).
    """
    input_scales = dict(input_scales or {})
    extra = dict(extra or {})
    tensors: dict[str, np.ndarray] = {}
    recorded: dict[str, str] = {}
    for prefix, w in weights.items():
        if not isinstance(w, Nvfp4Tensor):
            raise TypeError(f"weights[{prefix!r}]: expected an Nvfp4Tensor, got {type(w).__name__}")
        scales = _host(w.linear_block_scales)
        check_block_scale_bytes(scales, f"weights[{prefix!r}].block_scales")
        s = _host_scalar(f"weights[{prefix!r}].global_scale", w.global_scale)
        check_positive_finite(s, f"weights[{prefix!r}].global_scale", "encode scale")
        tensors[f"{prefix}.weight"] = _host(w.packed)
        tensors[f"{prefix}.weight_scale"] = scales.copy(order="C").view(DTYPES["F8_E4M3"])
        tensors[f"{prefix}.weight_scale_2"] = decode_scale(s)
        recorded[f"{prefix}.weight_scale_2"] = _scale_to_hex(s)
    for prefix, s_a in input_scales.items():
        if prefix not in weights:
            raise ValueError(f"input_scales[{prefix!r}]: no quantized weight with this prefix")
        s_a = _host_scalar(f"input_scales[{prefix!r}]", s_a)
        check_positive_finite(s_a, f"input_scales[{prefix!r}]", "encode scale")
        tensors[f"{prefix}.input_scale"] = decode_scale(s_a)
        recorded[f"{prefix}.input_scale"] = _scale_to_hex(s_a)
    for name, a in extra.items():
        if name in tensors:
            raise ValueError(f"extra[{name!r}]: the name is already used by a quantized weight's tensors")
        if not hasattr(a, "dtype"):
            raise TypeError(f"extra[{name!r}]: expected an array, got {type(a).__name__}")
        tensors[name] = _host(a)
    metadata = {"format": "pt"}
    if recorded:
        metadata[METADATA_KEY] = json.dumps(recorded, sort_keys=True)
    return tensors, metadata


def quant_config(exclude_modules=()) -> dict:
    """The content of ``hf_quant_config.json`` for an NVFP4 checkpoint written by fp4kit."""
    return {
        "producer": {"name": "fp4kit", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": BLOCK_SIZE,
            "kv_cache_quant_algo": None,
            "exclude_modules": [str(m) for m in exclude_modules],
        },
    }


def write_quant_config(folder, exclude_modules=()) -> Path:
    """Write ``hf_quant_config.json`` into ``folder``; returns its path."""
    path = Path(folder) / QUANT_CONFIG_NAME
    path.write_text(json.dumps(quant_config(exclude_modules), indent=2) + "\n", encoding="utf-8")
    return path


def save_nvfp4(
    path,
    weights: dict[str, Nvfp4Tensor],
    *,
    input_scales: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    exclude_modules=(),
) -> Path:
    """Save NVFP4 weights as a ModelOpt-layout safetensors file plus ``hf_quant_config.json``.

    Parameters
    ----------
    path : str or PathLike
        A ``*.safetensors`` file name, or a folder (created if needed) that gets
        ``model.safetensors``. ``hf_quant_config.json`` is written beside the file.
    weights, input_scales, extra
        As in `to_modelopt_tensors` (encode scales in, decode scales on disk, the exact encode
        scales in ``__metadata__``). Device arrays are copied to the host first.
    exclude_modules : iterable of str
        Module names left unquantized, recorded in ``hf_quant_config.json``.

    Returns
    -------
    Path
        The safetensors file written.

    Everything is validated before the file is written; the file is written to a temporary
    name and renamed, so a failure never leaves a half-written checkpoint.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / SINGLE_FILE_NAME
    tensors, metadata = to_modelopt_tensors(weights, input_scales=input_scales, extra=extra)
    write_safetensors(path, tensors, metadata)
    write_quant_config(path.parent, exclude_modules)
    return path

