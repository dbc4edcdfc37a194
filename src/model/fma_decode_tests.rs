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
