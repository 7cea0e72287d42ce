//! Query channels: a pair of rings between one frontend and the daemon, so
//! that a select round trip costs two cache-line handoffs instead of two
//! trips through the kernel's socket path.
//!
//! The daemon creates both sealed segments (a frontend never gets to hand
//! the daemon memory it could shrink under it): a request ring the frontend
//! writes and the daemon reads, and a reply ring the daemon writes and the
//! frontend reads. Each record is one binary-protocol frame body
//! (`op or status | version | payload`, without the length prefix: the
//! record has its own). One request is in flight at a time, so replies come
//! back in order and a ring never fills in normal use.
//!
//! The four descriptors travel with the reply to an attach request on the
//! frontend's `query.sock` connection, which stays open: it is how each side
//! learns that the other is gone. Both sides treat the other's ring as
//! hostile, as [`crate::ring`] describes.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::SegmentError;
use crate::ring::{Consumer, Producer, wake_eventfd};
use crate::segment::Segment;

/// Record type of every channel record: one frame body.
pub const FRAME: u16 = 1;

/// Descriptors an attach reply carries, in order: request segment, request
/// wake eventfd, reply segment, reply wake eventfd.
pub const FDS: usize = 4;

/// The daemon's end: it reads requests and writes replies.
#[derive(Debug)]
pub struct ServerChannel {
    pub requests: Consumer,
    pub replies: Producer,
}

impl ServerChannel {
    /// Creates both rings, each with a data area of `capacity` bytes.
    pub fn create(capacity: u64, attach_epoch: u64) -> Result<Self, SegmentError> {
        let requests = Consumer::create(capacity, attach_epoch)?;
        let replies = Producer::new(
            Segment::create(capacity, attach_epoch)?,
            Some(wake_eventfd()?),
        )?;
        Ok(ServerChannel { requests, replies })
    }

    /// The descriptors to send to the frontend, in [`FDS`] order.
    pub fn fds(&self) -> [BorrowedFd<'_>; FDS] {
        [
            self.requests.segment_fd(),
            self.requests.wake_fd(),
            self.replies.segment_fd(),
            self.replies
                .wake_fd()
                .expect("ServerChannel::create always gives the reply ring a wake fd"),
        ]
    }
}

/// The frontend's end: it writes requests and reads replies.
#[derive(Debug)]
pub struct ClientChannel {
    pub requests: Producer,
    pub replies: Consumer,
}

impl ClientChannel {
    /// Maps the four descriptors of an attach reply, checking both
    /// segments (seals, size, magic, version, layout) and that both rings
    /// are fresh.
    pub fn open(fds: Vec<OwnedFd>) -> Result<Self, SegmentError> {
        let Ok([req_seg, req_wake, rep_seg, rep_wake]) = <[OwnedFd; FDS]>::try_from(fds) else {
            return Err(SegmentError::Os {
                op: "attach",
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    "an attach reply must carry exactly 4 descriptors",
                ),
            });
        };
        let requests = Producer::new(Segment::open(req_seg)?, Some(req_wake))?;
        let replies = Consumer::open(Segment::open(rep_seg)?, rep_wake)?;
        Ok(ClientChannel { requests, replies })
    }
}

/// Sends all of `bytes` with `fds` attached to the first byte
/// (`MSG_NOSIGNAL`). Meant for a blocking socket, ideally with a write
/// timeout: `EAGAIN` (the timeout, or a full non-blocking socket) is an
/// error, so a peer that stops reading cannot hold the caller.
pub fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors"));
    }
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        // Only the first successful call carries the descriptors.
        let r = if sent == 0 {
            rustix::net::sendmsg(stream, &iov, &mut anc, SendFlags::NOSIGNAL)
        } else {
            rustix::net::send(stream, &bytes[sent..], SendFlags::NOSIGNAL)
        };
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(rustix::io::Errno::AGAIN) => return Err(io::ErrorKind::TimedOut.into()),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, collecting any descriptors that come
/// with them (close-on-exec). With `spin`, retries on `EAGAIN` (a
/// non-blocking socket); without, `EAGAIN` is a timeout (`SO_RCVTIMEO`).
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], spin: bool) -> io::Result<Vec<OwnedFd>> {
    let mut fds = Vec::new();
    let mut got = 0;
    while got < buf.len() {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        match rustix::net::recvmsg(stream, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC) {
            Ok(msg) => {
                for m in anc.drain() {
                    if let RecvAncillaryMessage::ScmRights(rights) = m {
                        fds.extend(rights);
                    }
                }
                if msg.bytes == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                got += msg.bytes;
            }
            Err(rustix::io::Errno::AGAIN) if spin => std::hint::spin_loop(),
            Err(rustix::io::Errno::AGAIN) => return Err(io::ErrorKind::TimedOut.into()),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::Push;
    use std::os::fd::AsFd;

    fn pair(capacity: u64) -> (ServerChannel, ClientChannel) {
        let server = ServerChannel::create(capacity, 3).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(&a, b"attach", &server.fds()).unwrap();
        let mut buf = [0u8; 6];
        let fds = recv_with_fds(&b, &mut buf, false).unwrap();
        assert_eq!(&buf, b"attach");
        (server, ClientChannel::open(fds).unwrap())
    }

    #[test]
    fn requests_and_replies_cross_in_order() {
        let (mut server, mut client) = pair(4096);
        for i in 0..100u32 {
            let req = i.to_le_bytes();
            assert!(matches!(
                client.requests.try_push(FRAME, 0, &req),
                Ok(Push::Committed { .. })
            ));
            let r = server.requests.poll().unwrap().unwrap();
            assert_eq!((r.kind, r.payload), (FRAME, &req[..]));
            let reply = (i * 2).to_le_bytes();
            server.replies.try_push(FRAME, 0, &reply).unwrap();
            let r = client.replies.poll().unwrap().unwrap();
            assert_eq!(r.payload, &reply[..]);
            assert!(client.replies.poll().unwrap().is_none());
        }
    }

    #[test]
    fn wrong_descriptor_sets_are_refused() {
        let server = ServerChannel::create(4096, 1).unwrap();
        let three: Vec<OwnedFd> = server.fds()[..3]
            .iter()
            .map(|f| f.try_clone_to_owned().unwrap())
            .collect();
        assert!(ClientChannel::open(three).is_err());
        // Segments in the wrong places (a wake eventfd is not a segment).
        let swapped: Vec<OwnedFd> = [1, 0, 2, 3]
            .iter()
            .map(|&i| server.fds()[i].try_clone_to_owned().unwrap())
            .collect();
        assert!(ClientChannel::open(swapped).is_err());
    }

    #[test]
    fn a_hostile_client_cannot_make_the_daemon_write_out_of_place() {
        use crate::segment::Segment;
        use std::sync::atomic::Ordering;
        let (mut server, client) = pair(4096);
        // The client owns the reply ring's head: it claims to have read
        // more than was ever written, then sets every flag bit.
        let reply_seg =
            Segment::open(client.replies.segment_fd().try_clone_to_owned().unwrap()).unwrap();
        let h = reply_seg.header();
        h.head.0.store(u64::MAX - 15, Ordering::Release);
        h.consumer_sleeping.0.store(u32::MAX, Ordering::Release);
        // The daemon's producer fills the ring once, then sees the
        // impossible head when it looks for room: from then on it drops,
        // never writing anywhere else and never panicking.
        let mut committed = 0;
        for _ in 0..1000 {
            match server.replies.try_push(FRAME, 0, &[7; 100]).unwrap() {
                Push::Committed { .. } => committed += 1,
                Push::Dropped { .. } => {}
            }
        }
        assert!(
            committed < 4096 / 100,
            "only what fits before the first look at head"
        );
        assert_eq!(server.replies.dropped(), 1000 - committed);
        assert_eq!(h.tail.0.load(Ordering::Acquire), committed * 128);
    }

    #[test]
    fn a_reply_ring_already_written_is_not_fresh() {
        let mut server = ServerChannel::create(4096, 1).unwrap();
        server.replies.try_push(FRAME, 0, b"early").unwrap();
        let fds = server
            .fds()
            .iter()
            .map(|f| f.as_fd().try_clone_to_owned().unwrap())
            .collect();
        assert!(matches!(
            ClientChannel::open(fds),
            Err(SegmentError::NotFresh { .. })
        ));
    }
}
