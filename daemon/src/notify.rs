//! What the daemon tells its service manager (sd_notify(3), `Type=notify`):
//! READY=1 once the sockets and configuration are up, STATUS= with live
//! counts, WATCHDOG=1 from the routing loop (so a stuck loop is restarted),
//! RELOADING=1 with MONOTONIC_USEC then READY=1 around a reload, and
//! STOPPING=1. Every call is a no-op without `NOTIFY_SOCKET`.

use std::time::{Duration, Instant};

use sd_notify::NotifyState;
use tracing::debug;

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        debug!("sd_notify: {e}");
    }
}

/// The service is up.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A reload starts.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(_) => send(&[NotifyState::Reloading]),
    }
}

/// The service is shutting down.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// systemd's watchdog pings and status lines, at most as often as needed.
#[derive(Debug)]
pub struct Watchdog {
    watchdog: Option<Duration>,
    last_ping: Instant,
    last_status: Instant,
}

impl Default for Watchdog {
    fn default() -> Self {
        Watchdog {
            // Ping at half the interval systemd expects.
            watchdog: sd_notify::watchdog_enabled().map(|d| d / 2),
            last_ping: Instant::now(),
            last_status: Instant::now(),
        }
    }
}

impl Watchdog {
    /// Call from the routing loop: pings the watchdog when due and sends
    /// `status()` every few seconds.
    pub fn tick(&mut self, status: impl FnOnce() -> String) {
        if let Some(every) = self.watchdog
            && self.last_ping.elapsed() >= every
        {
            send(&[NotifyState::Watchdog]);
            self.last_ping = Instant::now();
        }
        if self.last_status.elapsed() >= Duration::from_secs(5) {
            send(&[NotifyState::Status(&status())]);
            self.last_status = Instant::now();
        }
    }
}
