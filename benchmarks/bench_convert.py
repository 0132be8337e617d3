"""Benchmark: `fp4kit convert` throughput, in GB of official checkpoint read per second.

Writes a synthetic checkpoint in the official DeepSeek-V4 format at V4-Flash layer widths (per
layer: the attention projections in FP8 with UE8M0 128 x 128 scales, ``--experts`` routed experts
in MXFP4 with a UE8M0 scale per 32, the shared expert in FP8), one shard per layer, into a
temporary folder, converts it with the CLI on the chosen device and reports input GB/s per shard
and in total, next to the disk's own rates: reading the same files, and writing the converted
output's bytes with as many writers as jobs (the floor the write stage stands on). Target (not a test): >= 2 GB/s
on the GPU, bounded by the disk. Each shard's log line says where its time went (read, convert and
of that the quantization, write; a job reads ahead and writes behind on threads, so these overlap),
and the table gives their medians over the shards after each job's first, whose time includes its
process and CUDA start. A run whose input and output the temporary folder's file system cannot hold
(about 2.1 times the input) is refused before anything is written.

    .venv/bin/python benchmarks/bench_convert.py [--layers 2] [--experts 32] [--device cpu|cuda] [--jobs 4]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from fp4kit import checkpoint
from fp4kit.cli import main as fp4kit_main

try:
    from benchmarks.common import Table
except ImportError:
    from common import Table

HIDDEN, INNER, Q_RANK, O_RANK, HEADS, HEAD_DIM, O_GROUPS = 4096, 2048, 1024, 1024, 64, 512, 8


def _fp8(rng, n, k):
    codes = rng.integers(0, 0x7E, (n, k), dtype=np.uint8)  # E4M3 bytes without NaN
    codes |= rng.integers(0, 2, (n, k), dtype=np.uint8) << 7
    scales = rng.integers(110, 125, (-(-n // 128), -(-k // 128)), dtype=np.uint8)
    return codes.view(ml_dtypes.float8_e4m3fn), scales.view(ml_dtypes.float8_e8m0fnu)


def _mxfp4(rng, n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8).view(np.int8)
    scales = rng.integers(115, 128, (n, k // 32), dtype=np.uint8)
    return codes, scales.view(ml_dtypes.float8_e8m0fnu)


#: the FP8 weights of a layer (attention and shared expert, 128 x 128 block scales) and of each
#: routed expert in MXFP4 (a scale per 32), [N, K]
FP8_LINEARS = {"attn.wq_a": (Q_RANK, HIDDEN), "attn.wq_b": (HEADS * HEAD_DIM, Q_RANK), "attn.wkv": (HEAD_DIM, HIDDEN),
               "attn.wo_a": (O_GROUPS * O_RANK, HEADS * HEAD_DIM // O_GROUPS), "attn.wo_b": (HIDDEN, O_GROUPS * O_RANK),
               "ffn.shared_experts.w1": (INNER, HIDDEN), "ffn.shared_experts.w3": (INNER, HIDDEN),
               "ffn.shared_experts.w2": (HIDDEN, INNER)}
EXPERT_LINEARS = {"w1": (INNER, HIDDEN), "w3": (INNER, HIDDEN), "w2": (HIDDEN, INNER)}


def layer_bytes(experts: int) -> int:
    """Tensor bytes of one layer's shard as `write_checkpoint` writes it."""
    fp8 = sum(n * k + -(-n // 128) * -(-k // 128) for n, k in FP8_LINEARS.values())
    mxfp4 = sum(n * k // 2 + n * k // 32 for n, k in EXPERT_LINEARS.values())
    return fp8 + experts * mxfp4 + 2 * HIDDEN  # + the bf16 norm


def check_disk_space(folder: Path, layers: int, experts: int) -> None:
    """ValueError, before anything is written, where ``folder``'s file system cannot hold the run:
    the input beside the converted output, then beside the write-rate probe of the output's size
    (the output counted as 1.1 times the input: NVFP4 holds 4.5 bits a weight, MXFP4 4.25)."""
    need = int(2.1 * layers * layer_bytes(experts))
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ValueError(f"--layers {layers} --experts {experts}: the run needs about {need / 1e9:.1f} GB in "
                         f"{folder} (the input and the output), which has {free / 1e9:.1f} GB free; "
                         "use fewer layers or point TMPDIR at a larger file system")


def write_checkpoint(folder: Path, layers: int, experts: int, seed: int = 0) -> int:
    """One shard per layer; every layer holds the same random values (the conversion's work does not
    depend on them, and drawing 0.56 GB of random bytes per layer took longer than converting it)."""
    rng = np.random.default_rng(seed)
    layer = {}
    for name, (n, k) in FP8_LINEARS.items():
        layer[f"{name}.weight"], layer[f"{name}.scale"] = _fp8(rng, n, k)
    for e in range(experts):
        for name, (n, k) in EXPERT_LINEARS.items():
            layer[f"ffn.experts.{e}.{name}.weight"], layer[f"ffn.experts.{e}.{name}.scale"] = _mxfp4(rng, n, k)
    layer["attn_norm.weight"] = np.ones(HIDDEN, ml_dtypes.bfloat16)
    for i in range(layers):
        checkpoint.write_safetensors(folder / f"model-{i + 1:05d}-of-{layers:05d}.safetensors",
                                     {f"layers.{i}.{name}": t for name, t in layer.items()})
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def disk_read_gbps(folder: Path) -> float:
    start, total = time.perf_counter(), 0
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - start) / 1e9


def disk_write_gbps(folder: Path, nbytes: int, files: int) -> float:
    """The disk's own write rate for ``nbytes`` in ``files`` files written at once (one thread each,
    64 MB writes, closed but not synced, as the converter's jobs write their shards), in GB/s; the
    files are removed after."""
    from concurrent.futures import ThreadPoolExecutor

    chunk = memoryview(bytes(64 << 20))
    each = -(-nbytes // files)

    def write(i: int) -> None:
        left = each
        with open(folder / f"write-probe-{i}", "wb") as f:
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])

    start = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(write, range(files)))
    seconds = time.perf_counter() - start
    for i in range(files):
        (folder / f"write-probe-{i}").unlink()
    return each * files / seconds / 1e9


def warm_device_kernels(folder: Path) -> None:
    """Compile (or load from CuPy's on-disk cache) every kernel a CUDA conversion launches, so the
    timing is the conversion's and not a first run's compile (a warm cache, as after any earlier
    run): a miniature checkpoint (one FP8 linear, one MXFP4 expert, a norm) converted on the GPU
    in this process. Not only fp4kit's quantizer: the conversion's own CuPy arithmetic (the finite
    check, the blockwise dequantization, the MXFP4 exponent spread) is compiled on first use too,
    and the spawned workers read the same cache."""
    from fp4kit.runtime import device as runtime_device

    if runtime_device.unavailable_reason() is not None:
        return
    rng = np.random.default_rng(1)
    src, out = folder / "warm-src", folder / "warm-out"
    src.mkdir()
    t = {"layers.0.attn_norm.weight": np.ones(256, ml_dtypes.bfloat16)}
    t["layers.0.attn.wq_a.weight"], t["layers.0.attn.wq_a.scale"] = _fp8(rng, 256, 256)
    t["layers.0.ffn.experts.0.w1.weight"], t["layers.0.ffn.experts.0.w1.scale"] = _mxfp4(rng, 256, 256)
    checkpoint.write_safetensors(src / "model-00001-of-00001.safetensors", t)
    with contextlib.redirect_stdout(io.StringIO()):
        assert fp4kit_main(["convert", str(src), str(out), "--device", "cuda"]) == 0


_SHARD_LINE = re.compile(r"^model-\S+: .* in ([\d.]+) s \(.*read ([\d.]+) s, convert ([\d.]+) s of which quantize "
                         r"([\d.]+) s(?:, waited ([\d.]+) s for the CUDA start)?, write ([\d.]+) s\)", re.M)
STAGES = ("shard", "read", "convert", "quantize", "CUDA start", "write")


def stage_medians(log: str, jobs: int) -> dict[str, float]:
    """Median seconds per stage over the shards of ``log`` past the first ``jobs`` to finish (each
    job's first shard pays its start-up), or over all of them when there are no more."""
    shards = [[float(v or 0) for v in m.groups()] for m in _SHARD_LINE.finditer(log)]
    steady = shards[jobs:] or shards
    return {stage: statistics.median(s[i] for s in steady) for i, stage in enumerate(STAGES)} if steady else {}


class _Tee(io.TextIOBase):
    """What is printed, kept as well."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--jobs", type=int, default=1, help="shards converted at once (fp4kit convert --jobs)")
    args = ap.parse_args()
    if args.jobs > 1 and args.layers < 3 * args.jobs:
        print(f"note: {args.layers} shard(s) over {args.jobs} jobs: each spawned worker starts its interpreter and, on "
              "the GPU, CUDA and the kernels within its first shard; --layers >= 3 x --jobs shows the steady rate")
    try:
        check_disk_space(Path(tempfile.gettempdir()), args.layers, args.experts)
    except ValueError as e:
        ap.error(str(e))  # the usage and the reason, exit status 2, no traceback
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "official", Path(tmp) / "nvfp4"
        src.mkdir()
        size = write_checkpoint(src, args.layers, args.experts)
        disk = disk_read_gbps(src)
        if args.device != "cpu":
            warm_device_kernels(Path(tmp))
        tee = _Tee(sys.stdout)
        start = time.perf_counter()
        with contextlib.redirect_stdout(tee):
            assert fp4kit_main(["convert", str(src), str(out), "--device", args.device, "--jobs", str(args.jobs)]) == 0
        seconds = time.perf_counter() - start
        out_size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        shutil.rmtree(out)  # room for the probe: the disk holds the input and one output's bytes at a time
        # the same bytes written by as many writers as the run had jobs, on the same file system
        disk_write = disk_write_gbps(Path(tmp), out_size, min(args.jobs, args.layers))
    stages = stage_medians(tee.kept.getvalue(), args.jobs)
    table = Table("fp4kit convert, official DeepSeek-V4 format at V4-Flash widths",
                  ["layers", "experts per layer", "input GB", "output GB", "device", "jobs", "seconds", "GB/s",
                   "read GB/s", "write GB/s", "target", *(f"{stage} s" for stage in STAGES)])
    gbps = size / seconds / 1e9
    table.add(**{"layers": args.layers, "experts per layer": args.experts, "input GB": size / 1e9,
                 "output GB": out_size / 1e9, "device": args.device, "jobs": args.jobs, "seconds": seconds,
                 "GB/s": gbps, "read GB/s": disk, "write GB/s": disk_write,
                 "target": ">= 2 GB/s (GPU): " + ("met" if gbps >= 2 else "MISSED"),
                 **{f"{stage} s": v for stage, v in stages.items()}})
    print()
    print(table.markdown())
    print("saved", table.save("bench_convert", {"layers": args.layers, "experts": args.experts}))


if __name__ == "__main__":
    main()
