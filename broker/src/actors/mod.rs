//! The node's actors: thin actix shells that execute what the pure cores decide.
//!
//! Each file has the same shape (STYLE.md): a `//!` doc (role, what it receives, what it sends,
//! timers, thread), its messages, the actor, `started`, one handler per message, and one
//! `drive()` that drains the core's outputs.

pub mod elector;
pub mod health;
pub mod metadata;
pub mod partition;
