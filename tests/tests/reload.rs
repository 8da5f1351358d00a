//! Live reload of a node's configuration file with real broker processes: tokens added and
//! removed, a renewed certificate, the log level, SIGHUP, a setting that needs a restart, and
//! files that are refused. Each node runs TLS on its client and peer listeners, client tokens
//! and an admin token, from a development CA.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmq_broker::net::tls::PeerTls;
use bmq_client::{Client, ClientConfig, ClientError, OpenOptions};
use bmq_config::{BrokerConfig, Permission, TokenConfig};
use bmq_proto::admin_doc::{NodeStatusDoc, ReloadDoc};
use bmq_proto::client::{
    client_message::Kind, AckStatus, ClientMessage, Hello, OpenQueue, Status, StatusCode,
};
use bmq_proto::{member_name, BoxedStream, FrameCodec, NodeId, PROTOCOL_VERSION};
use bmq_tests::bmqp::{guid, RawClient};
use bmq_tests::{metric, Cluster};
use bmqctl::dev_ca::{generate_dev_ca, issue_node_cert, DevCaFiles};
use futures::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

/// Secret of the token allowed to produce and consume on `bmq.test`.
const APP_TOKEN: &str = "app-token-0123456789abcdef";
/// Secret of the token allowed only to produce on `bmq.test`.
const WRITER_TOKEN: &str = "writer-token-0123456789abcdef";
/// Secret of a token that only a reload adds.
const LATE_TOKEN: &str = "late-token-0123456789abcdef";
/// The admin token.
const ADMIN_TOKEN: &str = "admin-token-0123456789abcdef";
/// How long a condition may take to hold before a test fails.
const WAIT: Duration = Duration::from_secs(15);

/// A one-node secured cluster and its development CA.
struct Node {
    cluster: Cluster,
    ca: DevCaFiles,
    ca_dir: tempfile::TempDir,
}

fn token(name: &str, secret: &str, permissions: &[Permission]) -> TokenConfig {
    TokenConfig {
        name: name.into(),
        secret: secret.into(),
        domains: vec!["bmq.test".into()],
        permissions: permissions.to_vec(),
    }
}

/// Starts one node with TLS, the `app` and `writer` tokens and the admin token.
fn secure_node() -> anyhow::Result<Node> {
    let ca_dir = tempfile::tempdir()?;
    let ca = generate_dev_ca(ca_dir.path(), &[(1, "127.0.0.1".into())])?;
    let tls = ca.nodes[0].1.clone();
    let mut cluster = Cluster::configure(1, |config: &mut BrokerConfig| {
        config.tls = Some(tls.clone());
        config.admin.token = Some(ADMIN_TOKEN.into());
        config.auth.tokens = vec![
            token(
                "app",
                APP_TOKEN,
                &[Permission::Produce, Permission::Consume],
            ),
            token("writer", WRITER_TOKEN, &[Permission::Produce]),
        ];
    })?;
    cluster.start_node(1)?;
    Ok(Node {
        cluster,
        ca,
        ca_dir,
    })
}

impl Node {
    fn admin(&self) -> String {
        self.cluster.node(1).admin_addr()
    }

    fn client_addr(&self) -> String {
        self.cluster.node(1).client_addr()
    }

    fn client_config(&self, token: &str) -> ClientConfig {
        let mut c = ClientConfig::new(vec![self.client_addr()]);
        c.tls_ca_file = Some(self.ca.ca_cert.clone());
        c.token = Some(token.into());
        c.request_timeout = Duration::from_secs(5);
        c
    }

    /// Changes the node's configuration file (not the running node).
    fn edit(&mut self, change: impl FnOnce(&mut BrokerConfig)) -> anyhow::Result<()> {
        let node = &mut self.cluster.nodes[0];
        change(&mut node.config);
        std::fs::write(&node.config_path, node.config.to_toml_string())?;
        Ok(())
    }

    /// Writes `text` as the node's configuration file.
    fn write_file(&self, text: &str) -> anyhow::Result<()> {
        Ok(std::fs::write(&self.cluster.node(1).config_path, text)?)
    }

    /// `POST /admin/reload` with the admin token: the status code and the answer.
    async fn reload(&self) -> anyhow::Result<(u16, ReloadDoc)> {
        let (code, body) = bmqctl::http::request_with_status(
            &self.admin(),
            "POST",
            "/admin/reload",
            Some(ADMIN_TOKEN),
        )
        .await?;
        let doc = serde_json::from_slice(&body)
            .with_context(|| format!("answer {code}: {:?}", String::from_utf8_lossy(&body)))?;
        Ok((code, doc))
    }

    async fn status(&self) -> anyhow::Result<NodeStatusDoc> {
        Ok(serde_json::from_slice(
            &bmqctl::http::get(&self.admin(), "/status").await?,
        )?)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.cluster.node(1).log_path()).unwrap_or_default()
    }
}

/// A TLS connection to `addr` verified against `ca`, and the DER of the certificate the node
/// served on it.
async fn tls_connect(addr: &str, ca: &Path) -> anyhow::Result<(BoxedStream, Vec<u8>)> {
    let connector = bmq_client::tls::client_connector(ca)?;
    let name = bmq_client::tls::server_name_of(addr).map_err(anyhow::Error::msg)?;
    let tcp = TcpStream::connect(addr).await?;
    let tls = connector.connect(name, tcp).await?;
    let served = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no certificate served")?
        .to_vec();
    Ok((Box::new(tls), served))
}

type RawSession = Framed<BoxedStream, FrameCodec<ClientMessage>>;

/// A client session in our own protocol over TLS, frame by frame, so a test sees every frame
/// and whether the connection closed (the client library would reconnect by itself). Returns
/// the served certificate too.
async fn raw_session(node: &Node, token: &str) -> anyhow::Result<(RawSession, Vec<u8>)> {
    let (stream, served) = tls_connect(&node.client_addr(), &node.ca.ca_cert).await?;
    let mut framed = Framed::new(stream, FrameCodec::<ClientMessage>::new(1 << 20));
    framed
        .send(ClientMessage {
            kind: Some(Kind::Hello(Hello {
                client_id: "reload-test".into(),
                protocol_version: PROTOCOL_VERSION,
                token: token.into(),
            })),
        })
        .await?;
    match next_frame(&mut framed).await? {
        Some(Kind::HelloResponse(r)) => {
            let status = r.status.unwrap_or_default();
            ensure!(
                status.code == StatusCode::Ok as i32,
                "hello refused: {status:?}"
            );
        }
        other => bail!("hello answered with {other:?}"),
    }
    Ok((framed, served))
}

/// The next frame of `session` (`None`: the node closed the connection), within [`WAIT`].
async fn next_frame(session: &mut RawSession) -> anyhow::Result<Option<Kind>> {
    match tokio::time::timeout(WAIT, session.next()).await {
        Err(_) => bail!("no frame within {WAIT:?}"),
        Ok(None) => Ok(None),
        // A TLS peer closing without close_notify reads as an error: a close too.
        Ok(Some(Err(_))) => Ok(None),
        Ok(Some(Ok(m))) => Ok(m.kind),
    }
}

/// Opens `uri` for writing on `session` and returns the answer's status.
async fn open_for_write(
    session: &mut RawSession,
    request_id: u64,
    uri: &str,
) -> anyhow::Result<Status> {
    session
        .send(ClientMessage {
            kind: Some(Kind::OpenQueue(OpenQueue {
                request_id,
                uri: uri.into(),
                read: false,
                write: true,
                ..Default::default()
            })),
        })
        .await?;
    loop {
        match next_frame(session).await? {
            Some(Kind::OpenQueueResponse(r)) if r.request_id == request_id => {
                return Ok(r.status.unwrap_or_default())
            }
            Some(_) => continue,
            None => bail!("the connection closed before the open was answered"),
        }
    }
}

/// Waits for the node's first leadership (a one-node cluster elects itself).
async fn ready(node: &Node) -> anyhow::Result<()> {
    node.cluster
        .wait_for_leader(Duration::from_secs(20))
        .await?;
    Ok(())
}

/// Puts one message with `client` on `uri` and checks it is ACKed.
async fn put_acked(client: &Client, uri: &str) -> anyhow::Result<()> {
    client.open_queue(uri, OpenOptions::write()).await?;
    let ack = client
        .put(uri, "after reload".into(), vec![])
        .await?
        .await?;
    ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");
    Ok(())
}

/// A token added to the file is refused before the reload and admits a new client after it;
/// the answer and the log name it by its secret's fingerprint, never the secret; a new
/// `log.level` applies at once; a reload without the admin token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_added_by_a_reload_admits_a_new_client() {
    let mut node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        match Client::connect(node.client_config(LATE_TOKEN)).await {
            Err(ClientError::Refused { code, .. }) => {
                ensure!(code == StatusCode::NotAuthorized, "{code:?}")
            }
            other => bail!("an unknown token connected: {:?}", other.map(|_| ())),
        }
        // At `info` the node does not log session starts.
        raw_session(&node, APP_TOKEN).await?;
        ensure!(!node.log().contains("client session started"));

        node.edit(|c| {
            c.auth
                .tokens
                .push(token("late", LATE_TOKEN, &[Permission::Produce]));
            c.log.level = "debug".into();
        })?;
        // Behind the admin token: without it nothing is read or changed.
        for token in [None, Some(APP_TOKEN)] {
            let (code, _) =
                bmqctl::http::request_with_status(&node.admin(), "POST", "/admin/reload", token)
                    .await?;
            ensure!(code == 401, "reload with {token:?}: {code}");
        }
        ensure!(
            node.status().await?.config_reload.is_none(),
            "an unauthorized reload ran"
        );
        let (code, doc) = node.reload().await?;
        ensure!(code == 200 && doc.result == "applied", "{code}: {doc:?}");
        ensure!(doc.requested_by == "admin.token", "{doc:?}");
        let added = doc
            .changed
            .iter()
            .find(|c| c.setting == "auth.tokens[late]")
            .with_context(|| format!("token not named: {doc:?}"))?;
        ensure!(added.before.is_none(), "{added:?}");
        let fingerprint = bmq_broker::reload::secret_fingerprint(LATE_TOKEN);
        ensure!(
            added
                .after
                .as_deref()
                .is_some_and(|a| a.contains(&fingerprint)),
            "{added:?}"
        );
        ensure!(
            doc.changed.iter().any(|c| c.setting == "log.level"
                && c.before.as_deref() == Some("info")
                && c.after.as_deref() == Some("debug")),
            "{doc:?}"
        );
        ensure!(doc.needs_restart.is_empty(), "{doc:?}");
        ensure!(doc.sessions_closed == 0, "{doc:?}");

        let late = Client::connect(node.client_config(LATE_TOKEN)).await?;
        put_acked(&late, "bmq://bmq.test/late").await?;
        // The debug level is in force: this session's start is logged.
        let deadline = Instant::now() + WAIT;
        while !node.log().contains("client session started") {
            ensure!(Instant::now() < deadline, "no debug line after the reload");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let log = node.log();
        ensure!(log.contains("configuration reloaded"), "reload not logged");
        ensure!(
            log.contains(&fingerprint),
            "the token's fingerprint is not logged"
        );
        ensure!(!log.contains(LATE_TOKEN), "a secret is in the log");
        let counted = metric(&node.admin(), "bmq_config_changes_total{kind=\"reload\"}").await?;
        ensure!(counted == 1.0, "{counted} reloads counted");
        let status = node.status().await?;
        let reload = status.config_reload.context("no reload in /status")?;
        ensure!(
            reload.last_applied_unix_ms == Some(doc.at_unix_ms),
            "{reload:?}"
        );
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}

/// A token removed from the file: its open sessions — one of our protocol, one of a BlazingMQ
/// SDK that authenticated with it — are ended (ours told NOT_AUTHORIZED with the reason),
/// counted and logged, and it cannot connect again; sessions of another token go on over
/// their connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_token_closes_its_sessions_and_others_continue() {
    let mut node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        let uri = "bmq://bmq.test/removed";
        let (mut writer, _) = raw_session(&node, WRITER_TOKEN).await?;
        let (mut app, _) = raw_session(&node, APP_TOKEN).await?;
        let opened = open_for_write(&mut writer, 1, uri).await?;
        ensure!(opened.code == StatusCode::Ok as i32, "{opened:?}");
        let bmqp_addr = node.cluster.node(1).bmqp_addr();
        // `open`: RawClient opens for reading and writing, which the writer token may not.
        let sdk = |name: &'static str, secret: &'static str, open: bool| {
            let (addr, ca) = (bmqp_addr.clone(), node.ca.ca_cert.clone());
            async move {
                let mut c = RawClient::connect_tls(&addr, &ca).await?;
                let (category, message) = c
                    .authenticate("BASIC", format!("{name}:{secret}").as_bytes())
                    .await?;
                ensure!(category == 0, "{name}: authentication refused: {message}");
                let mut c = c.negotiate().await?;
                if open {
                    c.open(0, "bmq://bmq.test/removed-sdk").await?;
                }
                anyhow::Ok(c)
            }
        };
        let mut sdk_writer = sdk("writer", WRITER_TOKEN, false).await?;
        let mut sdk_app = sdk("app", APP_TOKEN, true).await?;

        node.edit(|c| c.auth.tokens.retain(|t| t.name != "writer"))?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 200 && doc.result == "applied", "{code}: {doc:?}");
        ensure!(doc.sessions_closed == 2, "{doc:?}");
        ensure!(
            doc.changed
                .iter()
                .any(|c| c.setting == "auth.tokens[writer]" && c.after.is_none()),
            "{doc:?}"
        );

        let told = loop {
            match next_frame(&mut writer).await? {
                Some(Kind::Error(e)) => break e.status.unwrap_or_default(),
                Some(_) => continue,
                None => bail!("closed without NOT_AUTHORIZED"),
            }
        };
        ensure!(told.code == StatusCode::NotAuthorized as i32, "{told:?}");
        ensure!(told.message.contains("\"writer\" was removed"), "{told:?}");
        ensure!(
            next_frame(&mut writer).await?.is_none(),
            "the session stayed open"
        );

        // The other session goes on, on the same connection.
        let opened = open_for_write(&mut app, 2, uri).await?;
        ensure!(opened.code == StatusCode::Ok as i32, "{opened:?}");
        match Client::connect(node.client_config(WRITER_TOKEN)).await {
            Err(ClientError::Refused { code, .. }) => {
                ensure!(code == StatusCode::NotAuthorized, "{code:?}")
            }
            other => bail!("a removed token connected: {:?}", other.map(|_| ())),
        }
        ensure!(
            sdk_writer.closed().await?,
            "the SDK session of the removed token stayed"
        );
        ensure!(
            sdk_app.post(0, guid(1), b"still admitted", false).await? == 0,
            "the other SDK session's PUT was not ACKed"
        );
        let revoked = metric(&node.admin(), "bmq_client_sessions_revoked_total").await?;
        ensure!(revoked == 2.0, "{revoked} revoked sessions counted");
        ensure!(node
            .log()
            .contains("client session closed: not authorized any more"));
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}

/// A certificate renewed in place (new key, same CA) is served to new client and peer
/// connections once the node reloads — not before — while a connection opened before goes
/// on; the answer names the old and new fingerprints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_to_new_connections_after_a_reload() {
    let node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        let (mut before, old_cert) = raw_session(&node, APP_TOKEN).await?;
        let renewed = issue_node_cert(node.ca_dir.path(), 1, "127.0.0.1")?;
        let new_cert = bmq_client::tls::load_certs(&renewed.cert_file, "certificate")?[0].to_vec();
        ensure!(
            new_cert != old_cert,
            "the renewal made the same certificate"
        );
        // The files changed on disk; the node serves what it read until it reloads.
        let (_, served) = tls_connect(&node.client_addr(), &node.ca.ca_cert).await?;
        ensure!(
            served == old_cert,
            "the new certificate was served before the reload"
        );

        let (code, doc) = node.reload().await?;
        ensure!(code == 200 && doc.result == "applied", "{code}: {doc:?}");
        let sha = |der: &[u8]| format!("sha256:{}", bmq_broker::net::tls::sha256_hex(der));
        ensure!(
            doc.changed.iter().any(|c| c.setting == "tls.cert_file"
                && c.before.as_deref() == Some(sha(&old_cert).as_str())
                && c.after.as_deref() == Some(sha(&new_cert).as_str())),
            "{doc:?}"
        );
        let (_, served) = tls_connect(&node.client_addr(), &node.ca.ca_cert).await?;
        ensure!(
            served == new_cert,
            "the client listener serves the old certificate"
        );
        let (mut after, served) = raw_session(&node, APP_TOKEN).await?;
        ensure!(served == new_cert);
        let opened = open_for_write(&mut after, 1, "bmq://bmq.test/renewed").await?;
        ensure!(opened.code == StatusCode::Ok as i32, "{opened:?}");

        // The peer listener too: a member's dialer (the renewed files) sees the new one.
        let peer = PeerTls::load(&renewed)?;
        let peer_addr = node.cluster.node(1).config.self_member().peer_addr();
        let tcp = TcpStream::connect(&peer_addr).await?;
        let name = rustls::pki_types::ServerName::try_from(member_name(NodeId(1)))?;
        let link = peer.peer_connector.connect(name, tcp).await?;
        let served = link.get_ref().1.peer_certificates().context("no cert")?[0].to_vec();
        ensure!(
            served == new_cert,
            "the peer listener serves the old certificate"
        );

        // The connection from before the reload goes on with what it negotiated.
        let opened = open_for_write(&mut before, 1, "bmq://bmq.test/renewed").await?;
        ensure!(opened.code == StatusCode::Ok as i32, "{opened:?}");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}

/// SIGHUP reloads as `POST /admin/reload` does: a token added to the file admits a client,
/// and `/status` says the reload was asked by SIGHUP; the node keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_file_as_the_admin_command_does() {
    let mut node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        node.edit(|c| {
            c.auth
                .tokens
                .push(token("late", LATE_TOKEN, &[Permission::Produce]))
        })?;
        node.cluster.signal_node(1, libc::SIGHUP)?;
        let deadline = Instant::now() + WAIT;
        let last = loop {
            let status = node.status().await?;
            if let Some(r) = status.config_reload {
                break r.last;
            }
            ensure!(Instant::now() < deadline, "no reload after SIGHUP");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        ensure!(
            last.requested_by == "SIGHUP" && last.result == "applied",
            "{last:?}"
        );
        ensure!(
            last.changed
                .iter()
                .any(|c| c.setting == "auth.tokens[late]"),
            "{last:?}"
        );
        ensure!(node.cluster.node(1).is_running());
        let late = Client::connect(node.client_config(LATE_TOKEN)).await?;
        put_acked(&late, "bmq://bmq.test/sighup").await?;
        ensure!(node.log().contains("requested_by=\"SIGHUP\""), "not logged");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}

/// Settings that cannot change live are named in the answer (JSON and `bmqctl`'s text) and
/// not applied, at every reload, while a live change beside them applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_that_needs_a_restart_is_named_and_not_applied() {
    let mut node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        let partitions = node.status().await?.partitions.len();
        node.edit(|c| {
            c.partition_count = 8;
            c.elector.heartbeat_period_ms = 120;
            c.auth
                .tokens
                .push(token("late", LATE_TOKEN, &[Permission::Produce]));
        })?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 200 && doc.result == "applied", "{code}: {doc:?}");
        let mut restart = doc.needs_restart.clone();
        restart.sort();
        ensure!(
            restart == ["elector.heartbeat_period_ms", "partition_count"],
            "{doc:?}"
        );
        ensure!(
            node.status().await?.partitions.len() == partitions,
            "partition_count changed without a restart"
        );
        Client::connect(node.client_config(LATE_TOKEN)).await?;

        // bmqctl prints the same, and a second reload names them again.
        let out = std::process::Command::new(bmq_tests::broker_binary().with_file_name("bmqctl"))
            .args([
                "admin",
                "reload",
                "--admin",
                &node.admin(),
                "--token",
                ADMIN_TOKEN,
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "bmqctl: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(text.contains("nothing to change"), "{text}");
        ensure!(
            text.contains(
                "needs a restart (not applied): partition_count, elector.heartbeat_period_ms"
            ) || text.contains(
                "needs a restart (not applied): elector.heartbeat_period_ms, partition_count"
            ),
            "{text}"
        );
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}

/// A file that does not validate, an unreadable TLS file and a file that is not TOML are each
/// refused with the loader's error naming the field or file; nothing changes: the tokens in
/// force, the certificate served and the sessions stay, and the refusals are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_is_refused_naming_the_field_and_changes_nothing() {
    let mut node = secure_node().expect("start node");
    let result = async {
        ready(&node).await?;
        let (mut writer, served_before) = raw_session(&node, WRITER_TOKEN).await?;
        let good = node.cluster.node(1).config.clone();

        // A token removed and another with a secret too short: the whole file is refused.
        node.edit(|c| {
            c.auth.tokens.retain(|t| t.name != "writer");
            c.auth
                .tokens
                .push(token("short", "too-short", &[Permission::Produce]));
        })?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 400 && doc.result == "refused", "{code}: {doc:?}");
        ensure!(
            doc.error_field.as_deref() == Some("auth.tokens[1].secret"),
            "{doc:?}"
        );
        ensure!(
            doc.error
                .as_deref()
                .is_some_and(|e| e.contains("auth.tokens[1].secret")),
            "{doc:?}"
        );
        ensure!(
            doc.changed.is_empty() && doc.sessions_closed == 0,
            "{doc:?}"
        );
        // bmqctl prints the refusal and fails.
        let out = std::process::Command::new(bmq_tests::broker_binary().with_file_name("bmqctl"))
            .args([
                "admin",
                "reload",
                "--admin",
                &node.admin(),
                "--token",
                ADMIN_TOKEN,
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(!out.status.success(), "bmqctl succeeded: {text}");
        ensure!(
            text.contains("refused; nothing changed") && text.contains("auth.tokens[1].secret"),
            "{text}"
        );

        // A certificate file that is not there.
        let mut missing = good.clone();
        missing.tls.as_mut().context("tls")?.cert_file = node.ca_dir.path().join("gone.pem");
        node.edit(|c| *c = missing)?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 400, "{code}: {doc:?}");
        ensure!(
            doc.error_field.as_deref() == Some("tls.cert_file"),
            "{doc:?}"
        );
        ensure!(
            doc.error.as_deref().is_some_and(|e| e.contains("gone.pem")),
            "{doc:?}"
        );

        // Not TOML at all.
        node.write_file("this is [not toml")?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 400, "{code}: {doc:?}");
        ensure!(
            doc.error
                .as_deref()
                .is_some_and(|e| e.contains("cannot parse")),
            "{doc:?}"
        );

        // Nothing changed: the writer's session, its token, the certificate.
        let opened = open_for_write(&mut writer, 1, "bmq://bmq.test/refused").await?;
        ensure!(opened.code == StatusCode::Ok as i32, "{opened:?}");
        Client::connect(node.client_config(WRITER_TOKEN)).await?;
        let (_, served) = tls_connect(&node.client_addr(), &node.ca.ca_cert).await?;
        ensure!(served == served_before, "the certificate changed");
        let refused = metric(
            &node.admin(),
            "bmq_config_changes_total{kind=\"reload_refused\"}",
        )
        .await?;
        ensure!(refused == 4.0, "{refused} refusals counted");
        let applied = metric(&node.admin(), "bmq_config_changes_total{kind=\"reload\"}").await?;
        ensure!(applied == 0.0, "{applied} reloads counted");
        // Once the file is valid again, the reload has nothing to change.
        node.edit(|c| *c = good)?;
        let (code, doc) = node.reload().await?;
        ensure!(code == 200 && doc.result == "unchanged", "{code}: {doc:?}");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", node.cluster.log_tails(40));
    }
}
