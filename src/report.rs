//! What the operator's long operations report: how far an export, import
//! or check has come, and what a check found. Shared by every engine.

use std::hash::{BuildHasher, Hasher, RandomState};

#[cfg(all(test, feature = "postgres"))]
pub(crate) mod binding_damage;

/// How far an export, import or check has come, for a progress display.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// Records handled so far.
    pub records: u64,
    /// Bytes of the stream written or read so far (0 for a check).
    pub bytes: u64,
    /// Records expected in all, when known before the end: for
    /// [`check_file`](crate::check_file), the store's record count, read
    /// once redb's page check has passed (the records' check follows);
    /// `None` otherwise.
    pub total: Option<u64>,
}

/// The outcome of redb's own integrity check of the file's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Integrity {
    /// Not run: [`Store::verify`](crate::Store::verify) on an open store checks records only.
    NotRun,
    /// Every page and checksum of the file is sound.
    Clean,
    /// redb found damage and repaired the file; records lost with the
    /// damaged pages are gone (the record check that follows sees the
    /// repaired file).
    Repaired,
    /// The file's pages are damaged: redb found damage it could not repair,
    /// or the file does not open at all because of it (redb's message, such
    /// as "Primary is corrupted despite 2-phase commit", names what
    /// failed). The records are still checked as far as the pages give
    /// them, from the index as of its last checkpoint, through a view that
    /// writes nothing to the file, and each damaged one is named; when even
    /// that read fails, none are ([`CheckReport::records_checked`] is
    /// `false`, and a problem keyed [`UNREAD_PROBLEM`](crate::UNREAD_PROBLEM)
    /// says why). The next step is a restore from the latest export into a
    /// new file (`idemstore import --create NEW EXPORT`).
    Failed(String),
}

/// One problem found by a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The key concerned, as `scope/id` (escaped bytes when the key itself
    /// is damaged), or a business-key binding, or what else is wrong (such
    /// as `(state counts)`). For people: `scope/id` is ambiguous when the
    /// scope or the id holds `/`.
    pub key: String,
    /// The idempotency key concerned, scope and id apart, when the problem
    /// is one record's and its stored key bytes decode as a key; `None` for
    /// a binding, key bytes that do not decode, or a problem of the store
    /// as a whole. (A record's checksum covers key and body: a damaged key
    /// byte that still decodes names the key a read of those bytes would
    /// find, as `key` does.)
    pub idempotency_key: Option<crate::Key>,
    /// What is wrong.
    pub detail: String,
}

impl Problem {
    /// A problem of the record stored under `key_bytes`, named `key`.
    pub(crate) fn of_record(key_bytes: &[u8], key: String, detail: String) -> Problem {
        Problem {
            key,
            idempotency_key: crate::Key::from_bytes(key_bytes).ok(),
            detail,
        }
    }

    /// A problem of the record whose key is `key`.
    pub(crate) fn of_key(key: &crate::Key, detail: String) -> Problem {
        Problem {
            key: key.to_string(),
            idempotency_key: Some(key.clone()),
            detail,
        }
    }

    /// A problem with no decodable key: a binding, the store's counts,
    /// the file, or a record whose stored key is not known.
    pub(crate) fn other(what: String, detail: String) -> Problem {
        Problem {
            key: what,
            idempotency_key: None,
            detail,
        }
    }
}

/// What one step of the online scrub found: see
/// [`Store::scrub`](crate::Store::scrub) and
/// [`Config::scrub_rate`](crate::Config::scrub_rate).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScrubReport {
    /// Records this step walked (live, expired and damaged).
    pub records: u64,
    /// What this step found, in key order, at most 100 (the event `scrub
    /// pass finished` counts them all). A missing expiry index entry is
    /// reported and changes nothing; anything else is damage.
    pub problems: Vec<Problem>,
    /// Whether the step found damage, and so made the store refuse writes
    /// (see [`Config::scrub_rate`](crate::Config::scrub_rate)).
    pub damaged: bool,
    /// Whether this step ended the pass: it reached the key that was last
    /// when the pass started, or found no more records, or could not read
    /// on. The next step starts a new pass at the first key.
    pub pass_finished: bool,
}

/// The most problems a [`CheckReport`] lists (10,000); the rest are
/// counted in [`CheckReport::problems_found`]. A check of a store damaged
/// throughout so keeps its memory bounded: a listed problem is one line,
/// some 200 bytes for a typical key (about 2 MB for the whole list), at
/// most about 2 KB for the longest keys and business keys printed escaped
/// (about 20 MB), where listing every one of 10 million damaged records
/// would take gigabytes.
pub const MAX_LISTED_PROBLEMS: usize = 10_000;

/// What a check found: see [`Store::verify`](crate::Store::verify) and [`check_file`](crate::check_file).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckReport {
    /// redb's page-level check.
    pub integrity: Integrity,
    /// Whether the records were read and checked: `false` when the write-
    /// ahead log keeps the store from opening, or the pages are damaged and
    /// not even the index could be read (then `records` and `bindings` are
    /// 0, unread, and a problem says why). See [`Integrity::Failed`].
    pub records_checked: bool,
    /// Stored records read (live, expired and damaged).
    pub records: u64,
    /// Business-key bindings read.
    pub bindings: u64,
    /// The first [`MAX_LISTED_PROBLEMS`] problems found, in the order the
    /// check reads them (records in the store's key order, sorted by their
    /// printed `scope/id` when records without an expiry entry were looked
    /// for; then the state counts and, on a store file, the expiry counts;
    /// then business-key bindings), and the
    /// damage marker's line when the online scrub marked the store
    /// ([`check_file`](crate::check_file)).
    pub problems: Vec<Problem>,
    /// How many problems were found in all, listed or not (at least
    /// `problems.len()`).
    pub problems_found: u64,
}

impl CheckReport {
    /// A report with nothing read and nothing found yet.
    pub(crate) fn new(integrity: Integrity) -> CheckReport {
        CheckReport {
            integrity,
            records_checked: true,
            records: 0,
            bindings: 0,
            problems: Vec::new(),
            problems_found: 0,
        }
    }

    /// Counts `problem`, and lists it while fewer than
    /// [`MAX_LISTED_PROBLEMS`] are listed.
    pub(crate) fn found(&mut self, problem: Problem) {
        self.problems_found = self.problems_found.saturating_add(1);
        if self.problems.len() < MAX_LISTED_PROBLEMS {
            self.problems.push(problem);
        }
    }

    /// Counts and lists `problem` however many are listed already (the
    /// damage marker's line: it says why the store opens read-only).
    pub(crate) fn found_listed(&mut self, problem: Problem) {
        self.problems_found = self.problems_found.saturating_add(1);
        self.problems.push(problem);
    }

    /// Whether nothing is damaged: no problem, and redb's check (if it ran)
    /// neither failed nor had to repair the file.
    pub fn is_clean(&self) -> bool {
        self.problems_found == 0 && matches!(self.integrity, Integrity::NotRun | Integrity::Clean)
    }
}

/// An order-independent digest of a set of pairs of byte strings: two sums
/// of keyed SipHashes, with keys drawn at random per check (so that stored
/// data cannot be crafted to make two different sets agree), and a count.
/// A check compares what one table says another holds (the expiry index
/// entries the records call for, the business-key bindings the records
/// found bound to them) with what that table holds, reading each once in
/// its own order instead of a lookup per entry in random order.
pub(crate) struct PairDigest {
    hashers: [RandomState; 2],
    sums: [u64; 2],
    count: u64,
}

impl PairDigest {
    /// An empty digest under `hashers` (the same for the digests compared).
    pub(crate) fn new(hashers: &[RandomState; 2]) -> PairDigest {
        PairDigest {
            hashers: hashers.clone(),
            sums: [0; 2],
            count: 0,
        }
    }

    /// Adds the pair `(a, b)` (`a`'s length is hashed too, so that no two
    /// pairs of the same bytes split differently agree).
    pub(crate) fn add(&mut self, a: &[u8], b: &[u8]) {
        for (sum, hasher) in self.sums.iter_mut().zip(&self.hashers) {
            let mut h = hasher.build_hasher();
            h.write_usize(a.len());
            h.write(a);
            h.write(b);
            *sum = sum.wrapping_add(h.finish());
        }
        self.count = self.count.saturating_add(1);
    }

    /// Whether both digests hold the same pairs (up to a collision of two
    /// keyed 64-bit sums).
    pub(crate) fn matches(&self, other: &PairDigest) -> bool {
        self.sums == other.sums && self.count == other.count
    }
}
