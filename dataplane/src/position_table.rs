//! `PositionTable`: the hash table under [`GuidIndex`](crate::guid_index) and
//! [`GuidWindow`](crate::guid_window) — `u32` positions into the caller's dense store (an
//! entry vector, a ring of GUIDs), found by the key stored at the position — that resizes a
//! little at a time instead of all at once.
//!
//! A `hashbrown` table that runs out of room rehashes every element in one call, and here
//! rehashing an element means reading its key from the caller's store at a random place: a
//! cache miss each. Measured on 2026-11-26 (BENCHMARKS.md, "No stop-the-world rehash"): the
//! duplicate window stopped its partition's thread for 13 ms at 229,000 GUIDs, 35 ms at
//! 459,000 and 69 ms at 918,000, on every node at about the same moment (they all see the same
//! messages), and the index of outstanding messages did the same as a backlog grew. Every
//! ACK and delivery of the partition waited that long.
//!
//! So a resize (growing when the table is full, shrinking when it is less than a quarter full)
//! only allocates the new table and keeps the old one beside it; the caller then moves a few
//! positions from the old table to the new one with every operation
//! ([`PositionTable::migrate`], walking its own store in position order), until the old one
//! is empty and is freed — incremental rehashing, as Redis does for its dictionaries. With
//! [`MIGRATE_PER_OP`] positions moved per operation and the new table sized for twice what is
//! held, a resize always ends before the new table fills, so `hashbrown` never rehashes on its
//! own (tested: the hasher closure handed to it is never called). While a resize runs, a look-up
//! that misses the new table also probes the old one, and the old table's memory (half the
//! new one's when growing) is held until it is empty.

use hashbrown::HashTable;

/// A shrink never asks for less than this capacity; a table is shrunk only while its capacity
/// is above twice this (see [`PositionTable::maybe_shrink`]).
pub(crate) const SHRINK_FLOOR: usize = 1024;

/// Positions the caller moves from the old table to the new one per operation while a resize
/// runs. Growing: the new table holds twice what was held, so `n` migrated positions leave
/// room for `n` inserts, and at 2 per insert the `n` are moved after `n / 2`.
pub(crate) const MIGRATE_PER_OP: usize = 2;

/// A hash table of positions that resizes incrementally (see the module doc). Hashes are the
/// caller's: every method takes the hash of the key at the position concerned.
#[derive(Debug, Default)]
pub(crate) struct PositionTable {
    /// Where positions are inserted; where all of them are when no resize runs.
    table: HashTable<u32>,
    /// The table being emptied into `table` while a resize runs; otherwise empty and
    /// unallocated.
    old: HashTable<u32>,
}

/// The hasher handed to `hashbrown`, which asks for one with every insert in case it must
/// rehash: a resize's new table never needs to (see the module doc), so in debug builds this
/// panics when called — tests fail if a table ever rehashes all at once; in release builds it
/// hashes correctly, and the cost is only the pause this module avoids.
fn rehash_with(hash_of: &impl Fn(u32) -> u64) -> impl Fn(&u32) -> u64 + '_ {
    move |&p| {
        debug_assert!(false, "a position table rehashed all at once");
        hash_of(p)
    }
}

impl PositionTable {
    /// How many positions the current table holds before it must resize (tests).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Positions held.
    pub(crate) fn len(&self) -> usize {
        self.table.len() + self.old.len()
    }

    /// Whether a resize is running (positions may still be in the old table).
    pub(crate) fn resizing(&self) -> bool {
        !self.old.is_empty()
    }

    /// The position whose key `eq` accepts, among those hashed to `hash`.
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.table
            .find(hash, |&p| eq(p))
            .or_else(|| self.old.find(hash, |&p| eq(p)))
            .copied()
    }

    /// Removes the position whose key `eq` accepts, among those hashed to `hash`.
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.remove_hinted(hash, eq, false)
    }

    /// As [`PositionTable::remove`], probing the old table first when the caller knows the
    /// position is still there (`in_old`): one probe instead of two.
    pub(crate) fn remove_hinted(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(u32) -> bool,
        in_old: bool,
    ) -> Option<u32> {
        if in_old {
            if let Ok(entry) = self.old.find_entry(hash, |&p| eq(p)) {
                let removed = entry.remove().0;
                self.drop_old_if_empty();
                return Some(removed);
            }
        }
        if let Ok(entry) = self.table.find_entry(hash, |&p| eq(p)) {
            return Some(entry.remove().0);
        }
        let removed = self.old.find_entry(hash, |&p| eq(p)).ok()?.remove().0;
        self.drop_old_if_empty();
        Some(removed)
    }

    /// Adds `position` (its key hashes to `hash`; the caller checked that the key is not
    /// held). A full table starts a resize to twice what is held. `hash_of` gives the hash of
    /// the key at a held position (here and below: used only if hashbrown had to rehash).
    /// Returns whether a resize started: every position held before this one is in the old
    /// table, and the caller's walk begins.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        position: u32,
        hash_of: impl Fn(u32) -> u64,
    ) -> bool {
        let started = self.table.len() >= self.table.capacity()
            && !self.resizing()
            && self.start_resize((2 * self.len()).max(8));
        self.table
            .insert_unique(hash, position, rehash_with(&hash_of));
        started
    }

    /// Adds `position` unless a position whose key `eq` accepts is held (one probe of each
    /// table, as [`PositionTable::find`] then [`PositionTable::insert`] would take two of the
    /// new one). `None` when the key is held; otherwise whether a resize started, as
    /// [`PositionTable::insert`] returns.
    pub(crate) fn insert_if_absent(
        &mut self,
        hash: u64,
        position: u32,
        mut eq: impl FnMut(u32) -> bool,
        hash_of: impl Fn(u32) -> u64,
    ) -> Option<bool> {
        if self.old.find(hash, |&p| eq(p)).is_some() {
            return None;
        }
        if self.table.len() < self.table.capacity() {
            return match self.table.entry(hash, |&p| eq(p), rehash_with(&hash_of)) {
                hashbrown::hash_table::Entry::Occupied(_) => None,
                hashbrown::hash_table::Entry::Vacant(place) => {
                    place.insert(position);
                    Some(false)
                }
            };
        }
        if self.table.find(hash, |&p| eq(p)).is_some() {
            return None;
        }
        Some(self.insert(hash, position, hash_of))
    }

    /// Points the entry of the key hashed to `hash` from position `from` to position `to`
    /// (the caller moved the entry in its store). `settled`: `to` is below the caller's
    /// migration cursor, where every position must be in the new table — an entry still in
    /// the old one moves over.
    pub(crate) fn repoint(
        &mut self,
        hash: u64,
        from: u32,
        to: u32,
        settled: bool,
        hash_of: impl Fn(u32) -> u64,
    ) -> bool {
        if let Some(p) = self.table.find_mut(hash, |&p| p == from) {
            *p = to;
            return true;
        }
        let Ok(entry) = self.old.find_entry(hash, |&p| p == from) else {
            return false;
        };
        if settled {
            entry.remove();
            self.table.insert_unique(hash, to, rehash_with(&hash_of));
            self.drop_old_if_empty();
        } else {
            *entry.into_mut() = to;
        }
        true
    }

    /// Moves `position` (its key hashes to `hash`) from the old table to the new one, if it
    /// is still in the old one.
    pub(crate) fn migrate(&mut self, hash: u64, position: u32, hash_of: impl Fn(u32) -> u64) {
        if let Ok(entry) = self.old.find_entry(hash, |&p| p == position) {
            entry.remove();
            self.table
                .insert_unique(hash, position, rehash_with(&hash_of));
            self.drop_old_if_empty();
        }
    }

    /// Starts shrinking to twice what is held (at least [`SHRINK_FLOOR`]) once less than a
    /// quarter of the capacity is used (not while a resize runs), when that halves the table
    /// at least. Returns whether a resize started, as [`PositionTable::insert`] returns.
    ///
    /// hashbrown gives a table 7/8 of a power of two of buckets, so asking for the floor's
    /// 1,024 gives 1,792: below twice the floor, a "shrink" would make a table as large as
    /// the one it replaces and only move every position again. It did: the index of a few
    /// hundred outstanding messages (a table of 1,792 whenever it held fewer than 448) was
    /// resized every ~150 messages on every node at 40,000-60,000 msgs/s (issue 18). Above
    /// twice the floor a quarter-full table always at least halves.
    pub(crate) fn maybe_shrink(&mut self) -> bool {
        let cap = self.table.capacity();
        if self.resizing() || cap <= 2 * SHRINK_FLOOR || cap / 4 <= self.len() {
            return false;
        }
        let started = self.start_resize((2 * self.len()).max(SHRINK_FLOOR));
        // `capacity()` counts hashbrown's tombstones out, so the old table may report less
        // than its buckets hold: what a shrink must give is a smaller table, whatever that.
        debug_assert!(
            self.table.capacity() < cap,
            "a shrink from {cap} made a table of {}",
            self.table.capacity()
        );
        started
    }

    /// Empties the table (both halves of a running resize).
    pub(crate) fn clear_for(&mut self, capacity: usize) {
        self.old = HashTable::new();
        self.table = HashTable::with_capacity(capacity);
    }

    /// Adds `position` to a table being rebuilt from scratch after [`PositionTable::clear_for`]
    /// (no resize starts: the table was sized for the rebuild).
    pub(crate) fn insert_rebuilt(
        &mut self,
        hash: u64,
        position: u32,
        hash_of: impl Fn(u32) -> u64,
    ) {
        self.table
            .insert_unique(hash, position, rehash_with(&hash_of));
    }

    /// Moves every position to the old table behind a new one of `capacity`; returns whether
    /// a resize runs (not when nothing was held).
    fn start_resize(&mut self, capacity: usize) -> bool {
        debug_assert!(!self.resizing());
        self.old = std::mem::replace(&mut self.table, HashTable::with_capacity(capacity));
        self.drop_old_if_empty();
        self.resizing()
    }

    fn drop_old_if_empty(&mut self) {
        if self.old.is_empty() && self.old.capacity() > 0 {
            self.old = HashTable::new();
        }
    }

    /// Bytes held by both tables (hashbrown keeps one control byte per bucket, and at least
    /// 8/7 buckets per capacity).
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        let bytes = |t: &HashTable<u32>| {
            if t.capacity() == 0 {
                0
            } else {
                (t.capacity() * 8 / 7).next_power_of_two() * (std::mem::size_of::<u32>() + 1)
            }
        };
        bytes(&self.table) + bytes(&self.old)
    }
}
