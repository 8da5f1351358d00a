//! Cluster metadata replicated as advisories stamped with Leader Sequence Numbers (DESIGN.md §5,
//! §6; the BlazingMQ leader election article).
//!
//! - [`lsn`]: `Lsn = (term, sequence)`.
//! - [`state`]: [`ClusterState`] and the rule that applies an advisory to it.
//! - [`domains`]: [`DomainState`], the committed domains, and the rules of a change.
//! - [`assignment`]: pure placement decisions (queue -> partition, partition -> primary).
//! - [`ledger`]: the on-disk ledger with CRC32C records, torn-tail recovery and rollover, on
//!   the storage floor's file layer ([`disk`]: the operating system's files, or a simulated
//!   disk).
//! - [`core`]: [`MetadataCore`], the replication state machine (no I/O, no clock).
//! - [`outbox`]: [`PeerOutbox`], the shell's per-peer batching of the core's messages.
//!
//! The crate is pure: no actix, no tokio, no socket, no clock (the ledger's record timestamps
//! are set by its shell). The node's actor that persists, sends and publishes lives in
//! `bmq-broker` (`actors/metadata.rs`).
#![warn(missing_docs)]

pub mod assignment;
pub mod core;
pub mod domains;
pub mod ledger;
pub mod lsn;
pub mod membership;
pub mod outbox;
pub mod state;

/// The file layer the ledger runs on, from the storage floor ([`bmq_storage::disk`]):
/// [`disk::RealDisk`] for the node, [`disk::SimDisk`] for the simulators.
pub use bmq_storage::disk;
/// The record frame the ledger's records are written in, the partition journal's too
/// ([`bmq_storage::frame`]).
pub use bmq_storage::frame;

pub use crate::assignment::{
    lease_replicas_now, pick_partition_for_queue, plan_primaries, plan_primary_assignment,
    plan_rebalance, plan_replica_change,
};
pub use crate::core::{
    LearnerProgress, MetadataConfig, MetadataCore, MetadataCounters, MetadataOutput, MetadataRole,
    MetadataStatus, ProposeError,
};
pub use crate::domains::{Domain, DomainError, DomainState};
pub use crate::ledger::{
    leader_continues, FsyncPolicy, Ledger, LedgerError, LedgerRecord, LedgerRelease,
    LedgerSnapshot, LedgerSync, Recovered, SnapshotWritten, SyncDone,
};
pub use crate::lsn::Lsn;
pub use crate::membership::{ClusterMembership, Member, MemberRole, MembershipError, MAX_VOTERS};
pub use crate::outbox::PeerOutbox;
pub use crate::state::{
    ApplyError, ClusterState, PartitionState, PrimaryStatus, QueueAssignment, SnapshotError,
};
