//! The gRPC side: Envoy's `envoy.service.ext_proc.v3.ExternalProcessor`
//! and the standard health service, on tonic. Each stream is an
//! [`Exchange`]; its selects, `prefill_done`s and `finish`es go to the
//! routing core through a [`Backend`] in the binary query protocol, the
//! same requests a Unix-socket client sends.
//!
//! The port is hostile: connections are bounded ([`Settings`]) and closed
//! when idle or silent from the start, streams are bounded over all
//! connections, buffered bodies share one budget, prompts larger than a
//! few kilobytes are read on the tokenizer [`Pool`] (never on the serving
//! thread), and a pick whose response never ends gives its reservation
//! back. What each bound refused is counted in [`Stats`].

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request as Msg,
};
use kvedge_shm::ratelimit::{RateLimit, held_back};
use kvedge_wire::{Pairs, Request, Status, Strs, binary};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, async_trait};

use crate::picker::{
    self, Body, Exchange, Limits, Picked, Prompted, Refusal, SelectArgs, Step, immediate,
};
use crate::pool::{Pool, Refused};
use crate::tokenize::Models;

/// The gRPC service name of ext_proc (for health checks).
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How long a stream's request (its headers to the end of its body) may
/// take: Envoy sends a buffered body right after the headers, so a stream
/// still without its whole body this long after it opened is abandoned
/// (closed with `DEADLINE_EXCEEDED`), however it trickles. After the pick,
/// the response may take as long as generation does.
pub const REQUEST_PHASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Streams at once per gRPC connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4096;
/// A prompt in a body of at most this many bytes is read on the serving
/// thread (a millisecond or two); a larger one goes to the pool.
pub const INLINE_PROMPT_BYTES: usize = 8 << 10;
/// The same for an ASCII body when every model reads ASCII quickly
/// ([`Models::quick_on_ascii`]): such a text is read on the serving thread
/// in less time than the two thread hand-offs the pool costs.
pub const INLINE_ASCII_PROMPT_BYTES: usize = 32 << 10;
/// The same for a completion whose prompt is a list of token ids, read at
/// a byte loop (no template or tokenizer), well within two thread
/// hand-offs to the pool and back. A body
/// of this size that turns out to hold anything else is given up as soon
/// as its prompt is seen, and goes to the pool.
pub const INLINE_ID_PROMPT_BYTES: usize = 64 << 10;
/// A connection that has sent nothing this long after it was accepted is
/// closed (HTTP/2 begins with the client's preface).
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the serving thread checks for the routing core's reply,
/// yielding its CPU between checks, before it parks until the reply wakes
/// it. The core answers a select within microseconds of waking, and a
/// parked serving thread paid a wake-up of its own for each reply, which
/// more than doubled the round trip to the core (BENCHMARKS.md, "Endpoint
/// picker"). A reply that takes longer
/// costs the thread no more than this. The query clients wait the same way.
pub const REPLY_WAIT: Duration = Duration::from_micros(50);

/// The routing core's reply on `rx`, checked for up to [`REPLY_WAIT`]
/// before the task parks; `None` when the core dropped the request.
async fn core_reply(mut rx: oneshot::Receiver<Vec<u8>>) -> Option<Vec<u8>> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(frame) => return Some(frame),
            Err(oneshot::error::TryRecvError::Closed) => return None,
            Err(oneshot::error::TryRecvError::Empty) if start.elapsed() < REPLY_WAIT => {
                std::thread::yield_now();
            }
            Err(oneshot::error::TryRecvError::Empty) => return rx.await.ok(),
        }
    }
}

/// The server's bounds (`epp:` in the configuration).
#[derive(Clone, Debug)]
pub struct Settings {
    pub max_connections: usize,
    /// A connection with no stream open and no bytes this long is closed.
    pub idle_timeout: Duration,
    /// Streams open at once over all connections.
    pub max_streams: usize,
    /// Request body bytes buffered at once over all streams.
    pub max_buffered_body_bytes: usize,
    /// A picked stream silent this long has its reservation released.
    pub pick_timeout: Duration,
    pub tokenizer_threads: usize,
    pub tokenizer_queue: usize,
    pub tokenize_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_connections: 256,
            idle_timeout: Duration::from_secs(300),
            max_streams: 16_384,
            max_buffered_body_bytes: 256 << 20,
            pick_timeout: Duration::from_secs(300),
            tokenizer_threads: 2,
            tokenizer_queue: 64,
            tokenize_timeout: Duration::from_secs(2),
        }
    }
}

/// What the picker's bounds did, for the metrics (gauges and counters).
#[derive(Debug, Default)]
pub struct Stats {
    /// gRPC connections open now.
    pub connections: AtomicU64,
    /// Connections closed as they came, past `max_connections` with every
    /// open connection busy.
    pub connections_refused: AtomicU64,
    /// Idle connections closed to make room for a new one.
    pub connections_evicted: AtomicU64,
    /// Connections closed for being idle (or silent from the start).
    pub connections_idle_closed: AtomicU64,
    /// ext_proc streams open now.
    pub streams: AtomicU64,
    /// Streams refused past `max_streams`.
    pub streams_refused: AtomicU64,
    /// Request body bytes buffered now.
    pub buffered_body_bytes: AtomicU64,
    /// Requests answered 503 because the body budget was spent.
    pub refused_body_budget: AtomicU64,
    /// Requests answered 503 because the tokenizer queue was full.
    pub refused_tokenizer_queue: AtomicU64,
    /// Requests answered 503 because their prompt was not read in time.
    pub refused_tokenize_deadline: AtomicU64,
    /// Prompts read on the serving thread, and on the pool.
    pub prompts_inline: AtomicU64,
    pub prompts_pooled: AtomicU64,
    /// Picks whose reservation was released by `pick_timeout`.
    pub picks_expired: AtomicU64,
    /// Requests the HTTP front door proxied to an engine.
    pub http_proxied: AtomicU64,
    /// Requests the HTTP front door could not proxy: the engine refused
    /// the connection, failed, or did not answer in time (502 or 504).
    pub http_upstream_errors: AtomicU64,
    /// How long reading a prompt took (parsing, template, tokenizer, and
    /// any wait for the pool), refusals included.
    pub prompt_durations: crate::stage::Durations,
    /// How long a select's round trip to the routing core took.
    pub select_durations: crate::stage::Durations,
}

/// The routing core, as the picker reaches it.
pub trait Backend: Send + Sync + 'static {
    /// Serves one binary-protocol request (a frame body: op, version,
    /// payload) and calls `reply` with the reply frame (length, status,
    /// version, payload). A `reply` never called means the core is gone.
    fn call(&self, body: Vec<u8>, reply: Box<dyn FnOnce(Vec<u8>) + Send>);

    /// Serves one JSON-lines request (the line without its newline) and
    /// calls `reply` with the reply line: for a select whose explanation
    /// the debug header asked for (the binary protocol carries none). A
    /// backend without it answers an error.
    fn call_json(&self, line: Vec<u8>, reply: Box<dyn FnOnce(Vec<u8>) + Send>) {
        drop(line);
        reply(br#"{"error":{"code":"internal","message":"no JSON protocol here"}}"#.to_vec());
    }
}

/// The picker's shared state.
pub struct Picker {
    pub(crate) models: Arc<Models>,
    pub(crate) limits: Limits,
    pub(crate) settings: Settings,
    backend: Arc<dyn Backend>,
    pool: Pool,
    /// [`Models::quick_on_ascii`], asked once.
    quick_on_ascii: bool,
    pub(crate) stats: Arc<Stats>,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker")
            .field("models", &self.models)
            .field("limits", &self.limits)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Picker {
    /// The picker, with its tokenizer pool's threads started.
    pub fn new(
        models: Models,
        limits: Limits,
        settings: Settings,
        backend: Arc<dyn Backend>,
    ) -> io::Result<Picker> {
        let pool = Pool::new(
            settings.tokenizer_threads,
            settings.tokenizer_queue,
            settings.tokenize_timeout,
        )?;
        Ok(Picker {
            quick_on_ascii: models.quick_on_ascii(),
            models: Arc::new(models),
            limits,
            settings,
            backend,
            pool,
            stats: Arc::default(),
        })
    }

    /// What the bounds did so far.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// What the models' prefix caches did.
    pub fn prefix_counts(&self) -> crate::tokenize::PrefixCounts {
        self.models.prefix_counts()
    }

    /// Reads a whole body's prompt: here when the body is small or its
    /// prompt is token ids, on the pool when it is not (refused at once
    /// when the pool is full, and after its deadline when it is slow).
    pub(crate) async fn read_prompt(&self, body: Body) -> Result<Prompted, Refusal> {
        let started = std::time::Instant::now();
        let read = self.read_prompt_untimed(body).await;
        self.stats.prompt_durations.record(started.elapsed());
        read
    }

    async fn read_prompt_untimed(&self, body: Body) -> Result<Prompted, Refusal> {
        let n = body.bytes.len();
        if n <= INLINE_PROMPT_BYTES
            || (n <= INLINE_ASCII_PROMPT_BYTES && self.quick_on_ascii && body.bytes.is_ascii())
        {
            self.stats.prompts_inline.fetch_add(1, Relaxed);
            return picker::prompt(&body, &self.models, &self.limits);
        }
        if n <= INLINE_ID_PROMPT_BYTES
            && let Some(read) = picker::prompt_of_ids(&body, &self.models, &self.limits)
        {
            self.stats.prompts_inline.fetch_add(1, Relaxed);
            return read;
        }
        self.stats.prompts_pooled.fetch_add(1, Relaxed);
        let (models, limits) = (Arc::clone(&self.models), self.limits.clone());
        match self
            .pool
            .run(move || picker::prompt(&body, &models, &limits))
            .await
        {
            Ok(read) => read,
            Err(why) => {
                let counter = match why {
                    Refused::QueueFull => &self.stats.refused_tokenizer_queue,
                    Refused::Deadline | Refused::Stopped => &self.stats.refused_tokenize_deadline,
                };
                counter.fetch_add(1, Relaxed);
                Err(picker::refuse(
                    503,
                    "overloaded",
                    &format!("{why}; try again"),
                ))
            }
        }
    }

    /// A place among `max_streams` for one more stream (or front-door
    /// request) on `connection`; `None` (counted) when all are taken.
    pub(crate) fn stream_slot(&self, connection: Option<Arc<AtomicUsize>>) -> Option<StreamSlot> {
        let max = self.settings.max_streams as u64;
        if self
            .stats
            .streams
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .is_err()
        {
            self.stats.streams_refused.fetch_add(1, Relaxed);
            return None;
        }
        if let Some(c) = &connection {
            c.fetch_add(1, Relaxed);
        }
        Some(StreamSlot {
            stats: Arc::clone(&self.stats),
            connection,
        })
    }

    /// Takes `n` bytes from the body budget, if it has them.
    pub(crate) fn reserve_body(&self, n: usize) -> bool {
        let max = self.settings.max_buffered_body_bytes as u64;
        self.stats
            .buffered_body_bytes
            .fetch_update(Relaxed, Relaxed, |held| {
                let after = held.checked_add(n as u64)?;
                (after <= max).then_some(after)
            })
            .is_ok()
    }

    /// One request to the core; its reply's status and payload.
    async fn call(&self, request: &Request<'_>) -> Result<(Status, Vec<u8>), String> {
        // Room for the prompt's ids at once (eight bytes an id covers
        // hashes and token ids alike): a 2,000-token frame grown from a
        // small buffer was a fresh allocation and a copy.
        let ids = match request {
            Request::Select(s) => s.ids.len() * 8,
            _ => 0,
        };
        let mut out = Vec::with_capacity(256 + ids);
        binary::encode_request(&mut out, request)
            .map_err(|e| format!("the request cannot be sent to the routing core: {e}"))?;
        // The frame's length goes: the backend takes the body.
        out.drain(..4);
        let (tx, rx) = oneshot::channel();
        self.backend.call(
            out,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let mut frame = core_reply(rx)
            .await
            .ok_or_else(|| "the routing core is gone".to_owned())?;
        if frame.len() < 8 {
            return Err("a short reply frame from the routing core".into());
        }
        let code = u16::from_le_bytes([frame[4], frame[5]]);
        let status = Status::from_code(code).ok_or("an unknown status from the routing core")?;
        frame.drain(..8);
        Ok((status, frame))
    }

    /// The core's pick for `args` (reserved).
    pub async fn select(&self, args: &SelectArgs) -> Picked {
        let started = std::time::Instant::now();
        let picked = self.select_untimed(args).await;
        self.stats.select_durations.record(started.elapsed());
        picked
    }

    async fn select_untimed(&self, args: &SelectArgs) -> Picked {
        let headers: BTreeMap<String, String> = args.headers.iter().cloned().collect();
        let mut s = picker::prompt_select(
            &args.model,
            &args.tokens,
            args.prompt_tokens,
            &args.approximate,
        );
        s.tenant = args.tenant.as_deref();
        s.session = args.session.as_deref();
        if s.session.is_some_and(|id| !id.is_empty()) {
            // A trigger is session metadata: without a session no policy
            // sees it.
            s.trigger = args.trigger;
        }
        s.headers = Pairs::map(&headers);
        s.subset = Strs::strings(&args.subset);
        s.text = args.text.as_deref();
        if let Some(t) = &args.target {
            match picker::parse_target(t) {
                Ok(target) => s.target = Some(target),
                Err(message) => {
                    return Picked::Refused {
                        status: "bad_request",
                        message,
                    };
                }
            }
        }
        if args.tolerations.len() > kvedge_wire::MAX_TOLERATIONS {
            return Picked::Refused {
                status: "bad_request",
                message: format!(
                    "the tolerations header lists {} taints (at most {})",
                    args.tolerations.len(),
                    kvedge_wire::MAX_TOLERATIONS
                ),
            };
        }
        s.tolerations = Strs::strings(&args.tolerations);
        if args.explain {
            s.explain = true;
            return self.select_explained(&Request::Select(s)).await;
        }
        match self.call(&Request::Select(s)).await {
            Ok((Status::Ok, payload)) => match binary::decode_select_reply(&payload) {
                Ok(v) if v.provider => Picked::Provider {
                    name: v.provider_name.to_owned(),
                    endpoint: v.endpoint.to_owned(),
                    decision: None,
                },
                Ok(v) => Picked::Worker {
                    endpoint: v.endpoint.to_owned(),
                    request_id: v.request_id,
                    decision: None,
                },
                Err(e) => Picked::Refused {
                    status: "internal",
                    message: format!("an undecodable select reply: {e}"),
                },
            },
            Ok((status, payload)) => Picked::Refused {
                status: status.name(),
                message: String::from_utf8_lossy(&payload).into_owned(),
            },
            Err(message) => Picked::Refused {
                status: if message.starts_with("the request cannot be sent") {
                    "bad_request"
                } else {
                    "internal"
                },
                message,
            },
        }
    }

    /// The pick of a select with `explain` set, over the JSON protocol,
    /// with its explanation for [`picker::DECISION`].
    async fn select_explained(&self, request: &Request<'_>) -> Picked {
        let mut line = Vec::with_capacity(512);
        if let Err(e) = kvedge_wire::json::encode_request(&mut line, request) {
            return Picked::Refused {
                status: "bad_request",
                message: format!("the request cannot be sent to the routing core: {e}"),
            };
        }
        while line.last() == Some(&b'\n') {
            line.pop();
        }
        let (tx, rx) = oneshot::channel();
        self.backend.call_json(
            line,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let Some(reply) = core_reply(rx).await else {
            return Picked::Refused {
                status: "internal",
                message: "the routing core is gone".into(),
            };
        };
        let v: serde_json::Value = serde_json::from_slice(&reply).unwrap_or_default();
        if let Some(e) = v.get("error") {
            let code = e["code"].as_str().unwrap_or("internal");
            return Picked::Refused {
                status: Status::from_name(code).map_or("internal", Status::name),
                message: e["message"].as_str().unwrap_or("").to_owned(),
            };
        }
        let decision = Some(decision(&v));
        match v["request_id"].as_u64() {
            _ if !v["provider"].is_null() => Picked::Provider {
                name: v["provider"].as_str().unwrap_or("").to_owned(),
                endpoint: v["endpoint"].as_str().unwrap_or("").to_owned(),
                decision,
            },
            Some(request_id) => Picked::Worker {
                endpoint: v["endpoint"].as_str().unwrap_or("").to_owned(),
                request_id,
                decision,
            },
            None => Picked::Refused {
                status: "internal",
                message: format!("an unreadable select reply: {v}"),
            },
        }
    }

    /// Sends `prefill_done` or `finish` without waiting for the answer:
    /// Envoy's reply need not wait for the core's bookkeeping. A refusal
    /// (an id already finished or expired) is logged at debug level.
    pub(crate) fn release(&self, request: Request<'static>) {
        let mut out = Vec::with_capacity(16);
        if let Err(e) = binary::encode_request(&mut out, &request) {
            tracing::warn!("{request:?}: {e}");
            return;
        }
        out.drain(..4);
        self.backend.call(
            out,
            Box::new(move |frame| {
                let code = frame.get(4..6).map(|c| u16::from_le_bytes([c[0], c[1]]));
                if code != Some(Status::Ok.code()) {
                    tracing::debug!(
                        "{request:?} answered {:?}: {}",
                        code.and_then(Status::from_code),
                        String::from_utf8_lossy(frame.get(8..).unwrap_or_default())
                    );
                }
            }),
        );
    }

    /// Runs one ext_proc stream to its end.
    async fn run(
        self: Arc<Self>,
        mut inbound: Streaming<ProcessingRequest>,
        out: mpsc::Sender<Result<ProcessingResponse, tonic::Status>>,
    ) {
        let mut ex: Option<Exchange> = None;
        // Body bytes this stream holds of the budget.
        let mut held = BodyHeld {
            stats: Arc::clone(&self.stats),
            bytes: 0,
            seen: 0,
        };
        // Whether the pick's reservation may still be released by the
        // pick timeout (once).
        let mut pick_timer = true;
        let request_deadline = tokio::time::Instant::now() + REQUEST_PHASE_TIMEOUT;
        loop {
            let picked = ex.as_ref().is_some_and(Exchange::picked);
            // Until when the next message may take, and what its absence
            // means: the request phase's end, or a silent picked stream.
            let (until, silent_pick) = if !picked {
                (Some(request_deadline), false)
            } else if pick_timer {
                let until = tokio::time::Instant::now() + self.settings.pick_timeout;
                (Some(until), true)
            } else {
                (None, false)
            };
            let next = match until {
                None => inbound.message().await,
                Some(until) => match tokio::time::timeout_at(until, inbound.message()).await {
                    Ok(next) => next,
                    Err(_) if silent_pick => {
                        // The response has not ended: give the reservation
                        // back (the stream goes on, accounted no more).
                        pick_timer = false;
                        if let Some(id) = ex.as_mut().and_then(Exchange::handle_closed) {
                            self.stats.picks_expired.fetch_add(1, Relaxed);
                            self.release(Request::Finish { request_id: id });
                        }
                        continue;
                    }
                    Err(_) => {
                        let _ = out
                            .send(Err(tonic::Status::deadline_exceeded(
                                "the request was not whole within 30 s",
                            )))
                            .await;
                        break;
                    }
                },
            };
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!("ext_proc stream ended: {e}");
                    break;
                }
            };
            // The body modes are in the stream's first message.
            let ex = ex.get_or_insert_with(|| {
                let duplex = BodySendMode::FullDuplexStreamed as i32;
                let c = msg.protocol_config.as_ref();
                if c.is_some_and(ends_with_the_request) {
                    warn_end_unseen();
                }
                Exchange::new(
                    c.is_some_and(|c| c.request_body_mode == duplex),
                    c.is_some_and(|c| c.response_body_mode == duplex),
                )
            });
            if let Some(m) = &msg.metadata_context {
                ex.handle_metadata(m);
            }
            let mut step = match &msg.request {
                Some(Msg::RequestHeaders(h)) => ex.handle_request_headers(h),
                Some(Msg::RequestBody(b)) => {
                    // A body's first INLINE_PROMPT_BYTES need no budget
                    // (they are bounded by max_streams), so small requests
                    // pass while large ones hold it all.
                    let seen = held.seen;
                    held.seen += b.body.len();
                    let charge = held.seen.saturating_sub(INLINE_PROMPT_BYTES)
                        - seen.saturating_sub(INLINE_PROMPT_BYTES);
                    if self.reserve_body(charge) {
                        held.bytes += charge;
                        ex.handle_request_body(b, &self.limits)
                    } else {
                        self.stats.refused_body_budget.fetch_add(1, Relaxed);
                        Step::Reply(immediate(
                            503,
                            "overloaded",
                            "too many request bodies are being read at once; try again",
                        ))
                    }
                }
                Some(Msg::ResponseHeaders(h)) => ex.handle_response_headers(h),
                Some(Msg::ResponseBody(b)) => ex.handle_response_body(b),
                Some(Msg::RequestTrailers(_)) => ex.handle_trailers(false),
                Some(Msg::ResponseTrailers(_)) => ex.handle_trailers(true),
                // A flow-control message needs no answer.
                None => continue,
            };
            if let Step::Prompt(body) = step {
                let read = self.read_prompt(body).await;
                step = ex.handle_prompt(read, &self.limits);
            }
            let replies = match step {
                Step::Nothing => continue,
                Step::Reply(r) => vec![r],
                // Answered above.
                Step::Prompt(_) => continue,
                Step::Select(args) => {
                    let picked = self.select(&args).await;
                    let r = ex.handle_picked(picked);
                    if r.first().is_some_and(is_immediate)
                        && let Some(id) = ex.take_unused_reservation()
                    {
                        self.release(Request::Finish { request_id: id });
                    }
                    r
                }
                Step::PrefillDone(id, r) => {
                    self.release(Request::PrefillDone { request_id: id });
                    vec![r]
                }
                Step::Finish(id, r) => {
                    self.release(Request::Finish { request_id: id });
                    vec![r]
                }
            };
            // The body is no longer held once the request is answered.
            if ex.picked() || replies.iter().any(is_immediate) {
                held.release();
            }
            let done = replies.iter().any(is_immediate);
            let mut sent = true;
            for r in replies {
                sent &= out.send(Ok(r)).await.is_ok();
            }
            if !sent || done {
                break;
            }
        }
        if let Some(id) = ex.as_mut().and_then(Exchange::handle_closed) {
            self.release(Request::Finish { request_id: id });
        }
    }
}

/// Whether Envoy, configured as `c` says, closes the stream once the
/// request is processed rather than when the response ends: it sends no
/// response body and streams the request body, and Envoy (1.37 and later)
/// closes an ext_proc stream as soon as nothing more is to be sent on it.
/// With a `BUFFERED` request body it keeps the stream to the end.
fn ends_with_the_request(c: &ProtocolConfiguration) -> bool {
    let streamed = [BodySendMode::Streamed, BodySendMode::FullDuplexStreamed].map(|m| m as i32);
    c.response_body_mode == BodySendMode::None as i32 && streamed.contains(&c.request_body_mode)
}

/// Says once per process that the responses' ends cannot be seen.
fn warn_end_unseen() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "Envoy streams request bodies to the picker and sends no response body: it closes each \
             ext_proc stream once the request is processed, so picks are released then, not when \
             their responses end. Use request_body_mode: BUFFERED, or send the response body \
             (docs/gateway.md, \"Envoy\")"
        );
    });
}

/// A stream's share of the body budget, given back when it is done with
/// its body or ends.
pub(crate) struct BodyHeld {
    pub(crate) stats: Arc<Stats>,
    /// Bytes taken from the budget.
    pub(crate) bytes: usize,
    /// Bytes of the body so far.
    pub(crate) seen: usize,
}

impl BodyHeld {
    pub(crate) fn release(&mut self) {
        let n = std::mem::take(&mut self.bytes) as u64;
        self.stats.buffered_body_bytes.fetch_sub(n, Relaxed);
    }
}

impl Drop for BodyHeld {
    fn drop(&mut self) {
        self.release();
    }
}

/// A stream's place among `max_streams`, and on its connection.
pub(crate) struct StreamSlot {
    pub(crate) stats: Arc<Stats>,
    pub(crate) connection: Option<Arc<AtomicUsize>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.stats.streams.fetch_sub(1, Relaxed);
        if let Some(c) = &self.connection {
            c.fetch_sub(1, Relaxed);
        }
    }
}

/// A select reply with its explanation, as one header value: the worker
/// (or provider), what decided (the rule, or the policy), the overlap and
/// cost, and each candidate as `worker/rank:cost`.
fn decision(v: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    let chosen = if v["provider"].is_null() {
        format!("worker={}/{}", text(&v["worker_id"]), text(&v["dp_rank"]))
    } else {
        format!("provider={}", text(&v["provider"]))
    };
    let o = &v["overlap_blocks"];
    let e = &v["explain"];
    let candidates: Vec<String> = e["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            format!(
                "{}/{}:{}",
                text(&w["worker_id"]),
                text(&w["dp_rank"]),
                text(&w["cost"])
            )
        })
        .collect();
    let mut out = format!(
        "{chosen}; rule={}; policy={}; tier={}; overlap={}/{}/{}; sharers={}; cost={}; candidates={}; survivors={}; costs={}",
        text(&v["rule"]),
        text(&v["policy"]),
        text(&e["tier"]),
        text(&o["device"]),
        text(&o["host"]),
        text(&o["disk"]),
        text(&e["prefix_sharers"]),
        text(&v["cost"]),
        text(&e["candidates"]),
        text(&e["survivors"]),
        candidates.join(",")
    );
    // A header value: visible ASCII and spaces only, and bounded.
    out.retain(|c| c.is_ascii_graphic() || c == ' ');
    out.truncate(2048);
    out
}

fn is_immediate(r: &ProcessingResponse) -> bool {
    matches!(
        r.response,
        Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::ImmediateResponse(_))
    )
}

/// The ext_proc service over a [`Picker`].
#[derive(Clone, Debug)]
pub struct Service(pub Arc<Picker>);

#[async_trait]
impl ExternalProcessor for Service {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let picker = &self.0;
        let connection = request
            .extensions()
            .get::<ConnInfo>()
            .map(|c| Arc::clone(&c.streams));
        let Some(slot) = picker.stream_slot(connection) else {
            return Err(tonic::Status::resource_exhausted(format!(
                "the picker has {} streams open already",
                picker.settings.max_streams
            )));
        };
        let (tx, rx) = mpsc::channel(4);
        let picker = Arc::clone(picker);
        tokio::spawn(async move {
            picker.run(request.into_inner(), tx).await;
            drop(slot);
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// What a connection tells the services about itself.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub remote: Option<SocketAddr>,
    /// Streams open on it now (it is not idle while one is).
    pub streams: Arc<AtomicUsize>,
}

/// An accepted connection, closed when it has been idle (no bytes, no
/// stream open) for its timeout, or silent since it was accepted for
/// [`FIRST_BYTES_TIMEOUT`].
pub(crate) struct Guarded {
    io: TcpStream,
    /// Fires when the accept loop needs this connection's place.
    evict: oneshot::Receiver<()>,
    evicted: bool,
    timer: Pin<Box<tokio::time::Sleep>>,
    idle_after: Duration,
    greeted: bool,
    streams: Arc<AtomicUsize>,
    stats: Arc<Stats>,
}

impl Guarded {
    /// Requests (streams) open on this connection now.
    pub(crate) fn streams(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.streams)
    }

    fn new(
        io: TcpStream,
        idle_after: Duration,
        streams: Arc<AtomicUsize>,
        evict: oneshot::Receiver<()>,
        stats: Arc<Stats>,
    ) -> Guarded {
        stats.connections.fetch_add(1, Relaxed);
        Guarded {
            io,
            evict,
            evicted: false,
            timer: Box::pin(tokio::time::sleep(FIRST_BYTES_TIMEOUT)),
            idle_after,
            greeted: false,
            streams,
            stats,
        }
    }

    fn touch(&mut self) {
        let after = if self.greeted {
            self.idle_after
        } else {
            FIRST_BYTES_TIMEOUT
        };
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + after);
    }

    /// Whether the connection has been idle too long (registering the
    /// timer's wake-up when it has not).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            if self.greeted && self.streams.load(Relaxed) > 0 {
                // A stream is open: not idle, whatever the silence.
                self.touch();
                continue;
            }
            self.stats.connections_idle_closed.fetch_add(1, Relaxed);
            return true;
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stats.connections.fetch_sub(1, Relaxed);
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.evicted || Pin::new(&mut this.evict).poll(cx).is_ready() {
            this.evicted = true;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for a new connection",
            )));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.greeted = true;
                    this.touch();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the connection was idle",
            ))),
            other => other,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.touch();
        }
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            remote: self.io.peer_addr().ok(),
            streams: Arc::clone(&self.streams),
        }
    }
}

/// An accepted connection, as the accept loop keeps it (oldest first).
struct Tracked {
    streams: Arc<AtomicUsize>,
    evict: oneshot::Sender<()>,
}

/// Accepts connections up to the limit and hands them to the server. At
/// the limit, the oldest connection with no stream open makes room (a
/// gateway reopens one it needs; a connection held open for nothing loses
/// its place); only when every connection is busy is the newcomer closed.
pub(crate) async fn accept(
    listener: tokio::net::TcpListener,
    tx: mpsc::Sender<io::Result<Guarded>>,
    settings: Settings,
    stats: Arc<Stats>,
) {
    let mut refused = RateLimit::default();
    let mut failed = RateLimit::default();
    let mut open: std::collections::VecDeque<Tracked> = std::collections::VecDeque::new();
    loop {
        let (io, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                if let Some(n) = failed.allow(std::time::Instant::now()) {
                    tracing::warn!("the endpoint picker cannot accept: {e}{}", held_back(n));
                }
                // Out of descriptors: pause rather than spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|t| !t.evict.is_closed());
        if open.len() >= settings.max_connections {
            match open.iter().position(|t| t.streams.load(Relaxed) == 0) {
                Some(i) => {
                    if let Some(t) = open.remove(i) {
                        let _ = t.evict.send(());
                    }
                    stats.connections_evicted.fetch_add(1, Relaxed);
                }
                None => {
                    stats.connections_refused.fetch_add(1, Relaxed);
                    if let Some(n) = refused.allow(std::time::Instant::now()) {
                        tracing::warn!(
                            "the endpoint picker refused a connection from {peer}: its {} connections all have streams open (epp.max_connections){}",
                            settings.max_connections,
                            held_back(n)
                        );
                    }
                    continue;
                }
            }
        }
        // Without TCP_NODELAY a reply waits for the peer's delayed ACK
        // (40 ms on Linux) behind the one before it.
        let _ = io.set_nodelay(true);
        let streams = Arc::new(AtomicUsize::new(0));
        let (evict, evicted) = oneshot::channel();
        open.push_back(Tracked {
            streams: Arc::clone(&streams),
            evict,
        });
        let conn = Guarded::new(
            io,
            settings.idle_timeout,
            streams,
            evicted,
            Arc::clone(&stats),
        );
        if tx.send(Ok(conn)).await.is_err() {
            return;
        }
    }
}

/// Serves ext_proc and health on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    picker: Arc<Picker>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    for name in ["", "liveness", "readiness", EXT_PROC_SERVICE] {
        reporter
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    let (tx, rx) = mpsc::channel(16);
    let acceptor = tokio::spawn(accept(
        listener,
        tx,
        picker.settings.clone(),
        Arc::clone(&picker.stats),
    ));
    // Envoy sends a buffered body in one message.
    let max_message = picker.limits.max_body_bytes.saturating_add(1 << 20);
    let served = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .add_service(health)
        .add_service(
            ExternalProcessorServer::new(Service(picker)).max_decoding_message_size(max_message),
        )
        .serve_with_incoming_shutdown(ReceiverStream::new(rx), shutdown)
        .await;
    acceptor.abort();
    served
}

/// The address a listener is bound to, for logs.
pub fn describe(addr: SocketAddr) -> String {
    format!("ext_proc on {addr} ({EXT_PROC_SERVICE}, grpc.health.v1)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn only_a_streamed_request_without_a_response_body_ends_with_the_request() {
        use BodySendMode::*;
        let config = |request: BodySendMode, response: BodySendMode| ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            ..Default::default()
        };
        for (request, response, early) in [
            (Buffered, None, false),
            (BufferedPartial, None, false),
            (Streamed, None, true),
            (FullDuplexStreamed, None, true),
            (Buffered, Streamed, false),
            (Streamed, Streamed, false),
            (FullDuplexStreamed, FullDuplexStreamed, false),
        ] {
            assert_eq!(
                ends_with_the_request(&config(request, response)),
                early,
                "{request:?} {response:?}"
            );
        }
    }

    #[test]
    fn a_reply_is_taken_however_late_it_comes_and_a_dropped_request_is_none() {
        // Already there.
        let (tx, rx) = oneshot::channel();
        tx.send(vec![1]).unwrap();
        assert_eq!(run(core_reply(rx)), Some(vec![1]));
        // Within the wait, from another thread.
        let (tx, rx) = oneshot::channel();
        let t = std::thread::spawn(move || tx.send(vec![2]).unwrap());
        assert_eq!(run(core_reply(rx)), Some(vec![2]));
        t.join().unwrap();
        // Long after the wait: the task parks, and the reply wakes it.
        let (tx, rx) = oneshot::channel();
        let t = std::thread::spawn(move || {
            std::thread::sleep(REPLY_WAIT * 20);
            tx.send(vec![3]).unwrap();
        });
        let start = std::time::Instant::now();
        assert_eq!(run(core_reply(rx)), Some(vec![3]));
        assert!(start.elapsed() >= REPLY_WAIT * 20);
        t.join().unwrap();
        // Dropped at once, and after the wait.
        let (tx, rx) = oneshot::channel::<Vec<u8>>();
        drop(tx);
        assert_eq!(run(core_reply(rx)), None);
        let (tx, rx) = oneshot::channel::<Vec<u8>>();
        let t = std::thread::spawn(move || {
            std::thread::sleep(REPLY_WAIT * 20);
            drop(tx);
        });
        assert_eq!(run(core_reply(rx)), None);
        t.join().unwrap();
    }

    #[test]
    fn other_tasks_run_while_a_late_reply_is_awaited() {
        // Past the wait the serving thread is free again: a second task on
        // the same single-threaded runtime finishes before the late reply.
        let order = run(async {
            let (tx, rx) = oneshot::channel();
            let done = Arc::new(std::sync::Mutex::new(Vec::new()));
            let d = Arc::clone(&done);
            let other = tokio::spawn(async move { d.lock().unwrap().push("other") });
            let t = std::thread::spawn(move || {
                std::thread::sleep(REPLY_WAIT * 40);
                tx.send(vec![]).unwrap();
            });
            core_reply(rx).await.unwrap();
            done.lock().unwrap().push("reply");
            other.await.unwrap();
            t.join().unwrap();
            done.lock().unwrap().clone()
        });
        assert_eq!(order, ["other", "reply"]);
    }
}
