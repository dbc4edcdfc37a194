// The register decode shared by cuda/dequant_gemm.cu's register kernel (mma.sync) and
// cuda/dequant_wgmma.cu's warpgroup kernel (wgmma): a step's row scales into shared memory and
// each lane's values of its two rows, chunk by chunk, in the compute dtype's packing. See
// cuda/dequant_gemm.cu's "register-decode kernel" for the arithmetic and the permuted k order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.cuh"

namespace {

constexpr int BM = 64;          // weight rows per block (per warpgroup in the wgmma kernel)
constexpr int KS = 256;         // k per step

template <typename C> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
    return *(uint32_t *) &r;
}
template <> __device__ __forceinline__ uint32_t pack2<half>(float a, float b) {
    half2 r = __floats2half2_rn(a, b);
    return *(uint32_t *) &r;
}
template <typename C> __device__ __forceinline__ C from_f32(float a);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float a) { return __float2bfloat16_rn(a); }
template <> __device__ __forceinline__ half from_f32<half>(float a) { return __float2half_rn(a); }

// Byte i of x as the float 2^23 + byte (one permute: the byte under the exponent bits of 2^23).
__device__ __forceinline__ float magic_byte(uint32_t x, int i) {
    return __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7540 + i));
}

// ---- One FMA a weight ----
// A byte q < 128 permuted into a float of a larger exponent needs no subtraction when the offset
// it carries is folded into the FMA's addend, and that addend is exact:
//   half_byte(x, i)  = 0.5 + q/256   (q in bits 16..22, exponent of 0.5: 0x3F_q_00_00)
//   w15_byte(x, i)   = 2^15 + q      (q in bits 8..15, exponent of 2^15: 0x47_00_q_00)
// so d·q - m = fma(256·d, half_byte, -(128·d + m)) and d·(q - 128) = fma(d, w15_byte, -32896·d), each
// rounded once from the exact value -- the value decode32's expression rounds once -- whenever the
// addend is exactly representable. Q6_K (d·sc·(q - 32): addend -160·d·sc, 21 bits at most) and
// Q8_0 (addend -32896·d, 20 bits) always are; Q4_K/Q5_K's -(128·d·sc + dmin·m) is when the two
// 17-bit products overlap enough (every sub-block of every file measured so far), and dq_scales
// reports whether it held for all of a step's sub-blocks: the block then takes the one-FMA
// decode, otherwise decode32's two-operation one (the same value either way).
__device__ __forceinline__ float half_byte(uint32_t x, int i) {
    return __uint_as_float(__byte_perm(x, 0x3F000000u, 0x7044 + (i << 8)));
}
__device__ __forceinline__ float w15_byte(uint32_t x, int i) {
    return __uint_as_float(__byte_perm(x, 0x47000000u, 0x7504 + (i << 4)));
}

// ---- The f16 decode (H16: Q4_K's default in the register kernel; GLMCHECK_DEQUANT_EXPERTS=directh) ----
// No byte permutes: one LOP3 masks two small integers q of a word into the mantissas of its two
// f16 halves, i.e. the subnormals q·2^-24 (or 16q·2^-24 for a high nibble), which convert to f32
// exactly, and fma(d1·2^24, q·2^-24, -m1) is d1·q - m1 rounded once: decode32's FMA for every
// block (the product is exact; there is no addend to keep exact, so no fallback). Q4_K only: its
// (d1·2^24 | d1·2^20, -m1) come from dq_scales (direct_scales in the direct-load kernel).
// The two f16 halves of u as floats (exact: every f16, subnormals too, is an f32).
__device__ __forceinline__ float2 half2_bits(uint32_t u) {
    __half2 h;
    static_assert(sizeof(h) == sizeof(u), "half2 is 32 bits");
    memcpy(&h, &u, sizeof(u));
    return __half22float2(h);
}
// The f16 decode's scale of a sub-block's low (hi 0) or high (hi 1) nibbles: d1·2^24 or d1·2^20.
__device__ __forceinline__ float h16_scale(float d1, int hi) { return d1 * (hi ? 0x1p20f : 0x1p24f); }
// The four values of word w's nibble hi (w8 = w >> 8), bytes 0..3 in order: bytes 0 and 2 from w,
// 1 and 3 from w8, each as fma(s, q·2^-24, a) with s = h16_scale(d1, hi), a = -m1.
__device__ __forceinline__ void h16_decode4(uint32_t w, uint32_t w8, int hi, float s, float a, float (&v)[4]) {
    const uint32_t msk = hi ? 0x00F000F0u : 0x000F000Fu;
    const float2 e = half2_bits(w & msk), o = half2_bits(w8 & msk);
    v[0] = __fmaf_rn(s, e.x, a);
    v[1] = __fmaf_rn(s, o.x, a);
    v[2] = __fmaf_rn(s, e.y, a);
    v[3] = __fmaf_rn(s, o.y, a);
}

// Floats of a step's row scales per row (+2 so that the 8 rows of a fragment spread over the
// banks): Q4_K/Q5_K (256·d·sc, -(128·d·sc + dmin·m)) per 32-value sub-block, Q6_K 256·d·sc per 16
// values (its addend is -0.625 times that, exactly), Q8_0 d per 32. (More floats a row would cost
// Q4_K and Q6_K a resident block per SM: shared memory bounds them.)
template <int T> __host__ __device__ constexpr int dq_row_scales() { return (T == Q8_0 ? 8 : 16) + 2; }

// a + b rounded, and whether that is exact (Knuth's TwoSum: the rounding error is zero).
__device__ __forceinline__ bool exact_sum(float a, float b, float & s) {
    s = __fadd_rn(a, b);
    const float bb = __fsub_rn(s, a);
    const float err = __fadd_rn(__fsub_rn(a, __fsub_rn(s, bb)), __fsub_rn(b, bb));
    return err == 0.0f;
}

// A step's row scales into shared memory, by the whole block (thread tid: row tid % 64, half
// tid / 64 of its sub-blocks, warp-uniform), from the products decode32 forms (d·sc and dmin·m are
// exact: 11-bit halves times 6-bit integers). Returns whether every Q4_K/Q5_K addend this thread
// wrote is exact (always true for the other types).
// A row's scale bytes are read as words, Q4_K/Q5_K's 16-byte header in one 16-byte load where rows
// are aligned (8 consecutive rows, 44 (Q4_K) or 52 (Q5_K) words apart, hit 32 different banks), the
// 6-bit scales and mins taken out four at a time as cuda/q8_moe.cu's step_scales does, and written as float2 pairs
// (16 rows 18 words apart: no two on a bank). Byte by byte (scale_min_k4's way, until 2026-12-06) a
// warp's loads were 4-way bank conflicts (four of its rows share each bank): the same values, and
// on an H200 the Q4_K expert launches 3200 → 3040 µs (16 wide) and 1231 → 1147 (32 wide) at 256
// tokens; Q6_K's (unaligned rows, word() reads) 854 → 867 and 285 → 283 (reports/gpu-moe.md, build V).
template <int T, bool ALIGNED, typename Blk, bool H16 = false>
__device__ __forceinline__ bool dq_scales(Blk blk, float * rsc, int tid) {
    constexpr int RS = dq_row_scales<T>();
    const int r = tid % BM, h = tid / BM;
    const uint8_t * b = blk(r);
    float * out = rsc + r * RS;
    bool exact = true;
    if constexpr (T == Q4_K || T == Q5_K) {
        uint32_t w, w0, w1, w2; // d, dmin | q[0..3] | q[4..7] | q[8..11]
        if constexpr (ALIGNED) {
            const uint4 v = *(const uint4 *) b;
            w = v.x; w0 = v.y; w1 = v.z; w2 = v.w;
        } else {
            w = word(b); w0 = word(b + 4); w1 = word(b + 8); w2 = word(b + 12);
        }
        const float dall = __half2float(__ushort_as_half((unsigned short) (w & 0xFFFF)));
        const float dmin = __half2float(__ushort_as_half((unsigned short) (w >> 16)));
        // Sub-blocks j < 4: sc = q[j] & 63, m = q[j + 4] & 63; j >= 4: sc = q[j + 4] & 15 with q[j - 4]'s
        // top two bits above, m = q[j + 4] >> 4 with q[j]'s top two bits above (scale_min_k4).
        const uint32_t sc = h == 0 ? w0 & 0x3F3F3F3Fu : (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
        const uint32_t m = h == 0 ? w1 & 0x3F3F3F3Fu : ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float d1 = dall * (int) ((sc >> 8 * i) & 0xFF), m1 = dmin * (int) ((m >> 8 * i) & 0xFF);
            if constexpr (H16 && T == Q4_K) {
                // sub-block 4h + i: its low (even) or high (odd) nibbles
                *(float2 *) (out + 2 * (4 * h + i)) = make_float2(h16_scale(d1, i % 2), -m1);
                continue;
            }
            float c;
            exact &= exact_sum(128.0f * d1, m1, c);
            *(float2 *) (out + 2 * (4 * h + i)) = make_float2(256.0f * d1, -c);
        }
    } else if constexpr (T == Q6_K) {
        const uint32_t s0 = word(b + 192 + 8 * h), s1 = word(b + 196 + 8 * h);
        const float d = h2f(b + 208);
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const uint32_t sw = i < 4 ? s0 : s1;
            const int a = (int8_t) ((sw >> 8 * (i % 4)) & 0xFF), c = (int8_t) ((sw >> 8 * (i % 4 + 1)) & 0xFF);
            *(float2 *) (out + 8 * h + i) = make_float2(256.0f * (d * a), 256.0f * (d * c));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[4 * h + i] = h2f(b + 34 * (4 * h + i));
        }
    }
    return exact;
}

// A step's raw blocks of ROWS rows into shared memory at `dst` (this thread's first row, pitch
// raw_pitch(T)) by THR threads, 16-byte copies (cp.async, not committed): chunk tid % 16 (+ 16) of
// rows tid / 16 + (THR / 16)·j, each row's from the 16-byte boundary below the step's first byte
// (`srcp`: this thread's first row at the step; `wstride`: THR / 16 rows' bytes), so a row's bytes
// sit `(uintptr_t) src & 15` past its slot's start where rows are not ALIGNED.
template <int T, bool ALIGNED, int ROWS, int THR>
__device__ __forceinline__ void stage_raw(uint8_t * dst, const uint8_t * srcp, long long wstride, int tid) {
    constexpr int B = bytes_256(T), CH = raw_chunks(T), P = raw_pitch(T);
#pragma unroll
    for (int j = 0; j < ROWS / (THR / 16); ++j, srcp += wstride) {
        const uintptr_t off = (uintptr_t) srcp;
        const int mis = ALIGNED ? 0 : (int) (off & 15);
#pragma unroll
        for (int c0 = 0; c0 < CH; c0 += 16) {
            const int c = c0 + tid % 16;
            if (c < CH && 16 * c < mis + B) {
                __pipeline_memcpy_async(dst + j * (THR / 16) * P + 16 * c, (const void *) (off - mis + 16 * c), 16);
            }
        }
    }
}

// The decode of one 256-value step for one lane of a warp that owns 16 weight rows: `b[h]` the raw
// blocks of the lane's rows g + 8h (`rs[h]` their scales from dq_scales). For each 16-value chunk
// at k0 of the step, `chunk(v, k0)` receives the lane's values v[h][i] (row g + 8h, physical
// k0 + 4t + i), as an m16n8k16 A fragment wants them in the permuted k order above (the register
// kernel's MMAs, the wgmma kernel's A registers). FMA1: the one-FMA decode (Q4_K/Q5_K only when
// dq_scales found every addend exact; the other types always).
template <int T, bool ALIGNED, bool FMA1, bool H16, typename F>
__device__ __forceinline__ void dq_decode(const uint8_t * const (&b)[2], const float * const (&rs)[2], int t,
                                          F && chunk) {
    // The lane's rows as aligned words and one funnel shift each (a row's misalignment is the same
    // for every word of the step): wd(h, off) is the word at byte off (a multiple of 4) of row h.
    const uint32_t * wb[2];
    unsigned sh[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned mis = ALIGNED ? 0 : (unsigned) (uintptr_t) b[h] & 3;
        wb[h] = (const uint32_t *) (b[h] - mis); // derived from the shared array: LDS, not generic loads
        sh[h] = 8 * mis;
    }
    auto wd = [&](int h, int off) -> uint32_t {
        if constexpr (ALIGNED) {
            return wb[h][off / 4];
        } else {
            return __funnelshift_r(wb[h][off / 4], wb[h][off / 4 + 1], sh[h]);
        }
    };
    if constexpr (T == Q4_K || T == Q5_K) {
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int l = 16 * c + 4 * t; // the lane's values l..l+3 of the sub-blocks
                const int o = (T == Q4_K ? 16 : 48) + 32 * pair + l;
                const uint32_t w[2] = {wd(0, o), wd(1, o)};
                const uint32_t w8[2] = {w[0] >> 8, w[1] >> 8}; // H16: bytes 1 and 3 under 0 and 2
                uint32_t qh[2] = {0, 0};
                if constexpr (T == Q5_K) {
                    qh[0] = wd(0, 16 + l);
                    qh[1] = wd(1, 16 + l);
                }
#pragma unroll
                for (int hi = 0; hi < 2; ++hi) {
                    const int s = 2 * pair + hi;
                    float v[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if constexpr (H16 && T == Q4_K) {
                            const float2 f = *(const float2 *) (rs[h] + 2 * s);
                            h16_decode4(w[h], w8[h], hi, f.x, f.y, v[h]);
                            continue;
                        }
                        uint32_t x = (w[h] >> (4 * hi)) & 0x0F0F0F0Fu;
                        if constexpr (T == Q5_K) {
                            x |= ((qh[h] >> s) & 0x01010101u) << 4; // decode32's `+ 16`: the same integer
                        }
                        const float2 f = *(const float2 *) (rs[h] + 2 * s);
                        if constexpr (FMA1) {
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                v[h][i] = __fmaf_rn(f.x, half_byte(x, i), f.y);
                            }
                        } else {
                            // decode32's scale and min, from the raw block (a rare step: not kept in
                            // shared memory, where they would cost a resident block per SM)
                            int sc, m;
                            scale_min_k4(s, b[h] + 4, sc, m);
                            const float d1 = h2f(b[h]) * sc, m1 = h2f(b[h] + 2) * m;
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                v[h][i] = d1 * (magic_byte(x, i) - 8388608.0f) - m1;
                            }
                        }
                    }
                    chunk(v, 32 * s + 16 * c);
                }
            }
        }
    } else if constexpr (T == Q6_K) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int ip = s / 4, jj = s % 4, lsh = (jj >> 1) * 4, hsh = 2 * jj;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int l = 16 * c + 4 * t;
                float v[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t q = wd(h, 64 * ip + 32 * (jj & 1) + l), hb = wd(h, 128 + 32 * ip + l);
                    const uint32_t x = ((q >> lsh) & 0x0F0F0F0Fu) | (((hb >> hsh) & 0x03030303u) << 4);
                    const float a = rs[h][2 * s + c], add = -0.625f * a; // 256·ds, -160·ds
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        v[h][i] = __fmaf_rn(a, half_byte(x, i), add);
                    }
                }
                chunk(v, 32 * s + 16 * c);
            }
        }
    } else if constexpr (T == Q8_0) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float v[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t q = word(b[h] + 34 * s + 2 + 16 * c + 4 * t) ^ 0x80808080u; // int8 + 128
                    const float d = rs[h][s], add = -32896.0f * d;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        v[h][i] = __fmaf_rn(d, w15_byte(q, i), add);
                    }
                }
                chunk(v, 32 * s + 16 * c);
            }
        }
    }
}

} // namespace
