//! `bmqctl status`: gather every node's `GET /status` document and print the cluster.
//!
//! Each node serves a [`NodeStatusDoc`] on its admin port. This module fetches them with a tiny
//! HTTP/1.1 client ([`fetch_status`]: one `GET`, `Connection: close`, bounded size and time),
//! prints a nodes table, then the partitions and queues as the leader sees them, or a JSON array
//! with `--json`. [`wait_for_leader`] polls the same documents until the cluster agrees on an
//! active leader (used by `bmqctl cluster up` and by tests).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use serde::Serialize;

use bmq_proto::admin_doc::{NodeStatusDoc, PartitionDoc};

/// Admin addresses of the default local cluster (`bmqctl cluster up` with default ports).
pub const DEFAULT_ADMINS: &str = "127.0.0.1:30301,127.0.0.1:30302,127.0.0.1:30303";

/// Poll period of [`wait_for_leader`].
pub const WAIT_FOR_LEADER_POLL_PERIOD: Duration = Duration::from_millis(100);

/// Metadata role of a leader that may assign queues and primaries (DESIGN.md §5).
pub const ACTIVE_LEADER_ROLE: &str = "active_leader";

/// Arguments of `bmqctl status`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Show the cluster: nodes, leader, term, LSNs, partitions and queues",
    after_help = "Examples:\n  \
        bmqctl status\n  \
        bmqctl status --admin 127.0.0.1:30301,127.0.0.1:30302 --json\n  \
        BMQ_ADMIN=10.0.0.1:30301,10.0.0.2:30301 bmqctl status"
)]
pub struct StatusArgs {
    /// Admin HTTP address of a node, host:port; repeat the flag or separate with commas
    /// [default: $BMQ_ADMIN, else 127.0.0.1:30301,127.0.0.1:30302,127.0.0.1:30303].
    #[arg(long = "admin", value_name = "HOST:PORT", value_delimiter = ',')]
    pub admin: Vec<String>,
    /// Print a JSON array of `{"admin", "status"}` or `{"admin", "error"}` objects instead of
    /// tables.
    #[arg(long)]
    pub json: bool,
    /// Timeout of each node's request, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// Fetches and decodes `GET http://<addr>/status`.
///
/// `addr` is `host:port`. The whole exchange (connect, request, response) must finish within
/// `timeout`, and the response may not exceed [`crate::http::RESPONSE_MAX_BYTES`].
///
/// Errors: connection failure, timeout, a non-200 status, an oversized or malformed response, or
/// a body that is not a [`NodeStatusDoc`].
pub async fn fetch_status(addr: &str, timeout: Duration) -> anyhow::Result<NodeStatusDoc> {
    let body = tokio::time::timeout(timeout, crate::http::get(addr, "/status"))
        .await
        .map_err(|_| anyhow!("no answer within {} ms", timeout.as_millis()))??;
    serde_json::from_slice(&body).context("invalid /status document")
}

/// Queries every address concurrently; results are in the order of `admins`.
async fn fetch_all(
    admins: &[String],
    timeout: Duration,
) -> Vec<(String, anyhow::Result<NodeStatusDoc>)> {
    let results =
        futures::future::join_all(admins.iter().map(|addr| fetch_status(addr, timeout))).await;
    admins.iter().cloned().zip(results).collect()
}

/// One element of the `--json` output.
#[derive(Debug, Serialize)]
struct JsonEntry<'a> {
    admin: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a NodeStatusDoc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// Runs `bmqctl status`: queries every node, prints tables (or JSON with `--json`).
///
/// Errors: when no node answered (after printing what was found).
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let admins = resolve_admins(&args.admin);
    if admins.is_empty() {
        bail!("no admin address given (use --admin host:port)");
    }
    let results = fetch_all(&admins, Duration::from_millis(args.timeout_ms)).await;
    if args.json {
        let entries: Vec<JsonEntry<'_>> = results
            .iter()
            .map(|(admin, r)| JsonEntry {
                admin,
                status: r.as_ref().ok(),
                error: r.as_ref().err().map(|e| format!("{e:#}")),
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&entries)?);
    } else {
        out!("{}", render_status(&results));
    }
    if results.iter().all(|(_, r)| r.is_err()) {
        bail!("no node answered ({})", admins.join(", "));
    }
    Ok(())
}

/// The admin addresses to query: `--admin` if given, else `$BMQ_ADMIN` (comma-separated), else
/// [`DEFAULT_ADMINS`]. Entries are trimmed; empty ones are dropped.
pub fn resolve_admins(flag: &[String]) -> Vec<String> {
    let given = normalize_admins(flag);
    if !given.is_empty() {
        return given;
    }
    match std::env::var("BMQ_ADMIN") {
        Ok(env) if !env.trim().is_empty() => normalize_admins(&[env]),
        _ => normalize_admins(&[DEFAULT_ADMINS.to_string()]),
    }
}

/// Trims, drops empty entries and splits any remaining commas.
fn normalize_admins(admins: &[String]) -> Vec<String> {
    admins
        .iter()
        .flat_map(|a| a.split(','))
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// The node whose view of partitions and queues is shown: the node that is leader by its own
/// account (the active one first), else the first reachable node.
fn reference_node(docs: &[&NodeStatusDoc]) -> Option<usize> {
    let is_leader = |d: &NodeStatusDoc| d.elector.state == "leader";
    docs.iter()
        .position(|d| is_leader(d) && d.metadata.role == ACTIVE_LEADER_ROLE)
        .or_else(|| docs.iter().position(|d| is_leader(d)))
        .or(if docs.is_empty() { None } else { Some(0) })
}

fn opt_id(id: Option<u32>) -> String {
    id.map_or_else(|| "-".to_string(), |id| id.to_string())
}

/// Renders the nodes, partitions and queues tables.
fn render_status(results: &[(String, anyhow::Result<NodeStatusDoc>)]) -> String {
    let mut out = String::new();
    let headers = [
        "NODE",
        "ADMIN",
        "STATE",
        "TERM",
        "LEADER",
        "ROLE",
        "LAST LSN",
        "COMMITTED LSN",
        "PEERS SEEN",
        "SESSIONS",
        "READY",
    ];
    let mut rows = Vec::new();
    for (admin, r) in results {
        match r {
            Ok(d) => {
                let mut seen: Vec<u32> = d
                    .peers
                    .iter()
                    .filter(|p| p.connected)
                    .map(|p| p.node_id)
                    .collect();
                seen.sort_unstable();
                let seen = if seen.is_empty() {
                    "-".to_string()
                } else {
                    seen.iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                };
                rows.push(vec![
                    d.node_id.to_string(),
                    admin.clone(),
                    d.elector.state.clone(),
                    d.elector.term.to_string(),
                    opt_id(d.elector.leader),
                    d.metadata.role.clone(),
                    d.metadata.last_lsn.clone(),
                    d.metadata.committed_lsn.clone(),
                    seen,
                    d.client_sessions.to_string(),
                    if d.ready { "yes" } else { "no" }.to_string(),
                ]);
            }
            Err(e) => rows.push(vec![
                "?".to_string(),
                admin.clone(),
                format!("unreachable: {e:#}"),
            ]),
        }
    }
    out.push_str(&render_table(&headers, &rows));

    let docs: Vec<&NodeStatusDoc> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    let Some(i) = reference_node(&docs) else {
        return out;
    };
    let d = docs[i];
    let whose = if d.elector.state == "leader" {
        format!("node {}, the leader", d.node_id)
    } else {
        format!("node {}, not a leader", d.node_id)
    };

    if let Some(m) = &d.membership {
        let ids = |role: &str| {
            let ids: Vec<String> = m
                .members
                .iter()
                .filter(|x| x.role == role)
                .map(|x| x.node_id.to_string())
                .collect();
            if ids.is_empty() {
                "-".to_string()
            } else {
                ids.join(",")
            }
        };
        let _ = writeln!(
            out,
            "\nmembership (epoch {}, as seen by {whose}): voters {}  learners {}  leaving {}",
            m.epoch,
            ids("voter"),
            ids("learner"),
            ids("leaving")
        );
        for learner in m.members.iter().filter(|x| x.role == "learner") {
            let progress = learner.catch_up.as_ref().map_or_else(
                || "no report yet".to_string(),
                |c| {
                    format!(
                        "ledger at epoch {}, journals of {}/{} partitions follow their primary",
                        c.membership_epoch, c.partitions_following, c.partitions
                    )
                },
            );
            let _ = writeln!(out, "  learner {} catching up: {progress}", learner.node_id);
        }
        for d in &docs {
            if let Some(why) = d
                .membership
                .as_ref()
                .and_then(|m| m.file_disagrees.as_ref())
            {
                let _ = writeln!(out, "  node {}'s file differs: {why}", d.node_id);
            }
        }
    }

    let _ = writeln!(out, "\npartitions (as seen by {whose}):");
    if d.partitions.is_empty() {
        out.push_str("  (none)\n");
    } else {
        let rows: Vec<Vec<String>> = d
            .partitions
            .iter()
            .map(|p| partition_row(p, &docs))
            .collect();
        out.push_str(&render_table(
            &[
                "PARTITION",
                "PRIMARY",
                "LEASE",
                "STATUS",
                "MESSAGES",
                "UNCOMMITTED",
                "REPLICA BEHIND",
                "JOURNAL",
                "DISK",
            ],
            &rows,
        ));
    }

    let _ = writeln!(out, "\nqueues (as seen by {whose}):");
    if d.queues.is_empty() {
        out.push_str("  (none)\n");
    } else {
        let rows: Vec<Vec<String>> = d
            .queues
            .iter()
            .map(|q| vec![q.uri.clone(), q.partition_id.to_string()])
            .collect();
        out.push_str(&render_table(&["URI", "PARTITION"], &rows));
    }
    out
}

/// A row of the partitions table: the committed view of `p` (primary, lease, status), then
/// what its active primary's own document says of it (messages held, records waiting for a
/// quorum, records the slowest replica lacks, journal size; `-` when the partition has no
/// active primary or its document is not among `docs`), and `full` when any node's last
/// journal write for it failed for a full disk (else `re-install N,..` while those nodes' journals,
/// set aside as corrupt, wait for their re-install).
fn partition_row(p: &PartitionDoc, docs: &[&NodeStatusDoc]) -> Vec<String> {
    // Each node's own view of this partition: `(node, its entry)`.
    let views = docs.iter().filter_map(|d| {
        let q = d
            .partitions
            .iter()
            .find(|q| q.partition_id == p.partition_id)?;
        Some((d.node_id, q))
    });
    // A primary still healing (passive) has committed nothing of its lease yet.
    let at_primary = p
        .primary
        .filter(|_| p.status == "active")
        .and_then(|primary| views.clone().find(|(node, _)| *node == primary))
        .map(|(_, q)| q);
    let figure = |f: fn(&PartitionDoc) -> String| at_primary.map_or("-".to_string(), f);
    let disk_full = views.clone().any(|(_, q)| q.disk_full);
    let reinstalling: Vec<String> = views
        .filter(|(_, q)| q.needs_install)
        .map(|(node, _)| node.to_string())
        .collect();
    vec![
        p.partition_id.to_string(),
        opt_id(p.primary),
        p.primary_lease_id.to_string(),
        p.status.clone(),
        figure(|q| q.messages.to_string()),
        figure(|q| {
            q.journal_last_sequence
                .saturating_sub(q.committed_sequence)
                .to_string()
        }),
        figure(|q| q.replication_lag.to_string()),
        figure(|q| format!("{:.1} MiB", q.journal_bytes as f64 / (1u64 << 20) as f64)),
        if disk_full {
            "full".to_string()
        } else if !reinstalling.is_empty() {
            // A journal found corrupt there, set aside and not yet re-installed.
            format!("re-install {}", reinstalling.join(","))
        } else {
            "ok".to_string()
        },
    ]
}

/// Renders left-aligned columns separated by two spaces. A row shorter than the headers has its
/// last cell run across the remaining columns (used for "unreachable: ..." rows).
fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        if row.len() < headers.len() {
            // Spanning cell: it does not widen its column.
            for (w, cell) in widths.iter_mut().zip(&row[..row.len().saturating_sub(1)]) {
                *w = (*w).max(cell.chars().count());
            }
        } else {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>, n: usize| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            if i + 1 == n {
                s.push_str(cell);
            } else {
                let _ = write!(s, "{cell:<width$}  ", width = widths[i]);
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied(), headers.len());
    for row in rows {
        line(&mut row.iter().map(String::as_str), row.len());
    }
    out
}

/// What [`wait_for_leader`] saw at its last poll, for its timeout error.
fn describe(results: &[(String, anyhow::Result<NodeStatusDoc>)]) -> String {
    results
        .iter()
        .map(|(admin, r)| match r {
            Ok(d) => format!(
                "node {} ({admin}): {} term {} leader {} role {}",
                d.node_id,
                d.elector.state,
                d.elector.term,
                opt_id(d.elector.leader),
                d.metadata.role
            ),
            Err(e) => format!("{admin}: unreachable: {e:#}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The agreed leader and its term, if every reachable node names the same leader, that leader
/// answered, says it is the leader, and its metadata role is `active_leader`.
fn agreed_leader(results: &[(String, anyhow::Result<NodeStatusDoc>)]) -> Option<(u32, u64)> {
    let docs: Vec<&NodeStatusDoc> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    let leader = docs.first()?.elector.leader?;
    if docs.iter().any(|d| d.elector.leader != Some(leader)) {
        return None;
    }
    let l = docs.iter().find(|d| d.node_id == leader)?;
    (l.elector.state == "leader" && l.metadata.role == ACTIVE_LEADER_ROLE)
        .then_some((leader, l.elector.term))
}

/// Polls every `admins` node each [`WAIT_FOR_LEADER_POLL_PERIOD`] until all reachable nodes
/// agree on one leader, the leader itself answers, and its metadata role is `active_leader`.
///
/// Returns `(leader node id, term)`. Errors: `timeout` elapsed first; the message describes what
/// each node said at the last poll.
pub async fn wait_for_leader(admins: &[String], timeout: Duration) -> anyhow::Result<(u32, u64)> {
    if admins.is_empty() {
        bail!("no admin address to poll");
    }
    let deadline = Instant::now() + timeout;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let request_timeout = remaining.clamp(Duration::from_millis(1), Duration::from_secs(1));
        let results = fetch_all(admins, request_timeout).await;
        if let Some(found) = agreed_leader(&results) {
            return Ok(found);
        }
        if Instant::now() + WAIT_FOR_LEADER_POLL_PERIOD >= deadline {
            bail!(
                "no agreed active leader within {} ms: {}",
                timeout.as_millis(),
                describe(&results)
            );
        }
        tokio::time::sleep(WAIT_FOR_LEADER_POLL_PERIOD).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_proto::admin_doc::{ElectorDoc, MetadataDoc, PeerDoc, QueueDoc};
    use clap::Parser;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn doc(node_id: u32, state: &str, leader: Option<u32>, role: &str) -> NodeStatusDoc {
        NodeStatusDoc {
            node_id,
            cluster_name: "local".into(),
            version: "0.1.0".into(),
            elector: ElectorDoc {
                state: state.into(),
                term: 3,
                leader,
                reason: "started".into(),
                quorum: 2,
            },
            metadata: MetadataDoc {
                role: role.into(),
                term: 3,
                last_lsn: "3:7".into(),
                committed_lsn: "3:6".into(),
                uncommitted: 1,
            },
            partitions: vec![PartitionDoc {
                partition_id: 0,
                primary: Some(node_id),
                primary_lease_id: 2,
                status: "active".into(),
                replicas: vec![1, 2, 3],
                messages: 10,
                journal_last_sequence: 120,
                committed_sequence: 117,
                replication_lag: 5,
                journal_bytes: 64 << 20,
                disk_full: false,
                needs_install: false,
            }],
            queues: vec![QueueDoc {
                uri: "bmq://bmq.test/orders".into(),
                partition_id: 0,
                queue_key: 1,
            }],
            peers: vec![
                PeerDoc {
                    node_id: 3,
                    connected: true,
                },
                PeerDoc {
                    node_id: 2,
                    connected: true,
                },
                PeerDoc {
                    node_id: 4,
                    connected: false,
                },
            ],
            client_sessions: 5,
            ready: true,
            membership: None,
            config_reload: None,
            domains: None,
        }
    }

    /// Serves each connection the next canned response of `responses` (repeating the last).
    async fn serve(responses: Vec<Vec<u8>>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let mut i = 0;
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let response = responses[i.min(responses.len() - 1)].clone();
                i += 1;
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut req = Vec::new();
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        let n = s.read(&mut buf).await.unwrap();
                        if n == 0 {
                            return;
                        }
                        req.extend_from_slice(&buf[..n]);
                    }
                    assert!(req.starts_with(b"GET /status HTTP/1.1\r\n"));
                    let _ = s.write_all(&response).await;
                });
            }
        });
        addr
    }

    fn ok_json(d: &NodeStatusDoc) -> Vec<u8> {
        let body = serde_json::to_vec(d).unwrap();
        let mut r = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(&body);
        r
    }

    #[tokio::test]
    async fn fetch_status_decodes_a_served_document() {
        // A node serving a valid document is decoded; a refused connection is an error.
        let d = doc(1, "leader", Some(1), "active_leader");
        let addr = serve(vec![ok_json(&d)]).await;
        let got = fetch_status(&addr, Duration::from_secs(2)).await.unwrap();
        assert_eq!(got, d);

        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_addr = closed.local_addr().unwrap().to_string();
        drop(closed);
        assert!(fetch_status(&closed_addr, Duration::from_secs(2))
            .await
            .is_err());
    }

    #[tokio::test]
    async fn fetch_status_times_out_on_a_silent_server() {
        // A server that accepts but never answers trips the timeout.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _keep = tokio::spawn(async move {
            let (_s, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        let e = fetch_status(&addr, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no answer within 200 ms"), "{e}");
    }

    #[test]
    fn renders_nodes_partitions_and_queues() {
        // The nodes table lists every node (unreachable ones with their error), and the
        // partitions and queues come from the leader.
        let results = vec![
            (
                "127.0.0.1:30301".to_string(),
                Ok(doc(1, "follower", Some(2), "follower")),
            ),
            (
                "127.0.0.1:30302".to_string(),
                Ok(doc(2, "leader", Some(2), "active_leader")),
            ),
            (
                "127.0.0.1:30303".to_string(),
                Err(anyhow!("cannot connect to 127.0.0.1:30303")),
            ),
        ];
        let out = render_status(&results);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NODE  ADMIN"), "{out}");
        assert!(
            lines[1].starts_with("1     127.0.0.1:30301  follower"),
            "{out}"
        );
        assert!(lines[1].contains("3:7"), "{out}");
        assert!(lines[1].contains(" 2,3 "), "{out}");
        assert!(lines[1].ends_with("yes"), "{out}");
        assert_eq!(
            lines[3],
            "?     127.0.0.1:30303  unreachable: cannot connect to 127.0.0.1:30303"
        );
        assert!(
            out.contains("partitions (as seen by node 2, the leader):"),
            "{out}"
        );
        // Messages, records waiting for a quorum (120 - 117) and the slowest replica's lag
        // come from the primary's own document (node 2's).
        assert!(
            out.contains(
                "PARTITION  PRIMARY  LEASE  STATUS  MESSAGES  UNCOMMITTED  REPLICA BEHIND  \
                 JOURNAL   DISK\n\
                 0          2        2      active  10        3            5               \
                 64.0 MiB  ok\n"
            ),
            "{out}"
        );
        assert!(out.contains("bmq://bmq.test/orders  0"), "{out}");
    }

    #[test]
    fn partition_figures_need_the_active_primarys_document() {
        let leader = doc(2, "leader", Some(2), "active_leader");
        let mut replica = doc(3, "follower", Some(2), "follower");
        let mut p = leader.partitions[0].clone();
        // Primary 1's document is missing: its figures are unknown; node 3's disk is full.
        p.primary = Some(1);
        replica.partitions[0].disk_full = true;
        let row = partition_row(&p, &[&leader, &replica]);
        assert_eq!(row, ["0", "1", "2", "active", "-", "-", "-", "-", "full"]);
        // A passive primary (healing) has committed nothing of its lease yet: no figures.
        p.primary = Some(2);
        p.status = "passive".into();
        let row = partition_row(&p, &[&leader]);
        assert_eq!(row, ["0", "2", "2", "passive", "-", "-", "-", "-", "ok"]);
    }

    #[test]
    fn agreement_needs_an_active_leader_that_everyone_follows() {
        // All reachable nodes must name the same leader, which must be active.
        let ok = |d| ("a".to_string(), Ok(d));
        let down = ("b".to_string(), Err(anyhow!("down")));
        let agreed = vec![
            ok(doc(1, "follower", Some(2), "follower")),
            ok(doc(2, "leader", Some(2), "active_leader")),
            down,
        ];
        assert_eq!(agreed_leader(&agreed), Some((2, 3)));
        let passive = vec![
            ok(doc(1, "follower", Some(2), "follower")),
            ok(doc(2, "leader", Some(2), "passive_leader")),
        ];
        assert_eq!(agreed_leader(&passive), None);
        let split = vec![
            ok(doc(1, "follower", Some(3), "follower")),
            ok(doc(2, "leader", Some(2), "active_leader")),
        ];
        assert_eq!(agreed_leader(&split), None);
        let leader_unseen = vec![ok(doc(1, "follower", Some(2), "follower"))];
        assert_eq!(agreed_leader(&leader_unseen), None);
        let leaderless = vec![ok(doc(1, "follower", None, "follower"))];
        assert_eq!(agreed_leader(&leaderless), None);
    }

    #[tokio::test]
    async fn wait_for_leader_polls_until_agreement() {
        // A node that first has no leader, then an active one, is waited for; a node that never
        // agrees makes the wait time out with a description.
        let first = doc(1, "follower", None, "follower");
        let then = doc(1, "leader", Some(1), "active_leader");
        let addr = serve(vec![ok_json(&first), ok_json(&first), ok_json(&then)]).await;
        let got = wait_for_leader(&[addr], Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got, (1, 3));

        let never = serve(vec![ok_json(&first)]).await;
        let e = wait_for_leader(&[never], Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no agreed active leader"), "{e}");
        assert!(e.to_string().contains("follower term 3 leader -"), "{e}");
    }

    #[test]
    fn admin_flag_accepts_commas_and_repeats() {
        // --admin may be repeated or comma-separated, and defaults to the local cluster.
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: StatusArgs,
        }
        let cli = Cli::try_parse_from(["t", "--admin", "a:1,b:2", "--admin", "c:3"]).unwrap();
        assert_eq!(cli.args.admin, vec!["a:1", "b:2", "c:3"]);
        assert_eq!(normalize_admins(&[" a:1 ".into(), "".into()]), vec!["a:1"]);
        assert_eq!(resolve_admins(&cli.args.admin), vec!["a:1", "b:2", "c:3"]);
        let cli = Cli::try_parse_from(["t", "--json"]).unwrap();
        assert!(cli.args.admin.is_empty());
        assert!(cli.args.json);
        assert_eq!(cli.args.timeout_ms, 2000);
        if std::env::var_os("BMQ_ADMIN").is_none() {
            let admins = resolve_admins(&cli.args.admin);
            assert_eq!(admins.len(), 3);
            assert_eq!(admins[2], "127.0.0.1:30303");
        }
    }
}
