//! The optional HTTP metrics listener (`metrics.listen`): a thread that
//! answers `GET /metrics` with the latest OpenMetrics rendering, which the
//! routing loop refreshes about once a second. It never touches routing
//! state, so a slow scraper cannot slow the loop.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Serves the latest rendering on `addr` over HTTP (`GET /metrics`), from a
/// thread of its own; the routing loop refreshes `latest` about once a
/// second. Binding errors are returned at once.
pub fn serve_http(addr: &str, latest: Arc<Mutex<String>>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr)?;
    std::thread::Builder::new()
        .name("kvedge-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
                let mut req = [0u8; 1024];
                let n = stream.read(&mut req).unwrap_or(0);
                let head = String::from_utf8_lossy(&req[..n]);
                let (status, body) = if head.starts_with("GET /metrics") {
                    let text = latest.lock().map(|t| t.clone()).unwrap_or_default();
                    ("200 OK", text)
                } else {
                    ("404 Not Found", "try /metrics\n".to_owned())
                };
                let _ = write!(
                    stream,
                    "HTTP/1.0 {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })?;
    Ok(())
}
