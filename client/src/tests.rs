//! Client tests against [`FakeBroker`](crate::testing::FakeBroker).

use std::time::Duration;

use bmq_proto::client::{client_message::Kind, AckStatus, ConsumerOptions, Push, StatusCode};
use bytes::Bytes;
use tokio::net::TcpListener;

use crate::testing::{Behaviour, Control, FakeBroker, WAIT};

use super::*;

const URI: &str = "bmq://bmq.test/q";

fn config(brokers: &[&FakeBroker]) -> ClientConfig {
    let mut config = ClientConfig::new(brokers.iter().map(|b| b.addr.clone()).collect());
    config.request_timeout = Duration::from_secs(3);
    config.reconnect_backoff_min = Duration::from_millis(10);
    config.reconnect_backoff_max = Duration::from_millis(50);
    config
}

fn consumer() -> ConsumerOptions {
    ConsumerOptions {
        max_unconfirmed_messages: 10,
        max_unconfirmed_bytes: 1000,
        priority: 2,
        app_id: String::new(),
        ..Default::default()
    }
}

#[tokio::test]
async fn round_trip() {
    // Hello, open, put/ack, push/confirm, close and disconnect against one broker.
    let mut broker = FakeBroker::start(Behaviour::default()).await;
    let client = Client::connect(config(&[&broker])).await.unwrap();
    assert!(
        matches!(broker.next().await, Kind::Hello(h) if h.protocol_version == bmq_proto::PROTOCOL_VERSION)
    );
    assert_eq!(client.connected_broker(), Some(broker.addr.clone()));

    client
        .open_queue(URI, OpenOptions::read_write(consumer()))
        .await
        .unwrap();
    match broker.next().await {
        Kind::OpenQueue(open) => {
            assert_eq!(open.uri, URI);
            assert!(open.read && open.write);
            assert_eq!(open.consumer, Some(consumer()));
        }
        other => panic!("expected OpenQueue, got {other:?}"),
    }

    let pending = client
        .put(URI, Bytes::from_static(b"hello"), vec![])
        .await
        .unwrap();
    let guid = pending.guid().clone();
    assert_eq!(guid.len(), 16);
    let ack = tokio::time::timeout(WAIT, pending).await.unwrap().unwrap();
    assert_eq!(ack.status(), AckStatus::Success);
    assert_eq!(ack.guid, guid);
    assert!(matches!(broker.next().await, Kind::Put(p) if p.guid == guid && p.payload == "hello"));
    assert_eq!(client.pending_puts(), 0);

    broker.control(Control::Send(Kind::Push(Push {
        uri: URI.into(),
        guid: Bytes::from_static(&[9; 16]),
        payload: Bytes::from_static(b"pushed"),
        properties: vec![],
        delivery_attempt: 1,
        out_of_order: true,
        ..Default::default()
    })));
    let message = tokio::time::timeout(WAIT, client.next_message())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(message.payload, "pushed");
    assert_eq!(message.delivery_attempt, 1);
    assert!(message.out_of_order);
    client.confirm(&message.uri, message.guid).await.unwrap();
    assert!(
        matches!(broker.next().await, Kind::Confirm(c) if c.uri == URI && c.guid == [9u8; 16][..])
    );

    client.close_queue(URI).await.unwrap();
    assert!(matches!(broker.next().await, Kind::CloseQueue(c) if c.uri == URI));
    client.clone().disconnect().await.unwrap();
    assert!(matches!(broker.next().await, Kind::Disconnect(_)));
    assert_eq!(client.connected_broker(), None);
    assert!(matches!(
        client.put(URI, Bytes::new(), vec![]).await,
        Err(ClientError::Disconnected)
    ));
}

#[tokio::test]
async fn reconnect_reopens_queue_and_resends_unacked_put() {
    // The first broker drops the connection with a PUT unacknowledged: the client moves to the
    // second broker, reopens the queue with its options, and resends the PUT with its GUID.
    let mut first = FakeBroker::start(Behaviour {
        no_acks: true,
        ..Default::default()
    })
    .await;
    let mut second = FakeBroker::start(Behaviour::default()).await;
    let client = Client::connect(config(&[&first, &second])).await.unwrap();
    client
        .open_queue(URI, OpenOptions::read_write(consumer()))
        .await
        .unwrap();
    let pending = client
        .put(URI, Bytes::from_static(b"important"), vec![])
        .await
        .unwrap();
    let guid = pending.guid().clone();
    assert!(matches!(first.next().await, Kind::Hello(_)));
    assert!(matches!(first.next().await, Kind::OpenQueue(_)));
    assert!(matches!(first.next().await, Kind::Put(p) if p.guid == guid));
    assert_eq!(client.pending_puts(), 1);

    first.control(Control::Stop);

    let ack = tokio::time::timeout(WAIT, pending).await.unwrap().unwrap();
    assert_eq!(ack.status(), AckStatus::Success);
    assert_eq!(ack.guid, guid);
    assert!(matches!(second.next().await, Kind::Hello(_)));
    match second.next().await {
        Kind::OpenQueue(open) => {
            assert_eq!(open.uri, URI);
            assert!(open.read && open.write);
            assert_eq!(open.consumer, Some(consumer()));
        }
        other => panic!("expected OpenQueue, got {other:?}"),
    }
    assert!(
        matches!(second.next().await, Kind::Put(p) if p.guid == guid && p.payload == "important")
    );
    assert_eq!(client.connected_broker(), Some(second.addr.clone()));
    assert_eq!(client.pending_puts(), 0);

    // The reopened queue works: new PUTs are acknowledged by the second broker.
    let ack = client
        .put(URI, Bytes::from_static(b"next"), vec![])
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(ack.status(), AckStatus::Success);
}

#[tokio::test]
async fn malformed_frame_causes_reconnect() {
    // A frame that does not decode closes the connection; the client reconnects (to the same,
    // only broker) and reopens its queue.
    let mut broker = FakeBroker::start(Behaviour::default()).await;
    let client = Client::connect(config(&[&broker])).await.unwrap();
    client.open_queue(URI, OpenOptions::write()).await.unwrap();
    assert!(matches!(broker.next().await, Kind::Hello(_)));
    assert!(matches!(broker.next().await, Kind::OpenQueue(_)));
    broker.control(Control::SendRaw(vec![0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff]));
    assert!(matches!(broker.next().await, Kind::Hello(_)));
    assert!(
        matches!(broker.next().await, Kind::OpenQueue(o) if o.uri == URI && o.write && !o.read)
    );
}

#[tokio::test]
async fn open_retries_not_ready_and_reports_refusals() {
    // NOT_READY answers are retried until OK; another status is a Refused error with its code.
    let mut broker = FakeBroker::start(Behaviour {
        open_refusals: [
            StatusCode::NotReady,
            StatusCode::NotReady,
            StatusCode::Ok,
            StatusCode::UnknownDomain,
        ]
        .into(),
        ..Default::default()
    })
    .await;
    let client = Client::connect(config(&[&broker])).await.unwrap();
    client.open_queue(URI, OpenOptions::write()).await.unwrap();
    assert!(matches!(broker.next().await, Kind::Hello(_)));
    for _ in 0..3 {
        assert!(matches!(broker.next().await, Kind::OpenQueue(_)));
    }
    let other = "bmq://nope/q";
    match client.open_queue(other, OpenOptions::write()).await {
        Err(ClientError::Refused { code, .. }) => assert_eq!(code, StatusCode::UnknownDomain),
        other => panic!("expected Refused, got {other:?}"),
    }
    // The refused queue is not open: a PUT to it fails.
    let pending = client.put(other, Bytes::new(), vec![]).await.unwrap();
    assert!(matches!(pending.await, Err(ClientError::NotOpen { .. })));
    assert!(matches!(
        client.open_queue("not a uri", OpenOptions::write()).await,
        Err(ClientError::InvalidUri(_))
    ));
}

#[tokio::test]
async fn connect_fails_without_brokers() {
    // No broker listening: connect gives up after the request timeout, naming the brokers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let mut config = ClientConfig::new(vec![addr.clone()]);
    config.request_timeout = Duration::from_millis(200);
    config.reconnect_backoff_min = Duration::from_millis(10);
    config.reconnect_backoff_max = Duration::from_millis(20);
    match Client::connect(config).await {
        Err(ClientError::Connect { brokers, .. }) => assert_eq!(brokers, vec![addr]),
        other => panic!("expected Connect error, got {other:?}"),
    }
    assert!(matches!(
        Client::connect(ClientConfig::new(vec![])).await,
        Err(ClientError::Config { .. })
    ));
}

#[tokio::test]
async fn put_during_reconnection_is_sent_after_reopen() {
    // A PUT made right after the broker dropped the connection is held until the queue is
    // reopened on the new connection, then sent and acknowledged.
    let mut broker = FakeBroker::start(Behaviour::default()).await;
    let client = Client::connect(config(&[&broker])).await.unwrap();
    client.open_queue(URI, OpenOptions::write()).await.unwrap();
    assert!(matches!(broker.next().await, Kind::Hello(_)));
    assert!(matches!(broker.next().await, Kind::OpenQueue(_)));
    broker.control(Control::DropConnection);
    // Wait until the client noticed, so the PUT is made while disconnected or reopening.
    let give_up = tokio::time::Instant::now() + WAIT;
    while client.connected_broker().is_some() && tokio::time::Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let pending = client
        .put(URI, Bytes::from_static(b"held"), vec![])
        .await
        .unwrap();
    let guid = pending.guid().clone();
    let ack = tokio::time::timeout(WAIT, pending).await.unwrap().unwrap();
    assert_eq!(ack.status(), AckStatus::Success);
    assert!(matches!(broker.next().await, Kind::Hello(_)));
    assert!(matches!(broker.next().await, Kind::OpenQueue(_)));
    assert!(matches!(broker.next().await, Kind::Put(p) if p.guid == guid));
}

#[tokio::test]
async fn gives_up_after_reconnect_timeout() {
    // With every broker gone for longer than reconnect_timeout, pending PUTs fail with
    // Disconnected and the handle becomes unusable.
    let broker = FakeBroker::start(Behaviour {
        no_acks: true,
        ..Default::default()
    })
    .await;
    let mut config = config(&[&broker]);
    config.reconnect_timeout = Some(Duration::from_millis(200));
    let client = Client::connect(config).await.unwrap();
    client.open_queue(URI, OpenOptions::write()).await.unwrap();
    let pending = client.put(URI, Bytes::new(), vec![]).await.unwrap();
    broker.control(Control::Stop);
    let result = tokio::time::timeout(WAIT, pending).await.unwrap();
    assert!(
        matches!(result, Err(ClientError::Disconnected)),
        "{result:?}"
    );
    assert!(matches!(
        client.put(URI, Bytes::new(), vec![]).await,
        Err(ClientError::Disconnected)
    ));
}

#[test]
fn guids_are_16_random_bytes_and_distinct_across_slabs() {
    // Three slabs' worth: every GUID 16 bytes, none repeated (128 random bits each).
    let guids: Vec<Bytes> = (0..3 * super::GUID_SLAB_BYTES / 16)
        .map(|_| super::new_guid())
        .collect();
    assert!(guids.iter().all(|g| g.len() == 16));
    let distinct: std::collections::HashSet<&Bytes> = guids.iter().collect();
    assert_eq!(distinct.len(), guids.len());
}

#[test]
fn a_queue_uri_is_encoded_once_per_thread_and_shared() {
    let a = super::shared_uri("bmq://bmq.test/shared-uri");
    let b = super::shared_uri("bmq://bmq.test/shared-uri");
    assert_eq!(&a[..], b"bmq://bmq.test/shared-uri");
    assert_eq!(a.as_ptr(), b.as_ptr(), "the same bytes, not a copy");
    // Past the bound the cache starts over; every answer stays right.
    for i in 0..2 * super::URI_CACHE_MAX {
        let uri = format!("bmq://bmq.test/q{i}");
        assert_eq!(&super::shared_uri(&uri)[..], uri.as_bytes());
    }
}
