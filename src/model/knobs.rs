//! Every `GLMCHECK_*` environment setting the forward reads, in one place, each read once per
//! process. They switch one implementation for another to measure them against each other (the
//! defaults are the measured best, and every alternative has a test of its own); none changes what
//! a comparison reports beyond its own rounding. [`TABLE`] names them with a line each; the README's
//! table lists the same names (a test checks both ways), and no other file reads them.

use std::sync::OnceLock;

/// The settings as this process's environment gave them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Knobs {
    /// `GLMCHECK_FUSED`: `off` candle's chains instead of the fused kernels, `no-norm` all but the
    /// fused RMSNorm.
    pub fused: Option<String>,
    /// `GLMCHECK_COPY16=off`: candle's transpose copy and MLA's one-value-a-thread copies.
    pub copy16_off: bool,
    /// `GLMCHECK_INDEXER=always`: the DSA indexer computed even where nothing reads it.
    pub indexer_always: bool,
    /// `GLMCHECK_DENSE=decode|tiled`: every dense matmul decode-then-GEMM, or through the grouped
    /// kernel's tiles, whatever the token count; `wgmma|wgmma64`: past 32 tokens through the wgmma
    /// kernel (`wgmma_cuda`), 128 tokens a block past 64 tokens or 64 always.
    pub dense: Option<String>,
    /// `GLMCHECK_DEQUANT_EXPERTS`: `batched` (decode-then-GEMM), `smem`, `one`, `direct`,
    /// `direct8`, `directh`, `runsb` (another tiled kernel).
    pub dequant_experts: Option<String>,
    /// `GLMCHECK_DEQUANT_TILE=8|16|32`: one launch of the register kernel at that width.
    pub dequant_tile: Option<u8>,
    /// `GLMCHECK_Q8_EXPERTS=mmq`: candle's MMQ kernels for q8 mode's experts.
    pub q8_experts_mmq: bool,
    /// `GLMCHECK_Q8_INPUT=f32`: q8 mode casts bf16 inputs to f32 before quantizing them.
    pub q8_input_f32: bool,
    /// `GLMCHECK_Q8_TILE=8|16|32`: q8 mode's expert tile width.
    pub q8_tile: Option<usize>,
    /// `GLMCHECK_Q8_DENSE`: `candle` (candle's kernels), `all`, `splitk`, `narrow`, `wide` (the int8
    /// kernel's grid and split-K rules changed; `q8_cuda::int8_dense`).
    pub q8_dense: Option<String>,
    /// `GLMCHECK_Q8_DENSE_TILE=32|64|128`: the widest int8 dense tile.
    pub q8_dense_tile: Option<usize>,
    /// `GLMCHECK_EVENT_TRACKING=on`: keep cudarc's per-allocation events.
    pub event_tracking: bool,
    /// `GLMCHECK_ROUTING=ahead`: on CUDA a MoE layer reads its routing to the host during its
    /// shared expert (`host_ids`) instead of synchronously before its experts.
    pub routing_ahead: bool,
}

/// Each setting's name and what it does, for `--help`-like listings and the README's table. The
/// text before the first `:` is the values it takes (` / ` between them; `any value`), which
/// [`unrecognised`] checks and a test holds [`Knobs::from_vars`] to.
pub const TABLE: &[(&str, &str)] = &[
    ("GLMCHECK_FUSED", "off / no-norm: candle's chains instead of the fused CUDA kernels, or all but the fused RMSNorm"),
    ("GLMCHECK_COPY16", "off: candle's copies instead of the 16-byte ones (attention's output, MLA's keys/values)"),
    ("GLMCHECK_INDEXER", "always: compute the DSA indexer even where nothing reads it (transformers' work)"),
    ("GLMCHECK_DENSE", "decode / tiled / wgmma / wgmma64: every dense matmul decode-then-GEMM, or through the grouped kernel; or past 32 tokens through the Hopper wgmma kernel, 128 tokens a block past 64 (wgmma) or 64 always (wgmma64) (not yet run on a GPU)"),
    ("GLMCHECK_DEQUANT_EXPERTS", "batched / smem / one / direct / direct8 / directh / runsb: another experts kernel"),
    ("GLMCHECK_DEQUANT_TILE", "8 / 16 / 32: the experts' register kernel in one launch at that width"),
    ("GLMCHECK_Q8_EXPERTS", "mmq: candle's MMQ kernels for q8 mode's experts"),
    ("GLMCHECK_Q8_INPUT", "f32: q8 mode casts bf16 inputs to f32 before quantizing them"),
    ("GLMCHECK_Q8_TILE", "8 / 16 / 32: q8 mode's expert tile width"),
    ("GLMCHECK_Q8_DENSE", "candle / all / splitk / narrow / wide: q8 mode's dense matmuls on candle's kernels, or the int8 kernel's grid and split-K rules changed"),
    ("GLMCHECK_Q8_DENSE_TILE", "32 / 64 / 128: the widest int8 dense tile"),
    ("GLMCHECK_EVENT_TRACKING", "on: keep cudarc's per-allocation CUDA events"),
    ("GLMCHECK_ROUTING", "ahead: on CUDA a MoE layer reads its routing back during its shared expert (not yet run on a GPU)"),
    ("GLMCHECK_PEAK_RSS", "any value: print the peak resident memory at exit (read by main)"),
];

impl Knobs {
    /// The settings `var` gives (the environment, or a test's map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Knobs {
        // a value its row lists, else unset (the default; `unrecognised` says so): the values a
        // setting takes are its row's, nowhere else
        let one_of = |name: &str| {
            let takes = TABLE
                .iter()
                .find(|(n, _)| *n == name)
                .and_then(|&(_, doc)| documented_values(doc));
            var(name).filter(|v| takes.is_some_and(|t| t.contains(&v.as_str())))
        };
        let is = |name: &str, v: &str| one_of(name).is_some_and(|x| x == v);
        let num = |name: &str| one_of(name).and_then(|v| v.parse::<usize>().ok());
        Knobs {
            fused: one_of("GLMCHECK_FUSED"),
            copy16_off: is("GLMCHECK_COPY16", "off"),
            indexer_always: is("GLMCHECK_INDEXER", "always"),
            dense: one_of("GLMCHECK_DENSE"),
            dequant_experts: one_of("GLMCHECK_DEQUANT_EXPERTS"),
            dequant_tile: num("GLMCHECK_DEQUANT_TILE").and_then(|t| u8::try_from(t).ok()),
            q8_experts_mmq: is("GLMCHECK_Q8_EXPERTS", "mmq"),
            q8_input_f32: is("GLMCHECK_Q8_INPUT", "f32"),
            q8_tile: num("GLMCHECK_Q8_TILE"),
            q8_dense: one_of("GLMCHECK_Q8_DENSE"),
            q8_dense_tile: num("GLMCHECK_Q8_DENSE_TILE"),
            event_tracking: is("GLMCHECK_EVENT_TRACKING", "on"),
            routing_ahead: is("GLMCHECK_ROUTING", "ahead"),
        }
    }

    /// Whether `GLMCHECK_DEQUANT_EXPERTS` is `v`.
    pub fn experts_are(&self, v: &str) -> bool {
        self.dequant_experts.as_deref() == Some(v)
    }
}

/// The values `doc` (a [`TABLE`] row's text) says its setting takes; `None`: any value.
fn documented_values(doc: &'static str) -> Option<Vec<&'static str>> {
    let head = doc.split(':').next().unwrap_or_default();
    (head != "any value").then(|| head.split(" / ").map(str::trim).collect())
}

/// The settings `var` gives a value that their row does not list (a typo such as
/// `GLMCHECK_COPY16=of` would otherwise be the default without a word: a measurement of nothing):
/// `(name, value, the values it takes)`, in [`TABLE`]'s order.
pub fn unrecognised(
    var: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String, Vec<&'static str>)> {
    TABLE
        .iter()
        .filter_map(|&(name, doc)| {
            let (value, takes) = (var(name)?, documented_values(doc)?);
            (!takes.contains(&value.as_str())).then_some((name, value, takes))
        })
        .collect()
}

/// The settings `var` gives a value their row takes, `(name, value)` in [`TABLE`]'s order: what a
/// run's output records as the kernels it ran with (an unrecognised value is the default and is
/// warned about instead, [`unrecognised`]).
pub fn in_effect(var: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, String)> {
    TABLE
        .iter()
        .filter_map(|&(name, doc)| {
            let value = var(name)?;
            documented_values(doc)
                .is_none_or(|takes| takes.contains(&value.as_str()))
                .then_some((name, value))
        })
        .collect()
}

/// `name` in this process's environment; set to nothing is unset (`VAR= cmd` in scripts).
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// This process's settings (the environment, read on first use).
pub fn knobs() -> &'static Knobs {
    static K: OnceLock<Knobs> = OnceLock::new();
    K.get_or_init(|| Knobs::from_vars(env_var))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_is_every_default_and_each_value_reads_as_documented() {
        assert_eq!(Knobs::from_vars(|_| None), Knobs::default());
        let set = |pairs: &'static [(&'static str, &'static str)]| {
            Knobs::from_vars(move |n| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            })
        };
        let k = set(&[
            ("GLMCHECK_COPY16", "off"),
            ("GLMCHECK_INDEXER", "always"),
            ("GLMCHECK_DEQUANT_TILE", "16"),
            ("GLMCHECK_Q8_TILE", "12"),
            ("GLMCHECK_Q8_DENSE_TILE", "64"),
            ("GLMCHECK_DEQUANT_EXPERTS", "smem"),
        ]);
        assert!(k.copy16_off && k.indexer_always && k.experts_are("smem"));
        assert_eq!(
            (k.dequant_tile, k.q8_tile, k.q8_dense_tile),
            (Some(16), None, Some(64))
        );
        let k = set(&[
            ("GLMCHECK_FUSED", "no-norm"),
            ("GLMCHECK_DENSE", "tiled"),
            ("GLMCHECK_Q8_DENSE", "narrow"),
            ("GLMCHECK_Q8_EXPERTS", "mmq"),
            ("GLMCHECK_Q8_INPUT", "f32"),
            ("GLMCHECK_EVENT_TRACKING", "on"),
        ]);
        assert_eq!(
            (
                k.fused.as_deref(),
                k.dense.as_deref(),
                k.q8_dense.as_deref()
            ),
            (Some("no-norm"), Some("tiled"), Some("narrow"))
        );
        assert!(k.q8_experts_mmq && k.q8_input_f32 && k.event_tracking);
        // any other value is the default
        let k = set(&[
            ("GLMCHECK_COPY16", "on"),
            ("GLMCHECK_INDEXER", "yes"),
            ("GLMCHECK_Q8_EXPERTS", "int8"),
            ("GLMCHECK_Q8_INPUT", "bf16"),
            ("GLMCHECK_EVENT_TRACKING", "1"),
            ("GLMCHECK_DEQUANT_TILE", "64"),
        ]);
        assert!(!k.copy16_off && !k.indexer_always && !k.q8_experts_mmq && !k.q8_input_f32);
        assert!(!k.event_tracking && k.dequant_tile.is_none());
    }

    /// The settings in effect are those set to a value their row takes, in the table's order.
    #[test]
    fn the_settings_in_effect_are_the_recognised_ones() {
        let env = |n: &str| match n {
            "GLMCHECK_ROUTING" => Some("ahead".to_string()),
            "GLMCHECK_DENSE" => Some("wgmma".to_string()),
            "GLMCHECK_COPY16" => Some("of".to_string()),
            "GLMCHECK_PEAK_RSS" => Some("1".to_string()),
            _ => None,
        };
        assert_eq!(
            in_effect(env),
            vec![
                ("GLMCHECK_DENSE", "wgmma".to_string()),
                ("GLMCHECK_ROUTING", "ahead".to_string()),
                ("GLMCHECK_PEAK_RSS", "1".to_string()),
            ]
        );
        assert!(in_effect(|_| None).is_empty());
    }

    /// Every value a row documents changes what `from_vars` reads (alone in the environment), and
    /// is not flagged; a value no row documents reads as the default and is flagged.
    #[test]
    fn the_documented_values_are_the_values_read_and_others_are_flagged() {
        for &(name, doc) in TABLE {
            let Some(values) = documented_values(doc) else {
                assert_eq!(
                    name, "GLMCHECK_PEAK_RSS",
                    "only main's setting takes any value"
                );
                continue;
            };
            for v in values.iter().copied().chain(["zzz"]) {
                let var = |n: &str| (n == name).then(|| v.to_string());
                let read = Knobs::from_vars(var);
                let flagged = !unrecognised(var).is_empty();
                if v == "zzz" {
                    assert_eq!(read, Knobs::default(), "{name}={v} reads as the default");
                    assert!(flagged, "{name}={v} is flagged");
                } else {
                    assert_ne!(read, Knobs::default(), "{name}={v} is read");
                    assert!(!flagged, "{name}={v} is not flagged");
                }
            }
        }
        let found = unrecognised(|n| (n == "GLMCHECK_COPY16").then(|| "of".to_string()));
        assert_eq!(
            found,
            vec![("GLMCHECK_COPY16", "of".to_string(), vec!["off"])]
        );
        assert!(unrecognised(|n| (n == "GLMCHECK_PEAK_RSS").then(|| "0".into())).is_empty());
        // a number spelled otherwise than its row is flagged, so it must not be read either
        let var = |n: &str| (n == "GLMCHECK_Q8_TILE").then(|| "08".to_string());
        assert!(Knobs::from_vars(var).q8_tile.is_none() && !unrecognised(var).is_empty());
    }

    /// Every `GLMCHECK_` name spelled in src/ is in [`TABLE`], and read nowhere but here (and
    /// main's `GLMCHECK_PEAK_RSS`); the README's table lists exactly [`TABLE`]'s names.
    #[test]
    fn every_setting_is_in_the_table_the_readme_and_read_only_here() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let names: Vec<&str> = TABLE.iter().map(|(n, _)| *n).collect();
        let mut stack = vec![root.join("src")];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).expect("src/ readable") {
                let p = e.expect("entry").path();
                if p.is_dir() {
                    stack.push(p);
                    continue;
                }
                if p.extension().is_none_or(|x| x != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&p).expect("source readable");
                let file = p.strip_prefix(root).unwrap_or(&p).display().to_string();
                for (i, _) in text.match_indices("GLMCHECK_") {
                    let name: String = text[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    assert!(
                        name == "GLMCHECK_" || names.contains(&name.as_str()),
                        "{file}: {name} is not in knobs::TABLE"
                    );
                }
                let reads = text.contains("env::var(\"GLMCHECK_")
                    || text.contains("env::var_os(\"GLMCHECK_");
                let allowed = file.ends_with("knobs.rs") || file.ends_with("main.rs");
                assert!(
                    !reads || allowed,
                    "{file} reads a GLMCHECK_ variable itself"
                );
            }
        }
        // every name but main's is read by `from_vars` (a name nothing reads does not stay listed)
        let here = std::fs::read_to_string(root.join("src/model/knobs.rs")).expect("readable");
        let body = &here[here.find("pub fn from_vars").expect("from_vars")..];
        let body = &body[..body.find("\n    }\n").expect("its end")];
        for n in names.iter().filter(|n| **n != "GLMCHECK_PEAK_RSS") {
            assert!(
                body.contains(&format!("\"{n}\"")),
                "{n} is listed but from_vars never reads it"
            );
        }
        let readme = std::fs::read_to_string(root.join("README.md")).expect("README readable");
        let mut got: Vec<String> = readme
            .lines()
            .filter(|l| l.starts_with("| `GLMCHECK_"))
            .map(str::to_string)
            .collect();
        let mut want: Vec<String> = TABLE
            .iter()
            .map(|(n, d)| format!("| `{n}` | {d} |"))
            .collect();
        want.sort();
        got.sort();
        assert_eq!(
            got, want,
            "README's table of GLMCHECK_ settings against knobs::TABLE (names and text)"
        );
    }
}
