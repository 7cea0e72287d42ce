//! A first-in, first-out queue of `u64`s kept in fixed-size chunks: the KV
//! index's store-order queues. A `VecDeque` doubles by copying every
//! entry into a new array, and a queue of millions of hashes held the
//! routing thread for a long pause each time it did; here growing adds a
//! chunk, and only the small list of chunks is ever copied.

use std::collections::VecDeque;

/// Entries per chunk (8 KiB).
const CHUNK: usize = 1024;

type Chunk = Box<[u64; CHUNK]>;

#[derive(Debug, Default)]
pub(crate) struct ChunkQueue {
    /// Every chunk is full except, perhaps, the first (entries before
    /// `head` are gone) and the last.
    chunks: VecDeque<Chunk>,
    /// Position of the first entry in the first chunk.
    head: usize,
    len: usize,
    /// One emptied chunk kept for the next push that needs one, so that a
    /// queue whose length holds steady does not allocate.
    spare: Option<Chunk>,
}

impl ChunkQueue {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Chunks held, the spare included.
    #[cfg(test)]
    pub(crate) fn chunks(&self) -> usize {
        self.chunks.len() + usize::from(self.spare.is_some())
    }

    pub(crate) fn push_back(&mut self, x: u64) {
        let at = self.head + self.len;
        if at == self.chunks.len() * CHUNK {
            let chunk = self.spare.take().unwrap_or_else(|| Box::new([0; CHUNK]));
            self.chunks.push_back(chunk);
        }
        self.chunks[at / CHUNK][at % CHUNK] = x;
        self.len += 1;
    }

    pub(crate) fn pop_front(&mut self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let x = self.chunks[0][self.head];
        self.head += 1;
        self.len -= 1;
        if self.len == 0 {
            // Empty: the one chunk left is written again from its start.
            debug_assert_eq!(self.chunks.len(), 1);
            self.head = 0;
        } else if self.head == CHUNK {
            self.head = 0;
            self.spare = self.chunks.pop_front();
        }
        Some(x)
    }

    /// Entry `i` from the front.
    pub(crate) fn get(&self, i: usize) -> Option<u64> {
        (i < self.len).then(|| {
            let at = self.head + i;
            self.chunks[at / CHUNK][at % CHUNK]
        })
    }

    /// Sets entry `i` from the front (which must exist).
    pub(crate) fn set(&mut self, i: usize, x: u64) {
        assert!(i < self.len, "entry {i} of a queue of {}", self.len);
        let at = self.head + i;
        self.chunks[at / CHUNK][at % CHUNK] = x;
    }

    /// Keeps the first `n` entries.
    pub(crate) fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        self.len = n;
        let needed = if n == 0 {
            self.head = 0;
            self.chunks.len().min(1)
        } else {
            (self.head + n).div_ceil(CHUNK)
        };
        self.chunks.truncate(needed);
    }

    pub(crate) fn clear(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes, pops, truncations and in-place sets against a `VecDeque`,
    /// across many chunk boundaries.
    #[test]
    fn behaves_like_a_vecdeque() {
        let mut q = ChunkQueue::default();
        let mut model = VecDeque::new();
        let mut x = 0x1234_5678_u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000u64 {
            match next() % 100 {
                0..=54 => {
                    q.push_back(step);
                    model.push_back(step);
                }
                55..=97 => assert_eq!(q.pop_front(), model.pop_front(), "step {step}"),
                98 => {
                    let i = (next() as usize) % (model.len() + 1);
                    if i < model.len() {
                        q.set(i, !step);
                        model[i] = !step;
                    }
                }
                _ => {
                    let n = model.len() - (next() as usize) % (model.len().min(3000) + 1);
                    q.truncate(n);
                    model.truncate(n);
                }
            }
            assert_eq!(q.len(), model.len(), "step {step}");
            if step % 997 == 0 {
                for (i, &m) in model.iter().enumerate() {
                    assert_eq!(q.get(i), Some(m), "entry {i} at step {step}");
                }
                assert_eq!(q.get(model.len()), None);
                // No chunk more than the entries need, the spare and a
                // partly used first and last.
                assert!(q.chunks() <= model.len().div_ceil(CHUNK) + 2);
            }
        }
        while let Some(m) = model.pop_front() {
            assert_eq!(q.pop_front(), Some(m));
        }
        assert_eq!(q.pop_front(), None);
    }

    #[test]
    fn a_queue_of_steady_length_keeps_its_chunks() {
        let mut q = ChunkQueue::default();
        for i in 0..10 * CHUNK as u64 {
            q.push_back(i);
        }
        let held = q.chunks();
        for i in 0..100 * CHUNK as u64 {
            q.push_back(i);
            assert!(q.pop_front().is_some());
        }
        assert!(
            q.chunks() <= held + 1,
            "{} chunks, {held} before",
            q.chunks()
        );
    }
}
