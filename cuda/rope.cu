// RoPE on CUDA with transformers' roundings: `q·cos + rotate_half(q)·sin` evaluated as torch's
// eager ops do in the tensor's dtype, each product and the sum rounded separately:
//   out[i]        = rn(rn(x1·c) − rn(x2·s)),   out[i + d/2] = rn(rn(x2·c) + rn(x1·s))
// (torch rounds (−x2)·s, the same value negated). candle's fused `rope` kernel writes
// `x1 * c - x2 * s` with the dtype's operators, which nvcc may contract into one fused
// multiply-add (measured on an H200: query states 6.6e-4 rel-L2 off transformers' bf16 where the
// op-by-op rotation was bit-identical). Here every operation is an explicit round-to-nearest
// intrinsic, never contracted, and the interleaved layout's de-interleaving is the same launch.
//
// Built by build.rs with `--features cuda`; declared in src/model/rope_cuda.rs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

template <typename T> __device__ __forceinline__ float up(T v);
template <> __device__ __forceinline__ float up<float>(float v) { return v; }
template <> __device__ __forceinline__ float up<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float up<half>(half v) { return __half2float(v); }

// One operation's f32 result rounded to T (for f32, already rounded by the _rn intrinsic).
template <typename T> __device__ __forceinline__ float rn(float v);
template <> __device__ __forceinline__ float rn<float>(float v) { return v; }
template <> __device__ __forceinline__ float rn<__nv_bfloat16>(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
template <> __device__ __forceinline__ float rn<half>(float v) { return __half2float(__float2half_rn(v)); }

template <typename T> __device__ __forceinline__ T down(float v);
template <> __device__ __forceinline__ float down<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 down<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ half down<half>(float v) { return __float2half_rn(v); }

// x, y: [rows, d] contiguous; rows are (token, head) when tokens_first, else (head, token) with
// t tokens. cos, sin: [t, d/2] in T. One thread per (row, pair).
template <typename T>
__global__ void glmcheck_rope_k(const T * __restrict__ x, const T * __restrict__ cos, const T * __restrict__ sin,
                                T * __restrict__ y, long long rows, int t, int heads, int d, int tokens_first,
                                int interleaved) {
    const int half_d = d / 2;
    const long long idx = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * half_d) {
        return;
    }
    const long long r = idx / half_d;
    const int i = (int) (idx % half_d);
    const int tok = tokens_first ? (int) (r / heads) : (int) (r % t);
    const T * xr = x + r * d;
    const float x1 = up<T>(interleaved ? xr[2 * i] : xr[i]);
    const float x2 = up<T>(interleaved ? xr[2 * i + 1] : xr[i + half_d]);
    const float c = up<T>(cos[(long long) tok * half_d + i]), s = up<T>(sin[(long long) tok * half_d + i]);
    T * yr = y + r * d;
    yr[i] = down<T>(__fsub_rn(rn<T>(__fmul_rn(x1, c)), rn<T>(__fmul_rn(x2, s))));
    yr[i + half_d] = down<T>(__fadd_rn(rn<T>(__fmul_rn(x2, c)), rn<T>(__fmul_rn(x1, s))));
}

template <typename T>
int launch(const void * x, const void * cos, const void * sin, void * y, long long rows, int t, int heads, int d,
           int tokens_first, int interleaved, cudaStream_t stream) {
    const long long n = rows * (d / 2);
    const long long blocks = (n + 255) / 256;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_rope_k<T><<<(unsigned) blocks, 256, 0, stream>>>((const T *) x, (const T *) cos, (const T *) sin,
                                                              (T *) y, rows, t, heads, d, tokens_first, interleaved);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

} // namespace

// Returns 0 when launched; 1: a dtype it does not take (0 f32, 1 f16, 2 bf16); 2: a shape it does
// not take (d odd or 0, no rows, heads·t ≠ rows); 3: CUDA refused the launch.
extern "C" int glmcheck_rope(int dtype, const void * x, const void * cos, const void * sin, void * y, long long rows,
                             int t, int heads, int d, int tokens_first, int interleaved, void * stream) {
    if (d <= 0 || d % 2 != 0 || rows <= 0 || t <= 0 || heads <= 0 || (long long) heads * t != rows) {
        return 2;
    }
    const cudaStream_t s = (cudaStream_t) stream;
    switch (dtype) {
        case 0: return launch<float>(x, cos, sin, y, rows, t, heads, d, tokens_first, interleaved, s);
        case 1: return launch<half>(x, cos, sin, y, rows, t, heads, d, tokens_first, interleaved, s);
        case 2: return launch<__nv_bfloat16>(x, cos, sin, y, rows, t, heads, d, tokens_first, interleaved, s);
        default: return 1;
    }
}
