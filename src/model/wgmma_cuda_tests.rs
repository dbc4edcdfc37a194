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

/// Every type the kernel covers, bf16 and f16, both tiles, on weights of 192 rows (not a
/// multiple of 128: the wide tile runs as the narrow one) and 256, of 512 values a row (two steps;
/// Q6_K's rows then sit off 16-byte boundaries) and 2048 (eight steps: both stage buffers
/// reused), for 5, 33, 130 and 256 tokens (partial and whole tiles of 64 and 128): within the
/// output's rounding of candle's decoded weights rounded to the dtype and multiplied in f32 (the
/// same products, another order of f32 sums). A wrong core-matrix layout, k permutation,
/// accumulator layout, row or token gives a rel-L2 near 1. Beside it, the register kernel's dense
/// route on the same inputs (the same decoded values) agrees as closely.
#[test]
fn the_wgmma_dense_kernel_equals_decode_then_matmul() -> Result<()> {
    let Some(dev) = hopper() else {
        return Ok(());
    };
    let mut checked = 0;
    for (out, inp) in [(192, 512), (256, 2048)] {
        let w = (Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu)? * 0.05)?;
        for qt in [
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
        ] {
            let q = QTensor::quantize_onto(&w, qt, &dev)?;
            let decoded = q.dequantize(&dev)?;
            for dtype in [DType::BF16, DType::F16] {
                let wd = decoded.to_dtype(dtype)?.to_dtype(DType::F32)?;
                for t in [5, 33, 130, 256] {
                    let x = Tensor::randn(0f32, 1.0, (t, inp), &dev)?.to_dtype(dtype)?;
                    let want = x.to_dtype(DType::F32)?.matmul(&wd.t()?)?;
                    for tile in [WgmmaTile::Wide, WgmmaTile::Narrow] {
                        let got = dense_wgmma(&q, &x, tile)?
                            .expect("taken")
                            .to_dtype(DType::F32)?;
                        assert_eq!(got.dims(), &[t, out]);
                        let r = rel_l2(&got, &want)?;
                        assert!(
                            r < 4e-3,
                            "{qt:?} {dtype:?} [{out}, {inp}] {t} tokens {tile:?}: rel-L2 {r}"
                        );
                        checked += 1;
                    }
                    if t == 256 {
                        let tiled = dense_tiled(&q, &x)?.expect("taken").to_dtype(DType::F32)?;
                        let wg = dense_wgmma(&q, &x, WgmmaTile::Wide)?
                            .expect("taken")
                            .to_dtype(DType::F32)?;
                        let r = rel_l2(&wg, &tiled)?;
                        eprintln!("{qt:?} {dtype:?} [{out}, {inp}]: wgmma against the register kernel rel-L2 {r:.2e}");
                        assert!(
                            r < 4e-3,
                            "{qt:?} {dtype:?}: against the register kernel {r}"
                        );
                    }
                }
            }
            // not taken: f32 activations, a type it does not decode
            let x = Tensor::randn(0f32, 1.0, (40, inp), &dev)?;
            assert!(
                dense_wgmma(&q, &x, WgmmaTile::Wide)?.is_none(),
                "f32: not taken"
            );
        }
        let q4 = QTensor::quantize_onto(&w, GgmlDType::Q4_0, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (40, inp), &dev)?.to_dtype(DType::BF16)?;
        assert!(
            dense_wgmma(&q4, &x, WgmmaTile::Wide)?.is_none(),
            "Q4_0: not taken"
        );
    }
    assert_eq!(checked, 2 * 4 * 2 * 4 * 2);
    Ok(())
}

/// `GLMCHECK_DENSE` routes only past the register kernel's 32 tokens.
#[test]
fn the_wgmma_route_starts_past_one_tile() {
    for t in [1, 16, DENSE_TILED_TOKENS] {
        assert_eq!(dense_wgmma_tile(t), None, "{t} tokens");
    }
}
