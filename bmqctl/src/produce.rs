//! `bmqctl produce`: publish self-checking messages ([`super::payload`]) to a queue and wait for
//! every acknowledgement.
//!
//! Opens the queue for writing through the client library (`bmq_client`), which reconnects
//! to another broker and resends unacknowledged PUTs after a broker loss. At most `--window` PUTs
//! are unacknowledged at once. Prints one summary line (or a JSON report with `--json`) and fails
//! if any message was NACKed or not acknowledged before `--timeout-secs`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_proto::client::{AckStatus, Property, PropertyType};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::connect::{as_secs_f64, connect, resolve_brokers};
use crate::payload;
use bmq_client::{ClientError, OpenOptions, PendingAck};
use bmq_proto::uri::QueueUri;

/// Arguments of `bmqctl produce`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Publish self-checking messages to a queue and wait for their acknowledgements",
    after_help = "Examples:\n  \
        bmqctl produce --queue bmq://bmq.test/q --count 10000 --size 512\n  \
        BMQ_BROKERS=10.0.0.1:30101 bmqctl produce --queue bmq://bmq.test/q --json"
)]
pub struct ProduceArgs {
    /// The queue, bmq://<domain>/<queue>.
    #[arg(long, value_name = "URI")]
    pub queue: String,
    /// Number of messages to publish.
    #[arg(long, default_value_t = 1000)]
    pub count: u64,
    /// Size of each message in bytes (at least the 32-byte self-check header).
    #[arg(long, value_name = "BYTES", default_value_t = 1024)]
    pub size: usize,
    /// Most unacknowledged messages at once.
    #[arg(long, default_value_t = 1000)]
    pub window: usize,
    /// Client address of a broker, host:port; repeat the flag or separate with commas
    /// [default: $BMQ_BROKERS, else 127.0.0.1:30101,127.0.0.1:30102,127.0.0.1:30103].
    #[arg(long = "broker", value_name = "HOST:PORT", value_delimiter = ',')]
    pub broker: Vec<String>,
    /// Give up if not every message is acknowledged within this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub timeout_secs: u64,
    /// Print a JSON report instead of the summary line.
    #[arg(long)]
    pub json: bool,
    /// A property of every message, KEY=VALUE (a string) or KEY:int=VALUE (a 64-bit
    /// integer); repeat the flag for more.
    #[arg(long = "property", value_name = "KEY=VALUE", value_parser = parse_property)]
    pub properties: Vec<Property>,
    /// Give every message an integer property of this name holding its sequence number (0, 1,
    /// ...): for consumers with subscriptions such as `seq >= 50`.
    #[arg(long, value_name = "NAME")]
    pub sequence_property: Option<String>,
    /// TLS and token.
    #[command(flatten)]
    pub security: crate::credentials::ClientSecurityArgs,
}

/// What `bmqctl produce` did.
#[derive(Debug, Clone, Serialize)]
pub struct ProduceReport {
    /// The queue.
    pub uri: String,
    /// The random producer id written in every payload.
    pub producer_id: u64,
    /// Messages asked for.
    pub count: u64,
    /// Messages handed to the client library.
    pub sent: u64,
    /// Messages acknowledged with SUCCESS.
    pub acked: u64,
    /// Messages answered with another status, or failed by the client library.
    pub nacked: u64,
    /// NACK reasons (`STATUS: message`) and how many messages got each.
    pub nack_reasons: BTreeMap<String, u64>,
    /// Messages still unacknowledged when the timeout hit (0 when it did not).
    pub unacknowledged: u64,
    /// From opening the queue to the last acknowledgement.
    #[serde(rename = "elapsed_secs", serialize_with = "as_secs_f64")]
    pub elapsed: Duration,
    /// `acked / elapsed`, messages per second.
    pub rate_msgs_per_sec: f64,
}

fn rate(n: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Runs `bmqctl produce`: publishes `count` payloads of `size` bytes and waits for every ack.
///
/// Errors: bad arguments, no broker reachable, queue refused, any NACK, or acknowledgements
/// missing at the timeout (the summary is printed first in the last two cases).
pub async fn run(args: ProduceArgs) -> anyhow::Result<ProduceReport> {
    let uri = QueueUri::parse(&args.queue)?.to_string();
    if args.size > payload::PAYLOAD_LEN_MAX {
        bail!(
            "--size {} exceeds {} bytes",
            args.size,
            payload::PAYLOAD_LEN_MAX
        );
    }
    if args.window == 0 {
        bail!("--window must be at least 1");
    }
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let deadline = tokio::time::Instant::now() + timeout;
    let client = connect(
        resolve_brokers(&args.broker),
        args.window,
        timeout,
        "produce",
        &args.security,
    )
    .await?;
    client
        .open_queue(&uri, OpenOptions::write())
        .await
        .with_context(|| format!("cannot open {uri} for writing"))?;

    let producer_id: u64 = rand::random();
    let start = Instant::now();
    let mut report = ProduceReport {
        uri: uri.clone(),
        producer_id,
        count: args.count,
        sent: 0,
        acked: 0,
        nacked: 0,
        nack_reasons: BTreeMap::new(),
        unacknowledged: 0,
        elapsed: Duration::ZERO,
        rate_msgs_per_sec: 0.0,
    };

    // Acks are collected by a second task so sending never waits for one ack in particular;
    // the client library bounds the outstanding PUTs to the window.
    let (acks_tx, mut acks_rx) = mpsc::channel::<PendingAck>(args.window);
    let collector = tokio::spawn(async move {
        let mut acked = 0u64;
        let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
        while let Some(pending) = acks_rx.recv().await {
            match pending.await {
                Ok(ack) if ack.status() == AckStatus::Success => acked += 1,
                Ok(ack) => {
                    *reasons
                        .entry(format!("{}: {}", ack.status().as_str_name(), ack.message))
                        .or_default() += 1
                }
                Err(e) => *reasons.entry(e.to_string()).or_default() += 1,
            }
        }
        (acked, reasons)
    });

    let send_all = async {
        for sequence in 0..args.count {
            let body = payload::encode(producer_id, sequence, args.size);
            let mut properties = args.properties.clone();
            if let Some(name) = &args.sequence_property {
                properties.push(Property {
                    key: name.clone(),
                    value: sequence.to_string(),
                    value_type: PropertyType::Int64 as i32,
                });
            }
            let pending = client.put(&uri, body, properties).await?;
            report.sent += 1;
            if acks_tx.send(pending).await.is_err() {
                break;
            }
        }
        Ok::<(), ClientError>(())
    };
    let sent = tokio::time::timeout_at(deadline, send_all).await;
    drop(acks_tx);
    let collected = tokio::time::timeout_at(deadline, collector).await;
    report.elapsed = start.elapsed();
    let timed_out = sent.is_err() || collected.is_err();
    if let Ok(Err(e)) = sent {
        return Err(e).context("publishing failed");
    }
    if let Ok(joined) = collected {
        let (acked, reasons) = joined.context("ack collector panicked")?;
        report.acked = acked;
        report.nacked = reasons.values().sum();
        report.nack_reasons = reasons;
    } else {
        // The collector's partial counts are lost with it; count what the client still holds.
        report.acked = report.sent.saturating_sub(client.pending_puts() as u64);
    }
    report.unacknowledged = args.count.saturating_sub(report.acked + report.nacked);
    report.rate_msgs_per_sec = rate(report.acked, report.elapsed);
    print_report(&report, args.json)?;
    let _ = client.disconnect().await;

    if report.nacked > 0 {
        bail!(
            "{} of {} messages were not acknowledged",
            report.nacked,
            args.count
        );
    }
    if timed_out || report.unacknowledged > 0 {
        bail!(
            "timed out after {} s with {} of {} messages unacknowledged",
            timeout.as_secs(),
            report.unacknowledged,
            args.count
        );
    }
    Ok(report)
}

fn print_report(report: &ProduceReport, json: bool) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    let reasons = if report.nack_reasons.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = report
            .nack_reasons
            .iter()
            .map(|(reason, n)| format!("{n} x {reason}"))
            .collect();
        format!(" ({})", list.join("; "))
    };
    let unacked = if report.unacknowledged > 0 {
        format!(", unacknowledged {}", report.unacknowledged)
    } else {
        String::new()
    };
    outln!(
        "produced {} messages to {}: acked {}, nacked {}{}{}, in {:.2} s ({:.0} msg/s)",
        report.sent,
        report.uri,
        report.acked,
        report.nacked,
        reasons,
        unacked,
        report.elapsed.as_secs_f64(),
        report.rate_msgs_per_sec
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ProduceArgs,
    }

    #[test]
    fn defaults_and_broker_lists() {
        // Defaults match the documentation; --broker accepts repeats and commas.
        let cli = Cli::parse_from(["x", "--queue", "bmq://d/q"]);
        assert_eq!(cli.args.count, 1000);
        assert_eq!(cli.args.size, 1024);
        assert_eq!(cli.args.window, 1000);
        assert_eq!(cli.args.timeout_secs, 60);
        assert!(!cli.args.json);
        let cli = Cli::parse_from([
            "x",
            "--queue",
            "bmq://d/q",
            "--broker",
            "a:1,b:2",
            "--broker",
            "c:3",
        ]);
        assert_eq!(
            crate::connect::resolve_brokers(&cli.args.broker),
            vec!["a:1", "b:2", "c:3"]
        );
        if std::env::var_os("BMQ_BROKERS").is_none() {
            assert_eq!(crate::connect::resolve_brokers(&[]), split_default());
        }
    }

    fn split_default() -> Vec<String> {
        crate::connect::DEFAULT_BROKERS
            .split(',')
            .map(String::from)
            .collect()
    }

    #[test]
    fn properties_parse_with_their_type() {
        let p = parse_property("region=emea").unwrap();
        assert_eq!((p.key.as_str(), p.value.as_str()), ("region", "emea"));
        assert_eq!(p.value_type, PropertyType::String as i32);
        let p = parse_property("seq:int=-5").unwrap();
        assert_eq!(
            (p.key.as_str(), p.value_type),
            ("seq", PropertyType::Int64 as i32)
        );
        assert!(parse_property("seq:int=x").is_err());
        assert!(parse_property("novalue").is_err());
        assert!(parse_property("k:float=1").is_err());
    }
}

#[cfg(test)]
mod run_tests {
    use super::*;
    use bmq_client::testing::{Behaviour, FakeBroker};

    fn args(addr: &str) -> ProduceArgs {
        ProduceArgs {
            queue: "bmq://bmq.test/q".into(),
            count: 50,
            size: 100,
            window: 8,
            broker: vec![addr.to_string()],
            timeout_secs: 5,
            json: false,
            properties: Vec::new(),
            sequence_property: None,
            security: crate::credentials::ClientSecurityArgs {
                no_tls: true,
                token: Some(String::new()),
                ..Default::default()
            },
        }
    }

    #[tokio::test]
    async fn produces_and_counts_acks() {
        // Every message is acknowledged: the report says so and run succeeds.
        let broker = FakeBroker::start(Behaviour::default()).await;
        let report = run(args(&broker.addr)).await.unwrap();
        assert_eq!((report.sent, report.acked, report.nacked), (50, 50, 0));
        assert_eq!(report.unacknowledged, 0);
    }

    #[tokio::test]
    async fn nacks_fail_the_run() {
        // NACKed messages make run return an error naming how many.
        let broker = FakeBroker::start(Behaviour {
            nack: Some(AckStatus::LimitReached),
            ..Default::default()
        })
        .await;
        let err = run(args(&broker.addr)).await.unwrap_err();
        assert!(err.to_string().contains("50 of 50"), "{err}");
    }

    #[tokio::test]
    async fn missing_acks_time_out() {
        // Without acks, run gives up at the timeout with an error.
        let broker = FakeBroker::start(Behaviour {
            no_acks: true,
            ..Default::default()
        })
        .await;
        let mut a = args(&broker.addr);
        a.timeout_secs = 1;
        let err = run(a).await.unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    }
}

/// `KEY=VALUE` (a string property) or `KEY:int=VALUE` (a 64-bit integer).
fn parse_property(s: &str) -> Result<Property, String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))?;
    let (key, value_type) = match key.rsplit_once(':') {
        Some((key, "int")) => {
            value
                .parse::<i64>()
                .map_err(|e| format!("{value:?} is not a 64-bit integer: {e}"))?;
            (key, PropertyType::Int64)
        }
        Some((_, other)) => return Err(format!("unknown property type {other:?} (int)")),
        None => (key, PropertyType::String),
    };
    if key.is_empty() {
        return Err(format!("{s:?} has no key"));
    }
    Ok(Property {
        key: key.to_string(),
        value: value.to_string(),
        value_type: value_type as i32,
    })
}
