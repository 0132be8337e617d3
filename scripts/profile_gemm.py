#!/usr/bin/env python3
"""Run one engine GEMM a few times, for a profiler (``ncu -k regex:gemm_ -s 2 -c 1``): any M on
the engine (not the cuBLAS path); ``sync`` forces the mma.sync kernels on Hopper, ``narrow`` keeps
long-K prefill off the 256-row blocks (``WGMMA_WIDE_BLOCK_MIN`` None).

    .venv/bin/python scripts/profile_gemm.py M N K [w4a4] [sync] [narrow]
"""

import sys

import cupy as cp
import ml_dtypes
import numpy as np

import fp4kit
from fp4kit.formats import to_tiled
from fp4kit.ops import gemm as gemm_ops
from fp4kit.ops.gemm import gemm

m, n, k = (int(v) for v in sys.argv[1:4])
rng = np.random.default_rng(0)
w = to_tiled(fp4kit.quantize(cp.asarray(rng.standard_normal((n, k), dtype=np.float32))))
x = cp.asarray(rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16))
a = fp4kit.quantize(x) if "w4a4" in sys.argv[4:] else x
out = cp.empty((m, n), ml_dtypes.bfloat16)
if "sync" in sys.argv[4:]:
    gemm_ops.WGMMA_MIN_M = 1 << 30
if "narrow" in sys.argv[4:]:
    gemm_ops.WGMMA_WIDE_BLOCK_MIN = None
for _ in range(3):
    gemm(a, w, out=out, decode_max_m=1 << 30)
cp.cuda.Device().synchronize()
