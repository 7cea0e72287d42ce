//! Entry point shared by the cargo-fuzz target and the property tests of
//! the configuration loader: any bytes, as a file an operator (or an
//! attacker with write access to it) could hand to `kvedge run`,
//! `check-config` or a reload. The loader must answer with a
//! configuration or an error, never panic, and stay bounded in time
//! whatever the nesting or size.

use kvedge_policies::{SelectionOverrides, router_plugin_registry};

use crate::{Config, source};

/// Loads `bytes` as the daemon would: bounded and UTF-8-checked text, then
/// parsed and validated. `Ok` with the number of rules, or the error text.
pub fn load_hostile_config(bytes: &[u8]) -> Result<usize, String> {
    let text = source::text(bytes)?;
    let config = Config::load(
        "fuzz.yaml",
        text,
        &router_plugin_registry(),
        &SelectionOverrides::default(),
    )
    .map_err(|e| e.to_string())?;
    Ok(config.rules.map_or(0, |r| r.rules.len()))
}
