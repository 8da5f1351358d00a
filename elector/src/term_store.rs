//! Durable storage of the elector term (DESIGN.md §4, "where we go beyond BlazingMQ").
//!
//! The term is written and fsynced before the node supports a proposal or becomes a candidate,
//! so that a restarted node can never support two candidates in one term.
//!
//! File `elector-term`, 24 bytes: magic `b"BMQTERM2"` (8 bytes), then the term (u64 little
//! endian) in the storage floor's record frame ([`bmq_storage::frame`]: body length, CRC32C,
//! body), the frame of the journal and the metadata ledger. Updates go to `elector-term.tmp`,
//! which is fsynced, renamed over `elector-term`, and then the directory is fsynced. A file of
//! the first format (20 bytes: magic `b"BMQTERM1"`, the term, CRC-32 (IEEE) of the term) is
//! read too; the next update writes the current format.
//!
//! **Files** are the storage floor's ([`bmq_storage::disk`], DESIGN.md §2): [`TermStore::open`]
//! opens the operating system's ([`RealDisk`]), [`TermStore::open_on`] any [`Disk`] — the
//! simulators' disk in memory, which loses at a power loss what no fsync made durable.
//!
//! **A failed write or fsync fails the store** for good (STYLE.md: a write or fsync failure
//! stops the node; never retry an fsync). An fsync that failed says nothing about what it
//! covered, and Linux does not write those pages again at a later fsync (PostgreSQL's
//! "fsyncgate"), so the term it was to make durable is never reported persisted: the caller
//! does not tell the elector `on_term_persisted`, so it neither votes nor campaigns in that
//! term, and every later [`TermStore::persist`] is refused without touching the disk.
//! Reopening the store after a restart reads what the disk holds.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bmq_proto::Term;
use bmq_storage::disk::{Disk, Open, RealDisk};
use bmq_storage::frame;

/// Name of the term file inside the elector's directory.
pub const TERM_FILE_NAME: &str = "elector-term";
const TEMP_FILE_NAME: &str = "elector-term.tmp";
const MAGIC: &[u8; 8] = b"BMQTERM2";
const FILE_LEN: usize = 8 + frame::HEADER_LEN + 8;
/// The first format's magic and length (read only).
const MAGIC_V1: &[u8; 8] = b"BMQTERM1";
const FILE_LEN_V1: usize = 8 + 8 + 4;

/// The elector's term file. Owned by the elector actor; not shared.
#[derive(Debug)]
pub struct TermStore {
    /// The disk the file is on.
    disk: Arc<dyn Disk>,
    dir: PathBuf,
    term: Term,
    /// The first failed write or fsync (its error's text): the store takes nothing more.
    failed: Option<String>,
}

impl TermStore {
    /// Opens `dir/elector-term` on the operating system's files: [`TermStore::open_on`] with
    /// [`RealDisk`].
    ///
    /// # Errors
    /// As [`TermStore::open_on`].
    pub fn open(dir: &Path) -> io::Result<(TermStore, Term)> {
        TermStore::open_on(Arc::new(RealDisk), dir)
    }

    /// Opens `dir/elector-term` on `disk`, creating the directory and a file holding term 0 if
    /// absent. Returns the store and the persisted term.
    ///
    /// # Errors
    /// I/O errors, and `InvalidData` (naming the file) for a file with a wrong size, magic or
    /// checksum: a corrupt term file must stop the node, since guessing a term could let it
    /// vote twice.
    pub fn open_on(disk: Arc<dyn Disk>, dir: &Path) -> io::Result<(TermStore, Term)> {
        disk.create_dir_all(dir)?;
        let path = dir.join(TERM_FILE_NAME);
        let mut store = TermStore {
            disk,
            dir: dir.to_path_buf(),
            term: Term(0),
            failed: None,
        };
        match store.disk.open(&path, Open::Read) {
            Ok(file) => {
                // At most one byte more than a term file: anything longer is corrupt
                // whatever follows, and is not read into memory.
                let bytes = file.read_up_to(FILE_LEN as u64 + 1).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("cannot read elector term file {}: {e}", path.display()),
                    )
                })?;
                let term = decode(&bytes).map_err(|what| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("corrupt elector term file {}: {what}", path.display()),
                    )
                })?;
                store.term = term;
                Ok((store, term))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
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

    /// The first failed write or fsync (its error's text), once the store failed.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Durably replaces the stored term: write a temp file, fsync, rename, fsync the directory.
    /// Only once it returns `Ok` may the caller tell the elector `on_term_persisted`.
    ///
    /// # Errors
    /// Any I/O error, which fails the store: the term is not persisted (and may or may not be
    /// on disk). Once failed, every call is refused with an error naming the first failure,
    /// without touching the disk. The caller must stop the node (STYLE.md: never retry an
    /// fsync).
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
        if let Some(cause) = &self.failed {
            return Err(io::Error::other(format!(
                "elector term store failed earlier and takes nothing more: {cause}"
            )));
        }
        match self.write_file(term) {
            Ok(()) => {
                self.term = term;
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn write_file(&self, term: Term) -> io::Result<()> {
        let temp = self.dir.join(TEMP_FILE_NAME);
        let file = self.disk.open(&temp, Open::Create)?;
        file.write_all_at(&encode(term), 0)?;
        file.sync_all()?;
        drop(file);
        self.disk.rename(&temp, &self.dir.join(TERM_FILE_NAME))?;
        self.disk.sync_dir(&self.dir)
    }
}

fn encode(term: Term) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    frame::encode_into(&mut out, &term.0.to_le_bytes());
    debug_assert_eq!(out.len(), FILE_LEN);
    out
}

fn decode(bytes: &[u8]) -> Result<Term, String> {
    if bytes.starts_with(MAGIC_V1) {
        return decode_v1(bytes);
    }
    check_len(bytes, FILE_LEN)?;
    if &bytes[..8] != MAGIC {
        return Err("bad magic".to_string());
    }
    match frame::read(&bytes[8..], 8) {
        Ok((body, _)) if body.len() == 8 => {
            Ok(Term(u64::from_le_bytes(body.try_into().expect("8 bytes"))))
        }
        Ok((body, _)) => Err(format!("a term of {} bytes", body.len())),
        Err(damage) => Err(damage.to_string()),
    }
}

/// Errors unless `bytes` is `expected` long (the file is read up to one byte more).
fn check_len(bytes: &[u8], expected: usize) -> Result<(), String> {
    if bytes.len() == expected {
        return Ok(());
    }
    let len = if bytes.len() > expected {
        format!("more than {expected}")
    } else {
        bytes.len().to_string()
    };
    Err(format!("length {len} instead of {expected}"))
}

/// [`decode`] of the first format.
fn decode_v1(bytes: &[u8]) -> Result<Term, String> {
    check_len(bytes, FILE_LEN_V1)?;
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

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), bitwise: the input is 8 bytes (the
/// first format's checksum).
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
    use std::fs;
    use std::time::{Duration, Instant};

    use bmq_proto::peer::elector_message::Kind;
    use bmq_proto::peer::{ElectionProposal, ElectionScoutingResponse, ElectorMessage};
    use bmq_proto::NodeId;
    use bmq_storage::disk::{Faults, SimDisk};

    use super::*;
    use crate::{Elector, ElectorConfig, ElectorOutput, ElectorState};

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
        bytes[8 + frame::HEADER_LEN + 1] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("elector-term"), "{err}");
        assert!(err.to_string().contains("checksum"), "{err}");

        fs::write(&path, b"short").unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("length 5"), "{err}");

        fs::write(&path, [0u8; 4096]).unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("more than 24"), "{err}");

        // Every single flipped bit of a term file is refused.
        store.persist(Term(5)).unwrap();
        let good = fs::read(&path).unwrap();
        for bit in 0..good.len() * 8 {
            let mut bytes = good.clone();
            bytes[bit / 8] ^= 1 << (bit % 8);
            fs::write(&path, &bytes).unwrap();
            let err = TermStore::open(dir.path()).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "bit {bit}: {err}");
        }
    }

    /// A term file of the first format (an older build's) is read; the next update writes the
    /// current one.
    #[test]
    fn a_term_file_of_the_first_format_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TERM_FILE_NAME);
        let mut v1 = MAGIC_V1.to_vec();
        v1.extend_from_slice(&9u64.to_le_bytes());
        v1.extend_from_slice(&crc32(&9u64.to_le_bytes()).to_le_bytes());
        fs::write(&path, &v1).unwrap();
        let (mut store, term) = TermStore::open(dir.path()).unwrap();
        assert_eq!(term, Term(9));
        store.persist(Term(10)).unwrap();
        assert_eq!(&fs::read(&path).unwrap()[..8], MAGIC);
        let (_, term) = TermStore::open(dir.path()).unwrap();
        assert_eq!(term, Term(10));
        v1[9] ^= 1;
        fs::write(&path, &v1).unwrap();
        let err = TermStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
    }

    /// The store in `/elector` on the simulated disk `disk`.
    fn open_sim(disk: &SimDisk) -> (TermStore, Term) {
        TermStore::open_on(Arc::new(disk.clone()), Path::new("/elector")).unwrap()
    }

    /// Fails the next `n` fsyncs of `disk`.
    fn fail_fsyncs(disk: &SimDisk, n: u32) {
        disk.set_faults(Faults {
            fsyncs_failing: n,
            ..Faults::default()
        });
    }

    /// On the simulated disk, a persisted term survives a power loss (the file and its name
    /// were fsynced), torn or not.
    #[test]
    fn on_a_simulated_disk_a_persisted_term_survives_a_power_loss() {
        let disk = SimDisk::new();
        let (mut store, term) = open_sim(&disk);
        assert_eq!(term, Term(0));
        store.persist(Term(4)).unwrap();
        store.persist(Term(5)).unwrap();
        drop(store);
        disk.power_loss(|sizes| (sizes.len(), Some(0)));
        assert_eq!(open_sim(&disk).1, Term(5));
    }

    /// A failed fsync of the term fails the store: the term is not reported persisted, every
    /// later persist is refused without an fsync (none is retried), and after a power loss
    /// the disk holds the term persisted before.
    #[test]
    fn a_failed_fsync_fails_the_store_and_the_term_is_not_persisted() {
        let disk = SimDisk::new();
        let (mut store, _) = open_sim(&disk);
        store.persist(Term(2)).unwrap();
        fail_fsyncs(&disk, 1);
        let fsyncs = disk.fsync_counts().0;
        let err = store.persist(Term(3)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(5), "{err}");
        assert_eq!(store.term(), Term(2), "not counted");
        assert!(store.failure().is_some());
        let refused = store.persist(Term(3)).unwrap_err();
        assert!(refused.to_string().contains("failed earlier"), "{refused}");
        assert_eq!(disk.fsync_counts().0, fsyncs + 1, "no fsync retried");
        drop(store);
        disk.power_loss(|sizes| (sizes.len(), None));
        assert_eq!(open_sim(&disk).1, Term(2));
    }

    fn n(id: u32) -> NodeId {
        NodeId(id)
    }

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn m(kind: Kind) -> ElectorMessage {
        ElectorMessage { kind: Some(kind) }
    }

    /// Node 1 of 3 with exact deadlines, from term 0.
    fn node_1() -> Elector {
        let config = ElectorConfig {
            random_wait_max: Duration::ZERO,
            ..Default::default()
        };
        Elector::new(n(1), &[n(2), n(3)], config, Term(0), 7)
    }

    /// The elector actor's handling of the core's outputs, on `store`: a term is confirmed
    /// with `on_term_persisted` only once persisted; a failed persist stops the node (nothing
    /// more is executed). Returns the other outputs executed and whether the node stopped.
    fn execute(
        core: &mut Elector,
        store: &mut TermStore,
        now: Instant,
    ) -> (Vec<ElectorOutput>, bool) {
        let mut executed = Vec::new();
        while let Some(output) = core.poll_output() {
            match output {
                ElectorOutput::PersistTerm { term } => match store.persist(term) {
                    Ok(()) => core.on_term_persisted(now, term),
                    Err(_) => return (executed, true),
                },
                other => executed.push(other),
            }
        }
        (executed, false)
    }

    /// Whether `outputs` hold a vote (`ElectionResponse`) or a candidacy (`ElectionProposal`)
    /// for `term`.
    fn votes_or_campaigns(outputs: &[ElectorOutput], term: u64) -> bool {
        outputs.iter().any(|o| match o {
            ElectorOutput::Send { message, .. } | ElectorOutput::Broadcast { message } => {
                matches!(&message.kind, Some(Kind::ElectionResponse(r)) if r.term == term)
                    || matches!(&message.kind, Some(Kind::Proposal(p)) if p.term == term)
            }
            _ => false,
        })
    }

    /// A follower asked to support a proposal of term 1, and a node whose scouting succeeded
    /// and that would propose term 1: when the fsync of term 1 fails, the node stops without
    /// voting or campaigning, is never a candidate, and term 1 is not on disk after a power
    /// loss. With the fsync succeeding, the same steps vote and campaign (the check can fail).
    #[test]
    fn no_vote_and_no_candidacy_in_a_term_whose_fsync_failed() {
        for failing in [true, false] {
            // Support: a leaderless follower receives a proposal of a higher term.
            let disk = SimDisk::new();
            let (mut store, term) = open_sim(&disk);
            let t = Instant::now();
            let mut core = node_1();
            core.start(t);
            assert!(!execute(&mut core, &mut store, t).1);
            if failing {
                fail_fsyncs(&disk, 1);
            }
            let proposal = ElectionProposal {
                term: term.0 + 1,
                membership_epoch: 0,
            };
            core.handle_message(at(t, 10), n(2), m(Kind::Proposal(proposal)));
            let (executed, stopped) = execute(&mut core, &mut store, at(t, 10));
            assert_eq!(stopped, failing);
            assert_eq!(votes_or_campaigns(&executed, 1), !failing, "{executed:?}");
            drop(store);
            disk.power_loss(|sizes| (sizes.len(), None));
            assert_eq!(open_sim(&disk).1, Term(u64::from(!failing)));

            // Candidacy: the initial wait ends, the scouting gets a quorum.
            let disk = SimDisk::new();
            let (mut store, _) = open_sim(&disk);
            let mut core = node_1();
            core.start(t);
            core.handle_timeout(at(t, 500));
            assert!(!execute(&mut core, &mut store, at(t, 500)).1);
            if failing {
                fail_fsyncs(&disk, 1);
            }
            let response = ElectionScoutingResponse {
                term: 1,
                will_vote: true,
            };
            core.handle_message(at(t, 510), n(2), m(Kind::ScoutingResponse(response)));
            let (executed, stopped) = execute(&mut core, &mut store, at(t, 510));
            assert_eq!(stopped, failing);
            assert_eq!(votes_or_campaigns(&executed, 1), !failing, "{executed:?}");
            assert_eq!(
                core.status().state == ElectorState::Candidate,
                !failing,
                "a candidate only with its term on disk"
            );
            drop(store);
            disk.power_loss(|sizes| (sizes.len(), None));
            assert_eq!(open_sim(&disk).1, Term(u64::from(!failing)));
        }
    }
}
