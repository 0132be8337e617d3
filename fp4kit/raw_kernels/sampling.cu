// Token sampling: one draw per row from softmax(logits / T) truncated by top-k, top-p and min-p.
// fp4kit/reference/sampling.py is the specification (filter order, tie rules, special rows, the
// Philox counter layout and the Gumbel race).
//
// Arguments (row-major, contiguous):
//   logits    bf16 | fp32 [B, V]   any finite, +-inf or NaN values (NaN is read as -inf)
//   t_rows    fp32  [B] or null    per-row temperature; null: every row uses t_all
//   k_rows    int32 [B] or null    per-row top_k (0: off); null: k_all
//   p_rows    fp32  [B] or null    per-row top_p (1: off); null: p_all
//   m_rows    fp32  [B] or null    per-row min_p (0: off); null: m_all
//   seed      uint64 [1]           Philox key (lo word, hi word)
//   offset    uint64 [1]           Philox counter words 2 and 3; advanced by one per launch, on the
//                                  device, by the last block to arrive
//   arrivals  uint32 [1]           0 between launches: counts the blocks that have read `offset`
//   out       int32 [B]            the drawn token ids, always in [0, V)
//   status    uint32 [1]           SMP_STATUS_INPUT (8) is or-ed in for a NaN or +inf logit, a row
//                                  with no finite logit, or an invalid per-row parameter (replaced
//                                  as the reference says)
//
// Geometry: grid B, 1024 threads, one block per row. Thread t owns the contiguous token range
// [t * per, t * per + per), per = ceil(V / 1024) rounded up to a multiple of 4 (so a range starts
// on a vector boundary and a Philox call covers 4 tokens of one thread). The logits are re-read
// (from L2) by every pass; nothing is sorted:
//   1. max and argmax of the canonical logits (argmax is the greedy / +inf / empty-row result);
//      d_i = (l_i - l_max) / T <= 0 from here on, and keys are d's order-preserving uint32 image;
//   2. top-k: a radix select on the keys (digits of 11, 11, 10 bits, 2048-bin shared histograms of
//      counts and of 36-bit fixed-point masses exp(d_i) * 2^36, a block scan from the top bin);
//      the kept set is "key above the threshold bits, or equal and among the first `need` in id
//      order" (a prefix of the order larger probability first, lower id first); its mass is
//      what top-p renormalises by;
//   3. top-p: the same radix descent driven by the cumulative mass, target ceil(p * mass(top-k));
//   4. race: per-thread tie ranks by one block scan, then each kept token's d_i - log(-log u_i)
//      (u from Philox, min-p checked as exp(d_i) >= m), and a block argmax, ties to the lower id.
// Passes 2 and 3 run only when their filter is on and stop early once the threshold bin is taken
// whole. Masses are integers, so the thresholds do not depend on the order of the atomics.
#include <cuda_bf16.h>

#include "common/block_scan.cuh"
#include "common/philox.cuh"

#define SMP_STATUS_INPUT 8u
#define SMP_NEG_INF __int_as_float(0xFF800000)
#define SMP_FLT_MIN 1.175494351e-38f

constexpr int kThreads = 1024;
constexpr unsigned kBins = 2048;
constexpr float kMassScale = 68719476736.0f;  // 2^36: V <= 2^24 tokens of mass <= 2^36 fit in 64 bits

__device__ __forceinline__ float smp_load(const float* p) { return *p; }
__device__ __forceinline__ float smp_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Four logits at p (n of them valid); vec: p is 16-byte (fp32) or 8-byte (bf16) aligned.
__device__ __forceinline__ void smp_load4(const float* p, unsigned n, bool vec, float v[4]) {
    if (vec && n == 4) {
        const float4 f = *reinterpret_cast<const float4*>(p);
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = (unsigned)j < n ? p[j] : SMP_NEG_INF;
}

__device__ __forceinline__ void smp_load4(const __nv_bfloat16* p, unsigned n, bool vec, float v[4]) {
    if (vec && n == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.x & 0xFFFF0000u);
        v[2] = __uint_as_float(w.y << 16), v[3] = __uint_as_float(w.y & 0xFFFF0000u);
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = (unsigned)j < n ? smp_load(p + j) : SMP_NEG_INF;
}

// Order-preserving map of a float (NaN -> -inf, -0 -> +0) to uint32.
__device__ __forceinline__ unsigned smp_key(float s) {
    unsigned u = isnan(s) ? 0xFF800000u : __float_as_uint(s);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float smp_unkey(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__device__ __forceinline__ unsigned long long smp_block_max(unsigned long long v, unsigned long long* scratch) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long x = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        v = x > v ? x : v;
    }
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[lane];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned long long x = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        v = x > v ? x : v;
    }
    __syncthreads();
    return v;
}

// A prefix of the order (key descending, id ascending): keys whose masked bits exceed `bits`, and
// the first `need` (in id order) of those whose masked bits equal `bits`.
struct Prefix {
    unsigned mask, bits, need;
};

struct Row {
    unsigned begin, count;  // this thread's token range
    float lmax, temp;
    bool vec;
};

template <typename T, class F>
__device__ __forceinline__ void smp_for_each(const T* row, const Row& r, F&& f) {
#pragma unroll 1
    for (unsigned i = 0; i < r.count; i += 4) {
        float v[4];
        const unsigned n = min(4u, r.count - i);
        smp_load4(row + r.begin + i, n, r.vec, v);
        f(r.begin + i, v, n);
    }
}

// d = (canonical logit - l_max) / T <= 0 (or -inf).
__device__ __forceinline__ float smp_scaled(float l, const Row& r) {
    const float c = isnan(l) ? SMP_NEG_INF : l;
    return __fdiv_rn(__fsub_rn(c, r.lmax), r.temp) + 0.0f;
}

__device__ __forceinline__ unsigned long long smp_mass(float d) {
    return __float2ull_rn(__fmul_rn(expf(d), kMassScale));
}

struct SelectSmem {
    unsigned count[kBins];
    unsigned long long mass[kBins];
    unsigned scan32[32];
    unsigned long long scan64[32];
    unsigned digit, found, count_above, in_bin;
    unsigned long long mass_above, bin_mass;
};

// Radix descent to the prefix that holds `want` tokens (by_mass false) or whose mass first reaches
// `want` (by_mass true). `*prefix_mass` receives the mass of the prefix.
template <typename T>
__device__ Prefix smp_select(const T* row, const Row& r, bool by_mass, unsigned long long want,
                             unsigned long long* prefix_mass, SelectSmem& sm) {
    const unsigned tid = threadIdx.x;
    unsigned mask = 0u, bits = 0u;
    unsigned need = (unsigned)want;
    unsigned long long rem = want, mass_above = 0ull, bin_mass = 0ull;
    unsigned in_bin = 0u;
    bool early = false;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const unsigned digit_mask = pass == 2 ? 0x3FFu : 0x7FFu;
        sm.count[tid] = 0u, sm.count[tid + kThreads] = 0u;
        sm.mass[tid] = 0ull, sm.mass[tid + kThreads] = 0ull;
        if (tid == 0) sm.found = 0u;
        __syncthreads();
        smp_for_each(row, r, [&](unsigned, const float* v, unsigned n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if ((unsigned)j >= n) break;
                const float d = smp_scaled(v[j], r);
                const unsigned key = smp_key(d);
                if ((key & mask) != bits) continue;
                const unsigned digit = (key >> shift) & digit_mask;
                atomicAdd(&sm.count[digit], 1u);
                const unsigned long long q = smp_mass(d);
                if (q) atomicAdd(&sm.mass[digit], q);
            }
        });
        __syncthreads();
        // thread t holds bins 2047 - 2t and 2046 - 2t: the scans count what lies in larger bins
        const unsigned d_hi = kBins - 1 - 2 * tid, d_lo = d_hi - 1;
        const unsigned c_hi = sm.count[d_hi], c_lo = sm.count[d_lo];
        const unsigned long long m_hi = sm.mass[d_hi], m_lo = sm.mass[d_lo];
        const unsigned c_above_hi = block_inclusive_scan(c_hi + c_lo, sm.scan32) - c_hi - c_lo;
        const unsigned long long m_above_hi = block_inclusive_scan(m_hi + m_lo, sm.scan64) - m_hi - m_lo;
        const unsigned c_above_lo = c_above_hi + c_hi;
        const unsigned long long m_above_lo = m_above_hi + m_hi;
        bool hit_hi, hit_lo;
        if (by_mass) {
            hit_hi = m_above_hi < rem && rem <= m_above_hi + m_hi;
            hit_lo = m_above_lo < rem && rem <= m_above_lo + m_lo;
        } else {
            hit_hi = c_above_hi < need && need <= c_above_hi + c_hi;
            hit_lo = c_above_lo < need && need <= c_above_lo + c_lo;
        }
        if (hit_hi) {
            sm.digit = d_hi, sm.count_above = c_above_hi, sm.in_bin = c_hi;
            sm.mass_above = m_above_hi, sm.bin_mass = m_hi, sm.found = 1u;
        } else if (hit_lo) {
            sm.digit = d_lo, sm.count_above = c_above_lo, sm.in_bin = c_lo;
            sm.mass_above = m_above_lo, sm.bin_mass = m_lo, sm.found = 1u;
        }
        __syncthreads();
        if (!sm.found) {  // unreachable for consistent inputs: keep everything
            *prefix_mass = ~0ull;
            return Prefix{0u, 0u, 0xFFFFFFFFu};
        }
        bits |= sm.digit << shift;
        mask |= digit_mask << shift;
        in_bin = sm.in_bin, bin_mass = sm.bin_mass;
        need -= sm.count_above;
        rem -= sm.mass_above;
        mass_above += sm.mass_above;
        __syncthreads();  // every thread has read the shared results before the next pass writes them
        if (by_mass ? in_bin == 1u : in_bin == need) {
            early = true;
            break;
        }
    }
    if (by_mass) {
        if (early) {
            need = 1u;
        } else {  // all 32 bits fixed: every token of the bin has the same mass
            const unsigned long long each = bin_mass / in_bin;
            unsigned long long n = each ? (rem + each - 1) / each : in_bin;
            need = (unsigned)(n < 1ull ? 1ull : (n > in_bin ? in_bin : n));
        }
    }
    *prefix_mass = mass_above + (need == in_bin ? bin_mass : (bin_mass / in_bin) * need);
    return Prefix{mask, bits, need};
}

__device__ __forceinline__ bool smp_in_prefix(unsigned key, const Prefix& p, unsigned& rank) {
    const unsigned top = key & p.mask;
    if (top > p.bits) return true;
    if (top != p.bits) return false;
    return rank++ < p.need;
}

template <typename T>
__device__ __forceinline__ void sample_row(const T* __restrict__ logits, unsigned V, int vec,
                                           const float* __restrict__ t_rows, float t_all,
                                           const int* __restrict__ k_rows, int k_all,
                                           const float* __restrict__ p_rows, float p_all,
                                           const float* __restrict__ m_rows, float m_all,
                                           const unsigned long long* __restrict__ seed,
                                           unsigned long long* __restrict__ offset, unsigned* __restrict__ arrivals,
                                           int* __restrict__ out, unsigned* __restrict__ status) {
    __shared__ SelectSmem sm;
    __shared__ unsigned long long s_offset, s_seed;
    const unsigned b = blockIdx.x, tid = threadIdx.x;

    // Read the counter, then arrive; the last block to arrive advances it for the next launch.
    if (tid == 0) {
        s_offset = *offset;
        s_seed = *seed;
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(arrivals, 1u) == gridDim.x - 1) {
            *arrivals = 0u;
            *offset = s_offset + 1ull;
            __threadfence();
        }
    }
    const unsigned long long ctr_offset = s_offset, key = s_seed;

    // Per-row parameters, with invalid device values replaced as the reference says.
    float temp = t_rows ? t_rows[b] : t_all;
    int top_k = k_rows ? k_rows[b] : k_all;
    float top_p = p_rows ? p_rows[b] : p_all;
    float min_p = m_rows ? m_rows[b] : m_all;
    bool flag = false;
    if (isnan(temp) || temp < 0.0f) flag = true, temp = 0.0f;
    if (top_k < 0) flag = true, top_k = 0;
    if (isnan(top_p) || top_p <= 0.0f || top_p > 1.0f) flag = true, top_p = 1.0f;
    if (isnan(min_p) || min_p < 0.0f || min_p >= 1.0f) flag = true, min_p = 0.0f;
    if (temp < SMP_FLT_MIN) temp = 0.0f;

    const T* row = logits + (size_t)b * V;
    Row r;
    const unsigned per = ((V + kThreads - 1) / kThreads + 3u) & ~3u;
    r.begin = tid * per;
    r.count = r.begin < V ? min(per, V - r.begin) : 0u;
    r.vec = vec != 0;

    // 1. max / argmax of the canonical logits, ties to the lower id; NaN and +inf are events.
    unsigned long long best = 0ull;
    smp_for_each(row, r, [&](unsigned i, const float* v, unsigned n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((unsigned)j >= n) break;
            flag |= isnan(v[j]) || v[j] == __int_as_float(0x7F800000);
            const unsigned long long cand = ((unsigned long long)smp_key(v[j]) << 32) | (unsigned)~(i + j);
            best = cand > best ? cand : best;
        }
    });
    best = smp_block_max(best, sm.scan64);
    const float lmax = smp_unkey((unsigned)(best >> 32));
    const unsigned greedy = ~(unsigned)best;
    flag |= lmax == SMP_NEG_INF;  // no finite logit (and no +inf)
    if (__syncthreads_or(flag) && tid == 0) atomicOr(status, SMP_STATUS_INPUT);
    if (temp == 0.0f || !isfinite(lmax)) {
        if (tid == 0) out[b] = (int)(greedy < V ? greedy : 0u);
        return;
    }
    r.lmax = lmax, r.temp = temp;

    // 2. top-k, 3. top-p: prefixes of the order (larger d first, lower id first).
    const Prefix all{0u, 0u, 0xFFFFFFFFu};
    Prefix pk = all, pp = all;
    unsigned long long mass_k = 0ull;
    const bool use_k = top_k > 0 && (unsigned)top_k < V;
    const bool use_p = top_p < 1.0f;
    if (use_k) pk = smp_select(row, r, false, (unsigned long long)top_k, &mass_k, sm);
    if (use_p) {
        if (!use_k) {  // the total mass: one block reduction
            unsigned long long part = 0ull;
            smp_for_each(row, r, [&](unsigned, const float* v, unsigned n) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if ((unsigned)j < n) part += smp_mass(smp_scaled(v[j], r));
            });
            const unsigned long long total = block_inclusive_scan(part, sm.scan64);
            if (tid == kThreads - 1) sm.bin_mass = total;  // the inclusive scan ends with the block total
            __syncthreads();
            mass_k = sm.bin_mass;
            __syncthreads();
        }
        const unsigned long long target =
            mass_k == ~0ull ? 1ull : (unsigned long long)ceil((double)top_p * (double)mass_k);
        unsigned long long unused;
        if (mass_k != ~0ull) pp = smp_select(row, r, true, target < 1ull ? 1ull : target, &unused, sm);
    }

    // 4. The race. Ranks among each prefix's boundary ties come from one scan of per-thread counts.
    unsigned eq_k = 0u, eq_p = 0u;
    smp_for_each(row, r, [&](unsigned, const float* v, unsigned n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((unsigned)j >= n) break;
            const unsigned key = smp_key(smp_scaled(v[j], r));
            eq_k += (key & pk.mask) == pk.bits;
            eq_p += (key & pp.mask) == pp.bits;
        }
    });
    const unsigned long long mine = eq_k | ((unsigned long long)eq_p << 32);
    const unsigned long long before = block_inclusive_scan(mine, sm.scan64) - mine;
    unsigned rank_k = (unsigned)before, rank_p = (unsigned)(before >> 32);
    const unsigned k0 = (unsigned)key, k1 = (unsigned)(key >> 32);
    const uint4 ctr_base = make_uint4(0u, b, (unsigned)ctr_offset, (unsigned)(ctr_offset >> 32));
    unsigned long long win = 0ull;
    smp_for_each(row, r, [&](unsigned i, const float* v, unsigned n) {
        uint4 ctr = ctr_base;
        ctr.x = i >> 2;
        const uint4 x = fp4_philox4x32_10(ctr, k0, k1);
        const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((unsigned)j >= n) break;
            const float d = smp_scaled(v[j], r);
            const unsigned key_d = smp_key(d);
            const bool in_k = smp_in_prefix(key_d, pk, rank_k);
            const bool in_p = smp_in_prefix(key_d, pp, rank_p);
            if (!(in_k && in_p)) continue;
            if (min_p > 0.0f && !(expf(d) >= min_p)) continue;
            const float u = fp4_philox_uniform(words[j]);
            const float g = -logf(-logf(u));
            const unsigned long long cand = ((unsigned long long)smp_key(__fadd_rn(d, g)) << 32) | (unsigned)~(i + j);
            win = cand > win ? cand : win;
        }
    });
    win = smp_block_max(win, sm.scan64);
    if (tid == 0) {
        const unsigned tok = ~(unsigned)win;
        out[b] = (int)(win != 0ull && tok < V ? tok : greedy);
    }
}

#define SMP_ARGS(T)                                                                                              \
    const T *__restrict__ logits, unsigned V, int vec, const float *__restrict__ t_rows, float t_all,          \
        const int *__restrict__ k_rows, int k_all, const float *__restrict__ p_rows, float p_all,               \
        const float *__restrict__ m_rows, float m_all, const unsigned long long *__restrict__ seed,             \
        unsigned long long *__restrict__ offset, unsigned *__restrict__ arrivals, int *__restrict__ out,        \
        unsigned *__restrict__ status
#define SMP_PASS logits, V, vec, t_rows, t_all, k_rows, k_all, p_rows, p_all, m_rows, m_all, seed, offset, arrivals, out, status

extern "C" __global__ void __launch_bounds__(kThreads, 1) sample_f32(SMP_ARGS(float)) { sample_row<float>(SMP_PASS); }

extern "C" __global__ void __launch_bounds__(kThreads, 1) sample_bf16(SMP_ARGS(__nv_bfloat16)) {
    sample_row<__nv_bfloat16>(SMP_PASS);
}
