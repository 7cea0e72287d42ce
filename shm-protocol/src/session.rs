//! An engine's session with the daemon, as a state machine without I/O in
//! the manner of the routing core: `handle_*` says what happened,
//! [`Session::poll_action`] what to do next, [`Session::poll_timeout`]
//! when; time is always an argument. Every engine driver runs this one
//! machine, with one set of intervals: [`Link`] (the Rust publisher's, and
//! through it `kvedge publish` and the mock engine), the C library's
//! `kvedge_publisher_poll`, the Python binding and the engine bridge.
//!
//! ```text
//!            Register                handle_registered
//! Unregistered ───────▶ Registering ────────────────▶ Registered ─┐
//!      ▲    ▲  backoff      │ handle_register_failed    │  Heartbeat, Resync,
//!      │    └───────────────┘                           │  Republish (after a
//!      └────────────── handle_closed ───────────────────┘  registration again)
//! ```
//!
//! A failed registration waits [`FIRST_RETRY`], doubling up to
//! [`MAX_RETRY`]; a closed one is tried again after [`FIRST_RETRY`]. A
//! heartbeat is due when no record but a notice has gone for half the
//! interval the daemon's Welcome gives, so one late beat is never a missed
//! one. After registering again, the daemon knows nothing of the engine:
//! [`Action::Republish`] asks for everything it holds.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::ControlError;
use crate::publisher::{PublishError, Publisher};
use kvedge_schema::messages::control::Hello;

/// The wait after a registration that failed or a session the daemon
/// closed.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);
/// The longest wait between registration attempts.
pub const MAX_RETRY: Duration = Duration::from_secs(5);
/// How long one registration attempt may take.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// Not registered; a registration is due at `retry_at`.
    Unregistered { retry_at: Instant },
    /// A registration was asked for and its outcome is awaited.
    Registering,
    /// Registered: the engine publishes into its ring.
    Registered,
}

/// What the driver should do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Connect and register, then [`Session::handle_registered`] or
    /// [`Session::handle_register_failed`].
    Register,
    /// Registered again after the daemon closed the session: publish
    /// everything the engine holds (the daemon knows none of it).
    Republish,
    /// Serve the daemon's resync request: a snapshot of everything held.
    Resync { snapshot_id: u64 },
    /// Send a heartbeat record, then [`Session::handle_sent`].
    Heartbeat,
}

/// An engine's session with the daemon.
#[derive(Debug, Clone)]
pub struct Session {
    state: SessionState,
    backoff: Duration,
    heartbeat_every: Duration,
    beat_due: Instant,
    pending_resync: Option<u64>,
    republish: bool,
    registrations: u64,
}

impl Session {
    /// A session that has yet to register; a registration is due at once.
    pub fn new(now: Instant) -> Session {
        Session {
            state: SessionState::Unregistered { retry_at: now },
            backoff: FIRST_RETRY,
            heartbeat_every: Duration::from_millis(500),
            beat_due: now,
            pending_resync: None,
            republish: false,
            registrations: 0,
        }
    }

    /// A session whose first registration just succeeded (a driver that
    /// registers synchronously before it runs the machine).
    pub fn registered(now: Instant, heartbeat_interval_ms: u32) -> Session {
        let mut s = Session::new(now);
        s.state = SessionState::Registering;
        s.handle_registered(now, heartbeat_interval_ms);
        s
    }

    pub fn state(&self) -> SessionState {
        self.state
    }

    /// Registrations that succeeded so far.
    pub fn registrations(&self) -> u64 {
        self.registrations
    }

    /// The interval the heartbeats keep.
    pub fn heartbeat_every(&self) -> Duration {
        self.heartbeat_every
    }

    /// The daemon took the registration; its Welcome asks for a record at
    /// least every `heartbeat_interval_ms`.
    pub fn handle_registered(&mut self, now: Instant, heartbeat_interval_ms: u32) {
        self.state = SessionState::Registered;
        self.backoff = FIRST_RETRY;
        self.heartbeat_every = (Duration::from_millis(u64::from(heartbeat_interval_ms)) / 2)
            .max(Duration::from_millis(10));
        self.beat_due = now + self.heartbeat_every;
        self.republish = self.registrations > 0;
        self.registrations += 1;
    }

    /// The registration failed (no daemon, refused, timed out): tried
    /// again after the backoff, which doubles up to [`MAX_RETRY`].
    pub fn handle_register_failed(&mut self, now: Instant) {
        self.state = SessionState::Unregistered {
            retry_at: now + self.backoff,
        };
        self.backoff = (self.backoff * 2).min(MAX_RETRY);
    }

    /// The daemon closed the session (it restarted, or dropped the
    /// engine): registered again after [`FIRST_RETRY`].
    pub fn handle_closed(&mut self, now: Instant) {
        if self.state == SessionState::Registered {
            self.backoff = FIRST_RETRY;
            self.state = SessionState::Unregistered {
                retry_at: now + FIRST_RETRY,
            };
            self.pending_resync = None;
            self.republish = false;
        }
    }

    /// The daemon asks for a snapshot (records were lost).
    pub fn handle_resync_requested(&mut self, snapshot_id: u64) {
        if self.state == SessionState::Registered {
            self.pending_resync = Some(snapshot_id);
        }
    }

    /// A record other than a notice went into the ring: it counts as a
    /// sign of life, so the next heartbeat is due a full interval later.
    pub fn handle_sent(&mut self, now: Instant) {
        self.beat_due = now + self.heartbeat_every;
    }

    /// The next thing to do at `now`, if anything (call until `None`).
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        match self.state {
            SessionState::Unregistered { retry_at } if now >= retry_at => {
                self.state = SessionState::Registering;
                Some(Action::Register)
            }
            SessionState::Unregistered { .. } | SessionState::Registering => None,
            SessionState::Registered => {
                if std::mem::take(&mut self.republish) {
                    return Some(Action::Republish);
                }
                if let Some(snapshot_id) = self.pending_resync.take() {
                    return Some(Action::Resync { snapshot_id });
                }
                if now >= self.beat_due {
                    // Due once: the driver's handle_sent (or its next
                    // record) moves it on.
                    self.beat_due = now + self.heartbeat_every;
                    return Some(Action::Heartbeat);
                }
                None
            }
        }
    }

    /// When the machine next has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            SessionState::Unregistered { retry_at } => Some(retry_at),
            SessionState::Registering => None,
            SessionState::Registered => Some(self.beat_due),
        }
    }
}

/// What a [`Link::tick`] did, for the caller's log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    /// The daemon closed the session during this tick.
    pub closed: bool,
    /// The engine registered (again) during this tick.
    pub registered: bool,
    /// A resync snapshot was served.
    pub resynced: bool,
}

/// An engine's registration and publisher, kept alive by [`Session`] for
/// as long as the engine runs: what a blocking engine (the Rust
/// publisher's users, `kvedge publish`, the mock engine) calls each turn.
#[derive(Debug)]
pub struct Link {
    control: PathBuf,
    hello: Hello,
    session: Session,
    publisher: Option<Publisher>,
    /// The engine's clock origin for heartbeat timestamps.
    started: Instant,
    last_error: Option<String>,
}

impl Link {
    /// Registers `hello` at `control` now (an error if the daemon refuses
    /// or is not there), to be kept registered by [`Link::tick`].
    pub fn connect(control: impl AsRef<Path>, hello: Hello) -> Result<Link, ControlError> {
        let now = Instant::now();
        let publisher = Publisher::connect(control.as_ref(), &hello, REGISTER_TIMEOUT)?;
        let interval = publisher
            .session()
            .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
        Ok(Link {
            control: control.as_ref().to_owned(),
            hello,
            session: Session::registered(now, interval),
            publisher: Some(publisher),
            started: now,
            last_error: None,
        })
    }

    /// The publisher while registered.
    pub fn publisher(&mut self) -> Option<&mut Publisher> {
        self.publisher.as_mut()
    }

    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Why the last registration attempt failed, while unregistered.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// A record other than a notice was published: no heartbeat is due
    /// for a while.
    pub fn sent(&mut self, now: Instant) {
        self.session.handle_sent(now);
    }

    /// Does what is due at `now`: notices a closed session or a resync
    /// request, registers again (with backoff), republishes after that,
    /// serves snapshots and sends heartbeats. `republish` publishes every
    /// block the engine holds (inside a snapshot, or after registering
    /// again).
    pub fn tick(
        &mut self,
        now: Instant,
        mut republish: impl FnMut(&mut Publisher) -> Result<(), PublishError>,
    ) -> Tick {
        let mut tick = Tick::default();
        if let Some(p) = &mut self.publisher {
            match p.poll() {
                Ok(Some(req)) => self.session.handle_resync_requested(req.snapshot_id),
                Ok(None) => {}
                Err(_) => {
                    self.publisher = None;
                    self.session.handle_closed(now);
                    tick.closed = true;
                }
            }
        }
        while let Some(action) = self.session.poll_action(now) {
            match action {
                Action::Register => {
                    match Publisher::connect(&self.control, &self.hello, REGISTER_TIMEOUT) {
                        Ok(p) => {
                            let interval = p
                                .session()
                                .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
                            self.publisher = Some(p);
                            self.session.handle_registered(now, interval);
                            self.last_error = None;
                            tick.registered = true;
                        }
                        Err(e) => {
                            self.last_error = Some(e.to_string());
                            self.session.handle_register_failed(now);
                        }
                    }
                }
                Action::Republish => {
                    if let Some(p) = &mut self.publisher {
                        // A full ring drops records; the daemon sees the
                        // gap and asks for a snapshot.
                        let _ = republish(p);
                    }
                }
                Action::Resync { snapshot_id } => {
                    if let Some(p) = &mut self.publisher {
                        let result = p
                            .begin_snapshot(snapshot_id)
                            .and_then(|_| republish(p))
                            .and_then(|_| p.end_snapshot());
                        // An incomplete snapshot is asked for again.
                        let _ = result;
                        tick.resynced = true;
                    }
                }
                Action::Heartbeat => {
                    let ts = self.started.elapsed().as_nanos() as u64;
                    if let Some(p) = &mut self.publisher {
                        let _ = p.heartbeat(ts);
                    }
                }
            }
        }
        tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Session, now: Instant) -> Vec<Action> {
        std::iter::from_fn(|| s.poll_action(now)).collect()
    }

    #[test]
    fn registers_at_once_and_backs_off_on_failure() {
        let t = Instant::now();
        let mut s = Session::new(t);
        assert_eq!(drain(&mut s, t), [Action::Register]);
        assert_eq!(s.state(), SessionState::Registering);
        assert_eq!(drain(&mut s, t), [], "one attempt at a time");
        // Refused, or no daemon: 100 ms, 200, 400, ... up to 5 s.
        let mut waits = Vec::new();
        let mut now = t;
        for _ in 0..8 {
            s.handle_register_failed(now);
            let at = s.poll_timeout().unwrap();
            waits.push(at - now);
            assert_eq!(drain(&mut s, at - Duration::from_millis(1)), []);
            assert_eq!(drain(&mut s, at), [Action::Register]);
            now = at;
        }
        assert_eq!(waits[0], FIRST_RETRY);
        assert_eq!(waits[1], FIRST_RETRY * 2);
        assert_eq!(*waits.last().unwrap(), MAX_RETRY);
        s.handle_registered(now, 1000);
        assert_eq!(s.state(), SessionState::Registered);
        assert_eq!(s.registrations(), 1);
        assert_eq!(
            drain(&mut s, now),
            [],
            "nothing to republish the first time"
        );
    }

    #[test]
    fn heartbeats_at_half_the_interval_unless_records_went() {
        let t = Instant::now();
        let mut s = Session::registered(t, 1000);
        assert_eq!(s.heartbeat_every(), Duration::from_millis(500));
        assert_eq!(s.poll_timeout(), Some(t + Duration::from_millis(500)));
        assert_eq!(drain(&mut s, t + Duration::from_millis(499)), []);
        // A record at 400 ms moves the beat to 900 ms.
        s.handle_sent(t + Duration::from_millis(400));
        assert_eq!(drain(&mut s, t + Duration::from_millis(600)), []);
        assert_eq!(
            drain(&mut s, t + Duration::from_millis(900)),
            [Action::Heartbeat]
        );
        assert_eq!(
            drain(&mut s, t + Duration::from_millis(901)),
            [],
            "due once"
        );
        assert_eq!(
            drain(&mut s, t + Duration::from_millis(1400)),
            [Action::Heartbeat]
        );
    }

    #[test]
    fn a_late_poll_sends_one_heartbeat_not_a_burst() {
        let t = Instant::now();
        let mut s = Session::registered(t, 1000);
        // The engine's loop stalled for 5 s, ten beats' worth: one
        // heartbeat now, the next half an interval after it.
        let late = t + Duration::from_secs(5);
        assert_eq!(drain(&mut s, late), [Action::Heartbeat]);
        assert_eq!(s.poll_timeout(), Some(late + Duration::from_millis(500)));
        assert_eq!(s.state(), SessionState::Registered);
    }

    #[test]
    fn a_resync_request_is_served_once() {
        let t = Instant::now();
        let mut s = Session::registered(t, 1000);
        s.handle_resync_requested(7);
        assert_eq!(drain(&mut s, t), [Action::Resync { snapshot_id: 7 }]);
        assert_eq!(drain(&mut s, t), []);
    }

    #[test]
    fn a_closed_session_registers_again_and_republishes() {
        let t = Instant::now();
        let mut s = Session::registered(t, 1000);
        s.handle_resync_requested(3);
        // The daemon restarts: the pending resync goes with its session.
        s.handle_closed(t);
        assert_eq!(
            s.state(),
            SessionState::Unregistered {
                retry_at: t + FIRST_RETRY
            }
        );
        assert_eq!(drain(&mut s, t), []);
        let later = t + FIRST_RETRY;
        assert_eq!(drain(&mut s, later), [Action::Register]);
        // Not back yet: the backoff grows from the first retry.
        s.handle_register_failed(later);
        assert_eq!(s.poll_timeout(), Some(later + FIRST_RETRY));
        let again = later + FIRST_RETRY;
        assert_eq!(drain(&mut s, again), [Action::Register]);
        s.handle_registered(again, 2000);
        assert_eq!(s.registrations(), 2);
        // Everything held goes to the new daemon, then heartbeats resume
        // at the new interval.
        assert_eq!(drain(&mut s, again), [Action::Republish]);
        assert_eq!(
            drain(&mut s, again + Duration::from_millis(1000)),
            [Action::Heartbeat]
        );
        // A closed notice while not registered changes nothing.
        let mut u = Session::new(t);
        u.handle_closed(t);
        assert_eq!(drain(&mut u, t), [Action::Register]);
    }
}
