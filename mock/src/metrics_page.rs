//! The mock engine's Prometheus page, served as a vLLM server serves its
//! `/metrics`: HTTP/1.1 with kept-alive connections (hyper, on the feed's
//! tokio runtime), the latest page for `GET /metrics`, 404 for any other
//! path. The port faces whoever can reach it, so connections are capped
//! and a client that does not send its request head in time is dropped.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;

/// Connections served at once; more are closed as they arrive.
pub const MAX_CONNECTIONS: usize = 16;
/// A request head not received within this long closes the connection
/// (an idle kept-alive connection included).
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// What vLLM's server (Python's prometheus_client) answers with.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves `page` on `addr` from `rt`; binding errors are returned at once.
pub fn serve(rt: &Runtime, addr: &str, page: Arc<Mutex<String>>) -> std::io::Result<()> {
    let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    rt.spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                // Out of descriptors, most likely: try again shortly
                // rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Over the cap: dropped, which closes it.
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                continue;
            };
            let page = Arc::clone(&page);
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let answer = respond(&req, &page);
                    async move { Ok::<_, Infallible>(answer) }
                });
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                drop(slot);
            });
        }
    });
    Ok(())
}

fn respond(req: &Request<Incoming>, page: &Mutex<String>) -> Response<Full<Bytes>> {
    let (status, body) = if req.method() == Method::GET && req.uri().path() == "/metrics" {
        let text = page.lock().map(|p| p.clone()).unwrap_or_default();
        (StatusCode::OK, text)
    } else {
        (StatusCode::NOT_FOUND, "try /metrics\n".to_owned())
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(TEXT_FORMAT),
    );
    response
}
