//! `bmqctl consume`: receive, verify and confirm self-checking messages ([`super::payload`])
//! from a queue.
//!
//! Every payload is verified byte by byte; messages are counted by their distinct
//! `(producer_id, sequence)`, so duplicates and redeliveries (at-least-once, DESIGN.md §7) show
//! up separately from losses. Every message is confirmed, corrupt ones included (so they are not
//! redelivered forever). Stops after `--count` distinct messages, or after `--idle-timeout-secs`
//! without a message when no count is given, or at `--timeout-secs`.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bmq_proto::client::{ConsumerOptions, Subscription};
use bmq_proto::expression::Expression;
use serde::Serialize;

use crate::connect::{as_secs_f64, connect, resolve_brokers};
use crate::payload;
use bmq_client::OpenOptions;
use bmq_proto::uri::QueueUri;

/// Arguments of `bmqctl consume`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Receive, verify and confirm messages from a queue",
    after_help = "Examples:\n  \
        bmqctl consume --queue bmq://bmq.test/q --count 10000\n  \
        bmqctl consume --queue bmq://bmq.test/q --idle-timeout-secs 5 --json\n  \
        bmqctl consume --queue bmq://bmq.test/q --subscription 'seq >= 50' --count 50"
)]
pub struct ConsumeArgs {
    /// The queue, bmq://<domain>/<queue>.
    #[arg(long, value_name = "URI")]
    pub queue: String,
    /// Stop after this many distinct messages; without it, stop after --idle-timeout-secs
    /// without a message.
    #[arg(long)]
    pub count: Option<u64>,
    /// Without --count: stop after this many seconds without a message.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub idle_timeout_secs: u64,
    /// Client address of a broker, host:port; repeat the flag or separate with commas
    /// [default: $BMQ_BROKERS, else 127.0.0.1:30101,127.0.0.1:30102,127.0.0.1:30103].
    #[arg(long = "broker", value_name = "HOST:PORT", value_delimiter = ',')]
    pub broker: Vec<String>,
    /// Most messages delivered and not yet confirmed (the consumer's flow control).
    #[arg(long, default_value_t = 1000)]
    pub max_unconfirmed: u32,
    /// Give up after this many seconds (an error if --count was not reached).
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub timeout_secs: u64,
    /// Print a JSON report instead of the summary line.
    #[arg(long)]
    pub json: bool,
    /// Receive only the messages whose properties match this expression (BlazingMQ's
    /// subscription language, e.g. `seq >= 50 && region == "emea"`); the others stay in the
    /// queue for other consumers.
    #[arg(long, value_name = "EXPR")]
    pub subscription: Option<String>,
    /// The consumer's priority: only the highest-priority consumers of a queue receive.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub priority: i32,
    /// TLS and token.
    #[command(flatten)]
    pub security: crate::credentials::ClientSecurityArgs,
}

/// What one producer's messages looked like to the consumer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProducerSummary {
    /// Distinct sequences received.
    pub distinct: u64,
    /// Highest sequence received; `max_sequence + 1 - distinct` sequences below it are missing.
    pub max_sequence: u64,
}

/// What `bmqctl consume` did.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumeReport {
    /// The queue.
    pub uri: String,
    /// Messages received, duplicates and corrupt ones included.
    pub received: u64,
    /// Distinct `(producer_id, sequence)` among the valid messages.
    pub distinct: u64,
    /// Messages confirmed (all received ones whose confirm could be sent).
    pub confirmed: u64,
    /// Valid messages whose `(producer_id, sequence)` was already received.
    pub duplicates: u64,
    /// Messages delivered with `delivery_attempt > 1`.
    pub redeliveries: u64,
    /// Messages whose payload did not verify.
    pub corrupt: u64,
    /// Per producer id: distinct count and highest sequence.
    pub producers: BTreeMap<u64, ProducerSummary>,
    /// From opening the queue to the last message received.
    #[serde(rename = "elapsed_secs", serialize_with = "as_secs_f64")]
    pub elapsed: Duration,
    /// `received / elapsed`, messages per second.
    pub rate_msgs_per_sec: f64,
}

impl ConsumeReport {
    fn new(uri: String) -> Self {
        ConsumeReport {
            uri,
            received: 0,
            distinct: 0,
            confirmed: 0,
            duplicates: 0,
            redeliveries: 0,
            corrupt: 0,
            producers: BTreeMap::new(),
            elapsed: Duration::ZERO,
            rate_msgs_per_sec: 0.0,
        }
    }

    /// Counts one received message with `payload`; `seen` holds the distinct ids so far.
    fn record(&mut self, seen: &mut HashSet<(u64, u64)>, payload: &[u8], delivery_attempt: u32) {
        self.received += 1;
        if delivery_attempt > 1 {
            self.redeliveries += 1;
        }
        match payload::verify(payload) {
            Ok((producer_id, sequence)) => {
                if seen.insert((producer_id, sequence)) {
                    self.distinct += 1;
                    let p = self.producers.entry(producer_id).or_default();
                    p.distinct += 1;
                    p.max_sequence = p.max_sequence.max(sequence);
                } else {
                    self.duplicates += 1;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "corrupt payload");
                self.corrupt += 1;
            }
        }
    }
}

/// Runs `bmqctl consume` (see the module doc).
///
/// Errors: bad arguments, no broker reachable, queue refused, any corrupt payload, or `--count`
/// not reached before `--timeout-secs` (the summary is printed first in the last two cases).
pub async fn run(args: ConsumeArgs) -> anyhow::Result<ConsumeReport> {
    let uri = QueueUri::parse(&args.queue)?.to_string();
    if args.max_unconfirmed == 0 {
        bail!("--max-unconfirmed must be at least 1");
    }
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let idle = Duration::from_secs(args.idle_timeout_secs.max(1));
    let deadline = tokio::time::Instant::now() + timeout;
    let client = connect(
        resolve_brokers(&args.broker),
        1,
        timeout,
        "consume",
        &args.security,
    )
    .await?;
    let subscriptions = match &args.subscription {
        None => Vec::new(),
        Some(text) => {
            // Checked here too, for an error that names the offset before any connection.
            Expression::compile(text)
                .with_context(|| format!("--subscription {text:?} is not a valid expression"))?;
            vec![Subscription {
                id: 1,
                expression: text.clone(),
                priority: args.priority,
                max_unconfirmed_messages: args.max_unconfirmed,
                max_unconfirmed_bytes: 0,
            }]
        }
    };
    let consumer = ConsumerOptions {
        max_unconfirmed_messages: args.max_unconfirmed,
        max_unconfirmed_bytes: 0,
        priority: args.priority,
        app_id: String::new(),
        subscriptions,
        ..Default::default()
    };
    client
        .open_queue(&uri, OpenOptions::read(consumer))
        .await
        .with_context(|| format!("cannot open {uri} for reading"))?;

    let start = Instant::now();
    let mut report = ConsumeReport::new(uri.clone());
    let mut seen = HashSet::new();
    loop {
        if args.count.is_some_and(|n| report.distinct >= n) {
            break;
        }
        let wait_until = match args.count {
            Some(_) => deadline,
            None => deadline.min(tokio::time::Instant::now() + idle),
        };
        let message = match tokio::time::timeout_at(wait_until, client.next_message()).await {
            Ok(Some(message)) => message,
            Ok(None) => bail!("the client was disconnected"),
            // Idle (without --count) or the overall timeout: the end either way.
            Err(_) => break,
        };
        report.record(&mut seen, &message.payload, message.delivery_attempt);
        if client.confirm(&message.uri, message.guid).await.is_ok() {
            report.confirmed += 1;
        }
        report.elapsed = start.elapsed();
    }
    report.rate_msgs_per_sec = if report.elapsed.is_zero() {
        0.0
    } else {
        report.received as f64 / report.elapsed.as_secs_f64()
    };
    let _ = client.close_queue(&uri).await;
    let _ = client.disconnect().await;
    print_report(&report, args.json)?;

    if report.corrupt > 0 {
        bail!("{} corrupt messages received", report.corrupt);
    }
    if let Some(n) = args.count {
        if report.distinct < n {
            bail!(
                "timed out after {} s with {} of {} messages received",
                timeout.as_secs(),
                report.distinct,
                n
            );
        }
    }
    Ok(report)
}

fn print_report(report: &ConsumeReport, json: bool) -> anyhow::Result<()> {
    if json {
        outln!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    outln!(
        "consumed {} messages from {}: confirmed {}, duplicates {}, corrupt {}, in {:.2} s ({:.0} msg/s)",
        report.distinct,
        report.uri,
        report.confirmed,
        report.duplicates,
        report.corrupt,
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
        args: ConsumeArgs,
    }

    #[test]
    fn defaults() {
        // Defaults match the documentation.
        let cli = Cli::parse_from(["x", "--queue", "bmq://d/q"]);
        assert_eq!(cli.args.count, None);
        assert_eq!(cli.args.idle_timeout_secs, 10);
        assert_eq!(cli.args.max_unconfirmed, 1000);
        assert_eq!(cli.args.timeout_secs, 120);
    }

    #[test]
    fn report_counts_distinct_duplicates_and_corrupt() {
        // Duplicates, redeliveries and corrupt payloads are counted separately from distinct ones.
        let mut report = ConsumeReport::new("bmq://d/q".into());
        let mut seen = HashSet::new();
        report.record(&mut seen, &payload::encode(1, 0, 64), 1);
        report.record(&mut seen, &payload::encode(1, 2, 64), 1);
        report.record(&mut seen, &payload::encode(1, 0, 64), 2);
        report.record(&mut seen, &payload::encode(2, 5, 64), 1);
        report.record(&mut seen, b"garbage", 1);
        assert_eq!(report.received, 5);
        assert_eq!(report.distinct, 3);
        assert_eq!(report.duplicates, 1);
        assert_eq!(report.redeliveries, 1);
        assert_eq!(report.corrupt, 1);
        assert_eq!(report.producers[&1].distinct, 2);
        assert_eq!(report.producers[&1].max_sequence, 2);
        assert_eq!(report.producers[&2].max_sequence, 5);
    }
}

#[cfg(test)]
mod run_tests {
    use super::*;
    use bmq_client::testing::{Behaviour, FakeBroker};
    use bytes::Bytes;

    fn args(addr: &str, count: Option<u64>) -> ConsumeArgs {
        ConsumeArgs {
            queue: "bmq://bmq.test/q".into(),
            count,
            idle_timeout_secs: 1,
            broker: vec![addr.to_string()],
            max_unconfirmed: 100,
            timeout_secs: 3,
            json: false,
            subscription: None,
            priority: 0,
            security: crate::credentials::ClientSecurityArgs {
                no_tls: true,
                token: Some(String::new()),
                ..Default::default()
            },
        }
    }

    fn pushes() -> Vec<Bytes> {
        vec![
            payload::encode(7, 0, 64),
            payload::encode(7, 1, 64),
            payload::encode(7, 1, 64),
            payload::encode(7, 2, 64),
        ]
    }

    #[tokio::test]
    async fn consumes_verifies_and_confirms() {
        // Three distinct messages and one duplicate: count 3 is reached, all four confirmed.
        let mut broker = FakeBroker::start(Behaviour {
            push_on_open: pushes(),
            ..Default::default()
        })
        .await;
        let report = run(args(&broker.addr, Some(3))).await.unwrap();
        assert_eq!(report.distinct, 3);
        assert!(report.received >= 3);
        assert_eq!(report.corrupt, 0);
        let mut confirms = 0;
        while let Ok(Some(m)) =
            tokio::time::timeout(Duration::from_millis(200), broker.received.recv()).await
        {
            if matches!(
                m.kind,
                Some(bmq_proto::client::client_message::Kind::Confirm(_))
            ) {
                confirms += 1;
            }
        }
        assert_eq!(confirms as u64, report.confirmed);
    }

    #[tokio::test]
    async fn idle_timeout_ends_without_count_and_corrupt_fails() {
        // Without --count the run ends when idle; a corrupt payload makes it fail.
        let broker = FakeBroker::start(Behaviour {
            push_on_open: pushes(),
            ..Default::default()
        })
        .await;
        let report = run(args(&broker.addr, None)).await.unwrap();
        assert_eq!((report.distinct, report.duplicates), (3, 1));

        let mut bad = pushes();
        bad.push(Bytes::from_static(b"not a payload"));
        let broker = FakeBroker::start(Behaviour {
            push_on_open: bad,
            ..Default::default()
        })
        .await;
        let err = run(args(&broker.addr, None)).await.unwrap_err();
        assert!(err.to_string().contains("1 corrupt"), "{err}");
    }

    #[tokio::test]
    async fn count_not_reached_is_an_error() {
        // Asking for more distinct messages than exist fails at the timeout.
        let broker = FakeBroker::start(Behaviour {
            push_on_open: pushes(),
            ..Default::default()
        })
        .await;
        let mut a = args(&broker.addr, Some(10));
        a.timeout_secs = 1;
        let err = run(a).await.unwrap_err();
        assert!(err.to_string().contains("3 of 10"), "{err}");
    }
}
