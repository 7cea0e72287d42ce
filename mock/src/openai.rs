//! `kvedge mock-engine --http`: the mock engine's OpenAI-compatible front,
//! so a gateway can send it real requests. `/v1/completions` and
//! `/v1/chat/completions`, streamed (server-sent events) or not, and the
//! probes routers send first (`GET /health`, `GET /v1/models`), over
//! HTTP/1.1 with keep-alive. A prompt is tokenized with the model's
//! `tokenizer.json` and chat template exactly as kvedge's endpoint picker
//! does (the same code), hashed into KV blocks, and submitted to the
//! engine model through the engine's own request socket; the response
//! comes when the model says its first token and its last are done.
//!
//! The token ids of every block a request brings are remembered
//! ([`BlockTokens`]), so the engine's vLLM-format Stored events carry the
//! real token ids and kvedge, hashing them, finds the same blocks the
//! picker finds in a later prompt.
//!
//! With `--enable-scale-out`, as vLLM with that flag, it also renders a
//! request into its prompt's token ids without running it (`POST
//! /v1/completions/render`, `/v1/chat/completions/render`: a list of one
//! `GenerateRequest`), which routers such as vllm-router's `kv_aware` ask
//! for; without it those paths answer 403, as a vLLM started without it
//! does.
//!
//! Responses carry `x-kvedge-worker: <worker id>` (and the same in
//! `system_fingerprint`), and `usage.prompt_tokens_details.cached_tokens`
//! says how much of the prompt the engine found cached.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvedge_epp::body::{self, Route};
use kvedge_epp::tokenize::{ModelSpec, Models, PromptError, Tokens};
use serde_json::{Value, json};

/// Largest request body read (larger: 413).
const MAX_BODY: usize = 16 << 20;
/// Largest header section.
const MAX_HEADERS: usize = 64 << 10;
/// Longest prompt, in tokens.
const MAX_PROMPT_TOKENS: usize = 1 << 20;
/// `max_tokens` when the request gives none, and the most it may ask.
const DEFAULT_MAX_TOKENS: u32 = 16;
const MAX_MAX_TOKENS: u32 = 8192;

/// The token ids of blocks requests brought, by block hash, for the
/// engine's Stored events. Two generations: when the current one holds
/// `capacity` blocks it becomes the previous one (and the old previous
/// one goes), so a block is known for at least `capacity` newer blocks
/// after its last request: about the engine's whole pool when `capacity`
/// is a few times its size.
#[derive(Debug)]
pub struct BlockTokens {
    current: HashMap<u64, Box<[u32]>>,
    previous: HashMap<u64, Box<[u32]>>,
    capacity: usize,
}

impl BlockTokens {
    pub fn new(capacity: usize) -> Self {
        BlockTokens {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers `tokens` (whole blocks) under `hashes`, one block each.
    pub fn remember(&mut self, hashes: &[u64], tokens: &[u32], block_size: usize) {
        for (&h, block) in hashes.iter().zip(tokens.chunks_exact(block_size)) {
            if self.current.contains_key(&h) {
                continue;
            }
            let block = self
                .previous
                .remove(&h)
                .unwrap_or_else(|| block.to_vec().into_boxed_slice());
            if self.current.len() >= self.capacity {
                self.previous = std::mem::take(&mut self.current);
            }
            self.current.insert(h, block);
        }
    }

    /// The token ids of the block `hash`, if a request brought it.
    pub fn get(&self, hash: u64) -> Option<&[u32]> {
        self.current
            .get(&hash)
            .or_else(|| self.previous.get(&hash))
            .map(|b| &b[..])
    }
}

/// What the front needs.
#[derive(Debug, Clone)]
pub struct Front {
    pub worker_id: u64,
    pub model: String,
    pub block_size: u32,
    /// The engine's request socket.
    pub engine: PathBuf,
    pub blocks: Arc<Mutex<BlockTokens>>,
    /// Whether the render endpoints are served (vLLM's `--enable-scale-out`).
    pub scale_out: bool,
}

/// Loads the model's tokenizer and template (`tokenizer` may be absent:
/// then only token-id prompts are served).
pub fn load_models(
    model: &str,
    tokenizer: Option<&Path>,
    chat_template: Option<&Path>,
    bos_token: &str,
    eos_token: &str,
) -> Result<Models, String> {
    Models::load(&[ModelSpec {
        engine: Default::default(),
        name: model.to_owned(),
        tokenizer: tokenizer.map(Path::to_path_buf),
        chat_template: chat_template.map(Path::to_path_buf),
        bos_token: bos_token.to_owned(),
        eos_token: eos_token.to_owned(),
    }])
}

/// Binds `addr` and serves on threads of its own until the process ends.
pub fn serve(addr: &str, front: Front, models: Models) -> Result<(), String> {
    let listener = TcpListener::bind(addr).map_err(|e| format!("--http {addr}: {e}"))?;
    let shared = Arc::new((front, models));
    std::thread::Builder::new()
        .name("openai-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let shared = Arc::clone(&shared);
                let _ = std::thread::Builder::new()
                    .name("openai-conn".into())
                    .spawn(move || {
                        let _ = serve_connection(conn, &shared.0, &shared.1);
                    });
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// One HTTP request as read.
struct HttpRequest {
    method: String,
    path: String,
    body: Vec<u8>,
    close: bool,
}

/// Why a request could not be read: answered with this status, then the
/// connection is closed.
struct ReadError(u16, String);

fn serve_connection(conn: TcpStream, front: &Front, models: &Models) -> io::Result<()> {
    conn.set_nodelay(true)?;
    let mut r = BufReader::new(conn.try_clone()?);
    let mut w = conn;
    loop {
        let req = match read_request(&mut r) {
            Ok(Some(req)) => req,
            Ok(None) => return Ok(()),
            Err(ReadError(status, message)) => {
                error(&mut w, status, &message, true)?;
                return Ok(());
            }
        };
        respond(&mut w, &req, front, models)?;
        if req.close {
            return Ok(());
        }
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Result<Option<HttpRequest>, ReadError> {
    let bad = |m: &str| ReadError(400, m.to_owned());
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) | Err(_) => return Ok(None),
        Ok(_) => {}
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("a malformed request line"));
    };
    let mut close = version == "HTTP/1.0";
    let (mut length, mut chunked) = (None, false);
    let mut header_bytes = 0;
    loop {
        let mut h = String::new();
        let n = r.read_line(&mut h).map_err(|e| bad(&e.to_string()))?;
        header_bytes += n;
        if n == 0 || header_bytes > MAX_HEADERS {
            return Err(bad("the headers are cut short or too large"));
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let Some((k, v)) = h.split_once(':') else {
            return Err(bad("a malformed header"));
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        match k.as_str() {
            "content-length" => {
                length = Some(
                    v.parse::<usize>()
                        .map_err(|_| bad("content-length is not a number"))?,
                );
            }
            "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
            "connection" => close = v.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let mut size = String::new();
            r.read_line(&mut size).map_err(|e| bad(&e.to_string()))?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad("a malformed chunk size"))?;
            if body.len() + size > MAX_BODY {
                return Err(ReadError(413, format!("a body over {MAX_BODY} bytes")));
            }
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).map_err(|e| bad(&e.to_string()))?;
            if size == 0 {
                break body;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        let n = length.unwrap_or(0);
        if n > MAX_BODY {
            return Err(ReadError(413, format!("a body over {MAX_BODY} bytes")));
        }
        let mut body = vec![0; n];
        r.read_exact(&mut body).map_err(|e| bad(&e.to_string()))?;
        body
    };
    Ok(Some(HttpRequest {
        method: method.to_owned(),
        path: path.to_owned(),
        body,
        close,
    }))
}

/// An OpenAI-style error response.
fn error(w: &mut TcpStream, status: u16, message: &str, close: bool) -> io::Result<()> {
    let kind = match status {
        403 => "permission_denied",
        404 => "not_found",
        413 => "body_too_large",
        503 => "unavailable",
        _ => "bad_request",
    };
    let body = json!({"error": {"message": message, "type": kind, "code": status}}).to_string();
    write!(
        w,
        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}\r\n{body}",
        reason(status),
        body.len(),
        if close { "connection: close\r\n" } else { "" }
    )
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        413 => "Payload Too Large",
        503 => "Service Unavailable",
        _ => "Bad Request",
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A JSON answer with status 200.
fn ok_json(w: &mut TcpStream, body: &str) -> io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    w.flush()
}

fn respond(w: &mut TcpStream, req: &HttpRequest, front: &Front, models: &Models) -> io::Result<()> {
    // What gateways and routers probe before they send work: liveness and
    // the model list, as vLLM answers them.
    if req.method == "GET" {
        match req.path.as_str() {
            "/health" => return ok_json(w, ""),
            "/v1/models" => {
                let body = json!({"object": "list", "data": [{
                    "id": front.model, "object": "model", "owned_by": "kvedge-mock",
                    "root": front.model,
                }]});
                return ok_json(w, &body.to_string());
            }
            _ => {}
        }
    }
    let render = req
        .path
        .split('?')
        .next()
        .unwrap_or_default()
        .trim_end_matches('/');
    if let Some(route) = render
        .strip_suffix("/render")
        .and_then(Route::of)
        .filter(|_| req.method == "POST")
    {
        return self::render(w, req, route, front, models);
    }
    let Some(route) = Route::of(&req.path).filter(|_| req.method == "POST") else {
        return error(
            w,
            404,
            &format!(
                "{} {} is not served (POST /v1/completions or /v1/chat/completions)",
                req.method, req.path
            ),
            false,
        );
    };
    let tokens = match prompt_tokens(req, route, front, models) {
        Ok(t) => t,
        Err((status, message)) => return error(w, status, &message, false),
    };
    let request: Value = serde_json::from_slice(&req.body).unwrap_or_default();
    let stream = request["stream"] == true;
    let max_tokens = max_tokens(&request);
    let bs = front.block_size as usize;
    let hashes = kvedge_schema::hash::sequence_hashes(&tokens, bs, None, None);
    if let Ok(mut b) = front.blocks.lock() {
        b.remember(&hashes, &tokens, bs);
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let engine = match submit(front, id, &hashes, tokens.len(), max_tokens) {
        Ok(e) => e,
        Err(e) => return error(w, 503, &e, false),
    };
    let chat = route == Route::Chat;
    let mut engine = BufReader::new(engine);
    // The engine's first line: the first token, or a refusal.
    let first = match read_event(&mut engine) {
        Ok(v) if v["event"] == "first_token" => v,
        Ok(v) => {
            let message = v["error"].as_str().unwrap_or("the engine refused");
            return error(w, 503, message, false);
        }
        Err(e) => return error(w, 503, &e, false),
    };
    let cached = first["cached_tokens"].as_u64().unwrap_or(0);
    let usage = json!({
        "prompt_tokens": tokens.len(),
        "completion_tokens": max_tokens,
        "total_tokens": tokens.len() as u64 + u64::from(max_tokens),
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    let fingerprint = format!("kvedge-mock-{}", front.worker_id);
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    if stream {
        write!(
            w,
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\nx-kvedge-worker: {}\r\n\r\n",
            front.worker_id
        )?;
        let piece = |text: &str, finish: Option<&str>| {
            let choice = if chat {
                json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": text, "finish_reason": finish})
            };
            json!({"id": format!("cmpl-{id}"), "object": format!("{object}.chunk"),
                   "model": front.model, "system_fingerprint": fingerprint,
                   "choices": [choice]})
        };
        sse(w, &piece(" tok", None).to_string())?;
        // Then one event a token as the engine makes it, as vLLM streams.
        let done = loop {
            match read_event(&mut engine) {
                Ok(v) if v["event"] == "token" => sse(w, &piece(" tok", None).to_string())?,
                other => break other,
            }
        };
        if let Err(e) = &done {
            // The engine went away mid-stream: end the stream as an error.
            sse(
                w,
                &json!({"error": {"message": e, "type": "unavailable"}}).to_string(),
            )?;
        } else {
            sse(w, &piece("", Some("length")).to_string())?;
            let mut last = piece("", Some("length"));
            last["choices"] = json!([]);
            last["usage"] = usage;
            sse(w, &last.to_string())?;
        }
        sse(w, "[DONE]")?;
        w.write_all(b"0\r\n\r\n")?;
        return w.flush();
    }
    // The tokens' events, then the end.
    loop {
        match read_event(&mut engine) {
            Ok(v) if v["event"] == "token" => {}
            Ok(_) => break,
            Err(e) => return error(w, 503, &e, false),
        }
    }
    let text = " tok".repeat(max_tokens as usize);
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": text, "finish_reason": "length"})
    };
    let body = json!({"id": format!("cmpl-{id}"), "object": object, "model": front.model,
                      "system_fingerprint": fingerprint, "choices": [choice], "usage": usage})
    .to_string();
    write!(
        w,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nx-kvedge-worker: {}\r\n\r\n{body}",
        body.len(),
        front.worker_id
    )?;
    w.flush()
}

/// The token ids of a request's prompt, as the engine runs it, or the
/// status and message to answer with.
fn prompt_tokens(
    req: &HttpRequest,
    route: Route,
    front: &Front,
    models: &Models,
) -> Result<Vec<u32>, (u16, String)> {
    let parsed = body::parse(route, &req.body).map_err(|e| (400, e.to_string()))?;
    if parsed.model != front.model {
        let message = format!("model `{}` is not served here", parsed.model);
        return Err((404, message));
    }
    let tokens = match models.tokens(&parsed.model, parsed.prompt, MAX_PROMPT_TOKENS) {
        Ok(Tokens::Ids(ids)) => ids,
        Ok(Tokens::Text(_)) => {
            let message = "this engine has no tokenizer (--tokenizer): send token ids";
            return Err((400, message.to_owned()));
        }
        Err(e @ PromptError::UnknownModel(_)) => return Err((404, e.to_string())),
        Err(e) => return Err((400, e.to_string())),
    };
    if tokens.is_empty() {
        return Err((400, "the prompt is empty".to_owned()));
    }
    Ok(tokens)
}

/// The output tokens a request asks for (`max_tokens`, or a chat's
/// `max_completion_tokens`), within the engine's bounds.
fn max_tokens(request: &Value) -> u32 {
    request["max_tokens"]
        .as_u64()
        .or_else(|| request["max_completion_tokens"].as_u64())
        .map_or(DEFAULT_MAX_TOKENS, |n| {
            n.clamp(1, u64::from(MAX_MAX_TOKENS)) as u32
        })
}

/// A request rendered, not run: a list of one `GenerateRequest` with the
/// prompt's token ids, as vLLM's render endpoints answer.
fn render(
    w: &mut TcpStream,
    req: &HttpRequest,
    route: Route,
    front: &Front,
    models: &Models,
) -> io::Result<()> {
    if !front.scale_out {
        let message = "Scale-out endpoints are disabled. Restart the engine with \
                       --enable-scale-out to enable them.";
        return error(w, 403, message, false);
    }
    let tokens = match prompt_tokens(req, route, front, models) {
        Ok(t) => t,
        Err((status, message)) => return error(w, status, &message, false),
    };
    let request: Value = serde_json::from_slice(&req.body).unwrap_or_default();
    let max_tokens = max_tokens(&request);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let stream = request["stream"] == true;
    let body = json!([{
        "request_id": format!("cmpl-{id}"),
        "token_ids": tokens,
        "features": null,
        "sampling_params": {"max_tokens": max_tokens},
        "model": front.model,
        "stream": stream,
        "stream_options": if stream { request["stream_options"].clone() } else { Value::Null },
        "cache_salt": request["cache_salt"],
        "priority": request["priority"].as_i64().unwrap_or(0),
        "token_offsets": null,
    }]);
    ok_json(w, &body.to_string())
}

/// One server-sent event as one HTTP chunk.
fn sse(w: &mut TcpStream, data: &str) -> io::Result<()> {
    let event = format!("data: {data}\n\n");
    // One write: the chunk goes out in one segment, as a server's would.
    w.write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes())?;
    w.flush()
}

/// Sends the request to the engine's socket; the connection its events
/// come back on.
fn submit(
    front: &Front,
    id: u64,
    hashes: &[u64],
    prompt_tokens: usize,
    output_tokens: u32,
) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(&front.engine)
        .map_err(|e| format!("the engine is not reachable: {e}"))?;
    // A request waits in the engine's queue as long as it must; a dead
    // engine is noticed as a closed socket.
    let _ = s.set_read_timeout(Some(Duration::from_secs(600)));
    let line = json!({"id": id, "hashes": hashes, "prompt_tokens": prompt_tokens,
                      "output_tokens": output_tokens});
    s.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| format!("the engine is not reachable: {e}"))?;
    Ok(s)
}

fn read_event(r: &mut BufReader<UnixStream>) -> Result<Value, String> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) => Err("the engine closed the request".into()),
        Ok(_) => serde_json::from_str(&line).map_err(|e| format!("the engine's answer: {e}")),
        Err(e) => Err(format!("the engine's answer: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_tokens_are_kept_for_a_generation_and_refreshed_by_use() {
        let mut b = BlockTokens::new(2);
        b.remember(&[1, 2], &[10, 11, 20, 21], 2);
        assert_eq!(b.get(1), Some(&[10, 11][..]));
        // A third block rolls the generation: 1 and 2 are still known.
        b.remember(&[3], &[30, 31], 2);
        assert_eq!((b.get(1).is_some(), b.get(3).is_some()), (true, true));
        // Block 1 used again moves to the current generation; 2 does not
        // survive the next roll.
        b.remember(&[1], &[10, 11], 2);
        b.remember(&[4, 5], &[40, 41, 50, 51], 2);
        assert_eq!(b.get(2), None);
        assert_eq!(b.get(1), Some(&[10, 11][..]));
        // A partial trailing block is not remembered.
        b.remember(&[9], &[90], 2);
        assert_eq!(b.get(9), None);
    }
}
