//! Entry point shared by the cargo-fuzz target and the property tests of
//! the binary query decoder: any bytes as a frame body from a client. The
//! decoder must return a request or an error reply, never panic or read
//! past the body; and what it decodes must survive a round trip (encoded,
//! decoded and encoded again, it gives the same bytes).

use crate::binary::{decode_request, encode_request};

/// What the decoder made of the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A request, which round-tripped.
    Request,
    /// An error reply (bad input).
    Refused,
}

/// Decodes `body` as a binary request frame's body; panics only if a
/// decoded request does not round-trip (a bug the fuzzer should find).
pub fn decode_hostile_request(body: &[u8]) -> Decoded {
    let Ok(request) = decode_request(body) else {
        return Decoded::Refused;
    };
    let mut frame = Vec::new();
    if encode_request(&mut frame, &request).is_err() {
        // Decodable yet not encodable would be a bug.
        panic!("decoded {request:?} but cannot encode it");
    }
    let again = decode_request(&frame[4..]).expect("a re-encoded request decodes");
    let mut twice = Vec::new();
    encode_request(&mut twice, &again).expect("encodes");
    assert_eq!(frame, twice, "the request survives a round trip");
    Decoded::Request
}
