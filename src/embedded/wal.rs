//! The write-ahead log: frames, the log-file seam, fsync, recovery, reuse.
//!
//! Every state change is first written to a preallocated log file beside the
//! redb file (`<file>-wal`, as SQLite keeps its `-wal`) and made durable
//! there with one `fdatasync` per group of batches; the redb index is then
//! updated with non-durable commits. Periodic checkpoints (durable redb
//! commits that record the last applied sequence number) let the log be
//! overwritten from its start again. Recovery opens redb, which reverts to
//! its last durable commit, and replays the frames written after it.
//!
//! The byte layout of the header, frames and change records, the crash
//! analysis and the assumptions about the disk are in `docs/design.md`.
//!
//! A frame logs the *effects* of a batch (records put and removed, expiry
//! index entries, counters), not the requests, so replay is deterministic and
//! idempotent: applying a suffix of the log twice gives the same index.
//!
//! All I/O of the log goes through the [`LogFile`] trait, so that tests can
//! inject faults and simulate power loss in the log as in redb (whose seam is
//! [`redb::StorageBackend`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// The storage under the write-ahead log: a file that is read and written at
/// offsets and made durable with [`LogFile::sync_data`].
///
/// The store opens a [`FileLog`] at `<file>-wal` by itself;
/// [`Store::open_with_backend`](crate::Store::open_with_backend) takes any
/// implementation, so that tests can inject I/O errors, lose what was not
/// synced (a power cut), or keep the log in memory ([`MemoryLog`]).
///
/// The store calls these methods from two threads (the writer writes frames,
/// a syncer calls `sync_data`), so an implementation must allow concurrent
/// calls. Bytes never written read as zero (a new file is empty; the store
/// writes zeros to extend it).
///
/// An error from any method fails the batch that needed it and poisons the
/// store ([`Error::Poisoned`]) until it is reopened;
/// a panic in `sync_data` stops the store's syncer, and every waiting and
/// later call gets [`Error::Closed`].
// `len` without `is_empty`: named as in redb's `StorageBackend`, which this
// trait sits beside; an empty log is not a case callers ask about.
#[allow(clippy::len_without_is_empty)]
pub trait LogFile: Send + Sync + 'static {
    /// Fills `buf` with the bytes at `offset`.
    ///
    /// # Errors
    /// An [`io::Error`] of kind `UnexpectedEof` when the file ends before
    /// `offset + buf.len()`, or any other read error.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Writes all of `data` at `offset`, extending the file (with zeros
    /// between the old end and `offset`) when it is shorter. Need not be
    /// durable until [`LogFile::sync_data`] returns.
    ///
    /// # Errors
    /// Any write error; the bytes may then be partly written.
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;

    /// Makes every write that returned before this call durable (POSIX
    /// `fdatasync`). A real disk may keep any subset of the writes that were
    /// not yet synced when power is lost.
    ///
    /// # Errors
    /// Any I/O error. After an error nothing is known about which writes are
    /// durable; the store refuses writes until it is reopened.
    fn sync_data(&self) -> io::Result<()>;

    /// The current length of the file in bytes.
    ///
    /// # Errors
    /// Any I/O error.
    fn len(&self) -> io::Result<u64>;
}

/// A [`LogFile`] on a file of the operating system, the one the store uses
/// for `<file>-wal`.
#[derive(Debug)]
pub struct FileLog {
    file: File,
    /// The file was absent or empty when opened: no store has written it.
    fresh: bool,
    #[cfg(not(unix))]
    cursor: Mutex<()>,
}

impl FileLog {
    /// Opens the file at `path` for reading and writing, creating it when it
    /// is absent, and takes an exclusive lock on it (`flock`, held until the
    /// `FileLog` is dropped): one writer per log, even when its store file
    /// was replaced by a copy under a running store, whose open would
    /// otherwise replay and write the running store's log. A newly created
    /// file's directory entry is made durable (the parent directory is
    /// synced on Unix) before this returns.
    ///
    /// # Errors
    /// [`io::ErrorKind::WouldBlock`] when another open file holds the lock
    /// (another process's store, this process's, or a `FileLog` of the same
    /// file opened earlier and still alive); any I/O error from opening or
    /// creating the file or syncing its directory. A lock the file system
    /// cannot take (no `flock`: as redb, which also locks by byte ranges,
    /// the store then goes on without it) is not an error.
    pub fn open(path: impl AsRef<Path>) -> io::Result<FileLog> {
        let path = path.as_ref();
        let (file, created) = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(f) => (f, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                (OpenOptions::new().read(true).write(true).open(path)?, false)
            }
            Err(e) => return Err(e),
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "another store holds this write-ahead log",
                ));
            }
            // No lock on this file system: as redb, go on without it.
            Err(std::fs::TryLockError::Error(_)) => {}
        }
        if created {
            file.sync_all()?;
            sync_parent_dir(path)?;
        }
        let fresh = created || file.metadata()?.len() == 0;
        Ok(FileLog {
            file,
            fresh,
            #[cfg(not(unix))]
            cursor: Mutex::new(()),
        })
    }
}

impl FileLog {
    /// Opens the existing file at `path` for reading only (another name's
    /// log, looked at and never written).
    pub(crate) fn read_only(path: &Path) -> io::Result<FileLog> {
        let file = OpenOptions::new().read(true).open(path)?;
        let fresh = file.metadata()?.len() == 0;
        Ok(FileLog {
            file,
            fresh,
            #[cfg(not(unix))]
            cursor: Mutex::new(()),
        })
    }

    /// Whether the file was absent or empty when opened: no store had
    /// written it (a store writes its log's header at its first open).
    pub(crate) fn fresh(&self) -> bool {
        self.fresh
    }
}

#[cfg(unix)]
pub(crate) fn sync_parent_dir(path: &Path) -> io::Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    File::open(parent)?.sync_all()
}

#[cfg(not(unix))]
pub(crate) fn sync_parent_dir(_path: &Path) -> io::Result<()> {
    // Directories cannot be opened for syncing here; NTFS journals the entry.
    Ok(())
}

impl LogFile for FileLog {
    #[cfg(unix)]
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }

    #[cfg(not(unix))]
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let _held = self.cursor.lock();
        let mut f = &self.file;
        f.seek(SeekFrom::Start(offset))?;
        f.read_exact(buf)
    }

    #[cfg(unix)]
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, data, offset)
    }

    #[cfg(not(unix))]
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        use std::io::{Seek, SeekFrom, Write};
        let _held = self.cursor.lock();
        let mut f = &self.file;
        f.seek(SeekFrom::Start(offset))?;
        f.write_all(data)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

/// A [`LogFile`] kept in memory, to pair with redb's `InMemoryBackend` in
/// [`Store::open_with_backend`](crate::Store::open_with_backend). Clones
/// share the same bytes, so a test can keep one handle, drop the store and
/// reopen on the same log. `sync_data` does nothing: nothing is lost unless
/// the bytes are changed through [`MemoryLog::set_contents`].
#[derive(Debug, Clone, Default)]
pub struct MemoryLog(Arc<Mutex<Vec<u8>>>);

impl MemoryLog {
    /// An empty log.
    pub fn new() -> MemoryLog {
        MemoryLog::default()
    }

    /// A copy of the log's bytes.
    pub fn contents(&self) -> Vec<u8> {
        self.0.lock().clone()
    }

    /// Replaces the log's bytes, e.g. with a damaged copy.
    pub fn set_contents(&self, bytes: Vec<u8>) {
        *self.0.lock() = bytes;
    }
}

impl LogFile for MemoryLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = self.0.lock();
        let start = usize::try_from(offset).map_err(|_| eof())?;
        let end = start.checked_add(buf.len()).ok_or_else(eof)?;
        let src = data.get(start..end).ok_or_else(eof)?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let mut data = self.0.lock();
        let start = usize::try_from(offset).map_err(|_| too_far())?;
        let end = start.checked_add(bytes.len()).ok_or_else(too_far)?;
        if data.len() < end {
            data.resize(end, 0);
        }
        data[start..end].copy_from_slice(bytes);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.lock().len() as u64)
    }
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the log")
}

fn too_far() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "offset out of range")
}

// ---------------------------------------------------------------------------
// Layout

/// Bytes reserved for the log header; frames start here.
pub(crate) const HEADER_LEN: u64 = 4096;
/// The log format this build writes and reads.
pub(crate) const LOG_VERSION: u32 = 1;
const LOG_MAGIC: [u8; 8] = *b"IDEMWAL\0";
/// The header bytes that carry data (the rest of [`HEADER_LEN`] is zero,
/// but for the length record).
const HEADER_USED: usize = 32;
/// Where the header records the log's length: a tag, the length in bytes
/// (u64 LE) and a crc32 of both. The log only grows, and only by zeros
/// made durable before the record names the new length, so a log shorter
/// than its record was cut (a partial copy, a truncation): a crash never
/// shortens it. A log written before the record existed has zeros here,
/// and is not judged by it until an open writes one.
const LENGTH_AT: u64 = HEADER_USED as u64;
/// Bytes of the length record.
const LENGTH_RECORD_LEN: usize = 16;
/// The length record's tag.
const LENGTH_TAG: [u8; 4] = *b"LEN1";

/// Marks the start of a frame: "IWF" and the frame format version 1.
const FRAME_MAGIC: [u8; 4] = [b'I', b'W', b'F', 1];
/// Bytes of a frame header.
pub(crate) const FRAME_HEADER_LEN: usize = 36;
/// The largest frame body accepted when reading (in bytes): a guard against
/// a damaged length field, well above any batch the writer forms.
const MAX_BODY_LEN: usize = 1 << 30;
/// Bytes of a body before its changes: next token, clock, change count.
const BODY_HEADER_LEN: usize = 20;

/// The log length a new log starts with (in bytes); it doubles on each
/// checkpoint forced by a full log, up to the configured maximum.
pub(crate) const INITIAL_LOG_BYTES: u64 = 1024 * 1024;
/// How many fencing tokens a checkpoint reserves: the counter may hand them
/// out before the next checkpoint, and jumps past them after a crash. A
/// batch that needs a token beyond the reservation is committed as a
/// checkpoint that extends it (once per this many acquisitions).
pub(crate) const TOKEN_RESERVATION: u64 = 1 << 20;
/// The token reservation a checkpoint records when the counter is at
/// `next_token`: [`TOKEN_RESERVATION`] tokens ahead, but never past
/// [`MAX_TOKEN`](crate::MAX_TOKEN) (nor below the counter itself).
pub(crate) fn reserve_tokens(next_token: u64) -> u64 {
    next_token
        .checked_add(TOKEN_RESERVATION)
        .map_or(crate::config::MAX_TOKEN, |t| {
            t.min(crate::config::MAX_TOKEN)
        })
        .max(next_token)
}

/// The smallest maximum log size [`crate::Config`] accepts (in bytes).
pub(crate) const MIN_LOG_BYTES: u64 = 64 * 1024;

/// The tables a change applies to (the byte in each change record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogTable {
    /// Records: stored key bytes → record envelope.
    Records = 1,
    /// Expiry index: key = deadline (u64 LE) ‖ stored key bytes; no value.
    Expiry = 2,
    /// Business keys: key → stored key bytes.
    Business = 3,
}

impl LogTable {
    fn from_code(code: u8) -> Option<LogTable> {
        Some(match code {
            1 => LogTable::Records,
            2 => LogTable::Expiry,
            3 => LogTable::Business,
            _ => return None,
        })
    }
}

const CHANGE_INSERT: u8 = 1;
const CHANGE_REMOVE: u8 = 2;

/// One logged change, borrowed from a decoded frame body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change<'a> {
    /// Insert or overwrite `key` → `value` in `table`.
    Insert {
        table: LogTable,
        key: &'a [u8],
        value: &'a [u8],
    },
    /// Remove `key` from `table` (absent is fine).
    Remove { table: LogTable, key: &'a [u8] },
}

/// Builds the body of one frame while the writer decides a batch.
#[derive(Debug)]
pub(crate) struct BodyWriter {
    buf: Vec<u8>,
    count: u32,
}

impl Default for BodyWriter {
    fn default() -> Self {
        BodyWriter::new()
    }
}

impl BodyWriter {
    pub(crate) fn new() -> BodyWriter {
        BodyWriter {
            buf: vec![0; BODY_HEADER_LEN],
            count: 0,
        }
    }

    /// Whether no change was recorded.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn key(&mut self, op: u8, table: LogTable, key: &[&[u8]]) {
        let len: usize = key.iter().map(|p| p.len()).sum();
        self.buf.push(op);
        self.buf.push(table as u8);
        self.buf.extend_from_slice(&len_u32(len).to_le_bytes());
        for part in key {
            self.buf.extend_from_slice(part);
        }
        self.count += 1;
    }

    /// Records an insert; `key` is given in parts that are concatenated.
    pub(crate) fn insert(&mut self, table: LogTable, key: &[&[u8]], value: &[u8]) {
        self.key(CHANGE_INSERT, table, key);
        self.buf
            .extend_from_slice(&len_u32(value.len()).to_le_bytes());
        self.buf.extend_from_slice(value);
    }

    /// Records a removal; `key` is given in parts that are concatenated.
    pub(crate) fn remove(&mut self, table: LogTable, key: &[&[u8]]) {
        self.key(CHANGE_REMOVE, table, key);
    }

    /// The finished body, with the counters the index holds after it.
    pub(crate) fn finish(mut self, next_token: u64, clock_hwm: u64) -> Vec<u8> {
        self.buf[0..8].copy_from_slice(&next_token.to_le_bytes());
        self.buf[8..16].copy_from_slice(&clock_hwm.to_le_bytes());
        self.buf[16..20].copy_from_slice(&self.count.to_le_bytes());
        self.buf
    }
}

/// Keys and values are bounded far below 4 GiB (keys by `Key`, values by
/// `MAX_VALUE_LIMIT`), so lengths always fit a `u32`.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// A decoded frame body.
#[derive(Debug)]
pub(crate) struct Body<'a> {
    pub next_token: u64,
    pub clock_hwm: u64,
    pub changes: Vec<Change<'a>>,
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.buf.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(le_u64)
    }
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Decodes a frame body. `None` when it is malformed (a frame whose checksum
/// passed but whose body does not decode: a bug or a foreign writer).
pub(crate) fn decode_body(buf: &[u8]) -> Option<Body<'_>> {
    let mut r = Reader { buf, at: 0 };
    // A token counter past the cap was never written (the writer stops at
    // it): a body that says so is not one the store wrote.
    let next_token = r.u64().filter(|t| *t <= crate::config::MAX_TOKEN)?;
    let clock_hwm = r.u64()?;
    let count = r.u32()? as usize;
    // Each change takes at least 6 bytes: never trust `count` for capacity.
    let mut changes = Vec::with_capacity(count.min(buf.len() / 6));
    for _ in 0..count {
        let op = r.u8()?;
        let table = LogTable::from_code(r.u8()?)?;
        let klen = r.u32()? as usize;
        let key = r.take(klen)?;
        changes.push(match op {
            CHANGE_INSERT => {
                let vlen = r.u32()? as usize;
                let value = r.take(vlen)?;
                Change::Insert { table, key, value }
            }
            CHANGE_REMOVE => Change::Remove { table, key },
            _ => return None,
        });
    }
    (r.at == buf.len()).then_some(Body {
        next_token,
        clock_hwm,
        changes,
    })
}

/// The fixed fields of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub body_len: usize,
    pub seq: u64,
    pub epoch: u64,
    pub synced_through: u64,
}

impl FrameHeader {
    fn total_len(&self) -> usize {
        FRAME_HEADER_LEN + self.body_len
    }
}

fn frame_crc(store_id: u128, header: &[u8], body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&store_id.to_le_bytes());
    h.update(&header[..32]);
    h.update(body);
    h.finalize()
}

/// Encodes a frame: header then body.
pub(crate) fn encode_frame(store_id: u128, header: &FrameHeader, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    out.extend_from_slice(&FRAME_MAGIC);
    out.extend_from_slice(&len_u32(body.len()).to_le_bytes());
    out.extend_from_slice(&header.seq.to_le_bytes());
    out.extend_from_slice(&header.epoch.to_le_bytes());
    out.extend_from_slice(&header.synced_through.to_le_bytes());
    let crc = frame_crc(store_id, &out, body);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The log header: what store the log belongs to, in which format.
pub(crate) fn encode_header(store_id: u128) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN as usize];
    out[0..8].copy_from_slice(&LOG_MAGIC);
    out[8..12].copy_from_slice(&LOG_VERSION.to_le_bytes());
    out[12..28].copy_from_slice(&store_id.to_le_bytes());
    let crc = crc32fast::hash(&out[0..28]);
    out[28..32].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The length record for a log of `len` bytes (see [`LENGTH_AT`]).
fn encode_length(len: u64) -> [u8; LENGTH_RECORD_LEN] {
    let mut out = [0u8; LENGTH_RECORD_LEN];
    out[0..4].copy_from_slice(&LENGTH_TAG);
    out[4..12].copy_from_slice(&len.to_le_bytes());
    let crc = crc32fast::hash(&out[0..12]);
    out[12..16].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The length the header of `log` (of `len` bytes) records, or `None`
/// when it records none (a log written before the record existed, or a
/// record torn or damaged: then the log is not judged by it).
fn recorded_len(log: &dyn LogFile, len: u64) -> io::Result<Option<u64>> {
    let end = LENGTH_AT + LENGTH_RECORD_LEN as u64;
    if len < end {
        return Ok(None);
    }
    let mut rec = [0u8; LENGTH_RECORD_LEN];
    log.read_at(LENGTH_AT, &mut rec)?;
    if rec[0..4] != LENGTH_TAG || crc32fast::hash(&rec[0..12]) != le_u32(&rec[12..16]) {
        return Ok(None);
    }
    Ok(Some(le_u64(&rec[4..12])))
}

/// Makes the log's `len` bytes durable, then records `len` as its length
/// in its header, and syncs that: one `fdatasync` orders nothing among the
/// writes it makes durable, so a record synced with the growth it names
/// could reach the disk before the file's new length (see [`LENGTH_AT`]).
fn record_len(file: &dyn LogFile, path: &Path, len: u64) -> Result<()> {
    file.sync_data().map_err(|e| io_err(path, "fsync", &e))?;
    file.write_at(LENGTH_AT, &encode_length(len))
        .map_err(|e| io_err(path, "write", &e))?;
    file.sync_data().map_err(|e| io_err(path, "fsync", &e))
}

/// What the first bytes of a log file say.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeaderState {
    /// Empty or all zero: a log that was never written (or whose creation
    /// was cut short).
    Blank,
    /// A valid header of this format, naming a store.
    Valid { store_id: u128 },
    /// This format's magic, but a damaged header (a torn creation, or
    /// damage).
    Damaged,
    /// Not a log of this format: another file, or another format version.
    Foreign(String),
}

/// Reads and checks the header of `log`.
pub(crate) fn read_header(log: &dyn LogFile) -> io::Result<HeaderState> {
    let len = log.len()?;
    if len == 0 {
        return Ok(HeaderState::Blank);
    }
    let mut head = [0u8; HEADER_USED];
    let n = usize::try_from(len.min(HEADER_USED as u64)).unwrap_or(HEADER_USED);
    log.read_at(0, &mut head[..n])?;
    if head.iter().all(|&b| b == 0) {
        return Ok(HeaderState::Blank);
    }
    if head[0..8] != LOG_MAGIC {
        return Ok(HeaderState::Foreign(
            "not an idemstore write-ahead log (bad magic)".into(),
        ));
    }
    if n < HEADER_USED || crc32fast::hash(&head[0..28]) != le_u32(&head[28..32]) {
        return Ok(HeaderState::Damaged);
    }
    let version = le_u32(&head[8..12]);
    if version != LOG_VERSION {
        return Ok(HeaderState::Foreign(format!(
            "log format version {version}; this build reads version {LOG_VERSION}"
        )));
    }
    let mut id = [0u8; 16];
    id.copy_from_slice(&head[12..28]);
    Ok(HeaderState::Valid {
        store_id: u128::from_le_bytes(id),
    })
}

/// Whether `log`'s header, whose magic number is not this format's, holds
/// `store_id` where a valid header keeps the store's identity (bytes
/// 12..28): a header damaged in its magic number is then this store's, not
/// a foreign file's (128 random bits do not match by chance). A header
/// with this format's magic and another version stays foreign.
fn names_store(log: &dyn LogFile, store_id: u128) -> bool {
    let mut head = [0u8; 28];
    log.len().is_ok_and(|len| len >= 28)
        && log.read_at(0, &mut head).is_ok()
        && head[0..8] != LOG_MAGIC
        && head[12..28] == store_id.to_le_bytes()
}

// ---------------------------------------------------------------------------
// Opening: header checks, replay, the opening checkpoint.

/// What the writer starts from after the log was opened and replayed.
pub(crate) struct Opened {
    pub writer: LogWriter,
    /// The last sequence number the index holds (durably).
    pub last_seq: u64,
    pub next_token: u64,
    /// Tokens below this may be handed out before the next checkpoint.
    pub token_reserved: u64,
    /// How many frames were replayed.
    pub replayed: usize,
    /// Opened with `accept_loss` only: what of the log recovery needed
    /// could not be replayed (changes acknowledged after the last
    /// checkpoint that the index lacks), or `None` when nothing was lost.
    pub log_lost: Option<String>,
}

/// Opens the log of the store whose metadata is `meta`, replays the frames
/// after its last checkpoint into the index, and commits a checkpoint
/// (durable, with redb's quick-repair) that starts a new epoch. After this
/// the log holds nothing the index needs. The same commit persists the
/// store's first time reservation: `reserve_time` is given the clock's
/// high-water mark after the replay and returns the bound to persist
/// (raised to that mark if below it) and what it built from the mark,
/// which is returned beside [`Opened`]. A clean open of an existing store
/// makes no other durable commit (creation, an open that ran the integrity
/// check and a format migration add one each).
///
/// `record_log`, the canonical path of a file log, is recorded in the same
/// checkpoint (`schema::META_LOG_PATH`).
///
/// With `accept_loss` (a salvage's copy, `crate::salvage`), a log that is
/// missing, blank or damaged where a durable frame was opens the store with
/// the index and the frames before the damage, and [`Opened::log_lost`]
/// says what was lost, instead of the [`Error::CorruptLog`] below.
///
/// # Errors
/// - [`Error::IncompatibleFile`] naming the log: it belongs to another store
///   (another identity), is another format version, or is not a log.
/// - [`Error::CorruptLog`]: a durable frame is damaged (see [`recover`]), or
///   the log is missing or its header damaged after an unclean shutdown.
/// - [`Error::Storage`], [`Error::CorruptFile`]: the log or the index cannot
///   be read or written.
// Each argument is one input of the open (the index, the log and its
// names, the metadata, the cap, the record, the time reservation).
#[allow(clippy::too_many_arguments)]
pub(crate) fn open<T>(
    db: &redb::Database,
    path: &Path,
    log_path: &Path,
    log: Arc<dyn LogFile>,
    meta: &super::schema::Meta,
    max_len: u64,
    record_log: Option<&Path>,
    accept_loss: bool,
    reserve_time: impl FnOnce(u64) -> (u64, T),
) -> Result<(Opened, T)> {
    use super::pending::Pending;
    use super::schema::{Checkpoint, Tables, guard, map_err, write_checkpoint};

    let header = read_header(log.as_ref()).map_err(|e| io_err(log_path, "read", &e))?;
    let lost = |what: &str| Error::CorruptLog {
        path: log_path.to_path_buf(),
        offset: 0,
        detail: format!(
            "{what} after an unclean shutdown: changes acknowledged since the last \
             checkpoint cannot be recovered"
        ),
    };
    // With `accept_loss` after an unclean shutdown: what became of the
    // log's header (its frames are still read: their checksums are keyed
    // by the store's identity, not by the header).
    let mut header_lost = None;
    let header_valid = matches!(header, HeaderState::Valid { .. });
    // A header whose magic number is damaged but that names this store
    // is this store's, damaged: not another file.
    let header = match header {
        HeaderState::Foreign(_) if names_store(log.as_ref(), meta.store_id) => HeaderState::Damaged,
        other => other,
    };
    match header {
        HeaderState::Valid { store_id } if store_id == meta.store_id => {}
        HeaderState::Valid { store_id } => {
            return Err(Error::IncompatibleFile {
                path: log_path.to_path_buf(),
                detail: format!(
                    "the write-ahead log belongs to store {store_id:032x}, not to {:032x} ({})",
                    meta.store_id,
                    path.display()
                ),
            });
        }
        HeaderState::Foreign(detail) if accept_loss && !meta.clean => {
            header_lost = Some(format!(
                "the write-ahead log's header is unreadable ({detail})"
            ));
            LogWriter::initialise(log.as_ref(), log_path, meta.store_id, max_len)?;
        }
        HeaderState::Foreign(detail) => {
            return Err(Error::IncompatibleFile {
                path: log_path.to_path_buf(),
                detail,
            });
        }
        HeaderState::Blank if meta.clean => {
            LogWriter::initialise(log.as_ref(), log_path, meta.store_id, max_len)?;
        }
        HeaderState::Damaged if meta.clean => {
            LogWriter::initialise(log.as_ref(), log_path, meta.store_id, max_len)?;
        }
        HeaderState::Blank | HeaderState::Damaged if accept_loss => {
            header_lost = Some(
                if matches!(header, HeaderState::Blank) {
                    "the write-ahead log is empty or missing"
                } else {
                    "the write-ahead log's header is damaged"
                }
                .to_string(),
            );
            // A new header over the old; the frames after it stay.
            LogWriter::initialise(log.as_ref(), log_path, meta.store_id, max_len)?;
        }
        HeaderState::Blank => return Err(lost("the write-ahead log is empty or missing")),
        HeaderState::Damaged => return Err(lost("the write-ahead log's header is damaged")),
    }

    // A checkpoint commits its new epoch to the index before the log is
    // written in it, and every epoch writes from the log's start: the
    // frame there is of the index's epoch or an earlier one. One of a
    // later epoch means the index is older than its log: redb fell back to
    // an older commit (its header damaged), or an older copy of the file
    // was put beside a newer log. The changes committed since are in
    // neither (the log was wrapped over them), so the store is refused,
    // clean flag or not: a clean older commit skipped the log, and a
    // recovery stopped at the first frame of another epoch, and both
    // opened without them.
    let mut index_behind = None;
    if header_valid {
        let len = log.len().map_err(|e| io_err(log_path, "stat", &e))?;
        if let Some((h, _)) = read_frame(log.as_ref(), log_path, HEADER_LEN, len, meta.store_id)?
            && h.epoch > meta.log_epoch
        {
            let detail = format!(
                "the store's last commit (log epoch {}) is older than its write-ahead log, \
                 whose first frame is of epoch {} ({}): the file fell back to an older \
                 commit (damage to its header) or is an older copy beside a newer log, and \
                 the changes committed after it are lost (a copy put back on purpose goes \
                 with the log that was beside it when it was made, or with none; else \
                 restore a backup, or salvage what is left: docs/operations.md)",
                meta.log_epoch,
                h.epoch,
                log_path.display()
            );
            if !accept_loss {
                return Err(Error::CorruptFile {
                    path: path.to_path_buf(),
                    detail,
                });
            }
            index_behind = Some(detail);
        }
    }
    let index_is_behind = index_behind.is_some();
    let recovered = if meta.clean || index_is_behind {
        None
    } else {
        Some(recover(
            log.as_ref(),
            log_path,
            meta.store_id,
            meta.log_epoch,
            meta.log_base,
            accept_loss,
        )?)
    };
    let chain_lost = recovered
        .as_ref()
        .and_then(|r| r.lost.as_ref())
        .map(|(offset, detail)| {
            format!("at offset {offset}: {detail}; no frame from there on was replayed")
        });
    // Without its header, the log cannot say what it held: what it still
    // holds is replayed, and the rest is taken as lost.
    let chain_lost = index_behind.or(chain_lost);
    let log_lost = match (header_lost, chain_lost) {
        (Some(header), chain) => Some(format!(
            "{header} after an unclean shutdown: the {} frames found after it were replayed, \
             and any change past them is lost{}",
            recovered
                .as_ref()
                .map_or(0, |r| r.count_after(meta.applied_seq)),
            chain.map(|c| format!(" ({c})")).unwrap_or_default()
        )),
        (None, chain) => chain,
    };
    let replayed = recovered
        .as_ref()
        .map_or(0, |r| r.count_after(meta.applied_seq));
    let mut last_seq = meta.applied_seq.max(meta.log_base);
    // After an unclean shutdown, tokens up to the reservation may have been
    // handed out by changes that were lost (buffered mode): skip them.
    let mut next_token = if meta.clean {
        meta.next_token
    } else {
        meta.next_token.max(meta.token_reserved)
    };
    let mut clock_hwm = meta.clock_hwm;
    if index_is_behind {
        // The log's frames were written after the index's last commit:
        // their changes are lost, but the tokens they handed out must not
        // be handed out again, and the store's time must not run back
        // behind theirs. Tokens up to the newer index's reservation may
        // have gone to frames past the chain: skip a reservation beyond the
        // highest counter the chain records.
        let (token, hwm) = chain_counters(log.as_ref(), log_path, meta.store_id)?;
        next_token = next_token.max(reserve_tokens(token));
        clock_hwm = clock_hwm.max(hwm);
    }
    if let Some(r) = &recovered {
        tracing::info!(
            log = %log_path.display(),
            frames = replayed,
            chain_end_seq = r.last_seq(meta.log_base),
            end = r.end,
            torn_tail = r.discarded_tail,
            "recovering from the write-ahead log after an unclean shutdown"
        );
    }
    let epoch = meta.log_epoch + 1;
    let made = guard(path, || {
        let mut txn = db.begin_write().map_err(|e| map_err(path, e))?;
        txn.set_quick_repair(true);
        // The replay goes through the writer's buffer: a record or expiry
        // entry changed by several frames (a claim, then its completion)
        // reaches the index once per application of the buffer, with its
        // last change, in key order, which ends the tables as applying each
        // change in turn would (`pending.rs`). Business-key changes go to
        // the index at once, as in the writer.
        let mut pending = Pending::default();
        let (tally, made) = {
            let mut tables = Tables::open(path, &txn, false).buffering(&mut pending);
            if let Some(r) = &recovered {
                // One frame in memory at a time, and buffered changes up to
                // `MAX_PENDING_BYTES` (estimated) plus one frame's.
                r.replay_after(log.as_ref(), log_path, meta.applied_seq, |frame| {
                    for change in &frame.body.changes {
                        if !tables.apply(*change)? {
                            return Err(Error::CorruptLog {
                                path: log_path.to_path_buf(),
                                offset: frame.offset,
                                detail: format!("frame {} holds a malformed change", frame.seq),
                            });
                        }
                    }
                    if tables.pending_full() {
                        tables.apply_pending()?;
                    }
                    last_seq = frame.seq;
                    next_token = next_token.max(frame.body.next_token);
                    clock_hwm = clock_hwm.max(frame.body.clock_hwm);
                    Ok(())
                })?;
                tables.apply_pending()?;
            }
            let (bound, made) = reserve_time(clock_hwm);
            tables.set_counters(next_token, bound.max(clock_hwm), last_seq)?;
            (tables.finish().tally, made)
        };
        super::schema::write_tally(path, &txn, tally)?;
        if let Some(log) = record_log {
            super::schema::record_log_path(path, &txn, log)?;
        }
        write_checkpoint(
            path,
            &txn,
            Checkpoint {
                epoch,
                base: last_seq,
                clean: false,
                token_reserved: reserve_tokens(next_token),
            },
        )?;
        txn.commit().map_err(|e| map_err(path, e))?;
        Ok(made)
    })?;
    let writer = LogWriter::start(log, log_path.to_path_buf(), meta.store_id, epoch, max_len)?;
    let opened = Opened {
        writer,
        last_seq,
        next_token,
        token_reserved: reserve_tokens(next_token),
        replayed: usize::try_from(replayed).unwrap_or(usize::MAX),
        log_lost,
    };
    Ok((opened, made))
}

// ---------------------------------------------------------------------------
// Recovery

/// What recovery found after the last checkpoint: where the chain of
/// frames ends. The frames themselves stay in the log and are read again,
/// one at a time, by [`Recovered::replay_after`], so recovery holds at most
/// one frame (and one [`SCAN_CHUNK`] buffer) of the log in memory, whatever
/// the log's size, besides the write buffer the replay applies through
/// (bounded by `pending::MAX_PENDING_BYTES` plus one frame's changes).
pub(crate) struct Recovered {
    store_id: u128,
    /// The sequence number of the last checkpoint (the chain starts after
    /// it).
    base: u64,
    /// The last sequence number of the chain, or `base` when it is empty.
    last: u64,
    /// Where the chain ends (the first byte after its last frame).
    pub end: u64,
    /// Whether non-zero bytes follow the chain (a torn tail, or frames of
    /// an earlier epoch): they are ignored; recovery logs the fact.
    pub discarded_tail: bool,
    /// Recovered with `accept_loss` only: the offset where the chain broke
    /// and why frames past it, durable ones among them, are not replayed.
    pub lost: Option<(u64, String)>,
}

/// One frame of the chain, decoded.
pub(crate) struct RecoveredFrame<'a> {
    pub seq: u64,
    pub offset: u64,
    pub body: Body<'a>,
}

/// The bytes the scan past the chain reads at a time.
pub(crate) const SCAN_CHUNK: usize = 64 * 1024;

impl Recovered {
    /// The last sequence number of the chain, or `base` when it is empty.
    pub(crate) fn last_seq(&self, base: u64) -> u64 {
        if self.last == self.base {
            base
        } else {
            self.last
        }
    }

    /// How many frames of the chain have a sequence number above `after`.
    pub(crate) fn count_after(&self, after: u64) -> u64 {
        self.last.saturating_sub(after.max(self.base))
    }

    /// Reads the chain's frames with a sequence number above `after` from
    /// `log`, one at a time, and hands each, decoded, to `apply`.
    ///
    /// # Errors
    /// [`Error::CorruptLog`] for a frame whose checksum passed but whose
    /// body does not decode, or that changed since [`recover`] read it;
    /// [`Error::Storage`] when the log cannot be read; `apply`'s errors.
    pub(crate) fn replay_after(
        &self,
        log: &dyn LogFile,
        path: &Path,
        after: u64,
        mut apply: impl FnMut(&RecoveredFrame<'_>) -> Result<()>,
    ) -> Result<()> {
        let len = log.len().map_err(|e| io_err(path, "read", &e))?;
        let mut at = HEADER_LEN;
        let mut expect = self.base;
        while expect < self.last {
            let corrupt = |detail: String| Error::CorruptLog {
                path: path.to_path_buf(),
                offset: at,
                detail,
            };
            let Some((h, body)) = read_frame(log, path, at, len, self.store_id)? else {
                return Err(corrupt(format!(
                    "frame {} changed while the log was being recovered",
                    expect + 1
                )));
            };
            if h.seq != expect + 1 {
                return Err(corrupt(format!(
                    "frame {} changed while the log was being recovered",
                    expect + 1
                )));
            }
            if h.seq > after {
                let decoded = decode_body(&body).ok_or_else(|| {
                    corrupt(format!(
                        "frame {} has a valid checksum but a malformed body",
                        h.seq
                    ))
                })?;
                apply(&RecoveredFrame {
                    seq: h.seq,
                    offset: at,
                    body: decoded,
                })?;
            }
            expect = h.seq;
            at = at.saturating_add(h.total_len() as u64);
        }
        Ok(())
    }
}

/// Reads the frame at `at` of a log of `len` bytes: its magic, length and
/// checksum must all be right. `None` for anything else (zeros, a torn or
/// damaged frame, the middle of an older frame, another store's frame).
/// Allocates only for a frame whose whole length lies inside the log.
fn read_frame(
    log: &dyn LogFile,
    path: &Path,
    at: u64,
    len: u64,
    store_id: u128,
) -> Result<Option<(FrameHeader, Vec<u8>)>> {
    let Some(body_start) = at.checked_add(FRAME_HEADER_LEN as u64) else {
        return Ok(None);
    };
    if body_start > len {
        return Ok(None);
    }
    let mut head = [0u8; FRAME_HEADER_LEN];
    log.read_at(at, &mut head)
        .map_err(|e| io_err(path, "read", &e))?;
    if head[0..4] != FRAME_MAGIC {
        return Ok(None);
    }
    let body_len = le_u32(&head[4..8]) as usize;
    if body_len > MAX_BODY_LEN || body_start.saturating_add(body_len as u64) > len {
        return Ok(None);
    }
    let mut body = vec![0u8; body_len];
    log.read_at(body_start, &mut body)
        .map_err(|e| io_err(path, "read", &e))?;
    if frame_crc(store_id, &head, &body) != le_u32(&head[32..36]) {
        return Ok(None);
    }
    let header = FrameHeader {
        body_len,
        seq: le_u64(&head[8..16]),
        epoch: le_u64(&head[16..24]),
        synced_through: le_u64(&head[24..32]),
    };
    Ok(Some((header, body)))
}

/// The highest token counter and clock high-water mark recorded by the
/// chain of frames at the log's start, whatever its epoch (`(0, 0)` for a
/// log with none): what a store whose index is older than its log had
/// handed out since that index's last commit. Reads each frame of the
/// chain once, one at a time; a frame whose body does not decode counts for
/// nothing.
///
/// # Errors
/// [`Error::Storage`] when the log cannot be read.
fn chain_counters(log: &dyn LogFile, path: &Path, store_id: u128) -> Result<(u64, u64)> {
    let len = log.len().map_err(|e| io_err(path, "read", &e))?;
    let mut at = HEADER_LEN;
    let mut last: Option<(u64, u64)> = None;
    let (mut token, mut hwm) = (0u64, 0u64);
    while let Some((h, body)) = read_frame(log, path, at, len, store_id)? {
        if last.is_some_and(|(epoch, seq)| h.epoch != epoch || Some(h.seq) != seq.checked_add(1)) {
            break;
        }
        if let Some(b) = decode_body(&body) {
            token = token.max(b.next_token);
            hwm = hwm.max(b.clock_hwm);
        }
        last = Some((h.epoch, h.seq));
        at = at.saturating_add(h.total_len() as u64);
    }
    Ok((token, hwm))
}

/// Reads the log after the checkpoint that began `epoch` at sequence
/// number `base`, one frame (or one [`SCAN_CHUNK`]) at a time.
///
/// The chain is the run of frames from the first frame position, of this
/// epoch, with sequence numbers `base + 1, base + 2, …`. It ends at the
/// first position that does not hold its next frame. What follows is a torn
/// tail (a batch whose write was cut by the crash, and any batch after it
/// that was not yet known to be durable) or older frames, and is ignored —
/// unless a later frame of this epoch says, by its `synced_through` field,
/// that the missing frame had already been made durable: then a durable
/// frame was damaged, and recovery stops with [`Error::CorruptLog`] rather
/// than silently losing acknowledged changes.
///
/// With `accept_loss` (a salvage: `crate::salvage`), the chain is kept
/// and what the damage cost is returned as [`Recovered::lost`] instead of
/// the [`Error::CorruptLog`] below.
///
/// # Errors
/// [`Error::CorruptLog`] as above (naming the log and the offset where the
/// chain broke), [`Error::Storage`] when the log cannot be read.
pub(crate) fn recover(
    log: &dyn LogFile,
    path: &Path,
    store_id: u128,
    epoch: u64,
    base: u64,
    accept_loss: bool,
) -> Result<Recovered> {
    let len = log.len().map_err(|e| io_err(path, "read", &e))?;

    let mut at = HEADER_LEN;
    let mut last = base;
    while let Some((h, _)) = read_frame(log, path, at, len, store_id)? {
        if h.epoch != epoch || Some(h.seq) != last.checked_add(1) {
            break;
        }
        last = h.seq;
        at = at.saturating_add(h.total_len() as u64);
    }
    let end = at;

    // Look past the chain for a frame of this epoch that proves the missing
    // frame `last + 1` was durable, a chunk at a time. The tail is hostile
    // input as much as a torn write: every chunk is read once and searched
    // in place, a candidate's header is judged from the chunk, and only a
    // candidate whose header claims a later frame of this epoch has its
    // body read and checked, within a budget of verified bytes (twice the
    // log), so that no arrangement of bytes makes recovery read more than
    // a few times the log.
    let mut discarded_tail = false;
    let mut pos = end;
    let mut chunk = Vec::new();
    let budget = len.saturating_mul(2);
    let mut verified: u64 = 0;
    // With `accept_loss`: where the chain broke and what was lost there.
    let mut lost: Option<(u64, String)> = None;
    'scan: while pos < len {
        let n = usize::try_from((len - pos).min(SCAN_CHUNK as u64)).unwrap_or(SCAN_CHUNK);
        chunk.resize(n, 0);
        log.read_at(pos, &mut chunk)
            .map_err(|e| io_err(path, "read", &e))?;
        let mut from = 0usize;
        // Where the scan goes on after this chunk.
        let mut next = None;
        while let Some(rel) = chunk[from..]
            .windows(FRAME_MAGIC.len())
            .position(|w| w == FRAME_MAGIC)
        {
            let at = from + rel;
            let cand = pos + at as u64;
            // The header from the chunk, or read when the chunk cuts it.
            let mut head = [0u8; FRAME_HEADER_LEN];
            match chunk.get(at..at + FRAME_HEADER_LEN) {
                Some(h) => head.copy_from_slice(h),
                None if cand.saturating_add(FRAME_HEADER_LEN as u64) <= len => log
                    .read_at(cand, &mut head)
                    .map_err(|e| io_err(path, "read", &e))?,
                None => {
                    from = at + 1;
                    continue;
                }
            }
            let body_len = u64::from(le_u32(&head[4..8]));
            let whole = cand
                .checked_add(FRAME_HEADER_LEN as u64)
                .and_then(|b| b.checked_add(body_len))
                .is_some_and(|e| e <= len);
            let claims_later = le_u64(&head[16..24]) == epoch && le_u64(&head[8..16]) > last;
            if !claims_later || !whole {
                from = at + 1;
                continue;
            }
            verified = verified.saturating_add(body_len);
            if verified > budget {
                let detail = format!(
                    "past the end of the log's chain, damaged frame headers claim more \
                     than twice the log's {len} bytes of frames: the log is not a torn \
                     write of this store"
                );
                if accept_loss {
                    lost = Some((end, detail));
                    break 'scan;
                }
                return Err(Error::CorruptLog {
                    path: path.to_path_buf(),
                    offset: cand,
                    detail,
                });
            }
            match read_frame(log, path, cand, len, store_id)? {
                Some((h, _)) if h.epoch == epoch && h.seq > last => {
                    discarded_tail = true;
                    if h.synced_through > last {
                        let detail = format!(
                            "frame {} is missing or damaged, but frame {} at offset {cand} \
                             records that frames up to {} were durable",
                            last + 1,
                            h.seq,
                            h.synced_through
                        );
                        if accept_loss {
                            lost = Some((end, detail));
                            break 'scan;
                        }
                        return Err(Error::CorruptLog {
                            path: path.to_path_buf(),
                            offset: end,
                            detail,
                        });
                    }
                    let after = cand.saturating_add(h.total_len() as u64);
                    match usize::try_from(after - pos).ok().filter(|&a| a < n) {
                        Some(a) => from = a,
                        None => {
                            next = Some(after);
                            break;
                        }
                    }
                }
                _ => from = at + 1,
            }
        }
        pos = match next {
            Some(after) => after,
            // A magic cut by the chunk's end is found by the next chunk.
            None if pos + n as u64 >= len => len,
            None => pos + n.saturating_sub(FRAME_MAGIC.len() - 1).max(1) as u64,
        };
    }
    // Anything but zeros where the next frame would start was cut off.
    if end < len {
        let n = usize::try_from((len - end).min(FRAME_HEADER_LEN as u64)).unwrap_or(0);
        let mut next = vec![0u8; n];
        log.read_at(end, &mut next)
            .map_err(|e| io_err(path, "read", &e))?;
        discarded_tail |= next.iter().any(|&b| b != 0);
    }
    // A log shorter than the length its header records was cut: the
    // frames it held past its end may have been durable, and nothing
    // after the chain can tell.
    if let Some(recorded) = recorded_len(log, len).map_err(|e| io_err(path, "read", &e))?
        && recorded > len
    {
        let detail = format!(
            "the log is {len} bytes long, but the store made it {recorded} bytes: it was \
             cut short (a partial copy, a truncation), and the changes it held past byte \
             {len} are lost"
        );
        if !accept_loss {
            return Err(Error::CorruptLog {
                path: path.to_path_buf(),
                offset: len,
                detail,
            });
        }
        lost = lost.or(Some((end, detail)));
    }
    Ok(Recovered {
        store_id,
        base,
        last,
        end,
        discarded_tail,
        lost,
    })
}

fn io_err(path: &Path, what: &str, e: &io::Error) -> Error {
    Error::Storage(format!("{}: log {what} failed: {e}", path.display()))
}

// ---------------------------------------------------------------------------
// Writing

/// The writer's side of the log: where the next frame goes.
pub(crate) struct LogWriter {
    file: Arc<dyn LogFile>,
    path: PathBuf,
    store_id: u128,
    /// The checkpoint epoch frames are written in.
    epoch: u64,
    /// Where the next frame goes.
    pos: u64,
    /// The log's length (bytes in use as log space, from offset 0).
    len: u64,
    /// The length the log may grow to on its own.
    max_len: u64,
}

impl LogWriter {
    /// Opens the log for writing after recovery: frames of `epoch` start at
    /// the first frame position. Extends a log shorter than its initial size.
    pub(crate) fn start(
        file: Arc<dyn LogFile>,
        path: PathBuf,
        store_id: u128,
        epoch: u64,
        max_len: u64,
    ) -> Result<LogWriter> {
        let len = file.len().map_err(|e| io_err(&path, "stat", &e))?;
        let mut w = LogWriter {
            file,
            path,
            store_id,
            epoch,
            pos: HEADER_LEN,
            len,
            max_len,
        };
        let initial = INITIAL_LOG_BYTES.min(max_len);
        if w.len < initial {
            w.grow_to(initial)?;
        }
        // A log of an older build, or one whose growth a crash cut before
        // its record: the length it has now is recorded once made durable
        // (a killed process's growth may be in the page cache only).
        let recorded =
            recorded_len(w.file.as_ref(), w.len).map_err(|e| io_err(&w.path, "read", &e))?;
        if recorded != Some(w.len) {
            record_len(w.file.as_ref(), &w.path, w.len)?;
        }
        Ok(w)
    }

    /// Writes a fresh header for `store_id` and zero space after it, and
    /// syncs: the log of a new store, or one whose previous contents are
    /// known to be obsolete.
    pub(crate) fn initialise(
        file: &dyn LogFile,
        path: &Path,
        store_id: u128,
        max_len: u64,
    ) -> Result<()> {
        file.write_at(0, &encode_header(store_id))
            .map_err(|e| io_err(path, "write", &e))?;
        let initial = INITIAL_LOG_BYTES.min(max_len);
        let len = file.len().map_err(|e| io_err(path, "stat", &e))?;
        zero_fill(file, path, len.max(HEADER_LEN), initial)?;
        let len = file.len().map_err(|e| io_err(path, "stat", &e))?;
        record_len(file, path, len)
    }

    /// The epoch frames are written in.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether a frame of `frame_len` bytes fits before the end of the log.
    pub(crate) fn fits(&self, frame_len: usize) -> bool {
        self.pos.saturating_add(frame_len as u64) <= self.len
    }

    /// Makes the frames written so far durable (`fdatasync`).
    pub(crate) fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| io_err(&self.path, "fsync", &e))
    }

    /// Writes frame `seq` at the next position. Not durable until the file
    /// is synced.
    pub(crate) fn append(&mut self, seq: u64, synced_through: u64, body: &[u8]) -> Result<usize> {
        let header = FrameHeader {
            body_len: body.len(),
            seq,
            epoch: self.epoch,
            synced_through,
        };
        let frame = encode_frame(self.store_id, &header, body);
        self.file
            .write_at(self.pos, &frame)
            .map_err(|e| io_err(&self.path, "write", &e))?;
        self.pos += frame.len() as u64;
        Ok(frame.len())
    }

    /// Starts the log over after a checkpoint: frames of `epoch` are written
    /// from the first frame position again. When the checkpoint was forced
    /// by a full log, the log doubles, up to its maximum and never past it:
    /// a batch whose frame does not fit even an empty log of the maximum
    /// size is not written to the log at all, but committed to the index
    /// by a checkpoint of its own (see `commit.rs`).
    pub(crate) fn wrap(&mut self, epoch: u64, was_full: bool) -> Result<()> {
        self.epoch = epoch;
        self.pos = HEADER_LEN;
        let mut target = self.len;
        if was_full && self.len < self.max_len {
            target = self.len.saturating_mul(2).min(self.max_len);
        }
        if target > self.len {
            self.grow_to(target)?;
        }
        Ok(())
    }

    fn grow_to(&mut self, len: u64) -> Result<()> {
        zero_fill(
            self.file.as_ref(),
            &self.path,
            self.len.max(HEADER_LEN),
            len,
        )?;
        record_len(self.file.as_ref(), &self.path, len)?;
        self.len = len;
        Ok(())
    }
}

/// Writes zeros over `[from, to)`: the log is preallocated with real blocks
/// (not a sparse hole or an unwritten extent) so that later overwrites sync
/// data only, without a journal commit for the file's size or extents.
fn zero_fill(file: &dyn LogFile, path: &Path, from: u64, to: u64) -> Result<()> {
    const CHUNK: u64 = 1024 * 1024;
    let zeros = vec![0u8; CHUNK as usize];
    let mut at = from;
    while at < to {
        let n = (to - at).min(CHUNK);
        file.write_at(at, &zeros[..n as usize])
            .map_err(|e| io_err(path, "write", &e))?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(n: u8) -> Vec<u8> {
        let mut w = BodyWriter::new();
        w.insert(LogTable::Records, &[b"key", &[n]], b"value");
        w.remove(LogTable::Expiry, &[&7u64.to_le_bytes(), b"key"]);
        w.finish(u64::from(n) + 10, 99)
    }

    fn log_with(frames: u8, synced: impl Fn(u64) -> u64) -> (MemoryLog, Vec<u64>) {
        let log = MemoryLog::new();
        LogWriter::initialise(&log, Path::new("t"), 7, 1 << 20).unwrap();
        let mut w = LogWriter::start(Arc::new(log.clone()), "t".into(), 7, 3, 1 << 20).unwrap();
        let mut offsets = Vec::new();
        for i in 1..=frames {
            offsets.push(w.pos);
            w.append(10 + u64::from(i), synced(10 + u64::from(i)), &body(i))
                .unwrap();
        }
        (log, offsets)
    }

    #[test]
    fn body_round_trip() {
        let b = body(4);
        let d = decode_body(&b).unwrap();
        assert_eq!((d.next_token, d.clock_hwm), (14, 99));
        assert_eq!(
            d.changes,
            vec![
                Change::Insert {
                    table: LogTable::Records,
                    key: b"key\x04",
                    value: b"value"
                },
                Change::Remove {
                    table: LogTable::Expiry,
                    key: &[7, 0, 0, 0, 0, 0, 0, 0, b'k', b'e', b'y']
                },
            ]
        );
        for cut in 0..b.len() {
            assert!(decode_body(&b[..cut]).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn a_body_whose_token_counter_is_past_the_cap_is_malformed() {
        let mut w = BodyWriter::new();
        w.insert(LogTable::Records, &[b"key"], b"value");
        let at_cap = w.finish(crate::config::MAX_TOKEN, 99);
        assert!(decode_body(&at_cap).is_some());
        let mut w = BodyWriter::new();
        w.insert(LogTable::Records, &[b"key"], b"value");
        assert!(decode_body(&w.finish(crate::config::MAX_TOKEN + 1, 99)).is_none());
    }

    #[test]
    fn the_header_records_the_length_and_a_shorter_log_was_cut() {
        let (grown, _) = log_with(3, |s| s - 1);
        let len = grown.len().unwrap();
        assert_eq!(recorded_len(&grown, len).unwrap(), Some(1 << 20));
        // Grown by a full log's checkpoint: the record follows.
        let mut w = LogWriter::start(Arc::new(grown.clone()), "t".into(), 7, 4, 1 << 22).unwrap();
        w.wrap(5, true).unwrap();
        assert_eq!(
            recorded_len(&grown, grown.len().unwrap()).unwrap(),
            Some(2 << 20)
        );
        // Cut at the last frame: refused, or with `accept_loss` the chain
        // before the cut is kept and the loss said.
        let (log, offsets) = log_with(3, |s| s - 1);
        let mut bytes = log.contents();
        bytes.truncate(usize::try_from(offsets[2]).unwrap());
        log.set_contents(bytes);
        match recover(&log, Path::new("t"), 7, 3, 10, false) {
            Err(Error::CorruptLog { offset, detail, .. }) => {
                assert_eq!(offset, offsets[2]);
                assert!(detail.contains("cut short"), "{detail}");
            }
            other => panic!("expected CorruptLog, got {:?}", other.map(|r| r.last)),
        }
        let r = recover(&log, Path::new("t"), 7, 3, 10, true).unwrap();
        assert_eq!(r.last_seq(10), 12);
        assert!(
            r.lost
                .is_some_and(|(at, d)| at == offsets[2] && d.contains("cut short"))
        );
        // A log of an older build (no record) is not judged by it, and its
        // next writer records the length it has.
        for cut in [8192, 1 << 20] {
            let (old, _) = log_with(1, |s| s - 1);
            let mut bytes = old.contents();
            bytes[32..48].fill(0);
            bytes.truncate(cut);
            old.set_contents(bytes);
            assert_eq!(recorded_len(&old, cut as u64).unwrap(), None);
            let r = recover(&old, Path::new("t"), 7, 3, 10, false).unwrap();
            assert_eq!(r.last_seq(10), 11);
            // Cut to 8192 bytes: grown back to the initial 1 MiB, which is
            // recorded; as long already: its length recorded as it is.
            LogWriter::start(Arc::new(old.clone()), "t".into(), 7, 4, 1 << 20).unwrap();
            assert_eq!(recorded_len(&old, 1 << 20).unwrap(), Some(1 << 20));
        }
    }

    #[test]
    fn chain_is_read_in_order() {
        let (log, _) = log_with(5, |s| s - 1);
        let r = recover(&log, Path::new("t"), 7, 3, 10, false).unwrap();
        assert_eq!(r.last_seq(10), 15);
        let mut seqs = Vec::new();
        r.replay_after(&log, Path::new("t"), 12, |f| {
            seqs.push((f.seq, f.body.next_token));
            Ok(())
        })
        .unwrap();
        assert_eq!(seqs, vec![(13, 13), (14, 14), (15, 15)]);
        assert_eq!(r.count_after(12), 3);
        assert!(!r.discarded_tail);
        // Another store or another epoch sees no frame.
        assert_eq!(
            recover(&log, Path::new("t"), 8, 3, 10, false)
                .unwrap()
                .last_seq(10),
            10
        );
        assert_eq!(
            recover(&log, Path::new("t"), 7, 4, 10, false)
                .unwrap()
                .last_seq(10),
            10
        );
    }

    #[test]
    fn torn_tail_ends_the_chain() {
        let (log, offsets) = log_with(5, |s| s - 1);
        let mut bytes = log.contents();
        let last = offsets[4] as usize;
        for b in &mut bytes[last + 10..last + 20] {
            *b ^= 0xff;
        }
        log.set_contents(bytes);
        let r = recover(&log, Path::new("t"), 7, 3, 10, false).unwrap();
        assert_eq!(r.last_seq(10), 14);
        assert_eq!(r.end, offsets[4]);
        assert!(r.discarded_tail);
    }

    #[test]
    fn unsynced_frames_after_a_hole_are_a_torn_tail() {
        // Frames 13..15 were written before 12 was known durable (buffered
        // mode, or a pipelined fsync): losing 12 loses them too.
        let (log, offsets) = log_with(5, |_| 11);
        let mut bytes = log.contents();
        bytes[offsets[1] as usize + 40] ^= 1;
        log.set_contents(bytes);
        let r = recover(&log, Path::new("t"), 7, 3, 10, false).unwrap();
        assert_eq!(r.last_seq(10), 11);
        assert!(r.discarded_tail);
    }

    #[test]
    fn damaged_durable_frame_is_corruption() {
        let (log, offsets) = log_with(5, |s| s - 1);
        let mut bytes = log.contents();
        bytes[offsets[2] as usize + 40] ^= 1;
        log.set_contents(bytes);
        match recover(&log, Path::new("t"), 7, 3, 10, false) {
            Err(Error::CorruptLog { offset, .. }) => assert_eq!(offset, offsets[2]),
            other => panic!("expected corruption, got {:?}", other.map(|r| r.end)),
        }
    }

    /// A log that counts the bytes read from it.
    #[derive(Clone)]
    struct Counted {
        log: MemoryLog,
        read: Arc<std::sync::atomic::AtomicU64>,
    }

    impl LogFile for Counted {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.read
                .fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.log.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.log.write_at(offset, data)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.log.sync_data()
        }
        fn len(&self) -> std::io::Result<u64> {
            self.log.len()
        }
    }

    /// Hostile bytes past the chain: frame headers packed back to back,
    /// each claiming a later frame of this epoch with a long body. The scan
    /// reads a bounded multiple of the log (not a body per header), and
    /// refuses the log rather than read on.
    #[test]
    fn packed_fake_headers_past_the_chain_cost_a_bounded_read() {
        let (log, _) = log_with(2, |s| s - 1);
        let start = recover(&log, Path::new("t"), 7, 3, 10, false).unwrap().end as usize + 64;
        let mut bytes = log.contents();
        let len = bytes.len();
        let mut at = start;
        // Whole headers, back to back (a header is 36 bytes).
        while at + FRAME_HEADER_LEN <= len {
            bytes[at..at + 4].copy_from_slice(&FRAME_MAGIC);
            // body_len, seq, epoch, synced_through: a later frame of epoch 3.
            bytes[at + 4..at + 8].copy_from_slice(&(((len - at) as u32) / 2).to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&99u64.to_le_bytes());
            bytes[at + 16..at + 24].copy_from_slice(&3u64.to_le_bytes());
            at += FRAME_HEADER_LEN;
        }
        log.set_contents(bytes);
        let counted = Counted {
            log: log.clone(),
            read: Arc::default(),
        };
        let result = recover(&counted, Path::new("t"), 7, 3, 10, false);
        let read = counted.read.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            read <= 4 * len as u64,
            "recovery read {read} bytes of a {len}-byte log"
        );
        match result {
            Err(Error::CorruptLog { detail, .. }) => assert!(detail.contains("twice"), "{detail}"),
            other => panic!("expected a refusal, got {:?}", other.map(|r| r.end)),
        }
    }

    /// Frame magics packed past the chain whose headers claim nothing of
    /// this epoch are passed over in place: the tail is read about once.
    #[test]
    fn packed_foreign_magics_are_read_once() {
        let (log, _) = log_with(2, |s| s - 1);
        let mut at = recover(&log, Path::new("t"), 7, 3, 10, false).unwrap().end as usize + 64;
        let mut bytes = log.contents();
        let len = bytes.len();
        while at + 4 <= len {
            bytes[at..at + 4].copy_from_slice(&FRAME_MAGIC);
            at += 4;
        }
        log.set_contents(bytes);
        let counted = Counted {
            log: log.clone(),
            read: Arc::default(),
        };
        let r = recover(&counted, Path::new("t"), 7, 3, 10, false).unwrap();
        assert_eq!(r.last_seq(10), 12);
        let read = counted.read.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            read <= 3 * len as u64,
            "recovery read {read} bytes of a {len}-byte log"
        );
    }

    #[test]
    fn header_states() {
        let log = MemoryLog::new();
        assert_eq!(read_header(&log).unwrap(), HeaderState::Blank);
        log.set_contents(encode_header(42));
        assert_eq!(
            read_header(&log).unwrap(),
            HeaderState::Valid { store_id: 42 }
        );
        let mut bad = encode_header(42);
        bad[13] ^= 1;
        log.set_contents(bad);
        assert_eq!(read_header(&log).unwrap(), HeaderState::Damaged);
        let mut newer = encode_header(42);
        newer[8] = 2;
        let crc = crc32fast::hash(&newer[0..28]);
        newer[28..32].copy_from_slice(&crc.to_le_bytes());
        log.set_contents(newer);
        assert!(matches!(
            read_header(&log).unwrap(),
            HeaderState::Foreign(_)
        ));
        log.set_contents(b"hello world".to_vec());
        assert!(matches!(
            read_header(&log).unwrap(),
            HeaderState::Foreign(_)
        ));
    }
}
