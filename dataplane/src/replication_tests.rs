//! Step-by-step tests of the replication core: exact outputs for each input.

use super::*;
use crate::store::{encode_frames, guid_key, AppsOf, StoreConfig};
use bmq_proto::peer::journal_record::Kind as RecordKind;
use bmq_proto::peer::{LeaseRun, StoredConfirm};
use std::sync::Arc;

const P: PartitionId = PartitionId(0);

fn cfg(me: u32) -> ReplicationConfig {
    ReplicationConfig {
        self_id: NodeId(me),
        partition: P,
        members: vec![NodeId(1), NodeId(2), NodeId(3)],
        quorum: 2,
        batch_records_max: 100,
        in_flight_records_max: 1000,
        resend_after: Duration::from_millis(500),
        guid_window_max: 1000,
        guid_window_age: Duration::from_secs(60),
        in_sync_timeout: Duration::from_secs(10),
    }
}

/// A replication core with its journal in a temporary directory (removed on drop).
struct Node {
    core: ReplicationCore,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Node {
    type Target = ReplicationCore;
    fn deref(&self) -> &ReplicationCore {
        &self.core
    }
}

impl std::ops::DerefMut for Node {
    fn deref_mut(&mut self) -> &mut ReplicationCore {
        &mut self.core
    }
}

fn apps() -> AppsOf {
    Arc::new(|_: &str| vec![String::new()])
}

/// Node `me` whose journal holds `records` (durable), in segments of `segment` bytes.
fn node_with(me: u32, records: Vec<JournalRecord>, segment: u64) -> Node {
    node_on_disk(me, records, segment, false)
}

/// [`node_with`], with real fsyncs when `fsync` (so that a sync leaves a [`SyncTicket`]).
fn node_on_disk(me: u32, records: Vec<JournalRecord>, segment: u64, fsync: bool) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let cfg_store = StoreConfig {
        segment_size_max: segment,
        cache_bytes_max: 1 << 20,
        quota_bytes: 0,
        recycle: true,
        fsync,
    };
    let mut store = Store::open(dir.path(), cfg_store, apps()).unwrap();
    store.append(&records, 0, 0, None).unwrap();
    store.sync().unwrap();
    Node {
        core: ReplicationCore::new(cfg(me), store),
        _dir: dir,
    }
}

fn node(me: u32, records: Vec<JournalRecord>) -> Node {
    node_with(me, records, 1 << 20)
}

/// Every record the node's journal holds, in order.
fn records(core: &ReplicationCore) -> Vec<JournalRecord> {
    core.store()
        .read_from(0, usize::MAX, u64::MAX, false)
        .unwrap()
        .0
}

fn producer() -> SessionAddr {
    SessionAddr {
        origin_node: NodeId(3),
        session_id: 9,
    }
}

/// A PUT of `producer()` to `bmq://d/q` with GUID `guid(n)` and payload `x`, strong or
/// eventual.
fn put(core: &mut ReplicationCore, now: Instant, n: u8, strong: bool) -> PutResult {
    core.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(n),
        Bytes::from_static(b"x"),
        vec![],
        strong,
        0,
    )
}

fn guid(n: u8) -> Bytes {
    Bytes::from(vec![n; 16])
}

fn rec(lease: u64, sequence: u64) -> JournalRecord {
    JournalRecord {
        lease,
        sequence,
        timestamp_ms: 0,
        kind: Some(RecordKind::Message(StoredMessage {
            uri: "bmq://d/q".into(),
            guid: guid(sequence as u8),
            payload: Bytes::from_static(b"x"),
            properties: vec![],
        })),
    }
}

/// A journal of `runs`: (lease, how many records).
fn journal(runs: &[(u64, u64)]) -> Vec<JournalRecord> {
    let mut out = Vec::new();
    for (lease, count) in runs {
        for _ in 0..*count {
            let seq = out.len() as u64 + 1;
            out.push(rec(*lease, seq));
        }
    }
    out
}

fn drain(core: &mut ReplicationCore) -> Vec<Output> {
    std::iter::from_fn(|| core.poll_output()).collect()
}

fn shape_of(runs: &[(u64, u64)], last: u64) -> JournalShape {
    JournalShape {
        runs: runs
            .iter()
            .map(|(lease, first)| LeaseRun {
                lease: *lease,
                first_sequence: *first,
            })
            .collect(),
        last_sequence: last,
        floor: 0,
    }
}

fn msg(kind: MsgKind) -> PartitionMessage {
    PartitionMessage { kind: Some(kind) }
}

/// Runs `core`'s outputs as a shell would with a perfect disk: syncs at once and returns
/// the sends and acks.
fn run_shell(now: Instant, core: &mut ReplicationCore) -> Vec<Output> {
    let mut rest = Vec::new();
    loop {
        rest.extend(drain(core));
        if !core.needs_sync() {
            return rest;
        }
        core.sync(now).unwrap();
    }
}

/// Delivers every Send among `cores` (indexed by node id - 1) until quiet, skipping nodes in
/// `down`. Returns the acks seen.
fn settle(now: Instant, cores: &mut [Node], down: &[u32]) -> Vec<Output> {
    let mut acks = Vec::new();
    for _ in 0..1000 {
        let mut sends = Vec::new();
        for (i, core) in cores.iter_mut().enumerate() {
            if down.contains(&(i as u32 + 1)) {
                drain(core);
                continue;
            }
            for o in run_shell(now, core) {
                match o {
                    Output::Send { to, message } => sends.push((NodeId(i as u32 + 1), to, message)),
                    other => acks.push(other),
                }
            }
        }
        if sends.is_empty() {
            return acks;
        }
        for (from, to, message) in sends {
            if !down.contains(&to.0) {
                cores[to.0 as usize - 1].handle_message(now, from, message);
            }
        }
    }
    panic!("network did not settle within 1000 rounds");
}

/// Three empty cores; node 1 is primary of lease 1 and active.
fn active_cluster(now: Instant) -> Vec<Node> {
    let mut cores: Vec<_> = (1..=3).map(|n| node(n, vec![])).collect();
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    }
    let outs = settle(now, &mut cores, &[]);
    assert_eq!(outs, vec![Output::Active { lease: LeaseId(1) }]);
    cores
}

#[test]
fn common_prefix_follows_lease_runs() {
    // Journals agree up to where their leases first differ (log matching).
    let a = shape_of(&[(1, 1), (2, 4)], 6);
    let b = shape_of(&[(1, 1)], 5);
    assert_eq!(common_prefix(&a, &b), 3);
    assert_eq!(common_prefix(&a, &a), 6);
    assert_eq!(common_prefix(&a, &shape_of(&[], 0)), 0);
    assert_eq!(
        common_prefix(&shape_of(&[(1, 1)], 3), &shape_of(&[(1, 1)], 8)),
        3
    );
    assert_eq!(
        common_prefix(&shape_of(&[(2, 1)], 3), &shape_of(&[(1, 1)], 8)),
        0
    );
}

#[test]
fn new_primary_queries_every_member() {
    // A node named primary of lease 1 starts passive and asks the others for their journals.
    let now = Instant::now();
    let mut core = node(1, vec![]);
    core.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    let query = |to| Output::Send {
        to: NodeId(to),
        message: msg(MsgKind::StateQuery(ReplicaStateQuery {
            partition_id: 0,
            lease: 1,
        })),
    };
    assert_eq!(drain(&mut core), vec![query(2), query(3)]);
    assert_eq!(core.phase(), Some(&PrimaryPhase::Collecting));
}

fn receipt(sequence: u64, lease: u64) -> PartitionMessage {
    msg(MsgKind::Receipt(Receipt {
        partition_id: 0,
        lease,
        sequence,
    }))
}

fn settled(to: u32, lease: u64, prev: u64, base: u64) -> Output {
    Output::Send {
        to: NodeId(to),
        message: msg(MsgKind::Replicate(ReplicateRecords {
            partition_id: 0,
            lease,
            prev_sequence: prev,
            records: vec![],
            covered_through: 0,
            settled_through: base,
            framed_records: Bytes::new(),
        })),
    }
}

#[test]
fn strong_put_is_acked_at_quorum_receipt() {
    // DESIGN.md §7 strong consistency: no ACK on the primary's own fsync, ACK on the first
    // replica receipt (2 of 3); the position is settled once every in-sync replica has it
    // (node 3 receipted the lease's first record, so it is in sync and waited for).
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    // Record 1 is the lease's first record (committed when the primary went active).
    let r = put(&mut core, now, 2, true);
    assert_eq!(r, PutResult::Appended { sequence: 2 });
    let rec2 = rec(1, 2);
    let replicate = |to| Output::Send {
        to: NodeId(to),
        message: msg(MsgKind::Replicate(ReplicateRecords {
            partition_id: 0,
            lease: 1,
            prev_sequence: 1,
            records: vec![],
            covered_through: 2,
            settled_through: 1,
            // Fresh records stream as the journal holds them, encoded once.
            framed_records: encode_frames(std::slice::from_ref(&rec2)),
        })),
    };
    // Streamed at once, before the primary's own fsync.
    assert_eq!(drain(&mut core), vec![replicate(2), replicate(3)]);
    assert_eq!(records(&core)[1], rec2);
    core.sync(now).unwrap();
    assert_eq!(
        drain(&mut core),
        vec![],
        "no ACK on the primary's fsync alone"
    );
    core.handle_message(now, NodeId(2), receipt(2, 1));
    assert_eq!(
        drain(&mut core),
        vec![Output::Ack {
            producer: producer(),
            uri: "bmq://d/q".into(),
            guid: guid(2)
        }]
    );
    assert_eq!(core.committed(), 2);
    assert_eq!(core.store().base(), 1, "node 3 is in sync and lacks it");
    core.handle_message(now, NodeId(3), receipt(2, 1));
    assert_eq!(
        drain(&mut core),
        vec![settled(2, 1, 2, 2), settled(3, 1, 2, 2)]
    );
    assert_eq!(core.store().base(), 2);
}

/// A replica receipts a record only once its fsync has finished when the fsync runs off the
/// core (`begin_sync` / `complete_sync`, the shell's sync thread), and records that arrive
/// while it runs wait for the next fsync (DESIGN.md §7: a receipt means durable).
#[test]
fn replica_receipts_only_after_its_fsync_ticket_completes() {
    let now = Instant::now();
    let mut cores: Vec<Node> = (1..=3)
        .map(|n| node_on_disk(n, vec![], 1 << 20, n == 2))
        .collect();
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    }
    assert_eq!(
        settle(now, &mut cores, &[]),
        vec![Output::Active { lease: LeaseId(1) }]
    );
    let put_to_node_2 = |cores: &mut [Node], n: u8| {
        put(&mut cores[0], now, n, true);
        cores[0].sync(now).unwrap();
        for o in drain(&mut cores[0]) {
            if let Output::Send { to, message } = o {
                if to == NodeId(2) {
                    cores[1].handle_message(now, NodeId(1), message);
                }
            }
        }
    };
    put_to_node_2(&mut cores, 1);
    assert_eq!(drain(&mut cores[1]), vec![], "no receipt before an fsync");
    // Record 1 is the lease's first record, durable since the primary went active.
    let ticket = cores[1].begin_sync(now).unwrap().expect("an fsync to run");
    assert_eq!(ticket.through(), 2);
    assert_eq!(
        drain(&mut cores[1]),
        vec![],
        "no receipt while the fsync runs"
    );
    put_to_node_2(&mut cores, 2);
    assert_eq!(drain(&mut cores[1]), vec![]);
    let result = ticket.run();
    cores[1].complete_sync(now, ticket, result).unwrap();
    let receipt_to_1 = |sequence| Output::Send {
        to: NodeId(1),
        message: receipt(sequence, 1),
    };
    assert_eq!(drain(&mut cores[1]), vec![receipt_to_1(2)]);
    assert!(cores[1].needs_sync(), "record 3 waits for the next fsync");
    cores[1].sync(now).unwrap();
    assert_eq!(drain(&mut cores[1]), vec![receipt_to_1(3)]);
}

#[test]
fn eventual_put_is_acked_once_the_primary_holds_it() {
    // DESIGN.md §7 eventual consistency: the primary's own fsync releases the ACK.
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    put(&mut core, now, 1, false);
    drain(&mut core);
    core.sync(now).unwrap();
    assert_eq!(
        acks(drain(&mut core)),
        vec![Output::Ack {
            producer: producer(),
            uri: "bmq://d/q".into(),
            guid: guid(1)
        }]
    );
}

#[test]
fn duplicate_guid_is_stored_once_and_acked_with_the_first_copy() {
    // A proxy resends a PUT after a timeout (same session), and a client that reconnected
    // elsewhere resends it (another session): neither copy is appended; each session gets one
    // ACK when the record is committed; a copy after that is ACKed at once.
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    let other = SessionAddr {
        origin_node: NodeId(2),
        session_id: 4,
    };
    assert_eq!(core.duplicate_of(now, &guid(1)), None);
    let r = put(&mut core, now, 1, true);
    // Record 1 is the lease's first record.
    assert_eq!(r, PutResult::Appended { sequence: 2 });
    drain(&mut core);
    let resend = |core: &mut ReplicationCore, producer: SessionAddr| {
        let sequence = core.duplicate_of(now, &guid(1)).expect("a resend");
        core.wait_for_stored(producer, "bmq://d/q".into(), guid(1), true, sequence);
    };
    resend(&mut core, producer());
    resend(&mut core, other);
    assert_eq!(drain(&mut core), vec![]);
    assert_eq!(core.last_sequence(), 2);
    core.sync(now).unwrap();
    core.handle_message(now, NodeId(3), receipt(2, 1));
    let ack = |producer| Output::Ack {
        producer,
        uri: "bmq://d/q".into(),
        guid: guid(1),
    };
    let outs = acks(drain(&mut core));
    assert_eq!(outs[..2], [ack(producer()), ack(other)]);
    resend(&mut core, producer());
    assert_eq!(drain(&mut core), vec![ack(producer())]);
}

#[test]
fn passive_primary_refuses_puts() {
    // Until healed, PUTs are answered NOT_READY so the proxy keeps them for retransmission.
    let now = Instant::now();
    let mut core = node(1, vec![]);
    core.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    let r = core.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(1),
        Bytes::new(),
        vec![],
        true,
        0,
    );
    assert_eq!(r, PutResult::NotReady);
}

#[test]
fn healing_pulls_from_the_most_advanced_member() {
    // Node 2 becomes primary of lease 2 holding (lease 1: 1..2); node 3 holds (lease 1: 1..4);
    // node 1 (the old primary) is dead. Node 2 must pull 3..4 from node 3 before going active.
    let now = Instant::now();
    let mut primary = node(2, journal(&[(1, 2)]));
    let mut replica = node(3, journal(&[(1, 4)]));
    primary.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    replica.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    // The primary-lease mark is made durable before the primary changes a replica.
    primary.sync(now).unwrap();
    drain(&mut primary);
    replica.handle_message(
        now,
        NodeId(2),
        msg(MsgKind::StateQuery(ReplicaStateQuery {
            partition_id: 0,
            lease: 2,
        })),
    );
    let response = drain(&mut replica);
    assert_eq!(
        response,
        vec![Output::Send {
            to: NodeId(2),
            message: msg(MsgKind::StateResponse(ReplicaStateResponse {
                needs_install: false,
                partition_id: 0,
                lease: 2,
                shape: Some(shape_of(&[(1, 1)], 4)),
            }))
        }]
    );
    let Output::Send { message, .. } = response[0].clone() else {
        unreachable!()
    };
    primary.handle_message(now, NodeId(3), message);
    let pull = drain(&mut primary);
    assert_eq!(
        pull,
        vec![Output::Send {
            to: NodeId(3),
            message: msg(MsgKind::Pull(PullRecords {
                partition_id: 0,
                lease: 2,
                shape: Some(shape_of(&[(1, 1)], 2)),
                install_covered: 0,
            }))
        }]
    );
    let Output::Send { message, .. } = pull[0].clone() else {
        unreachable!()
    };
    replica.handle_message(now, NodeId(2), message);
    let answer = drain(&mut replica);
    let sync = SyncRecords {
        partition_id: 0,
        lease: 2,
        truncate_after: 2,
        records: vec![rec(1, 3), rec(1, 4)],
        sender_last_sequence: 4,
        covered_through: 4,
        runs: shape_of(&[(1, 1)], 4).runs,
        ..Default::default()
    };
    assert_eq!(
        answer,
        vec![Output::Send {
            to: NodeId(2),
            message: msg(MsgKind::Sync(sync.clone()))
        }]
    );
    primary.handle_message(now, NodeId(3), msg(MsgKind::Sync(sync)));
    let outs = drain(&mut primary);
    // Whole, the primary appends its lease's first record (5), which leaves it once durable.
    assert_eq!(
        outs,
        vec![Output::Send {
            to: NodeId(3),
            message: msg(MsgKind::Sync(SyncRecords {
                partition_id: 0,
                lease: 2,
                truncate_after: 4,
                records: vec![],
                sender_last_sequence: 5,
                covered_through: 4,
                runs: shape_of(&[(1, 1), (2, 5)], 5).runs,
                ..Default::default()
            }))
        },]
    );
    assert_eq!(records(&primary)[..4], journal(&[(1, 4)])[..]);
    assert!(matches!(
        records(&primary)[4].kind,
        Some(RecordKind::LeaseStart(_))
    ));
    assert_eq!(primary.phase(), Some(&PrimaryPhase::Syncing));
    primary.sync(now).unwrap();
    let outs = drain(&mut primary);
    assert!(
        matches!(&outs[..], [Output::Send { to, message }] if *to == NodeId(3) && matches!(&message.kind, Some(MsgKind::Replicate(r)) if r.prev_sequence == 4 && r.covered_through == 5)),
        "{outs:?}"
    );
    primary.handle_message(now, NodeId(3), receipt(4, 2));
    assert_eq!(
        drain(&mut primary),
        vec![],
        "not active before a quorum holds record 5"
    );
    primary.handle_message(now, NodeId(3), receipt(5, 2));
    assert_eq!(
        drain(&mut primary),
        vec![Output::Active { lease: LeaseId(2) }, settled(3, 2, 5, 5)]
    );
}

#[test]
fn healing_truncates_unacknowledged_records_of_an_older_lease() {
    // Node 3 holds (lease 1: 1..5), but records 4..5 reached no quorum: the new primary of
    // lease 2 healed with node 1 at (lease 1: 1..3) and wrote (lease 2: 4). When node 3 shows
    // its journal, it is told to drop everything after 3 and take record 4 of lease 2.
    let now = Instant::now();
    let mut primary = node(2, journal(&[(1, 3)]));
    let mut replica = node(3, journal(&[(1, 5)]));
    primary.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    primary.sync(now).unwrap();
    drain(&mut primary);
    primary.handle_message(
        now,
        NodeId(1),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            needs_install: false,
            partition_id: 0,
            lease: 2,
            shape: Some(shape_of(&[(1, 1)], 3)),
        })),
    );
    drain(&mut primary);
    primary.sync(now).unwrap();
    drain(&mut primary);
    // Record 4 is lease 2's first record: active once node 1 holds it.
    primary.handle_message(now, NodeId(1), receipt(4, 2));
    assert_eq!(
        drain(&mut primary),
        vec![Output::Active { lease: LeaseId(2) }, settled(1, 2, 4, 4)]
    );
    put(&mut primary, now, 5, true);
    primary.sync(now).unwrap();
    drain(&mut primary);
    primary.handle_message(
        now,
        NodeId(3),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            needs_install: false,
            partition_id: 0,
            lease: 2,
            shape: Some(replica.shape()),
        })),
    );
    let outs = drain(&mut primary);
    let lease_start = records(&primary)[3].clone();
    let new5 = records(&primary)[4].clone();
    assert_eq!((lease_start.lease, new5.lease), (2, 2));
    let sync = SyncRecords {
        partition_id: 0,
        lease: 2,
        truncate_after: 3,
        records: vec![lease_start.clone(), new5.clone()],
        sender_last_sequence: 5,
        covered_through: 5,
        settled_through: 4,
        runs: shape_of(&[(1, 1), (2, 4)], 5).runs,
        ..Default::default()
    };
    assert_eq!(
        outs,
        vec![Output::Send {
            to: NodeId(3),
            message: msg(MsgKind::Sync(sync.clone()))
        }]
    );
    replica.handle_message(now, NodeId(2), msg(MsgKind::Sync(sync)));
    assert_eq!(drain(&mut replica), vec![]);
    let mut want = journal(&[(1, 3)]);
    want.extend([lease_start, new5]);
    assert_eq!(records(&replica), want);
    assert_eq!(replica.store().base(), 4);
    replica.sync(now).unwrap();
    assert_eq!(
        drain(&mut replica),
        vec![Output::Send {
            to: NodeId(2),
            message: msg(MsgKind::Receipt(Receipt {
                partition_id: 0,
                lease: 2,
                sequence: 5
            }))
        }]
    );
}

#[test]
fn replica_drops_records_of_a_stale_lease() {
    // After answering lease 2's query, a replica ignores lease 1's primary.
    let now = Instant::now();
    let mut replica = node(3, vec![]);
    replica.handle_message(
        now,
        NodeId(2),
        msg(MsgKind::StateQuery(ReplicaStateQuery {
            partition_id: 0,
            lease: 2,
        })),
    );
    drain(&mut replica);
    replica.handle_message(
        now,
        NodeId(1),
        msg(MsgKind::Replicate(ReplicateRecords {
            partition_id: 0,
            lease: 1,
            prev_sequence: 0,
            records: vec![rec(1, 1)],
            covered_through: 0,
            settled_through: 0,
            framed_records: Bytes::new(),
        })),
    );
    assert_eq!(drain(&mut replica), vec![]);
    assert_eq!(replica.last_sequence(), 0);
}

#[test]
fn primary_steps_down_when_a_higher_lease_is_named() {
    // A primary told that another node holds a higher lease becomes a replica at once.
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    core.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    assert_eq!(core.phase(), None);
    assert_eq!(core.lease(), LeaseId(2));
}

#[test]
fn every_acked_message_survives_the_primary_failing() {
    // 20 strong PUTs; the primary dies with some unreplicated; node 2 takes lease 2, heals
    // with node 3 and holds every ACKed message.
    let now = Instant::now();
    let mut cores = active_cluster(now);
    let mut acked = Vec::new();
    for i in 0..20u8 {
        put(&mut cores[0], now, i, true);
        // Node 2 misses every other batch (a slow link); node 3 stops hearing at i = 15.
        let down: &[u32] = if i >= 15 {
            &[2, 3]
        } else if i % 2 == 0 {
            &[2]
        } else {
            &[]
        };
        for o in settle(now, &mut cores, down) {
            if let Output::Ack { guid, .. } = o {
                acked.push(guid);
            }
        }
    }
    assert!(acked.len() >= 10, "acked {}", acked.len());
    for c in cores.iter_mut().skip(1) {
        c.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    }
    let outs = settle(now, &mut cores, &[1]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?} {:?} {:?} {:?} {:?}",
        cores[1].phase(),
        cores[1].shape(),
        cores[2].shape(),
        cores[1].replica_receipts()
    );
    assert_holds_every(&cores[1], &acked);
    assert_eq!(records(&cores[1]), records(&cores[2]));
}

/// Asserts that `core`'s journal holds a message record of every GUID in `acked`.
fn assert_holds_every(core: &ReplicationCore, acked: &[Bytes]) {
    let held: Vec<Bytes> = records(core)
        .iter()
        .filter_map(|r| match &r.kind {
            Some(RecordKind::Message(m)) => Some(m.guid.clone()),
            _ => None,
        })
        .collect();
    for g in acked {
        assert!(held.contains(g), "acked {g:?} lost");
    }
}

fn confirm_record(n: u8) -> RecordKind {
    RecordKind::Confirm(StoredConfirm {
        uri: "bmq://d/q".into(),
        guid: guid(n),
        app_id: String::new(),
    })
}

/// Puts message `n` on the primary `cores[0]` and, with `confirm`, confirms it; settles the
/// network with `down` unreachable.
fn put_and_confirm(now: Instant, cores: &mut [Node], n: u8, confirm: bool, down: &[u32]) {
    let r = cores[0].handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(n),
        Bytes::from(vec![n; 100]),
        vec![],
        true,
        0,
    );
    assert!(matches!(r, PutResult::Appended { .. }), "{r:?}");
    settle(now, cores, down);
    if confirm {
        assert!(cores[0].handle_record(now, confirm_record(n), 0).is_some());
        settle(now, cores, down);
    }
}

fn outstanding(core: &ReplicationCore) -> Vec<u128> {
    core.store().outstanding().iter().map(|o| o.guid).collect()
}

/// Three nodes with journal segments of `segment` bytes; node 1 primary of lease 1, active.
fn small_segment_cluster(now: Instant, segment: u64) -> Vec<Node> {
    let mut cores: Vec<_> = (1..=3).map(|n| node_with(n, vec![], segment)).collect();
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    }
    settle(now, &mut cores, &[]);
    assert!(cores[0].is_active_primary());
    cores
}

#[test]
fn settled_positions_reach_the_replicas_which_reclaim_space_too() {
    // Confirmed messages become dead once settled; the primary tells its replicas where the
    // settled position is, and every node deletes the segments that hold only dead records.
    let now = Instant::now();
    let mut cores = small_segment_cluster(now, 700);
    for n in 1..=40u8 {
        put_and_confirm(now, &mut cores, n, n != 7, &[]);
    }
    for (i, c) in cores.iter().enumerate() {
        let stats = c.store().stats();
        assert_eq!(stats.base, c.last_sequence(), "node {}: {stats:?}", i + 1);
        assert!(stats.floor > 40, "node {}: {stats:?}", i + 1);
        assert!(stats.segments <= 4, "node {}: {stats:?}", i + 1);
        assert_eq!(outstanding(c), vec![guid_key(&guid(7))]);
    }
}

#[test]
fn space_is_reclaimed_when_the_traffic_stops() {
    // The last confirms settle after the last write (the primary's base moves on the receipts,
    // a replica's on a settled position sent alone): every node still deletes its closed
    // segments of dead records, without waiting for another write.
    let now = Instant::now();
    let mut cores = small_segment_cluster(now, 700);
    for n in 1..=40u8 {
        put_and_confirm(now, &mut cores, n, true, &[]);
    }
    for (i, c) in cores.iter().enumerate() {
        let stats = c.store().stats();
        assert_eq!(stats.base, c.last_sequence(), "node {}: {stats:?}", i + 1);
        assert_eq!(stats.outstanding, 0, "node {}: {stats:?}", i + 1);
        assert_eq!(
            stats.segments,
            1,
            "node {}: only the active segment stays: {stats:?}",
            i + 1
        );
        assert!(!c.needs_sync(), "node {}", i + 1);
    }
}

/// Node 3, back after the primary (node 1) compacted past its journal's end, is found by the
/// primary's resend at `now` and brought to the primary's live state (an install).
fn node_3_catches_up(now: Instant, cores: &mut [Node]) {
    cores[0].handle_timeout(now);
    settle(now, cores, &[]);
    assert!(!cores[2].is_installing());
    assert_eq!(outstanding(&cores[2]), outstanding(&cores[0]));
    assert_eq!(cores[2].last_sequence(), cores[0].last_sequence());
}

#[test]
fn a_replica_behind_the_floor_receives_the_live_state() {
    // Node 3 is down while the others settle and compact past its journal's end (it is not in
    // sync after `in_sync_timeout`); when it comes back it is sent the live state (an
    // install), not the history, and then follows normally.
    let t0 = Instant::now();
    let mut cores = small_segment_cluster(t0, 700);
    for n in 1..=5u8 {
        put_and_confirm(t0, &mut cores, n, n != 2, &[]);
    }
    let t1 = t0 + Duration::from_secs(11);
    for n in 6..=60u8 {
        put_and_confirm(t1, &mut cores, n, n % 10 != 0, &[3]);
    }
    let floor = cores[0].store().floor();
    assert!(
        floor > cores[2].last_sequence(),
        "floor {floor}, node 3 at {}",
        cores[2].last_sequence()
    );
    // Node 3 is back: the primary's resend finds it below the floor.
    let t2 = t1 + Duration::from_secs(1);
    node_3_catches_up(t2, &mut cores);
    assert_eq!(cores[2].shape().runs, cores[0].shape().runs);
    // And it follows normally afterwards.
    put_and_confirm(t2, &mut cores, 61, false, &[]);
    assert_eq!(outstanding(&cores[2]), outstanding(&cores[0]));
    assert_eq!(
        cores[0].replica_receipts(),
        vec![
            (NodeId(2), cores[0].last_sequence()),
            (NodeId(3), cores[0].last_sequence())
        ]
    );
}

#[test]
fn a_new_primary_behind_the_floor_pulls_the_live_state() {
    // Node 3 missed everything while nodes 1 and 2 compacted; node 1 dies and node 3 is named
    // primary of lease 2: it pulls an install from node 2 (the most advanced), then serves
    // every outstanding message.
    let t0 = Instant::now();
    let mut cores = small_segment_cluster(t0, 700);
    put_and_confirm(t0, &mut cores, 1, true, &[]);
    let t1 = t0 + Duration::from_secs(11);
    for n in 2..=50u8 {
        put_and_confirm(t1, &mut cores, n, n % 7 != 0, &[3]);
    }
    assert!(cores[1].store().floor() > cores[2].last_sequence());
    let want = outstanding(&cores[1]);
    for c in cores.iter_mut().skip(1) {
        c.handle_role(t1, Some(NodeId(3)), LeaseId(2), &[]);
    }
    let outs = settle(t1, &mut cores, &[1]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?}"
    );
    assert_eq!(outstanding(&cores[2]), want);
    assert_eq!(outstanding(&cores[1]), want);
}

#[test]
fn the_duplicate_window_holds_finished_messages_only() {
    // Outstanding GUIDs are known from the index: the window stays empty while messages are
    // outstanding (no memory twice for them), and takes a GUID when its message is done and
    // settled, so a resend of a confirmed message is still a duplicate — on every node.
    let now = Instant::now();
    let mut cores = small_segment_cluster(now, 1 << 20);
    put_and_confirm(now, &mut cores, 1, false, &[]);
    put_and_confirm(now, &mut cores, 2, true, &[]);
    let primary = &mut cores[0];
    assert_eq!(
        primary.duplicate_of(now, &guid(1)),
        Some(2),
        "outstanding: its record (after the lease's first)"
    );
    assert_eq!(
        primary.duplicate_of(now, &guid(2)),
        Some(0),
        "confirmed: a duplicate, ACKed at once"
    );
    assert_eq!(primary.duplicate_of(now, &guid(3)), None);
    assert_eq!(primary.guids.len(), 1, "only the finished message");
    assert!(primary.guids.contains(guid_key(&guid(2))));
    // Replicas remember finished messages too: a producer that resends to the next primary
    // (its ACK died with this one) gets an ACK, not a second copy.
    for replica in &cores[1..] {
        assert_eq!(replica.guids.len(), 1);
        assert!(replica.guids.contains(guid_key(&guid(2))));
    }
}

/// A replica of the primary node 1 at `lease`, synchronised with `first` (records 1-3 of
/// lease 1) and then streamed records 4-5 of lease 1, all durable and receipted through 5.
fn replica_receipted_through_5(now: Instant, lease: u64, first: &SyncRecords) -> Node {
    let mut replica = node(2, vec![]);
    replica.handle_role(now, Some(NodeId(1)), LeaseId(lease), &[]);
    drain(&mut replica);
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(first.clone())));
    replica.sync(now).unwrap();
    let more = ReplicateRecords {
        partition_id: 0,
        lease,
        prev_sequence: 3,
        records: vec![],
        covered_through: 5,
        settled_through: 0,
        framed_records: encode_frames(&[rec(1, 4), rec(1, 5)]),
    };
    replica.handle_message(now, NodeId(1), msg(MsgKind::Replicate(more)));
    replica.sync(now).unwrap();
    let receipts = drain(&mut replica);
    assert!(
        receipts
            .iter()
            .any(|o| matches!(o, Output::Send { message, .. }
            if matches!(&message.kind, Some(MsgKind::Receipt(r)) if r.sequence == 5))),
        "{receipts:?}"
    );
    replica
}

#[test]
fn a_late_copy_of_a_sync_cuts_nothing_the_replica_holds() {
    // Found by the replication simulator: a sync answering an older shape of the replica
    // arrives after records that followed it. Cutting back to its `truncate_after` would drop
    // records the replica has receipted as durable (the primary may have committed, and ACKed,
    // on that receipt). Matching records (same lease at the same position) are kept, as Raft's
    // AppendEntries keeps matching entries.
    let now = Instant::now();
    let first = SyncRecords {
        partition_id: 0,
        lease: 1,
        truncate_after: 0,
        records: journal(&[(1, 3)]),
        sender_last_sequence: 3,
        covered_through: 3,
        ..Default::default()
    };
    let mut replica = replica_receipted_through_5(now, 1, &first);
    // The late copy of the first sync.
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(first)));
    assert_eq!(replica.last_sequence(), 5);
    assert_eq!(
        replica.store().durable(),
        5,
        "receipted records stay durable"
    );
    assert!(!replica.needs_sync(), "nothing was rewritten");
    assert_eq!(records(&replica), journal(&[(1, 5)]));
    // A sync that conflicts (another lease at position 4) still cuts from the conflict.
    replica.handle_role(now, Some(NodeId(3)), LeaseId(2), &[]);
    drain(&mut replica);
    let conflicting = SyncRecords {
        partition_id: 0,
        lease: 2,
        truncate_after: 3,
        records: vec![rec(2, 4)],
        sender_last_sequence: 4,
        covered_through: 4,
        ..Default::default()
    };
    replica.handle_message(now, NodeId(3), msg(MsgKind::Sync(conflicting)));
    assert_eq!(records(&replica), journal(&[(1, 3), (2, 1)]));
}

#[test]
fn a_late_sync_keeps_records_of_an_older_lease_that_match_the_sender() {
    // Replication simulator, 3 nodes, seed 10021: a replica held records of lease 3 through
    // 545 under the primary of lease 4 and had receipted them; a late sync (answering an older
    // shape) accounted only through 527, and the replica cut 528-545 because they were of an
    // older lease than the sync's, though the primary holds them too. The receipt still in
    // flight then counted them, and the primary ACKed a message one node held.
    let now = Instant::now();
    // The primary of lease 2 holds five records of lease 1.
    let first = SyncRecords {
        partition_id: 0,
        lease: 2,
        truncate_after: 0,
        records: journal(&[(1, 3)]),
        sender_last_sequence: 5,
        covered_through: 3,
        runs: shape_of(&[(1, 1)], 5).runs,
        ..Default::default()
    };
    let mut replica = replica_receipted_through_5(now, 2, &first);
    // The late copy of the first sync: its runs say the sender holds lease 1 through 5.
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(first.clone())));
    assert_eq!(
        records(&replica),
        journal(&[(1, 5)]),
        "receipted records are kept"
    );
    assert_eq!(replica.store().durable(), 5);
    assert!(!replica.needs_sync(), "nothing was rewritten");
    // A sender whose journal diverges at 5 (lease 2 there): the replica keeps through 4 only.
    let diverging = SyncRecords {
        runs: shape_of(&[(1, 1), (2, 5)], 5).runs,
        ..first.clone()
    };
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(diverging)));
    assert_eq!(records(&replica), journal(&[(1, 4)]));
    // A sender that sends no runs (an older version): cut after what the message accounts for.
    let bare = SyncRecords {
        runs: vec![],
        ..first
    };
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(bare)));
    assert_eq!(records(&replica), journal(&[(1, 3)]));
}

#[test]
fn the_duplicate_window_stays_bounded_on_replicas() {
    // Replicas remember finished GUIDs too, and their window expires like the primary's
    // (a soak of 10,000,000 messages showed replicas growing without it).
    let now = Instant::now();
    let mut cores = small_segment_cluster(now, 1 << 20);
    for c in cores.iter_mut() {
        c.cfg.guid_window_max = 3;
    }
    for n in 1..=10u8 {
        put_and_confirm(now, &mut cores, n, true, &[]);
    }
    for (i, c) in cores.iter().enumerate() {
        assert!(c.guids.len() <= 3, "node {}: {}", i + 1, c.guids.len());
    }
}

#[test]
fn a_replica_drops_frames_that_do_not_check() {
    // Records streamed as journal frames are checked frame by frame: a message with
    // a corrupt frame is dropped whole (nothing appended, nothing receipted; the primary
    // resends), and the intact resend is appended as received.
    let now = Instant::now();
    let mut replica = node(2, vec![]);
    replica.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    drain(&mut replica);
    let sync = SyncRecords {
        partition_id: 0,
        lease: 1,
        truncate_after: 0,
        records: journal(&[(1, 2)]),
        sender_last_sequence: 2,
        covered_through: 2,
        ..Default::default()
    };
    replica.handle_message(now, NodeId(1), msg(MsgKind::Sync(sync)));
    replica.sync(now).unwrap();
    drain(&mut replica);
    let frames = encode_frames(&[rec(1, 3), rec(1, 4)]);
    let mut corrupt = frames.to_vec();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xff;
    let replicate = |framed_records: Bytes| {
        msg(MsgKind::Replicate(ReplicateRecords {
            partition_id: 0,
            lease: 1,
            prev_sequence: 2,
            records: vec![],
            covered_through: 4,
            settled_through: 0,
            framed_records,
        }))
    };
    replica.handle_message(now, NodeId(1), replicate(Bytes::from(corrupt)));
    assert_eq!(replica.last_sequence(), 2);
    assert!(!replica.needs_sync());
    assert_eq!(drain(&mut replica), vec![]);
    replica.handle_message(now, NodeId(1), replicate(frames));
    assert_eq!(replica.last_sequence(), 4);
    replica.sync(now).unwrap();
    assert_eq!(replica.store().read(4).unwrap().unwrap(), rec(1, 4));
    assert!(drain(&mut replica)
        .iter()
        .any(|o| matches!(o, Output::Send { message, .. }
        if matches!(&message.kind, Some(MsgKind::Receipt(r)) if r.sequence == 4))));
}

#[test]
fn a_primary_named_again_at_a_lease_it_served_before_a_restart_asks_for_a_new_one() {
    // Scenario: node 1 wrote records as primary of lease 2, then restarted (a new core over
    // the same journal) and the committed state still names it at lease 2. Healing again at
    // lease 2 could append, at positions a replica holds durably under lease 2, records other
    // than the replica's, so it refuses: no healing, PUTs NOT_READY, one LeaseReused. Named at
    // lease 3 it heals as usual.
    let now = Instant::now();
    let mut core = node(1, journal(&[(1, 2), (2, 3)]));
    core.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    assert!(
        core.phase().is_none(),
        "no healing at a lease served before the restart"
    );
    let outputs = drain(&mut core);
    assert!(
        matches!(outputs.as_slice(), [Output::LeaseReused { lease }] if *lease == LeaseId(2)),
        "{outputs:?}"
    );
    let r = core.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(9),
        Bytes::new(),
        vec![],
        true,
        0,
    );
    assert_eq!(r, PutResult::NotReady);

    core.handle_role(now, Some(NodeId(1)), LeaseId(3), &[]);
    assert!(core.phase().is_some(), "heals at the new lease");
    let outputs = drain(&mut core);
    assert!(
        outputs
            .iter()
            .any(|o| matches!(o, Output::Send { message, .. } if matches!(message.kind, Some(MsgKind::StateQuery(_))))),
        "queries the members: {outputs:?}"
    );
}

#[test]
fn a_primary_heals_at_a_lease_its_journal_does_not_hold_and_again_after_stepping_down() {
    // A lease the journal holds no record of is served at once; and a primary that stepped
    // down and is named again at the lease it served in this run heals again (nothing was
    // lost: the same process wrote those records).
    let now = Instant::now();
    let mut core = node(1, journal(&[(1, 2)]));
    core.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    assert!(core.phase().is_some());
    assert!(!drain(&mut core)
        .iter()
        .any(|o| matches!(o, Output::LeaseReused { .. })));
    core.handle_role(now, None, LeaseId(2), &[]);
    assert!(core.phase().is_none());
    core.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    assert!(core.phase().is_some(), "same run: heals again at lease 2");
}

/// ACK waiters leave in sequence order, each at its record's release; a resend waiting for an
/// earlier record is released with it, and the same producer resending the same GUID waits
/// once (the queue that replaced a map of lists).
#[test]
fn ack_waiters_leave_in_sequence_order_and_a_resend_waits_once() {
    let waiter = |session_id: u64, n: u8| Waiter {
        producer: SessionAddr {
            origin_node: NodeId(1),
            session_id,
        },
        uri: "bmq://d/q".into(),
        guid: Bytes::from(vec![n; 16]),
    };
    let mut w = AckWaiters::default();
    w.add(3, waiter(1, 3));
    w.add(5, waiter(1, 5));
    w.add(7, waiter(1, 7));
    // Resends of the message stored at 5: another producer's waits, the same one's does not.
    w.add(5, waiter(2, 5));
    w.add(5, waiter(1, 5));
    w.add(1, waiter(3, 1));
    let ids = |w: &mut AckWaiters, through| -> Vec<(u64, u8)> {
        w.take_through(through)
            .map(|x| (x.producer.session_id, x.guid[0]))
            .collect()
    };
    assert_eq!(ids(&mut w, 0), []);
    assert_eq!(ids(&mut w, 4), [(3, 1), (1, 3)]);
    assert_eq!(ids(&mut w, 6), [(1, 5), (2, 5)]);
    w.add(9, waiter(1, 9));
    assert_eq!(ids(&mut w, 100), [(1, 7), (1, 9)]);
    assert_eq!(ids(&mut w, 100), []);
}

/// Three nodes that compacted (floor above 0) with some messages outstanding; node 2 is named
/// primary of lease 2 on nodes 2 and 3 (node 1 is down), and the lease's state queries
/// between them are delivered. Returns the cluster and node 2's sync of node 3, not delivered
/// (nor is the lease's first record that follows it).
fn lease_two_healing_with_compacted_journals(now: Instant) -> (Vec<Node>, PartitionMessage) {
    let mut cores = small_segment_cluster(now, 700);
    for n in 1..=40u8 {
        put_and_confirm(now, &mut cores, n, n % 10 != 0, &[]);
    }
    assert!(cores[1].store().floor() > 0);
    for c in cores.iter_mut().skip(1) {
        c.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    }
    for o in drain(&mut cores[1]) {
        if let Output::Send {
            to: NodeId(3),
            message,
        } = o
        {
            cores[2].handle_message(now, NodeId(2), message);
        }
    }
    for o in run_shell(now, &mut cores[2]) {
        if let Output::Send {
            to: NodeId(2),
            message,
        } = o
        {
            cores[1].handle_message(now, NodeId(3), message);
        }
    }
    let mut sync = None;
    for o in run_shell(now, &mut cores[1]) {
        if let Output::Send {
            to: NodeId(3),
            message,
        } = o
        {
            if let Some(MsgKind::Sync(s)) = &message.kind {
                assert!(!s.install, "{message:?}");
                sync.get_or_insert(message);
            }
        }
    }
    (cores, sync.expect("node 2 syncs node 3"))
}

#[test]
fn a_lost_sync_is_not_replaced_by_an_install_of_a_replica_that_holds_the_history() {
    // Node 3 holds the whole history, node 2's (same leases, same last position). Node 2's sync
    // of it is lost, so node 3's receipt stays 0 at lease 2 — below the floor. The resend must
    // not stream from there: that starts an install, which replaces node 3's journal with the
    // live state through the floor, shorter than what it held (the replication simulator,
    // seed 831 of 3 nodes: a committed confirm then lived on one node and its message was
    // delivered again). Node 2 asks node 3 for its shape again instead.
    let t0 = Instant::now();
    let (mut cores, _lost) = lease_two_healing_with_compacted_journals(t0);
    let held = cores[2].last_sequence();
    // Node 2 holds the same and its lease's first record.
    assert_eq!(held + 1, cores[1].last_sequence());
    let t1 = t0 + Duration::from_secs(1);
    cores[1].handle_timeout(t1);
    let to_node_3: Vec<_> = drain(&mut cores[1])
        .into_iter()
        .filter_map(|o| match o {
            Output::Send {
                to: NodeId(3),
                message,
            } => Some(message.kind),
            _ => None,
        })
        .collect();
    assert_eq!(
        to_node_3,
        vec![Some(MsgKind::StateQuery(ReplicaStateQuery {
            partition_id: P.0,
            lease: 2
        }))]
    );
    // The query reaches node 3; the rest of the exchange runs as usual.
    for kind in to_node_3 {
        cores[2].handle_message(t1, NodeId(2), PartitionMessage { kind });
    }
    let outs = settle(t1, &mut cores, &[1]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?}"
    );
    assert_eq!(cores[2].last_sequence(), held + 1);
    assert_eq!(cores[1].replica_receipts()[1], (NodeId(3), held + 1));
}

#[test]
fn a_replica_that_holds_the_install_floor_position_keeps_its_journal() {
    // An install's first chunk reaches node 3, whose journal holds the primary's floor position
    // under the same lease (so the same records up to there) and more after it. It keeps its
    // journal (as a Raft follower holding a snapshot's last entry keeps the log after it,
    // Raft §7) and answers with its shape; the primary then synchronises it from the common
    // prefix. Installing would have left it shorter than the records it held.
    let t0 = Instant::now();
    let (mut cores, sync) = lease_two_healing_with_compacted_journals(t0);
    cores[2].handle_message(t0, NodeId(2), sync);
    // Node 3 holds lease 1's records (the lease's first record was not delivered).
    settle(t0, &mut cores, &[1]);
    let held = cores[2].last_sequence();
    let install = cores[1].install_message(0).expect("readable");
    assert!(install.install_through > 0 && install.install_through < held);
    assert_eq!(install.install_through_lease, 1);
    cores[2].handle_message(t0, NodeId(2), msg(MsgKind::Sync(install)));
    assert!(!cores[2].is_installing());
    assert_eq!(cores[2].last_sequence(), held);
    let outs = drain(&mut cores[2]);
    assert!(
        matches!(
            outs.as_slice(),
            [Output::Send { to: NodeId(2), message: PartitionMessage { kind: Some(MsgKind::StateResponse(r)) } }]
                if r.shape.as_ref().is_some_and(|s| s.last_sequence == held)
        ),
        "{outs:?}"
    );
    // The lease's first record is resent; the primary goes active.
    let t1 = t0 + Duration::from_secs(1);
    cores[1].handle_timeout(t1);
    settle(t1, &mut cores, &[1]);
    assert!(cores[1].is_active_primary());
    // (A journal that ends below the floor still takes the install:
    // `a_replica_behind_the_floor_receives_the_live_state`.)
}

#[test]
fn an_install_continues_from_its_first_chunk_not_from_the_common_prefix() {
    // Node 3 holds the first records, then misses the rest while the others compact past its
    // end. Its journal agrees with the primary's up to its end, but that is below the floor:
    // it is installed. The install's first chunk (two records here) covers less than node 3
    // held, and the next chunk must continue the staged journal from there: sent from the
    // common prefix instead, it left a gap the member could not fill, and the install began
    // again at every resend (replication simulator, 5 nodes, seed 4294968040).
    let t0 = Instant::now();
    let mut cores = small_segment_cluster(t0, 700);
    cores[0].cfg.batch_records_max = 2;
    for n in 1..=6u8 {
        put_and_confirm(t0, &mut cores, n, n > 3, &[]);
    }
    let held = cores[2].last_sequence();
    let t1 = t0 + Duration::from_secs(11);
    for n in 7..=60u8 {
        put_and_confirm(t1, &mut cores, n, n % 10 != 0, &[3]);
    }
    assert!(cores[0].store().floor() > held);
    node_3_catches_up(t1 + Duration::from_secs(1), &mut cores);
}

/// The ACKs among `outputs`.
fn acks(outputs: Vec<Output>) -> Vec<Output> {
    outputs
        .into_iter()
        .filter(|o| matches!(o, Output::Ack { .. }))
        .collect()
}

/// A primary lets no record of its lease out before the first one is durable in its own
/// journal: a restart that lost everything since then (a power loss, a failed fsync) still
/// finds the lease there and asks for a new one, so no replica can hold another record at a
/// position under the same lease.
#[test]
fn no_record_of_a_lease_leaves_the_primary_before_its_first_is_durable_there() {
    // The lease's first record is the one a healed primary appends (`StoredLeaseStart`).
    let now = Instant::now();
    let mut core = node(1, vec![]);
    core.handle_role(now, Some(NodeId(1)), LeaseId(1), &[]);
    drain(&mut core);
    core.sync(now).unwrap();
    core.handle_message(
        now,
        NodeId(2),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            needs_install: false,
            partition_id: 0,
            lease: 1,
            shape: Some(Default::default()),
        })),
    );
    assert_eq!(core.last_sequence(), 1, "the lease's first record");
    let carries_1 = |outputs: &[Output]| {
        outputs.iter().any(|o| match o {
            Output::Send { message, .. } => match &message.kind {
                Some(MsgKind::Sync(s)) => s.covered_through >= 1 || !s.records.is_empty(),
                Some(MsgKind::Replicate(r)) => r.covered_through >= 1,
                _ => false,
            },
            _ => false,
        })
    };
    let outputs = drain(&mut core);
    assert!(
        !carries_1(&outputs),
        "nothing before the primary's fsync: {outputs:?}"
    );
    core.handle_timeout(now + Duration::from_secs(5));
    assert!(!carries_1(&drain(&mut core)), "no resend either");
    core.sync(now).unwrap();
    let outputs = drain(&mut core);
    assert!(carries_1(&outputs), "then it goes: {outputs:?}");
    core.handle_message(now, NodeId(2), receipt(1, 1));
    assert!(core.is_active_primary());
    drain(&mut core);
    // Later records of the lease stream before the primary's own fsync.
    put(&mut core, now, 4, true);
    let sends = drain(&mut core)
        .iter()
        .filter(|o| matches!(o, Output::Send { .. }))
        .count();
    assert_eq!(sends, 1, "to node 2 (node 3 never answered)");
}

/// `node` after its journal was found corrupt and set aside ([`Store::quarantine`]): a
/// restarted core over the empty journal that needs an install.
fn lose_journal(node: Node) -> Node {
    let Node { core, _dir } = node;
    let me = core.cfg.self_id.0;
    let cfg_store = core.store().config();
    drop(core);
    Store::quarantine(&bmq_storage::disk::RealDisk, _dir.path()).unwrap();
    let store = Store::open(_dir.path(), cfg_store, apps()).unwrap();
    assert!(store.needs_install());
    assert_eq!(store.last_sequence(), 0);
    Node {
        core: ReplicationCore::new(cfg(me), store),
        _dir,
    }
}

#[test]
fn a_replica_that_lost_its_journal_counts_in_no_healing_quorum_until_reinstalled() {
    // Records 4 and 5 are ACKed by nodes 1 and 3 while node 2 misses them. Node 3 then loses
    // its journal (corrupt, set aside) and node 1 dies. Healing with nodes 2 and 3 would lose
    // 4 and 5 — node 3 answers an empty journal — so node 2, primary of lease 2, does not go
    // active on that quorum: it waits for node 1, pulls 4 and 5 from it, and brings node 3 up
    // to its journal, after which node 3 counts again.
    let now = Instant::now();
    let mut cores = active_cluster(now);
    let mut acked = Vec::new();
    for i in 1..=5u8 {
        put(&mut cores[0], now, i, true);
        let down: &[u32] = if i >= 4 { &[2] } else { &[] };
        for o in settle(now, &mut cores, down) {
            if let Output::Ack { guid, .. } = o {
                acked.push(guid);
            }
        }
    }
    assert_eq!(acked.len(), 5);
    // The lease's first record and three messages.
    assert_eq!(cores[1].store().last_sequence(), 4);
    let third = cores.pop().unwrap();
    cores.push(lose_journal(third));
    for c in cores.iter_mut().skip(1) {
        c.handle_role(now, Some(NodeId(2)), LeaseId(2), &[]);
    }
    let outs = settle(now, &mut cores, &[1]);
    assert!(
        !outs.contains(&Output::Active { lease: LeaseId(2) }),
        "healed on a quorum counting an emptied journal: {outs:?}"
    );
    assert_eq!(cores[1].phase(), Some(&PrimaryPhase::Collecting));
    assert!(cores[2].store().needs_install());
    // Node 1 answers (its query is resent on the primary's timer).
    cores[1].handle_timeout(now + Duration::from_secs(1));
    let outs = settle(now + Duration::from_secs(1), &mut cores, &[]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?}"
    );
    assert_holds_every(&cores[1], &acked);
    assert_eq!(records(&cores[2]), records(&cores[1]));
    assert!(
        !cores[2].store().needs_install(),
        "re-installed through the primary's last position: counts again"
    );
}

#[test]
fn a_primary_that_lost_its_journal_asks_for_a_lease_above_its_mark_and_does_not_count_itself() {
    // Node 1 served lease 2 as primary, then lost its journal. Named again at lease 2 it can
    // no longer see that in its journal, but its primary-lease mark does: it asks for a new
    // lease. At lease 3 it heals, counting only the other members' answers.
    let now = Instant::now();
    let mut cores: Vec<_> = (1..=3).map(|n| node(n, vec![])).collect();
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    }
    settle(now, &mut cores, &[]);
    put(&mut cores[0], now, 1, true);
    settle(now, &mut cores, &[]);
    let first = cores.remove(0);
    cores.insert(0, lose_journal(first));
    assert_eq!(cores[0].store().primary_lease_mark(), 2);
    cores[0].handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    assert!(cores[0].phase().is_none());
    assert!(matches!(
        drain(&mut cores[0]).as_slice(),
        [Output::LeaseReused { lease }] if *lease == LeaseId(2)
    ));
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(3), &[]);
    }
    // With node 3 down, node 2's answer and its own (uncounted) are not a quorum.
    let outs = settle(now, &mut cores, &[3]);
    assert!(
        !outs.contains(&Output::Active { lease: LeaseId(3) }),
        "{outs:?}"
    );
    cores[0].handle_timeout(now + Duration::from_secs(1));
    let outs = settle(now + Duration::from_secs(1), &mut cores, &[]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(3) }),
        "{outs:?}"
    );
    let messages = records(&cores[0])
        .iter()
        .filter(|r| matches!(r.kind, Some(RecordKind::Message(_))))
        .count();
    assert_eq!(messages, 1, "pulled the message back");
    assert!(!cores[0].store().needs_install());
    assert!(cores[0].store().primary_lease_mark() >= 3);
}

#[test]
fn a_primary_changes_no_replica_before_its_lease_is_durably_marked_and_a_restart_renews_it() {
    // Node 1, named primary of lease 2 over a journal of lease 1, collects a quorum of shapes
    // but sends no sync until its primary-lease mark is durable. Then it syncs node 2 and
    // restarts having written no record of lease 2 (as after a failed fsync): its journal
    // does not show the lease, its mark does, so named at lease 2 again it asks for a new
    // lease instead of healing a second time at a lease whose first run changed a replica.
    let now = Instant::now();
    let node1 = node_on_disk(1, journal(&[(1, 3)]), 1 << 20, true);
    let mut primary = node1;
    primary.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    drain(&mut primary);
    primary.handle_message(
        now,
        NodeId(2),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            needs_install: false,
            partition_id: 0,
            lease: 2,
            shape: Some(shape_of(&[(1, 1)], 1)),
        })),
    );
    assert_eq!(
        drain(&mut primary),
        vec![],
        "no sync before the mark is durable"
    );
    assert_eq!(primary.phase(), Some(&PrimaryPhase::Collecting));
    assert!(primary.needs_sync());
    primary.sync(now).unwrap();
    let outs = drain(&mut primary);
    assert!(
        outs.iter().any(|o| matches!(o, Output::Send { to, message } if *to == NodeId(2) && matches!(message.kind, Some(MsgKind::Sync(_))))),
        "{outs:?}"
    );
    let Node { core, _dir } = primary;
    let cfg_store = core.store().config();
    drop(core);
    let store = Store::open(_dir.path(), cfg_store, apps()).unwrap();
    assert_eq!(store.last_lease(), 1, "no record of lease 2 in the journal");
    let mut restarted = ReplicationCore::new(cfg(1), store);
    restarted.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    assert!(restarted.phase().is_none());
    assert!(matches!(
        drain(&mut restarted).as_slice(),
        [Output::LeaseReused { lease }] if *lease == LeaseId(2)
    ));
}

#[test]
fn a_healed_primary_commits_older_records_only_with_a_record_of_its_own_lease() {
    // Raft's figure 8 (§5.4.2). Nodes 1 and 2 hold records 4-5 of lease 1; node 3, primary of
    // lease 2 once, holds records 4-5 of lease 2 that no quorum took. Node 1 heals lease 3
    // with node 2 (node 3 down) and goes active, settling 4-5 of lease 1 on node 2. Without a
    // record of lease 3, node 2's journal would still end in lease 1, and node 3, primary of
    // lease 4 with node 2 (node 1 down), would count its own lease-2 journal the most
    // advanced and sync node 2 to it — whose settled records cannot be cut. With lease 3's
    // first record on node 2, node 2 is the most advanced: node 3 pulls from it.
    let now = Instant::now();
    let mut cores = vec![
        node(1, journal(&[(1, 5)])),
        node(2, journal(&[(1, 5)])),
        node(3, journal(&[(1, 3), (2, 2)])),
    ];
    for c in cores.iter_mut().take(2) {
        c.handle_role(now, Some(NodeId(1)), LeaseId(3), &[]);
    }
    let outs = settle(now, &mut cores, &[3]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(3) }),
        "{outs:?}"
    );
    assert_eq!(
        cores[1].store().last_lease(),
        3,
        "node 2 holds lease 3's first record"
    );
    assert!(
        cores[1].store().base() >= 5,
        "4-5 of lease 1 settled on node 2"
    );
    for c in cores.iter_mut().skip(1) {
        c.handle_role(now, Some(NodeId(3)), LeaseId(4), &[]);
    }
    let outs = settle(now, &mut cores, &[1]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(4) }),
        "{outs:?}"
    );
    let leases = |core: &ReplicationCore| -> Vec<(u64, u64)> {
        records(core)
            .iter()
            .map(|r| (r.sequence, r.lease))
            .collect()
    };
    assert_eq!(leases(&cores[2]), leases(&cores[1]), "one journal");
    assert_eq!(&leases(&cores[2])[3..5], &[(4, 1), (5, 1)]);
}

#[test]
fn a_lease_counts_the_replicas_it_names() {
    // Scenario: records committed at lease 1 by {1,2,3}; lease 2 names replicas {1,2,3,4}
    // with a majority quorum (3 of 4). With 3 down, the primary heals from {1,2,4} and brings
    // the new replica 4 up to date; with 2 and 3 down it stays passive ({1,4} is no majority
    // of four), however many of the old replicas' receipts it once had.
    let now = Instant::now();
    let mut cores = active_cluster(now);
    cores.push(node(4, vec![]));
    for n in 1..=3u8 {
        assert!(matches!(
            put(&mut cores[0], now, n, true),
            PutResult::Appended { .. }
        ));
    }
    let acks = settle(now, &mut cores, &[4]);
    assert_eq!(
        acks.iter()
            .filter(|o| matches!(o, Output::Ack { .. }))
            .count(),
        3
    );
    let four: Vec<NodeId> = (1..=4).map(NodeId).collect();
    for c in cores.iter_mut() {
        c.set_quorum(now, 0);
        c.handle_role(now, Some(NodeId(1)), LeaseId(2), &four);
    }
    assert_eq!(cores[0].replicas(), &four[..]);
    assert_eq!(cores[0].quorum(), 3);
    let outs = settle(now, &mut cores, &[3]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?}"
    );
    assert_eq!(records(&cores[3]).len(), records(&cores[0]).len());
    assert_eq!(
        records(&cores[3]).len(),
        2 + 3,
        "each lease's own record and the three PUTs"
    );

    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(3), &four);
    }
    let outs = settle(now, &mut cores, &[2, 3]);
    assert!(
        !outs.iter().any(|o| matches!(o, Output::Active { .. })),
        "{{1,4}} is no majority of four replicas: {outs:?}"
    );
}

#[test]
fn a_learner_receives_the_journal_and_counts_in_no_quorum() {
    // Scenario: replicas {1,2,3}, learner 4. With 2 and 3 down, a strong PUT held by 1 and 4
    // is not ACKed (4 counts in no quorum); once 2 is back it is, and 4 holds every record.
    // A learner's shape counts in no healing quorum either: lease 2 with 2 and 3 down stays
    // passive beside learner 4.
    let now = Instant::now();
    let mut cores = active_cluster(now);
    cores.push(node(4, vec![]));
    assert!(!cores[3].follows_primary(), "not synchronised yet");
    cores[0].set_learners(now, &[NodeId(4), NodeId(2)]);
    assert_eq!(
        cores[0].learners().iter().copied().collect::<Vec<_>>(),
        vec![NodeId(4)],
        "a replica of the lease is never a learner"
    );
    assert!(matches!(
        put(&mut cores[0], now, 1, true),
        PutResult::Appended { .. }
    ));
    let acks = settle(now, &mut cores, &[2, 3]);
    assert!(
        !acks.iter().any(|o| matches!(o, Output::Ack { .. })),
        "ACKed with a learner's receipt: {acks:?}"
    );
    assert_eq!(
        records(&cores[3]).len(),
        records(&cores[0]).len(),
        "the learner has it"
    );
    assert!(cores[3].follows_primary(), "the learner caught up");
    assert!(!cores[0].follows_primary(), "the primary follows no one");
    // Node 2 is back: the primary resends what it did not receipt.
    let now = now + Duration::from_secs(1);
    cores[0].handle_timeout(now);
    let acks = settle(now, &mut cores, &[3]);
    assert_eq!(
        acks.iter()
            .filter(|o| matches!(o, Output::Ack { .. }))
            .count(),
        1
    );

    for c in cores.iter_mut().take(3) {
        c.handle_role(now, Some(NodeId(1)), LeaseId(2), &[]);
    }
    let outs = settle(now, &mut cores, &[2, 3]);
    assert!(
        !outs.iter().any(|o| matches!(o, Output::Active { .. })),
        "healed from a learner's shape: {outs:?}"
    );
    cores[0].set_learners(now, &[]);
    assert!(cores[0].learners().is_empty());
}

#[test]
fn a_learner_of_an_idle_partition_catches_up_without_new_records() {
    // Scenario: the primary holds records and receives none after learner 4 is added: the
    // learner still gets them and reports that it follows the primary.
    let now = Instant::now();
    let mut cores = active_cluster(now);
    for seq in 1..=3 {
        assert!(matches!(
            put(&mut cores[0], now, seq, true),
            PutResult::Appended { .. }
        ));
    }
    settle(now, &mut cores, &[]);
    cores.push(node(4, vec![]));
    cores[0].set_learners(now, &[NodeId(4)]);
    settle(now, &mut cores, &[]);
    assert_eq!(records(&cores[3]), records(&cores[0]));
    assert!(cores[3].follows_primary(), "the learner caught up");
}
