//! Multi-process tests of the queue modes beyond priority (DESIGN.md §7): broadcast
//! (at-most-once, nothing stored) and fanout (every app id gets every message).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_config::{DomainConfig, DomainMode};
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bmq_tests::Cluster;
use bmqctl::payload;

const QUEUE: &str = "bmq://bmq.broadcast/ticks";
const FANOUT_QUEUE: &str = "bmq://bmq.fanout/orders";

fn client(brokers: Vec<String>, id: &str) -> ClientConfig {
    let mut config = ClientConfig::new(brokers);
    config.client_id = id.to_string();
    config.request_timeout = Duration::from_secs(20);
    config
}

/// Receives until `count` distinct sequences of `producer` arrived; returns them.
async fn receive(consumer: &Client, producer: u64, count: usize) -> anyhow::Result<BTreeSet<u64>> {
    let mut seen = BTreeSet::new();
    while seen.len() < count {
        let msg = tokio::time::timeout(Duration::from_secs(20), consumer.next_message())
            .await
            .context("consumer timed out")?
            .context("consumer stream ended")?;
        let (pid, seq) =
            payload::verify(&msg.payload).map_err(|e| anyhow::anyhow!("corrupt payload: {e}"))?;
        ensure!(
            pid == producer,
            "received a message of producer {pid}, sent before this consumer attached"
        );
        ensure!(msg.delivery_attempt == 1, "broadcast redelivered: {msg:?}");
        seen.insert(seq);
    }
    Ok(seen)
}

/// Two consumers on different nodes each get every message of a broadcast queue; messages
/// put while no consumer was attached are ACKed and never delivered later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_reaches_every_attached_consumer_and_stores_nothing() {
    let mut cluster = Cluster::configure(3, |c| {
        let mut d = DomainConfig::new("bmq.broadcast");
        d.mode = DomainMode::Broadcast;
        c.domains.push(d);
    })
    .expect("configure cluster");
    for id in 1..=3 {
        cluster.start_node(id).expect("start node");
    }
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        let addrs = cluster.client_addrs();
        let producer = Client::connect(client(vec![addrs[0].clone()], "producer")).await?;
        producer.open_queue(QUEUE, OpenOptions::write()).await?;
        // Nobody listens: ACKed, and gone.
        for seq in 0..10 {
            let ack = producer
                .put(QUEUE, payload::encode(1, seq, 64), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack {ack:?}");
        }
        let mut consumers = Vec::new();
        for (i, addr) in addrs.iter().enumerate().skip(1) {
            let c = Client::connect(client(vec![addr.clone()], &format!("consumer-{i}"))).await?;
            c.open_queue(QUEUE, OpenOptions::read(ConsumerOptions::default()))
                .await?;
            consumers.push(c);
        }
        for seq in 0..100 {
            let ack = producer
                .put(QUEUE, payload::encode(2, seq, 64), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack {ack:?}");
        }
        for c in &consumers {
            let seen = receive(c, 2, 100).await?;
            ensure!(seen == (0..100).collect(), "a consumer missed messages");
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

/// Receives and confirms until `count` distinct sequences arrived on `uri`.
async fn drain_confirming(
    consumer: &Client,
    uri: &str,
    count: usize,
) -> anyhow::Result<BTreeSet<u64>> {
    let mut seen = BTreeSet::new();
    while seen.len() < count {
        let msg = tokio::time::timeout(Duration::from_secs(20), consumer.next_message())
            .await
            .context("consumer timed out")?
            .context("consumer stream ended")?;
        let (_, seq) =
            payload::verify(&msg.payload).map_err(|e| anyhow::anyhow!("corrupt payload: {e}"))?;
        consumer.confirm(uri, msg.guid).await?;
        seen.insert(seq);
    }
    Ok(seen)
}

/// A fanout domain with app ids `a` and `b`: app `a` consumes and confirms every message,
/// and app `b`, attached only afterwards, still gets every one of them; an unknown app id is
/// refused with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanout_gives_every_app_its_own_copy() {
    let mut cluster = Cluster::configure(3, |c| {
        let mut d = DomainConfig::new("bmq.fanout");
        d.mode = DomainMode::Fanout;
        d.app_ids = vec!["a".into(), "b".into()];
        c.domains.push(d);
    })
    .expect("configure cluster");
    for id in 1..=3 {
        cluster.start_node(id).expect("start node");
    }
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        let addrs = cluster.client_addrs();
        let app = |id: &str| ConsumerOptions {
            app_id: id.to_string(),
            ..Default::default()
        };
        let unknown = Client::connect(client(vec![addrs[2].clone()], "consumer-c")).await?;
        let refused = unknown
            .open_queue(FANOUT_QUEUE, OpenOptions::read(app("c")))
            .await;
        ensure!(refused.is_err(), "an unknown app id must be refused");
        let a = Client::connect(client(vec![addrs[1].clone()], "consumer-a")).await?;
        a.open_queue(FANOUT_QUEUE, OpenOptions::read(app("a")))
            .await?;
        let producer = Client::connect(client(vec![addrs[0].clone()], "producer")).await?;
        producer
            .open_queue(FANOUT_QUEUE, OpenOptions::write())
            .await?;
        for seq in 0..100 {
            let ack = producer
                .put(FANOUT_QUEUE, payload::encode(1, seq, 64), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack {ack:?}");
        }
        let seen_a = drain_confirming(&a, FANOUT_QUEUE, 100).await?;
        ensure!(seen_a == (0..100).collect(), "app a missed messages");
        let b = Client::connect(client(vec![addrs[2].clone()], "consumer-b")).await?;
        b.open_queue(FANOUT_QUEUE, OpenOptions::read(app("b")))
            .await?;
        let seen_b = drain_confirming(&b, FANOUT_QUEUE, 100).await?;
        ensure!(seen_b == (0..100).collect(), "app b missed messages");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}

/// Subscriptions through our own client (BlazingMQ's expression language): a consumer of
/// `seq >= 50` gets exactly the messages whose `seq` property is 50 or more, a consumer with
/// no subscription then gets the others, and an expression that does not compile is refused
/// with INVALID_ARGUMENT naming the offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_select_messages_by_their_properties() {
    use bmq_proto::client::{Property, PropertyType, StatusCode, Subscription};
    const QUEUE: &str = "bmq://bmq.test/subscribed";
    let cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        let addrs = cluster.client_addrs();
        let subscribed = |expression: &str| ConsumerOptions {
            subscriptions: vec![Subscription {
                id: 1,
                expression: expression.to_string(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let bad = Client::connect(client(vec![addrs[1].clone()], "bad")).await?;
        match bad
            .open_queue(QUEUE, OpenOptions::read(subscribed("seq >=")))
            .await
        {
            Err(bmq_client::ClientError::Refused { code, message }) => ensure!(
                code == StatusCode::InvalidArgument && message.contains("offset"),
                "{code:?}: {message}"
            ),
            other => anyhow::bail!("an invalid expression was not refused: {other:?}"),
        }
        let high = Client::connect(client(vec![addrs[1].clone()], "high")).await?;
        high.open_queue(QUEUE, OpenOptions::read(subscribed("seq >= 50")))
            .await?;
        let producer = Client::connect(client(vec![addrs[0].clone()], "producer")).await?;
        producer.open_queue(QUEUE, OpenOptions::write()).await?;
        for seq in 0..100u64 {
            let seq_property = Property {
                key: "seq".into(),
                value: seq.to_string(),
                value_type: PropertyType::Int64 as i32,
            };
            let ack = producer
                .put(QUEUE, payload::encode(1, seq, 64), vec![seq_property])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack {ack:?}");
        }
        let seen = drain_confirming(&high, QUEUE, 50).await?;
        ensure!(seen == (50..100).collect(), "seq >= 50 got {seen:?}");
        let rest = Client::connect(client(vec![addrs[2].clone()], "rest")).await?;
        rest.open_queue(QUEUE, OpenOptions::read(ConsumerOptions::default()))
            .await?;
        let seen = drain_confirming(&rest, QUEUE, 50).await?;
        ensure!(seen == (0..50).collect(), "the rest got {seen:?}");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(40));
    }
}
