//! What BlazingMQ's SDKs expect of a broker, spoken with our own code over real TCP to a real
//! 3-node cluster, so that a regression fails without any SDK installed. The JSON messages are
//! those the Java SDK (bloomberg/blazingmq-sdk-java 7171c7c) sends, as its sources write them
//! and as a build of it was seen to send against this broker:
//!
//! - a legacy client (no `guidInfo`: the Java SDK) puts a 24-bit correlation id in the GUID
//!   field of its PUTs and starts again at 1 in every process: the broker makes each
//!   message's GUID, returns the correlation id in the ACK, and no message of a later process
//!   is taken for a duplicate of an earlier one's;
//! - every PUSH carries the `SUB_QUEUE_INFOS` option naming the subscription (ConfigureStream
//!   `sId`) it went to: the SDKs route a PUSH by it;
//! - several handles of one queue (a writer and readers of two fanout apps) share one queue id
//!   in one session, each closed on its own;
//! - after the DisconnectResponse the broker leaves the close of the connection to the client;
//! - a subscription's expression selects the messages it gets, by their properties; an invalid
//!   one is refused with BlazingMQ's status; consumer priorities hold across sessions and
//!   nodes (the highest served, round-robin among equals, the next when they leave).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_bmqp::event::EventType;
use bmq_bmqp::message::{
    decode_pushes, decode_sub_queue_ids, MESSAGE_PROPERTIES, PUT_ACK_REQUESTED,
};
use bmq_bmqp::properties::{self, PropertyValue};
use bmq_tests::bmqp::{guid, legacy_guid_field, RawClient};
use bmq_tests::{metric, Cluster};
use serde_json::json;

/// Opens `uri` (queue id `q_id`, sub-queue `sub_id` of app `app_id` when given) in JSON with
/// the Java SDK's `flags` and counts; checks the answer.
async fn open(
    raw: &mut RawClient,
    r_id: i64,
    uri: &str,
    q_id: u32,
    sub: Option<(u32, &str)>,
    read: bool,
) -> anyhow::Result<()> {
    let mut handle = json!({"uri": uri, "qId": q_id,
        "flags": if read { 2 } else { 12 },
        "readCount": i32::from(read), "writeCount": i32::from(!read), "adminCount": 0});
    if let Some((sub_id, app_id)) = sub {
        handle["subIdInfo"] = json!({"subId": sub_id, "appId": app_id});
    }
    let v = raw
        .json_request(json!({"rId": r_id, "openQueue": {"handleParameters": handle}}))
        .await?;
    ensure!(
        v["openQueueResponse"]["originalRequest"]["handleParameters"]["uri"] == uri,
        "open {uri}: {v}"
    );
    Ok(())
}

/// ConfigureStream of `app_id`'s reader on queue id `q_id` with one subscription `s_id` of
/// every message (`s_id` `None`: deconfigure, no subscription).
async fn configure(
    raw: &mut RawClient,
    r_id: i64,
    q_id: u32,
    app_id: &str,
    s_id: Option<u32>,
) -> anyhow::Result<()> {
    let subs: Vec<(u32, &str, i32)> = s_id.map(|s| (s, "", 0)).into_iter().collect();
    let v = configure_subscriptions(raw, r_id, q_id, app_id, &subs).await?;
    ensure!(
        v["configureStreamResponse"]["request"]["qId"] == q_id,
        "configure: {v}"
    );
    Ok(())
}

/// ConfigureStream with `subscriptions` (sId, expression, priority) as the Java SDK writes
/// them (version `E_VERSION_1` for a non-empty expression); returns the answer.
async fn configure_subscriptions(
    raw: &mut RawClient,
    r_id: i64,
    q_id: u32,
    app_id: &str,
    subscriptions: &[(u32, &str, i32)],
) -> anyhow::Result<serde_json::Value> {
    let subscriptions: Vec<serde_json::Value> = subscriptions
        .iter()
        .map(|(s_id, text, priority)| {
            let version = if text.is_empty() {
                "E_UNDEFINED"
            } else {
                "E_VERSION_1"
            };
            json!({"sId": s_id, "expression": {"version": version, "text": text},
                "consumers": [{"maxUnconfirmedMessages": 1000, "maxUnconfirmedBytes": 33554432,
                               "consumerPriority": priority, "consumerPriorityCount": 1}]})
        })
        .collect();
    raw.json_request(json!({"rId": r_id, "configureStream": {"qId": q_id,
        "streamParameters": {"appId": app_id, "subscriptions": subscriptions}}}))
        .await
}

/// Closes queue id `q_id`'s handle (sub-queue `sub` when given).
async fn close(
    raw: &mut RawClient,
    r_id: i64,
    uri: &str,
    q_id: u32,
    sub: Option<(u32, &str)>,
    read: bool,
    is_final: bool,
) -> anyhow::Result<()> {
    let mut handle = json!({"uri": uri, "qId": q_id,
        "flags": if read { 2 } else { 12 },
        "readCount": i32::from(read), "writeCount": i32::from(!read), "adminCount": 0});
    if let Some((sub_id, app_id)) = sub {
        handle["subIdInfo"] = json!({"subId": sub_id, "appId": app_id});
    }
    let v = raw
        .json_request(
            json!({"rId": r_id, "closeQueue": {"handleParameters": handle, "isFinal": is_final}}),
        )
        .await?;
    ensure!(v.get("closeQueueResponse").is_some(), "close: {v}");
    Ok(())
}

/// Receives `n` PUSHes; returns `(payload, GUID, subscription ids)` of each.
async fn pushes(
    raw: &mut RawClient,
    n: usize,
) -> anyhow::Result<Vec<(String, [u8; 16], Vec<u32>)>> {
    let mut got = Vec::new();
    while got.len() < n {
        let e = raw
            .next_of(EventType::Push)
            .await
            .with_context(|| format!("{} of {n} PUSHes received", got.len()))?;
        for p in decode_pushes(&e.body)? {
            let payload = if p.flags & MESSAGE_PROPERTIES != 0 {
                properties::decode(&p.app_data, p.schema_wire != 0)?.1
            } else {
                p.app_data.clone()
            };
            got.push((
                String::from_utf8_lossy(&payload).into_owned(),
                p.guid,
                decode_sub_queue_ids(&p.options)?,
            ));
        }
    }
    Ok(got)
}

/// Three legacy producers, one after the other on three nodes as three Java processes would,
/// each numbering its correlation ids from 1, with ACKs and without: every ACK carries its
/// PUT's correlation id, no message is dropped as a duplicate, and a consumer receives all of
/// them, each under the GUID the broker made for it and the subscription id it configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_producers_get_their_correlation_ids_and_lose_nothing() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let uri = "bmq://bmq.test/legacy-producers";
        let (acked, silent) = (20u32, 5u32);
        let mut guids = HashSet::new();
        for process in 1..=3u32 {
            let addr = cluster.node(process).bmqp_addr();
            let mut raw =
                RawClient::negotiated_json(&addr, &format!("java-{process}"), None).await?;
            open(&mut raw, 1, uri, 0, None, false).await?;
            for c in 1..=acked {
                let data = format!("p{process}-acked-{c}");
                raw.put(
                    0,
                    legacy_guid_field(c),
                    data.as_bytes(),
                    PUT_ACK_REQUESTED,
                    false,
                )
                .await;
            }
            // Without a correlation id: no ACK wanted, the GUID field all zero.
            for c in 1..=silent {
                let data = format!("p{process}-silent-{c}");
                raw.put(0, legacy_guid_field(0), data.as_bytes(), 0, false)
                    .await;
            }
            let mut by_correlation = BTreeMap::new();
            while by_correlation.len() < acked as usize {
                for ack in raw.acks().await? {
                    ensure!(ack.status == 0, "ACK status {} for {ack:?}", ack.status);
                    ensure!(ack.queue_id == 0);
                    ensure!(
                        by_correlation
                            .insert(ack.correlation_id, ack.guid)
                            .is_none(),
                        "two ACKs for correlation id {}",
                        ack.correlation_id
                    );
                }
            }
            ensure!(
                by_correlation.keys().copied().eq(1..=acked),
                "correlation ids {:?}",
                by_correlation.keys().collect::<Vec<_>>()
            );
            for g in by_correlation.values() {
                ensure!(g[0] >> 6 == 1, "a GUID of BlazingMQ's version 1: {g:?}");
                ensure!(guids.insert(*g), "GUID {g:?} made twice");
            }
            close(&mut raw, 2, uri, 0, None, false, true).await?;
        }

        let mut reader =
            RawClient::negotiated_json(&cluster.node(2).bmqp_addr(), "reader", None).await?;
        open(&mut reader, 1, uri, 0, None, true).await?;
        configure(&mut reader, 2, 0, "__default", Some(5)).await?;
        let total = 3 * (acked + silent) as usize;
        let got = pushes(&mut reader, total).await?;
        let mut payloads = HashSet::new();
        let mut pushed_guids = HashSet::new();
        for (payload, g, ids) in &got {
            ensure!(ids == &[5], "PUSH of {payload} names subscriptions {ids:?}");
            ensure!(pushed_guids.insert(*g), "GUID {g:?} pushed twice");
            ensure!(payloads.insert(payload.clone()), "{payload} pushed twice");
            reader.confirm(0, *g, 0).await;
        }
        for process in 1..=3 {
            for c in 1..=acked {
                ensure!(payloads.contains(&format!("p{process}-acked-{c}")));
            }
            for c in 1..=silent {
                ensure!(payloads.contains(&format!("p{process}-silent-{c}")));
            }
        }
        ensure!(
            guids.is_subset(&pushed_guids),
            "ACKed GUIDs are the pushed ones"
        );
        let mut duplicates = 0.0;
        for id in 1..=3 {
            duplicates += metric(
                &cluster.node(id).admin_addr(),
                "bmq_queue_put_duplicates_total",
            )
            .await?;
        }
        ensure!(duplicates == 0.0, "{duplicates} PUTs taken for duplicates");
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// One session holds a writer of a fanout queue and readers of two of its apps under one
/// queue id (sub-queues 0, 1, 2), as the Java SDK opens them: each message reaches each app's
/// reader once, under that reader's subscription id; a reader closed on its own leaves the
/// others working; the last close is final; after the DisconnectResponse the broker waits for
/// the client to close the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_of_one_queue_share_its_id_and_pushes_name_their_subscription() -> anyhow::Result<()>
{
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run =
        async {
            let base = "bmq://bmq.test.mmap.fanout/handles";
            let addr = cluster.node(3).bmqp_addr();
            let mut raw =
                RawClient::negotiated_json(&addr, "java-fanout", Some("0A0B0C0D0E0F")).await?;
            open(
                &mut raw,
                1,
                &format!("{base}?id=foo"),
                0,
                Some((1, "foo")),
                true,
            )
            .await?;
            configure(&mut raw, 2, 0, "foo", Some(11)).await?;
            open(
                &mut raw,
                3,
                &format!("{base}?id=bar"),
                0,
                Some((2, "bar")),
                true,
            )
            .await?;
            configure(&mut raw, 4, 0, "bar", Some(12)).await?;
            open(&mut raw, 5, base, 0, None, false).await?;
            for n in 1..=5u8 {
                ensure!(
                    raw.post(0, guid(n), format!("m{n}").as_bytes(), false)
                        .await?
                        == 0,
                    "ACK of m{n}"
                );
            }
            let got = pushes(&mut raw, 10).await?;
            let mut seen = BTreeMap::new();
            for (payload, g, ids) in &got {
                ensure!(ids.len() == 1, "one subscription per PUSH: {ids:?}");
                ensure!(
                    seen.insert((payload.clone(), ids[0]), *g).is_none(),
                    "{payload} twice for subscription {}",
                    ids[0]
                );
                // Sub-queue 1 reads foo (subscription 11), 2 reads bar (12).
                raw.confirm(0, *g, if ids[0] == 11 { 1 } else { 2 }).await;
            }
            for n in 1..=5 {
                for s_id in [11, 12] {
                    ensure!(
                        seen.contains_key(&(format!("m{n}"), s_id)),
                        "m{n} for {s_id}"
                    );
                }
            }

            // foo's reader goes (deconfigured, then closed, as the SDKs do); bar's stays.
            configure(&mut raw, 6, 0, "foo", None).await?;
            close(
                &mut raw,
                7,
                &format!("{base}?id=foo"),
                0,
                Some((1, "foo")),
                true,
                false,
            )
            .await?;
            for n in 6..=8u8 {
                ensure!(
                    raw.post(0, guid(n), format!("m{n}").as_bytes(), false)
                        .await?
                        == 0,
                    "ACK of m{n}"
                );
            }
            let got = pushes(&mut raw, 3).await?;
            for (payload, g, ids) in &got {
                ensure!(ids == &[12], "{payload} after foo's close went to {ids:?}");
                raw.confirm(0, *g, 2).await;
            }
            configure(&mut raw, 8, 0, "bar", None).await?;
            close(
                &mut raw,
                9,
                &format!("{base}?id=bar"),
                0,
                Some((2, "bar")),
                true,
                false,
            )
            .await?;
            close(&mut raw, 10, base, 0, None, false, true).await?;

            let v = raw
                .json_request(json!({"rId": 11, "disconnect": {}}))
                .await?;
            ensure!(v.get("disconnectResponse").is_some(), "disconnect: {v}");
            ensure!(
            raw.next_event_within(Duration::from_secs(2)).await?.is_none(),
            "the broker closed the connection after the DisconnectResponse (the SDKs take that \
             for a lost connection and reconnect)"
        );
            Ok::<_, anyhow::Error>(())
        };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// The BER reader of the Python SDK's protocol (ConfigureQueueStream, no subscriptions) gets
/// PUSHes naming its sub-queue (0, the default stream), and a JSON client opening a queue id
/// already open for another queue is refused with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_to_a_configure_queue_stream_reader_name_sub_queue_zero() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let mut raw = RawClient::negotiated(&cluster.node(1).bmqp_addr()).await?;
        raw.open(4, "bmq://bmq.test/ber-reader").await?;
        ensure!(raw.post(4, guid(1), b"ber", false).await? == 0, "ACK");
        let got = pushes(&mut raw, 1).await?;
        ensure!(got[0].0 == "ber" && got[0].2 == [0], "{got:?}");
        raw.confirm(4, got[0].1, 0).await;

        let mut json = RawClient::negotiated_json(&cluster.node(1).bmqp_addr(), "j", None).await?;
        open(&mut json, 1, "bmq://bmq.test/one", 0, None, false).await?;
        json.json(json!({"rId": 2, "openQueue": {"handleParameters": {
            "uri": "bmq://bmq.test/two", "qId": 0, "flags": 12, "readCount": 0,
            "writeCount": 1, "adminCount": 0}}}))
            .await;
        let v = json.json_answer().await?;
        let status = &v["status"];
        ensure!(
            status["category"] == "E_INVALID_ARGUMENT"
                && status["message"]
                    .as_str()
                    .context("a message")?
                    .contains("bmq://bmq.test/one"),
            "second queue under queue id 0: {v}"
        );
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// A JSON reader subscribes to `seq >= 50 && kind == "even"`: of 100 messages with typed
/// properties from a producer on another node, it gets exactly those that match, each
/// named by its subscription id; a second subscription of the same reader takes the rest;
/// an expression that does not compile is refused with BlazingMQ's status and leaves the
/// reader as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_select_by_properties() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let uri = "bmq://bmq.test/subscriptions";
        let mut reader =
            RawClient::negotiated_json(&cluster.node(1).bmqp_addr(), "sub-reader", None).await?;
        open(&mut reader, 1, uri, 0, None, true).await?;
        let v =
            configure_subscriptions(&mut reader, 2, 0, "__default", &[(3, "seq >=", 0)]).await?;
        let status = &v["status"];
        ensure!(
            status["category"] == "E_INVALID_ARGUMENT"
                && status["message"].as_str().is_some_and(|m| m
                    .contains("Expression validation failed")
                    && m.contains("-100")),
            "an invalid expression: {v}"
        );
        let v = configure_subscriptions(
            &mut reader,
            3,
            0,
            "__default",
            &[(7, "seq >= 50 && kind == \"even\"", 0)],
        )
        .await?;
        ensure!(v.get("configureStreamResponse").is_some(), "configure: {v}");

        // A writer only (a reader would take what no subscription of the other matches).
        let addr = cluster.node(2).bmqp_addr();
        let mut producer =
            RawClient::negotiated_json(&addr, "writer", Some("0A0B0C0D0E0F")).await?;
        open(&mut producer, 1, uri, 1, None, false).await?;
        for n in 0..100u8 {
            let kind = if n % 2 == 0 { "even" } else { "odd" };
            let props = vec![
                ("seq".to_string(), PropertyValue::Int32(i32::from(n))),
                ("kind".to_string(), PropertyValue::String(kind.into())),
            ];
            producer
                .put_with_properties(1, guid(n), &props, format!("m{n}").as_bytes())
                .await?;
        }
        let mut acked = 0;
        while acked < 100 {
            for ack in producer.acks().await? {
                ensure!(ack.status == 0, "ACK {ack:?}");
                acked += 1;
            }
        }
        let got = pushes(&mut reader, 25).await?;
        let mut payloads: Vec<String> = got.iter().map(|(p, _, _)| p.clone()).collect();
        payloads.sort();
        let mut want: Vec<String> = (50..100).step_by(2).map(|n| format!("m{n}")).collect();
        want.sort();
        ensure!(payloads == want, "{payloads:?}");
        for (payload, g, ids) in &got {
            ensure!(ids == &[7], "{payload} under {ids:?}");
            reader.confirm(0, *g, 0).await;
        }
        ensure!(
            reader
                .next_event_within(Duration::from_millis(500))
                .await?
                .is_none(),
            "nothing else matches"
        );
        // A second subscription takes what waited.
        let v = configure_subscriptions(
            &mut reader,
            4,
            0,
            "__default",
            &[
                (7, "seq >= 50 && kind == \"even\"", 0),
                (8, "seq < 50 || kind != \"even\"", 0),
            ],
        )
        .await?;
        ensure!(v.get("configureStreamResponse").is_some(), "configure: {v}");
        let rest = pushes(&mut reader, 75).await?;
        for (payload, g, ids) in &rest {
            ensure!(ids == &[8], "{payload} under {ids:?}");
            reader.confirm(0, *g, 0).await;
        }
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// Consumer priorities across sessions on different nodes: the priority-2 reader gets every
/// message while the priority-1 reader waits; two readers of equal priority share them; when
/// the high-priority reader leaves, the lower one is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_priorities_hold_across_sessions() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let uri = "bmq://bmq.test/priorities";
        let reader = |node: u32, name: &'static str| {
            let addr = cluster.node(node).bmqp_addr();
            async move { RawClient::negotiated_json(&addr, name, None).await }
        };
        let mut high = reader(1, "high").await?;
        let mut low = reader(2, "low").await?;
        let mut high2 = reader(3, "high2").await?;
        for (r, priority) in [(&mut high, 2), (&mut low, 1)] {
            open(r, 1, uri, 0, None, true).await?;
            let v = configure_subscriptions(r, 2, 0, "__default", &[(1, "", priority)]).await?;
            ensure!(v.get("configureStreamResponse").is_some(), "configure: {v}");
        }
        let addr = cluster.node(1).bmqp_addr();
        let mut producer =
            RawClient::negotiated_json(&addr, "writer", Some("0A0B0C0D0E0F")).await?;
        open(&mut producer, 1, uri, 1, None, false).await?;
        let post = async |producer: &mut RawClient, from: u8, to: u8| -> anyhow::Result<()> {
            for n in from..to {
                ensure!(
                    producer
                        .post(1, guid(n), format!("m{n}").as_bytes(), false)
                        .await?
                        == 0
                );
            }
            Ok(())
        };
        post(&mut producer, 0, 10).await?;
        let got = pushes(&mut high, 10).await?;
        for (_, g, _) in &got {
            high.confirm(0, *g, 0).await;
        }
        ensure!(
            low.next_event_within(Duration::from_millis(500))
                .await?
                .is_none(),
            "the priority-1 reader got a message while a priority-2 reader was there"
        );
        // A second priority-2 reader: the two share the next messages.
        open(&mut high2, 1, uri, 0, None, true).await?;
        configure_subscriptions(&mut high2, 2, 0, "__default", &[(1, "", 2)]).await?;
        post(&mut producer, 10, 30).await?;
        let (mut a, mut b) = (0, 0);
        while a + b < 20 {
            tokio::select! {
                e = high.next_of(EventType::Push) => {
                    for p in decode_pushes(&e?.body)? { high.confirm(0, p.guid, 0).await; a += 1; }
                }
                e = high2.next_of(EventType::Push) => {
                    for p in decode_pushes(&e?.body)? { high2.confirm(0, p.guid, 0).await; b += 1; }
                }
            }
        }
        ensure!(a > 0 && b > 0, "round-robin among equals: {a} and {b}");
        ensure!(
            low.next_event_within(Duration::from_millis(300))
                .await?
                .is_none(),
            "the priority-1 reader was served"
        );
        // Both high readers leave: the low one gets the next messages.
        drop(high);
        drop(high2);
        tokio::time::sleep(Duration::from_millis(300)).await;
        post(&mut producer, 30, 35).await?;
        let got = pushes(&mut low, 5).await?;
        ensure!(got.len() == 5, "{got:?}");
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}

/// Broker heartbeats (BlazingMQ's, `[bmqp] heartbeat_interval_ms`, `max_missed_heartbeats`;
/// 200 ms and 3 here): a silent libbmq client is sent HEARTBEAT_REQ and stays connected while
/// it answers; one that stops answering is dropped after three silent intervals and the
/// message it held goes to another consumer; the Java SDK (which cannot decode one) is sent
/// none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_are_sent_heartbeats_and_dropped() -> anyhow::Result<()> {
    let cluster = Cluster::start_with(3, |c| {
        c.bmqp.heartbeat_interval_ms = 200;
        c.bmqp.max_missed_heartbeats = 3;
    })?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let uri = "bmq://bmq.test/heartbeats";
        let addr = cluster.node(1).bmqp_addr();
        // A reader that will hold one message and then go silent.
        let mut silent = RawClient::negotiated(&addr).await?;
        silent.open(0, uri).await?;
        ensure!(silent.post(0, guid(1), b"held", false).await? == 0, "ACK");
        let got = pushes(&mut silent, 1).await?;
        ensure!(got[0].0 == "held", "{got:?}");
        // A client that answers every heartbeat for two seconds.
        let mut alive = RawClient::negotiated(&cluster.node(2).bmqp_addr()).await?;
        let mut java =
            RawClient::negotiated_json(&cluster.node(2).bmqp_addr(), "java", None).await?;
        let until = tokio::time::Instant::now() + Duration::from_secs(2);
        let mut answered = 0;
        while tokio::time::Instant::now() < until {
            match alive.next_event_within(Duration::from_millis(100)).await? {
                Some(Some(e)) if e.header.event_type == EventType::HeartbeatReq => {
                    alive
                        .send(EventType::HeartbeatRsp, 0, bytes::Bytes::new())
                        .await;
                    answered += 1;
                }
                Some(Some(_)) | None => {}
                Some(None) => anyhow::bail!("a client answering heartbeats was dropped"),
            }
        }
        ensure!(answered >= 3, "{answered} heartbeats in 2 s at 200 ms");
        // The silent one is gone: its connection closed, its message redelivered.
        ensure!(silent.closed().await?, "a silent client stayed connected");
        let mut next = RawClient::negotiated(&cluster.node(3).bmqp_addr()).await?;
        next.open(0, uri).await?;
        let got = pushes(&mut next, 1).await?;
        ensure!(got[0].0 == "held", "{got:?}");
        // The Java client heard nothing (and is still connected).
        ensure!(
            java.next_event_within(Duration::from_millis(100))
                .await?
                .is_none(),
            "the Java SDK was sent an event (it cannot decode HEARTBEAT_REQ)"
        );
        ensure!(
            bmq_tests::metric(
                &cluster.node(1).admin_addr(),
                "bmq_bmqp_heartbeat_timeouts_total"
            )
            .await?
                >= 1.0
        );
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}
