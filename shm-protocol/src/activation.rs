//! systemd socket activation: adopting the listening sockets a service
//! manager passed as fds 3.. (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`,
//! see sd_listen_fds(3)). Turning an inherited fd number into an owned fd
//! takes `unsafe`, which in kvedge lives only in this crate (whose job
//! includes fd passing) and the C library.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// The first passed fd (`SD_LISTEN_FDS_START`).
const START: i32 = 3;

/// Why the passed fds could not be adopted.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("socket activation: {0}")]
    Invalid(String),
    #[error("socket activation fds were already adopted")]
    AlreadyTaken,
}

static TAKEN: AtomicBool = AtomicBool::new(false);

/// Adopts the fds passed to this process, with their names (empty when
/// `LISTEN_FDNAMES` is absent). `Ok(empty)` when nothing was passed, or the
/// variables are meant for another process (`LISTEN_PID` differs). The fds
/// are marked close-on-exec. Only the first call can adopt them.
///
/// `vars` looks an environment variable up (the process environment in
/// production: `|k| std::env::var(k).ok()`).
pub fn take_listen_fds(
    vars: impl Fn(&str) -> Option<String>,
) -> Result<Vec<(String, OwnedFd)>, ActivationError> {
    let Some(pid) = vars("LISTEN_PID") else {
        return Ok(Vec::new());
    };
    let pid: u32 = pid
        .trim()
        .parse()
        .map_err(|_| ActivationError::Invalid(format!("LISTEN_PID `{pid}` is not a pid")))?;
    if pid != std::process::id() {
        return Ok(Vec::new());
    }
    let n = vars("LISTEN_FDS").unwrap_or_default();
    let n: i32 = n
        .trim()
        .parse()
        .map_err(|_| ActivationError::Invalid(format!("LISTEN_FDS `{n}` is not a count")))?;
    if !(0..=1024).contains(&n) {
        return Err(ActivationError::Invalid(format!(
            "LISTEN_FDS {n} out of range"
        )));
    }
    let names: Vec<String> = vars("LISTEN_FDNAMES")
        .map(|s| s.split(':').map(str::to_owned).collect())
        .unwrap_or_default();
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(ActivationError::AlreadyTaken);
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let raw = START + i;
        // Check the fd is open before owning it.
        if rustix::io::fcntl_getfd(
            // SAFETY: a borrow for the duration of this call only; fcntl on
            // a closed fd number fails with EBADF and touches nothing.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) },
        )
        .is_err()
        {
            return Err(ActivationError::Invalid(format!("fd {raw} is not open")));
        }
        // SAFETY: the service manager passed fds START..START+n to this
        // process (LISTEN_PID matched) and nothing else owns them; TAKEN
        // guarantees they are adopted once.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| ActivationError::Invalid(format!("fd {raw}: {e}")))?;
        out.push((names.get(i as usize).cloned().unwrap_or_default(), fd));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn nothing_passed_or_meant_for_another_process_is_empty() {
        assert!(take_listen_fds(env(&[])).unwrap().is_empty());
        let other = (std::process::id() + 1).to_string();
        let vars = [("LISTEN_PID", other.as_str()), ("LISTEN_FDS", "2")];
        assert!(take_listen_fds(env(&vars)).unwrap().is_empty());
    }

    #[test]
    fn malformed_variables_are_errors() {
        let me = std::process::id().to_string();
        for (pid, fds) in [("x", "1"), (me.as_str(), "many"), (me.as_str(), "-1")] {
            let vars = [("LISTEN_PID", pid), ("LISTEN_FDS", fds)];
            assert!(matches!(
                take_listen_fds(env(&vars)),
                Err(ActivationError::Invalid(_))
            ));
        }
    }
}
