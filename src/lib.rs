//! An embedded, crash-safe idempotency store: a retried side effect runs once.
//!
//! A caller's orchestrator fixes an idempotency key before the first attempt
//! (for an agent, `task_id:tool_call_id`). The executing side claims that key
//! atomically, holds it with a fenced lease while the work runs, records the
//! outcome durably, replays it to every later retry, rejects a reused key with
//! a different payload, and forgets it after a retention period (24 hours by
//! default, as Stripe does). All of it lives in the process, on one file;
//! with the cargo feature `postgres`, the same `Store` runs on one schema
//! of a PostgreSQL database shared by every replica (`Store::connect`).
//!
//! ```
//! use idemstore::{ClaimOptions, ClaimOutcome, Fingerprint, Key, Store};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?; // any directory: the store is this file and its log
//! let store = Store::open(dir.path().join("idem.redb"))?;
//! let key = Key::new("acme/tickets.create", "task-42:call-7")?;
//! let payload = br#"{"title":"printer on fire"}"#;
//! let fingerprint = Fingerprint::of(payload);
//!
//! // First attempt: we hold the key, do the work, record the outcome.
//! let ClaimOutcome::Acquired(lease) = store.claim(&key, &fingerprint, &ClaimOptions::new())? else {
//!     unreachable!("a fresh key is acquired");
//! };
//! let ticket_id = b"T-1001"; // ... create the ticket here ...
//! store.complete(&lease, ticket_id)?;
//!
//! // A retry with the same key and payload replays the stored outcome.
//! match store.claim(&key, &fingerprint, &ClaimOptions::new())? {
//!     ClaimOutcome::Replay(record) => assert_eq!(record.result(), Some(&ticket_id[..])),
//!     other => unreachable!("{other:?}"),
//! }
//!
//! // The same key with a different payload is refused (HTTP 422).
//! let other = Fingerprint::of(br#"{"title":"something else"}"#);
//! assert!(matches!(
//!     store.claim(&key, &other, &ClaimOptions::new()),
//!     Err(idemstore::Error::FingerprintMismatch { .. })
//! ));
//! # Ok(())
//! # }
//! ```
//!
//! # What it guarantees
//!
//! - One valid lease per key at a time, under any number of threads.
//! - Every acknowledged change (claim, complete, fail, release, extend,
//!   recovery point) is on stable storage when the call returns; after a
//!   crash the store answers as if the process had paused. (Opt-in
//!   [`Durability::Buffered`] trades a bounded window of acknowledged
//!   changes for speed.) Concurrent changes share one fsync of a
//!   write-ahead log beside the store file; `docs/design.md` has the file
//!   formats and the crash analysis.
//! - Fencing tokens come from one store-wide counter and are never reused; a
//!   holder whose lease was taken over gets [`Error::StaleLease`].
//! - Corruption is detected (checksums over key and body) and reported as an
//!   error naming the key or file, never as a wrong answer or a panic.
//! - A store file's time, at which leases and retention are judged, is defined
//!   once on [`Clock`] ("The store's time"; a PostgreSQL store takes the
//!   server's clock, see `Store::connect`): `max(wall, floor + monotonic
//!   time elapsed since the floor was set)`, so it follows the wall clock
//!   forward and keeps moving when the wall clock steps back; it never runs
//!   backwards, across crashes too (a bound is reserved durably before any
//!   answer uses a time), and after crashes it is at most
//!   [`TIME_RESERVATION`] (1 s) ahead of the wall clock.
//! - Creating a store file is atomic (a temporary file linked into place): a
//!   crash while creating it leaves no store or one that opens.
//! - The `*_async` methods never block their executor on the writer: a full
//!   queue ([`WRITER_QUEUE_BOUND`]) is awaited.
//!
//! The store cannot make the side effect and [`Store::complete`] one atomic
//! step. Pass the idempotency key to the downstream system too (a payment's
//! merchant reference, a ticket's external id), and when a lease is a
//! takeover ([`Lease::is_takeover`]) ask the downstream what happened before
//! acting again.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "agent")]
pub mod agent;
#[cfg(feature = "mcp")]
pub mod mcp;

/// README.md's Rust snippets, compiled and run as doc tests (with
/// `--all-features`, since some use the `agent` and `http` features; CI
/// runs `cargo test --profile ci --all-features`). Never part of a build.
#[cfg(all(doctest, feature = "agent", feature = "http", feature = "postgres"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// `docs/*.md`'s Rust snippets, compiled and run as doc tests like
/// README's. Never part of a build.
#[cfg(all(doctest, feature = "agent", feature = "http", feature = "postgres"))]
pub mod docs_doctests {
    /// docs/agents.md.
    #[doc = include_str!("../docs/agents.md")]
    pub struct Agents;
    /// docs/http.md.
    #[doc = include_str!("../docs/http.md")]
    pub struct Http;
    /// docs/operations.md.
    #[doc = include_str!("../docs/operations.md")]
    #[doc = include_str!("../docs/postgres.md")]
    pub struct Operations;
    /// docs/mcp.md (its snippets use the `mcp` feature).
    #[cfg(feature = "mcp")]
    #[doc = include_str!("../docs/mcp.md")]
    pub struct Mcp;
    /// docs/demo.md, docs/design.md and docs/testing.md (no Rust, but their
    /// code blocks must be marked as what they are).
    #[doc = include_str!("../docs/demo.md")]
    #[doc = include_str!("../docs/design.md")]
    #[doc = include_str!("../docs/store.md")]
    #[doc = include_str!("../docs/testing.md")]
    pub struct Other;
}

// The layers, top to bottom; a module imports only from its own layer or
// below (tests/architecture.rs checks it):
// - the public face: `store` (`Store`), `check` (`check_file`), `agent`, `mcp`,
//   `http`, `postgres` (`complete_in`, `fail_in`), `conformance`, and what
//   `agent` and `http` share to keep a lease while work runs: `renewal` (its
//   schedule) and `extender` (the store's threads that renew leases);
// - operations written once over any engine: `backup` (export and import
//   framing), `scan`, `sweeper`;
// - the engine boundary: `engine`;
// - the engines: `embedded` (one file and its write-ahead log), `pg`
//   (PostgreSQL);
// - definitions every engine shares, no I/O: `config`, `codec` (the record
//   envelope), `audit` (events), `stats` (counters and their shape),
//   `metrics`;
// - the pure core: `key`, `record` (records and the transition function),
//   `clock`, `error`.
mod audit;
mod backup;
mod check;
mod clock;
mod codec;
mod compact;
mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod embedded;
mod engine;
mod error;
#[cfg(any(feature = "agent", feature = "http"))]
mod extender;
#[cfg(feature = "http")]
pub mod http;
mod key;
#[cfg(feature = "metrics")]
pub mod metrics;
mod orphans;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(feature = "postgres")]
pub mod postgres;
mod record;
#[cfg(any(feature = "agent", feature = "http"))]
mod renewal;
mod report;
mod salvage;
mod scan;
mod stats;
mod store;
mod sweeper;

pub use backup::{
    DEFAULT_CLOCK_TOLERANCE, ExportSummary, ImportOptions, ImportSummary, check_export_start,
};
pub use check::{LOG_PROBLEM, UNREAD_PROBLEM, check_file};
pub use clock::{Clock, ManualClock, SystemClock, TIME_RESERVATION};
pub use compact::{Compaction, compact_file};
pub use config::{
    ClaimOptions, Config, DEFAULT_INTEGRITY_CHECK_INTERVAL, DEFAULT_SCRUB_RATE,
    DEFAULT_SWEEP_BATCH, Durability, MAX_CLAIM_MANY, MAX_LEASE, MAX_RETENTION, MAX_SCRUB_RATE,
    MAX_TOKEN, MAX_VALUE_LIMIT, MIN_RENEWED_LEASE, PostgresLimits, PostgresPooler,
};
pub use embedded::WRITER_QUEUE_BOUND;
pub use embedded::wal::{FileLog, LogFile, MemoryLog};
pub use error::{ConfigFault, Error, ImportRule, Result};
pub use key::{
    Fingerprint, Key, MAX_BUSINESS_KEY_LEN, MAX_FINGERPRINT_LEN, MAX_ID_LEN, MAX_SCOPE_LEN,
};
pub use record::{AcquiredFrom, ClaimOutcome, Lease, Record, Resolution, State};
/// The redb storage seam re-exported for [`Store::open_with_backend`].
pub use redb::{BackendError, StorageBackend};
pub use report::{CheckReport, Integrity, MAX_LISTED_PROBLEMS, Problem, Progress, ScrubReport};
pub use salvage::{Salvage, salvage_file};
pub use scan::{Filter, Records};
pub use stats::{Counters, StateCounts, Stats};
pub use store::Store;

/// Entry points for the fuzz targets in `fuzz/` and their corpus replay in
/// `tests/fuzz_corpus.rs` (cargo feature `fuzzing`). Not part of the API:
/// no stability promise.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use crate::record::{Ctx, Effect, Op, Reply, transition};
    use crate::{ClaimOutcome, Error, Fingerprint, Key, Record, Result, codec};

    /// The records of one store decided by the pure transition function
    /// alone: no storage, no threads, no clock (the caller gives the store's
    /// time), no business keys. Inputs are not validated (sizes, lease
    /// bounds): the store does that before the transition, and a caller
    /// must not present what the store would refuse. Tokens start at 1 and
    /// grow by one per acquisition.
    #[derive(Debug, Clone)]
    pub struct Machine {
        /// Kept records, found by a linear search: a fuzz run has a few
        /// keys, and hashing a key costs more than comparing it.
        records: Vec<Record>,
        next_token: u64,
        retention_ms: u64,
    }

    impl Machine {
        /// An empty store whose records are kept `retention_ms` after they
        /// finish.
        pub fn new(retention_ms: u64) -> Machine {
            Machine {
                records: Vec::new(),
                next_token: 1,
                retention_ms,
            }
        }

        fn step(&mut self, key: &Key, op: &Op, now_ms: u64) -> Result<Reply> {
            let ctx = Ctx {
                now_ms,
                retention_ms: self.retention_ms,
                next_token: self.next_token,
                business_holder: None,
            };
            let at = self.records.iter().position(|r| r.key() == key);
            let current = at.map(|i| &self.records[i]);
            let (effect, reply) = transition(key, current, op, &ctx)?;
            match effect {
                Effect::None => {}
                Effect::Put(record) => {
                    if matches!(reply, Reply::Claim(ClaimOutcome::Acquired(_))) {
                        self.next_token =
                            self.next_token
                                .checked_add(1)
                                .ok_or(Error::InvalidArgument {
                                    what: "token",
                                    reason: "the token counter is exhausted".into(),
                                })?;
                    }
                    match at {
                        Some(i) => self.records[i] = record,
                        None => self.records.push(record),
                    }
                }
                Effect::Delete => {
                    if let Some(i) = at {
                        self.records.swap_remove(i);
                    }
                }
            }
            Ok(reply)
        }

        /// Claims `key` at `now_ms` with a lease of `lease_ms`.
        ///
        /// # Errors
        /// What the transition refuses (a fingerprint mismatch).
        pub fn claim(
            &mut self,
            key: &Key,
            fingerprint: &Fingerprint,
            lease_ms: u64,
            now_ms: u64,
        ) -> Result<ClaimOutcome> {
            let op = Op::Claim {
                fingerprint: fingerprint.clone(),
                lease_ms,
                business_key: None,
            };
            match self.step(key, &op, now_ms)? {
                Reply::Claim(outcome) => Ok(outcome),
                other => unexpected(&other),
            }
        }

        /// Completes (`failure` `None`) or fails the record of `key` held
        /// with `token`.
        ///
        /// # Errors
        /// [`Error::StaleLease`] when `token` does not hold the record.
        pub fn finish(
            &mut self,
            key: &Key,
            token: u64,
            bytes: &[u8],
            failure: Option<bool>,
            now_ms: u64,
        ) -> Result<Record> {
            let op = match failure {
                None => Op::Complete {
                    token,
                    result: bytes.to_vec(),
                },
                Some(retryable) => Op::Fail {
                    token,
                    failure: bytes.to_vec(),
                    retryable,
                },
            };
            match self.step(key, &op, now_ms)? {
                Reply::Record(record) => Ok(record),
                other => unexpected(&other),
            }
        }

        /// Releases the record of `key` held with `token`.
        ///
        /// # Errors
        /// [`Error::StaleLease`] when `token` does not hold the record.
        pub fn release(&mut self, key: &Key, token: u64, now_ms: u64) -> Result<()> {
            self.step(key, &Op::Release { token }, now_ms).map(drop)
        }

        /// Extends the lease of `key` held with `token`; the new deadline.
        ///
        /// # Errors
        /// [`Error::StaleLease`] when `token` does not hold the record.
        pub fn extend(&mut self, key: &Key, token: u64, lease_ms: u64, now_ms: u64) -> Result<u64> {
            match self.step(key, &Op::Extend { token, lease_ms }, now_ms)? {
                Reply::Record(record) => Ok(record.lease_until_ms()),
                other => unexpected(&other),
            }
        }

        /// Sets the recovery point of `key` held with `token`.
        ///
        /// # Errors
        /// [`Error::StaleLease`] when `token` does not hold the record.
        pub fn set_recovery_point(
            &mut self,
            key: &Key,
            token: u64,
            bytes: &[u8],
            now_ms: u64,
        ) -> Result<()> {
            let op = Op::SetRecoveryPoint {
                token,
                bytes: bytes.to_vec(),
            };
            self.step(key, &op, now_ms).map(drop)
        }

        /// The record of `key` as a reader sees it at `now_ms` (none once
        /// past retention).
        pub fn get(&self, key: &Key, now_ms: u64) -> Option<&Record> {
            self.records
                .iter()
                .find(|r| r.key() == key)
                .filter(|r| !r.is_expired_at(now_ms))
        }

        /// Forgets the record of `key` (an eviction).
        pub fn evict(&mut self, key: &Key) {
            self.records.retain(|r| r.key() != key);
        }

        /// How many records are kept, expired ones included.
        pub fn len(&self) -> usize {
            self.records.len()
        }

        /// Whether no record is kept.
        pub fn is_empty(&self) -> bool {
            self.records.is_empty()
        }
    }

    fn unexpected<T>(reply: &Reply) -> Result<T> {
        Err(Error::InvalidArgument {
            what: "reply",
            reason: format!("the transition answered {reply:?}"),
        })
    }

    /// Decodes a record envelope stored under the key bytes `key`.
    ///
    /// # Errors
    /// [`Error::CorruptRecord`](crate::Error::CorruptRecord) for anything
    /// that is not a valid envelope of a valid record under that key.
    pub fn decode_record(key: &[u8], bytes: &[u8]) -> Result<Record> {
        codec::decode_record(key, bytes)
    }

    /// Encodes `record` into its envelope, as the store writes it.
    pub fn encode_record(record: &Record) -> Vec<u8> {
        codec::encode_record(&record.key().to_bytes(), record)
    }

    /// Wraps arbitrary body bytes in a valid envelope (current version,
    /// correct checksum) so that a fuzzer reaches the body decoder.
    pub fn seal(key: &[u8], body: &[u8]) -> Vec<u8> {
        codec::seal(key, body)
    }

    /// The stored form of `key`.
    pub fn key_bytes(key: &Key) -> Vec<u8> {
        key.to_bytes()
    }
}
