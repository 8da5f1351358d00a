//! Bad input never takes a node down: malformed frames, garbage on every port, unknown domains,
//! malformed queue URIs, and invalid configuration files.

use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_client::{Client, ClientConfig, ClientError, OpenOptions};
use bmq_proto::client::{
    client_message::Kind, AckStatus, ClientMessage, Hello, OpenQueue, StatusCode,
};
use bmq_proto::FrameCodec;
use bmq_tests::{broker_binary, Cluster};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use bmq_tests::metric;

/// Sends `bytes` on a fresh connection to `addr` and waits (bounded) for the node to close it.
async fn send_garbage(addr: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(bytes).await?;
    let mut buf = [0u8; 4096];
    // The node answers with an error frame and/or closes; either way a read ends.
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

/// Garbage on the client, peer and admin ports of every node closes only those connections:
/// the leader and term stay, and a client connected meanwhile keeps producing and consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_every_port_leaves_every_node_up() {
    let cluster = Cluster::start(3).expect("start cluster");
    let result = async {
        let (leader, term) = cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let uri = "bmq://bmq.test/garbage";
        let client = Client::connect(ClientConfig::new(cluster.client_addrs())).await?;
        client
            .open_queue(uri, OpenOptions::read_write(Default::default()))
            .await?;

        let oversized = [0xffu8, 0xff, 0xff, 0xff, 1, 2, 3];
        let undecodable = [0u8, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
        for node in &cluster.nodes {
            let client_addr = node.client_addr();
            let peer_addr = node.config.self_member().peer_addr();
            let admin_addr = node.admin_addr();
            send_garbage(&client_addr, &oversized).await?;
            send_garbage(&client_addr, &undecodable).await?;
            send_garbage(&peer_addr, &oversized).await?;
            send_garbage(&peer_addr, &undecodable).await?;
            send_garbage(&peer_addr, b"GET / HTTP/1.1\r\n\r\n").await?;
            send_garbage(
                &admin_addr,
                &[0u8, 1, 2, 3, 0xff, b'\r', b'\n', b'\r', b'\n'],
            )
            .await?;
        }
        // Each node counted the client frames it refused.
        for node in &cluster.nodes {
            let errors = metric(&node.admin_addr(), "bmq_client_frame_errors_total").await?;
            ensure!(
                errors >= 2.0,
                "node {} counted {errors} client frame errors",
                node.id
            );
            let refused = metric(&node.admin_addr(), "bmq_peer_connections_refused_total").await?;
            ensure!(
                refused >= 3.0,
                "node {} counted {refused} refused peer connections",
                node.id
            );
        }
        let (leader_after, term_after) = cluster.wait_for_leader(Duration::from_secs(5)).await?;
        ensure!(
            (leader_after, term_after) == (leader, term),
            "garbage changed the leadership: ({leader}, {term}) -> ({leader_after}, {term_after})"
        );
        // The client that was connected all along is unaffected.
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
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}

/// An unknown domain and a malformed queue URI are answered with errors naming the problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_domain_and_malformed_uri_are_refused_with_a_reason() {
    let cluster = Cluster::start(1).expect("start cluster");
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let client = Client::connect(ClientConfig::new(cluster.client_addrs())).await?;
        match client
            .open_queue("bmq://no.such.domain/q", OpenOptions::write())
            .await
        {
            Err(ClientError::Refused { code, message }) => {
                ensure!(code == StatusCode::UnknownDomain, "code {code:?}");
                ensure!(message.contains("no.such.domain"), "message {message:?}");
            }
            other => anyhow::bail!("unknown domain: expected a refusal, got {other:?}"),
        }
        // The client library refuses a malformed URI itself, so speak the protocol directly to
        // see the broker's own answer.
        let mut raw = Framed::new(
            TcpStream::connect(cluster.node(1).client_addr()).await?,
            FrameCodec::<ClientMessage>::new(1 << 20),
        );
        raw.send(ClientMessage {
            kind: Some(Kind::Hello(Hello {
                client_id: "raw".into(),
                protocol_version: bmq_proto::PROTOCOL_VERSION,
                token: String::new(),
            })),
        })
        .await?;
        raw.send(ClientMessage {
            kind: Some(Kind::OpenQueue(OpenQueue {
                request_id: 7,
                uri: "not a uri".into(),
                read: false,
                write: true,
                consumer: None,
                ..Default::default()
            })),
        })
        .await?;
        let mut answered = false;
        while let Some(frame) = tokio::time::timeout(Duration::from_secs(5), raw.next()).await? {
            if let Some(Kind::OpenQueueResponse(r)) = frame?.kind {
                let status = r.status.unwrap_or_default();
                ensure!(r.request_id == 7, "request id {}", r.request_id);
                ensure!(
                    status.code == StatusCode::InvalidUri as i32,
                    "code {}",
                    status.code
                );
                ensure!(
                    status.message.contains("not a uri"),
                    "message {:?}",
                    status.message
                );
                answered = true;
                break;
            }
        }
        ensure!(answered, "no OpenQueueResponse for a malformed uri");
        // The session survives both refusals.
        client
            .open_queue("bmq://bmq.test/fine", OpenOptions::write())
            .await?;
        let ack = client
            .put("bmq://bmq.test/fine", "x".into(), vec![])
            .await?
            .await?;
        ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}

/// A configuration with an invalid value stops the broker at start with the field's name.
#[test]
fn invalid_config_stops_the_node_naming_the_field() {
    let cluster = Cluster::configure(3, |c| c.members[1].peer_port = 0).expect("configure");
    let node = cluster.node(1);
    let output = Command::new(broker_binary())
        .arg("--config")
        .arg(&node.config_path)
        .output()
        .expect("run broker");
    assert!(
        !output.status.success(),
        "broker accepted an invalid config"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("members[1].peer_port"),
        "the error does not name the field: {stderr}"
    );

    let unknown = cluster.dir().join("typo.toml");
    std::fs::write(&unknown, "node_id = 1\nheartbeat_period = 3\n").unwrap();
    let output = Command::new(broker_binary())
        .arg("--config")
        .arg(&unknown)
        .output()
        .expect("run broker");
    assert!(!output.status.success(), "broker accepted an unknown field");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("heartbeat_period"),
        "the error does not name the field: {stderr}"
    );
}

/// `bmqctl` writing to a pipe whose reader left (`bmqctl status | head -0`) drops its output
/// instead of panicking ("failed printing to stdout"): it exits with its own status, here 1
/// with "no node answered" (nothing listens on the admin port), not a panic's 101.
#[test]
fn bmqctl_with_a_closed_stdout_does_not_panic() -> anyhow::Result<()> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let bmqctl = broker_binary().with_file_name("bmqctl");
    let port = bmq_tests::free_ports(1)[0];
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills the two descriptors of the array it is given.
    ensure!(
        unsafe { libc::pipe(fds.as_mut_ptr()) } == 0,
        "pipe: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: both descriptors were just made by pipe(2) and are owned by nothing else.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // The reader is gone before bmqctl writes anything: every write to its stdout fails.
    drop(reader);
    let output = Command::new(&bmqctl)
        .args(["status", "--admin", &format!("127.0.0.1:{port}")])
        .stdout(std::process::Stdio::from(writer))
        .stderr(std::process::Stdio::piped())
        .output()
        .context("run bmqctl")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(!stderr.contains("panicked"), "bmqctl panicked: {stderr}");
    ensure!(
        output.status.code() == Some(1),
        "exit status {:?}: {stderr}",
        output.status
    );
    ensure!(stderr.contains("no node answered"), "stderr: {stderr}");
    Ok(())
}

/// A consumer that stops reading does not keep its messages from the others: its session
/// gives up on it after the request timeout (2 s here) with the PUSHes it could not write
/// still waiting, and every message it held is delivered to the other consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_stops_reading_is_closed_and_its_messages_go_to_another() {
    stuck_consumer_releases_its_messages(
        |c| c.limits.request_timeout_ms = 2000,
        "bmq_client_write_timeouts_total",
    )
    .await;
}

/// A consumer whose session falls a whole inbox behind does not keep its messages either:
/// with a request timeout far beyond the test's patience and an inbox of 16 events, the PUSH
/// dropped on the full inbox closes the session at once, and every message it held is
/// delivered to the other consumer (before, that PUSH stayed held by the session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_inbox_overflows_is_closed_and_its_messages_go_to_another() {
    stuck_consumer_releases_its_messages(
        |c| {
            c.limits.request_timeout_ms = 600_000;
            c.limits.mailbox_capacity = 16;
        },
        "bmq_session_inbox_overflows_total",
    )
    .await;
}

/// One node configured by `configure`; a raw consumer that opens a queue and then reads
/// nothing, a library consumer and a producer of 400 x 64 KiB messages, one at a time: every
/// message must reach the library consumer within 30 s, and the stuck consumer's session must
/// have been closed for the reason `closed_by` counts.
async fn stuck_consumer_releases_its_messages(
    configure: impl Fn(&mut bmq_config::BrokerConfig),
    closed_by: &str,
) {
    const QUEUE: &str = "bmq://bmq.test/stuck-consumer";
    const COUNT: usize = 400;
    // 400 x 64 KiB: the half pushed to the consumer that never reads is far more than its
    // socket buffers hold, so its session's write blocks.
    const SIZE: usize = 64 * 1024;
    let mut cluster = Cluster::configure(1, configure).expect("configure cluster");
    let result = async {
        cluster.start_node(1)?;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        let admin = cluster.node(1).admin_addr();
        let mut stuck = Framed::new(
            TcpStream::connect(cluster.node(1).client_addr()).await?,
            FrameCodec::<ClientMessage>::new(1 << 20),
        );
        stuck
            .send(ClientMessage {
                kind: Some(Kind::Hello(Hello {
                    client_id: "stuck".into(),
                    protocol_version: bmq_proto::PROTOCOL_VERSION,
                    token: String::new(),
                })),
            })
            .await?;
        stuck
            .send(ClientMessage {
                kind: Some(Kind::OpenQueue(OpenQueue {
                    request_id: 1,
                    uri: QUEUE.into(),
                    read: true,
                    write: false,
                    consumer: None,
                    ..Default::default()
                })),
            })
            .await?;
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), stuck.next())
                .await?
                .context("closed before the open's answer")??;
            if let Some(Kind::OpenQueueResponse(r)) = frame.kind {
                let code = r.status.unwrap_or_default().code;
                ensure!(code == StatusCode::Ok as i32, "open refused: {code}");
                break;
            }
        }
        // From here on `stuck` reads nothing (it stays open until the end of the test).
        let consumer = Client::connect(ClientConfig::new(cluster.client_addrs())).await?;
        consumer
            .open_queue(QUEUE, OpenOptions::read(Default::default()))
            .await?;
        let producer = Client::connect(ClientConfig::new(cluster.client_addrs())).await?;
        producer.open_queue(QUEUE, OpenOptions::write()).await?;
        // One PUT at a time, so each PUSH reaches the stuck session's inbox as its own event.
        for i in 0..COUNT {
            let mut payload = vec![0u8; SIZE];
            payload[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let ack = producer.put(QUEUE, payload.into(), vec![]).await?.await?;
            ensure!(ack.status == AckStatus::Success as i32, "{ack:?}");
        }
        let mut seen = std::collections::BTreeSet::new();
        while seen.len() < COUNT {
            let message = tokio::time::timeout(Duration::from_secs(30), consumer.next_message())
                .await
                .with_context(|| {
                    format!(
                        "{} of {COUNT} messages reached the reading consumer; the rest stay \
                         with the one that stopped reading",
                        seen.len()
                    )
                })?
                .context("consumer closed")?;
            let index = u64::from_le_bytes(message.payload[..8].try_into()?);
            seen.insert(index);
            consumer.confirm(&message.uri, message.guid).await?;
        }
        ensure!(
            metric(&admin, closed_by).await? >= 1.0,
            "the stuck consumer's session was not closed ({closed_by} is 0)"
        );
        drop(stuck);
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n{}", cluster.log_tails(30));
    }
}
