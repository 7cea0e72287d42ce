//! The time-to-first-token predictor: one model behind the `predicted-ttft`
//! worker-selection policy (through the host's `TTFT` signal) and the rule
//! language's `PredictedTTFT` objective, so the two always agree.
//!
//! For a candidate worker, with `B` the block size and the request's prefix
//! found `D` blocks deep in the worker's device cache, `H` in its host tier
//! and `K` on disk (each counted from the prompt's start, as the index
//! reports them):
//!
//! ```text
//! device_tokens = min(D·B, P − 1)                       (one token is always computed)
//! host_tokens   = min(max(H − D, 0)·B, P − 1 − device_tokens)
//! disk_tokens   = min(max(K − max(D, H), 0)·B, P − 1 − device_tokens − host_tokens)
//! uncached      = P − device_tokens − host_tokens − disk_tokens
//! own_work      = uncached + host_hit_cost·host_tokens + disk_hit_cost·disk_tokens
//! queue_s       = queued_prefill_tokens / speed          (engine report + kvedge's reservations not yet computed)
//! prefill_s     = own_work / speed
//! wait_s        = waiting_requests · queue_wait_per_request
//! steps         = 1 + floor((queued_prefill_tokens + own_work) / step_tokens)
//! decode_s      = decode_blocks · decode_per_block_step · steps
//! ttft          = queue_s + prefill_s + wait_s + decode_s
//! ```
//!
//! `speed` is the worker's prefill speed in tokens per second as the host
//! learned it ([`PrefillSpeedLearner`]). A worker that has learned nothing
//! yet is unknown, and unknown is neutral: it gets the mean speed of the
//! workers that have learned one, and the configured prior only while none
//! has. (Were it given the prior while its peers had learned a faster
//! speed, it would look slower than all of them, get no request, and never
//! learn.) Everything is a few floating-point operations; no allocation.

/// The predictor's parameters (the `ttft:` configuration section).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftPredictor {
    /// Prefill speed assumed for a worker whose speed is not learned yet,
    /// tokens per second.
    pub prefill_tokens_per_second: f64,
    /// Seconds added per request waiting in the worker's queue (scheduling
    /// and admission beyond its prompt tokens, which `queue_s` counts).
    pub queue_wait_per_request: f64,
    /// A token loaded from the host tier, as a fraction of computing it.
    pub host_hit_cost: f64,
    /// A token loaded from disk, as a fraction of computing it.
    pub disk_hit_cost: f64,
    /// What one engine step spends per KV block of its decoding requests,
    /// seconds: a step reads all of them, so a worker busy decoding
    /// prefills more slowly.
    pub decode_per_block_step: f64,
    /// Prefill tokens one engine step takes at most (the engine's chunked
    /// prefill budget).
    pub step_tokens: f64,
}

impl Default for TtftPredictor {
    fn default() -> Self {
        TtftPredictor {
            prefill_tokens_per_second: 10_000.0,
            queue_wait_per_request: 0.05,
            // PCIe moves a token's KV (~128 KiB for an 8B model) about 8x
            // faster than a GPU computes it; NVMe about 3x.
            host_hit_cost: 0.125,
            disk_hit_cost: 0.35,
            // A 16-token block of an 8B model is 2 MiB of KV, read in
            // about 0.7 µs at 3 TB/s; 8,192 tokens is vLLM's usual step
            // budget with chunked prefill.
            decode_per_block_step: 0.7e-6,
            step_tokens: 8192.0,
        }
    }
}

/// What the prediction for one candidate is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftInputs {
    pub prompt_tokens: u32,
    pub block_size: u32,
    /// Prefix overlap in blocks, per tier, each from the prompt's start.
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    /// Prefill tokens ahead of the request: the engine's report plus the
    /// host's reservations not yet reflected in one.
    pub queued_prefill_tokens: u64,
    pub waiting_requests: u32,
    /// KV blocks of the worker's decoding requests (each step reads them).
    pub decode_blocks: u64,
    /// The worker's learned prefill speed, if any.
    pub learned_tokens_per_second: Option<f64>,
    /// The mean learned speed of the other workers, if any learned one.
    pub peer_tokens_per_second: Option<f64>,
}

/// Where the speed of a prediction came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpeedSource {
    /// The worker's own, learned from its completed prefills.
    Learned,
    /// Its peers' mean: it has learned none yet.
    Peers,
    /// The configured prior: no worker has learned one yet.
    #[default]
    Prior,
}

impl SpeedSource {
    pub fn as_str(self) -> &'static str {
        match self {
            SpeedSource::Learned => "learned",
            SpeedSource::Peers => "peers",
            SpeedSource::Prior => "prior",
        }
    }
}

/// The prediction, term by term (seconds, except where said).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftTerms {
    pub queue_s: f64,
    pub prefill_s: f64,
    pub wait_s: f64,
    /// The decoding requests' share of the steps until the first token.
    pub decode_s: f64,
    /// The speed used, and where it came from.
    pub tokens_per_second: f64,
    pub speed_source: SpeedSource,
    /// Prompt tokens by where they come from.
    pub device_tokens: u32,
    pub host_tokens: u32,
    pub disk_tokens: u32,
    pub uncached_tokens: u32,
    /// The request's own prefill work in computed-token equivalents (what
    /// `prefill_s` is made of).
    pub own_work_tokens: f64,
}

impl TtftTerms {
    /// The predicted time to first token, seconds.
    pub fn total_s(&self) -> f64 {
        self.queue_s + self.prefill_s + self.wait_s + self.decode_s
    }

    /// The work a completed prefill measures: the queue ahead plus the
    /// request's own (computed-token equivalents).
    pub fn work_tokens(&self) -> f64 {
        self.queue_s * self.tokens_per_second + self.own_work_tokens
    }
}

impl TtftPredictor {
    /// The prefill speed a prediction uses, and where it comes from: the
    /// worker's learned one, else its peers' mean, else the prior.
    #[inline]
    pub fn speed(&self, learned: Option<f64>, peers: Option<f64>) -> (f64, SpeedSource) {
        let usable = |s: Option<f64>| s.filter(|s| s.is_finite() && *s > 0.0);
        match (usable(learned), usable(peers)) {
            (Some(s), _) => (s, SpeedSource::Learned),
            (None, Some(s)) => (s, SpeedSource::Peers),
            (None, None) => (self.prefill_tokens_per_second, SpeedSource::Prior),
        }
    }

    /// The prediction for one candidate.
    #[inline]
    pub fn terms(&self, i: &TtftInputs) -> TtftTerms {
        let bs = u64::from(i.block_size.max(1));
        let prompt = u64::from(i.prompt_tokens);
        // At most P - 1 tokens come from any cache: the last one is computed.
        let cacheable = prompt.saturating_sub(1);
        let device = (u64::from(i.device_blocks) * bs).min(cacheable);
        let host_beyond = u64::from(i.host_blocks.saturating_sub(i.device_blocks));
        let host = (host_beyond * bs).min(cacheable - device);
        let disk_beyond = u64::from(
            i.disk_blocks
                .saturating_sub(i.device_blocks.max(i.host_blocks)),
        );
        let disk = (disk_beyond * bs).min(cacheable - device - host);
        let uncached = prompt - device - host - disk;
        let (speed, speed_source) =
            self.speed(i.learned_tokens_per_second, i.peer_tokens_per_second);
        let own =
            uncached as f64 + self.host_hit_cost * host as f64 + self.disk_hit_cost * disk as f64;
        // The steps the queue and the request's own prefill span: each one
        // also reads every decoding request's KV.
        let steps = 1.0 + ((i.queued_prefill_tokens as f64 + own) / self.step_tokens).floor();
        TtftTerms {
            queue_s: i.queued_prefill_tokens as f64 / speed,
            prefill_s: own / speed,
            wait_s: f64::from(i.waiting_requests) * self.queue_wait_per_request,
            decode_s: self.decode_per_block_step * i.decode_blocks as f64 * steps,
            tokens_per_second: speed,
            speed_source,
            device_tokens: device as u32,
            host_tokens: host as u32,
            disk_tokens: disk as u32,
            uncached_tokens: uncached as u32,
            own_work_tokens: own,
        }
    }

    /// Checks the parameters; the message names the bad one.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.prefill_tokens_per_second.is_finite() && self.prefill_tokens_per_second > 0.0) {
            return Err((
                "prefill_tokens_per_second",
                format!(
                    "must be a finite positive number, got {}",
                    self.prefill_tokens_per_second
                ),
            ));
        }
        for (name, v) in [
            ("host_hit_cost", self.host_hit_cost),
            ("disk_hit_cost", self.disk_hit_cost),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err((name, format!("must be a finite number from 0, got {v}")));
            }
        }
        if !(self.step_tokens.is_finite() && self.step_tokens >= 1.0) {
            return Err((
                "step_tokens",
                format!("must be at least 1, got {}", self.step_tokens),
            ));
        }
        if !(self.decode_per_block_step.is_finite() && self.decode_per_block_step >= 0.0) {
            return Err((
                "decode_per_block_step",
                format!(
                    "must be a non-negative duration, got {}s",
                    self.decode_per_block_step
                ),
            ));
        }
        if !(self.queue_wait_per_request.is_finite() && self.queue_wait_per_request >= 0.0) {
            return Err((
                "queue_wait_per_request",
                format!(
                    "must be a non-negative duration, got {}s",
                    self.queue_wait_per_request
                ),
            ));
        }
        Ok(())
    }
}

/// Learns a worker's prefill speed from completed prefills.
///
/// When a request is placed, the host notes the work its prediction counted
/// ([`TtftTerms::work_tokens`]: the prefill queued ahead plus its own) and
/// the time; when the frontend reports `prefill_done`, the elapsed time is
/// what that work took on this worker. The learner keeps the sums of both,
/// each decayed by [`PrefillSpeedLearner::DECAY`] per sample, so longer
/// prefills weigh more and the estimate follows a worker whose speed
/// changes.
///
/// The estimate is shrunk towards an anchor (its peers' pooled speed, or
/// the configured prior while no worker has learned one) by
/// [`PrefillSpeedLearner::ANCHOR_SECONDS`] of pseudo-observation: a worker
/// with few samples sits near its peers instead of wherever its first odd
/// sample put it, which would make identical workers look different and
/// starve the ones that look slower. And an estimate within
/// [`PrefillSpeedLearner::SAME_AS_PEERS`] of the anchor counts as the
/// anchor (the learner answers `None`, and the predictor uses the peers'
/// speed): such differences between identical GPUs are noise, and acting on
/// them sends every request that is new to all workers to whichever one
/// drifted fastest, where it evicts that worker's cache. A real difference
/// (another GPU model, a noisy neighbour) is larger. Samples of less than
/// [`PrefillSpeedLearner::MIN_WORK_TOKENS`] say more about per-step
/// overheads than about speed and are skipped, as are non-positive times.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillSpeedLearner {
    tokens: f64,
    seconds: f64,
    samples: u64,
}

impl PrefillSpeedLearner {
    /// Weight kept by the past at each new sample.
    pub const DECAY: f64 = 0.95;
    /// Smallest sample learned from, in tokens of work.
    pub const MIN_WORK_TOKENS: f64 = 1024.0;
    /// How much observation the anchor counts for, seconds.
    pub const ANCHOR_SECONDS: f64 = 2.0;
    /// Relative difference from the anchor below which an estimate is the
    /// anchor's.
    pub const SAME_AS_PEERS: f64 = 0.15;

    /// Feeds one completed prefill: `work_tokens` took `seconds`.
    pub fn observe(&mut self, work_tokens: f64, seconds: f64) {
        if !(work_tokens.is_finite() && seconds.is_finite())
            || work_tokens < Self::MIN_WORK_TOKENS
            || seconds <= 0.0
        {
            return;
        }
        self.tokens = self.tokens * Self::DECAY + work_tokens;
        self.seconds = self.seconds * Self::DECAY + seconds;
        self.samples += 1;
    }

    /// Tokens per second, shrunk towards `anchor`; `None` before any
    /// sample, and while the estimate is within [`Self::SAME_AS_PEERS`] of
    /// the anchor.
    pub fn tokens_per_second(&self, anchor: f64) -> Option<f64> {
        if self.samples == 0 {
            return None;
        }
        let s =
            (self.tokens + Self::ANCHOR_SECONDS * anchor) / (self.seconds + Self::ANCHOR_SECONDS);
        ((s / anchor - 1.0).abs() >= Self::SAME_AS_PEERS).then_some(s)
    }

    /// The pooled speed of several learners (the anchor of each), `None`
    /// when none has a sample.
    pub fn pooled<'a>(learners: impl IntoIterator<Item = &'a PrefillSpeedLearner>) -> Option<f64> {
        let (tokens, seconds) = learners
            .into_iter()
            .filter(|l| l.samples > 0)
            .fold((0.0, 0.0), |(t, s), l| (t + l.tokens, s + l.seconds));
        (seconds > 0.0).then(|| tokens / seconds)
    }

    /// Samples learned from.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> TtftInputs {
        TtftInputs {
            prompt_tokens: 1000,
            block_size: 16,
            ..TtftInputs::default()
        }
    }

    fn predictor() -> TtftPredictor {
        TtftPredictor {
            prefill_tokens_per_second: 1000.0,
            queue_wait_per_request: 0.1,
            host_hit_cost: 0.25,
            disk_hit_cost: 0.5,
            decode_per_block_step: 0.0,
            step_tokens: 8192.0,
        }
    }

    #[test]
    fn the_queue_ahead_is_its_tokens_over_the_speed_plus_a_wait_per_queued_request() {
        let p = predictor();
        let idle = p.terms(&inputs());
        assert_eq!((idle.queue_s, idle.wait_s), (0.0, 0.0));
        assert_eq!(idle.prefill_s, 1.0);
        let busy = p.terms(&TtftInputs {
            queued_prefill_tokens: 3000,
            waiting_requests: 2,
            ..inputs()
        });
        assert_eq!(busy.queue_s, 3.0);
        assert!((busy.wait_s - 0.2).abs() < 1e-12);
        assert!((busy.total_s() - 4.2).abs() < 1e-12);
        assert_eq!(busy.work_tokens(), 4000.0);
    }

    #[test]
    fn decoding_requests_slow_every_step_until_the_first_token() {
        let p = TtftPredictor {
            decode_per_block_step: 1e-6,
            step_tokens: 1000.0,
            ..predictor()
        };
        // 1,000 own tokens: two steps (floor(1000 / 1000) + 1), each
        // reading 5,000 blocks for 5 ms.
        let t = p.terms(&TtftInputs {
            decode_blocks: 5000,
            ..inputs()
        });
        assert!((t.decode_s - 0.010).abs() < 1e-12, "{t:?}");
        // 2,500 tokens queued ahead: four steps.
        let t = p.terms(&TtftInputs {
            decode_blocks: 5000,
            queued_prefill_tokens: 2500,
            ..inputs()
        });
        assert!((t.decode_s - 0.020).abs() < 1e-12, "{t:?}");
        assert!((t.total_s() - (2.5 + 1.0 + 0.020)).abs() < 1e-12);
        // Nothing decoding: no term.
        assert_eq!(p.terms(&inputs()).decode_s, 0.0);
    }

    #[test]
    fn device_host_and_disk_hits_are_priced_differently() {
        let p = predictor();
        // 25 blocks = 400 tokens on the device; the host holds 40 blocks
        // from the start (15 beyond the device); disk 50 (10 beyond both).
        let t = p.terms(&TtftInputs {
            device_blocks: 25,
            host_blocks: 40,
            disk_blocks: 50,
            ..inputs()
        });
        assert_eq!(
            (
                t.device_tokens,
                t.host_tokens,
                t.disk_tokens,
                t.uncached_tokens
            ),
            (400, 240, 160, 200)
        );
        let own = 200.0 + 0.25 * 240.0 + 0.5 * 160.0;
        assert_eq!(t.own_work_tokens, own);
        assert!((t.prefill_s - own / 1000.0).abs() < 1e-12);
        // A host prefix shorter than the device's adds nothing.
        let t = p.terms(&TtftInputs {
            device_blocks: 25,
            host_blocks: 10,
            ..inputs()
        });
        assert_eq!((t.host_tokens, t.uncached_tokens), (0, 600));
        // The whole prompt cached: the last token is still computed.
        let t = p.terms(&TtftInputs {
            device_blocks: 1000,
            ..inputs()
        });
        assert_eq!((t.device_tokens, t.uncached_tokens), (999, 1));
    }

    #[test]
    fn a_learned_speed_replaces_the_prior_and_an_unknown_worker_gets_its_peers() {
        let p = predictor();
        let t = p.terms(&TtftInputs {
            learned_tokens_per_second: Some(4000.0),
            peer_tokens_per_second: Some(2000.0),
            ..inputs()
        });
        assert_eq!(t.speed_source, SpeedSource::Learned);
        assert_eq!(t.prefill_s, 0.25);
        // Unknown: neutral (its peers' mean), not the prior, which would
        // make it look slower than every worker that learned.
        let t = p.terms(&TtftInputs {
            learned_tokens_per_second: None,
            peer_tokens_per_second: Some(2000.0),
            ..inputs()
        });
        assert_eq!(
            (t.speed_source, t.tokens_per_second),
            (SpeedSource::Peers, 2000.0)
        );
        let t = p.terms(&TtftInputs {
            learned_tokens_per_second: Some(f64::NAN),
            ..inputs()
        });
        assert_eq!(
            (t.speed_source, t.tokens_per_second),
            (SpeedSource::Prior, 1000.0)
        );
    }

    #[test]
    fn the_learned_speed_converges_and_follows_a_worker_that_slows_down() {
        let anchor = 25_000.0;
        let mut l = PrefillSpeedLearner::default();
        assert_eq!(l.tokens_per_second(anchor), None);
        // Too little work to learn from; non-positive times.
        l.observe(500.0, 0.01);
        l.observe(5000.0, 0.0);
        assert_eq!(l.tokens_per_second(anchor), None);
        // A worker doing 25,000 tokens/s, prefills of 2,000-20,000 tokens.
        let mut sizes = [2000.0, 8000.0, 20_000.0, 5000.0].iter().cycle();
        for _ in 0..60 {
            let w = *sizes.next().unwrap();
            l.observe(w, w / 25_000.0);
        }
        // As fast as its peers: it gets their speed (no estimate of its own).
        assert_eq!(l.tokens_per_second(anchor), None);
        // Against peers at 20,000 it is the faster one (shrunk towards
        // them by 2 s against its own 6-7 s of observation).
        let s = l.tokens_per_second(20_000.0).unwrap();
        assert!((s - 25_000.0).abs() / 25_000.0 < 0.06, "{s}");
        // Its speed halves (another tenant on the GPU) while its peers stay
        // at 25,000: within 100 samples the estimate is within 15 % of the
        // new speed (about 14 s of its own observation against the anchor's
        // 2 s at its peers' speed).
        for _ in 0..100 {
            let w = *sizes.next().unwrap();
            l.observe(w, w / 12_500.0);
        }
        let s = l.tokens_per_second(anchor).unwrap();
        assert!((s - 12_500.0).abs() / 12_500.0 < 0.15, "{s}");
        assert!(s < 15_000.0, "{s}");
        assert_eq!(l.samples(), 160);
    }

    #[test]
    fn one_odd_sample_does_not_swing_a_worker_away_from_its_peers() {
        let mut l = PrefillSpeedLearner::default();
        // 1,024 tokens that took 2 s (a stall): not 512 tokens/s.
        l.observe(1024.0, 2.0);
        let s = l.tokens_per_second(25_000.0).unwrap();
        assert!(s > 12_000.0, "{s}");
        // A short fast one near its peers' speed: the peers' (no estimate).
        let mut l = PrefillSpeedLearner::default();
        l.observe(2048.0, 0.08);
        assert_eq!(l.tokens_per_second(25_000.0), None);
        // The anchor is the peers' pooled speed.
        let mut a = PrefillSpeedLearner::default();
        let mut b = PrefillSpeedLearner::default();
        a.observe(30_000.0, 1.0);
        b.observe(10_000.0, 1.0);
        assert_eq!(PrefillSpeedLearner::pooled([&a, &b]), Some(20_000.0));
        assert_eq!(
            PrefillSpeedLearner::pooled([&PrefillSpeedLearner::default()]),
            None
        );
    }

    #[test]
    fn bad_parameters_are_named() {
        let mut p = TtftPredictor::default();
        assert!(p.validate().is_ok());
        p.host_hit_cost = -1.0;
        assert_eq!(p.validate().unwrap_err().0, "host_hit_cost");
        p = TtftPredictor {
            prefill_tokens_per_second: 0.0,
            ..TtftPredictor::default()
        };
        assert_eq!(p.validate().unwrap_err().0, "prefill_tokens_per_second");
    }
}
