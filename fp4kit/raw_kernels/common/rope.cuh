// The rotation of one RoPE channel pair, shared by the kernels that rotate rows (elementwise.cu's
// RMSNorm + RoPE, the attention kernel's queries, the indexer's scoring of its queries) so that
// every one gives the same bits.
#pragma once

// The cosine and sine of the angle p * inv_freq[i] of channel pair i of the last rope_dim channels
// at position p (the pair's inverse frequency, theta^(-2i / rope_dim) or YaRN-scaled, computed on
// the host in float64): the angle, its sine and cosine in double as in kv_cache.cu, then fp32.
__device__ __forceinline__ void rope_cos_sin(int p, unsigned i, const double* inv_freq, float& c, float& s) {
    const double angle = (double)p * inv_freq[i];
    double sn, cs;
    sincos(angle, &sn, &cs);
    c = (float)cs, s = (float)sn;
}

// (a, b) rotated by the angle of cosine c and sine s.
__device__ __forceinline__ void rope_apply(float& a, float& b, float c, float s) {
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    a = ra, b = rb;
}

__device__ __forceinline__ void rope_rotate(float& a, float& b, int p, unsigned i, const double* inv_freq) {
    float c, s;
    rope_cos_sin(p, i, inv_freq, c, s);
    rope_apply(a, b, c, s);
}
