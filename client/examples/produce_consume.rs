//! Produce and consume a few messages with the client library.
//!
//! Start a local cluster first (`bmqctl cluster up`), then:
//!
//! ```text
//! cargo run -p bmq-broker --example produce_consume -- [host:port ...]
//! ```
//!
//! The brokers default to the local cluster (127.0.0.1:30101..30103). The client connects to the
//! first that answers and fails over to the others if that broker goes away.

use std::time::Duration;

use bmq_client::{Client, ClientConfig, OpenOptions};
use bmq_proto::client::{AckStatus, ConsumerOptions, Property};
use bytes::Bytes;

const URI: &str = "bmq://bmq.test/example";
const COUNT: usize = 10;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut brokers: Vec<String> = std::env::args().skip(1).collect();
    if brokers.is_empty() {
        brokers = ["127.0.0.1:30101", "127.0.0.1:30102", "127.0.0.1:30103"]
            .map(String::from)
            .to_vec();
    }
    let client = Client::connect(ClientConfig::new(brokers)).await?;
    println!("connected to {:?}", client.connected_broker());

    // One client may both produce and consume; real applications usually do one of the two.
    let consumer = ConsumerOptions {
        max_unconfirmed_messages: 100,
        max_unconfirmed_bytes: 0, // the broker's default
        priority: 0,
        app_id: String::new(), // only fanout domains use it
        ..Default::default()
    };
    client
        .open_queue(URI, OpenOptions::read_write(consumer))
        .await?;

    // PUT without waiting for each ack, then wait for all of them.
    let mut pending = Vec::new();
    for i in 0..COUNT {
        let properties = vec![Property {
            key: "index".into(),
            value: i.to_string(),
            ..Default::default()
        }];
        let payload = Bytes::from(format!("hello #{i}"));
        pending.push(client.put(URI, payload, properties).await?);
    }
    for ack in pending {
        let ack = ack.await?;
        if ack.status() != AckStatus::Success {
            anyhow::bail!("nacked: {:?} {}", ack.status(), ack.message);
        }
    }
    println!("{COUNT} messages acknowledged");

    // Receive and confirm them (there may be more: the queue may hold older messages).
    let mut received = 0;
    while received < COUNT {
        let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_secs(10), client.next_message()).await
        else {
            anyhow::bail!("only {received} of {COUNT} messages received");
        };
        println!(
            "received {:?} (attempt {})",
            String::from_utf8_lossy(&message.payload),
            message.delivery_attempt
        );
        client.confirm(&message.uri, message.guid).await?;
        received += 1;
    }

    client.close_queue(URI).await?;
    client.disconnect().await?;
    Ok(())
}
