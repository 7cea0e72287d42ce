//! Session affinity (hard and soft, TTL, bounds, failure keeps the binding)
//! and the request classifier.

#![forbid(unsafe_code)]

mod common;

use std::borrow::Cow;

use common::*;
use kvedge_policies::affinity::{MAX_SESSION_ID_BYTES, SessionIdError};
use kvedge_policies::plugins::request_classifier::*;
use kvedge_policies::{
    AffinityMode, AffinityTarget, InputTrigger, SelectionErrorKind, SessionAffinityTable,
    SessionContext, WorkerSelectionContext, WorkerWithDpRank,
};
use kvedge_shm::testing::{FAULT_ALLOWANCE, minor_faults};

fn ctx_for(session: &str, now: u64) -> WorkerSelectionContext<'_> {
    WorkerSelectionContext::new("r", 64, 16)
        .with_session(SessionContext::new(session, InputTrigger::UserMessage))
        .with_now_ms(now)
}

const A: WorkerWithDpRank = WorkerWithDpRank::new(1, 0);
const B: WorkerWithDpRank = WorkerWithDpRank::new(2, 0);

#[test]
fn hard_mode_turns_a_binding_into_an_exact_target() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 1000, 16);
    t.bind("s", B, 0).unwrap();
    let c = t.apply(ctx_for("s", 10)).unwrap();
    assert_eq!(c.pinned_worker(), Some(B));
    assert_eq!(c.affinity_target(), None);
    // The policy would pick A (idle), but the exact-target path wins.
    let mut p = policy("dynamo-default-cost-fn", "{}");
    let s = p
        .select(&c, &table(&[w(1), w(2).active(50).decode(500)]))
        .unwrap();
    assert_eq!(s.worker, B);
}

#[test]
fn soft_mode_passes_the_binding_as_advice() {
    let mut t = SessionAffinityTable::new(AffinityMode::Soft, 1000, 16);
    t.bind("s", B, 0).unwrap();
    let c = t.apply(ctx_for("s", 10)).unwrap();
    assert_eq!(c.pinned_worker(), None);
    assert_eq!(c.affinity_target(), Some(AffinityTarget::from(B)));
}

#[test]
fn explicit_targets_and_sessionless_requests_are_left_alone() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 1000, 16);
    t.bind("s", B, 0).unwrap();
    let c = t.apply(ctx_for("s", 10).with_pinned_worker(A)).unwrap();
    assert_eq!(c.pinned_worker(), Some(A));
    let c = t.apply(WorkerSelectionContext::new("r", 64, 16)).unwrap();
    assert_eq!(c.pinned_worker(), None);
}

#[test]
fn bindings_expire_after_the_ttl_and_rebinding_refreshes_it() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 100, 16);
    t.bind("s", A, 0).unwrap();
    assert_eq!(t.lookup("s", 99).unwrap(), Some(A));
    t.bind("s", B, 90).unwrap();
    assert_eq!(t.lookup("s", 150).unwrap(), Some(B), "refreshed at 90");
    assert_eq!(t.lookup("s", 190).unwrap(), None);
    assert!(t.is_empty(), "an expired binding is dropped on lookup");
}

#[test]
fn a_failed_selection_leaves_the_previous_binding_intact() {
    let mut t = SessionAffinityTable::new(AffinityMode::Soft, 1000, 16);
    t.bind("s", A, 0).unwrap();
    let mut p = policy("least-busy", "{min_device_overlap_blocks: 5}");
    let c = t.apply(ctx_for("s", 1)).unwrap();
    let r = p.select(&c, &table(&[w(1), w(2)]));
    assert!(matches!(
        r.map_err(|e| e.into_kind()),
        Err(SelectionErrorKind::AllRejected { .. })
    ));
    // The host binds only after a successful dispatch, so nothing changed.
    assert_eq!(t.lookup("s", 2).unwrap(), Some(A));
}

#[test]
fn a_full_table_evicts_expired_bindings_first_then_the_closest_to_expiry() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 100, 3);
    t.bind("old", A, 0).unwrap();
    t.bind("mid", A, 50).unwrap();
    t.bind("new", A, 90).unwrap();
    t.bind("fresh", B, 120).unwrap(); // "old" expired at 100
    assert_eq!(t.len(), 3);
    assert_eq!(t.lookup("old", 120).unwrap(), None);
    t.bind("fresher", B, 130).unwrap(); // none expired: "mid" (expires 150) goes
    assert_eq!(t.lookup("mid", 130).unwrap(), None);
    assert_eq!(t.lookup("new", 130).unwrap(), Some(A));
    assert_eq!(t.lookup("fresh", 130).unwrap(), Some(B));
    assert_eq!(t.len(), 3);
}

#[test]
fn session_ids_are_bounded_and_non_empty() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 100, 3);
    let long = "x".repeat(MAX_SESSION_ID_BYTES + 1);
    assert_eq!(
        t.bind(&long, A, 0),
        Err(SessionIdError::TooLong {
            len: MAX_SESSION_ID_BYTES + 1
        })
    );
    assert_eq!(t.lookup("", 0), Err(SessionIdError::Empty));
    assert!(t.bind(&"x".repeat(MAX_SESSION_ID_BYTES), A, 0).is_ok());
    assert_eq!(t.len(), 1);
    assert_eq!(
        SessionAffinityTable::new(AffinityMode::Hard, 1, usize::MAX).len(),
        0,
        "capacity is clamped, not allocated as asked"
    );
}

#[test]
fn final_turns_and_departed_workers_drop_bindings() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 100, 8);
    t.bind("a", A, 0).unwrap();
    t.bind("b", B, 0).unwrap();
    t.bind("c", B, 0).unwrap();
    assert!(t.end("a").unwrap());
    assert!(!t.end("a").unwrap());
    assert_eq!(t.forget_worker(2), 2);
    assert!(t.is_empty());
    t.bind("d", A, 0).unwrap();
    assert_eq!(t.expire(99), 0);
    assert_eq!(t.expire(100), 1);
}

/// Defers requests whose prefix is not tracked yet, rejects long ones.
struct PrefixGate;
impl RequestClassifier for PrefixGate {
    fn classify(&mut self, request: &ClassifyRequest<'_>) -> Classification {
        match request.sequence_hashes() {
            None => Classification::Defer { retry_after_ms: 5 },
            Some([]) => Classification::AdmitWithPriority(-1),
            Some(h) if h.len() > 4 => Classification::Reject {
                reason: Cow::Borrowed("too many blocks"),
            },
            Some(_) => Classification::Admit,
        }
    }
}

#[test]
fn classifiers_see_the_borrowed_hash_snapshot() {
    let hashes = [1u64, 2, 3, 4, 5];
    let base = ClassifyRequest {
        request_id: "r",
        prompt_tokens: 80,
        block_size: 16,
        priority: 0,
        sequence_hashes: None,
        session: None,
        agent_headers: None,
        now_ms: 0,
    };
    let mut c = PrefixGate;
    assert_eq!(
        c.classify(&base),
        Classification::Defer { retry_after_ms: 5 }
    );
    let empty = ClassifyRequest {
        sequence_hashes: Some(&[]),
        ..base
    };
    assert_eq!(c.classify(&empty), Classification::AdmitWithPriority(-1));
    let five = ClassifyRequest {
        sequence_hashes: Some(&hashes),
        ..base
    };
    assert!(matches!(c.classify(&five), Classification::Reject { .. }));
    let four = ClassifyRequest {
        sequence_hashes: Some(&hashes[..4]),
        ..base
    };
    assert_eq!(c.classify(&four), Classification::Admit);
    let mut limit = PromptLimitClassifier {
        max_prompt_tokens: 64,
    };
    assert!(matches!(
        limit.classify(&base),
        Classification::Reject { .. }
    ));
}

/// What a session table should hold, kept the slow, obvious way: every
/// binding with its expiry. Dropped only when a lookup finds it expired, a
/// final turn ends it or its worker leaves.
#[derive(Default)]
struct Model {
    bindings: Vec<(String, WorkerWithDpRank, u64)>,
}

impl Model {
    fn find(&self, id: &str) -> Option<usize> {
        self.bindings.iter().position(|b| b.0 == id)
    }

    fn lookup(&mut self, id: &str, now: u64) -> Option<WorkerWithDpRank> {
        let i = self.find(id)?;
        if self.bindings[i].2 > now {
            return Some(self.bindings[i].1);
        }
        self.bindings.remove(i);
        None
    }

    fn bind(&mut self, id: &str, w: WorkerWithDpRank, expires: u64) {
        match self.find(id) {
            Some(i) => self.bindings[i] = (id.to_owned(), w, expires),
            None => self.bindings.push((id.to_owned(), w, expires)),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Bind(u8, u8),
    Lookup(u8),
    End(u8),
    ForgetWorker(u8),
    Wait(u8),
}

/// Operations over 24 session ids and 3 workers.
const IDS: u8 = 24;

fn any_op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        8 => (0..IDS, 0u8..3).prop_map(|(s, w)| Op::Bind(s, w)),
        3 => (0..IDS).prop_map(Op::Lookup),
        1 => (0..IDS).prop_map(Op::End),
        1 => (0u8..3).prop_map(Op::ForgetWorker),
        2 => (0u8..40).prop_map(Op::Wait),
    ]
}

fn worker(w: u8) -> WorkerWithDpRank {
    WorkerWithDpRank::new(u64::from(w) + 1, 0)
}

proptest::proptest! {
    /// With room for every session, whatever the binds, lookups, final
    /// turns, departed workers and time do (and however the table moves
    /// its bind order), the table answers as the model does. It may drop
    /// an expired binding before a lookup finds it, never a live one.
    #[test]
    fn with_room_for_all_the_table_agrees_with_a_model(
        capacity in usize::from(IDS)..40,
        ttl in 1u64..200,
        ops in proptest::collection::vec(any_op(), 1..600),
    ) {
        let mut t = SessionAffinityTable::new(AffinityMode::Hard, ttl, capacity);
        let mut m = Model::default();
        let mut now = 0;
        for op in ops {
            match op {
                Op::Bind(s, w) => {
                    let id = format!("s{s}");
                    t.bind(&id, worker(w), now).unwrap();
                    m.bind(&id, worker(w), now + ttl);
                }
                Op::Lookup(s) => {
                    let id = format!("s{s}");
                    proptest::prop_assert_eq!(t.lookup(&id, now).unwrap(), m.lookup(&id, now));
                }
                Op::End(s) => {
                    let id = format!("s{s}");
                    let was = m.find(&id).map(|i| m.bindings.remove(i));
                    let ended = t.end(&id).unwrap();
                    match was {
                        Some((_, _, expires)) if expires > now => proptest::prop_assert!(ended),
                        Some(_) => {}
                        None => proptest::prop_assert!(!ended),
                    }
                }
                Op::ForgetWorker(w) => {
                    let live = m.bindings.iter().filter(|b| b.1 == worker(w) && b.2 > now).count();
                    let all = m.bindings.iter().filter(|b| b.1 == worker(w)).count();
                    m.bindings.retain(|b| b.1 != worker(w));
                    let forgot = t.forget_worker(worker(w).worker_id);
                    proptest::prop_assert!((live..=all).contains(&forgot), "{} not in {}..={}", forgot, live, all);
                }
                Op::Wait(ms) => now += u64::from(ms),
            }
            proptest::prop_assert!(t.len() <= m.bindings.len());
        }
        for s in 0..IDS {
            let id = format!("s{s}");
            proptest::prop_assert_eq!(t.lookup(&id, now).unwrap(), m.lookup(&id, now));
        }
        proptest::prop_assert_eq!(t.len(), m.bindings.len());
    }

    /// A table too small for its sessions stays within its capacity, keeps
    /// the session just bound, and answers only with a session's last
    /// binding while it is live.
    #[test]
    fn a_small_table_stays_bounded_and_answers_only_live_bindings(
        capacity in 1usize..8,
        ttl in 1u64..200,
        ops in proptest::collection::vec(any_op(), 1..600),
    ) {
        let mut t = SessionAffinityTable::new(AffinityMode::Hard, ttl, capacity);
        let mut last: Vec<Option<(WorkerWithDpRank, u64)>> = vec![None; usize::from(IDS)];
        let mut now = 0;
        for op in ops {
            match op {
                Op::Bind(s, w) => {
                    let id = format!("s{s}");
                    t.bind(&id, worker(w), now).unwrap();
                    last[usize::from(s)] = Some((worker(w), now + ttl));
                    proptest::prop_assert_eq!(t.lookup(&id, now).unwrap(), Some(worker(w)));
                }
                Op::Lookup(s) => {
                    if let Some(w) = t.lookup(&format!("s{s}"), now).unwrap() {
                        let (bound, expires) = last[usize::from(s)].expect("bound before");
                        proptest::prop_assert_eq!(w, bound);
                        proptest::prop_assert!(expires > now);
                    }
                }
                Op::End(s) => {
                    t.end(&format!("s{s}")).unwrap();
                    last[usize::from(s)] = None;
                }
                Op::ForgetWorker(w) => {
                    t.forget_worker(worker(w).worker_id);
                    for l in &mut last {
                        if l.is_some_and(|(b, _)| b == worker(w)) {
                            *l = None;
                        }
                    }
                }
                Op::Wait(ms) => now += u64::from(ms),
            }
            proptest::prop_assert!(t.len() <= capacity);
        }
    }
}

#[test]
fn a_full_table_of_live_sessions_drops_the_one_bound_longest_ago() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 1_000, 3);
    t.bind("a", A, 0).unwrap();
    t.bind("b", A, 1).unwrap();
    t.bind("c", A, 2).unwrap();
    t.bind("a", B, 3).unwrap(); // refreshed: "b" is now the oldest
    t.bind("d", B, 4).unwrap();
    assert_eq!(t.lookup("b", 5).unwrap(), None);
    assert_eq!(t.lookup("a", 5).unwrap(), Some(B));
    assert_eq!(t.lookup("c", 5).unwrap(), Some(A));
    assert_eq!(t.lookup("d", 5).unwrap(), Some(B));
}

#[test]
fn a_reload_to_a_smaller_capacity_keeps_the_bindings_refreshed_last() {
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 1_000, 4);
    for (now, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
        t.bind(id, A, now as u64).unwrap();
    }
    t.bind("a", B, 4).unwrap();
    t.reconfigure(AffinityMode::Soft, 1_000, 2);
    assert_eq!(t.len(), 2);
    assert_eq!(t.lookup("a", 5).unwrap(), Some(B));
    assert_eq!(t.lookup("d", 5).unwrap(), Some(A));
    assert_eq!(t.lookup("b", 5).unwrap(), None);
    assert_eq!(t.lookup("c", 5).unwrap(), None);
    t.reconfigure(AffinityMode::Soft, 1_000, 8);
    for id in ["e", "f", "g", "h", "i", "j"] {
        t.bind(id, A, 6).unwrap();
    }
    assert_eq!(t.len(), 8, "grown back");
    assert_eq!(t.lookup("a", 7).unwrap(), Some(B));
}

#[test]
fn binding_new_sessions_takes_no_page_fault() {
    // The default capacity: its map is 10 MiB, and before its memory was
    // written when the table was made, about 1,400 of these 2,000 binds
    // took a page fault.
    let ids: Vec<String> = (0..2_000).map(|i| format!("session-{i}")).collect();
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 60_000, 65_536);
    // The bind's code and stack, touched once.
    t.bind("warm-up", A, 0).unwrap();
    let before = minor_faults();
    for id in &ids {
        t.bind(id, A, 1).unwrap();
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in 2,000 binds"
    );
    assert_eq!(t.len(), 2_001);

    // A reload to a larger capacity writes the larger table's memory too,
    // and keeps the bindings.
    let mut t = SessionAffinityTable::new(AffinityMode::Hard, 60_000, 1_024);
    t.bind("warm-up", A, 0).unwrap();
    t.reconfigure(AffinityMode::Hard, 60_000, 65_536);
    let before = minor_faults();
    for id in &ids {
        t.bind(id, B, 2).unwrap();
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in 2,000 binds after a reload"
    );
    assert_eq!(t.lookup("warm-up", 3).unwrap(), Some(A));
    assert_eq!(t.len(), 2_001);
}
