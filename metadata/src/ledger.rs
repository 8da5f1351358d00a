//! The on-disk metadata ledger (DESIGN.md §5, "Ledger file").
//!
//! One directory holds one live file `ledger-<n>.bmql`:
//!
//! ```text
//! file header : magic b"BMQLEDG1" | version u32 LE | reserved u32
//! record      : the storage floor's frame (bmq_storage::frame: body length u32 | CRC32C u32 |
//!               body), whose body is
//!               record_type u8 | lsn_term u64 | lsn_sequence u64 | timestamp_ms u64 | protobuf
//!               (integers little-endian)
//! ```
//!
//! The partition journal writes the same frame, so one check ([`bmq_storage::frame::read`])
//! decides for both whether a record is whole. Version 1 files (their own frame: the header
//! above with a body length, then the protobuf, then a CRC32C over both) are read at open and
//! rewritten at once as version 2 (the same step as a reset: a new file, fsynced, renamed into
//! place), so a node upgraded in place keeps its ledger.
//!
//! Record types: 1 SNAPSHOT (body `ClusterStateSnapshot`, the committed state at the header's
//! LSN), 2 UPDATE (body `Advisory`), 3 COMMIT (body `AdvisoryCommit`), 4 reserved for ACK (skipped).
//!
//! Writing and syncing are separate so a node can group-commit: [`Ledger::write`]
//! encodes a record into a buffer, [`Ledger::sync`] writes everything buffered with one
//! `write` and makes it durable with one `fsync` (per [`FsyncPolicy`]), and [`Ledger::append`]
//! does both for one record. The format on disk is the same whichever is used.
//!
//! **Length ahead of the records**: the file's length is set 1 MiB at a time ahead
//! of what is written ([`LEDGER_LENGTH_STEP`]), and records are written into that zero-filled
//! length. An fsync then has no file size to record, which made the ledger's small fsyncs
//! 25-35% shorter on the benchmark machine (ext4: 120-145 µs instead of 190-205 µs for a 250-byte
//! record). The zeros after the last record are not a torn tail: opening finds the end of the
//! records where the zeros begin, and writes there next.
//!
//! **Rollover** (past [`Ledger::set_max_file_size`]) runs in two steps, so that no commit waits
//! for a snapshot of the whole state (with 420,000 queues, ~33 MB written and fsynced
//! while every commit waited, 354-414 ms):
//! 1. *The snapshot* ([`Ledger::begin_snapshot`], [`LedgerSnapshot::run`], on a thread of the
//!    caller's choosing): `ledger-<n+1>.bmql.next` = SNAPSHOT of the committed state + the
//!    still-uncommitted UPDATE records at that moment, written and fsynced. Meanwhile the ledger
//!    goes on writing and fsyncing records in the old file, and keeps a copy of each record
//!    written since the snapshot was taken.
//! 2. *The switch* (the next [`Ledger::begin_sync`]'s work, short): those records appended to
//!    the `.next` file, fsynced, the file renamed to `ledger-<n+1>.bmql`, the directory fsynced,
//!    the old file removed. The new file then holds everything the old one held.
//!
//! A [`Ledger::reset_to`] writes `ledger-<n+1>.bmql.tmp` (SNAPSHOT of the given state + its
//! UPDATE records) in one step, fsyncs it, renames it, fsyncs the directory and removes the old
//! file; a rollover's snapshot taken before the reset is discarded. A crash at any point leaves
//! one complete file with the highest number (a `.next` or `.tmp` file is removed at open); the
//! blocks of a removed file are freed a step at a time by [`LedgerRelease::run`].
//!
//! **Files** are the storage floor's ([`bmq_storage::disk`]): [`Ledger::open`] opens the
//! operating system's ([`RealDisk`]), [`Ledger::open_on`] any [`Disk`] — the simulators' disk
//! in memory, which loses at a power loss what no fsync made durable. The ledger reads no clock:
//! the records' `timestamp_ms` is the wall-clock time its shell last set
//! ([`Ledger::set_wall_clock_ms`]).
//!
//! **A failed write or fsync fails the ledger** for good (STYLE.md: a ledger write or fsync
//! failure stops the node; never retry an fsync). An fsync that failed says nothing about what
//! it covered, and Linux does not write those pages again at a later fsync (PostgreSQL's
//! "fsyncgate"), so no later fsync could make them durable: every later write, sync or handed-out
//! disk work returns [`LedgerError::Failed`], and nothing the failed fsync covered is ever
//! reported durable. The node stops acting as a metadata member; reopening the ledger after a
//! restart replays what the disk holds.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use bmq_proto::{peer, Term};
use bmq_storage::disk::{Disk, FileRef, FileSync, Open, RealDisk};
use bmq_storage::frame;
use prost::Message;
use thiserror::Error;
use tracing::{info, warn};

use crate::lsn::{lsn_of, Lsn};
use crate::state::ClusterState;

/// The file magic.
pub const LEDGER_MAGIC: &[u8; 8] = b"BMQLEDG1";
/// The file format version this code writes (it reads version 1 too, and rewrites such a
/// file at open).
pub const LEDGER_VERSION: u32 = 2;
/// Default size at which the ledger rolls over to a new file: 64 MiB.
pub const LEDGER_MAX_FILE_SIZE_DEFAULT: u64 = 64 * 1024 * 1024;
/// How far ahead of the records the ledger sets its file's length: 1 MiB (see the module doc).
pub const LEDGER_LENGTH_STEP: u64 = 1024 * 1024;
/// The largest record body accepted on read: any body the writer can frame (under 4 GiB).
/// A snapshot record holds the whole state (~40 bytes per queue), so a lower limit made a
/// ledger with a few hundred thousand queues unreadable by its own node (a 16 MiB limit did,
/// above ~390,000 queues). The file is read whole and a body longer than what follows its
/// header is a torn tail, so the length of the file bounds what a damaged length can cost.
pub const LEDGER_RECORD_BODY_MAX: u32 = u32::MAX - ENTRY_HEADER_LEN as u32;

const FILE_HEADER_LEN: usize = 16;
/// Bytes at the start of a record's body before its protobuf: type, LSN, timestamp.
const ENTRY_HEADER_LEN: usize = 1 + 8 + 8 + 8;
/// Bytes of a record before its protobuf (the frame's header, then the entry's).
const RECORD_HEADER_LEN: usize = frame::HEADER_LEN + ENTRY_HEADER_LEN;
/// Version 1's record header (the entry's, then the protobuf's length) and its trailing CRC.
const V1_RECORD_HEADER_LEN: usize = ENTRY_HEADER_LEN + 4;
const V1_CRC_LEN: usize = 4;

const TYPE_SNAPSHOT: u8 = 1;
const TYPE_UPDATE: u8 = 2;
const TYPE_COMMIT: u8 = 3;
const TYPE_ACK: u8 = 4;

/// When the ledger calls `fsync` ([`bmq_storage::disk::DiskFile::sync_data`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsyncPolicy {
    /// After every record (the default: metadata writes are rare and acks mean "on disk").
    #[default]
    EveryRecord,
    /// Never (tests only): a crash may lose acknowledged records.
    Never,
}

/// One ledger record, as the core asks for it to be written.
#[derive(Debug, Clone, PartialEq)]
pub enum LedgerRecord {
    /// The committed state at `lsn` (written at rollover and reset; committed by construction).
    Snapshot {
        /// The LSN of the last record the state includes.
        lsn: Lsn,
        /// The committed state.
        state: ClusterState,
    },
    /// An advisory, not yet known to be committed.
    Update {
        /// The advisory's LSN.
        lsn: Lsn,
        /// The advisory.
        advisory: peer::Advisory,
    },
    /// Every UPDATE up to and including `committed` is committed.
    Commit {
        /// The commit record's own LSN (the leader's next sequence).
        lsn: Lsn,
        /// The committed LSN.
        committed: Lsn,
    },
}

impl LedgerRecord {
    /// The record's own LSN.
    pub fn lsn(&self) -> Lsn {
        match self {
            LedgerRecord::Snapshot { lsn, .. }
            | LedgerRecord::Update { lsn, .. }
            | LedgerRecord::Commit { lsn, .. } => *lsn,
        }
    }
}

/// What the ledger holds, computed by replaying it on open.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    /// The state with every committed advisory applied.
    pub committed_state: ClusterState,
    /// The last committed LSN.
    pub committed_lsn: Lsn,
    /// UPDATE records after `committed_lsn` not (yet) known to be committed, in LSN order.
    pub uncommitted: Vec<(Lsn, peer::Advisory)>,
    /// The LSN of the last record of any type.
    pub last_lsn: Lsn,
}

impl Recovered {
    /// A fresh ledger: `partition_count` partitions, nothing written.
    pub fn fresh(partition_count: u32) -> Self {
        Recovered {
            committed_state: ClusterState::new(partition_count),
            committed_lsn: Lsn::ZERO,
            uncommitted: Vec::new(),
            last_lsn: Lsn::ZERO,
        }
    }

    /// Applies one record, as replay does.
    ///
    /// - SNAPSHOT sets the committed state and drops older uncommitted records.
    /// - UPDATE appends to the uncommitted list; a `LeaderAdvisory` with a snapshot
    ///   supersedes every uncommitted record of an older term (the new leader's snapshot
    ///   already holds every committed one, see `core.rs`), so those are dropped; one that
    ///   only continues a history keeps them (its commit commits them).
    /// - COMMIT applies every uncommitted record with LSN <= `committed`.
    pub(crate) fn replay(&mut self, record: &LedgerRecord) {
        let mut settled = Vec::new();
        self.replay_deferring(record, &mut settled);
        for (lsn, advisory) in settled {
            apply_committed(&mut self.committed_state, lsn, &advisory);
        }
    }

    /// [`Recovered::replay`], except that the advisories a COMMIT settles are moved to
    /// `deferred` (in LSN order) instead of applied to `committed_state`; the caller applies
    /// them later or replaces the state with one that holds them.
    pub(crate) fn replay_deferring(
        &mut self,
        record: &LedgerRecord,
        deferred: &mut Vec<(Lsn, peer::Advisory)>,
    ) {
        match record {
            LedgerRecord::Snapshot { lsn, state } => {
                self.committed_state = state.clone();
                self.committed_lsn = *lsn;
                self.uncommitted.retain(|(l, _)| l > lsn);
            }
            LedgerRecord::Update { lsn, advisory } => {
                match leader_continues(advisory) {
                    // A term that continues a history keeps its uncommitted advisories: it
                    // commits them (the node wrote it only when its last advisory was the one
                    // named, so nothing follows it; dropped if something does).
                    Some(Some(continues)) => self.uncommitted.retain(|(l, _)| *l <= continues),
                    Some(None) => self.uncommitted.retain(|(l, _)| l.term >= lsn.term),
                    None => {}
                }
                self.uncommitted.push((*lsn, advisory.clone()));
            }
            LedgerRecord::Commit { committed, .. } => {
                let split = self.uncommitted.partition_point(|(l, _)| l <= committed);
                deferred.extend(self.uncommitted.drain(..split));
                if *committed > self.committed_lsn {
                    self.committed_lsn = *committed;
                }
            }
        }
        self.last_lsn = self.last_lsn.max(record.lsn());
    }
}

/// Applies a committed advisory to `state`, as a replay does.
fn apply_committed(state: &mut ClusterState, lsn: Lsn, advisory: &peer::Advisory) {
    if let Err(error) = state.apply(advisory) {
        // The leader validated it; a failure here means a bug elsewhere. Keep going: refusing
        // to start would not repair the history.
        warn!(lsn = %lsn, error = %error, "committed advisory does not apply on replay");
    }
}

pub(crate) fn is_leader_advisory(advisory: &peer::Advisory) -> bool {
    matches!(advisory.kind, Some(peer::advisory::Kind::Leader(_)))
}

/// For a `LeaderAdvisory`: `Some(Some(lsn))` when it only continues the history whose last
/// advisory is `lsn` (no snapshot), `Some(None)` when it carries the whole state; `None` for
/// any other advisory.
pub fn leader_continues(advisory: &peer::Advisory) -> Option<Option<Lsn>> {
    match &advisory.kind {
        Some(peer::advisory::Kind::Leader(leader)) => {
            Some(match (&leader.state, leader.continues) {
                (None, Some(lsn)) => Some(Lsn::from(lsn)),
                _ => None,
            })
        }
        _ => None,
    }
}

/// Ledger failures. Any of them on write stops the node (STYLE.md: never retry an fsync); the
/// first I/O error of a write or sync also fails the ledger (see the module doc).
#[derive(Debug, Error)]
pub enum LedgerError {
    /// An I/O error on `path`.
    #[error("ledger i/o error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the ledger magic.
    #[error("{file}: not a ledger file")]
    BadMagic {
        /// The file.
        file: PathBuf,
    },
    /// The file has a version this code does not read.
    #[error("{file}: unsupported ledger version {version}")]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// Its version.
        version: u32,
    },
    /// A damaged record followed by valid ones (so not a torn tail), or a record whose CRC is
    /// right but whose content is not (bad body, LSN going backwards).
    #[error("{file}: corrupt record at offset {offset}")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// Byte offset of the damaged record.
        offset: u64,
    },
    /// An earlier write or fsync failed (`cause`, that error's text): the ledger takes no more
    /// writes and runs no more disk work until it is opened again.
    #[error("ledger failed earlier and takes nothing more: {cause}")]
    Failed {
        /// The first error.
        cause: String,
    },
}

/// The first error of a ledger's writes or syncs, shared with the disk work it hands out (which
/// runs on other threads): once set, the ledger and that work do nothing more.
#[derive(Debug, Clone, Default)]
struct Failure(Arc<OnceLock<String>>);

impl Failure {
    /// `Err(Failed)` once an error was recorded.
    fn check(&self) -> Result<(), LedgerError> {
        match self.0.get() {
            Some(cause) => Err(LedgerError::Failed {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records the error of `result`, if any (the first one is kept), and returns it.
    fn record<T>(&self, result: Result<T, LedgerError>) -> Result<T, LedgerError> {
        if let Err(e) = &result {
            let _ = self.0.set(e.to_string());
        }
        result
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LedgerError + '_ {
    move |source| LedgerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The disk work that makes the ledger's records written up to [`Ledger::begin_sync`]
/// durable, to run on any thread ([`LedgerSync::run`]): an fsync of the live file, a
/// rollover's switch to its new file, or the writing of a reset's new file.
#[derive(Debug)]
pub struct LedgerSync {
    work: SyncWork,
    /// The ledger's failure, shared: set by this work's error, and checked before it starts.
    failure: Failure,
}

#[derive(Debug)]
enum SyncWork {
    Fsync {
        sync: FileSync,
        path: PathBuf,
    },
    /// A reset's new file: the state and records of the mirror when it was handed out (a
    /// clone of the state shares its maps: O(1)); encoding it is part of the work.
    Rewrite {
        disk: Arc<dyn Disk>,
        dir: PathBuf,
        old_index: u64,
        mirror: Recovered,
        /// The records' `timestamp_ms` (the shell's wall clock when the work was handed out).
        timestamp_ms: u64,
        /// The file being replaced, for its release once its name is gone.
        old_file: FileRef,
    },
    /// A rollover's switch: the records written since the snapshot appended to the snapshot's
    /// file, which then replaces the old one.
    Switch {
        disk: Arc<dyn Disk>,
        dir: PathBuf,
        old_index: u64,
        next: SnapshotWritten,
        /// Every record written since the snapshot was taken, encoded.
        tail: Vec<u8>,
        old_file: FileRef,
    },
}

/// What a [`LedgerSync`] did, for [`Ledger::complete_sync`].
#[derive(Debug)]
pub struct SyncDone {
    /// After a rewrite or a switch: the new live file, and the replaced one (its name removed).
    rewritten: Option<(NewFile, FileRef)>,
}

impl LedgerSync {
    /// Makes the covered records durable: the live file's [`FileSync`] (`fdatasync`), the
    /// journal's sync step too; or a
    /// rollover's switch (the records since its snapshot appended to the snapshot's file,
    /// fsynced, renamed into place, the directory fsynced, the old file removed: about two
    /// fsyncs); or a reset's new file written, fsynced and renamed into place the same way. A
    /// removed file's blocks are freed later, by the [`LedgerRelease`] that
    /// [`Ledger::take_release`] hands out.
    ///
    /// # Errors
    /// I/O errors, which fail the ledger; [`LedgerError::Failed`] without touching the disk
    /// when the ledger failed since this work was handed out. Either way nothing it covers is
    /// durable as far as anyone may know: the caller must not report it persisted, and must
    /// stop the node (STYLE.md: never retry an fsync).
    pub fn run(self) -> Result<SyncDone, LedgerError> {
        self.failure.check()?;
        let failure = self.failure;
        failure.record(match self.work {
            SyncWork::Fsync { sync, path } => sync
                .run()
                .map_err(io_err(&path))
                .map(|()| SyncDone { rewritten: None }),
            SyncWork::Rewrite {
                disk,
                dir,
                old_index,
                mirror,
                timestamp_ms,
                old_file,
            } => write_next_file(&*disk, &dir, old_index, &mirror, timestamp_ms).map(|new| {
                SyncDone {
                    rewritten: Some((new, old_file)),
                }
            }),
            SyncWork::Switch {
                disk,
                dir,
                old_index,
                next,
                tail,
                old_file,
            } => switch_to_next_file(&*disk, &dir, old_index, next, &tail).map(|new| SyncDone {
                rewritten: Some((new, old_file)),
            }),
        })
    }

    /// Whether this is the writing of a reset's new file.
    #[cfg(test)]
    fn is_rewrite(&self) -> bool {
        matches!(self.work, SyncWork::Rewrite { .. })
    }

    /// Whether this is a rollover's switch to its new file.
    #[cfg(test)]
    fn is_switch(&self) -> bool {
        matches!(self.work, SyncWork::Switch { .. })
    }
}

/// The first step of a rollover, to run on any thread ([`LedgerSnapshot::run`]): the new file
/// `ledger-<n+1>.bmql.next` with the SNAPSHOT of the committed state and the uncommitted
/// UPDATE records as they were at [`Ledger::begin_snapshot`], written and fsynced. The ledger
/// goes on meanwhile; give the result to [`Ledger::complete_snapshot`].
#[derive(Debug)]
pub struct LedgerSnapshot {
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    index: u64,
    mirror: Recovered,
    /// The records' `timestamp_ms` (the shell's wall clock when the snapshot was handed out).
    timestamp_ms: u64,
    generation: u64,
    failure: Failure,
}

impl LedgerSnapshot {
    /// Encodes, writes and fsyncs the snapshot's file (tens of milliseconds with 100,000
    /// queues; the only step of a rollover that grows with the state).
    ///
    /// # Errors
    /// I/O errors, which fail the ledger (the switch would otherwise count on a file whose
    /// fsync failed); [`LedgerError::Failed`] without touching the disk when the ledger failed
    /// since. The caller must stop the node.
    pub fn run(self) -> Result<SnapshotWritten, LedgerError> {
        self.failure.check()?;
        let path = file_path(&self.dir, self.index).with_extension("bmql.next");
        let (file, len) = self.failure.record(write_file(
            &*self.disk,
            &path,
            &self.mirror,
            self.timestamp_ms,
        ))?;
        Ok(SnapshotWritten {
            file,
            path,
            index: self.index,
            len,
            generation: self.generation,
        })
    }
}

/// A rollover's snapshot file, written and fsynced by [`LedgerSnapshot::run`].
#[derive(Debug)]
pub struct SnapshotWritten {
    file: FileRef,
    /// `ledger-<index>.bmql.next`.
    path: PathBuf,
    index: u64,
    /// Bytes written (header and records).
    len: u64,
    /// [`Ledger`]'s reset count when the snapshot was taken: after a reset it is discarded.
    generation: u64,
}

impl SnapshotWritten {
    /// The release of a discarded snapshot: its file removed (from `disk`) and freed.
    fn discard(self, disk: Arc<dyn Disk>) -> LedgerRelease {
        LedgerRelease {
            disk,
            file: self.file,
            remove: Some(self.path),
        }
    }
}

/// A file the ledger no longer uses, whose blocks are to be freed: [`LedgerRelease::run`] on a
/// thread that waits for nothing else (about 1 ms per MiB, [`bmq_storage::release`]), since freeing
/// a large file at once holds every fsync of the disk (35-39 ms measured for a 32 MiB ledger
/// file, on every node at once).
#[derive(Debug)]
pub struct LedgerRelease {
    disk: Arc<dyn Disk>,
    file: FileRef,
    /// A name to remove first (a discarded snapshot's file).
    remove: Option<PathBuf>,
}

impl LedgerRelease {
    /// Removes the file's name if it still has one of the ledger's, then frees its blocks a
    /// step at a time ([`bmq_storage::disk::DiskFile::release`]; on a real disk
    /// [`bmq_storage::release::release_gradually`]). Best effort: an error leaves the blocks to
    /// the last close (or the name to the next open's clean-up).
    pub fn run(self) {
        if let Some(path) = &self.remove {
            if let Err(e) = self.disk.remove_file(path) {
                warn!(file = %path.display(), error = %e, "discarded ledger snapshot not removed");
            }
        }
        self.file.release();
    }
}

/// Where a rollover stands (see the module doc).
#[derive(Debug, Default)]
enum Rollover {
    /// None due.
    #[default]
    Idle,
    /// The live file passed its size: the next [`Ledger::begin_snapshot`] hands out the
    /// snapshot.
    Due,
    /// The snapshot is being written; records written meanwhile are copied for the switch.
    Writing,
    /// The snapshot is written; the next [`Ledger::begin_sync`] hands out the switch.
    Written(SnapshotWritten),
    /// The switch runs (as a [`LedgerSync`]).
    Switching,
}

/// The metadata ledger: appends records, rolls over, and replays on open.
#[derive(Debug)]
pub struct Ledger {
    /// The disk the files are on.
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    fsync: FsyncPolicy,
    max_file_size: u64,
    /// The live file; shared with a [`LedgerSync`] whose fsync runs on another thread.
    file: FileRef,
    file_index: u64,
    /// Bytes of records (and header) in the live file, not counting `buffer`: where the next
    /// write goes.
    file_size: u64,
    /// The live file's length: `file_size` plus the zeros set ahead of the records.
    file_len: u64,
    /// Encoded records written by [`Ledger::write`] and not yet handed to the file.
    buffer: Vec<u8>,
    /// Records handed to the file since the last fsync (an fsync is due).
    unsynced: bool,
    /// A reset is due: the next [`Ledger::begin_sync`] hands out the new file's writing (from
    /// the mirror, which holds every record written since the reset).
    rewrite_due: bool,
    /// A reset's rewrite or a rollover's switch handed out by [`Ledger::begin_sync`] is not
    /// yet completed ([`Ledger::complete_sync`]): records written meanwhile wait in the buffer.
    rewrite_running: bool,
    /// Where a rollover stands.
    rollover: Rollover,
    /// Every record written since the running rollover's snapshot was taken, encoded: the
    /// switch appends them to the snapshot's file.
    since_snapshot: Vec<u8>,
    /// Resets so far: a snapshot taken before the last one is discarded.
    generation: u64,
    /// The live file's size when a rollover or reset wrote it (0 for a file opened or
    /// created): it rolls over past twice that at least ([`Ledger::set_max_file_size`]).
    written_len: u64,
    /// Files to free ([`Ledger::take_release`]).
    releases: Vec<LedgerRelease>,
    bytes_written: u64,
    rollovers: u64,
    /// The ledger's own replay of what it wrote, for rollover snapshots.
    mirror: Recovered,
    /// Committed advisories the mirror has not applied to its committed state yet, in LSN
    /// order: applied when the mirror is read ([`Ledger::recovered`], a rewrite), dropped when
    /// the caller hands over the state they lead to ([`Ledger::share_committed_state`], after
    /// every commit), so a commit is applied once per node instead of twice (the second
    /// application was ~2% of the metadata leader's main thread with 64 opens in flight).
    unapplied: Vec<(Lsn, peer::Advisory)>,
    /// The wall-clock time stamped on records, ms since the Unix epoch
    /// ([`Ledger::set_wall_clock_ms`]).
    wall_clock_ms: u64,
    /// Set by the first failed write or fsync: the ledger takes nothing more.
    failure: Failure,
}

impl Ledger {
    /// Opens (or creates) the ledger in `dir` on the operating system's files and replays it:
    /// [`Ledger::open_on`] with [`RealDisk`].
    ///
    /// # Errors
    /// As [`Ledger::open_on`].
    pub fn open(
        dir: impl AsRef<Path>,
        fsync: FsyncPolicy,
        partition_count: u32,
    ) -> Result<(Ledger, Recovered), LedgerError> {
        Ledger::open_on(Arc::new(RealDisk), dir, fsync, partition_count)
    }

    /// Opens (or creates) the ledger in directory `dir` of `disk` and replays it.
    ///
    /// A torn or corrupt tail (an incomplete record, or bad records with nothing valid after them)
    /// is truncated with a warning and the counter `bmq_ledger_torn_tail_truncations_total`.
    /// An empty directory gives a fresh state of `partition_count` partitions. Leftovers of an
    /// interrupted rollover or reset (a `.next` or `.tmp` file, an older complete file) are
    /// removed.
    ///
    /// # Errors
    /// [`LedgerError::Corrupt`] when damage is followed by valid records, bad magic or version,
    /// I/O errors.
    pub fn open_on(
        disk: Arc<dyn Disk>,
        dir: impl AsRef<Path>,
        fsync: FsyncPolicy,
        partition_count: u32,
    ) -> Result<(Ledger, Recovered), LedgerError> {
        let dir = dir.as_ref().to_path_buf();
        disk.create_dir_all(&dir).map_err(io_err(&dir))?;
        let mut files = Vec::new();
        for path in disk.read_dir(&dir).map_err(io_err(&dir))? {
            let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            if name.starts_with("ledger-")
                && (name.ends_with(".bmql.tmp") || name.ends_with(".bmql.next"))
            {
                // An unfinished reset or rollover: the old file is still complete.
                disk.remove_file(&path).map_err(io_err(&path))?;
            } else if let Some(n) = name
                .strip_prefix("ledger-")
                .and_then(|rest| rest.strip_suffix(".bmql"))
                .and_then(|n| n.parse::<u64>().ok())
            {
                files.push(n);
            }
        }
        files.sort_unstable();
        let Some(&file_index) = files.last() else {
            let recovered = Recovered::fresh(partition_count);
            let path = file_path(&dir, 0);
            // No `ledger-0.bmql` is listed, so creating it truncates nothing.
            let file = disk.open(&path, Open::Create).map_err(io_err(&path))?;
            file.write_all_at(&file_header(), 0)
                .map_err(io_err(&path))?;
            file.sync_all().map_err(io_err(&path))?;
            sync_dir(&*disk, &dir)?;
            let ledger = Ledger::with_file(
                disk,
                dir,
                fsync,
                file,
                0,
                FILE_HEADER_LEN as u64,
                FILE_HEADER_LEN as u64,
                recovered.clone(),
            );
            return Ok((ledger, recovered));
        };
        // A completed rollover whose old file was not yet removed.
        for old in &files[..files.len() - 1] {
            let path = file_path(&dir, *old);
            disk.remove_file(&path).map_err(io_err(&path))?;
        }
        let path = file_path(&dir, file_index);
        let file = disk.open(&path, Open::ReadWrite).map_err(io_err(&path))?;
        let bytes = file.read_up_to(u64::MAX).map_err(io_err(&path))?;
        let scan = scan(&path, &bytes, partition_count)?;
        if scan.version < LEDGER_VERSION {
            // Rewritten as a reset would (the old file stays whole until the new one is in
            // place): no code path below appends records of two formats to one file.
            drop(file);
            let new = write_next_file(&*disk, &dir, file_index, &scan.recovered, 0)?;
            info!(
                from_version = scan.version,
                to_version = LEDGER_VERSION,
                file = %file_path(&dir, new.index).display(),
                "ledger rewritten in the current format"
            );
            let ledger = Ledger::with_file(
                disk,
                dir,
                fsync,
                new.file,
                new.index,
                new.len,
                new.len,
                scan.recovered.clone(),
            );
            return Ok((ledger, scan.recovered));
        }
        // Zeros after the last record are the length set ahead of it (see the module doc).
        let zero_tail = bytes
            .get(scan.valid_len as usize..)
            .is_some_and(|tail| tail.iter().all(|b| *b == 0));
        let file_size = if scan.rewrite_header {
            FILE_HEADER_LEN as u64
        } else {
            scan.valid_len
        };
        let mut file_len = bytes.len() as u64;
        if scan.rewrite_header || !zero_tail {
            warn!(
                file = %path.display(),
                offset = scan.valid_len,
                dropped_bytes = bytes.len() as u64 - scan.valid_len.min(bytes.len() as u64),
                "ledger has a torn tail; truncating"
            );
            metrics::counter!("bmq_ledger_torn_tail_truncations_total").increment(1);
            file.set_len(scan.valid_len).map_err(io_err(&path))?;
            if scan.rewrite_header {
                file.write_all_at(&file_header(), 0)
                    .map_err(io_err(&path))?;
            }
            file.sync_all().map_err(io_err(&path))?;
            file_len = file_size;
        }
        info!(
            file = %path.display(),
            last_lsn = %scan.recovered.last_lsn,
            committed_lsn = %scan.recovered.committed_lsn,
            uncommitted = scan.recovered.uncommitted.len(),
            "ledger opened"
        );
        let ledger = Ledger::with_file(
            disk,
            dir,
            fsync,
            file,
            file_index,
            file_size,
            file_len,
            scan.recovered.clone(),
        );
        Ok((ledger, scan.recovered))
    }

    /// A ledger on its live file `file` (`ledger-<file_index>.bmql`, `file_size` bytes of
    /// header and records, `file_len` bytes long), whose records replay to `mirror`.
    #[allow(clippy::too_many_arguments)] // each is one fact of the file just opened
    fn with_file(
        disk: Arc<dyn Disk>,
        dir: PathBuf,
        fsync: FsyncPolicy,
        file: FileRef,
        file_index: u64,
        file_size: u64,
        file_len: u64,
        mirror: Recovered,
    ) -> Ledger {
        Ledger {
            disk,
            dir,
            fsync,
            max_file_size: LEDGER_MAX_FILE_SIZE_DEFAULT,
            file,
            file_index,
            file_size,
            file_len,
            buffer: Vec::new(),
            unsynced: false,
            rewrite_due: false,
            rewrite_running: false,
            rollover: Rollover::Idle,
            since_snapshot: Vec::new(),
            generation: 0,
            written_len: 0,
            releases: Vec::new(),
            bytes_written: 0,
            rollovers: 0,
            mirror,
            unapplied: Vec::new(),
            wall_clock_ms: 0,
            failure: Failure::default(),
        }
    }

    /// Sets the wall-clock time, ms since the Unix epoch, stamped on the records written from
    /// now on (their `timestamp_ms`, and that of a rollover's or reset's file handed out from
    /// now on). Informational: replay does not read it. The ledger reads no clock; its shell
    /// sets this before it writes (a ledger never told stamps 0).
    pub fn set_wall_clock_ms(&mut self, unix_ms: u64) {
        self.wall_clock_ms = unix_ms;
    }

    /// The first write or fsync error that failed the ledger (see the module doc), as text;
    /// `None` while it works.
    pub fn failure(&self) -> Option<&str> {
        self.failure.0.get().map(String::as_str)
    }

    /// Sets the size (bytes) past which the ledger rolls over to a new file — or past twice
    /// the size the file had when it was written, if that is more: a state whose snapshot
    /// alone passes the size (about 850,000 queues for the default 64 MiB) would otherwise
    /// roll over at every record, writing the whole state each time; this way a rollover
    /// writes at most as many bytes as records were appended since the last one.
    pub fn set_max_file_size(&mut self, max_file_size: u64) {
        self.max_file_size = max_file_size;
    }

    /// Appends one record and makes it durable: [`Ledger::write`] then [`Ledger::sync`].
    ///
    /// # Panics
    /// As [`Ledger::write`].
    ///
    /// # Errors
    /// As [`Ledger::sync`]; the caller must stop the node.
    pub fn append(&mut self, record: &LedgerRecord) -> Result<(), LedgerError> {
        self.write(record)?;
        self.sync()
    }

    /// Adds one record to the ledger, not yet durable: it is encoded into a buffer that the
    /// next [`Ledger::sync`] (or [`Ledger::flush`]) writes out. Past `max_file_size` a rollover
    /// becomes due: the next [`Ledger::begin_snapshot`] hands out its snapshot.
    ///
    /// # Panics
    /// If the record's LSN is not above the last one written (a programmer error that would
    /// corrupt the history); SNAPSHOT records are not accepted here (use [`Ledger::reset_to`]).
    ///
    /// # Errors
    /// [`LedgerError::Failed`] once the ledger failed (nothing is written).
    pub fn write(&mut self, record: &LedgerRecord) -> Result<(), LedgerError> {
        self.failure.check()?;
        assert!(
            !matches!(record, LedgerRecord::Snapshot { .. }),
            "snapshots are written by rollover and reset_to only"
        );
        assert!(
            record.lsn() > self.mirror.last_lsn,
            "ledger LSN regressed: {} after {}",
            record.lsn(),
            self.mirror.last_lsn
        );
        let before = self.buffer.len();
        encode_record_into(&mut self.buffer, record, self.wall_clock_ms);
        self.bytes_written += (self.buffer.len() - before) as u64;
        if matches!(self.rollover, Rollover::Writing | Rollover::Written(_)) {
            // Not in the snapshot being written: the switch copies it into the new file.
            self.since_snapshot
                .extend_from_slice(&self.buffer[before..]);
        }
        self.mirror.replay_deferring(record, &mut self.unapplied);
        if matches!(self.rollover, Rollover::Idle)
            && !self.rewrite_due
            && !self.rewrite_running
            && self.file_size + self.buffer.len() as u64
                >= self.max_file_size.max(2 * self.written_len)
        {
            self.rollover = Rollover::Due;
            self.rollovers += 1;
        }
        Ok(())
    }

    /// Hands the buffered records to the file with one `write`, without an fsync: they
    /// survive a crash of the process, not of the machine.
    /// While a reset's rewrite is due (it will hold them) or a rewrite or switch runs (the
    /// file's end is not known yet) the records stay in the buffer. While a rollover's
    /// snapshot is written, they go to the old file as usual.
    ///
    /// # Errors
    /// I/O errors, which fail the ledger; [`LedgerError::Failed`] once it failed. The caller
    /// must stop the node.
    pub fn flush(&mut self) -> Result<(), LedgerError> {
        self.failure.check()?;
        if self.buffer.is_empty() || self.rewrite_due || self.rewrite_running {
            return Ok(());
        }
        let path = file_path(&self.dir, self.file_index);
        let end = self.file_size + self.buffer.len() as u64;
        if end > self.file_len {
            let len = end.div_ceil(LEDGER_LENGTH_STEP) * LEDGER_LENGTH_STEP;
            self.failure
                .record(self.file.set_len(len).map_err(io_err(&path)))?;
            self.file_len = len;
        }
        self.failure.record(
            self.file
                .write_all_at(&self.buffer, self.file_size)
                .map_err(io_err(&path)),
        )?;
        self.file_size = end;
        self.buffer.clear();
        self.unsynced = true;
        Ok(())
    }

    /// Makes every record written so far durable: [`Ledger::flush`], then one fsync
    /// ([`bmq_storage::disk::DiskFile::sync_data`]) unless the policy is [`FsyncPolicy::Never`]
    /// or nothing is pending. A due rollover's snapshot and switch run here too.
    ///
    /// # Errors
    /// I/O errors, which fail the ledger: none of the records it was to make durable may be
    /// counted as durable; [`LedgerError::Failed`] once it failed. The caller must stop the
    /// node (STYLE.md: never retry an fsync).
    pub fn sync(&mut self) -> Result<(), LedgerError> {
        self.failure.check()?;
        if let Some(snapshot) = self.begin_snapshot() {
            let written = snapshot.run()?;
            self.complete_snapshot(written);
        }
        while let Some(sync) = self.begin_sync()? {
            let done = sync.run()?;
            self.complete_sync(done);
        }
        while let Some(release) = self.take_release() {
            release.run();
        }
        Ok(())
    }

    /// Hands out a due rollover's first step: the snapshot of everything written so far, to
    /// write on another thread ([`LedgerSnapshot::run`]) while the ledger goes on writing and
    /// syncing records in the live file; give its result to [`Ledger::complete_snapshot`].
    /// `None` when no rollover is due (or one is under way), or once the ledger failed.
    pub fn begin_snapshot(&mut self) -> Option<LedgerSnapshot> {
        if !matches!(self.rollover, Rollover::Due) || self.failure.check().is_err() {
            return None;
        }
        self.settle_mirror();
        self.rollover = Rollover::Writing;
        self.since_snapshot.clear();
        Some(LedgerSnapshot {
            disk: self.disk.clone(),
            dir: self.dir.clone(),
            index: self.file_index + 1,
            mirror: self.mirror.clone(),
            timestamp_ms: self.wall_clock_ms,
            generation: self.generation,
            failure: self.failure.clone(),
        })
    }

    /// Takes a written snapshot: the next [`Ledger::begin_sync`] hands out the switch to it.
    /// A snapshot taken before a [`Ledger::reset_to`] is discarded (its file is removed by the
    /// next [`Ledger::take_release`]'s work).
    pub fn complete_snapshot(&mut self, written: SnapshotWritten) {
        if written.generation != self.generation || !matches!(self.rollover, Rollover::Writing) {
            self.releases.push(written.discard(self.disk.clone()));
            return;
        }
        self.rollover = Rollover::Written(written);
    }

    /// A file the ledger let go of, whose blocks are to be freed on a thread that waits for
    /// nothing else ([`LedgerRelease::run`]); `None` when there is none.
    pub fn take_release(&mut self) -> Option<LedgerRelease> {
        self.releases.pop()
    }

    /// A rollover is under way or due (its snapshot or switch not yet handed out or not yet
    /// completed).
    pub fn rollover_pending(&self) -> bool {
        !matches!(self.rollover, Rollover::Idle)
    }

    /// [`Ledger::sync`] in steps, so that the disk work can run on another thread while the
    /// caller goes on: returns the work still due to make every record written so far
    /// durable — an fsync of the live file after handing it the buffered records (as
    /// [`Ledger::flush`]), or the writing of a new file when a rollover or reset is due — or
    /// `None` when nothing is pending or the policy is [`FsyncPolicy::Never`] (then what was
    /// written counts as persisted at once). Run it ([`LedgerSync::run`]), then give its result
    /// to [`Ledger::complete_sync`] before the next `begin_sync`.
    ///
    /// When a rollover's snapshot is written ([`Ledger::complete_snapshot`]), the work is its
    /// switch, which covers every record written so far too.
    ///
    /// Records written after this call are not covered by the returned [`LedgerSync`]: they
    /// need another one. A reset ([`Ledger::reset_to`]) while one runs is safe for the files
    /// (its new file is written by a later `LedgerSync`, after this one completed); whether
    /// the records the running one covers still belong to the history is the caller's
    /// question (a reset replaces them).
    ///
    /// # Panics
    /// When a rewrite handed out earlier has not been completed (a programmer error).
    ///
    /// # Errors
    /// I/O errors of the write, which fail the ledger; [`LedgerError::Failed`] once it failed
    /// (no work is handed out, so no fsync is retried). The caller must stop the node.
    pub fn begin_sync(&mut self) -> Result<Option<LedgerSync>, LedgerError> {
        self.failure.check()?;
        assert!(
            !self.rewrite_running,
            "ledger sync begun while a rewrite is not completed"
        );
        if self.rewrite_due {
            // The new file is written from the mirror, which holds the buffered records.
            debug_assert!(!matches!(self.rollover, Rollover::Written(_)));
            self.rewrite_due = false;
            self.rewrite_running = true;
            self.buffer.clear();
            self.settle_mirror();
            self.unsynced = false;
            return Ok(Some(LedgerSync {
                work: SyncWork::Rewrite {
                    disk: self.disk.clone(),
                    dir: self.dir.clone(),
                    old_index: self.file_index,
                    mirror: self.mirror.clone(),
                    timestamp_ms: self.wall_clock_ms,
                    old_file: self.file.clone(),
                },
                failure: self.failure.clone(),
            }));
        }
        if matches!(self.rollover, Rollover::Written(_)) {
            let Rollover::Written(next) =
                std::mem::replace(&mut self.rollover, Rollover::Switching)
            else {
                unreachable!("matched above")
            };
            // Every buffered record is in the snapshot or among those written since.
            self.rewrite_running = true;
            self.buffer.clear();
            self.unsynced = false;
            return Ok(Some(LedgerSync {
                work: SyncWork::Switch {
                    disk: self.disk.clone(),
                    dir: self.dir.clone(),
                    old_index: self.file_index,
                    next,
                    tail: std::mem::take(&mut self.since_snapshot),
                    old_file: self.file.clone(),
                },
                failure: self.failure.clone(),
            }));
        }
        self.flush()?;
        let due = self.unsynced && self.fsync == FsyncPolicy::EveryRecord;
        self.unsynced = false;
        Ok(due.then(|| LedgerSync {
            work: SyncWork::Fsync {
                // The live file's name is durable: made by the open, a reset or a switch, each
                // of which fsyncs the directory.
                sync: FileSync::new(self.disk.clone(), self.file.clone(), None),
                path: file_path(&self.dir, self.file_index),
            },
            failure: self.failure.clone(),
        }))
    }

    /// A reset's new file, or a rollover's switch, waits for the next [`Ledger::begin_sync`]
    /// (a reset's records stay in memory until its file is written).
    pub fn rewrite_due(&self) -> bool {
        self.rewrite_due || matches!(self.rollover, Rollover::Written(_))
    }

    /// Takes the result of a [`LedgerSync`] run: after a rewrite or a switch, the new file
    /// becomes the live one, records written meanwhile go to it at the next flush, and the old
    /// file waits for its release ([`Ledger::take_release`]).
    pub fn complete_sync(&mut self, done: SyncDone) {
        if let Some((file, replaced)) = done.rewritten {
            self.file = file.file;
            self.file_index = file.index;
            self.file_size = file.len;
            self.file_len = file.len;
            self.written_len = file.len;
            self.bytes_written += file.len;
            self.rewrite_running = false;
            if matches!(self.rollover, Rollover::Switching) {
                self.rollover = Rollover::Idle;
            }
            self.releases.push(LedgerRelease {
                disk: self.disk.clone(),
                file: replaced,
                remove: None,
            });
        }
    }

    /// Replaces the whole history: a follower that received a `CatchUp` (or any history that
    /// supersedes its own) records it as a SNAPSHOT of `state` at `committed_lsn` (committed)
    /// followed by the `uncommitted` UPDATE records, in a new file, like a rollover. The new
    /// history is durable once the next [`Ledger::begin_sync`]'s work has run (it writes that
    /// file); until then a crash leaves the old history.
    ///
    /// # Errors
    /// [`LedgerError::Failed`] once the ledger failed (nothing changes).
    pub fn reset_to(
        &mut self,
        state: &ClusterState,
        committed_lsn: Lsn,
        uncommitted: &[(Lsn, peer::Advisory)],
    ) -> Result<(), LedgerError> {
        self.failure.check()?;
        let last_lsn = uncommitted
            .iter()
            .map(|(l, _)| *l)
            .fold(committed_lsn, Lsn::max);
        self.mirror = Recovered {
            committed_state: state.clone(),
            committed_lsn,
            uncommitted: uncommitted.to_vec(),
            last_lsn,
        };
        self.unapplied.clear();
        // Records still buffered belong to the history being replaced.
        self.buffer.clear();
        self.unsynced = false;
        self.rewrite_due = true;
        // A rollover's snapshot holds the old history: discarded (a switch already running
        // completes first; the reset's file then replaces its file).
        self.generation += 1;
        self.since_snapshot.clear();
        match std::mem::take(&mut self.rollover) {
            Rollover::Written(next) => self.releases.push(next.discard(self.disk.clone())),
            Rollover::Switching => self.rollover = Rollover::Switching,
            Rollover::Idle | Rollover::Due | Rollover::Writing => {}
        }
        Ok(())
    }

    /// Bytes written since open (records, rollover files included).
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    /// Size of the live file in bytes, records written but not yet flushed included.
    pub fn file_size(&self) -> u64 {
        self.file_size + self.buffer.len() as u64
    }

    /// Rollovers since open (not counting [`Ledger::reset_to`]), counted when they become due.
    pub fn rollovers(&self) -> u64 {
        self.rollovers
    }

    /// The path of the live file.
    pub fn file_path(&self) -> PathBuf {
        file_path(&self.dir, self.file_index)
    }

    /// What a replay of the ledger would give now.
    pub fn recovered(&mut self) -> &Recovered {
        self.settle_mirror();
        &self.mirror
    }

    /// Applies to the mirror's committed state the committed advisories it deferred.
    fn settle_mirror(&mut self) {
        for (lsn, advisory) in self.unapplied.drain(..) {
            apply_committed(&mut self.mirror.committed_state, lsn, &advisory);
        }
    }

    /// Takes `state`, the state committed through `committed_lsn` as the caller (the
    /// metadata core) holds it, as the mirror's committed state when the mirror is at the
    /// same LSN: the same content (both applied the same committed advisories to the same
    /// snapshot), and a clone shares every node of its maps, so the ledger no longer keeps a
    /// third copy of the state (~300 bytes per queue). Does nothing at another LSN.
    pub fn share_committed_state(&mut self, committed_lsn: Lsn, state: &ClusterState) {
        if self.mirror.committed_lsn != committed_lsn {
            return;
        }
        #[cfg(debug_assertions)]
        self.settle_mirror();
        // The state handed over is the deferred advisories applied.
        self.unapplied.clear();
        debug_assert!(
            self.mirror.committed_state == *state,
            "the ledger's committed state at {committed_lsn} differs from the core's"
        );
        self.mirror.committed_state = state.clone();
    }
}

/// A ledger file's bytes holding `mirror`: the header, a SNAPSHOT of its committed state, its
/// uncommitted UPDATE records and, when the last record written was a COMMIT (whose own LSN
/// neither the snapshot nor the updates carry), a COMMIT at that LSN, so that a replay of the
/// new file ends at the same last LSN as the mirror (found by the metadata simulator once it
/// rolled ledgers over: a node restarted after a rollover recovered "up to 4:6" having
/// synced the COMMIT 4:7). Every record is stamped `now` (ms since the Unix epoch).
fn encode_file(mirror: &Recovered, now: u64) -> Vec<u8> {
    let mut bytes = file_header().to_vec();
    encode_record_into(
        &mut bytes,
        &LedgerRecord::Snapshot {
            lsn: mirror.committed_lsn,
            state: mirror.committed_state.clone(),
        },
        now,
    );
    for (lsn, advisory) in &mirror.uncommitted {
        encode_record_into(
            &mut bytes,
            &LedgerRecord::Update {
                lsn: *lsn,
                advisory: advisory.clone(),
            },
            now,
        );
    }
    let last_encoded = mirror
        .uncommitted
        .last()
        .map_or(mirror.committed_lsn, |(lsn, _)| *lsn)
        .max(mirror.committed_lsn);
    if mirror.last_lsn > last_encoded {
        // Commits nothing new (every UPDATE in the file above `committed_lsn` stays
        // uncommitted); it keeps the last LSN.
        encode_record_into(
            &mut bytes,
            &LedgerRecord::Commit {
                lsn: mirror.last_lsn,
                committed: mirror.committed_lsn,
            },
            now,
        );
    }
    bytes
}

/// Writes `mirror` ([`encode_file`], stamped `timestamp_ms`) as the whole content of the file
/// at `path` on `disk` (created or truncated) and fsyncs it; returns the file and its length.
fn write_file(
    disk: &dyn Disk,
    path: &Path,
    mirror: &Recovered,
    timestamp_ms: u64,
) -> Result<(FileRef, u64), LedgerError> {
    let bytes = encode_file(mirror, timestamp_ms);
    let file = disk.open(path, Open::Create).map_err(io_err(path))?;
    file.write_all_at(&bytes, 0).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))?;
    Ok((file, bytes.len() as u64))
}

/// Puts the complete, fsynced file at `from` in place as `ledger-<old_index + 1>.bmql`: the
/// rename, the directory's fsync, then the old file's name removed (see the module doc: a
/// crash at any point leaves one complete file with the highest number). Returns the new path.
fn install_next_file(
    disk: &dyn Disk,
    dir: &Path,
    old_index: u64,
    from: &Path,
) -> Result<PathBuf, LedgerError> {
    let final_path = file_path(dir, old_index + 1);
    disk.rename(from, &final_path)
        .map_err(io_err(&final_path))?;
    sync_dir(disk, dir)?;
    let old_path = file_path(dir, old_index);
    disk.remove_file(&old_path).map_err(io_err(&old_path))?;
    Ok(final_path)
}

/// Writes `ledger-<old_index + 1>.bmql` holding `mirror` (snapshot + uncommitted, stamped
/// `timestamp_ms`) through a temporary file, fsynced (whatever the fsync policy: it must be
/// durable before the old file goes) and put in place ([`install_next_file`]).
fn write_next_file(
    disk: &dyn Disk,
    dir: &Path,
    old_index: u64,
    mirror: &Recovered,
    timestamp_ms: u64,
) -> Result<NewFile, LedgerError> {
    let tmp_path = file_path(dir, old_index + 1).with_extension("bmql.tmp");
    let (file, len) = write_file(disk, &tmp_path, mirror, timestamp_ms)?;
    let final_path = install_next_file(disk, dir, old_index, &tmp_path)?;
    info!(
        file = %final_path.display(),
        committed_lsn = %mirror.committed_lsn,
        uncommitted = mirror.uncommitted.len(),
        "ledger rewritten"
    );
    Ok(NewFile {
        file,
        index: old_index + 1,
        len,
    })
}

/// A rollover's switch: appends `tail` (the records written since the snapshot) to the
/// snapshot's file `next`, fsyncs it and puts it in place ([`install_next_file`]). Until the
/// rename is durable the old file is the complete one (it holds every record synced so far);
/// after it, the new one holds them all too.
fn switch_to_next_file(
    disk: &dyn Disk,
    dir: &Path,
    old_index: u64,
    next: SnapshotWritten,
    tail: &[u8],
) -> Result<NewFile, LedgerError> {
    debug_assert_eq!(next.index, old_index + 1);
    next.file
        .write_all_at(tail, next.len)
        .map_err(io_err(&next.path))?;
    // The new file must be durable before the old one goes, whatever the fsync policy.
    next.file.sync_data().map_err(io_err(&next.path))?;
    let final_path = install_next_file(disk, dir, old_index, &next.path)?;
    info!(file = %final_path.display(), "ledger rolled over");
    Ok(NewFile {
        file: next.file,
        index: next.index,
        len: next.len + tail.len() as u64,
    })
}

/// A file written by [`write_next_file`], to become the live one.
#[derive(Debug)]
struct NewFile {
    file: FileRef,
    index: u64,
    len: u64,
}

fn file_path(dir: &Path, index: u64) -> PathBuf {
    dir.join(format!("ledger-{index}.bmql"))
}

fn sync_dir(disk: &dyn Disk, dir: &Path) -> Result<(), LedgerError> {
    disk.sync_dir(dir).map_err(io_err(dir))
}

fn file_header() -> [u8; FILE_HEADER_LEN] {
    let mut h = [0u8; FILE_HEADER_LEN];
    h[..8].copy_from_slice(LEDGER_MAGIC);
    h[8..12].copy_from_slice(&LEDGER_VERSION.to_le_bytes());
    h
}

#[cfg(test)]
fn encode_record(record: &LedgerRecord, timestamp_ms: u64) -> Vec<u8> {
    let mut out = Vec::new();
    encode_record_into(&mut out, record, timestamp_ms);
    out
}

/// Appends one encoded record (header, body, CRC32C) to `out`.
fn encode_record_into(out: &mut Vec<u8>, record: &LedgerRecord, timestamp_ms: u64) {
    let (record_type, body) = match record {
        LedgerRecord::Snapshot { state, .. } => {
            (TYPE_SNAPSHOT, state.to_snapshot().encode_to_vec())
        }
        LedgerRecord::Update { advisory, .. } => (TYPE_UPDATE, advisory.encode_to_vec()),
        LedgerRecord::Commit { lsn, committed } => (
            TYPE_COMMIT,
            peer::AdvisoryCommit {
                lsn: Some((*lsn).into()),
                committed: Some((*committed).into()),
            }
            .encode_to_vec(),
        ),
    };
    let lsn = record.lsn();
    out.reserve(RECORD_HEADER_LEN + body.len());
    let start = frame::begin(out);
    out.push(record_type);
    out.extend_from_slice(&lsn.term.0.to_le_bytes());
    out.extend_from_slice(&lsn.sequence.to_le_bytes());
    out.extend_from_slice(&timestamp_ms.to_le_bytes());
    out.extend_from_slice(&body);
    frame::finish(out, start);
}

/// A record whose frame (length and CRC) is intact.
struct Frame<'a> {
    record_type: u8,
    lsn: Lsn,
    body: &'a [u8],
    len: usize,
}

/// Reads the record at the start of `bytes` in a file of format `version`, if it is complete
/// and its CRC matches.
fn read_frame(bytes: &[u8], version: u32) -> Option<Frame<'_>> {
    if version == 1 {
        return read_frame_v1(bytes);
    }
    let max = ENTRY_HEADER_LEN + LEDGER_RECORD_BODY_MAX as usize;
    let (body, len) = frame::read(bytes, max).ok()?;
    let (record_type, lsn) = entry_header(body)?;
    Some(Frame {
        record_type,
        lsn,
        body: &body[ENTRY_HEADER_LEN..],
        len,
    })
}

/// The record type and LSN at the start of `entry` (a version 2 body, or a version 1 record),
/// if it is long enough and of a known type.
fn entry_header(entry: &[u8]) -> Option<(u8, Lsn)> {
    let header = entry.get(..ENTRY_HEADER_LEN)?;
    let record_type = header[0];
    if !(TYPE_SNAPSHOT..=TYPE_ACK).contains(&record_type) {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().expect("8 bytes"));
    Some((record_type, Lsn::new(Term(u64_at(1)), u64_at(9))))
}

/// [`read_frame`] of a version 1 file (read only: such a file is rewritten at open).
fn read_frame_v1(bytes: &[u8]) -> Option<Frame<'_>> {
    let (record_type, lsn) = entry_header(bytes.get(..V1_RECORD_HEADER_LEN)?)?;
    let body_len = u32::from_le_bytes(bytes[25..29].try_into().expect("4 bytes"));
    if body_len > LEDGER_RECORD_BODY_MAX {
        return None;
    }
    let len = V1_RECORD_HEADER_LEN + body_len as usize + V1_CRC_LEN;
    if bytes.len() < len {
        return None;
    }
    let crc_at = len - V1_CRC_LEN;
    let crc = u32::from_le_bytes(bytes[crc_at..len].try_into().expect("4 bytes"));
    if crc32c::crc32c(&bytes[..crc_at]) != crc {
        return None;
    }
    Some(Frame {
        record_type,
        lsn,
        body: &bytes[V1_RECORD_HEADER_LEN..crc_at],
        len,
    })
}

fn decode_frame(frame: &Frame<'_>) -> Option<Option<LedgerRecord>> {
    let record = match frame.record_type {
        TYPE_SNAPSHOT => {
            let snapshot = peer::ClusterStateSnapshot::decode(frame.body).ok()?;
            LedgerRecord::Snapshot {
                lsn: frame.lsn,
                state: ClusterState::from_snapshot(&snapshot).ok()?,
            }
        }
        TYPE_UPDATE => LedgerRecord::Update {
            lsn: frame.lsn,
            advisory: peer::Advisory::decode(frame.body).ok()?,
        },
        TYPE_COMMIT => {
            let commit = peer::AdvisoryCommit::decode(frame.body).ok()?;
            if lsn_of(commit.lsn) != frame.lsn {
                return None;
            }
            LedgerRecord::Commit {
                lsn: frame.lsn,
                committed: lsn_of(commit.committed),
            }
        }
        _ => return Some(None),
    };
    Some(Some(record))
}

struct Scan {
    recovered: Recovered,
    valid_len: u64,
    rewrite_header: bool,
    /// The file's format version (an older one is rewritten at open).
    version: u32,
}

/// Replays a whole file. See [`Ledger::open`] for the torn-tail rule.
fn scan(path: &Path, bytes: &[u8], partition_count: u32) -> Result<Scan, LedgerError> {
    let mut recovered = Recovered::fresh(partition_count);
    if bytes.len() < FILE_HEADER_LEN {
        // Only a crash while creating the very first file leaves a short header (later files are
        // renamed into place complete).
        if !LEDGER_MAGIC.starts_with(&bytes[..bytes.len().min(8)]) {
            return Err(LedgerError::BadMagic {
                file: path.to_path_buf(),
            });
        }
        return Ok(Scan {
            recovered,
            valid_len: 0,
            rewrite_header: true,
            version: LEDGER_VERSION,
        });
    }
    if &bytes[..8] != LEDGER_MAGIC {
        return Err(LedgerError::BadMagic {
            file: path.to_path_buf(),
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if !(1..=LEDGER_VERSION).contains(&version) {
        return Err(LedgerError::UnsupportedVersion {
            file: path.to_path_buf(),
            version,
        });
    }
    let mut offset = FILE_HEADER_LEN;
    let mut last: Option<Lsn> = None;
    while offset < bytes.len() {
        let corrupt = || LedgerError::Corrupt {
            file: path.to_path_buf(),
            offset: offset as u64,
        };
        let Some(frame) = read_frame(&bytes[offset..], version) else {
            // Damaged here: a torn tail only if nothing valid follows, or if zeros stand where
            // the next record should begin. The file's length is set ahead of the records
            // (see the module doc), so a power loss can leave a later page of one write on
            // disk and an earlier one not; records after such a hole were never covered by a
            // completed fsync (it would have covered the hole too), so nobody was told they
            // were durable. Other damage followed by valid records is corruption.
            let hole = bytes[offset..bytes.len().min(offset + frame::HEADER_LEN)]
                .iter()
                .all(|b| *b == 0);
            // (Looked for only when it matters: a zero tail of 1 MiB is the usual end.)
            let valid_after =
                || (offset + 1..bytes.len()).any(|o| read_frame(&bytes[o..], version).is_some());
            if !hole && valid_after() {
                return Err(corrupt());
            }
            return Ok(Scan {
                recovered,
                valid_len: offset as u64,
                rewrite_header: false,
                version,
            });
        };
        let record = decode_frame(&frame).ok_or_else(corrupt)?;
        if let Some(record) = record {
            if last.is_some_and(|l| record.lsn() <= l)
                && !matches!(record, LedgerRecord::Snapshot { .. })
            {
                return Err(corrupt());
            }
            last = Some(record.lsn());
            recovered.replay(&record);
        }
        offset += frame.len;
    }
    Ok(Scan {
        recovered,
        valid_len: offset as u64,
        rewrite_header: false,
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{assign, primaries};
    use bmq_storage::disk::{Faults, SimDisk};
    use std::fs::{self, File, OpenOptions};

    fn lsn(term: u64, sequence: u64) -> Lsn {
        Lsn::new(Term(term), sequence)
    }

    fn update(l: Lsn, advisory: peer::Advisory) -> LedgerRecord {
        LedgerRecord::Update { lsn: l, advisory }
    }

    fn commit(l: Lsn, committed: Lsn) -> LedgerRecord {
        LedgerRecord::Commit { lsn: l, committed }
    }

    fn open(dir: &Path) -> (Ledger, Recovered) {
        Ledger::open(dir, FsyncPolicy::Never, 2).unwrap()
    }

    fn write_history(dir: &Path) -> Ledger {
        let (mut ledger, _) = open(dir);
        ledger
            .append(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])))
            .unwrap();
        ledger
            .append(&update(lsn(1, 2), assign("q1", 0, 0)))
            .unwrap();
        ledger.append(&commit(lsn(1, 3), lsn(1, 2))).unwrap();
        ledger
            .append(&update(lsn(1, 4), assign("q2", 0, 1)))
            .unwrap();
        ledger
    }

    /// Closes `ledger` and cuts its file to the records (the zeros set ahead of them go), as a
    /// file written by an appending ledger looks; returns the file's path and bytes.
    fn close_to_records(ledger: Ledger) -> (PathBuf, Vec<u8>) {
        let path = ledger.file_path();
        let size = ledger.file_size();
        drop(ledger);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(size).unwrap();
        (path.clone(), fs::read(&path).unwrap())
    }

    fn expected_state() -> ClusterState {
        let mut s = ClusterState::new(2);
        s.apply(&primaries(&[(0, Some(1), 1)])).unwrap();
        s.apply(&assign("q1", 0, 0)).unwrap();
        s
    }

    #[test]
    fn empty_directory_opens_fresh() {
        // Scenario: a new node opens an empty ledger directory.
        let dir = tempfile::tempdir().unwrap();
        let (ledger, recovered) = open(dir.path());
        assert_eq!(recovered, Recovered::fresh(2));
        assert!(ledger.file_path().ends_with("ledger-0.bmql"));
        assert_eq!(fs::read(ledger.file_path()).unwrap().len(), FILE_HEADER_LEN);
    }

    #[test]
    fn restart_restores_committed_state_and_uncommitted_records() {
        // Scenario: records written, the node restarts, the replay gives back the same view.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let before = ledger.recovered().clone();
        assert!(ledger.bytes_written() > 0);
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered, before);
        assert_eq!(recovered.committed_state, expected_state());
        assert_eq!(recovered.committed_lsn, lsn(1, 2));
        assert_eq!(recovered.uncommitted, vec![(lsn(1, 4), assign("q2", 0, 1))]);
        assert_eq!(recovered.last_lsn, lsn(1, 4));
    }

    #[test]
    fn the_committed_state_is_shared_only_at_the_same_lsn() {
        // Scenario: the core hands the ledger its committed state after a commit: taken (one
        // copy in memory) when the ledger is at that LSN, ignored otherwise; the ledger still
        // replays to the same view after a restart.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let core_state = expected_state();
        ledger.share_committed_state(lsn(1, 4), &core_state);
        assert!(!ledger
            .recovered()
            .committed_state
            .queues
            .ptr_eq(&core_state.queues));
        ledger.share_committed_state(lsn(1, 2), &core_state);
        assert!(ledger
            .recovered()
            .committed_state
            .queues
            .ptr_eq(&core_state.queues));
        let before = ledger.recovered().clone();
        drop(ledger);
        assert_eq!(open(dir.path()).1, before);
    }

    #[test]
    fn a_commit_is_applied_once_when_the_core_shares_its_state() {
        // Scenario: the ledger defers applying what a COMMIT settles; the core's state handed
        // over at that LSN replaces the deferred advisories (never applied twice); a later
        // commit is deferred again and applied for a rollover's snapshot, and a restart
        // replays to the same view.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        assert_eq!(
            ledger.unapplied,
            vec![
                (lsn(1, 1), primaries(&[(0, Some(1), 1)])),
                (lsn(1, 2), assign("q1", 0, 0))
            ]
        );
        let core_state = expected_state();
        ledger.share_committed_state(lsn(1, 2), &core_state);
        assert!(ledger.unapplied.is_empty());
        assert!(ledger
            .recovered()
            .committed_state
            .queues
            .ptr_eq(&core_state.queues));
        ledger.append(&commit(lsn(1, 5), lsn(1, 4))).unwrap();
        assert_eq!(ledger.unapplied, vec![(lsn(1, 4), assign("q2", 0, 1))]);
        ledger.set_max_file_size(1);
        ledger
            .append(&update(lsn(1, 6), assign("q3", 1, 0)))
            .unwrap();
        assert_eq!(ledger.rollovers(), 1);
        assert!(ledger.unapplied.is_empty());
        let mut state = expected_state();
        state.apply(&assign("q2", 0, 1)).unwrap();
        let before = ledger.recovered().clone();
        assert_eq!(before.committed_state, state);
        assert_eq!(before.uncommitted, vec![(lsn(1, 6), assign("q3", 1, 0))]);
        drop(ledger);
        assert_eq!(open(dir.path()).1, before);
    }

    #[test]
    fn new_term_leader_advisory_supersedes_older_uncommitted_records() {
        // Scenario: uncommitted records of term 1 are superseded by term 2's LeaderAdvisory, which commits.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let mut snapshot = expected_state();
        snapshot.apply(&assign("q2", 0, 1)).unwrap();
        let leader = peer::Advisory {
            kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                state: Some(snapshot.to_snapshot()),
                continues: None,
            })),
        };
        ledger.append(&update(lsn(2, 1), leader.clone())).unwrap();
        assert_eq!(ledger.recovered().uncommitted, vec![(lsn(2, 1), leader)]);
        ledger.append(&commit(lsn(2, 2), lsn(2, 1))).unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, snapshot);
        assert_eq!(recovered.committed_lsn, lsn(2, 1));
        assert!(recovered.uncommitted.is_empty());
        assert_eq!(recovered.last_lsn, lsn(2, 2));
    }

    #[test]
    fn a_term_start_that_continues_the_history_keeps_and_commits_older_uncommitted_records() {
        // Scenario: term 2's LeaderAdvisory only continues the history whose last advisory is
        // 1:4 (q2, uncommitted): the replay keeps q2 and the term start's commit commits it.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let start = peer::Advisory {
            kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                state: None,
                continues: Some(lsn(1, 4).into()),
            })),
        };
        ledger.append(&update(lsn(2, 1), start.clone())).unwrap();
        assert_eq!(
            ledger.recovered().uncommitted,
            vec![(lsn(1, 4), assign("q2", 0, 1)), (lsn(2, 1), start)]
        );
        ledger.append(&commit(lsn(2, 2), lsn(2, 1))).unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        let mut expected = expected_state();
        expected.apply(&assign("q2", 0, 1)).unwrap();
        assert_eq!(recovered.committed_state, expected);
        assert_eq!(recovered.committed_lsn, lsn(2, 1));
        assert!(recovered.uncommitted.is_empty());
    }

    #[test]
    fn a_record_larger_than_sixteen_mib_is_read_back() {
        // Scenario: a snapshot of a large state (~40 bytes per queue: 36 MB with 1,000,000
        // queues) is written as one record; the node must read its own ledger at its next
        // start. Here an update of 17 MiB stands for it.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let big = assign(&"q".repeat(17 * 1024 * 1024), 0, 9);
        ledger.append(&update(lsn(1, 5), big.clone())).unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, 5));
        assert_eq!(recovered.uncommitted.last(), Some(&(lsn(1, 5), big)));
    }

    #[test]
    fn torn_tail_is_truncated() {
        // Scenario: the node crashed in the middle of writing its last record.
        let dir = tempfile::tempdir().unwrap();
        let (path, full) = close_to_records(write_history(dir.path()));
        // Cut the last record (q2 at 1:4) in half.
        let last_len = encode_record(&update(lsn(1, 4), assign("q2", 0, 1)), 0).len();
        let cut = full.len() - last_len / 2;
        fs::write(&path, &full[..cut]).unwrap();
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, expected_state());
        assert!(recovered.uncommitted.is_empty());
        assert_eq!(recovered.last_lsn, lsn(1, 3));
        assert_eq!(fs::read(&path).unwrap().len(), full.len() - last_len);
        // A bad CRC on the last record is also a torn tail.
        let mut damaged = full.clone();
        let n = damaged.len();
        damaged[n - 1] ^= 0xff;
        fs::write(&path, &damaged).unwrap();
        let (ledger, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, 3));
        keeps_working_after_truncation(dir.path(), ledger);
    }

    /// A ledger whose tail after 1:3 was truncated takes the next record (1:4) and finds it
    /// again on reopening.
    fn keeps_working_after_truncation(dir: &Path, mut ledger: Ledger) {
        ledger
            .append(&update(lsn(1, 4), assign("q3", 1, 1)))
            .unwrap();
        drop(ledger);
        let (_, recovered) = open(dir);
        assert_eq!(recovered.uncommitted, vec![(lsn(1, 4), assign("q3", 1, 1))]);
    }

    /// `record` in version 1's format (its own frame: entry header with the protobuf's
    /// length, protobuf, CRC32C over both), as ledgers written before the shared frame hold.
    fn encode_record_v1(record: &LedgerRecord) -> Vec<u8> {
        let framed = encode_record(record, 0);
        let entry = &framed[frame::HEADER_LEN..];
        let mut out = entry[..ENTRY_HEADER_LEN].to_vec();
        let body = &entry[ENTRY_HEADER_LEN..];
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(body);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn a_version_1_ledger_is_read_and_rewritten_in_the_current_format() {
        // Scenario: a node upgraded in place opens the ledger an older build wrote, with a
        // torn last record.
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = LEDGER_MAGIC.to_vec();
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        for record in [
            update(lsn(1, 1), primaries(&[(0, Some(1), 1)])),
            update(lsn(1, 2), assign("q1", 0, 0)),
            commit(lsn(1, 3), lsn(1, 2)),
            update(lsn(1, 4), assign("q2", 0, 1)),
        ] {
            bytes.extend_from_slice(&encode_record_v1(&record));
        }
        let torn = encode_record_v1(&update(lsn(1, 5), assign("q3", 1, 1)));
        bytes.extend_from_slice(&torn[..torn.len() / 2]);
        let old = dir.path().join("ledger-0.bmql");
        fs::write(&old, &bytes).unwrap();

        let (ledger, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, expected_state());
        assert_eq!(recovered.uncommitted, vec![(lsn(1, 4), assign("q2", 0, 1))]);
        assert_eq!(recovered.last_lsn, lsn(1, 4));
        assert!(!old.exists(), "the version 1 file is replaced");
        let new = ledger.file_path();
        let written = fs::read(&new).unwrap();
        assert_eq!(&written[8..12], &LEDGER_VERSION.to_le_bytes());
        // It takes records in the current format and finds them all again.
        keeps_working_after_rewrite(dir.path(), ledger, &recovered);
    }

    fn keeps_working_after_rewrite(dir: &Path, mut ledger: Ledger, before: &Recovered) {
        ledger.append(&commit(lsn(1, 5), lsn(1, 4))).unwrap();
        drop(ledger);
        let (_, recovered) = open(dir);
        assert_eq!(recovered.last_lsn, lsn(1, 5));
        assert_eq!(recovered.committed_lsn, lsn(1, 4));
        assert!(recovered.uncommitted.is_empty());
        assert_ne!(recovered.committed_state, before.committed_state);
    }

    #[test]
    fn an_unknown_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = LEDGER_MAGIC.to_vec();
        bytes.extend_from_slice(&(LEDGER_VERSION + 1).to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        fs::write(dir.path().join("ledger-0.bmql"), &bytes).unwrap();
        assert!(matches!(
            Ledger::open(dir.path(), FsyncPolicy::Never, 2),
            Err(LedgerError::UnsupportedVersion { version, .. }) if version == LEDGER_VERSION + 1
        ));
    }

    #[test]
    fn corruption_followed_by_valid_records_is_an_error() {
        // Scenario: a bit flip in the second record while later records are intact.
        let dir = tempfile::tempdir().unwrap();
        let (path, mut bytes) = close_to_records(write_history(dir.path()));
        let first_len = encode_record(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])), 0).len();
        let second = FILE_HEADER_LEN + first_len;
        bytes[second + RECORD_HEADER_LEN] ^= 0x55;
        fs::write(&path, &bytes).unwrap();
        match Ledger::open(dir.path(), FsyncPolicy::Never, 2) {
            Err(LedgerError::Corrupt { file, offset }) => {
                assert_eq!(file, path);
                assert_eq!(offset, second as u64);
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
        // The file was not touched.
        assert_eq!(fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn bad_magic_is_an_error() {
        // Scenario: a foreign file sits where the ledger should be.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("ledger-0.bmql"), b"NOTALEDGERFILE!!").unwrap();
        assert!(matches!(
            Ledger::open(dir.path(), FsyncPolicy::Never, 2),
            Err(LedgerError::BadMagic { .. })
        ));
    }

    #[test]
    fn rollover_keeps_state_and_uncommitted_records() {
        // Scenario: the file passes max_file_size; the new file holds snapshot + uncommitted records.
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(200);
        let mut seq = 0;
        let mut next = || {
            seq += 1;
            lsn(1, seq)
        };
        ledger
            .append(&update(
                next(),
                primaries(&[(0, Some(1), 1), (1, Some(2), 1)]),
            ))
            .unwrap();
        let mut committed_until = Lsn::ZERO;
        for key in 0..10u64 {
            let l = next();
            ledger
                .append(&update(
                    l,
                    assign(&format!("bmq://d/q{key}"), (key % 2) as u32, key),
                ))
                .unwrap();
            if key < 8 {
                let c = next();
                ledger.append(&commit(c, l)).unwrap();
                committed_until = l;
            }
        }
        assert!(ledger.rollovers() > 0);
        let files: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(files.len(), 1, "old files are removed: {files:?}");
        let before = ledger.recovered().clone();
        assert_eq!(before.committed_lsn, committed_until);
        assert_eq!(before.committed_state.queues.len(), 8);
        assert_eq!(before.uncommitted.len(), 2);
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, before.committed_state);
        assert_eq!(recovered.committed_lsn, before.committed_lsn);
        assert_eq!(recovered.uncommitted, before.uncommitted);
    }

    #[test]
    fn domain_state_survives_a_rollovers_snapshot_and_a_restart() {
        // Scenario: domains seeded by a snapshot and changed by an advisory are in the
        // rollover's snapshot and read back equal after a restart.
        use crate::domains::{advisory, config_to_wire, DomainState};
        use bmq_config::DomainConfig;
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(400);
        let mut seeded = ClusterState::new(2);
        seeded.domains = Some(std::sync::Arc::new(DomainState::seed(
            &[DomainConfig::new("bmq.a")],
            lsn(1, 1),
        )));
        let snapshot = peer::Advisory {
            kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                state: Some(seeded.to_snapshot()),
                continues: None,
            })),
        };
        ledger.append(&update(lsn(1, 1), snapshot)).unwrap();
        let mut create = advisory(
            peer::domain_advisory::Change::Create(config_to_wire(
                &DomainConfig::new("bmq.b"),
                Lsn::ZERO,
            )),
            "ops",
        );
        if let Some(peer::advisory::Kind::Domain(d)) = create.kind.as_mut() {
            d.lsn = Some(lsn(1, 2).into());
        }
        ledger.append(&update(lsn(1, 2), create)).unwrap();
        ledger.append(&commit(lsn(1, 3), lsn(1, 2))).unwrap();
        let mut seq = 3;
        while ledger.rollovers() == 0 {
            seq += 1;
            let key = seq;
            ledger
                .append(&update(
                    lsn(1, seq),
                    assign(&format!("bmq://d/q{key}"), 0, key),
                ))
                .unwrap();
            seq += 1;
            ledger
                .append(&commit(lsn(1, seq), lsn(1, seq - 1)))
                .unwrap();
        }
        let before = ledger.recovered().clone();
        let domains = before.committed_state.domains.clone().expect("domains");
        assert_eq!(domains.version, lsn(1, 2));
        assert!(domains.get("bmq.a").is_some() && domains.get("bmq.b").is_some());
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, before.committed_state);
        assert_eq!(recovered.committed_state.domains, Some(domains));
    }

    #[test]
    fn a_rollovers_old_file_is_freed_by_its_release_not_by_the_ledger_letting_go_of_it() {
        // Scenario: a rollover's old file is freed a step at a time by the release
        // the ledger hands out (run on a thread of its own), not all at once when the main
        // thread drops its handle in complete_sync (which would hold the main thread, and
        // every fsync of the disk, for as long as the file system takes to free it).
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(400);
        let mut seq = 0;
        while !ledger.rollover_pending() {
            write_assignment(&mut ledger, &mut seq, false);
            ledger.flush().unwrap();
        }
        let old = File::open(ledger.file_path()).unwrap();
        assert!(old.metadata().unwrap().blocks() > 0);
        let snapshot = ledger.begin_snapshot().expect("the rollover's snapshot");
        ledger.complete_snapshot(snapshot.run().unwrap());
        let sync = ledger.begin_sync().unwrap().expect("the switch");
        assert!(sync.is_switch());
        ledger.complete_sync(sync.run().unwrap());
        assert_eq!(old.metadata().unwrap().nlink(), 0, "the old name is gone");
        let release = ledger.take_release().expect("the old file's release");
        assert!(ledger.take_release().is_none());
        release.run();
        let meta = old.metadata().unwrap();
        assert_eq!(meta.blocks(), 0, "freed by the release");
        ledger
            .append(&update(lsn(1, seq + 1), assign("bmq://d/last", 0, 0)))
            .unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, seq + 1));
    }

    /// The names in `dir`, sorted.
    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// What a crash would leave: a copy of `dir`'s files as they are on disk now, opened.
    fn open_a_copy(dir: &Path) -> Recovered {
        let copy = tempfile::tempdir().unwrap();
        for name in names_in(dir) {
            fs::copy(dir.join(&name), copy.path().join(&name)).unwrap();
        }
        let (_, recovered) = Ledger::open(copy.path(), FsyncPolicy::EveryRecord, 2).unwrap();
        assert_eq!(
            names_in(copy.path()).len(),
            1,
            "one file left after the open's clean-up"
        );
        recovered
    }

    /// Writes the assignment of a new queue (and, when `committed`, its commit); returns the
    /// last LSN written.
    fn write_assignment(ledger: &mut Ledger, seq: &mut u64, committed: bool) -> Lsn {
        *seq += 1;
        let l = lsn(1, *seq);
        ledger
            .write(&update(l, assign(&format!("bmq://d/q{seq}"), 0, *seq)))
            .unwrap();
        if committed {
            *seq += 1;
            ledger.write(&commit(lsn(1, *seq), l)).unwrap();
        }
        lsn(1, *seq)
    }

    /// Syncs what was written as the node does between a rollover's snapshot and its switch:
    /// fsyncs of the live file (runs `begin_sync`'s work, which is the switch once the
    /// snapshot is completed).
    fn sync_live_file(ledger: &mut Ledger) {
        while let Some(sync) = ledger.begin_sync().unwrap() {
            assert!(!sync.is_switch() && !sync.is_rewrite());
            ledger.complete_sync(sync.run().unwrap());
        }
    }

    #[test]
    fn records_are_written_and_synced_while_a_rollovers_snapshot_is_written_and_follow_it() {
        // Scenario: a rollover's snapshot of the whole state is written on another
        // thread while the ledger goes on writing and fsyncing records in the old file, so no
        // commit waits for it. A crash at any step recovers every record synced so far: before
        // the switch from the old file (the snapshot's `.next` file is removed at open), after
        // it from the new one, which holds the snapshot and every record written since.
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(600);
        let mut seq = 0;
        while !ledger.rollover_pending() {
            write_assignment(&mut ledger, &mut seq, true);
            sync_live_file(&mut ledger);
        }
        let snapshot = ledger.begin_snapshot().expect("the snapshot");
        assert!(ledger.begin_snapshot().is_none(), "one at a time");
        // Records synced in the old file while the snapshot is written.
        let mut last = write_assignment(&mut ledger, &mut seq, true);
        sync_live_file(&mut ledger);
        assert_eq!(open_a_copy(dir.path()).last_lsn, last);
        let written = std::thread::spawn(move || snapshot.run())
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(
            names_in(dir.path()),
            ["ledger-0.bmql", "ledger-1.bmql.next"]
        );
        assert_eq!(open_a_copy(dir.path()).last_lsn, last, "from the old file");
        last = write_assignment(&mut ledger, &mut seq, false);
        sync_live_file(&mut ledger);
        assert_eq!(open_a_copy(dir.path()).last_lsn, last);
        ledger.complete_snapshot(written);
        assert!(ledger.rewrite_due(), "the switch is due");
        // A record only buffered: the switch covers it too.
        last = write_assignment(&mut ledger, &mut seq, true);
        let expected = ledger.recovered().clone();
        let switch = ledger.begin_sync().unwrap().expect("the switch");
        assert!(switch.is_switch());
        // Records written while the switch runs wait for the new file.
        let after = lsn(1, seq + 1);
        ledger
            .write(&update(after, assign("bmq://d/after", 1, 0)))
            .unwrap();
        ledger.flush().unwrap();
        let done = switch.run().unwrap();
        assert_eq!(names_in(dir.path()), ["ledger-1.bmql"]);
        let recovered = open_a_copy(dir.path());
        assert_eq!(recovered.last_lsn, last);
        assert_eq!(recovered, expected, "the new file holds everything");
        ledger.complete_sync(done);
        assert!(!ledger.rollover_pending());
        ledger.sync().unwrap();
        assert_eq!(open_a_copy(dir.path()).last_lsn, after);
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, after);
        assert_eq!(recovered.committed_state, expected.committed_state);
    }

    #[test]
    fn a_rollover_right_after_a_commit_keeps_the_commits_lsn() {
        // Scenario (found by the metadata simulator): the last record before a rollover is a
        // COMMIT and nothing follows before the switch. The new file's snapshot carries the
        // committed LSN, not the COMMIT record's own; a COMMIT at that LSN ends the file, so
        // a restart recovers the last LSN it had synced.
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(300);
        let mut seq = 0;
        let mut last = Lsn::ZERO;
        while ledger.rollovers() == 0 {
            last = write_assignment(&mut ledger, &mut seq, true);
            ledger.sync().unwrap();
        }
        assert_eq!(ledger.file_path(), file_path(dir.path(), 1));
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, last);
        assert_eq!(recovered.committed_lsn, lsn(1, last.sequence - 1));
        assert!(recovered.uncommitted.is_empty());
    }

    #[test]
    fn a_reset_discards_a_rollovers_snapshot_taken_before_it() {
        // Scenario: a follower's history is replaced (reset) while a rollover's snapshot of
        // the old history is written, or after it is written and before its switch. The
        // snapshot is discarded (its file removed by the release), the reset's file replaces
        // the old one, and the ledger rolls over again later.
        for written_before_the_reset in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let mut ledger = write_history(dir.path());
            ledger.set_max_file_size(100);
            ledger
                .write(&update(lsn(1, 5), assign("bmq://d/x", 0, 5)))
                .unwrap();
            assert!(ledger.rollover_pending());
            let snapshot = ledger.begin_snapshot().unwrap();
            let mut written = Some(snapshot.run().unwrap());
            if written_before_the_reset {
                ledger.complete_snapshot(written.take().unwrap());
            }
            let state = expected_state();
            ledger.reset_to(&state, lsn(2, 1), &[]).unwrap();
            if let Some(written) = written {
                ledger.complete_snapshot(written);
            }
            let rewrite = ledger.begin_sync().unwrap().expect("the reset's file");
            assert!(rewrite.is_rewrite());
            ledger.complete_sync(rewrite.run().unwrap());
            while let Some(release) = ledger.take_release() {
                release.run();
            }
            assert_eq!(names_in(dir.path()), ["ledger-1.bmql"]);
            assert!(!ledger.rollover_pending());
            // It rolls over again (past twice the reset's file).
            let mut appended = Vec::new();
            while ledger.rollovers() < 2 {
                let record = (
                    lsn(2, 2 + appended.len() as u64),
                    assign(&format!("bmq://d/y{}", appended.len()), 1, 6),
                );
                ledger.append(&update(record.0, record.1.clone())).unwrap();
                appended.push(record);
            }
            assert_eq!(names_in(dir.path()), ["ledger-2.bmql"]);
            drop(ledger);
            let (_, recovered) = open(dir.path());
            assert_eq!(recovered.committed_lsn, lsn(2, 1));
            assert_eq!(recovered.committed_state, state);
            assert_eq!(recovered.uncommitted, appended);
        }
    }

    #[test]
    fn a_state_larger_than_the_file_size_does_not_roll_over_at_every_record() {
        // Scenario: the snapshot alone passes the configured size (a very large cluster
        // state). The ledger rolls over once the records appended since reach the file's
        // size as written, not at every record (which would write the whole state each time).
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        let mut seq = 0;
        for _ in 0..200 {
            write_assignment(&mut ledger, &mut seq, true);
        }
        ledger.sync().unwrap();
        ledger.set_max_file_size(1_000);
        write_assignment(&mut ledger, &mut seq, true);
        ledger.sync().unwrap();
        assert_eq!(ledger.rollovers(), 1);
        let written = ledger.file_size();
        assert!(
            written > 2_000,
            "the snapshot passes the size: {written} bytes"
        );
        // Records appended until the next rollover becomes due: the file then holds twice
        // what it held as written.
        while ledger.rollovers() == 1 {
            write_assignment(&mut ledger, &mut seq, true);
            if ledger.rollovers() == 1 {
                ledger.sync().unwrap();
            }
        }
        assert!(ledger.file_size() >= 2 * written);
        assert!(
            ledger.file_size() < 2 * written + 200,
            "due as soon as it got there"
        );
        assert_eq!(ledger.rollovers(), 2);
    }

    #[test]
    fn a_group_of_writes_is_durable_at_the_sync() {
        // Scenario: group commit — records written without a sync are buffered (a crash before
        // the sync loses them, and nobody was told they were durable); one sync writes and
        // fsyncs them all; the file reads back as if each had been appended alone.
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = Ledger::open(dir.path(), FsyncPolicy::EveryRecord, 2).unwrap();
        // The records on the file (its length runs ahead of them).
        let on_disk = |dir: &Path| {
            let path = file_path(dir, 0);
            scan(&path, &fs::read(&path).unwrap(), 2).unwrap().valid_len
        };
        let empty = on_disk(dir.path());
        ledger
            .write(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])))
            .unwrap();
        ledger
            .write(&update(lsn(1, 2), assign("q1", 0, 0)))
            .unwrap();
        ledger.write(&commit(lsn(1, 3), lsn(1, 2))).unwrap();
        assert_eq!(on_disk(dir.path()), empty, "buffered until the sync");
        assert!(ledger.file_size() > empty);
        ledger.sync().unwrap();
        assert_eq!(on_disk(dir.path()), ledger.file_size());
        // A commit record alone may be flushed without an fsync; it reaches the file.
        ledger.write(&commit(lsn(1, 4), lsn(1, 2))).unwrap();
        ledger.flush().unwrap();
        assert_eq!(on_disk(dir.path()), ledger.file_size());
        // Written but never synced: lost with the process.
        ledger
            .write(&update(lsn(1, 5), assign("q2", 0, 1)))
            .unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, 4));
        assert_eq!(recovered.committed_lsn, lsn(1, 2));
        assert!(recovered.committed_state.queues.contains_key("q1"));
        assert!(recovered.uncommitted.is_empty());
    }

    #[test]
    fn a_rollover_keeps_records_still_buffered() {
        // Scenario: the buffered records push the ledger past its maximum size: a rollover is
        // due, and the next sync writes the new file, which holds them (snapshot +
        // uncommitted); the old file is live until then.
        let dir = tempfile::tempdir().unwrap();
        let (mut ledger, _) = open(dir.path());
        ledger.set_max_file_size(300);
        ledger
            .write(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])))
            .unwrap();
        let mut seq = 1;
        for key in 0..8u64 {
            seq += 1;
            ledger
                .write(&update(
                    lsn(1, seq),
                    assign(&format!("bmq://d/q{key}"), 0, key),
                ))
                .unwrap();
        }
        seq += 1;
        ledger.write(&commit(lsn(1, seq), lsn(1, seq - 2))).unwrap();
        assert!(ledger.rollovers() > 0);
        assert_eq!(ledger.file_path(), file_path(dir.path(), 0));
        ledger.sync().unwrap();
        assert_eq!(ledger.file_path(), file_path(dir.path(), 1));
        let expected = ledger.recovered().clone();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, expected.committed_state);
        assert_eq!(recovered.committed_lsn, expected.committed_lsn);
        assert_eq!(recovered.uncommitted, expected.uncommitted);
        assert_eq!(recovered.committed_state.queues.len(), 7);
    }

    #[test]
    fn reset_to_replaces_the_history() {
        // Scenario: a follower's history is replaced by a CatchUp (snapshot + uncommitted records).
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let mut state = ClusterState::new(2);
        state.apply(&assign("other", 1, 5)).unwrap();
        let uncommitted = vec![(lsn(3, 4), assign("late", 0, 6))];
        ledger.reset_to(&state, lsn(3, 3), &uncommitted).unwrap();
        ledger.sync().unwrap();
        ledger.append(&commit(lsn(3, 5), lsn(3, 4))).unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        let mut expected = state.clone();
        expected.apply(&assign("late", 0, 6)).unwrap();
        assert_eq!(recovered.committed_state, expected);
        assert_eq!(recovered.committed_lsn, lsn(3, 4));
        assert_eq!(recovered.last_lsn, lsn(3, 5));
    }

    #[test]
    fn leftover_files_from_an_interrupted_rollover_are_cleaned() {
        // Scenario: a crash left a .tmp file and an old file next to the newest complete one.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        ledger.reset_to(&expected_state(), lsn(1, 2), &[]).unwrap();
        ledger.sync().unwrap();
        let live = ledger.file_path();
        drop(ledger);
        fs::write(dir.path().join("ledger-0.bmql"), file_header()).unwrap();
        fs::write(dir.path().join("ledger-2.bmql.tmp"), b"garbage").unwrap();
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, expected_state());
        let files: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files, vec![live]);
    }

    #[test]
    fn a_rewrite_runs_while_records_are_written_and_they_follow_it_into_the_new_file() {
        // Scenario: the node runs a reset's (or rollover's) writing of the new file
        // on another thread while it goes on writing records. Until the rewrite completes they
        // wait in the buffer (a flush does not touch the old file); then they go to the new
        // file, and the next sync makes them durable. A reset that never reached its sync
        // leaves the old history on disk.
        let dir = tempfile::tempdir().unwrap();
        let mut ledger = write_history(dir.path());
        let state = expected_state();
        ledger.reset_to(&state, lsn(2, 1), &[]).unwrap();
        drop(ledger);
        let (mut ledger, recovered) = open(dir.path());
        assert_eq!(
            recovered.last_lsn,
            lsn(1, 4),
            "the old history until the reset's sync"
        );
        ledger.reset_to(&state, lsn(2, 1), &[]).unwrap();
        let rewrite = ledger.begin_sync().unwrap().expect("the reset's rewrite");
        assert!(rewrite.is_rewrite());
        let old = file_path(dir.path(), 0);
        let old_bytes = fs::read(&old).unwrap();
        ledger
            .write(&update(lsn(2, 2), assign("q3", 1, 2)))
            .unwrap();
        ledger.flush().unwrap();
        assert_eq!(
            fs::read(&old).unwrap(),
            old_bytes,
            "nothing written to the old file"
        );
        let done = std::thread::spawn(move || rewrite.run())
            .join()
            .unwrap()
            .unwrap();
        ledger.complete_sync(done);
        assert!(!old.exists());
        ledger.sync().unwrap();
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.committed_lsn, lsn(2, 1));
        assert_eq!(recovered.committed_state, state);
        assert_eq!(recovered.uncommitted, vec![(lsn(2, 2), assign("q3", 1, 2))]);
    }

    #[test]
    fn records_go_into_a_length_set_ahead_and_the_zeros_after_them_are_no_torn_tail() {
        // Scenario: the file's length runs 1 MiB ahead of the records, so an fsync
        // has no file size to record; reopening finds the end of the records where the zeros
        // begin, truncates nothing, and the next record goes right after the last.
        let dir = tempfile::tempdir().unwrap();
        let ledger = write_history(dir.path());
        let path = ledger.file_path();
        let records = ledger.file_size();
        drop(ledger);
        assert_eq!(fs::metadata(&path).unwrap().len(), LEDGER_LENGTH_STEP);
        let (mut ledger, recovered) = open(dir.path());
        assert_eq!(recovered.committed_state, expected_state());
        assert_eq!(recovered.last_lsn, lsn(1, 4));
        assert_eq!(ledger.file_size(), records);
        assert_eq!(fs::metadata(&path).unwrap().len(), LEDGER_LENGTH_STEP);
        ledger
            .append(&update(lsn(1, 5), assign("q3", 1, 2)))
            .unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), LEDGER_LENGTH_STEP);
        // Past the length set ahead, it moves on to the next step.
        let big = "q".repeat(LEDGER_LENGTH_STEP as usize);
        ledger
            .append(&update(lsn(1, 6), assign(&big, 1, 3)))
            .unwrap();
        assert!(ledger.file_size() > LEDGER_LENGTH_STEP);
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            ledger.file_size().div_ceil(LEDGER_LENGTH_STEP) * LEDGER_LENGTH_STEP
        );
        drop(ledger);
        let (_, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, 6));
        assert_eq!(
            recovered
                .uncommitted
                .iter()
                .map(|(l, _)| *l)
                .collect::<Vec<_>>(),
            vec![lsn(1, 4), lsn(1, 5), lsn(1, 6)]
        );
    }

    #[test]
    fn zeros_where_a_record_should_begin_end_the_records_even_with_records_after_them() {
        // Scenario: a power loss left a later page of one write on disk and an earlier one not
        // (the file's length was set ahead, so nothing orders them): zeros stand where the
        // fourth record begins, and the fifth is intact. The fifth was never covered by a
        // completed fsync, so the records end at the zeros: a torn tail, truncated. Damage
        // that is not zeros before valid records stays an error (see the test above).
        let dir = tempfile::tempdir().unwrap();
        let (path, ends) = history_with_boundaries(dir.path());
        let mut bytes = fs::read(&path).unwrap();
        let (start, end) = (ends[2].1 as usize, ends[3].1 as usize);
        bytes[start..end].fill(0);
        fs::write(&path, &bytes).unwrap();
        let (ledger, recovered) = open(dir.path());
        assert_eq!(recovered.last_lsn, lsn(1, 3));
        assert_eq!(recovered.committed_state, {
            let mut s = ClusterState::new(2);
            s.apply(&primaries(&[(0, Some(1), 1)])).unwrap();
            s.apply(&assign("q1", 0, 0)).unwrap();
            s
        });
        assert_eq!(fs::metadata(&path).unwrap().len(), start as u64);
        keeps_working_after_truncation(dir.path(), ledger);
    }

    /// A ledger in `/ledger` on the simulated disk `disk`, fsyncing every record.
    fn open_sim(disk: &SimDisk) -> (Ledger, Recovered) {
        Ledger::open_on(
            Arc::new(disk.clone()),
            "/ledger",
            FsyncPolicy::EveryRecord,
            2,
        )
        .unwrap()
    }

    /// Whether `result` is the refusal of a failed ledger.
    fn refused(result: Result<(), LedgerError>) -> bool {
        matches!(result, Err(LedgerError::Failed { .. }))
    }

    #[test]
    fn a_failed_fsync_is_never_reported_persisted_and_fails_the_ledger() {
        // Scenario: the fsync covering a record fails (EIO). The sync reports the error, never
        // durability; from then on the ledger refuses every write, flush, sync and reset
        // without touching the disk (no fsync is retried); and after a power loss the record
        // is gone although reads saw it and a later fsync of the file succeeded (the pages a
        // failed fsync covered are never written later).
        let disk = SimDisk::new();
        let (mut ledger, _) = open_sim(&disk);
        ledger
            .append(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])))
            .unwrap();
        ledger
            .write(&update(lsn(1, 2), assign("q1", 0, 0)))
            .unwrap();
        disk.set_faults(Faults {
            fsyncs_failing: 1,
            ..Default::default()
        });
        let sync = ledger.begin_sync().unwrap().expect("an fsync is due");
        let (fsyncs, failed) = disk.fsync_counts();
        match sync.run() {
            Err(LedgerError::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(5)),
            other => panic!("expected the fsync's EIO, got {other:?}"),
        }
        assert_eq!(disk.fsync_counts(), (fsyncs + 1, failed + 1));
        assert!(ledger
            .failure()
            .is_some_and(|cause| cause.contains("ledger-0.bmql")));
        assert!(refused(ledger.sync()));
        assert!(refused(ledger.flush()));
        assert!(refused(ledger.write(&commit(lsn(1, 3), lsn(1, 2)))));
        assert!(refused(
            ledger.append(&update(lsn(1, 3), assign("q2", 0, 1)))
        ));
        assert!(refused(ledger.reset_to(&expected_state(), lsn(1, 2), &[])));
        assert!(matches!(
            ledger.begin_sync(),
            Err(LedgerError::Failed { .. })
        ));
        assert_eq!(disk.fsync_counts().0, fsyncs + 1, "no fsync retried");
        let file = disk.open(&ledger.file_path(), Open::Read).unwrap();
        let mut header = [0u8; RECORD_HEADER_LEN];
        let second = FILE_HEADER_LEN as u64
            + encode_record(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])), 0).len() as u64;
        file.read_exact_at(&mut header, second).unwrap();
        assert_eq!(
            header[frame::HEADER_LEN + 9],
            2,
            "reads still see the record (sequence 2)"
        );
        file.sync_data().unwrap();
        drop((ledger, file));
        disk.power_loss(|sizes| (sizes.len(), None));
        let (_, recovered) = open_sim(&disk);
        assert_eq!(
            recovered.last_lsn,
            lsn(1, 1),
            "the record was never durable"
        );
    }

    #[test]
    fn disk_work_handed_out_before_a_failure_does_not_touch_the_disk() {
        // Scenario: a rollover's snapshot and an fsync of the live file are both handed out
        // (the node runs them on two threads) and the snapshot's fsync fails. The fsync handed
        // out earlier then runs no fsync and reports the failure, so the records it covers are
        // not reported durable either, and no further rollover starts.
        let disk = SimDisk::new();
        let (mut ledger, _) = open_sim(&disk);
        ledger.set_max_file_size(300);
        let mut seq = 0;
        while !ledger.rollover_pending() {
            write_assignment(&mut ledger, &mut seq, true);
        }
        let snapshot = ledger.begin_snapshot().expect("the rollover's snapshot");
        write_assignment(&mut ledger, &mut seq, false);
        let sync = ledger
            .begin_sync()
            .unwrap()
            .expect("an fsync of the live file");
        assert!(!sync.is_switch() && !sync.is_rewrite());
        disk.set_faults(Faults {
            fsyncs_failing: 1,
            ..Default::default()
        });
        assert!(matches!(snapshot.run(), Err(LedgerError::Io { .. })));
        let fsyncs = disk.fsync_counts().0;
        assert!(matches!(sync.run(), Err(LedgerError::Failed { .. })));
        assert_eq!(disk.fsync_counts().0, fsyncs, "no fsync after the failure");
        assert!(ledger.begin_snapshot().is_none());
        assert!(refused(ledger.sync()));
    }

    #[test]
    fn on_a_simulated_disk_a_power_loss_keeps_what_the_ledger_synced() {
        // Scenario: the ledger on the simulators' disk, rolling over: records handed to the
        // file but not fsynced are lost at a power loss, every synced one survives, in the
        // file the last switch put in place (its directory entry was fsynced). The old file's
        // removal was not fsynced, so it comes back: the open removes it again.
        let disk = SimDisk::new();
        let (mut ledger, _) = open_sim(&disk);
        ledger.set_max_file_size(300);
        let mut seq = 0;
        let mut synced = Lsn::ZERO;
        while ledger.rollovers() < 2 {
            synced = write_assignment(&mut ledger, &mut seq, true);
            ledger.sync().unwrap();
        }
        let expected = ledger.recovered().clone();
        write_assignment(&mut ledger, &mut seq, false);
        ledger.flush().unwrap();
        let live = ledger.file_path();
        drop(ledger);
        disk.power_loss(|_| (0, None));
        assert_eq!(
            disk.files(),
            vec![file_path(Path::new("/ledger"), 1), live.clone()]
        );
        let (_, recovered) = open_sim(&disk);
        assert_eq!(recovered.last_lsn, synced);
        assert_eq!(recovered, expected);
        assert_eq!(disk.files(), vec![live]);
    }

    #[test]
    fn records_carry_the_wall_clock_time_the_shell_set() {
        // Scenario: the ledger reads no clock: a record's timestamp is the time its shell set
        // last (0 before it set any).
        let disk = SimDisk::new();
        let (mut ledger, _) = open_sim(&disk);
        ledger
            .append(&update(lsn(1, 1), primaries(&[(0, Some(1), 1)])))
            .unwrap();
        ledger.set_wall_clock_ms(1_700_000_000_123);
        ledger
            .append(&update(lsn(1, 2), assign("q1", 0, 0)))
            .unwrap();
        let bytes = disk
            .open(&ledger.file_path(), Open::Read)
            .unwrap()
            .read_up_to(u64::MAX)
            .unwrap();
        let stamp = |at: usize| {
            let at = at + frame::HEADER_LEN + 17;
            u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
        };
        let first = FILE_HEADER_LEN;
        let second = first
            + read_frame(&bytes[first..], LEDGER_VERSION)
                .expect("a record")
                .len;
        assert_eq!((stamp(first), stamp(second)), (0, 1_700_000_000_123));
    }

    /// `write_history` again, returning each record's LSN and the file size after it.
    fn history_with_boundaries(dir: &Path) -> (PathBuf, Vec<(Lsn, u64)>) {
        let (mut ledger, _) = open(dir);
        let records = [
            update(lsn(1, 1), primaries(&[(0, Some(1), 1)])),
            update(lsn(1, 2), assign("q1", 0, 0)),
            commit(lsn(1, 3), lsn(1, 2)),
            update(lsn(1, 4), assign("q2", 0, 1)),
            commit(lsn(1, 5), lsn(1, 4)),
        ];
        let mut ends = Vec::new();
        for r in &records {
            ledger.append(r).unwrap();
            ends.push((r.lsn(), ledger.file_size()));
        }
        (close_to_records(ledger).0, ends)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_as_a_ledger_file_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1024),
            with_header in proptest::prelude::any::<bool>(),
        ) {
            // Scenario: a ledger file holding arbitrary bytes (behind a valid file header or
            // not) opens to a state or a clear error, never a panic.
            let dir = tempfile::tempdir().unwrap();
            let mut content = if with_header { file_header().to_vec() } else { Vec::new() };
            content.extend_from_slice(&bytes);
            fs::write(dir.path().join("ledger-0.bmql"), &content).unwrap();
            let _ = Ledger::open(dir.path(), FsyncPolicy::Never, 2);
        }

        #[test]
        fn a_cut_anywhere_recovers_every_record_before_it(cut_at in 0u64..4096) {
            // Scenario: a crash cuts the file at any byte; every record that ends before the
            // cut is recovered and nothing after it (the torn tail is truncated).
            let dir = tempfile::tempdir().unwrap();
            let (path, ends) = history_with_boundaries(dir.path());
            let len = fs::metadata(&path).unwrap().len();
            let cut = FILE_HEADER_LEN as u64 + cut_at % (len - FILE_HEADER_LEN as u64 + 1);
            let file = OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(cut).unwrap();
            drop(file);
            let (_, recovered) = Ledger::open(dir.path(), FsyncPolicy::Never, 2).unwrap();
            let expected_last = ends
                .iter()
                .filter(|(_, end)| *end <= cut)
                .map(|(l, _)| *l)
                .next_back()
                .unwrap_or(Lsn::ZERO);
            proptest::prop_assert_eq!(recovered.last_lsn, expected_last);
            proptest::prop_assert!(recovered.committed_lsn <= expected_last);
        }

        #[test]
        fn a_flipped_byte_is_truncated_as_a_tail_or_reported_with_its_offset(
            at in 0u64..4096,
            mask in 1u8..=255,
        ) {
            // Scenario: one damaged byte. In the last record it is a torn tail: the records
            // before it are recovered. Earlier, open fails naming the file and an offset at or
            // before the damage. Never a panic, never a state built from the damaged record.
            let dir = tempfile::tempdir().unwrap();
            let (path, ends) = history_with_boundaries(dir.path());
            let mut bytes = fs::read(&path).unwrap();
            let body_len = bytes.len() as u64 - FILE_HEADER_LEN as u64;
            let pos = FILE_HEADER_LEN as u64 + at % body_len;
            bytes[pos as usize] ^= mask;
            fs::write(&path, &bytes).unwrap();
            // The index of the record holding the damaged byte.
            let damaged = ends.iter().position(|(_, end)| pos < *end).unwrap();
            match Ledger::open(dir.path(), FsyncPolicy::Never, 2) {
                Ok((_, recovered)) => {
                    let before = if damaged == 0 { Lsn::ZERO } else { ends[damaged - 1].0 };
                    proptest::prop_assert_eq!(damaged, ends.len() - 1, "damage before the tail accepted");
                    proptest::prop_assert_eq!(recovered.last_lsn, before);
                }
                Err(LedgerError::Corrupt { file, offset }) => {
                    proptest::prop_assert_eq!(file, path.clone());
                    proptest::prop_assert!(offset <= pos, "offset {} after the damage at {}", offset, pos);
                    let start = if damaged == 0 { FILE_HEADER_LEN as u64 } else { ends[damaged - 1].1 };
                    proptest::prop_assert_eq!(offset, start);
                }
                Err(other) => proptest::prop_assert!(false, "unexpected error {}", other),
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn arbitrary_bytes_after_a_valid_prefix_never_panic(
            garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            keep in 0usize..400,
        ) {
            // Scenario: whatever follows a valid prefix, open returns Ok or Err and never panics.
            let dir = tempfile::tempdir().unwrap();
            let (path, mut bytes) = close_to_records(write_history(dir.path()));
            bytes.truncate(keep.min(bytes.len()));
            bytes.extend_from_slice(&garbage);
            fs::write(&path, &bytes).unwrap();
            let _ = Ledger::open(dir.path(), FsyncPolicy::Never, 2);
        }
    }

    /// One step of [`a_crash_at_any_step_of_rollovers_recovers_every_synced_record`].
    #[derive(Debug, Clone)]
    enum Step {
        /// A queue assignment, committed or not.
        Write(bool),
        /// `begin_sync`'s work run and completed (an fsync, or a rollover's switch).
        Sync,
        /// A due rollover's snapshot handed out.
        BeginSnapshot,
        /// The snapshot handed out written (on "another thread").
        RunSnapshot,
        /// The written snapshot given back.
        CompleteSnapshot,
        /// The files let go of released.
        Release,
        /// A crash now: a copy of the directory, the live file cut at a byte between what
        /// was synced and what was written, opened.
        Crash(u16),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            6 => any::<bool>().prop_map(Step::Write),
            3 => Just(Step::Sync),
            1 => Just(Step::BeginSnapshot),
            1 => Just(Step::RunSnapshot),
            1 => Just(Step::CompleteSnapshot),
            1 => Just(Step::Release),
            2 => any::<u16>().prop_map(Step::Crash),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
            std::env::var("BMQ_LEDGER_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256)
        ))]
        #[test]
        fn a_crash_at_any_step_of_rollovers_recovers_every_synced_record(
            steps in proptest::collection::vec(step(), 1..120),
        ) {
            // Scenario: writes, fsyncs, and the steps of rollovers (snapshot handed
            // out, written while records go on, given back, switched to) in any order, with a
            // tiny file size so that rollovers follow one another. A crash at any point —
            // the live file cut anywhere between its synced records and its written ones —
            // recovers a prefix of the history holding every synced record: exactly the state
            // the ledger had when that prefix's last record was written.
            use proptest::prop_assert;
            let dir = tempfile::tempdir().unwrap();
            let (mut ledger, _) = open(dir.path());
            ledger.set_max_file_size(700);
            let mut seq = 0;
            // The ledger's view after each record written, by its LSN.
            let mut history = vec![ledger.recovered().clone()];
            let mut synced = Lsn::ZERO;
            // The live file and the length of its records at the last sync.
            let mut synced_file = (ledger.file_path(), ledger.file_size());
            let mut snapshot: Option<LedgerSnapshot> = None;
            let mut written: Option<SnapshotWritten> = None;
            for step in steps {
                match step {
                    Step::Write(committed) => {
                        write_assignment(&mut ledger, &mut seq, committed);
                        history.push(ledger.recovered().clone());
                    }
                    Step::Sync => {
                        let covers = ledger.recovered().last_lsn;
                        while let Some(sync) = ledger.begin_sync().unwrap() {
                            ledger.complete_sync(sync.run().unwrap());
                        }
                        ledger.flush().unwrap();
                        synced = covers;
                        synced_file = (ledger.file_path(), ledger.file_size());
                    }
                    Step::BeginSnapshot => {
                        if snapshot.is_none() && written.is_none() {
                            snapshot = ledger.begin_snapshot();
                        }
                    }
                    Step::RunSnapshot => {
                        if let Some(s) = snapshot.take() {
                            written = Some(s.run().unwrap());
                        }
                    }
                    Step::CompleteSnapshot => {
                        if let Some(w) = written.take() {
                            ledger.complete_snapshot(w);
                        }
                    }
                    Step::Release => {
                        while let Some(release) = ledger.take_release() {
                            release.run();
                        }
                    }
                    Step::Crash(at) => {
                        let copy = tempfile::tempdir().unwrap();
                        for name in names_in(dir.path()) {
                            fs::copy(dir.path().join(&name), copy.path().join(&name)).unwrap();
                        }
                        let (path, synced_len) = &synced_file;
                        let live = copy.path().join(path.file_name().unwrap());
                        if path == &ledger.file_path() && live.exists() {
                            let written_len = ledger.file_size() - ledger.buffer.len() as u64;
                            let cut = synced_len + u64::from(at) % (written_len - synced_len + 1);
                            let file = OpenOptions::new().write(true).open(&live).unwrap();
                            file.set_len(cut).unwrap();
                        }
                        let (_, recovered) =
                            Ledger::open(copy.path(), FsyncPolicy::EveryRecord, 2).unwrap();
                        prop_assert!(
                            recovered.last_lsn >= synced,
                            "recovered up to {} but {} was synced", recovered.last_lsn, synced
                        );
                        let at_that_point = history
                            .iter()
                            .find(|h| h.last_lsn == recovered.last_lsn)
                            .expect("a point of the history");
                        prop_assert!(&recovered == at_that_point, "recovered {:?}", recovered);
                        prop_assert!(names_in(copy.path()).len() == 1);
                    }
                }
            }
        }
    }
}
