//! One engine rank's event feed as a state machine without I/O: who sent
//! a message and its sequence number in, translated events and replay
//! requests out. Its driver reads the sockets; tests hand it messages
//! directly.
//!
//! - **One source.** Messages come from the engine's publisher: the one
//!   connection kvedge made (trusted: kvedge chose the address), or, on a
//!   bound port, the first peer to send. Another peer's messages are
//!   ignored and counted (`foreign_batches`) while that source is
//!   connected; when it leaves, the next peer to send takes its place.
//! - **Vouched for by the engine.** A source kvedge did not dial is
//!   trusted only once the engine's own replay socket, which kvedge dials,
//!   holds the same batch under the same number; until then its message
//!   waits, and a peer the replay disowns is ignored for good.
//! - The next sequence number is applied.
//! - A gap asks for a replay from the first missing number
//!   ([`Live::Replay`]); the message that showed the gap waits until the
//!   replay ends. Without a replay socket, or when the replay does not
//!   cover the gap, the worker's state is dropped (never kept stale) and
//!   the loss is counted.
//! - A number at or below the last one means the engine restarted (each
//!   engine process counts from 0) only if its replay socket agrees: a
//!   restarted engine's buffer no longer holds the last batch kvedge
//!   applied. Then its state is dropped and rebuilt from what follows;
//!   otherwise the message is ignored as stale. Without a replay socket
//!   (or when it does not answer), the trusted source's word is taken.
//! - When kvedge starts reading an engine, and each time its connection to
//!   the engine's publisher is made again, it asks the replay socket at
//!   once ([`Feed::handle_connected`]): from 0 for what the engine stored
//!   before, or from the last number applied for what passed while the
//!   connection was down. A buffer that no longer holds that batch (or
//!   holds another under its number) shows the engine restarted meanwhile.
//!   Failing that, the first message after kvedge starts asks for a replay
//!   from 0.

use kvedge_schema::messages::notice;
use xxhash_rust::xxh3::xxh3_64;

use crate::decode::Decoder;
use crate::translate::{Sink, Translator};

/// Peers found not to be the engine's publisher, remembered so that
/// their later messages cost no replay.
const DISOWNED: usize = 64;

/// Who sent a live message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    /// The connection, numbered by the driver (never reused).
    pub peer: u64,
    /// Whether kvedge dialled this peer at the engine's configured
    /// address (a connecting SUB): its word needs no replay to vouch.
    pub trusted: bool,
}

/// What the log should say, by kind (the driver rate-limits each kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogKind {
    Restart,
    Loss,
    Foreign,
    Stale,
    Unverified,
}

/// What the driver does after a live message or a replay's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Live {
    /// Applied (or skipped as undecodable, and counted).
    Applied,
    /// Not applied: a replay is under way (the driver reads no live
    /// message until it ends).
    Busy,
    /// Not applied: from a peer that is not the engine's publisher, or a
    /// stale number the engine's replay socket disowned (counted).
    Ignored,
    /// Ask the replay socket for every batch from this sequence number on,
    /// hand each to [`Feed::handle_replayed`], then call
    /// [`Feed::handle_replay_end`] (which may ask for another).
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
    /// Batches from a peer that is not the engine's publisher.
    pub foreign: u64,
    /// Batches numbered back though the engine did not restart.
    pub stale: u64,
    /// Batches from a new peer the replay socket could not vouch for
    /// (it did not answer).
    pub unverified: u64,
}

/// Why a replay was asked for, and what it found so far.
#[derive(Debug, Clone)]
enum Purpose {
    /// Fill a gap (or, at start, learn the history): apply what comes.
    Fill {
        /// The replay kvedge asks for when it starts: history, not a loss.
        startup: bool,
        /// The replay left a hole of its own.
        holed: bool,
    },
    /// A new source's first message: does the engine's buffer hold it?
    Vouch { matched: bool },
    /// The connection to the publisher was made again: what passed while
    /// it was down, and did the engine restart meanwhile? Replayed from
    /// the last number applied, whose payload's digest kvedge kept.
    CatchUp {
        last: u64,
        digest: Option<u64>,
        found: Continuity,
    },
    /// The number went back: has the engine restarted? Replayed from the
    /// last number applied, whose payload's digest kvedge kept.
    Restart {
        last: u64,
        digest: Option<u64>,
        /// The buffer's copy of `last`: Some(same payload).
        seen_last: Option<bool>,
        /// The buffer holds numbers past `last`.
        ahead: bool,
    },
}

/// What a catch-up replay has shown so far (batches come in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Continuity {
    Undecided,
    /// The same engine: later batches are applied.
    Same,
    /// The engine restarted: everything kvedge had of it is stale.
    Restarted,
}

#[derive(Debug, Clone)]
struct Replaying {
    /// The live message that asked, decided on after the replay (none for
    /// a replay asked on connecting).
    pending: Option<(u64, Vec<u8>)>,
    from: u64,
    purpose: Purpose,
}

/// The peer whose messages the feed takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Source {
    peer: u64,
    vouched: bool,
}

/// One rank's decoder, translator and sequence state.
#[derive(Debug)]
pub struct Feed {
    decoder: Decoder,
    translator: Translator,
    can_replay: bool,
    last: Option<u64>,
    /// The digest of the last payload applied.
    last_digest: Option<u64>,
    source: Option<Source>,
    disowned: Vec<u64>,
    replaying: Option<Replaying>,
    /// The history asked at start was not given (the replay socket did
    /// not answer, or not in time): the next batch is applied as it is
    /// rather than asking again.
    history_abandoned: bool,
    counts: FeedCounts,
    /// Lines for the log (restarts, losses, strangers), drained by the
    /// driver, which rate-limits each kind.
    log: Vec<(LogKind, String)>,
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
            last_digest: None,
            source: None,
            disowned: Vec::new(),
            replaying: None,
            history_abandoned: false,
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

    /// Log lines since the last call, with their kinds.
    pub fn take_log(&mut self) -> impl Iterator<Item = (LogKind, String)> + '_ {
        self.log.drain(..)
    }

    /// Counted happenings as notice codes and counts, for the worker.
    pub fn notices(&self) -> [(u16, u64); 6] {
        [
            (notice::RESTARTED, self.counts.restarts),
            (notice::REPLAYED, self.counts.replayed),
            (notice::EVENTS_LOST, self.counts.lost),
            (notice::FOREIGN_BATCHES, self.counts.foreign),
            (notice::STALE_SEQUENCE, self.counts.stale),
            (notice::UNVERIFIED_PUBLISHER, self.counts.unverified),
        ]
    }

    fn apply(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) {
        self.last = Some(seq);
        self.last_digest = Some(xxh3_64(payload));
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
        self.last_digest = None;
        self.replaying = None;
    }

    /// A peer's connection ended: if it was the source, the next peer to
    /// send may take its place.
    pub fn handle_left(&mut self, peer: u64) {
        if self.source.is_some_and(|s| s.peer == peer) {
            self.source = None;
        }
        self.disowned.retain(|&p| p != peer);
    }

    /// A message that does not have the engines' shape (three frames, an
    /// 8-byte number): counted against the engine if it came from its
    /// publisher (or from the first peer to send), else as foreign.
    pub fn handle_malformed(&mut self, from: Sender, why: &str) {
        let ours = match self.source {
            Some(s) => s.peer == from.peer,
            None => !self.disowned.contains(&from.peer),
        };
        if ours {
            self.translator.undecodable(why);
        } else {
            self.foreign(from.peer, "the engine's publisher is connected");
        }
    }

    /// A message from the engine's PUB socket (or a peer of a bound one).
    pub fn handle_live(
        &mut self,
        from: Sender,
        seq: u64,
        payload: &[u8],
        sink: &mut impl Sink,
    ) -> Live {
        if self.replaying.is_some() {
            // The driver reads no live message during a replay; one that
            // arrives anyway waits its turn like the pending one would.
            return Live::Busy;
        }
        let source = match self.source {
            Some(s) if s.peer == from.peer => s,
            Some(_) => return self.foreign(from.peer, "the engine's publisher is connected"),
            None if self.disowned.contains(&from.peer) => {
                return self.foreign(from.peer, "the replay socket disowned it");
            }
            None => {
                let s = Source {
                    peer: from.peer,
                    vouched: from.trusted || !self.can_replay,
                };
                self.source = Some(s);
                s
            }
        };
        if !source.vouched {
            return self.start_replay(seq, seq, payload, Purpose::Vouch { matched: false });
        }
        self.proceed(seq, payload, sink)
    }

    fn foreign(&mut self, peer: u64, why: &str) -> Live {
        self.counts.foreign += 1;
        self.log.push((
            LogKind::Foreign,
            format!(
                "a batch from peer {peer}, which is not the engine's publisher ({why}), was ignored"
            ),
        ));
        Live::Ignored
    }

    /// A message from the vouched source.
    fn proceed(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) -> Live {
        let Some(last) = self.last else {
            if seq > 0 && self.can_replay && !std::mem::take(&mut self.history_abandoned) {
                return self.start_replay(
                    0,
                    seq,
                    payload,
                    Purpose::Fill {
                        startup: true,
                        holed: false,
                    },
                );
            }
            self.apply(seq, payload, sink);
            return Live::Applied;
        };
        match seq.checked_sub(last) {
            Some(1) => {}
            Some(0) | None if self.can_replay => {
                let purpose = Purpose::Restart {
                    last,
                    digest: self.last_digest,
                    seen_last: None,
                    ahead: false,
                };
                return self.start_replay(last, seq, payload, purpose);
            }
            Some(0) | None => self.restart(last, seq, "", sink),
            Some(_) if self.can_replay => {
                let purpose = Purpose::Fill {
                    startup: false,
                    holed: false,
                };
                return self.start_replay(last + 1, seq, payload, purpose);
            }
            Some(gap) => {
                self.lose(gap - 1, "no replay socket is configured", sink);
            }
        }
        self.apply(seq, payload, sink);
        Live::Applied
    }

    /// The engine restarted: everything it had is gone.
    fn restart(&mut self, last: u64, seq: u64, confirmed: &str, sink: &mut impl Sink) {
        self.counts.restarts += 1;
        self.log.push((
            LogKind::Restart,
            format!(
                "sequence went back from {last} to {seq}{confirmed}: the engine restarted; its blocks were dropped and are rebuilt from its events"
            ),
        ));
        self.drop_state(sink);
        self.last = None;
        self.last_digest = None;
    }

    fn start_replay(&mut self, from: u64, seq: u64, payload: &[u8], purpose: Purpose) -> Live {
        self.replaying = Some(Replaying {
            pending: Some((seq, payload.to_vec())),
            from,
            purpose,
        });
        Live::Replay { from }
    }

    /// kvedge (re)connected to the engine's publisher, or started reading
    /// it: asks the replay socket for what it may have missed.
    pub fn handle_connected(&mut self) -> Live {
        if self.replaying.is_some() || !self.can_replay {
            return Live::Applied;
        }
        let (from, purpose) = match self.last {
            None => (
                0,
                Purpose::Fill {
                    startup: true,
                    holed: false,
                },
            ),
            Some(last) => (
                last,
                Purpose::CatchUp {
                    last,
                    digest: self.last_digest,
                    found: Continuity::Undecided,
                },
            ),
        };
        self.replaying = Some(Replaying {
            pending: None,
            from,
            purpose,
        });
        Live::Replay { from }
    }

    fn lose(&mut self, missing: u64, why: &str, sink: &mut impl Sink) {
        self.counts.lost += 1;
        self.log.push((
            LogKind::Loss,
            format!(
                "{missing} event batches were lost and could not be replayed ({why}): the engine's blocks were dropped rather than kept stale"
            ),
        ));
        self.drop_state(sink);
    }

    /// A batch from the replay socket.
    pub fn handle_replayed(&mut self, seq: u64, payload: &[u8], sink: &mut impl Sink) {
        let Some(r) = &mut self.replaying else { return };
        match &mut r.purpose {
            Purpose::Vouch { matched } => {
                if r.pending
                    .as_ref()
                    .is_some_and(|(s, p)| *s == seq && p.as_slice() == payload)
                {
                    *matched = true;
                }
            }
            Purpose::CatchUp {
                last,
                digest,
                found,
            } => {
                if *found == Continuity::Undecided {
                    if seq == *last {
                        *found = if *digest == Some(xxh3_64(payload)) {
                            Continuity::Same
                        } else {
                            Continuity::Restarted
                        };
                        return;
                    }
                    if seq < *last {
                        return;
                    }
                    // Past the last number without it: the same engine,
                    // whose buffer has moved on.
                    *found = Continuity::Same;
                }
                if *found == Continuity::Same {
                    let applied = self.last.unwrap_or(*last);
                    if seq <= applied {
                        return;
                    }
                    if seq > applied + 1 {
                        self.lose(
                            seq - applied - 1,
                            "the engine's replay buffer no longer holds them",
                            sink,
                        );
                    }
                    self.apply(seq, payload, sink);
                    self.counts.replayed += 1;
                }
            }
            Purpose::Restart {
                last,
                digest,
                seen_last,
                ahead,
            } => {
                if seq == *last {
                    *seen_last = Some(*digest == Some(xxh3_64(payload)));
                } else if seq > *last {
                    *ahead = true;
                }
            }
            Purpose::Fill { holed, .. } => {
                if r.pending.as_ref().is_some_and(|(p, _)| seq >= *p) {
                    // The live stream has it (pending or later).
                    return;
                }
                match self.last {
                    Some(last) if seq <= last => return,
                    Some(last) if seq > last + 1 && !*holed => {
                        *holed = true;
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
        }
    }

    /// The replay socket accepted no connection. Asked at start for the
    /// engine's history, that means the engine is not running yet: it
    /// has no history kvedge could miss, so nothing is lost, and the
    /// history is asked again when kvedge connects to its publisher or
    /// first hears a batch numbered past 0. Any other replay counts as
    /// not complete.
    pub fn handle_replay_unreachable(&mut self, sink: &mut impl Sink) -> Live {
        if let Some(Replaying {
            pending: None,
            purpose: Purpose::Fill { startup: true, .. },
            ..
        }) = self.replaying
        {
            self.replaying = None;
            return Live::Applied;
        }
        self.handle_replay_end(false, sink)
    }

    /// The replay ended: `complete` when its end marker arrived (false on
    /// a timeout, a stall past its deadline or a socket error). Decides on
    /// the message that waited; may ask for another replay.
    pub fn handle_replay_end(&mut self, complete: bool, sink: &mut impl Sink) -> Live {
        let Some(r) = self.replaying.take() else {
            return Live::Applied;
        };
        let Some((seq, payload)) = r.pending else {
            return self.caught_up(r.purpose, complete, sink);
        };
        match r.purpose {
            Purpose::Vouch { matched: true } => {
                if let Some(s) = &mut self.source {
                    s.vouched = true;
                }
                self.proceed(seq, &payload, sink)
            }
            Purpose::Vouch { matched: false } => {
                let peer = self.source.take().map_or(0, |s| s.peer);
                if complete {
                    if self.disowned.len() == DISOWNED {
                        self.disowned.remove(0);
                    }
                    self.disowned.push(peer);
                    self.foreign(peer, "the engine's replay socket does not hold its batch")
                } else {
                    self.counts.unverified += 1;
                    self.log.push((
                        LogKind::Unverified,
                        format!(
                            "a batch from peer {peer} was ignored: the engine's replay socket did not answer, so it could not vouch for the peer"
                        ),
                    ));
                    Live::Ignored
                }
            }
            Purpose::Restart {
                last,
                seen_last,
                ahead,
                ..
            } => {
                let restarted = match (complete, seen_last) {
                    // No answer: the source is the engine's, its word is
                    // taken.
                    (false, _) => true,
                    (true, Some(same)) => !same,
                    (true, None) => !ahead,
                };
                if !restarted {
                    self.counts.stale += 1;
                    self.log.push((
                        LogKind::Stale,
                        format!(
                            "a batch numbered {seq} after {last} was ignored: the engine's replay socket still holds its later batches, so it did not restart"
                        ),
                    ));
                    return Live::Ignored;
                }
                let how = if complete {
                    " (its replay socket agrees)"
                } else {
                    " (its replay socket did not answer)"
                };
                self.restart(last, seq, how, sink);
                self.proceed(seq, &payload, sink)
            }
            Purpose::CatchUp { .. } => Live::Applied,
            Purpose::Fill { startup, holed } => {
                if startup && !complete {
                    // Not asked again for the next batch: this one is
                    // applied as it is.
                    self.abandon_history();
                    self.history_abandoned = false;
                }
                let covered = self.last.map_or(seq == 0, |last| last + 1 >= seq);
                if !covered && !startup && !holed {
                    let why = if complete {
                        "the engine's replay buffer no longer holds them"
                    } else {
                        "the replay socket did not answer in time"
                    };
                    let missing = seq - self.last.map_or(r.from, |l| l + 1);
                    self.lose(missing, why, sink);
                }
                if self.last.is_none_or(|last| seq > last) {
                    self.apply(seq, &payload, sink);
                }
                Live::Applied
            }
        }
    }

    /// The history the replay socket was asked for did not come whole.
    fn abandon_history(&mut self) {
        self.history_abandoned = true;
        self.counts.lost += 1;
        self.log.push((
            LogKind::Loss,
            "the replay socket did not give the engine's history (no answer, or not within the deadline): blocks it stored before are learned from its later batches".to_owned(),
        ));
    }

    /// The end of a replay asked on connecting.
    fn caught_up(&mut self, purpose: Purpose, complete: bool, sink: &mut impl Sink) -> Live {
        let Purpose::CatchUp { last, found, .. } = purpose else {
            // History at start: whatever came was applied.
            if !complete {
                self.abandon_history();
            }
            return Live::Applied;
        };
        let restarted = match found {
            Continuity::Restarted => true,
            // Nothing at or after the last number: the buffer holds only
            // a newer process's earlier batches.
            Continuity::Undecided => complete,
            Continuity::Same => false,
        };
        if !restarted {
            return Live::Applied;
        }
        self.counts.restarts += 1;
        self.log.push((
            LogKind::Restart,
            format!(
                "the engine restarted while kvedge was not connected (its replay socket no longer holds batch {last}); its blocks were dropped and are rebuilt from its events"
            ),
        ));
        self.drop_state(sink);
        self.last = None;
        self.last_digest = None;
        self.handle_connected()
    }

    /// Whether a replay is under way.
    pub fn replaying(&self) -> bool {
        self.replaying.is_some()
    }
}
