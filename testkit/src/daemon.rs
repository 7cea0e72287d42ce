//! A daemon in this process: its configuration loaded from YAML, its
//! sockets bound in a fresh directory (with the endpoint picker started
//! when the configuration has an `epp:` section), then its routing loop
//! run on a thread of its own until the [`Running`] handle is dropped.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use kvedge_config::Config;
use kvedge_daemon::server::{RuntimeDir, Server};
use kvedge_policies::{SelectionOverrides, router_plugin_registry};

/// `yaml` loaded as `kvedge run` loads a file, with the shipped policies.
pub fn config(yaml: &str) -> Config {
    Config::load(
        "test.yaml",
        yaml,
        &router_plugin_registry(),
        &SelectionOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A fresh, empty directory for `name` under the system's temporary one.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvedge-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A daemon whose sockets are bound but whose loop does not run yet: what
/// a test changes before it runs (its query listener moved to io_uring,
/// its job channel taken) is done on `server`.
pub struct Bound {
    pub server: Server,
    pub runtime: RuntimeDir,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound")
            .field("runtime", &self.runtime.dir)
            .finish_non_exhaustive()
    }
}

impl Bound {
    /// `yaml`'s daemon in a fresh directory named after `name`.
    pub fn new(name: &str, yaml: &str) -> Bound {
        Bound::at(temp_dir(name), config(yaml))
    }

    /// `config`'s daemon with its sockets in `dir`, and its picker when
    /// configured (models loaded before anything is bound, as
    /// `kvedge run` does).
    pub fn at(dir: PathBuf, config: Config) -> Bound {
        let picker = config
            .epp
            .as_ref()
            .map(|s| kvedge_daemon::epp::load(s, &config.engines).unwrap());
        let runtime = RuntimeDir { dir };
        let mut server = Server::bind(config, &runtime).unwrap();
        if let Some(picker) = picker {
            kvedge_daemon::epp::start(picker, server.job_sender().unwrap()).unwrap();
        }
        Bound { server, runtime }
    }

    /// Runs the loop on a thread of its own until the handle is dropped.
    pub fn run(self) -> Running {
        self.run_with(|_| false)
    }

    /// Runs the loop, calling `each_turn` at every turn (it may look at
    /// the server, and stops the loop by returning true).
    pub fn run_with(
        self,
        mut each_turn: impl FnMut(&mut Server) -> bool + Send + 'static,
    ) -> Running {
        let Bound {
            mut server,
            runtime,
        } = self;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            server
                .run_with(|s| each_turn(s) || flag.load(Ordering::Relaxed))
                .unwrap();
        });
        Running {
            runtime,
            stop,
            thread: Some(thread),
        }
    }
}

/// A running daemon; dropping it stops the loop and removes its
/// directory.
pub struct Running {
    pub runtime: RuntimeDir,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("runtime", &self.runtime.dir)
            .finish_non_exhaustive()
    }
}

impl Running {
    pub fn control(&self) -> PathBuf {
        self.runtime.control()
    }

    pub fn query(&self) -> PathBuf {
        self.runtime.query()
    }

    /// Stops the loop and waits for it.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.halt();
        let _ = std::fs::remove_dir_all(&self.runtime.dir);
    }
}
