"""The ``fp4kit`` command: ``quantize`` a safetensors model to NVFP4, ``convert`` an official DeepSeek
checkpoint to NVFP4, ``inspect`` a checkpoint.

``fp4kit quantize IN OUT`` reads a bf16 / fp16 / fp32 model (a ``.safetensors`` file or a folder
of shards), quantizes the selected weights with `fp4kit.quantize` (the CUDA kernels with
``--device cuda``, the numpy reference with ``--device cpu``; the bytes are the same) and writes
a ModelOpt-layout NVFP4 checkpoint to the folder OUT: ``model.safetensors`` (or one output shard
per input shard plus ``model.safetensors.index.json``) and ``hf_quant_config.json``, labelled
``W4A16_NVFP4`` (weights only) unless ``--calibrate FILE`` gives sample activations: a safetensors
file holding, under a quantized layer's module name (``model.layers.0.mlp.down_proj``), inputs of
that layer ``[..., K]``; each such layer gets the static activation scale of their amax
(``input_scale``, as ModelOpt writes it) and the checkpoint is labelled ``NVFP4`` (every layer
calibrated) or ``MIXED_PRECISION``. Other files of an input
folder (``config.json``, tokenizer files, ...) and of its subfolders (e.g. a sentence-transformers
``1_Pooling/``) are copied unchanged; weights in other formats (``*.bin``, ...) and the weights of
subfolders are not, and are listed. A copied ``config.json`` gets ModelOpt's
``quantization_config`` (``quant_method: modelopt``). Input shards are processed one at a time,
tensors read one at a time, so memory holds at most one shard's output. Shards are staged and
moved into OUT only when every tensor succeeded: a failure (e.g. a weight holding NaN, no CUDA
device) leaves no partial checkpoint, and no OUT folder when the run created it.

Default selection: a tensor is quantized when it is a 2-D bf16 / fp16 / fp32 tensor named
``*.weight`` whose last dimension is a multiple of 16 and whose name does not match
`DEFAULT_SKIP` (embeddings, norms, MoE routers). ``lm_head`` is quantized by default; add
``--exclude lm_head`` to keep it in bf16 as ModelOpt's default recipe does. ``--include REGEX``
replaces the name rule (the shape rule still applies); ``--exclude REGEX`` removes more names.
Everything not selected is copied as it is and listed with the reason; every ``*.weight`` left
out is recorded in ``exclude_modules``. Selecting nothing (e.g. an ``--include`` that matches no
tensor) is an error, not a checkpoint without an NVFP4 tensor. The summary gives the error of each
quantized tensor and the size of the whole checkpoint before and after.

``fp4kit convert IN OUT`` converts an official DeepSeek checkpoint (V4: FP8 weights with UE8M0
128 x 128 block scales and MXFP4 experts; V3 / R1: FP8 with fp32 ``weight_scale_inv``) to the same
ModelOpt layout under the same tensor names, shard by shard (one output shard per input shard,
written whole or not at all), copying every other tensor and file; MXFP4 tensors convert exactly
when their block-exponent spread allows (`fp4kit.checkpoint.deepseek`), and the report names any
that had to be re-quantized. A record in OUT (``.fp4kit-convert.json``) lets a stopped run resume
at the first shard not yet written.

``fp4kit inspect PATH`` prints the layout, every tensor (dtype, shape, bytes) and, for each
quantized prefix, N, K, the global scale and block-scale statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import __version__, checkpoint, formats
from .checkpoint.jobs import run_jobs
from .checkpoint.overlap import ReadAhead
from .formats import BLOCK_SIZE, Nvfp4Tensor
from .ops.quant import amax, dequantize, global_scale_from_amax, quantize
from .runtime import device as runtime_device

#: name patterns kept unquantized by default
DEFAULT_SKIP = (
    r"embed",  # token / position embeddings (embed_tokens, word_embeddings, ...)
    r"(^|\.)(wte|wpe)\.",  # GPT-2 style embeddings
    r"norm",  # RMSNorm / LayerNorm weights, incl. 2-D ones
    r"(^|\.)ln_",  # GPT-2 style norms
    r"(^|\.)gate\.weight$",  # MoE routers (mlp.gate, block_sparse_moe.gate), not gate_proj
    r"router",  # routers named as such
    r"shared_expert_gate",  # the scalar gate of a shared expert
)
_DEFAULT_SKIP = re.compile("|".join(f"(?:{p})" for p in DEFAULT_SKIP))
_QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")
_ROW_CHUNK_ELEMENTS = 1 << 18  # error statistics are accumulated over row chunks of this size (in cache)
_DEVICE_CHUNK_ELEMENTS = 1 << 24  # ... and of this size on a device (float64 temporaries of 128 MB)


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which tensors ``fp4kit quantize`` quantizes (see the module docstring)."""

    include: re.Pattern | None = None
    exclude: re.Pattern | None = None

    @staticmethod
    def shape_reason(info: checkpoint.TensorInfo) -> str | None:
        """Why the name suffix, dtype or shape rule out quantizing ``info`` (None: they allow it).

        Quantizable: a 2-D bf16 / fp16 / fp32 ``*.weight`` with K a multiple of 16 and at least
        one element.
        """
        if not info.name.endswith(".weight"):
            return "not a *.weight tensor"
        if info.dtype not in _QUANTIZABLE_DTYPES:
            return f"dtype {info.dtype} (only {', '.join(_QUANTIZABLE_DTYPES)} are quantized)"
        if len(info.shape) != 2:
            return f"{len(info.shape)}-D (only 2-D [N, K] weights are quantized)"
        if info.shape[1] % BLOCK_SIZE:
            return f"K = {info.shape[1]} is not a multiple of {BLOCK_SIZE}"
        if info.shape[0] * info.shape[1] == 0:
            return "empty"
        return None

    def reason(self, info: checkpoint.TensorInfo) -> str | None:
        """Why ``info`` is not quantized, or None when it is."""
        why = self.shape_reason(info)
        if why is not None:
            return why
        if self.include is not None:
            if not self.include.search(info.name):
                return "does not match --include"
        elif _DEFAULT_SKIP.search(info.name):
            rule = next(p for p in DEFAULT_SKIP if re.search(p, info.name))
            return f"default name rule ({rule}); --include replaces the rule"
        if self.exclude is not None and self.exclude.search(info.name):
            return "matches --exclude"
        return None

    def __call__(self, info: checkpoint.TensorInfo) -> bool:
        return self.reason(info) is None


@dataclass
class Plan:
    """What ``fp4kit quantize`` will do with every tensor, decided from the headers alone."""

    quantized: list[str] = field(default_factory=list)
    #: name -> why it is copied as it is
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def exclude_modules(self) -> list[str]:
        """Every ``*.weight`` left unquantized, as a module name (for ``hf_quant_config.json``)."""
        return sorted(name.removesuffix(".weight") for name in self.kept if name.endswith(".weight"))


def plan_quantization(src: checkpoint.CheckpointFiles, select: Selection) -> Plan:
    """Sort every tensor of ``src`` into quantized and kept; raise ValueError when nothing would be
    quantized (the output would be labelled NVFP4 without holding an NVFP4 tensor)."""
    plan = Plan()
    for name, f in src.where.items():
        why = select.reason(f.tensors[name])
        if why is None:
            plan.quantized.append(name)
        else:
            plan.kept[name] = why
    if select.include is not None and not any(select.include.search(name) for name in src.where):
        raise ValueError(f"--include {select.include.pattern!r} matches no tensor of {src.path} "
                         f"(its {len(src.where)} tensors include {sorted(src.where)[:3]})")
    if not plan.quantized:
        reasons = sorted(set(plan.kept.values()))
        shown = "; ".join(reasons[:6]) + ("; ..." if len(reasons) > 6 else "")
        raise ValueError(f"{src.path}: nothing to quantize: every tensor is ruled out ({shown})")
    return plan


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {text!r} ({e})") from None


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def progress(total: int, stream=None) -> tqdm:
    """A tqdm bar over ``total`` tensors on ``stream`` (stderr), shown only on a terminal (tqdm's
    ``disable=None``), so logs and pipes get no carriage-return updates."""
    return tqdm(total=total, unit="tensor", file=sys.stderr if stream is None else stream, disable=None,
                dynamic_ncols=True)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Rows of strings as aligned columns (numbers right-aligned), with a header rule."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    numeric = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# --------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------


def _resolve_device(device: str) -> str:
    """The backend for a --device choice; "auto" means cuda when a device is available."""
    if device == "cpu":
        return "cpu"
    reason = runtime_device.unavailable_reason()
    if device == "cuda" and reason is not None:
        raise ValueError(f"--device cuda: no CUDA device is available ({reason}); --device cpu runs the numpy "
                         "reference, which writes the same bytes")
    return "cpu" if reason is not None else "cuda"


def read_calibration(path, plan: Plan, src: checkpoint.CheckpointFiles) -> dict[str, np.ndarray]:
    """The static activation encode scales ``S_a = global_scale_from_amax(amax(x))`` (0-d fp32) of
    the layers that ``path`` holds sample inputs ``x [..., K]`` for, by module name; every name must
    be a layer that is quantized, every tensor finite, not all zero, with that layer's K."""
    where = f"--calibrate {path}"
    f = checkpoint.SafetensorsFile(path)
    layers = {n.removesuffix(".weight"): src.where[n].tensors[n].shape for n in plan.quantized}
    unknown = [n for n in f.tensors if n not in layers]
    if unknown:
        raise ValueError(f"{where}: {unknown[:5]} name no quantized layer; expected module names of quantized "
                         f"layers such as {sorted(layers)[:3]}")
    if not f.tensors:
        raise ValueError(f"{where}: holds no tensors")
    scales = {}
    for name, info in f.tensors.items():
        k = layers[name][1]
        if info.dtype not in _QUANTIZABLE_DTYPES or not info.shape or info.shape[-1] != k or 0 in info.shape:
            raise ValueError(f"{where}: {name}: expected {'/'.join(_QUANTIZABLE_DTYPES)} activations [..., {k}] "
                             f"(K of the layer), got {info.dtype} {list(info.shape)}")
        x = f.read(name)
        if not np.isfinite(x.astype(np.float32)).all():
            raise ValueError(f"{where}: {name}: holds non-finite values")
        a = amax(x)
        if a == 0:
            raise ValueError(f"{where}: {name}: all zero; an activation scale needs a non-zero amax")
        scales[name] = global_scale_from_amax(a)
    return scales


def _quantize_one(name: str, w, device: str) -> tuple[Nvfp4Tensor, float, float]:
    """NVFP4 of ``w`` (host, or device for ``device`` cuda) as host arrays, and its error against
    ``w`` (`quantization_error`), computed where ``w`` is: only the NVFP4 bytes and two numbers
    cross to the host."""
    xp = formats.array_module(w)
    bad = w.size - int(xp.count_nonzero(xp.isfinite(w)))
    if bad:
        raise ValueError(f"{name}: holds {bad} non-finite value(s); refusing to quantize it")
    if device == "cpu":
        q = quantize(w)
        return (q, *quantization_error(w, q))
    import cupy

    w = cupy.asarray(w)
    q = quantize(w)
    rel, max_abs = quantization_error(w, q)
    return Nvfp4Tensor(q.packed.get(), q.block_scales.get(), q.global_scale.get(), q.scale_layout, q.shape), rel, max_abs


def _row_chunks(a) -> list[slice]:
    """Row slices of the 2-D ``a``: in-cache chunks on the host, few large ones on a device (each
    chunk there costs launches and a read-back)."""
    rows, k = a.shape
    size = _ROW_CHUNK_ELEMENTS if isinstance(a, np.ndarray) else _DEVICE_CHUNK_ELEMENTS
    step = max(1, size // max(k, 1))
    return [slice(r, r + step) for r in range(0, rows, step)]


def error_stats(pairs) -> tuple[float, float]:
    """Relative L2 error ``|d - w| / |w|`` and max ``|d - w|`` over ``(w, d)`` pairs of row chunks
    (float64 sums, on the host or the device)."""
    err2 = ref2 = max_abs = 0.0
    for w, d in pairs:
        xp = formats.array_module(w)
        wf = w.astype(np.float64)
        diff = d.astype(np.float64) - wf
        err2 += float((diff * diff).sum())  # not vdot: BLAS threads would spin in every worker process
        ref2 += float((wf * wf).sum())
        max_abs = max(max_abs, float(xp.abs(diff).max())) if diff.size else max_abs
    return (float(np.sqrt(err2 / ref2)) if ref2 else 0.0), max_abs


def quantization_error(w, q: Nvfp4Tensor) -> tuple[float, float]:
    """`error_stats` of ``dequantize(q)`` (``q`` in the linear scale layout) against ``w``, one row
    chunk at a time: no whole-tensor temporary, on the host or the device."""
    k = w.shape[-1]
    w2, packed, scales = w.reshape(-1, k), q.packed.reshape(-1, k // 2), q.block_scales.reshape(-1, k // BLOCK_SIZE)

    def rows(r: slice):
        part = Nvfp4Tensor(packed[r], scales[r], q.global_scale, q.scale_layout, (len(packed[r]), k))
        return w2[r], dequantize(part)

    return error_stats(rows(r) for r in _row_chunks(w2))


def _output_names(count: int) -> list[str]:
    if count == 1:
        return [checkpoint.SINGLE_FILE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _check_output(out: Path) -> None:
    """Refuse an OUT that is a file or already holds a checkpoint (before anything is written)."""
    if out.suffix == ".safetensors":
        raise ValueError(f"{out}: OUT must be a folder (it receives model.safetensors and {checkpoint.QUANT_CONFIG_NAME})")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: OUT exists and is not a folder")
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise ValueError(f"{out}: already holds *.safetensors files; choose an empty or new folder")


#: weight files of other formats that are not copied next to the NVFP4 checkpoint
_OTHER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def side_files(src: Path) -> tuple[list[Path], list[Path]]:
    """The files of an input folder and its subfolders that ``quantize`` copies (config, tokenizer,
    a sentence-transformers ``1_Pooling/config.json``, ...) and the weight files it does not copy
    (other formats at the top; any weights in subfolders, which are not quantized), both relative
    to ``src``. The input's own shards, index and ``hf_quant_config.json`` are neither; hidden
    files and folders (``.git/``, ``.cache/``) are skipped."""
    if not src.is_dir():
        return [], []
    copy, skip = [], []
    for p in sorted(src.rglob("*")):
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(src).parts):
            continue
        rel = p.relative_to(src)
        top = len(rel.parts) == 1
        weights = p.suffix in _OTHER_WEIGHT_SUFFIXES or p.name.endswith(".index.json")
        if top and (p.suffix == ".safetensors" or p.name == checkpoint.INDEX_NAME or p.name == checkpoint.QUANT_CONFIG_NAME):
            continue  # the input checkpoint itself
        (skip if weights else copy).append(rel)
    return copy, skip


@dataclass
class _Summary:
    rows: list[list[str]] = field(default_factory=list)
    bytes_before: int = 0  # tensor data of the quantized tensors, before and after
    bytes_after: int = 0


def _quantize_shard(f: checkpoint.SafetensorsFile, plan: Plan, input_scales: dict, device: str, bar: tqdm,
                    summary: _Summary) -> tuple[dict, dict]:
    """The output tensors and metadata of one input shard (its tensors read one at a time)."""
    quantized = set(plan.quantized)
    weights, extra = {}, {}
    for name in f.tensors:
        bar.set_postfix_str(name[-60:], refresh=False)
        w = f.read(name)
        if name in quantized:
            q, rel, max_abs = _quantize_one(name, w, device)
            weights[name.removesuffix(".weight")] = q
            row = _summary_row(name, w, q, rel, max_abs)
            summary.rows.append(row)
            summary.bytes_before += w.nbytes
            summary.bytes_after += q.packed.nbytes + q.block_scales.nbytes + 4  # + the fp32 weight_scale_2
        else:
            extra[name] = w
        bar.update(1)
    scales = {p: input_scales[p] for p in weights if p in input_scales}
    return checkpoint.to_modelopt_tensors(weights, input_scales=scales, extra=extra)


def cmd_quantize(args) -> int:
    src = checkpoint.CheckpointFiles(args.input)
    if src.layout != "plain":
        raise ValueError(f"{args.input}: already holds {src.layout} NVFP4 tensors; expected a bf16/fp16/fp32 model")
    out = Path(args.output)
    _check_output(out)
    device = _resolve_device(args.device)
    plan = plan_quantization(src, Selection(args.include, args.exclude))
    input_scales = read_calibration(args.calibrate, plan, src) if args.calibrate else {}
    copy, skip = side_files(Path(args.input))
    names = _output_names(len(src.files))
    summary = _Summary()
    weight_map, total_size = {}, 0
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        # shards are written to a staging folder and moved into OUT only when all of them succeeded
        staging = Path(tempfile.mkdtemp(prefix=".fp4kit-staging-", dir=out))
        try:
            with progress(len(src.where)) as bar:
                for f, out_name in zip(src.files, names):
                    tensors, metadata = _quantize_shard(f, plan, input_scales, device, bar, summary)
                    checkpoint.write_safetensors(staging / out_name, tensors, metadata)
                    weight_map.update(dict.fromkeys(tensors, out_name))
                    total_size += sum(t.nbytes for t in tensors.values())
                    del tensors
            for out_name in names:
                os.replace(staging / out_name, out / out_name)
                written.append(out / out_name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if len(names) > 1:
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            written.append(out / checkpoint.INDEX_NAME)
            written[-1].write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for rel in copy:  # before the quant config, which sets config.json's quantization_config
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            written.append(out / rel)
            shutil.copy2(Path(args.input) / rel, out / rel)
        written.append(out / checkpoint.QUANT_CONFIG_NAME)
        checkpoint.write_quant_config(out, [n.removesuffix(".weight") for n in plan.quantized], input_scales,
                                      plan.exclude_modules)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for path in written:
                path.unlink(missing_ok=True)
        raise
    size_before = sum(f.size for f in src.files)
    size_after = sum((out / n).stat().st_size for n in names)
    _print_quantize_summary(summary, plan, src, out, device, size_before, size_after, copy, skip)
    if input_scales:
        print(f"input scales from --calibrate for {len(input_scales)} of {len(plan.quantized)} quantized layer(s)"
              + ("" if len(input_scales) == len(plan.quantized) else "; the others are weight-only"))
    return 0


def _summary_row(name: str, w: np.ndarray, q: Nvfp4Tensor, rel: float, max_abs: float) -> list[str]:
    after = q.packed.nbytes + q.block_scales.nbytes + 4  # + the fp32 weight_scale_2
    return [name, _shape(w.shape), f"{rel:.3e}", f"{max_abs:.3e}", f"{w.nbytes:,}", f"{after:,}"]


def _ratio(before: int, after: int) -> str:
    return f" ({before / after:.2f}x smaller)" if after else ""


def _print_quantize_summary(summary: _Summary, plan: Plan, src: checkpoint.CheckpointFiles, out: Path, device: str,
                            size_before: int, size_after: int, copied: list[Path], not_copied: list[Path]) -> None:
    headers = ["tensor", "shape", "rel L2 err", "max abs err", "bytes before", "bytes after"]
    print(format_table(headers, summary.rows))
    if plan.kept:
        print(f"\nkept as they are ({len(plan.kept)} tensor(s); the *.weight ones are listed in exclude_modules):")
        info = {name: f.tensors[name] for name, f in src.where.items()}
        print(format_table(["tensor", "dtype", "shape", "reason"],
                           [[n, info[n].dtype, _shape(info[n].shape), why] for n, why in plan.kept.items()]))
    if copied:
        print(f"\ncopied {len(copied)} other file(s): {', '.join(p.as_posix() for p in copied)}")
    if not_copied:
        print(f"not copied ({len(not_copied)} weight file(s) of other formats or of subfolders): "
              f"{', '.join(p.as_posix() for p in not_copied)}")
    print(f"\nquantized {len(summary.rows)} tensor(s) on {device}: {summary.bytes_before:,} -> "
          f"{summary.bytes_after:,} bytes{_ratio(summary.bytes_before, summary.bytes_after)}")
    print(f"checkpoint: {size_before:,} -> {size_after:,} bytes of safetensors files"
          f"{_ratio(size_before, size_after)}; wrote {out}")


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------

#: the record of a conversion in progress or done, inside OUT: the input shards and each output
#: shard written, so a run that stopped resumes at the first shard not yet written
CONVERT_STATE = ".fp4kit-convert.json"


def _convert_state(out: Path, inputs: dict[str, int]) -> dict:
    """The record of an earlier run into ``out`` of the same input, or a new one; refuses an OUT
    holding shards of another run or of another input."""
    path = out / CONVERT_STATE
    if path.is_file():
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("inputs") != inputs:
            raise ValueError(f"{out}: holds a conversion of another input ({CONVERT_STATE}); choose another OUT")
        return state
    _check_output(out)
    return {"inputs": inputs, "done": {}}


def _shard_is_complete(path: Path, record: dict) -> bool:
    """``path`` is the output shard ``record`` describes: the same size and tensor names (its header
    validated)."""
    if not path.is_file() or path.stat().st_size != record["size"]:
        return False
    try:
        return sorted(checkpoint.SafetensorsFile(path).tensors) == sorted(record["names"])
    except (ValueError, OSError):
        return False


def _deepseek_sources(src: checkpoint.CheckpointFiles) -> dict:
    """The official quantized weights of ``src`` (`fp4kit.checkpoint.deepseek.find_sources`)."""
    from .checkpoint import deepseek

    return deepseek.find_sources({name: (f.tensors[name].dtype, f.tensors[name].shape) for name, f in src.where.items()})


def _uploader(device: str):
    """What moves a converted weight's source bytes to ``device``: ``cupy.asarray`` or None (host)."""
    if device == "cpu":
        return None
    import cupy

    return cupy.asarray


#: tensors a job reads ahead of the one it converts (a V4-Flash expert is 4 MB, an FP8 linear up to 32 MB)
CONVERT_READ_AHEAD = 4
FP8_WARM_ROWS = 128  # the CUDA start's FP8 weight: [128, 256], two 128 x 128 blocks


def _warm_conversion(device: str) -> None:
    """A small FP8 weight through the conversion on ``device``: the CUDA context and every kernel
    an FP8 conversion launches (lookup, block scaling, NaN and finite checks, quantize, error)."""
    import ml_dtypes

    from .checkpoint import deepseek

    codes = np.full((FP8_WARM_ROWS, 2 * FP8_WARM_ROWS), 0x38, np.uint8).view(ml_dtypes.float8_e4m3fn)  # 1.0
    scale = np.full((1, 2), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)  # 2^0
    src = deepseek.Source("warm-up", "fp8-ue8m0", "warm-up.scale")
    deepseek.convert_weight(src, codes, scale, lambda where, w: _quantize_one(where, w, device)[:2],
                            upload=_uploader(device))


def _touch_pages(a: np.ndarray) -> None:
    """Reads one byte of each 4 KiB page of ``a`` (an array over a memory map): the page faults and
    any disk reads happen here, not in the conversion."""
    flat = a.reshape(-1).view(np.uint8)
    if flat.size:
        int(flat[::4096].max())


class _DeviceStart:
    """A job's CUDA start-up (context, kernel loads: seconds in a fresh process) on a thread, while
    the host work of its first shard (reading, the exact MXFP4 re-encode) runs; `wait` before the
    first use of the device. A failure here is left to that first use to report."""

    def __init__(self, device: str):
        self._thread = None
        if device != "cpu":
            self._thread = threading.Thread(target=self._start, args=(device,), name="fp4kit-cuda-start", daemon=True)
            self._thread.start()

    @staticmethod
    def _start(device: str) -> None:
        with contextlib.suppress(Exception):
            _warm_conversion(device)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _ConvertJob:
    """The conversion of shards by one job (a thread, or a worker process with ``--jobs`` above 1):
    the input's headers and quantized weights are read once per job, not once per shard. Called with
    ``(index, out_name)``, it converts input shard ``index`` in memory (reading ahead on a thread)
    and returns what writes it into ``out/out_name`` (whole, as ``.partial`` then renamed) and gives
    its record for `CONVERT_STATE` and a line for the log."""

    def __init__(self, src_path: str, out: str, device: str):
        self.src = checkpoint.CheckpointFiles(src_path)
        self.sources = _deepseek_sources(self.src)
        self.consumed = {s.scale_name for s in self.sources.values()}
        self.out, self.device = Path(out), device
        self._device_start = _DeviceStart(device)
        self._upload = None if device == "cpu" else self._upload_after_start

    def _upload_after_start(self, a):
        """``cupy.asarray(a)`` once the CUDA start has finished (its wait counted in the log)."""
        t = time.perf_counter()
        self._device_start.wait()
        self._spent["device start"] += time.perf_counter() - t
        return _uploader(self.device)(a)

    def _needs_device(self, name: str) -> bool:
        s = self.sources.get(name)
        return s is not None and s.format != "mxfp4"

    def __call__(self, task: tuple[int, str]):
        from .checkpoint import deepseek

        index, out_name = task
        f = self.src.files[index]
        t0 = time.perf_counter()
        spent = self._spent = dict.fromkeys(("read", "convert", "quantize", "device start", "write"), 0.0)

        @contextlib.contextmanager
        def timed(part: str):
            t = time.perf_counter()
            yield
            spent[part] += time.perf_counter() - t

        def quantize(where, w):  # the FP8 (or re-quantized) weights, on ``device``
            with timed("quantize"):
                return _quantize_one(where, w, self.device)[:2]

        maps = {}  # the input files' tensors over memory maps: no copy, pages read ahead by the system

        def tensor(file, name):
            if file.path not in maps:
                maps[file.path] = file.map()
            return maps[file.path][name]

        def read(name):  # on the read-ahead thread: the pages in memory before the conversion touches them
            with timed("read"):
                s = self.sources.get(name)
                value = tensor(f, name) if s is None else (tensor(f, name), tensor(self.src.where[s.scale_name], s.scale_name))
                for a in value if s is not None else (value,):
                    _touch_pages(a)
                return value

        names = [n for n in f.tensors if n not in self.consumed]
        # the host's own work first (copies, exact MXFP4), then the FP8 weights: a job's first shard
        # runs it while CUDA starts. The file is written in the input's order whatever this order.
        order = sorted(names, key=self._needs_device)
        converted, extra = {}, {}
        with ReadAhead(order, read, depth=CONVERT_READ_AHEAD) as reader:
            for name, value in reader:
                if name not in self.sources:
                    extra[name] = value
                    continue
                with timed("convert"):
                    converted[name] = deepseek.convert_weight(self.sources[name], *value, quantize, upload=self._upload)
                del value
        done = [converted[n] for n in names if n in converted]
        weights = {c.prefix: c.weight for c in done}
        rows = [[n, _shape(c.weight.shape), c.source, c.method, "" if c.spread is None else str(c.spread),
                 f"{c.rel_error:.3e}"] for n, c in zip((n for n in names if n in converted), done)]
        with timed("convert"):
            tensors, metadata = checkpoint.to_modelopt_tensors(weights, extra={n: extra[n] for n in names if n in extra})
        maps.clear()  # the arrays still in use (codes kept, tensors copied) hold their maps
        quantized = sorted(c.prefix for c in done)
        summary = f"{len(rows)} weight(s) converted, {len(names) - len(rows)} tensor(s) copied"
        del converted, done, extra, weights
        return functools.partial(self._write, out_name, tensors, metadata, rows, quantized, summary, f.size, t0, spent)

    def _write(self, out_name, tensors, metadata, rows, quantized, summary, size, t0, spent) -> dict:
        """On the write-behind thread."""
        target = self.out / out_name
        t = time.perf_counter()
        partial = target.with_name(out_name + ".partial")
        checkpoint.write_safetensors(partial, tensors, metadata)
        os.replace(partial, target)
        spent["write"] = time.perf_counter() - t
        seconds = time.perf_counter() - t0
        start = f", waited {spent['device start']:.2f} s for the CUDA start" if spent["device start"] >= 0.005 else ""
        line = (f"{out_name}: {summary}, {size / 1e9:.3f} GB in {seconds:.1f} s "
                f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s: read {spent['read']:.2f} s, convert "
                f"{spent['convert']:.2f} s of which quantize {spent['quantize']:.2f} s{start}, "
                f"write {spent['write']:.2f} s)")
        record = {"size": target.stat().st_size, "names": sorted(tensors), "quantized": quantized,
                  "rows": rows}
        return {"record": record, "log": line, "bytes": size}


def cmd_convert(args) -> int:
    src = checkpoint.CheckpointFiles(args.input)
    if src.layout != "plain":
        raise ValueError(f"{args.input}: already holds {src.layout} NVFP4 tensors; expected an official DeepSeek checkpoint")
    if not _deepseek_sources(src):  # also checks every scale
        raise ValueError(f"{args.input}: no DeepSeek FP8 or FP4 weight found (a P.weight with a P.scale or a "
                         "P.weight_scale_inv)")
    if args.jobs < 1:
        raise ValueError(f"--jobs: expected a positive number of worker processes, got {args.jobs}")
    out = Path(args.output)
    device = _resolve_device(args.device)
    names = _output_names(len(src.files))
    state = _convert_state(out, {f.path.name: f.size for f in src.files})
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for index, out_name in enumerate(names):
        record = state["done"].get(out_name)
        if record is not None and _shard_is_complete(out / out_name, record):
            print(f"{out_name}: converted by an earlier run, kept", flush=True)
        else:
            todo.append((index, out_name))

    start, converted_bytes = time.perf_counter(), 0
    with tqdm(total=len(todo), unit="shard", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:

        def finished(task: tuple[int, str], result: dict) -> None:
            """A shard whose file is complete and in place (shards finish in any order with several jobs)."""
            nonlocal converted_bytes
            out_name = task[1]
            print(result["log"], flush=True)
            state["done"][out_name] = result["record"]
            state["done"] = dict(sorted(state["done"].items()))  # the same record whatever the order
            (out / CONVERT_STATE).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")  # after each shard
            converted_bytes += result["bytes"]
            bar.update(1)

        # one job converts on a thread of this process; several in spawned worker processes, each
        # converting a shard while its previous one is written (at most two shards in memory per job)
        run_jobs(todo, args.jobs, functools.partial(_ConvertJob, str(src.path), str(out), device), finished)
    if len(names) > 1:
        weight_map = {t: n for n in names for t in state["done"][n]["names"]}
        total = sum(state["done"][n]["size"] for n in names)
        (out / checkpoint.INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n", encoding="utf-8")
    copy, skip = side_files(Path(args.input))
    for rel in copy:  # before the quant config, which sets config.json's quantization_config
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(args.input) / rel, out / rel)
    quantized = sorted(p for n in names for p in state["done"][n]["quantized"])
    checkpoint.write_quant_config(out, quantized)
    rows = [r for n in names for r in state["done"][n]["rows"]]
    print(format_table(["tensor", "shape", "source", "method", "exponent spread", "rel L2 err"], rows))
    exact = sum(r[3] == "exact" for r in rows)
    requant = [r[0] for r in rows if r[3] == "re-quantized"]
    print(f"\n{len(rows)} weight(s) to NVFP4: {exact} MXFP4 exactly (every value kept), "
          f"{len(requant)} MXFP4 re-quantized (exponent spread above 17), "
          f"{sum(r[3] == 'quantized' for r in rows)} FP8 quantized; the other tensors copied")
    if requant:
        print("re-quantized: " + ", ".join(requant))
    seconds = time.perf_counter() - start
    if converted_bytes:
        print(f"converted {converted_bytes / 1e9:.3f} GB of input in {seconds:.1f} s "
              f"({converted_bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s, {device}, {args.jobs} job(s))")
    if skip:
        print(f"not copied: {', '.join(p.as_posix() for p in skip)}")
    return 0


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def _block_scale_stats(scales: np.ndarray) -> tuple[str, str, int]:
    """min and max of the non-zero block-scale values, and the number of zero-scale blocks."""
    values = formats.E4M3_VALUES[scales.reshape(-1)]
    nonzero = values[values != 0]
    zero = int(values.size - nonzero.size)
    if not nonzero.size:
        return "-", "-", zero
    return f"{float(nonzero.min()):.6g}", f"{float(nonzero.max()):.6g}", zero


def cmd_inspect(args) -> int:
    ckpt = checkpoint.CheckpointFiles(args.path)
    total = sum(f.size for f in ckpt.files)
    print(f"checkpoint: {args.path}")
    print(f"files: {len(ckpt.files)} ({total:,} bytes)")
    print(f"layout: {ckpt.layout}")
    if ckpt.quant_config is not None:
        quant = ckpt.quant_config.get("quantization", {})
        producer = ckpt.quant_config.get("producer", {})
        print(
            f"{checkpoint.QUANT_CONFIG_NAME}: quant_algo {quant.get('quant_algo')}, group_size "
            f"{quant.get('group_size')}, producer {producer.get('name')} {producer.get('version')}, "
            f"exclude_modules {quant.get('exclude_modules', [])}"
        )
    tensor_rows = [[name, f.tensors[name].dtype, _shape(f.tensors[name].shape), f"{f.tensors[name].nbytes:,}"]
                   for name, f in ckpt.where.items()]
    print(f"\ntensors ({len(tensor_rows)}):")
    print(format_table(["name", "dtype", "shape", "bytes"], tensor_rows))
    if ckpt.quantized:
        print(f"\nquantized prefixes ({len(ckpt.quantized)}):")
        print(format_table(
            ["prefix", "N", "K", "global scale S", "decode 1/S", "input S_a", "min scale", "max scale", "zero blocks"],
            [_quantized_row(ckpt, q) for q in ckpt.quantized.values()],
        ))
    tensor_bytes = sum(f.tensors[name].nbytes for name, f in ckpt.where.items())
    print(f"\ntotal: {tensor_bytes:,} bytes of tensor data in {len(ckpt.where)} tensors")
    return 0


def _quantized_row(ckpt: checkpoint.CheckpointFiles, q: checkpoint.QuantizedPrefix) -> list[str]:
    info = ckpt.where[q.packed].tensors[q.packed]
    n = "x".join(str(s) for s in info.shape[:-1])
    scales = ckpt.read_block_scales(q)
    stored, s = ckpt.read_scale(q.global_scale, q.layout, all_zero=not scales.any())
    # the decode scale as a ModelOpt file stores it; compressed-tensors stores S itself
    decode = stored if checkpoint.LAYOUTS[q.layout].stores_decode else checkpoint.decode_scale(s)
    s_a = ckpt.read_input_scale(q)
    lo, hi, zero = _block_scale_stats(scales)
    return [q.prefix, n, str(2 * info.shape[-1]), f"{float(s):.9g}", f"{float(decode):.9g}",
            "-" if s_a is None else f"{float(s_a):.9g}", lo, hi, str(zero)]


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: the CUDA quantizer; cpu: the numpy reference (bit-identical); auto: cuda if available")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4kit", description="NVFP4 checkpoints: quantize, convert and inspect.")
    parser.add_argument("--version", action="version", version=f"fp4kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser(
        "quantize",
        help="quantize a bf16/fp16/fp32 safetensors model to an NVFP4 (ModelOpt layout) checkpoint",
        description=(
            "Quantize the 2-D *.weight tensors (K a multiple of 16) of a safetensors model to NVFP4, "
            "leaving embeddings, norms and MoE routers as they are, and write a ModelOpt-layout "
            "checkpoint (model.safetensors + hf_quant_config.json) to the folder OUT. lm_head is "
            "quantized unless excluded (--exclude lm_head keeps it in its dtype, as ModelOpt does)."
        ),
    )
    q.add_argument("input", metavar="IN", help="a .safetensors file or a folder of shards")
    q.add_argument("output", metavar="OUT", help="output folder (created; must hold no .safetensors yet)")
    q.add_argument("--include", type=_regex, metavar="REGEX",
                   help="quantize the 2-D *.weight tensors whose name matches (replaces the default name rule)")
    q.add_argument("--exclude", type=_regex, metavar="REGEX",
                   help="keep tensors whose name matches unquantized (e.g. 'lm_head')")
    q.add_argument("--calibrate", metavar="FILE",
                   help="a safetensors file of sample inputs [..., K] per quantized layer (by module name): "
                        "writes each one's static activation scale (input_scale) from their amax")
    _device_argument(q)
    q.set_defaults(run=cmd_quantize)

    c = sub.add_parser(
        "convert",
        help="convert an official DeepSeek-V4 (FP8 + MXFP4) or V3/R1 (FP8) checkpoint to NVFP4",
        description=(
            "Convert the FP8 weights (128 x 128 block scales: UE8M0 in V4, fp32 weight_scale_inv in V3) "
            "and the MXFP4 experts (V4: UE8M0 scale per 32) of an official DeepSeek checkpoint to NVFP4, "
            "shard by shard, into a ModelOpt-layout checkpoint in the folder OUT; every other tensor is "
            "copied. MXFP4 tensors whose block-exponent spread is at most 17 convert exactly; the others, "
            "and the FP8 weights, are quantized with fp4kit.quantize. A run that stopped resumes: shards "
            "already written and verified are kept."
        ),
    )
    c.add_argument("input", metavar="IN", help="the official checkpoint: a .safetensors file or a folder of shards")
    c.add_argument("output", metavar="OUT", help="output folder (created; resumed if it holds this conversion)")
    _device_argument(c)
    c.add_argument("--jobs", type=int, default=1,
                   help="shards converted at once, in worker processes (each holds at most two shards' output: one "
                        "being written while the next converts)")
    c.set_defaults(run=cmd_convert)

    i = sub.add_parser("inspect", help="print what an NVFP4 or plain safetensors checkpoint holds")
    i.add_argument("path", metavar="PATH", help="a .safetensors file or a folder of shards")
    i.set_defaults(run=cmd_inspect)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``fp4kit`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"fp4kit {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
