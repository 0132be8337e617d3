#!/usr/bin/env python3
"""What holds the device memory of a batched prefill or of the first decode steps (needs a GPU).

`bench_decode.py` reports how much device memory a run adds beyond the weights and the KV caches
(CuPy's pool after the run: live arrays plus the blocks it keeps for reuse). This script runs the
same workload (v4-flash-slice, 4 layers) with a CuPy memory hook that records every allocation
from the pool with the innermost stack frame inside fp4kit or the example model, and prints: the
peak of the bytes held by live arrays, the sites that held them at that peak (largest first), and
the pool's total at the end, so the gap between the two (blocks freed into the pool but not
reusable by later, differently sized requests) shows as well.

    PYTHONPATH=. python3 scripts/memory_trace.py [--prefill=4096] [--batch=1] [--decode] [--top=25]
"""

from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

_OURS = (str(ROOT / "fp4kit"), str(ROOT / "examples"))


_HELPERS = (str(ROOT / "fp4kit" / "runtime" / "workspace.py"),)  # allocate for their callers


def allocation_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ``stack`` in the library or the example model (``file:line
    function``, the path relative to the repository), else the innermost frame. A workspace
    helper's frames are passed over, so its buffers are named by the code that asked for them."""
    for frame in reversed(stack):
        if frame.filename.startswith(_OURS) and not frame.filename.startswith(_HELPERS):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno} {frame.name}"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


class LiveBytes:
    """Live allocations by pointer, their total, its peak and the sites live at the peak."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, str]] = {}
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def malloc(self, ptr: int, size: int, site: str) -> None:
        self.live[ptr] = (size, site)
        self.total += size
        if self.total > self.peak:
            self.peak = self.total
            self._snapshot()

    def free(self, ptr: int) -> None:
        entry = self.live.pop(ptr, None)
        if entry is not None:  # blocks allocated before the hook was installed are not tracked
            self.total -= entry[0]

    def _snapshot(self) -> None:
        sites: dict[str, int] = collections.Counter()
        for size, site in self.live.values():
            sites[site] += size
        self.at_peak = dict(sites)

    def report(self, top: int) -> list[tuple[str, int]]:
        """The ``top`` sites by bytes live at the peak."""
        return sorted(self.at_peak.items(), key=lambda kv: -kv[1])[:top]


def main() -> None:
    import cupy as cp
    import numpy as np
    from cupy.cuda import memory_hook

    from dsv4 import config as configs
    from dsv4 import runner

    prefill, batch, decode, top, steps = 4096, 1, False, 25, 3
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key == "--prefill":
            prefill = int(value)
        elif key == "--batch":
            batch = int(value)
        elif key == "--decode":
            decode = True
        elif key == "--top":
            top = int(value)
        else:
            raise SystemExit(f"unknown argument {arg!r}")

    tracker = LiveBytes()

    class Hook(memory_hook.MemoryHook):
        name = "fp4kit-memory-trace"

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            tracker.malloc(mem_ptr, mem_size, allocation_site(traceback.extract_stack()[:-1]))

        def free_preprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            tracker.free(mem_ptr)

    cfg = configs.v4_flash_slice(4, max_context=8192, mode="w4a16")
    model, ckpt = runner.build(cfg, device=True, seed=0)
    del ckpt
    state = model.new_state(batch, history_rows=64)
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()  # the run's own pool, as bench_decode's probe
    cp.cuda.set_allocator(pool.malloc)
    with Hook():
        if decode:
            dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32))
            for _ in range(steps):
                dec.decode_step()
        else:
            model.prefill(state, cp.zeros((batch, prefill), np.int32))
        cp.cuda.Device().synchronize()
    what = f"{steps} decode steps at batch {batch}" if decode else f"a batched prefill of {prefill} tokens (batch {batch})"
    print(f"{what}: peak of live bytes {tracker.peak / 1e6:.1f} MB; the run's pool at the end "
          f"{pool.total_bytes() / 1e6:.1f} MB ({pool.used_bytes() / 1e6:.1f} MB in use)")
    print("| site | MB live at the peak |")
    print("| --- | --- |")
    for site, size in tracker.report(top):
        print(f"| {site} | {size / 1e6:.1f} |")


if __name__ == "__main__":
    main()
