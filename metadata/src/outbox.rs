//! [`PeerOutbox`]: the metadata messages a node's shell gathers between two flushes, batched per
//! peer (many advisories per message).
//!
//! The shell pushes every `Send` and `Broadcast` output of the core here while it handles the
//! messages already in its mailbox, and drains the outbox once at the end of that turn: each
//! peer then gets one frame with everything for it, in the order the core produced it, instead
//! of one frame per record, commit or ack. The receiving core handles a
//! [`peer::MetadataBatch`] as its messages in order, so batching changes nothing in the
//! protocol.

use std::collections::BTreeMap;

use bmq_proto::peer::{self, metadata_message::Kind as Msg};
use bmq_proto::NodeId;
use prost::Message;

/// The most messages in one batch.
pub const BATCH_MESSAGES_MAX: usize = 4096;
/// The most encoded bytes in one batch (a larger single message, such as a snapshot, travels
/// alone): 1 MiB, far below the peer frame limit.
pub const BATCH_BYTES_MAX: usize = 1024 * 1024;

/// Messages waiting for each peer, in the order they were pushed. See the module doc.
#[derive(Debug, Clone)]
pub struct PeerOutbox {
    peers: Vec<NodeId>,
    queued: BTreeMap<NodeId, Vec<peer::MetadataMessage>>,
}

impl PeerOutbox {
    /// An empty outbox for `peers` (the members other than this node).
    pub fn new(peers: impl IntoIterator<Item = NodeId>) -> Self {
        PeerOutbox {
            peers: peers.into_iter().collect(),
            queued: BTreeMap::new(),
        }
    }

    /// Replaces the peers a broadcast goes to (the membership changed); what is queued stays.
    pub fn set_peers(&mut self, peers: impl IntoIterator<Item = NodeId>) {
        self.peers = peers.into_iter().collect();
    }

    /// Queues `message` for `to`, or for every peer when `to` is `None` (a broadcast).
    pub fn push(&mut self, to: Option<NodeId>, message: peer::MetadataMessage) {
        match to {
            Some(to) => self.queued.entry(to).or_default().push(message),
            None => {
                for peer in &self.peers {
                    self.queued.entry(*peer).or_default().push(message.clone());
                }
            }
        }
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Takes everything queued: per peer, in push order, a message alone as itself and
    /// consecutive ones as [`peer::MetadataBatch`]es of at most [`BATCH_MESSAGES_MAX`]
    /// messages and [`BATCH_BYTES_MAX`] encoded bytes.
    pub fn drain(&mut self) -> Vec<(NodeId, peer::MetadataMessage)> {
        let mut out = Vec::new();
        for (to, messages) in std::mem::take(&mut self.queued) {
            let mut batch: Vec<peer::MetadataMessage> = Vec::new();
            let mut bytes = 0;
            for message in messages {
                let len = message.encoded_len();
                if !batch.is_empty()
                    && (batch.len() >= BATCH_MESSAGES_MAX || bytes + len > BATCH_BYTES_MAX)
                {
                    out.push((to, seal(std::mem::take(&mut batch))));
                    bytes = 0;
                }
                bytes += len;
                batch.push(message);
            }
            if !batch.is_empty() {
                out.push((to, seal(batch)));
            }
        }
        out
    }
}

fn seal(mut messages: Vec<peer::MetadataMessage>) -> peer::MetadataMessage {
    if messages.len() == 1 {
        return messages.pop().expect("one message");
    }
    peer::MetadataMessage {
        kind: Some(Msg::Batch(peer::MetadataBatch { messages })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(sequence: u64) -> peer::MetadataMessage {
        peer::MetadataMessage {
            kind: Some(Msg::Ack(peer::AdvisoryAck {
                lsn: Some(peer::Lsn { term: 1, sequence }),
                membership_epoch: 0,
            })),
        }
    }

    fn batch(messages: Vec<peer::MetadataMessage>) -> peer::MetadataMessage {
        peer::MetadataMessage {
            kind: Some(Msg::Batch(peer::MetadataBatch { messages })),
        }
    }

    #[test]
    fn messages_are_batched_per_peer_in_order() {
        // Scenario: broadcasts and sends interleave; each peer gets one frame with its
        // messages in push order, and a lone message is not wrapped.
        let mut outbox = PeerOutbox::new([NodeId(2), NodeId(3)]);
        assert!(outbox.is_empty());
        outbox.push(None, ack(1));
        outbox.push(Some(NodeId(2)), ack(2));
        outbox.push(None, ack(3));
        assert!(!outbox.is_empty());
        assert_eq!(
            outbox.drain(),
            vec![
                (NodeId(2), batch(vec![ack(1), ack(2), ack(3)])),
                (NodeId(3), batch(vec![ack(1), ack(3)])),
            ]
        );
        assert!(outbox.is_empty());
        outbox.push(Some(NodeId(3)), ack(4));
        assert_eq!(outbox.drain(), vec![(NodeId(3), ack(4))]);
        assert_eq!(outbox.drain(), vec![]);
    }

    #[test]
    fn batches_are_bounded_in_count() {
        // Scenario: more messages than a batch holds go out as several batches, in order.
        let mut outbox = PeerOutbox::new([NodeId(2)]);
        for i in 0..(BATCH_MESSAGES_MAX as u64 + 1) {
            outbox.push(None, ack(i));
        }
        let out = outbox.drain();
        assert_eq!(out.len(), 2);
        let Some(Msg::Batch(first)) = &out[0].1.kind else {
            panic!("a batch first");
        };
        assert_eq!(first.messages.len(), BATCH_MESSAGES_MAX);
        assert_eq!(first.messages[0], ack(0));
        assert_eq!(out[1].1, ack(BATCH_MESSAGES_MAX as u64));
    }

    #[test]
    fn batches_are_bounded_in_bytes() {
        // Scenario: a message as large as a batch may be travels alone, between batches of the
        // smaller ones around it.
        let big = peer::MetadataMessage {
            kind: Some(Msg::QueueAssignmentRequest(peer::QueueAssignmentRequest {
                uri: "x".repeat(BATCH_BYTES_MAX),
            })),
        };
        let mut outbox = PeerOutbox::new([NodeId(2)]);
        outbox.push(None, ack(1));
        outbox.push(None, ack(2));
        outbox.push(None, big.clone());
        outbox.push(None, ack(3));
        assert_eq!(
            outbox.drain(),
            vec![
                (NodeId(2), batch(vec![ack(1), ack(2)])),
                (NodeId(2), big),
                (NodeId(2), ack(3)),
            ]
        );
    }
}
