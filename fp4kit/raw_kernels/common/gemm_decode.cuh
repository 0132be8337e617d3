// The NVFP4 decode GEMM's device code, shared by gemm.cu (dense) and moe.cu (grouped experts):
// nibble and scale conversion to bf16, the weight and activation MMA fragments, the epilogue,
// and gemm_decode, which computes 16 weight rows x up to 8*kTokenTiles tokens in one block.
// See gemm.cu for the method.
#pragma once

#include "nvfp4.cuh"

constexpr int kWarps = 8;
constexpr int kChunk = 128;                          // k per warp per step: 4 threads x 32
constexpr float kOperandUnscale = 67108864.0f;       // 2^26, per dequantized operand

// The same for the nibbles (3-k, 7-k) of q, k = 0..3: signs at bits 15-4k / 31-4k, the other
// three bits at 12-4k..14-4k, moved with one shift each.
template <int k>
__device__ __forceinline__ unsigned nibble_pair_bf16_at(unsigned q) {
    const unsigned sign = (q << (4 * k)) & 0x80008000u;
    const unsigned rest = (k <= 1 ? q >> (6 - 4 * k) : q << (4 * k - 6)) & 0x01C001C0u;
    return sign | rest;
}

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (s, s) as bf16x2 with s = fp32(E4M3 byte) * 2^100, exact, without branches. A normal E4M3 byte
// maps straight to bf16 bits (exponent + 120 + 100, mantissa shifted up 4). A subnormal one,
// m * 2^-9 with m = 1..7, becomes m * 2^91: exponent 218 + p and mantissa m << (7 - p), p the
// position of m's leading one. 0 stays 0 and the NaN byte 0x7F (never written by fp4kit, refused
// by the checkpoint loader) becomes a bf16 NaN.
__device__ __forceinline__ unsigned scale_pair_bf16(unsigned byte) {
    const unsigned b = byte & 0x7Fu, m = b & 7u;
    const unsigned p = 31u - __clz(m | 1u);
    const unsigned subnormal = m ? (((218u + p) << 7) | ((m << (7u - p)) & 0x7Fu)) : 0u;
    unsigned h = (b & 0x78u) ? (b << 4) + (220u << 7) : subnormal;
    h = b == 0x7Fu ? 0x7FC0u : h;
    return h | (h << 16);
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ void mma_bf16(float d[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 32-bit words (32 nibbles, k = kbase .. kbase+31) of a packed row. kFull: the whole range
// lies inside K and the row is 16-byte aligned (K % 128 == 0), one 16-byte load; otherwise words
// past K are zero.
template <bool kFull>
__device__ __forceinline__ uint4 load_nibble_words(const unsigned char* row, unsigned kbase, unsigned K) {
    if (kFull) return *reinterpret_cast<const uint4*>(row + kbase / 2);
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    unsigned* words = reinterpret_cast<unsigned*>(&r);
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (kbase + 8 * j + 8 <= K) words[j] = reinterpret_cast<const unsigned*>(row + kbase / 2)[j];
    return r;
}

__device__ __forceinline__ unsigned load_byte(const unsigned char* p, bool valid) { return valid ? *p : 0u; }

// The weight operand of one 32-k word: A fragments for two k16 MMA steps, rows g and g+8.
struct WeightFrags {
    unsigned a[2][4];
};

__device__ __forceinline__ WeightFrags weight_frags(unsigned q0, unsigned q1, unsigned s0, unsigned s1) {
    WeightFrags f;
    // step 0 <- nibbles (3,7) and (2,6); step 1 <- (1,5) and (0,4); a0/a2 row g, a1/a3 row g+8
    f.a[0][0] = bf16x2_mul(nibble_pair_bf16_at<0>(q0), s0);
    f.a[0][2] = bf16x2_mul(nibble_pair_bf16_at<1>(q0), s0);
    f.a[0][1] = bf16x2_mul(nibble_pair_bf16_at<0>(q1), s1);
    f.a[0][3] = bf16x2_mul(nibble_pair_bf16_at<1>(q1), s1);
    f.a[1][0] = bf16x2_mul(nibble_pair_bf16_at<2>(q0), s0);
    f.a[1][2] = bf16x2_mul(nibble_pair_bf16_at<3>(q0), s0);
    f.a[1][1] = bf16x2_mul(nibble_pair_bf16_at<2>(q1), s1);
    f.a[1][3] = bf16x2_mul(nibble_pair_bf16_at<3>(q1), s1);
    return f;
}

// Activation operands (B fragments) of the same 8 k for one token, in the weight's k order.
// Activation row of local token i: rows[base + i] (a gather, e.g. tokens routed to one expert) or
// base + i.
struct RowMap {
    const unsigned* rows;
    unsigned base;
    __device__ __forceinline__ size_t operator()(unsigned i) const { return rows ? rows[base + i] : base + i; }
};

struct ActBf16 {
    const __nv_bfloat16* x;  // [rows, K]
    RowMap row;
    // valid: the token exists and k .. k+7 lie inside K
    __device__ __forceinline__ void frags(unsigned token, bool valid, unsigned k, unsigned K, unsigned b[2][2]) const {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (valid) v = *reinterpret_cast<const uint4*>(x + row(token) * K + k);
        b[0][0] = prmt(v.y, v.w, 0x7632u);  // elements (3, 7)
        b[0][1] = prmt(v.y, v.w, 0x5410u);  // (2, 6)
        b[1][0] = prmt(v.x, v.z, 0x7632u);  // (1, 5)
        b[1][1] = prmt(v.x, v.z, 0x5410u);  // (0, 4)
    }
    static constexpr int kDequantized = 1;
};

struct ActNvfp4 {
    const unsigned char* packed;  // [rows, K/2]
    const unsigned char* scales;  // [rows, K/16]
    RowMap row;
    __device__ __forceinline__ void frags(unsigned token, bool valid, unsigned k, unsigned K, unsigned b[2][2]) const {
        unsigned q = 0u, s = 0u;
        if (valid) {
            const size_t r = row(token);
            q = *reinterpret_cast<const unsigned*>(packed + r * (K / 2) + k / 2);
            s = scale_pair_bf16(scales[r * (K / 16) + k / 16]);
        }
        b[0][0] = bf16x2_mul(nibble_pair_bf16_at<0>(q), s);
        b[0][1] = bf16x2_mul(nibble_pair_bf16_at<1>(q), s);
        b[1][0] = bf16x2_mul(nibble_pair_bf16_at<2>(q), s);
        b[1][1] = bf16x2_mul(nibble_pair_bf16_at<3>(q), s);
    }
    static constexpr int kDequantized = 2;
};

struct Epilogue {
    const float* w_global;      // encode scale S_w; or, with w_decode set, unused
    const float* w_row_decode;  // nullptr: one decode factor for every row
    const float* act_global;    // nullptr: W4A16
    const void* bias;
    int bias_kind;  // 0 none, 1 fp32, 2 bf16
    void* out;
    int out_f32;
    const float* w_decode = nullptr;  // a precomputed decode factor 1/S_w (per-expert weights)
    unsigned out_ld = 0;              // output row stride (0: N)
    unsigned out_row_base = 0;        // output row of local token 0
    unsigned out_col = 0;             // output column of weight row 0

    float w_dec, a_dec;  // 1 / S_w (unused with w_row_decode) and 1 / S_a (1 for W4A16)

    __device__ __forceinline__ void init() {
        w_dec = w_row_decode ? 0.0f : (w_decode ? *w_decode : __fdiv_rn(1.0f, *w_global));
        a_dec = act_global ? __fdiv_rn(1.0f, *act_global) : 1.0f;
    }

    __device__ __forceinline__ size_t index(unsigned token, unsigned n, unsigned N) const {
        return (size_t)(out_row_base + token) * (out_ld ? out_ld : N) + out_col + n;
    }

    __device__ __forceinline__ float alpha(unsigned n, float unscale) const {
        return __fmul_rn(__fmul_rn(w_row_decode ? w_row_decode[n] : w_dec, a_dec), unscale);
    }

    __device__ __forceinline__ void store(size_t index, unsigned n, float y) const {
        if (bias_kind == 1) y = __fadd_rn(y, static_cast<const float*>(bias)[n]);
        if (bias_kind == 2) y = __fadd_rn(y, __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[n]));
        if (out_f32) static_cast<float*>(out)[index] = y;
        else static_cast<__nv_bfloat16*>(out)[index] = __float2bfloat16_rn(y);
    }
};

// Partial sums of 16 weight rows x 8 * kTokenTiles tokens over this warp's K chunks (warp w takes
// chunks w, w + 8, ...). A software pipeline keeps the next chunk's weight words and scale bytes
// in flight while the current one is dequantized and multiplied.
template <bool kFull, int kTokenTiles, class Act>
__device__ __forceinline__ void gemm_decode_chunks(const unsigned char* row0, const unsigned char* row1,
                                                   const unsigned char* srow0, const unsigned char* srow1,
                                                   const Act& act, unsigned M, unsigned K,
                                                   float acc[kTokenTiles][4]) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    struct Chunk {
        uint4 w0, w1;
        unsigned sb0, sb1;  // the two block-scale bytes of row g and of row g + 8
    };
    auto fetch = [&](unsigned c) {
        const unsigned kbase = c * kChunk + 32 * t;
        Chunk ch;
        ch.w0 = load_nibble_words<kFull>(row0, kbase, K);
        ch.w1 = load_nibble_words<kFull>(row1, kbase, K);
        if (kFull) {  // K % 128 == 0: the row's scales start at an even byte
            ch.sb0 = *reinterpret_cast<const unsigned short*>(srow0 + kbase / 16);
            ch.sb1 = *reinterpret_cast<const unsigned short*>(srow1 + kbase / 16);
        } else {
            const bool in0 = kbase < K, in1 = kbase + 16 < K;
            ch.sb0 = load_byte(srow0 + kbase / 16, in0) | (load_byte(srow0 + kbase / 16 + 1, in1) << 8);
            ch.sb1 = load_byte(srow1 + kbase / 16, in0) | (load_byte(srow1 + kbase / 16 + 1, in1) << 8);
        }
        return ch;
    };
    const unsigned chunks = (K + kChunk - 1) / kChunk;
    Chunk next{};
    if (warp < chunks) next = fetch(warp);
    for (unsigned c = warp; c < chunks; c += kWarps) {
        const Chunk cur = next;
        if (c + kWarps < chunks) next = fetch(c + kWarps);
        const unsigned kbase = c * kChunk + 32 * t;
        const unsigned* q0 = reinterpret_cast<const unsigned*>(&cur.w0);
        const unsigned* q1 = reinterpret_cast<const unsigned*>(&cur.w1);
        const unsigned s00 = scale_pair_bf16(cur.sb0 & 0xFFu), s01 = scale_pair_bf16(cur.sb0 >> 8);
        const unsigned s10 = scale_pair_bf16(cur.sb1 & 0xFFu), s11 = scale_pair_bf16(cur.sb1 >> 8);
#pragma unroll
        for (int word = 0; word < 4; ++word) {
            const WeightFrags wf = weight_frags(q0[word], q1[word], word < 2 ? s00 : s01, word < 2 ? s10 : s11);
            const unsigned k = kbase + 8 * word;
            const bool in_k = kFull || k + 8 <= K;
#pragma unroll
            for (int tile = 0; tile < kTokenTiles; ++tile) {
                const unsigned token = tile * 8 + g;
                unsigned b[2][2];
                act.frags(token, in_k && token < M, k, K, b);
                mma_bf16(acc[tile], wf.a[0][0], wf.a[0][1], wf.a[0][2], wf.a[0][3], b[0][0], b[0][1]);
                mma_bf16(acc[tile], wf.a[1][0], wf.a[1][1], wf.a[1][2], wf.a[1][3], b[1][0], b[1][1]);
            }
        }
    }
}

template <int kTokenTiles, class Act>
__device__ void gemm_decode(const unsigned char* w_packed, const unsigned char* w_scales, const Act act,
                            Epilogue ep, unsigned M, unsigned N, unsigned K) {
    __shared__ float partial[kWarps][16][kTokenTiles * 8];
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned n0 = blockIdx.x * 16;
    // rows past N read row N - 1 (their sums are never stored), so the loads need no guard
    const size_t r0 = min(n0 + g, N - 1), r1 = min(n0 + g + 8, N - 1);
    const unsigned char* row0 = w_packed + r0 * (K / 2);
    const unsigned char* row1 = w_packed + r1 * (K / 2);
    const unsigned char* srow0 = w_scales + r0 * (K / 16);
    const unsigned char* srow1 = w_scales + r1 * (K / 16);

    float acc[kTokenTiles][4];
#pragma unroll
    for (int i = 0; i < kTokenTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    if (K % kChunk == 0) gemm_decode_chunks<true, kTokenTiles>(row0, row1, srow0, srow1, act, M, K, acc);
    else gemm_decode_chunks<false, kTokenTiles>(row0, row1, srow0, srow1, act, M, K, acc);

    // D fragment: (row g, tokens 2t, 2t+1) and (row g+8, the same tokens)
#pragma unroll
    for (int tile = 0; tile < kTokenTiles; ++tile) {
        partial[warp][g][tile * 8 + 2 * t] = acc[tile][0];
        partial[warp][g][tile * 8 + 2 * t + 1] = acc[tile][1];
        partial[warp][g + 8][tile * 8 + 2 * t] = acc[tile][2];
        partial[warp][g + 8][tile * 8 + 2 * t + 1] = acc[tile][3];
    }
    __syncthreads();
    const float unscale = Act::kDequantized == 2 ? kOperandUnscale * kOperandUnscale : kOperandUnscale;
    ep.init();
    for (unsigned i = threadIdx.x; i < 16 * kTokenTiles * 8; i += blockDim.x) {
        const unsigned r = i % 16, token = i / 16, n = n0 + r;
        if (token >= M || n >= N) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum = __fadd_rn(sum, partial[w][r][token]);
        ep.store(ep.index(token, n, N), n, __fmul_rn(sum, ep.alpha(n, unscale)));
    }
    __syncthreads();  // partial is reused when a caller loops over token groups
}
