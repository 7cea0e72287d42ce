//! One HTTP request's life through the gateway, as the ext_proc stream
//! shows it: request headers, the buffered request body (where the pick
//! is made), then the response headers and body (where the reservation is
//! accounted: `prefill_done` at the first body chunk, `finish` at the end
//! of the stream or when the stream goes away early).
//!
//! [`Exchange`] is the state of one stream; it does no I/O. Each
//! `handle_*` returns what to answer Envoy, and the [`Step::Select`] it may
//! ask for is carried out by the server against the routing core.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
    body_mutation::Mutation, processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use bytes::Bytes;

use crate::body::{self, Route};
use crate::tokenize::{Models, PromptError, Tokens};

/// The header (and `envoy.lb` metadata key) that carries the pick.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The header (and `envoy.lb` metadata key) that names a provider the
/// rules chose; the gateway routes it to that provider's cluster.
pub const PROVIDER: &str = "x-kvedge-provider";
/// The request header that carries a decision's explanation when the
/// configured debug header asked for it; the gateway copies it into the
/// response. One a client sent is always removed.
pub const DECISION: &str = "x-kvedge-decision";
/// The dynamic-metadata namespace Envoy's load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace of a gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints (`ip:port`) the pick must come from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The most request headers the picker reads (Envoy's own default limit
/// is 100).
pub const MAX_HEADERS: usize = 256;
/// The most bytes of request headers the picker reads (Envoy's own
/// default limit is 60 KiB).
pub const MAX_HEADER_BYTES: usize = 96 << 10;

/// What the picker is configured with.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request body read, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Largest prompt, in tokens (larger: 400).
    pub max_prompt_tokens: usize,
    /// The header naming the tenant the rule language sees (lower case).
    pub tenant_header: Option<String>,
    /// The header naming a session for affinity (lower case).
    pub session_header: Option<String>,
    /// The header naming an explicit target, `worker_id[/dp_rank]` (lower
    /// case); `None`: clients cannot choose a worker.
    pub target_header: Option<String>,
    /// The header listing tolerated taints, comma-separated (lower case).
    pub tolerations_header: Option<String>,
    /// The header that asks for the decision's explanation (lower case);
    /// `None`: never explained.
    pub debug_header: Option<String>,
    /// Chunk size of the approximate prefix mode, in bytes (0: prompts
    /// without a tokenizer route on load alone).
    pub approximate_chunk_bytes: usize,
    /// The routing core's regex classifier reads texts up to this many
    /// bytes (0: none is configured): a prompt's text that fits goes with
    /// its select; a longer one, or a prompt of token ids, goes without
    /// (the classifier's skipped case). Shared with the daemon, which
    /// sets it at startup and at each reload.
    pub classify_text_bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// A select the core is asked for.
#[derive(Debug, PartialEq)]
pub struct SelectArgs {
    pub model: String,
    pub tokens: Vec<u32>,
    /// The prompt length when `tokens` is empty because no tokenizer
    /// could count them (an estimate: bytes / 4).
    pub prompt_tokens: Option<u32>,
    /// Without token ids: the text's chunk hashes, for an approximate
    /// select ([`crate::approx`]); empty with token ids.
    pub approximate: Vec<u64>,
    pub tenant: Option<String>,
    pub session: Option<String>,
    pub headers: Vec<(String, String)>,
    /// The gateway's subset hint: pick only among these endpoints (empty:
    /// no hint).
    pub subset: Vec<String>,
    /// Explain the decision ([`DECISION`]): the request carried the
    /// configured debug header.
    pub explain: bool,
    /// What started this turn; the core sees it with a session only.
    pub trigger: kvedge_wire::Trigger,
    /// The prompt's text for the regex classifier.
    pub text: Option<String>,
    /// The target header's value, read when the select is made.
    pub target: Option<String>,
    /// The tolerations header's entries.
    pub tolerations: Vec<String>,
}

/// A target header's value, `worker_id` or `worker_id/dp_rank`.
pub fn parse_target(v: &str) -> Result<kvedge_wire::Target, String> {
    let v = v.trim();
    let (id, rank) = v.split_once('/').unwrap_or((v, "0"));
    match (id.trim().parse(), rank.trim().parse()) {
        (Ok(worker_id), Ok(dp_rank)) => Ok(kvedge_wire::Target { worker_id, dp_rank }),
        _ => Err(format!(
            "the target header `{v}` is not worker_id or worker_id/dp_rank"
        )),
    }
}

/// The select a read prompt asks for: by its token ids, or, without them,
/// approximately by its text's chunk hashes; `prompt_tokens` when the ids
/// cannot count it.
pub fn prompt_select<'a>(
    model: &'a str,
    tokens: &'a [u32],
    prompt_tokens: Option<u32>,
    approximate: &'a [u64],
) -> kvedge_wire::Select<'a> {
    use kvedge_wire::{Ids, Role, Select};
    let mut s = if approximate.is_empty() {
        Select::new(model, Role::Aggregated, Ids::tokens(tokens))
    } else {
        let mut s = Select::new(model, Role::Aggregated, Ids::hashes(approximate));
        s.approximate = true;
        s
    };
    s.prompt_tokens = prompt_tokens;
    s
}

impl Prompted {
    /// The select this prompt asks for ([`prompt_select`]).
    pub fn select(&self) -> kvedge_wire::Select<'_> {
        prompt_select(
            &self.model,
            &self.tokens,
            self.prompt_tokens,
            &self.approximate,
        )
    }
}

/// A whole request body, for [`prompt`].
#[derive(Debug, Clone)]
pub struct Body {
    pub route: Route,
    pub bytes: Bytes,
}

/// A body's prompt, read for the pick.
#[derive(Debug, PartialEq)]
pub struct Prompted {
    pub model: String,
    pub tokens: Vec<u32>,
    /// The prompt length when `tokens` is empty (see [`SelectArgs`]).
    pub prompt_tokens: Option<u32>,
    pub approximate: Vec<u64>,
    /// What started this turn: a chat whose last message is a tool's
    /// result (`role: tool`, or the older `function`) is a tool turn.
    pub trigger: kvedge_wire::Trigger,
    /// The prompt's text for the regex classifier (see
    /// [`Limits::classify_text_bytes`]).
    pub text: Option<String>,
}

/// A local reply that refuses a request (boxed: it is large, and rare).
pub type Refusal = Box<ProcessingResponse>;

/// [`immediate`], boxed.
pub fn refuse(code: i32, kind: &str, message: &str) -> Refusal {
    Box::new(immediate(code, kind, message))
}

/// What the picker makes of a request to `path` with `body` (its model
/// and prompt), or the HTTP status and message it would answer instead;
/// for tools that show a body's decision outside the gateway.
pub fn read_request(
    path: &str,
    body: &[u8],
    models: &Models,
    limits: &Limits,
) -> Result<Prompted, (i32, String)> {
    let route = Route::of(path).ok_or_else(|| {
        (
            404,
            format!("{path} is neither /v1/completions nor /v1/chat/completions"),
        )
    })?;
    if body.len() > limits.max_body_bytes {
        return Err((
            413,
            format!(
                "a body of {} bytes, over the limit of {}",
                body.len(),
                limits.max_body_bytes
            ),
        ));
    }
    let body = Body {
        route,
        bytes: Bytes::copy_from_slice(body),
    };
    prompt(&body, models, limits).map_err(|refusal| match refusal.response {
        Some(Response::ImmediateResponse(r)) => (
            r.status.map_or(400, |s| s.code),
            serde_json::from_slice::<serde_json::Value>(&r.body)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
                .unwrap_or_else(|| String::from_utf8_lossy(&r.body).into_owned()),
        ),
        _ => (400, "refused".to_owned()),
    })
}

/// Reads `body`'s prompt: parses it, renders a chat with the model's
/// template and tokenizes (or, without a tokenizer, hashes the text in
/// chunks). The work grows with the body, so the server runs it off its
/// serving thread when the body is large. A refusal is the reply to send.
pub fn prompt(body: &Body, models: &Models, limits: &Limits) -> Result<Prompted, Refusal> {
    prompted(body::parse(body.route, &body.bytes), models, limits)
}

/// [`prompt`] for a body whose prompt is a list of token ids, which costs
/// about a nanosecond a byte whatever its size (no template or
/// tokenizer); `None` for any other body, found out as soon as its prompt
/// is seen.
pub fn prompt_of_ids(
    body: &Body,
    models: &Models,
    limits: &Limits,
) -> Option<Result<Prompted, Refusal>> {
    if body.route != Route::Completions {
        return None;
    }
    Some(prompted(body::token_ids(&body.bytes)?, models, limits))
}

/// The prompt of a body read by [`body::parse`] or [`body::token_ids`],
/// or the refusal to send.
fn prompted(
    parsed: Result<body::Parsed, body::BodyError>,
    models: &Models,
    limits: &Limits,
) -> Result<Prompted, Refusal> {
    let parsed = parsed.map_err(|e| refuse(400, "bad_request", &e.to_string()))?;
    let trigger = trigger_of(&parsed.prompt);
    let text = classified_text(
        &parsed.prompt,
        limits
            .classify_text_bytes
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    let tokens = match models.tokens(&parsed.model, parsed.prompt, limits.max_prompt_tokens) {
        Ok(t) => t,
        Err(e @ PromptError::UnknownModel(_)) => {
            return Err(refuse(404, "model_not_found", &e.to_string()));
        }
        Err(e) => return Err(refuse(400, "bad_request", &e.to_string())),
    };
    let (tokens, prompt_tokens, approximate) = match tokens {
        Tokens::Ids(ids) => (ids, None, Vec::new()),
        Tokens::Text(text) => {
            // No tokenizer: about four bytes a token, held to the same
            // limit as a tokenized prompt.
            let estimate = (text.len() / 4).max(1);
            if estimate > limits.max_prompt_tokens {
                return Err(refuse(
                    400,
                    "bad_request",
                    &format!(
                        "the prompt has about {estimate} tokens ({} bytes), over the limit of {}",
                        text.len(),
                        limits.max_prompt_tokens
                    ),
                ));
            }
            (
                Vec::new(),
                Some(u32::try_from(estimate).unwrap_or(u32::MAX)),
                crate::approx::chunk_hashes(text.as_bytes(), limits.approximate_chunk_bytes),
            )
        }
    };
    Ok(Prompted {
        model: parsed.model,
        tokens,
        prompt_tokens,
        approximate,
        trigger,
        text,
    })
}

/// The text a regex classifier reads of `prompt` when it is at most
/// `limit` bytes: a completion's text, or a chat's messages as roles and
/// contents line by line; `None` for token ids, a longer text, or `limit`
/// 0 (no classifier).
fn classified_text(prompt: &body::Prompt, limit: usize) -> Option<String> {
    if limit == 0 {
        return None;
    }
    let text = match prompt {
        body::Prompt::Text(t) if t.len() <= limit => t.clone(),
        body::Prompt::Messages(c) => crate::tokenize::plain_text(&c.messages),
        _ => return None,
    };
    (text.len() <= limit).then_some(text)
}

/// A chat whose last message carries a tool's result is a tool turn;
/// anything else is a user's.
pub fn trigger_of(prompt: &body::Prompt) -> kvedge_wire::Trigger {
    match prompt {
        body::Prompt::Messages(c)
            if c.messages
                .last()
                .and_then(|m| m.get("role"))
                .and_then(serde_json::Value::as_str)
                .is_some_and(|r| r == "tool" || r == "function") =>
        {
            kvedge_wire::Trigger::Tool
        }
        _ => kvedge_wire::Trigger::User,
    }
}

/// What the core answered a select.
#[derive(Debug, Clone, PartialEq)]
pub enum Picked {
    /// A worker at `endpoint` (its URL, `http://host:port`), reserved
    /// under `request_id`.
    Worker {
        endpoint: String,
        request_id: u64,
        /// The explanation, when asked for.
        decision: Option<String>,
    },
    /// An off-cluster provider (the rule language chose it): the gateway
    /// routes on its name ([`PROVIDER`]). Nothing is reserved.
    Provider {
        name: String,
        endpoint: String,
        /// The explanation, when asked for.
        decision: Option<String>,
    },
    /// The core's refusal: its status name and message.
    Refused {
        status: &'static str,
        message: String,
    },
}

/// What to do after a message.
#[derive(Debug)]
pub enum Step {
    /// Send nothing yet (a full-duplex stream's headers and body chunks
    /// before the body's end).
    Nothing,
    /// Send this to Envoy.
    Reply(ProcessingResponse),
    /// Read the body's prompt with [`prompt`], then call
    /// [`Exchange::handle_prompt`].
    Prompt(Body),
    /// Ask the core, then call [`Exchange::handle_picked`].
    Select(SelectArgs),
    /// Tell the core the first token is out, then send the reply.
    PrefillDone(u64, ProcessingResponse),
    /// Release the reservation, then send the reply.
    Finish(u64, ProcessingResponse),
}

/// The state of one ext_proc stream.
#[derive(Debug, Default)]
pub struct Exchange {
    /// The request body comes `FULL_DUPLEX_STREAMED`: the headers are
    /// answered after the body's end, with the pick, and the body is sent
    /// back as a streamed response.
    duplex_request: bool,
    /// The response body comes `FULL_DUPLEX_STREAMED`: each chunk is sent
    /// back as it came.
    duplex_response: bool,
    route: Option<Route>,
    headers: Vec<(String, String)>,
    /// The gateway's subset hint, once one was seen.
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The whole body once it arrived (sent back in full-duplex mode).
    whole: Option<Bytes>,
    /// The reservation to account, once picked.
    request_id: Option<u64>,
    prefill_reported: bool,
    finished: bool,
}

impl Exchange {
    /// An exchange whose bodies come in the given modes (from the first
    /// message's protocol configuration; `BUFFERED` and `STREAMED` when
    /// Envoy does not say).
    pub fn new(duplex_request: bool, duplex_response: bool) -> Exchange {
        Exchange {
            duplex_request,
            duplex_response,
            ..Default::default()
        }
    }

    /// The request's filter metadata arrived with a message: its subset
    /// hint, if any, restricts the pick.
    pub fn handle_metadata(&mut self, m: &Metadata) {
        let Some(hint) = m.filter_metadata.get(SUBSET_NAMESPACE) else {
            return;
        };
        let Some(value) = hint.fields.get(SUBSET_KEY) else {
            return;
        };
        let mut subset = Vec::new();
        let mut add = |s: &str| {
            subset.extend(
                s.split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(str::to_owned),
            )
        };
        match &value.kind {
            Some(Kind::StringValue(s)) => add(s),
            Some(Kind::ListValue(l)) => {
                for v in &l.values {
                    if let Some(Kind::StringValue(s)) = &v.kind {
                        add(s);
                    }
                }
            }
            _ => {}
        }
        self.subset = Some(subset);
    }

    /// Whether a worker was picked (the response phase has begun).
    pub fn picked(&self) -> bool {
        self.request_id.is_some() || self.finished
    }

    /// The request's headers arrived.
    pub fn handle_request_headers(&mut self, h: &HttpHeaders) -> Step {
        let all = h.headers.iter().flat_map(|m| m.headers.iter());
        let (count, bytes) = all.fold((0usize, 0usize), |(n, b), v| {
            (n + 1, b + v.key.len() + v.value.len() + v.raw_value.len())
        });
        if count > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
            return Step::Reply(immediate(
                431,
                "request_header_fields_too_large",
                &format!(
                    "the request has {count} headers of {bytes} bytes; the picker reads at most {MAX_HEADERS} of {MAX_HEADER_BYTES} bytes"
                ),
            ));
        }
        self.headers = h
            .headers
            .iter()
            .flat_map(|m| m.headers.iter())
            .map(|v| (v.key.to_ascii_lowercase(), header_value(v)))
            .collect();
        let path = self
            .headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map(|(_, v)| v.as_str())
            .unwrap_or("");
        self.route = Route::of(path);
        if self.route.is_none() {
            return Step::Reply(immediate(
                404,
                "not_found",
                &format!(
                    "`{path}` is not an OpenAI route the picker serves (/v1/completions, /v1/chat/completions)"
                ),
            ));
        }
        if h.end_of_stream {
            return Step::Reply(immediate(400, "bad_request", "the request has no body"));
        }
        if self.duplex_request {
            // Answered with the pick, once the body is whole.
            return Step::Nothing;
        }
        Step::Reply(ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse { response: None })),
            ..Default::default()
        })
    }

    /// A request body chunk arrived (the whole body, in `BUFFERED` mode).
    /// Once the body is whole, its prompt is to be read ([`Step::Prompt`]):
    /// by [`prompt`], wherever the caller runs it, then
    /// [`Exchange::handle_prompt`].
    pub fn handle_request_body(&mut self, b: &HttpBody, limits: &Limits) -> Step {
        if self.body.len() + b.body.len() > limits.max_body_bytes {
            return Step::Reply(immediate(
                413,
                "body_too_large",
                &format!("the request body is over {} bytes", limits.max_body_bytes),
            ));
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            if self.duplex_request {
                return Step::Nothing;
            }
            return Step::Reply(ProcessingResponse {
                response: Some(Response::RequestBody(BodyResponse { response: None })),
                ..Default::default()
            });
        }
        let body = Bytes::from(std::mem::take(&mut self.body));
        self.whole = Some(body.clone());
        Step::Prompt(Body {
            route: self.route.unwrap_or(Route::Completions),
            bytes: body,
        })
    }

    /// The body's prompt was read: the select to ask for, or the refusal
    /// to answer.
    pub fn handle_prompt(&mut self, read: Result<Prompted, Refusal>, limits: &Limits) -> Step {
        let p = match read {
            Ok(p) => p,
            Err(reply) => return Step::Reply(*reply),
        };
        let subset = match &self.subset {
            Some(s) if s.is_empty() => {
                return Step::Reply(immediate(
                    503,
                    "no_worker",
                    "the gateway's subset hint names no endpoint",
                ));
            }
            Some(s) => s.clone(),
            None => Vec::new(),
        };
        Step::Select(select_args(p, &self.headers, subset, limits))
    }

    /// The core answered the select asked for by the body: what to send
    /// (the pick as the body's answer; in full-duplex mode the headers'
    /// answer with the pick, then the body sent back).
    pub fn handle_picked(&mut self, picked: Picked) -> Vec<ProcessingResponse> {
        match picked {
            Picked::Worker {
                endpoint,
                request_id,
                decision,
            } => {
                self.request_id = Some(request_id);
                let Some(addr) = host_port(&endpoint) else {
                    // Not addressable by the gateway's original-destination
                    // cluster: released by the caller, and said why.
                    return vec![immediate(
                        503,
                        "unroutable_endpoint",
                        &format!("the chosen endpoint `{endpoint}` is not http://host:port"),
                    )];
                };
                self.answer(pick_response(&addr, decision.as_deref()))
            }
            Picked::Provider { name, endpoint, .. } if name.is_empty() => vec![immediate(
                503,
                "unroutable_endpoint",
                &format!("a provider at `{endpoint}` was chosen but not named"),
            )],
            Picked::Provider { name, decision, .. } => {
                self.answer(provider_response(&name, decision.as_deref()))
            }
            Picked::Refused { status, message } => {
                vec![immediate(refusal_code(status), status, &message)]
            }
        }
    }

    /// The pick's answer as this exchange's mode sends it: the body's
    /// answer, or in full-duplex mode the headers' answer and then the body
    /// sent back whole.
    fn answer(&mut self, pick: ProcessingResponse) -> Vec<ProcessingResponse> {
        if !self.duplex_request {
            return vec![pick];
        }
        let mut headers = pick;
        let Some(Response::RequestBody(BodyResponse { response })) = headers.response.take() else {
            unreachable!("pick_response answers a body");
        };
        headers.response = Some(Response::RequestHeaders(HeadersResponse { response }));
        let body = ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(streamed(
                    self.whole.take().map(Vec::from).unwrap_or_default(),
                    true,
                )),
            })),
            ..Default::default()
        };
        vec![headers, body]
    }

    /// An immediate response about the pick was sent: its reservation (if
    /// any, for an unroutable endpoint) is released now.
    pub fn take_unused_reservation(&mut self) -> Option<u64> {
        if self.finished {
            return None;
        }
        self.finished = true;
        self.request_id.take()
    }

    /// The response's headers arrived.
    pub fn handle_response_headers(&mut self, h: &HttpHeaders) -> Step {
        let reply = ProcessingResponse {
            response: Some(Response::ResponseHeaders(HeadersResponse {
                response: None,
            })),
            ..Default::default()
        };
        if h.end_of_stream {
            return self.finish_with(reply);
        }
        Step::Reply(reply)
    }

    /// A response body chunk passed.
    pub fn handle_response_body(&mut self, b: &HttpBody) -> Step {
        let response = self
            .duplex_response
            .then(|| streamed(b.body.clone(), b.end_of_stream));
        let reply = ProcessingResponse {
            response: Some(Response::ResponseBody(BodyResponse { response })),
            ..Default::default()
        };
        if b.end_of_stream {
            return self.finish_with(reply);
        }
        match self.request_id {
            Some(id) if !self.prefill_reported && !b.body.is_empty() => {
                self.prefill_reported = true;
                Step::PrefillDone(id, reply)
            }
            _ => Step::Reply(reply),
        }
    }

    /// Request or response trailers arrived (asked for by some
    /// full-duplex configurations): let them pass.
    pub fn handle_trailers(&mut self, response: bool) -> Step {
        let t = TrailersResponse {
            header_mutation: None,
        };
        Step::Reply(ProcessingResponse {
            response: Some(if response {
                Response::ResponseTrailers(t)
            } else {
                Response::RequestTrailers(t)
            }),
            ..Default::default()
        })
    }

    fn finish_with(&mut self, reply: ProcessingResponse) -> Step {
        match self.request_id.take() {
            Some(id) if !self.finished => {
                self.finished = true;
                Step::Finish(id, reply)
            }
            _ => Step::Reply(reply),
        }
    }

    /// The stream ended (Envoy closed it, the client reset, or an
    /// error): the reservation still held, if any, to release.
    pub fn handle_closed(&mut self) -> Option<u64> {
        if self.finished {
            return None;
        }
        self.finished = true;
        self.request_id.take()
    }
}

fn header_value(v: &HeaderValue) -> String {
    if v.raw_value.is_empty() {
        v.value.clone()
    } else {
        String::from_utf8_lossy(&v.raw_value).into_owned()
    }
}

/// A body chunk sent back in full-duplex mode.
fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body,
                end_of_stream,
                ..Default::default()
            })),
        }),
        ..Default::default()
    }
}

/// The select a read prompt asks for, with the request's headers
/// (lower-case names; pseudo-headers are not passed to the rules) and the
/// gateway's subset hint (empty: none).
pub fn select_args(
    p: Prompted,
    headers: &[(String, String)],
    subset: Vec<String>,
    limits: &Limits,
) -> SelectArgs {
    let header = |name: &Option<String>| {
        name.as_ref()
            .and_then(|n| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
    };
    SelectArgs {
        model: p.model,
        tokens: p.tokens,
        prompt_tokens: p.prompt_tokens,
        approximate: p.approximate,
        trigger: p.trigger,
        text: p.text,
        target: header(&limits.target_header),
        tolerations: header(&limits.tolerations_header)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
        tenant: header(&limits.tenant_header),
        session: header(&limits.session_header),
        headers: headers
            .iter()
            .filter(|(k, _)| !k.starts_with(':'))
            .cloned()
            .collect(),
        subset,
        explain: limits
            .debug_header
            .as_ref()
            .is_some_and(|h| headers.iter().any(|(k, _)| k == h)),
    }
}

/// The HTTP status a refusal of the routing core (its status name) is
/// answered with.
pub fn refusal_code(status: &str) -> i32 {
    match status {
        "too_many_requests" => 429,
        "no_worker" | "no_rule" | "rejected" => 503,
        "bad_request" => 400,
        _ => 500,
    }
}

/// `host:port` of an `http://host:port[/...]` endpoint.
pub fn host_port(endpoint: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then(|| authority.to_owned())
}

/// The answer to the request body that routes to `addr`: the header, the
/// `envoy.lb` metadata, and a cleared route cache; with `decision`, its
/// explanation in [`DECISION`].
pub fn pick_response(addr: &str, decision: Option<&str>) -> ProcessingResponse {
    routing_response(DESTINATION, addr, PROVIDER, decision)
}

/// The answer for a provider: the header [`PROVIDER`] with its name (the
/// gateway's route for that provider matches it), the destination header
/// removed (a client's own included), and the route cache cleared.
pub fn provider_response(name: &str, decision: Option<&str>) -> ProcessingResponse {
    routing_response(PROVIDER, name, DESTINATION, decision)
}

/// Sets header `key` to `value` (and the same under `envoy.lb`), removes
/// header `other`, sets [`DECISION`] to `decision` (or removes a client's),
/// and has the gateway choose its route again.
fn routing_response(
    key: &str,
    value: &str,
    other: &str,
    decision: Option<&str>,
) -> ProcessingResponse {
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    let lb = Struct {
        fields: HashMap::from([(key.to_owned(), string(value))]),
    };
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: [(key, Some(value)), (DECISION, decision)]
                        .into_iter()
                        .filter_map(|(k, v)| {
                            Some(HeaderValueOption {
                                header: Some(HeaderValue {
                                    key: k.to_owned(),
                                    raw_value: v?.as_bytes().to_vec(),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            })
                        })
                        .collect(),
                    remove_headers: [Some(other), decision.is_none().then_some(DECISION)]
                        .into_iter()
                        .flatten()
                        .map(str::to_owned)
                        .collect(),
                }),
                clear_route_cache: true,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(Struct {
            fields: HashMap::from([(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]),
        }),
        ..Default::default()
    }
}

/// A local error's body, in OpenAI's error shape.
pub fn error_body(code: i32, kind: &str, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string()
}

/// A local reply with a JSON error body (OpenAI's error shape).
pub fn immediate(code: i32, kind: &str, message: &str) -> ProcessingResponse {
    let body = error_body(code, kind, message);
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code }),
            headers: Some(HeaderMutation {
                set_headers: vec![HeaderValueOption {
                    header: Some(HeaderValue {
                        key: "content-type".to_owned(),
                        raw_value: b"application/json".to_vec(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                remove_headers: vec![],
            }),
            body: body.into_bytes(),
            details: format!("kvedge_{kind}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;

    use super::*;
    use crate::tokenize::ModelSpec;

    /// A body chunk, with its prompt read at once when the body is whole.
    fn feed(ex: &mut Exchange, b: &HttpBody, models: &Models, limits: &Limits) -> Step {
        match ex.handle_request_body(b, limits) {
            Step::Prompt(body) => {
                let read = prompt(&body, models, limits);
                ex.handle_prompt(read, limits)
            }
            other => other,
        }
    }

    fn models() -> Models {
        Models::load(&[ModelSpec {
            engine: Default::default(),
            name: "m".into(),
            tokenizer: None,
            chat_template: None,
            bos_token: String::new(),
            eos_token: String::new(),
        }])
        .unwrap()
    }

    #[test]
    fn a_provider_pick_names_the_provider_and_drops_any_destination() {
        let mut ex = Exchange::new(false, false);
        ex.handle_request_headers(&headers("/v1/completions"));
        let Step::Select(_) = feed(
            &mut ex,
            &body(br#"{"model":"m","prompt":[1]}"#, true),
            &models(),
            &limits(),
        ) else {
            panic!("a select");
        };
        let [r]: [ProcessingResponse; 1] = ex
            .handle_picked(Picked::Provider {
                name: "cloud".into(),
                endpoint: "https://api.example.com".into(),
                decision: None,
            })
            .try_into()
            .unwrap();
        let common = body_answer(&r);
        assert!(common.clear_route_cache);
        let m = common.header_mutation.as_ref().unwrap();
        let h = m.set_headers[0].header.as_ref().unwrap();
        assert_eq!(
            (h.key.as_str(), h.raw_value.as_slice()),
            (PROVIDER, &b"cloud"[..])
        );
        assert_eq!(m.remove_headers, [DESTINATION, DECISION]);
        // Nothing reserved, so nothing to report.
        assert_eq!(ex.take_unused_reservation(), None);
        // A worker pick removes a forged provider header likewise.
        let w = pick_response("10.0.0.1:80", None);
        let m = body_answer(&w).header_mutation.as_ref().unwrap();
        assert_eq!(m.remove_headers, [PROVIDER, DECISION]);
        // An explained pick sets its explanation instead.
        let w = pick_response("10.0.0.1:80", Some("worker 1/0"));
        let m = body_answer(&w).header_mutation.as_ref().unwrap();
        assert_eq!(m.remove_headers, [PROVIDER]);
        let h = m.set_headers[1].header.as_ref().unwrap();
        assert_eq!(
            (h.key.as_str(), h.raw_value.as_slice()),
            (DECISION, &b"worker 1/0"[..])
        );
    }

    #[test]
    fn text_without_a_tokenizer_is_selected_approximately() {
        let select = |prompt: &str, chunk: usize| {
            let mut ex = Exchange::new(false, false);
            ex.handle_request_headers(&headers("/v1/completions"));
            let body_json = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let limits = Limits {
                approximate_chunk_bytes: chunk,
                max_prompt_tokens: 1000,
                ..limits()
            };
            match feed(
                &mut ex,
                &body(body_json.as_bytes(), true),
                &models(),
                &limits,
            ) {
                Step::Select(args) => args,
                _ => panic!("a select"),
            }
        };
        let doc = "0123456789abcdef".repeat(2);
        let a = select(&format!("{doc}first question"), 16);
        let b = select(&format!("{doc}second one here!"), 16);
        assert!(a.tokens.is_empty());
        assert_eq!(a.prompt_tokens, Some(46 / 4));
        assert_eq!(a.approximate.len(), 2);
        assert_eq!(b.approximate.len(), 3);
        assert_eq!(a.approximate, b.approximate[..2]);
        // The mode off: a load-only select.
        assert!(select(&doc, 0).approximate.is_empty());
        // Without a tokenizer the prompt is held to the token limit all the
        // same (about four bytes a token).
        let mut ex = Exchange::new(false, false);
        ex.handle_request_headers(&headers("/v1/completions"));
        let long = serde_json::json!({"model": "m", "prompt": "x".repeat(40)}).to_string();
        let step = feed(&mut ex, &body(long.as_bytes(), true), &models(), &limits());
        assert!(
            matches!(step, Step::Reply(ref r) if status(r) == Some(400)),
            "{step:?}"
        );
    }

    #[test]
    fn oversized_headers_get_a_431() {
        let mut h = headers("/v1/completions");
        let map = h.headers.as_mut().unwrap();
        map.headers.push(HeaderValue {
            key: "x-big".into(),
            raw_value: vec![b'a'; MAX_HEADER_BYTES],
            ..Default::default()
        });
        let step = Exchange::default().handle_request_headers(&h);
        assert!(
            matches!(step, Step::Reply(ref r) if status(r) == Some(431)),
            "{step:?}"
        );
        let mut many = headers("/v1/completions");
        let map = many.headers.as_mut().unwrap();
        for i in 0..MAX_HEADERS {
            map.headers.push(HeaderValue {
                key: format!("x-{i}"),
                raw_value: b"v".to_vec(),
                ..Default::default()
            });
        }
        let step = Exchange::default().handle_request_headers(&many);
        assert!(matches!(step, Step::Reply(ref r) if status(r) == Some(431)));
    }

    /// The common part of a body response (panics for another kind).
    fn body_answer(r: &ProcessingResponse) -> &CommonResponse {
        let Some(Response::RequestBody(b)) = &r.response else {
            panic!("a body response: {r:?}");
        };
        b.response.as_ref().unwrap()
    }

    fn limits() -> Limits {
        Limits {
            max_body_bytes: 1024,
            max_prompt_tokens: 8,
            tenant_header: Some("x-tenant".into()),
            session_header: None,
            target_header: None,
            tolerations_header: None,
            debug_header: None,
            approximate_chunk_bytes: 16,
            classify_text_bytes: Default::default(),
        }
    }

    fn headers(path: &str) -> HttpHeaders {
        let h = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        };
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![h(":path", path), h("X-Tenant", "acme")],
            }),
            ..Default::default()
        }
    }

    fn body(b: &[u8], end: bool) -> HttpBody {
        HttpBody {
            body: b.to_vec(),
            end_of_stream: end,
            ..Default::default()
        }
    }

    fn status(r: &ProcessingResponse) -> Option<i32> {
        match &r.response {
            Some(Response::ImmediateResponse(i)) => i.status.as_ref().map(|s| s.code),
            _ => None,
        }
    }

    #[test]
    fn a_request_is_picked_then_accounted_over_its_response() {
        let mut ex = Exchange::default();
        assert!(matches!(
            ex.handle_request_headers(&headers("/v1/completions")),
            Step::Reply(ref r) if status(r).is_none()
        ));
        // The body in two chunks: the first is acknowledged, the last
        // asks for a select with the tenant from its header.
        assert!(matches!(
            feed(
                &mut ex,
                &body(br#"{"model":"m","#, false),
                &models(),
                &limits()
            ),
            Step::Reply(_)
        ));
        let Step::Select(args) = feed(
            &mut ex,
            &body(br#""prompt":[1,2,3]}"#, true),
            &models(),
            &limits(),
        ) else {
            panic!("a select");
        };
        assert_eq!(args.tokens, [1, 2, 3]);
        assert!(args.approximate.is_empty(), "token ids are exact");
        assert_eq!(args.tenant.as_deref(), Some("acme"));
        let [r]: [ProcessingResponse; 1] = ex
            .handle_picked(Picked::Worker {
                endpoint: "http://10.0.0.7:8000".into(),
                request_id: 42,
                decision: None,
            })
            .try_into()
            .unwrap();
        let common = body_answer(&r);
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().unwrap().set_headers[0];
        let h = set.header.as_ref().unwrap();
        assert_eq!(
            (h.key.as_str(), h.raw_value.as_slice()),
            (DESTINATION, &b"10.0.0.7:8000"[..])
        );
        let lb = &r.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("envoy.lb is a struct");
        };
        assert_eq!(
            lb.fields[DESTINATION].kind,
            Some(Kind::StringValue("10.0.0.7:8000".into()))
        );
        // The response: prefill_done at the first chunk with bytes, finish
        // at the end, nothing more when the stream closes.
        assert!(matches!(
            ex.handle_response_headers(&HttpHeaders::default()),
            Step::Reply(_)
        ));
        assert!(matches!(
            ex.handle_response_body(&body(b"", false)),
            Step::Reply(_)
        ));
        assert!(matches!(
            ex.handle_response_body(&body(b"data: a", false)),
            Step::PrefillDone(42, _)
        ));
        assert!(matches!(
            ex.handle_response_body(&body(b"data: b", false)),
            Step::Reply(_)
        ));
        assert!(matches!(
            ex.handle_response_body(&body(b"", true)),
            Step::Finish(42, _)
        ));
        assert_eq!(ex.handle_closed(), None);
    }

    #[test]
    fn a_stream_that_ends_early_releases_its_reservation() {
        let mut ex = Exchange::default();
        ex.handle_request_headers(&headers("/v1/completions"));
        feed(
            &mut ex,
            &body(br#"{"model":"m","prompt":[1]}"#, true),
            &models(),
            &limits(),
        );
        ex.handle_picked(Picked::Worker {
            endpoint: "http://10.0.0.7:8000".into(),
            request_id: 7,
            decision: None,
        });
        assert_eq!(ex.handle_closed(), Some(7));
        assert_eq!(ex.handle_closed(), None, "once");
    }

    #[test]
    fn refusals_become_local_replies_with_the_right_status() {
        let refused = |status, code| {
            let mut ex = Exchange::default();
            let r = ex.handle_picked(Picked::Refused {
                status,
                message: "m".into(),
            });
            assert_eq!(super::tests::status(&r[0]), Some(code), "{status}");
        };
        refused("no_worker", 503);
        refused("too_many_requests", 429);
        refused("bad_request", 400);
        // A provider's URL cannot go to an original-destination cluster:
        // 503, and its reservation is given back.
        let mut ex = Exchange::default();
        let r = ex.handle_picked(Picked::Worker {
            endpoint: "https://api.example.com/v1".into(),
            request_id: 9,
            decision: None,
        });
        assert_eq!(status(&r[0]), Some(503));
        assert_eq!(ex.take_unused_reservation(), Some(9));
        // Bad requests never reach the core.
        let mut ex = Exchange::default();
        ex.handle_request_headers(&headers("/v1/completions"));
        let step = feed(
            &mut ex,
            &body(br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#, true),
            &models(),
            &limits(),
        );
        assert!(matches!(step, Step::Reply(ref r) if status(r) == Some(400)));
        let mut ex = Exchange::default();
        ex.handle_request_headers(&headers("/v1/completions"));
        let step = feed(&mut ex, &body(&[b' '; 2048], true), &models(), &limits());
        assert!(matches!(step, Step::Reply(ref r) if status(r) == Some(413)));
    }

    #[test]
    fn a_full_duplex_stream_is_answered_at_the_bodys_end_with_its_body_sent_back() {
        let mut ex = Exchange::new(true, true);
        assert!(matches!(
            ex.handle_request_headers(&headers("/v1/completions")),
            Step::Nothing
        ));
        assert!(matches!(
            feed(
                &mut ex,
                &body(br#"{"model":"m","#, false),
                &models(),
                &limits()
            ),
            Step::Nothing
        ));
        assert!(matches!(
            feed(
                &mut ex,
                &body(br#""prompt":[1,2]}"#, true),
                &models(),
                &limits()
            ),
            Step::Select(_)
        ));
        let r = ex.handle_picked(Picked::Worker {
            endpoint: "http://10.0.0.7:8000".into(),
            request_id: 3,
            decision: None,
        });
        assert_eq!(r.len(), 2);
        let Some(Response::RequestHeaders(h)) = &r[0].response else {
            panic!("the headers' answer first");
        };
        let common = h.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        assert_eq!(
            common.header_mutation.as_ref().unwrap().set_headers[0]
                .header
                .as_ref()
                .unwrap()
                .raw_value,
            b"10.0.0.7:8000"
        );
        assert!(r[0].dynamic_metadata.is_some());
        let Some(Response::RequestBody(b)) = &r[1].response else {
            panic!("then the body");
        };
        let Some(Mutation::StreamedResponse(sent)) = b
            .response
            .as_ref()
            .and_then(|c| c.body_mutation.as_ref())
            .and_then(|m| m.mutation.clone())
        else {
            panic!("the body sent back");
        };
        assert_eq!(sent.body, br#"{"model":"m","prompt":[1,2]}"#);
        assert!(sent.end_of_stream);
        // Response chunks are sent back as they came.
        let Step::PrefillDone(3, r) = ex.handle_response_body(&body(b"data: a", false)) else {
            panic!("prefill_done");
        };
        let Some(Response::ResponseBody(b)) = r.response else {
            panic!("a body answer");
        };
        let Some(Mutation::StreamedResponse(sent)) = b
            .response
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        else {
            panic!("the chunk sent back");
        };
        assert_eq!(
            (sent.body.as_slice(), sent.end_of_stream),
            (&b"data: a"[..], false)
        );
    }

    #[test]
    fn endpoints_become_host_port() {
        assert_eq!(
            host_port("http://127.0.0.2:8000").as_deref(),
            Some("127.0.0.2:8000")
        );
        assert_eq!(
            host_port("http://[::1]:8000/v1").as_deref(),
            Some("[::1]:8000")
        );
        assert_eq!(host_port("http://engine-1"), None);
        assert_eq!(host_port("https://api.example.com:443"), None);
    }
}
