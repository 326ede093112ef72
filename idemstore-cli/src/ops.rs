//! Operator subcommands on a store: `stats`, `get`, `list`, `sweep`,
//! `resolve`, `check`, `export`, `import`, and `migrate` (PostgreSQL only).
//!
//! A store is a file or, given a `postgresql://` or `postgres://` URL (and
//! `--schema`, default `idemstore`), a PostgreSQL store. A command opens a
//! file itself, so it needs the file to itself: redb locks the file while a
//! `Store` holds it. When a service holds it, the error says so and points
//! to `Store::stats()`, which a service exposes for live numbers. A
//! PostgreSQL store is shared: a command works beside the running
//! replicas. Messages name a PostgreSQL store as
//! `postgresql://host:port/db?schema=name`, never with its credentials. Output is a human-readable table by default and JSON with
//! `--json`; progress bars go to stderr, only when it is a terminal.

pub mod check;
pub mod compact;
pub mod export;
pub mod get;
pub mod import;
pub mod list;
pub mod migrate;
pub mod resolve;
pub mod stats;
pub mod sweep;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemstore::{Config, Error, Key, Record, State, Store};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use crate::error::CliError;

/// The store every operator subcommand works on: a store file, or a
/// PostgreSQL store named by a connection URL and a schema.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArg {
    /// The store: a file (a redb file written by idemstore), or a
    /// PostgreSQL connection URL (`postgresql://…` or `postgres://…`) or
    /// key=value connection string (`host=… dbname=… user=…`, when no file
    /// of that name exists). A password is never printed.
    #[arg(value_name = "STORE")]
    pub store: PathBuf,
    /// The PostgreSQL schema that holds the store [default: idemstore, or
    /// the URL's `schema=NAME` parameter, as messages name a store]. For a
    /// PostgreSQL store only.
    #[arg(long, value_name = "NAME")]
    pub schema: Option<String>,
}

/// Where a store lives, as the command line named it.
#[derive(Debug, Clone)]
pub enum Target {
    /// A store file.
    File(PathBuf),
    /// A PostgreSQL store.
    Postgres {
        /// The connection URL as given (may hold a password: never print it).
        url: String,
        /// The schema.
        schema: String,
        /// The store's name for messages, without credentials:
        /// `postgresql://host:port/db?schema=name`.
        name: String,
    },
}

/// The URL prefixes that name a PostgreSQL store.
const URL_PREFIXES: [&str; 2] = ["postgresql://", "postgres://"];

/// The schema a PostgreSQL store lives in when `--schema` is not given.
pub const DEFAULT_SCHEMA: &str = "idemstore";

impl StoreArg {
    /// Where the store lives: a PostgreSQL store when STORE starts with
    /// `postgresql://` or `postgres://`, else a file. `--schema` on a file
    /// is refused. A URL's `schema=NAME` query parameter (the store's name
    /// as messages print it) names the schema; `--schema` naming another
    /// is refused.
    pub fn target(&self) -> Result<Target, CliError> {
        let text = self.store.to_str();
        let absent = || std::fs::symlink_metadata(&self.store).is_err();
        let url = text.and_then(|s| match url_scheme(s) {
            // A URL's scheme is case-insensitive (RFC 3986 §3.1); the
            // engine takes it in lower case.
            Some(scheme) => Some(format!(
                "{}{}",
                scheme.to_ascii_lowercase(),
                &s[scheme.len()..]
            )),
            None if is_key_value(s) && absent() => Some(s.to_owned()),
            None => None,
        });
        match url {
            Some(url) => {
                // The store's name as messages print it (`…?schema=NAME`)
                // names its schema in the URL: taken from there, so that
                // the name pasted back opens the same store.
                let (url, in_url) = if is_key_value(&url) {
                    (url, None)
                } else {
                    take_schema(&url)?
                };
                let schema = match (self.schema.as_deref(), in_url) {
                    (Some(flag), Some(given)) if flag != given => {
                        return Err(CliError::Usage(format!(
                            "--schema {flag} and the URL's schema={given} name different \
                             schemas; give one (see --help)"
                        )));
                    }
                    (Some(flag), _) => flag.to_owned(),
                    (None, Some(given)) => given,
                    (None, None) => DEFAULT_SCHEMA.to_owned(),
                };
                let name = if is_key_value(&url) {
                    redacted_key_value(&url, &schema)
                } else {
                    redacted(&url, &schema)
                };
                Ok(Target::Postgres { url, schema, name })
            }
            // Not a store file, and it may hold a password: not echoed.
            None if text.is_some_and(may_be_connection_string) && absent() => Err(CliError::Usage(
                "STORE is not a store file, and not a connection string this command \
                     reads (its value is not shown: it may hold a password): give a \
                     postgresql:// URL, or key=value pairs that start with a libpq keyword \
                     (`host=db1 port=5432 dbname=app user=svc`)"
                    .into(),
            )),
            None if self.schema.is_some() => Err(CliError::Usage(format!(
                "--schema is for a PostgreSQL store (a postgresql:// or postgres:// URL, or a \
                 key=value connection string), and {} is a file (see --help)",
                self.store.display()
            ))),
            None => {
                refuse_output_into(&self.store)?;
                Ok(Target::File(self.store.clone()))
            }
        }
    }
}

/// Takes the `schema=NAME` query parameter out of a PostgreSQL URL (the
/// driver knows no such option): the URL without it, and the schema it
/// names, if any. Refused (exit 2) when it names two different schemas. A
/// URL whose authority holds no `@` while the rest does (a password with
/// an unescaped `/`, `?` or `#` may have cut the authority short) is left
/// as it is: what follows a `?` there may be part of a password.
fn take_schema(url: &str) -> Result<(String, Option<String>), CliError> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok((url.to_owned(), None));
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(end);
    let Some((path, query)) = after.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    if !authority.contains('@') && after.contains('@') {
        return Ok((url.to_owned(), None));
    }
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let mut schema: Option<&str> = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("schema", value)) => match schema {
                Some(first) if first != value => {
                    return Err(CliError::Usage(format!(
                        "the URL names two schemas, schema={first} and schema={value}; give \
                         one (see --help)"
                    )));
                }
                _ => schema = Some(value),
            },
            _ => kept.push(pair),
        }
    }
    let Some(schema) = schema else {
        return Ok((url.to_owned(), None));
    };
    let mut out = format!("{scheme}://{authority}{path}");
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    Ok((out, Some(schema.to_owned())))
}

/// Refuses a run whose standard output is the store file at `path` or its
/// write-ahead log, by any name (`idemstore export S >> S`, `list S 1<> S`):
/// what the command prints would be written into the store and damage it.
/// Compared by file identity (`same-file`, as ripgrep does for its own
/// output). Only a regular file is opened to compare (a fifo or a device is
/// never opened here: the library refuses it without blocking); an output
/// or a file that cannot be compared is no match. (Standard error is not
/// compared: the refusal itself would be written there.)
fn refuse_output_into(path: &Path) -> Result<(), CliError> {
    let outputs = [("standard output", same_file::Handle::stdout())];
    // The store writes the log beside the file's canonical path; an older
    // build wrote it beside the path as spelled.
    let log_beside = |p: &Path| {
        let mut log = p.as_os_str().to_owned();
        log.push("-wal");
        std::path::PathBuf::from(log)
    };
    let spelled = log_beside(path);
    let canonical =
        std::fs::canonicalize(path).map_or_else(|_| spelled.clone(), |c| log_beside(&c));
    for (what, file) in [
        ("store file", path),
        ("write-ahead log", spelled.as_path()),
        ("write-ahead log", canonical.as_path()),
    ] {
        if !std::fs::metadata(file).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let Ok(handle) = same_file::Handle::from_path(file) else {
            continue;
        };
        for (stream, output) in &outputs {
            if output.as_ref().is_ok_and(|o| *o == handle) {
                return Err(CliError::Usage(format!(
                    "{stream} is the {what} {}: what the command prints would be written into \
                     the store and damage it; nothing was done: redirect it elsewhere",
                    file.display()
                )));
            }
        }
    }
    Ok(())
}

/// The scheme and `://` that start `s` when it is a PostgreSQL URL, in any
/// case (`postgresql://`, `postgres://`, `PostgreSQL://`).
fn url_scheme(s: &str) -> Option<&str> {
    URL_PREFIXES
        .iter()
        .find_map(|p| s.get(..p.len()).filter(|head| head.eq_ignore_ascii_case(p)))
}

/// Whether `s`, which names no file, reads like a connection string this
/// command did not take, so that messages must not show it: a password
/// (`password=…`, spaces around `=` too), a URL of any scheme (`x://`, or
/// `x:/` mistyped), or two or more `keyword=value` words.
fn may_be_connection_string(s: &str) -> bool {
    // The keyword of a `keyword=value` word.
    fn keyword(word: &str) -> Option<&str> {
        word.split_once('=').map(|(key, _)| key).filter(|key| {
            !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphabetic() || b == b'_')
        })
    }
    let lower = s.trim_start().to_ascii_lowercase();
    let password = lower
        .match_indices("password")
        .any(|(at, word)| lower[at + word.len()..].trim_start().starts_with('='));
    // A scheme of two characters or more (RFC 3986 §3.1; one would be a
    // Windows drive), so that `./postgresql://x` stays a path.
    let url = lower.split_once(":/").is_some_and(|(scheme, _)| {
        scheme.len() >= 2
            && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
    });
    let words: Vec<&str> = s.split_whitespace().collect();
    password || url || (words.len() >= 2 && words.iter().all(|w| keyword(w).is_some()))
}

/// The libpq connection keywords (PostgreSQL 17, "Parameter Key Words"):
/// a key=value connection string (`host=db1 dbname=app user=svc`), which
/// `Store::connect` takes as well as a URL, starts with one of them.
const KEY_VALUE_KEYWORDS: [&str; 42] = [
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "requiressl",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
    "sslnegotiation",
];

/// Whether `s` reads as a key=value connection string: its first word is
/// `KEYWORD=` with a libpq keyword. (A store file of that name is still a
/// file: the caller checks that no such file exists.)
fn is_key_value(s: &str) -> bool {
    s.trim_start()
        .split_once('=')
        .is_some_and(|(word, _)| KEY_VALUE_KEYWORDS.contains(&word.trim_end()))
}

/// A key=value connection string as messages show it: host, port and
/// database only (never the user or a password), plus `?schema=NAME`. A
/// string with a quoted or escaped value shows none of them (such a value
/// may hold spaces and `=`, so splitting it at spaces could show part of a
/// password), nor does a value that could hold credentials (see
/// [`shown_part`]).
fn redacted_key_value(conn: &str, schema: &str) -> String {
    // A quote or a backslash escape (`x\ y`) lets a value hold spaces and
    // `=`: splitting at spaces could then show part of a password.
    if conn.contains(['\'', '\\']) {
        return format!("postgresql://?schema={schema}");
    }
    // `key = value` as `key=value`.
    let pairs = conn.split('=').map(str::trim).collect::<Vec<_>>().join("=");
    let value = |key: &str| {
        pairs
            .split_whitespace()
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == key)
            .map_or("", |(_, v)| shown_part(v))
    };
    let port = match value("port") {
        "" => String::new(),
        p => format!(":{p}"),
    };
    format!(
        "postgresql://{}{port}/{}?schema={schema}",
        value("host"),
        value("dbname")
    )
}

/// A host, port or database name as messages show it: itself when it
/// holds only letters, digits and `.-_:/[]%,` with no `://` (libpq reads a
/// `dbname` that is itself a connection string, with its password), else
/// `…`.
fn shown_part(v: &str) -> &str {
    let plain = v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:/[]%,".contains(&b))
        && !v.contains("://");
    if plain { v } else { "…" }
}

/// `url` without its user, password and parameters, plus `?schema=NAME`:
/// what messages show of a connection URL (the store's own
/// [`Store::path`] is the same form once connected).
///
/// The authority ends at the first `/`, `?` or `#`; the user and password
/// are what it holds up to its last `@` (a password may hold an `@` of its
/// own). When the authority holds no `@` but the rest of the URL does, a
/// password with an unescaped `/`, `?` or `#` may have cut the authority
/// short, so neither host nor database is shown. A query parameter that
/// overrides the host (`host`, `hostaddr`, `port`) or the database
/// (`dbname`) shows that part as `…`: the URL's own would name another.
fn redacted(url: &str, schema: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgresql", url));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(end);
    let host = match authority.rsplit_once('@') {
        Some((_, host)) => host,
        None if after.contains('@') => return format!("{scheme}://?schema={schema}"),
        None => authority,
    };
    let db = after
        .strip_prefix('/')
        .map_or("", |path| path.split(['?', '#']).next().unwrap_or(""));
    // A percent-encoded database name may encode a connection string
    // (the library decodes it, and hides it then): shown as `…` too.
    let db = if db.contains('%') {
        "…"
    } else {
        shown_part(db)
    };
    let query = after
        .split_once('?')
        .map_or("", |(_, q)| q.split('#').next().unwrap_or(""));
    let overridden = |keys: &[&str]| {
        query
            .split('&')
            .any(|pair| keys.contains(&pair.split('=').next().unwrap_or("")))
    };
    let db = if overridden(&["dbname"]) { "…" } else { db };
    let host = if overridden(&["host", "hostaddr", "port"]) {
        "…"
    } else {
        shown_part(host)
    };
    format!("{scheme}://{host}/{db}?schema={schema}")
}

/// The settings of an operator command's store: no background sweeper and
/// no background scrub (a command is short), `retention` for what the
/// command writes (the default, 24 h, when `None`).
pub fn config(retention: Option<Duration>) -> Config {
    let mut config = Config::new().sweep_interval(None).scrub_rate(None);
    if let Some(retention) = retention {
        config = config.retention(retention);
    }
    config
}

/// Connects to a PostgreSQL store: the existing one in `schema` (refused
/// when the schema holds none), or, with `create`, creating it if absent.
pub fn connect(
    url: &str,
    schema: &str,
    retention: Option<Duration>,
    create: bool,
) -> Result<Store, Error> {
    connect_with(url, schema, config(retention), create)
}

/// [`connect`] with `config` (from [`config`], changed by the command).
#[cfg(feature = "postgres")]
pub fn connect_with(url: &str, schema: &str, config: Config, create: bool) -> Result<Store, Error> {
    // An operator command runs one request at a time (and a scan).
    let config = config.postgres_schema(schema).postgres_connections(2);
    if create {
        Store::connect(url, config)
    } else {
        Store::connect_existing(url, config)
    }
}

/// Without the `postgres` feature there is no PostgreSQL engine.
#[cfg(not(feature = "postgres"))]
pub fn connect_with(
    _url: &str,
    _schema: &str,
    _config: Config,
    _create: bool,
) -> Result<Store, Error> {
    Err(Error::InvalidArgument {
        what: "STORE",
        reason: "this build of idemstore has no PostgreSQL engine (cargo feature `postgres`)"
            .into(),
    })
}

/// Opens an existing store for a command that only reads it (`get`,
/// `list`, `stats`, `export`): a store file read-only
/// ([`Config::read_only`]), so that a host whose wall clock is ahead does
/// not move the store's time forward for good; a PostgreSQL store (whose
/// time is the server's) as [`open`] does.
pub fn open_to_read(arg: &StoreArg) -> Result<Store, CliError> {
    match arg.target()? {
        Target::File(path) => Store::open_existing(&path, config(None).read_only(true))
            .map_err(|e| open_error(&path, e)),
        Target::Postgres { .. } => open(arg, None),
    }
}

/// Opens an existing store for an operator command: no background sweeper,
/// `retention` for what the command writes (the default, 24 h, when `None`).
pub fn open(arg: &StoreArg, retention: Option<Duration>) -> Result<Store, CliError> {
    match arg.target()? {
        Target::File(path) => {
            Store::open_existing(&path, config(retention)).map_err(|e| open_error(&path, e))
        }
        Target::Postgres { url, schema, name } => {
            connect(&url, &schema, retention, false).map_err(|e| connect_error(&name, &schema, e))
        }
    }
}

/// The one-line error for a store file that cannot be opened: names the
/// file and the problem (missing, in use, not an idemstore file, newer
/// format).
pub fn open_error(path: &Path, err: Error) -> CliError {
    match err {
        // The store file is free but its log is held: the file at the
        // path was replaced under a running store.
        Error::AlreadyOpen { path: held }
            if held != path && held.to_string_lossy().ends_with("-wal") =>
        {
            CliError::Failed(format!(
                "{}'s write-ahead log {} is held by a running store: the file at {} is not the \
             one that store has open (it was replaced, a copy moved over it, while the store \
             ran). Stop that service first; its clean close writes its changes into the file \
             it holds (the one moved away), not into this one",
                path.display(),
                held.display(),
                path.display()
            ))
        }
        Error::AlreadyOpen { .. } => CliError::Failed(format!(
            "{} is in use: another process holds the store (redb locks the file while a Store \
             has it open). Operator commands need the file to themselves: stop the service \
             first, or read live numbers from the service's Store::stats()",
            path.display()
        )),
        Error::CorruptLog { .. } => CliError::store(
            format!(
                "cannot open the store (`idemstore check {}` says what to do; \
                 `idemstore export --accept-log-loss` salvages what the file itself holds)",
                path.display()
            ),
            err,
        ),
        other => CliError::store("cannot open the store", other),
    }
}

/// The one-line error for a PostgreSQL store that cannot be opened: names
/// the store (without credentials) and the problem.
pub fn connect_error(name: &str, schema: &str, err: Error) -> CliError {
    match err {
        Error::Missing { .. } => CliError::Failed(format!(
            "{name}: no idemstore store in schema {schema:?} (check the database and --schema; \
             `idemstore import --create` restores an export into a new schema)"
        )),
        // The commands connect as a store with no pooler between.
        other @ Error::Misconfigured {
            fault: idemstore::ConfigFault::PoolerMismatch,
            ..
        } => CliError::store(
            format!(
                "cannot open the store {name} (idemstore commands connect to the server \
                 itself: give the server's address, not a pooler's)"
            ),
            other,
        ),
        other => CliError::store(format!("cannot open the store {name}"), other),
    }
}

/// A key as the operator typed it, for messages: `scope "acme/tickets" id
/// "task-42:call-7"` (quoted and escaped, so spaces and slashes show
/// exactly where one part ends). Never the joined `scope/id` form, which is
/// ambiguous: a scope may contain `/`.
pub fn key_text(scope: &str, id: &str) -> String {
    format!("scope {scope:?} id {id:?}")
}

/// The key named by `scope` and `id`; with no `id`, `scope` is a key as the
/// library prints it (`scope/id`, as in `acme/tickets.create/task-1:call-1`)
/// and is split at the one `/` after which `store` holds a live record.
/// A scope and an id may both hold `/`, so the joined form is ambiguous on
/// its own: when no split or more than one names a record, the error lists
/// each way to split it as two arguments.
pub fn key_of(store: &Store, scope: &str, id: Option<&str>) -> Result<Key, CliError> {
    if let Some(id) = id {
        return Key::new(scope, id)
            .map_err(|e| CliError::store(format!("invalid key ({})", key_text(scope, id)), e));
    }
    let joined = scope;
    let splits: Vec<Key> = joined
        .match_indices('/')
        .filter_map(|(at, _)| Key::new(&joined[..at], &joined[at + 1..]).ok())
        .collect();
    // Each split as a shell takes it: after `--` (a scope may start with
    // `-`), each part quoted for a POSIX shell where it needs it.
    let listed = |keys: &[Key]| {
        keys.iter()
            .map(|k| format!("-- {} {}", shell_word(k.scope()), shell_word(k.id())))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mut found = Vec::new();
    // On a store the scrub found damaged, a split that is not found is not
    // known to be absent (the damage can hide a record): such splits are
    // unknown, and the key is taken only as two arguments.
    let mut unknown = None;
    for key in &splits {
        match store.get(key) {
            Ok(Some(_)) => found.push(key.clone()),
            Ok(None) => {}
            Err(e @ idemstore::Error::CorruptFile { .. }) => unknown = Some(e),
            Err(e) => {
                return Err(CliError::store(
                    format!("cannot read {}", key_text(key.scope(), key.id())),
                    e,
                ));
            }
        }
    }
    if let Some(e) = unknown {
        return Err(CliError::Usage(format!(
            "{joined:?} is one argument, and this store cannot tell which way of splitting it \
             names a record ({e}). A key is SCOPE ID, two arguments; it splits as one of \
             (each pasted at the end of the command, after its options): {}",
            listed(&splits)
        )));
    }
    if let [key] = found.as_slice() {
        return Ok(key.clone());
    }
    Err(CliError::Usage(match (splits.len(), found.len()) {
        (0, _) => format!(
            "{joined:?} is one argument: a key is SCOPE ID, two arguments (a key printed as \
             scope/id splits at a `/`, and this one has no `/` with text on both sides)"
        ),
        (_, 0) => format!(
            "{joined:?} is one argument and no way of splitting it at a `/` names a record \
             (absent or past retention). A key is SCOPE ID, two arguments; it splits as one \
             of (each pasted at the end of the command, after its options): {}",
            listed(&splits)
        ),
        _ => format!(
            "{joined:?} is one argument and names more than one record; give SCOPE ID as two \
             arguments, one of (each pasted at the end of the command, after its options): {}",
            listed(&found)
        ),
    }))
}

/// `word` quoted for a POSIX shell when it needs quoting (as is when it
/// holds a NUL byte, which no quoting carries and no key holds).
fn shell_word(word: &str) -> std::borrow::Cow<'_, str> {
    shlex::try_quote(word).unwrap_or(std::borrow::Cow::Borrowed(word))
}

/// A writer that remembers whether a write failed because the reader went
/// away (a closed pipe: `idemstore export STORE | head`). The library
/// reports a failed write as a storage error with the cause as text; this
/// keeps the cause so that the command can end quietly, as ripgrep does.
pub struct PipeWatch<W> {
    inner: W,
    closed: bool,
}

impl<W: std::io::Write> PipeWatch<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        PipeWatch {
            inner,
            closed: false,
        }
    }

    /// Whether a write or flush failed with a closed pipe.
    pub fn closed(&self) -> bool {
        self.closed
    }

    fn watch<T>(&mut self, result: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &result
            && e.kind() == std::io::ErrorKind::BrokenPipe
        {
            self.closed = true;
        }
        result
    }
}

impl<W: std::io::Write> std::io::Write for PipeWatch<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let result = self.inner.write(buf);
        self.watch(result)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let result = self.inner.flush();
        self.watch(result)
    }
}

/// What a progress bar counts.
#[derive(Debug, Clone, Copy)]
pub enum Unit {
    /// Records.
    Records,
    /// Bytes of a stream.
    Bytes,
}

/// A progress bar on stderr, hidden unless stderr is a terminal. `len` is
/// the expected count (a spinner when unknown).
pub fn progress(len: Option<u64>, message: &'static str, unit: Unit) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match len {
        Some(len) => ProgressBar::new(len),
        None => ProgressBar::new_spinner(),
    }
    .with_style(style(len.is_some(), unit));
    bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(10));
    bar.set_message(message);
    bar
}

/// Gives a bar made without a length (a spinner) its length, once known,
/// and the style of a bar with one.
pub fn size_progress(bar: &ProgressBar, len: u64, unit: Unit) {
    if bar.is_hidden() {
        return;
    }
    bar.set_length(len);
    bar.set_style(style(true, unit));
}

/// The style of a bar with a known length (`sized`) or a spinner.
fn style(sized: bool, unit: Unit) -> ProgressStyle {
    let template = match (sized, unit) {
        (true, Unit::Records) => "{msg} [{bar:32}] {human_pos}/{human_len} records (eta {eta})",
        (true, Unit::Bytes) => {
            "{msg} [{bar:32}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, eta {eta})"
        }
        (false, Unit::Records) => "{spinner} {msg} {human_pos} records ({elapsed})",
        (false, Unit::Bytes) => "{spinner} {msg} {binary_bytes} ({binary_bytes_per_sec})",
    };
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// A duration in milliseconds for people: `3m 12s`, `850ms`.
pub fn age(ms: u64) -> String {
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    humantime::format_duration(Duration::from_secs(ms / 1_000)).to_string()
}

/// A size in bytes for people: `12.3 MiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    #[allow(clippy::cast_precision_loss)] // display only
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Stored bytes as JSON: `{"text": …}` when they are UTF-8, else
/// `{"hex": …}`; `null` when absent.
pub fn bytes_json(bytes: Option<&[u8]>) -> Value {
    match bytes {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(text) => json!({ "text": text }),
            Err(_) => json!({ "hex": hex(b) }),
        },
    }
}

/// Stored bytes for people: the text (escaped) when UTF-8, else hex.
pub fn bytes_text(bytes: Option<&[u8]>) -> String {
    match bytes {
        None => "-".into(),
        Some(b) => match std::str::from_utf8(b) {
            Ok(text) => format!("{:?}", text),
            Err(_) => format!("0x{}", hex(b)),
        },
    }
}

/// A record as JSON, with times judged at `now_ms`.
pub fn record_json(record: &Record, now_ms: u64) -> Value {
    json!({
        "scope": record.key().scope(),
        "id": record.key().id(),
        "state": record.state().name(),
        "token": record.token(),
        "fingerprint": hex(record.fingerprint().as_bytes()),
        "created_ms": record.created_ms(),
        "updated_ms": record.updated_ms(),
        "lease_until_ms": record.lease_until_ms(),
        "expires_ms": record.expires_ms(),
        "age_ms": now_ms.saturating_sub(record.created_ms()),
        "lease_lapsed": record.state() == State::Processing && !record.lease_valid_at(now_ms),
        "acquisitions": record.acquisitions(),
        "business_key": record.business_key(),
        "result": bytes_json(record.result()),
        "failure": bytes_json(record.failure()),
        "recovery_point": bytes_json(record.recovery_point()),
    })
}

/// A failed JSON write as an output error, keeping the I/O error's kind so
/// that a closed pipe is recognised (and not reported).
pub fn json_error(err: serde_json::Error) -> CliError {
    match err.io_error_kind() {
        Some(kind) => CliError::Output(std::io::Error::new(kind, err)),
        None => CliError::Output(std::io::Error::other(err)),
    }
}

/// Writes `value` as pretty JSON and a newline.
pub fn write_json(out: &mut impl std::io::Write, value: &Value) -> Result<(), CliError> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(json_error)?;
    writeln!(out)?;
    Ok(())
}

/// The lease column: time left, or how long ago it lapsed.
pub fn lease_text(record: &Record, now_ms: u64) -> String {
    if record.state() != State::Processing {
        return "-".into();
    }
    let until = record.lease_until_ms();
    if now_ms < until {
        format!("{} left", age(until - now_ms))
    } else {
        format!("lapsed {} ago", age(now_ms - until))
    }
}

/// The state names `--state` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StateArg {
    /// A lease holder is running the work (or abandoned it).
    Processing,
    /// Finished with a stored result.
    Succeeded,
    /// Failed permanently; replayed until retention ends.
    Failed,
    /// Failed retryably; the next claim runs the work again.
    FailedRetryable,
}

impl From<StateArg> for State {
    fn from(s: StateArg) -> State {
        match s {
            StateArg::Processing => State::Processing,
            StateArg::Succeeded => State::Succeeded,
            StateArg::Failed => State::Failed { retryable: false },
            StateArg::FailedRetryable => State::Failed { retryable: true },
        }
    }
}

#[cfg(test)]
mod tests {
    /// A store behind a pooler that refuses or drops the startup options:
    /// the command says to give the server's own address (the library's
    /// remedy, a `Config` setting, is not the operator's to set here).
    #[test]
    fn a_pooler_mismatch_names_the_servers_address() {
        let err = super::connect_error(
            "postgresql://pool:6432/app?schema=idemstore",
            "idemstore",
            idemstore::Error::Misconfigured {
                fault: idemstore::ConfigFault::PoolerMismatch,
                detail: "FATAL (08P01): unsupported startup parameter: options".into(),
            },
        );
        let text = err.to_string();
        assert!(text.contains("give the server's address"), "{text}");
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        assert!(
            cause
                .as_deref()
                .is_some_and(|c| c.contains("unsupported startup parameter")),
            "{cause:?}"
        );
    }

    use super::*;

    fn target(store: &str) -> Result<Target, CliError> {
        StoreArg {
            store: PathBuf::from(store),
            schema: None,
        }
        .target()
    }

    #[test]
    fn messages_never_show_a_urls_credentials() {
        let cases = [
            (
                "postgresql://svc:pw@db1:5432/app?sslmode=disable",
                "postgresql://db1:5432/app",
            ),
            ("postgres://svc:p@ss@db1/app", "postgres://db1/app"),
            ("postgresql://db1/app?password=p@ss", "postgresql://"),
            (
                "postgresql://svc:Sekr3tPW?x@127.0.0.1:5488/app",
                "postgresql://",
            ),
            (
                "postgresql://svc:Sekr3tPW#x@127.0.0.1:5488/app",
                "postgresql://",
            ),
            (
                "postgresql://svc:Sekr/3tPW@127.0.0.1:5488/app",
                "postgresql://",
            ),
            ("postgresql:///app?host=/run/pg", "postgresql://…/app"),
            (
                "postgresql://postgres@127.0.0.1:5488/postgres?dbname=db2",
                "postgresql://127.0.0.1:5488/…",
            ),
            (
                "postgresql://db1/app?sslmode=disable&hostaddr=10.0.0.2&x=1",
                "postgresql://…/app",
            ),
            (
                "postgresql://db1/app?application_name=x",
                "postgresql://db1/app",
            ),
            (
                "postgresql://db1/x%3A%2F%2Fsvc%3ASekr3t%40db2",
                "postgresql://db1/…",
            ),
        ];
        for (url, shown) in cases {
            let name = redacted(url, "s");
            assert_eq!(name, format!("{shown}?schema=s"), "{url}");
            assert!(!name.contains("pw") && !name.contains("Sekr") && !name.contains("ss@"));
        }
    }

    #[test]
    fn messages_never_show_a_key_value_strings_credentials() {
        let cases = [
            (
                "host = db1 port = 5433 dbname = app password = pw",
                "postgresql://db1:5433/app",
            ),
            (
                "dbname=postgresql://svc:Sekr3t@db1/app host=db1",
                "postgresql://db1/…",
            ),
            ("password='x dbname=Sekr3t' host=db1", "postgresql://"),
            ("host=svc:Sekr3t@db1 dbname=app", "postgresql://…/app"),
            (r"host=db1 password=x\ dbname=Sekr3t", "postgresql://"),
        ];
        for (conn, shown) in cases {
            let name = redacted_key_value(conn, "s");
            assert_eq!(name, format!("{shown}?schema=s"), "{conn}");
        }
    }

    /// The store's name as messages print it (`…?schema=NAME`), pasted
    /// back as STORE, names that schema: the parameter is taken out of the
    /// URL the driver gets, and `--schema` naming another is refused.
    #[test]
    fn a_schema_in_the_url_names_the_store() {
        let with = |store: &str, schema: Option<&str>| {
            StoreArg {
                store: PathBuf::from(store),
                schema: schema.map(str::to_owned),
            }
            .target()
        };
        let postgres = |store: &str, flag: Option<&str>| match with(store, flag) {
            Ok(Target::Postgres { url, schema, name }) => (url, schema, name),
            other => panic!("{store}: {other:?}"),
        };
        assert_eq!(
            postgres("postgresql://db1:5432/app?schema=Orders_2", None),
            (
                "postgresql://db1:5432/app".to_owned(),
                "Orders_2".to_owned(),
                "postgresql://db1:5432/app?schema=Orders_2".to_owned()
            )
        );
        let (url, schema, _) = postgres(
            "postgresql://svc:pw@db1/app?sslmode=disable&schema=s1&application_name=x#f",
            Some("s1"),
        );
        assert_eq!(
            (url.as_str(), schema.as_str()),
            (
                "postgresql://svc:pw@db1/app?sslmode=disable&application_name=x#f",
                "s1"
            )
        );
        // Without the parameter: --schema, else the default.
        assert_eq!(postgres("postgresql://db1/app", Some("s2")).1, "s2");
        assert_eq!(
            postgres("postgresql://db1/app?sslmode=disable", None).1,
            "idemstore"
        );
        // Two schemas named: refused.
        for (store, flag) in [
            ("postgresql://db1/app?schema=s1", Some("s2")),
            ("postgresql://db1/app?schema=s1&schema=s2", None),
        ] {
            match with(store, flag) {
                Err(CliError::Usage(msg)) => assert!(msg.contains("s1") && msg.contains("s2")),
                other => panic!("{store}: {other:?}"),
            }
        }
        // What follows a `?` that may be part of a password is left alone.
        let (url, schema, _) = postgres("postgresql://svc:pw?schema=x@db1/app", None);
        assert_eq!(
            (url.as_str(), schema.as_str()),
            ("postgresql://svc:pw?schema=x@db1/app", "idemstore")
        );
    }

    #[test]
    fn connection_strings_are_told_from_files() {
        let postgres = |s: &str| match target(s) {
            Ok(Target::Postgres { url, name, .. }) => Some((url, name)),
            _ => None,
        };
        let (url, name) = postgres("PostgreSQL://svc:pw@db1/app").unwrap();
        assert_eq!(url, "postgresql://svc:pw@db1/app");
        assert_eq!(name, "postgresql://db1/app?schema=idemstore");
        let (_, name) =
            postgres("connect_timeout=5 host=db1 port=5433 user=svc password=pw dbname=app")
                .unwrap();
        assert_eq!(name, "postgresql://db1:5433/app?schema=idemstore");
        assert!(matches!(target("/nonexistent/a.redb"), Ok(Target::File(_))));
        assert!(matches!(
            target("/nonexistent/passwords.redb"),
            Ok(Target::File(_))
        ));
        assert!(matches!(target("./postgresql://x"), Ok(Target::File(_))));
        // A new store file's name may hold `@` and `:`.
        assert!(matches!(
            target("/nonexistent/idem@2024-05-01T12:00.redb"),
            Ok(Target::File(_))
        ));
        // Not a store and not a string this command reads: refused, and
        // not echoed.
        for s in [
            "mysql://svc:Sekr3t@db1/app",
            "/nonexistent/x password=Sekr3t",
            "bogus=1 also=2",
            "Host = db1 password = Sekr3t",
            "bogus=1 password =Sekr3t",
            " postgresql://svc:Sekr3t@db1/app",
            "postgresql:/svc:Sekr3t@db1/app",
        ] {
            match target(s) {
                Err(CliError::Usage(msg)) => assert!(!msg.contains("Sekr3t"), "{msg}"),
                other => panic!("{s}: {:?}", other.is_ok()),
            }
        }
    }
}
