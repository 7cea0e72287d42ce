//! A daemon that accepts a client and never answers does not hang it: a
//! call gives up after the default timeout with `KVEDGE_ERR_TIMEOUT`,
//! and 0 turns the bound off only when asked.

mod support;

use std::ffi::CString;
use std::time::{Duration, Instant};

use kvedge::*;
use support::select_request;

#[test]
fn a_silent_daemon_times_out_by_default() {
    let dir = std::env::temp_dir().join(format!("kvedge-c-timeout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("query.sock");
    // Accepts, reads, and never replies.
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    let path = CString::new(path.to_str().unwrap()).unwrap();
    let mut c = std::ptr::null_mut();
    // SAFETY: valid path and out pointer.
    let rc = unsafe { kvedge_client_connect(path.as_ptr(), &mut c) };
    assert_eq!(rc, KVEDGE_OK);
    let model = CString::new("llama").unwrap();
    let hashes = [1u64, 2, 3];
    let req = select_request(model.as_ptr(), &hashes, true);
    // SAFETY: zeroed plain data is a valid result to fill.
    let mut res: kvedge_select_result = unsafe { std::mem::zeroed() };
    let started = Instant::now();
    // SAFETY: live client, a request whose pointers outlive the call.
    let rc = unsafe { kvedge_select(c, &req, &mut res) };
    let waited = started.elapsed();
    assert_eq!(rc, KVEDGE_ERR_TIMEOUT);
    let default = Duration::from_millis(u64::from(KVEDGE_DEFAULT_TIMEOUT_MS));
    assert!(
        waited >= default && waited < default * 3,
        "gave up after {waited:?}"
    );
    // SAFETY: the handle from connect, closed once.
    unsafe { kvedge_client_close(c) };
    let _ = std::fs::remove_dir_all(&dir);
}
