//! Dequantization to f32 through candle's GGML block decoders (`candle_core::quantized::k_quants`),
//! spread over all cores. Works on a tensor's raw bytes straight from the memory map: no copy of the
//! quantized data unless the map is misaligned for the block type.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8K, BlockQ8_0, BlockQ8_1,
};
use candle_core::quantized::GgmlType as CandleBlock;
use half::{bf16, f16};

use super::error::DequantError;
use super::types::GgmlType;

/// Runs `$body` with `$T` bound to candle's block type for `$dtype`; `None` for types candle lacks.
/// The one list of supported types.
macro_rules! with_block {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            GgmlType::F32 => {
                type $T = f32;
                Some($body)
            }
            GgmlType::F16 => {
                type $T = f16;
                Some($body)
            }
            GgmlType::BF16 => {
                type $T = bf16;
                Some($body)
            }
            GgmlType::Q4_0 => {
                type $T = BlockQ4_0;
                Some($body)
            }
            GgmlType::Q4_1 => {
                type $T = BlockQ4_1;
                Some($body)
            }
            GgmlType::Q5_0 => {
                type $T = BlockQ5_0;
                Some($body)
            }
            GgmlType::Q5_1 => {
                type $T = BlockQ5_1;
                Some($body)
            }
            GgmlType::Q8_0 => {
                type $T = BlockQ8_0;
                Some($body)
            }
            GgmlType::Q8_1 => {
                type $T = BlockQ8_1;
                Some($body)
            }
            GgmlType::Q2_K => {
                type $T = BlockQ2K;
                Some($body)
            }
            GgmlType::Q3_K => {
                type $T = BlockQ3K;
                Some($body)
            }
            GgmlType::Q4_K => {
                type $T = BlockQ4K;
                Some($body)
            }
            GgmlType::Q5_K => {
                type $T = BlockQ5K;
                Some($body)
            }
            GgmlType::Q6_K => {
                type $T = BlockQ6K;
                Some($body)
            }
            GgmlType::Q8_K => {
                type $T = BlockQ8K;
                Some($body)
            }
            _ => None,
        }
    };
}

/// candle's quantized-tensor type for `t` (what a `QTensor` keeps on a device), for the types
/// [`supported`] lists.
pub fn candle_dtype(t: GgmlType) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as D;
    Some(match t {
        GgmlType::F32 => D::F32,
        GgmlType::F16 => D::F16,
        GgmlType::BF16 => D::BF16,
        GgmlType::Q4_0 => D::Q4_0,
        GgmlType::Q4_1 => D::Q4_1,
        GgmlType::Q5_0 => D::Q5_0,
        GgmlType::Q5_1 => D::Q5_1,
        GgmlType::Q8_0 => D::Q8_0,
        GgmlType::Q8_1 => D::Q8_1,
        GgmlType::Q2_K => D::Q2K,
        GgmlType::Q3_K => D::Q3K,
        GgmlType::Q4_K => D::Q4K,
        GgmlType::Q5_K => D::Q5K,
        GgmlType::Q6_K => D::Q6K,
        GgmlType::Q8_K => D::Q8K,
        _ => return None,
    })
}

/// candle's type for `t` when a tensor of it is kept as blocks on a device: the quantized types.
/// Float types gain nothing from it, and candle decodes float `QTensor`s and Q8_1 on the host
/// from a device copy.
pub fn device_blocks(t: GgmlType) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as D;
    candle_dtype(t).filter(|d| !matches!(d, D::F32 | D::F16 | D::BF16 | D::Q8_1))
}

/// `bytes` (whole `dtype` blocks of a tensor of `shape`) as a candle `QTensor` on `device`, the
/// blocks copied into its storage as they are; None for a type not kept as blocks
/// ([`device_blocks`]).
pub fn qtensor(
    name: &str,
    dtype: GgmlType,
    bytes: &[u8],
    shape: &[usize],
    device: &candle_core::Device,
) -> Result<Option<candle_core::quantized::QTensor>, DequantError> {
    use candle_core::quantized::{QStorage, QTensor};
    let Some(cd) = device_blocks(dtype) else {
        return Ok(None);
    };
    with_blocks(name, dtype, bytes, |aligned| {
        QStorage::from_data(std::borrow::Cow::Borrowed(aligned), device, cd)
            .and_then(|s| QTensor::new(s, shape))
    })?
    .map(Some)
    .map_err(|e| DequantError::Bad {
        tensor: name.to_string(),
        reason: e.to_string(),
    })
}

/// Runs `f` on `bytes` checked to be whole `dtype` blocks candle can hold, at an address aligned
/// for them (candle's block casts panic on a misaligned slice): the map itself when it already is
/// (GGUF data is 32-byte aligned), else an 8-byte-aligned copy.
pub fn with_blocks<R>(
    name: &str,
    dtype: GgmlType,
    bytes: &[u8],
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, DequantError> {
    check(name, dtype, bytes)?;
    if (bytes.as_ptr() as usize).is_multiple_of(8) {
        return Ok(f(bytes));
    }
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: a u64 buffer viewed as its bytes: u8 has no alignment or validity requirement, and
    // the view covers only the buffer's own (initialised) memory.
    let view =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, words.len() * 8) };
    view[..bytes.len()].copy_from_slice(bytes);
    Ok(f(&view[..bytes.len()]))
}

/// `xs` (a whole number of `dtype` blocks' values) encoded as `dtype`'s blocks by candle's
/// quantizers (llama.cpp's reference `quantize_row_*`), as the bytes a GGUF stores.
pub fn quantize(name: &str, dtype: GgmlType, xs: &[f32]) -> Result<Vec<u8>, DequantError> {
    let bad = |reason: String| DequantError::Bad {
        tensor: name.to_string(),
        reason,
    };
    if !(xs.len() as u64).is_multiple_of(dtype.block_size.max(1)) {
        return Err(bad(format!(
            "{} values are not whole {dtype} blocks of {}",
            xs.len(),
            dtype.block_size
        )));
    }
    let out = with_block!(dtype, T => {
        let mut blocks = vec![T::zeros(); xs.len() / T::BLCK_SIZE];
        T::from_float(xs, &mut blocks);
        let n = blocks.len() * std::mem::size_of::<T>();
        // SAFETY: candle's block types are plain `repr(C)` data (what it reads GGUF bytes into);
        // viewing them as bytes reads initialised memory only.
        unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, n) }.to_vec()
    });
    out.ok_or_else(|| DequantError::Unsupported {
        tensor: name.to_string(),
        dtype: dtype.name.to_string(),
    })
}

/// Types candle decodes.
pub fn supported(t: GgmlType) -> bool {
    with_block!(t, T => std::mem::size_of::<T>()).is_some()
}

/// Checks that `bytes` is a whole number of `dtype` blocks candle can decode; returns the block count.
pub(crate) fn check(name: &str, dtype: GgmlType, bytes: &[u8]) -> Result<usize, DequantError> {
    let bad = |reason: String| DequantError::Bad {
        tensor: name.to_string(),
        reason,
    };
    let Some(block_bytes) = with_block!(dtype, T => std::mem::size_of::<T>()) else {
        return Err(DequantError::Unsupported {
            tensor: name.to_string(),
            dtype: dtype.name.to_string(),
        });
    };
    if block_bytes as u64 != dtype.type_size {
        return Err(bad(format!(
            "candle's {dtype} block is {block_bytes} bytes, ggml's {}",
            dtype.type_size
        )));
    }
    if !bytes.len().is_multiple_of(block_bytes) {
        return Err(bad(format!(
            "{} bytes is not a whole number of {dtype} blocks ({block_bytes} bytes each)",
            bytes.len()
        )));
    }
    Ok(bytes.len() / block_bytes)
}

/// Dequantizes `bytes` (a whole number of `dtype` blocks) into `out`, which must hold exactly the
/// number of elements those blocks encode. `name` is only used in errors.
pub fn dequantize_into(
    name: &str,
    dtype: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), DequantError> {
    let n_blocks = check(name, dtype, bytes)?;
    let expected = n_blocks as u64 * dtype.block_size;
    if out.len() as u64 != expected {
        return Err(DequantError::Bad {
            tensor: name.to_string(),
            reason: format!(
                "{n_blocks} {dtype} blocks hold {expected} values, the output has room for {}",
                out.len()
            ),
        });
    }
    with_block!(dtype, T => run::<T>(bytes, out));
    Ok(())
}

/// Values decoded per chunk by [`fold_chunks`]: 64 KiB of f32, so a chunk stays in L2.
const CHUNK_VALUES: usize = 16 * 1024;

/// Decodes `bytes` in cache-sized chunks on all cores and folds each chunk into a per-thread
/// accumulator, never materialising the whole tensor: `fold(acc, values)` sees every value once, in
/// order within a thread. Returns the accumulators (one per thread, in tensor order).
pub fn fold_chunks<R: Send>(
    name: &str,
    dtype: GgmlType,
    bytes: &[u8],
    init: impl Fn() -> R + Sync,
    fold: impl Fn(&mut R, &[f32]) + Sync,
) -> Result<Vec<R>, DequantError> {
    check(name, dtype, bytes)?;
    let out = with_block!(dtype, T => fold_run::<T, R>(bytes, &init, &fold));
    out.ok_or_else(|| DequantError::Unsupported {
        tensor: name.to_string(),
        dtype: dtype.name.to_string(),
    })
}

/// Dequantizes into a new vector.
pub fn dequantize(name: &str, dtype: GgmlType, bytes: &[u8]) -> Result<Vec<f32>, DequantError> {
    let n_blocks = bytes.len() as u64 / dtype.type_size.max(1);
    let mut out = alloc_f32(name, n_blocks * dtype.block_size)?;
    dequantize_into(name, dtype, bytes, &mut out)?;
    Ok(out)
}

/// `n` zeroed f32 for tensor `name`, or [`DequantError::Alloc`] when the memory cannot be had
/// (never the allocator's abort).
pub(crate) fn alloc_f32(name: &str, n: u64) -> Result<Vec<f32>, DequantError> {
    let alloc = || DequantError::Alloc {
        tensor: name.to_string(),
        bytes: n.saturating_mul(4),
    };
    let n = usize::try_from(n).map_err(|_| alloc())?;
    let mut out: Vec<f32> = Vec::new();
    out.try_reserve_exact(n).map_err(|_| alloc())?;
    out.resize(n, 0.0);
    Ok(out)
}

/// Below this many output values a tensor is decoded on the calling thread.
const PARALLEL_MIN: usize = 1 << 16;

/// Worker threads: the available parallelism, asked once per process (std reads the cgroup
/// quota files on every call, which cost more than decoding a small tensor).
fn threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `bytes` as blocks of `T`: borrowed when aligned, copied when not.
fn as_blocks<T: CandleBlock>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    let n_blocks = bytes.len() / std::mem::size_of::<T>();
    if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        // SAFETY: the candle block types are `repr(C)` structs of integers, f16 and f32 (or those
        // scalars themselves), valid for every bit pattern; length and alignment were checked.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(bytes.as_ptr() as *const T, n_blocks)
        })
    } else {
        let mut v: Vec<T> = Vec::with_capacity(n_blocks);
        // SAFETY: as above; the destination has capacity for n_blocks and is then fully initialised.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len());
            v.set_len(n_blocks);
        }
        std::borrow::Cow::Owned(v)
    }
}

fn fold_run<T: CandleBlock, R: Send>(
    bytes: &[u8],
    init: &(impl Fn() -> R + Sync),
    fold: &(impl Fn(&mut R, &[f32]) + Sync),
) -> Vec<R> {
    let blocks = as_blocks::<T>(bytes);
    let blocks: &[T] = &blocks;
    let per_chunk = (CHUNK_VALUES / T::BLCK_SIZE).max(1);
    let work = |part: &[T]| {
        let mut acc = init();
        let mut buf = vec![0f32; per_chunk * T::BLCK_SIZE];
        for chunk in part.chunks(per_chunk) {
            let out = &mut buf[..chunk.len() * T::BLCK_SIZE];
            T::to_float(chunk, out);
            fold(&mut acc, out);
        }
        acc
    };
    let n_values = blocks.len() * T::BLCK_SIZE;
    let n_threads = threads().min(n_values / PARALLEL_MIN).max(1);
    if n_threads == 1 {
        return vec![work(blocks)];
    }
    let per_thread = blocks.len().div_ceil(n_threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = blocks
            .chunks(per_thread)
            .map(|part| s.spawn(move || work(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Decodes blocks of `T` into `out` in parallel.
fn run<T: CandleBlock>(bytes: &[u8], out: &mut [f32]) {
    let blocks = as_blocks::<T>(bytes);
    let blocks: &[T] = &blocks;
    let n_blocks = blocks.len();
    let per_block = T::BLCK_SIZE;
    let n_threads = threads().min(out.len() / PARALLEL_MIN).max(1);
    if n_threads == 1 {
        T::to_float(blocks, out);
        return;
    }
    let blocks_per = n_blocks.div_ceil(n_threads);
    std::thread::scope(|s| {
        for (xs, ys) in blocks
            .chunks(blocks_per)
            .zip(out.chunks_mut(blocks_per * per_block))
        {
            s.spawn(move || T::to_float(xs, ys));
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_allocation_that_cannot_succeed_is_an_error_naming_the_tensor() {
        // 2^46 f32 = 256 TiB: past any x86-64 / aarch64 user address space, overcommit or not.
        let err = super::alloc_f32("blk.3.ffn_gate_exps.weight", 1 << 46).expect_err("refused");
        let text = err.to_string();
        assert!(text.contains("blk.3.ffn_gate_exps.weight"), "{text}");
        assert!(text.contains(&(1u64 << 48).to_string()), "{text}");
        assert_eq!(super::alloc_f32("t", 3).expect("small"), vec![0.0; 3]);
    }

    use super::*;

    #[test]
    fn q8_0_block_decodes_by_hand() {
        // d = 0.5 (f16 0x3800), qs = -2, 3, 0, ...
        let mut block = vec![0x00u8, 0x38];
        let mut qs = [0i8; 32];
        qs[0] = -2;
        qs[1] = 3;
        qs[31] = 127;
        block.extend(qs.iter().map(|&q| q as u8));
        let v = dequantize("t", GgmlType::Q8_0, &block).unwrap();
        assert_eq!(v.len(), 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[1], 1.5);
        assert_eq!(v[31], 63.5);
    }

    #[test]
    fn unaligned_bytes_give_the_same_values() {
        let vals: Vec<f32> = (0..100).map(|i| i as f32 * 0.25 - 3.0).collect();
        let mut raw = vec![0u8];
        raw.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        let a = dequantize("t", GgmlType::F32, &raw[1..]).unwrap();
        assert_eq!(a, vals);
    }

    #[test]
    fn unsupported_type_is_a_per_tensor_error() {
        let e = dequantize("blk.0.x", GgmlType::IQ2_XXS, &[0u8; 66]).unwrap_err();
        assert!(e.to_string().contains("IQ2_XXS"), "{e}");
        assert!(!supported(GgmlType::MXFP4));
        assert!(supported(GgmlType::Q6_K));
    }

    #[test]
    fn parallel_split_matches_serial() {
        let n = PARALLEL_MIN * 3 + 32 * 7;
        let raw: Vec<u8> = (0..n / 32 * 34)
            .map(|i| {
                if i % 34 == 1 {
                    0x30
                } else {
                    (i * 7 % 251) as u8
                }
            })
            .collect();
        let par = dequantize("t", GgmlType::Q8_0, &raw).unwrap();
        let blocks: Vec<BlockQ8_0> = raw
            .chunks(34)
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const BlockQ8_0) })
            .collect();
        let mut ser = vec![0f32; n];
        BlockQ8_0::to_float(&blocks, &mut ser);
        assert_eq!(par, ser);
    }
}
