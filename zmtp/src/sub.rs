//! The SUB socket that reads an engine's events, and the DEALER that asks
//! its replay socket.
//!
//! A connecting [`Sub`] has one peer, the engine's PUB, which it reads in
//! [`Sub::recv`] itself. A bound one takes peers that connect to it
//! (engines started with a `tcp://host:port` endpoint connect rather than
//! bind), each on a task of its own feeding one queue: only from
//! the addresses [`Allow`] permits, at most [`Options::max_peers`] at a
//! time, each finishing its handshake within
//! [`Options::handshake_timeout`]. Every message comes out tagged with the
//! peer it came from, and joins and departures are events too, so the
//! reader can tell one publisher from another.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::Error;
use crate::codec::{self, Incoming, SocketType};
use crate::conn::Conn;
use crate::endpoint::{Endpoint, PeerAddr};
use crate::peers::{self, Options, PeerId, Stats};

/// What a SUB socket hears.
#[derive(Debug)]
pub enum SubEvent {
    /// A peer finished its handshake and has our subscriptions.
    Joined { peer: PeerId, addr: PeerAddr },
    /// A message on a subscribed topic.
    Message { peer: PeerId, frames: Vec<Bytes> },
    /// A peer's connection ended ([`Error::Closed`] when it simply closed).
    Left { peer: PeerId, error: Error },
    /// A connection that was refused or failed its handshake (reported
    /// when the queue has room; always counted in [`Stats`]).
    Refused { addr: PeerAddr, why: String },
}

/// A SUB socket, connected to one publisher or bound for many.
#[derive(Debug)]
pub struct Sub {
    peers: Peers,
    stats: Arc<Stats>,
    endpoint: Endpoint,
}

#[derive(Debug)]
enum Peers {
    /// A connecting socket reads its one peer itself, in [`Sub::recv`]:
    /// no task and no queue between the socket and its reader.
    One(Box<One>),
    /// A bound socket's peers each have a task, feeding one queue.
    Many {
        rx: mpsc::Receiver<SubEvent>,
        /// Dropping the socket aborts its tasks (and closes its peers).
        _tasks: JoinSet<()>,
    },
}

#[derive(Debug)]
struct One {
    conn: Conn,
    topics: Arc<[Bytes]>,
    idle: Option<Duration>,
    /// Joined told; Left told.
    joined: bool,
    ended: bool,
}

fn topic_matches(topics: &[Bytes], frames: &[Bytes]) -> bool {
    let first = frames.first().map_or(&[][..], |f| &f[..]);
    topics.iter().any(|t| first.starts_with(t))
}

/// Subscription messages for `topics`.
fn subscriptions(topics: &[Bytes]) -> Vec<u8> {
    let mut out = Vec::new();
    for t in topics {
        codec::encode_subscription(&mut out, t);
    }
    out
}

/// The next command or message from `conn`, or an error after `idle` of
/// silence. Cancel-safe.
async fn read(conn: &mut Conn, idle: Option<Duration>) -> Result<Incoming, Error> {
    match idle {
        Some(idle) => match tokio::time::timeout(idle, conn.next()).await {
            Ok(n) => n,
            Err(_) => Err(Error::Timeout("a silence")),
        },
        None => conn.next().await,
    }
}

/// Serves one peer of a SUB socket until it leaves or the socket closes.
async fn read_peer(
    mut conn: Conn,
    peer: PeerId,
    topics: Arc<[Bytes]>,
    tx: mpsc::Sender<SubEvent>,
    stats: Arc<Stats>,
    idle: Option<Duration>,
) {
    if let Err(error) = conn.write(&subscriptions(&topics)).await {
        let _ = tx.send(SubEvent::Left { peer, error }).await;
        return;
    }
    let addr = conn.peer.addr;
    if tx.send(SubEvent::Joined { peer, addr }).await.is_err() {
        return;
    }
    let error = loop {
        match read(&mut conn, idle).await {
            Ok(Incoming::Message(frames)) => {
                if topic_matches(&topics, &frames)
                    && tx.send(SubEvent::Message { peer, frames }).await.is_err()
                {
                    return;
                }
            }
            // A publisher has nothing to command a subscriber.
            Ok(Incoming::Command(_)) => {}
            Err(e) => break e,
        }
    };
    if error.is_protocol() {
        stats.broke_protocol.fetch_add(1, Relaxed);
    }
    let _ = tx.send(SubEvent::Left { peer, error }).await;
}

impl Sub {
    /// Connects to the publisher at `endpoint` and subscribes to `topics`
    /// (an empty topic is every message). Errors if it cannot connect or
    /// greet within the options' timeouts. When the connection ends,
    /// [`Sub::recv`] returns a `Left` and then `None`.
    pub async fn connect(
        endpoint: &str,
        topics: &[&[u8]],
        options: &Options,
    ) -> Result<Sub, Error> {
        let (mut conn, endpoint) = peers::dial(endpoint, SocketType::Sub, options).await?;
        let topics: Arc<[Bytes]> = topics.iter().map(|t| Bytes::copy_from_slice(t)).collect();
        conn.write(&subscriptions(&topics)).await?;
        let stats = Arc::new(Stats::default());
        stats.peers.store(1, Relaxed);
        Ok(Sub {
            peers: Peers::One(Box::new(One {
                conn,
                topics,
                idle: options.idle_timeout,
                joined: false,
                ended: false,
            })),
            stats,
            endpoint,
        })
    }

    /// Binds `endpoint` and takes publishers that connect (as
    /// [`Options`] allows), subscribing each to `topics`.
    pub async fn bind(endpoint: &str, topics: &[&[u8]], options: &Options) -> Result<Sub, Error> {
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel(options.queue.max(1));
        let topics: Arc<[Bytes]> = topics.iter().map(|t| Bytes::copy_from_slice(t)).collect();
        let mut tasks = JoinSet::new();
        let told = tx.clone();
        let peer_stats = Arc::clone(&stats);
        let idle = options.idle_timeout;
        let endpoint = peers::listen(
            endpoint,
            SocketType::Sub,
            options,
            &stats,
            &mut tasks,
            move |addr, why| {
                let _ = told.try_send(SubEvent::Refused { addr, why });
            },
            move |conn, id| {
                read_peer(
                    conn,
                    id,
                    Arc::clone(&topics),
                    tx.clone(),
                    Arc::clone(&peer_stats),
                    idle,
                )
            },
        )
        .await?;
        Ok(Sub {
            peers: Peers::Many { rx, _tasks: tasks },
            stats,
            endpoint,
        })
    }

    /// The next event; `None` once no peer can send any more (a
    /// connecting socket whose connection ended). Cancel-safe.
    pub async fn recv(&mut self) -> Option<SubEvent> {
        let one = match &mut self.peers {
            Peers::Many { rx, .. } => return rx.recv().await,
            Peers::One(one) => one,
        };
        if one.ended {
            return None;
        }
        if !std::mem::replace(&mut one.joined, true) {
            let addr = one.conn.peer.addr;
            return Some(SubEvent::Joined { peer: 1, addr });
        }
        let error = loop {
            match read(&mut one.conn, one.idle).await {
                Ok(Incoming::Message(frames)) if topic_matches(&one.topics, &frames) => {
                    return Some(SubEvent::Message { peer: 1, frames });
                }
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        if error.is_protocol() {
            self.stats.broke_protocol.fetch_add(1, Relaxed);
        }
        self.stats.peers.store(0, Relaxed);
        one.ended = true;
        Some(SubEvent::Left { peer: 1, error })
    }

    /// The endpoint connected to, or bound (with its real port).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}

/// A DEALER connected to one ROUTER (an engine's replay socket).
#[derive(Debug)]
pub struct Dealer {
    conn: Conn,
}

impl Dealer {
    pub async fn connect(endpoint: &str, options: &Options) -> Result<Dealer, Error> {
        let (conn, _) = peers::dial(endpoint, SocketType::Dealer, options).await?;
        Ok(Dealer { conn })
    }

    pub async fn send<B: AsRef<[u8]>>(&mut self, frames: &[B]) -> Result<(), Error> {
        self.conn.send(frames).await
    }

    /// The next message (commands other than PING are ignored).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, Error> {
        loop {
            if let Incoming::Message(m) = self.conn.next().await? {
                return Ok(m);
            }
        }
    }
}
