//! Domains through the admin HTTP server (DESIGN.md §5a):
//!
//! - `GET /admin/domains`: every committed domain, as JSON
//!   `{"version": "t:s", "domains": [{name, mode, consistency, app_ids, ..., version}]}`;
//!   `GET /admin/domains/{name}`: one domain (404 if unknown). Any node answers from its own
//!   committed state.
//! - `PUT /admin/domains/{name}?key=value&...`: creates a domain (defaults for the keys not
//!   given; 409 if it exists).
//! - `PATCH /admin/domains/{name}?key=value&...`: changes the settings named.
//! - `DELETE /admin/domains/{name}[?purge=true]`: deletes a domain; refused while its queues
//!   are assigned unless `purge=true`, which unassigns them and has their primaries remove
//!   their messages (logged and counted as purged).
//!
//! The keys are the file's `[[domains]]` keys (`bmq_metadata::domains::SETTING_KEYS`), with
//! `app_ids` comma-separated. `if_version=t:s` makes a change apply only if the domain is
//! still at that version (compare-and-set); without it a change is computed against the
//! committed domain, and computed again if another change came first. `timeout_ms` (default
//! 10000) bounds the wait for the commit.
//!
//! The changes need the admin token, are answered by the active leader once committed (any
//! other node forwards them to it and relays its answer; a request it forwarded itself gets a
//! 307 to the leader instead, so nothing is forwarded twice), and answer 400 for an unknown key or
//! an invalid value (naming it), 404 for an unknown domain, 409 for a name in use, a version
//! that moved, or a change the domain's queues forbid, 503 while no leader is active or when
//! the change was lost to a leader failover (nothing changed then; retry). A change is one
//! advisory: it is applied by every node at its LSN, or by none.

use std::time::{Duration, Instant};

use actix_web::{web, HttpRequest, HttpResponse};
use bmq_client::http;
use bmq_config::{DomainConfig, Permission};
use bmq_metadata::domains::{advisory, apply_settings, check_domain, config_to_wire};
use bmq_metadata::{ApplyError, ClusterState, DomainError, DomainState, Lsn, ProposeError};
use bmq_proto::peer::{self, domain_advisory::Change};
use bmq_proto::Term;

use crate::actors::metadata::{GetMetadataStatus, Propose};
use crate::admin::{refuse_unauthorized, AdminContext};
use crate::admin_members::{leader_state, Refusal};

/// Polling period while waiting for a commit.
const POLL: Duration = Duration::from_millis(20);

/// Registers the routes of this module.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/domains", web::get().to(list))
        .route("/admin/domains/{name}", web::get().to(show))
        .route("/admin/domains/{name}", web::put().to(create))
        .route("/admin/domains/{name}", web::patch().to(update))
        .route("/admin/domains/{name}", web::delete().to(delete));
}

/// A refusal, or a 404.
enum Answer {
    Refused(Refusal),
    NotFound(String),
}

impl From<Refusal> for Answer {
    fn from(r: Refusal) -> Self {
        Answer::Refused(r)
    }
}

impl Answer {
    fn respond(self) -> HttpResponse {
        match self {
            Answer::Refused(r) => r.answer(),
            Answer::NotFound(m) => HttpResponse::NotFound().body(format!("{m}\n")),
        }
    }
}

/// The answer to a change: a follower forwards it to the leader and relays the leader's
/// answer (the "any node answers"), unless the request was itself forwarded
/// (`bmq_client::http::FORWARDED_BY`): then it redirects, so a request is forwarded once at
/// most. A leader that cannot be reached gives 503 (nothing changed here; retry).
async fn answer(ctx: &AdminContext, req: &HttpRequest, a: Answer) -> HttpResponse {
    let Answer::Refused(Refusal::Redirect(location, why)) = a else {
        return a.respond();
    };
    if req.headers().contains_key(http::FORWARDED_BY) {
        return Refusal::Redirect(location, why).answer();
    }
    let Some((addr, path)) = location
        .strip_prefix("http://")
        .and_then(|rest| rest.find('/').map(|i| (&rest[..i], &rest[i..])))
    else {
        return Refusal::Redirect(location, why).answer();
    };
    let token = req
        .headers()
        .get("Authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let by = ctx.config.node_id.to_string();
    match http::forward(addr, req.method().as_str(), path, token, &by).await {
        Ok((code, body)) => {
            let status = actix_web::http::StatusCode::from_u16(code)
                .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
            HttpResponse::build(status).body(body)
        }
        Err(error) => Refusal::Unavailable(format!(
            "{why}, and forwarding to it at {addr} failed: {error:#}; nothing changed here, retry"
        ))
        .answer(),
    }
}

/// The HTTP answer for a domain rule a change breaks.
fn refused(error: DomainError) -> Answer {
    match error {
        DomainError::Unknown { .. } => Answer::NotFound(error.to_string()),
        DomainError::Exists { .. }
        | DomainError::VersionConflict { .. }
        | DomainError::ChangeWithQueues { .. }
        | DomainError::HasQueues { .. } => Answer::Refused(Refusal::Conflict(error.to_string())),
        DomainError::NotSeeded => Answer::Refused(Refusal::Unavailable(error.to_string())),
        _ => Answer::Refused(Refusal::Bad(error.to_string())),
    }
}

/// The committed domains on this node.
async fn committed(ctx: &AdminContext) -> Result<std::sync::Arc<DomainState>, Answer> {
    let snapshot = ctx
        .metadata
        .send(GetMetadataStatus)
        .await
        .map_err(|_| Refusal::Unavailable("metadata actor unavailable".into()))?;
    snapshot
        .state
        .domains
        .clone()
        .ok_or_else(|| Answer::Refused(Refusal::Unavailable(DomainError::NotSeeded.to_string())))
}

fn json(value: &impl serde::Serialize) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(serde_json::to_string_pretty(value).unwrap_or_default() + "\n")
}

/// `GET /admin/domains`.
async fn list(ctx: web::Data<AdminContext>) -> HttpResponse {
    match committed(&ctx).await {
        Ok(domains) => {
            #[derive(serde::Serialize)]
            struct ListJson<'a> {
                version: Lsn,
                domains: Vec<&'a bmq_metadata::Domain>,
            }
            json(&ListJson {
                version: domains.version,
                domains: domains.domains.values().collect(),
            })
        }
        Err(a) => a.respond(),
    }
}

/// `GET /admin/domains/{name}`.
async fn show(ctx: web::Data<AdminContext>, path: web::Path<String>) -> HttpResponse {
    let name = path.into_inner();
    match committed(&ctx).await {
        Ok(domains) => match domains.get(&name) {
            Some(d) => json(d),
            None => Answer::NotFound(DomainError::Unknown { name }.to_string()).respond(),
        },
        Err(a) => a.respond(),
    }
}

/// What a request asks besides settings.
struct Control {
    settings: Vec<(String, String)>,
    if_version: Option<Lsn>,
    purge: bool,
    deadline: Instant,
}

fn parse_lsn(text: &str) -> Option<Lsn> {
    let (term, sequence) = text.split_once(':')?;
    Some(Lsn::new(Term(term.parse().ok()?), sequence.parse().ok()?))
}

fn control(query: Vec<(String, String)>) -> Result<Control, Answer> {
    let mut c = Control {
        settings: Vec::new(),
        if_version: None,
        purge: false,
        deadline: Instant::now() + Duration::from_secs(10),
    };
    for (key, value) in query {
        match key.as_str() {
            "if_version" => {
                c.if_version = Some(parse_lsn(&value).ok_or_else(|| {
                    Refusal::Bad(format!("if_version: {value:?} is not an LSN term:seq"))
                })?)
            }
            "purge" => {
                c.purge = match value.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => {
                        return Err(Refusal::Bad(format!(
                            "purge: {value:?}: expected true or false"
                        ))
                        .into())
                    }
                }
            }
            "timeout_ms" => {
                let ms: u64 = value
                    .parse()
                    .map_err(|_| Refusal::Bad(format!("timeout_ms: {value:?} is not a number")))?;
                c.deadline = Instant::now() + Duration::from_millis(ms.min(600_000));
            }
            _ => c.settings.push((key, value)),
        }
    }
    Ok(c)
}

/// Who asks: the name of the admin token presented (`admin` for `admin.token`), or
/// `anonymous` when the admin actions need no token.
fn requester(ctx: &AdminContext, req: &HttpRequest) -> String {
    let presented = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(secret) = presented else {
        return "anonymous".into();
    };
    if ctx
        .config
        .admin
        .token
        .as_deref()
        .is_some_and(|t| bmq_config::constant_time_eq(t.as_bytes(), secret.as_bytes()))
    {
        return "admin".into();
    }
    match ctx.config.auth.find(secret) {
        Some(t) if t.permissions.contains(&Permission::Admin) => t.name.clone(),
        _ => "anonymous".into(),
    }
}

/// Sets what the leader's rules check and the audit line shows.
fn stamp(
    mut a: peer::Advisory,
    expected: Option<Lsn>,
    previous: Option<peer::DomainInfo>,
    purge: bool,
) -> peer::Advisory {
    if let Some(peer::advisory::Kind::Domain(d)) = a.kind.as_mut() {
        d.expected_version = expected.map(Into::into);
        d.previous = previous;
        d.purge = purge;
    }
    a
}

/// Proposes the change `build` computes from the leader's committed state, computing it
/// again (until `deadline`) while another change of the domain is proposed and not
/// committed (unless the client gave the version, `explicit`); waits until it is committed,
/// then answers the committed domains and the change's LSN.
async fn change(
    ctx: &AdminContext,
    req: &HttpRequest,
    deadline: Instant,
    explicit: bool,
    build: impl Fn(&ClusterState) -> Result<peer::Advisory, Answer>,
    applied: impl Fn(&DomainState, Lsn) -> bool,
) -> Result<(std::sync::Arc<DomainState>, Lsn), Answer> {
    let lsn = loop {
        let state = leader_state(ctx, req).await?;
        if state.domains.is_none() {
            return Err(refused(DomainError::NotSeeded));
        }
        let advisory = build(&state)?;
        let answer = ctx
            .metadata
            .send(Propose { advisory })
            .await
            .map_err(|_| Refusal::Unavailable("metadata actor unavailable".into()))?;
        match answer {
            Ok(lsn) => break lsn,
            Err(ProposeError::Invalid(ApplyError::Domain(DomainError::VersionConflict {
                ..
            }))) if !explicit && Instant::now() < deadline => {
                // Another change of the domain is proposed and not committed yet: this one is
                // computed again from its result once it is.
                tokio::time::sleep(POLL).await;
            }
            Err(ProposeError::Invalid(ApplyError::Domain(e))) => return Err(refused(e)),
            Err(e @ ProposeError::Invalid(_)) => return Err(Refusal::Bad(e.to_string()).into()),
            Err(e) => return Err(Refusal::Unavailable(format!("{e}; retry")).into()),
        }
    };
    loop {
        if let Ok(snapshot) = ctx.metadata.send(GetMetadataStatus).await {
            if snapshot.status.committed_lsn >= lsn {
                if let Some(domains) = snapshot.state.domains.clone() {
                    if applied(&domains, lsn) {
                        return Ok((domains, lsn));
                    }
                }
                return Err(Refusal::Unavailable(format!(
                    "the change proposed at {lsn} was lost to a leader failover: nothing changed; retry"
                ))
                .into());
            }
        }
        if Instant::now() >= deadline {
            return Err(Refusal::Unavailable(format!(
                "the change proposed at {lsn} is not committed in time (leader failover?): it \
                 applies on every node or on none; check `bmqctl domain show`"
            ))
            .into());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `PUT /admin/domains/{name}`: see the module doc.
async fn create(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    let name = path.into_inner();
    let run = async {
        let c = control(query.into_inner())?;
        let config =
            apply_settings(DomainConfig::new(name.clone()), &c.settings).map_err(refused)?;
        check_domain(&config).map_err(refused)?;
        let by = requester(&ctx, &req);
        let (_, lsn) = change(
            &ctx,
            &req,
            c.deadline,
            false,
            |state| {
                if state
                    .domains
                    .as_ref()
                    .is_some_and(|d| d.get(&name).is_some())
                {
                    return Err(refused(DomainError::Exists { name: name.clone() }));
                }
                let wire = config_to_wire(&config, Lsn::ZERO);
                Ok(advisory(Change::Create(wire), &by))
            },
            |domains, lsn| domains.get(&name).is_some_and(|d| d.version >= lsn),
        )
        .await?;
        Ok::<_, Answer>(format!("domain {name} created at LSN {lsn}\n"))
    };
    match run.await {
        Ok(text) => HttpResponse::Ok().body(text),
        Err(a) => answer(&ctx, &req, a).await,
    }
}

/// `PATCH /admin/domains/{name}`: see the module doc.
async fn update(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    let name = path.into_inner();
    let run = async {
        let c = control(query.into_inner())?;
        if c.settings.is_empty() {
            return Err(Refusal::Bad(format!(
                "nothing to change: name at least one of {}",
                bmq_metadata::domains::SETTING_KEYS.join(", ")
            ))
            .into());
        }
        let by = requester(&ctx, &req);
        let (_, lsn) = change(
            &ctx,
            &req,
            c.deadline,
            c.if_version.is_some(),
            |state| {
                let current = state
                    .domains
                    .as_ref()
                    .and_then(|d| d.get(&name))
                    .ok_or_else(|| refused(DomainError::Unknown { name: name.clone() }))?;
                let next = apply_settings(current.config.clone(), &c.settings).map_err(refused)?;
                let wire = config_to_wire(&next, Lsn::ZERO);
                Ok(stamp(
                    advisory(Change::Update(wire), &by),
                    Some(c.if_version.unwrap_or(current.version)),
                    Some(config_to_wire(&current.config, current.version)),
                    false,
                ))
            },
            |domains, lsn| domains.get(&name).is_some_and(|d| d.version >= lsn),
        )
        .await?;
        Ok::<_, Answer>(format!("domain {name} updated at LSN {lsn}\n"))
    };
    match run.await {
        Ok(text) => HttpResponse::Ok().body(text),
        Err(a) => answer(&ctx, &req, a).await,
    }
}

/// `DELETE /admin/domains/{name}`: see the module doc.
async fn delete(
    ctx: web::Data<AdminContext>,
    req: HttpRequest,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> HttpResponse {
    if let Some(refused) = refuse_unauthorized(&ctx, &req) {
        return refused;
    }
    let name = path.into_inner();
    let run = async {
        let c = control(query.into_inner())?;
        if let Some((key, _)) = c.settings.first() {
            return Err(refused(DomainError::UnknownKey { key: key.clone() }));
        }
        let by = requester(&ctx, &req);
        let queues = std::cell::Cell::new(0usize);
        let (_, lsn) = change(
            &ctx,
            &req,
            c.deadline,
            c.if_version.is_some(),
            |state| {
                let current = state
                    .domains
                    .as_ref()
                    .and_then(|d| d.get(&name))
                    .ok_or_else(|| refused(DomainError::Unknown { name: name.clone() }))?;
                queues.set(state.domain_queues(&name).count());
                Ok(stamp(
                    advisory(Change::Delete(name.clone()), &by),
                    Some(c.if_version.unwrap_or(current.version)),
                    Some(config_to_wire(&current.config, current.version)),
                    c.purge,
                ))
            },
            |domains, lsn| domains.get(&name).is_none() && domains.version >= lsn,
        )
        .await?;
        Ok::<_, Answer>(if c.purge {
            format!(
                "domain {name} deleted at LSN {lsn}; {} queue(s) unassigned, their messages purged\n",
                queues.get()
            )
        } else {
            format!("domain {name} deleted at LSN {lsn}\n")
        })
    };
    match run.await {
        Ok(text) => HttpResponse::Ok().body(text),
        Err(a) => answer(&ctx, &req, a).await,
    }
}
