//! The optional HTTP metrics listener (`metrics.listen`): a thread that
//! answers `GET /metrics` with the latest OpenMetrics rendering, which the
//! routing loop refreshes about once a second. It never touches routing
//! state, so a slow scraper cannot slow the loop. Connections are kept
//! alive (HTTP/1.1), as Prometheus and kvedge's own scraper expect: a new
//! TCP connection per scrape costs both ends more than the scrape itself.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Connections served at once; more are closed as they arrive.
pub const MAX_CONNECTIONS: usize = 16;
/// The largest request head read; a longer one gets 431 and is closed.
const MAX_HEAD: usize = 8 * 1024;
/// An idle kept-alive connection is closed after this long.
const IDLE: Duration = Duration::from_secs(30);
/// A reply not taken within this long closes the connection.
const WRITE: Duration = Duration::from_secs(2);

/// Serves the latest rendering on `addr` over HTTP (`GET /metrics`), from a
/// thread of its own (and one per connection, at most
/// [`MAX_CONNECTIONS`]); the routing loop refreshes `latest` about once a
/// second. Binding errors are returned at once.
pub fn serve_http(addr: &str, latest: Arc<Mutex<String>>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr)?;
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("kvedge-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                if open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                    open.fetch_sub(1, Ordering::AcqRel);
                    continue; // dropped: closed
                }
                let (latest, open) = (Arc::clone(&latest), Arc::clone(&open));
                let spawned = std::thread::Builder::new()
                    .name("kvedge-metrics-conn".into())
                    .spawn(move || {
                        serve_connection(stream, &latest);
                        open.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    // The closure (and its count) went with the error.
                    tracing::warn!("the metrics listener could not start a thread");
                }
            }
        })?;
    Ok(())
}

/// Answers the requests of one connection until it closes, asks to close,
/// idles for [`IDLE`] or sends something that is not a request head.
fn serve_connection(mut stream: TcpStream, latest: &Mutex<String>) {
    if stream.set_read_timeout(Some(IDLE)).is_err()
        || stream.set_write_timeout(Some(WRITE)).is_err()
    {
        return;
    }
    let mut buf = vec![0u8; MAX_HEAD];
    let mut filled = 0;
    loop {
        let end = loop {
            if let Some(i) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if filled == buf.len() {
                let _ = stream.write_all(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                return;
            }
            match stream.read(&mut buf[filled..]) {
                Ok(0) | Err(_) => return,
                Ok(n) => filled += n,
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let request_line = head.lines().next().unwrap_or("");
        let http10 = request_line.ends_with("http/1.0");
        let header = |name: &str| {
            head.lines()
                .skip(1)
                .filter_map(|l| l.split_once(':'))
                .find(|(n, _)| n.trim() == name)
                .map(|(_, v)| v.trim().to_owned())
        };
        let connection = header("connection").unwrap_or_default();
        // A body (GET has none) is not read: such a request ends the
        // connection after its answer.
        let has_body = header("content-length").is_some_and(|v| v != "0")
            || header("transfer-encoding").is_some();
        let close = has_body
            || connection.contains("close")
            || (http10 && !connection.contains("keep-alive"));
        let (status, body) = if request_line.starts_with("get /metrics ")
            || request_line.starts_with("get /metrics?")
        {
            let text = latest.lock().map(|t| t.clone()).unwrap_or_default();
            ("200 OK", text)
        } else {
            ("404 Not Found", "try /metrics\n".to_owned())
        };
        let reply = format!(
            "HTTP/1.{} {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\n{}\r\n{body}",
            u8::from(!http10),
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        );
        if stream.write_all(reply.as_bytes()).is_err() || close {
            return;
        }
        buf.copy_within(end..filled, 0);
        filled -= end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    fn serve(text: &str) -> std::net::SocketAddr {
        // Bind to learn a free port, then serve on it.
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        serve_http(&addr.to_string(), Arc::new(Mutex::new(text.to_owned()))).unwrap();
        addr
    }

    /// Reads one response: its status line and body.
    fn response(r: &mut std::io::BufReader<TcpStream>) -> (String, String) {
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        let mut len = 0;
        loop {
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        (status.trim().to_owned(), String::from_utf8(body).unwrap())
    }

    #[test]
    fn scrapes_share_one_kept_alive_connection() {
        let addr = serve("kvedge_up 1\n# EOF\n");
        let mut s = TcpStream::connect(addr).unwrap();
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        for _ in 0..3 {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            assert_eq!(
                response(&mut r),
                ("HTTP/1.1 200 OK".into(), "kvedge_up 1\n# EOF\n".into())
            );
        }
        // Two requests in one write, the second asking to close.
        s.write_all(
            b"GET /nope HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        assert_eq!(response(&mut r).0, "HTTP/1.1 404 Not Found");
        assert_eq!(response(&mut r).0, "HTTP/1.1 200 OK");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "closed after the answer");
    }

    #[test]
    fn an_oversized_head_gets_431_and_a_closed_connection() {
        let addr = serve("x");
        let mut s = TcpStream::connect(addr).unwrap();
        let head = format!(
            "GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(MAX_HEAD)
        );
        let _ = s.write_all(head.as_bytes());
        let mut r = std::io::BufReader::new(s);
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        assert!(status.starts_with("HTTP/1.1 431"), "{status}");
    }

    #[test]
    fn connections_beyond_the_limit_are_closed_and_the_rest_served() {
        let addr = serve("y");
        let held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // Let the listener count them (a test thread, not the routing loop).
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(100));
        let mut extra = TcpStream::connect(addr).unwrap();
        extra
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = extra.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
        let mut out = Vec::new();
        let n = extra.read_to_end(&mut out).unwrap_or(0);
        assert_eq!(n, 0, "closed unanswered");
        // A held one is served.
        let mut s = held.into_iter().next().unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(
            out.starts_with("HTTP/1.0 200 OK") && out.ends_with("\r\n\r\ny"),
            "{out}"
        );
    }
}
