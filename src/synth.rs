//! `glmcheck synth`: a random-weight GGUF with GLM-5's exact tensor names, shapes and metadata
//! (llama.cpp's `glm-dsa` layout), at GLM-5's real dimensions or the fixtures' tiny ones, so that
//! the forward can be run and timed at the real size without downloading 400 GB.
//!
//! Values: independent draws per tensor, approximately normal with std 0.02 (transformers'
//! `initializer_range`; a sum of four uniforms), norm weights 1, the indexer's LayerNorm bias 0.
//! Blocks are made by candle's quantizers (llama.cpp's reference `quantize_row_*`). `q4_k_m` follows
//! llama-quantize's Q4_K_M choices as they show in the fixtures' Q4_K_M file (made by llama.cpp):
//! Q4_K, with Q6_K for the lm_head and for `ffn_down*` in llama.cpp's "more bits" layers, Q5_K for `attn_output`, Q8_0 for the indexer's key projection, the router and every 1-D
//! tensor in F32, and llama.cpp's fallback for rows that are not whole 256-value blocks (Q4_K/Q5_K →
//! Q5_0, Q6_K → Q8_0). Deterministic for a seed, whatever the core count.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::arch::glm_dsa::{self, Idx, Scope};
use crate::arch::Config;
use crate::gguf::writer::{string_array, write_gguf_streamed, WriteTensor};
use crate::gguf::{DequantError, GgmlType, Value};

/// Which dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dims {
    /// GLM-5's published config (hidden 6144, 256 experts, vocab 154880).
    Glm5,
    /// The fixtures' tiny model (hidden 256, 8 experts, vocab 600).
    Tiny,
}

/// The weight types to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mix {
    Q4KM,
    Q8_0,
    Bf16,
    F32,
}

#[derive(Debug, Clone)]
pub struct SynthSpec {
    pub dims: Dims,
    pub layers: usize,
    /// Leading dense layers (None: the dims' own count, at most a third of `layers` and at least
    /// one when there is more than one layer).
    pub dense: Option<usize>,
    pub mix: Mix,
    pub seed: u64,
}

/// What was written.
#[derive(Debug, Clone, Serialize)]
pub struct SynthReport {
    pub dims: Dims,
    pub mix: Mix,
    pub seed: u64,
    pub layers: usize,
    pub dense_layers: usize,
    pub tensors: usize,
    pub bytes: u64,
    /// Tensor count per GGML type.
    pub types: BTreeMap<String, usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("--layers must be at least 1")]
    NoLayers,
    #[error("--dense {dense} exceeds --layers {layers}")]
    TooDense { dense: usize, layers: usize },
    #[error(transparent)]
    Quantize(#[from] DequantError),
    #[error("writing {path}: {err}")]
    Io { path: String, err: std::io::Error },
}

/// The config a spec describes.
pub fn config(spec: &SynthSpec) -> Result<Config, SynthError> {
    let base = match spec.dims {
        Dims::Glm5 => Config::glm5(),
        Dims::Tiny => Config::tiny(),
    };
    if spec.layers == 0 {
        return Err(SynthError::NoLayers);
    }
    let dense = spec.dense.unwrap_or_else(|| {
        base.first_k_dense_replace
            .min((spec.layers / 3).max(usize::from(spec.layers > 1)))
    });
    if dense > spec.layers {
        return Err(SynthError::TooDense {
            dense,
            layers: spec.layers,
        });
    }
    Ok(Config {
        num_hidden_layers: spec.layers,
        first_k_dense_replace: dense,
        num_nextn_predict_layers: 0,
        ..base
    })
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers and every third one
/// between them.
fn more_bits(i: usize, n: usize) -> bool {
    let first = n / 8;
    i < first || i >= 7 * n / 8 || (i - first) % 3 == 2
}

/// The type `name` (ggml dims `ne`) gets in `mix`.
pub fn tensor_type(mix: Mix, name: &str, ne: &[u64], layer: Option<usize>, c: &Config) -> GgmlType {
    if ne.len() == 1 || name.ends_with("ffn_gate_inp.weight") {
        return GgmlType::F32;
    }
    let want = match mix {
        Mix::F32 => return GgmlType::F32,
        Mix::Bf16 => return GgmlType::BF16,
        Mix::Q8_0 => GgmlType::Q8_0,
        Mix::Q4KM => {
            let more = layer.is_some_and(|l| more_bits(l, c.num_hidden_layers));
            if name == "output.weight" || (more && name.contains("ffn_down")) {
                GgmlType::Q6_K
            } else if name.contains("attn_output") {
                GgmlType::Q5_K
            } else if name.contains("indexer.attn_k") {
                GgmlType::Q8_0
            } else {
                GgmlType::Q4_K
            }
        }
    };
    let row = ne[0];
    if row.is_multiple_of(want.block_size) {
        return want;
    }
    let fallback = match want {
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::Q5_0,
    };
    if row.is_multiple_of(fallback.block_size) {
        fallback
    } else {
        GgmlType::F32
    }
}

/// Every tensor of the file in llama.cpp's order (globals, then each block), with its type.
pub fn tensors(c: &Config, mix: Mix) -> Vec<WriteTensor<'static>> {
    let mut out = Vec::new();
    for layer in std::iter::once(None).chain((0..c.num_hidden_layers).map(Some)) {
        for d in glm_dsa::HF_TABLE {
            let applies = match layer {
                None => d.scope == Scope::Global,
                Some(l) => d.scope.has_layer(c, l),
            };
            if !applies {
                continue;
            }
            for s in d.gguf {
                let name = glm_dsa::name(
                    s.name,
                    Idx {
                        layer,
                        expert: None,
                    },
                );
                let ne: Vec<u64> = glm_dsa::resolve(s.shape, c)
                    .iter()
                    .rev()
                    .map(|&d| d as u64)
                    .collect();
                let dtype = tensor_type(mix, &name, &ne, layer, c);
                out.push(WriteTensor {
                    name,
                    ne,
                    dtype,
                    data: None,
                });
            }
        }
    }
    out
}

/// GGUF metadata for `c` under `glm-dsa.*`, as llama.cpp's converter writes it, with a byte-level
/// BPE tokenizer of `c.vocab_size` tokens (the 256 byte symbols, then filler words) and merges, so
/// that glmcheck's tokenizer and llama.cpp's loader accept the file.
pub fn metadata(c: &Config, mix: Mix) -> Vec<(String, Value)> {
    let u = |v: usize| Value::U32(v as u32);
    let f = |v: f64| Value::F32(v as f32);
    let k = |s: &str| format!("glm-dsa.{s}");
    let file_type = match mix {
        Mix::F32 => 0,
        Mix::Bf16 => 32,
        Mix::Q8_0 => 7,
        Mix::Q4KM => 15,
    };
    let (tokens, merges) = vocabulary(c.vocab_size);
    let eos = c.vocab_size.saturating_sub(1);
    vec![
        (
            "general.architecture".into(),
            Value::String("glm-dsa".into()),
        ),
        ("general.type".into(), Value::String("model".into())),
        (
            "general.name".into(),
            Value::String("glmcheck synth (random weights)".into()),
        ),
        ("general.file_type".into(), u(file_type)),
        (k("block_count"), u(c.num_hidden_layers)),
        (k("nextn_predict_layers"), u(0)),
        (k("context_length"), u(c.max_position_embeddings)),
        (k("embedding_length"), u(c.hidden_size)),
        (k("feed_forward_length"), u(c.intermediate_size)),
        (k("attention.head_count"), u(c.num_attention_heads)),
        (k("attention.head_count_kv"), u(1)),
        (k("attention.q_lora_rank"), u(c.q_lora_rank)),
        (k("attention.kv_lora_rank"), u(c.kv_lora_rank)),
        (
            k("attention.key_length"),
            u(c.kv_lora_rank + c.qk_rope_head_dim),
        ),
        (k("attention.value_length"), u(c.kv_lora_rank)),
        (k("attention.key_length_mla"), u(c.qk_head_dim())),
        (k("attention.value_length_mla"), u(c.v_head_dim)),
        (k("rope.dimension_count"), u(c.qk_rope_head_dim)),
        (k("rope.freq_base"), f(c.rope_theta)),
        (k("attention.layer_norm_rms_epsilon"), f(c.rms_norm_eps)),
        (k("leading_dense_block_count"), u(c.first_k_dense_replace)),
        (k("expert_count"), u(c.n_routed_experts)),
        (k("expert_used_count"), u(c.num_experts_per_tok)),
        (k("expert_shared_count"), u(c.n_shared_experts)),
        (k("expert_feed_forward_length"), u(c.moe_intermediate_size)),
        (k("expert_weights_scale"), f(c.routed_scaling_factor)),
        (k("expert_weights_norm"), Value::Bool(c.norm_topk_prob)),
        (k("expert_group_count"), u(c.n_group)),
        (k("expert_group_used_count"), u(c.topk_group)),
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        (k("expert_gating_func"), u(2)),
        (k("attention.indexer.head_count"), u(c.index_n_heads)),
        (k("attention.indexer.key_length"), u(c.index_head_dim)),
        (k("attention.indexer.top_k"), u(c.index_topk)),
        (k("vocab_size"), u(c.vocab_size)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("glm4".into())),
        ("tokenizer.ggml.tokens".into(), string_array(&tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                crate::gguf::ValueType::I32,
                (0..tokens.len()).map(|_| Value::I32(1)).collect(),
            ),
        ),
        ("tokenizer.ggml.merges".into(), string_array(&merges)),
        ("tokenizer.ggml.eos_token_id".into(), u(eos)),
        ("tokenizer.ggml.padding_token_id".into(), u(eos)),
    ]
}

/// GPT-2's byte-to-symbol table: printable bytes map to themselves, the rest to U+0100 onwards.
fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// `n` tokens: the 256 byte symbols, then merged pairs of lowercase letters (with and without the
/// leading-space symbol `Ġ`), then fillers; merges for the pairs.
fn vocabulary(n: usize) -> (Vec<String>, Vec<String>) {
    let bytes = byte_symbols();
    let mut tokens: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    let space = bytes[b' ' as usize];
    'pairs: for a in 'a'..='z' {
        for b in 'a'..='z' {
            if tokens.len() + 2 > n {
                break 'pairs;
            }
            tokens.push(format!("{a}{b}"));
            merges.push(format!("{a} {b}"));
        }
    }
    for a in 'a'..='z' {
        if tokens.len() >= n {
            break;
        }
        tokens.push(format!("{space}{a}"));
        merges.push(format!("{space} {a}"));
    }
    let mut i = 0;
    while tokens.len() < n {
        tokens.push(format!("<|synth_{i}|>"));
        i += 1;
    }
    tokens.truncate(n);
    (tokens, merges)
}

/// A small fast generator (xorshift64*), seeded per tensor and per chunk.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: u64, chunk: u64) -> Self {
        let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ chunk.rotate_left(32);
        // splitmix64 finalizer so that neighbouring streams start far apart
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately N(0, std²): (Σ of four uniforms − 2)·√3.
    fn normal(&mut self, std: f32) -> f32 {
        let s = self.unit() + self.unit() + self.unit() + self.unit();
        (s - 2.0) * 3f32.sqrt() * std
    }
}

/// What a tensor's values are: ones (norm weights), zeros (the indexer's LayerNorm bias) or
/// random.
fn values_kind(name: &str) -> Option<f32> {
    if name.ends_with("norm.weight") {
        Some(1.0)
    } else if name.ends_with("k_norm.bias") {
        Some(0.0)
    } else {
        None
    }
}

/// Values per chunk: 1 Mi, rounded to whole rows.
const CHUNK: u64 = 1 << 20;

/// Tensor `index`'s bytes, generated chunk by chunk on all cores and written in order.
fn fill(
    t: &WriteTensor<'_>,
    index: usize,
    seed: u64,
    out: &mut dyn Write,
) -> Result<(), SynthError> {
    let row = t.ne.first().copied().unwrap_or(1).max(1);
    let total: u64 = t.ne.iter().product();
    let per = (CHUNK / row).max(1) * row;
    let chunks = total.div_ceil(per);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let constant = values_kind(&t.name);
    let make = |c: u64| -> Result<Vec<u8>, DequantError> {
        let n = per.min(total - c * per) as usize;
        let xs: Vec<f32> = match constant {
            Some(v) => vec![v; n],
            None => {
                let mut rng = Rng::new(seed, index as u64, c);
                (0..n).map(|_| rng.normal(0.02)).collect()
            }
        };
        crate::gguf::dequant::quantize(&t.name, t.dtype, &xs)
    };
    let io = |err| SynthError::Io {
        path: t.name.clone(),
        err,
    };
    let mut c = 0;
    while c < chunks {
        let batch: Vec<u64> = (c..chunks.min(c + threads)).collect();
        let parts: Vec<Result<Vec<u8>, DequantError>> = std::thread::scope(|s| {
            let handles: Vec<_> = batch.iter().map(|&i| s.spawn(move || make(i))).collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(DequantError::Bad {
                            tensor: t.name.clone(),
                            reason: "a quantizer thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        for p in parts {
            out.write_all(&p?).map_err(io)?;
        }
        c += batch.len() as u64;
    }
    Ok(())
}

/// Writes the file (to a temp file beside `out`, renamed into place); `progress(done, total)`
/// counts tensor bytes.
pub fn synth(
    spec: &SynthSpec,
    out: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    let c = config(spec)?;
    let list = tensors(&c, spec.mix);
    let meta = metadata(&c, spec.mix);
    let total: u64 = list.iter().map(WriteTensor::n_bytes).sum();
    let mut types = BTreeMap::new();
    for t in &list {
        *types.entry(t.dtype.name.to_string()).or_insert(0) += 1;
    }
    let path = out.display().to_string();
    let io = |err| SynthError::Io {
        path: path.clone(),
        err,
    };
    let mut bytes = 0;
    crate::outputs::write_atomically(out, |tmp| -> Result<(), SynthError> {
        let file = std::fs::File::create(tmp).map_err(io)?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
        let mut done = 0;
        let mut failed = None;
        bytes = write_gguf_streamed(&mut w, &meta, &list, 32, &mut |i, out| {
            let t = &list[i];
            match fill(t, i, spec.seed, out) {
                Ok(()) => {
                    done += t.n_bytes();
                    progress(done, total);
                    Ok(())
                }
                Err(e) => {
                    let msg = e.to_string();
                    failed = Some(e);
                    Err(std::io::Error::other(msg))
                }
            }
        })
        .map_err(|e| failed.take().unwrap_or_else(|| io(e)))?;
        w.flush().map_err(io)
    })
    .map_err(|e| match e {
        crate::outputs::AtomicError::Write(e) => e,
        crate::outputs::AtomicError::Rename(err) => io(err),
    })?;
    Ok(SynthReport {
        dims: spec.dims,
        mix: spec.mix,
        seed: spec.seed,
        layers: c.num_hidden_layers,
        dense_layers: c.first_k_dense_replace,
        tensors: list.len(),
        bytes,
        types,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;

    fn spec(dims: Dims, layers: usize, mix: Mix) -> SynthSpec {
        SynthSpec {
            dims,
            layers,
            dense: None,
            mix,
            seed: 7,
        }
    }

    /// The file reads back as the config it was made from, with the fixture's Q4_K_M type mix.
    #[test]
    fn a_tiny_synth_reads_back_as_its_config_with_the_fixtures_type_mix() {
        let dir = tempfile::tempdir().expect("tmp");
        let out = dir.path().join("s.gguf");
        let r = synth(&spec(Dims::Tiny, 3, Mix::Q4KM), &out, &mut |_, _| {}).expect("synth");
        let m = GgufModel::open(&out).expect("reads back");
        let read = ConfigReader::read(&m, "glm-dsa").expect("config");
        let defaulted: Vec<_> = read
            .sources
            .iter()
            .filter(|(_, s)| matches!(s, crate::arch::config::Source::Default(_)))
            .collect();
        assert!(defaulted.is_empty(), "{defaulted:?}");
        assert_eq!(read.config, Config::tiny());
        assert_eq!(r.bytes, std::fs::metadata(&out).expect("size").len());
        // Every tensor has the type llama-quantize gave it in the fixture made by llama.cpp.
        let fixture = GgufModel::open(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/tiny/tiny-Q4_K_M.gguf"),
        )
        .expect("fixture");
        let fixture_config = ConfigReader::read(&fixture, "glm-dsa")
            .expect("config")
            .config;
        assert_eq!(fixture_config, Config::tiny());
        let mut differ = Vec::new();
        for t in fixture.tensors() {
            let ours = m.tensor(&t.info.name).map(|o| o.info.dtype);
            if ours != Some(t.info.dtype) {
                differ.push(format!("{} {:?} vs {}", t.info.name, ours, t.info.dtype));
            }
        }
        assert!(differ.is_empty(), "{differ:#?}");
        // Deterministic: the same seed gives the same bytes.
        let again = dir.path().join("t.gguf");
        synth(&spec(Dims::Tiny, 3, Mix::Q4KM), &again, &mut |_, _| {}).expect("synth");
        assert_eq!(
            std::fs::read(&out).expect("a"),
            std::fs::read(&again).expect("b")
        );
    }

    #[test]
    fn glm5_dims_give_glm5s_names_and_shapes() {
        let c = config(&spec(Dims::Glm5, 3, Mix::Q4KM)).expect("config");
        assert_eq!((c.first_k_dense_replace, c.num_hidden_layers), (1, 3));
        let list = tensors(&c, Mix::Q4KM);
        let find = |n: &str| list.iter().find(|t| t.name == n).expect(n);
        assert_eq!(find("blk.1.ffn_gate_exps.weight").ne, vec![6144, 2048, 256]);
        assert_eq!(find("blk.0.attn_k_b.weight").ne, vec![192, 512, 64]);
        // 192-value rows cannot hold 256-value blocks: llama.cpp's Q5_0 fallback.
        assert_eq!(find("blk.0.attn_k_b.weight").dtype, GgmlType::Q5_0);
        assert_eq!(find("output.weight").dtype, GgmlType::Q6_K);
        assert_eq!(find("blk.1.ffn_gate_inp.weight").dtype, GgmlType::F32);
        assert!(list.iter().all(|t| !t.name.starts_with("blk.3.")));
    }

    #[test]
    fn bad_layer_counts_are_refused() {
        assert!(matches!(
            config(&spec(Dims::Tiny, 0, Mix::F32)),
            Err(SynthError::NoLayers)
        ));
        let mut s = spec(Dims::Tiny, 2, Mix::F32);
        s.dense = Some(3);
        assert!(matches!(config(&s), Err(SynthError::TooDense { .. })));
    }
}
