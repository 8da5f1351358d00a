//! Durable storage of the elector term (DESIGN.md §4, "where we go beyond BlazingMQ").
//!
//! The term is written and fsynced before the node supports a proposal or becomes a candidate,
//! so that a restarted node can never support two candidates in one term.
//!
//! File `elector-term`, 20 bytes: magic `b"BMQTERM1"` (8 bytes), the term (u64 little endian),
//! CRC-32 (IEEE) of the term bytes (u32 little endian). Updates go to `elector-term.tmp`, which
//! is fsynced, renamed over `elector-term`, and then the directory is fsynced.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use bmq_proto::Term;

/// Name of the term file inside the elector's directory.
pub const TERM_FILE_NAME: &str = "elector-term";
const TEMP_FILE_NAME: &str = "elector-term.tmp";
const MAGIC: &[u8; 8] = b"BMQTERM1";
const FILE_LEN: usize = 8 + 8 + 4;

/// The elector's term file. Owned by the elector actor; not shared.
#[derive(Debug)]
pub struct TermStore {
    dir: PathBuf,
    term: Term,
}

impl TermStore {
    /// Opens `dir/elector-term`, creating the directory and a file holding term 0 if absent.
    /// Returns the store and the persisted term.
    ///
    /// # Errors
    /// I/O errors, and `InvalidData` (naming the file) for a file with a wrong size, magic or
    /// checksum: a corrupt term file must stop the node, since guessing a term could let it
    /// vote twice.
    pub fn open(dir: &Path) -> io::Result<(TermStore, Term)> {
        fs::create_dir_all(dir)?;
        let path = dir.join(TERM_FILE_NAME);
        match fs::read(&path) {
            Ok(bytes) => {
                let term = decode(&bytes).map_err(|what| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("corrupt elector term file {}: {what}", path.display()),
                    )
                })?;
                Ok((
                    TermStore {
                        dir: dir.to_path_buf(),
                        term,
                    },
                    term,
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let mut store = TermStore {
                    dir: dir.to_path_buf(),
                    term: Term(0),
                };
                store.write(Term(0))?;
                Ok((store, Term(0)))
            }
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!("cannot read elector term file {}: {e}", path.display()),
            )),
        }
    }

    /// The last persisted term.
    pub fn term(&self) -> Term {
        self.term
    }

    /// Durably replaces the stored term: write a temp file, fsync, rename, fsync the directory.
    ///
    /// # Errors
    /// Any I/O error. The caller must stop the node (STYLE.md: never retry an fsync).
    ///
    /// # Panics
    /// If `term` is lower than the stored term: terms never go backwards (an internal
    /// invariant of the elector).
    pub fn persist(&mut self, term: Term) -> io::Result<()> {
        assert!(
            term >= self.term,
            "elector term regressed: stored {} new {}",
            self.term,
            term
        );
        self.write(term)
    }

    fn write(&mut self, term: Term) -> io::Result<()> {
        let temp = self.dir.join(TEMP_FILE_NAME);
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)?;
        file.write_all(&encode(term))?;
        file.sync_all()?;
        drop(file);
        fs::rename(&temp, self.dir.join(TERM_FILE_NAME))?;
        File::open(&self.dir)?.sync_all()?;
        self.term = term;
        Ok(())
    }
}

fn encode(term: Term) -> [u8; FILE_LEN] {
    let mut out = [0u8; FILE_LEN];
    out[..8].copy_from_slice(MAGIC);
    let term_bytes = term.0.to_le_bytes();
    out[8..16].copy_from_slice(&term_bytes);
    out[16..].copy_from_slice(&crc32(&term_bytes).to_le_bytes());
    out
}

fn decode(bytes: &[u8]) -> Result<Term, String> {
    if bytes.len() != FILE_LEN {
        return Err(format!("length {} instead of {FILE_LEN}", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("bad magic".to_string());
    }
    let term_bytes: [u8; 8] = bytes[8..16].try_into().expect("slice of 8 bytes");
    let stored: [u8; 4] = bytes[16..].try_into().expect("slice of 4 bytes");
    let (stored, computed) = (u32::from_le_bytes(stored), crc32(&term_bytes));
    if stored != computed {
        return Err(format!(
            "checksum {stored:#010x} instead of {computed:#010x}"
        ));
    }
    Ok(Term(u64::from_le_bytes(term_bytes)))
}

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), bitwise: the input is 8 bytes.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC matches the standard check value of CRC-32/ISO-HDLC.
    #[test]
    fn crc32_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    /// A fresh directory starts at term 0; a persisted term survives reopening.
    #[test]
    fn persist_then_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, term) = TermStore::open(dir.path()).unwrap();
        assert_eq!(term, Term(0));
        store.persist(Term(7)).unwrap();
        assert_eq!(store.term(), Term(7));
        drop(store);
        let (store, term) = TermStore::open(dir.path()).unwrap();
        assert_eq!(term, Term(7));
        assert_eq!(store.term(), Term(7));
        assert!(!dir.path().join(TEMP_FILE_NAME).exists());
    }

    /// A corrupted file is an InvalidData error naming the file, not a silent term 0.
    #[test]
    fn corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = TermStore::open(dir.path()).unwrap();
        store.persist(Term(3)).unwrap();
        let path = dir.path().join(TERM_FILE_NAME);
        let mut bytes = fs::read(&path).unwrap();
        bytes[9] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("elector-term"), "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");

        fs::write(&path, b"short").unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("length 5"), "{err}");
    }
}
