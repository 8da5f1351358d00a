//! A real Prometheus server for the tests that check the shipped dashboards
//! (`tests/tests/prometheus.rs`, `tests/tests/consoles.rs`): the scrape configuration, alert
//! rules and console pages of [`bmqctl::prometheus`], pointed at a test cluster.
//!
//! Needs Debian's `prometheus` package (`prometheus` and `promtool` on `PATH`); `scripts/test.sh`
//! installs it when missing. Without it [`tool`] fails with that instruction.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use bmqctl::prometheus::{self, ScrapeTarget};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::free_ports;

/// `prometheus` or `promtool` from `PATH`, or an error saying how to install it.
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
    prometheus::find_on_path(name).with_context(|| {
        format!(
            "`{name}` is not on PATH: install Debian's prometheus package \
             (apt-get update && apt-get install -y prometheus), as scripts/test.sh does"
        )
    })
}

/// A Prometheus server process with its own port and storage, killed on drop.
///
/// It serves the dashboards' console pages at `/consoles/<page>` when the installation's
/// console libraries are found ([`PrometheusServer::consoles`]).
pub struct PrometheusServer {
    child: Option<Child>,
    /// `127.0.0.1:<port>` of its UI and HTTP API.
    pub addr: String,
    consoles: bool,
    dir: tempfile::TempDir,
}

impl PrometheusServer {
    /// Starts Prometheus with the shipped configuration for `targets`.
    ///
    /// Errors: no `prometheus` on `PATH`, the files cannot be written, the spawn fails.
    pub fn start(targets: &[ScrapeTarget]) -> anyhow::Result<PrometheusServer> {
        let binary = tool("prometheus")?;
        let dir = tempfile::Builder::new()
            .prefix("bmq-prometheus-")
            .tempdir()?;
        let config = prometheus::write_config(dir.path(), targets)?;
        let consoles_dir = dir.path().join("consoles");
        prometheus::write_consoles(&consoles_dir)?;
        let libraries = prometheus::find_console_libraries(&binary);
        let addr = format!("127.0.0.1:{}", free_ports(1)[0]);
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let mut command = Command::new(binary);
        command
            .args(prometheus::server_args(
                &config,
                &dir.path().join("data"),
                &addr,
            ))
            .args(
                libraries
                    .iter()
                    .flat_map(|libraries| prometheus::console_args(&consoles_dir, libraries)),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: only prctl runs between fork and exec: if the test process dies without
        // unwinding, the kernel stops Prometheus too.
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().context("spawn prometheus")?;
        Ok(PrometheusServer {
            child: Some(child),
            addr,
            consoles: libraries.is_some(),
            dir,
        })
    }

    /// Whether it serves the console pages (the console libraries were found).
    pub fn consoles(&self) -> bool {
        self.consoles
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// One GET on the HTTP API; the parsed JSON body (whatever the HTTP status: the API
    /// reports errors in the body).
    pub async fn get(&self, path: &str, params: &[(&str, &str)]) -> anyhow::Result<Value> {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encode(v)))
            .collect();
        let target = if query.is_empty() {
            path.to_string()
        } else {
            format!("{path}?{}", query.join("&"))
        };
        let (status, body) = http_get(&self.addr, &target).await?;
        serde_json::from_str(&body)
            .with_context(|| format!("GET {path}: HTTP {status}, body not JSON: {body}"))
    }

    /// An instant query's result vector.
    pub async fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let v = self.get("/api/v1/query", &[("query", expr)]).await?;
        ensure!(v["status"] == "success", "query {expr}: {v}");
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// Waits until `check` holds for the result of `expr`.
    pub async fn wait_for(
        &self,
        what: &str,
        expr: &str,
        timeout: Duration,
        check: impl Fn(&[Value]) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = Vec::new();
        while Instant::now() < deadline {
            if let Ok(result) = self.query(expr).await {
                if check(&result) {
                    return Ok(());
                }
                last = result;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!("timed out after {timeout:?} waiting for {what} ({expr}); last result: {last:?}")
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- prometheus log ---\n{}", self.log());
        }
    }
}

/// `s` percent-encoded for a URL's query string.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One HTTP/1.0 GET (so the server closes after a plain, unchunked body), bounded in time;
/// returns the status code and the body.
pub async fn http_get(addr: &str, target: &str) -> anyhow::Result<(u16, String)> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {target} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .with_context(|| format!("malformed HTTP response: {text}"))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no HTTP status in {head}"))?;
        anyhow::Ok((status, body.to_string()))
    })
    .await
    .with_context(|| format!("GET {target} on {addr} timed out"))?
}
