//! Running the table: each row's rule decides the values and findings, and the row and its
//! verdict are built here, the same way for every field.

use serde::Serialize;
use serde_json::Value;

use super::table::{rows, Dim, Judge};
use super::{
    FieldRow, Finding, FindingKind, HfConfig, HfConfigCheck, Key, Origin, Verdict, FLOAT_REL_TOL,
};
use crate::arch::config::Source;
use crate::arch::Config;

/// What a rule sees: the deployment's config.json, the GGUF's config and where each of its fields
/// came from.
pub(super) struct Ctx<'a> {
    pub hf: &'a HfConfig,
    pub cfg: &'a Config,
    pub sources: &'a [(String, Source)],
    /// The row's field.
    pub field: &'static str,
}

impl Ctx<'_> {
    pub fn source(&self, field: &str) -> Option<Source> {
        self.sources
            .iter()
            .find(|(f, _)| f == field)
            .map(|(_, s)| s.clone())
    }

    /// A value compared with the GGUF's: a [`FindingKind::Mismatch`] (`harmless` or not) when
    /// they differ (`same` false).
    pub fn compared(
        &self,
        json: Key<Value>,
        vllm: Value,
        vllm_from: Origin,
        gguf: Value,
        same: bool,
        harmless: bool,
    ) -> Judged {
        let mut j = Judged::new(json, vllm.clone(), vllm_from, gguf.clone());
        if !same {
            let gguf_defaulted = matches!(self.source(self.field), Some(Source::Default(_)));
            j.finding(
                harmless,
                FindingKind::Mismatch {
                    vllm,
                    vllm_from,
                    gguf,
                    gguf_defaulted,
                },
            );
        }
        j
    }
}

/// A rule's decision on its field: the row's values and the findings (harmless or not).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Judged {
    pub json: Key<Value>,
    pub vllm: Value,
    pub vllm_from: Origin,
    pub gguf: Value,
    pub findings: Vec<(bool, FindingKind)>,
}

impl Judged {
    pub fn new(json: Key<Value>, vllm: Value, vllm_from: Origin, gguf: Value) -> Self {
        Judged {
            json,
            vllm,
            vllm_from,
            gguf,
            findings: Vec::new(),
        }
    }

    pub fn finding(&mut self, harmless: bool, kind: FindingKind) {
        self.findings.push((harmless, kind));
    }

    /// A finding when `cond`.
    pub fn finding_if(mut self, cond: bool, harmless: bool, kind: FindingKind) -> Self {
        if cond {
            self.finding(harmless, kind);
        }
        self
    }

    /// Agrees without findings; a harmless finding makes it harmless, any other a finding.
    fn verdict(&self) -> Verdict {
        match self.findings.iter().map(|(h, _)| *h).min() {
            None => Verdict::Agrees,
            Some(true) => Verdict::Harmless,
            Some(false) => Verdict::Finding,
        }
    }
}

/// Compares `hf` with the GGUF's config (`cfg`, and `sources`: where each of its fields came from).
pub fn check(hf: &HfConfig, cfg: &Config, sources: &[(String, Source)]) -> HfConfigCheck {
    let mut out = HfConfigCheck {
        path: hf.path.display().to_string(),
        rows: Vec::new(),
        findings: Vec::new(),
    };
    for row in rows() {
        let ctx = Ctx {
            hf,
            cfg,
            sources,
            field: row.field,
        };
        let judged = match row.judge {
            Judge::Dim(d) => Some(dimension(&ctx, d)),
            Judge::Rule(rule) => rule(&ctx),
        };
        let Some(j) = judged else { continue };
        let verdict = j.verdict();
        out.findings
            .extend(j.findings.into_iter().map(|(harmless, kind)| Finding {
                field: row.field.to_string(),
                harmless,
                kind,
            }));
        out.rows.push(FieldRow {
            field: row.field.to_string(),
            json: j.json,
            vllm: j.vllm,
            vllm_from: j.vllm_from,
            gguf: j.gguf,
            gguf_from: if row.gguf_field {
                ctx.source(row.field)
            } else {
                None
            },
            verdict,
        });
    }
    out
}

/// A declared dimension: the key, else the class default, against the GGUF's value.
fn dimension(ctx: &Ctx<'_>, d: &Dim) -> Judged {
    let json = ctx.hf.uint(d.field);
    let (v, from) = declared(&json, d.default);
    let gguf = (d.gguf)(ctx.cfg) as u64;
    ctx.compared(
        key_value(&json),
        Value::from(v),
        from,
        Value::from(gguf),
        v == gguf,
        d.harmless,
    )
}

pub(super) fn same_f64(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= FLOAT_REL_TOL * a.abs().max(b.abs())
}

/// A key as JSON, for the row's "as written" column.
pub(super) fn key_value<T: Serialize>(k: &Key<T>) -> Key<Value> {
    match k {
        Key::Absent => Key::Absent,
        Key::Null => Key::Null,
        Key::Set(v) => Key::Set(serde_json::to_value(v).unwrap_or(Value::Null)),
    }
}

/// The value of a declared field: the key, else the class default.
pub(super) fn declared<T: Clone>(k: &Key<T>, default: T) -> (T, Origin) {
    match k {
        Key::Set(v) => (v.clone(), Origin::ConfigJson),
        _ => (default, Origin::TransformersDefault),
    }
}

/// What vLLM's `getattr(config, key, default)` returns: the key (null is None), else `default`.
pub(super) fn undeclared<T: Clone>(k: &Key<T>, default: Option<T>) -> (Option<T>, Origin) {
    match k {
        Key::Set(v) => (Some(v.clone()), Origin::ConfigJson),
        Key::Null => (None, Origin::ConfigJson),
        Key::Absent => (default, Origin::VllmDefault),
    }
}
