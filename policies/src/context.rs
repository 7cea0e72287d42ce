//! The request as a policy sees it: prompt size, priority, pinning, session
//! metadata, the soft-affinity target, agent headers and the host's clock.
//!
//! Everything is borrowed from the host for the duration of one selection;
//! nothing here is copied per request.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::table::WorkerWithDpRank;

/// The worker pool a policy instance serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerType {
    Aggregated,
    Prefill,
    Decode,
    Encode,
}

impl WorkerType {
    pub const ALL: [WorkerType; 4] = [
        WorkerType::Aggregated,
        WorkerType::Prefill,
        WorkerType::Decode,
        WorkerType::Encode,
    ];

    /// The lowercase role name used in YAML and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            WorkerType::Aggregated => "aggregated",
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
            WorkerType::Encode => "encode",
        }
    }

    /// Parses a role name as written by [`WorkerType::as_str`].
    pub fn parse(name: &str) -> Option<WorkerType> {
        WorkerType::ALL.into_iter().find(|t| t.as_str() == name)
    }
}

impl fmt::Display for WorkerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One routing partition: a role and a model. Each gets its own policy
/// instance with its own state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RoutingPartition {
    pub worker_type: WorkerType,
    pub model: String,
}

impl RoutingPartition {
    pub fn new(worker_type: WorkerType, model: impl Into<String>) -> Self {
        RoutingPartition {
            worker_type,
            model: model.into(),
        }
    }
}

/// What started this turn of an agent session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputTrigger {
    UserMessage,
    ToolResult,
    Other,
}

/// Session metadata of a request, when it has any.
#[derive(Clone, Copy, Debug)]
pub struct SessionContext<'a> {
    session_id: &'a str,
    parent_session_id: Option<&'a str>,
    is_final: bool,
    input_trigger: InputTrigger,
}

impl<'a> SessionContext<'a> {
    pub fn new(session_id: &'a str, input_trigger: InputTrigger) -> Self {
        SessionContext {
            session_id,
            parent_session_id: None,
            is_final: false,
            input_trigger,
        }
    }

    pub fn with_parent(mut self, parent: &'a str) -> Self {
        self.parent_session_id = Some(parent);
        self
    }

    pub fn with_final(mut self, is_final: bool) -> Self {
        self.is_final = is_final;
        self
    }

    pub fn session_id(&self) -> &'a str {
        self.session_id
    }

    pub fn parent_session_id(&self) -> Option<&'a str> {
        self.parent_session_id
    }

    /// True on the session's last turn.
    pub fn is_final(&self) -> bool {
        self.is_final
    }

    pub fn input_trigger(&self) -> InputTrigger {
        self.input_trigger
    }
}

/// The current soft-affinity binding of the request's session. A target
/// without a rank matches every rank of its worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityTarget {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

impl AffinityTarget {
    pub fn matches(&self, worker: WorkerWithDpRank) -> bool {
        self.worker_id == worker.worker_id && self.dp_rank.is_none_or(|r| r == worker.dp_rank)
    }
}

impl From<WorkerWithDpRank> for AffinityTarget {
    fn from(w: WorkerWithDpRank) -> Self {
        AffinityTarget {
            worker_id: w.worker_id,
            dp_rank: Some(w.dp_rank),
        }
    }
}

/// Agent-harness headers observed at ingress: lowercase names, values as
/// received (untrusted, uninterpreted). Built once per request by the host
/// and shared by reference-counted pointer, never copied per policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentHeaders(Arc<BTreeMap<Box<str>, Box<str>>>);

impl AgentHeaders {
    /// Builds the map, lowercasing names (a later duplicate wins).
    pub fn from_pairs<N: AsRef<str>, V: Into<Box<str>>>(
        pairs: impl IntoIterator<Item = (N, V)>,
    ) -> Self {
        let map = pairs
            .into_iter()
            .map(|(n, v)| (n.as_ref().to_ascii_lowercase().into_boxed_str(), v.into()))
            .collect();
        AgentHeaders(Arc::new(map))
    }

    /// The value of `name` (give it in lowercase).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(|v| &**v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The request context of one selection.
#[derive(Clone, Copy, Debug)]
pub struct WorkerSelectionContext<'a> {
    request_id: &'a str,
    prompt_tokens: u32,
    block_size: u32,
    /// Precomputed: scorers read it once per candidate.
    request_blocks: u64,
    expected_output_tokens: Option<u32>,
    priority: i32,
    pinned_worker: Option<WorkerWithDpRank>,
    session: Option<SessionContext<'a>>,
    affinity_target: Option<AffinityTarget>,
    agent_headers: Option<&'a AgentHeaders>,
    now_ms: u64,
    prefix_sharers: u32,
}

impl<'a> WorkerSelectionContext<'a> {
    /// A context for a prompt of `prompt_tokens` tokens cut into blocks of
    /// `block_size` (a zero block size is refused at selection).
    pub fn new(request_id: &'a str, prompt_tokens: u32, block_size: u32) -> Self {
        WorkerSelectionContext {
            request_id,
            prompt_tokens,
            block_size,
            request_blocks: u64::from(prompt_tokens).div_ceil(u64::from(block_size.max(1))),
            expected_output_tokens: None,
            priority: 0,
            pinned_worker: None,
            session: None,
            affinity_target: None,
            agent_headers: None,
            now_ms: 0,
            prefix_sharers: 0,
        }
    }

    pub fn with_expected_output_tokens(mut self, tokens: u32) -> Self {
        self.expected_output_tokens = Some(tokens);
        self
    }

    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// An explicit target: selection takes the exact-target path.
    pub fn with_pinned_worker(mut self, worker: WorkerWithDpRank) -> Self {
        self.pinned_worker = Some(worker);
        self
    }

    pub fn with_session(mut self, session: SessionContext<'a>) -> Self {
        self.session = Some(session);
        self
    }

    pub fn with_affinity_target(mut self, target: AffinityTarget) -> Self {
        self.affinity_target = Some(target);
        self
    }

    pub fn with_agent_headers(mut self, headers: &'a AgentHeaders) -> Self {
        self.agent_headers = Some(headers);
        self
    }

    /// The host's monotonic clock, in milliseconds (policies never read a clock).
    pub fn with_now_ms(mut self, now_ms: u64) -> Self {
        self.now_ms = now_ms;
        self
    }

    /// How many recent picks (the host's prefix-reservation window) sent
    /// the deepest prefix of this prompt that some candidate holds: 0 when
    /// no candidate holds any of it or the host does not count.
    pub fn with_prefix_sharers(mut self, picks: u32) -> Self {
        self.prefix_sharers = picks;
        self
    }

    /// See [`Self::with_prefix_sharers`].
    pub fn prefix_sharers(&self) -> u32 {
        self.prefix_sharers
    }

    pub fn request_id(&self) -> &'a str {
        self.request_id
    }

    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks the prompt occupies (partial last block included).
    pub fn request_blocks(&self) -> u64 {
        self.request_blocks
    }

    pub fn expected_output_tokens(&self) -> Option<u32> {
        self.expected_output_tokens
    }

    pub fn priority(&self) -> i32 {
        self.priority
    }

    pub fn pinned_worker(&self) -> Option<WorkerWithDpRank> {
        self.pinned_worker
    }

    pub fn session_context(&self) -> Option<&SessionContext<'a>> {
        self.session.as_ref()
    }

    pub fn affinity_target(&self) -> Option<AffinityTarget> {
        self.affinity_target
    }

    /// Ingress agent headers; `None` when the host captured none.
    pub fn agent_headers(&self) -> Option<&'a AgentHeaders> {
        self.agent_headers
    }

    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_target_without_rank_matches_every_rank() {
        let any = AffinityTarget {
            worker_id: 7,
            dp_rank: None,
        };
        let one = AffinityTarget {
            worker_id: 7,
            dp_rank: Some(1),
        };
        assert!(any.matches(WorkerWithDpRank::new(7, 0)));
        assert!(any.matches(WorkerWithDpRank::new(7, 3)));
        assert!(!any.matches(WorkerWithDpRank::new(8, 0)));
        assert!(one.matches(WorkerWithDpRank::new(7, 1)));
        assert!(!one.matches(WorkerWithDpRank::new(7, 0)));
    }

    #[test]
    fn agent_headers_are_lowercased_and_shared() {
        let h = AgentHeaders::from_pairs([("X-Agent-Name", "Claude"), ("x-turn", "{bad json")]);
        let clone = h.clone();
        assert_eq!(clone.get("x-agent-name"), Some("Claude"));
        assert_eq!(clone.get("x-turn"), Some("{bad json"));
        assert_eq!(h.get("X-Agent-Name"), None, "lookups are by lowercase name");
        assert!(Arc::ptr_eq(&h.0, &clone.0), "clones share the map");
    }

    #[test]
    fn request_blocks_round_up() {
        assert_eq!(
            WorkerSelectionContext::new("r", 2048, 16).request_blocks(),
            128
        );
        assert_eq!(WorkerSelectionContext::new("r", 17, 16).request_blocks(), 2);
        assert_eq!(WorkerSelectionContext::new("r", 0, 16).request_blocks(), 0);
    }
}
