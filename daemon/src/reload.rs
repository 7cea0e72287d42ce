//! Reloads off the routing thread. Reading, parsing and validating a
//! configuration (and building its rule policy) can take long on a large
//! file; the routing thread must not wait for it. A reload thread, started
//! on the first reload, runs the [`Reloader`]; the routing thread hands it
//! the request, keeps serving, and swaps the loaded configuration into the
//! core at the start of a turn once it is ready. Whoever asked (a client's
//! `reload`, SIGHUP) gets the outcome then; a client that asked is not
//! served further requests until it has its answer, so its replies stay in
//! order. The configuration replaced is sent back to the reload thread to
//! be dropped there.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use kvedge_config::{Config, ConfigError};
use kvedge_core::{ClientId, Core, ReloadError};
use kvedge_wire::framing::Mode;
use kvedge_wire::{Reply, Status};

use crate::dispatch::reply_encoder;

use crate::jobs::Replied;

/// Produces a freshly loaded configuration, or the loader's error.
pub type Reloader = Box<dyn FnMut() -> Result<Config, ConfigError> + Send>;

/// Who waits for a reload's outcome.
pub(crate) enum Waiter {
    /// A query connection of the routing thread, in its protocol.
    Socket { client: ClientId, mode: Mode },
    /// A query channel's request ring (binary).
    Ring { client: ClientId },
    /// A connection of a driver on another thread.
    Job { reply: Replied, mode: Mode },
    /// SIGHUP: the outcome is only logged.
    Signal,
}

/// What the reload thread is asked to do.
enum Command {
    Load,
    /// Drop a configuration the core no longer uses.
    Retire(Box<Config>),
}

/// The reload thread, once started: what it is sent, what it answers,
/// and the eventfd it wakes the loop with.
struct ReloadThread {
    tx: mpsc::Sender<Command>,
    rx: mpsc::Receiver<Result<Config, ConfigError>>,
    wake: Arc<OwnedFd>,
}

/// The routing thread's side of reloads.
pub(crate) struct Reloads {
    /// Until the thread starts.
    reloader: Option<Reloader>,
    thread: Option<ReloadThread>,
    in_flight: bool,
    /// Asked again while a load ran: the file may have changed since.
    again: bool,
    waiters: Vec<Waiter>,
}

impl std::fmt::Debug for Reloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloads")
            .field("in_flight", &self.in_flight)
            .field("waiters", &self.waiters.len())
            .finish_non_exhaustive()
    }
}

/// An outcome to deliver to one waiter: the reply's bytes.
pub(crate) struct Delivery {
    pub waiter: Waiter,
    pub bytes: Vec<u8>,
}

impl Reloads {
    pub fn new() -> Reloads {
        Reloads {
            reloader: None,
            thread: None,
            in_flight: false,
            again: false,
            waiters: Vec::new(),
        }
    }

    /// Sets how the configuration is loaded again.
    pub fn set_reloader(&mut self, reloader: Reloader) {
        self.reloader = Some(reloader);
        self.thread = None;
    }

    /// Whether a reloader is set (else a reload is refused at once).
    pub fn configured(&self) -> bool {
        self.reloader.is_some() || self.thread.is_some()
    }

    /// The eventfd the reload thread signals when a load is done (to end
    /// a sleep), once the thread runs.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.thread.as_ref().map(|w| w.wake.as_fd())
    }

    /// Starts a reload for `waiter` (or joins the one running); gives the
    /// waiter back if the reload thread cannot start.
    pub fn begin(&mut self, waiter: Waiter) -> Result<(), (io::Error, Waiter)> {
        if self.thread.is_none() {
            match self.start() {
                Ok(worker) => self.thread = Some(worker),
                Err(e) => return Err((e, waiter)),
            }
        }
        self.waiters.push(waiter);
        if self.in_flight {
            self.again = true;
        } else {
            self.send_load();
        }
        Ok(())
    }

    /// Starts the reload thread with the reloader.
    fn start(&mut self) -> io::Result<ReloadThread> {
        let Some(mut reloader) = self.reloader.take() else {
            return Err(io::Error::other("no configuration file to reload"));
        };
        let wake = Arc::new(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?);
        let (tx, commands) = mpsc::channel::<Command>();
        let (results, rx) = mpsc::channel();
        let thread_wake = Arc::clone(&wake);
        std::thread::Builder::new()
            .name("kvedge-reload".into())
            .spawn(move || {
                // Below the routing thread: on a busy node a long
                // parse takes its time, not the selects'.
                let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
                for command in commands {
                    match command {
                        Command::Load => {
                            if results.send(reloader()).is_err() {
                                return;
                            }
                            let _ = rustix::io::write(&*thread_wake, &1u64.to_ne_bytes());
                        }
                        Command::Retire(old) => drop(old),
                    }
                }
            })?;
        Ok(ReloadThread { tx, rx, wake })
    }

    fn send_load(&mut self) {
        if let Some(w) = &self.thread {
            crate::notify::reloading();
            self.in_flight = w.tx.send(Command::Load).is_ok();
        }
    }

    /// If the running load is done: applies it to the core (or keeps the
    /// old configuration, on an error) and returns the replies to deliver.
    pub fn poll(&mut self, core: &mut Core, now: Instant) -> Vec<Delivery> {
        if !self.in_flight {
            return Vec::new();
        }
        let Some(w) = &self.thread else {
            return Vec::new();
        };
        let loaded = match w.rx.try_recv() {
            Ok(loaded) => loaded,
            Err(mpsc::TryRecvError::Empty) => return Vec::new(),
            Err(mpsc::TryRecvError::Disconnected) => Err(ConfigError {
                file: String::new(),
                message: "the reload thread is gone".into(),
            }),
        };
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&*w.wake, &mut counter);
        self.in_flight = false;
        let outcome = core.handle_reload(now, loaded.map_err(ReloadError::from));
        if let Some(old) = core.take_retired_config() {
            let _ = w.tx.send(Command::Retire(Box::new(old)));
        }
        crate::notify::ready(&core.status());
        let deliveries = self
            .waiters
            .drain(..)
            .map(|waiter| Delivery {
                bytes: encode(&waiter, &outcome),
                waiter,
            })
            .collect();
        if std::mem::take(&mut self.again) {
            self.send_load();
        }
        deliveries
    }
}

/// The reply to a reload, in the waiter's protocol (nothing for SIGHUP).
fn encode(waiter: &Waiter, outcome: &Result<u64, ReloadError>) -> Vec<u8> {
    let reply = match outcome {
        Ok(reloads) => Reply::Reloaded { reloads: *reloads },
        Err(e) => Reply::error(Status::ReloadFailed, e.to_string()),
    };
    let mut out = Vec::new();
    let mode = match waiter {
        Waiter::Socket { mode, .. } | Waiter::Job { mode, .. } => *mode,
        Waiter::Ring { .. } => Mode::Binary,
        Waiter::Signal => return out,
    };
    reply_encoder(mode)(&mut out, &reply);
    out
}

/// The reply to a reload that could not be started, in `mode`.
pub(crate) fn could_not_start(mode: Mode, e: &io::Error, out: &mut Vec<u8>) {
    let reply = Reply::error(
        Status::ReloadFailed,
        format!("the reload could not start: {e}"),
    );
    reply_encoder(mode)(out, &reply);
}
