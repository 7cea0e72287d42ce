//! A select the rules send to an off-cluster provider names it: the
//! result's `is_provider` and endpoint, and `kvedge_selected_provider`
//! for the provider's name (copied and truncated like every other string
//! this library hands out).

mod support;

use std::ffi::{CStr, CString, c_char};

use kvedge::*;
use support::{Daemon, hello, select_request};

const CONFIG: &str = "daemon:\n  heartbeat_timeout_ms: 600000\n\
policy:\n  rules:\n\
\x20   - name: premium-to-cloud\n      matches:\n        - { header.x-tier: premium }\n      route:\n        consider:\n          - providers: {}\n        select:\n          - { type: Provider, order: [cloud-east-1] }\n        onEmpty: Reject\n\
\x20   - name: everyone\n      route:\n        select:\n          - { type: Local }\n\
providers:\n  - { name: cloud-east-1, models: [llama], endpoint: \"https://cloud.example/v1\" }\n";

/// `kvedge_selected_provider` into a buffer of `len` bytes: its return
/// value and what it wrote.
fn provider(c: *const kvedge_client, len: usize) -> (usize, String) {
    let mut buf = vec![b'x' as c_char; len.max(1)];
    // SAFETY: `c` is NULL or live; `buf` has at least `len` bytes.
    let n = unsafe { kvedge_selected_provider(c, buf.as_mut_ptr(), len) };
    let text = if len == 0 {
        String::new()
    } else {
        // SAFETY: the call NUL-terminated `buf` within `len` bytes.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    };
    (n, text)
}

#[test]
fn a_provider_pick_names_the_provider() {
    let daemon = Daemon::start("provider", CONFIG);
    let (control, query) = (daemon.control(), daemon.query());
    let model = CString::new("llama").unwrap();
    let mut p = std::ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { kvedge_publisher_open(control.as_ptr(), &hello(model.as_ptr()), &mut p) };
    assert_eq!(rc, KVEDGE_OK);
    let mut c = std::ptr::null_mut();
    // SAFETY: valid path and out pointer.
    let rc = unsafe { kvedge_client_connect(query.as_ptr(), &mut c) };
    assert_eq!(rc, KVEDGE_OK);
    assert_eq!(provider(c, 64), (0, String::new()), "no select yet");

    let hashes = [1u64, 2, 3];
    let (name, premium) = (c"x-tier".as_ptr(), c"premium".as_ptr());
    let mut req = select_request(model.as_ptr(), &hashes, true);
    req.header_names = &name;
    req.header_values = &premium;
    req.n_headers = 1;
    // SAFETY: zeroed plain data is a valid result to fill.
    let mut res: kvedge_select_result = unsafe { std::mem::zeroed() };
    // SAFETY: live client, a request whose pointers outlive the call.
    assert_eq!(unsafe { kvedge_select(c, &req, &mut res) }, KVEDGE_OK);
    assert_eq!(res.is_provider, 1);
    // SAFETY: the library NUL-terminates the endpoint.
    let endpoint = unsafe { CStr::from_ptr(res.endpoint.as_ptr()) };
    assert_eq!(endpoint.to_str().unwrap(), "https://cloud.example/v1");
    assert_eq!(provider(c, 64), (12, "cloud-east-1".into()));
    assert_eq!(
        provider(c, 6),
        (12, "cloud".into()),
        "truncated, terminated"
    );
    assert_eq!(provider(c, 0), (12, String::new()), "length only");
    // SAFETY: a NULL buffer is allowed.
    let n = unsafe { kvedge_selected_provider(c, std::ptr::null_mut(), 8) };
    assert_eq!(n, 12);
    assert_eq!(provider(std::ptr::null(), 64), (0, String::new()));

    // A failed select leaves the name as it was.
    let other = CString::new("no-such-model").unwrap();
    let bad = select_request(other.as_ptr(), &hashes, true);
    // SAFETY: as above.
    let rc = unsafe { kvedge_select(c, &bad, &mut res) };
    assert_ne!(rc, KVEDGE_OK);
    assert_eq!(provider(c, 64), (12, "cloud-east-1".into()));

    // A worker pick clears it.
    let plain = select_request(model.as_ptr(), &hashes, true);
    // SAFETY: as above.
    assert_eq!(unsafe { kvedge_select(c, &plain, &mut res) }, KVEDGE_OK);
    assert_eq!((res.is_provider, res.worker_id), (0, 1));
    assert_eq!(provider(c, 64), (0, String::new()));

    // SAFETY: live handles, not used again.
    unsafe {
        kvedge_client_close(c);
        kvedge_publisher_close(p);
    }
}
