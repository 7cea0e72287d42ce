//! Child producer for the two-process ring tests: registers over the control
//! socket given as the first argument, then pushes the deterministic stress
//! stream. `stress N` pushes N records and exits, printing its counts;
//! `forever` pushes until killed.

#![forbid(unsafe_code)]

use std::time::Duration;

use kvedge_shm::Push;
use kvedge_shm::control::ProducerSession;
use kvedge_tests::{stress_payload, test_hello};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (socket, mode) = (&args[1], args[2].as_str());
    let limit = match mode {
        "stress" => args[3].parse::<u64>().expect("count"),
        "forever" => u64::MAX,
        _ => panic!("unknown mode {mode}"),
    };
    let (_session, mut ring) =
        ProducerSession::connect(socket, &test_hello(7), Duration::from_secs(10))
            .expect("register");
    let mut buf = Vec::with_capacity(512);
    let (mut committed, mut dropped) = (0u64, 0u64);
    for seq in 0..limit {
        stress_payload(seq, &mut buf);
        match ring.try_push(42, 0, &buf).expect("push") {
            Push::Committed { .. } => committed += 1,
            Push::Dropped { .. } => dropped += 1,
        }
    }
    println!("committed {committed} dropped {dropped}");
}
