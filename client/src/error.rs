//! Errors of the client library.

use bmq_proto::client::StatusCode;

use bmq_proto::uri::UriError;

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The broker answered the request with a non-OK status that retrying does not fix (or
    /// that kept coming until the request timeout).
    #[error("refused by the broker: {code:?}: {message}")]
    Refused {
        /// The broker's status code.
        code: StatusCode,
        /// The broker's explanation.
        message: String,
    },
    /// No answer within the request timeout (`ClientConfig::request_timeout`).
    #[error("timed out: {what}")]
    Timeout {
        /// What was waited for, e.g. `open queue bmq://bmq.test/q`.
        what: String,
    },
    /// No broker of the list answered Hello within the request timeout.
    #[error("cannot connect to any broker of {brokers:?}: {last_error}")]
    Connect {
        /// The brokers tried, `host:port`.
        brokers: Vec<String>,
        /// The last failure seen.
        last_error: String,
    },
    /// The client was disconnected (by `disconnect`, or after reconnecting for longer than
    /// `ClientConfig::reconnect_timeout`); the handle can no longer be used.
    #[error("the client is disconnected")]
    Disconnected,
    /// A PUT names a queue that this client has not opened for writing.
    #[error("queue {uri} is not open for writing")]
    NotOpen {
        /// The queue.
        uri: String,
    },
    /// The URI is not `bmq://<domain>/<queue>`.
    #[error(transparent)]
    InvalidUri(#[from] UriError),
    /// The configuration is unusable.
    #[error("invalid client configuration: {message}")]
    Config {
        /// What is wrong, naming the field.
        message: String,
    },
    /// A socket error on the initial connection.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

impl ClientError {
    /// Whether retrying the same request later may succeed: the broker is not ready yet
    /// (no leader, no active primary) or timed out internally.
    pub fn is_retriable(&self) -> bool {
        matches!(
            self,
            ClientError::Refused {
                code: StatusCode::NotReady | StatusCode::Timeout,
                ..
            }
        )
    }
}
