//! The entry point shared by the cargo-fuzz target `zmtp_stream` and the
//! property tests below: any bytes as what a peer sends after its
//! greeting, cut into reads of arbitrary sizes. The decoder must never
//! panic, never hand out a message over its caps, stop at the first
//! error, and what it decodes must survive a round trip through the
//! encoder.

use bytes::BytesMut;

use crate::codec::{self, Decoder, GREETING_LEN, Incoming, Limits};

/// Small caps, so that the fuzzer reaches them.
pub const LIMITS: Limits = Limits {
    max_frame_bytes: 300,
    max_message_bytes: 600,
    max_message_frames: 5,
};

/// What the decoder made of the bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    pub greeted: bool,
    pub messages: usize,
    pub commands: usize,
    pub refused: bool,
}

/// Feeds `data` to a greeting check and a decoder: the first byte sets
/// the read size (1 to 256 bytes), the next 64 are the greeting.
pub fn decode_hostile_stream(data: &[u8]) -> Decoded {
    let mut d = Decoded::default();
    let Some((&chunk, rest)) = data.split_first() else {
        return d;
    };
    let chunk = usize::from(chunk) + 1;
    if rest.len() < GREETING_LEN {
        return d;
    }
    let (greeting, mut rest) = rest.split_at(GREETING_LEN);
    let greeting: &[u8; GREETING_LEN] = greeting.try_into().expect("64 bytes");
    d.greeted = codec::check_greeting(greeting).is_ok();
    let mut decoder = Decoder::new(LIMITS);
    let mut buf = BytesMut::new();
    while !rest.is_empty() || !buf.is_empty() {
        let take = chunk.min(rest.len());
        buf.extend_from_slice(&rest[..take]);
        rest = &rest[take..];
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(Incoming::Message(frames))) => {
                    assert!(frames.len() <= LIMITS.max_message_frames, "frame cap");
                    let total: usize = frames.iter().map(|f| f.len()).sum();
                    assert!(total <= LIMITS.max_message_bytes, "message cap");
                    assert!(frames.iter().all(|f| f.len() <= LIMITS.max_frame_bytes));
                    let mut again = Vec::new();
                    codec::encode_message(&mut again, &frames);
                    let mut other = Decoder::new(LIMITS);
                    let decoded = other.decode(&mut BytesMut::from(&again[..]));
                    assert_eq!(decoded, Ok(Some(Incoming::Message(frames))), "round trip");
                    d.messages += 1;
                }
                Ok(Some(Incoming::Command(_))) => d.commands += 1,
                Ok(None) => break,
                Err(_) => {
                    d.refused = true;
                    return d;
                }
            }
        }
        if take == 0 {
            // Input ended inside a frame.
            break;
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream(frames: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut out = vec![7];
        out.extend_from_slice(&codec::greeting(false));
        for (flags, body) in frames {
            let flags = flags & 0x05;
            if body.len() > 255 {
                out.push(flags | 0x02);
                out.extend_from_slice(&(body.len() as u64).to_be_bytes());
            } else {
                out.push(flags);
                out.push(body.len() as u8);
            }
            out.extend_from_slice(body);
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_hostile_stream(&data);
        }

        #[test]
        fn well_formed_frames_with_damage_never_panic(
            frames in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..400)), 0..12),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
            cut in any::<usize>(),
        ) {
            let mut data = stream(&frames);
            for (at, x) in flips {
                let i = 1 + at % (data.len() - 1);
                data[i] ^= x;
            }
            data.truncate(1 + cut % data.len());
            let _ = decode_hostile_stream(&data);
        }
    }

    #[test]
    fn the_entry_point_reaches_messages_commands_and_refusals() {
        let ok = stream(&[
            (1, b"topic".to_vec()),
            (0, vec![9; 200]),
            (4, b"\x04PONG".to_vec()),
        ]);
        let d = decode_hostile_stream(&ok);
        assert!(d.greeted && !d.refused);
        assert_eq!((d.messages, d.commands), (1, 1));
        let too_big = stream(&[(0, vec![0; 301])]);
        assert!(decode_hostile_stream(&too_big).refused);
    }
}
