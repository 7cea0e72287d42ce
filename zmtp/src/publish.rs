//! A bound PUB socket, as an engine's event publisher is: subscribers
//! connect and say which topics they want; each message goes to every
//! subscriber whose topic it matches, through a bounded queue per
//! subscriber (a subscriber that falls behind loses messages, as with
//! libzmq's high-water mark, and slows no one else).

use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::Error;
use crate::codec::{self, Command, Incoming, SocketType};
use crate::conn::{self, Conn};
use crate::endpoint::Endpoint;
use crate::peers::{self, Options, PeerId, Stats};

/// Messages queued for one subscriber before it loses them.
const HIGH_WATER: usize = 10_000;

struct Subscriber {
    id: PeerId,
    topics: Arc<Mutex<Vec<Bytes>>>,
    tx: mpsc::Sender<Bytes>,
}

type Subscribers = Arc<Mutex<Vec<Subscriber>>>;

/// A PUB socket bound for subscribers.
#[derive(Debug)]
pub struct Pub {
    subscribers: Subscribers,
    endpoint: Endpoint,
    stats: Arc<Stats>,
    _tasks: JoinSet<()>,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriber").field("id", &self.id).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves one subscriber: its subscriptions in, its messages out.
async fn serve(conn: Conn, id: PeerId, subscribers: Subscribers) {
    let topics = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = mpsc::channel::<Bytes>(HIGH_WATER);
    lock(&subscribers).push(Subscriber {
        id,
        topics: Arc::clone(&topics),
        tx,
    });
    let (mut reader, mut writer, _) = conn.split();
    loop {
        tokio::select! {
            incoming = reader.next() => {
                // Subscriptions come as 0x01/0x00-prefixed messages (ZMTP
                // 3.0) or SUBSCRIBE/CANCEL commands (3.1).
                let (subscribe, topic) = match incoming {
                    Ok(Incoming::Message(frames)) => match frames.first() {
                        Some(f) if f.first() == Some(&1) => (true, f.slice(1..)),
                        Some(f) if f.first() == Some(&0) => (false, f.slice(1..)),
                        _ => continue,
                    },
                    Ok(Incoming::Command(Command::Subscribe(t))) => (true, t),
                    Ok(Incoming::Command(Command::Cancel(t))) => (false, t),
                    Ok(Incoming::Command(Command::Ping { context })) => {
                        let mut out = Vec::new();
                        codec::encode_pong(&mut out, &context);
                        if conn::write(&mut writer, &out).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    Ok(Incoming::Command(_)) => continue,
                    Err(_) => break,
                };
                let mut t = lock(&topics);
                if subscribe {
                    t.push(topic);
                } else if let Some(i) = t.iter().position(|x| *x == topic) {
                    t.swap_remove(i);
                }
            }
            out = rx.recv() => match out {
                Some(bytes) => {
                    if conn::write(&mut writer, &bytes).await.is_err() {
                        break;
                    }
                }
                None => break,
            },
        }
    }
    lock(&subscribers).retain(|s| s.id != id);
}

impl Pub {
    /// Binds `endpoint` for subscribers (as [`Options`] allows).
    pub async fn bind(endpoint: &str, options: &Options) -> Result<Pub, Error> {
        let stats = Arc::new(Stats::default());
        let subscribers: Subscribers = Arc::default();
        let mut tasks = JoinSet::new();
        let serving = Arc::clone(&subscribers);
        let endpoint = peers::listen(
            endpoint,
            SocketType::Pub,
            options,
            &stats,
            &mut tasks,
            |_, _| {},
            move |conn, id| serve(conn, id, Arc::clone(&serving)),
        )
        .await?;
        Ok(Pub {
            subscribers,
            endpoint,
            stats,
            _tasks: tasks,
        })
    }

    /// Queues a message for every subscriber of its first frame's topic;
    /// how many subscribers it was queued for. Never waits.
    pub fn send<B: AsRef<[u8]>>(&self, frames: &[B]) -> usize {
        let mut out = BytesMut::with_capacity(frames.iter().map(|f| f.as_ref().len() + 9).sum());
        codec::encode_message(&mut out, frames);
        let bytes = out.freeze();
        let topic = frames.first().map_or(&[][..], |f| f.as_ref());
        let subscribers = lock(&self.subscribers);
        let mut queued = 0;
        for s in subscribers.iter() {
            let wants = lock(&s.topics).iter().any(|t| topic.starts_with(t));
            if wants && s.tx.try_send(bytes.clone()).is_ok() {
                queued += 1;
            }
        }
        queued
    }

    /// Subscribers connected now that have subscribed to something.
    pub fn subscribers(&self) -> usize {
        lock(&self.subscribers)
            .iter()
            .filter(|s| !lock(&s.topics).is_empty())
            .count()
    }

    /// The bound endpoint (with its real port).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}
