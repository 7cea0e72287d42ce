//! Each socket against libzmq itself (pyzmq, `fixtures/zmq_peer.py`), the
//! ZeroMQ the engines use: a PUB that binds and one that connects to a
//! bound SUB, a ROUTER answering a DEALER, and the other way round for
//! the mock engine's sockets. Needs python3 with pyzmq.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvedge_zmtp::{Dealer, Options, PeerAddr, Pub, Router, Sub, SubEvent};

struct Peer {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(args: &[&str]) -> Peer {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/zmq_peer.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with pyzmq is needed for these tests");
        let out = BufReader::new(child.stdout.take().unwrap());
        Peer { child, out }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        assert!(!l.is_empty(), "the libzmq peer ended (is pyzmq installed?)");
        l.trim_end().to_owned()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.stdin.take().map(|mut s| s.flush());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long a libzmq peer gets to do its part; one that never starts
/// (no pyzmq) fails the test after it instead of hanging it.
const PEER_DEADLINE: Duration = Duration::from_secs(20);

fn hex(frames: &[Bytes]) -> String {
    frames
        .iter()
        .map(|f| f.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The sequence numbers of the next `n` messages (all on our topic).
async fn sequences(sub: &mut Sub, n: usize) -> Vec<u64> {
    let mut seqs = Vec::new();
    while seqs.len() < n {
        let event = tokio::time::timeout(PEER_DEADLINE, sub.recv())
            .await
            .expect("a message from libzmq in time")
            .expect("open");
        if let SubEvent::Message { frames, .. } = event {
            assert_eq!(&frames[0][..], b"kv-events", "only the subscribed topic");
            let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
            assert_eq!(frames[2], Bytes::from(format!("payload-{seq}")));
            seqs.push(seq);
        }
    }
    seqs
}

fn consecutive(seqs: &[u64]) -> bool {
    seqs.windows(2).all(|w| w[1] == w[0] + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_reads_a_libzmq_pub_it_connects_to() {
    let mut p = Peer::spawn(&["pub-bind"]);
    let port = p.line();
    let mut sub = Sub::connect(
        &format!("tcp://127.0.0.1:{port}"),
        &[b"kv-events"],
        &Options::default(),
    )
    .await
    .unwrap();
    assert!(consecutive(&sequences(&mut sub, 5).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_sub_reads_a_libzmq_pub_that_connects() {
    let mut sub = Sub::bind("tcp://127.0.0.1:0", &[b"kv-events"], &Options::default())
        .await
        .unwrap();
    let mut p = Peer::spawn(&["pub-connect", &sub.endpoint().to_string()]);
    p.line();
    let joined = tokio::time::timeout(PEER_DEADLINE, async {
        loop {
            if let Some(SubEvent::Joined { addr, .. }) = sub.recv().await {
                break addr;
            }
        }
    })
    .await
    .expect("the libzmq publisher joins in time");
    assert!(matches!(joined, PeerAddr::Tcp(a) if a.ip().is_loopback()));
    assert!(consecutive(&sequences(&mut sub, 5).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dealer_asks_a_libzmq_router() {
    let mut p = Peer::spawn(&["router"]);
    let port = p.line();
    let mut dealer = Dealer::connect(&format!("tcp://127.0.0.1:{port}"), &Options::default())
        .await
        .unwrap();
    dealer.send(&[&b""[..], &7u64.to_be_bytes()]).await.unwrap();
    let first = dealer.recv().await.unwrap();
    assert_eq!(
        first,
        [
            Bytes::new(),
            Bytes::copy_from_slice(&7u64.to_be_bytes()),
            Bytes::from_static(b"done")
        ]
    );
    let second = dealer.recv().await.unwrap();
    assert_eq!(&second[1][..], b"end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_sub_reads_our_pub() {
    let publisher = Pub::bind("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let mut p = Peer::spawn(&["sub", &publisher.endpoint().to_string(), "kv", "3"]);
    assert_eq!(p.line(), "ready");
    // Publish until the subscription has arrived, then three messages.
    tokio::time::timeout(PEER_DEADLINE, async {
        while publisher.subscribers() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    for i in 0..3u8 {
        publisher.send(&[&b"nope"[..], &[i]]);
        assert_eq!(publisher.send(&[&b"kv-events"[..], &[i], b"p"]), 1);
    }
    for i in 0..3u8 {
        assert_eq!(
            p.line(),
            hex(&[
                Bytes::from_static(b"kv-events"),
                Bytes::from(vec![i]),
                Bytes::from_static(b"p")
            ])
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_dealer_is_answered_by_our_router() {
    let mut router = Router::bind("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let mut p = Peer::spawn(&["dealer", &router.endpoint().to_string()]);
    let ask = tokio::time::timeout(PEER_DEADLINE, router.recv())
        .await
        .expect("the libzmq dealer's request in time (is pyzmq installed?)")
        .unwrap();
    assert_eq!(&ask[1..], [Bytes::new(), Bytes::from_static(b"hi")]);
    router
        .send(&[ask[0].clone(), Bytes::new(), Bytes::from_static(b"yes")])
        .await
        .unwrap();
    assert_eq!(p.line(), hex(&[Bytes::new(), Bytes::from_static(b"yes")]));
}
