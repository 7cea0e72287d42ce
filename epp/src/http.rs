//! kvedge's own OpenAI-compatible HTTP front door (`epp.http_listen`): the
//! endpoint picker with no gateway in front. A `POST` to
//! `/v1/completions` or `/v1/chat/completions` is read exactly as the
//! ext_proc path reads it (the same limits, tokenizers, prefix cache and
//! select), then proxied to the picked engine over a pooled HTTP/1.1
//! client, its response streamed back as it comes. The reservation is
//! accounted from the response: `prefill_done` at its first body bytes,
//! `finish` at its end or when the client goes away. `GET /v1/models`
//! lists the configured models and `GET /health` answers `ok`.
//!
//! The port is as hostile as the gRPC one, and shares its bounds:
//! connections (`max_connections`, idle ones closed), requests in flight
//! (`max_streams`), the request headers' count and size and the time to
//! send them, a body's size (from its `Content-Length` before anything is
//! read, then as it arrives) and its share of the body budget, and the
//! time to send the whole request. A picked engine that does not answer
//! within `pick_timeout` gets a 504, one that cannot be reached a 502.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ExtProcResponse;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::request::Parts;
use hyper::{Method, Request as HttpRequest, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kvedge_wire::Request;
use tokio::sync::mpsc;

use crate::body::Route;
use crate::picker::{self, Body, DECISION, MAX_HEADER_BYTES, MAX_HEADERS, Picked, Refusal};
use crate::server::{
    BodyHeld, FIRST_BYTES_TIMEOUT, INLINE_PROMPT_BYTES, Picker, REQUEST_PHASE_TIMEOUT, StreamSlot,
    accept,
};

/// A response's body: a local answer, or an engine's response streamed.
pub type Out = UnsyncBoxBody<Bytes, hyper::Error>;

/// How long connecting to a picked engine may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// An idle pooled connection to an engine is closed after this long.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers that belong to one hop and are not passed on (RFC 9110, 7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The front door's state: the picker and the client to the engines.
struct Door {
    picker: Arc<Picker>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Serves the HTTP front door on `listener`, for as long as it runs.
pub async fn serve(listener: tokio::net::TcpListener, picker: Arc<Picker>) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    let client = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .build(connector);
    let (tx, mut rx) = mpsc::channel(16);
    let acceptor = tokio::spawn(accept(
        listener,
        tx,
        picker.settings.clone(),
        Arc::clone(&picker.stats),
    ));
    let door = Arc::new(Door { picker, client });
    while let Some(conn) = rx.recv().await {
        let Ok(conn) = conn else { continue };
        let streams = conn.streams();
        let door = Arc::clone(&door);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let door = Arc::clone(&door);
                let streams = Arc::clone(&streams);
                async move { Ok::<_, Infallible>(door.handle(req, streams).await) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(FIRST_BYTES_TIMEOUT)
                .max_headers(MAX_HEADERS)
                .max_buf_size(MAX_HEADER_BYTES + (16 << 10))
                .serve_connection(TokioIo::new(conn), service)
                .await;
            if let Err(e) = served {
                tracing::debug!("an HTTP front door connection ended: {e}");
            }
        });
    }
    acceptor.abort();
}

/// The address the front door listens on, for logs.
pub fn describe(addr: std::net::SocketAddr) -> String {
    format!("HTTP front door on {addr} (/v1/completions, /v1/chat/completions)")
}

impl Door {
    async fn handle(&self, req: HttpRequest<Incoming>, streams: Arc<AtomicUsize>) -> Response<Out> {
        let path = req.uri().path();
        let Some(route) = Route::of(path) else {
            return match (req.method(), path.trim_end_matches('/')) {
                (&Method::GET, "/health") => local(StatusCode::OK, "text/plain", "ok\n".into()),
                (&Method::GET, "/v1/models") => self.models(),
                _ => error(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    &format!(
                        "`{path}` is not a route of kvedge's HTTP front door (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health)"
                    ),
                ),
            };
        };
        if req.method() != Method::POST {
            return error(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                &format!("{path} takes POST, not {}", req.method()),
            );
        }
        let picker = &self.picker;
        let stats = &picker.stats;
        let Some(slot) = picker.stream_slot(Some(streams)) else {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                &format!(
                    "kvedge has {} requests in flight already (epp.max_streams); try again",
                    picker.settings.max_streams
                ),
            );
        };
        let deadline = tokio::time::Instant::now() + REQUEST_PHASE_TIMEOUT;
        let (parts, body) = req.into_parts();
        let header_bytes: usize = parts
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        if header_bytes > MAX_HEADER_BYTES {
            return error(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request_header_fields_too_large",
                &format!(
                    "the request has {header_bytes} bytes of headers; kvedge reads at most {MAX_HEADER_BYTES}"
                ),
            );
        }
        let mut held = BodyHeld {
            stats: Arc::clone(stats),
            bytes: 0,
            seen: 0,
        };
        let bytes = match self.read_body(body, &mut held, deadline).await {
            Ok(b) => b,
            Err(refused) => return refused,
        };
        let read = match tokio::time::timeout_at(
            deadline,
            picker.read_prompt(Body {
                route,
                bytes: bytes.clone(),
            }),
        )
        .await
        {
            Ok(read) => read,
            Err(_) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "the prompt was not read in time; try again",
                );
            }
        };
        let prompted = match read {
            Ok(p) => p,
            Err(refusal) => return refused(refusal),
        };
        let headers: Vec<(String, String)> = parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let args = picker::select_args(prompted, &headers, Vec::new(), &picker.limits);
        let picked = picker.select(&args).await;
        held.release();
        match picked {
            Picked::Worker {
                endpoint,
                request_id,
                decision,
            } => {
                let reservation = Reservation {
                    picker: Arc::clone(picker),
                    id: Some(request_id),
                    prefilled: false,
                    failed: false,
                };
                let Some(addr) = picker::host_port(&endpoint) else {
                    reservation.abort();
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unroutable_endpoint",
                        &format!("the chosen endpoint `{endpoint}` is not http://host:port"),
                    );
                };
                self.proxy(&parts, &addr, bytes, decision, reservation, slot)
                    .await
            }
            Picked::Provider { name, .. } => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unroutable_endpoint",
                &format!(
                    "the rules chose provider `{name}`, which kvedge's HTTP front door does not reach (it proxies to local workers; providers are reached through a gateway)"
                ),
            ),
            Picked::Refused { status, message } => error(
                StatusCode::from_u16(picker::refusal_code(status) as u16)
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                status,
                &message,
            ),
        }
    }

    /// The whole request body, within the body limit and budget and the
    /// request's deadline; or the refusal to answer.
    async fn read_body(
        &self,
        mut body: Incoming,
        held: &mut BodyHeld,
        deadline: tokio::time::Instant,
    ) -> Result<Bytes, Response<Out>> {
        let max = self.picker.limits.max_body_bytes;
        let too_large = || {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                &format!("the request body is over {max} bytes"),
            )
        };
        // Content-Length, checked before a byte is read.
        let announced = body.size_hint().lower();
        if announced > max as u64 {
            return Err(too_large());
        }
        let mut buf: Vec<u8> = Vec::with_capacity(announced as usize);
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    return Err(error(
                        StatusCode::REQUEST_TIMEOUT,
                        "request_timeout",
                        &format!(
                            "the request was not whole within {} s",
                            REQUEST_PHASE_TIMEOUT.as_secs()
                        ),
                    ));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(error(
                        StatusCode::BAD_REQUEST,
                        "bad_request",
                        &format!("the request body could not be read: {e}"),
                    ));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if buf.len() + data.len() > max {
                return Err(too_large());
            }
            // The first INLINE_PROMPT_BYTES need no budget (they are
            // bounded by max_streams), as on the ext_proc path.
            let seen = held.seen;
            held.seen += data.len();
            let charge = held.seen.saturating_sub(INLINE_PROMPT_BYTES)
                - seen.saturating_sub(INLINE_PROMPT_BYTES);
            if !self.picker.reserve_body(charge) {
                self.picker.stats.refused_body_budget.fetch_add(1, Relaxed);
                return Err(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "too many request bodies are being read at once; try again",
                ));
            }
            held.bytes += charge;
            if buf.is_empty() && body.is_end_stream() {
                // One frame, the whole body: kept as it came.
                return Ok(data);
            }
            buf.extend_from_slice(&data);
        }
        if buf.is_empty() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the request has no body",
            ));
        }
        Ok(Bytes::from(buf))
    }

    /// Sends the request to the engine at `addr` and streams its answer
    /// back, accounting the reservation as it goes.
    async fn proxy(
        &self,
        parts: &Parts,
        addr: &str,
        body: Bytes,
        decision: Option<String>,
        mut reservation: Reservation,
        slot: StreamSlot,
    ) -> Response<Out> {
        let stats = &self.picker.stats;
        let upstream = match forward(parts, addr, body) {
            Ok(r) => r,
            Err(e) => {
                reservation.abort();
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unroutable_endpoint",
                    &format!("the chosen endpoint `{addr}` cannot be addressed: {e}"),
                );
            }
        };
        let wait = self.picker.settings.pick_timeout;
        let answered = match tokio::time::timeout(wait, self.client.request(upstream)).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                stats.http_upstream_errors.fetch_add(1, Relaxed);
                reservation.abort();
                return error(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("the engine at {addr} failed: {}", chain(&e)),
                );
            }
            Err(_) => {
                stats.http_upstream_errors.fetch_add(1, Relaxed);
                reservation.abort();
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "gateway_timeout",
                    &format!(
                        "the engine at {addr} did not answer within {} ms (epp.pick_timeout_ms)",
                        wait.as_millis()
                    ),
                );
            }
        };
        stats.http_proxied.fetch_add(1, Relaxed);
        let (mut head, inner) = answered.into_parts();
        // A server error is no response stream: the session's binding goes
        // back when it is released.
        reservation.failed = head.status.is_server_error();
        strip_hop_by_hop(&mut head.headers);
        if let Some(d) = decision
            && let Ok(v) = HeaderValue::from_str(&d)
        {
            head.headers.insert(DECISION, v);
        }
        let body = Accounted {
            inner,
            reservation,
            silent: Box::pin(tokio::time::sleep(wait)),
            last: tokio::time::Instant::now(),
            wait,
            _slot: slot,
        };
        Response::from_parts(head, body.boxed_unsync())
    }

    /// `GET /v1/models`: the configured models, as OpenAI lists them.
    fn models(&self) -> Response<Out> {
        let data: Vec<serde_json::Value> = self
            .picker
            .models
            .names()
            .into_iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": "kvedge"}))
            .collect();
        let body = serde_json::json!({"object": "list", "data": data});
        local(StatusCode::OK, "application/json", body.to_string().into())
    }
}

/// The request to send the engine at `addr`: the client's method, path,
/// headers (but those of the hop) and body.
fn forward(
    parts: &Parts,
    addr: &str,
    body: Bytes,
) -> Result<HttpRequest<Full<Bytes>>, hyper::http::Error> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = HttpRequest::builder()
        .method(parts.method.clone())
        .uri(format!("http://{addr}{path}"))
        .body(Full::new(body))?;
    let headers = req.headers_mut();
    for (k, v) in &parts.headers {
        if k != header::HOST && k != header::CONTENT_LENGTH && !HOP_BY_HOP.contains(k) {
            headers.append(k.clone(), v.clone());
        }
    }
    headers.insert(header::HOST, HeaderValue::from_str(addr)?);
    Ok(req)
}

/// Removes the headers that belong to one hop, and those the
/// `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(name);
    }
}

/// An error and its causes, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

fn local(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Out> {
    let mut r = Response::new(
        Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// An error answered by the front door, in OpenAI's error shape (the
/// same body the ext_proc path's local replies carry).
fn error(status: StatusCode, kind: &str, message: &str) -> Response<Out> {
    let body = picker::error_body(i32::from(status.as_u16()), kind, message);
    local(status, "application/json", body.into())
}

/// A refusal the prompt reader built for Envoy, as an HTTP response.
fn refused(refusal: Refusal) -> Response<Out> {
    match refusal.response {
        Some(ExtProcResponse::ImmediateResponse(r)) => {
            let status = r
                .status
                .and_then(|s| u16::try_from(s.code).ok())
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::BAD_REQUEST);
            local(status, "application/json", r.body.into())
        }
        _ => error(StatusCode::BAD_REQUEST, "bad_request", "refused"),
    }
}

/// A pick's reservation, released once: `finish` when the response ends
/// or is dropped (the client went away); `abort` when the engine could not
/// be reached, did not answer, or answered with a server error, so that
/// the session's binding is put back as it was before the pick.
struct Reservation {
    picker: Arc<Picker>,
    id: Option<u64>,
    prefilled: bool,
    /// The engine failed before a response stream: released with `abort`.
    failed: bool,
}

impl Reservation {
    fn first_bytes(&mut self) {
        if let (Some(request_id), false, false) = (self.id, self.prefilled, self.failed) {
            self.prefilled = true;
            self.picker.release(Request::PrefillDone { request_id });
        }
    }

    fn finish(&mut self) {
        if let Some(request_id) = self.id.take() {
            self.picker.release(if self.failed {
                Request::Abort { request_id }
            } else {
                Request::Finish { request_id }
            });
        }
    }

    /// The dispatch failed: released at once with `abort`.
    fn abort(mut self) {
        self.failed = true;
        self.finish();
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.finish();
    }
}

/// An engine's response body on its way to the client, accounting the
/// reservation: `prefill_done` at the first bytes, `finish` at the end;
/// silent for `wait`, the reservation is released and the body goes on.
///
/// A frame only notes the time it passed; the timer is moved when it
/// fires early (a stream of tokens would otherwise re-arm it per token).
struct Accounted {
    inner: Incoming,
    reservation: Reservation,
    silent: Pin<Box<tokio::time::Sleep>>,
    /// When the last frame passed.
    last: tokio::time::Instant,
    wait: Duration,
    /// The request's place among `max_streams`, held to the end.
    _slot: StreamSlot,
}

impl HttpBody for Accounted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    this.reservation.first_bytes();
                }
                if this.reservation.id.is_some() {
                    this.last = tokio::time::Instant::now();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(end) => {
                this.reservation.finish();
                Poll::Ready(end)
            }
            Poll::Pending => {
                while this.reservation.id.is_some() && this.silent.as_mut().poll(cx).is_ready() {
                    let due = this.last + this.wait;
                    if due <= tokio::time::Instant::now() {
                        this.picker_stats().picks_expired.fetch_add(1, Relaxed);
                        this.reservation.finish();
                    } else {
                        // A frame passed since it was set: wait from there
                        // (and poll again, to be woken then).
                        this.silent.as_mut().reset(due);
                    }
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Accounted {
    fn picker_stats(&self) -> &crate::server::Stats {
        &self.reservation.picker.stats
    }
}
