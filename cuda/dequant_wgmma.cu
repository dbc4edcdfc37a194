// Dequant mode's dense matmuls of many tokens (y = x · Wᵀ, W a GGUF's quantized [n_out, k_in]) on
// Hopper's warpgroup MMA (wgmma, sm_90a): the weights decoded into registers and multiplied
// there, never written out, with each decoded value used for WN (64 or 128) tokens at once.
//
// Why: past 32 tokens the register kernel (cuda/dequant_gemm.cu) is not the default for a dense
// weight, since each 32-token tile decodes the weight again; the default decodes the whole weight
// into device memory and multiplies it with cuBLAS, and on an H100 at 256 tokens of the 3-layer
// GLM-5 those decodes alone are 1.77 ms of the forward's 9.2 ms of kernels (the lm_head: 1018 µs
// of decode beside 776 µs of GEMM; reports/gpu-moe.md build AE). A wgmma takes A from registers:
// each warp's 16 rows come straight from dq_decode (cuda/dq_decode.cuh), the register kernel's
// arithmetic and values, so the products are decode32's values rounded once to the compute dtype,
// summed in f32 (in another order than cuBLAS' or the register kernel's: equal to rounding).
//
// Layout. A block is WGS warpgroups (1 or 2) of 4 warps; warpgroup wg owns the 64 weight rows
// 64·(WGS·blockIdx.y + wg)..+64, the block WN tokens from WN·blockIdx.x (the token tiles of the
// same rows run side by side and read the weights through L2 once). It walks k in steps of
// 256 (one K-quant super-block), double buffered with cp.async: the step's raw blocks of its rows
// (as the register kernel stages them) and the step's activations, WN × 256 values, which
// glmcheck_wg_tiles has already laid out in global memory as wgmma's K-major core matrices (8
// tokens × 8 values, 128 contiguous bytes; LBO 128 bytes between the two k-halves of a 16-value
// chunk, SBO 4096 between groups of 8 tokens) with the register kernel's permuted k order inside
// each 16-value chunk (logical k 2t, 2t+1, 2t+8, 2t+9 are physical 4t..4t+3: core matrix 0 of a
// chunk holds its even words, core matrix 1 its odd ones), so that a stage is one contiguous copy
// and the A fragments need no shuffle. A step's 16 chunks go as four groups of 4 wgmmas
// (m64nWNk16): each quarter decoded while the quarters before it run (wg_step).
//
// Built by build.rs with `-gencode arch=compute_90a,code=sm_90a` (and -DGLMCHECK_WGMMA) when
// CUDA_COMPUTE_CAP is 90; for another GPU the launcher answers "no kernel" (1) and glmcheck keeps
// decode-then-GEMM. Declared in src/model/wgmma_cuda.rs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#include <atomic>
#include <stdint.h>
#include <type_traits>

#include "dq_decode.cuh"
#include "gguf_blocks.cuh"

namespace {

constexpr int CM = 128;                  // bytes of one core matrix: 8 tokens × 8 values
constexpr int K8 = KS / 8;               // core matrices along k in a step (32)
constexpr int GROUP_BYTES = K8 * CM;     // a step's 8 tokens: 4096 bytes (the SBO)

__host__ __device__ constexpr int wg_stage_bytes(int wn) { return wn * KS * 2; }

// The shared memory of a block: activations [2][WN tokens × 256] | raw blocks [2][64·WGS][P] |
// row scales [64·WGS][RS] floats.
template <int T> constexpr int wg_shared_bytes(int wn, int wgs) {
    return 2 * wg_stage_bytes(wn) + 2 * 64 * wgs * raw_pitch(T) + 64 * wgs * dq_row_scales<T>() * 4;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A K-major, unswizzled wgmma descriptor of the 16 × WN operand at shared address `addr`.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
    return (uint64_t) ((addr & 0x3FFFF) >> 4) | ((uint64_t) (CM >> 4) << 16) | ((uint64_t) (GROUP_BYTES >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared memory written through the generic proxy (cp.async's landed copies) made visible to the
// wgmmas' async proxy.
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The accumulators are not to be read or moved across this point (after a wait).
template <int N> __device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}
// The A fragments are fully written before the wgmma.fence that precedes their wgmmas (the
// fence's "memory" clobber orders memory, not registers; CUTLASS fences the operands the same way).
template <int N> __device__ __forceinline__ void wg_hold_a(uint32_t (&a)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            asm volatile("" : "+r"(a[j][k])::"memory");
        }
    }
}

// d += A(64×16, this warpgroup's registers a) · B(16×WN at desc), f32 accumulators.
template <typename C, int WN> __device__ __forceinline__ void wgmma_rs(float (&d)[WN / 2], const uint32_t (&a)[4], uint64_t desc);

// The register-A wgmma's asm for one width, the operand type's PTX name DT (bf16, f16).
#define GLMCHECK_WGMMA_N128(DT) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " " \
                 "{"  \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));

#define GLMCHECK_WGMMA_N64(DT) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." DT "." DT " " \
                 "{"  \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));

template <> __device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    GLMCHECK_WGMMA_N128("bf16");
}
template <> __device__ __forceinline__ void wgmma_rs<half, 128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    GLMCHECK_WGMMA_N128("f16");
}
template <> __device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    GLMCHECK_WGMMA_N64("bf16");
}
template <> __device__ __forceinline__ void wgmma_rs<half, 64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
    GLMCHECK_WGMMA_N64("f16");
}
#undef GLMCHECK_WGMMA_N128
#undef GLMCHECK_WGMMA_N64

// Part P of a step's NP parts (its chunks: k in [P·256/NP, (P+1)·256/NP)) decoded into A
// fragments, a[j] the part's chunk j (m16n8k16's A layout, the permuted k order).
template <int P, int NP, int T, bool ALIGNED, bool FMA1, bool H16, typename C>
__device__ __forceinline__ void wg_decode_part(const uint8_t * const (&b)[2], const float * const (&rs)[2], int t,
                                               uint32_t (&a)[16 / NP][4]) {
    constexpr int KP = KS / NP;
    dq_decode<T, ALIGNED, FMA1, H16>(b, rs, t, [&](const float (&v)[2][4], int k0) {
        if (k0 / KP == P) { // a compile-time test once unrolled: the other parts' decoding is dead
            const int j = (k0 % KP) / 16;
            a[j][0] = pack2<C>(v[0][0], v[0][1]);
            a[j][1] = pack2<C>(v[1][0], v[1][1]);
            a[j][2] = pack2<C>(v[0][2], v[0][3]);
            a[j][3] = pack2<C>(v[1][2], v[1][3]);
        }
    });
}

// Parts P.. of a step: each decoded into registers of its own and issued as one wgmma group, the
// next part decoded while the groups before it run. No wait in between (every part has its own
// registers); the caller waits for them all before their stage is overwritten.
template <int P, int NP, int T, bool ALIGNED, bool FMA1, bool H16, typename C, int WN>
__device__ __forceinline__ void wg_parts(const uint8_t * const (&b)[2], const float * const (&rs)[2], int t, uint32_t xs,
                                         float (&acc)[WN / 2]) {
    if constexpr (P < NP) {
        uint32_t a[16 / NP][4];
        wg_decode_part<P, NP, T, ALIGNED, FMA1, H16, C>(b, rs, t, a);
        wg_hold_a(a);
        if constexpr (P == 0) {
            wg_hold(acc); // no wgmma in flight yet: the step began with a wait
        }
        wg_fence();
#pragma unroll
        for (int j = 0; j < 16 / NP; ++j) {
            wgmma_rs<C, WN>(acc, a[j], wg_desc(xs + 2 * CM * (16 / NP * P + j)));
        }
        wg_commit();
        wg_parts<P + 1, NP, T, ALIGNED, FMA1, H16, C, WN>(b, rs, t, xs, acc);
    }
}

// One step of one warpgroup in WG_PARTS groups of wgmmas. The block meets and waits for every
// group at each step's start (the stage they read is then rewritten), so the tensor pipe idles for
// the scales and the first part's decoding: four parts make that a quarter of a step's decoding
// where two made it half. (Keeping a group in flight across the step boundary instead made ptxas
// serialize every wgmma, C7513: the next step's copies reused the in-flight groups' registers.)
constexpr int WG_PARTS = 4;
template <int T, bool ALIGNED, bool FMA1, bool H16, typename C, int WN>
__device__ __forceinline__ void wg_step(const uint8_t * const (&b)[2], const float * const (&rs)[2], int t, uint32_t xs,
                                        float (&acc)[WN / 2]) {
    wg_parts<0, WG_PARTS, T, ALIGNED, FMA1, H16, C, WN>(b, rs, t, xs, acc);
}
#endif

// x [n_tok, k_in] → xt: per step s, per group n8 of 8 tokens (tpad / 8 of them, tokens past n_tok
// zero), the step's 32 core matrices (k8 = 2c + h: chunk c's even (h 0) or odd (h 1) words) of
// 8 tokens × 8 values. One thread a token's 16-value chunk: two 16-byte loads, two stores.
template <typename C>
__global__ void glmcheck_wg_tiles(const C * __restrict__ x, C * __restrict__ xt, int n_tok, int k_in, int tpad) {
    const int chunks = k_in / 16;
    const long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long) tpad * chunks) {
        return;
    }
    const int tok = (int) (i / chunks), c = (int) (i % chunks);
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (tok < n_tok) {
        const uint4 * p = (const uint4 *) (x + (long long) tok * k_in + 16 * c);
        lo = p[0];
        hi = p[1];
    }
    const int s = c / (KS / 16), k8 = 2 * (c % (KS / 16));
    uint8_t * base = (uint8_t *) xt + ((long long) s * (tpad / 8) + tok / 8) * GROUP_BYTES + (tok % 8) * 16;
    *(uint4 *) (base + k8 * CM) = make_uint4(lo.x, lo.z, hi.x, hi.z);
    *(uint4 *) (base + (k8 + 1) * CM) = make_uint4(lo.y, lo.w, hi.y, hi.w);
}

// y[tok][row] = Σ_k x[tok][k] · W[row][k]: grid (tpad / WN, n_out / (64·WGS)), n_out a multiple of
// 64·WGS (every warpgroup has rows: wgmmas under a warpgroup-dependent branch are serialized by
// ptxas, C7518); xt from glmcheck_wg_tiles. Tokens past n_tok are zeros in xt and not written.
template <int T, bool ALIGNED, bool H16, typename C, int WN, int WGS>
__global__ void __launch_bounds__(128 * WGS, 1) glmcheck_dqwg(const uint8_t * __restrict__ w, long long row_bytes,
                                                              const C * __restrict__ xt, C * __restrict__ y, int n_out,
                                                              int k_in, int n_tok, int tpad) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int THR = 128 * WGS, ROWS = 64 * WGS, B = bytes_256(T), P = raw_pitch(T);
    constexpr int RS = dq_row_scales<T>(), XS = wg_stage_bytes(WN);
    const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128, warp = wtid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_base = ROWS * blockIdx.y; // n_out is a multiple of ROWS: every warpgroup has rows
    const int tok0 = WN * blockIdx.x;

    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t * xs = smem;
    uint8_t * raw = smem + 2 * XS;
    float * rsc = (float *) (raw + 2 * ROWS * P);
    const uint32_t xs_addr = (uint32_t) __cvta_generic_to_shared(xs);

    const uint8_t * wblk = w + (long long) row_base * row_bytes;
    const uint8_t * wrow = wblk + (long long) (tid / 16) * row_bytes;
    const long long wstride = (THR / 16) * row_bytes;
    const uint8_t * xsrc = (const uint8_t *) xt + (long long) (tok0 / 8) * GROUP_BYTES;
    const long long xstep = (long long) (tpad / 8) * GROUP_BYTES;
    const int steps = k_in / KS;
    const int rb16 = (int) (row_bytes & 15);
    // The register kernel's staging of the step's raw rows, then its activations: one contiguous
    // piece.
    auto stage = [&](int buf, int step) {
        const uint8_t * srcp = wrow + (long long) step * B;
        uint8_t * dst = raw + (buf * ROWS + tid / 16) * P;
        stage_raw<T, ALIGNED, ROWS, THR>(dst, srcp, wstride, tid);
        const uint8_t * xp = xsrc + step * xstep;
        uint8_t * xd = xs + buf * XS;
#pragma unroll 4
        for (int i = tid; i < XS / 16; i += THR) {
            __pipeline_memcpy_async(xd + 16 * i, xp + 16 * i, 16);
        }
        __pipeline_commit();
    };

    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) {
        acc[i] = 0.0f;
    }
    const int r0 = 64 * wg + 16 * warp + g; // this lane's rows of the block: r0 and r0 + 8
    stage(0, 0);
    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        // Row r of the block, this step: its bytes start `mis` past the 16-byte boundary its copy
        // started from (w is on a 16-byte boundary: the offset mod 16 in 32-bit arithmetic; a
        // 64-bit address here made ptxas serialize the wgmmas, C7515).
        auto blk = [&](int r) {
            const int mis = ALIGNED ? 0 : (r * rb16 + step * B) & 15;
            return raw + (buf * ROWS + r) * P + mis;
        };
        __pipeline_wait_prior(0);
        proxy_fence();
        wg_wait_all(); // the previous step's wgmmas have read the other stage
        wg_hold(acc);
        // Everyone's copies of this step have landed; the other buffers and the scales are free.
        __syncthreads();
        auto wg_blk = [&](int r) { return blk(64 * wg + r); };
        bool fma1 = true;
        if constexpr (H16) {
            dq_scales<T, ALIGNED, decltype(wg_blk), true>(wg_blk, rsc + 64 * wg * RS, wtid);
            __syncthreads();
        } else {
            fma1 = __syncthreads_and(dq_scales<T, ALIGNED>(wg_blk, rsc + 64 * wg * RS, wtid));
        }
        if (step + 1 < steps) {
            stage(buf ^ 1, step + 1);
        }
        const uint8_t * b[2] = {blk(r0), blk(r0 + 8)};
        const float * rs[2] = {rsc + r0 * RS, rsc + (r0 + 8) * RS};
        const uint32_t xb = xs_addr + buf * XS;
        if constexpr (!H16 && (T == Q4_K || T == Q5_K)) {
            if (!fma1) {
                wg_step<T, ALIGNED, false, false, C, WN>(b, rs, t, xb, acc);
                continue;
            }
        }
        wg_step<T, ALIGNED, true, H16, C, WN>(b, rs, t, xb, acc);
    }
    wg_wait_all();
    wg_hold(acc);
    // acc[4i + e]: row r0 + 8·(e / 2), token 8i + 2t + e % 2 of the block's (wgmma's D layout).
#pragma unroll
    for (int i = 0; i < WN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int tok = tok0 + 8 * i + 2 * t + (e & 1);
            if (tok < n_tok) {
                y[(long long) tok * n_out + row_base + r0 + 8 * (e / 2)] = from_f32<C>(acc[4 * i + e]);
            }
        }
    }
#endif
}

// The tokens xt holds for n_tok at tile width wn (a whole number of tiles).
int wg_tpad(int n_tok, int wn) { return (n_tok + wn - 1) / wn * wn; }

template <int T, bool ALIGNED, bool H16, typename C, int WN, int WGS>
int launch_wg(const void * w, long long row_bytes, const void * x, void * xt, void * y, int n_out, int k_in, int n_tok,
              cudaStream_t stream) {
    const int tpad = wg_tpad(n_tok, WN);
    const long long threads = (long long) tpad * (k_in / 16);
    const long long tile_blocks = (threads + 255) / 256;
    const int row_blocks = n_out / (64 * WGS);
    if (n_out % (64 * WGS) != 0 || tile_blocks > 0x7FFFFFFF || row_blocks > 65535) { // every warpgroup has rows
        return 2;
    }
    glmcheck_wg_tiles<C><<<(unsigned) tile_blocks, 256, 0, stream>>>((const C *) x, (C *) xt, n_tok, k_in, tpad);
    constexpr int shared = wg_shared_bytes<T>(WN, WGS);
    static_assert(shared <= 227 * 1024, "a block's shared memory");
    auto kernel = glmcheck_dqwg<T, ALIGNED, H16, C, WN, WGS>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared) != cudaSuccess) {
        return 3;
    }
    const dim3 grid(tpad / WN, row_blocks);
    kernel<<<grid, 128 * WGS, shared, stream>>>((const uint8_t *) w, row_bytes, (const C *) xt, (C *) y, n_out, k_in,
                                                n_tok, tpad);
    return cudaGetLastError() == cudaSuccess ? 0 : 3;
}

template <typename C, int WN, int WGS>
int launch_wg_type(int ggml_type, bool aligned, const void * w, long long row_bytes, const void * x, void * xt, void * y,
                   int n_out, int k_in, int n_tok, cudaStream_t s) {
    switch (ggml_type) {
        // Q4_K with the f16 decode, as the register kernel's default; Q4_K and Q5_K rows on
        // 16-byte boundaries only (144 and 176 bytes a super-block: always, from an aligned base)
        case Q4_K: return aligned ? launch_wg<Q4_K, true, true, C, WN, WGS>(w, row_bytes, x, xt, y, n_out, k_in, n_tok, s) : 2;
        case Q5_K: return aligned ? launch_wg<Q5_K, true, false, C, WN, WGS>(w, row_bytes, x, xt, y, n_out, k_in, n_tok, s) : 2;
        case Q6_K: return launch_wg<Q6_K, false, false, C, WN, WGS>(w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        case Q8_0: return launch_wg<Q8_0, false, false, C, WN, WGS>(w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        default: return 1;
    }
}

// The variants: 0 → 128 tokens, 2 warpgroups (128 rows) a block; 1 → 64 tokens, 1 warpgroup.
constexpr int wg_width(int variant) { return variant == 1 ? 64 : 128; }

} // namespace

// 1: this build has the kernel (sm_90a) and the current GPU is compute capability 9.0; 0: built
// without it (another CUDA_COMPUTE_CAP); -1: the GPU is another one, or CUDA did not say. A
// device's answer is asked of CUDA once and kept: every dense matmul asks, twice (its caller and
// glmcheck_dequant_wgmma).
extern "C" int glmcheck_dequant_wgmma_ready() {
#if defined(GLMCHECK_WGMMA)
    static std::atomic<int> known[64]; // by device ordinal: 0 not asked yet
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        return -1;
    }
    const bool keep = dev >= 0 && dev < 64;
    if (keep) {
        if (const int k = known[dev].load(std::memory_order_relaxed)) {
            return k;
        }
    }
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess
        || cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        return -1; // not kept: CUDA may answer later
    }
    const int ready = major == 9 && minor == 0 ? 1 : -1;
    if (keep) {
        known[dev].store(ready, std::memory_order_relaxed);
    }
    return ready;
#else
    return 0;
#endif
}

// The tokens the scratch `xt` of glmcheck_dequant_wgmma must hold (times k_in values of the
// compute dtype) for n_tok tokens and `variant`; 0 for an unknown variant.
extern "C" int glmcheck_dequant_wgmma_tokens(int n_tok, int variant) {
    return (variant == 0 || variant == 1) && n_tok > 0 ? wg_tpad(n_tok, wg_width(variant)) : 0;
}

// y [n_tok, n_out] = x [n_tok, k_in] · Wᵀ, W the GGUF's [n_out, k_in] blocks (row_bytes a row);
// xt: scratch of glmcheck_dequant_wgmma_tokens(n_tok, variant) × k_in values. Returns 0 when
// launched; 1: no kernel (a quant type other than Q4_K, Q5_K, Q6_K, Q8_0; a dtype other than
// 1 f16, 2 bf16; not built for sm_90a, or the current GPU is not compute capability 9.0); 2: a
// shape or alignment it does not take (n_out % 64, k_in % 256, x, xt or W off a 16-byte boundary,
// an unknown variant, a grid too large); 3: CUDA refused a launch. Variant 0 on an n_out that is
// not a multiple of 128 runs as variant 1 (64 tokens, one warpgroup: xt's tokens are a multiple
// of 64 either way).
extern "C" int glmcheck_dequant_wgmma(int ggml_type, int dtype, int variant, const void * w, long long row_bytes,
                                      const void * x, void * xt, void * y, int n_out, int k_in, int n_tok, void * stream) {
#if defined(GLMCHECK_WGMMA)
    if (n_out <= 0 || n_tok <= 0 || n_out % 64 != 0 || k_in <= 0 || k_in % KS != 0 || (variant != 0 && variant != 1)
        || (uintptr_t) x % 16 != 0 || (uintptr_t) xt % 16 != 0) {
        return 2;
    }
    if (glmcheck_dequant_wgmma_ready() != 1) {
        return 1;
    }
    if ((uintptr_t) w % 16 != 0) {
        return 2;
    }
    const bool aligned = row_bytes % 16 == 0;
    const cudaStream_t s = (cudaStream_t) stream;
    if (variant == 0 && n_out % 128 != 0) {
        variant = 1; // two warpgroups need 128 rows a block
    }
    switch (dtype * 2 + variant) {
        case 2: return launch_wg_type<half, 128, 2>(ggml_type, aligned, w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        case 3: return launch_wg_type<half, 64, 1>(ggml_type, aligned, w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        case 4: return launch_wg_type<__nv_bfloat16, 128, 2>(ggml_type, aligned, w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        case 5: return launch_wg_type<__nv_bfloat16, 64, 1>(ggml_type, aligned, w, row_bytes, x, xt, y, n_out, k_in, n_tok, s);
        default: return 1;
    }
#else
    (void) ggml_type; (void) dtype; (void) variant; (void) w; (void) row_bytes; (void) x; (void) xt; (void) y;
    (void) n_out; (void) k_in; (void) n_tok; (void) stream;
    return 1;
#endif
}
