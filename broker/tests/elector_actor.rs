//! Tests of the actix shell: real timers, a real term file, outbound messages routed between
//! actors in-process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use bmq_broker::actors::elector::{
    CedeLeadership, ElectorActor, ElectorInbound, ElectorOutbound, GetElectorStatus,
    LeadershipChanged, SetQuorum, SubscribeLeadership,
};
use bmq_elector::{Elector, ElectorConfig, ElectorState, TermStore};
use bmq_proto::{NodeId, Term};

/// Routes one node's outbound elector messages to the other nodes' actors.
struct Link {
    from: NodeId,
    table: Arc<Mutex<HashMap<NodeId, Addr<ElectorActor>>>>,
}

impl Actor for Link {
    type Context = Context<Self>;
}

impl Handler<ElectorOutbound> for Link {
    type Result = ();
    fn handle(&mut self, msg: ElectorOutbound, _ctx: &mut Self::Context) {
        let table = self.table.lock().unwrap();
        for (id, addr) in table.iter() {
            if *id != self.from && msg.to.is_none_or(|to| to == *id) {
                addr.do_send(ElectorInbound {
                    from: self.from,
                    message: msg.message,
                });
            }
        }
    }
}

/// Records every LeadershipChanged it receives.
struct Recorder(Arc<Mutex<Vec<LeadershipChanged>>>);

impl Actor for Recorder {
    type Context = Context<Self>;
}

impl Handler<LeadershipChanged> for Recorder {
    type Result = ();
    fn handle(&mut self, msg: LeadershipChanged, _ctx: &mut Self::Context) {
        self.0.lock().unwrap().push(msg);
    }
}

fn fast_config() -> ElectorConfig {
    ElectorConfig {
        initial_wait: Duration::from_millis(50),
        random_wait_max: Duration::from_millis(30),
        scouting_result_timeout: Duration::from_millis(100),
        election_result_timeout: Duration::from_millis(100),
        heartbeat_period: Duration::from_millis(20),
        heartbeat_check_period: Duration::from_millis(10),
        heartbeat_miss_count: 5,
        quorum: 0,
    }
}

async fn wait_for<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A single-node actor elects itself, persists the term to its file, notifies subscribers,
/// and steps down when the quorum is raised above the cluster size.
#[actix_rt::test]
async fn single_node_actor_becomes_leader_and_persists_term() {
    let dir = tempfile::tempdir().unwrap();
    let (store, term) = TermStore::open(dir.path()).unwrap();
    let core = Elector::new(NodeId(1), &[], fast_config(), term, 1);
    let table = Arc::new(Mutex::new(HashMap::new()));
    let link = Link {
        from: NodeId(1),
        table: table.clone(),
    }
    .start();
    let addr = ElectorActor::new(core, store, link.recipient()).start();

    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder(seen.clone()).start();
    addr.send(SubscribeLeadership {
        subscriber: recorder.recipient(),
    })
    .await
    .unwrap();

    let snapshot = wait_for("leadership", async || {
        let s = addr.send(GetElectorStatus).await.unwrap();
        s.status.is_leader().then_some(s)
    })
    .await;
    assert_eq!(snapshot.status.term, Term(1));
    assert_eq!(snapshot.quorum, 1);
    assert_eq!(
        TermStore::open(dir.path()).unwrap().1,
        Term(1),
        "term on disk"
    );
    let ages: Vec<u64> = seen.lock().unwrap().iter().map(|c| c.status.age).collect();
    assert!(ages.windows(2).all(|w| w[0] < w[1]), "ages grow: {ages:?}");
    assert_eq!(
        seen.lock().unwrap().last().unwrap().status.state,
        ElectorState::Leader
    );

    addr.send(SetQuorum { quorum: 2 }).await.unwrap();
    let snapshot = addr.send(GetElectorStatus).await.unwrap();
    assert_eq!(snapshot.status.state, ElectorState::Follower);
    assert_eq!(snapshot.quorum, 2);
}

/// Three actors wired through in-process links elect one leader; after it cedes, another
/// node leads in a higher term.
#[actix_rt::test]
async fn three_actors_elect_one_leader_and_hand_over() {
    let ids = [NodeId(1), NodeId(2), NodeId(3)];
    let table = Arc::new(Mutex::new(HashMap::new()));
    let mut dirs = Vec::new();
    let mut addrs = Vec::new();
    for id in ids {
        let dir = tempfile::tempdir().unwrap();
        let (store, term) = TermStore::open(dir.path()).unwrap();
        let peers: Vec<NodeId> = ids.iter().copied().filter(|p| *p != id).collect();
        let core = Elector::new(id, &peers, fast_config(), term, u64::from(id.0));
        let link = Link {
            from: id,
            table: table.clone(),
        }
        .start();
        let addr = ElectorActor::new(core, store, link.recipient()).start();
        table.lock().unwrap().insert(id, addr.clone());
        addrs.push(addr);
        dirs.push(dir);
    }
    let stable = async |addrs: &[Addr<ElectorActor>]| {
        let mut statuses = Vec::new();
        for addr in addrs {
            statuses.push(addr.send(GetElectorStatus).await.unwrap().status);
        }
        let leaders: Vec<_> = statuses.iter().filter(|s| s.is_leader()).collect();
        let [leader] = leaders.as_slice() else {
            return None;
        };
        let leader = (leader.leader.unwrap(), leader.term);
        statuses
            .iter()
            .all(|s| s.leader == Some(leader.0) && s.term == leader.1)
            .then_some(leader)
    };
    let (first, term) = wait_for("a leader", async || stable(&addrs).await).await;
    addrs[first.0 as usize - 1]
        .send(CedeLeadership)
        .await
        .unwrap();
    let (second, second_term) = wait_for("a new leader", async || {
        stable(&addrs).await.filter(|(id, _)| *id != first)
    })
    .await;
    assert!(second_term > term);
    assert_ne!(second, first);
}
