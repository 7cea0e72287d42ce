//! The plugin traits (filter, scorer, picker) and the executor that runs
//! them under the host contract.
//!
//! The contract, enforced here rather than trusted: filters run in
//! declaration order and rejecting every worker is an error; each scorer gets
//! a cost slice pre-filled with NaN and must write every entry with a finite
//! value; totals must stay finite; the picker's row is range-checked. A
//! component sees only the signal groups it declared. After warm-up (the
//! largest table seen so far) a selection allocates nothing.
//!
//! One exception to "rather than trusted", which only this crate can make:
//! a shipped scorer that writes every entry whenever it succeeds (tested
//! for each of its loops) may be marked so when its policy is built, and
//! then, as the first scorer, gets its slice without the NaN pre-fill. Its
//! costs are still checked for finiteness.

use std::fmt;

use crate::config::RouterConfig;
use crate::context::WorkerSelectionContext;
use crate::error::{SelectionErrorKind, WorkerSelectionPolicyError};
use crate::inputs::WorkerInputs;
use crate::table::{CandidateTable, WorkerWithDpRank};
use crate::view::{WorkerCandidate, WorkerCandidates, WorkerInputView};

/// A hard yes/no on one worker. Keep preferences in scorers.
pub trait WorkerFilter: Send {
    /// The signal groups `keep` reads. Read once, when the policy is built.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    /// `true` keeps the worker.
    fn keep(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError>;

    /// Runs `keep` for every candidate, in order, writing `keep[i]`. The
    /// host calls this, once per filter per selection: the provided body
    /// calls your `keep` directly (no virtual call per candidate, and the
    /// compiler can inline it). Override it only to filter columns at once.
    fn keep_many(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        keep: &mut [bool],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (candidate, k) in candidates.iter().zip(keep.iter_mut()) {
            *k = self.keep(context, candidate)?;
        }
        Ok(())
    }
}

/// A preference: one finite cost per candidate, lower is better. Costs of
/// all scorers are added.
pub trait WorkerScorer: Send {
    /// The signal groups `score` reads. Read once, when the policy is built.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    /// Writes `costs[i]` for candidate `i`; `costs` is pre-filled with NaN and
    /// has exactly one entry per candidate.
    fn score(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError>;
}

/// The final choice among the scored candidates.
pub trait WorkerPicker: Send {
    /// The signal groups `pick` reads. Read once, when the policy is built.
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    /// Returns a row of `input`.
    fn pick(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError>;

    /// Runs what `pick` runs over `input` and changes nothing any later
    /// `pick` returns. The host calls it between paced requests so that the
    /// picker's code and state are in the CPU's caches when the next request
    /// comes ([`WorkerSelectionPolicy::warm`]). The default does nothing;
    /// the shipped pickers run `pick` and put back what it changed (a
    /// generator's state, the last worker picked).
    fn warm(&mut self, context: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) {
        let _ = (context, input);
    }
}

/// The outcome of one selection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Selection {
    pub worker: WorkerWithDpRank,
    /// Row of the host's candidate table.
    pub row: usize,
    /// Total cost of the chosen row (NaN on the exact-target path, which
    /// does not score).
    pub cost: f64,
    /// Candidates that survived the filters.
    pub candidates: usize,
}

/// A built policy: filters, scorers and a picker, plus the buffers they run
/// in. One instance per routing partition; its state is its own.
pub struct WorkerSelectionPolicy {
    config: RouterConfig,
    worker_type: &'static str,
    filters: Vec<(Box<dyn WorkerFilter>, WorkerInputs)>,
    scorers: Vec<(Box<dyn WorkerScorer>, WorkerInputs)>,
    picker: (Box<dyn WorkerPicker>, WorkerInputs),
    required: WorkerInputs,
    /// The first scorer is a shipped one that writes every entry when it
    /// succeeds, so its slice is not pre-filled (see the module docs).
    first_scorer_writes_all: bool,
    /// The host may run the filters and scorers outside selections
    /// (warm-ups, explain's cost pass): see
    /// [`WorkerSelectionPolicy::allow_side_passes`].
    side_passes: bool,
    rows: Vec<u32>,
    compacted: CandidateTable,
    /// Second buffer for compacting an already compacted table.
    spare: CandidateTable,
    flags: Vec<bool>,
    positions: Vec<u32>,
    totals: Vec<f64>,
    contribution: Vec<f64>,
}

impl fmt::Debug for WorkerSelectionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerSelectionPolicy")
            .field("worker_type", &self.worker_type)
            .field("filters", &self.filters.len())
            .field("scorers", &self.scorers.len())
            .field("required_worker_inputs", &self.required)
            .finish_non_exhaustive()
    }
}

impl WorkerSelectionPolicy {
    /// A policy without filters.
    pub fn new(
        config: RouterConfig,
        worker_type: &'static str,
        scorers: Vec<Box<dyn WorkerScorer>>,
        picker: Box<dyn WorkerPicker>,
    ) -> Self {
        Self::new_with_filters(config, worker_type, Vec::new(), scorers, picker)
    }

    /// A policy whose filters run, in this order, before scoring.
    pub fn new_with_filters(
        config: RouterConfig,
        worker_type: &'static str,
        filters: Vec<Box<dyn WorkerFilter>>,
        scorers: Vec<Box<dyn WorkerScorer>>,
        picker: Box<dyn WorkerPicker>,
    ) -> Self {
        let filters: Vec<_> = filters
            .into_iter()
            .map(|f| {
                let inputs = f.required_worker_inputs();
                (f, inputs)
            })
            .collect();
        let scorers: Vec<_> = scorers
            .into_iter()
            .map(|s| {
                let inputs = s.required_worker_inputs();
                (s, inputs)
            })
            .collect();
        let picker_inputs = picker.required_worker_inputs();
        let mut required = picker_inputs;
        for (_, i) in &filters {
            required |= *i;
        }
        for (_, i) in &scorers {
            required |= *i;
        }
        WorkerSelectionPolicy {
            config,
            worker_type,
            filters,
            scorers,
            picker: (picker, picker_inputs),
            required,
            first_scorer_writes_all: false,
            side_passes: false,
            rows: Vec::new(),
            compacted: CandidateTable::new(),
            spare: CandidateTable::new(),
            flags: Vec::new(),
            positions: Vec::new(),
            totals: Vec::new(),
            contribution: Vec::new(),
        }
    }

    /// Marks the first scorer as one of this crate's that writes every
    /// entry of its slice whenever it returns `Ok` (a test for each of its
    /// loops shows it does), so the executor skips the NaN pre-fill.
    pub(crate) fn first_scorer_writes_all(mut self) -> Self {
        self.first_scorer_writes_all = true;
        self
    }

    /// Lets the host call this policy's filters and scorers outside
    /// selections: to keep their code and data in the CPU's caches while
    /// no request comes ([`WorkerSelectionPolicy::warm`]), and to show each
    /// candidate's cost when a select is explained. Off unless a policy
    /// says so, because the plugin API promises a filter or scorer a call
    /// per selection and no other: a policy whose components keep state
    /// across calls would otherwise see calls for requests that never
    /// came. The shipped types allow it (their filters and scorers keep
    /// no state, and their pickers put back what a warm-up changed).
    pub fn allow_side_passes(mut self) -> Self {
        self.side_passes = true;
        self
    }

    /// Whether [`WorkerSelectionPolicy::allow_side_passes`] was given.
    pub fn side_passes(&self) -> bool {
        self.side_passes
    }

    /// The union of every component's declaration: the groups the host must
    /// compute for this policy (and need not compute otherwise).
    pub fn required_worker_inputs(&self) -> WorkerInputs {
        self.required
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn worker_type(&self) -> &'static str {
        self.worker_type
    }

    /// Runs filter -> score -> pick over `table`.
    pub fn select(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        table: &CandidateTable,
    ) -> Result<Selection, WorkerSelectionPolicyError> {
        if context.block_size() == 0 {
            return Err(SelectionErrorKind::InvalidContext("block_size must be positive").into());
        }
        if table.is_empty() {
            return Err(SelectionErrorKind::NoCandidates.into());
        }
        if let Some(worker) = context.pinned_worker() {
            // The exact-target path: no filters, scorers or picker.
            return match table.position(worker) {
                Some(row) => Ok(Selection {
                    worker,
                    row,
                    cost: f64::NAN,
                    candidates: 1,
                }),
                None => Err(SelectionErrorKind::PinnedUnavailable { worker }.into()),
            };
        }
        let (filtered, range) = self.score_all(context, table)?;
        let view: &CandidateTable = if filtered { &self.compacted } else { table };
        let n = view.len();
        let totals = &self.totals;
        let (picker, grant) = &mut self.picker;
        let row = picker.pick(context, WorkerInputView::new(view, totals, range, *grant))?;
        if row >= n {
            return Err(SelectionErrorKind::RowOutOfRange { row, len: n }.into());
        }
        let table_row = if filtered {
            self.rows[row] as usize
        } else {
            row
        };
        Ok(Selection {
            worker: view.worker(row),
            row: table_row,
            cost: totals[row],
            candidates: n,
        })
    }

    /// Runs filter -> score -> the picker's [`WorkerPicker::warm`] over
    /// `table`, as `select` would, and changes nothing a later `select`
    /// returns: for keeping the selection's code and buffers in the CPU's
    /// caches while no request comes. A context `select` would refuse, or a
    /// failing filter or scorer, ends it early; it returns nothing. Does
    /// nothing unless the policy allows side passes.
    pub fn warm(&mut self, context: &WorkerSelectionContext<'_>, table: &CandidateTable) {
        if !self.side_passes
            || context.block_size() == 0
            || table.is_empty()
            || context.pinned_worker().is_some()
        {
            return;
        }
        let Ok((filtered, range)) = self.score_all(context, table) else {
            return;
        };
        let view: &CandidateTable = if filtered { &self.compacted } else { table };
        let (picker, grant) = &mut self.picker;
        picker.warm(
            context,
            WorkerInputView::new(view, &self.totals, range, *grant),
        );
    }

    /// Runs the filters and scorers (not the picker). Returns whether rows
    /// were filtered out (survivors in `self.compacted`, their table rows in
    /// `self.rows`) and the totals' range; the totals are in `self.totals`.
    /// Inlined into each caller: as one shared function it made `select`
    /// at 32 workers 3-5 % slower. A warm-up therefore runs its own copy
    /// of this code, over the same data.
    #[inline(always)]
    fn score_all(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        table: &CandidateTable,
    ) -> Result<(bool, (f64, f64)), WorkerSelectionPolicyError> {
        let missing = self.required.difference(table.present());
        if !missing.is_empty() {
            return Err(SelectionErrorKind::MissingInputs { missing }.into());
        }

        // Most policies have no filter: no call for them.
        let filtered = !self.filters.is_empty() && self.run_filters(context, table)?;
        let view: &CandidateTable = if filtered { &self.compacted } else { table };
        let n = view.len();

        let totals = &mut self.totals;
        // Grows or shrinks; what is left from the last selection is
        // overwritten below (NaN for a scorer not known to write every row).
        totals.resize(n, f64::NAN);
        // The totals' range, found by the same pass that checks them and
        // handed to the picker (most pickers need the minimum anyway).
        let Some(((first, grant), rest)) = self.scorers.split_first_mut() else {
            totals.fill(0.0);
            return Ok((filtered, (0.0, 0.0)));
        };
        if !self.first_scorer_writes_all {
            totals.fill(f64::NAN);
        }
        first.score(context, WorkerCandidates::new(view, *grant), totals)?;
        let mut range = checked_range(totals, |row, value| SelectionErrorKind::InvalidCost {
            scorer_index: 0,
            row,
            value,
        })?;
        for (i, (scorer, grant)) in rest.iter_mut().enumerate() {
            let scorer_index = i + 1;
            let contribution = &mut self.contribution;
            contribution.clear();
            contribution.resize(n, f64::NAN);
            scorer.score(context, WorkerCandidates::new(view, *grant), contribution)?;
            checked_range(contribution, |row, value| SelectionErrorKind::InvalidCost {
                scorer_index,
                row,
                value,
            })?;
            for (t, c) in totals.iter_mut().zip(contribution.iter()) {
                *t += *c;
            }
            range = checked_range(totals, |row, value| SelectionErrorKind::NonFiniteTotal {
                scorer_index,
                row,
                value,
            })?;
        }
        Ok((filtered, range))
    }

    /// The total cost of every row of `table` under this policy's filters
    /// and scorers, without picking: `out[row]` is NaN for a row a filter
    /// removed (all NaN when every row was removed). Lets another stage (the
    /// rule language's `minimize: { policy: NAME }`) rank by this policy.
    pub fn costs_into(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        table: &CandidateTable,
        out: &mut Vec<f64>,
    ) -> Result<(), WorkerSelectionPolicyError> {
        out.clear();
        out.resize(table.len(), f64::NAN);
        if context.block_size() == 0 {
            return Err(SelectionErrorKind::InvalidContext("block_size must be positive").into());
        }
        if table.is_empty() {
            return Ok(());
        }
        let (filtered, _) = match self.score_all(context, table) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), SelectionErrorKind::AllRejected { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        if filtered {
            for (i, &row) in self.rows.iter().enumerate() {
                out[row as usize] = self.totals[i];
            }
        } else {
            out.copy_from_slice(&self.totals);
        }
        Ok(())
    }

    /// Runs the filters in declaration order, each over the survivors of
    /// the previous one. Returns whether any row was removed, in which case
    /// the survivors are in `self.compacted` and their table rows in
    /// `self.rows`. A filter that keeps everything costs its `keep_many` call
    /// and a count, nothing else.
    #[inline]
    fn run_filters(
        &mut self,
        context: &WorkerSelectionContext<'_>,
        table: &CandidateTable,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        let mut compacted = false;
        for (index, (filter, grant)) in self.filters.iter_mut().enumerate() {
            let view: &CandidateTable = if compacted { &self.compacted } else { table };
            let n = view.len();
            self.flags.clear();
            self.flags.resize(n, false);
            filter.keep_many(
                context,
                WorkerCandidates::new(view, *grant),
                &mut self.flags,
            )?;
            let kept = self.flags.iter().filter(|&&k| k).count();
            if kept == 0 {
                return Err(SelectionErrorKind::AllRejected {
                    filter_index: index,
                }
                .into());
            }
            if kept == n {
                continue;
            }
            self.positions.clear();
            self.positions.extend(
                self.flags
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| **k)
                    .map(|(i, _)| i as u32),
            );
            if compacted {
                // Survivors of survivors: map back to table rows, and compact
                // through the spare buffer.
                for (slot, &p) in self.positions.iter().enumerate() {
                    self.rows[slot] = self.rows[p as usize];
                }
                self.rows.truncate(self.positions.len());
                self.spare.gather(&self.compacted, &self.positions);
                std::mem::swap(&mut self.compacted, &mut self.spare);
            } else {
                self.rows.clear();
                self.rows.extend_from_slice(&self.positions);
                self.compacted.gather(table, &self.positions);
                compacted = true;
            }
        }
        Ok(compacted)
    }
}

/// The range of `values`, or the error `bad` makes of the first row that
/// is NaN or infinite.
#[inline(always)]
fn checked_range(
    values: &[f64],
    bad: impl FnOnce(usize, f64) -> SelectionErrorKind,
) -> Result<(f64, f64), WorkerSelectionPolicyError> {
    match finite_range(values) {
        Some(range) => Ok(range),
        None => Err(first_bad(values, bad)),
    }
}

#[cold]
#[inline(never)]
fn first_bad(
    values: &[f64],
    bad: impl FnOnce(usize, f64) -> SelectionErrorKind,
) -> WorkerSelectionPolicyError {
    let row = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
    bad(row, values[row]).into()
}

/// `Some((min, max))` when no entry is NaN or infinite. One pass in
/// independent lanes of pure float work, so it vectorises even on baseline
/// x86-64 (which has no packed 64-bit integer compare) and no lane waits on
/// another. The range is compare-and-select; the check is a sum, which is
/// finite when every entry is (NaN and the infinities carry through `+`).
/// Only a sum that overflowed, or a bad entry, takes a second, exact look.
/// The rows after the last whole chunk need no loop of their own: the last
/// `LANES` rows are one more chunk, overlapping rows already seen (a row
/// seen twice changes neither the range nor the verdict). An empty slice
/// gives (0, 0).
#[inline]
pub(crate) fn finite_range(values: &[f64]) -> Option<(f64, f64)> {
    const LANES: usize = 4;
    let n = values.len();
    let Some(&first) = values.first() else {
        return Some((0.0, 0.0));
    };
    let (mut sum, mut lo, mut hi) = ([0.0f64; LANES], [first; LANES], [first; LANES]);
    let mut step = |q: &[f64; LANES]| {
        for k in 0..LANES {
            let v = q[k];
            sum[k] += v;
            // Written so that the lane is the instruction's destination
            // (`minpd`/`maxpd` overwrite their first operand): no copies.
            lo[k] = if lo[k] < v { lo[k] } else { v };
            hi[k] = if hi[k] > v { hi[k] } else { v };
        }
    };
    match values.last_chunk::<LANES>() {
        Some(last) => {
            for q in values[..n - 1].as_chunks::<LANES>().0 {
                step(q);
            }
            step(last);
        }
        // Fewer rows than lanes: the first row fills the lanes it lacks.
        None => {
            let mut q = [first; LANES];
            q[..n].copy_from_slice(values);
            step(&q);
        }
    }
    let total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    if !total.is_finite() && !values.iter().all(|v| v.is_finite()) {
        return None;
    }
    let min = |a: f64, b: f64| if b < a { b } else { a };
    let max = |a: f64, b: f64| if b > a { b } else { a };
    Some((
        min(min(lo[0], lo[2]), min(lo[1], lo[3])),
        max(max(hi[0], hi[2]), max(hi[1], hi[3])),
    ))
}

#[cfg(test)]
mod tests {
    use super::finite_range;

    #[test]
    fn finite_range_finds_the_range_and_every_bad_row_at_every_length() {
        for n in 0..40usize {
            let values: Vec<f64> = (0..n).map(|i| ((i * 37) % 23) as f64 - 7.5).collect();
            let expected = if n == 0 {
                (0.0, 0.0)
            } else {
                let min = values.iter().copied().fold(f64::INFINITY, f64::min);
                let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                (min, max)
            };
            assert_eq!(finite_range(&values), Some(expected), "n={n}");
            // A bad value in any row, in the lanes or after them, is seen.
            for row in 0..n {
                for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                    let mut v = values.clone();
                    v[row] = bad;
                    assert_eq!(finite_range(&v), None, "n={n} row={row} value={bad}");
                }
            }
            // Finite entries whose sum overflows (to an infinity, or to NaN
            // once both signs overflow) are still finite entries.
            let huge: Vec<f64> = (0..n)
                .map(|i| match i % 3 {
                    0 => f64::MAX,
                    1 => -f64::MAX,
                    _ => f64::MAX / 2.0,
                })
                .collect();
            let expected = match n {
                0 => (0.0, 0.0),
                1 => (f64::MAX, f64::MAX),
                _ => (-f64::MAX, f64::MAX),
            };
            assert_eq!(finite_range(&huge), Some(expected), "n={n} huge");
            for row in 0..n {
                let mut v = huge.clone();
                v[row] = f64::NAN;
                assert_eq!(finite_range(&v), None, "n={n} huge, NaN in row {row}");
            }
        }
    }
}
