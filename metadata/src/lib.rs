//! Cluster metadata replicated as advisories stamped with Leader Sequence Numbers (DESIGN.md §5,
//! §6; the BlazingMQ leader election article).
//!
//! - [`lsn`]: `Lsn = (term, sequence)`.
//! - [`state`]: [`ClusterState`] and the rule that applies an advisory to it.
//! - [`assignment`]: pure placement decisions (queue -> partition, partition -> primary).
//! - [`ledger`]: the on-disk ledger with CRC32C records, torn-tail recovery and rollover.
//! - [`core`]: [`MetadataCore`], the replication state machine (no I/O, no clock).
//! - [`actor`]: [`MetadataActor`], the actix shell that persists, sends and publishes.
#![warn(missing_docs)]

pub mod actor;
pub mod assignment;
pub mod core;
pub mod ledger;
pub mod lsn;
pub mod state;

pub use crate::actor::{
    ClusterStateCommitted, GetMetadataStatus, LeaderChanged, MetadataActor, MetadataInbound,
    MetadataOutbound, MetadataSnapshot, Propose, RequestQueueAssignment, SetMetadataQuorum,
    SubscribeState,
};
pub use crate::assignment::{pick_partition_for_queue, plan_primary_assignment};
pub use crate::core::{
    MetadataConfig, MetadataCore, MetadataCounters, MetadataOutput, MetadataRole, MetadataStatus,
    ProposeError,
};
pub use crate::ledger::{FsyncPolicy, Ledger, LedgerError, LedgerRecord, Recovered};
pub use crate::lsn::Lsn;
pub use crate::state::{
    ApplyError, ClusterState, PartitionState, PrimaryStatus, QueueAssignment, SnapshotError,
};
