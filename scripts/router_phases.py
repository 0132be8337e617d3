#!/usr/bin/env python3
"""Where the small-T router launch's time goes (`moe_route_*`, the MoE's first launch at decode
sizes): an instrumented copy of ``raw_kernels/moe.cu`` (`phase_probe`) in which thread 0 of each
block stamps the wait for the kernel before (PDL), its logits, and, in the block that arrives last,
the arrival, the load of the token's logits, the picks (scores, selection bias, top-k) and the
weights; graph-replayed on `scripts/router_probe.py`'s V4-Flash routing. The launch alone (no
kernel before it) is timed beside. Needs a GPU.

    PYTHONPATH=. python3 scripts/router_phases.py [--tokens=1] [--rounds=2]

At T = 1 the launch has 256 blocks; only the token's last block to arrive records the phases
from "last" on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phase_probe  # noqa: E402

PHASES = ("entry", "waited", "logits", "last", "loaded", "picked", "routed", "end")
# (text in the kernel, the text with marks around it); each text occurs exactly once
MARKS = (
    ("    if (runs && e < E) load_weights(k_lo + 8 * lane);\n    pdl::wait_prior();\n",
     "    PHASE(0);\n    if (runs && e < E) load_weights(k_lo + 8 * lane);\n    pdl::wait_prior();\n    PHASE(1);\n"),
    ("    router_logits<XT, WT>(x, gate_w, E, H, wpe, logits, release != 0);\n"
     "    if (!gpu_sync::last_to_arrive(done + t, gridDim.x, &last)) return;  // block-uniform\n",
     "    router_logits<XT, WT>(x, gate_w, E, H, wpe, logits, release != 0);\n    PHASE(2);\n"
     "    if (!gpu_sync::last_to_arrive(done + t, gridDim.x, &last)) return;  // block-uniform\n    PHASE(3);\n"),
    ("        select[e] = bias ? bias[e] : 0.0f;\n    }\n    __syncthreads();\n",
     "        select[e] = bias ? bias[e] : 0.0f;\n    }\n    __syncthreads();\n    PHASE(4);\n"),
    ("    if (threadIdx.x < 32) {  // lane j writes pick j", "    PHASE(5);\n    if (threadIdx.x < 32) {  // lane j writes pick j"),
    ("           routed_scale, ids, weights, nullptr, nullptr, t);\n    if (x_amax) {",
     "           routed_scale, ids, weights, nullptr, nullptr, t);\n    PHASE(6);\n    if (x_amax) {"),
    ("    if (threadIdx.x == 0) done[t] = 0u;  // every block of this token has counted\n}",
     "    PHASE(7);\n    if (threadIdx.x == 0) done[t] = 0u;  // every block of this token has counted\n}"),
)
ANCHOR = "template <typename XT, typename WT>\n__device__ void router_logits("


def instrumented_source(source: str) -> str:
    """``source`` (moe.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the kernel changed)."""
    return phase_probe.instrument(source, MARKS, ANCHOR, "moe.cu")


def main(argv: list[str]) -> int:
    import ml_dtypes

    import router_probe
    from benchmarks.common import graph_us
    from fp4kit.runtime import loader

    tokens = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--tokens=")), 1)
    rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), 2)
    source = instrumented_source(loader.kernel_source("moe"))
    args = router_probe.buffers(tokens, ml_dtypes.bfloat16, np.random.default_rng(0))
    for _ in range(rounds):
        library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure(
            "moe", source, lambda i: router_probe.call(*args), graph_us)
        print(f"T = {tokens}: {library_us:.2f} us a launch ({probed_us:.2f} instrumented), {blocks} blocks")
        print("\n".join(phase_probe.summary(clock, time_ns, blocks, PHASES)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
