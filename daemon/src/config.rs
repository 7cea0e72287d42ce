//! How `kvedge run`, a reload and `kvedge check-config` load the
//! configuration file: the core's loader, then what only this daemon build
//! can judge (its logger's filter syntax, whether it has io_uring).

use std::path::Path;

use kvedge_core::config::{Config, ConfigError, QueryIo};
use kvedge_policies::{RouterPluginRegistry, SelectionOverrides};

/// Reads, parses and validates the file at `path` for this daemon.
pub fn load(
    path: &Path,
    registry: &RouterPluginRegistry,
    overrides: &SelectionOverrides,
) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let source = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: file.clone(),
        message: format!("cannot read: {e}"),
    })?;
    let config = Config::load(&file, &source, registry, overrides)?;
    check(&config).map_err(|message| ConfigError { file, message })?;
    Ok(config)
}

/// What the core's loader cannot judge.
pub fn check(config: &Config) -> Result<(), String> {
    if config.daemon.query_io == QueryIo::IoUring && !cfg!(feature = "io-uring") {
        return Err(
            "daemon.query_io: io-uring needs a kvedge built with `--features io-uring`".into(),
        );
    }
    if tracing_subscriber::EnvFilter::try_new(&config.log.level).is_err() {
        return Err(format!(
            "log.level `{}` is not a filter (e.g. info, debug, kvedge_daemon=debug,warn)",
            config.log.level
        ));
    }
    Ok(())
}
