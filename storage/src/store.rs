//! `Store`: one partition's journal on disk, with an index of what is outstanding (DESIGN.md §7,
//! "Storage for months").
//!
//! **Files.** `<dir>/journal-<n>.bmqj`, `n` = 1, 2, 3, ... (ten digits), each an 8-byte header
//! (`BMQJ` + format version, u32 little-endian) then records
//! `| body length: u32 LE | CRC32C of body: u32 LE | body: protobuf JournalRecord |`.
//! Records carry increasing sequences across segments; a new segment starts when the current
//! one reaches `segment_size_max` bytes and begins with a *marker* (a record with sequence 0
//! and kind `StoredMarker`: the base, the covered position and the lease runs), so the newest
//! segment always says where the journal stands.
//!
//! **What memory holds** — never the history: for each *outstanding* message (a message record
//! some app of its queue has not confirmed, and that was not removed) a 32-byte index entry
//! and its GUID; for each segment the sequence, offset, length and a live bit of each record
//! it still holds (16 bytes, so a record is read back with one `pread`); and a bounded cache
//! of the most recent records (`cache_bytes_max`), kept as they were written, from which
//! deliveries and replication of fresh records are served without a read. Only what this
//! node encoded itself (as primary) is cached: a replica's frames, received from its primary,
//! are written as they arrived and not kept ([`Store::append_framed`]).
//!
//! **Base, floor, and what may be removed.** A record is *live* while its message is
//! outstanding (the message record, and every confirm, failure or removal record of it); the
//! others are dead. Positions up to the **base** are *settled*: the caller raises the base to
//! what a quorum holds and every in-sync replica has ([`Store::set_base`]), so a confirm or
//! removal at or below the base can never be undone by a new primary's healing; only then does
//! it count (a confirm above the base may still be truncated by [`Store::truncate_after`]). A
//! closed segment whose records are all dead and settled is deleted; one with few live records
//! among settled dead ones is compacted (its live records copied to a new file that replaces it
//! atomically). The **floor** is the highest position no longer held: every position above it
//! is on disk, so a replica whose journal ends at or above the floor can be sent the history,
//! and one further behind receives the live state instead (an *install*, into a staged journal
//! that replaces its own only once complete: [`Store::begin_install`],
//! [`Store::finish_install`]) — as a Raft follower receives a snapshot (Raft §7).
//!
//! **Crash safety.** Before anything is deleted or compacted, a marker with the current base
//! is appended and made durable, so a restarted node knows that absent positions below it were
//! dead. A compaction writes `journal-<n>.<id>.bmqj.compact`, fsyncs it, renames it over the
//! segment and fsyncs the directory: a power loss leaves the old or the new segment, never
//! neither (a leftover `.compact` file is removed at open). The copy can run on another thread
//! while the partition goes on (`store_compaction.rs`). Deleting a segment is an unlink plus a
//! directory fsync; its blocks are freed a megabyte at a time before its file closes
//! ([`ClosedFiles::finish`]), since freeing them at once stalled every fsync of the disk. An
//! install is written to `<dir>/install/`; a `COMPLETE` file there, made durable, is the
//! commit point: at open, a complete install replaces the journal, an incomplete one is
//! discarded. At open, a *torn tail* (an incomplete record, or a last record whose checksum
//! fails, at the end of the last segment) is truncated with a warning and
//! counted in `bmq_journal_torn_tail_truncations_total`; anything else wrong is
//! [`StoreError::Corrupt`] naming the file and offset.
//!
//! **Costs.** Memory: 55 to 74 bytes per outstanding message in the index (entry and GUID, 48
//! bytes, in one dense vector grown by a quarter at a time, plus 7 to 14 bytes of hash table,
//! see `guid_index.rs`; both shrink as messages leave) plus 16 per record held on disk, plus
//! the cache. Restart: reads every retained segment once —
//! the outstanding data plus at most about two segments of dead records (compaction keeps the
//! dead bytes of closed settled segments under one segment), not the history. Disk:
//! outstanding bytes plus about two segments, plus what is not yet settled, plus the spare
//! (see "Recycling").
//!
//! **Writes.** A new segment's space is reserved when it is created (`fallocate` with
//! `FALLOC_FL_KEEP_SIZE`: the file's length stays what is written). Appends within the
//! reservation wait in a write-behind buffer and reach the file in one `pwrite` at the next
//! [`Store::sync`] (or once the buffer passes 1 MiB), so a batch of appends costs one system
//! call; reads of records still in the buffer are served from it. Nothing changes for
//! durability: a record counts as durable only after [`Store::sync`], and a crash before it
//! loses the same records as a power loss would. Where the file system cannot reserve, every
//! append is written at once.
//!
//! **Recycling.** An `fdatasync` of a file that grew also writes its inode (the new length),
//! a second synchronous write after the data on this project's ext4; writing over blocks the
//! file already holds needs none. So a deleted segment whose file is full is not removed: it
//! becomes the *spare* (`<dir>/spare.bmqj-spare`, at most one), and the next roll-over writes
//! the new segment over it (as RocksDB and PostgreSQL recycle log files): its header (format
//! version 3, "recycled") and first marker are written over the start and fsynced before the
//! rename to `journal-<n>.bmqj`, so a segment of that name never starts with an earlier
//! life's header. Such a file holds an earlier life's bytes after its records, so in the *last*
//! segment, if recycled, the records end at the first one that is incomplete, fails its
//! checksum, does not decode, or is not this life's: a record of any position but the next (an
//! earlier life's are all below where the segment started: it was deleted settled and dead)
//! or a marker naming another segment (markers carry their segment's number; an install, which
//! numbers segments afresh, removes the spare). Everything from there is cut at open, as a
//! torn tail is (logged, not counted: after a clean stop it is the normal case). A recycled
//! segment is cut to its length when it closes, so closed segments keep the strict rules (a
//! bad record is corruption). A record whose checksum fails there but that is followed by an
//! intact record of this life was damaged in place, not torn, and is corruption too; only a
//! damaged *last* record looks like a torn write and is cut as one (as in those systems).
//! Measured: the block requests per
//! `fdatasync` fell from 2.0 to 1.5-1.7 and the mean fsync by 13-25% (docs/bench/JOURNAL.md,
//! "Recycled segments"). Disk use: up to one segment more per partition (the spare).
//!
//! **Corruption.** A corrupt record found at open fails it ([`StoreError::Corrupt`]); the
//! partition then sets the journal aside ([`Store::quarantine`]: to `<dir>/corrupt/`) and
//! starts empty, marked [`Store::needs_install`] — it may lack records it acknowledged, so
//! it counts in no healing quorum until a primary has brought it up to date. One found on a
//! read is never delivered or sent: the read fails, and the node stops (its next open finds
//! it). The highest lease the node served as primary is kept outside the journal
//! (`lease_mark.rs`), since a journal set aside no longer tells.
//!
//! **Apps of a queue.** A message waits for each app of its queue (one bit per app slot in its
//! index entry; a confirm or removal for that app clears it; with none left it is done). A
//! queue's slots are set by the first record the index reads of it: a `StoredQueueApps` (the
//! primary writes one before the first message of a fanout queue its journal does not know)
//! gives its app ids, a message the ones the domain lists then (`apps_of`). A later
//! `StoredQueueApps` at position `S` changes them in journal order — on the primary as it
//! appends, on a replica as it receives, at open as it reads — so every node that holds the
//! record agrees: an app it adds gets a new slot that only messages after `S` wait for; an app it
//! removes has its slot made a tombstone (never shifted; reused by a later addition only once
//! the removal is settled, should all 64 be taken) and, once the base passes `S`, every message
//! before `S` is done with it (logged with the count; a message no other app waits for leaves
//! the index, as after its last confirm). No record is written per message. A truncation of the
//! record undoes the change (the slots before it are kept aside until the base passes it). The
//! record itself is dead at once (it is no message's), so compaction and deletion may drop it
//! once settled; what a node that reads the journal again (a restart, or an install, which
//! sends live records only) sees then:
//! - the record still held: exactly the above. A queue first read through a message has the
//!   slots the domain lists *now*; a record that adds an app such a slot already holds makes
//!   every message before it done with that app (it was not the queue's app when they were
//!   stored), so a message stored before an app was added does not go to it.
//! - the record dropped: the messages stored before it that are read again (the outstanding
//!   ones, and done ones whose segment is still held) have the slots the domain lists now. A removed app is in none of them (unless it was added again
//!   since: then it gets those messages again); an **added app also gets the messages stored
//!   before it was added** — extra copies for the new app, never fewer for the others. Messages
//!   after the record read the same slots as before the restart.
//!
//! **Disk full.** A full disk shows when a segment is created (its reservation fails) or, without
//! a reservation, when a write fails with `ENOSPC`: the append is rolled back (a segment it
//! created is removed, the segment cut back to its length before the write), nothing already
//! written is touched, and [`StoreError::NoSpace`] is returned: the caller refuses new writes
//! until space returns. A configured quota (`quota_bytes`) is checked by the caller before a
//! write ([`Store::would_exceed_quota`]).

use crate::disk::{Disk, FileRef, FileSync, Open, RealDisk};
use crate::frame;
use crate::lease_mark::{LeaseMark, LEASE_MARK_NAME};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bmq_proto::peer::{journal_record::Kind as RecordKind, JournalRecord, LeaseRun, StoredMarker};
use bmq_proto::uri_text;

use crate::guid_index::GuidIndex;
use crate::record_view::{facts_of, parse_facts, FactKind, RecordFacts};
use bytes::{Bytes, BytesMut};
use compaction::Compacting;
pub use compaction::{CompactionDone, CompactionTicket};
use prost::Message;
use tracing::{info, warn};

/// Segment file header: magic `BMQJ` then the format version.
const MAGIC: &[u8; 4] = b"BMQJ";
/// The format written: version 2 (markers; positions below the base may be absent). Version 1
/// segments (no markers, no gaps) are read too.
const VERSION: u32 = 2;
/// The format of a *recycled* segment (see "Recycling" in the module doc): version 2's
/// records in a file that may hold an earlier segment's bytes after them.
const VERSION_RECYCLED: u32 = 3;
/// Bytes of a segment header.
const HEADER_LEN: u64 = 8;
/// Name of the spare file under the store's directory: a deleted segment kept for the next
/// roll-over to write over (see "Recycling" in the module doc).
const SPARE_NAME: &str = "spare.bmqj-spare";
/// Bytes of a record header (length + CRC32C: [`crate::frame`]).
const RECORD_HEADER_LEN: usize = frame::HEADER_LEN;
/// The largest record body accepted, bytes; a longer length field is corruption.
pub const RECORD_SIZE_MAX: usize = 64 * 1024 * 1024;
/// The most app ids a queue's messages are tracked for (a fanout domain's apps); more are
/// refused by the configuration.
pub const APPS_MAX: usize = 64;
/// Most bytes appended to the active segment that wait in memory for one write (see
/// [`Store::sync`]); beyond, they are written at once.
const PENDING_BYTES_MAX: usize = 1 << 20;
/// Name of the staged journal of an install, under the store's directory.
const INSTALL_DIR: &str = "install";
/// The commit point of an install (see the module doc).
const INSTALL_COMPLETE: &str = "COMPLETE";
/// Name of the file under the store's directory that says its journal was set aside as
/// corrupt ([`Store::quarantine`]) and must be re-installed from a primary before the node
/// counts in a healing quorum again ([`Store::needs_install`]).
const NEEDS_INSTALL: &str = "NEEDS_INSTALL";
/// Where [`Store::quarantine`] moves a corrupt journal's files, under the store's directory
/// (the last one only).
pub const QUARANTINE_DIR: &str = "corrupt";

/// Settings of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Size at which a segment is closed and a new one started, bytes.
    pub segment_size_max: u64,
    /// Most bytes of recent records (as framed on disk, plus [`CACHE_ENTRY_BYTES`] each) kept
    /// in memory for reads without I/O.
    pub cache_bytes_max: u64,
    /// Most bytes the partition's segments may take on disk; 0 = no quota.
    pub quota_bytes: u64,
    /// Whether [`Store::sync`] calls `fsync` (false only where durability is simulated).
    pub fsync: bool,
    /// Whether a deleted full segment is kept as the spare the next roll-over writes over
    /// (see "Recycling" in the module doc). Off, a spare left by an earlier run is removed at
    /// open.
    pub recycle: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            segment_size_max: 32 * 1024 * 1024,
            cache_bytes_max: 32 * 1024 * 1024,
            quota_bytes: 0,
            fsync: true,
            recycle: true,
        }
    }
}

/// What can go wrong with a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A read, write, fsync or directory operation failed.
    #[error("journal i/o on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The device is full (`ENOSPC`): the write was rolled back, nothing written is lost.
    #[error("journal disk full writing {path}: the write was rolled back")]
    NoSpace {
        /// The file being written.
        path: PathBuf,
    },
    /// The journal holds data that is not a valid record where one must be.
    #[error("journal corrupt in {path} at byte offset {offset}: {reason}")]
    Corrupt {
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the bad record (or header) in that file.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// An append out of order: `expected` was the lowest sequence acceptable.
    #[error("journal append out of order: expected sequence {expected}, got {got}")]
    OutOfOrder {
        /// The lowest acceptable sequence.
        expected: u64,
        /// The sequence of the record offered.
        got: u64,
    },
}

impl StoreError {
    /// Whether this is a full device (the caller may retry once space returns).
    pub fn is_no_space(&self) -> bool {
        matches!(self, StoreError::NoSpace { .. })
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| {
        if source.kind() == std::io::ErrorKind::StorageFull {
            StoreError::NoSpace {
                path: path.to_path_buf(),
            }
        } else {
            StoreError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

fn segment_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("journal-{n:010}.bmqj"))
}

/// The spare file of the store in `dir` (see "Recycling" in the module doc).
fn spare_path(dir: &Path) -> PathBuf {
    dir.join(SPARE_NAME)
}

fn sync_dir(disk: &dyn Disk, dir: &Path) -> Result<(), StoreError> {
    disk.sync_dir(dir).map_err(io(dir))
}

/// A message GUID as a map key: its 16 bytes, big-endian (shorter ones are zero-padded,
/// longer ones cut, so a malformed GUID can never panic here).
pub fn guid_key(guid: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    let n = guid.len().min(16);
    b[..n].copy_from_slice(&guid[..n]);
    u128::from_be_bytes(b)
}

/// Says for which app ids a queue's messages are stored: the fanout app ids of its domain, or
/// `[""]` (also for a domain no longer configured, so its messages are kept, not dropped).
pub type AppsOf = Arc<dyn Fn(&str) -> Vec<String> + Send + Sync>;

/// A record held in a segment: 16 bytes.
#[derive(Debug, Clone, Copy)]
struct Held {
    sequence: u64,
    offset: u32,
    /// Framed length, with [`LIVE`] set while the record is live.
    len_live: u32,
}

/// The live bit of [`Held::len_live`] (a framed length is below 2^31: see [`RECORD_SIZE_MAX`]).
const LIVE: u32 = 1 << 31;

impl Held {
    fn len(&self) -> u32 {
        self.len_live & !LIVE
    }

    fn live(&self) -> bool {
        self.len_live & LIVE != 0
    }
}

#[derive(Debug)]
struct Segment {
    no: u32,
    path: PathBuf,
    /// Shared with a [`SyncTicket`] whose fsync runs on another thread.
    file: FileRef,
    /// Bytes of the segment: on the file, plus (active segment) the store's write-behind buffer.
    len: u64,
    /// Bytes written to the file; `len - written` wait in [`Store::pending`].
    written: u64,
    /// Bytes reserved for the file with `fallocate` (0: none, every write goes straight to the
    /// file). Writes within the reservation cannot fail for a full disk, so they may wait in
    /// the write-behind buffer until the next [`Store::sync`].
    reserved: u64,
    /// Bytes made durable by the last fsync (for simulated crashes).
    synced_len: u64,
    /// Created, but its inode and directory entry are not known durable yet: the next sync
    /// (its [`SyncTicket`] names the directory) fsyncs both before anything in it counts as
    /// durable.
    fresh: bool,
    /// A recycled file (format [`VERSION_RECYCLED`]): it may hold an earlier segment's bytes
    /// after `len`, so it is cut to `len` when it closes.
    recycled: bool,
    /// Records held, ascending sequence (markers excluded).
    records: Vec<Held>,
    live: u64,
    live_bytes: u64,
    /// Confirm, failure and removal records (in this or later segments) of dead messages whose
    /// message record is still in this segment: they stay live until it is gone, or a restart
    /// would find the message without its confirm and bring it back.
    pins: Vec<u64>,
    /// How many of `pins` are records of this very segment (a message and its confirm in one
    /// segment): they stay live while the segment exists, so an install that already sent
    /// the message also sends its confirm; the segment may still be deleted when they are its
    /// only live records.
    self_pinned: u64,
    /// The dead bytes its last compaction left (records it had to keep, its marker): no
    /// compaction can reclaim them until more of its records die, so they do not count
    /// towards compacting it again (a segment chosen again and again for bytes its copy keeps
    /// kept an idle node compacting without end: replication simulator).
    unreclaimable: u64,
}

impl Segment {
    fn first_sequence(&self) -> Option<u64> {
        self.records.first().map(|r| r.sequence)
    }

    fn last_sequence(&self) -> Option<u64> {
        self.records.last().map(|r| r.sequence)
    }

    fn dead_bytes(&self) -> u64 {
        (self.len - HEADER_LEN).saturating_sub(self.live_bytes)
    }

    /// Dead bytes a compaction could remove.
    fn reclaimable(&self) -> u64 {
        self.dead_bytes().saturating_sub(self.unreclaimable)
    }
}

/// One outstanding message as the index holds it: 32 bytes.
#[derive(Debug)]
struct Entry {
    sequence: u64,
    /// Payload bytes.
    size: u32,
    /// Index in [`Store::queues`].
    queue: u32,
    /// Bit `i`: app `i` of the queue has not confirmed it nor had it removed (as of the base).
    pending: u64,
    /// Consumer failures and attached records; most messages have none.
    extra: Option<Box<Extra>>,
}

#[derive(Debug, Default)]
struct Extra {
    /// `(app index, consumer failures)`, as of the base.
    failures: Vec<(u8, u32)>,
    /// Sequences of the confirm, failure and removal records of this message that took effect
    /// while it stayed outstanding (they die with it).
    records: Vec<u64>,
}

/// What a record above the base will do to the index once the base passes it.
#[derive(Debug, Clone, Copy)]
enum Effect {
    /// App `app` is done with the message (confirm or removal).
    Done { guid: u128, app: u8 },
    /// The message's consumer failures for `app` are `failures`.
    Failed { guid: u128, app: u8, failures: u32 },
    /// App slot `app` of queue `queue` is done with every message of the queue stored before
    /// position `before` (a `StoredQueueApps` removed the app, or added one that slot already
    /// held only because the domain listed it when the queue was first read: see "Apps of a
    /// queue" in the module doc).
    AppGone { queue: u32, app: u8, before: u64 },
}

/// A queue as the index knows it: its URI and its app slots.
#[derive(Debug, Clone)]
struct QueueInfo {
    uri: String,
    /// The app of each slot: bit `i` of a message's `pending` is `apps[i]`. Slots never
    /// shift; a removed app's slot stays, a tombstone, reused only once its removal is
    /// settled (see "Apps of a queue" in the module doc).
    apps: Vec<String>,
    /// Bit `i`: slot `i` is one of the queue's apps now (what a new message waits for).
    live: u64,
    /// Per slot, the position of the `StoredQueueApps` that removed its app (0: live).
    gone_at: Vec<u64>,
}

impl QueueInfo {
    fn new(uri: &str, mut apps: Vec<String>) -> QueueInfo {
        if apps.is_empty() {
            apps.push(String::new());
        }
        apps.truncate(APPS_MAX);
        QueueInfo {
            uri: uri.to_string(),
            live: mask_of(apps.len()),
            gone_at: vec![0; apps.len()],
            apps,
        }
    }

    /// The slot of live app `app`.
    fn live_slot(&self, app: &str) -> Option<usize> {
        self.apps
            .iter()
            .enumerate()
            .position(|(i, a)| self.live & (1u64 << i) != 0 && a == app)
    }

    /// The apps now, in slot order.
    fn live_apps(&self) -> impl Iterator<Item = &str> {
        self.apps
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live & (1u64 << i) != 0)
            .map(|(_, a)| a.as_str())
    }
}

/// The mask of slots `0..n`.
fn mask_of(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// A queue's apps before a `StoredQueueApps` above the base changed them: what a truncation
/// of that record puts back.
#[derive(Debug)]
struct AppsUndo {
    sequence: u64,
    queue: u32,
    before: QueueInfo,
}

/// An outstanding message, as a new primary rebuilds its queues from it
/// ([`Store::outstanding`]): every record held taken into account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outstanding {
    /// Sequence of the message's record.
    pub sequence: u64,
    /// The queue.
    pub uri: String,
    /// The GUID, as a key ([`guid_key`]).
    pub guid: u128,
    /// Payload bytes.
    pub size: u32,
    /// `(app id, consumer failures)` of every app that still has to confirm it.
    pub apps: Vec<(String, u32)>,
}

/// An outstanding message borrowed from the store ([`Store::for_each_outstanding`]).
#[derive(Debug, Clone, Copy)]
pub struct OutstandingRef<'a> {
    /// Sequence of the message's record.
    pub sequence: u64,
    /// The queue.
    pub uri: &'a str,
    /// The GUID, as a key ([`guid_key`]).
    pub guid: u128,
    /// Payload bytes.
    pub size: u32,
    /// `(app id, consumer failures)` of every app that still has to confirm it.
    pub apps: &'a [(&'a str, u32)],
}

/// Counts of a store, for gauges and `/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Bytes of every segment file.
    pub bytes: u64,
    /// Segment files.
    pub segments: usize,
    /// Outstanding messages.
    pub outstanding: usize,
    /// Bytes of live records (outstanding messages and their confirms/failures).
    pub live_bytes: u64,
    /// Highest settled position.
    pub base: u64,
    /// Highest position no longer held.
    pub floor: u64,
    /// Highest position held.
    pub last_sequence: u64,
    /// Highest position fsynced.
    pub durable: u64,
    /// Bytes of the records cached in memory (as framed on disk, plus [`CACHE_ENTRY_BYTES`]
    /// each).
    pub cache_bytes: u64,
}

/// What [`Store::maintain`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintenance {
    /// Segments deleted (every record dead and settled).
    pub deleted: usize,
    /// Segments compacted (their live records copied to a new file).
    pub compacted: usize,
    /// Bytes freed on disk.
    pub freed_bytes: u64,
}

/// The write-behind buffer of the active segment: the frames appended since the last write,
/// kept as the slices of the cache's blocks they were staged in (no copy), written with
/// `pwritev`.
#[derive(Debug, Default)]
struct WriteBehind {
    chunks: Vec<Bytes>,
    len: usize,
}

impl WriteBehind {
    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push(chunk);
        }
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.len = 0;
    }

    /// Keeps the first `keep` bytes.
    fn truncate(&mut self, keep: usize) {
        let mut total = 0;
        let mut n = 0;
        while n < self.chunks.len() && total + self.chunks[n].len() <= keep {
            total += self.chunks[n].len();
            n += 1;
        }
        if n < self.chunks.len() && total < keep {
            self.chunks[n].truncate(keep - total);
            total = keep;
            n += 1;
        }
        self.chunks.truncate(n);
        self.len = total;
    }

    /// A copy of bytes `start..end`, or `None` when they are not all here.
    fn copy_range(&self, start: usize, end: usize) -> Option<Vec<u8>> {
        if start > end || end > self.len {
            return None;
        }
        let mut out = Vec::with_capacity(end - start);
        let mut at = 0;
        for chunk in &self.chunks {
            let (from, to) = (at, at + chunk.len());
            at = to;
            if to <= start {
                continue;
            }
            if from >= end {
                break;
            }
            out.extend_from_slice(&chunk[start.max(from) - from..end.min(to) - from]);
        }
        Some(out)
    }

    /// Writes every byte at `offset` of `file` (one vectored write: `pwritev`, as many calls
    /// as it takes).
    fn write_at(&self, file: &FileRef, offset: u64) -> std::io::Result<()> {
        let slices: Vec<std::io::IoSlice<'_>> = self
            .chunks
            .iter()
            .map(|c| std::io::IoSlice::new(c))
            .collect();
        file.write_vectored_at(&slices, offset).map(|_| ())
    }
}

/// What a file of a deleted segment is renamed to until it is removed ([`ClosedFiles`]).
const DELETED_SUFFIX: &str = ".bmqj.deleted";

fn deleted_path(path: &Path) -> PathBuf {
    let mut name = path.file_stem().unwrap_or_default().to_os_string();
    name.push(DELETED_SUFFIX);
    path.with_file_name(name)
}

/// Segment files a store with deferred closing let go of ([`Store::take_closed_files`]): to
/// remove and close on another thread with [`ClosedFiles::finish`], so the partition never
/// waits while the kernel frees a segment's pages and blocks.
#[derive(Debug, Default)]
pub struct ClosedFiles {
    /// The disk they are on (set by the store that fills the list).
    disk: Option<Arc<dyn Disk>>,
    files: Vec<FileRef>,
    /// Renamed files of deleted segments, to remove.
    unlink: Vec<PathBuf>,
    /// The directory to fsync once they are removed.
    sync_dir: Option<PathBuf>,
}

impl ClosedFiles {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.unlink.is_empty()
    }

    /// Removes the deleted segments' files, closes every file and fsyncs the directory. A
    /// file whose last handle this is and that no name refers to any more (a deleted segment,
    /// one a compaction replaced) has its blocks freed a step at a time first
    /// ([`crate::release::release_gradually`]: freed at once, they held every fsync of the
    /// disk, on every node together). Blocks for tens of milliseconds.
    /// Errors: the first removal or fsync that failed (the space is then reclaimed at the
    /// next open, which removes `.deleted` files); the rest is still done.
    pub fn finish(self) -> std::io::Result<()> {
        let mut result = Ok(());
        let disk: Arc<dyn Disk> = self.disk.unwrap_or_else(|| Arc::new(RealDisk));
        for path in &self.unlink {
            if let Err(e) = disk.remove_file(path) {
                result = result.and(Err(e));
            }
        }
        for file in self.files {
            if Arc::strong_count(&file) == 1 {
                file.release();
            }
        }
        if let Some(dir) = &self.sync_dir {
            if let Err(e) = disk.sync_dir(dir) {
                result = result.and(Err(e));
            }
        }
        result
    }
}

/// An fsync of a journal segment that [`Store::begin_sync`] left to the caller, so that it
/// can run on another thread while the store takes more appends (group commit without
/// stopping the partition; see [`Store::complete_sync`]). Covers every position held when
/// it was issued.
#[derive(Debug)]
pub struct SyncTicket {
    /// The segment's sync; for a new segment (`Segment::fresh`) its directory's too.
    sync: FileSync,
    path: PathBuf,
    segment: u32,
    /// Bytes of the segment written when the ticket was issued.
    len: u64,
    /// The last position held when the ticket was issued.
    through: u64,
    /// The base of the last marker written when the ticket was issued.
    marked_base: u64,
    epoch: u64,
    /// Whether [`SyncTicket::run`] fsyncs (the store's setting; off in tests).
    fsync: bool,
    /// The primary-lease mark raised since its last fsync: its file and value (see
    /// `lease_mark.rs`).
    lease_mark: Option<(FileRef, u64)>,
}

impl SyncTicket {
    /// Runs the fsync (`fdatasync`; for a new segment `fsync` of the file and of its
    /// directory); blocks for as long as the disk takes.
    pub fn run(&self) -> std::io::Result<()> {
        if !self.fsync {
            return Ok(());
        }
        self.sync.run()?;
        match &self.lease_mark {
            Some((file, _)) => file.sync_data(),
            None => Ok(()),
        }
    }

    /// The last position this ticket makes durable.
    pub fn through(&self) -> u64 {
        self.through
    }
}

/// One partition's journal with its index (see the module doc).
pub struct Store {
    /// The disk the journal's files are on.
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    cfg: StoreConfig,
    apps_of: AppsOf,
    segments: Vec<Segment>,
    /// Highest position held or accounted for.
    last_sequence: u64,
    /// `(lease, first sequence)` of each run of equal leases, every position up to
    /// `last_sequence` (absent ones included).
    runs: Vec<(u64, u64)>,
    base: u64,
    floor: u64,
    /// The base and covered position of the last marker written.
    marked: (u64, u64),
    /// The base rose since the last [`Store::maintain`]: settled dead records may be removable.
    maintenance_due: bool,
    /// GUIDs that left the index (every app done, settled) since [`Store::take_retired`].
    retired: Vec<u128>,
    /// Calls of [`Store::maintain`] that deleted or compacted something, ever (this process).
    maintenance_epoch: u64,
    durable: u64,
    /// Bumped by every change that drops positions (a truncation, an install): a
    /// [`SyncTicket`] issued before it no longer says anything about what is durable.
    sync_epoch: u64,
    /// Whether files of removed segments are kept for [`Store::take_closed_files`] instead of
    /// closed here ([`Store::set_defer_close`]).
    defer_close: bool,
    /// Files of removed or replaced segments, for the caller to close elsewhere.
    closed_files: ClosedFiles,
    /// The base of the newest marker known durable (see [`Store::maintain`]).
    durable_marked_base: u64,
    /// Segments found dead at a base whose marker is not durable yet: `(base, numbers)`,
    /// deleted once it is.
    pending_deletion: Option<(u64, Vec<u32>)>,
    /// A spare file ([`SPARE_NAME`]) waits for the next roll-over.
    spare: bool,
    /// Whether a compaction's copy is left to the caller ([`Store::take_compaction`]) instead
    /// of run in the call that starts it ([`Store::set_background_compaction`]).
    background_compaction: bool,
    /// The compaction under way, if any (see `store_compaction.rs`).
    compacting: Option<Compacting>,
    /// Its copy, until the caller takes it.
    compaction_out: Option<CompactionTicket>,
    /// Outstanding messages, by GUID.
    index: GuidIndex<Entry>,
    /// Effects of records above the base, in sequence order.
    effects: VecDeque<(u64, Effect)>,
    /// Reused buffers of an append (so that appending a record allocates nothing): the
    /// effects of the records being indexed, and the `(offset, length)` of the frames staged
    /// in the cache's block. Empty between calls.
    effects_scratch: Vec<(u64, Effect)>,
    staged_scratch: Vec<(u32, u32)>,
    /// Tests: writes of the active segment fail (an I/O error) once this many more have
    /// succeeded, to check rollbacks.
    #[cfg(test)]
    fail_writes_after: Option<usize>,
    queues: Vec<QueueInfo>,
    /// The queues' apps before each `StoredQueueApps` above the base, oldest first (what a
    /// truncation restores; dropped as the base passes them).
    apps_undo: Vec<AppsUndo>,
    /// `queues` positions by URI (foldhash: one look-up per record appended or loaded).
    queue_ids: HashMap<String, u32, foldhash::quality::RandomState>,
    /// Framed records of the active segment not yet written to its file (offsets `written..len`):
    /// written in one `pwritev` at the next [`Store::sync`] (or when over [`PENDING_BYTES_MAX`]),
    /// so a batch of appends costs one system call, not one each.
    pending: WriteBehind,
    /// The most recent records, ascending sequence, as written (see [`Cached`]).
    cache: VecDeque<Cached>,
    cache_bytes: u64,
    /// The block the next written records are copied into for the cache (see [`Cached`]).
    cache_block: BytesMut,
    bytes_total: u64,
    live_bytes: u64,
    /// The primary-lease mark beside the journal (`None` for an install's staged journal,
    /// which takes the live one's at the end).
    lease_mark: Option<LeaseMark>,
    /// The journal was set aside as corrupt and must be re-installed ([`Store::needs_install`]).
    needs_install: bool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// A cached record: its frame (header and body), as written to the segment.
///
/// The cache keeps what was written, not the decoded records: a decoded record's byte fields
/// are slices of whatever buffer it was decoded from — a client's or a peer's read buffer — and
/// each one kept alive its whole buffer (heaptrack of a primary with 8 MiB of cached messages
/// showed 18 MB held by the peer link's frame buffers). The written bytes are copied into
/// blocks of [`CACHE_BLOCK`] bytes, one after the other, so a block is one allocation for many
/// records and is freed when the last of them leaves the cache (oldest first); a read decodes
/// the body (zero-copy for the payload) instead of cloning a record, and a primary streams the
/// frames to its replicas as they are ([`Store::read_frames_from`]).
#[derive(Debug)]
struct Cached {
    sequence: u64,
    frame: Bytes,
}

/// Size of the blocks the cache copies written records into (a larger write gets a block of
/// its own).
const CACHE_BLOCK: usize = 256 * 1024;

/// Bytes counted for a cached record besides its framed length: its entry in the cache.
pub const CACHE_ENTRY_BYTES: u64 = std::mem::size_of::<Cached>() as u64;

/// Bytes of a record that count against a read's byte bound ([`Store::read_from`]).
fn cached_size(record: &JournalRecord) -> u64 {
    match &record.kind {
        Some(RecordKind::Message(m)) => m.payload.len() as u64 + 64,
        _ => 64,
    }
}

/// `records` as journal frames, one after another (what [`FramedBatch::split`] reads): the form
/// in which a primary streams fresh records to its replicas.
pub fn encode_frames(records: &[JournalRecord]) -> Bytes {
    let mut buf = Vec::new();
    for record in records {
        frame(record, &mut buf);
    }
    Bytes::from(buf)
}

/// One frame of a [`FramedBatch`]: where it is in the batch's bytes and what the index needs
/// of its record (borrowed from those bytes).
#[derive(Debug, Clone, Copy)]
struct BatchFrame<'a> {
    /// Offset of the frame's header in the batch.
    start: usize,
    /// The frame's length, header included.
    len: usize,
    facts: RecordFacts<'a>,
}

/// Journal frames one after another (`| body length: u32 LE | CRC32C of body: u32 LE | body
/// |`, the records of a `ReplicateRecords` as the sender's journal holds them), checked and
/// read in place ([`FramedBatch::split`]): a replica writes them as they arrived
/// ([`Store::append_framed`]) and indexes each record from its frame's bytes, with no decoded
/// `JournalRecord` and no reference count taken per field (see [`crate::record_view`]).
#[derive(Debug)]
pub struct FramedBatch<'a> {
    data: &'a Bytes,
    frames: Vec<BatchFrame<'a>>,
}

impl<'a> FramedBatch<'a> {
    /// Splits `data` into its frames, checking each: length, checksum, body (what
    /// `JournalRecord::decode` accepts). Errors: a truncated frame, a length over
    /// [`RECORD_SIZE_MAX`], a checksum mismatch, a body that does not decode, or a marker
    /// (never replicated).
    pub fn split(data: &'a Bytes) -> Result<FramedBatch<'a>, String> {
        let mut frames = Vec::new();
        let mut pos = 0;
        while pos < data.len() {
            let (body, len) = frame::read(&data[pos..], RECORD_SIZE_MAX)
                .map_err(|damage| format!("{damage} in the frame at byte {pos}"))?;
            let facts = parse_facts(body)
                .map_err(|e| format!("frame at byte {pos} does not decode: {e}"))?;
            if matches!(facts.kind, FactKind::Marker) {
                return Err(format!("a marker in the frame at byte {pos}"));
            }
            frames.push(BatchFrame {
                start: pos,
                len,
                facts,
            });
            pos += len;
        }
        Ok(FramedBatch { data, frames })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// The position (`JournalRecord.sequence`) of record `i`. Panics when `i >= len()`.
    pub fn sequence(&self, i: usize) -> u64 {
        self.frames[i].facts.sequence
    }

    /// The index of the first record whose position is above `sequence` (positions rise, as
    /// [`Store::append_framed`] requires; `len()` when none is).
    pub fn first_above(&self, sequence: u64) -> usize {
        self.frames
            .partition_point(|f| f.facts.sequence <= sequence)
    }

    /// The frames of records `range`, one slice of the batch's bytes (no copy).
    fn bytes_of(&self, range: std::ops::Range<usize>) -> Bytes {
        let (first, last) = (&self.frames[range.start], &self.frames[range.end - 1]);
        self.data.slice(first.start..last.start + last.len)
    }
}

/// What [`Store::append_with`] appends: decoded records (a primary's, a sync's, an install's,
/// or an older primary's replication), or the records of a [`FramedBatch`] from its `from`-th
/// on (a replica's replication, as received). Positions strictly increase in both.
#[derive(Clone, Copy)]
pub enum Appending<'r, 'b> {
    /// Decoded records.
    Records(&'r [JournalRecord]),
    /// The records of a framed batch from the given index on.
    Frames(&'r FramedBatch<'b>, usize),
}

impl Appending<'_, '_> {
    /// Records to append.
    pub fn len(&self) -> usize {
        match self {
            Appending::Records(r) => r.len(),
            Appending::Frames(b, from) => b.len().saturating_sub(*from),
        }
    }

    /// Whether there is nothing to append.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The position of the `i`-th record appended (below [`Appending::len`]), and whether it
    /// is a marker (never in a framed batch: [`FramedBatch::split`] refuses them).
    pub fn position(&self, i: usize) -> (u64, bool) {
        match self {
            Appending::Records(r) => (
                r[i].sequence,
                matches!(r[i].kind, Some(RecordKind::Marker(_))),
            ),
            Appending::Frames(b, from) => (b.sequence(from + i), false),
        }
    }

    /// The index of the first record whose position is above `sequence` ([`Appending::len`]
    /// when none is).
    pub fn first_above(&self, sequence: u64) -> usize {
        match self {
            Appending::Records(r) => r.partition_point(|x| x.sequence <= sequence),
            Appending::Frames(b, from) => b.first_above(sequence).max(*from) - from,
        }
    }

    /// The same records without the first `n` (all of them when `n` is past the end).
    pub fn skip(self, n: usize) -> Self {
        match self {
            Appending::Records(r) => Appending::Records(&r[n.min(r.len())..]),
            Appending::Frames(b, from) => Appending::Frames(b, (from + n).min(b.len())),
        }
    }
}

fn proto_runs(runs: &[(u64, u64)]) -> Vec<LeaseRun> {
    runs.iter()
        .map(|(lease, first)| LeaseRun {
            lease: *lease,
            first_sequence: *first,
        })
        .collect()
}

impl Store {
    /// Opens (or creates) the store in `dir` and rebuilds its index from the retained
    /// segments; `apps_of` says for which app ids each queue's messages are stored. Finishes a
    /// complete install or discards an incomplete one, truncates a torn tail; anything else
    /// wrong is [`StoreError::Corrupt`].
    pub fn open(dir: &Path, cfg: StoreConfig, apps_of: AppsOf) -> Result<Store, StoreError> {
        Store::open_on(Arc::new(RealDisk), dir, cfg, apps_of)
    }

    /// [`Store::open`] on `disk` (the simulators' [`crate::disk::SimDisk`], or the real one).
    ///
    /// Errors: as [`Store::open`].
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: &Path,
        cfg: StoreConfig,
        apps_of: AppsOf,
    ) -> Result<Store, StoreError> {
        Store::open_in(disk, dir, cfg, apps_of, true)
    }

    /// [`Store::open_on`]; `live`: the journal a partition serves (with its primary-lease
    /// mark and install marker), not an install's staged one.
    fn open_in(
        disk: Arc<dyn Disk>,
        dir: &Path,
        cfg: StoreConfig,
        apps_of: AppsOf,
        live: bool,
    ) -> Result<Store, StoreError> {
        disk.create_dir_all(dir).map_err(io(dir))?;
        recover_install(&*disk, dir)?;
        let lease_mark = if live {
            let path = dir.join(LEASE_MARK_NAME);
            Some(LeaseMark::open(&*disk, dir, cfg.fsync).map_err(io(&path))?)
        } else {
            None
        };
        let needs_install = live && disk.exists(&dir.join(NEEDS_INSTALL));
        let mut numbers: Vec<u32> = Vec::new();
        let mut spare = false;
        for path in disk.read_dir(dir).map_err(io(dir))? {
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if name.ends_with(DELETED_SUFFIX) {
                // A deleted segment whose file the node had not removed yet.
                disk.remove_file(&path).map_err(io(&path))?;
                continue;
            }
            if name == SPARE_NAME {
                if cfg.recycle {
                    spare = true;
                } else {
                    disk.remove_file(&path).map_err(io(&path))?;
                }
                continue;
            }
            if compaction::is_copy(&name) {
                // A compaction the node did not finish: the segment it was to replace is
                // intact.
                warn!(path = %path.display(), "unfinished journal compaction removed");
                disk.remove_file(&path).map_err(io(&path))?;
                continue;
            }
            if let Some(n) = name
                .strip_prefix("journal-")
                .and_then(|s| s.strip_suffix(".bmqj"))
                .and_then(|s| s.parse::<u32>().ok())
            {
                numbers.push(n);
            }
        }
        numbers.sort_unstable();
        let mut store = Store {
            disk,
            dir: dir.to_path_buf(),
            cfg: StoreConfig {
                segment_size_max: cfg.segment_size_max.max(HEADER_LEN + 1),
                ..cfg
            },
            apps_of,
            segments: Vec::new(),
            last_sequence: 0,
            runs: Vec::new(),
            base: 0,
            floor: 0,
            marked: (0, 0),
            maintenance_due: false,
            retired: Vec::new(),
            maintenance_epoch: 0,
            durable: 0,
            sync_epoch: 0,
            defer_close: false,
            closed_files: ClosedFiles::default(),
            durable_marked_base: 0,
            pending_deletion: None,
            spare,
            background_compaction: false,
            compacting: None,
            compaction_out: None,
            index: GuidIndex::new(),
            effects: VecDeque::new(),
            effects_scratch: Vec::new(),
            staged_scratch: Vec::new(),
            #[cfg(test)]
            fail_writes_after: None,
            queues: Vec::new(),
            apps_undo: Vec::new(),
            queue_ids: HashMap::default(),
            pending: WriteBehind::default(),
            cache: VecDeque::new(),
            cache_bytes: 0,
            cache_block: BytesMut::new(),
            bytes_total: 0,
            live_bytes: 0,
            lease_mark,
            needs_install,
        };
        let last = numbers.last().copied();
        let mut effects = Vec::new();
        for &n in &numbers {
            store.load_segment(n, Some(n) == last, &mut effects)?;
        }
        if store.segments.is_empty() {
            store.create_segment(1)?;
        }
        // Effects at or below the recovered base apply now; the others wait for the base.
        store.effects.extend(effects);
        store.apply_effects_through(store.base);
        store.durable = store.last_sequence;
        store.marked = (store.base, store.last_sequence);
        store.durable_marked_base = store.base;
        info!(
            dir = %dir.display(),
            segments = store.segments.len(),
            bytes = store.bytes_total,
            outstanding = store.index.len(),
            base = store.base,
            floor = store.floor,
            last_sequence = store.last_sequence,
            "partition journal recovered"
        );
        Ok(store)
    }

    /// [`Store::open_on`], and where the journal is corrupt ([`StoreError::Corrupt`], logged
    /// with file and offset) [`Store::quarantine`] and an empty journal that
    /// [`Store::needs_install`]: what a partition opens, so that a node whose journal was
    /// damaged is re-installed from the primary instead of refusing to start.
    ///
    /// Errors: as [`Store::open_on`], other than corruption; or the quarantine failed.
    pub fn open_or_quarantine(
        disk: Arc<dyn Disk>,
        dir: &Path,
        cfg: StoreConfig,
        apps_of: AppsOf,
    ) -> Result<Store, StoreError> {
        match Store::open_on(disk.clone(), dir, cfg, apps_of.clone()) {
            Err(e @ StoreError::Corrupt { .. }) => {
                tracing::error!(dir = %dir.display(), error = %e, "partition journal corrupt");
                Store::quarantine(&*disk, dir)?;
                Store::open_on(disk, dir, cfg, apps_of)
            }
            other => other,
        }
    }

    /// The directory of the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The settings.
    pub fn config(&self) -> StoreConfig {
        self.cfg
    }

    fn queue_id(&mut self, uri: &str) -> u32 {
        if let Some(id) = self.queue_ids.get(uri) {
            return *id;
        }
        let apps = (self.apps_of)(uri);
        self.new_queue(uri, apps)
    }

    fn new_queue(&mut self, uri: &str, apps: Vec<String>) -> u32 {
        let id = self.queues.len() as u32;
        self.queues.push(QueueInfo::new(uri, apps));
        self.queue_ids.insert(uri.to_string(), id);
        id
    }

    /// The app ids queue `uri`'s next message is stored for, in slot order; `None` for a queue
    /// the journal holds no record of (its first message will be stored for what the
    /// domain lists then). What a primary compares with its domain's app ids before it writes
    /// a `StoredQueueApps`.
    pub fn queue_apps(&self, uri: &str) -> Option<Vec<String>> {
        let id = *self.queue_ids.get(uri)?;
        Some(
            self.queues[id as usize]
                .live_apps()
                .map(String::from)
                .collect(),
        )
    }

    /// Indexes a `StoredQueueApps` at `sequence` (see "Apps of a queue" in the module doc):
    /// new apps get a slot that only later messages wait for; a removed app's slot becomes a
    /// tombstone and, as the base passes the record, every earlier message of the queue is
    /// done with it; an added app the queue already had a slot for (given by the domain
    /// when the queue was first read) is done with every earlier message the same way.
    fn index_queue_apps(
        &mut self,
        sequence: u64,
        apps: &bmq_proto::peer::StoredQueueApps,
        effects: &mut Vec<(u64, Effect)>,
    ) {
        let uri = uri_text(&apps.uri);
        let Some(&queue) = self.queue_ids.get(uri.as_ref()) else {
            // The queue's first record: its apps are the record's (a truncation of the record
            // leaves the queue as its first message would have found it).
            let queue = self.new_queue(&uri, apps.app_ids.clone());
            let before = QueueInfo::new(&uri, (self.apps_of)(&uri));
            self.apps_undo.push(AppsUndo {
                sequence,
                queue,
                before,
            });
            return;
        };
        let info = &self.queues[queue as usize];
        self.apps_undo.push(AppsUndo {
            sequence,
            queue,
            before: info.clone(),
        });
        let mut gone = Vec::new();
        for added in &apps.added {
            if let Some(slot) = info.live_slot(added) {
                gone.push(slot as u8);
            }
        }
        let removed: Vec<usize> = (0..info.apps.len())
            .filter(|i| info.live & (1u64 << i) != 0 && !apps.app_ids.contains(&info.apps[*i]))
            .collect();
        let base = self.base;
        let info = &mut self.queues[queue as usize];
        for slot in removed {
            info.live &= !(1u64 << slot);
            info.gone_at[slot] = sequence;
            gone.push(slot as u8);
        }
        for app in &apps.app_ids {
            if info.live_slot(app).is_some() {
                continue;
            }
            let slot = if info.apps.len() < APPS_MAX {
                info.apps.push(app.clone());
                info.gone_at.push(0);
                info.apps.len() - 1
            } else {
                // A tombstone whose removal is settled: no message waits for it any more.
                match (0..info.apps.len())
                    .find(|i| info.live & (1u64 << i) == 0 && info.gone_at[*i] <= base)
                {
                    Some(slot) => {
                        info.apps[slot] = app.clone();
                        info.gone_at[slot] = 0;
                        slot
                    }
                    None => {
                        warn!(queue = %uri, app = %app, sequence, "queue has no free app slot: the app's copies are not tracked by the journal");
                        metrics::counter!("bmq_journal_apps_untracked_total").increment(1);
                        continue;
                    }
                }
            };
            info.live |= 1u64 << slot;
        }
        info!(
            queue = %uri,
            sequence,
            apps = ?apps.app_ids,
            added = ?apps.added,
            removed = ?apps.removed,
            "queue app ids changed in the journal"
        );
        for app in gone {
            effects.push((
                sequence,
                Effect::AppGone {
                    queue,
                    app,
                    before: sequence,
                },
            ));
        }
    }

    /// The index of `app` among the apps of queue `queue`, if it is one of them. Called for
    /// every confirm record; most queues have the one default app id (empty), which is matched
    /// by its length: comparing the strings called glibc's `memcmp` even for two empty ones, a
    /// visible share of the brokers' CPU at the maximum rate (docs/bench/JOURNAL.md, "The
    /// targets on a faster host").
    fn app_index(&self, queue: u32, app: &str) -> Option<u8> {
        let info = &self.queues[queue as usize];
        info.apps
            .iter()
            .enumerate()
            .position(|(i, a)| {
                a.len() == app.len() && (app.is_empty() || a == app) && info.live & (1u64 << i) != 0
            })
            .map(|i| i as u8)
    }

    /// Reads segment `n` at open: its records join the index (their effects are collected in
    /// `effects`, applied once the base is known).
    fn load_segment(
        &mut self,
        n: u32,
        is_last: bool,
        effects: &mut Vec<(u64, Effect)>,
    ) -> Result<(), StoreError> {
        let path = segment_path(&self.dir, n);
        let file = self.disk.open(&path, Open::ReadWrite).map_err(io(&path))?;
        let data = file.read_up_to(u64::MAX).map_err(io(&path))?;
        let corrupt = |offset: u64, reason: String| StoreError::Corrupt {
            path: path.clone(),
            offset,
            reason,
        };
        if data.len() < HEADER_LEN as usize {
            if is_last {
                warn!(path = %path.display(), "journal segment without a complete header: rewriting it");
                drop(file);
                self.disk.remove_file(&path).map_err(io(&path))?;
                return self.create_segment(n);
            }
            return Err(corrupt(0, "segment shorter than its header".into()));
        }
        if &data[..4] != MAGIC {
            return Err(corrupt(0, "bad magic (not a journal segment)".into()));
        }
        let version = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
        if version != 1 && version != VERSION && version != VERSION_RECYCLED {
            return Err(corrupt(4, format!("unsupported format version {version}")));
        }
        // A recycled last segment's records end at the first that is not its own (see
        // "Recycling" in the module doc); everything after is an earlier life's.
        let recycled_tail = version == VERSION_RECYCLED && is_last;
        self.segments.push(Segment {
            no: n,
            path: path.clone(),
            file: file.clone(),
            len: HEADER_LEN,
            written: HEADER_LEN,
            reserved: 0,
            synced_len: 0,
            fresh: false,
            recycled: version == VERSION_RECYCLED,
            records: Vec::new(),
            live: 0,
            live_bytes: 0,
            pins: Vec::new(),
            self_pinned: 0,
            unreclaimable: 0,
        });
        let data = Bytes::from(data);
        let mut pos = HEADER_LEN as usize;
        // Where a recycled last segment's own records end, and why (logged when cut).
        let mut ends: Option<String> = None;
        while pos < data.len() {
            let torn = |reason: &str| -> Result<Option<usize>, StoreError> {
                if !is_last {
                    return Err(corrupt(pos as u64, reason.to_string()));
                }
                if recycled_tail {
                    return Ok(None);
                }
                warn!(path = %path.display(), offset = pos, %reason, "journal torn tail truncated");
                metrics::counter!("bmq_journal_torn_tail_truncations_total").increment(1);
                Ok(None)
            };
            let parsed = match frame::read(&data[pos..], RECORD_SIZE_MAX) {
                Ok((_, total)) => Some(total - RECORD_HEADER_LEN),
                // No record encodes to nothing (each has a position or is a marker): a zero
                // header is a region of the file that was never written — an extension whose
                // data a crash lost, as after a failed fsync. In the last segment it ends what
                // was written; elsewhere records were expected there.
                Err(damage @ (frame::Damage::ShortHeader | frame::Damage::ZeroLength)) => {
                    torn(&damage.to_string())?
                }
                Err(frame::Damage::TooLong(len)) => {
                    if pos + RECORD_HEADER_LEN + len > data.len() || recycled_tail {
                        torn("record length beyond the end of the file")?
                    } else {
                        return Err(corrupt(pos as u64, frame::Damage::TooLong(len).to_string()));
                    }
                }
                Err(damage @ frame::Damage::Truncated(_)) => torn(&damage.to_string())?,
                Err(frame::Damage::Checksum(total)) => {
                    let end = pos + total;
                    // In a recycled tail a record of this life right after the bad one means
                    // it was damaged in place, not torn (a torn write ends what was written):
                    // what it held may have been acknowledged.
                    let damaged = recycled_tail && self.record_of_this_life_at(&data, end, n);
                    if !damaged && (end == data.len() || recycled_tail) {
                        torn("checksum mismatch on the last record")?
                    } else {
                        return Err(corrupt(pos as u64, "checksum mismatch".into()));
                    }
                }
            };
            let own = match parsed {
                None => None,
                // Zero-copy: the record's byte fields are slices of `data`, dropped once
                // indexed.
                Some(len) => match JournalRecord::decode(
                    data.slice(pos + RECORD_HEADER_LEN..pos + RECORD_HEADER_LEN + len),
                ) {
                    Ok(record) if recycled_tail && !self.continues(&record, n, version) => None,
                    Ok(record) => Some((len, record)),
                    Err(_) if recycled_tail => None,
                    Err(e) => {
                        return Err(corrupt(pos as u64, format!("record does not decode: {e}")))
                    }
                },
            };
            let Some((len, record)) = own else {
                if recycled_tail {
                    ends = Some(format!("offset {pos} of {}", data.len()));
                }
                // A torn tail, or (recycled) an earlier life's bytes: cut, so that no record
                // of this life written after a torn one can ever be taken back.
                file.set_len(pos as u64).map_err(io(&path))?;
                file.sync_all().map_err(io(&path))?;
                break;
            };
            let total = (RECORD_HEADER_LEN + len) as u32;
            if let Some(RecordKind::Marker(m)) = &record.kind {
                self.base = self.base.max(m.base);
                if m.covered_through > self.last_sequence {
                    self.floor = self.floor.max(m.covered_through);
                    self.last_sequence = m.covered_through;
                }
                if !m.runs.is_empty() {
                    self.runs = m.runs.iter().map(|r| (r.lease, r.first_sequence)).collect();
                }
            } else {
                let expected = self.last_sequence + 1;
                if !self.is_next_position(record.sequence, version) {
                    return Err(corrupt(
                        pos as u64,
                        format!(
                            "sequence {} where {expected} was expected (base {})",
                            record.sequence, self.base
                        ),
                    ));
                }
                if record.sequence > expected {
                    self.floor = record.sequence - 1;
                }
                let segment = self.segments.len() - 1;
                self.index_record(segment, pos as u32, total, &facts_of(&record), effects);
            }
            let s = self.segments.last_mut().expect("pushed");
            s.len = (pos + RECORD_HEADER_LEN + len) as u64;
            pos += RECORD_HEADER_LEN + len;
        }
        if let Some(at) = ends {
            info!(path = %path.display(), ends = %at, "recycled journal segment: an earlier segment's bytes after its records cut");
        }
        let segment_size_max = self.cfg.segment_size_max;
        let s = self.segments.last_mut().expect("pushed");
        s.synced_len = s.len;
        s.written = s.len;
        if is_last {
            // Appends continue here: reserve the rest of the segment (best effort: without a
            // reservation every append is written at once, as before).
            s.reserved = reserve(&s.file, segment_size_max).unwrap_or(0);
        }
        s.records.shrink_to_fit();
        self.bytes_total += s.len;
        if let Some(first) = s.first_sequence() {
            // Segments deleted before this one: their positions are absent.
            if self.segments.len() == 1 && first > 1 {
                self.floor = self.floor.max(first - 1);
            }
        }
        Ok(())
    }

    /// Whether `record`, read in recycled segment `n` after the records before it, is this
    /// segment's own: a marker written to segment `n` that covers as far at least, or the next
    /// position (or one after positions absent below the base). An earlier life's records
    /// are all below the position the segment starts at (it was deleted settled and dead), and
    /// its markers name another segment.
    fn continues(&self, record: &JournalRecord, n: u32, version: u32) -> bool {
        match &record.kind {
            // Not the base: a compacted earlier segment's marker may carry a later one.
            Some(RecordKind::Marker(m)) => {
                m.segment == n && m.covered_through >= self.last_sequence
            }
            _ => self.is_next_position(record.sequence, version),
        }
    }

    /// Whether `data` (segment `n`, read at open) holds at `pos` a whole, intact record of
    /// this life that could come right after a record following what was read so far: a
    /// marker of this segment, or one of the next two positions.
    fn record_of_this_life_at(&self, data: &Bytes, pos: usize, n: u32) -> bool {
        let Some(Ok((_, total))) = data.get(pos..).map(|d| frame::read(d, RECORD_SIZE_MAX)) else {
            return false;
        };
        let Ok(record) = JournalRecord::decode(data.slice(pos + RECORD_HEADER_LEN..pos + total))
        else {
            return false;
        };
        match &record.kind {
            Some(RecordKind::Marker(_)) => self.continues(&record, n, VERSION_RECYCLED),
            _ => {
                (self.last_sequence + 1..=self.last_sequence + 2).contains(&record.sequence)
                    && record.lease >= self.last_lease()
            }
        }
    }

    /// Whether a record of position `sequence` may follow what was read so far in a segment
    /// of format `version`: the next position, or (from version 2) one after positions absent
    /// below the base — above the base every position is held; below it absent ones were
    /// dead.
    fn is_next_position(&self, sequence: u64, version: u32) -> bool {
        let expected = self.last_sequence + 1;
        sequence == expected || (sequence > expected && version != 1 && sequence - 1 <= self.base)
    }

    /// Adds a record (not a marker) held in `self.segments[segment]` at `offset` to the
    /// bookkeeping: the segment's list, the lease runs, the index (a message) or the effects
    /// (a confirm, removal or failure of an outstanding message).
    fn index_record(
        &mut self,
        segment: usize,
        offset: u32,
        len: u32,
        record: &RecordFacts<'_>,
        effects: &mut Vec<(u64, Effect)>,
    ) {
        let sequence = record.sequence;
        self.last_sequence = sequence;
        if self
            .runs
            .last()
            .is_none_or(|(lease, _)| *lease != record.lease)
        {
            self.runs.push((record.lease, sequence));
        }
        let live = match record.kind {
            FactKind::Message {
                uri,
                guid,
                payload_len,
            } => {
                let guid = guid_key(guid);
                let queue = self.queue_id(&uri_text(uri));
                let pending = self.queues[queue as usize].live;
                match self.index.contains(guid) {
                    // The same GUID stored twice (a resend older than the duplicate window):
                    // the first copy stands, this one is dead.
                    true => false,
                    false => {
                        self.index.insert_new(
                            guid,
                            Entry {
                                sequence,
                                size: payload_len as u32,
                                queue,
                                pending,
                                extra: None,
                            },
                        );
                        true
                    }
                }
            }
            FactKind::Subject {
                guid,
                app_id,
                failures,
            } => {
                let guid = guid_key(guid);
                let app = self
                    .index
                    .get(guid)
                    .and_then(|e| self.app_index(e.queue, app_id));
                match app {
                    Some(app) => {
                        let effect = match failures {
                            Some(failures) => Effect::Failed {
                                guid,
                                app,
                                failures,
                            },
                            None => Effect::Done { guid, app },
                        };
                        effects.push((sequence, effect));
                        true
                    }
                    // About a message no longer (or never) outstanding: dead at once.
                    None => false,
                }
            }
            // What it changes is the queue's, not a message's: dead at once (see "Apps of a
            // queue" in the module doc).
            FactKind::QueueApps(apps) => {
                self.index_queue_apps(sequence, &apps.get(), effects);
                false
            }
            // Delivery records of version 1 (informational), lease starts: dead at once.
            FactKind::Delivery | FactKind::Marker | FactKind::LeaseStart | FactKind::None => false,
        };
        let s = &mut self.segments[segment];
        s.records.push(Held {
            sequence,
            offset,
            len_live: if live { len | LIVE } else { len },
        });
        if live {
            s.live += 1;
            s.live_bytes += u64::from(len);
            self.live_bytes += u64::from(len);
        }
    }

    /// Applies the effects at or below `through`, in order; a message no app waits for any
    /// more leaves the index and its records become dead.
    fn apply_effects_through(&mut self, through: u64) {
        while let Some((sequence, effect)) = self.effects.front().copied() {
            if sequence > through {
                break;
            }
            self.effects.pop_front();
            let (guid, app) = match effect {
                Effect::Done { guid, app } | Effect::Failed { guid, app, .. } => (guid, app),
                Effect::AppGone { queue, app, before } => {
                    self.apply_app_gone(queue, app, before);
                    continue;
                }
            };
            let Some(entry) = self.index.get_mut(guid) else {
                self.kill(sequence);
                continue;
            };
            match effect {
                Effect::Done { .. } => {
                    entry.pending &= !(1u64 << app);
                    if let Some(extra) = entry.extra.as_mut() {
                        extra.failures.retain(|(a, _)| *a != app);
                    }
                    if entry.pending == 0 {
                        let entry = self.index.remove(guid).expect("present");
                        self.retired.push(guid);
                        let records = entry.extra.map(|e| e.records).unwrap_or_default();
                        self.retire(entry.sequence, records.into_iter().chain([sequence]));
                    } else {
                        entry
                            .extra
                            .get_or_insert_with(Default::default)
                            .records
                            .push(sequence);
                    }
                }
                Effect::AppGone { .. } => unreachable!("handled above"),
                Effect::Failed { failures, .. } => {
                    let extra = entry.extra.get_or_insert_with(Default::default);
                    match extra.failures.iter_mut().find(|(a, _)| *a == app) {
                        Some((_, n)) => *n = (*n).max(failures),
                        None => extra.failures.push((app, failures)),
                    }
                    extra.records.push(sequence);
                }
            }
        }
    }

    /// Every message of queue `queue` stored before `before` is done with app slot `app`: a
    /// message no app waits for any more leaves the index, as after its last confirm. A walk
    /// over the partition's outstanding messages: an operator's change of a domain's apps is
    /// rare.
    fn apply_app_gone(&mut self, queue: u32, app: u8, before: u64) {
        let bit = 1u64 << app;
        let hit: Vec<u128> = self
            .index
            .iter()
            .filter(|(_, e)| e.queue == queue && e.sequence < before && e.pending & bit != 0)
            .map(|(guid, _)| guid)
            .collect();
        let mut finished = 0usize;
        for &guid in &hit {
            let entry = self.index.get_mut(guid).expect("present");
            entry.pending &= !bit;
            if let Some(extra) = entry.extra.as_mut() {
                extra.failures.retain(|(a, _)| *a != app);
            }
            if entry.pending == 0 {
                let entry = self.index.remove(guid).expect("present");
                self.retired.push(guid);
                let records = entry.extra.map(|e| e.records).unwrap_or_default();
                self.retire(entry.sequence, records);
                finished += 1;
            }
        }
        let info = &self.queues[queue as usize];
        info!(
            queue = %info.uri,
            app = %info.apps[app as usize],
            before,
            copies = hit.len(),
            finished,
            "app's copies of a queue dropped from the journal's index"
        );
    }

    /// The segment holding `sequence` and the record's index in it.
    fn locate(&self, sequence: u64) -> Option<(usize, usize)> {
        let i = self
            .segments
            .partition_point(|s| s.first_sequence().is_none_or(|f| f <= sequence));
        // Segments without records (only markers) sort anywhere; search back from `i`.
        for si in (0..i).rev() {
            let s = &self.segments[si];
            if let Some(first) = s.first_sequence().filter(|f| *f <= sequence) {
                // A segment's records are usually consecutive positions (gaps come only from
                // compaction and installs): try the direct index before the binary search,
                // which took ~1.7% of the brokers' CPU (2-3 look-ups per message per node).
                let guess = (sequence - first) as usize;
                if s.records.get(guess).is_some_and(|h| h.sequence == sequence) {
                    return Some((si, guess));
                }
                let r = s.records.partition_point(|h| h.sequence < sequence);
                return s
                    .records
                    .get(r)
                    .filter(|h| h.sequence == sequence)
                    .map(|_| (si, r));
            }
        }
        None
    }

    /// A message is done: its record at `message` is dead; its confirm, failure and removal
    /// records (`records`) stay pinned to the message record's segment until that record is
    /// removed from disk (see [`Segment::pins`]).
    fn retire(&mut self, message: u64, records: impl IntoIterator<Item = u64>) {
        self.kill(message);
        let home = self.locate(message).map(|(si, _)| si);
        for r in records {
            match (home, self.locate(r)) {
                // Held while the message record is on disk: pinned to its segment (in the same
                // segment too: a chunked install that sent the message must find its confirm).
                (Some(si), Some((ri, _))) => {
                    self.segments[si].pins.push(r);
                    if ri == si {
                        self.segments[si].self_pinned += 1;
                    }
                }
                _ => self.kill(r),
            }
        }
    }

    /// Whether the record at `sequence` is held and live.
    fn is_live(&self, sequence: u64) -> bool {
        self.locate(sequence)
            .is_some_and(|(si, ri)| self.segments[si].records[ri].live())
    }

    /// Marks the record at `sequence` dead (nothing when it is not held or already dead).
    fn kill(&mut self, sequence: u64) {
        let Some((si, ri)) = self.locate(sequence) else {
            return;
        };
        let s = &mut self.segments[si];
        let h = &mut s.records[ri];
        if h.live() {
            let len = u64::from(h.len());
            h.len_live &= !LIVE;
            s.live -= 1;
            s.live_bytes -= len;
            self.live_bytes -= len;
        }
    }

    fn active(&mut self) -> &mut Segment {
        self.segments.last_mut().expect("a segment is open")
    }

    /// A marker of where the journal stands (the base, the covered position, the lease runs),
    /// to write in segment file `segment`.
    fn marker(&self, segment: u32) -> JournalRecord {
        marker_record(StoredMarker {
            segment,
            base: self.base,
            covered_through: self.last_sequence,
            runs: proto_runs(&self.runs),
        })
    }

    /// Creates segment `n` with its header and a marker of where the journal stands; the next
    /// sync makes it durable, with its directory entry (see `Segment::fresh`).
    fn create_segment(&mut self, n: u32) -> Result<(), StoreError> {
        if self.spare {
            match self.recycle_spare(n) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // Nothing is lost: the segment is made afresh, as without a spare.
                    warn!(dir = %self.dir.display(), error = %e, "journal spare segment not reusable: removed");
                    self.spare = false;
                    let _ = self.disk.remove_file(&spare_path(&self.dir));
                }
            }
        }
        let path = segment_path(&self.dir, n);
        let buf = segment_head(&self.marker(n), VERSION);
        let made = (|| {
            let file = self.disk.open(&path, Open::Create)?;
            file.write_all_at(&buf, 0)?;
            // The segment's space, reserved now: a full disk shows here, where the append that
            // needs the segment can still be refused, and never in a write-behind.
            let reserved = reserve(&file, self.cfg.segment_size_max)?;
            Ok((file, reserved))
        })();
        let (file, reserved) = match made {
            Ok(made) => made,
            Err(e) => {
                let _ = self.disk.remove_file(&path);
                return Err(io(&path)(e));
            }
        };
        // Its inode and directory entry become durable with the next sync (see `fresh`), off
        // the partition's thread: a roll-over does not wait for two fsyncs.
        self.push_segment(n, path, file, buf.len() as u64, reserved, false);
        Ok(())
    }

    /// Puts segment `n`, just made with `head` bytes (its header and marker) written, at the
    /// end: the active segment. Not durable until the next sync (`fresh`, with fsyncs); a
    /// `recycled` one's head was fsynced before its rename.
    fn push_segment(
        &mut self,
        n: u32,
        path: PathBuf,
        file: FileRef,
        head: u64,
        reserved: u64,
        recycled: bool,
    ) {
        let fresh = self.cfg.fsync;
        self.bytes_total += head;
        self.segments.push(Segment {
            no: n,
            path,
            file,
            len: head,
            written: head,
            reserved,
            synced_len: if fresh && !recycled { 0 } else { head },
            fresh,
            recycled,
            records: Vec::new(),
            live: 0,
            live_bytes: 0,
            pins: Vec::new(),
            self_pinned: 0,
            unreclaimable: 0,
        });
        self.marked = (self.base, self.last_sequence);
        if !fresh {
            self.durable_marked_base = self.durable_marked_base.max(self.base);
        }
    }

    /// Makes the spare file segment `n` (see "Recycling" in the module doc): its header (format
    /// [`VERSION_RECYCLED`]) and a marker of where the journal stands are written over its
    /// start and fsynced before it is renamed, so a segment of that name never starts with the
    /// header of its earlier life; the rename becomes durable with the next sync, as a new
    /// segment's does. Errors: any I/O error before the rename leaves the spare to be removed;
    /// after it, the segment file is removed.
    fn recycle_spare(&mut self, n: u32) -> std::io::Result<()> {
        let spare = spare_path(&self.dir);
        let path = segment_path(&self.dir, n);
        let buf = segment_head(&self.marker(n), VERSION_RECYCLED);
        let file = self.disk.open(&spare, Open::ReadWrite)?;
        file.write_all_at(&buf, 0)?;
        if self.cfg.fsync {
            file.sync_data()?;
        }
        self.disk.rename(&spare, &path)?;
        self.spare = false;
        let reserved = match reserve(&file, self.cfg.segment_size_max) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.disk.remove_file(&path);
                return Err(e);
            }
        };
        // Its head was fsynced above; the new name becomes durable with the next sync.
        self.push_segment(n, path, file, buf.len() as u64, reserved, true);
        metrics::counter!("bmq_journal_segments_recycled_total").increment(1);
        Ok(())
    }

    /// Appends `buf` to the active segment. Within the segment's reservation the bytes wait
    /// in the write-behind buffer for the next [`Store::sync`] (one write for many appends);
    /// beyond it they are written at once, and a failed write cuts the segment back, so it
    /// leaves nothing behind.
    fn write_active(&mut self, buf: Bytes) -> Result<(), StoreError> {
        #[cfg(test)]
        match self.fail_writes_after.as_mut() {
            Some(0) => {
                let path = self
                    .segments
                    .last()
                    .expect("a segment is open")
                    .path
                    .clone();
                return Err(io(&path)(std::io::Error::other("injected write failure")));
            }
            Some(n) => *n -= 1,
            None => {}
        }
        let add = buf.len() as u64;
        let s = self.segments.last().expect("a segment is open");
        if s.len + add <= s.reserved {
            if self.pending.len() + buf.len() > PENDING_BYTES_MAX {
                self.write_pending()?;
            }
            self.pending.push(buf);
            self.active().len += add;
            self.bytes_total += add;
            return Ok(());
        }
        self.write_pending()?;
        let s = self.active();
        let at = s.len;
        match s.file.write_all_at(&buf, at) {
            Ok(()) => {
                s.len += add;
                s.written = s.len;
                self.bytes_total += add;
                metrics::counter!("bmq_journal_written_bytes_total").increment(add);
                Ok(())
            }
            Err(e) => {
                let path = s.path.clone();
                // Shrinking needs no space; if it fails too, the torn tail is cut at open.
                let _ = s.file.set_len(at);
                Err(io(&path)(e))
            }
        }
    }

    /// Writes the write-behind buffer to the active segment's file (one `pwritev`). On failure
    /// the file is cut back to what was written before and the buffer kept, so a later call
    /// writes it again.
    fn write_pending(&mut self) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let s = self.segments.last_mut().expect("a segment is open");
        let at = s.written;
        match self.pending.write_at(&s.file, at) {
            Ok(()) => {
                s.written += self.pending.len() as u64;
                debug_assert_eq!(s.written, s.len, "the buffer holds the segment's tail");
                metrics::counter!("bmq_journal_written_bytes_total")
                    .increment(self.pending.len() as u64);
                self.pending.clear();
                Ok(())
            }
            Err(e) => {
                let _ = s.file.set_len(at);
                Err(io(&s.path)(e))
            }
        }
    }

    fn write_marker(&mut self) -> Result<(), StoreError> {
        let mut buf = Vec::new();
        let segment = self.segments.last().expect("a segment is open").no;
        frame(&self.marker(segment), &mut buf);
        self.write_active(Bytes::from(buf))?;
        self.marked = (self.base, self.last_sequence);
        Ok(())
    }

    fn roll_over(&mut self) -> Result<(), StoreError> {
        self.write_pending()?;
        let fsync = self.cfg.fsync;
        let dir = self.dir.clone();
        let disk = self.disk.clone();
        let s = self.active();
        if s.recycled {
            // Closed segments end at their last record (only the last segment may hold an
            // earlier life's bytes after its records); durable with the fsync below.
            s.file.set_len(s.len).map_err(io(&s.path))?;
        }
        if fsync {
            // Before the next segment exists: its marker says how far this one goes.
            FileSync::new(disk.clone(), s.file.clone(), s.fresh.then(|| dir.clone()))
                .run()
                .map_err(io(&s.path))?;
        }
        s.fresh = false;
        s.synced_len = s.len;
        let next = s.no + 1;
        self.create_segment(next)?;
        // The closed segment's list grows no more: give its spare capacity back.
        let closed = self.segments.len() - 2;
        self.segments[closed].records.shrink_to_fit();
        metrics::counter!("bmq_journal_rollovers_total").increment(1);
        Ok(())
    }

    /// Whether appending `bytes` more would pass the quota (always false without one).
    pub fn would_exceed_quota(&self, bytes: u64) -> bool {
        self.cfg.quota_bytes > 0 && self.bytes_total + bytes > self.cfg.quota_bytes
    }

    /// Appends one record at the next position (a primary's append). See [`Store::append`].
    pub fn append_one(&mut self, record: &JournalRecord) -> Result<(), StoreError> {
        self.append(std::slice::from_ref(record), 0, 0, None)
    }

    /// [`Store::append`] of the records of `batch` from its `from`-th on, as another journal
    /// wrote them ([`FramedBatch::split`]): the frames are written as they are — not decoded,
    /// encoded again nor copied — and not cached (the cache, which holds a suffix of the
    /// journal, is emptied): a replica's records are read back from the disk if it becomes
    /// primary.
    pub fn append_framed(
        &mut self,
        batch: &FramedBatch<'_>,
        from: usize,
        covered_through: u64,
        settled_through: u64,
    ) -> Result<(), StoreError> {
        self.append_with(
            Appending::Frames(batch, from),
            covered_through,
            settled_through,
            None,
        )
    }

    /// Appends `records`, sequences strictly increasing above the last position held; a gap
    /// (absent positions: dead records a primary did not send) is allowed only at or below
    /// `settled_through`. Then every position up to `covered_through` (0: the last record's)
    /// counts as held, positions up to `settled_through` as settled ([`Store::set_base`]), and
    /// `runs`, when given, replace the lease runs (an install, whose absent positions the
    /// records cannot describe). Not durable until [`Store::sync`]. On an error (for example
    /// [`StoreError::NoSpace`]) nothing of this call remains.
    pub fn append(
        &mut self,
        records: &[JournalRecord],
        covered_through: u64,
        settled_through: u64,
        runs: Option<&[LeaseRun]>,
    ) -> Result<(), StoreError> {
        self.append_with(
            Appending::Records(records),
            covered_through,
            settled_through,
            runs,
        )
    }

    /// [`Store::append`] of decoded records or of a framed batch's ([`Appending`]).
    pub fn append_with(
        &mut self,
        appending: Appending<'_, '_>,
        covered_through: u64,
        settled_through: u64,
        runs: Option<&[LeaseRun]>,
    ) -> Result<(), StoreError> {
        let max_seq = match appending.len() {
            0 => self.last_sequence,
            n => appending.position(n - 1).0,
        };
        let gap_bound = self.base.max(settled_through.min(max_seq));
        let mut expected = self.last_sequence + 1;
        let mut gaps = false;
        // The highest position absent in the batch (settled dead records the sender no longer
        // holds): the floor, as a reopen would find it. A lower floor would let a later sync
        // skip those positions for a replica that still needs them (found by the replication
        // simulator: a confirm missing on a lagging replica, whose message stayed outstanding).
        let mut gap_floor = 0;
        for i in 0..appending.len() {
            let (sequence, marker) = appending.position(i);
            if sequence < expected || (sequence > expected && sequence - 1 > gap_bound) || marker {
                return Err(StoreError::OutOfOrder {
                    expected,
                    got: sequence,
                });
            }
            if sequence > expected {
                gaps = true;
                gap_floor = sequence - 1;
            }
            expected = sequence + 1;
        }
        let before = self.snapshot(runs.is_some());
        let result = self.append_inner(appending, gaps, gap_bound);
        if let Err(e) = result {
            self.rollback(before);
            return Err(e);
        }
        self.floor = self.floor.max(gap_floor);
        // Positions held without a record (the sender no longer holds them): only a marker
        // says so. When the covered position is the last record's, the records say it all.
        let beyond_records = covered_through > self.last_sequence;
        if beyond_records {
            self.floor = covered_through;
            self.last_sequence = covered_through;
        }
        if let Some(runs) = runs {
            self.runs = runs
                .iter()
                .filter(|r| r.first_sequence <= self.last_sequence)
                .map(|r| (r.lease, r.first_sequence))
                .collect();
        }
        if beyond_records || runs.is_some() {
            if let Err(e) = self.write_marker() {
                self.rollback(before);
                return Err(e);
            }
        }
        self.set_base(settled_through);
        Ok(())
    }

    fn append_inner(
        &mut self,
        appending: Appending<'_, '_>,
        gaps: bool,
        gap_bound: u64,
    ) -> Result<(), StoreError> {
        if gaps && gap_bound > self.base {
            // A restart must accept the gaps: say first that they are settled.
            self.base = gap_bound;
            self.write_marker()?;
        }
        let records = match appending {
            Appending::Frames(batch, from) => return self.append_frames(batch, from),
            Appending::Records(records) => records,
        };
        // The frames are staged in the cache's block (see `Cached`), so a record is copied
        // once into memory the cache keeps and once into the write-behind buffer.
        self.cache_block.clear();
        let mut staged = std::mem::take(&mut self.staged_scratch);
        let mut first_staged = 0;
        for (i, record) in records.iter().enumerate() {
            if self.active().len + self.cache_block.len() as u64 >= self.cfg.segment_size_max {
                self.flush(&mut staged, &records[first_staged..i])?;
                first_staged = i;
                self.roll_over()?;
            }
            let offset = self.active().len + self.cache_block.len() as u64;
            let body = record.encoded_len();
            let need = RECORD_HEADER_LEN + body;
            if self.cache_block.capacity() - self.cache_block.len() < need {
                // The block is full: what is staged goes now, the rest into a new block (a
                // `reserve` would copy the staged bytes into a new allocation, again and again
                // for a large batch).
                self.flush(&mut staged, &records[first_staged..i])?;
                first_staged = i;
                self.cache_block = BytesMut::with_capacity(CACHE_BLOCK.max(need));
            }
            let len = frame_sized(record, body, &mut self.cache_block);
            staged.push((offset as u32, len));
        }
        self.flush(&mut staged, &records[first_staged..])?;
        self.staged_scratch = staged;
        Ok(())
    }

    /// Appends the records of `batch` from its `from`-th on (a replica's, from its primary):
    /// the frames go to the write-behind buffer as they arrived — one slice of the batch per
    /// segment they land in, no copy: the kernel's `pwritev` reads them where the peer link's
    /// read put them — and nothing is cached. A replica serves no deliveries, so the cache
    /// would only hold what a promotion might read; a new primary reads its earlier records
    /// from the disk (`Store::read`, one `pread` each, most from the page cache), and what it
    /// appends from then on is cached. Caching here cost a copy of every replicated byte
    /// (docs/bench/JOURNAL.md, "A replica's journal writes without a copy") and kept the peer
    /// link's read buffers alive with the records. The cache holds a suffix of the journal, so
    /// one that precedes these records is emptied.
    fn append_frames(&mut self, batch: &FramedBatch<'_>, from: usize) -> Result<(), StoreError> {
        if from >= batch.len() {
            return Ok(());
        }
        self.cache.clear();
        self.cache_bytes = 0;
        let mut effects = std::mem::take(&mut self.effects_scratch);
        let mut first = from;
        while first < batch.len() {
            if self.active().len >= self.cfg.segment_size_max {
                self.roll_over()?;
            }
            // The frames that go into the active segment: a frame goes where the one before it
            // went unless that one filled the segment (as one frame at a time would).
            let start = self.active().len;
            let mut end = first;
            let mut len = start;
            while end < batch.len() && (end == first || len < self.cfg.segment_size_max) {
                len += batch.frames[end].len as u64;
                end += 1;
            }
            self.write_active(batch.bytes_of(first..end))?;
            let segment = self.segments.len() - 1;
            let base = batch.frames[first].start;
            // The index's buckets for every GUID of these frames (a message indexed, a confirm
            // looked up) loaded before any is used: at a backlog of a million their cache
            // misses overlap instead of following one another.
            let loaded =
                batch.frames[first..end]
                    .iter()
                    .fold(0, |loaded, frame| match frame.facts.kind {
                        FactKind::Message { guid, .. } | FactKind::Subject { guid, .. } => {
                            loaded ^ self.index.prefetch(guid_key(guid))
                        }
                        _ => loaded,
                    });
            std::hint::black_box(loaded);
            for frame in &batch.frames[first..end] {
                let offset = (start + (frame.start - base) as u64) as u32;
                self.index_record(
                    segment,
                    offset,
                    frame.len as u32,
                    &frame.facts,
                    &mut effects,
                );
            }
            first = end;
        }
        // On an error above, the caller's rollback forgets what was indexed.
        self.effects.extend(effects.drain(..));
        self.effects_scratch = effects;
        Ok(())
    }

    /// Writes the records staged in the cache's block and, once written, indexes and caches
    /// them (the cache keeps their frames: slices of one block, no copy).
    fn flush(
        &mut self,
        staged: &mut Vec<(u32, u32)>,
        records: &[JournalRecord],
    ) -> Result<(), StoreError> {
        if self.cache_block.is_empty() {
            return Ok(());
        }
        let start = self.active().len;
        let written = self.cache_block.split().freeze();
        self.write_active(written.clone())?;
        let segment = self.segments.len() - 1;
        let mut effects = std::mem::take(&mut self.effects_scratch);
        for ((offset, len), record) in staged.drain(..).zip(records) {
            self.index_record(segment, offset, len, &facts_of(record), &mut effects);
            let at = (u64::from(offset) - start) as usize;
            self.cache_bytes += u64::from(len) + CACHE_ENTRY_BYTES;
            self.cache.push_back(Cached {
                sequence: record.sequence,
                frame: written.slice(at..at + len as usize),
            });
        }
        self.effects.extend(effects.drain(..));
        self.effects_scratch = effects;
        while self.cache_bytes > self.cfg.cache_bytes_max && !self.cache.is_empty() {
            let old = self.cache.pop_front().expect("non-empty");
            self.cache_bytes -= Self::cache_cost(&old);
        }
        Ok(())
    }

    /// What a cached record counts against the cache bound.
    fn cache_cost(c: &Cached) -> u64 {
        c.frame.len() as u64 + CACHE_ENTRY_BYTES
    }

    /// Decodes a cached record.
    fn decode_cached(&self, c: &Cached) -> Result<JournalRecord, StoreError> {
        JournalRecord::decode(c.frame.slice(RECORD_HEADER_LEN..)).map_err(|e| StoreError::Corrupt {
            path: self.dir.clone(),
            offset: 0,
            reason: format!("cached record {} does not decode: {e}", c.sequence),
        })
    }

    /// What [`Store::rollback`] restores. The lease runs are copied only when the append
    /// replaces them (`replaces_runs`, an install's chunk): otherwise it can only add runs
    /// after `last_sequence`, which the rollback removes (a copy per append was one of the
    /// allocations of every record).
    fn snapshot(&self, replaces_runs: bool) -> Snapshot {
        Snapshot {
            segments: self.segments.len(),
            len: self.segments.last().map_or(0, |s| s.len),
            last_sequence: self.last_sequence,
            runs: replaces_runs.then(|| self.runs.clone()),
            base: self.base,
            floor: self.floor,
        }
    }

    /// Undoes a failed append: segments created by it are removed, the first one cut back, and
    /// what was indexed forgotten.
    fn rollback(&mut self, before: Snapshot) {
        while self.segments.len() > before.segments {
            let s = self.segments.pop().expect("checked");
            self.bytes_total = self.bytes_total.saturating_sub(s.len);
            let _ = self.disk.remove_file(&s.path);
            self.retire_file(s.file);
        }
        let s = self.segments.last_mut().expect("a segment is open");
        let over = s.len.saturating_sub(before.len);
        if before.len < s.written {
            let _ = s.file.set_len(before.len);
            s.written = before.len;
        }
        let keep = before.len.saturating_sub(s.written) as usize;
        self.pending.truncate(keep);
        let s = self.active();
        s.len = before.len;
        s.synced_len = s.synced_len.min(before.len);
        self.bytes_total = self.bytes_total.saturating_sub(over);
        self.forget_after(before.last_sequence);
        self.last_sequence = before.last_sequence;
        match before.runs {
            Some(runs) => self.runs = runs,
            None => {
                while self
                    .runs
                    .last()
                    .is_some_and(|(_, first)| *first > before.last_sequence)
                {
                    self.runs.pop();
                }
            }
        }
        self.base = before.base;
        self.floor = before.floor;
    }

    /// Makes everything appended so far durable; returns the highest durable position.
    /// [`Store::begin_sync`], the fsync and [`Store::complete_sync`] in one call.
    pub fn sync(&mut self) -> Result<u64, StoreError> {
        match self.begin_sync()? {
            None => Ok(self.durable),
            Some(ticket) => {
                let result = ticket.run();
                self.complete_sync(ticket, result)
            }
        }
    }

    /// Starts making everything appended so far durable without waiting for the disk: the
    /// write-behind buffer goes to the file (one `pwritev`), and the fsync that remains is
    /// returned as a [`SyncTicket`] for another thread to run ([`SyncTicket::run`]); hand its
    /// outcome to [`Store::complete_sync`] (also with fsync off, when `run` does nothing).
    /// `None`: nothing needed an fsync, and [`Store::durable`] already covers every position
    /// held. Appends may go on while a ticket runs; they are covered by the next one. Errors:
    /// the write failed.
    pub fn begin_sync(&mut self) -> Result<Option<SyncTicket>, StoreError> {
        self.write_pending()?;
        let fsync = self.cfg.fsync;
        let through = self.last_sequence;
        let epoch = self.sync_epoch;
        let marked_base = self.marked.0;
        let dir = self.dir.clone();
        let behind = through > self.durable;
        let disk = self.disk.clone();
        let lease_mark = match self.lease_mark.as_mut() {
            Some(m) => m.prepare().map_err(|e| io(m.path())(e))?,
            None => None,
        };
        let s = self.active();
        // A ticket even without fsyncs (tests): the same steps, with an fsync that does
        // nothing, so that what depends on them is exercised alike.
        if s.synced_len < s.len || s.fresh || behind || lease_mark.is_some() {
            return Ok(Some(SyncTicket {
                sync: FileSync::new(disk, s.file.clone(), s.fresh.then_some(dir)),
                path: s.path.clone(),
                segment: s.no,
                len: s.len,
                through,
                marked_base,
                epoch,
                fsync,
                lease_mark,
            }));
        }
        Ok(None)
    }

    /// Records the outcome of `ticket`'s fsync ([`Store::begin_sync`]) and returns the highest
    /// durable position: every position the ticket covered, unless a truncation or an install
    /// came in between (then nothing changes, and [`Store::needs_sync`] asks for another).
    /// Errors: the fsync failed ([`StoreError::Io`]); never retry it — the node must stop, as
    /// the page cache may have dropped the data it could not write.
    pub fn complete_sync(
        &mut self,
        ticket: SyncTicket,
        result: std::io::Result<()>,
    ) -> Result<u64, StoreError> {
        result.map_err(io(&ticket.path))?;
        if let (Some(m), Some((_, value))) = (self.lease_mark.as_mut(), &ticket.lease_mark) {
            m.synced(*value);
        }
        if ticket.epoch != self.sync_epoch {
            return Ok(self.durable);
        }
        // Only the active segment can hold unsynced bytes (a roll-over syncs the one it
        // closes), so a ticket of an older segment has nothing left to record.
        if let Some(s) = self.segments.last_mut() {
            if s.no == ticket.segment && ticket.len <= s.len {
                s.synced_len = s.synced_len.max(ticket.len);
                if ticket.sync.is_new() {
                    s.fresh = false;
                }
            }
        }
        self.durable = self.durable.max(ticket.through.min(self.last_sequence));
        self.durable_marked_base = self.durable_marked_base.max(ticket.marked_base);
        Ok(self.durable)
    }

    /// The GUIDs of the messages that stopped being outstanding (every app confirmed them or
    /// had them removed, and that is settled) since the last call, oldest first: a primary
    /// remembers them for duplicate detection once the index no longer knows them. Every
    /// rise of the base may add some (and sets [`Store::maintenance_due`]).
    pub fn take_retired(&mut self) -> std::vec::Drain<'_, u128> {
        self.retired.drain(..)
    }

    /// Keeps the files of removed or replaced segments for [`Store::take_closed_files`]
    /// instead of closing them in the call that removed them. The last close of a deleted
    /// segment frees its pages and blocks, which takes tens of milliseconds for a 32 MiB
    /// segment (seen in the throughput benchmark: 17-27 ms per `close`); a shell closes them
    /// on another thread so the partition never waits for it.
    pub fn set_defer_close(&mut self, defer: bool) {
        self.defer_close = defer;
    }

    /// The files of segments removed or replaced since the last call (see
    /// [`Store::set_defer_close`]), to finish with [`ClosedFiles::finish`] on another thread.
    /// Nothing reads them again.
    pub fn take_closed_files(&mut self) -> ClosedFiles {
        let mut taken = std::mem::take(&mut self.closed_files);
        taken.disk = Some(self.disk.clone());
        taken
    }

    fn retire_file(&mut self, file: FileRef) {
        if self.defer_close {
            self.closed_files.files.push(file);
        }
    }

    /// How many calls of [`Store::maintain`] removed dead records so far (in this process): a
    /// reader of the live state in chunks (an install) knows the chunks form one state only
    /// while this does not change.
    pub fn maintenance_epoch(&self) -> u64 {
        self.maintenance_epoch
    }

    /// Whether the base rose since the last [`Store::maintain`], so that a call may remove
    /// settled dead records even when nothing was written (traffic stopped after the last
    /// confirms).
    pub fn maintenance_due(&self) -> bool {
        self.maintenance_due
    }

    /// Whether something was appended (or a primary lease noted) since the last
    /// [`Store::sync`].
    pub fn needs_sync(&self) -> bool {
        self.lease_mark
            .as_ref()
            .is_some_and(|m| m.high() > m.durable())
            || self.durable < self.last_sequence
            || self
                .segments
                .last()
                .is_some_and(|s| s.synced_len < s.len || s.fresh)
    }

    /// Every segment file with its length made durable by the last fsync and its current
    /// length, bytes (a simulator cuts files back to a length in between to simulate a crash).
    pub fn files(&self) -> Vec<(PathBuf, u64, u64)> {
        self.segments
            .iter()
            .map(|s| (s.path.clone(), s.synced_len, s.written))
            .collect()
    }

    /// The highest position held.
    pub fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// The lease of the last position held (0 when empty).
    pub fn last_lease(&self) -> u64 {
        self.runs.last().map_or(0, |(lease, _)| *lease)
    }

    /// Notes that this node serves `lease` as the partition's primary: the primary-lease mark
    /// (`lease_mark.rs`) is raised at the next [`Store::begin_sync`] and durable with that
    /// sync, so before any record of the lease can leave the node.
    pub fn note_primary_lease(&mut self, lease: u64) {
        if let Some(m) = self.lease_mark.as_mut() {
            m.note(lease);
        }
    }

    /// The highest lease this node has served as primary of the partition by its durable
    /// primary-lease mark (0: none, or a staged journal): noted with
    /// [`Store::note_primary_lease`], durable once a sync since has completed. What a journal
    /// set aside as corrupt no longer tells.
    pub fn primary_lease_mark(&self) -> u64 {
        self.lease_mark.as_ref().map_or(0, LeaseMark::durable)
    }

    /// Whether this journal replaces one set aside as corrupt ([`Store::quarantine`]) and
    /// may lack records the node had acknowledged: until a primary has brought it up to the
    /// primary's journal ([`Store::clear_needs_install`]), the node must not count in a
    /// healing quorum (an emptied replica there could hide a committed record), nor heal as
    /// primary at a lease it may have served.
    pub fn needs_install(&self) -> bool {
        self.needs_install
    }

    /// The journal holds what a primary had when it began bringing this node up to date,
    /// durably: removes the marker of [`Store::quarantine`] (and makes that durable).
    ///
    /// Errors: the marker cannot be removed or the directory fsynced.
    pub fn clear_needs_install(&mut self) -> Result<(), StoreError> {
        if !self.needs_install {
            return Ok(());
        }
        let marker = self.dir.join(NEEDS_INSTALL);
        if self.disk.exists(&marker) {
            self.disk.remove_file(&marker).map_err(io(&marker))?;
        }
        if self.cfg.fsync {
            sync_dir(&*self.disk, &self.dir)?;
        }
        self.needs_install = false;
        info!(dir = %self.dir.display(), last_sequence = self.last_sequence, "partition journal re-installed from the primary: it counts in healing quorums again");
        Ok(())
    }

    /// Sets the journal in `dir` aside after it was found corrupt ([`StoreError::Corrupt`] at
    /// open): its files move to `<dir>/corrupt/` (replacing an earlier set), an unfinished
    /// install is discarded, and a `NEEDS_INSTALL` marker is made durable, so that the next
    /// [`Store::open_on`] starts an empty journal that [`Store::needs_install`]. The
    /// primary-lease mark stays. Returns where the files went.
    ///
    /// Errors: a file cannot be moved, or the marker written or fsynced.
    pub fn quarantine(disk: &dyn Disk, dir: &Path) -> Result<PathBuf, StoreError> {
        let aside = dir.join(QUARANTINE_DIR);
        if disk.exists(&aside) {
            disk.remove_dir_all(&aside).map_err(io(&aside))?;
        }
        disk.create_dir_all(&aside).map_err(io(&aside))?;
        let install = dir.join(INSTALL_DIR);
        if disk.exists(&install) {
            disk.remove_dir_all(&install).map_err(io(&install))?;
        }
        // The marker first: a crash while files move leaves an incomplete journal that is
        // known to need an install.
        let marker = dir.join(NEEDS_INSTALL);
        let file = disk.open(&marker, Open::Create).map_err(io(&marker))?;
        file.sync_all().map_err(io(&marker))?;
        sync_dir(disk, dir)?;
        for path in disk.read_dir(dir).map_err(io(dir))? {
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if disk.is_dir(&path) || name == NEEDS_INSTALL || name == LEASE_MARK_NAME {
                continue;
            }
            disk.rename(&path, &aside.join(&name)).map_err(io(&path))?;
        }
        sync_dir(disk, &aside)?;
        sync_dir(disk, dir)?;
        metrics::counter!("bmq_journal_quarantines_total").increment(1);
        warn!(dir = %dir.display(), aside = %aside.display(), "corrupt partition journal set aside: the node starts with an empty journal and is re-installed from the primary");
        Ok(aside)
    }

    /// The last lease run, `(lease, first sequence written under it)`; `None` when empty.
    pub fn last_run(&self) -> Option<(u64, u64)> {
        self.runs.last().copied()
    }

    /// The highest settled position (see the module doc).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The highest position no longer held (0: every position is held).
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The highest position fsynced.
    pub fn durable(&self) -> u64 {
        self.durable
    }

    /// The lease runs of every position held, as the journal shape carries them.
    pub fn runs(&self) -> Vec<LeaseRun> {
        proto_runs(&self.runs)
    }

    /// Starts loading what a look-up of `guid` ([`guid_key`]) in the index of outstanding
    /// messages reads, so that a caller with a batch of GUIDs has their cache misses overlap;
    /// returns a value to pass to `std::hint::black_box` (folded with the others), which keeps
    /// the loads from being optimised away.
    pub fn prefetch_outstanding(&self, guid: u128) -> u32 {
        self.index.prefetch(guid)
    }

    /// The sequence of the outstanding message `guid` ([`guid_key`]), if it is outstanding.
    pub fn outstanding_sequence(&self, guid: u128) -> Option<u64> {
        self.index.get(guid).map(|e| e.sequence)
    }

    /// Raises the settled position to `through` (never above the last position held): the
    /// confirms and removals up to there count, and what they made dead may be removed by
    /// [`Store::maintain`]. The caller passes what a quorum holds and every in-sync replica
    /// has (a primary), or what its primary says is settled (a replica).
    pub fn set_base(&mut self, through: u64) {
        let through = through.min(self.last_sequence);
        if through > self.base {
            self.base = through;
            self.maintenance_due = true;
        }
        if self.effects.front().is_some_and(|(s, _)| *s <= self.base) {
            self.apply_effects_through(self.base);
        }
        if self
            .apps_undo
            .first()
            .is_some_and(|u| u.sequence <= self.base)
        {
            let base = self.base;
            self.apps_undo.retain(|u| u.sequence > base);
        }
    }

    /// Drops every position after `sequence` (healing: records of an older lease that no
    /// quorum holds), durably. A `sequence` below the base is raised to it: settled positions
    /// are committed, and every primary holds the same records there.
    pub fn truncate_after(&mut self, sequence: u64) -> Result<(), StoreError> {
        let sequence = sequence.max(self.base);
        if sequence >= self.last_sequence {
            return Ok(());
        }
        self.write_pending()?;
        // Segments whose every record is above the cut (or that hold none) go; the one
        // holding the cut is cut.
        while self.segments.len() > 1
            && self
                .segments
                .last()
                .is_some_and(|s| s.first_sequence().is_none_or(|first| first > sequence))
        {
            let s = self.segments.pop().expect("checked");
            self.bytes_total = self.bytes_total.saturating_sub(s.len);
            self.live_bytes -= s.live_bytes;
            self.disk.remove_file(&s.path).map_err(io(&s.path))?;
            self.retire_file(s.file);
        }
        let fsync = self.cfg.fsync;
        let s = self.segments.last_mut().expect("a segment");
        let keep = s.records.partition_point(|r| r.sequence <= sequence);
        if let Some(first_cut) = s.records.get(keep) {
            let cut = u64::from(first_cut.offset);
            let removed = s.len - cut;
            s.file.set_len(cut).map_err(io(&s.path))?;
            if fsync {
                s.file.sync_all().map_err(io(&s.path))?;
            }
            s.len = cut;
            s.written = cut;
            s.synced_len = s.synced_len.min(cut);
            self.bytes_total = self.bytes_total.saturating_sub(removed);
        }
        if fsync {
            sync_dir(&*self.disk, &self.dir)?;
        }
        // Not reached (`maintain` compacts only segments that stay closed), but a segment
        // under compaction must never take appends.
        self.abandon_compaction_of_active();
        self.forget_after(sequence);
        self.last_sequence = sequence;
        self.durable = self.durable.min(sequence);
        self.sync_epoch += 1;
        self.floor = self.floor.min(sequence);
        while self.runs.last().is_some_and(|(_, first)| *first > sequence) {
            self.runs.pop();
        }
        // A marker, so that a restart does not mistake the cut for missing records.
        self.write_marker()?;
        self.sync()?;
        Ok(())
    }

    /// Forgets the index entries, effects, cached records and segment entries of positions
    /// after `sequence` (the files are the caller's business).
    fn forget_after(&mut self, sequence: u64) {
        while self.effects.back().is_some_and(|(s, _)| *s > sequence) {
            self.effects.pop_back();
        }
        while self.apps_undo.last().is_some_and(|u| u.sequence > sequence) {
            let undo = self.apps_undo.pop().expect("checked");
            self.queues[undo.queue as usize] = undo.before;
        }
        while self.cache.back().is_some_and(|r| r.sequence > sequence) {
            let r = self.cache.pop_back().expect("checked");
            self.cache_bytes -= Self::cache_cost(&r);
        }
        let mut live_removed = 0;
        for s in &mut self.segments {
            let keep = s.records.partition_point(|r| r.sequence <= sequence);
            for h in s.records.drain(keep..) {
                if h.live() {
                    s.live -= 1;
                    s.live_bytes -= u64::from(h.len());
                    live_removed += u64::from(h.len());
                }
            }
        }
        self.live_bytes -= live_removed;
        self.index.retain(|_, e| e.sequence <= sequence);
        for e in self.index.values_mut() {
            if let Some(extra) = e.extra.as_mut() {
                extra.records.retain(|s| *s <= sequence);
            }
        }
    }

    /// Starts an install (see the module doc): an empty staged store in `<dir>/install/`, with
    /// this store's settings, replacing any unfinished one.
    pub fn begin_install(&self) -> Result<Store, StoreError> {
        let staged = self.dir.join(INSTALL_DIR);
        if self.disk.exists(&staged) {
            self.disk.remove_dir_all(&staged).map_err(io(&staged))?;
        }
        let store = Store::open_in(
            self.disk.clone(),
            &staged,
            self.cfg,
            self.apps_of.clone(),
            false,
        )?;
        if self.cfg.fsync {
            sync_dir(&*self.disk, &self.dir)?;
        }
        Ok(store)
    }

    /// Replaces this journal by the staged one of an install, crash-safely: the staged journal
    /// is made durable, `COMPLETE` written (the commit point), this journal's segments deleted
    /// and the staged ones moved in.
    pub fn finish_install(&mut self, mut staged: Store) -> Result<(), StoreError> {
        staged.sync()?;
        let install = self.dir.join(INSTALL_DIR);
        let complete = install.join(INSTALL_COMPLETE);
        self.disk
            .open(&complete, Open::Create)
            .and_then(|f| if self.cfg.fsync { f.sync_all() } else { Ok(()) })
            .map_err(io(&complete))?;
        if self.cfg.fsync {
            sync_dir(&*self.disk, &install)?;
        }
        recover_install(&*self.disk, &self.dir)?;
        for s in &mut staged.segments {
            s.path = segment_path(&self.dir, s.no);
        }
        staged.dir = self.dir.clone();
        staged.defer_close = self.defer_close;
        staged.background_compaction = self.background_compaction;
        self.forget_compaction();
        staged.closed_files = std::mem::take(&mut self.closed_files);
        for s in &self.segments {
            staged.retire_file(s.file.clone());
        }
        if self.spare {
            // The installed journal numbers its segments afresh: a spare of the old numbering
            // goes (see "Recycling" in the module doc).
            staged.remove_file(&spare_path(&self.dir))?;
        }
        staged.sync_epoch = self.sync_epoch + 1;
        staged.lease_mark = self.lease_mark.take();
        staged.needs_install = self.needs_install;
        info!(
            dir = %self.dir.display(),
            outstanding = staged.index.len(),
            last_sequence = staged.last_sequence,
            base = staged.base,
            "partition journal installed from the primary's live state"
        );
        *self = staged;
        Ok(())
    }

    /// The record `held` of segment `si`: from the write-behind buffer when it is not written
    /// yet, else with one positioned read.
    fn read_held(&self, si: usize, held: Held) -> Result<JournalRecord, StoreError> {
        let s = &self.segments[si];
        let offset = u64::from(held.offset);
        if offset < s.written {
            return read_at(s, held);
        }
        let start = (offset - s.written) as usize;
        let end = start + held.len() as usize;
        match self.pending.copy_range(start, end) {
            Some(data) => decode_framed(s, held, data),
            None => Err(StoreError::Corrupt {
                path: s.path.clone(),
                offset,
                reason: "record beyond the end of the segment".into(),
            }),
        }
    }

    /// The record at `sequence`, from the cache or the disk; `None` when the position is not
    /// held (beyond the last, or dead and compacted away).
    pub fn read(&self, sequence: u64) -> Result<Option<JournalRecord>, StoreError> {
        if let Some(first) = self.cache.front() {
            if sequence >= first.sequence {
                let i = self.cache.partition_point(|r| r.sequence < sequence);
                return match self.cache.get(i).filter(|r| r.sequence == sequence) {
                    Some(c) => self.decode_cached(c).map(Some),
                    None => Ok(None),
                };
            }
        }
        match self.locate(sequence) {
            Some((si, ri)) => self.read_held(si, self.segments[si].records[ri]).map(Some),
            None => Ok(None),
        }
    }

    /// Records after position `after`, ascending, at most `max_records` and about `max_bytes`
    /// of payload (at least one record), with the position they account for through (the
    /// last record's, or the last position held when the end was reached). With `install`,
    /// positions at or below the floor yield only live records (the live state, for a replica
    /// further behind than the floor); without, `after` must be at or above the floor (every
    /// later position is held).
    pub fn read_from(
        &self,
        after: u64,
        max_records: usize,
        max_bytes: u64,
        install: bool,
    ) -> Result<(Vec<JournalRecord>, u64), StoreError> {
        let mut out = Vec::new();
        let mut bytes = 0;
        let full = |out: &Vec<JournalRecord>, bytes: u64| {
            out.len() >= max_records.max(1) || (!out.is_empty() && bytes >= max_bytes)
        };
        // Disk first (positions older than the cache), then the cache.
        let cache_first = self.cache.front().map_or(u64::MAX, |r| r.sequence);
        let mut cursor = after;
        if cursor + 1 < cache_first {
            // The first segment holding a record after `cursor`. Not a binary search: a
            // segment without records (only markers, as a fresh active segment) has no place
            // in the order, and one after the segment to read made a `partition_point` skip
            // it (a healing primary sent "nothing after 71, covered through 82" and replicas
            // acknowledged records they never received: the replication simulator, seed
            // 4294967938 of 5 nodes).
            let start = self
                .segments
                .iter()
                .position(|s| s.last_sequence().is_some_and(|l| l > cursor))
                .unwrap_or(self.segments.len());
            'segments: for (si, s) in self.segments.iter().enumerate().skip(start) {
                let from = s.records.partition_point(|h| h.sequence <= cursor);
                for h in &s.records[from..] {
                    if h.sequence >= cache_first {
                        break 'segments;
                    }
                    if install && h.sequence <= self.floor && !h.live() {
                        continue;
                    }
                    if full(&out, bytes) {
                        return Ok((out, cursor));
                    }
                    let record = self.read_held(si, *h)?;
                    bytes += cached_size(&record);
                    cursor = h.sequence;
                    out.push(record);
                }
            }
        }
        let from = self.cache.partition_point(|r| r.sequence <= cursor);
        for r in self.cache.iter().skip(from) {
            if install && r.sequence <= self.floor && !self.is_live(r.sequence) {
                continue;
            }
            if full(&out, bytes) {
                return Ok((out, cursor));
            }
            let record = self.decode_cached(r)?;
            bytes += cached_size(&record);
            cursor = r.sequence;
            out.push(record);
        }
        Ok((out, self.last_sequence))
    }

    /// The frames of the records after position `after`, one after another as the journal
    /// holds them, at most `max_records` and about `max_bytes` (at least one record), with the
    /// position they account for through (as [`Store::read_from`] says) — when every one of
    /// them is in the cache; `None` otherwise (or when there is nothing after `after`). What a
    /// primary streams to a replica that keeps up: sent as they are, never encoded again.
    pub fn read_frames_from(
        &self,
        after: u64,
        max_records: usize,
        max_bytes: u64,
    ) -> Option<(Bytes, u64)> {
        let first = self.cache.front()?.sequence;
        if after + 1 < first || after >= self.last_sequence {
            return None;
        }
        let from = self.cache.partition_point(|r| r.sequence <= after);
        let mut out = bytes::BytesMut::new();
        let (mut count, mut bytes, mut cursor) = (0, 0, after);
        for r in self.cache.iter().skip(from) {
            if count >= max_records.max(1) || (count > 0 && bytes >= max_bytes) {
                return Some((out.freeze(), cursor));
            }
            out.extend_from_slice(&r.frame);
            count += 1;
            bytes += Self::cache_cost(r);
            cursor = r.sequence;
        }
        (count > 0).then(|| (out.freeze(), self.last_sequence))
    }

    /// Every outstanding message, every record held taken into account, in journal order:
    /// what a new primary rebuilds its queues from. Owned copies; a primary with millions of
    /// outstanding messages uses [`Store::for_each_outstanding`], which allocates nothing per
    /// message.
    pub fn outstanding(&self) -> Vec<Outstanding> {
        let mut out = Vec::new();
        self.for_each_outstanding(|o| {
            out.push(Outstanding {
                sequence: o.sequence,
                uri: o.uri.to_string(),
                guid: o.guid,
                size: o.size,
                apps: o.apps.iter().map(|(a, n)| (a.to_string(), *n)).collect(),
            })
        });
        out
    }

    /// Calls `f` with every outstanding message, every record held taken into account, in
    /// journal order, borrowed from the index: memory is 16 bytes per outstanding message for
    /// the ordering (plus the effects above the base), nothing allocated per message.
    pub fn for_each_outstanding(&self, mut f: impl FnMut(OutstandingRef<'_>)) {
        // The effects above the base, per GUID.
        let mut done: HashMap<u128, u64> = HashMap::new();
        let mut failed: HashMap<(u128, u8), u32> = HashMap::new();
        // Apps gone above the base: (queue, slot mask, messages before).
        let mut gone: Vec<(u32, u64, u64)> = Vec::new();
        for (_, effect) in &self.effects {
            match *effect {
                Effect::AppGone { queue, app, before } => gone.push((queue, 1u64 << app, before)),
                Effect::Done { guid, app } => *done.entry(guid).or_default() |= 1u64 << app,
                Effect::Failed {
                    guid,
                    app,
                    failures,
                } => {
                    let n = failed.entry((guid, app)).or_default();
                    *n = (*n).max(failures);
                }
            }
        }
        // (sequence, position in the index): the index does not change while this runs.
        let mut order: Vec<(u64, u32)> = self
            .index
            .iter()
            .enumerate()
            .map(|(i, (_, e))| (e.sequence, i as u32))
            .collect();
        order.sort_unstable();
        let mut apps: Vec<(&str, u32)> = Vec::new();
        for (sequence, position) in order {
            let (guid, e) = self.index.at(position as usize);
            let mut pending = e.pending & !done.get(&guid).copied().unwrap_or(0);
            for (queue, mask, before) in &gone {
                if *queue == e.queue && e.sequence < *before {
                    pending &= !mask;
                }
            }
            if pending == 0 {
                continue;
            }
            let info = &self.queues[e.queue as usize];
            apps.clear();
            for (i, name) in info.apps.iter().enumerate() {
                if pending & (1u64 << i) == 0 {
                    continue;
                }
                let app = i as u8;
                let base = e
                    .extra
                    .as_ref()
                    .and_then(|x| x.failures.iter().find(|(a, _)| *a == app))
                    .map_or(0, |(_, n)| *n);
                let above = failed.get(&(guid, app)).copied().unwrap_or(0);
                apps.push((name.as_str(), base.max(above)));
            }
            f(OutstandingRef {
                sequence,
                uri: &info.uri,
                guid,
                size: e.size,
                apps: &apps,
            });
        }
    }

    /// Deletes the closed segments whose records are all dead and settled, and compacts the
    /// settled closed segment with the most dead bytes while the dead bytes of closed settled
    /// segments exceed one segment. Removed records must be dead at the base of a durable
    /// marker (see the module doc): the marker is written here and made durable by a later
    /// sync, after which a later call removes them. Bounded work per call: at most one
    /// compaction, whose copy runs here, or — with [`Store::set_background_compaction`] — on
    /// the caller's other thread ([`Store::take_compaction`]); a finished copy is put in
    /// place by the first call that finds its marker durable.
    pub fn maintain(&mut self) -> Result<Maintenance, StoreError> {
        self.maintenance_due = false;
        let mut report = self.install_compaction()?;
        let compacting = self.compacting.as_ref().map(|c| c.segment());
        let base = self.base;
        let settled = |s: &Segment| s.last_sequence().is_none_or(|l| l <= base);
        // The segment under compaction stays until its copy is in place or given up.
        let dead_and_settled =
            |s: &Segment| s.live == s.self_pinned && settled(s) && Some(s.no) != compacting;
        // A segment goes only once a durable marker has a base at which it was dead: a
        // restart then knows its positions are absent on purpose, and no confirm that made
        // its messages dead can be truncated away. The marker is written here without an
        // fsync (the partition does not wait for the disk); the segments found dead at this
        // base are deleted by a later call, once the next sync has made the marker durable.
        // The newest durable marker must also outlive the deletion: it is in the active
        // segment (its header's or a later one) once the active segment itself is durable.
        let active_fresh = self.segments.last().is_some_and(|s| s.fresh);
        if let Some((at, _)) = &self.pending_deletion {
            if self.durable_marked_base < *at || active_fresh {
                self.maintenance_due = true;
                return Ok(report);
            }
            let (_, nos) = self.pending_deletion.take().expect("checked");
            for no in nos {
                // Still there and still dead (deadness only grows while the process runs).
                if let Some(i) = self.segments.iter().position(|s| s.no == no) {
                    if i + 1 < self.segments.len() && dead_and_settled(&self.segments[i]) {
                        self.delete_segment(i, &mut report)?;
                    }
                }
            }
        }
        // Deleting a segment releases the records it pinned, which may free the next one.
        loop {
            let closed = self.segments.len().saturating_sub(1);
            let deletable: Vec<u32> = self.segments[..closed]
                .iter()
                .filter(|s| dead_and_settled(s))
                .map(|s| s.no)
                .collect();
            if deletable.is_empty() {
                break;
            }
            if self.durable_marked_base < base || active_fresh {
                if self.marked.0 < base {
                    self.write_marker()?;
                }
                self.pending_deletion = Some((base, deletable));
                self.maintenance_due = true;
                break;
            }
            for no in deletable {
                let i = self
                    .segments
                    .iter()
                    .position(|s| s.no == no)
                    .expect("listed");
                self.delete_segment(i, &mut report)?;
            }
        }
        let closed = self.segments.len().saturating_sub(1);
        let sparse = |s: &Segment| settled(s) && s.live > 0;
        // A healing truncation cuts above the base and removes the segments that start above
        // the cut: a segment followed only by such ones would become the active segment and
        // take appends while its copy is made. Compacted are only segments whose next one
        // starts at or below the base (which never falls), so they stay closed.
        let stays_closed = |i: usize| {
            self.segments
                .get(i + 1)
                .and_then(Segment::first_sequence)
                .is_some_and(|f| f <= base)
        };
        let dead_closed: u64 = self.segments[..closed]
            .iter()
            .filter(|s| sparse(s))
            .map(Segment::reclaimable)
            .sum();
        // Deleting what waits for its marker releases records it pins elsewhere: decide on
        // compaction after that.
        let compact = if self.compacting.is_none()
            && self.pending_deletion.is_none()
            && dead_closed > self.cfg.segment_size_max
        {
            self.segments[..closed]
                .iter()
                .enumerate()
                .filter(|(i, s)| sparse(s) && stays_closed(*i) && s.reclaimable() > 0)
                .max_by_key(|(_, s)| s.reclaimable())
                .map(|(_, s)| s.no)
        } else {
            None
        };
        if let Some(no) = compact {
            if self.background_compaction {
                // The copy runs while the marker becomes durable.
                if self.marked.0 < base {
                    self.write_marker()?;
                }
                self.compaction_out = Some(self.begin_compaction(no));
            } else {
                self.mark_durably()?;
                let done = self.begin_compaction(no).run();
                let more = self.complete_compaction(done)?;
                report.compacted += more.compacted;
                report.freed_bytes += more.freed_bytes;
            }
        }
        if report.deleted > 0 {
            if self.cfg.fsync && !self.defer_close {
                sync_dir(&*self.disk, &self.dir)?;
            }
            self.maintenance_epoch += 1;
            metrics::counter!("bmq_journal_segments_deleted_total")
                .increment(report.deleted as u64);
        }
        Ok(report)
    }

    /// Leaves the copy of each compaction to the caller ([`Store::take_compaction`], to run
    /// on another thread and hand back to [`Store::complete_compaction`]) instead of running
    /// it inside [`Store::maintain`]: the copy reads and writes the segment's live records
    /// and fsyncs them, tens of milliseconds during which the partition would stop.
    pub fn set_background_compaction(&mut self, background: bool) {
        self.background_compaction = background;
    }

    /// Deletes closed segment `i` (every record dead and settled, a durable marker saying so):
    /// with deferred closing its file is renamed now and removed by the caller's thread with
    /// the close (which frees its pages and blocks: tens of milliseconds); a crash in between
    /// leaves a `.deleted` file, removed at open.
    fn delete_segment(&mut self, i: usize, report: &mut Maintenance) -> Result<(), StoreError> {
        let s = self.segments.remove(i);
        let full = || s.file.len().is_ok_and(|l| l >= self.cfg.segment_size_max);
        if self.cfg.recycle && !self.spare && full() {
            // Kept as the spare the next roll-over writes over (its blocks stay allocated).
            self.disk
                .rename(&s.path, &spare_path(&self.dir))
                .map_err(io(&s.path))?;
            self.spare = true;
            if self.defer_close && self.cfg.fsync {
                self.closed_files.sync_dir = Some(self.dir.clone());
            }
        } else {
            self.remove_file(&s.path)?;
        }
        self.retire_file(s.file.clone());
        // Its only live records were confirms of its own dead messages.
        self.live_bytes = self.live_bytes.saturating_sub(s.live_bytes);
        self.floor = self.floor.max(s.last_sequence().unwrap_or(0));
        self.bytes_total = self.bytes_total.saturating_sub(s.len);
        report.deleted += 1;
        report.freed_bytes += s.len;
        // The dead messages are gone from disk: their confirms are no longer needed.
        for r in s.pins {
            self.kill(r);
        }
        Ok(())
    }

    /// Removes the file at `path`: with deferred closing it is renamed now and removed by the
    /// caller's thread (a crash in between leaves a `.deleted` file, removed at open), the
    /// directory fsynced there; otherwise removed at once.
    fn remove_file(&mut self, path: &Path) -> Result<(), StoreError> {
        if self.defer_close {
            let deleted = deleted_path(path);
            self.disk.rename(path, &deleted).map_err(io(path))?;
            self.closed_files.unlink.push(deleted);
            if self.cfg.fsync {
                self.closed_files.sync_dir = Some(self.dir.clone());
            }
        } else {
            self.disk.remove_file(path).map_err(io(path))?;
        }
        Ok(())
    }

    /// Appends and syncs a marker with the current base, unless one is already durable.
    fn mark_durably(&mut self) -> Result<(), StoreError> {
        if self.marked != (self.base, self.last_sequence) {
            self.write_marker()?;
        }
        if self.needs_sync() {
            self.sync()?;
        }
        Ok(())
    }

    /// Checks that each segment's live count and live bytes agree with the live bits of its
    /// records, and the store's live bytes with the segments' (tests).
    #[cfg(test)]
    fn check_accounting(&self) -> Result<(), String> {
        let mut total = 0;
        for s in &self.segments {
            let live = s.records.iter().filter(|h| h.live()).count() as u64;
            let bytes: u64 = s
                .records
                .iter()
                .filter(|h| h.live())
                .map(|h| u64::from(h.len()))
                .sum();
            if (live, bytes) != (s.live, s.live_bytes) {
                return Err(format!(
                    "segment {}: {live} live records of {bytes} bytes, counted {} of {}",
                    s.no, s.live, s.live_bytes
                ));
            }
            total += bytes;
        }
        if total != self.live_bytes {
            return Err(format!("{total} live bytes, counted {}", self.live_bytes));
        }
        Ok(())
    }

    /// Counts, for gauges and `/status`.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            bytes: self.bytes_total,
            segments: self.segments.len(),
            outstanding: self.index.len(),
            live_bytes: self.live_bytes,
            base: self.base,
            floor: self.floor,
            last_sequence: self.last_sequence,
            durable: self.durable,
            cache_bytes: self.cache_bytes,
        }
    }
}

/// What [`Store::rollback`] returns to.
struct Snapshot {
    segments: usize,
    len: u64,
    last_sequence: u64,
    /// The lease runs, when the append replaces them (otherwise it only adds runs).
    runs: Option<Vec<(u64, u64)>>,
    base: u64,
    floor: u64,
}

/// Finishes a complete install in `dir` (its `COMPLETE` file exists: delete the journal's
/// segments, move the staged ones in) or discards an incomplete one.
fn recover_install(disk: &dyn Disk, dir: &Path) -> Result<(), StoreError> {
    let install = dir.join(INSTALL_DIR);
    if !disk.exists(&install) {
        return Ok(());
    }
    if !disk.exists(&install.join(INSTALL_COMPLETE)) {
        warn!(dir = %install.display(), "unfinished journal install discarded");
        return disk.remove_dir_all(&install).map_err(io(&install));
    }
    let segments = |d: &Path| -> Result<Vec<PathBuf>, StoreError> {
        Ok(disk
            .read_dir(d)
            .map_err(io(d))?
            .into_iter()
            .filter(|p| {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                name.starts_with("journal-") && name.ends_with(".bmqj")
            })
            .collect())
    };
    for old in segments(dir)? {
        disk.remove_file(&old).map_err(io(&old))?;
    }
    sync_dir(disk, dir)?;
    for new in segments(&install)? {
        let to = dir.join(new.file_name().expect("a file name"));
        disk.rename(&new, &to).map_err(io(&to))?;
    }
    sync_dir(disk, dir)?;
    disk.remove_dir_all(&install).map_err(io(&install))?;
    sync_dir(disk, dir)?;
    Ok(())
}

/// `marker` as a journal record (sequence 0, never replicated).
fn marker_record(marker: StoredMarker) -> JournalRecord {
    JournalRecord {
        lease: 0,
        sequence: 0,
        timestamp_ms: 0,
        kind: Some(RecordKind::Marker(marker)),
    }
}

/// The start of a segment file: its header (magic, format `version`) and `marker` framed.
fn segment_head(marker: &JournalRecord, version: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&version.to_le_bytes());
    frame(marker, &mut buf);
    buf
}

/// Appends `record` framed (length, CRC32C, body) to `buf`; returns the framed length.
fn frame<B>(record: &JournalRecord, buf: &mut B) -> u32
where
    B: bytes::BufMut + std::ops::DerefMut<Target = [u8]>,
{
    frame_sized(record, record.encoded_len(), buf)
}

/// [`frame`] of a record whose body is `len` bytes (`record.encoded_len()`, which the caller
/// computed already: prost's `encode` would compute it once more to check the room, and `buf`
/// grows anyway).
fn frame_sized<B>(record: &JournalRecord, len: usize, buf: &mut B) -> u32
where
    B: bytes::BufMut + std::ops::DerefMut<Target = [u8]>,
{
    let start = frame::begin(buf);
    record.encode_raw(&mut bmq_proto::EncodeBuf(buf));
    debug_assert_eq!(buf.len() - start, RECORD_HEADER_LEN + len);
    frame::finish(buf, start) as u32
}

/// Reserves `size` bytes for `file` from its start without changing its length
/// (`fallocate` with `FALLOC_FL_KEEP_SIZE`), so writes within them cannot fail for a full disk.
/// Returns the bytes reserved: `size`, or 0 where the file system cannot reserve.
/// Errors: the disk has not the space (`ENOSPC`), or another I/O error.
fn reserve(file: &FileRef, size: u64) -> std::io::Result<u64> {
    Ok(if file.reserve(size)? { size } else { 0 })
}

/// Reads the record `held` of segment `s` with one positioned read.
fn read_at(s: &Segment, held: Held) -> Result<JournalRecord, StoreError> {
    let mut data = vec![0u8; held.len() as usize];
    s.file
        .read_exact_at(&mut data, u64::from(held.offset))
        .map_err(io(&s.path))?;
    decode_framed(s, held, data)
}

/// Checks and decodes the framed record `held` of segment `s`, read as `data`.
fn decode_framed(s: &Segment, held: Held, data: Vec<u8>) -> Result<JournalRecord, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        path: s.path.clone(),
        offset: u64::from(held.offset),
        reason,
    };
    check_frame(&data, "read").map_err(corrupt)?;
    let body = Bytes::from(data).slice(RECORD_HEADER_LEN..);
    JournalRecord::decode(body).map_err(|e| corrupt(format!("record does not decode: {e}")))
}

/// Checks a record read whole from its segment (`| length | CRC32C | body |`, as long as the
/// segment's list says): its header is there and its body's checksum matches. Errors: the
/// reason, naming what was being done (`doing`).
fn check_frame(framed: &[u8], doing: &str) -> Result<(), String> {
    frame::check(framed).map_err(|damage| format!("{damage} on {doing}"))
}

#[path = "store_compaction.rs"]
mod compaction;

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
