//! The diagnosis of one parameter across ranks: each rank's copy against its expected shard
//! ([`Class`]), and for corrupt ones the cause ([`Cause`]), grouped over ranks into findings.

use candle_core::Tensor;

use super::against::{Checked, Class, Finding};
use super::values;
use crate::arch::glm_dsa::TpStyle;
use crate::compare::{diff, dump_dtype_rel_l2, quant_rel_l2_bound};
use crate::dump::{DumpTensor, RankFile};
use crate::faults::{explain, Evidence, Explanation, Fault};
use crate::plan::{per_expert, ParamPlan};
use crate::weights::{WeightError, Weights};

/// Why ranks hold a corrupt copy of a parameter. The words are `report::shards`'.
#[derive(Debug, Clone, PartialEq)]
pub enum Cause {
    /// A known loader bug's signature fits; `detail` is the signature's own reading (from
    /// `faults::explain`). `experts`: (corrupt, of) for an expert stack where not every expert is.
    Fault {
        fault: Fault,
        detail: crate::faults::Sign,
        experts: Option<(usize, usize)>,
    },
    /// Every rank but 0 holds rank 0's shard `shard` (the tp rank was ignored while loading).
    MergedRank0 { shard: usize },
    /// Ranks `a` < `b` hold each other's shards.
    RanksSwapped { a: usize, b: usize },
    /// Rank `rank` holds rank `of`'s shard.
    HoldsShardOf { rank: usize, of: usize },
    /// The rank's tensor has another shape than its shard.
    ShapeMismatch {
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// No known bug's signature fits this reading.
    Unexplained { rel_l2: f64, cosine: f64 },
}

/// One rank's tensor against its expected shard: the class, the diff, and (when corrupt) what
/// explains it.
struct RankVerdict {
    class: Class,
    replicated: bool,
    rel_l2: f64,
    cosine: f64,
    tol_match: f64,
    tol_quant: f64,
    explanation: Option<Explanation>,
}

/// For an expert stack: how many of its experts were corrupt on a rank (the verdict is the first
/// corrupt expert's, or the worst diff when none is).
struct ExpertCount {
    corrupt: usize,
    of: usize,
}

/// Compares `actual` (rank `rank`'s copy) with `p`'s shard of `full`.
fn judge(
    w: &Weights<'_>,
    p: &ParamPlan,
    full: &Tensor,
    rank: usize,
    actual: &DumpTensor,
    quant: f64,
) -> Result<RankVerdict, WeightError> {
    let candle = |err| WeightError::Candle {
        param: p.param.clone(),
        err,
    };
    let tol_match = dump_dtype_rel_l2(actual.dtype);
    let tol_quant = tol_match + quant;
    let mut shard = p.shard(full, rank).map_err(candle)?;
    // VLLM_REPLICATE_EMBED=1: every rank holds the whole (padded or unpadded) vocab table, a valid
    // alternative to the vocab-parallel cut.
    let replicated = p.style == TpStyle::Vocab
        && p.cuts.len() > 1
        && shard.dims() != actual.shape.as_slice()
        && full.dims().len() == 2
        && actual.shape.len() == 2
        && actual.shape[1] == full.dims()[1]
        && (actual.shape[0] == full.dims()[0]
            || actual.shape[0] == crate::plan::padded_vocab(full.dims()[0]));
    if replicated {
        shard = full
            .pad_with_zeros(0, 0, actual.shape[0] - full.dims()[0])
            .map_err(candle)?;
    }
    let (class, rel_l2, cosine) = if shard.dims() == actual.shape.as_slice() {
        let d = diff(&actual.to_f32(), &values(&shard).map_err(candle)?);
        let class = if d.rel_l2 <= tol_match {
            Class::Match
        } else if d.rel_l2 <= tol_quant {
            Class::Quantization
        } else {
            Class::Corrupt
        };
        (class, d.rel_l2, d.cosine)
    } else {
        (Class::Corrupt, f64::NAN, f64::NAN)
    };
    let explanation = (class == Class::Corrupt).then(|| {
        let ev = Evidence {
            p,
            full,
            w,
            tp: p.cuts.len().max(1),
            rank,
            actual,
            tol: tol_quant,
        };
        explain(&ev, w.config)
    });
    Ok(RankVerdict {
        class,
        replicated,
        rel_l2,
        cosine,
        tol_match,
        tol_quant,
        explanation,
    })
}

/// Compares one parameter's present ranks (`quant`: the quantization bound to allow, None: the GGUF
/// type's) and groups the corrupt ones into findings.
pub(super) fn check_present(
    w: &Weights<'_>,
    p: &ParamPlan,
    present: &[(usize, &RankFile)],
    tp: usize,
    quant: Option<f64>,
) -> Result<(Vec<Checked>, Vec<Finding>), WeightError> {
    let verdicts = compare_param(w, p, present, tp, quant)?;
    let mut checked = Vec::new();
    let mut per_rank: Vec<RankReading> = Vec::new();
    for (r, v, experts) in verdicts {
        checked.push(Checked {
            param: p.param.clone(),
            rank: r,
            class: v.class,
            rel_l2: v.rel_l2,
            tol_match: v.tol_match,
            tol_quant: v.tol_quant,
            replicated: v.replicated,
        });
        if let Some(explanation) = v.explanation {
            per_rank.push(RankReading {
                rank: r,
                explanation,
                rel_l2: v.rel_l2,
                cosine: v.cosine,
                experts: experts
                    .filter(|n| n.corrupt < n.of)
                    .map(|n| (n.corrupt, n.of)),
            });
        }
    }
    Ok((checked, group(p, &per_rank, tp)))
}

/// Every present rank's copy of `p` against its expected shard: one verdict per rank (per rank, the
/// first corrupt expert's for an expert stack, with the count of corrupt experts).
fn compare_param(
    w: &Weights<'_>,
    p: &ParamPlan,
    present: &[(usize, &RankFile)],
    tp: usize,
    quant: Option<f64>,
) -> Result<Vec<(usize, RankVerdict, Option<ExpertCount>)>, WeightError> {
    let quant = quant.unwrap_or_else(|| {
        p.dtypes
            .iter()
            .map(|t| quant_rel_l2_bound(*t))
            .fold(0.0, f64::max)
    });
    let mut verdicts: Vec<(usize, RankVerdict, Option<ExpertCount>)> = Vec::new();
    let n_experts = w.config.n_routed_experts;
    let experts = per_expert(p).filter(|_| {
        present
            .iter()
            .all(|(_, f)| f.shape(&p.param).and_then(|s| s.first().copied()) == Some(n_experts))
    });
    match (experts, p.idx.layer) {
        (Some(q), Some(layer)) => {
            let mut worst: Vec<Option<RankVerdict>> = (0..tp).map(|_| None).collect();
            let mut bad = vec![0usize; tp];
            for e in 0..n_experts {
                let full = expert_slice(w, p, layer, e)?;
                for (r, f) in present {
                    let Some(actual) = f.get_outer(&p.param, e) else {
                        continue;
                    };
                    let v = judge(w, &q, &full, *r, &actual, quant)?;
                    if v.class == Class::Corrupt {
                        bad[*r] += 1;
                    }
                    let keep = match &worst[*r] {
                        None => true,
                        // The first corrupt expert explains the rank; until then the worst diff.
                        Some(old) => {
                            old.class != Class::Corrupt
                                && (v.class == Class::Corrupt || v.rel_l2 > old.rel_l2)
                        }
                    };
                    if keep {
                        worst[*r] = Some(v);
                    }
                }
            }
            for (r, v) in worst.into_iter().enumerate() {
                if let Some(v) = v {
                    verdicts.push((
                        r,
                        v,
                        Some(ExpertCount {
                            corrupt: bad[r],
                            of: n_experts,
                        }),
                    ));
                }
            }
        }
        _ => {
            let full = w.vllm(&p.param)?;
            for (r, f) in present {
                let Some(actual) = f.get(&p.param) else {
                    continue;
                };
                verdicts.push((*r, judge(w, p, &full, *r, &actual, quant)?, None));
            }
        }
    }
    Ok(verdicts)
}

/// One expert's slice of a stacked vLLM expert parameter: its HF parts concatenated ([2I, H] for
/// w13, [H, I] for w2).
fn expert_slice(
    w: &Weights<'_>,
    p: &ParamPlan,
    layer: usize,
    e: usize,
) -> Result<Tensor, WeightError> {
    let idx = crate::arch::glm_dsa::Idx {
        layer: Some(layer),
        expert: Some(e),
    };
    let parts = p
        .def
        .parts
        .iter()
        .map(|t| w.hf(&crate::arch::glm_dsa::name(t, idx)))
        .collect::<Result<Vec<_>, _>>()?;
    Tensor::cat(&parts, p.def.cat_dim.saturating_sub(1)).map_err(|err| WeightError::Candle {
        param: p.param.clone(),
        err,
    })
}

/// One corrupt rank's reading: what explains it, its diff, and for an expert stack where not every
/// expert is corrupt, (corrupt, of).
#[derive(Debug, Clone)]
struct RankReading {
    rank: usize,
    explanation: Explanation,
    rel_l2: f64,
    cosine: f64,
    experts: Option<(usize, usize)>,
}

/// The cause of each rank's reading: ranks holding another rank's shard become a rank swap (two
/// ranks holding each other's), merged-rank0 (every rank but 0 holds shard 0) or one rank holding
/// another's.
fn causes(per_rank: &[RankReading], tp: usize) -> Vec<Cause> {
    let holders: Vec<(usize, usize)> = per_rank
        .iter()
        .filter_map(|x| match x.explanation {
            Explanation::HoldsShardOf(o) => Some((x.rank, o)),
            _ => None,
        })
        .collect();
    let all_hold_zero =
        tp > 1 && holders.len() == tp - 1 && holders.iter().all(|&(r, o)| r != 0 && o == 0);
    per_rank
        .iter()
        .map(|x| {
            let r = x.rank;
            match &x.explanation {
                Explanation::Fault(fault, detail) => Cause::Fault {
                    fault: fault.clone(),
                    detail: detail.clone(),
                    experts: x.experts,
                },
                Explanation::HoldsShardOf(o) if all_hold_zero => Cause::MergedRank0 { shard: *o },
                Explanation::HoldsShardOf(o) if holders.contains(&(*o, r)) => Cause::RanksSwapped {
                    a: r.min(*o),
                    b: r.max(*o),
                },
                Explanation::HoldsShardOf(o) => Cause::HoldsShardOf { rank: r, of: *o },
                Explanation::ShapeMismatch { expected, found } => Cause::ShapeMismatch {
                    expected: expected.clone(),
                    found: found.clone(),
                },
                Explanation::Unexplained => Cause::Unexplained {
                    rel_l2: x.rel_l2,
                    cosine: x.cosine,
                },
            }
        })
        .collect()
}

/// Turns per-rank readings into findings: ranks whose causes read the same (as the report words
/// them, so two unexplained ranks whose printed readings agree are one finding) are one finding,
/// carrying the worst rank's diff.
fn group(p: &ParamPlan, per_rank: &[RankReading], tp: usize) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    for (x, cause) in per_rank.iter().zip(causes(per_rank, tp)) {
        let (rel, cos) = (x.rel_l2, x.cosine);
        let same = crate::report::shards::same_reading;
        if let Some(f) = out.iter_mut().find(|f| same(&f.cause, &cause)) {
            f.ranks.push(x.rank);
            if rel > f.rel_l2 || f.rel_l2.is_nan() {
                f.rel_l2 = rel;
                f.cosine = cos;
            }
        } else {
            out.push(Finding {
                param: p.param.clone(),
                layer: p.layer,
                ranks: vec![x.rank],
                cause,
                rel_l2: rel,
                cosine: cos,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;
    use crate::plan::ShardPlan;

    fn tiny() -> GgufModel {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
        GgufModel::open(&path).expect("the tiny fixture opens")
    }

    /// Every rank's copy of `param` as a loader with `fault` holds it, judged and grouped: the
    /// classes per rank and the findings.
    fn diagnose(fault: Fault, param: &str, tp: usize) -> (Vec<Class>, Vec<Finding>) {
        let model = tiny();
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)
            .expect("config")
            .config;
        let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
        let plan = ShardPlan::new(&model, &cfg, tp);
        let p = plan
            .params
            .iter()
            .find(|p| p.param == param)
            .unwrap_or_else(|| panic!("{param} is planned"));
        let full = w.vllm(&p.param).expect("rebuilt");
        let mut classes = Vec::new();
        let mut per_rank = Vec::new();
        for r in 0..tp {
            let actual = fault
                .inject(p, &full, &w, tp, r, safetensors::Dtype::F32)
                .expect("injected");
            let v = judge(&w, p, &full, r, &actual, 0.0).expect("judged");
            classes.push(v.class);
            if let Some(explanation) = v.explanation {
                per_rank.push(RankReading {
                    rank: r,
                    explanation,
                    rel_l2: v.rel_l2,
                    cosine: v.cosine,
                    experts: None,
                });
            }
        }
        (classes, group(p, &per_rank, tp))
    }

    const Q_B: &str = "model.layers.0.self_attn.q_b_proj.weight";
    const KV_B: &str = "model.layers.0.self_attn.kv_b_proj.weight";
    /// Row-parallel: rank-swap's default target.
    const O: &str = "model.layers.0.self_attn.o_proj.weight";
    /// Merged column-parallel: merged-rank0's default target.
    const GATE_UP: &str = "model.layers.0.mlp.gate_up_proj.weight";

    #[test]
    fn a_correct_dump_matches_on_every_rank() {
        let (classes, findings) = diagnose(Fault::None, Q_B, 4);
        assert_eq!(classes, vec![Class::Match; 4]);
        assert!(findings.is_empty());
    }

    #[test]
    fn ranks_holding_each_others_shards_are_one_swap() {
        let (classes, findings) = diagnose(Fault::RankSwap(1, 3), O, 4);
        assert_eq!(
            classes,
            vec![Class::Match, Class::Corrupt, Class::Match, Class::Corrupt]
        );
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].ranks, vec![1, 3]);
        assert_eq!(findings[0].cause, Cause::RanksSwapped { a: 1, b: 3 });
        assert_eq!(findings[0].layer, Some(0));
    }

    #[test]
    fn every_rank_holding_shard_zero_is_merged_rank0() {
        let (_, findings) = diagnose(Fault::MergedRank0, GATE_UP, 4);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].ranks, vec![1, 2, 3]);
        assert_eq!(findings[0].cause, Cause::MergedRank0 { shard: 0 });
    }

    #[test]
    fn a_zeroed_parameter_is_named_on_every_rank() {
        let (classes, findings) = diagnose(Fault::ParamZeroed("*q_b_proj*".into()), Q_B, 2);
        assert_eq!(classes, vec![Class::Corrupt; 2]);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].ranks, vec![0, 1]);
        match &findings[0].cause {
            Cause::Fault { fault, experts, .. } => {
                assert!(matches!(fault, Fault::ParamZeroed(_)), "{fault:?}");
                assert_eq!(*experts, None);
            }
            c => panic!("{c:?}"),
        }
        // All-zero against non-zero values: relative error 1, no correlation.
        assert!(
            (findings[0].rel_l2 - 1.0).abs() < 1e-9,
            "{}",
            findings[0].rel_l2
        );
    }

    #[test]
    fn an_untransposed_kv_b_is_its_own_fault() {
        let (_, findings) = diagnose(Fault::KvbUntransposed, KV_B, 2);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].ranks, vec![0, 1]);
        assert!(
            matches!(
                findings[0].cause,
                Cause::Fault {
                    fault: Fault::KvbUntransposed,
                    ..
                }
            ),
            "{:?}",
            findings[0].cause
        );
    }

    #[test]
    fn one_sided_holders_and_shapes_keep_their_own_causes() {
        let reading = |rank, explanation| RankReading {
            rank,
            explanation,
            rel_l2: 0.5,
            cosine: 0.1,
            experts: None,
        };
        let per_rank = [
            reading(2, Explanation::HoldsShardOf(1)),
            reading(
                3,
                Explanation::ShapeMismatch {
                    expected: vec![4, 8],
                    found: vec![8, 4],
                },
            ),
            reading(1, Explanation::Unexplained),
        ];
        assert_eq!(
            causes(&per_rank, 4),
            vec![
                Cause::HoldsShardOf { rank: 2, of: 1 },
                Cause::ShapeMismatch {
                    expected: vec![4, 8],
                    found: vec![8, 4]
                },
                Cause::Unexplained {
                    rel_l2: 0.5,
                    cosine: 0.1
                },
            ]
        );
        // At tp 2 the only other rank holding shard 0 is every rank but 0: merged-rank0.
        assert_eq!(
            causes(&[reading(1, Explanation::HoldsShardOf(0))], 2),
            vec![Cause::MergedRank0 { shard: 0 }]
        );
    }
}
