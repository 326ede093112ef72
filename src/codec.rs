//! The record envelope: the only place where bytes become records and back.
//!
//! ```text
//! [format version: u8 = 1][crc32 (IEEE), little-endian u32, over key bytes ‖ body][body]
//! ```
//!
//! The body is encoded with bincode 2 (standard configuration: variable-length
//! integers, little-endian) and decoded with a size limit, so hostile bytes
//! cannot make the decoder allocate more than [`DECODE_LIMIT`] bytes. The
//! checksum covers the key as well as the body, so a record moved under
//! another key is detected. Every use of bincode in the crate is in this file
//! (it is unmaintained upstream, RUSTSEC-2025-0141; README says why it is
//! accepted), so the format can change in one place.

use bincode::{Decode, Encode};

use crate::error::{Error, Result};
use crate::key::{Fingerprint, Key, MAX_FINGERPRINT_LEN};
use crate::record::{Record, State};

/// The envelope version this build writes and reads.
pub(crate) const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 5;
/// The most a record body may make the decoder allocate (in bytes): three
/// values at their largest configurable size, plus the fixed fields.
pub(crate) const DECODE_LIMIT: usize = 3 * crate::config::MAX_VALUE_LIMIT + 4096;

#[derive(Encode, Decode)]
struct Body {
    state: u8,
    token: u64,
    fingerprint: Vec<u8>,
    created_ms: u64,
    updated_ms: u64,
    lease_until_ms: u64,
    expires_ms: u64,
    output: Option<Vec<u8>>,
    recovery_point: Option<Vec<u8>>,
    business_key: Option<String>,
    acquisitions: u32,
}

/// One stored record as an engine hands it over: its key bytes
/// ([`Key::to_bytes`](crate::Key)) and its envelope.
pub(crate) type Entry = (Vec<u8>, Vec<u8>);

/// The stored records of one snapshot, in key order, as an engine reads
/// them; an `Err` is a storage failure, after which the iterator ends.
pub(crate) type Entries = Box<dyn Iterator<Item = Result<Entry>> + Send + Sync>;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_LIMIT>()
}

fn state_code(state: State) -> u8 {
    match state {
        State::Processing => 0,
        State::Succeeded => 1,
        State::Failed { retryable: false } => 2,
        State::Failed { retryable: true } => 3,
    }
}

fn state_from_code(code: u8) -> Option<State> {
    Some(match code {
        0 => State::Processing,
        1 => State::Succeeded,
        2 => State::Failed { retryable: false },
        3 => State::Failed { retryable: true },
        _ => return None,
    })
}

fn checksum(key: &[u8], body: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(key);
    hasher.update(body);
    hasher.finalize()
}

/// Encodes a record into its envelope. `key_bytes` is the stored key.
pub(crate) fn encode_record(key_bytes: &[u8], record: &Record) -> Vec<u8> {
    let body = Body {
        state: state_code(record.state),
        token: record.token,
        fingerprint: record.fingerprint.as_bytes().to_vec(),
        created_ms: record.created_ms,
        updated_ms: record.updated_ms,
        lease_until_ms: record.lease_until_ms,
        expires_ms: record.expires_ms,
        output: record.output.clone(),
        recovery_point: record.recovery_point.clone(),
        business_key: record.business_key.clone(),
        acquisitions: record.acquisitions,
    };
    // Encoding into a Vec cannot fail for this plain struct; the limit only
    // applies when decoding, and every value was checked against a limit
    // below DECODE_LIMIT before it reached a record.
    let encoded = bincode::encode_to_vec(&body, bincode::config::standard()).unwrap_or_default();
    seal(key_bytes, &encoded)
}

/// Wraps an encoded body stored under `key_bytes` in the envelope: version
/// and checksum.
pub(crate) fn seal(key_bytes: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.push(RECORD_VERSION);
    out.extend_from_slice(&checksum(key_bytes, body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// The state an envelope names, read from its first body byte without
/// decoding or checking it (`None` for an unknown version or state code);
/// for counts only, never for a decision. bincode writes a `u8` as one
/// byte, and `state` is the body's first field.
pub(crate) fn peek_state(bytes: &[u8]) -> Option<State> {
    match bytes {
        [RECORD_VERSION, _, _, _, _, code, ..] => state_from_code(*code),
        _ => None,
    }
}

/// Decodes an envelope stored under `key_bytes`.
///
/// # Errors
/// [`Error::CorruptRecord`] naming the key when the version is unknown, the
/// checksum does not match, the body does not decode within the limit, bytes
/// are left over, or a field is out of range.
pub(crate) fn decode_record(key_bytes: &[u8], bytes: &[u8]) -> Result<Record> {
    let corrupt = |detail: String| Error::CorruptRecord {
        key: Key::describe_bytes(key_bytes),
        detail,
    };
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(format!("envelope is {} bytes", bytes.len())));
    }
    if bytes[0] != RECORD_VERSION {
        return Err(corrupt(format!("unknown record version {}", bytes[0])));
    }
    let stored = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    let body = &bytes[HEADER_LEN..];
    if checksum(key_bytes, body) != stored {
        return Err(corrupt("checksum mismatch".into()));
    }
    let key = Key::from_bytes(key_bytes).map_err(|e| corrupt(e.to_string()))?;
    let (b, used): (Body, usize) =
        bincode::decode_from_slice(body, config()).map_err(|e| corrupt(e.to_string()))?;
    if used != body.len() {
        return Err(corrupt(format!("{} trailing bytes", body.len() - used)));
    }
    let state = state_from_code(b.state).ok_or_else(|| corrupt(format!("state {}", b.state)))?;
    if b.fingerprint.is_empty() || b.fingerprint.len() > MAX_FINGERPRINT_LEN {
        return Err(corrupt("fingerprint length out of range".into()));
    }
    let fingerprint = Fingerprint::from_bytes(b.fingerprint).map_err(|e| corrupt(e.to_string()))?;
    Ok(Record {
        key,
        state,
        token: b.token,
        fingerprint,
        created_ms: b.created_ms,
        updated_ms: b.updated_ms,
        lease_until_ms: b.lease_until_ms,
        expires_ms: b.expires_ms,
        output: b.output,
        recovery_point: b.recovery_point,
        business_key: b.business_key,
        acquisitions: b.acquisitions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `peek_state` reads what `decode_record` decodes, for every state,
    /// and nothing from an envelope of another version or a short one.
    #[test]
    fn peek_state_names_the_state_the_envelope_decodes_to() {
        for state in [
            State::Processing,
            State::Succeeded,
            State::Failed { retryable: false },
            State::Failed { retryable: true },
        ] {
            let mut rec = sample();
            rec.state = state;
            let kb = rec.key.to_bytes();
            let env = encode_record(&kb, &rec);
            assert_eq!(peek_state(&env), Some(state));
            assert_eq!(decode_record(&kb, &env).unwrap().state, state);
            let mut other = env.clone();
            other[0] = RECORD_VERSION + 1;
            assert_eq!(peek_state(&other), None);
            assert_eq!(peek_state(&env[..HEADER_LEN]), None);
        }
        let mut env = encode_record(&sample().key.to_bytes(), &sample());
        env[HEADER_LEN] = 9;
        assert_eq!(peek_state(&env), None);
    }

    fn sample() -> Record {
        Record {
            key: Key::new("acme/tickets.create", "task-1:call-1").unwrap(),
            state: State::Failed { retryable: true },
            token: 42,
            fingerprint: Fingerprint::of(b"payload"),
            created_ms: 1,
            updated_ms: 2,
            lease_until_ms: 3,
            expires_ms: 4,
            output: Some(b"boom".to_vec()),
            recovery_point: Some(b"step-2".to_vec()),
            business_key: Some("order-9".into()),
            acquisitions: 3,
        }
    }

    #[test]
    fn round_trip() {
        let rec = sample();
        let kb = rec.key.to_bytes();
        let bytes = encode_record(&kb, &rec);
        assert_eq!(decode_record(&kb, &bytes).unwrap(), rec);
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let rec = sample();
        let kb = rec.key.to_bytes();
        let bytes = encode_record(&kb, &rec);
        for i in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[i] ^= 0x20;
            let err = decode_record(&kb, &damaged).unwrap_err();
            assert!(
                matches!(err, Error::CorruptRecord { .. }),
                "byte {i}: {err}"
            );
        }
        let mut other_key = kb.clone();
        other_key[3] ^= 1;
        assert!(decode_record(&other_key, &bytes).is_err());
    }
}
