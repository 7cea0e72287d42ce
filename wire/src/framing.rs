//! How a query connection's bytes become requests, for every driver that
//! serves one: the first bytes choose the protocol (`KVE1`: binary frames,
//! anything else: JSON lines), then each complete request is cut out of
//! the buffer, and a request that cannot fit the frame limit is refused.

use crate::Status;
use crate::binary::{MAGIC, write_error};

/// A connection's protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Not decided yet: fewer than 4 bytes that could still be the magic.
    Unknown,
    Json,
    Binary,
}

/// Decides `mode` once `buf` shows which protocol it is, removing the
/// binary magic from `buf`.
#[inline]
pub fn detect(mode: &mut Mode, buf: &mut Vec<u8>) {
    if *mode != Mode::Unknown || buf.is_empty() {
        return;
    }
    if buf.starts_with(MAGIC) {
        *mode = Mode::Binary;
        buf.drain(..MAGIC.len());
    } else if buf.len() >= MAGIC.len() || !MAGIC.starts_with(buf) {
        *mode = Mode::Json;
    }
}

/// What the front of a buffer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// A request: its body is `buf[body]` (a JSON line without its newline,
    /// or a binary frame after its length); `used` bytes are consumed.
    Request {
        body: std::ops::Range<usize>,
        used: usize,
    },
    /// Not a whole request yet (or the mode is undecided).
    NeedMore,
    /// Longer than the frame limit: answer [`too_large`] and close.
    TooLarge,
}

/// The next request at the front of `buf`.
#[inline]
pub fn next(mode: Mode, buf: &[u8], limit: usize) -> Next {
    match mode {
        Mode::Unknown => Next::NeedMore,
        Mode::Binary => {
            if buf.len() < 4 {
                return Next::NeedMore;
            }
            let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
            if len > limit {
                Next::TooLarge
            } else if buf.len() < 4 + len {
                Next::NeedMore
            } else {
                Next::Request {
                    body: 4..4 + len,
                    used: 4 + len,
                }
            }
        }
        Mode::Json => match buf.iter().position(|&b| b == b'\n') {
            Some(pos) => Next::Request {
                body: 0..pos,
                used: pos + 1,
            },
            None if buf.len() > limit => Next::TooLarge,
            None => Next::NeedMore,
        },
    }
}

/// The reply to a request over the frame limit, in the connection's
/// protocol (written by hand: JSON lines need no serializer for it).
pub fn too_large(mode: Mode, limit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    match mode {
        Mode::Binary => write_error(
            &mut out,
            Status::FrameTooLarge,
            &format!("a frame is longer than {limit} bytes"),
        ),
        Mode::Json | Mode::Unknown => out.extend_from_slice(
            format!(
                "{{\"error\":{{\"code\":\"{}\",\"message\":\"a request line is longer than {limit} bytes\"}}}}\n",
                Status::FrameTooLarge.name()
            )
            .as_bytes(),
        ),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bytes_choose_the_protocol() {
        let mut mode = Mode::Unknown;
        let mut buf = b"KV".to_vec();
        detect(&mut mode, &mut buf);
        assert_eq!(mode, Mode::Unknown, "could still be the magic");
        buf.extend_from_slice(b"E1\x05");
        detect(&mut mode, &mut buf);
        assert_eq!((mode, &buf[..]), (Mode::Binary, &b"\x05"[..]));
        let mut mode = Mode::Unknown;
        let mut buf = b"{\"op\"".to_vec();
        detect(&mut mode, &mut buf);
        assert_eq!(mode, Mode::Json);
    }

    #[test]
    fn requests_are_cut_whole_and_oversized_ones_refused() {
        assert_eq!(
            next(Mode::Json, b"ab\ncd", 10),
            Next::Request {
                body: 0..2,
                used: 3
            }
        );
        assert_eq!(next(Mode::Json, b"abcd", 10), Next::NeedMore);
        assert_eq!(next(Mode::Json, &[b'x'; 11], 10), Next::TooLarge);
        let mut frame = 3u32.to_le_bytes().to_vec();
        frame.extend_from_slice(b"abc");
        assert_eq!(
            next(Mode::Binary, &frame, 10),
            Next::Request {
                body: 4..7,
                used: 7
            }
        );
        assert_eq!(next(Mode::Binary, &frame[..5], 10), Next::NeedMore);
        assert_eq!(next(Mode::Binary, &11u32.to_le_bytes(), 10), Next::TooLarge);
        assert_eq!(next(Mode::Unknown, b"anything\n", 10), Next::NeedMore);
    }
}
