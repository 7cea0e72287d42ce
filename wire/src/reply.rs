//! What a daemon answers, whatever the encoding: one [`Reply`] that the
//! binary frame and JSON line encoders both write. A select's reply
//! borrows its names (endpoint, policy, rule, provider) from the routing
//! state, so answering one allocates nothing.

use std::borrow::Cow;

use crate::Status;

/// The answer to one [`crate::Request`].
#[derive(Clone, Debug, PartialEq)]
pub enum Reply<'a> {
    /// A select's choice.
    Selected(Selected<'a>),
    /// `prefill_done` or `finish` took effect.
    Done,
    /// `attach_rings` was granted: the rings follow with the reply.
    RingsAttached {
        capacity: u64,
    },
    Workers(Vec<WorkerRow>),
    Stats(Box<Stats>),
    /// OpenMetrics text.
    Metrics(String),
    /// The configuration was loaded again (`reloads` so far).
    Reloaded {
        reloads: u64,
    },
    /// The most recent selections, newest first.
    Decisions(Vec<DecisionRow>),
    Error(ErrorReply<'a>),
}

/// One recent selection, as the `decisions` op shows it.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecisionRow {
    /// How long ago it was made, in milliseconds.
    pub age_ms: u64,
    /// The chosen worker (`None`: a provider, or none chosen).
    pub worker_id: Option<u64>,
    pub dp_rank: Option<u32>,
    /// The provider a rule chose.
    pub provider: Option<String>,
    /// `ok` or the error's status name.
    pub outcome: &'static str,
    pub role: &'static str,
    /// The policy serving the partition.
    pub policy: String,
    /// The rule that decided, and its tier (`select` entry); `None`
    /// without rules, or when the configuration was reloaded since.
    pub rule: Option<String>,
    pub tier: Option<usize>,
    /// `rule` (the rule language decided) or `policy`.
    pub stage: &'static str,
    /// Workers available for it, and left after the policy's filters.
    pub candidates: usize,
    pub survivors: usize,
    /// The prompt's full blocks and those cached on the chosen worker.
    pub prompt_blocks: u32,
    pub overlap_blocks: u32,
    /// Recent picks that sent the deepest prompt block a candidate held
    /// (a prefix many requests share has many; a conversation's own, few).
    pub prefix_sharers: u32,
    /// A dry run (nothing reserved).
    pub dry_run: bool,
}

impl<'a> Reply<'a> {
    /// An error reply.
    pub fn error(status: Status, message: impl Into<Cow<'a, str>>) -> Self {
        Reply::Error(ErrorReply {
            status,
            message: message.into(),
        })
    }

    /// The reply's status (`Ok` unless an error).
    pub fn status(&self) -> Status {
        match self {
            Reply::Error(e) => e.status,
            _ => Status::Ok,
        }
    }
}

/// An error: its status and a message for people.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply<'a> {
    pub status: Status,
    pub message: Cow<'a, str>,
}

impl std::fmt::Display for ErrorReply<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

/// Where a select sends the request.
#[derive(Clone, Debug, PartialEq)]
pub struct Selected<'a> {
    /// The chosen worker (id, dp rank); `None` when a rule chose a
    /// provider.
    pub worker: Option<(u64, u32)>,
    /// The provider's name when a rule chose one.
    pub provider: Option<&'a str>,
    pub endpoint: &'a str,
    /// Prefix overlap on the chosen worker: device, host, disk blocks.
    pub overlap_blocks: [u32; 3],
    /// The policy's cost of the choice (NaN: none, e.g. chosen by a rule).
    pub cost: f64,
    /// The worker-selection policy instance serving the partition.
    pub policy: &'a str,
    /// The rule that decided, when rules are configured.
    pub rule: Option<&'a str>,
    /// The id to report `prefill_done` and `finish` with.
    pub request_id: u64,
    /// How the choice was made, when asked for.
    pub explain: Option<Box<Explanation>>,
}

impl Selected<'_> {
    /// The part of the answer a binary reply frame carries.
    pub fn view(&self) -> SelectView<'_> {
        let (worker_id, dp_rank) = self.worker.unwrap_or_default();
        SelectView {
            worker_id,
            dp_rank,
            request_id: self.request_id,
            cost: self.cost,
            overlap_blocks: self.overlap_blocks,
            provider: self.provider.is_some(),
            endpoint: self.endpoint,
            provider_name: self.provider.unwrap_or(""),
        }
    }
}

/// A select answer as a binary reply frame carries it, borrowed from the
/// client's buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectView<'a> {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub request_id: u64,
    /// NaN: none.
    pub cost: f64,
    pub overlap_blocks: [u32; 3],
    /// A provider, not a worker, was chosen.
    pub provider: bool,
    pub endpoint: &'a str,
    /// The chosen provider's name (empty for a worker).
    pub provider_name: &'a str,
}

impl SelectView<'_> {
    pub fn to_owned(&self) -> SelectReply {
        SelectReply {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            request_id: self.request_id,
            cost: self.cost,
            overlap_blocks: self.overlap_blocks,
            provider: self.provider,
            endpoint: self.endpoint.to_owned(),
            provider_name: self.provider_name.to_owned(),
        }
    }
}

/// An owned [`SelectView`].
#[derive(Clone, Debug, PartialEq)]
pub struct SelectReply {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub request_id: u64,
    pub cost: f64,
    pub overlap_blocks: [u32; 3],
    pub provider: bool,
    pub endpoint: String,
    /// The chosen provider's name (empty for a worker).
    pub provider_name: String,
}

/// How a select was decided (`explain`).
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Explanation {
    /// Candidates the deciding stage saw.
    pub candidates: usize,
    /// Candidates left after the policy's filters (or the rule's exclude).
    pub survivors: usize,
    /// Rule path: the deciding tier, the candidates after `consider` and
    /// after `exclude`, and the rules that fell through.
    pub tier: Option<usize>,
    pub considered: usize,
    pub after_exclude: usize,
    pub fell_through: usize,
    /// Recent picks that sent the deepest prompt block some candidate holds
    /// (what `prefill-times-requests` compares with `min_sharers`).
    pub prefix_sharers: u32,
    /// Every available worker of the request's role, with its signals.
    pub workers: Vec<ExplainedWorker>,
}

/// One worker's signals at an explained select.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, PartialEq)]
pub struct ExplainedWorker {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub model: String,
    /// Its cost under the partition's policy (`None`: filtered out, or not
    /// computed because a rule decided).
    pub cost: Option<f64>,
    #[cfg_attr(feature = "json", serde(serialize_with = "crate::json::tiers"))]
    pub overlap_blocks: [u32; 3],
    pub active_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    /// The requests kvedge sent it lately, a count halving every 10 s (what
    /// `predicted-ttft`'s `balance_weight` compares), before this one.
    pub recent_selections: f64,
    /// Its predicted time to first token for this request, term by term.
    pub ttft: TtftExplained,
}

/// A worker's TTFT prediction at an explained select (the predictor of
/// the `predicted-ttft` policy and the rules' `PredictedTTFT`), before the
/// chosen worker was reserved.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftExplained {
    /// The prefill queued ahead, over the speed.
    pub queue_ms: f64,
    /// The request's own uncached prefill (host and disk hits priced apart).
    pub prefill_ms: f64,
    /// The wait per request queued on the worker.
    pub wait_ms: f64,
    /// The worker's decoding requests' share of the steps until the first
    /// token.
    pub decode_ms: f64,
    pub total_ms: f64,
    /// The prefill speed used, and where it came from: `learned` from the
    /// worker's completed prefills, its `peers`' mean (it has learned none
    /// yet), or the configured `prior` (no worker has).
    pub tokens_per_second: f64,
    pub speed: &'static str,
}

/// One registered worker, as `workers` and the metrics report it.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerRow {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub model: String,
    pub role: &'static str,
    pub endpoint: String,
    /// Its engine's lifecycle state (`live`, `resyncing`, ...).
    pub state: &'static str,
    /// Routable: registered and its heartbeat on time.
    pub available: bool,
    /// Report plus kvedge's own projection.
    pub active_requests: u32,
    pub waiting_requests: u32,
    pub active_prefill_tokens: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// Device-tier blocks in the index.
    pub device_blocks: u64,
    /// The prefill speed its TTFT predictions use, tokens per second, and
    /// where it comes from (`learned`, `peers` or `prior`).
    pub prefill_tokens_per_second: u64,
    pub speed: &'static str,
    /// Requests it was picked for since it registered (dry runs not
    /// counted), their prompts' full blocks, and how many of those were
    /// in its device cache (or reserved there) when it was picked: its hit
    /// rate is `picked_cached_blocks / picked_prompt_blocks`.
    pub picks: u64,
    pub picked_prompt_blocks: u64,
    pub picked_cached_blocks: u64,
    /// What its engine reported about its own feed (mismatches, lost
    /// events), by code.
    pub notices: Vec<WorkerNotice>,
    /// Its labels as `key=value` (the rule language's backends).
    pub labels: Vec<String>,
}

/// One kind of notice an engine reported.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerNotice {
    /// Its name (`block_size_mismatch`, `events_lost`, ...).
    pub code: &'static str,
    /// How many times so far.
    pub count: u64,
    /// What happened and how to fix it.
    pub message: String,
    /// Whether it stands now: false once the engine's producer said the
    /// condition is over (an engine heard again, its load read again).
    pub active: bool,
}

/// The daemon's counters (`stats`).
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub workers: usize,
    pub clients: usize,
    pub query_channels: usize,
    pub index_entries: usize,
    pub index_refused_full: u64,
    pub reservations: usize,
    pub selects: u64,
    pub errors: u64,
    pub select_latency: LatencySummary,
    pub reloads: u64,
    pub reload_failures: u64,
    pub refused_registrations: u64,
    pub refused_connections: u64,
}

/// A latency distribution, in microseconds. The quantiles are the upper
/// edges of the daemon's histogram buckets (at most the maximum): at most
/// 6.25% above the true quantile.
#[cfg_attr(feature = "json", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}
