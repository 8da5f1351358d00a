//! One type for plain TCP and TLS connections, so sessions, peer links and the client library
//! handle both the same way.

use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream that is plain TCP or TLS.
pub trait AsyncStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> AsyncStream for T {}

/// A boxed [`AsyncStream`].
pub type BoxedStream = Box<dyn AsyncStream>;
