//! The stored form of an HTTP response, and the request fingerprint.
//!
//! A response is stored as a small length-prefixed blob (all integers
//! big-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 1 | format version, `1` |
//! | 2 | status code |
//! | 2 | header count *n* |
//! | *n* × (2 + len + 4 + len) | header name length, name (lowercase), value length, value |
//! | 4 | body length |
//! | len | body |
//!
//! A response that could not be kept (over `max_response_bytes` or the
//! store's limit) is stored as a marker instead:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | format version, `2` |
//! | 2 | status code of the response the first client got |
//! | 4 | length of its `location` header (0: none) |
//! | len | the `location` value |
//!
//! Decoding checks every length and that nothing follows the body, so a
//! damaged blob is reported, never replayed as a wrong response.

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};

use crate::key::Fingerprint;

use super::layer::ReplayHeaders;

const VERSION: u8 = 1;
const NOT_KEPT_VERSION: u8 = 2;
/// Bytes of the stored form besides the header names, values and the
/// body: version, status, header count, body length.
const FIXED_BYTES: usize = 1 + 2 + 2 + 4;
/// Bytes of each stored header besides its name and value.
const PER_HEADER_BYTES: usize = 2 + 4;

/// What the store holds for one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    /// The response, to replay as it was.
    Kept(StoredResponse),
    /// The response was delivered but too large to keep: its status and
    /// `location`, for the answer to a retry.
    NotKept {
        status: StatusCode,
        location: Option<HeaderValue>,
    },
}

impl Stored {
    /// Parses either stored form.
    ///
    /// # Errors
    /// A description of what is wrong (see [`StoredResponse::decode`]).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Stored, String> {
        if bytes.first() != Some(&NOT_KEPT_VERSION) {
            return StoredResponse::decode(bytes).map(Stored::Kept);
        }
        let mut r = Reader(&bytes[1..]);
        let status = StatusCode::from_u16(r.u16()?).map_err(|e| e.to_string())?;
        let len = r.u32_len()?;
        let location = if len == 0 {
            None
        } else {
            Some(HeaderValue::from_bytes(r.take(len)?).map_err(|e| e.to_string())?)
        };
        if !r.0.is_empty() {
            return Err(format!("{} bytes after the marker", r.0.len()));
        }
        Ok(Stored::NotKept { status, location })
    }

    /// The marker's stored form; the location is left out when it would
    /// make the marker longer than `limit` bytes (or 4 GiB).
    pub(crate) fn not_kept(
        status: StatusCode,
        location: Option<&HeaderValue>,
        limit: usize,
    ) -> Vec<u8> {
        let location = location
            .filter(|l| l.len().saturating_add(7) <= limit)
            .and_then(|l| Some((u32::try_from(l.len()).ok()?, l.as_bytes())));
        let mut out = vec![NOT_KEPT_VERSION];
        out.extend_from_slice(&status.as_u16().to_be_bytes());
        match location {
            Some((len, bytes)) => {
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(bytes);
            }
            None => out.extend_from_slice(&0u32.to_be_bytes()),
        }
        out
    }
}

/// A response as the layer stores and replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// The headers of `headers` that `choice` keeps (every value of each),
    /// with an empty body to be filled in.
    pub(crate) fn new(
        status: StatusCode,
        headers: &HeaderMap,
        choice: &ReplayHeaders,
    ) -> StoredResponse {
        // The fields `connection` names are per-connection (RFC 9110
        // §7.6.1: removed before a message is forwarded): never stored,
        // whatever `choice` says.
        let per_connection: Vec<String> = headers
            .get_all(http::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|option| option.trim().to_ascii_lowercase())
            .filter(|option| !option.is_empty())
            .collect();
        let kept = |name: &HeaderName| {
            choice.keeps(name) && !per_connection.iter().any(|o| o == name.as_str())
        };
        let headers = match choice {
            ReplayHeaders::Only(names) => names
                .iter()
                .filter(|name| kept(name))
                .flat_map(|name| {
                    headers
                        .get_all(name)
                        .iter()
                        .map(move |v| (name.clone(), v.clone()))
                })
                .collect(),
            ReplayHeaders::AllExcept(_) => headers
                .iter()
                .filter(|(name, _)| kept(name))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
        };
        StoredResponse {
            status,
            headers,
            body: Bytes::new(),
        }
    }

    /// Bytes of the stored form without the body (saturating).
    pub(crate) fn len_without_body(&self) -> usize {
        self.headers.iter().fold(FIXED_BYTES, |n, (name, value)| {
            n.saturating_add(PER_HEADER_BYTES)
                .saturating_add(name.as_str().len())
                .saturating_add(value.len())
        })
    }

    /// The stored form. `None` when a length does not fit its field (a
    /// header over 4 GiB, more than 65 535 headers): such a response cannot
    /// be stored.
    pub(crate) fn encode(&self) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(self.len_without_body().saturating_add(self.body.len()));
        out.push(VERSION);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.extend_from_slice(&u16::try_from(self.headers.len()).ok()?.to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&u16::try_from(name.as_str().len()).ok()?.to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&u32::try_from(value.len()).ok()?.to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&u32::try_from(self.body.len()).ok()?.to_be_bytes());
        out.extend_from_slice(&self.body);
        Some(out)
    }

    /// Parses the stored form.
    ///
    /// # Errors
    /// A description of what is wrong: an unknown version, a length past
    /// the end, an invalid status, header name or value, trailing bytes.
    pub(crate) fn decode(bytes: &[u8]) -> Result<StoredResponse, String> {
        let mut r = Reader(bytes);
        let version = r.take(1)?[0];
        if version != VERSION {
            return Err(format!("unknown stored response version {version}"));
        }
        let status = StatusCode::from_u16(r.u16()?).map_err(|e| e.to_string())?;
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = usize::from(r.u16()?);
            let name = HeaderName::from_bytes(r.take(len)?).map_err(|e| e.to_string())?;
            let len = r.u32_len()?;
            let value = HeaderValue::from_bytes(r.take(len)?).map_err(|e| e.to_string())?;
            headers.push((name, value));
        }
        let len = r.u32_len()?;
        let body = Bytes::copy_from_slice(r.take(len)?);
        if !r.0.is_empty() {
            return Err(format!("{} bytes after the body", r.0.len()));
        }
        Ok(StoredResponse {
            status,
            headers,
            body,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "stored response ends early: {n} bytes wanted, {} left",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32_len(&mut self) -> Result<usize, String> {
        let b = self.take(4)?;
        usize::try_from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])).map_err(|e| e.to_string())
    }
}

/// The fingerprint of a request: SHA-256 over a length-prefixed encoding of
/// the method, the path and query, each chosen header (name, number of
/// values, each value, in the order the names were chosen) and the body. The
/// encoding is unambiguous, so two different requests never share an input.
pub(crate) fn fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    names: &[HeaderName],
    body: &[u8],
) -> Fingerprint {
    fn field(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    }
    let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let mut enc = Vec::with_capacity(64 + path_and_query.len() + body.len());
    field(&mut enc, b"idemstore-http-fingerprint-v1");
    field(&mut enc, method.as_str().as_bytes());
    field(&mut enc, path_and_query.as_bytes());
    for name in names {
        field(&mut enc, name.as_str().as_bytes());
        let values: Vec<&HeaderValue> = headers.get_all(name).iter().collect();
        enc.extend_from_slice(&(values.len() as u64).to_be_bytes());
        for v in values {
            if name == header::CONTENT_TYPE {
                field(&mut enc, &media_type(v));
            } else {
                field(&mut enc, v.as_bytes());
            }
        }
    }
    field(&mut enc, body);
    Fingerprint::of(&enc)
}

/// A `content-type` value in one spelling per media type (RFC 9110
/// §8.3.1): type, subtype and parameter names lowercased (and `charset`'s
/// value, which `mime` lowercases), no spaces outside a quoted value, a
/// value quoted only when it is not a token, and no `charset` on a JSON
/// type, where it has no effect (RFC 8259 §11; `application/json` and any
/// `+json` type, RFC 6839). The common spelling is unchanged
/// (`application/json` stays `application/json`). A value that does not
/// parse as a media type is kept as its bytes.
fn media_type(value: &HeaderValue) -> Cow<'_, [u8]> {
    let Some(parsed) = value
        .to_str()
        .ok()
        .and_then(|text| text.parse::<mime::Mime>().ok())
    else {
        return Cow::Borrowed(value.as_bytes());
    };
    let json = parsed.subtype() == mime::JSON || parsed.suffix() == Some(mime::JSON);
    let mut out = parsed.essence_str().to_owned();
    for (name, param) in parsed.params() {
        if json && name == mime::CHARSET {
            continue;
        }
        out.push(';');
        out.push_str(name.as_str());
        out.push('=');
        // `mime` gives a quoted value unquoted: quote it again unless it
        // is a token, so that `a="x;y=z"` and `a=x;y=z` stay apart.
        let value = param.as_str();
        if !value.is_empty() && value.bytes().all(is_tchar) {
            out.push_str(value);
        } else {
            out.push('"');
            for c in value.chars() {
                if matches!(c, '"' | '\\') {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        }
    }
    Cow::Owned(out.into_bytes())
}

/// A token character (RFC 9110 §5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_type_is_compared_as_a_media_type() {
        let spelled = |v: &'static str| media_type(&HeaderValue::from_static(v)).into_owned();
        let json = b"application/json".to_vec();
        for same in [
            "application/json",
            "APPLICATION/Json",
            "application/json; charset=utf-8",
            "application/json;charset=UTF-8",
        ] {
            assert_eq!(spelled(same), json, "{same}");
        }
        assert_eq!(
            spelled("application/problem+json; charset=utf-8"),
            b"application/problem+json"
        );
        assert_eq!(
            spelled("Text/Plain; Charset=UTF-8"),
            b"text/plain;charset=utf-8"
        );
        assert_ne!(spelled("text/plain; charset=latin1"), spelled("text/plain"));
        assert_ne!(spelled("application/xml"), json);
        // A quoted value is not confused with two parameters.
        assert_ne!(
            spelled(r#"multipart/mixed; boundary="a;b=c""#),
            spelled("multipart/mixed; boundary=a; b=c")
        );
        assert_eq!(
            spelled(r#"multipart/mixed; boundary="a;b=c""#),
            br#"multipart/mixed;boundary="a;b=c""#
        );
        // Not a media type: its bytes, as before.
        assert_eq!(spelled("not a type"), b"not a type");
    }

    fn sample() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    http::header::LOCATION,
                    HeaderValue::from_static("/tickets/7"),
                ),
            ],
            body: Bytes::from_static(br#"{"id":7}"#),
        }
    }

    #[test]
    fn round_trips() {
        let r = sample();
        assert_eq!(StoredResponse::decode(&r.encode().unwrap()).unwrap(), r);
    }

    #[test]
    fn the_length_without_body_is_the_encoded_length_of_an_empty_body() {
        let mut r = sample();
        let with_body = r.encode().unwrap().len();
        let body = r.body.len();
        r.body = Bytes::new();
        assert_eq!(r.len_without_body(), r.encode().unwrap().len());
        assert_eq!(r.len_without_body() + body, with_body);
    }

    #[test]
    fn headers_are_chosen_by_allow_list_or_deny_list() {
        let mut h = HeaderMap::new();
        h.insert("etag", HeaderValue::from_static("\"v1\""));
        h.insert("set-cookie", HeaderValue::from_static("s=1"));
        h.append("link", HeaderValue::from_static("</a>"));
        h.append("link", HeaderValue::from_static("</b>"));
        let deny = ReplayHeaders::AllExcept(crate::http::REPLAY_DENY_LIST.to_vec());
        let names: Vec<String> = StoredResponse::new(StatusCode::OK, &h, &deny)
            .headers
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        assert_eq!(names, ["etag", "link", "link"]);
        let only = ReplayHeaders::Only(vec![HeaderName::from_static("set-cookie")]);
        let kept = StoredResponse::new(StatusCode::OK, &h, &only).headers;
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].0, "set-cookie");
    }

    #[test]
    fn the_not_kept_marker_round_trips_and_refuses_damage() {
        let loc = HeaderValue::from_static("/tickets/9");
        let enc = Stored::not_kept(StatusCode::CREATED, Some(&loc), 1024);
        assert_eq!(
            Stored::decode(&enc).unwrap(),
            Stored::NotKept {
                status: StatusCode::CREATED,
                location: Some(loc.clone())
            }
        );
        for n in 1..enc.len() {
            assert!(Stored::decode(&enc[..n]).is_err(), "prefix {n}");
        }
        let mut longer = enc.clone();
        longer.push(0);
        assert!(Stored::decode(&longer).is_err());
        // A location that does not fit the limit is left out.
        let small = Stored::not_kept(StatusCode::CREATED, Some(&loc), 8);
        assert_eq!(
            Stored::decode(&small).unwrap(),
            Stored::NotKept {
                status: StatusCode::CREATED,
                location: None
            }
        );
        assert_eq!(
            Stored::decode(&sample().encode().unwrap()).unwrap(),
            Stored::Kept(sample())
        );
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let enc = sample().encode().unwrap();
        for n in 0..enc.len() {
            assert!(StoredResponse::decode(&enc[..n]).is_err(), "prefix {n}");
        }
        let mut longer = enc.clone();
        longer.push(0);
        assert!(StoredResponse::decode(&longer).is_err());
        let mut other_version = enc;
        other_version[0] = 3;
        assert!(StoredResponse::decode(&other_version).is_err());
    }

    #[test]
    fn fingerprint_covers_each_part() {
        let uri: Uri = "/tickets?x=1".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-a", HeaderValue::from_static("1"));
        let names = [HeaderName::from_static("x-a")];
        let base = fingerprint(&Method::POST, &uri, &headers, &names, b"body");
        assert_eq!(
            base,
            fingerprint(&Method::POST, &uri, &headers, &names, b"body")
        );
        assert_ne!(
            base,
            fingerprint(&Method::PATCH, &uri, &headers, &names, b"body")
        );
        let other: Uri = "/tickets?x=2".parse().unwrap();
        assert_ne!(
            base,
            fingerprint(&Method::POST, &other, &headers, &names, b"body")
        );
        let mut h2 = headers.clone();
        h2.insert("x-a", HeaderValue::from_static("2"));
        assert_ne!(base, fingerprint(&Method::POST, &uri, &h2, &names, b"body"));
        assert_ne!(
            base,
            fingerprint(&Method::POST, &uri, &headers, &names, b"bodz")
        );
        // A header that is not chosen does not count.
        h2.insert("x-b", HeaderValue::from_static("3"));
        h2.insert("x-a", HeaderValue::from_static("1"));
        assert_eq!(base, fingerprint(&Method::POST, &uri, &h2, &names, b"body"));
    }
}
