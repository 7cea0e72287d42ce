//! The endpoint picker's decision as a gateway meets it: a 2,048-token chat
//! request, rendered with its template and tokenized with its tokenizer,
//! then picked by the routing core, over a real gRPC ext_proc stream (the
//! request headers, the buffered body, the pick) against an in-process
//! daemon with one engine holding the conversation's blocks. Beside it,
//! the template and tokenizer alone. Each chat is measured twice: as a new
//! conversation every time (its first message differs), and as the next
//! turn of a conversation whose earlier turns the picker saw (the same
//! history, a new question at the end), which its tokenization prefix
//! cache serves. The tokenizer has the template's role markers as special
//! tokens, as real models do. The same text sent as a plain-text prompt,
//! new or continued, is tokenized alone too. The prefix cache is on (its
//! default size) in every row.
//!
//! Each decision is followed by the same exchange with a processor that
//! answers at once, in the same process: the gRPC floor, so that the
//! picker's own part is each decision less the floor's exchange after it
//! (the machine's moods weigh on both alike). The process runs with the
//! kvedge binary's allocator (mimalloc).
//!
//! The same bodies through kvedge's own HTTP front door (`epp.http_listen`),
//! where no gRPC floor stands between the client and the pick: each
//! request is timed from the client's write until an engine (a plain
//! socket server in this process) has read the whole forwarded request,
//! and is followed by the same request sent to that engine directly (the
//! kernel's loopback floor), so that the front door's part is the
//! difference.
//!
//! Not criterion: the figures wanted are p50 and p99 per decision, so each
//! decision is timed on the monotonic clock and the samples sorted.
//!
//! `cargo bench --bench epp [-- --quick]`

#![forbid(unsafe_code)]

#[path = "support/ext_proc.rs"]
mod ext_proc;
mod support;

/// The kvedge binary's allocator, so that the daemon in this process
/// allocates as the shipped one does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use kvedge_epp::body::Prompt;
use kvedge_epp::{ModelSpec, Models};
use kvedge_testkit::Percentiles;

const TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = if quick { 500 } else { 2_000 };
    let dir = std::env::temp_dir().join(format!("kvedge-bench-epp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let tokenizer_path = dir.join("tokenizer.json");
    let docs = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs"));
    let mut trained = kvedge_epp::testing::train_tokenizer(docs, 8000, &tokenizer_path);
    trained.add_special_tokens(&[
        tokenizers::AddedToken::from("<|user|>", true),
        tokenizers::AddedToken::from("<|assistant|>", true),
    ]);
    trained.save(&tokenizer_path, false).unwrap();
    let template_path = dir.join("chat.jinja");
    std::fs::write(&template_path, TEMPLATE).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).unwrap();

    // A conversation of about 2,048 tokens: the docs' text, cut to length.
    let mut text = String::new();
    for f in ["daemon.md", "policies.md", "rules.md", "operations.md"] {
        text.push_str(
            &std::fs::read_to_string(format!("{}/../docs/{f}", env!("CARGO_MANIFEST_DIR")))
                .unwrap(),
        );
    }
    let rendered_len = |t: &str| {
        tokenizer
            .encode_fast(format!("<|user|>{t}\n<|assistant|>"), false)
            .unwrap()
            .len()
    };
    let mut chars = text.len();
    while rendered_len(&text[..text.floor_char_boundary(chars)]) > 2048 {
        chars = chars * 9 / 10;
    }
    let content = text[..text.floor_char_boundary(chars)].to_owned();
    // Request i: a new conversation (its first message says which), or
    // the next turn after the same history (a new question at the end).
    let (half, _) = content.split_at(content.floor_char_boundary(content.len() / 2));
    let rest = &content[half.len()..];
    let messages = |i: usize, seen: bool| -> Vec<serde_json::Value> {
        let first = if seen {
            half.to_owned()
        } else {
            format!("Conversation {i}. {half}")
        };
        vec![
            serde_json::json!({"role": "user", "content": first}),
            serde_json::json!({"role": "assistant", "content": rest}),
            serde_json::json!({"role": "user", "content": format!("And question {i}?")}),
        ]
    };
    let body = |i: usize, seen: bool| -> Vec<u8> {
        serde_json::json!({"model": "m", "stream": true, "messages": messages(i, seen)})
            .to_string()
            .into_bytes()
    };

    // The template and tokenizer alone.
    let spec = ModelSpec {
        engine: Default::default(),
        name: "m".into(),
        tokenizer: Some(tokenizer_path.clone()),
        chat_template: Some(template_path.clone()),
        bos_token: String::new(),
        eos_token: String::new(),
    };
    // `n` tokenizations of prompt(i) by a fresh set of models, after 100
    // for warm-up.
    let timed = |prompt: &dyn Fn(usize) -> Prompt| {
        let models = Models::load_with(std::slice::from_ref(&spec), 32 << 20).unwrap();
        let mut samples = Vec::with_capacity(n);
        for i in 0..n + 100 {
            let prompt = prompt(i);
            let t = Instant::now();
            let ids = models.tokens("m", prompt, 1 << 20).unwrap();
            if i >= 100 {
                samples.push(t.elapsed());
            }
            std::hint::black_box(ids);
        }
        samples
    };
    // The seen conversation's ids: what the engine holds, and the body of
    // the token-id row.
    let tokens = match Models::load_with(std::slice::from_ref(&spec), 0)
        .unwrap()
        .tokens("m", Prompt::chat(messages(0, true)), 1 << 20)
        .unwrap()
    {
        kvedge_epp::tokenize::Tokens::Ids(ids) => ids,
        kvedge_epp::tokenize::Tokens::Text(_) => panic!("not tokenized"),
    };
    let alone_new = timed(&|i| Prompt::chat(messages(i, false)));
    let alone_seen = timed(&|i| Prompt::chat(messages(i, true)));
    // The same text as a plain-text completion prompt (a conversation
    // kept as one string): a new one every time, or the next turn.
    let text_new =
        timed(&|i| Prompt::Text(format!("Conversation {i}. {half}{rest}\nAnd question {i}?")));
    let text_seen = timed(&|i| Prompt::Text(format!("{half}{rest}\nAnd question {i}?")));

    // The daemon with its picker and front door, and an engine holding
    // the blocks (its HTTP side a socket server that notes when each
    // request has arrived whole).
    let free = || kvedge_epp::testing::free_port(std::net::Ipv4Addr::LOCALHOST);
    let (port, door) = (free(), free());
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 600000\nepp:\n  listen: 127.0.0.1:{port}\n  http_listen: 127.0.0.1:{door}\n  models:\n    - name: m\n      tokenizer: {}\n      chat_template: {}\n",
        tokenizer_path.display(),
        template_path.display()
    );
    let daemon = kvedge_testkit::Bound::at(dir.join("run"), kvedge_testkit::config(&yaml)).run();
    let (upstream, arrivals) = upstream();
    let engine = support::engine(&daemon.control(), 1, &format!("http://{upstream}"), &tokens);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The same prompt as token ids on /v1/completions: everything but
    // the template and the tokenizer.
    let ids_body = serde_json::json!({"model": "m", "stream": true, "prompt": tokens})
        .to_string()
        .into_bytes();
    let floor_port = answers_at_once();
    let (chat_new, chat_seen, with_ids) = rt.block_on(async {
        let connect =
            |port: u16| ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}"));
        let mut clients = [
            connect(port).await.unwrap(),
            connect(floor_port).await.unwrap(),
        ];
        let chat = "/v1/chat/completions";
        let new = decisions(&mut clients, chat, |i| body(i, false), n).await;
        let seen = decisions(&mut clients, chat, |i| body(i, true), n).await;
        let ids = decisions(&mut clients, "/v1/completions", |_| ids_body.clone(), n).await;
        (new, seen, ids)
    });
    // The front door: the same bodies, without streaming (the engine
    // answers with one small JSON body).
    let unstreamed = |b: Vec<u8>| {
        let mut v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        v["stream"] = serde_json::Value::Bool(false);
        v.to_string().into_bytes()
    };
    let door = std::net::SocketAddr::from(([127, 0, 0, 1], door));
    let mut via = FrontDoor::new(door, upstream, arrivals);
    let chat = "/v1/chat/completions";
    // New conversations the picker has not seen over ext_proc either
    // (its prefix cache would hold those).
    let door_new = via.decisions(chat, |i| unstreamed(body(n + 100 + i, false)), n);
    let door_seen = via.decisions(chat, |i| unstreamed(body(i, true)), n);
    let door_ids = via.decisions("/v1/completions", |_| unstreamed(ids_body.clone()), n);
    drop(via);
    drop(engine);
    daemon.stop();
    let _ = std::fs::remove_dir_all(&dir);

    let chat_tokens = tokens.len();
    let row = |what: &str, samples: Vec<Duration>| {
        let (p50, p99) = Percentiles::of(samples).p50_p99_us();
        println!("| {what} | {p50:.1} µs | {p99:.1} µs |");
    };
    // A decision's rows: over ext_proc, the floor's exchange beside it,
    // and the picker's own part.
    // A paired measurement's rows: the path measured, the floor measured
    // beside it, and the difference (`labels`: the floor's, the part's).
    let rows = |head: &str, labels: [&str; 2], d: Paired| {
        row(head, d.picker);
        row(labels[0], d.floor);
        row(labels[1], d.own);
    };
    let grpc = [
        "  the same exchange with a processor that answers at once (the gRPC floor)",
        "  the picker's part (each decision less the floor's exchange after it)",
    ];
    let loopback = [
        "  the same request sent to the engine directly (the loopback floor)",
        "  the front door's part (each request less the direct one after it)",
    ];
    println!(
        "a chat request of {chat_tokens} tokens ({} bytes of body), {n} decisions each:",
        body(0, true).len()
    );
    println!("| what | p50 | p99 |");
    println!("|---|---|---|");
    row(
        "template and tokenizer alone, a new conversation",
        alone_new,
    );
    row(
        "template and tokenizer alone, earlier turns seen (prefix cache)",
        alone_seen,
    );
    row(
        "a plain-text prompt, tokenizer alone, a new text every time",
        text_new,
    );
    row(
        "a plain-text prompt, tokenizer alone, the text before its last line seen",
        text_seen,
    );
    let ids_what = format!(
        "the prompt sent as token ids (no template or tokenizer; {} bytes of body)",
        ids_body.len()
    );
    for (what, d) in [
        ("a new conversation (headers, body, pick)", chat_new),
        ("earlier turns seen", chat_seen),
        (ids_what.as_str(), with_ids),
    ] {
        rows(
            &format!("the picker's decision over ext_proc, {what}"),
            grpc,
            d,
        );
    }
    // The front door's: the request's way to the engine through it, sent
    // directly, and the front door's part.
    for (what, d) in [
        ("a new conversation", door_new),
        ("earlier turns seen", door_seen),
        ("the prompt sent as token ids", door_ids),
    ] {
        let head = format!("through the front door until the engine has the request, {what}");
        rows(&head, loopback, d);
    }
}

/// The engine's HTTP side: a socket server on 127.0.0.2 that reads each
/// request whole, sends the instant it had it, and answers `200 {}`. Its
/// address, and the instants.
fn upstream() -> (std::net::SocketAddr, std::sync::mpsc::Receiver<Instant>) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            conn.set_nodelay(true).unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                let mut r = std::io::BufReader::new(conn);
                while kvedge_epp::testing::read_message(&mut r).is_some() {
                    let _ = tx.send(Instant::now());
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if w.write_all(answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// A client of the front door and, beside it, of the engine directly,
/// each over one kept-alive connection.
struct FrontDoor {
    door: std::io::BufReader<std::net::TcpStream>,
    direct: std::io::BufReader<std::net::TcpStream>,
    arrivals: std::sync::mpsc::Receiver<Instant>,
}

impl FrontDoor {
    fn new(
        door: std::net::SocketAddr,
        engine: std::net::SocketAddr,
        arrivals: std::sync::mpsc::Receiver<Instant>,
    ) -> FrontDoor {
        let connect = |a| {
            let s = std::net::TcpStream::connect(a).unwrap();
            s.set_nodelay(true).unwrap();
            std::io::BufReader::new(s)
        };
        FrontDoor {
            door: connect(door),
            direct: connect(engine),
            arrivals,
        }
    }

    /// `n` requests through the front door (after 100 for warm-up), each
    /// followed by the same request to the engine directly.
    fn decisions(&mut self, path: &str, body: impl Fn(usize) -> Vec<u8>, n: usize) -> Paired {
        let mut d = Paired::with_capacity(n);
        for i in 0..n + 100 {
            let body = body(i);
            let through = Self::request(&mut self.door, &self.arrivals, path, &body);
            let direct = Self::request(&mut self.direct, &self.arrivals, path, &body);
            if i >= 100 {
                d.push(through, direct);
            }
        }
        d
    }

    /// One request on `conn`: the time from its write until the engine
    /// had it whole; then its `200` read.
    fn request(
        conn: &mut std::io::BufReader<std::net::TcpStream>,
        arrivals: &std::sync::mpsc::Receiver<Instant>,
        path: &str,
        body: &[u8],
    ) -> Duration {
        use std::io::Write;
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        let t = Instant::now();
        conn.get_mut().write_all(&req).unwrap();
        let arrived = arrivals.recv_timeout(Duration::from_secs(10)).unwrap();
        let (status, _) = kvedge_epp::testing::read_message(conn).expect("an answer");
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        arrived.saturating_duration_since(t)
    }
}

/// An ext_proc processor on its own thread and single-threaded runtime,
/// as the picker's, that answers each message at once: what the gRPC
/// exchanges alone cost. Its port.
fn answers_at_once() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        ext_proc::serve(listener, |m| {
            let response = match m.request {
                Some(Msg::RequestHeaders(_)) => {
                    Response::RequestHeaders(HeadersResponse { response: None })
                }
                _ => Response::RequestBody(BodyResponse {
                    response: Some(CommonResponse {
                        clear_route_cache: true,
                        ..Default::default()
                    }),
                }),
            };
            ProcessingResponse {
                response: Some(response),
                ..Default::default()
            }
        })
        .unwrap()
    });
    port
}

/// A decision's samples: the picker's, the floor's, and their differences.
struct Paired {
    picker: Vec<Duration>,
    floor: Vec<Duration>,
    own: Vec<Duration>,
}

impl Paired {
    fn with_capacity(n: usize) -> Paired {
        Paired {
            picker: Vec::with_capacity(n),
            floor: Vec::with_capacity(n),
            own: Vec::with_capacity(n),
        }
    }

    /// One pair: the measured path's time and the floor's after it.
    fn push(&mut self, measured: Duration, floor: Duration) {
        self.picker.push(measured);
        self.floor.push(floor);
        self.own.push(measured.saturating_sub(floor));
    }
}

/// `n` decisions (after 100 to warm the connections and caches), each a
/// gRPC stream of the request headers for `path` and the buffered `body`,
/// timed until the pick arrives; each followed by the same exchange with
/// the processor that answers at once (`clients[1]`), so that the
/// machine's moods weigh on both alike.
async fn decisions(
    clients: &mut [ExternalProcessorClient<tonic::transport::Channel>; 2],
    path: &str,
    body: impl Fn(usize) -> Vec<u8>,
    n: usize,
) -> Paired {
    let mut d = Paired::with_capacity(n);
    for i in 0..n + 100 {
        let body = body(i);
        let picker = exchange(&mut clients[0], path, body.clone()).await;
        let floor = exchange(&mut clients[1], path, body).await;
        if i >= 100 {
            d.push(picker, floor);
        }
    }
    d
}

/// One ext_proc stream: the request headers for `path` and the buffered
/// `body`, timed until the answer to the body (a pick) arrives.
async fn exchange(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    path: &str,
    body: Vec<u8>,
) -> Duration {
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":path".into(),
                raw_value: path.as_bytes().to_vec(),
                ..Default::default()
            }],
        }),
        ..Default::default()
    };
    let t = Instant::now();
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tx.send(ProcessingRequest {
        request: Some(Msg::RequestHeaders(headers)),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(ProcessingRequest {
        request: Some(Msg::RequestBody(HttpBody {
            body,
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut stream = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let _headers = stream.message().await.unwrap().unwrap();
    let pick = stream.message().await.unwrap().unwrap();
    let elapsed = t.elapsed();
    let Some(Response::RequestBody(b)) = pick.response else {
        panic!("a pick: {pick:?}");
    };
    assert!(b.response.is_some_and(|c| c.clear_route_cache));
    drop(tx);
    elapsed
}
