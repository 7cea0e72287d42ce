//! The engines' side of the routing thread: connections on `control.sock`
//! (accepted at once, their Hello read only once it has fully arrived, so
//! a slow or silent peer cannot stall the loop), the registration
//! handshake (Hello in, Welcome and a fresh ring out), and each turn's
//! drain of every ring into the core. What an engine's state means and
//! when it changes is the core's business; this driver moves bytes and
//! carries out what the core asks (send a resync, close a connection).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use kvedge_core::{Core, EngineId, RegistrationError};
use kvedge_schema::messages::control::ResyncRequest;
use kvedge_shm::control::{
    FrameReady, connection_closed, frame_ready, peer_credentials, read_hello, send_reject,
    send_resync, send_welcome,
};
use kvedge_shm::{Consumer, ControlError, SegmentError};

use crate::poller::Poller;

/// Records read from one ring per turn at most, so queries are not
/// starved by a busy engine.
const RECORDS_PER_TURN: usize = 4096;
/// Payload bytes read from one ring per turn at most (past the first
/// record): a snapshot's records carry thousands of blocks each, and a
/// turn that applied 4,096 of them would hold every query for seconds.
const BYTES_PER_TURN: usize = 64 * 1024;
/// Connections accepted on `control.sock` per turn at most: half the
/// pending connections one uid may hold, so a connection is read for its
/// Hello in at least two turns before a flood of newer ones can push it
/// out ([`kvedge_core::MAX_PENDING_PER_UID`]).
const ACCEPTS_PER_TURN: usize = kvedge_core::MAX_PENDING_PER_UID / 2;

/// Why a registration handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("it hung up before its Hello")]
    HungUp,
    #[error("reading its Hello: {0}")]
    Hello(ControlError),
    #[error(transparent)]
    Refused(RegistrationError),
    #[error("creating its ring: {0}")]
    Ring(SegmentError),
    #[error("sending its Welcome: {0}")]
    Welcome(ControlError),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// One connection on the control socket.
#[derive(Debug)]
struct EngineConn {
    id: EngineId,
    stream: UnixStream,
    /// Its ring, once registered.
    ring: Option<Consumer>,
    /// The stream had something (or hung up) at the last readiness check.
    readable: bool,
}

/// Every engine connection of the routing thread.
#[derive(Debug)]
pub(crate) struct Engines {
    listener: UnixListener,
    conns: Vec<EngineConn>,
    /// Connections still waiting for their Hello.
    pending: usize,
}

impl Engines {
    pub fn new(listener: UnixListener) -> Engines {
        Engines {
            listener,
            conns: Vec::new(),
            pending: 0,
        }
    }

    pub fn listener(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }

    /// Registered engines' rings (to prepare a sleep).
    pub fn rings(&mut self) -> impl Iterator<Item = &mut Consumer> {
        self.conns.iter_mut().filter_map(|c| c.ring.as_mut())
    }

    /// Records which connections the last readiness check found readable.
    pub fn take_readiness(&mut self, poller: &mut Poller) {
        for c in &mut self.conns {
            c.readable = poller.take(c.stream.as_fd());
        }
    }

    /// Accepts up to [`ACCEPTS_PER_TURN`] waiting connections; the core
    /// admits each, closing an older pending one if need be.
    pub fn accept(&mut self, core: &mut Core, poller: &Poller, now: Instant) -> bool {
        let mut any = false;
        for _ in 0..ACCEPTS_PER_TURN {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    any = true;
                    // Admitted always; the core may close an older pending
                    // connection to make room (an output).
                    let uid = peer_credentials(&stream).ok().map(|c| c.uid);
                    let id = core.handle_engine_connected(now, uid);
                    if stream.set_nonblocking(true).is_err() || poller.watch(&stream).is_err() {
                        core.handle_engine_closed(now, id, 0);
                        continue;
                    }
                    self.conns.push(EngineConn {
                        id,
                        stream,
                        ring: None,
                        readable: true,
                    });
                    self.pending += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!("accept on control socket: {e}");
                    break;
                }
            }
        }
        any
    }

    /// Registers the waiting connections whose Hello has fully arrived,
    /// and lets go of the ones that hung up first.
    pub fn register(&mut self, core: &mut Core, poller: &Poller, now: Instant) -> bool {
        if self.pending == 0 {
            return false;
        }
        let mut any = false;
        let mut i = 0;
        while i < self.conns.len() {
            let c = &mut self.conns[i];
            if c.ring.is_some() || !c.readable {
                i += 1;
                continue;
            }
            let outcome = match frame_ready(&c.stream) {
                Ok(FrameReady::NotYet) => {
                    i += 1;
                    continue;
                }
                Ok(FrameReady::Ready) => handshake(c, core, poller, now),
                Ok(FrameReady::Closed) | Err(_) => Err(HandshakeError::HungUp),
            };
            any = true;
            self.pending -= 1;
            match outcome {
                Ok(ring) => {
                    c.ring = Some(ring);
                    i += 1;
                }
                Err(e) => {
                    let c = self.conns.swap_remove(i);
                    poller.unwatch(&c.stream);
                    match e {
                        // The core refused it: counted, logged, forgotten.
                        HandshakeError::Refused(_) => {}
                        HandshakeError::HungUp => core.handle_engine_closed(now, c.id, 0),
                        e => core.handle_registration_failed(now, c.id, &e),
                    }
                }
            }
        }
        any
    }

    /// Drains every registered engine's ring into the core (bounded per
    /// ring), and lets go of engines whose control connection closed.
    pub fn drain(&mut self, core: &mut Core, poller: &Poller, now: Instant) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.conns.len() {
            let c = &mut self.conns[i];
            let Some(ring) = c.ring.as_mut() else {
                i += 1;
                continue;
            };
            let mut n = 0;
            let mut bytes = 0;
            let mut drained = false;
            while n < RECORDS_PER_TURN && bytes < BYTES_PER_TURN {
                match ring.poll() {
                    Ok(Some(record)) => {
                        bytes += record.payload.len();
                        core.handle_engine_record(now, c.id, &record);
                        n += 1;
                    }
                    Ok(None) => {
                        drained = true;
                        break;
                    }
                    Err(e) => {
                        core.handle_engine_broken(now, c.id, &e);
                        break;
                    }
                }
            }
            any |= n > 0;
            // With no record and no drop the core would find nothing to do
            // (the loop's busiest path calls this for every engine).
            if n > 0 || ring.unreported_drops() > 0 {
                core.handle_engine_drained(now, c.id, ring.producer_dropped(), drained);
            }
            if c.readable && connection_closed(&c.stream).unwrap_or(true) {
                any = true;
                self.remove(i, core, poller, now);
                continue;
            }
            i += 1;
        }
        any
    }

    /// Sends engine `id` a resync request: a few bytes on its control
    /// connection, never waiting. An engine that has let its connection
    /// fill up (it does not read its resync requests) cannot be brought
    /// back in sync: the core is told its feed is broken.
    pub fn send_resync(
        &mut self,
        id: EngineId,
        request: &ResyncRequest,
        core: &mut Core,
        now: Instant,
    ) {
        if let Some(c) = self.conns.iter().find(|c| c.id == id)
            && let Err(e) = send_resync(&c.stream, request)
        {
            core.handle_engine_broken(
                now,
                id,
                &format_args!("its resync request could not be sent without waiting: {e}"),
            );
        }
    }

    /// Closes engine `id`'s connection, as the core asked.
    pub fn close(&mut self, id: EngineId, core: &mut Core, poller: &Poller, now: Instant) {
        if let Some(i) = self.conns.iter().position(|c| c.id == id) {
            self.remove(i, core, poller, now);
        }
    }

    /// Takes connection `i` out of the loop and tells the core it is gone.
    fn remove(&mut self, i: usize, core: &mut Core, poller: &Poller, now: Instant) {
        let c = self.conns.swap_remove(i);
        if c.ring.is_none() {
            self.pending -= 1;
        }
        poller.unwatch(&c.stream);
        let dropped = c.ring.as_ref().map_or(0, |r| {
            poller.unwatch(r.wake_fd());
            r.producer_dropped()
        });
        core.handle_engine_closed(now, c.id, dropped);
    }
}

/// Reads a Hello that has fully arrived, lets the core register it, and
/// answers with a Welcome and a fresh ring (or the core's refusal).
fn handshake(
    c: &EngineConn,
    core: &mut Core,
    poller: &Poller,
    now: Instant,
) -> Result<Consumer, HandshakeError> {
    // The stream stays non-blocking: the Hello has fully arrived, and the
    // Welcome is a small frame on a fresh connection; a peer that could
    // make either wait fails its registration instead.
    let stream = &c.stream;
    let hello = read_hello(stream).map_err(HandshakeError::Hello)?;
    let welcome = match core.handle_hello(now, c.id, &hello, || peer_credentials(stream)) {
        Ok(w) => w,
        Err(e) => {
            let _ = send_reject(stream, e.reject_code(), &e.to_string());
            return Err(HandshakeError::Refused(e));
        }
    };
    let ring = Consumer::create(welcome.ring_capacity, welcome.attach_epoch)
        .map_err(HandshakeError::Ring)?;
    send_welcome(stream, &welcome, &ring).map_err(HandshakeError::Welcome)?;
    poller.watch_wake(ring.wake_fd())?;
    Ok(ring)
}
