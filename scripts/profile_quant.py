"""Launch the fused amax+quantize a few times at one size, for `ncu` to profile.

    ncu --clock-control none -k regex:amax_quantize -s 2 -c 1 --section SpeedOfLight \
        .venv/bin/python scripts/profile_quant.py 16384 7168
"""

import sys

import cupy as cp
import ml_dtypes
import numpy as np

import fp4kit

m, k = (int(a) for a in sys.argv[1:3])
x = cp.asarray(np.random.default_rng(0).standard_normal((m, k)).astype(ml_dtypes.bfloat16))
q = fp4kit.quantize(x)
for _ in range(4):
    fp4kit.quantize(x, out=q)
cp.cuda.Device().synchronize()
