//! The router's queue-assignment waiters: an open of a queue with no partition yet asks the
//! leader to assign one, then waits here until a proposal of it reaches this node's ledger
//! ([`ProposalWatcher`]) or a commit assigns it ([`Router::assignments_committed`]). Threads:
//! the main thread (session tasks, the metadata actor, the commit fan-out); two `Mutex` maps
//! by URI, each held for a look-up or an insert, never both at once.

use std::collections::HashMap;
use std::sync::Mutex;

use bmq_metadata::ClusterState;
use bmq_proto::PartitionId;
use tokio::sync::oneshot;

use super::Router;
use crate::actors::metadata::{ProposalWatcher, RequestQueueAssignment};

impl Router {
    /// Asks the leader, through the metadata actor, to assign `uri` to a partition (fire and
    /// forget: the caller waits for the assignment in the committed state). Queued even when
    /// the actor's mailbox is full, since the caller asks once: the metadata core keeps the
    /// request (bounded, counted when dropped) and is the one that sends it again.
    pub fn request_assignment(&self, uri: String) {
        self.assignments.do_send(RequestQueueAssignment { uri });
    }

    /// A receiver that fires once a committed state containing `uri` is published on this node
    /// (see [`Router::assignments_committed`]). Register before looking at the state, so that no
    /// commit falls in between. A receiver dropped unfired is cleaned up at the next
    /// registration or commit of the same URI, or by [`Router::forget_assignment_waiters`].
    pub fn watch_assignment(&self, uri: &str) -> oneshot::Receiver<()> {
        add_waiter(&self.assignment_waiters, uri)
    }

    /// A receiver that fires with the partition the leader proposes for `uri`, once an
    /// uncommitted assignment of it is written to this node's ledger (the router's
    /// [`ProposalWatcher::assignment_proposed`]): an open can be sent to that partition's
    /// primary ahead of the commit (`Proxy::handle_proposed`). A proposal made before the
    /// registration is not reported; the commit still is ([`Router::watch_assignment`]).
    pub fn watch_proposal(&self, uri: &str) -> oneshot::Receiver<PartitionId> {
        add_waiter(&self.proposal_waiters, uri)
    }

    /// Drops the abandoned waiters of `uri` (its opens gave up).
    pub fn forget_assignment_waiters(&self, uri: &str) {
        drop_closed_waiters(&self.proposal_waiters, uri);
        drop_closed_waiters(&self.assignment_waiters, uri);
    }

    /// The committed state went from `before` to `after`: wakes the opens waiting for a queue
    /// that is now assigned. O(changed queues) (see `ClusterState::queues_assigned_since`), and
    /// nothing at all while no open waits.
    pub fn assignments_committed(&self, before: &ClusterState, after: &ClusterState) {
        let mut waiters = self.assignment_waiters.lock().expect("waiters lock");
        if waiters.is_empty() {
            return;
        }
        for uri in after.queues_assigned_since(before) {
            for waiter in waiters.remove(uri).into_iter().flatten() {
                let _ = waiter.send(());
            }
        }
    }
}

/// A new waiter of `uri` (the abandoned ones dropped on the way); fires through the sender
/// kept in `waiters`.
fn add_waiter<T>(
    waiters: &Mutex<HashMap<String, Vec<oneshot::Sender<T>>>>,
    uri: &str,
) -> oneshot::Receiver<T> {
    let (tx, rx) = oneshot::channel();
    let mut waiters = waiters.lock().expect("waiters lock");
    let entry = waiters.entry(uri.to_owned()).or_default();
    entry.retain(|w| !w.is_closed());
    entry.push(tx);
    rx
}

/// Removes the waiters of `uri` whose receiver was dropped, and its entry once none is left.
fn drop_closed_waiters<T>(waiters: &Mutex<HashMap<String, Vec<oneshot::Sender<T>>>>, uri: &str) {
    let mut waiters = waiters.lock().expect("waiters lock");
    if let Some(entry) = waiters.get_mut(uri) {
        entry.retain(|w| !w.is_closed());
        if entry.is_empty() {
            waiters.remove(uri);
        }
    }
}

impl ProposalWatcher for Router {
    /// Wakes the opens waiting for the proposal of `uri` ([`Router::watch_proposal`]). O(1);
    /// nothing while no open waits.
    fn assignment_proposed(&self, uri: &str, partition: PartitionId) {
        let mut waiters = self.proposal_waiters.lock().expect("waiters lock");
        if waiters.is_empty() {
            return;
        }
        for waiter in waiters.remove(uri).into_iter().flatten() {
            let _ = waiter.send(partition);
        }
    }
}
