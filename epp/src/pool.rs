//! The pool where prompts are tokenized and templates rendered, off the
//! picker's serving thread: a few threads of their own, a bounded queue,
//! and a deadline. A job that finds the queue full is refused at once; one
//! that waited past its deadline is dropped unrun, and its asker has
//! already been answered. The serving thread only ever waits on a future,
//! so one huge prompt delays no other stream.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Why a job did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the tokenizer pool's queue is full")]
    QueueFull,
    #[error("the prompt was not tokenized within the deadline")]
    Deadline,
    #[error("the tokenizer pool has stopped")]
    Stopped,
}

type Work = Box<dyn FnOnce() + Send>;

struct Job {
    work: Work,
    /// Past this the job is dropped unrun.
    deadline: Instant,
}

/// A fixed set of threads with a bounded queue.
#[derive(Debug, Clone)]
pub struct Pool {
    tx: SyncSender<Job>,
    deadline: Duration,
}

impl Pool {
    /// `threads` workers (at least one), `queue` jobs waiting at most,
    /// each with `deadline` from when it was queued to when it is done.
    pub fn new(threads: usize, queue: usize, deadline: Duration) -> std::io::Result<Pool> {
        let (tx, rx) = sync_channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("kvedge-tokenize-{i}"))
                .spawn(move || work(&rx))?;
        }
        Ok(Pool { tx, deadline })
    }

    /// Runs `f` on the pool; its result, or why it did not run in time.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Refused> {
        let (done, result) = oneshot::channel();
        let job = Job {
            work: Box::new(move || {
                let _ = done.send(f());
            }),
            deadline: Instant::now() + self.deadline,
        };
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(Refused::QueueFull),
            Err(TrySendError::Disconnected(_)) => return Err(Refused::Stopped),
        }
        match tokio::time::timeout(self.deadline, result).await {
            Ok(Ok(v)) => Ok(v),
            // Dropped unrun: it waited past its deadline.
            Ok(Err(_)) => Err(Refused::Deadline),
            Err(_) => Err(Refused::Deadline),
        }
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        if Instant::now() < job.deadline {
            (job.work)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_a_late_job_never_runs() {
        let pool = Pool::new(1, 1, Duration::from_millis(200)).unwrap();
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // One job holds the only thread past the deadline, one waits.
        let slow = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.run(|| std::thread::sleep(Duration::from_millis(400)))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let waiting = {
            let (pool, ran) = (pool.clone(), Arc::clone(&ran));
            tokio::spawn(async move {
                pool.run(move || ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        assert_eq!(pool.run(|| ()).await, Err(Refused::QueueFull));
        assert!(started.elapsed() < Duration::from_millis(100), "at once");
        assert_eq!(slow.await.unwrap(), Err(Refused::Deadline));
        assert_eq!(waiting.await.unwrap(), Err(Refused::Deadline));
        // The late job is dropped when the thread gets to it.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(pool.run(|| 7).await, Ok(7));
    }
}
