//! Where a socket connects or binds: `tcp://host:port` or `ipc://path`,
//! and the stream either gives.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// A ZeroMQ endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://host:port`; `*` as the host binds every address.
    Tcp { host: String, port: u16 },
    /// `ipc://path`, a Unix socket.
    Ipc(PathBuf),
}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Endpoint, String> {
        if let Some(path) = s.strip_prefix("ipc://") {
            if path.is_empty() {
                return Err(format!("`{s}` names no socket path"));
            }
            return Ok(Endpoint::Ipc(path.into()));
        }
        let Some(addr) = s.strip_prefix("tcp://") else {
            return Err(format!("`{s}` is neither tcp://host:port nor ipc://path"));
        };
        match addr.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() => match port.parse::<u16>() {
                Ok(port) => Ok(Endpoint::Tcp {
                    host: host.to_owned(),
                    port,
                }),
                Err(_) => Err(format!("`{s}` has no port")),
            },
            _ => Err(format!("`{s}` has no host:port")),
        }
    }

    /// `host:port` as the socket API takes it (`*` is every address).
    fn tcp_addr(host: &str, port: u16) -> String {
        let host = if host == "*" { "0.0.0.0" } else { host };
        format!("{host}:{port}")
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
            Endpoint::Ipc(p) => write!(f, "ipc://{}", p.display()),
        }
    }
}

/// Who is at the other end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAddr {
    Tcp(SocketAddr),
    /// A Unix-socket peer (no address; the socket file's permissions say
    /// who may connect).
    Unix,
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Tcp(a) => a.fmt(f),
            PeerAddr::Unix => f.write_str("a Unix-socket peer"),
        }
    }
}

/// A connected byte stream of either kind.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// Idle time before TCP keepalive probes, so that a peer that vanished
/// without closing (a host gone, a cable pulled) is noticed in about a
/// minute rather than after the kernel's two hours.
const KEEPALIVE: Duration = Duration::from_secs(30);

fn keepalive(s: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE)
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    // Best effort: a socket without keepalive still works.
    let _ = socket2::SockRef::from(s).set_tcp_keepalive(&ka);
    let _ = s.set_nodelay(true);
}

impl Stream {
    /// Connects to `endpoint`.
    pub async fn connect(endpoint: &Endpoint) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Tcp { host, port } => {
                let s = TcpStream::connect(Endpoint::tcp_addr(host, *port)).await?;
                keepalive(&s);
                Ok(Stream::Tcp(s))
            }
            Endpoint::Ipc(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
        }
    }
}

/// A bound listener of either kind.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `endpoint`; an `ipc://` path left by an earlier process is
    /// replaced (as libzmq does), anything else there is an error.
    pub async fn bind(endpoint: &Endpoint) -> io::Result<Listener> {
        match endpoint {
            Endpoint::Tcp { host, port } => Ok(Listener::Tcp(
                TcpListener::bind(Endpoint::tcp_addr(host, *port)).await?,
            )),
            Endpoint::Ipc(path) => {
                use std::os::unix::fs::FileTypeExt;
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                    std::fs::remove_file(path)?;
                }
                Ok(Listener::Unix(UnixListener::bind(path)?, path.clone()))
            }
        }
    }

    /// The endpoint as bound (a tcp port of 0 becomes the real one).
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => {
                let a = l.local_addr()?;
                Ok(Endpoint::Tcp {
                    host: match a {
                        SocketAddr::V4(v4) => v4.ip().to_string(),
                        SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
                    },
                    port: a.port(),
                })
            }
            Listener::Unix(_, p) => Ok(Endpoint::Ipc(p.clone())),
        }
    }

    pub async fn accept(&self) -> io::Result<(Stream, PeerAddr)> {
        match self {
            Listener::Tcp(l) => {
                let (s, a) = l.accept().await?;
                keepalive(&s);
                Ok((Stream::Tcp(s), PeerAddr::Tcp(a)))
            }
            Listener::Unix(l, _) => {
                let (s, _) = l.accept().await?;
                Ok((Stream::Unix(s), PeerAddr::Unix))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_print() {
        for s in [
            "tcp://127.0.0.1:5557",
            "tcp://*:0",
            "tcp://[::1]:9",
            "ipc:///tmp/x",
        ] {
            assert_eq!(Endpoint::parse(s).unwrap().to_string(), s);
        }
        for bad in [
            "tcp://host",
            "tcp://:1",
            "udp://a:1",
            "ipc://",
            "tcp://a:99999",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
