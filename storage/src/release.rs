//! Freeing a deleted file's disk blocks a step at a time, for the partition journals and the
//! metadata ledger (docs/bench/JOURNAL.md, "Segments freed a little at a time").
//!
//! The last close of an unlinked file frees all its blocks in one call — on a file system
//! mounted with `discard`, a TRIM of each — and every other writer's fsync on the disk waits
//! meanwhile: for a journal segment, on every node at once, since they delete the same segment
//! together. [`release_gradually`] cuts the file down [`RELEASE_STEP`] bytes at a time first,
//! pausing [`RELEASE_PAUSE`] between cuts, so the other fsyncs pass between them — what
//! RocksDB's file deletion does with `bytes_max_delete_chunk`, for the same reason.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

/// Bytes of an unlinked file's blocks freed per cut.
pub const RELEASE_STEP: u64 = 1 << 20;

/// The pause between two cuts, so that other writers' fsyncs pass.
pub const RELEASE_PAUSE: Duration = Duration::from_millis(1);

/// Frees the blocks of `file` a [`RELEASE_STEP`] at a time, from its end, if no name refers
/// to it any more (`nlink` 0); a file that still has a name is left alone. Blocks the caller
/// for about a millisecond per step (50 ms for 32 MiB): call it on a thread that waits for
/// nothing else. Best effort: on any error it stops, and the last close frees what is left.
/// The caller must know that nobody reads or writes the file any more.
pub fn release_gradually(file: &File) {
    let Ok(meta) = file.metadata() else {
        return;
    };
    if meta.nlink() != 0 {
        return;
    }
    let mut len = meta.len();
    while len > 0 {
        len = len.saturating_sub(RELEASE_STEP);
        if file.set_len(len).is_err() {
            return;
        }
        if len > 0 {
            std::thread::sleep(RELEASE_PAUSE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    /// An unlinked file is cut to nothing, in steps with pauses between them; a file that
    /// still has a name is not touched.
    #[test]
    fn an_unlinked_file_is_cut_down_step_by_step_and_a_named_one_is_left_alone() {
        let dir = std::env::temp_dir().join(format!("bmq-files-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("segment");
        let len = 3 * RELEASE_STEP + 12_345;
        std::fs::write(&path, vec![7u8; len as usize]).unwrap();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        release_gradually(&file);
        assert_eq!(
            file.metadata().unwrap().len(),
            len,
            "still named: untouched"
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        let started = std::time::Instant::now();
        release_gradually(&file);
        let meta = file.metadata().unwrap();
        assert_eq!((meta.nlink(), meta.len(), meta.blocks()), (0, 0, 0));
        assert!(
            started.elapsed() >= 3 * RELEASE_PAUSE,
            "four cuts, three pauses between them"
        );
    }
}
