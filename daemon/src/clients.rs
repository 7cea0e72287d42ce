//! The frontends' side of the routing thread: connections on `query.sock`
//! (admitted by the core), their bytes cut into requests ([`framing`]),
//! answered through [`crate::dispatch`] and written back; and the query
//! channels (shared-memory request and reply rings) a binary connection
//! may attach, served in the same pass.

use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use kvedge_core::{ClientDrop, ClientId, Core};
use kvedge_shm::channel::{self as query_channel, ServerChannel};
use kvedge_shm::{Consumer, RingError};
use kvedge_wire::framing::{self, Mode, Next};
use kvedge_wire::{Status, binary, json};

use crate::dispatch::{self, Answer};
use crate::poller::Poller;
use crate::reload::{Reloads, Waiter};

/// Requests answered from one query channel per turn at most, so one
/// client cannot starve the rest.
const RING_REQUESTS_PER_TURN: usize = 64;

/// Requests answered from one connection per turn at most (a `metrics` or
/// `workers` request ends its turn), so a client pipelining thousands
/// cannot make the others wait for all of them.
const REQUESTS_PER_TURN: usize = 32;

/// Bytes read from one connection per turn at most; the rest waits in its
/// socket for the next turn (the poller reports it readable again), so a
/// client sending megabytes does not make the others wait for them.
const READ_PER_TURN: usize = 64 * 1024;

/// A connection's input buffer keeps at most this much capacity once it
/// is empty; a larger one (a large request came) is given back.
const KEPT_INPUT_CAPACITY: usize = 64 * 1024;

/// Why a connection leaves at the end of its turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// It closed, failed, or was closed after an error reply.
    Closed,
    /// The daemon drops it (counted, logged).
    Dropped(ClientDrop),
}

/// One query connection.
#[derive(Debug)]
struct ClientConn {
    id: ClientId,
    stream: UnixStream,
    /// Bytes received and not yet cut into requests.
    buf: Vec<u8>,
    /// Reply bytes the socket has not taken yet (the client is slow to
    /// read); bounded by `daemon.max_reply_backlog_bytes`.
    out: Vec<u8>,
    /// The poller also reports this socket writable (while `out` holds
    /// bytes).
    writing: bool,
    /// Readable, or writable while `writing`, at the last check.
    readable: bool,
    /// Its buffer may hold a complete request: new bytes arrived, or its
    /// last turn ended before its requests did. Only then is it framed
    /// (a slowloris's megabyte is not searched again every turn).
    unframed: bool,
    /// Leading bytes of `buf` known to hold no newline (JSON lines).
    scanned: usize,
    mode: Mode,
    /// The query channel this connection attached, if any.
    rings: Option<ServerChannel>,
    /// It asked for a reload and waits for the answer: its later requests
    /// wait too, so its replies stay in order.
    awaiting_reload: bool,
}

/// Every query connection the routing thread serves itself.
#[derive(Debug)]
pub(crate) struct Clients {
    /// `None` while another driver (the io_uring listener) owns it.
    listener: Option<UnixListener>,
    conns: Vec<ClientConn>,
    /// Where reads land before they join a connection's buffer (retained:
    /// a fresh 16 KiB array per client per turn was a memset that showed
    /// up as a tenth of the loop's time).
    scratch: Vec<u8>,
    /// The reply being written (retained).
    reply: Vec<u8>,
    /// The bytes of every connection's `buf`, together.
    input_backlog: usize,
    /// The CPU this loop ran on when it last told the query channels.
    loop_cpu: usize,
}

impl Clients {
    pub fn new(listener: UnixListener) -> Clients {
        Clients {
            listener: Some(listener),
            conns: Vec::new(),
            scratch: vec![0; 16384],
            reply: Vec::with_capacity(4096),
            input_backlog: 0,
            loop_cpu: usize::MAX,
        }
    }

    pub fn listener(&self) -> Option<&UnixListener> {
        self.listener.as_ref()
    }

    /// Hands the listening socket to another driver.
    pub fn take_listener(&mut self) -> Option<UnixListener> {
        self.listener.take()
    }

    /// Takes the listening socket back.
    pub fn restore_listener(&mut self, listener: UnixListener) {
        self.listener = Some(listener);
    }

    /// The query channels' request rings (to prepare a sleep).
    pub fn rings(&mut self) -> impl Iterator<Item = &mut Consumer> {
        self.conns
            .iter_mut()
            .filter_map(|c| c.rings.as_mut().map(|r| &mut r.requests))
    }

    /// Records which connections the last readiness check found readable.
    pub fn take_readiness(&mut self, poller: &mut Poller) {
        for c in &mut self.conns {
            c.readable = poller.take(c.stream.as_fd());
        }
    }

    /// Accepts every waiting connection; the core admits it or refuses it
    /// (one JSON error line, then closed).
    pub fn accept(&mut self, core: &mut Core, poller: &Poller, now: Instant) -> bool {
        let mut any = false;
        while let Some(listener) = &self.listener {
            let Ok((stream, _)) = listener.accept() else {
                return any;
            };
            any = true;
            let id = match core
                .handle_client_connected(now, || kvedge_shm::control::peer_credentials(&stream))
            {
                Ok(id) => id,
                Err(refusal) => {
                    send_refusal(&stream, refusal.status, &refusal.message);
                    continue;
                }
            };
            if stream.set_nonblocking(true).is_err() || poller.watch(&stream).is_err() {
                core.handle_client_closed(id);
                continue;
            }
            self.conns.push(ClientConn {
                id,
                stream,
                buf: Vec::with_capacity(4096),
                out: Vec::new(),
                writing: false,
                readable: true,
                unframed: false,
                scanned: 0,
                mode: Mode::Unknown,
                rings: None,
                awaiting_reload: false,
            });
        }
        any
    }

    /// Reads every readable connection and answers its complete requests,
    /// then the requests in its query channel, if any. Replies are written
    /// without waiting: what a slow client's socket does not take waits in
    /// its own buffer, and a client that lets it pass the backlog limit is
    /// dropped, so no client waits for another.
    pub fn serve(
        &mut self,
        core: &mut Core,
        reloads: &mut Reloads,
        poller: &Poller,
        now: Instant,
    ) -> bool {
        let mut any = false;
        let limits = Limits::of(core);
        // Where this loop runs, told to every query channel's client when
        // it changes: a client that shares this CPU with the awake loop
        // yields it while it waits, rather than holding it while the loop
        // cannot answer (a vDSO call, no system call).
        let cpu = rustix::thread::sched_getcpu();
        if cpu != self.loop_cpu {
            self.loop_cpu = cpu;
            for r in self.conns.iter().filter_map(|c| c.rings.as_ref()) {
                r.requests.publish_cpu(cpu);
            }
        }
        let mut i = 0;
        while i < self.conns.len() {
            let mut end = None;
            if self.conns[i].readable && !self.conns[i].out.is_empty() {
                any = true;
                if flush(&mut self.conns[i], poller).is_err() {
                    end = Some(End::Closed);
                }
            }
            // Requests left from its last turn are served before more is
            // read: a pipelining client waits in its own socket buffer
            // (backpressure), not in the daemon's memory.
            let (read, closed) = if self.conns[i].unframed {
                (false, false)
            } else {
                self.read(i)
            };
            if closed {
                end = end.or(Some(End::Closed));
            }
            if read {
                any = true;
                self.conns[i].unframed = true;
                core.handle_client_active(now, self.conns[i].id);
            }
            if end.is_none() && self.conns[i].unframed && !self.conns[i].awaiting_reload {
                let c = &mut self.conns[i];
                framing::detect(&mut c.mode, &mut c.buf);
                end = self.serve_requests(i, core, reloads, poller, now, limits);
                // Requests left for its next turn keep the loop awake.
                any |= self.conns[i].unframed;
            }
            if end.is_none() && !self.conns[i].awaiting_reload {
                match self.serve_ring(i, core, reloads, now) {
                    Ok(served) => any |= served,
                    Err(e) => {
                        tracing::warn!(
                            "a query channel's request ring is broken, closing its connection: {e}"
                        );
                        any = true;
                        end = Some(End::Closed);
                    }
                }
            }
            match end {
                Some(end) => {
                    self.remove(i, end, core, poller, now);
                    any = true;
                }
                None => i += 1,
            }
        }
        // Unfinished requests over the budget: the connection holding the
        // most goes (a slowloris, not the many clients with a few bytes).
        while self.input_backlog > limits.input_backlog {
            let Some(worst) = (0..self.conns.len()).max_by_key(|&j| self.conns[j].buf.len()) else {
                break;
            };
            self.remove(
                worst,
                End::Dropped(ClientDrop::InputBudget),
                core,
                poller,
                now,
            );
        }
        any
    }

    /// Takes connection `i` out of the loop and tells the core why.
    fn remove(&mut self, i: usize, end: End, core: &mut Core, poller: &Poller, now: Instant) {
        let id = self.detach(i, poller);
        match end {
            End::Closed => core.handle_client_closed(id),
            End::Dropped(why) => core.handle_client_dropped(now, id, why),
        }
    }

    /// Takes connection `i` out of the loop (its socket and wake eventfd
    /// out of the epoll set, its input out of the backlog) and drops it.
    fn detach(&mut self, i: usize, poller: &Poller) -> ClientId {
        let c = self.conns.swap_remove(i);
        self.input_backlog -= c.buf.len();
        poller.unwatch(&c.stream);
        if let Some(r) = &c.rings {
            poller.unwatch(r.requests.wake_fd());
        }
        c.id
    }

    /// Reads what connection `i` sent; returns whether anything arrived
    /// and whether the connection closed.
    fn read(&mut self, i: usize) -> (bool, bool) {
        let c = &mut self.conns[i];
        let chunk = &mut self.scratch[..];
        let mut read = false;
        let mut total = 0;
        while c.readable && total < READ_PER_TURN {
            match c.stream.read(chunk) {
                Ok(0) => return (read, true),
                Ok(n) => {
                    read = true;
                    total += n;
                    c.buf.extend_from_slice(&chunk[..n]);
                    self.input_backlog += n;
                    // A short read drained the socket: skip the read that
                    // would only say EAGAIN (a system call per request).
                    // Anything newer shows at the next readiness check
                    // (level-triggered).
                    if n < chunk.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return (read, true),
            }
        }
        (read, false)
    }

    /// Answers every complete request of connection `i` (JSON lines or
    /// binary frames); returns why the connection must go, if it must.
    fn serve_requests(
        &mut self,
        i: usize,
        core: &mut Core,
        reloads: &mut Reloads,
        poller: &Poller,
        now: Instant,
        limits: Limits,
    ) -> Option<End> {
        let c = &mut self.conns[i];
        c.unframed = false;
        let mode = c.mode;
        // A JSON line still incomplete: look for its newline only in the
        // bytes that are new since the last look.
        if mode == Mode::Json
            && c.buf.len() <= limits.frame
            && !c.buf[c.scanned.min(c.buf.len())..].contains(&b'\n')
        {
            c.scanned = c.buf.len();
            return None;
        }
        c.scanned = 0;
        let buf = std::mem::take(&mut c.buf);
        let mut consumed = 0;
        let mut end = None;
        let mut served = 0;
        loop {
            if served == REQUESTS_PER_TURN {
                c.unframed = true;
                break;
            }
            served += 1;
            match framing::next(mode, &buf[consumed..], limits.frame) {
                Next::NeedMore => break,
                Next::TooLarge => {
                    let _ = queue(c, &framing::too_large(mode, limits.frame), &limits, poller);
                    end = Some(End::Closed);
                    break;
                }
                Next::Request { body, used } => {
                    let body = &buf[consumed + body.start..consumed + body.end];
                    consumed += used;
                    if mode == Mode::Binary
                        && body.get(..2) == Some(&binary::op::ATTACH_RINGS.to_le_bytes()[..])
                    {
                        if let Err(e) = attach_rings(c, body, core, poller, now, &limits) {
                            end = Some(e);
                            break;
                        }
                        continue;
                    }
                    let answer =
                        dispatch::answer(core, reloads, now, c.id, mode, body, &mut self.reply);
                    if answer == Answer::Heavy {
                        served = REQUESTS_PER_TURN;
                    }
                    if answer == Answer::Reload {
                        let waiter = Waiter::Socket { client: c.id, mode };
                        if let Err((e, _)) = reloads.begin(waiter) {
                            self.reply.clear();
                            crate::reload::could_not_start(mode, &e, &mut self.reply);
                        } else {
                            c.awaiting_reload = true;
                            break;
                        }
                    }
                    if let Err(e) = queue(c, &self.reply, &limits, poller) {
                        end = Some(e);
                        break;
                    }
                }
            }
        }
        c.buf = buf;
        c.buf.drain(..consumed);
        self.input_backlog -= consumed;
        if c.buf.is_empty() && c.buf.capacity() > KEPT_INPUT_CAPACITY {
            c.buf = Vec::with_capacity(4096);
        }
        end
    }

    /// Answers the requests waiting in connection `i`'s query channel, if
    /// it has one. Returns whether it served any, or the error that broke
    /// the request ring's framing (the connection must close). Any other
    /// bad record gets an error reply.
    fn serve_ring(
        &mut self,
        i: usize,
        core: &mut Core,
        reloads: &mut Reloads,
        now: Instant,
    ) -> Result<bool, RingError> {
        let c = &mut self.conns[i];
        let Some(rings) = c.rings.as_mut() else {
            return Ok(false);
        };
        let out = &mut self.reply;
        let mut served = false;
        for _ in 0..RING_REQUESTS_PER_TURN {
            let Some(record) = rings.requests.poll()? else {
                break;
            };
            served = true;
            if record.kind == query_channel::FRAME {
                let answer =
                    dispatch::answer(core, reloads, now, c.id, Mode::Binary, record.payload, out);
                if answer == Answer::Reload {
                    match reloads.begin(Waiter::Ring { client: c.id }) {
                        Ok(()) => {
                            c.awaiting_reload = true;
                            break;
                        }
                        Err((e, _)) => {
                            out.clear();
                            crate::reload::could_not_start(Mode::Binary, &e, out);
                        }
                    }
                }
            } else {
                out.clear();
                let e = kvedge_wire::ErrorReply {
                    status: Status::BadRequest,
                    message: "unknown record type in the request ring".into(),
                };
                binary::encode_reply(out, &core.handle_undecodable(now, c.id, e));
            }
            if out.len() - 4 > rings.replies.max_payload() {
                out.clear();
                binary::write_error(
                    out,
                    Status::FrameTooLarge,
                    "the reply does not fit the reply ring; send this request over the socket",
                );
            }
            // Dropped only when the client stopped reading its replies
            // (it then sees a gap): its loss, nobody else's.
            let _ = rings.replies.try_push(query_channel::FRAME, 0, &out[4..]);
        }
        Ok(served)
    }

    /// Delivers a reload's answer to connection `client` (socket or
    /// query channel) and lets it be served again.
    pub fn deliver(
        &mut self,
        waiter: &Waiter,
        bytes: &[u8],
        poller: &Poller,
        core: &mut Core,
        now: Instant,
    ) {
        let (client, ring) = match waiter {
            Waiter::Socket { client, .. } => (*client, false),
            Waiter::Ring { client } => (*client, true),
            _ => return,
        };
        let limits = Limits::of(core);
        let Some(i) = self.conns.iter().position(|c| c.id == client) else {
            return;
        };
        let c = &mut self.conns[i];
        c.awaiting_reload = false;
        // Its requests that arrived meanwhile are served at its next turn.
        c.unframed = true;
        if ring {
            if let Some(rings) = c.rings.as_mut() {
                let _ = rings.replies.try_push(query_channel::FRAME, 0, &bytes[4..]);
            }
        } else if let Err(end) = queue(c, bytes, &limits, poller) {
            self.remove(i, end, core, poller, now);
        }
    }

    /// On the way out: writes what slow readers have not taken yet,
    /// waiting for their sockets for at most `within`.
    pub fn flush_all(&mut self, poller: &mut Poller, within: std::time::Duration) {
        let deadline = Instant::now() + within;
        loop {
            let mut pending = false;
            for c in &mut self.conns {
                if !c.out.is_empty() && flush(c, &*poller).is_ok() {
                    pending |= !c.out.is_empty();
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !pending || left.is_zero() {
                return;
            }
            poller.sleep(left.min(std::time::Duration::from_millis(10)));
        }
    }

    /// Closes connection `id`, which the core has already forgotten (idle).
    pub fn close(&mut self, id: ClientId, poller: &Poller) -> bool {
        let Some(i) = self.conns.iter().position(|c| c.id == id) else {
            return false;
        };
        self.detach(i, poller);
        true
    }
}

/// The limits of the configuration in force that bound a connection.
#[derive(Clone, Copy, Debug)]
struct Limits {
    frame: usize,
    reply_backlog: usize,
    input_backlog: usize,
}

impl Limits {
    fn of(core: &Core) -> Limits {
        let d = &core.config().daemon;
        Limits {
            frame: d.max_frame_bytes,
            reply_backlog: d.max_reply_backlog_bytes,
            input_backlog: d.max_input_backlog_bytes,
        }
    }
}

/// Answers an `attach_rings` frame: creates the connection's query
/// channel and sends its four descriptors with the reply, or refuses
/// (`RingsUnavailable`) and leaves the connection as it was. An error
/// means the connection must go.
fn attach_rings(
    c: &mut ClientConn,
    body: &[u8],
    core: &mut Core,
    poller: &Poller,
    now: Instant,
    limits: &Limits,
) -> Result<(), End> {
    let mut out = Vec::new();
    // Its op is attach_rings (the caller looked); the rest must be right.
    if let Err(e) = binary::decode_request(body) {
        binary::encode_reply(&mut out, &core.handle_undecodable(now, c.id, e));
        return queue(c, &out, limits, poller);
    }
    if !c.out.is_empty() {
        binary::write_error(
            &mut out,
            Status::RingsUnavailable,
            "earlier replies on this connection are still unread; read them, then attach",
        );
        return queue(c, &out, limits, poller);
    }
    let grant = match core.handle_attach_rings(now, c.id) {
        Ok(grant) => grant,
        Err(refusal) => {
            binary::write_error(&mut out, refusal.status, &refusal.message);
            return queue(c, &out, limits, poller);
        }
    };
    let rings = match ServerChannel::create(grant.capacity, grant.attach_epoch) {
        Ok(r) => r,
        Err(e) => {
            core.handle_rings_detached(c.id);
            tracing::warn!("cannot create a query channel: {e}");
            binary::write_error(
                &mut out,
                Status::RingsUnavailable,
                &format!("the daemon cannot create the rings: {e}"),
            );
            return queue(c, &out, limits, poller);
        }
    };
    binary::encode_reply(
        &mut out,
        &kvedge_wire::Reply::RingsAttached {
            capacity: grant.capacity,
        },
    );
    // The descriptors go with the reply's first byte, on a socket with
    // nothing else waiting: it takes a few dozen bytes at once, or the
    // client is not reading and goes.
    let sent = query_channel::send_with_fds(&c.stream, &out, &rings.fds())
        .and_then(|()| poller.watch_wake(rings.requests.wake_fd()));
    if sent.is_err() {
        core.handle_rings_detached(c.id);
        return Err(End::Dropped(ClientDrop::SlowReader));
    }
    // Where this loop runs, for the client (see `Clients::serve`).
    rings.requests.publish_cpu(rustix::thread::sched_getcpu());
    c.rings = Some(rings);
    Ok(())
}

/// One JSON error line to a refused connection, never blocking (the
/// caller then drops it). The protocol is not known yet, and a line is
/// what people and scripts read; binary clients see the refusal as an
/// unreadable reply followed by the close.
pub(crate) fn send_refusal(stream: &UnixStream, status: Status, message: &str) {
    let mut line = Vec::new();
    json::write_error(&mut line, status, message);
    let _ = stream.set_nonblocking(true);
    let _ = rustix::net::send(stream, &line, rustix::net::SendFlags::NOSIGNAL);
}

/// Sends a reply without waiting: straight through when nothing is
/// pending and the socket has room (the usual case); what the socket does
/// not take waits in the connection's backlog, written when the poller
/// says the socket has room. A backlog past its limit drops the client.
fn queue(c: &mut ClientConn, bytes: &[u8], limits: &Limits, poller: &Poller) -> Result<(), End> {
    let mut rest = bytes;
    if c.out.is_empty() {
        match c.stream.write(bytes) {
            Ok(n) => rest = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return Err(End::Closed),
        }
        if rest.is_empty() {
            return Ok(());
        }
    }
    if c.out.len() + rest.len() > limits.reply_backlog {
        return Err(End::Dropped(ClientDrop::SlowReader));
    }
    c.out.extend_from_slice(rest);
    if !c.writing {
        poller
            .want_write(&c.stream, true)
            .map_err(|_| End::Closed)?;
        c.writing = true;
    }
    Ok(())
}

/// Writes as much of connection `c`'s backlog as its socket takes now;
/// once it is empty the poller stops reporting the socket writable.
fn flush(c: &mut ClientConn, poller: &Poller) -> io::Result<()> {
    let mut written = 0;
    while written < c.out.len() {
        match c.stream.write(&c.out[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    c.out.drain(..written);
    if c.out.is_empty() {
        if c.out.capacity() > KEPT_INPUT_CAPACITY {
            c.out = Vec::new();
        }
        if c.writing {
            poller.want_write(&c.stream, false)?;
            c.writing = false;
        }
    }
    Ok(())
}
