//! Length-prefixed framing: a 4-byte big-endian body length, then one protobuf message.
//!
//! A frame whose declared length exceeds the configured maximum, or whose body does not decode,
//! is an error for that connection only: the caller logs the reason, counts it, and closes the
//! connection (DESIGN.md §8). Decoding never panics on any input.

use std::marker::PhantomData;

use bytes::{Buf, BufMut, BytesMut};
#[cfg(feature = "codec")]
use tokio_util::codec::{Decoder, Encoder};

/// Default maximum frame body size: 64 MiB.
pub const FRAME_SIZE_MAX_DEFAULT: usize = 64 * 1024 * 1024;

/// Bytes of the length prefix of every frame.
pub(crate) const LENGTH_PREFIX_BYTES: usize = 4;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The declared (or encoded) body length exceeds the maximum.
    #[error("frame of {length} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// Declared body length in bytes.
        length: usize,
        /// Configured maximum in bytes.
        max: usize,
    },
    /// The body is not a valid protobuf message of the expected type.
    #[error("frame body does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The underlying socket failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// A tokio-util codec for one prost message type `M` per frame.
#[derive(Debug)]
pub struct FrameCodec<M> {
    frame_size_max: usize,
    _message: PhantomData<fn() -> M>,
}

impl<M> Clone for FrameCodec<M> {
    fn clone(&self) -> Self {
        Self::new(self.frame_size_max)
    }
}

impl<M> FrameCodec<M> {
    /// A codec that refuses frames whose body exceeds `frame_size_max` bytes.
    pub fn new(frame_size_max: usize) -> Self {
        Self {
            frame_size_max,
            _message: PhantomData,
        }
    }
}

impl<M: prost::Message + Default> FrameCodec<M> {
    /// Takes one frame off the front of `src`: `Ok(None)` until a whole frame is there,
    /// [`FrameError::TooLarge`] as soon as the length prefix exceeds the maximum, and
    /// [`FrameError::Decode`] for a body that is not an `M`. Never panics.
    pub fn decode_frame(&self, src: &mut BytesMut) -> Result<Option<M>, FrameError> {
        if src.len() < LENGTH_PREFIX_BYTES {
            reserve_read_space(src);
            return Ok(None);
        }
        let length = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if length > self.frame_size_max {
            return Err(FrameError::TooLarge {
                length,
                max: self.frame_size_max,
            });
        }
        if src.len() < LENGTH_PREFIX_BYTES + length {
            src.reserve(LENGTH_PREFIX_BYTES + length - src.len());
            reserve_read_space(src);
            return Ok(None);
        }
        src.advance(LENGTH_PREFIX_BYTES);
        let body = src.split_to(length).freeze();
        Ok(Some(M::decode(body)?))
    }
}

/// Room one read of a connection may fill, bytes: with at least this much free in the read
/// buffer, a read takes in many small frames at once (a batch of 1 KiB messages) instead of
/// the 8 KiB a reader starts with. It is also what an idle connection's read buffer holds (64
/// MiB for the default `client_sessions_max` of 1,024 idle clients).
pub const READ_SPACE_BYTES: usize = 64 * 1024;

/// Makes room for at least [`READ_SPACE_BYTES`] more bytes in `src` before the next read.
fn reserve_read_space(src: &mut BytesMut) {
    if src.capacity() - src.len() < READ_SPACE_BYTES / 2 {
        src.reserve(READ_SPACE_BYTES);
    }
}

impl<M: prost::Message> FrameCodec<M> {
    /// Appends `item` as one frame to `dst`; [`FrameError::TooLarge`] when its body exceeds
    /// the maximum.
    pub fn encode_frame(&self, item: &M, dst: &mut BytesMut) -> Result<(), FrameError> {
        let length = item.encoded_len();
        if length > self.frame_size_max {
            return Err(FrameError::TooLarge {
                length,
                max: self.frame_size_max,
            });
        }
        dst.reserve(LENGTH_PREFIX_BYTES + length);
        dst.put_u32(length as u32);
        item.encode(dst).expect("reserved capacity is sufficient");
        Ok(())
    }
}

#[cfg(feature = "codec")]
impl<M: prost::Message + Default> Decoder for FrameCodec<M> {
    type Item = M;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<M>, FrameError> {
        self.decode_frame(src)
    }
}

#[cfg(feature = "codec")]
impl<M: prost::Message> Encoder<M> for FrameCodec<M> {
    type Error = FrameError;

    fn encode(&mut self, item: M, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.encode_frame(&item, dst)
    }
}

#[cfg(all(test, feature = "codec"))]
mod tests {
    use super::*;
    use crate::client::{client_message::Kind, ClientMessage, Put};

    fn put(payload: &[u8]) -> ClientMessage {
        ClientMessage {
            kind: Some(Kind::Put(Put {
                uri: "bmq://bmq.test/q".into(),
                guid: vec![7u8; 16].into(),
                payload: payload.to_vec().into(),
                properties: vec![],
            })),
        }
    }

    /// A message encoded then decoded comes back equal, also when it arrives byte by byte.
    #[test]
    fn round_trip_byte_by_byte() {
        let mut codec = FrameCodec::<ClientMessage>::new(1024);
        let mut wire = BytesMut::new();
        codec.encode(put(b"hello"), &mut wire).unwrap();
        let mut src = BytesMut::new();
        let mut out = None;
        for b in wire.iter() {
            assert!(out.is_none());
            src.put_u8(*b);
            out = codec.decode(&mut src).unwrap();
        }
        assert_eq!(out, Some(put(b"hello")));
        assert!(src.is_empty());
    }

    /// A declared length above the maximum is refused before the body is read.
    #[test]
    fn oversized_frame_is_refused() {
        let mut codec = FrameCodec::<ClientMessage>::new(16);
        let mut src = BytesMut::new();
        src.put_u32(17);
        assert!(matches!(
            codec.decode(&mut src),
            Err(FrameError::TooLarge {
                length: 17,
                max: 16
            })
        ));
        assert!(matches!(
            codec.encode(put(&[0u8; 64]), &mut BytesMut::new()),
            Err(FrameError::TooLarge { .. })
        ));
    }

    /// Garbage that is not a protobuf message is a decode error, not a panic.
    #[test]
    fn garbage_body_is_a_decode_error() {
        let mut codec = FrameCodec::<ClientMessage>::new(1024);
        let mut src = BytesMut::new();
        src.put_u32(4);
        src.put_slice(&[0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(codec.decode(&mut src), Err(FrameError::Decode(_))));
    }
}
