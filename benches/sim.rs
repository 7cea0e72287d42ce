//! Replay speed of `kvedge sim` (target: a 12,000-request trace on 8
//! workers in under 60 s): one policy's whole replay, the real router core
//! and 8 engine models in virtual time, and the engine model alone.
//!
//! `cargo bench --bench sim`

#![forbid(unsafe_code)]

use criterion::Criterion;
use kvedge_policies::router_plugin_registry;
use kvedge_sim::engine::EngineParams;
use kvedge_sim::workload::{SyntheticParams, synthetic};
use kvedge_tools::sim::{Setup, preset_config, run};

fn main() {
    let mut c = Criterion::default().configure_from_args().sample_size(10);
    let requests = synthetic(&SyntheticParams {
        requests: 12_000,
        ..SyntheticParams::default()
    });
    let setup = Setup {
        workers: 8,
        engine: EngineParams::default(),
        sample_us: 1_000_000,
        approximate: false,
    };
    let registry = router_plugin_registry();
    let mut g = c.benchmark_group("sim");
    for policy in ["default", "round-robin"] {
        let config = preset_config(policy, &registry).unwrap();
        g.bench_function(
            format!("synthetic_12000_requests_8_workers_{policy}"),
            |b| {
                b.iter(|| {
                    run(&config, policy, &setup, &requests, 0.0)
                        .summary
                        .requests
                })
            },
        );
    }
    g.finish();
    c.final_summary();
}
