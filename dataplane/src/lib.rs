//! The data plane's pure cores (DESIGN.md §7): what a partition, its queues and a proxying
//! session decide, with no actix, no tokio, no sockets and no clock.
//!
//! - [`replication`]: [`ReplicationCore`], one partition's journal replication from its primary
//!   to its replicas: quorum receipts, ACK release (strong/eventual), duplicate GUIDs, healing
//!   of a new primary (collect, pull, sync, truncate), replica rules.
//! - [`queue`]: [`QueueCore`], one priority-mode queue: round-robin among the highest
//!   priority, flow control, confirms, redelivery, TTL, limits.
//! - [`partition`]: [`Partition`], one partition on one node: the replication core plus, on
//!   the active primary, the queues and the request rules (OpenQueue, PUT, CONFIRM,
//!   CloseQueue; fanout, broadcast, NACKs, duplicates).
//! - [`proxy`]: [`Proxy`], the decisions of a client session on the node it is connected to:
//!   where each queue is served from, the retransmission buffer of unacknowledged PUTs, and
//!   what to resend when a primary moves.
//! - [`policy`]: [`DomainPolicy`], a domain's settings as the cores use them.
//!
//! The journal under the partition core is the storage floor's ([`bmq_storage::Store`],
//! re-exported as [`store`]): this crate opens no file itself.
//!
//! Every core takes `now` as an argument and returns what to do as a closed output enum,
//! drained with `poll_output`. The partition core writes its journal through the store (on
//! the partition's own thread); durability is the shell's call (`Partition::sync`: fsync,
//! then receipts and ACKs are released). The node's actors in `bmq-broker` only execute those
//! outputs.
#![warn(missing_docs)]

pub mod partition;
pub mod policy;
pub mod proxy;
pub mod queue;
pub mod replication;
/// The partition journal, from the storage floor ([`bmq_storage::store`]).
pub use bmq_storage::store;

pub use partition::{
    Partition, PartitionConfig, PartitionCounters, PartitionGauges, PartitionOutput, PartitionRole,
    PartitionStats,
};
pub use policy::{refusal, ConsumerDefaults, DeliveryMode, DomainPolicies, DomainPolicy};
pub use proxy::{PrimaryRoute, Proxy, ProxyConfig, ProxyCounters, ProxyOutput};
pub use queue::{ConsumerOptions, Delivery, PutOutcome, QueueCore, QueueCounters, QueueLimits};
pub use replication::{Output, PrimaryPhase, PutResult, ReplicationConfig, ReplicationCore};
pub use store::{
    AppsOf, ClosedFiles, CompactionDone, CompactionTicket, Store, StoreConfig, StoreError,
    StoreStats, SyncTicket,
};
