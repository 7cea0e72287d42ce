//! The C library's hot calls allocate nothing after warm-up (counted by
//! allocation-counter on this thread; the daemon runs in another).

mod support;

use std::ffi::CString;

use kvedge::*;
use support::{Daemon, hello, select_request};

#[test]
fn publish_hash_and_select_allocate_nothing_after_warm_up() {
    let daemon = Daemon::start("alloc", "daemon:\n  heartbeat_timeout_ms: 600000\n");
    let (control, query) = (daemon.control(), daemon.query());
    let model = CString::new("llama").unwrap();
    let hello = hello(model.as_ptr());
    let mut p = std::ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { kvedge_publisher_open(control.as_ptr(), &hello, &mut p) };
    assert_eq!(rc, KVEDGE_OK);
    let hashes: Vec<u64> = (1..=16).collect();
    let tokens: Vec<u32> = (0..2048).collect();
    let mut out = vec![0u64; 128];
    let mut n = 0usize;
    let publish = |p| {
        // SAFETY: a live publisher and 16 readable hashes.
        let rc = unsafe {
            kvedge_publish_stored(p, KVEDGE_TIER_DEVICE, std::ptr::null(), hashes.as_ptr(), 16)
        };
        assert_eq!(rc, KVEDGE_OK);
    };
    publish(p);
    let info = allocation_counter::measure(|| {
        for _ in 0..1000 {
            publish(p);
        }
    });
    assert_eq!(info.count_total, 0, "kvedge_publish_stored: {info:?}");

    let info = allocation_counter::measure(|| {
        for _ in 0..100 {
            // SAFETY: 2048 readable tokens, 128 writable outputs.
            let rc = unsafe {
                kvedge_hash_blocks(
                    tokens.as_ptr(),
                    tokens.len(),
                    16,
                    std::ptr::null(),
                    std::ptr::null(),
                    out.as_mut_ptr(),
                    out.len(),
                    &mut n,
                )
            };
            assert_eq!(rc, KVEDGE_OK);
        }
    });
    assert_eq!(info.count_total, 0, "kvedge_hash_blocks: {info:?}");
    assert_eq!(n, 128);

    let mut c = std::ptr::null_mut();
    // SAFETY: a valid path and out pointer.
    let rc = unsafe { kvedge_client_connect(query.as_ptr(), &mut c) };
    assert_eq!(rc, KVEDGE_OK);
    let req = select_request(model.as_ptr(), &out, false);
    // SAFETY: all-zero bytes are a valid kvedge_select_result.
    let mut res: kvedge_select_result = unsafe { std::mem::zeroed() };
    let select_and_finish = |c, res: &mut kvedge_select_result| {
        // SAFETY: a live client, a valid request and result.
        unsafe {
            assert_eq!(kvedge_select(c, &req, res), KVEDGE_OK);
            assert_eq!(kvedge_finish(c, res.request_id), KVEDGE_OK);
        }
    };
    // Over the socket, then over a query channel (shared-memory rings).
    for rings in [false, true] {
        if rings {
            // SAFETY: a live client.
            assert_eq!(unsafe { kvedge_client_attach_rings(c) }, KVEDGE_OK);
        }
        select_and_finish(c, &mut res);
        let info = allocation_counter::measure(|| {
            for _ in 0..100 {
                select_and_finish(c, &mut res);
            }
        });
        assert_eq!(
            info.count_total, 0,
            "kvedge_select + kvedge_finish (rings: {rings}): {info:?}"
        );
        assert_eq!(res.worker_id, 1);
    }

    // SAFETY: live handles, closed once.
    unsafe {
        kvedge_client_close(c);
        kvedge_publisher_close(p);
    }
    drop(daemon);
}
