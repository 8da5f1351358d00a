//! `GuidWindow`: the GUIDs of recently finished messages, for duplicate detection (the journal's
//! index knows the outstanding ones), bounded by count and by age (16 bytes per GUID in the
//! ring plus 7 to 14 in the table, where a `HashSet` beside the ring took about 52;
//! docs/bench/JOURNAL.md, "Storage for months").
//!
//! The GUIDs are kept once, in insertion order, in a ring ([`ChunkedRing`]: growing never
//! copies what it holds, which a `VecDeque` did, 8 MiB in one insert at 524,288 GUIDs); the
//! hash table holds only each GUID's 4-byte position in the ring (a [`PositionTable`] of
//! one-cache-line buckets, hashing the GUID the position points at, with foldhash's keyed
//! `quality::RandomState`: GUIDs are chosen by producers). Every node inserts every finished
//! message and, once the window is full, forgets one for each: [`GuidWindow::insert_all`] and
//! [`GuidWindow::expire`] work on groups of GUIDs whose buckets are loaded together, so their
//! cache misses overlap.
//! GUIDs leave from the front, oldest first, so positions are a counter: the ring's front has
//! position `popped`, and a position is stored modulo 2^32 (the ring never holds 2^32 GUIDs).
//! Ages are kept per second of traffic, not per GUID: one `(Instant, count)` per
//! [`GUID_BUCKET`]. With the default 1,000,000 GUIDs per partition the window takes 16 MiB of
//! ring and 8 MiB of table (12 MiB while a resize runs), and both shrink as GUIDs leave. The
//! table resizes incrementally ([`PositionTable`]: a few positions move to the new table with
//! every insert, oldest first, and forgetting the oldest GUIDs empties the old table too), so
//! no insert stops to rehash the whole window — which took 69 ms at 918,000 GUIDs, on every
//! node at once.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use crate::chunked_ring::ChunkedRing;

use foldhash::quality::RandomState;
use std::time::{Duration, Instant};

use crate::position_table::{PositionTable, MIGRATE_PER_OP};

/// Width of a [`GuidWindow`] time bucket: GUIDs leave the window at most this much later than
/// their age says (never earlier), and the window keeps one timestamp per bucket, not per GUID.
pub const GUID_BUCKET: Duration = Duration::from_secs(1);

/// GUIDs at most that one [`GuidWindow::expire`] forgets for their age (about 1 ms of work),
/// besides those the count bound removes (never capped: they follow the inserts).
pub const AGE_OUT_PER_CALL: usize = 8_192;

/// GUIDs inserted or forgotten together, their table buckets loaded before any is used (see
/// [`GuidWindow::insert_all`]): enough misses in flight to cover a memory latency, few enough
/// to stay in the first-level cache.
const GROUP: usize = 16;

/// GUIDs of recently finished messages (see the module doc).
#[derive(Debug, Default)]
pub struct GuidWindow {
    /// GUIDs in insertion order.
    order: ChunkedRing<u128>,
    /// GUIDs that left the front so far: `order[i]` has position `popped + i`.
    popped: u64,
    /// `(start, GUIDs inserted from start for up to GUID_BUCKET)`, oldest first; the counts add
    /// up to `order.len()`.
    buckets: VecDeque<(Instant, usize)>,
    /// Positions (modulo 2^32) of the GUIDs in `order`, hashed by GUID.
    table: PositionTable,
    /// While the table resizes: positions below `migrated` are in its new table, and the old
    /// one holds only positions below `resize_end` (absolute positions, like `popped`).
    migrated: u64,
    resize_end: u64,
    hasher: RandomState,
}

impl GuidWindow {
    fn hash(hasher: &RandomState, guid: u128) -> u64 {
        hasher.hash_one(guid)
    }

    /// Index in `order` of position `p` (stored modulo 2^32).
    fn index(popped: u64, p: u32) -> usize {
        p.wrapping_sub(popped as u32) as usize
    }

    /// GUIDs remembered.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether no GUID is remembered.
    pub fn is_empty(&self) -> bool {
        self.order.len() == 0
    }

    /// Starts loading the table bucket that [`GuidWindow::contains`] of `guid` reads; returns a
    /// value to fold into `std::hint::black_box` (see `BucketTable::prefetch`).
    pub fn prefetch(&self, guid: u128) -> u32 {
        self.table.prefetch(Self::hash(&self.hasher, guid))
    }

    /// Whether `guid` is remembered.
    pub fn contains(&self, guid: u128) -> bool {
        let (order, popped) = (&self.order, self.popped);
        self.table
            .find(Self::hash(&self.hasher, guid), |p| {
                order[Self::index(popped, p)] == guid
            })
            .is_some()
    }

    /// Begins the walk of a resize the table just started: every GUID held is in the old
    /// table.
    fn begin_walk(&mut self) {
        self.migrated = self.popped;
        self.resize_end = self.popped + self.order.len() as u64;
    }

    /// The hash of the GUID at position `p` (held: `popped <= p < popped + order.len()`).
    fn hash_at(&self, p: u64) -> u64 {
        Self::hash(&self.hasher, self.order[(p - self.popped) as usize])
    }

    /// Moves the next few positions of a running resize to the new table, oldest first.
    fn migrate_some(&mut self) {
        for _ in 0..MIGRATE_PER_OP {
            if !self.table.resizing() {
                return;
            }
            let p = self.migrated.max(self.popped);
            if p >= self.resize_end {
                debug_assert!(false, "a resize outlived its walk");
                return;
            }
            self.table.migrate(self.hash_at(p), p as u32);
            self.migrated = p + 1;
        }
    }

    /// Remembers `guid`, finished at `now` (nothing when it is remembered already).
    #[cfg(test)]
    pub(crate) fn insert(&mut self, now: Instant, guid: u128) {
        self.insert_all(now, [guid]);
    }

    /// Remembers each of `guids`, finished at `now` (nothing for one remembered already).
    ///
    /// In groups of [`GROUP`]: the table's buckets for a whole group (and for the positions
    /// a running resize will move meanwhile) are loaded before any is used, so their cache
    /// misses overlap instead of following one another — at 1,000,000 GUIDs nearly every
    /// bucket is a miss, and the window takes every finished message on every node.
    pub fn insert_all(&mut self, now: Instant, guids: impl IntoIterator<Item = u128>) {
        let mut guids = guids.into_iter();
        loop {
            let mut group = [(0u128, 0u64); GROUP];
            let mut n = 0;
            for (slot, guid) in group.iter_mut().zip(&mut guids) {
                *slot = (guid, Self::hash(&self.hasher, guid));
                n += 1;
            }
            let mut loaded = self.prefetch_migration(n * MIGRATE_PER_OP);
            for &(_, hash) in &group[..n] {
                loaded ^= self.table.prefetch(hash);
            }
            std::hint::black_box(loaded);
            for &(guid, hash) in &group[..n] {
                self.insert_hashed(now, guid, hash);
            }
            if n < GROUP {
                return;
            }
        }
    }

    /// Loads the buckets of the next `count` positions a running resize will move (see
    /// [`GuidWindow::insert_all`]).
    fn prefetch_migration(&self, count: usize) -> u32 {
        if !self.table.resizing() {
            return 0;
        }
        let start = self.migrated.max(self.popped);
        let end = (start + count as u64).min(self.resize_end);
        (start..end).fold(0, |loaded, p| loaded ^ self.table.prefetch(self.hash_at(p)))
    }

    fn insert_hashed(&mut self, now: Instant, guid: u128, hash: u64) {
        let position = (self.popped + self.order.len() as u64) as u32;
        let (order, popped) = (&self.order, self.popped);
        let Some(resize_started) = self
            .table
            .insert_if_absent(hash, position, |p| order[Self::index(popped, p)] == guid)
        else {
            return;
        };
        if resize_started {
            self.begin_walk();
        }
        self.order.push_back(guid);
        self.migrate_some();
        match self.buckets.back_mut() {
            Some((start, count)) if now.saturating_duration_since(*start) < GUID_BUCKET => {
                *count += 1
            }
            _ => self.buckets.push_back((now, 1)),
        }
    }

    /// Forgets the oldest GUIDs while there are more than `max`, and those of every bucket that
    /// began `age + GUID_BUCKET` ago or earlier — at most [`AGE_OUT_PER_CALL`] of these per
    /// call beyond what `max` removes: the rest leave at the next calls (later than their age,
    /// never earlier), so a second of a burst at 100,000 msgs/s does not stop the partition
    /// for the 5-9 ms its removal takes.
    pub fn expire(&mut self, now: Instant, max: usize, age: Duration) {
        let mut forgot = false;
        let mut aged_budget = AGE_OUT_PER_CALL;
        while let Some(&(start, count)) = self.buckets.front() {
            let too_old = now.saturating_duration_since(start) >= age + GUID_BUCKET;
            let excess = self.order.len().saturating_sub(max);
            let n = if too_old {
                count.min(excess.max(aged_budget))
            } else {
                excess.min(count)
            };
            if n == 0 {
                break;
            }
            aged_budget = aged_budget.saturating_sub(n);
            self.forget_oldest(n);
            forgot = true;
            if n == count {
                self.buckets.pop_front();
            } else if let Some(front) = self.buckets.front_mut() {
                front.1 -= n;
            }
        }
        if forgot {
            self.give_back_memory();
        }
    }

    /// Forgets the `n` oldest GUIDs, in groups of [`GROUP`] whose buckets are loaded together
    /// (as [`GuidWindow::insert_all`] does).
    fn forget_oldest(&mut self, n: usize) {
        let mut left = n.min(self.order.len());
        while left > 0 {
            let k = left.min(GROUP);
            let mut hashes = [0u64; GROUP];
            let mut loaded = 0;
            for (i, hash) in hashes[..k].iter_mut().enumerate() {
                *hash = self.hash_at(self.popped + i as u64);
                loaded ^= self.table.prefetch(*hash);
            }
            std::hint::black_box(loaded);
            for &hash in &hashes[..k] {
                self.forget_front(hash);
            }
            left -= k;
        }
    }

    /// Forgets the oldest GUID, whose hash is `hash`.
    fn forget_front(&mut self, hash: u64) {
        if self.order.pop_front().is_none() {
            return;
        }
        // The oldest position is the next one a resize's walk would move: it is still in the
        // old table unless the walk passed it. Forgetting it advances the walk too, so a
        // forget moves nothing (inserts keep the resize going).
        let in_old = self.table.resizing() && self.popped >= self.migrated;
        let position = self.popped as u32;
        self.table.remove_hinted(hash, |p| p == position, in_old);
        self.popped += 1;
    }

    /// Shrinks the table to twice what it holds once it is less than a quarter full (amortised
    /// O(1) per GUID); the ring gives its chunks back as they empty.
    fn give_back_memory(&mut self) {
        if self.table.maybe_shrink() {
            self.begin_walk();
        }
    }

    /// Bytes held by the ring and the table (capacity, not length).
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.order.allocated_bytes() + self.table.allocated_bytes()
    }

    /// The GUID counts of the time buckets, oldest first.
    #[cfg(test)]
    pub(crate) fn bucket_counts(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.1).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgets_by_count_and_by_age_never_early() {
        // The count bound drops the oldest first (within a bucket too); the age bound never
        // drops a GUID early and drops a whole bucket at most one bucket width late.
        let t0 = Instant::now();
        let age = Duration::from_secs(10);
        let mut w = GuidWindow::default();
        // Three seconds of traffic, 4 GUIDs a second.
        for i in 0..12u128 {
            w.insert(t0 + Duration::from_millis(250 * i as u64), i);
        }
        w.insert(t0, 3); // already known: not counted twice
        assert_eq!(w.len(), 12);
        assert_eq!(w.bucket_counts().iter().sum::<usize>(), 12);
        w.expire(t0 + Duration::from_secs(3), 10, age);
        assert_eq!(w.len(), 10);
        assert!(!w.contains(0) && !w.contains(1) && w.contains(2));
        assert_eq!(w.bucket_counts().iter().sum::<usize>(), 10);
        w.expire(t0 + age + Duration::from_millis(999), 10, age);
        assert!(w.contains(2), "a GUID 10.999 s old is still remembered");
        w.expire(t0 + age + GUID_BUCKET, 10, age);
        assert!(!w.contains(3) && w.contains(4));
        assert_eq!(w.len(), 8);
        w.expire(t0 + Duration::from_secs(60), 10, age);
        assert!(w.is_empty() && w.bucket_counts().is_empty());
        assert!((0..12).all(|g| !w.contains(g)));
    }

    #[test]
    fn a_full_window_of_a_million_takes_24_mib_and_shrinks_when_it_empties() {
        // 3,000,000 GUIDs through a window of 1,000,000: exactly the last 1,000,000 are
        // remembered, in at most 16 MiB of ring plus 8 MiB of table; once they age out the
        // memory goes back.
        let t0 = Instant::now();
        let age = Duration::from_secs(300);
        let mut w = GuidWindow::default();
        let guid = |n: u64| u128::from(n) << 64 | u128::from(n * 7);
        for n in 0..3_000_000u64 {
            w.insert(t0, guid(n));
            if n % 1000 == 0 {
                w.expire(t0, 1_000_000, age);
            }
        }
        w.expire(t0, 1_000_000, age);
        assert_eq!(w.len(), 1_000_000);
        assert!(!w.contains(guid(1_999_999)) && w.contains(guid(2_000_000)));
        assert!(w.contains(guid(2_999_999)));
        assert!(
            w.allocated_bytes() <= 24 << 20,
            "{} bytes",
            w.allocated_bytes()
        );
        // Aged out, at most AGE_OUT_PER_CALL per call.
        let mut calls = 0;
        while !w.is_empty() {
            let before = w.len();
            w.expire(t0 + age + GUID_BUCKET, 1_000_000, age);
            assert!(before - w.len() <= AGE_OUT_PER_CALL);
            calls += 1;
        }
        assert_eq!(calls, 1_000_000usize.div_ceil(AGE_OUT_PER_CALL));
        assert!(
            w.allocated_bytes() <= 64 << 10,
            "{} bytes",
            w.allocated_bytes()
        );
    }

    #[test]
    fn resizes_a_little_at_a_time_through_bursts_and_lulls() {
        // Bursts of 40,000 GUIDs a second, then lulls that let them age out, four times:
        // the window grows and shrinks through many resizes, always remembers exactly the GUIDs
        // younger than its age bound, and every resize ends before its table fills (a
        // `BucketTable` asserts it).
        let t0 = Instant::now();
        let age = Duration::from_secs(10);
        let mut w = GuidWindow::default();
        let guid = |n: u64| u128::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) << 64 | u128::from(n);
        let mut n = 0u64;
        let mut resizes = 0;
        let mut was = false;
        for cycle in 0..4u64 {
            let start = t0 + Duration::from_secs(100 * cycle);
            let first = n;
            for ms in 0..2_000u64 {
                let now = start + Duration::from_millis(ms);
                for _ in 0..40 {
                    w.insert(now, guid(n));
                    n += 1;
                    resizes += usize::from(!was && w.table.resizing());
                    was = w.table.resizing();
                }
                w.expire(now, 1_000_000, age);
            }
            assert_eq!(w.len() as u64, n - first);
            assert!(w.contains(guid(first)) && w.contains(guid(n - 1)));
            assert!(
                first == 0 || !w.contains(guid(first - 1)),
                "the last cycle aged out"
            );
            // The lull: everything ages out over a few calls, and the memory goes back.
            for _ in 0..80_000usize.div_ceil(AGE_OUT_PER_CALL) {
                w.expire(start + Duration::from_secs(60), 1_000_000, age);
            }
            assert_eq!(w.len(), 0);
        }
        assert!(resizes >= 16, "{resizes} resizes");
        assert!(
            w.allocated_bytes() <= 64 << 10,
            "{} bytes",
            w.allocated_bytes()
        );
    }

    #[test]
    fn agrees_with_a_fifo_set_through_resizes_both_ways() {
        // Random groups of inserts (new GUIDs and GUIDs seen before, some forgotten since, some
        // twice in one group) and count bounds that rise and fall, so the table grows and
        // shrinks many times and GUIDs are forgotten before and after a resize's walk moves
        // them: the window always remembers exactly the GUIDs a FIFO set of the same bound
        // would, and outside a resize its table holds exactly the ring's positions.
        let t0 = Instant::now();
        let age = Duration::from_secs(3600);
        let mut w = GuidWindow::default();
        let mut model: VecDeque<u128> = VecDeque::new();
        let mut held = std::collections::HashSet::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut fresh = 0u128;
        let mut resizes = 0;
        let mut was = false;
        for step in 0..20_000u64 {
            let max = match (step / 2_000) % 4 {
                0 => 30_000,
                1 => 3_000,
                2 => 50_000,
                _ => 500,
            };
            let mut group = Vec::new();
            for _ in 0..=next() % 40 {
                let guid = if next() % 8 == 0 && fresh > 0 {
                    (next() as u128) % fresh // seen before: remembered or forgotten
                } else {
                    fresh += 1;
                    fresh - 1
                };
                group.push(guid);
            }
            w.insert_all(t0, group.iter().copied());
            for &guid in &group {
                if held.insert(guid) {
                    model.push_back(guid);
                }
            }
            if next() % 4 == 0 {
                w.expire(t0, max, age);
                while model.len() > max {
                    held.remove(&model.pop_front().expect("longer than max"));
                }
            }
            resizes += usize::from(!was && w.table.resizing());
            was = w.table.resizing();
            if !w.table.resizing() {
                assert_eq!(w.table.len(), w.len(), "step {step}");
            }
            if step % 1_000 == 999 {
                assert_eq!(w.len(), model.len(), "step {step}");
                for g in 0..fresh {
                    assert_eq!(w.contains(g), held.contains(&g), "GUID {g} at step {step}");
                }
            }
        }
        assert!(resizes >= 10, "{resizes} resizes");
    }
}
