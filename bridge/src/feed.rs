//! One engine rank's event feed as a state machine without I/O: sequence
//! numbers in, translated events and replay requests out. Its driver reads
//! the sockets; tests hand it messages directly.
//!
//! - The next sequence number is applied.
//! - A gap asks for a replay from the first missing number
//!   ([`Live::Replay`]); the message that showed the gap waits until the
//!   replay ends. Without a replay socket, or when the replay does not
//!   cover the gap, the worker's state is dropped (never kept stale) and
//!   the loss is counted.
//! - A number at or below the last one means the engine restarted (each
//!   engine process counts from 0): its state is dropped and rebuilt from
//!   what follows.
//! - The first message after kvedge starts asks for a replay from 0, so
//!   blocks stored before kvedge came up are known where the engine's
//!   replay buffer still holds them.

use kvedge_shm::messages::notice;

use crate::decode::Decoder;
use crate::translate::{Sink, Translator};

/// What the driver does after a live message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Live {
    /// Applied (or skipped as undecodable, and counted).
    Applied,
    /// Not applied: a replay is under way (the driver reads no live
    /// message until it ends).
    Busy,
    /// Ask the replay socket for every batch from this sequence number on,
    /// hand each to [`Feed::handle_replayed`], then call
    /// [`Feed::handle_replay_end`].
    Replay { from: u64 },
}

/// Feed-level happenings, counted like the translator's skips.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedCounts {
    pub batches: u64,
    pub events: u64,
    pub restarts: u64,
    /// Batches recovered by replay.
    pub replayed: u64,
    /// Gaps that could not be replayed (each dropped the worker's state).
    pub lost: u64,
}

#[derive(Debug, Clone)]
struct Replaying {
    /// The live message that showed the gap, applied after the replay.
    pending: (u64, Vec<u8>),
    from: u64,
    /// The replay kvedge asks for when it starts: history, not a loss.
    startup: bool,
    /// The replay left a hole of its own.
    holed: bool,
}

/// One rank's decoder, translator and sequence state.
#[derive(Debug)]
pub struct Feed {
    decoder: Decoder,
    translator: Translator,
    can_replay: bool,
    last: Option<u64>,
    replaying: Option<Replaying>,
    counts: FeedCounts,
    /// Lines for the log (restarts, losses), drained by the driver.
    log: Vec<String>,
}

impl Feed {
    /// A feed for an engine with `block_size`-token blocks; `can_replay`
    /// when a replay socket is configured.
    pub fn new(block_size: u32, capacity: usize, can_replay: bool) -> Self {
        Feed {
            decoder: Decoder::new(),
            translator: Translator::new(block_size, capacity),
            can_replay,
            last: None,
            replaying: None,
            counts: FeedCounts::default(),
            log: Vec::new(),
        }
    }

    pub fn translator(&mut self) -> &mut Translator {
        &mut self.translator
    }

    pub fn counts(&self) -> &FeedCounts {
        &self.counts
    }

    /// The last sequence number applied.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Log lines since the last call.
    pub fn take_log(&mut self) -> impl Iterator<Item = String> + '_ {
        self.log.drain(..)
    }

    /// Counted happenings as notice codes and counts, for the worker.
    pub fn notices(&self) -> [(u16, u64); 3] {
        [
            (notice::RESTARTED, self.counts.restarts),
            (notice::REPLAYED, self.counts.replayed),
            (notice::EVENTS_LOST, self.counts.lost),
        ]
    }

    fn apply(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) {
        self.last = Some(seq);
        self.counts.batches += 1;
        let translator = &mut self.translator;
        match self.decoder.decode(payload, |e| translator.apply(e, sink)) {
            Ok(batch) => self.counts.events += batch.events as u64,
            Err(e) => translator.undecodable(&e.to_string()),
        }
    }

    /// Drops what kvedge knows of the engine (its ring gets a Cleared).
    fn drop_state(&mut self, sink: &mut impl Sink) {
        self.translator.reset(sink);
    }

    /// The engine went away for good (silent, or its feed was reset by
    /// configuration): state dropped, sequence forgotten.
    pub fn forget(&mut self, sink: &mut impl Sink) {
        self.drop_state(sink);
        self.last = None;
        self.replaying = None;
    }

    /// A message from the engine's PUB socket.
    pub fn handle_live(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) -> Live {
        if self.replaying.is_some() {
            // The driver reads no live message during a replay; one that
            // arrives anyway waits its turn like the pending one would.
            return Live::Busy;
        }
        let Some(last) = self.last else {
            if seq > 0 && self.can_replay {
                return self.start_replay(0, seq, payload, true);
            }
            self.apply(seq, payload, sink);
            return Live::Applied;
        };
        match seq.checked_sub(last) {
            Some(1) => {}
            Some(0) | None => {
                self.counts.restarts += 1;
                self.log.push(format!(
                    "sequence went back from {last} to {seq}: the engine restarted; its blocks were dropped and are rebuilt from its events"
                ));
                self.drop_state(sink);
            }
            Some(_) if self.can_replay => {
                return self.start_replay(last + 1, seq, payload, false);
            }
            Some(gap) => {
                self.lose(gap - 1, "no replay socket is configured", sink);
            }
        }
        self.apply(seq, payload, sink);
        Live::Applied
    }

    fn start_replay(&mut self, from: u64, seq: u64, payload: &[u8], startup: bool) -> Live {
        self.replaying = Some(Replaying {
            pending: (seq, payload.to_vec()),
            from,
            startup,
            holed: false,
        });
        Live::Replay { from }
    }

    fn lose(&mut self, missing: u64, why: &str, sink: &mut impl Sink) {
        self.counts.lost += 1;
        self.log.push(format!(
            "{missing} event batches were lost and could not be replayed ({why}): the engine's blocks were dropped rather than kept stale"
        ));
        self.drop_state(sink);
    }

    /// A batch from the replay socket.
    pub fn handle_replayed(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) {
        let Some(r) = &mut self.replaying else { return };
        if seq >= r.pending.0 {
            // The live stream has it (pending or later).
            return;
        }
        match self.last {
            Some(last) if seq <= last => return,
            Some(last) if seq > last + 1 && !r.holed => {
                r.holed = true;
                let missing = seq - last - 1;
                self.lose(
                    missing,
                    "the engine's replay buffer no longer holds them",
                    sink,
                );
            }
            _ => {}
        }
        self.apply(seq, payload, sink);
        self.counts.replayed += 1;
    }

    /// The replay ended: `complete` when its end marker arrived (false on
    /// a timeout or a socket error). Applies the message that waited.
    pub fn handle_replay_end(&mut self, complete: bool, sink: &mut impl Sink) {
        let Some(r) = self.replaying.take() else {
            return;
        };
        let (seq, payload) = r.pending;
        let covered = self.last.map_or(seq == 0, |last| last + 1 >= seq);
        if !covered && !r.startup && !r.holed {
            let why = if complete {
                "the engine's replay buffer no longer holds them"
            } else {
                "the replay socket did not answer"
            };
            let missing = seq - self.last.map_or(r.from, |l| l + 1);
            self.lose(missing, why, sink);
        }
        if self.last.is_none_or(|last| seq > last) {
            self.apply(seq, &payload, sink);
        }
    }

    /// Whether a replay is under way.
    pub fn replaying(&self) -> bool {
        self.replaying.is_some()
    }
}
