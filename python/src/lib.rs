//! `kvedge._kvedge`: the native half of the `kvedge` Python package. It
//! wraps the Rust binary-protocol client (`kvedge_wire::Client`: over
//! `query.sock`, or over a query channel once attached), block hashing
//! (`kvedge_schema::hash`) and the engine publisher (`kvedge_shm::Publisher`).
//! Every call that waits on the daemon or hashes a prompt releases the GIL.
//! The pure-Python half (`python/kvedge/`) adds the JSON-only requests
//! (`explain`, `workers`, `stats`) and the asyncio client, and declares the
//! exceptions (`kvedge.errors`) this module raises.
//!
//! No hand-written `unsafe`: the only unsafe code is what PyO3's macros
//! generate for the export itself.

#![deny(unsafe_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{Load, Tier};
use kvedge_shm::ring::Push;
use kvedge_shm::session::{Action, REGISTER_TIMEOUT, Session, SessionState};
use kvedge_wire::{Ids, Pairs, Role, Select, Status, Strs};
use pyo3::call::PyCallArgs;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// `kvedge.errors`, where the package's exceptions are declared (once, in
/// Python, so the native and the JSON paths raise the same classes).
fn errors(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    ERRORS
        .get_or_try_init(py, || Ok(py.import("kvedge.errors")?.unbind()))
        .map(|m| m.bind(py))
}

/// Calls `kvedge.errors.<factory>(args...)` and makes its result the error.
fn raised<'py>(py: Python<'py>, factory: &str, args: impl PyCallArgs<'py>) -> PyErr {
    match errors(py).and_then(|m| m.getattr(factory)?.call1(args)) {
        Ok(exception) => PyErr::from_value(exception),
        Err(e) => e,
    }
}

/// The exception for a daemon's error status, with `status` and `code`.
fn status_error(py: Python<'_>, status: Status, message: &str) -> PyErr {
    raised(py, "status_error", (status.name(), message))
}

/// The exception for a daemon that could not be reached or went away.
fn unavailable(py: Python<'_>, message: String) -> PyErr {
    raised(py, "unavailable", (message,))
}

/// The exception for an I/O failure talking to the daemon.
fn io_error(py: Python<'_>, e: std::io::Error) -> PyErr {
    if e.kind() == std::io::ErrorKind::InvalidInput {
        return PyValueError::new_err(e.to_string());
    }
    unavailable(py, format!("kvedge daemon: {e}"))
}

/// The protocol's code for the status named `name` (None for an unknown
/// name): the one status table, read by `kvedge.errors`.
#[pyfunction]
fn status_code(name: &str) -> Option<u16> {
    Status::from_name(name).map(Status::code)
}

fn role(name: &str) -> PyResult<Role> {
    match name {
        "aggregated" => Ok(Role::Aggregated),
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        "encode" => Ok(Role::Encode),
        _ => Err(PyValueError::new_err(format!(
            "role must be aggregated, prefill, decode or encode, not {name:?}"
        ))),
    }
}

fn tier(name: &str) -> PyResult<Tier> {
    match name {
        "device" => Ok(Tier::Device),
        "host" => Ok(Tier::Host),
        "disk" => Ok(Tier::Disk),
        _ => Err(PyValueError::new_err(format!(
            "tier must be device, host or disk, not {name:?}"
        ))),
    }
}

fn timeout(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds or None, not {s}"
        ))),
    }
}

/// The worker a select chose.
#[pyclass(module = "kvedge._kvedge", frozen, get_all)]
#[derive(Debug)]
pub struct Selection {
    /// The chosen worker and its data-parallel rank (None when a rule chose
    /// an off-cluster provider).
    worker_id: Option<u64>,
    dp_rank: Option<u32>,
    /// Where to send the request.
    endpoint: String,
    /// The name of the provider a rule chose, if it chose one.
    provider: Option<String>,
    /// Prefix overlap in blocks, per tier.
    device_blocks: u32,
    host_blocks: u32,
    disk_blocks: u32,
    /// The policy's cost of the chosen worker (None: chosen by a rule).
    cost: Option<f64>,
    /// The worker-selection policy and the deciding rule (JSON path only:
    /// `explain=True`; None over the binary protocol).
    policy: Option<String>,
    rule: Option<String>,
    /// For prefill_done and finish (0 for a dry run's answer).
    request_id: u64,
    /// How the choice was made (`explain=True`): the daemon's explanation
    /// as a dict, else None.
    explain: Option<Py<PyAny>>,
}

#[pymethods]
impl Selection {
    #[new]
    #[pyo3(signature = (*, worker_id, dp_rank, endpoint, provider=None, device_blocks=0, host_blocks=0, disk_blocks=0, cost=None, policy=None, rule=None, request_id=0, explain=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        worker_id: Option<u64>,
        dp_rank: Option<u32>,
        endpoint: String,
        provider: Option<String>,
        device_blocks: u32,
        host_blocks: u32,
        disk_blocks: u32,
        cost: Option<f64>,
        policy: Option<String>,
        rule: Option<String>,
        request_id: u64,
        explain: Option<Py<PyAny>>,
    ) -> Self {
        Selection {
            worker_id,
            dp_rank,
            endpoint,
            provider,
            device_blocks,
            host_blocks,
            disk_blocks,
            cost,
            policy,
            rule,
            request_id,
            explain,
        }
    }

    /// (device, host, disk) overlap in blocks.
    #[getter]
    fn overlap_blocks(&self) -> (u32, u32, u32) {
        (self.device_blocks, self.host_blocks, self.disk_blocks)
    }

    fn __repr__(&self) -> String {
        match self.worker_id {
            Some(w) => format!(
                "Selection(worker_id={w}, dp_rank={}, endpoint={:?}, overlap_blocks={:?}, request_id={})",
                self.dp_rank.unwrap_or(0),
                self.endpoint,
                self.overlap_blocks(),
                self.request_id
            ),
            None => format!(
                "Selection(provider={:?}, endpoint={:?}, request_id={})",
                self.provider, self.endpoint, self.request_id
            ),
        }
    }
}

/// A blocking client of the binary protocol (see the module docs).
#[pyclass(module = "kvedge._kvedge", name = "NativeClient")]
pub struct NativeClient {
    inner: Mutex<Option<kvedge_wire::Client>>,
}

impl NativeClient {
    fn lock(&self) -> MutexGuard<'_, Option<kvedge_wire::Client>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl NativeClient {
    /// Connects to `query_socket` (a daemon's `query.sock`).
    #[new]
    #[pyo3(
        signature = (query_socket, timeout=Some(10.0)),
        text_signature = "(query_socket, timeout=10.0)"
    )]
    fn new(py: Python<'_>, query_socket: PathBuf, timeout: Option<f64>) -> PyResult<Self> {
        let timeout = self::timeout(timeout)?;
        let client = py
            .detach(|| {
                let mut c = kvedge_wire::Client::connect(&query_socket)?;
                c.set_timeout(timeout)?;
                Ok::<_, std::io::Error>(c)
            })
            .map_err(|e| io_error(py, e))?;
        Ok(NativeClient {
            inner: Mutex::new(Some(client)),
        })
    }

    /// Chooses a worker. Exactly one of `tokens` (token ids; the daemon
    /// hashes them with the model's block size) and `hashes` (sequence
    /// hashes of the prompt's full blocks) is given.
    #[pyo3(signature = (model, *, tokens=None, hashes=None, prompt_tokens=None, tenant=None, tags=None, headers=None, session=None, role="aggregated", priority=0, dry_run=false, trigger="user", parent_session=None, final_turn=false, target=None, tolerations=None))]
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        py: Python<'_>,
        model: &str,
        tokens: Option<Vec<u32>>,
        hashes: Option<&Bound<'_, PyAny>>,
        prompt_tokens: Option<u32>,
        tenant: Option<&str>,
        tags: Option<Vec<String>>,
        headers: Option<Vec<(String, String)>>,
        session: Option<&str>,
        role: &str,
        priority: i32,
        dry_run: bool,
        trigger: &str,
        parent_session: Option<&str>,
        final_turn: bool,
        target: Option<(u64, u32)>,
        tolerations: Option<Vec<String>>,
    ) -> PyResult<Selection> {
        let role = self::role(role)?;
        let trigger = kvedge_wire::Trigger::parse(trigger).ok_or_else(|| {
            PyValueError::new_err(format!("unknown trigger {trigger:?} (user, tool, other)"))
        })?;
        // Held natively, or a sequence of ints converted here.
        let held = hashes.and_then(|h| h.cast::<BlockHashes>().ok().cloned());
        let converted: Option<Vec<u64>> = match (hashes, &held) {
            (Some(h), None) => Some(h.extract()?),
            _ => None,
        };
        let hashes: Option<&[u64]> = match (&held, &converted) {
            (Some(b), _) => Some(&b.get().hashes),
            (None, Some(v)) => Some(v),
            (None, None) => None,
        };
        let tags: Vec<String> = tags.unwrap_or_default();
        if tags.len() > kvedge_wire::MAX_TAGS {
            return Err(PyValueError::new_err(format!(
                "at most {} tags, got {}",
                kvedge_wire::MAX_TAGS,
                tags.len()
            )));
        }
        let headers = headers.unwrap_or_default();
        let tolerations = tolerations.unwrap_or_default();
        if tolerations.len() > kvedge_wire::MAX_TOLERATIONS {
            return Err(PyValueError::new_err(format!(
                "at most {} tolerations, got {}",
                kvedge_wire::MAX_TOLERATIONS,
                tolerations.len()
            )));
        }
        let mut guard = self.lock();
        let client = guard
            .as_mut()
            .ok_or_else(|| unavailable(py, "the client is closed".into()))?;
        let outcome = py.detach(|| {
            let ids = match (&tokens, &hashes) {
                (Some(t), None) => Ids::tokens(t),
                (None, Some(h)) => Ids::hashes(h),
                _ => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "give exactly one of tokens and hashes",
                    ));
                }
            };
            let tag_refs: Vec<&str> = tags.iter().map(String::as_str).collect();
            let header_refs: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let mut q = Select::new(model, role, ids);
            q.prompt_tokens = prompt_tokens;
            q.tenant = tenant;
            q.session = session;
            q.priority = priority;
            q.dry_run = dry_run;
            q.tags = Strs::new(&tag_refs);
            q.headers = Pairs::new(&header_refs);
            q.trigger = trigger;
            q.parent_session = parent_session;
            q.session_final = final_turn;
            q.target =
                target.map(|(worker_id, dp_rank)| kvedge_wire::Target { worker_id, dp_rank });
            let toleration_refs: Vec<&str> = tolerations.iter().map(String::as_str).collect();
            q.tolerations = Strs::new(&toleration_refs);
            q.check_session_metadata()
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            Ok(match client.select(&q)? {
                Ok(v) => Ok(Selection {
                    worker_id: (!v.provider).then_some(v.worker_id),
                    dp_rank: (!v.provider).then_some(v.dp_rank),
                    endpoint: v.endpoint.to_owned(),
                    provider: (v.provider && !v.provider_name.is_empty())
                        .then(|| v.provider_name.to_owned()),
                    device_blocks: v.overlap_blocks[0],
                    host_blocks: v.overlap_blocks[1],
                    disk_blocks: v.overlap_blocks[2],
                    cost: (!v.cost.is_nan()).then_some(v.cost),
                    policy: None,
                    rule: None,
                    request_id: v.request_id,
                    explain: None,
                }),
                Err((status, message)) => Err((status, message.to_owned())),
            })
        });
        match outcome {
            Ok(Ok(s)) => Ok(s),
            Ok(Err((status, message))) => Err(status_error(py, status, &message)),
            Err(e) => Err(io_error(py, e)),
        }
    }

    /// The request's prefill is done (its first token came out).
    fn prefill_done(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.release(py, request_id, Release::PrefillDone)
    }

    /// The request finished: it leaves the worker's load.
    fn finish(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.release(py, request_id, Release::Finish)
    }

    /// The request was never served (its dispatch failed before a
    /// response stream): it leaves the worker's load and its session's
    /// binding goes back to what it was before its select.
    fn abort(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.release(py, request_id, Release::Abort)
    }

    /// Moves this connection onto a query channel (shared-memory rings).
    /// Returns False, leaving the client on the socket, when the daemon
    /// offers none.
    fn attach_rings(&self, py: Python<'_>) -> PyResult<bool> {
        let mut guard = self.lock();
        let client = guard
            .as_mut()
            .ok_or_else(|| unavailable(py, "the client is closed".into()))?;
        match py.detach(|| client.attach_rings()) {
            Ok(Ok(())) => Ok(true),
            Ok(Err((Status::RingsUnavailable, _))) => Ok(false),
            Ok(Err((status, message))) => Err(status_error(py, status, &message)),
            Err(e) => Err(io_error(py, e)),
        }
    }

    /// Whether requests go through a query channel.
    #[getter]
    fn rings_attached(&self) -> bool {
        self.lock().as_ref().is_some_and(|c| c.rings_attached())
    }

    /// Closes the connection (and its query channel); later calls raise.
    fn close(&self) {
        self.lock().take();
    }
}

impl NativeClient {
    fn release(&self, py: Python<'_>, request_id: u64, how: Release) -> PyResult<()> {
        let mut guard = self.lock();
        let client = guard
            .as_mut()
            .ok_or_else(|| unavailable(py, "the client is closed".into()))?;
        let outcome = py.detach(|| match how {
            Release::PrefillDone => client.prefill_done(request_id),
            Release::Finish => client.finish(request_id),
            Release::Abort => client.abort(request_id),
        });
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err((status, message))) => Err(status_error(py, status, &message)),
            Err(e) => Err(io_error(py, e)),
        }
    }
}

/// What a release tells the daemon.
#[derive(Clone, Copy)]
enum Release {
    PrefillDone,
    Finish,
    Abort,
}

/// A prompt's block hashes held natively: `select(hashes=...)` reads them
/// without converting a Python list element by element, the way a C
/// caller passes its array.
#[pyclass(module = "kvedge._kvedge", frozen, sequence)]
pub struct BlockHashes {
    hashes: Vec<u64>,
}

#[pymethods]
impl BlockHashes {
    #[new]
    fn new(hashes: Vec<u64>) -> Self {
        BlockHashes { hashes }
    }

    fn __len__(&self) -> usize {
        self.hashes.len()
    }

    fn __getitem__(&self, index: isize) -> PyResult<u64> {
        let n = self.hashes.len() as isize;
        let i = if index < 0 { index + n } else { index };
        if (0..n).contains(&i) {
            Ok(self.hashes[i as usize])
        } else {
            Err(pyo3::exceptions::PyIndexError::new_err(
                "block index out of range",
            ))
        }
    }

    fn to_list(&self) -> Vec<u64> {
        self.hashes.clone()
    }

    fn __repr__(&self) -> String {
        format!("BlockHashes({} blocks)", self.hashes.len())
    }
}

/// As [`hash_blocks`], into a [`BlockHashes`].
#[pyfunction]
#[pyo3(signature = (tokens, block_size, lora=None, namespace=None))]
fn block_hashes(
    py: Python<'_>,
    tokens: Vec<u32>,
    block_size: usize,
    lora: Option<&str>,
    namespace: Option<&str>,
) -> PyResult<BlockHashes> {
    Ok(BlockHashes {
        hashes: hash_blocks(py, tokens, block_size, lora, namespace)?,
    })
}

/// The sequence hashes of `tokens`' full blocks, as engines and the daemon
/// compute them (a LoRA adapter and a namespace change the seed).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, lora=None, namespace=None))]
fn hash_blocks(
    py: Python<'_>,
    tokens: Vec<u32>,
    block_size: usize,
    lora: Option<&str>,
    namespace: Option<&str>,
) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive"));
    }
    Ok(py.detach(|| kvedge_schema::hash::sequence_hashes(&tokens, block_size, lora, namespace)))
}

/// An engine's publisher: registers with the daemon over `control.sock`
/// and publishes its KV events and load through its ring.
#[pyclass(module = "kvedge._kvedge", name = "Publisher")]
pub struct Publisher {
    inner: Mutex<Engine>,
    block_size: u32,
}

/// A registration and the session that keeps it (`kvedge_shm::session`,
/// the state machine every kvedge engine driver runs).
struct Engine {
    publisher: kvedge_shm::Publisher,
    session: Session,
    control: PathBuf,
    hello: Hello,
    started: Instant,
}

impl std::ops::Deref for Engine {
    type Target = kvedge_shm::Publisher;
    fn deref(&self) -> &kvedge_shm::Publisher {
        &self.publisher
    }
}

impl std::ops::DerefMut for Engine {
    fn deref_mut(&mut self) -> &mut kvedge_shm::Publisher {
        &mut self.publisher
    }
}

fn pushed(py: Python<'_>, r: Result<Push, kvedge_shm::PublishError>) -> PyResult<bool> {
    match r {
        Ok(Push::Committed { .. }) => Ok(true),
        Ok(Push::Dropped { .. }) => Ok(false),
        Err(e) => Err(raised(py, "KvedgeError", (format!("publish: {e}"),))),
    }
}

#[pymethods]
impl Publisher {
    /// Registers worker (`worker_id`, `dp_rank`) serving `model` with the
    /// daemon at `control_socket`.
    #[new]
    #[pyo3(
        signature = (control_socket, worker_id, model, *, dp_rank=0, role="aggregated", block_size=16, kv_blocks=(0, 0, 0), endpoint="", timeout=5.0, labels=None, taints=None),
        text_signature = "(control_socket, worker_id, model, *, dp_rank=0, role='aggregated', block_size=16, kv_blocks=(0, 0, 0), endpoint='', timeout=5.0, labels=None, taints=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control_socket: PathBuf,
        worker_id: u64,
        model: String,
        dp_rank: u32,
        role: &str,
        block_size: u32,
        kv_blocks: (u64, u64, u64),
        endpoint: &str,
        timeout: f64,
        labels: Option<std::collections::BTreeMap<String, String>>,
        taints: Option<Vec<String>>,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let labels = labels.unwrap_or_default();
        if let Some(k) = labels.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Err(PyValueError::new_err(format!(
                "label key {k:?} is empty or has '=' in it"
            )));
        }
        let timeout = self::timeout(Some(timeout))?.expect("given");
        let hello = Hello {
            worker_id,
            dp_rank,
            model,
            role: self::role(role)?,
            block_size,
            kv_blocks: [kv_blocks.0, kv_blocks.1, kv_blocks.2],
            labels: labels
                .into_iter()
                .map(|(key, value)| kvedge_schema::messages::control::Label { key, value })
                .collect(),
            taints: taints.unwrap_or_default(),
            endpoint: endpoint.to_owned(),
            ring_capacity: 0,
        };
        let p = py
            .detach(|| kvedge_shm::Publisher::connect(&control_socket, &hello, timeout))
            .map_err(|e| unavailable(py, format!("registration: {e}")))?;
        let interval = p
            .session()
            .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
        let now = Instant::now();
        Ok(Publisher {
            inner: Mutex::new(Engine {
                publisher: p,
                session: Session::registered(now, interval),
                control: control_socket,
                hello,
                started: now,
            }),
            block_size,
        })
    }

    /// Blocks now in `tier`: given as sequence hashes, or as the token ids
    /// of a prompt (hashed with the registered block size). Returns False
    /// when the ring was full and the event was dropped (the daemon then
    /// asks for a resync).
    #[pyo3(signature = (*, hashes=None, tokens=None, tier="device", parent=None, lora=None, namespace=None))]
    #[allow(clippy::too_many_arguments)]
    fn stored(
        &self,
        py: Python<'_>,
        hashes: Option<Vec<u64>>,
        tokens: Option<Vec<u32>>,
        tier: &str,
        parent: Option<u64>,
        lora: Option<&str>,
        namespace: Option<&str>,
    ) -> PyResult<bool> {
        let tier = self::tier(tier)?;
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let p: &mut kvedge_shm::Publisher = &mut guard;
        let block_size = self.block_size as usize;
        let r = match (hashes, tokens) {
            (Some(h), None) => py.detach(|| p.publish_stored_hashes(tier, parent, &h)),
            (None, Some(t)) => {
                let seed = kvedge_schema::hash::block_seed(lora, namespace);
                py.detach(|| p.publish_stored_tokens(tier, parent, &t, block_size, seed))
            }
            _ => {
                return Err(PyValueError::new_err(
                    "give exactly one of hashes and tokens",
                ));
            }
        };
        pushed(py, r)
    }

    /// Blocks (by sequence hash) left `tier`.
    #[pyo3(signature = (hashes, *, tier="device"))]
    fn removed(&self, py: Python<'_>, hashes: Vec<u64>, tier: &str) -> PyResult<bool> {
        let tier = self::tier(tier)?;
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let p: &mut kvedge_shm::Publisher = &mut guard;
        let r = py.detach(|| p.publish_removed(tier, &hashes));
        pushed(py, r)
    }

    /// Every block of `tier` (of every tier with None) is gone.
    #[pyo3(signature = (tier=None))]
    fn cleared(&self, py: Python<'_>, tier: Option<&str>) -> PyResult<bool> {
        let tier = tier.map(self::tier).transpose()?;
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = p.publish_cleared(tier);
        pushed(py, r)
    }

    /// The engine's load now.
    #[pyo3(signature = (*, active_requests=0, waiting_requests=0, active_prefill_tokens=0, active_decode_blocks=0, kv_used_blocks=0, kv_total_blocks=0, timestamp_ns=0))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        active_requests: u32,
        waiting_requests: u32,
        active_prefill_tokens: u64,
        active_decode_blocks: u64,
        kv_used_blocks: u64,
        kv_total_blocks: u64,
        timestamp_ns: u64,
    ) -> PyResult<bool> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = p.publish_load(&Load {
            active_requests,
            waiting_requests,
            active_prefill_tokens,
            active_decode_blocks,
            kv_used_blocks,
            kv_total_blocks,
            timestamp_ns,
        });
        pushed(py, r)
    }

    /// A liveness beat (engines send one at least every heartbeat interval).
    #[pyo3(signature = (timestamp_ns=0))]
    fn heartbeat(&self, py: Python<'_>, timestamp_ns: u64) -> PyResult<bool> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = p.heartbeat(timestamp_ns);
        pushed(py, r)
    }

    /// Checks the control connection for a resync request (non-blocking):
    /// its snapshot id, or None. On one, call `begin_snapshot(id)`, publish
    /// every block held with `stored`, then `end_snapshot()`.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match p.poll() {
            Ok(r) => Ok(r.map(|r| r.snapshot_id)),
            Err(e) => Err(unavailable(py, format!("control connection: {e}"))),
        }
    }

    fn begin_snapshot(&self, py: Python<'_>, snapshot_id: u64) -> PyResult<bool> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = p.begin_snapshot(snapshot_id);
        pushed(py, r)
    }

    fn end_snapshot(&self, py: Python<'_>) -> PyResult<bool> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let r = p.end_snapshot();
        pushed(py, r)
    }

    /// Runs the engine's session with the daemon; call it every 100 ms or
    /// so. It sends heartbeats when due and, when the daemon went away (a
    /// restart), registers again (after 100 ms, backing off to 5 s). It
    /// returns what the engine must do now, or None: ("resync", id): call
    /// `begin_snapshot(id)`, `stored(...)` for every block held, then
    /// `end_snapshot()`; ("republish", None): registered again, call
    /// `stored(...)` for every block held (the new registration knows
    /// none). `registered` says whether the daemon is there.
    fn tick(&self, py: Python<'_>) -> Option<(&'static str, Option<u64>)> {
        let mut e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if e.session.state() == SessionState::Registered {
            match e.publisher.poll() {
                Ok(Some(req)) => e.session.handle_resync_requested(req.snapshot_id),
                Ok(None) => {}
                Err(_) => e.session.handle_closed(now),
            }
        }
        while let Some(action) = e.session.poll_action(now) {
            match action {
                Action::Register => {
                    let (control, hello) = (e.control.clone(), e.hello.clone());
                    let connected = py.detach(|| {
                        kvedge_shm::Publisher::connect(&control, &hello, REGISTER_TIMEOUT)
                    });
                    match connected {
                        Ok(p) => {
                            let interval = p
                                .session()
                                .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
                            e.publisher = p;
                            e.session.handle_registered(now, interval);
                        }
                        Err(_) => e.session.handle_register_failed(now),
                    }
                }
                Action::Heartbeat => {
                    let ts = e.started.elapsed().as_nanos() as u64;
                    let _ = e.publisher.heartbeat(ts);
                }
                Action::Resync { snapshot_id } => return Some(("resync", Some(snapshot_id))),
                Action::Republish => return Some(("republish", None)),
            }
        }
        None
    }

    /// Whether the engine is registered with a daemon now.
    #[getter]
    fn registered(&self) -> bool {
        let e = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        e.session.state() == SessionState::Registered
    }

    /// Records dropped because the ring was full.
    #[getter]
    fn dropped(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .dropped()
    }
}

#[pymodule]
fn _kvedge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeClient>()?;
    m.add_class::<Selection>()?;
    m.add_class::<Publisher>()?;
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_class::<BlockHashes>()?;
    m.add_function(wrap_pyfunction!(status_code, m)?)?;
    Ok(())
}
