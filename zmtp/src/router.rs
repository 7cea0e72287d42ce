//! A bound ROUTER socket, as an engine's replay socket is: each peer gets
//! an identity (the one its READY named, else one made here), every
//! message it sends comes out with that identity as its first frame, and
//! a message sent with an identity first goes to that peer (to none if it
//! has gone, as ZeroMQ does).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::Error;
use crate::codec::{self, Command, Incoming, SocketType};
use crate::conn::{self, Conn};
use crate::endpoint::Endpoint;
use crate::peers::{self, Options, PeerId, Stats};

/// Messages queued for one peer; a sender waits when it is full.
const QUEUE: usize = 64;

type Routes = Arc<Mutex<HashMap<Bytes, mpsc::Sender<Bytes>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A ROUTER socket bound for peers.
#[derive(Debug)]
pub struct Router {
    rx: mpsc::Receiver<Vec<Bytes>>,
    routes: Routes,
    endpoint: Endpoint,
    stats: Arc<Stats>,
    _tasks: JoinSet<()>,
}

async fn serve(conn: Conn, id: PeerId, routes: Routes, inbox: mpsc::Sender<Vec<Bytes>>) {
    let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUE);
    let identity = {
        let mut r = lock(&routes);
        let named = &conn.peer.identity;
        let identity = if !named.is_empty() && !r.contains_key(named) {
            named.clone()
        } else {
            // libzmq's form: a zero byte, then a number.
            let mut made = vec![0u8];
            made.extend_from_slice(&(id as u32).to_be_bytes());
            Bytes::from(made)
        };
        r.insert(identity.clone(), tx);
        identity
    };
    let (mut reader, mut writer, _) = conn.split();
    loop {
        tokio::select! {
            incoming = reader.next() => match incoming {
                Ok(Incoming::Message(mut frames)) => {
                    frames.insert(0, identity.clone());
                    if inbox.send(frames).await.is_err() {
                        break;
                    }
                }
                Ok(Incoming::Command(Command::Ping { context })) => {
                    let mut out = Vec::new();
                    codec::encode_pong(&mut out, &context);
                    if conn::write(&mut writer, &out).await.is_err() {
                        break;
                    }
                }
                Ok(Incoming::Command(_)) => {}
                Err(_) => break,
            },
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
    lock(&routes).remove(&identity);
}

impl Router {
    /// Binds `endpoint` for peers (as [`Options`] allows).
    pub async fn bind(endpoint: &str, options: &Options) -> Result<Router, Error> {
        let stats = Arc::new(Stats::default());
        let routes: Routes = Arc::default();
        let (inbox, rx) = mpsc::channel(options.queue.max(1));
        let mut tasks = JoinSet::new();
        let serving = Arc::clone(&routes);
        let endpoint = peers::listen(
            endpoint,
            SocketType::Router,
            options,
            &stats,
            &mut tasks,
            |_, _| {},
            move |conn, id| serve(conn, id, Arc::clone(&serving), inbox.clone()),
        )
        .await?;
        Ok(Router {
            rx,
            routes,
            endpoint,
            stats,
            _tasks: tasks,
        })
    }

    /// The next message, its sender's identity first.
    pub async fn recv(&mut self) -> Option<Vec<Bytes>> {
        self.rx.recv().await
    }

    /// Sends `frames[1..]` to the peer named by `frames[0]`, waiting while
    /// its queue is full; a peer that has gone gets nothing.
    pub async fn send<B: AsRef<[u8]>>(&self, frames: &[B]) -> Result<(), Error> {
        let Some((identity, rest)) = frames.split_first() else {
            return Ok(());
        };
        let Some(tx) = lock(&self.routes).get(identity.as_ref()).cloned() else {
            return Ok(());
        };
        let mut out = BytesMut::with_capacity(rest.iter().map(|f| f.as_ref().len() + 9).sum());
        codec::encode_message(&mut out, rest);
        // A peer that went away meanwhile gets nothing, as above.
        let _ = tx.send(out.freeze()).await;
        Ok(())
    }

    /// The bound endpoint (with its real port).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}
