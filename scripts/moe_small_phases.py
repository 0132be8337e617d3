#!/usr/bin/env python3
"""Where a block of the MoE's small-T GEMV launches spends its life (needs a GPU): an instrumented
copy of ``raw_kernels/moe.cu`` (`phase_probe`) in which thread 0 of each block stamps its entry, the
wait for the kernel before (PDL), the activation staged, its warp's GEMV done and the block's
epilogue, in one of the two launches of a graph-replayed V4-Flash layer call (W4A16 by default).
Thread 0 is warp 0's lane 0, so "computed" is warp 0's mainloop; the block barrier after it is the
wait for the block's slowest warp. The first 1024 blocks (by linear index) stamp: every block at T = 1.

    PYTHONPATH=. python3 scripts/moe_small_phases.py [--launch=down|gate_up] [--tokens=1] [--mode=w4a16]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phase_probe  # noqa: E402

PHASES = {
    "down": ("entry", "waited", "staged", "computed", "gathered", "end"),
    "gate_up": ("entry", "waited", "primed", "staged", "computed", "gathered", "end"),
}
# (text in the kernel, the text with marks around it); each text occurs exactly once
MARKS = {
    "down": (
        ("    const bool prefetch = has_shared && warp == top_k;\n",
         "    PHASE(0);\n    const bool prefetch = has_shared && warp == top_k;\n"),
        ("    pdl::wait_prior();\n    if (warp < slots && !prefetch) {",
         "    pdl::wait_prior();\n    PHASE(1);\n    if (warp < slots && !prefetch) {"),
        ("    settle();\n    __syncthreads();\n    for (unsigned j = warp; j < slots; j += kWarps) {",
         "    settle();\n    __syncthreads();\n    PHASE(2);\n    for (unsigned j = warp; j < slots; j += kWarps) {"),
        ("    __syncthreads();\n    if (threadIdx.x >= 16) return;\n",
         "    PHASE(3);\n    __syncthreads();\n    PHASE(4);\n    if (threadIdx.x >= 16) return;\n"),
        ("    out[(size_t)t * H + n] = __float2bfloat16_rn(acc);\n}",
         "    out[(size_t)t * H + n] = __float2bfloat16_rn(acc);\n    PHASE(5);\n}"),
    ),
    "gate_up": (
        ("    if (!shared) pdl::wait_prior();  // a routed",
         "    PHASE(0);\n    if (!shared) pdl::wait_prior();\n    PHASE(1);  // a routed"),
        ("    gemv.prime();\n    if (shared && !early) pdl::wait_prior();",
         "    gemv.prime();\n    if (shared && !early) pdl::wait_prior();\n    PHASE(2);"),
        ("    settle();\n    __syncthreads();\n    float acc[2][4] = {};",
         "    settle();\n    __syncthreads();\n    PHASE(3);\n    float acc[2][4] = {};"),
        ("    gemv.run(act_s + (size_t)row_of_lane * ld, acc);\n",
         "    gemv.run(act_s + (size_t)row_of_lane * ld, acc);\n    PHASE(4);\n"),
        ("    const unsigned q = threadIdx.x / 16, i = threadIdx.x % 16, pair = blockIdx.x * pairs_per_block + q;\n",
         "    PHASE(5);\n    const unsigned q = threadIdx.x / 16, i = threadIdx.x % 16, pair = blockIdx.x * pairs_per_block + q;\n"),
        ("    if (out_amax) {  // W4A4: one max per block", "    PHASE(6);\n    if (out_amax) {  // W4A4: one max per block"),
    ),
}
# outside `namespace small`, so that the stamp arrays keep their plain names
ANCHOR = "namespace small {\n\nconstexpr int kWarps = 8;"


def instrumented_source(source: str, launch: str) -> str:
    """``source`` (moe.cu with its headers) with the recorder and the marks of ``launch``; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    return phase_probe.instrument(source, MARKS[launch], ANCHOR, "moe.cu")


def main(argv: list[str]) -> int:
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from benchmarks.bench_moe import CONFIGS, ROTATE, build
    from benchmarks.common import graph_us
    from fp4kit.runtime import loader

    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    launch, mode = opts.get("launch", "down"), opts.get("mode", "w4a16")
    tokens, rounds = int(opts.get("tokens", 1)), int(opts.get("rounds", 2))
    if launch not in MARKS:
        raise SystemExit(f"--launch: expected one of {sorted(MARKS)}, got {launch!r}")
    cfg = CONFIGS[opts.get("config", "V4-Flash")]
    layer, _ = build(cfg, mode)
    rng = np.random.default_rng(0)
    xs = [cp.asarray(rng.standard_normal((tokens, cfg["hidden"])).astype(ml_dtypes.bfloat16)) for _ in range(ROTATE)]
    source = instrumented_source(loader.kernel_source("moe"), launch)
    for _ in range(rounds):
        library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure(
            "moe", source, lambda i: layer(xs[i % ROTATE]), lambda f: graph_us(f, calls=ROTATE))
        print(f"{launch}, T = {tokens}, {mode}: the layer call {library_us:.2f} us ({probed_us:.2f} instrumented), "
              f"{blocks} blocks stamped, on {len(set(sm[:blocks].tolist()))} SMs")
        print("\n".join(phase_probe.summary(clock, time_ns, blocks, PHASES[launch])))
        print("\n".join(phase_probe.sm_summary(time_ns, sm, blocks)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
