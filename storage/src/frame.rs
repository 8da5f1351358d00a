//! The record frame of every file this crate's users append to — the partition journal's
//! segments ([`crate::store`]) and the metadata ledger (`bmq-metadata`'s `ledger`):
//!
//! ```text
//! | body length: u32 LE | CRC32C of the body: u32 LE | body |
//! ```
//!
//! A frame is checked whole before its body is read: a reader never decodes bytes whose
//! checksum does not match. What a damaged frame means (a torn tail to cut, or corruption to
//! report with file and offset) is the file's own rule, since it depends on where the frame
//! is; [`read`] says only what is wrong with it ([`Damage`]).
//!
//! CRC32C (Castagnoli) as in BlazingMQ's journal, etcd's WAL and ext4's metadata: computed in
//! hardware on current CPUs.

use std::fmt;

/// Bytes of a frame's header (length and checksum).
pub const HEADER_LEN: usize = 8;

/// What is wrong with the bytes where a frame was expected ([`read`], [`check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// Fewer bytes than a header.
    ShortHeader,
    /// A length of zero: no record encodes to an empty body (an empty body's checksum is 0),
    /// so a zero header is a region of the file never written.
    ZeroLength,
    /// A length above the reader's maximum, bytes.
    TooLong(usize),
    /// The length says the body runs past the bytes given (the frame's length, header
    /// included).
    Truncated(usize),
    /// The body's checksum does not match its header (the frame's length, header included).
    Checksum(usize),
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::ShortHeader => f.write_str("incomplete record header"),
            Damage::ZeroLength => f.write_str("zero-filled region (never written)"),
            Damage::TooLong(len) => write!(f, "record length {len} over the maximum"),
            Damage::Truncated(_) => f.write_str("incomplete record body"),
            Damage::Checksum(_) => f.write_str("checksum mismatch"),
        }
    }
}

/// Starts a frame at the end of `buf`: reserves its header, which [`finish`] fills once the
/// body follows it. Returns where the frame starts.
pub fn begin<B>(buf: &mut B) -> usize
where
    B: bytes::BufMut + std::ops::Deref<Target = [u8]>,
{
    let start = buf.len();
    buf.put_slice(&[0; HEADER_LEN]);
    start
}

/// Fills the header of the frame that starts at `start` in `buf` (from [`begin`], the body
/// written after it since). Returns the frame's length, header included.
///
/// # Panics
/// If `start` is not a frame's start in `buf` or the body is over `u32::MAX` bytes (a caller's
/// bug: every writer bounds its records far below).
pub fn finish(buf: &mut [u8], start: usize) -> usize {
    let body = &buf[start + HEADER_LEN..];
    let len = u32::try_from(body.len()).expect("a record body under 4 GiB");
    let crc = crc32c::crc32c(body);
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..start + HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    buf.len() - start
}

/// Appends `body` framed to `out`. Returns the frame's length, header included.
pub fn encode_into(out: &mut Vec<u8>, body: &[u8]) -> usize {
    let start = begin(out);
    out.extend_from_slice(body);
    finish(out, start)
}

/// The frame at the start of `bytes`: its body and its length (header included), if it is
/// whole and intact with a body of at most `max` bytes. Errors: what is wrong ([`Damage`]).
pub fn read(bytes: &[u8], max: usize) -> Result<(&[u8], usize), Damage> {
    let len = peek_len(bytes)?;
    if len == 0 {
        return Err(Damage::ZeroLength);
    }
    if len > max {
        return Err(Damage::TooLong(len));
    }
    let total = HEADER_LEN + len;
    if bytes.len() < total {
        return Err(Damage::Truncated(total));
    }
    check(&bytes[..total])?;
    Ok((&bytes[HEADER_LEN..total], total))
}

/// The body length a frame's header at the start of `bytes` gives, unchecked. Errors:
/// [`Damage::ShortHeader`].
pub fn peek_len(bytes: &[u8]) -> Result<usize, Damage> {
    let header = bytes.get(..HEADER_LEN).ok_or(Damage::ShortHeader)?;
    Ok(u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize)
}

/// Checks a frame read whole (its extent known from elsewhere, as an index's): its header is
/// there and its body's checksum matches. Errors: [`Damage::ShortHeader`],
/// [`Damage::Checksum`] (with `framed`'s length).
pub fn check(framed: &[u8]) -> Result<(), Damage> {
    if framed.len() < HEADER_LEN {
        return Err(Damage::ShortHeader);
    }
    let crc = u32::from_le_bytes(framed[4..HEADER_LEN].try_into().expect("4 bytes"));
    if crc32c::crc32c(&framed[HEADER_LEN..]) != crc {
        return Err(Damage::Checksum(framed.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_reads_back_and_every_damage_is_named() {
        let mut out = Vec::new();
        let len = encode_into(&mut out, b"hello");
        assert_eq!(len, HEADER_LEN + 5);
        out.extend_from_slice(b"trailing");
        assert_eq!(read(&out, 1024), Ok((&b"hello"[..], len)));

        assert_eq!(read(&out[..3], 1024), Err(Damage::ShortHeader));
        assert_eq!(read(&out[..len - 1], 1024), Err(Damage::Truncated(len)));
        assert_eq!(read(&out, 4), Err(Damage::TooLong(5)));
        assert_eq!(read(&[0; 16], 1024), Err(Damage::ZeroLength));
        let mut flipped = out.clone();
        flipped[HEADER_LEN + 1] ^= 0x10;
        assert_eq!(read(&flipped, 1024), Err(Damage::Checksum(len)));
        assert_eq!(check(&flipped[..len]), Err(Damage::Checksum(len)));
        assert_eq!(check(&out[..len]), Ok(()));
    }

    #[test]
    fn begin_and_finish_frame_a_body_written_in_place() {
        let mut buf = b"xy".to_vec();
        let start = begin(&mut buf);
        assert_eq!(start, 2);
        buf.extend_from_slice(b"body");
        assert_eq!(finish(&mut buf, start), HEADER_LEN + 4);
        let mut direct = b"xy".to_vec();
        encode_into(&mut direct, b"body");
        assert_eq!(buf, direct);
    }
}
