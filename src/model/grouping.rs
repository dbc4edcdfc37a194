//! The router's choices grouped by expert, as the grouped MoE kernels read them (`model::q8_cuda`,
//! `model::moe_cuda`). Host-side and device-independent, so its tables are tested without a GPU.
//! Only a `cuda` build multiplies with it (the eager expert loop uses [`routed_rows`] in every
//! build).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::{Result, Tensor};

/// The tile widths (tokens per block) the kernel is built for.
const TILE_WIDTHS: [usize; 5] = [8, 16, 32, 64, 128];
/// Where a tile's weight reads cost as much as its columns' arithmetic, in columns: the tile
/// width is chosen to minimise Σ_experts ⌈rows/w⌉ · (BREAK_EVEN + w). An estimate (a Q4_K
/// 128-row tile of 6144 inputs is ~440 KB; int8 mma runs ~30 of its columns in that read's
/// time on an H200), not a measured optimum.
const BREAK_EVEN: usize = 32;

/// The router's `[T, k]` choices grouped by expert, as the kernel reads them: one U32 table on the
/// device, `[tokens (rows) | slots (rows) | bounds (n_active + 1) | experts (n_active) | by_size
/// (n_active)]`. Row j (expert-major, tokens ascending within an expert) is token `tokens[j]`'s
/// slot `slots[j] = token·k + slot`; the j-th active expert `experts[z]` owns rows
/// `bounds[z]..bounds[z+1]`; `by_size` lists the active indices z by row count, fewest first (ties
/// in index order), so that the experts of one tile width are a run of it ([`Grouping::tile_runs`]).
pub struct Grouping {
    pub(crate) table: Tensor,
    pub(crate) rows: usize,
    /// The rows (`token·k + slot`) of each expert that has tokens, experts ascending, tokens
    /// ascending within one: the host's copy of `slots` split at `bounds`.
    pub(crate) by_expert: Vec<Vec<u32>>,
}

impl Grouping {
    pub fn new(indices: &Tensor, n_experts: usize) -> Result<Self> {
        let (_, k) = indices.dims2()?;
        let ids = indices.flatten_all()?.to_vec1::<u32>()?;
        Self::from_host(&ids, k, n_experts, indices.device())
    }

    /// The grouping of the router's choices `ids` (`[T, k]` row-major, read to the host), its
    /// table on `device`.
    pub fn from_host(
        ids: &[u32],
        k: usize,
        n_experts: usize,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let mut by_expert = Vec::new();
        let (mut tokens, mut slots, mut bounds, mut experts) =
            (Vec::new(), Vec::new(), vec![0u32], Vec::new());
        for (e, list) in routed_rows(ids, k, n_experts)?.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let flat: Vec<u32> = list.iter().map(|&(_, f)| f).collect();
            tokens.extend(list.iter().map(|&(tok, _)| tok));
            slots.extend_from_slice(&flat);
            bounds.push(slots.len() as u32);
            experts.push(e as u32);
            by_expert.push(flat);
        }
        let rows = ids.len();
        let mut by_size: Vec<u32> = (0..by_expert.len() as u32).collect();
        by_size.sort_by_key(|&z| by_expert[z as usize].len());
        let mut table = tokens;
        table.extend(slots);
        table.extend(bounds);
        table.extend(experts);
        table.extend(by_size);
        let n = table.len();
        Ok(Grouping {
            table: Tensor::from_vec(table, n, device)?,
            rows,
            by_expert,
        })
    }

    /// All `t` rows to one expert, in order: a dense weight as a one-expert stack.
    pub(crate) fn identity(t: usize, device: &candle_core::Device) -> Result<Self> {
        let ids = Tensor::zeros((t, 1), candle_core::DType::U32, &candle_core::Device::Cpu)?;
        let g = Grouping::new(&ids, 1)?;
        Ok(Grouping {
            table: g.table.to_device(device)?,
            ..g
        })
    }

    /// Experts that have tokens.
    pub(crate) fn active(&self) -> usize {
        self.by_expert.len()
    }

    /// The most rows one expert has.
    pub(crate) fn max_rows(&self) -> usize {
        self.by_expert.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Each token's grouped rows in row order, for a combine that sums per token what an
    /// `index_add` over the rows sums (`model::fused_cuda::token_sum`): `[rows (t·k) | slots
    /// (t·k)]`, token i's rows at `i·k..(i+1)·k` ascending, each beside its slot `token·k +
    /// slot`. Every token has exactly `k` rows (the router picks k distinct experts).
    pub(crate) fn token_order(&self, k: usize) -> Vec<u32> {
        let n = self.rows;
        let mut out = vec![0u32; 2 * n];
        let mut filled = vec![0usize; n / k.max(1)];
        let slots = self.by_expert.iter().flatten();
        for (j, &s) in slots.enumerate() {
            let tok = s as usize / k.max(1);
            if let Some(f) = filled.get_mut(tok) {
                let at = tok * k + (*f).min(k.saturating_sub(1));
                out[at] = j as u32;
                out[n + at] = s;
                *f += 1;
            }
        }
        out
    }

    /// The tile width for these experts' row counts (see [`BREAK_EVEN`]).
    pub(crate) fn tile_width(&self) -> usize {
        tile_width_for(self.by_expert.iter().map(Vec::len))
    }

    /// dequant mode's register kernel in one or two launches, each a run of the `by_size` order:
    /// with the cost-model tile `w` (at most `cap`), the experts that hold more than `w` rows would
    /// decode each of their weights once per tile of `w`; when a wider tile (at most `cap`) suits
    /// them, they get a launch of their own at it, and the rest keep a narrow tile (and the
    /// resident blocks per SM a narrow tile's shared memory allows). A run's tile only decides
    /// which of an expert's tokens share a block: every output is summed the same way.
    pub(crate) fn tile_runs(&self, cap: usize) -> Vec<TileRun> {
        let mut sizes: Vec<usize> = self.by_expert.iter().map(Vec::len).collect();
        sizes.sort_unstable();
        let run = |range: std::ops::Range<usize>, tile: usize| TileRun {
            max_rows: range.clone().last().map_or(0, |i| sizes[i]),
            range,
            tile,
        };
        let all = self.tile_width().min(cap);
        let light = sizes.partition_point(|&r| r <= all);
        let heavy_tile = tile_width_for(sizes[light..].iter().copied()).min(cap);
        if light == 0 || light == sizes.len() || heavy_tile <= all {
            return vec![run(0..sizes.len(), all)];
        }
        let light_tile = tile_width_for(sizes[..light].iter().copied()).min(all);
        vec![
            run(0..light, light_tile),
            run(light..sizes.len(), heavy_tile),
        ]
    }
}

/// One launch of [`Grouping::tile_runs`]: the active experts `by_size[range]`, at `tile` tokens
/// per block, the busiest of them holding `max_rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TileRun {
    pub range: std::ops::Range<usize>,
    pub tile: usize,
    pub max_rows: usize,
}

/// The tile width for experts with these row counts: the one minimising
/// Σ ⌈rows/w⌉ · ([`BREAK_EVEN`] + w), the narrower on a tie ([`Grouping::tile_width`]; a dense
/// weight of `t` rows is one expert of `t`).
pub(crate) fn tile_width_for(rows: impl Iterator<Item = usize> + Clone) -> usize {
    let cost = |w: usize| -> usize { rows.clone().map(|r| r.div_ceil(w) * (BREAK_EVEN + w)).sum() };
    TILE_WIDTHS
        .into_iter()
        .min_by_key(|&w| (cost(w), w))
        .unwrap_or(TILE_WIDTHS[0])
}

/// A run of consecutive active experts for dequant mode's batched GEMMs: experts `range` (indices
/// into the active list), each padded to `m` rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub range: std::ops::Range<usize>,
    pub m: usize,
    /// The token of each padded row, `range.len() · m` (padding repeats the expert's first token).
    pub src: Vec<u32>,
    /// The padded positions of the real rows, in grouped order (experts ascending, tokens
    /// ascending within one).
    pub valid: Vec<u32>,
}

impl Grouping {
    /// The active experts in runs whose decoded weights (`expert_bytes` each) and padded
    /// activations (`row_bytes` per padded row: every expert of a run padded to its busiest) each
    /// fit `budget` bytes (at least one expert per run); `k` slots per token.
    pub fn batches(
        &self,
        k: usize,
        expert_bytes: usize,
        row_bytes: usize,
        budget: usize,
    ) -> Vec<Batch> {
        let mut runs = Vec::new();
        let mut start = 0;
        while start < self.active() {
            let (mut end, mut m) = (start + 1, self.by_expert[start].len());
            while end < self.active() {
                let m2 = m.max(self.by_expert[end].len());
                let n2 = end + 1 - start;
                if n2 * expert_bytes > budget || n2 * m2 * row_bytes > budget {
                    break;
                }
                (end, m) = (end + 1, m2);
            }
            runs.push(self.batch(start..end, m, k));
            start = end;
        }
        runs
    }

    fn batch(&self, range: std::ops::Range<usize>, m: usize, k: usize) -> Batch {
        let k = k.max(1) as u32;
        let (mut src, mut valid) = (Vec::new(), Vec::new());
        for (z, rows) in self.by_expert[range.clone()].iter().enumerate() {
            let pad = rows.first().map_or(0, |&s| s / k);
            for r in 0..m {
                src.push(rows.get(r).map_or(pad, |&s| s / k));
            }
            valid.extend((0..rows.len()).map(|r| (z * m + r) as u32));
        }
        Batch {
            range,
            m,
            src,
            valid,
        }
    }
}

/// The router's choices `ids` (`[T, k]` row-major, on the host) by expert: for each of
/// `n_experts` experts, its (token, flat index token·k + slot into the routing weights), tokens
/// ascending.
pub(crate) fn routed_rows(ids: &[u32], k: usize, n_experts: usize) -> Result<Vec<Vec<(u32, u32)>>> {
    let mut per_expert: Vec<Vec<(u32, u32)>> = vec![Vec::new(); n_experts];
    for (tok, row) in ids.chunks(k.max(1)).enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            let list = per_expert.get_mut(e as usize).ok_or_else(|| {
                candle_core::Error::Msg(format!("router chose expert {e} of {n_experts}"))
            })?;
            list.push((tok as u32, (tok * k + slot) as u32));
        }
    }
    Ok(per_expert)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn grouping(ids: &[[u32; 2]], experts: usize) -> Result<Grouping> {
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        Grouping::new(
            &Tensor::from_vec(flat, (ids.len(), 2), &Device::Cpu)?,
            experts,
        )
    }

    #[test]
    fn rows_are_grouped_by_expert_with_tokens_ascending() -> Result<()> {
        // token 0 → experts 3, 1; token 1 → experts 1, 2; expert 0 idle.
        let g = grouping(&[[3, 1], [1, 2]], 4)?;
        assert_eq!((g.rows, g.active(), g.max_rows()), (4, 3, 2));
        let table = g.table.to_vec1::<u32>()?;
        let (tokens, rest) = table.split_at(4);
        let (slots, rest) = rest.split_at(4);
        let (bounds, rest) = rest.split_at(4);
        let (experts, by_size) = rest.split_at(3);
        assert_eq!(tokens, [0, 1, 1, 0]);
        assert_eq!(slots, [1, 2, 3, 0]); // token·k + slot
        assert_eq!(bounds, [0, 2, 3, 4]);
        assert_eq!(experts, [1, 2, 3]);
        assert_eq!(by_size, [1, 2, 0]); // experts 2 and 3 (one row each), then expert 1 (two)
        Ok(())
    }

    #[test]
    fn each_tokens_rows_come_in_row_order_beside_their_slots() -> Result<()> {
        // token 0 → experts 3, 1; token 1 → experts 1, 2; token 2 → experts 0, 3.
        // Rows (expert-major): e0 [t2], e1 [t0, t1], e2 [t1], e3 [t0, t2].
        let g = grouping(&[[3, 1], [1, 2], [0, 3]], 4)?;
        let order = g.token_order(2);
        let (rows, slots) = order.split_at(6);
        assert_eq!(rows, [1, 4, 2, 3, 0, 5]);
        assert_eq!(slots, [1, 0, 2, 3, 4, 5]); // row 1 is token 0's slot 1 (expert 1)
        Ok(())
    }

    #[test]
    fn batches_pad_each_expert_to_the_busiest_one_in_its_run() -> Result<()> {
        // token 0 → experts 3, 1; token 1 → experts 1, 2: expert 1 has tokens 0 and 1.
        let g = grouping(&[[3, 1], [1, 2]], 4)?;
        // Two experts' weights per run: [1, 2] then [3].
        let b = g.batches(2, 100, 1, 250);
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].range.clone(), b[0].m), (0..2, 2));
        assert_eq!(b[0].src, [0, 1, 1, 1]); // expert 2's one row (token 1) padded with token 1
        assert_eq!(b[0].valid, [0, 1, 2]);
        assert_eq!(
            (b[1].range.clone(), b[1].m, b[1].src.clone()),
            (2..3, 1, vec![0])
        );
        assert_eq!(b[1].valid, [0]);
        // A budget below one expert still makes progress, one expert per run.
        assert_eq!(g.batches(2, 100, 1, 10).len(), 3);
        // Padded activations count too: experts 1 (2 rows) and 2 (1 row) padded to 2 rows each
        // are 400 bytes of 100-byte rows, over 300, so expert 1 runs alone; 2 and 3 (1 row each)
        // fit together.
        let runs = g.batches(2, 1, 100, 300);
        assert_eq!(
            runs.iter().map(|b| b.range.len()).collect::<Vec<_>>(),
            [1, 2]
        );
        Ok(())
    }

    #[test]
    fn an_expert_id_past_the_stack_is_an_error() {
        let err = grouping(&[[0, 9]], 4).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("expert 9 of 4")));
    }

    /// The rows of `sizes[i]` tokens for expert i (k = 1; token order = expert order).
    fn sized(sizes: &[usize]) -> Result<Grouping> {
        let ids: Vec<u32> = sizes
            .iter()
            .enumerate()
            .flat_map(|(e, &n)| std::iter::repeat_n(e as u32, n))
            .collect();
        let t = ids.len();
        Grouping::new(&Tensor::from_vec(ids, (t, 1), &Device::Cpu)?, sizes.len())
    }

    #[test]
    fn busy_experts_get_a_wider_tile_of_their_own() -> Result<()> {
        let run = |range: std::ops::Range<usize>, tile, max_rows| TileRun {
            range,
            tile,
            max_rows,
        };
        // ~9 rows an expert and a few busy ones (256 tokens of GLM-5): 16 for the many, 32 for
        // the busy (each of their weights decoded once or twice instead of two to four times).
        let g = sized(&[9, 40, 12, 8, 20, 10, 11, 9, 64, 7])?;
        assert_eq!(g.tile_width(), 16);
        assert_eq!(g.tile_runs(32), [run(0..7, 16, 12), run(7..10, 32, 64)]);
        // by_size: the light experts first, fewest rows first; the runs cover every expert once.
        let table = g.table.to_vec1::<u32>()?;
        let by_size = &table[table.len() - g.active()..];
        assert_eq!(by_size, [9, 3, 0, 7, 5, 6, 2, 4, 1, 8]);
        // Every expert within the tile, or one tile for all: a single launch.
        let even = sized(&[9, 12, 16, 10])?;
        assert_eq!(even.tile_runs(32), [run(0..4, 16, 16)]);
        assert_eq!(g.tile_runs(16), [run(0..10, 16, 64)]);
        // Few rows (16 tokens): 8 wide, and a busier expert 16 wide.
        let few = sized(&[1, 2, 1, 3, 12, 1])?;
        assert_eq!(few.tile_width(), 8);
        assert_eq!(few.tile_runs(32), [run(0..5, 8, 3), run(5..6, 16, 12)]);
        Ok(())
    }

    #[test]
    fn the_tile_width_follows_the_rows_per_expert() -> Result<()> {
        // Few rows per expert: the narrowest tile.
        assert_eq!(grouping(&[[3, 1], [1, 2]], 4)?.tile_width(), 8);
        // 40 rows in each of 2 experts: one 64-wide tile each beats two 32-wide reads.
        let ids: Vec<[u32; 2]> = (0..40).map(|_| [0, 1]).collect();
        assert_eq!(grouping(&ids, 2)?.tile_width(), 64);
        // One expert (a dense weight): 256 rows in two 128-wide tiles, 150 in three 64-wide ones
        // (3·96 = 288 against 2·160 = 320), 200 in two 128-wide ones (320 against 4·96 = 384).
        assert_eq!(tile_width_for([256].into_iter()), 128);
        assert_eq!(tile_width_for([150].into_iter()), 64);
        assert_eq!(tile_width_for([200].into_iter()), 128);
        assert_eq!(tile_width_for([16].into_iter()), 16);
        Ok(())
    }
}
