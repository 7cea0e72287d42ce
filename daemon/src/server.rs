//! The routing thread behind `kvedge run`: one thread owns the [`Core`]
//! and drives it from one epoll set. Each turn reads the clock once, lets
//! the core handle its timeouts, asks the set which sockets are readable,
//! accepts and registers engines ([`crate::engines`]), drains their rings,
//! serves the query connections and their query channels
//! ([`crate::clients`]) and the jobs of drivers on other threads
//! ([`crate::jobs`]), then carries out what the core asked. With nothing
//! to do it sleeps in the same set, which also holds every ring's wake
//! eventfd; while bursts of work come closer together than
//! `daemon.spin_us`, it first polls for that long ([`Spin`]).

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use kvedge_config::Config;
use kvedge_core::metrics::LoopStats;
use kvedge_core::pacing::Gaps;
use kvedge_core::{Core, Output, ReloadError};
use kvedge_shm::Consumer;

use crate::clients::Clients;
use crate::engines::Engines;
use crate::jobs::{JobSender, Jobs};
pub use crate::listen::RuntimeDir;
use crate::poller::Poller;
use crate::reload::{Reloader, Reloads, Waiter};

/// How long the way out waits for slow readers to take their replies.
const DRAIN_WRITES: Duration = Duration::from_secs(1);
/// The longest sleep: the loop's tick (signals, watchdog) runs at least
/// this often.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Work without a pause this long counts as back-to-back arrivals ([`Spin`]).
const CONTINUOUS: Duration = Duration::from_millis(1);

/// The routing thread: the core and the drivers around it.
pub struct Server {
    core: Core,
    poller: Poller,
    engines: Engines,
    clients: Clients,
    /// Work from drivers on other threads, once any was connected.
    jobs: Option<Jobs>,
    /// A sender of that channel, cloned for each driver.
    job_tx: Option<JobSender>,
    /// Loads the configuration again (SIGHUP, `kvedge reload`).
    reloads: Reloads,
    /// The reload thread's eventfd is in the epoll set.
    reload_watched: bool,
    /// When the loop started (its tick counts milliseconds from here).
    started: Instant,
    /// Whether to poll before sleeping.
    spin: Spin,
}

/// Whether the loop polls for `daemon.spin_us` after a burst of work
/// before it sleeps. Polling spares the next request the wake-up from
/// sleep, but only if it comes within the spin: the loop spins only while
/// the idle gaps between bursts (from the last work of one to the first of
/// the next) have been, on average, shorter than the spin. Under paced
/// traffic (a gateway's ten requests a second, an engine's load reports)
/// and when idle it sleeps at once; back to back, it spins. How long a
/// burst lasts does not count, but work without a pause for a
/// millisecond counts as a gap of nothing: a loop kept busy by
/// back-to-back traffic learns that it comes back to back.
#[derive(Debug, Default)]
struct Spin {
    /// The idle gaps before bursts.
    gaps: Gaps,
    /// The last turn had nothing to do.
    idle: bool,
    /// When the last work was done.
    last_work: Option<Instant>,
    /// When the current stretch of work without a pause began, or was
    /// last counted as a gap of nothing.
    busy_since: Option<Instant>,
    /// Since when the loop has polled without work (the last work, or
    /// the end of the last sleep).
    polling_since: Option<Instant>,
    stats: LoopStats,
}

impl Spin {
    /// A turn at `now` found work or not; returns whether to sleep now.
    fn turn(&mut self, now: Instant, busy: bool, spin: Duration) -> bool {
        if busy {
            if self.idle || self.last_work.is_none() {
                if let Some(w) = self.last_work {
                    // Gaps longer than a few spins all mean "sleep".
                    self.gaps.record(now.saturating_duration_since(w), spin * 4);
                }
                self.stats.bursts += 1;
                self.busy_since = Some(now);
            } else if self
                .busy_since
                .is_some_and(|b| now.saturating_duration_since(b) >= CONTINUOUS)
            {
                self.gaps.record(Duration::ZERO, spin * 4);
                self.busy_since = Some(now);
            }
            self.stats.spinning = self.gaps.closer_than(spin);
            self.idle = false;
            self.last_work = Some(now);
            self.polling_since = Some(now);
            return false;
        }
        self.idle = true;
        self.stats.spinning = self.gaps.closer_than(spin);
        let spin_for = if self.stats.spinning {
            spin
        } else {
            Duration::ZERO
        };
        self.polling_since
            .is_none_or(|b| now.saturating_duration_since(b) >= spin_for)
    }

    /// The loop slept and woke at `now`.
    fn slept(&mut self, now: Instant) {
        self.stats.sleeps += 1;
        self.polling_since = Some(now);
    }

    fn stats(&self) -> LoopStats {
        LoopStats {
            mean_burst_gap_us: self
                .gaps
                .mean()
                .map_or(0, |m| u64::try_from(m.as_micros()).unwrap_or(u64::MAX)),
            ..self.stats
        }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("engines", &self.core.engines())
            .field("clients", &self.core.clients())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds both sockets in `dir` (created with `daemon.runtime_dir_mode`
    /// if missing; refused if another user owns it).
    pub fn bind(config: Config, dir: &RuntimeDir) -> io::Result<Server> {
        crate::listen::prepare_dir(&dir.dir, config.daemon.runtime_dir_mode())?;
        let control = crate::listen::bind(&dir.control())?;
        let query = crate::listen::bind(&dir.query())?;
        Server::from_listeners(config, control, query)
    }

    /// Serves on sockets bound elsewhere (socket activation).
    pub fn from_listeners(
        config: Config,
        control: UnixListener,
        query: UnixListener,
    ) -> io::Result<Server> {
        control.set_nonblocking(true)?;
        query.set_nonblocking(true)?;
        let poller = Poller::new()?;
        poller.watch(&control)?;
        poller.watch(&query)?;
        let now = Instant::now();
        Ok(Server {
            core: Core::new(config, now),
            poller,
            engines: Engines::new(control),
            clients: Clients::new(query),
            jobs: None,
            job_tx: None,
            reloads: Reloads::new(),
            reload_watched: false,
            started: now,
            spin: Spin::default(),
        })
    }

    /// The routing core (counters, workers, configuration).
    pub fn core(&self) -> &Core {
        &self.core
    }

    /// Sets how the configuration is loaded again (SIGHUP, `kvedge reload`).
    pub fn set_reloader(&mut self, reloader: Reloader) {
        self.reloads.set_reloader(reloader);
        self.reload_watched = false;
    }

    /// Starts loading the configuration again on the reload thread; once
    /// loaded, a valid one is applied at the start of a turn, an invalid
    /// one is logged and the old one keeps serving. Without a reloader
    /// the refusal is immediate.
    pub fn reload(&mut self) -> Result<(), ReloadError> {
        if !self.reloads.configured() {
            return self
                .core
                .handle_reload(Instant::now(), Err(ReloadError::NoConfigFile))
                .map(|_| ());
        }
        self.reloads.begin(Waiter::Signal).map_err(|(e, _)| {
            ReloadError::Invalid(kvedge_config::ConfigError {
                file: String::new(),
                message: format!("the reload could not start: {e}"),
            })
        })
    }

    /// A sender for a driver on another thread: its jobs are served by
    /// this loop from now on. Every driver shares the one channel.
    pub fn job_sender(&mut self) -> io::Result<JobSender> {
        if let Some(tx) = &self.job_tx {
            return Ok(tx.clone());
        }
        let (jobs, sender) = Jobs::new()?;
        self.poller.watch(jobs.wake_fd())?;
        self.jobs = Some(jobs);
        self.job_tx = Some(sender.clone());
        Ok(sender)
    }

    /// Hands the query socket to another driver (the io_uring listener):
    /// from now on its requests arrive through the returned sender.
    pub fn take_query_listener(&mut self) -> io::Result<Option<(UnixListener, JobSender)>> {
        let Some(query) = self.clients.take_listener() else {
            return Ok(None);
        };
        self.poller.unwatch(&query);
        let sender = match self.job_sender() {
            Ok(s) => s,
            Err(e) => {
                self.restore_query_listener(query)?;
                return Err(e);
            }
        };
        Ok(Some((query, sender)))
    }

    /// Gives the query socket back (the other driver could not start).
    pub fn restore_query_listener(&mut self, query: UnixListener) -> io::Result<()> {
        query.set_nonblocking(true)?;
        self.poller.watch(&query)?;
        self.clients.restore_listener(query);
        Ok(())
    }

    /// Runs until `stop` returns true (checked every loop).
    pub fn run(&mut self, mut stop: impl FnMut() -> bool) -> io::Result<()> {
        self.run_with(|_| stop())
    }

    /// Runs until `tick` returns true. `tick` is called about once a
    /// millisecond while busy and at least every 100 ms while idle, with
    /// the server, so it can reload, report status and ping a watchdog. On
    /// the way out, requests already received are answered (a drain).
    pub fn run_with(&mut self, mut tick: impl FnMut(&mut Server) -> bool) -> io::Result<()> {
        let mut last_tick = u128::MAX;
        loop {
            // The clock, read once a turn: perf showed clock reads at
            // about a tenth of a round trip when every step made its own.
            let now = Instant::now();
            let ms = now.saturating_duration_since(self.started).as_millis();
            if ms != last_tick {
                last_tick = ms;
                self.core.handle_loop_stats(self.spin.stats());
                if tick(self) {
                    break;
                }
            }
            // `daemon.spin_us` is read each turn, so a reload applies.
            let spin = Duration::from_micros(self.core.config().daemon.spin_us);
            let busy = self.turn(now);
            if self.spin.turn(now, busy, spin) {
                let until_due = self
                    .core
                    .poll_timeout()
                    .map_or(MAX_SLEEP, |t| t.saturating_duration_since(now));
                self.sleep(until_due.min(MAX_SLEEP));
                self.spin.slept(Instant::now());
            } else if !busy {
                // Yield, not spin on the CPU: a client this loop just
                // answered is often woken on this core, and would wait for
                // the spin to end (paced query-channel round trips measured
                // several times slower with a pure spin than yielding).
                std::thread::yield_now();
            }
        }
        // Drain: answer what the clients already sent (a turn serves at
        // most 32 requests per connection, so as many turns as that takes
        // while they are busy), and let slow readers take their replies;
        // a second at most for both.
        let draining = Instant::now();
        while self.turn(Instant::now()) && draining.elapsed() < DRAIN_WRITES {}
        self.clients.flush_all(
            &mut self.poller,
            DRAIN_WRITES.saturating_sub(draining.elapsed()),
        );
        Ok(())
    }

    /// One turn of the loop; returns whether anything happened.
    fn turn(&mut self, now: Instant) -> bool {
        if self.core.poll_timeout().is_some_and(|t| t <= now) {
            self.core.handle_timeout(now);
        }
        // One readiness check for every socket, instead of a system call
        // per socket per turn (accept, peek, read), which dominated latency.
        let p = &mut self.poller;
        p.check();
        let control_ready = p.take(self.engines.listener());
        let query_ready = self.clients.listener().is_some_and(|l| p.take(l.as_fd()));
        let jobs_ready = self.jobs.as_ref().is_some_and(|j| p.take(j.wake_fd()));
        self.engines.take_readiness(p);
        self.clients.take_readiness(p);

        let (core, poller) = (&mut self.core, &self.poller);
        let mut busy = false;
        // Hellos that arrived are read before new connections are
        // accepted: an accept may close the oldest pending connection, and
        // one whose Hello is already here must not be that one.
        busy |= self.engines.register(core, poller, now);
        if control_ready {
            busy |= self.engines.accept(core, poller, now);
        }
        if query_ready {
            busy |= self.clients.accept(core, poller, now);
        }
        busy |= self.engines.drain(core, poller, now);
        busy |= self.clients.serve(core, &mut self.reloads, poller, now);
        if jobs_ready && let Some(jobs) = &mut self.jobs {
            busy |= jobs.serve(core, &mut self.reloads, now);
        }
        busy |= self.finish_reload(now);
        self.carry_out(now);
        busy
    }

    /// Applies a reload the reload thread finished, and answers whoever
    /// asked for it.
    fn finish_reload(&mut self, now: Instant) -> bool {
        if !self.reload_watched
            && let Some(fd) = self.reloads.wake_fd()
        {
            self.reload_watched = self.poller.watch_wake(fd).is_ok();
        }
        let deliveries = self.reloads.poll(&mut self.core, now);
        let any = !deliveries.is_empty();
        for d in deliveries {
            match d.waiter {
                Waiter::Job { reply, .. } => reply(d.bytes),
                Waiter::Signal => {}
                w => self
                    .clients
                    .deliver(&w, &d.bytes, &self.poller, &mut self.core, now),
            }
        }
        any
    }

    /// Does what the core asked.
    fn carry_out(&mut self, now: Instant) {
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::Resync { engine, request } => {
                    self.engines
                        .send_resync(engine, &request, &mut self.core, now)
                }
                Output::CloseEngine(id) => {
                    self.engines.close(id, &mut self.core, &self.poller, now)
                }
                Output::CloseClient(id) => {
                    if !self.clients.close(id, &self.poller)
                        && let Some(jobs) = &mut self.jobs
                    {
                        jobs.close(id);
                    }
                }
            }
        }
    }

    /// Every ring this loop reads: the engines' and the query channels'
    /// request rings.
    fn rings(&mut self) -> impl Iterator<Item = &mut Consumer> {
        self.engines.rings().chain(self.clients.rings())
    }

    /// Sleeps in the epoll set for at most `timeout`, unless a ring
    /// received records meanwhile.
    fn sleep(&mut self, timeout: Duration) {
        // Records already waiting: no sleep, and no flag set (a producer
        // that sees a flag pays a system call to write the eventfd).
        if self.rings().any(|r| r.has_pending()) {
            return;
        }
        // Every ring's sleeping flag is set first, then one barrier serves
        // them all (a membarrier interrupts every CPU running an engine),
        // then each ring is checked for records that arrived meanwhile.
        let mut barrier = false;
        for ring in self.rings() {
            barrier |= ring.announce_sleep();
        }
        let barrier = barrier && kvedge_shm::ring::sleep_barrier();
        let mut pending = false;
        for ring in self.rings() {
            pending |= !ring.confirm_sleep(barrier);
        }
        if pending {
            for ring in self.rings() {
                ring.end_sleep();
            }
            return;
        }
        // Only the eventfds the sleep saw readable are read: a system call
        // per ring fewer on a wake-up by a socket, the clock or another
        // ring.
        self.poller.sleep(timeout);
        // The rings of `rings()`, borrowed field by field beside the poller.
        let poller = &self.poller;
        for ring in self.engines.rings().chain(self.clients.rings()) {
            if poller.woke(ring.wake_fd()) {
                ring.end_sleep();
            } else {
                ring.clear_sleep();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(200);

    /// Drives `s` through bursts of `busy_turns` turns 1 µs apart, each
    /// followed by idle turns 1 µs apart until the next burst `idle`
    /// later (or until it sleeps, which ends the idle stretch at once).
    /// Returns how many idle stretches ended in a sleep before the next
    /// burst.
    fn drive(
        s: &mut Spin,
        t: &mut Instant,
        bursts: usize,
        busy_turns: u32,
        idle: Duration,
    ) -> usize {
        let us = Duration::from_micros(1);
        let mut slept = 0;
        for _ in 0..bursts {
            for _ in 0..busy_turns {
                assert!(!s.turn(*t, true, SPIN));
                *t += us;
            }
            let next = *t + idle;
            while *t < next {
                if s.turn(*t, false, SPIN) {
                    slept += 1;
                    s.slept(next);
                    *t = next;
                    break;
                }
                *t += us;
            }
        }
        slept
    }

    #[test]
    fn back_to_back_bursts_are_spun_for_and_paced_ones_slept_through() {
        let mut s = Spin::default();
        let mut t = Instant::now();
        // Back to back: 20 µs between requests. After a few, the loop
        // polls through the gaps and never sleeps.
        drive(&mut s, &mut t, 10, 1, Duration::from_micros(20));
        assert_eq!(drive(&mut s, &mut t, 100, 1, Duration::from_micros(20)), 0);
        assert!(s.stats().spinning);

        // Paced, 10 ms apart: spinning stops after a burst or two, and
        // every gap is slept through.
        assert!(drive(&mut s, &mut t, 3, 1, Duration::from_millis(10)) >= 1);
        assert!(!s.stats().spinning);
        assert_eq!(drive(&mut s, &mut t, 20, 1, Duration::from_millis(10)), 20);
        let gap = s.stats().mean_burst_gap_us;
        assert!((790..=800).contains(&gap), "{gap} µs: capped at four spins");

        // Back to back again: spinning again within a few requests.
        drive(&mut s, &mut t, 8, 1, Duration::from_micros(20));
        assert!(s.stats().spinning);
        assert_eq!(s.stats().bursts, 141);
    }

    #[test]
    fn long_bursts_with_short_gaps_still_spin() {
        // Under back-to-back load a burst can last milliseconds: what
        // counts is the idle gap after it.
        let mut s = Spin::default();
        let mut t = Instant::now();
        drive(&mut s, &mut t, 10, 5_000, Duration::from_micros(30));
        assert!(s.stats().spinning, "{:?}", s.stats());
        assert_eq!(
            drive(&mut s, &mut t, 10, 5_000, Duration::from_micros(30)),
            0
        );
    }

    #[test]
    fn work_without_a_pause_counts_as_back_to_back() {
        // A client so fast that the loop never finds a turn without work:
        // after a few milliseconds of it, the loop would spin.
        let mut s = Spin::default();
        let mut t = Instant::now();
        drive(&mut s, &mut t, 3, 1, Duration::from_millis(10));
        assert!(!s.stats().spinning);
        drive(&mut s, &mut t, 1, 10_000, Duration::ZERO);
        assert!(s.stats().spinning, "{:?}", s.stats());
        // One request lasting a few microseconds never counts so.
        let mut s = Spin::default();
        drive(&mut s, &mut t, 20, 50, Duration::from_millis(10));
        assert!(!s.stats().spinning, "{:?}", s.stats());
    }

    #[test]
    fn without_a_spin_the_loop_sleeps_at_once() {
        let mut s = Spin::default();
        let mut t = Instant::now();
        assert!(s.turn(t, false, SPIN), "nothing done yet: sleep");
        t += Duration::from_micros(5);
        assert!(!s.turn(t, true, Duration::ZERO));
        assert!(s.turn(t, false, Duration::ZERO));
    }
}
