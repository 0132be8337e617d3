"""The ``fp4kit`` command: ``quantize`` a safetensors model to NVFP4, ``inspect`` a checkpoint.

``fp4kit quantize IN OUT`` reads a bf16 / fp16 / fp32 model (a ``.safetensors`` file or a folder
of shards), quantizes the selected weights with `fp4kit.quantize` (the CUDA kernels with
``--device cuda``, the numpy reference with ``--device cpu``; the bytes are the same) and writes
a ModelOpt-layout NVFP4 checkpoint to the folder OUT: ``model.safetensors`` (or one output shard
per input shard plus ``model.safetensors.index.json``) and ``hf_quant_config.json``. Other files
of an input folder (``config.json``, tokenizer files, ...) are copied unchanged; weights in other
formats (``*.bin``, ...) are not. Input shards are processed one at a time, tensors read one at a
time, so memory holds at most one shard's output. Shards are staged and moved into OUT only when
every tensor succeeded: a failure (e.g. a weight holding NaN) leaves no partial checkpoint.

Default selection: a tensor is quantized when it is a 2-D bf16 / fp16 / fp32 tensor named
``*.weight`` whose last dimension is a multiple of 16 and whose name does not match
`DEFAULT_SKIP` (embeddings, norms, MoE routers). ``lm_head`` is quantized by default; add
``--exclude lm_head`` to keep it in bf16 as ModelOpt's default recipe does. ``--include REGEX``
replaces the name rule (the shape rule still applies); ``--exclude REGEX`` removes more names.
Everything not selected is copied as it is; the selectable-by-shape ``*.weight`` tensors left out
are listed in ``exclude_modules``.

``fp4kit inspect PATH`` prints the layout, every tensor (dtype, shape, bytes) and, for each
quantized prefix, N, K, the global scale and block-scale statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__, checkpoint, formats
from .formats import BLOCK_SIZE, Nvfp4Tensor
from .ops.quant import dequantize, quantize
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
_ROW_CHUNK_ELEMENTS = 1 << 22  # error statistics are accumulated over row chunks of this size


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which tensors ``fp4kit quantize`` quantizes (see the module docstring)."""

    include: re.Pattern | None = None
    exclude: re.Pattern | None = None

    @staticmethod
    def shape_allows(info: checkpoint.TensorInfo) -> bool:
        """A 2-D float ``*.weight`` with K a multiple of 16 and at least one element."""
        return (
            info.name.endswith(".weight")
            and info.dtype in _QUANTIZABLE_DTYPES
            and len(info.shape) == 2
            and info.shape[1] % BLOCK_SIZE == 0
            and info.shape[0] * info.shape[1] > 0
        )

    def __call__(self, info: checkpoint.TensorInfo) -> bool:
        if not self.shape_allows(info):
            return False
        named = self.include.search(info.name) if self.include else not _DEFAULT_SKIP.search(info.name)
        return bool(named) and not (self.exclude and self.exclude.search(info.name))


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a valid regular expression: {text!r} ({e})") from None


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a text stream: ``[#####.....] 12/40 name``."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.done, self.width = total, 0, width
        self.stream = sys.stderr if stream is None else stream

    def advance(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[-60:]:<60}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


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


def _quantize_one(name: str, w: np.ndarray, device: str) -> tuple[Nvfp4Tensor, np.ndarray]:
    """NVFP4 of ``w`` and its fp32 dequantization, both on the host."""
    bad = w.size - int(np.count_nonzero(np.isfinite(w)))
    if bad:
        raise ValueError(f"{name}: holds {bad} non-finite value(s); refusing to quantize it")
    if device == "cpu":
        q = quantize(w)
        return q, dequantize(q)
    import cupy

    q = quantize(cupy.asarray(w))
    host = Nvfp4Tensor(q.packed.get(), q.block_scales.get(), q.global_scale.get(), q.scale_layout, q.shape)
    return host, dequantize(q).get()


def error_stats(w: np.ndarray, d: np.ndarray) -> tuple[float, float]:
    """Relative L2 error ``|d - w| / |w|`` and max ``|d - w|`` (float64 sums over row chunks)."""
    w2, d2 = w.reshape(-1, w.shape[-1]), d.reshape(-1, w.shape[-1])
    step = max(1, _ROW_CHUNK_ELEMENTS // max(w2.shape[1], 1))
    err2 = ref2 = max_abs = 0.0
    for r in range(0, w2.shape[0], step):
        wf = w2[r : r + step].astype(np.float64)
        diff = d2[r : r + step].astype(np.float64) - wf
        err2 += float(np.vdot(diff, diff))
        ref2 += float(np.vdot(wf, wf))
        max_abs = max(max_abs, float(np.abs(diff).max(initial=0.0)))
    return (float(np.sqrt(err2 / ref2)) if ref2 else 0.0), max_abs


def _output_names(count: int) -> list[str]:
    if count == 1:
        return [checkpoint.SINGLE_FILE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _prepare_output(out: Path) -> None:
    if out.suffix == ".safetensors":
        raise ValueError(f"{out}: OUT must be a folder (it receives model.safetensors and {checkpoint.QUANT_CONFIG_NAME})")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: OUT exists and is not a folder")
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise ValueError(f"{out}: already holds *.safetensors files; choose an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)


#: weight files of other formats that are not copied next to the NVFP4 checkpoint
_OTHER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def _copy_side_files(src: Path, out: Path) -> None:
    """Copy the non-weight files of an input folder (config, tokenizer, ...)."""
    if not src.is_dir():
        return
    for p in sorted(src.iterdir()):
        weights = p.suffix in _OTHER_WEIGHT_SUFFIXES or p.name.endswith(".index.json")
        if p.is_file() and not weights and p.name != checkpoint.QUANT_CONFIG_NAME:
            shutil.copy2(p, out / p.name)


@dataclass
class _Summary:
    rows: list[list[str]]
    excluded: list[str]


def _quantize_shard(f: checkpoint.SafetensorsFile, select: Selection, device: str, progress: Progress,
                    summary: _Summary) -> tuple[dict, dict]:
    """The output tensors and metadata of one input shard (its tensors read one at a time)."""
    weights, extra = {}, {}
    for name, info in f.tensors.items():
        progress.advance(name)
        w = f.read(name)
        if not select(info):
            extra[name] = w
            if Selection.shape_allows(info):
                summary.excluded.append(name.removesuffix(".weight"))
            continue
        q, d = _quantize_one(name, w, device)
        weights[name.removesuffix(".weight")] = q
        summary.rows.append(_summary_row(name, w, q, d))
    return checkpoint.to_modelopt_tensors(weights, extra=extra)


def cmd_quantize(args) -> int:
    src = checkpoint.CheckpointFiles(args.input)
    if src.layout != "plain":
        raise ValueError(f"{args.input}: already holds {src.layout} NVFP4 tensors; expected a bf16/fp16/fp32 model")
    out = Path(args.output)
    _prepare_output(out)
    device = _resolve_device(args.device)
    select = Selection(args.include, args.exclude)
    names = _output_names(len(src.files))
    summary = _Summary([], [])
    weight_map, total_size = {}, 0
    # shards are written to a staging folder and moved into OUT only when all of them succeeded
    staging = Path(tempfile.mkdtemp(prefix=".fp4kit-staging-", dir=out))
    progress = Progress(len(src.where))
    try:
        for f, out_name in zip(src.files, names):
            tensors, metadata = _quantize_shard(f, select, device, progress, summary)
            checkpoint.write_safetensors(staging / out_name, tensors, metadata)
            weight_map.update(dict.fromkeys(tensors, out_name))
            total_size += sum(t.nbytes for t in tensors.values())
            del tensors
        for out_name in names:
            os.replace(staging / out_name, out / out_name)
    finally:
        progress.close()
        shutil.rmtree(staging, ignore_errors=True)
    if len(names) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    checkpoint.write_quant_config(out, summary.excluded)
    _copy_side_files(Path(args.input), out)
    _print_quantize_summary(summary.rows, out, device)
    return 0


def _summary_row(name: str, w: np.ndarray, q: Nvfp4Tensor, d: np.ndarray) -> list[str]:
    rel, max_abs = error_stats(w, d)
    after = q.packed.nbytes + q.block_scales.nbytes + 4  # + the fp32 weight_scale_2
    return [name, _shape(w.shape), f"{rel:.3e}", f"{max_abs:.3e}", f"{w.nbytes:,}", f"{after:,}"]


def _print_quantize_summary(rows: list[list[str]], out: Path, device: str) -> None:
    headers = ["tensor", "shape", "rel L2 err", "max abs err", "bytes before", "bytes after"]
    if rows:
        print(format_table(headers, rows))
    before = sum(int(r[4].replace(",", "")) for r in rows)
    after = sum(int(r[5].replace(",", "")) for r in rows)
    ratio = f" ({before / after:.2f}x smaller)" if after else ""
    print(f"quantized {len(rows)} tensor(s) on {device}: {before:,} -> {after:,} bytes{ratio}; wrote {out}")


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
    s = ckpt.read_global_scale(q)
    s_a = ckpt.read_input_scale(q)
    lo, hi, zero = _block_scale_stats(ckpt.read_block_scales(q))
    return [q.prefix, n, str(2 * info.shape[-1]), f"{float(s):.9g}", f"{float(checkpoint.decode_scale(s)):.9g}",
            "-" if s_a is None else f"{float(s_a):.9g}", lo, hi, str(zero)]


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4kit", description="NVFP4 checkpoints: quantize and inspect.")
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
    q.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: the CUDA kernels; cpu: the numpy reference (bit-identical); auto: cuda if available")
    q.set_defaults(run=cmd_quantize)

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
