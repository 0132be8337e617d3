// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, ten rounds of a multiply-xor bijection keyed by a bumped Weyl key.
// fp4kit/reference/sampling.py (philox4x32_10) computes the same words; the published Random123
// known-answer vectors are checked against it in tests/test_sampling.py.
#pragma once

#define FP4_PHILOX_M0 0xD2511F53u
#define FP4_PHILOX_M1 0xCD9E8D57u
#define FP4_PHILOX_W0 0x9E3779B9u
#define FP4_PHILOX_W1 0xBB67AE85u

// counter (c.x, c.y, c.z, c.w) = (c0, c1, c2, c3), key (k0, k1); returns the four output words.
__device__ __forceinline__ uint4 fp4_philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(FP4_PHILOX_M0, c.x), lo0 = FP4_PHILOX_M0 * c.x;
        const unsigned hi1 = __umulhi(FP4_PHILOX_M1, c.z), lo1 = FP4_PHILOX_M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += FP4_PHILOX_W0;
        k1 += FP4_PHILOX_W1;
    }
    return c;
}

// ((x >> 8) | 1) * 2^-24: an odd multiple of 2^-24 in (0, 1), exact in fp32, never 0 or 1.
__device__ __forceinline__ float fp4_philox_uniform(unsigned x) {
    return (float)((x >> 8) | 1u) * 5.9604644775390625e-08f;
}
