//! What a command refuses before (or instead of) running a stage: bad arguments and inputs that do
//! not fit together. Each is exit 2 (as every error is).

use std::path::PathBuf;

/// A command's own refusal; the stages' errors pass through `anyhow` beside these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdError {
    #[error(
        "--fault {0}: a weight fault; write it into rank files with `glmcheck inject --fault {0} \
         --tp N --out DIR` and run `glmcheck forward --tp N --weights-from DIR`"
    )]
    WeightFaultInForward(String),
    #[error("nothing to check: give --reference, --candidate, --against or --weights-from")]
    NothingToGate,
    #[error("{}: {why}", .file.display())]
    GateConfig { file: PathBuf, why: String },
    #[error("{}: {why}", .file.display())]
    Patches { file: PathBuf, why: String },
    #[error("--device {0}: this glmcheck was built without CUDA (build it with --features cuda: tools/build-cuda.sh)")]
    NoCuda(String),
    #[error("--device {0}: {1}")]
    Device(String, String),
    #[error("{} holds no tensors (a vocab-only GGUF?): nothing to dequantize", .file.display())]
    NoTensors { file: PathBuf },
    #[error("no tensor of {} matches --tensor {}", .file.display(), .globs.join(" --tensor "))]
    NoTensorMatches { file: PathBuf, globs: Vec<String> },
    #[error("no parameter matches the --layer/--tensor filters")]
    NoParamMatches,
    #[error("{param} cannot be sharded at tp={tp}: {}", .problems.join("; "))]
    Unshardable {
        param: String,
        tp: usize,
        problems: Vec<String>,
    },
    #[error("{} holds rank files up to rank {}, but --tp is {tp}", .dir.display(), .ranks.saturating_sub(1))]
    RankCount {
        dir: PathBuf,
        /// How many rank files the directory holds (the highest rank + 1).
        ranks: usize,
        tp: usize,
    },
    #[error("{} exists (--force replaces it)", .0.display())]
    OutputExists(PathBuf),
    #[error("give --prompt TEXT or --tokens IDS")]
    NoPrompt,
    #[error("the prompt gives no tokens")]
    EmptyPrompt,
    #[error("--tokens: `{0}` is not a token id")]
    BadTokenId(String),
    #[error("--tokens: no token ids given")]
    NoTokenIds,
    #[error(
        "{} was made from tokens {reference:?}, this run has {run:?}: pass --tokens {} to compare",
        .file.display(),
        .reference.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
    )]
    OtherTokens {
        file: PathBuf,
        reference: Vec<u32>,
        run: Vec<u32>,
    },
    #[error("--weights: unknown GGML type `{0}`")]
    UnknownWeightType(String),
    #[error("--report {}: refusing to overwrite an input of this command", .0.display())]
    ReportOverInput(PathBuf),
    #[error("--report {}: refusing to overwrite an existing GGUF or safetensors file", .0.display())]
    ReportOverModelData(PathBuf),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_as_the_commands_always_printed_them() {
        let e = CmdError::OtherTokens {
            file: "/r.safetensors".into(),
            reference: vec![1, 2],
            run: vec![3],
        };
        assert_eq!(
            e.to_string(),
            "/r.safetensors was made from tokens [1, 2], this run has [3]: pass --tokens 1,2 to compare"
        );
        let e = CmdError::RankCount {
            dir: "/d".into(),
            ranks: 4,
            tp: 8,
        };
        assert_eq!(
            e.to_string(),
            "/d holds rank files up to rank 3, but --tp is 8"
        );
        let e = CmdError::NoTensorMatches {
            file: "m.gguf".into(),
            globs: vec!["a*".into(), "b".into()],
        };
        assert_eq!(
            e.to_string(),
            "no tensor of m.gguf matches --tensor a* --tensor b"
        );
        let e = CmdError::Unshardable {
            param: "p".into(),
            tp: 3,
            problems: vec!["x".into(), "y".into()],
        };
        assert_eq!(e.to_string(), "p cannot be sharded at tp=3: x; y");
    }
}
