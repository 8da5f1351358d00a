//! Step tests of the proxy core: each drives one `Proxy` and asserts the exact outputs.

use super::*;

const URI: &str = "bmq://d/q";
const P: PartitionId = PartitionId(2);

fn proxy() -> Proxy {
    Proxy::new(
        NodeId(1),
        ProxyConfig {
            retransmit_buffer_max: 3,
            retransmit_interval: Duration::from_secs(1),
        },
    )
}

fn guid(n: u8) -> Bytes {
    Bytes::from(vec![n; 16])
}

fn put(n: u8) -> Put {
    Put {
        uri: URI.into(),
        guid: guid(n),
        payload: Bytes::from_static(b"x"),
        properties: vec![],
    }
}

fn open() -> OpenQueue {
    OpenQueue {
        request_id: 5,
        uri: URI.into(),
        read: false,
        write: true,
        consumer: None,
        ..Default::default()
    }
}

/// Every output, with every data link at generation 0 (never interrupted).
fn drain(p: &mut Proxy) -> Vec<ProxyOutput> {
    drain_at(p, 0)
}

/// Every output, with every data link at `generation`.
fn drain_at(p: &mut Proxy, generation: u64) -> Vec<ProxyOutput> {
    std::iter::from_fn(|| p.poll_output(&|_| generation)).collect()
}

fn route(primary: u32, lease: u64) -> impl Fn(PartitionId) -> Option<PrimaryRoute> {
    move |_| {
        Some(PrimaryRoute {
            primary: NodeId(primary),
            lease: LeaseId(lease),
            active: true,
        })
    }
}

fn to_primary(primary: u32, kind: Kind) -> ProxyOutput {
    ProxyOutput::ToPrimary {
        partition: P,
        primary: NodeId(primary),
        message: ClientMessage { kind: Some(kind) },
    }
}

/// A proxy with `URI` open for writing on primary 2 at lease 1.
fn attached(now: Instant) -> Proxy {
    let mut p = proxy();
    p.handle_open(now, open());
    assert_eq!(
        drain(&mut p),
        vec![ProxyOutput::Resolve {
            request_id: 5,
            uri: URI.into()
        }]
    );
    p.handle_resolved(5, URI.into(), Ok(P), &route(2, 1), now);
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::OpenQueue(open()))]);
    p
}

#[test]
fn not_ready_blocks_the_queue_and_the_reattach_resends_in_order() {
    // A NOT_READY ACK keeps the PUT and holds later PUTs back; when the primary moves, the
    // queue is reopened there and every buffered PUT is resent in arrival order.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_put(now, put(1));
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::Put(put(1)))]);
    p.handle_from_primary(
        now,
        ClientMessage {
            kind: Some(Kind::Ack(Ack {
                uri: URI.into(),
                guid: guid(1),
                status: AckStatus::NotReady as i32,
                message: String::new(),
            })),
        },
    );
    p.handle_put(now, put(2));
    assert_eq!(drain(&mut p), vec![], "blocked: PUT 2 waits in the buffer");
    p.handle_cluster_change(&route(3, 2), now);
    assert_eq!(
        drain(&mut p),
        vec![
            to_primary(3, Kind::OpenQueue(open())),
            to_primary(3, Kind::Put(put(1))),
            to_primary(3, Kind::Put(put(2))),
        ]
    );
    assert_eq!(p.unacknowledged(), 2);
}

#[test]
fn ack_releases_the_put_and_reports_latency() {
    // A successful ACK removes the PUT from the buffer, goes to the client, and reports the
    // latency since the PUT arrived.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_put(now, put(1));
    drain(&mut p);
    let ack = Ack {
        uri: URI.into(),
        guid: guid(1),
        status: AckStatus::Success as i32,
        message: String::new(),
    };
    let later = now + Duration::from_millis(3);
    p.handle_from_primary(
        later,
        ClientMessage {
            kind: Some(Kind::Ack(ack.clone())),
        },
    );
    assert_eq!(
        drain(&mut p),
        vec![
            ProxyOutput::Acked {
                latency: Duration::from_millis(3)
            },
            ProxyOutput::ToClient(ClientMessage {
                kind: Some(Kind::Ack(ack))
            }),
        ]
    );
    assert_eq!(p.unacknowledged(), 0);
}

#[test]
fn a_primarys_error_response_reaches_the_client_and_the_app_is_no_longer_read() {
    // The primary closed this session's consumer of app b (removed from the domain): the
    // ErrorResponse goes to the client unchanged, and the open kept for reopens reads a only.
    let now = Instant::now();
    let mut p = attached(now);
    let app = |a: &str| bmq_proto::client::ConsumerOptions {
        app_id: a.into(),
        ..Default::default()
    };
    p.queues.get_mut(URI).unwrap().request = OpenQueue {
        read: true,
        consumers: vec![app("a"), app("b")],
        ..open()
    };
    let error = ClientMessage {
        kind: Some(Kind::Error(bmq_proto::client::ErrorResponse {
            status: Some(bmq_proto::client::Status {
                code: StatusCode::NotOpen as i32,
                message: "app id \"b\" was removed".into(),
            }),
            uri: URI.into(),
            app_id: "b".into(),
        })),
    };
    p.handle_from_primary(now, error.clone());
    assert_eq!(drain(&mut p), vec![ProxyOutput::ToClient(error)]);
    let kept = &p.queues[URI].request;
    assert!(kept.read);
    assert_eq!(kept.consumers, vec![app("a")]);
}

#[test]
fn a_full_buffer_nacks_and_unanswered_puts_are_resent() {
    // Beyond retransmit_buffer_max the PUT is NACKed LIMIT_REACHED; a PUT without an answer
    // for the retransmission interval is sent again (and counted).
    let now = Instant::now();
    let mut p = attached(now);
    answer_reaches_the_client(&mut p, P);
    for n in 1..=3 {
        p.handle_put(now, put(n));
    }
    drain(&mut p);
    p.handle_put(now, put(4));
    let outputs = drain(&mut p);
    assert!(
        matches!(&outputs[..], [ProxyOutput::ToClient(ClientMessage { kind: Some(Kind::Ack(a)) })]
        if a.status == AckStatus::LimitReached as i32)
    );
    p.handle_tick(now + Duration::from_millis(500), &route(2, 1));
    assert_eq!(drain(&mut p), vec![]);
    p.handle_tick(now + Duration::from_secs(1), &route(2, 1));
    assert_eq!(
        drain(&mut p),
        (1..=3)
            .map(|n| to_primary(2, Kind::Put(put(n))))
            .collect::<Vec<_>>()
    );
    let counters = p.take_counters();
    assert_eq!(
        (counters.retransmissions, counters.nacks_buffer_full),
        (3, 1)
    );
}

#[test]
fn put_before_assignment_waits_for_the_attach() {
    // A PUT sent while the queue's partition is still being resolved is buffered and sent
    // right after the open once the assignment arrives.
    let now = Instant::now();
    let mut p = proxy();
    p.handle_open(now, open());
    drain(&mut p);
    p.handle_put(now, put(1));
    assert_eq!(drain(&mut p), vec![]);
    p.handle_resolved(5, URI.into(), Ok(P), &route(2, 1), now);
    assert_eq!(
        drain(&mut p),
        vec![
            to_primary(2, Kind::OpenQueue(open())),
            to_primary(2, Kind::Put(put(1)))
        ]
    );
}

/// Partition `P` on node 2 and `Q` on node 3, both at lease 1.
const Q: PartitionId = PartitionId(3);

fn two_routes(p: PartitionId) -> Option<PrimaryRoute> {
    Some(PrimaryRoute {
        primary: NodeId(if p == P { 2 } else { 3 }),
        lease: LeaseId(1),
        active: true,
    })
}

fn to(partition: PartitionId, primary: u32, kind: Kind) -> ProxyOutput {
    ProxyOutput::ToPrimary {
        partition,
        primary: NodeId(primary),
        message: ClientMessage { kind: Some(kind) },
    }
}

fn open_response(partition: PartitionId, code: StatusCode) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
            request_id: 5,
            uri: URI.into(),
            status: Some(Status {
                code: code as i32,
                message: String::new(),
            }),
            partition_id: partition.0,
        })),
    }
}

/// `partition`'s primary answers the open OK, and the answer goes to the client.
fn answer_reaches_the_client(p: &mut Proxy, partition: PartitionId) {
    p.handle_from_primary(Instant::now(), open_response(partition, StatusCode::Ok));
    assert_eq!(
        drain(p),
        vec![ProxyOutput::ToClient(open_response(
            partition,
            StatusCode::Ok
        ))]
    );
}

fn withdrawal() -> Kind {
    Kind::CloseQueue(CloseQueue {
        request_id: 0,
        uri: URI.into(),
    })
}

/// A proxy with `URI` being opened and its assignment to `P` proposed: the open went to
/// node 2 ahead of the commit.
fn proposed(now: Instant) -> Proxy {
    let mut p = proxy();
    p.handle_open(now, open());
    drain(&mut p);
    p.handle_put(now, put(1));
    p.handle_proposed(5, URI, P, &two_routes, now);
    assert_eq!(
        drain(&mut p),
        vec![to(P, 2, Kind::OpenQueue(open()))],
        "only the open goes ahead of the commit, never a PUT"
    );
    p
}

#[test]
fn an_open_sent_ahead_answers_the_client_once_the_assignment_commits() {
    // The answer of an open sent to the proposed partition's primary is held until the commit
    // confirms that partition; then the client gets it and the buffered PUT goes out.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_from_primary(now, open_response(P, StatusCode::Ok));
    assert_eq!(
        drain(&mut p),
        vec![],
        "not committed yet: nothing for the client"
    );
    p.handle_resolved(5, URI.into(), Ok(P), &two_routes, now);
    assert_eq!(
        drain(&mut p),
        vec![
            ProxyOutput::ToClient(open_response(P, StatusCode::Ok)),
            to(P, 2, Kind::Put(put(1))),
        ]
    );
    // Attached as after any open: the next PUT goes straight there.
    p.handle_put(now, put(2));
    assert_eq!(drain(&mut p), vec![to(P, 2, Kind::Put(put(2)))]);
    assert_eq!(p.attached_primaries(), vec![NodeId(2)]);
}

#[test]
fn a_commit_before_the_answer_waits_for_it() {
    // The commit comes first: the buffered PUT follows the open (same link, in order), and the
    // client is answered when the primary's answer comes.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_resolved(5, URI.into(), Ok(P), &two_routes, now);
    assert_eq!(drain(&mut p), vec![to(P, 2, Kind::Put(put(1)))]);
    answer_reaches_the_client(&mut p, P);
}

#[test]
fn a_commit_elsewhere_withdraws_the_open_sent_ahead() {
    // The commit names another partition (a new leader chose again): the open sent ahead is
    // closed, the queue opened where the commit says, and the late answer of the withdrawn
    // open is not taken for the new one's.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_resolved(5, URI.into(), Ok(Q), &two_routes, now);
    assert_eq!(
        drain(&mut p),
        vec![
            to(P, 2, withdrawal()),
            to(Q, 3, Kind::OpenQueue(open())),
            to(Q, 3, Kind::Put(put(1))),
        ]
    );
    p.handle_from_primary(now, open_response(P, StatusCode::Ok));
    assert_eq!(drain(&mut p), vec![], "the withdrawn open's answer");
    answer_reaches_the_client(&mut p, Q);
}

#[test]
fn a_primary_that_moved_before_the_commit_gets_the_open_again_elsewhere() {
    // Same partition, but its primary changed before the commit: withdrawn there, opened on
    // the new primary.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_from_primary(now, open_response(P, StatusCode::Ok));
    p.handle_resolved(5, URI.into(), Ok(P), &route(4, 2), now);
    assert_eq!(
        drain(&mut p),
        vec![
            to(P, 2, withdrawal()),
            to(P, 4, Kind::OpenQueue(open())),
            to(P, 4, Kind::Put(put(1))),
        ]
    );
}

#[test]
fn a_failed_assignment_or_a_close_withdraws_the_open_sent_ahead() {
    // No commit in time: the client gets the error and the open sent ahead is closed. A close
    // from the client before the commit goes there too.
    let now = Instant::now();
    let mut p = proposed(now);
    let status = Status {
        code: StatusCode::NotReady as i32,
        message: "no leader".into(),
    };
    p.handle_resolved(5, URI.into(), Err(status.clone()), &two_routes, now);
    assert_eq!(
        drain(&mut p),
        vec![
            to(P, 2, withdrawal()),
            ProxyOutput::ToClient(ClientMessage {
                kind: Some(Kind::OpenQueueResponse(OpenQueueResponse {
                    request_id: 5,
                    uri: URI.into(),
                    status: Some(status),
                    partition_id: 0,
                })),
            }),
        ]
    );
    let mut p = proposed(now);
    assert_eq!(
        p.attached_primaries(),
        vec![NodeId(2)],
        "told at the session's end"
    );
    let close = CloseQueue {
        request_id: 6,
        uri: URI.into(),
    };
    p.handle_close(close.clone());
    let outputs = drain(&mut p);
    assert_eq!(outputs[0], to(P, 2, Kind::CloseQueue(close)));
}

#[test]
fn a_link_back_forgets_the_open_sent_ahead() {
    // The link to the primary the open went to dropped and came back (it released the
    // session's opens): the commit opens the queue again.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_peer_back(Some(NodeId(2)), &two_routes, now);
    assert_eq!(drain(&mut p), vec![]);
    p.handle_resolved(5, URI.into(), Ok(P), &two_routes, now);
    assert_eq!(
        drain(&mut p),
        vec![
            to(P, 2, Kind::OpenQueue(open())),
            to(P, 2, Kind::Put(put(1))),
        ]
    );
}

#[test]
fn a_proposal_is_ignored_unless_the_queue_is_resolving() {
    // A proposal for another request, for a queue already assigned, or for a partition
    // without an active primary sends nothing.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_proposed(5, URI, P, &two_routes, now);
    assert_eq!(drain(&mut p), vec![]);
    let mut p = proxy();
    p.handle_open(now, open());
    drain(&mut p);
    p.handle_proposed(6, URI, P, &two_routes, now);
    let passive = |_| {
        Some(PrimaryRoute {
            primary: NodeId(2),
            lease: LeaseId(1),
            active: false,
        })
    };
    p.handle_proposed(5, URI, P, &passive, now);
    assert_eq!(drain(&mut p), vec![]);
    p.handle_resolved(5, URI.into(), Ok(P), &two_routes, now);
    assert_eq!(drain(&mut p), vec![to(P, 2, Kind::OpenQueue(open()))]);
}

fn pending(n: u32) -> PendingPut {
    PendingPut {
        put: Put {
            uri: URI.into(),
            guid: Bytes::from(n.to_le_bytes().repeat(4)),
            payload: Bytes::new(),
            properties: vec![],
        },
        sent_at: None,
        received_at: Instant::now(),
    }
}

fn order(buffer: &mut RetransmitBuffer) -> Vec<u32> {
    buffer
        .values_mut()
        .map(|p| u32::from_le_bytes(p.put.guid[..4].try_into().unwrap()))
        .collect()
}

#[test]
fn retransmit_buffer_keeps_arrival_order_through_holes_and_resends() {
    let mut b = RetransmitBuffer::default();
    for n in 0..5 {
        b.insert(pending(n));
    }
    assert!(b.remove(&pending(2).put.guid).is_some());
    assert!(b.remove(&pending(2).put.guid).is_none(), "removed once");
    assert!(b.remove(&pending(0).put.guid).is_some());
    // A GUID sent again goes to the back.
    b.insert(pending(1));
    assert_eq!(order(&mut b), vec![3, 4, 1]);
    assert_eq!(b.len(), 3);
    assert!(b.get_mut(&pending(4).put.guid).is_some());
    assert!(b.get_mut(&pending(0).put.guid).is_none());
}

#[test]
fn retransmit_buffer_stays_within_twice_what_is_unacknowledged_behind_an_old_put() {
    let mut b = RetransmitBuffer::default();
    b.insert(pending(0)); // never acknowledged: every later ACK leaves a hole behind it
    for n in 1..10_000 {
        b.insert(pending(n));
        if n > 3 {
            assert!(b.remove(&pending(n - 3).put.guid).is_some());
        }
        assert!(b.slots.len() <= (2 * b.len()).max(COMPACT_MIN + 1));
    }
    assert_eq!(order(&mut b), vec![0, 9_997, 9_998, 9_999]);
    for n in [0, 9_997, 9_998, 9_999] {
        assert!(b.get_mut(&pending(n).put.guid).is_some(), "{n} still found");
    }
    for n in [9_998, 0, 9_999, 9_997] {
        assert!(b.remove(&pending(n).put.guid).is_some(), "{n} removed");
    }
    assert_eq!(b.len(), 0);
    assert!(b.slots.is_empty());
}

#[test]
fn a_put_whose_uri_is_not_utf8_is_nacked_and_the_open_queue_goes_on() {
    // Per-message URIs are protobuf `bytes` (decoded without a UTF-8 check): bytes that are
    // not UTF-8 name no open queue, so the PUT is NACKed UNKNOWN_QUEUE and counted, nothing
    // goes to the primary, and the queue's next PUT is forwarded as usual.
    let now = Instant::now();
    let mut p = attached(now);
    let mut bad = put(1);
    bad.uri = Bytes::from_static(b"bmq://d/\xff");
    p.handle_put(now, bad.clone());
    let outputs = drain(&mut p);
    let [ProxyOutput::ToClient(ClientMessage {
        kind: Some(Kind::Ack(nack)),
    })] = &outputs[..]
    else {
        panic!("expected one NACK to the client, got {outputs:?}");
    };
    assert_eq!(nack.status, AckStatus::UnknownQueue as i32);
    assert_eq!(nack.uri, bad.uri);
    assert_eq!(p.take_counters().nacks_not_open, 1);
    assert_eq!(p.unacknowledged(), 0);
    p.handle_put(now, put(2));
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::Put(put(2)))]);
}

#[test]
fn an_unanswered_open_is_sent_again_to_the_same_primary() {
    // An open lost on its way to the primary (found by the compose test, where a client's
    // open through a node whose data link to the primary was still reconnecting timed out,
    // before a data link's return reopened what was attached there) is sent again by the tick
    // after the retransmission interval, until an answer comes; then never again.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_tick(now + Duration::from_millis(900), &route(2, 1));
    assert_eq!(drain(&mut p), vec![], "not yet: within the interval");
    let later = now + Duration::from_secs(1);
    p.handle_tick(later, &route(2, 1));
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::OpenQueue(open()))]);
    p.handle_tick(later + Duration::from_millis(999), &route(2, 1));
    assert_eq!(
        drain(&mut p),
        vec![],
        "the interval counts from the last send"
    );
    p.handle_tick(later + Duration::from_secs(1), &route(2, 1));
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::OpenQueue(open()))]);
    assert_eq!(p.take_counters().open_retransmissions, 2);
    // The answer reaches the client once, and nothing is sent again after it.
    answer_reaches_the_client(&mut p, P);
    p.handle_tick(later + Duration::from_secs(5), &route(2, 1));
    assert_eq!(drain(&mut p), vec![]);
    assert_eq!(p.take_counters().open_retransmissions, 0);
}

#[test]
fn a_lost_reopen_after_a_primary_move_is_sent_again() {
    // The reopen on a new primary (no client request waiting: the queue was open) is sent
    // again too, or the session's consumer or producer would stay unknown there.
    let now = Instant::now();
    let mut p = attached(now);
    answer_reaches_the_client(&mut p, P);
    p.handle_cluster_change(&route(3, 2), now);
    assert_eq!(drain(&mut p), vec![to_primary(3, Kind::OpenQueue(open()))]);
    let later = now + Duration::from_secs(1);
    p.handle_tick(later, &route(3, 2));
    assert_eq!(drain(&mut p), vec![to_primary(3, Kind::OpenQueue(open()))]);
    // Its answer is not the client's (the client's open was answered): nothing for it, and
    // no more opens.
    p.handle_from_primary(later, open_response(P, StatusCode::Ok));
    assert_eq!(drain(&mut p), vec![]);
    p.handle_tick(later + Duration::from_secs(2), &route(3, 2));
    assert_eq!(drain(&mut p), vec![]);
}

#[test]
fn an_open_sent_ahead_and_lost_is_sent_again_once_committed() {
    // An open sent ahead of its assignment's commit and lost: once the commit confirms that
    // partition and primary, the tick sends it again; the client gets the answer when it comes.
    let now = Instant::now();
    let mut p = proposed(now);
    p.handle_resolved(5, URI.into(), Ok(P), &two_routes, now);
    assert_eq!(drain(&mut p), vec![to(P, 2, Kind::Put(put(1)))]);
    let later = now + Duration::from_secs(1);
    p.handle_tick(later, &two_routes);
    assert_eq!(
        drain(&mut p),
        vec![
            to(P, 2, Kind::OpenQueue(open())),
            to(P, 2, Kind::Put(put(1)))
        ],
        "reattached: the open, then the buffered PUT (the primary drops a duplicate by GUID)"
    );
    answer_reaches_the_client(&mut p, P);
}

#[test]
fn puts_wait_for_the_return_of_an_interrupted_data_link_then_go_in_order() {
    // The data link to the primary (node 2) was interrupted after PUT 1: PUT 2 and every
    // resend are held, not sent on the new connection ahead of what the interruption lost;
    // when the link's return is announced at its new generation, the queue reopens and both
    // PUTs go in arrival order.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_put(now, put(1));
    assert_eq!(drain(&mut p), vec![to_primary(2, Kind::Put(put(1)))]);
    p.handle_from_primary(now, open_response(P, StatusCode::Ok));
    drain(&mut p);
    p.handle_put(now, put(2));
    assert_eq!(drain_at(&mut p, 1), vec![]);
    let later = now + Duration::from_secs(1);
    p.handle_tick(later, &route(2, 1));
    assert_eq!(drain_at(&mut p, 1), vec![]);
    assert_eq!(p.take_counters().puts_held, 3);
    assert_eq!(p.unacknowledged(), 2, "held PUTs stay in the buffer");
    p.handle_link_generation(NodeId(2), 1);
    p.handle_peer_back(Some(NodeId(2)), &route(2, 1), later);
    assert_eq!(
        drain_at(&mut p, 1),
        vec![
            to_primary(2, Kind::OpenQueue(open())),
            to_primary(2, Kind::Put(put(1))),
            to_primary(2, Kind::Put(put(2))),
        ]
    );
    assert_eq!(p.take_counters().puts_held, 0);
}

#[test]
fn a_link_return_of_unknown_peers_takes_every_generation_afresh() {
    // Which links came back is unknown (the announcements lagged): the queue reopens and its
    // PUTs go under the link's generation as it is now.
    let now = Instant::now();
    let mut p = attached(now);
    p.handle_put(now, put(1));
    drain(&mut p);
    p.handle_peer_back(None, &route(2, 1), now);
    assert_eq!(
        drain_at(&mut p, 4),
        vec![
            to_primary(2, Kind::OpenQueue(open())),
            to_primary(2, Kind::Put(put(1))),
        ]
    );
    assert_eq!(p.take_counters().puts_held, 0);
}

#[test]
fn puts_to_this_node_and_other_requests_are_never_held() {
    // Only a PUT crosses a data link: an open for a peer, and a PUT whose primary is this
    // node (1), go whatever the generations say.
    let now = Instant::now();
    let mut p = proxy();
    p.handle_open(now, open());
    drain(&mut p);
    p.handle_resolved(5, URI.into(), Ok(P), &route(1, 1), now);
    p.handle_put(now, put(1));
    assert_eq!(
        drain(&mut p),
        vec![
            to_primary(1, Kind::OpenQueue(open())),
            to_primary(1, Kind::Put(put(1))),
        ]
    );
    p.handle_put(now, put(2));
    assert_eq!(drain_at(&mut p, 7), vec![to_primary(1, Kind::Put(put(2)))]);
    let mut p = attached(now);
    p.handle_put(now, put(1));
    drain(&mut p);
    p.handle_cluster_change(&route(2, 2), now);
    assert_eq!(
        drain_at(&mut p, 1),
        vec![to_primary(2, Kind::OpenQueue(open()))],
        "the reopen goes; the resend waits for the link's return"
    );
}
