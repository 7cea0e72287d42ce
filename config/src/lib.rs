//! The daemon's configuration file: one loader for `kvedge run`, reloads
//! and `kvedge check-config`. Sections: `daemon` (limits), `router` (the default
//! cost policy's settings), `session_affinity`, `worker_selection`, and the
//! rule language's `policy`, `providers`, `classifiers` and `ttft`, the
//! engines read over ZeroMQ (`engines`), and the daemon's `log` and
//! `metrics`. Unknown top-level sections are errors;
//! every error names the file and, where the parser knows it, the line.
//! What only the running daemon can judge (whether `log.level` is a filter
//! its logger accepts, whether this build has io_uring) is checked by the
//! daemon's own loader on top of this one.

#![forbid(unsafe_code)]

use kvedge_policies::rules::{RulePolicy, load_with};
use kvedge_policies::{
    AffinityMode, RouterConfig, RouterPluginRegistry, RouterPlugins, SelectionOverrides,
    WorkerSelectionConfig,
};
use serde::Deserialize;

mod engines;
pub mod epp;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod source;
mod taint;

/// Workers one daemon routes to at most: the KV index keeps which workers
/// hold a block as a 64-bit mask.
pub const MAX_WORKERS: usize = 64;
pub use engines::{EngineKind, EngineRank, EngineSpec};
pub use epp::{EppModel, EppSection};
pub use taint::{Taint, TaintEffect};

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

/// `daemon:` limits and timeouts.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DaemonSection {
    /// (block, worker, tier) entries the KV index holds at most.
    pub index_capacity: usize,
    /// Workers (engine ranks) registered at once, at most 64.
    pub max_workers: usize,
    /// Ring size per worker, in bytes (a power of two).
    pub ring_capacity: u64,
    /// A worker that sends nothing for this long is unavailable.
    pub heartbeat_timeout_ms: u64,
    /// Reservations not released by `finish` expire after this long.
    pub reservation_ttl_ms: u64,
    /// How long a worker's prompt counts as cached there before its engine
    /// reports the blocks (prefix reservations); 0: not at all.
    pub prefix_reservation_ms: u64,
    pub max_query_connections: usize,
    pub max_frame_bytes: usize,
    /// Reply bytes a query connection may leave unread; past it the
    /// connection is dropped (it is not reading), so nobody else waits.
    pub max_reply_backlog_bytes: usize,
    /// Bytes of unfinished requests buffered for all query connections
    /// together; past it the connection holding the most is dropped.
    pub max_input_backlog_bytes: usize,
    pub idle_timeout_ms: u64,
    /// Engine uids allowed on the control socket (with `allowed_gids`;
    /// both empty: any).
    pub allowed_uids: Vec<u32>,
    /// Engine gids allowed on the control socket.
    pub allowed_gids: Vec<u32>,
    /// Client uids allowed on the query socket (with `query_allowed_gids`;
    /// both empty: any).
    pub query_allowed_uids: Vec<u32>,
    /// Client gids allowed on the query socket.
    pub query_allowed_gids: Vec<u32>,
    /// Requests selected and not yet finished (reservations), at most;
    /// beyond it a select is refused with `too_many_requests`.
    pub max_reservations: usize,
    /// How query.sock is served: `epoll` (the routing loop itself, the
    /// default) or `io-uring` (a listener thread on io_uring; needs the
    /// `io-uring` build feature, falls back to epoll where io_uring is
    /// refused).
    pub query_io: QueryIo,
    /// Query connections that may attach a query channel (shared-memory
    /// rings, `attach_rings` in the binary protocol) at once; 0 turns
    /// channels off.
    pub max_query_rings: usize,
    /// The runtime directory's mode, in octal (`"0750"`): set whatever the
    /// umask. It may not let other users write (they could replace the
    /// sockets).
    pub runtime_dir_mode: String,
    /// Size of each of a query channel's two rings, in bytes (a power of
    /// two); a request or reply larger than a quarter of it uses the
    /// socket.
    pub query_ring_capacity: u64,
    /// How long the routing loop keeps polling after a burst of work
    /// before it sleeps, in microseconds, while bursts come closer
    /// together than that (0: always sleep at once). Spinning spares the
    /// next request the wake-up from sleep, at the price of a core busy
    /// for that long after each burst.
    pub spin_us: u64,
    /// While selects keep coming, the shortest interval between two
    /// warm-ups of the select path (its code and data back in the CPU's
    /// caches), in microseconds (0: never warm). The warm-ups close in on
    /// the time the next select is expected.
    pub warm_us: u64,
    /// The longest the loop keeps warming after the last select, in
    /// milliseconds (it stops sooner, after four mean gaps between
    /// selects).
    pub warm_for_ms: u64,
}

/// `daemon.query_io`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum QueryIo {
    #[default]
    Epoll,
    IoUring,
}

impl DaemonSection {
    /// `runtime_dir_mode` as a number (checked at load; 0o750 if it
    /// somehow is not octal).
    pub fn runtime_dir_mode(&self) -> u32 {
        parse_mode(&self.runtime_dir_mode).unwrap_or(0o750)
    }

    /// Whether a peer with `uid`/`gid` may use the control socket.
    pub fn engine_allowed(&self, uid: u32, gid: u32) -> bool {
        allowed(&self.allowed_uids, &self.allowed_gids, uid, gid)
    }

    /// Whether a peer with `uid`/`gid` may use the query socket.
    pub fn client_allowed(&self, uid: u32, gid: u32) -> bool {
        allowed(&self.query_allowed_uids, &self.query_allowed_gids, uid, gid)
    }

    /// Whether any peer-credential policy applies to the control socket.
    pub fn engine_policy(&self) -> bool {
        !self.allowed_uids.is_empty() || !self.allowed_gids.is_empty()
    }

    /// Whether any peer-credential policy applies to the query socket.
    pub fn client_policy(&self) -> bool {
        !self.query_allowed_uids.is_empty() || !self.query_allowed_gids.is_empty()
    }
}

/// The longest duration a setting may name, in milliseconds (a year):
/// longer ones are surely mistakes, and would overflow the clock.
pub const MAX_DURATION_MS: u64 = 365 * 24 * 3600 * 1000;
/// `daemon.spin_us` by default.
pub const DEFAULT_SPIN_US: u64 = 200;
/// The longest `daemon.spin_us` (10 ms): longer spins are a busy core.
pub const MAX_SPIN_US: u64 = 10_000;
/// `daemon.warm_us` by default.
pub const DEFAULT_WARM_US: u64 = 1_000;
/// The longest `daemon.warm_us` (a second): warming less often than that
/// keeps nothing warm.
pub const MAX_WARM_US: u64 = 1_000_000;
/// `daemon.warm_for_ms` by default.
pub const DEFAULT_WARM_FOR_MS: u64 = 10_000;
/// `daemon.prefix_reservation_ms` by default: long enough for a prompt's
/// prefill and its events under load, short enough that a reservation its
/// engine never confirms soon stops steering requests.
pub const DEFAULT_PREFIX_RESERVATION_MS: u64 = 10_000;
/// The longest `daemon.prefix_reservation_ms` (ten minutes).
pub const MAX_PREFIX_RESERVATION_MS: u64 = 600_000;
/// The largest request frame or line a client may send.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// The first `daemon:` value the daemon could not run on: (key, what is
/// wrong with it).
fn check_daemon(d: &DaemonSection) -> Option<(&'static str, String)> {
    let range = |key: &'static str, v: u64, lo: u64, hi: u64, unit: &str| {
        (v < lo || v > hi).then(|| (key, format!("must be between {lo} and {hi}{unit}, got {v}")))
    };
    let ms = |key: &'static str, v: u64| range(key, v, 1, MAX_DURATION_MS, " ms (a year)");
    let pow2 = |key: &'static str, capacity: u64| {
        (!capacity.is_power_of_two()
            || !(kvedge_shm::layout::MIN_CAPACITY..=kvedge_shm::layout::MAX_CAPACITY)
                .contains(&capacity))
        .then(|| {
            (
                key,
                format!(
                    "must be a power of two between {} and {} bytes, got {capacity}",
                    kvedge_shm::layout::MIN_CAPACITY,
                    kvedge_shm::layout::MAX_CAPACITY,
                ),
            )
        })
    };
    let n = |v: usize| v as u64;
    range("max_workers", n(d.max_workers), 1, MAX_WORKERS as u64, "")
        .or_else(|| pow2("ring_capacity", d.ring_capacity))
        .or_else(|| pow2("query_ring_capacity", d.query_ring_capacity))
        .or_else(|| {
            range(
                "index_capacity",
                n(d.index_capacity),
                1,
                1 << 32,
                " entries",
            )
        })
        .or_else(|| {
            range(
                "max_query_connections",
                n(d.max_query_connections),
                1,
                1 << 20,
                "",
            )
        })
        .or_else(|| {
            range(
                "max_frame_bytes",
                n(d.max_frame_bytes),
                64,
                n(MAX_FRAME_BYTES),
                " bytes",
            )
        })
        .or_else(|| {
            range(
                "max_reply_backlog_bytes",
                n(d.max_reply_backlog_bytes),
                4096,
                1 << 30,
                " bytes",
            )
        })
        .or_else(|| {
            range(
                "max_input_backlog_bytes",
                n(d.max_input_backlog_bytes),
                n(d.max_frame_bytes),
                1 << 40,
                " bytes (at least max_frame_bytes, so one whole request fits)",
            )
        })
        .or_else(|| range("max_reservations", n(d.max_reservations), 1, 1 << 32, ""))
        .or_else(|| range("max_query_rings", n(d.max_query_rings), 0, 1 << 16, ""))
        .or_else(|| range("spin_us", d.spin_us, 0, MAX_SPIN_US, " µs"))
        .or_else(|| range("warm_us", d.warm_us, 0, MAX_WARM_US, " µs"))
        .or_else(|| ms("warm_for_ms", d.warm_for_ms))
        .or_else(|| ms("heartbeat_timeout_ms", d.heartbeat_timeout_ms))
        .or_else(|| ms("idle_timeout_ms", d.idle_timeout_ms))
        .or_else(|| ms("reservation_ttl_ms", d.reservation_ttl_ms))
        .or_else(|| {
            range(
                "prefix_reservation_ms",
                d.prefix_reservation_ms,
                0,
                MAX_PREFIX_RESERVATION_MS,
                " ms",
            )
        })
        .or_else(|| {
            parse_mode(&d.runtime_dir_mode)
                .err()
                .map(|e| ("runtime_dir_mode", e))
        })
}

/// An octal permission string (`0750`, `750`, `0o750`) whose owner has
/// every permission and others cannot write.
fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let mode = u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o777 && !digits.is_empty())
        .ok_or_else(|| format!("`{s}` is not an octal permission mode like \"0750\""))?;
    if mode & 0o700 != 0o700 {
        return Err(format!(
            "`{s}` does not give the daemon's own user rwx on its directory"
        ));
    }
    if mode & 0o002 != 0 {
        return Err(format!(
            "`{s}` lets every user write the directory (they could replace its sockets)"
        ));
    }
    Ok(mode)
}

fn allowed(uids: &[u32], gids: &[u32], uid: u32, gid: u32) -> bool {
    (uids.is_empty() && gids.is_empty()) || uids.contains(&uid) || gids.contains(&gid)
}

impl Default for DaemonSection {
    fn default() -> Self {
        DaemonSection {
            index_capacity: 16 * 1024 * 1024,
            max_workers: MAX_WORKERS,
            ring_capacity: 1 << 20,
            heartbeat_timeout_ms: 5_000,
            reservation_ttl_ms: 600_000,
            prefix_reservation_ms: DEFAULT_PREFIX_RESERVATION_MS,
            max_query_connections: 1024,
            max_frame_bytes: 1 << 20,
            max_reply_backlog_bytes: 1 << 20,
            max_input_backlog_bytes: 64 << 20,
            idle_timeout_ms: 300_000,
            allowed_uids: Vec::new(),
            allowed_gids: Vec::new(),
            query_allowed_uids: Vec::new(),
            query_allowed_gids: Vec::new(),
            max_reservations: 1_000_000,
            query_io: QueryIo::Epoll,
            max_query_rings: 64,
            query_ring_capacity: 64 * 1024,
            runtime_dir_mode: "0750".into(),
            spin_us: DEFAULT_SPIN_US,
            warm_us: DEFAULT_WARM_US,
            warm_for_ms: DEFAULT_WARM_FOR_MS,
        }
    }
}

/// `session_affinity:`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AffinitySection {
    pub mode: AffinityMode,
    pub ttl_ms: u64,
    pub max_sessions: usize,
}

impl Default for AffinitySection {
    fn default() -> Self {
        AffinitySection {
            mode: AffinityMode::Hard,
            ttl_ms: 600_000,
            max_sessions: kvedge_policies::affinity::MAX_SESSIONS,
        }
    }
}

/// `log:`: how the daemon logs (`KVEDGE_LOG` overrides `level`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// `human` (the default) or `json` (one object per line).
    pub format: LogFormat,
    /// A tracing filter: `info`, `debug`, `kvedge_daemon=debug,warn`, ...
    pub level: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

impl Default for LogSection {
    fn default() -> Self {
        LogSection {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}

/// `metrics:`.
#[derive(Clone, Debug, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// `host:port` of an HTTP listener serving `GET /metrics` (off when
    /// absent). Use a loopback address; the shipped systemd unit allows
    /// only Unix sockets (see docs/operations.md).
    pub listen: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    #[serde(default)]
    metrics: MetricsSection,
    #[serde(default)]
    daemon: DaemonSection,
    #[serde(default)]
    log: LogSection,
    #[serde(default)]
    router: RouterConfig,
    #[serde(default)]
    session_affinity: AffinitySection,
    #[serde(default)]
    engines: Vec<EngineSpec>,
    #[serde(default)]
    epp: Option<EppSection>,
    // Parsed by the policies crate's own loaders; named here so that an
    // unknown top-level key is an error.
    #[serde(default)]
    #[allow(dead_code)]
    worker_selection: Option<serde_yaml::Value>,
    #[serde(default)]
    policy: Option<serde_yaml::Value>,
    #[serde(default)]
    #[allow(dead_code)]
    providers: Option<serde_yaml::Value>,
    #[serde(default)]
    #[allow(dead_code)]
    classifiers: Option<serde_yaml::Value>,
    #[serde(default)]
    #[allow(dead_code)]
    request_classifier: Option<serde_yaml::Value>,
    #[serde(default)]
    #[allow(dead_code)]
    ttft: Option<serde_yaml::Value>,
}

/// Why the shared-cache settings are refused.
const NO_SHARED_CACHE: &str = "kvedge has no node-shared cache tier (engines report device, host and disk blocks), so a shared-cache credit would change nothing; remove it";

/// A loaded, validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub daemon: DaemonSection,
    pub log: LogSection,
    pub metrics: MetricsSection,
    pub session_affinity: AffinitySection,
    pub plugins: RouterPlugins,
    /// The rule policy, when a `policy:` section is present.
    pub rules: Option<RulePolicy>,
    /// The TTFT predictor (`ttft:`), behind the `predicted-ttft` policy and
    /// the rules' `PredictedTTFT` alike.
    pub ttft: kvedge_policies::predict::TtftPredictor,
    /// Engines read over ZeroMQ and Prometheus (`engines:`).
    pub engines: Vec<EngineSpec>,
    /// The gateway endpoint picker (`epp:`), when configured.
    pub epp: Option<EppSection>,
}

impl Config {
    /// Parses and validates `source` (read from `file`, named in errors).
    pub fn load(
        file: &str,
        source: &str,
        registry: &RouterPluginRegistry,
        overrides: &SelectionOverrides,
    ) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError {
            file: file.to_owned(),
            message,
        };
        source::precheck(source).map_err(&err)?;
        let doc: Document = serde_yaml::from_str(source).map_err(|e| {
            err(match e.location() {
                Some(l) => format!("line {}: {e}", l.line()),
                // Errors the parser cannot place (an alias expanded past
                // its limit): the first alias's line, if any.
                None => match source
                    .lines()
                    .position(|l| l.contains(" *") || l.trim_start().starts_with('*'))
                {
                    Some(n) => format!("line {}: {e}", n + 1),
                    None => e.to_string(),
                },
            })
        })?;
        // Values the parser accepts but the daemon could not run on.
        let at = |path: &[&str], message: String| {
            err(match source::key_line(source, path) {
                Some(line) => format!("line {line}: {message}"),
                None => message,
            })
        };
        if let Some((key, message)) = check_daemon(&doc.daemon) {
            return Err(at(&["daemon", key], format!("daemon.{key} {message}")));
        }
        let a = &doc.session_affinity;
        if a.max_sessions == 0 || a.max_sessions > kvedge_policies::affinity::MAX_SESSIONS {
            return Err(at(
                &["session_affinity", "max_sessions"],
                format!(
                    "session_affinity.max_sessions must be between 1 and {}, got {}",
                    kvedge_policies::affinity::MAX_SESSIONS,
                    a.max_sessions
                ),
            ));
        }
        if a.ttl_ms == 0 || a.ttl_ms > MAX_DURATION_MS {
            return Err(at(
                &["session_affinity", "ttl_ms"],
                format!(
                    "session_affinity.ttl_ms must be between 1 and {MAX_DURATION_MS} (a year), got {}",
                    a.ttl_ms
                ),
            ));
        }
        if let Err(message) = doc.router.validate() {
            let key = message.split_whitespace().next().unwrap_or("");
            return Err(at(&["router", key], format!("router.{message}")));
        }
        let selection =
            WorkerSelectionConfig::from_yaml_str(source).map_err(|e| err(e.to_string()))?;
        // The shared-cache credit prices blocks a node-shared cache tier
        // holds beyond the device prefix; no engine reports such a tier to
        // kvedge, so the settings would load and change nothing.
        if doc.router.shared_cache_enabled || doc.router.shared_cache_multiplier.is_some() {
            let key = if doc.router.shared_cache_enabled {
                "shared_cache_enabled"
            } else {
                "shared_cache_multiplier"
            };
            return Err(at(
                &["router", key],
                format!("router.{key}: {NO_SHARED_CACHE}"),
            ));
        }
        if let Some(inst) = selection.instances().iter().find(|i| {
            matches!(
                i.type_name.as_str(),
                "dynamo-default-cost-fn" | "tool-result-cache-local"
            ) && i.parameters.get("shared_cache_multiplier").is_some()
        }) {
            return Err(err(format!(
                "worker_selection instance `{}`{}: shared_cache_multiplier: {NO_SHARED_CACHE}",
                inst.name,
                inst.line
                    .map(|l| format!(" (line {l})"))
                    .unwrap_or_default()
            )));
        }
        let plugins = registry
            .resolve_plugins(&selection, overrides, &doc.router)
            .map_err(|e| err(e.to_string()))?;
        let classifier =
            kvedge_policies::plugins::request_classifier::ClassifierConfig::from_yaml_str(source)
                .and_then(|c| registry.resolve_classifier(c.as_ref()))
                .map_err(|e| err(e.to_string()))?;
        let plugins = plugins.with_classifier(classifier);
        let ttft = kvedge_policies::rules::load_ttft(source).map_err(|e| err(e.to_string()))?;
        let rules = if doc.policy.is_some() {
            Some(load_with(source, Some(&plugins)).map_err(|e| err(e.to_string()))?)
        } else {
            None
        };
        if let Some(addr) = &doc.metrics.listen
            && addr.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(at(
                &["metrics", "listen"],
                format!("metrics.listen `{addr}` is not host:port (e.g. 127.0.0.1:9464)"),
            ));
        }
        let mut engines = doc.engines;
        for (e, line) in engines.iter_mut().zip(engines::item_lines(source)) {
            e.line = Some(line);
        }
        engines::validate(&engines, doc.daemon.max_workers).map_err(err)?;
        let mut own = Vec::new();
        for (what, addr) in [
            ("metrics.listen", doc.metrics.listen.as_deref()),
            ("epp.listen", doc.epp.as_ref().map(|e| e.listen.as_str())),
            (
                "epp.http_listen",
                doc.epp.as_ref().and_then(|e| e.http_listen.as_deref()),
            ),
        ] {
            if let Some((host, port)) = addr.and_then(|a| engines::host_port(&format!("tcp://{a}")))
            {
                own.push((what.to_owned(), host, port));
            }
        }
        engines::refuse_loops(&engines, &own).map_err(err)?;
        if let Some(e) = &doc.epp
            && let Some((key, message)) = epp::validate(e)
        {
            return Err(at(&["epp", key], message));
        }
        Ok(Config {
            engines,
            epp: doc.epp,
            daemon: doc.daemon,
            log: doc.log,
            metrics: doc.metrics,
            session_affinity: doc.session_affinity,
            plugins,
            rules,
            ttft,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvedge_policies::router_plugin_registry;

    fn load(src: &str) -> Result<Config, ConfigError> {
        Config::load(
            "k.yaml",
            src,
            &router_plugin_registry(),
            &SelectionOverrides::default(),
        )
    }

    #[test]
    fn the_ttft_section_configures_the_predictor_with_or_without_rules() {
        let c = load(
            "ttft:\n  decode_per_block_step: 2us\n  step_tokens: 2048\n  host_hit_cost: 0.5\n",
        )
        .unwrap();
        assert!(c.rules.is_none());
        assert_eq!(c.ttft.step_tokens, 2048.0);
        assert_eq!(c.ttft.host_hit_cost, 0.5);
        assert!((c.ttft.decode_per_block_step - 2e-6).abs() < 1e-15);
        assert_eq!(
            load("{}").unwrap().ttft,
            kvedge_policies::predict::TtftPredictor::default()
        );
    }

    #[test]
    fn shared_cache_settings_are_refused_because_no_engine_reports_that_tier() {
        for (src, says) in [
            (
                "router:\n  shared_cache_enabled: true\n",
                "line 2: router.shared_cache_enabled: kvedge has no node-shared cache tier",
            ),
            (
                "router:\n  shared_cache_multiplier: 0.5\n",
                "line 2: router.shared_cache_multiplier: kvedge has no node-shared cache tier",
            ),
            (
                "worker_selection:\n  instances:\n    - name: d\n      type: dynamo-default-cost-fn\n      parameters: { shared_cache_multiplier: 0.5 }\n",
                "worker_selection instance `d` (line 3): shared_cache_multiplier: kvedge has no node-shared cache tier",
            ),
        ] {
            let e = load(src).unwrap_err().to_string();
            assert!(e.contains(says), "{src}: {e}");
        }
        // Other types may name a parameter so for their own purposes.
        assert!(load("router:\n  shared_cache_enabled: false\n").is_ok());
    }

    #[test]
    fn empty_file_means_defaults() {
        let c = load("{}").unwrap();
        assert_eq!(c.daemon, DaemonSection::default());
        assert!(c.rules.is_none());
    }

    #[test]
    fn every_section_together() {
        let c = load(
            "daemon:\n  index_capacity: 1000\n  ring_capacity: 65536\nrouter:\n  router_temperature: 0.1\nsession_affinity:\n  mode: soft\n  ttl_ms: 1000\nworker_selection:\n  prefill: lb\n  instances:\n    - name: lb\n      type: least-busy\n      parameters: { min_device_overlap_blocks: 0 }\npolicy:\n  rules:\n    - name: all\n      route:\n        select: [{ type: Local, minimize: { policy: lb } }]\n",
        )
        .unwrap();
        assert_eq!(c.daemon.index_capacity, 1000);
        assert_eq!(c.session_affinity.mode, AffinityMode::Soft);
        assert_eq!(
            c.plugins.selection(kvedge_policies::WorkerType::Prefill).0,
            "lb"
        );
        assert_eq!(c.plugins.router_config().router_temperature, 0.1);
        assert_eq!(c.rules.unwrap().rules.len(), 1);
    }

    #[test]
    fn errors_name_file_line_and_problem() {
        let cases = [
            ("demon: {}\n", "k.yaml: line 1: unknown field `demon`"),
            (
                "daemon:\n  ring_capacity: 1000\n",
                "k.yaml: line 2: daemon.ring_capacity must be a power of two",
            ),
            (
                "daemon:\n  query_ring_capacity: 1024\n",
                "k.yaml: line 2: daemon.query_ring_capacity must be a power of two between 4096 and 1073741824 bytes, got 1024",
            ),
            (
                "daemon:\n  max_workers: 65\n",
                "k.yaml: line 2: daemon.max_workers must be between 1 and 64, got 65",
            ),
            (
                "daemon:\n  index_capacty: 5\n",
                "k.yaml: line 2: daemon: unknown field `index_capacty`",
            ),
            (
                "worker_selection:\n  aggregated: x\n",
                "k.yaml: worker_selection.aggregated (line 2): selects `x`",
            ),
            (
                "policy:\n  rules:\n    - name: r\n      route: {}\n",
                "k.yaml: rule `r`, route.select (line 3)",
            ),
            (
                "daemon:\n  ring_capacity: 65536\n  heartbeat_timeout_ms: 0\n",
                "k.yaml: line 3: daemon.heartbeat_timeout_ms must be between 1 and",
            ),
            (
                "daemon: {idle_timeout_ms: 0}\n",
                "k.yaml: line 1: daemon.idle_timeout_ms must be between 1",
            ),
            (
                "daemon:\n  spin_us: 20000\n",
                "k.yaml: line 2: daemon.spin_us must be between 0 and 10000 µs, got 20000",
            ),
            (
                "daemon:\n  warm_us: 2000000\n",
                "k.yaml: line 2: daemon.warm_us must be between 0 and 1000000 µs, got 2000000",
            ),
            (
                "daemon:\n  warm_for_ms: 0\n",
                "k.yaml: line 2: daemon.warm_for_ms must be between 1",
            ),
            (
                "daemon:\n  max_reservations: 0\n",
                "k.yaml: line 2: daemon.max_reservations must be between 1",
            ),
            (
                "daemon:\n  reservation_ttl_ms: 0\n",
                "k.yaml: line 2: daemon.reservation_ttl_ms must be between 1",
            ),
            (
                "daemon:\n  heartbeat_timeout_ms: 18446744073709551615\n",
                "k.yaml: line 2: daemon.heartbeat_timeout_ms must be between 1 and 31536000000 ms",
            ),
            (
                "daemon:\n  max_frame_bytes: 18446744073709551615\n",
                "k.yaml: line 2: daemon.max_frame_bytes must be between 64 and 67108864 bytes",
            ),
            (
                "daemon:\n  runtime_dir_mode: \"0777\"\n",
                "k.yaml: line 2: daemon.runtime_dir_mode `0777` lets every user write",
            ),
            (
                "daemon:\n  max_workers: 4\nrouter:\n  overlap_score_credit: .nan\n",
                "k.yaml: line 4: router.overlap_score_credit must be a finite non-negative number, got NaN",
            ),
            (
                "session_affinity:\n  ttl_ms: 0\n",
                "k.yaml: line 2: session_affinity.ttl_ms must be between 1",
            ),
            ("\n# nothing\n", "k.yaml: the file is empty"),
            (
                "metrics:\n  listen: nowhere\n",
                "k.yaml: line 2: metrics.listen `nowhere` is not host:port",
            ),
            (
                "ttft:\n  host_hit_cost: 0.1\n  step_tokens: 0\n",
                "k.yaml: ttft.step_tokens (line 3): must be at least 1",
            ),
            (
                "ttft:\n  decode_per_block_step: fast\n",
                "k.yaml: ttft.decode_per_block_step (line 2): `fast` is not a duration",
            ),
            (
                "ttft:\n  prefill_tokens_per_second: -5\n",
                "k.yaml: ttft.prefill_tokens_per_second (line 2): must be a finite positive number",
            ),
        ];
        for (src, expected) in cases {
            let msg = load(src).unwrap_err().to_string();
            assert!(
                msg.starts_with(expected),
                "expected `{expected}`, got `{msg}`"
            );
        }
    }
}
