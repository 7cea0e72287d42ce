//! Status codes and the constants of the C API (tiers, roles, poll
//! flags, sizes, the version).

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

/// What started a session's turn (`kvedge_select_routing::trigger`).
pub const KVEDGE_TRIGGER_USER: u32 = 0;
pub const KVEDGE_TRIGGER_TOOL: u32 = 1;
pub const KVEDGE_TRIGGER_OTHER: u32 = 2;

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
pub const KVEDGE_VERSION_MINOR: u32 = 2;
pub const KVEDGE_VERSION_PATCH: u32 = 0;
