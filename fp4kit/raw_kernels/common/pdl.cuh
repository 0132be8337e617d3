// Programmatic dependent launch (sm_90+). fp4kit launches the kernels of PDL-ready modules with
// the programmatic-serialization attribute (fp4kit/runtime/launch.py), so a kernel's blocks may
// be scheduled while the kernel before it in the stream is still running: its launch latency and
// whatever it does before `wait_prior` (reading its own constant weights) overlap that kernel.
//
// The contract every kernel of a PDL-ready module keeps (tests/test_compile.py checks the SASS):
//   * nothing is read that an earlier kernel may write, and nothing is written, before
//     `wait_prior()` returns (it returns once the earlier grids have completed and their memory
//     is visible, which also orders every kernel before those);
//   * the next kernel is released only after `wait_prior()`, so at most one kernel waits ahead
//     of the running one. By default a block releases it when it exits: released at the start, the
//     next kernel's waiting blocks took the SM slots that a multi-wave kernel's later blocks needed
//     (V4-Flash MoE at T = 1: 56 -> 60 µs). FP4_PDL_EARLY_RELEASE (FP4KIT_PDL=early) releases
//     right after the wait, for measurement.
// Launched without the attribute (eager launches, or FP4KIT_PDL=0), both are no-ops.
#pragma once

namespace pdl {

__device__ __forceinline__ void wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Where a kernel has waited: the first statement of one that reads nothing ahead of its inputs.
__device__ __forceinline__ void enter() {
    wait_prior();
#ifdef FP4_PDL_EARLY_RELEASE
    release_next();
#endif
}

}  // namespace pdl
