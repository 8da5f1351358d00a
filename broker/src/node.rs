//! The broker node: wires the actors and listeners together (DESIGN.md §3).
//!
//! Supervision tree (all in one actix `System`):
//! ```text
//! node::run
//!  ├─ PeerHub            dialers + listener of the peer CONTROL and DATA connections
//!  ├─ PeerTransport      actor: elector/metadata outbound messages -> PeerHub
//!  ├─ ElectorActor       the elector core (bmq_elector), term persisted in <data_dir>/elector
//!  ├─ MetadataActor      the metadata core + ledger (bmq_metadata), <data_dir>/ledger
//!  ├─ Bridge             actor: LeadershipChanged -> metadata; ClusterStateCommitted ->
//!  │                     the state watch channel and the partition actors
//!  ├─ HealthActor        on the active leader: failed primaries -> new primaries
//!  ├─ DataPlane          router between client sessions and PartitionActors
//!  ├─ client listener    one session task per client connection
//!  └─ admin HTTP         /metrics /status /healthz /readyz
//! ```
//! A failure to open the data directory, the term file or the ledger, or to bind a port, stops
//! the node at start with an error naming the path or address.
//!
//! Graceful stop (SIGTERM/SIGINT or `POST /admin/stop`): the node announces
//! `NodeStatusAdvisory { STOPPING }` to its peers (the leader's health actor then moves its
//! primaries away, lease + 1), cedes leadership (so the others elect at once instead of waiting
//! for missed heartbeats), waits until the committed state names it primary of no partition
//! — serving as a replica meanwhile, so the new primaries heal from it — or until
//! `limits.graceful_stop_timeout_ms`, then stops. Clients attached to it see a disconnect and
//! reconnect elsewhere; their unacknowledged PUTs are resent.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::{Actor, Addr, Context, Handler};
use anyhow::Context as _;
use bmq_elector::{
    CedeLeadership, Elector, ElectorActor, ElectorConfig, ElectorInbound, ElectorOutbound,
    LeadershipChanged, PeerAvailability, SubscribeLeadership, TermStore,
};
use bmq_metadata::{
    ClusterState, ClusterStateCommitted, FsyncPolicy, LeaderChanged, Ledger, MetadataActor,
    MetadataCore, MetadataInbound, MetadataOutbound, RequestQueueAssignment, SubscribeState,
};
use bmq_proto::peer::{peer_message::Kind, Channel, PeerMessage};
use bmq_proto::NodeId;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::admin::{install_metrics_recorder, start_admin_server, AdminContext};
use crate::config::{BrokerConfig, FsyncSetting};
use crate::dataplane::DataPlane;
use crate::health::{HealthActor, NodeStopping};
use crate::peers::{PeerHub, PeerHubConfig, PeerInbound};

/// Outbound queue capacity of each peer link, messages.
const PEER_OUTBOUND_CAPACITY: usize = 65_536;

/// Sends the elector's and the metadata actor's outbound messages over the CONTROL channel.
struct PeerTransport {
    hub: Arc<PeerHub>,
}

impl Actor for PeerTransport {
    type Context = Context<Self>;
}

impl Handler<ElectorOutbound> for PeerTransport {
    type Result = ();

    fn handle(&mut self, msg: ElectorOutbound, _ctx: &mut Self::Context) {
        let message = PeerMessage {
            kind: Some(Kind::Elector(msg.message)),
        };
        match msg.to {
            Some(to) => {
                self.hub.send(to, Channel::Control, message);
            }
            None => self.hub.broadcast(Channel::Control, message),
        }
    }
}

impl Handler<MetadataOutbound> for PeerTransport {
    type Result = ();

    fn handle(&mut self, msg: MetadataOutbound, _ctx: &mut Self::Context) {
        let message = PeerMessage {
            kind: Some(Kind::Metadata(msg.message)),
        };
        match msg.to {
            Some(to) => {
                self.hub.send(to, Channel::Control, message);
            }
            None => self.hub.broadcast(Channel::Control, message),
        }
    }
}

/// Relays state changes between actors (see the module doc).
struct Bridge {
    metadata: Addr<MetadataActor>,
    health: Addr<HealthActor>,
    router: Arc<DataPlane>,
    state_tx: watch::Sender<Arc<ClusterState>>,
}

impl Actor for Bridge {
    type Context = Context<Self>;
}

impl Handler<LeadershipChanged> for Bridge {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, _ctx: &mut Self::Context) {
        // Leadership changes are rare (bounded by the elector's timers), so do_send is fine.
        self.metadata.do_send(LeaderChanged {
            term: msg.status.term,
            leader: msg.status.leader,
        });
    }
}

impl Handler<ClusterStateCommitted> for Bridge {
    type Result = ();

    fn handle(&mut self, msg: ClusterStateCommitted, _ctx: &mut Self::Context) {
        self.router.sync_partitions(&msg.state);
        if !Arc::ptr_eq(&self.state_tx.borrow(), &msg.state) {
            self.state_tx.send_replace(msg.state.clone());
        }
        // Commits are rate-bounded by the metadata quorum round trips, so do_send is fine.
        self.health.do_send(msg);
    }
}

/// Routes peer frames to the actor that owns them. Set once the actors exist; frames that
/// arrive before are dropped (every protocol retries).
#[derive(Default)]
struct NodeInbound {
    elector: OnceLock<Addr<ElectorActor>>,
    metadata: OnceLock<Addr<MetadataActor>>,
    router: OnceLock<Arc<DataPlane>>,
    health: OnceLock<Addr<HealthActor>>,
}

impl PeerInbound for NodeInbound {
    fn on_message(&self, from: NodeId, channel: Channel, message: PeerMessage) {
        match (channel, message.kind) {
            (_, Some(Kind::Elector(m))) => {
                if let Some(e) = self.elector.get() {
                    if e.try_send(ElectorInbound { from, message: m }).is_err() {
                        metrics::counter!("bmq_mailbox_full_total", "actor" => "elector")
                            .increment(1);
                    }
                }
            }
            (_, Some(Kind::Metadata(m))) => {
                if let Some(bmq_proto::peer::metadata_message::Kind::NodeStatus(ns)) = &m.kind {
                    // Node status is the health actor's business (DESIGN.md §6).
                    if ns.node_id == from.0
                        && ns.status == bmq_proto::peer::NodeStatusKind::NodeStatusStopping as i32
                    {
                        if let Some(h) = self.health.get() {
                            if h.try_send(NodeStopping { node: from }).is_err() {
                                metrics::counter!("bmq_mailbox_full_total", "actor" => "health")
                                    .increment(1);
                            }
                        }
                    }
                    return;
                }
                if let Some(md) = self.metadata.get() {
                    if md.try_send(MetadataInbound { from, message: m }).is_err() {
                        metrics::counter!("bmq_mailbox_full_total", "actor" => "metadata")
                            .increment(1);
                    }
                }
            }
            (
                _,
                kind @ (Some(Kind::Forwarded(_))
                | Some(Kind::SessionGone(_))
                | Some(Kind::Partition(_))
                | Some(Kind::PrimaryActive(_))),
            ) => {
                if let Some(r) = self.router.get() {
                    r.handle_peer_data(from, PeerMessage { kind });
                }
            }
            _ => {
                metrics::counter!("bmq_peer_messages_invalid_total").increment(1);
            }
        }
    }

    fn on_availability(&self, peer: NodeId, available: bool) {
        if let Some(e) = self.elector.get() {
            if e.try_send(PeerAvailability { peer, available }).is_err() {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "elector").increment(1);
            }
        }
        if let Some(r) = self.router.get() {
            if available {
                r.handle_node_back(peer);
            } else {
                r.handle_node_gone(peer);
            }
        }
    }
}

/// Translates the `[elector]` settings into the elector core's configuration.
pub fn elector_config(config: &BrokerConfig) -> ElectorConfig {
    let e = &config.elector;
    let single = config.members.len() == 1;
    ElectorConfig {
        initial_wait: if single {
            Duration::ZERO
        } else {
            Duration::from_millis(e.initial_wait_ms)
        },
        random_wait_max: Duration::from_millis(e.random_wait_max_ms),
        scouting_result_timeout: Duration::from_millis(e.scouting_result_timeout_ms),
        election_result_timeout: Duration::from_millis(e.election_result_timeout_ms),
        heartbeat_period: Duration::from_millis(e.heartbeat_period_ms),
        heartbeat_check_period: Duration::from_millis(e.heartbeat_check_period_ms),
        heartbeat_miss_count: e.heartbeat_miss_count,
        quorum: e.quorum as usize,
    }
}

fn bind(addr: &str, what: &str) -> anyhow::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("cannot bind the {what} port {addr}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Runs the node until SIGTERM/SIGINT. Must be called inside an actix `System`.
pub async fn run(config: BrokerConfig) -> anyhow::Result<()> {
    config.validate().context("invalid configuration")?;
    let config = Arc::new(config);
    let self_id = NodeId(config.node_id);
    let me = config.self_member().clone();
    let metrics_handle =
        install_metrics_recorder().context("cannot install the metrics recorder")?;

    std::fs::create_dir_all(&config.data_dir).with_context(|| {
        format!(
            "cannot create the data directory {}",
            config.data_dir.display()
        )
    })?;
    let elector_dir = config.data_dir.join("elector");
    let ledger_dir = config.data_dir.join("ledger");
    std::fs::create_dir_all(&elector_dir)
        .with_context(|| format!("cannot create {}", elector_dir.display()))?;
    std::fs::create_dir_all(&ledger_dir)
        .with_context(|| format!("cannot create {}", ledger_dir.display()))?;

    // Bind every port first so a port clash fails fast with the address in the message.
    let [client_bind, peer_bind, admin_bind] = config.listen_addrs();
    let client_listener = bind(&client_bind, "client")?;
    let peer_listener = bind(&peer_bind, "peer")?;
    // The admin port binds to loopback unless `admin.listen_host` says otherwise (issue 10).
    let admin_bind = {
        let host = config.admin.bind_host(&me.host);
        let listen = crate::config::MemberConfig { host, ..me.clone() };
        let _ = admin_bind;
        listen.admin_addr()
    };
    let admin_listener = bind(&admin_bind, "admin")?;

    let (term_store, persisted_term) = TermStore::open(&elector_dir)
        .with_context(|| format!("cannot open the elector term in {}", elector_dir.display()))?;
    let fsync = match config.metadata.fsync {
        FsyncSetting::EveryRecord => FsyncPolicy::EveryRecord,
        FsyncSetting::Never => FsyncPolicy::Never,
    };
    let (mut ledger, recovered) = Ledger::open(&ledger_dir, fsync, config.partition_count)
        .with_context(|| format!("cannot open the ledger in {}", ledger_dir.display()))?;
    ledger.set_max_file_size(config.metadata.ledger_max_file_size_bytes);
    // The elector never starts below the term of the last ledger LSN (DESIGN.md §4 "Start").
    let start_term = persisted_term.max(recovered.last_lsn.term);
    info!(
        node = %self_id,
        term = %start_term,
        last_lsn = %recovered.last_lsn,
        committed_lsn = %recovered.committed_lsn,
        queues = recovered.committed_state.queues.len(),
        "node starting"
    );

    let tls = match &config.tls {
        Some(settings) => {
            Some(crate::tls::PeerTls::load(settings).context("cannot set up TLS from [tls]")?)
        }
        None => None,
    };
    let inbound = Arc::new(NodeInbound::default());
    let hub = PeerHub::start(
        PeerHubConfig {
            self_id,
            cluster_name: config.cluster_name.clone(),
            peers: config
                .peers()
                .map(|m| (NodeId(m.id), m.peer_addr()))
                .collect(),
            heartbeat_period: Duration::from_millis(config.link.heartbeat_period_ms),
            heartbeat_timeout: Duration::from_millis(config.link.heartbeat_timeout_ms),
            reconnect_backoff_min: Duration::from_millis(config.link.reconnect_backoff_min_ms),
            reconnect_backoff_max: Duration::from_millis(config.link.reconnect_backoff_max_ms),
            frame_size_max: config.limits.frame_size_max_bytes as usize,
            outbound_queue_capacity: PEER_OUTBOUND_CAPACITY,
            tls: tls.clone(),
        },
        inbound.clone(),
    );
    let transport = PeerTransport { hub: hub.clone() }.start();

    let members: Vec<NodeId> = config.members.iter().map(|m| NodeId(m.id)).collect();
    let initial_state = Arc::new(recovered.committed_state.clone());
    let metadata_core =
        MetadataCore::new(self_id, &members, config.elector.quorum as usize, recovered);
    let metadata = MetadataActor::new(metadata_core, ledger, transport.clone().recipient()).start();

    let peers: Vec<NodeId> = members.iter().copied().filter(|m| *m != self_id).collect();
    let seed = rand::random::<u64>();
    let elector_core = Elector::new(self_id, &peers, elector_config(&config), start_term, seed);
    let elector = ElectorActor::new(elector_core, term_store, transport.recipient()).start();

    let (state_tx, state_rx) = watch::channel(initial_state);
    let metadata_for_requests = metadata.clone();
    let router = DataPlane::new(
        config.clone(),
        hub.clone(),
        state_rx,
        Box::new(move |uri| {
            if metadata_for_requests
                .try_send(RequestQueueAssignment { uri })
                .is_err()
            {
                metrics::counter!("bmq_mailbox_full_total", "actor" => "metadata").increment(1);
            }
        }),
    );
    let health = HealthActor::new(self_id, metadata.clone(), hub.clone()).start();
    let _ = inbound.health.set(health.clone());
    let _ = router.primary_active_sink.set(health.clone().recipient());
    let bridge = Bridge {
        metadata: metadata.clone(),
        health: health.clone(),
        router: router.clone(),
        state_tx,
    }
    .start();
    let _ = inbound.elector.set(elector.clone());
    let _ = inbound.metadata.set(metadata.clone());
    let _ = inbound.router.set(router.clone());
    metadata
        .send(SubscribeState {
            subscriber: bridge.clone().recipient(),
        })
        .await?;
    elector
        .send(SubscribeLeadership {
            subscriber: bridge.recipient(),
        })
        .await?;

    let peer_listener = tokio::net::TcpListener::from_std(peer_listener)?;
    tokio::spawn(hub.clone().serve(peer_listener, inbound.clone()));
    let client_listener = tokio::net::TcpListener::from_std(client_listener)?;
    tokio::spawn(crate::session::serve_clients(
        client_listener,
        router.clone(),
        tls.as_ref().and_then(|t| t.client_acceptor.clone()),
    ));
    let admin_stop = Arc::new(tokio::sync::Notify::new());
    let admin = start_admin_server(
        admin_listener,
        AdminContext {
            node_id: self_id.0,
            cluster_name: config.cluster_name.clone(),
            elector: elector.clone(),
            metadata: metadata.clone(),
            peers: hub.clone(),
            router: router.clone(),
            metrics: metrics_handle.clone(),
            stop: admin_stop.clone(),
            admin_token: config.admin.token.clone(),
            auth: config.auth.clone(),
        },
    )?;
    let admin_handle = admin.handle();
    tokio::spawn(admin);
    let upkeep = metrics_handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    info!(
        node = %self_id,
        client = %me.client_addr(),
        peer = %me.peer_addr(),
        admin = %admin_bind,
        "node started"
    );

    tokio::select! {
        _ = wait_for_stop_signal() => {}
        _ = admin_stop.notified() => {}
    }
    graceful_stop(&config, &hub, &health, &elector, router.cluster.clone()).await;
    hub.stop();
    admin_handle.stop(false).await;
    info!(node = %self_id, "node stopped");
    Ok(())
}

/// Cedes leadership and primaries, then waits (bounded) until no partition names this node
/// primary (see the module doc).
async fn graceful_stop(
    config: &BrokerConfig,
    hub: &Arc<PeerHub>,
    health: &Addr<HealthActor>,
    elector: &Addr<ElectorActor>,
    mut cluster: watch::Receiver<Arc<ClusterState>>,
) {
    let self_id = NodeId(config.node_id);
    let timeout = Duration::from_millis(config.limits.graceful_stop_timeout_ms);
    info!(node = %self_id, ?timeout, "stopping: ceding leadership and primaries");
    let started = tokio::time::Instant::now();
    let _ = health.try_send(NodeStopping { node: self_id });
    let announce = || {
        for peer in config.peers() {
            let msg = PeerMessage {
                kind: Some(Kind::Metadata(bmq_proto::peer::MetadataMessage {
                    kind: Some(bmq_proto::peer::metadata_message::Kind::NodeStatus(
                        bmq_proto::peer::NodeStatusAdvisory {
                            node_id: self_id.0,
                            status: bmq_proto::peer::NodeStatusKind::NodeStatusStopping as i32,
                        },
                    )),
                })),
            };
            hub.send(NodeId(peer.id), Channel::Control, msg);
        }
    };
    announce();
    let _ = tokio::time::timeout(Duration::from_secs(1), elector.send(CedeLeadership)).await;
    let deadline = started + timeout;
    loop {
        let primaries = cluster
            .borrow_and_update()
            .partitions
            .values()
            .filter(|p| p.primary == Some(self_id))
            .count();
        if primaries == 0 {
            info!(node = %self_id, elapsed = ?started.elapsed(), "no partition left on this node: stopping");
            break;
        }
        if hub.peer_availability().iter().all(|(_, up)| !up) {
            warn!(node = %self_id, primaries, "no peer to hand primaries to: stopping");
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(node = %self_id, primaries, "graceful stop timeout: stopping with primaries still here");
            break;
        }
        // Announce again: the leader may have changed since (we just ceded).
        announce();
        let _ = tokio::time::timeout(Duration::from_millis(200), cluster.changed()).await;
    }
    // Give the cession and the last receipts a moment to leave the sockets.
    tokio::time::sleep(Duration::from_millis(200)).await;
}

async fn wait_for_stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            warn!("cannot install signal handlers; stopping only on ctrl-c");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
