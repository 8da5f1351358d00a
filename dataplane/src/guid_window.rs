//! `GuidWindow`: the GUIDs of recently finished messages, for duplicate detection (the journal's
//! index knows the outstanding ones), bounded by count and by age (issue 17: 16 bytes per GUID
//! in the ring plus 5 to 11 in the table, where a `HashSet` beside the ring took about 52).
//!
//! The GUIDs are kept once, in insertion order, in a ring ([`ChunkedRing`]: growing never
//! copies what it holds, which a `VecDeque` did, 8 MiB in one insert at 524,288 GUIDs); the hash table holds
//! only each GUID's 4-byte position in the ring (`hashbrown::HashTable<u32>`, hashing the GUID
//! the position points at, with foldhash's keyed `quality::RandomState`: GUIDs are chosen by producers).
//! GUIDs leave from the front, oldest first, so positions are a counter: the ring's front has
//! position `popped`, and a position is stored modulo 2^32 (the ring never holds 2^32 GUIDs).
//! Ages are kept per second of traffic, not per GUID: one `(Instant, count)` per
//! [`GUID_BUCKET`]. With the default 1,000,000 GUIDs per partition the window takes 16 MiB of
//! ring and 10 MiB of table at most, and both shrink as GUIDs leave. The table resizes
//! incrementally ([`PositionTable`]: a few positions move to the new table with every insert,
//! oldest first, and forgetting the oldest GUIDs empties the old table too), so no insert stops
//! to rehash the whole window —
//! which took 69 ms at 918,000 GUIDs, on every node at once.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use crate::chunked_ring::ChunkedRing;

use foldhash::quality::RandomState;
use std::time::{Duration, Instant};

use crate::position_table::{PositionTable, MIGRATE_PER_OP};

/// Width of a [`GuidWindow`] time bucket: GUIDs leave the window at most this much later than
/// their age says (never earlier), and the window keeps one timestamp per bucket, not per GUID.
pub(crate) const GUID_BUCKET: Duration = Duration::from_secs(1);

/// GUIDs at most that one [`GuidWindow::expire`] forgets for their age (about 1 ms of work),
/// besides those the count bound removes (never capped: they follow the inserts).
pub(crate) const AGE_OUT_PER_CALL: usize = 8_192;

/// GUIDs of recently finished messages (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct GuidWindow {
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
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether `guid` is remembered.
    pub(crate) fn contains(&self, guid: u128) -> bool {
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
            let (order, popped, hasher) = (&self.order, self.popped, &self.hasher);
            let hash = Self::hash(hasher, order[(p - popped) as usize]);
            self.table.migrate(hash, p as u32, |q| {
                Self::hash(hasher, order[Self::index(popped, q)])
            });
            self.migrated = p + 1;
        }
    }

    /// Remembers `guid`, finished at `now` (nothing when it is remembered already).
    pub(crate) fn insert(&mut self, now: Instant, guid: u128) {
        let position = (self.popped + self.order.len() as u64) as u32;
        let (order, popped, hasher) = (&self.order, self.popped, &self.hasher);
        let Some(resize_started) = self.table.insert_if_absent(
            Self::hash(hasher, guid),
            position,
            |p| order[Self::index(popped, p)] == guid,
            |p| Self::hash(hasher, order[Self::index(popped, p)]),
        ) else {
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
    pub(crate) fn expire(&mut self, now: Instant, max: usize, age: Duration) {
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
            for _ in 0..n {
                self.forget_oldest();
            }
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

    fn forget_oldest(&mut self) {
        let Some(key) = self.order.pop_front() else {
            return;
        };
        // The oldest position is the next one a resize's walk would move: it is still in the
        // old table unless the walk passed it. Forgetting it advances the walk too, so a
        // forget moves nothing (inserts keep the resize going).
        let in_old = self.table.resizing() && self.popped >= self.migrated;
        let position = self.popped as u32;
        self.table
            .remove_hinted(Self::hash(&self.hasher, key), |p| p == position, in_old);
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
        assert!(w.len() == 0 && w.bucket_counts().is_empty());
        assert!((0..12).all(|g| !w.contains(g)));
    }

    #[test]
    fn a_full_window_of_a_million_takes_26_mib_and_shrinks_when_it_empties() {
        // 3,000,000 GUIDs through a window of 1,000,000: exactly the last 1,000,000 are
        // remembered, in at most 16 MiB of ring plus 10 MiB of table; once they age out the
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
            w.allocated_bytes() <= 26 << 20,
            "{} bytes",
            w.allocated_bytes()
        );
        // Aged out, at most AGE_OUT_PER_CALL per call.
        let mut calls = 0;
        while w.len() > 0 {
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
        // younger than its age bound, and no insert makes hashbrown rehash everything at once
        // (its hasher panics in debug builds).
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
        // Random inserts (new GUIDs and GUIDs seen before, some forgotten since) and count
        // bounds that rise and fall, so the table grows and shrinks many times and GUIDs are
        // forgotten before and after a resize's walk moves them: the window always remembers
        // exactly the GUIDs a FIFO set of the same bound would, and outside a resize its table
        // holds exactly the ring's positions.
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
        for step in 0..200_000u64 {
            let max = match (step / 20_000) % 4 {
                0 => 30_000,
                1 => 3_000,
                2 => 50_000,
                _ => 500,
            };
            let guid = if next() % 8 == 0 && fresh > 0 {
                (next() as u128) % fresh // seen before: remembered or forgotten
            } else {
                fresh += 1;
                fresh - 1
            };
            w.insert(t0, guid);
            if held.insert(guid) {
                model.push_back(guid);
            }
            if next() % 64 == 0 {
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
            if step % 10_000 == 9_999 {
                assert_eq!(w.len(), model.len(), "step {step}");
                for g in 0..fresh {
                    assert_eq!(w.contains(g), held.contains(&g), "GUID {g} at step {step}");
                }
            }
        }
        assert!(resizes >= 10, "{resizes} resizes");
    }
}
