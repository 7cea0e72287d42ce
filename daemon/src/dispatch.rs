//! One request's bytes to its reply's bytes, for every transport the
//! routing thread serves (query sockets, query channels, jobs from other
//! threads): decode with the wire crate, let the core answer, encode in
//! the request's own protocol. The two requests the core cannot answer
//! alone are completed here: the select timing (the core reads no clock)
//! and a reload, which is handed to [`crate::reload`] (the file is read
//! on another thread) and answered when it is done.

use std::time::Instant;

use kvedge_core::{ClientId, Core, ReloadError};
use kvedge_wire::framing::Mode;
use kvedge_wire::{Reply, Request, binary, json};

use crate::reload::Reloads;

/// How a request was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub(crate) enum Answer {
    /// The reply is in `out`.
    Now,
    /// The reply is in `out`, and it cost a rendering of every worker or
    /// metric: the connection's turn ends here, so a client pipelining
    /// such requests gets one per turn and no one else waits for it.
    Heavy,
    /// A reload: the transport registers its waiter with
    /// [`Reloads::begin`]; the reply comes when the load is done, and the
    /// connection's later requests wait for it.
    Reload,
}

/// How a reply is written in a connection's protocol (JSON lines unless
/// the connection speaks binary frames).
pub(crate) fn reply_encoder(mode: Mode) -> fn(&mut Vec<u8>, &Reply<'_>) {
    match mode {
        Mode::Binary => binary::encode_reply,
        Mode::Json | Mode::Unknown => json::encode_reply,
    }
}

/// The reply bytes to one request `body` of `client` in `mode` (a JSON
/// line without its newline, or a binary frame after its length), into
/// `out`.
pub(crate) fn answer(
    core: &mut Core,
    reloads: &Reloads,
    now: Instant,
    client: ClientId,
    mode: Mode,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Answer {
    out.clear();
    // A JSON line is parsed into owned fields first; the request borrows
    // from them, as a binary request borrows from its frame.
    let line;
    let (decoded, encode): (_, fn(&mut Vec<u8>, &Reply<'_>)) = match mode {
        Mode::Binary => (binary::decode_request(body), reply_encoder(mode)),
        Mode::Json | Mode::Unknown => {
            line = json::decode_request(body);
            let decoded = match &line {
                Ok(line) => line.request(),
                Err(e) => Err(e.clone()),
            };
            (decoded, reply_encoder(mode))
        }
    };
    match decoded {
        Ok(request) => respond(core, reloads, now, client, &request, out, encode),
        Err(e) => {
            encode(out, &core.handle_undecodable(now, client, e));
            Answer::Now
        }
    }
}

/// Asks the core (completing a reload or timing a select) and encodes.
fn respond(
    core: &mut Core,
    reloads: &Reloads,
    now: Instant,
    client: ClientId,
    request: &Request<'_>,
    out: &mut Vec<u8>,
    encode: fn(&mut Vec<u8>, &Reply<'_>),
) -> Answer {
    match request {
        Request::Reload if reloads.configured() => return Answer::Reload,
        Request::Reload => {
            let e = core
                .handle_reload(now, Err(ReloadError::NoConfigFile))
                .expect_err("a refusal");
            encode(
                out,
                &Reply::error(kvedge_wire::Status::ReloadFailed, e.to_string()),
            );
        }
        Request::Select(_) => {
            let started = Instant::now();
            let reply = core.handle_request(now, client, request);
            let took = started.elapsed();
            encode(out, &reply);
            core.note_select_time(took);
        }
        Request::Metrics | Request::Workers => {
            encode(out, &core.handle_request(now, client, request));
            return Answer::Heavy;
        }
        _ => encode(out, &core.handle_request(now, client, request)),
    }
    Answer::Now
}
