// Mixture-of-Experts kernels: DeepSeek routing, dispatch without the host, grouped NVFP4 expert
// GEMMs, and the weighted combine. fp4kit/reference/moe.py is the specification.
//
//   moe_router_logits_*  grid (ceil(E / (8 / wpe)), T), 256 threads: logits [T, E] fp32 = x [T, H]
//                  (bf16 or fp32) . gate weight [E, H] (bf16 or fp32), wpe warps per (token, expert).
//   moe_router     grid T (one block per token), 256 threads: from the logits, bias [E] (selection
//                  only, optional), hash routing
//                  (tid2eid [V, top_k], token_ids [T]) optional: an id outside [0, V) reads row 0
//                  and or-s FP4_STATUS_TOKEN_RANGE into status [1]. Writes ids [T, top_k] (int32),
//                  weights [T, top_k] (fp32), and for each (token, slot) a ticket: its position
//                  among the pairs routed to the same expert, from an atomic increment of
//                  counts [E] (zero on entry). With done (uint32 [1], zero on entry and left zero)
//                  the last block to finish then runs the dispatch below (no moe_dispatch launch).
//   moe_dispatch   one block of 1024 threads. Exclusive scan of counts into offsets [E + 1],
//                  the active experts in id order (active [E], num_active [1]), each pair's row in
//                  expert-sorted order (slot_row [T * top_k]), the token and weight of every sorted
//                  row (row_token, row_weight); then zeroes counts for the next call. Counts or
//                  tickets of another call or-s FP4_STATUS_MOE_DISPATCH into status [1] (dispatch_block).
//   moe_gemm_*_<T> grid (ceil(N / 128), min(E, T * top_k)), 256 threads, the GEMM engine's shared
//                  memory: block (i, s) computes weight rows 128i .. 128i+127 of active expert
//                  active[s] for all its rows, 8T at a time; blocks with s >= num_active exit at once.
//                  The weights are stacked tiled experts (fp4kit/formats.py to_tiled, one after
//                  another) with a decode factor per expert [E] (or per row [E, N]); the activation
//                  rows are gathered through row_token (from the token order) or taken in sorted
//                  order; the output is written in sorted order (moe_gemm_swiglu_bf16_<T>: the
//                  SwiGLU of W13's gate|up pairs, bf16 [rows, N / 2], in place of h + a SwiGLU launch).
//                  The swiglu and dense builds also run one dense expert (a folded shared expert)
//                  on block rows of their own (DenseExpert).
//   moe_combine    grid T, 256 threads: out[t] = sum over slots of y[slot_row] (times the routing
//                  weight unless it was applied before the down projection) + shared[t], in slot order.
//   moe_small_gate_up_* / moe_small_down_*  the small-T path (decode), which needs no dispatch: see
//                  the section "The small-T path" below.
//
// Every grid is sized for the worst case and exits early, so nothing depends on a count read back.
#include "common/block_scan.cuh"
#include "common/gemm_engine.cuh"

constexpr int kRouterThreads = 256;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 16;
#define FP4_INF __int_as_float(0x7F800000)
#include "common/status.cuh"
#include "common/nvfp4.cuh"
#include "common/pdl.cuh"
#include "common/residual_norm.cuh"

enum ScoreFunc { kSqrtSoftplus = 0, kSigmoid = 1, kSoftmax = 2 };

__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p) { return __bfloat162float(*p); }
// Eight consecutive values as fp32 from 16-byte aligned p (one or two 16-byte loads).
__device__ __forceinline__ void load8_f32(const float* p, float v[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8_f32(const __nv_bfloat16* p, float v[8]) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

// Larger value first; equal values: lower index first.
__device__ __forceinline__ bool better(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float w = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        const int j = __shfl_xor_sync(0xFFFFFFFFu, i, off);
        if (better(w, j, v, i)) v = w, i = j;
    }
}

// Block-wide argmax of vals[0, n); all threads get (value, index).
__device__ void block_argmax(const float* vals, int n, float& best_v, int& best_i) {
    __shared__ float wv[kRouterThreads / 32];
    __shared__ int wi[kRouterThreads / 32];
    float v = -FP4_INF;
    int i = 0x7FFFFFFF;
    for (int e = threadIdx.x; e < n; e += blockDim.x)
        if (better(vals[e], e, v, i)) v = vals[e], i = e;
    warp_argmax(v, i);
    if ((threadIdx.x & 31) == 0) wv[threadIdx.x >> 5] = v, wi[threadIdx.x >> 5] = i;
    __syncthreads();
    v = -FP4_INF, i = 0x7FFFFFFF;
    for (int w = 0; w < kRouterThreads / 32; ++w)
        if (better(wv[w], wi[w], v, i)) v = wv[w], i = wi[w];
    __syncthreads();
    best_v = v, best_i = i;
}

// Order-preserving key of a score (a larger value, a larger key; -0 as +0; select holds no NaN).
__device__ __forceinline__ unsigned score_order_key(float v) {
    unsigned u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The top_k best of select[0, E) in pick order into chosen (better(): the larger value, then the
// lower index), by one warp and no block barrier. Lane l holds the keys of experts l, l + 32, ..
// in registers and its best of them; a pick is one warp maximum of the lanes' best keys and one
// warp minimum of the expert indices holding it (redux.sync both), and the winning lane marks its
// expert taken (-inf: still a candidate, as in a block-wide argmax over the array). Keys 0 (no
// expert) lie below every score, -inf included. Warp 0 calls it.
// (The shared-memory version, a shuffle argmax and a rescan of shared memory per pick, held the
// last block of the small-T router launch ~6,000 cycles with the scores: phase stamps, H100.)
template <int kEach>
__device__ void warp_topk_regs(const float* select, unsigned E, unsigned top_k, int* chosen) {
    const unsigned lane = threadIdx.x & 31;
    unsigned key[kEach];
#pragma unroll
    for (int j = 0; j < kEach; ++j) {
        const unsigned e = lane + 32u * j;
        key[j] = e < E ? score_order_key(select[e]) : 0u;
    }
    for (unsigned r = 0; r < top_k; ++r) {
        unsigned best = key[0], at = 0u;  // the lane's best key and its slot (the lowest among equals)
#pragma unroll
        for (int j = 1; j < kEach; ++j)
            if (key[j] > best) best = key[j], at = j;
        const unsigned top = __reduce_max_sync(0xFFFFFFFFu, best);
        const unsigned e = __reduce_min_sync(0xFFFFFFFFu, best == top ? lane + 32u * at : 0xFFFFFFFFu);
        if (lane == 0) chosen[r] = (int)e;
#pragma unroll
        for (int j = 0; j < kEach; ++j)  // the pick's lane marks it taken
            if (e == lane + 32u * j) key[j] = score_order_key(-FP4_INF);
    }
    __syncwarp();
}

__device__ void warp_topk(const float* select, unsigned E, unsigned top_k, int* chosen) {
    static_assert(kMaxExperts <= 32 * 32, "32 keys a lane at most");
    if (E <= 256u) warp_topk_regs<8>(select, E, top_k, chosen);
    else warp_topk_regs<kMaxExperts / 32>(select, E, top_k, chosen);
}

__device__ float block_sum(float v) {
    __shared__ float ws[kRouterThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < kRouterThreads / 32; ++w) s += ws[w];
    __syncthreads();
    return s;
}

// Block-wide max of unsigned values (fp32 bits of |v|); every thread gets it. All threads call it.
__device__ unsigned block_max_bits(unsigned m) {
    __shared__ unsigned warp_max[32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
    __syncthreads();  // warp_max is reused by the next call
    return m;
}

// An NVFP4 activation written by a launch for the next one (linear layout: 8 code bytes and one
// E4M3 scale byte per 16 elements, and the encode scale S), as the quantize launch writes it.
struct Nvfp4Out {
    unsigned char* packed;
    unsigned char* scales;
    float* global;
};

// max of `count` per-block maxima (fp32 bits of |v|), which other blocks of this launch may have
// written (read past L1), by the whole block; every thread gets it
__device__ __forceinline__ unsigned block_max_of_words(const unsigned* words, unsigned count) {
    unsigned m = 0;
    for (unsigned i = threadIdx.x; i < count; i += blockDim.x) m = max(m, __ldcg(words + i));
    return block_max_bits(m);
}

// A maximum |v| (fp32 bits) as the quantize launch takes it: a subnormal one flushes to zero, a
// non-finite one is recorded in `status` (by thread 0 where `records`: one block of a launch).
__device__ __forceinline__ unsigned quantize_amax_bits(unsigned m, unsigned* status, bool records) {
    if (records && threadIdx.x == 0 && m >= 0x7F800000u) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);
    return m < 0x00800000u ? 0u : m;
}

// The encode scale S of a maximum this block found, as the quantize launch derives it.
__device__ __forceinline__ float encode_scale_of_amax(unsigned amax_bits, unsigned* status) {
    return fp4_global_scale_from_amax(__uint_as_float(quantize_amax_bits(amax_bits, status, true)));
}

__device__ __forceinline__ void store_nvfp4_block(const Nvfp4Out& o, unsigned b, const float v[FP4_BLOCK],
                                                  unsigned vmax_bits, float s) {
    uint2 q;
    const unsigned sf = fp4_encode_block(v, vmax_bits, s, q);
    reinterpret_cast<uint2*>(o.packed)[b] = q;
    o.scales[b] = (unsigned char)sf;
}

// One row of K = 16 nb values (nb <= 2 * blockDim.x) quantized to NVFP4 by the whole block with
// the encode scale of its own max |x| (the quantize launch's arithmetic on a one-row tensor): each
// thread's blocks are loaded once, kept in registers for the block-wide max, then encoded.
template <typename T>
__device__ void block_quantize_row(const T* x, unsigned nb, const Nvfp4Out& o, unsigned* status) {
    Fp4Raw16<T> r[2];
    unsigned m = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned b = threadIdx.x + i * blockDim.x;
        if (b < nb) {
            r[i] = fp4_fetch16(x + (size_t)b * FP4_BLOCK);
            m = max(m, fp4_raw_abs_max_bits(r[i]));
        }
    }
    const float s = encode_scale_of_amax(block_max_bits(m), status);
    if (threadIdx.x == 0) *o.global = s;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned b = threadIdx.x + i * blockDim.x;
        if (b < nb) {
            float v[FP4_BLOCK];
            fp4_expand16(r[i], v);
            store_nvfp4_block(o, b, v, fp4_raw_abs_max_bits(r[i]), s);
        }
    }
}

// logits[t, e] = x[t] . gate_w[e] in fp32: grid (ceil(E / (8 / wpe)), T), `wpe` warps per expert
// (1, 2, 4 or 8: moe.py `router_warps_per_expert`), each over one contiguous
// H / wpe slice, a fixed-order warp reduction, then the slices added in order. Spread over many
// blocks and warps so that even one token reads the gate weight at full bandwidth: with one warp
// per expert, V4-Flash's 2 MB gate ran on 32 blocks with 512 KB in flight. With H / wpe a
// multiple of 8 and 16-byte aligned rows each lane takes runs of 8 (16-byte loads, several in
// flight); else lanes stride over the slice one value at a time. The first runs of the gate
// weight (a constant of the layer) are loaded before the wait for the kernel before (pdl), which
// wrote x.
template <typename XT, typename WT>
__device__ void router_logits(const XT* x, const WT* gate_w, unsigned E, unsigned H, unsigned wpe, float* logits,
                              bool release = false) {
    __shared__ float slice_sum[kRouterThreads / 32];
    const unsigned t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned e = blockIdx.x * (kRouterThreads / 32 / wpe) + warp / wpe, slice = warp % wpe;
    const unsigned k_lo = slice * (H / wpe), k_hi = slice + 1 == wpe ? H : k_lo + H / wpe;
    const XT* xt = x + (size_t)t * H;
    const WT* we = gate_w + (size_t)min(e, E - 1) * H;
    const bool runs = (H / wpe) % 8 == 0 && H % wpe == 0 && (reinterpret_cast<size_t>(xt) | reinterpret_cast<size_t>(we)) % 16 == 0;
    constexpr int kRuns = 4;  // runs of 8 loaded before any is multiplied
    float a[kRuns][8], b[kRuns][8];
    // weight runs of k0 .. (a run past the slice loads a valid run that is not added)
    auto load_weights = [&](unsigned k0) {
#pragma unroll
        for (int j = 0; j < kRuns; ++j) load8_f32(we + min(k0 + j * 256, k_hi - 8), b[j]);
    };
    if (runs && e < E) load_weights(k_lo + 8 * lane);
    pdl::wait_prior();
    // the small-T gate|up launch's shared-expert blocks then run while this launch does (their
    // input x is final: the wait above returned); only a single-wave grid is released early
    if (release) pdl::release_next();
    float acc = 0.0f;
    if (e < E) {  // warp-uniform; no return before the block barrier below
        if (runs) {
            for (unsigned k0 = k_lo + 8 * lane; k0 < k_hi; k0 += kRuns * 256) {
                if (k0 != k_lo + 8 * lane) load_weights(k0);
#pragma unroll
                for (int j = 0; j < kRuns; ++j) load8_f32(xt + min(k0 + j * 256, k_hi - 8), a[j]);
#pragma unroll
                for (int j = 0; j < kRuns; ++j)
                    if (k0 + j * 256 < k_hi) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc = fmaf(a[j][i], b[j][i], acc);
                    }
            }
        } else {
            for (unsigned k = k_lo + lane; k < k_hi; k += 32) acc = fmaf(load_f32(xt + k), load_f32(we + k), acc);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, off);
    }
    if (wpe == 1) {
        if (e < E && lane == 0) logits[(size_t)t * E + e] = acc;
        return;
    }
    if (lane == 0) slice_sum[warp] = acc;
    __syncthreads();
    if (e < E && slice == 0 && lane == 0) {
        float sum = slice_sum[warp];
        for (unsigned s = 1; s < wpe; ++s) sum += slice_sum[warp + s];
        logits[(size_t)t * E + e] = sum;
    }
}

__device__ void router(const float* logits, const float* bias, const int* token_ids, const int* tid2eid,
                       unsigned vocab, unsigned* status, unsigned E, unsigned top_k, int score_func, unsigned n_group, unsigned topk_group,
                       int renormalize, float routed_scale, int* ids, float* weights, unsigned* counts,
                       unsigned* tickets, unsigned t) {
    __shared__ float score[kMaxExperts];
    __shared__ float select[kMaxExperts];
    __shared__ int chosen[kMaxTopK];
    // __ldcg: in moe_route the logits of the other blocks of this token were written by them; the
    // selection bias, a constant of the layer, is loaded alongside (held in select until used)
    for (unsigned e = threadIdx.x; e < E; e += blockDim.x) {
        score[e] = __ldcg(logits + (size_t)t * E + e);
        select[e] = bias ? bias[e] : 0.0f;
    }
    __syncthreads();
    float mx = 0.0f, denom = 1.0f;
    if (score_func == kSoftmax) {
        float best;
        int at;
        block_argmax(score, E, best, at);
        mx = best;
        float part = 0.0f;
        for (unsigned e = threadIdx.x; e < E; e += blockDim.x) part += expf(score[e] - mx);
        denom = block_sum(part);
    }
    for (unsigned e = threadIdx.x; e < E; e += blockDim.x) {
        const float l = score[e];
        if (!(fabsf(l) <= 3.402823466e38f)) atomicOr(status, FP4_STATUS_NONFINITE_INPUT);  // NaN/Inf input
        float s;
        if (score_func == kSqrtSoftplus) s = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
        else if (score_func == kSigmoid) s = 1.0f / (1.0f + expf(-l));
        else s = expf(l - mx) / denom;
        score[e] = s;
        // a NaN never wins a comparison, so the top-k would pick no index for it: rank it last
        const float sel = s + select[e];  // the bias
        select[e] = isnan(sel) ? -FP4_INF : sel;
    }
    __syncthreads();
    if (tid2eid) {
        // An id outside [0, vocab) reads row 0 (as the embedding gather does) and is recorded.
        const int tok = token_ids[t];
        const bool in_range = tok >= 0 && (unsigned)tok < vocab;
        if (threadIdx.x == 0 && !in_range) atomicOr(status, FP4_STATUS_TOKEN_RANGE);
        if (threadIdx.x < top_k) chosen[threadIdx.x] = tid2eid[(size_t)(in_range ? tok : 0) * top_k + threadIdx.x];
    } else {
        if (n_group > 1) {  // V3: keep the topk_group groups with the best top-2 sums
            __shared__ float group_score[32];
            const unsigned per = E / n_group;
            if (threadIdx.x < n_group) {
                float a = -FP4_INF, b = -FP4_INF;
                for (unsigned j = 0; j < per; ++j) {
                    const float v = select[threadIdx.x * per + j];
                    if (v > a) b = a, a = v;
                    else if (v > b) b = v;
                }
                group_score[threadIdx.x] = a + b;
            }
            __syncthreads();
            __shared__ int keep[32];
            if (threadIdx.x == 0) {
                for (unsigned g = 0; g < n_group; ++g) keep[g] = 0;
                for (unsigned r = 0; r < topk_group; ++r) {
                    int bi = -1;
                    for (unsigned g = 0; g < n_group; ++g)
                        if (!keep[g] && (bi < 0 || group_score[g] > group_score[bi])) bi = g;
                    keep[bi] = 1;
                }
            }
            __syncthreads();
            for (unsigned e = threadIdx.x; e < E; e += blockDim.x)
                if (!keep[e / per]) select[e] = -FP4_INF;
            __syncthreads();
        }
        if (threadIdx.x < 32) warp_topk(select, E, top_k, chosen);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane j writes pick j; every lane adds the picks' scores in pick order
        const unsigned j = threadIdx.x;
        const int e = j < top_k ? chosen[j] : 0;
        const float s = j < top_k ? score[e] : 0.0f;
        float sum = 0.0f;
        for (unsigned i = 0; i < top_k; ++i) sum += __shfl_sync(0xFFFFFFFFu, s, i);
        if (j < top_k) {
            const float w = renormalize ? s / sum : s;
            ids[(size_t)t * top_k + j] = e;
            weights[(size_t)t * top_k + j] = w * routed_scale;
        }
    }
    // dispatch tickets (the sorted path); the small-T path reads ids directly and passes no counts
    if (counts && threadIdx.x < top_k) tickets[(size_t)t * top_k + threadIdx.x] = atomicAdd(counts + chosen[threadIdx.x], 1u);
}

#define FP4_DEFINE_ROUTER_LOGITS(SUFFIX, XT, WT)                                                          \
    extern "C" __global__ void __launch_bounds__(kRouterThreads)                                          \
        moe_router_logits_##SUFFIX(const XT* x, const WT* gate_w, unsigned E, unsigned H, unsigned wpe, float* logits) { \
        router_logits<XT, WT>(x, gate_w, E, H, wpe, logits);                                              \
    }

FP4_DEFINE_ROUTER_LOGITS(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
FP4_DEFINE_ROUTER_LOGITS(bf16_f32, __nv_bfloat16, float)
FP4_DEFINE_ROUTER_LOGITS(f32_f32, float, float)
FP4_DEFINE_ROUTER_LOGITS(f32_bf16, float, __nv_bfloat16)

// The dispatch, by one block of kPer experts per thread (blockDim.x * kPer >= E): offsets by an
// exclusive scan of counts in expert order, the active experts in id order, each pair's sorted row
// (its expert's offset + its ticket) with that row's token and weight; counts back to zero. Integer
// arithmetic in a fixed order: the same outputs for any block size. The pairs' data may have been
// written by other blocks of this launch (the router's last block), so it is read past L1.
// Counts that do not sum to the call's pairs, or a ticket past its expert's count, are another
// call's (two overlapping calls of one layer share its counters): FP4_STATUS_MOE_DISPATCH, and every
// row stays inside the call's buffers. Counts off: no expert is active and pair p takes row p.
// A ticket off: its pair takes the last row.
template <int kPer>
__device__ void dispatch_block(unsigned* counts, const unsigned* tickets, const int* ids, const float* weights,
                               unsigned E, unsigned pairs, unsigned top_k, unsigned* offsets, unsigned* active,
                               unsigned* num_active, unsigned* slot_row, unsigned* row_token, float* row_weight,
                               unsigned* status) {
    __shared__ unsigned sh_offsets[kMaxExperts + 1];
    const unsigned e0 = threadIdx.x * kPer;
    unsigned c[kPer], sum = 0, nonzero = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        c[j] = e0 + j < E ? __ldcg(counts + e0 + j) : 0u;
        sum += c[j], nonzero += c[j] > 0;
    }
    unsigned total, n_active;
    unsigned start = block_exclusive_scan(sum, total);
    unsigned rank = block_exclusive_scan(nonzero, n_active);
    const bool ours = total == pairs;  // block-uniform
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        const unsigned e = e0 + j;
        if (e < E) {
            offsets[e] = sh_offsets[e] = ours ? start : 0u;
            if (ours && c[j] > 0) active[rank++] = e;
            counts[e] = 0;  // ready for the next call (every reader of counts ran before)
        }
        start += c[j];
    }
    if (threadIdx.x == 0) {
        offsets[E] = sh_offsets[E] = ours ? total : 0u;
        *num_active = ours ? n_active : 0u;
        if (!ours) atomicOr(status, FP4_STATUS_MOE_DISPATCH);
    }
    __syncthreads();
    bool off = false;
    for (unsigned p = threadIdx.x; p < pairs; p += blockDim.x) {
        unsigned row = p;
        if (ours) {
            const unsigned e = (unsigned)__ldcg(ids + p);
            row = sh_offsets[e] + __ldcg(tickets + p);
            if (row >= sh_offsets[e + 1]) row = pairs - 1u, off = true;
        }
        slot_row[p] = row;
        row_token[row] = p / top_k;
        row_weight[row] = __ldcg(weights + p);
    }
    if (off) atomicOr(status, FP4_STATUS_MOE_DISPATCH);
}

extern "C" __global__ void __launch_bounds__(kRouterThreads) moe_router(
    const float* logits, const float* bias, const int* token_ids, const int* tid2eid, unsigned vocab, unsigned* status,
    unsigned E, unsigned top_k, int score_func, unsigned n_group, unsigned topk_group, int renormalize, float routed_scale, int* ids,
    float* weights, unsigned* counts, unsigned* tickets, unsigned* done, unsigned pairs, unsigned* offsets,
    unsigned* active, unsigned* num_active, unsigned* slot_row, unsigned* row_token, float* row_weight) {
    pdl::wait_prior();
    router(logits, bias, token_ids, tid2eid, vocab, status, E, top_k, score_func, n_group, topk_group, renormalize, routed_scale,
           ids, weights, counts, tickets, blockIdx.x);
    if (!done) return;
    // the dispatch in the last block to finish, instead of a launch of its own
    __shared__ unsigned last;  // this block's ids, weights and tickets (and its count atomics) published
    if (!gpu_sync::last_to_arrive(done, gridDim.x, &last)) return;  // block-uniform
    static_assert(kRouterThreads * 4 >= kMaxExperts, "four experts per thread cover every expert");
    dispatch_block<4>(counts, tickets, ids, weights, E, pairs, top_k, offsets, active, num_active, slot_row, row_token,
                      row_weight, status);
    if (threadIdx.x == 0) *done = 0u;  // every block has arrived
}

// moe_route_<x>_<w>: the small-T path's first launch, grid (ceil(E / 8), T), 256 threads. The
// logits of moe_router_logits; the last block of a token to finish (a per-token counter it then
// resets) runs the router for that token and writes the token's max |x| as fp32 bits to
// x_amax[t] (the W4A4 input's amax, reduced over the tokens by the next launch). `release`
// (single-wave grids only, common/pdl.cuh): the next launch is released right after the wait, for
// the gate|up launch's shared-expert blocks (shared_first) to run beside this one.
template <typename XT, typename WT>
__device__ void route_fused(const XT* x, const WT* gate_w, unsigned E, unsigned H, unsigned wpe, float* logits, unsigned* done,
                            unsigned* x_amax, Nvfp4Out x_q, const float* bias, const int* token_ids, const int* tid2eid,
                            unsigned vocab, unsigned* status, unsigned top_k, int score_func, unsigned n_group,
                            unsigned topk_group, int renormalize, float routed_scale, int* ids, float* weights,
                            int release) {
    __shared__ unsigned last;
    const unsigned t = blockIdx.y;
    router_logits<XT, WT>(x, gate_w, E, H, wpe, logits, release != 0);
    if (!gpu_sync::last_to_arrive(done + t, gridDim.x, &last)) return;  // block-uniform
    router(logits, bias, token_ids, tid2eid, vocab, status, E, top_k, score_func, n_group, topk_group, renormalize,
           routed_scale, ids, weights, nullptr, nullptr, t);
    if (x_amax) {
        unsigned m = 0;
        for (unsigned k = threadIdx.x; k < H; k += blockDim.x) m = max(m, fp4_abs_bits(load_f32(x + (size_t)t * H + k)));
        m = block_max_bits(m);
        if (threadIdx.x == 0) x_amax[t] = m;
    }
    // W4A4 at T = 1 (the host's rule; H <= 32 * blockDim.x): this block is the grid's last, and
    // quantizes the layer input for the gate|up launch
    if (x_q.packed) block_quantize_row(x + (size_t)t * H, H / FP4_BLOCK, x_q, status);
    if (threadIdx.x == 0) done[t] = 0u;  // every block of this token has counted
}

#define FP4_DEFINE_ROUTE(SUFFIX, XT, WT)                                                                  \
    extern "C" __global__ void __launch_bounds__(kRouterThreads) moe_route_##SUFFIX(                      \
        const XT* x, const WT* gate_w, unsigned E, unsigned H, unsigned wpe, float* logits, unsigned* done, unsigned* x_amax, \
        unsigned char* xq_packed, unsigned char* xq_scales, float* xq_global, const float* bias, const int* token_ids, const int* tid2eid, unsigned vocab, unsigned* status,     \
        unsigned top_k, int score_func, unsigned n_group, unsigned topk_group, int renormalize, float routed_scale, \
        int* ids, float* weights, int release) {                                                          \
        route_fused<XT, WT>(x, gate_w, E, H, wpe, logits, done, x_amax, Nvfp4Out{xq_packed, xq_scales, xq_global}, bias, token_ids, tid2eid, vocab, status, top_k, \
                            score_func, n_group, topk_group, renormalize, routed_scale, ids, weights, release); \
    }

FP4_DEFINE_ROUTE(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
FP4_DEFINE_ROUTE(bf16_f32, __nv_bfloat16, float)
FP4_DEFINE_ROUTE(f32_f32, float, float)
FP4_DEFINE_ROUTE(f32_bf16, float, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch(unsigned* counts, const unsigned* tickets, const int* ids,
                                                               const float* weights, unsigned E, unsigned pairs,
                                                               unsigned top_k, unsigned* offsets, unsigned* active,
                                                               unsigned* num_active, unsigned* slot_row,
                                                               unsigned* row_token, float* row_weight,
                                                               unsigned* status) {
    pdl::wait_prior();
    dispatch_block<1>(counts, tickets, ids, weights, E, pairs, top_k, offsets, active, num_active, slot_row, row_token,
                      row_weight, status);
}

// The grouped GEMM multiplies only the token tiles that hold rows: an expert's rows vary per block
// and a pass is sized to the mean, so many of its tiles are empty. H200, the MoE layer with passes
// of 64 rows: V4-Flash T = 64 W4A16 2001 -> 1848 us, W4A4 2405 -> 2203; T = 512 2918 -> 2799;
// bit-identical.
constexpr bool kMoeSkipEmptyTiles = true;

// The sorted path's gate|up with SwiGLU in the grouped GEMM's epilogue. W13 is interleaved in
// chunks of 16 rows (formats.py interleave_rows), so the 128 weight rows of a block are 4 gate|up
// pairs: the GEMM's outputs, rounded to bf16 as it stores h, go to shared memory instead (over the
// activation buffers, free once every warp is past the mainloop), and the block turns them into
// the 64 SwiGLU outputs of its rows as quant.cu's swiglu_bf16_interleaved does from h: the same
// bits, without h's round trip or the SwiGLU launch.
constexpr unsigned kBlockRows = gemm::kWarps * 16;
// bf16 per staged token row: 8 more than the block's rows, so the 4 token columns of a fragment
// store (2 tokens = 544 bytes apart) fall 8 banks apart
constexpr unsigned kStageLd = kBlockRows + 8;

struct SwigluStage : gemm::Epilogue {
    static constexpr bool kSplitK = false;  // the grouped GEMM does not split K
    __nv_bfloat16* stage;                   // [tokens of the pass][kStageLd]
    unsigned n0;                            // the block's first weight row

    __device__ __forceinline__ void init() {
        __syncthreads();  // every warp is done with the activation buffers the stage reuses
        gemm::Epilogue::init();
    }
    __device__ __forceinline__ void store(unsigned token, unsigned n, unsigned, float sum,
                                          float unscale = gemm::kWeightUnscale) const {
        stage[token * kStageLd + n - n0] = __float2bfloat16_rn(__fmul_rn(sum, row_alpha(row(n).decode, unscale)));
    }
};

struct SwigluOut {
    __nv_bfloat16* out;      // [sorted rows, I]
    const float* row_scale;  // per sorted row (the routing weight before the down projection), or nullptr
    float limit;
    int has_limit;
};

// SwiGLU of the staged gate|up outputs of sorted rows row0 .. row0 + rows - 1 (block column group bx)
__device__ __forceinline__ void swiglu_from_stage(const __nv_bfloat16* stage, const SwigluOut& o, unsigned row0,
                                                  unsigned rows, unsigned bx, unsigned I) {
    constexpr unsigned kCols = kBlockRows / 2;
    const unsigned c0 = bx * kCols;
    for (unsigned q = threadIdx.x; q < rows * kCols; q += gemm::kThreads) {
        const unsigned token = q / kCols, c = q % kCols;
        if (c0 + c >= I) continue;
        const __nv_bfloat16* gate = stage + token * kStageLd + c / 16 * 32 + c % 16;  // up: 16 rows on
        float v = fp4_swiglu(__bfloat162float(gate[0]), __bfloat162float(gate[16]), o.limit, o.has_limit);
        if (o.row_scale) v = __fmul_rn(v, fp4_ftz(o.row_scale[row0 + token]));
        o.out[(size_t)(row0 + token) * I + c0 + c] = __float2bfloat16_rn(v);
    }
}

// A dense weight the grouped GEMM runs as one more expert (the shared expert folded into the sorted
// path): its own codes, scales, encode scale and optional per-row decode factors, on sorted rows
// first .. first + rows - 1 (the host fills their row_token with their tokens, once), one pass of
// 8T rows per block row y >= routed_slots; its own SwiGLU clamp and no routing weight.
struct DenseExpert {
    const uint4* codes;
    const uint2* scales;
    const float* global;
    const float* row_decode;
    unsigned first, rows;
    float limit;
    int has_limit;
};

// The combine in the down projection's grouped GEMM: each block, after storing a pass's fp32 rows
// of y, counts them in per (token, column group of kBlockRows) arrivals, and the block whose
// arrival completes a token's slots (and its folded shared expert's row) adds them for that
// column group as moe_combine does (slot order, then the shared expert): the same bits, without
// the combine launch. Arrival counts are zero between calls (the finisher resets its own).
struct CombineOut {
    unsigned* arrivals;          // [T * column groups]
    const unsigned* row_token;   // the token of each routed sorted row
    const unsigned* slot_row;    // [T * top_k]
    const float* weights;        // [T * top_k]
    int weighted;
    const __nv_bfloat16* shared; // bf16 [T, H] of a shared expert run apart, or nullptr
    int shared_rows;             // the dense expert's rows of y are the shared expert's (added last)
    __nv_bfloat16* out;          // [T, H]
    unsigned top_k;
};

// After a pass's stores: the arrivals of its rows (sorted rows row_first .., `rows` of them; dense:
// the tokens row_first - dense_first ..), then the combine of the (token, column group)s it completed.
__device__ __forceinline__ void combine_finished(const CombineOut& cb, const float* y, unsigned row_first,
                                                 unsigned rows, bool dense, unsigned dense_first, unsigned H) {
    __shared__ unsigned finished[64], n_finished;
    if (threadIdx.x == 0) n_finished = 0;
    __syncthreads();  // the block's rows of y before its arrivals, which release them
    if (threadIdx.x < rows) {
        const unsigned r = row_first + threadIdx.x;
        const unsigned t = dense ? r - dense_first : __ldg(cb.row_token + r);
        const unsigned slots = cb.top_k + (cb.shared_rows ? 1u : 0u);
        // the arrival completing a token acquires the other blocks' rows of it
        if (gpu_sync::arrive_acq_rel(cb.arrivals + (size_t)t * gridDim.x + blockIdx.x) == slots - 1)
            finished[atomicAdd(&n_finished, 1u)] = t;  // an expert holds a token once: distinct tokens
    }
    __syncthreads();
    const unsigned n = n_finished;
    if (n == 0) return;  // block-uniform
    for (unsigned i = 0; i < n; ++i) {
        const unsigned t = finished[i];
        for (unsigned c = blockIdx.x * kBlockRows + threadIdx.x; c < min(H, (blockIdx.x + 1) * kBlockRows);
             c += gemm::kThreads) {
            float acc = 0.0f;
            for (unsigned j = 0; j < cb.top_k; ++j) {
                const float v = __ldcg(y + (size_t)__ldg(cb.slot_row + t * cb.top_k + j) * H + c);
                acc = cb.weighted ? fmaf(v, __ldg(cb.weights + t * cb.top_k + j), acc) : __fadd_rn(acc, v);
            }
            if (cb.shared) acc = __fadd_rn(acc, __bfloat162float(cb.shared[(size_t)t * H + c]));
            if (cb.shared_rows)
                acc = __fadd_rn(acc, __bfloat162float(__float2bfloat16_rn(__ldcg(y + (size_t)(dense_first + t) * H + c))));
            cb.out[(size_t)t * H + c] = __float2bfloat16_rn(acc);
        }
        if (threadIdx.x == 0) cb.arrivals[(size_t)t * gridDim.x + blockIdx.x] = 0u;
    }
}

// Grouped GEMM over the active experts on the GEMM engine (common/gemm_engine.cuh): block (i, s)
// multiplies row group i (128 weight rows) of expert active[s] with that expert's rows, 8T at a
// time (the weight tile is re-read, mostly from L2, per 8T rows; the host sizes T to the rows an
// expert is expected to get, ops/moe.py grouped_pass_rows). Weights: tiled stacks, one expert after
// another. kSwiglu: the output is SwiGLU of W13's gate|up pairs (`sw`, SwigluStage). kDense: block
// rows y >= routed_slots run the dense expert `dx` (builds of their own: the branch costs the plain
// builds registers, e.g. the W4A16 8-row pass 78 -> 96, sm_90a). kCombine: the down projection
// combines into `cb.out` as its rows complete tokens (CombineOut; fp32 out, no out_col).
template <int T, bool kSwiglu = false, bool kDense = false, bool kCombine = false, class Act>
__device__ void moe_gemm(const uint4* w_codes, const uint2* w_scales, const float* w_decode, const float* row_decode,
                         Act act, const unsigned* gather, const float* act_global, void* out, int out_f32,
                         unsigned out_ld, unsigned out_col, int side_by_side, const unsigned* offsets,
                         const unsigned* active, const unsigned* num_active, unsigned N, unsigned K,
                         unsigned routed_slots, DenseExpert dx, SwigluOut sw = {}, CombineOut cb = {}) {
    pdl::wait_prior();  // the dispatch's counts choose the expert
    const bool dense = kDense && blockIdx.y >= routed_slots;  // block-uniform, as every exit below
    if (!dense && blockIdx.y >= *num_active) return;
    const unsigned row_tiles = (N + 15) / 16, chunks = (K + gemm::kTileK - 1) / gemm::kTileK;
    const unsigned groups = (chunks + gemm::kGroupChunks - 1) / gemm::kGroupChunks;
    unsigned e = 0, row0, m_begin = 0, m_end;
    const uint4* codes;
    const uint2* scales;
    if (dense) {
        row0 = dx.first;
        m_begin = (blockIdx.y - routed_slots) * 8 * T;
        m_end = min(dx.rows, m_begin + 8 * T);
        codes = dx.codes, scales = dx.scales;
        sw.row_scale = nullptr, sw.limit = dx.limit, sw.has_limit = dx.has_limit;
    } else {
        e = active[blockIdx.y];
        row0 = offsets[e];
        m_end = offsets[e + 1] - row0;
        codes = w_codes + (size_t)e * row_tiles * chunks * 32;
        scales = w_scales + (size_t)e * row_tiles * groups * 32;
    }
    const float* rd = dense ? dx.row_decode : row_decode ? row_decode + (size_t)e * N : nullptr;
    for (unsigned m0 = m_begin; m0 < m_end; m0 += 8 * T) {
        act.row = gemm::RowMap{gather, row0 + m0};
        gemm::Epilogue ep{dense ? dx.global : nullptr, rd, act_global, nullptr, 0, out, out_f32};
        ep.w_decode = dense ? nullptr : w_decode + e;
        ep.out_ld = out_ld;
        // sorted row r at output row r; or (side_by_side) expert e's rows at rows 0.. and columns e * N..
        ep.out_row_base = side_by_side ? m0 : row0 + m0;
        ep.out_col = out_col + (side_by_side ? e * N : 0u);
        const unsigned pass = min(m_end - m0, 8u * T);
        if constexpr (kSwiglu) {
            extern __shared__ uint4 smem_raw[];
            static_assert(8 * T * kStageLd * 2 <= 2 * gemm::Window<T>::kBytes, "the stage fits the activation buffers");
            __nv_bfloat16* stage = reinterpret_cast<__nv_bfloat16*>(smem_raw);
            gemm::gemm_block<1, gemm::kGroupChunks, 0, false, kMoeSkipEmptyTiles>(
                codes, scales, act, SwigluStage{ep, stage, blockIdx.x * kBlockRows}, pass, N, K, blockIdx.x, 0,
                gemm::SplitK{nullptr, nullptr, 1, chunks});
            __syncthreads();  // the stage is complete
            swiglu_from_stage(stage, sw, row0 + m0, pass, blockIdx.x, N / 2);
        } else {
            gemm::gemm_block<1, gemm::kGroupChunks, 0, false, kMoeSkipEmptyTiles>(
                codes, scales, act, ep, pass, N, K, blockIdx.x, 0, gemm::SplitK{nullptr, nullptr, 1, chunks});
            if constexpr (kCombine) combine_finished(cb, static_cast<const float*>(out), row0 + m0, pass, dense, dx.first, N);
        }
        __syncthreads();  // the next rows reuse the shared activation buffers
    }
}

#define FP4_MOE_GEMM_ARGS                                                                                 \
    const uint4 *w_codes, const uint2 *w_scales, const float *w_decode, const float *row_decode,        \
        const unsigned *gather, void *out, int out_f32, unsigned out_ld, unsigned out_col, int side_by_side, \
        const unsigned *offsets, const unsigned *active, const unsigned *num_active, unsigned N, unsigned K, \
        unsigned routed_slots, const uint4 *d_codes, const uint2 *d_scales, const float *d_global,        \
        const float *d_row_decode, unsigned d_first, unsigned d_rows, float d_limit, int d_has_limit
#define FP4_MOE_GEMM_DENSE \
    routed_slots, DenseExpert{d_codes, d_scales, d_global, d_row_decode, d_first, d_rows, d_limit, d_has_limit}

// BLOCKS: the resident blocks per SM a build is compiled for (its register bound). SUFFIX "_occ3":
// the 8- and 16-row passes bounded to 3 blocks (85 registers), which they fit without spilling in
// their mainloops (sm_90a, cuobjdump -res-usage and the SASS: W4A16 16 rows 124 -> 80 registers,
// W4A4 8 rows 121 -> 77, W4A4 16 rows 111 -> 80 with 16 bytes of stack outside the loop; the
// mainloops 3.6 %, 10.5 % and 1.6 % longer); ops/moe.py GROUPED_BLOCKS_PER_SM picks them. The same
// arithmetic, so the same bits. The 32- and 64-row passes spill at that bound.
#define FP4_DEFINE_MOE_GEMM_B(T, BLOCKS, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS) moe_gemm_bf16_##T##SUFFIX(        \
        const __nv_bfloat16* act, FP4_MOE_GEMM_ARGS) {                                                    \
        moe_gemm<T>(w_codes, w_scales, w_decode, row_decode, gemm::ActBf16<gemm::Window<T>>{act, gemm::RowMap{nullptr, 0}}, \
                    gather, nullptr, out, out_f32, out_ld, out_col, side_by_side, offsets, active, num_active, N, K, \
                    FP4_MOE_GEMM_DENSE);                                                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS) moe_gemm_nvfp4_##T##SUFFIX(       \
        const unsigned char* act_packed, const unsigned char* act_scales, const float* act_global,        \
        FP4_MOE_GEMM_ARGS) {                                                                              \
        moe_gemm<T>(w_codes, w_scales, w_decode, row_decode,                                            \
                    gemm::ActNvfp4<gemm::Window<T>>{act_packed, act_scales, gemm::RowMap{nullptr, 0}}, gather, act_global, out, \
                    out_f32, out_ld, out_col, side_by_side, offsets, active, num_active, N, K, FP4_MOE_GEMM_DENSE); \
    }
#define FP4_DEFINE_MOE_GEMM_FOLDED(T, BLOCKS, SUFFIX)                                                     \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS) moe_gemm_swiglu_bf16_##T##SUFFIX( \
        const __nv_bfloat16* act, FP4_MOE_GEMM_ARGS, const float* row_scale, float limit, int has_limit) { \
        moe_gemm<T, true, true>(w_codes, w_scales, w_decode, row_decode,                                \
                          gemm::ActBf16<gemm::Window<T>>{act, gemm::RowMap{nullptr, 0}}, gather, nullptr, out, \
                          out_f32, out_ld, out_col, side_by_side, offsets, active, num_active, N, K,     \
                          FP4_MOE_GEMM_DENSE, SwigluOut{static_cast<__nv_bfloat16*>(out), row_scale, limit, has_limit}); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS) moe_gemm_dense_bf16_##T##SUFFIX(  \
        const __nv_bfloat16* act, FP4_MOE_GEMM_ARGS) {                                                    \
        moe_gemm<T, false, true>(w_codes, w_scales, w_decode, row_decode,                               \
                                 gemm::ActBf16<gemm::Window<T>>{act, gemm::RowMap{nullptr, 0}}, gather, nullptr, out, \
                                 out_f32, out_ld, out_col, side_by_side, offsets, active, num_active, N, K, \
                                 FP4_MOE_GEMM_DENSE);                                                     \
    }

// moe_gemm_combine_{bf16,nvfp4}_*: the down projection with the combine (CombineOut) and a dense
// expert (its rows the folded shared expert's, shared_rows 1).
#define FP4_MOE_COMBINE_ARGS                                                                              \
    unsigned *arrivals, const unsigned *row_token, const unsigned *slot_row, const float *weights,      \
        int weighted, const __nv_bfloat16 *shared, int shared_rows, __nv_bfloat16 *combined, unsigned top_k
#define FP4_MOE_COMBINE CombineOut{arrivals, row_token, slot_row, weights, weighted, shared, shared_rows, combined, top_k}
#define FP4_DEFINE_MOE_GEMM_COMBINE(T, BLOCKS_BF16, BLOCKS_NVFP4, SUFFIX)                               \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS_BF16) moe_gemm_combine_bf16_##T##SUFFIX( \
        const __nv_bfloat16* act, FP4_MOE_GEMM_ARGS, FP4_MOE_COMBINE_ARGS) {                              \
        moe_gemm<T, false, true, true>(w_codes, w_scales, w_decode, row_decode,                         \
                                       gemm::ActBf16<gemm::Window<T>>{act, gemm::RowMap{nullptr, 0}}, gather, nullptr, \
                                       out, out_f32, out_ld, out_col, side_by_side, offsets, active, num_active, N, K, \
                                       FP4_MOE_GEMM_DENSE, SwigluOut{}, FP4_MOE_COMBINE);                \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(gemm::kThreads, BLOCKS_NVFP4) moe_gemm_combine_nvfp4_##T##SUFFIX( \
        const unsigned char* act_packed, const unsigned char* act_scales, const float* act_global,        \
        FP4_MOE_GEMM_ARGS, FP4_MOE_COMBINE_ARGS) {                                                        \
        moe_gemm<T, false, true, true>(w_codes, w_scales, w_decode, row_decode,                         \
                                       gemm::ActNvfp4<gemm::Window<T>>{act_packed, act_scales, gemm::RowMap{nullptr, 0}}, \
                                       gather, act_global, out, out_f32, out_ld, out_col, side_by_side, offsets, \
                                       active, num_active, N, K, FP4_MOE_GEMM_DENSE, SwigluOut{}, FP4_MOE_COMBINE); \
    }

#define FP4_DEFINE_MOE_GEMM(T) FP4_DEFINE_MOE_GEMM_B(T, 2, )

FP4_DEFINE_MOE_GEMM(1)
FP4_DEFINE_MOE_GEMM(2)
FP4_DEFINE_MOE_GEMM(4)
FP4_DEFINE_MOE_GEMM(8)
FP4_DEFINE_MOE_GEMM_B(1, 3, _occ3)
FP4_DEFINE_MOE_GEMM_B(2, 3, _occ3)

// moe_gemm_swiglu_bf16_*: the W4A16 gate|up with SwiGLU in the epilogue (out: bf16 [rows, N / 2],
// out_f32 0, out_col 0, side_by_side 0; row_scale, limit and has_limit as the SwiGLU kernels take
// them) and a dense expert (the d_* arguments, d_rows 0: none); moe_gemm_dense_bf16_*: the plain
// W4A16 GEMM with a dense expert (the folded shared expert's down projection). The 8-row builds
// are bounded to three blocks per SM by default: the plain one fits them unbounded (78 registers),
// the SwiGLU one takes 121 unless bounded (sm_90a).
FP4_DEFINE_MOE_GEMM_FOLDED(1, 3, )
FP4_DEFINE_MOE_GEMM_FOLDED(2, 2, )
FP4_DEFINE_MOE_GEMM_FOLDED(4, 2, )
FP4_DEFINE_MOE_GEMM_FOLDED(8, 2, )
FP4_DEFINE_MOE_GEMM_FOLDED(1, 3, _occ3)
FP4_DEFINE_MOE_GEMM_FOLDED(2, 3, _occ3)
// (the W4A16 8-row combine build bounded to three blocks per SM, as the SwiGLU one: 121 registers
// unbounded, against the plain build's 80)
FP4_DEFINE_MOE_GEMM_COMBINE(1, 3, 2, )
FP4_DEFINE_MOE_GEMM_COMBINE(2, 2, 2, )
FP4_DEFINE_MOE_GEMM_COMBINE(4, 2, 2, )
FP4_DEFINE_MOE_GEMM_COMBINE(8, 2, 2, )
FP4_DEFINE_MOE_GEMM_COMBINE(1, 3, 3, _occ3)
FP4_DEFINE_MOE_GEMM_COMBINE(2, 3, 3, _occ3)

// out[t, :] = sum_j y[slot_row[t, j], :] * (weighted ? weight[t, j] : 1) (+ shared[t, :]), slot order.
// shared_f32 (instead of shared): the folded shared expert's fp32 rows [T, H], rounded to bf16 as
// its dense GEMM's output would be. With norm_resid (else null), the block then takes its token's
// row through the residual step (common/residual_norm.cuh): norm_resid[t] += out[t], norm_y[t] its
// RMSNorm with norm_w, in the quad layout where norm_quads (ops/elementwise.py `quad_rows`).
extern "C" __global__ void __launch_bounds__(rownorm::kThreads) moe_combine(
        const float* y, const unsigned* slot_row, const float* weights, int weighted, const __nv_bfloat16* shared,
        const float* shared_f32, __nv_bfloat16* out, unsigned H, unsigned top_k, float* norm_resid,
        const float* norm_w, __nv_bfloat16* norm_y, float norm_eps, int norm_quads) {
    pdl::wait_prior();
    const unsigned t = blockIdx.x;
    for (unsigned c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = 0.0f;
        for (unsigned j = 0; j < top_k; ++j) {
            const float v = y[(size_t)slot_row[t * top_k + j] * H + c];
            acc = weighted ? fmaf(v, weights[t * top_k + j], acc) : __fadd_rn(acc, v);
        }
        if (shared) acc = __fadd_rn(acc, __bfloat162float(shared[(size_t)t * H + c]));
        if (shared_f32) acc = __fadd_rn(acc, __bfloat162float(__float2bfloat16_rn(shared_f32[(size_t)t * H + c])));
        out[(size_t)t * H + c] = __float2bfloat16_rn(acc);
    }
    if (norm_resid == nullptr) return;
    __syncthreads();  // the block's row of out, re-read by other threads
    const size_t row = (size_t)t * H;
    rownorm::add_rmsnorm_row(norm_resid + row, out + row, norm_w, norm_y + row, H, norm_eps, norm_quads);
}

// ---------------------------------------------------------------------------------------------
// The small-T path (decode): no dispatch. Every (token, slot) assignment is a GEMV work item read
// straight from the router's ids; the weights of an expert are streamed once per assignment.
//
//   moe_small_gate_up_{bf16,nvfp4}  grid (I / (16 P), T * top_k [+ ceil(T / 8)]), 8 or 4 warps (N):
//                  block (p, a) computes gate rows 16 (pP + j) .. + 15 (j < P) and the matching up
//                  rows of expert ids[a] for the token of assignment a (N / P warps per pair split K
//                  and add their partials in warp order), then SwiGLU (+ clamp, + the routing weight
//                  as row factor): fp32 [T * top_k, I] for the amax + quantize launch (W4A4), or bf16
//                  (W4A16) for the down projection.
//                  A folded shared expert's blocks take up to 8 tokens each, one per column of the
//                  MMA's 8 (a routed block repeats its one token there), so its weights are streamed
//                  once for up to 8 tokens with the same instructions. With shared_first (W4A16,
//                  launched right after a moe_route_* launch that releases it early) the shared
//                  expert's blocks come first and run whole while the router works: its weights
//                  stream while the router's serial tail leaves the memory system idle.
//   moe_small_down_{bf16,nvfp4}     grid (H / 16, T), 256 threads: block (r, t) computes output rows
//                  16r .. 16r + 15 of token t: warp j the down projection of slot j (full K, as the
//                  grouped GEMM's warps do), then the weighted sum over the slots in slot order (the
//                  arithmetic of moe_combine) plus the shared expert's output, to bf16.
// Weights are tiled expert stacks as in moe_gemm. The activation rows of a block are staged in
// shared memory as exact bf16 values (NVFP4: e2m1 * s; the epilogue multiplies by 1 / S_a).
namespace small {

constexpr int kWarps = 8;

// One token row (K a multiple of 16) into shared memory as bf16, zero up to Kp (whole tiles), by
// asynchronous copies: a block stages all its rows with one L2 round trip (a plain load + store per
// element waited for each before the next: one round trip per row), then `settle()`s them.
__device__ __forceinline__ void stage_row(const __nv_bfloat16* x, unsigned K, unsigned Kp, __nv_bfloat16* dst,
                                          unsigned thread, unsigned threads) {
    for (unsigned i = thread * 8; i < Kp; i += threads * 8) gemm::cp_async16(dst + i, i < K ? x + i : x, i < K);
}

// The staging copies issued by this thread have landed (before the block barrier that publishes them).
__device__ __forceinline__ void settle() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ unsigned bf16_pair(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) | ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// The bf16 pair (e2m1 of the low nibble, e2m1 of the high nibble) of every code byte, built by
// the block before it stages NVFP4 rows.
__device__ __forceinline__ void build_code_table(unsigned* table) {
    for (unsigned b = threadIdx.x; b < 256; b += blockDim.x)
        table[b] = bf16_pair(fp4_e2m1_value(b & 0xFu), fp4_e2m1_value(b >> 4));
}

// One 16-element block (8 code bytes q, E4M3 scale byte) decoded to e2m1 * s into dst (32 bytes):
// one table load and one bf16 multiply per pair (exact: E4M3 values are bf16 values, and e2m1 * s
// has at most 6 significant bits and stays normal).
__device__ __forceinline__ void store_decoded(__nv_bfloat16* dst, uint2 q, unsigned scale_byte, const unsigned* table) {
    const float sv = fp4_e4m3_value(scale_byte);
    const unsigned s = bf16_pair(sv, sv);
    unsigned w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = gemm::bf16x2_mul(table[((i < 4 ? q.x : q.y) >> (8 * (i % 4))) & 0xFFu], s);
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__device__ __forceinline__ void store_zeros(__nv_bfloat16* dst) {
    reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<uint4*>(dst)[1] = make_uint4(0u, 0u, 0u, 0u);
}

// An NVFP4 row (linear layout: 8 code bytes and one E4M3 scale byte per 16 elements) decoded to
// e2m1 * s, zero up to Kp.
__device__ __forceinline__ void stage_row(const unsigned char* packed, const unsigned char* scales, unsigned K,
                                          unsigned Kp, __nv_bfloat16* dst, const unsigned* table, unsigned thread,
                                          unsigned threads) {
    for (unsigned b = thread; b < Kp / 16; b += threads) {
        if (b < K / 16) store_decoded(dst + (size_t)b * 16, *reinterpret_cast<const uint2*>(packed + (size_t)b * 8), scales[b], table);
        else store_zeros(dst + (size_t)b * 16);
    }
}

// A warp's GEMV of R weight row tiles (tile pointers at their first chunk) over chunks [c0, c1)
// (c0 a multiple of the 4 chunks of a scale word) against one staged activation row: D groups of
// 4 chunks in flight; lanes with t = 0 end with the token's sums in acc[r][0] (row g) and
// acc[r][2] (row g + 8). The other lanes' columns repeat the token and are ignored. C = 2 splits
// the accumulation into two chains (even and odd chunks, added at the end) so that consecutive
// MMAs do not wait on each other. kWhole: c1 - c0 is whole groups (K of whole scale groups), so
// no tile of a group is past c1 and the per-tile bounds tests go; the same arithmetic in the same
// order.
template <int R, int D, int C = 1, bool kWhole = false>
struct WarpGemv {
    struct Group {
        uint4 q[R][4];
        uint2 s[R];
    };
    const uint4* codes[R];
    const uint2* scales[R];
    unsigned c0, c1;
    unsigned long long policy;
    // groups requested into L2 ahead of their register fetch (0: none): a warp's later groups
    // then come from L2 instead of each waiting a DRAM round trip in turn
    unsigned l2_ahead = 0;
    Group buf[D];

    // the group at chunk c into L2: lanes 0-15 the codes of row 0, 16-31 those of row 1 (row 0
    // again for R = 1), one 128-byte line each; lanes < 2R the scale words
    __device__ __forceinline__ void l2_prefetch(unsigned c) const {
        if (c >= c1) return;
        // the row by a select, not an index: a lane-indexed pointer array would live in local memory
        const unsigned lane = threadIdx.x & 31, j = (lane >> 2) & 3u;
        const bool second = R > 1 && (lane & 16u);
        if (kWhole || c + j < c1)
            gemm::prefetch_l2((second ? codes[R - 1] : codes[0]) + (c + j) * 32 + (lane & 3u) * 8);
        if (lane < 2 * R)
            gemm::prefetch_l2(((R > 1 && lane >= 2) ? scales[R - 1] : scales[0]) + c / gemm::kGroupChunks * 32 +
                              (lane & 1u) * 16);
    }

    __device__ __forceinline__ void fetch(Group& grp, unsigned c) {
        const unsigned lane = threadIdx.x & 31;
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                grp.q[r][j] = kWhole || c + j < c1 ? gemm::load_stream(codes[r] + (c + j) * 32 + lane, policy)
                                                   : make_uint4(0u, 0u, 0u, 0u);
            grp.s[r] = gemm::load_stream(scales[r] + c / gemm::kGroupChunks * 32 + lane, policy);
        }
    }

    // the first D groups: issued before the activation is staged
    __device__ __forceinline__ void prime() {
#pragma unroll
        for (int d = 0; d < D; ++d)
            if (c0 + 4 * d < c1) fetch(buf[d], c0 + 4 * d);
        for (unsigned g = 0; g < l2_ahead; ++g) l2_prefetch(c0 + 4 * (D + g));
    }

    __device__ __forceinline__ void compute(const Group& grp, unsigned c, const __nv_bfloat16* act, float acc[R][4],
                                            float odd[R][4]) {
        const unsigned t = threadIdx.x & 3;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (!kWhole && c + j >= c1) break;
            unsigned sc_g[R], sc_g8[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (j == 0) gemm::scale_pairs<0>(grp.s[r], sc_g[r], sc_g8[r]);
                if (j == 1) gemm::scale_pairs<1>(grp.s[r], sc_g[r], sc_g8[r]);
                if (j == 2) gemm::scale_pairs<2>(grp.s[r], sc_g[r], sc_g8[r]);
                if (j == 3) gemm::scale_pairs<3>(grp.s[r], sc_g[r], sc_g8[r]);
            }
            const __nv_bfloat16* tile = act + (c + j) * gemm::kTileK + 16 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 b = *reinterpret_cast<const uint4*>(tile + 8 * h);
#pragma unroll
                for (int ss = 0; ss < 2; ++ss) {
                    const int step = 2 * h + ss;
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint4 q4 = grp.q[r][j];
                        const unsigned q = step == 0 ? q4.x : step == 1 ? q4.y : step == 2 ? q4.z : q4.w;
                        unsigned a[4];
                        gemm::dequant_step(q, sc_g[r], sc_g8[r], a);
                        if (C == 2 && (j & 1)) gemm::mma_bf16(odd[r], a, ss ? b.z : b.x, ss ? b.w : b.y);
                        else gemm::mma_bf16(acc[r], a, ss ? b.z : b.x, ss ? b.w : b.y);
                    }
                }
            }
        }
    }

    // after prime(): every chunk, each group's buffer refilled with the group D ahead once used
    __device__ __forceinline__ void run(const __nv_bfloat16* act, float acc[R][4]) {
        float odd[R][4] = {};
        for (unsigned c = c0; c < c1; c += 4 * D) {
#pragma unroll
            for (int d = 0; d < D; ++d) {
                const unsigned cd = c + 4 * d;
                if (cd < c1) {
                    compute(buf[d], cd, act, acc, odd);
                    if (cd + 4 * D < c1) {
                        fetch(buf[d], cd + 4 * D);
                        if (l2_ahead) l2_prefetch(cd + 4 * (D + l2_ahead));
                    }
                }
            }
        }
        if (C == 2) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[r][v] = __fadd_rn(acc[r][v], odd[r][v]);
        }
    }
};

// One weight for the gate or the up half (tile p * step + first of expert e), or for the down
// projection (step 1, first 0): a tiled expert stack with decode factors per expert (`decode`,
// fp32(1 / S_e)), or a single tiled weight (e = 0) with its encode scale `global`, whose factor
// is 1 / S as the dense GEMM's epilogue computes it; per-row factors override either.
struct StackRows {
    const uint4* codes;
    const uint2* scales;
    const float* decode;
    const float* global;
    const float* row_decode;
    unsigned rows, step, first;

    // the alpha of the engine's epilogue: (decode factor of row n * 1 / S_a) * 2^26
    __device__ __forceinline__ float alpha(unsigned e, unsigned n, float a_dec) const {
        const float w_dec = row_decode ? row_decode[(size_t)e * rows + n]
                                       : (global ? __fdiv_rn(1.0f, *global) : decode[e]);
        return __fmul_rn(__fmul_rn(w_dec, a_dec), gemm::kWeightUnscale);
    }
};

// The SwiGLU settings of the routed experts or of the shared expert.
struct Swiglu {
    float limit;
    int has_limit;
};

// Tokens of the shared expert per block: the 8 columns of an m16n8k16 MMA.
constexpr unsigned kSharedTokens = 8;

// The staged rows of a block: the row of MMA column n is n (below `count`), else row 0; rows are
// `ld` bf16 apart, ld = Kp + 8 so that the 8 columns' 16-byte loads of one MMA step fall in
// distinct banks (a multiple of 128 bytes apart, they would all hit the same ones).
__device__ __forceinline__ unsigned staged_ld(unsigned kp) { return kp + 8; }

// W4A4 at T = 1: the gate|up launch's last blocks to finish quantize the fp32 SwiGLU output for
// the down launch, as two quantize launches would (the routed rows with the encode scale of their
// blocks' maxima, the shared expert's rows with that of its own): once, instead of in every block
// of the down launch. The last `spread` blocks to arrive wait for the rest and take one share of
// the 16-value blocks each (one block alone reads them all through one SM: 57 KB of fp32 at
// V4-Flash widths, ~7 dependent L2 round trips a thread). `done` counts the arrivals, then the
// spread's departures (zero between launches: the last to leave resets it). The spread's blocks
// wait only for blocks that have started or can (fewer than `spread` are missing, and the host
// keeps `spread` to half the kernel's resident blocks), so the wait cannot hold the grid up.
struct LastQuantize {
    unsigned* done;
    unsigned spread;
    Nvfp4Out routed, shared;
    unsigned* status;
};

// Blocks [b0, b1) of an fp32 matrix (16 values each, written by other blocks of this launch, so
// read past L1) quantized with encode scale s; the next block's loads are in flight while one is
// encoded.
__device__ void quantize_f32_blocks(const float* src, unsigned b0, unsigned b1, float s, const Nvfp4Out& o) {
    auto fetch = [&](unsigned b) {
        Fp4Raw16<float> r;
#pragma unroll
        for (int j = 0; j < 4; ++j) r.q[j] = __ldcg(reinterpret_cast<const uint4*>(src + (size_t)b * FP4_BLOCK) + j);
        return r;
    };
    Fp4Raw16<float> next;
    if (b0 + threadIdx.x < b1) next = fetch(b0 + threadIdx.x);
    for (unsigned b = b0 + threadIdx.x; b < b1; b += blockDim.x) {
        const Fp4Raw16<float> cur = next;
        if (b + blockDim.x < b1) next = fetch(b + blockDim.x);
        float v[FP4_BLOCK];
        fp4_expand16(cur, v);
        store_nvfp4_block(o, b, v, fp4_raw_abs_max_bits(cur), s);
    }
}

// Blocks (p, a) with a < routed take the routed assignment a (expert ids[a], token a / top_k, the
// routing weight as row factor); a >= routed the shared expert (one more always-selected expert,
// its own weights and clamp) for tokens 8 (a - routed) .. + 7 (those below T = routed / top_k),
// one per MMA column. Rows of `out`: the routed assignments, then the shared expert's tokens.
template <int D, int C, bool kWhole, int kBlockWarps, class Stage>
__device__ void gate_up(Stage stage, unsigned* out_amax, LastQuantize lq, StackRows r_gate, StackRows r_up, StackRows s_gate,
                        StackRows s_up, const int* ids, const float* row_scale, unsigned top_k, unsigned routed,
                        Swiglu r_swiglu, Swiglu s_swiglu, unsigned H, unsigned I, unsigned pairs_per_block, void* out,
                        int out_f32, int shared_first, unsigned l2_ahead) {
    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* act_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __shared__ float partial[kBlockWarps][2][kSharedTokens][16];
    __shared__ unsigned table[256];
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // shared_first: the shared expert's blocks come first in launch order (rows y < s_blocks), so
    // they are the ones resident while the router runs (see `early`); else they come last
    const unsigned s_blocks = gridDim.y - routed;
    const unsigned a = !shared_first ? blockIdx.y : blockIdx.y < s_blocks ? routed + blockIdx.y : blockIdx.y - s_blocks;
    const bool shared = a >= routed;  // block-uniform
    // early: a shared-expert block of a launch the router released right after its own wait (the
    // layer input is final then, and nothing this block reads or writes is the router's) runs whole
    // while the router works, without waiting; its input comes through L2 (cp.async.cg)
    const bool early = Stage::kLayerInput && shared_first && shared;
    // this block's tokens: first, first + 1, ... (count of them)
    const unsigned first = shared ? (a - routed) * kSharedTokens : a / top_k;
    const unsigned count = shared ? min(kSharedTokens, routed / top_k - first) : 1u;
    const StackRows gate = shared ? s_gate : r_gate, up = shared ? s_up : r_up;
    // warp w: pair p of the block's pairs_per_block (gate rows 16p.., up rows alike), K part w % ks
    const unsigned ks = kBlockWarps / pairs_per_block, p = blockIdx.x * pairs_per_block + warp / ks;
    if (!shared) pdl::wait_prior();  // a routed block's expert is the router's output (common/pdl.cuh)
    const unsigned e = shared ? 0u : ids[a], chunks = (H + gemm::kTileK - 1) / gemm::kTileK;
    const unsigned groups = (chunks + gemm::kGroupChunks - 1) / gemm::kGroupChunks;
    const unsigned per_warp = (groups + ks - 1) / ks * gemm::kGroupChunks;
    const bool active = p < I / 16;

    WarpGemv<2, D, C, kWhole> gemv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const StackRows& st = r == 0 ? gate : up;
        const size_t tile = (size_t)e * (st.rows / 16) + (active ? p : 0) * st.step + st.first;
        gemv.codes[r] = st.codes + tile * chunks * 32;
        gemv.scales[r] = st.scales + tile * groups * 32;
    }
    gemv.c0 = active ? min(chunks, warp % ks * per_warp) : chunks;
    gemv.c1 = min(chunks, gemv.c0 + per_warp);
    gemv.policy = gemm::evict_first_policy();
    gemv.l2_ahead = l2_ahead;
    gemv.prime();
    if (shared && !early) pdl::wait_prior();  // the shared expert's first weights are in flight by now
    stage.prepare(table);
    __syncthreads();
    const unsigned kp = chunks * gemm::kTileK, ld = staged_ld(kp);
    for (unsigned n = 0; n < count; ++n) stage.token(first + n, act_s + (size_t)n * ld, kp, table);
    settle();
    __syncthreads();
    float acc[2][4] = {};
    // MMA column lane / 4: token lane / 4 of a shared block, the block's one token otherwise
    const unsigned column = lane >> 2, row_of_lane = column < count ? column : 0u;
    gemv.run(act_s + (size_t)row_of_lane * ld, acc);
    // acc[r][v] is output row lane / 4 + 8 (v / 2) of MMA column 2 (lane % 4) + v % 2
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const unsigned n = 2 * (lane & 3) + (v & 1);
            if (n < count) partial[warp][r][n][(lane >> 2) + 8 * (v >> 1)] = acc[r][v];
        }
    __syncthreads();
    const unsigned q = threadIdx.x / 16, i = threadIdx.x % 16, pair = blockIdx.x * pairs_per_block + q;
    const bool writes = threadIdx.x < 16 * pairs_per_block && pair < I / 16;
    unsigned v_bits = 0;  // |v| as fp32 bits: this block's share of the amax
    if (writes) {
        const float a_dec = stage.a_dec(false);
        const Swiglu sw = shared ? s_swiglu : r_swiglu;
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const StackRows& st = r == 0 ? gate : up;
            alpha[r] = st.alpha(e, (pair * st.step + st.first) * 16 + i, a_dec);
        }
        for (unsigned n = 0; n < count; ++n) {
            float y[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float sum = 0.0f;  // the K parts in order
                for (unsigned w = q * ks; w < (q + 1) * ks; ++w) sum = __fadd_rn(sum, partial[w][r][n][i]);
                // the GEMM's bf16 output (h), as the grouped path and the dense GEMM store it
                y[r] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(sum, alpha[r])));
            }
            float v = fp4_swiglu(y[0], y[1], sw.limit, sw.has_limit);
            if (row_scale && !shared) v = __fmul_rn(v, fp4_ftz(row_scale[a]));
            const size_t index = (size_t)(shared ? routed + first + n : a) * I + pair * 16 + i;
            if (out_f32) static_cast<float*>(out)[index] = v;
            else static_cast<__nv_bfloat16*>(out)[index] = __float2bfloat16_rn(v);
            v_bits = max(v_bits, fp4_abs_bits(v));
        }
    }
    if (out_amax) {  // W4A4: one max per block, plain stores
        v_bits = block_max_bits(v_bits);
        if (threadIdx.x == 0) out_amax[(size_t)a * gridDim.x + blockIdx.x] = v_bits;
    }
    if (!lq.done) return;
    const unsigned routed_blocks = gridDim.x * routed, blocks = gridDim.x * gridDim.y, kb = I / 16;
    const unsigned spread = min(max(lq.spread, 1u), blocks);
    __shared__ unsigned slot;
    // this block's rows of out and its maximum published with its arrival
    const unsigned arrival = gpu_sync::block_arrive(lq.done, &slot);
    if (arrival < blocks - spread) return;  // block-uniform: not among the last `spread`
    const unsigned share = arrival - (blocks - spread);
    if (threadIdx.x == 0) {
        while (gpu_sync::ld_acquire(lq.done) < blocks) {  // acquires every block's rows and maximum
        }
    }
    __syncthreads();
    const float* h = static_cast<const float*>(out);
    const float s = encode_scale_of_amax(block_max_of_words(out_amax, routed_blocks), lq.status);
    const float s2 = blocks > routed_blocks
                         ? encode_scale_of_amax(block_max_of_words(out_amax + routed_blocks, blocks - routed_blocks), lq.status)
                         : 1.0f;
    if (share == 0 && threadIdx.x == 0) {
        *lq.routed.global = s;
        if (blocks > routed_blocks) *lq.shared.global = s2;
    }
    // this share of the routed rows' 16-value blocks, then of the shared expert's
    const unsigned nr = routed * kb, nb = nr + (blocks > routed_blocks ? routed / top_k * kb : 0u);
    const unsigned b0 = (unsigned)((unsigned long long)nb * share / spread);
    const unsigned b1 = (unsigned)((unsigned long long)nb * (share + 1) / spread);
    if (b0 < nr) quantize_f32_blocks(h, b0, min(b1, nr), s, lq.routed);
    if (b1 > nr) quantize_f32_blocks(h + (size_t)routed * I, max(b0, nr) - nr, b1 - nr, s2, lq.shared);
    // departures: the spread's last to leave (every other block has arrived) resets the count
    if (threadIdx.x == 0 && atomicAdd(lq.done, 1u) == blocks + spread - 1u) *lq.done = 0u;
}

// Block (r, t): slots j < top_k are token t's routed assignments (activation row t * top_k + j);
// with a folded shared expert, slot top_k is its down projection (activation row routed + t,
// its own weight and 1 / S_a), rounded to bf16 as the dense layer's output and added last, as
// moe_combine adds a separate shared expert's output (`shared_out`).
template <int D, int C, bool kWhole, class Stage>
__device__ void down(Stage stage, StackRows w, StackRows s_w,
                     int has_shared, const int* ids, const float* weights, int weighted, unsigned top_k,
                     unsigned routed, const __nv_bfloat16* shared_out, __nv_bfloat16* out, unsigned H, unsigned I,
                     unsigned l2_ahead) {
    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* act_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __shared__ float y[kMaxTopK + 1][16];
    __shared__ unsigned table[256];
    const unsigned r = blockIdx.x, t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned chunks = (I + gemm::kTileK - 1) / gemm::kTileK, kp = chunks * gemm::kTileK;
    const unsigned groups = (chunks + gemm::kGroupChunks - 1) / gemm::kGroupChunks, row_tiles = H / 16;
    const unsigned slots = top_k + (has_shared ? 1u : 0u);

    WarpGemv<1, D, C, kWhole> gemv;
    gemv.c0 = 0;
    gemv.c1 = chunks;
    gemv.policy = gemm::evict_first_policy();
    gemv.l2_ahead = l2_ahead;
    auto point = [&](unsigned j) {
        const bool sh = j == top_k;
        const size_t tile = (sh ? 0u : (size_t)ids[t * top_k + j]) * row_tiles + r;
        gemv.codes[0] = (sh ? s_w.codes : w.codes) + tile * chunks * 32;
        gemv.scales[0] = (sh ? s_w.scales : w.scales) + tile * groups * 32;
    };
    // the shared expert's warp prefetches its weights first; the routed experts are the router's output
    const bool prefetch = has_shared && warp == top_k;
    if (prefetch) {
        point(warp);
        gemv.prime();
    }
    pdl::wait_prior();
    if (warp < slots && !prefetch) {
        point(warp);
        gemv.prime();
    }
    stage.prepare(table);
    __syncthreads();
    for (unsigned j = 0; j < slots; ++j) stage.row(j == top_k ? routed + t : t * top_k + j, act_s + (size_t)j * kp, kp, table);
    settle();
    __syncthreads();
    for (unsigned j = warp; j < slots; j += kWarps) {
        if (j != warp) {
            point(j);
            gemv.prime();
        }
        float acc[1][4] = {};
        gemv.run(act_s + (size_t)j * kp, acc);
        if ((lane & 3) == 0) {
            const bool sh = j == top_k;
            const float a_dec = stage.a_dec(sh);
            const unsigned e = sh ? 0u : ids[t * top_k + j], n = r * 16 + (lane >> 2);
            const StackRows st = sh ? s_w : w;  // by value: a reference to either went through local memory
            y[j][lane >> 2] = __fmul_rn(acc[0][0], st.alpha(e, n, a_dec));
            y[j][(lane >> 2) + 8] = __fmul_rn(acc[0][2], st.alpha(e, n + 8, a_dec));
        }
    }
    __syncthreads();
    if (threadIdx.x >= 16) return;
    const unsigned n = r * 16 + threadIdx.x;
    float acc = 0.0f;  // moe_combine's arithmetic, in slot order
    for (unsigned j = 0; j < top_k; ++j) acc = weighted ? fmaf(y[j][threadIdx.x], weights[t * top_k + j], acc) : __fadd_rn(acc, y[j][threadIdx.x]);
    if (has_shared) acc = __fadd_rn(acc, __bfloat162float(__float2bfloat16_rn(y[top_k][threadIdx.x])));
    if (shared_out) acc = __fadd_rn(acc, __bfloat162float(shared_out[(size_t)t * H + n]));
    out[(size_t)t * H + n] = __float2bfloat16_rn(acc);
}

// Activation stagers: `prepare` (every thread, then a block barrier), then `token(t, ...)` stages
// token t of the layer input, `row(a, ...)` row a of the down-projection input, into `dst` (kp
// bf16), by the whole block; `a_dec(shared)` is the 1 / S_a of the epilogue (the shared expert's
// rows of a down-projection input may have their own). bf16: one buffer for every row, 1 / S_a = 1.
struct StageBf16 {
    // in gate_up: the layer input staged as it is, nothing from the router (the other stagers read
    // the router's quantization or maxima)
    static constexpr bool kLayerInput = true;
    const __nv_bfloat16* x;
    unsigned K;
    __device__ __forceinline__ void prepare(unsigned*) {}
    __device__ __forceinline__ float a_dec(bool) const { return 1.0f; }
    __device__ __forceinline__ void token(unsigned t, __nv_bfloat16* dst, unsigned kp, const unsigned*) const {
        stage_row(x + (size_t)t * K, K, kp, dst, threadIdx.x, blockDim.x);
    }
    __device__ __forceinline__ void row(unsigned a, __nv_bfloat16* dst, unsigned kp, const unsigned* table) const {
        token(a, dst, kp, table);
    }
};

// An NVFP4 activation quantized by its own launch; rows from `split` on (the shared expert's) are a
// tensor of their own with its own global scale.
struct StageNvfp4 {
    static constexpr bool kLayerInput = false;
    const unsigned char* packed;
    const unsigned char* scales;
    const float* global;
    unsigned K;
    const unsigned char* packed2 = nullptr;
    const unsigned char* scales2 = nullptr;
    const float* global2 = nullptr;
    unsigned split = 0xFFFFFFFFu;
    __device__ __forceinline__ void prepare(unsigned* table) { build_code_table(table); }
    __device__ __forceinline__ float a_dec(bool shared) const { return __fdiv_rn(1.0f, *(shared ? global2 : global)); }
    __device__ __forceinline__ void token(unsigned t, __nv_bfloat16* dst, unsigned kp, const unsigned* table) const {
        stage_row(packed + (size_t)t * (K / 2), scales + (size_t)t * (K / 16), K, kp, dst, table, threadIdx.x, blockDim.x);
    }
    __device__ __forceinline__ void row(unsigned a, __nv_bfloat16* dst, unsigned kp, const unsigned* table) const {
        if (a < split) token(a, dst, kp, table);
        else stage_row(packed2 + (size_t)(a - split) * (K / 2), scales2 + (size_t)(a - split) * (K / 16), K, kp, dst,
                       table, threadIdx.x, blockDim.x);
    }
};

// max of `count` amax words (fp32 bits of |v|) by the whole block; a subnormal maximum flushes to
// zero and a non-finite one is recorded, as the quantize launch does. Every thread gets the result.
__device__ __forceinline__ unsigned block_amax(const unsigned* words, unsigned count, unsigned* status) {
    return quantize_amax_bits(block_max_of_words(words, count), status, blockIdx.x == 0 && blockIdx.y == 0);
}

// A row of T (16-byte aligned) quantized with encode scale s exactly as the quantize kernels do
// (amax_quantize: the block's max |v| from the raw values, fp4_encode_block) and staged as the
// decoded e2m1 * s_block values, zero up to Kp.
template <typename T>
__device__ __forceinline__ void quantize_row(const T* src, float s, unsigned K, unsigned Kp, __nv_bfloat16* dst,
                                             const unsigned* table) {
    for (unsigned b = threadIdx.x; b < Kp / 16; b += blockDim.x) {
        if (b < K / 16) {
            const Fp4Raw16<T> raw = fp4_fetch16(src + (size_t)b * FP4_BLOCK);
            float v[FP4_BLOCK];
            fp4_expand16(raw, v);
            uint2 q;
            const unsigned sf = fp4_encode_block(v, fp4_raw_abs_max_bits(raw), s, q);
            store_decoded(dst + (size_t)b * 16, q, sf, table);
        } else {
            store_zeros(dst + (size_t)b * 16);
        }
    }
}

// W4A4 layer input quantized in the block from its raw values (bf16 or fp32): the global amax is
// the max over the tokens of the per-token maxima the route launch wrote.
template <typename T>
struct StageQuantize {
    static constexpr bool kLayerInput = false;
    const T* x;
    unsigned K;
    const unsigned* x_amax;  // [tokens]
    unsigned tokens;
    unsigned* status;
    float s = 1.0f;
    __device__ __forceinline__ void prepare(unsigned* table) {
        build_code_table(table);
        s = fp4_global_scale_from_amax(__uint_as_float(block_amax(x_amax, tokens, status)));
    }
    __device__ __forceinline__ float a_dec(bool) const { return __fdiv_rn(1.0f, s); }
    __device__ __forceinline__ void token(unsigned t, __nv_bfloat16* dst, unsigned kp, const unsigned* table) const {
        quantize_row(x + (size_t)t * K, s, K, kp, dst, table);
    }
};

// W4A4 down-projection input quantized in the block from the first launch's fp32 SwiGLU output:
// the routed rows with the amax of the routed blocks' maxima, the shared expert's rows (from
// `split` on) with that of its own blocks.
struct StageQuantizeRows {
    static constexpr bool kLayerInput = false;
    const float* h;
    unsigned K;
    const unsigned* h_amax;  // per first-launch block: the routed blocks, then the shared expert's
    unsigned routed_blocks, blocks;
    unsigned split;
    unsigned* status;
    float s = 1.0f, s2 = 1.0f;
    __device__ __forceinline__ void prepare(unsigned* table) {
        build_code_table(table);
        s = fp4_global_scale_from_amax(__uint_as_float(block_amax(h_amax, routed_blocks, status)));
        if (blocks > routed_blocks)
            s2 = fp4_global_scale_from_amax(__uint_as_float(block_amax(h_amax + routed_blocks, blocks - routed_blocks, status)));
    }
    __device__ __forceinline__ float a_dec(bool shared) const { return __fdiv_rn(1.0f, shared ? s2 : s); }
    __device__ __forceinline__ void row(unsigned a, __nv_bfloat16* dst, unsigned kp, const unsigned* table) const {
        quantize_row(h + (size_t)a * K, a < split ? s : s2, K, kp, dst, table);
    }
};

}  // namespace small

#define FP4_STACK_ARGS(P) \
    const uint4 *P##codes, const uint2 *P##scales, const float *P##decode, const float *P##global, \
        const float *P##row_decode, unsigned P##rows, unsigned P##step, unsigned P##first
#define FP4_STACK(P) small::StackRows{P##codes, P##scales, P##decode, P##global, P##row_decode, P##rows, P##step, P##first}

#define FP4_SMALL_GATE_UP_ARGS                                                                            \
    FP4_STACK_ARGS(rg_), FP4_STACK_ARGS(ru_), FP4_STACK_ARGS(sg_), FP4_STACK_ARGS(su_), const int *ids,  \
        const float *row_scale, unsigned top_k, unsigned routed, float limit, int has_limit, float s_limit, \
        int s_has_limit, unsigned H, unsigned I, unsigned pairs_per_block, void *out, int out_f32, int shared_first, \
        unsigned l2_ahead
#define FP4_SMALL_GATE_UP_CALL(D, C, W, N, STAGE, OUT_AMAX, LQ)                                          \
    small::gate_up<D, C, W, N>(STAGE, OUT_AMAX, LQ, FP4_STACK(rg_), FP4_STACK(ru_), FP4_STACK(sg_), FP4_STACK(su_), ids, \
                         row_scale, top_k, routed, small::Swiglu{limit, has_limit}, small::Swiglu{s_limit, s_has_limit}, \
                         H, I, pairs_per_block, out, out_f32, shared_first, l2_ahead)

#define FP4_SMALL_DOWN_ARGS                                                                               \
    FP4_STACK_ARGS(w_), FP4_STACK_ARGS(sw_), int has_shared, const int *ids, const float *weights, int weighted, \
        unsigned top_k, unsigned routed, const __nv_bfloat16 *shared_out, __nv_bfloat16 *out, unsigned H, unsigned I, \
        unsigned l2_ahead
#define FP4_SMALL_DOWN_CALL(D, C, W, STAGE)                                                               \
    small::down<D, C, W>(STAGE, FP4_STACK(w_), FP4_STACK(sw_), has_shared, ids, weights, weighted, top_k, routed, \
                      shared_out, out, H, I, l2_ahead)

// VARIANT: weight groups in flight per warp (D), accumulator chains (C), blocks per SM the
// registers must allow (B), no per-tile bounds tests (W), warps per block of the first launch (N).
// Activations: bf16 (W4A16); NVFP4 quantized by their own launches or, at T = 1, by the last block
// of the launch before (the route launch's, and with h_done the gate_up nvfp4 launch's own last
// block quantizes its fp32 output for the down launch); or (quant_<x>) quantized in the blocks
// from the raw values and the per-token / per-block maxima of the previous launch (W4A4 in three
// launches: moe_route_*, gate_up, down).
#define FP4_DEFINE_SMALL_GATE_UP(VARIANT, D, C, B, W, N)                                                        \
    extern "C" __global__ void __launch_bounds__(32 * N, B) moe_small_gate_up_bf16_##VARIANT(                \
        const __nv_bfloat16* x, FP4_SMALL_GATE_UP_ARGS) {                                                 \
        FP4_SMALL_GATE_UP_CALL(D, C, W, N, (small::StageBf16{x, H}), nullptr, (small::LastQuantize{}));                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * N, B) moe_small_gate_up_nvfp4_##VARIANT(               \
        const unsigned char* x_packed, const unsigned char* x_scales, const float* x_global, unsigned* h_amax, \
        unsigned* h_done, unsigned h_spread, unsigned char* hq_packed, unsigned char* hq_scales, float* hq_global, \
        unsigned char* sq_packed, unsigned char* sq_scales, float* sq_global, unsigned* status,               \
        FP4_SMALL_GATE_UP_ARGS) {                                                                         \
        FP4_SMALL_GATE_UP_CALL(D, C, W, N, (small::StageNvfp4{x_packed, x_scales, x_global, H}), h_amax,       \
                               (small::LastQuantize{h_done, h_spread, {hq_packed, hq_scales, hq_global},      \
                                                    {sq_packed, sq_scales, sq_global}, status}));          \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * N, B) moe_small_gate_up_quant_bf16_##VARIANT(          \
        const __nv_bfloat16* x, const unsigned* x_amax, unsigned tokens, unsigned* status, unsigned* h_amax, \
        FP4_SMALL_GATE_UP_ARGS) {                                                                         \
        FP4_SMALL_GATE_UP_CALL(D, C, W, N, (small::StageQuantize<__nv_bfloat16>{x, H, x_amax, tokens, status}), h_amax, (small::LastQuantize{})); \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * N, B) moe_small_gate_up_quant_f32_##VARIANT(           \
        const float* x, const unsigned* x_amax, unsigned tokens, unsigned* status, unsigned* h_amax,      \
        FP4_SMALL_GATE_UP_ARGS) {                                                                         \
        FP4_SMALL_GATE_UP_CALL(D, C, W, N, (small::StageQuantize<float>{x, H, x_amax, tokens, status}), h_amax, (small::LastQuantize{})); \
    }
#define FP4_DEFINE_SMALL_DOWN(VARIANT, D, C, B, W)                                                           \
    extern "C" __global__ void __launch_bounds__(256, B) moe_small_down_bf16_##VARIANT(                   \
        const __nv_bfloat16* h, FP4_SMALL_DOWN_ARGS) {                                                    \
        FP4_SMALL_DOWN_CALL(D, C, W, (small::StageBf16{h, I}));                                             \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, B) moe_small_down_nvfp4_##VARIANT(                  \
        const unsigned char* h_packed, const unsigned char* h_scales, const float* h_global,              \
        const unsigned char* s_packed, const unsigned char* s_scales, const float* s_global, FP4_SMALL_DOWN_ARGS) { \
        FP4_SMALL_DOWN_CALL(D, C, W, (small::StageNvfp4{h_packed, h_scales, h_global, I, s_packed, s_scales, s_global, \
                                                    routed}));                                            \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, B) moe_small_down_quant_##VARIANT(                  \
        const float* h, const unsigned* h_amax, unsigned routed_blocks, unsigned blocks, unsigned* status,  \
        FP4_SMALL_DOWN_ARGS) {                                                                            \
        FP4_SMALL_DOWN_CALL(D, C, W, (small::StageQuantizeRows{h, I, h_amax, routed_blocks, blocks, routed, status})); \
    }

// the variants the launchers use, chosen among (D, C, B) = (2|4, 1|2, 2), (2, 2, 3), (1, 2, 4)
// (H200, V4-Flash and V3 at T = 1, 2, 8, each launch alone): gate_up with 2 groups in flight and
// one chain at 2 blocks per SM; down with 1 group in flight, two chains, 4 blocks per SM (18.2 ->
// 17.1 us at T = 1, 112 -> 79 us at T = 8 on V4-Flash against 4 groups, one chain)
FP4_DEFINE_SMALL_GATE_UP(d2c1, 2, 1, 2, false, 8)
FP4_DEFINE_SMALL_DOWN(d1c2b4, 1, 2, 4, false)
// the same without per-tile bounds tests, for K of whole scale groups (ops/moe.py SMALL_WHOLE_FETCHES)
FP4_DEFINE_SMALL_GATE_UP(d2c1w, 2, 1, 2, true, 8)
FP4_DEFINE_SMALL_DOWN(d1c2b4w, 1, 2, 4, true)
// gate|up in blocks of 4 warps (one to four pairs each, 4 blocks per SM), for T <= 4 (ops/moe.py
// SMALL_NARROW_MAX_TOKENS; H200, V4-Flash, the layer, W4A16 / W4A4: T = 1 48.7 -> 48.2 / 59.3 ->
// 59.6 us, T = 2 76.4 -> 76.2 / 88.8 -> 88.9, T = 4 135.7 -> 126.6 / 150.4 -> 142.6, T = 8 equal;
// 2-warp blocks: no faster at T <= 4, 30 % slower at T = 8)
FP4_DEFINE_SMALL_GATE_UP(d2c1n4, 2, 1, 4, false, 4)
FP4_DEFINE_SMALL_GATE_UP(d2c1n4w, 2, 1, 4, true, 4)
// gate|up in blocks of 4 warps with one weight group in flight per warp, for T <= 4 (ops/moe.py
// SMALL_GATE_UP_GEOMETRY): without the second buffer's registers (127 -> 72) 7 blocks fit an SM
// instead of 4; at one pair per block, V4-Flash W4A16 T = 1 48.3 -> 46.2 us, T = 2 76.8 -> 71.0
FP4_DEFINE_SMALL_GATE_UP(d1c1n4b7, 1, 1, 7, false, 4)
FP4_DEFINE_SMALL_GATE_UP(d1c1n4b7w, 1, 1, 7, true, 4)
// down candidates with more weight groups in flight per warp (ops/moe.py SMALL_DOWN_VARIANTS, timed by
// scripts/sweep_moe_small.py): with the staging no longer serialising the prologue, still none faster
// than d1c2b4 (H200, V4-Flash W4A16: T = 1 49.7-51.2 us against 49.2, T = 8 259-271 against 238)
FP4_DEFINE_SMALL_DOWN(d2c1b2, 2, 1, 2, false)
FP4_DEFINE_SMALL_DOWN(d2c2b2, 2, 2, 2, false)
FP4_DEFINE_SMALL_DOWN(d4c1b2, 4, 1, 2, false)
