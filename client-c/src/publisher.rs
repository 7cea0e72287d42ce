//! The engine side: registering over `control.sock`, publishing KV events
//! and load into the shared-memory ring, and the engine session that keeps
//! the registration (heartbeats, resyncs, registering again).

use std::ffi::{c_char, c_void};
use std::path::PathBuf;
use std::time::Instant;

use kvedge_schema::messages::Load;
use kvedge_schema::messages::control::{Hello, Label};
use kvedge_shm::control::ProducerSession;
use kvedge_shm::session::{Action, REGISTER_TIMEOUT, Session, SessionState};
use kvedge_shm::{ControlError, PublishError, Publisher};

use crate::boundary::*;
use crate::status::*;

/// What an engine (one data-parallel rank) says when it registers.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvedge_hello {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// `KVEDGE_ROLE_*`.
    pub role: u32,
    /// The served model (required, UTF-8).
    pub model: *const c_char,
    /// Where frontends send requests for this worker (URL or socket path;
    /// NULL for none).
    pub endpoint: *const c_char,
    /// Tokens per KV block (required, > 0).
    pub block_size: u32,
    pub reserved: u32,
    /// Total KV blocks per tier.
    pub kv_blocks_device: u64,
    pub kv_blocks_host: u64,
    pub kv_blocks_disk: u64,
    /// Ring size in bytes to ask for (0: the daemon's default).
    pub ring_capacity: u64,
}

/// An engine's load, reported after its scheduler steps.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvedge_load {
    pub active_requests: u32,
    pub waiting_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// CLOCK_MONOTONIC nanoseconds when measured (0 if unknown).
    pub timestamp_ns: u64,
}

/// An engine's registration and ring. Opaque.
pub struct kvedge_publisher {
    /// The registration's publisher (after the daemon went away, the old
    /// one until a registration again replaces it).
    inner: Publisher,
    /// The session with the daemon: heartbeats, resyncs, registering
    /// again.
    session: Session,
    control: PathBuf,
    hello: Hello,
    /// Registered again, and the blocks not yet republished (no callback
    /// was given).
    republish_pending: bool,
    started: Instant,
}

impl std::fmt::Debug for kvedge_publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvedge_publisher")
            .field("dropped", &self.inner.dropped())
            .field("session", &self.session.state())
            .finish_non_exhaustive()
    }
}

/// Resync callback: republish every block the engine holds (with
/// `kvedge_publish_stored` on the publisher it is given), return 0 on
/// success. It must not close the publisher.
pub type kvedge_resync_fn = Option<
    unsafe extern "C" fn(publisher: *mut kvedge_publisher, user: *mut c_void) -> kvedge_status,
>;

fn publish_error(e: PublishError) -> Error {
    match e {
        PublishError::Ring(r) => Error::invalid(r.to_string()),
        PublishError::ZeroBlockSize => Error::invalid("block_size must be positive"),
        other => Error::new(KVEDGE_ERR_PROTOCOL, other.to_string()),
    }
}

fn control_error(e: ControlError) -> Error {
    match e {
        ControlError::Rejected { .. } => Error::new(KVEDGE_ERR_REJECTED, e.to_string()),
        ControlError::Closed => Error::new(KVEDGE_ERR_CLOSED, e.to_string()),
        ControlError::Io(ref io) => match io.kind() {
            std::io::ErrorKind::NotFound
            | std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::PermissionDenied => Error::new(KVEDGE_ERR_CONNECT, e.to_string()),
            std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::UnexpectedEof => Error::new(KVEDGE_ERR_CLOSED, e.to_string()),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Error::new(KVEDGE_ERR_TIMEOUT, e.to_string())
            }
            _ => Error::new(KVEDGE_ERR_IO, e.to_string()),
        },
        other => Error::new(KVEDGE_ERR_PROTOCOL, other.to_string()),
    }
}

/// Registers with the daemon at `control_socket_path` and receives the
/// ring. Blocks at most 5 s. On success `*out` is the publisher; close it
/// with `kvedge_publisher_close` (which is also how the daemon learns the
/// engine left).
///
/// # Safety
/// `control_socket_path` is NUL-terminated; `hello` points to a
/// `kvedge_hello` whose strings are NULL or NUL-terminated; `out` is
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publisher_open(
    control_socket_path: *const c_char,
    hello: *const kvedge_hello,
    out: *mut *mut kvedge_publisher,
) -> kvedge_status {
    // SAFETY: the caller's contract is this function's; no labels.
    unsafe {
        kvedge_publisher_open_labeled(
            control_socket_path,
            hello,
            std::ptr::null(),
            std::ptr::null(),
            0,
            std::ptr::null(),
            0,
            out,
        )
    }
}

/// Most labels `kvedge_publisher_open_labeled` takes.
pub const KVEDGE_MAX_LABELS: usize = 64;
/// Most taints `kvedge_publisher_open_labeled` takes.
pub const KVEDGE_MAX_TAINTS: usize = 16;

/// `kvedge_publisher_open` with labels and taints: `n_labels` (at most
/// `KVEDGE_MAX_LABELS`) keys and values as parallel arrays, which the
/// rule language matches (`backends: { labels }`, `backend.labels.<key>`;
/// the `backend` label is the engine's backend name; a key is not empty
/// and has no `=`), and `n_taints` (at most `KVEDGE_MAX_TAINTS`) taints,
/// `key[=value]:NoSchedule` (requests that do not tolerate it never come)
/// or `key[=value]:PreferNoSchedule` (their cost here is multiplied). A function of its own so that programs built against
/// an older header, whose `kvedge_hello` has no room for labels, keep
/// working.
///
/// # Safety
/// As `kvedge_publisher_open`; `label_keys` and `label_values` are NULL
/// (with `n_labels` 0) or point to `n_labels` NUL-terminated strings each;
/// `taints` is NULL (with `n_taints` 0) or points to `n_taints` of them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publisher_open_labeled(
    control_socket_path: *const c_char,
    hello: *const kvedge_hello,
    label_keys: *const *const c_char,
    label_values: *const *const c_char,
    n_labels: usize,
    taints: *const *const c_char,
    n_taints: usize,
    out: *mut *mut kvedge_publisher,
) -> kvedge_status {
    guard(|| {
        if out.is_null() {
            return Err(Error::null("out"));
        }
        // SAFETY: `out` is non-null and writable (caller).
        unsafe { *out = std::ptr::null_mut() };
        if hello.is_null() {
            return Err(Error::null("hello"));
        }
        // SAFETY: non-null; the caller guarantees a readable kvedge_hello.
        let h = unsafe { &*hello };
        // SAFETY: caller contract on the strings.
        let (socket, model, endpoint) = unsafe {
            (
                path(control_socket_path, "control_socket_path")?,
                text(h.model, "hello.model")?,
                optional_text(h.endpoint, "hello.endpoint")?,
            )
        };
        if model.is_empty() {
            return Err(Error::invalid("hello.model is empty"));
        }
        if h.block_size == 0 {
            return Err(Error::invalid("hello.block_size must be positive"));
        }
        if n_labels > KVEDGE_MAX_LABELS {
            return Err(Error::invalid(format!(
                "{n_labels} labels, more than KVEDGE_MAX_LABELS ({KVEDGE_MAX_LABELS})"
            )));
        }
        // SAFETY: caller contract on the arrays.
        let (keys, values) = unsafe {
            (
                slice(label_keys, n_labels, "label_keys")?,
                slice(label_values, n_labels, "label_values")?,
            )
        };
        let mut labels = Vec::with_capacity(n_labels);
        for (&k, &v) in keys.iter().zip(values) {
            // SAFETY: each element is a NUL-terminated string (caller).
            let (key, value) = unsafe { (text(k, "a label key")?, text(v, "a label value")?) };
            if key.is_empty() || key.contains('=') {
                return Err(Error::invalid(format!(
                    "label key `{key}` is empty or has `=` in it"
                )));
            }
            labels.push(Label {
                key: key.to_owned(),
                value: value.to_owned(),
            });
        }
        if n_taints > KVEDGE_MAX_TAINTS {
            return Err(Error::invalid(format!(
                "{n_taints} taints, more than KVEDGE_MAX_TAINTS ({KVEDGE_MAX_TAINTS})"
            )));
        }
        // SAFETY: caller contract on the array.
        let taint_ptrs = unsafe { slice(taints, n_taints, "taints")? };
        let mut taint_list = Vec::with_capacity(n_taints);
        for &t in taint_ptrs {
            // SAFETY: each element is a NUL-terminated string (caller).
            taint_list.push(unsafe { text(t, "a taint")? }.to_owned());
        }
        let hello = Hello {
            worker_id: h.worker_id,
            dp_rank: h.dp_rank,
            model: model.to_owned(),
            role: parse_role(h.role)?,
            block_size: h.block_size,
            kv_blocks: [h.kv_blocks_device, h.kv_blocks_host, h.kv_blocks_disk],
            labels,
            taints: taint_list,
            endpoint: endpoint.unwrap_or("").to_owned(),
            ring_capacity: h.ring_capacity,
        };
        let (session, producer) = ProducerSession::connect(socket, &hello, REGISTER_TIMEOUT)
            .map_err(|e| control_error(e).at(socket))?;
        let interval = session.welcome().heartbeat_interval_ms;
        let now = Instant::now();
        let p = Box::new(kvedge_publisher {
            inner: Publisher::new(Some(session), producer),
            session: Session::registered(now, interval),
            control: socket.to_owned(),
            hello,
            republish_pending: false,
            started: now,
        });
        // SAFETY: `out` is writable (checked above).
        unsafe { *out = Box::into_raw(p) };
        Ok(())
    })
}

/// Blocks whose sequence hashes are `hashes[0..n]` became resident in
/// `tier`, continuing the chain after `*parent_hash` (NULL: they start a
/// sequence). Never blocks and never allocates after warm-up; a full ring
/// drops the record and counts it (`kvedge_publisher_dropped`), which is
/// not an error: the daemon notices the gap and asks for a resync.
///
/// # Safety
/// `publisher` is a live handle used by this thread only; `parent_hash` is
/// NULL or readable; `hashes` points to `n` `uint64_t` (NULL if `n` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publish_stored(
    publisher: *mut kvedge_publisher,
    tier: u32,
    parent_hash: *const u64,
    hashes: *const u64,
    n: usize,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        // SAFETY: caller contract.
        let hashes = unsafe { slice(hashes, n, "hashes")? };
        let t = parse_tier(tier)?;
        // SAFETY: NULL or readable (caller).
        let parent = unsafe { parent_hash.as_ref().copied() };
        p.inner
            .publish_stored_hashes(t, parent, hashes)
            .map(drop)
            .map_err(publish_error)
    })
}

/// Like `kvedge_publish_stored`, from token ids: the full blocks of
/// `tokens[0..n]` (of `block_size` tokens) are hashed here, continuing after
/// `*parent_hash`, with the default seed (no LoRA, no namespace).
///
/// # Safety
/// As `kvedge_publish_stored`, with `tokens` pointing to `n` `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publish_stored_tokens(
    publisher: *mut kvedge_publisher,
    tier: u32,
    parent_hash: *const u64,
    tokens: *const u32,
    n: usize,
    block_size: u32,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        // SAFETY: caller contract.
        let tokens = unsafe { slice(tokens, n, "tokens")? };
        let t = parse_tier(tier)?;
        if block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        // SAFETY: NULL or readable (caller).
        let parent = unsafe { parent_hash.as_ref().copied() };
        p.inner
            .publish_stored_tokens(
                t,
                parent,
                tokens,
                block_size as usize,
                kvedge_schema::hash::SEED,
            )
            .map(drop)
            .map_err(publish_error)
    })
}

/// Blocks left `tier`.
///
/// # Safety
/// As `kvedge_publish_stored`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publish_removed(
    publisher: *mut kvedge_publisher,
    tier: u32,
    hashes: *const u64,
    n: usize,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        // SAFETY: caller contract.
        let hashes = unsafe { slice(hashes, n, "hashes")? };
        let t = parse_tier(tier)?;
        p.inner
            .publish_removed(t, hashes)
            .map(drop)
            .map_err(publish_error)
    })
}

/// Every block of `tier` left (`KVEDGE_TIER_ALL`: of every tier).
///
/// # Safety
/// `publisher` is a live handle used by this thread only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publish_cleared(
    publisher: *mut kvedge_publisher,
    tier: i32,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        let t = if tier == KVEDGE_TIER_ALL {
            None
        } else {
            Some(parse_tier(u32::try_from(tier).map_err(|_| {
                Error::invalid(format!("tier {tier} (KVEDGE_TIER_* or KVEDGE_TIER_ALL)"))
            })?)?)
        };
        p.inner.publish_cleared(t).map(drop).map_err(publish_error)
    })
}

/// The engine's load (the daemon's truth until the next report).
///
/// # Safety
/// `publisher` is a live handle used by this thread only; `load` readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publish_load(
    publisher: *mut kvedge_publisher,
    load: *const kvedge_load,
) -> kvedge_status {
    guard(|| {
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        if load.is_null() {
            return Err(Error::null("load"));
        }
        // SAFETY: non-null and readable (caller).
        let l = unsafe { &*load };
        let timestamp_ns = if l.timestamp_ns != 0 {
            l.timestamp_ns
        } else {
            p.started.elapsed().as_nanos() as u64
        };
        p.inner
            .publish_load(&Load {
                active_requests: l.active_requests,
                waiting_requests: l.waiting_requests,
                active_prefill_tokens: l.active_prefill_tokens,
                active_decode_blocks: l.active_decode_blocks,
                kv_used_blocks: l.kv_used_blocks,
                kv_total_blocks: l.kv_total_blocks,
                timestamp_ns,
            })
            .map(drop)
            .map_err(publish_error)
    })
}

/// Call every 100 ms or so from the publishing thread: it runs the
/// engine's session with the daemon. It sends the heartbeat when due and
/// serves the daemon's resync requests: with `resync`, a pending request
/// is served at once (the snapshot is opened, `resync` is called to
/// republish every block, the snapshot is closed: flag
/// `KVEDGE_POLL_RESYNC_SERVED`); if `resync` returns an error the snapshot
/// stays open and incomplete, and that error is returned. Without it,
/// `KVEDGE_POLL_RESYNC_PENDING` is set and the request is kept for a later
/// poll. When the daemon has gone away (it restarted) the call returns
/// `KVEDGE_ERR_CLOSED`, and later calls register again (after 100 ms,
/// backing off to 5 s; an attempt blocks up to 5 s); once registered,
/// `resync` is called to republish every block (without a snapshot: the
/// new registration knows nothing) and `KVEDGE_POLL_REGISTERED_AGAIN` is
/// set. `flags` (may be NULL) receives those bits.
///
/// # Safety
/// `publisher` is a live handle used by this thread only; `flags` is NULL
/// or writable; `resync` does not close the publisher.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publisher_poll(
    publisher: *mut kvedge_publisher,
    resync: kvedge_resync_fn,
    user: *mut c_void,
    flags: *mut u32,
) -> kvedge_status {
    guard(|| {
        let mut bits = 0u32;
        let now = Instant::now();
        // What the callback is to be called for, once no Rust reference
        // to the handle is held: a snapshot (its id), or a republish.
        let mut callback: Option<Option<u64>> = None;
        {
            // SAFETY: caller contract; this borrow ends before the callback.
            let p = unsafe { handle(publisher, "publisher")? };
            if p.session.state() == SessionState::Registered {
                match p.inner.poll() {
                    Ok(Some(req)) => p.session.handle_resync_requested(req.snapshot_id),
                    Ok(None) => {}
                    Err(ControlError::Closed) => p.session.handle_closed(now),
                    Err(e) => return Err(control_error(e)),
                }
            }
            while let Some(action) = p.session.poll_action(now) {
                match action {
                    Action::Register => {
                        match Publisher::connect(&p.control, &p.hello, REGISTER_TIMEOUT) {
                            Ok(new) => {
                                let interval = new
                                    .session()
                                    .map_or(1000, |s| s.welcome().heartbeat_interval_ms);
                                p.inner = new;
                                p.session.handle_registered(now, interval);
                                bits |= KVEDGE_POLL_REGISTERED_AGAIN;
                            }
                            Err(_) => p.session.handle_register_failed(now),
                        }
                    }
                    Action::Republish => p.republish_pending = true,
                    Action::Resync { snapshot_id } if resync.is_some() && callback.is_none() => {
                        p.inner.begin_snapshot(snapshot_id).map_err(publish_error)?;
                        callback = Some(Some(snapshot_id));
                    }
                    Action::Resync { snapshot_id } => {
                        // Kept for a poll with a callback.
                        p.session.handle_resync_requested(snapshot_id);
                        bits |= KVEDGE_POLL_RESYNC_PENDING;
                        break;
                    }
                    Action::Heartbeat => {
                        let ts = p.started.elapsed().as_nanos() as u64;
                        p.inner.heartbeat(ts).map_err(publish_error)?;
                    }
                }
            }
            if p.republish_pending && resync.is_some() && callback.is_none() {
                p.republish_pending = false;
                callback = Some(None);
            }
        }
        if let (Some(snapshot), Some(cb)) = (callback, resync) {
            // SAFETY: the C callback gets the same live handle; no Rust
            // reference to it is held across the call.
            let rc = unsafe { cb(publisher, user) };
            if rc != KVEDGE_OK {
                return Err(Error::new(rc, format!("the resync callback returned {rc}")));
            }
            if snapshot.is_some() {
                // SAFETY: caller contract (the callback did not close it).
                let p = unsafe { handle(publisher, "publisher")? };
                p.inner.end_snapshot().map_err(publish_error)?;
                bits |= KVEDGE_POLL_RESYNC_SERVED;
            }
        }
        if !flags.is_null() {
            // SAFETY: non-null and writable (caller).
            unsafe { *flags = bits };
        }
        // SAFETY: caller contract.
        let p = unsafe { handle(publisher, "publisher")? };
        if p.session.state() != SessionState::Registered {
            return Err(Error::new(
                KVEDGE_ERR_CLOSED,
                "the daemon is gone; later polls register again",
            ));
        }
        Ok(())
    })
}

/// Records dropped because the ring was full, since the publisher opened.
///
/// # Safety
/// `publisher` is NULL (returns 0) or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publisher_dropped(publisher: *const kvedge_publisher) -> u64 {
    guard_value(0, || {
        // SAFETY: NULL or a live handle (caller).
        unsafe { publisher.as_ref() }.map_or(0, |p| p.inner.dropped())
    })
}

/// Closes the registration (the daemon drops the worker at once) and
/// frees the publisher. NULL is a no-op.
///
/// # Safety
/// `publisher` is NULL or a live handle, not used again afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_publisher_close(publisher: *mut kvedge_publisher) {
    guard_value((), || {
        if !publisher.is_null() {
            // SAFETY: a handle from `Box::into_raw` in `kvedge_publisher_open`,
            // given back exactly once (caller).
            drop(unsafe { Box::from_raw(publisher) });
        }
    })
}
