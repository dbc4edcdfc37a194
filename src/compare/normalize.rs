//! The two dumps brought to one naming and one shape per module.

use std::borrow::Cow;
use std::collections::BTreeSet;

use super::driver::Note;
use super::io::Activations;
use super::metrics::common_shape;
use crate::model::names::{conv, ModelPaths};

/// Other names the same module may have in a dump made another way: `logits` ↔ `lm_head`, a
/// `model.` prefix more or less (hooks registered on the inner model, or on a wrapper).
pub(crate) fn alternative_keys(key: &str) -> Vec<String> {
    let mut alts = Vec::new();
    let lm_head = ModelPaths::new().map(|m| m.lm_head).ok();
    if let Some(lm_head) = lm_head {
        if key == conv::LOGITS {
            alts.push(lm_head);
        } else if key == lm_head {
            alts.push(conv::LOGITS.to_string());
        }
    }
    if let Some(rest) = key.strip_prefix("model.") {
        alts.push(rest.to_string());
    }
    alts.push(format!("model.{key}"));
    alts
}

/// The two dumps brought to one naming and one shape per module ("comparison by meaning"): a key
/// only one dump has is matched to the other's name for the same module where that is unambiguous,
/// and shapes that differ only in singleton dims are given their common shape. Returns copies only
/// when something changed, and a note per kind of change.
pub(crate) fn normalize<'a>(
    reference: &'a Activations,
    cand: &'a Activations,
    notes: &mut Vec<Note>,
) -> (Cow<'a, Activations>, Cow<'a, Activations>) {
    let mut cand_c: Cow<'a, Activations> = Cow::Borrowed(cand);
    let mut ref_c: Cow<'a, Activations> = Cow::Borrowed(reference);
    let only_ref: Vec<String> = reference
        .order
        .iter()
        .filter(|k| !cand.tensors.contains_key(*k))
        .cloned()
        .collect();
    // Both sides end under glmcheck's own naming (HF paths from the top module, `logits`), which
    // the dataflow knows; a pair is renamed only where exactly one alternative matches.
    let canonical = |k: &str| {
        k == conv::LOGITS
            || k == conv::INPUT_IDS
            || (k.starts_with("model.") && !k.starts_with("model.model."))
            || k == "model"
    };
    let mut claimed = BTreeSet::new();
    let mut renamed = Vec::new();
    for k in &only_ref {
        let hits: Vec<String> = alternative_keys(k)
            .into_iter()
            .filter(|a| cand.tensors.contains_key(a) && !reference.tensors.contains_key(a))
            .filter(|a| !claimed.contains(a))
            .collect();
        let [alt] = hits.as_slice() else {
            continue;
        };
        claimed.insert(alt.clone());
        // Keep the canonical one of the two names (`logits` over the lm_head path).
        let keep_ref = if k == conv::LOGITS || alt == conv::LOGITS {
            k == conv::LOGITS
        } else {
            canonical(k) || !canonical(alt)
        };
        if keep_ref {
            cand_c.to_mut().rename(alt, k);
            renamed.push((alt.clone(), k.clone()));
        } else {
            ref_c.to_mut().rename(k, alt);
            renamed.push((k.clone(), alt.clone()));
        }
    }
    if !renamed.is_empty() {
        if let Cow::Owned(c) = &mut cand_c {
            c.canonicalize_expert_rows();
        }
        if let Cow::Owned(r) = &mut ref_c {
            r.canonicalize_expert_rows();
        }
        notes.push(Note::Renamed(renamed));
    }
    let mut reshaped = Vec::new();
    let keys: Vec<String> = ref_c.order.clone();
    for k in keys {
        let (Some(ra), Some(ca)) = (ref_c.tensors.get(&k), cand_c.tensors.get(&k)) else {
            continue;
        };
        if ra.shape == ca.shape {
            continue;
        }
        let Some(shape) = common_shape(&ra.shape, &ca.shape) else {
            continue;
        };
        let (from_r, from_c) = (ra.shape.clone(), ca.shape.clone());
        if let Some(a) = ref_c.to_mut().tensors.get_mut(&k) {
            a.shape = shape.clone();
        }
        if let Some(a) = cand_c.to_mut().tensors.get_mut(&k) {
            a.shape = shape.clone();
        }
        reshaped.push((k.clone(), from_r, from_c));
    }
    if !reshaped.is_empty() {
        notes.push(Note::Reshaped(reshaped));
    }
    (ref_c, cand_c)
}
