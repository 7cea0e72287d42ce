//! Shared helpers of the policy tests: tables from compact specs, policies
//! from YAML, shuffling.

#![allow(dead_code)]

use kvedge_policies::{
    CacheRow, CandidateRow, CandidateTable, LoadRow, OccupancyRow, PolicyConfigError, RouterConfig,
    RouterPlugins, RoutingPartition, SelectionOverrides, WorkerInputs, WorkerSelectionConfig,
    WorkerSelectionPolicy, WorkerType, WorkerWithDpRank, router_plugin_registry,
};

/// One candidate, by the fields tests care about.
#[derive(Clone, Copy, Debug, Default)]
pub struct W {
    pub id: u64,
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    pub active: u32,
    pub waiting: u32,
    pub prefill: u64,
    pub decode: u64,
    pub kv_used: u64,
    pub kv_total: u64,
    pub taint: Option<f64>,
    pub ttft: Option<f64>,
    /// The request's own prefill, seconds (0 when `ttft` is set alone).
    pub own: Option<f64>,
    pub recent: Option<f64>,
}

pub fn w(id: u64) -> W {
    W {
        id,
        kv_total: 100,
        ..W::default()
    }
}

impl W {
    pub fn device(mut self, v: u32) -> Self {
        self.device = v;
        self
    }
    pub fn host(mut self, v: u32) -> Self {
        self.host = v;
        self
    }
    pub fn disk(mut self, v: u32) -> Self {
        self.disk = v;
        self
    }
    pub fn active(mut self, v: u32) -> Self {
        self.active = v;
        self
    }
    pub fn waiting(mut self, v: u32) -> Self {
        self.waiting = v;
        self
    }
    pub fn prefill(mut self, v: u64) -> Self {
        self.prefill = v;
        self
    }
    pub fn decode(mut self, v: u64) -> Self {
        self.decode = v;
        self
    }
    pub fn kv(mut self, used: u64, total: u64) -> Self {
        self.kv_used = used;
        self.kv_total = total;
        self
    }
    /// The host's predicted TTFT, seconds.
    pub fn ttft(mut self, s: f64) -> Self {
        self.ttft = Some(s);
        self
    }
    /// Of the predicted TTFT, the request's own prefill, seconds.
    pub fn own(mut self, s: f64) -> Self {
        self.own = Some(s);
        self
    }
    /// The host's decayed count of recent selections.
    pub fn recent(mut self, n: f64) -> Self {
        self.recent = Some(n);
        self
    }
    pub fn taint(mut self, m: f64) -> Self {
        self.taint = Some(m);
        self
    }
    pub fn row(&self) -> CandidateRow {
        CandidateRow {
            worker: WorkerWithDpRank::new(self.id, 0),
            cache: CacheRow {
                device_blocks: self.device,
                host_blocks: self.host,
                disk_blocks: self.disk,
                shared_beyond_blocks: 0,
            },
            load: LoadRow {
                active_requests: self.active,
                waiting_requests: self.waiting,
                active_prefill_tokens: self.prefill,
                active_decode_blocks: self.decode,
            },
            occupancy: OccupancyRow {
                kv_used_blocks: self.kv_used,
                kv_total_blocks: self.kv_total,
            },
            preferred_taint_multiplier: self.taint,
            predicted_ttft_s: self.ttft,
            predicted_prefill_s: self.own.or(self.ttft.map(|_| 0.0)),
            recent_selections: self.recent,
        }
    }
}

pub fn table(rows: &[W]) -> CandidateTable {
    let mut t = CandidateTable::new();
    t.reset(WorkerInputs::ALL);
    for r in rows {
        t.push(r.row());
    }
    t
}

/// A policy of one instance of `type_name` with `params` (YAML flow mapping).
pub fn policy(type_name: &str, params: &str) -> WorkerSelectionPolicy {
    policy_for(
        type_name,
        params,
        WorkerType::Aggregated,
        RouterConfig::default(),
    )
}

pub fn policy_for(
    type_name: &str,
    params: &str,
    role: WorkerType,
    router: RouterConfig,
) -> WorkerSelectionPolicy {
    resolve(type_name, params, role, &router)
        .unwrap()
        .build(&RoutingPartition::new(role, "model"))
}

/// Why one instance of `type_name` with `params` is refused at load.
pub fn refused(type_name: &str, params: &str) -> String {
    match resolve(
        type_name,
        params,
        WorkerType::Aggregated,
        &RouterConfig::default(),
    ) {
        Ok(_) => panic!("{type_name} with {params} was accepted"),
        Err(e) => e.to_string(),
    }
}

fn resolve(
    type_name: &str,
    params: &str,
    role: WorkerType,
    router: &RouterConfig,
) -> Result<RouterPlugins, PolicyConfigError> {
    let yaml = format!(
        "worker_selection:\n  {role}: p\n  instances:\n    - name: p\n      type: {type_name}\n      parameters: {params}\n"
    );
    let config = WorkerSelectionConfig::from_yaml_str(&yaml).unwrap();
    router_plugin_registry().resolve_plugins(&config, &SelectionOverrides::default(), router)
}

/// Deterministic Fisher-Yates.
pub fn shuffle<T>(v: &mut [T], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
}
