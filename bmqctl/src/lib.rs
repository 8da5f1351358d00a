//! `bmqctl`, the operator tool of the broker cluster, as a library: each subcommand is a module
//! with its arguments (clap) and a `run`; `main.rs` only parses the command line. The tests use
//! the same modules (`status::fetch_status`, `payload`, `http`) to drive real clusters.
//!
//! `bmqctl` depends on the client library, the configuration and the wire types, never on the
//! node: it starts `broker` processes and talks to them over their ports like any operator.
#![warn(missing_docs)]

pub mod admin;
pub mod bench;
pub mod cluster;
pub mod connect;
pub mod consume;
pub mod credentials;
pub mod dev_ca;
pub mod http;
pub mod payload;
pub mod produce;
pub mod prometheus;
pub mod ready;
pub mod status;
