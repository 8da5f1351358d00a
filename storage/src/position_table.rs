//! `PositionTable`: the hash table under [`GuidIndex`](crate::guid_index) and
//! [`GuidWindow`](crate::guid_window) — `u32` positions into the caller's dense store (an
//! entry vector, a ring of GUIDs), found by the key stored at the position — that resizes a
//! little at a time instead of all at once.
//!
//! A hash table that runs out of room and rehashes every element in one call (as `hashbrown`
//! does, which this module used before) reads each element's key from the caller's store at a
//! random place: a cache miss each. The duplicate window stopped its partition's thread for
//! longer the more GUIDs it held, on every node at about the same moment (they all see the same
//! messages), and the index of outstanding messages did the same as a backlog grew. Every
//! ACK and delivery of the partition waited that long (docs/bench/JOURNAL.md, "No
//! stop-the-world rehash").
//!
//! So a resize (growing when the table is full, shrinking when it is less than a quarter full)
//! only allocates the new table and keeps the old one beside it; the caller then moves a few
//! positions from the old table to the new one with every operation
//! ([`PositionTable::migrate`], walking its own store in position order), until the old one
//! is empty and is freed — incremental rehashing, as Redis does for its dictionaries. With
//! [`MIGRATE_PER_OP`] positions moved per operation and the new table sized for twice what is
//! held, a resize always ends before the new table fills (a [`BucketTable`] never grows on its
//! own, and asserts that it is never filled). While a resize runs, a look-up
//! that misses the new table also probes the old one, and the old table's memory (half the
//! new one's when growing) is held until it is empty.

use crate::bucket_table::BucketTable;

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
    table: BucketTable,
    /// The table being emptied into `table` while a resize runs; otherwise empty and
    /// unallocated.
    old: BucketTable,
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

    /// Starts loading the buckets that an operation on `hash` will read, in both tables while
    /// a resize runs (see [`BucketTable::prefetch`]); returns a value to fold into
    /// `std::hint::black_box`.
    pub(crate) fn prefetch(&self, hash: u64) -> u32 {
        self.table.prefetch(hash) ^ self.old.prefetch(hash)
    }

    /// The position whose key `eq` accepts, among those hashed to `hash`.
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.table
            .find(hash, &mut eq)
            .or_else(|| self.old.find(hash, &mut eq))
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
            if let Some(removed) = self.old.remove(hash, &mut eq) {
                self.drop_old_if_empty();
                return Some(removed);
            }
        }
        if let Some(removed) = self.table.remove(hash, &mut eq) {
            return Some(removed);
        }
        let removed = self.old.remove(hash, &mut eq)?;
        self.drop_old_if_empty();
        Some(removed)
    }

    /// Adds `position` (its key hashes to `hash`; the caller checked that the key is not
    /// held). A full table starts a resize to twice what is held. Returns whether a resize
    /// started: every position held before this one is in the old table, and the caller's
    /// walk begins.
    pub(crate) fn insert(&mut self, hash: u64, position: u32) -> bool {
        let started = self.table.len() >= self.table.capacity()
            && !self.resizing()
            && self.start_resize((2 * self.len()).max(8));
        self.table.insert_unique(hash, position);
        started
    }

    /// Adds `position` unless a position whose key `eq` accepts is held. `None` when the key
    /// is held; otherwise whether a resize started, as [`PositionTable::insert`] returns.
    pub(crate) fn insert_if_absent(
        &mut self,
        hash: u64,
        position: u32,
        mut eq: impl FnMut(u32) -> bool,
    ) -> Option<bool> {
        if self.find(hash, &mut eq).is_some() {
            return None;
        }
        Some(self.insert(hash, position))
    }

    /// Points the entry of the key hashed to `hash` from position `from` to position `to`
    /// (the caller moved the entry in its store). `settled`: `to` is below the caller's
    /// migration cursor, where every position must be in the new table — an entry still in
    /// the old one moves over.
    pub(crate) fn repoint(&mut self, hash: u64, from: u32, to: u32, settled: bool) -> bool {
        if let Some(p) = self.table.find_mut(hash, |p| p == from) {
            *p = to;
            return true;
        }
        if settled {
            if self.old.remove(hash, |p| p == from).is_none() {
                return false;
            }
            self.table.insert_unique(hash, to);
            self.drop_old_if_empty();
        } else {
            let Some(p) = self.old.find_mut(hash, |p| p == from) else {
                return false;
            };
            *p = to;
        }
        true
    }

    /// Moves `position` (its key hashes to `hash`) from the old table to the new one, if it
    /// is still in the old one.
    pub(crate) fn migrate(&mut self, hash: u64, position: u32) {
        if self.old.remove(hash, |p| p == position).is_some() {
            self.table.insert_unique(hash, position);
            self.drop_old_if_empty();
        }
    }

    /// Starts shrinking to twice what is held (at least [`SHRINK_FLOOR`]) once less than a
    /// quarter of the capacity is used (not while a resize runs), when that halves the table
    /// at least. Returns whether a resize started, as [`PositionTable::insert`] returns.
    ///
    /// Below twice the floor a shrink is not worth its walk. (Under `hashbrown`, whose tables
    /// have 7/8 of a power of two of buckets, asking for the floor's 1,024 gave 1,792, and a
    /// "shrink" below twice the floor made a table as large as the one it replaced: the index
    /// of a few hundred outstanding messages was resized every ~150 messages on every node;
    /// docs/bench/JOURNAL.md, "Fewer allocations per message, and a table that resized itself
    /// every 150 messages".) Above twice the floor a quarter-full table always at least halves.
    pub(crate) fn maybe_shrink(&mut self) -> bool {
        let cap = self.table.capacity();
        if self.resizing() || cap <= 2 * SHRINK_FLOOR || cap / 4 <= self.len() {
            return false;
        }
        let started = self.start_resize((2 * self.len()).max(SHRINK_FLOOR));
        debug_assert!(
            self.table.capacity() < cap,
            "a shrink from {cap} made a table of {}",
            self.table.capacity()
        );
        started
    }

    /// Empties the table (both halves of a running resize).
    pub(crate) fn clear_for(&mut self, capacity: usize) {
        self.old = BucketTable::default();
        self.table = BucketTable::with_capacity(capacity);
    }

    /// Adds `position` to a table being rebuilt from scratch after [`PositionTable::clear_for`]
    /// (no resize starts: the table was sized for the rebuild).
    pub(crate) fn insert_rebuilt(&mut self, hash: u64, position: u32) {
        self.table.insert_unique(hash, position);
    }

    /// Moves every position to the old table behind a new one of `capacity`; returns whether
    /// a resize runs (not when nothing was held).
    fn start_resize(&mut self, capacity: usize) -> bool {
        debug_assert!(!self.resizing());
        self.old = std::mem::replace(&mut self.table, BucketTable::with_capacity(capacity));
        self.drop_old_if_empty();
        self.resizing()
    }

    fn drop_old_if_empty(&mut self) {
        if self.old.is_empty() && self.old.capacity() > 0 {
            self.old = BucketTable::default();
        }
    }

    /// Bytes held by both tables.
    #[cfg(test)]
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.table.allocated_bytes() + self.old.allocated_bytes()
    }
}
