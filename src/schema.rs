//! The on-disk schema: redb tables, metadata entries, opening and format
//! checks, and the boundary that turns redb errors and panics into ours.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle,
    WriteTransaction,
};

use crate::error::{Error, Result};

/// Records: stored key bytes → record envelope (see `codec`).
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
/// Expiry index: (expiry deadline in ms, stored key bytes) → (). Ordered by
/// deadline, so eviction reads only what has expired.
pub(crate) const EXPIRY: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("expiry");
/// Business keys: (scope prefix ‖ business key) → stored key bytes.
pub(crate) const BUSINESS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("business_keys");
/// Metadata: name → little-endian value bytes.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The store format this build writes and reads.
pub(crate) const FORMAT_VERSION: u64 = 1;

pub(crate) const META_FORMAT: &str = "format_version";
pub(crate) const META_STORE_ID: &str = "store_id";
pub(crate) const META_NEXT_TOKEN: &str = "next_token";
pub(crate) const META_CLOCK_HWM: &str = "clock_high_water_ms";

/// What the metadata table says about a store.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    pub store_id: u128,
    pub next_token: u64,
    pub clock_hwm: u64,
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

/// Opens (or creates) the redb file, or a database on `backend` when one is
/// given (`path` then only names it in errors), and checks or initialises
/// the metadata.
pub(crate) fn open<B: redb::StorageBackend>(
    path: &Path,
    backend: Option<B>,
    cache_bytes: usize,
) -> Result<(Database, Meta)> {
    guard(path, || {
        let mut builder = Database::builder();
        builder.set_cache_size(cache_bytes);
        // Verify every page checksum on every open, not only after a crash.
        // The record checksum cannot see a damaged key (the lookup simply
        // misses, and the key would be acquired twice), and a plain open of
        // a damaged file may panic inside redb. This reads the whole file,
        // as crash recovery already does.
        builder.set_check_integrity_on_open(true);
        let opened = match backend {
            Some(backend) => builder.create_with_backend(backend),
            None => builder.create(path),
        };
        let db = opened.map_err(|e| match e {
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
                    detail: format!("not a redb file, so not an idemstore file ({io})"),
                }
            }
            other => map_err(path, other),
        })?;
        let meta = init_meta(path, &db)?;
        Ok((db, meta))
    })
}

fn init_meta(path: &Path, db: &Database) -> Result<Meta> {
    let txn = db.begin_write().map_err(|e| map_err(path, e))?;
    let existing: Vec<String> = txn
        .list_tables()
        .map_err(|e| map_err(path, e))?
        .map(|t| t.name().to_string())
        .collect();
    let meta = {
        let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
        let format = table
            .get(META_FORMAT)
            .map_err(|e| map_err(path, e))?
            .map(|v| u64_of(path, META_FORMAT, v.value()))
            .transpose()?;
        match format {
            None if existing.iter().any(|t| t != META.name()) => {
                return Err(Error::IncompatibleFile {
                    path: path.to_path_buf(),
                    detail: "a redb file without idemstore metadata (not an idemstore file)".into(),
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
                Meta {
                    store_id: id,
                    next_token: 1,
                    clock_hwm: 0,
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
        }
    };
    // Create every table so that readers never meet a missing one.
    txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
    txn.commit().map_err(|e| map_err(path, e))?;
    Ok(meta)
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
    let next_token = get(META_NEXT_TOKEN)?
        .map(|v| u64_of(path, META_NEXT_TOKEN, &v))
        .transpose()?
        .unwrap_or(1);
    let clock_hwm = get(META_CLOCK_HWM)?
        .map(|v| u64_of(path, META_CLOCK_HWM, &v))
        .transpose()?
        .unwrap_or(0);
    Ok(Meta {
        store_id: u128::from_le_bytes(id),
        next_token,
        clock_hwm,
    })
}

/// Writes the token counter and clock high-water mark in `txn`.
pub(crate) fn write_counters(
    path: &Path,
    txn: &WriteTransaction,
    next_token: u64,
    clock_hwm: u64,
) -> Result<()> {
    let mut table = txn.open_table(META).map_err(|e| map_err(path, e))?;
    table
        .insert(META_NEXT_TOKEN, &next_token.to_le_bytes()[..])
        .map_err(|e| map_err(path, e))?;
    table
        .insert(META_CLOCK_HWM, &clock_hwm.to_le_bytes()[..])
        .map_err(|e| map_err(path, e))?;
    Ok(())
}

/// Number of stored records (including expired ones not yet evicted).
pub(crate) fn record_count(path: &Path, db: &Database) -> Result<u64> {
    guard(path, || {
        let txn = db.begin_read().map_err(|e| map_err(path, e))?;
        let table = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
        table.len().map_err(|e| map_err(path, e))
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
