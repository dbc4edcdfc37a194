//! The one name table of the `glm-dsa` architecture: every GGUF tensor (llama.cpp's names), the
//! Hugging Face transformers parameter it becomes (`GlmMoeDsaForCausalLM`), and the vLLM parameter
//! (`deepseek_v2.py`) that holds it, with roles, symbolic shapes and tensor-parallel styles.
//! Nothing else in glmcheck spells a tensor name.
//!
//! Templates use `{L}` for the layer index.

use serde::Serialize;

use super::config::Config;

/// A symbolic dimension, resolved against a [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Hidden,
    /// 2 · hidden_size (an MTP block's `eh_proj` input: [enorm(embedding); hnorm(hidden)])
    Hidden2,
    Vocab,
    QLora,
    KvLora,
    Heads,
    /// qk_nope_head_dim
    Nope,
    /// v_head_dim
    V,
    /// kv_lora_rank + qk_rope_head_dim (kv_a_proj_with_mqa's output)
    KvA,
    /// heads · (nope + rope): q_b_proj's output
    HeadsQk,
    /// heads · (nope + v): kv_b_proj's output
    HeadsKv,
    /// heads · v: o_proj's input
    HeadsV,
    IdxHeads,
    IdxDim,
    /// index_n_heads · index_head_dim
    IdxQ,
    Inter,
    MoeInter,
    /// 2 · moe_intermediate_size (fused gate+up of the routed experts)
    MoeInter2,
    /// moe_intermediate_size · n_shared_experts
    SharedInter,
    Experts,
}

impl Dim {
    pub fn resolve(self, c: &Config) -> usize {
        match self {
            Dim::Hidden => c.hidden_size,
            Dim::Hidden2 => 2 * c.hidden_size,
            Dim::Vocab => c.vocab_size,
            Dim::QLora => c.q_lora_rank,
            Dim::KvLora => c.kv_lora_rank,
            Dim::Heads => c.num_attention_heads,
            Dim::Nope => c.qk_nope_head_dim,
            Dim::V => c.v_head_dim,
            Dim::KvA => c.kv_lora_rank + c.qk_rope_head_dim,
            Dim::HeadsQk => c.num_attention_heads * c.qk_head_dim(),
            Dim::HeadsKv => c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            Dim::HeadsV => c.num_attention_heads * c.v_head_dim,
            Dim::IdxHeads => c.index_n_heads,
            Dim::IdxDim => c.index_head_dim,
            Dim::IdxQ => c.index_n_heads * c.index_head_dim,
            Dim::Inter => c.intermediate_size,
            Dim::MoeInter => c.moe_intermediate_size,
            Dim::MoeInter2 => 2 * c.moe_intermediate_size,
            Dim::SharedInter => c.moe_intermediate_size * c.n_shared_experts,
            Dim::Experts => c.n_routed_experts,
        }
    }
}

pub fn resolve(shape: &[Dim], c: &Config) -> Vec<usize> {
    shape.iter().map(|d| d.resolve(c)).collect()
}

/// Which layers a tensor exists in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Not per layer (embedding, final norm, lm_head).
    Global,
    /// Every decoder layer.
    Layer,
    /// Layers below `first_k_dense_replace`.
    Dense,
    /// Layers from `first_k_dense_replace` on.
    Moe,
}

impl Scope {
    pub fn has_layer(self, c: &Config, l: usize) -> bool {
        match self {
            Scope::Global => false,
            Scope::Layer => true,
            Scope::Dense => !c.is_moe_layer(l),
            Scope::Moe => c.is_moe_layer(l),
        }
    }
}

/// How the HF tensor is rebuilt from its GGUF source(s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rebuild {
    /// One GGUF tensor; the HF shape is its `ne` reversed.
    Direct,
    /// kv_b_proj from `attn_k_b` [H, kv_lora, nope] (k_b transposed) and `attn_v_b` [H, v, kv_lora]:
    /// `cat([k_b.transpose(1, 2), v_b], dim=1).reshape(H·(nope+v), kv_lora)`.
    KvB,
    /// One routed expert's matrix: slice `{E}` of the stacked GGUF tensor (`ffn_*_exps`, [E, …]).
    ExpertSlice,
}

/// What a tensor is, for reports and for the shard plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    FinalNorm,
    InputNorm,
    PostAttnNorm,
    QANorm,
    KvANorm,
    IndexerKNorm,
    IndexerKNormBias,
    AttnQA,
    AttnQB,
    AttnKvA,
    AttnKvB,
    AttnOut,
    IndexerQB,
    IndexerK,
    IndexerWeights,
    FfnGate,
    FfnUp,
    FfnDown,
    Router,
    RouterBias,
    ExpertGate,
    ExpertUp,
    ExpertDown,
    SharedGate,
    SharedUp,
    SharedDown,
    LmHead,
}

/// One GGUF source tensor: name template and PyTorch-order symbolic shape.
#[derive(Debug, Clone, Copy)]
pub struct GgufSrc {
    pub name: &'static str,
    pub shape: &'static [Dim],
}

/// One Hugging Face parameter and where it comes from in the GGUF.
#[derive(Debug, Clone, Copy)]
pub struct HfDef {
    pub hf: &'static str,
    pub role: Role,
    pub scope: Scope,
    pub shape: &'static [Dim],
    pub rebuild: Rebuild,
    pub gguf: &'static [GgufSrc],
    /// An older single-tensor form some converters wrote instead of `gguf` (kv_b_proj as `attn_kv_b`).
    pub legacy: Option<GgufSrc>,
}

/// vLLM's tensor-parallel style for a parameter (from `deepseek_v2.py` / `linear.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TpStyle {
    Replicated,
    /// Output rows cut (ColumnParallelLinear).
    Column,
    /// Input columns cut (RowParallelLinear).
    Row,
    /// MergedColumnParallelLinear: each part's rows cut, then concatenated.
    MergedColumn,
    /// FusedMoE w13 [E, 2I, H]: gate rows r then up rows r.
    MoeW13,
    /// FusedMoE w2 [E, H, I]: input columns cut.
    MoeW2,
    /// VocabParallelEmbedding / ParallelLMHead: vocab padded to ×64, contiguous rows per rank.
    Vocab,
}

/// One vLLM parameter: the HF parameters it concatenates (along `cat_dim`), and its TP style.
#[derive(Debug, Clone, Copy)]
pub struct VllmDef {
    pub vllm: &'static str,
    pub parts: &'static [&'static str],
    pub cat_dim: usize,
    pub style: TpStyle,
    pub scope: Scope,
    /// vLLM >= 0.33's name, where it differs from the older name in `vllm` (which the plan uses).
    pub v033: Option<&'static str>,
    /// `state_dict()`-only names of modules registered twice (same storage as this parameter).
    /// A dump may hold the parameter under any of its names.
    pub aliases: &'static [&'static str],
}

/// vLLM buffers a `state_dict()` dump may hold beside the parameters: not weights of the GGUF, so
/// recognized and not compared (vLLM 0.33, `deepseek_v32`: attention scales, RoPE caches).
pub const VLLM_BUFFERS: &[&str] = &[
    "model.layers.{L}.self_attn._k_scale",
    "model.layers.{L}.self_attn._v_scale",
    "model.layers.{L}.self_attn._q_scale",
    "model.layers.{L}.self_attn._prob_scale",
    "model.layers.{L}.self_attn.rotary_emb.cos_sin_cache",
    "model.layers.{L}.self_attn.indexer_rope_emb.cos_sin_cache",
];

/// Whether `name` is one of vLLM's buffers ([`VLLM_BUFFERS`]).
pub fn is_vllm_buffer(name: &str) -> bool {
    VLLM_BUFFERS
        .iter()
        .any(|t| match_template(t, name).is_some())
}

/// Which vLLM version's parameter names a dump uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VllmNames {
    /// vLLM >= 0.33 (`MoERunner`: routed experts under `mlp.experts.routed_experts.*`).
    V033,
    /// Earlier vLLM (`mlp.experts.w13_weight`).
    Legacy,
}

impl VllmDef {
    /// The parameter's name (template) under a version's naming.
    pub fn name_in(&self, names: VllmNames) -> &'static str {
        match names {
            VllmNames::V033 => self.v033.unwrap_or(self.vllm),
            VllmNames::Legacy => self.vllm,
        }
    }

    /// Every name (template) a dump may hold this parameter under: the plan's, other versions', and
    /// `state_dict()` aliases.
    pub fn all_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.vllm)
            .chain(self.v033)
            .chain(self.aliases.iter().copied())
    }
}

mod hf_table;
mod names;
mod vllm_table;

pub use hf_table::HF_TABLE;
pub use names::*;
pub use vllm_table::{MtpDef, MTP_TABLE, VLLM_TABLE};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vllm_part_is_an_hf_parameter_of_the_same_scope() {
        for v in VLLM_TABLE {
            for p in v.parts {
                let d = HF_TABLE.iter().find(|d| d.hf == *p);
                let d = d.unwrap_or_else(|| panic!("{} names unknown HF parameter {p}", v.vllm));
                assert_eq!(d.scope, v.scope, "{}", v.vllm);
            }
        }
        // And every HF parameter lands in exactly one vLLM parameter.
        for d in HF_TABLE {
            let n = VLLM_TABLE
                .iter()
                .filter(|v| v.parts.contains(&d.hf))
                .count();
            assert_eq!(n, 1, "{}", d.hf);
        }
    }

    #[test]
    fn every_table_entry_has_its_own_role() {
        for (i, a) in HF_TABLE.iter().enumerate() {
            for b in &HF_TABLE[i + 1..] {
                assert_ne!(a.role, b.role, "{} and {} share a role", a.hf, b.hf);
            }
        }
    }

    #[test]
    fn templates_match_only_their_own_names() {
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.12.attn_k_b.weight"),
            Some(Idx::layer(12))
        );
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.x.attn_k_b.weight"),
            None
        );
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.012.attn_k_b.weight"),
            None
        );
        assert_eq!(
            match_template("output.weight", "output.weight"),
            Some(Idx::default())
        );
        assert_eq!(
            match_template(
                "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
                "model.layers.4.mlp.experts.17.up_proj.weight"
            ),
            Some(Idx {
                layer: Some(4),
                expert: Some(17)
            })
        );
        let (d, s, i) = lookup_gguf("blk.3.attn_v_b.weight").unwrap();
        assert_eq!(d.role, Role::AttnKvB);
        assert_eq!(s.name, "blk.{L}.attn_v_b.weight");
        assert_eq!(i, Idx::layer(3));
    }

    #[test]
    fn glm5_shapes_match_the_reference_sheet() {
        let c = Config::glm5();
        let shape = |n: &str| {
            let (d, _) = lookup_hf(n).unwrap();
            resolve(d.shape, &c)
        };
        assert_eq!(
            shape("model.layers.5.self_attn.kv_b_proj.weight"),
            [28672, 512]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.q_b_proj.weight"),
            [16384, 2048]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.o_proj.weight"),
            [6144, 16384]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.kv_a_proj_with_mqa.weight"),
            [576, 6144]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.indexer.wq_b.weight"),
            [4096, 2048]
        );
        assert_eq!(
            shape("model.layers.5.mlp.experts.255.down_proj.weight"),
            [6144, 2048]
        );
        let n_params = hf_params(&c).len();
        // 3 dense layers × 17 + 75 MoE layers × (19 + 3 × 256 experts) + 3 globals
        assert_eq!(n_params, 3 * 17 + 75 * (19 + 3 * 256) + 3);
    }
}
