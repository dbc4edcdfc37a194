// q8 mode's activation quantizer for bf16 activations: llama.cpp's quantize_mmq_q8_1 (as vendored
// in candle-kernels' src/mmq_gguf/mmq_quantize.cu, which reads f32) reading bf16 directly. A bf16
// value converts to f32 exactly, so the blocks written are bit for bit those of casting the
// activations to f32 first and quantizing them with candle-kernels: one launch (and one f32 copy
// of the activations) fewer per q8 matmul. Measured on an H100 (ncu, one 16-token forward of a
// 3-layer GLM-5 synth): 44 bf16→f32 casts took 390 µs of 4.8 ms of kernel time.
//
// Same arithmetic, same order as the f32 kernel: each thread quantizes 4 consecutive values, the
// absolute maximum (and, for the DS4/D2S6 layouts, the sum) exchanged across the threads of a
// 32-value (D2S6: 64-value) block, d = amax / 127, q = round(x · 127 / amax).
//
// Built by build.rs with `--features cuda`; declared in src/model/q8_cuda.rs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int QK8_1 = 32;
constexpr int BLOCK = 128; // threads per block, 4 values each

// llama.cpp's block_q8_1_mmq: 128 values, their scales (and partial sums) first.
struct block_q8_1_mmq {
    union {
        float d4[4];   // D4: a scale per 32 values
        half2 ds4[4];  // DS4: (scale, sum) per 32 values
        half d2s6[8];  // D2S6: a scale per 64 values, then a sum per 16 of the first 96
    };
    int8_t qs[4 * QK8_1];
};
static_assert(sizeof(block_q8_1_mmq) == 144, "block_q8_1_mmq is 144 bytes");

enum Layout { D4 = 0, DS4 = 1, D2S6 = 2 };

// x: bf16 rows of ne00 values, row i at x + i·s01 (or row ids[i]); vy: ne1 rows of ne0 (padded to
// 512) values as block_q8_1_mmq, block (kb, i) at kb·ne1 + i. Grid (ne1, ⌈ne0 / 512⌉).
template <int LAYOUT>
__global__ void glmcheck_quantize_q8_1_bf16(const __nv_bfloat16 * __restrict__ x, const int32_t * __restrict__ ids,
                                            void * __restrict__ vy, long long ne00, long long s01, long long ne0,
                                            int ne1) {
    constexpr int vals_per_scale = LAYOUT == D2S6 ? 64 : 32;
    constexpr int vals_per_sum = LAYOUT == D2S6 ? 16 : 32;
    const long long i0 = ((long long) blockDim.x * blockIdx.y + threadIdx.x) * 4;
    if (i0 >= ne0) {
        return;
    }
    const long long i1 = blockIdx.x;
    const long long i01 = ids ? ids[i1] : i1;
    block_q8_1_mmq * y = (block_q8_1_mmq *) vy;
    const long long ib = (i0 / (4 * QK8_1)) * ne1 + blockIdx.x;
    const int iqs = (int) (i0 % (4 * QK8_1));

    float4 xi = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i0 < ne00) {
        const uint2 raw = *(const uint2 *) (x + i01 * s01 + i0);
        xi.x = __uint_as_float(raw.x << 16);
        xi.y = __uint_as_float(raw.x & 0xFFFF0000u);
        xi.z = __uint_as_float(raw.y << 16);
        xi.w = __uint_as_float(raw.y & 0xFFFF0000u);
    }
    float amax = fabsf(xi.x);
    amax = fmaxf(amax, fabsf(xi.y));
    amax = fmaxf(amax, fabsf(xi.z));
    amax = fmaxf(amax, fabsf(xi.w));
#pragma unroll
    for (int offset = vals_per_scale / 8; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFF, amax, offset, 32));
    }
    float sum = 0.0f;
    if (LAYOUT != D4) {
        sum = xi.x + xi.y + xi.z + xi.w;
#pragma unroll
        for (int offset = vals_per_sum / 8; offset > 0; offset >>= 1) {
            sum += __shfl_xor_sync(0xFFFFFFFF, sum, offset, 32);
        }
    }
    const float d_inv = 127.0f / amax;
    char4 q;
    q.x = roundf(xi.x * d_inv);
    q.y = roundf(xi.y * d_inv);
    q.z = roundf(xi.z * d_inv);
    q.w = roundf(xi.w * d_inv);
    ((char4 *) y[ib].qs)[iqs / 4] = q;

    if (LAYOUT == D2S6) {
        if (iqs % 16 != 0 || iqs >= 96) {
            return;
        }
        y[ib].d2s6[2 + iqs / 16] = __float2half(sum);
        if (iqs % 64 != 0) {
            return;
        }
        y[ib].d2s6[iqs / 64] = __float2half(1.0f / d_inv);
        return;
    }
    if (iqs % 32 != 0) {
        return;
    }
    const float d = 1.0f / d_inv;
    if (LAYOUT == DS4) {
        y[ib].ds4[iqs / 32] = make_half2(d, sum);
    } else {
        y[ib].d4[iqs / 32] = d;
    }
}

} // namespace

// Quantizes ne1 bf16 rows (row i at x + i·s01 values, or row ids[i] when ids is not null; ne00
// values each, s01 and the row starts multiples of 4 values) into block_q8_1_mmq rows of ne0
// values (ne00 padded to a multiple of 512 with zeros), scale layout 0 D4, 1 DS4, 2 D2S6.
// Returns 0, 2 for arguments it does not take, 3 for a CUDA error.
extern "C" int glmcheck_quantize_q8_1_bf16(int layout, const void * x, const int32_t * ids, void * vy, long long ne00,
                                           long long s01, long long ne0, long long ne1, void * stream) {
    if (ne00 % 4 != 0 || s01 % 4 != 0 || ne0 % 512 != 0 || ne0 < ne00 || ne1 <= 0 || ne1 > 2147483647
        || (uintptr_t) x % 8 != 0) {
        return 2;
    }
    const dim3 grid((unsigned) ne1, (unsigned) ((ne0 + 4 * BLOCK - 1) / (4 * BLOCK)), 1);
    const cudaStream_t s = (cudaStream_t) stream;
    const __nv_bfloat16 * xb = (const __nv_bfloat16 *) x;
    switch (layout) {
        case D4: glmcheck_quantize_q8_1_bf16<D4><<<grid, BLOCK, 0, s>>>(xb, ids, vy, ne00, s01, ne0, (int) ne1); break;
        case DS4: glmcheck_quantize_q8_1_bf16<DS4><<<grid, BLOCK, 0, s>>>(xb, ids, vy, ne00, s01, ne0, (int) ne1); break;
        case D2S6: glmcheck_quantize_q8_1_bf16<D2S6><<<grid, BLOCK, 0, s>>>(xb, ids, vy, ne00, s01, ne0, (int) ne1); break;
        default: return 2;
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}
