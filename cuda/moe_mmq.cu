// Grouped MoE matmul over GGUF blocks: llama.cpp's MMQ kernel (as vendored in candle-kernels
// 0.11.1, src/mmq_gguf/) run once over every routed expert, each expert's tokens as one tile
// column range, so an expert's weights are read once per forward instead of once per token.
//
// Differences from llama.cpp's `mul_mat_q` with `ids`:
//  - the experts are COMPACTED: channel z is the z-th expert that has tokens, `expert_map[z]`
//    its index in the stack, `expert_bounds` the compacted column ranges (at 16 tokens about 72
//    of GLM-5's 256 experts have any: no blocks are launched for the others).
//  - the routing tables (`ids_dst`, `expert_bounds`, `expert_map`, the quantizer's source rows)
//    are built on the host from the router's choices (glmcheck reads them back anyway).
//  - conventional tiling, one block per (row tile, column tile, active expert) over the whole k
//    range, several blocks resident per SM (glmcheck_min_blocks), instead of llama.cpp's stream-k
//    (one block per SM plus a fixup pass). On an H200 (3-layer GLM-5 Q4_K_M, q8 mode) the forward took
//    7.5 ms at 16 tokens and 28.3 ms at 256 tiled, 9.8 and 29.6 ms with stream-k.
//
// Built by build.rs with `--features cuda`; declared in src/model/q8_cuda.rs.

#include "mmq_common.cuh"
#include "mmq_gguf.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < GGML_CUDA_CC_VOLTA
#error "glmcheck's grouped MoE kernel needs compute capability >= 7.0 (the mma tiles)"
#endif

// Conventional tiling: one block per (row tile, column tile, active expert), each over the whole
// k range; no fixup. Many independent blocks, several resident per SM (glmcheck_min_blocks), instead
// of stream-k's one block per SM.
template <ggml_type type, int mmq_x, bool need_check, int min_blocks>
__launch_bounds__(ggml_cuda_get_physical_warp_size()*mmq_get_nwarps_device(), min_blocks)
static __global__ void glmcheck_mmq_moe(
        const char * __restrict__ x, const int * __restrict__ y, const int32_t * __restrict__ ids_dst,
        const int32_t * __restrict__ expert_bounds, const int32_t * __restrict__ expert_map,
        float * __restrict__ dst, const int ncols_x, const int nrows_x, const int stride_row_x,
        const int ncols_y, const int stride_col_dst, const int stride_expert_x) {

    if (mmq_x > get_mmq_x_max_device() || mmq_x % mmq_get_granularity_device(mmq_x) != 0) {
        NO_DEVICE_CODE;
        return;
    }

    constexpr int nwarps    = mmq_get_nwarps_device();
    constexpr int warp_size = ggml_cuda_get_physical_warp_size();
    constexpr int qk        = ggml_cuda_type_traits<type>::qk;
    constexpr int mmq_y     = get_mmq_y_device();

    const int it = blockIdx.x;
    const int jt = blockIdx.y;
    const int zt = blockIdx.z;

    const int col_low  = expert_bounds[zt + 0];
    const int col_diff = expert_bounds[zt + 1] - col_low;
    if (jt*mmq_x >= col_diff) {
        return;
    }

    extern __shared__ int ids_dst_shared[];
#pragma unroll
    for (int j0 = 0; j0 < mmq_x; j0 += nwarps*warp_size) {
        const int j = j0 + threadIdx.y*warp_size + threadIdx.x;
        if (j0 + nwarps*warp_size > mmq_x && j >= mmq_x) {
            break;
        }
        ids_dst_shared[j] = jt*mmq_x + j < col_diff ? ids_dst[col_low + jt*mmq_x + j] : 0;
    }
    __syncthreads();

    const int offset_y     = (col_low + jt*mmq_x)*(sizeof(block_q8_1_mmq)/sizeof(int));
    const int offset_dst   = it*mmq_y;
    const int tile_x_max_i = nrows_x  - it*mmq_y - 1;
    const int tile_y_max_j = col_diff - jt*mmq_x - 1;
    const int offset_x     = expert_map[zt]*stride_expert_x + it*mmq_y*stride_row_x;

    constexpr bool fixup = false;
    mul_mat_q_process_tile<type, mmq_x, need_check, fixup>
        (x, offset_x, y + offset_y, ids_dst_shared, dst + offset_dst, nullptr, stride_row_x, ncols_y, stride_col_dst,
         tile_x_max_i, tile_y_max_j, 0, ncols_x/qk);
}

template <ggml_type type, int mmq_x, bool need_check, int min_blocks>
static void glmcheck_launch_checked(
        const char * x, const int * y, const int32_t * ids_dst, const int32_t * expert_bounds,
        const int32_t * expert_map, float * dst, int ncols_x, int nrows_x, int stride_row_x,
        int ncols_y, int stride_expert_x, int n_active, int ncols_max, int cc, int warp_size,
        cudaStream_t stream) {
    const int mmq_y  = 128; // get_mmq_y_host on NVIDIA >= Volta
    const int nwarps = 256 / warp_size;
    const size_t nbytes_shared = mmq_get_nbytes_shared<type>(mmq_x, mmq_y, cc, warp_size, nwarps);
    const dim3 block_dims(warp_size, nwarps, 1);
    CUDA_SET_SHARED_MEMORY_LIMIT((glmcheck_mmq_moe<type, mmq_x, need_check, min_blocks>), nbytes_shared);
    const dim3 grid((nrows_x + mmq_y - 1) / mmq_y, (ncols_max + mmq_x - 1) / mmq_x, n_active);
    glmcheck_mmq_moe<type, mmq_x, need_check, min_blocks><<<grid, block_dims, nbytes_shared, stream>>>(
        x, y, ids_dst, expert_bounds, expert_map, dst, ncols_x, nrows_x, stride_row_x, ncols_y,
        /*stride_col_dst=*/nrows_x, stride_expert_x);
}

// Blocks resident per SM (registers capped to fit): 4 for tiles up to 16 wide (routed experts with
// few tokens each, where the weight loads dominate: on an H200 at 256 tokens the experts took 9.1 ms
// with 4, 9.4 with 3, 9.6 with 2), 2 up to 64, 1 for 128.
template <int mmq_x>
static constexpr int glmcheck_min_blocks() { return mmq_x <= 16 ? 4 : mmq_x <= 64 ? 2 : 1; }

template <ggml_type type, int mmq_x>
static void glmcheck_launch_x(
        const char * x, const int * y, const int32_t * ids_dst, const int32_t * expert_bounds,
        const int32_t * expert_map, float * dst,
        int ncols_x, int nrows_x, int stride_row_x, int ncols_y, int stride_expert_x,
        int n_active, int ncols_max, int cc, int warp_size, cudaStream_t stream) {
    if (nrows_x % 128 == 0) {
        glmcheck_launch_checked<type, mmq_x, false, glmcheck_min_blocks<mmq_x>()>(x, y, ids_dst, expert_bounds, expert_map, dst,
            ncols_x, nrows_x, stride_row_x, ncols_y, stride_expert_x, n_active, ncols_max, cc, warp_size, stream);
    } else {
        glmcheck_launch_checked<type, mmq_x, true, glmcheck_min_blocks<mmq_x>()>(x, y, ids_dst, expert_bounds, expert_map, dst,
            ncols_x, nrows_x, stride_row_x, ncols_y, stride_expert_x, n_active, ncols_max, cc, warp_size, stream);
    }
}

template <ggml_type type>
static int glmcheck_launch_type(
        int mmq_x, const char * x, const int * y, const int32_t * ids_dst, const int32_t * expert_bounds,
        const int32_t * expert_map, float * dst,
        int ncols_x, int nrows_x, int stride_row_x, int ncols_y, int stride_expert_x,
        int n_active, int ncols_max, int cc, int warp_size, cudaStream_t stream) {
#define GLMCHECK_CASE(X) case X: glmcheck_launch_x<type, X>(x, y, ids_dst, expert_bounds, expert_map, dst, \
        ncols_x, nrows_x, stride_row_x, ncols_y, stride_expert_x, n_active, ncols_max, cc, warp_size, stream); \
        return 0;
    switch (mmq_x) {
        GLMCHECK_CASE(8)
        GLMCHECK_CASE(16)
        GLMCHECK_CASE(32)
        GLMCHECK_CASE(64)
        GLMCHECK_CASE(128)
        default: return 2;
    }
#undef GLMCHECK_CASE
}

// Returns 0 when launched, 1 for a quant type without a kernel, 2 for an mmq_x without one.
// x: the [n_expert, nrows_x, ncols_x] stack's blocks; y: block_q8_1_mmq activations, ncols_y
// columns in expert order; dst: f32 [ncols_y, nrows_x], row ids_dst[j] for column j.
extern "C" int glmcheck_moe_mmq(
        int ggml_type_x, int mmq_x,
        const void * x, const void * y, const int32_t * ids_dst, const int32_t * expert_bounds,
        const int32_t * expert_map, float * dst,
        int ncols_x, int nrows_x, int stride_row_x, int ncols_y, int stride_expert_x,
        int n_active, int ncols_max, int cc, int warp_size, void * stream) {
#define GLMCHECK_TYPE(T) case T: return glmcheck_launch_type<T>(mmq_x, (const char *) x, (const int *) y, \
        ids_dst, expert_bounds, expert_map, dst, ncols_x, nrows_x, stride_row_x, ncols_y, \
        stride_expert_x, n_active, ncols_max, cc, warp_size, (cudaStream_t) stream);
    switch ((ggml_type) ggml_type_x) {
        GLMCHECK_TYPE(GGML_TYPE_Q4_0)
        GLMCHECK_TYPE(GGML_TYPE_Q4_1)
        GLMCHECK_TYPE(GGML_TYPE_Q5_0)
        GLMCHECK_TYPE(GGML_TYPE_Q5_1)
        GLMCHECK_TYPE(GGML_TYPE_Q8_0)
        GLMCHECK_TYPE(GGML_TYPE_Q2_K)
        GLMCHECK_TYPE(GGML_TYPE_Q3_K)
        GLMCHECK_TYPE(GGML_TYPE_Q4_K)
        GLMCHECK_TYPE(GGML_TYPE_Q5_K)
        GLMCHECK_TYPE(GGML_TYPE_Q6_K)
        default: return 1;
    }
#undef GLMCHECK_TYPE
}
