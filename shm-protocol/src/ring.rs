//! The single-producer single-consumer byte ring over a [`Segment`].
//!
//! Positions are monotonically increasing byte counters; a record lives at
//! `pos & (capacity - 1)`. A record is a 16-byte header (`len | type | flags |
//! seq`) and its payload, padded to 16 bytes, and is never split: when it
//! would cross the end, the producer first writes a padding record up to the
//! end. The producer commits by a release store of `tail` after writing the
//! bytes, so a producer killed mid-write leaves nothing visible.
//!
//! The producer never blocks: on a full ring it drops the record, counts it in
//! the header's `dropped` line and still consumes a sequence number, so the
//! consumer sees a gap of exactly the dropped records.
//!
//! The consumer treats the whole segment as hostile. It keeps its own head,
//! validates every tail it loads and every record header it reads, copies a
//! record out of shared memory (with atomic word loads, never through a
//! reference to shared bytes) into an aligned buffer it owns, and only then
//! hands it on. Any framing violation poisons the ring with a [`RingError`];
//! it never reads outside the data area, panics or loops unboundedly.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering, compiler_fence, fence};
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags};

use crate::error::{RingError, SegmentError};
use crate::layout::{
    CONSUMER_FORCE_FENCE, CONSUMER_SLEEPING, PADDING_TYPE, PRODUCER_ASYMMETRIC_FENCE,
    RECORD_HEADER_SIZE, RecordHeader, max_payload, record_footprint,
};
use crate::segment::Segment;

/// What happened to one pushed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    /// The record is visible to the consumer.
    Committed { seq: u64 },
    /// The ring was full: the record was dropped and `seq` is a gap.
    Dropped { seq: u64 },
}

/// A push the producer refused outright (caller bug); no sequence number used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("payload of {len} bytes exceeds the ring's record limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("record type {0:#x} is reserved for ring padding")]
    ReservedType(u16),
}

/// How a producer orders each commit against the consumer's going to
/// sleep (the Dekker pair in [`Producer::try_push`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fencing {
    /// A compiler fence per commit, when the kernel allows: the consumer
    /// runs `membarrier(GLOBAL_EXPEDITED)` before it sleeps, which
    /// interrupts every CPU running the producer's process. For a producer
    /// that commits far more often than the consumer sleeps: an engine.
    #[default]
    Asymmetric,
    /// A full fence per commit (a few nanoseconds), and no barrier for
    /// the consumer to run. For a producer that commits about as often as
    /// the consumer sleeps: a bridge relaying an engine's events and load,
    /// where every membarrier would cost more than the fences it saves.
    Full,
}

/// The writing end. Owned by exactly one thread of the engine process.
#[derive(Debug)]
pub struct Producer {
    seg: Segment,
    wake: Option<OwnedFd>,
    capacity: u64,
    tail: u64,
    head_cache: u64,
    next_seq: u64,
    dropped: u64,
    /// Commits that found the consumer asleep and wrote its eventfd.
    wakes: u64,
    max_payload: usize,
    /// Set when the consumer published an impossible head; from then on every
    /// record is dropped (the daemon will notice the silence or the gap).
    consumer_broken: bool,
    /// Publishing with a compiler fence only (see `try_push`).
    asymmetric: bool,
}

impl Producer {
    /// Takes the producer side of a validated segment. `wake` is the eventfd
    /// the consumer sleeps on, if any. Commits are fenced asymmetrically
    /// where the kernel allows ([`Fencing::Asymmetric`]).
    pub fn new(seg: Segment, wake: Option<OwnedFd>) -> Result<Self, SegmentError> {
        Self::with_fencing(seg, wake, Fencing::Asymmetric)
    }

    /// [`Producer::new`], with commits fenced as `fencing` says. Chosen
    /// once, before the first commit: the consumer reads the choice from
    /// the segment's header each time it goes to sleep.
    pub fn with_fencing(
        seg: Segment,
        wake: Option<OwnedFd>,
        fencing: Fencing,
    ) -> Result<Self, SegmentError> {
        let h = seg.header();
        let tail = h.tail.0.load(Ordering::Acquire);
        let head = h.head.0.load(Ordering::Acquire);
        if tail != 0 || head != 0 {
            return Err(SegmentError::NotFresh { tail, head });
        }
        h.identity
            .0
            .producer_pid
            .store(std::process::id(), Ordering::Relaxed);
        // With the process registered, the consumer's membarrier before it
        // sleeps stands in for our full fence after every commit.
        let asymmetric = fencing == Fencing::Asymmetric
            && rustix::thread::membarrier(
                rustix::thread::MembarrierCommand::RegisterGlobalExpedited,
            )
            .is_ok();
        h.identity.0.producer_flags.store(
            if asymmetric {
                PRODUCER_ASYMMETRIC_FENCE
            } else {
                0
            },
            Ordering::Release,
        );
        let capacity = seg.capacity();
        Ok(Producer {
            max_payload: max_payload(capacity),
            seg,
            wake,
            capacity,
            tail: 0,
            head_cache: 0,
            next_seq: 0,
            dropped: 0,
            wakes: 0,
            consumer_broken: false,
            asymmetric,
        })
    }

    /// Largest payload this ring accepts.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// The segment's memfd (a daemon that creates a ring it writes hands
    /// this to the reading side).
    pub fn segment_fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }

    /// The eventfd this producer signals when the consumer sleeps.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.wake.as_ref().map(|w| w.as_fd())
    }

    /// Sequence number the next push will carry.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Whether commits are published with a compiler fence only (the
    /// process is registered for expedited global membarriers and the
    /// consumer has not asked for full fences).
    pub fn asymmetric_fence(&self) -> bool {
        self.asymmetric
    }

    /// Records dropped so far because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Commits so far that found the consumer asleep and woke it (wrote its
    /// eventfd). A caller that waits for an answer compares it before and
    /// after a push to learn whether it has just woken the consumer, which
    /// the kernel then tends to run on the caller's CPU.
    pub fn wakes(&self) -> u64 {
        self.wakes
    }

    /// The attach epoch the daemon wrote into the segment.
    pub fn attach_epoch(&self) -> u64 {
        self.seg.attach_epoch()
    }

    /// The CPU the consumer last published as its own
    /// ([`Consumer::publish_cpu`]), if any. A hint: it may have moved
    /// since, and the consumer may write anything there.
    pub fn consumer_cpu(&self) -> Option<usize> {
        match self.seg.header().consumer_cpu.0.load(Ordering::Relaxed) {
            0 => None,
            cpu => Some(cpu as usize - 1),
        }
    }

    /// Appends one record, never blocking. Wakes the consumer only when it
    /// announced it is going to sleep.
    pub fn try_push(&mut self, kind: u16, flags: u16, payload: &[u8]) -> Result<Push, PushError> {
        if kind == PADDING_TYPE {
            return Err(PushError::ReservedType(kind));
        }
        if payload.len() > self.max_payload {
            return Err(PushError::TooLarge {
                len: payload.len(),
                limit: self.max_payload,
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let total = record_footprint(payload.len()) as u64;
        let idx = self.tail & (self.capacity - 1);
        let to_end = self.capacity - idx;
        let needed = if total <= to_end {
            total
        } else {
            to_end + total
        };
        if !self.has_room(needed) {
            self.dropped += 1;
            self.seg
                .header()
                .dropped
                .0
                .store(self.dropped, Ordering::Relaxed);
            return Ok(Push::Dropped { seq });
        }
        let mut idx = idx;
        if total > to_end {
            let pad = RecordHeader {
                len: (to_end - RECORD_HEADER_SIZE as u64) as u32,
                kind: PADDING_TYPE,
                flags: 0,
                seq: 0,
            };
            self.write_header(idx, pad);
            self.tail += to_end;
            idx = 0;
        }
        let header = RecordHeader {
            len: payload.len() as u32,
            kind,
            flags,
            seq,
        };
        self.write_header(idx, header);
        // SAFETY: idx + total <= capacity was established above (the record
        // fits before the end), so the payload lies inside the data area; the
        // region [tail, tail + needed) is not readable by the consumer until
        // the tail store below, and `payload` is a separate heap/stack slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                payload.as_ptr(),
                self.seg.data_ptr().add(idx as usize + RECORD_HEADER_SIZE),
                payload.len(),
            );
        }
        self.tail += total;
        let h = self.seg.header();
        h.tail.0.store(self.tail, Ordering::Release);
        // Dekker with the consumer's `prepare_sleep`: either it sees our tail
        // or we see its sleeping flag. Symmetric form: a full fence on each
        // side. Asymmetric form: only a compiler fence here, because before
        // it sleeps the consumer runs membarrier(GLOBAL_EXPEDITED), which
        // executes a full barrier on every CPU running this process. A full
        // fence costs a store-buffer drain per record, which across cores
        // waits for the record's cache lines to be fetched.
        let mut state = if self.asymmetric {
            compiler_fence(Ordering::SeqCst);
            h.consumer_sleeping.0.load(Ordering::Relaxed)
        } else {
            fence(Ordering::SeqCst);
            h.consumer_sleeping.0.load(Ordering::Relaxed)
        };
        if self.asymmetric && state & CONSUMER_FORCE_FENCE != 0 {
            self.asymmetric = false;
            fence(Ordering::SeqCst);
            state = h.consumer_sleeping.0.load(Ordering::Relaxed);
        }
        if state & CONSUMER_SLEEPING != 0 {
            self.wake();
        }
        Ok(Push::Committed { seq })
    }

    /// The shared segment (for inspection, and for tests that play a
    /// hostile producer through [`crate::fuzzing`]).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Whether a record of `len` payload bytes would be committed now,
    /// without pushing it (no sequence number is used). False for ever
    /// once the consumer broke the ring's invariants.
    pub fn has_room_for(&mut self, len: usize) -> bool {
        let total = record_footprint(len) as u64;
        let to_end = self.capacity - (self.tail & (self.capacity - 1));
        let needed = if total <= to_end {
            total
        } else {
            to_end + total
        };
        self.has_room(needed)
    }

    /// The consumer moved its head where no consumer could: the ring is
    /// unusable and every push is dropped.
    pub fn consumer_broken(&self) -> bool {
        self.consumer_broken
    }

    fn has_room(&mut self, needed: u64) -> bool {
        if self.consumer_broken {
            return false;
        }
        if self.capacity - (self.tail - self.head_cache) >= needed {
            return true;
        }
        let head = self.seg.header().head.0.load(Ordering::Acquire);
        if head < self.head_cache || head > self.tail {
            self.consumer_broken = true;
            return false;
        }
        self.head_cache = head;
        self.capacity - (self.tail - head) >= needed
    }

    fn write_header(&mut self, idx: u64, h: RecordHeader) {
        // SAFETY: idx is 16-aligned and idx + 16 <= capacity (records and
        // padding always start on 16-byte boundaries of a power-of-two area of
        // at least 4096 bytes), so both words are inside the data area and
        // 8-aligned; the consumer does not read them before the tail store.
        unsafe {
            let p = self.seg.data_ptr().add(idx as usize).cast::<u64>();
            p.write(h.word0().to_le());
            p.add(1).write(h.seq.to_le());
        }
    }

    fn wake(&mut self) {
        if let Some(fd) = &self.wake {
            self.wakes += 1;
            // A full eventfd counter (EAGAIN) already means "wake up"; any
            // other error cannot be acted on without blocking the engine.
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }
}

/// A non-blocking, close-on-exec eventfd: what a sleeping consumer waits on.
pub fn wake_eventfd() -> Result<OwnedFd, SegmentError> {
    rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
        .map_err(|e| SegmentError::os("eventfd", e))
}

/// The consumer's half of the wake-up handshake with producers that
/// publish with a compiler fence only: `membarrier(GLOBAL_EXPEDITED)`, a
/// full barrier on every CPU running a registered process. One call serves
/// every ring whose flag was set before it ([`Consumer::announce_sleep`]).
/// Returns whether it ran.
pub fn sleep_barrier() -> bool {
    rustix::thread::membarrier(rustix::thread::MembarrierCommand::GlobalExpedited).is_ok()
}

/// One record handed out by [`Consumer::poll`], borrowed from the consumer's
/// private buffer (not from shared memory).
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u64,
    /// Records the producer dropped between the previous record and this one.
    pub missing_before: u64,
    pub payload: &'a [u8],
}

/// The reading end, owned by the daemon.
#[derive(Debug)]
pub struct Consumer {
    seg: Segment,
    wake: OwnedFd,
    capacity: u64,
    head: u64,
    /// The head value last stored in the shared header. The consumer
    /// publishes its head once per `publish_stride` bytes (and whenever it
    /// runs dry), not once per record: each store pulls the head's cache line
    /// away from a producer that is polling it for room, and across cores that
    /// transfer costs more than the record itself.
    head_published: u64,
    publish_stride: u64,
    tail_cache: u64,
    expected_seq: u64,
    missing_total: u64,
    max_payload: usize,
    buf: Vec<u128>,
    poisoned: Option<RingError>,
    /// Our membarrier failed: the producer was told to fence for itself.
    force_fence: bool,
}

impl Consumer {
    /// Creates a fresh segment and its wake eventfd.
    pub fn create(capacity: u64, attach_epoch: u64) -> Result<Self, SegmentError> {
        let seg = Segment::create(capacity, attach_epoch)?;
        Ok(Self::over(seg, wake_eventfd()?))
    }

    /// The reading end of a ring the other side created (a query
    /// channel's reply ring, written by the daemon): `seg` already passed
    /// [`Segment::open`]'s checks; it must be fresh.
    pub fn open(seg: Segment, wake: OwnedFd) -> Result<Self, SegmentError> {
        let h = seg.header();
        let tail = h.tail.0.load(Ordering::Acquire);
        let head = h.head.0.load(Ordering::Acquire);
        if tail != 0 || head != 0 {
            return Err(SegmentError::NotFresh { tail, head });
        }
        Ok(Self::over(seg, wake))
    }

    fn over(seg: Segment, wake: OwnedFd) -> Self {
        let capacity = seg.capacity();
        let max_payload = max_payload(capacity);
        Consumer {
            seg,
            wake,
            capacity,
            head: 0,
            head_published: 0,
            publish_stride: capacity / 8,
            tail_cache: 0,
            expected_seq: 0,
            missing_total: 0,
            max_payload,
            buf: vec![0; max_payload.div_ceil(16)],
            poisoned: None,
            force_fence: false,
        }
    }

    /// The segment's memfd, to hand to the producer.
    pub fn segment_fd(&self) -> BorrowedFd<'_> {
        self.seg.fd()
    }

    /// The eventfd the producer signals; register it with epoll to sleep.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    /// The segment itself (tests and tools inspect its header).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Total records reported missing in gaps so far.
    pub fn missing_total(&self) -> u64 {
        self.missing_total
    }

    /// The dropped count the producer claims in the header (untrusted; for
    /// reporting only).
    pub fn producer_dropped(&self) -> u64 {
        self.seg.header().dropped.0.load(Ordering::Relaxed)
    }

    /// Drops the producer has counted that no received record has reported
    /// as a gap yet: records dropped at the end of a burst, with nothing
    /// committed after them. Check it when the ring goes idle and resync if
    /// non-zero. Untrusted: a lying producer only earns itself a resync.
    pub fn unreported_drops(&self) -> u64 {
        self.producer_dropped().saturating_sub(self.missing_total)
    }

    /// The producer's pid as written at attach (untrusted).
    pub fn producer_pid(&self) -> u32 {
        self.seg
            .header()
            .identity
            .0
            .producer_pid
            .load(Ordering::Relaxed)
    }

    /// The error that poisoned this ring, if any.
    pub fn poisoned(&self) -> Option<&RingError> {
        self.poisoned.as_ref()
    }

    /// True when committed records are waiting (one acquire load).
    pub fn has_pending(&self) -> bool {
        self.head != self.seg.header().tail.0.load(Ordering::Acquire)
    }

    /// Returns the next record, `Ok(None)` when the ring is empty, or the
    /// error that makes this ring unusable (sticky).
    pub fn poll(&mut self) -> Result<Option<Record<'_>>, RingError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        match self.next_record() {
            Ok(Some((kind, flags, seq, missing, len))) => Ok(Some(Record {
                kind,
                flags,
                seq,
                missing_before: missing,
                payload: &bytemuck::cast_slice::<u128, u8>(&self.buf)[..len],
            })),
            Ok(None) => Ok(None),
            Err(e) => {
                self.poisoned = Some(e.clone());
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn next_record(&mut self) -> Result<Option<(u16, u16, u64, u64, usize)>, RingError> {
        // At most one padding record can precede a real one, so this loop
        // runs at most twice per call.
        for _ in 0..2 {
            if self.head == self.tail_cache && !self.refresh_tail()? {
                self.publish_head();
                return Ok(None);
            }
            let available = self.tail_cache - self.head;
            let idx = self.head & (self.capacity - 1);
            let base = self.seg.data_ptr();
            // SAFETY: idx is 16-aligned (head only advances by multiples of
            // 16) and idx + 16 <= capacity, so both words are in the data area
            // and 8-aligned; AtomicU64 accepts any bits the producer wrote.
            let (w0, seq) = unsafe {
                let p = base.add(idx as usize).cast::<u64>();
                (
                    AtomicU64::from_ptr(p).load(Ordering::Relaxed),
                    AtomicU64::from_ptr(p.add(1)).load(Ordering::Relaxed),
                )
            };
            let h = RecordHeader::from_words(u64::from_le(w0), u64::from_le(seq));
            let len = u64::from(h.len);
            let pos = self.head;
            let to_end = self.capacity - idx;
            if h.kind == PADDING_TYPE {
                if len + RECORD_HEADER_SIZE as u64 != to_end || to_end > available {
                    return Err(RingError::BadPadding { pos });
                }
                self.advance(to_end);
                continue;
            }
            if len > self.max_payload as u64 {
                return Err(RingError::RecordTooLarge {
                    pos,
                    len,
                    limit: self.max_payload as u64,
                });
            }
            let total = record_footprint(len as usize) as u64;
            if total > to_end {
                return Err(RingError::RecordSplit { pos, len });
            }
            if total > available {
                return Err(RingError::RecordOverrun {
                    pos,
                    len,
                    available: available - RECORD_HEADER_SIZE as u64,
                });
            }
            if h.seq < self.expected_seq {
                return Err(RingError::SequenceRegression {
                    expected: self.expected_seq,
                    found: h.seq,
                });
            }
            // u64::MAX can never be a real sequence number (2^64 records),
            // and accepting it would overflow the next expected one.
            let next = h.seq.checked_add(1).ok_or(RingError::SequenceExhausted)?;
            let missing = h.seq - self.expected_seq;
            self.expected_seq = next;
            self.missing_total = self.missing_total.saturating_add(missing);
            let words = (len as usize).div_ceil(8);
            let dst = bytemuck::cast_slice_mut::<u128, u64>(&mut self.buf);
            // SAFETY: the payload starts 16 bytes after idx and `words * 8 <=
            // total - 16`, so every word read lies inside this record, which
            // lies inside the data area (checked above); `words <=
            // max_payload / 8 + 1 <= dst.len()` since buf holds
            // max_payload rounded up to 16. Reads are atomic, so concurrent
            // rewrites by a hostile producer only change the values we copy.
            unsafe {
                let src = base.add(idx as usize + RECORD_HEADER_SIZE).cast::<u64>();
                for (i, d) in dst[..words].iter_mut().enumerate() {
                    *d = AtomicU64::from_ptr(src.add(i)).load(Ordering::Relaxed);
                }
            }
            self.advance(total);
            return Ok(Some((h.kind, h.flags, h.seq, missing, len as usize)));
        }
        Ok(None)
    }

    fn refresh_tail(&mut self) -> Result<bool, RingError> {
        let tail = self.seg.header().tail.0.load(Ordering::Acquire);
        if !tail.is_multiple_of(16) {
            return Err(RingError::TailMisaligned(tail));
        }
        if tail < self.head || tail - self.head > self.capacity {
            return Err(RingError::TailOutOfRange {
                tail,
                head: self.head,
                capacity: self.capacity,
            });
        }
        self.tail_cache = tail;
        Ok(tail != self.head)
    }

    fn advance(&mut self, by: u64) {
        self.head += by;
        if self.head - self.head_published >= self.publish_stride {
            self.publish_head();
        }
    }

    /// Hands the space consumed so far back to the producer.
    fn publish_head(&mut self) {
        if self.head != self.head_published {
            self.head_published = self.head;
            self.seg.header().head.0.store(self.head, Ordering::Release);
        }
    }

    /// Tells the producer which CPU this consumer runs on (a hint it reads
    /// with [`Producer::consumer_cpu`]); a CPU number beyond `u32` is
    /// published as none.
    pub fn publish_cpu(&self, cpu: usize) {
        let value = u32::try_from(cpu)
            .ok()
            .and_then(|c| c.checked_add(1))
            .unwrap_or(0);
        self.seg
            .header()
            .consumer_cpu
            .0
            .store(value, Ordering::Relaxed);
    }

    /// Announces that the consumer is about to sleep. Returns `false` (and
    /// clears the flag) when records arrived meanwhile, so the caller must
    /// not sleep. After sleeping, call [`Consumer::end_sleep`]. A caller
    /// sleeping on several rings at once uses [`Consumer::announce_sleep`],
    /// one [`sleep_barrier`] and [`Consumer::confirm_sleep`] instead, so
    /// that one barrier serves them all.
    pub fn prepare_sleep(&mut self) -> bool {
        let barrier = self.announce_sleep() && sleep_barrier();
        self.confirm_sleep(barrier)
    }

    /// The first half of [`Consumer::prepare_sleep`]: hands space back and
    /// sets the sleeping flag. Returns whether the producer relies on the
    /// consumer's barrier ([`sleep_barrier`]) before [`Consumer::confirm_sleep`].
    pub fn announce_sleep(&mut self) -> bool {
        self.publish_head();
        let h = self.seg.header();
        h.consumer_sleeping
            .0
            .store(CONSUMER_SLEEPING | self.force_bits(), Ordering::Relaxed);
        self.relies_on_barrier()
    }

    /// Whether the producer publishes with a compiler fence only and so
    /// relies on the consumer's barrier for its half of the Dekker pair in
    /// `Producer::try_push` (the membarrier runs a real barrier on its CPU,
    /// and is a full fence for us).
    fn relies_on_barrier(&self) -> bool {
        let producer_flags = self
            .seg
            .header()
            .identity
            .0
            .producer_flags
            .load(Ordering::Relaxed);
        producer_flags & PRODUCER_ASYMMETRIC_FENCE != 0 && !self.force_fence
    }

    /// The second half of [`Consumer::prepare_sleep`], after the flags of
    /// every ring the caller sleeps on are set and, if any of them asked
    /// for it, [`sleep_barrier`] ran (`barrier`: whether it succeeded).
    /// Returns `false` (and clears the flag) when records arrived, so the
    /// caller must not sleep.
    pub fn confirm_sleep(&mut self, barrier: bool) -> bool {
        let h = self.seg.header();
        // If the producer relies on our barrier and it did not run, tell
        // the producer to fence for itself from now on; until it reads
        // that, a wake-up can be late by at most the caller's sleep
        // timeout.
        if !barrier && self.relies_on_barrier() {
            self.force_fence = true;
            h.consumer_sleeping
                .0
                .store(CONSUMER_SLEEPING | CONSUMER_FORCE_FENCE, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        if self.has_pending() {
            h.consumer_sleeping
                .0
                .store(self.force_bits(), Ordering::Relaxed);
            return false;
        }
        true
    }

    fn force_bits(&self) -> u32 {
        if self.force_fence {
            CONSUMER_FORCE_FENCE
        } else {
            0
        }
    }

    /// Clears the sleeping flag and drains the eventfd counter.
    pub fn end_sleep(&mut self) {
        self.clear_sleep();
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut buf);
    }

    /// Clears the sleeping flag but leaves the eventfd as it is: for a
    /// caller whose sleep did not report this ring's eventfd readable,
    /// which saves a read. A producer that wrote the eventfd since leaves it
    /// readable, so the next sleep ends at once and drains it.
    pub fn clear_sleep(&mut self) {
        self.seg
            .header()
            .consumer_sleeping
            .0
            .store(self.force_bits(), Ordering::Relaxed);
    }

    /// Waits until records are pending or `timeout` passes: spins for
    /// `spin` first (cheap when the producer is busy), then sleeps on the
    /// eventfd. Returns whether records are pending.
    pub fn wait(&mut self, spin: Duration, timeout: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < spin {
            if self.has_pending() {
                return true;
            }
            std::hint::spin_loop();
        }
        if !self.prepare_sleep() {
            return true;
        }
        let remaining = timeout.saturating_sub(start.elapsed());
        let ts = rustix::time::Timespec::try_from(remaining).unwrap_or(rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        });
        let mut fds = [PollFd::new(&self.wake, PollFlags::IN)];
        let _ = rustix::event::poll(&mut fds, Some(&ts));
        self.end_sleep();
        self.has_pending()
    }
}
