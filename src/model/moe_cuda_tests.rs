//! The CUDA kernels against candle's own decoders, on the GPU (`cargo test --features cuda` on a
//! machine with one; skipped without a device). Built here with tools/build-cuda.sh's environment
//! and `--no-run` (`tools/build-cuda.sh --tests`), run on the H200 machine by
//! tools/device_tiled_check.sh and tools/device_decode_check.sh.

use super::*;
use crate::model::fma_decode_tests;
use crate::model::q8_cuda::{
    dense_on_int8, dense_tile, int8_dense, int8_tile, split_count, Q8Kernel, DENSE_TILE_MAX,
    EXPERT_TILE_MAX, INT8_DENSE_TOKENS,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, IndexOp, Tensor};

/// rel-L2 of `a` against `b` (both f32).
fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f32> {
    let num = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()?;
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()?;
    Ok((num / den).sqrt())
}

/// How many values of `a` differ from `b`'s in their bits (any dtype, compared as f32, which holds
/// f16 and bf16 exactly), and how many there are.
fn bits_differ(a: &Tensor, b: &Tensor) -> Result<(usize, usize)> {
    let to_f32 = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (a, b) = (to_f32(a)?, to_f32(b)?);
    let diff = a
        .iter()
        .zip(&b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    Ok((diff, a.len()))
}

/// The quant types of `cuda/dequant_gemm.cu` (the tiled kernel and the whole-tensor decoder).
const TILED_TYPES: [GgmlDType; 6] = [
    GgmlDType::Q4_0,
    GgmlDType::Q5_0,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Both tiled kernels, the register kernel at each tile width, by the cost model and in tile runs,
/// and the direct-load kernel (Q4_K) with 4 and 8 warps a block in tile runs; both with the f16 decode
/// (the register kernel by default), the register kernel with the byte permutes for Q4_K too.
const TILED_KERNELS: [TiledKernel; 10] = [
    TiledKernel::Registers(None),
    TiledKernel::Runs,
    TiledKernel::Direct(4),
    TiledKernel::Direct(8),
    TiledKernel::DirectH16,
    TiledKernel::RunsBytes,
    TiledKernel::Registers(Some(8)),
    TiledKernel::Registers(Some(16)),
    TiledKernel::Registers(Some(32)),
    TiledKernel::Shared,
];

/// The routing of `t` tokens over `e` experts, two slots each: token i → experts i % e and
/// (i + 1) % e (every expert gets 2t/e rows).
fn round_robin(t: usize, e: usize, dev: &Device) -> Result<Grouping> {
    let ids: Vec<u32> = (0..t)
        .flat_map(|i| [(i % e) as u32, ((i + 1) % e) as u32])
        .collect();
    Grouping::new(&Tensor::from_vec(ids, (t, 2), dev)?, e)
}

/// Every type the tiled kernels cover, both input orders (by token: gate/up; grouped rows: down),
/// bf16 and f16, 6, 20 and 70 rows per expert (partial groups of 8, one to nine tiles), both
/// kernels and every tile width of the register kernel: the output equals candle's CUDA decode rounded to the compute dtype and multiplied in f32,
/// to the output's rounding (a swapped nibble, scale or row gives a rel-L2 near 1).
#[test]
fn the_tiled_dequant_kernel_equals_candles_decode_then_matmul() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let (e, out, inp) = (4usize, 128usize, 512usize);
    let w = Tensor::randn(0f32, 1.0, (e, out, inp), &Device::Cpu)?;
    for qt in TILED_TYPES {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for dtype in [DType::BF16, DType::F16] {
            assert!(tiled_dequant(&q, dtype), "{qt:?} {dtype:?} not covered");
            // The weights as the kernel must see them: candle's decode, rounded to the dtype.
            let deq = q
                .dequantize(&dev)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?;
            for t in [12usize, 40, 140] {
                // 6, 20 or 70 rows per expert.
                let g = round_robin(t, e, &dev)?;
                let table = g.table.to_vec1::<u32>()?;
                // The table: tokens [rows], slots [rows], bounds [active + 1], experts [active],
                // by_size [active].
                let a = g.active();
                let tokens = &table[..g.rows];
                let bounds = &table[2 * g.rows..2 * g.rows + a + 1];
                let experts = &table[2 * g.rows + a + 1..2 * g.rows + 2 * a + 1];
                let expert_of = |j: usize| -> usize {
                    let z = bounds[..a]
                        .iter()
                        .rposition(|&b| b as usize <= j)
                        .unwrap_or(0);
                    experts[z] as usize
                };
                for by_token in [true, false] {
                    let n = if by_token { t } else { g.rows };
                    let x = Tensor::randn(0f32, 1.0, (n, inp), &dev)?.to_dtype(dtype)?;
                    let xf = x.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
                    let want = (0..g.rows)
                        .map(|j| {
                            let row = if by_token { tokens[j] as usize } else { j };
                            xf.i(row..row + 1)?.matmul(&deq.i(expert_of(j))?.t()?)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let want = Tensor::cat(&want, 0)?;
                    for kernel in TILED_KERNELS {
                        let got = g
                            .dequant_matmul_with(&q, &x, by_token, kernel)?
                            .to_dtype(DType::F32)?
                            .to_device(&Device::Cpu)?;
                        let err = rel_l2(&got, &want)?;
                        let case = format!("{qt:?} {dtype:?} t={t} by_token={by_token} {kernel:?}");
                        assert!(err < 3e-3, "{case}: rel-L2 {err:.2e}");
                        eprintln!("{case}: rel-L2 {err:.2e}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The register-decode kernel decodes every weight to candle's value, bit for bit, on both of its
/// decodes and in one or two launches: tokens that are the unit vectors e_k make each output row
/// one column of the decoded weights (1·w plus zeros, exact in f32), so the output must equal
/// candle's decode rounded to the compute dtype in every bit. Expert 0's weights are spread evenly (every Q4_K/Q5_K addend exact:
/// the one-FMA decode), expert 1's sub-blocks hold values in [-1e-3·u, 1) (tiny mins far below
/// their scales: inexact addends, so those blocks take the two-operation decode); both asserted on
/// the quantized blocks before the kernels run. The shared-memory kernel is held to the same bits.
#[test]
fn the_tiled_kernels_decode_every_weight_to_candles_bits() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    // 128 rows: the direct-load kernel's 8-warp blocks cover them too.
    let (out, inp) = (128usize, 512usize);
    let w = fma_decode_tests::two_experts(out, inp)?;
    // Two routings of unit-vector tokens (k = 1; token order = grouped order): every column of
    // both experts (one launch, 32 wide), and 8 columns of expert 0 with 40 of expert 1 (16 wide
    // by the cost model; `TiledKernel::Runs` launches expert 0 8 wide and the busy expert 1 32
    // wide: `Grouping::tile_runs`).
    let every: Vec<(usize, usize)> = (0..2 * inp).map(|i| (i / inp, i % inp)).collect();
    let uneven: Vec<(usize, usize)> = (0..8)
        .map(|k| (0, 3 * k))
        .chain((100..140).map(|k| (1, k)))
        .collect();
    for qt in TILED_TYPES {
        let cpu = QTensor::quantize(&w, qt)?;
        fma_decode_tests::assert_both_decodes(&cpu)?;
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for dtype in [DType::BF16, DType::F16] {
            // [2, out, inp] → [2, inp, out]: expert e's decoded column k at [e][k].
            let deq = q
                .dequantize(&dev)?
                .to_dtype(dtype)?
                .transpose(1, 2)?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .to_vec3::<f32>()?;
            for (name, routing) in [("every column", &every), ("uneven", &uneven)] {
                let ids: Vec<u32> = routing.iter().map(|&(e, _)| e as u32).collect();
                let t = ids.len();
                let g = Grouping::new(&Tensor::from_vec(ids, (t, 1), &dev)?, 2)?;
                let mut x = vec![0f32; t * inp];
                for (i, &(_, k)) in routing.iter().enumerate() {
                    x[i * inp + k] = 1.0;
                }
                let xd = Tensor::from_vec(x, (t, inp), &dev)?.to_dtype(dtype)?;
                for kernel in TILED_KERNELS {
                    let got = g
                        .dequant_matmul_with(&q, &xd, true, kernel)?
                        .to_dtype(DType::F32)?
                        .to_device(&Device::Cpu)?
                        .to_vec2::<f32>()?;
                    let case = format!("{qt:?} {dtype:?} {name} {kernel:?}");
                    for (row, &(e, k)) in got.iter().zip(routing.iter()) {
                        let want = &deq[e][k];
                        let bad = row.iter().zip(want).position(|(a, b)| {
                            a.to_bits() != b.to_bits() && !(*a == 0.0 && *b == 0.0)
                        });
                        if let Some(r) = bad {
                            panic!(
                                "{case}: expert {e} row {r} k {k} is {} where candle decodes {}",
                                row[r], want[r]
                            );
                        }
                    }
                    eprintln!("{case}: all {} weights bit for bit", t * out);
                }
            }
        }
    }
    Ok(())
}

/// The dense route through the grouped kernel ([`dense_tiled`]: a `[out, in]` weight as a
/// one-expert stack) against candle's decode-then-matmul, 40 tokens (two 32-wide tiles, the
/// second partial), bf16 and f16: within the output's rounding of the decoded weights rounded to
/// the dtype (the same weights, another order of f32 sums); a wrong row, tile or token order gives
/// a rel-L2 near 1. f32 and a shape the kernel does not cover are not taken.
#[test]
fn the_tiled_dense_route_equals_decode_then_matmul() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let w = (Tensor::randn(0f32, 1.0, (128, 512), &Device::Cpu)? * 0.05)?;
    let x = Tensor::randn(0f32, 1.0, (40, 512), &dev)?;
    for qt in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q5K,
        GgmlDType::Q8_0,
    ] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for dtype in [DType::BF16, DType::F16] {
            let xd = x.to_dtype(dtype)?;
            // the decoded weights rounded to the dtype, the product in f32
            let want = xd.to_dtype(DType::F32)?.matmul(
                &q.dequantize(&dev)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?
                    .t()?,
            )?;
            let got = dense_tiled(&q, &xd)?.expect("taken").to_dtype(DType::F32)?;
            let r = rel_l2(&got, &want)?;
            eprintln!("{qt:?} {dtype:?}: tiled dense rel-L2 {r:.2e} against decode-then-matmul");
            assert!(r < 4e-3, "{qt:?} {dtype:?}: rel-L2 {r}");
        }
        assert!(dense_tiled(&q, &x)?.is_none(), "f32: not taken");
    }
    let odd = QTensor::quantize_onto(&w.narrow(0, 0, 96)?, GgmlDType::Q8_0, &dev)?;
    assert!(
        dense_tiled(&odd, &x.to_dtype(DType::BF16)?)?.is_none(),
        "96 rows: not taken"
    );
    Ok(())
}

/// glmcheck's whole-tensor decoder gives candle's decoded values bit for bit: f32 against candle's
/// f32 decode, f16 against its f16 decode, bf16 against its f32 decode rounded (what
/// `linear::dequantize` used before). A size that ends mid-warp (74 groups of 256: the last warp takes 2 of its 4),
/// on every grid (warps that loop over several batches included).
#[test]
fn the_whole_tensor_decoder_equals_candles_bit_for_bit() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    // quantize_onto takes its source on the CPU.
    let w = (Tensor::randn(0f32, 1.0, (37, 512), &Device::Cpu)? * 0.05)?;
    for qt in TILED_TYPES {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        let f32_ref = q.dequantize(&dev)?;
        let wants = [
            (DType::F32, f32_ref.clone()),
            (DType::F16, q.dequantize_f16(&dev)?),
            (DType::BF16, f32_ref.to_dtype(DType::BF16)?),
        ];
        for (dtype, want) in wants {
            // on the device's resident blocks (0) and on 1, 2 or 3 blocks whose warps loop over
            // the 19 batches (the last short)
            for grid in [0, 1, 2, 3] {
                let got = crate::gguf::cuda_decode::decode_grid(&q, dtype, grid)?
                    .unwrap_or_else(|| panic!("{qt:?} {dtype:?} not covered"));
                assert_eq!(got.dims(), want.dims());
                let (diff, n) = bits_differ(&got, &want)?;
                assert_eq!(
                    diff, 0,
                    "{qt:?} {dtype:?} grid {grid}: {diff} of {n} values differ"
                );
            }
            eprintln!(
                "{qt:?} {dtype:?}: {} values equal on every grid",
                want.elem_count()
            );
        }
    }
    Ok(())
}

/// q8 mode's int8 expert kernel (`cuda/q8_moe.cu`) against llama.cpp's MMQ (`cuda/moe_mmq.cu`, as
/// vendored in candle-kernels) on the same grouping and the same Q8_1 activations: both compute
/// exact integer dot products per sub-block scaled by llama.cpp's expressions, so they agree to
/// f32 summation order (a wrong nibble, scale, row or token gives a rel-L2 near 1). Q4_K, Q6_K
/// and Q8_0; 6, 12, 20 and 70 rows per expert (tiles of 8, 16 and 32 tokens); both input orders.
#[test]
fn the_int8_expert_kernel_equals_llama_cpps_mmq() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let (e, out, inp, k) = (4usize, 128usize, 512usize, 2usize);
    let w = Tensor::randn(0f32, 1.0, (e, out, inp), &Device::Cpu)?;
    for qt in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        assert!(Q8Kernel::Int8.int8_type(&q).is_some(), "{qt:?} not covered");
        for t in [12usize, 24, 40, 140] {
            let g = round_robin(t, e, &dev)?;
            for by_token in [true, false] {
                let n = if by_token { t } else { t * k };
                let x = Tensor::randn(0f32, 1.0, (n, inp), &dev)?;
                let run = |kernel| -> Result<Tensor> {
                    g.matmul_with(&q, &x, by_token, kernel)?
                        .to_device(&Device::Cpu)
                };
                let (got, want) = (run(Q8Kernel::Int8)?, run(Q8Kernel::Mmq)?);
                let err = rel_l2(&got, &want)?;
                eprintln!(
                    "{qt:?} t={t} tile={} by_token={by_token}: rel-L2 {err:.2e}",
                    int8_tile(g.tile_width(), None)
                );
                assert!(
                    err < 1e-5,
                    "{qt:?} t={t} by_token={by_token}: rel-L2 {err:.2e}"
                );
            }
        }
    }
    Ok(())
}

/// q8 mode's dense matmuls by the int8 kernel (a dense weight as a one-expert stack,
/// `int8_dense`: wide grids at 9 to 16 tokens, small grids past 16) against candle's own quantized
/// matmul of the same weight (its MMQ, the kernel those matmuls used before): the same integer dot
/// products and scale expressions, so they agree to f32 summation order; a row or token mix-up
/// gives a rel-L2 near 1. Elsewhere, and for a type the kernel lacks, `int8_dense` declines
/// (candle's kernels run).
#[test]
fn the_int8_dense_matmul_equals_candles_mmq() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    // Enough rows for twice the SMs of any current GPU (the kernel declines smaller grids).
    let (out, inp) = (64 * 2 * 256usize, 768usize);
    let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)?;
    for qt in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
    ] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for t in [1usize, 8, 9, 12, 16, 17, 32] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?;
            let got = int8_dense(&q, &x)?;
            let covered = qt != GgmlDType::Q5_0 && INT8_DENSE_TOKENS.contains(&t);
            assert_eq!(got.is_some(), covered, "{qt:?} t={t}");
            let Some(got) = got else { continue };
            let want = x.apply_op1_no_bwd(&q)?;
            let err = rel_l2(
                &got.to_device(&Device::Cpu)?,
                &want.to_device(&Device::Cpu)?,
            )?;
            eprintln!("{qt:?} t={t}: rel-L2 {err:.2e}");
            assert!(err < 1e-5, "{qt:?} t={t}: rel-L2 {err:.2e}");
        }
    }
    // Too few blocks of 64 rows to fill the GPU without split-K: declined.
    let small = QTensor::quantize_onto(
        &Tensor::randn(0f32, 1.0, (192, inp), &Device::Cpu)?,
        GgmlDType::Q4K,
        &dev,
    )?;
    let x = Tensor::randn(0f32, 1.0, (16, inp), &dev)?;
    assert!(
        int8_dense(&small, &x)?.is_none(),
        "a 3-block grid was taken"
    );
    // Past 16 tokens it is the other way round: a small grid is taken (split-K), the wide one
    // above is not (checked in the loop at 17 and 32 tokens).
    for t in [17usize, 40, 256] {
        let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?;
        let Some(got) = int8_dense(&small, &x)? else {
            panic!("a 3-block grid at {t} tokens was declined")
        };
        let want = x.apply_op1_no_bwd(&small)?;
        let err = rel_l2(
            &got.to_device(&Device::Cpu)?,
            &want.to_device(&Device::Cpu)?,
        )?;
        eprintln!("small grid t={t}: rel-L2 {err:.2e}");
        assert!(err < 1e-5, "small grid t={t}: rel-L2 {err:.2e}");
    }
    Ok(())
}

/// Split-K on the int8 kernel (`GLMCHECK_Q8_DENSE=splitk`: each split sums its share of the k
/// steps, a second launch adds the splits in order) against candle's own quantized matmul: small
/// grids, 1 to 5 splits asked (5 over 6 steps runs as 3 shares of 2: no split without steps), 9
/// and 16 tokens, Q4_K, Q6_K, Q8_0. A split that dropped or doubled a share would be off by
/// ~1/splits.
#[test]
fn split_k_on_the_int8_kernel_equals_candles_mmq() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    assert_eq!(split_count(9, 24, 132), 24); // kv_a: 9 blocks, capped at one step per split
    assert_eq!(split_count(96, 64, 132), 3); // o_proj
    assert_eq!(split_count(2420, 24, 132), 1); // lm_head
    let (out, inp) = (192usize, 6 * 256usize);
    let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)?;
    for qt in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for t in [9usize, 16] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?;
            let want = x.apply_op1_no_bwd(&q)?.to_device(&Device::Cpu)?;
            for splits in 1..=5 {
                let got =
                    dense_on_int8(&q, &x, splits, EXPERT_TILE_MAX)?.to_device(&Device::Cpu)?;
                let err = rel_l2(&got, &want)?;
                eprintln!("{qt:?} t={t} splits={splits}: rel-L2 {err:.2e}");
                assert!(err < 1e-5, "{qt:?} t={t} splits={splits}: rel-L2 {err:.2e}");
            }
        }
    }
    Ok(())
}

/// The int8 kernel's wide tiles (64 and 128 tokens, q8's dense route past 16 tokens,
/// `GLMCHECK_Q8_DENSE=wide`) against candle's own quantized matmul (its MMQ, which those matmuls
/// run by default): Q4_K, Q6_K, Q8_0; 24 to 300 tokens (partial tiles, several column tiles of
/// one row block: the grid runs them as neighbours; 200 tokens under a cap of 128 run as a full
/// and a partial 128-wide tile, 300 as five 64-wide ones: the identity grouping's choice), 1 and
/// 3 splits. A column tile that read another tile's tokens or wrote another's rows would be off
/// by a rel-L2 near 1.
#[test]
fn the_int8_kernels_wide_tiles_equal_candles_mmq() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    assert_eq!(dense_tile(17), 32);
    assert_eq!(dense_tile(40), 64);
    assert_eq!(dense_tile(256), DENSE_TILE_MAX);
    let (out, inp) = (640usize, 6 * 256usize);
    let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)?;
    for qt in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for t in [24usize, 64, 100, 200, 256, 300] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?;
            let want = x.apply_op1_no_bwd(&q)?.to_device(&Device::Cpu)?;
            for cap in [32usize, 64, 128] {
                for splits in [1usize, 3] {
                    let got = dense_on_int8(&q, &x, splits, cap)?.to_device(&Device::Cpu)?;
                    let err = rel_l2(&got, &want)?;
                    eprintln!("{qt:?} t={t} cap={cap} splits={splits}: rel-L2 {err:.2e}");
                    assert!(
                        err < 1e-5,
                        "{qt:?} t={t} cap={cap} splits={splits}: rel-L2 {err:.2e}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// glmcheck's bf16 Q8_1 quantizer (`cuda/q8_quantize.cu`) writes the blocks candle-kernels' f32
/// quantizer writes from the same values cast to f32 (bf16 → f32 is exact): every q8 route fed bf16
/// gives the bits it gives fed f32. Dense (`q8_dense_cuda::dense_q8`, against candle's own
/// quantized matmul of the f32 cast, or the int8 kernel fed f32 where it runs): all three scale
/// layouts (Q4_0/Q4_K DS4, Q8_0/Q5_0/Q6_K D4, Q2_K D2S6), the MMQ route (12 and 40 tokens) and the
/// int8 kernel (12 and 16 tokens of a grid it takes), 768 inputs (rows padded to 1024). Grouped
/// experts (`Grouping::matmul`, the row gather by token and by slot): the int8 kernel and MMQ.
#[test]
fn the_bf16_quantizer_gives_the_f32_casts_bits() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let same = |a: &Tensor, b: &Tensor, what: &str| -> Result<()> {
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        eprintln!("{what}: max |diff| {diff:e}");
        assert!(diff == 0.0, "{what}: max |diff| {diff:e}");
        Ok(())
    };
    let inp = 768usize;
    for (qt, out) in [
        (GgmlDType::Q4_0, 256usize),
        (GgmlDType::Q4K, 256),
        (GgmlDType::Q8_0, 256),
        (GgmlDType::Q5_0, 256),
        (GgmlDType::Q6K, 256),
        (GgmlDType::Q2K, 256),
        (GgmlDType::Q4K, 64 * 2 * 256), // the int8 kernel's grid at 16 tokens
    ] {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)?;
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for t in [12usize, 16, 40] {
            let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?.to_dtype(candle_core::DType::BF16)?;
            let Some(got) = crate::model::q8_dense_cuda::dense_q8(&q, &x)? else {
                panic!("{qt:?} out={out} t={t}: no glmcheck route for bf16")
            };
            // The f32 route the same weight and token count take: the int8 kernel or candle's.
            let xf = x.to_dtype(candle_core::DType::F32)?;
            let want = match int8_dense(&q, &xf)? {
                Some(y) => y,
                None => xf.apply_op1_no_bwd(&q)?,
            };
            same(&got, &want, &format!("dense {qt:?} out={out} t={t}"))?;
        }
    }
    let (e, out, k) = (4usize, 128usize, 2usize);
    let w = Tensor::randn(0f32, 1.0, (e, out, inp), &Device::Cpu)?;
    for qt in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q5_0] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        let t = 20usize;
        let g = round_robin(t, e, &dev)?;
        for by_token in [true, false] {
            let n = if by_token { t } else { t * k };
            let x = Tensor::randn(0f32, 1.0, (n, inp), &dev)?.to_dtype(candle_core::DType::BF16)?;
            let got = g.matmul(&q, &x, by_token)?;
            let want = g.matmul(&q, &x.to_dtype(candle_core::DType::F32)?, by_token)?;
            same(&got, &want, &format!("experts {qt:?} by_token={by_token}"))?;
        }
    }
    Ok(())
}

/// The routing read ahead (`host_ids`: an asynchronous copy into page-locked memory, waited for
/// by its own event) gives what a synchronous read gives: from a view that starts inside its
/// storage, with later work still queued behind the copy, with the buffer reused for a shorter
/// and then a longer read (past the first buffer's size: a new one).
#[test]
fn the_routing_read_ahead_equals_the_synchronous_read() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        return Ok(());
    };
    let busy = Tensor::randn(0f32, 1.0, (2048, 2048), &dev)?;
    for (t, k) in [(256usize, 8usize), (16, 8), (5, 1), (9000, 8)] {
        let n = (t * k) as u32;
        // Long work the ids depend on (+ 0 from each of its values): a read that did not wait
        // for the copy would find the buffer's previous contents (another routing) or nothing.
        let mut y = busy.clone();
        for _ in 0..8 {
            y = (y.matmul(&busy)? * 1e-3)?;
        }
        let zeros = y
            .abs()?
            .ge(1e30)?
            .to_dtype(DType::U32)?
            .flatten_all()?
            .narrow(0, 0, 2 * n as usize)?
            .reshape((2 * t, k))?;
        // [2t, k], its second half: a view at offset t·k.
        let ids = (Tensor::arange_step(0u32, 6 * n, 3, &dev)?.reshape((2 * t, k))? + zeros)?
            .narrow(0, t, t)?;
        let ahead = crate::model::host_ids::HostIds::start(&ids)?;
        // And work queued behind the copy, which the wait must not need.
        let z = y.matmul(&busy)?;
        let (got, got_k) = ahead.wait()?;
        let want = ids.flatten_all()?.to_vec1::<u32>()?;
        assert_eq!(got_k, k);
        assert_eq!(got, want, "{t} tokens × {k}");
        assert_eq!(got.first().copied(), Some(3 * n));
        drop(z);
    }
    Ok(())
}
