//! `EncodeBuf`: a [`BufMut`] adapter for encoding protobuf messages, whose one-byte writes are
//! stores into the buffer's spare capacity.
//!
//! prost writes every byte of a varint (each tag, length and integer field) with
//! `BufMut::put_u8`, which `bytes` implements as `put_slice(&[byte])`: for `BytesMut` and
//! `Vec<u8>` a capacity check and a call to `memmove` for one byte. Those calls showed in the
//! brokers' profile (`encode_varint`, `put_slice` and the `memmove`s under them;
//! docs/bench/JOURNAL.md "Replicas read frames in place, and fewer calls per frame").
//! Wrapping the buffer in an `EncodeBuf` writes the same bytes.

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut};

/// `buf`, with single bytes written in place (see the module doc). Every other write is
/// `buf`'s own.
pub struct EncodeBuf<'a, B: BufMut>(pub &'a mut B);

// SAFETY: every method delegates to `B`'s implementation, but `put_u8`, which writes the first
// byte of `B::chunk_mut()` before advancing over exactly that byte.
unsafe impl<B: BufMut> BufMut for EncodeBuf<'_, B> {
    fn remaining_mut(&self) -> usize {
        self.0.remaining_mut()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller's promise is passed on.
        unsafe { self.0.advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        self.0.chunk_mut()
    }

    fn put<T: Buf>(&mut self, src: T)
    where
        Self: Sized,
    {
        self.0.put(src)
    }

    fn put_slice(&mut self, src: &[u8]) {
        self.0.put_slice(src)
    }

    #[inline]
    fn put_u8(&mut self, n: u8) {
        let chunk = self.0.chunk_mut();
        if chunk.len() == 0 {
            // No room and no growth: `B` reports it its own way.
            return self.0.put_u8(n);
        }
        chunk.write_byte(0, n);
        // SAFETY: the first byte of `chunk_mut()` was initialised just above.
        unsafe { self.0.advance_mut(1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::{journal_record::Kind, JournalRecord, StoredMessage};
    use bytes::{Bytes, BytesMut};
    use prost::Message;

    #[test]
    fn writes_what_prost_writes() {
        let record = JournalRecord {
            lease: 300,
            sequence: u64::MAX,
            timestamp_ms: 1 << 40,
            kind: Some(Kind::Message(StoredMessage {
                uri: Bytes::from_static(b"bmq://d/q"),
                guid: Bytes::from(vec![7u8; 16]),
                payload: Bytes::from(vec![1u8; 1000]),
                properties: vec![],
            })),
        };
        let expected = record.encode_to_vec();
        // From empty buffers (each byte may grow them) and from full ones.
        let mut bytes = BytesMut::new();
        record.encode(&mut EncodeBuf(&mut bytes)).unwrap();
        assert_eq!(&bytes[..], &expected[..]);
        let mut vec = Vec::new();
        record.encode(&mut EncodeBuf(&mut vec)).unwrap();
        assert_eq!(vec, expected);
        let mut tight = BytesMut::with_capacity(3);
        tight.extend_from_slice(b"abc");
        record.encode(&mut EncodeBuf(&mut tight)).unwrap();
        assert_eq!(&tight[3..], &expected[..]);
        // A buffer that cannot grow: refused as prost refuses it.
        let mut small = [0u8; 10];
        let mut slice = &mut small[..];
        assert!(record.encode(&mut EncodeBuf(&mut slice)).is_err());
    }
}
