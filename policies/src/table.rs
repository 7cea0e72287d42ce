//! The host-owned, columnar candidate table a selection runs over.
//!
//! One row per eligible (worker, data-parallel rank). The host fills the
//! identity column and the columns of the signal groups some component
//! declared; the table records which groups are present. Columns are plain
//! vectors kept across requests, so refilling a table of the same size does
//! not allocate.

use std::fmt;

use crate::inputs::WorkerInputs;

/// A worker and its data-parallel rank: one routable target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WorkerWithDpRank {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl WorkerWithDpRank {
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        WorkerWithDpRank { worker_id, dp_rank }
    }
}

impl fmt::Display for WorkerWithDpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// `CACHE`: raw prefix-overlap counts per tier, in blocks. Missing is zero.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct CacheRow {
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    /// Blocks found in a node-shared cache beyond the worker's device prefix.
    pub shared_beyond_blocks: u32,
}

/// `LOAD`: what the worker is already doing.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct LoadRow {
    pub active_requests: u32,
    pub waiting_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// `OCCUPANCY`: KV-cache blocks in use and in total.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct OccupancyRow {
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
}

/// Everything the host may know about one candidate.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct CandidateRow {
    pub worker: WorkerWithDpRank,
    pub cache: CacheRow,
    pub load: LoadRow,
    pub occupancy: OccupancyRow,
    /// `PREFERRED_TAINT`: cost multiplier from preferred routing constraints.
    pub preferred_taint_multiplier: Option<f64>,
    /// `TTFT`: the host's predicted time to first token, seconds.
    pub predicted_ttft_s: Option<f64>,
    /// `TTFT`: of that, the request's own prefill on this worker (the
    /// work it adds there), seconds.
    pub predicted_prefill_s: Option<f64>,
    /// `TTFT`: the requests the host sent this worker lately, a count that
    /// halves every [`RECENT_HALF_LIFE_MS`]: the load the streams placed
    /// there will bring, which a prediction of this request's first token
    /// leaves out.
    pub recent_selections: Option<f64>,
}

/// The half-life of [`CandidateRow::recent_selections`], ms.
pub const RECENT_HALF_LIFE_MS: u64 = 10_000;

/// Columnar candidates. Row order is unspecified to policies.
///
/// Every count is stored as a `u32` column, saturated at 2^31 - 1 when
/// pushed (no realistic count comes near): scorers convert every signal they
/// read to `f64`, and a value below 2^31 converts as a signed 32-bit integer,
/// two per instruction, where a `u64` takes a branchy sequence per value.
#[derive(Clone, Debug, Default)]
pub struct CandidateTable {
    present: WorkerInputs,
    pub(crate) workers: Vec<WorkerWithDpRank>,
    pub(crate) device: Vec<u32>,
    pub(crate) host: Vec<u32>,
    pub(crate) disk: Vec<u32>,
    pub(crate) shared_beyond: Vec<u32>,
    pub(crate) active_requests: Vec<u32>,
    pub(crate) waiting_requests: Vec<u32>,
    pub(crate) active_prefill_tokens: Vec<u32>,
    pub(crate) active_decode_blocks: Vec<u32>,
    pub(crate) kv_used: Vec<u32>,
    pub(crate) kv_total: Vec<u32>,
    /// NaN where the candidate has no multiplier.
    pub(crate) taint: Vec<f64>,
    /// Predicted TTFT, seconds (NaN: not predicted).
    pub(crate) ttft: Vec<f64>,
    /// The request's own predicted prefill, seconds (NaN: not predicted).
    pub(crate) prefill: Vec<f64>,
    /// Recent selections, a decayed count (NaN: not known).
    pub(crate) recent: Vec<f64>,
    /// Some row may have host, disk or shared-cache overlap (conservative:
    /// cleared only by `reset`). Lets scorers skip three all-zero columns.
    pub(crate) lower_tiers: bool,
    /// Some row may have a taint multiplier (conservative, as above).
    pub(crate) any_taint: bool,
}

impl CandidateTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the table (keeping its buffers) and declares which signal
    /// groups the rows about to be pushed carry.
    pub fn reset(&mut self, present: WorkerInputs) {
        self.present = present;
        self.workers.clear();
        self.device.clear();
        self.host.clear();
        self.disk.clear();
        self.shared_beyond.clear();
        self.active_requests.clear();
        self.waiting_requests.clear();
        self.active_prefill_tokens.clear();
        self.active_decode_blocks.clear();
        self.kv_used.clear();
        self.kv_total.clear();
        self.taint.clear();
        self.ttft.clear();
        self.prefill.clear();
        self.recent.clear();
        self.lower_tiers = false;
        self.any_taint = false;
    }

    /// Appends a row. Columns of groups not present are filled but never
    /// shown to a policy.
    pub fn push(&mut self, row: CandidateRow) {
        self.workers.push(row.worker);
        self.device
            .push(saturate(u64::from(row.cache.device_blocks)));
        self.host.push(saturate(u64::from(row.cache.host_blocks)));
        self.disk.push(saturate(u64::from(row.cache.disk_blocks)));
        self.shared_beyond
            .push(saturate(u64::from(row.cache.shared_beyond_blocks)));
        self.active_requests
            .push(saturate(u64::from(row.load.active_requests)));
        self.waiting_requests
            .push(saturate(u64::from(row.load.waiting_requests)));
        self.active_prefill_tokens
            .push(saturate(row.load.active_prefill_tokens));
        self.active_decode_blocks
            .push(saturate(row.load.active_decode_blocks));
        self.kv_used.push(saturate(row.occupancy.kv_used_blocks));
        self.kv_total.push(saturate(row.occupancy.kv_total_blocks));
        self.taint
            .push(row.preferred_taint_multiplier.unwrap_or(f64::NAN));
        self.ttft.push(row.predicted_ttft_s.unwrap_or(f64::NAN));
        self.prefill
            .push(row.predicted_prefill_s.unwrap_or(f64::NAN));
        self.recent.push(row.recent_selections.unwrap_or(f64::NAN));
        self.lower_tiers |= has_lower_tiers(&row.cache);
        self.any_taint |= row.preferred_taint_multiplier.is_some();
    }

    /// Overwrites the `CACHE` columns of one row (the host fills overlaps per
    /// request into a table whose load columns it keeps up to date).
    pub fn set_cache(&mut self, row: usize, cache: CacheRow) {
        self.device[row] = saturate(u64::from(cache.device_blocks));
        self.host[row] = saturate(u64::from(cache.host_blocks));
        self.disk[row] = saturate(u64::from(cache.disk_blocks));
        self.shared_beyond[row] = saturate(u64::from(cache.shared_beyond_blocks));
        self.lower_tiers |= has_lower_tiers(&cache);
    }

    /// Overwrites the `LOAD` columns of one row.
    pub fn set_load(&mut self, row: usize, load: LoadRow) {
        self.active_requests[row] = saturate(u64::from(load.active_requests));
        self.waiting_requests[row] = saturate(u64::from(load.waiting_requests));
        self.active_prefill_tokens[row] = saturate(load.active_prefill_tokens);
        self.active_decode_blocks[row] = saturate(load.active_decode_blocks);
    }

    /// Declares the groups present (after in-place updates).
    pub fn set_present(&mut self, present: WorkerInputs) {
        self.present = present;
    }

    pub fn present(&self) -> WorkerInputs {
        self.present
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub fn worker(&self, row: usize) -> WorkerWithDpRank {
        self.workers[row]
    }

    pub fn workers(&self) -> &[WorkerWithDpRank] {
        &self.workers
    }

    /// The row of `worker`, if it is a candidate.
    pub fn position(&self, worker: WorkerWithDpRank) -> Option<usize> {
        self.workers.iter().position(|w| *w == worker)
    }

    /// Reads one row back.
    pub fn row(&self, row: usize) -> CandidateRow {
        let taint = self.taint[row];
        CandidateRow {
            worker: self.workers[row],
            cache: CacheRow {
                device_blocks: self.device[row],
                host_blocks: self.host[row],
                disk_blocks: self.disk[row],
                shared_beyond_blocks: self.shared_beyond[row],
            },
            load: LoadRow {
                active_requests: self.active_requests[row],
                waiting_requests: self.waiting_requests[row],
                active_prefill_tokens: u64::from(self.active_prefill_tokens[row]),
                active_decode_blocks: u64::from(self.active_decode_blocks[row]),
            },
            occupancy: OccupancyRow {
                kv_used_blocks: u64::from(self.kv_used[row]),
                kv_total_blocks: u64::from(self.kv_total[row]),
            },
            preferred_taint_multiplier: (!taint.is_nan()).then_some(taint),
            predicted_ttft_s: Some(self.ttft[row]).filter(|t| !t.is_nan()),
            predicted_prefill_s: Some(self.prefill[row]).filter(|t| !t.is_nan()),
            recent_selections: Some(self.recent[row]).filter(|r| !r.is_nan()),
        }
    }

    /// Replaces `self` with the rows of `src` listed in `rows` (filtered
    /// candidates are compacted so scorers and pickers see contiguous columns).
    pub(crate) fn gather(&mut self, src: &CandidateTable, rows: &[u32]) {
        fn take<T: Copy>(dst: &mut Vec<T>, src: &[T], rows: &[u32]) {
            dst.clear();
            dst.extend(rows.iter().map(|&r| src[r as usize]));
        }
        self.present = src.present;
        self.lower_tiers = src.lower_tiers;
        self.any_taint = src.any_taint;
        take(&mut self.workers, &src.workers, rows);
        take(&mut self.device, &src.device, rows);
        take(&mut self.host, &src.host, rows);
        take(&mut self.disk, &src.disk, rows);
        take(&mut self.shared_beyond, &src.shared_beyond, rows);
        take(&mut self.active_requests, &src.active_requests, rows);
        take(&mut self.waiting_requests, &src.waiting_requests, rows);
        take(
            &mut self.active_prefill_tokens,
            &src.active_prefill_tokens,
            rows,
        );
        take(
            &mut self.active_decode_blocks,
            &src.active_decode_blocks,
            rows,
        );
        take(&mut self.kv_used, &src.kv_used, rows);
        take(&mut self.kv_total, &src.kv_total, rows);
        take(&mut self.taint, &src.taint, rows);
        take(&mut self.ttft, &src.ttft, rows);
        take(&mut self.prefill, &src.prefill, rows);
        take(&mut self.recent, &src.recent, rows);
    }
}

/// Counts are kept below 2^31 so that scorers may convert them as signed
/// 32-bit integers (`cvtdq2pd`, two per instruction on baseline x86-64).
pub(crate) const COUNT_MAX: u32 = i32::MAX as u32;

fn saturate(v: u64) -> u32 {
    v.min(u64::from(COUNT_MAX)) as u32
}

/// A stored count as `f64`: one signed conversion (counts are < 2^31).
#[inline(always)]
pub(crate) fn count(v: u32) -> f64 {
    f64::from(v as i32)
}

fn has_lower_tiers(c: &CacheRow) -> bool {
    (c.host_blocks | c.disk_blocks | c.shared_beyond_blocks) != 0
}
