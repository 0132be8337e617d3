"""The ModelOpt NVFP4 layout (load and save), as Hugging Face checkpoints exported by ModelOpt use it.

A quantized linear layer of logical weight ``[N, K]`` under the prefix ``P``:

=====================  ===========================================================================
``P.weight``           ``U8 [N, K/2]``: E2M1 codes, element ``2i`` in the low nibble
``P.weight_scale``     ``F8_E4M3 [N, K/16]``: block scales, linear (never swizzled on disk)
``P.weight_scale_2``   ``F32 []``: the *decode* scale ``1/S`` (older exports: BF16, or shape ``[1]``)
``P.input_scale``      optional static activation decode scale ``1/S_a``
=====================  ===========================================================================

``hf_quant_config.json`` beside the files says what was written, with ModelOpt's labels::

    {"producer": {"name": "fp4kit", "version": ...},
     "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                      "kv_cache_quant_algo": null, "exclude_modules": [...]}}

``"W4A16_NVFP4"`` when no layer has an input scale, ``"NVFP4"`` when every layer has one, and
``"MIXED_PRECISION"`` with per-layer ``quantized_layers`` otherwise (`quant_config`). A
``config.json`` beside the files gets the matching ``quantization_config``
(``quant_method: "modelopt"``, `hf_quantization_config`), as ModelOpt's exporter writes it.

Exact global scales. fp4kit works with the encode scale ``S`` (``Nvfp4Tensor.global_scale``);
ModelOpt stores ``fp32(1/S)``, and ``fp32(1/fp32(1/S))`` differs from ``S`` in the last bit for
about one value in seven (13.7–14.1 % of log-uniformly spread scales measured; 17.2 % of the fp32
values of one binade). `save_nvfp4` therefore also records every encode scale it turns
into a decode scale in the safetensors ``__metadata__`` under `METADATA_KEY`, as JSON
``{decode-scale tensor name: "0x" + the 8 hex digits of S's fp32 bits}``. On load the recorded
``S`` is used when it is consistent with the stored tensor (``fp32(1/S)`` equals it bit for bit);
otherwise (a file from another producer, or an edited one: a warning says so)
``S = min(fp32(1 / decode), FLT_MAX)`` with one IEEE fp32 division. In the other direction a loaded
decode scale is written back as it was read (`Checkpoint.decode_scales`), so load → save of a
foreign file leaves its scales byte-identical.

All-zero weights. `fp4kit.quantize` gives an all-zero tensor ``S = FLT_MAX`` (``min(2688 / 0,
FLT_MAX)``), every block scale 0 and every code 0; ``fp32(1/FLT_MAX)`` would be the subnormal
2.94e-39, which flush-to-zero readers see as 0. fp4kit writes ``weight_scale_2 = 0`` instead,
ModelOpt's ``amax / 2688`` for ``amax = 0``, and reads a zero decode scale back (as ``S = FLT_MAX``)
only for a weight whose block scales are all 0. Such a weight dequantizes to zeros under any
reading; a reader that divides by ``weight_scale_2`` gets an infinite global scale for it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..formats import BLOCK_SIZE, Nvfp4Tensor
from .layout import Checkpoint, Layout
from .safetensors_io import DTYPES, SINGLE_FILE_NAME, SafetensorsFile, as_path, read_json, write_safetensors
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
#: the Hugging Face model config whose ``quantization_config`` `write_quant_config` sets
MODEL_CONFIG_NAME = "config.json"

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

    The clamp matters for a decode scale of 0 (an all-zero weight) or a subnormal one, whose
    reciprocal overflows; it mirrors the ``min(2688 / amax, FLT_MAX)`` of the quantization recipe.
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


#: ``quant_algo`` of a layer with a static activation scale (W4A4) and of a weight-only one
W4A4 = "NVFP4"
W4A16 = "W4A16_NVFP4"
#: ``quant_algo`` of a checkpoint holding both kinds (per-layer detail in ``quantized_layers``)
MIXED = "MIXED_PRECISION"


def read_quant_config(folder: Path) -> dict | None:
    """``hf_quant_config.json`` in ``folder``, or None.

    It must describe NVFP4 with group size 16: ``quant_algo`` ``"NVFP4"`` (weights and static
    activation scales), ``"W4A16_NVFP4"`` (weight-only) or ``"MIXED_PRECISION"`` whose
    ``quantized_layers`` are all one of those two.
    """
    config_path = folder / QUANT_CONFIG_NAME
    if not config_path.is_file():
        return None
    config = read_json(config_path)
    quant = config.get("quantization")
    quant = quant if isinstance(quant, dict) else {}
    algo = quant.get("quant_algo")
    layers = quant.get("quantized_layers") if algo == MIXED else {"": quant}
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{config_path}: quant_algo {MIXED!r} needs a non-empty 'quantized_layers' object")
    for name, layer in layers.items():
        layer = layer if isinstance(layer, dict) else {}
        algo_l, group = layer.get("quant_algo"), layer.get("group_size", BLOCK_SIZE)
        if algo_l not in (W4A4, W4A16) or group != BLOCK_SIZE:
            where = f"quantized_layers[{name!r}]: " if name else ""
            raise ValueError(
                f"{config_path}: {where}expected quant_algo {W4A4!r} or {W4A16!r} with group_size "
                f"{BLOCK_SIZE}, got quant_algo {algo_l!r} with group_size {group!r}"
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
    """The encode scale ``S`` behind a stored (validated) decode scale.

    A positive stored value: the recorded exact ``S`` when its reciprocal is the stored value bit
    for bit, else ``min(fp32(1 / stored), FLT_MAX)``. A stored 0 (an all-zero weight, see
    `to_modelopt_tensors`): the recorded ``S`` if any, else ``FLT_MAX`` (the recipe's ``S`` for
    ``amax = 0``).
    """
    encode = None if recorded is None else _scale_from_hex(recorded)
    if stored == 0:
        if encode is not None and np.isfinite(encode) and encode > 0:
            return encode
        return np.asarray(_FLT_MAX, _F32)
    if recorded is not None:
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


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.asarray(a, _F32).reshape(()).view(np.uint32) == np.asarray(b, _F32).reshape(()).view(np.uint32))


def _decode_to_write(name: str, s: np.ndarray, given, all_zero: bool) -> tuple[np.ndarray, bool]:
    """The decode scale written for encode scale ``s`` under tensor ``name``, and whether ``s``
    must be recorded in ``__metadata__`` to come back exactly."""
    if given is not None:
        d = _host_scalar(f"decode_scales[{name!r}]", given)
        # a loaded scale goes back as it was read, as long as the weight still has the S it gave
        valid = (np.isfinite(d) and d > 0) or (d == 0 and all_zero)
        if valid and _same_bits(encode_scale(d, None, name), s):
            return d.astype(_F32), False
    if all_zero:
        # ModelOpt's weight_scale_2 is amax / 2688, i.e. 0 for an all-zero weight (fp32(1/FLT_MAX)
        # would be a subnormal 2.9e-39 that flush-to-zero readers see as 0 anyway)
        return np.zeros((), _F32), not _same_bits(s, _FLT_MAX)
    return decode_scale(s), True


def to_modelopt_tensors(
    weights: dict[str, Nvfp4Tensor],
    *,
    input_scales: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    decode_scales: dict[str, Any] | None = None,
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
    decode_scales : dict[str, 0-d fp32 array], optional
        Decode scales as a file stored them, by tensor name (``P.weight_scale_2``,
        ``P.input_scale``): `Checkpoint.decode_scales` of a loaded checkpoint. Each is written
        instead of ``fp32(1/S)`` when the weight's ``S`` is still the one it gives
        (``min(fp32(1/D), FLT_MAX)``, bit for bit), so load → save writes a foreign file's
        scales back unchanged although ``fp32(1/fp32(1/D))`` is not always ``D``.

    Returns
    -------
    tensors : dict[str, numpy array]
    metadata : dict[str, str]
        ``{"format": "pt", METADATA_KEY: JSON of the exact encode scales}`` (the ``format`` entry
        is what Hugging Face loaders expect of a file with metadata).

    An all-zero weight (every block scale 0; `fp4kit.quantize` gives it ``S = FLT_MAX``) is written
    with ``weight_scale_2 = 0``, as ModelOpt's ``amax / 2688`` gives, every block-scale byte 0 and
    every code 0: it dequantizes to zeros under any reading. Its ``S`` comes back as ``FLT_MAX``
    (or the recorded ``S``, if it was another).
    """
    input_scales = dict(input_scales or {})
    extra = dict(extra or {})
    decode_scales = dict(decode_scales or {})
    tensors: dict[str, np.ndarray] = {}
    recorded: dict[str, str] = {}
    for prefix, w in weights.items():
        if not isinstance(w, Nvfp4Tensor):
            raise TypeError(f"weights[{prefix!r}]: expected an Nvfp4Tensor, got {type(w).__name__}")
        scales = _host(w.linear_block_scales)
        check_block_scale_bytes(scales, f"weights[{prefix!r}].block_scales")
        s = _host_scalar(f"weights[{prefix!r}].global_scale", w.global_scale)
        check_positive_finite(s, f"weights[{prefix!r}].global_scale", "encode scale")
        name = f"{prefix}.{MODELOPT.global_scale}"
        decode, record = _decode_to_write(name, s, decode_scales.get(name), not scales.any())
        tensors[f"{prefix}.{MODELOPT.packed}"] = _host(w.linear_packed)  # a tiled GEMM weight goes back to the file layout
        tensors[f"{prefix}.{MODELOPT.block_scales}"] = scales.copy(order="C").view(DTYPES["F8_E4M3"])
        tensors[name] = decode
        if record:
            recorded[name] = _scale_to_hex(s)
    for prefix, s_a in input_scales.items():
        if prefix not in weights:
            raise ValueError(f"input_scales[{prefix!r}]: no quantized weight with this prefix")
        s_a = _host_scalar(f"input_scales[{prefix!r}]", s_a)
        check_positive_finite(s_a, f"input_scales[{prefix!r}]", "encode scale")
        name = f"{prefix}.{MODELOPT.input_scale}"
        decode, record = _decode_to_write(name, s_a, decode_scales.get(name), False)
        tensors[name] = decode
        if record:
            recorded[name] = _scale_to_hex(s_a)
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


def quant_config(quantized=(), input_scaled=(), exclude_modules=()) -> dict:
    """The content of ``hf_quant_config.json`` for an NVFP4 checkpoint written by fp4kit.

    Parameters
    ----------
    quantized : iterable of str
        The quantized prefixes.
    input_scaled : iterable of str
        Those of them with a static activation scale (``P.input_scale``).
    exclude_modules : iterable of str
        Modules left unquantized.

    ``quant_algo`` says what was written, as ModelOpt labels it: ``"NVFP4"`` when every quantized
    layer has an input scale (W4A4), ``"W4A16_NVFP4"`` when none has (weight-only; loaders that
    expect W4A4 would otherwise look for the missing input scales), and ``"MIXED_PRECISION"``
    with the per-layer ``quantized_layers`` when some have.
    """
    quantized = sorted(str(p) for p in quantized)
    scaled = {str(p) for p in input_scaled}
    algos = {p: W4A4 if p in scaled else W4A16 for p in quantized}
    kinds = set(algos.values())
    quantization: dict[str, Any] = {"quant_algo": kinds.pop() if len(kinds) == 1 else (MIXED if kinds else W4A16)}
    if quantization["quant_algo"] == MIXED:
        quantization["quantized_layers"] = {p: {"quant_algo": a, "group_size": BLOCK_SIZE} for p, a in algos.items()}
    else:
        quantization["group_size"] = BLOCK_SIZE
    quantization["kv_cache_quant_algo"] = None
    quantization["exclude_modules"] = sorted(str(m) for m in exclude_modules)
    return {"producer": {"name": "fp4kit", "version": __version__}, "quantization": quantization}


def hf_quantization_config(config: dict) -> dict:
    """``config.json``'s ``quantization_config`` for an ``hf_quant_config.json`` content, in the
    form ModelOpt's exporter writes (``quant_method: "modelopt"``, compressed-tensors style
    ``config_groups``, ``ignore``)."""
    quant = config["quantization"]
    algo = quant["quant_algo"]

    def group(layer_algo: str, targets: list[str]) -> dict:
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
        g = {"input_activations": dict(fp4)} if layer_algo == W4A4 else {}
        return g | {"weights": fp4, "targets": targets}

    out: dict[str, Any] = {}
    if algo == MIXED:
        by_algo: dict[str, list[str]] = {}
        for prefix, layer in quant["quantized_layers"].items():
            by_algo.setdefault(layer["quant_algo"], []).append(prefix)
        out["config_groups"] = {f"group_{i}": group(a, sorted(names)) for i, (a, names) in enumerate(by_algo.items())}
        out["quantized_layers"] = quant["quantized_layers"]
    else:
        out["config_groups"] = {"group_0": group(algo, ["Linear"])}
    out["ignore"] = list(quant.get("exclude_modules", []))
    out["quant_algo"] = algo
    out["producer"] = config["producer"]
    out["quant_method"] = "modelopt"
    return out


def write_quant_config(folder, quantized=(), input_scaled=(), exclude_modules=()) -> Path:
    """Write ``hf_quant_config.json`` (see `quant_config`) into ``folder`` and, when the folder has
    a ``config.json``, set its ``quantization_config`` (see `hf_quantization_config`); returns the
    path of ``hf_quant_config.json``."""
    folder = as_path(folder, "folder")
    config = quant_config(quantized, input_scaled, exclude_modules)
    path = folder / QUANT_CONFIG_NAME
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    model_config = folder / MODEL_CONFIG_NAME
    if model_config.is_file():
        content = read_json(model_config)
        content["quantization_config"] = hf_quantization_config(config)
        tmp = model_config.with_name(model_config.name + ".tmp")
        tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        tmp.replace(model_config)
    return path


def save_nvfp4(
    path,
    weights,
    *,
    input_scales: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    exclude_modules=None,
    decode_scales: dict[str, Any] | None = None,
) -> Path:
    """Save NVFP4 weights as a ModelOpt-layout safetensors file plus ``hf_quant_config.json``.

    Parameters
    ----------
    path : str or PathLike
        A ``*.safetensors`` file name, or a folder (created if needed) that gets
        ``model.safetensors``. ``hf_quant_config.json`` is written beside the file, and the
        ``quantization_config`` of a ``config.json`` there is set to match it.
    weights : dict[str, Nvfp4Tensor] or Checkpoint
        A `Checkpoint` (as `load_nvfp4` returns it) supplies its weights, input scales, extra
        tensors, stored decode scales and (from its ``hf_quant_config.json``) excluded modules;
        arguments given explicitly replace them.
    input_scales, extra, decode_scales
        As in `to_modelopt_tensors` (encode scales in, decode scales on disk, the exact encode
        scales in ``__metadata__``). Device arrays are copied to the host first.
    exclude_modules : iterable of str
        Module names left unquantized, recorded in ``hf_quant_config.json``.

    Returns
    -------
    Path
        The safetensors file written.

    ``quant_algo`` is ``"NVFP4"``, ``"W4A16_NVFP4"`` or ``"MIXED_PRECISION"`` by which weights have
    input scales (see `quant_config`). Everything is validated before the file is written; the
    file is written to a temporary name and renamed, so a failure never leaves a half-written
    checkpoint.
    """
    if isinstance(weights, Checkpoint):
        ckpt = weights
        weights = ckpt.weights
        input_scales = ckpt.input_scales if input_scales is None else input_scales
        extra = ckpt.extra if extra is None else extra
        decode_scales = ckpt.decode_scales if decode_scales is None else decode_scales
        if exclude_modules is None and ckpt.quant_config is not None:
            exclude_modules = ckpt.quant_config.get("quantization", {}).get("exclude_modules", ())
    elif not isinstance(weights, dict):
        raise TypeError(f"weights: expected a dict of Nvfp4Tensor or a Checkpoint, got {type(weights).__name__}")
    path = as_path(path, "path")
    if not weights:
        raise ValueError("weights: expected at least one Nvfp4Tensor (the file would be labelled NVFP4 without "
                         "holding an NVFP4 tensor)")
    tensors, metadata = to_modelopt_tensors(weights, input_scales=input_scales, extra=extra,
                                            decode_scales=decode_scales)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / SINGLE_FILE_NAME
    write_safetensors(path, tensors, metadata)
    write_quant_config(path.parent, weights, input_scales or {}, exclude_modules or ())
    return path
