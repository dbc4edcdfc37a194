//! The fused kernels against the candle chains they replace, bit for bit, on the GPU (`cargo test
//! --features cuda` on a machine with one; skipped without a device).

use super::*;
use candle_core::Device;

fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(_) => {
            eprintln!("no CUDA device: skipped");
            None
        }
    }
}

use crate::model::cuda_ffi::bits;

/// How many values of `a` and `b` differ in their bits (a length difference counts too).
fn differing(a: &Tensor, b: &Tensor) -> Result<usize> {
    let (a, b) = (bits(a)?, bits(b)?);
    Ok(a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len()))
}

/// The heads-to-tokens copy equals candle's transpose + reshape bit for bit (f32, f16, bf16;
/// GLM-5's 64 heads of 256 values at 256 tokens, small odd shapes, inputs that start one head
/// into their buffer); rows that are not whole 16-byte pieces, and views that do not start on
/// a 16-byte boundary, are declined.
#[test]
fn heads_to_tokens_equals_candles_transpose_copy_bit_for_bit() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    for (h, t, v) in [
        (64usize, 256usize, 256usize),
        (3, 5, 24),
        (2, 7, 8),
        (2, 3, 4),
    ] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let size = dtype.size_in_bytes();
            // one head more, then narrowed away: the input starts t·v values into its buffer
            let whole = Tensor::randn(0f32, 1.0, (h + 1, t, v), &dev)?.to_dtype(dtype)?;
            let x = whole.narrow(0, 1, h)?;
            let want = x.transpose(0, 1)?.reshape((t, h * v))?;
            let got = heads_to_tokens_kernel(&x)?;
            if !(v * size).is_multiple_of(16) || !(t * v * size).is_multiple_of(16) {
                assert!(
                    got.is_none(),
                    "{h}x{t}x{v} {dtype:?}: not whole 16-byte pieces"
                );
                continue;
            }
            let got = got.ok_or_else(|| candle_core::Error::Msg("kernel declined".into()))?;
            assert_eq!(got.dims(), &[t, h * v]);
            let differ = differing(&got, &want)?;
            assert_eq!(
                differ, 0,
                "{h}x{t}x{v} {dtype:?}: {differ} values differ from candle's copy"
            );
        }
    }
    Ok(())
}

/// The fused softmax equals candle's five-launch chain bit for bit, in f32, f16 and bf16, with
/// a causal mask of `finfo.min` (rows of one allowed key included), key counts below, at and
/// past a warp's width, and a scale that is not a power of two (its rounding to the dtype
/// matters). A row read with the wrong query's mask, or a scale applied in f32, differs.
#[test]
fn the_fused_masked_softmax_equals_candles_chain_bit_for_bit() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let scale = 1.0 / (256f64).sqrt() * 1.2345;
    // (heads, queries, keys): causal masks where queries = keys, else a random one.
    for (h, t, s) in [
        (3usize, 5usize, 5usize),
        (4, 32, 32),
        (2, 77, 77),
        (3, 6, 40),
    ] {
        let mask = if t == s {
            crate::model::ops::CausalMask::new(t, DType::F32, &dev)?.additive
        } else {
            let allowed = Tensor::rand(0f32, 1.0, (t, s), &dev)?.ge(0.3)?;
            crate::model::ops::additive(&allowed, f64::from(f32::MIN))?
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let scores = (Tensor::randn(0f32, 4.0, (h, t, s), &dev)?).to_dtype(dtype)?;
            let got = masked_softmax(&scores, scale, &mask)?
                .ok_or_else(|| candle_core::Error::Msg("kernel declined".into()))?;
            let want = candle_nn::ops::softmax_last_dim(
                &(&scores * scale)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&mask)?,
            )?
            .to_dtype(dtype)?;
            assert_eq!(got.dtype(), dtype);
            let differ = differing(&got, &want)?;
            assert_eq!(
                differ, 0,
                "{dtype:?} h={h} t={t} s={s}: {differ} values differ"
            );
        }
    }
    Ok(())
}

/// The fused RMSNorm equals `ops::RmsNorm`'s candle chain bit for bit in f32, f16 and bf16:
/// GLM-5's widths (6144 hidden, 2048 q_lora, 512 kv_lora) and odd ones (36: two warps, one
/// nearly idle; 100; 1000), rows of very different scales, a weight that is not 1. A sum in
/// another order, an rsqrt, or the weight applied before rounding differs somewhere.
#[test]
fn the_fused_rms_norm_equals_candles_chain_bit_for_bit() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    for (rows, n) in [
        (256usize, 6144usize),
        (37, 2048),
        (19, 512),
        (5, 36),
        (7, 100),
        (3, 1000),
    ] {
        let scales = Tensor::arange(0u32, rows as u32, &dev)?
            .to_dtype(DType::F32)?
            .affine(0.37, -3.0)?
            .exp()?
            .unsqueeze(1)?;
        let x = Tensor::randn(0f32, 1.0, (rows, n), &dev)?.broadcast_mul(&scales)?;
        let w = (Tensor::randn(0f32, 0.2, n, &dev)? + 1.0)?;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (x, w) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
            let norm = crate::model::ops::RmsNorm::new(w.clone(), 1e-5);
            let got = rms_norm(&x, &w, 1e-5)?
                .ok_or_else(|| candle_core::Error::Msg("kernel declined".into()))?;
            let want = norm.chain(&x)?;
            assert_eq!(got.dims(), want.dims());
            let differ = differing(&got, &want)?;
            assert_eq!(differ, 0, "{dtype:?} {rows}x{n}: {differ} values differ");
            // what forward takes on CUDA: the kernel
            let differ = differing(&norm.forward(&x)?, &got)?;
            assert_eq!(
                differ, 0,
                "{dtype:?} {rows}x{n}: forward, {differ} values differ"
            );
        }
    }
    let x = Tensor::zeros((2, 32), DType::BF16, &dev)?;
    let w = Tensor::ones(32, DType::BF16, &dev)?;
    assert!(
        rms_norm(&x, &w, 1e-5)?.is_none(),
        "32 values: candle's small sum"
    );
    Ok(())
}

/// The one-launch keys and values equal the narrows, broadcast and cat they replace, bit for
/// bit, one value a thread and 16 bytes a thread (GLM-5's 192 | 64 | 256 split at 64 heads and
/// 40 tokens, scaled down, and an odd one the 16-byte copies leave to the other); a column from
/// the wrong head or token differs.
#[test]
fn the_fused_mla_keys_and_values_equal_the_chain() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    for (t, h, nope, rope, v, pieces) in [
        (7usize, 4usize, 24usize, 8usize, 32usize, false),
        (3, 5, 5, 3, 7, false),
        (7, 4, 24, 8, 32, true),
        (40, 64, 192, 64, 256, true),
        (3, 5, 5, 3, 7, true),
    ] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let kv = Tensor::randn(0f32, 1.0, (t, h, nope + v), &dev)?.to_dtype(dtype)?;
            let k_rot = Tensor::randn(0f32, 1.0, (t, rope), &dev)?.to_dtype(dtype)?;
            let op = MlaKv {
                nope,
                pieces,
                took: AtomicI32::new(0),
            };
            let out = kv.contiguous()?.apply_op2_no_bwd(&k_rot, &op)?;
            let key_n = h * t * (nope + rope);
            let key = out.narrow(0, 0, key_n)?.reshape((h, t, nope + rope))?;
            let value = out.narrow(0, key_n, h * t * v)?.reshape((h, t, v))?;
            let kvt = kv.transpose(0, 1)?;
            let want_key = Tensor::cat(
                &[
                    &kvt.narrow(2, 0, nope)?,
                    &k_rot.unsqueeze(0)?.broadcast_as((h, t, rope))?,
                ],
                2,
            )?;
            let want_value = kvt.narrow(2, nope, v)?;
            assert!(key.is_contiguous() && value.is_contiguous());
            let case = format!("{t}x{h} {nope}|{rope}|{v} {dtype:?} pieces={pieces}");
            assert_eq!(differing(&key, &want_key)?, 0, "{case}: key");
            assert_eq!(differing(&value, &want_value)?, 0, "{case}: value");
            // GLM-5's split (and the scaled one) in every dtype takes the 16-byte path when asked;
            // the odd split, or not asked, one value a thread
            let sixteen = pieces && (nope, rope, v) != (5, 3, 7);
            let want_took = if sixteen {
                16
            } else {
                dtype.size_in_bytes() as i32
            };
            assert_eq!(op.took.load(Ordering::Relaxed), want_took, "{case}: path");
        }
    }
    Ok(())
}

/// The grouped combine equals candle's `index_add` chain (each row's output times its f32
/// weight, rounded to the dtype, added to its token in row order) bit for bit, in f32, f16 and
/// bf16, with 8 slots over 16 experts and 3 over 4 (rows of one token far apart). Adding a
/// token's rows in another order, or in f32, differs in some values.
#[test]
fn the_grouped_token_sum_equals_candles_index_add_bit_for_bit() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    for (t, k, e, h) in [(37usize, 8usize, 16u32, 300usize), (9, 3, 4, 64)] {
        // token i → experts (5i + j) mod e, j < k: k distinct experts, rows spread over the table.
        let ids: Vec<u32> = (0..t)
            .flat_map(|i| (0..k).map(move |j| ((i as u32) * 5 + j as u32) % e))
            .collect();
        let g = crate::model::grouping::Grouping::new(
            &Tensor::from_vec(ids, (t, k), &Device::Cpu)?,
            e as usize,
        )?;
        let rows = g.rows;
        let table = g.table.to_device(&dev)?;
        let (tokens, slots) = (table.narrow(0, 0, rows)?, table.narrow(0, rows, rows)?);
        let order = g.token_order(k);
        let order = Tensor::from_vec(order, 2 * rows, &dev)?;
        let w = Tensor::rand(0f32, 1.0, (t, k), &dev)?;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let y = Tensor::randn(0f32, 3.0, (rows, h), &dev)?.to_dtype(dtype)?;
            let got = token_sum(&y, &w, &order)?
                .ok_or_else(|| candle_core::Error::Msg("kernel declined".into()))?;
            let wr = w.flatten_all()?.index_select(&slots, 0)?.unsqueeze(1)?;
            let ys = y
                .to_dtype(DType::F32)?
                .broadcast_mul(&wr)?
                .to_dtype(dtype)?;
            let want = Tensor::zeros((t, h), dtype, &dev)?.index_add(&tokens, &ys, 0)?;
            let (a, b) = (bits(&got)?, bits(&want)?);
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "{dtype:?} t={t} k={k}: {differ} values differ");
        }
    }
    Ok(())
}

/// The fused combine equals candle's `broadcast_mul → sum(1) → to_dtype` bit for bit (8 slots
/// as GLM-5 routes, and an odd count), into f32, f16 and bf16. Summing the slots in another
/// order or contracting a product into the sum differs in some values.
#[test]
fn the_fused_slot_sum_equals_candles_chain_bit_for_bit() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    for (t, k, h) in [(5usize, 8usize, 300usize), (17, 3, 64)] {
        let y = Tensor::randn(0f32, 3.0, (t, k, h), &dev)?;
        let w = Tensor::rand(0f32, 1.0, (t, k), &dev)?;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let got = slot_sum(&y, &w, dtype)?
                .ok_or_else(|| candle_core::Error::Msg("kernel declined".into()))?;
            let want = y.broadcast_mul(&w.unsqueeze(2)?)?.sum(1)?.to_dtype(dtype)?;
            assert_eq!(got.dims(), &[t, h]);
            let differ = differing(&got, &want)?;
            assert_eq!(
                differ, 0,
                "{dtype:?} t={t} k={k} h={h}: {differ} values differ"
            );
        }
    }
    Ok(())
}
