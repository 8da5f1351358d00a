//! The three systems behind one face: a [`Producer`] puts and hands back an ACK future, a
//! [`Consumer`] yields messages and acknowledges them, a [`MetaWriter`] makes one durable,
//! replicated metadata write. The workloads (`messages.rs`, `metadata.rs`, `failover.rs`) only
//! see these, so every system is driven and timed by the same code.
//!
//! - **bmq** (ours): `bmq-client`; a queue `bmq://<domain>/<name>` (domain `bmq.test` is strong
//!   consistency: ACK once a quorum holds the PUT on disk); a metadata write is the open of a
//!   queue nobody opened before, which waits for the leader to commit its
//!   `QueueAssignmentAdvisory` on a quorum.
//! - **nats**: `async-nats`; a JetStream stream with file storage, 3 replicas and work-queue
//!   retention (an acknowledged message is removed, as a confirmed one is from our queue); a
//!   publish waits for the stream leader's PubAck (sent once the stream's Raft group has the
//!   message on a quorum); a durable pull consumer with explicit acks (with many queues, a
//!   subject each and a consumer filtered on each: `messages.rs`).
//! - **etcd**: its gRPC gateway over HTTP/1.1 (`POST /v3/kv/put`, JSON, base64 key and value);
//!   a put answers once the Raft entry is committed on a quorum (each member fsyncs its WAL).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use async_nats::jetstream;
use base64::Engine;
use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bytes::Bytes;
use futures::stream::SelectAll;
use futures::StreamExt;
use serde::Deserialize;

/// Queue opens (ours) or consumer binds and creations (NATS) one client has in flight at once
/// when it opens many queues.
pub const OPENS_IN_FLIGHT: usize = 64;

/// Which system a probe drives.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    clap::ValueEnum,
    serde::Serialize,
    Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum System {
    /// Our cluster, through `bmq-client`.
    Bmq,
    /// NATS JetStream, through `async-nats`.
    Nats,
    /// etcd, through its JSON gateway.
    Etcd,
}

impl System {
    /// Lowercase name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            System::Bmq => "bmq",
            System::Nats => "nats",
            System::Etcd => "etcd",
        }
    }
}

/// A future that resolves when the system acknowledged one PUT (an error for a NACK, a timeout
/// or a lost connection).
pub type AckFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// `servers` rotated so that `first` (modulo the length) comes first: client `i` of a run
/// connects to node `i % N` and fails over to the next ones.
pub fn rotated(servers: &[String], first: usize) -> Vec<String> {
    let n = servers.len();
    (0..n).map(|k| servers[(first + k) % n].clone()).collect()
}

/// Connects a `bmq-client` to `brokers` (plain TCP, no token), at most `window` PUTs pending.
pub async fn bmq_connect(
    brokers: Vec<String>,
    window: usize,
    name: &str,
) -> anyhow::Result<Client> {
    let mut config = ClientConfig::new(brokers.clone());
    config.client_id = format!("peer-probe-{name}-{:08x}", rand::random::<u32>());
    config.max_pending_puts = window.max(1);
    Client::connect(config)
        .await
        .with_context(|| format!("cannot connect to {}", brokers.join(",")))
}

/// Connects to NATS at `servers` (`host:port`), trying them in the given order.
pub async fn nats_connect(servers: &[String]) -> anyhow::Result<async_nats::Client> {
    let addrs: Vec<async_nats::ServerAddr> = servers
        .iter()
        .map(|s| s.parse::<async_nats::ServerAddr>())
        .collect::<Result<_, _>>()
        .context("bad NATS server address")?;
    async_nats::ConnectOptions::new()
        .retain_servers_order()
        .connect(addrs)
        .await
        .with_context(|| format!("cannot connect to NATS at {}", servers.join(",")))
}

/// A JetStream context whose API requests and publish ACKs time out after `timeout`.
pub fn nats_js(client: async_nats::Client, timeout: Duration) -> jetstream::Context {
    jetstream::context::ContextBuilder::new()
        .timeout(timeout)
        .build(client)
}

/// Creates the stream `name` on subject `subject`: file storage, `replicas` replicas,
/// work-queue retention.
pub async fn nats_create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    replicas: usize,
) -> anyhow::Result<jetstream::stream::Stream> {
    js.create_stream(jetstream::stream::Config {
        name: name.to_string(),
        subjects: vec![subject.to_string()],
        storage: jetstream::stream::StorageType::File,
        num_replicas: replicas,
        retention: jetstream::stream::RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await
    .map_err(|e| anyhow!("cannot create stream {name}: {e}"))
}

/// The producer side of a message workload.
// One per connection, few per run: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Producer {
    /// Ours: a client with the queue open for writing.
    Bmq {
        /// The connection.
        client: Client,
        /// The queue.
        uri: String,
    },
    /// NATS: a JetStream context publishing to the stream's subject.
    Nats {
        /// The context (its connection inside).
        js: jetstream::Context,
        /// The stream's subject.
        subject: String,
    },
}

impl Producer {
    /// Hands one PUT to the client library; the returned future completes with its ACK.
    pub async fn put(&self, payload: Bytes) -> anyhow::Result<AckFuture> {
        let target = match self {
            Producer::Bmq { uri, .. } => uri,
            Producer::Nats { subject, .. } => subject,
        };
        self.put_to(target, payload).await
    }

    /// Like [`Producer::put`], to another queue (ours, a URI this client opened for writing)
    /// or subject (NATS) than the one the producer was made with.
    pub async fn put_to(&self, target: &str, payload: Bytes) -> anyhow::Result<AckFuture> {
        match self {
            Producer::Bmq { client, .. } => {
                let pending = client.put(target, payload, vec![]).await?;
                Ok(Box::pin(async move {
                    let ack = pending.await?;
                    match ack.status() {
                        AckStatus::Success => Ok(()),
                        status => bail!("NACK {}", status.as_str_name()),
                    }
                }))
            }
            Producer::Nats { js, .. } => {
                let pending = js
                    .publish(target.to_string(), payload)
                    .await
                    .map_err(|e| anyhow!("publish: {e}"))?;
                Ok(Box::pin(async move {
                    pending.await.map_err(|e| anyhow!("publish ack: {e}"))?;
                    Ok(())
                }))
            }
        }
    }

    /// Closes the connection (best effort).
    pub async fn close(self) {
        match self {
            Producer::Bmq { client, .. } => {
                let _ = client.disconnect().await;
            }
            Producer::Nats { js, .. } => {
                let _ = js.client().drain().await;
            }
        }
    }
}

/// One received message: its payload, whether it was delivered before, and what acknowledges it.
pub struct Received {
    /// The body.
    pub payload: Bytes,
    /// Delivered before (ours: `delivery_attempt > 1`; NATS: `delivered > 1`).
    pub redelivered: bool,
    /// Where it came from: ours, the queue's URI; NATS, the subject it was published to.
    pub queue: String,
    /// What names this message among all of a run's (ours: its 16-byte GUID; NATS: its
    /// stream sequence), to count deliveries of a message received before.
    pub id: u128,
    ack: Acker,
}

enum Acker {
    Bmq { uri: String, guid: Bytes },
    Nats(Box<jetstream::Message>),
}

/// The consumer side of a message workload.
// One per connection, few per run: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Consumer {
    /// Ours: a client with the queue open for reading.
    Bmq {
        /// The connection.
        client: Client,
    },
    /// NATS: the message streams of one or more durable pull consumers, merged.
    Nats {
        /// The connection (kept to drain it at the end).
        client: async_nats::Client,
        /// Messages pulled in batches by the client library, from every consumer bound.
        messages: SelectAll<jetstream::consumer::pull::Stream>,
    },
}

impl Consumer {
    /// Opens every one of `uris` for reading on one connection, each with at most
    /// `max_unconfirmed` delivered-but-unconfirmed messages; [`OPENS_IN_FLIGHT`] opens at a
    /// time.
    pub async fn bmq_queues(
        client: Client,
        uris: &[String],
        max_unconfirmed: u32,
    ) -> anyhow::Result<Consumer> {
        let options = ConsumerOptions {
            max_unconfirmed_messages: max_unconfirmed,
            ..Default::default()
        };
        let mut opens = futures::stream::iter(uris.iter().map(|uri| {
            let (client, options) = (&client, options.clone());
            async move {
                client
                    .open_queue(uri, OpenOptions::read(options))
                    .await
                    .with_context(|| format!("cannot open {uri} for reading"))
            }
        }))
        .buffer_unordered(OPENS_IN_FLIGHT);
        while let Some(r) = opens.next().await {
            r?;
        }
        drop(opens);
        Ok(Consumer::Bmq { client })
    }

    /// Binds to the durable pull consumers `durables` of `stream` (created by the caller) and
    /// starts pulling from each; [`OPENS_IN_FLIGHT`] binds at a time.
    pub async fn nats(
        client: async_nats::Client,
        timeout: Duration,
        stream: &str,
        durables: &[String],
    ) -> anyhow::Result<Consumer> {
        let js = nats_js(client.clone(), timeout);
        let binds = futures::stream::iter(durables.iter().map(|durable| {
            let js = &js;
            async move {
                let consumer: jetstream::consumer::PullConsumer = js
                    .get_consumer_from_stream(durable, stream)
                    .await
                    .map_err(|e| anyhow!("cannot bind consumer {durable}: {e}"))?;
                consumer
                    .messages()
                    .await
                    .map_err(|e| anyhow!("cannot pull from {durable}: {e}"))
            }
        }))
        .buffer_unordered(OPENS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await;
        let streams = binds.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Consumer::Nats {
            client,
            messages: futures::stream::select_all(streams),
        })
    }

    /// The next message, `None` when the stream ended.
    pub async fn next(&mut self) -> Option<anyhow::Result<Received>> {
        match self {
            Consumer::Bmq { client } => {
                let m = client.next_message().await?;
                Some(Ok(Received {
                    payload: m.payload,
                    redelivered: m.delivery_attempt > 1,
                    queue: m.uri.clone(),
                    id: m
                        .guid
                        .get(..16)
                        .and_then(|g| g.try_into().ok())
                        .map(u128::from_be_bytes)
                        .unwrap_or(0),
                    ack: Acker::Bmq {
                        uri: m.uri,
                        guid: m.guid,
                    },
                }))
            }
            Consumer::Nats { messages, .. } => match messages.next().await? {
                Ok(m) => {
                    let info = m.info().ok();
                    let redelivered = info.as_ref().is_some_and(|i| i.delivered > 1);
                    let id = info.map_or(0, |i| u128::from(i.stream_sequence));
                    Some(Ok(Received {
                        payload: m.payload.clone(),
                        redelivered,
                        queue: m.subject.to_string(),
                        id,
                        ack: Acker::Nats(Box::new(m)),
                    }))
                }
                Err(e) => Some(Err(anyhow!("pull: {e}"))),
            },
        }
    }

    /// Acknowledges (confirms) a received message. Neither system waits for an answer to it.
    pub async fn ack(&self, r: Received) -> anyhow::Result<()> {
        match (self, r.ack) {
            (Consumer::Bmq { client }, Acker::Bmq { uri, guid }) => {
                client.confirm(&uri, guid).await?;
            }
            (Consumer::Nats { .. }, Acker::Nats(m)) => {
                m.ack().await.map_err(|e| anyhow!("ack: {e}"))?;
            }
            _ => bail!("a message acknowledged through another system's consumer"),
        }
        Ok(())
    }

    /// Closes the connection (best effort).
    pub async fn close(self) {
        match self {
            Consumer::Bmq { client } => {
                let _ = client.disconnect().await;
            }
            Consumer::Nats { client, messages } => {
                drop(messages);
                let _ = client.drain().await;
            }
        }
    }
}

/// One writer of durable, replicated metadata.
pub enum MetaWriter {
    /// Ours: each write opens a queue nobody opened before (one committed assignment).
    Bmq {
        /// The connection.
        client: Client,
        /// Domain of the new queues.
        domain: String,
    },
    /// etcd: each write puts a fresh key through the JSON gateway.
    Etcd {
        /// An HTTP client bound to one member.
        http: reqwest::Client,
        /// `http://host:port` of that member.
        base: String,
    },
}

/// Value written with every etcd put: about the size of our queue assignment advisory.
const ETCD_VALUE: &[u8] = b"partition=0;queue_key=0123456789abcdef";

impl MetaWriter {
    /// An etcd writer talking to the member at `addr` (`host:port`), each request bounded by
    /// `timeout`.
    pub fn etcd(addr: &str, timeout: Duration) -> anyhow::Result<MetaWriter> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(4)
            .build()
            .context("http client")?;
        Ok(MetaWriter::Etcd {
            http,
            base: format!("http://{addr}"),
        })
    }

    /// Makes the write named `key` (unique per run and write).
    pub async fn write(&self, key: &str) -> anyhow::Result<()> {
        match self {
            MetaWriter::Bmq { client, domain } => {
                let uri = format!("bmq://{domain}/{key}");
                client
                    .open_queue(&uri, OpenOptions::write())
                    .await
                    .with_context(|| format!("open {uri}"))?;
                Ok(())
            }
            MetaWriter::Etcd { http, base } => {
                let b64 = base64::engine::general_purpose::STANDARD;
                let body = serde_json::json!({
                    "key": b64.encode(format!("/peer-probe/{key}")),
                    "value": b64.encode(ETCD_VALUE),
                });
                let response = http
                    .post(format!("{base}/v3/kv/put"))
                    .json(&body)
                    .send()
                    .await
                    .with_context(|| format!("put to {base}"))?;
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                if !status.is_success() || !text.contains("\"header\"") {
                    bail!("put to {base}: HTTP {status}: {text}");
                }
                Ok(())
            }
        }
    }

    /// Closes the connection (best effort).
    pub async fn close(self) {
        if let MetaWriter::Bmq { client, .. } = self {
            let _ = client.disconnect().await;
        }
    }
}

/// A `GET` (or `POST` with `body`) of `url` returning JSON, within `timeout`.
pub async fn http_json(
    http: &reqwest::Client,
    url: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let request = match body {
        Some(b) => http.post(url).json(b),
        None => http.get(url),
    };
    let response = request
        .timeout(timeout)
        .send()
        .await
        .with_context(|| url.to_string())?;
    if !response.status().is_success() {
        bail!("{url}: HTTP {}", response.status());
    }
    response
        .json()
        .await
        .with_context(|| format!("{url}: not JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_puts_the_chosen_node_first() {
        // Client i dials node i % N first, then the others in order.
        let s: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        assert_eq!(rotated(&s, 0), s);
        assert_eq!(rotated(&s, 1), ["b", "c", "a"].map(String::from).to_vec());
        assert_eq!(rotated(&s, 5), ["c", "a", "b"].map(String::from).to_vec());
    }
}
