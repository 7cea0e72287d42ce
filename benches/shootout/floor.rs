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

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HeadersResponse, ProcessingResponse};

use crate::ext_proc;

/// The argument that makes the shoot-out's binary this processor:
/// `--floor-processor LISTEN ENGINE...`.
pub const ARG: &str = "--floor-processor";

/// Serves on `args[0]` (`IP:PORT`) with the engines `args[1..]`
/// (`IP:PORT` each) until killed.
pub fn serve(args: &[String]) -> Result<(), String> {
    let (listen, engines) = args
        .split_first()
        .ok_or_else(|| format!("{ARG} LISTEN ENGINE..."))?;
    if engines.is_empty() {
        return Err(format!("{ARG}: no engines"));
    }
    let listen: SocketAddr = listen.parse().map_err(|e| format!("{ARG} {listen}: {e}"))?;
    let listener = std::net::TcpListener::bind(listen).map_err(|e| format!("{listen}: {e}"))?;
    let engines: Arc<[String]> = engines.iter().cloned().collect();
    let next = Arc::new(AtomicUsize::new(0));
    ext_proc::serve(listener, move |m| match m.request {
        Some(Msg::RequestHeaders(_)) => ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse { response: None })),
            ..Default::default()
        },
        _ => {
            let i = next.fetch_add(1, Ordering::Relaxed) % engines.len();
            kvedge_epp::picker::pick_response(&engines[i], None)
        }
    })
}
