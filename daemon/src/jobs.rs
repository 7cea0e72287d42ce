//! The seam through which a driver on another thread feeds the routing
//! thread: the io_uring listener today, any async transport tomorrow. The
//! driver sends [`Job`]s (a connection arrived, a request, a connection
//! closed) over a channel and signals an eventfd in the routing thread's
//! epoll set, so a sleeping loop wakes; the routing thread answers each
//! job from the same core as its own sockets and calls back with the
//! outcome. The core stays with its single owner; nothing is locked.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use kvedge_core::{ClientId, Core};
use kvedge_shm::control::PeerCred;
use kvedge_wire::ErrorReply;
use kvedge_wire::framing::Mode;

use crate::dispatch::{self, Answer};
use crate::reload::{Reloads, Waiter};

/// Called with the outcome of a connection's admission.
pub type Admitted = Box<dyn FnOnce(Result<ClientId, ErrorReply<'static>>) + Send>;
/// Called when the core closes an admitted connection (idle timeout).
pub type Closer = Box<dyn FnOnce() + Send>;
/// Called with a request's reply bytes.
pub type Replied = Box<dyn FnOnce(Vec<u8>) + Send>;

/// One piece of work from a driver on another thread.
pub enum Job {
    /// A connection arrived, with its peer's credentials: the core admits
    /// or refuses it. `close` is called if the core later closes it.
    Connect {
        peer: io::Result<PeerCred>,
        /// Whether its selects keep the select path warm between paced
        /// selects (`daemon.warm_us`): yes for a client whose latency is
        /// the core's; no for the endpoint picker, whose every request
        /// costs hundreds of microseconds of HTTP around the select.
        warms: bool,
        admitted: Admitted,
        close: Closer,
    },
    /// One request of an admitted connection: a JSON line (without its
    /// newline) or a binary frame body.
    Request {
        client: ClientId,
        request: Vec<u8>,
        mode: Mode,
        reply: Replied,
    },
    /// An admitted connection sent part of a request (it is not idle).
    Active { client: ClientId },
    /// An admitted connection closed.
    Disconnect { client: ClientId },
    /// The endpoint picker's counts, for the metrics.
    PickerStats(Box<kvedge_core::metrics::PickerStats>),
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Connect { .. } => f.write_str("Connect"),
            Job::Request {
                client,
                request,
                mode,
                ..
            } => f
                .debug_struct("Request")
                .field("client", client)
                .field("bytes", &request.len())
                .field("mode", mode)
                .finish_non_exhaustive(),
            Job::Active { client } => f.debug_tuple("Active").field(client).finish(),
            Job::Disconnect { client } => f.debug_tuple("Disconnect").field(client).finish(),
            Job::PickerStats(_) => f.write_str("PickerStats"),
        }
    }
}

/// The sending end, for the other thread: queue a job, then signal the
/// eventfd so a sleeping loop wakes.
#[derive(Clone, Debug)]
pub struct JobSender {
    tx: mpsc::Sender<Job>,
    wake: Arc<OwnedFd>,
}

impl JobSender {
    /// Queues `job`; false once the routing thread is gone.
    pub fn send(&self, job: Job) -> bool {
        if self.tx.send(job).is_err() {
            return false;
        }
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        true
    }
}

/// The routing thread's end.
pub(crate) struct Jobs {
    rx: mpsc::Receiver<Job>,
    wake: Arc<OwnedFd>,
    /// How to close each admitted connection, should the core ask.
    closers: Vec<(ClientId, Closer)>,
    reply: Vec<u8>,
}

impl std::fmt::Debug for Jobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs")
            .field("connections", &self.closers.len())
            .finish_non_exhaustive()
    }
}

impl Jobs {
    /// A channel and its wake eventfd.
    pub fn new() -> io::Result<(Jobs, JobSender)> {
        let wake = Arc::new(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?);
        let (tx, rx) = mpsc::channel();
        let jobs = Jobs {
            rx,
            wake: Arc::clone(&wake),
            closers: Vec::new(),
            reply: Vec::with_capacity(4096),
        };
        Ok((jobs, JobSender { tx, wake }))
    }

    /// The eventfd a sender signals (in the routing thread's epoll set).
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    /// Carries out every queued job; returns whether there was any.
    pub fn serve(&mut self, core: &mut Core, reloads: &mut Reloads, now: Instant) -> bool {
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&*self.wake, &mut counter);
        let mut any = false;
        while let Ok(job) = self.rx.try_recv() {
            any = true;
            match job {
                Job::Connect {
                    peer,
                    warms,
                    admitted,
                    close,
                } => {
                    let outcome = core.handle_client_connected(now, || peer);
                    if let Ok(id) = outcome {
                        core.set_client_warms(id, warms);
                        self.closers.push((id, close));
                    }
                    admitted(outcome);
                }
                Job::Request {
                    client,
                    request,
                    mode,
                    reply,
                } => {
                    let answer = dispatch::answer(
                        core,
                        reloads,
                        now,
                        client,
                        mode,
                        &request,
                        &mut self.reply,
                    );
                    if answer == Answer::Reload {
                        // The reply comes when the load is done; the
                        // driver awaits it before its next request.
                        let waiter = Waiter::Job { reply, mode };
                        if let Err((e, Waiter::Job { reply, mode })) = reloads.begin(waiter) {
                            self.reply.clear();
                            crate::reload::could_not_start(mode, &e, &mut self.reply);
                            reply(self.reply.clone());
                        }
                        continue;
                    }
                    reply(self.reply.clone());
                }
                Job::Active { client } => core.handle_client_active(now, client),
                Job::Disconnect { client } => {
                    core.handle_client_closed(client);
                    self.closers.retain(|(id, _)| *id != client);
                }
                Job::PickerStats(stats) => core.handle_picker_stats(*stats),
            }
        }
        any
    }

    /// Closes connection `id` (the core has forgotten it); false if it is
    /// not one of this channel's.
    pub fn close(&mut self, id: ClientId) -> bool {
        let Some(i) = self.closers.iter().position(|(c, _)| *c == id) else {
            return false;
        };
        let (_, close) = self.closers.swap_remove(i);
        close();
        true
    }
}
