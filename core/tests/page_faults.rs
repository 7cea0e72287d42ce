//! The state a select writes takes no page fault: its memory was written
//! when it was allocated, not left for the select path's first writes.

#![forbid(unsafe_code)]

use kvedge_core::index::Slot;
use kvedge_core::load::LoadTable;
use kvedge_shm::testing::{FAULT_ALLOWANCE, minor_faults};

#[test]
fn reserving_takes_no_page_fault() {
    let (a, b) = (Slot::new(0).unwrap(), Slot::new(1).unwrap());
    let mut t = LoadTable::new(60_000);
    // The code and stack of a reserve, touched once.
    t.reserve(u64::MAX, a, 1, 1, 0, 0.0, 0.0);
    let before = minor_faults();
    // Up to the most the table holds without growing its map (which grows
    // at half full). Before the table's memory was written when it was
    // made, about 90 of these took a page fault.
    for id in 0..3_000u64 {
        t.reserve(
            id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            b,
            10,
            1,
            1,
            0.0,
            0.0,
        );
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in 3,000 reserves"
    );
    assert_eq!(t.reservations(), 3_001);
}

#[test]
fn watching_a_prompts_last_block_takes_no_page_fault() {
    let slot = Slot::new(3).unwrap();
    let mut w = kvedge_core::prefill_watch::PrefillWatch::default();
    // The code and stack of a watch, touched once.
    w.watch(slot, u64::MAX, 0, 0);
    let before = minor_faults();
    // Hashes spread over the whole table, as prompts' are.
    for id in 0..3_000u64 {
        w.watch(slot, id.wrapping_mul(0x9E37_79B9_7F4A_7C15), id, 1);
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in 3,000 watches"
    );
}

#[test]
fn noting_a_prompts_blocks_takes_no_page_fault() {
    let slot = Slot::new(3).unwrap();
    let mut p = kvedge_core::pending::PendingPrefixes::new(10_000);
    // The code and stack of a note, touched once.
    p.note(slot, &[u64::MAX], 0);
    let before = minor_faults();
    // 200 prompts of 40 blocks, spread over the whole table.
    for prompt in 0..200u64 {
        let hashes: [u64; 40] =
            std::array::from_fn(|i| (prompt * 40 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        p.note(slot, &hashes, 1);
    }
    let faults = minor_faults() - before;
    assert!(
        faults <= FAULT_ALLOWANCE,
        "{faults} page faults in 8,000 notes"
    );
}
