//! `BucketTable`: a fixed-size hash table of `u32` positions in which a look-up, an insert and
//! a removal each touch one 64-byte cache line of the table in the common case — the table
//! under [`PositionTable`](crate::position_table), which resizes it incrementally.
//!
//! Why not `hashbrown` (used here before): its control bytes and its slots live in
//! two arrays, so a probe that reads a slot reads two cache lines far apart, a removal may
//! leave a tombstone that the table later rebuilds itself to clear, and nothing lets a caller
//! start the loads of many probes at once. The duplicate window pays an insert and, once full,
//! a removal for every finished message on every node: a visible share of the brokers' CPU per
//! message at the maximum rate (docs/bench/JOURNAL.md, "A moderate rate's CPU is not the thread
//! hand-offs"). Here a bucket is one cache line holding 12 slots: 12 one-byte tags (8 bits of
//! the hash; 0 marks a free slot), a count of the entries that passed this bucket because it
//! was full, and 12 positions.
//!
//! Collisions are resolved by linear probing over buckets: an entry goes in the first bucket
//! from its home (chosen by the hash) with a free slot, and every full bucket it passes counts
//! it. A search stops at the first bucket whose count is zero — no entry whose home is at or
//! before it lies beyond it — so there are no tombstones: a removal frees its slot and takes
//! its count back from the buckets it had passed. The table never grows on its own; its owner
//! keeps it at most 3/4 full ([`BucketTable::capacity`]) and moves entries to a larger one.
//!
//! The buckets come from a zeroed allocation (`vec![0u32; n]`, i.e. `calloc`: a large table's
//! pages are mapped and zeroed by the kernel as they are first touched, so creating one for a
//! resize does not stop the caller to clear megabytes), and start on a 64-byte boundary.

/// The most of its slots a table is filled to, `LOAD_NUM / LOAD_DEN`: 3/4. At that load, with
/// 12 slots per bucket and random homes, a search for a held key reads 1.05 buckets on average
/// and one for an absent key (every insert's check, every new PUT's duplicate check) 1.3; at
/// 7/8 the latter is 2.9 (simulated, 240,000 slots).
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;
/// Slots per bucket.
const SLOTS: usize = 12;
/// `u32` words per bucket: 3 of tags (12 bytes), 1 of overflow count, 12 of positions.
const WORDS: usize = 16;
/// Word of a bucket holding its overflow count.
const OVERFLOW: usize = 3;
/// Word of a bucket holding its first position.
const POSITIONS: usize = 4;
/// The 12 tag bytes of a bucket, as the low 96 bits of a `u128`.
const TAG_BYTES: u128 = (1 << 96) - 1;
const LOW7: u128 = 0x7f7f_7f7f_7f7f_7f7f_7f7f_7f7f;
const HIGH: u128 = 0x8080_8080_8080_8080_8080_8080;
const ONES: u128 = 0x0101_0101_0101_0101_0101_0101;

/// A hash table of `u32` positions in buckets of one cache line (see the module doc). Hashes
/// and key comparisons are the caller's: every method takes the hash of the key concerned and
/// an `eq` that says whether a held position holds that key.
#[derive(Debug, Default)]
pub(crate) struct BucketTable {
    /// The buckets, `WORDS` words each, from `base` on (`base` puts bucket 0 on a 64-byte
    /// boundary).
    words: Box<[u32]>,
    base: usize,
    buckets: usize,
    len: usize,
}

/// Bytes of `tags` equal to `tag`, as a mask with 0x80 in each such byte (exact: no carry
/// crosses a byte).
fn bytes_equal(tags: u128, tag: u8) -> u128 {
    let x = tags ^ (ONES * u128::from(tag));
    !(((x & LOW7) + LOW7) | x | LOW7) & HIGH
}

impl BucketTable {
    /// A table with room for at least `capacity` positions at 3/4 of its slots.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        if capacity == 0 {
            return Self::default();
        }
        let buckets = (capacity * LOAD_DEN).div_ceil(LOAD_NUM * SLOTS);
        // 15 words more than the buckets take, so that some word offset in 0..16 is on a
        // 64-byte boundary (the allocation is 4-byte aligned).
        let words = vec![0u32; buckets * WORDS + WORDS - 1].into_boxed_slice();
        let misalign = (words.as_ptr() as usize) % 64;
        let base = ((64 - misalign) % 64) / 4;
        Self {
            words,
            base,
            buckets,
            len: 0,
        }
    }

    /// Positions held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the table takes before its owner must move them to a larger one: 3/4 of its
    /// slots (0 for a table that allocated nothing).
    pub(crate) fn capacity(&self) -> usize {
        self.buckets * SLOTS * LOAD_NUM / LOAD_DEN
    }

    /// Bytes allocated.
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.words.len() * 4
    }

    /// The bucket a hash starts from, and the tag (never 0) its entry carries.
    fn home(&self, hash: u64) -> (usize, u8) {
        let bucket = ((u64::from(hash as u32) * self.buckets as u64) >> 32) as usize;
        (bucket, ((hash >> 56) as u8).max(1))
    }

    fn next(&self, bucket: usize) -> usize {
        if bucket + 1 == self.buckets {
            0
        } else {
            bucket + 1
        }
    }

    fn word(&self, bucket: usize, w: usize) -> u32 {
        self.words[self.base + bucket * WORDS + w]
    }

    fn word_mut(&mut self, bucket: usize, w: usize) -> &mut u32 {
        &mut self.words[self.base + bucket * WORDS + w]
    }

    fn tags(&self, bucket: usize) -> u128 {
        let at = self.base + bucket * WORDS;
        let w = &self.words[at..at + 3];
        u128::from(w[0]) | u128::from(w[1]) << 32 | u128::from(w[2]) << 64
    }

    /// The slots of `bucket` whose tag is `tag` (0: the free ones), as a mask with 0x80 in the
    /// byte of each.
    fn slots_tagged(&self, bucket: usize, tag: u8) -> u128 {
        bytes_equal(self.tags(bucket), tag) & TAG_BYTES
    }

    fn set_tag(&mut self, bucket: usize, slot: usize, tag: u8) {
        let shift = (slot % 4) * 8;
        let w = self.word_mut(bucket, slot / 4);
        *w = (*w & !(0xff << shift)) | u32::from(tag) << shift;
    }

    /// Where the position that `eq` accepts among those hashed to `hash` is: its bucket and
    /// slot.
    fn locate(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<(usize, usize)> {
        if self.len == 0 {
            return None;
        }
        let (mut bucket, tag) = self.home(hash);
        for _ in 0..self.buckets {
            let mut hits = self.slots_tagged(bucket, tag);
            while hits != 0 {
                let slot = hits.trailing_zeros() as usize / 8;
                if eq(self.word(bucket, POSITIONS + slot)) {
                    return Some((bucket, slot));
                }
                hits &= hits - 1;
            }
            if self.word(bucket, OVERFLOW) == 0 {
                return None;
            }
            bucket = self.next(bucket);
        }
        None
    }

    /// Reads the first word of the bucket a search for `hash` starts from, so that a caller
    /// with many hashes to look up can start all their cache misses before it needs any of
    /// them: loads that do not depend on each other are in flight together (a prefetch
    /// without `unsafe`). The caller folds the words it gets into one value and passes it to
    /// `std::hint::black_box`, so the loads are not optimised away.
    pub(crate) fn prefetch(&self, hash: u64) -> u32 {
        if self.buckets == 0 {
            return 0;
        }
        self.word(self.home(hash).0, 0)
    }

    /// The position that `eq` accepts among those hashed to `hash`.
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let (bucket, slot) = self.locate(hash, eq)?;
        Some(self.word(bucket, POSITIONS + slot))
    }

    /// The position that `eq` accepts among those hashed to `hash`, to change it (the new
    /// position must hold a key of the same hash).
    pub(crate) fn find_mut(&mut self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<&mut u32> {
        let (bucket, slot) = self.locate(hash, eq)?;
        Some(self.word_mut(bucket, POSITIONS + slot))
    }

    /// Removes the position that `eq` accepts among those hashed to `hash`, and takes its
    /// count back from the full buckets it had passed.
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let (at, slot) = self.locate(hash, eq)?;
        let position = self.word(at, POSITIONS + slot);
        self.set_tag(at, slot, 0);
        let mut bucket = self.home(hash).0;
        while bucket != at {
            let count = self.word_mut(bucket, OVERFLOW);
            debug_assert!(*count > 0, "an entry passed a bucket that did not count it");
            *count -= 1;
            bucket = self.next(bucket);
        }
        self.len -= 1;
        Some(position)
    }

    /// Adds `position` (its key hashes to `hash`; the caller checked that the key is not
    /// held). Panics when every slot is taken: the owner keeps the table at most
    /// [`BucketTable::capacity`] full.
    pub(crate) fn insert_unique(&mut self, hash: u64, position: u32) {
        assert!(
            self.len < self.buckets * SLOTS,
            "insert into a full bucket table of {} slots",
            self.buckets * SLOTS
        );
        let (mut bucket, tag) = self.home(hash);
        loop {
            let free = self.slots_tagged(bucket, 0);
            if free != 0 {
                let slot = free.trailing_zeros() as usize / 8;
                self.set_tag(bucket, slot, tag);
                *self.word_mut(bucket, POSITIONS + slot) = position;
                self.len += 1;
                return;
            }
            *self.word_mut(bucket, OVERFLOW) += 1;
            bucket = self.next(bucket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashMap;

    #[test]
    fn tags_match_exactly() {
        // Every byte value against every tag: the mask marks exactly the equal bytes of the
        // 12, whatever their neighbours (no carry from one byte into the next).
        for tag in 0..=255u8 {
            for v in 0..=255u8 {
                let tags = u128::from_le_bytes([
                    v, tag, 0xff, 0x80, 0, v, tag, 1, 0x7f, v, 0xfe, tag, 9, 9, 9, 9,
                ]);
                let mask = bytes_equal(tags, tag) & TAG_BYTES;
                for i in 0..12 {
                    let byte = tags.to_le_bytes()[i];
                    assert_eq!(mask >> (8 * i) & 0xff, if byte == tag { 0x80 } else { 0 });
                }
            }
        }
    }

    #[test]
    fn agrees_with_a_map_when_full_and_with_colliding_hashes() {
        // Positions keyed by hashes drawn from a small set (long chains of collisions across
        // buckets), from a large one, and all starting at the last bucket (chains that wrap
        // around), inserted up to every slot (beyond the 3/4 an owner fills) and removed in
        // random order: every look-up agrees with a HashMap, and once empty again every
        // bucket's overflow count is back at zero.
        for spread in [7u64, 1 << 40, 0] {
            let mut t = BucketTable::with_capacity(1_000);
            assert!(t.capacity() >= 1_000);
            assert_eq!((t.words.as_ptr() as usize + t.base * 4) % 64, 0, "aligned");
            let mut model: HashMap<u32, u64> = HashMap::new();
            let mut rng = ChaCha8Rng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
            let mut next = || rng.gen::<u64>();
            let hash_of = |p: u32, spread: u64| {
                if spread == 0 {
                    // Every home the last bucket: the chain wraps around to bucket 0.
                    return u64::from(p).wrapping_mul(0x2545_f491_4f6c_dd1d) << 32 | 0xffff_ffff;
                }
                let h = u64::from(p).wrapping_mul(0x2545_f491_4f6c_dd1d) % spread;
                h.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            };
            for round in 0..20 {
                while t.len() < t.buckets * SLOTS {
                    let p = (next() % 1_000_000) as u32;
                    let h = hash_of(p, spread);
                    if t.find(h, |q| q == p).is_none() {
                        t.insert_unique(h, p);
                        model.insert(p, h);
                    }
                }
                let keys: Vec<u32> = model.keys().copied().collect();
                for (i, &p) in keys.iter().enumerate() {
                    if (i as u64 + round).is_multiple_of(3) {
                        assert_eq!(t.remove(model[&p], |q| q == p), Some(p));
                        model.remove(&p);
                    }
                }
                assert_eq!(t.len(), model.len());
                for p in 0..2_000u32 {
                    let found = t.find(hash_of(p, spread), |q| q == p);
                    assert_eq!(found.is_some(), model.contains_key(&p), "position {p}");
                }
                for (&p, &h) in &model {
                    assert_eq!(t.find(h, |q| q == p), Some(p));
                }
            }
            for (p, h) in model.drain() {
                assert_eq!(t.remove(h, |q| q == p), Some(p));
            }
            assert!(t.is_empty());
            assert!((0..t.buckets).all(|b| t.word(b, OVERFLOW) == 0 && t.tags(b) == 0));
        }
    }

    #[test]
    fn find_mut_repoints_in_place() {
        // A position changed through find_mut is found under the new one, with the same hash.
        let mut t = BucketTable::with_capacity(16);
        t.insert_unique(42, 7);
        *t.find_mut(42, |p| p == 7).expect("held") = 9;
        assert_eq!(t.find(42, |p| p == 7), None);
        assert_eq!(t.find(42, |p| p == 9), Some(9));
        assert_eq!(t.remove(42, |p| p == 9), Some(9));
        assert!(t.is_empty() && t.find(42, |_| true).is_none());
    }
}
