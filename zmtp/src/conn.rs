//! One ZMTP connection after its handshake: the greeting and READY
//! exchanged under a deadline, then commands and messages read through
//! the capped [`Decoder`], PINGs answered, and frames written.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};

use crate::Error;
use crate::codec::{
    self, Command, Decoder, GREETING_LEN, Incoming, Limits, ProtocolError, SocketType,
};
use crate::endpoint::{PeerAddr, Stream};

/// The most bytes one read reserves: a frame is read in slices of this
/// size, so the buffer grows with what the peer has sent, not with what it
/// declared.
const READ_CHUNK: usize = 64 << 10;
/// How long a write to a peer may take (a PONG, a subscription, a
/// message) before the peer counts as gone.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the peer said of itself in its handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub addr: PeerAddr,
    pub socket_type: SocketType,
    /// The identity from its READY (may be empty).
    pub identity: Bytes,
    /// Its ZMTP minor version (3.`minor`).
    pub minor: u8,
}

/// A byte stream read through the capped decoder.
#[derive(Debug)]
pub(crate) struct Framed<S> {
    stream: S,
    buf: BytesMut,
    decoder: Decoder,
}

impl<S: AsyncRead + Unpin> Framed<S> {
    /// The next command or message, reading as needed (PINGs are the
    /// caller's to answer). Cancel-safe: what was read stays buffered.
    pub async fn next(&mut self) -> Result<Incoming, Error> {
        loop {
            if let Some(i) = self.decoder.decode(&mut self.buf)? {
                return Ok(i);
            }
            let want = self.decoder.wanted(&self.buf).min(READ_CHUNK);
            self.buf.reserve(want);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(Error::Closed);
            }
        }
    }
}

/// A connection whose handshake is done.
#[derive(Debug)]
pub(crate) struct Conn {
    framed: Framed<Stream>,
    pub peer: Peer,
    /// Answers (PONGs) not yet written: written before the next read, a
    /// slice at a time, so that [`Conn::next`] stays cancel-safe.
    pending: Vec<u8>,
}

impl Conn {
    /// Greets the peer as a socket of type `ours` and waits for its
    /// greeting and READY, all within `deadline`.
    pub async fn handshake(
        mut stream: Stream,
        addr: PeerAddr,
        ours: SocketType,
        as_server: bool,
        limits: Limits,
        deadline: Duration,
    ) -> Result<Conn, Error> {
        let run = async {
            let mut out = Vec::with_capacity(GREETING_LEN + 64);
            out.extend_from_slice(&codec::greeting(as_server));
            codec::encode_ready(&mut out, ours, b"");
            stream.write_all(&out).await?;
            let mut greeting = [0u8; GREETING_LEN];
            stream.read_exact(&mut greeting).await?;
            let minor = codec::check_greeting(&greeting)?;
            let mut conn = Conn {
                framed: Framed {
                    stream,
                    buf: BytesMut::with_capacity(1024),
                    decoder: Decoder::new(limits),
                },
                peer: Peer {
                    addr,
                    socket_type: ours,
                    identity: Bytes::new(),
                    minor,
                },
                pending: Vec::new(),
            };
            match conn.framed.next().await? {
                Incoming::Command(Command::Ready {
                    socket_type,
                    socket_name,
                    identity,
                }) => match socket_type {
                    Some(t) if ours.accepts(t) => {
                        conn.peer.socket_type = t;
                        conn.peer.identity = identity;
                        Ok(conn)
                    }
                    _ => Err(ProtocolError::SocketType {
                        ours: ours.name(),
                        theirs: if socket_name.is_empty() {
                            "nameless".into()
                        } else {
                            socket_name
                        },
                    }
                    .into()),
                },
                Incoming::Command(Command::Error(e)) => Err(ProtocolError::PeerError(e).into()),
                Incoming::Command(c) => Err(ProtocolError::NotReady(format!("{c:?}")).into()),
                Incoming::Message(_) => Err(ProtocolError::NotReady("a message".into()).into()),
            }
        };
        match tokio::time::timeout(deadline, run).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout("the handshake")),
        }
    }

    /// The next command or message after the handshake; a PING is
    /// answered here, and a peer's ERROR ends the connection. Cancel-safe:
    /// nothing read or owed is lost if the future is dropped.
    pub async fn next(&mut self) -> Result<Incoming, Error> {
        loop {
            while !self.pending.is_empty() {
                let write = self.framed.stream.write(&self.pending);
                let n = match tokio::time::timeout(WRITE_TIMEOUT, write).await {
                    Ok(n) => n?,
                    Err(_) => return Err(Error::Timeout("a write")),
                };
                if n == 0 {
                    return Err(Error::Closed);
                }
                self.pending.drain(..n);
            }
            match self.framed.next().await? {
                Incoming::Command(Command::Ping { context }) => {
                    // A peer that only pings, never reading, is cut off
                    // by the write timeout above, not by memory.
                    if self.pending.len() < 4096 {
                        codec::encode_pong(&mut self.pending, &context);
                    }
                }
                Incoming::Command(Command::Error(e)) => {
                    return Err(ProtocolError::PeerError(e).into());
                }
                Incoming::Command(Command::Ready { .. }) => {
                    return Err(ProtocolError::Malformed("second READY").into());
                }
                other => return Ok(other),
            }
        }
    }

    /// Writes bytes already encoded, within [`WRITE_TIMEOUT`].
    pub async fn write(&mut self, bytes: &[u8]) -> Result<(), Error> {
        write(&mut self.framed.stream, bytes).await
    }

    /// Writes one message.
    pub async fn send<B: AsRef<[u8]>>(&mut self, frames: &[B]) -> Result<(), Error> {
        let mut out = Vec::with_capacity(frames.iter().map(|f| f.as_ref().len() + 9).sum());
        codec::encode_message(&mut out, frames);
        self.write(&out).await
    }

    /// Reading and writing halves for a task that does both at once.
    pub fn split(self) -> (Framed<ReadHalf<Stream>>, WriteHalf<Stream>, Peer) {
        let Framed {
            stream,
            buf,
            decoder,
        } = self.framed;
        let (r, w) = tokio::io::split(stream);
        (
            Framed {
                stream: r,
                buf,
                decoder,
            },
            w,
            self.peer,
        )
    }
}

/// Writes `bytes` within [`WRITE_TIMEOUT`].
pub(crate) async fn write(
    stream: &mut (impl AsyncWrite + Unpin),
    bytes: &[u8],
) -> Result<(), Error> {
    match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(bytes)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(Error::Timeout("a write")),
    }
}
