//! Prometheus metrics. The routing loop keeps plain counters (nothing on
//! the selection path allocates or locks); a scrape copies them into a
//! [`Snapshot`] and renders it here with prometheus-client as OpenMetrics
//! text, for `kvedge stats --prometheus` (the `metrics` op of query.sock)
//! and the daemon's optional HTTP listener.

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use kvedge_wire::WorkerRow;

use crate::latency::Histogram;

/// Bounds of the selection latency histogram, seconds.
const LATENCY_BOUNDS: [f64; 14] = [
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 1e-1,
];

/// Everything a scrape reports, copied out of the routing loop.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// (policy, rule or "", outcome, count).
    pub selections: Vec<(String, String, String, u64)>,
    pub select_latency: Histogram,
    /// (event kind, records applied).
    pub events: Vec<(&'static str, u64)>,
    pub ring_gaps: u64,
    pub ring_drops: u64,
    pub resyncs: u64,
    /// Warm-ups of the select path between paced selects.
    pub warmups: u64,
    pub index_entries: u64,
    pub index_refused_full: u64,
    pub index_evicted: u64,
    pub workers: Vec<WorkerRow>,
    pub clients: u64,
    /// Query connections with a query channel (shared-memory rings).
    pub query_channels: u64,
    pub reservations: u64,
    pub reservations_expired: u64,
    /// Prefills marked done by their engine's Stored event of the prompt's
    /// last block.
    pub prefills_from_events: u64,
    pub reloads: u64,
    pub reload_failures: u64,
    pub refused_connections: u64,
    pub refused_registrations: u64,
    /// (reason, query connections dropped by the daemon for it).
    pub dropped_connections: Vec<(&'static str, u64)>,
    /// The endpoint picker's connections, streams and refusals, when it
    /// runs.
    pub picker: Option<PickerStats>,
    /// Whether the routing loop spins between bursts of work.
    pub routing_loop: LoopStats,
}

/// How the routing loop waits between bursts of work, as its driver
/// reports it (see `daemon.spin_us` in docs/operations.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoopStats {
    /// It spins (yielding) after a burst, as bursts come closer together
    /// than `daemon.spin_us`; otherwise it sleeps at once.
    pub spinning: bool,
    /// Bursts of work: turns with something to do after one without.
    pub bursts: u64,
    /// Sleeps in epoll.
    pub sleeps: u64,
    /// The mean idle gap before a burst (from the last work to the next),
    /// in microseconds (each gap counted as at most four spins).
    pub mean_burst_gap_us: u64,
}

/// What the endpoint picker's bounds did, as its driver reports it
/// (gauges: now; counters: since start).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PickerStats {
    pub connections: u64,
    pub connections_refused: u64,
    pub connections_evicted: u64,
    pub connections_idle_closed: u64,
    pub streams: u64,
    pub streams_refused: u64,
    pub buffered_body_bytes: u64,
    pub refused_body_budget: u64,
    pub refused_tokenizer_queue: u64,
    pub refused_tokenize_deadline: u64,
    pub prompts_inline: u64,
    pub prompts_pooled: u64,
    pub picks_expired: u64,
    /// Requests the HTTP front door proxied to an engine, and those it
    /// answered 502 or 504 (the engine failed or did not answer).
    pub http_proxied: u64,
    pub http_upstream_errors: u64,
    /// Chats that started with a conversation the prefix cache held.
    pub prefix_hits: u64,
    pub prefix_misses: u64,
    /// Tokens taken from the prefix cache, and tokenized.
    pub prefix_tokens_reused: u64,
    pub prefix_tokens_encoded: u64,
    /// Bytes the prefix caches hold.
    pub prefix_bytes: u64,
    /// Chats routed on their text because their template could not be
    /// rendered as the engine renders it.
    pub template_fallbacks: u64,
    /// How long reading a prompt took, and a select's round trip to the
    /// routing core.
    pub prompt_durations: StageDurations,
    pub select_durations: StageDurations,
}

/// One of the picker's stages: how many took at most each of `bounds_ns`
/// (not cumulative), then how many took longer, their count and sum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageDurations {
    pub bounds_ns: Vec<u64>,
    /// One per bound, then one past them all.
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

impl StageDurations {
    fn metric(&self) -> LatencyMetric {
        let mut buckets: Vec<(f64, u64)> = self
            .bounds_ns
            .iter()
            .zip(&self.buckets)
            .map(|(&ns, &n)| (ns as f64 / 1e9, n))
            .collect();
        let bounded: u64 = buckets.iter().map(|b| b.1).sum();
        buckets.push((f64::INFINITY, self.count.saturating_sub(bounded)));
        LatencyMetric {
            sum: self.sum_ns as f64 / 1e9,
            count: self.count,
            buckets,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SelectionLabels {
    policy: String,
    rule: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker_id: String,
    dp_rank: String,
    model: String,
}

impl WorkerLabels {
    fn of(w: &WorkerRow) -> WorkerLabels {
        WorkerLabels {
            worker_id: w.worker_id.to_string(),
            dp_rank: w.dp_rank.to_string(),
            model: w.model.clone(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoticeLabels {
    worker_id: String,
    dp_rank: String,
    model: String,
    code: String,
}

/// The selection latency histogram as prometheus-client sees it.
#[derive(Debug)]
struct LatencyMetric {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for LatencyMetric {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            self.sum,
            self.count,
            &self.buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

fn gauge(v: u64) -> Gauge {
    let g = Gauge::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    g
}

/// Reads one gauge of a worker row.
type WorkerValue = fn(&WorkerRow) -> u64;

/// How the routing loop waits.
fn render_loop(r: &mut Registry, l: &LoopStats) {
    r.register(
        "loop_spinning",
        "1 while the routing loop spins after a burst of work (bursts come closer together than daemon.spin_us), 0 while it sleeps at once",
        gauge(u64::from(l.spinning)),
    );
    r.register(
        "loop_bursts",
        "Bursts of work of the routing loop",
        counter(l.bursts),
    );
    r.register(
        "loop_sleeps",
        "Sleeps of the routing loop in epoll",
        counter(l.sleeps),
    );
    r.register(
        "loop_burst_gap_microseconds",
        "Mean idle gap between the routing loop's bursts of work, from the last work of one to the first of the next (each gap counted as at most four daemon.spin_us)",
        gauge(l.mean_burst_gap_us),
    );
}

/// The endpoint picker's bounds.
fn render_picker(r: &mut Registry, p: &PickerStats) {
    r.register(
        "epp_connections",
        "Endpoint-picker connections open (gRPC, and the HTTP front door's)",
        gauge(p.connections),
    );
    r.register(
        "epp_connections_refused",
        "Endpoint-picker connections closed as they came, every open one having a stream (epp.max_connections)",
        counter(p.connections_refused),
    );
    r.register(
        "epp_connections_evicted",
        "Endpoint-picker connections with no stream open closed to make room for a new one (epp.max_connections)",
        counter(p.connections_evicted),
    );
    r.register(
        "epp_connections_idle_closed",
        "Endpoint-picker connections closed when idle (epp.idle_timeout_ms) or silent from the start",
        counter(p.connections_idle_closed),
    );
    r.register(
        "epp_streams",
        "Endpoint-picker requests in flight (ext_proc streams, and the HTTP front door's requests)",
        gauge(p.streams),
    );
    r.register(
        "epp_streams_refused",
        "Endpoint-picker streams refused (epp.max_streams)",
        counter(p.streams_refused),
    );
    r.register(
        "epp_buffered_body_bytes",
        "Request body bytes the endpoint picker holds",
        gauge(p.buffered_body_bytes),
    );
    let overload = Family::<ReasonLabels, Counter>::default();
    for (reason, n) in [
        ("body_budget", p.refused_body_budget),
        ("tokenizer_queue", p.refused_tokenizer_queue),
        ("tokenize_deadline", p.refused_tokenize_deadline),
    ] {
        overload
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc_by(n);
    }
    r.register(
        "epp_overloaded",
        "Requests the endpoint picker answered 503 at once (body_budget: epp.max_buffered_body_bytes; tokenizer_queue: epp.tokenizer_queue; tokenize_deadline: epp.tokenize_timeout_ms)",
        overload,
    );
    let prompts = Family::<KindLabels, Counter>::default();
    for (kind, n) in [("inline", p.prompts_inline), ("pool", p.prompts_pooled)] {
        prompts
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc_by(n);
    }
    r.register(
        "epp_prompts",
        "Prompts the endpoint picker read, on its serving thread (inline: small bodies) or its tokenizer pool",
        prompts,
    );
    r.register(
        "epp_picks_expired",
        "Picks whose reservation was released because their response did not end within epp.pick_timeout_ms",
        counter(p.picks_expired),
    );
    r.register(
        "epp_http_proxied",
        "Requests the HTTP front door (epp.http_listen) proxied to the engine it picked",
        counter(p.http_proxied),
    );
    r.register(
        "epp_http_upstream_errors",
        "Requests the HTTP front door answered 502 or 504: the picked engine could not be reached, failed, or did not answer within epp.pick_timeout_ms",
        counter(p.http_upstream_errors),
    );
    r.register(
        "epp_template_fallbacks",
        "Chats routed on their text, not their token ids, because the chat template could not be rendered as the engine renders it (a picture or other non-text part in a message, or a template calling a filter, test or method kvedge's Jinja lacks)",
        counter(p.template_fallbacks),
    );
    r.register(
        "epp_prefix_cache_hits",
        "Prompts (chats, and plain texts) whose beginning the picker's prefix cache held (only the rest was tokenized)",
        counter(p.prefix_hits),
    );
    r.register(
        "epp_prefix_cache_misses",
        "Prompts the prefix cache serves that were tokenized whole (a new conversation or text, an edited earlier part, or evicted)",
        counter(p.prefix_misses),
    );
    r.register(
        "epp_prefix_cache_tokens_reused",
        "Tokens of prompts taken from the prefix cache",
        counter(p.prefix_tokens_reused),
    );
    r.register(
        "epp_prefix_cache_tokens_encoded",
        "Tokens of prompts the prefix cache serves that the tokenizer computed",
        counter(p.prefix_tokens_encoded),
    );
    r.register(
        "epp_prefix_cache_bytes",
        "Bytes the picker's prefix caches hold (epp.prefix_cache_bytes per model)",
        gauge(p.prefix_bytes),
    );
    r.register(
        "epp_prompt_duration_seconds",
        "Time the endpoint picker took to read a request's prompt: the body parsed, the chat template rendered, the tokenizer run, with any wait for the tokenizer pool",
        p.prompt_durations.metric(),
    );
    r.register(
        "epp_select_duration_seconds",
        "Time the endpoint picker's select took, the round trip to the routing core",
        p.select_durations.metric(),
    );
}

/// Renders `s` as OpenMetrics text.
pub fn render(s: &Snapshot) -> String {
    let mut r = Registry::with_prefix("kvedge");
    let selections = Family::<SelectionLabels, Counter>::default();
    for (policy, rule, outcome, n) in &s.selections {
        selections
            .get_or_create(&SelectionLabels {
                policy: policy.clone(),
                rule: rule.clone(),
                outcome: outcome.clone(),
            })
            .inc_by(*n);
    }
    r.register(
        "selections",
        "Selections by policy, rule (empty: none) and outcome (ok or the error code)",
        selections,
    );
    r.register(
        "selection_duration_seconds",
        "Time in the router core per selection",
        LatencyMetric {
            sum: s.select_latency.sum_ns() as f64 / 1e9,
            count: s.select_latency.count(),
            buckets: s.select_latency.prometheus_buckets(&LATENCY_BOUNDS),
        },
    );
    let events = Family::<KindLabels, Counter>::default();
    for (kind, n) in &s.events {
        events
            .get_or_create(&KindLabels {
                kind: (*kind).to_owned(),
            })
            .inc_by(*n);
    }
    r.register(
        "ring_events_applied",
        "Ring records applied, by kind",
        events,
    );
    r.register(
        "ring_gap_records",
        "Records found missing in rings (sequence gaps)",
        counter(s.ring_gaps),
    );
    r.register(
        "ring_dropped_records",
        "Records engines dropped on a full ring (live engines)",
        counter(s.ring_drops),
    );
    r.register(
        "resyncs",
        "Resync requests sent to engines",
        counter(s.resyncs),
    );
    r.register(
        "warmups",
        "Runs of the select path's undecided part between paced selects, to keep it in the CPU's caches (daemon.warm_us)",
        counter(s.warmups),
    );
    r.register(
        "index_entries",
        "(block, worker, tier) entries in the KV index",
        gauge(s.index_entries),
    );
    r.register(
        "index_refused_full",
        "Stored blocks refused because the index was at capacity",
        counter(s.index_refused_full),
    );
    r.register(
        "index_evicted",
        "Index entries evicted to make room (daemon.index_capacity reached; oldest-stored of the worker holding the most)",
        counter(s.index_evicted),
    );
    r.register(
        "workers_registered",
        "Registered workers (engine ranks)",
        gauge(s.workers.len() as u64),
    );
    r.register(
        "workers_live",
        "Registered workers available for routing",
        gauge(s.workers.iter().filter(|w| w.available).count() as u64),
    );
    let per_worker: [(&str, &str, WorkerValue); 8] = [
        (
            "worker_in_sync",
            "1 when the worker's view of its cache is complete; 0 while a resync snapshot is asked for or arriving (its view then counts as empty)",
            |w| u64::from(w.state == "live"),
        ),
        (
            "worker_active_requests",
            "Active requests (report plus projection)",
            |w| u64::from(w.active_requests),
        ),
        (
            "worker_waiting_requests",
            "Queued requests (last report)",
            |w| u64::from(w.waiting_requests),
        ),
        (
            "worker_active_prefill_tokens",
            "Prompt tokens still to prefill (report plus projection)",
            |w| w.active_prefill_tokens,
        ),
        (
            "worker_kv_used_blocks",
            "KV blocks in use (last report)",
            |w| w.kv_used_blocks,
        ),
        (
            "worker_kv_total_blocks",
            "KV blocks in total (last report)",
            |w| w.kv_total_blocks,
        ),
        (
            "worker_device_blocks",
            "Device-tier blocks in the index",
            |w| w.device_blocks,
        ),
        (
            "worker_prefill_tokens_per_second",
            "Prefill speed the TTFT predictor uses for the worker: learned from prefill_done, its peers' while its own is within 15% of theirs or unknown, the configured prior while no worker has learned one",
            |w| w.prefill_tokens_per_second,
        ),
    ];
    for (name, help, value) in per_worker {
        let family = Family::<WorkerLabels, Gauge>::default();
        for w in &s.workers {
            family
                .get_or_create(&WorkerLabels::of(w))
                .set(i64::try_from(value(w)).unwrap_or(i64::MAX));
        }
        r.register(name, help, family);
    }
    let per_worker_counts: [(&str, &str, WorkerValue); 3] = [
        (
            "worker_picks",
            "Requests the worker was picked for since it registered",
            |w| w.picks,
        ),
        (
            "worker_picked_prompt_blocks",
            "Full blocks of the prompts the worker was picked for",
            |w| w.picked_prompt_blocks,
        ),
        (
            "worker_picked_cached_blocks",
            "Of those, blocks in its device cache (or reserved there) when it was picked: rate(cached) / rate(prompt) is its hit rate",
            |w| w.picked_cached_blocks,
        ),
    ];
    for (name, help, value) in per_worker_counts {
        let family = Family::<WorkerLabels, Counter>::default();
        for w in &s.workers {
            family.get_or_create(&WorkerLabels::of(w)).inc_by(value(w));
        }
        r.register(name, help, family);
    }
    let notices = Family::<NoticeLabels, Gauge>::default();
    let standing = Family::<NoticeLabels, Gauge>::default();
    for w in &s.workers {
        for n in &w.notices {
            let labels = NoticeLabels {
                worker_id: w.worker_id.to_string(),
                dp_rank: w.dp_rank.to_string(),
                model: w.model.clone(),
                code: n.code.to_owned(),
            };
            standing.get_or_create(&labels).set(i64::from(n.active));
            notices
                .get_or_create(&labels)
                .set(i64::try_from(n.count).unwrap_or(i64::MAX));
        }
    }
    r.register(
        "worker_notices",
        "What an engine reported about its own feed (mismatches, lost events), by code: its count so far",
        notices,
    );
    r.register(
        "worker_notices_active",
        "1 while the condition a notice names stands, 0 once the engine's producer said it is over",
        standing,
    );
    r.register("query_clients", "Open query connections", gauge(s.clients));
    r.register(
        "query_channels",
        "Query connections with a query channel (shared-memory rings)",
        gauge(s.query_channels),
    );
    r.register(
        "reservations",
        "Selected requests not yet finished",
        gauge(s.reservations),
    );
    r.register(
        "reservations_expired",
        "Reservations that expired without finish",
        counter(s.reservations_expired),
    );
    r.register(
        "prefills_from_kv_events",
        "Reservations whose prefill was marked done by their engine storing the prompt's last new block, before any prefill_done",
        counter(s.prefills_from_events),
    );
    r.register(
        "reloads",
        "Configuration reloads applied",
        counter(s.reloads),
    );
    r.register(
        "reload_failures",
        "Configuration reloads refused (invalid file)",
        counter(s.reload_failures),
    );
    r.register(
        "refused_connections",
        "Query connections refused (limit or credentials)",
        counter(s.refused_connections),
    );
    let dropped = Family::<ReasonLabels, Counter>::default();
    for (reason, n) in &s.dropped_connections {
        dropped
            .get_or_create(&ReasonLabels {
                reason: (*reason).to_owned(),
            })
            .inc_by(*n);
    }
    r.register(
        "dropped_connections",
        "Query connections the daemon dropped (slow_reader: replies left unread; input_backlog: unfinished requests over the budget)",
        dropped,
    );
    if let Some(p) = &s.picker {
        render_picker(&mut r, p);
    }
    render_loop(&mut r, &s.routing_loop);
    r.register(
        "refused_registrations",
        "Engine registrations refused",
        counter(s.refused_registrations),
    );
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &r).is_err() {
        let _ = writeln!(out, "# encoding failed");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_families_labels_and_the_histogram() {
        let mut h = Histogram::default();
        for ns in [800, 1_500, 30_000, 3_000_000_000] {
            h.record(ns);
        }
        let s = Snapshot {
            selections: vec![
                ("default".into(), "".into(), "ok".into(), 7),
                ("default".into(), "burst".into(), "no_worker".into(), 2),
            ],
            select_latency: h,
            events: vec![("stored", 10), ("load", 3)],
            workers: vec![WorkerRow {
                worker_id: 4,
                dp_rank: 1,
                model: "llama".into(),
                available: true,
                active_requests: 2,
                prefill_tokens_per_second: 25_000,
                ..WorkerRow::default()
            }],
            reloads: 1,
            ..Snapshot::default()
        };
        let text = render(&s);
        for line in [
            "kvedge_selections_total{policy=\"default\",rule=\"\",outcome=\"ok\"} 7",
            "kvedge_selections_total{policy=\"default\",rule=\"burst\",outcome=\"no_worker\"} 2",
            "kvedge_ring_events_applied_total{kind=\"stored\"} 10",
            "kvedge_worker_active_requests{worker_id=\"4\",dp_rank=\"1\",model=\"llama\"} 2",
            "kvedge_worker_prefill_tokens_per_second{worker_id=\"4\",dp_rank=\"1\",model=\"llama\"} 25000",
            "kvedge_workers_live 1",
            "kvedge_reloads_total 1",
            "kvedge_selection_duration_seconds_count 4",
            "kvedge_selection_duration_seconds_bucket{le=\"0.000001\"} 1",
            "kvedge_selection_duration_seconds_bucket{le=\"0.000002\"} 2",
            "kvedge_selection_duration_seconds_bucket{le=\"+Inf\"} 4",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in:\n{text}"
            );
        }
    }

    #[test]
    fn renders_the_pickers_stage_durations_as_histograms() {
        let s = Snapshot {
            picker: Some(PickerStats {
                prompt_durations: StageDurations {
                    bounds_ns: vec![10_000, 100_000],
                    buckets: vec![3, 1, 2],
                    count: 6,
                    sum_ns: 2_500_000_000,
                },
                ..PickerStats::default()
            }),
            ..Snapshot::default()
        };
        let text = render(&s);
        for line in [
            "kvedge_epp_prompt_duration_seconds_count 6",
            "kvedge_epp_prompt_duration_seconds_sum 2.5",
            "kvedge_epp_prompt_duration_seconds_bucket{le=\"0.00001\"} 3",
            "kvedge_epp_prompt_duration_seconds_bucket{le=\"0.0001\"} 4",
            "kvedge_epp_prompt_duration_seconds_bucket{le=\"+Inf\"} 6",
            // No select yet: a histogram of nothing.
            "kvedge_epp_select_duration_seconds_count 0",
            "kvedge_epp_select_duration_seconds_bucket{le=\"+Inf\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in:\n{text}"
            );
        }
    }
}
