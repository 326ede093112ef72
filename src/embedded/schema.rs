//! The on-disk schema: redb tables, metadata entries, opening and format
//! checks, and the boundary that turns redb errors and panics into ours.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::Instant;

use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table, TableDefinition,
    TableHandle, WriteTransaction,
};

use super::expiry_counts::{self, EXPIRY_COUNTS};
use super::fence::{Fence, Fenced};
use super::pending::{EntryChange, Pending};
use super::wal::{BodyWriter, Change, LogTable};
use crate::codec;
use crate::error::{Error, Result};

/// Records: stored key bytes → record envelope (see `codec`).
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
/// Expiry index: (slot, stored key bytes) → (), where the slot is the
/// record's expiry and its state ([`expiry_slot`]). Ordered by expiry, so
/// eviction reads only what has expired.
pub(crate) const EXPIRY: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("expiry");
/// Business keys: (scope prefix ‖ business key) → stored key bytes.
pub(crate) const BUSINESS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("business_keys");
/// The tag of an expiry index entry of a record in state Processing
/// (format 2 on): its slot has this bit set, so that the records in flight
/// sort after every finished record, by expiry. `stats` reads them as one
/// range instead of reading every record, and eviction reads the due ones
/// of each range; a lifecycle makes no more index writes than without the
/// tag. See [`expiry_slot`].
pub(crate) const IN_FLIGHT_TAG: u64 = 1 << 63;
/// Bits of a slot below the expiry that name the record's state (format 3
/// on): see [`expiry_slot`].
const STATE_BITS: u32 = 2;
/// The latest expiry a slot holds, in ms (2^61 − 1, about 73 million
/// years): a later one is held at it (never due).
const MAX_SLOT_EXPIRY: u64 = (IN_FLIGHT_TAG >> STATE_BITS) - 1;

/// The slot under which the expiry index holds a record of `state` that
/// expires at `expires_ms` (format 3):
///
/// ```text
/// slot = [in flight: 1 bit][expiry in ms: 61 bits][state: 2 bits]
/// state: 0 Succeeded, 1 Failed, 2 retryably Failed, 3 Processing
/// ```
///
/// Entries sort by (in flight, expiry, state, key): finished records first,
/// by expiry, then those in flight. The state lets `stats` count the due
/// entries by state from the index alone, without reading their records.
/// An expiry beyond [`MAX_SLOT_EXPIRY`] is held at it (so such a record
/// is evicted then, 73 million years out).
pub(crate) fn expiry_slot(state: crate::record::State, expires_ms: u64) -> u64 {
    use crate::record::State;
    let (tag, code) = match state {
        State::Succeeded => (0, 0),
        State::Failed { retryable: false } => (0, 1),
        State::Failed { retryable: true } => (0, 2),
        State::Processing => (IN_FLIGHT_TAG, 3),
    };
    tag | (expires_ms.min(MAX_SLOT_EXPIRY) << STATE_BITS) | code
}

/// The expiry time (ms) of an index entry's slot.
pub(crate) fn slot_expiry(slot: u64) -> u64 {
    (slot & !IN_FLIGHT_TAG) >> STATE_BITS
}

/// The state code of an index entry's slot (0 to 3, see [`expiry_slot`]).
pub(crate) fn slot_code(slot: u64) -> usize {
    // Two bits: 0 to 3.
    usize::from(u8::try_from(slot & ((1 << STATE_BITS) - 1)).unwrap_or(3))
}

/// The [`Tally`] slot of the state an index entry's slot names (the slot
/// itself, or its state code alone).
pub(crate) fn slot_state(slot: u64) -> usize {
    match slot_code(slot) {
        0 => Tally::SUCCEEDED,
        1 => Tally::FAILED,
        2 => Tally::FAILED_RETRYABLE,
        _ => Tally::PROCESSING,
    }
}

/// Metadata: name → little-endian value bytes.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The store format this build writes and reads. Format 1 (no
/// [`META_STATE_COUNTS`], untagged expiry entries of records in flight),
/// format 2 (expiry slots without the state) and format 3 (no
/// [`EXPIRY_COUNTS`]) are migrated to 4 at open, once the log is replayed
/// ([`migrate`]; see `docs/design.md`, "Format versions").
pub(crate) const FORMAT_VERSION: u64 = 4;

pub(crate) const META_FORMAT: &str = "format_version";
pub(crate) const META_STORE_ID: &str = "store_id";
pub(crate) const META_NEXT_TOKEN: &str = "next_token";
/// A bound on every time the store has based an answer on (a reserved
/// bound, up to `TIME_RESERVATION` ahead of use; exact at a clean close).
pub(crate) const META_CLOCK_HWM: &str = "clock_high_water_ms";
/// Written at a clean close: the floor-based part of the store's time then
/// (see `crate::clock`); absent in stores written before it existed, which
/// then start with no catch-up.
pub(crate) const META_CLOCK_FLOOR: &str = "clock_floor_ms";
/// The sequence number of the last log frame whose effects the index holds.
pub(crate) const META_APPLIED_SEQ: &str = "log_applied_seq";
/// The checkpoint epoch: frames written since the last checkpoint carry it.
pub(crate) const META_LOG_EPOCH: &str = "log_epoch";
/// The sequence number the last checkpoint covered; the first frame of the
/// epoch is `log_base_seq + 1`.
pub(crate) const META_LOG_BASE: &str = "log_base_seq";
/// 1 when the last durable commit was a clean close (or the creation): no
/// frame after it is needed, so a missing log loses nothing.
pub(crate) const META_CLEAN: &str = "clean_shutdown";
/// Tokens below this may have been handed out: after an unclean shutdown
/// the counter restarts here, so a token acknowledged but lost with the
/// unsynced end of the log (buffered mode) is never issued twice.
pub(crate) const META_TOKEN_RESERVED: &str = "token_reserved";
/// Stored records by the state their envelope names (format 2 on): five
/// little-endian u64s, [`Tally`]'s slots. Kept by [`Tables`] in the same
/// transaction as the records.
pub(crate) const META_STATE_COUNTS: &str = "state_counts";

/// When redb's full integrity check (every page's checksum) last passed on
/// this file: the wall reading of the store's clock, in ms since the epoch,
/// written in the first durable commit of an open that ran the check.
/// Absent in stores written before it existed, and in new stores until
/// their first open: such a store counts as never verified. Read only to
/// decide whether a clean open may skip the check (see [`check_reason`]).
pub(crate) const META_VERIFIED: &str = "integrity_verified_ms";

/// The damage marker the online scrub wrote beside this file (its
/// canonical path, the bytes of the path on Unix, UTF-8 elsewhere), written
/// at every durable checkpoint and at the close of a store the scrub found
/// damaged (the scrub asks for a checkpoint as soon as it has written the
/// marker). An open that finds the named marker in place opens the store
/// read-only, by whatever path it names the file: a hard link to it is
/// another name for the same file, which the marker beside the canonical
/// path cannot be found from. Absent in stores never found damaged. Added
/// without a format version change: an older build ignores it.
pub(crate) const META_DAMAGE_MARKER: &str = "scrub_damage_marker";

/// The canonical path of the write-ahead log the store writes (the bytes
/// of the path on Unix, UTF-8 elsewhere), recorded by the checkpoint of
/// every open that begins the log's new epoch. After an unclean shutdown,
/// the frames since the last checkpoint are in that log: an open by
/// another name of the file (a hard link, or a symlink to it opened by an
/// older build, which named the log after the spelling it was given) whose
/// own log is another file refuses while that one holds such frames (see
/// `refuse_stray_log`). Absent in stores written before it existed, and on
/// a caller's [`LogFile`](crate::LogFile). Added without a format version
/// change: an older build ignores it.
pub(crate) const META_LOG_PATH: &str = "log_path";

/// The longest [`META_DAMAGE_MARKER`] or [`META_LOG_PATH`] value read (in
/// bytes): Linux's `PATH_MAX`.
const MAX_MARKER_PATH_BYTES: usize = 4096;

/// How far ahead of the wall clock a recorded verification may be and
/// still count: one minute. The time was a wall reading too, so a time
/// ahead of the clock means the clock stepped back (an NTP correction, a
/// file moved from a host whose clock was ahead) or a file that cannot be
/// trusted about it; beyond this, the store counts as never verified and
/// checks (a far-future time must not switch the check off). Within it,
/// the period is lengthened by at most this much.
pub(crate) const VERIFIED_FUTURE_TOLERANCE_MS: u64 = 60_000;

/// What decides whether an open runs redb's full integrity check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IntegrityPolicy {
    /// How old the last verification may be on a clean open, in ms;
    /// `None` checks at every open (`Config::integrity_check_interval`).
    pub interval_ms: Option<u64>,
    /// The wall reading of the store's clock now (ms since the epoch).
    pub wall_ms: u64,
}

/// Why an open runs the full integrity check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CheckReason {
    /// `integrity_check_interval(None)`.
    EveryOpen,
    /// The metadata could not be read before the check: a new store (no
    /// tables yet), or one that the check will refuse.
    NoMetadata,
    /// The last shutdown was not clean.
    Unclean,
    /// No verification is recorded (or its value is malformed).
    NeverVerified,
    /// The recorded verification is ahead of the wall clock by more than
    /// [`VERIFIED_FUTURE_TOLERANCE_MS`].
    VerifiedInFuture,
    /// The recorded verification is at least the period old.
    Due,
}

impl CheckReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CheckReason::EveryOpen => "every open (integrity_check_interval None)",
            CheckReason::NoMetadata => "metadata not readable before the check",
            CheckReason::Unclean => "unclean shutdown",
            CheckReason::NeverVerified => "never verified",
            CheckReason::VerifiedInFuture => "last verification recorded in the future",
            CheckReason::Due => "last verification older than the period",
        }
    }
}

/// What an open reads of the metadata before deciding on the check: the
/// clean-shutdown flag and the last verification, from pages not yet
/// verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Peek {
    pub clean: bool,
    pub verified_ms: Option<u64>,
}

/// Whether an open with `peek` (`None`: the metadata did not read) runs the
/// full check under `policy`, and why; `None` to skip it. No step can
/// wrap (saturating at both ends, each saturation on the side that checks):
/// a hostile recorded time cannot overflow into "recent".
pub(crate) fn check_reason(peek: Option<Peek>, policy: IntegrityPolicy) -> Option<CheckReason> {
    let Some(interval_ms) = policy.interval_ms else {
        return Some(CheckReason::EveryOpen);
    };
    let Some(peek) = peek else {
        return Some(CheckReason::NoMetadata);
    };
    if !peek.clean {
        return Some(CheckReason::Unclean);
    }
    let Some(verified) = peek.verified_ms else {
        return Some(CheckReason::NeverVerified);
    };
    // A wall clock within the tolerance of u64::MAX has no future to refuse.
    let latest = policy.wall_ms.saturating_add(VERIFIED_FUTURE_TOLERANCE_MS);
    if verified > latest {
        return Some(CheckReason::VerifiedInFuture);
    }
    // Ahead of the clock within the tolerance: verified just now.
    let age = policy.wall_ms.saturating_sub(verified);
    if age >= interval_ms {
        return Some(CheckReason::Due);
    }
    None
}

/// Reads the clean flag and the last verification in a read transaction;
/// `None` when the metadata table or the clean flag does not read (a new
/// store, a damaged file).
fn peek(db: &Database) -> Option<Peek> {
    let txn = db.begin_read().ok()?;
    let table = txn.open_table(META).ok()?;
    let num = |name: &str| -> Option<Option<u64>> {
        match table.get(name) {
            Ok(None) => Some(None),
            Ok(Some(v)) => Some(<[u8; 8]>::try_from(v.value()).ok().map(u64::from_le_bytes)),
            Err(_) => None,
        }
    };
    // A malformed clean flag is not a clean shutdown.
    let clean = num(META_CLEAN)?.is_some_and(|v| v == 1);
    Some(Peek {
        clean,
        verified_ms: num(META_VERIFIED)?,
    })
}

/// Raises the fence when dropped unless disarmed: an open that fails leaves
/// the file as it found it (redb's close writes nothing to a file that
/// failed its check or is not a store).
struct FenceOnFailure<'f>(Option<&'f Fence>);

impl FenceOnFailure<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for FenceOnFailure<'_> {
    fn drop(&mut self) {
        if let Some(fence) = self.0 {
            fence.raise();
        }
    }
}

/// What the metadata table says about a store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    /// The store format the file was written in ([`META_FORMAT`]); older
    /// than [`FORMAT_VERSION`] until [`migrate`] has run.
    pub format: u64,
    pub store_id: u128,
    pub next_token: u64,
    pub clock_hwm: u64,
    /// See [`META_CLOCK_FLOOR`].
    pub clock_floor: Option<u64>,
    /// See [`META_APPLIED_SEQ`].
    pub applied_seq: u64,
    /// See [`META_LOG_EPOCH`].
    pub log_epoch: u64,
    /// See [`META_LOG_BASE`].
    pub log_base: u64,
    /// See [`META_CLEAN`].
    pub clean: bool,
    /// See [`META_TOKEN_RESERVED`].
    pub token_reserved: u64,
    /// Whether this open initialised the metadata (of an empty file or
    /// custom backend). Not stored.
    pub created: bool,
    /// Whether this open linked a new store file into place
    /// ([`super::create::ensure`]); another process may still have opened
    /// and used it before this open took the file's lock. Not stored.
    pub linked: bool,
}

/// Runs `f`, turning a panic inside redb (possible on a damaged file) into
/// [`Error::CorruptFile`].
pub(crate) fn guard<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "storage engine panicked".into());
            Err(Error::CorruptFile {
                path: path.to_path_buf(),
                detail: format!("storage engine panicked: {detail}"),
            })
        }
    }
}

/// Maps any redb error to ours, naming the file for corruption.
pub(crate) fn map_err(path: &Path, err: impl Into<redb::Error>) -> Error {
    match err.into() {
        redb::Error::Corrupted(detail) => Error::CorruptFile {
            path: path.to_path_buf(),
            detail,
        },
        redb::Error::DatabaseAlreadyOpen => Error::AlreadyOpen {
            path: path.to_path_buf(),
        },
        redb::Error::UpgradeRequired(v) => Error::IncompatibleFile {
            path: path.to_path_buf(),
            detail: format!("redb file format {v} needs an upgrade"),
        },
        other => Error::Storage(format!("{}: {other}", path.display())),
    }
}

fn u64_of(path: &Path, name: &str, bytes: &[u8]) -> Result<u64> {
    let arr: [u8; 8] = bytes.try_into().map_err(|_| Error::CorruptFile {
        path: path.to_path_buf(),
        detail: format!("metadata {name} is {} bytes, expected 8", bytes.len()),
    })?;
    Ok(u64::from_le_bytes(arr))
}

/// Asks for the index file to be synced off the writer, ahead of a
/// checkpoint's own sync (see `writeback.rs`); best effort, never blocks.
pub(crate) type EarlySync = Box<dyn Fn() + Send + Sync>;

/// Opens (or creates) the redb file, or a database on `backend` when one is
/// given (`path` then only names it in errors), runs redb's full integrity
/// check when `policy` says so (see [`check_reason`]), and checks or
/// initialises the metadata. With the store's own file on Linux, also the
/// [`EarlySync`] for its checkpoints. With `read_only`
/// (`Config::read_only`), never creates a file or initialises a database
/// ([`Error::Missing`] for a missing file, [`Error::IncompatibleFile`] for
/// one without a store) and records no verification time.
pub(crate) fn open<B: redb::StorageBackend>(
    path: &Path,
    backend: Option<B>,
    cache_bytes: usize,
    fence: &Fence,
    policy: IntegrityPolicy,
    read_only: bool,
) -> Result<(Database, Meta, Option<EarlySync>)> {
    // Set only where the early writeback exists (Linux).
    #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
    let mut early_sync: Option<EarlySync> = None;
    let mut linked = false;
    let (db, mut meta) = guard(path, || {
        let mut builder = Database::builder();
        // redb's own repair after a crash is skipped when the last durable
        // commit recorded its allocator state (quick-repair, which every
        // checkpoint sets); otherwise it walks the whole file.
        builder.set_cache_size(cache_bytes);
        // The open itself does not verify page checksums (redb's
        // `set_check_integrity_on_open` is off): the metadata is read
        // first, to decide whether the full check below runs. redb verifies
        // page checksums nowhere else, and the record checksum cannot see
        // a damaged key (the lookup simply misses, and the key would be
        // acquired twice), so the check runs after every unclean shutdown
        // and whenever the last one is older than the period.
        let file = backend.is_none();
        // Every backend goes behind the fence (see `fence.rs`).
        let opened = match backend {
            // A custom backend is created in place: see
            // `Store::open_with_backend` for the rule it gets.
            Some(backend) => builder.create_with_backend(Fenced::new(backend, fence.clone())),
            None => {
                // A missing file is created atomically (`super::create`).
                // Errors name the store's path, not the temporary one.
                if read_only {
                    super::check_existing(path)?;
                } else {
                    linked = super::create::ensure(path, |temp| {
                        let db = Database::builder()
                            .create(temp)
                            .map_err(|e| map_err(path, e))?;
                        init_meta(path, &db, None, false).map(|_| ())
                    })?;
                }
                // Then opened as redb's `create` opens a file, behind the
                // fence; never created here (a file removed meanwhile is
                // an error, not a new empty store).
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                    .map_err(redb::DatabaseError::from)
                    .and_then(|file| {
                        // The same file opened again, to ask for early
                        // writeback of what redb writes and an early sync
                        // at checkpoints (`writeback.rs`).
                        #[cfg(target_os = "linux")]
                        let early = super::writeback::reopen(&file);
                        let file = redb::backends::FileBackend::new(file)?;
                        #[cfg(target_os = "linux")]
                        let file = {
                            let file = super::writeback::Writeback::new(file, early);
                            let handle = file.early_sync();
                            early_sync = Some(Box::new(move || {
                                handle.start();
                            }));
                            file
                        };
                        builder.create_with_backend(Fenced::new(file, fence.clone()))
                    })
            }
        };
        let mut db = opened.map_err(|e| open_error(path, e))?;
        // Dropped before `db` (declared after it), so that a failure from
        // here on, a panic included, fences the file before redb closes it.
        let armed = FenceOnFailure(Some(fence));
        let verified = match check_reason(peek(&db), policy) {
            Some(reason) => {
                full_check(path, &mut db, reason)?;
                // A read-only open records no time (its clock may be ahead).
                (!read_only).then_some(policy.wall_ms)
            }
            None => {
                tracing::debug!(
                    path = %path.display(),
                    "integrity check skipped: clean shutdown, last verified within the period"
                );
                None
            }
        };
        let meta = init_meta(path, &db, verified, read_only)?;
        armed.disarm();
        if file {
            super::create::remove_leftovers(path);
        }
        Ok((db, meta))
    })?;
    meta.linked = linked;
    Ok((db, meta, early_sync))
}

/// redb's integrity check: every page checksum of the committed trees and
/// the allocator state, repaired when redb can (reported as a warning).
/// Emits the event "integrity check ran" (info, with `reason`).
fn full_check(path: &Path, db: &mut Database, reason: CheckReason) -> Result<()> {
    let started = Instant::now();
    let clean = db.check_integrity().map_err(|e| open_error(path, e))?;
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    if !clean {
        tracing::warn!(path = %path.display(), "the integrity check found damage redb could repair; repaired");
    }
    tracing::info!(
        path = %path.display(),
        reason = reason.as_str(),
        repaired = !clean,
        elapsed_ms,
        "integrity check ran"
    );
    Ok(())
}

/// Checks the metadata of an existing store, or initialises that of a new
/// database (identity, format, every table) in a durable commit, which
/// records `verified_ms` as the last full check when given. An existing
/// store with every table and nothing to record is only read (no commit).
/// With `read_only`, a database without metadata is refused, not
/// initialised.
fn init_meta(
    path: &Path,
    db: &Database,
    verified_ms: Option<u64>,
    read_only: bool,
) -> Result<Meta> {
    if verified_ms.is_none()
        && let Some(meta) = read_existing(path, db)?
    {
        return Ok(meta);
    }
    let mut txn = db.begin_write().map_err(|e| map_err(path, e))?;
    txn.set_quick_repair(true);
    let existing: Vec<String> = txn
        .list_tables()
        .map_err(|e| map_err(path, e))?
        .map(|t| t.name().to_string())
        .collect();
    let meta = {
        let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
        let meta = match stored_format(path, &table)? {
            None if existing.iter().any(|t| t != META.name()) => {
                return Err(Error::IncompatibleFile {
                    path: path.to_path_buf(),
                    detail: "a redb file without idemstore metadata (not an idemstore file)".into(),
                });
            }
            None if read_only => {
                return Err(Error::IncompatibleFile {
                    path: path.to_path_buf(),
                    detail: "no idemstore store in it, and a read-only open creates none".into(),
                });
            }
            None => {
                let id: u128 = rand::random();
                table
                    .insert(META_FORMAT, &FORMAT_VERSION.to_le_bytes()[..])
                    .map_err(|e| map_err(path, e))?;
                table
                    .insert(META_STORE_ID, &id.to_le_bytes()[..])
                    .map_err(|e| map_err(path, e))?;
                table
                    .insert(META_CLEAN, &1u64.to_le_bytes()[..])
                    .map_err(|e| map_err(path, e))?;
                table
                    .insert(META_STATE_COUNTS, &Tally::default().to_bytes()[..])
                    .map_err(|e| map_err(path, e))?;
                Meta {
                    format: FORMAT_VERSION,
                    store_id: id,
                    next_token: 1,
                    clock_hwm: 0,
                    clock_floor: None,
                    applied_seq: 0,
                    log_epoch: 0,
                    log_base: 0,
                    clean: true,
                    token_reserved: 1,
                    created: true,
                    linked: false,
                }
            }
            Some(v) if v > FORMAT_VERSION => {
                return Err(Error::IncompatibleFile {
                    path: path.to_path_buf(),
                    detail: format!(
                        "format version {v} is newer than {FORMAT_VERSION}, the newest this build reads"
                    ),
                });
            }
            Some(_) => read_meta(path, &table)?,
        };
        if let Some(ms) = verified_ms {
            table
                .insert(META_VERIFIED, &ms.to_le_bytes()[..])
                .map_err(|e| map_err(path, e))?;
        }
        meta
    };
    // Create every table so that readers never meet a missing one.
    txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    txn.open_table(EXPIRY_COUNTS)
        .map_err(|e| map_err(path, e))?;
    txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
    txn.commit().map_err(|e| map_err(path, e))?;
    Ok(meta)
}

/// The metadata of a store that has a format version this build reads and
/// every table, from a read transaction; `None` when [`init_meta`] has to
/// write (a new database, or a table missing) or to refuse the file.
fn read_existing(path: &Path, db: &Database) -> Result<Option<Meta>> {
    let txn = db.begin_read().map_err(|e| map_err(path, e))?;
    let existing: Vec<String> = txn
        .list_tables()
        .map_err(|e| map_err(path, e))?
        .map(|t| t.name().to_string())
        .collect();
    let tables = [
        META.name(),
        RECORDS.name(),
        EXPIRY.name(),
        EXPIRY_COUNTS.name(),
        BUSINESS.name(),
    ];
    if !tables.iter().all(|t| existing.iter().any(|e| e == t)) {
        return Ok(None);
    }
    let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    match stored_format(path, &table)? {
        Some(v) if v <= FORMAT_VERSION => read_meta(path, &table).map(Some),
        _ => Ok(None),
    }
}

/// The format version in the metadata table, `None` when it has none (a
/// new database, or a redb file that is not a store).
fn stored_format(
    path: &Path,
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Option<u64>> {
    table
        .get(META_FORMAT)
        .map_err(|e| map_err(path, e))?
        .map(|v| u64_of(path, META_FORMAT, v.value()))
        .transpose()
}

/// Migrates a store of format `from` (older than [`FORMAT_VERSION`]) in one
/// durable commit, which also records the new format version. Runs after
/// recovery has replayed the log (which the old format wrote) and before
/// the store answers anything, so a crash before it leaves a store of the
/// old format that the next open migrates.
///
/// Format 1 or 2 → 3: the expiry index is rebuilt from the records. One
/// pass empties it (entries of the old format, leftovers without a record
/// included), one pass over the records counts them by state
/// ([`META_STATE_COUNTS`]) and inserts each decodable record's entry under
/// [`expiry_slot`] (time linear in the records and entries, once; memory
/// bounded by one record). No record is changed or lost; a record that
/// does not decode gets no entry (`verify` names it as damaged, and as
/// without an entry).
///
/// Any older format → 4: the expiry counts ([`EXPIRY_COUNTS`]) are built
/// from the expiry index, one pass over its finished entries
/// ([`expiry_counts::rebuild`]; what the log's replay counted into
/// the table before is dropped).
pub(crate) fn migrate(path: &Path, db: &Database, from: u64) -> Result<()> {
    guard(path, || {
        let mut txn = db.begin_write().map_err(|e| map_err(path, e))?;
        txn.set_quick_repair(true);
        let tally = if from < 3 {
            Some(migrate_in(path, &txn, from)?)
        } else {
            None
        };
        let seconds = expiry_counts::rebuild(path, &txn)?;
        {
            let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
            if let Some(tally) = tally {
                table
                    .insert(META_STATE_COUNTS, &tally.to_bytes()[..])
                    .map_err(|e| map_err(path, e))?;
            }
            table
                .insert(META_FORMAT, &FORMAT_VERSION.to_le_bytes()[..])
                .map_err(|e| map_err(path, e))?;
        }
        txn.commit().map_err(|e| map_err(path, e))?;
        tracing::info!(
            path = %path.display(),
            from,
            to = FORMAT_VERSION,
            seconds,
            "store format migrated"
        );
        Ok(())
    })
}

fn migrate_in(path: &Path, txn: &WriteTransaction, from: u64) -> Result<Tally> {
    let records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    let mut expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    // Every old entry goes: a slot of format 1 or 2 read as format 3 would
    // name a wrong expiry and state.
    expiry.retain(|_, _| false).map_err(|e| map_err(path, e))?;
    let mut tally = Tally::default();
    for entry in records.iter().map_err(|e| map_err(path, e))? {
        let (k, v) = entry.map_err(|e| map_err(path, e))?;
        tally.add(Tally::slot_of(v.value()));
        let Ok(record) = codec::decode_record(k.value(), v.value()) else {
            continue;
        };
        expiry
            .insert(
                (expiry_slot(record.state, record.expires_ms), k.value()),
                (),
            )
            .map_err(|e| map_err(path, e))?;
    }
    tracing::info!(
        path = %path.display(),
        from,
        records = tally.total(),
        in_flight = tally.slots[Tally::PROCESSING],
        "expiry index rebuilt from the records"
    );
    Ok(tally)
}

/// Stored records by the state their envelope names: the slots are
/// Processing, Succeeded, Failed, retryably Failed, and envelopes whose
/// state cannot be read (damaged: `verify` says more). Expired records
/// not yet evicted are counted in their state (`stats` tells them apart
/// from the expiry index). Counts saturate instead of wrapping; `verify`
/// compares them with a count of the records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub slots: [u64; 5],
}

impl Tally {
    pub const PROCESSING: usize = 0;
    pub const SUCCEEDED: usize = 1;
    pub const FAILED: usize = 2;
    pub const FAILED_RETRYABLE: usize = 3;
    pub const UNREADABLE: usize = 4;
    const BYTES: usize = 40;

    /// The slot of a stored envelope.
    pub fn slot_of(envelope: &[u8]) -> usize {
        match codec::peek_state(envelope) {
            Some(crate::record::State::Processing) => Tally::PROCESSING,
            Some(crate::record::State::Succeeded) => Tally::SUCCEEDED,
            Some(crate::record::State::Failed { retryable: false }) => Tally::FAILED,
            Some(crate::record::State::Failed { retryable: true }) => Tally::FAILED_RETRYABLE,
            None => Tally::UNREADABLE,
        }
    }

    pub fn add(&mut self, slot: usize) {
        if let Some(n) = self.slots.get_mut(slot) {
            *n = n.saturating_add(1);
        }
    }

    pub fn sub(&mut self, slot: usize) {
        if let Some(n) = self.slots.get_mut(slot) {
            *n = n.saturating_sub(1);
        }
    }

    /// Takes `n` from `slot`, stopping at zero.
    pub fn sub_n(&mut self, slot: usize, n: u64) {
        if let Some(c) = self.slots.get_mut(slot) {
            *c = c.saturating_sub(n);
        }
    }

    pub fn total(&self) -> u64 {
        self.slots.iter().fold(0, |a, n| a.saturating_add(*n))
    }

    fn to_bytes(self) -> [u8; Tally::BYTES] {
        let mut out = [0u8; Tally::BYTES];
        for (chunk, n) in out.chunks_exact_mut(8).zip(self.slots) {
            chunk.copy_from_slice(&n.to_le_bytes());
        }
        out
    }

    /// The tally `table` holds; `None` in a store that has none (format 1,
    /// read without migrating).
    ///
    /// # Errors
    /// [`Error::CorruptFile`] when the stored value is not 40 bytes.
    pub fn read(
        path: &Path,
        table: &impl ReadableTable<&'static str, &'static [u8]>,
    ) -> Result<Option<Tally>> {
        let Some(v) = table.get(META_STATE_COUNTS).map_err(|e| map_err(path, e))? else {
            return Ok(None);
        };
        let bytes = v.value();
        if bytes.len() != Tally::BYTES {
            return Err(Error::CorruptFile {
                path: path.to_path_buf(),
                detail: format!("{META_STATE_COUNTS} is {} bytes, not 40", bytes.len()),
            });
        }
        let mut tally = Tally::default();
        for (n, chunk) in tally.slots.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut a = [0u8; 8];
            a.copy_from_slice(chunk);
            *n = u64::from_le_bytes(a);
        }
        Ok(Some(tally))
    }
}

pub(crate) fn read_meta(
    path: &Path,
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Meta> {
    let get = |name: &str| -> Result<Option<Vec<u8>>> {
        Ok(table
            .get(name)
            .map_err(|e| map_err(path, e))?
            .map(|v| v.value().to_vec()))
    };
    let id = get(META_STORE_ID)?.ok_or_else(|| Error::CorruptFile {
        path: path.to_path_buf(),
        detail: "store identity missing".into(),
    })?;
    let id: [u8; 16] = id.as_slice().try_into().map_err(|_| Error::CorruptFile {
        path: path.to_path_buf(),
        detail: "store identity is not 16 bytes".into(),
    })?;
    let num = |name: &str, default: u64| -> Result<u64> {
        Ok(get(name)?
            .map(|v| u64_of(path, name, &v))
            .transpose()?
            .unwrap_or(default))
    };
    Ok(Meta {
        format: num(META_FORMAT, 1)?,
        store_id: u128::from_le_bytes(id),
        next_token: num(META_NEXT_TOKEN, 1)?,
        clock_hwm: num(META_CLOCK_HWM, 0)?,
        clock_floor: get(META_CLOCK_FLOOR)?
            .map(|v| u64_of(path, META_CLOCK_FLOOR, &v))
            .transpose()?,
        applied_seq: num(META_APPLIED_SEQ, 0)?,
        log_epoch: num(META_LOG_EPOCH, 0)?,
        log_base: num(META_LOG_BASE, 0)?,
        clean: num(META_CLEAN, 0)? == 1,
        token_reserved: num(META_TOKEN_RESERVED, 1)?,
        created: false,
        linked: false,
    })
}

/// What a checkpoint records.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checkpoint {
    /// The epoch frames written after the checkpoint carry.
    pub epoch: u64,
    /// The sequence number of the last change the index holds.
    pub base: u64,
    /// Whether this is a clean close (the log may then be absent).
    pub clean: bool,
    /// Tokens below this may be handed out before the next checkpoint.
    pub token_reserved: u64,
}

/// Raises the persisted clock high-water mark to `hwm_ms` in `txn`.
pub(crate) fn write_clock_hwm(path: &Path, txn: &WriteTransaction, hwm_ms: u64) -> Result<()> {
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    let current = table
        .get(META_CLOCK_HWM)
        .map_err(|e| map_err(path, e))?
        .map(|v| u64_of(path, META_CLOCK_HWM, v.value()))
        .transpose()?
        .unwrap_or(0);
    if hwm_ms > current {
        table
            .insert(META_CLOCK_HWM, &hwm_ms.to_le_bytes()[..])
            .map_err(|e| map_err(path, e))?;
    }
    Ok(())
}

/// Writes the clock of a clean close: the high-water mark exactly (no
/// answer was based on a later time; the reservation is not needed once
/// nothing runs) and the floor-based time (see [`META_CLOCK_FLOOR`]).
pub(crate) fn write_clean_clock(
    path: &Path,
    txn: &WriteTransaction,
    high_water_ms: u64,
    floor_ms: u64,
) -> Result<()> {
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    for (name, value) in [
        (META_CLOCK_HWM, high_water_ms),
        (META_CLOCK_FLOOR, floor_ms.min(high_water_ms)),
    ] {
        table
            .insert(name, &value.to_le_bytes()[..])
            .map_err(|e| map_err(path, e))?;
    }
    Ok(())
}

/// Removes the record of the last full integrity check ([`META_VERIFIED`])
/// in `txn`: every later open runs the check ([`CheckReason::NeverVerified`]).
pub(crate) fn forget_verification(path: &Path, txn: &WriteTransaction) -> Result<()> {
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    table.remove(META_VERIFIED).map_err(|e| map_err(path, e))?;
    Ok(())
}

/// Records in `txn` that the scrub found this store damaged and left
/// `marker` ([`META_DAMAGE_MARKER`]).
pub(crate) fn record_damage_marker(
    path: &Path,
    txn: &WriteTransaction,
    marker: &Path,
) -> Result<()> {
    let Some(bytes) = path_bytes(marker) else {
        // Not UTF-8 on a platform whose paths are not bytes: the marker
        // beside the canonical path is still found by every spelling that
        // resolves to it.
        return Ok(());
    };
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    table
        .insert(META_DAMAGE_MARKER, bytes.as_slice())
        .map_err(|e| map_err(path, e))?;
    Ok(())
}

/// The damage marker recorded in the store ([`META_DAMAGE_MARKER`]):
/// `Ok(None)` when none is recorded; `Err` with what is wrong when the
/// recorded value (from a file that may be hostile) is not a plain absolute
/// path of at most [`MAX_MARKER_PATH_BYTES`] whose file name ends in
/// `-damaged` (see [`read_recorded_path`]). The caller ignores such a value
/// (the marker beside the file's canonical path still counts). A panic
/// inside redb on a damaged page is [`Error::CorruptFile`].
pub(crate) fn recorded_damage_marker(
    path: &Path,
    db: &Database,
) -> Result<std::result::Result<Option<PathBuf>, String>> {
    guard(path, || {
        read_recorded_path(path, db, META_DAMAGE_MARKER, "-damaged", "damage marker")
    })
}

/// The write-ahead log the store last wrote, as recorded
/// ([`META_LOG_PATH`]): `Ok(None)` when none is recorded (a store written
/// before the record existed, or on a caller's log); `Err` with what is
/// wrong when the value is not a plain absolute path of at most
/// [`MAX_MARKER_PATH_BYTES`] ending in `-wal` (see [`read_recorded_path`]).
pub(crate) fn recorded_log_path(
    path: &Path,
    db: &Database,
) -> Result<std::result::Result<Option<PathBuf>, String>> {
    guard(path, || {
        read_recorded_path(path, db, META_LOG_PATH, "-wal", "write-ahead log")
    })
}

/// Records in `txn` the canonical path of the write-ahead log the store
/// writes from this checkpoint on ([`META_LOG_PATH`]).
pub(crate) fn record_log_path(path: &Path, txn: &WriteTransaction, log: &Path) -> Result<()> {
    let Some(bytes) = path_bytes(log) else {
        return Ok(());
    };
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    table
        .insert(META_LOG_PATH, bytes.as_slice())
        .map_err(|e| map_err(path, e))?;
    Ok(())
}

/// A path recorded in the store under `name`, outside its guard: `Ok(None)`
/// when none is recorded; `Err` with what is wrong when the value (from a
/// file that may be hostile) is not a plain absolute path of at most
/// [`MAX_MARKER_PATH_BYTES`] whose file name ends in `suffix`: no NUL byte,
/// no `..` component, and on Windows a drive letter, not a UNC or device
/// prefix (looking one up could reach the network).
fn read_recorded_path(
    path: &Path,
    db: &Database,
    name: &str,
    suffix: &str,
    what: &str,
) -> Result<std::result::Result<Option<PathBuf>, String>> {
    let txn = db.begin_read().map_err(|e| map_err(path, e))?;
    let table = match txn.open_table(META) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Ok(None)),
        Err(e) => return Err(map_err(path, e)),
    };
    let Some(value) = table.get(name).map_err(|e| map_err(path, e))? else {
        return Ok(Ok(None));
    };
    let bytes = value.value();
    if bytes.len() > MAX_MARKER_PATH_BYTES {
        return Ok(Err(format!(
            "the recorded {what} is {} bytes long (at most {MAX_MARKER_PATH_BYTES})",
            bytes.len()
        )));
    }
    let Some(recorded) = path_of_bytes(bytes).filter(|_| !bytes.contains(&0)) else {
        return Ok(Err(format!("the recorded {what} is not a path")));
    };
    let named = recorded
        .file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with(suffix));
    let plain = recorded.components().all(|c| match c {
        // A drive letter, spelled plain or verbatim (`\\?\C:`, what
        // `canonicalize` returns on Windows).
        std::path::Component::Prefix(p) => matches!(
            p.kind(),
            std::path::Prefix::Disk(_) | std::path::Prefix::VerbatimDisk(_)
        ),
        std::path::Component::RootDir | std::path::Component::Normal(_) => true,
        std::path::Component::CurDir | std::path::Component::ParentDir => false,
    });
    if !recorded.is_absolute() || !named || !plain {
        return Ok(Err(format!(
            "the recorded {what} {} is not a plain absolute path ending in {suffix}",
            recorded.display()
        )));
    }
    Ok(Ok(Some(recorded)))
}

/// A path as stored: its bytes on Unix, its UTF-8 elsewhere (`None` when
/// it has none).
fn path_bytes(p: &Path) -> Option<Vec<u8>> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        Some(p.as_os_str().as_bytes().to_vec())
    }
    #[cfg(not(unix))]
    {
        p.to_str().map(|s| s.as_bytes().to_vec())
    }
}

/// The path [`path_bytes`] stored (`None`: not UTF-8 where it must be).
fn path_of_bytes(bytes: &[u8]) -> Option<PathBuf> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        Some(PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
    }
    #[cfg(not(unix))]
    {
        std::str::from_utf8(bytes).ok().map(PathBuf::from)
    }
}

/// Records a checkpoint in `txn`, which the caller commits durably.
pub(crate) fn write_checkpoint(path: &Path, txn: &WriteTransaction, ck: Checkpoint) -> Result<()> {
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    for (name, value) in [
        (META_LOG_EPOCH, ck.epoch),
        (META_LOG_BASE, ck.base),
        (META_CLEAN, u64::from(ck.clean)),
        (META_TOKEN_RESERVED, ck.token_reserved),
    ] {
        table
            .insert(name, &value.to_le_bytes()[..])
            .map_err(|e| map_err(path, e))?;
    }
    Ok(())
}

/// An expiry index entry as stored: the (tagged) deadline and the key.
pub(crate) type ExpiryEntry = (u64, Vec<u8>);

/// How many entries past its `max` a sweep step reads to finish the
/// millisecond of its last one (see [`Tables::expiry_due`]), so that a
/// step's reads stay bounded when many records share one expiry.
const SAME_MS_EXTRA: usize = 1024;

/// A table of a write transaction, opened in it at its first use.
struct LazyTable<'t, K: redb::Key + 'static, V: redb::Value + 'static> {
    definition: TableDefinition<'static, K, V>,
    table: std::cell::OnceCell<Table<'t, K, V>>,
}

impl<'t, K: redb::Key + 'static, V: redb::Value + 'static> LazyTable<'t, K, V> {
    fn new(definition: TableDefinition<'static, K, V>) -> Self {
        LazyTable {
            definition,
            table: std::cell::OnceCell::new(),
        }
    }

    /// The table, opened in `txn` if it is not yet. Errors: redb's, when
    /// it cannot be opened (`path` names the store in them).
    fn get(&self, path: &Path, txn: &'t WriteTransaction) -> Result<&Table<'t, K, V>> {
        if let Some(table) = self.table.get() {
            return Ok(table);
        }
        let table = txn
            .open_table(self.definition)
            .map_err(|e| map_err(path, e))?;
        Ok(self.table.get_or_init(|| table))
    }

    /// As [`LazyTable::get`], to change it.
    fn get_mut(&mut self, path: &Path, txn: &'t WriteTransaction) -> Result<&mut Table<'t, K, V>> {
        self.get(path, txn)?;
        self.table.get_mut().ok_or_else(|| {
            Error::Storage(format!(
                "{}: the table {} did not open",
                path.display(),
                self.definition.name()
            ))
        })
    }
}

/// The tables of one write transaction of the writer (or of recovery).
///
/// **Every change to the store's tables in the writer goes through these
/// methods**: each one changes the redb table and, when the transaction is
/// logged, appends the same change to the batch's log frame. A table written
/// around them would be lost in a crash (its redb commit is not durable;
/// only the log is). To add a table: add a `LogTable` code, methods here, and
/// an arm in [`Tables::apply`]. A table derived from the others, as the
/// expiry counts are from the expiry index (`expiry_counts.rs`), needs no
/// code: these methods keep it, and a replay of the log derives it again.
///
/// Opened with [`Tables::buffered`], changes to the records table and the
/// expiry index wait in the writer's [`Pending`] buffer and reach redb at
/// [`Tables::apply_pending`] or [`Tables::apply_pending_some`] (see
/// `pending.rs`), each key with its last change at that point, which leaves
/// the tables as applying every change in turn would; they are logged at
/// once all the same. Recovery's replay buffers its unlogged tables the
/// same way ([`Tables::buffering`]).
pub(crate) struct Tables<'t> {
    path: &'t Path,
    txn: &'t WriteTransaction,
    // Each table is opened at its first use: opening one costs about as
    // much as an insert, and a batch often needs few of them (a batch of
    // one completion whose claim is still buffered opens none; most
    // batches have no business key).
    records: LazyTable<'t, &'static [u8], &'static [u8]>,
    expiry: LazyTable<'t, (u64, &'static [u8]), ()>,
    expiry_counts: LazyTable<'t, u64, &'static [u8]>,
    business: LazyTable<'t, &'static [u8], &'static [u8]>,
    meta: LazyTable<'t, &'static str, &'static [u8]>,
    log: Option<BodyWriter>,
    /// The record keys changed, for the writer's read gate (logged tables
    /// only: recovery's replay has no readers to gate, and a full log's
    /// keys would all be held here).
    touched: Vec<Vec<u8>>,
    /// The state counts: handed in by the caller ([`Tables::with_tally`])
    /// or read at the first change, and handed back by [`Tables::finish`]
    /// for the caller to write before its commit ([`write_tally`]).
    /// Buffered changes count when they are applied.
    tally: Option<Tally>,
    /// The writer's buffer of changes not yet applied (`None`: every
    /// change goes to redb at once).
    pending: Option<&'t mut Pending>,
}

impl<'t> Tables<'t> {
    /// The tables of `txn` (each opened in it at its first use, so a
    /// failure to open one is that use's error); `logged` records every
    /// change for a frame.
    pub(crate) fn open(path: &'t Path, txn: &'t WriteTransaction, logged: bool) -> Self {
        Tables {
            path,
            txn,
            records: LazyTable::new(RECORDS),
            expiry: LazyTable::new(EXPIRY),
            expiry_counts: LazyTable::new(EXPIRY_COUNTS),
            business: LazyTable::new(BUSINESS),
            meta: LazyTable::new(META),
            log: logged.then(BodyWriter::new),
            touched: Vec::new(),
            tally: None,
            pending: None,
        }
    }

    /// The tables of `txn` for the writer: every change is logged, and
    /// changes to records and expiry entries wait in `pending`.
    pub(crate) fn buffered(
        path: &'t Path,
        txn: &'t WriteTransaction,
        pending: &'t mut Pending,
    ) -> Self {
        Tables::open(path, txn, true).buffering(pending)
    }

    /// Lets changes to records and expiry entries wait in `pending` (see
    /// `pending.rs`) until [`Tables::apply_pending`]: recovery's replay
    /// opens its unlogged tables so, as the writer does its logged ones.
    pub(crate) fn buffering(mut self, pending: &'t mut Pending) -> Self {
        self.pending = Some(pending);
        self
    }

    /// Whether the buffered changes should be applied now (see
    /// [`super::pending::MAX_PENDING_BYTES`]).
    pub(crate) fn pending_full(&self) -> bool {
        self.pending.as_ref().is_some_and(|p| p.is_full())
    }

    /// Applies the buffered changes to the redb tables, in key order
    /// (records, then expiry entries), counts the records' states, and
    /// writes the expiry counts that the entries applied since the last
    /// such call moved (`expiry_counts.rs`), once per second moved.
    /// Before the transaction commits and before a scan of a table, so
    /// that every commit holds the counts in step with the index.
    pub(crate) fn apply_pending(&mut self) -> Result<()> {
        self.apply_pending_some(usize::MAX)?;
        let (path, txn) = (self.path, self.txn);
        if let Some(pending) = self.pending.as_deref_mut()
            && !pending.counts_mut().is_empty()
        {
            let table = self.expiry_counts.get_mut(path, txn)?;
            pending.counts_mut().write(path, table)?;
        }
        Ok(())
    }

    /// Applies up to `max` buffered changes (the first in key order);
    /// whether any was applied. The expiry counts they move wait in the
    /// buffer for [`Tables::apply_pending`].
    pub(crate) fn apply_pending_some(&mut self, max: usize) -> Result<bool> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(false);
        };
        if pending.has_no_changes() {
            return Ok(false);
        }
        let (records, expiry) = pending.take_some(max);
        let (path, txn) = (self.path, self.txn);
        for (key, envelope) in records {
            let table = self.records.get_mut(path, txn)?;
            let old = match &envelope {
                Some(env) => table.insert(&key[..], &env[..]),
                None => table.remove(&key[..]),
            }
            .map_err(|e| map_err(path, e))?
            .map(|old| Tally::slot_of(old.value()));
            self.derive(old, envelope.as_deref().map(Tally::slot_of))?;
        }
        for ((deadline, key), change) in expiry {
            let table = self.expiry.get_mut(path, txn)?;
            // Whether redb's entry came or went (counted only then).
            let moved = match change {
                EntryChange::Insert => table.insert((deadline, &key[..]), ()).map(|o| o.is_none()),
                EntryChange::Remove => table.remove((deadline, &key[..])).map(|o| o.is_some()),
            }
            .map_err(|e| map_err(path, e))?;
            if moved && let Some(pending) = self.pending.as_deref_mut() {
                pending
                    .counts_mut()
                    .note(deadline, change == EntryChange::Insert);
            }
        }
        Ok(true)
    }

    /// Writes at once the expiry count that an entry of `deadline` moved
    /// (`inserted` or removed) in a table written without a buffer.
    fn count_now(&mut self, deadline: u64, inserted: bool) -> Result<()> {
        let mut delta = expiry_counts::Delta::default();
        delta.note(deadline, inserted);
        if delta.is_empty() {
            return Ok(());
        }
        let table = self.expiry_counts.get_mut(self.path, self.txn)?;
        delta.write(self.path, table)
    }

    /// Hands in the state counts as of this transaction (`None`: not read
    /// yet), as a writer that keeps them across batches does.
    pub(crate) fn with_tally(mut self, tally: Option<Tally>) -> Self {
        self.tally = tally;
        self
    }

    /// Moves a record from state slot `old` to `new` (either `None`:
    /// absent) in the tally.
    fn derive(&mut self, old: Option<usize>, new: Option<usize>) -> Result<()> {
        if old == new {
            return Ok(());
        }
        let tally = match &mut self.tally {
            Some(t) => t,
            None => {
                // A store of this format always has one (written at
                // creation or migration); a missing one counts from zero
                // and `verify` reports the difference.
                let meta = self.meta.get(self.path, self.txn)?;
                let read = Tally::read(self.path, meta)?.unwrap_or_default();
                self.tally.insert(read)
            }
        };
        if let Some(old) = old {
            tally.sub(old);
        }
        if let Some(new) = new {
            tally.add(new);
        }
        Ok(())
    }

    /// Whether a logged change was recorded.
    pub(crate) fn is_changed(&self) -> bool {
        self.log.as_ref().is_some_and(|l| !l.is_empty())
    }

    /// The stored bytes of a record (its envelope), if present.
    pub(crate) fn get_record(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(buffered) = self.pending.as_ref().and_then(|p| p.record(key)) {
            return Ok(buffered.map(<[u8]>::to_vec));
        }
        Ok(self
            .records
            .get(self.path, self.txn)?
            .get(key)
            .map_err(|e| map_err(self.path, e))?
            .map(|v| v.value().to_vec()))
    }

    /// Stores a record envelope under `key`.
    pub(crate) fn put_record(&mut self, key: &[u8], envelope: &[u8]) -> Result<()> {
        if let Some(pending) = self.pending.as_mut() {
            pending.set_record(key, Some(envelope));
        } else {
            let old = self
                .records
                .get_mut(self.path, self.txn)?
                .insert(key, envelope)
                .map_err(|e| map_err(self.path, e))?
                .map(|old| Tally::slot_of(old.value()));
            self.derive(old, Some(Tally::slot_of(envelope)))?;
        }
        if let Some(log) = &mut self.log {
            log.insert(LogTable::Records, &[key], envelope);
            self.touched.push(key.to_vec());
        }
        Ok(())
    }

    /// Removes the record under `key`.
    pub(crate) fn remove_record(&mut self, key: &[u8]) -> Result<()> {
        if let Some(pending) = self.pending.as_mut() {
            pending.set_record(key, None);
        } else {
            let old = self
                .records
                .get_mut(self.path, self.txn)?
                .remove(key)
                .map_err(|e| map_err(self.path, e))?
                .map(|old| Tally::slot_of(old.value()));
            self.derive(old, None)?;
        }
        if let Some(log) = &mut self.log {
            log.remove(LogTable::Records, &[key]);
            self.touched.push(key.to_vec());
        }
        Ok(())
    }

    /// Adds `(deadline, key)` to the expiry index.
    pub(crate) fn insert_expiry(&mut self, deadline: u64, key: &[u8]) -> Result<()> {
        if let Some(pending) = self.pending.as_mut() {
            pending.set_expiry(deadline, key, EntryChange::Insert);
        } else {
            let inserted = self
                .expiry
                .get_mut(self.path, self.txn)?
                .insert((deadline, key), ())
                .map_err(|e| map_err(self.path, e))?
                .is_none();
            if inserted {
                self.count_now(deadline, true)?;
            }
        }
        if let Some(log) = &mut self.log {
            log.insert(LogTable::Expiry, &[&deadline.to_le_bytes(), key], &[]);
        }
        Ok(())
    }

    /// Removes `(deadline, key)` from the expiry index.
    pub(crate) fn remove_expiry(&mut self, deadline: u64, key: &[u8]) -> Result<()> {
        if let Some(pending) = self.pending.as_mut() {
            pending.set_expiry(deadline, key, EntryChange::Remove);
        } else {
            let removed = self
                .expiry
                .get_mut(self.path, self.txn)?
                .remove((deadline, key))
                .map_err(|e| map_err(self.path, e))?
                .is_some();
            if removed {
                self.count_now(deadline, false)?;
            }
        }
        if let Some(log) = &mut self.log {
            log.remove(LogTable::Expiry, &[&deadline.to_le_bytes(), key]);
        }
        Ok(())
    }

    /// Up to `max` expiry index entries whose expiry is due at `now_ms`,
    /// earliest first (by expiry, then key) across finished records and
    /// records in flight (their tagged range, [`IN_FLIGHT_TAG`]); each
    /// entry as stored (slot, key), and how many entries were read from
    /// redb. Reads of each range the due entries up to `max`, those that
    /// share the millisecond of the `max`-th (a slot orders by state before
    /// key within one; at most [`SAME_MS_EXTRA`] more, past which the order
    /// within that millisecond is the slots'), and the first past them;
    /// never the rest. Applies the buffered changes first.
    pub(crate) fn expiry_due(
        &mut self,
        now_ms: u64,
        max: usize,
        is_due: impl Fn(u64, u64) -> bool,
    ) -> Result<(Vec<ExpiryEntry>, usize)> {
        self.apply_pending()?;
        let path = self.path;
        let empty: &[u8] = &[];
        let mut visited = 0usize;
        // The due entries of one range, in its order (expiry, key).
        let mut due_of = |range: redb::Range<'_, (u64, &'static [u8]), ()>| {
            let mut out = Vec::new();
            for entry in range {
                // Counted as soon as redb has read it, even when `max`
                // then stops the walk.
                visited = visited.saturating_add(1);
                let (k, _) = entry.map_err(|e| map_err(path, e))?;
                let (deadline, key) = k.value();
                let expiry = slot_expiry(deadline);
                // Past `max`, the rest of the last expiry's millisecond
                // still (up to `SAME_MS_EXTRA` entries): within one, entries
                // sort by state before key, and the merge below cuts by
                // (expiry, key).
                if out.len() >= max
                    && (out.len() >= max.saturating_add(SAME_MS_EXTRA)
                        || out
                            .last()
                            .is_none_or(|(d, _): &ExpiryEntry| slot_expiry(*d) != expiry))
                {
                    break;
                }
                if !is_due(expiry, now_ms) {
                    break;
                }
                out.push((deadline, key.to_vec()));
            }
            Ok::<_, Error>(out)
        };
        let expiry = self.expiry.get(path, self.txn)?;
        let finished = due_of(
            expiry
                .range(..(IN_FLIGHT_TAG, empty))
                .map_err(|e| map_err(path, e))?,
        )?;
        let in_flight = due_of(
            expiry
                .range((IN_FLIGHT_TAG, empty)..)
                .map_err(|e| map_err(path, e))?,
        )?;
        // Merged by (expiry, key), as one untagged index would order them.
        let mut merged: Vec<ExpiryEntry> = finished.into_iter().chain(in_flight).collect();
        merged.sort_by(|a, b| (slot_expiry(a.0), &a.1).cmp(&(slot_expiry(b.0), &b.1)));
        merged.truncate(max);
        Ok((merged, visited))
    }

    /// The store file these tables belong to.
    pub(crate) fn path(&self) -> &Path {
        self.path
    }

    /// The stored key a business-key binding names, if any.
    pub(crate) fn get_business(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .business
            .get(self.path, self.txn)?
            .get(key)
            .map_err(|e| map_err(self.path, e))?
            .map(|v| v.value().to_vec()))
    }

    /// Binds a business key to a stored key.
    pub(crate) fn put_business(&mut self, key: &[u8], stored_key: &[u8]) -> Result<()> {
        let path = self.path;
        self.business
            .get_mut(path, self.txn)?
            .insert(key, stored_key)
            .map_err(|e| map_err(path, e))?;
        if let Some(log) = &mut self.log {
            log.insert(LogTable::Business, &[key], stored_key);
        }
        Ok(())
    }

    /// Removes a business key.
    pub(crate) fn remove_business(&mut self, key: &[u8]) -> Result<()> {
        let path = self.path;
        self.business
            .get_mut(path, self.txn)?
            .remove(key)
            .map_err(|e| map_err(path, e))?;
        if let Some(log) = &mut self.log {
            log.remove(LogTable::Business, &[key]);
        }
        Ok(())
    }

    /// Applies one logged change (recovery's replay). `Ok(false)` when the
    /// change is malformed (an expiry key shorter than its deadline).
    pub(crate) fn apply(&mut self, change: Change<'_>) -> Result<bool> {
        match change {
            Change::Insert {
                table: LogTable::Records,
                key,
                value,
            } => self.put_record(key, value)?,
            Change::Remove {
                table: LogTable::Records,
                key,
            } => self.remove_record(key)?,
            Change::Insert {
                table: LogTable::Expiry,
                key,
                ..
            } => match split_expiry(key) {
                Some((d, k)) => self.insert_expiry(d, k)?,
                None => return Ok(false),
            },
            Change::Remove {
                table: LogTable::Expiry,
                key,
            } => match split_expiry(key) {
                Some((d, k)) => self.remove_expiry(d, k)?,
                None => return Ok(false),
            },
            Change::Insert {
                table: LogTable::Business,
                key,
                value,
            } => self.put_business(key, value)?,
            Change::Remove {
                table: LogTable::Business,
                key,
            } => self.remove_business(key)?,
        }
        Ok(true)
    }

    /// Writes the token counter, the clock high-water mark and the last
    /// applied log sequence number. Not logged: every frame carries them.
    pub(crate) fn set_counters(
        &mut self,
        next_token: u64,
        clock_hwm: u64,
        applied_seq: u64,
    ) -> Result<()> {
        for (name, value) in [
            (META_NEXT_TOKEN, next_token),
            (META_CLOCK_HWM, clock_hwm),
            (META_APPLIED_SEQ, applied_seq),
        ] {
            self.meta
                .get_mut(self.path, self.txn)?
                .insert(name, &value.to_le_bytes()[..])
                .map_err(|e| map_err(self.path, e))?;
        }
        Ok(())
    }

    /// Closes the tables: the frame body being built (`None` when nothing
    /// was changed or the transaction is not logged), the record keys
    /// changed (logged tables only), and the state counts, which the
    /// caller writes with [`write_tally`] before it commits.
    pub(crate) fn finish(self) -> Finished {
        Finished {
            body: self.log.filter(|l| !l.is_empty()),
            touched: self.touched,
            tally: self.tally,
        }
    }
}

/// What a closed [`Tables`] leaves: see [`Tables::finish`].
pub(crate) struct Finished {
    pub body: Option<BodyWriter>,
    pub touched: Vec<Vec<u8>>,
    /// The state counts as of the transaction (`None`: never read).
    pub tally: Option<Tally>,
}

/// Writes the state counts into `txn` before it commits (`None`: never read
/// by it, so unchanged).
pub(crate) fn write_tally(path: &Path, txn: &WriteTransaction, tally: Option<Tally>) -> Result<()> {
    let Some(tally) = tally else {
        return Ok(());
    };
    txn.open_table(META)
        .map_err(|e| map_err(path, e))?
        .insert(META_STATE_COUNTS, &tally.to_bytes()[..])
        .map_err(|e| map_err(path, e))?;
    Ok(())
}

fn split_expiry(key: &[u8]) -> Option<(u64, &[u8])> {
    let (d, k) = key.split_at_checked(8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(d);
    Some((u64::from_le_bytes(a), k))
}

/// The sequence number of the last log frame `txn` holds the effects of.
pub(crate) fn applied_seq(path: &Path, txn: &redb::ReadTransaction) -> Result<u64> {
    let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    let value = table.get(META_APPLIED_SEQ).map_err(|e| map_err(path, e))?;
    value.map_or(Ok(0), |v| u64_of(path, META_APPLIED_SEQ, v.value()))
}

/// Number of stored records (including expired ones not yet evicted), and
/// the last log sequence number the snapshot holds.
pub(crate) fn record_count(path: &Path, db: &Database) -> Result<(u64, u64)> {
    guard(path, || {
        let txn = db.begin_read().map_err(|e| map_err(path, e))?;
        let seq = applied_seq(path, &txn)?;
        let table = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
        Ok((table.len().map_err(|e| map_err(path, e))?, seq))
    })
}

/// The token counter as of the latest commit.
pub(crate) fn next_token(path: &Path, db: &Database) -> Result<u64> {
    guard(path, || {
        let txn = db.begin_read().map_err(|e| map_err(path, e))?;
        let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
        read_meta(path, &table).map(|m| m.next_token)
    })
}

/// Whether the file at `path` looks like redb's setup of it was cut:
/// redb writes its 9-byte magic number last, so such a file has zeros
/// there and its header's next bytes (the god byte, the page size) set.
fn setup_cut(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 16];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| head[..9].iter().all(|&b| b == 0) && head[9..].iter().any(|&b| b != 0))
}

/// Maps an error of opening the redb file at `path`: held by another
/// store ([`Error::AlreadyOpen`]), not a redb file
/// ([`Error::IncompatibleFile`], which says when the file is the remains of
/// a cut setup), or what [`map_err`] makes of it.
pub(crate) fn open_error(path: &Path, err: redb::DatabaseError) -> Error {
    match err {
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::WouldBlock =>
        {
            Error::AlreadyOpen {
                path: path.to_path_buf(),
            }
        }
        // redb's answer to a file without its magic number.
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Error::IncompatibleFile {
                path: path.to_path_buf(),
                detail: if setup_cut(path) {
                    format!(
                        "not a redb file ({io}), but the remains of a setup that was cut: \
                         redb writes its magic number last, and the file has zeros there \
                         and redb's header after them (an open of an empty file at this \
                         path killed midway). It holds no store and nothing was \
                         acknowledged in it: if nothing else wrote this file, remove it and \
                         open again"
                    )
                } else {
                    format!("not a redb file, so not an idemstore file ({io})")
                },
            }
        }
        other => map_err(path, other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 24 * 3600 * 1000;

    fn memory_db() -> Database {
        Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .unwrap()
    }

    /// The damage marker a file records is hostile input: only a plain
    /// absolute path ending in `-damaged`, of at most 4,096 bytes, is
    /// taken; anything else is named as malformed (the open ignores it).
    #[test]
    fn a_recorded_damage_marker_is_taken_only_when_plain() {
        let db = memory_db();
        let path = Path::new("memory.redb");
        assert_eq!(recorded_damage_marker(path, &db).unwrap(), Ok(None));
        let set = |value: &[u8]| {
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(META).unwrap();
                table.insert(META_DAMAGE_MARKER, value).unwrap();
            }
            txn.commit().unwrap();
        };
        let txn = db.begin_write().unwrap();
        record_damage_marker(path, &txn, Path::new("/srv/s.redb-damaged")).unwrap();
        txn.commit().unwrap();
        assert_eq!(
            recorded_damage_marker(path, &db).unwrap(),
            Ok(Some(PathBuf::from("/srv/s.redb-damaged")))
        );
        let long = [b"/".as_slice(), &[b'a'; 4100], b"-damaged"].concat();
        for bad in [
            b"s.redb-damaged".as_slice(),
            b"/srv/s.redb",
            b"/srv/../s.redb-damaged",
            b"/srv/s\0.redb-damaged",
            b"",
            &long,
        ] {
            set(bad);
            assert!(
                recorded_damage_marker(path, &db).unwrap().is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// Everything the records table, the expiry index and the expiry
    /// counts hold.
    type Contents = (
        Vec<(Vec<u8>, Vec<u8>)>,
        Vec<(u64, Vec<u8>)>,
        Vec<expiry_counts::Row>,
    );

    /// Asserts that the expiry counts hold what a recount of the index
    /// finds.
    fn assert_counts_in_step(db: &Database) {
        let path = Path::new("counts");
        let txn = db.begin_read().unwrap();
        let expiry = txn.open_table(EXPIRY).unwrap();
        let seconds = txn.open_table(EXPIRY_COUNTS).unwrap();
        let mut recount = expiry_counts::Recount::new(expiry_counts::rows(path, &seconds).unwrap());
        for entry in expiry.iter().unwrap() {
            recount.entry(entry.unwrap().0.value().0).unwrap();
        }
        let recount = recount.finish().unwrap();
        assert_eq!(recount.differ, 0, "{:?}", recount.first);
    }

    /// A slot from random bits: few values (so that changes meet), over
    /// three seconds, each state code, in flight or not.
    fn some_slot(r: u64) -> u64 {
        let tag = if r.is_multiple_of(5) {
            IN_FLIGHT_TAG
        } else {
            0
        };
        tag | (((r >> 2) % 3 * expiry_counts::SECOND_MS) << STATE_BITS) | (r % 4)
    }

    fn contents(db: &Database) -> Contents {
        let txn = db.begin_read().unwrap();
        let records = txn.open_table(RECORDS).unwrap();
        let expiry = txn.open_table(EXPIRY).unwrap();
        let r = records
            .iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                (k.value().to_vec(), v.value().to_vec())
            })
            .collect();
        let x = expiry
            .iter()
            .unwrap()
            .map(|e| {
                let (k, _) = e.unwrap();
                let (d, key) = k.value();
                (d, key.to_vec())
            })
            .collect();
        let seconds = txn.open_table(EXPIRY_COUNTS).unwrap();
        let c = expiry_counts::rows(Path::new("contents"), &seconds)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        (r, x, c)
    }

    /// A xorshift64 generator: the tests' reproducible stream of changes.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// Buffered tables, applied in part at arbitrary points and changed
    /// again after, end as the same changes applied one by one: the same
    /// records, expiry entries and state counts.
    #[test]
    fn buffered_tables_end_as_direct_ones() {
        let path = Path::new("buffer-test");
        let (direct_db, buffered_db) = (memory_db(), memory_db());
        let mut pending = Pending::default();
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let direct_txn = direct_db.begin_write().unwrap();
        let buffered_txn = buffered_db.begin_write().unwrap();
        let (direct_tally, buffered_tally) = {
            let mut direct = Tables::open(path, &direct_txn, false);
            let mut buffered = Tables::buffered(path, &buffered_txn, &mut pending);
            for _ in 0..2000 {
                let r = next();
                let key = [b'k', u8::try_from(r % 16).unwrap()];
                let deadline = some_slot(r >> 8);
                // An envelope whose state byte varies, so that the state
                // counts move (most are unreadable: counted as such).
                let envelope = [u8::try_from((r >> 16) % 7).unwrap(); 12];
                for t in [&mut direct, &mut buffered] {
                    match (r >> 24) % 5 {
                        0 | 1 => t.put_record(&key, &envelope).unwrap(),
                        2 => t.remove_record(&key).unwrap(),
                        3 => t.insert_expiry(deadline, &key).unwrap(),
                        _ => t.remove_expiry(deadline, &key).unwrap(),
                    }
                }
                assert_eq!(
                    direct.get_record(&key).unwrap(),
                    buffered.get_record(&key).unwrap()
                );
                if (r >> 32).is_multiple_of(7) {
                    let n = usize::try_from((r >> 40) % 4).unwrap();
                    buffered.apply_pending_some(n + 1).unwrap();
                }
            }
            buffered.apply_pending().unwrap();
            (direct.finish().tally, buffered.finish().tally)
        };
        assert_eq!(direct_tally, buffered_tally);
        assert!(direct_tally.is_some_and(|t| t.total() > 0));
        direct_txn.commit().unwrap();
        buffered_txn.commit().unwrap();
        assert_eq!(contents(&direct_db), contents(&buffered_db));
        assert!(!contents(&direct_db).2.is_empty());
        assert_counts_in_step(&direct_db);
        assert_counts_in_step(&buffered_db);
    }

    /// Recovery's replay: the frame a logged writer's tables wrote, decoded
    /// and applied through unlogged tables that buffer (as `wal::open`
    /// replays, applying the buffer whenever it fills and at the end), ends
    /// as the changes themselves did: the same records, expiry entries and
    /// state counts and business-key bindings, on an index that already
    /// held some of the keys.
    #[test]
    fn a_buffered_replay_ends_as_the_logged_changes() {
        let path = Path::new("replay-test");
        let (written_db, replayed_db) = (memory_db(), memory_db());
        // Both indexes start with the same records: the replay changes an
        // existing index, not an empty one.
        for db in [&written_db, &replayed_db] {
            let txn = db.begin_write().unwrap();
            {
                let mut t = Tables::open(path, &txn, false);
                for k in 0..8u8 {
                    t.put_record(&[b'k', k], &[k % 7; 12]).unwrap();
                    t.insert_expiry(some_slot(u64::from(k)), &[b'k', k])
                        .unwrap();
                }
                let tally = t.finish().tally;
                write_tally(path, &txn, tally).unwrap();
            }
            txn.commit().unwrap();
        }
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let txn = written_db.begin_write().unwrap();
        let (body, written_tally) = {
            let mut t = Tables::open(path, &txn, true);
            for _ in 0..3000 {
                let r = next();
                let key = [b'k', u8::try_from(r % 16).unwrap()];
                let deadline = some_slot(r >> 8);
                let envelope = [u8::try_from((r >> 16) % 7).unwrap(); 12];
                let binding = [b'b', u8::try_from((r >> 40) % 4).unwrap()];
                match (r >> 24) % 7 {
                    0 | 1 => t.put_record(&key, &envelope).unwrap(),
                    2 => t.remove_record(&key).unwrap(),
                    3 => t.insert_expiry(deadline, &key).unwrap(),
                    4 => t.remove_expiry(deadline, &key).unwrap(),
                    5 => t.put_business(&binding, &key).unwrap(),
                    _ => t.remove_business(&binding).unwrap(),
                }
            }
            let finished = t.finish();
            (finished.body.unwrap().finish(7, 9), finished.tally)
        };
        write_tally(path, &txn, written_tally).unwrap();
        txn.commit().unwrap();

        let decoded = super::super::wal::decode_body(&body).unwrap();
        let txn = replayed_db.begin_write().unwrap();
        let mut pending = Pending::default();
        let replayed_tally = {
            let mut t = Tables::open(path, &txn, false).buffering(&mut pending);
            assert_eq!(decoded.changes.len(), 3000);
            for (i, change) in decoded.changes.iter().enumerate() {
                assert!(t.apply(*change).unwrap());
                // The buffer applied part way, as a full one is; the last
                // 200 changes wait for the final application.
                if i % 700 == 699 {
                    t.apply_pending().unwrap();
                }
            }
            t.apply_pending().unwrap();
            let finished = t.finish();
            assert!(
                finished.touched.is_empty(),
                "an unlogged replay gates no key"
            );
            finished.tally
        };
        write_tally(path, &txn, replayed_tally).unwrap();
        txn.commit().unwrap();
        assert_eq!(written_tally, replayed_tally);
        assert_eq!(contents(&written_db), contents(&replayed_db));
        assert_counts_in_step(&written_db);
        assert_counts_in_step(&replayed_db);
        let business = |db: &Database| -> Vec<(Vec<u8>, Vec<u8>)> {
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(BUSINESS).unwrap();
            table
                .iter()
                .unwrap()
                .map(|e| {
                    let (k, v) = e.unwrap();
                    (k.value().to_vec(), v.value().to_vec())
                })
                .collect()
        };
        assert!(!business(&written_db).is_empty());
        assert_eq!(business(&written_db), business(&replayed_db));
    }

    fn policy(interval_ms: Option<u64>, wall_ms: u64) -> IntegrityPolicy {
        IntegrityPolicy {
            interval_ms,
            wall_ms,
        }
    }

    fn clean(verified_ms: Option<u64>) -> Option<Peek> {
        Some(Peek {
            clean: true,
            verified_ms,
        })
    }

    #[test]
    fn check_reason_covers_every_case() {
        let now = 1_800_000_000_000;
        let p = policy(Some(DAY), now);
        assert_eq!(
            check_reason(clean(Some(now)), policy(None, now)),
            Some(CheckReason::EveryOpen)
        );
        assert_eq!(check_reason(None, p), Some(CheckReason::NoMetadata));
        let unclean = Some(Peek {
            clean: false,
            verified_ms: Some(now),
        });
        assert_eq!(check_reason(unclean, p), Some(CheckReason::Unclean));
        assert_eq!(
            check_reason(clean(None), p),
            Some(CheckReason::NeverVerified)
        );
        assert_eq!(check_reason(clean(Some(now)), p), None);
        assert_eq!(check_reason(clean(Some(now - DAY + 1)), p), None);
        assert_eq!(
            check_reason(clean(Some(now - DAY)), p),
            Some(CheckReason::Due)
        );
        assert_eq!(check_reason(clean(Some(0)), p), Some(CheckReason::Due));
        let ahead = now + VERIFIED_FUTURE_TOLERANCE_MS;
        assert_eq!(check_reason(clean(Some(ahead)), p), None);
        assert_eq!(
            check_reason(clean(Some(ahead + 1)), p),
            Some(CheckReason::VerifiedInFuture)
        );
    }

    /// Hostile values at the edges of u64 neither overflow nor read as
    /// recent.
    #[test]
    fn check_reason_arithmetic_is_checked_at_the_edges() {
        let max = u64::MAX;
        assert_eq!(
            check_reason(clean(Some(max)), policy(Some(DAY), 0)),
            Some(CheckReason::VerifiedInFuture)
        );
        // A wall clock at the top of the range has no future to refuse.
        assert_eq!(check_reason(clean(Some(max)), policy(Some(DAY), max)), None);
        assert_eq!(
            check_reason(clean(Some(0)), policy(Some(DAY), max)),
            Some(CheckReason::Due)
        );
        // The longest period: only never verified, future or unclean check.
        assert_eq!(
            check_reason(clean(Some(0)), policy(Some(max), max - 1)),
            None
        );
        assert_eq!(
            check_reason(clean(Some(0)), policy(Some(max), max)),
            Some(CheckReason::Due)
        );
        assert_eq!(check_reason(clean(Some(0)), policy(Some(1), 0)), None);
    }
}
