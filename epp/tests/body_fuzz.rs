//! The request-body reader under hostile input, as property tests (the
//! same entry point as the cargo-fuzz target `request_body`): arbitrary
//! bytes, and real bodies with JSON's own characters put in, bytes
//! flipped, cut or appended. Every reading must agree with serde_json's
//! alone, and never panic.

#![forbid(unsafe_code)]

use kvedge_epp::fuzzing::read_hostile_body;
use proptest::prelude::*;

/// A body as clients send them: token ids, a text, or chat messages.
fn valid_body(ids: &[u32], text: &str, kind: u8) -> Vec<u8> {
    let v = match kind % 3 {
        0 => serde_json::json!({"model": "m", "stream": true, "prompt": ids, "max_tokens": 8}),
        1 => serde_json::json!({"model": "m", "prompt": text}),
        _ => serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]}),
    };
    if kind >= 128 {
        serde_json::to_vec_pretty(&v).unwrap()
    } else {
        serde_json::to_vec(&v).unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bodies_read_as_serde_json_reads_them(body in proptest::collection::vec(any::<u8>(), 0..256)) {
        read_hostile_body(&body);
    }

    #[test]
    fn damaged_bodies_read_as_serde_json_reads_them(
        ids in proptest::collection::vec(any::<u32>(), 0..40),
        text in "[a-z é\\\\\"]{0,16}",
        kind in any::<u8>(),
        inserts in proptest::collection::vec(
            (any::<usize>(), proptest::sample::select(b"0123456789,[]{}\":. -e\\".to_vec())),
            0..4,
        ),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        cut in any::<usize>(),
        tail in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut body = valid_body(&ids, &text, kind);
        read_hostile_body(&body);
        for (at, c) in inserts {
            body.insert(at % (body.len() + 1), c);
        }
        read_hostile_body(&body);
        for (at, b) in flips {
            if !body.is_empty() {
                let i = at % body.len();
                body[i] ^= b;
            }
        }
        let keep = cut % (body.len() + 1);
        body.truncate(keep.max(body.len() / 2));
        body.extend_from_slice(&tail);
        read_hostile_body(&body);
    }
}
