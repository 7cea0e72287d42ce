//! The endpoint-picker driver: `kvedge-epp`'s gRPC services on a tokio
//! runtime of their own thread, fed into the routing loop through the jobs
//! channel as one query client of the core (admitted like any other, and
//! admitted again if the core closes it when idle).

use std::io;
use std::sync::{Arc, Mutex};

use kvedge_core::ClientId;
use kvedge_core::config::EppSection;
use kvedge_epp::{Backend, Limits, ModelSpec, Models, Picker};
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
        let this = &self.0;
        let client = *this.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = client {
            this.tx.send(Job::Request {
                client,
                request: body,
                mode: Mode::Binary,
                reply,
            });
            return;
        }
        // Not admitted yet (or closed by the core): connect, then ask.
        let me = Arc::clone(this);
        let closing = Arc::clone(this);
        this.tx.send(Job::Connect {
            peer: Ok(this.me),
            admitted: Box::new(move |outcome| match outcome {
                Ok(client) => {
                    *me.client.lock().unwrap_or_else(|p| p.into_inner()) = Some(client);
                    me.tx.send(Job::Request {
                        client,
                        request: body,
                        mode: Mode::Binary,
                        reply,
                    });
                }
                Err(e) => reply(refusal(&e)),
            }),
            close: Box::new(move || {
                *closing.client.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }),
        });
    }
}

/// Loads the models, binds the listener and starts the picker's thread.
/// Errors (a tokenizer that does not load, an address in use) are the
/// caller's to report: the daemon does not start without its picker.
pub fn start(section: &EppSection, tx: JobSender) -> io::Result<std::net::SocketAddr> {
    let specs: Vec<ModelSpec> = section
        .models
        .iter()
        .map(|m| ModelSpec {
            name: m.name.clone(),
            tokenizer: m.tokenizer.as_ref().map(Into::into),
            chat_template: m.chat_template.as_ref().map(Into::into),
            bos_token: m.bos_token.clone(),
            eos_token: m.eos_token.clone(),
        })
        .collect();
    let models = Models::load(&specs).map_err(io::Error::other)?;
    let limits = Limits {
        max_body_bytes: section.max_body_bytes,
        max_prompt_tokens: section.max_prompt_tokens,
        tenant_header: section
            .tenant_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        session_header: section
            .session_header
            .as_ref()
            .map(|h| h.to_ascii_lowercase()),
        approximate_chunk_bytes: section.approximate_chunk_bytes,
    };
    let listener = std::net::TcpListener::bind(&section.listen)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let backend = Arc::new(Jobs {
        tx,
        client: Mutex::new(None),
        me: PeerCred {
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        },
    });
    let picker = Arc::new(Picker::new(models, limits, Arc::new(Client(backend))));
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
                if let Err(e) =
                    kvedge_epp::server::serve(listener, picker, std::future::pending()).await
                {
                    tracing::error!("the endpoint picker stopped: {e}");
                }
            });
        })?;
    Ok(addr)
}
