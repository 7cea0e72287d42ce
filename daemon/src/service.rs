//! `kvedge run` as a service: logging, the listening sockets (bound here,
//! or passed by systemd socket activation), signals (SIGTERM/SIGINT stop
//! after a drain, SIGHUP reloads), and what systemd is told (READY=1,
//! STATUS=, WATCHDOG=1, RELOADING=1, STOPPING=1).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvedge_policies::{RouterPluginRegistry, SelectionOverrides};
use tracing::{error, info, warn};

use crate::server::{RuntimeDir, Server};
use kvedge_config::{LogFormat, LogSection};

/// Installs the process's log subscriber: `log.format`, and `KVEDGE_LOG`
/// (a tracing filter) over `log.level`. Logs go to stderr (the journal
/// under systemd).
pub fn init_logging(log: &LogSection) {
    let filter = std::env::var("KVEDGE_LOG")
        .ok()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| {
            tracing_subscriber::EnvFilter::try_new(&log.level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        });
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match log.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Moves query.sock to the io_uring listener, or leaves it on epoll (with a
/// warning) where io_uring is refused.
#[cfg(feature = "io-uring")]
fn start_uring(server: &mut Server, limits: &kvedge_config::DaemonSection) {
    match server.take_query_listener() {
        Ok(Some((listener, jobs))) => {
            match crate::uring::start(listener, jobs, limits.max_frame_bytes) {
                Ok(()) => info!("query.sock served on io_uring"),
                Err((listener, e)) => {
                    warn!("io_uring unavailable ({e}): query.sock stays on epoll");
                    if let Err(e) = server.restore_query_listener(listener) {
                        error!("cannot restore query.sock: {e}");
                    }
                }
            }
        }
        Ok(None) => {}
        Err(e) => warn!("io_uring listener not started ({e}): query.sock stays on epoll"),
    }
}

#[cfg(not(feature = "io-uring"))]
fn start_uring(_: &mut Server, _: &kvedge_config::DaemonSection) {
    // Refused by the config loader; nothing to do.
}

/// Starts the engine bridge when `engines` is not empty, or hands the
/// running one its new list.
fn start_bridge(
    settings: &kvedge_bridge::Settings,
    engines: Vec<kvedge_config::EngineSpec>,
    running: Option<kvedge_bridge::Bridge>,
) -> Option<kvedge_bridge::Bridge> {
    match running {
        Some(b) => {
            b.configure(engines);
            Some(b)
        }
        None if engines.is_empty() => None,
        None => {
            let n = engines.len();
            match kvedge_bridge::Bridge::start(settings.clone(), engines) {
                Ok(b) => {
                    info!("engine bridge started for {n} engine(s)");
                    Some(b)
                }
                Err(e) => {
                    error!("cannot start the engine bridge: {e}");
                    None
                }
            }
        }
    }
}

/// What the drivers around the core take from the configuration, split
/// off before the core takes the rest.
struct Drivers {
    metrics_listen: Option<String>,
    query_io: kvedge_config::QueryIo,
    limits: kvedge_config::DaemonSection,
    engines: Vec<kvedge_config::EngineSpec>,
    /// The picker with its models loaded.
    picker: Option<crate::epp::Loaded>,
    /// The longest prompt text the rules' regex classifier reads.
    classify_text_bytes: usize,
}

/// Step 1: the configuration, loaded and validated, and everything the
/// drivers read from disk (the picker's models): nothing is bound yet, so
/// a daemon that cannot serve never listens.
fn load(
    path: &Path,
    registry: &RouterPluginRegistry,
    overrides: &SelectionOverrides,
) -> Result<(kvedge_config::Config, Drivers), String> {
    let config = crate::config::load(path, registry, overrides).map_err(|e| e.to_string())?;
    init_logging(&config.log);
    let picker = config
        .epp
        .as_ref()
        .map(|s| crate::epp::load(s, &config.engines))
        .transpose()
        .map_err(|e| format!("epp: {e}"))?;
    let drivers = Drivers {
        metrics_listen: config.metrics.listen.clone(),
        query_io: config.daemon.query_io,
        limits: config.daemon.clone(),
        engines: config.engines.clone(),
        picker,
        classify_text_bytes: crate::epp::classify_text_bytes(&config),
    };
    Ok((config, drivers))
}

/// Step 2: the routing core on its sockets, bound in `dir` or passed by
/// systemd; whether they were bound here (and so are ours to remove).
fn build(config: kvedge_config::Config, dir: &RuntimeDir) -> Result<(Server, bool), String> {
    let passed = kvedge_shm::activation::take_listen_fds(|k| std::env::var(k).ok())
        .map_err(|e| e.to_string())?;
    if passed.is_empty() {
        let server = Server::bind(config, dir)
            .map_err(|e| format!("cannot listen in {}: {e}", dir.dir.display()))?;
        return Ok((server, true));
    }
    let (control, query) = crate::listen::activated_listeners(passed).map_err(|e| e.to_string())?;
    let server = Server::from_listeners(config, control, query)
        .map_err(|e| format!("passed sockets: {e}"))?;
    Ok((server, false))
}

/// Step 3: the drivers around the core: the metrics listener, the io_uring
/// query listener, the endpoint picker, the engine bridge, and the
/// reloader (which hands the bridge each reloaded `engines:` section).
/// Returns the metrics page the loop refreshes, if one is served.
fn start(
    server: &mut Server,
    dir: &RuntimeDir,
    drivers: Drivers,
    path: &Path,
    registry: RouterPluginRegistry,
    overrides: SelectionOverrides,
) -> Result<Option<Arc<std::sync::Mutex<String>>>, String> {
    let Drivers {
        metrics_listen,
        query_io,
        limits,
        engines,
        picker,
        classify_text_bytes,
    } = drivers;
    // The optional HTTP metrics listener serves a rendering the loop
    // refreshes every second.
    let metrics_text = match &metrics_listen {
        Some(addr) => {
            let text = Arc::new(std::sync::Mutex::new(String::new()));
            crate::metrics_http::serve_http(addr, Arc::clone(&text))
                .map_err(|e| format!("metrics.listen {addr}: {e}"))?;
            info!("metrics on http://{addr}/metrics");
            Some(text)
        }
        None => None,
    };
    if query_io == kvedge_config::QueryIo::IoUring {
        start_uring(server, &limits);
    }
    // The gateway endpoint picker, on its own thread, feeds the loop
    // through the jobs channel. It sends prompt texts the rules' regex
    // classifier reads; a reload may change how long those are.
    let text_limit = picker.as_ref().map(|p| p.classify_text_bytes());
    if let Some(limit) = &text_limit {
        limit.store(classify_text_bytes, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some(loaded) = picker {
        let addrs = server
            .job_sender()
            .and_then(|tx| crate::epp::start(loaded, tx))
            .map_err(|e| format!("epp: {e}"))?;
        info!("{}", kvedge_epp::server::describe(addrs.grpc));
        if let Some(http) = addrs.http {
            info!("{}", kvedge_epp::http::describe(http));
        }
    }
    // Engines read over ZeroMQ and Prometheus register through the
    // bridge's own thread like any other engine.
    let settings = kvedge_bridge::Settings {
        control_socket: dir.control(),
        heartbeat_timeout: std::time::Duration::from_millis(limits.heartbeat_timeout_ms),
        index_capacity: limits.index_capacity,
    };
    let mut bridge = start_bridge(&settings, engines, None);
    let path = path.to_owned();
    server.set_reloader(Box::new(move || {
        let config = crate::config::load(&path, &registry, &overrides)?;
        bridge = start_bridge(&settings, config.engines.clone(), bridge.take());
        if let Some(limit) = &text_limit {
            limit.store(
                crate::epp::classify_text_bytes(&config),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Ok(config)
    }));
    Ok(metrics_text)
}

/// Runs the daemon until SIGTERM or SIGINT; returns the exit code. One
/// path: load and validate, build the core on its sockets, start the
/// drivers, serve. `overrides` (the command line's and the environment's
/// policy selections) apply to every load, reloads included.
pub fn run(
    config_path: &Path,
    runtime_dir: PathBuf,
    registry: RouterPluginRegistry,
    overrides: SelectionOverrides,
) -> u8 {
    let (config, drivers) = match load(config_path, &registry, &overrides) {
        Ok(loaded) => loaded,
        Err(e) => {
            // Logging may not be set up yet: say it on stderr as well.
            eprintln!("kvedge: {e}");
            return 1;
        }
    };
    let dir = RuntimeDir { dir: runtime_dir };
    let (mut server, bound_here) = match build(config, &dir) {
        Ok(built) => built,
        Err(e) => {
            error!("{e}");
            return 1;
        }
    };
    let metrics_text = match start(&mut server, &dir, drivers, config_path, registry, overrides) {
        Ok(m) => m,
        Err(e) => {
            error!("{e}");
            return 1;
        }
    };
    let mut last_metrics = std::time::Instant::now()
        .checked_sub(std::time::Duration::from_secs(2))
        .unwrap_or_else(std::time::Instant::now);
    let stop = Arc::new(AtomicBool::new(false));
    let reload = Arc::new(AtomicBool::new(false));
    for (signal, flag) in [
        (signal_hook::consts::SIGTERM, &stop),
        (signal_hook::consts::SIGINT, &stop),
        (signal_hook::consts::SIGHUP, &reload),
    ] {
        if let Err(e) = signal_hook::flag::register(signal, Arc::clone(flag)) {
            error!("cannot handle signal {signal}: {e}");
            return 1;
        }
    }
    info!(
        runtime_dir = %dir.dir.display(),
        config = %config_path.display(),
        "listening"
    );
    crate::notify::ready(&server.core().status());
    let mut watchdog = crate::notify::Watchdog::default();
    let result = server.run_with(|s| {
        if stop.load(Ordering::Relaxed) {
            info!("stopping: answering what clients already sent");
            crate::notify::stopping();
            return true;
        }
        if reload.swap(false, Ordering::Relaxed) {
            info!("SIGHUP: reloading the configuration");
            // An invalid configuration was logged; the old one serves on.
            let _ = s.reload();
        }
        watchdog.tick(|| s.core().status());
        if let Some(page) = &metrics_text
            && last_metrics.elapsed() >= std::time::Duration::from_secs(1)
        {
            let text = kvedge_core::metrics::render(&s.core().metrics());
            if let Ok(mut m) = page.lock() {
                *m = text;
            }
            last_metrics = std::time::Instant::now();
        }
        false
    });
    if bound_here {
        let _ = std::fs::remove_file(dir.control());
        let _ = std::fs::remove_file(dir.query());
    }
    match result {
        Ok(()) => {
            info!("stopped");
            0
        }
        Err(e) => {
            warn!("{e}");
            1
        }
    }
}
