//! The node's actors: thin actix shells that execute what the pure cores decide.
//!
//! Each file has the same shape (STYLE.md): a `//!` doc (role, what it receives, what it sends,
//! timers, threads), its messages, the actor, `started`, one handler per message, and:
//!
//! - **inputs**: a handler calls one `handle_*(now, ..)` of the core, then `drive()`;
//! - **core**: every rule is in the pure core (`Partition`, `MetadataCore`, `Elector`; the
//!   health actor's is the pure `plan_primaries`);
//! - **outputs**: `drive()` drains the core's outputs in order and executes them;
//! - **timer**: `drive()` re-arms one [`shell::Timer`] at `poll_timeout()`, never cancelled;
//! - **disk worker**: fsyncs and slow file work run on a [`shell::DiskWorker`] thread that
//!   answers by message, after a [`shell::GroupCommit`] flush (the elector's rare term writes
//!   run inline; the health actor checks on a fixed period and has no disk work).

pub mod elector;
pub mod health;
pub mod metadata;
pub mod partition;
pub mod shell;
