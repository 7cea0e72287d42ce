//! Helpers for tests and benchmarks: a real tokenizer without a download,
//! OpenAI-style HTTP engines, `kvedge mock-engine` nodes that publish as
//! vLLM does, and a real Envoy (its binary named by the caller) in front of
//! them, with the picker or round robin. They panic on failure, as a test
//! would.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The shipped Envoy configuration for the picker.
pub const SHIPPED_CONFIG: &str = include_str!("../../deploy/envoy/envoy.yaml");

/// A port free on `ip` just now, taken from below Linux's ephemeral range
/// (32768-60999): a port the kernel handed out for `:0` can be handed out
/// again as the source port of any outgoing connection before the caller
/// binds it, which makes a test's listener fail at random under load.
pub fn free_port(ip: Ipv4Addr) -> u16 {
    use std::sync::OnceLock;
    use std::sync::atomic::AtomicU32;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // One start per process: the calls then walk a permutation of the
    // range (7,919 is prime to 12,000), so two calls never return the same
    // port, even when the first one's port is not bound yet (a start
    // drawn per call could land on a port just handed out).
    static SEED: OnceLock<u32> = OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        std::process::id().wrapping_mul(2_654_435_761)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
    });
    for _ in 0..1_000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let step = (u64::from(seed) + u64::from(n) * 7_919) % 12_000;
        let port = 20_000 + step as u16;
        if TcpListener::bind((ip, port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on {ip} between 20000 and 32000");
}

/// An OpenAI-compatible engine: answers `/v1/completions` and
/// `/v1/chat/completions`, streamed (server-sent events, chunked) or not,
/// and counts the requests it served.
#[derive(Debug)]
pub struct HttpEngine {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl HttpEngine {
    /// An engine on `ip` (a free port).
    pub fn start(ip: Ipv4Addr) -> HttpEngine {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, s) = (Arc::clone(&hits), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let h = Arc::clone(&h);
                        std::thread::spawn(move || serve_http(conn, &h));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        HttpEngine { addr, hits, stop }
    }

    /// `http://ip:port`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests served so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for HttpEngine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocking accept so its thread sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// Reads one HTTP/1.1 message, a request or a response: its start line
/// (without the line end) and its body (content-length or chunked);
/// `None` at the end of the stream or on a malformed message.
pub fn read_message(r: &mut BufReader<TcpStream>) -> Option<(String, Vec<u8>)> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let start = line.trim_end().to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        // What a gateway sends when the body was streamed through it.
        let mut body = Vec::new();
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).ok()?;
            if size == 0 {
                return Some((start, body));
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    let len: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some((start, body))
}

fn serve_http(conn: TcpStream, hits: &AtomicUsize) {
    // Replies go out in several writes: without this each waits for the
    // gateway's delayed ACK.
    let _ = conn.set_nodelay(true);
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    while let Some((_, body)) = read_message(&mut r) {
        hits.fetch_add(1, Ordering::SeqCst);
        let req: Value = serde_json::from_slice(&body).unwrap_or_default();
        if req["stream"] == true {
            let _ = w.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            );
            for piece in [
                "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
                "data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
                "data: [DONE]\n\n",
            ] {
                std::thread::sleep(Duration::from_millis(20));
                let _ = write!(w, "{:x}\r\n{piece}\r\n", piece.len());
            }
            let _ = w.write_all(b"0\r\n\r\n");
        } else {
            let answer =
                json!({"object": "text_completion", "choices": [{"text": "ok"}]}).to_string();
            let _ = write!(
                w,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
        }
    }
}

/// Which bodies Envoy's ext_proc filter sends the picker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bodies {
    /// As shipped: the request body `BUFFERED`, no response body (the
    /// picker learns the response's end from its stream's end).
    Shipped,
    /// The response body `STREAMED` as well (its first chunk is the
    /// request's first token: `prefill_done`).
    StreamedResponse,
    /// Both bodies `FULL_DUPLEX_STREAMED`, trailers too (as the Gateway API
    /// Inference Extension's gateways configure it).
    FullDuplex,
}

/// The shipped configuration with the picker on `epp_port` and the bodies
/// sent to it as `bodies` says (the listener still on 8081).
pub fn shipped_config(epp_port: u16, bodies: Bodies) -> String {
    let config = SHIPPED_CONFIG.replace("port_value: 9002", &format!("port_value: {epp_port}"));
    let response = |mode: &str| {
        config.replace(
            "response_body_mode: NONE",
            &format!("response_body_mode: {mode}"),
        )
    };
    match bodies {
        Bodies::Shipped => config,
        Bodies::StreamedResponse => response("STREAMED"),
        Bodies::FullDuplex => response("FULL_DUPLEX_STREAMED")
            .replace(
                "request_body_mode: BUFFERED",
                "request_body_mode: FULL_DUPLEX_STREAMED",
            )
            .replace("request_trailer_mode: SKIP", "request_trailer_mode: SEND")
            .replace("response_trailer_mode: SKIP", "response_trailer_mode: SEND"),
    }
}

/// A real Envoy in front of the picker and the engines.
#[derive(Debug)]
pub struct Envoy {
    child: Child,
    /// Where it listens (127.0.0.1).
    pub port: u16,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// The shipped configuration (`deploy/envoy/envoy.yaml`) with the
    /// picker on `epp_port`.
    pub fn start(
        binary: &str,
        dir: &std::path::Path,
        epp_port: u16,
        failure_mode_allow: bool,
    ) -> Envoy {
        Envoy::start_with(binary, dir, epp_port, failure_mode_allow, Bodies::Shipped)
    }

    /// The shipped configuration with the picker on `epp_port` and the
    /// bodies sent to it as `bodies` says.
    pub fn start_with(
        binary: &str,
        dir: &std::path::Path,
        epp_port: u16,
        failure_mode_allow: bool,
        bodies: Bodies,
    ) -> Envoy {
        let config = shipped_config(epp_port, bodies).replace(
            "failure_mode_allow: false",
            &format!("failure_mode_allow: {failure_mode_allow}"),
        );
        Envoy::start_config(binary, dir, &config)
    }

    /// Any configuration whose listener is on `port_value: 8081` (moved to
    /// a free port).
    pub fn start_config(binary: &str, dir: &std::path::Path, config: &str) -> Envoy {
        let port = free_port(Ipv4Addr::LOCALHOST);
        let config = config.replace("port_value: 8081", &format!("port_value: {port}"));
        let path = dir.join(format!("envoy-{port}.yaml"));
        std::fs::write(&path, config).unwrap();
        let log = std::fs::File::create(dir.join(format!("envoy-{port}.log"))).unwrap();
        let child = Command::new(binary)
            .args(["-c", path.to_str().unwrap(), "--log-level", "warn"])
            .args(["--base-id", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("envoy starts");
        let envoy = Envoy { child, port };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "envoy did not listen; its log: {}",
                std::fs::read_to_string(dir.join(format!("envoy-{port}.log"))).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        envoy
    }

    /// The Envoy process's id (for its CPU time and memory).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// POSTs `body` to `path`; the status and the whole response body.
    pub fn post(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (u16, String) {
        let (status, _, body) = self.post_full(path, body, headers);
        (status, body)
    }

    /// [`Envoy::post`] with the response's head (status line and headers).
    pub fn post_full(
        &self,
        path: &str,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> (u16, String, String) {
        post((Ipv4Addr::LOCALHOST, self.port).into(), path, body, headers)
    }
}

/// POSTs `body` to `path` at `addr` over a new HTTP/1.1 connection (closed
/// after the response); the status, the response's head (status line and
/// headers) and its body as it came (chunked framing included).
pub fn post(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .map(|(h, b)| (h.to_owned(), b.to_owned()))
        .unwrap_or_default();
    (status, head, body)
}

/// Plain Envoy in front of `endpoints`: a listener on `port_value: 8081`
/// (for [`Envoy::start_config`]) routing everything round robin over them,
/// no picker; the baseline the picker is compared with.
pub fn round_robin_config(endpoints: &[SocketAddr]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|e| {
            format!(
                "              - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                e.ip(),
                e.port()
            )
        })
        .collect();
    format!(
        r#"static_resources:
  listeners:
    - name: gateway
      address:
        socket_address: {{ address: 127.0.0.1, port_value: 8081 }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: gateway
                route_config:
                  virtual_hosts:
                    - name: engines
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/" }}
                          route: {{ cluster: engines, timeout: 300s }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: engines
      type: STATIC
      lb_policy: ROUND_ROBIN
      connect_timeout: 2s
      load_assignment:
        cluster_name: engines
        endpoints:
          - lb_endpoints:
{endpoints}"#
    )
}

/// A `kvedge mock-engine` as a node of its own: on `127.0.0.(1 + worker)`,
/// serving HTTP and publishing as vLLM does (ZeroMQ events and replay,
/// Prometheus metrics), each on a free port. Its events go out on vLLM's
/// default topic, the empty one (a reader that matches topics exactly,
/// such as vllm-router's static event sources, reads them).
#[derive(Clone, Copy, Debug)]
pub struct VllmNode {
    pub worker: u64,
    pub ip: Ipv4Addr,
    pub events: u16,
    pub replay: u16,
    pub metrics: u16,
    pub http: SocketAddr,
}

impl VllmNode {
    /// Free ports for node `worker` (1 to 254).
    pub fn new(worker: u64) -> VllmNode {
        let ip = Ipv4Addr::new(127, 0, 0, 1 + worker as u8);
        let [events, replay, metrics, http] = [0; 4].map(|_| free_port(ip));
        VllmNode {
            worker,
            ip,
            events,
            replay,
            metrics,
            http: SocketAddr::from((ip, http)),
        }
    }

    /// Its command line (the `kvedge` binary at `kvedge`, its socket in
    /// `dir`, model `m` with `tokenizer`); the caller adds the engine's
    /// speed and shape and spawns it.
    pub fn command(&self, kvedge: &Path, dir: &Path, tokenizer: &Path) -> Command {
        let (ip, w) = (self.ip, self.worker);
        let mut c = Command::new(kvedge);
        c.arg("mock-engine")
            .args(["--worker-id", &w.to_string(), "--model", "m"])
            .arg("--listen")
            .arg(dir.join(format!("engine-{w}.sock")))
            .arg("--runtime-dir")
            .arg(dir)
            .args(["--vllm-events", &format!("tcp://{ip}:{}", self.events)])
            .arg("--vllm-topic=")
            .args(["--vllm-replay", &format!("tcp://{ip}:{}", self.replay)])
            .args(["--vllm-metrics", &format!("{ip}:{}", self.metrics)])
            .args(["--http", &self.http.to_string()])
            .arg("--tokenizer")
            .arg(tokenizer);
        c
    }

    /// Its entry in kvedge's `engines:` section (model `m`).
    pub fn entry(&self, block_size: u32) -> String {
        let (ip, w, http) = (self.ip, self.worker, self.http);
        format!(
            "  - kind: vllm\n    model: m\n    worker_id: {w}\n    block_size: {block_size}\n    endpoint: http://{http}\n    events: tcp://{ip}:{}\n    replay: tcp://{ip}:{}\n    topic: \"\"\n    metrics: http://{ip}:{}/metrics\n",
            self.events, self.replay, self.metrics
        )
    }
}

/// Trains a BPE tokenizer (whitespace pre-tokenizer, `vocab_size`
/// entries) on the Markdown files in `docs`, saves it as a
/// `tokenizer.json` at `path`, and returns it loaded from there.
pub fn train_tokenizer(docs: &Path, vocab_size: usize, path: &Path) -> tokenizers::Tokenizer {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    let files: Vec<String> = std::fs::read_dir(docs)
        .expect("the docs folder")
        .filter_map(|e| Some(e.ok()?.path().to_string_lossy().into_owned()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .build()
        .into();
    let mut t = tokenizers::Tokenizer::new(BPE::default());
    t.with_pre_tokenizer(Some(Whitespace {}));
    t.train_from_files(&mut trainer, files)
        .expect("training on the docs");
    t.save(path, false).expect("saving tokenizer.json");
    tokenizers::Tokenizer::from_file(path).expect("the saved tokenizer loads")
}
