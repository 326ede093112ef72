//! TLS for the PostgreSQL engine: `sslmode` and `sslrootcert` from the
//! connection string, honoured as libpq does, with a pure-Rust connector
//! (rustls with the `ring` provider).
//!
//! | `sslmode` | what the engine does |
//! |---|---|
//! | `disable` | plain TCP |
//! | `prefer` (default) | TLS when the server offers it, else plain; the certificate is not checked |
//! | `require` | TLS or no connection; the certificate is not checked |
//! | `verify-ca` | TLS; the certificate chain must lead to a trusted root |
//! | `verify-full` | as `verify-ca`, and the certificate must name the host |
//!
//! The trusted roots are the PEM file named by `sslrootcert`, or, without
//! one, the Mozilla roots (`webpki-roots`), as managed PostgreSQL services
//! use public certificates. `tokio-postgres` itself knows only `disable`,
//! `prefer` and `require`, so the two options are taken out of the
//! connection string here (in either form; in a key=value string a value
//! may be quoted, as libpq allows).

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres::config::SslMode as PgSslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

/// The `sslmode` of a connection string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if offered, unchecked.
    Prefer,
    /// TLS, unchecked.
    Require,
    /// TLS, chain checked.
    VerifyCa,
    /// TLS, chain and host name checked.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            // The value is not shown: a misplaced quote can make it hold
            // what follows, a password included.
            _ => {
                return Err(Error::invalid(
                    "url",
                    "sslmode is none of disable, allow, prefer, require, verify-ca or verify-full",
                ));
            }
        })
    }
}

/// A connection string with `sslmode` and `sslrootcert` taken out.
#[derive(Debug)]
pub(crate) struct Parsed {
    /// The rest of the connection string, for `tokio-postgres`.
    pub rest: String,
    /// The `sslmode` (default `prefer`).
    pub mode: SslMode,
    /// The `sslrootcert` file, if given.
    pub root_cert: Option<String>,
}

/// Decodes `%XX` escapes of a URL query value.
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes.get(i), bytes.get(i + 1), bytes.get(i + 2)) {
            (Some(b'%'), Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let v = hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0);
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 3;
            }
            (Some(&b), _, _) => {
                out.push(b);
                i += 1;
            }
            (None, _, _) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Takes `sslmode` and `sslrootcert` out of a `postgresql://` URL or a
/// `key=value` connection string.
pub(crate) fn parse(url: &str) -> Result<Parsed> {
    let mut mode = None;
    let mut root_cert = None;
    let mut take = |key: &str, value: String| -> Result<bool> {
        match key {
            "sslmode" => {
                mode = Some(SslMode::parse(&value)?);
                Ok(true)
            }
            "sslrootcert" => {
                root_cert = Some(value);
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&') {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(k, percent_decode(v))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
            None => url.to_string(),
        }
    } else {
        // The parameters this crate reads are cut out of the string as
        // written; the others are left to tokio-postgres as they are
        // (quoted values, escapes and spaces around `=` included).
        let mut kept = Vec::new();
        for param in key_value_params(url)? {
            if !take(param.key, param.value)? {
                kept.push(url.get(param.span).unwrap_or_default());
            }
        }
        kept.join(" ")
    };
    Ok(Parsed {
        rest,
        mode: mode.unwrap_or(SslMode::Prefer),
        root_cert,
    })
}

/// One `keyword = value` of a key=value connection string.
struct Param<'a> {
    /// The keyword.
    key: &'a str,
    /// The value, unquoted and unescaped.
    value: String,
    /// Where the parameter stands in the string, keyword to value's end.
    span: std::ops::Range<usize>,
}

/// The parameters of a key=value connection string, read as libpq (and
/// tokio-postgres) read it: `keyword = value` separated by whitespace,
/// spaces allowed around `=`, a value in single quotes may hold spaces,
/// and a backslash takes the next character as it is, quoted or not.
///
/// # Errors
/// [`Error::InvalidArgument`] for a word without `=`, a missing value or
/// an unterminated quote, named by its byte offset: the message holds no
/// part of the string (a malformed one may hold a password anywhere).
fn key_value_params(s: &str) -> Result<Vec<Param<'_>>> {
    let refuse = |reason: String| Error::invalid("url", reason);
    let mut out = Vec::new();
    let mut it = s.char_indices().peekable();
    let skip_ws = |it: &mut std::iter::Peekable<std::str::CharIndices<'_>>| {
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
    };
    loop {
        skip_ws(&mut it);
        let Some(&(start, _)) = it.peek() else { break };
        let mut key_end = start;
        while let Some((i, c)) = it.next_if(|(_, c)| !c.is_whitespace() && *c != '=') {
            key_end = i + c.len_utf8();
        }
        let key = s.get(start..key_end).unwrap_or_default();
        if key.is_empty() {
            return Err(refuse(format!(
                "the key=value connection string has '=' where a keyword belongs (byte {start})"
            )));
        }
        skip_ws(&mut it);
        if it.next_if(|(_, c)| *c == '=').is_none() {
            return Err(refuse(format!(
                "the word at byte {start} of the connection string is not keyword=value \
                 (a URL starts postgresql:// or postgres://, in lower case)"
            )));
        }
        skip_ws(&mut it);
        let mut value = String::new();
        let mut end = s.len();
        let quoted = it.next_if(|(_, c)| *c == '\'').is_some();
        let mut closed = !quoted;
        let mut any = false;
        while let Some(&(i, c)) = it.peek() {
            if quoted && c == '\'' {
                it.next();
                end = i + 1;
                closed = true;
                break;
            }
            if !quoted && c.is_whitespace() {
                end = i;
                break;
            }
            it.next();
            any = true;
            if c == '\\' {
                if let Some((_, next)) = it.next() {
                    value.push(next);
                }
            } else {
                value.push(c);
            }
        }
        if !closed {
            return Err(refuse(format!(
                "the value of the keyword at byte {start} of the connection string has no \
                 closing quote"
            )));
        }
        if !quoted && !any {
            return Err(refuse(format!(
                "the keyword at byte {start} of the connection string has no value"
            )));
        }
        out.push(Param {
            key,
            value,
            span: start..end,
        });
    }
    Ok(out)
}

/// The `tokio-postgres` mode for `mode` (the checks are the connector's).
pub(crate) fn pg_mode(mode: SslMode) -> PgSslMode {
    match mode {
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => PgSslMode::Require,
    }
}

/// The connector for `parsed`, `None` for `disable`.
pub(crate) fn connector(parsed: &Parsed) -> Result<Option<MakeRustlsConnect>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid("url", format!("TLS: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match parsed.mode {
        SslMode::Disable => return Ok(None),
        SslMode::Prefer | SslMode::Require => Arc::new(Unchecked(Arc::clone(&provider))),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let mut roots = RootCertStore::empty();
            match &parsed.root_cert {
                Some(path) => {
                    let certs = CertificateDer::pem_file_iter(path)
                        .map_err(|e| Error::invalid("url", format!("sslrootcert {path}: {e}")))?;
                    for cert in certs {
                        let cert = cert.map_err(|e| {
                            Error::invalid("url", format!("sslrootcert {path}: {e}"))
                        })?;
                        roots.add(cert).map_err(|e| {
                            Error::invalid("url", format!("sslrootcert {path}: {e}"))
                        })?;
                    }
                }
                None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            }
            let full = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| Error::invalid("url", format!("TLS roots: {e}")))?;
            if parsed.mode == SslMode::VerifyFull {
                full
            } else {
                Arc::new(AnyName(full))
            }
        }
    };
    let config = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Some(MakeRustlsConnect::new(config)))
}

/// `prefer` and `require`: the handshake's signatures are checked, the
/// certificate is not (libpq's behaviour without a root certificate).
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain is checked, the host name is not.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_options_are_taken_out_of_both_forms() {
        let p = parse(
            "postgresql://u@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .unwrap();
        assert_eq!(p.rest, "postgresql://u@h:5/db?application_name=x");
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert.as_deref(), Some("/tmp/ca.pem"));
        let p = parse("host=h sslmode=require user=u").unwrap();
        assert_eq!(p.rest, "host=h user=u");
        assert_eq!(p.mode, SslMode::Require);
        let p = parse("postgresql://u@h/db").unwrap();
        assert_eq!(p.mode, SslMode::Prefer);
        assert!(parse("postgresql://h/db?sslmode=sometimes").is_err());
    }

    #[test]
    fn key_value_strings_are_read_as_libpq_reads_them() {
        // A quoted value keeps its spaces, and is passed on as written.
        let p = parse("host=h user=u password='a  b' dbname=d").unwrap();
        assert_eq!(p.rest, "host=h user=u password='a  b' dbname=d");
        assert_eq!(p.mode, SslMode::Prefer);
        // Spaces around '=' and a quoted mode.
        let p = parse("host = h  sslmode = disable user=u").unwrap();
        assert_eq!(
            (p.rest.as_str(), p.mode),
            ("host = h user=u", SslMode::Disable)
        );
        let p = parse("host=h sslmode='verify-full' sslrootcert='/tmp/my ca.pem'").unwrap();
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert.as_deref(), Some("/tmp/my ca.pem"));
        assert_eq!(p.rest, "host=h");
        // What a quoted value holds is not a parameter.
        let p = parse("host=h password='x sslmode=verify-full' sslmode=require").unwrap();
        assert_eq!(p.mode, SslMode::Require);
        assert_eq!(p.rest, "host=h password='x sslmode=verify-full'");
        // Escapes, quoted and not.
        let p = parse(r"host=h password=a\ b application_name='it\'s'").unwrap();
        assert_eq!(p.rest, r"host=h password=a\ b application_name='it\'s'");
        let params = key_value_params(r"password=a\ b name='it\'s' empty=''").unwrap();
        let values: Vec<&str> = params.iter().map(|p| p.value.as_str()).collect();
        assert_eq!(values, ["a b", "it's", ""]);
        // Malformed strings are refused without echoing a value.
        for bad in [
            "host=h password='secret",
            "host=h password",
            "host=h password=",
            "=secret host=h",
            "host=h password=correct secret",
            "Postgres://u:secret@h/db",
            "jdbc:postgresql://u:secret@h/db",
            "secret@h/db='x",
            "host=h sslmode='require password=secret'",
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(!err.contains("secret"), "{err}");
            assert!(
                matches!(parse(bad), Err(Error::InvalidArgument { .. })),
                "{bad}"
            );
        }
        // tokio-postgres reads what is passed on the same way.
        let p = parse("host=h user=u password='a  b' sslmode=disable").unwrap();
        let config: tokio_postgres::Config = p.rest.parse().unwrap();
        assert_eq!(config.get_password(), Some(&b"a  b"[..]));
    }
}
