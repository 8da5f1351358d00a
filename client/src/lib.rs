//! The async client library (DESIGN.md §8): producers and consumers talk to any broker node.
//!
//! Depends on tokio only (no actix), so any tokio application can embed it. A [`Client`] is a
//! cheap, cloneable handle to one background task that owns the broker connection:
//!
//! - [`Client::connect`] tries the brokers of [`ClientConfig::brokers`] in order until one
//!   answers `Hello`;
//! - when the connection drops (EOF, socket error, or a malformed frame from the broker), the
//!   task reconnects to the **next** broker of the list (round robin, jittered exponential
//!   backoff between [`ClientConfig::reconnect_backoff_min`] and
//!   [`ClientConfig::reconnect_backoff_max`]), sends `Hello`, **reopens** every open queue with
//!   its options, then **resends** every unacknowledged PUT of that queue with its original GUID.
//!   The result is at-least-once: an acknowledged message is never lost, a consumer may see a
//!   message twice (with `delivery_attempt > 1` or not);
//! - [`Client::put`] returns a [`PendingAck`], a future completed by the broker's `Ack` for that
//!   GUID; at most [`ClientConfig::max_pending_puts`] PUTs are unacknowledged at once, `put`
//!   waits for room beyond that;
//! - pushed messages arrive through [`Client::next_message`]; confirm them with
//!   [`Client::confirm`]. Their number is bounded by the consumer's
//!   `max_unconfirmed_messages`, which the broker enforces;
//! - threads: the background task runs on the runtime that called [`Client::connect`]. A
//!   producer that keeps many PUTs in flight does best when its task, its PUTs and its ACK
//!   handling share one thread (a current-thread runtime, or a `LocalSet`): under a
//!   multi-thread runtime the workers hand every batch of PUTs and ACKs back and forth.
//!   `bmqctl bench messages` runs each client so: 2-17% (10% on average) more messages per
//!   second with 256 in flight on a 2-vCPU host, and less CPU per message in the client and
//!   the brokers (docs/bench/JOURNAL.md, "A thread per benchmark client");
//! - security: with [`ClientConfig::tls_ca_file`] the connection is TLS, the broker's
//!   certificate verified against that CA and the host dialed; [`ClientConfig::token`] is sent
//!   in `Hello`. A token the cluster refuses fails [`Client::connect`] at once; an OpenQueue the
//!   token does not permit fails with [`ClientError::Refused`] `NotAuthorized`.
//!
//! ```no_run
//! use bmq_client::{Client, ClientConfig, OpenOptions};
//! use bytes::Bytes;
//!
//! # async fn example() -> Result<(), bmq_client::ClientError> {
//! let client = Client::connect(ClientConfig::new(vec!["127.0.0.1:30101".into()])).await?;
//! let uri = "bmq://bmq.test/orders";
//! client.open_queue(uri, OpenOptions::read_write(Default::default())).await?;
//! let ack = client.put(uri, Bytes::from_static(b"hello"), vec![]).await?.await?;
//! assert_eq!(ack.status(), bmq_proto::client::AckStatus::Success);
//! if let Some(message) = client.next_message().await {
//!     client.confirm(&message.uri, message.guid.clone()).await?;
//! }
//! client.disconnect().await
//! # }
//! ```

#![warn(missing_docs)]

mod connection;
mod error;
pub mod http;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
pub mod tls;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bmq_proto::client::{Ack, ConsumerOptions as ProtoConsumerOptions, Property, StatusCode};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, Semaphore};

pub use error::ClientError;

use bmq_proto::uri::{uri_bytes, QueueUri};
use connection::{Command, Connection};

/// Capacity of the command channel from handles to the background task, commands.
const COMMAND_CHANNEL_CAPACITY: usize = 4096;

/// Settings of a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Brokers to connect to, `host:port`, tried in order; at least one.
    pub brokers: Vec<String>,
    /// The client's identity, sent in `Hello` (shows in broker logs).
    pub client_id: String,
    /// Timeout of each request (Hello, open, close, disconnect). Default 10 s.
    pub request_timeout: Duration,
    /// First reconnection delay. Default 50 ms.
    pub reconnect_backoff_min: Duration,
    /// Largest reconnection delay; the delay doubles up to it, with jitter. Default 1 s.
    pub reconnect_backoff_max: Duration,
    /// How long the task keeps trying to reconnect before giving up and failing every pending
    /// request with [`ClientError::Disconnected`]; `None` = forever (the default).
    pub reconnect_timeout: Option<Duration>,
    /// Most unacknowledged PUTs at once; [`Client::put`] waits beyond that. Default 10 000.
    pub max_pending_puts: usize,
    /// Largest frame accepted from the broker, bytes. Default 64 MiB.
    pub frame_size_max: usize,
    /// PEM file of the CA that signed the brokers' certificates: when set, the client speaks
    /// TLS and verifies each broker's certificate against it and the host it dials. `None`
    /// (the default) = plain TCP.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Token sent in `Hello` (an `[[auth.tokens]]` secret of the cluster); `None` = anonymous.
    /// A token the cluster does not know fails [`Client::connect`] at once with
    /// [`ClientError::Refused`] `NotAuthorized`.
    pub token: Option<String>,
}

impl ClientConfig {
    /// The defaults for the given brokers (`host:port`), with a random client id.
    pub fn new(brokers: Vec<String>) -> Self {
        ClientConfig {
            brokers,
            client_id: format!("bmq-client-{:08x}", rand::random::<u32>()),
            request_timeout: Duration::from_secs(10),
            reconnect_backoff_min: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_secs(1),
            reconnect_timeout: None,
            max_pending_puts: 10_000,
            frame_size_max: bmq_proto::FRAME_SIZE_MAX_DEFAULT,
            tls_ca_file: None,
            token: None,
        }
    }

    fn validate(&self) -> Result<(), ClientError> {
        let bad = |message: &str| {
            Err(ClientError::Config {
                message: message.to_string(),
            })
        };
        if self.brokers.is_empty() {
            return bad("brokers: at least one broker address is needed");
        }
        if self.max_pending_puts == 0 {
            return bad("max_pending_puts: must be at least 1");
        }
        if self.reconnect_backoff_min.is_zero()
            || self.reconnect_backoff_max < self.reconnect_backoff_min
        {
            return bad("reconnect_backoff_min must be positive and at most reconnect_backoff_max");
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout: must be positive");
        }
        Ok(())
    }
}

/// How to open a queue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpenOptions {
    /// Open for consuming: the broker pushes messages to this client.
    pub read: bool,
    /// Open for producing: this client may PUT.
    pub write: bool,
    /// Priority and flow control of the consumer (when `read`); zero limits mean the broker's
    /// defaults.
    pub consumer: ProtoConsumerOptions,
}

impl OpenOptions {
    /// Write only (a producer).
    pub fn write() -> Self {
        OpenOptions {
            write: true,
            ..Default::default()
        }
    }

    /// Read only (a consumer) with `consumer` options.
    pub fn read(consumer: ProtoConsumerOptions) -> Self {
        OpenOptions {
            read: true,
            consumer,
            ..Default::default()
        }
    }

    /// Read and write.
    pub fn read_write(consumer: ProtoConsumerOptions) -> Self {
        OpenOptions {
            read: true,
            write: true,
            consumer,
        }
    }
}

/// A message pushed by the broker to this consumer; confirm it with [`Client::confirm`].
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The queue it came from.
    pub uri: String,
    /// The producer's 16-byte GUID.
    pub guid: Bytes,
    /// The body.
    pub payload: Bytes,
    /// The producer's properties.
    pub properties: Vec<Property>,
    /// 1 plus the number of consumer failures of this message (a consumer that went away or
    /// closed the queue holding it); a failover alone does not raise it.
    pub delivery_attempt: u32,
    /// The message may have been delivered before and may arrive after later messages of its
    /// producer (a redelivery, or recovered by a new primary). Without it, each producer's
    /// messages arrive in the order they were sent.
    pub out_of_order: bool,
}

/// The broker's answer to one PUT: resolves to its [`Ack`] (whose status may be a NACK), or to
/// [`ClientError::Disconnected`] / [`ClientError::NotOpen`] when the PUT can no longer be sent.
/// Dropping it does not cancel the PUT.
#[derive(Debug)]
pub struct PendingAck {
    guid: Bytes,
    receiver: oneshot::Receiver<Result<Ack, ClientError>>,
}

impl PendingAck {
    /// The GUID the PUT was sent with.
    pub fn guid(&self) -> &Bytes {
        &self.guid
    }
}

impl Future for PendingAck {
    type Output = Result<Ack, ClientError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.receiver)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(ClientError::Disconnected)))
    }
}

#[derive(Debug)]
struct Shared {
    connected_broker: Mutex<Option<String>>,
    messages: tokio::sync::Mutex<mpsc::UnboundedReceiver<Message>>,
    put_window: Arc<Semaphore>,
    max_pending_puts: usize,
    request_timeout: Duration,
    reconnect_backoff_min: Duration,
    reconnect_backoff_max: Duration,
}

/// A handle to a client connection (see the module doc). Cheap to clone; the background task
/// stops when every handle is dropped or [`Client::disconnect`] is called.
#[derive(Debug, Clone)]
pub struct Client {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl Client {
    /// Connects to the first broker of `config.brokers` that answers `Hello`, cycling through
    /// the list with backoff for up to `request_timeout`, and starts the background task.
    ///
    /// Errors: [`ClientError::Config`] for an unusable configuration, [`ClientError::Connect`]
    /// when no broker answered in time.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        config.validate()?;
        if config.token.as_deref().is_some_and(|t| !t.is_empty()) && config.tls_ca_file.is_none() {
            tracing::warn!(
                "the client token is sent without TLS: anyone on the path can read it \
                 (set ClientConfig::tls_ca_file)"
            );
        }
        let (messages_tx, messages_rx) = mpsc::unbounded_channel();
        let (commands_tx, commands_rx) = mpsc::channel(COMMAND_CHANNEL_CAPACITY);
        let shared = Arc::new(Shared {
            connected_broker: Mutex::new(None),
            messages: tokio::sync::Mutex::new(messages_rx),
            put_window: Arc::new(Semaphore::new(config.max_pending_puts)),
            max_pending_puts: config.max_pending_puts,
            request_timeout: config.request_timeout,
            reconnect_backoff_min: config.reconnect_backoff_min,
            reconnect_backoff_max: config.reconnect_backoff_max,
        });
        let connection = Connection::establish(config, shared.clone(), messages_tx).await?;
        tokio::spawn(connection.run(commands_rx));
        Ok(Client {
            commands: commands_tx,
            shared,
        })
    }

    /// Opens `uri` (`bmq://<domain>/<queue>`) with `options`; opening an open queue again
    /// updates its options. The queue is reopened automatically after a reconnection.
    ///
    /// `NOT_READY` and `TIMEOUT` answers (the cluster has no leader or no active primary yet)
    /// are retried with backoff until `request_timeout`. Errors: [`ClientError::Refused`] for
    /// other statuses, [`ClientError::Timeout`], [`ClientError::InvalidUri`],
    /// [`ClientError::Disconnected`].
    pub async fn open_queue(&self, uri: &str, options: OpenOptions) -> Result<(), ClientError> {
        self.open_queue_partition(uri, options).await.map(|_| ())
    }

    /// As [`Client::open_queue`], and returns the partition the broker said the queue is
    /// assigned to (`OpenQueueResponse.partition_id`; 0 from a broker that does not say).
    pub async fn open_queue_partition(
        &self,
        uri: &str,
        options: OpenOptions,
    ) -> Result<u32, ClientError> {
        QueueUri::parse(uri)?;
        let what = || format!("open queue {uri}");
        let deadline = tokio::time::Instant::now() + self.shared.request_timeout;
        let mut backoff = self.shared.reconnect_backoff_min;
        loop {
            let (reply, response) = oneshot::channel();
            self.send(Command::Open {
                uri: uri.to_string(),
                options: options.clone(),
                reply,
            })
            .await?;
            let result = match tokio::time::timeout_at(deadline, response).await {
                Err(_) => return Err(ClientError::Timeout { what: what() }),
                Ok(Err(_)) => return Err(ClientError::Disconnected),
                Ok(Ok(result)) => result,
            };
            match result {
                Err(e) if e.is_retriable() => {
                    let wake = tokio::time::Instant::now() + connection::jitter(backoff);
                    if wake >= deadline {
                        return Err(e);
                    }
                    tokio::time::sleep_until(wake).await;
                    backoff = (backoff * 2).min(self.shared.reconnect_backoff_max);
                }
                other => return other,
            }
        }
    }

    /// Sends a message to `uri`, which must be open for writing, with a fresh random 16-byte
    /// GUID. Waits while `max_pending_puts` PUTs are unacknowledged. The returned
    /// [`PendingAck`] completes with the broker's `Ack`; until then the PUT is resent (same
    /// GUID) after every reconnection.
    ///
    /// Errors: [`ClientError::Disconnected`]; a queue that is not open shows as
    /// [`ClientError::NotOpen`] from the [`PendingAck`].
    pub async fn put(
        &self,
        uri: &str,
        payload: Bytes,
        properties: Vec<Property>,
    ) -> Result<PendingAck, ClientError> {
        let permit = self
            .shared
            .put_window
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ClientError::Disconnected)?;
        let guid = new_guid();
        let (reply, receiver) = oneshot::channel();
        self.send(Command::Put {
            put: bmq_proto::client::Put {
                uri: shared_uri(uri),
                guid: guid.clone(),
                payload,
                properties,
            },
            reply,
            permit,
        })
        .await?;
        Ok(PendingAck { guid, receiver })
    }

    /// The next message pushed to this client (from any queue open for reading), or `None`
    /// once the client is disconnected and every received message was taken.
    pub async fn next_message(&self) -> Option<Message> {
        self.shared.messages.lock().await.recv().await
    }

    /// Confirms a message received from `uri`, so the broker deletes it. A confirm that cannot
    /// be sent because the connection is down is dropped: the message is redelivered after the
    /// reconnection (at-least-once). Errors: [`ClientError::Disconnected`].
    pub async fn confirm(&self, uri: &str, guid: Bytes) -> Result<(), ClientError> {
        self.send(Command::Confirm {
            uri: shared_uri(uri),
            guid,
        })
        .await
    }

    /// Closes `uri`: no more reopening, and its consumer stops receiving. Unacknowledged PUTs
    /// to it fail with [`ClientError::NotOpen`] if a reconnection happens before their ack.
    /// Errors: [`ClientError::Refused`], [`ClientError::Timeout`],
    /// [`ClientError::Disconnected`].
    pub async fn close_queue(&self, uri: &str) -> Result<(), ClientError> {
        let (reply, response) = oneshot::channel();
        self.send(Command::Close {
            uri: uri.to_string(),
            reply,
        })
        .await?;
        match tokio::time::timeout(self.shared.request_timeout, response).await {
            Err(_) => Err(ClientError::Timeout {
                what: format!("close queue {uri}"),
            }),
            Ok(Err(_)) => Err(ClientError::Disconnected),
            Ok(Ok(result)) => result,
        }
    }

    /// Says goodbye to the broker and stops the background task. Unacknowledged PUTs complete
    /// with [`ClientError::Disconnected`]; every other handle becomes unusable.
    pub async fn disconnect(self) -> Result<(), ClientError> {
        let (reply, response) = oneshot::channel();
        self.send(Command::Disconnect { reply }).await?;
        match tokio::time::timeout(self.shared.request_timeout, response).await {
            Err(_) => Err(ClientError::Timeout {
                what: "disconnect".into(),
            }),
            // The task ended without answering: it is gone either way.
            Ok(Err(_)) => Ok(()),
            Ok(Ok(result)) => result,
        }
    }

    /// The broker (`host:port`) the client is connected to now, `None` while reconnecting.
    pub fn connected_broker(&self) -> Option<String> {
        self.shared
            .connected_broker
            .lock()
            .expect("connected_broker lock")
            .clone()
    }

    /// PUTs sent and not yet acknowledged.
    pub fn pending_puts(&self) -> usize {
        // The window was created with max_pending_puts permits; nobody adds any.
        let window = self.shared.put_window.available_permits();
        self.shared.max_pending_puts.saturating_sub(window)
    }

    async fn send(&self, command: Command) -> Result<(), ClientError> {
        self.commands
            .send(command)
            .await
            .map_err(|_| ClientError::Disconnected)
    }
}

/// Random GUID bytes drawn at once per thread: a GUID is a 16-byte slice of them, so a PUT
/// allocates no GUID of its own.
const GUID_SLAB_BYTES: usize = 4096;

/// Most queue URIs a thread keeps encoded for [`shared_uri`]; past it the cache starts over.
const URI_CACHE_MAX: usize = 256;

thread_local! {
    static GUID_SLAB: std::cell::RefCell<bytes::BytesMut> =
        std::cell::RefCell::new(bytes::BytesMut::new());
    static URI_CACHE: std::cell::RefCell<
        std::collections::HashMap<Box<str>, Bytes, foldhash::quality::RandomState>,
    > = std::cell::RefCell::new(std::collections::HashMap::default());
}

/// A new random 16-byte GUID (from the thread's random generator, as `rand::random` draws),
/// a slice of this thread's slab of random bytes: one allocation per 256 GUIDs instead of one
/// per PUT.
fn new_guid() -> Bytes {
    GUID_SLAB.with(|slab| {
        let mut slab = slab.borrow_mut();
        if slab.len() < 16 {
            let mut fresh = bytes::BytesMut::zeroed(GUID_SLAB_BYTES);
            rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut fresh);
            *slab = fresh;
        }
        slab.split_to(16).freeze()
    })
}

/// `uri` as the per-message frames carry it, shared: each thread keeps the queues it sent to
/// encoded once, so a PUT or CONFIRM costs a reference count, not an allocation and a copy.
fn shared_uri(uri: &str) -> Bytes {
    URI_CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(bytes) = cache.get(uri) {
            return bytes.clone();
        }
        if cache.len() >= URI_CACHE_MAX {
            cache.clear();
        }
        let bytes = uri_bytes(uri);
        cache.insert(uri.into(), bytes.clone());
        bytes
    })
}

/// Keeps the status code mapping in one place: a non-OK status as an error.
fn status_error(status: Option<bmq_proto::client::Status>) -> Result<(), ClientError> {
    let status = status.unwrap_or_default();
    match status.code() {
        StatusCode::Ok => Ok(()),
        code => Err(ClientError::Refused {
            code,
            message: status.message,
        }),
    }
}
