//! The feed's state machine in isolation: sequence numbers, gaps, replays
//! and restarts, and input built to hurt it.

#![forbid(unsafe_code)]

mod common;

use common::{Out, Recorder, batch, raw_batch, removed, stored};
use kvedge_bridge::decode::Decoder;
use kvedge_bridge::feed::{Feed, Live, Sender};
use kvedge_bridge::translate::Translator;
use kvedge_schema::messages::notice;
use proptest::prelude::*;

/// The engine's own publisher, dialled by kvedge.
const ENGINE: Sender = Sender {
    peer: 1,
    trusted: true,
};

fn block(first: u32) -> Vec<u32> {
    (first..first + 4).collect()
}

fn one_block(engine_hash: u64, parent: Option<u64>) -> Vec<u8> {
    batch(&[stored(
        &[engine_hash],
        parent,
        &block(engine_hash as u32 * 4),
        4,
    )])
}

#[test]
fn in_order_batches_apply() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    assert_eq!(
        feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out),
        Live::Applied
    );
    assert_eq!(
        feed.handle_live(ENGINE, 1, &one_block(2, Some(1)), &mut out),
        Live::Applied
    );
    assert_eq!(feed.translator().len(), 2);
    assert_eq!(feed.last(), Some(1));
}

#[test]
fn a_gap_is_replayed_and_the_waiting_message_applied_after() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    // 1 and 2 were lost in transit; 3 shows the gap.
    assert_eq!(
        feed.handle_live(ENGINE, 3, &one_block(4, Some(3)), &mut out),
        Live::Replay { from: 1 }
    );
    assert!(feed.replaying());
    feed.handle_replayed(1, &one_block(2, Some(1)), &mut out);
    feed.handle_replayed(2, &one_block(3, Some(2)), &mut out);
    // The replay socket also has 3 (the live stream's copy wins).
    feed.handle_replayed(3, &one_block(4, Some(3)), &mut out);
    feed.handle_replay_end(true, &mut out);
    assert_eq!(feed.last(), Some(3));
    assert_eq!(feed.translator().len(), 4, "every block, parents known");
    assert_eq!(feed.counts().replayed, 2);
    assert_eq!(feed.counts().lost, 0);
    assert!(!out.0.contains(&Out::Cleared));
}

#[test]
fn a_gap_without_replay_drops_the_state() {
    let mut feed = Feed::new(4, 1000, false);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    assert_eq!(
        feed.handle_live(ENGINE, 5, &one_block(9, None), &mut out),
        Live::Applied
    );
    assert_eq!(out.0.iter().filter(|o| **o == Out::Cleared).count(), 1);
    assert_eq!(feed.counts().lost, 1);
    assert_eq!(feed.translator().len(), 1, "only what came after the loss");
    assert!(
        feed.take_log()
            .any(|(_, l)| l.contains("4 event batches were lost"))
    );
}

#[test]
fn a_replay_that_does_not_answer_or_cover_drops_the_state() {
    for complete in [false, true] {
        let mut feed = Feed::new(4, 1000, true);
        let mut out = Recorder::default();
        feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
        assert_eq!(
            feed.handle_live(ENGINE, 4, &one_block(9, None), &mut out),
            Live::Replay { from: 1 }
        );
        // The buffer has lost 1 and 2: it starts at 3.
        if complete {
            feed.handle_replayed(3, &one_block(8, None), &mut out);
        }
        feed.handle_replay_end(complete, &mut out);
        assert_eq!(feed.counts().lost, 1, "complete={complete}");
        assert!(out.0.contains(&Out::Cleared));
        assert_eq!(feed.last(), Some(4));
    }
}

#[test]
fn a_sequence_going_back_is_a_restart_without_a_replay_socket() {
    let mut feed = Feed::new(4, 1000, false);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    feed.handle_live(ENGINE, 1, &one_block(2, Some(1)), &mut out);
    assert_eq!(
        feed.handle_live(ENGINE, 0, &one_block(7, None), &mut out),
        Live::Applied
    );
    assert_eq!(feed.counts().restarts, 1);
    assert!(out.0.contains(&Out::Cleared));
    assert_eq!(feed.translator().len(), 1);
}

#[test]
fn a_restart_is_taken_once_the_replay_socket_confirms_it() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    feed.handle_live(ENGINE, 1, &one_block(2, Some(1)), &mut out);
    // Number 0 again: the replay socket is asked from the last number.
    assert_eq!(
        feed.handle_live(ENGINE, 0, &one_block(7, None), &mut out),
        Live::Replay { from: 1 }
    );
    assert_eq!(feed.counts().restarts, 0, "not before the replay says so");
    assert!(!out.0.contains(&Out::Cleared));
    // A restarted engine's buffer holds nothing from 1 on.
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.counts().restarts, 1);
    assert!(out.0.contains(&Out::Cleared));
    assert_eq!(feed.translator().len(), 1);
    assert_eq!(feed.last(), Some(0));

    // Its buffer holds a different batch under the last number: restarted
    // too (and it has come that far since).
    feed.handle_live(ENGINE, 1, &one_block(8, Some(7)), &mut out);
    assert_eq!(
        feed.handle_live(ENGINE, 0, &one_block(20, None), &mut out),
        Live::Replay { from: 1 }
    );
    feed.handle_replayed(1, &one_block(30, None), &mut out);
    feed.handle_replayed(2, &one_block(31, None), &mut out);
    // History from 0 follows, as for any first message... but 0 is the
    // pending one, so it applies at once.
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.counts().restarts, 2);
}

#[test]
fn a_stale_number_the_replay_disowns_changes_nothing() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    let second = one_block(2, Some(1));
    feed.handle_live(ENGINE, 1, &second, &mut out);
    // A wiping batch numbered 0 (a stranger's, or an old one).
    assert_eq!(
        feed.handle_live(ENGINE, 0, &raw_batch(&[]), &mut out),
        Live::Replay { from: 1 }
    );
    // The engine's buffer still holds batch 1, the same bytes.
    feed.handle_replayed(1, &second, &mut out);
    feed.handle_replayed(2, &one_block(3, Some(2)), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Ignored);
    assert_eq!(feed.counts().stale, 1);
    assert_eq!(feed.counts().restarts, 0);
    assert!(!out.0.contains(&Out::Cleared));
    assert_eq!(feed.translator().len(), 2);
    assert_eq!(feed.last(), Some(1));
    // The stream goes on from where it was.
    assert_eq!(
        feed.handle_live(ENGINE, 2, &one_block(3, Some(2)), &mut out),
        Live::Applied
    );
    // A buffer that has moved past the last number (but no longer holds
    // it) also shows the engine did not restart.
    assert_eq!(
        feed.handle_live(ENGINE, 0, &raw_batch(&[]), &mut out),
        Live::Replay { from: 2 }
    );
    feed.handle_replayed(9, &one_block(9, None), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Ignored);
    assert_eq!(feed.counts().stale, 2);
    assert_eq!(feed.translator().len(), 3);
}

#[test]
fn one_source_at_a_time_and_strangers_are_ignored() {
    let mut feed = Feed::new(4, 1000, false);
    let mut out = Recorder::default();
    let a = Sender {
        peer: 7,
        trusted: false,
    };
    let stranger = Sender {
        peer: 8,
        trusted: false,
    };
    assert_eq!(
        feed.handle_live(a, 0, &one_block(1, None), &mut out),
        Live::Applied
    );
    // The next number with invented blocks, and a wiping number 0.
    assert_eq!(
        feed.handle_live(stranger, 1, &one_block(66, None), &mut out),
        Live::Ignored
    );
    assert_eq!(
        feed.handle_live(stranger, 0, &raw_batch(&[]), &mut out),
        Live::Ignored
    );
    feed.handle_malformed(stranger, "a message of 1 frames");
    assert_eq!(feed.counts().foreign, 3);
    assert_eq!(feed.translator().len(), 1);
    assert!(!out.0.contains(&Out::Cleared));
    // When the source leaves, the next peer to send takes its place.
    feed.handle_left(a.peer);
    assert_eq!(
        feed.handle_live(stranger, 1, &one_block(2, Some(1)), &mut out),
        Live::Applied
    );
    assert_eq!(
        feed.handle_live(a, 2, &one_block(3, Some(2)), &mut out),
        Live::Ignored
    );
}

#[test]
fn a_new_publisher_is_vouched_for_by_the_replay_socket() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    let peer = |p| Sender {
        peer: p,
        trusted: false,
    };
    let first = one_block(1, None);
    // A publisher that connected to kvedge: its batch waits for the
    // replay socket, asked from its own number.
    assert_eq!(
        feed.handle_live(peer(3), 5, &first, &mut out),
        Live::Replay { from: 5 }
    );
    assert!(out.0.is_empty());
    feed.handle_replayed(5, &first, &mut out);
    // Vouched for; as a first message it then asks for history.
    assert_eq!(
        feed.handle_replay_end(true, &mut out),
        Live::Replay { from: 0 }
    );
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.translator().len(), 1);
    assert_eq!(
        feed.handle_live(peer(3), 6, &one_block(2, Some(1)), &mut out),
        Live::Applied,
        "no replay once vouched for"
    );
    // The source leaves; a peer whose batch the engine does not hold is
    // disowned, and ignored from then on without asking again.
    feed.handle_left(3);
    assert_eq!(
        feed.handle_live(peer(4), 7, &one_block(66, Some(2)), &mut out),
        Live::Replay { from: 7 }
    );
    feed.handle_replayed(7, &one_block(3, Some(2)), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Ignored);
    assert_eq!(
        feed.handle_live(peer(4), 8, &one_block(67, Some(66)), &mut out),
        Live::Ignored
    );
    assert_eq!(feed.counts().foreign, 2);
    // A replay socket that does not answer vouches for no one.
    assert_eq!(
        feed.handle_live(peer(5), 7, &one_block(3, Some(2)), &mut out),
        Live::Replay { from: 7 }
    );
    assert_eq!(feed.handle_replay_end(false, &mut out), Live::Ignored);
    assert_eq!(feed.counts().unverified, 1);
    assert_eq!(feed.translator().len(), 2, "strangers added nothing");
}

#[test]
fn connecting_again_catches_up_or_finds_a_restart() {
    // At start, the history.
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    assert_eq!(feed.handle_connected(), Live::Replay { from: 0 });
    feed.handle_replayed(0, &one_block(1, None), &mut out);
    feed.handle_replayed(1, &one_block(2, Some(1)), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.translator().len(), 2);
    assert_eq!(feed.last(), Some(1));
    // Connected again: the buffer holds batch 1 as kvedge applied it,
    // and two more that passed while the connection was down.
    assert_eq!(feed.handle_connected(), Live::Replay { from: 1 });
    feed.handle_replayed(1, &one_block(2, Some(1)), &mut out);
    feed.handle_replayed(2, &one_block(3, Some(2)), &mut out);
    feed.handle_replayed(3, &one_block(4, Some(3)), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.last(), Some(3));
    assert_eq!(feed.translator().len(), 4);
    assert_eq!(feed.counts().restarts, 0);
    // Connected again after a restart: the buffer holds a different batch
    // under number 3, so everything goes and the history is asked anew.
    assert_eq!(feed.handle_connected(), Live::Replay { from: 3 });
    feed.handle_replayed(3, &one_block(9, None), &mut out);
    assert_eq!(
        feed.handle_replay_end(true, &mut out),
        Live::Replay { from: 0 }
    );
    assert_eq!(feed.counts().restarts, 1);
    assert!(out.0.contains(&Out::Cleared));
    feed.handle_replayed(0, &one_block(9, None), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.translator().len(), 1);
    // A restart whose new process has not come as far: nothing at or
    // after the last number.
    assert_eq!(feed.handle_connected(), Live::Replay { from: 0 });
    assert_eq!(
        feed.handle_replay_end(true, &mut out),
        Live::Replay { from: 0 }
    );
    assert_eq!(feed.counts().restarts, 2);
    // No answer: nothing is concluded.
    assert_eq!(feed.handle_replay_end(false, &mut out), Live::Applied);
    assert_eq!(feed.counts().restarts, 2);
    // Without a replay socket there is nothing to ask.
    assert_eq!(Feed::new(4, 1000, false).handle_connected(), Live::Applied);
}

#[test]
fn an_engine_not_yet_running_at_start_loses_nothing_and_is_asked_later() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    // kvedge starts first: nothing answers at the replay socket.
    assert_eq!(feed.handle_connected(), Live::Replay { from: 0 });
    assert_eq!(feed.handle_replay_unreachable(&mut out), Live::Applied);
    assert_eq!(feed.counts().lost, 0, "no history existed to lose");
    assert!(!feed.replaying());
    // The engine comes up; its first batches pass before kvedge
    // subscribes: the first one heard asks for the history, which brings
    // them.
    assert_eq!(
        feed.handle_live(ENGINE, 2, &one_block(3, Some(2)), &mut out),
        Live::Replay { from: 0 }
    );
    feed.handle_replayed(0, &one_block(1, None), &mut out);
    feed.handle_replayed(1, &one_block(2, Some(1)), &mut out);
    assert_eq!(feed.handle_replay_end(true, &mut out), Live::Applied);
    assert_eq!(feed.translator().len(), 3);
    assert_eq!(feed.counts().lost, 0);
    // Connected again later: the same engine's replay socket gone is an
    // incomplete catch-up, not a fresh start.
    assert_eq!(feed.handle_connected(), Live::Replay { from: 2 });
    assert_eq!(feed.handle_replay_unreachable(&mut out), Live::Applied);
    assert_eq!(feed.translator().len(), 3, "kept: nothing shows a restart");
    assert_eq!(feed.counts().restarts, 0);
    // An unanswered history at start is still counted.
    let mut other = Feed::new(4, 1000, true);
    assert_eq!(other.handle_connected(), Live::Replay { from: 0 });
    assert_eq!(other.handle_replay_end(false, &mut out), Live::Applied);
    assert_eq!(other.counts().lost, 1);
}

#[test]
fn the_first_message_asks_for_history() {
    let mut feed = Feed::new(4, 1000, true);
    let mut out = Recorder::default();
    assert_eq!(
        feed.handle_live(ENGINE, 10, &one_block(5, Some(4)), &mut out),
        Live::Replay { from: 0 }
    );
    feed.handle_replayed(8, &one_block(3, None), &mut out);
    feed.handle_replayed(9, &one_block(4, Some(3)), &mut out);
    feed.handle_replay_end(true, &mut out);
    assert_eq!(feed.translator().len(), 3, "history before kvedge started");
    assert_eq!(feed.counts().lost, 0, "history is not a loss");
}

#[test]
fn hostile_payloads_are_counted_and_change_nothing() {
    let mut feed = Feed::new(4, 1000, false);
    let mut out = Recorder::default();
    feed.handle_live(ENGINE, 0, &one_block(1, None), &mut out);
    let good = one_block(1, None);
    let mut wrong_types = Vec::new(); // ["a string for ts", []]
    rmp::encode::write_array_len(&mut wrong_types, 2).unwrap();
    rmp::encode::write_str(&mut wrong_types, "noon").unwrap();
    rmp::encode::write_array_len(&mut wrong_types, 0).unwrap();
    let mut events_not_list = Vec::new();
    rmp::encode::write_array_len(&mut events_not_list, 2).unwrap();
    rmp::encode::write_f64(&mut events_not_list, 1.0).unwrap();
    rmp::encode::write_str(&mut events_not_list, "no").unwrap();
    let mut huge = Vec::new();
    rmp::encode::write_array_len(&mut huge, 2).unwrap();
    rmp::encode::write_f64(&mut huge, 1.0).unwrap();
    huge.extend([0xdd, 0xff, 0xff, 0xff, 0xff]); // 4 G events claimed
    let mut hashes_as_strings = Vec::new();
    rmp::encode::write_array_len(&mut hashes_as_strings, 3).unwrap();
    rmp::encode::write_str(&mut hashes_as_strings, "BlockRemoved").unwrap();
    rmp::encode::write_str(&mut hashes_as_strings, "not a list").unwrap();
    rmp::encode::write_str(&mut hashes_as_strings, "GPU").unwrap();
    let cases: Vec<Vec<u8>> = vec![
        good[..good.len() / 2].to_vec(), // truncated
        Vec::new(),                      // empty
        vec![0xc1],                      // reserved byte
        events_not_list,
        huge,
        vec![0x91; 100_000],                       // nested far too deep
        raw_batch(&[hashes_as_strings]),           // a field of the wrong type
        raw_batch(&[b"\x92\xa3Foo\x01".to_vec()]), // unknown event tag
        wrong_types,
    ];
    for (i, payload) in cases.iter().enumerate() {
        feed.handle_live(ENGINE, 1 + i as u64, payload, &mut out);
    }
    assert_eq!(feed.translator().len(), 1, "the good block survives");
    assert!(!out.0.contains(&Out::Cleared));
    let c = *feed.translator().counts();
    assert_eq!(c.get(notice::UNDECODABLE), 8, "{c:?}");
    assert_eq!(c.get(notice::UNKNOWN_EVENT), 1);
    // A million removals of blocks never seen: counted, nothing sent.
    let bogus: Vec<u64> = (1_000_000..2_000_000).collect();
    let before = out.0.len();
    feed.handle_live(
        ENGINE,
        1 + cases.len() as u64,
        &batch(&[removed(&bogus)]),
        &mut out,
    );
    assert_eq!(
        feed.translator().counts().get(notice::UNKNOWN_REMOVAL),
        1_000_000
    );
    assert_eq!(out.0.len(), before);
    assert_eq!(feed.translator().len(), 1);
}

#[test]
fn capacity_bounds_what_a_rank_remembers() {
    let mut t = Translator::new(4, 3);
    let mut out = Recorder::default();
    let hashes: Vec<u64> = (1..=5).collect();
    let tokens: Vec<u32> = (0..20).collect();
    Decoder::new()
        .decode(&batch(&[stored(&hashes, None, &tokens, 4)]), |e| {
            t.apply(e, &mut out)
        })
        .unwrap();
    assert_eq!(t.len(), 3);
    assert_eq!(t.counts().get(notice::TOO_MANY_BLOCKS), 1);
}

#[test]
fn decoding_and_translating_a_warm_batch_allocates_nothing() {
    let mut decoder = Decoder::new();
    let mut t = Translator::new(16, 1 << 20);
    let mut out = common::Counter::default();
    let tokens: Vec<u32> = (0..256).collect();
    let make = |i: u64| {
        let hashes: Vec<u64> = (i * 16..i * 16 + 16).collect();
        batch(&[stored(&hashes, None, &tokens, 16), removed(&hashes[..8])])
    };
    let payloads: Vec<Vec<u8>> = (0..64).map(make).collect();
    // Warm-up: scratch buffers and the map grow to their working size.
    for p in &payloads {
        decoder.decode(p, |e| t.apply(e, &mut out)).unwrap();
    }
    let allocations = allocation_counter::measure(|| {
        for p in &payloads {
            decoder.decode(p, |e| t.apply(e, &mut out)).unwrap();
        }
    });
    assert_eq!(allocations.count_total, 0);
    assert!(out.stored > 0 && out.removed > 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any bytes: no panic, and a structural error or a batch.
    #[test]
    fn any_bytes_decode_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut t = Translator::new(4, 1000);
        let mut out = Recorder::default();
        let _ = Decoder::new().decode(&bytes, |e| t.apply(e, &mut out));
    }

    /// A valid batch with some bytes flipped: no panic, never more blocks
    /// than the batch named.
    #[test]
    fn mutated_batches_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let tokens: Vec<u32> = (0..32).collect();
        let mut bytes = batch(&[stored(&[1, 2], None, &tokens, 16), removed(&[1])]);
        for (i, v) in flips {
            let at = i.index(bytes.len());
            bytes[at] = v;
        }
        let mut t = Translator::new(16, 1000);
        let mut out = Recorder::default();
        let _ = Decoder::new().decode(&bytes, |e| t.apply(e, &mut out));
        prop_assert!(t.len() <= 1000);
    }
}
