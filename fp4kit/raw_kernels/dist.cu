// Kernels of the sharded layers (fp4kit/distributed): the expert-parallel MoE's fixed-capacity
// all-to-all plans, row copies by index, and the row-parallel Linear's final cast.
// fp4kit/reference/dist.py is the specification.
//
//   dist_plan_send   one block of 1024 threads. From the router's per-expert counts [E] (zeroed
//                    here for the next call), tickets [P] and expert ids [P] (P = T * top_k
//                    pairs): destination rank d = id / per_rank; the pair's position in d's send
//                    chunk is (pairs of d's lower experts) + ticket, so each chunk is sorted by
//                    expert. Writes pair_slot [P] = d * capacity + position (world * capacity when
//                    the position is >= capacity: dropped, the status flag is set), the routing
//                    weight of every sent slot send_weight [world * capacity], and send_counts
//                    [world, per_rank]: the rows actually sent per destination and local expert.
//   dist_plan_recv   one block of 1024 threads. From recv_counts [world, per_rank] (source s, local
//                    expert e): the received rows of every local expert made contiguous in
//                    (expert, source, position) order, as the grouped MoE GEMM reads them:
//                    offsets [per_rank + 1], active [per_rank], num_active [1], and per sorted row
//                    its slot in the receive buffer (row_token [world * capacity], slot = s *
//                    capacity + position) and its SwiGLU row factor (row_weight: the received
//                    routing weight, or 1; 0 for the unused tail rows, which keeps their stale
//                    values out of the activation's amax).
//   dist_copy_rows_* grid-stride over rows i < n (and < *n_device when given), one block per row,
//                    words of 16, 4 or 1 bytes: dst[dst_row(i)] = src[src_row(i)] with src_row(i) =
//                    src_rows ? src_rows[i] : i / src_div, dst_row(i) = dst_rows ? dst_rows[i] : i;
//                    rows with dst_row(i) >= dst_limit are skipped (dropped pairs).
//   dist_owner_slots grid-stride over pairs p < P: out[p] = slot_all[(ids[p] / per_rank) * P + p],
//                    the slot the owner of the pair's expert chose (replicated tokens: the ranks'
//                    tickets come from atomics and differ, so each rank's own pair_slot is only
//                    valid for its own experts' chunk).
//   dist_bias_to_bf16 grid-stride: out [rows, n] bf16 = acc fp32 (+ bias fp32 or bf16 [n]).
//
// Every grid is sized for the worst case; nothing depends on a count read back on the host.
#include <cuda_bf16.h>

#include "common/block_scan.cuh"
#include "common/status.cuh"

constexpr unsigned kPlanThreads = 1024;
constexpr unsigned kMaxExperts = 1024;

extern "C" __global__ void __launch_bounds__(kPlanThreads) dist_plan_send(
    unsigned* counts, const unsigned* tickets, const int* ids, const float* weights, unsigned E, unsigned per_rank,
    unsigned world, unsigned capacity, unsigned pairs, unsigned* pair_slot, unsigned* send_counts, float* send_weight,
    unsigned* status) {
    __shared__ unsigned start[kMaxExperts + 1];  // exclusive scan of counts over all experts
    const unsigned e = threadIdx.x;
    const unsigned c = e < E ? counts[e] : 0u;
    unsigned total;
    const unsigned s = block_exclusive_scan(c, total);
    if (e < E) start[e] = s;
    if (e == 0) start[E] = total;
    __syncthreads();
    if (e < E) {
        const unsigned base = start[(e / per_rank) * per_rank];
        send_counts[e] = min(s + c - base, capacity) - min(s - base, capacity);  // sorted: the tail is dropped
        counts[e] = 0;  // ready for the next call (this thread was its only reader)
    }
    bool overflow = false;
    for (unsigned p = threadIdx.x; p < pairs; p += blockDim.x) {
        const unsigned ex = (unsigned)ids[p], dest = ex / per_rank;
        const unsigned pos = start[ex] - start[dest * per_rank] + tickets[p];
        if (pos < capacity) {
            const unsigned slot = dest * capacity + pos;
            pair_slot[p] = slot;
            send_weight[slot] = weights[p];
        } else {
            pair_slot[p] = world * capacity;
            overflow = true;
        }
    }
    if (__syncthreads_or(overflow) && threadIdx.x == 0) atomicOr(status, FP4_STATUS_EP_CAPACITY_OVERFLOW);
}

extern "C" __global__ void __launch_bounds__(kPlanThreads) dist_plan_recv(
    const unsigned* recv_counts, const float* recv_weight, unsigned per_rank, unsigned world, unsigned capacity,
    int use_weight, unsigned* offsets, unsigned* active, unsigned* num_active, unsigned* row_token, float* row_weight) {
    __shared__ unsigned row_start[kMaxExperts];      // [s * per_rank + e]: first sorted row of (source s, expert e)
    __shared__ unsigned src_start[kMaxExperts + 1];  // [s * per_rank + e]: rows before (s, e) in source-major order
    __shared__ unsigned expert_start[kMaxExperts + 1];
    const unsigned n = world * per_rank, j = threadIdx.x;

    // expert-major order j = e * world + s gives every (expert, source) group its first sorted row
    const unsigned s = j % world, e = j / world;
    const unsigned c = j < n ? recv_counts[s * per_rank + e] : 0u;
    unsigned total;
    const unsigned r0 = block_exclusive_scan(c, total);
    if (j < n) {
        row_start[s * per_rank + e] = r0;
        if (s == 0) expert_start[e] = r0;
    }
    if (j == 0) expert_start[per_rank] = total;

    // source-major order: where each (source, expert) group sits in the source's chunk
    unsigned total_src;
    const unsigned g = block_exclusive_scan(j < n ? recv_counts[j] : 0u, total_src);
    if (j < n) src_start[j] = g;
    if (j == 0) src_start[n] = total_src;
    __syncthreads();

    const unsigned rows_e = j < per_rank ? expert_start[j + 1] - expert_start[j] : 0u;
    unsigned n_active;
    const unsigned rank = block_exclusive_scan(rows_e > 0 ? 1u : 0u, n_active);
    if (j < per_rank) {
        offsets[j] = expert_start[j];
        if (rows_e > 0) active[rank] = j;
    }
    if (j == 0) offsets[per_rank] = total, *num_active = n_active;

    const unsigned slots = world * capacity;
    for (unsigned q = threadIdx.x; q < slots; q += blockDim.x) {
        const unsigned src = q / capacity, pos = q % capacity, base = src * per_rank;
        const unsigned first = src_start[base];
        if (pos >= src_start[base + per_rank] - first) continue;  // an unused slot of the chunk
        unsigned lo = 0, hi = per_rank - 1;  // the last expert whose group starts at or before pos
        while (lo < hi) {
            const unsigned mid = (lo + hi + 1) >> 1;
            if (src_start[base + mid] - first <= pos) lo = mid;
            else hi = mid - 1;
        }
        const unsigned row = row_start[base + lo] + pos - (src_start[base + lo] - first);
        row_token[row] = q;
        row_weight[row] = use_weight ? recv_weight[q] : 1.0f;
    }
    for (unsigned r = total + threadIdx.x; r < slots; r += blockDim.x) row_token[r] = 0u, row_weight[r] = 0.0f;
}

template <typename Word>
__device__ void copy_rows(const Word* src, Word* dst, unsigned words_per_row, unsigned n, const unsigned* n_device,
                          const unsigned* src_rows, unsigned src_div, const unsigned* dst_rows, unsigned dst_limit) {
    const unsigned rows = n_device ? min(n, *n_device) : n;
    for (unsigned i = blockIdx.x; i < rows; i += gridDim.x) {
        const unsigned d = dst_rows ? dst_rows[i] : i;
        if (d >= dst_limit) continue;
        const unsigned s = src_rows ? src_rows[i] : i / src_div;
        const Word* from = src + (size_t)s * words_per_row;
        Word* to = dst + (size_t)d * words_per_row;
        for (unsigned w = threadIdx.x; w < words_per_row; w += blockDim.x) to[w] = from[w];
    }
}

#define FP4_DEFINE_COPY_ROWS(SUFFIX, WORD)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) dist_copy_rows_##SUFFIX(                                  \
        const WORD* src, WORD* dst, unsigned words_per_row, unsigned n, const unsigned* n_device,               \
        const unsigned* src_rows, unsigned src_div, const unsigned* dst_rows, unsigned dst_limit) {             \
        copy_rows<WORD>(src, dst, words_per_row, n, n_device, src_rows, src_div, dst_rows, dst_limit);          \
    }

FP4_DEFINE_COPY_ROWS(u128, uint4)
FP4_DEFINE_COPY_ROWS(u32, unsigned)
FP4_DEFINE_COPY_ROWS(u8, unsigned char)

extern "C" __global__ void __launch_bounds__(256) dist_owner_slots(const unsigned* slot_all, const int* ids,
                                                                   unsigned per_rank, unsigned pairs,
                                                                   unsigned* out) {
    for (unsigned p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x)
        out[p] = slot_all[(size_t)((unsigned)ids[p] / per_rank) * pairs + p];
}

extern "C" __global__ void __launch_bounds__(256) dist_bias_to_bf16(const float* acc, const float* bias_f32,
                                                                    const __nv_bfloat16* bias_bf16,
                                                                    __nv_bfloat16* out, unsigned rows, unsigned n) {
    const size_t total = (size_t)rows * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        float v = acc[i];
        const unsigned col = (unsigned)(i % n);
        if (bias_f32) v = __fadd_rn(v, bias_f32[col]);
        else if (bias_bf16) v = __fadd_rn(v, __bfloat162float(bias_bf16[col]));
        out[i] = __float2bfloat16_rn(v);
    }
}
