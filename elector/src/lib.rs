//! Leader election for the broker cluster: BlazingMQ's elector with ElectionScouting (pre-vote)
//! and a durable term (DESIGN.md §4).
//!
//! - [`Elector`] (`core.rs`): the pure state machine, `handle_*(now, ..)` in, [`ElectorOutput`]
//!   out, [`Elector::poll_timeout`] for the next deadline.
//! - [`Membership`] (`membership.rs`): the committed voter set and its epoch, which the elector
//!   counts votes against and carries in its requests (DESIGN.md §5a).
//! - [`ElectorConfig`] (`config.rs`): timings and quorum, validated at start-up.
//! - [`ElectorState`], [`TransitionReason`], [`ElectorStatus`] (`state.rs`): what is published.
//! - [`TermStore`] (`term_store.rs`): the fsynced term file, on the storage floor's file
//!   layer (`bmq_storage::disk`: the operating system's files, or the simulators' disk); a
//!   failed write or fsync fails it for good.
//! - [`successor_wait_bounds`] (`successor.rs`): after a leader's loss, the survivors scout in
//!   node-id order, each within its own window.
//!
//! The crate is pure: no actix, no tokio, no socket, no clock, and no file of its own (the term
//! file goes through the storage floor's `Disk`, DESIGN.md §2). The node's actor that executes
//! the outputs lives in `bmq-broker` (`actors/elector.rs`).
#![warn(missing_docs)]

pub mod config;
pub mod core;
pub mod membership;
pub mod state;
pub mod successor;
pub mod term_store;

pub use crate::config::{ConfigError, ElectorConfig};
pub use crate::core::{Elector, ElectorCounters, ElectorOutput};
pub use crate::membership::Membership;
pub use crate::state::{ElectorState, ElectorStatus, TransitionReason};
pub use crate::successor::successor_wait_bounds;
pub use crate::term_store::{TermStore, TERM_FILE_NAME};
