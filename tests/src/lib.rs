//! Helpers shared by the end-to-end tests: a minimal daemon side of the
//! control handshake, and the deterministic record stream the child producer
//! writes so the parent can verify every byte it receives.

#![forbid(unsafe_code)]

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use kvedge_schema::messages::control::Hello;
use kvedge_shm::Consumer;
use kvedge_shm::control::accept_registration;

/// A listening control socket in a private temporary directory.
#[derive(Debug)]
pub struct ControlListener {
    pub listener: UnixListener,
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl ControlListener {
    pub fn bind() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("control.sock");
        let listener = UnixListener::bind(&path).expect("bind control socket");
        ControlListener {
            listener,
            path,
            _dir: dir,
        }
    }

    /// Accepts one engine, reads its Hello and hands it a fresh ring.
    pub fn accept(&self, capacity: u64) -> (UnixStream, Hello, Consumer) {
        let (stream, _) = self.listener.accept().expect("accept");
        let (hello, ring) = accept_registration(&stream, capacity, 1, 1000).expect("register");
        (stream, hello, ring)
    }
}

/// Payload length of record `seq` in the stress stream: 0..=256 bytes,
/// pseudo-random but reproducible on both sides.
pub fn stress_len(seq: u64) -> usize {
    let mut z = seq.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % 257) as usize
}

/// Fills `buf` with record `seq`'s payload.
pub fn stress_payload(seq: u64, buf: &mut Vec<u8>) {
    buf.clear();
    buf.resize(stress_len(seq), seq as u8 ^ 0x5a);
}

/// Whether `payload` is exactly what the producer wrote for `seq`.
pub fn stress_payload_ok(seq: u64, payload: &[u8]) -> bool {
    payload.len() == stress_len(seq) && payload.iter().all(|&b| b == seq as u8 ^ 0x5a)
}

/// A Hello for test engines.
pub fn test_hello(worker_id: u64) -> Hello {
    Hello {
        kv_blocks: [1024, 0, 0],
        endpoint: "unix:///tmp/none".into(),
        ..Hello::new(worker_id, "test-model")
    }
}
