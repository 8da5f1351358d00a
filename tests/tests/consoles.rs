//! The dashboards as a person sees them: the console pages of `dashboards/consoles/`, served by
//! a real Prometheus scraping a 3-node cluster under load, opened in a headless Chromium.
//!
//! Each page must answer 200 from Prometheus (a template error is a 500), then Chromium runs
//! its JavaScript (a virtual time budget lets every graph's range query finish) and prints the
//! rendered DOM: every panel of the page's Grafana dashboard must be there, in order; a graph
//! must hold a drawn line (an SVG path with points) and no error ("No timeseries returned",
//! "Error loading data"); a single value must show a number, not "no data" or NaN. A screenshot
//! of each page goes to `target/consoles/`, and also to `$BMQ_CONSOLE_SCREENSHOTS` when set
//! (how `docs/dashboards/` is made: `BMQ_CONSOLE_SCREENSHOTS=docs/dashboards`, relative to the
//! repository root).
//!
//! Needs Debian's `prometheus` (with its console libraries) and `chromium-headless-shell`
//! packages; `scripts/test.sh` installs both. Without them the test says so and passes, except
//! under `CI=1`, where it fails.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use bmq_client::OpenOptions;
use bmq_proto::client::{AckStatus, ConsumerOptions};
use bmq_tests::prometheus::{http_get, PrometheusServer};
use bmq_tests::{client_config, open_consumer, open_producer, repo_root, round_trip, Cluster};
use bmqctl::prometheus::{self, ScrapeTarget, CONSOLE_PAGES};
use serde_json::Value;

/// Browsers that can print a page's DOM and take a screenshot headless; Debian's
/// `chromium-headless-shell` package installs the second.
const BROWSERS: &[&str] = &[
    "chrome-headless-shell",
    "chromium-headless-shell",
    "chromium",
    "chromium-browser",
];

/// How long the browser's page may run its JavaScript (virtual time: the graphs' queries).
const VIRTUAL_TIME_BUDGET_MS: u32 = 10_000;

/// How much data Prometheus holds before the pages are drawn: the load runs that long.
const MIN_DATA_SPAN: Duration = Duration::from_secs(30);

/// A bound on one browser run, in real time.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(60);

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// What this machine lacks to run the browser test: a failure under CI, a skip elsewhere.
fn missing(what: &str) {
    let why = format!(
        "{what}: install Debian's prometheus and chromium-headless-shell packages \
         (scripts/test.sh does)"
    );
    assert!(!under_ci(), "{why}");
    eprintln!("skipped: {why}");
}

/// The committed console pages and Grafana dashboards are what `dashboards/generate.py` writes.
#[test]
fn committed_dashboards_are_generated() {
    let output = std::process::Command::new("python3")
        .arg(repo_root().join("dashboards/generate.py"))
        .arg("--check")
        .output()
        .expect("run python3 dashboards/generate.py --check");
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The panels of a Grafana dashboard, in order: (title, whether it is a single-value panel).
fn grafana_panels(uid: &str) -> anyhow::Result<Vec<(String, bool)>> {
    let path = repo_root().join(format!("dashboards/grafana/{uid}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    Ok(doc["panels"]
        .as_array()
        .context("no panels")?
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            (
                p["title"].as_str().unwrap_or("?").to_string(),
                p["type"] == "stat",
            )
        })
        .collect())
}

/// One panel of a rendered page: its title and the DOM between its start and its description.
struct RenderedPanel<'a> {
    title: String,
    body: &'a str,
}

/// The panels of a page's rendered DOM, in order (each starts at a `data-panel` element, as
/// `dashboards/generate.py` writes them).
fn rendered_panels(dom: &str) -> Vec<RenderedPanel<'_>> {
    dom.split(" bmq_panel\" data-panel=\"")
        .skip(1)
        .map(|part| {
            let body = part
                .split("bmq_panel_description")
                .next()
                .unwrap_or_default();
            let title = body
                .split_once("<h4>")
                .and_then(|(_, rest)| rest.split_once("</h4>"))
                .map(|(title, _)| title.replace("&amp;", "&").replace("&#39;", "'"))
                .unwrap_or_default();
            RenderedPanel { title, body }
        })
        .collect()
}

/// Whether a graph drew a line: an SVG path of Rickshaw's with at least one point.
fn has_drawn_line(body: &str) -> bool {
    body.split("<path class=\"path\" d=\"M")
        .skip(1)
        .any(|rest| {
            rest.chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit() || c == '-' || c == '.')
        })
}

/// The texts of a single-value panel's value cells.
fn stat_values(body: &str) -> Vec<String> {
    body.split("class=\"bmq_value")
        .skip(1)
        .map(|cell| {
            cell.split_once('>')
                .and_then(|(_, rest)| rest.split_once('<'))
                .map(|(text, _)| text.trim().to_string())
                .unwrap_or_default()
        })
        .collect()
}

/// What is wrong with one panel as rendered, if anything.
fn panel_problem(panel: &RenderedPanel, stat: bool) -> Option<String> {
    for error in [
        "prom_graph_error",
        "No timeseries returned",
        "Error loading data",
    ] {
        if panel.body.contains(error) {
            return Some(format!("shows an error ({error})"));
        }
    }
    if stat {
        let values = stat_values(panel.body);
        if values.is_empty() {
            return Some("no value".into());
        }
        if let Some(bad) = values
            .iter()
            .find(|v| v.is_empty() || *v == "no data" || v.contains("NaN") || v.contains("Inf"))
        {
            return Some(format!("a value reads {bad:?}"));
        }
        return None;
    }
    if !panel.body.contains("<svg") || !has_drawn_line(panel.body) {
        return Some("no data drawn".into());
    }
    None
}

/// Runs the browser on `url` with `args` and returns its standard output.
async fn browser(
    binary: &Path,
    profile: &Path,
    args: &[String],
    url: &str,
) -> anyhow::Result<String> {
    let mut command = tokio::process::Command::new(binary);
    command
        .args([
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            &format!("--user-data-dir={}", profile.display()),
            &format!("--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}"),
        ])
        .args(args)
        .arg(url)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(BROWSER_TIMEOUT, command.output())
        .await
        .with_context(|| {
            format!(
                "{} on {url} took over {BROWSER_TIMEOUT:?}",
                binary.display()
            )
        })?
        .with_context(|| format!("run {}", binary.display()))?;
    ensure!(
        output.status.success(),
        "{} on {url}: {}\n{}",
        binary.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A producer that keeps putting a message every few milliseconds, and a consumer that confirms
/// them, until `stop`: the rates and latencies stay live while the pages are drawn.
async fn paced_traffic(brokers: Vec<String>, stop: Arc<AtomicBool>) -> anyhow::Result<u64> {
    let uri = "bmq://bmq.test/console-paced";
    let consumer = open_consumer(uri, brokers.clone(), "console-paced-c").await?;
    let producer = open_producer(uri, brokers, "console-paced-p").await?;
    let consume = async {
        while !stop.load(Ordering::Relaxed) {
            if let Ok(Some(msg)) =
                tokio::time::timeout(Duration::from_millis(200), consumer.next_message()).await
            {
                consumer.confirm(&msg.uri, msg.guid.clone()).await?;
            }
        }
        anyhow::Ok(())
    };
    let produce = async {
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let ack = producer
                .put(uri, bytes::Bytes::from(format!("paced {sent}")), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
            sent += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        anyhow::Ok(sent)
    };
    let (_, sent) = tokio::try_join!(consume, produce)?;
    producer.disconnect().await.ok();
    consumer.disconnect().await.ok();
    Ok(sent)
}

/// A 3-node cluster under load, scraped by a real Prometheus serving the console pages: every
/// page answers 200, and in a headless browser every panel of every page shows data and no
/// error; a screenshot of each page is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_console_page_shows_every_panel_with_data() {
    let Some(browser_binary) = BROWSERS.iter().find_map(|b| prometheus::find_on_path(b)) else {
        return missing("no headless Chromium on PATH");
    };
    if prometheus::find_on_path("prometheus").is_none() {
        return missing("no prometheus on PATH");
    }
    let cluster = Cluster::start(3).expect("start cluster");
    let targets: Vec<ScrapeTarget> = cluster
        .nodes
        .iter()
        .map(|n| ScrapeTarget {
            node_id: n.id,
            admin_addr: n.admin_addr(),
        })
        .collect();
    let prom = PrometheusServer::start(&targets).expect("start prometheus");
    if !prom.consoles() {
        return missing("no Prometheus console libraries (prom.lib)");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let result = async {
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        prom.wait_for(
            "all targets up",
            "up{job=\"bmq\"} == 1",
            Duration::from_secs(30),
            |r| r.len() == 3,
        )
        .await?;
        // Prometheus holds data from here on: the graphs are drawn over this span.
        let start = Instant::now();
        let addrs = cluster.client_addrs();
        let rotate = |k: usize| -> Vec<String> {
            (0..addrs.len())
                .map(|i| addrs[(i + k) % addrs.len()].clone())
                .collect()
        };
        let paced = tokio::spawn(paced_traffic(rotate(2), stop.clone()));

        // A few thousand messages through the proxy path (producer and consumer on different
        // nodes), then a backlog left unconfirmed, so depth and unconfirmed show.
        round_trip(
            "bmq://bmq.test/console-orders",
            rotate(0),
            rotate(1),
            1,
            3000,
        )
        .await?;
        let backlog = "bmq://bmq.test/console-backlog";
        let holder =
            bmq_client::Client::connect(client_config(rotate(1), "console-holder")).await?;
        holder
            .open_queue(
                backlog,
                OpenOptions::read(ConsumerOptions {
                    max_unconfirmed_messages: 5,
                    ..Default::default()
                }),
            )
            .await?;
        let backlog_producer = open_producer(backlog, rotate(0), "console-backlog-p").await?;
        for i in 0..50 {
            let ack = backlog_producer
                .put(backlog, bytes::Bytes::from(format!("kept {i}")), vec![])
                .await?
                .await?;
            ensure!(ack.status == AckStatus::Success as i32, "nack: {ack:?}");
        }
        // The traffic in Prometheus, and a few more scrapes so that every rate window holds it.
        prom.wait_for(
            "the traffic in Prometheus",
            "sum(bmq_queue_confirm_total{job=\"bmq\"}) >= 3000 \
             and on() sum(bmq_partition_messages{job=\"bmq\"}) >= 45",
            Duration::from_secs(30),
            |r| !r.is_empty(),
        )
        .await?;
        // Enough of it for a graph a person can read; the paced traffic goes on meanwhile.
        tokio::time::sleep(MIN_DATA_SPAN.saturating_sub(start.elapsed())).await;

        let shots: Vec<PathBuf> = [Some(repo_root().join("target/consoles"))]
            .into_iter()
            .chain([std::env::var_os("BMQ_CONSOLE_SCREENSHOTS").map(|d| repo_root().join(d))])
            .flatten()
            .collect();
        for dir in &shots {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        }
        let profile = tempfile::tempdir()?;
        // The graphs cover the test so far (the pages' default is the last 15 minutes).
        let duration = start.elapsed().as_secs() + 2;
        let mut failures = Vec::new();
        for (page, _) in CONSOLE_PAGES {
            let (status, body) = http_get(&prom.addr, &format!("/consoles/{page}")).await?;
            ensure!(status == 200, "/consoles/{page}: HTTP {status}: {body}");
            let uid = page.trim_end_matches(".html");
            let url = format!(
                "http://{}/consoles/{page}#pctc{{\"duration\":{duration},\"endTime\":0}}",
                prom.addr
            );
            let dom = browser(
                &browser_binary,
                profile.path(),
                &["--window-size=1400,2000".into(), "--dump-dom".into()],
                &url,
            )
            .await?;
            let rendered = rendered_panels(&dom);
            let expected = grafana_panels(uid)?;
            let titles: Vec<&str> = rendered.iter().map(|p| p.title.as_str()).collect();
            let expected_titles: Vec<&str> = expected.iter().map(|(t, _)| t.as_str()).collect();
            if titles != expected_titles {
                failures.push(format!(
                    "{page}: panels {titles:?}, the Grafana dashboard has {expected_titles:?}"
                ));
                continue;
            }
            for (panel, (_, stat)) in rendered.iter().zip(&expected) {
                if let Some(problem) = panel_problem(panel, *stat) {
                    failures.push(format!("{page} / {}: {problem}", panel.title));
                }
            }
            let height = page_height(uid)?;
            let png = shots[0].join(format!("{uid}.png"));
            browser(
                &browser_binary,
                profile.path(),
                &[
                    format!("--window-size=1400,{height}"),
                    format!("--screenshot={}", png.display()),
                ],
                &url,
            )
            .await?;
            ensure!(png.is_file(), "no screenshot at {}", png.display());
            for dir in &shots[1..] {
                let copy = dir.join(format!("{uid}.png"));
                std::fs::copy(&png, &copy).with_context(|| format!("write {}", copy.display()))?;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let sent = paced.await??;
        ensure!(sent > 0, "the paced producer sent nothing");
        drop(holder);
        ensure!(failures.is_empty(), "failures:\n{}", failures.join("\n"));
        eprintln!(
            "every console page shows its panels; screenshots in {}",
            shots
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        anyhow::Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    if let Err(e) = result {
        panic!(
            "{e:#}\n--- logs ---\n{}\n--- prometheus ---\n{}",
            cluster.log_tails(30),
            prom.log()
        );
    }
}

/// The window height that shows a whole page: the Grafana dashboard's grid height (rows of
/// 30 px units in Grafana; a console row of panels with its descriptions is taller).
fn page_height(uid: &str) -> anyhow::Result<u32> {
    let path = repo_root().join(format!("dashboards/grafana/{uid}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let bottom = doc["panels"]
        .as_array()
        .context("no panels")?
        .iter()
        .map(|p| p["gridPos"]["y"].as_u64().unwrap_or(0) + p["gridPos"]["h"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    Ok(400 + 42 * bottom as u32)
}
