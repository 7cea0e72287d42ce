//! kvedge's C library: `libkvedge.so` / `libkvedge.a` with the header
//! `include/kvedge.h` (generated from this file by a pinned cbindgen).
//!
//! Three parts, each a thin layer over the Rust crates so the C and Rust
//! paths cannot drift apart:
//! - the engine-side publisher ([`kvedge_publisher_open`] ...): registration
//!   over `control.sock` and KV events / load into the shared-memory ring
//!   (`kvedge_shm::Publisher`);
//! - block hashing ([`kvedge_hash_blocks`]), the same function `kvedge hash`
//!   and the daemon use;
//! - the frontend query client ([`kvedge_client_connect`] ...), the binary
//!   protocol's client (`kvedge_wire::Client`).
//!
//! Conventions, as in rustls-ffi: every function returns a `kvedge_status`
//! (0 is success) or a plain value, checks every pointer, and runs behind a
//! panic boundary; the message of the last failure on the calling thread
//! is `kvedge_last_error_message`.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{CStr, OsStr, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvedge_shm::control::ProducerSession;
use kvedge_shm::messages::control::Hello;
use kvedge_shm::messages::{Load, Role, Tier};
use kvedge_shm::session::{Action, REGISTER_TIMEOUT, Session, SessionState};
use kvedge_shm::{ControlError, PublishError, Publisher};
use kvedge_wire::{Client, Ids, Pairs, Select, Status, Strs};

/// Result of every fallible function: `KVEDGE_OK` (0) or an error code.
pub type kvedge_status = i32;

/// Success.
pub const KVEDGE_OK: kvedge_status = 0;
/// A required pointer argument was NULL.
pub const KVEDGE_ERR_NULL_ARGUMENT: kvedge_status = 1;
/// An argument is out of range or not UTF-8 where text is required.
pub const KVEDGE_ERR_INVALID_ARGUMENT: kvedge_status = 2;
/// The output buffer is too small; the needed size was written back.
pub const KVEDGE_ERR_BUFFER_TOO_SMALL: kvedge_status = 3;
/// The daemon's socket could not be reached.
pub const KVEDGE_ERR_CONNECT: kvedge_status = 4;
/// The daemon refused the engine's registration.
pub const KVEDGE_ERR_REJECTED: kvedge_status = 5;
/// The daemon closed the connection (it exited or restarted); reconnect.
pub const KVEDGE_ERR_CLOSED: kvedge_status = 6;
/// No reply within the client's timeout; the client must be reconnected.
pub const KVEDGE_ERR_TIMEOUT: kvedge_status = 7;

/// How long a client's call waits for the daemon unless
/// `kvedge_client_set_timeout_ms` says otherwise, in milliseconds.
pub const KVEDGE_DEFAULT_TIMEOUT_MS: u32 = 10_000;
/// Another I/O error.
pub const KVEDGE_ERR_IO: kvedge_status = 8;
/// The peer sent something this library does not understand.
pub const KVEDGE_ERR_PROTOCOL: kvedge_status = 9;
/// The daemon has no worker for the request (model, role, filters).
pub const KVEDGE_ERR_NO_WORKER: kvedge_status = 10;
/// The daemon does not know this request id (finished or expired).
pub const KVEDGE_ERR_UNKNOWN_REQUEST: kvedge_status = 11;
/// The daemon answered with another error; see the message.
pub const KVEDGE_ERR_DAEMON: kvedge_status = 12;
/// A bug in the library (a caught panic); the handle should be closed.
pub const KVEDGE_ERR_PANIC: kvedge_status = 13;
/// The daemon cannot give this client a query channel (its
/// `daemon.max_query_rings` is reached, or its listener does not offer
/// them); the client keeps working over the socket.
pub const KVEDGE_ERR_UNAVAILABLE: kvedge_status = 14;

/// KV tiers.
pub const KVEDGE_TIER_DEVICE: u32 = 0;
pub const KVEDGE_TIER_HOST: u32 = 1;
pub const KVEDGE_TIER_DISK: u32 = 2;
/// `kvedge_publish_cleared`: every tier.
pub const KVEDGE_TIER_ALL: i32 = -1;

/// Worker roles.
pub const KVEDGE_ROLE_AGGREGATED: u32 = 0;
pub const KVEDGE_ROLE_PREFILL: u32 = 1;
pub const KVEDGE_ROLE_DECODE: u32 = 2;
pub const KVEDGE_ROLE_ENCODE: u32 = 3;

/// `kvedge_publisher_poll` flag: the daemon asked for a resync and no
/// callback was given; poll again with one to serve it.
pub const KVEDGE_POLL_RESYNC_PENDING: u32 = 1;
/// `kvedge_publisher_poll` flag: a resync snapshot was published.
pub const KVEDGE_POLL_RESYNC_SERVED: u32 = 2;
/// `kvedge_publisher_poll` flag: the daemon had gone away and the engine
/// registered again (its blocks republished through the callback, or at
/// the next poll that gives one).
pub const KVEDGE_POLL_REGISTERED_AGAIN: u32 = 4;

/// Bytes of `kvedge_select_result::endpoint`, NUL included.
pub const KVEDGE_ENDPOINT_MAX: usize = 256;

pub const KVEDGE_VERSION_MAJOR: u32 = 0;
pub const KVEDGE_VERSION_MINOR: u32 = 1;
pub const KVEDGE_VERSION_PATCH: u32 = 0;

// ------------------------------------------------------------ errors

struct Error {
    code: kvedge_status,
    message: String,
}

impl Error {
    fn new(code: kvedge_status, message: impl Into<String>) -> Self {
        Error {
            code,
            message: message.into(),
        }
    }
    fn null(what: &str) -> Self {
        Error::new(KVEDGE_ERR_NULL_ARGUMENT, format!("{what} is NULL"))
    }
    fn invalid(message: impl Into<String>) -> Self {
        Error::new(KVEDGE_ERR_INVALID_ARGUMENT, message)
    }
    /// The same error, its message prefixed with the socket it concerns.
    fn at(mut self, socket: &Path) -> Self {
        self.message = format!("{}: {}", socket.display(), self.message);
        self
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(message: &str) {
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        e.clear();
        e.push_str(message);
    });
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned());
    format!("internal error (panic): {what}")
}

/// Runs `f` behind the panic boundary; records the message of a failure.
fn guard(f: impl FnOnce() -> Result<(), Error>) -> kvedge_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KVEDGE_OK,
        Ok(Err(e)) => {
            set_error(&e.message);
            e.code
        }
        Err(p) => {
            set_error(&panic_message(p.as_ref()));
            KVEDGE_ERR_PANIC
        }
    }
}

/// Runs `f` behind the panic boundary for functions that return a value;
/// a panic yields `fallback`.
fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            set_error(&panic_message(p.as_ref()));
            fallback
        }
    }
}

/// A NUL-terminated string argument as UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(Error::null(what));
    }
    // SAFETY: non-null, and the caller guarantees a NUL-terminated string
    // that outlives the call.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str()
        .map_err(|_| Error::invalid(format!("{what} is not UTF-8")))
}

/// An optional string argument: NULL or "" is none.
///
/// # Safety
/// As [`text`].
unsafe fn optional_text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Error> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: as `text`; `p` is not NULL.
    let s = unsafe { text(p, what)? };
    Ok((!s.is_empty()).then_some(s))
}

/// A path argument (any bytes but NUL).
///
/// # Safety
/// As [`text`].
unsafe fn path<'a>(p: *const c_char, what: &str) -> Result<&'a Path, Error> {
    if p.is_null() {
        return Err(Error::null(what));
    }
    // SAFETY: as `text`.
    let c = unsafe { CStr::from_ptr(p) };
    Ok(Path::new(OsStr::from_bytes(c.to_bytes())))
}

/// A `(pointer, count)` argument as a slice; NULL is allowed when `n` is 0.
///
/// # Safety
/// `p` points to `n` readable, initialised `T`s valid for the call.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Error> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::null(what));
    }
    if n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Error::invalid(format!("{what}: count {n} is too large")));
    }
    // SAFETY: non-null, in range, and the caller guarantees `n` readable
    // elements for the duration of the call.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

fn parse_tier(t: u32) -> Result<Tier, Error> {
    match t {
        KVEDGE_TIER_DEVICE => Ok(Tier::Device),
        KVEDGE_TIER_HOST => Ok(Tier::Host),
        KVEDGE_TIER_DISK => Ok(Tier::Disk),
        other => Err(Error::invalid(format!(
            "tier {other} (KVEDGE_TIER_DEVICE, _HOST or _DISK)"
        ))),
    }
}

fn parse_role(r: u32) -> Result<Role, Error> {
    match r {
        KVEDGE_ROLE_AGGREGATED => Ok(Role::Aggregated),
        KVEDGE_ROLE_PREFILL => Ok(Role::Prefill),
        KVEDGE_ROLE_DECODE => Ok(Role::Decode),
        KVEDGE_ROLE_ENCODE => Ok(Role::Encode),
        other => Err(Error::invalid(format!("role {other} (KVEDGE_ROLE_*)"))),
    }
}

// ------------------------------------------------------------ version, errors

/// The library's version as `major << 16 | minor << 8 | patch`, to compare
/// with the header's `KVEDGE_VERSION_*` at run time.
#[unsafe(no_mangle)]
pub extern "C" fn kvedge_version() -> u32 {
    (KVEDGE_VERSION_MAJOR << 16) | (KVEDGE_VERSION_MINOR << 8) | KVEDGE_VERSION_PATCH
}

/// Copies the message of the calling thread's last failure into `buf`
/// (NUL-terminated, truncated to `len - 1` bytes) and returns the message's
/// full length. `buf` may be NULL (or `len` 0) to ask for the length only.
/// Messages are per thread; a success does not clear them.
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_last_error_message(buf: *mut c_char, len: usize) -> usize {
    guard_value(0, || {
        // SAFETY: `buf` is NULL or has `len` writable bytes (caller).
        LAST_ERROR.with(|e| unsafe { copy_out(e.borrow().as_bytes(), buf, len) })
    })
}

/// Copies `text` into `buf` NUL-terminated, truncated to `len - 1` bytes
/// (nothing when `buf` is NULL or `len` is 0); returns `text`'s full
/// length.
///
/// # Safety
/// `buf` is NULL or points to `len` writable bytes, none of them `text`'s.
unsafe fn copy_out(text: &[u8], buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: `buf` has `len` writable bytes (caller), `n < len`, and
        // they do not overlap `text` (caller).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    text.len()
}

/// A static description of a status code (never NULL).
#[unsafe(no_mangle)]
pub extern "C" fn kvedge_strerror(code: kvedge_status) -> *const c_char {
    let s: &'static CStr = match code {
        KVEDGE_OK => c"success",
        KVEDGE_ERR_NULL_ARGUMENT => c"a required pointer argument is NULL",
        KVEDGE_ERR_INVALID_ARGUMENT => c"invalid argument",
        KVEDGE_ERR_BUFFER_TOO_SMALL => c"output buffer too small",
        KVEDGE_ERR_CONNECT => c"cannot connect to the daemon",
        KVEDGE_ERR_REJECTED => c"the daemon refused the registration",
        KVEDGE_ERR_CLOSED => c"the daemon closed the connection",
        KVEDGE_ERR_TIMEOUT => c"timed out waiting for the daemon",
        KVEDGE_ERR_IO => c"I/O error",
        KVEDGE_ERR_PROTOCOL => c"protocol error",
        KVEDGE_ERR_NO_WORKER => c"no worker can serve the request",
        KVEDGE_ERR_UNKNOWN_REQUEST => c"unknown request id",
        KVEDGE_ERR_DAEMON => c"the daemon reported an error",
        KVEDGE_ERR_PANIC => c"internal error (panic)",
        KVEDGE_ERR_UNAVAILABLE => c"the daemon cannot attach a query channel",
        _ => c"unknown status code",
    };
    s.as_ptr()
}

// ------------------------------------------------------------ hashing

/// Sequence hashes of the full blocks of `tokens` (a partial last block is
/// not hashed), identical to `kvedge hash` and to what the daemon computes
/// for token-id selects. `lora_name` and `namespace_` change the seed (NULL
/// or "" for none). Writes `n / block_size` hashes to `out` and their
/// number to `*out_len`; if `out_cap` is smaller, writes nothing but the
/// needed count and returns `KVEDGE_ERR_BUFFER_TOO_SMALL`. No allocation.
///
/// # Safety
/// `tokens` points to `n` `uint32_t` (may be NULL when `n` is 0); the
/// strings are NULL or NUL-terminated; `out` points to `out_cap` writable
/// `uint64_t` (may be NULL when `out_cap` is 0); `out_len` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvedge_hash_blocks(
    tokens: *const u32,
    n: usize,
    block_size: u32,
    lora_name: *const c_char,
    namespace_: *const c_char,
    out: *mut u64,
    out_cap: usize,
    out_len: *mut usize,
) -> kvedge_status {
    guard(|| {
        if out_len.is_null() {
            return Err(Error::null("out_len"));
        }
        if block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        // SAFETY: caller contract above.
        let tokens = unsafe { slice(tokens, n, "tokens")? };
        // SAFETY: caller contract above.
        let (lora, ns) = unsafe {
            (
                optional_text(lora_name, "lora_name")?,
                optional_text(namespace_, "namespace_")?,
            )
        };
        let needed = kvedge_shm::hash::full_blocks(tokens.len(), block_size as usize);
        // SAFETY: `out_len` is non-null and writable (caller).
        unsafe { *out_len = needed };
        if needed > out_cap {
            return Err(Error::new(
                KVEDGE_ERR_BUFFER_TOO_SMALL,
                format!("{needed} hashes do not fit in out_cap {out_cap}"),
            ));
        }
        if needed == 0 {
            return Ok(());
        }
        if out.is_null() {
            return Err(Error::null("out"));
        }
        // SAFETY: `out` has `out_cap >= needed` writable elements (caller).
        let out = unsafe { std::slice::from_raw_parts_mut(out, needed) };
        let seed = kvedge_shm::hash::block_seed(lora, ns);
        kvedge_shm::hash::sequence_hashes_into(tokens, block_size as usize, seed, None, out);
        Ok(())
    })
}

// ------------------------------------------------------------ publisher

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

/// Checks a handle argument.
///
/// # Safety
/// `p` is NULL or a live handle from this library, not used by another
/// thread during the call.
unsafe fn handle<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Error> {
    if p.is_null() {
        return Err(Error::null(what));
    }
    // SAFETY: non-null, and the caller guarantees a live handle with no
    // other reference in use.
    Ok(unsafe { &mut *p })
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
        let hello = Hello {
            worker_id: h.worker_id,
            dp_rank: h.dp_rank,
            model: model.to_owned(),
            role: parse_role(h.role)?,
            block_size: h.block_size,
            kv_blocks: [h.kv_blocks_device, h.kv_blocks_host, h.kv_blocks_disk],
            labels: vec![],
            taints: vec![],
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
                kvedge_shm::hash::SEED,
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

// ------------------------------------------------------------ query client

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
/// no system call while the daemon is busy (a 128-hash select took about
/// 1 µs, against about 9 µs for a blocking socket client, on our test VM).
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
