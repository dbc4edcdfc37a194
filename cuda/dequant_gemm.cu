// Dequant mode's routed experts in ONE kernel per projection: every expert that has tokens
// multiplies its tokens by its GGUF blocks, decoded tile by tile into shared memory in the compute
// dtype (bf16 or f16) and multiplied there with tensor cores (WMMA, f32 accumulation). The decoded
// weights never reach device memory: the kernel reads each active expert's blocks once (4.5 bits a
// weight for Q4_K) where decode-then-GEMM writes and re-reads them as 16-bit values (32 bits).
//
// Same values as decode-then-GEMM: each weight is decoded with the arithmetic of candle-kernels'
// dequantize_block_* (src/quantized.cu, llama.cpp's), the same float expressions in the same order,
// rounded once to the compute dtype; products are exact in f32, sums in f32 (another order than
// cuBLAS', so the two agree to rounding, not bit for bit); the output is rounded once.
//
// Tiling: a CUDA block owns 64 weight rows of one expert and TN (16 or 32) of its tokens; it walks
// k in steps of 256 (one K-quant super-block, eight 32-value blocks): the raw blocks of the next
// step are copied asynchronously (cp.async, 16 bytes at a time) while the current step is decoded
// and multiplied. Each warp owns 16 of the 64 rows: it decodes them half a step at a time (one
// 32-value sub-block per lane at a time) into its own tile and multiplies that by the TN tokens,
// synchronizing only with itself, so one warp's decoding overlaps another's MMAs; the block meets
// once a step, when the next step's copies are issued.
//
// Built by build.rs with `--features cuda`; declared in src/model/moe_cuda.rs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <mma.h>
#include <stdint.h>

#include "gguf_blocks.cuh"

using namespace nvcuda;

namespace {

constexpr int BM = 64;          // weight rows per block
constexpr int KS = 256;         // k per step
constexpr int LDK = KS + 8;     // row pitch of the activation tiles (a multiple of 8, WMMA)
constexpr int KH = KS / 2;      // k decoded at once: half a step (four 32-value sub-blocks)
constexpr int LDH = KH + 8;     // row pitch of the decoded weight tiles
constexpr int THREADS = 128;    // 4 warps, 16 weight rows each
constexpr int LDC = BM + 4;     // pitch of the f32 output staging (a multiple of 4, WMMA)

// One row's raw bytes in shared memory: the step's blocks from a 16-byte boundary (up to 15 bytes
// of misalignment in front), rounded up to 16, plus 16 bytes the word reader may touch past the end.
__host__ __device__ constexpr int slot_bytes(int t) { return (bytes_256(t) + 15 + 15) / 16 * 16 + 16; }

// An integer 0 <= v < 2^23 as a float, exactly (no int-to-float conversion unit): the bits of
// 2^23 + v minus 2^23.
__device__ __forceinline__ float ufloat(uint32_t v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }

// Sub-block s (0..7, values 32s..32s+31) of the 256 values at `b` into v. Each line matches the
// expression candle-kernels' dequantize_block_* evaluates for that value (the float conversions of
// small integers are exact either way).
template <int T>
__device__ __forceinline__ void decode32(const uint8_t * b, int s, float (&v)[32]) {
    if constexpr (T == Q4_0) {
        const uint8_t * x = b + 18 * s;
        const float d = h2f(x), dm = -8 * d;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t q = word(x + 2 + 4 * w);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[4 * w + i]      = d * ufloat((q >> (8 * i)) & 0xF) + dm;
                v[4 * w + i + 16] = d * ufloat((q >> (8 * i + 4)) & 0xF) + dm;
            }
        }
    } else if constexpr (T == Q5_0) {
        const uint8_t * x = b + 22 * s;
        const float d = h2f(x);
        const uint32_t qh = word(x + 2);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t q = word(x + 6 + 4 * w);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = 4 * w + i;
                const uint32_t xh0 = ((qh >> j) << 4) & 0x10, xh1 = (qh >> (j + 12)) & 0x10;
                // candle: (float(q) - 16.0f) * d; 2^23 + 16 folds the subtraction in exactly.
                v[j]      = (__uint_as_float(0x4B000000u | (((q >> (8 * i)) & 0xF) | xh0)) - 8388624.0f) * d;
                v[j + 16] = (__uint_as_float(0x4B000000u | (((q >> (8 * i + 4)) & 0xF) | xh1)) - 8388624.0f) * d;
            }
        }
    } else if constexpr (T == Q8_0) {
        const uint8_t * x = b + 34 * s;
        const float d = h2f(x);
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const uint32_t q = word(x + 2 + 4 * w) ^ 0x80808080u; // int8 + 128, per byte
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[4 * w + i] = d * (__uint_as_float(0x4B000000u | ((q >> (8 * i)) & 0xFF)) - 8388736.0f);
            }
        }
    } else if constexpr (T == Q4_K || T == Q5_K) {
        const float dall = h2f(b), dmin = h2f(b + 2);
        int sc, m;
        scale_min_k4(s, b + 4, sc, m);
        const float d1 = dall * sc, m1 = dmin * m;
        const int pair = s / 2, shift = 4 * (s & 1);
        const uint8_t * ql = b + (T == Q4_K ? 16 : 48) + 32 * pair;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const uint32_t q = word(ql + 4 * w);
            uint32_t h = 0;
            if constexpr (T == Q5_K) {
                h = word(b + 16 + 4 * w);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint32_t x = (q >> (8 * i + shift)) & 0xF;
                if constexpr (T == Q5_K) {
                    x += ((h >> (8 * i)) & (1u << (2 * pair + (s & 1)))) ? 16 : 0;
                }
                v[4 * w + i] = d1 * ufloat(x) - m1;
            }
        }
    } else if constexpr (T == Q6_K) {
        const int ip = s / 4, jj = s % 4;
        const float d = h2f(b + 208);
        const uint8_t * ql = b + 64 * ip + (jj & 1) * 32;
        const uint8_t * qh = b + 128 + 32 * ip;
        const int8_t * sc = (const int8_t *) (b + 192) + 8 * ip + 2 * jj;
        const int lshift = (jj >> 1) * 4, hshift = 2 * jj;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const uint32_t q = word(ql + 4 * w), h = word(qh + 4 * w);
            const float ds = d * sc[w / 4]; // values 0..15 take scale is, 16..31 is + 1
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t x = ((q >> (8 * i + lshift)) & 0xF) | (((h >> (8 * i + hshift)) & 3) << 4);
                v[4 * w + i] = ds * (__uint_as_float(0x4B000000u | x) - 8388640.0f);
            }
        }
    }
}

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

// y[j] = W[experts[z]] · x[src[j]] for the rows j of active expert z (bounds[z]..bounds[z+1]),
// j in grouped order; src null: x's row j. W: [E, n_out, k_in] blocks, row_bytes per row,
// expert_bytes per expert. Grid: (n_out / 64, column tiles of TN rows, active experts).
template <int T, int TN, typename C>
__global__ void __launch_bounds__(THREADS) glmcheck_dqmm(
        const uint8_t * __restrict__ w, long long expert_bytes, long long row_bytes,
        const C * __restrict__ x, const int32_t * __restrict__ src,
        const int32_t * __restrict__ bounds, const int32_t * __restrict__ experts,
        C * __restrict__ y, int n_out, int k_in) {
    constexpr int B = bytes_256(T), SLOT = slot_bytes(T), CHUNKS = SLOT / 16 - 1;
    const int z = blockIdx.z;
    const int row0 = bounds[z] + blockIdx.y * TN;
    const int nrows = min(TN, bounds[z + 1] - row0);
    if (nrows <= 0) {
        return;
    }
    const int n0 = blockIdx.x * BM;
    const int tid = threadIdx.x, warp = tid / 32;

    // Shared memory: raw[2][BM][SLOT] | xs[2][TN][LDK] | ws[BM][LDH] (4 warps' tiles of 16 rows;
    // reused for the f32 output).
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t * raw = smem;
    C * xs = (C *) (smem + 2 * BM * SLOT);
    C * ws = xs + 2 * TN * LDK;
    __shared__ int src_row[TN];
    __shared__ int misalign[BM];
    if (tid < TN) {
        src_row[tid] = tid < nrows ? (src ? src[row0 + tid] : row0 + tid) : -1;
    }
    const uint8_t * wexp = w + (long long) experts[z] * expert_bytes + (long long) n0 * row_bytes;
    __syncthreads();

    const int steps = k_in / KS;
    auto stage = [&](int buf, int step) {
        // Raw blocks of 64 rows: row r's bytes [off, off + B) copied from off rounded down to 16.
        for (int i = tid; i < BM * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const uintptr_t off = (uintptr_t) (wexp + r * row_bytes + (long long) step * B);
            const int mis = (int) (off & 15);
            if (c == 0 && step == 0) {
                misalign[r] = mis; // the same every step when B and row_bytes are multiples of 16
            }
            if (16 * c < mis + B) {
                __pipeline_memcpy_async(raw + (buf * BM + r) * SLOT + 16 * c,
                                        (const void *) (off - mis + 16 * c), 16);
            }
        }
        for (int i = tid; i < TN * (KS / 8); i += THREADS) {
            const int r = i / (KS / 8), c = i % (KS / 8);
            C * dst = xs + (buf * TN + r) * LDK + 8 * c;
            if (src_row[r] >= 0) {
                __pipeline_memcpy_async(dst, x + (long long) src_row[r] * k_in + (long long) step * KS + 8 * c, 16);
            } else {
                *(uint4 *) dst = make_uint4(0, 0, 0, 0);
            }
        }
        __pipeline_commit();
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[TN / 16];
#pragma unroll
    for (int t = 0; t < TN / 16; ++t) {
        wmma::fill_fragment(acc[t], 0.0f);
    }

    C * wsw = ws + 16 * warp * LDH; // this warp's 16 decoded rows
    const int lane = tid % 32;
    stage(0, 0);
    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        __pipeline_wait_prior(0);
        // Everyone's copies of this step have landed, and everyone is done with the other buffer.
        __syncthreads();
        if (step + 1 < steps) {
            stage(buf ^ 1, step + 1);
        }
        const C * xb = xs + buf * TN * LDK;
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
            // 16 rows × 4 sub-blocks: two per lane.
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int task = lane + 32 * i, rr = task / 4, sub = task % 4;
                const int r = 16 * warp + rr;
                // The misalignment of a step's blocks moves when B is not a multiple of 16 (Q6_K):
                // recomputed from the row's address.
                const int mis = (B % 16 == 0 && row_bytes % 16 == 0)
                    ? misalign[r]
                    : (int) ((uintptr_t) (wexp + r * row_bytes + (long long) step * B) & 15);
                float v[32];
                decode32<T>(raw + (buf * BM + r) * SLOT + mis, 4 * half + sub, v);
                uint4 * dst = (uint4 *) (wsw + rr * LDH + 32 * sub);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    dst[q] = make_uint4(pack2<C>(v[8 * q + 0], v[8 * q + 1]), pack2<C>(v[8 * q + 2], v[8 * q + 3]),
                                        pack2<C>(v[8 * q + 4], v[8 * q + 5]), pack2<C>(v[8 * q + 6], v[8 * q + 7]));
                }
            }
            __syncwarp();
#pragma unroll
            for (int kk = 0; kk < KH; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, C, wmma::row_major> a;
                wmma::load_matrix_sync(a, wsw + kk, LDH);
#pragma unroll
                for (int t = 0; t < TN / 16; ++t) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, C, wmma::col_major> bf;
                    wmma::load_matrix_sync(bf, xb + 16 * t * LDK + KH * half + kk, LDK);
                    wmma::mma_sync(acc[t], a, bf, acc[t]);
                }
            }
            __syncwarp(); // the tile is rewritten by the next half
        }
    }
    __syncthreads(); // every warp's MMAs done: ws becomes the output staging

    // acc[t]: weight rows 16·warp.., tokens 16·t..; staged column-major ([token][row]) in ws.
    float * cs = (float *) ws;
#pragma unroll
    for (int t = 0; t < TN / 16; ++t) {
        wmma::store_matrix_sync(cs + 16 * t * LDC + 16 * warp, acc[t], LDC, wmma::mem_col_major);
    }
    __syncthreads();
    for (int i = tid; i < TN * BM; i += THREADS) {
        const int t = i / BM, r = i % BM;
        if (t < nrows) {
            y[(long long) (row0 + t) * n_out + n0 + r] = from_f32<C>(cs[t * LDC + r]);
        }
    }
}

template <int T, int TN, typename C>
int launch(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
           const int32_t * bounds, const int32_t * experts, void * y, int n_out, int k_in, int n_active,
           int max_rows, cudaStream_t stream) {
    const size_t shared = 2 * BM * slot_bytes(T) + 2 * TN * LDK * sizeof(C) + BM * LDH * sizeof(C);
    static_assert(BM * LDH * sizeof(C) >= TN * LDC * sizeof(float), "output staging overruns ws");
    if (cudaFuncSetAttribute(glmcheck_dqmm<T, TN, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shared)
        != cudaSuccess
        // all of the SM's memory as shared memory: 4 blocks of ~57 KB (Q4_K, 16 wide) fit
        || cudaFuncSetAttribute(glmcheck_dqmm<T, TN, C>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
        return 3;
    }
    const dim3 grid(n_out / BM, (max_rows + TN - 1) / TN, n_active);
    glmcheck_dqmm<T, TN, C><<<grid, THREADS, shared, stream>>>(
        (const uint8_t *) w, expert_bytes, row_bytes, (const C *) x, src, bounds, experts, (C *) y, n_out, k_in);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <int T, typename C>
int launch_tn(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
              const int32_t * bounds, const int32_t * experts, void * y, int n_out, int k_in, int n_active,
              int max_rows, cudaStream_t stream) {
    // Wider tiles decode an expert's weights fewer times but hold more shared memory (3 blocks an
    // SM instead of 4) and waste MMAs on padding: only when experts hold many rows. (At 256 tokens
    // of GLM-5, ~9 rows an expert and the busiest ~30: 16 wide.)
    return max_rows < 64
        ? launch<T, 16, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, y, n_out, k_in, n_active, max_rows, stream)
        : launch<T, 32, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, y, n_out, k_in, n_active, max_rows, stream);
}

template <typename C>
int launch_type(int ggml_type, const void * w, long long expert_bytes, long long row_bytes, const void * x,
                const int32_t * src, const int32_t * bounds, const int32_t * experts, void * y, int n_out,
                int k_in, int n_active, int max_rows, cudaStream_t stream) {
#define GLMCHECK_DQMM(Q) case Q: return launch_tn<Q, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, y, \
        n_out, k_in, n_active, max_rows, stream);
    switch (ggml_type) {
        GLMCHECK_DQMM(Q4_0)
        GLMCHECK_DQMM(Q5_0)
        GLMCHECK_DQMM(Q8_0)
        GLMCHECK_DQMM(Q4_K)
        GLMCHECK_DQMM(Q5_K)
        GLMCHECK_DQMM(Q6_K)
        default: return 1;
    }
#undef GLMCHECK_DQMM
}

} // namespace

// Whether glmcheck_dequant_matmul has a kernel for this ggml type (ggml's numbering).
extern "C" int glmcheck_dequant_matmul_type(int ggml_type) { return bytes_256(ggml_type) != 0; }

// Returns 0 when launched; 1: no kernel for the quant type or dtype (dtype 1 f16, 2 bf16); 2: a
// shape the tiling does not cover (n_out % 64, k_in % 256, an empty or too large grid); 3: CUDA
// refused the launch. x: [*, k_in] contiguous rows of the compute dtype (16-byte aligned rows);
// src: the x row of each grouped row (null: grouped row j is x's row j); y: [rows, n_out].
extern "C" int glmcheck_dequant_matmul(
        int ggml_type, int dtype, const void * w, long long expert_bytes, long long row_bytes,
        const void * x, const int32_t * src, const int32_t * bounds, const int32_t * experts, void * y,
        int n_out, int k_in, int n_active, int max_rows, void * stream) {
    if (n_out % BM != 0 || k_in % KS != 0 || n_active <= 0 || n_active > 65535 || max_rows <= 0
        || (max_rows + 15) / 16 > 65535) {
        return 2;
    }
    const cudaStream_t s = (cudaStream_t) stream;
    switch (dtype) {
        case 1: return launch_type<half>(ggml_type, w, expert_bytes, row_bytes, x, src, bounds, experts, y, n_out,
                                         k_in, n_active, max_rows, s);
        case 2: return launch_type<__nv_bfloat16>(ggml_type, w, expert_bytes, row_bytes, x, src, bounds, experts, y,
                                                  n_out, k_in, n_active, max_rows, s);
        default: return 1;
    }
}

// ---- Whole tensors decoded into device memory with the same decoders ------------------------------
// A warp takes 32 consecutive 32-value sub-blocks (four 256-value groups): it copies their bytes into
// shared memory as aligned words (coalesced; never a word past the tensor's last byte), each lane
// decodes one sub-block into a staging tile, and the warp writes the 1024 values out contiguously.

namespace {

constexpr int DW = 4; // warps per block

template <typename O> __device__ __forceinline__ void store4(O * y, float4 f);
template <> __device__ __forceinline__ void store4<float>(float * y, float4 f) { *(float4 *) y = f; }
template <> __device__ __forceinline__ void store4<half>(half * y, float4 f) {
    half2 a = __floats2half2_rn(f.x, f.y), b = __floats2half2_rn(f.z, f.w);
    *(uint2 *) y = make_uint2(*(uint32_t *) &a, *(uint32_t *) &b);
}
template <> __device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16 * y, float4 f) {
    *(uint2 *) y = make_uint2(pack2<__nv_bfloat16>(f.x, f.y), pack2<__nv_bfloat16>(f.z, f.w));
}

template <int T, typename O>
__global__ void __launch_bounds__(32 * DW) glmcheck_decode_whole_k(const uint8_t * __restrict__ x,
                                                                    O * __restrict__ y, long long n_groups) {
    constexpr int B = bytes_256(T), RAW = (4 * B + 4 + 3) / 4 + 4; // words: 4 groups + misalignment + slack
    constexpr int PITCH = 36;                                       // floats per staged sub-block
    __shared__ uint32_t raw[DW][RAW];
    __shared__ __align__(16) float st[DW][32 * PITCH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long g0 = ((long long) blockIdx.x * DW + warp) * 4; // first 256-value group
    if (g0 >= n_groups) {
        return;
    }
    const int groups = (int) min(4LL, n_groups - g0);
    const uintptr_t start = (uintptr_t) (x + g0 * B), end = start + (uintptr_t) groups * B;
    const uint32_t * w0 = (const uint32_t *) (start & ~(uintptr_t) 3);
    const int words = (int) (((end + 3) & ~(uintptr_t) 3) - (uintptr_t) w0) / 4;
    for (int i = lane; i < words; i += 32) {
        raw[warp][i] = w0[i];
    }
    __syncwarp();
    const uint8_t * base = (const uint8_t *) raw[warp] + (start & 3);
    float * s = st[warp];
    if (lane < 8 * groups) {
        float v[32];
        decode32<T>(base + (lane / 8) * B, lane % 8, v);
        float4 * d = (float4 *) (s + lane * PITCH);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            d[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
        }
    }
    __syncwarp();
    O * out = y + g0 * 256;
    for (int e = 4 * lane; e < 256 * groups; e += 128) {
        store4<O>(out + e, *(const float4 *) (s + (e / 32) * PITCH + e % 32));
    }
}

template <int T>
int decode_whole(int dtype, const void * x, void * y, long long n_groups, cudaStream_t s) {
    const long long blocks = (n_groups + 4 * DW - 1) / (4 * DW);
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    const uint8_t * xb = (const uint8_t *) x;
    switch (dtype) {
        case 0: glmcheck_decode_whole_k<T, float><<<(unsigned) blocks, 32 * DW, 0, s>>>(xb, (float *) y, n_groups); break;
        case 1: glmcheck_decode_whole_k<T, half><<<(unsigned) blocks, 32 * DW, 0, s>>>(xb, (half *) y, n_groups); break;
        case 2: glmcheck_decode_whole_k<T, __nv_bfloat16><<<(unsigned) blocks, 32 * DW, 0, s>>>(
                    xb, (__nv_bfloat16 *) y, n_groups); break;
        default: return 1;
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

} // namespace

// n_values (a multiple of 256) of a tensor of `ggml_type` blocks at x, decoded into y: dtype 0 f32,
// 1 f16, 2 bf16. Returns 0 when launched; 1: no kernel for the type or dtype; 2: a shape it does not
// take; 3: CUDA refused the launch.
extern "C" int glmcheck_decode_whole(int ggml_type, int dtype, const void * x, void * y, long long n_values,
                                     void * stream) {
    if (n_values <= 0 || n_values % 256 != 0) {
        return 2;
    }
    const long long g = n_values / 256;
    const cudaStream_t s = (cudaStream_t) stream;
    switch (ggml_type) {
        case Q4_0: return decode_whole<Q4_0>(dtype, x, y, g, s);
        case Q5_0: return decode_whole<Q5_0>(dtype, x, y, g, s);
        case Q8_0: return decode_whole<Q8_0>(dtype, x, y, g, s);
        case Q4_K: return decode_whole<Q4_K>(dtype, x, y, g, s);
        case Q5_K: return decode_whole<Q5_K>(dtype, x, y, g, s);
        case Q6_K: return decode_whole<Q6_K>(dtype, x, y, g, s);
        default: return 1;
    }
}
