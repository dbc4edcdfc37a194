//! vLLM's tensor-parallel cut of every GLM-5 parameter, as data (a style per parameter from the name
//! table) plus one function that cuts a tensor for a rank.
//!
//! Rules (vLLM `linear.py`, `fused_moe`, `vocab_parallel_embedding.py`, `deepseek_v2.py`):
//! column-parallel cuts output rows (dim 0) into `tp` contiguous blocks; row-parallel cuts input
//! columns (the last dim); merged column-parallel cuts each part's rows and concatenates rank r's
//! pieces; FusedMoE w13 `[E, 2I, H]` holds gate rows r then up rows r, w2 `[E, H, I]` input columns r;
//! vocab-parallel pads the vocab to a multiple of 64 and gives each rank `V_pad / tp` contiguous rows
//! (rows past the real vocab are zero).

use candle_core::Tensor;
use serde::Serialize;

use crate::arch::glm_dsa::{self, Idx, Rebuild, Role, Scope, TpStyle, VllmDef};
use crate::arch::Config;
use crate::gguf::{GgmlType, GgufModel};

/// vLLM's `DEFAULT_VOCAB_PADDING_SIZE`.
pub const VOCAB_PADDING: usize = 64;

pub fn padded_vocab(v: usize) -> usize {
    v.div_ceil(VOCAB_PADDING) * VOCAB_PADDING
}

/// What rank r holds of a full tensor: along `dim`, these `[start, end)` ranges concatenated, then
/// `pad` zero rows (vocab padding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cut {
    pub dim: usize,
    pub ranges: Vec<(usize, usize)>,
    pub pad: usize,
}

impl Cut {
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|(a, b)| b - a).sum::<usize>() + self.pad
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies the cut to a full tensor.
    pub fn apply(&self, full: &Tensor) -> candle_core::Result<Tensor> {
        let mut pieces = Vec::with_capacity(self.ranges.len() + 1);
        for &(a, b) in &self.ranges {
            pieces.push(full.narrow(self.dim, a, b - a)?);
        }
        if self.pad > 0 {
            let mut dims = full.dims().to_vec();
            dims[self.dim] = self.pad;
            pieces.push(Tensor::zeros(dims, full.dtype(), full.device())?);
        }
        if pieces.len() == 1 {
            return Ok(pieces.remove(0));
        }
        Tensor::cat(&pieces, self.dim)
    }
}

/// Why a parameter cannot be cut at this tp (worded by `crate::report::shards`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanProblem {
    /// The parameter's parts are unknown to the name table.
    NoShape,
    /// `n` (`what`: output rows, input columns, …) does not divide by tp.
    NotDivisible {
        what: &'static str,
        n: usize,
        tp: usize,
    },
    /// An expert tensor that is not `[E, rows, cols]`.
    NotThreeD { shape: Vec<usize> },
    /// The attention heads do not divide by tp: a rank would hold part of a head.
    HeadsNotDivisible { heads: usize, tp: usize },
    /// Rank `rank` gets rows `rows`, not the whole heads `heads` the other projections give it.
    HeadsMisaligned {
        rank: usize,
        rows: (usize, usize),
        heads: (usize, usize),
    },
}

/// What is worth knowing about a parameter's cut that is not wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanNote {
    /// A name-table part without its own entry (a table bug).
    NotInTable {
        part: &'static str,
    },
    GgufMissing {
        tensor: String,
    },
    /// A row-parallel cut of `width` columns slices `dtype`'s blocks of `block` values.
    SplitsQuantBlocks {
        width: usize,
        dtype: GgmlType,
        block: u64,
    },
    VocabPadded {
        vocab: usize,
        padded: usize,
    },
    HeadsPerRank {
        heads: usize,
    },
}

/// One parameter's plan.
#[derive(Debug, Clone, Serialize)]
pub struct ParamPlan {
    pub param: String,
    pub layer: Option<usize>,
    pub gguf: Vec<String>,
    /// Quant type of the GGUF source(s); several distinct types are joined with `+`.
    pub dtype: String,
    /// The distinct quant types, in source order.
    #[serde(skip)]
    pub dtypes: Vec<GgmlType>,
    pub full_shape: Vec<usize>,
    pub style: TpStyle,
    pub shard_dim: Option<usize>,
    pub shard_shape: Vec<usize>,
    pub notes: Vec<PlanNote>,
    /// A per-rank cut slices quant blocks of the GGUF data (the shard cannot be cut from the bytes).
    pub splits_quant_blocks: bool,
    /// Cuts that cannot be made (divisibility): the deployment cannot run at this tp.
    pub problems: Vec<PlanProblem>,
    #[serde(skip)]
    pub cuts: Vec<Cut>,
    /// Each fused HF part's extent along the concatenation dim of the full tensor (one entry for an
    /// unfused parameter).
    #[serde(skip)]
    pub part_rows: Vec<usize>,
    #[serde(skip)]
    pub def: &'static VllmDef,
    #[serde(skip)]
    pub idx: Idx,
}

/// Where one HF parameter lies inside a rank's shard of the vLLM parameter that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartSlice {
    pub dim: usize,
    pub start: usize,
    pub len: usize,
}

impl ParamPlan {
    /// Where HF part `part` of this (possibly fused) parameter lies in any rank's shard; `None` when
    /// the parameter has one part (the whole shard is it). Merged column-parallel parts (gate/up,
    /// w13) give each rank `rows / tp` of every part, in part order; a replicated fused parameter
    /// (`fused_qkv_a_proj`, `wk_weights_proj`) keeps the parts whole.
    pub fn part_slice(&self, part: usize, tp: usize) -> Option<PartSlice> {
        if self.part_rows.len() < 2 || part >= self.part_rows.len() {
            return None;
        }
        let merged = matches!(self.style, TpStyle::MergedColumn | TpStyle::MoeW13);
        let rows = |n: usize| if merged { n / tp } else { n };
        Some(PartSlice {
            dim: self.def.cat_dim,
            start: self.part_rows[..part].iter().map(|&n| rows(n)).sum(),
            len: rows(self.part_rows[part]),
        })
    }

    /// Rank r's shard of the full (unsharded vLLM) tensor.
    pub fn shard(&self, full: &Tensor, rank: usize) -> candle_core::Result<Tensor> {
        match self.cuts.get(rank) {
            Some(c) => c.apply(full),
            None => Ok(full.clone()),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ShardPlan {
    pub tp: usize,
    pub params: Vec<ParamPlan>,
    /// GGUF blocks holding MTP (nextn) layers: not part of the served model, so not planned.
    pub mtp_blocks: Vec<usize>,
}

impl ShardPlan {
    /// The vLLM parameter that holds HF parameter `hf_template` (the name table's template) of
    /// `layer`, and which of its parts it is.
    pub fn holder(&self, hf_template: &str, layer: Option<usize>) -> Option<(&ParamPlan, usize)> {
        self.params
            .iter()
            .filter(|p| p.layer == layer)
            .find_map(|p| {
                p.def
                    .parts
                    .iter()
                    .position(|x| *x == hf_template)
                    .map(|i| (p, i))
            })
    }
}

fn blocks(n: usize, tp: usize, r: usize, offset: usize) -> (usize, usize) {
    let per = n / tp;
    (offset + r * per, offset + (r + 1) * per)
}

/// The cut of one style for every rank; `problems` collects divisibility failures.
fn cuts_for(
    style: TpStyle,
    shape: &[usize],
    parts: &[usize],
    tp: usize,
    problems: &mut Vec<PlanProblem>,
) -> (Option<usize>, Vec<Cut>) {
    let rank_cuts = |dim: usize, f: &dyn Fn(usize) -> (Vec<(usize, usize)>, usize)| {
        (0..tp)
            .map(|r| {
                let (ranges, pad) = f(r);
                Cut { dim, ranges, pad }
            })
            .collect::<Vec<_>>()
    };
    if shape.is_empty() {
        problems.push(PlanProblem::NoShape);
        return (None, Vec::new());
    }
    let mut need = |n: usize, what: &'static str| {
        if !n.is_multiple_of(tp) {
            problems.push(PlanProblem::NotDivisible { what, n, tp });
        }
    };
    match style {
        TpStyle::Replicated => (None, Vec::new()),
        TpStyle::Column => {
            need(shape[0], "output rows");
            (
                Some(0),
                rank_cuts(0, &|r| (vec![blocks(shape[0], tp, r, 0)], 0)),
            )
        }
        TpStyle::Row => {
            let d = shape.len() - 1;
            need(shape[d], "input columns");
            (
                Some(d),
                rank_cuts(d, &|r| (vec![blocks(shape[d], tp, r, 0)], 0)),
            )
        }
        TpStyle::MergedColumn | TpStyle::MoeW13 => {
            let d = if style == TpStyle::MoeW13 { 1 } else { 0 };
            for &p in parts {
                need(p, "merged part rows");
            }
            (
                Some(d),
                rank_cuts(d, &|r| {
                    let mut off = 0;
                    let mut ranges = Vec::new();
                    for &p in parts {
                        ranges.push(blocks(p, tp, r, off));
                        off += p;
                    }
                    (ranges, 0)
                }),
            )
        }
        TpStyle::MoeW2 if shape.len() == 3 => {
            need(shape[2], "expert input columns");
            (
                Some(2),
                rank_cuts(2, &|r| (vec![blocks(shape[2], tp, r, 0)], 0)),
            )
        }
        TpStyle::MoeW2 => {
            problems.push(PlanProblem::NotThreeD {
                shape: shape.to_vec(),
            });
            (None, Vec::new())
        }
        TpStyle::Vocab => {
            let v = shape[0];
            let vp = padded_vocab(v);
            need(vp, "padded vocab");
            let per = vp / tp;
            (
                Some(0),
                rank_cuts(0, &|r| {
                    let (a, b) = (r * per, (r + 1) * per);
                    let real = (a.min(v), b.min(v));
                    let ranges = if real.1 > real.0 {
                        vec![real]
                    } else {
                        Vec::new()
                    };
                    (ranges, per - (real.1 - real.0))
                }),
            )
        }
    }
}

impl ShardPlan {
    /// The plan for every vLLM parameter the config implies. `model` supplies source names and quant
    /// types (and is checked for presence); shapes come from the config.
    pub fn new(model: &GgufModel, c: &Config, tp: usize) -> Self {
        let mut params = Vec::new();
        let layers: Vec<Option<usize>> = std::iter::once(None)
            .chain((0..c.num_hidden_layers).map(Some))
            .collect();
        for layer in layers {
            for def in glm_dsa::VLLM_TABLE {
                let applies = match layer {
                    None => def.scope == Scope::Global,
                    Some(l) => def.scope.has_layer(c, l),
                };
                if !applies || (def.role() == Some(Role::LmHead) && c.tie_word_embeddings) {
                    continue;
                }
                params.push(plan_param(
                    model,
                    c,
                    tp,
                    def,
                    Idx {
                        layer,
                        expert: None,
                    },
                ));
            }
        }
        // Globals in forward order: embedding first, final norm and lm_head last.
        params.sort_by_key(|p| match (p.layer, p.def.role()) {
            (None, Some(Role::Embedding)) => (0, 0),
            (Some(l), _) => (1, l),
            (None, _) => (2, 0),
        });
        check_head_alignment(&mut params, c, tp);
        ShardPlan {
            tp,
            params,
            mtp_blocks: (c.num_hidden_layers..c.gguf_block_count()).collect(),
        }
    }
}

fn plan_param(
    model: &GgufModel,
    c: &Config,
    tp: usize,
    def: &'static VllmDef,
    idx: Idx,
) -> ParamPlan {
    let mut gguf = Vec::new();
    let mut dtypes: Vec<GgmlType> = Vec::new();
    let mut part_rows = Vec::new();
    let mut full_shape: Vec<usize> = Vec::new();
    let mut notes = Vec::new();
    for part in def.parts {
        let Some(hf) = glm_dsa::HF_TABLE.iter().find(|d| d.hf == *part) else {
            notes.push(PlanNote::NotInTable { part });
            continue;
        };
        let mut shape = glm_dsa::resolve(hf.shape, c);
        if hf.rebuild == Rebuild::ExpertSlice {
            shape.insert(0, c.n_routed_experts);
        }
        part_rows.push(shape[def.cat_dim]);
        if full_shape.is_empty() {
            full_shape = shape;
        } else {
            full_shape[def.cat_dim] += shape[def.cat_dim];
        }
        let legacy = hf.legacy.filter(|lg| {
            model.tensor(&glm_dsa::name(hf.gguf[0].name, idx)).is_none()
                && model.tensor(&glm_dsa::name(lg.name, idx)).is_some()
        });
        let sources: Vec<_> = match legacy {
            Some(lg) => vec![lg],
            None => hf.gguf.to_vec(),
        };
        for s in sources {
            let n = glm_dsa::name(s.name, idx);
            match model.tensor(&n) {
                Some(t) => {
                    if !dtypes.contains(&t.info.dtype) {
                        dtypes.push(t.info.dtype);
                    }
                }
                None => notes.push(PlanNote::GgufMissing { tensor: n.clone() }),
            }
            gguf.push(n);
        }
    }
    let mut problems = Vec::new();
    let (shard_dim, cuts) = cuts_for(def.style, &full_shape, &part_rows, tp, &mut problems);
    let shard_shape = match (shard_dim, cuts.first()) {
        (Some(d), Some(cut)) => {
            let mut s = full_shape.clone();
            s[d] = cut.len();
            s
        }
        _ => full_shape.clone(),
    };
    // A cut along the GGUF rows' inner dimension (the input columns of a row-parallel weight) slices
    // every quantized row; it must land on block boundaries, or the shard cannot be cut from the bytes.
    let mut splits_quant_blocks = false;
    if let (Some(d), true) = (
        shard_dim,
        def.style == TpStyle::Row || def.style == TpStyle::MoeW2,
    ) {
        let width = shard_shape[d];
        for t in &dtypes {
            if t.is_quantized() && width % t.block_size as usize != 0 {
                splits_quant_blocks = true;
                notes.push(PlanNote::SplitsQuantBlocks {
                    width,
                    dtype: *t,
                    block: t.block_size,
                });
            }
        }
    }
    if def.style == TpStyle::Vocab {
        let vp = padded_vocab(full_shape[0]);
        if vp != full_shape[0] {
            notes.push(PlanNote::VocabPadded {
                vocab: full_shape[0],
                padded: vp,
            });
        }
    }
    ParamPlan {
        param: glm_dsa::name(def.vllm, idx),
        layer: idx.layer,
        gguf,
        dtype: dtypes.iter().map(|t| t.name).collect::<Vec<_>>().join("+"),
        dtypes,
        full_shape,
        style: def.style,
        shard_dim,
        shard_shape,
        notes,
        splits_quant_blocks,
        problems,
        cuts,
        part_rows,
        def,
        idx,
    }
}

/// q_b_proj, kv_b_proj and o_proj must give every rank the same heads.
fn check_head_alignment(params: &mut [ParamPlan], c: &Config, tp: usize) {
    let h = c.num_attention_heads;
    if !h.is_multiple_of(tp) {
        for p in params.iter_mut().filter(|p| is_attn_head_param(p)) {
            p.problems
                .push(PlanProblem::HeadsNotDivisible { heads: h, tp });
        }
        return;
    }
    let per_head = |p: &ParamPlan| -> usize {
        match p.def.role() {
            Some(Role::AttnQB) => c.qk_head_dim(),
            Some(Role::AttnKvB) => c.qk_nope_head_dim + c.v_head_dim,
            _ => c.v_head_dim,
        }
    };
    for p in params.iter_mut().filter(|p| is_attn_head_param(p)) {
        let ph = per_head(p);
        for (r, cut) in p.cuts.iter().enumerate() {
            let (a, b) = cut.ranges.first().copied().unwrap_or((0, 0));
            let heads = (a / ph, b / ph);
            let want = (r * h / tp, (r + 1) * h / tp);
            if a % ph != 0 || b % ph != 0 || heads != want {
                p.problems.push(PlanProblem::HeadsMisaligned {
                    rank: r,
                    rows: (a, b),
                    heads: want,
                });
            }
        }
        p.notes.push(PlanNote::HeadsPerRank { heads: h / tp });
    }
}

fn is_attn_head_param(p: &ParamPlan) -> bool {
    matches!(
        p.def.role(),
        Some(Role::AttnQB | Role::AttnKvB | Role::AttnOut)
    )
}

/// Checks, from the ranges alone, that the ranks' cuts tile the shard dimension exactly once and that
/// every rank's shard has the same size (padding included).
pub fn check_ranges(p: &ParamPlan) -> Result<(), String> {
    let Some(d) = p.shard_dim else { return Ok(()) };
    let n = p.full_shape.get(d).copied().unwrap_or(0);
    let mut all: Vec<(usize, usize)> = p
        .cuts
        .iter()
        .flat_map(|c| c.ranges.iter().copied())
        .collect();
    all.sort_unstable();
    let mut expect = 0;
    for (a, b) in all {
        if a != expect || b < a {
            return Err(format!(
                "ranks' ranges leave {expect}..{a} uncovered or covered twice"
            ));
        }
        expect = b;
    }
    if expect != n {
        return Err(format!("ranks' ranges cover {expect} of {n}"));
    }
    let len = p.cuts.first().map_or(0, Cut::len);
    if p.cuts.iter().any(|c| c.len() != len) {
        return Err("ranks' shards differ in size".into());
    }
    Ok(())
}

/// The same plan for one expert of a stacked expert parameter (`[E, …]` → `[…]`).
pub fn per_expert(p: &ParamPlan) -> Option<ParamPlan> {
    if !matches!(p.style, TpStyle::MoeW13 | TpStyle::MoeW2) {
        return None;
    }
    let mut q = p.clone();
    q.full_shape.remove(0);
    q.shard_shape.remove(0);
    q.shard_dim = p.shard_dim.map(|d| d - 1);
    for c in &mut q.cuts {
        c.dim -= 1;
    }
    Some(q)
}

/// Checks that rank shards of `full` concatenate back to it (and padding is zero). Returns the first
/// violation as text.
pub fn check_reassembly(p: &ParamPlan, full: &Tensor, tp: usize) -> Result<(), String> {
    if p.cuts.is_empty() {
        return Ok(());
    }
    let err = |e: candle_core::Error| e.to_string();
    let d = p.shard_dim.unwrap_or(0);
    let mut real = Vec::new();
    for r in 0..tp {
        let s = p.shard(full, r).map_err(err)?;
        let cut = &p.cuts[r];
        if cut.pad > 0 {
            let pad = s.narrow(d, cut.len() - cut.pad, cut.pad).map_err(err)?;
            let m = pad
                .abs()
                .and_then(|t| t.max_all())
                .and_then(|t| t.to_scalar::<f32>())
                .map_err(err)?;
            if m != 0.0 {
                return Err(format!("rank {r}'s padding rows are not zero"));
            }
        }
        // Undo the cut: each range back to its place.
        let mut off = 0;
        for &(a, b) in &cut.ranges {
            real.push((a, s.narrow(d, off, b - a).map_err(err)?));
            off += b - a;
        }
    }
    real.sort_by_key(|(a, _)| *a);
    let mut expect = 0;
    for (a, t) in &real {
        if *a != expect {
            return Err(format!(
                "shards leave rows {expect}..{a} uncovered or covered twice"
            ));
        }
        expect += t.dim(d).map_err(err)?;
    }
    if expect != full.dim(d).map_err(err)? {
        return Err(format!(
            "shards cover {expect} of {} rows",
            full.dim(d).map_err(err)?
        ));
    }
    let pieces: Vec<&Tensor> = real.iter().map(|(_, t)| t).collect();
    let back = Tensor::cat(&pieces, d).map_err(err)?;
    let same = back
        .eq(full)
        .and_then(|t| t.to_dtype(candle_core::DType::F32))
        .and_then(|t| t.min_all())
        .and_then(|t| t.to_scalar::<f32>())
        .map_err(err)?;
    if same != 1.0 {
        return Err("shards concatenated back differ from the full tensor".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use candle_core::{Device, Tensor};

    fn tiny() -> (GgufModel, Config) {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
        let m = GgufModel::open(&path).expect("fixture");
        let c = ConfigReader::read(&m, "glm-dsa").expect("config").config;
        (m, c)
    }

    fn param<'p>(plan: &'p ShardPlan, name: &str) -> &'p ParamPlan {
        plan.params
            .iter()
            .find(|p| p.param == name)
            .unwrap_or_else(|| panic!("{name} not planned"))
    }

    #[test]
    fn each_style_cuts_what_vllm_cuts() {
        let (m, c) = tiny();
        let plan = ShardPlan::new(&m, &c, 4);
        let qb = param(&plan, "model.layers.1.self_attn.q_b_proj.weight");
        assert_eq!((qb.style, qb.shard_dim), (TpStyle::Column, Some(0)));
        let rows = qb.full_shape[0];
        assert_eq!(qb.cuts[2].ranges, vec![(rows / 2, 3 * rows / 4)]);
        let o = param(&plan, "model.layers.1.self_attn.o_proj.weight");
        assert_eq!(o.shard_dim, Some(1));
        assert_eq!(
            o.shard_shape,
            vec![c.hidden_size, c.num_attention_heads / 4 * c.v_head_dim]
        );
        // Merged gate/up: rank r takes its quarter of gate rows, then its quarter of up rows.
        let gu = param(&plan, "model.layers.0.mlp.gate_up_proj.weight");
        let i = c.intermediate_size;
        assert_eq!(
            gu.cuts[1].ranges,
            vec![(i / 4, i / 2), (i + i / 4, i + i / 2)]
        );
        // Vocab: padded to ×64, the last rank's padding rows are zero rows.
        let e = param(&plan, "model.embed_tokens.weight");
        let vp = padded_vocab(c.vocab_size);
        assert_eq!(e.cuts[3].len(), vp / 4);
        assert_eq!(e.cuts[3].pad, vp - c.vocab_size.max(3 * vp / 4));
        let norm = param(&plan, "model.norm.weight");
        assert!(norm.cuts.is_empty() && norm.shard_dim.is_none());
        assert!(plan.params.iter().all(|p| p.problems.is_empty()));
    }

    #[test]
    fn cuts_that_cannot_be_made_are_typed_problems() {
        let (m, c) = tiny();
        let plan = ShardPlan::new(&m, &c, 3);
        let qb = param(&plan, "model.layers.1.self_attn.q_b_proj.weight");
        assert!(qb.problems.contains(&PlanProblem::HeadsNotDivisible {
            heads: c.num_attention_heads,
            tp: 3
        }));
        let gu = param(&plan, "model.layers.0.mlp.gate_up_proj.weight");
        assert!(gu.problems.iter().any(|p| matches!(
            p,
            PlanProblem::NotDivisible {
                what: "merged part rows",
                tp: 3,
                ..
            }
        )));
        let norm = param(&plan, "model.norm.weight");
        assert!(norm.problems.is_empty());
        let e = param(&ShardPlan::new(&m, &c, 4), "model.embed_tokens.weight").clone();
        assert!(e.notes.contains(&PlanNote::VocabPadded {
            vocab: c.vocab_size,
            padded: padded_vocab(c.vocab_size)
        }));
    }

    #[test]
    fn fused_parts_are_found_in_the_rank_shard() {
        let (m, c) = tiny();
        let plan = ShardPlan::new(&m, &c, 4);
        let (gu, part) = plan
            .holder("model.layers.{L}.mlp.up_proj.weight", Some(0))
            .expect("up_proj is held");
        assert_eq!(
            (gu.param.as_str(), part),
            ("model.layers.0.mlp.gate_up_proj.weight", 1)
        );
        let i = c.intermediate_size;
        assert_eq!(
            gu.part_slice(1, 4),
            Some(PartSlice {
                dim: 0,
                start: i / 4,
                len: i / 4
            })
        );
        // Replicated fused: kv_a keeps its whole rows after q_a's.
        let (qkv, part) = plan
            .holder(
                "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
                Some(1),
            )
            .expect("kv_a is held");
        assert_eq!(part, 1);
        assert_eq!(
            qkv.part_slice(1, 4),
            Some(PartSlice {
                dim: 0,
                start: c.q_lora_rank,
                len: c.kv_lora_rank + c.qk_rope_head_dim
            })
        );
        // w13: the up half of each expert's rows, per rank.
        let (w13, part) = plan
            .holder("model.layers.{L}.mlp.experts.{E}.up_proj.weight", Some(1))
            .expect("experts' up is held");
        let mi = c.moe_intermediate_size;
        assert_eq!(
            w13.part_slice(part, 4),
            Some(PartSlice {
                dim: 1,
                start: mi / 4,
                len: mi / 4
            })
        );
        // An unfused parameter is its whole shard; a part of another layer is not found.
        let (o, _) = plan
            .holder("model.layers.{L}.self_attn.o_proj.weight", Some(2))
            .expect("o_proj");
        assert_eq!(o.part_slice(0, 4), None);
        assert!(plan
            .holder("model.layers.{L}.self_attn.o_proj.weight", Some(99))
            .is_none());
    }

    #[test]
    fn a_cut_reassembles_to_the_full_tensor() {
        let (m, c) = tiny();
        let plan = ShardPlan::new(&m, &c, 2);
        let gu = param(&plan, "model.layers.0.mlp.gate_up_proj.weight");
        let n: usize = gu.full_shape.iter().product();
        let full = Tensor::arange(0f32, n as f32, &Device::Cpu)
            .and_then(|t| t.reshape(gu.full_shape.as_slice()))
            .expect("tensor");
        assert_eq!(check_reassembly(gu, &full, 2), Ok(()));
        let r1 = gu.shard(&full, 1).expect("shard");
        let first = r1
            .get(0)
            .and_then(|r| r.get(0))
            .and_then(|v| v.to_scalar::<f32>());
        // Rank 1's first row is gate row I/2.
        let cols = gu.full_shape[1];
        assert_eq!(
            first.expect("value"),
            ((c.intermediate_size / 2) * cols) as f32
        );
    }
}
