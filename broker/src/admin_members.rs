//! Membership changes through the admin HTTP server (DESIGN.md §5a), on the active leader:
//!
//! - `POST /admin/members?id=N&host=H&peer_port=P&client_port=P&admin_port=P[&bmqp_port=P]`
//!   adds node N as a learner; the leader promotes it to voter once it has caught up the
//!   ledger and every partition's journal (`MetadataConfig::promote_learners`,
//!   `promote_after_journals`). The answer waits for the promotion, up to
//!   `timeout_ms` (default 30000); `wait=learner` answers once the learner is committed.
//! - `DELETE /admin/members/{id}` removes a member: a voter is first marked leaving (it gives
//!   up its primaries, which move as after a failure), then the active leader removes it
//!   once it holds none (the answer waits for that); a learner is removed at once. A leader asked to remove itself cedes first and redirects to the next leader, which
//!   removes it as a follower.
//!
//! Both need the admin token, change one member at a time, and answer 409 while another change
//! is in flight, 400 for a bad request (an id or address in use, an unknown id, no voter left,
//! more voters than supported, a joiner that does not answer `/status` as a node of this
//! cluster with that id), 503 while no membership is committed or no leader is active,
//! and redirect (307) to the leader's admin port from any other node. Every answer is one
//! line of text naming what happened.

use std::time::{Duration, Instant};

use actix_web::{web, HttpRequest, HttpResponse};
use bmq_metadata::{
    ClusterMembership, ClusterState, Member, MemberRole, MetadataRole, ProposeError, MAX_VOTERS,
};
use bmq_proto::NodeId;
use tracing::info;

use crate::actors::elector::CedeLeadership;
use crate::actors::metadata::{GetMetadataStatus, Propose};
use crate::admin::{refuse_unauthorized, AdminContext};

/// How long a change waits for the previous one to be applied by a majority of voters
/// (`ProposeError::MembershipNotApplied`) and followed by every partition
/// (`ProposeError::PartitionsNotFollowing`: healed under the current voters) before it gives up.
const APPLIED_WAIT: Duration = Duration::from_secs(5);

/// Polling period while waiting for a commit or a promotion.
const POLL: Duration = Duration::from_millis(20);

/// The query of `POST /admin/members`.
#[derive(Debug, serde::Deserialize)]
pub struct AddMemberQuery {
    id: u32,
    host: String,
    peer_port: u16,
    client_port: u16,
    admin_port: u16,
    #[serde(default)]
    bmqp_port: Option<u16>,
    /// `voter` (default): answer once promoted; `learner`: once added.
    #[serde(default)]
    wait: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

/// The query of `DELETE /admin/members/{id}`.
#[derive(Debug, serde::Deserialize)]
pub struct RemoveMemberQuery {
    #[serde(default)]
    timeout_ms: Option<u64>,
}

/// Why a change did not happen, as an HTTP answer (the domain endpoints answer the same).
pub(crate) enum Refusal {
    Bad(String),
    Conflict(String),
    Unavailable(String),
    Redirect(String, String),
}

impl Refusal {
    pub(crate) fn answer(self) -> HttpResponse {
        match self {
            Refusal::Bad(m) => HttpResponse::BadRequest().body(format!("{m}\n")),
            Refusal::Conflict(m) => HttpResponse::Conflict().body(format!("{m}\n")),
            Refusal::Unavailable(m) => HttpResponse::ServiceUnavailable().body(format!("{m}\n")),
            Refusal::Redirect(location, m) => HttpResponse::TemporaryRedirect()
                .insert_header(("Location", location))
                .body(format!("{m}\n")),
        }
    }
}

/// The committed state if this node is the active metadata leader; else where to go. A
/// leader still syncing (just elected, perhaps because the previous one ceded to be removed)
/// is waited for, up to [`APPLIED_WAIT`].
pub(crate) async fn leader_state(
    ctx: &AdminContext,
    req: &HttpRequest,
) -> Result<ClusterState, Refusal> {
    let syncing_until = Instant::now() + APPLIED_WAIT;
    let snapshot = loop {
        let snapshot = ctx
            .metadata
            .send(GetMetadataStatus)
            .await
            .map_err(|_| Refusal::Unavailable("metadata actor unavailable".into()))?;
        if snapshot.status.role != MetadataRole::PassiveLeader || Instant::now() >= syncing_until {
            break snapshot;
        }
        tokio::time::sleep(POLL).await;
    };
    if snapshot.status.role == MetadataRole::ActiveLeader {
        return Ok(snapshot.state);
    }
    let Some(leader) = snapshot.status.leader.filter(|l| l.0 != ctx.config.node_id) else {
        return Err(Refusal::Unavailable(
            "no active leader yet; retry shortly".into(),
        ));
    };
    let admin = snapshot
        .state
        .membership
        .as_ref()
        .and_then(|m| m.members.get(&leader))
        .map(|m| m.admin_addr())
        .or_else(|| {
            ctx.config
                .members
                .iter()
                .find(|m| m.id == leader.0)
                .map(|m| m.admin_addr())
        });
    match admin {
        Some(admin) => Err(Refusal::Redirect(
            format!(
                "http://{admin}{}",
                req.uri().path_and_query().map_or("/", |p| p.as_str())
            ),
            format!("node {leader} is the leader"),
        )),
        None => Err(Refusal::Unavailable(format!(
            "node {leader} is the leader; its admin address is unknown here"
        ))),
    }
}

fn committed_membership(state: &ClusterState) -> Result<ClusterMembership, Refusal> {
    state
        .membership
        .as_deref()
        .cloned()
        .ok_or_else(|| Refusal::Unavailable("no membership is committed yet; retry".into()))
}

/// Proposes `next` (a single change of the committed membership), retrying while a majority
/// of voters has not applied the current one yet; then waits for its commit.
async fn change(
    ctx: &AdminContext,
    next: &ClusterMembership,
    deadline: Instant,
) -> Result<(), Refusal> {
    let advisory = next.to_advisory();
    let applied_deadline = (Instant::now() + APPLIED_WAIT).min(deadline);
    loop {
        let answer = ctx
            .metadata
            .send(Propose {
                advisory: advisory.clone(),
            })
            .await
            .map_err(|_| Refusal::Unavailable("metadata actor unavailable".into()))?;
        match answer {
            Ok(_) => break,
            Err(
                ProposeError::MembershipNotApplied { .. }
                | ProposeError::PartitionsNotFollowing { .. },
            ) if Instant::now() < applied_deadline => {
                tokio::time::sleep(POLL).await;
            }
            Err(e @ ProposeError::MembershipChangeInFlight { .. }) => {
                return Err(Refusal::Conflict(e.to_string()))
            }
            Err(e @ ProposeError::Invalid(_)) => return Err(Refusal::Bad(e.to_string())),
            Err(e) => return Err(Refusal::Unavailable(e.to_string())),
        }
    }
    wait_for(ctx, deadline, |m| m.epoch >= next.epoch)
        .await
        .map(|_| ())
        .map_err(|_| {
            Refusal::Unavailable(format!(
                "membership epoch {} proposed but not committed in time (leader failover?); \
                 check bmqctl status",
                next.epoch
            ))
        })
}

/// Waits until the committed membership satisfies `done`; returns it.
async fn wait_for(
    ctx: &AdminContext,
    deadline: Instant,
    done: impl Fn(&ClusterMembership) -> bool,
) -> Result<ClusterMembership, ()> {
    loop {
        if let Ok(snapshot) = ctx.metadata.send(GetMetadataStatus).await {
            if let Some(m) = snapshot.state.membership.as_deref() {
                if done(m) {
                    return Ok(m.clone());
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(());
        }
        tokio::time::sleep(POLL).await;
    }
}

fn deadline_of(timeout_ms: Option<u64>) -> Instant {
    Instant::now() + Duration::from_millis(timeout_ms.unwrap_or(30_000).min(600_000))
}

/// `POST /admin/members`: see the module doc.
pub async fn add_member(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    query: web::Query<AddMemberQuery>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    match add(&ctx, &req, query.into_inner()).await {
        Ok(answer) => HttpResponse::Ok().body(answer),
        Err(refusal) => refusal.answer(),
    }
}

async fn add(ctx: &AdminContext, req: &HttpRequest, q: AddMemberQuery) -> Result<String, Refusal> {
    let deadline = deadline_of(q.timeout_ms);
    let wait_voter = match q.wait.as_deref() {
        None | Some("voter") => true,
        Some("learner") => false,
        Some(other) => {
            return Err(Refusal::Bad(format!(
                "wait={other:?}: expected voter or learner"
            )))
        }
    };
    let state = leader_state(ctx, req).await?;
    let current = committed_membership(&state)?;
    let id = NodeId(q.id);
    if q.id == 0 {
        return Err(Refusal::Bad(
            "0 is not a valid node id (ids start at 1)".into(),
        ));
    }
    if current.members.contains_key(&id) {
        return Err(Refusal::Bad(format!("node {id} is already a member")));
    }
    if current.voters().len() >= MAX_VOTERS {
        return Err(Refusal::Bad(format!(
            "the cluster has {MAX_VOTERS} voters, the most supported: node {id} could never vote"
        )));
    }
    if !current.removed.contains(&id) {
        check_joiner(ctx, &q).await?;
    }
    let mut next = current.clone();
    next.epoch += 1;
    next.members.insert(
        id,
        Member {
            id,
            host: q.host.clone(),
            peer_port: q.peer_port,
            client_port: q.client_port,
            admin_port: q.admin_port,
            bmqp_port: q.bmqp_port,
            role: MemberRole::Learner,
        },
    );
    // The state machine checks the rest (a removed id, an address in use, a zero port).
    change(ctx, &next, deadline).await?;
    info!(node = %id, host = %q.host, peer_port = q.peer_port, epoch = next.epoch, "member added as a learner");
    if !wait_voter {
        return Ok(format!(
            "node {id} added as a learner (membership epoch {})\n",
            next.epoch
        ));
    }
    match wait_for(ctx, deadline, |m| m.role(id) == Some(MemberRole::Voter)).await {
        Ok(m) => Ok(format!(
            "node {id} added and promoted to voter (membership epoch {}, voters {})\n",
            m.epoch,
            join_ids(&m)
        )),
        Err(()) => Err(Refusal::Unavailable(format!(
            "node {id} was added as a learner (epoch {}) but has not caught up in time: is it \
             running and can it reach the members? It stays a learner, and is promoted once it \
             holds the ledger and every partition's journal follows its primary (`bmqctl \
             status` shows its catch-up)",
            next.epoch
        ))),
    }
}

/// How long the joining node's `/status` may take to answer.
const JOINER_STATUS_TIMEOUT: Duration = Duration::from_secs(3);

/// Asks the joining node who it is before anything is proposed: its admin port must answer
/// `/status` with this cluster's name and the id it is added with, and its peer port must
/// take this node's link ([`crate::net::peers::PeerHub::probe_peer`]: under TLS, a
/// certificate of the cluster CA naming `node-<id>`, and ours accepted). So a node that is
/// not running, runs with another id, belongs to another cluster or holds the wrong
/// certificate is refused with the reason and never becomes a learner that could not catch
/// up.
async fn check_joiner(ctx: &AdminContext, q: &AddMemberQuery) -> Result<(), Refusal> {
    let addr = format!("{}:{}", q.host, q.admin_port);
    let doc = tokio::time::timeout(JOINER_STATUS_TIMEOUT, fetch_status(&addr))
        .await
        .map_err(|_| "no answer in time".to_string())
        .and_then(|r| r)
        .map_err(|e| {
            Refusal::Bad(format!(
                "node {} does not answer /status at {addr} ({e}): start it first, with its own \
                 id and addresses and the members in its [[members]]",
                q.id
            ))
        })?;
    if doc.cluster_name != ctx.config.cluster_name {
        return Err(Refusal::Bad(format!(
            "the node at {addr} belongs to cluster {:?}, not {:?}",
            doc.cluster_name, ctx.config.cluster_name
        )));
    }
    if doc.node_id != q.id {
        return Err(Refusal::Bad(format!(
            "the node at {addr} is node {}, not node {}",
            doc.node_id, q.id
        )));
    }
    // The links it needs: its peer port answers and, under TLS, proves it is node-<id> of
    // this cluster's CA and accepts ours (a joiner with a foreign CA or another node's
    // certificate would be a learner that never catches up).
    let peer_addr = format!("{}:{}", q.host, q.peer_port);
    ctx.peers
        .probe_peer(NodeId(q.id), &peer_addr)
        .await
        .map_err(|why| Refusal::Bad(format!("node {} cannot be linked to: {why}", q.id)))?;
    Ok(())
}

/// `GET /status` of a node's admin port (HTTP/1.0, the body read to the end).
async fn fetch_status(addr: &str) -> Result<bmq_proto::admin_doc::NodeStatusDoc, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(format!("GET /status HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    (&mut stream)
        .take(16 * 1024 * 1024)
        .read_to_end(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP response")?;
    let head = String::from_utf8_lossy(&response[..split]);
    if head.split_whitespace().nth(1) != Some("200") {
        return Err(format!(
            "answered {}",
            head.lines().next().unwrap_or_default()
        ));
    }
    serde_json::from_slice(&response[split + 4..]).map_err(|e| format!("not a node's /status: {e}"))
}

/// `DELETE /admin/members/{id}`: see the module doc.
pub async fn remove_member(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    path: web::Path<u32>,
    query: web::Query<RemoveMemberQuery>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    match remove(&ctx, &req, NodeId(path.into_inner()), query.into_inner()).await {
        Ok(answer) => HttpResponse::Ok().body(answer),
        Err(refusal) => refusal.answer(),
    }
}

async fn remove(
    ctx: &AdminContext,
    req: &HttpRequest,
    id: NodeId,
    q: RemoveMemberQuery,
) -> Result<String, Refusal> {
    let deadline = deadline_of(q.timeout_ms);
    let state = leader_state(ctx, req).await?;
    let current = committed_membership(&state)?;
    let Some(role) = current.role(id) else {
        return Err(Refusal::Bad(if current.removed.contains(&id) {
            format!("node {id} was removed already")
        } else {
            format!("node {id} is not a member")
        }));
    };
    if role.votes() && current.voters().len() == 1 {
        return Err(Refusal::Bad(format!(
            "node {id} is the only voter: a cluster keeps at least one"
        )));
    }
    if id.0 == ctx.config.node_id {
        return Err(cede_then_redirect(ctx, req, deadline).await);
    }
    if role == MemberRole::Learner {
        let mut next = current.clone();
        next.epoch += 1;
        next.members.remove(&id);
        next.removed.insert(id);
        change(ctx, &next, deadline).await?;
        info!(node = %id, epoch = next.epoch, "learner removed");
        return Ok(removed_answer(id, &next));
    }
    if role == MemberRole::Voter {
        let mut leaving = current.clone();
        leaving.epoch += 1;
        if let Some(m) = leaving.members.get_mut(&id) {
            m.role = MemberRole::Leaving;
        }
        change(ctx, &leaving, deadline).await?;
        info!(node = %id, epoch = leaving.epoch, "member leaving: its primaries move");
    }
    // Its primaries move (the health actor gives none to a leaving member), then the active
    // leader removes it (`MetadataConfig::promote_learners`): whichever leader is active
    // then, so a removal whose request died with its leader is finished all the same.
    match wait_for(ctx, deadline, |m| m.removed.contains(&id)).await {
        Ok(next) => {
            info!(node = %id, epoch = next.epoch, "member removed");
            Ok(removed_answer(id, &next))
        }
        Err(()) => {
            let holds = match ctx.metadata.send(GetMetadataStatus).await {
                Ok(snapshot) => snapshot
                    .state
                    .partitions
                    .values()
                    .filter(|p| p.primary == Some(id))
                    .count(),
                Err(_) => 0,
            };
            Err(Refusal::Unavailable(format!(
                "node {id} is leaving but not removed yet (still primary of {holds} \
                 partitions); the leader removes it once they moved: check bmqctl status"
            )))
        }
    }
}

fn removed_answer(id: NodeId, next: &ClusterMembership) -> String {
    format!(
        "node {id} removed (membership epoch {}, voters {})\n",
        next.epoch,
        join_ids(next)
    )
}

/// The leader asked to remove itself cedes leadership and sends the request on to the next
/// leader, which removes it as a follower: so a removed leader never leaves before the others
/// learned that its removal committed (the elector counts a voter set from its commit on, and
/// without that commit they would still count the leader that left).
async fn cede_then_redirect(ctx: &AdminContext, req: &HttpRequest, deadline: Instant) -> Refusal {
    if ctx.elector.send(CedeLeadership).await.is_err() {
        return Refusal::Unavailable("elector unavailable".into());
    }
    info!("asked to remove itself: leadership ceded, the next leader removes this node");
    loop {
        match leader_state(ctx, req).await {
            Err(redirect @ Refusal::Redirect(..)) => return redirect,
            _ if Instant::now() >= deadline => {
                return Refusal::Unavailable(
                    "leadership ceded but no other leader yet; retry the removal".into(),
                )
            }
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

fn join_ids(m: &ClusterMembership) -> String {
    m.voters()
        .iter()
        .map(|n| n.0.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
