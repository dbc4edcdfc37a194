#!/usr/bin/env python3
"""Simulates cuda/dequant_wgmma.cu's index algebra on integer data, without a GPU: the activation
tiles glmcheck_wg_tiles writes, the wgmma B operand as the PTX ISA lays out a K-major unswizzled
operand from its descriptor (core matrix (n, k): start + (n % 8)·16 B + (n // 8)·SBO + (k % 8)·2 B
+ (k // 8)·LBO, with LBO 128 B, SBO 4096 B, start + 256 B per 16-value chunk), the m16n8k16 A
fragment each lane fills from dq_decode's values (the permuted k order), the D fragment and the
epilogue. Prints whether the result is x·Wᵀ exactly for both tiles (128 tokens × 2 warpgroups,
64 × 1), and exits 1 if not. What it cannot check: the ISA reading itself, fences, waits, the asm
-- the device test (model::wgmma_cuda::tests) does.

Usage: tools/wgmma_layout_sim.py   (needs numpy)
"""
import sys

import numpy as np
rng = np.random.default_rng(0)
KS, CM_E, GROUP_E = 256, 64, 2048   # elements: core matrix 64, group of 8 tokens 2048
def tiles(x, tpad):
    T, K = x.shape
    xt = np.zeros(tpad * K, dtype=np.int64)
    chunks = K // 16
    for tok in range(tpad):
        for c in range(chunks):
            vals = x[tok, 16*c:16*c+16] if tok < T else np.zeros(16, dtype=np.int64)
            words = vals.reshape(8, 2)          # word w = values 2w, 2w+1
            even = words[[0, 2, 4, 6]].reshape(-1); odd = words[[1, 3, 5, 7]].reshape(-1)
            s, k8 = c // 16, 2 * (c % 16)
            base = (s * (tpad // 8) + tok // 8) * GROUP_E + (tok % 8) * 8
            xt[base + k8 * CM_E: base + k8 * CM_E + 8] = even
            xt[base + (k8 + 1) * CM_E: base + (k8 + 1) * CM_E + 8] = odd
    return xt
def run(T, K, NOUT, WN, WGS):
    x = rng.integers(-8, 8, (T, K)); W = rng.integers(-8, 8, (NOUT, K))
    tpad = (T + WN - 1) // WN * WN
    xt = tiles(x, tpad)
    y = np.zeros((T, NOUT), dtype=np.int64)
    ROWS = 64 * WGS
    for bx in range(NOUT // ROWS):
        for by in range(tpad // WN):
            tok0 = WN * by
            for wg in range(WGS):
                acc = np.zeros((128, WN // 2), dtype=np.int64)   # [thread in wg][reg]
                for s in range(K // KS):
                    stage = (s * (tpad // 8) + tok0 // 8) * GROUP_E
                    for j in range(16):
                        start = stage + 128 * j          # 256 bytes a chunk
                        # B[k][n] per the canonical K-major no-swizzle layout
                        B = np.zeros((16, WN), dtype=np.int64)
                        for n in range(WN):
                            for k in range(16):
                                B[k, n] = xt[start + (n % 8) * 8 + (n // 8) * GROUP_E + (k % 8) + (k // 8) * CM_E]
                        # A: 64 rows of the warpgroup, logical k from each lane's fragment
                        A = np.zeros((64, 16), dtype=np.int64)
                        for warp in range(4):
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                r = 64 * wg + 16 * warp + g
                                row = ROWS * bx + r
                                k0 = KS * s + 16 * j
                                v = [[W[row + 8 * h, k0 + 4 * t + i] for i in range(4)] for h in range(2)]
                                # a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
                                A[16*warp + g, 2*t:2*t+2] = v[0][0:2]
                                A[16*warp + g + 8, 2*t:2*t+2] = v[1][0:2]
                                A[16*warp + g, 2*t+8:2*t+10] = v[0][2:4]
                                A[16*warp + g + 8, 2*t+8:2*t+10] = v[1][2:4]
                        D = A @ B   # [64, WN]
                        for warp in range(4):
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                for i in range(WN // 8):
                                    for e in range(4):
                                        acc[32*warp + lane, 4*i + e] += D[16*warp + g + 8*(e//2), 8*i + 2*t + (e & 1)]
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        r0 = 64 * wg + 16 * warp + g
                        for i in range(WN // 8):
                            for e in range(4):
                                tok = tok0 + 8 * i + 2 * t + (e & 1)
                                if tok < T:
                                    y[tok, ROWS * bx + r0 + 8 * (e // 2)] = acc[32*warp + lane, 4*i + e]
    want = x @ W.T
    return np.array_equal(y, want)
ok = [run(T=37, K=512, NOUT=128, WN=64, WGS=1), run(T=130, K=256, NOUT=128, WN=128, WGS=2)]
print("narrow (64 tokens, 1 warpgroup):", ok[0], "wide (128 tokens, 2 warpgroups):", ok[1])
sys.exit(0 if all(ok) else 1)
