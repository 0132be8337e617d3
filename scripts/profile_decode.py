#!/usr/bin/env python3
"""One eager decode step of the benchmark's model (v4-flash-slice, 4 layers, context 4096) between
``cudaProfilerStart`` and ``cudaProfilerStop``, for a profiler that times every kernel of the step:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        .venv/bin/python scripts/profile_decode.py [BATCH] [w4a4]

The kernels are those of the captured step (`benchmarks/bench_decode.py` counts them), launched one
by one, so their durations add up to the step's time less the gaps between launches.
"""

import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from dsv4 import config as configs  # noqa: E402
from dsv4 import runner  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mode = "w4a4" if "w4a4" in sys.argv[2:] else "w4a16"
cfg = configs.v4_flash_slice(4, max_context=8192, mode=mode)
model, _ = runner.build(cfg, device=True, seed=0)
state = model.new_state(batch, history_rows=8)
runner.fill_context(model, state, 4096, seed=batch)
dec = runner.Decoder(model, state, cp.zeros((batch, 1), cp.int32), use_graph=False)
for _ in range(3):  # compile and warm up
    dec.decode_step()
dec.synchronize()
cp.cuda.profiler.start()
dec.decode_step()
dec.synchronize()
cp.cuda.profiler.stop()
