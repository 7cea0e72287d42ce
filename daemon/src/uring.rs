//! The query listener on io_uring (feature `io-uring`, `daemon.query_io:
//! io-uring`). A thread accepts on query.sock; a tokio-uring runtime on a
//! second thread reads and writes every client with io_uring operations and
//! frames requests (JSON lines, or `KVE1` binary frames); each request goes
//! to the routing loop as a [`Job`] and its reply comes back through a
//! oneshot channel. The routing state keeps its single owner. The accept
//! thread applies the epoll path's admission rules (connection limit, peer
//! credentials); the frame limit and the idle timeout apply per connection.
//!
//! If io_uring is unavailable (EPERM or ENOSYS from `io_uring_setup`, as
//! under default container seccomp profiles) [`start`] says so and the
//! caller keeps the epoll path.

use std::io;
use std::os::unix::net::UnixListener;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::framing::{self, Mode, Next};
use crate::server::{Job, JobSender, admission, send_refusal};
use kvedge_core::config::DaemonSection;

/// Starts the listener on `listener`; on error the listener is handed back
/// with the reason, so the caller can fall back to epoll.
pub fn start(
    listener: UnixListener,
    jobs: JobSender,
    limits: &DaemonSection,
) -> Result<(), (UnixListener, io::Error)> {
    let limits = limits.clone();
    let max_frame_bytes = limits.max_frame_bytes;
    let idle = std::time::Duration::from_millis(limits.idle_timeout_ms);
    let open = Arc::new(AtomicUsize::new(0));
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
        tokio::sync::mpsc::unbounded_channel::<(std::os::unix::net::UnixStream, OpenGuard)>();
    let spawned = std::thread::Builder::new()
        .name("kvedge-uring".into())
        .spawn(move || {
            tokio_uring::start(async move {
                while let Some((stream, guard)) = conn_rx.recv().await {
                    let jobs = jobs.clone();
                    tokio_uring::spawn(async move {
                        serve(stream, jobs, max_frame_bytes, idle).await;
                        drop(guard);
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
                        let open_now = open.load(Ordering::Relaxed);
                        if let Some((code, message)) = admission(&s, &limits, open_now) {
                            tracing::warn!("query connection refused ({code}): {message}");
                            send_refusal(&s, code, &message);
                            continue;
                        }
                        open.fetch_add(1, Ordering::Relaxed);
                        let guard = OpenGuard(Arc::clone(&open));
                        if conn_tx.send((s, guard)).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("io_uring listener: accept: {e}");
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

/// Counts an open connection until dropped.
struct OpenGuard(Arc<AtomicUsize>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Asks the routing loop and waits for its reply.
async fn ask(jobs: &JobSender, request: Vec<u8>, binary: bool) -> Option<Vec<u8>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sent = jobs.send(Job {
        request,
        binary,
        reply: Box::new(move |bytes| {
            let _ = tx.send(bytes);
        }),
    });
    if !sent {
        return None;
    }
    rx.await.ok()
}

/// One client: read with io_uring, frame, ask, write with io_uring. A
/// client that sends nothing for `idle` is closed.
async fn serve(
    stream: std::os::unix::net::UnixStream,
    jobs: JobSender,
    limit: usize,
    idle: std::time::Duration,
) {
    let stream = tokio_uring::net::UnixStream::from_std(stream);
    let mut pending: Vec<u8> = Vec::with_capacity(4096);
    let mut buf = vec![0u8; 16384];
    let mut mode = Mode::Unknown;
    loop {
        // On the timeout the read future is dropped, but the kernel still
        // holds the read (and with it the socket) until it completes:
        // shutting the socket down completes it, so the peer sees the close.
        let Ok((res, b)) = tokio::time::timeout(idle, stream.read(buf)).await else {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return;
        };
        buf = b;
        let n = match res {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        framing::detect(&mut mode, &mut pending);
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
                    let Some(reply) = ask(&jobs, request, mode == Mode::Binary).await else {
                        return;
                    };
                    let (res, _) = stream.write_all(reply).await;
                    if res.is_err() {
                        return;
                    }
                }
            }
        }
    }
}
