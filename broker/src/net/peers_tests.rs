//! Two [`PeerHub`]s over real loopback TCP: what each reports as availability and as the data
//! link when one DATA connection is lost alone; a hub closing an accepted connection that
//! goes silent; a removed node told so by the refusal of its connection.

use std::sync::Mutex;
use std::time::Duration;

use bmq_proto::peer::{peer_message::Kind, Channel, LinkHeartbeat, PeerHello, PeerMessage};
use bmq_proto::NodeId;
use tokio::net::TcpListener;

use super::{PeerHub, PeerHubConfig, PeerInbound};

/// What a hub reported, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Report {
    Available(NodeId, bool),
    DataLink(NodeId, bool),
    /// A newer membership learned from a peer: its epoch, and whether it removed this node.
    Membership(u64, bool),
}

#[derive(Default)]
struct Reports(Mutex<Vec<Report>>);

impl Reports {
    fn all(&self) -> Vec<Report> {
        self.0.lock().unwrap().clone()
    }
}

impl PeerInbound for Reports {
    fn on_messages(&self, _from: NodeId, _channel: Channel, _messages: Vec<PeerMessage>) {}
    fn on_availability(&self, peer: NodeId, available: bool) {
        self.0
            .lock()
            .unwrap()
            .push(Report::Available(peer, available));
    }
    fn on_data_link(&self, peer: NodeId, up: bool) {
        self.0.lock().unwrap().push(Report::DataLink(peer, up));
    }
    fn on_membership(&self, _from: NodeId, membership: &bmq_metadata::ClusterMembership) {
        self.0.lock().unwrap().push(Report::Membership(
            membership.epoch,
            membership.removed.contains(&NodeId(2)),
        ));
    }
}

/// Member `id` of the test memberships (made-up ports: no hub dials them).
fn member(id: u32) -> bmq_metadata::Member {
    bmq_metadata::Member {
        id: NodeId(id),
        host: "127.0.0.1".into(),
        peer_port: 7000 + id as u16,
        client_port: 6000 + id as u16,
        admin_port: 8000 + id as u16,
        bmqp_port: None,
        role: bmq_metadata::MemberRole::Voter,
    }
}

/// Hub `self_id` listening on a port of its own (returned), its dialer to `peer` sent to a
/// port nobody listens on: only the test's connections reach it.
async fn lone_hub(self_id: u32, peer: u32) -> (std::sync::Arc<PeerHub>, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let unused = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let unused_addr = unused.local_addr().unwrap().to_string();
    drop(unused);
    let (hub, pending) = PeerHub::new(config(self_id, peer, unused_addr, 64));
    hub.start(pending, listener, std::sync::Arc::new(Reports::default()));
    (hub, addr)
}

fn config(self_id: u32, peer: u32, peer_addr: String, queue_capacity: usize) -> PeerHubConfig {
    PeerHubConfig {
        self_id: NodeId(self_id),
        cluster_name: "peers-test".into(),
        peers: vec![(NodeId(peer), peer_addr)],
        heartbeat_period: Duration::from_millis(20),
        heartbeat_timeout: Duration::from_secs(2),
        reconnect_backoff_min: Duration::from_millis(10),
        reconnect_backoff_max: Duration::from_millis(100),
        frame_size_max: 64 * 1024,
        outbound_queue_capacity: queue_capacity,
        tls: None,
    }
}

/// Waits (up to 10 s) until `reports` from index `from` on match `want` in order (other
/// reports may come between); fails with everything reported.
async fn wait_for(reports: &Reports, from: usize, want: &[Report]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let all = reports.all();
        let mut wanted = want.iter().peekable();
        for r in &all[from.min(all.len())..] {
            if wanted.peek() == Some(&r) {
                wanted.next();
            }
        }
        if wanted.peek().is_none() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "wanted {want:?} after report {from}, got {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two hubs, nodes 1 and 2, each link queue holding `queue_capacity` items, started and
/// reporting both the peer available and the data link up.
async fn two_hubs(
    queue_capacity: usize,
) -> (
    std::sync::Arc<PeerHub>,
    std::sync::Arc<Reports>,
    std::sync::Arc<PeerHub>,
    std::sync::Arc<Reports>,
) {
    let listener_1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let listener_2 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr_1 = listener_1.local_addr().unwrap().to_string();
    let addr_2 = listener_2.local_addr().unwrap().to_string();
    let (hub_1, pending_1) = PeerHub::new(config(1, 2, addr_2, queue_capacity));
    let (hub_2, pending_2) = PeerHub::new(config(2, 1, addr_1, queue_capacity));
    let reports_1 = std::sync::Arc::new(Reports::default());
    let reports_2 = std::sync::Arc::new(Reports::default());
    hub_1.start(pending_1, listener_1, reports_1.clone());
    hub_2.start(pending_2, listener_2, reports_2.clone());
    let (n1, n2) = (NodeId(1), NodeId(2));
    wait_for(
        &reports_1,
        0,
        &[Report::Available(n2, true), Report::DataLink(n2, true)],
    )
    .await;
    wait_for(
        &reports_2,
        0,
        &[Report::Available(n1, true), Report::DataLink(n1, true)],
    )
    .await;
    (hub_1, reports_1, hub_2, reports_2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_connection_lost_alone_is_a_data_link_loss_then_return_on_both_sides() {
    // Node 1's DATA connection to node 2 fails (a message over the frame size limit makes its
    // writer drop the connection) while both CONTROL connections stay up: each side reports
    // its data link lost and then back, and neither reports the peer unavailable.
    let (hub_1, reports_1, hub_2, reports_2) = two_hubs(64).await;
    let (n1, n2) = (NodeId(1), NodeId(2));
    let (mark_1, mark_2) = (reports_1.all().len(), reports_2.all().len());

    let oversized = PeerMessage {
        kind: Some(Kind::Hello(PeerHello {
            cluster_name: "x".repeat(100 * 1024),
            ..Default::default()
        })),
    };
    assert!(hub_1.send(n2, Channel::Data, oversized));
    wait_for(
        &reports_1,
        mark_1,
        &[Report::DataLink(n2, false), Report::DataLink(n2, true)],
    )
    .await;
    wait_for(
        &reports_2,
        mark_2,
        &[Report::DataLink(n1, false), Report::DataLink(n1, true)],
    )
    .await;
    assert!(hub_1.is_available(n2) && hub_2.is_available(n1));
    for (reports, mark) in [(&reports_1, mark_1), (&reports_2, mark_2)] {
        let after = &reports.all()[mark..];
        assert!(
            !after.iter().any(|r| matches!(r, Report::Available(..))),
            "availability changed with the DATA connection alone: {after:?}"
        );
    }
    hub_1.stop();
    hub_2.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_message_dropped_on_a_full_queue_is_a_data_link_loss_then_return() {
    // Node 1 queues more DATA messages for node 2 than its link's queue holds, faster than the
    // link writes them: some are dropped while the connection stays up, so node 1 reports its
    // data link lost, then back once the queue has drained. Node 2 saw every frame that
    // arrived and no connection close: it reports nothing, and availability never changes.
    let (hub_1, reports_1, hub_2, reports_2) = two_hubs(8).await;
    let (n1, n2) = (NodeId(1), NodeId(2));
    let (mark_1, mark_2) = (reports_1.all().len(), reports_2.all().len());
    let small = PeerMessage {
        kind: Some(Kind::LinkHeartbeat(LinkHeartbeat::default())),
    };
    let dropped = (0..1000)
        .filter(|_| !hub_1.send(n2, Channel::Data, small.clone()))
        .count();
    assert!(
        dropped > 0,
        "no message dropped: the test did not fill the queue"
    );
    wait_for(
        &reports_1,
        mark_1,
        &[Report::DataLink(n2, false), Report::DataLink(n2, true)],
    )
    .await;
    assert!(hub_1.is_available(n2) && hub_2.is_available(n1));
    let after_1 = &reports_1.all()[mark_1..];
    assert!(
        !after_1.iter().any(|r| matches!(r, Report::Available(..))),
        "availability changed with a full queue: {after_1:?}"
    );
    let after_2 = &reports_2.all()[mark_2..];
    assert!(after_2.is_empty(), "node 2 reported {after_2:?}");
    hub_1.stop();
    hub_2.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_connection_silent_for_the_heartbeat_timeout_is_closed() {
    // A peer's DATA connection that says hello and then nothing — as one whose reset never
    // reached us after its node dialed a new one — is closed by the listening hub once the
    // heartbeat timeout (2 s here) passes without a byte, instead of staying open for ever.
    // One that keeps sending heartbeats stays open.
    use futures::{SinkExt, StreamExt};
    let (hub, addr) = lone_hub(2, 1).await;

    let hello = PeerMessage {
        kind: Some(Kind::Hello(PeerHello {
            cluster_name: "peers-test".into(),
            node_id: 1,
            channel: Channel::Data as i32,
            protocol_version: bmq_proto::PROTOCOL_VERSION,
            membership: None,
        })),
    };
    let connect = || async {
        let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut framed =
            tokio_util::codec::Framed::new(stream, bmq_proto::FrameCodec::<PeerMessage>::new(1024));
        framed.send(hello.clone()).await.unwrap();
        framed
    };
    let mut silent = connect().await;
    let mut beating = connect().await;
    let started = tokio::time::Instant::now();
    let closed_after = loop {
        tokio::select! {
            read = silent.next() => {
                assert!(read.is_none() || read.is_some_and(|r| r.is_err()), "the hub wrote to a peer connection");
                break started.elapsed();
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                assert!(started.elapsed() < Duration::from_secs(10), "the silent connection is still open after 10 s");
                let heartbeat = PeerMessage { kind: Some(Kind::LinkHeartbeat(LinkHeartbeat::default())) };
                beating.send(heartbeat).await.unwrap();
            }
        }
    };
    assert!(
        closed_after >= Duration::from_millis(1900),
        "closed after {closed_after:?}, before the heartbeat timeout"
    );
    // The connection that kept beating is still open: nothing to read, no end.
    let still_open = tokio::time::timeout(Duration::from_millis(300), beating.next()).await;
    assert!(
        still_open.is_err(),
        "the beating connection ended: {still_open:?}"
    );
    hub.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_node_that_missed_its_removal_learns_it_from_the_refusal() {
    // Scenario: node 1 follows a membership that removed node 2, which never got that commit.
    // Node 2's next connection to node 1 is refused, and the refusal carries the membership:
    // node 2 reports it (its node exits on it), instead of dialing a cluster that no longer
    // knows it for ever.
    use bmq_metadata::ClusterMembership;
    let (hub_1, _reports_1, _hub_2, reports_2) = two_hubs(64).await;
    let mut membership = ClusterMembership::seed([member(1), member(2)]).unwrap();
    membership.epoch = 2;
    membership.members.remove(&NodeId(2));
    membership.removed.insert(NodeId(2));
    let from = reports_2.all().len();
    hub_1.follow_membership(&membership);
    hub_1.remove_peer(NodeId(2));
    wait_for(&reports_2, from, &[Report::Membership(2, true)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_learns_the_membership_from_the_refusal_of_its_hello() {
    // Scenario: node 1 follows the membership {1, 2}. Node 3, not a member, asks it through
    // `join`: it gets that membership from the hello that answers its refused one. A node of
    // another cluster is told the cluster's name; a member's hello is taken as a link (no
    // answer).
    use crate::net::join::{ask_membership, JoinAnswer};
    use bmq_metadata::ClusterMembership;
    let (hub, addr) = lone_hub(1, 2).await;
    let membership = ClusterMembership::seed([member(1), member(2)]).unwrap();
    hub.follow_membership(&membership);

    match ask_membership(&addr, NodeId(3), "peers-test", None, 64 * 1024).await {
        Ok(JoinAnswer::Membership {
            from,
            membership: m,
        }) => {
            assert_eq!(from, NodeId(1));
            assert_eq!(m, membership);
        }
        other => panic!("node 3 got {other:?}"),
    }
    let foreign = ask_membership(&addr, NodeId(3), "another", None, 64 * 1024).await;
    assert!(
        foreign
            .as_ref()
            .is_err_and(|e| e.contains("belongs to cluster \"peers-test\"")),
        "{foreign:?}"
    );
    let member_2 = ask_membership(&addr, NodeId(2), "peers-test", None, 64 * 1024).await;
    assert!(
        matches!(member_2, Ok(JoinAnswer::AlreadyMember)),
        "{member_2:?}"
    );
    hub.stop();
}
