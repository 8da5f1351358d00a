//! The node's networking below the actors: peer links and node-side TLS.

pub mod join;
pub mod peers;
pub mod tls;
