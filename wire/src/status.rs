//! Every status a daemon answers with, defined once: its binary code (the
//! `status` field of a reply frame) and its JSON name (`error.code` of a
//! JSON reply). The C library maps each to a `KVEDGE_ERR_*` value with an
//! exhaustive match, so a new status cannot be forgotten there.

use std::fmt;

/// A daemon's answer status. `Ok` is the only success.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    /// The request is malformed or names something that does not exist
    /// (an unknown role, both or neither of tokens and hashes, ...).
    BadRequest,
    /// No worker can serve the request (model, role, filters).
    NoWorker,
    /// A rule found no candidate and rejects the request.
    Rejected,
    /// Rules are configured and none matches the request.
    NoRule,
    /// `prefill_done` or `finish` for a request id the daemon does not hold
    /// (finished, expired or never reserved).
    UnknownRequest,
    /// A frame or line longer than `daemon.max_frame_bytes`; the
    /// connection is closed after this reply.
    FrameTooLarge,
    /// A binary frame of another protocol version.
    UnsupportedVersion,
    /// A binary frame with an op this daemon does not know.
    UnknownOp,
    /// `daemon.max_reservations` requests are selected and not finished.
    TooManyRequests,
    /// No query channel for this connection (limit reached, channels off,
    /// or a listener that does not offer them); the socket still works.
    RingsUnavailable,
    /// `daemon.max_query_connections` connections are open; the
    /// connection is closed after this reply.
    TooManyConnections,
    /// The peer's uid/gid is not allowed on the query socket; the
    /// connection is closed after this reply.
    NotPermitted,
    /// A reload was asked for and the configuration was refused; the
    /// previous one keeps serving.
    ReloadFailed,
}

impl Status {
    /// Every status, in the order of their codes.
    pub const ALL: [Status; 14] = [
        Status::Ok,
        Status::BadRequest,
        Status::NoWorker,
        Status::Rejected,
        Status::NoRule,
        Status::UnknownRequest,
        Status::FrameTooLarge,
        Status::UnsupportedVersion,
        Status::UnknownOp,
        Status::TooManyRequests,
        Status::RingsUnavailable,
        Status::TooManyConnections,
        Status::NotPermitted,
        Status::ReloadFailed,
    ];

    /// The code in a binary reply frame.
    #[inline]
    pub const fn code(self) -> u16 {
        match self {
            Status::Ok => 0,
            Status::BadRequest => 1,
            Status::NoWorker => 2,
            Status::Rejected => 3,
            Status::NoRule => 4,
            Status::UnknownRequest => 5,
            Status::FrameTooLarge => 6,
            Status::UnsupportedVersion => 7,
            Status::UnknownOp => 8,
            Status::TooManyRequests => 9,
            Status::RingsUnavailable => 10,
            Status::TooManyConnections => 11,
            Status::NotPermitted => 12,
            Status::ReloadFailed => 13,
        }
    }

    /// The status with binary code `code`, if this version knows it.
    #[inline]
    pub fn from_code(code: u16) -> Option<Status> {
        Status::ALL.into_iter().find(|s| s.code() == code)
    }

    /// The name in a JSON error reply (`{"error":{"code":NAME,...}}`).
    pub const fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::BadRequest => "bad_request",
            Status::NoWorker => "no_worker",
            Status::Rejected => "rejected",
            Status::NoRule => "no_rule",
            Status::UnknownRequest => "unknown_request",
            Status::FrameTooLarge => "frame_too_large",
            Status::UnsupportedVersion => "unsupported_version",
            Status::UnknownOp => "unknown_op",
            Status::TooManyRequests => "too_many_requests",
            Status::RingsUnavailable => "rings_unavailable",
            Status::TooManyConnections => "too_many_connections",
            Status::NotPermitted => "not_permitted",
            Status::ReloadFailed => "reload_failed",
        }
    }

    /// The status with JSON name `name`, if this version knows it.
    pub fn from_name(name: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|s| s.name() == name)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_are_unique_and_round_trip() {
        for (i, s) in Status::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(s.code()), i, "{s} is out of order");
            assert_eq!(Status::from_code(s.code()), Some(s));
            assert_eq!(Status::from_name(s.name()), Some(s));
        }
        assert_eq!(Status::from_code(Status::ALL.len() as u16), None);
        assert_eq!(Status::from_name("nope"), None);
    }
}
