//! Live membership with real processes (DESIGN.md §5a): a running node joins a running
//! cluster as a learner, is promoted to voter by the leader, and counts in the elector's and
//! the metadata ledger's quorums; members leave and are removed (the leader too), and a
//! removed node exits and never comes back. Every ACKed message is delivered throughout.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bmq_proto::admin_doc::NodeStatusDoc;
use bmq_tests::history::{check, Event, LeaderPoller, Recorder};
use bmq_tests::{round_trip, Cluster};

const QUEUE: &str = "bmq://bmq.test/members";

/// `total` nodes configured; the files of the first `initial` list only those (the cluster as
/// first started), the later nodes' files list every node (a new node knows the members it
/// contacts). Nodes 1..=initial are started.
fn growing_cluster(initial: u32, total: u32) -> anyhow::Result<Cluster> {
    let mut cluster = Cluster::configure(total as usize, |_| {})?;
    for node in cluster.nodes.iter_mut().take(initial as usize) {
        node.config.members.retain(|m| m.id <= initial);
        std::fs::write(&node.config_path, node.config.to_toml_string())?;
    }
    for id in 1..=initial {
        cluster.start_node(id)?;
    }
    Ok(cluster)
}

/// Waits for a leader and for the membership it seeded (epoch 1) on every running node.
async fn seeded(cluster: &Cluster) -> anyhow::Result<()> {
    cluster.wait_for_leader(Duration::from_secs(20)).await?;
    cluster
        .wait_for_all(Duration::from_secs(10), "the seeded membership", |s| {
            s.membership.as_ref().is_some_and(|m| m.epoch == 1)
        })
        .await?;
    Ok(())
}

/// `POST /admin/members` for node `id` (its own configured addresses), sent to `via`.
async fn add_member(cluster: &Cluster, via: u32, id: u32) -> anyhow::Result<String> {
    let path = bmq_tests::add_member_path(cluster.node(id).config.self_member());
    bmqctl::http::request(&cluster.node(via).admin_addr(), "POST", &path, None).await
}

/// Waits until node `id`'s admin port answers (a joiner must, before it is added).
async fn wait_until_up(cluster: &Cluster, id: u32) -> anyhow::Result<()> {
    let admin = cluster.node(id).admin_addr();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while bmqctl::http::get(&admin, "/healthz").await.is_err() {
        ensure!(
            std::time::Instant::now() < deadline,
            "node {id} did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// `DELETE /admin/members/{id}`, sent to `via`.
async fn remove_member(cluster: &Cluster, via: u32, id: u32) -> anyhow::Result<String> {
    bmqctl::http::request(
        &cluster.node(via).admin_addr(),
        "DELETE",
        &format!("/admin/members/{id}?timeout_ms=30000"),
        None,
    )
    .await
}

fn voters(s: &NodeStatusDoc) -> BTreeSet<u32> {
    s.membership
        .iter()
        .flat_map(|m| &m.members)
        .filter(|m| m.role == "voter" || m.role == "leaving")
        .map(|m| m.node_id)
        .collect()
}

fn ids(v: &[u32]) -> BTreeSet<u32> {
    v.iter().copied().collect()
}

/// Polls every configured node's `/status` (about every 100 ms) for the whole test, so that
/// [`leadership_checked`] can tell whether two nodes led one term.
fn poll_leadership(cluster: &Cluster) -> (LeaderPoller, Recorder) {
    let recorder = Recorder::new();
    let nodes = cluster
        .nodes
        .iter()
        .map(|n| (n.id, n.admin_addr()))
        .collect();
    (LeaderPoller::start(nodes, recorder.clone()), recorder)
}

/// Stops the poller, and checks what it saw: one leader per term, and the highest term at
/// most `2 * changes` above the lowest (a membership change costs at most one election, and
/// an election at most two terms).
async fn leadership_checked(
    poller: LeaderPoller,
    recorder: &Recorder,
    changes: u64,
) -> anyhow::Result<()> {
    poller.stop().await;
    let history = recorder.snapshot();
    let violations = check(&history);
    ensure!(violations.is_empty(), "leadership: {violations:?}");
    let terms: Vec<u64> = history
        .iter()
        .filter_map(|e| match &e.event {
            Event::Observation { term, .. } if *term > 0 => Some(*term),
            _ => None,
        })
        .collect();
    let (low, high) = (terms.iter().min(), terms.iter().max());
    let (Some(low), Some(high)) = (low, high) else {
        bail!("no leadership observed");
    };
    ensure!(
        high - low <= 2 * changes,
        "terms rose from {low} to {high} over {changes} membership changes"
    );
    Ok(())
}

/// A running node 4 joins a running 3-node cluster: added as a learner, promoted by the leader
/// once caught up, then counted by every node (elector quorum 3 of 4). The members' files
/// still list three nodes: each says so in `/status`. Messages flow through the new node, and
/// after a SIGKILL of the leader the three survivors (a majority of four) elect a new one; the
/// killed node is removed while down, and exits when restarted. Bad requests change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_node_joins_is_promoted_and_counts_in_every_quorum() {
    let mut cluster = growing_cluster(3, 4).expect("start cluster");
    let result = async {
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let seeded = cluster
            .wait_for_all(Duration::from_secs(10), "the seeded membership", |s| {
                s.membership.as_ref().is_some_and(|m| m.epoch == 1)
                    && voters(s) == ids(&[1, 2, 3])
                    && s.membership.as_ref().unwrap().file_disagrees.is_none()
            })
            .await?;
        ensure!(seeded.len() == 3);

        // Bad input: an existing id, an address in use, an unknown id to remove.
        let existing = add_member(&cluster, leader, 2).await;
        ensure!(
            format!("{existing:?}").contains("already a member"),
            "adding a member twice: {existing:?}"
        );
        let unknown = remove_member(&cluster, leader, 9).await;
        ensure!(
            format!("{unknown:?}").contains("not a member"),
            "removing an unknown id: {unknown:?}"
        );

        // A joiner that is not running, runs under another cluster name, or is another node
        // than the id it is added with: refused with the reason before anything is proposed.
        let absent = add_member(&cluster, leader, 4).await;
        ensure!(
            format!("{absent:?}").contains("does not answer"),
            "adding a node that is not running: {absent:?}"
        );
        let good = cluster.nodes[3].config.clone();
        cluster.nodes[3].config.cluster_name = "another-cluster".into();
        std::fs::write(
            &cluster.nodes[3].config_path,
            cluster.nodes[3].config.to_toml_string(),
        )?;
        cluster.start_node(4)?;
        let foreign = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let answer = add_member(&cluster, leader, 4).await;
                if !format!("{answer:?}").contains("does not answer") {
                    return answer;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await?;
        ensure!(
            format!("{foreign:?}").contains("belongs to cluster"),
            "adding a node of another cluster: {foreign:?}"
        );
        cluster.kill_node(4)?;
        cluster.nodes[3].config = good;
        std::fs::write(
            &cluster.nodes[3].config_path,
            cluster.nodes[3].config.to_toml_string(),
        )?;
        cluster.start_node(4)?;
        let m4 = cluster.node(4).config.self_member().clone();
        let leader_admin = cluster.node(leader).admin_addr();
        let wrong_path = format!(
            "/admin/members?id=5&host={}&client_port={}&peer_port={}&admin_port={}",
            m4.host, m4.client_port, m4.peer_port, m4.admin_port
        );
        let wrong_id = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let answer = bmqctl::http::request(&leader_admin, "POST", &wrong_path, None).await;
                if !format!("{answer:?}").contains("does not answer") {
                    return answer;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await?;
        ensure!(
            format!("{wrong_id:?}").contains("is node 4, not node 5"),
            "adding node 4 as node 5: {wrong_id:?}"
        );
        cluster
            .wait_for_all(Duration::from_secs(5), "nothing changed", |s| {
                s.node_id == 4 || s.membership.as_ref().is_some_and(|m| m.epoch == 1)
            })
            .await?;
        // Through a follower: it redirects to the leader.
        let via = if leader == 1 { 2 } else { 1 };
        let answer = add_member(&cluster, via, 4).await?;
        ensure!(
            answer.contains("promoted to voter"),
            "add answered {answer:?}"
        );
        let statuses = cluster
            .wait_for_all(Duration::from_secs(20), "four voters everywhere", |s| {
                voters(s) == ids(&[1, 2, 3, 4]) && s.elector.quorum == 3
            })
            .await?;
        for s in &statuses {
            let m = s.membership.as_ref().unwrap();
            ensure!(
                m.epoch == 3,
                "node {}: epoch {} (seed, learner, voter)",
                s.node_id,
                m.epoch
            );
            let disagrees = m.file_disagrees.is_some();
            ensure!(
                disagrees == (s.node_id != 4),
                "node {}: file disagreement {:?}",
                s.node_id,
                m.file_disagrees
            );
        }
        round_trip(
            QUEUE,
            vec![cluster.node(4).client_addr()],
            vec![cluster.node(via).client_addr()],
            1,
            500,
        )
        .await
        .context("round trip through the new member")?;

        cluster
            .wait_for_all(
                Duration::from_secs(20),
                "partitions re-leased to four",
                |s| {
                    s.partitions
                        .iter()
                        .all(|p| p.replicas == [1, 2, 3, 4] && p.status == "active")
                },
            )
            .await?;
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        cluster.kill_node(leader)?;
        let (new_leader, new_term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        ensure!(new_leader != leader && new_term > term);
        let survivor = (1..=4).find(|n| *n != leader && *n != new_leader).unwrap();
        round_trip(
            QUEUE,
            vec![cluster.node(new_leader).client_addr()],
            vec![cluster.node(survivor).client_addr()],
            2,
            500,
        )
        .await
        .context("round trip after the leader's SIGKILL")?;
        // Every partition's lease is replicated by the four voters, the member added at run
        // time included (a partition whose primary died was given to a survivor under them).
        cluster
            .wait_for_all(
                Duration::from_secs(20),
                "partitions replicated by four",
                |s| {
                    s.partitions
                        .iter()
                        .all(|p| p.replicas == [1, 2, 3, 4] && p.status == "active")
                },
            )
            .await?;

        // The killed node is removed while it is down; restarted with its data (which does
        // not know), it learns from its peers' hellos that it was removed, and exits.
        let answer = remove_member(&cluster, new_leader, leader).await?;
        ensure!(answer.contains("removed"), "remove answered {answer:?}");
        cluster
            .wait_for_all(Duration::from_secs(20), "three voters", |s| {
                voters(s).len() == 3 && !voters(s).contains(&leader)
            })
            .await?;
        cluster.start_node(leader)?;
        let exit = cluster
            .wait_for_exit(leader, Duration::from_secs(20))?
            .context("the node removed while it was down kept running")?;
        ensure!(
            !exit.success(),
            "a removed node exits with an error: {exit}"
        );
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// Partitions follow the voters: a 3-node cluster grown to 5 re-leases every partition to the
/// five voters, so strong messages ACKed then are held by a majority of five. SIGKILL of nodes
/// 1 and 2 (two of the three seeded nodes) leaves 3, 4 and 5, two of which joined at run time:
/// they elect a leader, heal every partition from themselves, and deliver every message. (With
/// partitions replicated by the seeded nodes alone, node 3 would be the only one left holding
/// them, and no partition could reach a quorum.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_follow_the_voters_and_survive_the_loss_of_two_seeded_nodes() {
    let mut cluster = growing_cluster(3, 5).expect("start cluster");
    let result = async {
        seeded(&cluster).await?;
        for id in [4, 5] {
            cluster.start_node(id)?;
            wait_until_up(&cluster, id).await?;
            let answer = add_member(&cluster, 1, id).await?;
            ensure!(answer.contains("promoted to voter"), "add {id}: {answer:?}");
        }
        let five = [1, 2, 3, 4, 5];
        cluster
            .wait_for_all(
                Duration::from_secs(30),
                "partitions replicated by five",
                |s| {
                    voters(s) == ids(&five)
                        && s.partitions
                            .iter()
                            .all(|p| p.replicas == five && p.status == "active")
                },
            )
            .await?;
        bmq_tests::produce(QUEUE, vec![cluster.node(4).client_addr()], 7, 300)
            .await
            .context("produce to five voters")?;
        cluster.kill_node(1)?;
        cluster.kill_node(2)?;
        cluster
            .wait_for_all(Duration::from_secs(30), "primaries among 3, 4 and 5", |s| {
                s.node_id < 3
                    || s.partitions
                        .iter()
                        .all(|p| p.status == "active" && p.primary.is_some_and(|n| n >= 3))
            })
            .await?;
        bmq_tests::consume(QUEUE, vec![cluster.node(5).client_addr()], 7, 300)
            .await
            .context("every message ACKed by five voters, after the loss of two")?;
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// 3 -> 5 -> 3 while a producer paced at 200 PUTs/s and a consumer run on a strong queue
/// (through node 3, which stays): nodes 4 and 5 join and are promoted, every partition is
/// re-leased to each new set of voters, then 5 and 4 are removed and exit. Every PUT is
/// ACKed, every ACKed message is delivered, and each producer's messages arrive in order
/// (redeliveries flagged `out_of_order` aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_grows_to_five_and_shrinks_to_three_under_a_paced_producer() {
    use bmq_proto::client::AckStatus;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const PACED: &str = "bmq://bmq.test/members-paced";
    let mut cluster = growing_cluster(3, 5).expect("start cluster");
    let result = async {
        seeded(&cluster).await?;
        let (poller, recorder) = poll_leadership(&cluster);
        let via = cluster.node(3).client_addr();
        let consumer = bmq_tests::open_consumer(PACED, vec![via.clone()], "paced-consumer").await?;
        let producer = bmq_tests::open_producer(PACED, vec![via.clone()], "paced-producer").await?;
        let stop = Arc::new(AtomicBool::new(false));
        let produce = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut acks = Vec::new();
                let mut tick = tokio::time::interval(Duration::from_millis(5));
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let payload = bmqctl::payload::encode(9, seq, 1024);
                    acks.push(producer.put(PACED, payload, vec![]).await?);
                    seq += 1;
                }
                for ack in acks {
                    let ack = ack.await?;
                    ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
                }
                producer.disconnect().await.ok();
                anyhow::Ok(seq)
            }
        });
        let members = |want: &'static [u32]| {
            move |s: &NodeStatusDoc| {
                voters(s) == ids(want)
                    && s.partitions
                        .iter()
                        .all(|p| p.replicas == want && p.status == "active")
            }
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (id, want) in [(4, &[1, 2, 3, 4][..]), (5, &[1, 2, 3, 4, 5][..])] {
            cluster.start_node(id)?;
            wait_until_up(&cluster, id).await?;
            let answer = add_member(&cluster, 3, id).await?;
            ensure!(answer.contains("promoted to voter"), "add {id}: {answer:?}");
            cluster
                .wait_for_all(
                    Duration::from_secs(30),
                    "partitions re-leased",
                    members(want),
                )
                .await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        for (id, want) in [(5, &[1, 2, 3, 4][..]), (4, &[1, 2, 3][..])] {
            let answer = remove_member(&cluster, 3, id).await?;
            ensure!(answer.contains("removed"), "remove {id}: {answer:?}");
            cluster
                .wait_for_exit(id, Duration::from_secs(20))?
                .with_context(|| format!("node {id} kept running after its removal"))?;
            cluster
                .wait_for_all(
                    Duration::from_secs(30),
                    "partitions re-leased",
                    members(want),
                )
                .await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let sent = produce.await??;
        ensure!(sent > 100, "the producer sent only {sent} PUTs");
        bmq_tests::receive_all(&consumer, 9, sent, Duration::from_secs(60))
            .await
            .context("every ACKed message delivered, in order")?;
        leadership_checked(poller, &recorder, 4).await?;
        consumer.disconnect().await.ok();
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// The primary of a queue holding 200 unconfirmed strong messages is removed: it leaves, its
/// primaries move (the new primaries heal from the other voters), it is removed and exits,
/// and every message is delivered through a survivor. Then the leader is SIGKILLed in the
/// middle of the next change (node 5 being added): the survivors elect a leader within two
/// terms, the change is either applied everywhere or nowhere, and finished through the new
/// leader; node 5 becomes a voter and messages flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_with_unconfirmed_messages_is_removed_and_a_leader_dies_mid_change() {
    const HELD: &str = "bmq://bmq.test/members-held";
    let mut cluster = growing_cluster(3, 5).expect("start cluster");
    let result = async {
        seeded(&cluster).await?;
        cluster.start_node(4)?;
        wait_until_up(&cluster, 4).await?;
        let answer = add_member(&cluster, 1, 4).await?;
        ensure!(answer.contains("promoted to voter"), "add 4: {answer:?}");
        let all = cluster.client_addrs();
        bmq_tests::produce(HELD, all.clone(), 3, 200)
            .await
            .context("produce before the removal")?;
        let (partition, primary) =
            bmq_tests::primary_of_queue(&cluster, HELD, Duration::from_secs(10)).await?;
        let via = (1..=4).find(|n| *n != primary).unwrap();
        let answer = remove_member(&cluster, via, primary).await?;
        ensure!(answer.contains("removed"), "remove {primary}: {answer:?}");
        cluster
            .wait_for_exit(primary, Duration::from_secs(20))?
            .with_context(|| format!("node {primary} kept running after its removal"))?;
        let survivors: Vec<u32> = (1..=4).filter(|n| *n != primary).collect();
        cluster
            .wait_for_all(Duration::from_secs(30), "partitions healed without it", |s| {
                voters(s) == survivors.iter().copied().collect()
                    && s.partitions.iter().all(|p| {
                        p.status == "active"
                            && p.primary.is_some_and(|n| n != primary)
                            && p.replicas == survivors
                    })
            })
            .await
            .with_context(|| format!("partition {partition} of node {primary}"))?;
        let consumer_at = vec![cluster.node(survivors[0]).client_addr()];
        bmq_tests::consume(HELD, consumer_at, 3, 200)
            .await
            .context("the removed primary's unconfirmed messages")?;

        // The leader dies while node 5 is being added.
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        cluster.start_node(5)?;
        wait_until_up(&cluster, 5).await?;
        let m5 = cluster.node(5).config.self_member().clone();
        let path = format!(
            "/admin/members?id=5&host={}&client_port={}&peer_port={}&admin_port={}&timeout_ms=30000",
            m5.host, m5.client_port, m5.peer_port, m5.admin_port
        );
        let leader_admin = cluster.node(leader).admin_addr();
        let adding = tokio::spawn(async move {
            bmqctl::http::request(&leader_admin, "POST", &path, None).await
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        cluster.kill_node(leader)?;
        let _ = adding.await;
        let (new_leader, new_term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        ensure!(
            new_leader != leader && new_term > term && new_term <= term + 2,
            "after the leader's SIGKILL: node {new_leader} leads term {new_term} (was node \
             {leader}, term {term})"
        );
        let epochs = cluster
            .wait_for_agreement(Duration::from_secs(20), "the committed membership", |s| {
                s.membership.as_ref().map(|m| m.epoch)
            })
            .await?;
        let answer = add_member(&cluster, new_leader, 5).await;
        ensure!(
            format!("{answer:?}").contains("promoted to voter")
                || format!("{answer:?}").contains("already a member"),
            "finishing the change (epoch {epochs:?} agreed): {answer:?}"
        );
        let want: BTreeSet<u32> = survivors
            .iter()
            .copied()
            .chain([5])
            .collect();
        cluster
            .wait_for_all(Duration::from_secs(30), "node 5 a voter", |s| {
                voters(s) == want
            })
            .await?;
        let alive: Vec<String> = survivors
            .iter()
            .filter(|n| **n != leader)
            .map(|n| cluster.node(*n).client_addr())
            .collect();
        round_trip(
            QUEUE,
            vec![cluster.node(5).client_addr()],
            alive,
            4,
            200,
        )
        .await
        .context("round trip after the change")?;
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// Shrinking: the leader of a 4-node cluster is removed (it leaves, its primaries move, the
/// removal commits, it steps down and exits saying why); the three others elect a leader and
/// serve; a removed node restarted with its data exits at once; removing node 4 brings the
/// cluster to two voters and messages still flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_and_then_a_follower_are_removed_and_exit() {
    let mut cluster = growing_cluster(3, 4).expect("start cluster");
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let (poller, recorder) = poll_leadership(&cluster);
        cluster.start_node(4)?;
        wait_until_up(&cluster, 4).await?;
        let answer = add_member(&cluster, 1, 4).await?;
        ensure!(
            answer.contains("promoted to voter"),
            "add answered {answer:?}"
        );
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        round_trip(
            QUEUE,
            vec![cluster.node(4).client_addr()],
            vec![cluster.node(1).client_addr()],
            1,
            300,
        )
        .await
        .context("round trip on four voters")?;

        let answer = remove_member(&cluster, leader, leader).await?;
        ensure!(answer.contains("removed"), "remove answered {answer:?}");
        let exit = cluster
            .wait_for_exit(leader, Duration::from_secs(10))?
            .context("the removed leader did not exit")?;
        ensure!(
            !exit.success(),
            "a removed node exits with an error: {exit}"
        );
        let (new_leader, new_term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        ensure!(new_leader != leader && new_term > term);
        let rest: Vec<u32> = (1..=4).filter(|n| *n != leader).collect();
        let statuses = cluster
            .wait_for_all(
                Duration::from_secs(20),
                "three voters, the leader removed",
                |s| {
                    voters(s) == ids(&rest)
                        && s.elector.quorum == 2
                        && s.membership
                            .as_ref()
                            .is_some_and(|m| m.removed == vec![leader])
                        && s.partitions.iter().all(|p| p.primary != Some(leader))
                },
            )
            .await?;
        ensure!(statuses.len() == 3);
        round_trip(
            QUEUE,
            vec![cluster.node(rest[0]).client_addr()],
            vec![cluster.node(rest[2]).client_addr()],
            2,
            300,
        )
        .await
        .context("round trip after the leader's removal")?;
        // Add, leaving, removal of the leader (its election), then the follower's below.
        leadership_checked(poller, &recorder, 3).await?;

        // Restarted with its data, the removed node refuses to serve and exits.
        cluster.start_node(leader)?;
        let exit = cluster
            .wait_for_exit(leader, Duration::from_secs(10))?
            .context("the restarted removed node kept running")?;
        ensure!(!exit.success());
        let log = std::fs::read_to_string(cluster.node(leader).config.data_dir.join("stderr.log"))
            .unwrap_or_default()
            + &std::fs::read_to_string(cluster.node(leader).log_path()).unwrap_or_default();
        ensure!(
            log.contains("was removed from the cluster"),
            "no reason in the log"
        );

        // Again a removal, down to two voters: node 4, the one that joined, if it is still a
        // member, else a follower (partitions follow the voters: either leaves them a quorum).
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        let target = if rest.contains(&4) {
            4
        } else {
            *rest.iter().find(|n| **n != leader).unwrap()
        };
        remove_member(&cluster, leader, target).await?;
        cluster
            .wait_for_exit(target, Duration::from_secs(10))?
            .context("the removed node did not exit")?;
        let left: Vec<u32> = rest.iter().copied().filter(|n| *n != target).collect();
        cluster
            .wait_for_all(Duration::from_secs(20), "two voters", |s| {
                voters(s) == ids(&left) && s.elector.quorum == 2
            })
            .await?;
        round_trip(
            QUEUE,
            vec![cluster.node(left[0]).client_addr()],
            vec![cluster.node(left[1]).client_addr()],
            3,
            300,
        )
        .await
        .context("round trip on two voters")?;
        if cluster.nodes.iter().all(|n| !n.is_running()) {
            bail!("no node left running");
        }
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// Kills a process by pid when dropped (a detached node the test started through bmqctl).
struct KillOnDrop(Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // SAFETY: kill(2) with a pid this test learned from the command that started it.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// `bmqctl cluster add-node` and `remove-node` on a local cluster run by `bmqctl cluster up`
/// (with its development CA and tokens): node 4 is written, certified, started detached, added
/// and promoted; messages flow through it; it is removed and exits; Ctrl-C stops the rest.
#[test]
fn bmqctl_grows_and_shrinks_the_local_cluster() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let bmqctl = bmq_tests::broker_binary().with_file_name("bmqctl");
    let dir = tempfile::tempdir().expect("temp dir");
    // Node i uses base+i, base+13+i (bmqp), base+100+i and base+200+i: a base below the
    // ephemeral range where all of nodes 1-4's ports are free (as graceful.rs does).
    let base = (0..200)
        .map(|_| 20_000 + (rand::random::<u16>() % 10_000))
        .find(|b| {
            (1..=4).all(|i| {
                [0, 13, 100, 200]
                    .iter()
                    .all(|o| std::net::TcpListener::bind(("127.0.0.1", b + o + i)).is_ok())
            })
        })
        .expect("a free base port");
    let mut command = Command::new(&bmqctl);
    let mut up = command
        .args(["cluster", "up", "--no-prometheus", "--clean"])
        .args(["--nodes", "3", "--base-port", &base.to_string()])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start bmqctl cluster up");
    let mut out = BufReader::new(up.stdout.take().expect("stdout"));
    let mut node_4 = KillOnDrop(None);
    let result = (|| -> anyhow::Result<()> {
        loop {
            let mut line = String::new();
            ensure!(
                out.read_line(&mut line)? > 0,
                "cluster up ended before it was up"
            );
            if line.contains("Ctrl-C stops") {
                break;
            }
        }
        let run = |args: &[&str]| -> anyhow::Result<String> {
            let output = Command::new(&bmqctl)
                .args(args)
                .arg("--dir")
                .arg(dir.path())
                .env("BMQ_CLUSTER_DIR", dir.path())
                .output()?;
            let text = String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr);
            ensure!(output.status.success(), "bmqctl {args:?}: {text}");
            Ok(text)
        };
        let added = run(&["cluster", "add-node", "--timeout-ms", "60000"])?;
        node_4.0 = added
            .split("(pid ")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .and_then(|p| p.parse().ok());
        ensure!(
            added.contains("node 4 added and promoted to voter"),
            "{added}"
        );
        let client = format!("127.0.0.1:{}", base + 4);
        let produced = Command::new(&bmqctl)
            .args([
                "produce",
                "--queue",
                "bmq://bmq.test/grown",
                "--count",
                "100",
            ])
            .args(["--size", "100", "--broker", &client])
            .env("BMQ_CLUSTER_DIR", dir.path())
            .output()?;
        let text = String::from_utf8_lossy(&produced.stdout);
        ensure!(
            text.contains("acked 100, nacked 0"),
            "produce through node 4: {text}"
        );
        let removed = run(&["cluster", "remove-node", "--id", "4"])?;
        ensure!(
            removed.contains("node 4 removed") && removed.contains("node 4: exited"),
            "{removed}"
        );
        node_4.0 = None;
        Ok(())
    })();
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    unsafe { libc::kill(up.id() as i32, libc::SIGINT) };
    let _ = up.wait();
    if let Err(e) = result {
        panic!("{e:#}");
    }
}

/// A learner is promoted only once its journals follow every partition's primary, and a
/// learner SIGKILLed during its catch-up resumes it when restarted with its data. Four queues
/// hold messages on their partitions; node 4 joins as a learner, is killed before its journals
/// caught up (the leader keeps it a learner: its last report shows partitions behind), the
/// cluster serves meanwhile, and node 4 restarted finishes its catch-up and is promoted —
/// holding then every record its partitions' primaries held before it joined. Every ACKed
/// message is delivered, through node 4, in each producer's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_killed_during_its_catch_up_resumes_and_is_promoted_once_its_journals_follow() {
    const QUEUES: u64 = 4;
    const MESSAGES: u64 = 6_000;
    let queue = |i: u64| format!("bmq://bmq.test/catch-up-{i}");
    let mut cluster = growing_cluster(3, 4).expect("start cluster");
    let result = async {
        seeded(&cluster).await?;
        let brokers = vec![cluster.node(1).client_addr(), cluster.node(2).client_addr()];
        let loads = (0..QUEUES).map(|i| {
            let brokers = brokers.clone();
            let uri = queue(i);
            async move { bmq_tests::produce(&uri, brokers, 20 + i, MESSAGES).await }
        });
        futures::future::try_join_all(loads)
            .await
            .context("preload")?;
        // What each partition's primary holds before node 4 joins.
        let held: Vec<(u32, u64)> = {
            let docs = cluster
                .wait_for_all(Duration::from_secs(5), "every node answers", |_| true)
                .await?;
            let mut held = Vec::new();
            for p in &docs[0].partitions {
                let primary = p.primary.context("every partition has a primary")?;
                let doc = docs
                    .iter()
                    .find(|d| d.node_id == primary)
                    .context("the primary answers")?;
                let last = doc
                    .partitions
                    .iter()
                    .find(|q| q.partition_id == p.partition_id)
                    .map_or(0, |q| q.journal_last_sequence);
                held.push((p.partition_id, last));
            }
            held
        };
        ensure!(
            held.iter().filter(|(_, last)| *last > 0).count() >= 2,
            "the preload spans several partitions: {held:?}"
        );

        cluster.start_node(4)?;
        wait_until_up(&cluster, 4).await?;
        let m = cluster.node(4).config.self_member().clone();
        let path = format!(
            "/admin/members?id=4&host={}&client_port={}&peer_port={}&admin_port={}&wait=learner",
            m.host, m.client_port, m.peer_port, m.admin_port
        );
        let answer =
            bmqctl::http::request(&cluster.node(1).admin_addr(), "POST", &path, None).await?;
        ensure!(
            answer.contains("added as a learner"),
            "add answered {answer:?}"
        );
        cluster.kill_node(4)?;
        // Killed mid catch-up: a learner it stays, however long it is down.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let docs = cluster
            .wait_for_all(Duration::from_secs(5), "every node answers", |_| true)
            .await?;
        for d in &docs {
            let m = d.membership.as_ref().context("membership")?;
            let four = m.members.iter().find(|x| x.node_id == 4);
            ensure!(
                four.is_some_and(|x| x.role == "learner"),
                "node {}: node 4 is {:?} while it is down, before its journals caught up",
                d.node_id,
                four
            );
        }
        // The cluster serves meanwhile.
        bmq_tests::round_trip(QUEUE, brokers.clone(), brokers.clone(), 30, 200)
            .await
            .context("round trip while the learner is down")?;

        cluster.start_node(4)?;
        let admin4 = cluster.node(4).admin_addr();
        let promoted = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                if let Ok(s) = bmqctl::status::fetch_status(&admin4, Duration::from_secs(1)).await {
                    if voters(&s).contains(&4) {
                        return s;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .context("node 4 restarted was not promoted")?;
        for (partition, last) in &held {
            let own = promoted
                .partitions
                .iter()
                .find(|p| p.partition_id == *partition)
                .map_or(0, |p| p.journal_last_sequence);
            ensure!(
                own >= *last,
                "partition {partition}: node 4 holds {own} of the primary's {last} when promoted"
            );
        }
        for i in 0..QUEUES {
            bmq_tests::consume(
                &queue(i),
                vec![cluster.node(4).client_addr()],
                20 + i,
                MESSAGES,
            )
            .await
            .with_context(|| format!("every ACKed message of {} through node 4", queue(i)))?;
        }
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// A node joins with `join` alone: its file lists itself and the peer addresses of members to
/// ask (the first of which answers nothing). Started before the cluster is up, it waits —
/// never electing itself, though it is the only node its file lists — then learns the
/// committed membership from a member, is added, promoted, and serves. Restarted, its ledger
/// holds the membership and `join` is not used again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_join_alone_learns_the_members_is_added_and_never_elects_itself() {
    let mut cluster = Cluster::configure(4, |_| {}).expect("configure");
    let result = async {
        let unused = bmq_tests::free_ports(1)[0];
        let join = vec![
            format!("127.0.0.1:{unused}"),
            cluster.node(2).config.self_member().peer_addr(),
            cluster.node(1).config.self_member().peer_addr(),
        ];
        for node in cluster.nodes.iter_mut() {
            if node.id == 4 {
                node.config.members.retain(|m| m.id == 4);
                node.config.join = join.clone();
            } else {
                node.config.members.retain(|m| m.id <= 3);
            }
            std::fs::write(&node.config_path, node.config.to_toml_string())?;
        }
        cluster.start_node(4)?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        ensure!(
            bmqctl::http::get(&cluster.node(4).admin_addr(), "/healthz")
                .await
                .is_err(),
            "node 4 serves before it learned a cluster"
        );
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        // Nodes 1-3 seed the cluster (node 4, refused by them until it is added, follows no
        // leader yet).
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let mut views = BTreeSet::new();
                for id in 1..=3 {
                    let admin = cluster.node(id).admin_addr();
                    match bmqctl::status::fetch_status(&admin, Duration::from_secs(1)).await {
                        Ok(s) if s.ready && s.membership.as_ref().is_some_and(|m| m.epoch == 1) => {
                            views.insert((s.elector.leader, s.elector.term));
                        }
                        _ => {
                            views.insert((None, 0));
                        }
                    }
                }
                if views.len() == 1 && views.first().is_some_and(|(l, _)| l.is_some()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .context("nodes 1-3 seed the cluster")?;
        wait_until_up(&cluster, 4).await?;
        let before =
            bmqctl::status::fetch_status(&cluster.node(4).admin_addr(), Duration::from_secs(2))
                .await?;
        ensure!(
            before.elector.state != "leader" && before.membership.is_none(),
            "node 4 before its addition: {:?}, membership {:?}",
            before.elector,
            before.membership
        );
        let answer = add_member(&cluster, 1, 4).await?;
        ensure!(
            answer.contains("promoted to voter"),
            "add answered {answer:?}"
        );
        let statuses = cluster
            .wait_for_all(Duration::from_secs(20), "four voters everywhere", |s| {
                voters(s) == ids(&[1, 2, 3, 4]) && s.elector.quorum == 3
            })
            .await?;
        for s in &statuses {
            ensure!(
                s.membership.as_ref().unwrap().file_disagrees.is_none() || s.node_id != 4,
                "node 4 joined: its file is no seed to disagree with"
            );
        }
        let log = std::fs::read_to_string(cluster.node(4).log_path())?;
        ensure!(
            log.contains("no membership from this address")
                && log.contains("learned the cluster's committed membership"),
            "node 4's log tells how it joined"
        );
        bmq_tests::round_trip(
            QUEUE,
            vec![cluster.node(4).client_addr()],
            vec![cluster.node(3).client_addr()],
            40,
            300,
        )
        .await
        .context("round trip through the joined node")?;
        cluster.kill_node(4)?;
        cluster.start_node(4)?;
        cluster
            .wait_for_all(Duration::from_secs(20), "node 4 back as a voter", |s| {
                voters(s) == ids(&[1, 2, 3, 4]) && s.ready
            })
            .await?;
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        ensure!(
            leader != 4 || term > 1,
            "leader {leader} at term {term}: node 4 never elected itself alone"
        );
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}

/// The cluster moves entirely onto members added at run time whose files do not know each
/// other: nodes 4 and 5 each list the three seeded nodes and themselves, then the seeded nodes
/// are removed one by one. Every partition's primary, and the leader, end on nodes 4 and 5,
/// which find each other only through the committed membership: each partition heals and is
/// committed ACTIVE (a primary announces its healing to every member of the membership, not
/// to its file's members), and messages ACKed before flow after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_moves_onto_added_members_that_know_each_other_only_by_the_membership() {
    let mut cluster = Cluster::configure(5, |_| {}).expect("configure");
    let result = async {
        for node in cluster.nodes.iter_mut() {
            let id = node.id;
            node.config.members.retain(|m| m.id <= 3 || m.id == id);
            std::fs::write(&node.config_path, node.config.to_toml_string())?;
        }
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        seeded(&cluster).await?;
        for id in [4, 5] {
            cluster.start_node(id)?;
            wait_until_up(&cluster, id).await?;
            let answer = add_member(&cluster, 1, id).await?;
            ensure!(answer.contains("promoted to voter"), "add {id}: {answer:?}");
        }
        bmq_tests::produce(QUEUE, vec![cluster.node(2).client_addr()], 50, 300)
            .await
            .context("produce before the moves")?;
        for id in [1, 2, 3] {
            let answer = remove_member(&cluster, 4, id).await?;
            ensure!(answer.contains("removed"), "remove {id}: {answer:?}");
            cluster
                .wait_for_exit(id, Duration::from_secs(20))?
                .with_context(|| format!("node {id} kept running after its removal"))?;
        }
        cluster
            .wait_for_all(
                Duration::from_secs(30),
                "every partition active on nodes 4 and 5",
                |s| {
                    voters(s) == ids(&[4, 5])
                        && s.partitions
                            .iter()
                            .all(|p| p.status == "active" && p.primary.is_some_and(|n| n >= 4))
                },
            )
            .await?;
        bmq_tests::consume(QUEUE, vec![cluster.node(5).client_addr()], 50, 300)
            .await
            .context("every message ACKed before the moves")?;
        Ok(())
    }
    .await;
    cluster.assert_ok(result);
}
