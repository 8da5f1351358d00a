//! The partition journal on disk: segmented, append-only, CRC32C-checked (DESIGN.md §7).
//!
//! Layout: `<dir>/journal-<n>.bmqj`, `n` = 1, 2, 3, ... (ten digits). Each segment starts with
//! an 8-byte header (`BMQJ` + format version, u32 little-endian), followed by records:
//!
//! ```text
//! | body length: u32 LE | CRC32C of body: u32 LE | body: protobuf `JournalRecord` |
//! ```
//!
//! Records carry consecutive sequences across segments (the first is 1). A new segment is
//! started when the current one has reached `segment_size_max` bytes.
//!
//! Recovery ([`Journal::open`]) reads every segment in order. A *torn tail* — an incomplete
//! record, or a last record whose checksum fails, at the very end of the last segment, as a
//! crash in the middle of a write leaves it — is truncated with a warning and counted in
//! `bmq_journal_torn_tail_truncations_total`. Anything else (a bad checksum followed by more
//! data, a bad header, a body that does not decode, a gap in the sequences) is corruption: an
//! error naming the file and byte offset, and the node refuses to start rather than serve a
//! journal it cannot trust.
//!
//! Not done yet: compaction (segments whose messages are all confirmed are never removed).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bmq_proto::peer::JournalRecord;
use prost::Message;
use tracing::warn;

/// Segment file header: magic `BMQJ` then the format version.
const MAGIC: &[u8; 4] = b"BMQJ";
/// Journal format version.
const VERSION: u32 = 1;
/// Bytes of a segment header.
const HEADER_LEN: u64 = 8;
/// Bytes of a record header (length + CRC32C).
const RECORD_HEADER_LEN: usize = 8;
/// The largest record body accepted, bytes; a longer length field is corruption.
pub const RECORD_SIZE_MAX: usize = 64 * 1024 * 1024;

/// What can go wrong with a journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A read, write, fsync or directory operation failed.
    #[error("journal i/o on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The journal holds data that is not a valid record where one must be.
    #[error("journal corrupt in {path} at byte offset {offset}: {reason}")]
    Corrupt {
        /// The segment file.
        path: PathBuf,
        /// Byte offset of the bad record (or header) in that file.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// An append out of order: `expected` was the next sequence.
    #[error("journal append out of order: expected sequence {expected}, got {got}")]
    OutOfOrder {
        /// The next sequence the journal expects.
        expected: u64,
        /// The sequence of the record offered.
        got: u64,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An open journal, positioned for appending (see the module doc).
pub struct Journal {
    dir: PathBuf,
    segment_size_max: u64,
    /// Segment numbers, ascending.
    segments: Vec<u32>,
    /// Where record `sequence` starts: `index[sequence - 1] = (segment number, byte offset)`.
    index: Vec<(u32, u64)>,
    file: File,
    /// Bytes in the current (last) segment.
    file_len: u64,
    bytes_total: u64,
}

fn segment_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("journal-{n:010}.bmqj"))
}

impl Journal {
    /// Opens (or creates) the journal in `dir` and returns it with every record it holds, in
    /// order. Truncates a torn tail; corruption anywhere else is [`JournalError::Corrupt`].
    pub fn open(
        dir: &Path,
        segment_size_max: u64,
    ) -> Result<(Journal, Vec<JournalRecord>), JournalError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut segments: Vec<u32> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name
                .strip_prefix("journal-")
                .and_then(|s| s.strip_suffix(".bmqj"))
                .and_then(|s| s.parse::<u32>().ok())
            {
                segments.push(n);
            }
        }
        segments.sort_unstable();
        let mut records = Vec::new();
        let mut index = Vec::new();
        let mut bytes_total = 0;
        let last = segments.last().copied();
        for &n in &segments {
            let path = segment_path(dir, n);
            let valid_len = read_segment(&path, n, Some(n) == last, &mut records, &mut index)?;
            bytes_total += valid_len;
        }
        let (file, file_len) = match last {
            Some(n) => {
                let path = segment_path(dir, n);
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(io(&path))?;
                let len = file.metadata().map_err(io(&path))?.len();
                (file, len)
            }
            None => {
                segments.push(1);
                (create_segment(dir, 1)?, HEADER_LEN)
            }
        };
        let mut journal = Journal {
            dir: dir.to_path_buf(),
            segment_size_max: segment_size_max.max(HEADER_LEN + 1),
            segments,
            index,
            file,
            file_len,
            bytes_total: bytes_total.max(HEADER_LEN),
        };
        journal.seek_end()?;
        Ok((journal, records))
    }

    fn current_path(&self) -> PathBuf {
        segment_path(&self.dir, *self.segments.last().expect("a segment is open"))
    }

    fn seek_end(&mut self) -> Result<(), JournalError> {
        let path = self.current_path();
        self.file
            .seek(SeekFrom::Start(self.file_len))
            .map_err(io(&path))?;
        Ok(())
    }

    /// The last sequence held (0 when empty).
    pub fn last_sequence(&self) -> u64 {
        self.index.len() as u64
    }

    /// Bytes on disk, all segments.
    pub fn bytes(&self) -> u64 {
        self.bytes_total
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Appends `records` (consecutive, following the last one held). Not durable until
    /// [`Journal::sync`].
    pub fn append(&mut self, records: &[JournalRecord]) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        for record in records {
            let expected = self.last_sequence() + 1;
            if record.sequence != expected {
                return Err(JournalError::OutOfOrder {
                    expected,
                    got: record.sequence,
                });
            }
            if self.file_len >= self.segment_size_max {
                self.flush_buf(&mut buf)?;
                self.roll_over()?;
            }
            let body = record.encode_to_vec();
            let offset = self.file_len + buf.len() as u64;
            buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
            buf.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
            buf.extend_from_slice(&body);
            let segment = *self.segments.last().expect("a segment is open");
            self.index.push((segment, offset));
            if self.file_len + buf.len() as u64 >= self.segment_size_max {
                self.flush_buf(&mut buf)?;
            }
        }
        self.flush_buf(&mut buf)
    }

    fn flush_buf(&mut self, buf: &mut Vec<u8>) -> Result<(), JournalError> {
        if buf.is_empty() {
            return Ok(());
        }
        let path = self.current_path();
        self.file.write_all(buf).map_err(io(&path))?;
        self.file_len += buf.len() as u64;
        self.bytes_total += buf.len() as u64;
        metrics::counter!("bmq_journal_written_bytes_total").increment(buf.len() as u64);
        buf.clear();
        Ok(())
    }

    fn roll_over(&mut self) -> Result<(), JournalError> {
        let path = self.current_path();
        self.file.sync_data().map_err(io(&path))?;
        let next = self.segments.last().expect("a segment is open") + 1;
        self.file = create_segment(&self.dir, next)?;
        self.segments.push(next);
        self.file_len = HEADER_LEN;
        self.bytes_total += HEADER_LEN;
        metrics::counter!("bmq_journal_rollovers_total").increment(1);
        Ok(())
    }

    /// Makes everything appended so far durable (fsync of the current segment).
    pub fn sync(&mut self) -> Result<(), JournalError> {
        let path = self.current_path();
        self.file.sync_data().map_err(io(&path))
    }

    /// Drops every record after `sequence` (durably). A no-op when `sequence` is the last.
    pub fn truncate_after(&mut self, sequence: u64) -> Result<(), JournalError> {
        if sequence >= self.last_sequence() {
            return Ok(());
        }
        let (segment, offset) = self.index[sequence as usize];
        self.index.truncate(sequence as usize);
        while *self.segments.last().expect("a segment is open") > segment {
            let n = self.segments.pop().expect("checked");
            let path = segment_path(&self.dir, n);
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            self.bytes_total = self.bytes_total.saturating_sub(len);
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
        let path = self.current_path();
        self.file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        let len = self.file.metadata().map_err(io(&path))?.len();
        self.file.set_len(offset).map_err(io(&path))?;
        self.file.sync_all().map_err(io(&path))?;
        self.bytes_total = self.bytes_total.saturating_sub(len - offset);
        self.file_len = offset;
        self.seek_end()
    }
}

fn create_segment(dir: &Path, n: u32) -> Result<File, JournalError> {
    let path = segment_path(dir, n);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(io(&path))?;
    let mut header = [0u8; HEADER_LEN as usize];
    header[..4].copy_from_slice(MAGIC);
    header[4..].copy_from_slice(&VERSION.to_le_bytes());
    file.write_all(&header).map_err(io(&path))?;
    file.sync_all().map_err(io(&path))?;
    // The directory entry must be durable too, or the segment may vanish after a crash.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(file)
}

/// Reads segment `n` at `path` into `records`/`index`; returns its valid length in bytes.
fn read_segment(
    path: &Path,
    n: u32,
    is_last: bool,
    records: &mut Vec<JournalRecord>,
    index: &mut Vec<(u32, u64)>,
) -> Result<u64, JournalError> {
    let mut data = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(io(path))?;
    let corrupt = |offset: u64, reason: String| JournalError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    if data.len() < HEADER_LEN as usize {
        if is_last {
            // Crashed while creating the segment: rewrite its header.
            warn!(path = %path.display(), "journal segment without a complete header: rewriting it");
            let dir = path.parent().unwrap_or(Path::new("."));
            create_segment(dir, n)?;
            return Ok(HEADER_LEN);
        }
        return Err(corrupt(0, "segment shorter than its header".into()));
    }
    if &data[..4] != MAGIC {
        return Err(corrupt(0, "bad magic (not a journal segment)".into()));
    }
    let version = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(corrupt(4, format!("unsupported format version {version}")));
    }
    let mut pos = HEADER_LEN as usize;
    while pos < data.len() {
        let torn = |reason: &str| -> Result<u64, JournalError> {
            if !is_last {
                return Err(corrupt(pos as u64, reason.to_string()));
            }
            warn!(path = %path.display(), offset = pos, %reason, "journal torn tail truncated");
            metrics::counter!("bmq_journal_torn_tail_truncations_total").increment(1);
            let file = OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(io(path))?;
            file.set_len(pos as u64).map_err(io(path))?;
            file.sync_all().map_err(io(path))?;
            Ok(pos as u64)
        };
        if data.len() - pos < RECORD_HEADER_LEN {
            return torn("incomplete record header");
        }
        let len = u32::from_le_bytes(data[pos..pos + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(data[pos + 4..pos + 8].try_into().expect("4 bytes"));
        let body_start = pos + RECORD_HEADER_LEN;
        if len > RECORD_SIZE_MAX {
            if body_start + len > data.len() {
                return torn("record length beyond the end of the file");
            }
            return Err(corrupt(
                pos as u64,
                format!("record length {len} over the maximum"),
            ));
        }
        if body_start + len > data.len() {
            return torn("incomplete record body");
        }
        let body = &data[body_start..body_start + len];
        if crc32c::crc32c(body) != crc {
            if body_start + len == data.len() {
                return torn("checksum mismatch on the last record");
            }
            return Err(corrupt(pos as u64, "checksum mismatch".into()));
        }
        let record = JournalRecord::decode(body)
            .map_err(|e| corrupt(pos as u64, format!("record does not decode: {e}")))?;
        let expected = records.len() as u64 + 1;
        if record.sequence != expected {
            return Err(corrupt(
                pos as u64,
                format!("sequence {} where {expected} was expected", record.sequence),
            ));
        }
        index.push((n, pos as u64));
        records.push(record);
        pos = body_start + len;
    }
    Ok(pos as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bmq_proto::peer::{journal_record::Kind, StoredMessage};

    fn record(lease: u64, sequence: u64, payload: &str) -> JournalRecord {
        JournalRecord {
            lease,
            sequence,
            timestamp_ms: 7,
            kind: Some(Kind::Message(StoredMessage {
                uri: "bmq://d/q".into(),
                guid: vec![sequence as u8; 16].into(),
                payload: payload.as_bytes().to_vec().into(),
                properties: vec![],
            })),
        }
    }

    fn records(from: u64, to: u64) -> Vec<JournalRecord> {
        (from..=to).map(|s| record(1, s, "payload")).collect()
    }

    #[test]
    fn round_trip_across_reopen() {
        // Records appended and synced come back identical, in order, after a reopen.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, got) = Journal::open(dir.path(), 1 << 20).unwrap();
        assert!(got.is_empty());
        j.append(&records(1, 10)).unwrap();
        j.sync().unwrap();
        drop(j);
        let (j, got) = Journal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(got, records(1, 10));
        assert_eq!(j.last_sequence(), 10);
    }

    #[test]
    fn out_of_order_append_is_refused() {
        // A gap in the sequences is a programmer error reported as OutOfOrder.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), 1 << 20).unwrap();
        let err = j.append(&records(2, 2)).unwrap_err();
        assert!(matches!(
            err,
            JournalError::OutOfOrder {
                expected: 1,
                got: 2
            }
        ));
    }

    #[test]
    fn torn_tail_is_truncated() {
        // A crash mid-write leaves half a record at the end: it is dropped, the rest kept, and
        // appending continues after the last whole record.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), 1 << 20).unwrap();
        j.append(&records(1, 5)).unwrap();
        j.sync().unwrap();
        drop(j);
        let path = segment_path(dir.path(), 1);
        let len = std::fs::metadata(&path).unwrap().len();
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 3).unwrap();
        drop(f);
        let (mut j, got) = Journal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(got, records(1, 4));
        j.append(&records(5, 6)).unwrap();
        j.sync().unwrap();
        drop(j);
        let (_, got) = Journal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(got, records(1, 6));
    }

    #[test]
    fn corruption_mid_file_names_file_and_offset() {
        // A flipped byte inside the second record (with records after it) is corruption, not
        // a torn tail: open fails naming the segment and the record's offset.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), 1 << 20).unwrap();
        j.append(&records(1, 3)).unwrap();
        j.sync().unwrap();
        let second = j.index[1].1;
        drop(j);
        let path = segment_path(dir.path(), 1);
        let mut data = std::fs::read(&path).unwrap();
        data[second as usize + RECORD_HEADER_LEN + 2] ^= 0xff;
        std::fs::write(&path, &data).unwrap();
        match Journal::open(dir.path(), 1 << 20) {
            Err(JournalError::Corrupt {
                path: p, offset, ..
            }) => {
                assert_eq!(p, path);
                assert_eq!(offset, second);
            }
            Err(other) => panic!("expected Corrupt, got {other}"),
            Ok(_) => panic!("expected Corrupt, got Ok"),
        }
    }

    #[test]
    fn segments_roll_over_and_recover() {
        // With a tiny segment size, every few records start a new file; reopening reads all
        // segments in order.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), 200).unwrap();
        j.append(&records(1, 20)).unwrap();
        j.sync().unwrap();
        assert!(j.segment_count() > 3, "segments: {}", j.segment_count());
        let count = j.segment_count();
        drop(j);
        let (j, got) = Journal::open(dir.path(), 200).unwrap();
        assert_eq!(got, records(1, 20));
        assert_eq!(j.segment_count(), count);
    }

    #[test]
    fn truncate_after_drops_later_records_and_segments() {
        // Truncation (healing drops unacknowledged records of an older lease) removes later
        // segments and the tail of the one holding the cut point; appends continue from it.
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), 200).unwrap();
        j.append(&records(1, 20)).unwrap();
        j.sync().unwrap();
        j.truncate_after(7).unwrap();
        assert_eq!(j.last_sequence(), 7);
        let replacement: Vec<_> = (8..=9).map(|s| record(2, s, "new")).collect();
        j.append(&replacement).unwrap();
        j.sync().unwrap();
        drop(j);
        let (_, got) = Journal::open(dir.path(), 200).unwrap();
        let mut expected = records(1, 7);
        expected.extend(replacement);
        assert_eq!(got, expected);
    }
}
