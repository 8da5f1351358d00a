//! The router's registry of local client sessions: ids, inboxes, overflow, the end of a session
//! (its consumers released at every primary it used), and the settings sessions read.
//! Threads: sessions register and end on the main thread; inboxes are fed from the main
//! thread and from every partition thread, through a `DashMap` (sharded locks, held for a
//! look-up or an insert, never across a send that can wait: inbox sends are `try_send`).

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bmq_config::{BmqpSettings, BrokerConfig};
use bmq_proto::client::{ClientMessage, Status};
use bmq_proto::peer::{peer_message::Kind as PeerKind, Channel, PeerMessage, SessionGone};
use bmq_proto::{NodeId, PartitionId, SessionAddr};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::Router;
use crate::actors::partition::PartitionSessionGone;
use crate::auth::{ClientIdentity, LiveAuth};
use crate::domains::DomainCache;

/// What a session's inbox receives from the rest of the node.
#[derive(Debug)]
pub enum SessionEvent {
    /// Responses and deliveries from a primary (OpenQueueResponse, Ack, Push,
    /// CloseQueueResponse), in order: everything one turn of the primary had for the session.
    FromPrimary(Vec<ClientMessage>),
    /// The leader proposed a partition for a queue the session asked to open (not yet
    /// committed: `Proxy::handle_proposed`).
    OpenProposed {
        /// The client's request id.
        request_id: u64,
        /// The queue.
        uri: String,
        /// The proposed partition.
        partition: PartitionId,
    },
    /// A queue the session asked to open now has a partition (or not, on timeout).
    OpenResolved {
        /// The client's request id.
        request_id: u64,
        /// The queue.
        uri: String,
        /// The partition, or the status to answer the client with.
        outcome: Result<PartitionId, Status>,
    },
}

/// What client sessions (both listeners, their handshakes and the sessions' event loops) read
/// of the node configuration, taken from it once when the router is built: a session reads
/// these fields, never the whole configuration.
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// Most client sessions at once on this node; a connection beyond it is refused
    /// (`limits.client_sessions_max`).
    pub client_sessions_max: usize,
    /// Largest frame a client may send or be sent, in bytes (`limits.frame_size_max_bytes`).
    pub frame_size_max: usize,
    /// How long an open waits for its queue's assignment, and a write for a client that reads
    /// nothing (`limits.request_timeout_ms`).
    pub request_timeout: Duration,
    /// Most PUTs a session keeps unanswered for resending (`limits.retransmit_buffer_max`).
    pub retransmit_buffer_max: usize,
    /// How long a PUT's GUID is remembered against duplicates
    /// (`limits.duplicate_guid_window_ms`).
    pub duplicate_guid_window: Duration,
    /// The cluster's name, told to clients at their handshake.
    pub cluster_name: String,
    /// This node's host name (`[[members]] host`), told to BlazingMQ SDKs at negotiation.
    pub host_name: String,
    /// The client tokens in force (`[auth]`; a reload replaces them).
    pub auth: Arc<LiveAuth>,
    /// The bmqp listener's heartbeats and plaintext rule (`[bmqp]`).
    pub bmqp: BmqpSettings,
    /// The domains this node knows (committed, or the file's before the seed).
    domains: Arc<DomainCache>,
}

impl SessionSettings {
    /// The settings of `config`'s sessions.
    pub fn from_config(config: &BrokerConfig, domains: Arc<DomainCache>) -> SessionSettings {
        let limits = &config.limits;
        SessionSettings {
            client_sessions_max: limits.client_sessions_max as usize,
            frame_size_max: limits.frame_size_max_bytes as usize,
            request_timeout: limits.request_timeout(),
            retransmit_buffer_max: usize::try_from(limits.retransmit_buffer_max)
                .unwrap_or(usize::MAX),
            duplicate_guid_window: limits.duplicate_guid_window(),
            cluster_name: config.cluster_name.clone(),
            host_name: config.self_member().host.clone(),
            auth: Arc::new(LiveAuth::from_config(config)),
            bmqp: config.bmqp.clone(),
            domains,
        }
    }

    /// Whether a domain named `name` exists (as this node's domains say now).
    pub fn has_domain(&self, name: &str) -> bool {
        self.domains.has_domain(name)
    }
}

/// A local session's inbox as the router holds it ([`Router::to_local_session`]).
pub(super) struct SessionInbox {
    tx: mpsc::Sender<SessionEvent>,
    /// Cancelled when the inbox overflowed: the session ends at once.
    overflowed: CancellationToken,
    /// Who the session authenticated as, for [`Router::revoke_sessions`].
    identity: ClientIdentity,
    /// Set by [`Router::revoke_sessions`]: the session ends with `NOT_AUTHORIZED`.
    revoked: Revocation,
}

/// The end of a session whose token a reload removed or narrowed: set once, with the reason
/// the client is told (`NOT_AUTHORIZED`), and awaited by the session.
#[derive(Debug, Clone, Default)]
pub struct Revocation {
    signal: CancellationToken,
    reason: Arc<std::sync::OnceLock<String>>,
}

impl Revocation {
    /// Ends the session for `reason`; false if it was revoked already (the first reason
    /// stays).
    pub fn revoke(&self, reason: String) -> bool {
        let first = self.reason.set(reason).is_ok();
        self.signal.cancel();
        first
    }

    /// Waits until the session is revoked; returns the reason.
    pub async fn revoked(&self) -> String {
        self.signal.cancelled().await;
        self.reason.get().cloned().unwrap_or_default()
    }
}

/// What [`Router::register_session`] gives a new local session.
pub struct SessionRegistration {
    /// The session's id, unique on this node.
    pub id: u64,
    /// Answers and deliveries for the session, in order; bounded by `limits.mailbox_capacity`.
    pub inbox: mpsc::Receiver<SessionEvent>,
    /// Cancelled when an event found the inbox full: the event was dropped, so the session
    /// must end (its consumers released, their messages redelivered) rather than go on.
    pub overflowed: CancellationToken,
    /// What the session reads of the configuration ([`Router::session_settings`]).
    pub settings: Arc<SessionSettings>,
    /// Set when a reload removes or narrows the session's token ([`Router::revoke_sessions`]).
    pub revoked: Revocation,
}

impl Router {
    /// What client sessions read of the configuration, for the listeners and handshakes that
    /// run before a session is registered (a registered session gets it with its
    /// [`SessionRegistration`]).
    pub fn session_settings(&self) -> Arc<SessionSettings> {
        self.session_settings.clone()
    }

    /// Registers a new local session of a client that authenticated as `identity`: its id,
    /// its inbox, its overflow and revocation signals and its settings.
    pub fn register_session(&self, identity: &ClientIdentity) -> SessionRegistration {
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let (tx, inbox) = mpsc::channel(self.config.limits.mailbox_capacity());
        let overflowed = CancellationToken::new();
        let revoked = Revocation::default();
        let entry = SessionInbox {
            tx,
            overflowed: overflowed.clone(),
            identity: identity.clone(),
            revoked: revoked.clone(),
        };
        self.sessions.insert(id, entry);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        SessionRegistration {
            id,
            inbox,
            overflowed,
            settings: self.session_settings.clone(),
            revoked,
        }
    }

    /// Ends every local session for which `why` gives a reason (from its identity): each is
    /// told `NOT_AUTHORIZED` with the reason and closed, its consumers released as at any
    /// session end. Returns the sessions revoked now, with their token names (a session
    /// revoked before is not counted again).
    pub fn revoke_sessions(
        &self,
        why: impl Fn(&ClientIdentity) -> Option<String>,
    ) -> Vec<(u64, String)> {
        let mut revoked = Vec::new();
        for entry in self.sessions.iter() {
            if let Some(reason) = why(&entry.identity) {
                if entry.revoked.revoke(reason) {
                    revoked.push((*entry.key(), entry.identity.name().to_string()));
                }
            }
        }
        revoked
    }

    /// Removes a local session and tells every primary it used to release its consumers.
    pub fn unregister_session(&self, session_id: u64, primaries: impl IntoIterator<Item = NodeId>) {
        self.sessions.remove(&session_id);
        metrics::gauge!("bmq_client_sessions").set(self.sessions.len() as f64);
        let session = SessionAddr {
            origin_node: self.self_id,
            session_id,
        };
        let told: BTreeSet<NodeId> = primaries.into_iter().collect();
        for primary in told {
            if primary == self.self_id {
                // `do_send`: a release lost to a full mailbox would leave the session's
                // messages held by it for ever; one per session end and partition, so bounded
                // by the rate of client disconnections.
                self.each_partition(|addr| addr.do_send(PartitionSessionGone { session }));
            } else {
                let msg = PeerMessage {
                    kind: Some(PeerKind::SessionGone(SessionGone {
                        origin_node_id: self.self_id.0,
                        session_id,
                    })),
                };
                self.peers.send(primary, Channel::Data, msg);
            }
        }
    }

    /// Number of local client sessions.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Delivers `event` to a local session's inbox. Returns false when the session is gone or
    /// its inbox is full.
    ///
    /// A full inbox means the session fell `limits.mailbox_capacity` events behind (its client
    /// reads too slowly). The event is dropped and counted, and the session is *closed*: it is
    /// removed from the router (no further event reaches it) and its overflow signal ends it
    /// at once ([`SessionRegistration::overflowed`]). Ending it releases its consumers at
    /// their primaries, so a PUSH dropped here is redelivered, to another consumer or to the
    /// same client once it reconnects; going on instead would leave that message held by a
    /// consumer that never got it for as long as the session lives. A dropped ACK or open
    /// answer is covered anyway (the proxy resends PUTs and opens it has no answer for).
    pub fn to_local_session(&self, session_id: u64, event: SessionEvent) -> bool {
        let Some(tx) = self.sessions.get(&session_id).map(|s| s.tx.clone()) else {
            return false;
        };
        match tx.try_send(event) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(_)) => {
                metrics::counter!("bmq_session_inbox_dropped_total").increment(1);
                if let Some((_, inbox)) = self.sessions.remove(&session_id) {
                    inbox.overflowed.cancel();
                    metrics::counter!("bmq_session_inbox_overflows_total").increment(1);
                    warn!(
                        session = session_id,
                        capacity = self.config.limits.mailbox_capacity,
                        "session inbox full: closing the session, its consumers' messages go to others"
                    );
                }
                false
            }
        }
    }
}
