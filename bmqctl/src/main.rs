//! `bmqctl`: the command-line tool of the broker cluster.
//!
//! Subcommands live in the `bmqctl` library; this file only parses the command line, sets up
//! logging and the runtime, and turns an error into `error: ...` and exit code 1.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use bmqctl::{admin, bench, cluster, cluster_nodes, consume, domain, produce, ready, status};

/// Command-line tool of the BlazingMQ-style broker cluster.
#[derive(Debug, Parser)]
#[command(
    name = "bmqctl",
    version,
    about = "Command-line tool of the broker cluster: start a local cluster, show its status, \
             produce and consume messages",
    after_help = "Examples:\n  \
        bmqctl cluster up                 # start 3 local nodes, Ctrl-C stops them\n  \
        bmqctl produce --queue bmq://bmq.test/orders --count 10000 --size 1024\n  \
        bmqctl consume --queue bmq://bmq.test/orders --count 10000\n  \
        bmqctl status                     # leader, term, LSNs, partitions, queues\n\n\
        Logging goes to standard error; RUST_LOG sets the filter (default: warn)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Manage a local cluster.
    #[command(
        subcommand,
        after_help = "Example:\n  bmqctl cluster up --nodes 3 --clean"
    )]
    Cluster(ClusterCommand),
    /// Show the cluster: nodes, leader, term, LSNs, partitions and queues.
    Status(status::StatusArgs),
    /// Publish self-checking messages to a queue and wait for their acknowledgements.
    Produce(produce::ProduceArgs),
    /// Receive, verify and confirm messages from a queue.
    Consume(consume::ConsumeArgs),
    /// Benchmarks: message throughput and latency, metadata commit rate.
    #[command(
        subcommand,
        after_help = "Examples:\n  bmqctl bench messages --count 200000 --size 1024\n  bmqctl bench metadata --queues 500"
    )]
    Bench(bench::BenchCommand),
    /// Exit 0 if a node is ready (GET /readyz answers 200); for container health checks.
    Ready(ready::ReadyArgs),
    /// Operator actions on one node: graceful stop, leadership cession.
    #[command(
        subcommand,
        after_help = "Example:\n  bmqctl admin stop --admin 127.0.0.1:30301"
    )]
    Admin(admin::AdminCommand),
    /// The cluster's domains: create, update, delete, list, show (committed cluster state).
    #[command(
        subcommand,
        after_help = "Example:\n  bmqctl domain create bmq.orders --max-queue-messages 10000 --admin 127.0.0.1:30301"
    )]
    Domain(domain::DomainCommand),
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Start N broker nodes on this machine and run them until Ctrl-C.
    Up(cluster::ClusterUpArgs),
    /// Add a node to the running local cluster: writes its configuration, starts it detached,
    /// adds it and waits until it is a voter.
    AddNode(cluster_nodes::AddNodeArgs),
    /// Remove a node from the running local cluster (it leaves, then exits).
    RemoveNode(cluster_nodes::RemoveNodeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .init();
    // `produce` and `consume` drive one client: on a current-thread runtime its connection
    // task and the command's own loop never hand work between threads (docs/bench/JOURNAL.md, "A
    // thread per benchmark client"). The others keep tokio's multi-thread runtime.
    let one_client = matches!(cli.command, Command::Produce(_) | Command::Consume(_));
    let mut builder = if one_client {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Cluster(ClusterCommand::Up(args)) => cluster::run(args).await,
        Command::Cluster(ClusterCommand::AddNode(args)) => cluster_nodes::add_node(args).await,
        Command::Cluster(ClusterCommand::RemoveNode(args)) => {
            cluster_nodes::remove_node(args).await
        }
        Command::Status(args) => status::run(args).await,
        // Both print their own report (summary line or JSON).
        Command::Produce(args) => produce::run(args).await.map(drop),
        Command::Consume(args) => consume::run(args).await.map(drop),
        Command::Bench(command) => bench::run(command).await,
        Command::Ready(args) => ready::run(args).await,
        Command::Admin(command) => admin::run(command).await,
        Command::Domain(command) => domain::run(command).await,
    }
}
