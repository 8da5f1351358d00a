//! Peer links: the TCP connections between broker nodes (DESIGN.md §3).
//!
//! Every node dials every peer twice, a CONTROL connection (elector, metadata, health) and a
//! DATA connection (forwarded client traffic), so a heartbeat never waits behind bulk data. A
//! dialed connection is used only to send; the peer's own dialed connection carries the other
//! direction. Each connection starts with a `PeerHello` naming the cluster, the sender and the
//! channel; the listener refuses an unknown cluster, an unknown member or another protocol
//! version before reading anything else.
//!
//! Liveness: the dialer sends a `LinkHeartbeat` every `link.heartbeat_period`; a peer is
//! *available* while our control connection to it is up and its control connection to us has
//! delivered a frame within `link.heartbeat_timeout`. An accepted connection (either channel)
//! that delivers nothing for `link.heartbeat_timeout` is closed (counted in
//! `bmq_peer_connection_timeouts_total`): its peer is hung, or dialed a new one after losing it
//! without a reset reaching us. Changes are reported through
//! [`PeerInbound::on_availability`]; a killed peer is noticed at once (the socket closes and the
//! monitor recomputes availability right then, not at its next tick), a paused one after the
//! timeout.
//!
//! The *data link* with a peer is up while the peer is available and both DATA connections
//! (ours to it, its to us) are open. Every DATA connection that closes ends the data link, even
//! when another one took its place already: what was queued on it or in flight is lost, and the
//! data plane above must learn it (a consumer's CONFIRM or a primary's PUSH gone with it would
//! otherwise leave a message held forever). A DATA message dropped because the link's queue
//! is full is a loss too, and the link returns only once that queue is at most half full: so
//! every DATA message either reaches the peer or the data link is reported lost. Changes are
//! reported through [`PeerInbound::on_data_link`], a loss always before the return that
//! follows it.
//!
//! Limits: each outbound link has a bounded queue; a message that does not fit is dropped and
//! counted (`bmq_peer_messages_dropped_total`) — every protocol above retries on its own timer,
//! and the data plane learns of a DATA drop as a data link loss (above).
//! A frame that is oversized or does not decode closes only that connection, logged and counted
//! (`bmq_peer_frame_errors_total`).
//!
//! Authentication: with `[tls]` configured, both channels are mutual TLS under the
//! cluster CA ([`crate::net::tls`]). The dialer verifies that the listener's certificate names
//! `node-<peer id>`; the listener requires a client certificate chaining to the CA and naming
//! `node-<id>` for the id its `PeerHello` claims. A failed handshake, a missing certificate or
//! a certificate naming another member closes the connection before any elector or metadata
//! message is read, logged (warn) with the remote address and counted in
//! `bmq_peer_auth_failures_total`. Without `[tls]` the links are plain TCP, as before.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bmq_metadata::ClusterMembership;
use bmq_proto::peer::{self, peer_message::Kind, Channel, LinkHeartbeat, PeerHello, PeerMessage};
use bmq_proto::{FrameCodec, FrameWriter, NodeId, PROTOCOL_VERSION};
use futures::{FutureExt, StreamExt};
use rand::Rng;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::FramedRead;
use tracing::{debug, info, warn};

use bmq_proto::{member_name, BoxedStream};

use crate::net::tls::{certificate_names, PeerTls};

/// How long a TLS handshake on a peer link may take.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most accepted peer connections still in their TLS handshake or before their Hello was
/// accepted; beyond that, new connections are closed at once and counted in
/// `bmq_peer_connections_refused_total` (a flood of idle connections cannot pile up tasks).
/// A real cluster needs at most 2 per peer at a time.
const PEER_UNAUTHENTICATED_MAX: usize = 64;

/// Settings of the peer links (from `[link]` and `[limits]` of the node configuration).
#[derive(Debug, Clone)]
pub struct PeerHubConfig {
    /// This node's id.
    pub self_id: NodeId,
    /// Cluster name; a peer announcing another one is refused.
    pub cluster_name: String,
    /// Every peer (not self) with its `host:port` peer address.
    pub peers: Vec<(NodeId, String)>,
    /// Interval between link heartbeats on each dialed connection.
    pub heartbeat_period: Duration,
    /// A peer whose control connection delivered nothing for this long is unavailable.
    pub heartbeat_timeout: Duration,
    /// First reconnect delay; doubles (with jitter) up to `reconnect_backoff_max`.
    pub reconnect_backoff_min: Duration,
    /// Largest reconnect delay.
    pub reconnect_backoff_max: Duration,
    /// Largest accepted frame body, bytes.
    pub frame_size_max: usize,
    /// Capacity of each outbound link's queue, messages.
    pub outbound_queue_capacity: usize,
    /// Mutual TLS of both channels; `None` = plain TCP (no `[tls]` section).
    pub tls: Option<PeerTls>,
}

/// Most frames a connection hands over as one batch (what one read brought in).
const INBOUND_BATCH_MAX: usize = 256;

/// Bytes an outbound link gathers before it must write them (it writes once per batch of
/// queued messages anyway): a batch of replicated records or forwarded messages is one write.
const WRITE_BATCH_BYTES: usize = 256 * 1024;

/// Receiver of what arrives from peers. Implementations must not block: they hand the messages
/// to actors' mailboxes (`try_send`) and return.
pub trait PeerInbound: Send + Sync + 'static {
    /// Frames (other than Hello and LinkHeartbeat) that arrived from `from` on `channel`, in
    /// order: every frame one read of the connection brought in (at most
    /// [`INBOUND_BATCH_MAX`]), so a receiver hands each actor one mailbox message per batch.
    fn on_messages(&self, from: NodeId, channel: Channel, messages: Vec<PeerMessage>);
    /// `peer` became available or unavailable (see the module doc).
    fn on_availability(&self, peer: NodeId, available: bool);
    /// The data link with `peer` came up (`true`) or was lost (`false`): see the module doc.
    /// A loss is reported even when the link is back by the time the monitor looks (then a
    /// loss and a return, in that order).
    fn on_data_link(&self, peer: NodeId, up: bool);
    /// `from`'s `PeerHello` carried a valid committed membership newer than this node's (see
    /// [`PeerHub::follow_membership`]); its members were added to the links already.
    fn on_membership(&self, _from: NodeId, _membership: &ClusterMembership) {}
}

#[derive(Debug, Default)]
struct LinkState {
    outbound_control_up: bool,
    inbound_control_open: u32,
    last_inbound_control: Option<Instant>,
    available: bool,
    outbound_data_up: bool,
    inbound_data_open: u32,
    /// A DATA connection with this peer closed since the monitor last looked.
    data_interrupted: bool,
    /// Interruptions of the data link so far (see [`PeerHub::data_generation`]).
    data_generation: u64,
    data_link_up: bool,
}

impl LinkState {
    /// A DATA connection closed or a DATA message was dropped: the monitor reports a data link
    /// loss (then a return), and senders that stamped the old generation hold their PUTs.
    fn interrupt_data(&mut self) {
        self.data_interrupted = true;
        self.data_generation += 1;
    }

    /// The data link's state as the monitor reports it (module doc).
    fn data_link_ready(&self) -> bool {
        self.available && self.outbound_data_up && self.inbound_data_open > 0
    }
}

/// One item of a link's outbound queue: a message, or several for one write.
#[derive(Debug)]
enum Outbound {
    One(PeerMessage),
    Many(Vec<PeerMessage>),
}

/// The node's peer links: outbound queues, dialers, and the liveness monitor.
pub struct PeerHub {
    config: PeerHubConfig,
    /// Every peer's queues, by `(peer, channel)`; peers join and leave with the committed
    /// membership ([`PeerHub::add_peer`], [`PeerHub::remove_peer`]).
    outbound: RwLock<HashMap<(NodeId, i32), mpsc::Sender<Outbound>>>,
    /// Every current peer with its peer address (`config.peers` at start).
    peers: RwLock<Vec<(NodeId, String)>>,
    /// Ids removed from the cluster: their connections are refused with that reason.
    removed: RwLock<BTreeSet<NodeId>>,
    /// This node's committed membership: sent in every `PeerHello`, and the epoch a peer's
    /// must exceed to be followed.
    membership: RwLock<Option<(u64, peer::Membership)>>,
    links: Mutex<HashMap<NodeId, LinkState>>,
    stopping: AtomicBool,
    /// Wakes the liveness monitor when a control connection opens or closes, so a killed peer's
    /// loss is reported at once instead of at the monitor's next tick (up to half a
    /// heartbeat period, 50 ms by default, on every failover).
    links_changed: tokio::sync::Notify,
    /// Permits for connections not yet authenticated ([`PEER_UNAUTHENTICATED_MAX`]).
    unauthenticated: Arc<tokio::sync::Semaphore>,
    /// Wakes the dialers waiting out a backoff when this node follows a newer membership: a
    /// joining node refused as unknown until its addition commits dials again at once then.
    redial: tokio::sync::Notify,
    /// Where what arrives goes (set by [`PeerHub::start`]): the dialers report a membership a
    /// refusing peer sent back (this node was removed) through it.
    inbound: std::sync::OnceLock<Arc<dyn PeerInbound>>,
}

/// The receiving ends of the outbound queues, handed to [`PeerHub::start`]. Messages queued
/// before the start wait there (bounded) until the links are up.
pub struct PendingLinks {
    receivers: Vec<(NodeId, String, Channel, mpsc::Receiver<Outbound>)>,
}

impl PeerHub {
    /// The hub with its outbound queues; nothing is dialed or accepted until
    /// [`PeerHub::start`]. Two steps, so that the actors the hub delivers to can be built with
    /// the hub (their outbound path) first.
    pub fn new(config: PeerHubConfig) -> (Arc<PeerHub>, PendingLinks) {
        let mut outbound = HashMap::new();
        let mut receivers = Vec::new();
        let mut links = HashMap::new();
        for (peer, addr) in &config.peers {
            links.insert(*peer, LinkState::default());
            for (channel, tx, rx) in peer_queues(*peer, config.outbound_queue_capacity) {
                outbound.insert((*peer, channel as i32), tx);
                receivers.push((*peer, addr.clone(), channel, rx));
            }
        }
        let peers = RwLock::new(config.peers.clone());
        let hub = Arc::new(PeerHub {
            config,
            outbound: RwLock::new(outbound),
            peers,
            removed: RwLock::new(BTreeSet::new()),
            membership: RwLock::new(None),
            links: Mutex::new(links),
            stopping: AtomicBool::new(false),
            links_changed: tokio::sync::Notify::new(),
            unauthenticated: Arc::new(tokio::sync::Semaphore::new(PEER_UNAUTHENTICATED_MAX)),
            redial: tokio::sync::Notify::new(),
            inbound: std::sync::OnceLock::new(),
        });
        (hub, PendingLinks { receivers })
    }

    /// Starts the dialers, the liveness monitor and the listener on the current tokio runtime;
    /// what arrives from peers goes to `inbound`.
    pub fn start(
        self: &Arc<Self>,
        pending: PendingLinks,
        listener: TcpListener,
        inbound: Arc<dyn PeerInbound>,
    ) {
        let _ = self.inbound.set(inbound.clone());
        for (peer, addr, channel, rx) in pending.receivers {
            tokio::spawn(dial_loop(self.clone(), peer, addr, channel, rx));
        }
        tokio::spawn(monitor_loop(self.clone(), inbound.clone()));
        tokio::spawn(self.clone().serve(listener, inbound));
    }

    /// Adds a peer that joined the committed membership and starts dialing it at `addr`
    /// (`host:peer_port`); its connections are accepted from now on. Returns false, changing
    /// nothing, for this node, a peer already known, or a removed id. Call it on the tokio
    /// runtime the hub was started on.
    pub fn add_peer(self: &Arc<Self>, peer: NodeId, addr: String) -> bool {
        if peer == self.config.self_id || self.is_removed(peer) {
            return false;
        }
        {
            let mut peers = self.peers.write().expect("peers lock");
            if peers.iter().any(|(id, _)| *id == peer) {
                return false;
            }
            peers.push((peer, addr.clone()));
        }
        self.links
            .lock()
            .expect("link state lock")
            .insert(peer, LinkState::default());
        let queues = peer_queues(peer, self.config.outbound_queue_capacity);
        let mut outbound = self.outbound.write().expect("outbound lock");
        for (channel, tx, rx) in queues {
            outbound.insert((peer, channel as i32), tx);
            tokio::spawn(dial_loop(self.clone(), peer, addr.clone(), channel, rx));
        }
        info!(peer = %peer, %addr, "peer added: the committed membership has it");
        true
    }

    /// Forgets a peer removed from the committed membership: its queues close (its dialers
    /// stop), it shows as unavailable, and its connections are refused from now on, with the
    /// reason. Returns false if it was removed already.
    pub fn remove_peer(&self, peer: NodeId) -> bool {
        if !self.removed.write().expect("removed lock").insert(peer) {
            return false;
        }
        self.peers
            .write()
            .expect("peers lock")
            .retain(|(id, _)| *id != peer);
        self.outbound
            .write()
            .expect("outbound lock")
            .retain(|(id, _), _| *id != peer);
        self.with_link(peer, |l| {
            l.outbound_control_up = false;
            l.outbound_data_up = false;
            l.interrupt_data();
        });
        self.links_changed.notify_one();
        info!(peer = %peer, "peer removed: the committed membership removed it");
        true
    }

    /// Follows a committed membership: sends it in the `PeerHello` of every connection this
    /// node dials from now on (a peer that missed changes learns the members from it) and
    /// dials its members. Its removed ids are the caller's to drop ([`PeerHub::remove_peer`]):
    /// at once, or once the commit of their removal went out.
    pub fn follow_membership(self: &Arc<Self>, membership: &ClusterMembership) {
        {
            let mut own = self.membership.write().expect("membership lock");
            if own
                .as_ref()
                .is_none_or(|(epoch, _)| *epoch < membership.epoch)
            {
                *own = Some((membership.epoch, membership.to_wire()));
                self.redial.notify_waiters();
            }
        }
        for m in membership.members.values() {
            self.add_peer(m.id, m.peer_addr());
        }
    }

    /// A peer's hello carried `wire`: if it is a valid membership newer than this node's,
    /// dial its members and report it (the node's elector and ledger follow it).
    fn learn_membership(
        self: &Arc<Self>,
        from: NodeId,
        wire: &peer::Membership,
        inbound: &Arc<dyn PeerInbound>,
    ) {
        let own = self
            .membership
            .read()
            .expect("membership lock")
            .as_ref()
            .map_or(0, |(epoch, _)| *epoch);
        if wire.epoch <= own {
            return;
        }
        let membership = match ClusterMembership::from_wire(wire) {
            Ok(m) => m,
            Err(error) => {
                metrics::counter!("bmq_peer_frame_errors_total").increment(1);
                warn!(peer = %from, %error, "invalid membership in a peer's hello ignored");
                return;
            }
        };
        self.follow_membership(&membership);
        for id in &membership.removed {
            if *id != self.config.self_id {
                self.remove_peer(*id);
            }
        }
        inbound.on_membership(from, &membership);
    }

    /// This node's `PeerHello` for a connection of `channel`, with its committed membership:
    /// the first frame of every connection it dials, and its answer to a removed node.
    fn hello(&self, channel: i32) -> PeerMessage {
        PeerMessage {
            kind: Some(Kind::Hello(PeerHello {
                cluster_name: self.config.cluster_name.clone(),
                node_id: self.config.self_id.0,
                channel,
                protocol_version: PROTOCOL_VERSION,
                membership: self
                    .membership
                    .read()
                    .expect("membership lock")
                    .as_ref()
                    .map(|(_, wire)| wire.clone()),
            })),
        }
    }

    /// Writes `reply` on a connection about to be refused (within a second; a failure is the
    /// dialer's to notice), so that the dialer learns why.
    async fn answer_refused(&self, mut stream: BoxedStream, reply: &PeerMessage) {
        let mut out = FrameWriter::new(self.config.frame_size_max, WRITE_BATCH_BYTES);
        let _ = tokio::time::timeout(Duration::from_secs(1), out.send(&mut stream, reply)).await;
    }

    /// Checks, before a node is added, that this node could link to it: its peer port at
    /// `addr` accepts a connection and, with TLS, completes a mutual handshake as this node's
    /// dialer would (its certificate chains to the cluster CA and names `node-<peer>`, and it
    /// accepts this node's certificate: a refusal of ours arrives as an alert right after the
    /// handshake, read for up to half a second). Sends nothing on the connection.
    ///
    /// Errors: what failed, in words (no answer, the TLS error).
    pub async fn probe_peer(&self, peer: NodeId, addr: &str) -> Result<(), String> {
        let tcp = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr))
            .await
            .map_err(|_| format!("its peer port {addr} does not answer within 3 s"))?
            .map_err(|e| format!("its peer port {addr} does not answer: {e}"))?;
        let Some(tls) = &self.config.tls else {
            return Ok(());
        };
        let name = rustls::pki_types::ServerName::try_from(member_name(peer))
            .expect("node-<id> is a valid DNS name");
        let mut stream =
            tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.peer_connector.connect(name, tcp))
                .await
                .map_err(|_| format!("the TLS handshake with {addr} timed out"))?
                .map_err(|e| {
                    format!(
                        "its peer port {addr} does not present a certificate of this cluster's \
                         CA naming {}: {e}",
                        member_name(peer)
                    )
                })?;
        let mut byte = [0u8; 1];
        match tokio::time::timeout(
            Duration::from_millis(500),
            tokio::io::AsyncReadExt::read(&mut stream, &mut byte),
        )
        .await
        {
            Ok(Err(e)) => Err(format!(
                "its peer port {addr} refuses this node's certificate (does it trust this \
                 cluster's CA?): {e}"
            )),
            Ok(Ok(0)) => Err(format!(
                "its peer port {addr} closed the connection after the TLS handshake (does it \
                 trust this cluster's CA?)"
            )),
            // Waiting for our hello (a timeout), or anything else: it accepted us.
            _ => Ok(()),
        }
    }

    /// Whether `peer` was removed from the cluster ([`PeerHub::remove_peer`]).
    pub fn is_removed(&self, peer: NodeId) -> bool {
        self.removed.read().expect("removed lock").contains(&peer)
    }

    /// Queues `message` for `to` on `channel`. Returns false (and counts the drop) when the
    /// peer is unknown, its link is down, or its queue is full.
    pub fn send(&self, to: NodeId, channel: Channel, message: PeerMessage) -> bool {
        self.enqueue(to, channel, Outbound::One(message), 1)
    }

    /// Queues `messages` for `to` on `channel` as one item: they are written together, in
    /// order. Returns false (and counts every message as dropped) as [`PeerHub::send`] does.
    pub fn send_many(&self, to: NodeId, channel: Channel, mut messages: Vec<PeerMessage>) -> bool {
        match messages.len() {
            0 => true,
            1 => self.send(to, channel, messages.pop().expect("one")),
            n => self.enqueue(to, channel, Outbound::Many(messages), n as u64),
        }
    }

    fn enqueue(&self, to: NodeId, channel: Channel, item: Outbound, count: u64) -> bool {
        // A clone, so that no lock is held below (the monitor takes this one before the
        // link states; `interrupt_data` takes the link states).
        let tx = self
            .outbound
            .read()
            .expect("outbound lock")
            .get(&(to, channel as i32))
            .cloned();
        let Some(tx) = tx else {
            debug!(peer = %to, "message for an unknown peer dropped");
            return false;
        };
        match tx.try_send(item) {
            Ok(()) => true,
            Err(e) => {
                metrics::counter!("bmq_peer_messages_dropped_total", "channel" => channel_label(channel))
                    .increment(count);
                if channel == Channel::Data && matches!(e, mpsc::error::TrySendError::Full(_)) {
                    // A forwarded request or a push is gone while the link stays up: the data
                    // plane must see a loss, as if the connection had dropped (module doc).
                    self.with_link(to, LinkState::interrupt_data);
                    self.links_changed.notify_one();
                }
                false
            }
        }
    }

    /// Queues `message` for every peer on `channel`.
    pub fn broadcast(&self, channel: Channel, message: PeerMessage) {
        let peers: Vec<NodeId> = self
            .peers
            .read()
            .expect("peers lock")
            .iter()
            .map(|(id, _)| *id)
            .collect();
        for peer in peers {
            self.send(peer, channel, message.clone());
        }
    }

    /// How many times the data link with `peer` was interrupted so far (a DATA connection
    /// closed, or a DATA message dropped on a full queue), counted the moment it happens —
    /// before the monitor reports the loss. A DATA message queued under an older generation
    /// may have been lost while later ones get through on a new connection: a client session
    /// stamps the generation it last synchronised with (at a data link's return) and holds its
    /// PUTs for the peer while the two differ, so a producer's PUTs never overtake the ones the
    /// interruption lost (they are all resent, in order, after the reopen). 0 for an unknown
    /// peer.
    pub fn data_generation(&self, peer: NodeId) -> u64 {
        self.links
            .lock()
            .expect("link state lock")
            .get(&peer)
            .map_or(0, |l| l.data_generation)
    }

    /// Whether `peer` is currently available (see the module doc).
    pub fn is_available(&self, peer: NodeId) -> bool {
        self.links
            .lock()
            .expect("link state lock")
            .get(&peer)
            .is_some_and(|l| l.available)
    }

    /// Every peer with its availability, in id order.
    pub fn peer_availability(&self) -> Vec<(NodeId, bool)> {
        let links = self.links.lock().expect("link state lock");
        let mut v: Vec<_> = links.iter().map(|(id, l)| (*id, l.available)).collect();
        v.sort();
        v
    }

    /// Stops dialing (graceful shutdown); existing connections close as their tasks notice.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    fn with_link(&self, peer: NodeId, f: impl FnOnce(&mut LinkState)) {
        if let Some(l) = self.links.lock().expect("link state lock").get_mut(&peer) {
            f(l);
        }
    }

    /// Accepts peer connections on `listener` until the process ends.
    async fn serve(self: Arc<Self>, listener: TcpListener, inbound: Arc<dyn PeerInbound>) {
        loop {
            match listener.accept().await {
                Ok((stream, remote)) => {
                    let Ok(permit) = self.unauthenticated.clone().try_acquire_owned() else {
                        self.refuse(
                            &remote.to_string(),
                            "too many connections still authenticating",
                        );
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let hub = self.clone();
                    let inbound = inbound.clone();
                    tokio::spawn(async move {
                        if let Err(reason) =
                            hub.clone().serve_connection(stream, inbound, permit).await
                        {
                            debug!(%remote, %reason, "peer connection closed");
                        }
                    });
                }
                Err(e) => {
                    warn!(error = %e, "peer listener accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn serve_connection(
        self: Arc<Self>,
        stream: TcpStream,
        inbound: Arc<dyn PeerInbound>,
        unauthenticated: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(), String> {
        let remote = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        // With TLS, the handshake verifies the chain to the cluster CA; the certificate is kept
        // to check, once the Hello names a member, that it is that member's.
        let (stream, peer_cert): (BoxedStream, _) = match &self.config.tls {
            None => (Box::new(stream), None),
            Some(tls) => {
                let accepted =
                    tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.peer_acceptor.accept(stream))
                        .await;
                let tls_stream = match accepted {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        return Err(self.auth_failure(&remote, &format!("TLS handshake: {e}")))
                    }
                    Err(_) => return Err(self.auth_failure(&remote, "TLS handshake timed out")),
                };
                let cert = tls_stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.clone().into_owned());
                let Some(cert) = cert else {
                    return Err(self.auth_failure(&remote, "no client certificate"));
                };
                (Box::new(tls_stream), Some(cert))
            }
        };
        let mut framed = FramedRead::new(
            ReadClock::new(stream),
            FrameCodec::<PeerMessage>::new(self.config.frame_size_max),
        );
        let first = tokio::time::timeout(Duration::from_secs(5), framed.next())
            .await
            .map_err(|_| "no hello within 5 s".to_string())?;
        let hello = match first {
            Some(Ok(PeerMessage {
                kind: Some(Kind::Hello(h)),
            })) => h,
            Some(Ok(_)) => return Err(self.refuse(&remote, "first frame is not a PeerHello")),
            Some(Err(e)) => return Err(self.refuse(&remote, &format!("bad first frame: {e}"))),
            None => return Err("closed before hello".into()),
        };
        let from = NodeId(hello.node_id);
        if hello.cluster_name != self.config.cluster_name {
            // Say which cluster this is (a hello without the membership), so that a node
            // joining the wrong one can tell its operator.
            let mut reply = self.hello(hello.channel);
            if let Some(Kind::Hello(h)) = reply.kind.as_mut() {
                h.membership = None;
            }
            self.answer_refused(framed.into_inner().inner, &reply).await;
            return Err(self.refuse(&remote, &format!("cluster name {:?}", hello.cluster_name)));
        }
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(self.refuse(
                &remote,
                &format!("protocol version {}", hello.protocol_version),
            ));
        }
        if let Some(cert) = &peer_cert {
            if !certificate_names(cert, &member_name(from)) {
                return Err(self.auth_failure(
                    &remote,
                    &format!(
                        "the certificate does not name {} (the member the hello claims)",
                        member_name(from)
                    ),
                ));
            }
        }
        // Only from an authenticated peer: the membership its hello carries decides whom this
        // node dials and follows.
        if let Some(wire) = &hello.membership {
            self.learn_membership(from, wire, &inbound);
        }
        let removed = self.is_removed(from);
        let known = self
            .peers
            .read()
            .expect("peers lock")
            .iter()
            .any(|(id, _)| *id == from);
        if removed || !known {
            // Tell it why before closing: a hello with this node's committed membership. A
            // removed node (dialed by no one, it may have missed the commit of its removal)
            // reads that it was removed and exits; a joining node learns the members to dial
            // while it waits to be added (`join`, crate::net::join).
            let reply = self.hello(hello.channel);
            self.answer_refused(framed.into_inner().inner, &reply).await;
            let reason = if removed {
                format!("node {from} was removed from the cluster")
            } else {
                format!("unknown member id {from}")
            };
            return Err(self.refuse(&remote, &reason));
        }
        drop(unauthenticated);
        let channel = Channel::try_from(hello.channel).unwrap_or(Channel::Control);
        let is_control = channel == Channel::Control;
        debug!(peer = %from, channel = channel_label(channel), "peer connection accepted");
        self.with_link(from, |l| {
            if is_control {
                l.inbound_control_open += 1;
                l.last_inbound_control = Some(Instant::now());
            } else {
                l.inbound_data_open += 1;
            }
        });
        self.links_changed.notify_one();
        let mut batch = Vec::new();
        let silence_max = self.config.heartbeat_timeout;
        let silence = tokio::time::sleep(silence_max);
        tokio::pin!(silence);
        let result = loop {
            // Wait for a frame, then take every frame already read (one batch per read). The
            // peer's dialer sends a heartbeat every `heartbeat_period` on both channels, so a
            // connection that brings no byte for `heartbeat_timeout` is hung, or dead without a
            // reset we would ever see (the peer dialed a new one): closed, so its task and
            // socket do not stay for ever. Bytes count, not frames (a large frame on a slow
            // network may take longer than that to arrive whole), and the connection has one
            // timer, moved only when it fires (a timer per wait was a registration in the
            // runtime's timer wheel per batch read).
            let first = tokio::select! {
                biased;
                // `FramedRead::next` is cancel-safe: a frame partly read stays in its buffer.
                frame = framed.next() => frame,
                () = &mut silence => {
                    let last_read = framed.get_ref().last_read;
                    if last_read.elapsed() < silence_max {
                        silence.as_mut().reset((last_read + silence_max).into());
                        continue;
                    }
                    metrics::counter!("bmq_peer_connection_timeouts_total").increment(1);
                    info!(peer = %from, channel = channel_label(channel), %remote, "peer connection silent for the heartbeat timeout; closed");
                    break Err(format!("nothing received for {silence_max:?}"));
                }
            };
            let mut next = Some(first);
            let mut end = None;
            while let Some(frame) = next.take() {
                match frame {
                    None => end = Some(Ok(())),
                    Some(Err(e)) if bmq_client::tls::is_unclean_close(&e) => end = Some(Ok(())),
                    Some(Err(e)) => {
                        metrics::counter!("bmq_peer_frame_errors_total").increment(1);
                        warn!(peer = %from, error = %e, "bad frame from peer; closing the connection");
                        end = Some(Err(e.to_string()));
                    }
                    Some(Ok(message)) => match message.kind {
                        Some(Kind::LinkHeartbeat(_)) => {}
                        Some(Kind::Hello(_)) | None => {
                            metrics::counter!("bmq_peer_frame_errors_total").increment(1);
                            debug!(peer = %from, "unexpected frame from peer dropped");
                        }
                        Some(_) => batch.push(message),
                    },
                }
                if end.is_none() && batch.len() < INBOUND_BATCH_MAX {
                    next = framed.next().now_or_never();
                }
            }
            if is_control {
                self.with_link(from, |l| l.last_inbound_control = Some(Instant::now()));
            }
            if self.is_removed(from) {
                info!(peer = %from, "connection of a removed node closed");
                break Err(format!("node {from} was removed from the cluster"));
            }
            if !batch.is_empty() {
                // The next batch starts at this one's size: a `PeerMessage` is 152 bytes, and a
                // batch grown from empty moved each of them through every doubling.
                let next = Vec::with_capacity(batch.len());
                inbound.on_messages(from, channel, std::mem::replace(&mut batch, next));
            }
            if let Some(end) = end {
                break end;
            }
        };
        self.with_link(from, |l| {
            if is_control {
                l.inbound_control_open = l.inbound_control_open.saturating_sub(1);
            } else {
                l.inbound_data_open = l.inbound_data_open.saturating_sub(1);
                l.interrupt_data();
            }
        });
        self.links_changed.notify_one();
        result
    }

    /// A connection that failed authentication: counted, logged with the remote address.
    fn auth_failure(&self, remote: &str, reason: &str) -> String {
        metrics::counter!("bmq_peer_auth_failures_total").increment(1);
        warn!(%remote, %reason, "peer connection failed authentication; closed");
        reason.to_string()
    }

    fn refuse(&self, remote: &str, reason: &str) -> String {
        metrics::counter!("bmq_peer_connections_refused_total").increment(1);
        warn!(%remote, %reason, "peer connection refused");
        reason.to_string()
    }
}

/// A reader that remembers when it last read a byte (an accepted peer connection silent for
/// the heartbeat timeout is closed: `PeerHub::serve_connection`).
struct ReadClock<S> {
    inner: S,
    last_read: Instant,
}

impl<S> ReadClock<S> {
    fn new(inner: S) -> Self {
        ReadClock {
            inner,
            last_read: Instant::now(),
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for ReadClock<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.last_read = Instant::now();
        }
        polled
    }
}

fn channel_label(channel: Channel) -> &'static str {
    match channel {
        Channel::Control => "control",
        Channel::Data => "data",
    }
}

/// A peer's two outbound queues (control, data), with its metric series created at 0 (so a
/// peer that never came up shows as down rather than as missing).
fn peer_queues(
    peer: NodeId,
    capacity: usize,
) -> Vec<(Channel, mpsc::Sender<Outbound>, mpsc::Receiver<Outbound>)> {
    metrics::gauge!("bmq_peer_available", "peer" => peer.to_string()).set(0.0);
    metrics::counter!("bmq_peer_data_link_losses_total", "peer" => peer.to_string()).increment(0);
    [Channel::Control, Channel::Data]
        .into_iter()
        .map(|channel| {
            let (tx, rx) = mpsc::channel(capacity);
            (channel, tx, rx)
        })
        .collect()
}

/// Dials `peer` on `channel` forever (until the hub stops), sending what its queue receives.
async fn dial_loop(
    hub: Arc<PeerHub>,
    peer: NodeId,
    addr: String,
    channel: Channel,
    mut rx: mpsc::Receiver<Outbound>,
) {
    let cfg = hub.config.clone();
    let mut backoff = cfg.reconnect_backoff_min;
    // Whether a connection of this loop was up before (and so may have lost what it held).
    let mut lost_one = false;
    while !hub.stopping.load(Ordering::SeqCst) && !hub.is_removed(peer) {
        let connected =
            tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(&addr)).await;
        let stream = match connected {
            Ok(Ok(s)) => s,
            _ => {
                // Messages queued while the link is down are stale by the time it is back: drop
                // them (every protocol above retries on its own timer).
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(with_jitter(backoff)).await;
                backoff = (backoff * 2).min(cfg.reconnect_backoff_max);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if channel == Channel::Data && lost_one {
            // What was queued while no DATA connection was up came after what the last one lost
            // (module doc): sent first on this one, it would overtake those, which the data
            // plane resends only once the loss is reported. Dropped, as on a failed dial.
            while rx.try_recv().is_ok() {}
        }
        let local = stream
            .local_addr()
            .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
        let stream: BoxedStream = match &cfg.tls {
            None => Box::new(stream),
            Some(tls) => {
                // The listener must prove it is the member we dialed: its certificate names
                // node-<peer>.
                let name = rustls::pki_types::ServerName::try_from(member_name(peer))
                    .expect("node-<id> is a valid DNS name");
                match tokio::time::timeout(
                    TLS_HANDSHAKE_TIMEOUT,
                    tls.peer_connector.connect(name, stream),
                )
                .await
                {
                    Ok(Ok(s)) => Box::new(s),
                    outcome => {
                        let reason = match outcome {
                            Ok(Err(e)) => e.to_string(),
                            _ => "timed out".to_string(),
                        };
                        metrics::counter!("bmq_peer_auth_failures_total").increment(1);
                        warn!(peer = %peer, %addr, %reason, "TLS handshake with peer failed");
                        while rx.try_recv().is_ok() {}
                        tokio::time::sleep(with_jitter(backoff)).await;
                        backoff = (backoff * 2).min(cfg.reconnect_backoff_max);
                        continue;
                    }
                }
            }
        };
        // Frames go out through a `FrameWriter` (vectored writes: replicated journal frames
        // and forwarded payloads are written from the buffers they arrived in, not copied),
        // once per batch of queued messages, or sooner past `WRITE_BATCH_BYTES`. The peer
        // never writes on a connection we dialed: the read half only tells when it closes.
        let (reader, mut writer) = tokio::io::split(stream);
        let mut closed =
            FramedRead::new(reader, FrameCodec::<PeerMessage>::new(cfg.frame_size_max));
        let mut out = FrameWriter::new(cfg.frame_size_max, WRITE_BATCH_BYTES);
        if out
            .send(&mut writer, &hub.hello(channel as i32))
            .await
            .is_err()
        {
            pause(&hub, backoff).await;
            backoff = (backoff * 2).min(cfg.reconnect_backoff_max);
            continue;
        }
        // The local address tells this connection from the other one to the same peer (the
        // chaos suite breaks one connection alone by it).
        info!(peer = %peer, channel = channel_label(channel), local = %local, "peer link up");
        hub.with_link(peer, |l| match channel {
            Channel::Control => l.outbound_control_up = true,
            Channel::Data => l.outbound_data_up = true,
        });
        lost_one = true;
        hub.links_changed.notify_one();
        let mut heartbeat = tokio::time::interval(cfg.heartbeat_period);
        let started = Instant::now();
        let outcome: Result<(), String> = loop {
            tokio::select! {
                item = rx.recv() => {
                    let Some(item) = item else { return };
                    // Batch whatever else is already queued into the same write.
                    let mut next = Some(item);
                    let mut batch = 0;
                    let mut failed = None;
                    while let Some(item) = next.take() {
                        if let Err(e) = feed(&mut out, &mut writer, item).await {
                            failed = Some(e);
                            break;
                        }
                        batch += 1;
                        if batch <= 1024 {
                            next = rx.try_recv().ok();
                        }
                    }
                    if let Some(e) = failed { break Err(e.to_string()); }
                    if let Err(e) = out.flush_to(&mut writer).await { break Err(e.to_string()); }
                }
                _ = heartbeat.tick() => {
                    let hb = PeerMessage { kind: Some(Kind::LinkHeartbeat(LinkHeartbeat {
                        sent_at_ms: started.elapsed().as_millis() as u64,
                    })) };
                    if let Err(e) = out.send(&mut writer, &hb).await { break Err(e.to_string()); }
                }
                // A read completing means the peer closed (or sent garbage); either way the
                // link is gone. A peer that refuses this node as removed sends a hello with
                // the membership that removed it first: followed, this node exits.
                frame = closed.next() => {
                    if let Some(Ok(PeerMessage { kind: Some(Kind::Hello(h)) })) = &frame {
                        if let (Some(wire), Some(inbound)) = (&h.membership, hub.inbound.get()) {
                            hub.learn_membership(peer, wire, inbound);
                        }
                    }
                    break Err("closed by peer".into());
                }
            }
            if hub.stopping.load(Ordering::SeqCst) {
                break Ok(());
            }
        };
        hub.with_link(peer, |l| match channel {
            Channel::Control => l.outbound_control_up = false,
            Channel::Data => {
                l.outbound_data_up = false;
                l.interrupt_data();
            }
        });
        hub.links_changed.notify_one();
        if let Err(reason) = outcome {
            info!(peer = %peer, channel = channel_label(channel), %reason, "peer link down");
        }
        if started.elapsed() < STABLE_LINK {
            // Refused or dropped at once (a joining node the members do not know yet, a node
            // that was removed, a peer that closes each connection): dial again only after the
            // backoff, not in a loop of connections.
            pause(&hub, backoff).await;
            backoff = (backoff * 2).min(cfg.reconnect_backoff_max);
        } else {
            backoff = cfg.reconnect_backoff_min;
        }
    }
}

/// `backoff` plus up to half of it at random (dialers of one node do not retry in step).
fn with_jitter(backoff: Duration) -> Duration {
    backoff
        + Duration::from_millis(rand::thread_rng().gen_range(0..=backoff.as_millis() as u64 / 2))
}

/// A link that lasted less than this was refused or dropped at once: the next dial waits for
/// the backoff.
const STABLE_LINK: Duration = Duration::from_secs(1);

/// Waits `backoff` plus up to half of it at random, or until this node follows a newer
/// membership (see [`PeerHub::redial`]).
async fn pause(hub: &PeerHub, backoff: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(with_jitter(backoff)) => {}
        _ = hub.redial.notified() => {}
    }
}

/// Adds an outbound item's messages to the connection's [`FrameWriter`] (written once a batch's
/// worth waits). Errors: a message over the frame size limit, or a failed write (the link is
/// dropped and dialed again).
async fn feed<W: tokio::io::AsyncWrite + Unpin>(
    out: &mut FrameWriter,
    writer: &mut W,
    item: Outbound,
) -> Result<(), bmq_proto::FrameError> {
    match item {
        Outbound::One(m) => out.feed_peer(writer, &m).await,
        Outbound::Many(ms) => {
            for m in &ms {
                out.feed_peer(writer, m).await?;
            }
            Ok(())
        }
    }
}

/// Recomputes every peer's availability and data link every half heartbeat period (a silent
/// peer's heartbeats age out) and whenever a connection opens or closes, and reports changes:
/// availability first, then the data link (a loss before the return that follows it).
async fn monitor_loop(hub: Arc<PeerHub>, inbound: Arc<dyn PeerInbound>) {
    let mut tick = tokio::time::interval(hub.config.heartbeat_period / 2);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = hub.links_changed.notified() => {}
        }
        let now = Instant::now();
        let mut changes = Vec::new();
        let mut data_changes = Vec::new();
        {
            // Lock order: the queues, then the link states.
            let outbound_queues = hub.outbound.read().expect("outbound lock");
            let mut links = hub.links.lock().expect("link state lock");
            let outbound = links.values().filter(|l| l.outbound_control_up).count();
            let inbound: u32 = links.values().map(|l| l.inbound_control_open).sum();
            metrics::gauge!("bmq_peer_connections", "direction" => "outbound").set(outbound as f64);
            metrics::gauge!("bmq_peer_connections", "direction" => "inbound")
                .set(f64::from(inbound));
            for (peer, l) in links.iter_mut() {
                let fresh = l
                    .last_inbound_control
                    .is_some_and(|t| now.duration_since(t) <= hub.config.heartbeat_timeout);
                let available = l.outbound_control_up && l.inbound_control_open > 0 && fresh;
                if available != l.available {
                    l.available = available;
                    changes.push((*peer, available));
                }
                if std::mem::take(&mut l.data_interrupted) && l.data_link_up {
                    l.data_link_up = false;
                    data_changes.push((*peer, false));
                }
                // After a drop, the link returns only once its queue has room again.
                let room = outbound_queues
                    .get(&(*peer, Channel::Data as i32))
                    .is_some_and(|tx| tx.capacity() * 2 >= tx.max_capacity());
                let ready = l.data_link_ready() && room;
                if ready != l.data_link_up {
                    l.data_link_up = ready;
                    data_changes.push((*peer, ready));
                }
            }
        }
        for (peer, available) in changes {
            info!(peer = %peer, available, "peer availability changed");
            metrics::gauge!("bmq_peer_available", "peer" => peer.to_string()).set(if available {
                1.0
            } else {
                0.0
            });
            inbound.on_availability(peer, available);
        }
        for (peer, up) in data_changes {
            info!(peer = %peer, up, "peer data link changed");
            if !up {
                metrics::counter!("bmq_peer_data_link_losses_total", "peer" => peer.to_string())
                    .increment(1);
            }
            inbound.on_data_link(peer, up);
        }
    }
}

#[cfg(test)]
#[path = "peers_tests.rs"]
mod tests;
