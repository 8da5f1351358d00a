//! The broker node: opens its storage, binds its ports, starts its actors, serves until a stop
//! signal, then stops gracefully (DESIGN.md §3). [`run`] is those five steps.
//!
//! Supervision tree and threads (all in one actix `System`):
//! ```text
//! node::run                                           thread
//!  ├─ PeerHub        dialers, listener, link heartbeats   main (System)
//!  ├─ ControlSender  elector/metadata -> CONTROL channel  main
//!  ├─ ElectorActor   the elector core, term file          own arbiter (SCHED_OTHER)
//!  ├─ MetadataActor  the metadata core + ledger writes     main; fsyncs and ledger rewrites
//!  │                                                      on its bmq-ledger-sync thread
//!  ├─ CommitFanout   leadership -> metadata; commits ->   main
//!  │                 router, state watch, health
//!  ├─ HealthActor    on the active leader: failed         main
//!  │                 primaries -> new primaries
//!  ├─ Router         sessions <-> partitions              main (called from every thread)
//!  │   └─ PartitionActor per partition (journal)       one arbiter each
//!  ├─ client sessions, one task per connection          main
//!  └─ admin HTTP     /metrics /status /healthz /readyz    main
//! ```
//! No fsync runs on the main thread: the ledger's run on its sync thread (and a rollover's or
//! reset's new file is written there), a journal batch's on its partition's sync thread, a
//! term's on the elector's thread (only when the term changes, never while leading). The main
//! thread, which carries the link heartbeats, the forwarding of elector heartbeats, the
//! metadata actor and every client session, never waits for a disk.
//!
//! A failure to open the data directory, the term file or the ledger, or to bind a port, stops
//! the node at start with an error naming the path or address.
//!
//! Graceful stop (SIGTERM/SIGINT or `POST /admin/stop`, DESIGN.md §7):
//! 1. the elector retires: a leader cedes at once and the node never stands again, so the
//!    others elect a node that is not stopping; the node announces
//!    `NodeStatusAdvisory { STOPPING }`, and the leader's health actor never picks it as a
//!    primary and moves its primaries to nodes that are up and not stopping (lease + 1);
//! 2. drain: its partitions push nothing new, and its consumers get up to
//!    `limits.graceful_stop_drain_ms` to confirm what they hold (it ends as soon as nothing is
//!    unconfirmed);
//! 3. it waits until the committed state names it primary of no partition — serving as a
//!    replica meanwhile, so the new primaries heal from it — or until every peer is stopping or
//!    gone (nobody to hand over to: stop at once), bounded in all by
//!    `limits.graceful_stop_timeout_ms` from the signal;
//! 4. it exits. Clients attached to it see a disconnect and reconnect elsewhere; their
//!    unacknowledged PUTs are resent. Messages redelivered because of a stop do not count as a
//!    delivery attempt.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, Addr};
use anyhow::Context as _;
use bmq_config::{BrokerConfig, FsyncSetting};
use bmq_dataplane::DomainPolicies;
use bmq_elector::{Elector, ElectorConfig, TermStore};
use bmq_metadata::{
    ClusterMembership, ClusterState, FsyncPolicy, Ledger, Member, MemberRole, MembershipError,
    MetadataCore, Recovered,
};
use bmq_proto::peer::{
    metadata_message, peer_message::Kind, Channel, LearnerProgress, MetadataMessage,
    NodeStatusAdvisory, NodeStatusKind, PeerMessage,
};
use bmq_proto::{NodeId, Term};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::actors::elector::{ElectorActor, Retire, SubscribeLeadership};
use crate::actors::health::{GetStoppingPeers, HealthActor, NodeStopping};
use crate::actors::metadata::{MetadataActor, SubscribeProposals, SubscribeState};
use crate::admin::{install_metrics_recorder, start_admin_server, AdminContext};
use crate::net::peers::{PeerHub, PeerHubConfig};
use crate::net::tls::PeerTls;
use crate::router::{Router, RouterParts};
use crate::wiring::{elector_membership, CommitFanout, ControlSender, PeerDemux};

/// Translates the `[elector]` settings into the elector core's configuration. The quorum is
/// the configured one: 0 (the default) is a majority of the voters, as committed once the
/// ledger holds a membership.
pub fn elector_config(config: &BrokerConfig) -> ElectorConfig {
    let e = &config.elector;
    let single = config.members.len() == 1;
    ElectorConfig {
        initial_wait: if single {
            Duration::ZERO
        } else {
            e.initial_wait()
        },
        random_wait_max: e.random_wait_max(),
        scouting_result_timeout: e.scouting_result_timeout(),
        election_result_timeout: e.election_result_timeout(),
        heartbeat_period: e.heartbeat_period(),
        heartbeat_check_period: e.heartbeat_check_period(),
        heartbeat_miss_count: e.heartbeat_miss_count,
        quorum: config.elector.quorum as usize,
    }
}

/// How the file's `[[members]]` differ from the committed membership (ids and addresses; roles
/// are the ledger's), or `None` if they agree. The ledger wins: the file only seeds the first
/// start, and a node whose file disagrees says so in its log and in `/status`.
///
/// A node that joined (`join` set) lists itself alone, not a seed: it never disagrees.
pub fn file_disagreement(config: &BrokerConfig, membership: &ClusterMembership) -> Option<String> {
    if !config.join.is_empty() {
        return None;
    }
    let seed = match file_membership(config) {
        Ok(seed) => seed,
        Err(error) => {
            return Some(format!(
                "the file's members cannot form a membership: {error}"
            ))
        }
    };
    let mut differences = Vec::new();
    for id in seed.ids().union(&membership.ids()) {
        match (seed.members.get(id), membership.members.get(id)) {
            (Some(_), None) if membership.removed.contains(id) => {
                differences.push(format!("node {id} was removed"))
            }
            (Some(_), None) => differences.push(format!("node {id} is not a member")),
            (None, Some(_)) => differences.push(format!("node {id} is not in the file")),
            (Some(a), Some(b)) if !a.same_place(b) => {
                differences.push(format!("node {id} has other addresses in the file"))
            }
            (Some(_), Some(_)) => {}
            (None, None) => {}
        }
    }
    if differences.is_empty() {
        None
    } else {
        Some(format!(
            "{} (epoch {}; the committed membership is used)",
            differences.join(", "),
            membership.epoch
        ))
    }
}

/// The cluster's first membership, from the file's `[[members]]` (every one a voter, epoch 1):
/// what the first leader writes into the ledger. `None` (logged) if the members cannot form
/// one (more voters than [`bmq_metadata::MAX_VOTERS`]): the cluster then keeps its static
/// membership.
///
/// `None` for a node that joins a running cluster (`join` set): it never seeds one of its own.
pub fn seed_membership(config: &BrokerConfig) -> Option<ClusterMembership> {
    if !config.join.is_empty() {
        return None;
    }
    match file_membership(config) {
        Ok(seed) => Some(seed),
        Err(error) => {
            warn!(%error, "the configured members cannot seed a membership; it stays static");
            None
        }
    }
}

/// The file's `[[members]]` as a membership (every one a voter, epoch 1).
fn file_membership(config: &BrokerConfig) -> Result<ClusterMembership, MembershipError> {
    let members = config.members.iter().map(|m| Member {
        id: NodeId(m.id),
        host: m.host.clone(),
        peer_port: m.peer_port,
        client_port: m.client_port,
        admin_port: m.admin_port,
        bmqp_port: m.bmqp_port,
        role: MemberRole::Voter,
    });
    ClusterMembership::seed(members)
}

/// The domains of the configuration as the data-plane cores use them.
pub fn domain_policies(config: &BrokerConfig) -> DomainPolicies {
    crate::domains::policies_of(config.domains.iter())
}

fn bind(addr: &str, what: &str) -> anyhow::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("cannot bind the {what} port {addr}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// What the node recovered from its data directory.
struct Storage {
    term_store: TermStore,
    ledger: Ledger,
    recovered: Recovered,
    start_term: Term,
}

/// Creates the data directory and opens the term file and the ledger.
fn open_storage(config: &BrokerConfig) -> anyhow::Result<Storage> {
    let data_dir = &config.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create the data directory {}", data_dir.display()))?;
    let elector_dir = data_dir.join("elector");
    let ledger_dir = data_dir.join("ledger");
    for dir in [&elector_dir, &ledger_dir] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
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
    Ok(Storage {
        term_store,
        ledger,
        recovered,
        start_term,
    })
}

/// The listeners, bound before anything starts so a port clash fails fast.
struct Listeners {
    client: std::net::TcpListener,
    peer: std::net::TcpListener,
    admin: std::net::TcpListener,
    admin_addr: String,
    /// BlazingMQ SDK clients (`bmqp_port`), when configured.
    bmqp: Option<std::net::TcpListener>,
}

fn bind_listeners(config: &BrokerConfig) -> anyhow::Result<Listeners> {
    let [client_addr, peer_addr, _] = config.listen_addrs();
    // The admin port binds to loopback unless `admin.listen_host` says otherwise.
    let me = config.self_member();
    let admin_addr = bmq_config::MemberConfig {
        host: config.admin.bind_host(&me.host),
        ..me.clone()
    }
    .admin_addr();
    Ok(Listeners {
        client: bind(&client_addr, "client")?,
        peer: bind(&peer_addr, "peer")?,
        admin: bind(&admin_addr, "admin")?,
        admin_addr,
        bmqp: match config.bmqp_listen_addr() {
            Some(addr) => Some(bind(&addr, "bmqp")?),
            None => None,
        },
    })
}

/// The running actors and shared handles of a node.
struct Actors {
    hub: Arc<PeerHub>,
    elector: Addr<ElectorActor>,
    metadata: Addr<MetadataActor>,
    health: Addr<HealthActor>,
    router: Arc<Router>,
    cluster: watch::Receiver<Arc<ClusterState>>,
}

/// Builds and starts every actor, in dependency order: the peer hub's queues, the metadata
/// actor (main thread, with its ledger sync thread), the elector (its own thread), the health
/// actor, the router, the commit fan-out;
/// then starts the peer links with a demultiplexer that knows them all.
async fn start_actors(
    config: &Arc<BrokerConfig>,
    storage: Storage,
    peer_listener: std::net::TcpListener,
    tls: Option<PeerTls>,
    removed: Arc<tokio::sync::Notify>,
) -> anyhow::Result<Actors> {
    let self_id = NodeId(config.node_id);
    let mailbox = config.limits.mailbox_capacity();
    let (hub, pending_links) = PeerHub::new(PeerHubConfig {
        self_id,
        cluster_name: config.cluster_name.clone(),
        peers: config
            .peers()
            .map(|m| (NodeId(m.id), m.peer_addr()))
            .collect(),
        heartbeat_period: config.link.heartbeat_period(),
        heartbeat_timeout: config.link.heartbeat_timeout(),
        reconnect_backoff_min: config.link.reconnect_backoff_min(),
        reconnect_backoff_max: config.link.reconnect_backoff_max(),
        frame_size_max: config.limits.frame_size_max_bytes as usize,
        outbound_queue_capacity: mailbox,
        tls,
    });
    let control = ControlSender { hub: hub.clone() }.start();

    let members: Vec<NodeId> = config.members.iter().map(|m| NodeId(m.id)).collect();
    let initial_state = Arc::new(storage.recovered.committed_state.clone());
    // The configured quorum: 0 is a majority of the committed voters.
    let mut metadata_core = MetadataCore::new(
        self_id,
        &members,
        config.elector.quorum as usize,
        storage.recovered,
    );
    if let Some(seed) = seed_membership(config) {
        metadata_core.set_seed_membership(seed);
    }
    if config.join.is_empty() {
        // A joining node takes the cluster's domains; it seeds none of its own.
        metadata_core.set_seed_domains(config.domains.clone());
    }
    let (ledger, transport) = (storage.ledger, control.clone().recipient());
    // On the main thread, beside the peer links: a proposal goes out to the followers, and a
    // follower's ack comes back, without a hand-off between threads; the ledger's
    // fsyncs run on the actor's own sync thread.
    let metadata = MetadataActor::new(metadata_core, ledger, transport).start();

    let peers: Vec<NodeId> = members.iter().copied().filter(|m| *m != self_id).collect();
    let seed = rand::random::<u64>();
    let mut elector_core = Elector::new(
        self_id,
        &peers,
        elector_config(config),
        storage.start_term,
        seed,
    );
    if let Some(membership) = &initial_state.membership {
        // The membership the ledger holds wins over the file's members.
        if let Some(difference) = file_disagreement(config, membership) {
            warn!(%difference, "the configured [[members]] differ from the committed membership");
        }
        elector_core.set_membership(Instant::now(), elector_membership(membership));
    } else if !config.join.is_empty() {
        // A joining node never stands before a committed membership makes it a voter: the
        // members it learned (or none) and no voter, until its ledger or a peer's hello tells
        // it the committed membership (a higher epoch).
        elector_core.set_membership(
            Instant::now(),
            bmq_elector::Membership {
                epoch: 0,
                members: peers.iter().copied().collect(),
                voters: Default::default(),
            },
        );
    }
    let (term_store, transport) = (storage.term_store, control.recipient());
    let elector_thread = actix::Arbiter::new();
    // Its timers decide failover: never delayed behind a busy thread's slice (crate::scheduling).
    elector_thread.spawn_fn(crate::scheduling::keep_normal_on_this_thread);
    let elector = ElectorActor::start_in_arbiter(&elector_thread.handle(), move |_| {
        ElectorActor::new(elector_core, term_store, transport)
    });

    let health = HealthActor::new(
        self_id,
        metadata.clone(),
        hub.clone(),
        mailbox,
        members.iter().copied().collect(),
    )
    .start();
    let (state_tx, cluster) = watch::channel(initial_state.clone());
    let router = Router::new(RouterParts {
        config: config.clone(),
        peers: hub.clone(),
        cluster: cluster.clone(),
        domains: crate::domains::DomainCache::new(config, &initial_state),
        primary_active: health.clone().recipient(),
        assignments: metadata.clone().recipient(),
        // The configured quorum: 0 is a majority of each lease's replicas.
        quorum: config.elector.quorum as usize,
    });
    let fanout = CommitFanout {
        metadata: metadata.clone(),
        health: health.clone(),
        router: router.clone(),
        state_tx,
        elector: elector.clone(),
        peers: hub.clone(),
        self_id,
        removed: removed.clone(),
    }
    .start();
    metadata
        .send(SubscribeState {
            subscriber: fanout.clone().recipient(),
        })
        .await?;
    metadata
        .send(SubscribeProposals {
            watcher: router.clone(),
        })
        .await?;
    elector
        .send(SubscribeLeadership {
            subscriber: fanout.recipient(),
        })
        .await?;
    let demux = Arc::new(PeerDemux {
        elector: elector.clone(),
        metadata: metadata.clone(),
        health: health.clone(),
        router: router.clone(),
        self_id,
        removed: removed.clone(),
    });
    if let Some(membership) = &initial_state.membership {
        // The ledger's members, not only the file's: a member added at run time is dialed
        // after a restart too, and a removed one is not.
        hub.follow_membership(membership);
        for id in &membership.removed {
            hub.remove_peer(*id);
        }
        // And its learners: a primary elected after this restart streams to them (only a
        // later change would tell them otherwise, and a learner waits for every partition).
        router.set_partition_learners(crate::wiring::learners_of(membership));
        if membership.role(self_id) == Some(bmq_metadata::MemberRole::Leaving) {
            // Restarted while leaving: it votes but never leads again (see the wiring).
            elector.do_send(Retire);
        }
    }
    hub.start(
        pending_links,
        tokio::net::TcpListener::from_std(peer_listener)?,
        demux,
    );
    Ok(Actors {
        hub,
        elector,
        metadata,
        health,
        router,
        cluster,
    })
}

/// Period of the main thread's lag probe ([`probe_main_thread_lag`]).
const LAG_PROBE_PERIOD: Duration = Duration::from_millis(10);

/// Measures how late the main thread runs a timer (`bmq_main_thread_lag_seconds`): a task on
/// it sleeps [`LAG_PROBE_PERIOD`] again and again and records how much later than asked it
/// woke (tokio's timer resolution is 1 ms: up to ~1 ms is the timer, not the thread).
/// Everything on the main thread — client sessions, peer links, the router — waits behind
/// what makes this lag, so a stall there shows as a high p99.9 here, as a partition's does in
/// `bmq_partition_turn_seconds`.
async fn probe_main_thread_lag() {
    let histogram = metrics::histogram!("bmq_main_thread_lag_seconds");
    loop {
        let asked = Instant::now();
        tokio::time::sleep(LAG_PROBE_PERIOD).await;
        let late = asked.elapsed().saturating_sub(LAG_PROBE_PERIOD);
        histogram.record(late.as_secs_f64());
    }
}

/// A joining node's members: itself as its file describes it, and every member of the
/// committed `membership` it learned (crate::net::join), whom it dials and hears from.
fn adopt_members(config: &mut BrokerConfig, membership: &ClusterMembership) {
    let me = config.self_member().clone();
    let self_id = me.id;
    config.members = membership
        .members
        .values()
        .filter(|m| m.id.0 != self_id)
        .map(|m| bmq_config::MemberConfig {
            id: m.id.0,
            host: m.host.clone(),
            client_port: m.client_port,
            peer_port: m.peer_port,
            admin_port: m.admin_port,
            bmqp_port: m.bmqp_port,
        })
        .chain(std::iter::once(me))
        .collect();
    config.members.sort_by_key(|m| m.id);
}

/// How often a learner reports its catch-up ([`report_learner_progress`]): its promotion waits
/// for the first report that shows every journal followed, so the period adds to the time a
/// member takes to be added (a learner is one for a moment; the reports are small).
const LEARNER_PROGRESS_PERIOD: Duration = Duration::from_millis(50);

/// While this node is a learner of the committed membership (otherwise it waits for the next
/// commit), tells every other member how far it has caught up, every
/// [`LEARNER_PROGRESS_PERIOD`]: the membership epoch it applied (it
/// holds the ledger up to that commit) and how many partitions' primaries have synchronised
/// its journal ([`Router::journals_following`]). The active leader promotes it once it follows
/// every partition (`MetadataConfig::promote_after_journals`); every node shows the report in
/// `/status`. A lost report is replaced by the next one; a new committed state (the learner's
/// own addition among them) is reported at once.
async fn report_learner_progress(router: Arc<Router>, hub: Arc<PeerHub>) {
    let self_id = router.self_id();
    let mut cluster = router.cluster();
    let mut tick = tokio::time::interval(LEARNER_PROGRESS_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None;
    loop {
        let state = cluster.borrow_and_update().clone();
        let membership = state
            .membership
            .as_ref()
            .filter(|m| m.role(self_id) == Some(MemberRole::Learner));
        let Some(membership) = membership else {
            // Not a learner: nothing to report until the next commit.
            last = None;
            if cluster.changed().await.is_err() {
                return;
            }
            continue;
        };
        let (following, partitions) = router
            .journals_following(&state, Duration::from_secs(1))
            .await;
        let report = (membership.epoch, following, partitions);
        if last != Some(report) {
            if following >= partitions {
                info!(node = %self_id, epoch = membership.epoch, partitions, "learner: every partition's journal follows its primary");
            } else {
                info!(node = %self_id, epoch = membership.epoch, following, partitions, "learner: catching up the partitions' journals");
            }
            last = Some(report);
        }
        let message = PeerMessage {
            kind: Some(Kind::Metadata(MetadataMessage {
                kind: Some(metadata_message::Kind::LearnerProgress(LearnerProgress {
                    membership_epoch: membership.epoch,
                    partitions_following: following,
                    partitions,
                })),
            })),
        };
        for id in membership.members.keys().filter(|id| **id != self_id) {
            hub.send(*id, Channel::Control, message.clone());
        }
        tokio::select! {
            _ = tick.tick() => {}
            changed = cluster.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// What [`run_with`] needs besides the configuration: where it came from, for a reload, and
/// how to change the log filter.
#[derive(Default)]
pub struct NodeOptions {
    /// The file the configuration was read from; a reload (`POST /admin/reload`, SIGHUP)
    /// reads it again. `None`: every reload is refused.
    pub config_path: Option<std::path::PathBuf>,
    /// Changes the process's log filter when a reload changes `log.level`
    /// ([`crate::reload::LogFilterReload`]).
    pub log_filter: Option<crate::reload::LogFilterReload>,
}

/// Runs the node until SIGTERM/SIGINT or `POST /admin/stop`. Must be called inside an actix
/// `System`. A node run this way cannot reload its configuration ([`run_with`] can).
pub async fn run(config: BrokerConfig) -> anyhow::Result<()> {
    run_with(config, NodeOptions::default()).await
}

/// [`run`], reloading the configuration from `options.config_path` on `POST /admin/reload`
/// and SIGHUP ([`crate::reload`]).
pub async fn run_with(config: BrokerConfig, options: NodeOptions) -> anyhow::Result<()> {
    config.validate().context("invalid configuration")?;
    // At once: SIGHUP's default action would end the process.
    let sighup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot install the SIGHUP handler")?;
    // What the file says, before a joining node adopts the members it learns: what a reload
    // compares the file with.
    let as_read = config.clone();
    let mut config = config;
    let self_id = NodeId(config.node_id);
    let metrics_handle =
        install_metrics_recorder().context("cannot install the metrics recorder")?;
    let storage = open_storage(&config)?;
    info!(
        node = %self_id,
        term = %storage.start_term,
        last_lsn = %storage.recovered.last_lsn,
        committed_lsn = %storage.recovered.committed_lsn,
        queues = storage.recovered.committed_state.queues.len(),
        "node starting"
    );
    let tls = match &config.tls {
        Some(settings) => Some(PeerTls::load(settings).context("cannot set up TLS from [tls]")?),
        None => None,
    };
    if !config.join.is_empty() && storage.recovered.committed_state.membership.is_none() {
        // First start of a joining node: learn the members before anything dials or votes.
        let discovered = crate::net::join::discover_membership(
            &config.join,
            self_id,
            &config.cluster_name,
            tls.as_ref(),
            config.limits.frame_size_max_bytes as usize,
        );
        let answer = tokio::select! {
            answer = discovered => answer,
            _ = wait_for_stop_signal() => {
                info!(node = %self_id, "stopped while joining");
                return Ok(());
            }
        };
        if let crate::net::join::JoinAnswer::Membership { membership, .. } = answer {
            adopt_members(&mut config, &membership);
        }
    }
    let config = Arc::new(config);
    // After a join's discovery: until then nothing listens (a health check is refused, it does
    // not hang on an accepted connection no one serves).
    let listeners = bind_listeners(&config)?;
    let client_tls = tls.as_ref().and_then(|t| t.client_acceptor.clone());
    if let Some(m) = &storage.recovered.committed_state.membership {
        if m.removed.contains(&self_id) {
            anyhow::bail!(
                "node {self_id} was removed from the cluster (membership epoch {}): it never \
                 votes or serves again; a node that joins again takes a new id and an empty \
                 data directory",
                m.epoch
            );
        }
    }
    let removed = Arc::new(tokio::sync::Notify::new());
    let actors = start_actors(
        &config,
        storage,
        listeners.peer,
        tls.clone(),
        removed.clone(),
    )
    .await?;
    let reload = Arc::new(crate::reload::Reloader::new(crate::reload::ReloaderParts {
        path: options.config_path,
        running: as_read,
        auth: actors.router.session_settings().auth.clone(),
        tls,
        log_filter: options.log_filter,
        router: actors.router.clone(),
    }));
    tokio::spawn(crate::reload::serve_sighup(sighup, reload.clone()));

    tokio::spawn(crate::session::serve_clients(
        tokio::net::TcpListener::from_std(listeners.client)?,
        actors.router.clone(),
        client_tls.clone(),
    ));
    if let Some(bmqp) = listeners.bmqp {
        tokio::spawn(crate::bmqp_session::serve_bmqp_clients(
            tokio::net::TcpListener::from_std(bmqp)?,
            actors.router.clone(),
            client_tls,
        ));
    }
    let admin_stop = Arc::new(tokio::sync::Notify::new());
    let admin = start_admin_server(
        listeners.admin,
        AdminContext {
            config: config.clone(),
            elector: actors.elector.clone(),
            metadata: actors.metadata.clone(),
            peers: actors.hub.clone(),
            router: actors.router.clone(),
            metrics: metrics_handle.clone(),
            stop: admin_stop.clone(),
            reload,
        },
    )?;
    let admin_handle = admin.handle();
    tokio::spawn(admin);
    tokio::spawn(probe_main_thread_lag());
    tokio::spawn(report_learner_progress(
        actors.router.clone(),
        actors.hub.clone(),
    ));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            metrics_handle.run_upkeep();
        }
    });
    let me = config.self_member();
    info!(
        node = %self_id,
        client = %me.client_addr(),
        peer = %me.peer_addr(),
        admin = %listeners.admin_addr,
        "node started"
    );

    tokio::select! {
        _ = wait_for_stop_signal() => {}
        _ = admin_stop.notified() => {}
        _ = removed.notified() => {
            // Nothing to hand over: its primaries moved while it was leaving, and no quorum
            // counts it any more.
            actors.hub.stop();
            // Graceful: the request that removed this node (when it leads) gets its answer.
            admin_handle.stop(true).await;
            error!(node = %self_id, "this node was removed from the cluster; exiting (a node that joins again takes a new id and an empty data directory)");
            anyhow::bail!("node {self_id} was removed from the cluster");
        }
    }
    graceful_stop(&config, &actors).await;
    actors.hub.stop();
    admin_handle.stop(false).await;
    info!(node = %self_id, "node stopped");
    Ok(())
}

/// Tells every peer this node is stopping (`STOPPING`: never give it a new primary) or has
/// drained (`DRAINED`: move its primaries now), and this node's own health actor.
fn announce_stopping(config: &BrokerConfig, actors: &Actors, drained: bool) {
    let status = if drained {
        NodeStatusKind::NodeStatusDrained
    } else {
        NodeStatusKind::NodeStatusStopping
    };
    // Every peer of the committed membership (the peer links'), not only the file's members.
    let msg = PeerMessage {
        kind: Some(Kind::Metadata(MetadataMessage {
            kind: Some(metadata_message::Kind::NodeStatus(NodeStatusAdvisory {
                node_id: config.node_id,
                status: status as i32,
            })),
        })),
    };
    actors.hub.broadcast(Channel::Control, msg);
    let node = NodeId(config.node_id);
    let _ = actors.health.try_send(NodeStopping { node, drained });
}

/// Graceful stop (DESIGN.md §7): retire from leadership, announce the stop, drain, hand the
/// primaries over, exit. Each wait is bounded (see the module doc), and nothing waits for a
/// peer that is itself stopping.
async fn graceful_stop(config: &BrokerConfig, actors: &Actors) {
    let self_id = NodeId(config.node_id);
    let started = tokio::time::Instant::now();
    let deadline = started + config.limits.graceful_stop_timeout();
    info!(node = %self_id, timeout = ?config.limits.graceful_stop_timeout(), "stopping: draining, then handing primaries over");
    // 1. Never lead again (a leader cedes at once, so the others elect a node that stays), and
    //    tell everyone: the leader moves our primaries to nodes that are not stopping.
    let _ = tokio::time::timeout(Duration::from_secs(1), actors.elector.send(Retire)).await;
    announce_stopping(config, actors, false);
    // 2. Drain: push nothing new; give consumers time to confirm what they hold, and let the
    //    confirms reach a quorum so that the next primary knows them.
    actors.router.stop_delivering();
    let drain_deadline = deadline.min(started + config.limits.graceful_stop_drain());
    loop {
        let left = actors.router.drain_status(Duration::from_millis(500)).await;
        if left.is_done() {
            info!(node = %self_id, elapsed = ?started.elapsed(), "drained: every pushed message confirmed, every record on a quorum");
            break;
        }
        if successors(actors).await == 0 {
            info!(node = %self_id, unconfirmed = left.unconfirmed, "every peer is stopping or gone: not draining");
            break;
        }
        if tokio::time::Instant::now() >= drain_deadline {
            warn!(node = %self_id, unconfirmed = left.unconfirmed, uncommitted = left.uncommitted, "drain time over: moving on (unconfirmed messages are redelivered by the next primary, without a failure counted)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 3. Wait until no partition names this node primary: the leader moves them to a peer that
    //    is up and not stopping. With no such peer there is nobody to hand over to: stop now.
    announce_stopping(config, actors, true);
    let mut cluster = actors.cluster.clone();
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
        if successors(actors).await == 0 {
            info!(node = %self_id, primaries, elapsed = ?started.elapsed(), "every peer is stopping or gone: stopping now");
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(node = %self_id, primaries, "graceful stop timeout: stopping with primaries still here");
            break;
        }
        // Announce again: the leader may have changed since.
        announce_stopping(config, actors, true);
        let _ = tokio::time::timeout(Duration::from_millis(100), cluster.changed()).await;
    }
    // Let the cession and the last receipts leave the sockets.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Peers that are up and not stopping: the nodes this node's primaries can move to.
async fn successors(actors: &Actors) -> usize {
    let stopping = actors
        .health
        .send(GetStoppingPeers)
        .await
        .unwrap_or_default();
    actors
        .hub
        .peer_availability()
        .into_iter()
        .filter(|(id, up)| *up && !stopping.contains(id))
        .count()
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
