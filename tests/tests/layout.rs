//! The workspace layout's rules (DESIGN.md §2, ARCHITECTURE.md "Invariants"), read from cargo's
//! own resolution of each crate's normal dependencies (`cargo tree -p <crate> -e normal`, which
//! resolves features as a build of that crate alone would):
//!
//! - the pure cores (`bmq-elector`, `bmq-metadata`, `bmq-dataplane`), the configuration
//!   (`bmq-config`) and BlazingMQ's wire codec (`bmq-bmqp`) compile without any async runtime
//!   or actor framework: no tokio, no actix;
//! - the client library (`bmq-client`) never pulls actix or actix-web, and neither does the
//!   operator tool (`bmqctl`), which does not depend on the node (`bmq-broker`) either;
//! - only the node depends on actix.
//!
//! A failure names the crate and the forbidden dependency; `cargo tree -p <crate> -e normal -i
//! <dependency>` shows the path that brings it in.

use std::collections::BTreeSet;
use std::process::Command;

/// The package names in `package`'s normal dependency tree (itself included).
fn normal_dependencies(package: &str) -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let output = Command::new(cargo)
        .args([
            "tree",
            "--manifest-path",
            manifest,
            "--locked",
            "--offline",
            "-p",
            package,
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "cargo tree -p {package} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn assert_free_of(package: &str, forbidden: &[&str]) {
    let deps = normal_dependencies(package);
    assert!(deps.contains(package), "cargo tree did not list {package}");
    let found: Vec<&&str> = forbidden.iter().filter(|f| deps.contains(**f)).collect();
    assert!(
        found.is_empty(),
        "{package} depends on {found:?} (see `cargo tree -p {package} -e normal -i <name>`)"
    );
}

const RUNTIMES: &[&str] = &[
    "tokio",
    "tokio-util",
    "actix",
    "actix-rt",
    "actix-web",
    "mio",
];

#[test]
fn pure_cores_have_no_runtime() {
    // The elector, metadata and data-plane cores and the configuration compile without tokio
    // or actix: their logic can be stepped by tests and simulators with no runtime at all.
    for core in [
        "bmq-elector",
        "bmq-metadata",
        "bmq-dataplane",
        "bmq-config",
        "bmq-bmqp",
    ] {
        assert_free_of(core, RUNTIMES);
    }
}

#[test]
fn client_and_bmqctl_do_not_pull_the_node() {
    // A program that embeds the client library, and the operator tool, compile neither actix
    // nor the node.
    let actix = &["actix", "actix-rt", "actix-web", "bmq-broker"];
    assert_free_of("bmq-client", actix);
    assert_free_of("bmq-ctl", actix);
    let client = normal_dependencies("bmq-client");
    assert!(client.contains("tokio"), "the client is a tokio library");
}

#[test]
fn only_the_node_uses_actix() {
    // actix is the node's runtime: it is in bmq-broker's tree and in no other product's.
    let broker = normal_dependencies("bmq-broker");
    assert!(broker.contains("actix"), "bmq-broker runs on actix");
    for other in ["bmq-proto", "bmq-client", "bmq-ctl", "bmq-config"] {
        assert_free_of(other, &["actix"]);
    }
}

/// The code of `path` (relative to the workspace) before its inline test module, if any.
fn code_of(path: &str) -> String {
    let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {full}: {e}"));
    match text.find("#[cfg(test)]\nmod ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The non-test source files directly under `dir` (relative to the workspace).
fn sources(dir: &str) -> Vec<String> {
    let full = format!("{}/../{dir}", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<String> = std::fs::read_dir(&full)
        .unwrap_or_else(|e| panic!("list {full}: {e}"))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".rs") && !n.ends_with("tests.rs"))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    files.sort();
    files
}

#[test]
fn files_and_clocks_stay_out_of_the_cores() {
    // The storage floor owns the files (DESIGN.md §2): the data plane's cores and the whole
    // metadata and elector crates open none — the ledger's and the term store's files go
    // through the storage floor's `Disk` — and read no clock (they take `now`; the ledger's
    // record timestamps are set by its shell); the wire crate starts no thread.
    let mut cores = sources("dataplane/src");
    cores.extend(sources("metadata/src"));
    cores.extend(sources("elector/src"));
    for file in &cores {
        let code = code_of(file);
        for forbidden in ["std::fs", "rustix", "Instant::now()", "SystemTime::now()"] {
            assert!(
                !code.contains(forbidden),
                "{file} uses {forbidden}: files belong to the storage floor, time is an input"
            );
        }
    }
    for file in sources("proto/src") {
        assert!(
            !code_of(&file).contains("std::thread"),
            "{file} uses std::thread: the wire crate starts no thread"
        );
    }
}
