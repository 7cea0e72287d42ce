//! Router-wide settings the built-in cost policy inherits when an instance
//! leaves a parameter out (the analogue of Dynamo's `KvRouterConfig`).

use serde::Deserialize;

/// Defaults of the default cost policy, and the seed of per-instance RNGs.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// Credit per device-resident overlap block against prefill work.
    pub overlap_score_credit: f64,
    /// Decay of the device credit as a worker's prefill backlog exceeds the
    /// least-loaded candidate's (0 = off).
    pub overlap_score_credit_decay: f64,
    /// Scale of the prefill term after credits.
    pub prefill_load_scale: f64,
    /// Softmax sampling temperature over costs (0 = argmin).
    pub router_temperature: f64,
    /// Cost per active request.
    pub decode_active_request_weight: f64,
    /// Credit per host-tier (CPU) overlap block.
    pub host_cache_hit_weight: f64,
    /// Credit per disk-tier overlap block.
    pub disk_cache_hit_weight: f64,
    /// Whether a node-shared cache tier reports hits.
    pub shared_cache_enabled: bool,
    /// Credit per shared-cache block beyond the device prefix; when unset,
    /// 0.5 with a shared cache and 0 without.
    pub shared_cache_multiplier: Option<f64>,
    /// Whether prefill tokens are tracked per worker (disaggregated decode
    /// pools usually do not).
    pub track_prefill_tokens: bool,
    /// Base seed of every policy instance's RNG (mixed with the partition).
    pub seed: u64,
    /// The cost multiplier of each `PreferNoSchedule` taint a worker has
    /// and a request does not tolerate (the `PREFERRED_TAINT` signal).
    pub preferred_taint_multiplier: f64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            overlap_score_credit: 1.0,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: 1.0,
            router_temperature: 0.0,
            decode_active_request_weight: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_enabled: false,
            shared_cache_multiplier: None,
            track_prefill_tokens: true,
            seed: 0,
            preferred_taint_multiplier: 2.0,
        }
    }
}

impl RouterConfig {
    /// The shared-cache credit in effect.
    pub fn effective_shared_cache_multiplier(&self) -> f64 {
        match (self.shared_cache_enabled, self.shared_cache_multiplier) {
            (false, _) => 0.0,
            (true, Some(m)) => m,
            (true, None) => 0.5,
        }
    }

    /// Checks every number is finite and non-negative.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("overlap_score_credit", self.overlap_score_credit),
            (
                "overlap_score_credit_decay",
                self.overlap_score_credit_decay,
            ),
            ("prefill_load_scale", self.prefill_load_scale),
            ("router_temperature", self.router_temperature),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
            ),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            (
                "shared_cache_multiplier",
                self.shared_cache_multiplier.unwrap_or(0.0),
            ),
            (
                "preferred_taint_multiplier",
                self.preferred_taint_multiplier,
            ),
        ];
        for (name, value) in fields {
            check_non_negative(name, value)?;
        }
        Ok(())
    }
}

/// The one rule for numeric parameters: finite and non-negative.
pub(crate) fn check_non_negative(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!(
            "{name} must be a finite non-negative number, got {value}"
        ))
    }
}
