"""The safetensors container: a validating reader and an atomic writer, in numpy.

A safetensors file is an 8-byte little-endian header length, a JSON header (``__metadata__`` and,
per tensor, ``dtype``, ``shape`` and ``data_offsets``) and the raw little-endian bytes. fp4kit
reads and writes it here rather than through the ``safetensors`` package because:

* loading must validate every header before it reads data (truncation, offsets beyond the file
  or overlapping, unknown dtypes), naming the file and the tensor, and must read one tensor at a
  time with ``readinto`` so that memory never holds more than one host copy of one tensor beyond
  what it returns; ``safetensors.deserialize`` takes the whole file as one bytes object, and
  ``safe_open(framework="numpy")`` cannot materialise ``F8_E4M3`` (the block scales);
* ``safetensors.serialize`` does write ``F8_E4M3`` and ``U8`` tensors from raw bytes, but its
  Python signature changed in 0.8 (dicts holding ``bytes`` before, ``TensorSpec`` objects holding
  raw pointers since), so using it would pin a narrow version range to replace ~30 lines.

The package is therefore only a test dependency: the tests use it as an independent reader and
writer to check that fp4kit's files are ordinary safetensors files.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

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
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # UE8M0 block scales (DeepSeek-V4's FP8 and FP4 weights)
}
_DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


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
        self.path = as_path(path, "path")
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


    def map(self) -> dict[str, np.ndarray]:
        """Every tensor as an array over one private memory map of the file, in header order: nothing
        is copied at this point, pages are read on first use (the whole file is announced to the
        system for reading ahead), and a write to an array copies only its own pages, never into the
        file. A file shorter than its header says is refused as `read` refuses it; one that shrinks
        while the arrays are in use stops the process (SIGBUS), so use it on input that is not
        being rewritten."""
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            end = max((info.end for info in self.tensors.values()), default=0)
            if size < end:
                raise ValueError(f"{self.path}: expected at least {end} bytes, the file has {size}: the file is "
                                 "truncated (it changed after its header was read?)")
            if not size:
                return {}
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            m.madvise(mmap.MADV_WILLNEED)
        data = np.frombuffer(m, np.uint8)  # keeps the map alive as long as any view
        return {name: data[info.begin:info.end].view(DTYPES[info.dtype]).reshape(info.shape)
                for name, info in self.tensors.items()}


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
    path = as_path(path, "path")
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



def as_path(path, name: str) -> Path:
    """``path`` (a str or os.PathLike) as a Path; TypeError naming the argument otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a str or os.PathLike (a .safetensors file or a folder of them), "
                        f"got {type(path).__name__}")
    return Path(path)


def checkpoint_files(path) -> list[Path]:
    """The safetensors files of a checkpoint at ``path``.

    ``path`` may be a ``.safetensors`` file, or a folder holding ``model.safetensors.index.json``
    (its ``weight_map`` names the shards) or one or more ``*.safetensors`` files (all of them,
    sorted by name).
    """
    path = as_path(path, "path")
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the file if it is not one."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content

