//! BlazingMQ's client wire protocol, `bmqp`: what the official SDKs (C++ libbmq, Java,
//! Python `blazingmq`) speak to a broker, so they can connect to this cluster unchanged.
//!
//! A pure codec: bytes in, typed values out and back, no I/O. The layouts and rules come from
//! BlazingMQ's `src/groups/bmq/bmqp/bmqp_protocol.h` (cited as `protocol.h:<line>`, at the
//! snapshot `a5b313cb`; the client-visible layouts are identical in tag `BMQBRKR_0.92.5`, the
//! libbmq inside the Python SDK 1.2.2) and from frames captured from that SDK
//! (`shared/bmq-wire/`, replayed by `tests/golden.rs`).
//!
//! - [`event`]: the 8-byte event header, event types, padding, and an incremental
//!   [`event::EventDecoder`] that never panics and bounds the event size.
//! - [`message`]: PUT, PUSH, ACK and CONFIRM messages inside their events; CRC32-C of PUT
//!   application data.
//! - [`ber`]: a BER (X.690) TLV reader and writer, definite and indefinite lengths, for the
//!   control messages (`NegotiationMessage`, `ControlMessage`) the SDK sends BER-encoded.
//! - [`control`]: those control messages typed over the BER tree (or JSON, which the Java SDK
//!   sends), and the broker's responses in the client's encoding.
//! - [`properties`]: the typed message properties area of PUT and PUSH, old style and
//!   `MESSAGE_PROPERTIES_EX`.
//!
//! The broker's listener that maps a bmqp session onto the cluster is `bmq-broker`'s
//! `bmqp_session`.

pub mod ber;
pub mod control;
pub mod event;
pub mod message;
pub mod properties;

pub use event::{EventDecoder, EventError, EventHeader, EventType, RawEvent};
