//! Admin HTTP (actix-web): `/metrics`, `/status`, `/healthz`, `/readyz`, and admin actions.
//!
//! - `GET /metrics`: Prometheus text format, rendered by our own handler from the
//!   `metrics-exporter-prometheus` recorder, plus process CPU and memory read from `/proc`.
//!   Before rendering, the handler refreshes the gauges that are read from actors at scrape
//!   time ([`refresh_scrape_gauges`]): the committed partition table as this node sees it, the
//!   local partitions' depth, and how long a request waits in each actor's mailbox. The
//!   metrics reference is `docs/METRICS.md`.
//! - `GET /status`: the node's [`NodeStatusDoc`] as JSON (what `bmqctl status` reads).
//! - `GET /healthz`: 200 while the process serves requests.
//! - `GET /readyz`: 200 when the node follows (or is) a leader whose metadata is active and
//!   every partition's journal on this node is open (a restart reads the outstanding index of
//!   each journal before it serves it); else 503 with the reason. O(partitions): the status
//!   without its queue list ([`QueueList::Omitted`]), since orchestrators probe it every few
//!   seconds on the main thread (with 100,000 queues the list took 50-200 ms there).
//! - `POST /admin/quorum/{n}`: sets the quorum of the elector (votes), the metadata (advisory
//!   commits) and every local partition (journal receipts before an ACK) at once; `0` means a
//!   majority: of the committed voters for the elector and the ledger, of each lease's
//!   replicas for a partition (the files' members before a membership is committed). It
//!   changes this node only: set it on every node for a cluster-wide change.
//! - `POST /admin/cede-leadership`: the leader cedes at once (graceful transfer).
//! - `POST /admin/stop`: graceful stop, as on SIGTERM.
//! - `POST /admin/purge?queue=URI`: removes every outstanding message of the queue (BlazingMQ's
//!   PURGE) on its primary; another node answers `307` to the primary's admin address.
//! - `POST /admin/members?...` and `DELETE /admin/members/{id}`: add or remove a member
//!   (learner, promotion, leaving, removal), on the leader ([`crate::admin_members`]).
//! - `POST /admin/reload`: reads the configuration file again and applies the tokens, TLS
//!   files and log level ([`crate::admin_reload`]).
//!
//! The `POST` and `DELETE` actions change the cluster: when `admin.token` is configured (or a client
//! token has the `admin` permission) they require `Authorization: Bearer <token>` and answer
//! 401 otherwise, logged with the remote address and counted in
//! `bmq_admin_auth_failures_total` ([`crate::auth`]). The `GET` endpoints stay readable. The
//! listener binds to loopback unless `admin.listen_host` says otherwise
//! ([`bmq_config::AdminSettings::bind_host`]).

use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bmq_config::{BrokerConfig, Permission};
use bmq_metadata::{ClusterMembership, LearnerProgress, MemberRole, MetadataRole};
use bmq_proto::admin_doc::{
    CatchUpDoc, DomainsDoc, ElectorDoc, MemberDoc, MembershipDoc, MetadataDoc, NodeStatusDoc,
    PartitionDoc, PeerDoc, QueueDoc,
};
use bmq_proto::NodeId;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing::{info, warn};

use crate::actors::elector::{CedeLeadership, ElectorActor, GetElectorStatus, SetQuorum};
use crate::actors::metadata::{GetMetadataStatus, MetadataActor, SetMetadataQuorum};
use crate::actors::partition::{GetPartitionStats, PurgeQueue};
use crate::net::peers::PeerHub;
use crate::router::Router;

/// Latency buckets (seconds) for every `*_seconds` histogram: 100 µs to 10 s.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Buckets of the heartbeat interval histograms: fine around the 100 ms heartbeat period, so a
/// delay of a few milliseconds (an fsync on the thread that sends heartbeats) shows.
const HEARTBEAT_INTERVAL_BUCKETS_SECONDS: &[f64] = &[
    0.05, 0.09, 0.099, 0.1, 0.101, 0.102, 0.103, 0.105, 0.11, 0.12, 0.15, 0.2, 0.3, 0.5, 0.8, 1.0,
    2.0,
];

/// How long a scrape waits for one actor's answer before leaving its gauges as they were.
const SCRAPE_ACTOR_TIMEOUT: Duration = Duration::from_secs(2);

/// Installs the global metrics recorder (explicit histogram buckets, so the exporter renders
/// histograms rather than summaries) and returns the handle `/metrics` renders from.
pub fn install_metrics_recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        // Full matchers take precedence over the suffix matcher below.
        .set_buckets_for_metric(
            Matcher::Full("bmq_elector_heartbeat_send_interval_seconds".to_string()),
            HEARTBEAT_INTERVAL_BUCKETS_SECONDS,
        )?
        .set_buckets_for_metric(
            Matcher::Full("bmq_elector_heartbeat_receive_interval_seconds".to_string()),
            HEARTBEAT_INTERVAL_BUCKETS_SECONDS,
        )?
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_string()),
            LATENCY_BUCKETS_SECONDS,
        )?
        .install_recorder()?;
    describe_scrape_gauges();
    register_counters_at_zero();
    Ok(handle)
}

/// Counters (with their known label values) and histograms that exist from the start at zero.
///
/// The recorder creates a series at its first update, and Prometheus's `rate()` cannot see the
/// increment that creates a series: without this, the first burst of PUTs, a first NACK or the
/// first redelivery on a node would never show on a dashboard. The names are those the
/// components emit (`docs/METRICS.md` lists them with the file that emits each); a counter
/// missing here still works, it only loses its first increment.
fn register_counters_at_zero() {
    const COUNTERS: &[&str] = &[
        "bmq_queue_put_total",
        "bmq_queue_put_duplicates_total",
        "bmq_bmqp_heartbeat_timeouts_total",
        "bmq_queue_ack_total",
        "bmq_queue_push_total",
        "bmq_queue_confirm_total",
        "bmq_queue_redeliveries_total",
        "bmq_queue_consumer_failures_total",
        "bmq_client_connections_total",
        "bmq_client_connections_refused_total",
        "bmq_client_frame_errors_total",
        "bmq_client_write_timeouts_total",
        "bmq_client_protocol_errors_total",
        "bmq_client_invalid_requests_total",
        "bmq_session_put_retransmissions_total",
        "bmq_session_open_retransmissions_total",
        "bmq_session_inbox_dropped_total",
        "bmq_session_inbox_overflows_total",
        "bmq_partition_overloaded_total",
        "bmq_partition_invalid_requests_total",
        "bmq_peer_frame_errors_total",
        "bmq_peer_connection_timeouts_total",
        "bmq_peer_connections_refused_total",
        "bmq_peer_messages_invalid_total",
        "bmq_metadata_ledger_rollovers_total",
        "bmq_admin_auth_failures_total",
        "bmq_peer_auth_failures_total",
        "bmq_client_auth_failures_total",
        "bmq_client_unauthorized_total",
        "bmq_client_tls_failures_total",
        "bmq_bmqp_connections_total",
        "bmq_bmqp_errors_total",
        "bmq_bmqp_puts_decompressed_total",
        "bmq_journal_written_bytes_total",
        "bmq_journal_rollovers_total",
        "bmq_journal_segments_deleted_total",
        "bmq_journal_segments_recycled_total",
        "bmq_journal_compactions_total",
        "bmq_journal_torn_tail_truncations_total",
        "bmq_journal_delete_errors_total",
        "bmq_journal_quarantines_total",
        "bmq_ledger_torn_tail_truncations_total",
        "bmq_proxy_puts_held_total",
    ];
    for name in COUNTERS {
        metrics::counter!(*name).increment(0);
    }
    for reason in [
        "not_open",
        "retransmit_buffer_full",
        "unknown_queue",
        "limit_reached",
        "quota",
        "storage_failure",
        "invalid",
        "guid_conflict",
    ] {
        metrics::counter!("bmq_queue_nack_total", "reason" => reason).increment(0);
    }
    metrics::counter!("bmq_journal_write_failures_total", "reason" => "no_space").increment(0);
    for reason in ["ttl", "attempts_exhausted", "purged"] {
        metrics::counter!("bmq_queue_removed_total", "reason" => reason).increment(0);
    }
    for actor in ["elector", "metadata"] {
        metrics::counter!("bmq_mailbox_full_total", "actor" => actor).increment(0);
    }
    for channel in ["control", "data"] {
        metrics::counter!("bmq_peer_messages_dropped_total", "channel" => channel).increment(0);
    }
    // Registering the handle renders the histogram with empty buckets.
    let _ = metrics::histogram!("bmq_metadata_commit_latency_seconds");
    let _ = metrics::histogram!("bmq_queue_ack_latency_seconds");
    let _ = metrics::histogram!("bmq_journal_fsync_seconds");
    let _ = metrics::histogram!("bmq_journal_compaction_seconds");
}

/// `# HELP` texts of the gauges [`refresh_scrape_gauges`] sets (the reference for every metric
/// is `docs/METRICS.md`).
fn describe_scrape_gauges() {
    metrics::describe_gauge!(
        "bmq_cluster_partition_primary_node_id",
        "Primary node of the partition in this node's committed cluster state (0 = none)"
    );
    metrics::describe_gauge!(
        "bmq_cluster_partition_primary_lease_id",
        "primary_lease_id of the partition in this node's committed cluster state"
    );
    metrics::describe_gauge!(
        "bmq_cluster_partition_status",
        "Announced primary status in this node's committed state: 0 none, 1 passive, 2 active"
    );
    metrics::describe_gauge!(
        "bmq_cluster_partition_primary_reachable",
        "1 if the partition has an active primary that is this node or an available peer"
    );
    metrics::describe_gauge!(
        "bmq_cluster_queues",
        "Queues assigned to partitions in this node's committed cluster state"
    );
    metrics::describe_gauge!(
        "bmq_cluster_members",
        "Configured cluster members, this node included"
    );
    metrics::describe_gauge!(
        "bmq_cluster_membership_members",
        "Members of the committed membership by role (voter, learner, leaving)"
    );
    metrics::describe_gauge!(
        "bmq_cluster_membership_epoch",
        "Epoch of the committed membership (1: seeded from the files; +1 per change)"
    );
    metrics::describe_gauge!(
        "bmq_cluster_membership_change_in_flight",
        "1 while this node (as leader) holds a proposed membership change not yet committed"
    );
    metrics::describe_counter!(
        "bmq_cluster_membership_changes_total",
        "Membership changes this node applied, by kind (added, promoted, leaving, removed, moved)"
    );
    metrics::describe_counter!(
        "bmq_config_changes_total",
        "Committed domain changes this node applied, by kind (domain_create, domain_update, domain_delete)"
    );
    metrics::describe_gauge!(
        "bmq_elector_quorum",
        "Effective elector quorum, this node included"
    );
    metrics::describe_gauge!(
        "bmq_partition_messages",
        "Messages held and not yet confirmed on this node as primary of the partition (0 elsewhere)"
    );
    metrics::describe_gauge!(
        "bmq_partition_unconfirmed_messages",
        "Messages pushed to consumers and not yet confirmed, on this node as primary (0 elsewhere)"
    );
    metrics::describe_gauge!(
        "bmq_partition_queues",
        "Queues this node serves as primary of the partition: a consumer attached or a message held (0 elsewhere)"
    );
    metrics::describe_gauge!(
        "bmq_actor_mailbox_delay_seconds",
        "Round trip of a status request through the actor's mailbox at the last scrape"
    );
}

/// Sets the gauges that are read from the actors at scrape time, so a scrape shows the current
/// value without the actors publishing on every change:
///
/// - from the metadata actor's committed state: per partition, `bmq_cluster_partition_*`
///   (primary, lease, status, and whether the primary is active and reachable from here — this
///   node or an available peer), and `bmq_cluster_queues`;
/// - from the elector: `bmq_elector_quorum`; from the configuration: `bmq_cluster_members`;
/// - from each local partition actor ([`GetPartitionStats`]): `bmq_partition_messages`,
///   `bmq_partition_unconfirmed_messages`, `bmq_partition_queues`, set to 0 for the partitions
///   this node is not primary for, so that summing over nodes gives the cluster's total and a
///   former primary does not keep showing its last depth;
/// - `bmq_actor_mailbox_delay_seconds{actor}`: how long each status request took to pass
///   through the actor's mailbox (for `partition`, the slowest local partition). actix does not
///   expose mailbox lengths; this round trip is what a backlog costs.
///
/// An actor that does not answer within [`SCRAPE_ACTOR_TIMEOUT`] leaves its gauges unchanged
/// (its mailbox delay is then set to the timeout) and the rest of the scrape still renders.
/// Labels are bounded: `partition` by `partition_count`, `actor` by three values.
pub async fn refresh_scrape_gauges(ctx: &AdminContext) {
    let started = std::time::Instant::now();
    match tokio::time::timeout(SCRAPE_ACTOR_TIMEOUT, ctx.elector.send(GetElectorStatus)).await {
        Ok(Ok(snapshot)) => {
            metrics::gauge!("bmq_actor_mailbox_delay_seconds", "actor" => "elector")
                .set(started.elapsed().as_secs_f64());
            metrics::gauge!("bmq_elector_quorum").set(snapshot.quorum as f64);
        }
        _ => metrics::gauge!("bmq_actor_mailbox_delay_seconds", "actor" => "elector")
            .set(SCRAPE_ACTOR_TIMEOUT.as_secs_f64()),
    }
    metrics::gauge!("bmq_cluster_members").set((ctx.peers.peer_availability().len() + 1) as f64);

    let started = std::time::Instant::now();
    let state = match tokio::time::timeout(
        SCRAPE_ACTOR_TIMEOUT,
        ctx.metadata.send(GetMetadataStatus),
    )
    .await
    {
        Ok(Ok(snapshot)) => {
            metrics::gauge!("bmq_actor_mailbox_delay_seconds", "actor" => "metadata")
                .set(started.elapsed().as_secs_f64());
            let (committed, proposed) = snapshot.membership_epochs;
            metrics::gauge!("bmq_cluster_membership_change_in_flight")
                .set(if proposed != committed { 1.0 } else { 0.0 });
            if let Some(m) = &snapshot.state.membership {
                metrics::gauge!("bmq_cluster_membership_epoch").set(m.epoch as f64);
                for (role, name) in [
                    (MemberRole::Voter, "voter"),
                    (MemberRole::Learner, "learner"),
                    (MemberRole::Leaving, "leaving"),
                ] {
                    let count = m.members.values().filter(|x| x.role == role).count();
                    metrics::gauge!("bmq_cluster_membership_members", "role" => name)
                        .set(count as f64);
                }
            }
            Some(snapshot.state)
        }
        _ => {
            metrics::gauge!("bmq_actor_mailbox_delay_seconds", "actor" => "metadata")
                .set(SCRAPE_ACTOR_TIMEOUT.as_secs_f64());
            None
        }
    };

    let mut local = std::collections::HashMap::new();
    let mut slowest: Option<Duration> = None;
    for (id, addr) in ctx.router.local_partitions() {
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(SCRAPE_ACTOR_TIMEOUT, addr.send(GetPartitionStats)).await;
        let took = match answer {
            Ok(Ok(Some(stats))) => {
                local.insert(id, stats);
                started.elapsed()
            }
            _ => SCRAPE_ACTOR_TIMEOUT,
        };
        slowest = Some(slowest.map_or(took, |s| s.max(took)));
    }
    if let Some(slowest) = slowest {
        metrics::gauge!("bmq_actor_mailbox_delay_seconds", "actor" => "partition")
            .set(slowest.as_secs_f64());
    }

    let Some(state) = state else {
        return;
    };
    let available: std::collections::HashSet<u32> = ctx
        .peers
        .peer_availability()
        .into_iter()
        .filter(|(_, up)| *up)
        .map(|(id, _)| id.0)
        .chain(std::iter::once(ctx.config.node_id))
        .collect();
    for (id, p) in &state.partitions {
        let label = id.0.to_string();
        let status = match p.status {
            bmq_metadata::PrimaryStatus::None => 0.0,
            bmq_metadata::PrimaryStatus::Passive => 1.0,
            bmq_metadata::PrimaryStatus::Active => 2.0,
        };
        let reachable = p.status == bmq_metadata::PrimaryStatus::Active
            && p.primary.is_some_and(|n| available.contains(&n.0));
        metrics::gauge!("bmq_cluster_partition_primary_node_id", "partition" => label.clone())
            .set(p.primary.map_or(0.0, |n| f64::from(n.0)));
        metrics::gauge!("bmq_cluster_partition_primary_lease_id", "partition" => label.clone())
            .set(p.primary_lease_id as f64);
        metrics::gauge!("bmq_cluster_partition_status", "partition" => label.clone()).set(status);
        metrics::gauge!("bmq_cluster_partition_primary_reachable", "partition" => label.clone())
            .set(if reachable { 1.0 } else { 0.0 });
        let (messages, unconfirmed, queues) = local
            .get(id)
            .map_or((0, 0, 0), |s| (s.messages, s.unconfirmed, s.queues));
        metrics::gauge!("bmq_partition_messages", "partition" => label.clone())
            .set(messages as f64);
        metrics::gauge!("bmq_partition_unconfirmed_messages", "partition" => label.clone())
            .set(unconfirmed as f64);
        metrics::gauge!("bmq_partition_queues", "partition" => label).set(queues as f64);
    }
    metrics::gauge!("bmq_cluster_queues").set(state.queues.len() as f64);
}

/// What the admin handlers need from the node.
#[derive(Clone)]
pub struct AdminContext {
    /// The node configuration (id, cluster name, members, admin and client tokens).
    pub config: Arc<BrokerConfig>,
    /// The elector actor.
    pub elector: Addr<ElectorActor>,
    /// The metadata actor.
    pub metadata: Addr<MetadataActor>,
    /// Peer links (availability).
    pub peers: Arc<PeerHub>,
    /// The router (sessions, local partitions).
    pub router: Arc<Router>,
    /// Notified by `POST /admin/stop`: the node stops gracefully, as on SIGTERM.
    pub stop: Arc<tokio::sync::Notify>,
    /// The metrics recorder handle.
    pub metrics: PrometheusHandle,
    /// Reloads the configuration file (`POST /admin/reload`, [`crate::admin_reload`]).
    pub reload: Arc<crate::reload::Reloader>,
}

/// Checks the bearer token of a state-changing admin request (see the module doc): `None` when
/// no admin token is configured or the request carries a valid one; else the 401 answer, after
/// logging the remote address and counting `bmq_admin_auth_failures_total`.
pub(crate) fn refuse_unauthorized(ctx: &AdminContext, req: &HttpRequest) -> Option<HttpResponse> {
    admin_caller(ctx, req).err().map(|refused| *refused)
}

/// As [`refuse_unauthorized`], with who the caller is when admitted: `admin.token`, the name
/// of the client token with the `admin` permission it presented, or `anonymous` when no
/// admin token is configured. The tokens are those in force (a reload replaces them).
pub(crate) fn admin_caller(
    ctx: &AdminContext,
    req: &HttpRequest,
) -> Result<String, Box<HttpResponse>> {
    // `admin.token`, and any client token with the `admin` permission, are accepted; when
    // neither exists the actions are open to whoever reaches the (loopback) port.
    let in_force = ctx.router.session_settings().auth.current();
    let admin_token = in_force.admin_token.as_deref();
    let auth = &in_force.client;
    let admin_tokens_exist = admin_token.is_some()
        || auth
            .tokens
            .iter()
            .any(|t| t.permissions.contains(&Permission::Admin));
    if !admin_tokens_exist {
        return Ok("anonymous".to_string());
    }
    let presented = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if let Some(p) = presented {
        let by_admin =
            admin_token.is_some_and(|t| bmq_config::constant_time_eq(t.as_bytes(), p.as_bytes()));
        let by_client = auth
            .find(p)
            .filter(|t| t.permissions.contains(&Permission::Admin));
        match (by_admin, by_client) {
            (true, _) => return Ok("admin.token".to_string()),
            (false, Some(t)) => return Ok(t.name.clone()),
            (false, None) => {}
        }
    }
    metrics::counter!("bmq_admin_auth_failures_total").increment(1);
    let remote = req.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    warn!(%remote, path = %req.path(), presented = presented.is_some(), "admin action refused: missing or invalid token");
    Err(Box::new(HttpResponse::Unauthorized()
        .insert_header(("WWW-Authenticate", "Bearer"))
        .body(if presented.is_some() {
            "invalid admin token\n"
        } else {
            "this action requires an admin token: Authorization: Bearer <token> (bmqctl admin --token or BMQ_ADMIN_TOKEN)\n"
        })))
}

/// Whether a document lists the committed state's queues: `/status` does, `/readyz` needs
/// only the readiness, and with 1,000,000 queues the list costs ~0.1 s of the main thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueList {
    /// Every queue of the committed state (`/status`).
    Listed,
    /// No queue: `queues` is empty (`/readyz`), O(partitions).
    Omitted,
}

/// Builds this node's `/status` document from its actors.
pub async fn node_status(ctx: &AdminContext) -> anyhow::Result<NodeStatusDoc> {
    node_status_with(ctx, QueueList::Listed).await
}

/// Builds this node's `/status` document from its actors, with or without the queue list.
pub async fn node_status_with(
    ctx: &AdminContext,
    queue_list: QueueList,
) -> anyhow::Result<NodeStatusDoc> {
    let timeout = Duration::from_secs(2);
    let elector = tokio::time::timeout(timeout, ctx.elector.send(GetElectorStatus)).await??;
    let metadata = tokio::time::timeout(timeout, ctx.metadata.send(GetMetadataStatus)).await??;
    let mut local = std::collections::HashMap::new();
    let mut journals_closed = 0usize;
    for (id, addr) in ctx.router.local_partitions() {
        match tokio::time::timeout(timeout, addr.send(GetPartitionStats)).await {
            Ok(Ok(Some(stats))) => {
                local.insert(id, stats);
            }
            // `None`: the partition's journal is still being opened (or failed to open).
            _ => journals_closed += 1,
        }
    }
    let state = &metadata.state;
    let role = metadata.status.role;
    let leader_active = elector.status.leader.is_some()
        && (role == MetadataRole::ActiveLeader
            || metadata.status.committed_lsn.term == elector.status.term);
    Ok(NodeStatusDoc {
        node_id: ctx.config.node_id,
        cluster_name: ctx.config.cluster_name.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        elector: ElectorDoc {
            state: elector.status.state.as_str().to_string(),
            term: elector.status.term.0,
            leader: elector.status.leader.map(|n| n.0),
            reason: elector.status.reason.as_str().to_string(),
            quorum: elector.quorum,
        },
        metadata: MetadataDoc {
            role: role_name(role).to_string(),
            term: metadata.status.term.0,
            last_lsn: metadata.status.last_lsn.to_string(),
            committed_lsn: metadata.status.committed_lsn.to_string(),
            uncommitted: metadata.status.uncommitted,
        },
        partitions: state
            .partitions
            .iter()
            .map(|(id, p)| {
                let stats = local.get(id);
                let gauges = stats.map(|s| &s.gauges);
                PartitionDoc {
                    partition_id: id.0,
                    primary: p.primary.map(|n| n.0),
                    primary_lease_id: p.primary_lease_id,
                    status: primary_status_name(p.status).to_string(),
                    replicas: state
                        .lease_replicas(*id)
                        .map(|r| r.into_iter().map(|n| n.0).collect())
                        .unwrap_or_default(),
                    messages: stats.map(|s| s.messages).unwrap_or(0),
                    journal_last_sequence: gauges.map(|g| g.last_sequence).unwrap_or(0),
                    // The primary's figures, 0 on a replica (the core's gauges).
                    committed_sequence: gauges.map(|g| g.committed).unwrap_or(0),
                    replication_lag: gauges.map(|g| g.replication_lag).unwrap_or(0),
                    journal_bytes: gauges.map(|g| g.store.bytes).unwrap_or(0),
                    disk_full: gauges.is_some_and(|g| g.disk_full),
                    needs_install: gauges.is_some_and(|g| g.needs_install),
                }
            })
            .collect(),
        queues: match queue_list {
            QueueList::Listed => state
                .queues
                .iter()
                .map(|(uri, q)| QueueDoc {
                    uri: uri.clone(),
                    partition_id: q.partition.0,
                    queue_key: q.queue_key,
                })
                .collect(),
            QueueList::Omitted => Vec::new(),
        },
        peers: ctx
            .peers
            .peer_availability()
            .into_iter()
            .map(|(id, connected)| PeerDoc {
                node_id: id.0,
                connected,
            })
            .collect(),
        client_sessions: ctx.router.session_count() as u64,
        ready: leader_active && journals_closed == 0 && local.len() >= state.partitions.len(),
        membership: state.membership.as_deref().map(|m| {
            let mut doc = membership_doc(m, &ctx.config, &metadata.learner_progress);
            // This node, if a learner, as it stands now.
            let self_id = NodeId(ctx.config.node_id);
            if let Some(me) = doc.members.iter_mut().find(|d| d.node_id == self_id.0) {
                if me.role == "learner" {
                    let (partitions_following, partitions) =
                        crate::router::journals_following(state, self_id, |p| {
                            local.get(&p).is_some_and(|s| s.gauges.follows_primary)
                        });
                    me.catch_up = Some(catch_up_doc(&LearnerProgress {
                        membership_epoch: m.epoch,
                        partitions_following,
                        partitions,
                    }));
                }
            }
            doc
        }),
        config_reload: ctx.reload.status(),
        domains: state.domains.as_deref().map(|d| DomainsDoc {
            version: d.version.to_string(),
            count: d.domains.len(),
            file_disagrees: ctx.router.domains_file_disagreement(state),
        }),
    })
}

/// The `/status` form of a learner's catch-up.
fn catch_up_doc(p: &LearnerProgress) -> CatchUpDoc {
    CatchUpDoc {
        membership_epoch: p.membership_epoch,
        partitions_following: p.partitions_following,
        partitions: p.partitions,
    }
}

/// The `/status` form of a committed membership, with how this node's file differs from it and
/// the learners' latest reports of their catch-up.
fn membership_doc(
    membership: &ClusterMembership,
    config: &BrokerConfig,
    progress: &[(NodeId, LearnerProgress)],
) -> MembershipDoc {
    MembershipDoc {
        epoch: membership.epoch,
        members: membership
            .members
            .values()
            .map(|m| MemberDoc {
                node_id: m.id.0,
                host: m.host.clone(),
                peer_port: m.peer_port,
                client_port: m.client_port,
                admin_port: m.admin_port,
                bmqp_port: m.bmqp_port,
                role: match m.role {
                    MemberRole::Voter => "voter",
                    MemberRole::Learner => "learner",
                    MemberRole::Leaving => "leaving",
                }
                .to_string(),
                catch_up: progress
                    .iter()
                    .find(|(id, _)| *id == m.id)
                    .map(|(_, p)| catch_up_doc(p)),
            })
            .collect(),
        removed: membership.removed.iter().map(|n| n.0).collect(),
        file_disagrees: crate::node::file_disagreement(config, membership),
    }
}

async fn status(ctx: web::Data<AdminContext>) -> HttpResponse {
    match node_status(&ctx).await {
        Ok(doc) => HttpResponse::Ok().json(doc),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("status unavailable: {e:#}\n")),
    }
}

async fn readyz(ctx: web::Data<AdminContext>) -> HttpResponse {
    // Probed every few seconds by orchestrators: never O(queues).
    match node_status_with(&ctx, QueueList::Omitted).await {
        Ok(doc) if doc.ready => HttpResponse::Ok().body("ready\n"),
        Ok(_) => HttpResponse::ServiceUnavailable()
            .body("not ready: no active leader, or a partition journal is not open yet\n"),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("not ready: {e:#}\n")),
    }
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().body("ok\n")
}

async fn metrics_handler(ctx: web::Data<AdminContext>) -> HttpResponse {
    refresh_scrape_gauges(&ctx).await;
    let mut body = ctx.metrics.render();
    body.push_str(&process_metrics());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(body)
}

async fn set_quorum(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    path: web::Path<usize>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    let requested = path.into_inner();
    // 0 stays 0 everywhere: a majority of the committed voters (elector, ledger) or of each
    // lease's replicas (partitions).
    let a = ctx.elector.send(SetQuorum { quorum: requested }).await;
    let b = ctx
        .metadata
        .send(SetMetadataQuorum { quorum: requested })
        .await;
    if a.is_err() || b.is_err() {
        return HttpResponse::ServiceUnavailable().body("actors unavailable\n");
    }
    ctx.router.set_partition_quorum(requested);
    info!(
        requested,
        "quorum set for the elector, the metadata and every partition"
    );
    let quorum = if requested == 0 {
        "a majority of the voters".to_owned()
    } else {
        requested.to_string()
    };
    HttpResponse::Ok().body(format!(
        "quorum set to {quorum} for the elector, the metadata and every partition of this node\n"
    ))
}

async fn stop(ctx: web::Data<AdminContext>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    ctx.stop.notify_one();
    HttpResponse::Ok().body("graceful stop started: ceding leadership and primaries\n")
}

/// The query of `POST /admin/purge`.
#[derive(serde::Deserialize)]
struct PurgeQuery {
    queue: String,
}

async fn purge(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    query: web::Query<PurgeQuery>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    let uri = query.into_inner().queue;
    let state = ctx.router.cluster().borrow().clone();
    let Some(assignment) = state.queues.get(&uri) else {
        return HttpResponse::NotFound().body(format!(
            "queue {uri} is not assigned to a partition (never opened)\n"
        ));
    };
    let partition = assignment.partition;
    let primary = state.partitions.get(&partition).and_then(|p| p.primary);
    let me = ctx.config.node_id;
    match primary {
        Some(node) if node.0 == me => {
            let addr = ctx
                .router
                .local_partitions()
                .into_iter()
                .find(|(id, _)| *id == partition)
                .map(|(_, addr)| addr);
            let answer = match addr {
                Some(addr) => addr
                    .send(PurgeQueue { uri: uri.clone() })
                    .await
                    .ok()
                    .flatten(),
                None => None,
            };
            match answer {
                Some(removed) => {
                    info!(queue = %uri, %partition, removed, "queue purged by an operator");
                    HttpResponse::Ok().body(format!(
                        "purged {removed} messages of {uri} (partition {partition}, primary node {me})\n"
                    ))
                }
                None => HttpResponse::ServiceUnavailable().body(format!(
                    "partition {partition} is not active on this node yet; retry\n"
                )),
            }
        }
        // The committed membership's address (a member added at run time is in no file).
        Some(node) => match state.membership.as_ref().and_then(|m| m.members.get(&node)) {
            Some(member) => HttpResponse::TemporaryRedirect()
                .insert_header((
                    "Location",
                    format!(
                        "http://{}{}",
                        member.admin_addr(),
                        req.uri()
                            .path_and_query()
                            .map_or("/admin/purge", |p| p.as_str())
                    ),
                ))
                .body(format!(
                    "node {} is the primary of partition {partition}\n",
                    node.0
                )),
            None => HttpResponse::ServiceUnavailable()
                .body(format!("node {} is not a member\n", node.0)),
        },
        None => HttpResponse::ServiceUnavailable()
            .body(format!("partition {partition} has no primary; retry\n")),
    }
}

async fn cede(ctx: web::Data<AdminContext>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    match ctx.elector.send(CedeLeadership).await {
        Ok(_) => HttpResponse::Ok().body("leadership ceded if held\n"),
        Err(_) => HttpResponse::ServiceUnavailable().body("elector unavailable\n"),
    }
}

/// Starts the admin HTTP server on `listener` (one worker thread: admin traffic is light).
pub fn start_admin_server(
    listener: std::net::TcpListener,
    ctx: AdminContext,
) -> std::io::Result<actix_web::dev::Server> {
    let data = web::Data::new(ctx);
    Ok(HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/metrics", web::get().to(metrics_handler))
            .route("/status", web::get().to(status))
            .route("/healthz", web::get().to(healthz))
            .route("/readyz", web::get().to(readyz))
            .route("/admin/quorum/{n}", web::post().to(set_quorum))
            .route("/admin/cede-leadership", web::post().to(cede))
            .route("/admin/stop", web::post().to(stop))
            .route(
                "/admin/members",
                web::post().to(crate::admin_members::add_member),
            )
            .route(
                "/admin/members/{id}",
                web::delete().to(crate::admin_members::remove_member),
            )
            .route("/admin/purge", web::post().to(purge))
            .route("/admin/reload", web::post().to(crate::admin_reload::reload))
            .configure(crate::admin_domains::routes)
    })
    .workers(1)
    .disable_signals()
    .listen(listener)?
    .run())
}

/// `process_cpu_seconds_total` and `process_resident_memory_bytes` from `/proc/self`.
fn process_metrics() -> String {
    let mut out = String::new();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as f64;
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() > 12 {
                let cpu = f[11].parse::<f64>().unwrap_or(0.0) + f[12].parse::<f64>().unwrap_or(0.0);
                out.push_str("# TYPE process_cpu_seconds_total counter\n");
                out.push_str(&format!("process_cpu_seconds_total {}\n", cpu / ticks));
            }
        }
    }
    if let Ok(statm) = std::fs::read_to_string("/proc/self/statm") {
        if let Some(rss) = statm
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<f64>().ok())
        {
            out.push_str("# TYPE process_resident_memory_bytes gauge\n");
            out.push_str(&format!("process_resident_memory_bytes {}\n", rss * page));
        }
    }
    out
}

/// `follower`, `passive_leader` or `active_leader`.
fn role_name(role: MetadataRole) -> &'static str {
    match role {
        MetadataRole::Follower => "follower",
        MetadataRole::PassiveLeader => "passive_leader",
        MetadataRole::ActiveLeader => "active_leader",
    }
}

/// `none`, `passive` or `active`.
fn primary_status_name(status: bmq_metadata::PrimaryStatus) -> &'static str {
    match status {
        bmq_metadata::PrimaryStatus::None => "none",
        bmq_metadata::PrimaryStatus::Passive => "passive",
        bmq_metadata::PrimaryStatus::Active => "active",
    }
}
