#!/usr/bin/env bash
# The GPU half of the test suite on a CUDA machine: kernel resource usage, the GPU tests,
# compute-sanitizer memcheck and racecheck on the quantization tests, and the benchmarks.
# Logs go to $OUT (default ./gpu-logs). Uses the python3 on PATH with the repo on PYTHONPATH.
#   bash scripts/gpu_suite.sh [tests|sanitize|bench|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4KIT_BENCH_OUT="$out"
steps=${*:-all}

run() {  # run NAME CMD...: tee the output into $out/NAME.log, report the exit status
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]}"
}

has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/device.txt"
python3 - <<'PY' | tee "$out/kernels.txt"
import cupy, fp4kit
from fp4kit.runtime import loader
print("cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion(), "runtime", cupy.cuda.runtime.runtimeGetVersion())
for name in loader.kernel_names():
    module = loader.get_module(name, cooperative=True)
    for fn in sorted(set(__import__("re").findall(r'extern "C" __global__ void(?: __launch_bounds__\(\w+\))?\s+(\w+)\(', loader.kernel_source(name)))):
        k = module.get_function(fn)
        print(f"{name}.{fn}: regs={k.num_regs} local={k.local_size_bytes}B shared={k.shared_size_bytes}B")
PY
if has tests; then
    run gpu-tests python3 -m pytest -q -m gpu tests
fi
if has sanitize; then
    subset="dtypes or swiglu or dequantize or edge or graph or empty"
    FP4KIT_NO_POOL=1 run memcheck timeout 900 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m pytest -q -x -m gpu tests/test_quant_gpu.py -k "$subset" -p no:cacheprovider
    run racecheck timeout 900 compute-sanitizer --tool racecheck --error-exitcode 9 \
        python3 -m pytest -q -x -m gpu tests/test_quant_gpu.py -k "edge or graph or swiglu" -p no:cacheprovider
fi
if has bench; then
    for bench in benchmarks/bench_*.py; do
        run "$(basename "$bench" .py)" python3 "$bench"
    done
fi
