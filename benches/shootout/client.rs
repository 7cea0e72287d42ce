//! The shoot-out's client: replays a trace open-loop (each request at its
//! timestamp, whatever the earlier ones are doing) against a router's
//! OpenAI-compatible front door, streaming, one connection a request.
//! Time to first token is when the first server-sent event arrives;
//! the prompt and cached token counts are the engine's own `usage`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Requests in flight at most; one more is counted as an error.
const MAX_IN_FLIGHT: usize = 512;
/// A request's whole time at most.
const DEADLINE: Duration = Duration::from_secs(120);

/// What one request saw.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The error, if it failed (status, transport, or no usage).
    pub error: Option<String>,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The engine that answered (its `system_fingerprint`).
    pub engine: String,
}

/// One request to send: when (ms from the start), the prompt, how many
/// tokens to generate.
pub struct Send {
    pub at_ms: u64,
    pub prompt: String,
    pub max_tokens: u32,
}

/// Replays `sends` against `addr`; one outcome per send, in order.
pub fn replay(addr: SocketAddr, model: &str, sends: &[Send]) -> Vec<Outcome> {
    let out: Vec<Mutex<Outcome>> = sends.iter().map(|_| Mutex::default()).collect();
    let in_flight = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (i, send) in sends.iter().enumerate() {
            let due = start + Duration::from_millis(send.at_ms);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
                in_flight.fetch_sub(1, Ordering::AcqRel);
                *out[i].lock().unwrap() = Outcome {
                    error: Some("the client's in-flight limit".into()),
                    ..Outcome::default()
                };
                continue;
            }
            let (slot, in_flight) = (&out[i], &in_flight);
            scope.spawn(move || {
                let o = one(addr, model, send);
                *slot.lock().unwrap() = o;
                in_flight.fetch_sub(1, Ordering::AcqRel);
            });
        }
    });
    out.into_iter().map(|m| m.into_inner().unwrap()).collect()
}

fn failed(e: impl Into<String>) -> Outcome {
    Outcome {
        error: Some(e.into()),
        ..Outcome::default()
    }
}

fn one(addr: SocketAddr, model: &str, send: &Send) -> Outcome {
    let body = json!({"model": model, "prompt": send.prompt, "max_tokens": send.max_tokens,
                      "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let t0 = Instant::now();
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => return failed(format!("connect: {e}")),
    };
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(DEADLINE));
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\naccept: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if let Err(e) = s
        .write_all(head.as_bytes())
        .and_then(|()| s.write_all(body.as_bytes()))
    {
        return failed(format!("send: {e}"));
    }
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    let mut ttft = None;
    let mut body_at = None;
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return failed(format!("receive: {e}")),
        }
        if body_at.is_none() {
            body_at = find(&buf, b"\r\n\r\n").map(|i| i + 4);
        }
        if ttft.is_none()
            && let Some(b) = body_at
            && find(&buf[b..], b"data:").is_some()
        {
            ttft = Some(t0.elapsed());
        }
        if t0.elapsed() > DEADLINE {
            return failed("past the deadline");
        }
    }
    let e2e = t0.elapsed();
    let Some(b) = body_at else {
        return failed("no response head");
    };
    let head = String::from_utf8_lossy(&buf[..b]);
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(&buf[b..])
    } else {
        buf[b..].to_vec()
    };
    let text = String::from_utf8_lossy(&body);
    if status != 200 {
        return failed(format!("status {status}: {}", text.trim()));
    }
    let mut o = Outcome {
        ttft_ms: ttft.unwrap_or(e2e).as_secs_f64() * 1000.0,
        e2e_ms: e2e.as_secs_f64() * 1000.0,
        ..Outcome::default()
    };
    let mut usage = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        if let Some(e) = v.get("error") {
            return failed(format!("stream error: {e}"));
        }
        if let Some(f) = v["system_fingerprint"].as_str() {
            o.engine = f.to_owned();
        }
        if v["usage"].is_object() {
            usage = true;
            o.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            o.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    }
    if !usage {
        return failed("the stream carried no usage");
    }
    o
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The data of a chunked body (what is cut short is kept as far as it
/// goes).
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    while let Some(eol) = find(b, b"\r\n") {
        let size = std::str::from_utf8(&b[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok());
        let Some(size) = size else { break };
        if size == 0 {
            break;
        }
        let start = eol + 2;
        let end = (start + size).min(b.len());
        out.extend_from_slice(&b[start..end]);
        b = &b[(end + 2).min(b.len())..];
    }
    out
}
