//! The query listener on io_uring (feature `io-uring`, `daemon.query_io:
//! io-uring`): a driver on threads of its own that feeds the routing
//! thread through [`crate::jobs`], the seam every transport off the
//! routing thread uses. A thread accepts on query.sock; a tokio-uring
//! runtime on a second thread reads and writes every client with io_uring
//! operations and cuts requests out of the bytes ([`framing`]). Each
//! connection is admitted by the core (connection limit, peer
//! credentials), each request is answered by it, and the core's idle
//! timeout closes the connection by shutting its socket down (which also
//! completes the kernel's pending read).
//!
//! If io_uring is unavailable (EPERM or ENOSYS from `io_uring_setup`, as
//! under default container seccomp profiles) [`start`] says so and the
//! caller keeps the epoll path.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};

use kvedge_core::ClientId;
use kvedge_shm::control::{PeerCred, peer_credentials};
use kvedge_wire::framing::{self, Mode, Next};

use crate::clients::send_refusal;
use crate::jobs::{Job, JobSender};

/// Starts the listener on `listener` with the frame limit
/// `max_frame_bytes`; on error the listener is handed back with the
/// reason, so the caller can fall back to epoll.
pub fn start(
    listener: UnixListener,
    jobs: JobSender,
    max_frame_bytes: usize,
) -> Result<(), (UnixListener, io::Error)> {
    // Probe io_uring on this thread first: the clean fallback point.
    if let Err(e) = tokio_uring::Runtime::new(&tokio_uring::builder()) {
        return Err((listener, e));
    }
    let accept_from = match listener.try_clone() {
        Ok(l) => l,
        Err(e) => return Err((listener, e)),
    };
    if let Err(e) = accept_from.set_nonblocking(false) {
        return Err((listener, e));
    }
    let (conn_tx, mut conn_rx) =
        tokio::sync::mpsc::unbounded_channel::<(UnixStream, io::Result<PeerCred>)>();
    let spawned = std::thread::Builder::new()
        .name("kvedge-uring".into())
        .spawn(move || {
            tokio_uring::start(async move {
                while let Some((stream, peer)) = conn_rx.recv().await {
                    let jobs = jobs.clone();
                    tokio_uring::spawn(async move {
                        serve(stream, peer, jobs, max_frame_bytes).await;
                    });
                }
            })
        });
    if let Err(e) = spawned {
        return Err((listener, e));
    }
    let accepting = std::thread::Builder::new()
        .name("kvedge-accept".into())
        .spawn(move || {
            loop {
                match accept_from.accept() {
                    Ok((s, _)) => {
                        let peer = peer_credentials(&s);
                        if conn_tx.send((s, peer)).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("io_uring listener: accept: {e}");
                        // This thread only accepts; backing off here holds
                        // nobody else.
                        #[allow(clippy::disallowed_methods)]
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
            }
        });
    match accepting {
        // The accept thread's handle on the socket keeps it open.
        Ok(_) => Ok(()),
        // Dropping the sender ends the io_uring thread too.
        Err(e) => Err((listener, e)),
    }
}

/// Asks the routing thread to admit the connection.
async fn admit(
    stream: &UnixStream,
    peer: io::Result<PeerCred>,
    jobs: &JobSender,
) -> Option<ClientId> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The core's idle timeout closes the connection by shutting it down.
    let closer = stream.try_clone().ok()?;
    let sent = jobs.send(Job::Connect {
        peer,
        warms: true,
        admitted: Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }),
        close: Box::new(move || {
            let _ = closer.shutdown(std::net::Shutdown::Both);
        }),
    });
    if !sent {
        return None;
    }
    match rx.await.ok()? {
        Ok(id) => Some(id),
        Err(refusal) => {
            send_refusal(stream, refusal.status, &refusal.message);
            None
        }
    }
}

/// Asks the routing thread and waits for its reply.
async fn ask(jobs: &JobSender, client: ClientId, request: Vec<u8>, mode: Mode) -> Option<Vec<u8>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sent = jobs.send(Job::Request {
        client,
        request,
        mode,
        reply: Box::new(move |bytes| {
            let _ = tx.send(bytes);
        }),
    });
    if !sent {
        return None;
    }
    rx.await.ok()
}

/// One client: admitted by the core, then read with io_uring, cut into
/// requests, asked, written with io_uring; its end is reported.
async fn serve(stream: UnixStream, peer: io::Result<PeerCred>, jobs: JobSender, limit: usize) {
    let Some(client) = admit(&stream, peer, &jobs).await else {
        return;
    };
    serve_admitted(
        tokio_uring::net::UnixStream::from_std(stream),
        client,
        &jobs,
        limit,
    )
    .await;
    jobs.send(Job::Disconnect { client });
}

async fn serve_admitted(
    stream: tokio_uring::net::UnixStream,
    client: ClientId,
    jobs: &JobSender,
    limit: usize,
) {
    let mut pending: Vec<u8> = Vec::with_capacity(4096);
    let mut buf = vec![0u8; 16384];
    let mut mode = Mode::Unknown;
    loop {
        let (res, b) = stream.read(buf).await;
        buf = b;
        let n = match res {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        framing::detect(&mut mode, &mut pending);
        let mut asked = false;
        loop {
            match framing::next(mode, &pending, limit) {
                Next::NeedMore => break,
                Next::TooLarge => {
                    let _ = stream.write_all(framing::too_large(mode, limit)).await;
                    return;
                }
                Next::Request { body, used } => {
                    let request = pending[body].to_vec();
                    pending.drain(..used);
                    asked = true;
                    let Some(reply) = ask(jobs, client, request, mode).await else {
                        return;
                    };
                    let (res, _) = stream.write_all(reply).await;
                    if res.is_err() {
                        return;
                    }
                }
            }
        }
        // Bytes of a request still arriving count as activity too.
        if !asked {
            jobs.send(Job::Active { client });
        }
    }
}
