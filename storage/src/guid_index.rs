//! `GuidIndex`: a map from message GUIDs to small values that takes little more memory than its
//! entries: the journal's index of outstanding messages (docs/bench/JOURNAL.md, "Storage for
//! months").
//!
//! A `HashMap<u128, V>` keeps its key and value in every bucket of a table that is between
//! 44% and 87% full, so for 1,000,000 GUIDs (2^21 buckets) with 32-byte values it takes 98 MiB,
//! twice what the entries hold. Here the entries are one dense vector (GUID and value side by
//! side, no gaps: a removal moves the last entry into the hole), kept in fixed chunks of 1,024
//! so that growing it never copies it, and the hash table holds only the 4-byte position of
//! each entry (a [`PositionTable`], hashing the GUID it points at): 1,000,000 GUIDs with
//! 32-byte values take 48 MB of entries (plus at most two chunks) and 8 MiB of table (12 MiB
//! while a resize runs).
//! The chunks are freed as they empty and the table shrinks once it is less than a quarter
//! full, so memory follows what is held now, not the most ever held.
//!
//! The hash is foldhash's `quality::RandomState`, seeded at random per table: GUIDs are chosen
//! by producers, so a keyed hash keeps one that picks colliding GUIDs from slowing the table
//! down (foldhash rather than std's SipHash: the index and the duplicate window took ~5% of
//! the brokers' CPU with SipHash at 1,000,000 GUIDs). Nothing observable
//! depends on it: iteration follows the positions, which depend only on the operations made.
//!
//! Costs: `get`, `insert` and `remove` are O(1) (one more memory access than a `HashMap`, to
//! compare the GUID at the position found), and so is their worst case: the table resizes
//! incrementally ([`PositionTable`]: a few positions move to the new table with every insert
//! and removal, walking the entries in order), so no call stops to rehash them all — which
//! took 69 ms at 918,000 entries. `retain` is O(n).

use std::hash::BuildHasher;

use foldhash::quality::RandomState;

use crate::position_table::{PositionTable, MIGRATE_PER_OP, SHRINK_FLOOR};

/// Entries per chunk of [`Chunked`]: 48 KiB of 48-byte entries.
const CHUNK: usize = 1024;

/// A vector in fixed chunks of [`CHUNK`] elements: pushing never moves what is held (a `Vec`
/// grown by `realloc` copies itself while it is below glibc's mmap threshold — up to 32 MiB,
/// raised as large blocks are freed — which took 10 ms at 304,000 48-byte entries), and at most
/// one chunk is allocated beyond what is held (a `Vec` grown by a quarter leaves up to a
/// quarter unused). Element `i` is `chunks[i / CHUNK][i % CHUNK]`; every chunk but the last is
/// full, each holds `CHUNK` at most and never reallocates.
#[derive(Debug)]
struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, value: T) {
        if self.chunks.len() == self.len / CHUNK {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks[self.len / CHUNK].push(value);
        self.len += 1;
    }

    /// Removes the last element; frees a chunk once the one before it is empty too (one empty
    /// chunk is kept, so a length going back and forth across a boundary does not allocate).
    fn pop(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        let value = self.chunks[self.len / CHUNK].pop();
        if self.chunks.len() > self.len / CHUNK + 2 {
            self.chunks.pop();
        }
        value
    }

    /// Removes element `i`, putting the last one in its place (`Vec::swap_remove`).
    fn swap_remove(&mut self, i: usize) -> T {
        assert!(i < self.len, "index {i} beyond {}", self.len);
        let last = self.pop().expect("not empty");
        if i == self.len {
            return last;
        }
        std::mem::replace(&mut self[i], last)
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.chunks.iter_mut().flatten()
    }

    /// Keeps the elements for which `keep` is true, in order. O(n), into fresh chunks.
    fn retain_mut(&mut self, mut keep: impl FnMut(&mut T) -> bool) {
        let mut kept = Chunked::default();
        for mut value in std::mem::take(&mut self.chunks).into_iter().flatten() {
            if keep(&mut value) {
                kept.push(value);
            }
        }
        *self = kept;
    }

    /// Bytes of the chunks allocated (capacity, not length), and of the list of chunks.
    #[cfg(test)]
    fn allocated_bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T> std::ops::Index<usize> for Chunked<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl<T> std::ops::IndexMut<usize> for Chunked<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }
}

/// One entry: its GUID as two words (a `u128` field would align the entry to 16 bytes).
#[derive(Debug)]
struct Slot<V> {
    guid: [u64; 2],
    value: V,
}

impl<V> Slot<V> {
    fn guid(&self) -> u128 {
        (u128::from(self.guid[0]) << 64) | u128::from(self.guid[1])
    }
}

/// A map from GUIDs (`store::guid_key`) to values (see the module doc). At most `u32::MAX`
/// entries (a programmer error beyond: asserted).
#[derive(Debug)]
pub(crate) struct GuidIndex<V> {
    slots: Chunked<Slot<V>>,
    /// Positions in `slots`, hashed by the GUID of the entry they point at.
    table: PositionTable,
    /// While the table resizes: every position below `migrated` is in its new table, and the
    /// old one holds only positions below `resize_end` (entries only move down, into holes).
    migrated: usize,
    resize_end: usize,
    hasher: RandomState,
}

impl<V> Default for GuidIndex<V> {
    fn default() -> Self {
        GuidIndex {
            slots: Chunked::default(),
            table: PositionTable::default(),
            migrated: 0,
            resize_end: 0,
            hasher: RandomState::default(),
        }
    }
}

impl<V> GuidIndex<V> {
    /// An empty index.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn hash(hasher: &RandomState, guid: u128) -> u64 {
        hasher.hash_one(guid)
    }

    fn position(&self, guid: u128) -> Option<usize> {
        let slots = &self.slots;
        self.table
            .find(Self::hash(&self.hasher, guid), |i| {
                slots[i as usize].guid() == guid
            })
            .map(|i| i as usize)
    }

    /// Begins the walk of a resize the table just started: every entry held is in the old
    /// table.
    fn begin_walk(&mut self) {
        self.migrated = 0;
        self.resize_end = self.slots.len();
    }

    /// Moves the next few positions of a running resize to the new table.
    fn migrate_some(&mut self) {
        for _ in 0..MIGRATE_PER_OP {
            if !self.table.resizing() {
                return;
            }
            let end = self.resize_end.min(self.slots.len());
            if self.migrated >= end {
                debug_assert!(false, "a resize outlived its walk");
                return;
            }
            let p = self.migrated;
            let hash = Self::hash(&self.hasher, self.slots[p].guid());
            self.table.migrate(hash, p as u32);
            self.migrated += 1;
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether nothing is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.len() == 0
    }

    /// The value of `guid`.
    pub(crate) fn get(&self, guid: u128) -> Option<&V> {
        self.position(guid).map(|i| &self.slots[i].value)
    }

    /// The value of `guid`, to change it.
    pub(crate) fn get_mut(&mut self, guid: u128) -> Option<&mut V> {
        self.position(guid).map(|i| &mut self.slots[i].value)
    }

    /// Starts loading the table bucket that an operation on `guid` reads, and returns a value
    /// to fold into `std::hint::black_box` (see `BucketTable::prefetch`): a caller with a
    /// batch of GUIDs to look up or insert calls this for all of them first, so that their
    /// cache misses overlap.
    pub(crate) fn prefetch(&self, guid: u128) -> u32 {
        self.table.prefetch(Self::hash(&self.hasher, guid))
    }

    /// Whether `guid` is held.
    pub(crate) fn contains(&self, guid: u128) -> bool {
        self.position(guid).is_some()
    }

    /// Adds `guid` with `value`; the caller checked that `guid` is not held (asserted in debug
    /// builds: a second entry would shadow the first).
    pub(crate) fn insert_new(&mut self, guid: u128, value: V) {
        debug_assert!(!self.contains(guid), "guid {guid:032x} already indexed");
        let i = u32::try_from(self.slots.len()).expect("fewer than 2^32 entries");
        if self.table.insert(Self::hash(&self.hasher, guid), i) {
            self.begin_walk();
        }
        self.slots.push(Slot {
            guid: [(guid >> 64) as u64, guid as u64],
            value,
        });
        self.migrate_some();
    }

    /// Removes `guid`, returning its value.
    pub(crate) fn remove(&mut self, guid: u128) -> Option<V> {
        let slots = &self.slots;
        let i = self.table.remove(Self::hash(&self.hasher, guid), |i| {
            slots[i as usize].guid() == guid
        })? as usize;
        let last = self.slots.len() - 1;
        let removed = self.slots.swap_remove(i);
        if i < last {
            // The last entry moved into the hole: point its table entry at its new position
            // (into the new table if the hole is below the resize's walk).
            let moved = Self::hash(&self.hasher, self.slots[i].guid());
            let found = self
                .table
                .repoint(moved, last as u32, i as u32, i < self.migrated);
            debug_assert!(found, "every entry is in the table");
        }
        self.migrate_some();
        self.give_back_memory();
        Some(removed.value)
    }

    /// Keeps only the entries for which `keep` is true. O(n): the table is rebuilt.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u128, &mut V) -> bool) {
        let before = self.slots.len();
        self.slots.retain_mut(|s| keep(s.guid(), &mut s.value));
        if self.slots.len() == before {
            return;
        }
        self.table
            .clear_for((2 * self.slots.len()).max(SHRINK_FLOOR));
        for (i, s) in self.slots.iter().enumerate() {
            self.table
                .insert_rebuilt(Self::hash(&self.hasher, s.guid()), i as u32);
        }
        self.give_back_memory();
    }

    /// Every entry, in position order: the `n`-th is at position `n` for [`GuidIndex::at`]
    /// until the next change. The order means nothing but is deterministic (it depends only on
    /// the operations made).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u128, &V)> {
        self.slots.iter().map(|s| (s.guid(), &s.value))
    }

    /// Every value, to change it.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.slots.iter_mut().map(|s| &mut s.value)
    }

    /// The entry at `position` (from [`GuidIndex::iter`]'s order, before any change).
    pub(crate) fn at(&self, position: usize) -> (u128, &V) {
        let s = &self.slots[position];
        (s.guid(), &s.value)
    }

    /// Shrinks the table to twice what it holds once it is less than a quarter full (the
    /// entries give their chunks back as they empty): amortised O(1) per removal.
    fn give_back_memory(&mut self) {
        if self.table.maybe_shrink() {
            self.begin_walk();
        }
    }

    /// Bytes of memory held by the entries and the table (capacity, not length).
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.slots.allocated_bytes() + self.table.allocated_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map() {
        // A random mix of inserts, removals, updates and retains gives what a HashMap gives.
        let mut index: GuidIndex<u64> = GuidIndex::new();
        let mut model: HashMap<u128, u64> = HashMap::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000u64 {
            let guid = u128::from(next() % 5_000) << 64 | 7;
            match next() % 10 {
                0..=4 => {
                    if let std::collections::hash_map::Entry::Vacant(e) = model.entry(guid) {
                        index.insert_new(guid, step);
                        e.insert(step);
                    }
                }
                5..=7 => assert_eq!(index.remove(guid), model.remove(&guid)),
                8 => {
                    if let Some(v) = index.get_mut(guid) {
                        *v += 1;
                        *model.get_mut(&guid).unwrap() += 1;
                    }
                }
                _ => {
                    if step % 1000 == 9 {
                        index.retain(|g, v| (g >> 64) % 3 != 0 || *v % 2 == 0);
                        model.retain(|g, v| (g >> 64) % 3 != 0 || *v % 2 == 0);
                    }
                }
            }
            assert_eq!(index.len(), model.len());
        }
        for (guid, v) in &model {
            assert_eq!(index.get(*guid), Some(v));
        }
        let mut all: Vec<(u128, u64)> = index.iter().map(|(g, v)| (g, *v)).collect();
        all.sort_unstable();
        let mut expected: Vec<(u128, u64)> = model.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(all, expected);
    }

    #[test]
    fn takes_about_what_its_entries_hold_and_gives_memory_back() {
        // 1,000,000 GUIDs with 32-byte values: 48 bytes per entry in chunks at most two of
        // which are not full, and at most ~9 MiB of table plus the old table of a resize
        // while one runs — at most 65 MB at every size on the way (a HashMap takes 103 MB);
        // emptied, it shrinks back to its floor.
        let mut index: GuidIndex<[u64; 4]> = GuidIndex::new();
        let (mut most, mut resizing_seen) = (0, 0);
        for n in 0..1_000_000u128 {
            index.insert_new(n << 64 | n, [n as u64; 4]);
            if n % 1_000 == 999 {
                most = most.max(index.allocated_bytes());
                resizing_seen += usize::from(index.table.resizing());
            }
        }
        assert_eq!(std::mem::size_of::<Slot<[u64; 4]>>(), 48);
        assert!(resizing_seen > 0, "sampled while a resize ran");
        assert!(most <= 65_000_000, "{most} bytes");
        for n in 0..1_000_000u128 {
            assert_eq!(index.remove(n << 64 | n), Some([n as u64; 4]));
        }
        assert!(index.is_empty());
        assert!(
            index.allocated_bytes() <= 256 << 10,
            "{} KiB after emptying",
            index.allocated_bytes() >> 10
        );
    }

    #[test]
    fn grows_and_shrinks_a_little_at_a_time() {
        // Waves: fill to 60,000, empty down to 50 (in a scattered order, so entries move into
        // holes on both sides of a resize's walk), three times. The index always equals the
        // model, and every resize ends (a table never fills: `BucketTable` asserts it).
        let mut index: GuidIndex<u64> = GuidIndex::new();
        let mut model: HashMap<u128, u64> = HashMap::new();
        let guid = |n: u64| u128::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) << 64 | u128::from(n);
        let mut resizes = 0;
        let mut was = false;
        for wave in 0..3u64 {
            let base = wave * 1_000_000;
            for n in base..base + 60_000 {
                index.insert_new(guid(n), n);
                model.insert(guid(n), n);
                resizes += usize::from(!was && index.table.resizing());
                was = index.table.resizing();
            }
            for k in 0..60_000u64 {
                // Every residue modulo 7 in turn: removals spread over the whole vector.
                let n = base + (k % 7) * (60_000 / 7 + 1) + k / 7;
                if n >= base + 60_000 || model.len() <= 50 {
                    continue;
                }
                assert_eq!(index.remove(guid(n)), model.remove(&guid(n)));
                resizes += usize::from(!was && index.table.resizing());
                was = index.table.resizing();
            }
            assert_eq!(index.len(), model.len());
            for (g, v) in &model {
                assert_eq!(index.get(*g), Some(v));
            }
        }
        assert!(resizes >= 12, "{resizes} resizes");
        for n in 0..10_000u64 {
            index.insert_new(guid(10_000_000 + n), n);
        }
        assert_eq!(index.len(), model.len() + 10_000);
    }

    #[test]
    fn a_shrink_makes_a_smaller_table() {
        // A partition's index of outstanding messages under steady load: up to 1,500 entries
        // at a burst, then a few dozen, again and again. Every resize a removal starts (a
        // shrink) makes a smaller table: a shrink to the floor's 1,024 used to make a table
        // of 1,792, as large as the one it replaced (or larger than one whose tombstones
        // lowered its capacity), and then another as soon as that one was done, for as long
        // as the index held fewer than 448.
        let mut index: GuidIndex<u64> = GuidIndex::new();
        let guid = |n: u64| u128::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) << 64 | u128::from(n);
        let mut next = 0u64;
        let mut held = std::collections::VecDeque::new();
        let mut shrinks = 0;
        for _ in 0..20 {
            while held.len() < 1_500 {
                index.insert_new(guid(next), next);
                held.push_back(next);
                next += 1;
            }
            while held.len() > 40 {
                let (capacity, was) = (index.table.capacity(), index.table.resizing());
                let n = held.pop_front().expect("held");
                assert_eq!(index.remove(guid(n)), Some(n));
                if !was && index.table.resizing() {
                    shrinks += 1;
                    assert!(
                        index.table.capacity() < capacity,
                        "a shrink from {capacity} to {}",
                        index.table.capacity()
                    );
                }
            }
        }
        assert!(shrinks <= 20, "{shrinks} shrinks in 20 waves");
        assert_eq!(index.len(), 40);
    }

    #[test]
    fn chunked_is_a_vector_that_never_moves_what_it_holds() {
        // Random pushes, pops and swap-removes across chunk boundaries give what a Vec gives;
        // at most two chunks beyond the full ones are allocated; retain keeps the order.
        let mut c: Chunked<u64> = Chunked::default();
        let mut v: Vec<u64> = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Drift up, then down, then up: lengths cross many boundaries both ways.
            let grow = (step / 50_000) % 2 == 0;
            match x % 10 {
                0..=5 if grow => {
                    c.push(step);
                    v.push(step);
                }
                0..=2 => {
                    c.push(step);
                    v.push(step);
                }
                6 | 7 if !v.is_empty() => {
                    let i = (x >> 8) as usize % v.len();
                    assert_eq!(c.swap_remove(i), v.swap_remove(i));
                }
                _ => assert_eq!(c.pop(), v.pop()),
            }
            assert_eq!(c.len(), v.len());
            assert!(
                c.chunks.len() <= v.len() / CHUNK + 2,
                "{} chunks for {}",
                c.chunks.len(),
                v.len()
            );
            if step % 9_999 == 0 {
                assert!(c.iter().eq(v.iter()));
                assert!((0..v.len()).all(|i| c[i] == v[i]));
            }
        }
        c.retain_mut(|n| *n % 3 != 0);
        v.retain(|n| *n % 3 != 0);
        assert!(c.iter().eq(v.iter()));
        assert_eq!(c.len(), v.len());
    }
}
