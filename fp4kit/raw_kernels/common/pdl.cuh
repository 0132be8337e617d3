// Programmatic dependent launch (sm_90+). fp4kit launches the kernels of PDL-ready modules with
// the programmatic-serialization attribute (fp4kit/runtime/launch.py), so a kernel's blocks may
// be scheduled while the kernel before it in the stream is still running: its launch latency and
// whatever it does before `wait_prior` (reading its own constant weights) overlap that kernel.
//
// The contract every kernel of a PDL-ready module keeps (tests/test_compile.py checks the SASS):
//   * nothing is read that an earlier kernel may write, and nothing is written, before
//     `wait_prior()` returns (it returns once the earlier grids have completed and their memory
//     is visible, which also orders every kernel before those);
//   * the next kernel is released when a block exits (no griddepcontrol.launch_dependents):
//     released right after the wait, its waiting blocks took the SM slots that a multi-wave
//     kernel's later blocks needed (measured: V4-Flash MoE at T = 1, 56 -> 60 µs).
// A kernel that reads nothing ahead of its inputs waits as its first statement. Launched without
// the attribute (eager launches, or FP4KIT_PDL=0), the wait is a no-op.
//
// The exceptions to the second rule, all for a grid that is a single wave (every block already
// resident, so no waiting block can take a later block's slot): the small row kernels of
// elementwise.cu (one block per row) and hyper.cu's hc_pre_norm release the next kernel at their
// start, and the GEMV kernels of gemm.cu once their first weights are in flight (`release_next`,
// when their launch asks for it: ops/elementwise.py `EARLY_RELEASE`, ops/gemm.py
// `GEMV_EARLY_RELEASE`), the wgmma GEMMs' staging launches (`gemm_stage_*`) right after their
// wait (`STAGE_EARLY_RELEASE`), and the MoE's small-T router (`moe_route_*`) right after its wait
// when the gate|up launch after it puts its shared expert first (ops/moe.py `route_small`). The
// next kernel's blocks then take the SMs left free or freed first and issue their weight loads
// ahead of their own wait while this kernel runs or drains. The next kernel's `wait_prior` still
// waits for this kernel's completion.
//
// The one exception to the first rule follows from the last: a kernel released by a kernel that
// released it after its own wait may read what was final at that wait. The small-T MoE gate|up
// launch's shared-expert blocks (moe.cu `gate_up`, `shared_first`, W4A16) read the layer input
// through L2 and write their own output rows (read only by the next launch) without waiting, while
// the router that released them works.
#pragma once

namespace pdl {

__device__ __forceinline__ void wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel's blocks be scheduled now (see above); a no-op without PDL.
__device__ __forceinline__ void release_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace pdl
