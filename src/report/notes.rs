//! The commands' one-line messages on stderr, the notes a run records, and the fault list of
//! `inject --help`.

use std::path::Path;

use crate::faults::{Fault, FAULTS};
use crate::forward::{DsaNote, Stop};
use crate::gguf::GgufFile;

/// `inspect -v`: one GGUF part's header summary.
pub fn gguf_part_line(p: &GgufFile) -> String {
    format!(
        "glmcheck: {}: GGUF v{}, {} metadata entries, {} tensors, data at {}",
        p.path.display(),
        p.version,
        p.metadata.len(),
        p.tensors.len(),
        p.data_offset
    )
}

/// `forward --help`: the environment settings, one line each (`model::knobs::TABLE`).
pub fn settings_help() -> String {
    let rows = crate::model::knobs::TABLE
        .iter()
        .map(|(name, doc)| format!("  {name}\n      {doc}"))
        .collect::<Vec<_>>()
        .join("\n");
    format!(
        "Environment settings (measurement switches; each swaps one implementation for another, an\nunlisted value warns and the default is used):\n{rows}"
    )
}

/// Any command: a `GLMCHECK_*` setting with a value it does not take (its default is used).
pub fn setting_warning(name: &str, value: &str, takes: &[&str]) -> String {
    format!(
        "glmcheck: warning: {name}={value:?} is not a value it takes ({}): its default is used",
        takes.join(" / ")
    )
}

/// `shards --against`: the dump holds another number of ranks than --tp.
pub fn rank_count_warning(dir: &Path, dump_tp: usize, tp: usize) -> String {
    format!(
        "glmcheck: warning: {} holds rank files up to rank {}, checking at --tp {tp}",
        dir.display(),
        dump_tp.saturating_sub(1)
    )
}

/// `inject`: what was written.
pub fn injected(files: usize, out: &Path, fault: &Fault) -> String {
    injected_as(files, out, fault.cause())
}

/// `inject --patches`: what was written, the patches by name.
pub fn injected_patches(files: usize, out: &Path, patches: &[crate::bisect::Patch]) -> String {
    let names: Vec<String> = patches.iter().map(|p| p.injection().to_string()).collect();
    injected_as(files, out, &names.join(" + "))
}

fn injected_as(files: usize, out: &Path, what: &str) -> String {
    format!(
        "glmcheck: wrote {files} rank files to {} (fault {what})",
        out.display()
    )
}

/// `forward --dump`: what was written.
pub fn captures_written(n: usize, out: &Path) -> String {
    format!("glmcheck: wrote {n} captures to {}", out.display())
}

/// `forward --tokens` on a GGUF without a usable tokenizer.
pub fn no_token_texts(e: &impl std::fmt::Display) -> String {
    format!("glmcheck: warning: no token texts: {e}")
}

/// `forward --tp` without --reference: what the run is compared with.
pub fn unsharded_source(gguf: &Path) -> String {
    format!("the unsharded forward of {}", gguf.display())
}

/// `forward --fault` without --reference: what the faulted run is compared with.
pub fn unfaulted_source(gguf: &Path) -> String {
    format!(
        "the forward of {} without the injected faults",
        gguf.display()
    )
}

/// `forward --fault`: what was injected.
pub fn fault_note(injections: &[crate::faults::Injection]) -> String {
    let list: Vec<String> = injections
        .iter()
        .map(|i| match &i.layers {
            Some(_) => format!("{i} ({})", i.fault.spec().about),
            None => format!("{i} on every layer it changes ({})", i.fault.spec().about),
        })
        .collect();
    format!("injected: {}", list.join("; "))
}

/// `forward --tp`: where the simulated ranks' weights came from.
pub fn tp_note(tp: usize, weights_from: Option<&Path>, missing: &[String]) -> String {
    match weights_from {
        Some(dir) => format!(
            "simulated tp={tp}: the ranks' weights from {}{}",
            dir.display(),
            if missing.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} parameter(s) absent there, cut from the GGUF: {})",
                    missing.len(),
                    missing.join(", ")
                )
            }
        ),
        None => format!("simulated tp={tp}: the ranks' shards cut from the GGUF as vLLM cuts them"),
    }
}

/// `forward --weights-from` without --reference: what the dump's weights are, which sets the
/// tolerances against the GGUF's own forward.
pub fn dump_weights_note(d: &crate::shards::DumpWeights) -> String {
    use crate::shards::Relation;
    let (l, pb) = (d.sampled_layer.unwrap_or(0), &d.provenance);
    let from = match d.relation() {
        Relation::Unquantized => format!("the values of this unquantized ({}) GGUF", d.gguf.name),
        Relation::Indistinct => format!(
            "this GGUF's values or the originals: their {} rounding is as coarse as the GGUF's {} \
             quantization, so the two cannot be told apart",
            d.stored.name, d.gguf.name
        ),
        Relation::Dequantized => format!(
            "this GGUF's dequantized values (layer {l}: {} of {} quantized shards equal them)",
            pb.equal_to_dequantized, pb.quantized_shards
        ),
        Relation::Originals => format!(
            "not this GGUF's values but, as far as layer {l} shows ({} of {} quantized shards equal \
             them), the unquantized originals, which differ from it by its {} quantization",
            pb.equal_to_dequantized, pb.quantized_shards, d.gguf.name
        ),
    };
    format!(
        "the dump's weights, stored as {}, are {from}: compared with the GGUF's f32 forward at the \
         tolerances of {} weights",
        d.stored.name,
        d.class().name
    )
}

/// `forward --tp`: a rank whose replicated parameter is not rank 0's.
pub fn replica_note(m: &crate::model::ReplicaMismatch) -> String {
    format!(
        "rank {}'s {} differs from rank 0's (rel-L2 {:.3e}): vLLM gives every rank its own copy of \
         this replicated parameter, the simulation runs rank 0's, so rank {} is not simulated \
         faithfully — `glmcheck shards FILE --against DIR` names which copy is wrong",
        m.rank, m.module, m.rel_l2, m.rank
    )
}

/// What `--dsa` means for this prompt (text and `dsa.message` in --json).
pub fn dsa_message(d: &DsaNote) -> String {
    let (t, k, new) = (d.tokens, d.index_topk, d.new_tokens);
    match (d.mode == "dense", d.identical) {
        (true, true) => {
            let mut m = format!(
                "--dsa dense is identical to sparse on this prompt: with {t} tokens ≤ index_topk {k} the \
                 indexer selects every visible key, so its mask equals the causal mask"
            );
            if t + new > k && new > 0 {
                m.push_str(&format!(
                    "; the continuation passes {k} tokens, from there on the two may differ"
                ));
            }
            m
        }
        (true, false) => format!(
            "--dsa dense differs from GLM-5's sparse attention on this prompt: positions ≥ {k} attend to \
             every earlier key instead of their indexer's top-{k} (transformers runs sparse)"
        ),
        (false, true) => format!(
            "sparse (DSA) attention; with {t} tokens ≤ index_topk {k} every visible key is selected, \
             so it equals dense attention here"
        ),
        (false, false) => {
            format!("sparse (DSA) attention: each query attends to its indexer's top-{k} keys")
        }
    }
}

/// `forward --json`'s `"dsa"`: the note's fields and its message.
pub fn dsa_json(d: &DsaNote) -> serde_json::Value {
    let mut v = serde_json::to_value(d).unwrap_or(serde_json::Value::Null);
    if let Some(m) = v.as_object_mut() {
        m.insert("message".into(), dsa_message(d).into());
    }
    v
}

/// Why the greedy continuation stopped early.
pub fn stop_text(s: Stop) -> String {
    match s {
        Stop::EndOfGeneration(id) => format!("end-of-generation token {id}"),
        Stop::MaxPositions => "max_position_embeddings reached".into(),
    }
}

/// The capture's source label of a simulated tensor-parallel run.
pub fn simulated_tp_source(tp: usize) -> String {
    format!("glmcheck forward (simulated tp={tp})")
}

/// `Faults: none, kvb-concat, …` from the fault table, wrapped at 80 columns (continuation lines
/// indented by two).
pub fn fault_list_help() -> String {
    let mut lines = vec![String::from("Faults:")];
    // The weight faults: a dump can hold them (behaviour faults are `forward --fault`'s).
    let weight: Vec<_> = FAULTS
        .iter()
        .filter(|f| f.hits != crate::faults::Hits::Forward)
        .collect();
    for (i, f) in weight.iter().enumerate() {
        let item = if i + 1 < weight.len() {
            format!("{},", f.syntax())
        } else {
            f.syntax()
        };
        let last = lines.last_mut().expect("one line at least");
        if last.len() + 1 + item.len() > 80 {
            lines.push(format!("  {item}"));
        } else {
            last.push(' ');
            last.push_str(&item);
        }
    }
    lines.join("\n")
}

/// `synth`'s text: what was written.
pub fn synth_text(r: &crate::synth::SynthReport, out: &Path) -> String {
    let types: Vec<String> = r.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    format!(
        "wrote {} ({:.2} GB): {} random-weight layers ({} dense, {} MoE) at {} dimensions, {} \
         tensors ({}), seed {}\n",
        out.display(),
        r.bytes as f64 / 1e9,
        r.layers,
        r.dense_layers,
        r.layers - r.dense_layers,
        match r.dims {
            crate::synth::Dims::Glm5 => "GLM-5's",
            crate::synth::Dims::Tiny => "the tiny fixtures'",
        },
        r.tensors,
        types.join(", "),
        r.seed
    )
}

/// How the forward multiplied the GGUF's quantized weights, in the run's header line.
pub fn matmul_text(m: crate::model::MatmulMode) -> &'static str {
    match m {
        crate::model::MatmulMode::Dequant => "dequantized before each matmul",
        crate::model::MatmulMode::Q8 => "multiplied by q8 kernels",
    }
}

/// `export`'s text: what was written.
pub fn export_text(r: &crate::export::ExportReport) -> String {
    let l = &r.layers;
    let layers = if l.count == l.of {
        format!("all {} decoder layers", l.of)
    } else {
        format!(
            "decoder layers {}..{} of {} (renumbered 0..{})",
            l.first,
            l.last,
            l.of,
            l.count - 1
        )
    };
    let shards = r
        .files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .count();
    format!(
        "wrote {} ({} in {:.1} s): {} tensors in {} {} safetensors shard{} with its index and \
         config.json; {}, MTP layers not exported\n",
        r.out.display(),
        crate::report::human_bytes(r.bytes),
        r.seconds,
        r.tensors,
        shards,
        match r.dtype {
            crate::export::ExportDtype::Bf16 => "bf16",
            crate::export::ExportDtype::F32 => "f32",
        },
        if shards == 1 { "" } else { "s" },
        layers
    )
}

/// `export -v`: a file of the checkpoint is complete.
pub fn export_file_note(name: &str, bytes: u64) -> String {
    format!(
        "glmcheck: wrote {name} ({})",
        crate::report::human_bytes(bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fault_list_is_the_weight_faults_wrapped() {
        assert_eq!(
            fault_list_help(),
            "Faults: none, kvb-concat, kvb-untransposed, rank-swap:A,B, merged-rank0,\n  \
             merged-midsplit, param-zeroed:GLOB, wrong-dim, vocab-unpadded, bf16-as-f16,\n  \
             force-dequant:GLOB"
        );
    }

    #[test]
    fn the_dsa_message_says_when_dense_equals_sparse() {
        let note = |mode, tokens, new_tokens| DsaNote {
            mode,
            index_topk: 4,
            tokens,
            identical: tokens <= 4,
            new_tokens,
        };
        assert!(dsa_message(&note("dense", 3, 0)).starts_with(
            "--dsa dense is identical to sparse on this prompt: with 3 tokens ≤ index_topk 4"
        ));
        assert!(dsa_message(&note("dense", 3, 2))
            .ends_with("; the continuation passes 4 tokens, from there on the two may differ"));
        assert!(dsa_message(&note("dense", 5, 0)).starts_with("--dsa dense differs"));
        assert_eq!(
            dsa_message(&note("sparse", 5, 0)),
            "sparse (DSA) attention: each query attends to its indexer's top-4 keys"
        );
        let j = dsa_json(&note("sparse", 2, 8));
        assert_eq!(j["mode"], "sparse");
        assert_eq!(j["identical"], true);
        assert!(j.get("new_tokens").is_none());
        assert!(j["message"]
            .as_str()
            .is_some_and(|m| m.contains("equals dense attention")));
        assert_eq!(
            stop_text(Stop::EndOfGeneration(7)),
            "end-of-generation token 7"
        );
    }

    #[test]
    fn the_tp_note_names_what_was_cut_from_the_gguf() {
        let d = Path::new("/d");
        assert_eq!(
            tp_note(4, None, &[]),
            "simulated tp=4: the ranks' shards cut from the GGUF as vLLM cuts them"
        );
        assert_eq!(
            tp_note(2, Some(d), &[]),
            "simulated tp=2: the ranks' weights from /d"
        );
        assert_eq!(
            tp_note(2, Some(d), &["a".into(), "b".into()]),
            "simulated tp=2: the ranks' weights from /d (2 parameter(s) absent there, cut from the GGUF: a, b)"
        );
        assert_eq!(
            rank_count_warning(d, 8, 4),
            "glmcheck: warning: /d holds rank files up to rank 7, checking at --tp 4"
        );
    }
}
