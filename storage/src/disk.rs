//! The file layer under the storage floor: what the journal (and anything else that keeps
//! durable files) asks of a disk, with two implementations — [`RealDisk`], the operating
//! system's files, and [`SimDisk`], a disk in memory for the simulators, seeded, that can fail
//! an fsync, run out of space, lose every write not yet synced at a power loss (tearing the
//! last one), and hand back a block with flipped bits.
//!
//! The model of durability both follow (POSIX as Linux implements it):
//! - a write reaches the file at once (a read sees it) but is durable only once an fsync of
//!   the file ([`DiskFile::sync_data`]) returns `Ok`;
//! - a file created, renamed or removed is so in the directory at once, durably only once the
//!   directory is fsynced ([`Disk::sync_dir`]);
//! - an fsync that fails says nothing about what it covered, and what it covered is not
//!   written later either (Linux marks the pages clean after a failed writeback: PostgreSQL's
//!   "fsyncgate"). A caller must never count on it, nor retry it: [`SimDisk`] drops those
//!   writes from what a power loss keeps, as the kernel does.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{self, IoSlice};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// How a file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// An existing file, to read.
    Read,
    /// An existing file, to read and write.
    ReadWrite,
    /// Read and write, created if absent, cut to zero if present.
    Create,
}

/// An open file of a [`Disk`]; shared (`Arc`) between the thread that writes and the one that
/// fsyncs.
#[allow(clippy::len_without_is_empty)] // a file's length is an I/O result, as `std::fs::File`'s
pub trait DiskFile: Send + Sync + fmt::Debug {
    /// Reads at `offset` into `buf`; the bytes read (0 at the end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes `bufs` in order at `offset`; the bytes written (all of them, or an error).
    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize>;
    /// Makes every write so far durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// [`DiskFile::sync_data`] and the file's metadata (`fsync`).
    fn sync_all(&self) -> io::Result<()>;
    /// The file's length, bytes.
    fn len(&self) -> io::Result<u64>;
    /// Cuts or extends the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reserves `len` bytes of disk for the file without changing its length (`fallocate`
    /// with `FALLOC_FL_KEEP_SIZE`), so that writes within them cannot fail for a full disk.
    /// `Ok(false)`: the file system cannot reserve (writes go on unreserved).
    fn reserve(&self, len: u64) -> io::Result<bool>;
    /// Frees the blocks of a file no name refers to any more, a step at a time (see
    /// [`crate::release`]); a file that still has a name is left alone. Best effort.
    fn release(&self);

    /// Reads exactly `buf.len()` bytes at `offset`.
    ///
    /// Errors: `UnexpectedEof` when the file ends first.
    fn read_exact_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.read_at(buf, offset) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes all of `buf` at `offset`.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_vectored_at(&[IoSlice::new(buf)], offset)
            .map(|_| ())
    }

    /// The file's first `max` bytes, or all of it when shorter (a whole file read at open).
    ///
    /// Errors: the length or a read fails; a length that does not fit in memory.
    fn read_up_to(&self, max: u64) -> io::Result<Vec<u8>> {
        let len = usize::try_from(self.len()?.min(max))
            .map_err(|_| io::Error::other("file larger than memory"))?;
        let mut bytes = vec![0u8; len];
        self.read_exact_at(&mut bytes, 0)?;
        Ok(bytes)
    }
}

/// A shared open file.
pub type FileRef = Arc<dyn DiskFile>;

/// The sync step every durable file of a node takes — a journal segment
/// (`store::SyncTicket`), the metadata ledger's live file (`LedgerSync`), a closed segment at
/// roll-over: the writes made to `file` so far made durable, to run on any thread.
/// `fdatasync`; for a file created since its directory was last fsynced, `fsync` of the file
/// (its inode) and of that directory (its entry), so that a power loss cannot leave the data
/// without a name.
#[derive(Debug, Clone)]
pub struct FileSync {
    disk: Arc<dyn Disk>,
    file: FileRef,
    new_in: Option<PathBuf>,
}

impl FileSync {
    /// The sync of `file` on `disk`; `new_in`: the directory it was created in, while that
    /// directory's fsync since is owed.
    pub fn new(disk: Arc<dyn Disk>, file: FileRef, new_in: Option<PathBuf>) -> FileSync {
        FileSync { disk, file, new_in }
    }

    /// Whether it also makes the file's directory entry durable.
    pub fn is_new(&self) -> bool {
        self.new_in.is_some()
    }

    /// Runs it; blocks for as long as the disk takes.
    ///
    /// # Errors
    /// The fsync's error: nothing it covers may be taken as durable, now or after any later
    /// fsync (the page cache may have dropped what it could not write; STYLE.md: never retry
    /// an fsync).
    pub fn run(&self) -> io::Result<()> {
        match &self.new_in {
            None => self.file.sync_data(),
            Some(dir) => {
                self.file.sync_all()?;
                self.disk.sync_dir(dir)
            }
        }
    }
}

/// A disk: files by path (see the module doc for what is durable when).
pub trait Disk: Send + Sync + fmt::Debug {
    /// Opens `path` as `how` says.
    fn open(&self, path: &Path, how: Open) -> io::Result<FileRef>;
    /// Renames `from` to `to` (replacing `to`).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes the file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Removes the directory `path` with everything in it.
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Creates the directory `path` and its parents.
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// The entries of directory `path` (files and directories), whole paths, sorted.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>>;
    /// Whether `path` is a directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// Whether `path` exists.
    fn exists(&self, path: &Path) -> bool;
    /// Makes the entries of directory `path` durable (files created, renamed, removed in it).
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
}

/// The operating system's files.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealDisk;

#[derive(Debug)]
struct RealFile(std::fs::File);

impl DiskFile for RealFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(&self.0, buf, offset)
    }

    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        // `pwritev` may write less than asked: go on from where it stopped.
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut done = 0usize;
        while done < total {
            let mut skip = done;
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(bufs.len());
            for b in bufs {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                slices.push(IoSlice::new(&b[skip..]));
                skip = 0;
                if slices.len() == IOV_MAX {
                    break;
                }
            }
            match rustix::io::pwritev(&self.0, &slices, offset + done as u64) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(total)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn sync_all(&self) -> io::Result<()> {
        self.0.sync_all()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn reserve(&self, len: u64) -> io::Result<bool> {
        use rustix::fs::{fallocate, FallocateFlags};
        use rustix::io::Errno;
        match fallocate(&self.0, FallocateFlags::KEEP_SIZE, 0, len) {
            Ok(()) => Ok(true),
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn release(&self) {
        crate::release::release_gradually(&self.0);
    }
}

/// Most buffers one `pwritev` takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

impl Disk for RealDisk {
    fn open(&self, path: &Path, how: Open) -> io::Result<FileRef> {
        let mut o = std::fs::OpenOptions::new();
        match how {
            Open::Read => o.read(true),
            Open::ReadWrite => o.read(true).write(true),
            Open::Create => o.read(true).write(true).create(true).truncate(true),
        };
        Ok(Arc::new(RealFile(o.open(path)?)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(path)? {
            out.push(entry?.path());
        }
        out.sort();
        Ok(out)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::File::open(path)?.sync_all()
    }
}

/// What a [`SimDisk`] does wrong, set by the simulator.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The next this many fsyncs (of files or directories) fail with EIO.
    pub fsyncs_failing: u32,
    /// Bytes the disk may still take (writes and reservations beyond fail with ENOSPC);
    /// `None`: unbounded.
    pub space_left: Option<u64>,
}

/// One write or cut of a file since its last successful fsync, kept to decide what a power
/// loss keeps.
#[derive(Debug, Clone)]
enum Change {
    Write { offset: u64, bytes: Vec<u8> },
    SetLen(u64),
}

#[derive(Debug, Default)]
struct Inode {
    /// What reads see (the page cache).
    data: Vec<u8>,
    /// What a power loss keeps, before `changes`.
    durable: Vec<u8>,
    /// Changes since the last fsync, in order: a power loss keeps a prefix of them, the last
    /// one of it possibly torn.
    changes: Vec<Change>,
    /// Bytes reserved (counted against the space).
    reserved: u64,
    /// Names refer to it (else it lives only while open).
    linked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    File(u64),
    Dir,
}

#[derive(Debug, Default)]
struct SimState {
    inodes: HashMap<u64, Inode, foldhash::fast::RandomState>,
    next_inode: u64,
    /// The namespace as reads see it.
    names: BTreeMap<PathBuf, Entry>,
    /// The namespace a power loss keeps: entries as of their directory's last fsync.
    durable_names: BTreeMap<PathBuf, Entry>,
    faults: Faults,
    /// Counts, for the simulators' reports.
    fsyncs: u64,
    fsyncs_failed: u64,
}

impl SimState {
    /// Whether growing inode `ino` to `len` bytes fits the space left.
    fn fits(&self, ino: u64, len: u64) -> bool {
        let Some(left) = self.faults.space_left else {
            return true;
        };
        let inode = &self.inodes[&ino];
        let now = (inode.data.len() as u64).max(inode.reserved);
        len <= now || len - now <= left
    }

    /// Changes inode `ino` with `change` if its size (length or reservation, the larger)
    /// grown to `len` fits the space left, and charges the growth to it.
    ///
    /// Errors: `ENOSPC` when it does not fit (nothing changed).
    fn grow(&mut self, ino: u64, len: u64, change: impl FnOnce(&mut Inode)) -> io::Result<()> {
        if !self.fits(ino, len) {
            return Err(enospc());
        }
        let size = |i: &Inode| (i.data.len() as u64).max(i.reserved);
        let inode = self.inodes.get_mut(&ino).expect("open inode exists");
        let before = size(inode);
        change(inode);
        let after = size(inode);
        if let Some(left) = self.faults.space_left.as_mut() {
            *left = left.saturating_sub(after.saturating_sub(before));
        }
        Ok(())
    }

    fn fsync(&mut self) -> io::Result<()> {
        self.fsyncs += 1;
        if self.faults.fsyncs_failing > 0 {
            self.faults.fsyncs_failing -= 1;
            self.fsyncs_failed += 1;
            return Err(io::Error::from_raw_os_error(libc_eio()));
        }
        Ok(())
    }
}

/// Applies `changes` in order to `data`; the last one, a write, cut to `torn` bytes.
fn apply(data: &mut Vec<u8>, changes: Vec<Change>, torn: Option<usize>) {
    let n = changes.len();
    for (i, change) in changes.into_iter().enumerate() {
        match change {
            Change::SetLen(len) => data.resize(len as usize, 0),
            Change::Write { offset, mut bytes } => {
                if i + 1 == n {
                    if let Some(t) = torn {
                        bytes.truncate(t);
                    }
                }
                let end = offset as usize + bytes.len();
                if data.len() < end {
                    data.resize(end, 0);
                }
                data[offset as usize..end].copy_from_slice(&bytes);
            }
        }
    }
}

/// `EIO`, the error of a failed fsync.
fn libc_eio() -> i32 {
    5
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

/// A disk in memory (see the module doc): every node of a simulation has its own; cloning
/// shares it (a restarted node opens the same disk).
#[derive(Debug, Clone, Default)]
pub struct SimDisk {
    state: Arc<Mutex<SimState>>,
}

#[derive(Debug)]
struct SimFile {
    disk: Arc<Mutex<SimState>>,
    ino: u64,
    writable: bool,
}

impl SimDisk {
    /// An empty disk.
    pub fn new() -> SimDisk {
        SimDisk::default()
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets what goes wrong from now on.
    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    /// What goes wrong now.
    pub fn faults(&self) -> Faults {
        self.lock().faults.clone()
    }

    /// `(fsyncs, of which failed)` so far.
    pub fn fsync_counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.fsyncs, s.fsyncs_failed)
    }

    /// A power loss: every file goes back to what its last successful fsync made durable
    /// plus, in order, a prefix of the changes since — `keep(sizes)` is given the byte count
    /// of each change a file had since (0 for a cut) and says how many survive and, for the
    /// last kept one, how many of its bytes (`None`: all) — and every directory to its
    /// entries as of its last fsync. Files no durable name refers to are gone.
    pub fn power_loss(&self, mut keep: impl FnMut(&[usize]) -> (usize, Option<usize>)) {
        let mut s = self.lock();
        let s = &mut *s;
        s.names = s.durable_names.clone();
        let names = &s.names;
        let orphans: Vec<PathBuf> = names
            .keys()
            .filter(|p| {
                p.parent().is_some_and(|d| {
                    !d.as_os_str().is_empty()
                        && d != Path::new("/")
                        && !matches!(names.get(d), Some(Entry::Dir))
                })
            })
            .cloned()
            .collect();
        debug_assert!(
            orphans.is_empty(),
            "durable entries without their directory: {orphans:?}"
        );
        for p in orphans {
            s.names.remove(&p);
        }
        s.durable_names = s.names.clone();
        let live: std::collections::HashSet<u64> = s
            .names
            .values()
            .filter_map(|e| match e {
                Entry::File(i) => Some(*i),
                Entry::Dir => None,
            })
            .collect();
        s.inodes.retain(|ino, _| live.contains(ino));
        for inode in s.inodes.values_mut() {
            let mut changes = std::mem::take(&mut inode.changes);
            let sizes: Vec<usize> = changes
                .iter()
                .map(|c| match c {
                    Change::Write { bytes, .. } => bytes.len(),
                    Change::SetLen(_) => 0,
                })
                .collect();
            let (kept, torn) = keep(&sizes);
            let kept = kept.min(changes.len());
            changes.truncate(kept);
            let mut data = std::mem::take(&mut inode.durable);
            apply(&mut data, changes, torn);
            inode.durable = data.clone();
            inode.data = data;
            inode.reserved = 0;
            inode.linked = true;
        }
    }

    /// Flips bit `bit` (0-7) of byte `offset` of file `path`, in what reads see and in what
    /// is durable: a block that reads back damaged.
    ///
    /// Errors: no such file, or an offset past its end.
    pub fn flip_bit(&self, path: &Path, offset: u64, bit: u8) -> io::Result<()> {
        let mut s = self.lock();
        let Some(Entry::File(ino)) = s.names.get(path).copied() else {
            return Err(not_found(path));
        };
        let inode = s.inodes.get_mut(&ino).expect("named inode exists");
        let o = offset as usize;
        if o >= inode.data.len() {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        inode.data[o] ^= 1 << (bit & 7);
        if o < inode.durable.len() {
            inode.durable[o] ^= 1 << (bit & 7);
        }
        Ok(())
    }

    /// The files on the disk (their names as reads see them), sorted.
    pub fn files(&self) -> Vec<PathBuf> {
        self.lock()
            .names
            .iter()
            .filter(|(_, e)| matches!(e, Entry::File(_)))
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// The length of file `path` as reads see it.
    pub fn file_len(&self, path: &Path) -> Option<u64> {
        let s = self.lock();
        match s.names.get(path) {
            Some(Entry::File(ino)) => Some(s.inodes[ino].data.len() as u64),
            _ => None,
        }
    }
}

impl DiskFile for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        let data = &s.inodes[&self.ino].data;
        let start = (offset as usize).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }

    fn write_vectored_at(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(9));
        }
        let mut s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let end = offset + total as u64;
        let mut bytes = Vec::with_capacity(total);
        for b in bufs {
            bytes.extend_from_slice(b);
        }
        s.grow(self.ino, end, |inode| {
            if inode.data.len() < end as usize {
                inode.data.resize(end as usize, 0);
            }
            inode.data[offset as usize..end as usize].copy_from_slice(&bytes);
            inode.changes.push(Change::Write { offset, bytes });
        })?;
        Ok(total)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        let failed = s.fsync();
        let inode = s.inodes.get_mut(&self.ino).expect("open inode exists");
        match failed {
            Ok(()) => {
                // What the fsync writes is the changes since the last one — not what reads
                // see, which may hold writes a failed fsync dropped.
                let changes = std::mem::take(&mut inode.changes);
                apply(&mut inode.durable, changes, None);
                Ok(())
            }
            Err(e) => {
                // The kernel marks the pages clean after a failed writeback: what this fsync
                // covered never reaches the disk, though reads still see it.
                inode.changes.clear();
                Err(e)
            }
        }
    }

    fn sync_all(&self) -> io::Result<()> {
        self.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        let s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        Ok(s.inodes[&self.ino].data.len() as u64)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        s.grow(self.ino, len, |inode| {
            inode.data.resize(len as usize, 0);
            inode.changes.push(Change::SetLen(len));
        })
    }

    fn reserve(&self, len: u64) -> io::Result<bool> {
        let mut s = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        s.grow(self.ino, len, |inode| {
            inode.reserved = inode.reserved.max(len)
        })?;
        Ok(true)
    }

    fn release(&self) {}
}

/// The entries below directory `dir` in `names`, at any depth (they sort right after it).
fn below<'a>(
    names: &'a BTreeMap<PathBuf, Entry>,
    dir: &'a Path,
) -> impl Iterator<Item = &'a PathBuf> + 'a {
    names
        .range::<Path, _>((Bound::Excluded(dir), Bound::Unbounded))
        .map(|(p, _)| p)
        .take_while(move |p| p.starts_with(dir))
}

/// The entries directly in directory `dir` in `names`.
fn children<'a>(
    names: &'a BTreeMap<PathBuf, Entry>,
    dir: &'a Path,
) -> impl Iterator<Item = (&'a PathBuf, &'a Entry)> + 'a {
    names
        .range::<Path, _>((Bound::Excluded(dir), Bound::Unbounded))
        .take_while(move |(p, _)| p.starts_with(dir))
        .filter(move |(p, _)| p.parent() == Some(dir))
}

impl Disk for SimDisk {
    fn open(&self, path: &Path, how: Open) -> io::Result<FileRef> {
        let mut s = self.lock();
        let ino = match (s.names.get(path).copied(), how) {
            (Some(Entry::Dir), _) => {
                return Err(io::Error::other("is a directory"));
            }
            (Some(Entry::File(ino)), Open::Create) => {
                let inode = s.inodes.get_mut(&ino).expect("named inode exists");
                inode.data.clear();
                inode.changes.push(Change::SetLen(0));
                ino
            }
            (Some(Entry::File(ino)), _) => ino,
            (None, Open::Create) => {
                let parent = path.parent().unwrap_or(Path::new(""));
                if !parent.as_os_str().is_empty()
                    && !matches!(s.names.get(parent), Some(Entry::Dir))
                {
                    return Err(not_found(parent));
                }
                s.next_inode += 1;
                let ino = s.next_inode;
                s.inodes.insert(
                    ino,
                    Inode {
                        linked: true,
                        ..Default::default()
                    },
                );
                s.names.insert(path.to_path_buf(), Entry::File(ino));
                ino
            }
            (None, _) => return Err(not_found(path)),
        };
        Ok(Arc::new(SimFile {
            disk: self.state.clone(),
            ino,
            writable: how != Open::Read,
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.lock();
        let entry = s.names.remove(from).ok_or_else(|| not_found(from))?;
        if let Some(Entry::File(old)) = s.names.insert(to.to_path_buf(), entry) {
            if let Some(i) = s.inodes.get_mut(&old) {
                i.linked = false;
            }
        }
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        match s.names.remove(path) {
            Some(Entry::File(ino)) => {
                if let Some(i) = s.inodes.get_mut(&ino) {
                    i.linked = false;
                }
                Ok(())
            }
            Some(Entry::Dir) => {
                s.names.insert(path.to_path_buf(), Entry::Dir);
                Err(io::Error::other("is a directory"))
            }
            None => Err(not_found(path)),
        }
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        if !matches!(s.names.get(path), Some(Entry::Dir)) {
            return Err(not_found(path));
        }
        let mut gone: Vec<PathBuf> = below(&s.names, path).cloned().collect();
        gone.push(path.to_path_buf());
        for p in gone {
            if let Some(Entry::File(ino)) = s.names.remove(&p) {
                if let Some(i) = s.inodes.get_mut(&ino) {
                    i.linked = false;
                }
            }
        }
        Ok(())
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        let mut at = PathBuf::new();
        for part in path.components() {
            at.push(part);
            match s.names.get(&at) {
                Some(Entry::Dir) => {}
                Some(Entry::File(_)) => return Err(io::Error::other("a file is in the way")),
                None => {
                    s.names.insert(at.clone(), Entry::Dir);
                    // Directories are taken as durable at once (the store creates its own
                    // directory once; what it keeps durable are the files in it), and empty:
                    // what a removed directory of this name held went with it.
                    let inside: Vec<PathBuf> = below(&s.durable_names, &at).cloned().collect();
                    for p in inside {
                        s.durable_names.remove(&p);
                    }
                    s.durable_names.insert(at.clone(), Entry::Dir);
                }
            }
        }
        Ok(())
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>> {
        let s = self.lock();
        if !matches!(s.names.get(path), Some(Entry::Dir)) {
            return Err(not_found(path));
        }
        Ok(children(&s.names, path).map(|(p, _)| p.clone()).collect())
    }

    fn is_dir(&self, path: &Path) -> bool {
        matches!(self.lock().names.get(path), Some(Entry::Dir))
    }

    fn exists(&self, path: &Path) -> bool {
        self.lock().names.contains_key(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.fsync()?;
        let s = &mut *s;
        // The directory's entries, as they are now, become what a power loss keeps; a
        // directory removed from it goes with everything in it (it could only be removed
        // empty).
        // Both namespaces are sorted: one pass over the two lists of entries finds what
        // changed, and only that is copied.
        let mut made = Vec::new();
        let mut gone = Vec::new();
        let mut now = children(&s.names, path).peekable();
        let mut was = children(&s.durable_names, path).peekable();
        loop {
            match (now.peek(), was.peek()) {
                (None, None) => break,
                (Some((p, e)), None) => {
                    made.push(((*p).clone(), **e));
                    now.next();
                }
                (None, Some((p, e))) => {
                    gone.push(((*p).clone(), **e));
                    was.next();
                }
                (Some((p, e)), Some((q, f))) => match p.cmp(q) {
                    std::cmp::Ordering::Less => {
                        made.push(((*p).clone(), **e));
                        now.next();
                    }
                    std::cmp::Ordering::Greater => {
                        gone.push(((*q).clone(), **f));
                        was.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if e != f {
                            made.push(((*p).clone(), **e));
                        }
                        now.next();
                        was.next();
                    }
                },
            }
        }
        drop((now, was));
        for (p, e) in gone {
            s.durable_names.remove(&p);
            if e == Entry::Dir {
                let inside: Vec<PathBuf> = below(&s.durable_names, &p).cloned().collect();
                for q in inside {
                    s.durable_names.remove(&q);
                }
            }
        }
        s.durable_names.extend(made);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (SimDisk, PathBuf) {
        let d = SimDisk::new();
        let p = PathBuf::from("/data");
        d.create_dir_all(&p).unwrap();
        (d, p)
    }

    /// A disk with file `/data/f`, its name durable: `(disk, path, file)`.
    fn named_file() -> (SimDisk, PathBuf, FileRef) {
        let (d, p) = dir();
        let path = p.join("f");
        let f = d.open(&path, Open::Create).unwrap();
        d.sync_dir(&p).unwrap();
        (d, path, f)
    }

    #[test]
    fn a_power_loss_keeps_what_was_synced_and_a_prefix_of_the_rest() {
        // Synced bytes survive; of the writes since, the power loss keeps the prefix it
        // chooses, the last one torn.
        let (d, path, f) = named_file();
        f.write_all_at(b"hello", 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(b" world", 5).unwrap();
        f.write_all_at(b"!!", 11).unwrap();
        let mut buf = vec![0; 13];
        f.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"hello world!!", "reads see unsynced writes");
        d.power_loss(|sizes| {
            assert_eq!(sizes, &[6, 2]);
            (1, Some(3))
        });
        let f = d.open(&path, Open::Read).unwrap();
        assert_eq!(f.len().unwrap(), 8);
        let mut buf = vec![0; 8];
        f.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"hello wo");
    }

    #[test]
    fn a_file_not_synced_into_its_directory_is_gone_after_a_power_loss() {
        let (d, p) = dir();
        let f = d.open(&p.join("new"), Open::Create).unwrap();
        f.write_all_at(b"data", 0).unwrap();
        f.sync_data().unwrap();
        d.rename(&p.join("new"), &p.join("renamed")).unwrap();
        assert!(d.exists(&p.join("renamed")));
        d.power_loss(|sizes| (sizes.len(), None));
        assert!(!d.exists(&p.join("new")) && !d.exists(&p.join("renamed")));
    }

    #[test]
    fn a_removed_directory_goes_with_its_files_once_its_parent_is_synced() {
        // As on a real file system: a directory is removed empty, so once its removal is
        // durable none of its files can come back, and a directory made again under the
        // same name starts empty.
        let (d, p) = dir();
        let sub = p.join("install");
        // A durable directory `sub` holding a durable file, then removed.
        let make_and_remove = || {
            d.create_dir_all(&sub).unwrap();
            let f = d.open(&sub.join("seg"), Open::Create).unwrap();
            f.write_all_at(b"old", 0).unwrap();
            f.sync_data().unwrap();
            d.sync_dir(&sub).unwrap();
            d.remove_dir_all(&sub).unwrap();
        };
        make_and_remove();
        d.sync_dir(&p).unwrap();
        d.power_loss(|sizes| (sizes.len(), None));
        assert!(!d.exists(&sub) && !d.exists(&sub.join("seg")));

        make_and_remove();
        d.create_dir_all(&sub).unwrap();
        d.power_loss(|sizes| (sizes.len(), None));
        assert!(d.exists(&sub), "directories are durable when made");
        assert_eq!(d.read_dir(&sub).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_failed_fsync_is_never_durable_later() {
        // PostgreSQL's lesson: after an fsync fails, the writes it covered are not written by a
        // later fsync either; reads still see them until the power goes.
        let (d, path, f) = named_file();
        f.write_all_at(b"lost", 0).unwrap();
        d.set_faults(Faults {
            fsyncs_failing: 1,
            ..Default::default()
        });
        assert_eq!(f.sync_data().unwrap_err().raw_os_error(), Some(5));
        f.sync_data().unwrap();
        assert_eq!(f.len().unwrap(), 4, "reads still see it");
        d.power_loss(|sizes| (sizes.len(), None));
        assert_eq!(d.file_len(&path), Some(0), "never durable");
        assert_eq!(d.fsync_counts(), (3, 1));
    }

    #[test]
    fn writes_past_the_space_left_fail_with_enospc_and_reservations_hold() {
        let (d, p) = dir();
        d.set_faults(Faults {
            space_left: Some(10),
            ..Default::default()
        });
        let f = d.open(&p.join("f"), Open::Create).unwrap();
        assert!(f.reserve(8).unwrap());
        f.write_all_at(b"12345678", 0).unwrap();
        let e = f.write_all_at(b"abc", 8).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(28));
        f.write_all_at(b"ab", 8).unwrap();
    }

    #[test]
    fn a_flipped_bit_reads_back() {
        let (d, p) = dir();
        let path = p.join("f");
        let f = d.open(&path, Open::Create).unwrap();
        f.write_all_at(&[0u8; 4], 0).unwrap();
        d.flip_bit(&path, 2, 0).unwrap();
        let mut buf = [0u8; 4];
        f.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [0, 0, 1, 0]);
        assert_eq!(d.read_dir(&p).unwrap(), vec![path]);
    }
}
