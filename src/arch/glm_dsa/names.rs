//! Lookups over the name table: concrete names ↔ definitions, template filling and matching.

use super::{
    resolve, Config, GgufSrc, HfDef, MtpDef, Rebuild, Role, Scope, VllmDef, HF_TABLE, MTP_TABLE,
    VLLM_TABLE,
};

/// The MTP definition and layer of a concrete GGUF tensor name (`blk.N.nextn.*`).
pub fn lookup_mtp(tensor: &str) -> Option<(&'static MtpDef, Idx)> {
    MTP_TABLE
        .iter()
        .find_map(|d| match_template(d.gguf, tensor).map(|i| (d, i)))
}

/// The block of a GGUF tensor that marks an MTP block: any `blk.N.nextn.*` tensor, known to the
/// table or not (a newer converter's extra nextn tensor still marks its block).
pub fn mtp_marker_block(tensor: &str) -> Option<usize> {
    let l = gguf_layer(tensor)?;
    let rest = tensor.strip_prefix("blk.")?.split_once('.')?.1;
    rest.starts_with("nextn.").then_some(l)
}

/// Layer and expert indices of a concrete name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idx {
    pub layer: Option<usize>,
    pub expert: Option<usize>,
}

impl Idx {
    pub fn layer(l: usize) -> Self {
        Idx {
            layer: Some(l),
            expert: None,
        }
    }
}

impl VllmDef {
    /// The role of the parameter's (first) HF part.
    pub fn role(&self) -> Option<Role> {
        let first = self.parts.first()?;
        HF_TABLE.iter().find(|d| d.hf == *first).map(|d| d.role)
    }
}

/// The (first) HF definition with this role.
pub fn hf_def(role: Role) -> Option<&'static HfDef> {
    HF_TABLE.iter().find(|d| d.role == role)
}

/// The GGUF tensor name (template) of a role's first source.
pub fn gguf_name_of(role: Role) -> Option<&'static str> {
    hf_def(role).and_then(|d| d.gguf.first()).map(|s| s.name)
}

/// Fills `{L}` (and `{E}`) in a template.
pub fn name(template: &str, idx: Idx) -> String {
    let mut s = template.to_string();
    if let Some(l) = idx.layer {
        s = s.replace("{L}", &l.to_string());
    }
    if let Some(e) = idx.expert {
        s = s.replace("{E}", &e.to_string());
    }
    s
}

/// A concrete (index-resolved) HF parameter.
#[derive(Debug, Clone)]
pub struct HfParam {
    pub name: String,
    pub idx: Idx,
    pub def: &'static HfDef,
}

impl HfParam {
    pub fn shape(&self, c: &Config) -> Vec<usize> {
        resolve(self.def.shape, c)
    }

    pub fn gguf_names(&self) -> Vec<String> {
        self.def
            .gguf
            .iter()
            .map(|s| name(s.name, self.idx))
            .collect()
    }
}

/// Every HF checkpoint parameter the config implies, in model order.
pub fn hf_params(c: &Config) -> Vec<HfParam> {
    let mut out = Vec::new();
    let push = |out: &mut Vec<HfParam>, d: &'static HfDef, idx: Idx| {
        out.push(HfParam {
            name: name(d.hf, idx),
            idx,
            def: d,
        });
    };
    if let Some(d) = hf_def(Role::Embedding) {
        push(&mut out, d, Idx::default());
    }
    for l in 0..c.num_hidden_layers {
        for d in HF_TABLE.iter().filter(|d| d.scope.has_layer(c, l)) {
            if d.rebuild == Rebuild::ExpertSlice {
                for e in 0..c.n_routed_experts {
                    push(
                        &mut out,
                        d,
                        Idx {
                            layer: Some(l),
                            expert: Some(e),
                        },
                    );
                }
            } else {
                push(&mut out, d, Idx::layer(l));
            }
        }
    }
    for d in HF_TABLE
        .iter()
        .filter(|d| d.scope == Scope::Global && d.role != Role::Embedding)
    {
        if d.role == Role::LmHead && c.tie_word_embeddings {
            continue;
        }
        push(&mut out, d, Idx::default());
    }
    out
}

/// Finds the HF definition and indices of a concrete HF parameter name.
pub fn lookup_hf(param: &str) -> Option<(&'static HfDef, Idx)> {
    HF_TABLE
        .iter()
        .find_map(|d| match_template(d.hf, param).map(|i| (d, i)))
}

/// Finds the vLLM definition and layer of a concrete vLLM parameter name (its canonical name or any
/// alias).
pub fn lookup_vllm(param: &str) -> Option<(&'static VllmDef, Idx)> {
    VLLM_TABLE.iter().find_map(|d| {
        d.all_names()
            .find_map(|t| match_template(t, param))
            .map(|i| (d, i))
    })
}

/// The canonical vLLM name (glmcheck's plan's) of a concrete name or alias, when it is one of a
/// parameter that exists in this config (its layer below `num_hidden_layers`, in its scope).
pub fn canonical_vllm(param: &str, c: &Config) -> Option<String> {
    let (d, idx) = lookup_vllm(param)?;
    let exists = match idx.layer {
        None => d.scope == Scope::Global,
        Some(l) => l < c.num_hidden_layers && d.scope.has_layer(c, l),
    };
    exists.then(|| name(d.vllm, idx))
}

/// Finds the GGUF source definition (and its owner) of a concrete GGUF tensor name.
pub fn lookup_gguf(tensor: &str) -> Option<(&'static HfDef, &'static GgufSrc, Idx)> {
    HF_TABLE.iter().find_map(|d| {
        d.gguf
            .iter()
            .chain(d.legacy.iter())
            .find_map(|s| match_template(s.name, tensor).map(|i| (d, s, i)))
    })
}

/// The indices when `concrete` is `template` with `{L}` / `{E}` filled by canonical decimal numbers.
pub fn match_template(template: &str, concrete: &str) -> Option<Idx> {
    let mut idx = Idx::default();
    let mut rest_t = template;
    let mut rest_c = concrete;
    loop {
        let next = [("{L}", true), ("{E}", false)]
            .iter()
            .filter_map(|&(p, is_layer)| rest_t.find(p).map(|at| (at, is_layer)))
            .min_by_key(|&(at, _)| at);
        let Some((at, is_layer)) = next else {
            return (rest_t == rest_c).then_some(idx);
        };
        rest_c = rest_c.strip_prefix(&rest_t[..at])?;
        rest_t = &rest_t[at + 3..];
        let digits = rest_c.bytes().take_while(u8::is_ascii_digit).count();
        let num = &rest_c[..digits];
        if num.is_empty() || (num.len() > 1 && num.starts_with('0')) {
            return None;
        }
        let n: usize = num.parse().ok()?;
        if is_layer {
            idx.layer = Some(n);
        } else {
            idx.expert = Some(n);
        }
        rest_c = &rest_c[digits..];
    }
}

/// The layer number of a `blk.N.` GGUF tensor name.
pub fn gguf_layer(tensor: &str) -> Option<usize> {
    let rest = tensor.strip_prefix("blk.")?;
    rest.split('.').next()?.parse().ok()
}
