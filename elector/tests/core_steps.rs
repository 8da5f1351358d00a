//! Step-by-step tests of the pure elector core: each test drives one `Elector` with explicit
//! `now` values and asserts the exact outputs of every step (DESIGN.md §4, the BlazingMQ
//! leader election article, Raft §5.2 and §9.6 for pre-vote).

use std::time::{Duration, Instant};

use bmq_elector::{
    Elector, ElectorConfig, ElectorOutput, ElectorState, ElectorStatus, TransitionReason,
};
use bmq_proto::peer::elector_message::Kind;
use bmq_proto::peer::{
    ElectionProposal, ElectionResponse, ElectionScoutingRequest, ElectionScoutingResponse,
    ElectorMessage, ElectorNodeStatus, HeartbeatResponse, LeaderHeartbeat, LeadershipCession,
};
use bmq_proto::{NodeId, Term};
use ElectorOutput::{Broadcast, PersistTerm, Send, StateChanged};
use ElectorState::{Candidate, Follower, Leader};
use TransitionReason as R;

// ---------------------------------------------------------------------- helpers

fn n(id: u32) -> NodeId {
    NodeId(id)
}

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

/// Defaults without randomness, so that deadlines are exact.
fn fixed() -> ElectorConfig {
    ElectorConfig {
        random_wait_max: Duration::ZERO,
        ..Default::default()
    }
}

/// Node `id` of a cluster of nodes `1..=size`.
fn node(id: u32, size: u32, config: ElectorConfig, persisted: u64) -> Elector {
    let peers: Vec<NodeId> = (1..=size).filter(|p| *p != id).map(NodeId).collect();
    Elector::new(n(id), &peers, config, Term(persisted), 7)
}

fn drain(e: &mut Elector) -> Vec<ElectorOutput> {
    std::iter::from_fn(|| e.poll_output()).collect()
}

fn m(kind: Kind) -> ElectorMessage {
    ElectorMessage { kind: Some(kind) }
}
fn scouting_request(term: u64) -> ElectorMessage {
    m(Kind::ScoutingRequest(ElectionScoutingRequest {
        term,
        membership_epoch: 0,
    }))
}
fn scouting_response(term: u64, will_vote: bool) -> ElectorMessage {
    m(Kind::ScoutingResponse(ElectionScoutingResponse {
        term,
        will_vote,
    }))
}
fn proposal(term: u64) -> ElectorMessage {
    m(Kind::Proposal(ElectionProposal {
        term,
        membership_epoch: 0,
    }))
}
fn election_response(term: u64) -> ElectorMessage {
    m(Kind::ElectionResponse(ElectionResponse { term }))
}
fn heartbeat(term: u64) -> ElectorMessage {
    m(Kind::Heartbeat(LeaderHeartbeat { term }))
}
fn heartbeat_response(term: u64) -> ElectorMessage {
    m(Kind::HeartbeatResponse(HeartbeatResponse { term }))
}
fn cession(term: u64) -> ElectorMessage {
    m(Kind::Cession(LeadershipCession { term }))
}

fn send(to: u32, message: ElectorMessage) -> ElectorOutput {
    Send { to: n(to), message }
}
fn broadcast(message: ElectorMessage) -> ElectorOutput {
    Broadcast { message }
}
fn persist(term: u64) -> ElectorOutput {
    PersistTerm { term: Term(term) }
}
fn changed(
    state: ElectorState,
    term: u64,
    leader: Option<u32>,
    tentative_leader: Option<u32>,
    reason: TransitionReason,
    age: u64,
) -> ElectorOutput {
    StateChanged {
        status: ElectorStatus {
            state,
            term: Term(term),
            leader: leader.map(NodeId),
            tentative_leader: tentative_leader.map(NodeId),
            reason,
            age,
        },
    }
}

/// Node 1 of 3, started at `base`, made leader of term 1 with node 2's support at `base+530`
/// (the breathing test's path); outputs drained.
fn leader_of(size: u32, base: Instant) -> Elector {
    let mut e = node(1, size, fixed(), 0);
    e.start(base);
    e.handle_timeout(at(base, 500));
    for peer in 2..=e.quorum() as u32 {
        e.handle_message(at(base, 510), n(peer), scouting_response(1, true));
    }
    e.on_term_persisted(at(base, 520), Term(1));
    for peer in 2..=e.quorum() as u32 {
        e.handle_message(at(base, 530), n(peer), election_response(1));
    }
    assert_eq!(e.status().state, Leader);
    drain(&mut e);
    e
}

/// Node 1 of 3 following node 2 in term 1 since `base+100`; outputs drained.
fn follower_of_2(base: Instant) -> Elector {
    let mut e = node(1, 3, fixed(), 1);
    e.start(base);
    e.handle_message(at(base, 100), n(2), heartbeat(1));
    assert_eq!(e.status().leader, Some(n(2)));
    drain(&mut e);
    e
}

// ---------------------------------------------------------------------- tests

/// Breathing test, 3 nodes: follower -> scouting -> persist -> candidate -> leader with
/// heartbeats, seen from the winner and from a supporter.
#[test]
fn breathing_three_nodes() {
    let t = Instant::now();
    let mut a = node(1, 3, fixed(), 0);
    let mut b = node(2, 3, fixed(), 0);

    a.start(t);
    assert_eq!(
        drain(&mut a),
        vec![changed(Follower, 0, None, None, R::Started, 1)]
    );
    assert_eq!(a.poll_timeout(), Some(at(t, 500)), "initial_wait");
    b.start(t);
    drain(&mut b);

    // Initial wait over without a leader: scout for term 1 without bumping the own term.
    a.handle_timeout(at(t, 500));
    assert_eq!(drain(&mut a), vec![broadcast(scouting_request(1))]);
    assert_eq!(a.status().term, Term(0));
    assert_eq!(
        a.poll_timeout(),
        Some(at(t, 1000)),
        "scouting_result_timeout"
    );

    // A leaderless peer with a lower term says yes, and keeps its own term.
    b.handle_message(at(t, 505), n(1), scouting_request(1));
    assert_eq!(drain(&mut b), vec![send(1, scouting_response(1, true))]);
    assert_eq!(b.status().term, Term(0));

    // Quorum (2 of 3): the term is promised and must be persisted before proposing.
    a.handle_message(at(t, 510), n(2), scouting_response(1, true));
    assert_eq!(
        drain(&mut a),
        vec![persist(1), changed(Follower, 1, None, None, R::Started, 2)]
    );
    a.on_term_persisted(at(t, 520), Term(1));
    assert_eq!(
        drain(&mut a),
        vec![
            broadcast(proposal(1)),
            changed(Candidate, 1, None, None, R::None, 3)
        ]
    );
    assert_eq!(
        a.poll_timeout(),
        Some(at(t, 1020)),
        "election_result_timeout"
    );

    // The supporter persists, then answers.
    b.handle_message(at(t, 521), n(1), proposal(1));
    assert_eq!(
        drain(&mut b),
        vec![persist(1), changed(Follower, 1, None, Some(1), R::None, 2)]
    );
    b.on_term_persisted(at(t, 522), Term(1));
    assert_eq!(drain(&mut b), vec![send(1, election_response(1))]);

    // Quorum of supporters: leader, heartbeat at once and every heartbeat_period.
    a.handle_message(at(t, 530), n(2), election_response(1));
    assert_eq!(
        drain(&mut a),
        vec![
            broadcast(heartbeat(1)),
            changed(Leader, 1, Some(1), None, R::None, 4)
        ]
    );
    assert_eq!(a.poll_timeout(), Some(at(t, 630)));
    a.handle_timeout(at(t, 630));
    assert_eq!(drain(&mut a), vec![broadcast(heartbeat(1))]);
    assert_eq!(a.poll_timeout(), Some(at(t, 730)));

    // The supporter follows its tentative leader on the first heartbeat, without a second
    // ElectionResponse; a late response from node 3 is accepted silently.
    b.handle_message(at(t, 531), n(1), heartbeat(1));
    assert_eq!(
        drain(&mut b),
        vec![changed(Follower, 1, Some(1), None, R::None, 3)]
    );
    a.handle_message(at(t, 640), n(3), election_response(1));
    assert_eq!(drain(&mut a), vec![]);
    assert_eq!(a.counters().elections_started, 1);
    assert_eq!(a.counters().elections_won, 1);
}

/// ElectionScouting is refused by a node that has a leader, whatever the term (sticky leader),
/// and answered by term comparison otherwise; scouting never changes the receiver's term.
#[test]
fn scouting_refused_by_node_with_leader() {
    let t = Instant::now();
    let mut f = follower_of_2(t);
    f.handle_message(at(t, 110), n(3), scouting_request(9));
    assert_eq!(drain(&mut f), vec![send(3, scouting_response(9, false))]);
    assert_eq!(f.status().term, Term(1));

    let mut leader = leader_of(3, t);
    leader.handle_message(at(t, 600), n(3), scouting_request(9));
    assert_eq!(
        drain(&mut leader),
        vec![send(3, scouting_response(9, false))]
    );
    assert_eq!(leader.status().state, Leader);

    let mut leaderless = node(1, 3, fixed(), 4);
    leaderless.start(t);
    drain(&mut leaderless);
    leaderless.handle_message(at(t, 1), n(3), scouting_request(4));
    leaderless.handle_message(at(t, 2), n(3), scouting_request(5));
    assert_eq!(
        drain(&mut leaderless),
        vec![
            send(3, scouting_response(4, false)),
            send(3, scouting_response(5, true))
        ]
    );
    assert_eq!(leaderless.status().term, Term(4));
}

/// A leaderless follower supports a higher proposal, but its ElectionResponse leaves only after
/// the new term is persisted; a second candidate of the same term is refused.
#[test]
fn leaderless_follower_supports_higher_proposal_only_after_persisting() {
    let t = Instant::now();
    let mut f = node(1, 3, fixed(), 2);
    f.start(t);
    drain(&mut f);

    f.handle_message(at(t, 10), n(2), proposal(2));
    assert_eq!(drain(&mut f), vec![], "not above the own term");

    f.handle_message(at(t, 20), n(2), proposal(3));
    assert_eq!(
        drain(&mut f),
        vec![persist(3), changed(Follower, 3, None, Some(2), R::None, 2)]
    );
    f.handle_message(at(t, 25), n(3), proposal(3));
    assert_eq!(drain(&mut f), vec![], "never two candidates in one term");
    f.on_term_persisted(at(t, 30), Term(3));
    assert_eq!(drain(&mut f), vec![send(2, election_response(3))]);
    // If the candidate never heartbeats, scout once its election would have failed.
    assert_eq!(f.poll_timeout(), Some(at(t, 520)));
}

/// A follower that has a leader ignores a proposal, even with a much higher term.
#[test]
fn follower_with_leader_ignores_proposal() {
    let t = Instant::now();
    let mut f = follower_of_2(t);
    f.handle_message(at(t, 110), n(3), proposal(9));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.status().term, Term(1));
    assert_eq!(f.status().leader, Some(n(2)));
    assert_eq!(f.counters().messages_dropped, 1);
}

/// A leader ignores a proposal whatever its term (sticky leader).
#[test]
fn leader_ignores_proposal() {
    let t = Instant::now();
    let mut l = leader_of(3, t);
    l.handle_message(at(t, 600), n(3), proposal(9));
    assert_eq!(drain(&mut l), vec![]);
    assert_eq!(l.status().state, Leader);
    assert_eq!(l.status().term, Term(1));
}

/// A candidate that hears a heartbeat of its own term from another node follows it
/// (ElectionPreempted) and sends it an unsolicited ElectionResponse.
#[test]
fn candidate_preempted_by_heartbeat() {
    let t = Instant::now();
    let mut c = node(1, 3, fixed(), 0);
    c.start(t);
    c.handle_timeout(at(t, 500));
    c.handle_message(at(t, 510), n(2), scouting_response(1, true));
    c.on_term_persisted(at(t, 520), Term(1));
    assert_eq!(c.status().state, Candidate);
    drain(&mut c);

    c.handle_message(at(t, 530), n(3), heartbeat(1));
    assert_eq!(
        drain(&mut c),
        vec![
            send(3, election_response(1)),
            changed(Follower, 1, Some(3), None, R::ElectionPreempted, 4)
        ]
    );
    // A lower-term heartbeat would have been answered instead.
    let mut c2 = node(1, 3, fixed(), 5);
    c2.start(t);
    drain(&mut c2);
    c2.handle_message(at(t, 1), n(3), heartbeat(4));
    assert_eq!(drain(&mut c2), vec![send(3, heartbeat_response(5))]);
}

/// A candidate supports a higher proposal (ElectionPreempted), persisting first.
#[test]
fn candidate_preempted_by_higher_proposal() {
    let t = Instant::now();
    let mut c = node(1, 3, fixed(), 0);
    c.start(t);
    c.handle_timeout(at(t, 500));
    c.handle_message(at(t, 510), n(2), scouting_response(1, true));
    c.on_term_persisted(at(t, 520), Term(1));
    drain(&mut c);
    c.handle_message(at(t, 530), n(3), proposal(1));
    assert_eq!(drain(&mut c), vec![], "same term: own candidacy");
    c.handle_message(at(t, 540), n(3), proposal(2));
    assert_eq!(
        drain(&mut c),
        vec![
            persist(2),
            changed(Follower, 2, None, Some(3), R::ElectionPreempted, 4)
        ]
    );
    c.on_term_persisted(at(t, 541), Term(2));
    assert_eq!(drain(&mut c), vec![send(3, election_response(2))]);
}

/// A candidate without a quorum before election_result_timeout returns to follower and scouts
/// again after the random wait.
#[test]
fn candidate_times_out_without_quorum() {
    let t = Instant::now();
    let mut c = node(1, 3, fixed(), 0);
    c.start(t);
    c.handle_timeout(at(t, 500));
    c.handle_message(at(t, 510), n(2), scouting_response(1, true));
    c.on_term_persisted(at(t, 520), Term(1));
    drain(&mut c);
    assert_eq!(c.poll_timeout(), Some(at(t, 1020)));
    c.handle_timeout(at(t, 1020));
    assert_eq!(
        drain(&mut c),
        vec![changed(Follower, 1, None, None, R::QuorumNotAchieved, 4)]
    );
    c.handle_timeout(at(t, 1020));
    assert_eq!(drain(&mut c), vec![broadcast(scouting_request(2))]);
}

/// A follower drops its silent leader at the first check at which
/// heartbeat_miss_count * heartbeat_period (800 ms) have passed since the last heartbeat.
#[test]
fn follower_detects_missing_heartbeats_at_exact_time() {
    let t = Instant::now();
    let mut f = follower_of_2(t); // last heartbeat at t+100
                                  // A heartbeat at t+300 postpones detection to t+1100.
    let mut deadlines = Vec::new();
    while let Some(deadline) = f.poll_timeout().filter(|d| *d < at(t, 1100)) {
        if deadline == at(t, 300) {
            f.handle_message(deadline, n(2), heartbeat(1));
        }
        f.handle_timeout(deadline);
        assert_eq!(drain(&mut f), vec![], "no loss before t+1100");
        deadlines.push(deadline);
    }
    assert_eq!(
        deadlines.first(),
        Some(&at(t, 150)),
        "checked every heartbeat_check_period"
    );
    assert_eq!(deadlines.last(), Some(&at(t, 1050)));
    assert_eq!(f.poll_timeout(), Some(at(t, 1100)));
    f.handle_timeout(at(t, 1100));
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeaderNoHeartbeat, 3)]
    );
    // One period seen silent before the heartbeat at t+300, then eight.
    assert_eq!(f.counters().heartbeats_missed, 9);
    // random_wait_max = 0: scouting starts at once.
    assert_eq!(f.poll_timeout(), Some(at(t, 1100)));
    f.handle_timeout(at(t, 1100));
    assert_eq!(drain(&mut f), vec![broadcast(scouting_request(2))]);
}

/// A follower drops its leader when the connection to it drops (LeaderUnavailable), and on
/// its LeadershipCession (LeadershipCeded).
#[test]
fn follower_drops_unavailable_or_ceding_leader() {
    let t = Instant::now();
    let mut f = follower_of_2(t);
    f.handle_peer_available(at(t, 110), n(3), false);
    assert_eq!(drain(&mut f), vec![]);
    f.handle_peer_available(at(t, 120), n(2), false);
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeaderUnavailable, 3)]
    );

    let mut f = follower_of_2(t);
    f.handle_message(at(t, 110), n(3), cession(1));
    assert_eq!(drain(&mut f), vec![], "not our leader");
    f.handle_message(at(t, 120), n(2), cession(1));
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeadershipCeded, 3)]
    );
}

/// After the leader's loss the survivors scout in node-id order
/// (`successor_wait_bounds`): in a cluster of 3 that lost node 1, node 2 scouts within
/// random_wait_max / 30 .. / 10 and node 3 only from random_wait_max / 2 on, whatever the seed.
#[test]
fn survivors_scout_in_node_id_order() {
    let t = Instant::now();
    for seed in 0..50 {
        let follower = |id: u32| {
            let peers: Vec<NodeId> = (1..=3).filter(|p| *p != id).map(NodeId).collect();
            let mut e = Elector::new(n(id), &peers, ElectorConfig::default(), Term(1), seed);
            e.start(t);
            e.handle_message(at(t, 100), n(1), heartbeat(1));
            assert_eq!(e.status().leader, Some(n(1)));
            drain(&mut e);
            e
        };
        for (id, low, high) in [(2, 10, 30), (3, 150, 300)] {
            let mut e = follower(id);
            e.handle_peer_available(at(t, 200), n(1), false);
            let wait = e.poll_timeout().expect("a scouting is armed") - at(t, 200);
            assert!(
                wait >= Duration::from_millis(low) && wait <= Duration::from_millis(high),
                "node {id}, seed {seed}: waits {wait:?}"
            );
        }
    }
}

/// A silent leader is dropped at its own deadline (last heartbeat + 800 ms), not at the next
/// periodic check after it: here the checks fall at t+150, t+200, ... and the last
/// heartbeat at t+330, so the deadline t+1130 falls between two checks.
#[test]
fn silent_leader_dropped_at_its_deadline_between_checks() {
    let t = Instant::now();
    let mut f = follower_of_2(t);
    f.handle_message(at(t, 330), n(2), heartbeat(1));
    let mut last = None;
    while let Some(deadline) = f.poll_timeout().filter(|d| *d < at(t, 1130)) {
        f.handle_timeout(deadline);
        assert_eq!(drain(&mut f), vec![]);
        last = Some(deadline);
    }
    assert_eq!(last, Some(at(t, 1100)));
    assert_eq!(f.poll_timeout(), Some(at(t, 1130)));
    f.handle_timeout(at(t, 1130));
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeaderNoHeartbeat, 3)]
    );
}

/// A leader steps down on a HeartbeatResponse with a higher term: it broadcasts
/// LeadershipCession for its old term, persists the new term and becomes a follower.
#[test]
fn leader_steps_down_on_higher_term_heartbeat_response() {
    let t = Instant::now();
    let mut l = leader_of(3, t);
    l.handle_message(at(t, 600), n(3), heartbeat_response(1));
    assert_eq!(drain(&mut l), vec![], "not higher");
    l.handle_message(at(t, 610), n(3), heartbeat_response(5));
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            persist(5),
            changed(Follower, 5, None, None, R::LeaderPreempted, 5)
        ]
    );
}

/// A leader answers a heartbeat of a lower term with its own heartbeat, and on a heartbeat of
/// a higher term cedes, then follows the sender once the term is persisted.
#[test]
fn leader_and_foreign_heartbeats() {
    let t = Instant::now();
    let mut l = leader_of(3, t);
    l.handle_message(at(t, 600), n(3), heartbeat(0));
    assert_eq!(drain(&mut l), vec![send(3, heartbeat(1))]);
    l.handle_message(at(t, 610), n(3), heartbeat(2));
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            persist(2),
            changed(Follower, 2, Some(3), None, R::LeaderPreempted, 5)
        ]
    );
    l.on_term_persisted(at(t, 611), Term(2));
    assert_eq!(drain(&mut l), vec![send(3, election_response(2))]);
}

/// A leader of 5 (quorum 3) steps down with QuorumNotAchieved once its live supporters plus
/// itself fall below the quorum.
#[test]
fn leader_loses_quorum_when_supporters_become_unavailable() {
    let t = Instant::now();
    let mut l = leader_of(5, t); // supporters 2 and 3
    l.handle_message(at(t, 540), n(4), election_response(1));
    assert_eq!(drain(&mut l), vec![]);
    l.handle_peer_available(at(t, 600), n(4), false);
    assert_eq!(drain(&mut l), vec![], "2, 3 and self are still a quorum");
    l.handle_peer_available(at(t, 610), n(2), false);
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            changed(Follower, 1, None, None, R::QuorumNotAchieved, 5)
        ]
    );
}

/// A reconnecting peer gets the leader's heartbeat at once; a response from an unavailable peer
/// does not count as support.
#[test]
fn leader_greets_reconnected_peer() {
    let t = Instant::now();
    let mut l = leader_of(3, t);
    l.handle_peer_available(at(t, 600), n(3), false);
    assert_eq!(drain(&mut l), vec![]);
    l.handle_peer_available(at(t, 700), n(3), true);
    assert_eq!(drain(&mut l), vec![send(3, heartbeat(1))]);
}

/// A restarted follower's ElectionResponse that arrives before this leader's link monitor
/// reports it up is counted once the link is up (dropping it left the follower
/// uncounted for the whole term, and the later loss of the other supporter cost the leader its
/// quorum); a response from a peer whose link then goes down again is forgotten.
#[test]
fn support_received_while_link_down_counts_once_link_is_up() {
    let t = Instant::now();
    let mut l = leader_of(3, t); // supporter 2
    l.handle_peer_available(at(t, 600), n(3), false);
    // Node 3 restarts, follows us and answers before its link is reported up.
    l.handle_message(at(t, 650), n(3), election_response(1));
    assert_eq!(drain(&mut l), vec![]);
    l.handle_peer_available(at(t, 700), n(3), true);
    assert_eq!(drain(&mut l), vec![send(3, heartbeat(1))]);
    l.handle_peer_available(at(t, 800), n(2), false);
    assert_eq!(drain(&mut l), vec![], "3 and self are still a quorum");
    assert_eq!(l.status().state, Leader);

    // The same answer, but the link drops before it is reported up: it never counts.
    let mut l = leader_of(3, t);
    l.handle_peer_available(at(t, 600), n(3), false);
    l.handle_message(at(t, 650), n(3), election_response(1));
    l.handle_peer_available(at(t, 660), n(3), false);
    l.handle_peer_available(at(t, 700), n(3), true);
    drain(&mut l);
    l.handle_peer_available(at(t, 800), n(2), false);
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            changed(Follower, 1, None, None, R::QuorumNotAchieved, 5)
        ]
    );
}

/// With quorum 1 and no peers (initial_wait 0), a single node becomes leader right after
/// start; raising the quorum above N makes it step down and forbids leadership.
#[test]
fn single_node_becomes_leader_without_peers() {
    let t = Instant::now();
    let mut e = Elector::new(n(1), &[], ElectorConfig::default(), Term(4), 1);
    assert_eq!(e.quorum(), 1);
    e.start(t);
    assert_eq!(
        drain(&mut e),
        vec![changed(Follower, 4, None, None, R::Started, 1)]
    );
    assert_eq!(e.poll_timeout(), Some(t));
    e.handle_timeout(t);
    assert_eq!(
        drain(&mut e),
        vec![persist(5), changed(Follower, 5, None, None, R::Started, 2)]
    );
    e.on_term_persisted(t, Term(5));
    assert_eq!(
        drain(&mut e),
        vec![changed(Leader, 5, Some(1), None, R::None, 3)]
    );

    e.set_quorum(at(t, 10), 2);
    assert_eq!(e.quorum(), 2);
    assert_eq!(
        drain(&mut e),
        vec![changed(Follower, 5, None, None, R::QuorumNotAchieved, 4)]
    );
    for _ in 0..10 {
        let deadline = e
            .poll_timeout()
            .expect("a leaderless follower always has a timer");
        e.handle_timeout(deadline);
        assert_eq!(drain(&mut e), vec![], "scouting can never succeed");
    }
    assert_eq!(e.status().term, Term(5));
}

/// A stale heartbeat (term below the own term) is answered with HeartbeatResponse{own term}.
#[test]
fn stale_heartbeat_answered_with_heartbeat_response() {
    let t = Instant::now();
    let mut f = node(1, 3, fixed(), 5);
    f.start(t);
    drain(&mut f);
    f.handle_message(at(t, 10), n(2), heartbeat(3));
    assert_eq!(drain(&mut f), vec![send(2, heartbeat_response(5))]);
    let mut f = follower_of_2(t);
    f.handle_message(at(t, 200), n(3), heartbeat(0));
    assert_eq!(drain(&mut f), vec![send(3, heartbeat_response(1))]);
}

/// A leaderless follower that discovers a leader by its heartbeat adopts its term (persisting
/// first) and sends it an unsolicited ElectionResponse.
#[test]
fn unsolicited_election_response_on_discovering_leader() {
    let t = Instant::now();
    let mut f = node(1, 3, fixed(), 0);
    f.start(t);
    drain(&mut f);
    f.handle_message(at(t, 100), n(2), heartbeat(4));
    assert_eq!(
        drain(&mut f),
        vec![persist(4), changed(Follower, 4, Some(2), None, R::None, 2)]
    );
    f.on_term_persisted(at(t, 101), Term(4));
    assert_eq!(drain(&mut f), vec![send(2, election_response(4))]);

    // Already at that term on disk: the response leaves at once.
    let mut f = node(1, 3, fixed(), 4);
    f.start(t);
    drain(&mut f);
    f.handle_message(at(t, 100), n(2), heartbeat(4));
    assert_eq!(
        drain(&mut f),
        vec![
            send(2, election_response(4)),
            changed(Follower, 4, Some(2), None, R::None, 2)
        ]
    );
    // A follower that reconnects to its leader tells it again that it supports it.
    f.handle_peer_available(at(t, 200), n(2), true);
    assert_eq!(drain(&mut f), vec![send(2, election_response(4))]);
}

/// A restarted node (a new core from the persisted term T) never supports a second candidate
/// in term T; a crash before the persist completed released no vote, so it may vote in T.
#[test]
fn restarted_node_never_supports_second_candidate_in_persisted_term() {
    let t = Instant::now();
    let mut before = node(1, 3, fixed(), 2);
    before.start(t);
    before.handle_message(at(t, 10), n(2), proposal(3));
    before.on_term_persisted(at(t, 11), Term(3));
    assert!(drain(&mut before).contains(&send(2, election_response(3))));

    // Restart with the term store's content.
    let mut after = node(1, 3, fixed(), 3);
    after.start(at(t, 20));
    drain(&mut after);
    after.handle_message(at(t, 30), n(3), proposal(3));
    assert_eq!(drain(&mut after), vec![]);
    after.handle_message(at(t, 31), n(3), scouting_request(3));
    assert_eq!(
        drain(&mut after),
        vec![send(3, scouting_response(3, false))]
    );

    // Crash before the fsync: term 2 on disk, no response was sent, so supporting 3 is safe.
    let mut crashed = node(1, 3, fixed(), 2);
    crashed.start(t);
    drain(&mut crashed);
    crashed.handle_message(at(t, 10), n(2), proposal(3));
    assert!(!drain(&mut crashed).iter().any(|o| matches!(o, Send { .. })));
}

/// ElectionScouting that gets only one `will_vote` of the two needed (5 nodes) fails at
/// scouting_result_timeout; the node scouts again after a random wait, without having
/// changed its term.
#[test]
fn scouting_timeout_with_one_response_then_scout_again() {
    let t = Instant::now();
    let mut e = node(1, 5, ElectorConfig::default(), 0);
    e.start(t);
    let first = e.poll_timeout().unwrap();
    assert!(
        first >= at(t, 500) && first <= at(t, 800),
        "initial_wait + random wait"
    );
    e.handle_timeout(first);
    assert_eq!(
        drain(&mut e),
        vec![
            changed(Follower, 0, None, None, R::Started, 1),
            broadcast(scouting_request(1))
        ]
    );
    let ms = |d: u64| first + Duration::from_millis(d);
    e.handle_message(ms(10), n(2), scouting_response(1, true));
    e.handle_message(ms(11), n(3), scouting_response(1, false));
    e.handle_message(ms(12), n(4), scouting_response(7, true));
    assert_eq!(drain(&mut e), vec![]);
    assert_eq!(e.poll_timeout(), Some(ms(500)));
    e.handle_timeout(ms(500));
    assert_eq!(drain(&mut e), vec![]);
    let again = e.poll_timeout().unwrap();
    assert!(
        again >= ms(500) && again <= ms(800),
        "random wait in [0, 300 ms]"
    );
    e.handle_timeout(again);
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(1))]);
    assert_eq!(e.status().term, Term(0));
    assert_eq!(e.counters().scoutings_started, 2);
}

/// A supporter that goes unavailable during scouting no longer counts.
#[test]
fn unavailable_scouting_supporter_is_removed() {
    let t = Instant::now();
    let mut e = node(1, 5, fixed(), 0);
    e.start(t);
    e.handle_timeout(at(t, 500));
    e.handle_message(at(t, 510), n(2), scouting_response(1, true));
    e.handle_peer_available(at(t, 515), n(2), false);
    drain(&mut e);
    e.handle_message(at(t, 520), n(3), scouting_response(1, true));
    assert_eq!(drain(&mut e), vec![], "2 left: only 3 and self");
    e.handle_message(at(t, 530), n(4), scouting_response(1, true));
    assert_eq!(
        drain(&mut e),
        vec![persist(1), changed(Follower, 1, None, None, R::Started, 2)]
    );
}

/// cede_leadership: the leader broadcasts LeadershipCession, becomes a follower
/// (LeadershipCeded) and waits at least random_wait_max before scouting.
#[test]
fn cede_leadership() {
    let t = Instant::now();
    let mut l = node(1, 3, ElectorConfig::default(), 0);
    l.start(t);
    let first = l.poll_timeout().unwrap();
    let ms = |d: u64| first + Duration::from_millis(d);
    l.handle_timeout(first);
    l.handle_message(ms(10), n(2), scouting_response(1, true));
    l.on_term_persisted(ms(20), Term(1));
    l.handle_message(ms(30), n(2), election_response(1));
    assert_eq!(l.status().state, Leader);
    drain(&mut l);

    l.cede_leadership(ms(100));
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            changed(Follower, 1, None, None, R::LeadershipCeded, 5)
        ]
    );
    let next = l.poll_timeout().unwrap();
    assert!(
        next >= ms(400) && next <= ms(700),
        "random_wait_max + random wait: {:?}",
        next - first
    );
    // Another node's scouting gets our vote meanwhile.
    l.handle_message(ms(110), n(2), scouting_request(2));
    assert_eq!(drain(&mut l), vec![send(2, scouting_response(2, true))]);
    // Ceding again is a no-op.
    l.cede_leadership(ms(120));
    assert_eq!(drain(&mut l), vec![]);
}

/// retire (graceful stop): a leader cedes at once; afterwards the node never scouts or stands
/// again, even when it loses its leader, but it still answers other nodes' scouting.
#[test]
fn retired_node_cedes_and_never_stands_again() {
    let t = Instant::now();
    let mut l = leader_of(3, t);
    l.retire(at(t, 600));
    let outputs = drain(&mut l);
    assert_eq!(outputs[0], broadcast(cession(1)));
    assert_eq!(l.status().state, Follower);
    assert!(l.is_retired());
    // No scouting, however long we wait.
    for ms in (1_000..10_000).step_by(50) {
        l.handle_timeout(at(t, ms));
    }
    assert!(!drain(&mut l).iter().any(is_scouting));
    // Another node's scouting still gets our vote.
    l.handle_message(at(t, 5_010), n(2), scouting_request(2));
    assert_eq!(drain(&mut l), vec![send(2, scouting_response(2, true))]);

    // A retired follower whose leader goes silent does not scout either.
    let mut f = follower_of_2(t);
    f.retire(at(t, 150));
    assert_eq!(drain(&mut f), vec![]);
    for ms in (200..10_000).step_by(50) {
        f.handle_timeout(at(t, ms));
    }
    let outputs = drain(&mut f);
    assert_eq!(f.status().leader, None, "the silent leader was dropped");
    assert!(!outputs.iter().any(is_scouting), "{outputs:?}");
}

fn is_scouting(o: &ElectorOutput) -> bool {
    matches!(o, ElectorOutput::Broadcast { message }
        if matches!(message.kind, Some(Kind::ScoutingRequest(_))))
}

/// Unknown senders, empty messages and a dormant elector are ignored.
#[test]
fn unknown_sender_and_dormant_are_ignored() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.handle_message(t, n(2), heartbeat(3));
    assert_eq!(drain(&mut e), vec![], "dormant");
    e.start(t);
    drain(&mut e);
    e.handle_message(t, n(9), heartbeat(3));
    e.handle_message(t, n(1), heartbeat(3));
    e.handle_message(t, n(2), ElectorMessage { kind: None });
    e.handle_peer_available(t, n(9), false);
    assert_eq!(drain(&mut e), vec![]);
    assert_eq!(e.counters().messages_dropped, 4);
    // NodeStatus{available=false} from the leader counts as its unavailability.
    let mut f = follower_of_2(t);
    f.handle_message(
        at(t, 150),
        n(2),
        m(Kind::NodeStatus(ElectorNodeStatus {
            term: 1,
            available: false,
        })),
    );
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeaderUnavailable, 3)]
    );
}

/// Arbitrary message sequences from known and unknown senders never panic and never lower the
/// term (a cheap deterministic fuzz over a few seeds).
#[test]
fn arbitrary_input_never_panics() {
    use rand::{Rng, SeedableRng};
    let t = Instant::now();
    for seed in 0..20u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut e = node(1, 3, ElectorConfig::default(), 0);
        e.start(t);
        let mut now = t;
        let mut last_term = Term(0);
        for _ in 0..500 {
            now += Duration::from_millis(rng.gen_range(0..40));
            let from = n(rng.gen_range(0..5));
            let term = rng.gen_range(0..6);
            let kind = match rng.gen_range(0..10) {
                0 => Kind::ScoutingRequest(ElectionScoutingRequest {
                    term,
                    membership_epoch: 0,
                }),
                1 => Kind::ScoutingResponse(ElectionScoutingResponse {
                    term,
                    will_vote: rng.gen(),
                }),
                2 => Kind::Proposal(ElectionProposal {
                    term,
                    membership_epoch: 0,
                }),
                3 => Kind::ElectionResponse(ElectionResponse { term }),
                4 => Kind::Heartbeat(LeaderHeartbeat { term }),
                5 => Kind::HeartbeatResponse(HeartbeatResponse { term }),
                6 => Kind::Cession(LeadershipCession { term }),
                7 => Kind::NodeStatus(ElectorNodeStatus {
                    term,
                    available: rng.gen(),
                }),
                8 => {
                    e.handle_peer_available(now, from, rng.gen());
                    continue;
                }
                _ => {
                    if let Some(d) = e.poll_timeout() {
                        now = now.max(d);
                        e.handle_timeout(now);
                    }
                    continue;
                }
            };
            e.handle_message(now, from, m(kind));
            while let Some(out) = e.poll_output() {
                if let PersistTerm { term } = out {
                    e.on_term_persisted(now, term);
                }
                if let StateChanged { status } = out {
                    assert!(status.term >= last_term);
                    last_term = status.term;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------- one test per rule

/// Drives `e` through its deadlines up to (excluding) `until`, asserting that none of them
/// produces an output.
fn quiet_until(e: &mut Elector, until: Instant) {
    while let Some(deadline) = e.poll_timeout().filter(|d| *d < until) {
        e.handle_timeout(deadline);
        assert_eq!(drain(e), vec![], "nothing happens before {until:?}");
    }
}

/// A node elects itself after the initial wait plus a random wait; later, having lost its
/// leader, it scouts again after the random wait alone (the article's two waits).
#[test]
fn election_after_initial_wait_and_after_random_wait() {
    let t = Instant::now();
    let mut e = node(1, 3, ElectorConfig::default(), 1);
    e.start(t);
    assert_eq!(
        drain(&mut e),
        vec![changed(Follower, 1, None, None, R::Started, 1)]
    );
    let first = e.poll_timeout().unwrap();
    assert!(
        first >= at(t, 500) && first <= at(t, 800),
        "initial_wait 500 ms + random wait in [0, 300 ms]: {:?}",
        first - t
    );
    quiet_until(&mut e, first);
    e.handle_timeout(first);
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(2))]);
    let ms = |base: Instant, d: u64| base + Duration::from_millis(d);
    e.handle_message(ms(first, 5), n(3), scouting_response(2, true));
    assert_eq!(
        drain(&mut e),
        vec![persist(2), changed(Follower, 2, None, None, R::Started, 2)]
    );
    e.on_term_persisted(ms(first, 6), Term(2));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(proposal(2)),
            changed(Candidate, 2, None, None, R::None, 3)
        ]
    );
    e.handle_message(ms(first, 7), n(3), election_response(2));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(heartbeat(2)),
            changed(Leader, 2, Some(1), None, R::None, 4)
        ]
    );

    // A follower whose leader cedes scouts after the random wait only.
    let mut f = node(1, 3, ElectorConfig::default(), 1);
    f.start(t);
    drain(&mut f);
    f.handle_message(at(t, 100), n(2), heartbeat(1));
    assert_eq!(
        drain(&mut f),
        vec![
            send(2, election_response(1)),
            changed(Follower, 1, Some(2), None, R::None, 2)
        ]
    );
    f.handle_message(at(t, 150), n(2), cession(1));
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeadershipCeded, 3)]
    );
    let again = f.poll_timeout().unwrap();
    assert!(
        again >= at(t, 150) && again <= at(t, 450),
        "random wait in [0, 300 ms]: {:?}",
        again - t
    );
    quiet_until(&mut f, again);
    f.handle_timeout(again);
    assert_eq!(drain(&mut f), vec![broadcast(scouting_request(2))]);
    f.handle_message(ms(again, 1), n(3), scouting_response(2, true));
    f.on_term_persisted(ms(again, 2), Term(2));
    f.handle_message(ms(again, 3), n(3), election_response(2));
    assert_eq!(f.status().state, Leader);
    assert_eq!(f.status().term, Term(2));
}

/// Three times in a row: the node scouts, becomes candidate, is pre-empted by a heartbeat of
/// its own term from another node, follows it, and loses it after 800 ms of silence
/// (LeaderNoHeartbeat); each round scouts for the next term.
#[test]
fn candidate_preempted_by_heartbeat_then_leader_inactivity_repeated() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.start(t);
    drain(&mut e);
    let mut now = at(t, 500);
    let mut age = 1;
    let mut reason = R::Started;
    for term in 1..=3u64 {
        quiet_until(&mut e, now);
        assert_eq!(e.poll_timeout(), Some(now));
        e.handle_timeout(now);
        assert_eq!(drain(&mut e), vec![broadcast(scouting_request(term))]);
        e.handle_message(now, n(2), scouting_response(term, true));
        assert_eq!(
            drain(&mut e),
            vec![
                persist(term),
                changed(Follower, term, None, None, reason, age + 1)
            ]
        );
        e.on_term_persisted(now, Term(term));
        assert_eq!(
            drain(&mut e),
            vec![
                broadcast(proposal(term)),
                changed(Candidate, term, None, None, R::None, age + 2)
            ]
        );
        let heard = now + Duration::from_millis(10);
        e.handle_message(heard, n(3), heartbeat(term));
        assert_eq!(
            drain(&mut e),
            vec![
                send(3, election_response(term)),
                changed(Follower, term, Some(3), None, R::ElectionPreempted, age + 3)
            ]
        );
        let lost = heard + Duration::from_millis(800);
        quiet_until(&mut e, lost);
        assert_eq!(e.poll_timeout(), Some(lost));
        e.handle_timeout(lost);
        assert_eq!(
            drain(&mut e),
            vec![changed(
                Follower,
                term,
                None,
                None,
                R::LeaderNoHeartbeat,
                age + 4
            )]
        );
        age += 4;
        reason = R::LeaderNoHeartbeat;
        now = lost;
    }
    assert_eq!(e.counters().elections_started, 3);
    assert_eq!(e.counters().elections_won, 0);
}

/// The whole path of one node: scouting -> candidate -> leader; then a heartbeat of a higher
/// term makes it cede (LeadershipCession for its term) and follow the sender once the new
/// term is on disk.
#[test]
fn scouting_candidate_leader_then_higher_heartbeat_cedes() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.start(t);
    drain(&mut e);
    e.handle_timeout(at(t, 500));
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(1))]);
    e.handle_message(at(t, 501), n(3), scouting_response(1, true));
    assert_eq!(
        drain(&mut e),
        vec![persist(1), changed(Follower, 1, None, None, R::Started, 2)]
    );
    e.on_term_persisted(at(t, 502), Term(1));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(proposal(1)),
            changed(Candidate, 1, None, None, R::None, 3)
        ]
    );
    e.handle_message(at(t, 503), n(3), election_response(1));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(heartbeat(1)),
            changed(Leader, 1, Some(1), None, R::None, 4)
        ]
    );
    e.handle_message(at(t, 600), n(2), heartbeat(3));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(cession(1)),
            persist(3),
            changed(Follower, 3, Some(2), None, R::LeaderPreempted, 5)
        ]
    );
    e.on_term_persisted(at(t, 601), Term(3));
    assert_eq!(drain(&mut e), vec![send(2, election_response(3))]);
    assert_eq!(e.poll_timeout(), Some(at(t, 650)), "heartbeat checks start");
}

/// A leader ignores ElectionProposals of a lower, an equal and a higher term (sticky leader):
/// no output, no term change, each dropped and counted.
#[test]
fn leader_ignores_proposals_of_lower_equal_and_higher_terms() {
    let t = Instant::now();
    let mut l = leader_of(3, t); // term 1
    let dropped = l.counters().messages_dropped;
    for (from, term) in [(2, 0), (3, 1), (2, 2), (3, 9)] {
        l.handle_message(at(t, 600), n(from), proposal(term));
        assert_eq!(drain(&mut l), vec![], "proposal of term {term}");
    }
    assert_eq!(l.status().state, Leader);
    assert_eq!(l.status().term, Term(1));
    assert_eq!(l.counters().messages_dropped, dropped + 4);
    assert_eq!(l.poll_timeout(), Some(at(t, 630)), "heartbeats go on");
}

/// Quorum 1 in a 3-node cluster: scouting succeeds on the node's own support, and the
/// candidacy becomes leadership at once; losing every peer does not cost it leadership.
#[test]
fn quorum_one_in_three_node_cluster() {
    let t = Instant::now();
    let config = ElectorConfig {
        quorum: 1,
        ..fixed()
    };
    let mut e = node(1, 3, config, 0);
    assert_eq!(e.quorum(), 1);
    e.start(t);
    drain(&mut e);
    e.handle_timeout(at(t, 500));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(scouting_request(1)),
            persist(1),
            changed(Follower, 1, None, None, R::Started, 2)
        ]
    );
    e.on_term_persisted(at(t, 501), Term(1));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(proposal(1)),
            broadcast(heartbeat(1)),
            changed(Leader, 1, Some(1), None, R::None, 3)
        ]
    );
    e.handle_peer_available(at(t, 510), n(2), false);
    e.handle_peer_available(at(t, 511), n(3), false);
    assert_eq!(drain(&mut e), vec![]);
    assert_eq!(e.status().state, Leader);
}

/// ElectionResponses that do not apply are dropped without effect: to a leaderless follower,
/// to a follower with a leader, to a candidate for another term or from an unavailable peer,
/// and a lower-term one to a leader.
#[test]
fn stray_election_responses_are_ignored() {
    let t = Instant::now();
    let mut f = node(1, 3, fixed(), 2);
    f.start(t);
    drain(&mut f);
    f.handle_message(at(t, 1), n(2), election_response(2));
    f.handle_message(at(t, 2), n(2), election_response(1));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.counters().messages_dropped, 2);

    let mut f = follower_of_2(t);
    f.handle_message(at(t, 110), n(3), election_response(1));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.status().leader, Some(n(2)));

    let mut c = node(1, 3, fixed(), 0);
    c.start(t);
    c.handle_timeout(at(t, 500));
    c.handle_message(at(t, 501), n(2), scouting_response(1, true));
    c.on_term_persisted(at(t, 502), Term(1));
    drain(&mut c);
    assert_eq!(c.status().state, Candidate);
    c.handle_message(at(t, 503), n(3), election_response(0));
    c.handle_message(at(t, 504), n(3), election_response(2));
    c.handle_peer_available(at(t, 505), n(2), false);
    c.handle_message(at(t, 506), n(2), election_response(1));
    assert_eq!(drain(&mut c), vec![], "none of these makes a quorum");
    assert_eq!(c.status().state, Candidate);
    assert_eq!(c.status().term, Term(1));

    let mut l = leader_of(3, t);
    l.handle_message(at(t, 600), n(3), election_response(0));
    assert_eq!(drain(&mut l), vec![]);
    assert_eq!(l.status().state, Leader);
}

/// A scouting node that receives a proposal of a higher term supports it, abandons its own
/// scouting (late `will_vote` answers no longer count, the scouting deadline is gone) and waits
/// for the candidate's heartbeat instead.
#[test]
fn scouting_abandoned_after_supporting_higher_proposal() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.start(t);
    drain(&mut e);
    e.handle_timeout(at(t, 500));
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(1))]);
    e.handle_message(at(t, 505), n(3), proposal(1));
    assert_eq!(
        drain(&mut e),
        vec![persist(1), changed(Follower, 1, None, Some(3), R::None, 2)]
    );
    e.handle_message(at(t, 506), n(2), scouting_response(1, true));
    assert_eq!(drain(&mut e), vec![], "the scouting is over");
    e.on_term_persisted(at(t, 507), Term(1));
    assert_eq!(drain(&mut e), vec![send(3, election_response(1))]);
    assert_eq!(
        e.poll_timeout(),
        Some(at(t, 1005)),
        "election_result_timeout after the proposal, not the scouting deadline (t+1000)"
    );
    assert_eq!(e.counters().elections_started, 0);
}

/// Mixed scouting answers below the quorum (4 nodes, quorum 3: one yes, one no, one yes for
/// another term) lead to no candidacy and no term change; the node scouts again.
#[test]
fn mixed_scouting_answers_no_candidacy() {
    let t = Instant::now();
    let mut e = node(1, 4, fixed(), 0);
    e.start(t);
    drain(&mut e);
    e.handle_timeout(at(t, 500));
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(1))]);
    e.handle_message(at(t, 501), n(2), scouting_response(1, true));
    e.handle_message(at(t, 502), n(3), scouting_response(1, false));
    e.handle_message(at(t, 503), n(4), scouting_response(2, true));
    assert_eq!(drain(&mut e), vec![]);
    assert_eq!(e.poll_timeout(), Some(at(t, 1000)));
    e.handle_timeout(at(t, 1000));
    assert_eq!(
        drain(&mut e),
        vec![],
        "scouting failed: no persist, no proposal"
    );
    e.handle_timeout(at(t, 1000));
    assert_eq!(drain(&mut e), vec![broadcast(scouting_request(1))]);
    assert_eq!(e.status().term, Term(0));
    assert_eq!(e.counters().elections_started, 0);
}

/// The leader leaves (its connection drops) and returns with the same term: the follower
/// drops it (LeaderUnavailable), starts scouting, and on the leader's next heartbeat follows
/// it again in the same term (no persist) with an unsolicited ElectionResponse; the abandoned
/// scouting's answers no longer count.
#[test]
fn leader_leaves_and_returns_with_same_term() {
    let t = Instant::now();
    let mut f = follower_of_2(t);
    f.handle_peer_available(at(t, 200), n(2), false);
    assert_eq!(
        drain(&mut f),
        vec![changed(Follower, 1, None, None, R::LeaderUnavailable, 3)]
    );
    f.handle_timeout(at(t, 200));
    assert_eq!(drain(&mut f), vec![broadcast(scouting_request(2))]);
    f.handle_peer_available(at(t, 250), n(2), true);
    assert_eq!(drain(&mut f), vec![], "no leader to greet");
    f.handle_message(at(t, 260), n(2), heartbeat(1));
    assert_eq!(
        drain(&mut f),
        vec![
            send(2, election_response(1)),
            changed(Follower, 1, Some(2), None, R::None, 4)
        ]
    );
    f.handle_message(at(t, 270), n(3), scouting_response(2, true));
    assert_eq!(drain(&mut f), vec![]);
    assert_eq!(f.status().term, Term(1));
}

/// A follower that supported a candidate which never sent a heartbeat gives it up when it
/// scouts, so that a successful scouting leads to its own candidacy (regression: the
/// simulator's seed 22 found a node raising its term forever without proposing).
#[test]
fn supported_candidate_silent_then_own_candidacy() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.start(t);
    drain(&mut e);
    e.handle_message(at(t, 10), n(2), proposal(1));
    assert_eq!(
        drain(&mut e),
        vec![persist(1), changed(Follower, 1, None, Some(2), R::None, 2)]
    );
    e.on_term_persisted(at(t, 11), Term(1));
    assert_eq!(drain(&mut e), vec![send(2, election_response(1))]);
    assert_eq!(e.poll_timeout(), Some(at(t, 510)));
    e.handle_timeout(at(t, 510));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(scouting_request(2)),
            changed(Follower, 1, None, None, R::None, 3)
        ]
    );
    e.handle_message(at(t, 511), n(3), scouting_response(2, true));
    assert_eq!(
        drain(&mut e),
        vec![persist(2), changed(Follower, 2, None, None, R::None, 4)]
    );
    e.on_term_persisted(at(t, 512), Term(2));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(proposal(2)),
            changed(Candidate, 2, None, None, R::None, 5)
        ]
    );
}

/// With the test-only switch off (`set_election_scouting(false)`), a node proposes directly
/// with term + 1 (persisting first, no ElectionScoutingRequest), and a leader or a follower
/// with a leader supports a higher proposal: the article's algorithm before ElectionScouting.
#[test]
fn without_scouting_node_proposes_directly_and_leader_yields() {
    let t = Instant::now();
    let mut e = node(1, 3, fixed(), 0);
    e.set_election_scouting(false);
    e.start(t);
    drain(&mut e);
    e.handle_timeout(at(t, 500));
    assert_eq!(
        drain(&mut e),
        vec![persist(1), changed(Follower, 1, None, None, R::Started, 2)]
    );
    e.on_term_persisted(at(t, 501), Term(1));
    assert_eq!(
        drain(&mut e),
        vec![
            broadcast(proposal(1)),
            changed(Candidate, 1, None, None, R::None, 3)
        ]
    );

    let mut l = leader_of(3, t); // term 1
    l.set_election_scouting(false);
    l.handle_message(at(t, 600), n(3), proposal(5));
    assert_eq!(
        drain(&mut l),
        vec![
            broadcast(cession(1)),
            persist(5),
            changed(Follower, 5, None, Some(3), R::LeaderPreempted, 5)
        ]
    );
    l.on_term_persisted(at(t, 601), Term(5));
    assert_eq!(drain(&mut l), vec![send(3, election_response(5))]);

    let mut f = follower_of_2(t);
    f.set_election_scouting(false);
    f.handle_message(at(t, 110), n(3), proposal(3));
    assert_eq!(
        drain(&mut f),
        vec![
            persist(3),
            changed(Follower, 3, None, Some(3), R::LeaderPreempted, 3)
        ]
    );
}
