//! The router core, without I/O: the worker registry, the KV index and load
//! table they feed, and `select`, which builds the columnar candidate table
//! for a request's model and role (computing only the signal groups the
//! partition's policy declares), applies session affinity, runs the
//! policy, and reserves the chosen worker.
//!
//! One owner of all routing state: the daemon's event loop calls
//! [`Router::apply`] for ring events and [`Router::select`] for queries, so
//! nothing here locks. A warm `select` allocates nothing.

use std::collections::HashMap;

use kvedge_policies::plugins::request_classifier::{
    Classification, ClassifyRequest, RequestClassifier,
};
use kvedge_policies::predict::{PrefillSpeedLearner, TtftInputs, TtftPredictor, TtftTerms};
use kvedge_policies::rules::{Outcome, RuleCandidate, RuleEngine, RulePolicy, RuleRequest};
use kvedge_policies::{
    AffinityMode, CacheRow, CandidateRow, CandidateTable, OccupancyRow, RECENT_HALF_LIFE_MS,
    RouterPlugins, RoutingPartition, SessionAffinityTable, SessionContext, WorkerInputs,
    WorkerSelectionContext, WorkerSelectionPolicy, WorkerSelectionPolicyError, WorkerType,
    WorkerWithDpRank, affinity::SessionIdError,
};
use kvedge_schema::messages::{EventRef, Tier};

use crate::index::{KvIndex, MAX_WORKERS, Overlap, Slot};
use crate::load::{LoadError, LoadReport, LoadTable};
use crate::pending::PendingPrefixes;
use crate::prefill_watch::PrefillWatch;

/// A registered worker (one engine rank).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerInfo {
    pub worker: WorkerWithDpRank,
    pub model: String,
    pub role: WorkerType,
    pub endpoint: String,
    pub block_size: u32,
    /// False while a resync snapshot is incomplete or a heartbeat is late.
    pub available: bool,
    /// The engine's labels as `key=value`, for the rule language's
    /// `backends: { labels }` and `backend.labels.<key>`; the `backend`
    /// label is the worker's backend name ([`WorkerInfo::backend`]).
    pub labels: Vec<String>,
    /// The engine's taints: what keeps requests away from it.
    pub taints: Vec<Taint>,
}

pub use kvedge_config::{Taint, TaintEffect};

/// Whether `w` may serve a request with `tolerations` (no `NoSchedule`
/// taint it does not tolerate), and its preferred-taint cost multiplier.
fn taint_verdict(
    w: &WorkerInfo,
    tolerations: &kvedge_wire::Strs<'_>,
    multiplier: f64,
) -> (bool, f64) {
    let mut m = 1.0;
    for t in &w.taints {
        if t.tolerated_by(tolerations.iter()) {
            continue;
        }
        match t.effect {
            TaintEffect::NoSchedule => return (false, m),
            TaintEffect::PreferNoSchedule => m *= multiplier,
        }
    }
    (true, m)
}

impl WorkerInfo {
    /// The backend name the rules match (`backends: { names }`,
    /// `backend.name`, a Local tier's `order`): the value of the worker's
    /// `backend` label.
    pub fn backend(&self) -> Option<&str> {
        self.labels.iter().find_map(|l| l.strip_prefix("backend="))
    }
}

/// Most taints a worker may have: a select reads them all per candidate.
pub const MAX_TAINTS: usize = 16;

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("worker {0} is already registered")]
    Duplicate(WorkerWithDpRank),
    #[error("no free worker slot (at most {0} workers)")]
    Full(usize),
    #[error("block size must be positive")]
    BlockSize,
    #[error("label `{0}` has an empty key or a key with `=` in it")]
    Label(String),
    #[error("taint `{0}` is not `key[=value]:NoSchedule` or `key[=value]:PreferNoSchedule`")]
    Taint(String),
}

/// Why a selection produced no worker.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    #[error("no available {role} worker serves model `{model}`")]
    NoWorkers { model: String, role: WorkerType },
    #[error(transparent)]
    Selection(#[from] WorkerSelectionPolicyError),
    #[error(transparent)]
    Session(#[from] SessionIdError),
    #[error("rule `{rule}` found no candidate and rejects the request")]
    RejectedByRule { rule: String },
    #[error("no rule matches the request")]
    NoRuleMatched,
    #[error(
        "the request's target is not a candidate of rule `{rule}` (its consider or exclude drops it)"
    )]
    TargetExcluded { rule: String },
    #[error("the request classifier rejected the request: {0}")]
    RejectedByClassifier(String),
    #[error(
        "the request classifier deferred the request: retry after {retry_after_ms} ms (kvedge holds no queue of deferred requests)"
    )]
    Deferred { retry_after_ms: u64 },
}

/// The configured request classifier, run before every select.
struct Classifier(Box<dyn RequestClassifier>);

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Classifier")
    }
}

/// A routing query.
#[derive(Clone, Copy, Debug)]
pub struct SelectRequest<'a> {
    pub model: &'a str,
    pub tenant: Option<&'a str>,
    /// `type-degree` tags for the rule language.
    pub tags: &'a [&'a str],
    /// Ingress headers (lowercase names) and the request's priority, for
    /// rules and policies.
    pub headers: Option<&'a kvedge_policies::AgentHeaders>,
    pub priority: i32,
    pub role: WorkerType,
    /// The prompt's sequence hashes (full blocks, in order).
    pub hashes: &'a [u64],
    pub prompt_tokens: u32,
    pub session: Option<SessionContext<'a>>,
    pub pinned: Option<WorkerWithDpRank>,
    pub now_ms: u64,
    /// Answer without reserving or rebinding.
    pub dry_run: bool,
    /// Only workers whose endpoint is one of these (a gateway's subset
    /// hint: `host:port` or the whole URL); empty: every worker.
    pub subset: kvedge_wire::Strs<'a>,
    /// The taints this request tolerates (`key` or `key=value`).
    pub tolerations: kvedge_wire::Strs<'a>,
    /// `hashes` are approximate: chained hashes of the prompt's text
    /// chunks, not of its KV blocks. They are matched against where
    /// earlier approximate selects were sent ([`Router::approx`]), not
    /// against the engines' events, and the pick is remembered there.
    pub approximate: bool,
}

impl<'a> SelectRequest<'a> {
    /// A select of `hashes` (a prompt of `prompt_tokens`) for `model` in
    /// `role`, and nothing else: no tenant, tags, headers, session or pin,
    /// priority 0, at time 0, reserving, over every worker, exact hashes.
    /// Set the other fields with struct update syntax.
    pub fn new(model: &'a str, role: WorkerType, hashes: &'a [u64], prompt_tokens: u32) -> Self {
        SelectRequest {
            model,
            tenant: None,
            tags: &[],
            headers: None,
            priority: 0,
            role,
            hashes,
            prompt_tokens,
            session: None,
            pinned: None,
            now_ms: 0,
            dry_run: false,
            subset: kvedge_wire::Strs::EMPTY,
            tolerations: kvedge_wire::Strs::EMPTY,
            approximate: false,
        }
    }
}

/// Why [`Router::route`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Select,
    Warm,
}

/// Whether `endpoint` (a worker's URL, `http://host:port`) is allowed by
/// `subset` (empty: everything). Compares without allocating.
pub fn in_subset(endpoint: &str, subset: &kvedge_wire::Strs<'_>) -> bool {
    if subset.is_empty() {
        return true;
    }
    let authority = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .map(|rest| rest.split('/').next().unwrap_or(rest));
    subset.iter().any(|e| e == endpoint || Some(e) == authority)
}

/// The answer to a routing query.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectResult {
    pub request_id: u64,
    /// The chosen local worker, or `None` when a rule chose a provider.
    pub slot: Option<Slot>,
    pub worker: WorkerWithDpRank,
    /// Index of the chosen provider in the rule policy's `providers`.
    pub provider: Option<usize>,
    /// Index of the rule that decided, when rules are configured.
    pub rule: Option<usize>,
    /// Device, host and disk prefix overlap, in blocks.
    pub overlap_blocks: [u32; 3],
    pub cost: f64,
}

/// How the last selection went, for `explain`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Explain {
    /// Workers of the request's model and role that were available.
    pub candidates: usize,
    /// Candidates left after the policy's filters (policy path).
    pub survivors: usize,
    /// Rule path: the deciding rule and tier, the candidates after
    /// `consider` and after `exclude`, and rules that fell through.
    pub rule: Option<usize>,
    pub tier: Option<usize>,
    pub considered: usize,
    pub after_exclude: usize,
    pub fell_through: usize,
    /// Recent picks that sent the deepest prompt block some candidate
    /// holds (the policy's `prefix_sharers`).
    pub prefix_sharers: u32,
}

/// The approximate index holds `daemon.index_capacity` divided by this
/// (at least 1,024 entries): it remembers recent routing decisions, not
/// whole caches.
pub const APPROX_CAPACITY_DIVISOR: usize = 16;

/// All routing state.
#[derive(Debug)]
pub struct Router {
    workers: Vec<Option<WorkerInfo>>,
    /// The request classifier, when one is configured.
    classifier: Option<Classifier>,
    /// The slots of `workers` that hold one: a select visits these, not
    /// every slot (a cold select would read a line per slot).
    registered: u64,
    pub index: KvIndex,
    /// Where approximate selects were sent: each one's chunk hashes,
    /// stored for the worker it went to (as if on its device tier), oldest
    /// evicted first when full. Engines' events never touch it.
    pub approx: KvIndex,
    /// What each worker was just sent and has not yet reported caching
    /// (prefix reservations): counted as its overlap meanwhile.
    pub pending: PendingPrefixes,
    pub load: LoadTable,
    /// Per reservation, the prompt block whose Stored event marks its
    /// prefill done.
    watch: PrefillWatch,
    /// Prefills marked done by their engine's Stored event (before any
    /// client's `prefill_done`).
    prefills_from_events: u64,
    plugins: RouterPlugins,
    /// Per model, a policy per role, built on first use. Hashed with
    /// foldhash: SipHash's code alone is a dozen cache lines that a cold
    /// select would wait for, and the keys are models of registered
    /// workers only.
    policies: HashMap<String, [Option<WorkerSelectionPolicy>; 4], foldhash::fast::RandomState>,
    affinity: SessionAffinityTable,
    table: CandidateTable,
    rows: Vec<Slot>,
    overlap: Overlap,
    next_request_id: u64,
    /// Registrations allowed at once (at most `MAX_WORKERS`).
    max_workers: usize,
    rules: Option<RuleEngine>,
    rule_policy: Option<std::sync::Arc<RulePolicy>>,
    /// Workers whose view of their cache is incomplete (a resync snapshot
    /// is arriving): routable, but their view counts as empty.
    syncing: u64,
    /// Retained (empty) buffer for the rule candidates of one request, and
    /// what each candidate stands for (a worker slot or a provider index).
    rule_buf: Vec<RuleCandidate<'static>>,
    rule_targets: Vec<Result<Slot, usize>>,
    /// What the TTFT predictions need.
    prefill: Prefill,
    /// What the last selection saw, for `explain`.
    explained: Explained,
    /// Per slot: what its worker was picked for since it registered.
    picks: [Picks; MAX_WORKERS],
    /// Per slot: its recent selections, decayed (the `TTFT` group's
    /// `recent_selections`).
    recent: [Decayed; MAX_WORKERS],
}

/// A count that halves every [`RECENT_HALF_LIFE_MS`] of the router's
/// clock, kept as its value at the last change.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Decayed {
    value: f64,
    at_ms: u64,
}

impl Decayed {
    /// The count at `now_ms` (a clock that went back decays nothing).
    fn at(&self, now_ms: u64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64;
        self.value * (-elapsed / RECENT_HALF_LIFE_MS as f64).exp2()
    }

    /// One more at `now_ms`.
    fn add(&mut self, now_ms: u64) {
        self.value = self.at(now_ms) + 1.0;
        self.at_ms = self.at_ms.max(now_ms);
    }
}

/// What a worker was picked for: requests, and their prompts' blocks, in
/// all and found in its device cache (its hit rate, as kvedge counted it
/// when it picked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Picks {
    pub requests: u64,
    pub prompt_blocks: u64,
    pub cached_blocks: u64,
}

/// The TTFT predictor (the `ttft:` section), and per slot the prefill
/// speed learned from completed prefills.
#[derive(Debug)]
struct Prefill {
    ttft: TtftPredictor,
    speed: [PrefillSpeedLearner; MAX_WORKERS],
    /// The mean of the learned speeds (for workers that learned none).
    peer_speed: Option<f64>,
}

/// What the last selection saw, kept for `explain`.
#[derive(Debug)]
struct Explained {
    last: Explain,
    /// Compute every candidate's cost on the next selections.
    costs_on: bool,
    cost_buf: Vec<f64>,
    /// Per slot: the total cost under the partition's policy at the last
    /// explained selection (NaN: filtered out or not computed).
    costs: [f64; MAX_WORKERS],
    /// Per slot: the TTFT prediction at the last explained selection, made
    /// before the chosen worker was reserved.
    ttft: [TtftTerms; MAX_WORKERS],
    /// Per slot: its recent selections then, likewise.
    recent: [f64; MAX_WORKERS],
}

impl Router {
    pub fn new(
        plugins: RouterPlugins,
        index_capacity: usize,
        reservation_ttl_ms: u64,
        affinity: SessionAffinityTable,
    ) -> Self {
        Router {
            classifier: plugins.classifier().map(|c| Classifier(c.build())),
            workers: vec![None; MAX_WORKERS],
            registered: 0,
            index: KvIndex::new(index_capacity),
            approx: KvIndex::new((index_capacity / APPROX_CAPACITY_DIVISOR).max(1024)).quiet(),
            load: LoadTable::new(reservation_ttl_ms),
            pending: PendingPrefixes::new(kvedge_config::DEFAULT_PREFIX_RESERVATION_MS),
            watch: PrefillWatch::default(),
            prefills_from_events: 0,
            plugins,
            policies: HashMap::default(),
            affinity,
            table: CandidateTable::new(),
            rows: Vec::with_capacity(MAX_WORKERS),
            overlap: Overlap::default(),
            next_request_id: 1,
            max_workers: MAX_WORKERS,
            rules: None,
            rule_policy: None,
            picks: [Picks::default(); MAX_WORKERS],
            recent: [Decayed::default(); MAX_WORKERS],
            prefill: Prefill {
                ttft: TtftPredictor::default(),
                speed: [PrefillSpeedLearner::default(); MAX_WORKERS],
                peer_speed: None,
            },
            syncing: 0,
            rule_buf: Vec::new(),
            rule_targets: Vec::new(),
            explained: Explained {
                last: Explain::default(),
                costs_on: false,
                cost_buf: Vec::with_capacity(MAX_WORKERS),
                costs: [f64::NAN; MAX_WORKERS],
                ttft: [TtftTerms::default(); MAX_WORKERS],
                recent: [0.0; MAX_WORKERS],
            },
        }
    }

    /// The router a configuration describes: its policies, index capacity,
    /// reservation TTL, session affinity, worker limit and rules.
    pub fn from_config(config: &kvedge_config::Config) -> Self {
        let mut router = Router::new(
            config.plugins.clone(),
            config.daemon.index_capacity,
            config.daemon.reservation_ttl_ms,
            SessionAffinityTable::new(
                config.session_affinity.mode,
                config.session_affinity.ttl_ms,
                config.session_affinity.max_sessions,
            ),
        );
        router.set_max_workers(config.daemon.max_workers);
        router.prefill.ttft = config.ttft;
        router
            .pending
            .set_window(config.daemon.prefix_reservation_ms);
        if let Some(rules) = config.rules.clone() {
            router.set_rules(rules);
        }
        router
    }

    /// How the last selection went.
    pub fn last_explain(&self) -> Explain {
        self.explained.last
    }

    /// Computes every candidate's total cost on the selections that follow
    /// (for `explain`; off by default, it costs a second scoring pass).
    pub fn set_explain_costs(&mut self, on: bool) {
        self.explained.costs_on = on;
    }

    /// The cost of `slot` under its partition's worker-selection policy at
    /// the last selection made with explain costs on (`None`: not a
    /// candidate, filtered out, or chosen by the rule language).
    pub fn last_cost(&self, slot: Slot) -> Option<f64> {
        let c = self.explained.costs[slot.index()];
        (!c.is_nan()).then_some(c)
    }

    /// The recent selections of `slot` (the `TTFT` group's
    /// `recent_selections`) at the last explained selection, before the
    /// chosen worker was counted.
    pub fn last_recent(&self, slot: Slot) -> f64 {
        self.explained.recent[slot.index()]
    }

    /// Overlap of `slot` computed by the last selection, per tier.
    pub fn last_overlap(&self, slot: Slot) -> [u32; 3] {
        [
            self.overlap.get(slot, Tier::Device),
            self.overlap.get(slot, Tier::Host),
            self.overlap.get(slot, Tier::Disk),
        ]
    }

    /// Allows at most `n` registered workers (clamped to 1..=64).
    pub fn set_max_workers(&mut self, n: usize) {
        self.max_workers = n.clamp(1, MAX_WORKERS);
    }

    /// Applies a reloaded configuration between two selections: the
    /// worker-selection policies are rebuilt from the new plugins (fresh
    /// instances, on first use per partition), the rules replaced, the
    /// session affinity settings updated. The index, load table,
    /// reservations, session bindings and registered workers are kept.
    /// `index_capacity` and `max_workers` take effect at restart.
    pub fn reconfigure(&mut self, config: &kvedge_config::Config) {
        self.plugins = config.plugins.clone();
        self.classifier = self.plugins.classifier().map(|c| Classifier(c.build()));
        self.policies.clear();
        self.prefill.ttft = config.ttft;
        match config.rules.clone() {
            Some(rules) => self.set_rules(rules),
            None => {
                self.rules = None;
                self.rule_policy = None;
            }
        }
        self.affinity.reconfigure(
            config.session_affinity.mode,
            config.session_affinity.ttl_ms,
            config.session_affinity.max_sessions,
        );
        self.load.set_ttl(config.daemon.reservation_ttl_ms);
        self.pending.set_window(config.daemon.prefix_reservation_ms);
    }

    /// Routes with the rule language from now on.
    pub fn set_rules(&mut self, policy: RulePolicy) {
        let engine = RuleEngine::new(policy);
        self.rule_policy = Some(engine.shared_policy());
        self.rules = Some(engine);
    }

    /// The rule policy in use, if any.
    /// The rule policy, shared (its classifiers' tags borrow from it while
    /// the router decides).
    pub fn rule_policy(&self) -> Option<std::sync::Arc<RulePolicy>> {
        self.rule_policy.clone()
    }

    pub fn rules(&self) -> Option<&RulePolicy> {
        self.rules.as_ref().map(RuleEngine::policy)
    }

    /// A router with the built-in policy everywhere and hard affinity.
    pub fn with_defaults() -> Self {
        Router::new(
            RouterPlugins::builtin_only(Default::default()),
            16 << 20,
            600_000,
            SessionAffinityTable::new(AffinityMode::Hard, 600_000, 65_536),
        )
    }

    /// Registers a worker; a second live registration of the same
    /// (worker id, dp rank) is refused.
    pub fn register(&mut self, info: WorkerInfo) -> Result<Slot, RegisterError> {
        if info.block_size == 0 {
            return Err(RegisterError::BlockSize);
        }
        if let Some(bad) = info
            .labels
            .iter()
            .find(|l| l.split_once('=').is_none_or(|(k, _)| k.is_empty()))
        {
            return Err(RegisterError::Label(bad.clone()));
        }
        if info.taints.len() > MAX_TAINTS {
            return Err(RegisterError::Taint(format!(
                "{} taints, more than {MAX_TAINTS}",
                info.taints.len()
            )));
        }
        if self
            .workers
            .iter()
            .flatten()
            .any(|w| w.worker == info.worker)
        {
            return Err(RegisterError::Duplicate(info.worker));
        }
        let free = self
            .workers
            .iter()
            .take(self.max_workers)
            .position(Option::is_none)
            .ok_or(RegisterError::Full(self.max_workers))?;
        let slot = Slot::new(free).expect("slot index below MAX_WORKERS");
        // A fresh slot starts clean (a previous occupant was unregistered).
        self.index.remove_worker(slot);
        self.approx.remove_worker(slot);
        self.load.remove_worker(slot);
        self.prefill.speed[free] = PrefillSpeedLearner::default();
        self.picks[free] = Picks::default();
        self.recent[free] = Decayed::default();
        self.update_peer_speed();
        self.syncing &= !(1u64 << free);
        self.workers[free] = Some(info);
        self.registered |= 1u64 << free;
        Ok(slot)
    }

    /// The worker left (its control connection closed): its blocks, load,
    /// reservations and session bindings go at once.
    pub fn unregister(&mut self, slot: Slot) -> Option<WorkerInfo> {
        let info = self.workers[slot.index()].take()?;
        self.registered &= !(1u64 << slot.index());
        self.prefill.speed[slot.index()] = PrefillSpeedLearner::default();
        self.update_peer_speed();
        self.syncing &= !(1u64 << slot.index());
        self.index.remove_worker(slot);
        self.approx.remove_worker(slot);
        self.load.remove_worker(slot);
        self.pending.forget(slot);
        self.watch.forget(slot);
        self.affinity.forget_worker(info.worker.worker_id);
        Some(info)
    }

    pub fn worker(&self, slot: Slot) -> Option<&WorkerInfo> {
        self.workers[slot.index()].as_ref()
    }

    /// What `slot`'s worker was picked for since it registered.
    pub fn picks(&self, slot: Slot) -> Picks {
        self.picks[slot.index()]
    }

    pub fn workers(&self) -> impl Iterator<Item = (Slot, &WorkerInfo)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| Some((Slot::new(i)?, w.as_ref()?)))
    }

    /// Marks a worker (un)available for routing, e.g. during a resync.
    pub fn set_available(&mut self, slot: Slot, available: bool) {
        if let Some(w) = self.workers[slot.index()].as_mut() {
            w.available = available;
        }
    }

    /// Marks a worker's view of its cache (in)complete: while a resync
    /// snapshot arrives, its index entries count as no overlap (a partial
    /// view would attract requests for prefixes it may not hold, or hide
    /// ones it does), though it stays routable on load.
    pub fn set_syncing(&mut self, slot: Slot, syncing: bool) {
        let bit = 1u64 << slot.index();
        if syncing {
            self.syncing |= bit;
        } else {
            self.syncing &= !bit;
        }
    }

    /// Whether a worker's view is incomplete (see [`Router::set_syncing`]).
    pub fn syncing(&self, slot: Slot) -> bool {
        self.syncing & (1u64 << slot.index()) != 0
    }

    /// Applies one ring event of the worker in `slot`, received at
    /// `now_ms`.
    pub fn apply(&mut self, slot: Slot, event: &EventRef<'_>, now_ms: u64) {
        match event {
            EventRef::Stored(s) => {
                let tier = s.tier.to_native();
                for b in s.blocks.iter() {
                    let hash = b.sequence_hash.to_native();
                    self.apply_stored(slot, tier, &[hash]);
                    if tier == Tier::Device {
                        self.prefill_stored(slot, hash, now_ms);
                    }
                }
            }
            EventRef::Removed(r) => {
                let tier = r.tier.to_native();
                for h in r.hashes.iter() {
                    self.apply_removed(slot, tier, &[h.to_native()]);
                }
            }
            EventRef::Cleared(c) => {
                self.apply_cleared(slot, c.tier.as_ref().map(|t| t.to_native()));
            }
            EventRef::Load(l) => self.apply_load(
                slot,
                LoadReport {
                    active_requests: l.active_requests.to_native(),
                    waiting_requests: l.waiting_requests.to_native(),
                    active_prefill_tokens: l.active_prefill_tokens.to_native(),
                    active_decode_blocks: l.active_decode_blocks.to_native(),
                    kv_used_blocks: l.kv_used_blocks.to_native(),
                    kv_total_blocks: l.kv_total_blocks.to_native(),
                },
            ),
            EventRef::Heartbeat(_)
            | EventRef::SnapshotBegin(_)
            | EventRef::SnapshotEnd(_)
            | EventRef::Notice(_) => {}
        }
    }

    /// The worker in `slot` stored `hashes` in `tier` (the native form of a
    /// Stored event, used by the simulator).
    pub fn apply_stored(&mut self, slot: Slot, tier: Tier, hashes: &[u64]) {
        self.index.store(slot, tier, hashes);
    }

    /// The worker in `slot` stored the block `hash` on its device at
    /// `now_ms`: the prefill of the reservation that watched for it is
    /// done, if it still waits for it (see `prefill_watch.rs`).
    fn prefill_stored(&mut self, slot: Slot, hash: u64, now_ms: u64) {
        let Some(seen) = self.watch.stored(slot, hash) else {
            return;
        };
        if self
            .load
            .prefill_pending(seen.request_id, slot, seen.reserved_ms)
            && self.prefill_done(seen.request_id, now_ms).is_ok()
        {
            self.prefills_from_events += 1;
        }
    }

    /// Prefills marked done by their engine's Stored event since start.
    pub fn prefills_from_events(&self) -> u64 {
        self.prefills_from_events
    }

    /// The worker in `slot` removed `hashes` from `tier`.
    pub fn apply_removed(&mut self, slot: Slot, tier: Tier, hashes: &[u64]) {
        self.index.remove(slot, tier, hashes);
        // Its engine's word beats what it was sent.
        if tier == Tier::Device {
            self.pending.unnote(slot, hashes);
        }
    }

    /// The worker in `slot` cleared `tier` (every tier with `None`).
    pub fn apply_cleared(&mut self, slot: Slot, tier: Option<Tier>) {
        self.index.clear(slot, tier);
        // What was sent there is gone from its device cache too.
        if matches!(tier, None | Some(Tier::Device)) {
            self.approx.clear(slot, None);
            self.pending.forget(slot);
        }
    }

    /// The worker in `slot` reported its load.
    pub fn apply_load(&mut self, slot: Slot, report: LoadReport) {
        self.load.report(slot, report);
    }

    /// The request's first token came out at `now_ms`: its prefill tokens
    /// leave the worker's projected load, and the time since it was placed
    /// teaches the worker's prefill speed.
    pub fn prefill_done(&mut self, request_id: u64, now_ms: u64) -> Result<(), LoadError> {
        if let Some(t) = self.load.prefill_done(request_id)?
            && now_ms > t.reserved_ms
        {
            let seconds = (now_ms - t.reserved_ms) as f64 / 1000.0;
            self.prefill.speed[t.slot.index()].observe(t.work_tokens, seconds);
            self.update_peer_speed();
        }
        Ok(())
    }

    fn update_peer_speed(&mut self) {
        self.prefill.peer_speed = PrefillSpeedLearner::pooled(&self.prefill.speed);
    }

    /// The request finished: it leaves the worker's projected load.
    pub fn finish(&mut self, request_id: u64) -> Result<(), LoadError> {
        self.load.finish(request_id)
    }

    /// The request's dispatch failed before a response stream: its
    /// reservation is released and its session's binding goes back to
    /// what it was before its select (the plugin API: a failure before a
    /// response stream leaves the previous binding intact). After its
    /// prefill was done, or once it expired, it is a plain `finish`.
    pub fn abort(&mut self, request_id: u64, now_ms: u64) -> Result<(), LoadError> {
        if let Some(undo) = self.load.abort(request_id)? {
            self.affinity.undo(undo, now_ms);
        }
        Ok(())
    }

    /// The prefill speed the TTFT predictions of `slot` use, and where it
    /// comes from.
    pub fn prefill_speed(&self, slot: Slot) -> (f64, kvedge_policies::predict::SpeedSource) {
        let t = self.predict(slot, 1, [0; 3], 0);
        (t.tokens_per_second, t.speed_source)
    }

    /// The prefill speed learned for `slot`, tokens per second.
    pub fn learned_speed(&self, slot: Slot) -> Option<f64> {
        let anchor = self
            .prefill
            .peer_speed
            .unwrap_or(self.prefill.ttft.prefill_tokens_per_second);
        self.prefill.speed[slot.index()].tokens_per_second(anchor)
    }

    /// The TTFT prediction for `slot` at the last selection made with
    /// explain costs on, as it stood before the chosen worker was reserved.
    pub fn last_ttft(&self, slot: Slot) -> TtftTerms {
        self.explained.ttft[slot.index()]
    }

    /// With explain costs on, notes every worker's TTFT prediction for the
    /// request being decided (before its reservation changes one of them).
    fn explain_ttft(&mut self, prompt_tokens: u32, now_ms: u64) {
        if self.explained.costs_on {
            self.record_ttft(prompt_tokens, now_ms);
        }
    }

    /// Out of line: only `explain` asks for it, and a select's frame
    /// should not carry room for every worker's terms.
    #[cold]
    #[inline(never)]
    fn record_ttft(&mut self, prompt_tokens: u32, now_ms: u64) {
        for (recent, count) in self.explained.recent.iter_mut().zip(&self.recent) {
            *recent = count.at(now_ms);
        }
        Predicting::new(&self.prefill, &self.load, now_ms).all_into(
            &mut self.explained.ttft,
            registered(self.registered, &self.workers),
            &self.overlap,
            prompt_tokens,
        );
    }

    fn predict(&self, slot: Slot, prompt_tokens: u32, overlap: [u32; 3], now_ms: u64) -> TtftTerms {
        let block_size = self.workers[slot.index()]
            .as_ref()
            .map_or(1, |w| w.block_size);
        Predicting::new(&self.prefill, &self.load, now_ms).terms(
            slot,
            block_size,
            prompt_tokens,
            overlap,
        )
    }

    /// Chooses a worker for `req`, reserves it (unless a dry run) and
    /// rebinds the session after success.
    pub fn select(&mut self, req: &SelectRequest<'_>) -> Result<SelectResult, RouterError> {
        // What this selection saw, and nothing of the last one when it
        // fails before it looks (no worker of the model and role).
        self.explained.last = Explain::default();
        let chosen = match self.classify(req)? {
            Some(priority) => self.route(&SelectRequest { priority, ..*req }, Purpose::Select)?,
            None => self.route(req, Purpose::Select)?,
        };
        Ok(chosen.expect("a select that does not fail chooses"))
    }

    /// The configured classifier's verdict on `req`, before anything else
    /// looks at it (dry runs included, so that they answer what a real
    /// select would): a new priority to select with, `None` to go on as
    /// asked, or the rejection or deferral to answer.
    fn classify(&mut self, req: &SelectRequest<'_>) -> Result<Option<i32>, RouterError> {
        let Some(Classifier(classifier)) = self.classifier.as_mut() else {
            return Ok(None);
        };
        let block_size = registered(self.registered, &self.workers)
            .find(|(_, w)| w.model == req.model && w.role == req.role)
            .map_or(16, |(_, w)| w.block_size);
        let mut id_buf = [0u8; 20];
        let verdict = classifier.classify(&ClassifyRequest {
            request_id: format_u64(self.next_request_id, &mut id_buf),
            prompt_tokens: req.prompt_tokens,
            block_size,
            priority: req.priority,
            // Text-chunk hashes are not the host's tracking hashes.
            sequence_hashes: (!req.approximate).then_some(req.hashes),
            session: req.session,
            agent_headers: req.headers,
            now_ms: req.now_ms,
        });
        match verdict {
            Classification::Admit => Ok(None),
            Classification::AdmitWithPriority(p) => Ok(Some(p)),
            Classification::Reject { reason } => {
                Err(RouterError::RejectedByClassifier(reason.into_owned()))
            }
            Classification::Defer { retry_after_ms } => {
                Err(RouterError::Deferred { retry_after_ms })
            }
        }
    }

    /// Runs the part of a select that decides nothing, so that its code
    /// and data are in the CPU's caches when the next request comes: the
    /// candidates of `req`'s model and role, their overlap with `req`'s
    /// hashes, and the policy's filters, scorers and picker over them
    /// ([`WorkerSelectionPolicy::warm`], which puts back whatever the
    /// picker's pick changed). The rule language and everything a select
    /// changes are left alone: no reservation, no session, no random draw
    /// kept, no request id, no explanation. Allocates nothing once the
    /// partition's policy is built.
    pub fn warm(&mut self, req: &SelectRequest<'_>) {
        let _ = self.route(req, Purpose::Warm);
    }

    /// Builds the policy of a partition. Out of line: it runs once per
    /// partition, and its temporaries (a policy for each role) should not
    /// widen the frame of every select.
    #[cold]
    #[inline(never)]
    fn build_policy(&mut self, model: &str, role: WorkerType) {
        let built = self.plugins.build(&RoutingPartition::new(role, model));
        self.policies.entry(model.to_owned()).or_default()[role as usize] = Some(built);
    }

    /// A select, or only the warming part of it (`Ok(None)`).
    fn route(
        &mut self,
        req: &SelectRequest<'_>,
        purpose: Purpose,
    ) -> Result<Option<SelectResult>, RouterError> {
        let warm = purpose == Purpose::Warm;
        if self.explained.costs_on && !warm {
            self.explained.costs = [f64::NAN; MAX_WORKERS];
        }
        // Candidates: available workers of this model and role.
        let mut mask = 0u64;
        let mut block_size = 0;
        self.rows.clear();
        for (i, w) in registered(self.registered, &self.workers) {
            if w.available
                && w.role == req.role
                && w.model == req.model
                && in_subset(&w.endpoint, &req.subset)
                && (w.taints.is_empty() || taint_verdict(w, &req.tolerations, 1.0).0)
            {
                mask |= 1u64 << i;
                block_size = w.block_size;
                self.rows
                    .push(Slot::new(i).expect("slot index below MAX_WORKERS"));
            }
        }
        if self.rows.is_empty() {
            if warm {
                return Ok(None);
            }
            if self.rules.is_some() {
                // Rules may consider other models or providers.
                let block_size = self
                    .workers
                    .iter()
                    .flatten()
                    .find(|w| w.role == req.role)
                    .map_or(16, |w| w.block_size);
                return self
                    .select_by_rules(req, self.next_request_id, block_size, 0, None, req.pinned)
                    .map(Some);
            }
            return Err(RouterError::NoWorkers {
                model: req.model.to_owned(),
                role: req.role,
            });
        }
        // The partition's policy, built on first use: only for a model a
        // worker serves, so a client's unknown model names build nothing.
        let role = req.role as usize;
        if self
            .policies
            .get(req.model)
            .is_none_or(|p| p[role].is_none())
        {
            self.build_policy(req.model, req.role);
        }
        let policy = self
            .policies
            .get_mut(req.model)
            .and_then(|p| p[role].as_mut())
            .expect("built above");
        let required = policy.required_worker_inputs();
        // Only the signal groups the policy declared.
        let predict_ttft = required.contains(WorkerInputs::TTFT);
        if predict_ttft || required.contains(WorkerInputs::CACHE) {
            overlap_into(
                &self.index,
                &self.approx,
                &self.pending,
                req,
                mask & !self.syncing,
                &mut self.overlap,
            );
        } else {
            self.overlap = Overlap::default();
        }
        self.table.reset(required | WorkerInputs::LOAD);
        let mut deepest = 0u32;
        for &slot in &self.rows {
            let w = self.workers[slot.index()]
                .as_ref()
                .expect("candidate is registered");
            let report = self.load.reported(slot);
            let overlap = [
                self.overlap.get(slot, Tier::Device),
                self.overlap.get(slot, Tier::Host),
                self.overlap.get(slot, Tier::Disk),
            ];
            deepest = deepest.max(overlap[0]);
            let predicted = predict_ttft.then(|| {
                Predicting::new(&self.prefill, &self.load, req.now_ms).terms(
                    slot,
                    w.block_size,
                    req.prompt_tokens,
                    overlap,
                )
            });
            self.table.push(CandidateRow {
                worker: w.worker,
                cache: CacheRow {
                    device_blocks: overlap[0],
                    host_blocks: overlap[1],
                    disk_blocks: overlap[2],
                    shared_beyond_blocks: 0,
                },
                load: self.load.projected(slot),
                occupancy: OccupancyRow {
                    kv_used_blocks: report.kv_used_blocks,
                    kv_total_blocks: report.kv_total_blocks,
                },
                preferred_taint_multiplier: Some(if w.taints.is_empty() {
                    1.0
                } else {
                    taint_verdict(
                        w,
                        &req.tolerations,
                        policy.config().preferred_taint_multiplier,
                    )
                    .1
                }),
                predicted_ttft_s: predicted.map(|t| t.total_s()),
                predicted_prefill_s: predicted.map(|t| t.prefill_s),
                recent_selections: predict_ttft.then(|| self.recent[slot.index()].at(req.now_ms)),
            });
        }
        self.table.set_present(
            WorkerInputs::CACHE
                | WorkerInputs::LOAD
                | WorkerInputs::OCCUPANCY
                | WorkerInputs::PREFERRED_TAINT
                | WorkerInputs::TTFT,
        );

        let request_id = self.next_request_id;
        let mut id_buf = [0u8; 20];
        let id_str = format_u64(request_id, &mut id_buf);
        let sharers = match deepest.checked_sub(1) {
            Some(d) if !req.approximate => req
                .hashes
                .get(d as usize)
                .map_or(0, |&h| self.pending.picks(h, req.now_ms)),
            _ => 0,
        };
        let mut ctx = WorkerSelectionContext::new(id_str, req.prompt_tokens, block_size)
            .with_now_ms(req.now_ms)
            .with_priority(req.priority)
            .with_prefix_sharers(sharers);
        if let Some(h) = req.headers {
            ctx = ctx.with_agent_headers(h);
        }
        if let Some(s) = req.session {
            ctx = ctx.with_session(s);
        }
        if let Some(p) = req.pinned {
            ctx = ctx.with_pinned_worker(p);
        }
        let unbound = ctx;
        let ctx = self.affinity.apply(ctx)?;
        if warm {
            policy.warm(&ctx, &self.table);
            return Ok(None);
        }
        if self.rules.is_some() {
            // The rules see an exact target too (their exclude and onEmpty
            // still hold); a tier ranking by a policy sees the context the
            // policy would: the soft target, but not a hard binding, which
            // the rules handle as the pin.
            let ranking = if req.pinned.is_none() && ctx.pinned_worker().is_some() {
                unbound
            } else {
                ctx
            };
            return self
                .select_by_rules(
                    req,
                    request_id,
                    block_size,
                    sharers,
                    Some(ranking),
                    ctx.pinned_worker(),
                )
                .map(Some);
        }
        self.explained.last = Explain {
            candidates: self.rows.len(),
            prefix_sharers: sharers,
            ..Explain::default()
        };
        // Only for a policy that allows calls outside selections: a
        // stateful custom one's explain shows no costs.
        if self.explained.costs_on
            && policy.side_passes()
            && policy
                .costs_into(&ctx, &self.table, &mut self.explained.cost_buf)
                .is_ok()
        {
            for (&slot, &c) in self.rows.iter().zip(&self.explained.cost_buf) {
                self.explained.costs[slot.index()] = c;
            }
        }
        let selection = policy.select(&ctx, &self.table)?;
        self.explained.last.survivors = selection.candidates;
        let slot = self.rows[selection.row];
        self.explain_ttft(req.prompt_tokens, req.now_ms);
        let overlap_blocks = self.commit(req, request_id, slot)?;
        Ok(Some(SelectResult {
            request_id,
            slot: Some(slot),
            worker: selection.worker,
            provider: None,
            rule: None,
            overlap_blocks,
            cost: selection.cost,
        }))
    }

    /// The rule language decides: local workers of the request's role (any
    /// model: `consider` may pick another one) and the configured providers
    /// are the candidates.
    fn select_by_rules(
        &mut self,
        req: &SelectRequest<'_>,
        request_id: u64,
        block_size: u32,
        prefix_sharers: u32,
        selection: Option<WorkerSelectionContext<'_>>,
        pinned: Option<WorkerWithDpRank>,
    ) -> Result<SelectResult, RouterError> {
        // Overlap for every available worker of the role.
        let mut mask = 0u64;
        for (i, w) in registered(self.registered, &self.workers) {
            if w.available
                && w.role == req.role
                && in_subset(&w.endpoint, &req.subset)
                && (w.taints.is_empty() || taint_verdict(w, &req.tolerations, 1.0).0)
            {
                mask |= 1u64 << i;
            }
        }
        overlap_into(
            &self.index,
            &self.approx,
            &self.pending,
            req,
            mask & !self.syncing,
            &mut self.overlap,
        );
        // The TTFT terms `explain` shows, before a reservation changes them.
        self.explain_ttft(req.prompt_tokens, req.now_ms);
        // Reuse the retained allocation for this request's candidates.
        let mut candidates: Vec<RuleCandidate<'_>> = std::mem::take(&mut self.rule_buf);
        // What each candidate stands for: a worker slot or a provider index.
        let targets = &mut self.rule_targets;
        targets.clear();
        for (i, w) in registered(self.registered, &self.workers) {
            if mask & (1u64 << i) == 0 {
                continue;
            }
            let slot = Slot::new(i).expect("slot index below MAX_WORKERS");
            let load = self.load.projected(slot);
            let report = self.load.reported(slot);
            let mut c = RuleCandidate::local(&w.model, w.worker);
            c.role = Some(w.role.as_str());
            c.backend = w.backend();
            c.labels = &w.labels;
            c.kv_usage = (report.kv_total_blocks > 0)
                .then(|| report.kv_used_blocks as f64 / report.kv_total_blocks as f64);
            c.active_requests = Some(load.active_requests);
            c.waiting_requests = Some(load.waiting_requests);
            c.active_prefill_tokens = Some(load.active_prefill_tokens);
            c.active_decode_blocks = Some(load.active_decode_blocks);
            let overlap = [
                self.overlap.get(slot, Tier::Device),
                self.overlap.get(slot, Tier::Host),
                self.overlap.get(slot, Tier::Disk),
            ];
            c.device_overlap_blocks = Some(overlap[0]);
            c.host_overlap_blocks = Some(overlap[1]);
            c.disk_overlap_blocks = Some(overlap[2]);
            // The policies' prediction (the falling backlog, learned
            // speeds), so that `PredictedTTFT` and `explain` agree with it.
            c.ttft = Some(
                Predicting::new(&self.prefill, &self.load, req.now_ms).terms(
                    slot,
                    w.block_size,
                    req.prompt_tokens,
                    overlap,
                ),
            );
            c.prefill_tokens_per_second = self.prefill.speed[i]
                .tokens_per_second(
                    self.prefill
                        .peer_speed
                        .unwrap_or(self.prefill.ttft.prefill_tokens_per_second),
                )
                .or(self.prefill.peer_speed);
            targets.push(Ok(slot));
            candidates.push(c);
        }
        let policy = self.rule_policy.as_deref().expect("set with the engine");
        for (p, spec) in policy.providers.iter().enumerate() {
            for model in &spec.models {
                targets.push(Err(p));
                let mut c = RuleCandidate::provider(&spec.name, model);
                c.labels = &spec.labels;
                candidates.push(c);
            }
        }
        let mut rule_request = RuleRequest {
            model: req.model,
            tenant: req.tenant,
            role: Some(req.role.as_str()),
            prompt_tokens: req.prompt_tokens,
            block_size: block_size.max(1),
            session_id: req.session.map(|s| s.session_id()),
            priority: req.priority,
            headers: req.headers,
            tags: req.tags,
            selection,
            pinned,
        };
        let engine = self.rules.as_mut().expect("checked by the caller");
        let mut decision = engine.decide(&rule_request, &candidates);
        if decision.outcome == Outcome::PinExcluded && req.pinned.is_none() {
            // A hard session binding the matching rule does not keep: the
            // rules choose as for an unbound request (and the session is
            // bound to their choice).
            rule_request.pinned = None;
            decision = engine.decide(&rule_request, &candidates);
        }
        self.explained.last = Explain {
            candidates: candidates.len(),
            survivors: decision.after_exclude,
            rule: decision.rule,
            tier: decision.tier,
            considered: decision.considered,
            after_exclude: decision.after_exclude,
            fell_through: decision.fell_through,
            prefix_sharers,
        };
        candidates.clear();
        self.rule_buf = candidates
            .into_iter()
            .map(|_| unreachable!("empty"))
            .collect();
        let rule_name = |i: Option<usize>| {
            i.and_then(|i| policy.rules.get(i))
                .map(|r| r.name.clone())
                .unwrap_or_default()
        };
        let chosen = match decision.outcome {
            Outcome::Chosen(i) => self.rule_targets.get(i).copied(),
            Outcome::Rejected => {
                return Err(RouterError::RejectedByRule {
                    rule: rule_name(decision.rule),
                });
            }
            Outcome::NoRuleMatched => return Err(RouterError::NoRuleMatched),
            Outcome::PinExcluded => {
                return Err(RouterError::TargetExcluded {
                    rule: rule_name(decision.rule),
                });
            }
        };
        match chosen {
            Some(Ok(slot)) => {
                let worker = self.workers[slot.index()]
                    .as_ref()
                    .expect("candidate is registered")
                    .worker;
                let overlap_blocks = self.commit(req, request_id, slot)?;
                Ok(SelectResult {
                    request_id,
                    slot: Some(slot),
                    worker,
                    provider: None,
                    rule: decision.rule,
                    overlap_blocks,
                    cost: f64::NAN,
                })
            }
            Some(Err(p)) => {
                if !req.dry_run {
                    self.next_request_id += 1;
                }
                Ok(SelectResult {
                    request_id,
                    slot: None,
                    worker: WorkerWithDpRank::default(),
                    provider: Some(p),
                    rule: decision.rule,
                    overlap_blocks: [0; 3],
                    cost: f64::NAN,
                })
            }
            None => Err(RouterError::NoRuleMatched),
        }
    }

    /// The chosen worker's overlap; unless a dry run, reserves it for the
    /// request and rebinds (or, on a final turn, ends) the session.
    fn commit(
        &mut self,
        req: &SelectRequest<'_>,
        request_id: u64,
        slot: Slot,
    ) -> Result<[u32; 3], RouterError> {
        let overlap_blocks = [
            self.overlap.get(slot, Tier::Device),
            self.overlap.get(slot, Tier::Host),
            self.overlap.get(slot, Tier::Disk),
        ];
        if req.dry_run {
            return Ok(overlap_blocks);
        }
        // The work its prefill will measure, from the load before it.
        let terms = self.predict(slot, req.prompt_tokens, overlap_blocks, req.now_ms);
        let work_tokens = terms.work_tokens();
        let w = self.workers[slot.index()]
            .as_ref()
            .expect("chosen worker is registered");
        let block_size = u64::from(w.block_size);
        let worker = w.worker;
        self.next_request_id += 1;
        let cached_tokens = u64::from(overlap_blocks[0]) * block_size;
        let uncached = u64::from(req.prompt_tokens).saturating_sub(cached_tokens);
        let blocks = u64::from(req.prompt_tokens).div_ceil(block_size);
        self.load.reserve(
            request_id,
            slot,
            uncached,
            blocks,
            req.now_ms,
            work_tokens,
            terms.tokens_per_second,
        );
        // A prompt with a full block the worker does not hold yet: its
        // engine's Stored event of the last one is its prefill's end.
        if !req.approximate
            && let Some(&last) = req.hashes.last()
            && (overlap_blocks[0] as usize) < req.hashes.len()
        {
            self.watch.watch(slot, last, request_id, req.now_ms);
        }
        let picks = &mut self.picks[slot.index()];
        picks.requests += 1;
        picks.prompt_blocks += u64::from(req.prompt_tokens) / block_size;
        picks.cached_blocks += u64::from(overlap_blocks[0]);
        self.recent[slot.index()].add(req.now_ms);
        if req.approximate {
            self.approx.store(slot, Tier::Device, req.hashes);
        } else {
            self.pending.note(slot, req.hashes, req.now_ms);
        }
        if let Some(s) = req.session {
            // Kept with the reservation until a response stream comes back
            // (prefill done): an abort before then puts the binding back.
            let undo = if s.is_final() {
                self.affinity.end_undoable(s.session_id(), req.now_ms)?
            } else {
                self.affinity
                    .bind_undoable(s.session_id(), worker, req.now_ms)?
            };
            self.load.set_undo(request_id, undo);
        }
        Ok(overlap_blocks)
    }

    /// (instance name, type name) serving `role`.
    pub fn policy_name(&self, role: WorkerType) -> (&str, &str) {
        self.plugins.selection(role)
    }
}

/// The prefix overlap of `req` with every worker in `candidates`, into
/// `out`: the index's (the approximate one for an approximate select),
/// with the device tier deepened by the prefix reservations on the precise
/// path. (A free function: a select holds its policy borrowed meanwhile.)
fn overlap_into(
    index: &KvIndex,
    approx: &KvIndex,
    pending: &PendingPrefixes,
    req: &SelectRequest<'_>,
    candidates: u64,
    out: &mut Overlap,
) {
    if req.approximate {
        approx.overlap(req.hashes, candidates, out);
    } else {
        index.overlap(req.hashes, candidates, out);
        pending.deepen(
            req.hashes,
            candidates,
            req.now_ms,
            &mut out.blocks[Tier::Device as usize],
        );
    }
}

/// What a TTFT prediction reads of the router (see
/// [`kvedge_policies::predict`]): the predictor, the projected loads, the
/// learned speeds, the time.
struct Predicting<'a> {
    ttft: &'a TtftPredictor,
    load: &'a LoadTable,
    speed: &'a [PrefillSpeedLearner; MAX_WORKERS],
    peer_speed: Option<f64>,
    now_ms: u64,
}

impl<'a> Predicting<'a> {
    /// The prediction's inputs at `now_ms`.
    fn new(prefill: &'a Prefill, load: &'a LoadTable, now_ms: u64) -> Self {
        Predicting {
            ttft: &prefill.ttft,
            load,
            speed: &prefill.speed,
            peer_speed: prefill.peer_speed,
            now_ms,
        }
    }

    /// The prediction for `slot`, with the request's overlap there.
    fn terms(
        &self,
        slot: Slot,
        block_size: u32,
        prompt_tokens: u32,
        overlap: [u32; 3],
    ) -> TtftTerms {
        let projected = self.load.projected(slot);
        let anchor = self
            .peer_speed
            .unwrap_or(self.ttft.prefill_tokens_per_second);
        let learned = self.speed[slot.index()].tokens_per_second(anchor);
        let (speed, _) = self.ttft.speed(learned, self.peer_speed);
        self.ttft.terms(&TtftInputs {
            prompt_tokens,
            block_size,
            device_blocks: overlap[0],
            host_blocks: overlap[1],
            disk_blocks: overlap[2],
            queued_prefill_tokens: self.load.queued_prefill(slot, self.now_ms, speed),
            waiting_requests: projected.waiting_requests,
            decode_blocks: projected.active_decode_blocks,
            learned_tokens_per_second: learned,
            peer_tokens_per_second: self.peer_speed,
        })
    }

    /// Every registered worker's prediction into `out` (explain).
    fn all_into<'w>(
        &self,
        out: &mut [TtftTerms; MAX_WORKERS],
        workers: impl Iterator<Item = (usize, &'w WorkerInfo)>,
        overlap: &Overlap,
        prompt_tokens: u32,
    ) {
        for (i, w) in workers {
            let Some(slot) = Slot::new(i) else {
                continue;
            };
            let blocks = [
                overlap.get(slot, Tier::Device),
                overlap.get(slot, Tier::Host),
                overlap.get(slot, Tier::Disk),
            ];
            out[i] = self.terms(slot, w.block_size, prompt_tokens, blocks);
        }
    }
}

/// The workers of the slots in `mask` (all registered), in slot order.
fn registered(
    mask: u64,
    workers: &[Option<WorkerInfo>],
) -> impl Iterator<Item = (usize, &WorkerInfo)> {
    let mut left = mask;
    std::iter::from_fn(move || {
        let i = left.trailing_zeros() as usize;
        left &= left.wrapping_sub(1);
        let w = workers
            .get(i)?
            .as_ref()
            .expect("a registered slot holds its worker");
        Some((i, w))
    })
}

/// Decimal digits of `v` in `buf`, without allocating.
fn format_u64(mut v: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[i..]).expect("ASCII digits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_ids() {
        let mut b = [0u8; 20];
        assert_eq!(format_u64(0, &mut b), "0");
        assert_eq!(format_u64(1234567890, &mut b), "1234567890");
        assert_eq!(format_u64(u64::MAX, &mut b), u64::MAX.to_string());
    }

    fn worker(id: u64, model: &str) -> WorkerInfo {
        WorkerInfo {
            worker: WorkerWithDpRank::new(id, 0),
            model: model.into(),
            role: WorkerType::Aggregated,
            endpoint: format!("http://engine-{id}"),
            block_size: 16,
            available: true,
            labels: Vec::new(),
            taints: Vec::new(),
        }
    }

    fn request<'a>(model: &'a str, hashes: &'a [u64]) -> SelectRequest<'a> {
        let tokens = 16 * hashes.len() as u32;
        SelectRequest {
            dry_run: true,
            ..SelectRequest::new(model, WorkerType::Aggregated, hashes, tokens)
        }
    }

    #[test]
    fn a_model_no_worker_serves_builds_no_partition() {
        let mut router = Router::with_defaults();
        router.register(worker(1, "llama")).unwrap();
        for i in 0..1_000 {
            let model = format!("no-such-model-{i}");
            assert!(matches!(
                router.select(&request(&model, &[1, 2])),
                Err(RouterError::NoWorkers { .. })
            ));
        }
        assert!(router.policies.is_empty(), "{:?}", router.policies.keys());
        router.select(&request("llama", &[1, 2])).unwrap();
        assert_eq!(router.policies.len(), 1);
    }

    #[test]
    fn selects_visit_the_registered_slots_as_they_change() {
        let mut router = Router::with_defaults();
        let slots: Vec<Slot> = (1..=6)
            .map(|id| router.register(worker(id, "llama")).unwrap())
            .collect();
        let held = [7u64, 8, 9];
        router.apply_stored(slots[4], Tier::Device, &held);
        assert_eq!(
            router.select(&request("llama", &held)).unwrap().slot,
            Some(slots[4])
        );
        // A gap below the holder and a slot reused above it.
        router.unregister(slots[1]).unwrap();
        router.unregister(slots[4]).unwrap();
        assert_eq!(router.registered.count_ones(), 4);
        let back = router.register(worker(9, "llama")).unwrap();
        assert_eq!(back, slots[1], "the lowest free slot is reused");
        router.apply_stored(back, Tier::Device, &held);
        let chosen = router.select(&request("llama", &held)).unwrap();
        assert_eq!(chosen.slot, Some(back));
        assert_eq!(chosen.overlap_blocks[0], 3);
        assert_eq!(router.last_explain().candidates, 5);
        let listed: Vec<usize> = router.workers().map(|(s, _)| s.index()).collect();
        assert_eq!(listed, [0, 1, 2, 3, 5]);
        // The last slot of all.
        let mut full = Router::with_defaults();
        for id in 0..MAX_WORKERS as u64 {
            full.register(worker(id, "llama")).unwrap();
        }
        let last = Slot::new(MAX_WORKERS - 1).unwrap();
        full.apply_stored(last, Tier::Device, &held);
        assert_eq!(
            full.select(&request("llama", &held)).unwrap().slot,
            Some(last)
        );
        assert_eq!(full.last_explain().candidates, MAX_WORKERS);
    }
}
