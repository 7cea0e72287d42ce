//! Ring segments: a memfd created by the consumer, sealed so that neither side
//! can shrink or grow it (a shrink would turn the other side's next access
//! into SIGBUS), mapped shared, and validated by the producer before use.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;

use memmap2::{Advice, MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::error::SegmentError;
use crate::layout::{
    HEADER_SIZE, Header, MAGIC, MAX_CAPACITY, MIN_CAPACITY, VERSION_MAJOR, VERSION_MINOR,
    layout_hash,
};

/// Seals every segment carries before it is handed to a producer.
const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// A mapped ring segment. Owns the memfd and the mapping; the header and data
/// area live as long as this value.
#[derive(Debug)]
pub struct Segment {
    map: MmapRaw,
    fd: OwnedFd,
    capacity: u64,
}

impl Segment {
    /// Creates a fresh, sealed, zeroed segment with a data area of `capacity`
    /// bytes (a power of two) and writes its identity header.
    pub fn create(capacity: u64, attach_epoch: u64) -> Result<Self, SegmentError> {
        validate_capacity(capacity)?;
        let fd = rustix::fs::memfd_create(
            "kvedge-ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| SegmentError::os("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, HEADER_SIZE as u64 + capacity)
            .map_err(|e| SegmentError::os("ftruncate", e))?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS | SealFlags::SEAL)
            .map_err(|e| SegmentError::os("fcntl(F_ADD_SEALS)", e))?;
        let segment = Self::map(fd, capacity)?;
        let id = &segment.header().identity.0;
        id.version_major
            .store(VERSION_MAJOR.into(), Ordering::Relaxed);
        id.version_minor
            .store(VERSION_MINOR.into(), Ordering::Relaxed);
        id.layout_hash.store(layout_hash(), Ordering::Relaxed);
        id.capacity.store(capacity, Ordering::Relaxed);
        id.attach_epoch.store(attach_epoch, Ordering::Relaxed);
        // Magic last, with release: a reader that sees it sees the rest.
        id.magic.store(MAGIC, Ordering::Release);
        Ok(segment)
    }

    /// Maps a segment received from the other side and checks everything a
    /// producer must trust before writing into it: seals, size, magic,
    /// version, layout hash and capacity.
    pub fn open(fd: OwnedFd) -> Result<Self, SegmentError> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| SegmentError::os("fcntl(F_GET_SEALS)", e))?;
        if !seals.contains(REQUIRED_SEALS) {
            return Err(SegmentError::NotSealed(seals.bits()));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| SegmentError::os("fstat", e))?
            .st_size as u64;
        if size < HEADER_SIZE as u64 + MIN_CAPACITY {
            return Err(SegmentError::WrongSize {
                expected: HEADER_SIZE as u64 + MIN_CAPACITY,
                actual: size,
            });
        }
        // Map the header page alone first: the capacity it claims is
        // untrusted until checked against the real size.
        let probe = Self::map(fd, 0)?;
        let id = &probe.header().identity.0;
        let magic = id.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(SegmentError::BadMagic {
                found: magic,
                expected: MAGIC,
            });
        }
        let (major, minor) = (
            id.version_major.load(Ordering::Relaxed) as u16,
            id.version_minor.load(Ordering::Relaxed) as u16,
        );
        if major != VERSION_MAJOR {
            return Err(SegmentError::IncompatibleVersion {
                found_major: major,
                found_minor: minor,
                major: VERSION_MAJOR,
                minor: VERSION_MINOR,
            });
        }
        let found = id.layout_hash.load(Ordering::Relaxed);
        if found != layout_hash() {
            return Err(SegmentError::LayoutMismatch {
                found,
                expected: layout_hash(),
            });
        }
        let capacity = id.capacity.load(Ordering::Relaxed);
        validate_capacity(capacity)?;
        if size != HEADER_SIZE as u64 + capacity {
            return Err(SegmentError::WrongSize {
                expected: HEADER_SIZE as u64 + capacity,
                actual: size,
            });
        }
        Self::map(probe.fd, capacity)
    }

    fn map(fd: OwnedFd, capacity: u64) -> Result<Self, SegmentError> {
        let len = HEADER_SIZE + capacity as usize;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| SegmentError::os("mmap", e))?;
        if capacity > 0 {
            // Map every page, writable, now: each side's first write or
            // read of a page would otherwise take a page fault, in
            // a publish or an ingest, all through the first pass over the
            // ring. Best effort: kernels before 5.14 refuse the advice, and
            // then the pages are mapped as they are first touched.
            let _ = map.advise(Advice::PopulateWrite);
        }
        Ok(Segment { map, fd, capacity })
    }

    /// The header page.
    pub fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_SIZE bytes, page-aligned (so
        // aligned for Header's 128), lives as long as `self`, and every field
        // of Header is an atomic for which any bit pattern is valid; concurrent
        // writes by the other process go through atomics on our side.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }

    /// First byte of the data area (16-byte aligned, `capacity` bytes long).
    pub fn data_ptr(&self) -> *mut u8 {
        // SAFETY: HEADER_SIZE is within the mapping, whose length is
        // HEADER_SIZE + capacity.
        unsafe { self.map.as_mut_ptr().add(HEADER_SIZE) }
    }

    /// Bytes in the data area.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The memfd, to pass to the producer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The attach epoch written at creation.
    pub fn attach_epoch(&self) -> u64 {
        self.header()
            .identity
            .0
            .attach_epoch
            .load(Ordering::Relaxed)
    }
}

fn validate_capacity(capacity: u64) -> Result<(), SegmentError> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(SegmentError::InvalidCapacity(capacity));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::MemfdFlags;

    fn reopen(seg: &Segment) -> Result<Segment, SegmentError> {
        Segment::open(seg.fd().try_clone_to_owned().unwrap())
    }

    #[test]
    fn create_then_open_agrees() {
        let seg = Segment::create(1 << 16, 7).unwrap();
        let peer = reopen(&seg).unwrap();
        assert_eq!(peer.capacity(), 1 << 16);
        assert_eq!(peer.attach_epoch(), 7);
    }

    #[test]
    fn invalid_capacities_are_refused() {
        for cap in [0, 1000, 2048, 3 << 12, MAX_CAPACITY * 2] {
            assert!(matches!(
                Segment::create(cap, 0),
                Err(SegmentError::InvalidCapacity(c)) if c == cap
            ));
        }
    }

    #[test]
    fn wrong_magic_version_layout_are_refused() {
        let seg = Segment::create(1 << 12, 0).unwrap();
        let id = &seg.header().identity.0;
        id.magic.store(0x1234, Ordering::Relaxed);
        let err = reopen(&seg).unwrap_err();
        assert!(
            matches!(err, SegmentError::BadMagic { found: 0x1234, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("not a kvedge ring"));
        id.magic.store(MAGIC, Ordering::Relaxed);

        id.version_major.store(2, Ordering::Relaxed);
        let err = reopen(&seg).unwrap_err();
        assert!(matches!(
            err,
            SegmentError::IncompatibleVersion { found_major: 2, .. }
        ));
        assert!(
            err.to_string()
                .contains(&format!("2.{VERSION_MINOR} is incompatible")),
            "{err}"
        );
        id.version_major
            .store(VERSION_MAJOR.into(), Ordering::Relaxed);

        id.layout_hash.store(1, Ordering::Relaxed);
        let err = reopen(&seg).unwrap_err();
        assert!(matches!(err, SegmentError::LayoutMismatch { found: 1, .. }));
        id.layout_hash.store(layout_hash(), Ordering::Relaxed);

        // A header claiming a larger ring than the file holds.
        id.capacity.store(1 << 13, Ordering::Relaxed);
        let err = reopen(&seg).unwrap_err();
        assert!(matches!(err, SegmentError::WrongSize { expected, actual }
            if expected == 4096 + (1 << 13) && actual == 4096 + (1 << 12)));
        id.capacity.store(1 << 12, Ordering::Relaxed);
        reopen(&seg).unwrap();
    }

    #[test]
    fn unsealed_or_short_segments_are_refused() {
        let fd = rustix::fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096 + 4096).unwrap();
        assert!(matches!(
            Segment::open(fd.try_clone().unwrap()),
            Err(SegmentError::NotSealed(_))
        ));
        let fd = rustix::fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 100).unwrap();
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
        assert!(matches!(
            Segment::open(fd),
            Err(SegmentError::WrongSize { actual: 100, .. })
        ));
    }

    #[test]
    fn sealed_segment_cannot_shrink() {
        let seg = Segment::create(1 << 12, 0).unwrap();
        assert!(rustix::fs::ftruncate(seg.fd(), 10).is_err());
        assert!(rustix::fs::ftruncate(seg.fd(), 1 << 20).is_err());
    }
}
