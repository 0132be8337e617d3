"""Timing and reporting shared by the benchmark scripts.

* `graph_us`: device time per call of a microsecond op, from CUDA-graph replays (the graph holds
  ``calls`` launches; each replay is timed with events; the median replay over ``calls``).
* `events_us`: device time of eager calls with events (for baselines that cannot be captured).
* `torch_graph_us`: the same as `graph_us` for PyTorch baselines (PyTorch can capture cuBLAS).
* `copy_bandwidth`: the measured device-to-device copy bandwidth (bytes read + written) that
  every row is compared with.
* `graph_kernels`, `graph_kernel_nodes`: the kernel launches a captured CUDA graph holds (names, count).
* `Table`: prints the rows and writes them as JSON for the runner.
* `command_line`: a benchmark's flags, checked before any GPU work (``--help`` prints its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import cupy as cp
import numpy as np


def command_line(doc: str, add_flags=None, argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags. ``--help`` prints the benchmark's docstring and an unknown or malformed
    flag stops it with the flag's name, both before the benchmark builds anything on the GPU (a typo
    must not silently run the default for minutes). ``add_flags(parser)`` declares the flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    if add_flags is not None:
        add_flags(parser)
    return parser.parse_args(argv)


def int_list(text: str) -> tuple[int, ...]:
    """``1,8,32`` -> (1, 8, 32): the argparse type of the benchmarks' comma-separated counts."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def events_us(fn, *, warmup: int = 3, iters: int = 20) -> float:
    """Median device time in µs of ``fn()`` launched eagerly on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(times)


def graph_us(fn, *, calls: int = 20, replays: int = 30) -> float:
    """Median device time in µs per ``fn(i)`` from replays of one graph holding ``calls`` calls.

    ``fn(i)`` gets the call index so that it can rotate among input buffers.

    The eager first call runs on the current stream (the legacy default stream for the scripts), and
    the graph on a non-blocking stream, which does not wait for it: the device is synchronised in
    between, else the graph's first calls run alongside the eager one over the same layer state (a
    MoE layer's dispatch counters and plan: the arrivals of one call's routers erased by the other's,
    counts left for the next call, sorted rows past the plan's buffers), as the tests'
    ``capture_stream`` fixture and scripts/trace_moe.py already order it.
    """
    fn(0)  # eager first use: compile, allocate scratch
    cp.cuda.Device().synchronize()  # the eager call done before the graph's stream starts (see above)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            for i in range(calls):
                fn(i)
        except Exception:
            try:  # leave the stream out of capture mode before the error propagates
                stream.end_capture()
            except Exception:
                pass
            raise
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(replays):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / calls)
    return statistics.median(times)


def torch_graph_us(torch, fn, *, calls: int = 10, replays: int = 20) -> float:
    """Median device time in µs per ``fn(i)`` from PyTorch CUDA-graph replays (for baselines that
    call cuBLAS or other libraries CuPy cannot capture)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(0)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    t = events_us(lambda: b.__setitem__(Ellipsis, a), iters=10)
    del a, b
    return 2 * nbytes / (t * 1e-6)


_READ_KERNEL = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ src, size_t n, unsigned* sink) {
    unsigned acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) *sink = acc;  // keeps the loads; practically never taken
}
"""


def read_floor_us(nbytes: int) -> float:
    """The floor of streaming ``nbytes`` once: a plain read kernel (16-byte non-caching loads) over
    buffers rotated past L2, graph-replayed, best of 2..16 blocks of 256 threads per SM."""
    kernel = cp.RawKernel(_READ_KERNEL, "stream_read")
    words = max(1, nbytes // 16)
    copies = max(1, -(-3 * l2_bytes() // (words * 16)))
    bufs = [cp.ones(words * 4, cp.uint32) for _ in range(copies)]
    sink = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    best = float("inf")
    for per_sm in (2, 4, 8, 16):
        grid = (min(sms * per_sm, -(-words // 256)),)
        t = graph_us(lambda i: kernel(grid, (256,), (bufs[i % copies], np.uint64(words), sink)), calls=2 * copies)
        best = min(best, t)
    del bufs
    return best


def device_name() -> str:
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def l2_bytes() -> int:
    return cp.cuda.Device().attributes["L2CacheSize"]


def graph_kernels(graph) -> list[str]:
    """The kernel launches a captured `cupy.cuda.graph.Graph` holds, by function name, in the
    driver's node order (``cuGraphGetNodes``; ``cuGraphNodeGetType``, ``CU_GRAPH_NODE_TYPE_KERNEL``
    is 0; ``cuGraphKernelNodeGetParams_v2`` and ``cuFuncGetName``, CUDA 12.3+): what one replay runs."""
    import ctypes

    class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
        _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                    ("shared_mem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                    ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]

    driver = ctypes.CDLL("libcuda.so.1")
    handle, count = ctypes.c_void_p(graph.graph), ctypes.c_size_t(0)

    def check(status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what} failed with CUresult {status}")

    check(driver.cuGraphGetNodes(handle, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(driver.cuGraphGetNodes(handle, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    get_params = getattr(driver, "cuGraphKernelNodeGetParams_v2", None) or driver.cuGraphKernelNodeGetParams
    names = []
    for node in nodes[: count.value]:
        kind = ctypes.c_int(-1)
        check(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != 0:
            continue
        params, name = KernelNodeParams(), ctypes.c_char_p()
        named = (get_params(ctypes.c_void_p(node), ctypes.byref(params)) == 0 and params.func
                 and driver.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0)
        names.append(name.value.decode() if named else "(unnamed)")  # a driver without cuFuncGetName
    return names


def graph_kernel_nodes(graph) -> int:
    """Kernel nodes of a captured `cupy.cuda.graph.Graph`: the launches one replay makes."""
    return len(graph_kernels(graph))


class Table:
    def __init__(self, title: str, columns: list[str]):
        self.title, self.columns, self.rows = title, columns, []

    def add(self, **row) -> None:
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "| " + " | ".join("---" for _ in self.columns) + " |"
        body = ["| " + " | ".join(_fmt(r.get(c, "")) for c in self.columns) + " |" for r in self.rows]
        return "\n".join([f"### {self.title}", "", head, rule, *body])

    def save(self, name: str, meta: dict) -> Path:
        out_dir = Path(os.environ.get("FP4KIT_BENCH_OUT", Path(__file__).parent / "results"))
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps({"title": self.title, "meta": meta, "columns": self.columns, "rows": self.rows}, indent=1))
        return path


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
