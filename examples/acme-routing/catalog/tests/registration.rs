//! One registration test per type name, through the per-role YAML shipped
//! next to the catalog.

use kvedge_policies::plugins::router_plugin_registry;
use kvedge_policies::{
    CacheRow, CandidateRow, CandidateTable, LoadRow, RouterConfig, RoutingPartition,
    SelectionOverrides, WorkerInputs, WorkerSelectionConfig, WorkerSelectionContext, WorkerType,
    WorkerWithDpRank,
};

const YAML: &str = include_str!("../../worker-selection.yaml");

#[test]
fn registers_acme_least_busy_and_resolves_the_per_role_yaml() {
    let mut registry = router_plugin_registry();
    acme_routing_catalog::register(&mut registry).unwrap();
    assert!(registry.contains(acme_routing_policy::TYPE_NAME));
    assert!(
        registry
            .classifier_names()
            .any(|n| n == acme_routing_policy::CLASSIFIER_TYPE_NAME)
    );
    let classifier =
        kvedge_policies::plugins::request_classifier::ClassifierConfig::from_yaml_str(YAML)
            .unwrap();
    let resolved = registry
        .resolve_classifier(classifier.as_ref())
        .unwrap()
        .expect("the YAML configures one");
    assert_eq!(
        resolved.type_name(),
        acme_routing_policy::CLASSIFIER_TYPE_NAME
    );
    assert!(
        acme_routing_catalog::register(&mut registry).is_err(),
        "registering twice is refused"
    );
    let config = WorkerSelectionConfig::from_yaml_str(YAML).unwrap();
    let plugins = registry
        .resolve_plugins(
            &config,
            &SelectionOverrides::default(),
            &RouterConfig::default(),
        )
        .unwrap();
    assert_eq!(
        plugins.selection(WorkerType::Prefill),
        ("prefill-least-busy", "acme-least-busy")
    );
    assert_eq!(
        plugins.selection(WorkerType::Decode),
        ("least-busy", "acme-least-busy")
    );

    // The prefill instance requires one device block; aggregated does not.
    let mut table = CandidateTable::new();
    table.reset(WorkerInputs::CACHE | WorkerInputs::LOAD);
    for (id, device, active) in [(1u64, 0u32, 0u32), (2, 1, 3)] {
        table.push(CandidateRow {
            worker: WorkerWithDpRank::new(id, 0),
            cache: CacheRow {
                device_blocks: device,
                ..CacheRow::default()
            },
            load: LoadRow {
                active_requests: active,
                ..LoadRow::default()
            },
            ..CandidateRow::default()
        });
    }
    let ctx = WorkerSelectionContext::new("r", 64, 16);
    let mut prefill = plugins.build(&RoutingPartition::new(WorkerType::Prefill, "m"));
    let mut aggregated = plugins.build(&RoutingPartition::new(WorkerType::Aggregated, "m"));
    assert_eq!(prefill.select(&ctx, &table).unwrap().worker.worker_id, 2);
    assert_eq!(aggregated.select(&ctx, &table).unwrap().worker.worker_id, 1);
}
