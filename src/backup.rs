//! Export and import: a portable backup of a store as a stream of
//! length-prefixed, crc32-framed records.
//!
//! # Stream format (version 1)
//!
//! All integers little-endian.
//!
//! ```text
//! header  : magic "IDEMSTORE-EXPORT" (16 bytes) | version u32 = 1 | crc32 u32 over the 20 bytes before
//! frame   : length u32 (of kind + payload, ≤ MAX_FRAME) | crc32 u32 over kind + payload | kind u8 | payload
//! stream  : header, one META frame, any number of RECORD frames, one END frame, nothing after
//!
//! META    (kind 1): store id u128 | next token u64 | clock high-water mark (ms) u64 | record envelope version u8
//! RECORD  (kind 2): key length u16 | stored key bytes | record envelope (as stored; see codec.rs)
//! END     (kind 3): number of RECORD frames u64
//! ```
//!
//! A record frame carries the record exactly as the store keeps it: the
//! envelope with its own crc32 over key and body, so a record is checked
//! twice (frame and envelope) on import, and the body is only ever decoded
//! by the codec. The END frame lets import tell a complete stream from a
//! truncated one. Frame lengths are checked against [`MAX_FRAME`] before
//! anything is allocated, so a hostile stream cannot make import allocate
//! more than one largest record.

use std::io::{self, Read, Write};
use std::time::Duration;

use crate::codec::{self, DECODE_LIMIT, Entries, RECORD_VERSION};
use crate::config::{MAX_LEASE, MAX_RETENTION, MAX_TOKEN};
use crate::error::{Error, ImportRule, Result};
use crate::record::{ImportResult, Record};
pub(crate) use crate::report::Progress;

/// The magic bytes an export stream starts with.
pub(crate) const MAGIC: &[u8; 16] = b"IDEMSTORE-EXPORT";
/// The stream format this build writes and reads.
pub(crate) const EXPORT_VERSION: u32 = 1;
/// The largest frame (kind + payload) a stream may hold, in bytes: the
/// longest stored key and the largest record envelope, with room to spare.
pub(crate) const MAX_FRAME: usize = DECODE_LIMIT + 4096;
const HEADER_LEN: u64 = 24;

const KIND_META: u8 = 1;
const KIND_RECORD: u8 = 2;
const KIND_END: u8 = 3;

/// What [`Store::export`](crate::Store::export) wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExportSummary {
    /// Records written: every live record of the snapshot (records past
    /// retention are left out).
    pub records: u64,
    /// Bytes written.
    pub bytes: u64,
    /// The token counter of the snapshot: every token in the export is
    /// below it.
    pub next_token: u64,
}

/// What [`Store::import`](crate::Store::import) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportSummary {
    /// Record frames read.
    pub records: u64,
    /// Records written (their key was absent or past retention).
    pub imported: u64,
    /// Records skipped because a live record of the key exists: an import
    /// never overwrites one (so running it again changes nothing).
    pub present: u64,
    /// Records skipped because their retention has ended.
    pub expired: u64,
    /// Records skipped because a live record of another key holds their
    /// business key.
    pub business_key_taken: u64,
    /// The store's token counter after the import: above every token the
    /// stream holds and the stream's own counter, and at least the latest
    /// of the stream's times and the store's clock, in milliseconds, times
    /// 1,024 (at most 2^52), so that no token is handed out twice, also
    /// none that the source handed out after its export.
    pub next_token: u64,
}

/// The META frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamMeta {
    pub store_id: u128,
    pub next_token: u64,
    pub clock_hwm: u64,
}

fn write_err(err: &io::Error) -> Error {
    Error::Storage(format!("writing the export stream: {err}"))
}

/// Writes frames, counting bytes.
pub(crate) struct FrameWriter<W: Write> {
    out: W,
    bytes: u64,
}

impl<W: Write> FrameWriter<W> {
    /// Writes the stream header.
    pub(crate) fn new(mut out: W) -> Result<FrameWriter<W>> {
        let mut header = Vec::with_capacity(24);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&EXPORT_VERSION.to_le_bytes());
        let crc = crc32fast::hash(&header);
        header.extend_from_slice(&crc.to_le_bytes());
        out.write_all(&header).map_err(|e| write_err(&e))?;
        Ok(FrameWriter {
            out,
            bytes: HEADER_LEN,
        })
    }

    fn frame(&mut self, kind: u8, payload: &[u8]) -> Result<()> {
        let len = payload.len() + 1;
        let len32 = u32::try_from(len)
            .ok()
            .filter(|_| len <= MAX_FRAME)
            .ok_or_else(|| Error::Storage(format!("export frame of {len} bytes is too large")))?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&[kind]);
        hasher.update(payload);
        let mut head = [0u8; 9];
        head[..4].copy_from_slice(&len32.to_le_bytes());
        head[4..8].copy_from_slice(&hasher.finalize().to_le_bytes());
        head[8] = kind;
        self.out.write_all(&head).map_err(|e| write_err(&e))?;
        self.out.write_all(payload).map_err(|e| write_err(&e))?;
        self.bytes = self
            .bytes
            .checked_add(8 + u64::from(len32))
            .ok_or_else(|| Error::Storage("the export stream's length overflows".into()))?;
        Ok(())
    }

    pub(crate) fn meta(&mut self, meta: &StreamMeta) -> Result<()> {
        let mut p = Vec::with_capacity(33);
        p.extend_from_slice(&meta.store_id.to_le_bytes());
        p.extend_from_slice(&meta.next_token.to_le_bytes());
        p.extend_from_slice(&meta.clock_hwm.to_le_bytes());
        p.push(RECORD_VERSION);
        self.frame(KIND_META, &p)
    }

    /// A record frame: `key_bytes` and the envelope as stored.
    pub(crate) fn record(&mut self, key_bytes: &[u8], envelope: &[u8]) -> Result<()> {
        let key_len = u16::try_from(key_bytes.len())
            .map_err(|_| Error::Storage("stored key longer than 65535 bytes".into()))?;
        let mut p = Vec::with_capacity(2 + key_bytes.len() + envelope.len());
        p.extend_from_slice(&key_len.to_le_bytes());
        p.extend_from_slice(key_bytes);
        p.extend_from_slice(envelope);
        self.frame(KIND_RECORD, &p)
    }

    pub(crate) fn end(mut self, records: u64) -> Result<u64> {
        self.frame(KIND_END, &records.to_le_bytes())?;
        self.out.flush().map_err(|e| write_err(&e))?;
        Ok(self.bytes)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// One frame read from a stream.
#[derive(Debug)]
pub(crate) enum Frame {
    Meta(StreamMeta),
    Record(Box<Record>),
    End { records: u64 },
}

/// Reads and checks frames, tracking the byte offset for error messages.
pub(crate) struct FrameReader<R: Read> {
    input: R,
    offset: u64,
}

fn corrupt(offset: u64, detail: impl Into<String>) -> Error {
    Error::CorruptExport {
        offset,
        detail: detail.into(),
    }
}

impl<R: Read> FrameReader<R> {
    /// Reads and checks the stream header.
    pub(crate) fn new(mut input: R) -> Result<FrameReader<R>> {
        let mut header = [0u8; 24];
        let got = read_full(&mut input, &mut header)?;
        if got < header.len() || &header[..16] != MAGIC {
            return Err(corrupt(
                0,
                "not an idemstore export (the stream does not start with its magic bytes)",
            ));
        }
        let version = u32::from_le_bytes([header[16], header[17], header[18], header[19]]);
        let crc = u32::from_le_bytes([header[20], header[21], header[22], header[23]]);
        if crc32fast::hash(&header[..20]) != crc {
            return Err(corrupt(0, "stream header fails its crc32"));
        }
        if version == 0 {
            return Err(corrupt(
                16,
                "export format version 0 does not exist (versions start at 1)",
            ));
        }
        if version > EXPORT_VERSION {
            return Err(corrupt(
                16,
                format!(
                    "export format version {version} is newer than {EXPORT_VERSION}, the newest this build reads"
                ),
            ));
        }
        Ok(FrameReader {
            input,
            offset: HEADER_LEN,
        })
    }

    /// The byte offset of the next frame.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The next frame with its offset, or `None` at a clean end of input.
    pub(crate) fn next_frame(&mut self) -> Result<Option<(u64, Frame)>> {
        let at = self.offset;
        let mut head = [0u8; 8];
        match read_full(&mut self.input, &mut head)? {
            0 => return Ok(None),
            8 => {}
            n => {
                return Err(corrupt(
                    at,
                    format!("stream ends {n} bytes into a frame header"),
                ));
            }
        }
        let len32 = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let len = usize::try_from(len32).unwrap_or(usize::MAX);
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len == 0 || len > MAX_FRAME {
            return Err(corrupt(
                at,
                format!("frame length {len} is out of range (1 to {MAX_FRAME} bytes)"),
            ));
        }
        let mut body = vec![0u8; len];
        let got = read_full(&mut self.input, &mut body)?;
        if got < len {
            return Err(corrupt(
                at,
                format!("stream ends {got} bytes into a frame of {len} bytes"),
            ));
        }
        self.offset = self
            .offset
            .checked_add(8 + u64::from(len32))
            .ok_or_else(|| corrupt(at, "the stream's length overflows"))?;
        if crc32fast::hash(&body) != crc {
            return Err(corrupt(at, "frame fails its crc32"));
        }
        let (kind, payload) = (body[0], &body[1..]);
        let frame = match kind {
            KIND_META => Frame::Meta(parse_meta(at, payload)?),
            KIND_RECORD => Frame::Record(Box::new(parse_record(at, payload)?)),
            KIND_END => {
                let n: [u8; 8] = payload
                    .try_into()
                    .map_err(|_| corrupt(at, "end frame is not 8 bytes"))?;
                Frame::End {
                    records: u64::from_le_bytes(n),
                }
            }
            other => return Err(corrupt(at, format!("unknown frame kind {other}"))),
        };
        Ok(Some((at, frame)))
    }
}

fn parse_meta(at: u64, p: &[u8]) -> Result<StreamMeta> {
    if p.len() != 33 {
        return Err(corrupt(
            at,
            format!("meta frame is {} bytes, not 33", p.len()),
        ));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&p[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let mut id = [0u8; 16];
    id.copy_from_slice(&p[..16]);
    if p[32] != RECORD_VERSION {
        return Err(corrupt(
            at,
            format!(
                "records are in envelope version {}, this build reads {RECORD_VERSION}",
                p[32]
            ),
        ));
    }
    Ok(StreamMeta {
        store_id: u128::from_le_bytes(id),
        next_token: u64_at(16),
        clock_hwm: u64_at(24),
    })
}

fn parse_record(at: u64, p: &[u8]) -> Result<Record> {
    if p.len() < 2 {
        return Err(corrupt(at, "record frame too short"));
    }
    let key_len = usize::from(u16::from_le_bytes([p[0], p[1]]));
    if p.len() < 2 + key_len {
        return Err(corrupt(at, "record frame shorter than its key"));
    }
    let (key, envelope) = p[2..].split_at(key_len);
    codec::decode_record(key, envelope).map_err(|e| corrupt(at, e.to_string()))
}

/// Checks the start of an export stream, its header and its meta frame,
/// as [`Store::import`](crate::Store::import) checks their form, and gives back
/// a reader that yields the whole stream again from its first byte, for
/// the import. A restore into a store that does not exist yet checks this
/// before it creates the store, so that input that is not an export (an
/// empty or cut one, another file) creates nothing: `idemstore import
/// --create` does.
///
/// Reads the 24-byte header and the first frame, and keeps at most the
/// 66 bytes of a header and a meta frame (a first frame that claims more
/// is read into one buffer of at most 8 + `MAX_FRAME` bytes, as an import
/// reads any frame, and refused). The import reads and checks every later
/// frame: a stream damaged after its meta frame still stops it there, with
/// the batches before the damage imported. Of the meta frame's values, the
/// token counter is checked against the cap here; its clock high-water
/// mark is checked by the import against the store's clock, which only
/// an open store has.
///
/// # Errors
/// [`Error::CorruptExport`] with the byte offset and the fault, as
/// an import answers it: no export magic, a header failing its crc32 or of
/// a format version this build does not read, a stream that ends or is
/// damaged before the end of its meta frame, a first frame that is not the
/// meta frame. [`Error::ImportRefused`] with [`ImportRule::TokenCap`] for a
/// token counter above the cap (nothing imported). [`Error::Storage`] when
/// reading the input fails.
pub fn check_export_start<R: Read>(input: R) -> Result<io::Chain<io::Cursor<Vec<u8>>, R>> {
    let recording = Recording {
        inner: input,
        seen: Vec::new(),
    };
    let mut reader = FrameReader::new(recording)?;
    match reader.next_frame()? {
        Some((at, Frame::Meta(meta))) if meta.next_token > MAX_TOKEN => {
            return Err(Error::ImportRefused {
                offset: at,
                rule: ImportRule::TokenCap,
                detail: format!(
                    "the token counter {} is above the cap {MAX_TOKEN}",
                    meta.next_token
                ),
                imported: 0,
            });
        }
        Some((_, Frame::Meta(_))) => {}
        Some((at, _)) => return Err(corrupt(at, "the first frame is not the meta frame")),
        None => {
            return Err(corrupt(
                reader.offset(),
                "stream ends before its meta frame",
            ));
        }
    }
    let Recording { inner, seen } = reader.input;
    Ok(io::Cursor::new(seen).chain(inner))
}

/// The bytes of a stream's header and meta frame (8-byte frame head, kind
/// and 33-byte payload).
const START_LEN: usize = 24 + 8 + 34;

/// A reader that keeps a copy of the first [`START_LEN`] bytes read
/// through it (a stream whose start is longer is refused, and its copy not
/// needed).
struct Recording<R> {
    inner: R,
    seen: Vec<u8>,
}

impl<R: Read> Read for Recording<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let read = buf.get(..n).unwrap_or_default();
        let room = START_LEN.saturating_sub(self.seen.len()).min(read.len());
        self.seen
            .extend_from_slice(read.get(..room).unwrap_or_default());
        Ok(n)
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Storage(format!("reading the export stream: {e}"))),
        }
    }
    Ok(got)
}

/// Writes every live record of a snapshot to `out`: `store_id` and
/// `next_token` are the snapshot's, `entries` all its records in key
/// order, `now_ms` the store's time (records past it are left out).
pub(crate) fn export(
    store_id: u128,
    next_token: u64,
    entries: Entries,
    now_ms: u64,
    out: impl Write,
    mut progress: impl FnMut(Progress),
) -> Result<ExportSummary> {
    let mut writer = FrameWriter::new(out)?;
    writer.meta(&StreamMeta {
        store_id,
        next_token,
        // The store's time now: at least every time an answer was based on,
        // never the reserved bound ahead of it (an import of this stream
        // would adopt that lead).
        clock_hwm: now_ms,
    })?;
    let mut records = 0u64;
    for entry in entries {
        let (key, envelope) = entry?;
        // Verify before writing: an export is only as good as its records.
        let record = codec::decode_record(&key, &envelope)?;
        if record.is_expired_at(now_ms) {
            continue;
        }
        writer.record(&key, &envelope)?;
        records += 1;
        progress(Progress {
            records,
            bytes: writer.bytes(),
            total: None,
        });
    }
    let bytes = writer.end(records)?;
    Ok(ExportSummary {
        records,
        bytes,
        next_token,
    })
}

/// The most records one import write holds.
pub(crate) const IMPORT_BATCH: usize = 1024;
/// An import batch is handed to the writer once its record frames add up to
/// this many bytes (or [`IMPORT_BATCH`] records, whichever comes first), so
/// that an import holds at most this much of the stream in memory, plus the
/// one record that crosses the line (at most [`MAX_FRAME`] bytes).
pub(crate) const IMPORT_BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The default of [`ImportOptions::clock_tolerance`]: 5 minutes.
pub const DEFAULT_CLOCK_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// How [`Store::import_with`](crate::Store::import_with) treats a stream.
///
/// # Defaults
/// - `clock_tolerance`: [`DEFAULT_CLOCK_TOLERANCE`] (5 minutes)
/// - `accept_clock_ahead`: `false`
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportOptions {
    clock_tolerance: Duration,
    accept_clock_ahead: bool,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            clock_tolerance: DEFAULT_CLOCK_TOLERANCE,
            accept_clock_ahead: false,
        }
    }
}

impl ImportOptions {
    /// The defaults (see the type's docs).
    pub fn new() -> ImportOptions {
        ImportOptions::default()
    }

    /// How far (whole milliseconds) the stream's clock high-water mark and
    /// its records' update (and so creation) times may be ahead of the
    /// store's clock.
    /// A time further ahead is refused with [`Error::ImportRefused`]
    /// ([`ImportRule::ClockAhead`]) unless
    /// [`accept_clock_ahead`](ImportOptions::accept_clock_ahead) is set.
    /// The store's clock is raised to the latest imported time, but never
    /// by more than this: an import moves the store's time forward at most
    /// `clock_tolerance`, so it never makes every record expire at once.
    pub fn clock_tolerance(mut self, tolerance: Duration) -> ImportOptions {
        self.clock_tolerance = tolerance;
        self
    }

    /// Accept records and a clock high-water mark further ahead of the
    /// store's clock than [`clock_tolerance`](ImportOptions::clock_tolerance)
    /// (an export from a host whose clock ran ahead). The records are
    /// imported as they are, but the store's clock is still raised by at
    /// most the tolerance: the far-ahead time is not adopted. Off by
    /// default.
    pub fn accept_clock_ahead(mut self, accept: bool) -> ImportOptions {
        self.accept_clock_ahead = accept;
        self
    }
}

/// The limits an import checks every record against.
pub(crate) struct ImportLimits<'a> {
    pub options: ImportOptions,
    /// The store's time when the import started (ms since the epoch).
    pub now_ms: &'a dyn Fn() -> u64,
    /// The wall clock's reading when the import started (ms since the
    /// epoch): the tolerance counts from the later of the two, so that
    /// imports in a row cannot each move the store's time by another
    /// tolerance.
    pub wall_ms: u64,
    pub max_result_bytes: usize,
    pub max_failure_bytes: usize,
    pub max_recovery_point_bytes: usize,
}

impl ImportLimits<'_> {
    /// The latest time an imported time may be without being refused (and
    /// the highest the import raises the store's clock to).
    fn latest_ms(&self) -> u64 {
        let tolerance = crate::clock::duration_ms(self.options.clock_tolerance);
        (self.now_ms)().max(self.wall_ms.saturating_add(tolerance))
    }

    /// Checks a time read from the stream against the tolerance.
    fn time(&self, what: &str, t: u64) -> std::result::Result<(), (ImportRule, String)> {
        let latest = self.latest_ms();
        if t > latest && !self.options.accept_clock_ahead {
            return Err((
                ImportRule::ClockAhead,
                format!(
                    "{what} {t} ms is {} ms ahead of the store's clock, over the tolerance of {} ms \
                     (accept it explicitly to import anyway)",
                    t.saturating_sub((self.now_ms)()),
                    crate::clock::duration_ms(self.options.clock_tolerance)
                ),
            ));
        }
        Ok(())
    }

    /// Checks one record's invariants (see [`ImportRule`]).
    fn record(&self, r: &Record) -> std::result::Result<(), (ImportRule, String)> {
        use crate::record::State;
        if r.token >= MAX_TOKEN {
            return Err((
                ImportRule::TokenCap,
                format!("token {} is not below the cap {MAX_TOKEN}", r.token),
            ));
        }
        if r.token == 0 {
            return Err((
                ImportRule::TokenCap,
                "token 0 is never issued (a store's tokens start at 1)".into(),
            ));
        }
        let largest = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
        for (what, t) in [
            ("creation time", r.created_ms),
            ("update time", r.updated_ms),
            ("lease end", r.lease_until_ms),
            ("expiry", r.expires_ms),
        ] {
            if t > largest {
                return Err((
                    ImportRule::TimeOutOfRange,
                    format!("its {what} {t} ms is above the largest time, {largest} ms"),
                ));
            }
        }
        // A later write stamps its times at the record's last update at
        // least, and adds a lease and a retention to it: an update time
        // within the longest retention of the largest time would make that
        // write's lease end and expiry overflow what a `bigint` holds.
        let max_retention = crate::clock::duration_ms(MAX_RETENTION);
        let latest_update = largest.saturating_sub(max_retention);
        if r.updated_ms > latest_update {
            return Err((
                ImportRule::TimeOutOfRange,
                format!(
                    "its update time {} ms is above {latest_update} ms, the largest time less \
                     the longest retention, past which a later write's lease end and expiry \
                     would not fit",
                    r.updated_ms
                ),
            ));
        }
        if r.created_ms > r.updated_ms {
            return Err((
                ImportRule::TimesOutOfOrder,
                format!(
                    "created at {} ms, after its last update at {} ms",
                    r.created_ms, r.updated_ms
                ),
            ));
        }
        // Retention counts from the last update: a record past retention
        // at its own update time is one no store writes, and one that a
        // claim (judged at that time at least) would find absent while a
        // read at an earlier store time finds it live.
        if r.expires_ms <= r.updated_ms {
            return Err((
                ImportRule::TimesOutOfOrder,
                format!(
                    "expiring at {} ms, not after its last update at {} ms",
                    r.expires_ms, r.updated_ms
                ),
            ));
        }
        self.time("its update time", r.updated_ms)?;
        let max_lease = crate::clock::duration_ms(MAX_LEASE);
        if r.updated_ms
            .checked_add(max_lease)
            .is_none_or(|m| r.lease_until_ms > m)
        {
            return Err((
                ImportRule::LeaseTooLong,
                format!(
                    "lease until {} ms is more than the longest lease ({max_lease} ms) after its \
                     last update at {} ms",
                    r.lease_until_ms, r.updated_ms
                ),
            ));
        }
        // Even when far-ahead times are accepted, a lease ends within the
        // longest lease of this store's time: a record stamped years ahead
        // must not hold its key for years.
        if r.state == State::Processing
            && self
                .latest_ms()
                .checked_add(max_lease)
                .is_none_or(|m| r.lease_until_ms > m)
        {
            return Err((
                ImportRule::LeaseTooLong,
                format!(
                    "lease until {} ms is more than the longest lease ({max_lease} ms) ahead of \
                     the store's clock",
                    r.lease_until_ms
                ),
            ));
        }
        if r.updated_ms
            .checked_add(max_retention)
            .is_none_or(|m| r.expires_ms > m)
        {
            return Err((
                ImportRule::RetentionTooLong,
                format!(
                    "expiry at {} ms is more than the longest retention ({max_retention} ms) \
                     after its last update at {} ms",
                    r.expires_ms, r.updated_ms
                ),
            ));
        }
        if r.state == State::Processing && r.expires_ms < r.lease_until_ms {
            return Err((
                ImportRule::ExpiryBeforeLease,
                format!(
                    "a Processing record expiring at {} ms, before its lease ends at {} ms",
                    r.expires_ms, r.lease_until_ms
                ),
            ));
        }
        let output_limit = match r.state {
            State::Processing => self.max_failure_bytes,
            State::Succeeded => self.max_result_bytes,
            State::Failed { .. } => self.max_failure_bytes,
        };
        match (&r.output, r.state) {
            (None, State::Succeeded | State::Failed { .. }) => {
                return Err((
                    ImportRule::StateOutput,
                    format!("a {} record without its output", r.state.name()),
                ));
            }
            (Some(out), _) if out.len() > output_limit => {
                return Err((
                    ImportRule::TooLarge,
                    format!(
                        "its output is {} bytes, over the store's limit of {output_limit} bytes",
                        out.len()
                    ),
                ));
            }
            _ => {}
        }
        if let Some(rp) = &r.recovery_point
            && rp.len() > self.max_recovery_point_bytes
        {
            return Err((
                ImportRule::TooLarge,
                format!(
                    "its recovery point is {} bytes, over the store's limit of {} bytes",
                    rp.len(),
                    self.max_recovery_point_bytes
                ),
            ));
        }
        if r.acquisitions == 0 {
            return Err((
                ImportRule::StateOutput,
                "a record that was never acquired (0 acquisitions)".into(),
            ));
        }
        if let Some(bk) = &r.business_key
            && let Err(e) = crate::key::check_business_key(bk)
        {
            return Err((ImportRule::BusinessKey, e.to_string()));
        }
        Ok(())
    }
}

/// One batch of an import for the writer: the records, and the floors the
/// token counter and the clock must be raised to (at least one above every
/// token seen so far, and the latest time seen so far).
pub(crate) struct ImportBatch {
    pub records: Vec<Record>,
    pub token_floor: u64,
    pub clock_floor: u64,
}

/// What the writer did with each record of a batch.
pub(crate) type BatchResult = Vec<Result<ImportResult>>;

/// Reads a stream and hands it to `apply` in batches of up to
/// [`IMPORT_BATCH`] records and [`IMPORT_BATCH_BYTES`] bytes, each applied
/// atomically. The meta frame is checked against `limits` before anything
/// is written; every record is checked as it is read, and a batch is handed
/// over only once every frame in it has been read and checked, so a damaged
/// or refused frame stops the import before any record of its batch is
/// written.
pub(crate) fn import(
    input: impl Read,
    limits: &ImportLimits<'_>,
    mut progress: impl FnMut(Progress),
    mut apply: impl FnMut(ImportBatch) -> Result<BatchResult>,
) -> Result<ImportSummary> {
    let mut reader = FrameReader::new(input)?;
    let mut summary = ImportSummary::default();
    let refused = |at: u64, (rule, detail): (ImportRule, String), summary: &ImportSummary| {
        Error::ImportRefused {
            offset: at,
            rule,
            detail,
            imported: summary.imported,
        }
    };
    let meta = match reader.next_frame()? {
        Some((at, Frame::Meta(meta))) => {
            if meta.next_token > MAX_TOKEN {
                return Err(refused(
                    at,
                    (
                        ImportRule::TokenCap,
                        format!(
                            "the token counter {} is above the cap {MAX_TOKEN}",
                            meta.next_token
                        ),
                    ),
                    &summary,
                ));
            }
            limits
                .time("the clock high-water mark", meta.clock_hwm)
                .map_err(|e| refused(at, e, &summary))?;
            meta
        }
        Some((at, _)) => return Err(corrupt(at, "the first frame is not the meta frame")),
        None => {
            return Err(corrupt(
                reader.offset(),
                "stream ends before its meta frame",
            ));
        }
    };
    let mut token_floor = meta.next_token;
    // Never raised past the tolerance, even when far-ahead times are
    // accepted.
    let mut clock_floor = meta.clock_hwm.min(limits.latest_ms());
    let mut batch: Vec<Record> = Vec::new();
    // The byte offset of each batched record's frame, for errors.
    let mut batch_at: Vec<u64> = Vec::new();
    let mut batch_bytes = 0usize;
    // The counter is raised by the clock too, as a new PostgreSQL schema's
    // sequence starts: a source that kept handing out tokens after its
    // export (a replica serving until the cutover) hands out fewer than
    // `TOKENS_PER_MS` a millisecond, so none of them is handed out again
    // here (`config::TOKENS_PER_MS`).
    let store_ms = (limits.now_ms)().max(limits.wall_ms);
    let mut flush = |batch: &mut Vec<Record>,
                     batch_at: &mut Vec<u64>,
                     token_floor: u64,
                     clock_floor: u64,
                     summary: &mut ImportSummary|
     -> Result<()> {
        let by_clock = crate::config::clock_tokens(clock_floor.max(store_ms));
        let results = apply(ImportBatch {
            records: std::mem::take(batch),
            token_floor: token_floor.max(by_clock),
            clock_floor,
        })?;
        let offsets = std::mem::take(batch_at);
        // Every result is counted (the batch was written) before the first
        // record that failed is reported.
        let mut failed = None;
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(ImportResult::Written) => summary.imported += 1,
                Ok(ImportResult::Present) => summary.present += 1,
                Ok(ImportResult::Expired) => summary.expired += 1,
                Ok(ImportResult::BusinessKeyTaken) => summary.business_key_taken += 1,
                Err(e) => {
                    failed.get_or_insert((offsets.get(i).copied().unwrap_or(0), e));
                }
            }
        }
        match failed {
            None => Ok(()),
            Some((offset, e @ Error::CorruptRecord { .. })) => Err(Error::ImportRefused {
                offset,
                rule: ImportRule::StoredRecordDamaged,
                detail: format!(
                    "{e}: the store's own record of this key is damaged, so it cannot be \
                     told whether it is live (the rest of this frame's batch was written); \
                     run idemstore check, and restore the store from an export into a new \
                     file"
                ),
                imported: summary.imported,
            }),
            Some((_, e)) => Err(e),
        }
    };
    loop {
        let before = reader.offset();
        let Some((at, frame)) = reader.next_frame()? else {
            return Err(corrupt(
                reader.offset(),
                "stream ends before its end frame (truncated export)",
            ));
        };
        match frame {
            Frame::Record(record) => {
                limits
                    .record(&record)
                    .map_err(|e| refused(at, e, &summary))?;
                // Checked above: the token is below the cap.
                token_floor = token_floor.max(record.token.checked_add(1).unwrap_or(MAX_TOKEN));
                clock_floor = clock_floor.max(record.updated_ms.min(limits.latest_ms()));
                batch.push(*record);
                batch_at.push(at);
                batch_bytes = batch_bytes.saturating_add(
                    usize::try_from(reader.offset().saturating_sub(before)).unwrap_or(usize::MAX),
                );
                summary.records += 1;
                // Before the batch is written: a caller that reports how
                // far a failed import read counts the failed batch too.
                progress(Progress {
                    records: summary.records,
                    bytes: reader.offset(),
                    total: None,
                });
                if batch.len() >= IMPORT_BATCH || batch_bytes >= IMPORT_BATCH_BYTES {
                    flush(
                        &mut batch,
                        &mut batch_at,
                        token_floor,
                        clock_floor,
                        &mut summary,
                    )?;
                    batch_bytes = 0;
                }
            }
            Frame::End { records } => {
                if records != summary.records {
                    return Err(corrupt(
                        at,
                        format!(
                            "end frame counts {records} records, the stream holds {}",
                            summary.records
                        ),
                    ));
                }
                if let Some((after, _)) = reader.next_frame()? {
                    return Err(corrupt(after, "data after the end frame"));
                }
                // The last write goes through even with no record left in
                // it, so the floors always land.
                flush(
                    &mut batch,
                    &mut batch_at,
                    token_floor,
                    clock_floor,
                    &mut summary,
                )?;
                return Ok(summary);
            }
            Frame::Meta(_) => return Err(corrupt(at, "a second meta frame")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{Fingerprint, Key};
    use crate::record::State;

    fn sample(id: &str) -> Record {
        Record {
            key: Key::new("acme/t", id).unwrap(),
            state: State::Succeeded,
            token: 7,
            fingerprint: Fingerprint::of(b"p"),
            created_ms: 1,
            updated_ms: 2,
            lease_until_ms: 3,
            expires_ms: 4,
            output: Some(b"ok".to_vec()),
            recovery_point: None,
            business_key: Some("order-1".into()),
            acquisitions: 1,
        }
    }

    fn stream(records: &[Record]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut w = FrameWriter::new(&mut out).unwrap();
        w.meta(&StreamMeta {
            store_id: 9,
            next_token: 10,
            clock_hwm: 11,
        })
        .unwrap();
        for r in records {
            let kb = r.key.to_bytes();
            w.record(&kb, &codec::encode_record(&kb, r)).unwrap();
        }
        w.end(records.len() as u64).unwrap();
        out
    }

    #[test]
    fn frames_round_trip() {
        let recs = [sample("a"), sample("b")];
        let bytes = stream(&recs);
        let mut r = FrameReader::new(bytes.as_slice()).unwrap();
        assert!(
            matches!(r.next_frame().unwrap(), Some((24, Frame::Meta(m))) if m.next_token == 10)
        );
        for want in &recs {
            match r.next_frame().unwrap() {
                Some((_, Frame::Record(got))) => assert_eq!(*got, *want),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            r.next_frame().unwrap(),
            Some((_, Frame::End { records: 2 }))
        ));
        assert!(r.next_frame().unwrap().is_none());
    }

    /// `check_export_start` gives back the whole stream, byte for byte,
    /// having read no further than the meta frame; it refuses what an
    /// import refuses at the start (an empty stream, one cut in its header
    /// or meta frame, another file, a record before the meta frame, a token
    /// counter above the cap), and a stream damaged after its meta frame
    /// passes it (the import stops there).
    #[test]
    fn the_start_of_a_stream_is_checked_and_given_back_whole() {
        let bytes = stream(&[sample("a"), sample("b")]);
        let mut given = Vec::new();
        check_export_start(bytes.as_slice())
            .unwrap()
            .read_to_end(&mut given)
            .unwrap();
        assert_eq!(given, bytes);
        // Read no further than the header and the meta frame (8 + 34).
        let mut rest = &bytes[..];
        let start = check_export_start(&mut rest).unwrap();
        assert_eq!(start.get_ref().0.get_ref().len(), 24 + 8 + 34);
        drop(start);
        assert_eq!(rest.len(), bytes.len() - (24 + 8 + 34));
        let mut record_first = bytes[..24].to_vec();
        record_first.extend_from_slice(&bytes[24 + 42..]);
        let refused: [&[u8]; 5] = [
            &[],
            &bytes[..10],
            &bytes[..24 + 20],
            b"not an idemstore export at all, a text file",
            &record_first,
        ];
        for (i, input) in refused.into_iter().enumerate() {
            let result = check_export_start(input).map(drop);
            assert!(
                matches!(result, Err(Error::CorruptExport { .. })),
                "case {i}: {result:?}"
            );
        }
        let mut late_damage = bytes.clone();
        let last = late_damage.len() - 1;
        late_damage[last] ^= 0x04;
        assert!(check_export_start(late_damage.as_slice()).is_ok());
        // A token counter above the cap, refused as an import refuses it.
        let mut over = Vec::new();
        let mut w = FrameWriter::new(&mut over).unwrap();
        w.meta(&StreamMeta {
            store_id: 9,
            next_token: MAX_TOKEN + 1,
            clock_hwm: 11,
        })
        .unwrap();
        w.end(0).unwrap();
        let result = check_export_start(over.as_slice()).map(drop);
        assert!(
            matches!(
                result,
                Err(Error::ImportRefused {
                    rule: ImportRule::TokenCap,
                    imported: 0,
                    ..
                })
            ),
            "{result:?}"
        );
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let bytes = stream(&[sample("a")]);
        for i in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[i] ^= 0x04;
            let result = FrameReader::new(damaged.as_slice()).and_then(|mut r| {
                while r.next_frame()?.is_some() {}
                Ok(())
            });
            assert!(
                matches!(result, Err(Error::CorruptExport { .. })),
                "byte {i}: {result:?}"
            );
        }
    }

    #[test]
    fn a_huge_length_is_refused_before_allocating() {
        let mut bytes = stream(&[]);
        let at = 24usize;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut r = FrameReader::new(bytes.as_slice()).unwrap();
        match r.next_frame() {
            Err(Error::CorruptExport { offset, detail }) => {
                assert_eq!(offset, 24);
                assert!(detail.contains("out of range"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }
}
