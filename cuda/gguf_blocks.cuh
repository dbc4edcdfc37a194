// GGUF block helpers shared by cuda/dequant_gemm.cu and cuda/q8_moe.cu: ggml's type ids, the bytes
// of 256 values of each, and readers of the raw blocks staged in shared memory.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

// ggml's type ids (the types glmcheck's own kernels decode).
enum : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// The bytes of 256 values of type `t` (0 for a type not listed).
__host__ __device__ constexpr int bytes_256(int t) {
    return t == Q4_0 ? 8 * 18 : t == Q5_0 ? 8 * 22 : t == Q8_0 ? 8 * 34
         : t == Q4_K ? 144 : t == Q5_K ? 176 : t == Q6_K ? 210 : 0;
}

// A little-endian half at any byte address, as a float.
__device__ __forceinline__ float h2f(const uint8_t * p) {
    return __half2float(__ushort_as_half((unsigned short) (p[0] | (p[1] << 8))));
}

// Four bytes from any address in shared memory (little-endian): two aligned words, one funnel shift.
__device__ __forceinline__ uint32_t word(const uint8_t * p) {
    const unsigned mis = (unsigned) (uintptr_t) p & 3;
    // p - mis, not an integer cast: the pointer stays derived from the shared array, so the loads
    // compile to shared-memory loads (LDS) rather than generic ones
    const uint32_t * q = (const uint32_t *) (p - mis);
    return __funnelshift_r(q[0], q[1], mis * 8);
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes at q (ggml's
// get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t * q, int & d, int & m) {
    if (j < 4) {
        d = q[j] & 63; m = q[j + 4] & 63;
    } else {
        d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// Staging a step of 256 values of 64 rows into shared memory with 16-byte copies (cp.async), as
// cuda/q8_moe.cu and cuda/dequant_gemm.cu's register-decode kernel do: each row's copies start
// at the 16-byte boundary below the step's first byte.
// 16-byte copies per row and step.
__host__ __device__ constexpr int raw_chunks(int t) { return (bytes_256(t) + 15 + 15) / 16; }

// A row's pitch in shared memory: its chunks plus 16 bytes `word` may read past the end, in words
// ≡ 4 (mod 8), so that the 8 rows of one MMA fragment load hit 8 different groups of 4 banks.
__host__ __device__ constexpr int raw_pitch(int t) {
    int w = (raw_chunks(t) + 1) * 4;
    while (w % 8 != 4) {
        w += 4;
    }
    return w * 4;
}

// A word of a staged row: a plain load where the rows are known to sit on 4-byte boundaries
// (ALIGNED), else `word`.
template <bool ALIGNED> __device__ __forceinline__ uint32_t ld_word(const uint8_t * p) {
    if constexpr (ALIGNED) {
        return *(const uint32_t *) p;
    } else {
        return word(p);
    }
}
