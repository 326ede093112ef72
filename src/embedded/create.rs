//! Atomic creation of a store file: a crash at any point of creating a store
//! leaves either no store or a store that opens.
//!
//! The protocol (`docs/design.md` 2.8): the new index is created under a
//! unique temporary name in the same directory
//! (`.<file name>.creating-<16 hex digits>`), initialised (store identity,
//! format, tables) and made durable; then it is hard-linked to the real
//! name. A store that another process created meanwhile wins: the link
//! fails with `AlreadyExists` and that store is opened instead, never
//! replaced (which a `rename` would do). Then the temporary name is removed
//! and the directory synced. A temporary file left by a crash is removed by
//! the next open of the store (or by the next creation of it), and never
//! read.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// How often a creation is retried when its temporary file vanished before
/// the link (another opener cleaned it up as a leftover).
const ATTEMPTS: usize = 8;

/// The longest file name most file systems take (bytes: ext4, XFS, btrfs,
/// tmpfs; NTFS counts 255 UTF-16 units).
const MAX_NAME_BYTES: usize = 255;

/// The prefix of the temporary names of `path`'s creation:
/// `.<file name>.creating-`, which 16 hex digits end. A file name too long
/// for that to fit in [`MAX_NAME_BYTES`] (a store name of 229 bytes or
/// more, whose own name and `-wal` fit) gets
/// `.idemstore-<crc32 of the name, 8 hex digits>.creating-` instead: the
/// same for every creation of that path, so its leftovers are found. A
/// store of another long name whose crc32 is the same may then remove a
/// creation's temporary file as a leftover; that creation starts over, as
/// after any such removal.
fn temp_prefix(path: &Path) -> Option<OsString> {
    const SUFFIX: &str = ".creating-";
    let name = path.file_name()?;
    let mut prefix = OsString::from(".");
    if 1 + name.len() + SUFFIX.len() + 16 <= MAX_NAME_BYTES {
        prefix.push(name);
    } else {
        prefix.push(format!(
            "idemstore-{:08x}",
            crc32fast::hash(name.as_encoded_bytes())
        ));
    }
    prefix.push(SUFFIX);
    Some(prefix)
}

fn dir_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn storage(path: &Path, what: &str, e: &io::Error) -> Error {
    Error::Storage(format!("{}: {what}: {e}", path.display()))
}

/// Makes sure a store file exists at `path`, creating it atomically if it
/// does not: `init` is called on a new database at a temporary name and
/// must leave it initialised and committed durably. Returns whether this
/// call created the store. An existing file (of any content) is left
/// alone for the open to judge.
///
/// # Errors
/// [`Error::Storage`] when the directory or a file cannot be created,
/// synced or linked; whatever `init` returns.
pub(crate) fn ensure(path: &Path, init: impl Fn(&Path) -> Result<()>) -> Result<bool> {
    let Some(prefix) = temp_prefix(path) else {
        return Err(Error::invalid("path", "names no file"));
    };
    for _ in 0..ATTEMPTS {
        match std::fs::symlink_metadata(path) {
            Ok(_) => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(storage(path, "cannot look at the store file", &e)),
        }
        let mut name = prefix.clone();
        name.push(format!("{:016x}", rand::random::<u64>()));
        let temp = dir_of(path).join(name);
        if let Err(e) = init(&temp) {
            let _ = std::fs::remove_file(&temp);
            return Err(e);
        }
        match std::fs::File::open(&temp).and_then(|f| f.sync_all()) {
            Ok(()) => {}
            // Removed as a leftover by the opener of a store that another
            // process created meanwhile: start over (the next round finds
            // that store and opens it).
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                let _ = std::fs::remove_file(&temp);
                return Err(storage(&temp, "cannot sync the new store", &e));
            }
        }
        let linked = std::fs::hard_link(&temp, path);
        #[cfg(test)]
        if linked.is_ok() {
            after_link::run(path);
        }
        let _ = std::fs::remove_file(&temp);
        sync_dir(path)?;
        match linked {
            Ok(()) => return Ok(true),
            // Created meanwhile by another process: open that one.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            // The temporary file was removed as a leftover by another
            // opener before the link: start over.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(storage(path, "cannot link the new store into place", &e)),
        }
    }
    Err(Error::Storage(format!(
        "{}: the store could not be created: its temporary file kept vanishing",
        path.display()
    )))
}

/// Removes temporary files that creations of `path` left behind (a crash
/// between creating and linking, or between linking and removing). Called
/// once the store at `path` is open and held, so no creation of it is
/// still under way in a way that could succeed.
///
/// # Errors
/// None: a leftover that cannot be removed is left for the next open.
pub(crate) fn remove_leftovers(path: &Path) {
    let Some(prefix) = temp_prefix(path) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir_of(path)) else {
        return;
    };
    let mut removed = false;
    for entry in entries.flatten() {
        let name = entry.file_name();
        // Exactly the prefix and 16 hex digits: the names `ensure` makes,
        // and nothing else (not a user's file, not another store's).
        let is_leftover = name
            .as_encoded_bytes()
            .strip_prefix(prefix.as_encoded_bytes())
            .is_some_and(|rest| rest.len() == 16 && rest.iter().all(u8::is_ascii_hexdigit));
        if is_leftover && std::fs::remove_file(entry.path()).is_ok() {
            removed = true;
            tracing::info!(file = %entry.path().display(), "removed a store file left by an interrupted creation");
        }
    }
    if removed {
        let _ = sync_dir(path);
    }
}

#[cfg(unix)]
fn sync_dir(path: &Path) -> Result<()> {
    let dir = dir_of(path);
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| storage(&dir, "cannot sync the directory", &e))
}

#[cfg(not(unix))]
fn sync_dir(_path: &Path) -> Result<()> {
    // Directories cannot be opened for syncing here; NTFS journals entries.
    Ok(())
}

/// A test hook run by the thread whose link made a new store file, before
/// that thread's open takes the file's lock: the unit tests use it to open
/// and use the store from another thread in that window.
#[cfg(test)]
pub(crate) mod after_link {
    use std::cell::RefCell;
    use std::path::Path;

    /// What runs after the link.
    type Hook = Box<dyn FnOnce(&Path)>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Runs `hook` once, after this thread's next link of a new store.
    pub(crate) fn set(hook: impl FnOnce(&Path) + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    }

    pub(super) fn run(path: &Path) {
        if let Some(hook) = HOOK.with(|h| h.borrow_mut().take()) {
            hook(path);
        }
    }
}
