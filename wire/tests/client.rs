//! The blocking client against a peer that speaks the binary protocol on
//! a real Unix socket, with the peer in control of when it reads and
//! answers: how the client waits for a reply, and how it gives up.

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvedge_wire::{Client, MAGIC, Status, binary};

/// A listening socket in a fresh directory, removed on drop.
struct Socket {
    dir: PathBuf,
    listener: UnixListener,
}

impl Socket {
    fn new(name: &str) -> Socket {
        let dir = std::env::temp_dir().join(format!("kvedge-wire-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = UnixListener::bind(dir.join("query.sock")).unwrap();
        Socket { dir, listener }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("query.sock")
    }

    /// Accepts the client and reads its protocol magic.
    fn accept(&self) -> UnixStream {
        let (mut s, _) = self.listener.accept().unwrap();
        let mut magic = [0u8; 4];
        s.read_exact(&mut magic).unwrap();
        assert_eq!(&magic, MAGIC);
        s
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads one request frame (length, then body).
fn read_frame(s: &mut UnixStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    body
}

/// The calling thread's voluntary context switches so far: how often it
/// blocked.
fn voluntary_switches() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_blocking_client_sleeps_once_per_reply_even_when_its_request_is_read_late() {
    let socket = Socket::new("sleeps-once");
    let path = socket.path();
    let peer = std::thread::spawn(move || {
        let mut s = socket.accept();
        for _ in 0..3 {
            // Read the request only once the client waits for its reply,
            // and answer a while later: the read frees the client's send
            // buffer, which wakes a thread blocked in `read` on its socket.
            std::thread::sleep(Duration::from_millis(30));
            let request = read_frame(&mut s);
            std::thread::sleep(Duration::from_millis(30));
            let mut reply = Vec::new();
            let id = u64::from_le_bytes(request[request.len() - 8..].try_into().unwrap());
            binary::write_error(
                &mut reply,
                Status::UnknownRequest,
                &format!("no request {id}"),
            );
            s.write_all(&reply).unwrap();
        }
    });
    let mut c = Client::connect(&path).unwrap();
    for id in 0..3u64 {
        let before = voluntary_switches();
        let start = Instant::now();
        let answer = c.prefill_done(id).unwrap();
        let took = start.elapsed();
        let switches = voluntary_switches() - before;
        assert_eq!(
            answer,
            Err((Status::UnknownRequest, format!("no request {id}")))
        );
        assert!(took >= Duration::from_millis(60), "{took:?}");
        // It slept until the reply came, and only then woke.
        assert_eq!(
            switches, 1,
            "request {id}: the client blocked {switches} times"
        );
    }
    peer.join().unwrap();
}

#[test]
fn a_blocking_client_gives_up_after_its_timeout_and_then_refuses_calls() {
    let socket = Socket::new("timeout");
    let path = socket.path();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let mut s = socket.accept();
        // Reads the request and never answers (until the test is over).
        let _ = read_frame(&mut s);
        let _ = done_rx.recv();
    });
    let mut c = Client::connect(&path).unwrap();
    c.set_timeout(Some(Duration::from_millis(150))).unwrap();
    let start = Instant::now();
    let e = c.prefill_done(7).unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    assert!(took >= Duration::from_millis(150), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // The stream may be mid-frame now: every later call is refused.
    let again = c.prefill_done(8).unwrap_err();
    assert_eq!(again.kind(), std::io::ErrorKind::NotConnected, "{again}");
    done_tx.send(()).unwrap();
    peer.join().unwrap();
}

#[test]
fn a_blocking_client_reports_a_daemon_that_hung_up_before_answering() {
    let socket = Socket::new("hangup");
    let path = socket.path();
    let peer = std::thread::spawn(move || {
        let mut s = socket.accept();
        let _ = read_frame(&mut s);
        std::thread::sleep(Duration::from_millis(20));
        drop(s);
    });
    let mut c = Client::connect(&path).unwrap();
    let e = c.prefill_done(1).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    peer.join().unwrap();
}
