//! An engine that keeps polling survives a daemon restart: the poll that
//! finds the daemon gone says `KVEDGE_ERR_CLOSED`, later polls register
//! again (the engine session's backoff), call the callback to republish
//! every block, and the new daemon routes on them.

mod support;

use std::ffi::{CString, c_void};
use std::time::{Duration, Instant};

use kvedge::*;
use support::{Daemon, hello, select_request};

const CONFIG: &str = "daemon:\n  heartbeat_timeout_ms: 600000\n";
const HASHES: [u64; 3] = [11, 12, 13];

/// The engine's resync callback: publishes every block it holds.
unsafe extern "C" fn republish(p: *mut kvedge_publisher, calls: *mut c_void) -> kvedge_status {
    // SAFETY: `calls` is the test's counter, alive for the whole test.
    unsafe { *calls.cast::<u32>() += 1 };
    // SAFETY: the live handle the poll passes; a valid slice.
    unsafe {
        kvedge_publish_stored(
            p,
            KVEDGE_TIER_DEVICE,
            std::ptr::null(),
            HASHES.as_ptr(),
            HASHES.len(),
        )
    }
}

/// The device blocks of `HASHES` the daemon at `query` holds.
fn overlap(query: &CString, model: &CString) -> u32 {
    let mut c = std::ptr::null_mut();
    // SAFETY: valid path and out pointer.
    if unsafe { kvedge_client_connect(query.as_ptr(), &mut c) } != KVEDGE_OK {
        return 0;
    }
    let req = select_request(model.as_ptr(), &HASHES, true);
    // SAFETY: zeroed plain data is a valid result to fill.
    let mut res: kvedge_select_result = unsafe { std::mem::zeroed() };
    // SAFETY: live client, a request whose pointers outlive the call.
    let rc = unsafe { kvedge_select(c, &req, &mut res) };
    // SAFETY: the handle from connect, closed once.
    unsafe { kvedge_client_close(c) };
    if rc == KVEDGE_OK {
        res.overlap_device
    } else {
        0
    }
}

#[test]
fn a_polling_engine_registers_again_after_the_daemon_restarts() {
    let mut first = Daemon::start("reregister", CONFIG);
    let (control, query) = (first.control(), first.query());
    let model = CString::new("llama").unwrap();
    let mut p = std::ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { kvedge_publisher_open(control.as_ptr(), &hello(model.as_ptr()), &mut p) };
    assert_eq!(rc, KVEDGE_OK);
    // SAFETY: live publisher, a valid slice.
    let rc = unsafe {
        kvedge_publish_stored(p, KVEDGE_TIER_DEVICE, std::ptr::null(), HASHES.as_ptr(), 3)
    };
    assert_eq!(rc, KVEDGE_OK);
    let start = Instant::now();
    while overlap(&query, &model) != 3 {
        assert!(start.elapsed() < Duration::from_secs(5), "the blocks");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut calls = 0u32;
    let user = (&raw mut calls).cast::<c_void>();
    let mut flags = 0u32;
    // SAFETY: live publisher, a callback that publishes on it.
    let rc = unsafe { kvedge_publisher_poll(p, Some(republish), user, &mut flags) };
    assert_eq!((rc, flags, calls), (KVEDGE_OK, 0, 0));

    // The daemon goes away: the poll says so.
    first.stop();
    drop(first);
    let start = Instant::now();
    let rc = loop {
        // SAFETY: as above.
        let rc = unsafe { kvedge_publisher_poll(p, Some(republish), user, &mut flags) };
        if rc != KVEDGE_OK || start.elapsed() > Duration::from_secs(5) {
            break rc;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(rc, KVEDGE_ERR_CLOSED);

    // A new daemon in its place: polling registers again and republishes.
    let second = Daemon::start("reregister", CONFIG);
    let start = Instant::now();
    loop {
        // SAFETY: as above.
        let rc = unsafe { kvedge_publisher_poll(p, Some(republish), user, &mut flags) };
        if rc == KVEDGE_OK {
            break;
        }
        assert_eq!(rc, KVEDGE_ERR_CLOSED);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never registered again"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        flags & KVEDGE_POLL_REGISTERED_AGAIN,
        KVEDGE_POLL_REGISTERED_AGAIN
    );
    assert_eq!(calls, 1, "republished once");
    let start = Instant::now();
    while overlap(&second.query(), &model) != 3 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the new daemon has the republished blocks"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: the handle from open, closed once.
    unsafe { kvedge_publisher_close(p) };
}
