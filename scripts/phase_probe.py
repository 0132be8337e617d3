"""Shared by the phase probes (`attention_phases.py`, `sampler_phases.py`): an instrumented copy of
a kernel module in which thread 0 of each block records ``clock64``, ``%globaltimer`` and its SM at
marked points (``PHASE(i)``) into ``__device__`` arrays, built in place of the library's module for
the launches inside `instrumented`, and a summary of the stamps per phase."""

from __future__ import annotations

import contextlib
import statistics

import numpy as np

MAX_BLOCKS = 1024  # the MoE gate|up launch at T = 1 has 896 blocks
PHASE_SLOTS = 8


def recorder() -> str:
    """The stamp arrays and the ``PHASE(i)`` macro (thread 0 of each of the first `MAX_BLOCKS`
    blocks, by linear block index)."""
    return f"""
__device__ unsigned long long phase_clock[{MAX_BLOCKS}][{PHASE_SLOTS}];
__device__ unsigned long long phase_time[{MAX_BLOCKS}][{PHASE_SLOTS}];
__device__ unsigned phase_sm[{MAX_BLOCKS}];
#define PHASE(i) do {{ if (threadIdx.x == 0) {{                                                   \\
    unsigned long long t_; unsigned sm_;                                                        \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                      \\
    asm("mov.u32 %0, %%smid;" : "=r"(sm_));                                                     \\
    const unsigned b_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);         \\
    if (b_ < {MAX_BLOCKS}) {{ phase_clock[b_][i] = clock64(); phase_time[b_][i] = t_; phase_sm[b_] = sm_; }} \\
}} }} while (0)
"""


def instrument(source: str, marks, anchor: str, file: str) -> str:
    """``source`` with each ``(text, marked)`` of ``marks`` replaced and the recorder inserted
    before ``anchor`` (the first text that uses a mark); raises ValueError naming a text not found
    exactly once (the kernel changed)."""
    for text, marked in marks:
        if source.count(text) != 1:
            raise ValueError(f"{file}: expected the text {text.strip()!r} once, found it {source.count(text)} times")
        source = source.replace(text, marked)
    if source.count(anchor) != 1:
        raise ValueError(f"{file}: expected the text {anchor.strip()!r} once, found it {source.count(anchor)} times")
    at = source.index(anchor)
    return source[:at] + recorder() + source[at:]


def block_ends(time_ns: np.ndarray, blocks: int) -> list[float]:
    """When each stamped block finished: its latest stamp, µs after the first block's first one."""
    start = time_ns[:blocks, 0].min()
    return [float(time_ns[b][time_ns[b] > 0].max() - start) / 1e3 for b in range(blocks)]


def summary(clock: np.ndarray, time_ns: np.ndarray, blocks: int, phases) -> list[str]:
    """Per pair of consecutive stamps a block recorded (a path that skips a phase goes from the
    stamp before it to the one after), the median and largest cycle count over the blocks that
    recorded the pair, and when the blocks finished (µs after the first block's first stamp)."""
    steps: dict = {}
    for b in range(blocks):
        marked = [i for i in range(len(phases)) if clock[b, i]]
        for j, i in zip(marked, marked[1:]):
            cycles = int(clock[b, i] - clock[b, j])
            if cycles >= 0:  # a stamp left by an earlier launch precedes this one's
                steps.setdefault((j, i), []).append(cycles)
    lines = [f"  {phases[j]} -> {phases[i]}: median {statistics.median(v):.0f} cycles, max {max(v)} ({len(v)} blocks)"
             for (j, i), v in sorted(steps.items(), key=lambda kv: kv[0][::-1])]
    ends = sorted(block_ends(time_ns, blocks))
    lines.append(f"  blocks finished: first {ends[0]:.2f} us, median {ends[len(ends) // 2]:.2f}, last {ends[-1]:.2f}")
    return lines


def sm_summary(time_ns: np.ndarray, sm: np.ndarray, blocks: int) -> list[str]:
    """The SMs grouped by how many of the stamped blocks they ran: per group the number of SMs and
    when their last block finished (median and latest, µs after the first block's first stamp), to
    tell whether a launch's tail is the SMs holding the most blocks."""
    per_sm: dict = {}
    for b, end in enumerate(block_ends(time_ns, blocks)):
        count, last = per_sm.get(int(sm[b]), (0, 0.0))
        per_sm[int(sm[b])] = (count + 1, max(last, end))
    groups: dict = {}
    for count, last in per_sm.values():
        groups.setdefault(count, []).append(last)
    return [f"  SMs with {count} blocks: {len(lasts)}, their last block done at median {statistics.median(lasts):.2f} us, "
            f"latest {max(lasts):.2f}" for count, lasts in sorted(groups.items())]


@contextlib.contextmanager
def instrumented(module: str, source: str, cooperative: bool = False):
    """Inside the block, kernels of ``module`` are built from ``source`` (``cooperative``: as the
    library loads that module's kernels); yields a probe whose ``read()`` returns the stamps
    ``(clock, time_ns, sm)`` as int64 arrays and whose ``reset()`` zeroes them. Call ``reset()``
    after the first launch (which builds the module) and before the probed ones."""
    import cupy as cp

    from fp4kit.runtime import loader

    library_source = loader.kernel_source
    loader.kernel_source = lambda name: source if name == module else library_source(name)
    loader._kernels = type(loader._kernels)()  # the next launch builds the instrumented copy
    arrays: dict = {}

    def stamps():
        if not arrays:
            mod = loader.get_module(module, cooperative=cooperative)
            for name, shape, dtype in (("phase_clock", (MAX_BLOCKS, PHASE_SLOTS), cp.uint64),
                                       ("phase_time", (MAX_BLOCKS, PHASE_SLOTS), cp.uint64),
                                       ("phase_sm", (MAX_BLOCKS,), cp.uint32)):
                arrays[name] = cp.ndarray(shape, dtype, mod.get_global(name))
        return arrays

    class Probe:
        @staticmethod
        def reset() -> None:
            for a in stamps().values():
                a.fill(0)

        @staticmethod
        def read():
            a = stamps()
            return tuple(a[n].get().astype(np.int64) for n in ("phase_clock", "phase_time", "phase_sm"))

    try:
        yield Probe
    finally:
        loader.kernel_source = library_source
        loader._kernels = type(loader._kernels)()


def _build(job: tuple) -> None:
    """Compile ``module`` (from ``source``, or the library's when None) into CuPy's disk cache."""
    module, source, cooperative = job
    from fp4kit.runtime import loader

    if source is not None:
        library_source = loader.kernel_source
        loader.kernel_source = lambda name: source if name == module else library_source(name)
    loader.get_module(module, cooperative=cooperative)


def prebuild_jobs(module: str, source: str, cooperative: bool = False) -> list[tuple]:
    """The two builds a probe of ``module`` needs: the library's module and the instrumented one."""
    return [(module, None, cooperative), (module, source, cooperative)]


_prebuilt: set = set()


def build_side_by_side(jobs: list[tuple], workers: int = 14) -> None:
    """Compile ``(module, source or None for the library's, cooperative)`` jobs at the same time, in
    fresh (spawned: no fork of a CUDA process) processes, into CuPy's disk cache, from which this
    process then loads them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build, jobs))


def prebuild(module: str, source: str, cooperative: bool = False) -> None:
    """The library's ``module`` and the instrumented ``source`` compiled side by side
    (`build_side_by_side`): the GEMM and MoE modules take about two minutes each to compile, one
    after the other otherwise. Once per process and source."""
    key = (module, hash(source), cooperative)
    if key in _prebuilt:
        return
    build_side_by_side(prebuild_jobs(module, source, cooperative))
    _prebuilt.add(key)


def measure(module: str, source: str, call, timer, cooperative: bool = False) -> tuple:
    """``call(i)`` timed by ``timer`` (`benchmarks.common.graph_us`) with the library's kernels, then
    with ``source`` built in place of ``module``: ``(library µs, instrumented µs, clock, time_ns,
    sm, blocks)``, the stamps of the last launch and the number of blocks that stamped phase 0.
    Both modules are compiled first, side by side (`prebuild`)."""
    prebuild(module, source, cooperative)
    library_us = timer(call)
    with instrumented(module, source, cooperative) as probe:
        call(0)  # builds the instrumented module
        probe.reset()
        probed_us = timer(call)
        clock, time_ns, sm = probe.read()
    return library_us, probed_us, clock, time_ns, sm, int((clock[:, 0] > 0).sum())

