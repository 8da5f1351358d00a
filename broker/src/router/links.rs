//! The router's side of the peer data links: a link's loss releases the consumers the peer
//! proxied here; its return is announced to the peer (`ConsumersReleased`) and, with the
//! link's generation, to the sessions (which reopen and resend there); a peer's
//! `ConsumersReleased` and `SessionGone` are handled here. Threads: the main thread (the peer
//! demultiplexer); the `peer_back` broadcast channel has no lock of its own.

use bmq_proto::peer::{
    peer_message::Kind as PeerKind, Channel, ConsumersReleased, PeerMessage, SessionGone,
};
use bmq_proto::{NodeId, SessionAddr};
use tokio::sync::broadcast;
use tracing::info;

use super::{Dispatch, Router};
use crate::actors::partition::{PartitionNodeGone, PartitionSessionGone};

impl Router {
    /// The data link with a peer came back (after [`Router::handle_node_gone`] released its
    /// sessions' consumers here). The peer may never have seen the link go (a connection lost
    /// on our side alone, a paused process), so it is told first ([`ConsumersReleased`], on
    /// the DATA connection, ahead of anything our sessions send it from now on): it releases
    /// our sessions' consumers at its primaries — whatever they had sent or been pushed may
    /// have been lost — and reopens its sessions' queues here. Then our sessions reopen their
    /// queues at its primaries and resend their buffered PUTs.
    pub fn handle_node_back(&self, node: NodeId) {
        let notice = PeerMessage {
            kind: Some(PeerKind::ConsumersReleased(ConsumersReleased {})),
        };
        self.peers.send(node, Channel::Data, notice);
        self.announce_peer_back(node);
    }

    /// The data link with a peer was lost (or the peer told us it lost it): release every
    /// consumer it proxied (their unconfirmed messages are redelivered to other consumers, or
    /// to the same ones once they reopen, with the same delivery attempt).
    pub fn handle_node_gone(&self, node: NodeId) {
        // `do_send`: a release lost to a full mailbox would leave the messages pushed through
        // the lost link held for ever; one per data link loss and partition (a link returns
        // only after a reconnection or once its queue has drained to half, so losses are
        // rate-bounded by the peer links).
        self.each_partition(|addr| addr.do_send(PartitionNodeGone { node }));
    }

    /// Subscribes to "peer's data link came back" notifications (see
    /// [`Router::handle_node_back`]): the peer, and the data link's generation then.
    pub fn subscribe_peer_back(&self) -> broadcast::Receiver<(NodeId, u64)> {
        self.peer_back.subscribe()
    }

    /// The data link generation of `peer` now ([`crate::net::peers::PeerHub::data_generation`]).
    pub fn data_generation(&self, peer: NodeId) -> u64 {
        self.peers.data_generation(peer)
    }

    /// Tells the sessions that the data link with `node` is back, with its generation now: they
    /// reopen their queues there and send their PUTs under it again.
    fn announce_peer_back(&self, node: NodeId) {
        // No receiver (no session) is fine.
        let _ = self
            .peer_back
            .send((node, self.peers.data_generation(node)));
    }

    /// `from` lost its data link with us and released our sessions' consumers at its
    /// primaries ([`ConsumersReleased`], read from its DATA connection).
    pub(super) fn handle_consumers_released(&self, dispatch: &mut Dispatch, from: NodeId) {
        // What its sessions sent us or we pushed them may have been lost with the link too:
        // release their consumers here as well (after what arrived before the notice, so that
        // is dispatched first; their reopens follow it on this connection), then reopen ours
        // there.
        info!(peer = %from, "peer's data link came back: releasing its consumers, reopening ours");
        self.dispatch(dispatch);
        self.handle_node_gone(from);
        self.announce_peer_back(from);
    }

    /// A session of a peer ended ([`SessionGone`]): every local partition releases its
    /// consumers.
    pub(super) fn handle_session_gone(&self, dispatch: &mut Dispatch, gone: SessionGone) {
        let session = SessionAddr {
            origin_node: NodeId(gone.origin_node_id),
            session_id: gone.session_id,
        };
        // What the session sent before it went comes first (a confirm must not turn into a
        // redelivery).
        self.dispatch(dispatch);
        // `do_send`, as for local sessions (`unregister_session`): one per session end at the
        // peer and partition.
        self.each_partition(|addr| addr.do_send(PartitionSessionGone { session }));
    }
}
