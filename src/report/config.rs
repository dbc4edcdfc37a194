//! The words of the GGUF config's sources: how a derived value was derived (also its JSON string).

use std::fmt;

use serde::{Serialize, Serializer};

use crate::arch::config::Derivation;

impl fmt::Display for Derivation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Derivation::BlockCount { key, mtp_blocks } => {
                match key {
                    Some(k) => write!(f, "`{k}`")?,
                    None => f.write_str("1 + the highest blk.N in the file")?,
                }
                write!(
                    f,
                    " − {mtp_blocks} MTP block(s) (trailing blocks with nextn.* tensors)"
                )
            }
            Derivation::MtpBlocks {
                count,
                key,
                says: Some(k),
            } => write!(
                f,
                "the trailing blocks with nextn.* tensors ({count}); `{key}` says {k}"
            ),
            Derivation::MtpBlocks {
                key, says: None, ..
            } => write!(
                f,
                "the trailing blocks with nextn.* tensors (no `{key}` in the file)"
            ),
            Derivation::AttentionHeads => {
                f.write_str("= num_attention_heads (MLA; the GGUF's head_count_kv 1 is the latent)")
            }
            Derivation::KeyLengthLessRope { key } => write!(f, "{key} − rope.dimension_count"),
            Derivation::TokenCount => f.write_str("len(tokenizer.ggml.tokens)"),
            Derivation::EmbeddingRows => f.write_str("the embedding's ne[1]"),
            Derivation::LmHead { present: true } => {
                f.write_str("lm_head tensor (output.weight) present")
            }
            Derivation::LmHead { present: false } => {
                f.write_str("no lm_head tensor (output.weight) in the file")
            }
        }
    }
}

/// In the JSON a derivation is its sentence.
impl Serialize for Derivation {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::Source;

    #[test]
    fn derivations_in_words_and_json() {
        let d = Derivation::BlockCount {
            key: Some("glm-dsa.block_count".into()),
            mtp_blocks: 1,
        };
        assert_eq!(
            serde_json::to_string(&Source::Derived(d)).expect("serializes"),
            r#"{"derived":"`glm-dsa.block_count` − 1 MTP block(s) (trailing blocks with nextn.* tensors)"}"#
        );
        let d = Derivation::MtpBlocks {
            count: 1,
            key: "glm-dsa.nextn_predict_layers".into(),
            says: Some(2),
        };
        assert_eq!(
            d.to_string(),
            "the trailing blocks with nextn.* tensors (1); `glm-dsa.nextn_predict_layers` says 2"
        );
        assert_eq!(
            Derivation::BlockCount {
                key: None,
                mtp_blocks: 0
            }
            .to_string(),
            "1 + the highest blk.N in the file − 0 MTP block(s) (trailing blocks with nextn.* tensors)"
        );
    }
}
