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

#include <stdint.h>

#include "elementwise.cuh"

namespace {

using glmcheck::down;
using glmcheck::rn;
using glmcheck::up;

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

// A row-wise rotation inside wider rows, fused with the copies around it: x is [t, heads, width]
// (tokens first, contiguous); columns [offset, offset + d) of each row are rotated as above (the
// same roundings, de-interleaved when `interleaved`), the other columns copied. y is [t, heads,
// width], or [heads, t, width] when `heads_out_first` (MLA's query: q_b's output to the per-head
// layout attention multiplies). One thread per output value.
template <typename T>
__global__ void glmcheck_rope_part_k(const T * __restrict__ x, const T * __restrict__ cos,
                                     const T * __restrict__ sin, T * __restrict__ y, int t, int heads, int width,
                                     int offset, int d, int interleaved, int heads_out_first) {
    const long long idx = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    const long long rows = (long long) t * heads;
    if (idx >= rows * width) {
        return;
    }
    const long long r = idx / width; // output row
    const int c = (int) (idx % width);
    const int tok = heads_out_first ? (int) (r % t) : (int) (r / heads);
    const int head = heads_out_first ? (int) (r / t) : (int) (r % heads);
    const T * xr = x + ((long long) tok * heads + head) * width;
    const int j = c - offset;
    if (j < 0 || j >= d) {
        y[idx] = xr[c];
        return;
    }
    const int half_d = d / 2, i = j < half_d ? j : j - half_d;
    const T * xp = xr + offset;
    const float x1 = up<T>(interleaved ? xp[2 * i] : xp[i]);
    const float x2 = up<T>(interleaved ? xp[2 * i + 1] : xp[i + half_d]);
    const float cs = up<T>(cos[(long long) tok * half_d + i]), sn = up<T>(sin[(long long) tok * half_d + i]);
    y[idx] = j < half_d ? down<T>(__fsub_rn(rn<T>(__fmul_rn(x1, cs)), rn<T>(__fmul_rn(x2, sn))))
                        : down<T>(__fadd_rn(rn<T>(__fmul_rn(x2, cs)), rn<T>(__fmul_rn(x1, sn))));
}

template <typename T>
int launch_part(const void * x, const void * cos, const void * sin, void * y, int t, int heads, int width, int offset,
                int d, int interleaved, int heads_out_first, cudaStream_t stream) {
    const long long n = (long long) t * heads * width;
    const long long blocks = (n + 255) / 256;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_rope_part_k<T><<<(unsigned) blocks, 256, 0, stream>>>(
        (const T *) x, (const T *) cos, (const T *) sin, (T *) y, t, heads, width, offset, d, interleaved,
        heads_out_first);
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

// The same codes as glmcheck_rope; 2 also when [offset, offset + d) is not inside the row.
extern "C" int glmcheck_rope_part(int dtype, const void * x, const void * cos, const void * sin, void * y, int t,
                                  int heads, int width, int offset, int d, int interleaved, int heads_out_first,
                                  void * stream) {
    if (d <= 0 || d % 2 != 0 || t <= 0 || heads <= 0 || offset < 0 || width <= 0 || offset + d > width) {
        return 2;
    }
    const cudaStream_t s = (cudaStream_t) stream;
    switch (dtype) {
        case 0: return launch_part<float>(x, cos, sin, y, t, heads, width, offset, d, interleaved, heads_out_first, s);
        case 1: return launch_part<half>(x, cos, sin, y, t, heads, width, offset, d, interleaved, heads_out_first, s);
        case 2:
            return launch_part<__nv_bfloat16>(x, cos, sin, y, t, heads, width, offset, d, interleaved,
                                              heads_out_first, s);
        default: return 1;
    }
}
