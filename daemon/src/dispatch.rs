//! One request's bytes to its reply's bytes, for every transport the
//! routing thread serves (query sockets, query channels, jobs from other
//! threads): decode with the wire crate, let the core answer, encode in
//! the request's own protocol. The two requests the core cannot answer
//! alone are completed here: a reload (the file is read here) and the
//! select timing (the core reads no clock).

use std::time::Instant;

use kvedge_core::config::{Config, ConfigError};
use kvedge_core::{ClientId, Core, ReloadError};
use kvedge_wire::framing::Mode;
use kvedge_wire::{Reply, Request, Status, binary, json};

/// Produces a freshly loaded configuration, or the loader's error.
pub type Reloader = Box<dyn FnMut() -> Result<Config, ConfigError> + Send>;

/// Loads the configuration again with `reloader` and hands it to the core
/// (which applies it, or keeps the old one); tells systemd RELOADING=1,
/// then READY=1 either way. Returns the number of reloads so far.
pub(crate) fn reload(
    core: &mut Core,
    reloader: &mut Option<Reloader>,
    now: Instant,
) -> Result<u64, ReloadError> {
    let Some(reloader) = reloader.as_mut() else {
        return core.handle_reload(now, Err(ReloadError::NoConfigFile));
    };
    crate::notify::reloading();
    let loaded = reloader().map_err(ReloadError::from);
    let outcome = core.handle_reload(now, loaded);
    crate::notify::ready(&core.status());
    outcome
}

/// The reply bytes to one request `body` of `client` in `mode` (a JSON
/// line without its newline, or a binary frame after its length), into
/// `out`.
pub(crate) fn answer(
    core: &mut Core,
    reloader: &mut Option<Reloader>,
    now: Instant,
    client: ClientId,
    mode: Mode,
    body: &[u8],
    out: &mut Vec<u8>,
) {
    out.clear();
    // A JSON line is parsed into owned fields first; the request borrows
    // from them, as a binary request borrows from its frame.
    let line;
    let (decoded, encode): (_, fn(&mut Vec<u8>, &Reply<'_>)) = match mode {
        Mode::Binary => (binary::decode_request(body), binary::encode_reply),
        Mode::Json | Mode::Unknown => {
            line = json::decode_request(body);
            let decoded = match &line {
                Ok(line) => line.request(),
                Err(e) => Err(e.clone()),
            };
            (decoded, json::encode_reply)
        }
    };
    match decoded {
        Ok(request) => respond(core, reloader, now, client, &request, out, encode),
        Err(e) => encode(out, &core.handle_undecodable(now, client, e)),
    }
}

/// Asks the core (completing a reload or timing a select) and encodes.
fn respond(
    core: &mut Core,
    reloader: &mut Option<Reloader>,
    now: Instant,
    client: ClientId,
    request: &Request<'_>,
    out: &mut Vec<u8>,
    encode: fn(&mut Vec<u8>, &Reply<'_>),
) {
    match request {
        Request::Reload => match reload(core, reloader, now) {
            Ok(reloads) => encode(out, &Reply::Reloaded { reloads }),
            Err(e) => encode(out, &Reply::error(Status::ReloadFailed, e.to_string())),
        },
        Request::Select(_) => {
            let started = Instant::now();
            let reply = core.handle_request(now, client, request);
            let took = started.elapsed();
            encode(out, &reply);
            core.note_select_time(took);
        }
        _ => encode(out, &core.handle_request(now, client, request)),
    }
}
