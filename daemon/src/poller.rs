//! The routing thread's one epoll set: every socket (listeners, engine
//! control connections, clients, the jobs eventfd) keyed by its fd, and
//! every ring's wake eventfd keyed by its fd and a bit of its own. A busy
//! turn asks the set once, without waiting, which sockets are readable
//! (one system call whatever their number); an idle loop sleeps in the
//! same set, so a socket or a ring record wakes it, and notes which.

use std::cell::Cell;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::epoll;

/// Set in the epoll key of a ring's wake eventfd (beside its number): it
/// only ends a sleep, so readiness checks skip it, and a sleep notes which
/// one ended it, so that only that one is drained.
const WAKE_BIT: u64 = 1 << 63;

/// The epoll set and the readiness it last reported.
#[derive(Debug)]
pub(crate) struct Poller {
    epoll: OwnedFd,
    /// Readable at the last check, indexed by fd.
    ready: Vec<bool>,
    /// The last sleep's events are in `ready` already, so the check after
    /// it need not ask the set again.
    slept: bool,
    /// Wake eventfds readable when the last sleep ended, indexed by fd.
    woken: Vec<bool>,
    /// One past the highest fd ever watched: `ready` and `woken` grow to it
    /// before the next wait, so that the first readiness of a descriptor
    /// watched long ago (a client's ring, first woken under load) does not
    /// allocate on the served path.
    watched_end: Cell<usize>,
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        Ok(Poller {
            epoll: epoll::create(epoll::CreateFlags::CLOEXEC)?,
            ready: Vec::new(),
            slept: false,
            woken: Vec::new(),
            watched_end: Cell::new(0),
        })
    }

    /// Watches `fd` for readability (level-triggered), keyed by its number.
    pub fn watch(&self, fd: impl AsFd) -> io::Result<()> {
        let key = fd.as_fd().as_raw_fd() as u64;
        self.add(fd, key)
    }

    /// Watches a ring's wake eventfd: it only wakes a sleep. It must be
    /// removed explicitly ([`Poller::unwatch`]): the peer holds a copy of
    /// the eventfd, so closing ours does not take it out of the set.
    pub fn watch_wake(&self, fd: impl AsFd) -> io::Result<()> {
        let key = WAKE_BIT | fd.as_fd().as_raw_fd() as u64;
        self.add(fd, key)
    }

    fn add(&self, fd: impl AsFd, key: u64) -> io::Result<()> {
        let end = fd.as_fd().as_raw_fd() as usize + 1;
        self.watched_end.set(self.watched_end.get().max(end));
        epoll::add(
            &self.epoll,
            fd,
            epoll::EventData::new_u64(key),
            epoll::EventFlags::IN,
        )?;
        Ok(())
    }

    /// Watches socket `fd` (already watched) for writability as well, or
    /// no longer: a connection with unwritten output wakes the loop when
    /// its peer makes room, and is reported by [`Poller::take`].
    pub fn want_write(&self, fd: impl AsFd, on: bool) -> io::Result<()> {
        let key = fd.as_fd().as_raw_fd() as u64;
        let flags = if on {
            epoll::EventFlags::IN | epoll::EventFlags::OUT
        } else {
            epoll::EventFlags::IN
        };
        epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(key), flags)?;
        Ok(())
    }

    /// Stops watching `fd` (a socket or a wake eventfd).
    pub fn unwatch(&self, fd: impl AsFd) {
        let _ = epoll::delete(&self.epoll, fd);
    }

    /// Asks the set, without waiting, which sockets are readable (or hung
    /// up); [`Poller::take`] then reads the answer per socket. Right after
    /// [`Poller::sleep`], the sleep's answer stands instead.
    pub fn check(&mut self) {
        // Right after a sleep, what woke it is the answer: a system call
        // fewer per wake-up.
        if std::mem::take(&mut self.slept) {
            return;
        }
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        self.wait(&zero, false);
    }

    /// Waits for at most `timeout` and notes which sockets are readable
    /// (and, with `wakes`, which wake eventfds). On the stack:
    /// `epoll::Event` carries a raw pointer, which would make a retained
    /// buffer (and so the server) not `Send`. Level triggered: fds beyond
    /// 256 ready ones are reported next time. EINTR reports nothing.
    fn wait(&mut self, timeout: &rustix::time::Timespec, wakes: bool) {
        let end = self.watched_end.get();
        for marks in [&mut self.ready, &mut self.woken] {
            if marks.len() < end {
                marks.resize(end, false);
            }
        }
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 256];
        if let Ok((events, _)) = epoll::wait(&self.epoll, &mut buf[..], Some(timeout)) {
            for ev in events.iter() {
                let key = ev.data.u64();
                let fd = (key & !WAKE_BIT) as usize;
                let marks = if key & WAKE_BIT == 0 {
                    &mut self.ready
                } else if wakes {
                    &mut self.woken
                } else {
                    continue;
                };
                if fd >= marks.len() {
                    marks.resize(fd + 1, false);
                }
                marks[fd] = true;
            }
        }
    }

    /// Whether `fd` was readable (or, when asked for, writable) at the
    /// last check (and forgets it).
    pub fn take(&mut self, fd: BorrowedFd<'_>) -> bool {
        self.ready
            .get_mut(fd.as_raw_fd() as usize)
            .is_some_and(|r| std::mem::replace(r, false))
    }

    /// Sleeps until a watched fd is readable or `timeout` passes, and
    /// notes what woke it: sockets for the next [`Poller::check`], wake
    /// eventfds for [`Poller::woke`].
    pub fn sleep(&mut self, timeout: Duration) {
        let ts = rustix::time::Timespec::try_from(timeout).unwrap_or(rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        });
        self.woken.fill(false);
        self.wait(&ts, true);
        self.slept = true;
    }

    /// Whether wake eventfd `fd` was readable when the last sleep ended
    /// (its counter needs draining).
    pub fn woke(&self, fd: BorrowedFd<'_>) -> bool {
        self.woken.get(fd.as_raw_fd() as usize).is_some_and(|&w| w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An eventfd with a number above every descriptor the poller has seen.
    fn high_eventfd(above: usize) -> OwnedFd {
        let mut fds = Vec::new();
        loop {
            let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
            if fd.as_raw_fd() as usize > above + 8 {
                return fd;
            }
            fds.push(fd);
        }
    }

    #[test]
    fn the_first_readiness_of_a_watched_descriptor_does_not_grow_the_marks() {
        let mut p = Poller::new().unwrap();
        let low = rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK).unwrap();
        p.watch(&low).unwrap();
        p.check();
        let (socket, wake) = (high_eventfd(p.ready.len()), high_eventfd(p.ready.len()));
        p.watch(&socket).unwrap();
        p.watch_wake(&wake).unwrap();
        // The next wait sizes the marks for both, with nothing ready yet.
        p.check();
        let sizes = (p.ready.capacity(), p.woken.capacity());
        rustix::io::write(&socket, &1u64.to_ne_bytes()).unwrap();
        rustix::io::write(&wake, &1u64.to_ne_bytes()).unwrap();
        p.sleep(Duration::from_secs(1));
        assert!(p.woke(wake.as_fd()));
        p.check();
        assert!(p.take(socket.as_fd()));
        assert!(!p.take(low.as_fd()));
        assert_eq!((p.ready.capacity(), p.woken.capacity()), sizes);
    }
}
