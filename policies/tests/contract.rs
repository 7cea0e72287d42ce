//! The host contract, enforced by the executor: filter order, all-rejected,
//! NaN pre-fill and finite costs and totals, picker range, per-component
//! signal grants, missing inputs, the exact-target path, and indifference to
//! candidate order.

#![forbid(unsafe_code)]

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use kvedge_policies::plugins::worker_selection::*;
use kvedge_policies::view::WorkerCandidates;

struct Recorder {
    name: &'static str,
    log: Arc<Mutex<Vec<&'static str>>>,
    reject_id: Option<u64>,
}

impl WorkerFilter for Recorder {
    fn keep(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        self.log.lock().unwrap().push(self.name);
        Ok(Some(candidate.worker().worker_id) != self.reject_id)
    }
}

struct Constant(f64);
impl WorkerScorer for Constant {
    fn score(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        _cands: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        costs.fill(self.0);
        Ok(())
    }
}

/// Writes every row but the last (which stays NaN), from its `from`th
/// call on (counting from 1); every row before that.
struct LeavesLastUnwritten {
    from: usize,
    calls: usize,
}

impl LeavesLastUnwritten {
    fn from_call(from: usize) -> Self {
        LeavesLastUnwritten { from, calls: 0 }
    }
}

impl WorkerScorer for LeavesLastUnwritten {
    fn score(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        _cands: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        self.calls += 1;
        assert!(
            costs.iter().all(|c| c.is_nan()),
            "slice arrives pre-filled with NaN on call {}",
            self.calls
        );
        let n = costs.len();
        let written = if self.calls < self.from { n } else { n - 1 };
        costs[..written].fill(1.0);
        Ok(())
    }
}

struct FixedRow(usize);
impl WorkerPicker for FixedRow {
    fn pick(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        _i: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        Ok(self.0)
    }
}

struct Lowest;
impl WorkerPicker for Lowest {
    fn pick(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        input: WorkerInputView<'_>,
    ) -> Result<usize, WorkerSelectionPolicyError> {
        Ok(input
            .costs()
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0)
    }
}

fn ctx() -> WorkerSelectionContext<'static> {
    WorkerSelectionContext::new("req", 160, 16)
}

fn three() -> kvedge_policies::CandidateTable {
    table(&[w(1), w(2), w(3)])
}

#[test]
fn filters_run_in_declaration_order_and_later_ones_see_survivors() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let f = |name, reject_id| -> Box<dyn WorkerFilter> {
        Box::new(Recorder {
            name,
            log: log.clone(),
            reject_id,
        })
    };
    let mut p = WorkerSelectionPolicy::new_with_filters(
        RouterConfig::default(),
        "aggregated",
        vec![f("first", Some(2)), f("second", None)],
        vec![],
        Box::new(FixedRow(1)),
    );
    let s = p.select(&ctx(), &three()).unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        ["first", "first", "first", "second", "second"]
    );
    assert_eq!(s.candidates, 2);
    assert_eq!(s.worker.worker_id, 3, "row 1 of the survivors [1, 3]");
    assert_eq!(s.row, 2, "mapped back to the host's row");
}

#[test]
fn rejecting_every_worker_is_an_error_naming_the_filter() {
    struct None_;
    impl WorkerFilter for None_ {
        fn keep(
            &mut self,
            _c: &WorkerSelectionContext<'_>,
            _w: WorkerCandidate<'_>,
        ) -> Result<bool, WorkerSelectionPolicyError> {
            Ok(false)
        }
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut p = WorkerSelectionPolicy::new_with_filters(
        RouterConfig::default(),
        "aggregated",
        vec![
            Box::new(Recorder {
                name: "a",
                log,
                reject_id: None,
            }),
            Box::new(None_),
        ],
        vec![],
        Box::new(FixedRow(0)),
    );
    assert_eq!(
        p.select(&ctx(), &three()).map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::AllRejected { filter_index: 1 })
    );
}

#[test]
fn unwritten_cost_is_refused_before_picking() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![
            Box::new(Constant(0.0)),
            Box::new(LeavesLastUnwritten::from_call(1)),
        ],
        Box::new(FixedRow(0)),
    );
    match p.select(&ctx(), &three()).map_err(|e| e.into_kind()) {
        Err(SelectionErrorKind::InvalidCost {
            scorer_index: 1,
            row: 2,
            value,
        }) => assert!(value.is_nan()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_first_scorer_never_sees_the_last_selections_costs() {
    // The totals' buffer is kept between selections; a plugin as the first
    // scorer still gets NaN, so a row it skips is refused, not stale.
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(LeavesLastUnwritten::from_call(2))],
        Box::new(FixedRow(0)),
    );
    assert!(p.select(&ctx(), &three()).is_ok());
    match p.select(&ctx(), &three()).map_err(|e| e.into_kind()) {
        Err(SelectionErrorKind::InvalidCost {
            scorer_index: 0,
            row: 2,
            value,
        }) => assert!(value.is_nan()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn non_finite_contribution_and_total_are_refused() {
    for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        let mut p = WorkerSelectionPolicy::new(
            RouterConfig::default(),
            "aggregated",
            vec![Box::new(Constant(bad))],
            Box::new(FixedRow(0)),
        );
        assert!(matches!(
            p.select(&ctx(), &three()).map_err(|e| e.into_kind()),
            Err(SelectionErrorKind::InvalidCost {
                scorer_index: 0,
                row: 0,
                ..
            })
        ));
    }
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(Constant(f64::MAX)), Box::new(Constant(f64::MAX))],
        Box::new(FixedRow(0)),
    );
    assert!(matches!(
        p.select(&ctx(), &three()).map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::NonFiniteTotal {
            scorer_index: 1,
            row: 0,
            ..
        })
    ));
}

#[test]
fn costs_of_scorers_add_up() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(Constant(1.5)), Box::new(Constant(2.0))],
        Box::new(FixedRow(2)),
    );
    assert_eq!(p.select(&ctx(), &three()).unwrap().cost, 3.5);
    let mut none = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![],
        Box::new(FixedRow(0)),
    );
    assert_eq!(none.select(&ctx(), &three()).unwrap().cost, 0.0);
}

#[test]
fn picker_row_is_range_checked() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![],
        Box::new(FixedRow(3)),
    );
    assert_eq!(
        p.select(&ctx(), &three()).map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::RowOutOfRange { row: 3, len: 3 })
    );
}

/// Declares nothing, then checks it sees nothing.
struct Undeclared;
impl WorkerScorer for Undeclared {
    fn score(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        cands: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (c, cost) in cands.iter().zip(costs) {
            assert!(c.cache().is_none() && c.load().is_none() && c.occupancy().is_none());
            assert!(c.preferred_taint_multiplier().is_none());
            *cost = 0.0;
        }
        assert!(cands.load_columns().is_none() && cands.cache_columns().is_none());
        Ok(())
    }
}

/// Declares CACHE and reads it.
struct CacheReader;
impl WorkerScorer for CacheReader {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE | WorkerInputs::PREFERRED_TAINT
    }
    fn score(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        cands: WorkerCandidates<'_>,
        costs: &mut [f64],
    ) -> Result<(), WorkerSelectionPolicyError> {
        for (c, cost) in cands.iter().zip(costs) {
            assert!(c.load().is_none(), "LOAD was not declared by this scorer");
            *cost = -c.cache().unwrap().device_overlap_blocks()
                * c.preferred_taint_multiplier().unwrap_or(1.0);
        }
        Ok(())
    }
}

#[test]
fn a_component_sees_only_the_groups_it_declared() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(Undeclared), Box::new(CacheReader)],
        Box::new(Lowest),
    );
    assert_eq!(
        p.required_worker_inputs(),
        WorkerInputs::CACHE | WorkerInputs::PREFERRED_TAINT
    );
    let t = table(&[w(1).device(3), w(2).device(4).taint(0.5), w(3).device(1)]);
    let s = p.select(&ctx(), &t).unwrap();
    assert_eq!(s.worker.worker_id, 1, "-3 beats -4 * 0.5 and -1");
}

#[test]
fn a_table_without_a_declared_group_is_refused() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(CacheReader)],
        Box::new(Lowest),
    );
    let mut t = three();
    t.set_present(WorkerInputs::LOAD);
    assert_eq!(
        p.select(&ctx(), &t).map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::MissingInputs {
            missing: WorkerInputs::CACHE | WorkerInputs::PREFERRED_TAINT
        })
    );
}

#[test]
fn pinned_requests_take_the_exact_target_path() {
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![Box::new(Constant(f64::NAN))],
        Box::new(FixedRow(99)),
    );
    let target = WorkerWithDpRank::new(2, 0);
    let s = p
        .select(&ctx().with_pinned_worker(target), &three())
        .unwrap();
    assert_eq!((s.worker, s.row), (target, 1), "no scorer or picker ran");
    let gone = WorkerWithDpRank::new(9, 0);
    assert_eq!(
        p.select(&ctx().with_pinned_worker(gone), &three())
            .map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::PinnedUnavailable { worker: gone })
    );
}

#[test]
fn bad_context_and_empty_table_are_errors() {
    let mut p = policy("dynamo-default-cost-fn", "{}");
    assert!(matches!(
        p.select(&WorkerSelectionContext::new("r", 10, 0), &three())
            .map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::InvalidContext(_))
    ));
    assert_eq!(
        p.select(&ctx(), &table(&[])).map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::NoCandidates)
    );
}

#[test]
fn plugin_failures_pass_through() {
    struct Fails;
    impl WorkerPicker for Fails {
        fn pick(
            &mut self,
            _c: &WorkerSelectionContext<'_>,
            _i: WorkerInputView<'_>,
        ) -> Result<usize, WorkerSelectionPolicyError> {
            Err(WorkerSelectionPolicyError::failed("no good worker"))
        }
    }
    let mut p = WorkerSelectionPolicy::new(
        RouterConfig::default(),
        "aggregated",
        vec![],
        Box::new(Fails),
    );
    let e = p.select(&ctx(), &three()).unwrap_err();
    assert_eq!(e.to_string(), "policy failed: no good worker");
}

#[test]
fn candidate_order_does_not_change_a_deterministic_choice() {
    let rows: Vec<W> = (0..50u64)
        .map(|i| {
            w(i).device((i * 7 % 13) as u32)
                .active((i * 5 % 11) as u32)
                .prefill(i * 3)
                .decode(i % 9)
        })
        .collect();
    let mut p = policy("dynamo-default-cost-fn", "{}");
    let c = WorkerSelectionContext::new("r", 256, 16);
    let expected = p.select(&c, &table(&rows)).unwrap().worker;
    for seed in 1..20 {
        let mut shuffled = rows.clone();
        shuffle(&mut shuffled, seed);
        assert_eq!(p.select(&c, &table(&shuffled)).unwrap().worker, expected);
    }
}

/// A filter that overrides `keep_many` to work on whole columns.
struct ColumnarOverlapFilter;
impl WorkerFilter for ColumnarOverlapFilter {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE
    }
    fn keep(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        candidate: WorkerCandidate<'_>,
    ) -> Result<bool, WorkerSelectionPolicyError> {
        Ok(candidate.cache().unwrap().device_overlap_blocks() > 0.0)
    }
    fn keep_many(
        &mut self,
        _c: &WorkerSelectionContext<'_>,
        candidates: WorkerCandidates<'_>,
        keep: &mut [bool],
    ) -> Result<(), WorkerSelectionPolicyError> {
        let cache = candidates.cache_columns().unwrap();
        for (k, &d) in keep.iter_mut().zip(cache.device_blocks) {
            *k = d > 0;
        }
        Ok(())
    }
}

#[test]
fn chained_filters_compact_twice_and_map_rows_back() {
    // First filter drops worker 2 (per-candidate keep), the columnar one
    // drops the workers without overlap (1 and 4): survivors 3 and 5.
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut p = WorkerSelectionPolicy::new_with_filters(
        RouterConfig::default(),
        "aggregated",
        vec![
            Box::new(Recorder {
                name: "first",
                log,
                reject_id: Some(2),
            }),
            Box::new(ColumnarOverlapFilter),
        ],
        vec![],
        Box::new(FixedRow(1)),
    );
    let t = table(&[w(1), w(2).device(3), w(3).device(1), w(4), w(5).device(2)]);
    let s = p.select(&ctx(), &t).unwrap();
    assert_eq!((s.candidates, s.worker.worker_id, s.row), (2, 5, 4));
    // And again (buffers reused), picking the other survivor.
    let mut q = WorkerSelectionPolicy::new_with_filters(
        RouterConfig::default(),
        "aggregated",
        vec![
            Box::new(ColumnarOverlapFilter),
            Box::new(ColumnarOverlapFilter),
        ],
        vec![],
        Box::new(FixedRow(0)),
    );
    for _ in 0..3 {
        let s = q.select(&ctx(), &t).unwrap();
        assert_eq!((s.candidates, s.worker.worker_id, s.row), (3, 2, 1));
    }
}
