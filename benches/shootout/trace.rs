//! The shoot-out's traces: generated here, written in the Mooncake format
//! (one JSON object a line: `timestamp` in ms, `input_length`,
//! `output_length`, `hash_ids`), and turned into prompt text.
//!
//! A trace block is [`TOKENS_PER_BLOCK`] tokens: the text of block `h` is
//! that many words, each one token of the shoot-out's tokenizer, chosen
//! from `h` alone. Two requests that share their first `k` hash ids share
//! their first `32 k` tokens, and their text up to the same point, so a
//! router that matches text and one that matches token blocks see the
//! same prefixes.
//!
//! Two shapes, both at a given mean rate (Poisson arrivals):
//! - `system-prompts`: 12 system prompts of 24-64 blocks, chosen with a
//!   Zipf popularity (s = 1.1), each followed by 1-8 blocks of its own;
//!   16-128 output tokens.
//! - `multi-turn`: chats of 2-10 turns. A chat starts with one of 4 system
//!   prompts (8 blocks) and a 2-12 block question; each later turn brings
//!   the whole history (every earlier question and answer) and a new 1-6
//!   block question, after a think time of 0.5 s plus an exponential of
//!   mean 2.5 s from the previous turn's arrival. Answers are 16-96
//!   tokens; their text is new blocks of the history.

use std::io::{BufRead, Write};
use std::path::Path;

use serde_json::{Value, json};

/// Tokens per trace block.
pub const TOKENS_PER_BLOCK: u32 = 32;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Arrival, ms from the start.
    pub timestamp_ms: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    SystemPrompts,
    MultiTurn,
}

impl Shape {
    pub fn parse(s: &str) -> Result<Shape, String> {
        match s {
            "system-prompts" => Ok(Shape::SystemPrompts),
            "multi-turn" => Ok(Shape::MultiTurn),
            _ => Err(format!(
                "unknown trace shape `{s}` (system-prompts, multi-turn)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Shape::SystemPrompts => "system-prompts",
            Shape::MultiTurn => "multi-turn",
        }
    }
}

/// splitmix64: small, seedable, and the same on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// `n` requests of `shape` at `rate` requests a second on average.
pub fn generate(shape: Shape, n: usize, rate: f64, seed: u64) -> Vec<Request> {
    let mut rng = Rng::new(seed ^ shape as u64);
    // Hash ids are handed out in order; system prompts take the first.
    let mut next_id = 0u64;
    let mut fresh = |k: u32| -> Vec<u64> {
        let ids = (next_id..next_id + u64::from(k)).collect();
        next_id += u64::from(k);
        ids
    };
    let request = |t: f64, hash_ids: Vec<u64>, output: u32| Request {
        timestamp_ms: (t * 1000.0) as u64,
        input_length: hash_ids.len() as u32 * TOKENS_PER_BLOCK,
        output_length: output,
        hash_ids,
    };
    let mut out = Vec::with_capacity(n);
    match shape {
        Shape::SystemPrompts => {
            let prompts: Vec<Vec<u64>> = (0..12).map(|_| fresh(rng.range(24, 64))).collect();
            let weights: Vec<f64> = (1..=prompts.len())
                .map(|r| 1.0 / (r as f64).powf(1.1))
                .collect();
            let total: f64 = weights.iter().sum();
            let mut t = 0.0;
            for _ in 0..n {
                t += rng.exp(1.0 / rate);
                let mut x = rng.unit() * total;
                let mut pick = prompts.len() - 1;
                for (i, w) in weights.iter().enumerate() {
                    if x < *w {
                        pick = i;
                        break;
                    }
                    x -= w;
                }
                let mut ids = prompts[pick].clone();
                ids.extend(fresh(rng.range(1, 8)));
                out.push(request(t, ids, rng.range(16, 128)));
            }
        }
        Shape::MultiTurn => {
            let systems: Vec<Vec<u64>> = (0..4).map(|_| fresh(8)).collect();
            // Chats start at a rate that makes the requests' rate `rate`:
            // a chat has 6 turns on average.
            let mut chats: Vec<(f64, Vec<u64>, u32)> = Vec::new();
            let mut t = 0.0;
            while chats.iter().map(|c| c.2 as usize).sum::<usize>() < n {
                t += rng.exp(6.0 / rate);
                let mut ids = systems[rng.range(0, 3) as usize].clone();
                ids.extend(fresh(rng.range(2, 12)));
                chats.push((t, ids, rng.range(2, 10)));
            }
            // Each chat's turns, then all of them in arrival order.
            let mut all = Vec::new();
            for (start, mut history, turns) in chats {
                let mut at = start;
                for turn in 0..turns {
                    if turn > 0 {
                        at += 0.5 + rng.exp(2.5);
                        history.extend(fresh(rng.range(1, 6)));
                    }
                    let output = rng.range(16, 96);
                    all.push(request(at, history.clone(), output));
                    // The answer's text joins the history.
                    history.extend(fresh(output.div_ceil(TOKENS_PER_BLOCK)));
                }
            }
            all.sort_by_key(|r| r.timestamp_ms);
            all.truncate(n);
            out = all;
        }
    }
    out
}

pub fn write(path: &Path, trace: &[Request]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in trace {
        writeln!(
            f,
            "{}",
            json!({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                   "output_length": r.output_length, "hash_ids": r.hash_ids})
        )?;
    }
    f.flush()
}

pub fn read(path: &Path) -> Result<Vec<Request>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
        let field = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| format!("{}:{}: no `{k}`", path.display(), i + 1))
        };
        out.push(Request {
            timestamp_ms: field("timestamp")?,
            input_length: field("input_length")? as u32,
            output_length: field("output_length")? as u32,
            hash_ids: v["hash_ids"]
                .as_array()
                .ok_or_else(|| format!("{}:{}: no `hash_ids`", path.display(), i + 1))?
                .iter()
                .filter_map(Value::as_u64)
                .collect(),
        });
    }
    Ok(out)
}

/// Block texts: words of one token each.
pub struct Words(Vec<String>);

impl Words {
    /// The vocabulary's whole lowercase words of 3-10 letters that the
    /// tokenizer encodes as one token, in a fixed order.
    pub fn from_tokenizer(t: &tokenizers::Tokenizer) -> Result<Words, String> {
        let mut words: Vec<String> = t
            .get_vocab(false)
            .into_keys()
            .filter(|w| (3..=10).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase()))
            .filter(|w| {
                t.encode(w.as_str(), false)
                    .map(|e| e.get_ids().len() == 1)
                    .unwrap_or(false)
            })
            .collect();
        words.sort();
        if words.len() < 64 {
            return Err(format!(
                "the tokenizer has {} one-token words; at least 64 are needed",
                words.len()
            ));
        }
        Ok(Words(words))
    }

    /// The prompt of `hash_ids`: each block's words, space-separated.
    pub fn prompt(&self, hash_ids: &[u64]) -> String {
        let mut out = String::new();
        for &h in hash_ids {
            let mut rng = Rng::new(h.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5EED);
            for _ in 0..TOKENS_PER_BLOCK {
                if !out.is_empty() {
                    out.push(' ');
                }
                out.push_str(&self.0[(rng.next_u64() % self.0.len() as u64) as usize]);
            }
        }
        out
    }
}
