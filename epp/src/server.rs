//! The gRPC side: Envoy's `envoy.service.ext_proc.v3.ExternalProcessor`
//! and the standard health service, on tonic. Each stream is an
//! [`Exchange`]; its selects, `prefill_done`s and `finish`es go to the
//! routing core through a [`Backend`] in the binary query protocol, the
//! same requests a Unix-socket client sends.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_request::Request as Msg,
};
use kvedge_wire::{Ids, Pairs, Request, Role, Select, Status, Strs, binary};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, async_trait};

use crate::picker::{Exchange, Limits, Picked, SelectArgs, Step};
use crate::tokenize::Models;

/// The gRPC service name of ext_proc (for health checks).
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How long a stream may wait between messages before its pick: Envoy
/// sends the buffered body right after the headers, so a stream silent
/// this long is abandoned (it is closed with `DEADLINE_EXCEEDED`). After
/// the pick, the response may take as long as generation does.
pub const REQUEST_PHASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Streams at once per gRPC connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4096;

/// The routing core, as the picker reaches it.
pub trait Backend: Send + Sync + 'static {
    /// Serves one binary-protocol request (a frame body: op, version,
    /// payload) and calls `reply` with the reply frame (length, status,
    /// version, payload). A `reply` never called means the core is gone.
    fn call(&self, body: Vec<u8>, reply: Box<dyn FnOnce(Vec<u8>) + Send>);
}

/// The picker's shared state.
pub struct Picker {
    models: Models,
    limits: Limits,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker")
            .field("models", &self.models)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Picker {
    pub fn new(models: Models, limits: Limits, backend: Arc<dyn Backend>) -> Picker {
        Picker {
            models,
            limits,
            backend,
        }
    }

    /// One request to the core; its reply's status and payload.
    async fn call(&self, request: &Request<'_>) -> Result<(Status, Vec<u8>), String> {
        let mut out = Vec::with_capacity(256);
        binary::encode_request(&mut out, request).map_err(|e| e.to_string())?;
        let (tx, rx) = oneshot::channel();
        self.backend.call(
            out.split_off(4),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        let frame = rx
            .await
            .map_err(|_| "the routing core is gone".to_owned())?;
        if frame.len() < 8 {
            return Err("a short reply frame from the routing core".into());
        }
        let code = u16::from_le_bytes([frame[4], frame[5]]);
        let status = Status::from_code(code).ok_or("an unknown status from the routing core")?;
        Ok((status, frame[8..].to_vec()))
    }

    /// The core's pick for `args` (reserved).
    pub async fn select(&self, args: &SelectArgs) -> Picked {
        let headers: BTreeMap<String, String> = args.headers.iter().cloned().collect();
        let mut s = if args.approximate.is_empty() {
            Select::new(&args.model, Role::Aggregated, Ids::tokens(&args.tokens))
        } else {
            let mut s = Select::new(
                &args.model,
                Role::Aggregated,
                Ids::hashes(&args.approximate),
            );
            s.approximate = true;
            s
        };
        s.prompt_tokens = args.prompt_tokens;
        s.tenant = args.tenant.as_deref();
        s.session = args.session.as_deref();
        s.headers = Pairs::map(&headers);
        s.subset = Strs::strings(&args.subset);
        match self.call(&Request::Select(s)).await {
            Ok((Status::Ok, payload)) => match binary::decode_select_reply(&payload) {
                Ok(v) if v.provider => Picked::Provider {
                    name: v.provider_name.to_owned(),
                    endpoint: v.endpoint.to_owned(),
                },
                Ok(v) => Picked::Worker {
                    endpoint: v.endpoint.to_owned(),
                    request_id: v.request_id,
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
                status: "internal",
                message,
            },
        }
    }

    /// Sends `prefill_done` or `finish` without waiting for the answer:
    /// Envoy's reply need not wait for the core's bookkeeping. A refusal
    /// (an id already finished or expired) is logged at debug level.
    fn release(&self, request: Request<'static>) {
        let mut out = Vec::with_capacity(16);
        if let Err(e) = binary::encode_request(&mut out, &request) {
            tracing::warn!("{request:?}: {e}");
            return;
        }
        let what = format!("{request:?}");
        self.backend.call(
            out.split_off(4),
            Box::new(move |frame| {
                let code = frame.get(4..6).map(|c| u16::from_le_bytes([c[0], c[1]]));
                if code != Some(Status::Ok.code()) {
                    tracing::debug!(
                        "{what} answered {:?}: {}",
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
        loop {
            let picked = ex.as_ref().is_some_and(Exchange::picked);
            let next = if picked {
                inbound.message().await
            } else {
                match tokio::time::timeout(REQUEST_PHASE_TIMEOUT, inbound.message()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let _ = out
                            .send(Err(tonic::Status::deadline_exceeded(
                                "no request body within 30 s of the headers",
                            )))
                            .await;
                        break;
                    }
                }
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
                Exchange::new(
                    c.is_some_and(|c| c.request_body_mode == duplex),
                    c.is_some_and(|c| c.response_body_mode == duplex),
                )
            });
            if let Some(m) = &msg.metadata_context {
                ex.handle_metadata(m);
            }
            let step = match &msg.request {
                Some(Msg::RequestHeaders(h)) => ex.handle_request_headers(h),
                Some(Msg::RequestBody(b)) => ex.handle_request_body(b, &self.models, &self.limits),
                Some(Msg::ResponseHeaders(h)) => ex.handle_response_headers(h),
                Some(Msg::ResponseBody(b)) => ex.handle_response_body(b),
                Some(Msg::RequestTrailers(_)) => ex.handle_trailers(false),
                Some(Msg::ResponseTrailers(_)) => ex.handle_trailers(true),
                // A flow-control message needs no answer.
                None => continue,
            };
            let replies = match step {
                Step::Nothing => continue,
                Step::Reply(r) => vec![r],
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
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(Arc::clone(&self.0).run(request.into_inner(), tx));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
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
    // Without TCP_NODELAY a reply waits for the peer's delayed ACK
    // (40 ms on Linux) behind the one before it.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |conn| {
            let conn = conn?;
            conn.set_nodelay(true)?;
            Ok::<_, std::io::Error>(conn)
        },
    );
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .add_service(health)
        .add_service(ExternalProcessorServer::new(Service(picker)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The address a listener is bound to, for logs.
pub fn describe(addr: SocketAddr) -> String {
    format!("ext_proc on {addr} ({EXT_PROC_SERVICE}, grpc.health.v1)")
}
