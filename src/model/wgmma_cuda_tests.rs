//! The wgmma kernel against candle's decode-then-matmul, on the GPU (`cargo test --features cuda`
//! on a Hopper machine; skipped without a CUDA device or on another GPU generation). Built here
//! with `tools/build-cuda.sh --tests`.

use super::*;
use crate::model::moe_cuda::dense_tiled;
use candle_core::{Device, Tensor};

/// rel-L2 of `a` against `b` (both f32).
fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f32> {
    let num = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()?;
    let den = b.sqr()?.sum_all()?.to_scalar::<f32>()?;
    Ok((num / den).sqrt())
}

/// The device, where the kernel runs on it; `None` (skipped) without a CUDA device or on a GPU
/// other than compute capability 9.0. A build for 9.0 without the kernel fails: the test would
/// otherwise pass by skipping on the very GPU it is for.
fn hopper() -> Option<Device> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return None;
    };
    let built_for_hopper = option_env!("CUDA_COMPUTE_CAP").is_none_or(|c| c == "90");
    match wgmma_here() {
        Some(true) => Some(dev),
        Some(false) => {
            eprintln!("not a compute capability 9.0 GPU: skipped");
            None
        }
        None => {
            assert!(
                !built_for_hopper,
                "built for compute capability 9.0 without the wgmma kernel"
            );
            eprintln!("built without the wgmma kernel: skipped");
            None
        }
    }
}

/// Element by element: |got − want| within the output's rounding of |want| (bf16 2^-8, f16
/// 2^-11 relative: half an ulp at the bottom of a binade, with room for f32 sums in another order)
/// plus 1e-4 of Σ|x||w| (cancellation). A missing or doubled 16-value chunk, a wrong row or token
/// moves most elements far past that; a few wrong elements fail here where a global rel-L2 would not.
fn assert_close(
    got: &Tensor,
    want: &Tensor,
    scale: &Tensor,
    dtype: DType,
    what: &str,
) -> Result<()> {
    let rel = if dtype == DType::BF16 {
        1.0 / 256.0
    } else {
        1.0 / 2048.0
    };
    let (g, w, s) = (
        got.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?,
        scale.flatten_all()?.to_vec1::<f32>()?,
    );
    let bad: Vec<usize> = (0..w.len())
        .filter(|&i| (g[i] - w[i]).abs() > rel * w[i].abs() + 1e-4 * s[i])
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} values off, first at {}: {} against {}",
        bad.len(),
        w.len(),
        bad[0],
        g[bad[0]],
        w[bad[0]]
    );
    Ok(())
}

/// Every type the kernel covers, bf16 and f16, both tiles, on weights of 192 rows (not a
/// multiple of 128: the wide tile runs as the narrow one) and 256 or 128, of 256 values a row (one
/// step: no second stage), 512 (two; Q6_K's rows then sit off 16-byte boundaries), 768 (three:
/// the last step in the first buffer) and 2048 (eight), for 5, 33, 130 and 256 tokens (partial and
/// whole tiles of 64 and 128): element by element within the output's rounding of candle's decoded
/// weights rounded to the dtype and multiplied in f32 (the same products, another order of f32
/// sums; [`assert_close`]), and within 4e-3 rel-L2. Q4_K and Q5_K also on weights whose
/// sub-blocks' addends are inexact (`fma_decode_tests::two_experts`' second expert, which
/// `candles_blocks_of_the_two_experts_take_both_decodes` holds to that): Q5_K's two-operation decode. Beside it, the register kernel's dense route on the same inputs (the same
/// decoded values) agrees as closely.
#[test]
fn the_wgmma_dense_kernel_equals_decode_then_matmul() -> Result<()> {
    let Some(dev) = hopper() else {
        return Ok(());
    };
    let mut checked = 0;
    let shapes: [(usize, usize, &[usize]); 4] = [
        (192, 512, &[5, 33, 130, 256]),
        (256, 2048, &[5, 33, 130, 256]),
        (128, 256, &[33, 256]),
        (128, 768, &[33, 256]),
    ];
    for (out, inp, tokens) in shapes {
        let random = (Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)? * 0.05)?;
        let inexact = crate::model::fma_decode_tests::two_experts(out, inp)?
            .get(1)?
            .contiguous()?;
        for (qt, w, weights) in [
            (GgmlDType::Q4K, &random, "random"),
            (GgmlDType::Q5K, &random, "random"),
            (GgmlDType::Q6K, &random, "random"),
            (GgmlDType::Q8_0, &random, "random"),
            (GgmlDType::Q4K, &inexact, "inexact addends"),
            (GgmlDType::Q5K, &inexact, "inexact addends"),
        ] {
            let q = QTensor::quantize_onto(w, qt, &dev)?;
            let decoded = q.dequantize(&dev)?;
            for dtype in [DType::BF16, DType::F16] {
                let wd = decoded.to_dtype(dtype)?.to_dtype(DType::F32)?;
                for &t in tokens {
                    let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?.to_dtype(dtype)?;
                    let xf = x.to_dtype(DType::F32)?;
                    let want = xf.matmul(&wd.t()?)?;
                    let scale = xf.abs()?.matmul(&wd.abs()?.t()?)?;
                    for tile in [WgmmaTile::Wide, WgmmaTile::Narrow] {
                        let what = format!(
                            "{qt:?} {weights} {dtype:?} [{out}, {inp}] {t} tokens {tile:?}"
                        );
                        let got = dense_wgmma(&q, &x, tile)?
                            .expect("taken")
                            .to_dtype(DType::F32)?;
                        assert_eq!(got.dims(), &[t, out], "{what}");
                        assert_close(&got, &want, &scale, dtype, &what)?;
                        let r = rel_l2(&got, &want)?;
                        assert!(r < 4e-3, "{what}: rel-L2 {r}");
                        checked += 1;
                    }
                    if t == 256 {
                        let tiled = dense_tiled(&q, &x)?.expect("taken").to_dtype(DType::F32)?;
                        let wg = dense_wgmma(&q, &x, WgmmaTile::Wide)?
                            .expect("taken")
                            .to_dtype(DType::F32)?;
                        let r = rel_l2(&wg, &tiled)?;
                        eprintln!("{qt:?} {weights} {dtype:?} [{out}, {inp}]: wgmma against the register kernel rel-L2 {r:.2e}");
                        assert!(
                            r < 4e-3,
                            "{qt:?} {dtype:?}: against the register kernel {r}"
                        );
                    }
                }
            }
            // not taken: f32 activations
            let x = Tensor::randn(0f32, 1.0, (40, inp), &dev)?;
            assert!(
                dense_wgmma(&q, &x, WgmmaTile::Wide)?.is_none(),
                "f32: not taken"
            );
        }
        let q4 = QTensor::quantize_onto(&random, GgmlDType::Q4_0, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (40, inp), &dev)?.to_dtype(DType::BF16)?;
        assert!(
            dense_wgmma(&q4, &x, WgmmaTile::Wide)?.is_none(),
            "Q4_0: not taken"
        );
    }
    // 6 weights × 2 dtypes × 2 tiles × (4 + 4 + 2 + 2) token counts
    assert_eq!(checked, 6 * 2 * 2 * 12);
    Ok(())
}

/// One-hot tokens: token i is e_{k(i)}, so y[i][r] is exactly the decoded weight W[r][k(i)] rounded
/// to the dtype (one product, the rest zeros): bit for bit, for Q8_0 (unaligned rows) and Q4_K
/// (aligned, the f16 decode), both tiles. On a mismatch it names, for the first bad tokens, which
/// column the kernel read instead (another k: the descriptor or the k permutation; another token's:
/// the token layout) or how many rows are off (the fragment or row layout), so a first run on a GPU
/// says what is wrong, not only that something is.
#[test]
fn the_wgmma_kernel_reads_one_hot_tokens_exactly() -> Result<()> {
    let Some(dev) = hopper() else {
        return Ok(());
    };
    let (out, inp, t) = (256usize, 768usize, 130usize);
    let w = (Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)? * 0.05)?;
    let ks: Vec<usize> = (0..t).map(|i| (i * 37 + 5) % inp).collect();
    let mut onehot = vec![0f32; t * inp];
    for (i, &k) in ks.iter().enumerate() {
        onehot[i * inp + k] = 1.0;
    }
    let x = Tensor::from_vec(onehot, (t, inp), &dev)?;
    for qt in [GgmlDType::Q8_0, GgmlDType::Q4K] {
        let q = QTensor::quantize_onto(&w, qt, &dev)?;
        for dtype in [DType::BF16, DType::F16] {
            let wd: Vec<Vec<f32>> = q
                .dequantize(&dev)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_vec2()?;
            let column = |k: usize| -> Vec<f32> { wd.iter().map(|row| row[k]).collect() };
            for tile in [WgmmaTile::Wide, WgmmaTile::Narrow] {
                let got: Vec<Vec<f32>> = dense_wgmma(&q, &x.to_dtype(dtype)?, tile)?
                    .expect("taken")
                    .to_dtype(DType::F32)?
                    .to_vec2()?;
                let mut findings = Vec::new();
                for (i, &k) in ks.iter().enumerate() {
                    if got[i] == column(k) {
                        continue;
                    }
                    let read = (0..inp).find(|&k2| got[i] == column(k2));
                    findings.push(match read {
                        Some(k2) => match ks.iter().position(|&kj| kj == k2) {
                            Some(j) => format!("token {i} (k {k}) holds token {j}'s column (k {k2})"),
                            None => format!("token {i}: k {k} read as k {k2} (k mod 16: {} -> {})", k % 16, k2 % 16),
                        },
                        None => {
                            let off: Vec<usize> =
                                (0..out).filter(|&r| got[i][r] != wd[r][k]).collect();
                            format!(
                                "token {i} (k {k}): {} of {out} rows off, first {:?} (row mod 16 {:?})",
                                off.len(),
                                &off[..off.len().min(6)],
                                off.iter().take(6).map(|r| r % 16).collect::<Vec<_>>()
                            )
                        }
                    });
                }
                assert!(
                    findings.is_empty(),
                    "{qt:?} {dtype:?} {tile:?}: {} of {t} tokens wrong; {}",
                    findings.len(),
                    findings[..findings.len().min(8)].join("; ")
                );
            }
        }
    }
    Ok(())
}

/// `GLMCHECK_DENSE` routes only past the register kernel's 32 tokens; `wgmma` takes the narrow
/// tile up to 64 tokens and the wide one past them, `wgmma64` the narrow one; other values none.
#[test]
fn the_wgmma_route_starts_past_one_tile_and_fits_its_tile_to_the_tokens() {
    for dense in [Some("wgmma"), Some("wgmma64"), Some("decode"), None] {
        for t in [1, 16, DENSE_TILED_TOKENS] {
            assert_eq!(wgmma_tile_for(dense, t), None, "{dense:?} {t} tokens");
        }
    }
    let narrow = Some(WgmmaTile::Narrow);
    assert_eq!(
        wgmma_tile_for(Some("wgmma"), DENSE_TILED_TOKENS + 1),
        narrow
    );
    assert_eq!(wgmma_tile_for(Some("wgmma"), 64), narrow);
    assert_eq!(wgmma_tile_for(Some("wgmma"), 65), Some(WgmmaTile::Wide));
    assert_eq!(wgmma_tile_for(Some("wgmma64"), 256), narrow);
    assert_eq!(wgmma_tile_for(Some("tiled"), 256), None);
    assert_eq!(wgmma_tile_for(None, 256), None);
}
