//! `engines:`: serving engines that do not link libkvedge (vLLM, SGLang,
//! TensorRT-LLM) but publish their KV-cache events over ZeroMQ and their
//! load as Prometheus metrics. Each entry says where to read both, and
//! which worker(s) it is; data-parallel ranks expand into one worker each,
//! with the engines' own port convention (base port plus the rank).
//!
//! ```yaml
//! engines:
//!   - kind: vllm
//!     model: llama
//!     worker_id: 10
//!     dp_ranks: 2                        # workers (10, 0) and (10, 1)
//!     block_size: 16
//!     endpoint: http://10.0.0.5:8000     # where frontends send requests
//!     events: tcp://10.0.0.5:5557        # the engine's PUB socket (rank r: port + r)
//!     replay: tcp://10.0.0.5:5558        # its replay ROUTER socket (optional)
//!     topic: kv-events
//!     metrics: http://10.0.0.5:8000/metrics
//! ```
//!
//! With `events_bind: true` kvedge binds `events` and the engine connects:
//! `events_allow` names who may (default: loopback and the hosts this
//! entry names), `events_max_peers` how many at once, and
//! `max_message_bytes` caps every message read from the engine's sockets.

use serde::Deserialize;

use crate::MAX_WORKERS;

/// Which engine publishes (their metric names differ; their events do not).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Vllm,
    Sglang,
    Trtllm,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Trtllm => "trtllm",
        }
    }
}

/// One engine (all its data-parallel ranks) as configured.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub kind: EngineKind,
    pub model: String,
    /// The worker id; rank `r` is worker (`worker_id`, `r`).
    pub worker_id: u64,
    /// Data-parallel ranks, each with its own publisher (default 1).
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// `aggregated` (the default), `prefill`, `decode` or `encode`.
    #[serde(default)]
    pub role: Option<String>,
    /// Tokens per KV block, as the engine is started with.
    pub block_size: u32,
    /// Where frontends send this engine's requests (returned by select).
    pub endpoint: String,
    /// The engine's event publisher: `tcp://host:port` or `ipc://path`.
    pub events: String,
    /// Bind `events` (the engine connects to kvedge) instead of connecting.
    #[serde(default)]
    pub events_bind: bool,
    /// With `events_bind`: the addresses (`10.0.0.5`, `10.0.0.0/24`,
    /// `engine-1.pool`) whose connections are taken. Default: loopback and
    /// the hosts this entry names (`endpoint`, `replay`, `metrics`).
    #[serde(default)]
    pub events_allow: Option<Vec<String>>,
    /// With `events_bind`: connections taken at once (more are closed).
    #[serde(default = "events_max_peers")]
    pub events_max_peers: usize,
    /// The largest message read from the engine's event and replay
    /// sockets, in bytes; a peer that sends more is disconnected.
    #[serde(default = "max_message_bytes")]
    pub max_message_bytes: usize,
    /// The engine's replay socket (`tcp://host:port` or `ipc://path`);
    /// without it, a gap drops the engine's state.
    #[serde(default)]
    pub replay: Option<String>,
    /// The topic the engine publishes on ("" reads every topic).
    #[serde(default)]
    pub topic: String,
    /// The engine's Prometheus endpoint, `http://host:port/path`.
    #[serde(default)]
    pub metrics: Option<String>,
    /// How often the metrics are read, ms.
    #[serde(default = "scrape_interval")]
    pub scrape_interval_ms: u64,
    /// While the engine is idle (its load figures unchanged and no KV
    /// events), the interval doubles after each read up to this, ms; any
    /// change or event brings it back to `scrape_interval_ms`. Equal to
    /// `scrape_interval_ms`: always read at that pace. By default 1000, or
    /// `scrape_interval_ms` if that is longer.
    #[serde(default)]
    pub scrape_idle_interval_ms: Option<u64>,
    /// How long a closed events connection (not made again) or metrics
    /// reads failing in a row may last before the engine is taken out of
    /// routing and its blocks dropped, ms; it comes back when they work
    /// again. Independent of `daemon.heartbeat_timeout_ms`, which bounds
    /// silence. 0: only silence counts.
    #[serde(default = "down_after")]
    pub down_after_ms: u64,
    /// Labels the rule language matches (`backends: { labels }`,
    /// `backend.labels.<key>`); the `backend` label is the engine's
    /// backend name (`backends: { names }`, `backend.name`, a Local
    /// tier's `order`). Every rank also carries `engine: <kind>` unless
    /// set here.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// Taints, `key[=value]:NoSchedule` (requests that do not tolerate it
    /// never go here) or `key[=value]:PreferNoSchedule` (their cost is
    /// multiplied by `router.preferred_taint_multiplier`).
    #[serde(default)]
    pub taints: Vec<String>,
    /// 1-based line of the entry in the file, when known.
    #[serde(skip)]
    pub line: Option<usize>,
}

fn one() -> u32 {
    1
}

/// Five reads a second while an engine works: in the gateway shoot-out
/// (BENCHMARKS.md) the same routing and TTFT as ten, for about a fifth
/// less of kvedge's CPU per request; kvedge counts what it sent itself
/// between reads.
fn scrape_interval() -> u64 {
    200
}

fn down_after() -> u64 {
    2_000
}

/// The longest `down_after_ms`.
pub const MAX_DOWN_AFTER_MS: u64 = 600_000;

fn events_max_peers() -> usize {
    4
}

/// Far above any real batch (one of thousands of blocks is about 100 KB).
fn max_message_bytes() -> usize {
    4 << 20
}

/// The most `max_message_bytes` may be set to.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// One data-parallel rank of an engine: one worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EngineRank {
    pub kind: EngineKind,
    pub model: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub role: kvedge_schema::messages::Role,
    pub block_size: u32,
    pub endpoint: String,
    /// This rank's publisher (port offset by the rank for tcp).
    pub events: String,
    pub events_bind: bool,
    /// Who may connect to a bound `events` (addresses, ranges or host
    /// names), already defaulted.
    pub events_allow: Vec<String>,
    pub events_max_peers: usize,
    pub max_message_bytes: usize,
    pub replay: Option<String>,
    pub topic: String,
    pub metrics: Option<String>,
    pub scrape_interval_ms: u64,
    pub down_after_ms: u64,
    /// How many ranks the engine has (metrics of a multi-rank engine are
    /// told apart by their `engine` label).
    pub dp_ranks: u32,
    /// The entry's labels (see [`EngineSpec::labels`]).
    pub labels: std::collections::BTreeMap<String, String>,
    /// The entry's taints (see [`EngineSpec::taints`]).
    pub taints: Vec<String>,
}

/// A ZeroMQ endpoint kvedge can use.
fn endpoint_problem(endpoint: &str) -> Option<String> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return path
            .is_empty()
            .then(|| format!("`{endpoint}` names no socket path"));
    }
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return Some(format!(
            "`{endpoint}` is neither tcp://host:port nor ipc://path"
        ));
    };
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => None,
        _ => Some(format!("`{endpoint}` has no host:port")),
    }
}

/// Whether `a` can be an `events_allow` entry: an address, a range, or a
/// host name.
fn allow_entry_ok(a: &str) -> bool {
    if a.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    if let Some((ip, bits)) = a.split_once('/') {
        return match (ip.parse::<std::net::IpAddr>(), bits.parse::<u8>()) {
            (Ok(std::net::IpAddr::V4(_)), Ok(b)) => b <= 32,
            (Ok(std::net::IpAddr::V6(_)), Ok(b)) => b <= 128,
            _ => false,
        };
    }
    !a.is_empty()
        && a.len() <= 253
        && a.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// The host and port of `tcp://host:port` or `http://host:port/...` (port
/// 80 when an http URL names none); brackets are taken off IPv6 hosts.
pub(crate) fn host_port(url: &str) -> Option<(String, u16)> {
    let (rest, default_port) = if let Some(r) = url.strip_prefix("tcp://") {
        (r, None)
    } else if let Some(r) = url.strip_prefix("http://") {
        (r, Some(80))
    } else {
        return None;
    };
    let authority = rest.split('/').next()?;
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && (h.starts_with('[') || !h.contains(':')) => {
            (h, p.parse::<u16>().ok()?)
        }
        _ => (authority, default_port?),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// `endpoint` with its tcp port moved up by `rank` (the engines' convention
/// for data-parallel ranks).
fn offset(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_owned();
    }
    match endpoint
        .strip_prefix("tcp://")
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(host, port)| Some((host, port.parse::<u32>().ok()?)))
    {
        Some((host, port)) => format!("tcp://{host}:{}", port + rank),
        None => endpoint.to_owned(),
    }
}

impl EngineSpec {
    /// The longest interval between two reads of an idle engine's
    /// metrics (`scrape_idle_interval_ms`, defaulted).
    pub fn scrape_idle_interval_ms(&self) -> u64 {
        self.scrape_idle_interval_ms
            .unwrap_or(self.scrape_interval_ms.max(1000))
    }

    /// What is wrong with this entry, if anything.
    fn problem(&self) -> Option<String> {
        if self.model.is_empty() {
            return Some("`model` is empty".into());
        }
        if self.block_size == 0 {
            return Some("`block_size` must be positive".into());
        }
        if let Some(k) = self.labels.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Some(format!(
                "label `{k}`: a label's key is not empty and has no `=`"
            ));
        }
        if let Some(t) = self
            .taints
            .iter()
            .find(|t| crate::Taint::parse(t).is_none())
        {
            return Some(format!(
                "taint `{t}` is not `key[=value]:NoSchedule` or `key[=value]:PreferNoSchedule`"
            ));
        }
        if self.dp_ranks == 0 || self.dp_ranks as usize > MAX_WORKERS {
            return Some(format!(
                "`dp_ranks` must be between 1 and {MAX_WORKERS}, got {}",
                self.dp_ranks
            ));
        }
        if let Some(r) = &self.role
            && kvedge_schema::messages::Role::parse(r).is_none()
        {
            return Some(format!(
                "`role: {r}` is not aggregated, prefill, decode or encode"
            ));
        }
        for (what, endpoint) in [
            ("events", Some(&self.events)),
            ("replay", self.replay.as_ref()),
        ] {
            let Some(endpoint) = endpoint else { continue };
            if let Some(p) = endpoint_problem(endpoint) {
                return Some(format!("`{what}`: {p}"));
            }
            if self.dp_ranks > 1 && !endpoint.starts_with("tcp://") {
                return Some(format!(
                    "`{what}`: an engine with {} ranks needs a tcp:// endpoint (rank r uses port + r)",
                    self.dp_ranks
                ));
            }
        }
        if let Some(m) = &self.metrics {
            let ok = m
                .strip_prefix("http://")
                .and_then(|rest| rest.split('/').next())
                .is_some_and(|authority| !authority.is_empty());
            if !ok {
                return Some(format!(
                    "`metrics: {m}` is not an http://host:port/path URL"
                ));
            }
        }
        if self.scrape_interval_ms < 10 {
            return Some("`scrape_interval_ms` must be at least 10".into());
        }
        if let Some(idle) = self.scrape_idle_interval_ms
            && !(self.scrape_interval_ms..=60_000).contains(&idle)
        {
            return Some(format!(
                "`scrape_idle_interval_ms` must be between `scrape_interval_ms` ({}) and 60000, got {idle}",
                self.scrape_interval_ms
            ));
        }
        if self.down_after_ms > MAX_DOWN_AFTER_MS {
            return Some(format!(
                "`down_after_ms` must be at most {MAX_DOWN_AFTER_MS} (0: only silence counts), got {}",
                self.down_after_ms
            ));
        }
        if !(1..=1024).contains(&self.events_max_peers) {
            return Some(format!(
                "`events_max_peers` must be between 1 and 1024, got {}",
                self.events_max_peers
            ));
        }
        if !(1024..=MAX_MESSAGE_BYTES).contains(&self.max_message_bytes) {
            return Some(format!(
                "`max_message_bytes` must be between 1024 and {MAX_MESSAGE_BYTES}, got {}",
                self.max_message_bytes
            ));
        }
        if let Some(allow) = &self.events_allow {
            if !self.events_bind {
                return Some("`events_allow` needs `events_bind: true`".into());
            }
            if let Some(bad) = allow.iter().find(|a| !allow_entry_ok(a)) {
                return Some(format!(
                    "`events_allow`: `{bad}` is not an address, a range (10.0.0.0/24) or a host name"
                ));
            }
        }
        None
    }

    /// Who may connect to a bound `events`: `events_allow`, else loopback
    /// and the hosts this entry names.
    fn allowed_peers(&self) -> Vec<String> {
        if let Some(allow) = &self.events_allow {
            return allow.clone();
        }
        let mut hosts = vec!["127.0.0.0/8".to_owned(), "::1".to_owned()];
        let named = [
            Some(&self.endpoint),
            self.replay.as_ref(),
            self.metrics.as_ref(),
        ];
        for url in named.into_iter().flatten() {
            if let Some((host, _)) = host_port(url)
                && !hosts.contains(&host)
            {
                hosts.push(host);
            }
        }
        hosts
    }

    /// Each data-parallel rank as one worker.
    pub fn ranks(&self) -> impl Iterator<Item = EngineRank> + '_ {
        let role = self
            .role
            .as_deref()
            .and_then(kvedge_schema::messages::Role::parse)
            .unwrap_or(kvedge_schema::messages::Role::Aggregated);
        (0..self.dp_ranks).map(move |rank| EngineRank {
            kind: self.kind,
            model: self.model.clone(),
            worker_id: self.worker_id,
            dp_rank: rank,
            role,
            block_size: self.block_size,
            endpoint: self.endpoint.clone(),
            events: offset(&self.events, rank),
            events_bind: self.events_bind,
            events_allow: self.allowed_peers(),
            events_max_peers: self.events_max_peers,
            max_message_bytes: self.max_message_bytes,
            replay: self.replay.as_deref().map(|r| offset(r, rank)),
            topic: self.topic.clone(),
            metrics: self.metrics.clone(),
            scrape_interval_ms: self.scrape_interval_ms,
            down_after_ms: self.down_after_ms,
            dp_ranks: self.dp_ranks,
            labels: self.labels.clone(),
            taints: self.taints.clone(),
        })
    }
}

/// Checks every entry and the set as a whole; the message names the entry
/// (and its line, when known).
pub(crate) fn validate(engines: &[EngineSpec], max_workers: usize) -> Result<(), String> {
    let at = |i: usize, e: &EngineSpec| match e.line {
        Some(line) => format!("engines[{i}] (line {line})"),
        None => format!("engines[{i}]"),
    };
    let mut seen: Vec<(u64, u32)> = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        if let Some(p) = e.problem() {
            return Err(format!("{}: {p}", at(i, e)));
        }
        for rank in 0..e.dp_ranks {
            if seen.contains(&(e.worker_id, rank)) {
                return Err(format!(
                    "{}: worker {} rank {rank} is configured twice",
                    at(i, e),
                    e.worker_id
                ));
            }
            seen.push((e.worker_id, rank));
        }
    }
    if seen.len() > max_workers {
        return Err(format!(
            "engines: {} workers configured, more than daemon.max_workers ({max_workers})",
            seen.len()
        ));
    }
    Ok(())
}

/// Whether `host` names this machine through loopback.
fn loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a connection to `host` reaches a listener bound on `bound`
/// (as far as the configuration alone can tell).
fn reaches(host: &str, bound: &str) -> bool {
    let unspecified = |h: &str| {
        h == "*"
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified())
    };
    host == bound || (loopback(host) && (loopback(bound) || unspecified(bound)))
}

/// Refuses an entry that would read from kvedge itself: an `events`,
/// `replay` or `metrics` address that is one of kvedge's own listeners
/// (`own`: what, host, port), and two entries binding one port.
pub(crate) fn refuse_loops(
    engines: &[EngineSpec],
    own: &[(String, String, u16)],
) -> Result<(), String> {
    let at = |i: usize, e: &EngineSpec| match e.line {
        Some(line) => format!("engines[{i}] (line {line})"),
        None => format!("engines[{i}]"),
    };
    let mut listeners: Vec<(String, String, u16)> = own.to_vec();
    for (i, e) in engines.iter().enumerate() {
        if !e.events_bind {
            continue;
        }
        for rank in e.ranks() {
            let Some((host, port)) = host_port(&rank.events) else {
                continue;
            };
            if let Some((what, ..)) = listeners
                .iter()
                .find(|(_, h, p)| *p == port && (reaches(&host, h) || reaches(h, &host)))
            {
                return Err(format!(
                    "{}: `events: {}` binds a port {what} binds too",
                    at(i, e),
                    rank.events
                ));
            }
            listeners.push((format!("{} (worker {})", at(i, e), e.worker_id), host, port));
        }
    }
    for (i, e) in engines.iter().enumerate() {
        for rank in e.ranks() {
            let targets = [
                ("events", (!rank.events_bind).then_some(&rank.events)),
                ("replay", rank.replay.as_ref()),
                ("metrics", rank.metrics.as_ref()),
            ];
            for (key, url) in targets {
                let Some(url) = url else { continue };
                let Some((host, port)) = host_port(url) else {
                    continue;
                };
                if let Some((what, ..)) = listeners
                    .iter()
                    .find(|(_, h, p)| *p == port && reaches(&host, h))
                {
                    return Err(format!(
                        "{}: `{key}: {url}` points at kvedge's own listener ({what}), not at an engine",
                        at(i, e)
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The 1-based line of each `engines:` list item in block-style YAML (a
/// flow-style section parses fine but reports no line).
pub(crate) fn item_lines(source: &str) -> Vec<usize> {
    let mut lines = Vec::new();
    let mut inside = false;
    // The indentation of the section's items (that of the first one), so
    // that lists nested inside an item are not taken for items.
    let mut item_indent = None;
    for (n, line) in source.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        if indent == 0 && !trimmed.starts_with('-') {
            inside = trimmed.starts_with("engines:");
            item_indent = None;
            continue;
        }
        if inside && trimmed.starts_with('-') && *item_indent.get_or_insert(indent) == indent {
            lines.push(n + 1);
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(yaml: &str) -> EngineSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    const BASE: &str = "kind: vllm\nmodel: m\nworker_id: 5\nblock_size: 16\nendpoint: http://e\nevents: tcp://10.0.0.1:5557\n";

    #[test]
    fn ranks_offset_tcp_ports() {
        let mut e = spec(BASE);
        e.dp_ranks = 3;
        e.replay = Some("tcp://10.0.0.1:5600".into());
        let ranks: Vec<_> = e.ranks().map(|r| (r.dp_rank, r.events, r.replay)).collect();
        assert_eq!(ranks[2].1, "tcp://10.0.0.1:5559");
        assert_eq!(ranks[2].2.as_deref(), Some("tcp://10.0.0.1:5602"));
        assert_eq!(
            (ranks[0].0, ranks[0].1.as_str()),
            (0, "tcp://10.0.0.1:5557")
        );
    }

    #[test]
    fn problems_are_named() {
        let cases = [
            ("events: udp://x:1\n", "`events`: `udp://x:1` is neither"),
            ("events: tcp://host\n", "has no host:port"),
            (
                "metrics: https://e/metrics\n",
                "is not an http://host:port/path URL",
            ),
            ("role: chef\n", "`role: chef` is not aggregated"),
            ("labels: { \"a=b\": c }\n", "label `a=b`"),
            ("taints: [spot]\n", "taint `spot` is not"),
            (
                "taints: [\"spot:Sometimes\"]\n",
                "taint `spot:Sometimes` is not",
            ),
            (
                "dp_ranks: 2\nevents: ipc:///tmp/e\n",
                "needs a tcp:// endpoint",
            ),
            ("block_size: 0\n", "`block_size` must be positive"),
            ("scrape_interval_ms: 1\n", "at least 10"),
            (
                "down_after_ms: 600001\n",
                "`down_after_ms` must be at most 600000 (0: only silence counts), got 600001",
            ),
            (
                "scrape_idle_interval_ms: 50\n",
                "`scrape_idle_interval_ms` must be between `scrape_interval_ms` (200) and 60000, got 50",
            ),
        ];
        for (change, expected) in cases {
            // The base entry without the keys the case changes.
            let keys: Vec<&str> = change.lines().filter_map(|l| l.split(':').next()).collect();
            let base: String = BASE
                .lines()
                .filter(|l| !keys.iter().any(|k| l.starts_with(&format!("{k}:"))))
                .map(|l| format!("{l}\n"))
                .collect();
            let e = spec(&format!("{base}{change}"));
            let err = validate(&[e], 64).unwrap_err();
            assert!(err.contains(expected), "`{change}`: {err}");
        }
        let twice = [spec(BASE), spec(BASE)];
        assert!(
            validate(&twice, 64)
                .unwrap_err()
                .contains("configured twice")
        );
        let mut wide = spec(BASE);
        wide.dp_ranks = 8;
        assert!(
            validate(&[wide], 4)
                .unwrap_err()
                .contains("more than daemon.max_workers")
        );
    }

    #[test]
    fn an_entry_pointing_at_kvedge_itself_is_refused() {
        let own = [("epp.listen".to_owned(), "0.0.0.0".to_owned(), 9002)];
        let e = spec(&format!("{BASE}replay: tcp://127.0.0.1:9002\n"));
        let err = refuse_loops(&[e], &own).unwrap_err();
        assert!(
            err.contains("points at kvedge's own listener (epp.listen)"),
            "{err}"
        );
        let e = spec(&format!("{BASE}metrics: http://localhost:9002/metrics\n"));
        assert!(refuse_loops(&[e], &own).is_err());
        // Another machine's port 9002 is not kvedge's.
        let e = spec(&format!("{BASE}replay: tcp://10.0.0.1:9002\n"));
        assert!(refuse_loops(&[e], &own).is_ok());
        // One entry reading another's bound port, and two binding one.
        let bound = spec(
            "kind: vllm\nmodel: m\nworker_id: 6\nblock_size: 16\nendpoint: http://e\nevents: tcp://127.0.0.1:7000\nevents_bind: true\n",
        );
        let reader = spec(
            "kind: vllm\nmodel: m\nworker_id: 7\nblock_size: 16\nendpoint: http://e\nevents: tcp://127.0.0.1:7000\n",
        );
        let err = refuse_loops(&[bound.clone(), reader], &[]).unwrap_err();
        assert!(
            err.contains("engines[1]") && err.contains("worker 6"),
            "{err}"
        );
        let mut twin = bound.clone();
        twin.worker_id = 8;
        assert!(
            refuse_loops(&[bound, twin], &[])
                .unwrap_err()
                .contains("binds a port")
        );
    }

    #[test]
    fn bound_events_allow_loopback_and_the_entrys_hosts_by_default() {
        let e = spec(&format!(
            "{BASE}events_bind: true\nreplay: tcp://10.0.0.9:5558\nmetrics: http://[fd00::5]:8000/metrics\n"
        ));
        let rank = e.ranks().next().unwrap();
        assert_eq!(
            rank.events_allow,
            ["127.0.0.0/8", "::1", "e", "10.0.0.9", "fd00::5"]
        );
        let e = spec(&format!(
            "{BASE}events_bind: true\nevents_allow: [10.1.0.0/16]\n"
        ));
        assert_eq!(e.ranks().next().unwrap().events_allow, ["10.1.0.0/16"]);
        for bad in [
            "events_allow: [\"a b\"]\nevents_bind: true\n",
            "events_allow: [10.0.0.0/40]\nevents_bind: true\n",
            "events_allow: [x]\n",
            "max_message_bytes: 10\n",
            "events_max_peers: 0\n",
        ] {
            assert!(
                validate(&[spec(&format!("{BASE}{bad}"))], 64).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn item_lines_find_block_style_entries() {
        let src = "daemon: {}\nengines:\n  - kind: vllm\n    model: a\n  - kind: sglang\nlog: {}\n";
        assert_eq!(item_lines(src), [3, 5]);
        // Any indentation, comments at the margin, lists inside an item.
        let src = "engines:\n    - kind: vllm\n# a comment\n      taints:\n        - x\n    - kind: sglang\n";
        assert_eq!(item_lines(src), [2, 6]);
    }
}
