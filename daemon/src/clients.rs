//! The frontends' side of the routing thread: connections on `query.sock`
//! (admitted by the core), their bytes cut into requests ([`framing`]),
//! answered through [`crate::dispatch`] and written back; and the query
//! channels (shared-memory request and reply rings) a binary connection
//! may attach, served in the same pass.

use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use kvedge_core::{ClientId, Core};
use kvedge_shm::channel::{self as query_channel, ServerChannel};
use kvedge_shm::{Consumer, RingError};
use kvedge_wire::framing::{self, Mode, Next};
use kvedge_wire::{Status, binary, json};

use crate::dispatch::{self, Reloader};
use crate::poller::Poller;

/// Requests answered from one query channel per turn at most, so one
/// client cannot starve the rest.
const RING_REQUESTS_PER_TURN: usize = 64;

/// One query connection.
#[derive(Debug)]
struct ClientConn {
    id: ClientId,
    stream: UnixStream,
    /// Bytes received and not yet cut into requests.
    buf: Vec<u8>,
    readable: bool,
    mode: Mode,
    /// The query channel this connection attached, if any.
    rings: Option<ServerChannel>,
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
}

impl Clients {
    pub fn new(listener: UnixListener) -> Clients {
        Clients {
            listener: Some(listener),
            conns: Vec::new(),
            scratch: vec![0; 16384],
            reply: Vec::with_capacity(4096),
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
                readable: true,
                mode: Mode::Unknown,
                rings: None,
            });
        }
        any
    }

    /// Reads every readable connection and answers its complete requests,
    /// then the requests in its query channel, if any.
    pub fn serve(
        &mut self,
        core: &mut Core,
        reloader: &mut Option<Reloader>,
        poller: &Poller,
        now: Instant,
    ) -> bool {
        let mut any = false;
        let limit = core.config().daemon.max_frame_bytes;
        let mut i = 0;
        while i < self.conns.len() {
            let (read, mut closed) = self.read(i);
            if read {
                any = true;
                core.handle_client_active(now, self.conns[i].id);
            }
            let c = &mut self.conns[i];
            framing::detect(&mut c.mode, &mut c.buf);
            closed |= self.serve_requests(i, core, reloader, poller, now, limit);
            if !closed {
                match self.serve_ring(i, core, reloader, now) {
                    Ok(served) => any |= served,
                    Err(e) => {
                        tracing::warn!(
                            "a query channel's request ring is broken, closing its connection: {e}"
                        );
                        any = true;
                        closed = true;
                    }
                }
            }
            if closed {
                let c = self.conns.swap_remove(i);
                core.handle_client_closed(c.id);
                unwatch(poller, &c);
            } else {
                i += 1;
            }
        }
        any
    }

    /// Reads what connection `i` sent; returns whether anything arrived
    /// and whether the connection closed.
    fn read(&mut self, i: usize) -> (bool, bool) {
        let c = &mut self.conns[i];
        let chunk = &mut self.scratch[..];
        let mut read = false;
        while c.readable {
            match c.stream.read(chunk) {
                Ok(0) => return (read, true),
                Ok(n) => {
                    read = true;
                    c.buf.extend_from_slice(&chunk[..n]);
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
    /// binary frames); returns whether the connection must close.
    fn serve_requests(
        &mut self,
        i: usize,
        core: &mut Core,
        reloader: &mut Option<Reloader>,
        poller: &Poller,
        now: Instant,
        limit: usize,
    ) -> bool {
        let c = &mut self.conns[i];
        let mode = c.mode;
        let buf = std::mem::take(&mut c.buf);
        let mut consumed = 0;
        let mut closed = false;
        loop {
            match framing::next(mode, &buf[consumed..], limit) {
                Next::NeedMore => break,
                Next::TooLarge => {
                    let _ = write_reply(&mut c.stream, &framing::too_large(mode, limit));
                    closed = true;
                    break;
                }
                Next::Request { body, used } => {
                    let body = &buf[consumed + body.start..consumed + body.end];
                    consumed += used;
                    if mode == Mode::Binary
                        && body.get(..2) == Some(&binary::op::ATTACH_RINGS.to_le_bytes()[..])
                    {
                        if attach_rings(c, body, core, poller, now).is_err() {
                            closed = true;
                            break;
                        }
                        continue;
                    }
                    dispatch::answer(core, reloader, now, c.id, mode, body, &mut self.reply);
                    if write_reply(&mut c.stream, &self.reply).is_err() {
                        closed = true;
                        break;
                    }
                }
            }
        }
        c.buf = buf;
        c.buf.drain(..consumed);
        closed
    }

    /// Answers the requests waiting in connection `i`'s query channel, if
    /// it has one. Returns whether it served any, or the error that broke
    /// the request ring's framing (the connection must close). Any other
    /// bad record gets an error reply.
    fn serve_ring(
        &mut self,
        i: usize,
        core: &mut Core,
        reloader: &mut Option<Reloader>,
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
                dispatch::answer(core, reloader, now, c.id, Mode::Binary, record.payload, out);
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

    /// Closes connection `id`, which the core has already forgotten (idle).
    pub fn close(&mut self, id: ClientId, poller: &Poller) -> bool {
        let Some(i) = self.conns.iter().position(|c| c.id == id) else {
            return false;
        };
        let c = self.conns.swap_remove(i);
        unwatch(poller, &c);
        true
    }
}

/// Takes a departing connection's socket (and its query channel's wake
/// eventfd) out of the epoll set.
fn unwatch(poller: &Poller, c: &ClientConn) {
    poller.unwatch(&c.stream);
    if let Some(r) = &c.rings {
        poller.unwatch(r.requests.wake_fd());
    }
}

/// Answers an `attach_rings` frame: creates the connection's query
/// channel and sends its four descriptors with the reply, or refuses
/// (`RingsUnavailable`) and leaves the connection as it was. An error
/// means the reply could not be sent: close the connection.
fn attach_rings(
    c: &mut ClientConn,
    body: &[u8],
    core: &mut Core,
    poller: &Poller,
    now: Instant,
) -> io::Result<()> {
    let mut out = Vec::new();
    // Its op is attach_rings (the caller looked); the rest must be right.
    if let Err(e) = binary::decode_request(body) {
        binary::encode_reply(&mut out, &core.handle_undecodable(now, c.id, e));
        return write_reply(&mut c.stream, &out);
    }
    let grant = match core.handle_attach_rings(now, c.id) {
        Ok(grant) => grant,
        Err(refusal) => {
            binary::write_error(&mut out, refusal.status, &refusal.message);
            return write_reply(&mut c.stream, &out);
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
            return write_reply(&mut c.stream, &out);
        }
    };
    binary::encode_reply(
        &mut out,
        &kvedge_wire::Reply::RingsAttached {
            capacity: grant.capacity,
        },
    );
    // The descriptors go with the reply's first byte.
    let sent = blocking_for_a_second(&mut c.stream, |s| {
        query_channel::send_with_fds(s, &out, &rings.fds())
    })
    .and_then(|()| poller.watch_wake(rings.requests.wake_fd()));
    if sent.is_err() {
        core.handle_rings_detached(c.id);
        return sent;
    }
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

/// Writes a reply: straight through when the socket has room (the usual
/// case), else blocking for at most a second.
fn write_reply(stream: &mut UnixStream, bytes: &[u8]) -> io::Result<()> {
    let written = match stream.write(bytes) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    if written == bytes.len() {
        return Ok(());
    }
    blocking_for_a_second(stream, |s| s.write_all(&bytes[written..]))
}

/// Runs `send` on `stream` switched to blocking with a one-second write
/// timeout (a client whose socket is full gets that long), then switches
/// it back to non-blocking.
fn blocking_for_a_second<T>(
    stream: &mut UnixStream,
    send: impl FnOnce(&mut UnixStream) -> io::Result<T>,
) -> io::Result<T> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    let result = send(stream);
    stream.set_nonblocking(true)?;
    result
}
