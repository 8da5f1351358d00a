//! Step-by-step tests of the replication core: exact outputs for each input.

use super::*;
use bmq_proto::peer::journal_record::Kind as RecordKind;

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
    }
}

fn producer() -> SessionAddr {
    SessionAddr {
        origin_node: NodeId(3),
        session_id: 9,
    }
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
    }
}

fn msg(kind: MsgKind) -> PartitionMessage {
    PartitionMessage { kind: Some(kind) }
}

/// Runs `core`'s outputs as a shell would with a perfect disk: persists at once and returns
/// the sends and acks.
fn run_shell(now: Instant, core: &mut ReplicationCore) -> Vec<Output> {
    let mut rest = Vec::new();
    loop {
        let outs = drain(core);
        if outs.is_empty() {
            return rest;
        }
        let mut persisted = false;
        for o in outs {
            match o {
                Output::Persist { .. } => persisted = true,
                other => rest.push(other),
            }
        }
        if persisted {
            let last = core.last_sequence();
            core.on_persisted(now, last);
        }
    }
}

/// Delivers every Send among `cores` (indexed by node id - 1) until quiet, skipping nodes in
/// `down`. Returns the acks seen.
fn settle(now: Instant, cores: &mut [ReplicationCore], down: &[u32]) -> Vec<Output> {
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
fn active_cluster(now: Instant) -> Vec<ReplicationCore> {
    let mut cores: Vec<_> = (1..=3)
        .map(|n| ReplicationCore::new(cfg(n), vec![]))
        .collect();
    for c in cores.iter_mut() {
        c.handle_role(now, Some(NodeId(1)), LeaseId(1));
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
    let mut core = ReplicationCore::new(cfg(1), vec![]);
    core.handle_role(now, Some(NodeId(1)), LeaseId(1));
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

#[test]
fn strong_put_is_acked_at_quorum_receipt() {
    // DESIGN.md §7 strong consistency: no ACK on the primary's own fsync, ACK on the first
    // replica receipt (2 of 3).
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    let r = core.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(1),
        Bytes::from_static(b"x"),
        vec![],
        true,
        0,
    );
    assert_eq!(r, PutResult::Appended { sequence: 1 });
    let rec1 = rec(1, 1);
    let replicate = |to| Output::Send {
        to: NodeId(to),
        message: msg(MsgKind::Replicate(ReplicateRecords {
            partition_id: 0,
            lease: 1,
            prev_sequence: 0,
            records: vec![rec1.clone()],
        })),
    };
    assert_eq!(
        drain(&mut core),
        vec![
            Output::Persist {
                truncate_after: None,
                records: vec![rec1.clone()]
            },
            replicate(2),
            replicate(3),
        ]
    );
    core.on_persisted(now, 1);
    assert_eq!(drain(&mut core), vec![]);
    core.handle_message(
        now,
        NodeId(2),
        msg(MsgKind::Receipt(Receipt {
            partition_id: 0,
            lease: 1,
            sequence: 1,
        })),
    );
    assert_eq!(
        drain(&mut core),
        vec![Output::Ack {
            producer: producer(),
            uri: "bmq://d/q".into(),
            guid: guid(1)
        }]
    );
    assert_eq!(core.committed(), 1);
}

#[test]
fn eventual_put_is_acked_once_the_primary_holds_it() {
    // DESIGN.md §7 eventual consistency: the primary's own fsync releases the ACK.
    let now = Instant::now();
    let mut core = active_cluster(now).remove(0);
    core.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(1),
        Bytes::from_static(b"x"),
        vec![],
        false,
        0,
    );
    drain(&mut core);
    core.on_persisted(now, 1);
    assert_eq!(
        drain(&mut core),
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
    let put = |core: &mut ReplicationCore, producer: SessionAddr| {
        core.handle_put(
            now,
            producer,
            "bmq://d/q".into(),
            guid(1),
            Bytes::from_static(b"x"),
            vec![],
            true,
            0,
        )
    };
    assert_eq!(
        put(&mut core, producer()),
        PutResult::Appended { sequence: 1 }
    );
    drain(&mut core);
    assert_eq!(put(&mut core, producer()), PutResult::Duplicate);
    assert_eq!(put(&mut core, other), PutResult::Duplicate);
    assert_eq!(drain(&mut core), vec![]);
    assert_eq!(core.last_sequence(), 1);
    core.on_persisted(now, 1);
    core.handle_message(
        now,
        NodeId(3),
        msg(MsgKind::Receipt(Receipt {
            partition_id: 0,
            lease: 1,
            sequence: 1,
        })),
    );
    let ack = |producer| Output::Ack {
        producer,
        uri: "bmq://d/q".into(),
        guid: guid(1),
    };
    assert_eq!(drain(&mut core), vec![ack(producer()), ack(other)]);
    assert_eq!(put(&mut core, producer()), PutResult::Duplicate);
    assert_eq!(drain(&mut core), vec![ack(producer())]);
}

#[test]
fn passive_primary_refuses_puts() {
    // Until healed, PUTs are answered NOT_READY so the proxy keeps them for retransmission.
    let now = Instant::now();
    let mut core = ReplicationCore::new(cfg(1), vec![]);
    core.handle_role(now, Some(NodeId(1)), LeaseId(1));
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
    let mut primary = ReplicationCore::new(cfg(2), journal(&[(1, 2)]));
    let mut replica = ReplicationCore::new(cfg(3), journal(&[(1, 4)]));
    primary.handle_role(now, Some(NodeId(2)), LeaseId(2));
    replica.handle_role(now, Some(NodeId(2)), LeaseId(2));
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
    assert_eq!(
        outs,
        vec![
            Output::Persist {
                truncate_after: None,
                records: vec![rec(1, 3), rec(1, 4)]
            },
            Output::Send {
                to: NodeId(3),
                message: msg(MsgKind::Sync(SyncRecords {
                    partition_id: 0,
                    lease: 2,
                    truncate_after: 4,
                    records: vec![],
                    sender_last_sequence: 4,
                }))
            },
        ]
    );
    assert_eq!(primary.phase(), Some(&PrimaryPhase::Syncing));
    primary.on_persisted(now, 4);
    assert_eq!(drain(&mut primary), vec![]);
    primary.handle_message(
        now,
        NodeId(3),
        msg(MsgKind::Receipt(Receipt {
            partition_id: 0,
            lease: 2,
            sequence: 4,
        })),
    );
    assert_eq!(
        drain(&mut primary),
        vec![Output::Active { lease: LeaseId(2) }]
    );
}

#[test]
fn healing_truncates_unacknowledged_records_of_an_older_lease() {
    // Node 3 holds (lease 1: 1..5), but records 4..5 reached no quorum: the new primary of
    // lease 2 healed with node 1 at (lease 1: 1..3) and wrote (lease 2: 4). When node 3 shows
    // its journal, it is told to drop everything after 3 and take record 4 of lease 2.
    let now = Instant::now();
    let mut primary = ReplicationCore::new(cfg(2), journal(&[(1, 3)]));
    let mut replica = ReplicationCore::new(cfg(3), journal(&[(1, 5)]));
    primary.handle_role(now, Some(NodeId(2)), LeaseId(2));
    drain(&mut primary);
    primary.handle_message(
        now,
        NodeId(1),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            partition_id: 0,
            lease: 2,
            shape: Some(shape_of(&[(1, 1)], 3)),
        })),
    );
    drain(&mut primary);
    primary.on_persisted(now, 3);
    primary.handle_message(
        now,
        NodeId(1),
        msg(MsgKind::Receipt(Receipt {
            partition_id: 0,
            lease: 2,
            sequence: 3,
        })),
    );
    assert_eq!(
        drain(&mut primary),
        vec![Output::Active { lease: LeaseId(2) }]
    );
    primary.handle_put(
        now,
        producer(),
        "bmq://d/q".into(),
        guid(4),
        Bytes::from_static(b"x"),
        vec![],
        true,
        0,
    );
    drain(&mut primary);
    primary.handle_message(
        now,
        NodeId(3),
        msg(MsgKind::StateResponse(ReplicaStateResponse {
            partition_id: 0,
            lease: 2,
            shape: Some(replica.shape()),
        })),
    );
    let outs = drain(&mut primary);
    let new4 = primary.records()[3].clone();
    assert_eq!(new4.lease, 2);
    let sync = SyncRecords {
        partition_id: 0,
        lease: 2,
        truncate_after: 3,
        records: vec![new4.clone()],
        sender_last_sequence: 4,
    };
    assert_eq!(
        outs,
        vec![Output::Send {
            to: NodeId(3),
            message: msg(MsgKind::Sync(sync.clone()))
        }]
    );
    replica.handle_message(now, NodeId(2), msg(MsgKind::Sync(sync)));
    assert_eq!(
        drain(&mut replica),
        vec![Output::Persist {
            truncate_after: Some(3),
            records: vec![new4]
        }]
    );
    replica.on_persisted(now, 4);
    assert_eq!(
        drain(&mut replica),
        vec![Output::Send {
            to: NodeId(2),
            message: msg(MsgKind::Receipt(Receipt {
                partition_id: 0,
                lease: 2,
                sequence: 4
            }))
        }]
    );
}

#[test]
fn replica_drops_records_of_a_stale_lease() {
    // After answering lease 2's query, a replica ignores lease 1's primary.
    let now = Instant::now();
    let mut replica = ReplicationCore::new(cfg(3), vec![]);
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
    core.handle_role(now, Some(NodeId(2)), LeaseId(2));
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
        cores[0].handle_put(
            now,
            producer(),
            "bmq://d/q".into(),
            guid(i),
            Bytes::from_static(b"x"),
            vec![],
            true,
            0,
        );
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
        c.handle_role(now, Some(NodeId(2)), LeaseId(2));
    }
    let outs = settle(now, &mut cores, &[1]);
    assert!(
        outs.contains(&Output::Active { lease: LeaseId(2) }),
        "{outs:?}"
    );
    let held: Vec<Bytes> = cores[1]
        .records()
        .iter()
        .filter_map(|r| match &r.kind {
            Some(RecordKind::Message(m)) => Some(m.guid.clone()),
            _ => None,
        })
        .collect();
    for g in &acked {
        assert!(held.contains(g), "acked {g:?} lost");
    }
    assert_eq!(cores[1].records(), cores[2].records());
}
