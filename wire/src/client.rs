//! The blocking client of the binary protocol, for programs (the C
//! library wraps it): requests over the socket, or over a query channel
//! once attached. Replies are read into the client's own buffer, so a warm
//! client allocates nothing per request.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use kvedge_shm::channel::{self, ClientChannel};
use kvedge_shm::ring::Push;

use crate::Status;
use crate::binary::{MAGIC, decode_select_reply, encode_request};
use crate::reply::{SelectReply, SelectView};
use crate::request::{Ids, Request, Role, Select};

/// A client of the binary protocol. By default it checks for its reply
/// for up to 50 µs, yielding its CPU between checks, and then sleeps until
/// the reply arrives; [`Client::set_spinning`] makes it spin instead
/// (lower latency, one core busy while waiting).
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    out: Vec<u8>,
    body: Vec<u8>,
    spinning: bool,
    /// An earlier call failed mid-frame.
    broken: bool,
    /// The query channel, once attached.
    rings: Option<ClientChannel>,
    timeout: Option<Duration>,
}

/// A call's outcome: an I/O error (a reply this client cannot read
/// included), or the daemon's answer, which is the value or an error
/// status with its message.
pub type Outcome<T> = io::Result<Result<T, (Status, String)>>;

/// Longest reply a client accepts (a select reply is ~50 bytes plus the
/// endpoint; an error, its message).
pub const MAX_REPLY_BYTES: usize = 1 << 20;

/// How long a blocking client checks for its reply before it sleeps.
/// The kernel tends to run a woken thread on its waker's core, so the
/// daemon a request wakes often shares the client's core and can answer
/// only once the client lets go of it; a client that slept at once pays a
/// wake-up of its own when the reply comes (tens of microseconds on a
/// virtual machine whose idle core has halted). So a blocking client
/// checks, and lets other threads run between checks, for this long, and
/// then sleeps. Over the socket, each check is a `poll` and the client
/// always yields between checks. Over a query channel a check reads the
/// reply ring, and the client yields only when its request found the
/// daemon asleep and woke it, or when the awake daemon runs on the
/// client's CPU (the daemon publishes its CPU in the request ring's
/// header). An awake daemon elsewhere is not yielded to: with other
/// threads wanting the CPU a yield hands it to them, and a busy daemon's
/// replies then came later (the paced bench's A/B runs of each choice are
/// in BENCHMARKS.md's history).
const SPIN: Duration = Duration::from_micros(50);

/// Checks of the reply ring between two looks at whether the awake daemon
/// runs on this client's CPU (about a microsecond of checks): a reply that
/// comes sooner never pays for the look.
const SHARED_CPU_CHECK: u32 = 64;

/// The longest sleep between checks that the daemon is still there and
/// that the call's timeout has not passed.
const RING_SLEEP_SLICE: Duration = Duration::from_millis(10);

/// The status of a reply's code; one this version does not know is an
/// `InvalidData` error (a newer daemon; this client cannot tell what it
/// means).
fn status_of(code: u16) -> io::Result<Status> {
    Status::from_code(code).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the daemon answered with unknown status {code}"),
        )
    })
}

/// Writes all of `buf` with `send(MSG_NOSIGNAL)`: a peer that went away is
/// an `EPIPE` error, never a SIGPIPE (which would kill a C host process that
/// does not ignore it). Spins on `WouldBlock` (a non-blocking client).
fn send_all(stream: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match rustix::net::send(stream, buf, rustix::net::SendFlags::NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(rustix::io::Errno::AGAIN) => std::hint::spin_loop(),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Waits until `stream` has bytes to read (or hung up), for at most
/// `timeout`: checks with a yield between them for [`SPIN`], then sleeps
/// in `poll`. Not in `read`: Linux wakes a thread blocked in `read` on a
/// Unix socket whenever its own earlier write is consumed (the daemon
/// reading the request frees the client's send buffer), so a client
/// sleeping in `read` is woken once for nothing per request, and on the
/// daemon's core that wake-up interrupts the daemon mid-request. A
/// `poll` for input ignores it.
fn wait_readable(stream: &UnixStream, timeout: Option<Duration>) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags, poll};
    let start = Instant::now();
    let spin = timeout.map_or(SPIN, |t| t.min(SPIN));
    let no_wait = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    while start.elapsed() < spin {
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        if poll(&mut fds, Some(&no_wait)).is_ok_and(|n| n > 0) {
            return Ok(());
        }
        std::thread::yield_now();
    }
    let deadline = timeout.map(|t| start + t);
    loop {
        let left = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                Some(rustix::time::Timespec::try_from(left).map_err(io::Error::other)?)
            }
            None => None,
        };
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        match poll(&mut fds, left.as_ref()) {
            // Readable, hung up or failed: the read that follows says which.
            Ok(n) if n > 0 => return Ok(()),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// `read_exact` that retries on `WouldBlock` (a spinning client).
fn read_exact_spinning(stream: &mut UnixStream, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match stream.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Client {
    /// Connects to a daemon's `query.sock`.
    pub fn connect(path: impl AsRef<Path>) -> io::Result<Client> {
        let stream = UnixStream::connect(path)?;
        send_all(&stream, MAGIC)?;
        Ok(Client {
            stream,
            out: Vec::with_capacity(4096),
            body: Vec::with_capacity(256),
            spinning: false,
            broken: false,
            rings: None,
            timeout: None,
        })
    }

    /// Spin on a non-blocking socket while waiting for replies (`true`),
    /// or check for up to 50 µs and then sleep until the reply arrives
    /// (`false`, the default; see `SPIN`). On a query channel a spinning
    /// client polls the reply ring without ever sleeping, yielding its CPU
    /// between checks only when its request woke the daemon or the daemon
    /// runs on its CPU. Over the socket it spins without yielding: give it
    /// a core of its own, or a daemon that shares its core waits for the
    /// scheduler to preempt it.
    pub fn set_spinning(&mut self, spinning: bool) -> io::Result<()> {
        self.stream.set_nonblocking(spinning)?;
        self.spinning = spinning;
        Ok(())
    }

    /// Bounds how long a blocking client waits for a reply (`None`:
    /// forever). A call that waited that long fails with `TimedOut`.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.timeout = timeout;
        self.stream.set_read_timeout(timeout)?;
        self.stream.set_write_timeout(timeout)
    }

    /// Sends `out` and reads one reply frame: its status and payload. A
    /// status this version does not know is an `InvalidData` error.
    fn round_trip(&mut self) -> io::Result<(Status, &[u8])> {
        let (code, payload) = self.round_trip_code()?;
        Ok((status_of(code)?, payload))
    }

    /// Sends `out` and reads one reply frame: its raw status code and
    /// payload. After an I/O error (a timeout included) the stream may be
    /// mid-frame, so the client refuses every later call: close it and
    /// connect again.
    fn round_trip_code(&mut self) -> io::Result<(u16, &[u8])> {
        if self.broken {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "an earlier call failed mid-frame; reconnect",
            ));
        }
        self.broken = true;
        if let Some(rings) = &mut self.rings
            && self.out.len() - 4 <= rings.requests.max_payload()
        {
            return self.ring_round_trip();
        }
        send_all(&self.stream, &self.out)?;
        self.read_reply(None)?;
        self.broken = false;
        let code = u16::from_le_bytes([self.body[0], self.body[1]]);
        Ok((code, &self.body[4..]))
    }

    /// Reads one reply frame from the socket into `body` (status, version,
    /// payload); with `fds`, also collects descriptors sent with it.
    fn read_reply(&mut self, mut fds: Option<&mut Vec<std::os::fd::OwnedFd>>) -> io::Result<()> {
        let spinning = self.spinning;
        let mut fill = |stream: &mut UnixStream, buf: &mut [u8]| match fds.as_deref_mut() {
            Some(fds) => {
                fds.extend(channel::recv_with_fds(stream, buf, spinning)?);
                Ok(())
            }
            None if spinning => read_exact_spinning(stream, buf),
            None => stream.read_exact(buf),
        };
        if !spinning {
            wait_readable(&self.stream, self.timeout)?;
        }
        let mut len = [0u8; 4];
        fill(&mut self.stream, &mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if !(4..=MAX_REPLY_BYTES).contains(&len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply frame of {len} bytes (expected 4..={MAX_REPLY_BYTES})"),
            ));
        }
        self.body.resize(len, 0);
        fill(&mut self.stream, &mut self.body)
    }

    /// Moves this connection's requests onto a query channel (shared-memory
    /// rings; see the module docs): a round trip then costs no system call
    /// while the daemon is busy. Requests too large for the ring still go
    /// over the socket. `Ok(Err(RINGS_UNAVAILABLE, ..))` leaves the client
    /// on the socket, fully usable.
    pub fn attach_rings(&mut self) -> Outcome<()> {
        if self.rings.is_some() {
            return Ok(Ok(()));
        }
        if self.broken {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "an earlier call failed mid-frame; reconnect",
            ));
        }
        self.encode(&Request::AttachRings)?;
        self.broken = true;
        send_all(&self.stream, &self.out)?;
        // The descriptors come with the reply's first byte.
        let mut fds = Vec::new();
        self.read_reply(Some(&mut fds))?;
        self.broken = false;
        let status = status_of(u16::from_le_bytes([self.body[0], self.body[1]]))?;
        if status != Status::Ok {
            return Ok(Err((
                status,
                String::from_utf8_lossy(&self.body[4..]).into_owned(),
            )));
        }
        let rings = ClientChannel::open(fds).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the daemon's query channel is unusable: {e}"),
            )
        })?;
        self.rings = Some(rings);
        Ok(Ok(()))
    }

    /// Whether requests go through a query channel.
    /// The attached query channel, if any (its rings' positions, and the
    /// segments tests attack through `kvedge_shm::fuzzing`).
    pub fn channel(&self) -> Option<&kvedge_shm::channel::ClientChannel> {
        self.rings.as_ref()
    }

    pub fn rings_attached(&self) -> bool {
        self.rings.is_some()
    }

    /// `round_trip` over the rings: one record out, one back. Called with
    /// `broken` set; clears it on success.
    fn ring_round_trip(&mut self) -> io::Result<(u16, &[u8])> {
        let rings = self.rings.as_mut().expect("attached");
        let wakes = rings.requests.wakes();
        match rings.requests.try_push(channel::FRAME, 0, &self.out[4..]) {
            Ok(Push::Committed { .. }) => {}
            Ok(Push::Dropped { .. }) => {
                return Err(io::Error::other(
                    "the request ring is full (the daemon stopped reading it)",
                ));
            }
            Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidInput, e)),
        }
        // Whether the daemon was asleep and this request woke it (see
        // `SPIN`).
        let woke_daemon = rings.requests.wakes() != wakes;
        // Whether to yield between checks: when this request woke the
        // daemon, or once the awake daemon turns out to run on this CPU
        // (looked at after the first few checks; see `SPIN`).
        let mut yielding = woke_daemon;
        let start = Instant::now();
        let mut turns = 0u32;
        loop {
            match rings.replies.poll() {
                Ok(Some(r)) => {
                    if r.kind != channel::FRAME || r.missing_before != 0 || r.payload.len() < 4 {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "the reply ring lost or garbled a reply",
                        ));
                    }
                    self.body.clear();
                    self.body.extend_from_slice(r.payload);
                    break;
                }
                Ok(None) => {}
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
            // Waiting: poll (a spinning client for as long as it takes, a
            // blocking one for `SPIN`), holding the CPU unless this
            // request woke the daemon or the daemon runs on this CPU (see
            // `SPIN`); a blocking client then sleeps on the wake eventfd
            // in slices. Between slices (a spinning client: every few
            // thousand checks), make sure the daemon is still there.
            if self.spinning || start.elapsed() < SPIN {
                if yielding {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                turns = turns.wrapping_add(1);
                if !yielding && turns.is_multiple_of(SHARED_CPU_CHECK) {
                    yielding =
                        rings.requests.consumer_cpu() == Some(rustix::thread::sched_getcpu());
                }
                if !self.spinning || !turns.is_multiple_of(4096) {
                    continue;
                }
            } else {
                rings.replies.wait(Duration::ZERO, RING_SLEEP_SLICE);
            }
            if kvedge_shm::control::connection_closed(&self.stream)? {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the daemon closed the connection",
                ));
            }
            if self.timeout.is_some_and(|t| start.elapsed() > t) {
                return Err(io::ErrorKind::TimedOut.into());
            }
        }
        self.broken = false;
        let code = u16::from_le_bytes([self.body[0], self.body[1]]);
        Ok((code, &self.body[4..]))
    }

    /// Encodes `request` into `out`.
    fn encode(&mut self, request: &Request<'_>) -> io::Result<()> {
        self.out.clear();
        encode_request(&mut self.out, request)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Selects a worker. The answer borrows the client's buffer (no
    /// allocation after warm-up); an error status comes back with its
    /// message. A select with `lora` or `explain` is refused
    /// (`InvalidInput`): those are in the JSON protocol only.
    pub fn select(&mut self, q: &Select<'_>) -> io::Result<Result<SelectView<'_>, (Status, &str)>> {
        self.encode(&Request::Select(*q))?;
        let (status, p) = self.round_trip()?;
        if status != Status::Ok {
            return Ok(Err((
                status,
                std::str::from_utf8(p).unwrap_or("(message not UTF-8)"),
            )));
        }
        decode_select_reply(p)
            .map(Ok)
            .map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))
    }

    /// Selects a worker for a prompt given as sequence hashes (an owned
    /// answer; see [`Client::select`] for the general form). A
    /// `prompt_tokens` of 0 means the hash count times the block size.
    pub fn select_hashes(
        &mut self,
        model: &str,
        role: Role,
        hashes: &[u64],
        prompt_tokens: u32,
        dry_run: bool,
    ) -> Outcome<SelectReply> {
        let mut q = Select::new(model, role, Ids::hashes(hashes));
        q.prompt_tokens = (prompt_tokens > 0).then_some(prompt_tokens);
        q.dry_run = dry_run;
        Ok(match self.select(&q)? {
            Ok(v) => Ok(v.to_owned()),
            Err((status, m)) => Err((status, m.to_owned())),
        })
    }

    /// Sends raw bytes over the socket (even with rings attached) and reads
    /// one reply frame (tests of bad input).
    pub fn raw(&mut self, bytes: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        self.out.clear();
        self.out.extend_from_slice(bytes);
        let rings = self.rings.take();
        let reply = self.round_trip_code().map(|(code, p)| (code, p.to_vec()));
        self.rings = rings;
        reply
    }

    /// The request's prefill is done: its prefill tokens leave the
    /// worker's projected load.
    pub fn prefill_done(&mut self, request_id: u64) -> Outcome<()> {
        self.release(&Request::PrefillDone { request_id })
    }

    /// Releases a request.
    pub fn finish(&mut self, request_id: u64) -> Outcome<()> {
        self.release(&Request::Finish { request_id })
    }

    /// Releases a request whose dispatch failed before a response stream:
    /// its session's binding goes back to what it was before its select.
    pub fn abort(&mut self, request_id: u64) -> Outcome<()> {
        self.release(&Request::Abort { request_id })
    }

    fn release(&mut self, request: &Request<'_>) -> Outcome<()> {
        self.encode(request)?;
        let (status, p) = self.round_trip()?;
        Ok(if status == Status::Ok {
            Ok(())
        } else {
            Err((status, String::from_utf8_lossy(p).into_owned()))
        })
    }
}
