//! Admin HTTP (actix-web): `/metrics`, `/status`, `/healthz`, `/readyz`, and admin actions.
//!
//! - `GET /metrics`: Prometheus text format, rendered by our own handler from the
//!   `metrics-exporter-prometheus` recorder, plus process CPU and memory read from `/proc`.
//! - `GET /status`: the node's [`NodeStatusDoc`] as JSON (what `bmqctl status` reads).
//! - `GET /healthz`: 200 while the process serves requests.
//! - `GET /readyz`: 200 when the node follows (or is) a leader whose metadata is active; else
//!   503.
//! - `POST /admin/quorum/{n}`: sets the elector's and the metadata's quorum (0 = N/2+1).
//! - `POST /admin/cede-leadership`: the leader cedes at once (graceful transfer).

use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use actix_web::{web, App, HttpResponse, HttpServer};
use bmq_elector::{CedeLeadership, ElectorActor, GetElectorStatus, SetQuorum};
use bmq_metadata::{GetMetadataStatus, MetadataActor, MetadataRole, SetMetadataQuorum};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::dataplane::DataPlane;
use crate::partition::GetPartitionStats;
use crate::peers::PeerHub;
use crate::status::{ElectorDoc, MetadataDoc, NodeStatusDoc, PartitionDoc, PeerDoc, QueueDoc};

/// Latency buckets (seconds) for every `*_seconds` histogram: 100 µs to 10 s.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Installs the global metrics recorder (explicit histogram buckets, so the exporter renders
/// histograms rather than summaries) and returns the handle `/metrics` renders from.
pub fn install_metrics_recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_string()),
            LATENCY_BUCKETS_SECONDS,
        )?
        .install_recorder()?;
    Ok(handle)
}

/// What the admin handlers need from the node.
#[derive(Clone)]
pub struct AdminContext {
    /// Node id.
    pub node_id: u32,
    /// Cluster name.
    pub cluster_name: String,
    /// The elector actor.
    pub elector: Addr<ElectorActor>,
    /// The metadata actor.
    pub metadata: Addr<MetadataActor>,
    /// Peer links (availability).
    pub peers: Arc<PeerHub>,
    /// The data plane (sessions, local partitions).
    pub router: Arc<DataPlane>,
    /// Notified by `POST /admin/stop`: the node stops gracefully, as on SIGTERM.
    pub stop: Arc<tokio::sync::Notify>,
    /// The metrics recorder handle.
    pub metrics: PrometheusHandle,
}

/// Builds this node's `/status` document from its actors.
pub async fn node_status(ctx: &AdminContext) -> anyhow::Result<NodeStatusDoc> {
    let timeout = Duration::from_secs(2);
    let elector = tokio::time::timeout(timeout, ctx.elector.send(GetElectorStatus)).await??;
    let metadata = tokio::time::timeout(timeout, ctx.metadata.send(GetMetadataStatus)).await??;
    let mut local = std::collections::HashMap::new();
    for (id, addr) in ctx.router.local_partitions() {
        if let Ok(Ok(stats)) = tokio::time::timeout(timeout, addr.send(GetPartitionStats)).await {
            local.insert(id, stats);
        }
    }
    let state = &metadata.state;
    let role = metadata.status.role;
    let leader_active = elector.status.leader.is_some()
        && (role == MetadataRole::ActiveLeader
            || metadata.status.committed_lsn.term == elector.status.term);
    Ok(NodeStatusDoc {
        node_id: ctx.node_id,
        cluster_name: ctx.cluster_name.clone(),
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
            .map(|(id, p)| PartitionDoc {
                partition_id: id.0,
                primary: p.primary.map(|n| n.0),
                primary_lease_id: p.primary_lease_id,
                status: primary_status_name(p.status).to_string(),
                messages: local.get(id).map(|s| s.messages).unwrap_or(0),
            })
            .collect(),
        queues: state
            .queues
            .iter()
            .map(|(uri, q)| QueueDoc {
                uri: uri.clone(),
                partition_id: q.partition.0,
                queue_key: q.queue_key,
            })
            .collect(),
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
        ready: leader_active,
    })
}

async fn status(ctx: web::Data<AdminContext>) -> HttpResponse {
    match node_status(&ctx).await {
        Ok(doc) => HttpResponse::Ok().json(doc),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("status unavailable: {e:#}\n")),
    }
}

async fn readyz(ctx: web::Data<AdminContext>) -> HttpResponse {
    match node_status(&ctx).await {
        Ok(doc) if doc.ready => HttpResponse::Ok().body("ready\n"),
        Ok(_) => HttpResponse::ServiceUnavailable().body("not ready: no active leader\n"),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("not ready: {e:#}\n")),
    }
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().body("ok\n")
}

async fn metrics_handler(ctx: web::Data<AdminContext>) -> HttpResponse {
    let mut body = ctx.metrics.render();
    body.push_str(&process_metrics());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(body)
}

async fn set_quorum(ctx: web::Data<AdminContext>, path: web::Path<usize>) -> HttpResponse {
    let quorum = path.into_inner();
    let a = ctx.elector.send(SetQuorum { quorum }).await;
    let b = ctx.metadata.send(SetMetadataQuorum { quorum }).await;
    if a.is_err() || b.is_err() {
        return HttpResponse::ServiceUnavailable().body("actors unavailable\n");
    }
    HttpResponse::Ok().body(format!("quorum set to {quorum} (0 = N/2+1)\n"))
}

async fn stop(ctx: web::Data<AdminContext>) -> HttpResponse {
    ctx.stop.notify_one();
    HttpResponse::Ok().body("graceful stop started: ceding leadership and primaries\n")
}

async fn cede(ctx: web::Data<AdminContext>) -> HttpResponse {
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
