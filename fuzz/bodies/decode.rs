//! Fuzz body `decode`: arbitrary bytes into the record codec. Input:
//! `[mode][key length][key bytes][envelope or body]`. Mode bit 0 set: the
//! rest is a body that gets a valid envelope (version and checksum), so the
//! fuzzer reaches the bincode decoder and the field checks; clear: the rest
//! is the whole envelope. Decoding must never panic, must answer
//! `CorruptRecord` or a record, and a record must survive an encode/decode
//! round trip under the same key.
//!
//! Included by `fuzz/fuzz_targets/decode.rs` and `tests/fuzz_corpus.rs`.

use idemstore::Error;
use idemstore::fuzzing;

pub fn decode(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((&key_len, rest)) = rest.split_first() else {
        return;
    };
    let (key, rest) = rest.split_at(usize::from(key_len).min(rest.len()));
    let bytes = if mode & 1 == 1 {
        fuzzing::seal(key, rest)
    } else {
        rest.to_vec()
    };
    match fuzzing::decode_record(key, &bytes) {
        Ok(record) => {
            assert_eq!(
                fuzzing::key_bytes(record.key()),
                key,
                "a record decoded under other key bytes"
            );
            let again = fuzzing::decode_record(key, &fuzzing::encode_record(&record))
                .expect("a decoded record encodes to a valid envelope");
            assert_eq!(again, record, "round trip changed the record");
        }
        Err(Error::CorruptRecord { .. }) => {}
        Err(other) => panic!("decode answered {other:?}, not CorruptRecord"),
    }
}
