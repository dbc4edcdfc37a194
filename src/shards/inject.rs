//! `inject`: the per-rank dump a loader with a known bug would hold.

use std::collections::BTreeMap;

use super::AgainstError;
use crate::dump::DumpTensor;
use crate::faults::Fault;
use crate::plan::ShardPlan;
use crate::weights::Weights;

/// Which bug to inject, where, and in what dtype.
pub struct InjectSpec<'a> {
    pub fault: &'a Fault,
    /// Only this layer's parameters get the bug.
    pub layer: Option<usize>,
    /// Only parameters matching one of these globs get the bug (empty: the bug's default targets).
    pub params: &'a [String],
    pub dtype: safetensors::Dtype,
    /// Which vLLM version's parameter names the dump uses.
    pub names: crate::arch::glm_dsa::VllmNames,
}

/// Writes the dump a loader with the bug would hold into `out`, never over one of `inputs`.
/// Returns the files written.
pub fn inject(
    w: &Weights<'_>,
    plan: &ShardPlan,
    spec: &InjectSpec<'_>,
    out: &std::path::Path,
    inputs: &[&std::path::Path],
) -> Result<Vec<std::path::PathBuf>, AgainstError> {
    let (fault, layer, only) = (spec.fault, spec.layer, spec.params);
    let in_scope = |p: &crate::plan::ParamPlan| {
        layer.is_none_or(|l| p.layer == Some(l))
            && (only.is_empty()
                || only
                    .iter()
                    .any(|g| crate::gguf::stats::glob_match(g, &p.param)))
    };
    inject_with(w, plan, spec, out, inputs, &|p| {
        if in_scope(p) {
            fault.clone()
        } else {
            Fault::None
        }
    })
}

/// [`inject`] of several weight faults at once (the bisector's patch sets): `fault_of` names the
/// fault each parameter gets (`Fault::None` for none).
pub fn inject_with(
    w: &Weights<'_>,
    plan: &ShardPlan,
    spec: &InjectSpec<'_>,
    out: &std::path::Path,
    inputs: &[&std::path::Path],
    fault_of: &dyn Fn(&crate::plan::ParamPlan) -> Fault,
) -> Result<Vec<std::path::PathBuf>, AgainstError> {
    let (fault, dtype) = (spec.fault, spec.dtype);
    let tp = plan.tp;
    let mut per_rank: Vec<BTreeMap<String, DumpTensor>> = vec![BTreeMap::new(); tp];
    for p in &plan.params {
        let full = w.vllm(&p.param)?;
        let f = fault_of(p);
        let name = crate::arch::glm_dsa::name(p.def.name_in(spec.names), p.idx);
        for (r, slot) in per_rank.iter_mut().enumerate() {
            slot.insert(name.clone(), f.inject(p, &full, w, tp, r, dtype)?);
        }
    }
    let mut written = Vec::new();
    let mut meta = std::collections::HashMap::new();
    meta.insert("glmcheck.fault".to_string(), format!("{fault:?}"));
    meta.insert("glmcheck.tp".to_string(), tp.to_string());
    meta.insert(
        "glmcheck.vllm_names".to_string(),
        serde_json::to_value(spec.names)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
    );
    for (r, tensors) in per_rank.iter().enumerate() {
        let path = out.join(format!("rank{r}.safetensors"));
        crate::dump::write_file(&path, tensors, Some(meta.clone()), inputs)?;
        written.push(path);
    }
    Ok(written)
}
