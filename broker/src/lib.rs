//! The broker node and its tools.
//!
//! - node side: [`config`], networking, health, partitions and queues, admin HTTP;
//! - client side: [`client`] (the async client library, tokio only) and [`cli`] (`bmqctl`).
#![warn(missing_docs)]

pub mod admin;
pub mod auth;
pub mod cli;
pub mod client;
pub mod config;
pub mod dataplane;
pub mod health;
pub mod journal;
pub mod node;
pub mod partition;
pub mod peers;
pub mod queue;
pub mod replication;
pub mod session;
pub mod status;
pub mod tls;
pub mod uri;
