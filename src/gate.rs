//! `glmcheck gate`: every check its inputs allow, as test cases with one verdict — the form a
//! serving stack's CI (and `git bisect run`) consumes. The checks are the engines the other
//! commands run; this module only turns their typed results into cases:
//!
//! - weights: a deployment's per-rank dump against vLLM's cut of the GGUF (`shards --against`),
//!   one case per parameter of the plan;
//! - forward: glmcheck's forward against a reference dump (`forward --reference`), one case per
//!   layer and one for the logits;
//! - candidate: a deployment's activation dump against glmcheck's forward of the same GGUF;
//! - simulated: the simulated-TP forward from a rank dump's weights against the unsharded forward.
//!
//! Wording (text, JUnit messages) is in [`crate::report::gate`].

use serde::Serialize;

use crate::compare::{CmpVerdict, Comparison, FirstDivergence, ModuleRow, Status};
use crate::shards::{AgainstReport, Finding};

/// gate.toml's `[tolerances]` (each overrides the check's measured default; a flag overrides it).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateTolerances {
    pub rel_l2: Option<f64>,
    pub kl_mean: Option<f64>,
    pub kl_max: Option<f64>,
    pub top1_min: Option<f64>,
    pub score_noise: Option<f64>,
    pub router_flips: Option<f64>,
    /// `[tolerances.rel_l2_by_class]`: `"mlp.experts*" = 0.2` (module class glob → largest rel-L2).
    #[serde(default)]
    pub rel_l2_by_class: std::collections::BTreeMap<String, f64>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GateConfig {
    #[serde(default)]
    tolerances: GateTolerances,
}

/// gate.toml; unknown keys and non-finite or negative thresholds are refused.
pub fn parse_config(text: &str) -> Result<GateTolerances, String> {
    let c: GateConfig = toml::from_str(text).map_err(|e| e.to_string())?;
    let t = c.tolerances;
    for (name, v) in [
        ("rel_l2", t.rel_l2),
        ("kl_mean", t.kl_mean),
        ("kl_max", t.kl_max),
        ("top1_min", t.top1_min),
        ("score_noise", t.score_noise),
        ("router_flips", t.router_flips),
    ]
    .into_iter()
    .chain(
        t.rel_l2_by_class
            .values()
            .map(|&v| ("rel_l2_by_class", Some(v))),
    ) {
        if let Some(v) = v {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("tolerances.{name} = {v}: a finite number ≥ 0"));
            }
        }
    }
    Ok(t)
}

/// A group of cases from one engine run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Suite {
    Weights,
    Forward,
    Candidate,
    Simulated,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Weights => "weights",
            Suite::Forward => "forward",
            Suite::Candidate => "candidate",
            Suite::Simulated => "simulated",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CaseResult {
    Pass,
    Fail,
    /// Nothing to judge it by (not compared, not in both dumps, not on the expected ranks).
    Skipped,
}

/// Why a case came out as it did.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Detail {
    /// A parameter of the plan: its findings (corrupt ranks, with the cause) if any.
    Param { findings: Vec<Finding> },
    /// A layer's captures: the worst one, and the run's first divergence when it is in this layer.
    Layer {
        compared: usize,
        worst: Option<ModuleRow>,
        first_divergence: Option<Box<FirstDivergence>>,
        /// The run's first divergence, when it is in an earlier layer: this layer's failure may
        /// be only its consequence.
        downstream_of: Option<String>,
    },
    /// The logits, by their distributions.
    Logits { row: Option<ModuleRow> },
}

#[derive(Debug, Clone, Serialize)]
pub struct Case {
    pub name: String,
    pub result: CaseResult,
    pub detail: Detail,
}

/// One engine run as cases, and its own verdict.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteResult {
    pub suite: Suite,
    /// What was compared with what (paths, or "glmcheck forward").
    pub candidate: String,
    pub reference: String,
    pub verdict: SuiteVerdict,
    pub cases: Vec<Case>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SuiteVerdict {
    Pass,
    Fail,
    /// Nothing failed but not everything expected was checked.
    Incomplete,
}

/// The gate's verdict (the command maps it to exit 0, 1 or 125: `git bisect run` skips a commit
/// that cannot be evaluated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GateVerdict {
    Pass,
    Fail,
    CannotEvaluate,
}

#[derive(Debug, Clone, Serialize)]
pub struct GateReport {
    pub model: String,
    pub verdict: GateVerdict,
    /// Why the gate could not evaluate (an input missing or unreadable), when it could not.
    pub cannot_evaluate: Option<String>,
    pub suites: Vec<SuiteResult>,
}

impl GateReport {
    /// The verdict of these suites: fail if any fails, and an incomplete suite fails the gate
    /// too (a gate that passes must have checked what it was given).
    pub fn new(model: String, suites: Vec<SuiteResult>) -> Self {
        let verdict = if suites.iter().all(|s| s.verdict == SuiteVerdict::Pass) {
            GateVerdict::Pass
        } else {
            GateVerdict::Fail
        };
        GateReport {
            model,
            verdict,
            cannot_evaluate: None,
            suites,
        }
    }

    /// A gate that could not run its checks, and why.
    pub fn cannot_evaluate(model: String, why: String) -> Self {
        GateReport {
            model,
            verdict: GateVerdict::CannotEvaluate,
            cannot_evaluate: Some(why),
            suites: Vec::new(),
        }
    }
}

/// A comparison as cases: one per layer (a layer fails when any of its captures diverged), one
/// for the captures outside the layers, one for the logits.
pub fn comparison_suite(suite: Suite, c: &Comparison) -> SuiteResult {
    let mut layers: std::collections::BTreeMap<Option<usize>, Vec<&ModuleRow>> = Default::default();
    let mut logits = None;
    for r in &c.modules {
        if r.name == "logits" {
            logits = Some(r.clone());
        } else {
            layers.entry(r.layer).or_default().push(r);
        }
    }
    let mut cases: Vec<Case> = layers
        .into_iter()
        .map(|(layer, rows)| {
            let compared = rows.iter().filter(|r| r.rel_l2.is_some()).count();
            let failed = rows.iter().any(|r| r.status == Status::Diverged);
            let worst = rows
                .iter()
                .filter(|r| r.status == Status::Diverged || r.rel_l2.is_some())
                .max_by(|a, b| {
                    let key =
                        |r: &ModuleRow| (r.status == Status::Diverged, r.rel_l2.unwrap_or(0.0));
                    key(a)
                        .partial_cmp(&key(b))
                        .unwrap_or(std::cmp::Ordering::Equal)
                })
                .map(|r| (*r).clone());
            let first = c
                .first_divergence
                .as_ref()
                .filter(|f| f.layer == layer && layer.is_some())
                .cloned()
                .map(Box::new);
            let downstream_of = c
                .first_divergence
                .as_ref()
                .filter(|f| match (f.layer, layer) {
                    (Some(fl), Some(l)) => fl < l,
                    (Some(_), None) => true,
                    _ => false,
                })
                .map(|f| f.module.clone());
            Case {
                name: layer.map_or("model".to_string(), |l| format!("model.layers.{l}")),
                result: if failed {
                    CaseResult::Fail
                } else if compared == 0 {
                    CaseResult::Skipped
                } else {
                    CaseResult::Pass
                },
                detail: Detail::Layer {
                    compared,
                    worst,
                    first_divergence: first,
                    downstream_of,
                },
            }
        })
        .collect();
    cases.push(Case {
        name: "logits".into(),
        result: match &logits {
            Some(r) if r.status == Status::Diverged => CaseResult::Fail,
            Some(_) => CaseResult::Pass,
            None => CaseResult::Skipped,
        },
        detail: Detail::Logits { row: logits },
    });
    SuiteResult {
        suite,
        candidate: c.candidate.clone(),
        reference: c.reference.clone(),
        verdict: match c.verdict() {
            CmpVerdict::WithinTolerance => SuiteVerdict::Pass,
            CmpVerdict::Diverged => SuiteVerdict::Fail,
            CmpVerdict::Incomplete => SuiteVerdict::Incomplete,
        },
        cases,
    }
}

/// A rank dump checked against the plan as cases: one per parameter of the plan.
pub fn weights_suite(
    params: &[String],
    r: &AgainstReport,
    dir: String,
    model: String,
) -> SuiteResult {
    let cases = params
        .iter()
        .map(|p| {
            let findings: Vec<Finding> = r
                .findings
                .iter()
                .filter(|f| &f.param == p)
                .cloned()
                .collect();
            let missing = r
                .missing
                .iter()
                .any(|m| m == p || m.starts_with(&format!("{p}@")));
            Case {
                name: p.clone(),
                result: if !findings.is_empty() {
                    CaseResult::Fail
                } else if missing {
                    CaseResult::Skipped
                } else {
                    CaseResult::Pass
                },
                detail: Detail::Param { findings },
            }
        })
        .collect();
    SuiteResult {
        suite: Suite::Weights,
        candidate: dir,
        reference: model,
        verdict: match r.verdict {
            crate::shards::Verdict::Pass => SuiteVerdict::Pass,
            crate::shards::Verdict::Fail => SuiteVerdict::Fail,
            crate::shards::Verdict::Incomplete => SuiteVerdict::Incomplete,
        },
        cases,
    }
}
