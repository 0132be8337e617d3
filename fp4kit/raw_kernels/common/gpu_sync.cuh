// Message passing between the blocks of one launch at GPU scope: a block publishes what it wrote
// with a release fence before the atomic that counts it, and a waiting thread spins on an acquire
// load, then fences before reading what the others published. An acquire-release fence by one
// thread is enough when a block barrier precedes it (the barrier orders the other threads' writes
// before it), and costs less than the sequentially consistent __threadfence.
#pragma once

namespace gpu_sync {

__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

}  // namespace gpu_sync
