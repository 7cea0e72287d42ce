//! The engine model's parameters as command-line arguments, shared by
//! `kvedge mock-engine`, `kvedge sim` and `kvedge demo`.

use kvedge_sim::engine::EngineParams;

/// Engine model parameters, shared by `sim`, `mock-engine` and `demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Device KV blocks per engine (default: ~500k tokens, an 80 GB card
    /// serving an 8B model).
    #[arg(long, default_value_t = 32_768)]
    pub device_blocks: u32,
    /// Host-tier KV blocks per engine (0: none).
    #[arg(long, default_value_t = 0)]
    pub host_blocks: u32,
    /// Prefill speed, tokens per second.
    #[arg(long, default_value_t = 25_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of a step (the decode time per token at low load), µs.
    #[arg(long, default_value_t = 6_000.0)]
    pub step_base_us: f64,
    /// Decode cost per context token of each decoding sequence, µs.
    #[arg(long, default_value_t = 0.044)]
    pub decode_us_per_context_token: f64,
    /// Token budget of a step.
    #[arg(long, default_value_t = 8_192)]
    pub max_batch_tokens: u32,
    /// Sequences running at once.
    #[arg(long, default_value_t = 256)]
    pub max_running: u32,
}

impl EngineArgs {
    pub fn params(&self) -> Result<EngineParams, String> {
        if self.block_size == 0 || self.device_blocks == 0 {
            return Err("--block-size and --device-blocks must be positive".into());
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        if !positive(self.prefill_tokens_per_s)
            || !non_negative(self.step_base_us)
            || !non_negative(self.decode_us_per_context_token)
        {
            return Err("engine speeds must be positive and times non-negative".into());
        }
        if self.max_batch_tokens == 0 || self.max_running == 0 {
            return Err("--max-batch-tokens and --max-running must be positive".into());
        }
        Ok(EngineParams {
            block_size: self.block_size,
            device_blocks: self.device_blocks,
            host_blocks: self.host_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            step_base_us: self.step_base_us,
            decode_us_per_context_token: self.decode_us_per_context_token,
            ..EngineParams::default()
        })
    }
}
