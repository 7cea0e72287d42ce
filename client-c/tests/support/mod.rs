//! Shared by the C library's Rust tests and its bench: a daemon in a thread
//! of the test process whose loop can be held (to overflow a ring on
//! purpose, or to measure a publish batch with no consumer racing for the
//! ring's cache lines), and the C structs filled with test defaults.

#![allow(dead_code)] // each user takes a subset

use std::ffi::{CString, c_char};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvedge::{KVEDGE_ROLE_AGGREGATED, kvedge_hello, kvedge_select_request};

/// A daemon running in a thread; stopped (its sockets closed) on `stop` or
/// drop.
pub struct Daemon {
    pub dir: PathBuf,
    pause: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    quit: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Daemon {
    /// Binds in a fresh directory named after `name`, with `yaml`.
    pub fn start(name: &str, yaml: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("kvedge-c-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut server =
            kvedge_testkit::Bound::at(dir.clone(), kvedge_testkit::config(yaml)).server;
        let (pause, paused, quit) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let thread = {
            let (pause, paused, quit) = (pause.clone(), paused.clone(), quit.clone());
            std::thread::spawn(move || {
                while !quit.load(Ordering::SeqCst) {
                    server
                        .run(|| pause.load(Ordering::SeqCst) || quit.load(Ordering::SeqCst))
                        .unwrap();
                    paused.store(true, Ordering::SeqCst);
                    while pause.load(Ordering::SeqCst) && !quit.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    paused.store(false, Ordering::SeqCst);
                }
                // Dropping the server closes every socket and engine
                // connection: the daemon is gone.
                drop(server);
            })
        };
        Daemon {
            dir,
            pause,
            paused,
            quit,
            thread: Some(thread),
        }
    }

    pub fn control(&self) -> CString {
        CString::new(self.dir.join("control.sock").to_str().unwrap()).unwrap()
    }

    pub fn query(&self) -> CString {
        CString::new(self.dir.join("query.sock").to_str().unwrap()).unwrap()
    }

    /// Holds the loop (`true`) or lets it run again (`false`); returns once
    /// the loop is in that state.
    pub fn hold(&self, on: bool) {
        self.pause.store(on, Ordering::SeqCst);
        while self.paused.load(Ordering::SeqCst) != on {
            std::thread::yield_now();
        }
    }

    pub fn stop(&mut self) {
        self.quit.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Worker 1, block size 16, a large device pool, serving `model`.
pub fn hello(model: *const c_char) -> kvedge_hello {
    kvedge_hello {
        worker_id: 1,
        dp_rank: 0,
        role: KVEDGE_ROLE_AGGREGATED,
        model,
        endpoint: std::ptr::null(),
        block_size: 16,
        reserved: 0,
        kv_blocks_device: 1 << 20,
        kv_blocks_host: 0,
        kv_blocks_disk: 0,
        ring_capacity: 0,
    }
}

/// A select for `hashes` (2,048 prompt tokens), no context.
pub fn select_request(
    model: *const c_char,
    hashes: &[u64],
    dry_run: bool,
) -> kvedge_select_request {
    kvedge_select_request {
        model,
        session: std::ptr::null(),
        role: KVEDGE_ROLE_AGGREGATED,
        dry_run: u32::from(dry_run),
        hashes: hashes.as_ptr(),
        n_hashes: hashes.len(),
        tokens: std::ptr::null(),
        n_tokens: 0,
        prompt_tokens: 2048,
        priority: 0,
        tenant: std::ptr::null(),
        tags: std::ptr::null(),
        n_tags: 0,
        header_names: std::ptr::null(),
        header_values: std::ptr::null(),
        n_headers: 0,
    }
}
