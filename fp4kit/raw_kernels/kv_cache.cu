// KV cache kernels: the sliding-window append, the compressor with its preallocated compressed-KV
// buffer, and the device position counters. fp4kit/reference/kv_cache.py is the specification.
// Every position is read on the device, so a decode step's appends can be captured in a CUDA graph
// and replayed while the positions advance.
//
//   kv_append_swa   grid (T, B), 64 threads. kv bf16 [B, T, D] -> swa bf16 [B, W, D] at slot
//                   (pos[b] + i) % W for i < counts[b] (all T when counts is null); when more than W
//                   tokens arrive only the last W are written (no two writes race for a slot).
//   kv_compress     grid B, 256 threads, one block per sequence walking its new tokens in order:
//                   c, z fp32 or bf16 [B, T, coff*D] go into the fp32 state ring [B, coff*R, coff*D]
//                   at slot p % (coff*R); a token that completes a block emits one entry: per
//                   channel a softmax over the block's slots (and the previous block's for R = 4)
//                   of z + ape, weighted sum of c, RMSNorm, RoPE, stored at comp[b, comp_len[b]]
//                   (bf16 [B, C, D]); a full buffer sets FP4_STATUS_KV_COMP_OVERFLOW instead.
//                   flags bit 0 (kAdvance): it then moves pos[b] on as kv_advance does (one launch
//                   less); bit 1 (kReportCounts): it records a count out of range itself (the cache
//                   of a window nobody reads appends without kv_append_swa, which reports it otherwise).
//   kv_compress2    two caches' kv_compress (bf16 inputs) in one launch, grid 2B (see below).
//   kv_advance      grid 1: pos[b] += counts[b] (or T). Launched after the others.
//   kv_rewind       grid 1: pos[b] -= n[b], n[b] clamped to [0, min(1, pos[b])] (one outside
//                   [0, 1] recorded as FP4_STATUS_KV_INPUT); comp_len[b] (when given) becomes
//                   min(pos[b] / R, capacity), the entries complete at the new position.
// Every kernel clamps counts[b] to [0, T]; kv_append_swa (or kv_compress with kReportCounts) records
// one outside it (FP4_STATUS_KV_INPUT).
#include "common/fp32.cuh"
#include "common/status.cuh"
#include "common/pdl.cuh"

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// counts[b] clamped to [0, T] (all T without counts); `record` or-s FP4_STATUS_KV_INPUT for one
// out of range, so that each kernel reads the same count and one of them reports it.
__device__ __forceinline__ unsigned token_count(const int* counts, unsigned b, unsigned T, bool record,
                                                unsigned* status) {
    if (!counts) return T;
    const int c = counts[b];
    if (c >= 0 && (unsigned)c <= T) return (unsigned)c;
    if (record) atomicOr(status, FP4_STATUS_KV_INPUT);
    return c < 0 ? 0u : T;
}

extern "C" __global__ void __launch_bounds__(64) kv_append_swa(const __nv_bfloat16* kv, const int* counts,
                                                              __nv_bfloat16* swa, const int* pos, unsigned T,
                                                              unsigned W, unsigned D, unsigned* status) {
    pdl::wait_prior();
    const unsigned i = blockIdx.x, b = blockIdx.y;
    const unsigned n = token_count(counts, b, T, i == 0 && threadIdx.x == 0, status);
    if (i >= n || i + W < n) return;  // not this sequence's token, or overwritten later in this call
    const unsigned slot = ((unsigned)pos[b] + i) % W;
    const uint4* src = reinterpret_cast<const uint4*>(kv + ((size_t)b * T + i) * D);
    uint4* dst = reinterpret_cast<uint4*>(swa + ((size_t)b * W + slot) * D);
    for (unsigned c = threadIdx.x; c < D / 8; c += blockDim.x) dst[c] = src[c];
}

extern "C" __global__ void kv_advance(int* pos, const int* counts, unsigned B, unsigned T, unsigned* status) {
    pdl::wait_prior();
    for (unsigned b = threadIdx.x; b < B; b += blockDim.x) pos[b] += (int)token_count(counts, b, T, false, status);
}

extern "C" __global__ void kv_rewind(int* pos, int* comp_len, const int* tokens, unsigned B, unsigned R,
                                     unsigned capacity, unsigned* status) {
    pdl::wait_prior();
    for (unsigned b = threadIdx.x; b < B; b += blockDim.x) {
        int n = tokens[b];
        if (n < 0 || n > 1) {
            atomicOr(status, FP4_STATUS_KV_INPUT);
            n = n < 0 ? 0 : 1;
        }
        const int p = max(pos[b] - n, 0);
        pos[b] = p;
        if (comp_len) comp_len[b] = (int)min((unsigned)p / R, capacity);
    }
}

__device__ float block_sum(float v, float* scratch) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += scratch[w];
    __syncthreads();
    return s;
}

constexpr int kAdvance = 1, kReportCounts = 2;  // kv_compress flags
constexpr unsigned kFastSlots = 8;  // blocks of up to this many slots (ratio 4 with its previous block)
constexpr unsigned kPooledMax = 1024;  // entries up to this wide keep their pooled channels in shared memory

// Pooled channel d of the block [first, p]: one softmax over its slots (and, for R = 4 after the
// first block, the previous block's slots on the first half of the channels) of z + ape, weighted
// sum of c. The state rows are fp32 [slots, width].
__device__ __forceinline__ float pooled_channel(const float* ks, const float* ss, const float* ape, unsigned d, unsigned D,
                                unsigned cf, unsigned ratio, unsigned slots, unsigned first, unsigned p, bool previous) {
    const unsigned width = cf * D, ch = cf == 2 ? D + d : d;
    const unsigned lo = previous ? first - ratio : first;
    if (p - lo < kFastSlots) {  // the slots' values loaded at once (ratio 4), the same arithmetic as below
        float zv[kFastSlots], kv[kFastSlots];
#pragma unroll
        for (unsigned j = 0; j < kFastSlots; ++j) {
            const unsigned q = lo + j, k = q < first ? d : ch;
            zv[j] = kv[j] = 0.0f;
            if (q <= p) {
                zv[j] = ss[(size_t)(q % slots) * width + k] + ape[(q % ratio) * width + k];
                kv[j] = ks[(size_t)(q % slots) * width + k];
            }
        }
        float m = -3.402823466e+38f;
#pragma unroll
        for (unsigned j = 0; j < kFastSlots; ++j)
            if (lo + j <= p) m = fmaxf(m, zv[j]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (unsigned j = 0; j < kFastSlots; ++j)
            if (lo + j <= p) {
                const float e = expf(zv[j] - m);
                den += e;
                num = fmaf(e, kv[j], num);
            }
        return num / den;
    }
    float m = -3.402823466e+38f;
    for (unsigned q = lo; q <= p; ++q) {
        const unsigned k = q < first ? d : ch;
        m = fmaxf(m, ss[(size_t)(q % slots) * width + k] + ape[(q % ratio) * width + k]);
    }
    float num = 0.0f, den = 0.0f;
    for (unsigned q = lo; q <= p; ++q) {
        const unsigned k = q < first ? d : ch;
        const float e = expf(ss[(size_t)(q % slots) * width + k] + ape[(q % ratio) * width + k] - m);
        den += e;
        num = fmaf(e, ks[(size_t)(q % slots) * width + k], num);
    }
    return num / den;
}

template <typename T>
__device__ void compress(const T* c, const T* z, const int* counts, const float* ape, const float* norm_weight,
                         float* kv_state, float* score_state, __nv_bfloat16* comp, int* comp_len, int* pos,
                         unsigned Tn, unsigned D, unsigned ratio, unsigned capacity, float eps, unsigned rope_dim,
                         const double* inv_freq, unsigned* status, int flags, unsigned b) {
    __shared__ float scratch[32];
    __shared__ float pooled[kPooledMax];
    const unsigned cf = ratio == 4 ? 2 : 1, width = cf * D, slots = cf * ratio;
    // kv_append_swa reports a bad count unless there is none
    const unsigned n = token_count(counts, b, Tn, (flags & kReportCounts) && threadIdx.x == 0, status);
    float* ks = kv_state + (size_t)b * slots * width;
    float* ss = score_state + (size_t)b * slots * width;
    unsigned len = (unsigned)comp_len[b];
    for (unsigned i = 0; i < n; ++i) {
        const unsigned p = (unsigned)pos[b] + i;
        const T* ci = c + ((size_t)b * Tn + i) * width;
        const T* zi = z + ((size_t)b * Tn + i) * width;
        for (unsigned ch = threadIdx.x; ch < width; ch += blockDim.x) {
            ks[(size_t)(p % slots) * width + ch] = to_f32(ci[ch]);
            ss[(size_t)(p % slots) * width + ch] = to_f32(zi[ch]);
        }
        __syncthreads();
        if ((p + 1) % ratio != 0) continue;
        if (len >= capacity) {  // full: record it, never overwrite
            if (threadIdx.x == 0) atomicOr(status, FP4_STATUS_KV_COMP_OVERFLOW);
            continue;
        }
        const unsigned first = p + 1 - ratio;
        const bool previous = cf == 2 && p + 1 >= 2 * ratio;
        // RMS of the pooled entry (its channels kept in shared memory when it fits, else each
        // recomputed below), then each pair normalised, rotated and stored
        const bool keep = D <= kPooledMax;
        float sq = 0.0f;
        for (unsigned d = threadIdx.x; d < D; d += blockDim.x) {
            const float v = pooled_channel(ks, ss, ape, d, D, cf, ratio, slots, first, p, previous);
            if (keep) pooled[d] = v;
            sq = fmaf(v, v, sq);
        }
        const float inv_rms = rsqrtf(block_sum(sq, scratch) / (float)D + eps);  // a barrier: pooled complete
        auto channel = [&](unsigned d) {
            return keep ? pooled[d] : pooled_channel(ks, ss, ape, d, D, cf, ratio, slots, first, p, previous);
        };
        __nv_bfloat16* out = comp + ((size_t)b * capacity + len) * D;
        for (unsigned d0 = 2 * threadIdx.x; d0 < D; d0 += 2 * blockDim.x) {
            float a = channel(d0) * inv_rms * norm_weight[d0];
            float bb = channel(d0 + 1) * inv_rms * norm_weight[d0 + 1];
            if (d0 >= D - rope_dim) {  // adjacent pairs, angle = block start * inv_freq[i] (pair i)
                // in double: the angle of a late position needs more than fp32's 24 bits
                const double angle = (double)first * inv_freq[(d0 - (D - rope_dim)) / 2];
                double sn, cs;
                sincos(angle, &sn, &cs);
                const float ra = a * (float)cs - bb * (float)sn, rb = a * (float)sn + bb * (float)cs;
                a = ra, bb = rb;
            }
            out[d0] = __float2bfloat16_rn(a);
            out[d0 + 1] = __float2bfloat16_rn(bb);
        }
        ++len;
        __syncthreads();
    }
    if (threadIdx.x == 0) comp_len[b] = (int)len;
    if (flags & kAdvance) {  // the position advance of kv_advance, for this block's sequence, after every read of pos[b]
        __syncthreads();
        if (threadIdx.x == 0) pos[b] += (int)n;
    }
}

#define FP4_DEFINE_COMPRESS(SUFFIX, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) kv_compress_##SUFFIX(                               \
        const T* c, const T* z, const int* counts, const float* ape, const float* norm_weight, float* kv_state, \
        float* score_state, __nv_bfloat16* comp, int* comp_len, int* pos, unsigned Tn, unsigned D,         \
        unsigned ratio, unsigned capacity, float eps, unsigned rope_dim, const double* inv_freq,            \
        unsigned* status, int flags) {                                                                    \
        pdl::wait_prior();                                                                                     \
        compress<T>(c, z, counts, ape, norm_weight, kv_state, score_state, comp, comp_len, pos, Tn, D, ratio, \
                    capacity, eps, rope_dim, inv_freq, status, flags, blockIdx.x);                        \
    }

FP4_DEFINE_COMPRESS(f32, float)
FP4_DEFINE_COMPRESS(bf16, __nv_bfloat16)

// Two caches' compressors over the same B sequences and T tokens in one launch (a ratio-4 layer's
// KV cache and its indexer's key cache): grid 2B, blocks b < B run kv_compress on part 0's sequence
// b, the others on part 1's sequence b - B, each part with its own caches, RoPE frequencies and
// flags (counts, T and eps shared).
#define FP4_COMPRESS_PART(P)                                                                                 \
    const __nv_bfloat16 *c##P, const __nv_bfloat16 *z##P, const float *ape##P, const float *norm##P,        \
        float *kv_state##P, float *score_state##P, __nv_bfloat16 *comp##P, int *comp_len##P, int *pos##P,     \
        unsigned D##P, unsigned ratio##P, unsigned capacity##P, unsigned rope_dim##P, const double *inv_freq##P, \
        int flags##P
#define FP4_COMPRESS_PART_CALL(P, B)                                                                          \
    compress<__nv_bfloat16>(c##P, z##P, counts, ape##P, norm##P, kv_state##P, score_state##P, comp##P,        \
                            comp_len##P, pos##P, Tn, D##P, ratio##P, capacity##P, eps, rope_dim##P, inv_freq##P, status, \
                            flags##P, B)

extern "C" __global__ void __launch_bounds__(256) kv_compress2_bf16(FP4_COMPRESS_PART(0), FP4_COMPRESS_PART(1),
                                                                    const int* counts, unsigned B, unsigned Tn,
                                                                    float eps, unsigned* status) {
    pdl::wait_prior();
    if (blockIdx.x < B) FP4_COMPRESS_PART_CALL(0, blockIdx.x);
    else FP4_COMPRESS_PART_CALL(1, blockIdx.x - B);
}
