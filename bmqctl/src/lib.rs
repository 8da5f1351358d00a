//! `bmqctl`, the operator tool of the broker cluster, as a library: each subcommand is a module
//! with its arguments (clap) and a `run`; `main.rs` only parses the command line. The tests use
//! the same modules (`status::fetch_status`, `payload`, `http`) to drive real clusters.
//!
//! `bmqctl` depends on the client library, the configuration and the wire types, never on the
//! node: it starts `broker` processes and talks to them over their ports like any operator.
#![warn(missing_docs)]

/// `println!` for bmqctl's output, except that a stdout that cannot be written (a pipe whose
/// reader left: `bmqctl bench ... | head -1`) is not a panic: the line is dropped and the
/// command goes on (`cluster up` keeps supervising its nodes; a report is simply not read).
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` for bmqctl's output; see [`outln!`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*))
    };
}

/// Writes `args` to stdout; an error (a closed pipe) is ignored (see [`outln!`]).
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_fmt(args).and_then(|()| stdout.flush());
}

pub mod admin;
pub mod bench;
pub mod bench_first_open;
pub mod client_thread;
pub mod cluster;
pub mod cluster_nodes;
pub mod connect;
pub mod consume;
pub mod credentials;
pub mod dev_ca;
pub mod domain;
/// The admin-port HTTP client (in the client library: the brokers forward with it too).
pub use bmq_client::http;
pub mod payload;
pub mod produce;
pub mod prometheus;
pub mod ready;
pub mod reload;
pub mod status;
