//! Step tests of the elector core's committed membership (DESIGN.md §5a): quorums of voters
//! only, non-voters never stand, a voter refuses a candidate of an older membership epoch, and
//! the effects of a membership applied on a leader, a candidate and a follower.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bmq_elector::{
    Elector, ElectorConfig, ElectorOutput, ElectorState, Membership, TransitionReason,
};
use bmq_proto::peer::elector_message::Kind;
use bmq_proto::peer::{
    ElectionProposal, ElectionResponse, ElectionScoutingRequest, ElectionScoutingResponse,
    ElectorMessage, LeaderHeartbeat,
};
use bmq_proto::{NodeId, Term};

fn n(id: u32) -> NodeId {
    NodeId(id)
}

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

fn set(ids: &[u32]) -> BTreeSet<NodeId> {
    ids.iter().copied().map(NodeId).collect()
}

fn membership(epoch: u64, members: &[u32], voters: &[u32]) -> Membership {
    Membership {
        epoch,
        members: set(members),
        voters: set(voters),
    }
}

fn config() -> ElectorConfig {
    ElectorConfig {
        random_wait_max: Duration::ZERO,
        ..Default::default()
    }
}

fn drain(e: &mut Elector) -> Vec<ElectorOutput> {
    std::iter::from_fn(|| e.poll_output()).collect()
}

fn m(kind: Kind) -> ElectorMessage {
    ElectorMessage { kind: Some(kind) }
}

fn scouting_request(term: u64, membership_epoch: u64) -> ElectorMessage {
    m(Kind::ScoutingRequest(ElectionScoutingRequest {
        term,
        membership_epoch,
    }))
}

fn proposal(term: u64, membership_epoch: u64) -> ElectorMessage {
    m(Kind::Proposal(ElectionProposal {
        term,
        membership_epoch,
    }))
}

fn scouting_answers(outputs: &[ElectorOutput]) -> Vec<(NodeId, bool)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            ElectorOutput::Send {
                to,
                message:
                    ElectorMessage {
                        kind: Some(Kind::ScoutingResponse(r)),
                    },
            } => Some((*to, r.will_vote)),
            _ => None,
        })
        .collect()
}

/// Node `id` among `members` with `voters` at `epoch`, started at `base`, outputs drained.
fn started(id: u32, m: Membership, base: Instant) -> Elector {
    let peers: Vec<NodeId> = m.members.iter().copied().collect();
    let mut e = Elector::new(n(id), &peers, config(), Term(0), 7);
    assert!(e.set_membership(base, m));
    e.start(base);
    drain(&mut e);
    e
}

/// Drives node `e` from scouting to leader of term 1 with the support of `supporters`.
fn elect(e: &mut Elector, base: Instant, supporters: &[u32]) {
    e.handle_timeout(at(base, 500));
    for p in supporters {
        e.handle_message(
            at(base, 510),
            n(*p),
            m(Kind::ScoutingResponse(ElectionScoutingResponse {
                term: 1,
                will_vote: true,
            })),
        );
    }
    e.on_term_persisted(at(base, 520), Term(1));
    for p in supporters {
        e.handle_message(
            at(base, 530),
            n(*p),
            m(Kind::ElectionResponse(ElectionResponse { term: 1 })),
        );
    }
    drain(e);
}

#[test]
fn quorum_is_a_majority_of_voters_not_of_members() {
    let base = Instant::now();
    // Five members, three voters: the learners 4 and 5 do not move the quorum.
    let e = started(1, membership(1, &[1, 2, 3, 4, 5], &[1, 2, 3]), base);
    assert_eq!(e.quorum(), 2);
    assert!(e.is_voter());
    assert_eq!(e.membership_epoch(), 1);
}

#[test]
fn support_of_learners_does_not_make_a_leader() {
    let base = Instant::now();
    let mut e = started(1, membership(1, &[1, 2, 3, 4, 5], &[1, 2, 3]), base);
    // Learners 4 and 5 answer yes: not a quorum of voters, the term is not promised.
    e.handle_timeout(at(base, 500));
    for p in [4, 5] {
        e.handle_message(
            at(base, 510),
            n(p),
            m(Kind::ScoutingResponse(ElectionScoutingResponse {
                term: 1,
                will_vote: true,
            })),
        );
    }
    assert_eq!(
        e.status().term,
        Term(0),
        "the scouting never reached a quorum"
    );
    assert!(!drain(&mut e)
        .iter()
        .any(|o| matches!(o, ElectorOutput::PersistTerm { .. })));
    // One voter more and the scouting succeeds.
    let mut e = started(1, membership(1, &[1, 2, 3, 4, 5], &[1, 2, 3]), base);
    elect(&mut e, base, &[4, 2]);
    assert_eq!(e.status().state, ElectorState::Leader);
}

#[test]
fn a_learner_never_scouts_and_only_follows() {
    let base = Instant::now();
    let mut e = started(4, membership(1, &[1, 2, 3, 4], &[1, 2, 3]), base);
    assert!(!e.is_voter());
    assert_eq!(e.poll_timeout(), None, "no scouting deadline for a learner");
    e.handle_message(
        at(base, 10),
        n(1),
        m(Kind::Heartbeat(LeaderHeartbeat { term: 3 })),
    );
    assert_eq!(e.status().leader, Some(n(1)));
    assert_eq!(e.status().term, Term(3));
}

#[test]
fn a_promoted_learner_may_scout() {
    let base = Instant::now();
    let mut e = started(4, membership(1, &[1, 2, 3, 4], &[1, 2, 3]), base);
    assert_eq!(e.poll_timeout(), None);
    assert!(e.set_membership(at(base, 100), membership(2, &[1, 2, 3, 4], &[1, 2, 3, 4])));
    assert_eq!(e.quorum(), 3);
    assert_eq!(
        e.poll_timeout(),
        Some(at(base, 100)),
        "a leaderless new voter scouts"
    );
}

#[test]
fn a_voter_refuses_a_candidate_of_an_older_epoch() {
    let base = Instant::now();
    let mut e = started(2, membership(2, &[1, 2, 3, 4], &[1, 2, 3, 4]), base);
    e.handle_message(at(base, 10), n(1), scouting_request(1, 1));
    e.handle_message(at(base, 10), n(3), scouting_request(1, 2));
    e.handle_message(at(base, 10), n(4), scouting_request(1, 3));
    let answers = scouting_answers(&drain(&mut e));
    assert_eq!(answers, vec![(n(1), false), (n(3), true), (n(4), true)]);
    assert_eq!(e.counters().older_membership_refused, 1);

    e.handle_message(at(base, 20), n(1), proposal(1, 1));
    assert_eq!(
        e.status().tentative_leader,
        None,
        "an older-epoch proposal is refused"
    );
    assert_eq!(e.counters().older_membership_refused, 2);
    e.handle_message(at(base, 20), n(3), proposal(1, 2));
    assert_eq!(e.status().tentative_leader, Some(n(3)));
}

#[test]
fn a_voter_refuses_a_non_voter_of_its_own_epoch() {
    let base = Instant::now();
    let mut e = started(2, membership(1, &[1, 2, 3, 4], &[1, 2, 3]), base);
    e.handle_message(at(base, 10), n(4), scouting_request(1, 1));
    assert_eq!(scouting_answers(&drain(&mut e)), vec![(n(4), false)]);
}

#[test]
fn a_leader_removed_from_the_voters_steps_down() {
    let base = Instant::now();
    let mut e = started(1, membership(0, &[1, 2, 3], &[1, 2, 3]), base);
    elect(&mut e, base, &[2, 3]);
    assert_eq!(e.status().state, ElectorState::Leader);
    assert!(e.set_membership(at(base, 600), membership(1, &[1, 2, 3], &[2, 3])));
    let status = e.status();
    assert_eq!(status.state, ElectorState::Follower);
    assert_eq!(status.reason, TransitionReason::MembershipChanged);
    assert_eq!(e.poll_timeout(), None, "a non-voter never scouts");
    let outputs = drain(&mut e);
    assert!(
        outputs.iter().any(|o| matches!(
            o,
            ElectorOutput::Broadcast {
                message: ElectorMessage {
                    kind: Some(Kind::Cession(_))
                }
            }
        )),
        "the removed leader announces its cession: {outputs:?}"
    );
}

#[test]
fn a_leader_without_a_quorum_of_the_new_voters_steps_down() {
    let base = Instant::now();
    let mut e = started(1, membership(0, &[1, 2, 3, 4], &[1, 2, 3]), base);
    // Supported by voter 2 only; 3 is silent, learner 4 never answered.
    elect(&mut e, base, &[2]);
    assert_eq!(e.status().state, ElectorState::Leader);
    // 4 becomes a voter: 2 of 4 is not a majority.
    e.set_membership(at(base, 600), membership(1, &[1, 2, 3, 4], &[1, 2, 3, 4]));
    assert_eq!(e.status().state, ElectorState::Follower);
    assert_eq!(e.status().reason, TransitionReason::QuorumNotAchieved);
}

#[test]
fn a_leader_supported_by_a_promoted_learner_keeps_leading() {
    let base = Instant::now();
    let mut e = started(1, membership(0, &[1, 2, 3, 4], &[1, 2, 3]), base);
    // The learner followed and sent its (unsolicited) support.
    elect(&mut e, base, &[2, 4]);
    e.set_membership(at(base, 600), membership(1, &[1, 2, 3, 4], &[1, 2, 3, 4]));
    assert_eq!(e.status().state, ElectorState::Leader);
}

#[test]
fn a_follower_drops_a_leader_that_is_no_longer_a_member() {
    let base = Instant::now();
    let mut e = started(2, membership(0, &[1, 2, 3], &[1, 2, 3]), base);
    e.handle_message(
        at(base, 10),
        n(1),
        m(Kind::Heartbeat(LeaderHeartbeat { term: 1 })),
    );
    assert_eq!(e.status().leader, Some(n(1)));
    e.set_membership(at(base, 20), membership(1, &[2, 3], &[2, 3]));
    assert_eq!(e.status().leader, None);
    assert_eq!(e.status().reason, TransitionReason::MembershipChanged);
    // Messages from the removed node are dropped.
    let dropped = e.counters().messages_dropped;
    e.handle_message(
        at(base, 30),
        n(1),
        m(Kind::Heartbeat(LeaderHeartbeat { term: 1 })),
    );
    assert_eq!(e.counters().messages_dropped, dropped + 1);
    assert_eq!(e.status().leader, None);
}

#[test]
fn an_older_membership_is_ignored() {
    let base = Instant::now();
    let mut e = started(1, membership(3, &[1, 2, 3, 4], &[1, 2, 3, 4]), base);
    assert!(!e.set_membership(at(base, 10), membership(2, &[1, 2, 3], &[1, 2, 3])));
    assert_eq!(e.membership_epoch(), 3);
    assert_eq!(e.quorum(), 3);
}

#[test]
fn scouting_requests_carry_the_epoch() {
    let base = Instant::now();
    let mut e = started(1, membership(5, &[1, 2, 3], &[1, 2, 3]), base);
    e.handle_timeout(at(base, 500));
    let outputs = drain(&mut e);
    assert!(
        outputs.iter().any(|o| matches!(
            o,
            ElectorOutput::Broadcast {
                message: ElectorMessage {
                    kind: Some(Kind::ScoutingRequest(ElectionScoutingRequest {
                        term: 1,
                        membership_epoch: 5
                    }))
                }
            }
        )),
        "{outputs:?}"
    );
}
