//! Measurements the project's tests share: how many page faults the
//! calling thread has taken, so that a test can check that a path writes
//! only memory that was already mapped (the rings here, the routing
//! core's tables elsewhere).

use std::io::Read;

/// Page faults the calling thread has taken so far that needed no disk
/// read (`minflt`, field 10 of Linux's `/proc/thread-self/stat`). Reads
/// into a buffer on the stack, so calling it allocates nothing and takes
/// no fault of its own once its code has run.
pub fn minor_faults() -> u64 {
    let mut buf = [0u8; 1024];
    let mut f = std::fs::File::open("/proc/thread-self/stat").expect("/proc/thread-self/stat");
    let n = f.read(&mut buf).expect("read /proc/thread-self/stat");
    let stat = std::str::from_utf8(&buf[..n]).expect("stat is text");
    // After the command name's closing parenthesis (a name may hold
    // spaces and parentheses): state is field 3 of the line, minflt 10.
    let fields = &stat[stat.rfind(')').expect("comm") + 1..];
    fields
        .split_whitespace()
        .nth(7)
        .and_then(|f| f.parse().ok())
        .expect("minflt")
}

/// The faults a test of a path that should take none allows. The kernel
/// may move a page that was already written (compaction, migration) while
/// the test runs, and the next touch of it then faults once: up to 8 in
/// 2,000 session binds were seen on a fresh CI machine. A path that writes
/// unwritten memory takes one per new page, 88 to 1,400 in the tests that
/// use this, so the allowance still tells the two apart.
pub const FAULT_ALLOWANCE: u64 = 16;
