//! An ext_proc processor that does no work of its own, for the benches
//! that measure what a picker costs above it: it answers each message of
//! a stream at once with what a function of the message says, until the
//! stream ends (as Envoy keeps it open until the response is over), and
//! serves on one thread, without Nagle's algorithm, as kvedge's picker
//! does.

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};

/// The service: `F` answers each message.
#[derive(Clone)]
struct Answering<F>(F);

#[tonic::async_trait]
impl<F> ExternalProcessor for Answering<F>
where
    F: Fn(ProcessingRequest) -> ProcessingResponse + Clone + Send + Sync + 'static,
{
    type ProcessStream =
        tokio_stream::wrappers::ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let answer = self.0.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if tx.send(Ok(answer(m))).await.is_err() {
                    break;
                }
            }
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }
}

/// Serves ext_proc on `listener`, answering each message with `answer`,
/// on a runtime of the calling thread, until the process ends.
pub fn serve<F>(listener: std::net::TcpListener, answer: F) -> Result<(), String>
where
    F: Fn(ProcessingRequest) -> ProcessingResponse + Clone + Send + Sync + 'static,
{
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            |s| s.inspect(|s| drop(s.set_nodelay(true))),
        );
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(Answering(answer)))
            .serve_with_incoming(incoming)
            .await
            .map_err(|e| e.to_string())
    })
}
