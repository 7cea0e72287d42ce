//! ZMTP 3.x on the wire, without I/O: the greeting, the NULL mechanism's
//! READY handshake, and frames cut into commands and messages.
//!
//! Every size a peer declares is checked against [`Limits`] when its
//! header arrives, before a byte of it is stored: a frame, a message's
//! total and its frame count each have a cap, and a peer that breaks one
//! gets a [`ProtocolError`] (its driver closes the connection). Input is
//! consumed from a `BytesMut` that the driver fills; frames are split off
//! it without copying, and [`Decoder::wanted`] says how many more bytes
//! the frame under way needs, so a read never reserves more than a peer
//! has sent.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The greeting's length: signature, version, mechanism, role, filler.
pub const GREETING_LEN: usize = 64;
/// The largest command accepted (READY's metadata, a subscription).
pub const MAX_COMMAND_BYTES: usize = 16 << 10;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The caps a peer's input is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest frame, in bytes.
    pub max_frame_bytes: usize,
    /// The largest message (all its frames), in bytes.
    pub max_message_bytes: usize,
    /// The most frames in one message.
    pub max_message_frames: usize,
}

impl Default for Limits {
    /// 4 MiB a message (a KV-event batch of thousands of blocks is about
    /// 100 KB), 16 frames.
    fn default() -> Self {
        Limits {
            max_frame_bytes: 4 << 20,
            max_message_bytes: 4 << 20,
            max_message_frames: 16,
        }
    }
}

/// Why a peer's bytes were refused; the connection ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("not a ZMTP 3 peer (its greeting's signature is wrong)")]
    Signature,
    #[error("ZMTP {0}.x is not spoken here (3.0 and later are)")]
    Version(u8),
    #[error("security mechanism `{0}` is not supported (NULL is)")]
    Mechanism(String),
    #[error("a frame of {declared} bytes, over the limit of {limit}")]
    FrameTooLarge { declared: u64, limit: usize },
    #[error("a message of over {limit} bytes")]
    MessageTooLarge { limit: usize },
    #[error("a message of over {limit} frames")]
    TooManyFrames { limit: usize },
    #[error("a command of {declared} bytes, over the limit of {MAX_COMMAND_BYTES}")]
    CommandTooLarge { declared: u64 },
    #[error("reserved frame flags {0:#04x} are set")]
    Flags(u8),
    #[error("a malformed {0} command")]
    Malformed(&'static str),
    #[error("the peer sent {0} before READY")]
    NotReady(String),
    #[error("the peer is a {theirs} socket, which a {ours} socket cannot talk to")]
    SocketType { ours: &'static str, theirs: String },
    #[error("the peer reported an error: {0}")]
    PeerError(String),
}

/// ZeroMQ's socket types, as READY names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Pair,
    Pub,
    Sub,
    Req,
    Rep,
    Dealer,
    Router,
    Pull,
    Push,
    XPub,
    XSub,
}

impl SocketType {
    pub fn name(self) -> &'static str {
        match self {
            SocketType::Pair => "PAIR",
            SocketType::Pub => "PUB",
            SocketType::Sub => "SUB",
            SocketType::Req => "REQ",
            SocketType::Rep => "REP",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
            SocketType::Pull => "PULL",
            SocketType::Push => "PUSH",
            SocketType::XPub => "XPUB",
            SocketType::XSub => "XSUB",
        }
    }

    fn parse(name: &[u8]) -> Option<SocketType> {
        use SocketType::*;
        [
            Pair, Pub, Sub, Req, Rep, Dealer, Router, Pull, Push, XPub, XSub,
        ]
        .into_iter()
        .find(|t| t.name().as_bytes() == name)
    }

    /// Whether a socket of this type may talk to one of `peer`'s (the
    /// table of the ZMTP specification).
    pub fn accepts(self, peer: SocketType) -> bool {
        use SocketType::*;
        match self {
            Pair => peer == Pair,
            Pub | XPub => matches!(peer, Sub | XSub),
            Sub | XSub => matches!(peer, Pub | XPub),
            Req => matches!(peer, Rep | Router),
            Rep => matches!(peer, Req | Dealer),
            Dealer => matches!(peer, Rep | Dealer | Router),
            Router => matches!(peer, Req | Dealer | Router),
            Pull => peer == Push,
            Push => peer == Pull,
        }
    }
}

/// Our greeting: ZMTP 3.1, the NULL mechanism.
pub fn greeting(as_server: bool) -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    // Bytes 1-8 are a ZMTP 1.0 length (an empty identity), as libzmq sends.
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = u8::from(as_server);
    g
}

/// Checks a peer's greeting; its minor version.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<u8, ProtocolError> {
    if g[0] != 0xff || g[9] & 1 == 0 {
        return Err(ProtocolError::Signature);
    }
    if g[10] < 3 {
        return Err(ProtocolError::Version(g[10]));
    }
    let mechanism = &g[12..32];
    let end = mechanism
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(mechanism.len());
    if &mechanism[..end] != b"NULL" || mechanism[end..].iter().any(|&b| b != 0) {
        return Err(ProtocolError::Mechanism(
            String::from_utf8_lossy(&mechanism[..end]).into_owned(),
        ));
    }
    Ok(if g[10] > 3 { u8::MAX } else { g[11] })
}

/// A command a peer sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The NULL handshake's one command.
    Ready {
        socket_type: Option<SocketType>,
        /// The type's name as sent, for errors.
        socket_name: String,
        identity: Bytes,
    },
    Error(String),
    Subscribe(Bytes),
    Cancel(Bytes),
    /// A heartbeat, answered with [`encode_pong`] of its context.
    Ping {
        context: Bytes,
    },
    Pong,
    /// A command this side does not use (ignored, as the spec asks).
    Other(String),
}

/// What the decoder cut out of the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    Command(Command),
    /// A whole message: its frames, in order.
    Message(Vec<Bytes>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for a frame's flags and size.
    Header,
    /// Waiting for `size` bytes of a frame.
    Body { flags: u8, size: usize },
}

/// Frames in, commands and whole messages out.
#[derive(Debug, Clone)]
pub struct Decoder {
    limits: Limits,
    state: State,
    frames: Vec<Bytes>,
    message_bytes: usize,
}

impl Decoder {
    pub fn new(limits: Limits) -> Decoder {
        Decoder {
            limits,
            state: State::Header,
            frames: Vec::new(),
            message_bytes: 0,
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// How many bytes the decoder needs before it can make progress, given
    /// what `buf` holds: the rest of a header, or the rest of a frame
    /// whose size was accepted.
    pub fn wanted(&self, buf: &BytesMut) -> usize {
        let need = match self.state {
            State::Header => match buf.first() {
                Some(f) if f & LONG != 0 => 9,
                _ => 2,
            },
            State::Body { size, .. } => size,
        };
        need.saturating_sub(buf.len()).max(1)
    }

    /// The next command or whole message in `buf`, consuming its bytes;
    /// `None` when more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Incoming>, ProtocolError> {
        loop {
            match self.state {
                State::Header => {
                    let Some(&flags) = buf.first() else {
                        return Ok(None);
                    };
                    if flags & !(MORE | LONG | COMMAND) != 0 {
                        return Err(ProtocolError::Flags(flags));
                    }
                    let (header, declared) = if flags & LONG != 0 {
                        if buf.len() < 9 {
                            return Ok(None);
                        }
                        let mut size = [0u8; 8];
                        size.copy_from_slice(&buf[1..9]);
                        (9, u64::from_be_bytes(size))
                    } else {
                        if buf.len() < 2 {
                            return Ok(None);
                        }
                        (2, u64::from(buf[1]))
                    };
                    let size = self.check(flags, declared)?;
                    buf.advance(header);
                    self.state = State::Body { flags, size };
                }
                State::Body { flags, size } => {
                    if buf.len() < size {
                        return Ok(None);
                    }
                    let body = buf.split_to(size).freeze();
                    self.state = State::Header;
                    if flags & COMMAND != 0 {
                        return parse_command(body).map(|c| Some(Incoming::Command(c)));
                    }
                    self.frames.push(body);
                    if flags & MORE == 0 {
                        self.message_bytes = 0;
                        return Ok(Some(Incoming::Message(std::mem::take(&mut self.frames))));
                    }
                }
            }
        }
    }

    /// A frame's declared size against the caps, before it is read.
    fn check(&mut self, flags: u8, declared: u64) -> Result<usize, ProtocolError> {
        if flags & COMMAND != 0 {
            if flags & MORE != 0 {
                return Err(ProtocolError::Flags(flags));
            }
            if !self.frames.is_empty() {
                return Err(ProtocolError::Malformed("interleaved"));
            }
            if declared > MAX_COMMAND_BYTES as u64 {
                return Err(ProtocolError::CommandTooLarge { declared });
            }
            return Ok(declared as usize);
        }
        let limits = &self.limits;
        if declared > limits.max_frame_bytes as u64 {
            return Err(ProtocolError::FrameTooLarge {
                declared,
                limit: limits.max_frame_bytes,
            });
        }
        let size = declared as usize;
        if self.frames.len() >= limits.max_message_frames {
            return Err(ProtocolError::TooManyFrames {
                limit: limits.max_message_frames,
            });
        }
        if self.message_bytes + size > limits.max_message_bytes {
            return Err(ProtocolError::MessageTooLarge {
                limit: limits.max_message_bytes,
            });
        }
        self.message_bytes += size;
        Ok(size)
    }
}

/// A command's name and data.
fn parse_command(mut body: Bytes) -> Result<Command, ProtocolError> {
    let Some(&len) = body.first() else {
        return Err(ProtocolError::Malformed("empty"));
    };
    let len = usize::from(len);
    if body.len() < 1 + len {
        return Err(ProtocolError::Malformed("name of a"));
    }
    let name = body.slice(1..1 + len);
    body.advance(1 + len);
    Ok(match &name[..] {
        b"READY" => ready(body)?,
        b"ERROR" => {
            let reason = match body.first() {
                Some(&n) if body.len() > usize::from(n) => &body[1..1 + usize::from(n)],
                _ => &body[..0],
            };
            Command::Error(String::from_utf8_lossy(reason).into_owned())
        }
        b"SUBSCRIBE" => Command::Subscribe(body),
        b"CANCEL" => Command::Cancel(body),
        b"PING" => {
            if body.len() < 2 || body.len() > 2 + 16 {
                return Err(ProtocolError::Malformed("PING"));
            }
            Command::Ping {
                context: body.slice(2..),
            }
        }
        b"PONG" => Command::Pong,
        other => Command::Other(String::from_utf8_lossy(other).into_owned()),
    })
}

/// READY's metadata: `Socket-Type` and `Identity` (others are ignored).
fn ready(mut data: Bytes) -> Result<Command, ProtocolError> {
    let mut socket_name = String::new();
    let mut socket_type = None;
    let mut identity = Bytes::new();
    while !data.is_empty() {
        let n = usize::from(data[0]);
        if data.len() < 1 + n + 4 {
            return Err(ProtocolError::Malformed("READY"));
        }
        let name = data.slice(1..1 + n);
        let mut len = [0u8; 4];
        len.copy_from_slice(&data[1 + n..1 + n + 4]);
        let len = u32::from_be_bytes(len) as usize;
        let start = 1 + n + 4;
        if data.len() - start < len {
            return Err(ProtocolError::Malformed("READY"));
        }
        let value = data.slice(start..start + len);
        data.advance(start + len);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = SocketType::parse(&value);
            socket_name = String::from_utf8_lossy(&value).into_owned();
        } else if name.eq_ignore_ascii_case(b"Identity") {
            identity = value;
        }
    }
    Ok(Command::Ready {
        socket_type,
        socket_name,
        identity,
    })
}

fn put_header(out: &mut impl BufMut, flags: u8, len: usize) {
    if len > 255 {
        out.put_u8(flags | LONG);
        out.put_u64(len as u64);
    } else {
        out.put_u8(flags);
        out.put_u8(len as u8);
    }
}

fn put_command(out: &mut impl BufMut, name: &[u8], data: &[&[u8]]) {
    let len = 1 + name.len() + data.iter().map(|d| d.len()).sum::<usize>();
    put_header(out, COMMAND, len);
    out.put_u8(name.len() as u8);
    out.put_slice(name);
    for d in data {
        out.put_slice(d);
    }
}

/// READY for a socket of type `ours` (with `identity`, which a ROUTER
/// peer uses to address us; empty lets it choose).
pub fn encode_ready(out: &mut impl BufMut, ours: SocketType, identity: &[u8]) {
    let mut meta = Vec::with_capacity(64);
    for (name, value) in [
        (&b"Socket-Type"[..], ours.name().as_bytes()),
        (b"Identity", identity),
    ] {
        if name == b"Identity" && matches!(ours, SocketType::Pub | SocketType::Sub) {
            continue;
        }
        meta.push(name.len() as u8);
        meta.extend_from_slice(name);
        meta.extend_from_slice(&(value.len() as u32).to_be_bytes());
        meta.extend_from_slice(value);
    }
    put_command(out, b"READY", &[&meta]);
}

/// PONG, the answer to a PING with `context`.
pub fn encode_pong(out: &mut impl BufMut, context: &[u8]) {
    put_command(out, b"PONG", &[context]);
}

/// A message of `frames` (at least one; an empty slice sends one empty
/// frame).
pub fn encode_message<B: AsRef<[u8]>>(out: &mut impl BufMut, frames: &[B]) {
    if frames.is_empty() {
        put_header(out, 0, 0);
        return;
    }
    for (i, f) in frames.iter().enumerate() {
        let f = f.as_ref();
        let flags = if i + 1 < frames.len() { MORE } else { 0 };
        put_header(out, flags, f.len());
        out.put_slice(f);
    }
}

/// A subscription to `topic` as a SUB sends it: the message form (a
/// frame of 0x01 and the topic), which every ZMTP 3 publisher reads.
pub fn encode_subscription(out: &mut impl BufMut, topic: &[u8]) {
    put_header(out, 0, 1 + topic.len());
    out.put_u8(1);
    out.put_slice(topic);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(d: &mut Decoder, bytes: &[u8]) -> Result<Vec<Incoming>, ProtocolError> {
        let mut buf = BytesMut::from(bytes);
        let mut out = Vec::new();
        while let Some(i) = d.decode(&mut buf)? {
            out.push(i);
        }
        Ok(out)
    }

    #[test]
    fn greetings_are_checked() {
        assert_eq!(check_greeting(&greeting(false)), Ok(1));
        let mut g = greeting(true);
        g[0] = 0;
        assert_eq!(check_greeting(&g), Err(ProtocolError::Signature));
        let mut g = greeting(true);
        g[10] = 2;
        assert_eq!(check_greeting(&g), Err(ProtocolError::Version(2)));
        let mut g = greeting(true);
        g[12..17].copy_from_slice(b"CURVE");
        assert_eq!(
            check_greeting(&g),
            Err(ProtocolError::Mechanism("CURVE".into()))
        );
    }

    #[test]
    fn messages_and_commands_round_trip() {
        let mut out = Vec::new();
        encode_ready(&mut out, SocketType::Dealer, b"me");
        encode_message(&mut out, &[&b"topic"[..], &[7u8; 300][..], b""]);
        encode_pong(&mut out, b"ctx");
        let mut d = Decoder::new(Limits::default());
        let got = decode_all(&mut d, &out).unwrap();
        assert_eq!(
            got[0],
            Incoming::Command(Command::Ready {
                socket_type: Some(SocketType::Dealer),
                socket_name: "DEALER".into(),
                identity: Bytes::from_static(b"me"),
            })
        );
        assert_eq!(
            got[1],
            Incoming::Message(vec![
                Bytes::from_static(b"topic"),
                Bytes::from(vec![7u8; 300]),
                Bytes::new()
            ])
        );
        assert_eq!(got[2], Incoming::Command(Command::Pong));
    }

    #[test]
    fn a_huge_declared_frame_is_refused_at_its_header() {
        let mut d = Decoder::new(Limits::default());
        // A long frame declaring 200 GB, and nothing after it.
        let mut bytes = vec![LONG];
        bytes.extend_from_slice(&200_000_000_000u64.to_be_bytes());
        let mut buf = BytesMut::from(&bytes[..]);
        assert_eq!(
            d.decode(&mut buf),
            Err(ProtocolError::FrameTooLarge {
                declared: 200_000_000_000,
                limit: 4 << 20
            })
        );
        let mut bytes = vec![COMMAND | LONG];
        bytes.extend_from_slice(&u64::MAX.to_be_bytes());
        assert!(matches!(
            Decoder::new(Limits::default()).decode(&mut BytesMut::from(&bytes[..])),
            Err(ProtocolError::CommandTooLarge { .. })
        ));
    }

    #[test]
    fn a_message_is_capped_in_frames_and_bytes() {
        let limits = Limits {
            max_frame_bytes: 100,
            max_message_bytes: 250,
            max_message_frames: 4,
        };
        // Endless MORE frames: refused at the fifth header.
        let mut bytes = Vec::new();
        for _ in 0..10 {
            bytes.extend_from_slice(&[MORE, 1, b'x']);
        }
        assert_eq!(
            decode_all(&mut Decoder::new(limits), &bytes),
            Err(ProtocolError::TooManyFrames { limit: 4 })
        );
        // Three frames of 100 bytes: the third breaks the message's cap.
        let mut bytes = Vec::new();
        for _ in 0..3 {
            bytes.extend_from_slice(&[MORE, 100]);
            bytes.extend_from_slice(&[0; 100]);
        }
        assert_eq!(
            decode_all(&mut Decoder::new(limits), &bytes),
            Err(ProtocolError::MessageTooLarge { limit: 250 })
        );
        // Within the caps, the count starts again with each message.
        let mut bytes = Vec::new();
        for _ in 0..3 {
            encode_message(&mut bytes, &[[0u8; 100], [0u8; 100]]);
        }
        assert_eq!(
            decode_all(&mut Decoder::new(limits), &bytes).unwrap().len(),
            3
        );
    }

    #[test]
    fn wanted_never_exceeds_what_the_header_declared() {
        let mut d = Decoder::new(Limits::default());
        let mut buf = BytesMut::new();
        assert_eq!(d.wanted(&buf), 2);
        buf.put_u8(LONG);
        assert_eq!(d.wanted(&buf), 8);
        buf.put_u64(1000);
        assert_eq!(d.decode(&mut buf), Ok(None));
        assert_eq!(d.wanted(&buf), 1000);
        buf.put_slice(&[0; 400]);
        assert_eq!(d.wanted(&buf), 600);
    }

    #[test]
    fn malformed_commands_and_reserved_flags_are_errors() {
        let mut d = Decoder::new(Limits::default());
        assert_eq!(
            decode_all(&mut d, &[0x80, 0]),
            Err(ProtocolError::Flags(0x80))
        );
        // READY whose property claims more bytes than it has.
        let bad = [
            COMMAND, 12, 5, b'R', b'E', b'A', b'D', b'Y', 1, b'a', 0, 0, 0, 9,
        ];
        assert_eq!(
            decode_all(&mut Decoder::new(Limits::default()), &bad),
            Err(ProtocolError::Malformed("READY"))
        );
        // A command inside a multi-frame message.
        let mut bytes = vec![MORE, 1, b'x'];
        encode_pong(&mut bytes, b"");
        assert_eq!(
            decode_all(&mut Decoder::new(Limits::default()), &bytes),
            Err(ProtocolError::Malformed("interleaved"))
        );
    }

    #[test]
    fn socket_types_pair_as_the_specification_says() {
        use SocketType::*;
        assert!(Sub.accepts(Pub) && Sub.accepts(XPub) && !Sub.accepts(Dealer));
        assert!(Dealer.accepts(Router) && !Dealer.accepts(Pub));
        assert!(Router.accepts(Dealer) && Pub.accepts(Sub));
        assert_eq!(SocketType::parse(b"ROUTER"), Some(Router));
        assert_eq!(SocketType::parse(b"nonsense"), None);
    }
}
