//! The tokenizer a GGUF carries in its own metadata (`tokenizer.ggml.*`), rebuilt with the HF
//! `tokenizers` crate so that `--prompt` gives the ids the HF tokenizer (and llama.cpp) give.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported, with the pre-tokenizer
//! llama.cpp chooses for the file's `tokenizer.ggml.pre` label (`llama-vocab.cpp`):
//!
//! | `pre` label | llama.cpp type | pre-tokenizer built here |
//! |---|---|---|
//! | `glm4`, `chatglm-bpe` | `CHATGLM4` | Split(isolated) on [`REGEX_CHATGLM4`], then ByteLevel(add_prefix_space=false, use_regex=false) |
//! | `llama3`, `llama-bpe`, `smaug-bpe`, `dbrx` | `LLAMA3` / `SMAUG` / `DBRX` | the same regex (llama.cpp uses it for all four) and ByteLevel |
//! | `gpt2`, `default` | `GPT2` | ByteLevel with its built-in GPT-2 regex |
//!
//! Any other label is an error naming it: a pre-tokenizer guessed wrong gives plausible but wrong
//! ids (digits grouped differently, spaces attached to the wrong side), which would then be blamed
//! on the model. The decoder is always gpt2-style ByteLevel. No normalizer, no post-processor: ids
//! come out exactly for the text given (no `[gMASK]<sop>` prefix, as the fixtures' HF runs with
//! `add_special_tokens=False`); control and user-defined tokens (token types 3 and 4) are added as
//! special tokens, so `[gMASK]` typed in a prompt becomes its id, as in HF and llama.cpp.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::models::ModelWrapper;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{
    AddedToken, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior, TokenizerImpl,
};

use crate::gguf::{GgufModel, Value};

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_CHATGLM4` regex (also its LLAMA3 one). HF's GLM tokenizer.json
/// spells the contractions `(?i:'s|'t|'re|'ve|'m|'ll|'d)`; llama.cpp writes them out per case.
pub const REGEX_CHATGLM4: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";

/// llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
pub mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("the GGUF has no tokenizer: metadata `{0}` is missing (pass --tokens instead)")]
    Missing(&'static str),
    #[error("metadata `{key}` must be {want}, found {found}")]
    WrongType {
        key: &'static str,
        want: &'static str,
        found: String,
    },
    #[error("tokenizer model `{0}` is not supported (only gpt2-style byte-level BPE is); pass --tokens instead")]
    UnknownModel(String),
    #[error(
        "pre-tokenizer `{0}` (tokenizer.ggml.pre) is not known to glmcheck (known: {known}); \
         guessing would give plausible but wrong ids, so pass --tokens instead",
        known = KNOWN_PRE.join(", ")
    )]
    UnknownPre(String),
    #[error("tokenizer.ggml.merges[{index}] = {entry:?} is not two tokens separated by a space")]
    BadMerge { index: usize, entry: String },
    #[error(
        "tokenizer.ggml.tokens has {tokens} entries but tokenizer.ggml.token_type has {types}"
    )]
    TypeCount { tokens: usize, types: usize },
    #[error("building the tokenizer: {0}")]
    Build(String),
    #[error("tokenizing: {0}")]
    Encode(String),
    #[error("decoding: {0}")]
    Decode(String),
}

/// The `pre` labels this module maps (see the module docs).
pub const KNOWN_PRE: &[&str] = &[
    "glm4",
    "chatglm-bpe",
    "llama3",
    "llama-bpe",
    "smaug-bpe",
    "dbrx",
    "gpt2",
    "default",
];

/// A GGUF's tokenizer.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    inner: InnerTokenizer,
    /// `tokenizer.ggml.pre` (`default` when absent, as llama.cpp assumes).
    pub pre: String,
    /// Number of entries in `tokenizer.ggml.tokens`.
    pub vocab: usize,
    /// The special ids the file names (`eos`, `bos`, `eot`, `eom`, `padding`, `unknown`, …).
    pub special_ids: BTreeMap<String, u32>,
    tokens: Vec<String>,
}

fn string_array(model: &GgufModel, key: &'static str) -> Result<Vec<String>, TokenizerError> {
    let v = model.value(key).ok_or(TokenizerError::Missing(key))?;
    let items = v.as_array().ok_or_else(|| TokenizerError::WrongType {
        key,
        want: "an array of strings",
        found: v.type_name(),
    })?;
    items
        .iter()
        .map(|i| {
            i.as_str()
                .map(str::to_string)
                .ok_or_else(|| TokenizerError::WrongType {
                    key,
                    want: "an array of strings",
                    found: v.type_name(),
                })
        })
        .collect()
}

/// A pre-tokenizer shared by every tokenizer of the process that uses it. Compiling
/// [`REGEX_CHATGLM4`] (fancy-regex, Unicode classes) costs milliseconds, and `tokenizers`'
/// `Split::clone` compiles it again, so it is compiled once and shared behind an `Arc`.
#[derive(Debug, Clone)]
pub struct SharedPreTokenizer(Arc<PreTokenizerWrapper>);

impl PreTokenizer for SharedPreTokenizer {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        self.0.pre_tokenize(pretokenized)
    }
}

/// The `tokenizers` tokenizer with the shared pre-tokenizer.
pub type InnerTokenizer = TokenizerImpl<
    ModelWrapper,
    NormalizerWrapper,
    SharedPreTokenizer,
    PostProcessorWrapper,
    DecoderWrapper,
>;

fn chatglm4_pre_tokenizer() -> Result<PreTokenizerWrapper, String> {
    let split = Split::new(
        SplitPattern::Regex(REGEX_CHATGLM4.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| e.to_string())?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into())
}

fn pre_tokenizer(pre: &str) -> Result<SharedPreTokenizer, TokenizerError> {
    static CHATGLM4: OnceLock<Result<SharedPreTokenizer, String>> = OnceLock::new();
    match pre {
        "glm4" | "chatglm-bpe" | "llama3" | "llama-bpe" | "smaug-bpe" | "dbrx" => CHATGLM4
            .get_or_init(|| chatglm4_pre_tokenizer().map(|p| SharedPreTokenizer(Arc::new(p))))
            .clone()
            .map_err(TokenizerError::Build),
        "gpt2" | "default" => Ok(SharedPreTokenizer(Arc::new(
            ByteLevel::new(false, true, true).into(),
        ))),
        other => Err(TokenizerError::UnknownPre(other.to_string())),
    }
}

impl GgufTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(model: &GgufModel) -> Result<Self, TokenizerError> {
        let kind = model
            .value(KEY_MODEL)
            .ok_or(TokenizerError::Missing(KEY_MODEL))?;
        let kind = kind.as_str().ok_or_else(|| TokenizerError::WrongType {
            key: KEY_MODEL,
            want: "a string",
            found: kind.type_name(),
        })?;
        if kind != "gpt2" {
            return Err(TokenizerError::UnknownModel(kind.to_string()));
        }
        let pre = match model.value(KEY_PRE) {
            None => "default".to_string(),
            Some(v) => v
                .as_str()
                .ok_or_else(|| TokenizerError::WrongType {
                    key: KEY_PRE,
                    want: "a string",
                    found: v.type_name(),
                })?
                .to_string(),
        };
        let pre_tok = pre_tokenizer(&pre)?;

        let tokens = string_array(model, KEY_TOKENS)?;
        let merges = string_array(model, KEY_MERGES)?
            .into_iter()
            .enumerate()
            .map(|(index, m)| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    Ok((a.to_string(), b.to_string()))
                }
                _ => Err(TokenizerError::BadMerge { index, entry: m }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let types: Vec<i64> = match model.value(KEY_TYPES) {
            None => vec![token_type::NORMAL; tokens.len()],
            Some(v) => {
                let wrong = || TokenizerError::WrongType {
                    key: KEY_TYPES,
                    want: "an array of integers",
                    found: v.type_name(),
                };
                v.as_array()
                    .ok_or_else(wrong)?
                    .iter()
                    .map(|t| match t {
                        Value::I32(x) => Some(*x as i64),
                        Value::I64(x) => Some(*x),
                        other => other.as_u64().and_then(|x| i64::try_from(x).ok()),
                    })
                    .collect::<Option<Vec<i64>>>()
                    .ok_or_else(wrong)?
            }
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::TypeCount {
                tokens: tokens.len(),
                types: types.len(),
            });
        }

        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = InnerTokenizer::new(bpe.into());
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::new(true, true, true)));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == token_type::CONTROL || t == token_type::USER_DEFINED)
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;

        let mut special_ids = BTreeMap::new();
        for meta in model.metadata() {
            let Some(name) = meta
                .key
                .strip_prefix("tokenizer.ggml.")
                .and_then(|k| k.strip_suffix("_token_id"))
            else {
                continue;
            };
            if let Some(id) = meta.value.as_u64().and_then(|v| u32::try_from(v).ok()) {
                special_ids.insert(name.to_string(), id);
            }
        }
        Ok(GgufTokenizer {
            inner,
            pre,
            vocab: tokens.len(),
            special_ids,
            tokens,
        })
    }

    /// Token ids of `text`, nothing added (no BOS, no `[gMASK]<sop>`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included as their text.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The text of one token, decoded (`" the"`, `"<|user|>"`); the raw vocab entry when it is not
    /// valid UTF-8 on its own (a partial multi-byte character).
    pub fn token_text(&self, id: u32) -> Option<String> {
        let raw = self.tokens.get(id as usize)?;
        match self.inner.decode(&[id], false) {
            Ok(s) if !s.contains('\u{FFFD}') => Some(s),
            _ => Some(raw.clone()),
        }
    }

    /// Ids that end a generation (eos, eot, eom), as llama.cpp's end-of-generation set.
    pub fn end_ids(&self) -> Vec<u32> {
        ["eos", "eot", "eom"]
            .iter()
            .filter_map(|k| self.special_ids.get(*k).copied())
            .collect()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &InnerTokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_pre_is_named() {
        let e = pre_tokenizer("qwen35").unwrap_err();
        assert!(e.to_string().contains("`qwen35`"), "{e}");
        for p in KNOWN_PRE {
            assert!(pre_tokenizer(p).is_ok(), "{p}");
        }
    }
}
