//! `FrameWriter`: outgoing frames (the same wire format as [`crate::FrameCodec`]: a 4-byte
//! big-endian body length, then one protobuf message) gathered for vectored writes, so that
//! large `bytes` fields are written from where they already are instead of being copied into a
//! write buffer.
//!
//! A message's small fields are encoded into a buffer as usual; a `bytes` field of at least
//! [`ZERO_COPY_MIN`] bytes (a payload, a batch of journal frames) becomes a chunk of its own
//! that shares the message's [`Bytes`] (a reference count, no copy). [`FrameWriter::flush_to`]
//! hands the chunks to the socket with `writev` (up to [`IOVECS_PER_WRITE`] per call). Before,
//! a PUT crossing a proxy and replicated to two nodes was copied into a write buffer at every
//! hop, and those copies showed in the brokers' profile (`memmove` under prost's encoders;
//! docs/bench/JOURNAL.md "Where the CPU goes, and fewer copies").
//!
//! The bytes on the wire are exactly what [`crate::FrameCodec`] writes (tested); only the
//! number of copies differs.

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::framing::{FrameError, LENGTH_PREFIX_BYTES};

/// A `bytes` field of at least this many bytes is written from the message's own buffer; a
/// smaller one is copied (below this the copy costs less than an extra iovec).
pub const ZERO_COPY_MIN: usize = 512;

/// Most chunks handed to one `writev` (Linux accepts 1,024).
pub const IOVECS_PER_WRITE: usize = 128;

/// Capacity reserved for encoding when the buffer is full: many small frames share one
/// allocation.
const ENCODE_BLOCK: usize = 16 * 1024;

/// Outgoing frames waiting to be written (see the module doc). Not thread-safe; one per
/// connection.
#[derive(Debug)]
pub struct FrameWriter {
    frame_size_max: usize,
    /// [`FrameWriter::feed`] writes once this many bytes wait.
    write_batch_bytes: usize,
    /// Encoded bytes not yet sealed into `chunks`.
    head: BytesMut,
    /// What waits to be written, in order: runs of encoded bytes and shared large fields. The
    /// first may be partly written already (it was advanced past what was).
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    sealed: usize,
}

/// The `BufMut` prost encodes a message into: small writes go to the writer's `head`, a large
/// `Buf` (prost writes a `Bytes` field with `put(bytes.clone())`) becomes a chunk of its own
/// without a copy (`Bytes::copy_to_bytes` is a slice of the same buffer).
struct Gather<'a>(&'a mut FrameWriter);

// SAFETY: every method delegates to `BytesMut`'s own implementation on `head`; `put` only adds
// whole chunks or delegates.
unsafe impl BufMut for Gather<'_> {
    fn remaining_mut(&self) -> usize {
        self.0.head.remaining_mut()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller initialised `cnt` bytes of `chunk_mut()`, which is `head`'s.
        unsafe { self.0.head.advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        let head = &mut self.0.head;
        if head.capacity() == head.len() {
            head.reserve(ENCODE_BLOCK);
        }
        head.chunk_mut()
    }

    fn put<T: Buf>(&mut self, mut src: T)
    where
        Self: Sized,
    {
        if src.remaining() >= ZERO_COPY_MIN {
            self.0.seal();
            let len = src.remaining();
            let shared = src.copy_to_bytes(len);
            self.0.sealed += shared.len();
            self.0.chunks.push_back(shared);
        } else {
            self.0.head.put(src);
        }
    }

    fn put_slice(&mut self, src: &[u8]) {
        self.0.head.put_slice(src);
    }

    /// One byte (prost writes varints byte by byte) stored in place: `BytesMut`'s own
    /// `put_u8` is a `put_slice` of one byte, a `memmove` call (see [`crate::encode_buf`]).
    #[inline]
    fn put_u8(&mut self, n: u8) {
        crate::EncodeBuf(self).put_u8(n)
    }
}

impl FrameWriter {
    /// A writer that refuses messages whose body exceeds `frame_size_max` bytes, and whose
    /// [`FrameWriter::feed`] writes once `write_batch_bytes` bytes wait (the caller writes the
    /// rest with [`FrameWriter::flush_to`] at the end of its batch).
    pub fn new(frame_size_max: usize, write_batch_bytes: usize) -> Self {
        FrameWriter {
            frame_size_max,
            write_batch_bytes,
            head: BytesMut::new(),
            chunks: VecDeque::new(),
            sealed: 0,
        }
    }

    /// Starts a frame whose body is `length` bytes: checks the maximum, makes room, writes
    /// the length prefix; the caller encodes the body through the returned gatherer. Errors:
    /// [`FrameError::TooLarge`] (nothing is added).
    fn begin_frame(&mut self, length: usize) -> Result<Gather<'_>, FrameError> {
        if length > self.frame_size_max {
            return Err(FrameError::TooLarge {
                length,
                max: self.frame_size_max,
            });
        }
        if self.head.capacity() - self.head.len() < LENGTH_PREFIX_BYTES + length.min(1024) {
            self.head.reserve(ENCODE_BLOCK);
        }
        let mut gather = Gather(self);
        gather.put_u32(length as u32);
        Ok(gather)
    }

    /// Adds one frame: `message`, length-prefixed. Large `bytes` fields are shared, not copied.
    /// Errors: [`FrameError::TooLarge`] when the body exceeds the maximum (nothing is added).
    pub fn push<M: prost::Message>(&mut self, message: &M) -> Result<(), FrameError> {
        let mut gather = self.begin_frame(message.encoded_len())?;
        message
            .encode(&mut gather)
            .expect("a BytesMut-backed buffer has room for any message");
        Ok(())
    }

    /// [`FrameWriter::push`] of a peer message: the same bytes, but a
    /// `ForwardedClientMessage` (every request a proxy sends a primary, every ACK and PUSH a
    /// primary sends back) has its two envelopes written here, so the client message's length
    /// is computed twice instead of four times (prost computes a nested message's length
    /// again at every level it encodes, and the peer links' encoding showed in the brokers'
    /// profile; docs/bench/JOURNAL.md "Replicas read frames in place, and fewer calls per
    /// frame"). Errors: as [`FrameWriter::push`].
    pub fn push_peer(&mut self, message: &crate::peer::PeerMessage) -> Result<(), FrameError> {
        use crate::peer::peer_message::Kind;
        use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
        use prost::Message;
        let Some(Kind::Forwarded(f)) = &message.kind else {
            return self.push(message);
        };
        let Some(inner) = &f.inner else {
            return self.push(message);
        };
        /// `PeerMessage.forwarded` and the fields of `ForwardedClientMessage` (peer.proto).
        const FORWARDED: u32 = 5;
        let inner_len = inner.encoded_len();
        let scalar =
            |field: u32, value: u64| prost::encoding::key_len(field) + encoded_len_varint(value);
        let mut forwarded_len =
            prost::encoding::key_len(3) + encoded_len_varint(inner_len as u64) + inner_len;
        if f.origin_node_id != 0 {
            forwarded_len += scalar(1, u64::from(f.origin_node_id));
        }
        if f.session_id != 0 {
            forwarded_len += scalar(2, f.session_id);
        }
        if let Some(p) = f.partition_id {
            forwarded_len += scalar(4, u64::from(p));
        }
        let length = prost::encoding::key_len(FORWARDED)
            + encoded_len_varint(forwarded_len as u64)
            + forwarded_len;
        let before = self.buffered();
        let mut gather = self.begin_frame(length)?;
        encode_key(FORWARDED, WireType::LengthDelimited, &mut gather);
        encode_varint(forwarded_len as u64, &mut gather);
        if f.origin_node_id != 0 {
            prost::encoding::uint32::encode(1, &f.origin_node_id, &mut gather);
        }
        if f.session_id != 0 {
            prost::encoding::uint64::encode(2, &f.session_id, &mut gather);
        }
        encode_key(3, WireType::LengthDelimited, &mut gather);
        encode_varint(inner_len as u64, &mut gather);
        inner.encode_raw(&mut gather);
        if let Some(p) = f.partition_id {
            prost::encoding::uint32::encode(4, &p, &mut gather);
        }
        debug_assert_eq!(self.buffered() - before, LENGTH_PREFIX_BYTES + length);
        Ok(())
    }

    /// [`FrameWriter::push`], then, once the batch boundary (`write_batch_bytes`) is reached,
    /// [`FrameWriter::flush_to`]. Errors: those of either.
    pub async fn feed<M: prost::Message, W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        io: &mut W,
        message: &M,
    ) -> Result<(), FrameError> {
        self.push(message)?;
        self.flush_past_batch(io).await
    }

    /// [`FrameWriter::feed`] of a peer message, pushed with [`FrameWriter::push_peer`].
    pub async fn feed_peer<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        io: &mut W,
        message: &crate::peer::PeerMessage,
    ) -> Result<(), FrameError> {
        self.push_peer(message)?;
        self.flush_past_batch(io).await
    }

    /// [`FrameWriter::flush_to`] once the batch boundary (`write_batch_bytes`) is reached.
    async fn flush_past_batch<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        io: &mut W,
    ) -> Result<(), FrameError> {
        if self.buffered() >= self.write_batch_bytes {
            self.flush_to(io).await?;
        }
        Ok(())
    }

    /// [`FrameWriter::push`], then [`FrameWriter::flush_to`]: `message` and everything before
    /// it are written now. Errors: those of either.
    pub async fn send<M: prost::Message, W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        io: &mut W,
        message: &M,
    ) -> Result<(), FrameError> {
        self.push(message)?;
        Ok(self.flush_to(io).await?)
    }

    /// Moves what `head` holds into `chunks`.
    fn seal(&mut self) {
        if !self.head.is_empty() {
            let run = self.head.split().freeze();
            self.sealed += run.len();
            self.chunks.push_back(run);
        }
    }

    /// Bytes waiting to be written.
    pub fn buffered(&self) -> usize {
        self.sealed + self.head.len()
    }

    /// Whether nothing waits to be written.
    pub fn is_empty(&self) -> bool {
        self.buffered() == 0
    }

    /// Writes everything pushed so far to `io` (vectored writes), then flushes it. Cancel-safe:
    /// what a completed write took is dropped from the writer at once, so a later call goes
    /// on where this one stopped. Errors: the write failed, or `io` accepted no bytes
    /// (`WriteZero`).
    pub async fn flush_to<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        io: &mut W,
    ) -> std::io::Result<()> {
        self.seal();
        while !self.chunks.is_empty() {
            let mut slices = [IoSlice::new(&[]); IOVECS_PER_WRITE];
            let n = self.chunks.len().min(IOVECS_PER_WRITE);
            for (slice, chunk) in slices.iter_mut().zip(self.chunks.iter()) {
                *slice = IoSlice::new(chunk);
            }
            let written = io.write_vectored(&slices[..n]).await?;
            if written == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.consume(written);
        }
        io.flush().await
    }

    /// Drops the first `n` bytes of `chunks` (written).
    fn consume(&mut self, mut n: usize) {
        self.sealed -= n;
        while n > 0 {
            let front = self
                .chunks
                .front_mut()
                .expect("wrote no more than was queued");
            if front.len() <= n {
                n -= front.len();
                self.chunks.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio_util::codec::Encoder;

    use super::*;
    use crate::client::{client_message::Kind, ClientMessage, Push, Put};
    use crate::FrameCodec;

    fn put(payload: Bytes) -> ClientMessage {
        ClientMessage {
            kind: Some(Kind::Put(Put {
                uri: "bmq://bmq.test/q".into(),
                guid: Bytes::from(vec![7u8; 16]),
                payload,
                properties: vec![],
            })),
        }
    }

    fn push(payload: Bytes) -> ClientMessage {
        ClientMessage {
            kind: Some(Kind::Push(Push {
                uri: "bmq://bmq.test/q".into(),
                guid: Bytes::from(vec![9u8; 16]),
                payload,
                properties: vec![],
                delivery_attempt: 2,
                out_of_order: true,
                ..Default::default()
            })),
        }
    }

    /// What `FrameCodec` writes for `messages`.
    fn codec_bytes(messages: &[ClientMessage]) -> Vec<u8> {
        let mut codec = FrameCodec::<ClientMessage>::new(1 << 20);
        let mut out = BytesMut::new();
        for m in messages {
            codec.encode(m.clone(), &mut out).unwrap();
        }
        out.to_vec()
    }

    /// A sink that takes at most `max` bytes per write and at most 3 slices per vectored
    /// write, so writes stop inside chunks and between them.
    struct Trickle {
        out: Vec<u8>,
        max: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let n = buf.len().min(self.max);
            self.out.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let mut left = self.max;
            let mut n = 0;
            for b in bufs.iter().take(3) {
                let take = b.len().min(left);
                self.out.extend_from_slice(&b[..take]);
                n += take;
                left -= take;
                if left == 0 {
                    break;
                }
            }
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn messages() -> Vec<ClientMessage> {
        vec![
            put(Bytes::from(vec![1u8; 1024])),
            push(Bytes::from_static(b"small")),
            put(Bytes::from(vec![2u8; ZERO_COPY_MIN])),
            push(Bytes::from(vec![3u8; ZERO_COPY_MIN - 1])),
            push(Bytes::from(vec![4u8; 70_000])),
            put(Bytes::new()),
        ]
    }

    #[tokio::test]
    async fn writes_exactly_what_the_codec_writes_whatever_the_write_sizes() {
        let messages = messages();
        for max in [1, 7, 100, 1500, 1 << 20] {
            let mut w = FrameWriter::new(1 << 20, usize::MAX);
            for m in &messages {
                w.push(m).unwrap();
            }
            assert_eq!(w.buffered(), codec_bytes(&messages).len());
            let mut sink = Trickle {
                out: Vec::new(),
                max,
            };
            w.flush_to(&mut sink).await.unwrap();
            assert!(w.is_empty());
            assert_eq!(
                sink.out,
                codec_bytes(&messages),
                "writes of at most {max} bytes"
            );
        }
    }

    #[tokio::test]
    async fn frames_pushed_between_flushes_follow_in_order() {
        let messages = messages();
        let mut w = FrameWriter::new(1 << 20, usize::MAX);
        let mut sink = Trickle {
            out: Vec::new(),
            max: 333,
        };
        for m in &messages {
            w.push(m).unwrap();
            w.flush_to(&mut sink).await.unwrap();
        }
        assert_eq!(sink.out, codec_bytes(&messages));
    }

    #[tokio::test]
    async fn feed_writes_once_the_batch_boundary_is_reached_and_send_at_once() {
        let m = messages();
        let mut w = FrameWriter::new(1 << 20, 2048);
        let mut sink = Trickle {
            out: Vec::new(),
            max: 1 << 20,
        };
        w.feed(&mut sink, &m[1]).await.unwrap();
        w.feed(&mut sink, &m[0]).await.unwrap();
        assert!(sink.out.is_empty(), "below the boundary nothing is written");
        assert!(w.buffered() < 2048);
        w.feed(&mut sink, &m[4]).await.unwrap();
        assert!(w.is_empty(), "past the boundary everything is written");
        let fed = [m[1].clone(), m[0].clone(), m[4].clone()];
        assert_eq!(sink.out, codec_bytes(&fed));
        w.push(&m[2]).unwrap();
        w.send(&mut sink, &m[3]).await.unwrap();
        assert!(w.is_empty());
        let all = [fed.to_vec(), vec![m[2].clone(), m[3].clone()]].concat();
        assert_eq!(sink.out, codec_bytes(&all));
    }

    #[tokio::test]
    async fn push_peer_writes_what_push_writes() {
        // Forwarded client messages (with and without their optional and default fields) and
        // other peer messages: push_peer's frames are push's, byte for byte, large payloads
        // shared as push shares them, and the size limit applies to the whole frame.
        use crate::peer::{peer_message::Kind as PeerKind, ForwardedClientMessage, PeerMessage};
        let forwarded = |origin: u32, session: u64, partition: Option<u32>, inner| PeerMessage {
            kind: Some(PeerKind::Forwarded(ForwardedClientMessage {
                origin_node_id: origin,
                session_id: session,
                inner,
                partition_id: partition,
            })),
        };
        let mut all = vec![
            PeerMessage { kind: None },
            forwarded(1, 2, None, None),
            PeerMessage {
                kind: Some(PeerKind::SessionGone(crate::peer::SessionGone {
                    origin_node_id: 3,
                    session_id: 4,
                })),
            },
        ];
        for (i, inner) in messages().into_iter().enumerate() {
            let i = i as u64;
            all.push(forwarded(0, 0, None, Some(inner.clone())));
            all.push(forwarded(7, 1 << (7 * i), Some(0), Some(inner.clone())));
            all.push(forwarded(u32::MAX, u64::MAX, Some(u32::MAX), Some(inner)));
        }
        let mut by_push = FrameWriter::new(1 << 20, usize::MAX);
        let mut by_peer = FrameWriter::new(1 << 20, usize::MAX);
        for m in &all {
            by_push.push(m).unwrap();
            by_peer.push_peer(m).unwrap();
        }
        assert_eq!(by_peer.buffered(), by_push.buffered());
        assert_eq!(
            by_peer.chunks.len(),
            by_push.chunks.len(),
            "the same payloads shared"
        );
        let mut a = Trickle {
            out: Vec::new(),
            max: 1 << 20,
        };
        let mut b = Trickle {
            out: Vec::new(),
            max: 1 << 20,
        };
        by_push.flush_to(&mut a).await.unwrap();
        by_peer.flush_to(&mut b).await.unwrap();
        assert_eq!(a.out, b.out);
        // Too large: refused, nothing added.
        let big = forwarded(1, 1, Some(1), Some(put(Bytes::from(vec![0u8; 2000]))));
        let mut small = FrameWriter::new(1000, usize::MAX);
        assert!(matches!(
            small.push_peer(&big),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(small.is_empty());
    }

    #[test]
    fn a_large_payload_is_shared_not_copied() {
        let payload = Bytes::from(vec![5u8; 4096]);
        let mut w = FrameWriter::new(1 << 20, usize::MAX);
        w.push(&put(payload.clone())).unwrap();
        let shared = w
            .chunks
            .iter()
            .any(|c| c.as_ptr() == payload.as_ptr() && c.len() == payload.len());
        assert!(
            shared,
            "the payload is one of the chunks, at its own address"
        );
        let small = Bytes::from(vec![6u8; ZERO_COPY_MIN - 1]);
        let mut w = FrameWriter::new(1 << 20, usize::MAX);
        w.push(&put(small.clone())).unwrap();
        assert!(w.chunks.iter().all(|c| c.as_ptr() != small.as_ptr()));
    }

    #[test]
    fn an_oversized_message_is_refused_and_adds_nothing() {
        let mut w = FrameWriter::new(100, usize::MAX);
        w.push(&put(Bytes::from_static(b"fits"))).unwrap();
        let before = w.buffered();
        let err = w.push(&put(Bytes::from(vec![0u8; 200]))).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 100, .. }));
        assert_eq!(w.buffered(), before);
    }

    #[tokio::test]
    async fn a_sink_that_takes_nothing_is_an_error() {
        struct Full;
        impl AsyncWrite for Full {
            fn poll_write(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &[u8],
            ) -> Poll<std::io::Result<usize>> {
                Poll::Ready(Ok(0))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }
        let mut w = FrameWriter::new(1 << 20, usize::MAX);
        w.push(&put(Bytes::from_static(b"x"))).unwrap();
        let e = w.flush_to(&mut Full).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WriteZero);
    }
}
