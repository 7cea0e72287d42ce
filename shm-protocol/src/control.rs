//! The control socket between an engine and the daemon: length-prefixed
//! frames (`len: u32 | kind: u16 | version: u16` then an rkyv archive),
//! file-descriptor passing with SCM_RIGHTS, peer credentials, and both ends of
//! the registration handshake (Hello -> Welcome + ring fds, or Reject).
//!
//! The connection stays open for the life of the registration: its closing
//! (engine exit or SIGKILL) is the daemon's liveness signal, and the daemon
//! sends resync requests over it.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use rkyv::rancor;
use rkyv::ser::allocator::Arena;
use rkyv::util::AlignedVec;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::ControlError;
use crate::ring::{Consumer, Fencing, Producer};
use crate::segment::Segment;
use kvedge_schema::messages::control::{self, Hello, Reject, ResyncRequest, Welcome};
use kvedge_schema::messages::{Ser, encode};

/// Control protocol version carried in every frame.
pub const CONTROL_VERSION: u16 = 1;
/// Largest control frame payload either side accepts.
pub const MAX_CONTROL_FRAME: u32 = 64 * 1024;
const FRAME_HEADER: usize = 8;

/// One received control frame.
#[derive(Debug)]
pub struct Frame {
    pub kind: u16,
    payload: AlignedVec,
    /// Descriptors that arrived with the frame.
    pub fds: Vec<OwnedFd>,
}

impl Frame {
    /// Validated archived view of the payload.
    pub fn access<T>(&self) -> Result<&T, ControlError>
    where
        T: rkyv::Portable
            + for<'b> rkyv::bytecheck::CheckBytes<rkyv::api::low::LowValidator<'b, rancor::Error>>,
    {
        rkyv::api::low::access::<T, rancor::Error>(&self.payload).map_err(|e| {
            ControlError::Invalid {
                kind: self.kind,
                message: e.to_string(),
            }
        })
    }

    /// Validates and deserializes the payload.
    pub fn decode<T>(&self) -> Result<T, ControlError>
    where
        T: rkyv::Archive,
        T::Archived: for<'b> rkyv::bytecheck::CheckBytes<rkyv::api::low::LowValidator<'b, rancor::Error>>
            + rkyv::Deserialize<T, rkyv::api::low::LowDeserializer<rancor::Error>>,
    {
        let archived = self.access::<T::Archived>()?;
        rkyv::api::low::deserialize::<T, rancor::Error>(archived).map_err(|e| {
            ControlError::Invalid {
                kind: self.kind,
                message: e.to_string(),
            }
        })
    }
}

/// Writes one frame carrying `value`, with `fds` attached to its first byte.
pub fn write_frame<T>(
    stream: &UnixStream,
    kind: u16,
    value: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), ControlError>
where
    T: for<'a> rkyv::Serialize<Ser<'a>>,
{
    let mut payload = AlignedVec::new();
    encode(value, &mut payload, &mut Arena::new()).map_err(|e| ControlError::Invalid {
        kind,
        message: e.to_string(),
    })?;
    let len = payload.len() as u32;
    if len > MAX_CONTROL_FRAME {
        return Err(ControlError::FrameTooLarge {
            len,
            limit: MAX_CONTROL_FRAME,
        });
    }
    let mut header = [0u8; FRAME_HEADER];
    header[..4].copy_from_slice(&len.to_le_bytes());
    header[4..6].copy_from_slice(&kind.to_le_bytes());
    header[6..].copy_from_slice(&CONTROL_VERSION.to_le_bytes());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(ControlError::Io(io::Error::other("too many descriptors")));
    }
    let iov = [IoSlice::new(&header), IoSlice::new(&payload)];
    let total = header.len() + payload.len();
    let sent = rustix::net::sendmsg(stream, &iov, &mut anc, SendFlags::NOSIGNAL)
        .map_err(io::Error::from)?;
    if sent < total {
        // The descriptors went with the first byte; finish the rest plainly.
        let mut rest = Vec::with_capacity(total - sent);
        rest.extend_from_slice(&header);
        rest.extend_from_slice(&payload);
        (&*stream).write_all(&rest[sent..])?;
    }
    Ok(())
}

/// Whether a whole frame is waiting on a non-blocking stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameReady {
    /// `read_frame` will not block (it may still reject the frame).
    Ready,
    /// Part of a frame, or nothing, has arrived.
    NotYet,
    /// The peer closed the connection.
    Closed,
}

/// Peeks (without consuming) whether a whole frame has arrived, so a
/// single-threaded server reads a registration only when it cannot block on
/// a slow or hostile peer.
pub fn frame_ready(stream: &UnixStream) -> io::Result<FrameReady> {
    let flags = RecvFlags::PEEK | RecvFlags::DONTWAIT;
    let mut header = [0u8; FRAME_HEADER];
    let n = match rustix::net::recv(stream, &mut header, flags) {
        Ok((n, _)) => n,
        Err(rustix::io::Errno::AGAIN) => return Ok(FrameReady::NotYet),
        Err(e) => return Err(e.into()),
    };
    if n == 0 {
        return Ok(FrameReady::Closed);
    }
    if n < FRAME_HEADER {
        return Ok(FrameReady::NotYet);
    }
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
    if len > MAX_CONTROL_FRAME {
        return Ok(FrameReady::Ready); // read_frame rejects it at once
    }
    let total = FRAME_HEADER + len as usize;
    let mut whole = vec![0u8; total];
    match rustix::net::recv(stream, &mut whole, flags) {
        Ok((n, _)) if n >= total => Ok(FrameReady::Ready),
        Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(FrameReady::NotYet),
        Err(e) => Err(e.into()),
    }
}

/// Reads one frame, collecting any descriptors sent with it. Rejects
/// oversized frames and other protocol versions before reading the payload.
pub fn read_frame(stream: &UnixStream) -> Result<Frame, ControlError> {
    let mut header = [0u8; FRAME_HEADER];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < FRAME_HEADER {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut header[got..])];
        let msg = rustix::net::recvmsg(stream, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC)
            .map_err(io::Error::from)?;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if msg.bytes == 0 {
            return Err(ControlError::Closed);
        }
        got += msg.bytes;
    }
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
    let kind = u16::from_le_bytes(header[4..6].try_into().expect("2 bytes"));
    let version = u16::from_le_bytes(header[6..].try_into().expect("2 bytes"));
    if version != CONTROL_VERSION {
        return Err(ControlError::Version {
            found: version,
            supported: CONTROL_VERSION,
        });
    }
    if len > MAX_CONTROL_FRAME {
        return Err(ControlError::FrameTooLarge {
            len,
            limit: MAX_CONTROL_FRAME,
        });
    }
    let mut payload = AlignedVec::with_capacity(len as usize);
    payload.resize(len as usize, 0);
    (&*stream).read_exact(&mut payload).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ControlError::Closed
        } else {
            ControlError::Io(e)
        }
    })?;
    Ok(Frame { kind, payload, fds })
}

/// Kernel-reported identity of the process at the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// SO_PEERCRED of a connected Unix socket.
pub fn peer_credentials(stream: &impl AsFd) -> io::Result<PeerCred> {
    let c = rustix::net::sockopt::socket_peercred(stream)?;
    Ok(PeerCred {
        pid: c.pid.as_raw_nonzero().get() as u32,
        uid: c.uid.as_raw(),
        gid: c.gid.as_raw(),
    })
}

// ---------------------------------------------------------------- daemon side

/// Reads the Hello an engine must send first.
pub fn read_hello(stream: &UnixStream) -> Result<Hello, ControlError> {
    let frame = read_frame(stream)?;
    if frame.kind != control::kind::HELLO {
        return Err(ControlError::Unexpected {
            found: frame.kind,
            expected: "Hello",
        });
    }
    frame.decode::<Hello>()
}

/// Accepts a registration: sends Welcome with the ring memfd and wake fd.
pub fn send_welcome(
    stream: &UnixStream,
    welcome: &Welcome,
    ring: &Consumer,
) -> Result<(), ControlError> {
    write_frame(
        stream,
        control::kind::WELCOME,
        welcome,
        &[ring.segment_fd(), ring.wake_fd()],
    )
}

/// Registers an engine with no admission policy: reads its Hello, creates a
/// ring of `capacity` bytes and sends Welcome. A daemon that must check the
/// Hello first (duplicates, credentials) calls [`read_hello`] and
/// [`send_welcome`] itself.
pub fn accept_registration(
    stream: &UnixStream,
    capacity: u64,
    attach_epoch: u64,
    heartbeat_interval_ms: u32,
) -> Result<(Hello, Consumer), ControlError> {
    let hello = read_hello(stream)?;
    let ring = Consumer::create(capacity, attach_epoch)?;
    let welcome = Welcome {
        worker_id: hello.worker_id,
        dp_rank: hello.dp_rank,
        attach_epoch,
        ring_capacity: capacity,
        heartbeat_interval_ms,
    };
    send_welcome(stream, &welcome, &ring)?;
    Ok((hello, ring))
}

/// Refuses a registration with a code and a message for the engine's logs.
pub fn send_reject(stream: &UnixStream, code: u32, message: &str) -> Result<(), ControlError> {
    let reject = Reject {
        code,
        message: message.to_owned(),
    };
    write_frame(stream, control::kind::REJECT, &reject, &[])
}

/// Asks the engine for a full snapshot.
pub fn send_resync(stream: &UnixStream, request: &ResyncRequest) -> Result<(), ControlError> {
    write_frame(stream, control::kind::RESYNC_REQUEST, request, &[])
}

/// What a non-blocking peek at a control connection found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    /// The peer closed (orderly or by reset).
    Closed,
    /// Bytes are waiting.
    Readable,
    /// Open, nothing to read.
    Idle,
}

fn peek(stream: &UnixStream) -> io::Result<PeerState> {
    let mut probe = [0u8; 1];
    match rustix::net::recv(stream, &mut probe, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok((0, _)) | Err(rustix::io::Errno::CONNRESET) => Ok(PeerState::Closed),
        Ok(_) => Ok(PeerState::Readable),
        Err(rustix::io::Errno::AGAIN) => Ok(PeerState::Idle),
        Err(e) => Err(e.into()),
    }
}

/// Whether the engine closed its end (non-blocking). Pending unread bytes
/// count as open.
pub fn connection_closed(stream: &UnixStream) -> io::Result<bool> {
    Ok(peek(stream)? == PeerState::Closed)
}

// ---------------------------------------------------------------- engine side

/// The engine's end of a registration: the open control connection.
#[derive(Debug)]
pub struct ProducerSession {
    stream: UnixStream,
    welcome: Welcome,
}

impl ProducerSession {
    /// Connects to the daemon's control socket, registers with `hello`, and
    /// returns the session and the ring producer. Blocks at most `timeout`
    /// for each step.
    ///
    /// A daemon flooded with silent connections from this engine's uid
    /// closes the oldest waiting ones, which may be this one if the engine
    /// was descheduled between its connect and its Hello; it is told
    /// [`reject::DISPLACED`](kvedge_schema::messages::control::reject::DISPLACED)
    /// or finds the connection closed. Both are retried, with a short
    /// backoff, until `timeout` has passed since the first attempt; every
    /// other outcome is returned at once.
    pub fn connect(
        path: impl AsRef<Path>,
        hello: &Hello,
        timeout: Duration,
    ) -> Result<(ProducerSession, Producer), ControlError> {
        Self::connect_with(path, hello, timeout, Fencing::Asymmetric)
    }

    /// [`ProducerSession::connect`], with the ring's commits fenced as
    /// `fencing` says.
    pub fn connect_with(
        path: impl AsRef<Path>,
        hello: &Hello,
        timeout: Duration,
        fencing: Fencing,
    ) -> Result<(ProducerSession, Producer), ControlError> {
        let path = path.as_ref();
        let start = std::time::Instant::now();
        let mut backoff = Duration::from_millis(1);
        loop {
            match Self::connect_once(path, hello, timeout, fencing) {
                Err(e) if e.is_displaced() && start.elapsed() + backoff < timeout => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    fn connect_once(
        path: &Path,
        hello: &Hello,
        timeout: Duration,
        fencing: Fencing,
    ) -> Result<(ProducerSession, Producer), ControlError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        write_frame(&stream, control::kind::HELLO, hello, &[])?;
        let mut frame = read_frame(&stream)?;
        match frame.kind {
            control::kind::WELCOME => {}
            control::kind::REJECT => {
                let r = frame.decode::<Reject>()?;
                return Err(ControlError::Rejected {
                    code: r.code,
                    message: r.message,
                });
            }
            other => {
                return Err(ControlError::Unexpected {
                    found: other,
                    expected: "Welcome or Reject",
                });
            }
        }
        let welcome = frame.decode::<Welcome>()?;
        if frame.fds.len() != 2 {
            return Err(ControlError::MissingFds {
                expected: 2,
                got: frame.fds.len(),
            });
        }
        let wake = frame.fds.pop().expect("two fds");
        let memfd = frame.fds.pop().expect("two fds");
        let producer = Producer::with_fencing(Segment::open(memfd)?, Some(wake), fencing)?;
        stream.set_nonblocking(true)?;
        Ok((ProducerSession { stream, welcome }, producer))
    }

    /// What the daemon accepted.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Non-blocking check for a daemon request. `Ok(None)` when nothing is
    /// pending; [`ControlError::Closed`] when the daemon went away.
    pub fn poll(&mut self) -> Result<Option<ResyncRequest>, ControlError> {
        match peek(&self.stream)? {
            PeerState::Closed => return Err(ControlError::Closed),
            PeerState::Idle => return Ok(None),
            PeerState::Readable => {}
        }
        // A frame has started: read it whole (the daemon writes frames in one
        // call, so this does not wait on a slow peer in practice).
        self.stream.set_nonblocking(false)?;
        let frame = read_frame(&self.stream);
        self.stream.set_nonblocking(true)?;
        let frame = frame?;
        if frame.kind != control::kind::RESYNC_REQUEST {
            return Err(ControlError::Unexpected {
                found: frame.kind,
                expected: "ResyncRequest",
            });
        }
        frame.decode::<ResyncRequest>().map(Some)
    }

    /// The raw connection (for an engine that polls it with its own loop).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }
}
