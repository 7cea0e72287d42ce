//! The engine's side of the registration handshake against a scripted
//! daemon on a real Unix socket: which refusals it retries and which it
//! reports at once.

#![forbid(unsafe_code)]

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use kvedge_schema::messages::control::{Hello, reject};
use kvedge_shm::ControlError;
use kvedge_shm::control::{ProducerSession, accept_registration, read_hello, send_reject};

fn hello() -> Hello {
    Hello {
        kv_blocks: [64, 0, 0],
        endpoint: "http://engine".into(),
        ..Hello::new(7, "m")
    }
}

fn socket(name: &str) -> (PathBuf, UnixListener) {
    let dir = std::env::temp_dir().join(format!("kvedge-control-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("control.sock");
    let listener = UnixListener::bind(&path).unwrap();
    (path, listener)
}

#[test]
fn a_displaced_registration_connects_again_and_succeeds() {
    let (path, listener) = socket("displaced");
    let daemon = thread::spawn(move || {
        // First connection: closed before its Hello is read, as a flood
        // pushing it out would.
        drop(listener.accept().unwrap());
        // Second: the Hello is read, but the core had closed it already.
        let (s, _) = listener.accept().unwrap();
        read_hello(&s).unwrap();
        send_reject(&s, reject::DISPLACED, "displaced").unwrap();
        // Third: registered.
        let (s, _) = listener.accept().unwrap();
        let (hello, _ring) = accept_registration(&s, 4096, 1, 1000).unwrap();
        (hello.worker_id, s)
    });
    let (session, _producer) =
        ProducerSession::connect(&path, &hello(), Duration::from_secs(5)).unwrap();
    assert_eq!(session.welcome().worker_id, 7);
    let (seen, _s) = daemon.join().unwrap();
    assert_eq!(seen, 7);
}

#[test]
fn other_refusals_are_reported_at_once() {
    let (path, listener) = socket("refused");
    let daemon = thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        read_hello(&s).unwrap();
        send_reject(&s, reject::DUPLICATE_WORKER, "worker 7 is registered").unwrap();
        // No second attempt may arrive.
        listener.set_nonblocking(true).unwrap();
        thread::sleep(Duration::from_millis(200));
        listener.accept().is_err()
    });
    let err = ProducerSession::connect(&path, &hello(), Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(err, ControlError::Rejected { code, .. } if code == reject::DUPLICATE_WORKER),
        "{err}"
    );
    assert!(daemon.join().unwrap(), "the engine connected again");
}

#[test]
fn displacement_is_retried_only_until_the_timeout() {
    let (path, listener) = socket("timeout");
    thread::spawn(move || {
        while let Ok((s, _)) = listener.accept() {
            if read_hello(&s).is_ok() {
                let _ = send_reject(&s, reject::DISPLACED, "displaced");
            }
        }
    });
    let err = ProducerSession::connect(&path, &hello(), Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(err, ControlError::Rejected { code, .. } if code == reject::DISPLACED),
        "{err}"
    );
}
