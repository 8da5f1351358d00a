//! Durable files of a node (DESIGN.md §2, "storage"): nothing about queues or the protocol
//! decides here; the cores above say what to write and when it must be durable.
//!
//! - [`store`]: [`Store`], a partition's journal on disk — segments, CRC32C records, torn
//!   tails cut at open, write-behind, two-step syncs ([`SyncTicket`]), space reclamation of
//!   settled dead records, compaction off the caller's thread, installs — with the index of
//!   outstanding messages: memory and disk bounded by what is outstanding, not by the history.
//! - [`frame`]: the record frame (length, CRC32C, body) of the journal and of the metadata
//!   ledger: one format, one check.
//! - [`guid_window`]: [`GuidWindow`], the GUIDs of recently finished messages for duplicate
//!   detection, bounded by count and age.
//! - [`release`]: a deleted file's disk blocks freed a step at a time (the journals, the
//!   metadata ledger).
//! - [`disk`]: the file layer under it all — [`disk::RealDisk`], the operating system's
//!   files, and [`disk::SimDisk`], a seeded disk in memory that fails fsyncs, runs out of
//!   space, loses unsynced writes at a power loss and flips bits, for the simulators.
//!
//! The index tables (`GuidIndex`, `PositionTable`, `BucketTable`, `ChunkedRing`) are this
//! crate's own.
#![warn(missing_docs)]

mod bucket_table;
mod chunked_ring;
pub mod disk;
pub mod frame;
mod guid_index;
pub mod guid_window;
mod lease_mark;
#[cfg(test)]
mod pause_bench;
mod position_table;
mod record_view;
pub mod release;
pub mod store;

pub use guid_window::GuidWindow;
pub use store::{
    guid_key, AppsOf, ClosedFiles, CompactionDone, CompactionTicket, Store, StoreConfig,
    StoreError, StoreStats, SyncTicket,
};
