//! What rules read: the request and the candidates (local endpoints and
//! off-cluster providers), their attribute names as written in YAML, and
//! the PredictedTTFT model.

use crate::context::AgentHeaders;
use crate::predict::{TtftInputs, TtftPredictor, TtftTerms};
use crate::table::WorkerWithDpRank;

use super::predicate::AttrValue;

/// Most tags a request carries: up to 32 from the client (the query
/// protocol's limit) plus the classifiers' (one per length classifier and
/// regex pattern; past this, further classifier tags are not added).
pub const MAX_TAGS: usize = 48;

/// The request, borrowed from the host for one decision.
#[derive(Clone, Copy, Debug)]
pub struct RuleRequest<'a> {
    pub model: &'a str,
    pub tenant: Option<&'a str>,
    pub role: Option<&'a str>,
    pub prompt_tokens: u32,
    pub block_size: u32,
    pub session_id: Option<&'a str>,
    pub priority: i32,
    pub headers: Option<&'a AgentHeaders>,
    /// `type-degree` tags: sent by the client or produced by classifiers.
    pub tags: &'a [&'a str],
    /// The context the host's worker-selection policies see for this
    /// request (session, soft-affinity target, headers, priority, clock):
    /// a `minimize: { policy: ... }` tier ranks with it. `None`: a bare
    /// context of the prompt's size.
    pub selection: Option<crate::context::WorkerSelectionContext<'a>>,
    /// An exact target (an explicit one, or a hard session binding): when
    /// it survives the matching rule's `consider` and `exclude` it is the
    /// choice, ahead of the tiers; when it does not, the decision is
    /// [`super::Outcome::PinExcluded`].
    pub pinned: Option<WorkerWithDpRank>,
}

impl RuleRequest<'_> {
    pub fn request_blocks(&self) -> u64 {
        u64::from(self.prompt_tokens).div_ceil(u64::from(self.block_size.max(1)))
    }
}

/// Where a candidate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CandidateKind {
    /// A worker on this node, with load and cache signals.
    Local,
    /// An off-cluster inference provider: no load or cache signals.
    Provider,
}

/// One candidate endpoint. Signals a candidate does not have are `None`;
/// providers have none of the load and cache signals.
#[derive(Clone, Copy, Debug)]
pub struct RuleCandidate<'a> {
    pub kind: CandidateKind,
    pub model: &'a str,
    pub backend: Option<&'a str>,
    /// Backend labels as `key=value`.
    pub labels: &'a [String],
    pub provider: Option<&'a str>,
    pub worker: Option<WorkerWithDpRank>,
    pub role: Option<&'a str>,
    pub kv_usage: Option<f64>,
    pub active_requests: Option<u32>,
    pub waiting_requests: Option<u32>,
    pub device_overlap_blocks: Option<u32>,
    pub host_overlap_blocks: Option<u32>,
    pub disk_overlap_blocks: Option<u32>,
    pub active_prefill_tokens: Option<u64>,
    pub active_decode_blocks: Option<u64>,
    /// This worker's prefill throughput, when known (learned or configured);
    /// otherwise the policy's default applies.
    pub prefill_tokens_per_second: Option<f64>,
    /// The host's own TTFT prediction for this worker, the one its
    /// worker-selection policies see: when given, it is the candidate's
    /// `PredictedTTFT`, so rules and policies rank by one number. Without
    /// it (a host that predicts nothing), the predictor runs over the
    /// attributes above.
    pub ttft: Option<TtftTerms>,
}

impl<'a> RuleCandidate<'a> {
    /// A local worker with no signals yet.
    pub fn local(model: &'a str, worker: WorkerWithDpRank) -> Self {
        RuleCandidate {
            kind: CandidateKind::Local,
            model,
            backend: None,
            labels: &[],
            provider: None,
            worker: Some(worker),
            role: None,
            kv_usage: None,
            active_requests: None,
            waiting_requests: None,
            device_overlap_blocks: None,
            host_overlap_blocks: None,
            disk_overlap_blocks: None,
            active_prefill_tokens: None,
            active_decode_blocks: None,
            prefill_tokens_per_second: None,
            ttft: None,
        }
    }

    /// The candidate as a worker-selection row (missing signals as zero;
    /// KV usage as parts per million of a nominal capacity), with its
    /// predicted TTFT.
    pub fn as_candidate_row(&self, ttft: Option<&TtftTerms>) -> crate::table::CandidateRow {
        use crate::table::{CacheRow, CandidateRow, LoadRow, OccupancyRow};
        const NOMINAL: u64 = 1_000_000;
        CandidateRow {
            worker: self.worker.unwrap_or_default(),
            cache: CacheRow {
                device_blocks: self.device_overlap_blocks.unwrap_or(0),
                host_blocks: self.host_overlap_blocks.unwrap_or(0),
                disk_blocks: self.disk_overlap_blocks.unwrap_or(0),
                shared_beyond_blocks: 0,
            },
            load: LoadRow {
                active_requests: self.active_requests.unwrap_or(0),
                waiting_requests: self.waiting_requests.unwrap_or(0),
                active_prefill_tokens: self.active_prefill_tokens.unwrap_or(0),
                active_decode_blocks: self.active_decode_blocks.unwrap_or(0),
            },
            occupancy: OccupancyRow {
                kv_used_blocks: (self.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0) * NOMINAL as f64)
                    as u64,
                kv_total_blocks: NOMINAL,
            },
            preferred_taint_multiplier: None,
            predicted_ttft_s: ttft.map(|t| t.total_s()),
            predicted_prefill_s: ttft.map(|t| t.prefill_s),
            recent_selections: None,
        }
    }

    /// An off-cluster provider serving `model`.
    pub fn provider(name: &'a str, model: &'a str) -> Self {
        RuleCandidate {
            kind: CandidateKind::Provider,
            provider: Some(name),
            worker: None,
            ..RuleCandidate::local(model, WorkerWithDpRank::default())
        }
    }
}

/// Request attributes, by YAML name: `model`, `tenant`, `role`,
/// `promptTokens`, `requestBlocks`, `sessionId`, `priority`, `tag`,
/// `header.<name>`.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestAttr {
    Model,
    Tenant,
    Role,
    PromptTokens,
    RequestBlocks,
    SessionId,
    Priority,
    Tag,
    Header(String),
}

impl RequestAttr {
    pub const NAMES: &'static str =
        "model, tenant, role, promptTokens, requestBlocks, sessionId, priority, tag, header.<name>";

    pub fn parse(name: &str) -> Option<RequestAttr> {
        Some(match name {
            "model" => RequestAttr::Model,
            "tenant" => RequestAttr::Tenant,
            "role" => RequestAttr::Role,
            "promptTokens" => RequestAttr::PromptTokens,
            "requestBlocks" => RequestAttr::RequestBlocks,
            "sessionId" => RequestAttr::SessionId,
            "priority" => RequestAttr::Priority,
            "tag" | "tags" => RequestAttr::Tag,
            _ => {
                let header = name.strip_prefix("header.")?;
                if header.is_empty() {
                    return None;
                }
                RequestAttr::Header(header.to_ascii_lowercase())
            }
        })
    }

    pub fn value<'a>(&'a self, r: &RuleRequest<'a>) -> Option<AttrValue<'a>> {
        match self {
            RequestAttr::Model => Some(AttrValue::Str(r.model)),
            RequestAttr::Tenant => r.tenant.map(AttrValue::Str),
            RequestAttr::Role => r.role.map(AttrValue::Str),
            RequestAttr::PromptTokens => Some(AttrValue::Num(f64::from(r.prompt_tokens))),
            RequestAttr::RequestBlocks => Some(AttrValue::Num(r.request_blocks() as f64)),
            RequestAttr::SessionId => r.session_id.map(AttrValue::Str),
            RequestAttr::Priority => Some(AttrValue::Num(f64::from(r.priority))),
            RequestAttr::Tag => Some(AttrValue::Set(r.tags)),
            RequestAttr::Header(name) => r.headers.and_then(|h| h.get(name)).map(AttrValue::Str),
        }
    }
}

/// Candidate attributes, by YAML name: `type`, `model`, `backend.name`,
/// `backend.labels.<key>`, `provider.name`, `workerId`, `dpRank`, `role`,
/// `kvUsage`, `activeRequests`, `waitingRequests`, `deviceOverlapBlocks`,
/// `hostOverlapBlocks`, `diskOverlapBlocks`, `PredictedTTFT`.
#[derive(Clone, Debug, PartialEq)]
pub enum CandidateAttr {
    Type,
    Model,
    BackendName,
    BackendLabel(String),
    ProviderName,
    WorkerId,
    DpRank,
    Role,
    KvUsage,
    ActiveRequests,
    WaitingRequests,
    DeviceOverlapBlocks,
    HostOverlapBlocks,
    DiskOverlapBlocks,
    PredictedTtft,
}

impl CandidateAttr {
    pub const NAMES: &'static str = "type, model, backend.name, backend.labels.<key>, provider.name, workerId, dpRank, role, kvUsage, activeRequests, waitingRequests, deviceOverlapBlocks, hostOverlapBlocks, diskOverlapBlocks, PredictedTTFT";

    pub fn parse(name: &str) -> Option<CandidateAttr> {
        Some(match name {
            "type" => CandidateAttr::Type,
            "model" => CandidateAttr::Model,
            "backend.name" => CandidateAttr::BackendName,
            "provider.name" => CandidateAttr::ProviderName,
            "workerId" => CandidateAttr::WorkerId,
            "dpRank" => CandidateAttr::DpRank,
            "role" => CandidateAttr::Role,
            "kvUsage" => CandidateAttr::KvUsage,
            "activeRequests" => CandidateAttr::ActiveRequests,
            "waitingRequests" => CandidateAttr::WaitingRequests,
            "deviceOverlapBlocks" => CandidateAttr::DeviceOverlapBlocks,
            "hostOverlapBlocks" => CandidateAttr::HostOverlapBlocks,
            "diskOverlapBlocks" => CandidateAttr::DiskOverlapBlocks,
            "PredictedTTFT" => CandidateAttr::PredictedTtft,
            _ => {
                let key = name.strip_prefix("backend.labels.")?;
                if key.is_empty() {
                    return None;
                }
                CandidateAttr::BackendLabel(key.to_owned())
            }
        })
    }

    /// The value of a numeric objective (`minimize`), without going through
    /// [`AttrValue`].
    #[inline]
    pub fn objective(
        &self,
        c: &RuleCandidate<'_>,
        r: &RuleRequest<'_>,
        ttft: &TtftPredictor,
    ) -> Option<f64> {
        match self {
            CandidateAttr::PredictedTtft => ttft.predict(c, r),
            CandidateAttr::KvUsage => c.kv_usage,
            CandidateAttr::ActiveRequests => c.active_requests.map(f64::from),
            CandidateAttr::WaitingRequests => c.waiting_requests.map(f64::from),
            _ => None,
        }
    }

    /// Whether a provider candidate can have this attribute.
    pub fn defined_for_providers(&self) -> bool {
        matches!(
            self,
            CandidateAttr::Type
                | CandidateAttr::Model
                | CandidateAttr::ProviderName
                | CandidateAttr::BackendLabel(_)
        )
    }

    #[inline]
    pub fn value<'a>(
        &'a self,
        c: &RuleCandidate<'a>,
        r: &RuleRequest<'_>,
        ttft: &TtftPredictor,
    ) -> Option<AttrValue<'a>> {
        let num = |v: Option<u32>| v.map(|n| AttrValue::Num(f64::from(n)));
        match self {
            CandidateAttr::Type => Some(AttrValue::Str(match c.kind {
                CandidateKind::Local => "Local",
                CandidateKind::Provider => "Provider",
            })),
            CandidateAttr::Model => Some(AttrValue::Str(c.model)),
            CandidateAttr::BackendName => c.backend.map(AttrValue::Str),
            CandidateAttr::BackendLabel(key) => c.labels.iter().find_map(|l| {
                l.strip_prefix(key.as_str())
                    .and_then(|rest| rest.strip_prefix('='))
                    .map(AttrValue::Str)
            }),
            CandidateAttr::ProviderName => c.provider.map(AttrValue::Str),
            CandidateAttr::WorkerId => c.worker.map(|w| AttrValue::Num(w.worker_id as f64)),
            CandidateAttr::DpRank => c.worker.map(|w| AttrValue::Num(f64::from(w.dp_rank))),
            CandidateAttr::Role => c.role.map(AttrValue::Str),
            CandidateAttr::KvUsage => c.kv_usage.map(AttrValue::Num),
            CandidateAttr::ActiveRequests => num(c.active_requests),
            CandidateAttr::WaitingRequests => num(c.waiting_requests),
            CandidateAttr::DeviceOverlapBlocks => num(c.device_overlap_blocks),
            CandidateAttr::HostOverlapBlocks => num(c.host_overlap_blocks),
            CandidateAttr::DiskOverlapBlocks => num(c.disk_overlap_blocks),
            CandidateAttr::PredictedTtft => ttft.predict(c, r).map(AttrValue::Num),
        }
    }
}

impl TtftPredictor {
    /// A candidate's `PredictedTTFT`, seconds: [`TtftPredictor::terms`] over
    /// its attributes (the same model as the `predicted-ttft` policy), or
    /// `None` for a provider or a worker without load signals.
    #[inline]
    pub fn predict(&self, c: &RuleCandidate<'_>, r: &RuleRequest<'_>) -> Option<f64> {
        self.predict_terms(c, r).map(|t| t.total_s())
    }

    /// The prediction's terms for a local candidate.
    pub fn predict_terms(&self, c: &RuleCandidate<'_>, r: &RuleRequest<'_>) -> Option<TtftTerms> {
        if c.kind != CandidateKind::Local {
            return None;
        }
        if let Some(host) = c.ttft {
            return Some(host);
        }
        let inputs = TtftInputs {
            prompt_tokens: r.prompt_tokens,
            block_size: r.block_size,
            device_blocks: c.device_overlap_blocks.unwrap_or(0),
            host_blocks: c.host_overlap_blocks.unwrap_or(0),
            disk_blocks: c.disk_overlap_blocks.unwrap_or(0),
            queued_prefill_tokens: c.active_prefill_tokens?,
            waiting_requests: c.waiting_requests.unwrap_or(0),
            decode_blocks: c.active_decode_blocks.unwrap_or(0),
            learned_tokens_per_second: c.prefill_tokens_per_second,
            peer_tokens_per_second: None,
        };
        Some(self.terms(&inputs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicted_ttft_counts_backlog_uncached_prompt_and_queue() {
        let m = TtftPredictor {
            prefill_tokens_per_second: 1000.0,
            queue_wait_per_request: 0.1,
            ..TtftPredictor::default()
        };
        let r = RuleRequest {
            model: "m",
            tenant: None,
            role: None,
            prompt_tokens: 1000,
            block_size: 16,
            session_id: None,
            priority: 0,
            headers: None,
            tags: &[],
            selection: None,
            pinned: None,
        };
        let mut c = RuleCandidate::local("m", WorkerWithDpRank::new(1, 0));
        assert_eq!(m.predict(&c, &r), None, "no load signal, no prediction");
        c.active_prefill_tokens = Some(500);
        c.device_overlap_blocks = Some(25); // 400 tokens cached
        c.waiting_requests = Some(2);
        let t = m.predict(&c, &r).unwrap();
        assert!((t - ((500.0 + 600.0) / 1000.0 + 0.2)).abs() < 1e-12, "{t}");
        c.prefill_tokens_per_second = Some(2000.0);
        let t = m.predict(&c, &r).unwrap();
        assert!((t - (1100.0 / 2000.0 + 0.2)).abs() < 1e-12);
        assert_eq!(m.predict(&RuleCandidate::provider("p", "m"), &r), None);
    }
}
