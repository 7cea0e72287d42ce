//! The binary query decoder under hostile input, as property tests (the
//! same entry point as the cargo-fuzz target `binary_request`): arbitrary
//! frame bodies, and valid requests with bytes flipped, cut or appended.
//! The decoder answers with a request that round-trips or an error reply,
//! never a panic.

#![forbid(unsafe_code)]

use kvedge_wire::fuzzing::{Decoded, decode_hostile_request};
use kvedge_wire::{Ids, Request, Role, Select, binary};
use proptest::prelude::*;

fn valid_frame(hashes: &[u64], tenant: &str, priority: i32, op: u8) -> Vec<u8> {
    let mut s = Select::new("model", Role::Prefill, Ids::hashes(hashes));
    s.tenant = (!tenant.is_empty()).then_some(tenant);
    s.priority = priority;
    s.dry_run = op.is_multiple_of(2);
    let request = match op % 4 {
        0 | 1 => Request::Select(s),
        2 => Request::Finish {
            request_id: u64::from(op),
        },
        _ => Request::PrefillDone {
            request_id: u64::from(op),
        },
    };
    let mut out = Vec::new();
    binary::encode_request(&mut out, &request).unwrap();
    out.split_off(4)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_hostile_request(&body);
    }

    #[test]
    fn damaged_valid_frames_never_panic(
        hashes in proptest::collection::vec(any::<u64>(), 0..40),
        tenant in "[a-z]{0,12}",
        priority in any::<i32>(),
        op in any::<u8>(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in any::<usize>(),
        tail in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let mut body = valid_frame(&hashes, &tenant, priority, op);
        prop_assert_eq!(decode_hostile_request(&body), Decoded::Request);
        for (at, b) in flips {
            if !body.is_empty() {
                let i = at % body.len();
                body[i] ^= b;
            }
        }
        let keep = cut % (body.len() + 1);
        body.truncate(keep.max(body.len() / 2));
        body.extend_from_slice(&tail);
        let _ = decode_hostile_request(&body);
    }
}
