//! The endpoint-picker driver: `kvedge-epp`'s gRPC services on a tokio
//! runtime of their own thread, fed into the routing loop through the jobs
//! channel as one query client of the core (admitted like any other, and
//! admitted again if the core closes it when idle).

use std::io;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use kvedge_config::EppSection;
use kvedge_core::ClientId;
use kvedge_core::metrics::PickerStats;
use kvedge_epp::{Backend, Limits, ModelSpec, Models, Picker, Settings, Stats};
use kvedge_shm::control::PeerCred;
use kvedge_wire::framing::Mode;

use crate::jobs::{Job, JobSender};

/// The picker's client of the core.
struct Jobs {
    tx: JobSender,
    client: Mutex<Option<ClientId>>,
    me: PeerCred,
}

fn refusal(e: &kvedge_wire::ErrorReply<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    kvedge_wire::binary::write_error(&mut out, e.status, &e.message);
    out
}

/// [`Backend`] over the shared state.
struct Client(Arc<Jobs>);

impl Backend for Client {
    fn call(&self, body: Vec<u8>, reply: Box<dyn FnOnce(Vec<u8>) + Send>) {
        self.ask(body, Mode::Binary, reply);
    }

    fn call_json(&self, line: Vec<u8>, reply: Box<dyn FnOnce(Vec<u8>) + Send>) {
        self.ask(line, Mode::Json, reply);
    }
}

impl Client {
    fn ask(&self, body: Vec<u8>, mode: Mode, reply: Box<dyn FnOnce(Vec<u8>) + Send>) {
        let this = &self.0;
        let client = *this.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = client {
            this.tx.send(Job::Request {
                client,
                request: body,
                mode,
                reply,
            });
            return;
        }
        // Not admitted yet (or closed by the core): connect, then ask.
        let me = Arc::clone(this);
        let closing = Arc::clone(this);
        this.tx.send(Job::Connect {
            peer: Ok(this.me),
            // Its selects are a small part of an HTTP request's time: not
            // worth waking the routing loop between them.
            warms: false,
            admitted: Box::new(move |outcome| match outcome {
                Ok(client) => {
                    *me.client.lock().unwrap_or_else(|p| p.into_inner()) = Some(client);
                    me.tx.send(Job::Request {
                        client,
                        request: body,
                        mode,
                        reply,
                    });
                }
                Err(e) if mode == Mode::Json => reply(
                    serde_json::json!({"error": {"code": e.status.name(), "message": e.message}})
                        .to_string()
                        .into_bytes(),
                ),
                Err(e) => reply(refusal(&e)),
            }),
            close: Box::new(move || {
                *closing.client.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }),
        });
    }
}

/// A picker whose models are loaded, waiting for its socket and thread.
pub struct Loaded {
    models: Models,
    limits: Limits,
    settings: Settings,
    listen: String,
    http_listen: Option<String>,
}

impl Loaded {
    /// The picker's limit on the prompt texts it sends the routing core's
    /// regex classifier ([`Limits::classify_text_bytes`]), for the daemon
    /// to set from the configuration at startup and at each reload.
    pub fn classify_text_bytes(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        std::sync::Arc::clone(&self.limits.classify_text_bytes)
    }
}

/// The longest text the configuration's regex classifier reads (0: it
/// has none).
pub fn classify_text_bytes(config: &kvedge_config::Config) -> usize {
    config
        .rules
        .as_ref()
        .and_then(|r| r.regex.as_ref())
        .map_or(0, |re| re.max_text_bytes)
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// What the picker makes of a request to `path` with `body`: its model
    /// and prompt (token ids, or chunk hashes for a model without a
    /// tokenizer), or the HTTP status and message the gateway would
    /// answer instead. `kvedge explain` shows a body's decision with it.
    pub fn read_request(
        &self,
        path: &str,
        body: &[u8],
    ) -> Result<kvedge_epp::picker::Prompted, (i32, String)> {
        kvedge_epp::picker::read_request(path, body, &self.models, &self.limits)
    }
}

/// Whose server's way `model`'s chats are prepared: its `engine:`, else
/// SGLang's when every engine of the `engines:` section that serves it is
/// an SGLang engine, else vLLM's.
fn chat_engine(
    model: &kvedge_config::EppModel,
    engines: &[kvedge_config::EngineSpec],
) -> kvedge_epp::chat::Engine {
    use kvedge_epp::chat::Engine;
    match model.engine.as_deref() {
        Some("sglang") => Engine::Sglang,
        Some(_) => Engine::Vllm,
        None => {
            let mut serving = engines.iter().filter(|e| e.model == model.name).peekable();
            if serving.peek().is_some()
                && serving.all(|e| e.kind == kvedge_config::EngineKind::Sglang)
            {
                Engine::Sglang
            } else {
                Engine::Vllm
            }
        }
    }
}

/// Loads the models' tokenizers and templates (each a regular file under
/// its size limit). Called before the daemon binds any socket: a daemon
/// that cannot serve does not listen.
///
/// A model without `engine:` is prepared as SGLang prepares chats when
/// every engine of the `engines:` section that serves it is an SGLang
/// engine, else as vLLM does.
pub fn load(section: &EppSection, engines: &[kvedge_config::EngineSpec]) -> io::Result<Loaded> {
    for w in template_warnings(Some(section)) {
        tracing::warn!("{w}");
    }
    let specs: Vec<ModelSpec> = section
        .models
        .iter()
        .map(|m| ModelSpec {
            engine: chat_engine(m, engines),
            name: m.name.clone(),
            tokenizer: m.tokenizer.as_ref().map(Into::into),
            chat_template: m.chat_template.as_ref().map(Into::into),
            bos_token: m.bos_token.clone(),
            eos_token: m.eos_token.clone(),
        })
        .collect();
    let models = Models::load_with(&specs, section.prefix_cache_bytes).map_err(io::Error::other)?;
    let limits = Limits {
        max_body_bytes: section.body_limit(),
        max_prompt_tokens: section.max_prompt_tokens,
        tenant_header: section
            .tenant_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        session_header: section
            .session_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        target_header: section
            .target_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        tolerations_header: section
            .tolerations_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        debug_header: section
            .debug_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        approximate_chunk_bytes: section.approximate_chunk_bytes,
        classify_text_bytes: Default::default(),
    };
    let ms = Duration::from_millis;
    let settings = Settings {
        max_connections: section.max_connections,
        idle_timeout: ms(section.idle_timeout_ms),
        max_streams: section.max_streams,
        max_buffered_body_bytes: section.max_buffered_body_bytes,
        pick_timeout: ms(section.pick_timeout_ms),
        tokenizer_threads: section.tokenizer_threads,
        tokenizer_queue: section.tokenizer_queue,
        tokenize_timeout: ms(section.tokenize_timeout_ms),
    };
    Ok(Loaded {
        models,
        limits,
        settings,
        listen: section.listen.clone(),
        http_listen: section.http_listen.clone(),
    })
}

/// The picker's counts as the core's metrics take them.
fn snapshot(s: &Stats, prefix: kvedge_epp::tokenize::PrefixCounts) -> PickerStats {
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    PickerStats {
        connections: n(&s.connections),
        connections_refused: n(&s.connections_refused),
        connections_evicted: n(&s.connections_evicted),
        connections_idle_closed: n(&s.connections_idle_closed),
        streams: n(&s.streams),
        streams_refused: n(&s.streams_refused),
        buffered_body_bytes: n(&s.buffered_body_bytes),
        refused_body_budget: n(&s.refused_body_budget),
        refused_tokenizer_queue: n(&s.refused_tokenizer_queue),
        refused_tokenize_deadline: n(&s.refused_tokenize_deadline),
        prompts_inline: n(&s.prompts_inline),
        prompts_pooled: n(&s.prompts_pooled),
        picks_expired: n(&s.picks_expired),
        http_proxied: n(&s.http_proxied),
        http_upstream_errors: n(&s.http_upstream_errors),
        prefix_hits: prefix.hits,
        prefix_misses: prefix.misses,
        prefix_tokens_reused: prefix.tokens_reused,
        prefix_tokens_encoded: prefix.tokens_encoded,
        prefix_bytes: prefix.bytes,
        template_fallbacks: prefix.template_fallbacks,
        prompt_durations: durations(&s.prompt_durations),
        select_durations: durations(&s.select_durations),
    }
}

fn durations(d: &kvedge_epp::stage::Durations) -> kvedge_core::metrics::StageDurations {
    let read = d.read();
    kvedge_core::metrics::StageDurations {
        bounds_ns: kvedge_epp::stage::BOUNDS_NS.to_vec(),
        buckets: read.buckets,
        count: read.count,
        sum_ns: read.sum_ns,
    }
}

/// Where a started picker listens.
#[derive(Clone, Copy, Debug)]
pub struct Addrs {
    /// ext_proc (and gRPC health).
    pub grpc: std::net::SocketAddr,
    /// The HTTP front door, when configured.
    pub http: Option<std::net::SocketAddr>,
}

fn bind(addr: &str) -> io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("{addr}: {e}")))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Binds the listeners and starts the picker's thread (and its tokenizer
/// pool). Errors (an address in use) are the caller's to report: the
/// daemon does not start without its picker.
pub fn start(loaded: Loaded, tx: JobSender) -> io::Result<Addrs> {
    let Loaded {
        models,
        limits,
        settings,
        listen,
        http_listen,
    } = loaded;
    let listener = bind(&listen)?;
    let http_listener = http_listen.as_deref().map(bind).transpose()?;
    let addrs = Addrs {
        grpc: listener.local_addr()?,
        http: http_listener
            .as_ref()
            .map(std::net::TcpListener::local_addr)
            .transpose()?,
    };
    let backend = Arc::new(Jobs {
        tx: tx.clone(),
        client: Mutex::new(None),
        me: PeerCred {
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        },
    });
    let picker = Arc::new(Picker::new(
        models,
        limits,
        settings,
        Arc::new(Client(backend)),
    )?);
    std::thread::Builder::new()
        .name("kvedge-epp".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!("the endpoint picker's runtime did not start: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!("the endpoint picker's listener: {e}");
                        return;
                    }
                };
                // Its counts reach the core's metrics once a second.
                let stats = Arc::clone(picker.stats());
                let counted = Arc::clone(&picker);
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(Duration::from_secs(1));
                    let mut last = None;
                    loop {
                        tick.tick().await;
                        let now = snapshot(&stats, counted.prefix_counts());
                        if last.as_ref() != Some(&now) {
                            tx.send(Job::PickerStats(Box::new(now.clone())));
                            last = Some(now);
                        }
                    }
                });
                if let Some(l) = http_listener {
                    match tokio::net::TcpListener::from_std(l) {
                        Ok(l) => {
                            tokio::spawn(kvedge_epp::http::serve(l, Arc::clone(&picker)));
                        }
                        Err(e) => tracing::error!("the HTTP front door's listener: {e}"),
                    }
                }
                if let Err(e) =
                    kvedge_epp::server::serve(listener, picker, std::future::pending()).await
                {
                    tracing::error!("the endpoint picker stopped: {e}");
                }
            });
        })?;
    Ok(addrs)
}

/// What each configured chat template uses that kvedge cannot render as
/// the engine does: chats it renders wrong would be routed on hashes no
/// engine has.
pub fn template_warnings(epp: Option<&kvedge_config::EppSection>) -> Vec<String> {
    let mut out = Vec::new();
    for m in epp.map_or(&[][..], |e| &e.models[..]) {
        let Some(path) = &m.chat_template else {
            continue;
        };
        // The loader has checked the file; a race that removed it since
        // is the daemon's to report.
        let Ok(source) = std::fs::read_to_string(path) else {
            continue;
        };
        for what in kvedge_epp::template::unsupported(&source) {
            let why = if what.starts_with('`') {
                what
            } else {
                format!("{what}: kvedge cannot render it as the engine does")
            };
            out.push(format!(
                "epp model `{}`: chat template {path}: {why}",
                m.name
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn chats_are_prepared_as_the_engines_serving_the_model_prepare_them() {
        use kvedge_epp::chat::Engine;
        let engine = |kind: &str, model: &str| -> kvedge_config::EngineSpec {
            serde_json::from_value(serde_json::json!({"kind": kind, "model": model,
                "worker_id": 1, "block_size": 16, "endpoint": "http://127.0.0.1:1",
                "events": "tcp://127.0.0.1:2"}))
            .unwrap()
        };
        let model = |engine: Option<&str>| -> kvedge_config::EppModel {
            serde_json::from_value(serde_json::json!({"name": "m", "engine": engine})).unwrap()
        };
        let sglang = [engine("sglang", "m"), engine("vllm", "other")];
        assert_eq!(super::chat_engine(&model(None), &sglang), Engine::Sglang);
        assert_eq!(
            super::chat_engine(&model(Some("vllm")), &sglang),
            Engine::Vllm
        );
        let mixed = [engine("sglang", "m"), engine("vllm", "m")];
        assert_eq!(super::chat_engine(&model(None), &mixed), Engine::Vllm);
        assert_eq!(super::chat_engine(&model(None), &[]), Engine::Vllm);
        assert_eq!(
            super::chat_engine(&model(Some("sglang")), &[]),
            Engine::Sglang
        );
    }

    #[test]
    fn the_configuration_checks_model_files_against_the_readers_limits() {
        use kvedge_config::epp as config;
        assert_eq!(
            config::MAX_TOKENIZER_BYTES,
            kvedge_epp::tokenize::MAX_TOKENIZER_BYTES
        );
        assert_eq!(
            config::MAX_TEMPLATE_BYTES,
            kvedge_epp::tokenize::MAX_TEMPLATE_BYTES
        );
    }
}
