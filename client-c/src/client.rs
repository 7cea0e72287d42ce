//! The frontend side: the query client over `query.sock` (or a query
//! channel), selects, `prefill_done` and `finish`.

use std::ffi::c_char;
use std::time::Duration;

use kvedge_wire::{Client, Ids, Pairs, Select, Status, Strs, Target, Trigger};

use crate::boundary::*;
use crate::status::*;

/// A connection to the daemon's `query.sock`. Opaque.
#[derive(Debug)]
pub struct kvedge_client {
    inner: Client,
    /// The provider the last successful select chose (empty: a worker).
    /// Its capacity is kept, so selects allocate nothing after warm-up.
    provider: String,
}

/// A select. Give the prompt as sequence hashes or as token ids (exactly
/// one of the two non-empty).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvedge_select_request {
    /// Required, UTF-8.
    pub model: *const c_char,
    /// Session (conversation) id for session affinity; NULL for none.
    pub session: *const c_char,
    /// `KVEDGE_ROLE_*`.
    pub role: u32,
    /// Non-zero: answer without reserving the worker.
    pub dry_run: u32,
    pub hashes: *const u64,
    pub n_hashes: usize,
    pub tokens: *const u32,
    pub n_tokens: usize,
    /// Prompt length in tokens (0: derived from the ids).
    pub prompt_tokens: u32,
    /// Request priority, for the rules and policies (0: default).
    pub priority: i32,
    /// Tenant, for the rule language; NULL for none.
    pub tenant: *const c_char,
    /// `type-degree` tags for the rule language (at most `KVEDGE_MAX_TAGS`).
    pub tags: *const *const c_char,
    pub n_tags: usize,
    /// Request headers as parallel arrays (at most `KVEDGE_MAX_HEADERS`).
    pub header_names: *const *const c_char,
    pub header_values: *const *const c_char,
    pub n_headers: usize,
}

/// What `kvedge_select_ex` adds to a select: the session's metadata
/// (what started the turn, its parent session, whether it is the last
/// turn) and an explicit target. Zeroed, it asks for nothing: a select
/// exactly as `kvedge_select` makes it. `trigger`, `session_final` and
/// `parent_session` need the request's `session`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvedge_select_routing {
    /// `KVEDGE_TRIGGER_*` (0: a user's message).
    pub trigger: u32,
    /// Non-zero: the session's last turn; its binding ends once placed.
    pub session_final: u32,
    /// The session this one was forked from; NULL for none.
    pub parent_session: *const c_char,
    /// Non-zero: serve the request on exactly the worker below (no
    /// policy runs; an unavailable target is `KVEDGE_ERR_NO_WORKER`).
    pub has_target: u32,
    pub target_dp_rank: u32,
    pub target_worker_id: u64,
    /// The engines' taints this request tolerates, `key` or `key=value`
    /// (at most `KVEDGE_MAX_TOLERATIONS`).
    pub tolerations: *const *const c_char,
    pub n_tolerations: usize,
}

/// Most tolerations in a `kvedge_select_routing`.
pub const KVEDGE_MAX_TOLERATIONS: usize = 32;

/// Most tags in a `kvedge_select_request`.
pub const KVEDGE_MAX_TAGS: usize = 32;
/// Most headers in a `kvedge_select_request`.
pub const KVEDGE_MAX_HEADERS: usize = 32;

/// The daemon's answer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvedge_select_result {
    pub worker_id: u64,
    /// Pass to `kvedge_prefill_done` and `kvedge_finish`.
    pub request_id: u64,
    /// The policy's cost of the chosen worker (NaN when there is none).
    pub cost: f64,
    pub dp_rank: u32,
    /// Prefix-overlap blocks of the chosen worker per tier.
    pub overlap_device: u32,
    pub overlap_host: u32,
    pub overlap_disk: u32,
    /// Non-zero: the rules chose an off-cluster provider, not a worker
    /// (`kvedge_selected_provider` names it).
    pub is_provider: u32,
    /// Length of the endpoint; if it is `KVEDGE_ENDPOINT_MAX` or more, the
    /// copy below is truncated.
    pub endpoint_len: u32,
    /// NUL-terminated.
    pub endpoint: [c_char; KVEDGE_ENDPOINT_MAX],
}

fn io_error(e: std::io::Error) -> Error {
    use std::io::ErrorKind as K;
    let code = match e.kind() {
        K::NotFound | K::ConnectionRefused | K::PermissionDenied => KVEDGE_ERR_CONNECT,
        K::BrokenPipe | K::ConnectionReset | K::UnexpectedEof | K::NotConnected => {
            KVEDGE_ERR_CLOSED
        }
        K::WouldBlock | K::TimedOut => KVEDGE_ERR_TIMEOUT,
        K::InvalidData => KVEDGE_ERR_PROTOCOL,
        K::InvalidInput => KVEDGE_ERR_INVALID_ARGUMENT,
        _ => KVEDGE_ERR_IO,
    };
    Error::new(code, e.to_string())
}

/// The `KVEDGE_ERR_*` value of each daemon status: an exhaustive match, so
/// a status added to the protocol must be placed here.
fn status_code(status: Status) -> kvedge_status {
    match status {
        Status::Ok => KVEDGE_OK,
        Status::NoWorker => KVEDGE_ERR_NO_WORKER,
        Status::UnknownRequest => KVEDGE_ERR_UNKNOWN_REQUEST,
        Status::BadRequest => KVEDGE_ERR_INVALID_ARGUMENT,
        Status::RingsUnavailable => KVEDGE_ERR_UNAVAILABLE,
        Status::Rejected
        | Status::NoRule
        | Status::FrameTooLarge
        | Status::UnsupportedVersion
        | Status::UnknownOp
        | Status::TooManyRequests
        | Status::TooManyConnections
        | Status::NotPermitted
        | Status::ReloadFailed => KVEDGE_ERR_DAEMON,
    }
}

fn daemon_error(status: Status, message: &str) -> Error {
    Error::new(status_code(status), format!("daemon: {message}"))
}

/// Connects to the daemon's query socket. On success `*out` is the client;
/// close it with `kvedge_client_close`.
///
/// # Safety
/// `query_socket_path` is NUL-terminated; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_client_connect(
    query_socket_path: *const c_char,
    out: *mut *mut kvedge_client,
) -> kvedge_status {
    guard(|| {
        if out.is_null() {
            return Err(Error::null("out"));
        }
        // SAFETY: `out` is non-null and writable (caller).
        unsafe { *out = std::ptr::null_mut() };
        // SAFETY: caller contract.
        let socket = unsafe { path(query_socket_path, "query_socket_path")? };
        let mut inner = Client::connect(socket).map_err(|e| io_error(e).at(socket))?;
        // A daemon that stops answering must not hang its callers.
        inner
            .set_timeout(Some(Duration::from_millis(u64::from(
                KVEDGE_DEFAULT_TIMEOUT_MS,
            ))))
            .map_err(io_error)?;
        // SAFETY: `out` is writable (checked above).
        unsafe {
            *out = Box::into_raw(Box::new(kvedge_client {
                inner,
                provider: String::new(),
            }))
        };
        Ok(())
    })
}

/// Bounds how long each call waits for the daemon:
/// [`KVEDGE_DEFAULT_TIMEOUT_MS`] from connect on, 0 for no bound. After a
/// timeout the client must be closed and reconnected.
///
/// # Safety
/// `client` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_client_set_timeout_ms(
    client: *mut kvedge_client,
    timeout_ms: u32,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let c = unsafe { handle(client, "client")? };
        let t = (timeout_ms > 0).then(|| Duration::from_millis(u64::from(timeout_ms)));
        c.inner.set_timeout(t).map_err(io_error)
    })
}

/// Moves this client's requests onto a query channel: a request ring and a
/// reply ring in shared memory, created by the daemon. A select then costs
/// no system call while the daemon is busy (a fraction of a blocking socket
/// client's round trip: BENCHMARKS.md, "C library" and "Daemon").
/// While waiting for a reply the calling thread polls for up to 50 µs,
/// then sleeps. It holds its CPU while it polls, except when its request
/// woke the sleeping daemon or the daemon runs on the same CPU: then it
/// yields the CPU between checks, so that the daemon can answer. Requests too
/// large for the ring still use the socket. `KVEDGE_ERR_UNAVAILABLE` leaves
/// the client working over the socket. Calling it again is a no-op.
///
/// # Safety
/// `client` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_client_attach_rings(client: *mut kvedge_client) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let c = unsafe { handle(client, "client")? };
        match c.inner.attach_rings().map_err(io_error)? {
            Ok(()) => Ok(()),
            Err((code, m)) => Err(daemon_error(code, &m)),
        }
    })
}

/// Asks the daemon which worker should serve `request`; fills `result`.
/// Unless `dry_run`, the worker is reserved until `kvedge_finish` (or the
/// daemon's reservation TTL).
///
/// # Safety
/// `client` is a live handle used by this thread only; `request` points to
/// a `kvedge_select_request` whose pointers follow its field comments;
/// `result` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_select(
    client: *mut kvedge_client,
    request: *const kvedge_select_request,
    result: *mut kvedge_select_result,
) -> kvedge_status {
    // SAFETY: the caller's contract is this function's.
    unsafe { kvedge_select_ex(client, request, std::ptr::null(), result) }
}

/// `kvedge_select` with a session's metadata, an explicit target and the
/// taints the request tolerates (`routing`; NULL: none, the same as
/// `kvedge_select`). A function of
/// its own so that programs built against an older header, whose
/// `kvedge_select_request` has no room for these, keep working.
///
/// # Safety
/// As `kvedge_select`; `routing` is NULL or points to a
/// `kvedge_select_routing` whose `parent_session` is NULL or a
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_select_ex(
    client: *mut kvedge_client,
    request: *const kvedge_select_request,
    routing: *const kvedge_select_routing,
    result: *mut kvedge_select_result,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let c = unsafe { handle(client, "client")? };
        if request.is_null() {
            return Err(Error::null("request"));
        }
        if result.is_null() {
            return Err(Error::null("result"));
        }
        // SAFETY: non-null and readable (caller).
        let r = unsafe { &*request };
        // SAFETY: caller contract on the fields.
        let (model, session, hashes, tokens) = unsafe {
            (
                text(r.model, "request.model")?,
                optional_text(r.session, "request.session")?,
                slice(r.hashes, r.n_hashes, "request.hashes")?,
                slice(r.tokens, r.n_tokens, "request.tokens")?,
            )
        };
        let ids = match (hashes.is_empty(), tokens.is_empty()) {
            (false, true) => Ids::hashes(hashes),
            (true, false) => Ids::tokens(tokens),
            _ => {
                return Err(Error::invalid(
                    "give exactly one of request.hashes and request.tokens",
                ));
            }
        };
        let role = parse_role(r.role)?;
        if r.n_tags > KVEDGE_MAX_TAGS || r.n_headers > KVEDGE_MAX_HEADERS {
            return Err(Error::invalid(format!(
                "at most {KVEDGE_MAX_TAGS} tags and {KVEDGE_MAX_HEADERS} headers"
            )));
        }
        // SAFETY: caller contract on the fields.
        let (tenant, tag_ptrs, names, values) = unsafe {
            (
                optional_text(r.tenant, "request.tenant")?,
                slice(r.tags, r.n_tags, "request.tags")?,
                slice(r.header_names, r.n_headers, "request.header_names")?,
                slice(r.header_values, r.n_headers, "request.header_values")?,
            )
        };
        let mut tags = [""; KVEDGE_MAX_TAGS];
        for (slot, &p) in tags.iter_mut().zip(tag_ptrs) {
            // SAFETY: each element is a NUL-terminated string (caller).
            *slot = unsafe { text(p, "a tag")? };
        }
        let mut headers = [("", ""); KVEDGE_MAX_HEADERS];
        for (slot, (&n, &v)) in headers.iter_mut().zip(names.iter().zip(values)) {
            // SAFETY: each element is a NUL-terminated string (caller).
            *slot = unsafe { (text(n, "a header name")?, text(v, "a header value")?) };
        }
        let mut q = Select::new(model, role, ids);
        q.session = session;
        q.prompt_tokens = (r.prompt_tokens > 0).then_some(r.prompt_tokens);
        q.dry_run = r.dry_run != 0;
        q.priority = r.priority;
        q.tenant = tenant;
        q.tags = Strs::new(&tags[..r.n_tags]);
        q.headers = Pairs::new(&headers[..r.n_headers]);
        let mut tolerations = [""; KVEDGE_MAX_TOLERATIONS];
        if !routing.is_null() {
            // SAFETY: non-null and readable (caller).
            let g = unsafe { &*routing };
            if g.n_tolerations > KVEDGE_MAX_TOLERATIONS {
                return Err(Error::invalid(format!(
                    "at most {KVEDGE_MAX_TOLERATIONS} tolerations"
                )));
            }
            // SAFETY: caller contract on the field.
            let ptrs = unsafe { slice(g.tolerations, g.n_tolerations, "routing.tolerations")? };
            for (slot, &p) in tolerations.iter_mut().zip(ptrs) {
                // SAFETY: each element is a NUL-terminated string (caller).
                *slot = unsafe { text(p, "a toleration")? };
            }
            q.tolerations = Strs::new(&tolerations[..g.n_tolerations]);
            q.trigger = match g.trigger {
                KVEDGE_TRIGGER_USER => Trigger::User,
                KVEDGE_TRIGGER_TOOL => Trigger::Tool,
                KVEDGE_TRIGGER_OTHER => Trigger::Other,
                other => {
                    return Err(Error::invalid(format!(
                        "routing.trigger {other} (KVEDGE_TRIGGER_*)"
                    )));
                }
            };
            q.session_final = g.session_final != 0;
            // SAFETY: NULL or a NUL-terminated string (caller).
            q.parent_session =
                unsafe { optional_text(g.parent_session, "routing.parent_session")? };
            q.target = (g.has_target != 0).then_some(Target {
                worker_id: g.target_worker_id,
                dp_rank: g.target_dp_rank,
            });
            q.check_session_metadata().map_err(Error::invalid)?;
        }
        let v = match c.inner.select(&q).map_err(io_error)? {
            Ok(v) => v,
            Err((code, message)) => return Err(daemon_error(code, message)),
        };
        // SAFETY: non-null and writable (caller).
        let out = unsafe { &mut *result };
        out.worker_id = v.worker_id;
        out.request_id = v.request_id;
        out.cost = v.cost;
        out.dp_rank = v.dp_rank;
        out.overlap_device = v.overlap_blocks[0];
        out.overlap_host = v.overlap_blocks[1];
        out.overlap_disk = v.overlap_blocks[2];
        out.is_provider = u32::from(v.provider);
        c.provider.clear();
        if v.provider {
            c.provider.push_str(v.provider_name);
        }
        out.endpoint_len = u32::try_from(v.endpoint.len()).unwrap_or(u32::MAX);
        let n = v.endpoint.len().min(KVEDGE_ENDPOINT_MAX - 1);
        for (dst, &src) in out.endpoint.iter_mut().zip(&v.endpoint.as_bytes()[..n]) {
            *dst = src as c_char;
        }
        out.endpoint[n] = 0;
        Ok(())
    })
}

/// The name of the off-cluster provider the last successful
/// `kvedge_select` on `client` chose (when its `is_provider` was non-zero),
/// as the rules' `providers:` section names it. Copies it NUL-terminated
/// into `buf`, truncated to `len - 1` bytes, and returns its full length.
/// The name is empty (0, and `buf` an empty string) when that select chose
/// a worker, when none succeeded yet, or when `client` is NULL. A failed
/// select leaves the name as it was.
///
/// # Safety
/// `client` is NULL or a live handle used by this thread only; `buf` is
/// NULL or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_selected_provider(
    client: *const kvedge_client,
    buf: *mut c_char,
    len: usize,
) -> usize {
    guard_value(0, || {
        let name = if client.is_null() {
            ""
        } else {
            // SAFETY: non-null, and a live handle (caller).
            unsafe { (*client).provider.as_str() }
        };
        // SAFETY: `buf` is NULL or has `len` writable bytes (caller).
        unsafe { copy_out(name.as_bytes(), buf, len) }
    })
}

/// Releases `request_id` with `op` (prefill done or finished).
///
/// # Safety
/// `client` is a live handle used by this thread only.
unsafe fn release(
    client: *mut kvedge_client,
    request_id: u64,
    op: fn(&mut Client, u64) -> kvedge_wire::Outcome<()>,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let c = unsafe { handle(client, "client")? };
        match op(&mut c.inner, request_id).map_err(io_error)? {
            Ok(()) => Ok(()),
            Err((code, m)) => Err(daemon_error(code, &m)),
        }
    })
}

/// The request's prefill finished (its prompt tokens leave the worker's
/// projected load).
///
/// # Safety
/// `client` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_prefill_done(
    client: *mut kvedge_client,
    request_id: u64,
) -> kvedge_status {
    // SAFETY: the caller's contract is `release`'s.
    unsafe { release(client, request_id, Client::prefill_done) }
}

/// The request finished (it leaves the worker's projected load).
///
/// # Safety
/// `client` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_finish(
    client: *mut kvedge_client,
    request_id: u64,
) -> kvedge_status {
    // SAFETY: the caller's contract is `release`'s.
    unsafe { release(client, request_id, Client::finish) }
}

/// The request was never served: its dispatch to the chosen worker failed
/// before a response stream (refused, timed out, a server error). It
/// leaves the worker's projected load, and its session's binding goes
/// back to what it was before its select. After `kvedge_prefill_done` it
/// is the same as `kvedge_finish`.
///
/// # Safety
/// `client` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_abort(
    client: *mut kvedge_client,
    request_id: u64,
) -> kvedge_status {
    // SAFETY: the caller's contract is `release`'s.
    unsafe { release(client, request_id, Client::abort) }
}

/// Closes the connection and frees the client. NULL is a no-op.
///
/// # Safety
/// `client` is NULL or a live handle, not used again afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_client_close(client: *mut kvedge_client) {
    guard_value((), || {
        if !client.is_null() {
            // SAFETY: a handle from `Box::into_raw` in `kvedge_client_connect`,
            // given back exactly once (caller).
            drop(unsafe { Box::from_raw(client) });
        }
    })
}
