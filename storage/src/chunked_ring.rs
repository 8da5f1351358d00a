//! `ChunkedRing`: a first-in first-out ring of `Copy` values in fixed chunks of [`CHUNK`], for
//! the duplicate window's GUIDs ([`crate::guid_window`]).
//!
//! A `VecDeque` grows by doubling, and a doubling copies everything held: at the window's
//! default bound of 1,000,000 GUIDs the step from 524,288 to 1,048,576 moved 8 MiB on the
//! partition's thread in one insert, and after a lull had shrunk the ring the next burst paid
//! it again. Here pushing at the back never moves what is held: a full last chunk gets a new
//! one after it; popping at the front frees the first chunk once it is used up. So memory
//! follows the length (one chunk of slack at each end, and one spare chunk kept to spare the
//! allocator a chunk per [`CHUNK`] values under steady traffic), with no shrink step.
//! Element `i` is `chunks[(head + i) / CHUNK][(head + i) % CHUNK]`.

use std::collections::VecDeque;

/// Values per chunk: 16 KiB of `u128`s.
pub(crate) const CHUNK: usize = 1024;

/// A FIFO ring in fixed chunks (see the module doc).
#[derive(Debug)]
pub(crate) struct ChunkedRing<T: Copy> {
    /// Every chunk but the last is full (`CHUNK` values); the first one's values before
    /// `head` have left.
    chunks: VecDeque<Vec<T>>,
    /// Index in the first chunk of the front value.
    head: usize,
    len: usize,
    /// An emptied chunk kept for the next push that needs one.
    spare: Option<Vec<T>>,
}

impl<T: Copy> Default for ChunkedRing<T> {
    fn default() -> Self {
        ChunkedRing {
            chunks: VecDeque::new(),
            head: 0,
            len: 0,
            spare: None,
        }
    }
}

impl<T: Copy> ChunkedRing<T> {
    /// Values held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `value` at the back. O(1); allocates one chunk every [`CHUNK`] pushes at most.
    pub(crate) fn push_back(&mut self, value: T) {
        if self.chunks.back().is_none_or(|c| c.len() == CHUNK) {
            let chunk = self
                .spare
                .take()
                .unwrap_or_else(|| Vec::with_capacity(CHUNK));
            self.chunks.push_back(chunk);
        }
        self.chunks.back_mut().expect("a chunk").push(value);
        self.len += 1;
    }

    /// Removes and returns the front value. O(1); a used-up chunk becomes the spare (the one
    /// before is freed).
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let value = self.chunks[0][self.head];
        self.head += 1;
        self.len -= 1;
        if self.head == CHUNK || self.len == 0 {
            // Used up (or the ring is empty: its only chunk starts over).
            let mut chunk = self.chunks.pop_front().expect("a chunk");
            chunk.clear();
            self.spare = Some(chunk);
            self.head = 0;
            // The list of chunks (24 bytes a chunk) follows the length too, amortised O(1).
            let listed = self.chunks.len();
            if self.chunks.capacity() > 64 && self.chunks.capacity() / 4 > listed {
                self.chunks.shrink_to((2 * listed).max(64));
            }
        }
        Some(value)
    }

    /// Bytes of the chunks allocated (capacity, not length), the spare and the chunk list.
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        let chunks = self.chunks.len() + usize::from(self.spare.is_some());
        chunks * CHUNK * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T: Copy> std::ops::Index<usize> for ChunkedRing<T> {
    type Output = T;

    /// The value at `i` from the front. Panics when `i >= len`.
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "index {i} beyond {}", self.len);
        let at = self.head + i;
        &self.chunks[at / CHUNK][at % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_a_vecdeque_through_growth_and_drain() {
        // Pushes and pops in uneven runs across many chunk boundaries, against a VecDeque.
        let mut ring = ChunkedRing::default();
        let mut model = VecDeque::new();
        let mut next = 0u64;
        for round in 0..40usize {
            for _ in 0..(round * 397) % 5000 + 1 {
                ring.push_back(next);
                model.push_back(next);
                next += 1;
            }
            for _ in 0..(round * 631) % 5200 {
                assert_eq!(ring.pop_front(), model.pop_front());
            }
            assert_eq!(ring.len(), model.len());
            for i in (0..model.len()).step_by(97) {
                assert_eq!(ring[i], model[i]);
            }
            if let Some(last) = model.back() {
                assert_eq!(ring[model.len() - 1], *last);
            }
        }
        while let Some(v) = model.pop_front() {
            assert_eq!(ring.pop_front(), Some(v));
        }
        assert_eq!(ring.pop_front(), None);
        assert_eq!(ring.len(), 0);
    }

    #[test]
    fn memory_follows_the_length() {
        // 1,000,000 values take their own size plus at most two chunks; drained, only the
        // spare chunk and the chunk list remain.
        let mut ring = ChunkedRing::<u128>::default();
        for v in 0..1_000_000u128 {
            ring.push_back(v);
        }
        let held = 1_000_000 * 16;
        let list = ring.chunks.capacity() * std::mem::size_of::<Vec<u128>>();
        assert!(ring.allocated_bytes() <= held + 2 * CHUNK * 16 + list);
        for v in 0..1_000_000u128 {
            assert_eq!(ring.pop_front(), Some(v));
        }
        let list = 64 * std::mem::size_of::<Vec<u128>>();
        assert_eq!(ring.allocated_bytes(), CHUNK * 16 + list);
        // Refilled from empty, the spare is used first.
        ring.push_back(7);
        assert_eq!(ring.allocated_bytes(), CHUNK * 16 + list);
        assert_eq!(ring[0], 7);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn indexing_past_the_end_panics() {
        let mut ring = ChunkedRing::default();
        ring.push_back(1u8);
        let _ = ring[1];
    }
}
