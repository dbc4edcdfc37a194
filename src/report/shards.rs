//! The words of `shards`: the plan, `--verify`, and `--against`'s findings (their causes and
//! details, also for the JSON output, are worded here from the engine's typed [`Cause`]).

use serde::{Serialize, Serializer};

use super::{human_bytes, num, shape, table};
use crate::shards::{rank_list, Cause, Finding, KvbPart, Problem, UncheckedReason};

/// Human output of `shards` (the plan).
pub fn shards_text(plan: &crate::plan::ShardPlan, rows: &[&crate::plan::ParamPlan]) -> String {
    let mut t = table(&[
        "vLLM parameter",
        "GGUF source",
        "type",
        "full shape",
        "style",
        "dim",
        "per-rank shard",
        "notes",
    ]);
    for p in rows {
        let mut notes = p
            .problems
            .iter()
            .map(|s| format!("PROBLEM: {s}"))
            .collect::<Vec<_>>();
        notes.extend(p.notes.iter().map(|n| n.to_string()));
        t.add_row(vec![
            p.param.clone(),
            p.gguf.join("\n"),
            p.dtype.clone(),
            shape(&p.full_shape),
            serde_json::to_value(p.style)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            p.shard_dim.map_or("-".into(), |d| d.to_string()),
            shape(&p.shard_shape),
            notes.join("\n"),
        ]);
    }
    let problems: usize = rows.iter().map(|p| p.problems.len()).sum();
    let splits = rows.iter().filter(|p| p.splits_quant_blocks).count();
    let mtp = if plan.mtp_blocks.is_empty() {
        String::new()
    } else {
        format!(
            "GGUF block(s) {}: the MTP (nextn) layer, not part of the served model (not planned)\n",
            plan.mtp_blocks
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    format!(
        "{t}\n{} parameters at tp={}: {} problem(s); {} cut(s) split quant blocks\n{mtp}",
        rows.len(),
        plan.tp,
        problems,
        splits
    )
}

/// Human output of `shards --verify`.
pub fn verify_text(r: &crate::shards::VerifyReport) -> String {
    let mut t = table(&[
        "vLLM parameter",
        "type",
        "shape",
        "absmax",
        "mean",
        "std",
        "NaN",
        "Inf",
        "shards",
        "problems",
    ]);
    for p in &r.params {
        t.add_row(vec![
            p.param.clone(),
            p.dtype.clone(),
            shape(&p.full_shape),
            num(p.absmax),
            num(p.mean),
            num(p.std),
            p.nan.to_string(),
            p.inf.to_string(),
            if p.reassembles { "ok" } else { "BAD" }.into(),
            p.problems
                .iter()
                .map(problem_text)
                .collect::<Vec<_>>()
                .join("\n"),
        ]);
    }
    let bad = r.params.iter().filter(|p| !p.problems.is_empty()).count();
    format!(
        "{t}\nverified {} parameters at tp={} ({} of GGUF data in {:.2} s, {:.2} GB/s): {}\n",
        r.params.len(),
        r.tp,
        human_bytes(r.bytes),
        r.seconds,
        r.bytes as f64 / r.seconds.max(1e-9) / 1e9,
        if bad == 0 {
            "all sound".to_string()
        } else {
            format!("{bad} with problems")
        }
    )
}

/// Human output of `shards --against`.
pub fn against_text(r: &crate::shards::AgainstReport) -> String {
    let mut out = String::new();
    let matched = r
        .checked
        .iter()
        .filter(|c| c.class == crate::shards::Class::Match)
        .count();
    let quant = r
        .checked
        .iter()
        .filter(|c| c.class == crate::shards::Class::Quantization)
        .count();
    out.push_str(&findings_table(&r.findings));
    out.push_str(&provenance_line(&r.provenance));
    out.push_str(&format!(
        "checked {} parameter shards at tp={}: {} match, {} differ by quantization noise only, {} corrupt\n",
        r.checked.len(),
        r.tp,
        matched,
        quant,
        r.checked.len() - matched - quant
    ));
    for u in &r.unreadable_ranks {
        out.push_str(&format!("rank {} not checked: {}\n", u.rank, u.error));
    }
    for u in &r.unchecked {
        out.push_str(&format!(
            "not checked: {} on rank(s) {}: {}\n",
            u.param,
            rank_list(&u.ranks),
            reason_text(&u.reason)
        ));
    }
    use crate::shards::Verdict;
    if !r.missing_ranks.is_empty() {
        out.push_str(&format!(
            "missing rank files: {} (narrow the check with --ranks to the ranks you dumped)\n",
            rank_list(&r.missing_ranks)
        ));
    }
    if !r.missing.is_empty() {
        out.push_str(&format!(
            "{} parameter(s) absent from the dump (narrow with --tensor/--layer): {}\n",
            r.missing.len(),
            r.missing.join(", ")
        ));
    }
    for (alias, n) in &r.aliases {
        out.push_str(&format!(
            "read under another name of the same parameter: {alias} ({n} tensor(s))\n"
        ));
    }
    if r.buffers_ignored > 0 {
        out.push_str(&format!(
            "{} vLLM buffer(s) (attention scales, RoPE caches) recognized, not weights: not compared\n",
            r.buffers_ignored
        ));
    }
    if !r.unexpected.is_empty() {
        out.push_str(&format!(
            "{} tensor name(s) glmcheck does not know (the dump may come from a layout it cannot check{}): {}\n",
            r.unexpected.len(),
            if r.allow_unexpected {
                "; allowed by --allow-unexpected"
            } else {
                "; --allow-unexpected accepts them"
            },
            r.unexpected.join(", ")
        ));
    }
    let ranks = if r.ranks.len() == r.tp {
        format!("all {} ranks", r.tp)
    } else {
        format!("ranks {}", rank_list(&r.ranks))
    };
    out.push_str(&format!(
        "{} of {} expected parameter shards checked ({ranks}); {} not checked\n",
        r.checked_shards,
        r.expected_shards,
        r.expected_shards.saturating_sub(r.checked_shards)
    ));
    out.push_str(match r.verdict {
        Verdict::Pass => "verdict: pass\n",
        Verdict::Fail => "verdict: fail\n",
        Verdict::Incomplete => {
            "verdict: incomplete (nothing corrupt among what was checked, but not everything was checked)\n"
        }
    });
    out
}

/// The findings of `--against` as a table (or the line saying there are none).
fn findings_table(findings: &[Finding]) -> String {
    if findings.is_empty() {
        return "no corrupt parameter found\n".to_string();
    }
    let mut t = table(&[
        "layer",
        "vLLM parameter",
        "ranks",
        "cause",
        "rel-L2",
        "cosine",
        "detail",
    ]);
    for f in findings {
        t.add_row(vec![
            f.layer.map_or("-".into(), |l| l.to_string()),
            f.param.clone(),
            rank_list(&f.ranks),
            cause_name(&f.cause).to_string(),
            num(f.rel_l2),
            format!("{:.4}", f.cosine),
            cause_detail(&f.cause),
        ]);
    }
    format!("{t}\n")
}

/// Which provenance the check held the shards to, and why (nothing for originals decided without
/// quantized shards).
fn provenance_line(pb: &crate::shards::ProvenanceBasis) -> String {
    match (pb.provenance, pb.forced) {
        (crate::shards::Provenance::Gguf, true) => {
            "provenance: this GGUF's dequantized values (--provenance gguf): every shard must equal them up to the dump's dtype\n".to_string()
        }
        (crate::shards::Provenance::Originals, true) => {
            "provenance: the unquantized originals (--provenance originals): shards may differ by the quant type's noise\n".to_string()
        }
        (crate::shards::Provenance::Gguf, false) => format!(
            "provenance: this GGUF's dequantized values ({} of {} quantized shards equal them up to the dump's dtype): every shard is held to that\n",
            pb.equal_to_dequantized, pb.quantized_shards
        ),
        (crate::shards::Provenance::Originals, false) if pb.quantized_shards > 0 => format!(
            "provenance: the unquantized originals ({} of {} quantized shards equal the dequantized values): shards may differ by the quant type's noise (--provenance gguf holds them to the dump's dtype)\n",
            pb.equal_to_dequantized, pb.quantized_shards
        ),
        (crate::shards::Provenance::Originals, false) => String::new(),
    }
}

/// A `--verify` problem in words.
pub fn problem_text(p: &Problem) -> String {
    match p {
        Problem::Cut(p) => p.to_string(),
        Problem::Plan(s) | Problem::Unreadable(s) => s.clone(),
        Problem::SourcesMissing => "GGUF source tensor(s) missing".to_string(),
        Problem::NonFinite { nan, inf } => format!("{nan} NaN and {inf} Inf values"),
        Problem::KvbLayout { part, rel_l2 } => {
            let (rows, gguf) = match part {
                KvbPart::KNope => ("k_nope", "attn_k_b transposed"),
                KvbPart::V => ("v", "attn_v_b"),
            };
            format!(
                "kv_b_proj's per-head {rows} rows do not equal the GGUF's {gguf} (rel-L2 {rel_l2:.3e})"
            )
        }
        Problem::KvbLayoutUnchecked(e) => format!("kv_b_proj layout check: {e}"),
    }
}

/// `VerifyRow.problems` in the JSON: their sentences.
pub fn verify_problems<S: Serializer>(p: &[Problem], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(p.iter().map(problem_text))
}

/// The cause's name (a fault's own name for a known loader bug).
pub fn cause_name(c: &Cause) -> &'static str {
    match c {
        Cause::Fault { fault, .. } => fault.cause(),
        Cause::MergedRank0 { .. } => crate::faults::Fault::MergedRank0.cause(),
        Cause::RanksSwapped { .. } | Cause::HoldsShardOf { .. } => "rank-swap",
        Cause::ShapeMismatch { .. } => "shape-mismatch",
        Cause::Unexplained { .. } => "unexplained",
    }
}

/// What a fault's signature saw, in words.
pub fn sign(s: &crate::faults::Sign) -> String {
    use crate::faults::Sign;
    match s {
        Sign::WrongDim { dim, shard_dim } => {
            format!("cut along dim {dim} instead of dim {shard_dim}")
        }
        Sign::VocabUnpadded {
            rows,
            vocab,
            padded_rows,
            padded,
        } => format!(
            "{rows} rows per rank (vocab {vocab}/tp) instead of {padded_rows} (vocab padded to {padded}/tp)"
        ),
        Sign::AllZeros => "all zeros (an init value: the parameter was never loaded)".into(),
        Sign::AllOnes => "all ones (an init value: the parameter was never loaded)".into(),
        Sign::Bf16Bits => "declared F16, but the bits are the expected values in bf16".into(),
        Sign::MidsplitBlock => "holds a contiguous block of the [gate; up] concatenation instead of gate shard r then up shard r".into(),
        Sign::KvbConcat => "rows are all heads' k_nope then all heads' v, not [k_nope; v] per head: this rank computes with the wrong heads".into(),
        Sign::KvbUntransposed => "k rows are attn_k_b reshaped, not transposed back ([H, kv_lora, nope] read as [H, nope, kv_lora])".into(),
    }
}

/// The cause's detail: what the ranks hold.
pub fn cause_detail(c: &Cause) -> String {
    match c {
        Cause::Fault {
            detail,
            experts: Some((corrupt, of)),
            ..
        } => format!("{} (in {corrupt} of {of} experts)", sign(detail)),
        Cause::Fault { detail, .. } => sign(detail),
        Cause::MergedRank0 { shard } => {
            format!("every rank holds shard {shard} (the tp rank was ignored while loading)")
        }
        Cause::RanksSwapped { a, b } => format!("ranks {a} and {b} hold each other's shards"),
        Cause::HoldsShardOf { rank, of } => format!("rank {rank} holds rank {of}'s shard"),
        Cause::ShapeMismatch { expected, found } => {
            format!("shape {found:?}, expected {expected:?}")
        }
        Cause::Unexplained { rel_l2, cosine } => {
            format!("rel-L2 {rel_l2:.3e}, cosine {cosine:.4}: no known loader bug's signature fits")
        }
    }
}

/// Whether two causes read the same (name and detail): their ranks are one finding.
pub fn same_reading(a: &Cause, b: &Cause) -> bool {
    cause_name(a) == cause_name(b) && cause_detail(a) == cause_detail(b)
}

/// Why a parameter was not compared.
pub fn reason_text(r: &UncheckedReason) -> String {
    match r {
        UncheckedReason::NotFloat { file, dtype } => format!(
            "{} holds it as {dtype:?}, not a float tensor: not compared",
            file.display()
        ),
        UncheckedReason::NotRebuilt(e) => e.clone(),
    }
}

/// `Unchecked.reason` in the JSON: its sentence.
pub fn unchecked_reason<S: Serializer>(r: &UncheckedReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&reason_text(r))
}

/// A finding as the JSON shows it: the cause's name and detail as words.
#[derive(Serialize)]
struct FindingJson<'a> {
    param: &'a str,
    layer: Option<usize>,
    ranks: &'a [usize],
    cause: &'static str,
    detail: String,
    rel_l2: f64,
    cosine: f64,
}

impl Serialize for Finding {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        FindingJson {
            param: &self.param,
            layer: self.layer,
            ranks: &self.ranks,
            cause: cause_name(&self.cause),
            detail: cause_detail(&self.cause),
            rel_l2: self.rel_l2,
            cosine: self.cosine,
        }
        .serialize(s)
    }
}

/// A plan problem in words (the JSON's `problems` strings).
impl std::fmt::Display for crate::plan::PlanProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::plan::PlanProblem::*;
        match self {
            NoShape => f.write_str("no shape (the parameter's parts are unknown)"),
            NotDivisible { what, n, tp } => write!(f, "{what} {n} is not divisible by tp={tp}"),
            NotThreeD { shape } => write!(f, "expert tensor of shape {shape:?} is not 3-D"),
            HeadsNotDivisible { heads, tp } => write!(
                f,
                "{heads} attention heads cannot be split over tp={tp}: a rank would hold part of a head"
            ),
            HeadsMisaligned { rank, rows, heads } => write!(
                f,
                "rank {rank} gets rows {}..{}, not whole heads {}..{} like the other attention projections",
                rows.0, rows.1, heads.0, heads.1
            ),
        }
    }
}

/// A plan note in words (the JSON's `notes` strings).
impl std::fmt::Display for crate::plan::PlanNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::plan::PlanNote::*;
        match self {
            NotInTable { part } => write!(f, "internal: {part} is not in the name table"),
            GgufMissing { tensor } => write!(f, "GGUF tensor {tensor} is missing"),
            SplitsQuantBlocks {
                width,
                dtype,
                block,
            } => write!(
                f,
                "cut splits quant blocks: {width}-wide input slices of {dtype}'s {block}-value blocks; dequantize before sharding, do not slice GGUF bytes"
            ),
            VocabPadded { vocab, padded } => write!(
                f,
                "vocab {vocab} padded to {padded} (×{}); the last {} rows of the padded table are zero",
                crate::plan::VOCAB_PADDING,
                padded - vocab
            ),
            HeadsPerRank { heads } => write!(f, "{heads} head(s) per rank"),
        }
    }
}

impl serde::Serialize for crate::plan::PlanProblem {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl serde::Serialize for crate::plan::PlanNote {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// `shards --against --report DIR`'s report.html: the verdict line and the findings table.
pub fn against_html(r: &crate::shards::AgainstReport) -> String {
    let rows: Vec<(String, String, String)> = r
        .findings
        .iter()
        .map(|f| {
            (
                format!("{} (ranks {:?})", f.param, f.ranks),
                cause_name(&f.cause).to_string(),
                format!(
                    "{} (rel-L2 {:.3e}, cosine {:.4})",
                    cause_detail(&f.cause),
                    f.rel_l2,
                    f.cosine
                ),
            )
        })
        .collect();
    let text = against_text(r);
    super::html::table_html(
        "shards --against",
        text.lines().last().unwrap_or_default(),
        &rows,
    )
}

/// findings.jsonl of `shards --against`: one finding per line.
pub fn against_jsonl(r: &crate::shards::AgainstReport) -> String {
    super::html::jsonl(r.findings.iter().map(|f| {
        serde_json::json!({
            "param": f.param,
            "layer": f.layer,
            "ranks": f.ranks,
            "cause": cause_name(&f.cause),
            "why": cause_detail(&f.cause),
            "rel_l2": f.rel_l2,
            "cosine": f.cosine,
        })
    }))
}

/// `shards --verify --report DIR`'s report.html: the verdict line and every parameter with a
/// problem.
pub fn verify_html(r: &crate::shards::VerifyReport) -> String {
    let rows: Vec<(String, String, String)> = r
        .params
        .iter()
        .filter(|p| !p.problems.is_empty())
        .map(|p| {
            let why: Vec<String> = p.problems.iter().map(problem_text).collect();
            (p.param.clone(), "FAIL".to_string(), why.join("; "))
        })
        .collect();
    let text = verify_text(r);
    super::html::table_html(
        "shards --verify",
        text.lines().last().unwrap_or_default(),
        &rows,
    )
}

/// findings.jsonl of `shards --verify`: one parameter per line, with its problems.
pub fn verify_jsonl(r: &crate::shards::VerifyReport) -> String {
    super::html::jsonl(r.params.iter().map(|p| {
        serde_json::json!({
            "param": p.param,
            "dtype": p.dtype,
            "reassembles": p.reassembles,
            "nan": p.nan,
            "inf": p.inf,
            "problems": p.problems.iter().map(problem_text).collect::<Vec<_>>(),
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Fault;

    #[test]
    fn findings_serialize_their_cause_as_name_and_detail() {
        let f = Finding {
            param: "model.layers.1.self_attn.o_proj.weight".into(),
            layer: Some(1),
            ranks: vec![1, 3],
            cause: Cause::RanksSwapped { a: 1, b: 3 },
            rel_l2: 1.25,
            cosine: 0.5,
        };
        assert_eq!(
            serde_json::to_string(&f).expect("serializes"),
            r#"{"param":"model.layers.1.self_attn.o_proj.weight","layer":1,"ranks":[1,3],"cause":"rank-swap","detail":"ranks 1 and 3 hold each other's shards","rel_l2":1.25,"cosine":0.5}"#
        );
    }

    #[test]
    fn verify_problems_in_words() {
        assert_eq!(
            problem_text(&Problem::KvbLayout {
                part: KvbPart::KNope,
                rel_l2: 0.5
            }),
            "kv_b_proj's per-head k_nope rows do not equal the GGUF's attn_k_b transposed (rel-L2 5.000e-1)"
        );
        assert_eq!(
            problem_text(&Problem::NonFinite { nan: 2, inf: 0 }),
            "2 NaN and 0 Inf values"
        );
    }

    #[test]
    fn details_and_grouping() {
        let zeroed = |experts| Cause::Fault {
            fault: Fault::ParamZeroed("*".into()),
            detail: crate::faults::Sign::AllZeros,
            experts,
        };
        assert_eq!(cause_name(&zeroed(None)), "param-zeroed");
        assert_eq!(
            cause_detail(&zeroed(Some((3, 8)))),
            "all zeros (an init value: the parameter was never loaded) (in 3 of 8 experts)"
        );
        assert!(!same_reading(&zeroed(None), &zeroed(Some((3, 8)))));
        assert_eq!(
            cause_detail(&Cause::HoldsShardOf { rank: 2, of: 1 }),
            "rank 2 holds rank 1's shard"
        );
        // Unexplained readings that print alike are one finding; others are not.
        let u = |rel_l2, cosine| Cause::Unexplained { rel_l2, cosine };
        assert!(same_reading(&u(0.123_41, 0.5), &u(0.123_42, 0.5)));
        assert!(!same_reading(&u(0.1234, 0.5), &u(0.1244, 0.5)));
        assert_eq!(
            cause_detail(&u(0.1234, 0.5)),
            "rel-L2 1.234e-1, cosine 0.5000: no known loader bug's signature fits"
        );
    }
}
