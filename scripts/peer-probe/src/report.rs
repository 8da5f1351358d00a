//! `peer-probe report`: reads the JSON lines the runs appended to a results file and prints one
//! Markdown table: every figure of ours next to the peer's (NATS JetStream for messages and
//! broker failover, etcd for metadata writes and its failover), with the ratio ours / peer.
//! When a workload ran several times per system, each figure is the median of its runs (the
//! `runs` column says how many).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Context;

use crate::failover::FailoverResult;
use crate::measure::quantile;
use crate::messages::MessagesResult;
use crate::metadata::MetadataResult;
use crate::systems::System;

/// Values of one figure by system, keyed by (section, order of the workload's first line,
/// workload, figure order, figure name).
type Figures = BTreeMap<(u8, usize, String, u8, &'static str), BTreeMap<System, Vec<f64>>>;

fn median(v: &[f64]) -> Option<f64> {
    quantile(v, 0.5)
}

fn fmt(v: Option<f64>) -> String {
    match v {
        None => "—".into(),
        Some(x) if x >= 1000.0 => {
            let s = format!("{:.0}", x);
            // Thousands separators for readability.
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if i > 0 && (s.len() - i) % 3 == 0 {
                    out.push(',');
                }
                out.push(c);
            }
            out
        }
        Some(x) if x >= 100.0 => format!("{:.0}", x),
        Some(x) if x >= 10.0 => format!("{:.1}", x),
        Some(x) => format!("{:.2}", x),
    }
}

fn peer_name(s: System) -> &'static str {
    match s {
        System::Bmq => "ours",
        System::Nats => "NATS",
        System::Etcd => "etcd",
    }
}

/// Builds the table from the lines of a results file (blank lines and lines of unknown kind are
/// skipped).
///
/// Errors: a line that is not JSON, or a known kind with missing fields.
pub fn render(text: &str) -> anyhow::Result<String> {
    let mut figures: Figures = BTreeMap::new();
    let mut loads: Vec<(f64, f64)> = Vec::new();
    let mut first_seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut add =
        |section: u8, workload: &str, order: u8, figure: &'static str, s: System, v: f64| {
            let next = first_seen.len();
            let seen = *first_seen.entry(workload.to_string()).or_insert(next);
            figures
                .entry((section, seen, workload.to_string(), order, figure))
                .or_default()
                .entry(s)
                .or_default()
                .push(v);
        };
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", n + 1))?;
        match v.get("kind").and_then(|k| k.as_str()) {
            Some("messages") => {
                let r: MessagesResult = serde_json::from_value(v)
                    .with_context(|| format!("line {}: messages result", n + 1))?;
                loads.push(r.loadavg);
                let (l, s) = (&r.label, r.system);
                add(1, l, 1, "consumed msgs/s", s, r.consumed_per_sec);
                add(1, l, 2, "ACK p50 (ms)", s, r.ack.p50_ms);
                add(1, l, 3, "ACK p99 (ms)", s, r.ack.p99_ms);
                add(1, l, 4, "end-to-end p50 (ms)", s, r.e2e.p50_ms);
                add(1, l, 5, "end-to-end p99 (ms)", s, r.e2e.p99_ms);
                add(
                    1,
                    l,
                    6,
                    "errors + missing",
                    s,
                    (r.errors + r.missing) as f64,
                );
            }
            Some("metadata") => {
                let r: MetadataResult = serde_json::from_value(v)
                    .with_context(|| format!("line {}: metadata result", n + 1))?;
                loads.push(r.loadavg);
                let (l, s) = (&r.label, r.system);
                add(2, l, 1, "writes/s", s, r.writes_per_sec);
                add(2, l, 2, "latency p50 (ms)", s, r.latency.p50_ms);
                add(2, l, 3, "latency p99 (ms)", s, r.latency.p99_ms);
                add(2, l, 4, "errors", s, r.errors as f64);
            }
            Some("server_cpu") => {
                let r: ServerCpu = serde_json::from_value(v)
                    .with_context(|| format!("line {}: server CPU", n + 1))?;
                match r.workload.as_str() {
                    "messages" => add(1, &r.label, 7, CPU_PER_MESSAGE, r.system, r.cpu_us_per_op),
                    "metadata" => add(2, &r.label, 5, CPU_PER_WRITE, r.system, r.cpu_us_per_op),
                    other => anyhow::bail!("line {}: unknown workload {other:?}", n + 1),
                }
            }
            Some("failover") => {
                let r: FailoverResult = serde_json::from_value(v)
                    .with_context(|| format!("line {}: failover result", n + 1))?;
                loads.push(r.loadavg);
                match r.gap_ms {
                    Some(ms) => add(3, &r.scenario, 1, GAP, r.system, ms),
                    None => add(3, &r.scenario, 2, "runs without recovery", r.system, 1.0),
                }
            }
            _ => {}
        }
    }
    let mut out = String::new();
    writeln!(out, "| workload | figure | ours | peer | ours / peer |")?;
    writeln!(out, "|---|---|---|---|---|")?;
    for ((_, _, workload, _, figure), by_system) in &figures {
        let empty = Vec::new();
        let ours = by_system.get(&System::Bmq).unwrap_or(&empty);
        let peers: Vec<System> = by_system
            .keys()
            .copied()
            .filter(|s| *s != System::Bmq)
            .collect();
        let peers = if peers.is_empty() {
            vec![System::Bmq]
        } else {
            peers
        };
        for p in peers {
            let peer = if p == System::Bmq {
                &empty
            } else {
                &by_system[&p]
            };
            let (a, b) = if *figure == GAP {
                // Failover: p50 / p99 over the runs, and how many.
                let q = |v: &[f64]| {
                    if v.is_empty() {
                        return "—".to_string();
                    }
                    format!(
                        "{} / {} (n={})",
                        fmt(quantile(v, 0.5)),
                        fmt(quantile(v, 0.99)),
                        v.len()
                    )
                };
                (q(ours), q(peer))
            } else {
                let runs = |v: &[f64]| {
                    if v.len() > 1 {
                        format!(" ({} runs)", v.len())
                    } else {
                        String::new()
                    }
                };
                // Counts are whole numbers.
                let count = figure.starts_with("errors") || figure.starts_with("runs");
                let f = |v: &[f64]| match median(v) {
                    Some(x) if count => format!("{}", v.iter().sum::<f64>().max(x) as u64),
                    m => fmt(m),
                };
                (
                    format!("{}{}", f(ours), runs(ours)),
                    format!("{}{}", f(peer), runs(peer)),
                )
            };
            let ratio = match (median(ours), median(peer)) {
                (Some(x), Some(y))
                    if y > 0.0 && !figure.starts_with("errors") && !figure.starts_with("runs") =>
                {
                    format!("{:.2}", x / y)
                }
                _ => "—".into(),
            };
            let vs = if p == System::Bmq {
                String::new()
            } else {
                format!(" (vs {})", peer_name(p))
            };
            writeln!(out, "| {workload}{vs} | {figure} | {a} | {b} | {ratio} |")?;
        }
    }
    if let (Some(lo), Some(hi)) = (
        loads.iter().map(|l| l.0.min(l.1)).reduce(f64::min),
        loads.iter().map(|l| l.0.max(l.1)).reduce(f64::max),
    ) {
        writeln!(
            out,
            "\nLoad average (1 min) at the start and end of the runs: {lo:.2} to {hi:.2}."
        )?;
    }
    Ok(out)
}

/// Name of the failover gap figure (p50 / p99 over the runs).
const GAP: &str = "signal -> recovery p50 / p99 (ms)";

/// Names of the servers' CPU figures (`server_cpu` lines).
const CPU_PER_MESSAGE: &str = "servers' CPU per message (µs)";
const CPU_PER_WRITE: &str = "servers' CPU per write (µs)";

/// A `server_cpu` line, written by `scripts/bench-peers.sh` after each workload run: the CPU
/// time (user + system, `/proc/<pid>/stat`) of the system's three server processes over that
/// run, divided by its operations (messages sent, or metadata writes made).
#[derive(Debug, serde::Deserialize)]
struct ServerCpu {
    system: System,
    /// The run's label, as its result line gives it.
    label: String,
    /// `messages` or `metadata`.
    workload: String,
    /// Microseconds of server CPU per operation, all three servers together.
    cpu_us_per_op: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_ours_over_peer() {
        // One message run per system: the ratio row divides ours by NATS.
        let bmq = r#"{"kind":"messages","system":"bmq","label":"1p1c","producers":1,"consumers":1,"size":1024,"window":256,"rate":0,"sent":10,"acked":10,"errors":0,"received":10,"redeliveries":0,"missing":0,"produced_per_sec":200.0,"consumed_per_sec":200.0,"ack":{"count":10,"p50_ms":2.0,"p90_ms":3.0,"p99_ms":4.0,"max_ms":5.0},"e2e":{"count":10,"p50_ms":1.0,"p90_ms":1.0,"p99_ms":1.0,"max_ms":1.0},"loadavg":[1.0,2.0]}"#;
        let nats = bmq
            .replace("\"bmq\"", "\"nats\"")
            .replace("\"consumed_per_sec\":200.0", "\"consumed_per_sec\":100.0");
        let table = render(&format!("{bmq}\n{nats}\n")).unwrap();
        assert!(
            table.contains("| 1p1c (vs NATS) | consumed msgs/s | 200 | 100 | 2.00 |"),
            "{table}"
        );
        assert!(table.contains("| 1p1c (vs NATS) | ACK p50 (ms) | 2.00 | 2.00 | 1.00 |"));
        assert!(table.contains("1.00 to 2.00"));
        // Failover runs of ours against two peers: one row per peer, p50 / p99 and n.
        let fo = |sys: &str, ms: f64| {
            format!(
                r#"{{"kind":"failover","system":"{sys}","scenario":"s","node_index":0,"gap_ms":{ms},"errors":0,"loadavg":[1.0,1.0]}}"#
            )
        };
        let t = render(
            &[
                fo("bmq", 100.0),
                fo("bmq", 300.0),
                fo("nats", 1000.0),
                fo("etcd", 400.0),
            ]
            .join("\n"),
        )
        .unwrap();
        assert!(t.contains("| s (vs NATS) | signal -> recovery p50 / p99 (ms) | 100 / 300 (n=2) | 1,000 / 1,000 (n=1) | 0.10 |"), "{t}");
        assert!(t.contains("| s (vs etcd) | signal -> recovery p50 / p99 (ms) | 100 / 300 (n=2) | 400 / 400 (n=1) | 0.25 |"), "{t}");
    }

    #[test]
    fn server_cpu_lines_make_rows_beside_their_workloads() {
        // The servers' CPU of a messages run and of a metadata run, ours against each peer.
        let cpu = |sys: &str, workload: &str, label: &str, us: f64| {
            format!(
                r#"{{"kind":"server_cpu","system":"{sys}","label":"{label}","workload":"{workload}","ops":1000,"cpu_us_per_op":{us}}}"#
            )
        };
        let t = render(
            &[
                cpu("bmq", "messages", "1p1c", 10.0),
                cpu("nats", "messages", "1p1c", 40.0),
                cpu("bmq", "metadata", "meta", 50.0),
                cpu("etcd", "metadata", "meta", 100.0),
            ]
            .join("\n"),
        )
        .unwrap();
        assert!(
            t.contains("| 1p1c (vs NATS) | servers' CPU per message (µs) | 10.0 | 40.0 | 0.25 |"),
            "{t}"
        );
        assert!(
            t.contains("| meta (vs etcd) | servers' CPU per write (µs) | 50.0 | 100 | 0.50 |"),
            "{t}"
        );
        // A workload the report does not know is an error, not a silent skip.
        assert!(render(&cpu("bmq", "other", "x", 1.0)).is_err());
    }

    #[test]
    fn thousands_separators() {
        // Large figures are printed with separators, small ones with decimals.
        assert_eq!(fmt(Some(11904.4)), "11,904");
        assert_eq!(fmt(Some(1234567.0)), "1,234,567");
        assert_eq!(fmt(Some(47.94)), "47.9");
        assert_eq!(fmt(Some(1.654)), "1.65");
        assert_eq!(fmt(None), "—");
    }
}
