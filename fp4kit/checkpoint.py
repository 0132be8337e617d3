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
A ModelOpt checkpoint carries ``hf_quant_config.json`` next to its files::

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

Validation happens before anything is returned: every header of every file is checked
(truncation, offsets beyond the file or overlapping, unknown dtypes), then every quantized
prefix for missing tensors, dtypes and shapes, all before any tensor data is read; then each
tensor is checked as it is read (block-scale bytes that are NaN, 0x7F / 0xFF, or have the sign
bit set; global and input scales that are zero, negative or not finite). Problems with the
content of a file raise ``ValueError`` naming the tensor and the file, the expected and the
found value; arguments of the wrong Python type raise ``TypeError``.

The safetensors container is read and written here with numpy directly (an 8-byte little-endian
header length, a JSON header, the raw bytes), because the numpy backend of the ``safetensors``
package cannot materialise ``F8_E4M3`` tensors; the files are ordinary safetensors files that
any reader accepts. Tensors are read one at a time with ``readinto``, so loading never holds
more than one host copy of one tensor beyond what it returns.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import __version__, formats
from .formats import BLOCK_SIZE, Nvfp4Tensor
from .runtime import device as runtime_device

#: ``__metadata__`` key holding the exact encode scales written by `save_nvfp4`
METADATA_KEY = "fp4kit.global_scales"
QUANT_CONFIG_NAME = "hf_quant_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

_F32 = np.float32
_FLT_MAX = np.finfo(np.float32).max
_MAX_HEADER_BYTES = 100 * 2**20  # a larger header length means a corrupt file

#: safetensors dtype codes and their numpy dtypes
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}

#: tensor-name suffix of each part of a quantized prefix, per layout
_PARTS = {
    "modelopt": {"packed": "weight", "block_scales": "weight_scale", "global": "weight_scale_2", "input": "input_scale"},
    "compressed-tensors": {
        "packed": "weight_packed",
        "block_scales": "weight_scale",
        "global": "weight_global_scale",
        "input": "input_global_scale",
    },
}
_LAYOUT_TITLE = {"modelopt": "ModelOpt NVFP4", "compressed-tensors": "compressed-tensors NVFP4"}
#: does the stored scalar hold the decode scale 1/S (ModelOpt) or the encode scale S?
_STORES_DECODE = {"modelopt": True, "compressed-tensors": False}
#: suffixes that mark a prefix as quantized in each layout (``weight_scale`` is shared)
_MARKERS = {
    "compressed-tensors": ("weight_packed", "weight_global_scale", "input_global_scale"),
    "modelopt": ("weight_scale_2", "input_scale", "weight_scale"),
}
_CT_WEIGHT_SHAPE = "weight_shape"  # optional compressed-tensors record of [N, K]
_SCALAR_DTYPES = ("F32", "BF16")  # older ModelOpt exports carry bf16 global scales


# --------------------------------------------------------------------------------------------
# The safetensors container
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file (from the validated header).

    ``begin`` / ``end`` are absolute byte offsets in the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The validated header of one safetensors file; tensor data is read on demand.

    Parameters
    ----------
    path : str or PathLike
        The file. Its header is read and checked at once: the 8-byte length, the JSON, every
        tensor's dtype, shape and data offsets (inside the file, consistent with dtype and
        shape, not overlapping). A problem raises ``ValueError`` naming the file.

    Attributes
    ----------
    path : Path
    metadata : dict[str, str]
        The ``__metadata__`` table (empty if absent).
    tensors : dict[str, TensorInfo]
        In the order of the header.
    size : int
        File size in bytes.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            header, data_start = _read_header(f, self.path, self.size)
        self.metadata = _parse_metadata(header.pop("__metadata__", None), self.path)
        self.tensors = {name: _parse_entry(name, entry, data_start, self.path) for name, entry in header.items()}
        _check_extents(self.tensors, self.size, self.path)

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new host array of its dtype (F8_E4M3 as ``ml_dtypes.float8_e4m3fn``)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{name}: no such tensor in {self.path}")
        out = np.empty(info.shape, dtype=DTYPES[info.dtype])
        view = out.reshape(-1).view(np.uint8)
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            got = f.readinto(view)
        if got != info.nbytes:
            raise ValueError(
                f"{name} ({self.path}): expected {info.nbytes} bytes of data, read {got}: "
                "the file is truncated (it changed after its header was read?)"
            )
        return out


def _read_header(f, path: Path, size: int) -> tuple[dict, int]:
    if size < 8:
        raise ValueError(f"{path}: truncated safetensors file: {size} bytes, fewer than the 8-byte header length")
    length = int.from_bytes(f.read(8), "little")
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {length} bytes is not plausible (corrupt file?)")
    if 8 + length > size:
        raise ValueError(
            f"{path}: truncated safetensors file: the header needs {length} bytes after the length, "
            f"the file has {size - 8}"
        )
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}")
    return header, 8 + length


def _parse_metadata(metadata, path: Path) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must map strings to strings, got {metadata!r:.200}")
    return dict(metadata)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_entry(name: str, entry, data_start: int, path: Path) -> TensorInfo:
    where = f"{name} ({path})"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: header entry must be an object, got {entry!r:.200}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise ValueError(f"{where}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if begin < 0 or end - begin != expected:
        raise ValueError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, "
            f"but {dtype} {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_extents(tensors: dict[str, TensorInfo], size: int, path: Path) -> None:
    previous = None
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.end > size:
            raise ValueError(
                f"{path}: truncated safetensors file: {info.name} ends at byte {info.end}, "
                f"the file has {size} bytes"
            )
        if previous is not None and info.nbytes and info.begin < previous.end:
            raise ValueError(
                f"{path}: corrupt header: the data of {info.name} (bytes {info.begin}..{info.end}) "
                f"overlaps {previous.name} (bytes {previous.begin}..{previous.end})"
            )
        if info.nbytes:
            previous = info


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write host arrays to a safetensors file (atomically: a temporary file, then a rename).

    Parameters
    ----------
    path : str or PathLike
    tensors : dict[str, numpy array]
        Any dtype of `DTYPES` (bf16 and float8 through ``ml_dtypes``); written in this order.
    metadata : dict[str, str], optional
        The ``__metadata__`` table.
    """
    path = Path(path)
    entries, arrays, offset = {}, [], 0
    for name, a in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"tensor names must be non-empty strings other than '__metadata__', got {name!r}")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
        code = _DTYPE_CODES.get(a.dtype)
        if code is None:
            raise TypeError(f"{name}: dtype {a.dtype} has no safetensors code; expected one of {sorted(DTYPES)}")
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray would make 0-d 1-d)
        entries[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    header = ({"__metadata__": dict(metadata)} if metadata else {}) | entries
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8))
    os.replace(tmp, path)


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of one safetensors file as host arrays, and its ``__metadata__``."""
    f = SafetensorsFile(path)
    return {name: f.read(name) for name in f.tensors}, f.metadata


# --------------------------------------------------------------------------------------------
# Opening a checkpoint: files, layout, quantized prefixes (headers only)
# --------------------------------------------------------------------------------------------


def checkpoint_files(path) -> list[Path]:
    """The safetensors files of a checkpoint at ``path``.

    ``path`` may be a ``.safetensors`` file, or a folder holding ``model.safetensors.index.json``
    (its ``weight_map`` names the shards) or one or more ``*.safetensors`` files (all of them,
    sorted by name).
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: names shards that do not exist: {missing}")
        return files
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise ValueError(f"{path}: no *.safetensors files in this folder")
    return files


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content


@dataclass(frozen=True)
class QuantizedPrefix:
    """The tensor names of one quantized prefix (``input`` is None when it has no static scale)."""

    prefix: str
    layout: str
    packed: str
    block_scales: str
    global_scale: str
    input_scale: str | None
    weight_shape: str | None = None  # compressed-tensors' optional [N, K] record

    @property
    def names(self) -> tuple[str, ...]:
        extra = (self.input_scale, self.weight_shape)
        return (self.packed, self.block_scales, self.global_scale, *(n for n in extra if n))


class CheckpointFiles:
    """A checkpoint opened for reading: every header validated, no tensor data read yet.

    Parameters
    ----------
    path : str or PathLike
        A ``.safetensors`` file or a folder of shards (see `checkpoint_files`).

    Attributes
    ----------
    path : Path
    files : list[SafetensorsFile]
    where : dict[str, SafetensorsFile]
        The file holding each tensor.
    layout : str
        ``"modelopt"``, ``"compressed-tensors"`` or ``"plain"`` (nothing quantized).
    quantized : dict[str, QuantizedPrefix]
        Every quantized prefix, its tensors present with the right dtypes and shapes.
    extra_names : list[str]
        Every other tensor.
    quant_config : dict or None
        ``hf_quant_config.json`` next to the files, when there is one (it must say NVFP4 with
        group size 16).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.files = [SafetensorsFile(p) for p in checkpoint_files(self.path)]
        self.where = self._map_names()
        self.quant_config = self._read_quant_config()
        self.layout, self.quantized = self._find_quantized()
        owned = {name for q in self.quantized.values() for name in q.names}
        self.extra_names = [name for name in self.where if name not in owned]
        self._encode_scales = self._recorded_encode_scales()

    def _map_names(self) -> dict[str, SafetensorsFile]:
        where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in where:
                    raise ValueError(f"{name}: stored twice, in {where[name].path} and in {f.path}")
                where[name] = f
        return where

    def _read_quant_config(self) -> dict | None:
        folder = self.path if self.path.is_dir() else self.path.parent
        config_path = folder / QUANT_CONFIG_NAME
        if not config_path.is_file():
            return None
        config = _read_json(config_path)
        quant = config.get("quantization")
        quant = quant if isinstance(quant, dict) else {}
        algo, group = quant.get("quant_algo"), quant.get("group_size", BLOCK_SIZE)
        if algo != "NVFP4" or group != BLOCK_SIZE:
            raise ValueError(
                f"{config_path}: expected quant_algo 'NVFP4' with group_size {BLOCK_SIZE}, "
                f"got quant_algo {algo!r} with group_size {group!r}"
            )
        return config

    def _find_quantized(self) -> tuple[str, dict[str, QuantizedPrefix]]:
        found: dict[str, str] = {}  # prefix -> layout
        for name in self.where:
            prefix, _, leaf = name.rpartition(".")
            if leaf in _MARKERS["compressed-tensors"]:
                found[prefix] = "compressed-tensors"
            elif leaf in _MARKERS["modelopt"]:
                found.setdefault(prefix, "modelopt")
        layouts = sorted(set(found.values()))
        if len(layouts) > 1:
            examples = {lay: next(p for p, v in found.items() if v == lay) for lay in layouts}
            raise ValueError(
                f"{self.path}: mixes quantized layouts: {examples['modelopt']!r} is ModelOpt, "
                f"{examples['compressed-tensors']!r} is compressed-tensors"
            )
        if not layouts:
            return "plain", {}
        return layouts[0], {p: self._check_prefix(p, layout) for p, layout in sorted(found.items())}

    def _check_prefix(self, prefix: str, layout: str) -> QuantizedPrefix:
        parts = _PARTS[layout]
        names = {role: f"{prefix}.{leaf}" for role, leaf in parts.items()}
        for role in ("packed", "block_scales", "global"):
            if names[role] not in self.where:
                present = [n.rpartition(".")[2] for n in names.values() if n in self.where]
                raise ValueError(
                    f"{names[role]}: missing from {self.path} ({_LAYOUT_TITLE[layout]} layout: "
                    f"prefix {prefix!r} has {', '.join(present)} but no {parts[role]})"
                )
        packed = self._info(names["packed"])
        self._expect(packed, ("U8",), None, "packed E2M1 codes [..., K/2]")
        if len(packed.shape) < 2 or packed.shape[-1] % (BLOCK_SIZE // 2):
            raise ValueError(
                f"{self._at(packed)}: expected U8 [N, K/2] with K a multiple of {BLOCK_SIZE} "
                f"(a width that is a multiple of {BLOCK_SIZE // 2} bytes), got shape {list(packed.shape)}"
            )
        k = 2 * packed.shape[-1]
        scale_shape = (*packed.shape[:-1], k // BLOCK_SIZE)
        self._expect(self._info(names["block_scales"]), ("F8_E4M3",), scale_shape,
                     f"linear block scales for {names['packed']} {list(packed.shape)}")
        self._expect_scalar(names["global"])
        input_name = names["input"] if names["input"] in self.where else None
        if input_name:
            self._expect_scalar(input_name)
        shape_name = f"{prefix}.{_CT_WEIGHT_SHAPE}"
        shape_name = shape_name if layout == "compressed-tensors" and shape_name in self.where else None
        if shape_name:
            self._expect(self._info(shape_name), ("I64", "I32"), (len(packed.shape),), "the logical shape [N, K]")
        return QuantizedPrefix(prefix, layout, names["packed"], names["block_scales"], names["global"],
                               input_name, shape_name)

    def _info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def _at(self, info: TensorInfo) -> str:
        return f"{info.name} ({self.where[info.name].path})"

    def _expect(self, info: TensorInfo, dtypes: tuple[str, ...], shape, what: str) -> None:
        if info.dtype in dtypes and (shape is None or info.shape == tuple(shape)):
            return
        want = f"{' or '.join(dtypes)}" + ("" if shape is None else f" {list(shape)}")
        raise ValueError(f"{self._at(info)}: expected {want} ({what}), got {info.dtype} {list(info.shape)}")

    def _expect_scalar(self, name: str) -> None:
        info = self._info(name)
        if info.dtype in _SCALAR_DTYPES and info.shape in ((), (1,)):
            return
        raise ValueError(f"{self._at(info)}: expected an F32 (or BF16) scalar of shape [] or [1], "
                         f"got {info.dtype} {list(info.shape)}")

    def _recorded_encode_scales(self) -> dict[str, str]:
        recorded: dict[str, str] = {}
        for f in self.files:
            text = f.metadata.get(METADATA_KEY)
            if text is None:
                continue
            try:
                table = json.loads(text)
                if not isinstance(table, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                warnings.warn(f"{f.path}: ignoring unreadable __metadata__[{METADATA_KEY!r}] ({e})", stacklevel=3)
                continue
            recorded.update(table)
        return recorded

    # ---- reading (each read validates what it returns) -------------------------------------

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a host array of its stored dtype."""
        return self.where[name].read(name)

    def read_packed(self, q: QuantizedPrefix) -> np.ndarray:
        """uint8 ``[..., K/2]``; with compressed-tensors' ``weight_shape``, checked against it."""
        packed = self.read(q.packed)
        if q.weight_shape:
            recorded = [int(v) for v in self.read(q.weight_shape)]
            logical = [*packed.shape[:-1], 2 * packed.shape[-1]]
            if recorded != logical:
                raise ValueError(f"{self._at(self._info(q.weight_shape))}: records shape {recorded}, "
                                 f"but {q.packed} {list(packed.shape)} holds {logical}")
        return packed

    def read_block_scales(self, q: QuantizedPrefix) -> np.ndarray:
        """uint8 ``[..., K/16]`` E4M3 bytes, every one finite and non-negative."""
        scales = self.read(q.block_scales).view(np.uint8)
        check_block_scale_bytes(scales, self._at(self._info(q.block_scales)))
        return scales

    def read_global_scale(self, q: QuantizedPrefix) -> np.ndarray:
        """The weight's encode scale ``S`` (0-d fp32)."""
        return self._encode_scale(q.global_scale, q.layout)

    def read_input_scale(self, q: QuantizedPrefix) -> np.ndarray | None:
        """The static activation encode scale ``S_a`` (0-d fp32), or None."""
        return None if q.input_scale is None else self._encode_scale(q.input_scale, q.layout)

    def read_quantized(self, q: QuantizedPrefix) -> Nvfp4Tensor:
        """The prefix as a host `Nvfp4Tensor` with linear block scales."""
        packed = self.read_packed(q)
        shape = (*packed.shape[:-1], 2 * packed.shape[-1])
        return Nvfp4Tensor(packed, self.read_block_scales(q), self.read_global_scale(q), "linear", shape)

    def _encode_scale(self, name: str, layout: str) -> np.ndarray:
        where = self._at(self._info(name))
        stored = self.read(name).astype(_F32).reshape(())  # bf16 -> fp32 is exact
        kind = "decode" if _STORES_DECODE[layout] else "encode"
        check_positive_finite(stored, where, f"{kind} scale")
        if not _STORES_DECODE[layout]:
            return stored
        recorded = self._encode_scales.get(name)
        if recorded is not None:
            encode = _scale_from_hex(recorded)
            if encode is not None and decode_scale(encode).view(np.uint32) == stored.view(np.uint32):
                return encode
            warnings.warn(
                f"{where}: __metadata__[{METADATA_KEY!r}] records encode scale {recorded!r}, whose "
                f"reciprocal is not the stored decode scale {float(stored)!r}; using 1 / the stored value",
                stacklevel=3,
            )
        return encode_scale_from_decode(stored)



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


# --------------------------------------------------------------------------------------------
# Scales and scale bytes
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


def check_positive_finite(value: np.ndarray, where: str, what: str) -> None:
    """Raise ValueError unless the fp32 scalar ``value`` is finite and > 0."""
    v = np.asarray(value, _F32).reshape(())
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{where}: expected a positive finite {what}, got {float(v)!r}")


def check_block_scale_bytes(scales: np.ndarray, where: str) -> None:
    """Raise ValueError if any E4M3 block-scale byte is NaN (0x7F / 0xFF) or negative (sign bit set).

    The message gives the count of bad bytes and the index and value of the first one.
    """
    flat = np.asarray(scales).reshape(-1)
    bad = (flat >= 0x80) | (flat == 0x7F)
    count = int(np.count_nonzero(bad))
    if not count:
        return
    first = int(np.argmax(bad))
    nan = int(np.count_nonzero(np.isin(flat, formats.E4M3_NAN_BYTES)))
    index = [int(i) for i in np.unravel_index(first, np.shape(scales))]
    raise ValueError(
        f"{where}: {count} invalid E4M3 block-scale byte(s) ({nan} NaN 0x7F/0xFF, {count - nan} negative "
        f"with the sign bit set), first at index {index} = 0x{int(flat[first]):02X}; block scales must be "
        "finite and non-negative"
    )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


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
    """

    layout: str
    weights: dict[str, Nvfp4Tensor] = field(default_factory=dict)
    input_scales: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    quant_config: dict | None = None
    files: list[Path] = field(default_factory=list)


def load_nvfp4(path, *, device=None) -> Checkpoint:
    """Load an NVFP4 checkpoint (ModelOpt or compressed-tensors layout).

    Parameters
    ----------
    path : str or PathLike
        A ``.safetensors`` file, or a folder of one or many shards (with or without
        ``model.safetensors.index.json``); ``hf_quant_config.json`` beside them is read if present.
    device : None (default), False, "cpu", True, "cuda", "cuda:N" or int N
        ``None`` / ``False`` / ``"cpu"``: numpy arrays. Otherwise CuPy arrays on that CUDA device
        (``True`` / ``"cuda"``: CuPy's current device), copied straight from the host buffers read
        from the file. The one meaning of ``device=`` in fp4kit (`fp4kit.runtime.device`): without
        a usable CUDA device a CUDA choice raises RuntimeError saying to pass ``device=False``,
        before any file is opened.

    Returns
    -------
    Checkpoint

    Everything is validated before anything is returned (see the module docstring): headers,
    names, dtypes and shapes of all files before any data is read, then each tensor as it is
    read and placed; an error part way raises and releases what was placed. Scales
    stored as bf16 (older ModelOpt exports) are accepted and converted to fp32 exactly. For
    ModelOpt files, the exact encode scales recorded by `save_nvfp4` are used when they agree
    with the stored decode scales; otherwise ``S = min(fp32(1 / decode), FLT_MAX)``.
    """
    ordinal = runtime_device.resolve(device)
    ckpt = CheckpointFiles(path)
    if ckpt.layout == "plain":
        raise ValueError(
            f"{path}: no NVFP4 tensors found (expected ModelOpt '<prefix>.weight_scale_2' or "
            "compressed-tensors '<prefix>.weight_packed' tensors)"
        )
    put = _placer(ordinal)
    result = Checkpoint(ckpt.layout, quant_config=ckpt.quant_config, files=[f.path for f in ckpt.files])
    for prefix, q in ckpt.quantized.items():
        w = ckpt.read_quantized(q)
        result.weights[prefix] = Nvfp4Tensor(put(w.packed), put(w.block_scales), put(w.global_scale),
                                             "linear", w.shape)
        s_a = ckpt.read_input_scale(q)
        if s_a is not None:
            result.input_scales[prefix] = put(s_a)
    for name in ckpt.extra_names:
        result.extra[name] = put(ckpt.read(name))
    return result


def _placer(ordinal: int | None):
    """A function that puts a host array on the host (None) or CUDA device ``ordinal``."""
    if ordinal is None:
        return lambda a: a
    import cupy

    def put(a: np.ndarray):
        if a.dtype in (DTYPES["F8_E4M3"], DTYPES["F8_E5M2"]):
            a = a.view(np.uint8)  # CuPy has no float8 dtype
        with runtime_device.using(ordinal):
            return cupy.asarray(a)

    return put


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


# --------------------------------------------------------------------------------------------
# Fused shards
# --------------------------------------------------------------------------------------------


def fuse_rows(parts: list[Nvfp4Tensor]) -> tuple[Nvfp4Tensor, Any]:
    """Concatenate 2-D NVFP4 weights along N (e.g. q|k|v or gate|up) without touching a byte.

    Parameters
    ----------
    parts : list of Nvfp4Tensor
        Shapes ``[N_i, K]`` with one K, all host or all on one device; any scale layout.

    Returns
    -------
    fused : Nvfp4Tensor
        ``[sum N_i, K]``: the packed bytes and the *linear* block-scale bytes of the parts,
        stacked; its ``global_scale`` is 1.
    row_decode_scales : fp32 ``[sum N_i]``
        For each row, the decode scale ``fp32(1 / S_i)`` of the part it came from (ModelOpt's
        ``weight_scale_2`` of that part), in the same memory as the parts.

    The rule: row ``n`` of the fused weight is ``e2m1 * fp32(block_scale) * row_decode_scales[n]``.
    Parts with different global scales thus stay exact: nothing is re-quantized and no part is
    re-scaled to a shared (e.g. max-of-parts) global scale; a GEMM applies the per-row decode
    scale in its epilogue, ``out[m, n] = acc[m, n] * (1 / S_a) * row_decode_scales[n]``. The
    fused tensor's own global scale is 1 so that the usual ``alpha = 1 / (S_a * S_w)`` stays
    correct when a GEMM applies both. When all parts share ``S`` the vector is constant
    (``1/S`` everywhere). ``e2m1 * sf`` is exact in fp32, so a row dequantized this way has one
    rounding; it equals the part's ModelOpt dequantization ``e2m1 * sf * weight_scale_2`` bit for
    bit, and is within ``2**-23`` (relative) of the exact ``e2m1 * sf / S`` — as is fp4kit's
    reference `dequantize` (``e2m1 * fp32(sf / S)``): the two can differ by a couple of ulp.
    """
    if not parts:
        raise ValueError("parts: expected at least one Nvfp4Tensor, got none")
    for i, p in enumerate(parts):
        if not isinstance(p, Nvfp4Tensor):
            raise TypeError(f"parts[{i}]: expected an Nvfp4Tensor, got {type(p).__name__}")
        if len(p.shape) != 2 or p.shape[1] != parts[0].shape[1]:
            raise ValueError(
                f"parts[{i}]: expected a 2-D [N, {parts[0].shape[-1]}] tensor like parts[0], got shape {list(p.shape)}"
            )
    xp = formats.array_module(parts[0].packed)
    if any(formats.array_module(p.packed) is not xp for p in parts):
        raise ValueError("parts: expected all parts in the same memory (all numpy or all CuPy)")
    packed = xp.concatenate([p.packed for p in parts], axis=0)
    scales = xp.concatenate([p.linear_block_scales for p in parts], axis=0)
    # fp32(1 / S_i) per part, computed where the scales live (no host read of a device value)
    decode = [xp.broadcast_to(xp.reciprocal(p.global_scale.reshape(()).astype(_F32)), (p.shape[0],)) for p in parts]
    row_decode = xp.concatenate(decode).astype(_F32, copy=False)
    n = sum(p.shape[0] for p in parts)
    fused = Nvfp4Tensor(packed, scales, xp.ones((), dtype=_F32), "linear", (n, parts[0].shape[1]))
    return fused, row_decode
