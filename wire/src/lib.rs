//! The binary query protocol, for programs (people and scripts use JSON
//! lines on the same socket). A connection that starts with the 4 bytes
//! `KVE1` speaks it; anything else is JSON lines.
//!
//! Every frame, both ways: `len: u32 | op or status: u16 | version: u16 |
//! payload`, little-endian, where `len` counts everything after itself.
//!
//! | op | request payload | reply payload (status 0) |
//! |---|---|---|
//! | 1 select | `flags: u8` (bit 0 dry run, bit 1 ids are token ids rather than sequence hashes, bit 2 the request context follows the ids), `role: u8` (0 aggregated, 1 prefill, 2 decode, 3 encode), `model_len: u16`, model, `session_len: u16`, session (0 = none), `prompt_tokens: u32` (0 = from the ids), `count: u32`, then `count` ids (`u32` tokens or `u64` hashes); with bit 2: `priority: i32`, `tenant_len: u16`, tenant (0 = none), `tag_count: u16` then each `len: u16`, tag, `header_count: u16` then each `name_len: u16`, name, `value_len: u16`, value | `worker_id: u64`, `dp_rank: u32`, `request_id: u64`, `cost: f64` (NaN: none), overlap `device, host, disk: u32`, `flags: u8` (bit 0: a provider, not a worker), `endpoint_len: u16`, endpoint |
//! | 2 prefill_done | `request_id: u64` | empty |
//! | 3 finish | `request_id: u64` | empty |
//! | 4 attach_rings | empty | `capacity: u64`, with four descriptors attached (SCM_RIGHTS): see below |
//!
//! A non-zero status is an error, its payload the message (UTF-8). Status
//! codes are in [`status`]. A frame longer than the daemon's
//! `max_frame_bytes` gets `FRAME_TOO_LARGE` and the connection is closed;
//! any other bad frame gets its error and the connection stays usable.
//!
//! **Rings.** `attach_rings` moves a connection's requests off the socket:
//! the daemon answers with the descriptors of a query channel
//! ([`kvedge_shm::channel`]), a request ring and a reply ring of `capacity`
//! bytes each. From then on the client may put any request frame body (the
//! frame without its length) into the request ring as one record and reads
//! its reply frame body from the reply ring, one request in flight at a
//! time; the socket still works and stays open, as the liveness signal both
//! ways. A request larger than a quarter of the ring goes over the socket.
//! A daemon that cannot attach (its limit reached, or a listener that does
//! not support it) answers `RINGS_UNAVAILABLE`; the connection is unchanged.
//!
//! A crate of its own (std, rustix and the shm contract only) so that the
//! C library links the client without the daemon's dependencies.

#![forbid(unsafe_code)]

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use kvedge_shm::channel::{self, ClientChannel};
use kvedge_shm::ring::Push;

/// First bytes of a binary connection.
pub const MAGIC: &[u8; 4] = b"KVE1";
/// Protocol version in every frame.
pub const VERSION: u16 = 1;

/// Request operations.
pub mod op {
    pub const SELECT: u16 = 1;
    pub const PREFILL_DONE: u16 = 2;
    pub const FINISH: u16 = 3;
    pub const ATTACH_RINGS: u16 = 4;
}

/// Reply statuses.
pub mod status {
    pub const OK: u16 = 0;
    pub const BAD_REQUEST: u16 = 1;
    pub const NO_WORKER: u16 = 2;
    pub const REJECTED: u16 = 3;
    pub const NO_RULE: u16 = 4;
    pub const UNKNOWN_REQUEST: u16 = 5;
    pub const FRAME_TOO_LARGE: u16 = 6;
    pub const UNSUPPORTED_VERSION: u16 = 7;
    pub const UNKNOWN_OP: u16 = 8;
    pub const TOO_MANY_REQUESTS: u16 = 9;
    pub const RINGS_UNAVAILABLE: u16 = 10;
}

/// The ids of a select: raw little-endian bytes, decoded by the server.
#[derive(Clone, Copy, Debug)]
pub enum Ids<'a> {
    Tokens(&'a [u8]),
    Hashes(&'a [u8]),
}

/// A decoded request.
#[derive(Clone, Copy, Debug)]
pub enum Request<'a> {
    Select {
        dry_run: bool,
        role: u8,
        model: &'a str,
        session: Option<&'a str>,
        prompt_tokens: u32,
        ids: Ids<'a>,
        /// The request context for rules and policies (flag bit 2).
        context: Context<'a>,
    },
    PrefillDone(u64),
    Finish(u64),
    AttachRings,
}

/// Tags and headers of a select, validated, read in place.
#[derive(Clone, Copy, Debug, Default)]
pub struct Context<'a> {
    pub priority: i32,
    pub tenant: Option<&'a str>,
    tag_count: u16,
    tags: &'a [u8],
    header_count: u16,
    headers: &'a [u8],
}

impl<'a> Context<'a> {
    /// The tags, in order.
    pub fn tags(&self) -> impl Iterator<Item = &'a str> + 'a {
        let mut c = Cursor(self.tags);
        (0..self.tag_count).map(move |_| {
            let n = c.u16().expect("validated") as usize;
            c.str(n).expect("validated")
        })
    }

    pub fn tag_count(&self) -> usize {
        usize::from(self.tag_count)
    }

    /// The headers, (name, value), in order.
    pub fn headers(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let mut c = Cursor(self.headers);
        (0..self.header_count).map(move |_| {
            let n = c.u16().expect("validated") as usize;
            let name = c.str(n).expect("validated");
            let n = c.u16().expect("validated") as usize;
            (name, c.str(n).expect("validated"))
        })
    }

    pub fn header_count(&self) -> usize {
        usize::from(self.header_count)
    }
}

/// Most tags a select may carry.
pub const MAX_TAGS: usize = 32;

/// Reads and validates the context fields.
fn parse_context<'a>(c: &mut Cursor<'a>) -> Result<Context<'a>, &'static str> {
    let priority = c.u32()? as i32;
    let n = c.u16()? as usize;
    let tenant = c.str(n)?;
    let tag_count = c.u16()?;
    if usize::from(tag_count) > MAX_TAGS {
        return Err("more than 32 tags");
    }
    let start = c.0;
    for _ in 0..tag_count {
        let n = c.u16()? as usize;
        c.str(n)?;
    }
    let tags = &start[..start.len() - c.0.len()];
    let header_count = c.u16()?;
    let start = c.0;
    for _ in 0..header_count {
        let n = c.u16()? as usize;
        c.str(n)?;
        let n = c.u16()? as usize;
        c.str(n)?;
    }
    let headers = &start[..start.len() - c.0.len()];
    Ok(Context {
        priority,
        tenant: (!tenant.is_empty()).then_some(tenant),
        tag_count,
        tags,
        header_count,
        headers,
    })
}

/// A bounds-checked reader over a frame.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("frame is shorter than its fields");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str(&mut self, n: usize) -> Result<&'a str, &'static str> {
        std::str::from_utf8(self.take(n)?).map_err(|_| "a string field is not UTF-8")
    }
}

/// Decodes one frame's body (after the length): op, version, payload.
pub fn parse_request(body: &[u8]) -> Result<Request<'_>, (u16, &'static str)> {
    let bad = |m| (status::BAD_REQUEST, m);
    let mut c = Cursor(body);
    let op = c.u16().map_err(bad)?;
    let version = c.u16().map_err(bad)?;
    if version != VERSION {
        return Err((status::UNSUPPORTED_VERSION, "unsupported protocol version"));
    }
    let req = match op {
        op::SELECT => {
            let flags = c.u8().map_err(bad)?;
            let role = c.u8().map_err(bad)?;
            let model_len = c.u16().map_err(bad)? as usize;
            let model = c.str(model_len).map_err(bad)?;
            let session_len = c.u16().map_err(bad)? as usize;
            let session = c.str(session_len).map_err(bad)?;
            let prompt_tokens = c.u32().map_err(bad)?;
            let count = c.u32().map_err(bad)? as usize;
            let tokens = flags & 2 != 0;
            let width = if tokens { 4 } else { 8 };
            let bytes = c
                .take(count.checked_mul(width).ok_or(bad("id count overflows"))?)
                .map_err(bad)?;
            let context = if flags & 4 != 0 {
                parse_context(&mut c).map_err(bad)?
            } else {
                Context::default()
            };
            Request::Select {
                context,
                dry_run: flags & 1 != 0,
                role,
                model,
                session: (!session.is_empty()).then_some(session),
                prompt_tokens,
                ids: if tokens {
                    Ids::Tokens(bytes)
                } else {
                    Ids::Hashes(bytes)
                },
            }
        }
        op::PREFILL_DONE => Request::PrefillDone(c.u64().map_err(bad)?),
        op::FINISH => Request::Finish(c.u64().map_err(bad)?),
        op::ATTACH_RINGS => Request::AttachRings,
        _ => return Err((status::UNKNOWN_OP, "unknown op")),
    };
    if !c.0.is_empty() {
        return Err(bad("trailing bytes after the fields"));
    }
    Ok(req)
}

/// Appends a frame: `len | code | version | payload`.
pub fn write_frame(out: &mut Vec<u8>, code: u16, payload: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    payload(out);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// A select answer.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectReply {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub request_id: u64,
    pub cost: f64,
    pub overlap_blocks: [u32; 3],
    pub provider: bool,
    pub endpoint: String,
}

/// The ids of a select.
#[derive(Clone, Copy, Debug)]
pub enum QueryIds<'a> {
    /// Sequence hashes of the prompt's full blocks.
    Hashes(&'a [u64]),
    /// Token ids; the daemon hashes them with the model's block size.
    Tokens(&'a [u32]),
}

/// A select, as a client sends it.
#[derive(Clone, Copy, Debug)]
pub struct SelectQuery<'a> {
    pub model: &'a str,
    /// 0 aggregated, 1 prefill, 2 decode, 3 encode.
    pub role: u8,
    pub session: Option<&'a str>,
    pub ids: QueryIds<'a>,
    /// 0: derived from the ids.
    pub prompt_tokens: u32,
    pub dry_run: bool,
    /// For the rule language and policies; sent only when any is set.
    pub priority: i32,
    pub tenant: Option<&'a str>,
    pub tags: &'a [&'a str],
    pub headers: &'a [(&'a str, &'a str)],
}

/// A select answer borrowed from the client's buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectView<'a> {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub request_id: u64,
    pub cost: f64,
    pub overlap_blocks: [u32; 3],
    pub provider: bool,
    pub endpoint: &'a str,
}

impl SelectView<'_> {
    pub fn to_owned(&self) -> SelectReply {
        SelectReply {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            request_id: self.request_id,
            cost: self.cost,
            overlap_blocks: self.overlap_blocks,
            provider: self.provider,
            endpoint: self.endpoint.to_owned(),
        }
    }
}

/// Decodes the payload of a select answer.
pub fn parse_select_reply(p: &[u8]) -> Result<SelectView<'_>, &'static str> {
    let mut c = Cursor(p);
    let worker_id = c.u64()?;
    let dp_rank = c.u32()?;
    let request_id = c.u64()?;
    let cost = f64::from_bits(c.u64()?);
    let overlap_blocks = [c.u32()?, c.u32()?, c.u32()?];
    let provider = c.u8()? & 1 != 0;
    let n = c.u16()? as usize;
    Ok(SelectView {
        worker_id,
        dp_rank,
        request_id,
        cost,
        overlap_blocks,
        provider,
        endpoint: c.str(n)?,
    })
}

/// Encodes a select answer (borrowed, so the daemon encodes without
/// allocating).
pub fn write_select_reply(out: &mut Vec<u8>, r: &SelectView<'_>) {
    write_frame(out, status::OK, |o| {
        o.extend_from_slice(&r.worker_id.to_le_bytes());
        o.extend_from_slice(&r.dp_rank.to_le_bytes());
        o.extend_from_slice(&r.request_id.to_le_bytes());
        o.extend_from_slice(&r.cost.to_le_bytes());
        for b in r.overlap_blocks {
            o.extend_from_slice(&b.to_le_bytes());
        }
        o.push(u8::from(r.provider));
        let endpoint = &r.endpoint.as_bytes()[..r.endpoint.len().min(u16::MAX as usize)];
        o.extend_from_slice(&(endpoint.len() as u16).to_le_bytes());
        o.extend_from_slice(endpoint);
    });
}

/// Encodes an error.
pub fn write_error(out: &mut Vec<u8>, code: u16, message: &str) {
    write_frame(out, code, |o| o.extend_from_slice(message.as_bytes()));
}

/// A client of the binary protocol. It blocks in `read` by default;
/// [`Client::set_spinning`] makes it spin on a non-blocking socket instead
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

/// A call's outcome: an I/O error, or the daemon's answer, which is the
/// value or an error status with its message.
pub type Reply<T> = io::Result<Result<T, (u16, String)>>;

/// Longest reply a client accepts (a select reply is ~50 bytes plus the
/// endpoint; an error, its message).
pub const MAX_REPLY_BYTES: usize = 1 << 20;

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

    /// Spin on a non-blocking socket while waiting for replies (`true`), or
    /// block in `read` (`false`, the default).
    pub fn set_spinning(&mut self, spinning: bool) -> io::Result<()> {
        self.stream.set_nonblocking(spinning)?;
        self.spinning = spinning;
        Ok(())
    }

    /// Bounds how long a blocking client waits for a reply (`None`: forever).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.timeout = timeout;
        self.stream.set_read_timeout(timeout)?;
        self.stream.set_write_timeout(timeout)
    }

    /// Sends `out` and reads one reply frame. After an I/O error (a
    /// timeout included) the stream may be mid-frame, so the client refuses
    /// every later call: close it and connect again.
    fn round_trip(&mut self) -> io::Result<(u16, &[u8])> {
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
    pub fn attach_rings(&mut self) -> Reply<()> {
        if self.rings.is_some() {
            return Ok(Ok(()));
        }
        if self.broken {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "an earlier call failed mid-frame; reconnect",
            ));
        }
        self.out.clear();
        write_frame(&mut self.out, op::ATTACH_RINGS, |_| {});
        self.broken = true;
        send_all(&self.stream, &self.out)?;
        // The descriptors come with the reply's first byte.
        let mut fds = Vec::new();
        self.read_reply(Some(&mut fds))?;
        self.broken = false;
        let code = u16::from_le_bytes([self.body[0], self.body[1]]);
        if code != status::OK {
            return Ok(Err((
                code,
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
    pub fn rings_attached(&self) -> bool {
        self.rings.is_some()
    }

    /// `round_trip` over the rings: one record out, one back. Called with
    /// `broken` set; clears it on success.
    fn ring_round_trip(&mut self) -> io::Result<(u16, &[u8])> {
        let rings = self.rings.as_mut().expect("attached");
        match rings.requests.try_push(channel::FRAME, 0, &self.out[4..]) {
            Ok(Push::Committed { .. }) => {}
            Ok(Push::Dropped { .. }) => {
                return Err(io::Error::other(
                    "the request ring is full (the daemon stopped reading it)",
                ));
            }
            Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidInput, e)),
        }
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
            // Waiting: spin, or (blocking client) sleep on the wake eventfd
            // in slices; between them, make sure the daemon is still there.
            turns = turns.wrapping_add(1);
            if self.spinning {
                std::hint::spin_loop();
                if !turns.is_multiple_of(4096) {
                    continue;
                }
            } else {
                rings
                    .replies
                    .wait(Duration::from_micros(50), Duration::from_millis(10));
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

    /// Selects a worker. The answer borrows the client's buffer (no
    /// allocation after warm-up); an error status comes back with its
    /// message.
    pub fn select(
        &mut self,
        q: &SelectQuery<'_>,
    ) -> io::Result<Result<SelectView<'_>, (u16, &str)>> {
        self.out.clear();
        let (flag, count) = match q.ids {
            QueryIds::Hashes(h) => (0u8, h.len()),
            QueryIds::Tokens(t) => (2u8, t.len()),
        };
        let session = q.session.unwrap_or("");
        let tenant = q.tenant.unwrap_or("");
        let extended =
            q.priority != 0 || !tenant.is_empty() || !q.tags.is_empty() || !q.headers.is_empty();
        let short = |s: &str, what: &str| -> io::Result<u16> {
            u16::try_from(s.len()).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{what} is too long"))
            })
        };
        if q.tags.len() > MAX_TAGS || q.headers.len() > usize::from(u16::MAX) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "at most 32 tags and 65535 headers",
            ));
        }
        short(tenant, "tenant")?;
        for t in q.tags {
            short(t, "a tag")?;
        }
        for (n, v) in q.headers {
            short(n, "a header name")?;
            short(v, "a header value")?;
        }
        let too_long =
            |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{what} is too long"));
        let model_len = u16::try_from(q.model.len()).map_err(|_| too_long("model"))?;
        let session_len = u16::try_from(session.len()).map_err(|_| too_long("session"))?;
        let count = u32::try_from(count).map_err(|_| too_long("the prompt"))?;
        write_frame(&mut self.out, op::SELECT, |o| {
            o.push(u8::from(q.dry_run) | flag | if extended { 4 } else { 0 });
            o.push(q.role);
            o.extend_from_slice(&model_len.to_le_bytes());
            o.extend_from_slice(q.model.as_bytes());
            o.extend_from_slice(&session_len.to_le_bytes());
            o.extend_from_slice(session.as_bytes());
            o.extend_from_slice(&q.prompt_tokens.to_le_bytes());
            o.extend_from_slice(&count.to_le_bytes());
            match q.ids {
                QueryIds::Hashes(h) => {
                    for x in h {
                        o.extend_from_slice(&x.to_le_bytes());
                    }
                }
                QueryIds::Tokens(t) => {
                    for x in t {
                        o.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
            if extended {
                let put = |o: &mut Vec<u8>, s: &str| {
                    o.extend_from_slice(&(s.len() as u16).to_le_bytes());
                    o.extend_from_slice(s.as_bytes());
                };
                o.extend_from_slice(&q.priority.to_le_bytes());
                put(o, tenant);
                o.extend_from_slice(&(q.tags.len() as u16).to_le_bytes());
                for t in q.tags {
                    put(o, t);
                }
                o.extend_from_slice(&(q.headers.len() as u16).to_le_bytes());
                for (n, v) in q.headers {
                    put(o, n);
                    put(o, v);
                }
            }
        });
        let (code, p) = self.round_trip()?;
        if code != status::OK {
            return Ok(Err((
                code,
                std::str::from_utf8(p).unwrap_or("(message not UTF-8)"),
            )));
        }
        parse_select_reply(p)
            .map(Ok)
            .map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))
    }

    /// Selects a worker for a prompt given as sequence hashes (an owned
    /// answer; see [`Client::select`] for the general form).
    pub fn select_hashes(
        &mut self,
        model: &str,
        role: u8,
        hashes: &[u64],
        prompt_tokens: u32,
        dry_run: bool,
    ) -> Reply<SelectReply> {
        let q = SelectQuery {
            model,
            role,
            session: None,
            ids: QueryIds::Hashes(hashes),
            prompt_tokens,
            dry_run,
            priority: 0,
            tenant: None,
            tags: &[],
            headers: &[],
        };
        Ok(match self.select(&q)? {
            Ok(v) => Ok(v.to_owned()),
            Err((code, m)) => Err((code, m.to_owned())),
        })
    }

    /// Sends raw bytes over the socket (even with rings attached) and reads
    /// one reply frame (tests of bad input).
    pub fn raw(&mut self, bytes: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        self.out.clear();
        self.out.extend_from_slice(bytes);
        let rings = self.rings.take();
        let reply = self.round_trip().map(|(code, p)| (code, p.to_vec()));
        self.rings = rings;
        reply
    }

    /// The request's prefill is done: its prefill tokens leave the
    /// worker's projected load.
    pub fn prefill_done(&mut self, request_id: u64) -> Reply<()> {
        self.release(op::PREFILL_DONE, request_id)
    }

    /// Releases a request.
    pub fn finish(&mut self, request_id: u64) -> Reply<()> {
        self.release(op::FINISH, request_id)
    }

    fn release(&mut self, op: u16, request_id: u64) -> Reply<()> {
        self.out.clear();
        write_frame(&mut self.out, op, |o| {
            o.extend_from_slice(&request_id.to_le_bytes())
        });
        let (code, p) = self.round_trip()?;
        Ok(if code == status::OK {
            Ok(())
        } else {
            Err((code, String::from_utf8_lossy(p).into_owned()))
        })
    }
}
