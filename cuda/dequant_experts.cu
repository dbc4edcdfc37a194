// Dequant mode's routed experts: the active experts of a quantized [E, out, in] stack decoded into
// one [n, out, in] tensor of the compute dtype (f32, f16 or bf16) in ONE launch, by the very
// dequantize kernels candle 0.11.1 runs for a whole tensor (its src/quantized.cu, llama.cpp's
// dequantize_block_*): CUDA block blockIdx.x of expert experts[blockIdx.y], as those kernels lay
// blocks out within one tensor, writing the compute dtype directly (candle decodes to f32 and casts:
// the same values, rounded once, at a third of the memory traffic for bf16).
//
// glmcheck's dequant mode then multiplies each expert's tokens by its decoded weight in one batched
// GEMM per projection (src/model/moe.rs) instead of one decode, cast and GEMM per expert.
//
// Built by build.rs with `--features cuda`; declared in src/model/moe_cuda.rs.

#include "quantized.cu"

// K-quants and Q4_0/Q4_1/Q8_0 take the expert's 32-element block count; Q5_0/Q5_1 (candle's
// generic two-values-per-thread kernel) its element count.
#define GLMCHECK_DQ_K(Q, DST_T, TAG)                                                                 \
    extern "C" __global__ void glmcheck_dq_##Q##_##TAG(const char * __restrict__ vx,                 \
            const int32_t * __restrict__ experts, long long expert_bytes, DST_T * __restrict__ y,     \
            long long expert_elems) {                                                                \
        dequantize_block_##Q(vx + (experts ? experts[blockIdx.y] : 0)*expert_bytes, y + blockIdx.y*expert_elems);    \
    }
#define GLMCHECK_DQ_N(Q, N, DST_T, TAG)                                                              \
    extern "C" __global__ void glmcheck_dq_##Q##_##TAG(const char * __restrict__ vx,                 \
            const int32_t * __restrict__ experts, long long expert_bytes, DST_T * __restrict__ y,     \
            long long expert_elems) {                                                                \
        dequantize_block_##Q(vx + (experts ? experts[blockIdx.y] : 0)*expert_bytes, y + blockIdx.y*expert_elems, \
            (int) (N));                                                                               \
    }
#define GLMCHECK_DQ_ALL(DST_T, TAG)                                                                  \
    GLMCHECK_DQ_N(q4_0, expert_elems/32, DST_T, TAG)                                                 \
    GLMCHECK_DQ_N(q4_1, expert_elems/32, DST_T, TAG)                                                 \
    GLMCHECK_DQ_N(q5_0, expert_elems, DST_T, TAG)                                                    \
    GLMCHECK_DQ_N(q5_1, expert_elems, DST_T, TAG)                                                    \
    GLMCHECK_DQ_N(q8_0, expert_elems/32, DST_T, TAG)                                                 \
    GLMCHECK_DQ_K(q2_K, DST_T, TAG)                                                                  \
    GLMCHECK_DQ_K(q3_K, DST_T, TAG)                                                                  \
    GLMCHECK_DQ_K(q4_K, DST_T, TAG)                                                                  \
    GLMCHECK_DQ_K(q5_K, DST_T, TAG)                                                                  \
    GLMCHECK_DQ_K(q6_K, DST_T, TAG)
GLMCHECK_DQ_ALL(float, f32)
GLMCHECK_DQ_ALL(half, f16)
GLMCHECK_DQ_ALL(__nv_bfloat16, bf16)

// Returns 0 when launched, 1 for a quant type or dtype without a kernel, 2 for an expert that is not
// a whole number of 256-element blocks. ggml_type as ggml numbers it; dst_dtype 0 f32, 1 f16,
// 2 bf16. experts null (n 1): the tensor's first expert_bytes, i.e. a whole matrix. The launch
// shapes are candle's (quantized/cuda.rs, dequantize_f32).
extern "C" int glmcheck_dequant_experts(
        int ggml_type, int dst_dtype, const void * x, const int32_t * experts, int n,
        long long expert_bytes, void * y, long long expert_elems, void * stream) {
    if (expert_elems % 256 != 0 || n <= 0 || n > 65535) {
        return 2;
    }
    const long long nb = expert_elems / 256;
    void * fn = nullptr;
    unsigned int threads = 32;
    unsigned long long blocks = nb;
#define GLMCHECK_PICK(Q, T)                                                                          \
    fn = dst_dtype == 0 ? (void *) glmcheck_dq_##Q##_f32 : dst_dtype == 1 ? (void *) glmcheck_dq_##Q##_f16 \
        : dst_dtype == 2 ? (void *) glmcheck_dq_##Q##_bf16 : nullptr;                               \
    threads = T;
    switch (ggml_type) {
        case 2:  GLMCHECK_PICK(q4_0, 32) break;
        case 3:  GLMCHECK_PICK(q4_1, 32) break;
        case 6:  GLMCHECK_PICK(q5_0, CUDA_DEQUANTIZE_BLOCK_SIZE) blocks = (expert_elems + 2*CUDA_DEQUANTIZE_BLOCK_SIZE - 1) / (2*CUDA_DEQUANTIZE_BLOCK_SIZE); break;
        case 7:  GLMCHECK_PICK(q5_1, CUDA_DEQUANTIZE_BLOCK_SIZE) blocks = (expert_elems + 2*CUDA_DEQUANTIZE_BLOCK_SIZE - 1) / (2*CUDA_DEQUANTIZE_BLOCK_SIZE); break;
        case 8:  GLMCHECK_PICK(q8_0, 32) break;
        case 10: GLMCHECK_PICK(q2_K, 64) break;
        case 11: GLMCHECK_PICK(q3_K, 64) break;
        case 12: GLMCHECK_PICK(q4_K, 32) break;
        case 13: GLMCHECK_PICK(q5_K, 64) break;
        case 14: GLMCHECK_PICK(q6_K, 64) break;
        default: return 1;
    }
#undef GLMCHECK_PICK
    if (fn == nullptr) {
        return 1;
    }
    const dim3 grid((unsigned int) blocks, (unsigned int) n, 1);
    const dim3 block(threads, 1, 1);
    const char * xc = (const char *) x;
    void * args[] = {(void *) &xc, (void *) &experts, (void *) &expert_bytes, (void *) &y, (void *) &expert_elems};
    return cudaLaunchKernel(fn, grid, block, args, 0, (cudaStream_t) stream) == cudaSuccess ? 0 : 3;
}
