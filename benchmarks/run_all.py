"""Run every benchmark and gather the results into one dated report.

    .venv/bin/python benchmarks/run_all.py                      # every benchmarks/bench_*.py
    .venv/bin/python benchmarks/run_all.py --only quant,moe     # a subset (names without "bench_")
    .venv/bin/python benchmarks/run_all.py --from-existing      # assemble from results/bench_*.json, run nothing
    .venv/bin/python benchmarks/run_all.py --plot-only benchmarks/results/<date>-<gpu>.json

Each benchmark runs as its own subprocess with the repository on PYTHONPATH and writes its rows
through `common.Table.save`. A benchmark that fails (non-zero exit, or no JSON written) is
reported and the others still run; the runner then exits non-zero. The report is
``results/<YYYY-MM-DD>-<gpu-slug>.json`` (every row plus the run's metadata) and ``.md`` (one
table per benchmark); the plot (``.png``, matplotlib) is a separate step so that it can be drawn on
any machine from the JSON, and is attempted after a run when matplotlib is importable.

Multi-GPU benchmarks declare ``GPUS = <n>`` at module level (a literal int, read without
importing the script) and start their own worker processes. One that needs more GPUs than are
visible is skipped, and said so; ``--skip`` drops benchmarks by name.
"""

from __future__ import annotations

import argparse
import ast
import collections
import datetime
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"

# Dense bf16 tensor-core peak (TFLOP/s) by GPU-name fragment: the compute floor of GEMM rows.
# Unknown GPUs get the bandwidth floor only.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0}


# ---------------------------------------------------------------- achieved fraction of the floor

def _pct_of_copy(row, meta):
    v = row.get("% of copy BW")
    return None if v is None else v / 100


def _inverse_x_floor(row, meta):
    v = row.get("x floor")
    return None if not v else 1 / v


def _linear(row, meta):
    # roofline: the floor is the larger of the byte time and the flop time, so the achieved
    # fraction is the larger of the two fractions (prefill rows are compute bound); the byte time is
    # the streaming read of the weight measured in the same run where the row has one
    read = row.get("% of read floor")
    bw = read / 100 if isinstance(read, (int, float)) else _pct_of_copy(row, meta)
    peak = _bf16_peak(meta.get("device", ""))
    flops = row.get("TFLOP/s")
    compute = None if peak is None or flops is None else flops / peak
    return max((f for f in (bw, compute) if f is not None), default=None)


def _sampling(row, meta):
    # floor: reading the [batch, vocab] bf16 logits once at the copy bandwidth
    bw, vocab = meta.get("copy_bandwidth_Bps"), meta.get("vocab")
    if not (bw and vocab and row.get("µs") and row.get("batch")):
        return None
    return row["batch"] * vocab * 2 / bw * 1e6 / row["µs"]


def _parallel_efficiency(row, meta):
    # floor: perfect scaling, world_size GPUs doing world_size x T tokens in the time one does T
    speedup, world = row.get("speedup"), meta.get("world_size")
    return speedup / world if speedup and world else None


def _read_rate(row, meta):
    # floor: reading the input files (their rate from the page cache, measured in the same run)
    rate, read = row.get("GB/s"), row.get("read GB/s")
    return rate / read if rate and read else None


def _generic(row, meta):
    return _pct_of_copy(row, meta) if "% of copy BW" in row else _inverse_x_floor(row, meta)


FRACTION_OF_FLOOR = {
    "bench_quant": _pct_of_copy,          # "% of copy BW": bytes moved / time vs copy bandwidth
    "bench_attention": _pct_of_copy,      # idem; rows without it (torch.topk alone) are not plotted
    "bench_linear": _linear,              # max("% of read floor" or "% of copy BW", TFLOP/s / bf16 peak)
    "bench_moe": _inverse_x_floor,        # 1 / "x floor" (touched-expert byte floor)
    "bench_sampling": _sampling,          # logits bytes at the copy bandwidth / µs
    "bench_decode": _pct_of_copy,         # bytes the step must read / time vs copy bandwidth
    "bench_dist": _parallel_efficiency,   # speedup over one GPU on world x T tokens / world size
    "bench_convert": _read_rate,          # checkpoint GB/s / the rate of reading the same files
}


def _bf16_peak(device: str):
    return next((p for key, p in BF16_PEAK_TFLOPS.items() if key in device), None)


def fraction_of_floor(bench: str, row: dict, meta: dict):
    """The row's achieved fraction of its bandwidth or compute floor (1 = at the floor), or None."""
    value = FRACTION_OF_FLOOR.get(bench, _generic)(row, meta)
    return value if value is not None and math.isfinite(value) and value > 0 else None


# ---------------------------------------------------------------- discovery and running

def discover(only=None, skip=(), bench_dir: Path = BENCH_DIR) -> list[Path]:
    """bench_dir/bench_*.py, filtered by short names ("quant" or "bench_quant")."""
    scripts = sorted(bench_dir.glob("bench_*.py"))
    names = lambda s: {s.stem, s.stem.removeprefix("bench_")}
    if only:
        unknown = set(only) - set().union(*(names(s) for s in scripts))
        if unknown:
            raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        scripts = [s for s in scripts if names(s) & set(only)]
    return [s for s in scripts if not names(s) & set(skip)]


def gpus_needed(script: Path) -> int:
    """The script's module-level ``GPUS = <int>``, 1 when absent."""
    for node in ast.parse(script.read_text()).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GPUS" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
            return node.value.value
    return 1


def run_one(script: Path, out_dir: Path, timeout: float | None, python: str = sys.executable):
    """Run one benchmark, echoing its output. Returns (table dict, None) or (None, error text)."""
    env = dict(os.environ, FP4KIT_BENCH_OUT=str(out_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    tail = collections.deque(maxlen=15)
    proc = subprocess.Popen([python, str(script)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    expired = []

    def expire():
        expired.append(True)
        proc.kill()

    # a timer, not wait(timeout): reading the output blocks until the benchmark ends
    watchdog = threading.Timer(timeout or 1e9, expire)
    watchdog.start()
    for line in proc.stdout:
        print("  " + line, end="", flush=True)
        tail.append(line.rstrip())
    rc = proc.wait()
    watchdog.cancel()
    if expired:
        return None, f"timed out after {timeout:.0f} s"
    result = out_dir / f"{script.stem}.json"
    if rc != 0:
        last = tail[-1] if tail else ""  # usually the exception: the one line the summaries show
        return None, f"exit code {rc}: {last}\n" + "\n".join(tail)
    if not result.exists():
        return None, f"exit code 0 but no {result.name} written"
    return json.loads(result.read_text()), None


def run_benchmarks(scripts, *, gpu_count: int, timeout=None, copy_to: Path | None = None):
    """Run each script in turn. Returns (tables, failed, skipped), keyed by benchmark name."""
    tables, failed, skipped = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:  # fresh dir: a failed run cannot leave a stale file
        for script in scripts:
            need = gpus_needed(script)
            if need > 1 and need > gpu_count:  # single-GPU ones run anyway: without a GPU they fail, loudly
                skipped[script.stem] = f"needs {need} GPUs, {gpu_count} visible"
                print(f"== {script.stem}: skipped ({skipped[script.stem]})", flush=True)
                continue
            print(f"== {script.stem}", flush=True)
            table, error = run_one(script, Path(tmp), timeout)
            if error:
                failed[script.stem] = error
                print(f"== {script.stem}: FAILED ({error.splitlines()[0]})", flush=True)
                continue
            tables[script.stem] = table
            if copy_to is not None:  # keep the per-benchmark file current, as a manual run does
                copy_to.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / f"{script.stem}.json", copy_to / f"{script.stem}.json")
    return tables, failed, skipped


def load_existing(scripts, results_dir: Path):
    """The per-benchmark JSON files already in results_dir, for the given scripts."""
    tables, missing = {}, {}  # missing: a benchmark not run yet, not a failure
    for script in scripts:
        path = results_dir / f"{script.stem}.json"
        if path.exists():
            tables[script.stem] = json.loads(path.read_text())
        else:
            missing[script.stem] = f"no {path.name} in {results_dir}"
    return tables, missing


# ---------------------------------------------------------------- metadata

def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_version(v: int | None):
    return None if v is None else f"{v // 1000}.{v % 1000 // 10}"


def git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def common_meta() -> dict:
    return {"date": datetime.date.today().isoformat(), "git_commit": git_commit(), "python": sys.version.split()[0]}


def device_meta() -> dict:
    """GPU name, driver, CUDA runtime, CuPy, NVRTC and the copy bandwidth, measured here."""
    import cupy as cp

    sys.path.insert(0, str(BENCH_DIR))
    from common import copy_bandwidth, device_name

    rt = cp.cuda.runtime
    meta = {"gpu": device_name(), "gpu_count": gpu_count(), "driver": _nvidia_smi_driver(),
            "driver_cuda": _cuda_version(rt.driverGetVersion()),
            "cuda_runtime": _cuda_version(rt.runtimeGetVersion()), "cupy": cp.__version__,
            "nvrtc": ".".join(map(str, cp.cuda.nvrtc.getVersion())),
            "torch": _version("torch"),
            "copy_bandwidth_Bps": copy_bandwidth()}
    cp.get_default_memory_pool().free_all_blocks()  # leave the memory to the benchmarks
    return meta


def _nvidia_smi_driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def meta_from_tables(tables: dict) -> dict:
    """What the per-benchmark files recorded (no GPU needed): device, versions, copy bandwidth."""
    metas = [t.get("meta", {}) for t in tables.values()]
    pick = lambda key: next((m[key] for m in metas if m.get(key) is not None), None)
    bws = [m["copy_bandwidth_Bps"] for m in metas if m.get("copy_bandwidth_Bps")]
    rt = pick("cuda_runtime")
    return {"gpu": pick("device"), "driver": None, "cuda_runtime": _cuda_version(rt) if isinstance(rt, int) else rt,
            "cupy": pick("cupy"), "nvrtc": pick("nvrtc"), "torch": pick("torch"),
            "copy_bandwidth_Bps": statistics.median(bws) if bws else None}


def gpu_count() -> int:
    """Visible CUDA devices; 0 without CuPy, a driver or a device."""
    from fp4kit.runtime.device import device_count

    return device_count()


# ---------------------------------------------------------------- report

def build_report(meta: dict, tables: dict, failed: dict, skipped: dict) -> dict:
    """The report: run metadata, each benchmark's table with its rows' fraction of the floor."""
    benches = {}
    for name, table in tables.items():
        row_meta = {**meta, **table.get("meta", {})}  # a benchmark's own measurements win
        row_meta.setdefault("device", meta.get("gpu") or "")
        fractions = [fraction_of_floor(name, row, row_meta) for row in table["rows"]]
        benches[name] = {**table, "fraction_of_floor": fractions}
    return {"meta": meta, "benchmarks": benches, "failed": failed, "skipped": skipped}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (text or "unknown-gpu").lower()).strip("-") or "unknown-gpu"


def report_stem(meta: dict) -> str:
    return f"{meta['date']}-{slug(meta.get('gpu'))}"


def fmt(v) -> str:
    """Numbers as the README tables show them (three significant digits, integers above 100)."""
    if v is None:
        return ""
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(fmt(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def describe(meta: dict) -> str:
    """One line naming the GPU and the versions, for headings and the plot title."""
    parts = [meta.get("gpu") or "unknown GPU"]
    for key, label in (("driver", "driver"), ("cuda_runtime", "CUDA"), ("cupy", "CuPy"), ("nvrtc", "NVRTC"),
                       ("torch", "PyTorch")):
        if meta.get(key):
            parts.append(f"{label} {meta[key]}")
    return ", ".join(parts)


def markdown_report(report: dict) -> str:
    meta = report["meta"]
    bw = meta.get("copy_bandwidth_Bps")
    out = [f"## Benchmarks: {describe(meta)}", "",
           f"Date {meta.get('date')}, commit {meta.get('git_commit') or 'unknown'}"
           + (f", copy bandwidth {bw / 1e12:.2f} TB/s (read + write)" if bw else "") + "."]
    if meta.get("source"):  # --from-existing: the rows predate this date and commit
        out += ["", f"Assembled from {meta['source']}."]
    for name, bench in report["benchmarks"].items():
        out += ["", f"### {bench.get('title', name)}", "", markdown_table(bench["columns"], bench["rows"])]
    for label, entries in (("Failed", report["failed"]), ("Skipped", report["skipped"])):
        if entries:
            out += ["", f"{label}:", ""] + [f"* `{n}`: {why.splitlines()[0]}" for n, why in entries.items()]
    return "\n".join(out) + "\n"


def write_report(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{report_stem(report['meta'])}.json"
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown_report(report))
    return path


# ---------------------------------------------------------------- plot

def row_label(columns: list[str], row: dict) -> str:
    """The row's identity: the columns before the first timing column ("µs" or "ms/step")."""
    timing = next((c for c in ("µs", "ms/step") if c in columns), None)
    keys = columns[:columns.index(timing)] if timing else columns[:2]
    return " ".join(str(row[k]) if isinstance(row.get(k), str) else f"{k}={row.get(k)}" for k in keys)


def plot_bars(report: dict) -> list[tuple[str, str, float]]:
    """(benchmark, label, fraction) for every row that has a fraction, in report order."""
    return [(name, row_label(b["columns"], row), f)
            for name, b in report["benchmarks"].items()
            for row, f in zip(b["rows"], b["fraction_of_floor"]) if f is not None]


def plot(report_path: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'fp4kit[plot]' (or matplotlib), then "
                         f"python benchmarks/run_all.py --plot-only {report_path}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(report_path).read_text())
    bars = plot_bars(report)
    if not bars:
        raise SystemExit(f"{report_path}: no row has a fraction of its floor to plot")
    names = list(dict.fromkeys(b for b, _, _ in bars))
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.2 * len(bars)))
    y = range(len(bars))
    drawn = ax.barh(y, [f * 100 for _, _, f in bars], color=[colors[b] for b, _, _ in bars])
    ax.bar_label(drawn, fmt="%.1f", fontsize=5, padding=2)
    ax.set_yticks(list(y), [label for _, label, _ in bars], fontsize=6)
    ax.set_ylim(len(bars) - 0.5, -0.5)  # first row on top, as in the tables
    ax.axvline(100, color="black", linewidth=0.8)
    ax.set_xlabel("achieved % of the floor (bandwidth or compute; 100 = at the floor)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names], labels=names,
              loc="lower right", fontsize=7)
    meta = report["meta"]
    ax.set_title(f"fp4kit, {describe(meta)}\n{meta.get('date')}, commit {(meta.get('git_commit') or '?')[:12]}",
                 fontsize=9)
    fig.tight_layout()
    out = Path(report_path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], help="comma-separated subset: quant,moe")
    p.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[], help="comma-separated")
    p.add_argument("--from-existing", action="store_true",
                   help="assemble the report from the per-benchmark JSON files, running nothing")
    p.add_argument("--plot-only", type=Path, metavar="REPORT_JSON", help="draw the PNG of a report and exit")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the files are read and written")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="where the bench_*.py scripts are")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        print("plot", plot(args.plot_only))
        return 0
    scripts = discover(args.only, args.skip, args.bench_dir)
    if args.from_existing:
        tables, skipped = load_existing(scripts, args.results)
        meta = {**meta_from_tables(tables), **common_meta(), "source": f"existing files in {args.results}"}
        failed = {}
    else:
        count = gpu_count()
        if not count:
            print("no GPU visible: the benchmarks will fail", file=sys.stderr)
        meta = {**(device_meta() if count else {}), **common_meta()}
        tables, failed, skipped = run_benchmarks(scripts, gpu_count=count, timeout=args.timeout,
                                                 copy_to=args.results)
    report = build_report(meta, tables, failed, skipped)
    path = write_report(report, args.results)
    print("wrote", path, "and", path.with_suffix(".md"))
    if not args.no_plot and plot_bars(report):
        try:
            import matplotlib  # noqa: F401  (the plot is optional after a run)
        except ImportError:
            print(f"matplotlib missing: no plot; later: python benchmarks/run_all.py --plot-only {path}")
        else:
            print("plot", plot(path))
    for name, why in failed.items():
        print(f"FAILED {name}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
