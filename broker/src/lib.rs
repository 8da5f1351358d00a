//! The broker node (`bmq-broker`): one process of the cluster, built from the pure cores
//! (`bmq-elector`, `bmq-metadata`, `bmq-dataplane`) and the configuration (`bmq-config`).
//!
//! - [`node`]: `run` — open storage, bind ports, start actors, serve, stop gracefully; the
//!   supervision tree and which thread runs what.
//! - [`actors`]: the actix shells around the cores — [`actors::elector`],
//!   [`actors::metadata`], [`actors::partition`] — and [`actors::health`] (failed primaries ->
//!   new primaries on the active leader).
//! - [`router`]: sessions <-> partition primaries, local or over the peer DATA channel.
//! - [`session`]: one task per client connection around the data plane's proxy core.
//! - [`bmqp_session`]: the listener for BlazingMQ's own SDKs, a second client protocol
//!   translated onto the same sessions.
//! - [`wiring`]: control-channel sender, commit fan-out, peer demultiplexer.
//! - [`net`]: peer links ([`net::peers`]) and node-side TLS ([`net::tls`]).
//! - [`admin`]: admin HTTP (`/metrics`, `/status`, `/healthz`, `/readyz`, admin actions).
//! - [`auth`]: client authentication and authorisation.
//! - [`reload`]: live reload of the configuration file (tokens, TLS files, log level), by
//!   `POST /admin/reload` ([`admin_reload`]) or SIGHUP.
//! - [`scheduling`]: the CPU scheduling policy of the broker's threads (`SCHED_BATCH`).
//!
//! The client library (`bmq-client`) and the operator tool (`bmqctl`) are separate crates that
//! do not depend on this one.
#![warn(missing_docs)]

pub mod actors;
pub mod admin;
pub mod admin_domains;
pub mod admin_members;
pub mod admin_reload;
pub mod auth;
pub mod bmqp_session;
pub mod domains;
pub mod net;
pub mod node;
pub mod reload;
pub mod router;
pub mod scheduling;
pub mod session;
pub mod wiring;
