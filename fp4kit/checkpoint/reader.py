"""Reading an NVFP4 checkpoint: `CheckpointFiles` (headers validated, data read on demand) and
`load_nvfp4` (everything read, validated and placed on the host or a CUDA device).

Validation happens before anything is returned: every header of every file is checked
(truncation, offsets beyond the file or overlapping, unknown dtypes), then every quantized
prefix for missing tensors, dtypes and shapes, all before any tensor data is read; then each
tensor is checked as it is read (block-scale bytes that are NaN, 0x7F / 0xFF, or have the sign
bit set; global and input scales that are zero, negative or not finite). Problems with the
content of a file raise ``ValueError`` naming the tensor and the file, the expected and the
found value; arguments of the wrong Python type raise ``TypeError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import BLOCK_SIZE, Nvfp4Tensor, to_tiled
from ..runtime import device as runtime_device
from . import compressed_tensors, modelopt
from .compressed_tensors import COMPRESSED_TENSORS
from .layout import Checkpoint
from .modelopt import MODELOPT
from .safetensors_io import DTYPES, SafetensorsFile, TensorInfo, as_path, checkpoint_files
from .validation import check_block_scale_bytes, check_positive_finite

#: every readable layout by name
LAYOUTS = {layout.name: layout for layout in (MODELOPT, COMPRESSED_TENSORS)}
_SCALAR_DTYPES = ("F32", "BF16")  # older ModelOpt exports carry bf16 global scales


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
        self.path = as_path(path, "path")
        self.files = [SafetensorsFile(p) for p in checkpoint_files(self.path)]
        self.where = self._map_names()
        self.quant_config = self._read_quant_config()
        self.layout, self.quantized = self._find_quantized()
        owned = {name for q in self.quantized.values() for name in q.names}
        self.extra_names = [name for name in self.where if name not in owned]
        self._encode_scales = modelopt.recorded_encode_scales(self.files)

    def _map_names(self) -> dict[str, SafetensorsFile]:
        where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in where:
                    raise ValueError(f"{name}: stored twice, in {where[name].path} and in {f.path}")
                where[name] = f
        return where

    def _read_quant_config(self) -> dict | None:
        return modelopt.read_quant_config(self.path if self.path.is_dir() else self.path.parent)

    def _find_quantized(self) -> tuple[str, dict[str, QuantizedPrefix]]:
        found: dict[str, str] = {}  # prefix -> layout
        for name in self.where:
            prefix, _, leaf = name.rpartition(".")
            if leaf in COMPRESSED_TENSORS.markers:
                found[prefix] = COMPRESSED_TENSORS.name
            elif leaf in MODELOPT.markers:
                found.setdefault(prefix, MODELOPT.name)
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
        parts = LAYOUTS[layout].parts()
        names = {role: f"{prefix}.{leaf}" for role, leaf in parts.items()}
        for role in ("packed", "block_scales", "global"):
            if names[role] not in self.where:
                present = [n.rpartition(".")[2] for n in names.values() if n in self.where]
                raise ValueError(
                    f"{names[role]}: missing from {self.path} ({LAYOUTS[layout].title} layout: "
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
        shape_name = f"{prefix}.{compressed_tensors.WEIGHT_SHAPE}"
        shape_name = shape_name if layout == COMPRESSED_TENSORS.name and shape_name in self.where else None
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

    def read_global_scale(self, q: QuantizedPrefix, block_scales: np.ndarray | None = None) -> np.ndarray:
        """The weight's encode scale ``S`` (0-d fp32); ``block_scales`` (read if not given) decide
        whether a stored ModelOpt decode scale of 0 is valid (only for an all-zero weight)."""
        return self.read_scale(q.global_scale, q.layout, all_zero=self._all_zero(q, block_scales))[1]

    def read_input_scale(self, q: QuantizedPrefix) -> np.ndarray | None:
        """The static activation encode scale ``S_a`` (0-d fp32), or None."""
        return None if q.input_scale is None else self.read_scale(q.input_scale, q.layout)[1]

    def read_quantized(self, q: QuantizedPrefix) -> Nvfp4Tensor:
        """The prefix as a host `Nvfp4Tensor` with linear block scales."""
        packed = self.read_packed(q)
        shape = (*packed.shape[:-1], 2 * packed.shape[-1])
        scales = self.read_block_scales(q)
        return Nvfp4Tensor(packed, scales, self.read_global_scale(q, scales), "linear", shape)

    def read_scale(self, name: str, layout: str, *, all_zero: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """A stored scalar scale as it is on disk (0-d fp32) and the encode scale behind it.

        The stored value must be positive and finite; a ModelOpt decode scale may also be 0 when
        ``all_zero`` (the weight's block scales are all 0, as ModelOpt's ``amax / 2688`` gives).
        """
        where = self._at(self._info(name))
        stored = self.read(name).astype(np.float32).reshape(())  # bf16 -> fp32 is exact
        stores_decode = LAYOUTS[layout].stores_decode
        if not (stores_decode and all_zero and stored == 0 and not np.signbit(stored)):
            check_positive_finite(stored, where, f"{'decode' if stores_decode else 'encode'} scale")
        if not stores_decode:
            return stored, stored
        return stored, modelopt.encode_scale(stored, self._encode_scales.get(name), where)

    def _all_zero(self, q: QuantizedPrefix, block_scales: np.ndarray | None) -> bool:
        scales = self.read_block_scales(q) if block_scales is None else block_scales
        return not scales.any()


def load_nvfp4(path, *, device=None, tiled: bool = False, keep=None) -> Checkpoint:
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
    keep : callable or None
        ``keep(name) -> bool`` on each quantized prefix and each other tensor's name: only those it
        keeps are read (e.g. the first layers of a model too large for one GPU); None reads all.
    tiled : bool
        Put every weight in the tiled GEMM layout (`fp4kit.formats.to_tiled`) as it is placed, the
        layout fp4kit's layers convert their device weights to when they are built: a model built
        from the checkpoint then holds one copy of each weight. Saving converts back.

    Returns
    -------
    Checkpoint

    Everything is validated before anything is returned (see the module docstring): headers,
    names, dtypes and shapes of all files before any data is read, then each tensor as it is
    read and placed; an error part way raises and releases what was placed. Scales
    stored as bf16 (older ModelOpt exports) are accepted and converted to fp32 exactly. For
    ModelOpt files, the exact encode scales recorded by `save_nvfp4` are used when they agree
    with the stored decode scales; otherwise ``S = min(fp32(1 / decode), FLT_MAX)``. The stored
    decode scales are kept in `Checkpoint.decode_scales`, so ``save_nvfp4(out, checkpoint)``
    writes them back bit for bit.
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
    if keep is not None and not callable(keep):
        raise TypeError(f"keep: expected a callable name -> bool or None, got {type(keep).__name__}")
    for prefix, q in ckpt.quantized.items():
        if keep is not None and not keep(prefix):
            continue
        packed = ckpt.read_packed(q)
        scales = ckpt.read_block_scales(q)
        stored, s = ckpt.read_scale(q.global_scale, q.layout, all_zero=not scales.any())
        shape = (*packed.shape[:-1], 2 * packed.shape[-1])
        weight = Nvfp4Tensor(put(packed), put(scales), put(s), "linear", shape)
        result.weights[prefix] = to_tiled(weight) if tiled and len(shape) >= 2 else weight
        scalars = [(q.global_scale, stored)]
        if q.input_scale is not None:
            stored_a, s_a = ckpt.read_scale(q.input_scale, q.layout)
            result.input_scales[prefix] = put(s_a)
            scalars.append((q.input_scale, stored_a))
        if LAYOUTS[q.layout].stores_decode:
            result.decode_scales.update(scalars)
    for name in ckpt.extra_names:
        if keep is None or keep(name):
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

