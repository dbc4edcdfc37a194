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
#include <type_traits>

#include "dq_decode.cuh"
#include "gguf_blocks.cuh"

using namespace nvcuda;

namespace {

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


// y[j] = W[experts[z]] · x[src[j]] for the rows j of active expert z (bounds[z]..bounds[z+1]),
// j in grouped order; src null: x's row j. W: [E, n_out, k_in] blocks, row_bytes per row,
// expert_bytes per expert. Grid: (n_out / 64, column tiles of TN rows, active experts).
template <int T, int TN, typename C>
__global__ void __launch_bounds__(THREADS) glmcheck_dqmm(
        const uint8_t * __restrict__ w, long long expert_bytes, long long row_bytes,
        const C * __restrict__ x, const int32_t * __restrict__ src,
        const int32_t * __restrict__ bounds, const int32_t * __restrict__ experts, const int32_t * __restrict__ zlist,
        C * __restrict__ y, int n_out, int k_in) {
    constexpr int B = bytes_256(T), SLOT = slot_bytes(T), CHUNKS = SLOT / 16 - 1;
    const int z = zlist ? zlist[blockIdx.z] : (int) blockIdx.z; // the active expert of this grid plane
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

// ---- The register-decode kernel (Q4_K, Q5_K, Q6_K, Q8_0) ------------------------------------------
// The same decoded values as glmcheck_dqmm (decode32's expressions, rounded once to the compute
// dtype), multiplied with mma.sync m16n8k16 whose A fragments each lane decodes straight from the
// raw blocks into registers: no decoded tile goes through shared memory, and a weight costs two
// instructions (a byte permute into a float that carries q, the scale's FMA with the offset folded
// into its addend: "One FMA a weight" below; Q4_K/Q5_K steps whose addend would round take three)
// plus half a packing conversion; Q4_K takes the f16 decode below instead, by default.
// glmcheck_dqmm's decode (a lane decodes a whole 32-value sub-block into 32 registers, stores it,
// the warp reloads it with ldmatrix) ran at ~6 weights per SM cycle and bounded dequant mode's
// experts (reports/gpu-moe.md, E2).
//
// The k order inside each 16-value MMA chunk is permuted, the same way for weights and tokens:
// lane t's logical k (2t, 2t+1, 2t+8, 2t+9) are the chunk's physical values 4t..4t+3, so a lane's
// A registers come from one 32-bit word of packed quants per row (four consecutive values) and
// its B registers from one 8-byte load of a token's staged activations. A sum over k does not
// depend on the order its terms are listed in; the MMA sums them in f32 as glmcheck_dqmm does.
//
// Tiling as cuda/q8_moe.cu's: a block owns 64 weight rows of one expert and 8·NT of its tokens,
// walks k in steps of 256 with the next step's raw blocks and activations copied asynchronously,
// a step's row scales decoded once per block into shared memory; each warp owns 16 rows and runs
// one MMA per 16 values per 8 tokens that exist (empty groups of 8 are skipped).

constexpr int XPB = 2 * KS + 32; // bytes of one token's staged step (16-bit values; 8-byte loads conflict-free)

// c += A(16×16, row) · B(16×8, col) in f32, A and B of the compute dtype.
template <typename C>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<C, __nv_bfloat16>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// One 256-value step of one warp: `b[h]` the raw blocks of the lane's rows g + 8h (`rs[h]` their
// scales), `xb` the step's staged activations (token c at xb + c·XPB). acc[n][e]: row g + 8·(e / 2),
// token 8n + 2t + e % 2 (the m16n8 accumulator layout); only the first LIVE groups of 8 tokens
// are multiplied (a compile-time count: no branch between a chunk's MMAs, so the compiler
// interleaves one chunk's decoding with the previous chunk's MMAs). FMA1: the one-FMA decode
// (Q4_K/Q5_K only when dq_scales found every addend exact; the other types always).
template <int T, int NT, int LIVE, bool ALIGNED, bool FMA1, typename C, bool H16 = false>
__device__ __forceinline__ void dq_step(const uint8_t * const (&b)[2], const float * const (&rs)[2],
                                        const uint8_t * xb, int g, int t, float (&acc)[NT][4]) {
    // The chunk of 16 values at k0 of the step: lane values v[h][i] (row g + 8h, physical k0 + 4t + i)
    // into A, then one MMA per live group of 8 tokens.
    auto mma_chunk = [&](const float (&v)[2][4], int k0) {
        const uint32_t a[4] = {pack2<C>(v[0][0], v[0][1]), pack2<C>(v[1][0], v[1][1]), pack2<C>(v[0][2], v[0][3]),
                               pack2<C>(v[1][2], v[1][3])};
#pragma unroll
        for (int n = 0; n < LIVE; ++n) {
            const uint2 bv = *(const uint2 *) (xb + (8 * n + g) * XPB + 2 * (k0 + 4 * t));
            mma_16816<C>(acc[n], a, bv.x, bv.y);
        }
    };
    dq_decode<T, ALIGNED, FMA1, H16>(b, rs, t, mma_chunk);
}

// dq_step with LIVE = live (1..L), the block-uniform count of 8-token groups that hold tokens.
template <int T, int NT, bool ALIGNED, bool FMA1, typename C, bool H16 = false, int L = NT>
__device__ __forceinline__ void dq_step_live(int live, const uint8_t * const (&b)[2], const float * const (&rs)[2],
                                             const uint8_t * xb, int g, int t, float (&acc)[NT][4]) {
    if constexpr (L > 1) {
        if (live < L) {
            dq_step_live<T, NT, ALIGNED, FMA1, C, H16, L - 1>(live, b, rs, xb, g, t, acc);
            return;
        }
    }
    dq_step<T, NT, L, ALIGNED, FMA1, C, H16>(b, rs, xb, g, t, acc);
}

// As glmcheck_dqmm: y[j] = W[experts[z]] · x[src[j]] for the grouped rows j of active expert z.
// Grid: (row tiles of 8·NT, n_out / 64, active experts). Two copy stages: three (the next two
// steps' copies in flight) were the same bits and slower, 2772 → 3003 µs for the 16-wide Q4_K
// launches at 256 tokens on an H100 (a third buffer costs two resident blocks an SM;
// reports/gpu-moe.md build AB; recoverable at e9aa729).
template <int T, int NT, bool ALIGNED, typename C, bool H16 = false>
__global__ void __launch_bounds__(THREADS) glmcheck_dqmma(
        const uint8_t * __restrict__ w, long long expert_bytes, long long row_bytes,
        const C * __restrict__ x, const int32_t * __restrict__ src,
        const int32_t * __restrict__ bounds, const int32_t * __restrict__ experts, const int32_t * __restrict__ zlist,
        C * __restrict__ y, int n_out, int k_in) {
    constexpr int TN = 8 * NT, B = bytes_256(T), P = raw_pitch(T), RS = dq_row_scales<T>();
    const int z = zlist ? zlist[blockIdx.z] : (int) blockIdx.z; // the active expert of this grid plane
    const int row0 = bounds[z] + blockIdx.x * TN;
    const int nrows = min(TN, bounds[z + 1] - row0);
    if (nrows <= 0) {
        return;
    }
    const int n0 = blockIdx.y * BM;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

    // Shared memory: raw[2][BM][P] | xs[2][TN][XPB].
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t * raw = smem;
    uint8_t * xs = smem + 2 * BM * P;
    __shared__ int src_row[TN];
    __shared__ __align__(8) float rsc[BM * RS];
    if (tid < TN) {
        src_row[tid] = tid < nrows ? (src ? src[row0 + tid] : row0 + tid) : -1;
    }
    __syncthreads();
    const uint8_t * wexp = w + (long long) experts[z] * expert_bytes + (long long) n0 * row_bytes;

    // Weight chunks tid % 16 (+ 16) of rows tid / 16 + 8j, each from the 16-byte boundary below the
    // step's first byte; a token's 256 values in 32 chunks. Tokens past the expert's rows are not
    // copied (their columns' products are never written).
    const uint8_t * wrow = wexp + (long long) (tid / 16) * row_bytes;
    const long long wstride = (THREADS / 16) * row_bytes;
    const int steps = k_in / KS;
    auto stage = [&](int buf, int step) {
        const uint8_t * srcp = wrow + (long long) step * B;
        uint8_t * dst = raw + (buf * BM + tid / 16) * P;
        stage_raw<T, ALIGNED, BM, THREADS>(dst, srcp, wstride, tid);
        for (int i = tid; i < nrows * (KS / 8); i += THREADS) {
            const int r = i / (KS / 8), c = i % (KS / 8);
            __pipeline_memcpy_async(xs + (buf * TN + r) * XPB + 16 * c,
                                    x + (long long) src_row[r] * k_in + (long long) step * KS + 8 * c, 16);
        }
        __pipeline_commit();
    };

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[n][e] = 0.0f;
        }
    }
    const int r0 = 16 * warp + g; // this lane's rows: r0 and r0 + 8
    stage(0, 0);
    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        auto blk = [&](int r) {
            const int mis = ALIGNED ? 0 : (int) ((uintptr_t) (wexp + r * row_bytes + (long long) step * B) & 15);
            return raw + (buf * BM + r) * P + mis;
        };
        __pipeline_wait_prior(0);
        // Everyone's copies of this step have landed; everyone is done with the other buffer and
        // with the previous step's scales.
        __syncthreads();
        // Whether every addend of the step is exact (block-uniform): the one-FMA decode.
        bool fma1 = true;
        if constexpr (H16) {
            dq_scales<T, ALIGNED, decltype(blk), true>(blk, rsc, tid);
            __syncthreads();
        } else {
            fma1 = __syncthreads_and(dq_scales<T, ALIGNED>(blk, rsc, tid));
        }
        if (step + 1 < steps) {
            stage(buf ^ 1, step + 1);
        }
        const uint8_t * b[2] = {blk(r0), blk(r0 + 8)};
        const float * rs[2] = {rsc + r0 * RS, rsc + (r0 + 8) * RS};
        const int live = (nrows + 7) / 8;
        if constexpr (!H16 && (T == Q4_K || T == Q5_K)) { // the f16 decode has no fallback
            if (!fma1) {
                dq_step_live<T, NT, ALIGNED, false, C>(live, b, rs, xs + buf * TN * XPB, g, t, acc);
                continue;
            }
        }
        dq_step_live<T, NT, ALIGNED, true, C, H16>(live, b, rs, xs + buf * TN * XPB, g, t, acc);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * n + 2 * t + (e & 1);
            if (col < nrows) {
                y[(long long) (row0 + col) * n_out + n0 + r0 + 8 * (e / 2)] = from_f32<C>(acc[n][e]);
            }
        }
    }
}

template <int T, int NT, bool ALIGNED, typename C, bool H16 = false>
int launch_mma(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
               const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y, int n_out, int k_in, int n_active,
               int max_rows, cudaStream_t stream) {
    const size_t shared = 2 * (BM * raw_pitch(T) + 8 * NT * XPB);
    auto kernel = glmcheck_dqmma<T, NT, ALIGNED, C, H16>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shared) != cudaSuccess
        || cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
        return 3;
    }
    const dim3 grid((max_rows + 8 * NT - 1) / (8 * NT), n_out / BM, n_active);
    kernel<<<grid, THREADS, shared, stream>>>((const uint8_t *) w, expert_bytes, row_bytes, (const C *) x, src, bounds,
                                              experts, zlist, (C *) y, n_out, k_in);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// The register-decode kernel at tile width tn (8, 16 or 32 tokens; 0: by the busiest expert's rows).
template <int T, bool ALIGNED, typename C, bool H16 = false>
int launch_mma_tn(int tn, const void * w, long long expert_bytes, long long row_bytes, const void * x,
                  const int32_t * src, const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y, int n_out, int k_in,
                  int n_active, int max_rows, cudaStream_t stream) {
    if (tn == 0) {
        tn = max_rows <= 8 ? 8 : max_rows <= 16 ? 16 : 32;
    }
#define GLMCHECK_DQMMA(N) launch_mma<T, N, ALIGNED, C, H16>(w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, \
                                                       n_out, k_in, n_active, max_rows, stream)
    switch (tn) {
        case 8: return GLMCHECK_DQMMA(1);
        case 16: return GLMCHECK_DQMMA(2);
        case 32: return GLMCHECK_DQMMA(4);
        default: return 2;
    }
#undef GLMCHECK_DQMMA
}

// ---- The direct-load kernel (Q4_K on 16-byte aligned rows) ----------------------------------------
// glmcheck_dqmma's values (the one-FMA decode where the addend is exact, decode32's two operations
// where not; rounded once to the compute dtype; f32 sums), with the weights read straight from
// device memory into the registers of the lanes that decode them: nothing of a weight goes through
// shared memory, and a step's row scales are decoded by the lanes that use them, so the block
// meets once a step (for the tokens' stage) instead of twice. What glmcheck_dqmma spends a step
// on besides decoding -- the raw blocks' cp.async copies and their addresses, the block-wide scale
// pass through shared memory and its second barrier, a shared load per word -- is what it drops;
// with no raw blocks in shared memory its residency is bound by registers instead (96 at 8 or 16
// tokens: 5 blocks of 4 warps an SM, as many as glmcheck_dqmma's shared memory allows), each warp
// holding the next step's bytes in flight. On an H100 it was no faster than glmcheck_dqmma
// (reports/gpu-moe.md build W): opt-in.
//
// Lane (g, t) owns rows g and g + 8 of its warp's 16 and, of each row's 256-value step, the 32
// bytes 32t..32t+31 of the block's quants: sub-blocks 2t (low nibbles) and 2t + 1 (high), 64
// values, read as two 16-byte loads, with the block's 16-byte header (its scales: a load the
// quad's four lanes share). Its MMA chunk (hi, w) (hi: the nibble, w: the word 0..7) is the four
// values 64t + 32hi + 4w + 0..3 of each row; the tokens' stage puts those four values of every
// token where the lane's B fragment load finds them. The k order inside a chunk differs from
// glmcheck_dqmma's (a sum over k does not depend on it; the MMA sums in f32 either way).
//
// A token's stage: 32 granules of 16 bytes (8 values), granule c = 8q + x (q = c / 8) stored at
// 10q + x, pitch 41 granules: the 8 lanes of a quarter warp (two tokens g, four t) reading granule
// 8t + x of their tokens sit at 41g + 10t + x, i.e. (g + 2t + x) mod 8 groups of 4 banks: all 8
// different (16-byte loads: conflict-free), and a lane's address is its base plus a constant.

constexpr int XPD = 41 * 16; // bytes of one token's staged step

__device__ __forceinline__ int granule_at(int c) { return 10 * (c >> 3) + (c & 7); }

struct Q4kRows {
    uint4 hdr[2]; // d, dmin | scales 0..3 | 4..7 | 8..11 of rows g and g + 8
    uint4 q[2][2]; // the lane's 32 quant bytes of each row
};

// The lane's (d·sc, dmin·m) of sub-block 2t + hi of a row's block (decode32's products: exact).
__device__ __forceinline__ void q4k_scale(const uint4 & h, int t, int hi, float & d1, float & m1) {
    const float dall = __half2float(__ushort_as_half((unsigned short) (h.x & 0xFFFF)));
    const float dmin = __half2float(__ushort_as_half((unsigned short) (h.x >> 16)));
    // Sub-blocks 4h'..4h'+3 (h' = t / 2) as dq_scales computes them, then byte 2(t % 2) + hi.
    const uint32_t sc = t < 2 ? h.y & 0x3F3F3F3Fu : (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    const uint32_t m = t < 2 ? h.z & 0x3F3F3F3Fu : ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    const int sh = 16 * (t & 1) + 8 * hi;
    d1 = dall * (int) ((sc >> sh) & 0xFF);
    m1 = dmin * (int) ((m >> sh) & 0xFF);
}

// One step of one warp on the registers `r`, LIVE groups of 8 tokens multiplied. FMA1: every
// addend of the warp's step exact, sc/ad the one-FMA decode's (256·d1, -(128·d1 + m1)) of row h,
// nibble hi; else decode32's two operations everywhere, on (d1, m1) in sc/ad. `xl`: the lane's
// token g, granule 8t, of the step's stage.
template <int NT, int LIVE, bool FMA1, typename C, bool H16 = false>
__device__ __forceinline__ void direct_step(const Q4kRows & r, const float (&sc)[2][2], const float (&ad)[2][2],
                                            const uint8_t * xl, float (&acc)[NT][4]) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const float s[2] = {sc[0][hi], sc[1][hi]}, a[2] = {ad[0][hi], ad[1][hi]};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            uint4 bx[LIVE];
#pragma unroll
            for (int n = 0; n < LIVE; ++n) {
                bx[n] = *(const uint4 *) (xl + 8 * n * XPD + 16 * (4 * hi + u));
            }
#pragma unroll
            for (int ww = 0; ww < 2; ++ww) {
                const int w = 2 * u + ww;
                float v[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 & q = r.q[h][w / 4];
                    const uint32_t word = (w % 4 == 0 ? q.x : w % 4 == 1 ? q.y : w % 4 == 2 ? q.z : q.w);
                    if constexpr (H16) {
                        h16_decode4(word, word >> 8, hi, s[h], a[h], v[h]);
                        continue;
                    }
                    const uint32_t x = (word >> (4 * hi)) & 0x0F0F0F0Fu;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        if constexpr (FMA1) {
                            v[h][i] = __fmaf_rn(s[h], half_byte(x, i), a[h]);
                        } else {
                            v[h][i] = s[h] * (magic_byte(x, i) - 8388608.0f) - a[h];
                        }
                    }
                }
                const uint32_t af[4] = {pack2<C>(v[0][0], v[0][1]), pack2<C>(v[1][0], v[1][1]),
                                        pack2<C>(v[0][2], v[0][3]), pack2<C>(v[1][2], v[1][3])};
#pragma unroll
                for (int n = 0; n < LIVE; ++n) {
                    mma_16816<C>(acc[n], af, ww ? bx[n].z : bx[n].x, ww ? bx[n].w : bx[n].y);
                }
            }
        }
    }
}

// The lane's four (row h, nibble hi) scales: the one-FMA decode's (256·d1, -(128·d1 + m1)) into
// sc/ad, FMA1 false: (d1, m1). Returns whether every one-FMA addend is exact in f32.
// H16: the f16 decode's (d1·2^24, -m1) for the low nibbles, (d1·2^20, -m1) for the high ones, so
// that fma(d1·2^24, q·2^-24, -m1) is d1·q - m1 rounded once: decode32's FMA, for every block (the
// product is exact, as the power-of-two factors are; no addend to keep exact).
template <bool FMA1, bool H16 = false>
__device__ __forceinline__ bool direct_scales(const Q4kRows & r, int t, float (&sc)[2][2], float (&ad)[2][2]) {
    bool ok = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            float d1, m1;
            q4k_scale(r.hdr[h], t, hi, d1, m1);
            if constexpr (H16) {
                sc[h][hi] = h16_scale(d1, hi);
                ad[h][hi] = -m1;
            } else if constexpr (FMA1) {
                float c;
                ok &= exact_sum(128.0f * d1, m1, c);
                sc[h][hi] = 256.0f * d1;
                ad[h][hi] = -c;
            } else {
                sc[h][hi] = d1;
                ad[h][hi] = m1;
            }
        }
    }
    return ok;
}

template <int NT, typename C, bool H16 = false, int L = NT>
__device__ __forceinline__ void direct_step_live(int live, const Q4kRows & r, const float (&sc)[2][2],
                                                 const float (&ad)[2][2], const uint8_t * xl, float (&acc)[NT][4]) {
    if constexpr (L > 1) {
        if (live < L) {
            direct_step_live<NT, C, H16, L - 1>(live, r, sc, ad, xl, acc);
            return;
        }
    }
    direct_step<NT, L, true, C, H16>(r, sc, ad, xl, acc);
}

// Resident blocks an SM the direct-load kernel is built for, i.e. its register cap (65536 / (32·W·n)):
// 4 warps, 8 or 16 tokens: 5 (102 registers; uncapped it takes ~127, the next step's bytes and the
// compiler's hoisted loads); 32 tokens: 4; 8 warps: 2.
__host__ __device__ constexpr int direct_min_blocks(int nt, int w) { return w == 4 ? (nt == 4 ? 4 : 5) : 2; }

// y[j] = W[experts[z]] · x[src[j]] as glmcheck_dqmma, W Q4_K with 16-byte aligned rows, blocks of
// 16·W rows (W warps). Grid: (row tiles of 8·NT, n_out / (16·W), active experts).
template <int NT, int W, typename C, bool H16>
__global__ void __launch_bounds__(32 * W, direct_min_blocks(NT, W)) glmcheck_dqmma_direct(
        const uint8_t * __restrict__ w, long long expert_bytes, long long row_bytes,
        const C * __restrict__ x, const int32_t * __restrict__ src,
        const int32_t * __restrict__ bounds, const int32_t * __restrict__ experts, const int32_t * __restrict__ zlist,
        C * __restrict__ y, int n_out, int k_in) {
    constexpr int TN = 8 * NT, B = 144, NTH = 32 * W;
    const int z = zlist ? zlist[blockIdx.z] : (int) blockIdx.z;
    const int row0 = bounds[z] + blockIdx.x * TN;
    const int nrows = min(TN, bounds[z + 1] - row0);
    if (nrows <= 0) {
        return;
    }
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int r0 = blockIdx.y * 16 * W + 16 * warp + g; // this lane's rows: r0 and r0 + 8

    extern __shared__ __align__(16) uint8_t smem[]; // xs[2][TN][XPD]
    __shared__ int src_row[TN];
    if (tid < TN) {
        src_row[tid] = tid < nrows ? (src ? src[row0 + tid] : row0 + tid) : -1;
    }
    __syncthreads();
    const uint8_t * wexp = w + (long long) experts[z] * expert_bytes;
    const uint8_t * wr[2] = {wexp + (long long) r0 * row_bytes, wexp + (long long) (r0 + 8) * row_bytes};

    auto load = [&](Q4kRows & r, int step) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint8_t * b = wr[h] + (long long) step * B;
            r.hdr[h] = __ldg((const uint4 *) b);
            r.q[h][0] = __ldg((const uint4 *) (b + 16 + 32 * t));
            r.q[h][1] = __ldg((const uint4 *) (b + 32 + 32 * t));
        }
    };
    auto stage = [&](int buf, int step) {
        for (int i = tid; i < nrows * (KS / 8); i += NTH) {
            const int rr = i / (KS / 8), c = i % (KS / 8);
            __pipeline_memcpy_async(smem + (buf * TN + rr) * XPD + 16 * granule_at(c),
                                    x + (long long) src_row[rr] * k_in + (long long) step * KS + 8 * c, 16);
        }
        __pipeline_commit();
    };

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[n][e] = 0.0f;
        }
    }
    const int steps = k_in / KS, live = (nrows + 7) / 8;
    Q4kRows cur, nxt;
    load(cur, 0);
    stage(0, 0);
    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        __pipeline_wait_prior(0);
        __syncthreads(); // the step's tokens have landed; everyone is done with the other buffer
        if (step + 1 < steps) {
            stage(buf ^ 1, step + 1);
            load(nxt, step + 1);
        }
        const uint8_t * xl = smem + buf * TN * XPD + g * XPD + 16 * 10 * t; // token g, granule 8t
        float sc[2][2], ad[2][2];
        if constexpr (H16) {
            direct_scales<true, true>(cur, t, sc, ad);
            direct_step_live<NT, C, true>(live, cur, sc, ad, xl, acc);
        } else if (__all_sync(0xFFFFFFFFu, direct_scales<true>(cur, t, sc, ad))) {
            direct_step_live<NT, C>(live, cur, sc, ad, xl, acc);
        } else {
            direct_scales<false>(cur, t, sc, ad);
            direct_step<NT, NT, false, C>(cur, sc, ad, xl, acc);
        }
        cur = nxt;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * n + 2 * t + (e & 1);
            if (col < nrows) {
                y[(long long) (row0 + col) * n_out + r0 + 8 * (e / 2)] = from_f32<C>(acc[n][e]);
            }
        }
    }
}

template <int NT, int W, typename C, bool H16>
int launch_direct(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
                  const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y, int n_out, int k_in,
                  int n_active, int max_rows, cudaStream_t stream) {
    const size_t shared = 2 * 8 * NT * XPD;
    auto kernel = glmcheck_dqmma_direct<NT, W, C, H16>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shared) != cudaSuccess) {
        return 3;
    }
    const dim3 grid((max_rows + 8 * NT - 1) / (8 * NT), n_out / (16 * W), n_active);
    kernel<<<grid, 32 * W, shared, stream>>>((const uint8_t *) w, expert_bytes, row_bytes, (const C *) x, src, bounds,
                                             experts, zlist, (C *) y, n_out, k_in);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

// The direct-load kernel with W warps at tile width tn (8, 16, 32; 0: by the busiest expert's rows).
template <int W, typename C, bool H16>
int launch_direct_tn(int tn, const void * w, long long expert_bytes, long long row_bytes, const void * x,
                     const int32_t * src, const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y,
                     int n_out, int k_in, int n_active, int max_rows, cudaStream_t stream) {
    if (tn == 0) {
        tn = max_rows <= 8 ? 8 : max_rows <= 16 ? 16 : 32;
    }
#define GLMCHECK_DIRECT(N) launch_direct<N, W, C, H16>(w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, n_out, \
                                                  k_in, n_active, max_rows, stream)
    switch (tn) {
        case 8: return GLMCHECK_DIRECT(1);
        case 16: return GLMCHECK_DIRECT(2);
        case 32: return GLMCHECK_DIRECT(4);
        default: return 2;
    }
#undef GLMCHECK_DIRECT
}

template <int T, int TN, typename C>
int launch(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
           const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y, int n_out, int k_in, int n_active,
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
        (const uint8_t *) w, expert_bytes, row_bytes, (const C *) x, src, bounds, experts, zlist, (C *) y, n_out, k_in);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <int T, typename C>
int launch_tn(const void * w, long long expert_bytes, long long row_bytes, const void * x, const int32_t * src,
              const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y, int n_out, int k_in, int n_active,
              int max_rows, cudaStream_t stream) {
    // Wider tiles decode an expert's weights fewer times but hold more shared memory (3 blocks an
    // SM instead of 4) and waste MMAs on padding: only when experts hold many rows. (At 256 tokens
    // of GLM-5, ~9 rows an expert and the busiest ~30: 16 wide.)
    return max_rows < 64
        ? launch<T, 16, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, n_out, k_in, n_active, max_rows, stream)
        : launch<T, 32, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, n_out, k_in, n_active, max_rows, stream);
}

// The register-decode kernel for the types it covers (Q4_K with the f16 decode where h16, the byte
// permutes otherwise; Q5_K, Q6_K, Q8_0), at tile width tn: launch_mma_tn's code, or -1 for a type
// it does not cover (the shared-memory kernel's).
template <typename C>
int launch_registers(int ggml_type, bool h16, bool aligned, int tn, const void * w, long long expert_bytes, long long row_bytes,
                     const void * x, const int32_t * src, const int32_t * bounds, const int32_t * experts, const int32_t * zlist,
                     void * y, int n_out, int k_in, int n_active, int max_rows, cudaStream_t stream) {
#define GLMCHECK_MMA(Q, A, H) launch_mma_tn<Q, A, C, H>(tn, w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, \
                                                        n_out, k_in, n_active, max_rows, stream)
    switch (ggml_type) {
        case Q4_K:
            if (h16) {
                return aligned ? GLMCHECK_MMA(Q4_K, true, true) : GLMCHECK_MMA(Q4_K, false, true);
            }
            return aligned ? GLMCHECK_MMA(Q4_K, true, false) : GLMCHECK_MMA(Q4_K, false, false);
        case Q5_K: return aligned ? GLMCHECK_MMA(Q5_K, true, false) : GLMCHECK_MMA(Q5_K, false, false);
        case Q6_K: return GLMCHECK_MMA(Q6_K, false, false);
        case Q8_0: return GLMCHECK_MMA(Q8_0, false, false);
        default: return -1;
    }
#undef GLMCHECK_MMA
}

template <typename C>
int launch_type(int ggml_type, int kernel, int tn, const void * w, long long expert_bytes, long long row_bytes,
                const void * x, const int32_t * src, const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y,
                int n_out, int k_in, int n_active, int max_rows, cudaStream_t stream) {
    // Rows on 16-byte boundaries (Q4_K's and Q5_K's blocks are 144 and 176 bytes): plain word loads.
    const bool aligned = (uintptr_t) w % 16 == 0 && expert_bytes % 16 == 0 && row_bytes % 16 == 0;
    // kernel 2 / 3: the direct-load kernel with 4 / 8 warps where it covers the stack (Q4_K, aligned
    // rows, whole blocks of rows), else the register-decode kernel.
    // kernel 4: the direct-load kernel (4 warps) with the f16 decode.
    if ((kernel >= 2 && kernel <= 4) && ggml_type == Q4_K && aligned && n_out % (kernel == 3 ? 128 : 64) == 0) {
        switch (kernel) {
            case 2: return launch_direct_tn<4, C, false>(tn, w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y,
                                                         n_out, k_in, n_active, max_rows, stream);
            case 3: return launch_direct_tn<8, C, false>(tn, w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y,
                                                         n_out, k_in, n_active, max_rows, stream);
            default: return launch_direct_tn<4, C, true>(tn, w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y,
                                                         n_out, k_in, n_active, max_rows, stream);
        }
    }
    // kernel 0 (and 2, 3, 4 where the direct-load kernel does not cover the stack): the register
    // kernel with the f16 decode for Q4_K, the default since 2026-12-07: the same bits as the byte
    // permutes, and on an H100 at 256 tokens of the 3-layer synth its 16-wide Q4_K launches took
    // 2799 / 2787 µs against 3059 / 3045 (two calls), the 32-wide 1109 / 1113 against 1119 / 1118
    // (reports/gpu-moe.md, build Z): the ALU pipe was the hot one (Nsight Compute: 63 % ALU,
    // math-pipe throttle the second stall reason) and the f16 decode moves its work to the FMA
    // pipe. For Q6_K (a 6-bit q assembled from two places) it compiled to more integer work than
    // the permutes. Kernel 5: the byte permutes for Q4_K too (the earlier default, kept to compare).
    if (kernel != 1) {
        const int r = launch_registers<C>(ggml_type, kernel != 5, aligned, tn, w, expert_bytes, row_bytes, x, src, bounds,
                                          experts, zlist, y, n_out, k_in, n_active, max_rows, stream);
        if (r >= 0) {
            return r;
        }
    }
#define GLMCHECK_DQMM(Q) case Q: return launch_tn<Q, C>(w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y, \
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
// shape the tiling does not cover (n_out % 64, k_in % 256, an empty or too large grid, a tile width
// not 0, 8, 16 or 32) or a kernel code outside 0..5; 3: CUDA refused the launch. x: [*, k_in]
// contiguous rows of the compute dtype (16-byte aligned rows); src: the x row of each grouped row
// (null: grouped row j is x's row j);
// zlist: the active experts (indices into bounds/experts) this launch covers, n_active of them
// (null: all, in order: one launch per tile width, the busy experts in a wider one);
// y: [rows, n_out]. kernel 0: the register-decode kernel where it covers the type (Q4_K, Q5_K,
// Q6_K, Q8_0; tn its tile width, 0 by the busiest expert), else and for kernel 1 the
// shared-memory kernel glmcheck_dqmm; kernels 2 and 3: the direct-load kernel (4 and 8 warps a
// block) for Q4_K stacks on 16-byte aligned rows, the register-decode kernel for the rest; kernel 4:
// kernel 2 with the f16 decode of Q4_K. The register kernel decodes Q4_K with the f16 decode
// (H16) except for kernel 5, which keeps the byte permutes of the one-FMA decode for every type.
extern "C" int glmcheck_dequant_matmul(
        int ggml_type, int dtype, int kernel, int tn, const void * w, long long expert_bytes, long long row_bytes,
        const void * x, const int32_t * src, const int32_t * bounds, const int32_t * experts, const int32_t * zlist, void * y,
        int n_out, int k_in, int n_active, int max_rows, void * stream) {
    if (n_out % BM != 0 || k_in % KS != 0 || n_active <= 0 || n_active > 65535 || max_rows <= 0
        || (max_rows + 7) / 8 > 65535 || n_out / BM > 65535 || kernel < 0 || kernel > 5) {
        return 2;
    }
    const cudaStream_t s = (cudaStream_t) stream;
    switch (dtype) {
        case 1: return launch_type<half>(ggml_type, kernel, tn, w, expert_bytes, row_bytes, x, src, bounds, experts, zlist, y,
                                         n_out, k_in, n_active, max_rows, s);
        case 2: return launch_type<__nv_bfloat16>(ggml_type, kernel, tn, w, expert_bytes, row_bytes, x, src, bounds,
                                                  experts, zlist, y, n_out, k_in, n_active, max_rows, s);
        default: return 1;
    }
}

// ---- Whole tensors decoded into device memory with the same decoders ------------------------------
// A warp takes 32 consecutive 32-value sub-blocks (four 256-value groups) at a time: their bytes go
// through its registers into shared memory as aligned words (coalesced; never a word past the
// tensor's last byte), each lane decodes one sub-block into a staging tile, and the warp writes the
// 1024 values out contiguously.

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

// The grid's resident warps loop over the batches g0, g0 + stride, ... (stride: the grid's warps ×
// 4 groups), each batch's words loaded into registers before the previous one is decoded, so a
// warp's global loads overlap its decoding. Against one warp per batch that loaded, decoded and
// exited (until 2026-12-06): the same bits, and on an H200 lm_head's Q6_K decode 1274 → 841 µs,
// Q4_K 499 → 380, Q5_K 386 → 283 at 256 tokens of the 3-layer synth (reports/gpu-moe.md, build V).
template <int T, typename O>
__global__ void __launch_bounds__(32 * DW) glmcheck_decode_loop_k(const uint8_t * __restrict__ x,
                                                                    O * __restrict__ y, long long n_groups) {
    constexpr int B = bytes_256(T), RAW = (4 * B + 4 + 3) / 4 + 4; // words: 4 groups + misalignment + slack
    constexpr int LW = (RAW + 31) / 32;                             // words per lane
    constexpr int PITCH = 36;                                       // floats per staged sub-block
    __shared__ uint32_t raw[DW][RAW];
    __shared__ __align__(16) float st[DW][32 * PITCH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long stride = (long long) gridDim.x * DW * 4;
    long long g0 = ((long long) blockIdx.x * DW + warp) * 4; // first 256-value group
    if (g0 >= n_groups) {
        return;
    }
    // The words of batch g (from the 4-byte boundary below its first byte; never a word past the
    // tensor's last byte) into the lane's registers.
    uint32_t words[LW] = {};
    auto load = [&](long long g) {
        const int groups = (int) min(4LL, n_groups - g);
        const uintptr_t start = (uintptr_t) (x + g * B), end = start + (uintptr_t) groups * B;
        const uint32_t * w0 = (const uint32_t *) (start & ~(uintptr_t) 3);
        const int n = (int) (((end + 3) & ~(uintptr_t) 3) - (uintptr_t) w0) / 4;
#pragma unroll
        for (int j = 0; j < LW; ++j) {
            const int i = lane + 32 * j;
            if (i < n) {
                words[j] = w0[i];
            }
        }
    };
    load(g0);
    for (; g0 < n_groups; g0 += stride) {
        const int groups = (int) min(4LL, n_groups - g0);
        const uintptr_t start = (uintptr_t) (x + g0 * B);
        __syncwarp(); // the previous batch's reads of raw and st are done
#pragma unroll
        for (int j = 0; j < LW; ++j) {
            const int i = lane + 32 * j;
            if (i < RAW) {
                raw[warp][i] = words[j];
            }
        }
        __syncwarp();
        if (g0 + stride < n_groups) {
            load(g0 + stride);
        }
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
}

// Blocks of the loop kernel: as many as the device holds at once (max_blocks = 0), or at most
// max_blocks (tests make warps loop on small tensors); fewer when there are fewer batches.
template <int T, typename O> long long decode_blocks(long long n_groups, int max_blocks) {
    const long long all = (n_groups + 4 * DW - 1) / (4 * DW);
    if (max_blocks > 0) {
        return min(all, (long long) max_blocks);
    }
    // Blocks each device holds at once (per type and output, cached per device id; threads that race
    // write the same value). Where CUDA cannot say, one block per batch, with its error cleared so
    // that the launch's own check does not read it.
    static int resident[16] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return all;
    }
    int r = dev >= 0 && dev < 16 ? resident[dev] : 0;
    if (r == 0) {
        int sms = 0, per_sm = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess
            || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, glmcheck_decode_loop_k<T, O>, 32 * DW, 0)
                   != cudaSuccess
            || sms <= 0 || per_sm <= 0) {
            cudaGetLastError();
            return all;
        }
        r = sms * per_sm;
        if (dev >= 0 && dev < 16) {
            resident[dev] = r;
        }
    }
    return min(all, (long long) r);
}

// One launch of the loop kernel decoding into y's type.
template <int T, typename O>
int decode_into(const void * x, O * y, long long n_groups, int max_blocks, cudaStream_t s) {
    const long long blocks = decode_blocks<T, O>(n_groups, max_blocks);
    if (blocks > 0x7fffffffLL) {
        return 2;
    }
    glmcheck_decode_loop_k<T, O><<<(unsigned) blocks, 32 * DW, 0, s>>>((const uint8_t *) x, y, n_groups);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <int T>
int decode_whole(int dtype, const void * x, void * y, long long n_groups, int max_blocks, cudaStream_t s) {
    switch (dtype) {
        case 0: return decode_into<T>(x, (float *) y, n_groups, max_blocks, s);
        case 1: return decode_into<T>(x, (half *) y, n_groups, max_blocks, s);
        case 2: return decode_into<T>(x, (__nv_bfloat16 *) y, n_groups, max_blocks, s);
        default: return 1;
    }
}

} // namespace

// n_values (a multiple of 256) of a tensor of `ggml_type` blocks at x, decoded into y: dtype 0 f32,
// 1 f16, 2 bf16; max_blocks 0: on as many blocks as the device holds at once, N > 0: on at most N.
// Returns 0 when launched; 1: no kernel for the type or dtype; 2: a shape it does not take (or
// max_blocks < 0); 3: CUDA refused the launch.
extern "C" int glmcheck_decode_whole(int ggml_type, int dtype, const void * x, void * y, long long n_values,
                                     int max_blocks, void * stream) {
    if (n_values <= 0 || n_values % 256 != 0 || max_blocks < 0) {
        return 2;
    }
    const long long g = n_values / 256;
    const cudaStream_t s = (cudaStream_t) stream;
    switch (ggml_type) {
        case Q4_0: return decode_whole<Q4_0>(dtype, x, y, g, max_blocks, s);
        case Q5_0: return decode_whole<Q5_0>(dtype, x, y, g, max_blocks, s);
        case Q8_0: return decode_whole<Q8_0>(dtype, x, y, g, max_blocks, s);
        case Q4_K: return decode_whole<Q4_K>(dtype, x, y, g, max_blocks, s);
        case Q5_K: return decode_whole<Q5_K>(dtype, x, y, g, max_blocks, s);
        case Q6_K: return decode_whole<Q6_K>(dtype, x, y, g, max_blocks, s);
        default: return 1;
    }
}
