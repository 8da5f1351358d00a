//! Security with real broker processes over real TCP: mutual TLS on the peer links,
//! TLS and tokens on the client listener, the admin token, and bad input on a secured cluster.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_broker::net::tls::PeerTls;
use bmq_client::{Client, ClientConfig, ClientError, OpenOptions};
use bmq_config::BrokerConfig;
use bmq_config::{Permission, TokenConfig};
use bmq_proto::client::{AckStatus, StatusCode};
use bmq_proto::peer::{
    elector_message, peer_message::Kind, Channel, ElectionProposal, ElectorMessage,
    LeaderHeartbeat, PeerHello, PeerMessage,
};
use bmq_proto::{member_name, BoxedStream};
use bmq_proto::{FrameCodec, PROTOCOL_VERSION};
use bmq_tests::Cluster;
use bmqctl::dev_ca::{generate_dev_ca, DevCaFiles};
use futures::SinkExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

/// Secret of the token allowed to produce and consume on `bmq.test`.
const APP_TOKEN: &str = "app-token-0123456789abcdef";
/// Secret of the token allowed only to produce on `bmq.test`.
const WRITER_TOKEN: &str = "writer-token-0123456789abcdef";
/// The admin token.
const ADMIN_TOKEN: &str = "admin-token-0123456789abcdef";
/// The term a rogue process announces.
const HUGE_TERM: u64 = 1_000_000_000;

/// A cluster whose nodes run mutual TLS on peer links, TLS on the client listener, the two
/// tokens above and the admin token, with a development CA in `ca_dir`.
struct SecureCluster {
    cluster: Cluster,
    ca: DevCaFiles,
    _ca_dir: tempfile::TempDir,
}

fn secure_cluster(n: usize, tls: bool) -> anyhow::Result<SecureCluster> {
    let ca_dir = tempfile::tempdir()?;
    let members: Vec<(u32, String)> = (1..=n as u32).map(|i| (i, "127.0.0.1".into())).collect();
    let ca = generate_dev_ca(ca_dir.path(), &members)?;
    let nodes = ca.nodes.clone();
    let mut cluster = Cluster::configure(n, |config: &mut BrokerConfig| {
        if tls {
            config.tls = nodes
                .iter()
                .find(|(id, _)| *id == config.node_id)
                .map(|(_, t)| t.clone());
        }
        config.admin.token = Some(ADMIN_TOKEN.into());
        config.auth.tokens = vec![
            TokenConfig {
                name: "app".into(),
                secret: APP_TOKEN.into(),
                domains: vec!["bmq.test".into()],
                permissions: vec![Permission::Produce, Permission::Consume],
            },
            TokenConfig {
                name: "writer".into(),
                secret: WRITER_TOKEN.into(),
                domains: vec!["bmq.test".into()],
                permissions: vec![Permission::Produce],
            },
        ];
    })?;
    for id in 1..=n as u32 {
        cluster.start_node(id)?;
    }
    Ok(SecureCluster {
        cluster,
        ca,
        _ca_dir: ca_dir,
    })
}

impl SecureCluster {
    fn client_config(&self, token: Option<&str>) -> ClientConfig {
        let mut c = ClientConfig::new(self.cluster.client_addrs());
        c.tls_ca_file = Some(self.ca.ca_cert.clone());
        c.token = token.map(String::from);
        c.request_timeout = Duration::from_secs(5);
        c
    }
}

use bmq_tests::metric;

/// Waits until `metric` on `admin` reaches `at_least`.
async fn wait_metric(admin: &str, name: &str, at_least: f64) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = metric(admin, name).await?;
        if v >= at_least {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{admin}: {name} is {v}, expected at least {at_least}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HTTP/1.1 POST; returns the status code.
async fn post(admin: &str, path: &str, token: Option<&str>) -> anyhow::Result<u16> {
    let mut stream = TcpStream::connect(admin).await?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    stream
        .write_all(
            format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    body.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("malformed answer {body:?}"))
}

/// What a rogue process sends once connected: a Hello claiming `claimed` on `channel`, then
/// elector messages with a huge term, for about half a second.
async fn rogue_elector_traffic(
    stream: BoxedStream,
    claimed: u32,
    channel: Channel,
    cluster_name: &str,
) {
    let mut framed = Framed::new(stream, FrameCodec::<PeerMessage>::new(1 << 20));
    let hello = PeerMessage {
        kind: Some(Kind::Hello(PeerHello {
            cluster_name: cluster_name.into(),
            node_id: claimed,
            channel: channel as i32,
            protocol_version: PROTOCOL_VERSION,
            membership: None,
        })),
    };
    if framed.send(hello).await.is_err() {
        return;
    }
    for i in 0..10u64 {
        let kind = if i % 2 == 0 {
            elector_message::Kind::Heartbeat(LeaderHeartbeat {
                term: HUGE_TERM + i,
            })
        } else {
            elector_message::Kind::Proposal(ElectionProposal {
                term: HUGE_TERM + i,
                membership_epoch: 0,
            })
        };
        let msg = PeerMessage {
            kind: Some(Kind::Elector(ElectorMessage { kind: Some(kind) })),
        };
        if framed.send(msg).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The leader and term as every node reports them; an error if they disagree or one is silent.
async fn agreed_leadership(cluster: &Cluster) -> anyhow::Result<(Option<u32>, u64)> {
    let mut seen = None;
    for (id, status) in cluster.statuses().await {
        let s = status.with_context(|| format!("node {id} status"))?;
        let view = (s.elector.leader, s.elector.term);
        match seen {
            None => seen = Some(view),
            Some(v) if v != view => bail!("node {id} sees {view:?}, another node {v:?}"),
            _ => {}
        }
    }
    seen.context("no node answered")
}

/// A process without a valid certificate (plain TCP, a certificate from another CA, or a
/// valid member certificate claiming another member) sends elector messages with a huge term
/// to every node's peer port: each connection is refused and counted, leader and term stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rogue_peer_without_valid_certificate_changes_nothing() {
    let sc = secure_cluster(3, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let follower = (1..=3).find(|i| *i != leader).expect("a follower");
        let cluster_name = cluster.node(1).config.cluster_name.clone();

        // A certificate for node-<follower> signed by another CA, presented by a process that
        // trusts the cluster's CA (so only the node's check of the client certificate stops it).
        let rogue_dir = tempfile::tempdir()?;
        let rogue_ca = generate_dev_ca(rogue_dir.path(), &[(follower, "127.0.0.1".into())])?;
        let mut rogue_settings = rogue_ca.nodes[0].1.clone();
        rogue_settings.ca_file = sc.ca.ca_cert.clone();
        let rogue = PeerTls::load(&rogue_settings)?;
        // The real certificate of the leader, used to claim to be the follower.
        let leader_files = &sc.ca.nodes.iter().find(|(id, _)| *id == leader).unwrap().1;
        let impostor = PeerTls::load(leader_files)?;

        let mut before = Vec::new();
        for node in &cluster.nodes {
            before.push(metric(&node.admin_addr(), "bmq_peer_auth_failures_total").await?);
        }
        for node in &cluster.nodes {
            let peer_addr = node.config.self_member().peer_addr();
            let server =
                rustls::pki_types::ServerName::try_from(member_name(bmq_proto::NodeId(node.id)))?;
            // 1. Plain TCP.
            let plain = TcpStream::connect(&peer_addr).await?;
            rogue_elector_traffic(Box::new(plain), follower, Channel::Control, &cluster_name).await;
            // 2. A certificate from another CA.
            let tcp = TcpStream::connect(&peer_addr).await?;
            if let Ok(tls) = rogue.peer_connector.connect(server.clone(), tcp).await {
                rogue_elector_traffic(Box::new(tls), follower, Channel::Control, &cluster_name)
                    .await;
            }
            // 3. A valid member certificate whose hello claims another member.
            let claimed = if node.id == follower {
                (1..=3).find(|i| *i != leader && *i != follower).unwrap()
            } else {
                follower
            };
            // On both channels: the DATA channel is authenticated the same way.
            for channel in [Channel::Control, Channel::Data] {
                let tcp = TcpStream::connect(&peer_addr).await?;
                let tls = impostor.peer_connector.connect(server.clone(), tcp).await?;
                rogue_elector_traffic(Box::new(tls), claimed, channel, &cluster_name).await;
            }
        }
        for (node, before) in cluster.nodes.iter().zip(&before) {
            // The leader's own certificate on the leader's port claims a peer too: 4 each.
            wait_metric(
                &node.admin_addr(),
                "bmq_peer_auth_failures_total",
                before + 4.0,
            )
            .await?;
        }
        // Leadership is observed over several heartbeat periods: a rogue heartbeat that got
        // through would have moved some node's term within one.
        let watch_until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < watch_until {
            let (l, t) = agreed_leadership(cluster).await?;
            ensure!(
                (l, t) == (Some(leader), term),
                "leadership changed from ({leader}, {term}) to ({l:?}, {t})"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// Control for the test above: on a cluster without TLS, the same rogue traffic over plain TCP
/// does move the term, so the secured test's "nothing changed" is not vacuous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tls_the_same_rogue_traffic_moves_the_term() {
    let sc = secure_cluster(3, false).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        let (leader, _term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let follower = (1..=3).find(|i| *i != leader).expect("a follower");
        let target = (1..=3)
            .find(|i| *i != leader && *i != follower)
            .expect("another follower");
        let cluster_name = cluster.node(1).config.cluster_name.clone();
        let peer_addr = cluster.node(target).config.self_member().peer_addr();
        let plain = TcpStream::connect(&peer_addr).await?;
        rogue_elector_traffic(Box::new(plain), follower, Channel::Control, &cluster_name).await;
        cluster
            .wait_for_all(Duration::from_secs(5), "a term at least the rogue's", |s| {
                s.node_id != target || s.elector.term >= HUGE_TERM
            })
            .await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// A wrong token cannot connect, a missing token or a missing permission cannot open a queue
/// (each with a clear NOT_AUTHORIZED message), the right token produces and consumes, and
/// admin actions need the admin token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_permissions_are_enforced() {
    let sc = secure_cluster(3, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let uri = "bmq://bmq.test/secured";

        match Client::connect(sc.client_config(Some("not-a-valid-token-at-all"))).await {
            Err(ClientError::Refused { code, message }) => {
                ensure!(code == StatusCode::NotAuthorized, "{code:?}");
                ensure!(message.contains("token"), "{message}");
            }
            Err(e) => bail!("wrong token: unexpected error {e}"),
            Ok(_) => bail!("a wrong token connected"),
        }

        let anonymous = Client::connect(sc.client_config(None)).await?;
        match anonymous.open_queue(uri, OpenOptions::write()).await {
            Err(ClientError::Refused { code, message }) => {
                ensure!(code == StatusCode::NotAuthorized, "{code:?}");
                ensure!(message.contains("requires a token"), "{message}");
            }
            other => bail!("anonymous open: {other:?}"),
        }

        let writer = Client::connect(sc.client_config(Some(WRITER_TOKEN))).await?;
        match writer
            .open_queue(uri, OpenOptions::read_write(Default::default()))
            .await
        {
            Err(ClientError::Refused { code, message }) => {
                ensure!(code == StatusCode::NotAuthorized, "{code:?}");
                ensure!(
                    message.contains("consume") && message.contains("bmq.test"),
                    "{message}"
                );
            }
            other => bail!("writer opening for read: {other:?}"),
        }
        writer.open_queue(uri, OpenOptions::write()).await?;
        let ack = writer.put(uri, "by writer".into(), vec![]).await?.await?;
        ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");

        let app = Client::connect(sc.client_config(Some(APP_TOKEN))).await?;
        app.open_queue(uri, OpenOptions::read_write(Default::default()))
            .await?;
        let msg = tokio::time::timeout(Duration::from_secs(10), app.next_message())
            .await
            .context("no push")?
            .context("stream ended")?;
        ensure!(&msg.payload[..] == b"by writer");
        app.confirm(uri, msg.guid).await?;

        let mut refused_opens = 0.0;
        let mut failed_hellos = 0.0;
        for node in &cluster.nodes {
            refused_opens += metric(&node.admin_addr(), "bmq_client_unauthorized_total").await?;
            failed_hellos += metric(&node.admin_addr(), "bmq_client_auth_failures_total").await?;
        }
        ensure!(
            refused_opens >= 2.0,
            "{refused_opens} refused opens counted"
        );
        ensure!(
            failed_hellos >= 1.0,
            "{failed_hellos} refused hellos counted"
        );

        // Admin: reads stay open, actions need the admin token.
        let admin = cluster.node(1).admin_addr();
        ensure!(metric(&admin, "bmq_admin_auth_failures_total").await? == 0.0);
        let code = post(&admin, "/admin/cede-leadership", None).await?;
        ensure!(code == 401, "no token: {code}");
        let code = post(&admin, "/admin/cede-leadership", Some(APP_TOKEN)).await?;
        ensure!(code == 401, "a client token without admin: {code}");
        let code = post(&admin, "/admin/cede-leadership", Some(ADMIN_TOKEN)).await?;
        ensure!(code == 200, "admin token: {code}");
        ensure!(metric(&admin, "bmq_admin_auth_failures_total").await? == 2.0);
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// A client without TLS cannot talk to a TLS client listener: it never gets a Hello answer,
/// and the node counts the failed handshakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_client_cannot_talk_to_a_tls_listener() {
    let sc = secure_cluster(1, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let mut config = sc.client_config(Some(APP_TOKEN));
        config.tls_ca_file = None;
        config.request_timeout = Duration::from_secs(2);
        match Client::connect(config).await {
            Err(ClientError::Connect { .. }) => {}
            Err(e) => bail!("unexpected error {e}"),
            Ok(_) => bail!("a plain client connected to a TLS listener"),
        }
        wait_metric(
            &cluster.node(1).admin_addr(),
            "bmq_client_tls_failures_total",
            1.0,
        )
        .await?;
        // The same client with the CA connects.
        Client::connect(sc.client_config(Some(APP_TOKEN))).await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// Sends `bytes` on a fresh connection to `addr` and waits (bounded) for the node to close it.
async fn send_garbage(addr: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(bytes).await?;
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    Ok(())
}

/// Garbage bytes (including a truncated TLS ClientHello) on the client, peer and admin ports
/// of every node of a secured cluster leave every node up, the leadership unchanged, and a
/// client connected meanwhile producing and consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_every_port_of_a_secured_cluster_leaves_it_up() {
    let sc = secure_cluster(3, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let uri = "bmq://bmq.test/garbage";
        let client = Client::connect(sc.client_config(Some(APP_TOKEN))).await?;
        client
            .open_queue(uri, OpenOptions::read_write(Default::default()))
            .await?;
        let truncated_client_hello = [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
        let garbage: [&[u8]; 4] = [
            &[0xff, 0xff, 0xff, 0xff, 1, 2, 3],
            &[0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff],
            b"GET / HTTP/1.1\r\n\r\n",
            &truncated_client_hello,
        ];
        for node in &cluster.nodes {
            for addr in [
                node.client_addr(),
                node.config.self_member().peer_addr(),
                node.admin_addr(),
            ] {
                for bytes in garbage {
                    send_garbage(&addr, bytes).await?;
                }
            }
        }
        for node in &cluster.nodes {
            ensure!(node.is_running(), "node {} exited", node.id);
        }
        let (leader_after, term_after) = cluster.wait_for_leader(Duration::from_secs(5)).await?;
        ensure!(
            (leader_after, term_after) == (leader, term),
            "garbage changed the leadership: ({leader}, {term}) -> ({leader_after}, {term_after})"
        );
        let ack = client.put(uri, "still here".into(), vec![]).await?.await?;
        ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");
        let msg = tokio::time::timeout(Duration::from_secs(10), client.next_message())
            .await
            .context("no push")?
            .context("stream ended")?;
        ensure!(&msg.payload[..] == b"still here");
        client.confirm(uri, msg.guid).await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// A flood of idle connections to a TLS peer port is bounded: beyond 64 connections still
/// authenticating, new ones are closed at once and counted, and the node stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connection_flood_on_the_peer_port_is_bounded() {
    let sc = secure_cluster(1, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let admin = cluster.node(1).admin_addr();
        let before = metric(&admin, "bmq_peer_connections_refused_total").await?;
        let peer_addr = cluster.node(1).config.self_member().peer_addr();
        let mut idle = Vec::new();
        for _ in 0..80 {
            idle.push(TcpStream::connect(&peer_addr).await?);
        }
        wait_metric(&admin, "bmq_peer_connections_refused_total", before + 16.0).await?;
        drop(idle);
        ensure!(cluster.node(1).is_running(), "node exited");
        cluster.wait_for_leader(Duration::from_secs(5)).await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// The bmqp port (BlazingMQ's SDKs) under `[tls]`: a client that starts in plain bmqp is
/// refused (logged, counted) unless `[bmqp] allow_plaintext`; a TLS client negotiates. With
/// tokens configured and no `bmqp_identity`, an SDK client that does not authenticate opens
/// nothing; BlazingMQ's AUTHENTICATION with `BASIC name:secret` of a token gives it that
/// token's permissions, and wrong credentials are refused with a reason and the connection
/// closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bmqp_port_speaks_tls_and_maps_authentication_onto_tokens() {
    use bmq_tests::bmqp::{guid, RawClient};
    let sc = secure_cluster(1, true).expect("start cluster");
    let result = async {
        let cluster = &sc.cluster;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let node = cluster.node(1);
        let (addr, admin) = (node.bmqp_addr(), node.admin_addr());

        // Plain bmqp on a TLS listener: closed without an answer, counted.
        let before = bmq_tests::metric(&admin, "bmq_client_connections_refused_total").await?;
        let plain = RawClient::connect(&addr).await?.negotiate().await;
        ensure!(plain.is_err(), "a plaintext SDK client was served");
        wait_metric(&admin, "bmq_client_connections_refused_total", before + 1.0).await?;

        // TLS: negotiates; without credentials it is anonymous and opens nothing.
        let mut anonymous = RawClient::connect_tls(&addr, &sc.ca.ca_cert)
            .await?
            .negotiate()
            .await?;
        let refused = anonymous.open(0, "bmq://bmq.test/bmqp-tls").await;
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("not authorized")),
            "an anonymous SDK client opened a queue: {refused:?}"
        );

        // AUTHENTICATION with a token's name and secret: that token's permissions.
        let mut app = RawClient::connect_tls(&addr, &sc.ca.ca_cert).await?;
        let (category, message) = app
            .authenticate("BASIC", format!("app:{APP_TOKEN}").as_bytes())
            .await?;
        ensure!(category == 0, "authentication refused: {message}");
        let mut app = app.negotiate().await?;
        app.open(0, "bmq://bmq.test/bmqp-tls").await?;
        ensure!(app.post(0, guid(1), b"over tls", false).await? == 0, "ACK");

        // Wrong credentials: refused with the reason, closed, counted.
        let failures = bmq_tests::metric(&admin, "bmq_client_auth_failures_total").await?;
        let mut wrong = RawClient::connect_tls(&addr, &sc.ca.ca_cert).await?;
        let (category, message) = wrong.authenticate("BASIC", b"app:not-the-secret").await?;
        ensure!(category == -6, "category {category}: {message}");
        ensure!(message.contains("invalid name or secret"), "{message}");
        ensure!(wrong.closed().await?, "the connection stayed open");
        wait_metric(&admin, "bmq_client_auth_failures_total", failures + 1.0).await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", sc.cluster.log_tails(30));
    }
}

/// A joiner that could never link to the cluster is refused before anything is proposed, with
/// the reason, and the membership stays as it was: node 4 presenting a certificate of another
/// CA, node 4 holding a certificate of the cluster's CA but trusting another CA (it would
/// refuse every member's certificate), and node 4 presenting node 5's certificate. With its
/// own certificate, and `join` alone to find the members, it is added and promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_with_a_foreign_ca_or_the_wrong_certificate_is_refused() {
    let ca_dir = tempfile::tempdir().expect("tempdir");
    let members: Vec<(u32, String)> = (1..=4).map(|i| (i, "127.0.0.1".into())).collect();
    let ca = generate_dev_ca(ca_dir.path(), &members).expect("dev CA");
    let nodes = ca.nodes.clone();
    let mut cluster = Cluster::configure(4, |config: &mut BrokerConfig| {
        config.tls = nodes
            .iter()
            .find(|(id, _)| *id == config.node_id)
            .map(|(_, t)| t.clone());
        config.admin.token = Some(ADMIN_TOKEN.into());
    })
    .expect("configure");
    let result = async {
        for node in cluster.nodes.iter_mut().take(3) {
            node.config.members.retain(|m| m.id <= 3);
            std::fs::write(&node.config_path, node.config.to_toml_string())?;
        }
        for id in 1..=3 {
            cluster.start_node(id)?;
        }
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let rogue_dir = tempfile::tempdir()?;
        let rogue = generate_dev_ca(rogue_dir.path(), &[(4, "127.0.0.1".into())])?;
        let own = cluster.node(4).config.tls.clone().context("node 4's TLS")?;
        let foreign_cert = rogue.nodes[0].1.clone();
        let mut trusts_foreign = own.clone();
        trusts_foreign.ca_file = rogue.ca_cert.clone();
        let fifth = bmqctl::dev_ca::issue_node_cert(ca_dir.path(), 5, "127.0.0.1")?;
        let m = cluster.node(4).config.self_member().clone();
        let path = format!(
            "/admin/members?id=4&host={}&client_port={}&peer_port={}&admin_port={}&timeout_ms=30000",
            m.host, m.client_port, m.peer_port, m.admin_port
        );
        let leader_admin = cluster.node(leader).admin_addr();
        let cases = [
            (foreign_cert, "does not present a certificate of this cluster's CA"),
            (trusts_foreign, "refuses this node's certificate"),
            (fifth, "naming node-4"),
            (own, "promoted to voter"),
        ];
        for (settings, expected) in cases {
            if cluster.node(4).is_running() {
                cluster.kill_node(4)?;
            }
            cluster.nodes[3].config.tls = Some(settings);
            if expected == "promoted to voter" {
                // With its own certificate it joins through `join` alone: its ask for the
                // membership goes over mutual TLS too.
                let join = vec![cluster.node(2).config.self_member().peer_addr()];
                cluster.nodes[3].config.members.retain(|m| m.id == 4);
                cluster.nodes[3].config.join = join;
            }
            std::fs::write(
                &cluster.nodes[3].config_path,
                cluster.nodes[3].config.to_toml_string(),
            )?;
            cluster.start_node(4)?;
            let answer = tokio::time::timeout(Duration::from_secs(40), async {
                loop {
                    let answer = bmqctl::http::request(
                        &leader_admin,
                        "POST",
                        &path,
                        Some(ADMIN_TOKEN),
                    )
                    .await;
                    if !format!("{answer:?}").contains("does not answer /status") {
                        return answer;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await?;
            ensure!(
                format!("{answer:?}").contains(expected),
                "expected {expected:?}, the add answered {answer:?}"
            );
            if expected != "promoted to voter" {
                let docs = cluster
                    .wait_for_all(Duration::from_secs(5), "the members answer", |_| true)
                    .await?;
                for d in docs.iter().filter(|d| d.node_id != 4) {
                    let m = d.membership.as_ref().context("membership")?;
                    ensure!(
                        m.epoch == 1 && m.members.len() == 3,
                        "node {}: the refused add changed the membership: {m:?}",
                        d.node_id
                    );
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}
