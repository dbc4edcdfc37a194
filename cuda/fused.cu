// Fused chains of the forward, each one launch instead of three to six, with the very roundings of
// the candle kernels they replace (tested bit for bit against them on the device):
//
//  * attention's scaled, masked softmax: candle computes `affine(scores, scale)` in the scores'
//    dtype (one product rounded to it; `add` is 0), casts to f32, adds the f32 mask `[T, S]`
//    broadcast over heads, runs `softmax_f32` (one warp per row: lane-strided max and sum, a
//    butterfly reduction of each, `1. / sum` in double, each exp times its float reciprocal) and
//    casts the probabilities back. Here the same per lane, the exps recomputed for the last pass
//    instead of stored (the same inputs give the same expf).
//  * the MoE combine: `(y [N, k, H] f32 · w [N, k, 1] f32).sum(1)` then the cast to the compute
//    dtype: candle's `bmul` rounds each product, `fast_sum_small_f32` adds them in slot order
//    starting from 0. Here each product and each sum an explicit round-to-nearest intrinsic, so nvcc
//    contracts nothing into a fused multiply-add.
//  * dequant mode's MoE combine from grouped rows: each row's output (compute dtype) times its f32
//    routing weight, rounded to the dtype, then candle's `index_add` into a zeroed [T, H] in row
//    order (each add rounded to the dtype). candle's kernel gives each of H threads all R rows to
//    walk (~1 ms per MoE layer at 256 tokens of GLM-5); here one thread per output walks its
//    token's k rows, in the same row order.
//  * MLA's per-head keys `[k_nope | k_rot]` and values from kv_b's output: copies only.
//  * transformers' RMSNorm, op by op as glmcheck's candle chain computes it (`ops::RmsNorm`): the
//    input cast to f32, each square rounded (`usqr_f32`), summed in `fast_sum_f32`'s order (one
//    block of next_pow2(min(1024, n)) threads per row, four-value groups, warp butterflies; see
//    the kernel), times (float)(1/n) and plus
//    (float)eps (`affine_f32`, each one rounding), `sqrtf` rounded, `1. / x` in double rounded to
//    float (`urecip_f32`), each value times it (`bmul_f32`), rounded to the dtype, times the
//    weight in the dtype (`bmul`: the f32 product of two bf16/f16 values is exact, so one
//    rounding, unless it falls below f32's normal range, 2^-126, where the two could differ). Ten launches and five [rows, n] round trips through device memory become one.
//
// Built by build.rs with `--features cuda`; declared in src/model/fused_cuda.rs.

#include <math.h>
#include <stdint.h>
#include <algorithm>

#include "elementwise.cuh"

namespace {

using glmcheck::down;
using glmcheck::up;

constexpr int WARPS = 4;

// The masked score of column `col`: the product rounded to T (exact in f32 for bf16/f16 operands,
// so one rounding, as the dtype's own multiply), then the f32 mask added.
template <typename T>
__device__ __forceinline__ float masked(const T * row, const float * mrow, int col, float scale) {
    return __fadd_rn(up<T>(down<T>(__fmul_rn(up<T>(row[col]), scale))), mrow[col]);
}

// scores, probs: [heads·t, s] contiguous (row r is head r / t, query r % t); mask: [t, s] f32.
// One warp per row.
template <typename T>
__global__ void glmcheck_masked_softmax_k(const T * __restrict__ scores, const float * __restrict__ mask,
                                          T * __restrict__ probs, long long rows, int t, int s, float scale) {
    const long long row = (long long) blockIdx.x * WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) {
        return;
    }
    const T * x = scores + row * s;
    const float * m = mask + (long long) (row % t) * s;
    T * y = probs + row * s;

    float max_val = -INFINITY;
    for (int col = lane; col < s; col += 32) {
        max_val = fmaxf(max_val, masked(x, m, col, scale));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        max_val = fmaxf(max_val, __shfl_xor_sync(0xffffffff, max_val, off, 32));
    }
    float sum = 0.f;
    for (int col = lane; col < s; col += 32) {
        sum = __fadd_rn(sum, expf(__fsub_rn(masked(x, m, col, scale), max_val)));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffff, sum, off, 32));
    }
    const float inv = (float) (1. / (double) sum);
    for (int col = lane; col < s; col += 32) {
        y[col] = down<T>(__fmul_rn(expf(__fsub_rn(masked(x, m, col, scale), max_val)), inv));
    }
}

// x, y: [rows, n] contiguous (n a multiple of 4), w: [n], all in T. One block of BD threads (fast_sum's
// block width for n) per row; the sum of squares in `fast_sum_f32`'s order for contiguous rows
// aligned to 16 bytes: thread i adds the four-value groups i, i + BD, ... (each group's sum
// ((a + b) + c) + d added to its running sum), then a butterfly within each warp, the warps' sums
// through shared memory and a butterfly over them in the first warp.
template <typename T, int BD>
__global__ void __launch_bounds__(BD) glmcheck_rms_norm_k(const T * __restrict__ x, const T * __restrict__ w,
                                                          T * __restrict__ y, int n, float mul, float eps) {
    __shared__ float shr[32];
    __shared__ float total;
    const int tid = threadIdx.x, lane = tid % 32;
    const T * xr = x + (long long) blockIdx.x * n;
    T * yr = y + (long long) blockIdx.x * n;
    auto sq = [&](int i) {
        const float v = up<T>(xr[i]);
        return __fmul_rn(v, v);
    };
    float acc = 0.0f;
    for (int g = tid; g < n / 4; g += BD) {
        acc = __fadd_rn(acc, __fadd_rn(__fadd_rn(__fadd_rn(sq(4 * g), sq(4 * g + 1)), sq(4 * g + 2)), sq(4 * g + 3)));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffff, acc, off));
    }
    if (lane == 0) {
        shr[tid / 32] = acc;
    }
    __syncthreads();
    if (tid < 32) {
        float s = tid < BD / 32 ? shr[tid] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            s = __fadd_rn(s, __shfl_xor_sync(0xffffffff, s, off));
        }
        if (tid == 0) {
            total = s;
        }
    }
    __syncthreads();
    const float var = __fadd_rn(__fmul_rn(total, mul), eps);
    const float inv = __double2float_rn(__ddiv_rn(1.0, (double) __fsqrt_rn(var)));
    for (int i = tid; i < n; i += BD) {
        const float normed = up<T>(down<T>(__fmul_rn(up<T>(xr[i]), inv)));
        yr[i] = down<T>(__fmul_rn(normed, up<T>(w[i])));
    }
}

// fast_sum's block width for a row of n: next_pow2(min(1024, n)).
template <typename T>
int launch_rms_norm(const void * x, const void * w, void * y, long long rows, int n, float mul, float eps,
                    cudaStream_t stream) {
    if (rows > 0x7fffffffLL) {
        return 2;
    }
    int bd = 1;
    while (bd < n && bd < 1024) {
        bd *= 2;
    }
    const T * xt = (const T *) x;
    const T * wt = (const T *) w;
    T * yt = (T *) y;
    const unsigned g = (unsigned) rows;
    switch (bd) {
    case 64: glmcheck_rms_norm_k<T, 64><<<g, 64, 0, stream>>>(xt, wt, yt, n, mul, eps); break;
    case 128: glmcheck_rms_norm_k<T, 128><<<g, 128, 0, stream>>>(xt, wt, yt, n, mul, eps); break;
    case 256: glmcheck_rms_norm_k<T, 256><<<g, 256, 0, stream>>>(xt, wt, yt, n, mul, eps); break;
    case 512: glmcheck_rms_norm_k<T, 512><<<g, 512, 0, stream>>>(xt, wt, yt, n, mul, eps); break;
    case 1024: glmcheck_rms_norm_k<T, 1024><<<g, 1024, 0, stream>>>(xt, wt, yt, n, mul, eps); break;
    default: return 2; // rows of 32 values or fewer: candle sums them another way
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// y: [n, k, h] f32, w: [n, k] f32 → out [n, h] in T. One thread per output.
template <typename T>
__global__ void glmcheck_slot_sum_k(const float * __restrict__ y, const float * __restrict__ w, T * __restrict__ out,
                                    long long n, int k, int h) {
    const long long idx = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * h) {
        return;
    }
    const long long tok = idx / h;
    const int c = (int) (idx % h);
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        const long long slot = tok * k + j;
        acc = __fadd_rn(acc, __fmul_rn(y[slot * h + c], w[slot]));
    }
    out[idx] = down<T>(acc);
}

// out[tok] = Σ_j y[rows[j]] · w[slots[j]] over token tok's k rows (order: rows [n·k] then slots
// [n·k], a token's rows ascending), as `zeros.index_add(tokens, (y as f32 · w) as T)`.
template <typename T>
__global__ void glmcheck_token_sum_k(const T * __restrict__ y, const float * __restrict__ w,
                                     const uint32_t * __restrict__ order, T * __restrict__ out, long long n, int k,
                                     int h) {
    const long long idx = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * h) {
        return;
    }
    const long long tok = idx / h;
    const int c = (int) (idx % h);
    const uint32_t * rows = order + tok * k;
    const uint32_t * slots = order + n * k + tok * k;
    float acc = 0.f; // a value of T
    for (int j = 0; j < k; ++j) {
        const float v = up<T>(down<T>(__fmul_rn(up<T>(y[(long long) rows[j] * h + c]), w[slots[j]])));
        acc = up<T>(down<T>(__fadd_rn(acc, v)));
    }
    out[idx] = down<T>(acc);
}

template <typename T>
int launch_token_sum(const void * y, const float * w, const uint32_t * order, void * out, long long n, int k, int h,
                     cudaStream_t stream) {
    const long long blocks = (n * h + 255) / 256;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_token_sum_k<T><<<(unsigned) blocks, 256, 0, stream>>>((const T *) y, w, order, (T *) out, n, k, h);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <typename T>
int launch_softmax(const void * scores, const float * mask, void * probs, long long rows, int t, int s, float scale,
                   cudaStream_t stream) {
    const long long blocks = (rows + WARPS - 1) / WARPS;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_masked_softmax_k<T>
        <<<(unsigned) blocks, 32 * WARPS, 0, stream>>>((const T *) scores, mask, (T *) probs, rows, t, s, scale);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <typename T>
int launch_slot_sum(const float * y, const float * w, void * out, long long n, int k, int h, cudaStream_t stream) {
    const long long blocks = (n * h + 255) / 256;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_slot_sum_k<T><<<(unsigned) blocks, 256, 0, stream>>>(y, w, (T *) out, n, k, h);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// MLA's keys and values in the per-head layout attention multiplies: kv [t, heads, nope + v] (kv_b's
// output), krot [t, rope] (the shared rotated key) → key [heads, t, nope + rope] = [k_nope | krot],
// value [heads, t, v]. Copies only. One thread per output value of key, then of value.
template <typename T>
__global__ void glmcheck_mla_kv_k(const T * __restrict__ kv, const T * __restrict__ krot, T * __restrict__ key,
                                  T * __restrict__ value, int t, int heads, int nope, int rope, int v) {
    const long long idx = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    const long long rows = (long long) heads * t;
    const int qk = nope + rope;
    if (idx < rows * qk) {
        const long long r = idx / qk; // (head, token)
        const int c = (int) (idx % qk);
        const int head = (int) (r / t), tok = (int) (r % t);
        key[idx] = c < nope ? kv[((long long) tok * heads + head) * (nope + v) + c] : krot[(long long) tok * rope + c - nope];
        return;
    }
    const long long j = idx - rows * qk;
    if (j >= rows * v) {
        return;
    }
    const long long r = j / v;
    const int c = (int) (j % v);
    const int head = (int) (r / t), tok = (int) (r % t);
    value[j] = kv[((long long) tok * heads + head) * (nope + v) + nope + c];
}

// glmcheck_mla_kv_k in 16-byte pieces (np, rp, vp: the pieces of nope, rope and v values, each a
// whole number of them): a kv row (token, head) holds np + vp pieces, a k_rot row (token) rp. The
// same copies, 8 bf16 values a thread instead of one, and a piece never straddles nope | rope.
__global__ void glmcheck_mla_kv16_k(const uint4 * __restrict__ kv, const uint4 * __restrict__ krot,
                                    uint4 * __restrict__ key, uint4 * __restrict__ value, int t, int heads, int np,
                                    int rp, int vp) {
    const long long rows = (long long) heads * t;
    const int kp = np + rp;
    const long long n = rows * (kp + vp);
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long) gridDim.x * blockDim.x) {
        if (i < rows * kp) {
            const long long r = i / kp; // (head, token)
            const int c = (int) (i - r * kp);
            const int head = (int) (r / t), tok = (int) (r - (long long) head * t);
            key[i] = c < np ? kv[((long long) tok * heads + head) * (np + vp) + c] : krot[(long long) tok * rp + c - np];
        } else {
            const long long j = i - rows * kp;
            const long long r = j / vp;
            const int c = (int) (j - r * vp);
            const int head = (int) (r / t), tok = (int) (r - (long long) head * t);
            value[j] = kv[((long long) tok * heads + head) * (np + vp) + np + c];
        }
    }
}

template <typename T>
int launch_mla_kv(const void * kv, const void * krot, void * key, void * value, int t, int heads, int nope, int rope,
                  int v, bool pieces, int * took, cudaStream_t stream) {
    constexpr int S = (int) sizeof(T);
    const uintptr_t all = (uintptr_t) kv | (uintptr_t) krot | (uintptr_t) key | (uintptr_t) value;
    if (pieces && nope * S % 16 == 0 && rope * S % 16 == 0 && v * S % 16 == 0 && all % 16 == 0) {
        const int np = nope * S / 16, rp = rope * S / 16, vp = v * S / 16;
        const long long n = (long long) heads * t * (np + rp + vp);
        const long long blocks = std::min((n + 255) / 256, 1LL << 20);
        glmcheck_mla_kv16_k<<<(unsigned) blocks, 256, 0, stream>>>((const uint4 *) kv, (const uint4 *) krot,
                                                                   (uint4 *) key, (uint4 *) value, t, heads, np, rp,
                                                                   vp);
        if (took) {
            *took = 16;
        }
        return cudaGetLastError() == cudaSuccess ? 0 : 3;
    }
    const long long n = (long long) heads * t * (nope + rope + v);
    const long long blocks = (n + 255) / 256;
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_mla_kv_k<T><<<(unsigned) blocks, 256, 0, stream>>>((const T *) kv, (const T *) krot, (T *) key,
                                                                (T *) value, t, heads, nope, rope, v);
    if (took) {
        *took = S;
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// x [heads, t, row] → y [t, heads·row] (attention's per-head output to the o_proj input: candle's
// transpose + contiguous copy), in 16-byte pieces: a thread per piece of the output, consecutive
// threads consecutive pieces; a head's row (`row` bytes, a multiple of 16) is read contiguously.
__global__ void glmcheck_heads_to_tokens_k(const uint4 * __restrict__ x, uint4 * __restrict__ y, int heads, int t,
                                           int row_pieces) {
    const long long n = (long long) heads * t * row_pieces;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long) gridDim.x * blockDim.x) {
        const int c = (int) (i % row_pieces);
        const long long r = i / row_pieces; // (token, head) in the output's order
        const int head = (int) (r % heads), tok = (int) (r / heads);
        y[i] = x[((long long) head * t + tok) * row_pieces + c];
    }
}

} // namespace

// Each returns 0 when launched; 1: a dtype it does not take (0 f32, 1 f16, 2 bf16); 2: a shape it
// does not take; 3: CUDA refused the launch.

// scores/probs [heads·t, s] in the dtype, mask [t, s] f32; `scale` is the scale already rounded to
// the dtype (candle's affine takes `T::from_f64(scale)`), as f32.
extern "C" int glmcheck_masked_softmax(int dtype, const void * scores, const float * mask, void * probs,
                                       long long heads, int t, int s, float scale, void * stream) {
    if (heads <= 0 || t <= 0 || s <= 0) {
        return 2;
    }
    const long long rows = heads * t;
    cudaStream_t st = (cudaStream_t) stream;
    switch (dtype) {
    case 0: return launch_softmax<float>(scores, mask, probs, rows, t, s, scale, st);
    case 1: return launch_softmax<half>(scores, mask, probs, rows, t, s, scale, st);
    case 2: return launch_softmax<__nv_bfloat16>(scores, mask, probs, rows, t, s, scale, st);
    default: return 1;
    }
}

// x, y [rows, n], w [n], all in the dtype: transformers' RMSNorm as candle's chain rounds it; mul is
// (float)(1/n), eps (float)eps. Rows of 32 values or fewer, or not a multiple of 4, are refused (2).
extern "C" int glmcheck_rms_norm(int dtype, const void * x, const void * w, void * y, long long rows, int n, float mul,
                                 float eps, void * stream) {
    if (rows <= 0 || n <= 32 || n % 4 != 0) {
        return 2;
    }
    cudaStream_t st = (cudaStream_t) stream;
    switch (dtype) {
    case 0: return launch_rms_norm<float>(x, w, y, rows, n, mul, eps, st);
    case 1: return launch_rms_norm<half>(x, w, y, rows, n, mul, eps, st);
    case 2: return launch_rms_norm<__nv_bfloat16>(x, w, y, rows, n, mul, eps, st);
    default: return 1;
    }
}

// y [n, k, h] f32, w [n, k] f32 → out [n, h] in the dtype.
extern "C" int glmcheck_slot_sum(int dtype, const float * y, const float * w, void * out, long long n, int k, int h,
                                 void * stream) {
    if (n <= 0 || k <= 0 || h <= 0) {
        return 2;
    }
    cudaStream_t st = (cudaStream_t) stream;
    switch (dtype) {
    case 0: return launch_slot_sum<float>(y, w, out, n, k, h, st);
    case 1: return launch_slot_sum<half>(y, w, out, n, k, h, st);
    case 2: return launch_slot_sum<__nv_bfloat16>(y, w, out, n, k, h, st);
    default: return 1;
    }
}

// y [rows, h] of the dtype, w f32 indexed by slot, order [2, n, k] u32 → out [n, h].
extern "C" int glmcheck_token_sum(int dtype, const void * y, const float * w, const uint32_t * order, void * out,
                                  long long n, int k, int h, void * stream) {
    if (n <= 0 || k <= 0 || h <= 0) {
        return 2;
    }
    cudaStream_t st = (cudaStream_t) stream;
    switch (dtype) {
    case 0: return launch_token_sum<float>(y, w, order, out, n, k, h, st);
    case 1: return launch_token_sum<half>(y, w, order, out, n, k, h, st);
    case 2: return launch_token_sum<__nv_bfloat16>(y, w, order, out, n, k, h, st);
    default: return 1;
    }
}

// kv [t, heads, nope + v], krot [t, rope] → out = key [heads, t, nope + rope] then value
// [heads, t, v], one buffer.
// pieces: the 16-byte copies where nope, rope and v fill whole pieces and the buffers sit on 16-byte
// boundaries (else, and with 0, one value a thread; the same bits either way).
extern "C" int glmcheck_mla_kv(int dtype, const void * kv, const void * krot, void * out, int t, int heads, int nope,
                               int rope, int v, int pieces, int * took, void * stream) {
    if (t <= 0 || heads <= 0 || nope < 0 || rope < 0 || v <= 0 || nope + rope <= 0) {
        return 2;
    }
    const long long key_n = (long long) heads * t * (nope + rope);
    cudaStream_t st = (cudaStream_t) stream;
    switch (dtype) {
    case 0: return launch_mla_kv<float>(kv, krot, out, (float *) out + key_n, t, heads, nope, rope, v, pieces, took, st);
    case 1: return launch_mla_kv<half>(kv, krot, out, (half *) out + key_n, t, heads, nope, rope, v, pieces, took, st);
    case 2:
        return launch_mla_kv<__nv_bfloat16>(kv, krot, out, (__nv_bfloat16 *) out + key_n, t, heads, nope, rope, v,
                                            pieces, took, st);
    default: return 1;
    }
}

// x [heads, t, v] → y [t, heads·v] in the dtype (a pure copy: the same bits as candle's transpose and
// contiguous copy). Rows of v values must be whole 16-byte pieces and both pointers 16-byte
// aligned (2 otherwise).
extern "C" int glmcheck_heads_to_tokens(int dtype, const void * x, void * y, int heads, int t, int v, void * stream) {
    const int size = dtype == 0 ? 4 : (dtype == 1 || dtype == 2) ? 2 : 0;
    if (size == 0) {
        return 1;
    }
    if (heads <= 0 || t <= 0 || v <= 0 || (long long) v * size % 16 != 0 || (uintptr_t) x % 16 != 0
        || (uintptr_t) y % 16 != 0) {
        return 2;
    }
    const int row_pieces = (int) ((long long) v * size / 16);
    const long long n = (long long) heads * t * row_pieces;
    const long long blocks = std::min((n + 255) / 256, 1LL << 20);
    glmcheck_heads_to_tokens_k<<<(unsigned) blocks, 256, 0, (cudaStream_t) stream>>>((const uint4 *) x, (uint4 *) y,
                                                                                     heads, t, row_pieces);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}
