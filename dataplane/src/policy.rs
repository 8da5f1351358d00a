//! A domain's settings as the data-plane cores use them, resolved once from the node's
//! configuration (DESIGN.md §7): delivery mode, consistency, queue limits. The node builds a
//! [`DomainPolicies`] table at start; a partition resolves a queue URI against it the first
//! time it sees the queue and keeps the result, so no URI is parsed per PUT.
//!
//! Also here: the answers every component gives to a request it cannot serve
//! ([`refusal`]), so that "not ready" and "overloaded" read the same wherever they are built.

use std::collections::HashMap;

use bmq_proto::client::{
    client_message::Kind, Ack, AckStatus, ClientMessage, OpenQueueResponse, Status, StatusCode,
};
use bmq_proto::uri::QueueUri;
use bmq_proto::PartitionId;

use crate::queue::QueueLimits;

/// How a domain's queues deliver (BlazingMQ's routing modes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryMode {
    /// Round-robin among the highest-priority consumers.
    Priority,
    /// Every app id gets its own copy of each message; each copy is delivered as in
    /// `Priority` among that app's consumers.
    Fanout {
        /// The domain's app ids (at least one).
        app_ids: Vec<String>,
    },
    /// Pushed to the consumers attached at PUT time and ACKed at once; nothing is stored
    /// (at-most-once).
    Broadcast,
}

/// The settings a partition needs of one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainPolicy {
    /// Delivery mode.
    pub mode: DeliveryMode,
    /// `true`: a PUT is ACKed once a quorum holds it (strong consistency); `false`: once the
    /// primary holds it (eventual).
    pub strong: bool,
    /// Limits of each of the domain's queues (each fanout app copy counts on its own).
    pub limits: QueueLimits,
}

impl DomainPolicy {
    /// The app ids a message of this domain is stored for: the fanout app ids, or the single
    /// unnamed app `""`.
    pub fn apps(&self) -> Vec<String> {
        match &self.mode {
            DeliveryMode::Fanout { app_ids } => app_ids.clone(),
            _ => vec![String::new()],
        }
    }
}

/// Every configured domain's policy, by domain name.
#[derive(Debug, Clone, Default)]
pub struct DomainPolicies {
    domains: HashMap<String, DomainPolicy>,
}

impl DomainPolicies {
    /// A table of `(domain name, policy)` pairs.
    pub fn new(domains: impl IntoIterator<Item = (String, DomainPolicy)>) -> Self {
        DomainPolicies {
            domains: domains.into_iter().collect(),
        }
    }

    /// The policy of a domain, if configured.
    pub fn domain(&self, name: &str) -> Option<&DomainPolicy> {
        self.domains.get(name)
    }

    /// The policy of the domain of queue `uri`; `None` for a malformed URI or an unknown
    /// domain.
    pub fn resolve(&self, uri: &str) -> Option<&DomainPolicy> {
        let parsed = QueueUri::parse(uri).ok()?;
        self.domains.get(&parsed.domain)
    }

    /// For the journal's index ([`crate::store::AppsOf`]): the app ids a queue's messages are
    /// stored for — its domain's fanout app ids, else `[""]` (also for a domain that is not
    /// configured, whose messages are kept, not dropped).
    pub fn apps_of(self: &std::sync::Arc<Self>) -> crate::store::AppsOf {
        let policies = self.clone();
        std::sync::Arc::new(move |uri: &str| {
            policies
                .resolve(uri)
                .map_or_else(|| vec![String::new()], DomainPolicy::apps)
        })
    }
}

/// Flow control given to a consumer that sets none (0 in its `ConsumerOptions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerDefaults {
    /// `limits.max_unconfirmed_messages_default`.
    pub max_unconfirmed_messages: u32,
    /// `limits.max_unconfirmed_bytes_default`, bytes.
    pub max_unconfirmed_bytes: u64,
}

/// The answer to a request that cannot be served here, so that the client's proxy retries
/// elsewhere or later: an OpenQueue gets an `OpenQueueResponse` with `code`, a PUT an ACK with
/// `NOT_READY` (or `LIMIT_REACHED` when `code` is `OVERLOADED`). Other requests get no answer
/// (`None`): a CONFIRM or CloseQueue that is lost is repeated or harmless.
pub fn refusal(
    message: &ClientMessage,
    code: StatusCode,
    reason: &str,
    partition: PartitionId,
) -> Option<ClientMessage> {
    let kind = match &message.kind {
        Some(Kind::OpenQueue(o)) => Kind::OpenQueueResponse(OpenQueueResponse {
            request_id: o.request_id,
            uri: o.uri.clone(),
            status: Some(Status {
                code: code as i32,
                message: reason.to_string(),
            }),
            partition_id: partition.0,
        }),
        Some(Kind::Put(p)) => Kind::Ack(Ack {
            uri: p.uri.clone(),
            guid: p.guid.clone(),
            status: if code == StatusCode::Overloaded {
                AckStatus::LimitReached as i32
            } else {
                AckStatus::NotReady as i32
            },
            message: reason.to_string(),
        }),
        _ => return None,
    };
    Some(ClientMessage { kind: Some(kind) })
}
