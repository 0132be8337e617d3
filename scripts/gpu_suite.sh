#!/usr/bin/env bash
# The GPU half of the test suite on a CUDA machine: kernel resource usage, the GPU tests (every
# one must run: FP4KIT_REQUIRE_GPU=1 turns a skipped GPU test into a failure), compute-sanitizer
# memcheck and racecheck on every kernel family (scripts/sanitize_kernels.py, small shapes) and on
# the quantization edge-case tests, and the benchmarks.
# Logs go to $OUT (default ./gpu-logs). Uses $PYTHON (default: .venv/bin/python when there is
# one, else python3) with the repo on PYTHONPATH. Exits non-zero when any step failed.
#   bash scripts/gpu_suite.sh [tests|sanitize|bench|multigpu|profile|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4KIT_BENCH_OUT="$out"
steps=${*:-all}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
failed=()

run() {  # run NAME CMD...: tee the output into $out/NAME.log, report and remember the exit status
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name exit $rc"
    if [[ $rc -ne 0 ]]; then failed+=("$name"); fi
}

has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/device.txt" \
    || failed+=(nvidia-smi)
"$PYTHON" - <<'PY' > "$out/kernels.txt" 2>&1 || failed+=(kernel-resources)  # registers, local memory and shared memory per kernel
import subprocess, tempfile
from fp4kit.runtime import loader
for name in loader.kernel_names():
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(loader.compile_offline(name, "sm_90a") + b"\0")  # CuPy strips the ELF's last byte
        f.flush()
        print(subprocess.run(["cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout)
PY
grep -E "Function|REG" "$out/kernels.txt" | paste - - | awk '{print $2, $4, $5, $6, $7, $8}'
# every kernel module compiled once, in parallel, into CuPy's disk cache before anything is timed
run precompile "$PYTHON" scripts/precompile_kernels.py
if has tests; then
    # several pytest processes at once (scripts/parallel_pytest.py; GPU_TEST_JOBS, default half the
    # cores up to 8 and one per 12 GiB of GPU memory): the tests are mostly host work, and one
    # process leaves the GPU idle
    run gpu-tests env FP4KIT_REQUIRE_GPU=1 "$PYTHON" scripts/parallel_pytest.py --jobs "${GPU_TEST_JOBS:-0}" \
        --logs "$out/gpu-tests" -m gpu tests
fi
if has multigpu; then  # needs 2 GPUs
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    run check-dist timeout 300 "$PYTHON" -m fp4kit.distributed.launch --nproc 2 tests/multigpu/check_dist.py
    run decode-check-tp2-ep2 timeout 300 "$PYTHON" -m fp4kit.distributed.launch --nproc 2 examples/decode.py --check --tp 2 --ep 2
    run decode-slice-tp2-ep2 timeout 300 "$PYTHON" -m fp4kit.distributed.launch --nproc 2 examples/decode.py \
        --preset v4-flash-slice --layers 4 --batch 1 --prompt-len 16 --new-tokens 64 --tp 2 --ep 2
fi
if has profile; then
    for size in "2048 7168" "16384 7168"; do
        run "ncu-${size// /x}" ncu --clock-control none -k regex:amax_quantize -s 2 -c 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
            --section MemoryWorkloadAnalysis --section WarpStateStats "$PYTHON" scripts/profile_quant.py $size
    done
fi
if has bench; then
    run benchmarks "$PYTHON" benchmarks/run_all.py --results "$out/results"
fi
if has sanitize; then
    # every kernel family once with small shapes (the script disables CuPy's pool itself)
    run memcheck-families timeout 900 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$PYTHON" scripts/sanitize_kernels.py
    run racecheck-families timeout 900 compute-sanitizer --tool racecheck --error-exitcode 9 \
        "$PYTHON" scripts/sanitize_kernels.py
    # the quantizers' adversarial edge cases on top
    subset="dtypes or dequantize or edge or graph or empty or (swiglu and dtype0)"
    run memcheck-quant env FP4KIT_NO_POOL=1 timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$PYTHON" -m pytest -q -x -m gpu tests/test_quant_gpu.py -k "$subset" -p no:cacheprovider
    run racecheck-quant timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 \
        "$PYTHON" -m pytest -q -x -m gpu tests/test_quant_gpu.py -k "edge or graph or empty" -p no:cacheprovider
fi
if (( ${#failed[@]} )); then
    echo "=== FAILED steps: ${failed[*]}"
    exit 1
fi
echo "=== every step passed"
