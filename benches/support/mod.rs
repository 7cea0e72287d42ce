//! What the benches that run a daemon share: an in-process daemon (with its
//! endpoint picker when configured), and engines registered over its
//! control socket holding a prompt.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvedge_config::Config;
use kvedge_daemon::server::{RuntimeDir, Server};
use kvedge_policies::{SelectionOverrides, router_plugin_registry};
use kvedge_shm::Publisher;
use kvedge_shm::control::ProducerSession;
use kvedge_shm::messages::control::Hello;
use kvedge_shm::messages::{Role, Tier};

/// A daemon running `yaml` on a thread of this process (and its endpoint
/// picker, with an `epp:` section), its runtime directory under `dir`;
/// stopped by [`Running::stop`].
pub struct Running {
    pub runtime: RuntimeDir,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Running {
    pub fn start(dir: &Path, yaml: &str) -> Running {
        let config = Config::load(
            "bench",
            yaml,
            &router_plugin_registry(),
            &SelectionOverrides::default(),
        )
        .unwrap();
        let picker = config
            .epp
            .as_ref()
            .map(|s| kvedge_daemon::epp::load(s).unwrap());
        let runtime = RuntimeDir {
            dir: dir.join("run"),
        };
        let mut server = Server::bind(config, &runtime).unwrap();
        if let Some(picker) = picker {
            kvedge_daemon::epp::start(picker, server.job_sender().unwrap()).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let thread = std::thread::spawn(move || server.run(|| s.load(Ordering::Relaxed)).unwrap());
        Running {
            runtime,
            stop,
            thread,
        }
    }

    /// Registers worker `id` of model `m` at `endpoint`, holding the full
    /// blocks of `tokens` on its device.
    pub fn engine(&self, id: u64, endpoint: &str, tokens: &[u32]) -> Publisher {
        let hello = Hello {
            worker_id: id,
            dp_rank: 0,
            model: "m".into(),
            role: Role::Aggregated,
            block_size: 16,
            kv_blocks: [1 << 16, 0, 0],
            labels: vec![],
            taints: vec![],
            endpoint: endpoint.to_owned(),
            ring_capacity: 0,
        };
        let (session, ring) = ProducerSession::connect(
            self.runtime.dir.join("control.sock"),
            &hello,
            Duration::from_secs(5),
        )
        .unwrap();
        let mut p = Publisher::new(Some(session), ring);
        let full = &tokens[..tokens.len() / 16 * 16];
        if !full.is_empty() {
            let hashes = kvedge_shm::hash::sequence_hashes(full, 16, None, None);
            p.publish_stored_hashes(Tier::Device, None, &hashes)
                .unwrap();
        }
        p
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}
