//! How `kvedge run`, a reload and `kvedge check-config` load the
//! configuration file: the core's loader, then what only this daemon build
//! can judge (its logger's filter syntax, whether it has io_uring).

use std::path::Path;

use kvedge_config::{Config, ConfigError, QueryIo, source};
use kvedge_policies::{RouterPluginRegistry, SelectionOverrides};

/// Reads, parses and validates the file at `path` for this daemon.
pub fn load(
    path: &Path,
    registry: &RouterPluginRegistry,
    overrides: &SelectionOverrides,
) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let err = |message: String| ConfigError {
        file: file.clone(),
        message,
    };
    // Bounded before it is read whole: a huge file is refused by its size.
    let len = std::fs::metadata(path)
        .map_err(|e| err(format!("cannot read: {e}")))?
        .len();
    if len > source::MAX_CONFIG_BYTES as u64 {
        return Err(err(format!(
            "the file is {len} bytes; a configuration may be at most {}",
            source::MAX_CONFIG_BYTES
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let source = source::text(&bytes).map_err(&err)?;
    let config = Config::load(&file, source, registry, overrides)?;
    check(&config, source).map_err(err)?;
    Ok(config)
}

/// What the core's loader cannot judge; `source` is the file's text (for
/// line numbers).
pub fn check(config: &Config, source: &str) -> Result<(), String> {
    let at = |path: &[&str], message: String| match source::key_line(source, path) {
        Some(line) => format!("line {line}: {message}"),
        None => message,
    };
    if config.daemon.query_io == QueryIo::IoUring && !cfg!(feature = "io-uring") {
        return Err(at(
            &["daemon", "query_io"],
            "daemon.query_io: io-uring needs a kvedge built with `--features io-uring`".into(),
        ));
    }
    if tracing_subscriber::EnvFilter::try_new(&config.log.level).is_err() {
        return Err(at(
            &["log", "level"],
            format!(
                "log.level `{}` is not a filter (e.g. info, debug, kvedge_daemon=debug,warn)",
                config.log.level
            ),
        ));
    }
    Ok(())
}
