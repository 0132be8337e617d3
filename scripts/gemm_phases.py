#!/usr/bin/env python3
"""Where a block of the GEMM engine's mainloop kernels spends its life (needs a GPU): an
instrumented copy of ``raw_kernels/gemm.cu`` (`phase_probe`) in which thread 0 of each block of
`gemm_block` (the tiled mma.sync and wgmma kernels; not the GEMV kernels) stamps its entry, the
wait for the kernel before (PDL), the first activation window staged, warp 0's mainloop done and,
unsplit, the end of its stores; one GEMM graph-replayed over weights rotated past the L2 (as the
benchmarks time it), e.g. the decode step's query-rank projection (32768 x 1024 at M = 1).

    PYTHONPATH=. python3 scripts/gemm_phases.py [M N K] [--rounds=2] [--rotate=4]

The launch shape the library picks is printed beside; the per-SM summary tells whether the last
blocks to finish are those of the SMs holding the most.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import phase_probe  # noqa: E402

PHASES = ("entry", "waited", "staged", "computed", "stored")
# (text in the kernel, the text with marks around it); each text occurs exactly once
MARKS = (
    ("    if (active && c_begin < c_end) fetch(c_begin, first);\n",
     "    PHASE(0);\n    if (active && c_begin < c_end) fetch(c_begin, first);\n"),
    ("    if constexpr (kPdl) pdl::wait_prior();", "    if constexpr (kPdl) pdl::wait_prior();\n    PHASE(1);"),
    ("        act.finish(pending, act_buf(0), M, c_begin * kTileK, K);\n        window_done();\n",
     "        act.finish(pending, act_buf(0), M, c_begin * kTileK, K);\n        window_done();\n        PHASE(2);\n"),
    ("    Ep ep = ep_in;\n", "    PHASE(3);\n    Ep ep = ep_in;\n"),
    ("                    if (token < M && n < N) ep.store(token, n, N, acc[r][i][v]);\n                }\n        return;\n",
     "                    if (token < M && n < N) ep.store(token, n, N, acc[r][i][v]);\n                }\n"
     "        PHASE(4);\n        return;\n"),
)
# at file scope, before the engine's namespace: the stamp arrays keep their plain names
ANCHOR = "// ---- end common/pdl.cuh\nnamespace gemm {\n"


def instrumented_source(source: str) -> str:
    """``source`` (gemm.cu with its headers) with the recorder and every phase mark; raises
    ValueError naming a mark whose text is not found exactly once (the engine changed)."""
    return phase_probe.instrument(source, MARKS, ANCHOR, "gemm.cu")


def main(argv: list[str]) -> int:
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import fp4kit
    from benchmarks.common import graph_us
    from fp4kit.formats import to_tiled
    from fp4kit.ops import gemm as gemm_ops
    from fp4kit.runtime import loader

    sizes = [int(a) for a in argv if not a.startswith("--")]
    m, n, k = sizes if len(sizes) == 3 else (1, 32768, 1024)
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    rounds, rotate = int(opts.get("rounds", 2)), int(opts.get("rotate", 4))
    rng = np.random.default_rng(0)
    weights = [to_tiled(fp4kit.quantize(cp.asarray(rng.standard_normal((n, k), dtype=np.float32))))
               for _ in range(rotate)]
    x = cp.asarray(rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16))
    out = cp.empty((m, n), ml_dtypes.bfloat16)
    sms = loader.current_sm_count()
    print(f"{m} x {n} x {k}: GEMV {gemm_ops.gemv_launch(m, n, k, sms=sms)}; engine {gemm_ops.launch_config(m, n, k, sms=sms)}")
    source = instrumented_source(loader.kernel_source("gemm"))

    def call(i):
        gemm_ops.gemm(x, weights[i % rotate], out=out)

    for _ in range(rounds):
        library_us, probed_us, clock, time_ns, sm, blocks = phase_probe.measure(
            "gemm", source, call, lambda f: graph_us(f, calls=rotate))
        print(f"{library_us:.2f} us a call ({probed_us:.2f} instrumented), {blocks} blocks stamped "
              f"(none: the GEMV kernels ran), on {len(set(sm[:blocks].tolist()))} SMs")
        if blocks:
            print("\n".join(phase_probe.summary(clock, time_ns, blocks, PHASES)))
            print("\n".join(phase_probe.sm_summary(time_ns, sm, blocks)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
