//! Renderers of `forward` and `diff`: the run's tokens and predictions, the per-module comparison
//! table, the first divergence, and their JSON.

use serde_json::{json, Value};

use super::{num, table};
use crate::compare::{CmpVerdict, Comparison, ModuleRow, Status, TieClass, ValueKind};
use crate::forward::ForwardOutcome;

fn quoted(s: &str) -> String {
    format!("{s:?}")
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), num)
}

/// Human output of `forward`.
/// `--bench` (and `--profile`): the timings, the profile's modules by time, largest first.
fn bench_text(b: &crate::forward::Bench) -> String {
    let mut out = format!(
        "forward of the prompt: best {:.2} ms, median {:.2} ms of {} (device synchronized)\n",
        b.best_ms, b.median_ms, b.runs
    );
    if let Some(p) = &b.profile {
        let total: f64 = p.iter().map(|m| m.ms).sum();
        let mut by_time: Vec<_> = p.iter().collect();
        by_time.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        out.push_str(&format!(
            "profile (synchronized after every module, {total:.2} ms in all):\n"
        ));
        for m in by_time.iter().take(15) {
            out.push_str(&format!(
                "  {:>8.3} ms {:>5.1} %  {} (×{})\n",
                m.ms,
                100.0 * m.ms / total.max(f64::MIN_POSITIVE),
                m.module,
                m.calls
            ));
        }
    }
    match &b.timeline {
        Some(t) => out.push_str(&timeline_text(t)),
        None if b.profile.is_some() => out.push_str(
            "timeline: not taken (simulated tensor parallel: the ranks run one after another and \
             their modules are marked only when merged)\n",
        ),
        None => {}
    }
    out
}

/// The unsynchronized forward's marks: where the GPU waited on the host.
fn timeline_text(t: &crate::forward::Timeline) -> String {
    if !t.gpu_events {
        return format!(
            "timeline (one more forward, {} marks; on the CPU the host does the work, no device clock): {:.2} ms\n",
            t.marks.len(),
            t.total_ms
        );
    }
    let paced = t.host_paced(crate::forward::HOST_PACED_MS);
    let mut out = format!(
        "timeline (one more forward, not synchronized; CUDA events at {} module boundaries): \
         the GPU done at {:.2} ms, its work all enqueued by {:.2} ms on the host; \
         the GPU idle at most {:.2} ms\n  \
         it reached {} of the marks within {:.0} µs of their launch (it had waited on the host's \
         launches or on a host synchronization):\n",
        t.marks.len(),
        t.total_ms,
        t.host_ms,
        t.idle_bound_ms().unwrap_or(0.0),
        paced.len(),
        crate::forward::HOST_PACED_MS * 1e3,
    );
    let mut by_idle: Vec<_> = paced.iter().collect();
    by_idle.sort_by(|a, b| b.idle_ms.total_cmp(&a.idle_ms));
    for p in by_idle.iter().take(8) {
        out.push_str(&format!(
            "  up to {:>6.3} ms idle in the {:.3} ms before {} ({:.0} µs behind the host)\n",
            p.idle_ms,
            p.stretch_ms,
            p.module,
            p.lead_ms * 1e3
        ));
    }
    out
}

pub fn forward_text(o: &ForwardOutcome, all_modules: bool) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "tokens ({}): {}\n",
        o.tokens.len(),
        o.tokens
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    ));
    if let Some(texts) = &o.token_texts {
        out.push_str(&format!(
            "  {}\n",
            texts
                .iter()
                .map(|t| quoted(t))
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    out.push_str(&format!(
        "compute {}, weights {} (coarsest matrix type, {}); {}\n",
        o.dtype.name(),
        o.weights.name,
        super::notes::matmul_text(o.matmul),
        super::notes::dsa_message(&o.dsa)
    ));
    for n in &o.notes {
        out.push_str(&format!("{n}\n"));
    }
    if !o.settings.is_empty() {
        let set: Vec<String> = o.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!("settings (not the defaults): {}\n", set.join(" ")));
    }
    if let Some(b) = &o.bench {
        out.push_str(&bench_text(b));
    }
    out.push('\n');

    out.push_str(&format!(
        "next token after position {} (entropy {:.2} nats; uniform over {} tokens would be {:.2}):\n",
        o.tokens.len().saturating_sub(1),
        o.entropy,
        o.vocab,
        o.log_vocab
    ));
    let mut t = table(&["rank", "id", "token", "probability"]);
    for (i, c) in o.top.iter().enumerate() {
        t.add_row(vec![
            (i + 1).to_string(),
            c.id.to_string(),
            c.text.as_deref().map_or("-".into(), quoted),
            format!("{:.4}", c.prob),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if o.garbage {
        out.push_str(
            "warning: the next-token distribution is within 0.5 nats of uniform: the model outputs noise\n",
        );
    }
    if !o.continuation_ids.is_empty() {
        out.push_str(&format!(
            "greedy continuation ({} token{}{}): {}  [{}]\n",
            o.continuation_ids.len(),
            if o.continuation_ids.len() == 1 {
                ""
            } else {
                "s"
            },
            o.stopped.map_or(String::new(), |s| format!(
                ", stopped at {}",
                super::notes::stop_text(s)
            )),
            o.continuation
                .as_deref()
                .map_or("(no tokenizer in the GGUF)".into(), quoted),
            o.continuation_ids
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    if let Some(c) = &o.comparison {
        out.push('\n');
        if !o.replayed.is_empty() {
            out.push_str(&format!(
                "replayed the reference's top-k at {} tie/near-tie row(s) so that later modules stay comparable: {}\n",
                o.replayed.len(),
                o.replayed.join(", ")
            ));
        }
        out.push_str(&comparison_text(c, all_modules));
    }
    out
}

fn shown(r: &ModuleRow, all: bool) -> bool {
    all || !r.aux || r.status != Status::Match
}

fn status_cell(r: &ModuleRow) -> String {
    match &r.topk {
        Some(t) if !t.rows.is_empty() => format!(
            "{} ({} of {} positions differ)",
            r.status.name(),
            t.rows.len(),
            t.positions
        ),
        _ => r.status.name().to_string(),
    }
}

fn at(r: &ModuleRow) -> String {
    match (&r.max_abs, &r.max_abs_at) {
        (Some(m), Some(a)) => format!(
            "{} at [{}]",
            num(*m),
            a.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        (Some(m), None) => num(*m),
        _ => "-".into(),
    }
}

/// The per-module table, the tie details, the logits and the first divergence.
pub fn comparison_text(c: &Comparison, all_modules: bool) -> String {
    let mut out = module_table(c, all_modules);
    out.push_str(&topk_differences(c, all_modules));
    out.push_str(&exclusions_text(c));
    out.push_str(&logits_text(c));
    out.push_str(&lists_text(c));
    out.push_str(&divergence_text(c));
    out
}

/// The tolerances line and the per-module table.
fn module_table(c: &Comparison, all_modules: bool) -> String {
    let mut out = String::new();
    let tol = &c.tolerances;
    out.push_str(&format!(
        "candidate {} vs reference {} ({} tokens)\ntolerances ({}): rel-L2 ≤ {}, KL mean ≤ {} / max ≤ {}, top-1 ≥ {:.0} %, top-k near-tie margin ≤ {} × row max, routed-expert flips ≤ {:.0} %\n",
        c.candidate,
        c.reference,
        c.tokens.len(),
        tol.basis,
        num(tol.rel_l2),
        num(tol.kl_mean),
        num(tol.kl_max),
        tol.top1_min * 100.0,
        num(tol.score_noise),
        tol.router_flip_max * 100.0
    ));
    let mut t = table(&[
        "#", "module", "status", "rel-L2", "cosine", "max-abs", "note",
    ]);
    let mut hidden = 0;
    for (i, r) in c.modules.iter().enumerate() {
        if !shown(r, all_modules) {
            hidden += 1;
            continue;
        }
        let mut note = r.note.as_ref().map_or(String::new(), |n| n.to_string());
        if let Some(n) = r.positions_compared {
            if !note.is_empty() {
                note.push_str("; ");
            }
            note.push_str(&format!("{n} of {} positions compared", c.tokens.len()));
        }
        if let Some(tk) = &r.topk {
            if !note.is_empty() {
                note.push_str("; ");
            }
            note.push_str(&format!("overlap {:.3}", tk.overlap));
        }
        t.add_row(vec![
            i.to_string(),
            r.name.clone(),
            status_cell(r),
            opt(r.rel_l2),
            r.cosine.map_or("-".into(), |x| format!("{x:.6}")),
            at(r),
            note,
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    if hidden > 0 {
        out.push_str(&format!(
            "({hidden} auxiliary captures within tolerance not shown: tuple elements, aliases, recomputed extras; --all shows them)\n"
        ));
    }

    out
}

/// Each indexer top-k difference with its margin and class.
fn topk_differences(c: &Comparison, all_modules: bool) -> String {
    let mut out = String::new();
    let mut lines = Vec::new();
    for r in c
        .modules
        .iter()
        .filter(|r| r.role == ValueKind::IndexerIds && !r.aux)
    {
        let Some(tk) = &r.topk else { continue };
        for d in &tk.rows {
            let class = match d.class {
                TieClass::ExactTie => "exact tie (any choice among the tied keys is correct)",
                TieClass::NearTie => "near-tie (margin below the noise of dtype and weights)",
                TieClass::Divergence => "REAL DIVERGENCE",
                TieClass::Unavailable => "unclassified (the reference has no index scores)",
            };
            let scores = match (d.kth, d.next, d.margin, d.noise) {
                (Some(k), next, Some(m), Some(n)) => format!(
                    "; k-th score {k:e}, (k+1)-th {}, swap margin {m:.3e} vs noise {n:.3e}",
                    next.map_or("-".into(), |x| format!("{x:e}"))
                ),
                _ => String::new(),
            };
            lines.push(format!(
                "  {} pos {}: {class}; only the reference chose {:?}, only the candidate {:?}{scores}{}",
                r.name,
                d.pos,
                d.only_ref,
                d.only_cand,
                if d.replayed {
                    " (replayed the reference's choice)"
                } else {
                    ""
                }
            ));
        }
    }
    if !lines.is_empty() {
        const SHOWN: usize = 12;
        out.push_str("indexer top-k differences (causal keys only):\n");
        let n = lines.len();
        for l in lines
            .into_iter()
            .take(if all_modules { usize::MAX } else { SHOWN })
        {
            out.push_str(&l);
            out.push('\n');
        }
        if n > SHOWN && !all_modules {
            out.push_str(&format!(
                "  … {} more (--all or --json lists them)\n",
                n - SHOWN
            ));
        }
    }
    out
}

/// Positions left out after ties.
fn exclusions_text(c: &Comparison) -> String {
    let mut out = String::new();
    for e in &c.exclusions {
        let what = match (e.from_on, e.positions.first()) {
            (true, Some(p)) => format!("every position from {p} on"),
            _ => format!(
                "position{} {}",
                if e.positions.len() == 1 { "" } else { "s" },
                e.positions
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let why = if e.from_on {
            "the model is causal, so earlier positions are unaffected"
        } else {
            "tokens are routed independently; their small spill-over into later positions stays within tolerance"
        };
        out.push_str(&format!(
            "left out of every later comparison: {what}, after {} ({}; {why})\n",
            e.module, e.cause
        ));
    }

    out
}

/// The logits' metrics and entropy.
fn logits_text(c: &Comparison) -> String {
    let mut out = String::new();
    if let Some(l) = &c.logits {
        out.push_str(&format!(
            "logits over {} position(s): KL(ref‖cand) mean {} max {} (position {}), top-1 agrees at {}/{} ({:.1} %), RMS Δp of the reference's top token {}, max-abs {}\n",
            l.positions,
            num(l.kl_mean),
            num(l.kl_max),
            l.kl_max_pos,
            l.top1_agree_count,
            l.positions,
            l.top1_agree * 100.0,
            num(l.rms_dp),
            num(l.max_abs)
        ));
        if l.top1_noise_ties > 0 {
            out.push_str(&format!(
                "  of those, {} agree only up to the noise of the logits' input: the reference's \
                 top two logits there are closer than that noise can separate\n",
                l.top1_noise_ties
            ));
        }
        out.push_str(&kld_stats_text(&l.kld_stats));
        out.push_str(&format!(
            "next-token entropy {:.3} nats (reference {:.3}; uniform log V = {:.3}){}\n",
            l.entropy_mean,
            l.entropy_ref_mean,
            l.log_vocab,
            if l.garbage {
                ": GARBAGE, the candidate's distribution is near uniform"
            } else if l.reference_uniform {
                ": the reference's own distribution is near uniform too (random weights?), so \
                 near-uniform output is expected here"
            } else {
                ""
            }
        ));
    }
    out
}

/// Values printed together as llama-perplexity prints them, to `decimals` fixed, when the largest
/// shows four significant digits so; else all in scientific notation (the KL between two f32 runs,
/// 1e-12, would read 0.000000).
fn printed(values: &[f64], decimals: i32) -> Vec<String> {
    let largest = values
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f64, |a, x| a.max(x.abs()));
    let fixed = largest == 0.0 || largest >= 10f64.powi(3 - decimals);
    let d = decimals.max(0) as usize;
    values
        .iter()
        .map(|x| {
            if fixed {
                format!("{x:.d$}")
            } else {
                format!("{x:.3e}")
            }
        })
        .collect()
}

/// The logits' statistics as `llama-perplexity --kl-divergence` prints them (its definitions; KLD
/// to 6 decimals, Δp and "Same top p" in percent to 3).
fn kld_stats_text(k: &crate::compare::logits::KldStats) -> String {
    let kl = printed(
        &[
            k.kl_mean,
            k.kl_mean_err,
            k.kl_max,
            k.kl_p999,
            k.kl_p99,
            k.kl_p95,
            k.kl_p90,
            k.kl_median,
            k.kl_min,
        ],
        6,
    );
    let mut out = format!(
        "llama-perplexity KLD over {} position(s): mean {} ± {}, max {}, 99.9% {}, 99.0% {}, \
         95.0% {}, 90.0% {}, median {}, min {}{}\n",
        k.positions,
        kl[0],
        kl[1],
        kl[2],
        kl[3],
        kl[4],
        kl[5],
        kl[6],
        kl[7],
        kl[8],
        if k.positions <= 10 {
            " (± is 0 at 10 positions or fewer, as there)"
        } else {
            ""
        }
    );
    let dp = match &k.dp {
        Some(d) => {
            let v = printed(
                &[
                    d.rms, d.rms_err, d.mean, d.mean_err, d.max, d.p99, d.median, d.p01, d.min,
                ]
                .map(|x| 100.0 * x),
                3,
            );
            format!(
                "Δp of the next prompt token over {} position(s): RMS {} ± {} %, mean {} ± {} %, \
                 max {} %, 99.0% {} %, median {} %, 1.0% {} %, min {} %; ",
                d.positions, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]
            )
        }
        None => "Δp: no token ids; ".into(),
    };
    out.push_str(&format!(
        "{dp}Same top p {:.3} ± {:.3} %\n",
        100.0 * k.same_top,
        100.0 * k.same_top_err
    ));
    out
}

/// Keys only one dump has, notes, incomparable modules.
fn lists_text(c: &Comparison) -> String {
    let mut out = String::new();
    let list = |v: &[String]| -> String {
        let mut s = v.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
        if v.len() > 8 {
            s.push_str(&format!(", … ({} more)", v.len() - 8));
        }
        s
    };
    if !c.only_reference.is_empty() {
        out.push_str(&format!(
            "only in the reference ({}): {}\n",
            c.only_reference.len(),
            list(&c.only_reference)
        ));
    }
    if !c.only_candidate.is_empty() {
        out.push_str(&format!(
            "only in the candidate ({}): {}\n",
            c.only_candidate.len(),
            list(&c.only_candidate)
        ));
    }
    for n in &c.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    if !c.incomparable.is_empty() {
        out.push_str(&format!(
            "incomparable ({}; in both dumps, layouts that cannot be matched, not compared{}): {}\n",
            c.incomparable.len(),
            if c.allow_incomparable {
                "; allowed by --allow-incomparable"
            } else {
                "; --allow-incomparable accepts them"
            },
            list(&c.incomparable)
        ));
    }
    out
}

/// The first divergence and the verdict.
fn divergence_text(c: &Comparison) -> String {
    let mut out = String::new();
    match &c.first_divergence {
        None if c.verdict() == CmpVerdict::Incomplete => {
            out.push_str("first divergence: none among the modules compared\n");
            if let Some((n, t)) = c.thin() {
                out.push_str(&format!(
                    "the logits were compared at {n} of {t} positions (the others left out after \
                     tied choices): too few to call it a pass\n"
                ));
            }
            out.push_str("verdict: incomplete\n");
        }
        None => out.push_str("first divergence: none\nverdict: within tolerance\n"),
        Some(f) => {
            out.push_str(&format!(
                "first divergence: {}{}\n  {}\n",
                f.module,
                f.layer.map_or(String::new(), |l| format!(" (layer {l})")),
                f.reading
            ));
            for i in &f.inputs {
                out.push_str(&format!(
                    "  input {}: {}{}\n",
                    i.name,
                    i.status.map_or("not in both dumps", |s| s.name()),
                    i.rel_l2
                        .map_or(String::new(), |x| format!(" (rel-L2 {})", num(x)))
                ));
            }
            if let Some(s) = &f.signature {
                out.push_str(&format!("  {}\n", super::reading::signature_line(s)));
            }
            out.push_str("verdict: diverged\n");
        }
    }
    out
}

/// The verdict of a comparison, as JSON and text say it.
pub fn verdict_word(c: &Comparison) -> &'static str {
    match c.verdict() {
        CmpVerdict::WithinTolerance => "within tolerance",
        CmpVerdict::Diverged => "diverged",
        CmpVerdict::Incomplete => "incomplete",
    }
}

/// `diff --json`.
pub fn diff_json(c: &Comparison) -> Value {
    json!({
        "reference": c.reference,
        "candidate": c.candidate,
        "tokens": c.tokens,
        "verdict": verdict_word(c),
        "incomparable": c.incomparable,
        "tolerances": c.tolerances,
        "modules": c.modules,
        "logits": c.logits,
        "first_divergence": c.first_divergence,
        "exclusions": c.exclusions,
        "only_reference": c.only_reference,
        "only_candidate": c.only_candidate,
        "notes": c.notes,
    })
}

/// `forward --json`: `{"tokens", "top", "continuation", "dsa", "modules", "logits",
/// "first_divergence", "verdict", …}` (`modules` empty and `logits`, `first_divergence` null
/// without `--reference`).
pub fn forward_json(o: &ForwardOutcome) -> Value {
    let (modules, logits, first, verdict, extra) = match &o.comparison {
        Some(c) => (
            serde_json::to_value(&c.modules).unwrap_or(Value::Null),
            serde_json::to_value(&c.logits).unwrap_or(Value::Null),
            serde_json::to_value(&c.first_divergence).unwrap_or(Value::Null),
            verdict_word(c),
            json!({
                "reference": c.reference,
                "tolerances": c.tolerances,
                "exclusions": c.exclusions,
                "only_reference": c.only_reference,
                "only_candidate": c.only_candidate,
                "notes": c.notes,
                "incomparable": c.incomparable,
            }),
        ),
        None => (
            json!([]),
            Value::Null,
            Value::Null,
            "no reference",
            Value::Null,
        ),
    };
    json!({
        "tokens": o.tokens,
        "token_texts": o.token_texts,
        "dtype": o.dtype,
        "weights": o.weights,
        "matmul": o.matmul.name(),
        "dsa": super::notes::dsa_json(&o.dsa),
        "top": o.top,
        "entropy": o.entropy,
        "log_vocab": o.log_vocab,
        "garbage": o.garbage,
        "continuation": o.continuation,
        "continuation_ids": o.continuation_ids,
        "stopped": o.stopped.map(super::notes::stop_text),
        "replayed": o.replayed,
        "tp": o.tp,
        "notes": o.notes,
        "settings": o.settings,
        "forward_seconds": o.forward_seconds,
        "bench": o.bench,
        "modules": modules,
        "logits": logits,
        "first_divergence": first,
        "verdict": verdict,
        "comparison": extra,
    })
}
