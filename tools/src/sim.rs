//! `kvedge sim`: a deterministic discrete-event replay in virtual time.
//! Engine models ([`kvedge_sim::engine`]) publish their KV events and load
//! straight into the real [`Router`] (index, load table, policies, session
//! affinity, rules), and every request of a workload is routed by the
//! router's `select` at its arrival time, dispatched to the chosen engine,
//! and released with `prefill_done` and `finish` when the engine says so.
//! Only the transport is missing: no rings, no sockets, so a run replays
//! identically.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use kvedge_policies::{
    InputTrigger, RouterPluginRegistry, SelectionOverrides, SessionContext, WorkerType,
    WorkerWithDpRank,
};
use kvedge_sim::engine::{Completion, EngineModel, EngineParams, EngineRequest, KvEvent, Outputs};
use kvedge_sim::report::{LoadIntegral, Outcome, Summary, summarise};
use kvedge_sim::workload::TraceRequest;

use kvedge_config::{Config, ConfigError};
use kvedge_core::index::Slot;
use kvedge_core::load::LoadReport;
use kvedge_core::router::{Router, SelectRequest, WorkerInfo};

/// The shipped policies `kvedge sim` compares by default, with the
/// parameters they need (the names are the worker-selection types, except
/// `default`, the built-in default cost policy).
pub const PRESETS: &[(&str, &str)] = &[
    ("default", ""),
    ("cache-aware", ""),
    ("least-busy", "min_device_overlap_blocks: 0"),
    ("least-kv-usage", ""),
    ("power-of-two", ""),
    ("random", ""),
    ("round-robin", ""),
    ("soft-pin", "max_active_requests: 16"),
    ("tool-result-cache-local", ""),
    ("predicted-ttft", ""),
    ("prefill-times-requests", ""),
];

/// The configuration that runs `name`, one of [`PRESETS`], as the
/// aggregated policy with soft session affinity.
pub fn preset_config(name: &str, registry: &RouterPluginRegistry) -> Result<Config, ConfigError> {
    let Some((_, params)) = PRESETS.iter().find(|(n, _)| *n == name) else {
        return Err(ConfigError {
            file: format!("--policy {name}"),
            message: format!(
                "unknown policy (shipped: {})",
                PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    };
    let yaml = if name == "default" {
        "session_affinity:\n  mode: soft\n".to_owned()
    } else {
        let params = if params.is_empty() {
            String::new()
        } else {
            format!("      parameters:\n        {params}\n")
        };
        format!(
            "session_affinity:\n  mode: soft\nworker_selection:\n  aggregated: p\n  instances:\n    - name: p\n      type: {name}\n{params}"
        )
    };
    Config::load(
        &format!("--policy {name}"),
        &yaml,
        registry,
        &SelectionOverrides::default(),
    )
}

/// The simulated node.
#[derive(Clone, Debug)]
pub struct Setup {
    pub workers: usize,
    pub engine: EngineParams,
    /// Active requests per worker are sampled this often for the plots.
    pub sample_us: u64,
    /// Route as a frontend without the model's tokenizer does: selects
    /// are approximate, so the router matches them against its own earlier
    /// picks and never against the engines' events (which still flow, as
    /// they would, into the precise index nobody consults).
    pub approximate: bool,
}

/// One policy's run.
#[derive(Debug)]
pub struct Run {
    pub summary: Summary,
    /// Requests the router could not place (no worker, or an off-cluster
    /// provider, which the simulator does not model).
    pub unplaced: usize,
    /// Requests an engine refused (prompt longer than its KV pool).
    pub refused: usize,
    /// Per worker, active (running + waiting) requests every `sample_us`.
    pub load_samples: Vec<Vec<u32>>,
    /// Requests the router sent to each worker.
    pub requests_per_worker: Vec<u64>,
}

const MODEL: &str = "sim";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// An engine's step ends (stale if it no longer matches `wake`).
    Engine(usize),
    Arrival(usize),
}

/// Replays `requests` through a router built from `config` and
/// `setup.workers` engine models; `label` names the row.
pub fn run(
    config: &Config,
    label: &str,
    setup: &Setup,
    requests: &[TraceRequest],
    oracle_hit_rate: f64,
) -> Run {
    let mut router = Router::from_config(config);
    let n = setup.workers;
    let mut slots: Vec<Slot> = Vec::with_capacity(n);
    let mut worker_of = [usize::MAX; kvedge_core::index::MAX_WORKERS];
    for w in 0..n {
        let slot = router
            .register(WorkerInfo {
                worker: WorkerWithDpRank::new(w as u64 + 1, 0),
                model: MODEL.into(),
                role: WorkerType::Aggregated,
                endpoint: format!("sim://worker-{}", w + 1),
                block_size: setup.engine.block_size,
                available: true,
                labels: Vec::new(),
                taints: Vec::new(),
            })
            .expect("at most 64 simulated workers");
        worker_of[slot.index()] = w;
        slots.push(slot);
    }
    let mut engines: Vec<EngineModel> = (0..n)
        .map(|_| EngineModel::new(setup.engine.clone()))
        .collect();
    let mut wake: Vec<Option<u64>> = vec![None; n];
    let mut heap: BinaryHeap<Reverse<(u64, Ev)>> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| Reverse((r.arrival_us, Ev::Arrival(i))))
        .collect();
    let mut outcomes = vec![Outcome::default(); requests.len()];
    let mut router_ids = vec![0u64; requests.len()];
    let mut placed = vec![false; requests.len()];
    let mut router_ns = Vec::with_capacity(requests.len());
    let mut integral = LoadIntegral::new(n);
    let mut active = vec![0u32; n];
    let mut samples: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut next_sample = 0u64;
    let (mut unplaced, mut refused) = (0, 0);
    let mut requests_per_worker = vec![0u64; n];
    let mut out = Outputs::default();
    let mut session = String::new();

    while let Some(Reverse((now, ev))) = heap.pop() {
        while next_sample <= now {
            for (w, s) in samples.iter_mut().enumerate() {
                s.push(active[w]);
            }
            next_sample += setup.sample_us.max(1);
        }
        let w = match ev {
            Ev::Engine(w) => {
                if wake[w] != Some(now) {
                    continue; // superseded
                }
                w
            }
            Ev::Arrival(i) => {
                let r = &requests[i];
                session.clear();
                if let Some(s) = r.session {
                    use std::fmt::Write;
                    let _ = write!(session, "s{s}");
                }
                let trigger = if r.tool_result {
                    InputTrigger::ToolResult
                } else {
                    InputTrigger::UserMessage
                };
                let req = SelectRequest {
                    model: MODEL,
                    tenant: None,
                    tags: &[],
                    headers: None,
                    priority: 0,
                    role: WorkerType::Aggregated,
                    hashes: &r.hashes,
                    prompt_tokens: r.prompt_tokens(),
                    session: r
                        .session
                        .map(|_| SessionContext::new(session.as_str(), trigger)),
                    pinned: None,
                    now_ms: now / 1000,
                    dry_run: false,
                    subset: kvedge_wire::Strs::EMPTY,
                    tolerations: kvedge_wire::Strs::EMPTY,
                    approximate: setup.approximate,
                };
                router.load.expire(now / 1000);
                let t = Instant::now();
                let chosen = router.select(&req);
                router_ns.push(t.elapsed().as_nanos() as u64);
                let chosen = match chosen {
                    Ok(c) => c,
                    Err(_) => {
                        unplaced += 1;
                        continue;
                    }
                };
                let Some(slot) = chosen.slot else {
                    unplaced += 1;
                    continue;
                };
                let w = worker_of[slot.index()];
                requests_per_worker[w] += 1;
                router_ids[i] = chosen.request_id;
                outcomes[i] = Outcome {
                    arrival_us: now,
                    prompt_tokens: r.prompt_tokens(),
                    output_tokens: r.output_tokens,
                    ..Outcome::default()
                };
                let submitted = engines[w].submit(
                    EngineRequest {
                        id: i as u64,
                        hashes: r.hashes.clone(),
                        prompt_tokens: r.prompt_tokens(),
                        output_tokens: r.output_tokens,
                    },
                    now,
                );
                if submitted.is_err() {
                    refused += 1;
                    let _ = router.load.finish(chosen.request_id);
                    continue;
                }
                placed[i] = true;
                w
            }
        };
        // Run engine `w` up to now and feed what it published to the router.
        out.clear();
        let next = engines[w].advance(now, &mut out);
        let slot = slots[w];
        for e in &out.events {
            match e {
                KvEvent::Stored { tier, hashes, .. } => router.apply_stored(slot, *tier, hashes),
                KvEvent::Removed { tier, hashes } => router.apply_removed(slot, *tier, hashes),
            }
        }
        for l in &out.loads {
            router.apply_load(slot, LoadReport::from(l));
        }
        for c in &out.completions {
            match *c {
                Completion::FirstToken {
                    id,
                    at_us,
                    cached_tokens,
                } => {
                    let o = &mut outcomes[id as usize];
                    o.first_token_us = at_us;
                    o.cached_tokens = cached_tokens;
                    let _ = router.prefill_done(router_ids[id as usize], at_us / 1000);
                }
                Completion::Finished { id, at_us } => {
                    outcomes[id as usize].finish_us = at_us;
                    let _ = router.finish(router_ids[id as usize]);
                }
                // Not asked for (the replay needs the first and last).
                Completion::Token { .. } => {}
            }
        }
        let l = engines[w].load(now);
        let a = l.active_requests + l.waiting_requests;
        if a != active[w] {
            active[w] = a;
            integral.observe(w, now, a);
        }
        if next != wake[w] {
            wake[w] = next;
            if let Some(t) = next {
                heap.push(Reverse((t, Ev::Engine(w))));
            }
        }
    }
    let done: Vec<Outcome> = outcomes
        .iter()
        .zip(&placed)
        .filter(|(_, p)| **p)
        .map(|(o, _)| *o)
        .collect();
    Run {
        summary: summarise(label, &done, oracle_hit_rate, &integral, &router_ns),
        unplaced,
        refused,
        load_samples: samples,
        requests_per_worker,
    }
}
