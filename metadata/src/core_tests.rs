//! Tests of the replication core: exact outputs per step, then a 3-node harness.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bmq_proto::peer::{self, metadata_message::Kind as Msg};
use bmq_proto::{NodeId, PartitionId, Term};

use super::*;
use crate::membership::tests::member;
use crate::membership::{ClusterMembership, MemberRole, MembershipError};
use crate::state::tests::{assign, primaries};

fn n(id: u32) -> NodeId {
    NodeId(id)
}

fn lsn(term: u64, sequence: u64) -> Lsn {
    Lsn::new(Term(term), sequence)
}

fn members() -> Vec<NodeId> {
    vec![n(1), n(2), n(3)]
}

fn core(id: u32) -> MetadataCore {
    MetadataCore::new(n(id), &members(), 0, Recovered::fresh(2))
}

fn drain(core: &mut MetadataCore) -> Vec<MetadataOutput> {
    std::iter::from_fn(|| core.poll_output()).collect()
}

fn msg(kind: Msg) -> peer::MetadataMessage {
    peer::MetadataMessage { kind: Some(kind) }
}

fn record(l: Lsn, advisory: peer::Advisory) -> peer::MetadataMessage {
    msg(Msg::Record(peer::AdvisoryRecord {
        lsn: Some(l.into()),
        advisory: Some(advisory),
        timestamp_ms: 0,
    }))
}

fn commit(l: Lsn, committed: Lsn) -> peer::MetadataMessage {
    msg(Msg::Commit(peer::AdvisoryCommit {
        lsn: Some(l.into()),
        committed: Some(committed.into()),
    }))
}

fn ack(l: Lsn) -> peer::MetadataMessage {
    msg(Msg::Ack(peer::AdvisoryAck {
        lsn: Some(l.into()),
        membership_epoch: 0,
    }))
}

fn leader_advisory(state: &ClusterState) -> peer::Advisory {
    peer::Advisory {
        kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
            state: Some(state.to_snapshot()),
            continues: None,
        })),
    }
}

fn continuation(continues: Lsn) -> peer::Advisory {
    peer::Advisory {
        kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
            state: None,
            continues: Some(continues.into()),
        })),
    }
}

/// A sync state response whose last record is an advisory.
fn sync_response(term: u64, last: Lsn, committed: Lsn) -> peer::MetadataMessage {
    sync_answer(term, last, committed, last)
}

fn sync_answer(term: u64, last: Lsn, committed: Lsn, last_advisory: Lsn) -> peer::MetadataMessage {
    msg(Msg::SyncStateResponse(peer::LeaderSyncStateResponse {
        term,
        last_lsn: Some(last.into()),
        committed_lsn: Some(committed.into()),
        last_advisory_lsn: Some(last_advisory.into()),
    }))
}

fn persist_update(l: Lsn, advisory: peer::Advisory) -> MetadataOutput {
    MetadataOutput::Persist {
        record: LedgerRecord::Update { lsn: l, advisory },
    }
}

fn proposed(uri: &str, partition: u32) -> MetadataOutput {
    MetadataOutput::AssignmentProposed {
        uri: uri.into(),
        partition: PartitionId(partition),
    }
}

fn persist_commit(l: Lsn, committed: Lsn) -> MetadataOutput {
    MetadataOutput::Persist {
        record: LedgerRecord::Commit { lsn: l, committed },
    }
}

fn status(
    role: MetadataRole,
    term: u64,
    leader: Option<u32>,
    last: Lsn,
    committed: Lsn,
    uncommitted: usize,
) -> MetadataStatus {
    MetadataStatus {
        role,
        term: Term(term),
        leader: leader.map(NodeId),
        last_lsn: last,
        committed_lsn: committed,
        uncommitted,
    }
}

/// Node 1 becomes the active leader of term 1 with node 2's help; returns the time used.
fn active_leader(now: Instant) -> MetadataCore {
    let mut leader = core(1);
    leader.handle_leadership(now, Term(1), Some(n(1)));
    leader.handle_message(now, n(2), sync_response(1, Lsn::ZERO, Lsn::ZERO));
    leader.on_persisted(now, lsn(1, 1));
    leader.handle_message(now, n(2), ack(lsn(1, 1)));
    assert_eq!(leader.status().role, MetadataRole::ActiveLeader);
    drain(&mut leader);
    leader
}

#[test]
fn new_leader_syncs_then_commits_its_snapshot_and_becomes_active() {
    // Scenario: DESIGN.md §5 leader sync on a fresh cluster, every output checked.
    let now = Instant::now();
    let mut leader = core(1);
    leader.handle_leadership(now, Term(1), Some(n(1)));
    assert_eq!(
        drain(&mut leader),
        vec![
            MetadataOutput::RoleChanged {
                status: status(
                    MetadataRole::PassiveLeader,
                    1,
                    Some(1),
                    Lsn::ZERO,
                    Lsn::ZERO,
                    0
                )
            },
            MetadataOutput::Broadcast {
                message: msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 1 }))
            },
        ]
    );
    assert_eq!(
        leader.propose(now, assign("q", 0, 0)),
        Err(ProposeError::NotActive)
    );
    leader.handle_message(now, n(2), sync_response(1, Lsn::ZERO, Lsn::ZERO));
    let snapshot = leader_advisory(&ClusterState::new(2));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_update(lsn(1, 1), snapshot.clone()),
            MetadataOutput::Broadcast {
                message: record(lsn(1, 1), snapshot.clone())
            }
        ]
    );
    // A follower's ack alone is not a quorum: the leader's own ack waits for its fsync.
    leader.handle_message(now, n(2), ack(lsn(1, 1)));
    assert_eq!(drain(&mut leader), vec![]);
    leader.on_persisted(now, lsn(1, 1));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_commit(lsn(1, 2), lsn(1, 1)),
            MetadataOutput::Broadcast {
                message: commit(lsn(1, 2), lsn(1, 1))
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 1),
                advisory: snapshot
            },
            MetadataOutput::RoleChanged {
                status: status(
                    MetadataRole::ActiveLeader,
                    1,
                    Some(1),
                    lsn(1, 2),
                    lsn(1, 1),
                    0
                )
            },
        ]
    );
}

#[test]
fn leader_commits_at_quorum_and_applies_only_on_commit() {
    // Scenario: an advisory is persisted and broadcast, then committed once 2 of 3 hold it.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let advisory = assign("bmq://d/q", 1, 0);
    assert_eq!(leader.propose(now, advisory.clone()), Ok(lsn(1, 3)));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_update(lsn(1, 3), advisory.clone()),
            proposed("bmq://d/q", 1),
            MetadataOutput::Broadcast {
                message: record(lsn(1, 3), advisory.clone())
            }
        ]
    );
    // Not applied before the commit; visible in the tip state.
    assert!(leader.state().queues.is_empty());
    assert!(leader.tip_state().queues.contains_key("bmq://d/q"));
    // Validated against the tip: a conflicting assignment is refused right away.
    assert!(matches!(
        leader.propose(now, assign("bmq://d/q", 0, 1)),
        Err(ProposeError::Invalid(_))
    ));
    leader.on_persisted(now, lsn(1, 3));
    assert_eq!(drain(&mut leader), vec![]);
    leader.handle_message(now, n(3), ack(lsn(1, 3)));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_commit(lsn(1, 4), lsn(1, 3)),
            MetadataOutput::Broadcast {
                message: commit(lsn(1, 4), lsn(1, 3))
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 3),
                advisory
            },
        ]
    );
    assert_eq!(leader.state().queues["bmq://d/q"].partition, PartitionId(1));
    // A late ack of an already committed record changes nothing.
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    assert_eq!(drain(&mut leader), vec![]);
}

#[test]
fn committing_an_lsn_commits_every_smaller_one() {
    // Scenario: two proposals; the ack of the second commits both in order.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let (a, b) = (assign("a", 0, 0), assign("b", 1, 1));
    leader.propose(now, a.clone()).unwrap();
    leader.propose(now, b.clone()).unwrap();
    leader.on_persisted(now, lsn(1, 4));
    drain(&mut leader);
    leader.handle_message(now, n(2), ack(lsn(1, 4)));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_commit(lsn(1, 5), lsn(1, 4)),
            MetadataOutput::Broadcast {
                message: commit(lsn(1, 5), lsn(1, 4))
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 3),
                advisory: a
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 4),
                advisory: b
            },
        ]
    );
}

#[test]
fn a_commit_that_catches_up_with_the_tip_shares_the_tip_state() {
    // Scenario: two proposals; the commit of the first leaves the second pending, so the
    // committed state is its own (the first applied); the commit of the second catches up
    // with the tip, so the committed state is the tip state itself (one copy in memory).
    let now = Instant::now();
    let mut leader = active_leader(now);
    leader.propose(now, assign("a", 0, 0)).unwrap();
    leader.propose(now, assign("b", 1, 1)).unwrap();
    leader.on_persisted(now, lsn(1, 4));
    drain(&mut leader);
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    drain(&mut leader);
    assert!(leader.state().queues.contains_key("a"));
    assert!(!leader.state().queues.contains_key("b"));
    assert!(!leader.state().queues.ptr_eq(&leader.tip_state().queues));
    leader.handle_message(now, n(2), ack(lsn(1, 4)));
    drain(&mut leader);
    assert_eq!(leader.status().uncommitted, 0);
    assert_eq!(leader.state(), leader.tip_state());
    assert!(leader.state().queues.ptr_eq(&leader.tip_state().queues));
    assert_eq!(leader.state().queues["b"].partition, PartitionId(1));
}

#[test]
fn propose_is_refused_by_followers_and_passive_leaders() {
    // Scenario: only an active leader accepts proposals.
    let now = Instant::now();
    let mut follower = core(2);
    assert_eq!(
        follower.propose(now, assign("q", 0, 0)),
        Err(ProposeError::NotLeader { leader: None })
    );
    follower.handle_leadership(now, Term(1), Some(n(1)));
    assert_eq!(
        follower.propose(now, assign("q", 0, 0)),
        Err(ProposeError::NotLeader { leader: Some(n(1)) })
    );
    let mut passive = core(1);
    passive.set_quorum(3);
    passive.handle_leadership(now, Term(1), Some(n(1)));
    passive.handle_message(now, n(2), sync_response(1, Lsn::ZERO, Lsn::ZERO));
    assert_eq!(passive.status().role, MetadataRole::PassiveLeader);
    assert_eq!(
        passive.propose(now, assign("q", 0, 0)),
        Err(ProposeError::NotActive)
    );
}

/// Node 2 following node 1 at term 1, holding the term's committed snapshot (1:1, commit 1:2).
fn follower(now: Instant) -> MetadataCore {
    let mut f = core(2);
    f.handle_leadership(now, Term(1), Some(n(1)));
    f.handle_message(
        now,
        n(1),
        record(lsn(1, 1), leader_advisory(&ClusterState::new(2))),
    );
    f.on_persisted(now, lsn(1, 1));
    f.handle_message(now, n(1), commit(lsn(1, 2), lsn(1, 1)));
    f.on_persisted(now, lsn(1, 2));
    drain(&mut f);
    assert_eq!(f.status().committed_lsn, lsn(1, 1));
    f
}

#[test]
fn follower_persists_then_acks_and_applies_on_commit() {
    // Scenario: a follower writes a record, acks it after the fsync, applies it at the commit.
    let now = Instant::now();
    let mut f = follower(now);
    let advisory = assign("q", 0, 0);
    f.handle_message(now, n(1), record(lsn(1, 3), advisory.clone()));
    assert_eq!(
        drain(&mut f),
        vec![
            persist_update(lsn(1, 3), advisory.clone()),
            proposed("q", 0)
        ]
    );
    f.on_persisted(now, lsn(1, 3));
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: ack(lsn(1, 3))
        }]
    );
    assert!(f.state().queues.is_empty());
    f.handle_message(now, n(1), commit(lsn(1, 4), lsn(1, 3)));
    assert_eq!(
        drain(&mut f),
        vec![
            persist_commit(lsn(1, 4), lsn(1, 3)),
            MetadataOutput::Committed {
                lsn: lsn(1, 3),
                advisory
            },
        ]
    );
    assert!(f.state().queues.contains_key("q"));
    assert_eq!(f.status().committed_lsn, lsn(1, 3));
}

#[test]
fn follower_rejects_wrong_leader_stale_duplicate_and_gap() {
    // Scenario: every kind of bad record is dropped and counted; a gap triggers a FollowerHello.
    let now = Instant::now();
    let mut f = follower(now);
    // Wrong leader.
    f.handle_message(now, n(3), record(lsn(1, 3), assign("q", 0, 0)));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().wrong_leader, 1);
    // Duplicate (durable): re-acked, not re-persisted.
    f.handle_message(
        now,
        n(1),
        record(lsn(1, 1), leader_advisory(&ClusterState::new(2))),
    );
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: ack(lsn(1, 1))
        }]
    );
    assert_eq!(f.counters().duplicate, 1);
    // Gap: 1:4 after 1:2.
    f.handle_message(now, n(1), record(lsn(1, 4), assign("q", 0, 0)));
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: msg(Msg::FollowerHello(peer::FollowerHello {
                term: 1,
                last_lsn: Some(lsn(1, 2).into()),
                last_advisory_lsn: Some(lsn(1, 1).into()),
            })),
        }]
    );
    assert_eq!(f.counters().gap, 1);
    // Future term (the elector has not announced it) and, after moving on, stale term.
    f.handle_message(
        now,
        n(1),
        record(lsn(2, 1), leader_advisory(&ClusterState::new(2))),
    );
    assert_eq!(f.counters().future_term, 1);
    f.handle_leadership(now, Term(2), Some(n(1)));
    drain(&mut f);
    f.handle_message(now, n(1), record(lsn(1, 3), assign("q", 0, 0)));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().stale_term, 1);
    // Malformed: no advisory, no kind.
    f.handle_message(
        now,
        n(1),
        msg(Msg::Record(peer::AdvisoryRecord {
            lsn: Some(lsn(2, 1).into()),
            advisory: None,
            timestamp_ms: 0,
        })),
    );
    f.handle_message(now, n(1), peer::MetadataMessage { kind: None });
    assert_eq!(f.counters().invalid, 2);
    // From a non-member.
    f.handle_message(
        now,
        n(9),
        record(lsn(2, 1), leader_advisory(&ClusterState::new(2))),
    );
    assert_eq!(f.counters().unknown_sender, 1);
    assert_eq!(f.status().last_lsn, lsn(1, 2));
}

#[test]
fn follower_gates_records_until_the_term_snapshot() {
    // Scenario: 1:2 and its commit arrive before the snapshot 1:1; they wait, then apply in order.
    let now = Instant::now();
    let mut f = core(2);
    f.handle_leadership(now, Term(1), Some(n(1)));
    drain(&mut f);
    let q = assign("q", 0, 0);
    f.handle_message(now, n(1), record(lsn(1, 2), q.clone()));
    f.handle_message(now, n(1), commit(lsn(1, 3), lsn(1, 2)));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().gated, 2);
    let snapshot = leader_advisory(&ClusterState::new(2));
    f.handle_message(now, n(1), record(lsn(1, 1), snapshot.clone()));
    assert_eq!(
        drain(&mut f),
        vec![
            persist_update(lsn(1, 1), snapshot.clone()),
            persist_update(lsn(1, 2), q.clone()),
            proposed("q", 0),
            persist_commit(lsn(1, 3), lsn(1, 2)),
            MetadataOutput::Committed {
                lsn: lsn(1, 1),
                advisory: snapshot
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 2),
                advisory: q
            },
        ]
    );
    // A term's first record must be its snapshot.
    let mut g = core(3);
    g.handle_leadership(now, Term(1), Some(n(1)));
    g.handle_message(now, n(1), record(lsn(1, 1), assign("q", 0, 0)));
    assert_eq!(g.counters().invalid, 1);
}

#[test]
fn follower_without_the_term_snapshot_says_hello_after_a_while() {
    // Scenario: a follower that sees nothing of its leader's term asks for a catch up.
    let now = Instant::now();
    let mut f = core(2);
    f.handle_leadership(now, Term(1), Some(n(1)));
    drain(&mut f);
    let deadline = f.poll_timeout().expect("hello timer");
    assert_eq!(deadline, now + Duration::from_millis(500));
    f.handle_timeout(deadline);
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: msg(Msg::FollowerHello(peer::FollowerHello {
                term: 1,
                last_lsn: Some(Lsn::ZERO.into()),
                last_advisory_lsn: Some(Lsn::ZERO.into()),
            })),
        }]
    );
    assert_eq!(
        f.poll_timeout(),
        Some(deadline + Duration::from_millis(500))
    );
}

#[test]
fn leader_sync_fetches_the_state_of_the_most_advanced_node() {
    // Scenario: the new leader is behind node 3, which holds an uncommitted advisory; the term
    // snapshot is built from node 3's state.
    let now = Instant::now();
    let mut base = ClusterState::new(2);
    base.apply(&primaries(&[(0, Some(1), 1)])).unwrap();
    let recovered = Recovered {
        committed_state: base.clone(),
        committed_lsn: lsn(1, 1),
        uncommitted: vec![],
        last_lsn: lsn(1, 2),
    };
    let mut leader = MetadataCore::new(n(1), &members(), 0, recovered);
    leader.handle_leadership(now, Term(2), Some(n(1)));
    drain(&mut leader);
    leader.handle_message(now, n(3), sync_response(2, lsn(1, 3), lsn(1, 1)));
    assert_eq!(
        drain(&mut leader),
        vec![MetadataOutput::Send {
            to: n(3),
            message: msg(Msg::SyncDataQuery(peer::LeaderSyncDataQuery {
                term: 2,
                after: Some(lsn(1, 1).into())
            }))
        }]
    );
    // Retried until answered.
    leader.handle_timeout(now + Duration::from_millis(200));
    assert_eq!(
        drain(&mut leader),
        vec![MetadataOutput::Send {
            to: n(3),
            message: msg(Msg::SyncDataQuery(peer::LeaderSyncDataQuery {
                term: 2,
                after: Some(lsn(1, 1).into())
            }))
        }]
    );
    let mut advanced = base.clone();
    advanced.apply(&assign("uncommitted-on-3", 0, 0)).unwrap();
    // A response from another node is ignored.
    let data = msg(Msg::SyncDataResponse(peer::LeaderSyncDataResponse {
        term: 2,
        last_lsn: Some(lsn(1, 3).into()),
        state: Some(advanced.to_snapshot()),
        records: vec![],
    }));
    leader.handle_message(now, n(2), data.clone());
    assert_eq!(drain(&mut leader), vec![]);
    leader.handle_message(now, n(3), data);
    let snapshot = leader_advisory(&advanced);
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_update(lsn(2, 1), snapshot.clone()),
            MetadataOutput::Broadcast {
                message: record(lsn(2, 1), snapshot)
            }
        ]
    );
}

#[test]
fn leader_sync_fetches_only_the_advisories_it_lacks_from_a_node_with_its_history() {
    // Scenario: failover flat in the state. The new leader (node 1, last advisory 1:1) is
    // behind node 3, which holds 1:1 and an uncommitted 1:3: node 3 answers the fetch with the
    // advisory after 1:1 only, the leader appends it at its own LSN and starts its term as the
    // continuation of 1:3, which node 3 takes.
    let now = Instant::now();
    let mut base = ClusterState::new(2);
    base.apply(&primaries(&[(0, Some(1), 1)])).unwrap();
    let holding = |uncommitted: Vec<(Lsn, peer::Advisory)>, last: Lsn| Recovered {
        committed_state: base.clone(),
        committed_lsn: lsn(1, 1),
        uncommitted,
        last_lsn: last,
    };
    let mut third = MetadataCore::new(
        n(3),
        &members(),
        0,
        holding(vec![(lsn(1, 3), assign("on-3", 0, 0))], lsn(1, 3)),
    );
    third.handle_leadership(now, Term(2), Some(n(1)));
    drain(&mut third);
    let mut leader = MetadataCore::new(n(1), &members(), 0, holding(vec![], lsn(1, 2)));
    leader.handle_leadership(now, Term(2), Some(n(1)));
    drain(&mut leader);
    leader.handle_message(now, n(3), sync_response(2, lsn(1, 3), lsn(1, 1)));
    let query = messages_to(drain(&mut leader), n(3));
    assert_eq!(query.len(), 1, "{query:?}");
    third.handle_message(now, n(1), query[0].clone());
    let answer = messages_to(drain(&mut third), n(1));
    let Some(Msg::SyncDataResponse(response)) = &answer[0].kind else {
        panic!("{answer:?}");
    };
    assert!(response.state.is_none(), "no state sent: {response:?}");
    assert_eq!(response.records.len(), 1);
    leader.handle_message(now, n(3), answer[0].clone());
    let out = drain(&mut leader);
    assert_eq!(
        out[0],
        persist_update(lsn(1, 3), assign("on-3", 0, 0)),
        "{out:?}"
    );
    assert!(out.contains(&persist_update(lsn(2, 1), continuation(lsn(1, 3)))));
    assert!(leader.tip_state().queues.contains_key("on-3"));
    let to_3 = messages_to(out.clone(), n(3));
    assert_eq!(to_3, vec![record(lsn(2, 1), continuation(lsn(1, 3)))]);
    // Node 2 did not answer the sync: it gets the term start as proposed (and, its history
    // being older, would say hello for the whole state).
    let to_2 = messages_to(out, n(2));
    assert_eq!(to_2, to_3);
    third.handle_message(now, n(1), to_3[0].clone());
    assert_eq!(third.status().last_lsn, lsn(2, 1));
    assert_eq!(third.counters().continuation_mismatches, 0);
}

#[test]
fn follower_answers_sync_queries_only_from_the_leader_it_follows() {
    // Scenario: sync queries from a node that is not our leader at that term are dropped.
    let now = Instant::now();
    let mut f = follower(now);
    f.handle_message(
        now,
        n(3),
        msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 1 })),
    );
    assert_eq!(drain(&mut f), vec![]);
    f.handle_leadership(now, Term(2), Some(n(3)));
    drain(&mut f);
    f.handle_message(
        now,
        n(3),
        msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 2 })),
    );
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(3),
            message: sync_answer(2, lsn(1, 2), lsn(1, 1), lsn(1, 1))
        }]
    );
    // From then on, the old leader's records are stale.
    f.handle_message(now, n(1), record(lsn(1, 3), assign("q", 0, 0)));
    assert_eq!(drain(&mut f), vec![]);
    // The query from 3 at term 1 and this record: neither comes from the leader we follow.
    assert_eq!(f.counters().wrong_leader, 2);
}

#[test]
fn leader_resends_unacked_records() {
    // Scenario: no follower acked within 500 ms; the record is re-sent to each, until committed.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let advisory = assign("q", 0, 0);
    leader.propose(now, advisory.clone()).unwrap();
    leader.on_persisted(now, lsn(1, 3));
    drain(&mut leader);
    let deadline = leader.poll_timeout().expect("resend timer");
    assert_eq!(deadline, now + Duration::from_millis(500));
    leader.handle_timeout(deadline);
    assert_eq!(
        drain(&mut leader),
        vec![
            MetadataOutput::Send {
                to: n(2),
                message: record(lsn(1, 3), advisory.clone())
            },
            MetadataOutput::Send {
                to: n(3),
                message: record(lsn(1, 3), advisory)
            },
        ]
    );
    assert_eq!(leader.counters().records_resent, 2);
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    drain(&mut leader);
    // Committed: nothing to resend; the only deadline left is the refresh of the commit.
    assert_eq!(
        leader.poll_timeout(),
        Some(now + MetadataConfig::default().commit_refresh)
    );
}

#[test]
fn idle_leader_refreshes_its_latest_commit_and_a_follower_that_lost_it_catches_up() {
    // Scenario: the broadcast of the leader's latest commit record is lost to a follower and
    // nothing follows it; the idle leader re-broadcasts it after commit_refresh, the follower
    // takes it, and a follower in step ignores it without counting a duplicate.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let mut follower = follower_in_step(&mut leader, 2, now);
    let q = assign("q", 0, 0);
    leader.propose(now, q.clone()).unwrap();
    leader.on_persisted(now, lsn(1, 3));
    drain(&mut leader);
    follower.handle_message(now, n(1), record(lsn(1, 3), q));
    follower.on_persisted(now, lsn(1, 3));
    drain(&mut follower);
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    // The commit record 1:4 is broadcast and lost.
    assert_eq!(
        messages_to(drain(&mut leader), n(2)),
        vec![commit(lsn(1, 4), lsn(1, 3))]
    );
    let refresh = now + Duration::from_millis(500);
    assert_eq!(leader.poll_timeout(), Some(refresh));
    leader.handle_timeout(refresh - Duration::from_millis(1));
    assert_eq!(drain(&mut leader), vec![]);
    leader.handle_timeout(refresh);
    let out = drain(&mut leader);
    assert_eq!(
        out,
        vec![MetadataOutput::Broadcast {
            message: commit(lsn(1, 4), lsn(1, 3))
        }]
    );
    assert_eq!(leader.counters().commits_refreshed, 1);
    assert_eq!(
        leader.poll_timeout(),
        Some(refresh + Duration::from_millis(500))
    );
    follower.handle_message(refresh, n(1), commit(lsn(1, 4), lsn(1, 3)));
    let out = drain(&mut follower);
    assert_eq!(out.first(), Some(&persist_commit(lsn(1, 4), lsn(1, 3))));
    assert_eq!(follower.status().committed_lsn, lsn(1, 3));
    assert_eq!(follower.state(), leader.state());
    // The next refresh finds it in step: nothing happens, nothing is counted.
    let duplicates = follower.counters().duplicate;
    follower.handle_message(refresh, n(1), commit(lsn(1, 4), lsn(1, 3)));
    assert_eq!(drain(&mut follower), vec![]);
    assert_eq!(follower.counters().duplicate, duplicates);
}

#[test]
fn late_follower_catches_up() {
    // Scenario: node 3 missed the whole term; its hello gets a CatchUp, it resets its ledger and
    // acks the uncommitted records.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let (a, b) = (assign("a", 0, 0), assign("b", 1, 1));
    leader.propose(now, a).unwrap();
    leader.on_persisted(now, lsn(1, 3));
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    leader.propose(now, b.clone()).unwrap();
    leader.on_persisted(now, lsn(1, 5));
    drain(&mut leader);
    let mut late = core(3);
    late.handle_leadership(now, Term(1), Some(n(1)));
    drain(&mut late);
    late.handle_timeout(now + Duration::from_millis(500));
    let hello = match drain(&mut late).pop() {
        Some(MetadataOutput::Send { message, .. }) => message,
        other => panic!("expected a hello, got {other:?}"),
    };
    leader.handle_message(now, n(3), hello);
    let out = drain(&mut leader);
    assert_eq!(out.len(), 1, "{out:?}");
    let MetadataOutput::Send { to, message } = out.into_iter().next().unwrap() else {
        panic!()
    };
    assert_eq!(to, n(3));
    late.handle_message(now, n(1), message);
    assert_eq!(
        drain(&mut late),
        vec![MetadataOutput::ResetLedger {
            state: leader.state().clone(),
            committed_lsn: lsn(1, 3),
            uncommitted: vec![(lsn(1, 5), b.clone())],
        }]
    );
    late.on_persisted(now, lsn(1, 5));
    assert_eq!(
        drain(&mut late),
        vec![MetadataOutput::Send {
            to: n(1),
            message: ack(lsn(1, 5))
        }]
    );
    assert_eq!(late.state(), leader.state());
    // The follower is back in sequence: the next commit (1:6) is accepted.
    leader.handle_message(now, n(3), ack(lsn(1, 5)));
    let out = drain(&mut leader);
    assert!(out.contains(&MetadataOutput::Broadcast {
        message: commit(lsn(1, 6), lsn(1, 5))
    }));
    late.handle_message(now, n(1), commit(lsn(1, 6), lsn(1, 5)));
    assert_eq!(
        drain(&mut late),
        vec![
            persist_commit(lsn(1, 6), lsn(1, 5)),
            MetadataOutput::Committed {
                lsn: lsn(1, 5),
                advisory: b
            }
        ]
    );
}

#[test]
fn catch_up_resyncs_past_trailing_commit_records() {
    // Scenario: the leader's last records are commits; the CatchUp is followed by the latest
    // commit so the follower's next expected sequence matches the leader's.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let mut late = core(3);
    late.handle_leadership(now, Term(1), Some(n(1)));
    drain(&mut late);
    leader.handle_message(
        now,
        n(3),
        msg(Msg::FollowerHello(peer::FollowerHello {
            term: 1,
            last_lsn: Some(Lsn::ZERO.into()),
            last_advisory_lsn: None,
        })),
    );
    let out = drain(&mut leader);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(
        out[1],
        MetadataOutput::Send {
            to: n(3),
            message: commit(lsn(1, 2), lsn(1, 1))
        }
    );
    for o in out {
        let MetadataOutput::Send { message, .. } = o else {
            panic!()
        };
        late.handle_message(now, n(1), message);
    }
    assert_eq!(late.status().last_lsn, lsn(1, 2));
    let q = assign("q", 0, 0);
    leader.propose(now, q.clone()).unwrap();
    drain(&mut leader);
    late.handle_message(now, n(1), record(lsn(1, 3), q.clone()));
    let out = drain(&mut late);
    assert_eq!(
        out[out.len() - 2..],
        [persist_update(lsn(1, 3), q), proposed("q", 0)]
    );
    assert_eq!(late.counters().gap, 0);
}

#[test]
fn follower_rejoining_its_leader_in_the_same_term_asks_for_a_catch_up() {
    // Scenario (found by the chaos suite): a follower cut off from its leader misses records;
    // the leader's term goes on, so no new term resets it. When it follows the same leader again
    // it says hello after hello_retry, and a catch up that shows it missed nothing ends it.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let mut f = core(2);
    f.handle_leadership(now, Term(1), Some(n(1)));
    leader.handle_message(
        now,
        n(2),
        msg(Msg::FollowerHello(peer::FollowerHello {
            term: 1,
            last_lsn: Some(Lsn::ZERO.into()),
            last_advisory_lsn: None,
        })),
    );
    for o in drain(&mut leader) {
        let MetadataOutput::Send { message, .. } = o else {
            panic!("{o:?}")
        };
        f.handle_message(now, n(1), message);
    }
    f.on_persisted(now, f.status().last_lsn);
    drain(&mut f);
    let in_sync = f.status();
    f.handle_leadership(now, Term(1), None);
    f.handle_leadership(now, Term(1), Some(n(1)));
    drain(&mut f);
    let deadline = f.poll_timeout().expect("hello timer");
    assert_eq!(deadline, now + Duration::from_millis(500));
    f.handle_timeout(deadline);
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: msg(Msg::FollowerHello(peer::FollowerHello {
                term: 1,
                last_lsn: Some(in_sync.last_lsn.into()),
                last_advisory_lsn: Some(lsn(1, 1).into()),
            })),
        }]
    );
    // The leader's answer shows nothing was missed: no more hellos.
    leader.handle_message(
        deadline,
        n(2),
        msg(Msg::FollowerHello(peer::FollowerHello {
            term: 1,
            last_lsn: Some(in_sync.last_lsn.into()),
            last_advisory_lsn: None,
        })),
    );
    for o in drain(&mut leader) {
        let MetadataOutput::Send { message, .. } = o else {
            panic!("{o:?}")
        };
        f.handle_message(deadline, n(1), message);
    }
    drain(&mut f);
    assert_eq!(f.status().committed_lsn, in_sync.committed_lsn);
    assert_eq!(f.poll_timeout(), None);
}

// ---------------------------------------------------------------- 3-node harness

/// A tiny network of cores: messages are queued and delivered one by one; Persist is a fake that
/// calls `on_persisted` at once; nodes can be killed; filters drop chosen messages.
struct Harness {
    nodes: BTreeMap<NodeId, MetadataCore>,
    down: BTreeSet<NodeId>,
    queue: VecDeque<(NodeId, NodeId, peer::MetadataMessage)>,
    now: Instant,
    committed: BTreeMap<NodeId, Vec<(Lsn, peer::Advisory)>>,
    #[allow(clippy::type_complexity)]
    drop_if: Option<Box<dyn Fn(NodeId, NodeId, &peer::MetadataMessage) -> bool>>,
}

impl Harness {
    fn new() -> Self {
        Self::with_nodes(members().into_iter().map(|id| {
            (
                id,
                MetadataCore::new(id, &members(), 0, Recovered::fresh(4)),
            )
        }))
    }

    fn with_nodes(nodes: impl IntoIterator<Item = (NodeId, MetadataCore)>) -> Self {
        Harness {
            nodes: nodes.into_iter().collect(),
            down: BTreeSet::new(),
            queue: VecDeque::new(),
            now: Instant::now(),
            committed: BTreeMap::new(),
            drop_if: None,
        }
    }

    fn node(&mut self, id: u32) -> &mut MetadataCore {
        self.nodes.get_mut(&n(id)).unwrap()
    }

    fn state(&self, id: u32) -> ClusterState {
        self.nodes[&n(id)].state().clone()
    }

    fn pump(&mut self) {
        for (&id, core) in self.nodes.iter_mut() {
            if self.down.contains(&id) {
                continue;
            }
            while let Some(output) = core.poll_output() {
                match output {
                    MetadataOutput::Persist { record } => core.on_persisted(self.now, record.lsn()),
                    MetadataOutput::ResetLedger {
                        committed_lsn,
                        uncommitted,
                        ..
                    } => {
                        let last = uncommitted
                            .iter()
                            .map(|(l, _)| *l)
                            .fold(committed_lsn, Lsn::max);
                        core.on_persisted(self.now, last);
                    }
                    MetadataOutput::Send { to, message } => self.queue.push_back((id, to, message)),
                    MetadataOutput::Broadcast { message } => {
                        let peers: Vec<NodeId> = core.peers().collect();
                        for m in peers {
                            self.queue.push_back((id, m, message.clone()));
                        }
                    }
                    MetadataOutput::Committed { lsn, advisory } => {
                        self.committed.entry(id).or_default().push((lsn, advisory))
                    }
                    MetadataOutput::RoleChanged { .. }
                    | MetadataOutput::AssignmentProposed { .. } => {}
                }
            }
        }
    }

    /// Delivers until quiet (bounded).
    fn run(&mut self) {
        for _ in 0..100_000 {
            self.pump();
            let Some((from, to, message)) = self.queue.pop_front() else {
                return;
            };
            if self.down.contains(&to) || self.down.contains(&from) {
                continue;
            }
            if self.drop_if.as_ref().is_some_and(|f| f(from, to, &message)) {
                continue;
            }
            let now = self.now;
            self.node(to.0).handle_message(now, from, message);
        }
        panic!("the harness did not quiesce");
    }

    fn elect(&mut self, term: u64, leader: u32) {
        let now = self.now;
        for (&id, core) in self.nodes.iter_mut() {
            if !self.down.contains(&id) {
                core.handle_leadership(now, Term(term), Some(n(leader)));
            }
        }
        self.run();
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        let now = self.now;
        for (&id, core) in self.nodes.iter_mut() {
            if !self.down.contains(&id) {
                core.handle_timeout(now);
            }
        }
        self.run();
    }
}

#[test]
fn harness_failover_keeps_every_committed_queue() {
    // Scenario: A leads term 1, assigns primaries and queues, dies; B leads term 2 and every
    // committed queue is still there on B and C.
    let mut h = Harness::new();
    h.elect(1, 1);
    assert_eq!(h.node(1).status().role, MetadataRole::ActiveLeader);
    let now = h.now;
    let available: BTreeSet<NodeId> = members().into_iter().collect();
    let plan = crate::assignment::plan_primary_assignment(h.node(1).state(), &available);
    assert_eq!(plan.len(), 4);
    h.node(1)
        .propose(
            now,
            peer::Advisory {
                kind: Some(peer::advisory::Kind::PartitionPrimary(
                    peer::PartitionPrimaryAdvisory { partitions: plan },
                )),
            },
        )
        .unwrap();
    h.run();
    for i in 0..6 {
        // Half requested on the leader, half forwarded by a follower.
        let on = if i % 2 == 0 { 1 } else { 2 };
        h.node(on)
            .request_queue_assignment(now, &format!("bmq://d/q{i}"));
        h.run();
    }
    // Asking again for a known queue proposes nothing.
    h.node(1).request_queue_assignment(now, "bmq://d/q0");
    assert_eq!(h.node(1).status().uncommitted, 0);
    let state_a = h.node(1).state().clone();
    assert_eq!(state_a.queues.len(), 6);
    let counts = state_a.queue_counts();
    assert!(counts.values().all(|c| *c >= 1 && *c <= 2), "{counts:?}");
    for id in [2, 3] {
        assert_eq!(h.node(id).state(), &state_a, "node {id} converged");
    }
    // A dies; B leads term 2.
    h.down.insert(n(1));
    h.elect(2, 2);
    assert_eq!(h.node(2).status().role, MetadataRole::ActiveLeader);
    assert_eq!(h.node(2).state(), &state_a);
    assert_eq!(h.node(3).state(), &state_a);
    assert_eq!(h.node(2).status().committed_lsn, lsn(2, 1));
    // The new leader keeps assigning with fresh keys.
    let now = h.now;
    h.node(3).request_queue_assignment(now, "bmq://d/new");
    h.run();
    assert_eq!(h.node(2).state().queues["bmq://d/new"].queue_key, 6);
    assert_eq!(h.state(3), h.state(2));
    // Every node saw the same committed advisories at the same LSNs (where both saw them).
    let (b, c) = (&h.committed[&n(2)], &h.committed[&n(3)]);
    assert_eq!(b, c);
}

#[test]
fn harness_uncommitted_advisory_of_the_most_advanced_node_survives() {
    // Scenario: A's advisory reaches only B before A dies (so it is not committed); C leads
    // term 2, finds B most advanced, and the advisory is committed in C's term snapshot.
    let mut h = Harness::new();
    h.elect(1, 1);
    // Acks of this advisory are lost, and C never receives it.
    h.drop_if = Some(Box::new(|from, to, m| {
        let is_ack = matches!(m.kind, Some(Msg::Ack(_)));
        let is_record_to_c = matches!(m.kind, Some(Msg::Record(_))) && to == NodeId(3);
        (is_ack && to == NodeId(1) && from != NodeId(1)) || is_record_to_c
    }));
    let now = h.now;
    h.node(1)
        .propose(now, assign("bmq://d/survivor", 0, 0))
        .unwrap();
    h.run();
    assert!(h
        .node(2)
        .tip_state()
        .queues
        .contains_key("bmq://d/survivor"));
    assert!(h.node(1).state().queues.is_empty());
    h.drop_if = None;
    h.down.insert(n(1));
    h.elect(2, 3);
    assert_eq!(h.node(3).status().role, MetadataRole::ActiveLeader);
    assert!(h.node(3).state().queues.contains_key("bmq://d/survivor"));
    assert_eq!(h.state(2), h.state(3));
}

/// Whether `m` is a term start (`(term, 1)`) carrying the whole state.
fn is_whole_term_start(m: &peer::MetadataMessage) -> bool {
    matches!(
        &m.kind,
        Some(Msg::Record(peer::AdvisoryRecord {
            advisory: Some(peer::Advisory {
                kind: Some(peer::advisory::Kind::Leader(peer::LeaderAdvisory {
                    state: Some(_),
                    ..
                })),
            }),
            ..
        }))
    )
}

#[test]
fn harness_a_failover_continues_the_history_without_sending_the_state() {
    // Scenario: DESIGN.md §5a, failover flat in the state. A commits queues with B and C,
    // then one more advisory reaches B and C but not A's quorum count (their acks are lost);
    // A dies. B leads term 2 with the same history as C: its term start only names the last
    // advisory (no snapshot is built, sent or written), keeps the uncommitted advisory of
    // term 1, and its commit commits that advisory on B and C at its own LSN.
    let mut h = Harness::new();
    h.elect(1, 1);
    let now = h.now;
    for i in 0..3 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
        h.run();
    }
    h.drop_if = Some(Box::new(|_, to, m| {
        matches!(m.kind, Some(Msg::Ack(_))) && to == NodeId(1)
    }));
    let last = h.node(1).propose(now, assign("uncommitted", 1, 3)).unwrap();
    h.run();
    assert!(!h.node(2).state().queues.contains_key("uncommitted"));
    let whole_sent = std::rc::Rc::new(std::cell::Cell::new(0));
    let seen = whole_sent.clone();
    h.drop_if = Some(Box::new(move |_, _, m| {
        if is_whole_term_start(m) {
            seen.set(seen.get() + 1);
        }
        false
    }));
    h.down.insert(n(1));
    h.elect(2, 2);
    assert_eq!(h.node(2).status().role, MetadataRole::ActiveLeader);
    assert_eq!(whole_sent.get(), 0, "no follower needed the whole state");
    assert_eq!(h.node(2).counters().term_snapshots_sent, 0);
    for id in [2, 3] {
        assert!(
            h.node(id).state().queues.contains_key("uncommitted"),
            "node {id}"
        );
        let committed = &h.committed[&n(id)];
        let start = committed
            .iter()
            .position(|(l, _)| *l == lsn(2, 1))
            .expect("the term start is committed");
        assert_eq!(committed[start].1, continuation(last));
        assert_eq!(
            committed[start - 1].0,
            last,
            "node {id} commits term 1's advisory first"
        );
    }
    assert_eq!(h.state(2), h.state(3));
    assert_eq!(h.node(3).counters().continuation_mismatches, 0);
}

#[test]
fn harness_a_follower_with_another_history_gets_the_whole_state_as_the_term_start() {
    // Scenario: A's advisory reaches only B before A dies; B leads term 2 and is the most
    // advanced. C announced an older last advisory in the sync, so C's copy of the term start
    // carries the whole state (and C drops nothing it needs); B's own record only continues.
    let mut h = Harness::new();
    h.elect(1, 1);
    h.drop_if = Some(Box::new(|from, to, m| {
        let is_ack = matches!(m.kind, Some(Msg::Ack(_)));
        let is_record_to_c = matches!(m.kind, Some(Msg::Record(_))) && to == NodeId(3);
        (is_ack && to == NodeId(1) && from != NodeId(1)) || is_record_to_c
    }));
    let now = h.now;
    let last = h.node(1).propose(now, assign("only-on-b", 0, 0)).unwrap();
    h.run();
    h.drop_if = None;
    h.down.insert(n(1));
    h.elect(2, 2);
    assert_eq!(h.node(2).status().role, MetadataRole::ActiveLeader);
    assert_eq!(h.node(2).counters().term_snapshots_sent, 1);
    assert!(h.node(3).state().queues.contains_key("only-on-b"));
    assert_eq!(h.state(2), h.state(3));
    let b = &h.committed[&n(2)];
    assert!(b.contains(&(lsn(2, 1), continuation(last))), "{b:?}");
}

#[test]
fn a_term_start_that_continues_another_history_is_refused_with_a_hello() {
    // Scenario: a follower that lost records (a crash after it answered the sync) is sent a
    // term start naming a last advisory it does not hold: it takes nothing, says hello, and
    // the passive leader answers with the whole state as the term start.
    let now = Instant::now();
    let mut f = follower(now);
    f.handle_leadership(now, Term(2), Some(n(3)));
    drain(&mut f);
    f.handle_message(now, n(3), record(lsn(2, 1), continuation(lsn(1, 5))));
    let out = drain(&mut f);
    assert_eq!(f.counters().continuation_mismatches, 1);
    assert_eq!(f.status().last_lsn, lsn(1, 2), "nothing taken");
    assert_eq!(
        out,
        vec![MetadataOutput::Send {
            to: n(3),
            message: msg(Msg::FollowerHello(peer::FollowerHello {
                term: 2,
                last_lsn: Some(lsn(1, 2).into()),
                last_advisory_lsn: Some(lsn(1, 1).into()),
            })),
        }]
    );
    // The passive leader of term 2 answers that hello with the whole state at (2, 1).
    let recovered = Recovered {
        committed_state: ClusterState::new(2),
        committed_lsn: lsn(1, 1),
        uncommitted: vec![(lsn(1, 3), assign("a", 0, 0))],
        last_lsn: lsn(1, 3),
    };
    let mut leader = MetadataCore::new(n(3), &members(), 0, recovered);
    leader.handle_leadership(now, Term(2), Some(n(3)));
    leader.handle_message(now, n(2), sync_response(2, lsn(1, 1), lsn(1, 1)));
    let out = drain(&mut leader);
    assert!(
        out.iter().any(|o| matches!(o, MetadataOutput::Persist { record: LedgerRecord::Update { advisory, .. } } if *advisory == continuation(lsn(1, 3)))),
        "{out:?}"
    );
    leader.handle_message(
        now,
        n(2),
        msg(Msg::FollowerHello(peer::FollowerHello {
            term: 2,
            last_lsn: Some(lsn(1, 2).into()),
            last_advisory_lsn: None,
        })),
    );
    let out = messages_to(drain(&mut leader), n(2));
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(is_whole_term_start(&out[0]), "{out:?}");
    f.handle_message(now, n(3), out[0].clone());
    assert_eq!(f.status().last_lsn, lsn(2, 1));
    assert!(f.tip_state().queues.contains_key("a"));
}

/// Node `id` of `h` as it starts again from a ledger that holds what it holds now (its
/// committed state, its uncommitted advisories and its last LSN).
fn restarted(h: &mut Harness, id: u32) -> MetadataCore {
    let old = h.node(id);
    let recovered = Recovered {
        committed_state: old.state().clone(),
        committed_lsn: old.status().committed_lsn,
        uncommitted: old
            .pending
            .iter()
            .map(|p| (p.lsn, p.advisory.clone()))
            .collect(),
        last_lsn: old.status().last_lsn,
    };
    MetadataCore::new(n(id), &members(), 0, recovered)
}

#[test]
fn harness_a_restarted_follower_that_missed_nothing_catches_up_without_the_state() {
    // Scenario: failover flat in the state, a restarted node -> ready. C restarts within the
    // leader's term holding everything: it says hello as soon as it knows the leader, and the
    // CatchUp carries no state (nothing is rewritten); then again two commits behind: the
    // leader sends the committed records it retains.
    let mut h = Harness::new();
    h.elect(1, 1);
    let now = h.now;
    for i in 0..3 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
        h.run();
    }
    let fresh = restarted(&mut h, 3);
    h.nodes.insert(n(3), fresh);
    h.node(3).handle_leadership(now, Term(1), Some(n(1)));
    let hello = h.node(3).poll_output();
    assert!(
        matches!(&hello, Some(MetadataOutput::Send { message: peer::MetadataMessage { kind: Some(Msg::FollowerHello(f)) }, .. }) if f.last_advisory_lsn.is_some()),
        "a hello at once: {hello:?}"
    );
    if let Some(MetadataOutput::Send { to, message }) = hello {
        h.queue.push_back((n(3), to, message));
    }
    h.run();
    assert_eq!(h.node(1).counters().catch_ups_sent, 1);
    assert_eq!(h.node(1).counters().whole_catch_ups_sent, 0);
    assert_eq!(h.node(3).counters().catch_ups_refused, 0);
    h.node(1).propose(now, assign("after", 1, 3)).unwrap();
    h.run();
    assert_eq!(h.state(3), h.state(1));
    assert!(h.node(3).state().queues.contains_key("after"));
    // Now C starts again from a ledger two commits behind.
    let behind = restarted(&mut h, 3);
    for i in 4..6 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
    }
    h.down.insert(n(3));
    h.run();
    h.down.remove(&n(3));
    h.nodes.insert(n(3), behind);
    h.node(3).handle_leadership(now, Term(1), Some(n(1)));
    h.run();
    h.advance(Duration::from_millis(600));
    // The leader retains the committed records it missed: still no state sent.
    assert_eq!(h.node(1).counters().whole_catch_ups_sent, 0);
    assert_eq!(h.state(3), h.state(1));
}

#[test]
fn harness_a_follower_behind_the_retained_records_gets_the_whole_state() {
    // Scenario: the leader keeps one committed record (`catch_up_records_max`); C starts
    // again three commits behind: its last advisory is not one the leader holds, so the
    // CatchUp carries the whole state.
    let config = MetadataConfig {
        catch_up_records_max: 1,
        ..MetadataConfig::default()
    };
    let mut h = Harness::with_nodes(members().into_iter().map(|id| {
        let core =
            MetadataCore::with_config(id, &members(), 0, Recovered::fresh(4), config.clone());
        (id, core)
    }));
    h.elect(1, 1);
    let now = h.now;
    let behind = restarted(&mut h, 3);
    h.down.insert(n(3));
    for i in 0..3 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
        h.run();
    }
    h.down.remove(&n(3));
    h.nodes.insert(n(3), behind);
    h.node(3).handle_leadership(now, Term(1), Some(n(1)));
    h.run();
    h.advance(Duration::from_millis(600));
    assert_eq!(h.node(1).counters().whole_catch_ups_sent, 1);
    assert_eq!(h.state(3), h.state(1));
}

#[test]
fn harness_restarted_follower_catches_up_after_missing_records() {
    // Scenario: C is cut off while A commits advisories with B, then returns and catches up by
    // retransmission or hello.
    let mut h = Harness::new();
    h.elect(1, 1);
    h.drop_if = Some(Box::new(|from, to, _| from == NodeId(3) || to == NodeId(3)));
    let now = h.now;
    for i in 0..3 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
        h.run();
    }
    assert_eq!(h.node(1).state().queues.len(), 3);
    assert!(h.node(3).state().queues.is_empty());
    h.drop_if = None;
    // The next advisory shows C a gap; C says hello and gets a CatchUp.
    h.node(1).propose(now, assign("q3", 1, 3)).unwrap();
    h.run();
    h.advance(Duration::from_millis(600));
    h.advance(Duration::from_millis(600));
    assert_eq!(h.state(3), h.state(1));
    assert_eq!(h.node(3).state().queues.len(), 4);
}

#[test]
fn harness_follower_that_finds_its_leader_again_catches_up_without_a_new_record() {
    // Scenario: C's links are cut, so C loses the leader of term 1 while A commits advisories
    // with B. C's links come back and its elector finds A again at term 1: with no later
    // advisory to show it a gap, C still asks (hello) and catches up. An up-to-date follower
    // (B) that loses and finds A again gets a CatchUp that changes nothing and stops asking.
    let mut h = Harness::new();
    h.elect(1, 1);
    h.drop_if = Some(Box::new(|from, to, _| from == NodeId(3) || to == NodeId(3)));
    let now = h.now;
    h.node(3).handle_leadership(now, Term(1), None);
    for i in 0..3 {
        h.node(1)
            .propose(now, assign(&format!("q{i}"), 0, i))
            .unwrap();
        h.run();
    }
    let behind = h.node(3).status().last_lsn;
    assert!(behind < h.node(1).status().last_lsn);
    h.drop_if = None;
    h.node(3).handle_leadership(now, Term(1), Some(n(1)));
    h.node(2).handle_leadership(now, Term(1), None);
    h.node(2).handle_leadership(now, Term(1), Some(n(1)));
    h.run();
    let b_before = h.node(2).status();
    h.advance(Duration::from_millis(600));
    assert_eq!(h.state(3), h.state(1));
    assert_eq!(h.node(3).state().queues.len(), 3);
    let (a, c) = (h.node(1).status(), h.node(3).status());
    assert_eq!(c.committed_lsn, a.committed_lsn);
    assert_eq!(c.last_lsn, a.last_lsn);
    // B was in step: same LSNs, and it says no more hellos.
    assert_eq!(h.node(2).status().last_lsn, b_before.last_lsn);
    let hellos = h.node(2).counters().hellos_sent;
    assert_eq!(hellos, 1);
    h.advance(Duration::from_millis(600));
    h.advance(Duration::from_millis(600));
    assert_eq!(h.node(2).counters().hellos_sent, hellos);
    assert_eq!(h.node(3).counters().hellos_sent, 1);
}

/// A `FollowerHello` of term 1.
fn hello(last: Lsn) -> peer::MetadataMessage {
    msg(Msg::FollowerHello(peer::FollowerHello {
        term: 1,
        last_lsn: Some(last.into()),
        last_advisory_lsn: None,
    }))
}

/// Follower `id` of `leader` (node 1, term 1), brought in step by the CatchUp its hello gets,
/// with everything durable and its outputs drained.
fn follower_in_step(leader: &mut MetadataCore, id: u32, now: Instant) -> MetadataCore {
    let mut follower = core(id);
    follower.handle_leadership(now, Term(1), Some(n(1)));
    leader.handle_message(now, n(id), hello(Lsn::ZERO));
    for m in messages_to(drain(leader), n(id)) {
        follower.handle_message(now, n(1), m);
    }
    let last = follower.status().last_lsn;
    follower.on_persisted(now, last);
    drain(&mut follower);
    follower
}

/// The messages `out` broadcasts or sends to `to`, in order.
fn messages_to(out: Vec<MetadataOutput>, to: NodeId) -> Vec<peer::MetadataMessage> {
    out.into_iter()
        .filter_map(|o| match o {
            MetadataOutput::Broadcast { message } => Some(message),
            MetadataOutput::Send { to: t, message } if t == to => Some(message),
            _ => None,
        })
        .collect()
}

#[test]
fn catch_up_behind_a_followers_trailing_commit_commits_from_its_own_log() {
    // Scenario (found by the metadata simulator): a follower holds a commit record past the
    // leader's last advisory but missed a later commit; the CatchUp lists nothing beyond the
    // leader's committed LSN, which is below the follower's last. The follower commits from its
    // own log and takes the leader's latest commit, instead of dropping the CatchUp and staying
    // out of sync for as long as the leader is quiet.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let mut late = follower_in_step(&mut leader, 3, now);
    assert_eq!(late.status().last_lsn, lsn(1, 2));

    // The leader: q at 1:3, q2 at 1:4, commits 1:5 (of 1:3) and 1:6 (of 1:4).
    let (q, q2) = (assign("q", 0, 0), assign("q2", 1, 1));
    assert_eq!(leader.propose(now, q.clone()), Ok(lsn(1, 3)));
    assert_eq!(leader.propose(now, q2.clone()), Ok(lsn(1, 4)));
    leader.on_persisted(now, lsn(1, 4));
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    leader.handle_message(now, n(2), ack(lsn(1, 4)));
    let sent = messages_to(drain(&mut leader), n(3));
    assert_eq!(sent.len(), 4, "{sent:?}");
    assert_eq!(sent[2], commit(lsn(1, 5), lsn(1, 3)));
    assert_eq!(sent[3], commit(lsn(1, 6), lsn(1, 4)));
    // The follower gets all but the last commit.
    for m in sent.into_iter().take(3) {
        late.handle_message(now, n(1), m);
    }
    late.on_persisted(now, lsn(1, 5));
    drain(&mut late);
    assert_eq!(
        late.status(),
        status(MetadataRole::Follower, 1, Some(1), lsn(1, 5), lsn(1, 3), 1)
    );

    // Its hello (after a gap or a reconnection) brings a CatchUp that lists up to 1:4 only,
    // then the leader's latest commit.
    leader.handle_message(now, n(3), hello(lsn(1, 5)));
    let sent = messages_to(drain(&mut leader), n(3));
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[1], commit(lsn(1, 6), lsn(1, 4)));
    for m in sent {
        late.handle_message(now, n(1), m);
    }
    let out = drain(&mut late);
    assert!(
        out.contains(&MetadataOutput::Committed {
            lsn: lsn(1, 4),
            advisory: q2.clone()
        }),
        "{out:?}"
    );
    assert_eq!(out.last(), Some(&persist_commit(lsn(1, 6), lsn(1, 4))));
    assert_eq!(
        late.status(),
        status(MetadataRole::Follower, 1, Some(1), lsn(1, 6), lsn(1, 4), 0)
    );
    assert_eq!(late.state(), leader.state());

    // The next advisory is in sequence: no gap.
    let q3 = assign("q3", 0, 2);
    assert_eq!(leader.propose(now, q3.clone()), Ok(lsn(1, 7)));
    drain(&mut leader);
    let gaps = late.counters().gap;
    late.handle_message(now, n(1), record(lsn(1, 7), q3.clone()));
    assert_eq!(
        drain(&mut late),
        vec![persist_update(lsn(1, 7), q3), proposed("q3", 0)]
    );
    assert_eq!(late.counters().gap, gaps);
}

// ---------------------------------------------------------------- group commit, batched
// messages, cumulative acks, and what shortens a failover.

fn batch(messages: Vec<peer::MetadataMessage>) -> peer::MetadataMessage {
    msg(Msg::Batch(peer::MetadataBatch { messages }))
}

fn assignment_request(uri: &str) -> peer::MetadataMessage {
    msg(Msg::QueueAssignmentRequest(peer::QueueAssignmentRequest {
        uri: uri.into(),
    }))
}

#[test]
fn follower_acks_a_group_of_records_once_after_their_fsync() {
    // Scenario: group commit on a follower — three records arrive, the shell syncs them with
    // one fsync, and one ack names the last: the leader counts acks as a high-water mark.
    let now = Instant::now();
    let mut f = follower(now);
    let (a, b, c) = (assign("a", 0, 0), assign("b", 1, 1), assign("c", 0, 2));
    f.handle_message(now, n(1), record(lsn(1, 3), a.clone()));
    f.handle_message(now, n(1), record(lsn(1, 4), b.clone()));
    f.handle_message(now, n(1), record(lsn(1, 5), c.clone()));
    assert_eq!(
        drain(&mut f),
        vec![
            persist_update(lsn(1, 3), a),
            proposed("a", 0),
            persist_update(lsn(1, 4), b),
            proposed("b", 1),
            persist_update(lsn(1, 5), c),
            proposed("c", 0),
        ]
    );
    f.on_persisted(now, lsn(1, 5));
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: ack(lsn(1, 5))
        }]
    );
    // Nothing new is durable: no second ack.
    f.on_persisted(now, lsn(1, 5));
    assert_eq!(drain(&mut f), vec![]);
    // A partial sync acks up to what it covers.
    f.handle_message(now, n(1), record(lsn(1, 6), assign("d", 1, 3)));
    f.handle_message(now, n(1), record(lsn(1, 7), assign("e", 0, 4)));
    drain(&mut f);
    f.on_persisted(now, lsn(1, 6));
    assert_eq!(
        drain(&mut f),
        vec![MetadataOutput::Send {
            to: n(1),
            message: ack(lsn(1, 6))
        }]
    );
}

#[test]
fn leader_commits_a_group_with_one_commit_record() {
    // Scenario: group commit on the leader — two proposals, one own fsync, one ack of the
    // last record: one commit record covers both, and both apply in order.
    let now = Instant::now();
    let mut leader = active_leader(now);
    let (a, b) = (assign("a", 0, 0), assign("b", 1, 1));
    leader.propose(now, a.clone()).unwrap();
    leader.propose(now, b.clone()).unwrap();
    drain(&mut leader);
    leader.handle_message(now, n(3), ack(lsn(1, 4)));
    // The leader's own copy is not durable yet: no quorum.
    assert_eq!(drain(&mut leader), vec![]);
    leader.on_persisted(now, lsn(1, 4));
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_commit(lsn(1, 5), lsn(1, 4)),
            MetadataOutput::Broadcast {
                message: commit(lsn(1, 5), lsn(1, 4))
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 3),
                advisory: a
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 4),
                advisory: b
            },
        ]
    );
}

#[test]
fn a_batch_is_handled_as_its_messages_in_order() {
    // Scenario: records and a commit in one MetadataBatch do what they do one by one; a batch
    // inside a batch and an empty message are dropped and counted, the rest still handled.
    let now = Instant::now();
    let mut f = follower(now);
    let (a, b) = (assign("a", 0, 0), assign("b", 1, 1));
    f.handle_message(
        now,
        n(1),
        batch(vec![
            record(lsn(1, 3), a.clone()),
            batch(vec![record(lsn(1, 4), b.clone())]),
            peer::MetadataMessage { kind: None },
            record(lsn(1, 4), b.clone()),
            commit(lsn(1, 5), lsn(1, 4)),
        ]),
    );
    assert_eq!(
        drain(&mut f),
        vec![
            persist_update(lsn(1, 3), a.clone()),
            proposed("a", 0),
            persist_update(lsn(1, 4), b.clone()),
            proposed("b", 1),
            persist_commit(lsn(1, 5), lsn(1, 4)),
            MetadataOutput::Committed {
                lsn: lsn(1, 3),
                advisory: a
            },
            MetadataOutput::Committed {
                lsn: lsn(1, 4),
                advisory: b
            },
        ]
    );
    assert_eq!(f.counters().nested_batches, 1);
    assert_eq!(f.counters().invalid, 1);
    // A batch from a node we do not follow is dropped like its messages would be.
    f.handle_message(now, n(3), batch(vec![record(lsn(1, 6), assign("c", 0, 2))]));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().wrong_leader, 1);
}

#[test]
fn a_sync_query_that_overtakes_the_elector_is_answered_when_the_leader_is_named() {
    // Scenario: failover — the new leader's LeaderSyncStateQuery reaches a follower before
    // that follower's elector names the new leader. It is kept and answered at once when the
    // elector does, instead of the new leader retrying after `sync_retry`.
    let now = Instant::now();
    let mut f = follower(now);
    f.handle_leadership(now, Term(1), None);
    drain(&mut f);
    let query = msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 2 }));
    f.handle_message(now, n(3), query);
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().sync_queries_deferred, 1);
    f.handle_leadership(now, Term(2), Some(n(3)));
    let out = drain(&mut f);
    assert!(
        out.contains(&MetadataOutput::Send {
            to: n(3),
            message: sync_answer(2, lsn(1, 2), lsn(1, 1), lsn(1, 1))
        }),
        "{out:?}"
    );
    // Answered once: a later leadership notification does not answer it again.
    f.handle_leadership(now, Term(2), None);
    f.handle_leadership(now, Term(2), Some(n(3)));
    assert!(messages_to(drain(&mut f), n(3))
        .iter()
        .all(|m| !matches!(m.kind, Some(Msg::SyncStateResponse(_)))));
    // A kept query whose sender is not the leader the elector names is dropped.
    f.handle_message(
        now,
        n(1),
        msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 3 })),
    );
    f.handle_leadership(now, Term(3), Some(n(3)));
    assert!(messages_to(drain(&mut f), n(1)).is_empty());
    // A query of an older term is stale, not kept.
    f.handle_message(
        now,
        n(1),
        msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 2 })),
    );
    assert_eq!(f.counters().sync_queries_deferred, 2);
}

#[test]
fn a_sync_data_response_behind_its_announced_lsn_is_refused() {
    // Scenario: node 3 announced 1:3, but its data response holds only up to 1:2 (it lost
    // records it had not synced yet): adopting it could lose an advisory committed by a quorum
    // that node 1 belongs to. The leader asks again and builds its snapshot from what is held.
    let now = Instant::now();
    let mut base = ClusterState::new(2);
    base.apply(&primaries(&[(0, Some(1), 1)])).unwrap();
    let recovered = Recovered {
        committed_state: base.clone(),
        committed_lsn: lsn(1, 1),
        uncommitted: vec![(lsn(1, 2), assign("committed-on-1-and-2", 0, 0))],
        last_lsn: lsn(1, 2),
    };
    let mut leader = MetadataCore::new(n(1), &members(), 0, recovered);
    leader.handle_leadership(now, Term(2), Some(n(1)));
    drain(&mut leader);
    leader.handle_message(now, n(3), sync_response(2, lsn(1, 3), lsn(1, 1)));
    drain(&mut leader);
    let behind = msg(Msg::SyncDataResponse(peer::LeaderSyncDataResponse {
        term: 2,
        last_lsn: Some(lsn(1, 1).into()),
        state: Some(base.to_snapshot()),
        records: vec![],
    }));
    leader.handle_message(now, n(3), behind);
    assert_eq!(
        drain(&mut leader),
        vec![MetadataOutput::Send {
            to: n(3),
            message: msg(Msg::SyncStateQuery(peer::LeaderSyncStateQuery { term: 2 }))
        }]
    );
    assert_eq!(leader.counters().sync_data_behind, 1);
    // Node 3 now says what it holds; the leader is the most advanced and uses its own tip.
    leader.handle_message(now, n(3), sync_response(2, lsn(1, 1), lsn(1, 1)));
    let out = drain(&mut leader);
    let Some(MetadataOutput::Persist {
        record: LedgerRecord::Update {
            lsn: first,
            advisory,
        },
    }) = out.first()
    else {
        panic!("the term's snapshot is proposed: {out:?}");
    };
    assert_eq!(*first, lsn(2, 1));
    assert_eq!(*advisory, continuation(lsn(1, 2)));
    assert!(leader
        .tip_state()
        .queues
        .contains_key("committed-on-1-and-2"));
}

#[test]
fn queue_assignment_requests_wait_for_an_active_leader() {
    // Scenario: failover — requests reaching a passive leader are kept and proposed when it
    // becomes active, instead of being dropped and asked again by the caller later.
    let now = Instant::now();
    let mut leader = core(1);
    leader.handle_leadership(now, Term(1), Some(n(1)));
    leader.handle_message(now, n(2), assignment_request("bmq://d/early"));
    leader.request_queue_assignment(now, "bmq://d/local");
    drain(&mut leader);
    leader.handle_message(now, n(2), sync_response(1, Lsn::ZERO, Lsn::ZERO));
    drain(&mut leader);
    // No partition has a primary yet: give one, then finish the sync.
    leader.on_persisted(now, lsn(1, 1));
    leader.handle_message(now, n(2), ack(lsn(1, 1)));
    assert_eq!(leader.status().role, MetadataRole::ActiveLeader);
    leader.propose(now, primaries(&[(0, Some(1), 1)])).unwrap();
    drain(&mut leader);
    leader.on_persisted(now, lsn(1, 3));
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    drain(&mut leader);
    // The kept requests go out at the next leadership event: here the leader asks again for
    // one of them (as a waiting open does), which proposes it.
    leader.request_queue_assignment(now, "bmq://d/local");
    assert!(leader.tip_state().queues.contains_key("bmq://d/local"));

    // The same on a fresh leader whose partitions already have primaries: both requests are
    // proposed the moment the term's snapshot commits.
    let mut state = ClusterState::new(2);
    state
        .apply(&primaries(&[(0, Some(1), 1), (1, Some(2), 1)]))
        .unwrap();
    let recovered = Recovered {
        committed_state: state,
        committed_lsn: lsn(1, 1),
        uncommitted: vec![],
        last_lsn: lsn(1, 1),
    };
    let mut leader = MetadataCore::new(n(1), &members(), 0, recovered);
    leader.handle_leadership(now, Term(2), Some(n(1)));
    leader.handle_message(now, n(2), assignment_request("bmq://d/a"));
    leader.request_queue_assignment(now, "bmq://d/b");
    leader.handle_message(now, n(3), sync_response(2, lsn(1, 1), lsn(1, 1)));
    leader.on_persisted(now, lsn(2, 1));
    drain(&mut leader);
    leader.handle_message(now, n(3), ack(lsn(2, 1)));
    let proposed: Vec<Lsn> = drain(&mut leader)
        .into_iter()
        .filter_map(|o| match o {
            MetadataOutput::Persist {
                record: LedgerRecord::Update { lsn, .. },
            } => Some(lsn),
            _ => None,
        })
        .collect();
    assert_eq!(proposed, vec![lsn(2, 3), lsn(2, 4)]);
    assert!(leader.tip_state().queues.contains_key("bmq://d/a"));
    assert!(leader.tip_state().queues.contains_key("bmq://d/b"));
    // A follower forwards requests from peers nowhere (only leaders take them).
    let mut f = follower(now);
    f.handle_message(now, n(3), assignment_request("bmq://d/x"));
    assert_eq!(drain(&mut f), vec![]);
}

#[test]
fn a_follower_keeps_its_requests_for_the_next_leader_until_committed() {
    // Scenario: a follower whose leader is gone keeps the queue assignments its clients asked
    // for and forwards them to the next leader as soon as the elector names it; a committed
    // assignment is forgotten, an old one expires.
    let now = Instant::now();
    let mut f = follower(now);
    f.handle_leadership(now, Term(1), None);
    drain(&mut f);
    f.request_queue_assignment(now, "bmq://d/q");
    f.request_queue_assignment(now, "bmq://d/r");
    assert_eq!(drain(&mut f), vec![]);
    f.handle_leadership(now, Term(2), Some(n(3)));
    let forwarded = messages_to(drain(&mut f), n(3));
    assert_eq!(
        forwarded,
        vec![
            assignment_request("bmq://d/q"),
            assignment_request("bmq://d/r")
        ]
    );
    // The term-2 leader commits q (snapshot at 2:1, q at 2:2, commit 2:3).
    let snapshot = leader_advisory(&ClusterState::new(2));
    f.handle_message(now, n(3), record(lsn(2, 1), snapshot));
    f.handle_message(now, n(3), record(lsn(2, 2), assign("bmq://d/q", 0, 0)));
    f.handle_message(now, n(3), commit(lsn(2, 3), lsn(2, 2)));
    drain(&mut f);
    // A new leader gets only r again.
    f.handle_leadership(now, Term(3), Some(n(1)));
    let forwarded = messages_to(drain(&mut f), n(1));
    assert_eq!(forwarded, vec![assignment_request("bmq://d/r")]);
    // After the TTL, nothing is forwarded any more.
    let later = now + MetadataConfig::default().assignment_request_ttl;
    f.handle_leadership(later, Term(4), Some(n(3)));
    assert!(messages_to(drain(&mut f), n(3))
        .iter()
        .all(|m| !matches!(m.kind, Some(Msg::QueueAssignmentRequest(_)))));
}

#[test]
fn a_kept_request_is_sent_again_until_committed() {
    // Scenario: a follower's forwarded request is lost on the way. The follower sends it again
    // once `assignment_request_resend` has passed (not before), and no more once the
    // assignment is committed: the one retry home of an open's assignment.
    let now = Instant::now();
    let resend = MetadataConfig::default().assignment_request_resend;
    let requests = |out: Vec<MetadataOutput>| -> Vec<peer::MetadataMessage> {
        messages_to(out, n(3))
            .into_iter()
            .filter(|m| matches!(m.kind, Some(Msg::QueueAssignmentRequest(_))))
            .collect()
    };
    let mut f = follower(now);
    f.handle_leadership(now, Term(2), Some(n(3)));
    drain(&mut f);
    f.request_queue_assignment(now, "bmq://d/q");
    assert_eq!(
        requests(drain(&mut f)),
        vec![assignment_request("bmq://d/q")]
    );
    assert!(f.poll_timeout().is_some_and(|t| t <= now + resend));
    f.handle_timeout(now + resend - Duration::from_millis(1));
    assert_eq!(requests(drain(&mut f)), vec![]);
    f.handle_timeout(now + resend);
    assert_eq!(
        requests(drain(&mut f)),
        vec![assignment_request("bmq://d/q")]
    );
    assert_eq!(f.counters().assignment_resends, 1);
    // The leader commits q (snapshot at 2:1, q at 2:2, commit 2:3): nothing more is sent.
    let snapshot = leader_advisory(&ClusterState::new(2));
    f.handle_message(now, n(3), record(lsn(2, 1), snapshot));
    f.handle_message(now, n(3), record(lsn(2, 2), assign("bmq://d/q", 0, 0)));
    f.handle_message(now, n(3), commit(lsn(2, 3), lsn(2, 2)));
    drain(&mut f);
    for k in 2..5 {
        f.handle_timeout(now + resend * k);
        assert_eq!(requests(drain(&mut f)), vec![]);
    }
    assert_eq!(f.counters().assignment_resends, 1);
}

#[test]
fn a_queue_assignment_is_reported_proposed_right_after_its_record() {
    // Scenario: the leader stamps a queue assignment and a follower accepts one naming two
    // queues; each reports every queue of it proposed, right after the record's Persist and
    // in the advisory's order; other advisories, and the commit, report nothing.
    let now = Instant::now();
    let mut leader = active_leader(now);
    leader.propose(now, primaries(&[(0, Some(1), 1)])).unwrap();
    let out = drain(&mut leader);
    assert!(out
        .iter()
        .all(|o| !matches!(o, MetadataOutput::AssignmentProposed { .. })));
    leader.on_persisted(now, lsn(1, 3));
    leader.handle_message(now, n(2), ack(lsn(1, 3)));
    drain(&mut leader);
    // A request of this node's client: the leader picks partition 0 (the one with a primary).
    leader.request_queue_assignment(now, "bmq://d/q");
    let stamped = assign("bmq://d/q", 0, 0);
    assert_eq!(
        drain(&mut leader),
        vec![
            persist_update(lsn(1, 5), stamped.clone()),
            proposed("bmq://d/q", 0),
            MetadataOutput::Broadcast {
                message: record(lsn(1, 5), stamped.clone())
            },
        ]
    );
    leader.on_persisted(now, lsn(1, 5));
    leader.handle_message(now, n(2), ack(lsn(1, 5)));
    let out = drain(&mut leader);
    assert!(out.contains(&MetadataOutput::Committed {
        lsn: lsn(1, 5),
        advisory: stamped
    }));
    assert!(out
        .iter()
        .all(|o| !matches!(o, MetadataOutput::AssignmentProposed { .. })));

    let mut f = follower(now);
    let two = peer::Advisory {
        kind: Some(peer::advisory::Kind::QueueAssignment(
            peer::QueueAssignmentAdvisory {
                queues: vec![
                    peer::QueueInfo {
                        uri: "bmq://d/a".into(),
                        partition_id: 1,
                        queue_key: 0,
                    },
                    peer::QueueInfo {
                        uri: "bmq://d/b".into(),
                        partition_id: 0,
                        queue_key: 1,
                    },
                ],
            },
        )),
    };
    f.handle_message(now, n(1), record(lsn(1, 3), two.clone()));
    assert_eq!(
        drain(&mut f),
        vec![
            persist_update(lsn(1, 3), two),
            proposed("bmq://d/a", 1),
            proposed("bmq://d/b", 0),
        ]
    );
}

// ---------------------------------------------------------------- membership

/// The committed membership of the active leader with `f` applied at the next epoch.
fn changed(core: &MetadataCore, f: impl FnOnce(&mut ClusterMembership)) -> peer::Advisory {
    let mut next = (**core.membership().expect("seeded")).clone();
    next.epoch += 1;
    f(&mut next);
    next.to_advisory()
}

/// Nodes 1-3 configured with {1,2,3} and seeded from it; node 4 a new node that knows them.
/// Learners are promoted by hand (the tests propose every change) unless `promote`, once they
/// hold the ledger (their journals are not waited for).
fn membership_harness_with(promote: bool) -> Harness {
    membership_harness_config(MetadataConfig {
        promote_learners: promote,
        promote_after_journals: false,
        ..MetadataConfig::default()
    })
}

fn membership_harness_config(config: MetadataConfig) -> Harness {
    let seed = ClusterMembership::seed((1..=3).map(|i| member(i, MemberRole::Voter))).unwrap();
    let mut nodes: Vec<(NodeId, MetadataCore)> = (1..=3)
        .map(|i| {
            let mut core =
                MetadataCore::with_config(n(i), &members(), 0, Recovered::fresh(4), config.clone());
            core.set_seed_membership(seed.clone());
            (n(i), core)
        })
        .collect();
    let all = [n(1), n(2), n(3), n(4)];
    nodes.push((n(4), MetadataCore::new(n(4), &all, 0, Recovered::fresh(4))));
    Harness::with_nodes(nodes)
}

/// Node 1, the leader, adds node 4 as a learner, then promotes it; each change committed and
/// applied everywhere before the next.
fn add_voter_4(h: &mut Harness) {
    for role in [MemberRole::Learner, MemberRole::Voter] {
        let now = h.now;
        let next = changed(h.node(1), |m| {
            m.members.insert(n(4), member(4, role));
        });
        h.node(1).propose(now, next).unwrap();
        h.run();
        h.advance(Duration::from_secs(1));
    }
}

fn membership_harness() -> Harness {
    membership_harness_with(false)
}

fn learner_progress(epoch: u64, following: u32, partitions: u32) -> peer::MetadataMessage {
    msg(Msg::LearnerProgress(peer::LearnerProgress {
        membership_epoch: epoch,
        partitions_following: following,
        partitions,
    }))
}

#[test]
fn the_leader_promotes_a_learner_once_it_follows_every_partition() {
    // Scenario: with the broker's default configuration the learner's ledger is not enough:
    // the leader waits for a report, of the current membership's epoch, that every partition
    // with a primary has synchronised the learner's journal. Reports of an older epoch or of
    // a part of the partitions promote nothing; a node that is no learner is not listed.
    let mut h = membership_harness_config(MetadataConfig::default());
    h.elect(1, 1);
    let now = h.now;
    let add = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Learner));
    });
    h.node(1).propose(now, add).unwrap();
    h.run();
    h.advance(Duration::from_secs(1));
    assert_eq!(
        h.node(1).counters().learners_promoted,
        0,
        "holds the ledger, no journal reported"
    );
    let epoch = h.state(1).membership.as_ref().unwrap().epoch;
    for (e, following) in [(epoch - 1, 16), (epoch, 15)] {
        h.node(1)
            .handle_message(now, n(4), learner_progress(e, following, 16));
        h.run();
        assert_eq!(
            h.node(1).counters().learners_promoted,
            0,
            "epoch {e}, {following}/16"
        );
    }
    assert_eq!(
        h.node(1).learner_progress(),
        vec![(
            n(4),
            LearnerProgress {
                membership_epoch: epoch,
                partitions_following: 15,
                partitions: 16
            }
        )]
    );
    h.node(1)
        .handle_message(now, n(4), learner_progress(epoch, 16, 16));
    h.run();
    assert_eq!(h.node(1).counters().learners_promoted, 1);
    for id in 1..=4 {
        let state = h.state(id);
        let m = state.membership.as_ref().unwrap();
        assert_eq!(
            (m.epoch, m.voters()),
            (epoch + 1, voters(&[1, 2, 3, 4])),
            "node {id}"
        );
    }
    assert!(h.node(1).learner_progress().is_empty(), "a voter now");
}

#[test]
fn the_leader_promotes_a_learner_once_it_applied_its_addition() {
    // Scenario: etcd's learner promotion without the operator step. The learner catches up
    // (hello, CatchUp), reports the epoch that made it a learner, and the leader proposes its
    // promotion at once: every node ends with voters {1,2,3,4}.
    let mut h = membership_harness_with(true);
    h.elect(1, 1);
    let now = h.now;
    let add = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Learner));
    });
    h.node(1).propose(now, add).unwrap();
    h.run();
    assert_eq!(
        h.node(1).counters().learners_promoted,
        0,
        "not caught up yet"
    );
    h.advance(Duration::from_secs(1));
    assert_eq!(h.node(1).counters().learners_promoted, 1);
    for id in 1..=4 {
        let state = h.state(id);
        let m = state.membership.as_ref().unwrap();
        assert_eq!(
            (m.epoch, m.voters()),
            (3, voters(&[1, 2, 3, 4])),
            "node {id}"
        );
    }
}

fn voters(ids: &[u32]) -> BTreeSet<NodeId> {
    ids.iter().copied().map(NodeId).collect()
}

#[test]
fn the_first_leader_seeds_the_membership_and_changes_go_one_at_a_time() {
    // Scenario: DESIGN.md §5a. The first LeaderAdvisory carries the configured members as
    // epoch 1; a learner is added (committed by the old voters alone), a second change while
    // the first is uncommitted is refused, the learner is promoted, and a node that has not
    // been told the new set still follows and applies it.
    let mut h = membership_harness();
    h.elect(1, 1);
    assert_eq!(h.state(4).membership, None, "not a member: no ledger yet");
    for id in 1..=3 {
        let state = h.state(id);
        let m = state.membership.as_ref().expect("seeded on every node");
        assert_eq!((m.epoch, m.voters()), (1, voters(&[1, 2, 3])), "node {id}");
    }
    assert_eq!(h.node(1).quorum(), 2);

    let now = h.now;
    let add = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Learner));
    });
    h.node(1).propose(now, add).unwrap();
    // One change at a time: the promotion waits for the addition's commit.
    let promote = changed(h.node(1), |m| {
        m.epoch += 1;
        m.members.insert(n(4), member(4, MemberRole::Voter));
    });
    assert_eq!(
        h.node(1).propose(now, promote.clone()),
        Err(ProposeError::MembershipChangeInFlight { pending_epoch: 2 })
    );
    h.run();
    // The learner saw records of a term whose snapshot it lacks: it says hello and is caught up.
    h.advance(Duration::from_secs(1));
    for id in 1..=4 {
        assert_eq!(
            h.state(id).membership.as_ref().unwrap().epoch,
            2,
            "node {id}"
        );
    }
    assert_eq!(h.node(1).quorum(), 2, "a learner counts in no quorum");
    h.node(1).propose(now, promote).unwrap();
    h.run();
    for id in 1..=4 {
        let state = h.state(id);
        let m = state.membership.as_ref().unwrap();
        assert_eq!(
            (m.epoch, m.voters()),
            (3, voters(&[1, 2, 3, 4])),
            "node {id}"
        );
    }
    assert_eq!(h.node(1).quorum(), 3);
}

#[test]
fn a_change_commits_only_with_a_majority_of_the_old_and_the_new_voters() {
    // Scenario: with 3 and 4 down, promoting learner 4 is held by {1,2}: a majority of the
    // old voters {1,2,3} but not of the new {1,2,3,4}; it commits once 4 is back.
    let mut h = membership_harness();
    h.elect(1, 1);
    let now = h.now;
    let add = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Learner));
    });
    h.node(1).propose(now, add).unwrap();
    h.run();
    h.down.insert(n(3));
    h.down.insert(n(4));
    let promote = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Voter));
    });
    let lsn = h.node(1).propose(now, promote).unwrap();
    h.run();
    h.advance(Duration::from_secs(2));
    assert!(
        h.node(1).status().committed_lsn < lsn,
        "committed without a majority of the new voters"
    );
    assert_eq!(h.state(1).membership.as_ref().unwrap().epoch, 2);
    h.down.remove(&n(4));
    h.advance(Duration::from_secs(1));
    assert!(h.node(1).status().committed_lsn >= lsn);
    assert_eq!(h.state(1).voters(), Some(voters(&[1, 2, 3, 4])));
    // From now on {1,2} alone commits nothing: a majority of 4 voters is 3.
    h.down.insert(n(4));
    let now = h.now;
    let lsn = h.node(1).propose(now, assign("bmq://d/q", 0, 0)).unwrap();
    h.advance(Duration::from_secs(2));
    assert!(h.node(1).status().committed_lsn < lsn);
}

#[test]
fn the_next_change_waits_until_a_majority_of_voters_applied_the_current_one() {
    // Scenario: the epoch reports of 2 and 3 are lost: the leader refuses the next change
    // (MembershipNotApplied) until an idle commit refresh brings them, then accepts it.
    let mut h = membership_harness();
    h.elect(1, 1);
    let now = h.now;
    let add = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Learner));
    });
    h.node(1).propose(now, add).unwrap();
    h.drop_if = Some(Box::new(|_, to, m| {
        to == NodeId(1) && matches!(&m.kind, Some(Msg::Ack(a)) if a.membership_epoch >= 2)
    }));
    h.run();
    assert_eq!(h.state(1).membership.as_ref().unwrap().epoch, 2);
    let promote = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Voter));
    });
    assert_eq!(
        h.node(1).propose(now, promote.clone()),
        Err(ProposeError::MembershipNotApplied {
            epoch: 2,
            applied: 1,
            voters: 3
        })
    );
    h.drop_if = None;
    h.advance(Duration::from_secs(1));
    let now = h.now;
    h.node(1).propose(now, promote).unwrap();
}

#[test]
fn a_new_leader_syncs_with_a_majority_of_the_committed_voters() {
    // Scenario: with voters {1,2,3,4}, node 2's leader sync needs 3 answers: itself and 3 are
    // not enough; with 4 it becomes active and keeps the membership.
    let mut h = membership_harness();
    h.elect(1, 1);
    add_voter_4(&mut h);
    assert_eq!(h.state(2).voters(), Some(voters(&[1, 2, 3, 4])));
    h.down.insert(n(1));
    h.down.insert(n(4));
    h.elect(2, 2);
    h.advance(Duration::from_secs(1));
    assert_eq!(h.node(2).status().role, MetadataRole::PassiveLeader);
    h.down.remove(&n(4));
    let now = h.now;
    h.node(4).handle_leadership(now, Term(2), Some(n(2)));
    h.advance(Duration::from_secs(1));
    assert_eq!(h.node(2).status().role, MetadataRole::ActiveLeader);
    assert_eq!(h.state(2).membership.as_ref().unwrap().epoch, 3);
}

#[test]
fn invalid_membership_changes_are_refused_and_change_nothing() {
    // Scenario: two voters at once, a skipped epoch and a change before the seed are refused
    // with the rule they break; the state stays as it was.
    let mut h = membership_harness();
    h.elect(1, 1);
    let now = h.now;
    let two = changed(h.node(1), |m| {
        m.members.insert(n(4), member(4, MemberRole::Voter));
        m.members.insert(n(5), member(5, MemberRole::Voter));
    });
    assert!(matches!(
        h.node(1).propose(now, two),
        Err(ProposeError::Invalid(ApplyError::Membership(
            MembershipError::MoreThanOneChange(_)
        )))
    ));
    let skipped = changed(h.node(1), |m| m.epoch += 5);
    assert!(matches!(
        h.node(1).propose(now, skipped),
        Err(ProposeError::Invalid(ApplyError::Membership(
            MembershipError::EpochNotNext {
                current: 1,
                received: 7
            }
        )))
    ));
    assert_eq!(h.state(1).membership.as_ref().unwrap().epoch, 1);
    // A cluster without a seed (no membership committed) refuses changes.
    let mut unseeded = active_leader(Instant::now());
    let seed = ClusterMembership::seed((1..=3).map(|i| member(i, MemberRole::Voter))).unwrap();
    assert!(matches!(
        unseeded.propose(Instant::now(), seed.to_advisory()),
        Err(ProposeError::Invalid(ApplyError::Membership(
            MembershipError::NotSeeded
        )))
    ));
}

#[test]
fn a_joining_node_says_hello_at_once() {
    // Scenario: a node with no ledger that learned the members from a peer's hello joins a
    // term that began before it was a member: the term's snapshot never comes to it, so it
    // asks for a catch-up at once instead of after `hello_retry`; a member of the initial
    // cluster (nothing learned) still waits for the snapshot.
    let now = Instant::now();
    let all = [n(1), n(2), n(3), n(4)];
    let mut joining = MetadataCore::new(n(4), &all, 0, Recovered::fresh(2));
    joining.learn_members([n(1), n(2), n(3), n(4)]);
    joining.handle_leadership(now, Term(3), Some(n(1)));
    assert_eq!(joining.poll_timeout(), Some(now));
    joining.handle_timeout(now);
    let hellos = messages_to(drain(&mut joining), n(1))
        .into_iter()
        .filter(|m| matches!(m.kind, Some(Msg::FollowerHello(_))))
        .count();
    assert_eq!(hellos, 1);

    let mut member = core(2);
    member.handle_leadership(now, Term(3), Some(n(1)));
    assert!(member.poll_timeout().is_some_and(|t| t > now));
}

#[test]
fn the_next_change_waits_until_every_partition_healed_under_the_current_voters() {
    // Scenario: partition 0's lease was assigned under voters {1,2,3}; once learner 4 is
    // promoted, a further change is refused (PartitionsNotFollowing) while the lease's
    // replicas are the old voters and while its new lease is PASSIVE, and accepted once the
    // primary healed under {1,2,3,4} (ACTIVE). Without the wait, {1,2,3} -> {1,2,3,4} ->
    // {1,2,3,4,5} could heal from {3,4,5}, none of which holds a record {1,2} committed.
    let mut h = membership_harness();
    h.elect(1, 1);
    let now = h.now;
    h.node(1)
        .propose(now, primaries(&[(0, Some(1), 1)]))
        .unwrap();
    h.run();
    add_voter_4(&mut h);
    assert_eq!(
        h.state(1).lease_replicas(PartitionId(0)),
        Some(voters(&[1, 2, 3])),
        "a lease keeps the replicas it was assigned with"
    );
    let retire = changed(h.node(1), |m| {
        m.members.get_mut(&n(3)).unwrap().role = MemberRole::Leaving;
    });
    let now = h.now;
    assert!(matches!(
        h.node(1).propose(now, retire.clone()),
        Err(ProposeError::PartitionsNotFollowing {
            epoch: 3,
            partition: PartitionId(0),
            ..
        })
    ));
    let state = h.state(1);
    let mut relet = crate::plan_replica_change(&state, &voters(&[1, 2, 3, 4]));
    assert_eq!(relet.len(), 1);
    assert_eq!(
        (
            relet[0].primary_node_id,
            relet[0].primary_lease_id,
            relet[0].replicas.clone()
        ),
        (Some(1), 2, vec![1, 2, 3, 4]),
        "the same primary, the next lease, the current voters"
    );
    let passive = peer::Advisory {
        kind: Some(peer::advisory::Kind::PartitionPrimary(
            peer::PartitionPrimaryAdvisory {
                partitions: relet.clone(),
            },
        )),
    };
    h.node(1).propose(now, passive).unwrap();
    h.run();
    let now = h.now;
    assert!(
        matches!(
            h.node(1).propose(now, retire.clone()),
            Err(ProposeError::PartitionsNotFollowing {
                partition: PartitionId(0),
                ..
            })
        ),
        "a PASSIVE lease has not healed yet"
    );
    relet[0].status = peer::PrimaryStatus::Active as i32;
    let active = peer::Advisory {
        kind: Some(peer::advisory::Kind::PartitionPrimary(
            peer::PartitionPrimaryAdvisory { partitions: relet },
        )),
    };
    h.node(1).propose(now, active).unwrap();
    h.run();
    h.advance(Duration::from_secs(1));
    let now = h.now;
    h.node(1).propose(now, retire).unwrap();
    h.run();
    assert_eq!(
        h.state(2).membership.as_ref().unwrap().partition_voters(),
        voters(&[1, 2, 4])
    );
}

#[test]
fn the_active_leader_removes_a_leaving_member_once_its_primaries_moved() {
    // Scenario: node 1 marks node 3, primary of partition 0, leaving, and fails before the
    // removal (the request that marked it died with it). The next leader, node 2, keeps node
    // 3 while it is still primary, and removes it on its own once partition 0 moved.
    let mut h = membership_harness_with(true);
    h.elect(1, 1);
    let now = h.now;
    let lease = |primary: u32, lease: u64, replicas: &[u32]| {
        let mut a = primaries(&[(0, Some(primary), lease)]);
        if let Some(peer::advisory::Kind::PartitionPrimary(p)) = a.kind.as_mut() {
            p.partitions[0].replicas = replicas.to_vec();
        }
        a
    };
    h.node(1).propose(now, lease(3, 1, &[1, 2, 3])).unwrap();
    h.run();
    let leaving = changed(h.node(1), |m| {
        m.members.get_mut(&n(3)).unwrap().role = MemberRole::Leaving;
    });
    h.node(1).propose(now, leaving).unwrap();
    h.run();
    h.advance(Duration::from_secs(1));
    h.elect(2, 2);
    h.advance(Duration::from_secs(1));
    let m = h.state(2).membership.clone().unwrap();
    assert_eq!(m.role(n(3)), Some(MemberRole::Leaving), "still primary");
    assert_eq!(h.node(2).counters().leaving_removed, 0);
    let now = h.now;
    // The next lease, as the health actor gives it: another primary, and the partition
    // voters, which a leaving member is no longer among.
    h.node(2).propose(now, lease(2, 2, &[1, 2])).unwrap();
    h.run();
    h.advance(Duration::from_secs(1));
    assert_eq!(h.node(2).counters().leaving_removed, 1);
    assert_eq!(h.node(1).counters().leaving_removed, 0);
    for id in 1..=2 {
        let state = h.state(id);
        let m = state.membership.as_ref().unwrap();
        assert!(m.removed.contains(&n(3)), "node {id}: {m:?}");
        assert_eq!(m.voters(), voters(&[1, 2]), "node {id}");
    }
}

// ---------------------------------------------------------------- domains

/// Nodes 1-3, each seeded with `file` as its `[[domains]]`.
fn domain_harness(file: &[bmq_config::DomainConfig]) -> Harness {
    Harness::with_nodes(members().into_iter().map(|id| {
        let mut core = MetadataCore::new(id, &members(), 0, Recovered::fresh(4));
        core.set_seed_domains(file.to_vec());
        (id, core)
    }))
}

fn domain_change(
    core: &MetadataCore,
    name: &str,
    f: impl FnOnce(&mut bmq_config::DomainConfig),
) -> peer::Advisory {
    let current = core
        .tip_state()
        .domains
        .as_ref()
        .unwrap()
        .get(name)
        .unwrap();
    let mut next = current.config.clone();
    f(&mut next);
    let mut a = crate::domains::advisory(
        peer::domain_advisory::Change::Update(crate::domains::config_to_wire(&next, Lsn::ZERO)),
        "ops",
    );
    if let Some(peer::advisory::Kind::Domain(d)) = a.kind.as_mut() {
        d.expected_version = Some(current.version.into());
    }
    a
}

#[test]
fn the_first_leader_seeds_the_domains_and_every_node_applies_changes_at_their_lsn() {
    // Scenario: the first leader seeds the file's domains; a create and an update commit on
    // every node with the LSN they were stamped with; a failover keeps them.
    use bmq_config::DomainConfig;
    let mut h = domain_harness(&[DomainConfig::new("bmq.a")]);
    h.elect(1, 1);
    let seeded = h.state(1).domains.clone().expect("seeded");
    assert_eq!(seeded.version, lsn(1, 1));
    assert!(seeded.get("bmq.a").is_some());
    let now = h.now;
    let create = crate::domains::advisory(
        peer::domain_advisory::Change::Create(crate::domains::config_to_wire(
            &DomainConfig::new("bmq.b"),
            Lsn::ZERO,
        )),
        "ops",
    );
    let at = h.node(1).propose(now, create).unwrap();
    h.run();
    let update = domain_change(h.node(1), "bmq.b", |d| d.max_queue_messages = 2);
    let at2 = h.node(1).propose(now, update).unwrap();
    h.run();
    for id in 1..=3 {
        let d = h.state(id).domains.clone().unwrap();
        assert_eq!(d.version, at2, "node {id}");
        let b = d.get("bmq.b").unwrap();
        assert_eq!(
            (b.version, b.config.max_queue_messages),
            (at2, 2),
            "node {id}"
        );
        assert!(at < at2);
    }
    h.down.insert(n(1));
    h.elect(2, 2);
    assert_eq!(h.state(2).domains, h.state(3).domains);
    assert_eq!(
        h.state(2).domains.unwrap().version,
        at2,
        "the new leader reseeds nothing"
    );
}

#[test]
fn a_second_change_computed_against_the_same_version_is_refused() {
    // Scenario: two updates of one domain computed against one version: the first is
    // proposed, the second fails its compare-and-set against the first's result.
    use bmq_config::DomainConfig;
    let mut h = domain_harness(&[DomainConfig::new("bmq.a")]);
    h.elect(1, 1);
    let now = h.now;
    let first = domain_change(h.node(1), "bmq.a", |d| d.max_queue_messages = 2);
    let second = domain_change(h.node(1), "bmq.a", |d| d.max_queue_bytes = 2);
    h.node(1).propose(now, first).unwrap();
    let refused = h.node(1).propose(now, second);
    assert!(
        matches!(
            refused,
            Err(ProposeError::Invalid(ApplyError::Domain(
                crate::domains::DomainError::VersionConflict { .. }
            )))
        ),
        "{refused:?}"
    );
    h.run();
    let a = h.state(3).domains.unwrap().get("bmq.a").unwrap().clone();
    assert_eq!(a.config.max_queue_messages, 2);
    assert_eq!(
        a.config.max_queue_bytes,
        DomainConfig::new("x").max_queue_bytes
    );
}

#[test]
fn a_ledger_without_domains_is_seeded_once_by_the_next_leader() {
    // Scenario: an upgrade: a cluster whose state has no domains (no seed configured) gets
    // them from the next leader that has a seed; a later leader's different file is ignored.
    use bmq_config::DomainConfig;
    let mut h = Harness::new();
    h.elect(1, 1);
    assert_eq!(h.state(2).domains, None);
    for id in 1..=3 {
        h.node(id)
            .set_seed_domains(vec![DomainConfig::new("bmq.old")]);
    }
    h.down.insert(n(1));
    h.elect(2, 2);
    let seeded = h.state(3).domains.clone().expect("seeded by node 2");
    assert_eq!(seeded.version, lsn(2, 1));
    h.node(3)
        .set_seed_domains(vec![DomainConfig::new("bmq.other")]);
    h.down.insert(n(2));
    h.down.remove(&n(1));
    h.elect(3, 3);
    let kept = h.state(3).domains.unwrap();
    assert_eq!(kept, seeded, "the ledger's domains win over a file");
}

#[test]
fn a_queue_of_an_unknown_domain_is_never_assigned() {
    // Scenario: with domains seeded, an assignment request for a queue whose domain does not
    // exist (deleted after its session checked it) is dropped; a known domain's is assigned.
    use bmq_config::DomainConfig;
    let mut h = domain_harness(&[DomainConfig::new("d")]);
    h.elect(1, 1);
    let now = h.now;
    let available: BTreeSet<NodeId> = members().into_iter().collect();
    let plan = crate::assignment::plan_primary_assignment(h.node(1).state(), &available);
    h.node(1)
        .propose(
            now,
            peer::Advisory {
                kind: Some(peer::advisory::Kind::PartitionPrimary(
                    peer::PartitionPrimaryAdvisory { partitions: plan },
                )),
            },
        )
        .unwrap();
    h.run();
    h.node(2).request_queue_assignment(now, "bmq://gone/q");
    h.node(2).request_queue_assignment(now, "bmq://d/q");
    h.run();
    let state = h.state(3);
    assert!(state.queues.contains_key("bmq://d/q"));
    assert!(!state.queues.contains_key("bmq://gone/q"));
    assert_eq!(h.node(1).status().uncommitted, 0);
}
