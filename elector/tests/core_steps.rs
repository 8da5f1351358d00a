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
    m(Kind::ScoutingRequest(ElectionScoutingRequest { term }))
}
fn scouting_response(term: u64, will_vote: bool) -> ElectorMessage {
    m(Kind::ScoutingResponse(ElectionScoutingResponse {
        term,
        will_vote,
    }))
}
fn proposal(term: u64) -> ElectorMessage {
    m(Kind::Proposal(ElectionProposal { term }))
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
                0 => Kind::ScoutingRequest(ElectionScoutingRequest { term }),
                1 => Kind::ScoutingResponse(ElectionScoutingResponse {
                    term,
                    will_vote: rng.gen(),
                }),
                2 => Kind::Proposal(ElectionProposal { term }),
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
