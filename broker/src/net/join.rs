//! Joining a running cluster: the `join` setting (DESIGN.md §5a).
//!
//! A node that joins lists itself alone in its `[[members]]` and the peer addresses of some
//! current members in `join`. At its first start (its ledger holds no membership) it asks
//! them, over the peer protocol, for the committed membership ([`ask_membership`]): it dials a
//! `join` address (under TLS with its own certificate, accepting a listener certificate of
//! the cluster CA that names any member, [`PeerTls::join_connector`]), sends its `PeerHello`,
//! and reads the hello the member answers a node it does not count among its members with
//! (its committed membership; the member then closes the connection). The listener's
//! certificate must name the member id that hello claims. With the members learned, the node
//! dials them and waits to be added as a learner; until it is a voter it never stands for
//! election, and it never seeds a membership of its own.

use std::time::Duration;

use bmq_metadata::ClusterMembership;
use bmq_proto::peer::{peer_message::Kind, Channel, PeerHello, PeerMessage};
use bmq_proto::{member_name, BoxedStream, FrameCodec, FrameWriter, NodeId, PROTOCOL_VERSION};
use futures::StreamExt;
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;
use tracing::{info, warn};

use crate::net::tls::{certificate_names, PeerTls};

/// How long one attempt at a `join` address may take (connect, handshake, answer).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
/// A connection the member kept open this long without answering was taken as a link: a
/// refusal answers within a round trip, an accepted link closes only after the link
/// heartbeat timeout (1 s by default) without a heartbeat.
const ACCEPTED_AFTER: Duration = Duration::from_millis(250);
/// The pause between two rounds over every `join` address.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// What a `join` address answered.
#[derive(Debug)]
pub enum JoinAnswer {
    /// The member's committed membership (this node is not among its members yet).
    Membership {
        /// The member that answered.
        from: NodeId,
        /// Its committed membership.
        membership: ClusterMembership,
    },
    /// The member took the connection as a link: this node is a member already (added
    /// before its ledger learned it); the members dial it and tell it the membership.
    AlreadyMember,
}

/// Asks the member at `addr` for its committed membership (see the module doc), as node
/// `self_id` of cluster `cluster_name`.
///
/// Errors: in words — no answer, a failed TLS handshake, another cluster's name, a
/// certificate that does not name the member that answered, a malformed membership, a member
/// with no membership committed yet.
pub async fn ask_membership(
    addr: &str,
    self_id: NodeId,
    cluster_name: &str,
    tls: Option<&PeerTls>,
    frame_size_max: usize,
) -> Result<JoinAnswer, String> {
    let tcp = tokio::time::timeout(ATTEMPT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| "no answer within 3 s".to_string())?
        .map_err(|e| format!("cannot connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut stream, listener_cert): (BoxedStream, _) = match tls {
        None => (Box::new(tcp), None),
        Some(tls) => {
            // Any member's name is accepted here; the answer's id is checked against it below.
            let placeholder =
                rustls::pki_types::ServerName::try_from("bmq-join").expect("a valid DNS name");
            let s = tokio::time::timeout(
                ATTEMPT_TIMEOUT,
                tls.join_connector.connect(placeholder, tcp),
            )
            .await
            .map_err(|_| "the TLS handshake timed out".to_string())?
            .map_err(|e| format!("TLS handshake: {e}"))?;
            let cert = s
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.clone().into_owned());
            (Box::new(s), cert)
        }
    };
    let hello = PeerMessage {
        kind: Some(Kind::Hello(PeerHello {
            cluster_name: cluster_name.to_string(),
            node_id: self_id.0,
            channel: Channel::Control as i32,
            protocol_version: PROTOCOL_VERSION,
            membership: None,
        })),
    };
    let mut out = FrameWriter::new(frame_size_max, 64 * 1024);
    out.send(&mut stream, &hello)
        .await
        .map_err(|e| format!("cannot send the hello: {e}"))?;
    let mut frames = FramedRead::new(stream, FrameCodec::<PeerMessage>::new(frame_size_max));
    let sent = std::time::Instant::now();
    let reply = match tokio::time::timeout(ATTEMPT_TIMEOUT, frames.next()).await {
        // Open and silent: it took the connection as a member's link. (A refusal answers and
        // closes at once; a link it accepted closes only once no heartbeat came for its
        // heartbeat timeout.)
        Err(_) => return Ok(JoinAnswer::AlreadyMember),
        Ok(None) if sent.elapsed() >= ACCEPTED_AFTER => return Ok(JoinAnswer::AlreadyMember),
        Ok(None) => return Err("closed the connection without an answer".into()),
        Ok(Some(Err(e))) => return Err(format!("bad answer: {e}")),
        Ok(Some(Ok(PeerMessage {
            kind: Some(Kind::Hello(h)),
        }))) => h,
        Ok(Some(Ok(_))) => return Err("answered with something else than a hello".into()),
    };
    if reply.cluster_name != cluster_name {
        return Err(format!(
            "it belongs to cluster {:?}, not {cluster_name:?}",
            reply.cluster_name
        ));
    }
    let from = NodeId(reply.node_id);
    if let Some(cert) = &listener_cert {
        if !certificate_names(cert, &member_name(from)) {
            return Err(format!(
                "it answers as node {from}, but its certificate does not name {}",
                member_name(from)
            ));
        }
    }
    let wire = reply
        .membership
        .ok_or_else(|| format!("node {from} has no committed membership yet"))?;
    let membership = ClusterMembership::from_wire(&wire)
        .map_err(|e| format!("node {from} sent an invalid membership: {e}"))?;
    Ok(JoinAnswer::Membership { from, membership })
}

/// Asks the `join` addresses in turn, round after round (a pause of a second between rounds,
/// every failure logged), until one answers ([`ask_membership`]). Runs until it succeeds: a
/// joining node has nothing to do before it knows its cluster.
pub async fn discover_membership(
    join: &[String],
    self_id: NodeId,
    cluster_name: &str,
    tls: Option<&PeerTls>,
    frame_size_max: usize,
) -> JoinAnswer {
    loop {
        for addr in join {
            match ask_membership(addr, self_id, cluster_name, tls, frame_size_max).await {
                Ok(answer) => {
                    match &answer {
                        JoinAnswer::Membership { from, membership } => info!(
                            join = %addr,
                            member = %from,
                            epoch = membership.epoch,
                            members = ?membership.ids(),
                            "joining: learned the cluster's committed membership; waiting to be added"
                        ),
                        JoinAnswer::AlreadyMember => info!(
                            join = %addr,
                            "joining: the member takes this node as a member already"
                        ),
                    }
                    return answer;
                }
                Err(why) => {
                    warn!(join = %addr, %why, "joining: no membership from this address")
                }
            }
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}
