//! A gRPC client of the endpoint picker (what Envoy is to it), without
//! Envoy: streams opened, headers and bodies sent, answers read.
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;

pub type Client = ExternalProcessorClient<tonic::transport::Channel>;

pub async fn connect(port: u16) -> Client {
    Client::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

pub fn headers(path: &str) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":path".into(),
                    raw_value: path.as_bytes().to_vec(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub fn body(b: &[u8], end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Msg::RequestBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub type Open = (
    mpsc::Sender<ProcessingRequest>,
    tonic::Streaming<ProcessingResponse>,
);

/// Opens a stream; the sender feeds it, the stream answers.
pub async fn open(client: &mut Client) -> Open {
    try_open(client).await.unwrap()
}

pub async fn try_open(client: &mut Client) -> Result<Open, tonic::Status> {
    let (tx, rx) = mpsc::channel(8);
    let stream = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok((tx, stream))
}

/// Opens a stream and sends a completion's headers (answered at once).
pub async fn open_request(client: &mut Client) -> Result<Open, tonic::Status> {
    let (tx, mut stream) = try_open(client).await?;
    tx.send(headers("/v1/completions")).await.unwrap();
    stream.message().await?;
    Ok((tx, stream))
}

/// One buffered completion on a new stream, kept open: the answer to its
/// body, and the stream.
pub async fn pick_held(client: &mut Client, body: &[u8]) -> (ProcessingResponse, Open) {
    let (tx, mut s) = open_request(client).await.unwrap();
    tx.send(self::body(body, true)).await.unwrap();
    let r = s.message().await.unwrap().unwrap();
    (r, (tx, s))
}

/// One buffered completion's exchange on a new stream (its headers
/// carrying `subset` as a gateway's hint when given): the answer to its
/// body. The stream closes when this returns, which releases any
/// reservation.
pub async fn pick(client: &mut Client, body: &[u8], subset: Option<&[&str]>) -> ProcessingResponse {
    let (tx, mut s) = open(client).await;
    let h = headers("/v1/completions");
    let h = match subset {
        Some(e) => with_subset(h, e),
        None => h,
    };
    tx.send(h).await.unwrap();
    s.message().await.unwrap().unwrap();
    tx.send(self::body(body, true)).await.unwrap();
    s.message().await.unwrap().unwrap()
}

/// `m` carrying a gateway's subset hint (as Envoy forwards the
/// `envoy.lb.subset_hint` filter metadata).
pub fn with_subset(mut m: ProcessingRequest, endpoints: &[&str]) -> ProcessingRequest {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: endpoints
                .iter()
                .map(|e| Value {
                    kind: Some(Kind::StringValue((*e).to_owned())),
                })
                .collect(),
        })),
    };
    let hint = Struct {
        fields: [("x-gateway-destination-endpoint-subset".to_owned(), list)].into(),
    };
    m.metadata_context = Some(Metadata {
        filter_metadata: [("envoy.lb.subset_hint".to_owned(), hint)].into(),
        ..Default::default()
    });
    m
}

/// The local reply's status, or 0 for another kind of response.
pub fn status(r: &ProcessingResponse) -> i32 {
    match &r.response {
        Some(Response::ImmediateResponse(i)) => i.status.as_ref().map_or(0, |s| s.code),
        _ => 0,
    }
}

/// The picked destination of a body response, if any.
pub fn destination(r: &ProcessingResponse) -> Option<String> {
    let Some(Response::RequestBody(b)) = &r.response else {
        return None;
    };
    let h = b
        .response
        .as_ref()?
        .header_mutation
        .as_ref()?
        .set_headers
        .first()?;
    Some(String::from_utf8_lossy(&h.header.as_ref()?.raw_value).into_owned())
}
