//! The background task behind a [`Client`](super::Client): owns the broker connection, the open
//! queues, the unacknowledged PUTs, and the reconnection loop.
//!
//! Receives [`Command`]s from the handles and frames from the broker; sends frames to the broker
//! and completes the handles' oneshot replies. Timers: the reconnection backoff and the retries
//! of refused reopens. Stops when every handle is dropped, on `Disconnect`, or after
//! `reconnect_timeout` without a connection.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bmq_proto::client::{
    client_message::Kind, Ack, ClientMessage, CloseQueue, Confirm, Disconnect, Hello, OpenQueue,
    Put, StatusCode,
};
use bmq_proto::{uri_str, uri_text, FrameCodec, FrameError, FrameWriter, UriBytes};
use bytes::Bytes;
use futures::StreamExt;
use rand::Rng;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tracing::{debug, info, warn};

use bmq_proto::BoxedStream;

use super::{status_error, ClientConfig, ClientError, Message, OpenOptions, Shared};

/// Commands handled per wake-up before the write buffer is flushed.
const COMMAND_BATCH_MAX: usize = 256;

/// Buffered bytes after which a write is flushed before the next frame is added.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;

/// A connection to a broker: frames read with the codec, written through a [`FrameWriter`]
/// (vectored writes: a PUT's payload is written from the application's buffer, not copied into
/// a write buffer).
struct Transport {
    read: FramedRead<ReadHalf<BoxedStream>, FrameCodec<ClientMessage>>,
    write: WriteHalf<BoxedStream>,
    out: FrameWriter,
}

impl Transport {
    fn new(stream: BoxedStream, frame_size_max: usize) -> Self {
        let (read, write) = tokio::io::split(stream);
        Transport {
            read: FramedRead::new(read, FrameCodec::new(frame_size_max)),
            write,
            out: FrameWriter::new(frame_size_max, WRITE_BUFFER_BYTES),
        }
    }

    /// The next frame from the broker (cancel-safe), `None` once the connection closed.
    async fn next(&mut self) -> Option<Result<ClientMessage, FrameError>> {
        self.read.next().await
    }

    /// Adds a frame to the write buffer, writing what it holds first when over
    /// [`WRITE_BUFFER_BYTES`]. Errors: the frame is over the size limit, or a write failed.
    async fn feed(&mut self, message: ClientMessage) -> Result<(), FrameError> {
        self.out.feed(&mut self.write, &message).await
    }

    /// Writes everything buffered. Errors: a write failed.
    async fn flush(&mut self) -> Result<(), FrameError> {
        Ok(self.out.flush_to(&mut self.write).await?)
    }

    /// Writes `message` and everything before it now.
    async fn send(&mut self, message: ClientMessage) -> Result<(), FrameError> {
        self.out.send(&mut self.write, &message).await
    }
}

/// Why a connection attempt failed.
struct ConnectFailure {
    message: String,
    /// The broker refused our credentials (`NOT_AUTHORIZED`): trying again or another broker
    /// of the same cluster gives the same answer.
    refused: Option<ClientError>,
}

impl From<String> for ConnectFailure {
    fn from(message: String) -> Self {
        ConnectFailure {
            message,
            refused: None,
        }
    }
}

/// A request from a [`Client`](super::Client) handle to the task.
#[derive(Debug)]
pub(super) enum Command {
    /// Open (or update) a queue; the reply carries the partition the broker named.
    Open {
        uri: String,
        options: OpenOptions,
        reply: oneshot::Sender<Result<u32, ClientError>>,
    },
    /// Send a PUT and keep it until its ack; `permit` is its slot in the PUT window.
    Put {
        put: Put,
        reply: oneshot::Sender<Result<Ack, ClientError>>,
        permit: OwnedSemaphorePermit,
    },
    /// Confirm a pushed message.
    Confirm { uri: UriBytes, guid: Bytes },
    /// Close a queue.
    Close {
        uri: String,
        reply: oneshot::Sender<Result<(), ClientError>>,
    },
    /// Say goodbye and stop.
    Disconnect {
        reply: oneshot::Sender<Result<(), ClientError>>,
    },
}

/// `d` scaled by a random factor in `[0.5, 1.0]`, so that clients do not reconnect in step.
pub(super) fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueState {
    /// To be opened as soon as a connection exists.
    Idle,
    /// OpenQueue sent, waiting for the response with this request id.
    Opening { request_id: u64 },
    /// Open on the current connection: PUTs flow.
    Open,
    /// A reopen was refused as not ready; a retry is scheduled.
    RetryScheduled,
    /// A reopen was refused for good; PUTs to it fail until the user opens it again.
    Failed,
}

#[derive(Debug)]
struct QueueEntry {
    options: OpenOptions,
    state: QueueState,
    /// The user's `open_queue` waiting for the response (its partition), if any.
    waiter: Option<oneshot::Sender<Result<u32, ClientError>>>,
    /// Whether the queue was open once: a failed first open forgets the queue, a failed reopen
    /// is retried.
    ever_opened: bool,
    reopen_backoff: Duration,
}

#[derive(Debug)]
struct PendingPut {
    /// Send order, to resend in the same order (order per producer is kept).
    sequence: u64,
    put: Put,
    reply: oneshot::Sender<Result<Ack, ClientError>>,
    _permit: OwnedSemaphorePermit,
}

/// The task's state (see the module doc).
pub(super) struct Connection {
    config: ClientConfig,
    shared: Arc<Shared>,
    messages: mpsc::UnboundedSender<Message>,
    transport: Option<Transport>,
    /// Index in `config.brokers` of the current (or last tried) broker.
    broker_index: usize,
    next_request_id: u64,
    queues: HashMap<String, QueueEntry>,
    open_requests: HashMap<u64, String>,
    close_requests: HashMap<u64, oneshot::Sender<Result<(), ClientError>>>,
    /// Keyed by GUID with foldhash (seeded at random per map), not std's SipHash: an insert per
    /// PUT and a removal per ACK, where a profile of `bmqctl bench messages` found SipHash's
    /// rounds and the removal among the client's largest costs.
    puts: HashMap<Bytes, PendingPut, foldhash::quality::RandomState>,
    next_put_sequence: u64,
    retry_tx: mpsc::UnboundedSender<String>,
    retry_rx: Option<mpsc::UnboundedReceiver<String>>,
    /// When the connection was lost; `None` while connected.
    disconnected_since: Option<Instant>,
    next_attempt: Instant,
    backoff: Duration,
}

/// Opens a TCP connection to `addr` (with TLS when `config.tls_ca_file` is set, verifying the
/// broker's certificate against that CA and the host of `addr`) and exchanges Hello (with
/// `config.token`) within `timeout`.
async fn connect_one(
    config: &ClientConfig,
    addr: &str,
    timeout: Duration,
) -> Result<Transport, ConnectFailure> {
    let attempt = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let stream: BoxedStream = match &config.tls_ca_file {
            None => Box::new(stream),
            Some(ca) => {
                let connector = crate::tls::client_connector(ca).map_err(|e| e.to_string())?;
                let name = crate::tls::server_name_of(addr)?;
                Box::new(
                    connector
                        .connect(name, stream)
                        .await
                        .map_err(|e| format!("TLS handshake with {addr}: {e}"))?,
                )
            }
        };
        // Small PUTs are batched into larger writes; the task flushes after each batch.
        let mut transport = Transport::new(stream, config.frame_size_max);
        let hello = Hello {
            client_id: config.client_id.clone(),
            protocol_version: bmq_proto::PROTOCOL_VERSION,
            token: config.token.clone().unwrap_or_default(),
        };
        transport
            .send(ClientMessage {
                kind: Some(Kind::Hello(hello)),
            })
            .await
            .map_err(|e| format!("send hello to {addr}: {e}"))?;
        match transport.next().await {
            Some(Ok(ClientMessage {
                kind: Some(Kind::HelloResponse(response)),
            })) => match status_error(response.status) {
                Ok(()) => {
                    info!(broker = addr, node = response.node_id, cluster = %response.cluster_name, "client connected");
                    Ok(transport)
                }
                Err(e) => {
                    let refused = matches!(
                        &e,
                        ClientError::Refused {
                            code: StatusCode::NotAuthorized,
                            ..
                        }
                    );
                    Err(ConnectFailure {
                        message: format!("{addr} refused hello: {e}"),
                        refused: refused.then_some(e),
                    })
                }
            },
            Some(Ok(other)) => Err(format!("{addr} answered hello with {other:?}").into()),
            Some(Err(e)) => Err(format!("{addr}: {e}{}", tls_hint(config)).into()),
            None => Err(format!(
                "{addr} closed the connection during hello{}",
                tls_hint(config)
            )
            .into()),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("{addr}: no hello response within {timeout:?}").into()),
    }
}

/// A hint for a Hello that failed on a plain connection: a TLS listener answers a plain Hello
/// with a TLS alert (which decodes as an oversized frame) or by closing.
fn tls_hint(config: &ClientConfig) -> &'static str {
    if config.tls_ca_file.is_none() {
        " (if the broker speaks TLS, give its CA: ClientConfig::tls_ca_file, bmqctl --tls-ca)"
    } else {
        ""
    }
}

impl Connection {
    /// Connects to the first broker that answers Hello, cycling through the list with backoff
    /// for up to `request_timeout`.
    pub(super) async fn establish(
        config: ClientConfig,
        shared: Arc<Shared>,
        messages: mpsc::UnboundedSender<Message>,
    ) -> Result<Connection, ClientError> {
        let deadline = Instant::now() + config.request_timeout;
        let mut backoff = config.reconnect_backoff_min;
        let mut last_error = String::new();
        let mut connected = None;
        'rounds: loop {
            for (index, addr) in config.brokers.iter().enumerate() {
                let remaining = deadline.saturating_duration_since(Instant::now());
                if remaining.is_zero() {
                    break 'rounds;
                }
                match connect_one(&config, addr, remaining).await {
                    Ok(transport) => {
                        connected = Some((index, transport));
                        break 'rounds;
                    }
                    Err(ConnectFailure {
                        refused: Some(refused),
                        ..
                    }) => return Err(refused),
                    Err(e) => {
                        debug!(error = %e.message, "broker did not answer");
                        last_error = e.message;
                    }
                }
            }
            let wake = Instant::now() + jitter(backoff);
            if wake >= deadline {
                break;
            }
            tokio::time::sleep_until(wake).await;
            backoff = (backoff * 2).min(config.reconnect_backoff_max);
        }
        let Some((broker_index, transport)) = connected else {
            return Err(ClientError::Connect {
                brokers: config.brokers.clone(),
                last_error,
            });
        };
        *shared.connected_broker.lock().expect("lock") = Some(config.brokers[broker_index].clone());
        let (retry_tx, retry_rx) = mpsc::unbounded_channel();
        Ok(Connection {
            backoff: config.reconnect_backoff_min,
            config,
            shared,
            messages,
            transport: Some(transport),
            broker_index,
            next_request_id: 1,
            queues: HashMap::new(),
            open_requests: HashMap::new(),
            close_requests: HashMap::new(),
            puts: HashMap::default(),
            next_put_sequence: 0,
            retry_tx,
            retry_rx: Some(retry_rx),
            disconnected_since: None,
            next_attempt: Instant::now(),
        })
    }

    /// The task's loop: until every handle is gone, `Disconnect`, or the reconnect timeout.
    pub(super) async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        let mut retries = self.retry_rx.take().expect("run is called once");
        loop {
            let stop = if let Some(transport) = self.transport.as_mut() {
                tokio::select! {
                    frame = transport.next() => {
                        match frame {
                            Some(Ok(message)) => self.handle_frame(message).await,
                            Some(Err(e)) => self.connection_lost(&format!("bad frame or socket error: {e}")),
                            None => self.connection_lost("closed by the broker"),
                        }
                        false
                    }
                    command = commands.recv() => self.handle_commands(command, &mut commands).await,
                    Some(uri) = retries.recv() => { self.handle_retry(&uri).await; false }
                }
            } else {
                if let (Some(limit), Some(since)) =
                    (self.config.reconnect_timeout, self.disconnected_since)
                {
                    if since.elapsed() >= limit {
                        warn!(
                            timeout = ?limit,
                            "client could not reconnect in time, giving up"
                        );
                        self.fail_all();
                        return;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(self.next_attempt) => { self.reconnect().await; false }
                    command = commands.recv() => self.handle_commands(command, &mut commands).await,
                    Some(uri) = retries.recv() => { self.handle_retry(&uri).await; false }
                }
            };
            if stop {
                return;
            }
            if let Some(transport) = self.transport.as_mut() {
                if let Err(e) = transport.flush().await {
                    self.connection_lost(&format!("write failed: {e}"));
                }
            }
        }
    }

    /// Handles `first` and up to a batch of already queued commands. Returns true to stop.
    async fn handle_commands(
        &mut self,
        first: Option<Command>,
        commands: &mut mpsc::Receiver<Command>,
    ) -> bool {
        let Some(first) = first else {
            // Every handle is gone.
            self.fail_all();
            return true;
        };
        if self.handle_command(first).await {
            return true;
        }
        for _ in 0..COMMAND_BATCH_MAX {
            match commands.try_recv() {
                Ok(command) => {
                    if self.handle_command(command).await {
                        return true;
                    }
                }
                Err(_) => break,
            }
        }
        false
    }

    /// Returns true to stop.
    async fn handle_command(&mut self, command: Command) -> bool {
        match command {
            Command::Open {
                uri,
                options,
                reply,
            } => {
                let min = self.config.reconnect_backoff_min;
                let entry = self.queues.entry(uri.clone()).or_insert(QueueEntry {
                    options: options.clone(),
                    state: QueueState::Idle,
                    waiter: None,
                    ever_opened: false,
                    reopen_backoff: min,
                });
                entry.options = options;
                if let Some(previous) = entry.waiter.replace(reply) {
                    let _ = previous.send(Err(ClientError::Refused {
                        code: StatusCode::Refused,
                        message: "superseded by a newer open of the same queue".into(),
                    }));
                }
                entry.state = QueueState::Idle;
                if self.transport.is_some() {
                    self.send_open(&uri).await;
                }
            }
            Command::Put { put, reply, permit } => {
                let not_open = |put: &Put| ClientError::NotOpen {
                    uri: uri_text(&put.uri).into_owned(),
                };
                let state = match uri_str(&put.uri).and_then(|uri| self.queues.get(uri)) {
                    Some(entry) if entry.options.write => entry.state,
                    _ => {
                        let _ = reply.send(Err(not_open(&put)));
                        return false;
                    }
                };
                if state == QueueState::Failed {
                    let _ = reply.send(Err(not_open(&put)));
                    return false;
                }
                let sequence = self.next_put_sequence;
                self.next_put_sequence += 1;
                if state == QueueState::Open {
                    self.feed(Kind::Put(put.clone())).await;
                }
                self.puts.insert(
                    put.guid.clone(),
                    PendingPut {
                        sequence,
                        put,
                        reply,
                        _permit: permit,
                    },
                );
            }
            Command::Confirm { uri, guid } => {
                // Without a connection the confirm is dropped: the broker redelivers.
                self.feed(Kind::Confirm(Confirm {
                    uri,
                    guid,
                    ..Default::default()
                }))
                .await;
            }
            Command::Close { uri, reply } => {
                if let Some(entry) = self.queues.remove(&uri) {
                    if let Some(waiter) = entry.waiter {
                        let _ = waiter.send(Err(ClientError::NotOpen { uri: uri.clone() }));
                    }
                }
                if self.transport.is_some() {
                    let request_id = self.request_id();
                    self.close_requests.insert(request_id, reply);
                    self.feed(Kind::CloseQueue(CloseQueue { request_id, uri }))
                        .await;
                } else {
                    // No session on any broker: the queue is closed there already.
                    let _ = reply.send(Ok(()));
                }
            }
            Command::Disconnect { reply } => {
                self.say_goodbye().await;
                self.fail_all();
                let _ = reply.send(Ok(()));
                return true;
            }
        }
        false
    }

    async fn handle_frame(&mut self, message: ClientMessage) {
        for kind in self.handle_frame_inner(message) {
            self.feed(kind).await;
        }
    }

    /// Applies one broker frame; returns the frames to send in response (resent PUTs).
    fn handle_frame_inner(&mut self, message: ClientMessage) -> Vec<Kind> {
        match message.kind {
            Some(Kind::Ack(ack)) => {
                if let Some(pending) = self.puts.remove(&ack.guid) {
                    let _ = pending.reply.send(Ok(ack));
                } else {
                    debug!(uri = %uri_text(&ack.uri), "ack for an unknown or already acked put");
                }
            }
            Some(Kind::Push(push)) => {
                // Unbounded, but the broker pushes at most max_unconfirmed_messages per consumer.
                let _ = self.messages.send(Message {
                    uri: uri_text(&push.uri).into_owned(),
                    guid: push.guid,
                    payload: push.payload,
                    properties: push.properties,
                    delivery_attempt: push.delivery_attempt,
                    out_of_order: push.out_of_order,
                });
            }
            Some(Kind::OpenQueueResponse(response)) => {
                return self.handle_open_response(
                    response.request_id,
                    response.status,
                    response.partition_id,
                );
            }
            Some(Kind::CloseQueueResponse(response)) => {
                if let Some(reply) = self.close_requests.remove(&response.request_id) {
                    let _ = reply.send(status_error(response.status));
                }
            }
            Some(Kind::Error(error)) => {
                let status = error.status.unwrap_or_default();
                warn!(code = ?status.code(), message = %status.message, "broker reported an error");
            }
            other => debug!(frame = ?other, "unexpected frame from the broker ignored"),
        }
        Vec::new()
    }

    fn handle_open_response(
        &mut self,
        request_id: u64,
        status: Option<bmq_proto::client::Status>,
        partition_id: u32,
    ) -> Vec<Kind> {
        let Some(uri) = self.open_requests.remove(&request_id) else {
            return Vec::new();
        };
        let Some(entry) = self.queues.get_mut(&uri) else {
            return Vec::new();
        };
        if entry.state != (QueueState::Opening { request_id }) {
            return Vec::new();
        }
        let status = status.unwrap_or_default();
        let code = status.code();
        if code == StatusCode::Ok {
            entry.state = QueueState::Open;
            entry.ever_opened = true;
            entry.reopen_backoff = self.config.reconnect_backoff_min;
            if let Some(waiter) = entry.waiter.take() {
                let _ = waiter.send(Ok(partition_id));
            }
            info!(uri = %uri, partition = partition_id, "queue open");
            return self.puts_of(&uri);
        }
        let refused = || ClientError::Refused {
            code,
            message: status.message.clone(),
        };
        if let Some(waiter) = entry.waiter.take() {
            let _ = waiter.send(Err(refused()));
        }
        if !entry.ever_opened {
            self.queues.remove(&uri);
            self.fail_puts_of(&uri, |_| ClientError::NotOpen { uri: uri.clone() });
        } else if refused().is_retriable() {
            entry.state = QueueState::RetryScheduled;
            let delay = jitter(entry.reopen_backoff);
            entry.reopen_backoff =
                (entry.reopen_backoff * 2).min(self.config.reconnect_backoff_max);
            debug!(uri = %uri, ?code, ?delay, "reopen refused, retrying");
            let retry_tx = self.retry_tx.clone();
            let uri = uri.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = retry_tx.send(uri);
            });
        } else {
            warn!(uri = %uri, ?code, message = %status.message, "reopen refused");
            entry.state = QueueState::Failed;
            self.fail_puts_of(&uri, |_| refused());
        }
        Vec::new()
    }

    async fn handle_retry(&mut self, uri: &str) {
        let Some(entry) = self.queues.get_mut(uri) else {
            return;
        };
        if entry.state != QueueState::RetryScheduled {
            return;
        }
        entry.state = QueueState::Idle;
        if self.transport.is_some() {
            self.send_open(uri).await;
        }
    }

    /// The unacknowledged PUTs of `uri`, in send order, as frames.
    fn puts_of(&self, uri: &str) -> Vec<Kind> {
        let mut puts: Vec<&PendingPut> = self
            .puts
            .values()
            .filter(|p| p.put.uri == uri.as_bytes())
            .collect();
        puts.sort_by_key(|p| p.sequence);
        if !puts.is_empty() {
            info!(uri = %uri, count = puts.len(), "resending unacknowledged puts");
        }
        puts.into_iter().map(|p| Kind::Put(p.put.clone())).collect()
    }

    fn fail_puts_of(&mut self, uri: &str, error: impl Fn(&Put) -> ClientError) {
        let guids: Vec<Bytes> = self
            .puts
            .values()
            .filter(|p| p.put.uri == uri.as_bytes())
            .map(|p| p.put.guid.clone())
            .collect();
        for guid in guids {
            let pending = self.puts.remove(&guid).expect("listed");
            let _ = pending.reply.send(Err(error(&pending.put)));
        }
    }

    fn request_id(&mut self) -> u64 {
        let id = self.next_request_id;
        self.next_request_id += 1;
        id
    }

    /// Marks `uri` opening under a new request id and returns the OpenQueue frame.
    fn open_frame(&mut self, uri: &str, request_id: u64) -> Kind {
        let entry = self.queues.get_mut(uri).expect("queue exists");
        entry.state = QueueState::Opening { request_id };
        self.open_requests.insert(request_id, uri.to_string());
        Kind::OpenQueue(OpenQueue {
            request_id,
            uri: uri.to_string(),
            read: entry.options.read,
            write: entry.options.write,
            consumer: Some(entry.options.consumer.clone()),
            ..Default::default()
        })
    }

    async fn send_open(&mut self, uri: &str) {
        let request_id = self.request_id();
        let kind = self.open_frame(uri, request_id);
        self.feed(kind).await;
    }

    /// Writes a frame into the connection's buffer (flushed after the batch); no-op without a
    /// connection.
    async fn feed(&mut self, kind: Kind) {
        let Some(transport) = self.transport.as_mut() else {
            return;
        };
        if let Err(e) = transport.feed(ClientMessage { kind: Some(kind) }).await {
            self.connection_lost(&format!("write failed: {e}"));
        }
    }

    fn connection_lost(&mut self, reason: &str) {
        if self.transport.take().is_none() {
            return;
        }
        let broker = &self.config.brokers[self.broker_index];
        warn!(broker = %broker, reason, "connection to broker lost, reconnecting");
        *self.shared.connected_broker.lock().expect("lock") = None;
        for entry in self.queues.values_mut() {
            if matches!(
                entry.state,
                QueueState::Opening { .. } | QueueState::Open | QueueState::RetryScheduled
            ) {
                entry.state = QueueState::Idle;
            }
        }
        self.open_requests.clear();
        // The broker session is gone, so are its queues: a pending close has succeeded.
        for (_, reply) in self.close_requests.drain() {
            let _ = reply.send(Ok(()));
        }
        self.disconnected_since = Some(Instant::now());
        self.backoff = self.shared.reconnect_backoff_min;
        self.next_attempt = Instant::now() + jitter(self.backoff);
    }

    /// One reconnection attempt to the next broker of the list.
    async fn reconnect(&mut self) {
        self.broker_index = (self.broker_index + 1) % self.config.brokers.len();
        let addr = self.config.brokers[self.broker_index].clone();
        match connect_one(&self.config, &addr, self.config.request_timeout).await {
            Ok(transport) => {
                self.transport = Some(transport);
                self.disconnected_since = None;
                *self.shared.connected_broker.lock().expect("lock") = Some(addr);
                // PUTs to queues closed meanwhile can no longer be sent.
                let orphans: Vec<Bytes> = self
                    .puts
                    .values()
                    .filter(|p| !uri_str(&p.put.uri).is_some_and(|u| self.queues.contains_key(u)))
                    .map(|p| p.put.guid.clone())
                    .collect();
                for guid in orphans {
                    let pending = self.puts.remove(&guid).expect("listed");
                    let _ = pending.reply.send(Err(ClientError::NotOpen {
                        uri: uri_text(&pending.put.uri).into_owned(),
                    }));
                }
                // Reopen every queue; its PUTs are resent once the broker confirms the open.
                let idle: Vec<String> = self
                    .queues
                    .iter()
                    .filter(|(_, e)| e.state == QueueState::Idle)
                    .map(|(uri, _)| uri.clone())
                    .collect();
                for uri in idle {
                    self.send_open(&uri).await;
                }
            }
            Err(e) => {
                debug!(error = %e.message, "reconnection attempt failed");
                self.next_attempt = Instant::now() + jitter(self.backoff);
                self.backoff = (self.backoff * 2).min(self.shared.reconnect_backoff_max);
            }
        }
    }

    /// Sends Disconnect and waits (up to `request_timeout`) for the response, still completing
    /// acks that arrive meanwhile.
    async fn say_goodbye(&mut self) {
        let Some(mut transport) = self.transport.take() else {
            return;
        };
        let goodbye = ClientMessage {
            kind: Some(Kind::Disconnect(Disconnect {})),
        };
        if transport.send(goodbye).await.is_err() {
            return;
        }
        let timeout = self.config.request_timeout;
        let wait = async {
            while let Some(Ok(message)) = transport.next().await {
                if matches!(message.kind, Some(Kind::DisconnectResponse(_))) {
                    break;
                }
                self.handle_frame_inner(message);
            }
        };
        let _ = tokio::time::timeout(timeout, wait).await;
        *self.shared.connected_broker.lock().expect("lock") = None;
    }

    /// Fails every pending request with `Disconnected` and closes the PUT window.
    fn fail_all(&mut self) {
        self.shared.put_window.close();
        for (_, pending) in self.puts.drain() {
            let _ = pending.reply.send(Err(ClientError::Disconnected));
        }
        for entry in self.queues.values_mut() {
            if let Some(waiter) = entry.waiter.take() {
                let _ = waiter.send(Err(ClientError::Disconnected));
            }
        }
        for (_, reply) in self.close_requests.drain() {
            let _ = reply.send(Err(ClientError::Disconnected));
        }
        *self.shared.connected_broker.lock().expect("lock") = None;
    }
}
