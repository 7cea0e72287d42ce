//! The least a picker behind Envoy can cost: an ext_proc processor that
//! reads nothing and answers every request with the next engine in turn,
//! in kvedge's own answer (`kvedge_epp::picker::pick_response`: the
//! destination header, the `envoy.lb` metadata, a cleared route cache).
//! Envoy in front of it runs the shipped configuration, so that router
//! `envoy-floor` is the shipped gateway path with a picker that does no
//! work: what Envoy and gRPC alone cost. It runs as a process of its own
//! (the shoot-out started again with `--floor-processor`), so that its CPU
//! time is counted as a router's, as kvedge's daemon's is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeadersResponse, ProcessingRequest, ProcessingResponse,
};

/// The argument that makes the shoot-out's binary this processor:
/// `--floor-processor LISTEN ENGINE...`.
pub const ARG: &str = "--floor-processor";

#[derive(Clone)]
struct RoundRobin {
    engines: Arc<[String]>,
    next: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl ExternalProcessor for RoundRobin {
    type ProcessStream =
        tokio_stream::wrappers::ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            // Until Envoy ends the stream (the response's end), as the
            // shipped configuration keeps it open.
            while let Ok(Some(m)) = inbound.message().await {
                let r = match m.request {
                    Some(Msg::RequestHeaders(_)) => ProcessingResponse {
                        response: Some(Response::RequestHeaders(HeadersResponse {
                            response: None,
                        })),
                        ..Default::default()
                    },
                    _ => {
                        let i = this.next.fetch_add(1, Ordering::Relaxed) % this.engines.len();
                        kvedge_epp::picker::pick_response(&this.engines[i], None)
                    }
                };
                if tx.send(Ok(r)).await.is_err() {
                    break;
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// Serves on `args[0]` (`IP:PORT`) with the engines `args[1..]`
/// (`IP:PORT` each) until killed, on one thread as kvedge's picker serves.
pub fn serve(args: &[String]) -> Result<(), String> {
    let (listen, engines) = args
        .split_first()
        .ok_or_else(|| format!("{ARG} LISTEN ENGINE..."))?;
    if engines.is_empty() {
        return Err(format!("{ARG}: no engines"));
    }
    let listen: SocketAddr = listen.parse().map_err(|e| format!("{ARG} {listen}: {e}"))?;
    let service = RoundRobin {
        engines: engines.iter().cloned().collect(),
        next: Arc::new(AtomicUsize::new(0)),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("{listen}: {e}"))?;
        // Without Nagle's algorithm, as the picker's accept loop sets.
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            |s| s.inspect(|s| drop(s.set_nodelay(true))),
        );
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(service))
            .serve_with_incoming(incoming)
            .await
            .map_err(|e| e.to_string())
    })
}
