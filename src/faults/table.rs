//! The one table of known faults: each one's name, parameter syntax, one-line description and the
//! smallest tp at which it changes anything. Parsing (`FromStr`), printing (`Display`),
//! [`Fault::cause`], [`Fault::check_tp`] and the list in `inject --help` all read it.
//!
//! How to add a fault: a variant of [`Fault`], one entry in [`FAULTS`], then what the compiler asks
//! for: its default targets ([`Fault::targets`]) and what a rank holds under it ([`Fault::inject`]);
//! if a dump can show it, a signature in [`super::explain`].

use std::str::FromStr;

use super::{Behaviour, Fault};
use crate::arch::glm_dsa::{Role, TpStyle};

/// The parameter a fault takes after its name, and how the fault is built from it.
pub enum Make {
    /// No parameter: the fault itself.
    Plain(Fault),
    /// `NAME:A,B`: two different rank numbers.
    Ranks(fn(usize, usize) -> Fault),
    /// `NAME:GLOB`: a non-empty parameter-name glob.
    Glob(fn(String) -> Fault),
}

impl Make {
    /// The parameter syntax after the name (`""`, `":A,B"`, `":GLOB"`).
    pub fn syntax(&self) -> &'static str {
        match self {
            Make::Plain(_) => "",
            Make::Ranks(_) => ":A,B",
            Make::Glob(_) => ":GLOB",
        }
    }

    /// A fault of this kind (any parameters), to tell kinds apart.
    fn sample(&self) -> Fault {
        match self {
            Make::Plain(f) => f.clone(),
            Make::Ranks(f) => f(0, 1),
            Make::Glob(f) => f(String::new()),
        }
    }
}

/// Which parameters a fault hits by default (`inject --param` narrows or widens it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hits {
    Nothing,
    /// The parameters of this role.
    Role(Role),
    /// The parameters cut in one of these TP styles.
    Styles(&'static [TpStyle]),
    /// The parameters matching the fault's own glob.
    Glob,
    All,
    /// No parameter: the forward itself (a [`Behaviour`] fault).
    Forward,
}

/// One known loader bug: its name, parameter syntax, what it does, what it hits and the smallest tp
/// at which it changes anything.
pub struct FaultSpec {
    pub name: &'static str,
    pub make: Make,
    pub about: &'static str,
    pub hits: Hits,
    pub min_tp: usize,
}

impl FaultSpec {
    /// How the fault is written on the command line (`rank-swap:A,B`).
    pub fn syntax(&self) -> String {
        format!("{}{}", self.name, self.make.syntax())
    }
}

/// The merged column-parallel styles ([gate; up] and the experts' w13).
const MERGED: &[TpStyle] = &[TpStyle::MergedColumn, TpStyle::MoeW13];

/// Every known fault, in the order `--help` lists them. Parsing, `--help`, [`Fault::cause`] and
/// [`Fault::check_tp`] read this table; nothing else spells a fault's name.
pub static FAULTS: [FaultSpec; 21] = [
    FaultSpec {
        name: "none",
        make: Make::Plain(Fault::None),
        about: "the correct dump",
        hits: Hits::Nothing,
        min_tp: 1,
    },
    FaultSpec {
        name: "kvb-concat",
        make: Make::Plain(Fault::KvbConcat),
        about: "kv_b_proj rebuilt as all heads' k_nope rows, then all heads' v rows",
        hits: Hits::Role(Role::AttnKvB),
        min_tp: 1,
    },
    FaultSpec {
        name: "kvb-untransposed",
        make: Make::Plain(Fault::KvbUntransposed),
        about: "kv_b_proj built from attn_k_b reshaped instead of transposed back",
        hits: Hits::Role(Role::AttnKvB),
        min_tp: 1,
    },
    FaultSpec {
        name: "rank-swap",
        make: Make::Ranks(Fault::RankSwap),
        about: "ranks A and B hold each other's shards",
        hits: Hits::Role(Role::AttnOut),
        min_tp: 2,
    },
    FaultSpec {
        name: "merged-rank0",
        make: Make::Plain(Fault::MergedRank0),
        about: "every rank holds shard 0 of merged layers (tp rank ignored while loading)",
        hits: Hits::Styles(MERGED),
        min_tp: 2,
    },
    FaultSpec {
        name: "merged-midsplit",
        make: Make::Plain(Fault::MergedMidsplit),
        about: "a merged gate/up cut at the midpoint of the concatenation",
        hits: Hits::Styles(MERGED),
        min_tp: 2,
    },
    FaultSpec {
        name: "param-zeroed",
        make: Make::Glob(Fault::ParamZeroed),
        about: "parameters matching GLOB left at zero (never loaded)",
        hits: Hits::Glob,
        min_tp: 1,
    },
    FaultSpec {
        name: "wrong-dim",
        make: Make::Plain(Fault::WrongDim),
        about: "shards cut along the wrong dimension",
        hits: Hits::Role(Role::AttnOut),
        min_tp: 2,
    },
    FaultSpec {
        name: "vocab-unpadded",
        make: Make::Plain(Fault::VocabUnpadded),
        about: "vocab shards sized unpadded/tp (no padding to ×64)",
        hits: Hits::Styles(&[TpStyle::Vocab]),
        min_tp: 1,
    },
    FaultSpec {
        name: "bf16-as-f16",
        make: Make::Plain(Fault::Bf16AsF16),
        about: "bf16 bits stored (and read) as fp16",
        hits: Hits::All,
        min_tp: 1,
    },
    FaultSpec {
        name: "force-dequant",
        make: Make::Glob(Fault::ForceDequant),
        about: "parameters matching GLOB dequantized to bf16 before sharding (rounded, not wrong)",
        hits: Hits::Glob,
        min_tp: 1,
    },
    FaultSpec {
        name: "dsa-dense",
        make: Make::Plain(Fault::Behaviour(Behaviour::DsaDense)),
        about: "the DSA indexer off: every query attends to all earlier keys",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "indexer-rope-neox",
        make: Make::Plain(Fault::Behaviour(Behaviour::IndexerRopeNeox)),
        about: "the indexer's RoPE rotated half-split instead of interleaved",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "mla-rope-neox",
        make: Make::Plain(Fault::Behaviour(Behaviour::MlaRopeNeox)),
        about: "MLA's RoPE rotated half-split instead of interleaved",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "router-softmax",
        make: Make::Plain(Fault::Behaviour(Behaviour::RouterSoftmax)),
        about: "softmax expert gating instead of sigmoid (expert_gating_func missing)",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "router-no-bias",
        make: Make::Plain(Fault::Behaviour(Behaviour::RouterNoBias)),
        about: "e_score_correction_bias not added to the choice scores",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "bias-bf16",
        make: Make::Plain(Fault::Behaviour(Behaviour::BiasBf16)),
        about: "e_score_correction_bias rounded to bf16",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "mla-scale-latent",
        make: Make::Plain(Fault::Behaviour(Behaviour::MlaScaleLatent)),
        about: "attention softmax scale (kv_lora_rank + rope dim)^-1/2 instead of qk_head_dim^-1/2",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "no-norm-topk",
        make: Make::Plain(Fault::Behaviour(Behaviour::NoNormTopk)),
        about: "the chosen experts' weights not renormalized",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "routed-scale-missing",
        make: Make::Plain(Fault::Behaviour(Behaviour::RoutedScaleMissing)),
        about: "routed_scaling_factor not applied",
        hits: Hits::Forward,
        min_tp: 1,
    },
    FaultSpec {
        name: "fp16-compute",
        make: Make::Plain(Fault::Behaviour(Behaviour::Fp16Compute)),
        about:
            "the forward computed in fp16: activations beyond 65504 overflow where bf16 would not",
        hits: Hits::Forward,
        min_tp: 1,
    },
];

/// A fault limited to some layers: `NAME[@LAYERS]` (`router-softmax@1`, `dsa-dense@0,2-3`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injection {
    pub fault: Fault,
    /// None: every layer the fault can change.
    pub layers: Option<Vec<usize>>,
}

impl FromStr for Injection {
    type Err = FaultError;
    fn from_str(s: &str) -> Result<Self, FaultError> {
        let (name, layers) = match s.split_once('@') {
            Some((n, l)) => (n, Some(parse_layers(s, l)?)),
            None => (s, None),
        };
        Ok(Injection {
            fault: name.parse()?,
            layers,
        })
    }
}

impl std::fmt::Display for Injection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.fault)?;
        if let Some(ls) = &self.layers {
            let ls: Vec<String> = ls.iter().map(usize::to_string).collect();
            write!(f, "@{}", ls.join(","))?;
        }
        Ok(())
    }
}

/// `0,2-3` → [0, 2, 3] (sorted, without repeats).
fn parse_layers(given: &str, s: &str) -> Result<Vec<usize>, FaultError> {
    let bad = |part: &str| FaultError::NotALayer {
        given: given.to_string(),
        part: part.to_string(),
    };
    let num = |x: &str| x.trim().parse::<usize>().map_err(|_| bad(x));
    let mut out = std::collections::BTreeSet::new();
    for part in s.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b || b - a > 4096 {
                    return Err(bad(part));
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(num(part)?);
            }
        }
    }
    Ok(out.into_iter().collect())
}

/// Why a fault could not be parsed or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    #[error("unknown fault `{given}`; known: {known}")]
    Unknown { given: String, known: String },
    #[error("`{given}`: expected {syntax}")]
    Syntax { given: String, syntax: String },
    #[error("`{given}`: `{part}` is not a rank number")]
    NotARank { given: String, part: String },
    #[error("`{given}`: `{part}` is not a layer number or range (e.g. `@1` or `@0,2-3`)")]
    NotALayer { given: String, part: String },
    #[error("`{given}`: the two ranks must differ")]
    SameRanks { given: String },
    #[error("rank-swap:{a},{b} needs tp > {max}")]
    RankBeyondTp { a: usize, b: usize, max: usize },
    #[error("{name} changes nothing at tp=1 (one rank holds the whole tensor)")]
    NeedsTp2 { name: &'static str },
    #[error(
        "{name} changes what the forward computes, not a weight: no dump can hold it \
         (see it with `glmcheck forward --fault {name}`)"
    )]
    NotAWeightFault { name: &'static str },
}

/// Every fault's syntax, comma-separated (`none, kvb-concat, …, rank-swap:A,B, …`).
pub fn fault_list() -> String {
    FAULTS
        .iter()
        .map(FaultSpec::syntax)
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for Fault {
    type Err = FaultError;
    fn from_str(s: &str) -> Result<Self, FaultError> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let unknown = || FaultError::Unknown {
            given: s.to_string(),
            known: fault_list(),
        };
        let spec = FAULTS.iter().find(|f| f.name == name).ok_or_else(unknown)?;
        let syntax = || FaultError::Syntax {
            given: s.to_string(),
            syntax: spec.syntax(),
        };
        match (&spec.make, arg) {
            (Make::Plain(f), None) => Ok(f.clone()),
            (Make::Ranks(make), Some(ab)) => {
                let (a, b) = ab.split_once(',').ok_or_else(syntax)?;
                let rank = |x: &str| {
                    x.trim().parse::<usize>().map_err(|_| FaultError::NotARank {
                        given: s.to_string(),
                        part: x.to_string(),
                    })
                };
                let (a, b) = (rank(a)?, rank(b)?);
                if a == b {
                    return Err(FaultError::SameRanks {
                        given: s.to_string(),
                    });
                }
                Ok(make(a, b))
            }
            (Make::Glob(make), Some(g)) if !g.is_empty() => Ok(make(g.to_string())),
            (Make::Glob(_), Some(_)) => Err(syntax()),
            // A name that needs a parameter given none, or one that takes none given one.
            _ => Err(unknown()),
        }
    }
}

impl std::fmt::Display for Fault {
    /// The fault as written on the command line (parses back to itself).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::RankSwap(a, b) => write!(f, "{}:{a},{b}", self.cause()),
            Fault::ParamZeroed(g) | Fault::ForceDequant(g) => write!(f, "{}:{g}", self.cause()),
            _ => f.write_str(self.cause()),
        }
    }
}

impl Fault {
    /// This fault's entry in [`FAULTS`].
    pub fn spec(&self) -> &'static FaultSpec {
        let kind = std::mem::discriminant(self);
        FAULTS
            .iter()
            .find(|s| match &s.make {
                // Behaviour faults share one variant: told apart by value.
                Make::Plain(f) => f == self,
                m => std::mem::discriminant(&m.sample()) == kind,
            })
            .unwrap_or(&FAULTS[0])
    }

    /// The forward change this fault is, if it is one (not a weight fault).
    pub fn behaviour(&self) -> Option<Behaviour> {
        match self {
            Fault::Behaviour(b) => Some(*b),
            _ => None,
        }
    }

    /// The cause name reported by `--against` (the fault's name without arguments).
    pub fn cause(&self) -> &'static str {
        self.spec().name
    }

    /// Refuses a behaviour fault where a weight fault is needed (a faulted dump).
    pub fn check_weight(&self) -> Result<(), FaultError> {
        match self {
            Fault::Behaviour(_) => Err(FaultError::NotAWeightFault { name: self.cause() }),
            _ => Ok(()),
        }
    }

    /// Refuses a fault that would change nothing (or is impossible) at this tp.
    pub fn check_tp(&self, tp: usize) -> Result<(), FaultError> {
        match self {
            Fault::RankSwap(a, b) if *a >= tp || *b >= tp => Err(FaultError::RankBeyondTp {
                a: *a,
                b: *b,
                max: *a.max(b),
            }),
            _ if tp < self.spec().min_tp => Err(FaultError::NeedsTp2 { name: self.cause() }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command-line spelling of every table entry, parameters filled in.
    fn example(f: &FaultSpec) -> String {
        match f.make {
            Make::Plain(_) => f.name.to_string(),
            Make::Ranks(_) => format!("{}:1,3", f.name),
            Make::Glob(_) => format!("{}:*.mlp.gate.weight", f.name),
        }
    }

    #[test]
    fn every_table_name_parses_and_round_trips() {
        for spec in &FAULTS {
            let s = example(spec);
            let f: Fault = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(f.to_string(), s);
            assert_eq!(f.cause(), spec.name);
            assert!(std::ptr::eq(f.spec(), spec), "{s}");
        }
        assert_eq!(
            "rank-swap:2, 5".parse::<Fault>(),
            Ok(Fault::RankSwap(2, 5)),
            "spaces around a rank are allowed"
        );
        let names: std::collections::BTreeSet<_> = FAULTS.iter().map(|f| f.name).collect();
        assert_eq!(names.len(), FAULTS.len(), "fault names are unique");
    }

    #[test]
    fn injections_name_a_fault_and_its_layers() {
        let i: Injection = "router-softmax@3,1-2,3".parse().expect("parses");
        assert_eq!(i.fault, Fault::Behaviour(Behaviour::RouterSoftmax));
        assert_eq!(i.layers, Some(vec![1, 2, 3]));
        assert_eq!(i.to_string(), "router-softmax@1,2,3");
        let all: Injection = "dsa-dense".parse().expect("parses");
        assert_eq!(all.layers, None);
        for bad in ["dsa-dense@", "dsa-dense@x", "dsa-dense@3-1", "nope@1"] {
            assert!(bad.parse::<Injection>().is_err(), "{bad}");
        }
        assert!(Fault::KvbConcat.check_weight().is_ok());
        assert!(matches!(
            Fault::Behaviour(Behaviour::DsaDense).check_weight(),
            Err(FaultError::NotAWeightFault { name: "dsa-dense" })
        ));
    }

    #[test]
    fn the_list_is_the_tables_syntax_in_order() {
        assert_eq!(
            fault_list(),
            "none, kvb-concat, kvb-untransposed, rank-swap:A,B, merged-rank0, merged-midsplit, \
             param-zeroed:GLOB, wrong-dim, vocab-unpadded, bf16-as-f16, force-dequant:GLOB, dsa-dense, \
             indexer-rope-neox, mla-rope-neox, router-softmax, router-no-bias, bias-bf16, \
             mla-scale-latent, no-norm-topk, routed-scale-missing, fp16-compute"
        );
    }

    #[test]
    fn bad_parameters_are_refused_with_the_syntax() {
        let err = |s: &str| s.parse::<Fault>().unwrap_err().to_string();
        assert_eq!(err("rank-swap:1"), "`rank-swap:1`: expected rank-swap:A,B");
        assert_eq!(
            err("rank-swap:a,2"),
            "`rank-swap:a,2`: `a` is not a rank number"
        );
        assert_eq!(
            err("rank-swap:1,2,3"),
            "`rank-swap:1,2,3`: `2,3` is not a rank number"
        );
        assert_eq!(
            err("rank-swap:2,2"),
            "`rank-swap:2,2`: the two ranks must differ"
        );
        assert_eq!(
            err("param-zeroed:"),
            "`param-zeroed:`: expected param-zeroed:GLOB"
        );
        assert!(err("rank-swap").starts_with("unknown fault `rank-swap`; known: none, "));
        assert!(err("param-zeroed").starts_with("unknown fault"));
        assert!(err("kvb-concat:1").starts_with("unknown fault `kvb-concat:1`"));
        assert_eq!(
            err("nope"),
            format!("unknown fault `nope`; known: {}", fault_list())
        );
    }

    #[test]
    fn faults_that_change_nothing_at_this_tp_are_refused() {
        let check = |s: &str, tp| s.parse::<Fault>().expect("parses").check_tp(tp);
        assert_eq!(
            check("rank-swap:0,3", 2).unwrap_err().to_string(),
            "rank-swap:0,3 needs tp > 3"
        );
        assert_eq!(check("rank-swap:0,3", 4), Ok(()));
        for f in ["merged-rank0", "merged-midsplit", "wrong-dim"] {
            assert_eq!(
                check(f, 1).unwrap_err().to_string(),
                format!("{f} changes nothing at tp=1 (one rank holds the whole tensor)")
            );
            assert_eq!(check(f, 2), Ok(()));
        }
        for f in [
            "none",
            "kvb-concat",
            "kvb-untransposed",
            "vocab-unpadded",
            "bf16-as-f16",
        ] {
            assert_eq!(check(f, 1), Ok(()), "{f}");
        }
    }
}
