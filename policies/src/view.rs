//! Read-only views of the candidate table handed to filters, scorers and
//! pickers. A view carries the component's own grant: a signal group the
//! component did not declare reads as `None`, even when the host computed it
//! for another component.
//!
//! Two shapes of the same data: per-candidate accessors (the seed's API, what
//! a ported policy uses) and whole columns as slices (for policies that want a
//! tight loop over the table).

use crate::inputs::WorkerInputs;
use crate::table::{CandidateTable, WorkerWithDpRank};

/// One candidate, as a filter or scorer sees it.
#[derive(Clone, Copy, Debug)]
pub struct WorkerCandidate<'a> {
    table: &'a CandidateTable,
    row: usize,
    grant: WorkerInputs,
}

impl<'a> WorkerCandidate<'a> {
    pub(crate) fn new(table: &'a CandidateTable, row: usize, grant: WorkerInputs) -> Self {
        WorkerCandidate { table, row, grant }
    }

    pub fn worker(&self) -> WorkerWithDpRank {
        self.table.workers[self.row]
    }

    /// `CACHE` signals, if this component declared them.
    pub fn cache(&self) -> Option<CacheView<'a>> {
        self.grant
            .contains(WorkerInputs::CACHE)
            .then_some(CacheView {
                table: self.table,
                row: self.row,
            })
    }

    /// `LOAD` signals, if this component declared them.
    pub fn load(&self) -> Option<LoadView<'a>> {
        self.grant.contains(WorkerInputs::LOAD).then_some(LoadView {
            table: self.table,
            row: self.row,
        })
    }

    /// `OCCUPANCY` signals, if this component declared them.
    pub fn occupancy(&self) -> Option<OccupancyView<'a>> {
        self.grant
            .contains(WorkerInputs::OCCUPANCY)
            .then_some(OccupancyView {
                table: self.table,
                row: self.row,
            })
    }

    /// The preferred-constraint multiplier: `None` unless this component
    /// declared `PREFERRED_TAINT` and the candidate has one.
    pub fn preferred_taint_multiplier(&self) -> Option<f64> {
        taint(self.table, self.row, self.grant)
    }

    /// The host's predicted time to first token, seconds: `None` unless this
    /// component declared `TTFT` and the host predicted one.
    pub fn predicted_ttft_s(&self) -> Option<f64> {
        if !self.grant.contains(WorkerInputs::TTFT) {
            return None;
        }
        let t = self.table.ttft[self.row];
        (!t.is_nan()).then_some(t)
    }
}

fn taint(table: &CandidateTable, row: usize, grant: WorkerInputs) -> Option<f64> {
    if !grant.contains(WorkerInputs::PREFERRED_TAINT) {
        return None;
    }
    let t = table.taint[row];
    (!t.is_nan()).then_some(t)
}

/// Raw prefix-overlap counts of one candidate, in blocks.
#[derive(Clone, Copy, Debug)]
pub struct CacheView<'a> {
    table: &'a CandidateTable,
    row: usize,
}

impl CacheView<'_> {
    pub fn device_overlap_blocks(&self) -> f64 {
        f64::from(self.table.device[self.row])
    }
    pub fn host_overlap_blocks(&self) -> f64 {
        f64::from(self.table.host[self.row])
    }
    pub fn disk_overlap_blocks(&self) -> f64 {
        f64::from(self.table.disk[self.row])
    }
    /// Blocks in the node-shared cache beyond the device prefix.
    pub fn shared_beyond_blocks(&self) -> f64 {
        f64::from(self.table.shared_beyond[self.row])
    }
}

/// Load of one candidate.
#[derive(Clone, Copy, Debug)]
pub struct LoadView<'a> {
    table: &'a CandidateTable,
    row: usize,
}

impl LoadView<'_> {
    pub fn active_requests(&self) -> usize {
        self.table.active_requests[self.row] as usize
    }
    pub fn waiting_requests(&self) -> usize {
        self.table.waiting_requests[self.row] as usize
    }
    pub fn active_prefill_tokens(&self) -> usize {
        self.table.active_prefill_tokens[self.row] as usize
    }
    pub fn active_decode_blocks(&self) -> usize {
        self.table.active_decode_blocks[self.row] as usize
    }
}

/// KV occupancy of one candidate.
#[derive(Clone, Copy, Debug)]
pub struct OccupancyView<'a> {
    table: &'a CandidateTable,
    row: usize,
}

impl OccupancyView<'_> {
    pub fn kv_used_blocks(&self) -> usize {
        self.table.kv_used[self.row] as usize
    }
    pub fn kv_total_blocks(&self) -> usize {
        self.table.kv_total[self.row] as usize
    }
    /// Used over total, in [0, 1] for a sane worker; 1 when the total is 0
    /// (a worker with no KV capacity counts as full).
    pub fn kv_usage(&self) -> f64 {
        kv_usage(self.table.kv_used[self.row], self.table.kv_total[self.row])
    }
}

pub(crate) fn kv_usage(used: u32, total: u32) -> f64 {
    if total == 0 {
        1.0
    } else {
        f64::from(used) / f64::from(total)
    }
}

/// Every surviving candidate, in one call to a scorer.
#[derive(Clone, Copy, Debug)]
pub struct WorkerCandidates<'a> {
    table: &'a CandidateTable,
    grant: WorkerInputs,
}

impl<'a> WorkerCandidates<'a> {
    pub(crate) fn new(table: &'a CandidateTable, grant: WorkerInputs) -> Self {
        WorkerCandidates { table, grant }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn get(&self, row: usize) -> Option<WorkerCandidate<'a>> {
        (row < self.len()).then(|| WorkerCandidate::new(self.table, row, self.grant))
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = WorkerCandidate<'a>> + 'a {
        let (table, grant) = (self.table, self.grant);
        (0..table.len()).map(move |row| WorkerCandidate::new(table, row, grant))
    }

    /// Worker identities, index-aligned with the cost slice.
    pub fn workers(&self) -> &'a [WorkerWithDpRank] {
        &self.table.workers
    }

    /// `CACHE` columns, if this component declared them.
    pub fn cache_columns(&self) -> Option<CacheColumns<'a>> {
        cache_columns(self.table, self.grant)
    }

    /// `LOAD` columns, if this component declared them.
    pub fn load_columns(&self) -> Option<LoadColumns<'a>> {
        load_columns(self.table, self.grant)
    }

    /// `OCCUPANCY` columns, if this component declared them.
    pub fn occupancy_columns(&self) -> Option<OccupancyColumns<'a>> {
        occupancy_columns(self.table, self.grant)
    }

    /// False when no candidate has host, disk or shared-cache overlap (those
    /// columns are all zero and a scorer may skip them).
    pub fn has_lower_tier_overlap(&self) -> bool {
        self.table.lower_tiers
    }

    /// False when no candidate has a taint multiplier.
    pub fn has_taint_multipliers(&self) -> bool {
        self.table.any_taint
    }

    /// `TTFT` column (seconds; NaN = not predicted), if declared.
    pub fn ttft_column(&self) -> Option<&'a [f64]> {
        self.grant
            .contains(WorkerInputs::TTFT)
            .then_some(&self.table.ttft[..])
    }

    /// The request's own predicted prefill per candidate (seconds; NaN =
    /// not predicted), part of `TTFT`, if declared.
    pub fn prefill_column(&self) -> Option<&'a [f64]> {
        self.grant
            .contains(WorkerInputs::TTFT)
            .then_some(&self.table.prefill[..])
    }

    /// The requests the host sent each candidate lately (a count halving
    /// every [`crate::table::RECENT_HALF_LIFE_MS`]; NaN = not known), part
    /// of `TTFT`, if declared.
    pub fn recent_column(&self) -> Option<&'a [f64]> {
        self.grant
            .contains(WorkerInputs::TTFT)
            .then_some(&self.table.recent[..])
    }

    /// `PREFERRED_TAINT` column (NaN = no multiplier), if declared.
    pub fn preferred_taint_column(&self) -> Option<&'a [f64]> {
        self.grant
            .contains(WorkerInputs::PREFERRED_TAINT)
            .then_some(&self.table.taint[..])
    }
}

/// `CACHE` as index-aligned columns (block counts).
#[derive(Clone, Copy, Debug)]
pub struct CacheColumns<'a> {
    pub device_blocks: &'a [u32],
    pub host_blocks: &'a [u32],
    pub disk_blocks: &'a [u32],
    pub shared_beyond_blocks: &'a [u32],
}

/// `LOAD` as index-aligned columns (counts).
#[derive(Clone, Copy, Debug)]
pub struct LoadColumns<'a> {
    pub active_requests: &'a [u32],
    pub waiting_requests: &'a [u32],
    pub active_prefill_tokens: &'a [u32],
    pub active_decode_blocks: &'a [u32],
}

/// `OCCUPANCY` as index-aligned columns (block counts).
#[derive(Clone, Copy, Debug)]
pub struct OccupancyColumns<'a> {
    pub kv_used_blocks: &'a [u32],
    pub kv_total_blocks: &'a [u32],
}

fn cache_columns(t: &CandidateTable, grant: WorkerInputs) -> Option<CacheColumns<'_>> {
    grant.contains(WorkerInputs::CACHE).then_some(CacheColumns {
        device_blocks: &t.device,
        host_blocks: &t.host,
        disk_blocks: &t.disk,
        shared_beyond_blocks: &t.shared_beyond,
    })
}

fn load_columns(t: &CandidateTable, grant: WorkerInputs) -> Option<LoadColumns<'_>> {
    grant.contains(WorkerInputs::LOAD).then_some(LoadColumns {
        active_requests: &t.active_requests,
        waiting_requests: &t.waiting_requests,
        active_prefill_tokens: &t.active_prefill_tokens,
        active_decode_blocks: &t.active_decode_blocks,
    })
}

fn occupancy_columns(t: &CandidateTable, grant: WorkerInputs) -> Option<OccupancyColumns<'_>> {
    grant
        .contains(WorkerInputs::OCCUPANCY)
        .then_some(OccupancyColumns {
            kv_used_blocks: &t.kv_used,
            kv_total_blocks: &t.kv_total,
        })
}

/// What a picker sees: every surviving candidate with its total cost.
#[derive(Clone, Copy, Debug)]
pub struct WorkerInputView<'a> {
    table: &'a CandidateTable,
    costs: &'a [f64],
    range: (f64, f64),
    grant: WorkerInputs,
}

impl<'a> WorkerInputView<'a> {
    pub(crate) fn new(
        table: &'a CandidateTable,
        costs: &'a [f64],
        range: (f64, f64),
        grant: WorkerInputs,
    ) -> Self {
        WorkerInputView {
            table,
            costs,
            range,
            grant,
        }
    }

    /// The lowest and highest total cost (the host computes them while
    /// validating the costs).
    pub fn cost_range(&self) -> (f64, f64) {
        self.range
    }

    pub fn len(&self) -> usize {
        self.costs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.costs.is_empty()
    }

    /// Total costs, index-aligned with the rows.
    pub fn costs(&self) -> &'a [f64] {
        self.costs
    }

    pub fn candidates(&self) -> ScoredCandidates<'a> {
        ScoredCandidates {
            table: self.table,
            costs: self.costs,
            grant: self.grant,
        }
    }

    /// Index-aligned `CACHE` view, if this picker declared it.
    pub fn cache(&self) -> Option<CacheColumn<'a>> {
        self.grant
            .contains(WorkerInputs::CACHE)
            .then_some(CacheColumn { table: self.table })
    }

    /// Index-aligned `LOAD` view, if this picker declared it.
    pub fn load(&self) -> Option<LoadColumn<'a>> {
        self.grant
            .contains(WorkerInputs::LOAD)
            .then_some(LoadColumn { table: self.table })
    }

    /// Index-aligned `OCCUPANCY` view, if this picker declared it.
    pub fn occupancy(&self) -> Option<OccupancyColumn<'a>> {
        self.grant
            .contains(WorkerInputs::OCCUPANCY)
            .then_some(OccupancyColumn { table: self.table })
    }

    /// As [`WorkerCandidates`], for pickers that want columns.
    pub fn as_candidates(&self) -> WorkerCandidates<'a> {
        WorkerCandidates::new(self.table, self.grant)
    }
}

/// The scored candidates of a [`WorkerInputView`].
#[derive(Clone, Copy, Debug)]
pub struct ScoredCandidates<'a> {
    table: &'a CandidateTable,
    costs: &'a [f64],
    grant: WorkerInputs,
}

impl<'a> ScoredCandidates<'a> {
    pub fn len(&self) -> usize {
        self.costs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.costs.is_empty()
    }

    pub fn get(&self, row: usize) -> Option<ScoredWorkerCandidate<'a>> {
        (row < self.len()).then_some(ScoredWorkerCandidate {
            table: self.table,
            cost: self.costs[row],
            row: row as u32,
            grant: self.grant,
        })
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = ScoredWorkerCandidate<'a>> + 'a {
        let (table, grant) = (self.table, self.grant);
        self.costs
            .iter()
            .enumerate()
            .map(move |(row, &cost)| ScoredWorkerCandidate {
                table,
                cost,
                row: row as u32,
                grant,
            })
    }
}

/// One candidate with its total cost.
#[derive(Clone, Copy, Debug)]
pub struct ScoredWorkerCandidate<'a> {
    // Laid out without padding (8 + 8 + 4 + 4 bytes) so pickers that fold
    // over candidates keep them in registers.
    table: &'a CandidateTable,
    cost: f64,
    row: u32,
    grant: WorkerInputs,
}

impl ScoredWorkerCandidate<'_> {
    pub fn worker(&self) -> WorkerWithDpRank {
        self.table.workers[self.row as usize]
    }

    pub fn cost(&self) -> f64 {
        self.cost
    }

    pub fn preferred_taint_multiplier(&self) -> Option<f64> {
        taint(self.table, self.row as usize, self.grant)
    }
}

macro_rules! column_view {
    ($name:ident, $view:ident) => {
        /// Index-aligned per-row access for pickers.
        #[derive(Clone, Copy, Debug)]
        pub struct $name<'a> {
            table: &'a CandidateTable,
        }

        impl<'a> $name<'a> {
            pub fn get(&self, row: usize) -> Option<$view<'a>> {
                (row < self.table.len()).then_some($view {
                    table: self.table,
                    row,
                })
            }

            pub fn iter(&self) -> impl ExactSizeIterator<Item = $view<'a>> + 'a {
                let table = self.table;
                (0..table.len()).map(move |row| $view { table, row })
            }
        }
    };
}

column_view!(CacheColumn, CacheView);
column_view!(LoadColumn, LoadView);
column_view!(OccupancyColumn, OccupancyView);
