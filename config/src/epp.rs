//! `epp:`: kvedge as a gateway's endpoint picker (Envoy's external
//! processing gRPC protocol). Only read by the daemon's picker driver;
//! checked here so `kvedge check-config` catches its mistakes.

use serde::Deserialize;

/// The largest `tokenizer.json` read (real ones are 2-30 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// The largest chat template read (real ones are a few KB).
pub const MAX_TEMPLATE_BYTES: u64 = 1 << 20;
/// Body bytes allowed per prompt token when `max_body_bytes` is not set:
/// English text is about 4 bytes a token, JSON-escaped CJK text at most 6,
/// and a chat's framing adds a little per message.
pub const BODY_BYTES_PER_TOKEN: usize = 16;
/// Room for a body's fields other than the prompt, when `max_body_bytes`
/// is derived.
pub const BODY_OVERHEAD: usize = 64 << 10;

/// `epp:`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppSection {
    /// Where the ext_proc gRPC service listens (`host:port`); loopback
    /// unless set (a gateway on another host needs this set).
    #[serde(default = "listen")]
    pub listen: String,
    /// kvedge's own OpenAI-compatible HTTP front door (`host:port`), off
    /// unless set: requests to `/v1/completions` and
    /// `/v1/chat/completions` are picked as the gateway's are and proxied
    /// to the chosen engine, with no gateway in front.
    #[serde(default)]
    pub http_listen: Option<String>,
    /// Largest request body read, in bytes (larger: 413). Derived from
    /// `max_prompt_tokens` when not set ([`EppSection::body_limit`]).
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
    /// Largest prompt, in tokens (larger: 400).
    #[serde(default = "max_prompt_tokens")]
    pub max_prompt_tokens: usize,
    /// gRPC connections at once. At the limit the oldest connection with
    /// no stream open is closed to make room; when all have streams, the
    /// newcomer is.
    #[serde(default = "max_connections")]
    pub max_connections: usize,
    /// A connection with no stream open and no bytes this long is
    /// closed (a gateway opens another when it needs one).
    #[serde(default = "idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// ext_proc streams open at once, over all connections; more are
    /// refused (`RESOURCE_EXHAUSTED`).
    #[serde(default = "max_streams")]
    pub max_streams: usize,
    /// Request body bytes buffered at once over all streams; a body that
    /// would pass it gets a 503 at once.
    #[serde(default = "max_buffered_body_bytes")]
    pub max_buffered_body_bytes: usize,
    /// A picked stream silent this long (no response headers or body
    /// chunk) has its reservation released; the stream goes on.
    #[serde(default = "pick_timeout_ms")]
    pub pick_timeout_ms: u64,
    /// Threads that tokenize prompts and render chat templates.
    #[serde(default = "tokenizer_threads")]
    pub tokenizer_threads: usize,
    /// Prompts waiting for a tokenizer thread at most; more get a 503.
    #[serde(default = "tokenizer_queue")]
    pub tokenizer_queue: usize,
    /// A prompt not tokenized this long after it arrived gets a 503.
    #[serde(default = "tokenize_timeout_ms")]
    pub tokenize_timeout_ms: u64,
    /// The request header naming the tenant the rule language sees.
    #[serde(default)]
    pub tenant_header: Option<String>,
    /// The request header naming a session (session affinity).
    #[serde(default)]
    pub session_header: Option<String>,
    /// Off unless set: the request header naming an explicit target,
    /// `worker_id` or `worker_id/dp_rank` (the request goes to exactly
    /// that worker, no policy runs). Only for gateways whose clients may
    /// choose workers.
    #[serde(default)]
    pub target_header: Option<String>,
    /// Off unless set: the request header listing the engines' taints the
    /// request tolerates, comma-separated (`spot, draining=yes`).
    #[serde(default)]
    pub tolerations_header: Option<String>,
    /// Off unless set: a request carrying this header gets its decision
    /// explained in the `x-kvedge-decision` response header (the worker,
    /// the policy or rule that chose it, the overlap, the candidates).
    #[serde(default)]
    pub debug_header: Option<String>,
    /// Chunk size of the approximate prefix mode, in bytes: prompts the
    /// picker cannot tokenize are hashed in chunks of this size and routed
    /// to where their prefix was sent before. 0 turns the mode off (such
    /// prompts route on load alone).
    #[serde(default = "approximate_chunk_bytes")]
    pub approximate_chunk_bytes: usize,
    /// Per model with a tokenizer: bytes of rendered conversations and
    /// plain-text prompts kept with their token ids, so that the next turn
    /// of a chat (or a text that extends an earlier one) tokenizes only
    /// what is new (0: off).
    #[serde(default = "prefix_cache_bytes")]
    pub prefix_cache_bytes: usize,
    /// The models served, each with its tokenizer and chat template.
    pub models: Vec<EppModel>,
}

/// One served model.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppModel {
    pub name: String,
    /// A local `tokenizer.json`.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// A local Jinja chat template.
    #[serde(default)]
    pub chat_template: Option<String>,
    #[serde(default)]
    pub bos_token: String,
    #[serde(default)]
    pub eos_token: String,
    /// The engine that serves the model, whose OpenAI server decides how a
    /// chat is prepared for the template: `vllm` (the default) or
    /// `sglang`.
    #[serde(default)]
    pub engine: Option<String>,
}

fn listen() -> String {
    "127.0.0.1:9002".into()
}
fn max_prompt_tokens() -> usize {
    131_072
}
fn max_connections() -> usize {
    256
}
fn idle_timeout_ms() -> u64 {
    300_000
}
fn max_streams() -> usize {
    16_384
}
fn max_buffered_body_bytes() -> usize {
    256 << 20
}
fn pick_timeout_ms() -> u64 {
    300_000
}
fn tokenizer_threads() -> usize {
    2
}
fn tokenizer_queue() -> usize {
    64
}
fn tokenize_timeout_ms() -> u64 {
    2_000
}

impl EppSection {
    /// The largest request body read: `max_body_bytes`, or
    /// [`BODY_BYTES_PER_TOKEN`] per prompt token plus [`BODY_OVERHEAD`].
    pub fn body_limit(&self) -> usize {
        self.max_body_bytes.unwrap_or_else(|| {
            self.max_prompt_tokens
                .saturating_mul(BODY_BYTES_PER_TOKEN)
                .saturating_add(BODY_OVERHEAD)
                .min(1 << 30)
        })
    }
}

/// What is wrong with `path` as a file the picker reads at start: it must
/// be a regular file (not a FIFO or a device) of at most `limit` bytes.
pub fn file_problem(path: &str, limit: u64) -> Option<String> {
    match std::fs::metadata(path) {
        Err(e) => Some(format!("{path}: {e}")),
        Ok(m) if !m.is_file() => Some(format!("{path} is not a regular file")),
        Ok(m) if m.len() > limit => Some(format!(
            "{path} has {} bytes, more than the {limit} a model file may have",
            m.len()
        )),
        Ok(_) => None,
    }
}
/// About one 16-token KV block of English text (four bytes a token), so
/// an approximate overlap counts in blocks the cost model understands.
fn approximate_chunk_bytes() -> usize {
    64
}

/// 32 MiB: a few thousand conversations of a few thousand tokens each.
fn prefix_cache_bytes() -> usize {
    32 << 20
}

/// The most `epp.prefix_cache_bytes` may be set to (4 GiB).
pub const MAX_PREFIX_CACHE_BYTES: usize = 4 << 30;

/// The first unusable value: (key, message).
pub fn validate(e: &EppSection) -> Option<(&'static str, String)> {
    if e.listen.parse::<std::net::SocketAddr>().is_err() {
        return Some((
            "listen",
            format!(
                "epp.listen `{}` is not host:port (e.g. 0.0.0.0:9002)",
                e.listen
            ),
        ));
    }
    if let Some(h) = &e.http_listen
        && h.parse::<std::net::SocketAddr>().is_err()
    {
        return Some((
            "http_listen",
            format!("epp.http_listen `{h}` is not host:port (e.g. 127.0.0.1:8000)"),
        ));
    }
    if e.http_listen.as_deref() == Some(e.listen.as_str()) {
        return Some((
            "http_listen",
            format!(
                "epp.http_listen and epp.listen are both `{}`: the HTTP front door needs a port of its own",
                e.listen
            ),
        ));
    }
    if let Some(b) = e.max_body_bytes
        && !(1024..=(1 << 30)).contains(&b)
    {
        return Some((
            "max_body_bytes",
            format!(
                "epp.max_body_bytes must be between 1024 and {}, got {b}",
                1u64 << 30,
            ),
        ));
    }
    let ranges: [(&'static str, u64, u64, u64); 8] = [
        ("max_connections", e.max_connections as u64, 1, 65_536),
        ("idle_timeout_ms", e.idle_timeout_ms, 1_000, 86_400_000),
        ("max_streams", e.max_streams as u64, 1, 1 << 20),
        (
            "max_buffered_body_bytes",
            e.max_buffered_body_bytes as u64,
            1 << 20,
            1 << 40,
        ),
        ("pick_timeout_ms", e.pick_timeout_ms, 1_000, 86_400_000),
        ("tokenizer_threads", e.tokenizer_threads as u64, 1, 256),
        ("tokenizer_queue", e.tokenizer_queue as u64, 1, 1 << 20),
        ("tokenize_timeout_ms", e.tokenize_timeout_ms, 10, 600_000),
    ];
    for (key, value, min, max) in ranges {
        if !(min..=max).contains(&value) {
            return Some((
                key,
                format!("epp.{key} must be between {min} and {max}, got {value}"),
            ));
        }
    }
    if !(1..=(1 << 24)).contains(&e.max_prompt_tokens) {
        return Some((
            "max_prompt_tokens",
            format!(
                "epp.max_prompt_tokens must be between 1 and {}, got {}",
                1 << 24,
                e.max_prompt_tokens
            ),
        ));
    }
    for (key, h) in [
        ("tenant_header", &e.tenant_header),
        ("session_header", &e.session_header),
        ("debug_header", &e.debug_header),
        ("target_header", &e.target_header),
        ("tolerations_header", &e.tolerations_header),
    ] {
        let Some(h) = h else { continue };
        if h.is_empty()
            || !h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Some((key, format!("epp.{key} `{h}` is not a header name")));
        }
    }
    if e.approximate_chunk_bytes != 0 && !(16..=65_536).contains(&e.approximate_chunk_bytes) {
        return Some((
            "approximate_chunk_bytes",
            format!(
                "epp.approximate_chunk_bytes must be 0 (off) or between 16 and 65536, got {}",
                e.approximate_chunk_bytes
            ),
        ));
    }
    if e.prefix_cache_bytes > MAX_PREFIX_CACHE_BYTES {
        return Some((
            "prefix_cache_bytes",
            format!(
                "epp.prefix_cache_bytes must be at most {MAX_PREFIX_CACHE_BYTES}, got {}",
                e.prefix_cache_bytes
            ),
        ));
    }
    if e.models.is_empty() {
        return Some(("models", "epp.models names no model".into()));
    }
    let mut seen = std::collections::HashSet::new();
    for m in &e.models {
        if m.name.is_empty() {
            return Some(("models", "an epp model has an empty name".into()));
        }
        if !seen.insert(&m.name) {
            return Some(("models", format!("epp model `{}` is named twice", m.name)));
        }
        if let Some(engine) = m.engine.as_deref()
            && !["vllm", "sglang"].contains(&engine)
        {
            return Some((
                "models",
                format!(
                    "epp model `{}`: engine `{engine}` is not one kvedge renders chats for (vllm, sglang)",
                    m.name
                ),
            ));
        }
        for (path, limit) in [
            (&m.tokenizer, MAX_TOKENIZER_BYTES),
            (&m.chat_template, MAX_TEMPLATE_BYTES),
        ] {
            if let Some(problem) = path.as_deref().and_then(|p| file_problem(p, limit)) {
                return Some(("models", format!("epp model `{}`: {problem}", m.name)));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(extra: &str) -> EppSection {
        parse(&format!("{extra}models:\n  - name: m\n"))
    }

    /// The section as the loader reads it.
    fn parse(yaml: &str) -> EppSection {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_are_valid_and_each_bad_value_is_named() {
        let ok = section("");
        assert_eq!(ok.approximate_chunk_bytes, 64);
        assert_eq!(validate(&ok), None);
        assert_eq!(validate(&section("approximate_chunk_bytes: 0\n")), None);
        assert_eq!(
            ok.http_listen, None,
            "the HTTP front door is off unless set"
        );
        assert_eq!(validate(&section("http_listen: 127.0.0.1:8000\n")), None);
        for (yaml, key) in [
            ("approximate_chunk_bytes: 8\n", "approximate_chunk_bytes"),
            (
                "approximate_chunk_bytes: 100000\n",
                "approximate_chunk_bytes",
            ),
            ("listen: nowhere\n", "listen"),
            ("http_listen: nowhere\n", "http_listen"),
            ("http_listen: 127.0.0.1:9002\n", "http_listen"),
            ("max_body_bytes: 10\n", "max_body_bytes"),
            ("max_prompt_tokens: 0\n", "max_prompt_tokens"),
            ("max_connections: 0\n", "max_connections"),
            ("tokenize_timeout_ms: 1\n", "tokenize_timeout_ms"),
            ("idle_timeout_ms: 10\n", "idle_timeout_ms"),
            ("tenant_header: \"a b\"\n", "tenant_header"),
            ("session_header: \"\"\n", "session_header"),
        ] {
            let (k, message) = validate(&section(yaml)).expect(yaml);
            assert_eq!(k, key, "{yaml}: {message}");
            assert!(message.contains(key), "{message}");
        }
        let mut twice = section("");
        twice.models.push(twice.models[0].clone());
        assert_eq!(validate(&twice).unwrap().0, "models");
        let engine = |e: &str| parse(&format!("models:\n  - name: m\n    engine: {e}\n"));
        assert_eq!(validate(&engine("sglang")), None);
        assert_eq!(validate(&engine("vllm")), None);
        let (k, message) = validate(&engine("trtllm")).unwrap();
        assert_eq!(k, "models");
        assert!(message.contains("engine `trtllm`"), "{message}");
        // Loopback unless told, and a body limit from the token limit.
        assert_eq!(ok.listen, "127.0.0.1:9002");
        assert_eq!(ok.body_limit(), 131_072 * 16 + 65_536);
        assert_eq!(section("max_body_bytes: 5000\n").body_limit(), 5000);
    }

    #[test]
    fn model_files_must_be_regular_and_not_too_large() {
        let problem = |path: &str, limit| file_problem(path, limit).unwrap_or_default();
        assert!(problem("/dev/zero", MAX_TOKENIZER_BYTES).contains("not a regular file"));
        assert!(problem("/nonexistent/tokenizer.json", 10).contains("/nonexistent"));
        let dir = std::env::temp_dir().join(format!("kvedge-epp-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("big.jinja");
        std::fs::write(&big, vec![b' '; 2048]).unwrap();
        let big = big.to_str().unwrap();
        assert!(problem(big, 1024).contains("2048 bytes, more than the 1024"));
        assert_eq!(file_problem(big, 4096), None);
        let section = parse(&format!(
            "models:\n  - name: m\n    chat_template: {big}\n    tokenizer: /dev/zero\n"
        ));
        let (key, message) = validate(&section).unwrap();
        assert_eq!(key, "models");
        assert!(
            message.contains("/dev/zero is not a regular file"),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
