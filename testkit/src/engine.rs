//! Engines registered over a daemon's control socket, as an engine that
//! links libkvedge registers (build its `Hello` with `Hello::new`).

use std::path::Path;
use std::time::Duration;

use kvedge_schema::messages::control::Hello;
use kvedge_shm::Publisher;
use kvedge_shm::control::ProducerSession;

/// Registers `hello` at `control` (waiting up to 5 s) and returns the
/// engine's publisher.
pub fn register(control: impl AsRef<Path>, hello: &Hello) -> Publisher {
    let (session, ring) = ProducerSession::connect(control.as_ref(), hello, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("registering worker {}: {e}", hello.worker_id));
    Publisher::new(Some(session), ring)
}
