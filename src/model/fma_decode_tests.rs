//! The one-FMA decode of `cuda/dequant_gemm.cu`'s register kernel, checked where no GPU is needed:
//! a Q4_K/Q5_K weight `d·sc·q - dmin·m` is one FMA from the float `0.5 + q/256` when the addend
//! `128·d·sc + dmin·m` is exact in f32 (the kernel tests that per 256-value step and falls back to
//! the two-operation decode where it is not). These tests pin how often it holds on blocks other
//! writers made (llama.cpp's quantizer: the fixture; candle's: the CUDA test's weights), and build
//! the two-expert weights the CUDA test (`moe_cuda_tests`) uses to run both decodes.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Result, Tensor};

/// Deterministic values in [0, 1) (a 64-bit LCG): the assertions below are on the blocks these
/// quantize to, so they must not change from run to run.
pub(crate) fn lcg_uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

/// `[2, out, inp]` weights: expert 0 spread evenly over [-1, 1) (exact addends: the one-FMA
/// decode), expert 1 alternating values in [0, 1) and in (-1e-3, 0] (every sub-block's min tiny
/// against its scale: inexact addends, the two-operation decode).
pub(crate) fn two_experts(out: usize, inp: usize) -> Result<Tensor> {
    let even = lcg_uniform(out * inp, 7).into_iter().map(|u| 2.0 * u - 1.0);
    let tiny_mins = lcg_uniform(out * inp, 11)
        .chunks(2)
        .flat_map(|p| [p[0], -1e-3 * p[1]])
        .collect::<Vec<_>>();
    let all: Vec<f32> = even.chain(tiny_mins).collect();
    Tensor::from_vec(all, (2, out, inp), &Device::Cpu)
}

/// A Q4_K/Q5_K block's (`d·sc`, `dmin·m`) per sub-block (`d`, `dmin`, 12 packed scale bytes
/// first; the 6-bit scales and mins unpacked as ggml's `get_scale_min_k4`). Both products are exact.
pub(crate) fn k4_sub_scales(b: &[u8]) -> [(f32, f32); 8] {
    let h = |i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let (dall, dmin, q) = (h(0), h(2), &b[4..16]);
    std::array::from_fn(|j| {
        let (sc, m) = if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        };
        (dall * f32::from(sc), dmin * f32::from(m))
    })
}

/// Q4_K/Q5_K sub-blocks (8 per 144- or 176-byte block) whose addend `128·d·sc + dmin·m` is exact
/// in f32, and those whose is not: (exact, inexact). The kernel's `dq_scales` test, on the CPU
/// (f64 holds the sum exactly).
pub(crate) fn k4_addends(blocks: &[u8], block_bytes: usize) -> (usize, usize) {
    let (mut exact, mut inexact) = (0, 0);
    for b in blocks.chunks_exact(block_bytes) {
        for (d1, m1) in k4_sub_scales(b) {
            // 128·(d·sc): a power of two times an exact product, the kernel's 128·d1
            let a = 128.0 * d1;
            if f64::from(a + m1) == f64::from(a) + f64::from(m1) {
                exact += 1;
            } else {
                inexact += 1;
            }
        }
    }
    (exact, inexact)
}

/// For a Q4_K/Q5_K quantization of [`two_experts`]: expert 0's addends are all exact and expert
/// 1's are not, so a kernel run on it takes both decodes. Other types: nothing to check.
pub(crate) fn assert_both_decodes(q: &QTensor) -> Result<()> {
    let bb = match q.dtype() {
        GgmlDType::Q4K => 144,
        GgmlDType::Q5K => 176,
        _ => return Ok(()),
    };
    let data = q.data()?;
    let half = data.len() / 2;
    let (e0, e1) = (k4_addends(&data[..half], bb), k4_addends(&data[half..], bb));
    let qt = q.dtype();
    assert_eq!(
        e0.1, 0,
        "{qt:?}: expert 0 {e0:?} must take the one-FMA decode only"
    );
    assert!(
        e1.1 > 0,
        "{qt:?}: expert 1 {e1:?} must take the two-operation decode"
    );
    Ok(())
}

/// candle's own quantizer on the CUDA test's weights: one expert for each decode.
#[test]
fn candles_blocks_of_the_two_experts_take_both_decodes() -> Result<()> {
    let w = two_experts(64, 512)?;
    for qt in [GgmlDType::Q4K, GgmlDType::Q5K] {
        assert_both_decodes(&QTensor::quantize(&w, qt)?)?;
    }
    Ok(())
}

/// llama.cpp's quantizer (the fixture `llama_model_quantize` wrote, K-quant mix): every Q4_K and
/// Q5_K sub-block's addend is exact, so the kernel runs the one-FMA decode on all of them.
#[test]
fn llama_cpps_k_quant_blocks_all_take_the_one_fma_decode() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
    let m = crate::gguf::GgufModel::open(&path).expect("fixture");
    let (mut exact, mut tensors) = (0, 0);
    for t in m.tensors() {
        let bb = match t.info.dtype.name {
            "Q4_K" => 144,
            "Q5_K" => 176,
            _ => continue,
        };
        let (e, inexact) = k4_addends(t.bytes(), bb);
        assert_eq!(
            inexact,
            0,
            "{}: {inexact} inexact addends of {}",
            t.info.name,
            e + inexact
        );
        exact += e;
        tensors += 1;
    }
    assert!(
        tensors >= 20 && exact > 10_000,
        "{tensors} tensors, {exact} sub-blocks"
    );
}

/// The f16 decode (Q4_K's default in the register kernel; `GLMCHECK_DEQUANT_EXPERTS=directh`) on
/// the CPU: the nibble q (or 16q for a high nibble) as the f16 subnormal q·2^-24, converted to f32, then
/// `fma(d1·2^24 (2^20 for a high nibble), that, -m1)`. Rounded once from `d1·q - m1` for every
/// block, so it must equal candle's decode bit for bit (there is no addend to keep exact) — on
/// llama.cpp's blocks and on candle's, the inexact-addend expert included.
fn f16_decode_q4k(block: &[u8]) -> Vec<f32> {
    let (scales, qs) = (k4_sub_scales(block), &block[16..144]);
    let mut y = Vec::with_capacity(256);
    for p in 0..4 {
        for hi in 0..2 {
            let (d1, m1) = scales[2 * p + hi];
            let scale = d1 * if hi == 0 { 16_777_216.0 } else { 1_048_576.0 };
            let mask = if hi == 0 { 0x0F } else { 0xF0 };
            for &b in &qs[32 * p..32 * p + 32] {
                let sub = half::f16::from_bits(u16::from(b & mask)).to_f32();
                y.push(scale.mul_add(sub, -m1));
            }
        }
    }
    y
}

fn assert_f16_decode(blocks: &[u8], want: &[f32], what: &str) {
    assert_eq!(blocks.len() / 144 * 256, want.len(), "{what}: sizes");
    for (i, (b, w)) in blocks
        .chunks_exact(144)
        .zip(want.chunks_exact(256))
        .enumerate()
    {
        let got = f16_decode_q4k(b);
        if let Some(k) = got
            .iter()
            .zip(w)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{what}: block {i} value {k}: f16 decode {} where candle decodes {}",
                got[k], w[k]
            );
        }
    }
}

#[test]
fn the_f16_decode_equals_candles_q4k_decode_bit_for_bit() -> Result<()> {
    // candle's blocks: both experts (the second's addends are inexact: the one-FMA decode falls
    // back there, the f16 decode must not need to)
    let q = QTensor::quantize(&two_experts(64, 512)?, GgmlDType::Q4K)?;
    assert_both_decodes(&q)?;
    let want = q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_f16_decode(&q.data()?, &want, "candle's Q4_K");
    // llama.cpp's blocks: every Q4_K tensor of the fixture
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
    let m = crate::gguf::GgufModel::open(&path).expect("fixture");
    let mut n = 0;
    for t in m.tensors().filter(|t| t.info.dtype.name == "Q4_K") {
        // glmcheck's CPU decoder: candle's block decode, checked against it in gguf::dequant
        let want = t.dequantize().expect("fixture tensor");
        assert_f16_decode(t.bytes(), &want, &t.info.name);
        n += 1;
    }
    assert!(n >= 10, "{n} Q4_K tensors");
    Ok(())
}

/// `a·b + c` rounded once to bf16 (round to nearest, ties to even), for bf16 values `a`, `b`, `c`:
/// what `fma.rn.bf16x2` computes. The exact sum is `s + e` (f64 TwoSum, with the product exact in
/// f64: 8 by 8 significant bits); `e` breaks the ties `s` alone would leave.
pub(crate) fn bf16_fma(a: f32, b: f32, c: f32) -> f32 {
    let p = f64::from(a) * f64::from(b);
    let s = p + f64::from(c);
    let bb = s - p;
    let e = (p - (s - bb)) + (f64::from(c) - bb);
    if s == 0.0 || !s.is_finite() {
        return s as f32;
    }
    // s's 52 fraction bits keep 7: the 45 below decide
    let bits = s.to_bits();
    let rem = bits & ((1 << 45) - 1);
    let half = 1u64 << 44;
    let away = e != 0.0 && (e > 0.0) == (s > 0.0); // the exact value lies beyond s (in magnitude)
    let up = rem > half || (rem == half && (away || (e == 0.0 && (bits >> 45) & 1 == 1)));
    let kept = (bits & !((1 << 45) - 1)) + if up { 1 << 45 } else { 0 };
    f64::from_bits(kept) as f32
}

/// The packed bf16 decode of one Q4_K block (`cuda/dequant_gemm.cu` `bf2_fma`, dequant-fast's
/// experts): `bf16(bf16(d·sc)·q − bf16(dmin·m))`, or `None` where a sub-block's `bf16(d·sc)·2^129` is
/// no bf16 (the kernel's step then takes the f16 decode).
pub(crate) fn packed_decode_q4k(block: &[u8]) -> Option<Vec<f32>> {
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    let (scales, qs) = (k4_sub_scales(block), &block[16..144]);
    let mut y = Vec::with_capacity(256);
    for p in 0..4 {
        for hi in 0..2 {
            let (d1, m1) = scales[2 * p + hi];
            let (s, m) = (bf(d1), bf(m1));
            let e = (half::bf16::from_f32(d1).to_bits() >> 7) & 0xFF;
            if s != 0.0 && !(1..=125).contains(&e) {
                return None;
            }
            for &b in &qs[32 * p..32 * p + 32] {
                let q = if hi == 0 { b & 0xF } else { b >> 4 };
                y.push(bf16_fma(s, f32::from(q), -m));
            }
        }
    }
    Some(y)
}

/// The packed bf16 decode of one Q6_K block (210 bytes: ql, qh, 16 int8 scales, f16 d; ggml's
/// order): `bf16(bf16(d·sc)·(q − 32))`, or `None` where a 16-value scale's `bf16(d·sc)·2^131` is no
/// bf16 (the kernel's step then takes the exact decode).
pub(crate) fn packed_decode_q6k(block: &[u8]) -> Option<Vec<f32>> {
    let d = half::f16::from_le_bytes([block[208], block[209]]).to_f32();
    let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
    let mut y = vec![0f32; 256];
    for n in 0..2 {
        for l in 0..32 {
            let (a, b, h) = (ql[64 * n + l], ql[64 * n + l + 32], qh[32 * n + l]);
            let qs = [
                (a & 0xF) | ((h & 3) << 4),
                (b & 0xF) | (((h >> 2) & 3) << 4),
                (a >> 4) | (((h >> 4) & 3) << 4),
                (b >> 4) | (((h >> 6) & 3) << 4),
            ];
            for (j, q) in qs.into_iter().enumerate() {
                let scale = d * f32::from(sc[8 * n + l / 16 + 2 * j] as i8);
                let s = half::bf16::from_f32(scale);
                let e = (s.to_bits() >> 7) & 0xFF;
                if s.to_f32() != 0.0 && !(1..=123).contains(&e) {
                    return None;
                }
                y[128 * n + 32 * j + l] = bf16_fma(s.to_f32(), f32::from(q) - 32.0, 0.0);
            }
        }
    }
    Some(y)
}

/// The Q6_K model against candle's decode of the same blocks: within one bf16 rounding of the
/// rounded scale (`|w − exact| ≤ 2^-8·|exact|` plus a unit), most weights equal to the exact
/// value rounded to bf16.
/// On candle's blocks and on every Q6_K tensor llama.cpp's quantizer wrote into the fixture.
#[test]
fn the_packed_q6k_decode_is_candles_up_to_the_rounded_scale() -> Result<()> {
    let check = |blocks: &[u8], want: &[f32], what: &str| {
        let (mut num, mut den) = (0f64, 0f64);
        for (b, w) in blocks.chunks_exact(210).zip(want.chunks_exact(256)) {
            let got = packed_decode_q6k(b).expect("scales in range");
            for (g, x) in got.iter().zip(w) {
                let ulp = f32::EPSILON * 65536.0 * x.abs().max(f32::MIN_POSITIVE);
                assert!(
                    (g - x).abs() <= 2f32.powi(-8) * x.abs() + ulp,
                    "{what}: {g} against {x}"
                );
                num += f64::from(g - x).powi(2);
                den += f64::from(*x).powi(2);
            }
        }
        let rel = (num / den).sqrt();
        eprintln!("{what}: Q6_K packed decode rel-L2 {rel:.2e} against candle's");
        assert!(rel < 4e-3, "{what}: {rel}");
    };
    let q = QTensor::quantize(&two_experts(64, 512)?, GgmlDType::Q6K)?;
    let want = q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    check(&q.data()?, &want, "candle's Q6_K");
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
    let m = crate::gguf::GgufModel::open(&path).expect("fixture");
    let mut n = 0;
    for t in m.tensors().filter(|t| t.info.dtype.name == "Q6_K") {
        check(
            t.bytes(),
            &t.dequantize().expect("fixture tensor"),
            &t.info.name,
        );
        n += 1;
    }
    assert!(n >= 1, "{n} Q6_K tensors");
    let large = (two_experts(64, 512)?.narrow(0, 0, 1)? * 10.0)?;
    let q = QTensor::quantize(&large, GgmlDType::Q6K)?;
    assert!(q
        .data()?
        .chunks_exact(210)
        .all(|b| packed_decode_q6k(b).is_none()));
    Ok(())
}

/// The model of `fma.rn.bf16x2` against cases worked by hand: a tie broken by the addend's far
/// bits, a plain tie to even, a product the sum leaves exact.
#[test]
fn the_bf16_fma_model_rounds_once() {
    // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); a tiny positive addend breaks it up
    assert_eq!(bf16_fma(1.0, 1.0, 2f32.powi(-8)), 1.0);
    assert_eq!(
        bf16_fma(1.0 + 2f32.powi(-7), 1.0, 2f32.powi(-8)),
        1.0 + 2.0 * 2f32.powi(-7)
    );
    let tie_up = bf16_fma(2f32.powi(-8) + 2f32.powi(-30), 1.0, 1.0);
    assert_eq!(tie_up, 1.0 + 2f32.powi(-7));
    // 3·5 − 1 = 14 exactly
    assert_eq!(bf16_fma(3.0, 5.0, -1.0), 14.0);
    // 255·15 = 3825 = 1110_1111_0001b needs 12 bits: its top 8 are 3824 and the rest is below half
    assert_eq!(bf16_fma(255.0, 15.0, 0.0), 3824.0);
    assert_eq!(bf16_fma(255.0, 15.0, 7.0), 3840.0); // 3832 is the tie: to even (1111_0000)
                                                    // a negative sum rounds by magnitude
    assert_eq!(
        bf16_fma(-1.0, 1.0, -(2f32.powi(-8) + 2f32.powi(-30))),
        -(1.0 + 2f32.powi(-7))
    );
}

/// How far the packed decode is from the GGUF's values (candle's decode, i.e. dequant mode's) on
/// blocks other writers made: llama.cpp's quantizer (every Q4_K tensor of the fixture) and
/// candle's. Each weight is within 2^-8·(15·|d·sc| + |dmin·m|) plus one bf16 unit of its own of
/// the exact decode rounded to bf16. Over whole tensors the relative L2 against the exact decode is
/// 3.7e-3 (candle's blocks of uniform weights) to 5.8e-3 (the fixture's embedding): 2–4 times what
/// rounding the exact values to bf16 costs (dequant mode's weights), because `dmin·m` rounded to
/// 8 bits errs by a part of the sub-block's range, not of the weight.
#[test]
fn the_packed_decode_stays_within_its_bound_of_the_ggufs_values() -> Result<()> {
    let mut checked = Vec::new();
    let mut check = |blocks: &[u8], exact: &[f32], what: &str| {
        let (mut num, mut rnum, mut den, mut differ) = (0f64, 0f64, 0f64, 0usize);
        let mut outside = 0;
        for (b, w) in blocks.chunks_exact(144).zip(exact.chunks_exact(256)) {
            // a block outside the packed decode takes the f16 decode: the exact values
            let Some(got) = packed_decode_q4k(b) else {
                outside += 1;
                continue;
            };
            let scales = k4_sub_scales(b);
            for (k, (g, x)) in got.iter().zip(w).enumerate() {
                let (d1, m1) = scales[k / 32];
                let want = half::bf16::from_f32(*x).to_f32();
                let ulp = f32::EPSILON * 65536.0 * want.abs().max(f32::MIN_POSITIVE);
                let bound = 2f32.powi(-8) * (15.0 * d1.abs() + m1.abs()) + ulp;
                assert!(
                    (g - want).abs() <= bound,
                    "{what}: packed {g} against {want} (d·sc {d1}, dmin·m {m1})"
                );
                differ += usize::from(g.to_bits() != want.to_bits());
                num += f64::from(g - x).powi(2);
                rnum += f64::from(want - x).powi(2);
                den += f64::from(*x).powi(2);
            }
        }
        let rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        let rounding = (rnum / den.max(f64::MIN_POSITIVE)).sqrt();
        eprintln!(
            "{what}: rel-L2 {rel:.2e} against the exact decode (its bf16 rounding: {rounding:.2e}), \
             {differ} of {} weights differ from that rounding, {outside} blocks outside the packed decode",
            exact.len()
        );
        assert!(
            2 * outside < blocks.len() / 144,
            "{what}: {outside} blocks outside"
        );
        assert!(rel < 1e-2 && rel < 5.0 * rounding, "{what}: rel-L2 {rel}");
        checked.push(exact.len());
    };
    let q = QTensor::quantize(&two_experts(64, 512)?, GgmlDType::Q4K)?;
    let want = q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    check(&q.data()?, &want, "candle's Q4_K");
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
    let m = crate::gguf::GgufModel::open(&path).expect("fixture");
    for t in m.tensors().filter(|t| t.info.dtype.name == "Q4_K") {
        let want = t.dequantize().expect("fixture tensor");
        check(t.bytes(), &want, &t.info.name);
    }
    assert!(checked.len() >= 11, "{} tensors", checked.len());
    Ok(())
}

/// A sub-block whose `d·sc` is 2^-1 or more has no packed scale: the model says so (the kernel's
/// step takes the f16 decode there), and one below it does.
#[test]
fn a_large_scale_leaves_the_packed_decode() -> Result<()> {
    let w = (two_experts(64, 512)?.narrow(0, 0, 1)? * 10.0)?; // values in [-10, 10): d·sc ≈ 1.3
    let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
    let data = q.data()?;
    assert!(data
        .chunks_exact(144)
        .all(|b| packed_decode_q4k(b).is_none()));
    let q = QTensor::quantize(&(w / 10.0)?, GgmlDType::Q4K)?;
    assert!(q
        .data()?
        .chunks_exact(144)
        .all(|b| packed_decode_q4k(b).is_some()));
    Ok(())
}
