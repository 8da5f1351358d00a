//! A scripted in-process broker for tests of the client library and of programs built on it
//! (`bmqctl`): a real `TcpListener` on `127.0.0.1` speaking the framed client protocol, one
//! connection at a time, recording every frame it receives. Compiled for this crate's tests and
//! with the `testing` feature; never part of a production build.

use std::collections::VecDeque;
use std::time::Duration;

use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, CloseQueueResponse, DisconnectResponse,
    HelloResponse, OpenQueueResponse, Push, Status, StatusCode,
};
use bmq_proto::FrameCodec;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

/// How long [`FakeBroker::next`] waits for a frame.
pub const WAIT: Duration = Duration::from_secs(5);

/// What a test asks the fake broker to do on its current connection.
#[derive(Debug)]
pub enum Control {
    /// Send this message.
    Send(Kind),
    /// Write these bytes as they are (a malformed frame, say).
    SendRaw(Vec<u8>),
    /// Close the current connection (the broker keeps listening).
    DropConnection,
    /// Close the connection and stop listening.
    Stop,
}

/// How the fake answers.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
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
pub struct FakeBroker {
    /// The address it listens on, `127.0.0.1:<port>`.
    pub addr: String,
    /// Every frame received, in order.
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
    /// Starts listening on a free port; answers as `behaviour` says.
    ///
    /// # Panics
    /// If no port can be bound (a test environment problem).
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
                            uri: bmq_proto::uri_bytes(&open.uri),
                            guid: Bytes::from((i as u128).to_be_bytes().to_vec()),
                            payload: payload.clone(),
                            properties: vec![],
                            delivery_attempt: 1,
                            out_of_order: false,
                            ..Default::default()
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
    ///
    /// # Panics
    /// When nothing arrives in time or the broker stopped.
    pub async fn next(&mut self) -> Kind {
        tokio::time::timeout(WAIT, self.received.recv())
            .await
            .expect("fake broker received nothing in time")
            .expect("fake broker stopped")
            .kind
            .unwrap()
    }

    /// Tells the broker to act on its current connection.
    ///
    /// # Panics
    /// When the broker task stopped.
    pub fn control(&self, c: Control) {
        self.control.send(c).unwrap();
    }
}
