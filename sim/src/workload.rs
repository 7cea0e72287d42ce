//! Workloads: the Mooncake trace format and a seeded synthetic generator,
//! both turned into [`TraceRequest`]s whose prompts are real token
//! sequences hashed with kvedge's block hashing, so that the router sees
//! the same prefix sharing the workload has.

use std::io::BufRead;

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Deserialize;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, microseconds from the start.
    pub arrival_us: u64,
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Sequence hashes of the prompt's full blocks.
    pub hashes: Vec<u64>,
    pub output_tokens: u32,
    /// Multi-turn conversation this request belongs to.
    pub session: Option<u64>,
    /// The turn carries a tool result (not a user message).
    pub tool_result: bool,
}

impl TraceRequest {
    pub fn prompt_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }
}

/// Tokens per Mooncake `hash_id`.
pub const MOONCAKE_BLOCK: usize = 512;

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{file}:{line}: {message}")]
    Line {
        file: String,
        line: usize,
        message: String,
    },
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: no requests")]
    Empty { file: String },
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// splitmix64: a fixed, well-mixed map from a counter to 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Vocabulary size of generated token ids (Llama 3's is 128,256).
const VOCAB: u64 = 128_000;

/// The 512 tokens a Mooncake `hash_id` stands for: derived from the id and
/// the position inside the block, so equal ids give equal tokens.
pub fn mooncake_block_tokens(hash_id: u64, out: &mut Vec<u32>) {
    for pos in 0..MOONCAKE_BLOCK as u64 {
        out.push((mix(hash_id.wrapping_mul(MOONCAKE_BLOCK as u64) ^ (pos << 48)) % VOCAB) as u32);
    }
}

/// Reads a Mooncake trace (one JSON object a line: `timestamp` in ms,
/// `input_length`, `output_length`, `hash_ids`). Arrival times are
/// multiplied by `time_scale` (0.5 replays twice as fast). Prompts are
/// hashed with `block_size`.
pub fn read_mooncake(
    file: &str,
    reader: impl BufRead,
    time_scale: f64,
    block_size: usize,
) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            file: file.into(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| TraceError::Line {
            file: file.into(),
            line: n + 1,
            message,
        };
        let l: MooncakeLine = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        if !l.timestamp.is_finite() || l.timestamp < 0.0 {
            return Err(bad(format!("timestamp {} is not a time", l.timestamp)));
        }
        if l.input_length == 0 {
            return Err(bad("input_length is 0".into()));
        }
        if l.hash_ids.len() != (l.input_length as usize).div_ceil(MOONCAKE_BLOCK) {
            return Err(bad(format!(
                "{} hash_ids for input_length {} (expected ceil({}/512))",
                l.hash_ids.len(),
                l.input_length,
                l.input_length
            )));
        }
        let mut tokens = Vec::with_capacity(l.hash_ids.len() * MOONCAKE_BLOCK);
        for &id in &l.hash_ids {
            mooncake_block_tokens(id, &mut tokens);
        }
        tokens.truncate(l.input_length as usize);
        let hashes = kvedge_schema::hash::sequence_hashes(&tokens, block_size, None, None);
        out.push(TraceRequest {
            arrival_us: (l.timestamp * 1000.0 * time_scale).round() as u64,
            tokens,
            hashes,
            output_tokens: l.output_length.max(1),
            session: None,
            tool_result: false,
        });
    }
    if out.is_empty() {
        return Err(TraceError::Empty { file: file.into() });
    }
    out.sort_by_key(|r| r.arrival_us);
    Ok(out)
}

/// How arrivals are spaced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// Exponential gaps at `rate_per_s`.
    Poisson,
    /// On/off: bursts at 4x the rate for a quarter of each 8 s period,
    /// then the remaining requests at a lower rate, same mean.
    Bursty,
}

/// The synthetic generator's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticParams {
    pub requests: usize,
    pub seed: u64,
    /// Mean arrival rate.
    pub rate_per_s: f64,
    pub arrivals: Arrivals,
    /// Shared-prefix groups (system prompts / few-shot templates).
    pub prefix_groups: u32,
    pub prefix_tokens: u32,
    /// Fraction of arrivals that continue an open conversation.
    pub follow_up_fraction: f64,
    /// Of follow-ups, the fraction that carry a tool result.
    pub tool_fraction: f64,
    /// New user tokens per turn: uniform in [min, max].
    pub user_tokens: (u32, u32),
    pub tool_tokens: (u32, u32),
    pub output_tokens: (u32, u32),
    /// A conversation ends once its context passes this.
    pub max_context_tokens: u32,
    pub block_size: usize,
}

impl Default for SyntheticParams {
    fn default() -> Self {
        SyntheticParams {
            requests: 2_000,
            seed: 1,
            rate_per_s: 12.0,
            arrivals: Arrivals::Poisson,
            prefix_groups: 32,
            prefix_tokens: 2_048,
            follow_up_fraction: 0.6,
            tool_fraction: 0.3,
            user_tokens: (64, 1_024),
            tool_tokens: (256, 2_048),
            output_tokens: (32, 512),
            max_context_tokens: 24_000,
            block_size: 16,
        }
    }
}

struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn unit(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, (lo, hi): (u32, u32)) -> u32 {
        lo + (self.0.next_u64() % u64::from(hi.saturating_sub(lo) + 1)) as u32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
    fn tokens(&mut self, n: u32, out: &mut Vec<u32>) {
        for _ in 0..n {
            out.push((self.0.next_u64() % VOCAB) as u32);
        }
    }
}

/// Generates a synthetic workload: conversations that start from one of the
/// shared prefixes (chosen with a skew: group `g` has weight 1/(g+1)), grow
/// turn by turn (the previous prompt, the previous answer, then a user
/// message or a tool result), and end past `max_context_tokens`. The same
/// parameters always give the same workload.
pub fn synthetic(p: &SyntheticParams) -> Vec<TraceRequest> {
    assert!(p.prefix_groups > 0 && p.rate_per_s > 0.0 && p.block_size > 0);
    let mut rng = Rng(Xoshiro256PlusPlus::seed_from_u64(p.seed));
    let prefixes: Vec<Vec<u32>> = (0..p.prefix_groups)
        .map(|_| {
            let mut t = Vec::new();
            rng.tokens(p.prefix_tokens, &mut t);
            t
        })
        .collect();
    let weights: Vec<f64> = (0..p.prefix_groups)
        .map(|g| 1.0 / f64::from(g + 1))
        .collect();
    let total_weight: f64 = weights.iter().sum();
    // Open conversations: (session id, context so far).
    let mut open: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut next_session = 1u64;
    let mut out = Vec::with_capacity(p.requests);
    let mut t = 0.0f64;
    for _ in 0..p.requests {
        let rate = match p.arrivals {
            Arrivals::Poisson => p.rate_per_s,
            Arrivals::Bursty => {
                // 2 s of every 8 at 2.5x, the rest at 0.5x: mean 1x.
                if t % 8.0 < 2.0 {
                    p.rate_per_s * 2.5
                } else {
                    p.rate_per_s * 0.5
                }
            }
        };
        t += -(1.0 - rng.unit()).ln() / rate;
        let follow_up = !open.is_empty() && rng.unit() < p.follow_up_fraction;
        let (session, mut tokens, tool) = if follow_up {
            let i = rng.below(open.len());
            let (id, context) = open.swap_remove(i);
            let tool = rng.unit() < p.tool_fraction;
            (id, context, tool)
        } else {
            let mut x = rng.unit() * total_weight;
            let mut g = 0;
            while g + 1 < weights.len() && x >= weights[g] {
                x -= weights[g];
                g += 1;
            }
            let id = next_session;
            next_session += 1;
            (id, prefixes[g].clone(), false)
        };
        let new = rng.range(if tool { p.tool_tokens } else { p.user_tokens });
        rng.tokens(new, &mut tokens);
        let output_tokens = rng.range(p.output_tokens);
        let hashes = kvedge_schema::hash::sequence_hashes(&tokens, p.block_size, None, None);
        out.push(TraceRequest {
            arrival_us: (t * 1e6) as u64,
            tokens: tokens.clone(),
            hashes,
            output_tokens,
            session: Some(session),
            tool_result: tool,
        });
        // The answer joins the context of the next turn.
        rng.tokens(output_tokens, &mut tokens);
        if (tokens.len() as u32) < p.max_context_tokens {
            open.push((session, tokens));
        }
    }
    out
}

/// The oracle bound: the prefix-cache hit rate (cached / prompt tokens)
/// with an unlimited cache that every worker shares, so each request hits
/// the longest prefix of blocks any earlier request computed. At least one
/// prompt token is always computed, as the engine model does.
pub fn oracle_hit_rate(requests: &[TraceRequest], block_size: u32) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in requests {
        let max_blocks = ((r.prompt_tokens().saturating_sub(1)) / block_size) as usize;
        let hit = r.hashes.iter().take_while(|h| seen.contains(*h)).count();
        cached += (hit.min(max_blocks) as u64) * u64::from(block_size);
        prompt += u64::from(r.prompt_tokens());
        seen.extend(r.hashes.iter().copied());
    }
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}
