use super::*;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;

use bmq_proto::peer::{StoredConfirm, StoredFailure, StoredMessage, StoredRemoval};
use proptest::prelude::*;

fn apps() -> AppsOf {
    Arc::new(|uri: &str| {
        if uri.contains("fanout") {
            vec!["a".to_string(), "b".to_string()]
        } else {
            vec![String::new()]
        }
    })
}

fn cfg(segment: u64) -> StoreConfig {
    StoreConfig {
        segment_size_max: segment,
        cache_bytes_max: 4096,
        quota_bytes: 0,
        recycle: true,
        fsync: false,
    }
}

fn open(dir: &Path, segment: u64) -> Store {
    Store::open(dir, cfg(segment), apps()).expect("open")
}

/// A store in `dir` with real fsyncs (so that a sync leaves a [`SyncTicket`]).
fn open_fsync(dir: &Path, segment: u64) -> Store {
    let cfg = StoreConfig {
        fsync: true,
        ..cfg(segment)
    };
    Store::open(dir, cfg, apps()).expect("open")
}

fn guid(n: u64) -> Bytes {
    Bytes::copy_from_slice(&u128::from(n).to_be_bytes())
}

fn message(sequence: u64, lease: u64, uri: &str, n: u64) -> JournalRecord {
    JournalRecord {
        lease,
        sequence,
        timestamp_ms: 0,
        kind: Some(RecordKind::Message(StoredMessage {
            uri: bmq_proto::uri_bytes(uri),
            guid: guid(n),
            payload: Bytes::from(vec![n as u8; 100]),
            properties: vec![],
        })),
    }
}

fn confirm(sequence: u64, lease: u64, uri: &str, n: u64, app: &str) -> JournalRecord {
    JournalRecord {
        lease,
        sequence,
        timestamp_ms: 0,
        kind: Some(RecordKind::Confirm(StoredConfirm {
            uri: bmq_proto::uri_bytes(uri),
            guid: guid(n),
            app_id: app.into(),
        })),
    }
}

/// [`Store::maintain`] as a partition runs it: once more after the sync that makes the marker
/// it wrote durable (segments go only once a durable marker says they are settled).
fn maintain(s: &mut Store) -> Maintenance {
    let mut m = s.maintain().unwrap();
    if s.maintenance_due() {
        s.sync().unwrap();
        let more = s.maintain().unwrap();
        m.deleted += more.deleted;
        m.compacted += more.compacted;
        m.freed_bytes += more.freed_bytes;
    }
    m
}

/// Appends `count` messages, each followed by its confirm; returns the last position.
fn put_and_confirm(s: &mut Store, count: u64) -> u64 {
    put_and_confirm_from(s, 0, count)
}

/// As [`put_and_confirm`], after position `seq` (GUIDs from `seq + 1` on).
fn put_and_confirm_from(s: &mut Store, mut seq: u64, count: u64) -> u64 {
    for n in seq + 1..=seq + count {
        seq += 1;
        s.append_one(&message(seq, 1, Q, n)).unwrap();
        seq += 1;
        s.append_one(&confirm(seq, 1, Q, n, "")).unwrap();
    }
    seq
}

/// [`put_and_confirm_from`] `count` after `seq`, then everything settled and maintained: the
/// closed segments go (the first full one becomes the spare). Returns the last position and
/// what the maintenance did.
fn put_confirm_and_settle(s: &mut Store, seq: u64, count: u64) -> (u64, Maintenance) {
    let seq = put_and_confirm_from(s, seq, count);
    s.sync().unwrap();
    s.set_base(seq);
    (seq, maintain(s))
}

/// Appends messages after `seq` (GUID = position) until the active segment rolls over;
/// returns the last position.
fn append_until_roll_over(s: &mut Store, mut seq: u64) -> u64 {
    let segments = s.files().len();
    while s.files().len() == segments {
        seq += 1;
        s.append_one(&message(seq, 1, Q, seq)).unwrap();
    }
    seq
}

fn outstanding_guids(store: &Store) -> Vec<u128> {
    store.outstanding().iter().map(|o| o.guid).collect()
}

const Q: &str = "bmq://d/q";

/// The entries of a journal's directory other than its primary-lease mark.
fn journal_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name() != crate::lease_mark::LEASE_MARK_NAME)
        .count()
}

/// Messages and confirms survive a reopen; a confirm counts for the index once settled, and for
/// the rebuilt queues at once.
#[test]
fn reopen_rebuilds_the_outstanding_index() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for n in 1..=3 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    s.append_one(&confirm(4, 1, Q, 2, "")).unwrap();
    assert_eq!(s.sync().unwrap(), 4);
    // Not settled: the index keeps message 2, the rebuild drops it.
    assert_eq!(s.stats().outstanding, 3);
    assert_eq!(outstanding_guids(&s), vec![1, 3]);
    s.set_base(4);
    assert_eq!(s.stats().outstanding, 2);
    drop(s);
    let s = open(dir.path(), 1 << 20);
    assert_eq!(s.last_sequence(), 4);
    assert_eq!(outstanding_guids(&s), vec![1, 3]);
    let r = s.read(3).unwrap().unwrap();
    assert_eq!(r.sequence, 3);
    assert!(s.read(9).unwrap().is_none());
    assert_eq!(
        s.runs(),
        vec![LeaseRun {
            lease: 1,
            first_sequence: 1
        }]
    );
}

/// Fanout: a message stays outstanding until every app is done with it; a failure record
/// carries its count into the rebuild.
#[test]
fn fanout_apps_and_failures() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let f = "bmq://d/fanout";
    s.append_one(&message(1, 1, f, 7)).unwrap();
    s.append_one(&confirm(2, 1, f, 7, "a")).unwrap();
    s.append_one(&JournalRecord {
        lease: 1,
        sequence: 3,
        timestamp_ms: 0,
        kind: Some(RecordKind::Failure(StoredFailure {
            uri: f.into(),
            guid: guid(7),
            app_id: "b".into(),
            failures: 2,
        })),
    })
    .unwrap();
    let o = s.outstanding();
    assert_eq!(o.len(), 1);
    assert_eq!(o[0].apps, vec![("b".to_string(), 2)]);
    s.set_base(3);
    assert_eq!(s.outstanding()[0].apps, vec![("b".to_string(), 2)]);
    s.append_one(&JournalRecord {
        lease: 1,
        sequence: 4,
        timestamp_ms: 0,
        kind: Some(RecordKind::Removal(StoredRemoval {
            uri: f.into(),
            guid: guid(7),
            app_id: "b".into(),
            reason: "ttl".into(),
        })),
    })
    .unwrap();
    s.set_base(4);
    assert!(s.outstanding().is_empty());
    assert_eq!(s.stats().outstanding, 0);
    // One segment: the message record is dead; its confirm, failure and removal records stay
    // live (pinned to the segment) until the segment is rewritten or deleted, so a chunked
    // install that already sent the message also sends them.
    let live = s.stats().live_bytes;
    assert!(live > 0 && live < s.stats().bytes, "{:?}", s.stats());
}

fn queue_apps(sequence: u64, uri: &str, apps: &[&str], added: &[&str]) -> JournalRecord {
    let list = |l: &[&str]| l.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    JournalRecord {
        lease: 1,
        sequence,
        timestamp_ms: 0,
        kind: Some(RecordKind::QueueApps(bmq_proto::peer::StoredQueueApps {
            uri: bmq_proto::uri_bytes(uri),
            app_ids: list(apps),
            added: list(added),
            removed: Vec::new(),
        })),
    }
}

/// `(guid, apps waiting)` of every outstanding message.
fn waiting(s: &Store) -> Vec<(u128, Vec<String>)> {
    s.outstanding()
        .into_iter()
        .map(|o| (o.guid, o.apps.into_iter().map(|(a, _)| a).collect()))
        .collect()
}

fn names(apps: &[&str]) -> Vec<String> {
    apps.iter().map(|a| a.to_string()).collect()
}

/// A fanout queue's apps change in journal order: an added app waits only for later messages,
/// a removed one is done with every earlier message once the base passes the change (a
/// message no app waits for leaves the index); a restart that reads the change agrees.
#[test]
fn a_queue_apps_record_adds_and_removes_apps_in_journal_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let f = "bmq://d/fanout";
    s.append_one(&message(1, 1, f, 1)).unwrap();
    s.append_one(&confirm(2, 1, f, 1, "a")).unwrap();
    s.append_one(&message(3, 1, f, 2)).unwrap();
    s.append_one(&queue_apps(4, f, &["a", "b", "c"], &["c"]))
        .unwrap();
    s.append_one(&message(5, 1, f, 3)).unwrap();
    assert_eq!(s.queue_apps(f), Some(names(&["a", "b", "c"])));
    assert_eq!(
        waiting(&s),
        vec![
            (1, names(&["b"])),
            (2, names(&["a", "b"])),
            (3, names(&["a", "b", "c"]))
        ]
    );
    // Remove "b": done with 1 and 2 at once for the rebuilt queues, for the index once settled.
    s.append_one(&queue_apps(6, f, &["a", "c"], &[])).unwrap();
    s.append_one(&message(7, 1, f, 4)).unwrap();
    assert_eq!(s.queue_apps(f), Some(names(&["a", "c"])));
    assert_eq!(
        waiting(&s),
        vec![
            (2, names(&["a"])),
            (3, names(&["a", "c"])),
            (4, names(&["a", "c"]))
        ]
    );
    assert_eq!(s.stats().outstanding, 4, "not settled");
    s.set_base(7);
    assert_eq!(s.stats().outstanding, 3, "message 1 waited for b alone");
    // A confirm of the removed app finds no slot: it changes nothing.
    s.append_one(&confirm(8, 1, f, 3, "b")).unwrap();
    s.set_base(8);
    let before = waiting(&s);
    assert_eq!(before.len(), 3);
    s.sync().unwrap();
    let (records, _) = s.read_from(0, usize::MAX, u64::MAX, false).unwrap();
    drop(s);
    // The domain now lists a and c; the records are held, so a restart agrees.
    let apps_now: AppsOf = Arc::new(|_: &str| names(&["a", "c"]));
    let s = Store::open(dir.path(), cfg(1 << 20), apps_now.clone()).unwrap();
    assert_eq!(waiting(&s), before);
    assert_eq!(s.queue_apps(f), Some(names(&["a", "c"])));
    // So does a replica that receives the records as frames, whatever its domain says.
    let replica_dir = tempfile::tempdir().unwrap();
    let mut r = Store::open(replica_dir.path(), cfg(1 << 20), apps_now).unwrap();
    let frames = encode_frames(&records);
    r.append_framed(&FramedBatch::split(&frames).unwrap(), 0, 0, 8)
        .unwrap();
    assert_eq!(waiting(&r), before);
    assert_eq!(r.queue_apps(f), Some(names(&["a", "c"])));
}

/// A queue first read through a message has the slots the domain lists now; a later record
/// that adds one of them makes every earlier message done with it, so an app added after a
/// message was stored does not get it after a restart, nor on a replica whose domain already
/// listed the app when the queue's first message came.
#[test]
fn an_added_app_the_domain_already_listed_skips_earlier_messages() {
    let dir = tempfile::tempdir().unwrap();
    let f = "bmq://d/fanout";
    let abc: AppsOf = Arc::new(|_: &str| names(&["a", "b", "c"]));
    let mut s = Store::open(dir.path(), cfg(1 << 20), abc).unwrap();
    s.append_one(&message(1, 1, f, 1)).unwrap();
    s.append_one(&queue_apps(2, f, &["a", "b", "c"], &["c"]))
        .unwrap();
    s.append_one(&message(3, 1, f, 2)).unwrap();
    let expected = vec![(1, names(&["a", "b"])), (2, names(&["a", "b", "c"]))];
    assert_eq!(waiting(&s), expected, "the rebuild sees it before the base");
    s.set_base(3);
    assert_eq!(waiting(&s), expected);
    // Every app of message 1 but the added one confirms: it is done.
    s.append_one(&confirm(4, 1, f, 1, "a")).unwrap();
    s.append_one(&confirm(5, 1, f, 1, "b")).unwrap();
    s.set_base(5);
    assert_eq!(waiting(&s), vec![(2, names(&["a", "b", "c"]))]);
}

/// A truncated `StoredQueueApps` takes its change with it: the removed app waits again for
/// the earlier messages, the added one is gone.
#[test]
fn a_truncated_queue_apps_record_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let f = "bmq://d/fanout";
    s.append_one(&message(1, 1, f, 1)).unwrap();
    s.set_base(1);
    s.append_one(&queue_apps(2, f, &["a", "c"], &["c"]))
        .unwrap();
    assert_eq!(waiting(&s), vec![(1, names(&["a"]))]);
    s.truncate_after(1).unwrap();
    assert_eq!(s.queue_apps(f), Some(names(&["a", "b"])));
    assert_eq!(waiting(&s), vec![(1, names(&["a", "b"]))]);
    s.append_one(&message(2, 2, f, 2)).unwrap();
    assert_eq!(
        waiting(&s),
        vec![(1, names(&["a", "b"])), (2, names(&["a", "b"]))]
    );
}

/// A restart that no longer holds the record (deleted with its settled dead segment) reads
/// the older messages with the apps the domain lists now: the added app gets them too (the
/// documented approximation), the removed one does not.
#[test]
fn a_restart_without_the_record_uses_the_domains_apps() {
    let dir = tempfile::tempdir().unwrap();
    let f = "bmq://d/fanout";
    let mut s = open(dir.path(), 600);
    s.append_one(&message(1, 1, f, 1)).unwrap();
    // The record in a segment of its own, then settled dead records until that one goes.
    let seq = append_until_roll_over(&mut s, 1);
    s.append_one(&queue_apps(seq + 1, f, &["a", "c"], &["c"]))
        .unwrap();
    let (_, done) = put_confirm_and_settle(&mut s, seq + 1, 20);
    assert!(done.deleted > 0, "{done:?}");
    assert_eq!(waiting(&s)[0], (1, names(&["a"])));
    s.sync().unwrap();
    drop(s);
    let apps_now: AppsOf = Arc::new(|uri: &str| {
        if uri.contains("fanout") {
            names(&["a", "c"])
        } else {
            vec![String::new()]
        }
    });
    let s = Store::open(dir.path(), cfg(600), apps_now).unwrap();
    let w: Vec<_> = waiting(&s).into_iter().filter(|(g, _)| *g == 1).collect();
    assert_eq!(w, vec![(1, names(&["a", "c"]))]);
}

/// Closed segments whose records are all dead and settled are deleted; the floor rises; a
/// restart reads only what remains and agrees on the state.
#[test]
fn dead_settled_segments_are_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1024);
    let mut seq = 0;
    for n in 1..=40 {
        seq += 1;
        s.append_one(&message(seq, 1, Q, n)).unwrap();
        seq += 1;
        s.append_one(&confirm(seq, 1, Q, n, "")).unwrap();
    }
    seq += 1;
    s.append_one(&message(seq, 1, Q, 99)).unwrap();
    s.sync().unwrap();
    let before = s.stats();
    assert!(before.segments > 5, "{before:?}");
    // Nothing settled: nothing may go.
    assert_eq!(maintain(&mut s), Maintenance::default());
    s.set_base(seq);
    let m = maintain(&mut s);
    assert_eq!(m.deleted, before.segments - 1, "{m:?}");
    let after = s.stats();
    assert_eq!(after.segments, 1);
    assert!(after.floor >= 70, "{after:?}");
    assert_eq!(outstanding_guids(&s), vec![99]);
    drop(s);
    let s = open(dir.path(), 1024);
    assert_eq!(outstanding_guids(&s), vec![99]);
    assert_eq!(s.last_sequence(), seq);
    assert_eq!(s.stats().floor, after.floor);
    assert_eq!(
        s.runs(),
        vec![LeaseRun {
            lease: 1,
            first_sequence: 1
        }]
    );
}

/// With deferred closing, the files of deleted segments are handed to the caller (to close on
/// another thread) instead of being closed by `maintain`; their names are gone already (the
/// first one became the spare).
#[test]
fn deleted_segments_files_are_handed_over_when_closing_is_deferred() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1024);
    s.set_defer_close(true);
    let seq = put_and_confirm(&mut s, 20);
    s.sync().unwrap();
    let segments = s.stats().segments;
    assert!(segments > 2, "{segments}");
    assert!(s.take_closed_files().is_empty());
    s.set_base(seq);
    let m = maintain(&mut s);
    assert_eq!(m.deleted, segments - 1);
    let closed = s.take_closed_files();
    assert!(!closed.is_empty());
    let names = journal_entries(dir.path());
    assert_eq!(
        names, segments,
        "deleted segments are renamed until finished"
    );
    closed.finish().unwrap();
    let names = journal_entries(dir.path());
    assert_eq!(
        names, 2,
        "only the active segment and the spare are left on disk"
    );
}

/// `ClosedFiles::finish` cuts the deleted segments it closes: after it, the blocks are free
/// even though a handle to the file is still open elsewhere (here, the test's); the one kept
/// as the spare keeps its name and its blocks.
#[test]
fn finishing_closed_files_frees_the_deleted_segments_blocks() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 64 * 1024);
    s.set_defer_close(true);
    let seq = put_and_confirm(&mut s, 2000);
    s.sync().unwrap();
    // The closed segments, full: keep handles of our own to look at them after the close.
    let files = s.files();
    let closed: Vec<File> = files[..files.len() - 1]
        .iter()
        .map(|(path, _, _)| OpenOptions::new().read(true).open(path).unwrap())
        .collect();
    assert!(closed.len() > 1);
    assert!(closed.iter().all(|f| f.metadata().unwrap().blocks() > 0));
    s.set_base(seq);
    assert_eq!(maintain(&mut s).deleted, closed.len());
    // The store's handles are the only other ones: `finish` holds the last of its own and cuts.
    s.take_closed_files().finish().unwrap();
    let states: Vec<(u64, u64)> = closed
        .iter()
        .map(|f| {
            let meta = f.metadata().unwrap();
            (meta.nlink(), meta.blocks())
        })
        .collect();
    let spares = states.iter().filter(|(links, _)| *links == 1).count();
    assert_eq!(spares, 1, "{states:?}");
    assert!(
        states
            .iter()
            .all(|&(links, blocks)| (links == 1 && blocks > 0) || (links, blocks) == (0, 0)),
        "freed before their close, but the spare: {states:?}"
    );
}

/// A deleted full segment is kept as the spare and the next roll-over writes over it (same
/// inode, blocks already allocated, format 3); after a restart the recycled segment's records
/// end where this life's end, with the earlier life's records after them ignored and cut.
#[test]
fn a_deleted_segment_is_recycled_and_its_old_records_are_never_read_back() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1024);
    let (seq, m) = put_confirm_and_settle(&mut s, 0, 40);
    assert!(m.deleted > 1);
    let spare = spare_path(dir.path());
    let spare_inode = std::fs::metadata(&spare).unwrap().ino();
    let spare_len = std::fs::metadata(&spare).unwrap().len();
    assert!(spare_len >= 1024);
    // Fill the active segment until it rolls over into the spare, then two messages more.
    let mut seq = append_until_roll_over(&mut s, seq);
    for _ in 0..2 {
        seq += 1;
        s.append_one(&message(seq, 1, Q, seq)).unwrap();
    }
    s.sync().unwrap();
    assert!(!spare.exists(), "the spare became the new segment");
    let (path, _, written) = s.files().last().cloned().unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.ino(), spare_inode);
    assert_eq!(
        meta.len(),
        spare_len,
        "written over, not cut: its old records follow"
    );
    assert!(written < spare_len);
    let outstanding = outstanding_guids(&s);
    drop(s);
    let s = open_fsync(dir.path(), 1024);
    assert_eq!(s.last_sequence(), seq);
    assert_eq!(outstanding_guids(&s), outstanding);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        written,
        "the earlier life's bytes are cut at open"
    );
}

/// With recycling off, a deleted segment is removed (no spare), and a spare an earlier run
/// left is removed at open.
#[test]
fn without_recycling_no_spare_is_kept_and_an_old_one_goes_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let strict = StoreConfig {
        recycle: false,
        ..cfg(1024)
    };
    let mut s = Store::open(dir.path(), strict, apps()).unwrap();
    let (seq, m) = put_confirm_and_settle(&mut s, 0, 40);
    assert!(m.deleted > 1);
    let spare = spare_path(dir.path());
    assert!(!spare.exists());
    drop(s);
    // Recycling on: a spare is kept; then off again: it goes at open.
    let mut s = open(dir.path(), 1024);
    let (seq, m) = put_confirm_and_settle(&mut s, seq, 40);
    assert!(m.deleted > 1);
    assert!(spare.exists());
    drop(s);
    let s = Store::open(dir.path(), strict, apps()).unwrap();
    assert!(!spare.exists());
    assert_eq!(s.last_sequence(), seq);
}

/// In a recycled segment, what follows this life's records may be an earlier life's records
/// that check out (length, checksum, a marker covering as far): a marker written to another
/// segment and a record of an earlier position end the segment's records, and nothing they
/// say (the lease runs, the positions) is taken.
#[test]
fn an_earlier_lifes_marker_and_records_after_a_recycled_segments_own_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1024);
    let (seq, _) = put_confirm_and_settle(&mut s, 0, 40);
    append_until_roll_over(&mut s, seq);
    s.sync().unwrap();
    let (path, _, written) = s.files().last().cloned().unwrap();
    let n = s.segments.last().unwrap().no;
    let runs = s.runs();
    let last = s.last_sequence();
    let base = s.base();
    drop(s);
    // What an earlier life might have left right after this life's records: a marker of the
    // segment it was then (covering this far, other lease runs), and a record of a position
    // held already.
    for stale in [
        marker_record(StoredMarker {
            base,
            covered_through: last,
            runs: vec![LeaseRun {
                lease: 9,
                first_sequence: 1,
            }],
            segment: n - 3,
        }),
        message(last - 1, 1, Q, 77_777),
    ] {
        let mut buf = Vec::new();
        frame(&stale, &mut buf);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&buf, written).unwrap();
        drop(file);
        let s = open_fsync(dir.path(), 1024);
        assert_eq!(s.last_sequence(), last);
        assert_eq!(s.runs(), runs);
        assert!(!outstanding_guids(&s).contains(&u128::from(77_777u64)));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), written);
    }
}

/// A settled segment is deleted only once a durable marker says it is settled (a restart must
/// know its positions are absent on purpose): `maintain` writes the marker without an fsync
/// and deletes after the sync that covers it. A `.deleted` file left by a crash before the
/// closer removed it is removed at open.
#[test]
fn segments_go_only_after_a_durable_marker_and_leftovers_go_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1024);
    s.set_defer_close(true);
    let seq = put_and_confirm(&mut s, 20);
    s.sync().unwrap();
    let segments = s.stats().segments;
    s.set_base(seq);
    assert_eq!(s.maintain().unwrap().deleted, 0, "no durable marker yet");
    assert!(s.maintenance_due(), "{:?}", s.stats());
    assert!(s.needs_sync());
    let ticket = s.begin_sync().unwrap().expect("the marker to fsync");
    assert_eq!(s.maintain().unwrap().deleted, 0, "its fsync still runs");
    let result = ticket.run();
    s.complete_sync(ticket, result).unwrap();
    assert_eq!(s.maintain().unwrap().deleted, segments - 1);
    // A crash before the closer thread removed the renamed files.
    drop(s.take_closed_files());
    drop(s);
    let leftovers = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with(".deleted")
        })
        .count();
    assert_eq!(leftovers, segments - 2, "all but the spare");
    let s = open_fsync(dir.path(), 1024);
    assert_eq!(
        journal_entries(dir.path()),
        2,
        "the active segment and the spare"
    );
    assert_eq!(s.last_sequence(), seq);
    assert!(outstanding_guids(&s).is_empty());
}

/// A closed segment holding a few live records among many dead ones is compacted once the dead
/// bytes pass a segment; the live records stay readable, across a restart too.
#[test]
fn sparse_segments_are_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, kept, _) = sparse_store(dir.path(), false);
    let bytes = s.stats().bytes;
    let mut compacted = 0;
    for _ in 0..20 {
        let m = maintain(&mut s);
        compacted += m.compacted;
        if m == Maintenance::default() {
            break;
        }
    }
    assert!(compacted > 0);
    assert!(s.stats().bytes < bytes / 2, "{:?} from {bytes}", s.stats());
    check_kept(&s, &kept);
    drop(s);
    check_kept(&open(dir.path(), 2048), &kept);
}

/// The outstanding messages of `s` are exactly `kept` (`(guid, sequence)`), each readable at
/// its sequence.
fn check_kept(s: &Store, kept: &[(u128, u64)]) {
    for (n, sequence) in kept {
        let r = s.read(*sequence).unwrap().expect("live record kept");
        let Some(RecordKind::Message(m)) = r.kind else {
            panic!("a message")
        };
        assert_eq!(guid_key(&m.guid), *n);
    }
    let want: Vec<u128> = kept.iter().map(|(n, _)| *n).collect();
    assert_eq!(outstanding_guids(s), want);
}

/// A compaction whose live records pass the chunk it writes at a time (megabytes of them)
/// streams them to the new file: every live record is readable at its new place, across a
/// restart too.
#[test]
fn a_compaction_larger_than_its_write_chunk_keeps_every_live_record() {
    let dir = tempfile::tempdir().unwrap();
    let segment = 8 << 20;
    let mut s = open(dir.path(), segment);
    let (kept, _) = fill_sparse(&mut s, 2400, 3, 10_000);
    let mut compacted = 0;
    for _ in 0..20 {
        let m = maintain(&mut s);
        compacted += m.compacted;
        if m == Maintenance::default() {
            break;
        }
    }
    assert!(compacted > 0);
    let check = |s: &Store| {
        for (n, sequence) in &kept {
            let r = s.read(*sequence).unwrap().expect("live record kept");
            let Some(RecordKind::Message(m)) = r.kind else {
                panic!("a message")
            };
            assert_eq!(guid_key(&m.guid), *n);
            assert_eq!(m.payload, Bytes::from(vec![*n as u8; 10_000]));
        }
    };
    check(&s);
    let want: Vec<u128> = kept.iter().map(|(n, _)| *n).collect();
    assert_eq!(outstanding_guids(&s), want);
    drop(s);
    let s = open(dir.path(), segment);
    assert_eq!(outstanding_guids(&s), want);
    check(&s);
}

/// A store (compacting in the background or not) whose closed segments are sparse: 60
/// messages, every tenth left outstanding, the rest confirmed, all settled. Returns the store,
/// the kept `(guid, sequence)` pairs and the last position.
fn sparse_store(dir: &Path, background: bool) -> (Store, Vec<(u128, u64)>, u64) {
    let mut s = open(dir, 2048);
    s.set_background_compaction(background);
    let (kept, seq) = fill_sparse(&mut s, 60, 10, 100);
    (s, kept, seq)
}

/// Appends `count` messages of `payload` bytes to an empty store, each followed by its confirm
/// but every `keep_every`-th, syncs and settles everything. Returns the kept
/// `(guid, sequence)` pairs and the last position.
fn fill_sparse(
    s: &mut Store,
    count: u64,
    keep_every: u64,
    payload: usize,
) -> (Vec<(u128, u64)>, u64) {
    let mut seq = 0;
    let mut kept = Vec::new();
    for n in 1..=count {
        seq += 1;
        let mut m = message(seq, 1, Q, n);
        if let Some(RecordKind::Message(msg)) = &mut m.kind {
            msg.payload = Bytes::from(vec![n as u8; payload]);
        }
        s.append_one(&m).unwrap();
        if n % keep_every == 0 {
            kept.push((u128::from(n), seq));
        } else {
            seq += 1;
            s.append_one(&confirm(seq, 1, Q, n, "")).unwrap();
        }
    }
    s.sync().unwrap();
    s.set_base(seq);
    (kept, seq)
}

/// The first compaction `maintain` leaves to the caller, with the syncs that make its marker
/// durable in between, as a partition runs them.
fn first_compaction(s: &mut Store) -> CompactionTicket {
    for _ in 0..5 {
        s.maintain().unwrap();
        if let Some(ticket) = s.take_compaction() {
            return ticket;
        }
        s.sync().unwrap();
    }
    panic!("no compaction of a sparse segment: {:?}", s.stats());
}

/// Names of the compactions' copies left in `dir`.
fn copies_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".compact"))
        .collect()
}

/// In the background, a compaction's copy runs while the store goes on: records are read
/// from the old file meanwhile, a message confirmed during the copy is dead in the new
/// segment (and its confirm kept with it), the copy waits for the marker of its base to be
/// durable, and once in place every live record reads back, across a restart too.
#[test]
fn a_background_compaction_is_put_in_place_while_the_store_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, mut kept, mut seq) = sparse_store(dir.path(), true);
    let bytes = s.stats().bytes;
    let ticket = first_compaction(&mut s);
    assert!(s.take_compaction().is_none(), "taken once");
    // Meanwhile: all but the last kept message are confirmed (settled after the copy,
    // before it is put in place), one more is written, and the kept ones still read from
    // the old file.
    for (gone, _) in kept.drain(..kept.len() - 1) {
        seq += 1;
        s.append_one(&confirm(seq, 1, Q, gone as u64, "")).unwrap();
    }
    seq += 1;
    s.append_one(&message(seq, 1, Q, 1000)).unwrap();
    kept.push((1000, seq));
    for (_, sequence) in &kept {
        assert!(s.read(*sequence).unwrap().is_some());
    }
    let done = ticket.run();
    assert_eq!(copies_in(dir.path()).len(), 1);
    // The marker of the copy's base is not durable yet: the copy waits.
    let waiting = s.complete_compaction(done).unwrap();
    assert_eq!(waiting.compacted, 0);
    assert!(s.maintenance_due());
    s.sync().unwrap();
    s.set_base(seq);
    s.check_accounting().unwrap();
    let installed = s.maintain().unwrap();
    assert_eq!(installed.compacted, 1, "{installed:?}");
    assert!(installed.freed_bytes > 0);
    assert!(copies_in(dir.path()).is_empty());
    assert!(s.stats().bytes < bytes, "{:?} from {bytes}", s.stats());
    s.check_accounting().unwrap();
    check_kept(&s, &kept);
    // The rest compacts and deletes in turn, each copy run as the partition would.
    for _ in 0..40 {
        s.maintain().unwrap();
        if let Some(t) = s.take_compaction() {
            s.complete_compaction(t.run()).unwrap();
        }
        s.sync().unwrap();
        s.check_accounting().unwrap();
    }
    check_kept(&s, &kept);
    drop(s);
    check_kept(&open(dir.path(), 2048), &kept);
}

/// A copy that finds a record no longer checking out fails with the corruption named; its
/// file is removed and the segment stays as it was (chosen again later).
#[test]
fn a_failed_compaction_copy_leaves_the_segment_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, kept, _) = sparse_store(dir.path(), true);
    let ticket = first_compaction(&mut s);
    // Flip a byte of every kept record on disk (the copy reads the file, not the cache).
    for (_, sequence) in &kept {
        let (si, ri) = s.locate(*sequence).unwrap();
        let seg = &s.segments[si];
        let held = seg.records[ri];
        let at = u64::from(held.offset) + u64::from(held.len()) - 1;
        let mut b = [0u8];
        seg.file.read_exact_at(&mut b, at).unwrap();
        seg.file.write_all_at(&[b[0] ^ 0xff], at).unwrap();
    }
    let err = s.complete_compaction(ticket.run()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(copies_in(dir.path()).is_empty());
    s.check_accounting().unwrap();
    s.sync().unwrap();
    s.maintain().unwrap();
    assert!(s.take_compaction().is_some(), "chosen again");
}

/// Only segments that a healing truncation cannot make active are compacted; and should a
/// segment under compaction become active all the same, its copy is given up, so nothing
/// appended there is lost when the copy completes.
#[test]
fn a_segment_a_truncation_makes_active_is_not_replaced_by_its_copy() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 2048);
    s.set_background_compaction(true);
    let mut seq = 0;
    let mut n = 0;
    // Sparse segments, until a fresh active segment holds exactly one message.
    while s.segments.len() < 5 || s.segments.last().unwrap().records.len() != 1 {
        n += 1;
        seq += 1;
        s.append_one(&message(seq, 1, Q, n)).unwrap();
        if n % 10 != 0 && s.segments.len() < 5 {
            seq += 1;
            s.append_one(&confirm(seq, 1, Q, n, "")).unwrap();
        }
    }
    s.sync().unwrap();
    // Settled up to the end of the last closed segment; the active one starts above.
    let closed = s.segments.len() - 2;
    let last_closed = s.segments[closed].last_sequence().unwrap();
    s.set_base(last_closed);
    for _ in 0..4 {
        s.maintain().unwrap();
        s.sync().unwrap();
        if let Some(t) = s.take_compaction() {
            let no = s.compacting.as_ref().unwrap().segment();
            assert_ne!(
                no, s.segments[closed].no,
                "the last closed segment stays as it is"
            );
            s.complete_compaction(t.run()).unwrap();
        }
    }
    // Compacting it anyway, then a truncation at the base removes the active segment.
    let no = s.segments[closed].no;
    let ticket = s.begin_compaction(no);
    s.truncate_after(last_closed).unwrap();
    assert_eq!(
        s.segments.last().unwrap().no,
        no,
        "the compacted segment is active"
    );
    s.append_one(&message(last_closed + 1, 2, Q, 9999)).unwrap();
    s.sync().unwrap();
    let report = s.complete_compaction(ticket.run()).unwrap();
    assert_eq!(report, Maintenance::default());
    s.maintain().unwrap();
    assert!(copies_in(dir.path()).is_empty());
    s.check_accounting().unwrap();
    assert!(s.read(last_closed + 1).unwrap().is_some());
    let want = outstanding_guids(&s);
    assert!(want.contains(&9999));
    drop(s);
    let s = open(dir.path(), 2048);
    assert_eq!(outstanding_guids(&s), want);
}

/// A copy that finishes after an install replaced the journal is discarded: its file is
/// removed and nothing of the new journal changes.
#[test]
fn a_compaction_copy_outlived_by_an_install_is_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let (mut s, _, _) = sparse_store(dir.path(), true);
    let ticket = first_compaction(&mut s);
    let mut staged = s.begin_install().unwrap();
    staged
        .append(&[message(500, 2, Q, 5)], 500, 499, None)
        .unwrap();
    s.finish_install(staged).unwrap();
    let report = s.complete_compaction(ticket.run()).unwrap();
    assert_eq!(report, Maintenance::default());
    assert!(copies_in(dir.path()).is_empty());
    assert_eq!(outstanding_guids(&s), vec![5]);
    drop(s);
    let s = open(dir.path(), 2048);
    assert_eq!(outstanding_guids(&s), vec![5]);
}

/// Healing's truncation drops the positions after the cut, their effects included, durably.
#[test]
fn truncate_after_forgets_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 512);
    for n in 1..=6 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    s.append_one(&confirm(7, 1, Q, 1, "")).unwrap();
    s.sync().unwrap();
    s.truncate_after(3).unwrap();
    assert_eq!(s.last_sequence(), 3);
    assert_eq!(outstanding_guids(&s), vec![1, 2, 3]);
    s.append_one(&message(4, 2, Q, 40)).unwrap();
    s.sync().unwrap();
    assert_eq!(
        s.runs(),
        vec![
            LeaseRun {
                lease: 1,
                first_sequence: 1
            },
            LeaseRun {
                lease: 2,
                first_sequence: 4
            }
        ]
    );
    drop(s);
    let s = open(dir.path(), 512);
    assert_eq!(outstanding_guids(&s), vec![1, 2, 3, 40]);
    assert_eq!(s.last_sequence(), 4);
}

/// An fsync run off the store (a ticket) makes durable what was held when it began, not the
/// appends made while it ran; those wait for the next one.
#[test]
fn a_sync_ticket_covers_what_was_held_when_it_began() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1 << 20);
    for n in 1..=3 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    let ticket = s.begin_sync().unwrap().expect("records to fsync");
    assert_eq!(ticket.through(), 3);
    assert_eq!(s.durable(), 0, "nothing is durable before the fsync ran");
    s.append_one(&message(4, 1, Q, 4)).unwrap();
    let result = ticket.run();
    assert_eq!(s.complete_sync(ticket, result).unwrap(), 3);
    assert_eq!(s.durable(), 3);
    assert!(s.needs_sync(), "position 4 still waits for an fsync");
    assert_eq!(s.sync().unwrap(), 4);
    assert!(!s.needs_sync());
    assert!(s.begin_sync().unwrap().is_none(), "nothing left to fsync");
}

/// A truncation while a ticket's fsync runs voids the ticket: the positions it named may
/// hold other records by the time it finishes, so it makes nothing durable.
#[test]
fn a_truncation_voids_a_sync_ticket_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1 << 20);
    for n in 1..=5 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    let ticket = s.begin_sync().unwrap().expect("records to fsync");
    s.truncate_after(2).unwrap();
    assert_eq!(s.durable(), 2);
    s.append_one(&message(3, 2, Q, 30)).unwrap();
    s.append_one(&message(4, 2, Q, 40)).unwrap();
    let result = ticket.run();
    assert_eq!(s.complete_sync(ticket, result).unwrap(), 2);
    assert!(s.needs_sync());
    assert_eq!(s.sync().unwrap(), 4);
}

/// A failed fsync is an error and makes nothing durable (the caller stops the node: an fsync
/// is never retried).
#[test]
fn a_failed_sync_ticket_makes_nothing_durable() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1 << 20);
    s.append_one(&message(1, 1, Q, 1)).unwrap();
    let ticket = s.begin_sync().unwrap().expect("a record to fsync");
    let failed = Err(std::io::Error::other("EIO"));
    assert!(matches!(
        s.complete_sync(ticket, failed),
        Err(StoreError::Io { .. })
    ));
    assert_eq!(s.durable(), 0);
}

/// A torn last record is cut at open; a bad record followed by more data is corruption.
#[test]
fn torn_tail_is_cut_and_corruption_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for n in 1..=3 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    s.sync().unwrap();
    let (path, _, len) = s.files().pop().unwrap();
    drop(s);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 5).unwrap();
    let s = open(dir.path(), 1 << 20);
    assert_eq!(s.last_sequence(), 2);
    drop(s);
    // Flip a byte in the first record's body.
    let mut data = std::fs::read(&path).unwrap();
    let at = data.len() - 200;
    data[at] ^= 0xff;
    std::fs::write(&path, &data).unwrap();
    match Store::open(dir.path(), cfg(1 << 20), apps()) {
        Err(StoreError::Corrupt { .. }) => {}
        other => panic!("expected corruption, got {other:?}"),
    }
}

/// A replica further behind than the primary's floor receives the live state into a staged
/// journal; until it is complete its own journal stands; once installed it holds exactly the
/// outstanding messages, with the primary's lease runs, across a restart.
#[test]
fn install_replaces_the_journal_only_when_complete() {
    let src_dir = tempfile::tempdir().unwrap();
    let mut src = open(src_dir.path(), 1024);
    let mut seq = 0;
    for n in 1..=50 {
        seq += 1;
        let lease = if n < 25 { 1 } else { 2 };
        src.append_one(&message(seq, lease, Q, n)).unwrap();
        if n % 7 != 0 {
            seq += 1;
            src.append_one(&confirm(seq, lease, Q, n, "")).unwrap();
        }
    }
    src.sync().unwrap();
    src.set_base(seq - 3);
    while maintain(&mut src) != Maintenance::default() {}
    assert!(src.floor() > 10);

    let dst_dir = tempfile::tempdir().unwrap();
    let mut dst = open(dst_dir.path(), 1024);
    dst.append_one(&message(1, 1, Q, 1)).unwrap();
    dst.sync().unwrap();

    let mut staged = dst.begin_install().unwrap();
    let mut after = 0;
    let mut batches = 0;
    loop {
        let (records, covered) = src.read_from(after, 3, 1 << 20, true).unwrap();
        staged
            .append(&records, covered, src.base(), Some(&src.runs()))
            .unwrap();
        after = covered;
        batches += 1;
        if batches == 2 {
            // A crash in the middle: the replica restarts with its own journal.
            let again = open(dst_dir.path(), 1024);
            assert_eq!(again.last_sequence(), 1);
            drop(again);
            staged = dst.begin_install().unwrap();
            after = 0;
        }
        if after >= src.last_sequence() {
            break;
        }
    }
    assert!(batches > 3);
    dst.finish_install(staged).unwrap();
    assert_eq!(outstanding_guids(&dst), outstanding_guids(&src));
    assert_eq!(dst.last_sequence(), src.last_sequence());
    assert_eq!(dst.runs(), src.runs());
    dst.append_one(&message(seq + 1, 2, Q, 500)).unwrap();
    dst.sync().unwrap();
    drop(dst);
    let dst = open(dst_dir.path(), 1024);
    let mut want = outstanding_guids(&src);
    want.push(500);
    assert_eq!(outstanding_guids(&dst), want);
    assert_eq!(dst.runs(), src.runs());
}

/// An install committed (`COMPLETE` written) but not moved when the node crashed is finished
/// at open.
#[test]
fn a_committed_install_is_finished_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1024);
    s.append_one(&message(1, 1, Q, 1)).unwrap();
    s.sync().unwrap();
    let mut staged = s.begin_install().unwrap();
    staged.append(&[message(5, 2, Q, 5)], 5, 4, None).unwrap();
    staged.sync().unwrap();
    std::fs::write(dir.path().join(INSTALL_DIR).join(INSTALL_COMPLETE), b"").unwrap();
    drop(staged);
    drop(s);
    let s = open(dir.path(), 1024);
    assert_eq!(outstanding_guids(&s), vec![5]);
    assert!(!dir.path().join(INSTALL_DIR).exists());
}

/// Segments written by version 1 (consecutive records, no markers) are read.
#[test]
fn version_1_segments_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut buf = Vec::new();
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&1u32.to_le_bytes());
    frame(&message(1, 1, Q, 1), &mut buf);
    frame(&confirm(2, 1, Q, 1, ""), &mut buf);
    frame(&message(3, 1, Q, 3), &mut buf);
    std::fs::write(segment_path(dir.path(), 1), &buf).unwrap();
    let mut s = open(dir.path(), 1 << 20);
    assert_eq!(s.last_sequence(), 3);
    assert_eq!(outstanding_guids(&s), vec![3]);
    s.append_one(&message(4, 2, Q, 4)).unwrap();
    s.sync().unwrap();
    drop(s);
    let s = open(dir.path(), 1 << 20);
    assert_eq!(outstanding_guids(&s), vec![3, 4]);
}

/// Reading after the cache falls back to the disk with the same result.
#[test]
fn reads_agree_between_cache_and_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for n in 1..=100 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    assert!(s.stats().cache_bytes <= 4096);
    let (records, covered) = s.read_from(0, 1000, u64::MAX, false).unwrap();
    assert_eq!(covered, 100);
    let seqs: Vec<u64> = records.iter().map(|r| r.sequence).collect();
    assert_eq!(seqs, (1..=100).collect::<Vec<_>>());
    let (records, covered) = s.read_from(10, 5, u64::MAX, false).unwrap();
    assert_eq!(covered, 15);
    assert_eq!(records.first().unwrap().sequence, 11);
    for n in [1, 50, 100] {
        assert_eq!(s.read(n).unwrap().unwrap(), message(n, 1, Q, n));
    }
}

#[test]
fn frames_stream_from_the_cache_and_append_as_received() {
    // Recent records are read as the journal holds them (encoded once); a second
    // journal appends those frames as received, byte for byte, and reads them back alike, from
    // its write-behind buffer before the sync and from disk after a reopen.
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for n in 1..=10 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    let (frames, covered) = s.read_frames_from(4, 3, u64::MAX).unwrap();
    assert_eq!(covered, 7);
    let split = FramedBatch::split(&frames).unwrap();
    let seqs: Vec<u64> = (0..split.len()).map(|i| split.sequence(i)).collect();
    assert_eq!(seqs, vec![5, 6, 7]);
    assert_eq!(
        frames,
        encode_frames(&[
            message(5, 1, Q, 5),
            message(6, 1, Q, 6),
            message(7, 1, Q, 7)
        ])
    );
    // To the end: covers the last position.
    let (_, covered) = s.read_frames_from(8, 100, u64::MAX).unwrap();
    assert_eq!(covered, 10);
    assert_eq!(s.read_frames_from(10, 100, u64::MAX), None);

    let other = tempfile::tempdir().unwrap();
    let mut r = open(other.path(), 1 << 20);
    let (all, _) = s.read_frames_from(0, 100, u64::MAX).unwrap();
    r.append_framed(&FramedBatch::split(&all).unwrap(), 0, 0, 0)
        .unwrap();
    assert_eq!(r.read(3).unwrap().unwrap(), message(3, 1, Q, 3));
    let (from_buffer, _) = r.read_from(0, 100, u64::MAX, false).unwrap();
    let records: Vec<JournalRecord> = (1..=10).map(|n| message(n, 1, Q, n)).collect();
    assert_eq!(from_buffer, records);
    r.sync().unwrap();
    drop(r);
    let r = open(other.path(), 1 << 20);
    assert_eq!(r.last_sequence(), 10);
    assert_eq!(r.read(10).unwrap().unwrap(), message(10, 1, Q, 10));
    let path = &r.files()[0].0;
    let on_disk = std::fs::read(path).unwrap();
    assert!(
        on_disk.ends_with(&all),
        "the frames are written as received"
    );
}

#[test]
fn a_replica_writes_received_frames_without_caching_them() {
    // Scenario: a node was primary (its records cached), then follows another primary whose
    // frames it appends (rolling over segments on the way), then is primary again. The frames
    // are written as received and not cached; the earlier cache is emptied (the cache holds a
    // suffix of the journal); every record reads back, from the write-behind buffer, the disk
    // or the cache, and only the second primary stint's records are streamed from the cache.
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        cache_bytes_max: 1 << 20,
        ..cfg(2048)
    };
    let mut s = Store::open(dir.path(), cfg, apps()).unwrap();
    for n in 1..=5 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    assert!(s.stats().cache_bytes > 0);
    // Two batches, the second overlapping the first (a partial resend: appended from its
    // first record above what is held).
    let received: Vec<JournalRecord> = (6..=20).map(|n| message(n, 2, Q, n)).collect();
    let first = encode_frames(&received);
    s.append_framed(&FramedBatch::split(&first).unwrap(), 0, 0, 0)
        .unwrap();
    let received: Vec<JournalRecord> = (15..=40).map(|n| message(n, 2, Q, n)).collect();
    let second = encode_frames(&received);
    let batch = FramedBatch::split(&second).unwrap();
    let from = batch.first_above(s.last_sequence());
    assert_eq!(from, 6);
    s.append_framed(&batch, from, 0, 0).unwrap();
    assert_eq!(s.stats().cache_bytes, 0, "a replica caches nothing");
    assert!(s.files().len() > 1, "the frames rolled the journal over");
    assert_eq!(
        s.read_frames_from(5, 100, u64::MAX),
        None,
        "nothing to stream from the cache"
    );
    let check = |s: &Store, through: u64| {
        for n in 1..=through {
            let lease = if n <= 5 {
                1
            } else if n <= 40 {
                2
            } else {
                3
            };
            assert_eq!(
                s.read(n).unwrap().unwrap(),
                message(n, lease, Q, n),
                "record {n}"
            );
        }
        let (from, _) = s.read_from(0, 1000, u64::MAX, false).unwrap();
        let seqs: Vec<u64> = from.iter().map(|r| r.sequence).collect();
        assert_eq!(seqs, (1..=through).collect::<Vec<_>>());
    };
    check(&s, 40);
    s.sync().unwrap();
    check(&s, 40);
    s.append_one(&message(41, 3, Q, 41)).unwrap();
    assert!(s.stats().cache_bytes > 0, "a primary's appends are cached");
    let (streamed, covered) = s.read_frames_from(40, 100, u64::MAX).unwrap();
    assert_eq!(
        (streamed, covered),
        (encode_frames(&[message(41, 3, Q, 41)]), 41)
    );
    check(&s, 41);
    s.sync().unwrap();
    drop(s);
    let s = open(dir.path(), 2048);
    check(&s, 41);
}

#[test]
fn bad_frames_are_refused() {
    // Frames from the network are checked: a truncated one, a checksum mismatch, a length
    // beyond the data, a marker.
    let good = encode_frames(&[message(1, 1, Q, 1), message(2, 1, Q, 2)]);
    assert_eq!(FramedBatch::split(&good).unwrap().len(), 2);
    assert!(FramedBatch::split(&good.slice(..good.len() - 1)).is_err());
    assert!(FramedBatch::split(&good.slice(..5)).is_err());
    let mut flipped = good.to_vec();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(FramedBatch::split(&Bytes::from(flipped)).is_err());
    let mut long = good.to_vec();
    long[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(FramedBatch::split(&Bytes::from(long)).is_err());
    let marker = JournalRecord {
        kind: Some(RecordKind::Marker(StoredMarker::default())),
        ..Default::default()
    };
    assert!(FramedBatch::split(&encode_frames(&[marker])).is_err());
    assert_eq!(FramedBatch::split(&Bytes::new()).unwrap().len(), 0);
}

#[test]
fn write_behind_reaches_the_file_at_sync() {
    // Appends within the segment's reservation wait in memory until the sync (one write);
    // a reopen without the sync finds what was written before, as after a power loss.
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    s.append_one(&message(1, 1, Q, 1)).unwrap();
    s.sync().unwrap();
    let (path, _, written) = s.files().pop().unwrap();
    s.append_one(&message(2, 1, Q, 2)).unwrap();
    assert_eq!(
        s.files().pop().unwrap().2,
        written,
        "not written before the sync"
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), written);
    assert_eq!(s.read(2).unwrap().unwrap(), message(2, 1, Q, 2));
    drop(s);
    let mut s = open(dir.path(), 1 << 20);
    assert_eq!(s.last_sequence(), 1);
    s.append_one(&message(2, 1, Q, 2)).unwrap();
    s.sync().unwrap();
    assert!(s.files().pop().unwrap().2 > written);
    drop(s);
    assert_eq!(open(dir.path(), 1 << 20).last_sequence(), 2);
}

/// The cache keeps its own copy of what it wrote: a record decoded from a large read buffer
/// (a client's or a peer's frame) does not keep that buffer alive once the caller drops it
/// (a cache of the records as decoded held far more in frame buffers than in messages;
/// docs/bench/JOURNAL.md, "Storage for months").
#[test]
fn the_cache_holds_no_slice_of_the_callers_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let read_buffer = Bytes::from(vec![7u8; 64 * 1024]);
    let mut record = message(1, 1, Q, 1);
    if let Some(RecordKind::Message(m)) = &mut record.kind {
        m.guid = read_buffer.slice(0..16);
        m.payload = read_buffer.slice(16..1040);
    }
    s.append_one(&record).unwrap();
    drop(record);
    assert!(
        read_buffer.is_unique(),
        "the cache still refers to the caller's buffer"
    );
    let read = s.read(1).unwrap().unwrap();
    match read.kind {
        Some(RecordKind::Message(m)) => {
            assert_eq!(m.payload, read_buffer.slice(16..1040));
            assert_eq!(m.guid, read_buffer.slice(0..16));
        }
        other => panic!("{other:?}"),
    }
    assert!(s.stats().cache_bytes > 1040, "counted as framed");
}

#[derive(Debug, Clone)]
enum Op {
    Put,
    Confirm(usize),
    Settle,
    /// `maintain`; `true`: the closer thread finishes the deleted files at once.
    Maintain(bool),
    Sync,
    /// Issue a sync ticket (as the partition hands one to its sync thread), if none is out.
    BeginSync,
    /// Run the ticket that is out and record its outcome.
    CompleteSync,
    Truncate(u64),
    Reopen,
    /// Run the copy of the compaction that is out (as the compaction thread does), if any.
    CopyCompaction,
    /// Hand the finished copy back, if any.
    CompleteCompaction,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Put),
        4 => (0usize..64).prop_map(Op::Confirm),
        1 => Just(Op::Settle),
        1 => any::<bool>().prop_map(Op::Maintain),
        1 => Just(Op::Sync),
        2 => Just(Op::BeginSync),
        2 => Just(Op::CompleteSync),
        1 => any::<u64>().prop_map(Op::Truncate),
        1 => Just(Op::Reopen),
        2 => Just(Op::CopyCompaction),
        2 => Just(Op::CompleteCompaction),
    ]
}

/// [`op`] weighted towards what leads to compactions: messages confirmed, the base raised,
/// maintenance, and the copy run and handed back at any point between other operations.
fn compaction_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Put),
        6 => (0usize..64).prop_map(Op::Confirm),
        2 => Just(Op::Settle),
        3 => any::<bool>().prop_map(Op::Maintain),
        2 => Just(Op::Sync),
        1 => Just(Op::BeginSync),
        1 => Just(Op::CompleteSync),
        3 => Just(Op::CopyCompaction),
        3 => Just(Op::CompleteCompaction),
        1 => any::<u64>().prop_map(Op::Truncate),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(std::env::var("BMQ_STORE_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)))]

    /// A crash at any point (every file cut back to a length between what was fsynced and
    /// what was written, or for a recycled segment, the bytes after that point lost in place)
    /// loses no message that was durable and unconfirmed, and brings back no
    /// message whose confirm was durable — deletions and compactions included, with fsyncs
    /// run as the partition runs them (a ticket out while appends go on, deleted segments
    /// removed later by another thread or not at all before the crash).
    #[test]
    fn crash_keeps_durable_state(ops in proptest::collection::vec(op(), 1..200), cut in any::<u64>(), defer in any::<bool>(), background in any::<bool>()) {
        crash_model(ops, cut, defer, background)?;
    }

    /// The same with compactions copied on "another thread": the copy runs and is handed back
    /// at any point between appends, confirms, syncs, truncations and restarts.
    #[test]
    fn crash_keeps_durable_state_with_background_compactions(ops in proptest::collection::vec(compaction_op(), 100..500), cut in any::<u64>(), defer in any::<bool>()) {
        crash_model(ops, cut, defer, true)?;
    }
}

/// The crash model of `crash_keeps_durable_state`: runs `ops` on a store with real fsyncs
/// (`defer`: deleted segments' files handed over, as the partition does; `background`:
/// compactions copied when the ops say, as the partition's compaction thread does), crashes
/// (files cut back at random between what was fsynced and what was written, from `cut`),
/// reopens and checks.
fn crash_model(ops: Vec<Op>, cut: u64, defer: bool, background: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        fsync: true,
        ..cfg(700)
    };
    let open = |dir: &Path, _| {
        let mut s = Store::open(dir, cfg, apps()).expect("open");
        s.set_defer_close(defer);
        s.set_background_compaction(background);
        s
    };
    let mut s = open(dir.path(), 700);
    let mut ticket: Option<SyncTicket> = None;
    let mut copy: Option<CompactionTicket> = None;
    let mut copied: Option<CompactionDone> = None;
    let mut unfinished = Vec::new();
    let mut seq = 0;
    let mut next = 1u64;
    // guid -> (message sequence, confirm sequence)
    let mut messages: Vec<(u64, u64, Option<u64>)> = Vec::new();
    for op in ops {
        match op {
            Op::Put => {
                seq += 1;
                s.append_one(&message(seq, 1, Q, next)).unwrap();
                messages.push((next, seq, None));
                next += 1;
            }
            Op::Confirm(i) => {
                let open: Vec<usize> = (0..messages.len())
                    .filter(|j| messages[*j].2.is_none())
                    .collect();
                if let Some(j) = open.get(i % open.len().max(1)) {
                    seq += 1;
                    s.append_one(&confirm(seq, 1, Q, messages[*j].0, ""))
                        .unwrap();
                    messages[*j].2 = Some(seq);
                }
            }
            Op::Settle => s.set_base(s.durable()),
            Op::Maintain(finish) => {
                s.maintain().unwrap();
                if let Some(t) = s.take_compaction() {
                    prop_assert!(
                        copy.is_none() && copied.is_none(),
                        "one compaction at a time"
                    );
                    copy = Some(t);
                }
                let closed = s.take_closed_files();
                if finish {
                    closed.finish().unwrap();
                } else {
                    unfinished.push(closed);
                }
            }
            Op::Sync => {
                s.sync().unwrap();
            }
            Op::BeginSync => {
                if ticket.is_none() {
                    ticket = s.begin_sync().unwrap();
                }
            }
            Op::CompleteSync => {
                if let Some(t) = ticket.take() {
                    let result = t.run();
                    s.complete_sync(t, result).unwrap();
                }
            }
            Op::Truncate(r) => {
                let base = s.base();
                let cut = base + r % (s.last_sequence() - base + 1);
                s.truncate_after(cut).unwrap();
                seq = cut;
                messages.retain(|(_, m, _)| *m <= cut);
                for m in &mut messages {
                    if m.2.is_some_and(|c| c > cut) {
                        m.2 = None;
                    }
                }
            }
            Op::CopyCompaction => {
                if let Some(t) = copy.take() {
                    copied = Some(t.run());
                }
            }
            Op::CompleteCompaction => {
                if let Some(done) = copied.take() {
                    s.complete_compaction(done).unwrap();
                }
            }
            Op::Reopen => {
                // The process ends: a copy under way is lost (its file removed at open).
                copy = None;
                copied = None;
                if let Some(t) = ticket.take() {
                    let result = t.run();
                    s.complete_sync(t, result).unwrap();
                }
                s.sync().unwrap();
                drop(s);
                s = open(dir.path(), 700);
                prop_assert_eq!(s.last_sequence(), seq);
            }
        }
        prop_assert_eq!(s.check_accounting(), Ok(()));
    }
    let durable = s.durable();
    let mut rng = cut;
    for (path, synced, len) in s.files() {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let to = synced + (rng >> 33) % (len - synced + 1);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        if (rng >> 20) & 1 == 1 && file.metadata().unwrap().len() > len {
            // A recycled segment keeps its length: what was not fsynced is lost (zeros here),
            // and an earlier life's bytes follow.
            file.write_all_at(&vec![0; (len - to) as usize], to)
                .unwrap();
        } else {
            file.set_len(to).unwrap();
        }
    }
    drop(s);
    let s = open(dir.path(), 700);
    prop_assert!(s.last_sequence() >= durable);
    let out = outstanding_guids(&s);
    for (n, m, c) in &messages {
        let durable_message = *m <= durable;
        let durable_confirm = c.is_some_and(|c| c <= durable);
        // A confirm written but not fsynced may or may not survive.
        if durable_message && c.is_none() {
            prop_assert!(out.contains(&u128::from(*n)), "message {n} lost");
        }
        if durable_confirm {
            prop_assert!(
                !out.contains(&u128::from(*n)),
                "confirmed message {n} came back"
            );
        }
    }
    Ok(())
}

/// A batch with positions missing inside it (settled dead records the sender no longer holds,
/// as an install or a sync from a compacted journal carries) raises the floor to the highest
/// missing one, as a reopen finds it: a later read for a lagging replica must not skip them
/// silently (found by the replication simulator).
#[test]
fn positions_missing_inside_a_batch_raise_the_floor() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let u = "bmq://d/q";
    s.append(
        &[
            message(1, 1, u, 1),
            message(3, 1, u, 3),
            message(6, 1, u, 6),
        ],
        6,
        5,
        None,
    )
    .unwrap();
    assert_eq!(s.floor(), 5, "positions 2, 4 and 5 are absent");
    s.sync().unwrap();
    drop(s);
    let s = open(dir.path(), 1 << 20);
    assert_eq!(s.floor(), 5, "a reopen agrees");
}

/// Found by the crash model: a segment whose messages were dead only through a confirm above
/// the last durable marker's base was deleted; after a restart (base lower) a truncation cut
/// that confirm, and the message was gone. Segments are deleted only at a durable marker's
/// base at which they were dead.
#[test]
fn crash_model_deletion_waits_for_a_marker_at_its_base() {
    use Op::*;
    let ops = vec![
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Confirm(0),
        Put,
        Confirm(0),
        Confirm(0),
        Put,
        Confirm(0),
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Sync,
        Settle,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Truncate(2332743881183439948),
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Put,
        Truncate(2299358977469868244),
        Confirm(7),
        Put,
        Put,
        Put,
        Put,
        Truncate(2312606317640885647),
        Put,
        Put,
        Confirm(0),
        Put,
        Sync,
        Settle,
        Put,
        Maintain(false),
        Reopen,
        Put,
        Put,
        Put,
        Put,
        Put,
        Truncate(11896809042770883180),
    ];
    crash_model(ops, 0, false, false).unwrap();
}

/// Found by the crash model: segments were deleted while the active segment (holding the
/// only marker left) was new and not yet fsynced; a crash then lost every durable position.
/// Nothing is deleted while the active segment is fresh.
#[test]
fn crash_model_deletion_waits_for_a_durable_active_segment() {
    use Op::*;
    let ops = vec![
        Put,
        Put,
        Truncate(14771278014101809207),
        Put,
        Truncate(7542687684548049162),
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Reopen,
        Put,
        Put,
        Put,
        Settle,
        Put,
        Confirm(0),
        Put,
        Confirm(0),
        Confirm(0),
        Confirm(0),
        Put,
        Confirm(0),
        Confirm(0),
        Put,
        Truncate(17778577193022547494),
        Settle,
        Put,
        Truncate(1042956850135460696),
        Put,
        Maintain(false),
    ];
    crash_model(ops, 458394826046, false, false).unwrap();
}

/// The write-behind buffer keeps its chunks in order: a range read across chunk boundaries,
/// a cut inside a chunk, and one write of more chunks than a `pwritev` takes (`IOV_MAX`) all
/// give the bytes appended, in order.
#[test]
fn write_behind_chunks_read_cut_and_write_in_order() {
    let mut w = WriteBehind::default();
    let mut all = Vec::new();
    // More chunks than one `pwritev` takes (Linux's IOV_MAX, 1,024).
    for i in 0..(1024u32 * 2 + 7) {
        let chunk: Vec<u8> = (0..(i % 5))
            .map(|j| (i as u8).wrapping_add(j as u8))
            .collect();
        all.extend_from_slice(&chunk);
        w.push(Bytes::from(chunk));
    }
    assert_eq!(w.len(), all.len());
    assert_eq!(w.copy_range(3, 40).unwrap(), all[3..40].to_vec());
    assert_eq!(w.copy_range(0, all.len()).unwrap(), all);
    assert!(w.copy_range(0, all.len() + 1).is_none());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let file = crate::disk::RealDisk.open(&path, Open::Create).unwrap();
    w.write_at(&file, 5).unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[5..], &all[..]);
    w.truncate(1001);
    assert_eq!(w.len(), 1001);
    assert_eq!(w.copy_range(0, 1001).unwrap(), all[..1001].to_vec());
    w.truncate(0);
    assert!(w.is_empty());
}

/// A failed append leaves the journal as it was: records of a new lease whose second frame
/// cannot be written take back the lease run their first one started (the rollback removes
/// the runs the append added instead of restoring a copy taken before every append), and the
/// store appends and reopens as if the failure never happened.
#[test]
fn a_failed_append_takes_back_the_lease_run_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for seq in 1..=3 {
        s.append_one(&message(seq, 1, "bmq://d/q", seq)).unwrap();
    }
    let runs_before = s.runs();
    let records = [
        message(4, 2, "bmq://d/q", 4),
        confirm(5, 2, "bmq://d/q", 1, ""),
    ];
    let frames = encode_frames(&records);
    let batch = FramedBatch::split(&frames).unwrap();
    // The batch's frames go in one write: it fails after the records were checked.
    s.fail_writes_after = Some(0);
    assert!(s.append_framed(&batch, 0, 0, 0).is_err());
    assert_eq!(s.runs(), runs_before);
    assert_eq!((s.last_sequence(), s.last_lease()), (3, 1));
    assert_eq!(outstanding_guids(&s).len(), 3);
    s.fail_writes_after = Some(0);
    assert!(s.append_one(&records[0]).is_err());
    assert_eq!(s.runs(), runs_before);
    s.fail_writes_after = None;
    s.append_framed(&batch, 0, 0, 0).unwrap();
    s.sync().unwrap();
    let runs = |s: &Store| -> Vec<(u64, u64)> {
        s.runs()
            .iter()
            .map(|r| (r.lease, r.first_sequence))
            .collect()
    };
    assert_eq!(runs(&s), [(1, 1), (2, 4)]);
    assert_eq!(outstanding_guids(&s).len(), 3);
    s.check_accounting().unwrap();
    drop(s);
    let s = open(dir.path(), 1 << 20);
    assert_eq!(runs(&s), [(1, 1), (2, 4)]);
    assert_eq!(s.last_sequence(), 5);
    assert_eq!(outstanding_guids(&s).len(), 3);
}

/// Records read after a position are all there whatever segments follow theirs: a segment
/// without records (a fresh active one, only its marker) has no place in the order of
/// positions, and one right after the segment to read made the search for the first segment
/// skip it — a healing primary then sent a replica "nothing after 71, covered through 82", and
/// the replicas acknowledged records they never received (the replication simulator, seed
/// 4294967938 of 5 nodes: a strong ACK with one durable holder of five).
#[test]
fn read_from_finds_the_records_before_a_segment_of_only_markers() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    let records: Vec<JournalRecord> = (1..=3).map(|n| message(n, 1, "bmq://d/q", n)).collect();
    let frames = encode_frames(&records);
    // Appended as a replica appends (nothing cached): read back from the segment.
    s.append_framed(&FramedBatch::split(&frames).unwrap(), 0, 0, 0)
        .unwrap();
    s.roll_over().unwrap();
    assert_eq!(s.segments.len(), 2);
    assert!(s.segments[1].last_sequence().is_none(), "only its marker");
    for after in 0..3 {
        let (read, covered) = s.read_from(after, 100, u64::MAX, false).unwrap();
        let got: Vec<u64> = read.iter().map(|r| r.sequence).collect();
        assert_eq!(got, ((after + 1)..=3).collect::<Vec<_>>(), "after {after}");
        assert_eq!(covered, 3);
    }
}

/// A replica's batch that spans segments and fails after its first segment's frames were
/// written and indexed is taken back whole (index, lease runs, last position); appended again,
/// it reads back and reopens as if the failure never happened.
#[test]
fn a_framed_batch_failing_in_its_second_segment_is_taken_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 2048);
    s.append_one(&message(1, 1, Q, 1)).unwrap();
    let runs_before = s.runs();
    let records: Vec<JournalRecord> = (2..=40).map(|n| message(n, 2, Q, n)).collect();
    let frames = encode_frames(&records);
    let batch = FramedBatch::split(&frames).unwrap();
    s.fail_writes_after = Some(1);
    assert!(s.append_framed(&batch, 0, 0, 0).is_err());
    assert_eq!(s.runs(), runs_before);
    assert_eq!((s.last_sequence(), s.last_lease()), (1, 1));
    assert_eq!(outstanding_guids(&s).len(), 1);
    s.fail_writes_after = None;
    s.append_framed(&batch, 0, 0, 0).unwrap();
    assert!(s.files().len() > 1, "the batch spans segments");
    s.sync().unwrap();
    s.check_accounting().unwrap();
    assert_eq!(outstanding_guids(&s).len(), 40);
    drop(s);
    let s = open(dir.path(), 2048);
    assert_eq!((s.last_sequence(), s.last_lease()), (40, 2));
    for n in 2..=40 {
        assert_eq!(
            s.read(n).unwrap().unwrap(),
            message(n, 2, Q, n),
            "record {n}"
        );
    }
}

#[test]
fn decoded_and_framed_records_to_append_skip_alike() {
    // `Appending` is one view of both forms a replica receives: the same positions, the same
    // skip of what is held already, from any starting record of a framed batch.
    let records: Vec<JournalRecord> = (5..=7).map(|n| message(n, 1, Q, n)).collect();
    let frames = encode_frames(&records);
    let batch = FramedBatch::split(&frames).unwrap();
    for (decoded, framed) in [
        (Appending::Records(&records), Appending::Frames(&batch, 0)),
        (
            Appending::Records(&records[1..]),
            Appending::Frames(&batch, 1),
        ),
        (
            Appending::Records(&records[3..]),
            Appending::Frames(&batch, 3),
        ),
    ] {
        for view in [decoded, framed] {
            assert_eq!(view.len(), decoded.len());
            let positions: Vec<u64> = (0..view.len()).map(|i| view.position(i).0).collect();
            let expected: Vec<u64> = (0..decoded.len()).map(|i| decoded.position(i).0).collect();
            assert_eq!(positions, expected);
            for held in 0..10 {
                let first = view.first_above(held);
                assert_eq!(first, decoded.first_above(held), "held {held}");
                let rest = view.skip(first);
                assert_eq!(rest.len(), view.len() - first);
                assert!(rest.is_empty() || rest.position(0).0 > held);
            }
            assert!(view.skip(10).is_empty());
        }
    }
}

/// A last segment whose end is zeros — its length made durable but not the data written
/// there, as a crash after a failed fsync leaves it — opens with the zeros cut, as a torn
/// tail; zeros inside a closed segment are corruption, reported with file and offset.
#[test]
fn a_zero_filled_tail_is_cut_and_zeros_inside_a_closed_segment_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1 << 20);
    for n in 1..=3 {
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    s.sync().unwrap();
    let (path, _, len) = s.files().pop().unwrap();
    drop(s);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len + 816).unwrap();
    let mut s = open(dir.path(), 1 << 20);
    assert_eq!(s.last_sequence(), 3);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        len,
        "the zeros are cut"
    );
    s.append_one(&message(4, 1, Q, 4)).unwrap();
    s.sync().unwrap();
    drop(s);
    assert_eq!(open(dir.path(), 1 << 20).last_sequence(), 4);

    // Zeros where a closed segment's records were.
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), 1024);
    let mut n = 0;
    while s.files().len() < 3 {
        n += 1;
        s.append_one(&message(n, 1, Q, n)).unwrap();
    }
    s.sync().unwrap();
    let (first, _, _) = s.files()[0].clone();
    drop(s);
    let mut data = std::fs::read(&first).unwrap();
    let at = data.len() - 150;
    data[at..].fill(0);
    std::fs::write(&first, &data).unwrap();
    match Store::open(dir.path(), cfg(1024), apps()) {
        Err(e @ StoreError::Corrupt { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&first.display().to_string()), "{text}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

/// In a recycled last segment, a record whose checksum fails but that is followed by an intact
/// record of this life was damaged in place (a torn write ends what was written): corruption,
/// not a tail to cut — the records from there may have been acknowledged.
#[test]
fn a_record_damaged_in_place_in_a_recycled_last_segment_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_fsync(dir.path(), 1024);
    let (seq, _) = put_confirm_and_settle(&mut s, 0, 40);
    let mut seq = append_until_roll_over(&mut s, seq);
    for _ in 0..3 {
        seq += 1;
        s.append_one(&message(seq, 1, Q, seq)).unwrap();
    }
    s.sync().unwrap();
    let (path, _, written) = s.files().last().cloned().unwrap();
    let first = s.segments.last().unwrap().records[0];
    assert!(s.segments.last().unwrap().recycled);
    drop(s);
    // A byte inside the body of the segment's first record (more follow it).
    let mut data = std::fs::read(&path).unwrap();
    let at = first.offset as usize + RECORD_HEADER_LEN + 20;
    assert!((at as u64) < written);
    data[at] ^= 0x10;
    std::fs::write(&path, &data).unwrap();
    match Store::open(dir.path(), cfg(1024), apps()) {
        Err(StoreError::Corrupt {
            path: p, offset, ..
        }) => {
            assert_eq!(p, path);
            assert_eq!(offset, u64::from(first.offset));
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

/// A sim-disk store with real fsyncs, 4 KiB segments.
fn open_sim(disk: &crate::disk::SimDisk, dir: &Path) -> Result<Store, StoreError> {
    let cfg = StoreConfig {
        fsync: true,
        ..cfg(4096)
    };
    Store::open_or_quarantine(Arc::new(disk.clone()), dir, cfg, apps())
}

/// A journal found corrupt at open is set aside (its files under `corrupt/`), and the store
/// opens empty, marked as needing an install, with the primary-lease mark of before; the mark
/// and the marker survive a power loss; clearing the marker is durable.
#[test]
fn a_corrupt_journal_is_set_aside_and_the_node_starts_empty_needing_an_install() {
    let disk = crate::disk::SimDisk::new();
    let dir = Path::new("/journal");
    let mut s = open_sim(&disk, dir).unwrap();
    assert!(!s.needs_install());
    s.note_primary_lease(3);
    let mut seq = 0;
    while s.files().len() < 3 {
        seq += 1;
        s.append_one(&message(seq, 3, Q, seq)).unwrap();
        s.sync().unwrap();
    }
    let closed = s.files()[0].0.clone();
    drop(s);
    // A bit of the first (closed) segment's first record.
    disk.flip_bit(&closed, HEADER_LEN + RECORD_HEADER_LEN as u64 + 5, 3)
        .unwrap();
    assert!(matches!(
        Store::open_on(Arc::new(disk.clone()), dir, cfg(4096), apps()),
        Err(StoreError::Corrupt { .. })
    ));
    let s = open_sim(&disk, dir).unwrap();
    assert!(s.needs_install());
    assert_eq!(s.last_sequence(), 0);
    assert!(s.outstanding().is_empty());
    assert_eq!(
        s.primary_lease_mark(),
        3,
        "the mark stays beside the journal"
    );
    let aside = dir.join(QUARANTINE_DIR);
    let kept = disk.files();
    assert!(
        kept.iter().filter(|p| p.starts_with(&aside)).count() >= 3,
        "the corrupt journal's segments are kept aside: {kept:?}"
    );
    drop(s);
    disk.power_loss(|_| (0, None));
    let mut s = open_sim(&disk, dir).unwrap();
    assert!(s.needs_install(), "the marker is durable");
    assert_eq!(s.primary_lease_mark(), 3);
    s.clear_needs_install().unwrap();
    drop(s);
    disk.power_loss(|_| (0, None));
    assert!(!open_sim(&disk, dir).unwrap().needs_install());
}

/// The primary-lease mark is made durable by the sync that covers the lease's first record,
/// not before: a power loss before that sync keeps the earlier mark.
#[test]
fn the_primary_lease_mark_is_durable_with_the_sync_that_covers_the_first_record() {
    let disk = crate::disk::SimDisk::new();
    let dir = Path::new("/journal");
    let mut s = open_sim(&disk, dir).unwrap();
    s.note_primary_lease(2);
    s.append_one(&message(1, 2, Q, 1)).unwrap();
    s.sync().unwrap();
    s.note_primary_lease(5);
    s.append_one(&message(2, 5, Q, 2)).unwrap();
    // Written, not fsynced.
    let ticket = s.begin_sync().unwrap().expect("a ticket");
    drop(ticket);
    drop(s);
    disk.power_loss(|_| (0, None));
    let mut s = open_sim(&disk, dir).unwrap();
    assert_eq!(s.primary_lease_mark(), 2);
    assert_eq!(s.last_sequence(), 1);
    s.note_primary_lease(5);
    s.append_one(&message(2, 5, Q, 2)).unwrap();
    s.sync().unwrap();
    drop(s);
    disk.power_loss(|_| (0, None));
    assert_eq!(open_sim(&disk, dir).unwrap().primary_lease_mark(), 5);
}
