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
//! - [`journal`]: the partition journal's file format (segments, CRC32C records, torn tails).
//!
//! Every core takes `now` as an argument and returns what to do as a closed output enum,
//! drained with `poll_output`; durability is an output (the shell writes and fsyncs, then
//! calls `on_persisted`). The node's actors in `bmq-broker` only execute those outputs.
#![warn(missing_docs)]

pub mod journal;
pub mod partition;
pub mod policy;
pub mod proxy;
pub mod queue;
pub mod replication;

pub use journal::{Journal, JournalError};
pub use partition::{
    Partition, PartitionConfig, PartitionCounters, PartitionOutput, PartitionRole, PartitionStats,
};
pub use policy::{refusal, ConsumerDefaults, DeliveryMode, DomainPolicies, DomainPolicy};
pub use proxy::{PrimaryRoute, Proxy, ProxyConfig, ProxyCounters, ProxyOutput};
pub use queue::{ConsumerOptions, Delivery, PutOutcome, QueueCore, QueueCounters, QueueLimits};
pub use replication::{Output, PrimaryPhase, PutResult, ReplicationConfig, ReplicationCore};
