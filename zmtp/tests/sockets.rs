//! The sockets over real loopback connections: each with another of ours,
//! and with hand-written hostile peers that break every cap, hold
//! connections open without a word, or come from addresses not allowed.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use kvedge_zmtp::codec::{self, SocketType};
use kvedge_zmtp::{
    Allow, Dealer, Endpoint, Error, Limits, Options, ProtocolError, Pub, Router, Sub, SubEvent,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const WAIT: Duration = Duration::from_secs(10);

fn addr(e: &Endpoint) -> SocketAddr {
    e.to_string()
        .strip_prefix("tcp://")
        .unwrap()
        .parse()
        .unwrap()
}

async fn next(sub: &mut Sub) -> SubEvent {
    tokio::time::timeout(WAIT, sub.recv())
        .await
        .expect("an event in time")
        .expect("the socket is open")
}

/// The next message, skipping joins.
async fn message(sub: &mut Sub) -> Vec<Bytes> {
    loop {
        match next(sub).await {
            SubEvent::Message { frames, .. } => return frames,
            SubEvent::Joined { .. } => {}
            other => panic!("expected a message, got {other:?}"),
        }
    }
}

/// A raw TCP peer from `from` that has greeted as a PUB.
async fn raw_pub(to: SocketAddr, from: [u8; 4]) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((from, 0))).unwrap();
    let mut s = s.connect(to).await.unwrap();
    let mut out = codec::greeting(false).to_vec();
    codec::encode_ready(&mut out, SocketType::Pub, b"");
    s.write_all(&out).await.unwrap();
    s
}

/// Whether the other end closed `s` (within the wait).
async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

fn options() -> Options {
    Options {
        limits: Limits {
            max_frame_bytes: 1 << 20,
            max_message_bytes: 1 << 20,
            max_message_frames: 4,
        },
        handshake_timeout: Duration::from_millis(500),
        max_peers: 4,
        ..Options::default()
    }
}

#[tokio::test]
async fn pub_to_sub_in_both_directions_of_connection() {
    let publisher = Pub::bind("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let endpoint = publisher.endpoint().to_string();
    let mut sub = Sub::connect(&endpoint, &[b"kv"], &Options::default())
        .await
        .unwrap();
    // Wait until the subscription reached the publisher.
    tokio::time::timeout(WAIT, async {
        while publisher.subscribers() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(publisher.send(&[&b"other"[..], b"x"]), 0, "not subscribed");
    assert_eq!(publisher.send(&[&b"kv-events"[..], b"1", &[7u8; 1000]]), 1);
    let m = message(&mut sub).await;
    assert_eq!(m.len(), 3);
    assert_eq!(&m[0][..], b"kv-events");
    assert_eq!(m[2].len(), 1000);
    // The publisher goes: the subscriber hears it leave, then nothing.
    drop(publisher);
    match next(&mut sub).await {
        SubEvent::Left { .. } => {}
        other => panic!("{other:?}"),
    }
    assert!(sub.recv().await.is_none());
}

#[tokio::test]
async fn dealer_and_router_route_by_identity() {
    let mut router = Router::bind("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let endpoint = router.endpoint().to_string();
    let mut a = Dealer::connect(&endpoint, &Options::default())
        .await
        .unwrap();
    let mut b = Dealer::connect(&endpoint, &Options::default())
        .await
        .unwrap();
    a.send(&[&b""[..], b"from a"]).await.unwrap();
    b.send(&[&b""[..], b"from b"]).await.unwrap();
    for _ in 0..2 {
        let m = router.recv().await.unwrap();
        let reply = [
            m[0].clone(),
            Bytes::new(),
            Bytes::from(format!("re: {}", String::from_utf8_lossy(&m[2]))),
        ];
        router.send(&reply).await.unwrap();
    }
    assert_eq!(&a.recv().await.unwrap()[1][..], b"re: from a");
    assert_eq!(&b.recv().await.unwrap()[1][..], b"re: from b");
}

#[tokio::test]
async fn a_frame_declaring_200_gb_drops_its_peer_and_no_one_else() {
    let mut sub = Sub::bind("tcp://127.0.0.1:0", &[b""], &options())
        .await
        .unwrap();
    let to = addr(sub.endpoint());
    let mut good = raw_pub(to, [127, 0, 0, 1]).await;
    let mut bad = raw_pub(to, [127, 0, 0, 1]).await;
    // A long frame header declaring 200 GB, then a trickle of bytes.
    let mut header = vec![0x02];
    header.extend_from_slice(&200_000_000_000u64.to_be_bytes());
    bad.write_all(&header).await.unwrap();
    let _ = bad.write_all(&[0u8; 1024]).await;
    assert!(closed(&mut bad).await, "the peer is cut off");
    // The good peer is still heard.
    let mut out = Vec::new();
    codec::encode_message(&mut out, &[&b"t"[..], b"hello"]);
    good.write_all(&out).await.unwrap();
    let mut saw_left = false;
    loop {
        match next(&mut sub).await {
            SubEvent::Left { error, .. } => {
                assert!(
                    matches!(
                        error,
                        Error::Protocol(ProtocolError::FrameTooLarge {
                            declared: 200_000_000_000,
                            ..
                        })
                    ),
                    "{error}"
                );
                saw_left = true;
            }
            SubEvent::Message { frames, .. } => {
                assert_eq!(&frames[1][..], b"hello");
                break;
            }
            _ => {}
        }
    }
    if !saw_left {
        loop {
            if let SubEvent::Left { .. } = next(&mut sub).await {
                break;
            }
        }
    }
    assert_eq!(sub.stats().broke_protocol.load(Relaxed), 1);
}

#[tokio::test]
async fn endless_more_frames_and_big_messages_are_cut_off() {
    let mut sub = Sub::bind("tcp://127.0.0.1:0", &[b""], &options())
        .await
        .unwrap();
    let to = addr(sub.endpoint());
    // Frames that keep MORE set, forever.
    let mut more = raw_pub(to, [127, 0, 0, 1]).await;
    let chunk: Vec<u8> = std::iter::repeat_n([0x01u8, 255].into_iter().chain([0u8; 255]), 64)
        .flatten()
        .collect();
    let mut sent = 0usize;
    while sent < 64 << 20 && more.write_all(&chunk).await.is_ok() {
        sent += chunk.len();
    }
    assert!(sent < 64 << 20, "cut off, not read on without end");
    assert!(closed(&mut more).await);
    // Within the frame count, but over the message's byte cap.
    let mut big = raw_pub(to, [127, 0, 0, 1]).await;
    let mut out = Vec::new();
    codec::encode_message(&mut out, &[vec![0u8; 600 << 10], vec![0u8; 600 << 10]]);
    let _ = big.write_all(&out).await;
    assert!(closed(&mut big).await);
    let mut errors = Vec::new();
    while errors.len() < 2 {
        if let SubEvent::Left { error, .. } = next(&mut sub).await {
            errors.push(error.to_string());
        }
    }
    assert!(
        errors.iter().any(|e| e.contains("over 4 frames")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("message of over 1048576 bytes")),
        "{errors:?}"
    );
}

#[tokio::test]
async fn a_bound_socket_takes_only_allowed_addresses_and_only_so_many() {
    let opts = Options {
        allow: Allow::only(["127.0.0.1/32".parse().unwrap()]),
        ..options()
    };
    let mut sub = Sub::bind("tcp://127.0.0.1:0", &[b""], &opts).await.unwrap();
    let to = addr(sub.endpoint());
    // 127.0.0.2 is loopback but not allowed here.
    let mut stranger = raw_pub(to, [127, 0, 0, 2]).await;
    assert!(closed(&mut stranger).await);
    assert_eq!(sub.stats().refused_address.load(Relaxed), 1);
    // Four peers are taken, the rest closed at once.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(raw_pub(to, [127, 0, 0, 1]).await);
    }
    let mut joined = 0;
    while joined < 4 {
        if let SubEvent::Joined { .. } = next(&mut sub).await {
            joined += 1;
        }
    }
    for _ in 0..20 {
        let mut extra = raw_pub(to, [127, 0, 0, 1]).await;
        assert!(closed(&mut extra).await);
    }
    assert_eq!(sub.stats().refused_full.load(Relaxed), 20);
    // One leaves; a newcomer is taken.
    drop(held.pop());
    loop {
        if let SubEvent::Left { .. } = next(&mut sub).await {
            break;
        }
    }
    let _newcomer = raw_pub(to, [127, 0, 0, 1]).await;
    loop {
        if let SubEvent::Joined { .. } = next(&mut sub).await {
            break;
        }
    }
}

#[tokio::test]
async fn a_silent_or_wrong_peer_fails_its_handshake() {
    let sub = Sub::bind("tcp://127.0.0.1:0", &[b""], &options())
        .await
        .unwrap();
    let to = addr(sub.endpoint());
    // Connects and says nothing: closed after the handshake timeout, and
    // its place is free again.
    let mut silent = TcpStream::connect(to).await.unwrap();
    assert!(closed(&mut silent).await);
    // Greets as a DEALER, which a SUB cannot talk to.
    let mut wrong = TcpStream::connect(to).await.unwrap();
    let mut out = codec::greeting(false).to_vec();
    codec::encode_ready(&mut out, SocketType::Dealer, b"");
    wrong.write_all(&out).await.unwrap();
    assert!(closed(&mut wrong).await);
    // Not ZMTP at all.
    let mut http = TcpStream::connect(to).await.unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    http.write_all(&[0u8; 64]).await.unwrap();
    assert!(closed(&mut http).await);
    assert_eq!(sub.stats().failed_handshakes.load(Relaxed), 3);
    assert_eq!(sub.stats().peers.load(Relaxed), 0);
}

#[tokio::test]
async fn a_publisher_ping_is_answered() {
    let sub = Sub::bind("tcp://127.0.0.1:0", &[b""], &options())
        .await
        .unwrap();
    let mut p = raw_pub(addr(sub.endpoint()), [127, 0, 0, 1]).await;
    // PING: TTL 0, context "abc".
    let ping = [0x04, 10, 4, b'P', b'I', b'N', b'G', 0, 0, b'a', b'b', b'c'];
    p.write_all(&ping).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while !got.windows(7).any(|w| w == b"PONGabc") {
        let n = tokio::time::timeout(WAIT, p.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed instead of answering");
        got.extend_from_slice(&buf[..n]);
    }
}
