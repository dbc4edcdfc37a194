// q8 mode's routed experts with integer tensor cores: every expert that has tokens multiplies its
// GGUF blocks by its tokens' Q8_1 activations (candle-kernels' quantize_mmq_q8_1, llama.cpp's MMQ
// layout) with mma.sync int8 tiles, the weights' integers taken straight from the raw blocks.
//
// Same arithmetic as llama.cpp's MMQ (cuda/moe_mmq.cu runs it as vendored in candle-kernels): the
// integer dot products of each 32-value (Q6_K: 16-value) sub-block are exact, then scaled in f32
// with llama.cpp's expressions: Q4_K `d·sc` and `dmin·m` rounded to half as its load_tiles_q4_K
// does, `+= (d·sc)·d8·dot + (−dmin·m)·Σx`; Q6_K `+= dot·sc·d·d8`; Q8_0 `+= dot·d·d8`. On an H200
// the outputs equal MMQ's bit for bit for Q4_K and Q8_0 and to rel-L2 1.2e-7 for Q6_K (f32
// summation order; src/model/moe_cuda_tests.rs).
//
// Each lane builds its MMA fragments straight from the raw blocks in shared memory (Q4_K: one shift
// and one AND per 4 weights) where MMQ first decodes a tile to int8 in shared memory. Measured on
// an H200 (3-layer GLM-5 Q4_K_M synth, q8, bf16, both in one call): the forward takes 5.9 ms at 16
// tokens against 6.8–7.0 with MMQ, and the same at 256 tokens (the six expert launches 7.5 ms
// against MMQ's 7.4 under ncu). ncu of a first version found it issue-bound (81 % of issue slots:
// scale conversions and per-output scaling); moving the scales into the per-step pass below did not
// change the time, and a third pipeline stage made it slower (8.1 ms: fewer blocks per SM).
// Skipping a tile's empty 8-token groups brought the six launches to 7.3 ms (MMQ 7.5; build H2).
// At 256 tokens it is bound by issuing instructions, not by memory (reports/gpu-moe.md), so the
// k loop carries as few as it can: the MMAs accumulate onto the float 1.5·2^23 (the integer
// result read back as a float minus that constant: no int→float conversion per output), a step's
// row scales are decoded four at a time from their packed words (one row half per thread), and
// the staging copies' addresses are computed once before the loop. Same arithmetic, same output
// bit for bit (build M, on an H100: every module of the 16- and 256-token forwards, max |diff| 0);
// the six expert launches of one 256-token forward 7.36 → 5.35 ms under ncu, the forward 18.3 →
// 16.5 ms (best of 5, three interleaved rounds).
//
// Tiling: a CUDA block owns 64 weight rows of one expert and TN = 8·NT of its tokens (8, 16 or 32;
// 64 and 128 for q8's dense route past 16 tokens)
// and walks k in steps of 256 (one K-quant super-block): the next step's raw blocks and activation
// blocks are copied asynchronously (cp.async) while the current one is multiplied. Each of the 4
// warps owns 16 rows: per 32 values it runs one m16n8k32 MMA per 8 of the tile's tokens that exist
// (Q6_K: two m16n8k16, one per scale). A dense weight runs as a one-expert stack
// (src/model/q8_cuda.rs).
//
// Built by build.rs with `--features cuda`; declared in src/model/q8_cuda.rs.

#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <stdint.h>

#include "gguf_blocks.cuh"

namespace {

constexpr int BM = 64;          // weight rows per block
constexpr int KS = 256;         // k per step
constexpr int THREADS = 128;    // 4 warps, 16 weight rows each
constexpr int Q8B = 144;        // sizeof(block_q8_1_mmq): 16 bytes of scales, then 128 int8 values
constexpr int XP = 2 * Q8B + 16; // one token's two activation blocks of a step (76 words: conflict-free)

// The MMAs accumulate onto MAGIC, the bits of the float 1.5·2^23: an integer sum |c| < 2^22 comes
// out as the bits of 1.5·2^23 + c, and f32(c) is one subtraction (`dot`), without the conversion
// unit (a quarter of the FP32 rate on sm_90) or an integer add per output.
constexpr int MAGIC = 0x4B400000;
__device__ __forceinline__ float dot(int c) { return __int_as_float(c) - 12582912.0f; }

// c = MAGIC + A(16×32, row) · B(32×8, col), A unsigned (UA) or signed bytes, B signed bytes.
template <bool UA>
__device__ __forceinline__ void mma_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (UA) {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%10, %10, %10, %10};\n"
                     : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(MAGIC));
    } else {
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%10, %10, %10, %10};\n"
                     : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(MAGIC));
    }
}

// c = MAGIC + A(16×16, row, signed) · B(16×8, col, signed).
__device__ __forceinline__ void mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %7, %7, %7};\n"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(MAGIC));
}

// The per-row scales of a step, floats per row: Q4_K (d·sc, −dmin·m) per 32-value sub-block (16),
// Q6_K d·sc per 16 values (16), Q8_0 d per 32 (8); +2 so that the 8 rows of a fragment spread over
// the banks.
template <int T> __host__ __device__ constexpr int row_scales() { return (T == Q8_0 ? 8 : 16) + 2; }
// The per-token scales of a step: (d8, Σx) per 32 values (Σx only in the DS4 layout of Q4_K), +2.
constexpr int XSC = 16 + 2;

// A step's scales into shared memory, by the whole block: rows' from their raw blocks `blk(r)`,
// tokens' from their activation blocks at xb + c·XP (block kb at + kb·Q8B, its scales first). The
// row scales are llama.cpp's values: Q4_K's load_tiles_q4_K rounds (d, −dmin)·(sc, m) to half;
// Q6_K's d·sc is exact in f32, and (dot·sc)·d in f32 rounds the same exact product once as
// dot·(d·sc) does (|dot·sc| < 2^24).
// Thread tid takes row tid % 64's sub-blocks of half tid / 64 (warp-uniform): Q4_K's four 6-bit
// scales and mins of a half come out of the packed words four at a time (ggml's
// get_scale_min_k4, bytewise).
template <int T, bool ALIGNED, typename Blk>
__device__ __forceinline__ void step_scales(Blk blk, const uint8_t * xb, float * rsc, float * xsc, int tid, int ncols) {
    static_assert(THREADS == 2 * BM, "one thread per row and half");
    constexpr int RS = row_scales<T>();
    const int r = tid % BM, h = tid / BM;
    const uint8_t * b = blk(r);
    float * out = rsc + r * RS;
    if constexpr (T == Q4_K) {
        const uint32_t w = ld_word<ALIGNED>(b), w0 = ld_word<ALIGNED>(b + 4), w1 = ld_word<ALIGNED>(b + 8),
                       w2 = ld_word<ALIGNED>(b + 12);
        const half2 dm = __halves2half2(__ushort_as_half((unsigned short) (w & 0xFFFF)),
                                        __ushort_as_half((unsigned short) (w >> 16)))
                       * make_half2(1.0f, -1.0f); // (d, −dmin)
        // Sub-blocks j < 4: sc = q[j] & 63, m = q[j + 4] & 63; j ≥ 4: sc = q[j + 4] & 15 with q[j − 4]'s
        // top two bits above, m = q[j + 4] >> 4 with q[j]'s top two bits above.
        const uint32_t sc = h == 0 ? w0 & 0x3F3F3F3Fu : (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
        const uint32_t m = h == 0 ? w1 & 0x3F3F3F3Fu : ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(dm * make_half2((float) ((sc >> 8 * i) & 0xFF), (float) ((m >> 8 * i) & 0xFF)));
            *(float2 *) (out + 2 * (4 * h + i)) = f;
        }
    } else if constexpr (T == Q6_K) {
        const float d = h2f(b + 208);
        const uint32_t s0 = word(b + 192 + 8 * h), s1 = word(b + 196 + 8 * h);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            out[8 * h + i] = d * (int) (int8_t) (((i < 4 ? s0 : s1) >> 8 * (i % 4)) & 0xFF);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[4 * h + i] = h2f(b + 34 * (4 * h + i));
        }
    }
    for (int i = tid; i < ncols * 8; i += THREADS) {
        const int c = i / 8, s = i % 8;
        const uint8_t * q = xb + c * XP + (s / 4) * Q8B;
        float2 f;
        if constexpr (T == Q4_K) {
            f = __half22float2(((const half2 *) q)[s % 4]);
        } else {
            f = make_float2(((const float *) q)[s % 4], 0.0f);
        }
        *(float2 *) (xsc + c * XSC + 2 * s) = f;
    }
}

// One 256-value step of one warp: `b[h]` the raw blocks of the lane's rows g + 8h (`rs[h]` their
// scales), `xb` the step's activation blocks (token c at xb + c·XP: block kb at + kb·Q8B, its scales
// first, then 128 int8), `xsc` the tokens' scales.
// acc[n][e]: row g + 8·(e / 2), token 8n + 2t + e % 2 (the m16n8 accumulator layout). Only the
// first `live` groups of 8 tokens hold tokens: the others are skipped (a block-uniform branch).
// A copy without the branch for full tiles (ab22e86) took more registers (128-token tiles: Q4_K
// 128 → 221, Q8_0 137 → 166) and ran slower on an H100 (kv_a_proj_with_mqa's split-K launch 27 →
// 36 µs, the indexer's wk 16 → 27): not kept.
template <int T, int NT, bool ALIGNED>
__device__ __forceinline__ void step_dot(const uint8_t * const (&b)[2], const float * const (&rs)[2],
                                         const uint8_t * xb, const float * xsc, int g, int t, int live,
                                         float (&acc)[NT][4]) {
    // This lane's B fragment (token g of tile n, 4 values) and its tokens' scales (2t, 2t + 1).
    auto bq = [&](int n, int kb, int off) { return *(const uint32_t *) (xb + (8 * n + g) * XP + kb * Q8B + 16 + off); };
    auto xs2 = [&](int n, int e, int s) { return *(const float2 *) (xsc + (8 * n + 2 * t + e) * XSC + 2 * s); };
    if constexpr (T == Q4_K) {
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
            const int o = 16 + 32 * pair + 4 * t;
            const uint32_t w00 = ld_word<ALIGNED>(b[0] + o), w01 = ld_word<ALIGNED>(b[0] + o + 16);
            const uint32_t w10 = ld_word<ALIGNED>(b[1] + o), w11 = ld_word<ALIGNED>(b[1] + o + 16);
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int s = 2 * pair + hi, sh = 4 * hi, kb = s / 4, i = s % 4;
                const uint32_t a[4] = {(w00 >> sh) & 0x0F0F0F0Fu, (w10 >> sh) & 0x0F0F0F0Fu,
                                       (w01 >> sh) & 0x0F0F0F0Fu, (w11 >> sh) & 0x0F0F0F0Fu};
                const float2 f[2] = {*(const float2 *) (rs[0] + 2 * s), *(const float2 *) (rs[1] + 2 * s)};
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    if (n >= live) {
                        break;
                    }
                    int c[4];
                    mma_k32<true>(c, a, bq(n, kb, 32 * i + 4 * t), bq(n, kb, 32 * i + 16 + 4 * t));
                    const float2 d8[2] = {xs2(n, 0, s), xs2(n, 1, s)};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        // llama.cpp: sum += dmA.x·dsB.x·C; sum += dmA.y·dsB.y
                        acc[n][e] += f[e / 2].x * d8[e & 1].x * dot(c[e]);
                        acc[n][e] += f[e / 2].y * d8[e & 1].y;
                    }
                }
            }
        }
    } else if constexpr (T == Q6_K) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int ip = s / 4, jj = s % 4, lsh = (jj >> 1) * 4, hsh = 2 * jj;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int o = 16 * hh + 4 * t;
                uint32_t a[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t q = word(b[h] + 64 * ip + 32 * (jj & 1) + o), hb = word(b[h] + 128 + 32 * ip + o);
                    a[h] = __vsub4(((q >> lsh) & 0x0F0F0F0Fu) | (((hb >> hsh) & 0x03030303u) << 4), 0x20202020u);
                }
                const float sd[2] = {rs[0][2 * s + hh], rs[1][2 * s + hh]};
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    if (n >= live) {
                        break;
                    }
                    int c[4];
                    mma_k16(c, a[0], a[1], bq(n, ip, 32 * jj + o));
                    const float d8[2] = {xs2(n, 0, s).x, xs2(n, 1, s).x};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        // llama.cpp: sum += C·sc·d·dB
                        acc[n][e] += dot(c[e]) * sd[e / 2] * d8[e & 1];
                    }
                }
            }
        }
    } else if constexpr (T == Q8_0) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int kb = s / 4, i = s % 4;
            const uint8_t * x0 = b[0] + 34 * s, * x1 = b[1] + 34 * s;
            const uint32_t a[4] = {word(x0 + 2 + 4 * t), word(x1 + 2 + 4 * t), word(x0 + 18 + 4 * t),
                                   word(x1 + 18 + 4 * t)};
            const float d[2] = {rs[0][s], rs[1][s]};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                if (n >= live) {
                    break;
                }
                int c[4];
                mma_k32<false>(c, a, bq(n, kb, 32 * i + 4 * t), bq(n, kb, 32 * i + 16 + 4 * t));
                const float d8[2] = {xs2(n, 0, s).x, xs2(n, 1, s).x};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // llama.cpp: sum += C·dA·dB
                    acc[n][e] += dot(c[e]) * d[e / 2] * d8[e & 1];
                }
            }
        }
    }
}

// dst[ids_dst[j]] = W[experts[z]] · y_j for the grouped columns j of active expert z
// (bounds[z]..bounds[z+1]). W: [E, n_out, k_in] blocks, row_bytes per row, expert_bytes per expert;
// y: block_q8_1_mmq, block (kb, j) at (kb·ncols_y + j)·144; dst: f32 [.., n_out].
// Grid: (column tiles of 8·NT, n_out / 64, active experts · splits): the column tiles of one row
// block are neighbours in launch order, so a dense weight run with several column tiles (q8's
// wide dense route) is read from DRAM once and from L2 by the others. With splits > 1 (split-K, for
// grids too small to fill the GPU) split sp sums its share of the k steps into
// partial[sp][ncols_y][n_out] instead of dst; glmcheck_splitk_sum adds the splits in order.
template <int T, int NT, bool ALIGNED>
__global__ void __launch_bounds__(THREADS) glmcheck_q8mm(
        const uint8_t * __restrict__ w, long long expert_bytes, long long row_bytes,
        const uint8_t * __restrict__ y, int ncols_y, const int32_t * __restrict__ ids_dst,
        const int32_t * __restrict__ bounds, const int32_t * __restrict__ experts,
        float * __restrict__ dst, int n_out, int k_in, int splits, float * __restrict__ partial) {
    constexpr int TN = 8 * NT, B = bytes_256(T), CH = raw_chunks(T), P = raw_pitch(T);
    const int z = blockIdx.z / splits, sp = blockIdx.z % splits;
    const int col0 = bounds[z] + blockIdx.x * TN;
    const int ncols = min(TN, bounds[z + 1] - col0);
    // This block's k steps: all of them, or split sp's share.
    const int all_steps = k_in / KS, per = (all_steps + splits - 1) / splits;
    const int s0 = sp * per, s1 = min(all_steps, s0 + per);
    if (ncols <= 0 || s0 >= s1) {
        return;
    }
    const int n0 = blockIdx.y * BM;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

    // Shared memory: raw[2][BM][P] | xs[2][TN][XP].
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t * raw = smem;
    uint8_t * xs = smem + 2 * BM * P;
    __shared__ int out_row[TN];
    if (tid < TN) {
        out_row[tid] = tid < ncols ? ids_dst[col0 + tid] : -1;
    }
    const uint8_t * wexp = w + (long long) experts[z] * expert_bytes + (long long) n0 * row_bytes;

    // The staging copies (16 bytes each), their per-thread parts hoisted out of the k loop: weight
    // chunks tid % 16 (+ 16) of rows tid / 16 + 8j; activation chunk `lane` (< 18: chunk lane % 9
    // of the step's block lane / 9) of tokens warp + 4j.
    const uint8_t * wrow = wexp + (long long) (tid / 16) * row_bytes;
    const long long wstride = (THREADS / 16) * row_bytes;
    const long long y_lane = (long long) (lane / 9) * ncols_y * Q8B + 16 * (lane % 9);
    auto stage = [&](int buf, int step) {
        const uint8_t * src = wrow + (long long) step * B;
        uint8_t * dst = raw + (buf * BM + tid / 16) * P;
#pragma unroll
        for (int j = 0; j < BM / (THREADS / 16); ++j, src += wstride) {
            const uintptr_t off = (uintptr_t) src;
            const int mis = ALIGNED ? 0 : (int) (off & 15);
#pragma unroll
            for (int c0 = 0; c0 < CH; c0 += 16) {
                const int c = c0 + tid % 16;
                if (c < CH && 16 * c < mis + B) {
                    __pipeline_memcpy_async(dst + j * (THREADS / 16) * P + 16 * c, (const void *) (off - mis + 16 * c), 16);
                }
            }
        }
        // Each token's two 128-value blocks of this step; columns past the expert's tokens are left
        // as they are (their products are never written).
        if (lane < 18) {
            const uint8_t * ys = y + ((long long) 2 * step * ncols_y + col0) * Q8B + y_lane;
            for (int c = warp; c < ncols; c += THREADS / 32) {
                __pipeline_memcpy_async(xs + (buf * TN + c) * XP + 16 * lane, ys + (long long) c * Q8B, 16);
            }
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
    constexpr int RS = row_scales<T>();
    __shared__ __align__(8) float rsc[BM * RS];
    __shared__ __align__(8) float xsc[TN * XSC];
    stage(0, s0);
    for (int step = s0; step < s1; ++step) {
        const int buf = (step - s0) & 1;
        // Row r's blocks of this step in shared memory (the misalignment of a step's blocks moves
        // when their size is not a multiple of 16, Q6_K's).
        auto blk = [&](int r) {
            const int mis = ALIGNED ? 0 : (int) ((uintptr_t) (wexp + r * row_bytes + (long long) step * B) & 15);
            return raw + (buf * BM + r) * P + mis;
        };
        __pipeline_wait_prior(0);
        // Everyone's copies of this step have landed, and everyone is done with the other buffer
        // and with the previous step's scales.
        __syncthreads();
        step_scales<T, ALIGNED>(blk, xs + buf * TN * XP, rsc, xsc, tid, ncols);
        __syncthreads();
        if (step + 1 < s1) {
            stage(buf ^ 1, step + 1);
        }
        const uint8_t * b[2] = {blk(r0), blk(r0 + 8)};
        const float * rs[2] = {rsc + r0 * RS, rsc + (r0 + 8) * RS};
        step_dot<T, NT, ALIGNED>(b, rs, xs + buf * TN * XP, xsc, g, t, (ncols + 7) / 8, acc);
    }
    float * out = splits > 1 ? partial + (long long) sp * ncols_y * n_out : dst;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * n + 2 * t + (e & 1);
            if (col < ncols) {
                out[(long long) out_row[col] * n_out + n0 + r0 + 8 * (e / 2)] = acc[n][e];
            }
        }
    }
}

// dst[i] = Σ_sp partial[sp][i], splits in order (deterministic).
__global__ void glmcheck_splitk_sum(const float * __restrict__ partial, float * __restrict__ dst, long long n,
                                    int splits) {
    const long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float s = partial[i];
    for (int sp = 1; sp < splits; ++sp) {
        s += partial[(long long) sp * n + i];
    }
    dst[i] = s;
}

template <int T, int NT, bool ALIGNED>
int launch(const void * w, long long expert_bytes, long long row_bytes, const void * y, int ncols_y,
           const int32_t * ids_dst, const int32_t * bounds, const int32_t * experts, float * dst, int n_out,
           int k_in, int n_active, int max_cols, int splits, float * partial, cudaStream_t stream) {
    const size_t shared = 2 * (BM * raw_pitch(T) + 8 * NT * XP);
    auto kernel = glmcheck_q8mm<T, NT, ALIGNED>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shared) != cudaSuccess
        || cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
        return 3;
    }
    const dim3 grid((max_cols + 8 * NT - 1) / (8 * NT), n_out / BM, n_active * splits);
    kernel<<<grid, THREADS, shared, stream>>>((const uint8_t *) w, expert_bytes, row_bytes, (const uint8_t *) y,
                                              ncols_y, ids_dst, bounds, experts, dst, n_out, k_in, splits, partial);
    if (splits > 1) {
        const long long n = (long long) ncols_y * n_out;
        glmcheck_splitk_sum<<<(unsigned) ((n + 255) / 256), 256, 0, stream>>>(partial, dst, n, splits);
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <int T, bool ALIGNED>
int launch_tn(int tn, const void * w, long long expert_bytes, long long row_bytes, const void * y, int ncols_y,
              const int32_t * ids_dst, const int32_t * bounds, const int32_t * experts, float * dst, int n_out,
              int k_in, int n_active, int max_cols, int splits, float * partial, cudaStream_t stream) {
#define GLMCHECK_TN(N) launch<T, N, ALIGNED>(w, expert_bytes, row_bytes, y, ncols_y, ids_dst, bounds, experts, dst, \
                                            n_out, k_in, n_active, max_cols, splits, partial, stream)
    switch (tn) {
        case 8: return GLMCHECK_TN(1);
        case 16: return GLMCHECK_TN(2);
        case 32: return GLMCHECK_TN(4);
        case 64: return GLMCHECK_TN(8);
        case 128: return GLMCHECK_TN(16);
        default: return 2;
    }
#undef GLMCHECK_TN
}

} // namespace

// Whether glmcheck_q8_moe has a kernel for this ggml type: 1 or 0.
extern "C" int glmcheck_q8_moe_type(int ggml_type) {
    return ggml_type == Q4_K || ggml_type == Q6_K || ggml_type == Q8_0;
}

// Returns 0 when launched, 1 for a type without a kernel, 2 for a shape or tile width it does not
// take (n_out % 64, more than 65535 row blocks, k_in % 256, tn not 8, 16, 32, 64 or 128, splits < 1
// or more than k_in / 256, splits > 1 without a partial buffer), 3 for a CUDA error. tn: tokens per
// tile (64 and 128: q8's dense route past 16 tokens; the experts take at most 32, see
// src/model/q8_cuda.rs). splits > 1: split-K, partial holds splits · ncols_y · n_out floats.
extern "C" int glmcheck_q8_moe(int ggml_type, int tn, const void * w, long long expert_bytes, long long row_bytes,
                               const void * y, int ncols_y, const int32_t * ids_dst, const int32_t * bounds,
                               const int32_t * experts, float * dst, int n_out, int k_in, int n_active,
                               int max_cols, int splits, float * partial, void * stream) {
    if (n_out % BM != 0 || n_out / BM > 65535 || k_in % KS != 0 || n_active <= 0 || max_cols <= 0 || splits < 1
        || splits > k_in / KS || (splits > 1 && partial == nullptr) || (long long) n_active * splits > 65535) {
        return 2;
    }
    // Every split gets steps (5 ways over 6 steps would leave the last two empty, their partial
    // sums unwritten): as many splits as shares of ceil(steps / splits).
    const int per = (k_in / KS + splits - 1) / splits;
    splits = (k_in / KS + per - 1) / per;
    const cudaStream_t s = (cudaStream_t) stream;
    // Q4_K's blocks are 144 bytes: word loads need no funnel shift when every row starts on 16 bytes.
    const bool aligned = (uintptr_t) w % 16 == 0 && expert_bytes % 16 == 0 && row_bytes % 16 == 0;
    switch (ggml_type) {
        case Q4_K:
            return aligned ? launch_tn<Q4_K, true>(tn, w, expert_bytes, row_bytes, y, ncols_y, ids_dst, bounds, experts,
                                                   dst, n_out, k_in, n_active, max_cols, splits, partial, s)
                           : launch_tn<Q4_K, false>(tn, w, expert_bytes, row_bytes, y, ncols_y, ids_dst, bounds,
                                                    experts, dst, n_out, k_in, n_active, max_cols, splits, partial, s);
        case Q6_K:
            return launch_tn<Q6_K, false>(tn, w, expert_bytes, row_bytes, y, ncols_y, ids_dst, bounds, experts, dst,
                                          n_out, k_in, n_active, max_cols, splits, partial, s);
        case Q8_0:
            return launch_tn<Q8_0, false>(tn, w, expert_bytes, row_bytes, y, ncols_y, ids_dst, bounds, experts, dst,
                                          n_out, k_in, n_active, max_cols, splits, partial, s);
        default:
            return 1;
    }
}
