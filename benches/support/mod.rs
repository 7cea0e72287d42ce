//! What the benches that run a daemon share beyond the test kit: engines
//! registered over its control socket holding a prompt.

use std::path::Path;

use kvedge_schema::messages::Tier;
use kvedge_schema::messages::control::Hello;
use kvedge_shm::Publisher;

/// Registers worker `id` of model `m` at `endpoint` with the daemon whose
/// control socket is `control`, holding the full blocks of `tokens` on its
/// device.
pub fn engine(control: &Path, id: u64, endpoint: &str, tokens: &[u32]) -> Publisher {
    let hello = Hello {
        kv_blocks: [1 << 16, 0, 0],
        endpoint: endpoint.to_owned(),
        ..Hello::new(id, "m")
    };
    let mut p = kvedge_testkit::register(control, &hello);
    let full = &tokens[..tokens.len() / 16 * 16];
    if !full.is_empty() {
        let hashes = kvedge_schema::hash::sequence_hashes(full, 16, None, None);
        p.publish_stored_hashes(Tier::Device, None, &hashes)
            .unwrap();
    }
    p
}
