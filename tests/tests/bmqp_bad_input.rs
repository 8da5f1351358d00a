//! Bad input on the bmqp listener (BlazingMQ's client protocol), over real TCP to a
//! real 3-node cluster: garbage, a truncated event, an oversized length, an event type a client
//! never sends, malformed BER, a PUT for a queue id never opened — each closes that connection
//! only, counted in `bmq_bmqp_errors_total`; a PUT whose CRC32-C does not match is NACKed
//! (status 5) and the connection goes on; a HEARTBEAT_REQ is answered. A client negotiated
//! before all of this produces and consumes through it all.
//!
//! The raw client ([`bmq_tests::bmqp::RawClient`]) speaks the protocol with the `bmq-bmqp`
//! codec; its negotiation is the first frame the Python SDK 1.2.2 sent
//! (bmqp/tests/frames/captures.txt).

use std::time::Duration;

use anyhow::{ensure, Context};
use bmq_bmqp::event::EventType;
use bmq_bmqp::message::{decode_pushes, encode_puts, PutMessage, PUT_ACK_REQUESTED};
use bmq_tests::bmqp::{guid, RawClient};
use bmq_tests::{metric, Cluster};
use bytes::Bytes;

/// Bytes of a hex string.
fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bmqp_input_closes_only_that_connection() -> anyhow::Result<()> {
    let cluster = Cluster::start(3)?;
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let run = async {
        let node = cluster.node(1);
        let (addr, admin) = (node.bmqp_addr(), node.admin_addr());
        let uri = "bmq://bmq.test/bmqp-bad-input";

        // A good client, negotiated before the bad ones and used after them.
        let mut good = RawClient::negotiated(&addr).await?;
        good.open(0, uri).await?;
        ensure!(
            good.post(0, guid(1), b"before", false).await? == 0,
            "ACK SUCCESS"
        );

        let errors = |admin: String| async move { metric(&admin, "bmq_bmqp_errors_total").await };
        let mut counted = errors(admin.clone()).await?;
        let mut expect_counted = |now: f64, what: &str| -> anyhow::Result<()> {
            ensure!(
                now > counted,
                "{what} was not counted in bmq_bmqp_errors_total"
            );
            counted = now;
            Ok(())
        };

        // Garbage instead of an event: its "length" is far over the limit.
        let mut raw = RawClient::connect(&addr).await?;
        raw.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        ensure!(raw.closed().await?, "garbage: connection not closed");
        expect_counted(errors(admin.clone()).await?, "garbage")?;

        // An oversized length, after negotiation.
        let mut raw = RawClient::negotiated(&addr).await?;
        raw.send_bytes(&hex_bytes("7fffffff41020000")).await;
        ensure!(raw.closed().await?, "oversized: connection not closed");
        expect_counted(errors(admin.clone()).await?, "an oversized event")?;

        // A truncated event, then the client goes away: nothing to count, nothing breaks.
        let mut raw = RawClient::negotiated(&addr).await?;
        raw.send_bytes(&hex_bytes("0000004c4102")).await;
        drop(raw);

        // An event type clients never send (RECOVERY).
        let mut raw = RawClient::negotiated(&addr).await?;
        raw.send(EventType::from_code(9), 0, Bytes::from_static(b"\0\0\0\0"))
            .await;
        ensure!(raw.closed().await?, "RECOVERY: connection not closed");
        expect_counted(errors(admin.clone()).await?, "an unknown event type")?;

        // Malformed BER in a CONTROL event.
        let mut raw = RawClient::negotiated(&addr).await?;
        raw.send(
            EventType::Control,
            0,
            Bytes::from_static(b"\x30\x80\xa1\x85\x01\x02\x02"),
        )
        .await;
        ensure!(raw.closed().await?, "malformed BER: connection not closed");
        expect_counted(errors(admin.clone()).await?, "malformed BER")?;

        // A PUT for a queue id never opened.
        let mut raw = RawClient::negotiated(&addr).await?;
        let put = PutMessage {
            flags: PUT_ACK_REQUESTED,
            queue_id: 7,
            guid: guid(2),
            crc32c: crc32c::crc32c(b"x"),
            schema_wire: 0,
            compression: 0,
            options: Bytes::new(),
            app_data: Bytes::from_static(b"x"),
        };
        raw.send(EventType::Put, 0, encode_puts(&[put])).await;
        ensure!(
            raw.closed().await?,
            "PUT for an unknown queue id: connection not closed"
        );
        expect_counted(
            errors(admin.clone()).await?,
            "a PUT for an unknown queue id",
        )?;

        // A CRC mismatch is NACKed; the connection goes on; a heartbeat is answered.
        let mut raw = RawClient::negotiated(&addr).await?;
        raw.open(3, "bmq://bmq.test/bmqp-bad-crc").await?;
        let status = raw.post(3, guid(3), b"damaged", true).await?;
        ensure!(
            status == 5,
            "CRC mismatch: status {status}, want 5 (unknown)"
        );
        expect_counted(errors(admin.clone()).await?, "a CRC mismatch")?;
        ensure!(
            raw.post(3, guid(4), b"intact", false).await? == 0,
            "intact PUT ACKed"
        );
        raw.send(EventType::HeartbeatReq, 0, Bytes::new()).await;
        raw.next_of(EventType::HeartbeatRsp).await?;

        // The good client still produces, and receives and confirms both of its messages.
        ensure!(
            good.post(0, guid(5), b"after", false).await? == 0,
            "ACK SUCCESS after"
        );
        let mut got = Vec::new();
        while got.len() < 2 {
            let e = good.next_of(EventType::Push).await?;
            for p in decode_pushes(&e.body)? {
                got.push(p.app_data.clone());
                good.confirm(p.queue_id as u32, p.guid, 0).await;
            }
        }
        got.sort();
        ensure!(
            got == vec![Bytes::from_static(b"after"), Bytes::from_static(b"before")],
            "{got:?}"
        );
        let (leader, _) = cluster.wait_for_leader(Duration::from_secs(10)).await?;
        ensure!(leader >= 1, "a leader after the bad input");
        Ok::<_, anyhow::Error>(())
    };
    Box::pin(run).await.with_context(|| cluster.log_tails(30))
}
