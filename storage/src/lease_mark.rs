//! The highest primary lease a node has served for one partition, kept beside its journal in
//! `<dir>/primary-lease` — what the journal itself says (its lease runs) until the journal is
//! lost: a node whose journal was found corrupt and set aside ([`crate::Store::quarantine`])
//! no longer knows from it whether it already wrote records under the lease it is named
//! primary at, and healing twice at one lease could put other records at positions a replica
//! holds under that lease (same-lease journals must be prefixes of each other). The mark
//! survives the quarantine, so such a node asks for a new lease instead.
//!
//! Made durable with the journal's own fsync: [`crate::Store::begin_sync`] writes a raised
//! mark and the [`crate::SyncTicket`] fsyncs it with the segment, so the ticket that makes a
//! lease's first record durable (before which no record of the lease leaves the primary)
//! makes the mark durable too.
//!
//! Format: two slots of 16 bytes, at offsets 0 and 512 (different sectors), each
//! `| lease: u64 LE | CRC32C of the lease bytes: u32 LE | "BMQL" |`. A write goes to the slot
//! holding the lower value, so a torn write leaves the other, an older mark: a mark not yet
//! durable covered no record that had left the node.

use std::path::{Path, PathBuf};

use crate::disk::{Disk, FileRef, Open};

/// The file's name under the journal's directory.
pub(crate) const LEASE_MARK_NAME: &str = "primary-lease";
const SLOT_MAGIC: &[u8; 4] = b"BMQL";
const SLOT_LEN: usize = 16;
const SLOT_OFFSETS: [u64; 2] = [0, 512];
/// The file's length: both slots.
const FILE_LEN: usize = 512 + SLOT_LEN;

/// See the module doc.
#[derive(Debug)]
pub(crate) struct LeaseMark {
    file: FileRef,
    path: PathBuf,
    /// The value of each slot (0: empty or invalid).
    slots: [u64; 2],
    /// The highest lease noted.
    noted: u64,
    /// The highest lease written to a slot.
    written: u64,
    /// The highest lease known durable (read at open, or fsynced since).
    durable: u64,
}

impl LeaseMark {
    /// Opens (or creates, durably) the mark of the journal in `dir`.
    ///
    /// Errors: the file cannot be opened, read, created or fsynced.
    pub(crate) fn open(disk: &dyn Disk, dir: &Path, fsync: bool) -> std::io::Result<LeaseMark> {
        let path = dir.join(LEASE_MARK_NAME);
        let existed = disk.exists(&path);
        let file = disk.open(
            &path,
            if existed {
                Open::ReadWrite
            } else {
                Open::Create
            },
        )?;
        if !existed {
            // Both slots' bytes written once (empty slots), so that raising the mark writes
            // over blocks the file holds and never needs space: a full disk must not stop a
            // node.
            file.write_all_at(&[0u8; FILE_LEN], 0)?;
            if fsync {
                file.sync_all()?;
                disk.sync_dir(dir)?;
            }
        }
        let data = file.read_up_to(SLOT_OFFSETS[1] + SLOT_LEN as u64)?;
        let slots = SLOT_OFFSETS.map(|at| slot_value(&data, at as usize));
        let high = slots[0].max(slots[1]);
        Ok(LeaseMark {
            file,
            path,
            slots,
            noted: high,
            written: high,
            durable: high,
        })
    }

    /// The highest lease noted (durable or not yet).
    pub(crate) fn high(&self) -> u64 {
        self.noted
    }

    /// The highest lease known durable.
    pub(crate) fn durable(&self) -> u64 {
        self.durable
    }

    /// Notes `lease` (kept if higher), to be written at the next sync.
    pub(crate) fn note(&mut self, lease: u64) {
        self.noted = self.noted.max(lease);
    }

    /// The file's path (for errors).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes a raised mark to its slot (no fsync); returns the file and the value to fsync
    /// when the mark is not durable yet.
    ///
    /// Errors: the write failed (a full disk among them).
    pub(crate) fn prepare(&mut self) -> std::io::Result<Option<(FileRef, u64)>> {
        if self.noted > self.written {
            let i = usize::from(self.slots[1] < self.slots[0]);
            let mut slot = [0u8; SLOT_LEN];
            slot[..8].copy_from_slice(&self.noted.to_le_bytes());
            slot[8..12].copy_from_slice(&crc32c::crc32c(&self.noted.to_le_bytes()).to_le_bytes());
            slot[12..].copy_from_slice(SLOT_MAGIC);
            self.file.write_all_at(&slot, SLOT_OFFSETS[i])?;
            self.slots[i] = self.noted;
            self.written = self.noted;
        }
        Ok((self.written > self.durable).then(|| (self.file.clone(), self.written)))
    }

    /// The fsync of a ticket that carried the mark at `value` succeeded.
    pub(crate) fn synced(&mut self, value: u64) {
        self.durable = self.durable.max(value);
    }
}

/// The value of the slot at `at` of `data`, 0 when absent or damaged.
fn slot_value(data: &[u8], at: usize) -> u64 {
    let Some(slot) = data.get(at..at + SLOT_LEN) else {
        return 0;
    };
    let lease = u64::from_le_bytes(slot[..8].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(slot[8..12].try_into().expect("4 bytes"));
    if &slot[12..] != SLOT_MAGIC || crc32c::crc32c(&slot[..8]) != crc {
        return 0;
    }
    lease
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::SimDisk;

    #[test]
    fn a_mark_survives_a_power_loss_once_synced_and_a_torn_write_keeps_the_older() {
        let disk = SimDisk::new();
        let dir = Path::new("/j");
        disk.create_dir_all(dir).unwrap();
        let mut m = LeaseMark::open(&disk, dir, true).unwrap();
        assert_eq!(m.high(), 0);
        m.note(3);
        let (file, value) = m.prepare().unwrap().expect("not durable yet");
        file.sync_data().unwrap();
        m.synced(value);
        assert!(m.prepare().unwrap().is_none(), "durable: nothing to fsync");
        // A raised mark whose write is torn by a power loss: the older slot remains.
        m.note(7);
        m.prepare().unwrap();
        disk.power_loss(|sizes| (sizes.len(), Some(5)));
        let m = LeaseMark::open(&disk, dir, true).unwrap();
        assert_eq!(m.high(), 3);
    }

    #[test]
    fn a_damaged_slot_reads_as_empty_and_the_other_counts() {
        let disk = SimDisk::new();
        let dir = Path::new("/j");
        disk.create_dir_all(dir).unwrap();
        let mut m = LeaseMark::open(&disk, dir, true).unwrap();
        for lease in [4, 9] {
            m.note(lease);
            let (file, value) = m.prepare().unwrap().unwrap();
            file.sync_data().unwrap();
            m.synced(value);
        }
        // 4 went to slot 0, 9 to slot 1: damage slot 1.
        disk.flip_bit(&dir.join(LEASE_MARK_NAME), 512 + 2, 1)
            .unwrap();
        assert_eq!(LeaseMark::open(&disk, dir, true).unwrap().high(), 4);
    }
}
