//! What every socket shares about its peers: who may connect ([`Allow`]),
//! the caps and timeouts they are held to ([`Options`]), the counts of
//! what was refused ([`Stats`]), and the two ways a connection starts:
//! dialled, or accepted by a bound socket's loop, which refuses peers
//! from other addresses or past the socket's limit before their first
//! byte is read and gives each accepted peer a task of its own.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use ipnet::IpNet;
use tokio::task::JoinSet;

use crate::Error;
use crate::codec::{Limits, SocketType};
use crate::conn::Conn;
use crate::endpoint::{Endpoint, Listener, PeerAddr, Stream};

/// The addresses a bound socket takes peers from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allow {
    nets: Vec<IpNet>,
}

impl Allow {
    /// Loopback only (127.0.0.0/8 and ::1).
    pub fn loopback() -> Allow {
        Allow {
            nets: vec![
                IpNet::new(IpAddr::from([127, 0, 0, 0]), 8).expect("a valid prefix"),
                IpNet::new(IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]), 128).expect("a valid prefix"),
            ],
        }
    }

    /// Every address (for a socket whose peers are not trusted with
    /// anything, such as a publisher's subscribers).
    pub fn any() -> Allow {
        Allow {
            nets: vec![
                IpNet::new(IpAddr::from([0, 0, 0, 0]), 0).expect("a valid prefix"),
                IpNet::new(IpAddr::from([0u16; 8]), 0).expect("a valid prefix"),
            ],
        }
    }

    /// Exactly these ranges.
    pub fn only(nets: impl IntoIterator<Item = IpNet>) -> Allow {
        Allow {
            nets: nets.into_iter().collect(),
        }
    }

    /// Whether a peer at `addr` may connect (a Unix-socket peer always
    /// may: the socket file's permissions decide).
    pub fn permits(&self, addr: &PeerAddr) -> bool {
        match addr {
            PeerAddr::Unix => true,
            PeerAddr::Tcp(a) => {
                let ip = a.ip().to_canonical();
                self.nets.iter().any(|n| n.contains(&ip))
            }
        }
    }

    pub fn nets(&self) -> &[IpNet] {
        &self.nets
    }
}

/// How a socket treats its peers.
#[derive(Clone, Debug)]
pub struct Options {
    pub limits: Limits,
    /// Greeting and READY must both arrive within this.
    pub handshake_timeout: Duration,
    /// A connection attempt (connecting sockets).
    pub connect_timeout: Duration,
    /// Peers at once (bound sockets; more are closed as they come).
    pub max_peers: usize,
    /// Who may connect (bound sockets).
    pub allow: Allow,
    /// Messages read ahead of the consumer before reading stops (and the
    /// peers' TCP windows fill).
    pub queue: usize,
    /// A peer silent this long is disconnected (SUB sockets; none by
    /// default).
    pub idle_timeout: Option<Duration>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            limits: Limits::default(),
            handshake_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_millis(500),
            max_peers: 8,
            allow: Allow::loopback(),
            queue: 8,
            idle_timeout: None,
        }
    }
}

/// Counts of what a socket refused, kept for its owner to report.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections from an address [`Allow`] does not permit.
    pub refused_address: AtomicU64,
    /// Connections past [`Options::max_peers`].
    pub refused_full: AtomicU64,
    /// Handshakes that failed or took too long.
    pub failed_handshakes: AtomicU64,
    /// Peers cut off for breaking the protocol or a cap.
    pub broke_protocol: AtomicU64,
    /// Peers connected now (handshaking included).
    pub peers: AtomicUsize,
}

/// A peer's number within its socket (from 1, never reused).
pub type PeerId = u64;

/// Counts a connection for as long as it lives.
struct Counted(Arc<Stats>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.peers.fetch_sub(1, Relaxed);
    }
}

/// Connects to `endpoint` and greets it as a socket of type `ours`.
pub(crate) async fn dial(
    endpoint: &str,
    ours: SocketType,
    options: &Options,
) -> Result<(Conn, Endpoint), Error> {
    let endpoint = Endpoint::parse(endpoint).map_err(Error::Endpoint)?;
    let stream =
        match tokio::time::timeout(options.connect_timeout, Stream::connect(&endpoint)).await {
            Ok(s) => s?,
            Err(_) => return Err(Error::Timeout("connecting")),
        };
    let addr = match &stream {
        Stream::Tcp(s) => PeerAddr::Tcp(s.peer_addr()?),
        Stream::Unix(_) => PeerAddr::Unix,
    };
    let conn = Conn::handshake(
        stream,
        addr,
        ours,
        false,
        options.limits,
        options.handshake_timeout,
    )
    .await?;
    Ok((conn, endpoint))
}

/// Binds `endpoint` and spawns its accept loop into `tasks`: each peer
/// that is allowed, within the limit, and greets as a socket `ours` may
/// talk to is handed to `serve`; the others are counted in `stats` and
/// told to `refused`.
pub(crate) async fn listen<S, F>(
    endpoint: &str,
    ours: SocketType,
    options: &Options,
    stats: &Arc<Stats>,
    tasks: &mut JoinSet<()>,
    refused: impl Fn(PeerAddr, String) + Send + Sync + 'static,
    serve: S,
) -> Result<Endpoint, Error>
where
    S: Fn(Conn, PeerId) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (serve, refused) = (Arc::new(serve), Arc::new(refused));
    let endpoint = Endpoint::parse(endpoint).map_err(Error::Endpoint)?;
    let listener = Listener::bind(&endpoint).await?;
    let bound = listener.endpoint()?;
    let (options, stats) = (options.clone(), Arc::clone(stats));
    tasks.spawn(async move {
        let mut peers = JoinSet::new();
        let mut next_id: PeerId = 0;
        loop {
            while peers.try_join_next().is_some() {}
            let (stream, addr) = match listener.accept().await {
                Ok(x) => x,
                Err(_) => {
                    // Out of descriptors, or a connection reset before it
                    // was accepted: pause rather than spin on the error.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let refusal = if !options.allow.permits(&addr) {
                stats.refused_address.fetch_add(1, Relaxed);
                Some("its address is not allowed")
            } else if stats.peers.load(Relaxed) >= options.max_peers {
                stats.refused_full.fetch_add(1, Relaxed);
                Some("the socket has its most peers already")
            } else {
                None
            };
            if let Some(why) = refusal {
                drop(stream);
                refused(addr, why.to_owned());
                continue;
            }
            stats.peers.fetch_add(1, Relaxed);
            let counted = Counted(Arc::clone(&stats));
            next_id += 1;
            let (id, serve, refused) = (next_id, Arc::clone(&serve), Arc::clone(&refused));
            let (limits, deadline) = (options.limits, options.handshake_timeout);
            peers.spawn(async move {
                match Conn::handshake(stream, addr, ours, true, limits, deadline).await {
                    Ok(conn) => serve(conn, id).await,
                    Err(e) => {
                        counted.0.failed_handshakes.fetch_add(1, Relaxed);
                        refused(addr, format!("its handshake failed: {e}"));
                    }
                }
                drop(counted);
            });
        }
    });
    Ok(bound)
}
