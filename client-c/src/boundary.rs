//! The panic boundary and the argument checks every export goes through,
//! in the manner of rustls-ffi: a function runs inside [`guard`] (a panic
//! becomes `KVEDGE_ERR_PANIC`, an [`Error`] its code), its message is kept
//! per thread for `kvedge_last_error_message`, and every pointer a caller
//! hands over is checked before it is read.

use std::cell::RefCell;
use std::ffi::{CStr, OsStr, c_char};
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use kvedge_schema::messages::{Role, Tier};

use crate::status::*;

pub(crate) struct Error {
    pub(crate) code: kvedge_status,
    pub(crate) message: String,
}

impl Error {
    pub(crate) fn new(code: kvedge_status, message: impl Into<String>) -> Self {
        Error {
            code,
            message: message.into(),
        }
    }
    pub(crate) fn null(what: &str) -> Self {
        Error::new(KVEDGE_ERR_NULL_ARGUMENT, format!("{what} is NULL"))
    }
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::new(KVEDGE_ERR_INVALID_ARGUMENT, message)
    }
    /// The same error, its message prefixed with the socket it concerns.
    pub(crate) fn at(mut self, socket: &Path) -> Self {
        self.message = format!("{}: {}", socket.display(), self.message);
        self
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_error(message: &str) {
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        e.clear();
        e.push_str(message);
    });
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned());
    format!("internal error (panic): {what}")
}

/// Runs `f` behind the panic boundary; records the message of a failure.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> kvedge_status {
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
pub(crate) fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
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
pub(crate) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
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
pub(crate) unsafe fn optional_text<'a>(
    p: *const c_char,
    what: &str,
) -> Result<Option<&'a str>, Error> {
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
pub(crate) unsafe fn path<'a>(p: *const c_char, what: &str) -> Result<&'a Path, Error> {
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
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Error> {
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

pub(crate) fn parse_tier(t: u32) -> Result<Tier, Error> {
    match t {
        KVEDGE_TIER_DEVICE => Ok(Tier::Device),
        KVEDGE_TIER_HOST => Ok(Tier::Host),
        KVEDGE_TIER_DISK => Ok(Tier::Disk),
        other => Err(Error::invalid(format!(
            "tier {other} (KVEDGE_TIER_DEVICE, _HOST or _DISK)"
        ))),
    }
}

pub(crate) fn parse_role(r: u32) -> Result<Role, Error> {
    match r {
        KVEDGE_ROLE_AGGREGATED => Ok(Role::Aggregated),
        KVEDGE_ROLE_PREFILL => Ok(Role::Prefill),
        KVEDGE_ROLE_DECODE => Ok(Role::Decode),
        KVEDGE_ROLE_ENCODE => Ok(Role::Encode),
        other => Err(Error::invalid(format!("role {other} (KVEDGE_ROLE_*)"))),
    }
}

/// Checks a handle argument.
///
/// # Safety
/// `p` is NULL or a live handle from this library, not used by another
/// thread during the call.
pub(crate) unsafe fn handle<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Error> {
    if p.is_null() {
        return Err(Error::null(what));
    }
    // SAFETY: non-null, and the caller guarantees a live handle with no
    // other reference in use.
    Ok(unsafe { &mut *p })
}

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
pub(crate) unsafe fn copy_out(text: &[u8], buf: *mut c_char, len: usize) -> usize {
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
