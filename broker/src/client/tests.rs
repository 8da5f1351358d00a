//! Client tests against a tiny fake broker: a real `TcpListener` speaking the framed protocol.

use std::collections::VecDeque;
use std::time::Duration;

use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueueResponse, ConsumerOptions,
    DisconnectResponse, HelloResponse, OpenQueueResponse, Push, Status, StatusCode,
};
use bmq_proto::FrameCodec;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use super::*;

const URI: &str = "bmq://bmq.test/q";
const WAIT: Duration = Duration::from_secs(5);

/// What the test asks the fake broker to do on its current connection.
enum Control {
    Send(Kind),
    SendRaw(Vec<u8>),
    DropConnection,
    Stop,
}

/// How the fake answers.
#[derive(Clone, Default)]
pub(crate) struct Behaviour {
    /// Leaves PUTs unacknowledged.
    pub no_acks: bool,
    /// Acknowledges PUTs with this status instead of SUCCESS.
    pub nack: Option<AckStatus>,
    /// Answers the first OpenQueues with these statuses, then OK.
    pub open_refusals: VecDeque<StatusCode>,
    /// Pushes these payloads (delivery attempt 1) after a successful open for reading.
    pub push_on_open: Vec<Bytes>,
}

/// A fake broker serving one connection at a time, recording every frame it receives.
pub(crate) struct FakeBroker {
    pub addr: String,
    pub received: mpsc::UnboundedReceiver<ClientMessage>,
    control: mpsc::UnboundedSender<Control>,
}

fn status(code: StatusCode) -> Option<Status> {
    Some(Status {
        code: code as i32,
        message: format!("{code:?}"),
    })
}

impl FakeBroker {
    pub async fn start(mut behaviour: Behaviour) -> FakeBroker {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (received_tx, received) = mpsc::unbounded_channel();
        let (control, mut control_rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    accepted = listener.accept() => accepted.unwrap().0,
                    c = control_rx.recv() => match c {
                        Some(Control::Stop) | None => return,
                        _ => continue,
                    },
                };
                let mut conn = Framed::new(stream, FrameCodec::<ClientMessage>::new(1 << 20));
                loop {
                    tokio::select! {
                        frame = conn.next() => {
                            let Some(Ok(message)) = frame else { break };
                            let _ = received_tx.send(message.clone());
                            for reply in Self::answer(&mut behaviour, message.kind.unwrap()) {
                                let _ = conn.send(ClientMessage { kind: Some(reply) }).await;
                            }
                        }
                        c = control_rx.recv() => match c {
                            Some(Control::Send(kind)) => {
                                let _ = conn.send(ClientMessage { kind: Some(kind) }).await;
                            }
                            Some(Control::SendRaw(bytes)) => {
                                let _ = conn.get_mut().write_all(&bytes).await;
                            }
                            Some(Control::DropConnection) => break,
                            Some(Control::Stop) | None => return,
                        },
                    }
                }
            }
        });
        FakeBroker {
            addr,
            received,
            control,
        }
    }

    fn answer(behaviour: &mut Behaviour, kind: Kind) -> Vec<Kind> {
        vec![match kind {
            Kind::Hello(_) => Kind::HelloResponse(HelloResponse {
                status: status(StatusCode::Ok),
                node_id: 1,
                cluster_name: "fake".into(),
                protocol_version: bmq_proto::PROTOCOL_VERSION,
            }),
            Kind::OpenQueue(open) => {
                let code = behaviour
                    .open_refusals
                    .pop_front()
                    .unwrap_or(StatusCode::Ok);
                let mut replies = vec![Kind::OpenQueueResponse(OpenQueueResponse {
                    request_id: open.request_id,
                    uri: open.uri.clone(),
                    status: status(code),
                    partition_id: 0,
                })];
                if code == StatusCode::Ok && open.read {
                    for (i, payload) in behaviour.push_on_open.iter().enumerate() {
                        replies.push(Kind::Push(Push {
                            uri: open.uri.clone(),
                            guid: Bytes::from((i as u128).to_be_bytes().to_vec()),
                            payload: payload.clone(),
                            properties: vec![],
                            delivery_attempt: 1,
                        }));
                    }
                }
                return replies;
            }
            Kind::Put(put) if !behaviour.no_acks => Kind::Ack(Ack {
                uri: put.uri,
                guid: put.guid,
                status: behaviour.nack.unwrap_or(AckStatus::Success) as i32,
                message: if behaviour.nack.is_some() {
                    "queue full".into()
                } else {
                    String::new()
                },
            }),
            Kind::CloseQueue(close) => Kind::CloseQueueResponse(CloseQueueResponse {
                request_id: close.request_id,
                uri: close.uri,
                status: status(StatusCode::Ok),
            }),
            Kind::Disconnect(_) => Kind::DisconnectResponse(DisconnectResponse {}),
            _ => return Vec::new(),
        }]
    }

    /// The next frame received, within [`WAIT`].
    async fn next(&mut self) -> Kind {
        tokio::time::timeout(WAIT, self.received.recv())
            .await
            .expect("fake broker received nothing in time")
            .expect("fake broker stopped")
            .kind
            .unwrap()
    }

    fn control(&self, c: Control) {
        self.control.send(c).unwrap();
    }
}

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
    })));
    let message = tokio::time::timeout(WAIT, client.next_message())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(message.payload, "pushed");
    assert_eq!(message.delivery_attempt, 1);
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
