//! Compaction of a journal segment off the partition's thread: done inside one call on the
//! partition thread, a compaction made every PUT of the partition wait for it
//! (docs/bench/JOURNAL.md, "Compaction off the partition's thread").
//!
//! A compaction has three steps:
//! 1. **Issue** ([`Store::maintain`], partition thread): the settled closed segment with the
//!    most dead bytes is chosen; the records live at the current base are listed (16 bytes
//!    each) with the segment's open file, and a marker with that base is appended to the
//!    active segment (made durable by the next sync, as for a deletion). Nothing is read.
//! 2. **Copy** ([`CompactionTicket::run`], any thread): the listed records are read from the
//!    segment's file in runs of adjacent records, checked (length and CRC32C), written as
//!    they are to `journal-<n>.<id>.bmqj.compact` after a header and a marker with the base,
//!    each chunk fdatasynced as it is written and the file fsynced at the end. The partition goes on meanwhile: it reads the segment from its
//!    old file at the old offsets, and records may die.
//! 3. **Install** ([`Store::complete_compaction`], then [`Store::maintain`] until it can,
//!    partition thread): once a durable marker has the base at which the dropped records were
//!    dead (else a restart at a lower base could truncate the confirm that made a dropped
//!    message dead, and the message would be gone: the rule deletions follow too), the copy
//!    is renamed over the segment and the directory fsynced (~0.25 ms); the segment's list
//!    takes the new offsets, with the live bits of *now* (records that died during the copy
//!    stay in the new file as dead records, their confirms pinned to it as usual), and the
//!    confirms of dropped messages held in other segments are released.
//!
//! A copy whose journal was replaced by an install while it ran is discarded (its file
//! removed); a failed copy too, and the segment stays as it was. One compaction at
//! a time; the segment under compaction is not deleted until it is installed or discarded.
//! A crash at any step leaves the old segment (the copy is removed at open) or, after the
//! rename, the new one: both hold every record live at a durable base.

use crate::disk::{Disk, FileRef, Open};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bmq_proto::peer::StoredMarker;

use super::{
    check_frame, io, marker_record, segment_head, sync_dir, Held, Maintenance, Store, StoreError,
    LIVE, RECORD_HEADER_LEN, VERSION,
};

/// Bytes of a compacted segment gathered in memory before they are written and fdatasynced,
/// and the most read at once from the old segment: a compaction streams the live records
/// through about twice this much memory, not the whole segment. One fsync of the whole copy
/// made more of the journal's fsyncs slow than before the copy left the partition's thread,
/// and the producer fell short of its rate in some runs; chunks each fdatasynced brought both
/// back (docs/bench/JOURNAL.md, "Compaction off the partition's thread").
const COMPACT_CHUNK: usize = 256 << 10;

/// Numbers the copies of this process, so that a discarded copy's file can never be another
/// compaction's (a journal replaced by an install starts its own compactions).
static NEXT_COPY: AtomicU64 = AtomicU64::new(1);

/// The copy of a compaction, to run on another thread ([`CompactionTicket::run`]) while the
/// partition goes on; its outcome goes back to [`Store::complete_compaction`].
#[derive(Debug)]
pub struct CompactionTicket {
    id: u64,
    /// The disk the journal is on.
    disk: Arc<dyn Disk>,
    /// The old segment's file (shared: the partition still reads it) and path.
    source: FileRef,
    source_path: PathBuf,
    /// The copy's path (`journal-<n>.<id>.bmqj.compact`).
    tmp: PathBuf,
    /// Segment header and marker.
    head: Vec<u8>,
    /// The records to keep, ascending, at their old offsets.
    records: Vec<Held>,
    fsync: bool,
}

/// What a [`CompactionTicket`] did: hand it to [`Store::complete_compaction`].
#[derive(Debug)]
pub struct CompactionDone {
    id: u64,
    tmp: PathBuf,
    result: Result<Copied, StoreError>,
}

/// A finished copy: the new file, and for each kept record (ascending) its new offset.
#[derive(Debug)]
struct Copied {
    file: FileRef,
    records: Vec<Held>,
    len: u64,
}

/// The compaction under way in a store.
#[derive(Debug)]
pub(super) struct Compacting {
    id: u64,
    /// The segment's number.
    no: u32,
    /// The copy's path.
    tmp: PathBuf,
    /// The base at which the dropped records were dead: the copy is installed once a durable
    /// marker has it.
    base: u64,
    /// Highest sequence dropped (the floor rises to it once the copy is in place).
    dropped_max: u64,
    /// Confirm, failure and removal records in other segments pinned by the dropped messages:
    /// released once the copy is in place, given back to the segment if it is discarded.
    others: Vec<u64>,
    /// The finished copy, waiting for its durable marker.
    done: Option<Copied>,
}

impl Compacting {
    /// The segment under compaction.
    pub(super) fn segment(&self) -> u32 {
        self.no
    }
}

impl CompactionTicket {
    /// Copies the listed records to the new file and fsyncs it; blocks for as long as the
    /// disk takes (tens of milliseconds for a few MiB). Errors (in the outcome): a read or
    /// write failed, the disk is full, or a record no longer checks out
    /// ([`StoreError::Corrupt`]); the copy's file is then removed by
    /// [`Store::complete_compaction`].
    pub fn run(self) -> CompactionDone {
        let started = Instant::now();
        let result = self.copy();
        metrics::histogram!("bmq_journal_compaction_seconds")
            .record(started.elapsed().as_secs_f64());
        CompactionDone {
            id: self.id,
            tmp: self.tmp,
            result,
        }
    }

    fn copy(&self) -> Result<Copied, StoreError> {
        let file = self
            .disk
            .open(&self.tmp, Open::Create)
            .map_err(io(&self.tmp))?;
        let mut out = self.head.clone();
        let mut written = 0u64;
        let mut records = Vec::with_capacity(self.records.len());
        let mut run = Vec::new();
        let mut i = 0;
        while i < self.records.len() {
            // A run of adjacent records, read with one pread.
            let start = self.records[i].offset;
            let mut end = i;
            let mut bytes = 0usize;
            while end < self.records.len()
                && self.records[end].offset as usize == start as usize + bytes
                && (bytes == 0 || bytes + self.records[end].len() as usize <= COMPACT_CHUNK)
            {
                bytes += self.records[end].len() as usize;
                end += 1;
            }
            run.resize(bytes, 0);
            self.source
                .read_exact_at(&mut run, u64::from(start))
                .map_err(io(&self.source_path))?;
            let mut at = 0usize;
            for held in &self.records[i..end] {
                let framed = &run[at..at + held.len() as usize];
                self.check(held, framed)?;
                let offset = written + out.len() as u64;
                out.extend_from_slice(framed);
                records.push(Held {
                    sequence: held.sequence,
                    offset: offset as u32,
                    len_live: held.len() | LIVE,
                });
                at += held.len() as usize;
            }
            if out.len() >= COMPACT_CHUNK {
                file.write_all_at(&out, written).map_err(io(&self.tmp))?;
                if self.fsync {
                    // Each chunk to the disk at once: the journal's group-commit fsyncs, which
                    // now run beside the copy, wait behind at most one chunk's writeback, not
                    // behind megabytes at the final fsync.
                    file.sync_data().map_err(io(&self.tmp))?;
                }
                written += out.len() as u64;
                out.clear();
            }
            i = end;
        }
        file.write_all_at(&out, written).map_err(io(&self.tmp))?;
        written += out.len() as u64;
        if self.fsync {
            file.sync_all().map_err(io(&self.tmp))?;
        }
        Ok(Copied {
            file,
            records,
            len: written,
        })
    }

    /// Checks the framed record `held` as read: its length field (copied as it is, it must
    /// agree with the list) and, as every read does, its header and checksum.
    fn check(&self, held: &Held, framed: &[u8]) -> Result<(), StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt {
            path: self.source_path.clone(),
            offset: u64::from(held.offset),
            reason,
        };
        if let Ok(len) = crate::frame::peek_len(framed) {
            if len + RECORD_HEADER_LEN != framed.len() {
                return Err(corrupt("record length differs from the index".into()));
            }
        }
        check_frame(framed, "compaction").map_err(corrupt)
    }
}

impl Store {
    /// Starts compacting closed segment `no` (settled at the current base): lists its live
    /// records, releases the confirms of its dead messages held in the segment itself, and
    /// returns the copy to run. The caller has appended a marker with the current base.
    pub(super) fn begin_compaction(&mut self, no: u32) -> CompactionTicket {
        let i = self
            .segments
            .iter()
            .position(|s| s.no == no)
            .expect("listed");
        let id = NEXT_COPY.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!("journal-{no:010}.{id}.bmqj.compact"));
        // The segment now has gaps: it opens with the base that makes them legitimate (not
        // the covered position, which later segments establish).
        let head = segment_head(
            &marker_record(StoredMarker {
                base: self.base,
                covered_through: 0,
                runs: Vec::new(),
                segment: 0,
            }),
            VERSION,
        );
        // Confirms pinned by dead messages of this segment go with them (both leave the
        // disk together, whether or not this copy is installed); those pinned in other
        // segments are released once the copy is in place.
        let pins = std::mem::take(&mut self.segments[i].pins);
        let (own, others): (Vec<u64>, Vec<u64>) = pins
            .into_iter()
            .partition(|r| self.locate(*r).is_some_and(|(ri, _)| ri == i));
        for r in own {
            self.kill(r);
        }
        let s = &mut self.segments[i];
        s.self_pinned = 0;
        let records: Vec<Held> = s.records.iter().filter(|h| h.live()).copied().collect();
        let dropped_max = s
            .records
            .iter()
            .rev()
            .find(|h| !h.live())
            .map_or(0, |h| h.sequence);
        let ticket = CompactionTicket {
            id,
            disk: self.disk.clone(),
            source: s.file.clone(),
            source_path: s.path.clone(),
            tmp: tmp.clone(),
            head,
            records,
            fsync: self.cfg.fsync,
        };
        self.compacting = Some(Compacting {
            id,
            no,
            tmp,
            base: self.base,
            dropped_max,
            others,
            done: None,
        });
        ticket
    }

    /// The copy of a compaction that [`Store::maintain`] started, to run on another thread
    /// ([`CompactionTicket::run`]) when the store compacts in the background
    /// ([`Store::set_background_compaction`]); `None` when none waits. Issue the outcome to
    /// [`Store::complete_compaction`].
    pub fn take_compaction(&mut self) -> Option<CompactionTicket> {
        self.compaction_out.take()
    }

    /// Records the outcome of a compaction's copy ([`CompactionTicket::run`]): the copy
    /// replaces its segment now if a durable marker has the base it was made at, else at a
    /// later [`Store::maintain`] (after the next sync). A copy for a journal since replaced
    /// by an install is discarded (a truncation does not concern it: it cuts above the base,
    /// and the segment is settled). Returns what was reclaimed. Errors: the
    /// copy failed (its file is removed and the segment stays as it was; a full disk,
    /// [`StoreError::is_no_space`], lets a later call try again), or the rename or the
    /// directory fsync failed.
    pub fn complete_compaction(&mut self, done: CompactionDone) -> Result<Maintenance, StoreError> {
        let current = self
            .compacting
            .as_ref()
            .is_some_and(|c| c.id == done.id && c.done.is_none());
        if !current {
            self.remove_later(done.tmp);
            return Ok(Maintenance::default());
        }
        let copied = match done.result {
            Ok(copied) => copied,
            Err(e) => {
                self.abandon_compaction();
                self.remove_later(done.tmp);
                return Err(e);
            }
        };
        self.compacting.as_mut().expect("current").done = Some(copied);
        self.install_compaction()
    }

    /// Forgets the compaction under way, its copy's file removed if finished (a copy still
    /// running is discarded when it completes): the journal is being replaced by an install.
    pub(super) fn forget_compaction(&mut self) {
        if let Some(c) = self.compacting.take() {
            if c.done.is_some() {
                self.remove_later(c.tmp);
            }
        }
        self.compaction_out = None;
    }

    /// Gives up the compaction of the active segment, if it is under compaction (its copy's
    /// file removed now if finished, else when it completes): appends go there.
    pub(super) fn abandon_compaction_of_active(&mut self) {
        let active = self.segments.last().map(|s| s.no);
        if self
            .compacting
            .as_ref()
            .is_some_and(|c| Some(c.no) == active)
        {
            self.abandon_compaction();
        }
    }

    /// Gives a compaction up: the segment keeps its pins and will be chosen again; a finished
    /// copy's file is removed (one still running is when it completes).
    fn abandon_compaction(&mut self) {
        let Some(c) = self.compacting.take() else {
            return;
        };
        if c.done.is_some() {
            self.remove_later(c.tmp);
        }
        match self.segments.iter_mut().find(|s| s.no == c.no) {
            Some(s) => s.pins.extend(c.others),
            // The segment is gone, its records with it.
            None => {
                for r in c.others {
                    self.kill(r);
                }
            }
        }
        self.maintenance_due = true;
    }

    /// Puts a finished copy in place of its segment once a durable marker has its base and
    /// the active segment (which holds that marker) is durable; until then it waits
    /// ([`Store::maintain`] asks again after the next sync).
    pub(super) fn install_compaction(&mut self) -> Result<Maintenance, StoreError> {
        let mut report = Maintenance::default();
        let Some(c) = self.compacting.as_ref().filter(|c| c.done.is_some()) else {
            return Ok(report);
        };
        let active_fresh = self.segments.last().is_some_and(|s| s.fresh);
        if self.durable_marked_base < c.base || active_fresh {
            self.maintenance_due = true;
            return Ok(report);
        }
        let c = self.compacting.take().expect("ready");
        let copied = c.done.expect("ready");
        let Some(i) = self.segments.iter().position(|s| s.no == c.no) else {
            // Not reached (the segment is not deleted while under compaction): its records
            // are gone anyway.
            for r in c.others {
                self.kill(r);
            }
            return Ok(report);
        };
        let s = &self.segments[i];
        self.disk.rename(&c.tmp, &s.path).map_err(io(&s.path))?;
        if self.cfg.fsync {
            sync_dir(&*self.disk, &self.dir)?;
        }
        // The kept records, with their live bits as of now (some died during the copy).
        let s = &mut self.segments[i];
        let mut now = s.records.iter().peekable();
        let records: Vec<Held> = copied
            .records
            .into_iter()
            .map(|mut h| {
                while now.next_if(|o| o.sequence < h.sequence).is_some() {}
                let live = now
                    .peek()
                    .is_some_and(|o| o.sequence == h.sequence && o.live());
                if !live {
                    h.len_live &= !LIVE;
                }
                h
            })
            .collect();
        let freed = s.len.saturating_sub(copied.len);
        let replaced = std::mem::replace(&mut s.file, copied.file);
        s.len = copied.len;
        s.written = copied.len;
        s.synced_len = copied.len;
        s.recycled = false;
        s.records = records;
        s.unreclaimable = s.dead_bytes();
        self.retire_file(replaced);
        self.floor = self.floor.max(c.dropped_max);
        self.bytes_total = self.bytes_total.saturating_sub(freed);
        // The dead messages are gone from disk: their confirms are no longer needed.
        for r in c.others {
            self.kill(r);
        }
        self.maintenance_epoch += 1;
        // Space may remain to reclaim.
        self.maintenance_due = true;
        metrics::counter!("bmq_journal_compactions_total").increment(1);
        report.compacted = 1;
        report.freed_bytes = freed;
        Ok(report)
    }

    /// Removes file `path` with the closed files when they are closed on another thread
    /// (an unlink frees the file's blocks: milliseconds), else now; a failure is logged (a
    /// leftover copy is removed at the next open).
    fn remove_later(&mut self, path: PathBuf) {
        if self.defer_close {
            self.closed_files.unlink.push(path);
        } else if let Err(e) = self.disk.remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a discarded journal compaction");
        }
    }
}

/// Whether `path` names a compaction's copy (removed at open: the segment it was to replace
/// is intact).
pub(super) fn is_copy(name: &str) -> bool {
    name.ends_with(".bmqj.compact")
}
