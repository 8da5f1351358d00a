//! A small in-test network of elector cores (after raft-rs's `harness/src/network.rs` and
//! quinn's virtual-time tests): a message queue with random latency, durable-term writes that
//! complete after a delay, a virtual clock that jumps to the next event or deadline, and a
//! `cut` set whose nodes neither send nor receive. Invariants checked on every state change:
//! at most one leader per term (Raft §5.2 "Election Safety"), terms never decrease.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bmq_elector::{Elector, ElectorConfig, ElectorOutput, ElectorState};
use bmq_proto::peer::ElectorMessage;
use bmq_proto::{NodeId, Term};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

enum Event {
    Deliver {
        from: NodeId,
        to: NodeId,
        message: ElectorMessage,
    },
    Persisted {
        node: NodeId,
        term: Term,
    },
}

struct Net {
    seed: u64,
    nodes: BTreeMap<NodeId, Elector>,
    base: Instant,
    now: Instant,
    /// Events by (time, insertion sequence): deterministic order.
    events: BTreeMap<(Instant, u64), Event>,
    seq: u64,
    cut: BTreeSet<NodeId>,
    rng: ChaCha8Rng,
    leaders_by_term: BTreeMap<Term, NodeId>,
    terms: BTreeMap<NodeId, Term>,
}

impl Net {
    fn new(size: u32, seed: u64) -> Net {
        let ids: Vec<NodeId> = (1..=size).map(NodeId).collect();
        let base = Instant::now();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let nodes = ids
            .iter()
            .map(|id| {
                let peers: Vec<NodeId> = ids.iter().copied().filter(|p| p != id).collect();
                (
                    *id,
                    Elector::new(*id, &peers, ElectorConfig::default(), Term(0), rng.gen()),
                )
            })
            .collect();
        let mut net = Net {
            seed,
            nodes,
            base,
            now: base,
            events: BTreeMap::new(),
            seq: 0,
            cut: BTreeSet::new(),
            rng,
            leaders_by_term: BTreeMap::new(),
            terms: ids.iter().map(|id| (*id, Term(0))).collect(),
        };
        for id in ids {
            net.nodes.get_mut(&id).unwrap().start(base);
        }
        net.flush();
        net
    }

    fn schedule(&mut self, delay_ms: u64, event: Event) {
        self.seq += 1;
        self.events.insert(
            (self.now + Duration::from_millis(delay_ms), self.seq),
            event,
        );
    }

    fn send(&mut self, from: NodeId, to: NodeId, message: ElectorMessage) {
        if self.cut.contains(&from) || self.cut.contains(&to) {
            return;
        }
        let latency = self.rng.gen_range(1..=5);
        self.schedule(latency, Event::Deliver { from, to, message });
    }

    /// Executes every pending output of every node.
    fn flush(&mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            while let Some(output) = self.nodes.get_mut(&id).unwrap().poll_output() {
                match output {
                    ElectorOutput::Send { to, message } => self.send(id, to, message),
                    ElectorOutput::Broadcast { message } => {
                        let peers: Vec<NodeId> =
                            self.nodes.keys().copied().filter(|p| *p != id).collect();
                        for to in peers {
                            self.send(id, to, message);
                        }
                    }
                    ElectorOutput::PersistTerm { term } => {
                        let fsync = self.rng.gen_range(0..=3);
                        self.schedule(fsync, Event::Persisted { node: id, term });
                    }
                    ElectorOutput::StateChanged { status } => {
                        let seed = self.seed;
                        let previous = self.terms.insert(id, status.term).unwrap();
                        assert!(
                            status.term >= previous,
                            "seed {seed}: term of {id} went back"
                        );
                        if status.state == ElectorState::Leader {
                            let first = *self.leaders_by_term.entry(status.term).or_insert(id);
                            assert_eq!(
                                first, id,
                                "seed {seed}: two leaders in term {}",
                                status.term
                            );
                        }
                    }
                }
            }
        }
    }

    /// Processes the next event or deadline; false when nothing is left.
    fn step(&mut self) -> bool {
        let next_event = self.events.keys().next().map(|(at, _)| *at);
        let next_timer = self.nodes.values().filter_map(|n| n.poll_timeout()).min();
        match (next_event, next_timer) {
            (Some(e), t) if t.is_none_or(|t| e <= t) => {
                let (key, event) = self.events.pop_first().unwrap();
                self.now = self.now.max(key.0);
                match event {
                    Event::Deliver { from, to, message } => {
                        if !self.cut.contains(&from) && !self.cut.contains(&to) {
                            self.nodes
                                .get_mut(&to)
                                .unwrap()
                                .handle_message(self.now, from, message);
                        }
                    }
                    Event::Persisted { node, term } => self
                        .nodes
                        .get_mut(&node)
                        .unwrap()
                        .on_term_persisted(self.now, term),
                }
            }
            (_, Some(t)) => {
                self.now = self.now.max(t);
                let now = self.now;
                for node in self.nodes.values_mut() {
                    if node.poll_timeout().is_some_and(|d| d <= now) {
                        node.handle_timeout(now);
                    }
                }
            }
            (_, None) => return false,
        }
        self.flush();
        true
    }

    /// Steps until `done` holds or `limit` of virtual time passed; returns `done`'s value.
    fn run_until<T>(
        &mut self,
        limit: Duration,
        mut done: impl FnMut(&Net) -> Option<T>,
    ) -> Option<T> {
        let end = self.now + limit;
        while self.now < end {
            if let Some(v) = done(self) {
                return Some(v);
            }
            if !self.step() {
                break;
            }
        }
        done(self)
    }

    /// Steps for `duration` of virtual time.
    fn run_for(&mut self, duration: Duration) {
        let end = self.now + duration;
        while self.now < end && self.step() {}
    }

    /// The leader and term, if exactly one node outside the cut leads and every other node
    /// outside the cut follows it in its term.
    fn stable_leader(&self) -> Option<(NodeId, Term)> {
        let live: Vec<_> = self
            .nodes
            .iter()
            .filter(|(id, _)| !self.cut.contains(id))
            .collect();
        let leaders: Vec<_> = live
            .iter()
            .filter(|(_, n)| n.status().state == ElectorState::Leader)
            .collect();
        let [(leader, l)] = leaders.as_slice() else {
            return None;
        };
        let term = l.status().term;
        live.iter()
            .filter(|(id, _)| id != leader)
            .all(|(_, n)| {
                let s = n.status();
                s.state == ElectorState::Follower && s.leader == Some(**leader) && s.term == term
            })
            .then_some((**leader, term))
    }

    fn set_link(&mut self, a: NodeId, available: bool) {
        let now = self.now;
        let others: Vec<NodeId> = self.nodes.keys().copied().filter(|p| *p != a).collect();
        for b in others {
            self.nodes
                .get_mut(&a)
                .unwrap()
                .handle_peer_available(now, b, available);
            self.nodes
                .get_mut(&b)
                .unwrap()
                .handle_peer_available(now, a, available);
        }
        self.flush();
    }

    fn elapsed(&self) -> Duration {
        self.now - self.base
    }
}

/// Cluster scenario for one size and seed: a leader emerges and stays; once it is cut off a new
/// leader with a higher term emerges; after healing, the old leader follows the new one and
/// the term does not move (sticky leader). Odd seeds also drop the connections (leader loss by
/// LeaderUnavailable/QuorumNotAchieved), even seeds cut silently (LeaderNoHeartbeat).
fn failover_scenario(size: u32, seed: u64) {
    let mut net = Net::new(size, seed);
    let limit = Duration::from_secs(10);
    let (first, first_term) = net
        .run_until(limit, Net::stable_leader)
        .unwrap_or_else(|| panic!("seed {seed}, {size} nodes: no leader after {limit:?}"));
    // Without faults the leadership is stable: no new term, no new leader.
    net.run_for(Duration::from_secs(2));
    assert_eq!(
        net.stable_leader(),
        Some((first, first_term)),
        "seed {seed}: leadership moved"
    );

    net.cut.insert(first);
    if seed % 2 == 1 {
        net.set_link(first, false);
    }
    let cut_at = net.elapsed();
    let (second, second_term) = net
        .run_until(limit, |n| n.stable_leader().filter(|(id, _)| *id != first))
        .unwrap_or_else(|| panic!("seed {seed}, {size} nodes: no new leader after the cut"));
    assert!(second_term > first_term, "seed {seed}");
    let failover = net.elapsed() - cut_at;
    // Detection (<= 850 ms) + random wait + scouting + election, with a few retries at most.
    assert!(
        failover < Duration::from_secs(5),
        "seed {seed}: failover took {failover:?}"
    );

    net.cut.remove(&first);
    if seed % 2 == 1 {
        net.set_link(first, true);
    }
    let healed = net
        .run_until(limit, |n| {
            n.stable_leader()
                .filter(|_| n.nodes[&first].status().leader == Some(second))
        })
        .unwrap_or_else(|| panic!("seed {seed}, {size} nodes: old leader did not rejoin"));
    assert_eq!(healed, (second, second_term), "seed {seed}: sticky leader");
}

/// Three nodes, several seeds: one leader, failover on cut, sticky after heal.
#[test]
fn three_nodes_elect_and_fail_over() {
    for seed in 0..8 {
        failover_scenario(3, seed);
    }
}

/// Five nodes, several seeds: one leader, failover on cut, sticky after heal.
#[test]
fn five_nodes_elect_and_fail_over() {
    for seed in 0..8 {
        failover_scenario(5, seed);
    }
}

/// Graceful cession in a 3-node cluster: another node becomes leader in a higher term, and
/// the ceding node follows it.
#[test]
fn cession_hands_leadership_over() {
    for seed in 0..4 {
        let mut net = Net::new(3, seed);
        let (first, term) = net
            .run_until(Duration::from_secs(10), Net::stable_leader)
            .unwrap();
        let now = net.now;
        net.nodes.get_mut(&first).unwrap().cede_leadership(now);
        net.flush();
        let (second, second_term) = net
            .run_until(Duration::from_secs(5), |n| {
                n.stable_leader().filter(|(id, _)| *id != first)
            })
            .unwrap_or_else(|| panic!("seed {seed}: nobody took over"));
        assert!(second_term > term && second != first, "seed {seed}");
    }
}
