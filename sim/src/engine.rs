//! A model of one vLLM-style inference engine, in virtual time and without
//! I/O, precise enough to judge routing: a pool of fixed-size KV blocks with
//! prefix caching by sequence hash and LRU eviction of unreferenced blocks,
//! an optional host tier that receives evicted blocks, and a step scheduler
//! with a token budget per step (chunked prefill, one decode token per
//! running sequence per step).
//!
//! The model reports exactly what a real engine would publish: `Stored`
//! when a prompt block is complete and enters the prefix cache, `Removed`
//! when a cached block is evicted, a `Load` after every step. It also
//! reports each request's time to first token, cached tokens and finish
//! time. Decode-generated tokens are not cached (their content is not known
//! to the workload); only prompt blocks are.
//!
//! Time is in microseconds of virtual time. A step that starts at `t`
//! decides its batch at `t` and takes effect at `t + duration`, where
//! duration = `step_base_us` + prefill tokens / `prefill_tokens_per_s` +
//! host-tier reloads / `host_load_tokens_per_s` + context tokens of the
//! decoding sequences × `decode_us_per_context_token`.

use std::collections::{HashMap, VecDeque};

use kvedge_schema::messages::{Load, Tier};

/// The engine's hardware and scheduler, as parameters.
///
/// The defaults model an 80 GB card serving an 8B model (Llama-3-8B in
/// bf16): 16 GB of weights leave about 64 GB for KV at 128 KiB per token
/// (32 layers × 8 KV heads × 128 dims × K and V × 2 bytes), so about
/// 500,000 tokens: 32,768 blocks of 16. Prefill runs at 25,000 tokens/s
/// (2 × 8e9 FLOP per token at roughly half of an H100's dense bf16 peak,
/// less attention), a decode step costs 6 ms of weight reads plus the
/// sequences' KV reads (128 KiB per context token at 3 TB/s is 0.044 µs),
/// the step budget is 8,192 tokens and at most 256 sequences run at once,
/// as vLLM's defaults. No host tier by default.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineParams {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Device (GPU) KV blocks.
    pub device_blocks: u32,
    /// Host (CPU) KV blocks that receive evicted device blocks; 0: no host
    /// tier.
    pub host_blocks: u32,
    /// Token budget of one step (prefill chunks plus one token per decoding
    /// sequence).
    pub max_batch_tokens: u32,
    /// Sequences running at once.
    pub max_running: u32,
    /// Prefill speed.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of a step (a decode step with an empty batch): the
    /// per-token decode time at low load.
    pub step_base_us: f64,
    /// Decode cost per context token of every decoding sequence (KV reads).
    pub decode_us_per_context_token: f64,
    /// Speed of copying host-tier blocks back to the device.
    pub host_load_tokens_per_s: f64,
}

impl Default for EngineParams {
    fn default() -> Self {
        EngineParams {
            block_size: 16,
            device_blocks: 32_768,
            host_blocks: 0,
            max_batch_tokens: 8_192,
            max_running: 256,
            prefill_tokens_per_s: 25_000.0,
            step_base_us: 6_000.0,
            decode_us_per_context_token: 0.044,
            host_load_tokens_per_s: 1_000_000.0,
        }
    }
}

/// A request as the engine receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    pub id: u64,
    /// Sequence hashes of the prompt's full blocks, in order.
    pub hashes: Vec<u64>,
    pub prompt_tokens: u32,
    /// Tokens to generate (at least 1: the first token).
    pub output_tokens: u32,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("prompt of {prompt_tokens} tokens needs {blocks} blocks; the engine has {capacity}")]
    TooLong {
        prompt_tokens: u32,
        blocks: u32,
        capacity: u32,
    },
    #[error("request {0} has {1} hashes for {2} prompt tokens of block size {3}")]
    BadHashes(u64, usize, u32, u32),
    #[error("request {0} is already queued or running")]
    Duplicate(u64),
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(u64),
}

/// A KV event, as the engine would publish it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored {
        tier: Tier,
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    Removed {
        tier: Tier,
        hashes: Vec<u64>,
    },
}

/// What happened to a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Completion {
    /// The prefill finished and the first token came out.
    FirstToken {
        id: u64,
        at_us: u64,
        /// Prompt tokens served from the prefix cache (either tier).
        cached_tokens: u32,
    },
    /// A later output token came out, one a decode step (reported only
    /// when asked for: [`EngineModel::report_tokens`]); the last one comes
    /// just before the request's `Finished`.
    Token { id: u64, at_us: u64 },
    /// The last output token came out; the request left the engine.
    Finished { id: u64, at_us: u64 },
}

/// What `advance` produced, appended in order.
#[derive(Debug, Default)]
pub struct Outputs {
    pub events: Vec<KvEvent>,
    /// A Load after every step, stamped with the engine clock.
    pub loads: Vec<Load>,
    pub completions: Vec<Completion>,
}

impl Outputs {
    pub fn clear(&mut self) {
        self.events.clear();
        self.loads.clear();
        self.completions.clear();
    }
}

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    /// Sequence hash while in the prefix cache.
    hash: Option<u64>,
    refs: u32,
    /// Intrusive LRU list of cached, unreferenced blocks.
    prev: u32,
    next: u32,
}

/// An LRU list threaded through the blocks (or host entries).
#[derive(Debug)]
struct Lru {
    head: u32,
    tail: u32,
    len: u32,
}

impl Lru {
    fn new() -> Self {
        Lru {
            head: NONE,
            tail: NONE,
            len: 0,
        }
    }
    fn push_back(&mut self, nodes: &mut [Block], i: u32) {
        nodes[i as usize].prev = self.tail;
        nodes[i as usize].next = NONE;
        if self.tail == NONE {
            self.head = i;
        } else {
            nodes[self.tail as usize].next = i;
        }
        self.tail = i;
        self.len += 1;
    }
    fn unlink(&mut self, nodes: &mut [Block], i: u32) {
        let (p, n) = (nodes[i as usize].prev, nodes[i as usize].next);
        if p == NONE {
            self.head = n;
        } else {
            nodes[p as usize].next = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            nodes[n as usize].prev = p;
        }
        nodes[i as usize].prev = NONE;
        nodes[i as usize].next = NONE;
        self.len -= 1;
    }
}

/// The host tier: an LRU set of block hashes.
#[derive(Debug)]
struct HostTier {
    capacity: u32,
    slots: Vec<Block>,
    map: HashMap<u64, u32>,
    free: Vec<u32>,
    lru: Lru,
}

impl HostTier {
    fn new(capacity: u32) -> Self {
        HostTier {
            capacity,
            slots: Vec::new(),
            map: HashMap::new(),
            free: Vec::new(),
            lru: Lru::new(),
        }
    }
    /// Inserts `hash` as most recent; returns the hash evicted to make room.
    fn insert(&mut self, hash: u64) -> Option<u64> {
        if self.capacity == 0 {
            return None;
        }
        if let Some(&i) = self.map.get(&hash) {
            self.lru.unlink(&mut self.slots, i);
            self.lru.push_back(&mut self.slots, i);
            return None;
        }
        let mut evicted = None;
        let i = if let Some(i) = self.free.pop() {
            i
        } else if (self.slots.len() as u32) < self.capacity {
            self.slots.push(Block {
                hash: None,
                refs: 0,
                prev: NONE,
                next: NONE,
            });
            self.slots.len() as u32 - 1
        } else {
            let victim = self.lru.head;
            self.lru.unlink(&mut self.slots, victim);
            let old = self.slots[victim as usize]
                .hash
                .take()
                .expect("host slot in use");
            self.map.remove(&old);
            evicted = Some(old);
            victim
        };
        self.slots[i as usize].hash = Some(hash);
        self.map.insert(hash, i);
        self.lru.push_back(&mut self.slots, i);
        evicted
    }
    fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }
}

#[derive(Debug)]
struct Seq {
    id: u64,
    hashes: Vec<u64>,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Prompt tokens served from cache (set at admission).
    cached_tokens: u32,
    /// Of those, tokens reloaded from the host tier (cost in the first step).
    host_tokens: u32,
    /// Prompt tokens computed or cached so far.
    prefilled: u32,
    generated: u32,
    blocks: Vec<u32>,
    /// Leading blocks already registered in the prefix cache.
    registered: usize,
}

impl Seq {
    fn context_tokens(&self) -> u32 {
        self.prefilled + self.generated
    }
}

/// One engine. See the module documentation.
#[derive(Debug)]
pub struct EngineModel {
    params: EngineParams,
    blocks: Vec<Block>,
    free: Vec<u32>,
    cached: HashMap<u64, u32>,
    lru: Lru,
    host: HostTier,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// End of the step in progress.
    step_end: Option<u64>,
    /// What the step in progress does: (sequence index, prefill tokens).
    plan: Vec<(usize, u32)>,
    /// When the last step ended (or the engine went idle).
    clock: u64,
    steps: u64,
    /// Whether every decode step's tokens are reported ([`Completion::Token`]).
    tokens: bool,
}

impl EngineModel {
    pub fn new(params: EngineParams) -> Self {
        assert!(params.block_size > 0 && params.device_blocks > 0);
        let n = params.device_blocks;
        EngineModel {
            blocks: vec![
                Block {
                    hash: None,
                    refs: 0,
                    prev: NONE,
                    next: NONE,
                };
                n as usize
            ],
            free: (0..n).rev().collect(),
            cached: HashMap::with_capacity(n as usize),
            lru: Lru::new(),
            host: HostTier::new(params.host_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            step_end: None,
            plan: Vec::new(),
            clock: 0,
            steps: 0,
            tokens: false,
            params,
        }
    }

    /// Reports each output token after the first as it comes out
    /// ([`Completion::Token`]), as an engine streaming one event a token
    /// does; off by default (a simulation needs only the first and last).
    pub fn report_tokens(&mut self, on: bool) {
        self.tokens = on;
    }

    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Blocks needed to hold `tokens` tokens.
    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.params.block_size)
    }

    /// Queues a request that arrived at `now_us`. Call [`advance`] after.
    ///
    /// [`advance`]: EngineModel::advance
    pub fn submit(&mut self, req: EngineRequest, now_us: u64) -> Result<(), SubmitError> {
        let bs = self.params.block_size;
        if req.prompt_tokens == 0 {
            return Err(SubmitError::EmptyPrompt(req.id));
        }
        if req.hashes.len() != (req.prompt_tokens / bs) as usize {
            return Err(SubmitError::BadHashes(
                req.id,
                req.hashes.len(),
                req.prompt_tokens,
                bs,
            ));
        }
        let blocks = self.blocks_for(req.prompt_tokens + req.output_tokens.max(1));
        if blocks > self.params.device_blocks {
            return Err(SubmitError::TooLong {
                prompt_tokens: req.prompt_tokens,
                blocks,
                capacity: self.params.device_blocks,
            });
        }
        if self
            .waiting
            .iter()
            .chain(&self.running)
            .any(|s| s.id == req.id)
        {
            return Err(SubmitError::Duplicate(req.id));
        }
        if self.step_end.is_none() {
            self.clock = self.clock.max(now_us);
        }
        self.waiting.push_back(Seq {
            id: req.id,
            hashes: req.hashes,
            prompt_tokens: req.prompt_tokens,
            output_tokens: req.output_tokens.max(1),
            cached_tokens: 0,
            host_tokens: 0,
            prefilled: 0,
            generated: 0,
            blocks: Vec::new(),
            registered: 0,
        });
        Ok(())
    }

    /// True when nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Runs every step that ends at or before `now_us`, appending what
    /// happened to `out`, and starts the next one if there is work. Returns
    /// when the step in progress ends (call again then), or `None` when
    /// the engine is idle.
    pub fn advance(&mut self, now_us: u64, out: &mut Outputs) -> Option<u64> {
        loop {
            if let Some(end) = self.step_end {
                if end > now_us {
                    return Some(end);
                }
                self.finish_step(end, out);
                self.step_end = None;
                self.clock = end;
            }
            if self.is_idle() {
                self.clock = self.clock.max(now_us);
                return None;
            }
            let start = self.clock;
            match self.start_step(out) {
                Some(duration) => self.step_end = Some(start + duration.max(1)),
                None => {
                    // Work that cannot run (cannot happen for admitted
                    // sizes: an idle pool always fits the queue's head).
                    self.clock = self.clock.max(now_us);
                    return None;
                }
            }
        }
    }

    /// Free blocks plus cached blocks nobody references.
    fn allocatable(&self) -> u32 {
        self.free.len() as u32 + self.lru.len
    }

    /// A block for new content: a free one, else the least recently used
    /// cached one (published as Removed, and offloaded to the host tier).
    fn allocate(&mut self, out: &mut Outputs) -> u32 {
        if let Some(i) = self.free.pop() {
            self.blocks[i as usize].refs = 1;
            return i;
        }
        let victim = self.lru.head;
        assert!(victim != NONE, "allocate() beyond allocatable()");
        self.lru.unlink(&mut self.blocks, victim);
        let hash = self.blocks[victim as usize]
            .hash
            .take()
            .expect("LRU blocks are cached");
        self.cached.remove(&hash);
        push_removed(out, Tier::Device, hash);
        if self.params.host_blocks > 0 {
            push_stored(out, Tier::Host, hash);
            if let Some(gone) = self.host.insert(hash) {
                push_removed(out, Tier::Host, gone);
            }
        }
        self.blocks[victim as usize].refs = 1;
        victim
    }

    /// Takes a reference on a cached block.
    fn take_ref(&mut self, i: u32) {
        if self.blocks[i as usize].refs == 0 {
            self.lru.unlink(&mut self.blocks, i);
        }
        self.blocks[i as usize].refs += 1;
    }

    /// Drops a reference; an unreferenced block stays cached (LRU) if it has
    /// a hash, else it is free.
    fn drop_ref(&mut self, i: u32) {
        let b = &mut self.blocks[i as usize];
        b.refs -= 1;
        if b.refs == 0 {
            if b.hash.is_some() {
                self.lru.push_back(&mut self.blocks, i);
            } else {
                self.free.push(i);
            }
        }
    }

    /// Tries to admit the head of the queue: prefix-cache lookup, then the
    /// blocks of the whole prompt plus the first output token.
    fn admit(&mut self, out: &mut Outputs) -> bool {
        let Some(seq) = self.waiting.front() else {
            return false;
        };
        let bs = self.params.block_size;
        // Leading blocks in the device cache, then in the host tier.
        let mut device_hits = Vec::new();
        let mut host_hits = 0u32;
        for &h in &seq.hashes {
            if host_hits == 0
                && let Some(&i) = self.cached.get(&h)
            {
                device_hits.push(i);
            } else if self.host.contains(h) {
                host_hits += 1;
            } else {
                break;
            }
        }
        // At least one prompt token is always computed (it yields the first
        // output token), as in vLLM.
        let max_cached_blocks = (seq.prompt_tokens - 1) / bs;
        device_hits.truncate(max_cached_blocks as usize);
        let host_hits = host_hits.min(max_cached_blocks - device_hits.len() as u32);
        // The prompt, the tokens a preempted sequence already generated,
        // and the next token.
        let total = self.blocks_for(seq.prompt_tokens + seq.generated + 1);
        let needed = total - device_hits.len() as u32;
        let hits_in_lru = device_hits
            .iter()
            .filter(|&&i| self.blocks[i as usize].refs == 0)
            .count() as u32;
        if needed > self.allocatable() - hits_in_lru {
            return false;
        }
        let mut seq = self.waiting.pop_front().expect("front exists");
        for &i in &device_hits {
            self.take_ref(i);
        }
        seq.blocks = device_hits;
        for _ in 0..needed {
            let b = self.allocate(out);
            seq.blocks.push(b);
        }
        let hit_blocks = (total - needed) + host_hits;
        // A preempted sequence keeps the cache hit of its first admission.
        if seq.generated == 0 {
            seq.cached_tokens = hit_blocks * bs;
        }
        seq.host_tokens = host_hits * bs;
        seq.prefilled = seq.cached_tokens;
        seq.registered = (total - needed) as usize;
        self.running.push(seq);
        true
    }

    /// Decides the next step's batch; returns its duration, or `None` if
    /// nothing can run.
    fn start_step(&mut self, out: &mut Outputs) -> Option<u64> {
        let p = &self.params;
        let mut budget = p.max_batch_tokens;
        self.plan.clear();
        let mut decode_context = 0u64;
        let mut prefill_tokens = 0u64;
        let mut host_tokens = 0u64;
        // Running sequences first, in arrival order: decodes take one token,
        // unfinished prefills continue with a chunk.
        for i in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let s = &self.running[i];
            if s.prefilled < s.prompt_tokens {
                let chunk = (s.prompt_tokens - s.prefilled).min(budget);
                budget -= chunk;
                prefill_tokens += u64::from(chunk);
                self.plan.push((i, chunk));
            } else {
                budget -= 1;
                decode_context += u64::from(s.context_tokens());
                self.plan.push((i, 0));
            }
        }
        // Then admissions, in arrival order, while the budget, the running
        // limit and the pool allow.
        while budget > 0 && (self.running.len() as u32) < self.params.max_running {
            if !self.admit(out) {
                break;
            }
            let i = self.running.len() - 1;
            let s = &mut self.running[i];
            host_tokens += u64::from(std::mem::take(&mut s.host_tokens));
            let chunk = (s.prompt_tokens - s.prefilled).min(budget);
            budget -= chunk;
            prefill_tokens += u64::from(chunk);
            self.plan.push((i, chunk));
        }
        if self.plan.is_empty() {
            return None;
        }
        let p = &self.params;
        let us = p.step_base_us
            + prefill_tokens as f64 * 1e6 / p.prefill_tokens_per_s
            + host_tokens as f64 * 1e6 / p.host_load_tokens_per_s
            + decode_context as f64 * p.decode_us_per_context_token;
        Some(us.round() as u64)
    }

    /// Applies the step that ends at `end`.
    fn finish_step(&mut self, end: u64, out: &mut Outputs) {
        self.steps += 1;
        let bs = self.params.block_size;
        let plan = std::mem::take(&mut self.plan);
        let mut done = Vec::new();
        for &(i, chunk) in &plan {
            let prefilling = self.running[i].prefilled < self.running[i].prompt_tokens;
            if prefilling {
                self.running[i].prefilled += chunk;
                // Newly complete prompt blocks enter the prefix cache. A
                // block whose hash another sequence cached meanwhile stays
                // private (and is not published twice).
                let s = &self.running[i];
                // Each run of newly cached blocks is one Stored event whose
                // parent is the block right before it, so a consumer that
                // chains hashes from the parent (as vLLM's consumers do)
                // gets every block's prefix right across a skipped one.
                let complete = ((s.prefilled / bs) as usize).min(s.hashes.len());
                let mut run: Option<(Option<u64>, Vec<u64>)> = None;
                let mut publish = |run: Option<(Option<u64>, Vec<u64>)>| {
                    if let Some((parent, hashes)) = run {
                        out.events.push(KvEvent::Stored {
                            tier: Tier::Device,
                            parent,
                            hashes,
                        });
                    }
                };
                for k in s.registered..complete {
                    let (h, b) = (s.hashes[k], s.blocks[k]);
                    if let std::collections::hash_map::Entry::Vacant(v) = self.cached.entry(h) {
                        v.insert(b);
                        self.blocks[b as usize].hash = Some(h);
                        let parent = k.checked_sub(1).map(|p| s.hashes[p]);
                        run.get_or_insert_with(|| (parent, Vec::new())).1.push(h);
                    } else {
                        publish(run.take());
                    }
                }
                publish(run);
                self.running[i].registered = complete;
                let s = &mut self.running[i];
                if s.prefilled == s.prompt_tokens && s.generated == 0 {
                    s.generated = 1;
                    out.completions.push(Completion::FirstToken {
                        id: s.id,
                        at_us: end,
                        cached_tokens: s.cached_tokens,
                    });
                }
            } else {
                self.running[i].generated += 1;
                if self.tokens {
                    out.completions.push(Completion::Token {
                        id: self.running[i].id,
                        at_us: end,
                    });
                }
            }
            let s = &self.running[i];
            if s.generated >= s.output_tokens {
                done.push(i);
            } else if s.context_tokens() + 1 > s.blocks.len() as u32 * bs {
                // The next token needs a new block. With none to allocate
                // the sequence is preempted (recomputed later), as in vLLM.
                if self.allocatable() > 0 {
                    let b = self.allocate(out);
                    self.running[i].blocks.push(b);
                } else {
                    done.push(i);
                }
            }
        }
        self.plan = plan;
        // Leave in reverse index order so indices stay valid.
        done.sort_unstable();
        for &i in done.iter().rev() {
            let mut s = self.running.remove(i);
            let finished = s.generated >= s.output_tokens;
            // Tail blocks first into the LRU, so they are evicted first.
            for &b in s.blocks.iter().rev() {
                self.drop_ref(b);
            }
            if finished {
                out.completions.push(Completion::Finished {
                    id: s.id,
                    at_us: end,
                });
            } else {
                // Preempted: back to the front of the queue, to recompute.
                s.blocks.clear();
                s.prefilled = 0;
                s.registered = 0;
                self.waiting.push_front(s);
            }
        }
        out.loads.push(self.load(end));
    }

    /// The engine's load now, as published after every step (waiting
    /// requests' prompts count in `active_prefill_tokens`).
    pub fn load(&self, now_us: u64) -> Load {
        let waiting_prefill: u64 = self
            .waiting
            .iter()
            .map(|s| u64::from(s.prompt_tokens))
            .sum();
        let running_prefill: u64 = self
            .running
            .iter()
            .map(|s| u64::from(s.prompt_tokens - s.prefilled))
            .sum();
        let decode_blocks: u64 = self
            .running
            .iter()
            .filter(|s| s.prefilled == s.prompt_tokens)
            .map(|s| s.blocks.len() as u64)
            .sum();
        Load {
            active_requests: self.running.len() as u32,
            waiting_requests: self.waiting.len() as u32,
            active_prefill_tokens: waiting_prefill + running_prefill,
            active_decode_blocks: decode_blocks,
            kv_used_blocks: u64::from(self.params.device_blocks - self.allocatable()),
            kv_total_blocks: u64::from(self.params.device_blocks),
            timestamp_ns: now_us * 1000,
        }
    }

    /// The hashes in the device prefix cache (for resync snapshots and
    /// tests), in no particular order.
    pub fn device_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cached.keys().copied()
    }

    /// The hashes in the host tier.
    pub fn host_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.host.map.keys().copied()
    }
}

fn push_removed(out: &mut Outputs, tier: Tier, hash: u64) {
    if let Some(KvEvent::Removed { tier: t, hashes }) = out.events.last_mut()
        && *t == tier
    {
        hashes.push(hash);
        return;
    }
    out.events.push(KvEvent::Removed {
        tier,
        hashes: vec![hash],
    });
}

fn push_stored(out: &mut Outputs, tier: Tier, hash: u64) {
    if let Some(KvEvent::Stored {
        tier: t, hashes, ..
    }) = out.events.last_mut()
        && *t == tier
    {
        hashes.push(hash);
        return;
    }
    out.events.push(KvEvent::Stored {
        tier,
        parent: None,
        hashes: vec![hash],
    });
}
