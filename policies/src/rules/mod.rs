//! The rule language: ordered rules of `matches` / `route`
//! (`consider`, `exclude`, `select` tiers, `tieBreak`, `onEmpty`) that pick
//! between local workers and off-cluster providers.
//!
//! ```yaml
//! policy:
//!   rules:
//!     - name: pii-stays-local
//!       matches:
//!         - { tag: [pii-confirmed, pii-unknown] }
//!       route:
//!         select:
//!           - { type: Local, minimize: PredictedTTFT }
//!     - name: default
//!       route:
//!         consider:
//!           - backends: {}
//!           - providers: {}
//!         select:
//!           - { type: Local, minimize: PredictedTTFT }
//!           - { type: Provider, order: [databricks] }
//!         tieBreak: PreferLocal
//!         onEmpty: Reject
//! providers:
//!   - { name: databricks, models: [llama-70b], endpoint: "https://…" }
//! ```
//!
//! Rules are evaluated in order and the first that matches and routes wins.
//! A rule that finds no candidate either rejects the request or falls
//! through to the next rule (`onEmpty`). A policy is compiled once (see
//! [`config::load`]): predicates hold parsed constants, attributes are enum
//! tags, and evaluation ([`RuleEngine::decide`]) works in retained buffers
//! and allocates nothing after warm-up. Each decision reports the rule that
//! matched and how many candidates each stage left.

pub mod config;
pub mod model;
pub mod predicate;

use serde::Deserialize;

pub use crate::predict::TtftPredictor;
use crate::rng::PolicyRng;
pub use config::{RuleConfigError, load, load_ttft, load_with};
pub use model::{CandidateAttr, CandidateKind, MAX_TAGS, RequestAttr, RuleCandidate, RuleRequest};
use predicate::Op;

/// One compiled predicate: an attribute and an operator.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledPredicate<A> {
    pub attr: A,
    pub op: Op,
}

/// Candidate generation.
#[derive(Clone, Debug, PartialEq)]
pub enum Consider {
    /// Local endpoints serving one of these models.
    Models(Vec<String>),
    /// Local endpoints, optionally by backend name and `key=value` labels;
    /// with neither, every local endpoint.
    Backends {
        names: Vec<String>,
        labels: Vec<String>,
    },
    /// Providers by name; an empty list means every provider.
    Providers(Vec<String>),
}

/// An `exclude` entry: when the request matches `when` (empty = always),
/// drop the candidates matching `drop`.
#[derive(Clone, Debug, PartialEq)]
pub struct Exclude {
    pub when: Vec<CompiledPredicate<RequestAttr>>,
    pub drop: Vec<CompiledPredicate<CandidateAttr>>,
}

/// Which candidates a tier looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
pub enum TierType {
    Local,
    Provider,
    #[default]
    Any,
}

impl TierType {
    pub fn name(self) -> &'static str {
        match self {
            TierType::Local => "Local",
            TierType::Provider => "Provider",
            TierType::Any => "Any",
        }
    }

    fn admits(self, kind: CandidateKind) -> bool {
        match self {
            TierType::Any => true,
            TierType::Local => kind == CandidateKind::Local,
            TierType::Provider => kind == CandidateKind::Provider,
        }
    }
}

/// How a tier ranks its candidates.
#[derive(Clone, Debug, PartialEq)]
pub enum Objective {
    /// Lowest value first; candidates without a value leave the tier.
    Minimize(CandidateAttr),
    /// By position of the provider (or backend) name in the list; names not
    /// listed leave the tier.
    Order(Vec<String>),
    /// Candidate order as generated (every candidate ties).
    RankOrder,
    /// The total cost under a worker-selection instance (an index into
    /// [`RulePolicy::cost_policies`]); rows its filters drop leave the tier.
    PolicyCost(usize),
}

/// A select tier.
#[derive(Clone, Debug, PartialEq)]
pub struct Tier {
    pub kind: TierType,
    pub objective: Objective,
}

/// Among equally ranked candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum TieBreak {
    PreferLocal,
    Random,
}

/// When no tier has a survivor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum OnEmpty {
    Reject,
    FallThrough,
}

impl Objective {
    fn attr_name(a: &CandidateAttr) -> &'static str {
        match a {
            CandidateAttr::PredictedTtft => "PredictedTTFT",
            CandidateAttr::KvUsage => "kvUsage",
            CandidateAttr::ActiveRequests => "activeRequests",
            CandidateAttr::WaitingRequests => "waitingRequests",
            _ => "objective",
        }
    }
}

impl CandidateAttr {
    fn name(&self) -> &'static str {
        Objective::attr_name(self)
    }
}

/// One compiled rule.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledRule {
    pub name: String,
    /// `None`: every request. Otherwise OR over entries, AND within one.
    pub matches: Option<Vec<Vec<CompiledPredicate<RequestAttr>>>>,
    /// `None`: every local endpoint of the request's model.
    pub consider: Option<Vec<Consider>>,
    pub exclude: Vec<Exclude>,
    pub tiers: Vec<Tier>,
    pub tie_break: Option<TieBreak>,
    pub on_empty: OnEmpty,
}

/// An off-cluster provider from the `providers:` section.
#[derive(Clone, Debug, PartialEq)]
pub struct ProviderSpec {
    pub name: String,
    pub models: Vec<String>,
    pub endpoint: String,
    /// `key=value`.
    pub labels: Vec<String>,
}

/// The built-in `length` classifier: prompt tokens to `complexity-low`
/// (below `low`), `complexity-medium`, `complexity-high` (at least `high`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LengthClassifier {
    pub low: u32,
    pub high: u32,
}

impl LengthClassifier {
    pub fn tag(&self, prompt_tokens: u32) -> &'static str {
        if prompt_tokens < self.low {
            "complexity-low"
        } else if prompt_tokens >= self.high {
            "complexity-high"
        } else {
            "complexity-medium"
        }
    }
}

/// The `regex` classifier: named patterns over the request's text. For each
/// pattern, a match tags `NAME-confirmed` and no match adds no tag. A text
/// that is missing or longer than the byte budget is skipped: like any
/// skipped classifier it emits no tag, unless `unknown_when_skipped` asks for
/// an explicit `NAME-unknown` (so a restrictive rule that also matches
/// `-unknown` catches what could not be scanned). Matching is linear in the
/// text (the `regex` crate), so the byte budget bounds its time.
#[derive(Debug)]
pub struct RegexClassifier {
    pub max_text_bytes: usize,
    pub unknown_when_skipped: bool,
    patterns: Vec<(String, regex::Regex, String, String)>,
}

impl RegexClassifier {
    pub(crate) fn new(
        max_text_bytes: usize,
        unknown_when_skipped: bool,
        patterns: Vec<(String, regex::Regex)>,
    ) -> Self {
        RegexClassifier {
            max_text_bytes,
            unknown_when_skipped,
            patterns: patterns
                .into_iter()
                .map(|(name, re)| {
                    let confirmed = format!("{name}-confirmed");
                    let unknown = format!("{name}-unknown");
                    (name, re, confirmed, unknown)
                })
                .collect(),
        }
    }

    /// Adds this classifier's tags for `text` (stops when `tags` is full).
    pub fn classify<'a>(&'a self, text: Option<&str>, tags: &mut TagBuf<'a>) {
        for (_, re, confirmed, unknown) in &self.patterns {
            let tag = match text {
                Some(t) if t.len() <= self.max_text_bytes => {
                    if re.is_match(t) {
                        confirmed.as_str()
                    } else {
                        continue;
                    }
                }
                _ if self.unknown_when_skipped => unknown.as_str(),
                _ => continue,
            };
            if !tags.push(tag) {
                return;
            }
        }
    }

    pub fn pattern_names(&self) -> impl Iterator<Item = &str> {
        self.patterns.iter().map(|p| p.0.as_str())
    }
}

impl PartialEq for RegexClassifier {
    fn eq(&self, other: &Self) -> bool {
        self.max_text_bytes == other.max_text_bytes
            && self.unknown_when_skipped == other.unknown_when_skipped
            && self.patterns.len() == other.patterns.len()
            && self
                .patterns
                .iter()
                .zip(&other.patterns)
                .all(|(a, b)| a.0 == b.0 && a.1.as_str() == b.1.as_str())
    }
}

/// A compiled rule policy.
#[derive(Clone, Debug)]
pub struct RulePolicy {
    pub rules: Vec<CompiledRule>,
    pub providers: Vec<ProviderSpec>,
    pub length: Option<LengthClassifier>,
    /// Shared so the host can produce tags borrowed from it while the engine
    /// is busy deciding.
    pub regex: Option<std::sync::Arc<RegexClassifier>>,
    /// Worker-selection instances that tiers rank by, by name.
    pub cost_policies: Vec<String>,
    /// Where those instances come from (set when `cost_policies` is not empty).
    pub plugins: Option<crate::registry::RouterPlugins>,
    pub ttft: TtftPredictor,
    pub seed: u64,
}

/// How a decision ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This candidate (an index into the caller's slice) serves the request.
    Chosen(usize),
    /// The matched rule found no candidate and rejects.
    Rejected,
    /// No rule matched (or every matching rule fell through).
    NoRuleMatched,
    /// The request's exact target did not survive the matching rule's
    /// `consider` and `exclude`.
    PinExcluded,
}

/// A decision and its explanation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub outcome: Outcome,
    /// Index of the rule that decided.
    pub rule: Option<usize>,
    /// Index of the tier that chose.
    pub tier: Option<usize>,
    /// Candidates after `consider`, and after `exclude`, in the deciding rule.
    pub considered: usize,
    pub after_exclude: usize,
    /// Rules that matched but fell through before this one.
    pub fell_through: usize,
}

/// Runs a compiled policy. One per thread of decisions; keeps its buffers.
#[derive(Debug)]
pub struct RuleEngine {
    policy: std::sync::Arc<RulePolicy>,
    rng: PolicyRng,
    survivors: Vec<u32>,
    ranked: Vec<(f64, u32)>,
    /// Per `cost_policies` entry, one instance for each role (a tier ranks
    /// a request with its own role's), and the buffers they run in.
    cost_instances: Vec<Vec<crate::policy::WorkerSelectionPolicy>>,
    cost_table: crate::table::CandidateTable,
    cost_rows: Vec<u32>,
    costs: Vec<f64>,
}

impl RuleEngine {
    pub fn new(policy: RulePolicy) -> Self {
        let rng = PolicyRng::seed_from_u64(policy.seed);
        let cost_instances = match &policy.plugins {
            Some(plugins) => policy
                .cost_policies
                .iter()
                .map(|name| {
                    crate::context::WorkerType::ALL
                        .iter()
                        .filter_map(|&role| {
                            plugins.build_instance(
                                name,
                                &crate::context::RoutingPartition::new(role, "rules"),
                            )
                        })
                        .collect()
                })
                .collect(),
            None => Vec::new(),
        };
        RuleEngine {
            policy: std::sync::Arc::new(policy),
            rng,
            survivors: Vec::new(),
            ranked: Vec::new(),
            cost_instances,
            cost_table: crate::table::CandidateTable::new(),
            cost_rows: Vec::new(),
            costs: Vec::new(),
        }
    }

    pub fn policy(&self) -> &RulePolicy {
        &self.policy
    }

    /// The policy, shared: candidates built from it (provider names) can be
    /// borrowed while the engine decides.
    pub fn shared_policy(&self) -> std::sync::Arc<RulePolicy> {
        std::sync::Arc::clone(&self.policy)
    }

    /// Adds the `length` classifier's tag to `tags` (if configured and
    /// there is room); returns whether it added one.
    pub fn classify<'a>(&self, prompt_tokens: u32, tags: &mut TagBuf<'a>) -> bool {
        match self.policy.length {
            Some(l) => tags.push(l.tag(prompt_tokens)),
            None => false,
        }
    }

    /// Evaluates the rules for `request` over `candidates` (local endpoints
    /// and providers, in rank order).
    pub fn decide(
        &mut self,
        request: &RuleRequest<'_>,
        candidates: &[RuleCandidate<'_>],
    ) -> Decision {
        let mut fell_through = 0;
        let ttft = self.policy.ttft;
        for (index, rule) in self.policy.rules.iter().enumerate() {
            let matched = match &rule.matches {
                None => true,
                Some(entries) => entries
                    .iter()
                    .any(|preds| preds.iter().all(|p| p.op.eval(p.attr.value(request)))),
            };
            if !matched {
                continue;
            }
            // consider
            self.survivors.clear();
            for (i, c) in candidates.iter().enumerate() {
                let keep = match &rule.consider {
                    None => c.kind == CandidateKind::Local && c.model == request.model,
                    Some(entries) => entries.iter().any(|e| considers(e, c)),
                };
                if keep {
                    self.survivors.push(i as u32);
                }
            }
            let considered = self.survivors.len();
            // exclude
            for e in &rule.exclude {
                if !e.when.iter().all(|p| p.op.eval(p.attr.value(request))) {
                    continue;
                }
                self.survivors.retain(|&i| {
                    let c = &candidates[i as usize];
                    !e.drop
                        .iter()
                        .all(|p| p.op.eval(p.attr.value(c, request, &ttft)))
                });
            }
            let after_exclude = self.survivors.len();
            // An exact target is the choice if the rule keeps it.
            if let Some(pin) = request.pinned {
                let kept = self.survivors.iter().find(|&&i| {
                    let c = &candidates[i as usize];
                    c.kind == CandidateKind::Local && c.worker == Some(pin)
                });
                return Decision {
                    outcome: match kept {
                        Some(&i) => Outcome::Chosen(i as usize),
                        None => Outcome::PinExcluded,
                    },
                    rule: Some(index),
                    tier: None,
                    considered,
                    after_exclude,
                    fell_through,
                };
            }
            // select
            for (t, tier) in rule.tiers.iter().enumerate() {
                self.ranked.clear();
                if let Objective::PolicyCost(slot) = tier.objective {
                    let role = request
                        .role
                        .and_then(crate::context::WorkerType::parse)
                        .unwrap_or(crate::context::WorkerType::Aggregated);
                    rank_by_policy(
                        self.cost_instances
                            .get_mut(slot)
                            .and_then(|by_role| by_role.get_mut(role as usize)),
                        request,
                        candidates,
                        &self.survivors,
                        &mut self.cost_table,
                        &mut self.cost_rows,
                        &mut self.costs,
                        &mut self.ranked,
                        &ttft,
                    );
                }
                let by_attribute = !matches!(tier.objective, Objective::PolicyCost(_));
                for &i in self.survivors.iter().filter(|_| by_attribute) {
                    let c = &candidates[i as usize];
                    if !tier.kind.admits(c.kind) {
                        continue;
                    }
                    let key = match &tier.objective {
                        Objective::RankOrder => Some(0.0),
                        Objective::PolicyCost(_) => None,
                        Objective::Minimize(attr) => {
                            attr.objective(c, request, &ttft).filter(|v| !v.is_nan())
                        }
                        Objective::Order(names) => {
                            let name = match c.kind {
                                CandidateKind::Provider => c.provider,
                                CandidateKind::Local => c.backend,
                            };
                            name.and_then(|n| names.iter().position(|x| x == n))
                                .map(|p| p as f64)
                        }
                    };
                    if let Some(k) = key {
                        self.ranked.push((k, i));
                    }
                }
                if self.ranked.is_empty() {
                    continue;
                }
                let chosen = break_tie(&self.ranked, candidates, rule.tie_break, &mut self.rng);
                return Decision {
                    outcome: Outcome::Chosen(chosen),
                    rule: Some(index),
                    tier: Some(t),
                    considered,
                    after_exclude,
                    fell_through,
                };
            }
            match rule.on_empty {
                OnEmpty::FallThrough => fell_through += 1,
                OnEmpty::Reject => {
                    return Decision {
                        outcome: Outcome::Rejected,
                        rule: Some(index),
                        tier: None,
                        considered,
                        after_exclude,
                        fell_through,
                    };
                }
            }
        }
        Decision {
            outcome: Outcome::NoRuleMatched,
            rule: None,
            tier: None,
            considered: 0,
            after_exclude: 0,
            fell_through,
        }
    }
}

/// Ranks the local survivors by a worker-selection instance's total cost.
#[allow(clippy::too_many_arguments)]
fn rank_by_policy(
    instance: Option<&mut crate::policy::WorkerSelectionPolicy>,
    request: &RuleRequest<'_>,
    candidates: &[RuleCandidate<'_>],
    survivors: &[u32],
    table: &mut crate::table::CandidateTable,
    rows: &mut Vec<u32>,
    costs: &mut Vec<f64>,
    ranked: &mut Vec<(f64, u32)>,
    ttft: &crate::predict::TtftPredictor,
) {
    let Some(instance) = instance else {
        return;
    };
    table.reset(crate::inputs::WorkerInputs::ALL);
    rows.clear();
    for &i in survivors {
        let c = &candidates[i as usize];
        if c.kind != CandidateKind::Local {
            continue;
        }
        table.push(c.as_candidate_row(ttft.predict_terms(c, request).as_ref()));
        rows.push(i);
    }
    if rows.is_empty() {
        return;
    }
    let ctx = request.selection.unwrap_or_else(|| {
        crate::context::WorkerSelectionContext::new("", request.prompt_tokens, request.block_size)
    });
    if instance.costs_into(&ctx, table, costs).is_err() {
        return;
    }
    for (&i, &cost) in rows.iter().zip(costs.iter()) {
        if cost.is_finite() {
            ranked.push((cost, i));
        }
    }
}

fn considers(e: &Consider, c: &RuleCandidate<'_>) -> bool {
    match e {
        Consider::Models(names) => {
            c.kind == CandidateKind::Local && names.iter().any(|n| n == c.model)
        }
        Consider::Backends { names, labels } => {
            c.kind == CandidateKind::Local
                && (names.is_empty() || c.backend.is_some_and(|b| names.iter().any(|n| n == b)))
                && labels.iter().all(|l| c.labels.iter().any(|x| x == l))
        }
        Consider::Providers(names) => {
            c.kind == CandidateKind::Provider
                && (names.is_empty() || c.provider.is_some_and(|p| names.iter().any(|n| n == p)))
        }
    }
}

/// The lowest key wins; among equal keys: the first local one
/// (`PreferLocal`), a seeded uniform choice (`Random`), or the first in rank
/// order (omitted).
fn break_tie(
    ranked: &[(f64, u32)],
    candidates: &[RuleCandidate<'_>],
    tie_break: Option<TieBreak>,
    rng: &mut PolicyRng,
) -> usize {
    let best = ranked.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    let tied = || {
        ranked
            .iter()
            .filter(move |r| r.0 == best)
            .map(|r| r.1 as usize)
    };
    match tie_break {
        None => tied().next().unwrap_or(0),
        Some(TieBreak::PreferLocal) => tied()
            .find(|&i| candidates[i].kind == CandidateKind::Local)
            .or_else(|| tied().next())
            .unwrap_or(0),
        Some(TieBreak::Random) => {
            let n = tied().count();
            tied().nth(rng.below(n.max(1))).unwrap_or(0)
        }
    }
}

/// A fixed-capacity tag list (client tags plus classifier tags), so that
/// building a request's tags allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct TagBuf<'a> {
    tags: [&'a str; MAX_TAGS],
    len: usize,
}

impl Default for TagBuf<'_> {
    fn default() -> Self {
        TagBuf {
            tags: [""; MAX_TAGS],
            len: 0,
        }
    }
}

impl<'a> TagBuf<'a> {
    /// An empty buffer when `needed`, else none (it is a few hundred bytes
    /// to clear, which a request without tags or rules need not pay).
    pub fn default_if(needed: bool) -> Option<Self> {
        needed.then(Self::default)
    }

    /// Adds a tag; false (and nothing added) when full.
    pub fn push(&mut self, tag: &'a str) -> bool {
        if self.len == MAX_TAGS {
            return false;
        }
        self.tags[self.len] = tag;
        self.len += 1;
        true
    }

    pub fn as_slice(&self) -> &[&'a str] {
        &self.tags[..self.len]
    }
}
