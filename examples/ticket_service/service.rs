//! The ticket service: an axum app whose `POST /tickets` runs behind
//! [`IdempotencyLayer`], and whose ticket table closes the gap the store
//! cannot: it is unique on the idempotency key, and a handler that takes a
//! key over looks the ticket up before creating one.
//!
//! Two ways to run it: one replica over files (the idempotency store and a
//! redb ticket file), or a fleet of replicas over one PostgreSQL database
//! ([`Options::postgres`]: the store through `Store::connect`, and the
//! tickets in a table of the same database, `UNIQUE` on the idempotency
//! key). The handler is the same in both.
//!
//! Why the PostgreSQL mode does not create the ticket and complete the key
//! in one transaction (`idemstore::postgres::complete_in`, see
//! `examples/ticket_txn.rs`): the layer stores the *response* (status,
//! headers and the body as it streamed to the client) as the key's result,
//! after the handler returned and the last byte was sent, so the handler
//! has nothing to complete the key with. The unique key and the lookup on
//! a takeover close that gap instead, on one replica as on many.
//!
//! Shared by `examples/ticket_service.rs` and `tests/http_e2e.rs`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use idemstore::http::{IdempotencyContext, IdempotencyLayer, IdempotencyOutcome};
use idemstore::{Config, Store};
use metrics_exporter_prometheus::PrometheusHandle;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde_json::{Value, json};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Idempotency key (`scope/id`) → ticket id. The key is the table's key,
/// so a second ticket for one key cannot exist.
const BY_KEY: TableDefinition<&str, u64> = TableDefinition::new("tickets_by_idempotency_key");
/// Ticket id → ticket as JSON.
const TICKETS: TableDefinition<u64, &str> = TableDefinition::new("tickets");

/// How the service runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The address to listen on.
    pub addr: SocketAddr,
    /// The idempotency store's file.
    pub store: PathBuf,
    /// The ticket table's file.
    pub tickets: PathBuf,
    /// The lease of each claim: how long a key whose server died stays
    /// held before a retry may take it over.
    pub lease: Duration,
    /// Simulated work per ticket, half before the ticket is written and
    /// half after (so a crash can fall between the ticket and the stored
    /// response).
    pub work: Duration,
    /// The pause between two events of `POST /tickets/triage`'s streamed
    /// body (it sends [`TRIAGE_STEPS`] progress events, then the ticket).
    pub stream_interval: Duration,
    /// The Prometheus exporter's handle, for `GET /metrics`; its recorder
    /// must be installed before the store is opened. `None`: no route.
    pub metrics: Option<PrometheusHandle>,
    /// Run as one replica of a fleet on this PostgreSQL database (the
    /// `store` and `tickets` files are then not used). `None`: files.
    pub postgres: Option<PgTarget>,
}

/// Where a fleet keeps its idempotency keys and its tickets.
#[derive(Debug, Clone)]
pub struct PgTarget {
    /// The database's connection string (`postgresql://…`).
    pub url: String,
    /// The schema of the idempotency store; the `tickets` table is created
    /// in it too, beside the store's tables.
    pub schema: String,
}

/// How many progress events `POST /tickets/triage` streams before the
/// ticket.
pub const TRIAGE_STEPS: u32 = 5;

/// A ticket as the service returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// Its id, from 1 up.
    pub id: u64,
    /// The idempotency key (`scope/id`) it was created under.
    pub idempotency_key: String,
    /// Its title.
    pub title: String,
}

impl Ticket {
    fn to_json(&self) -> Value {
        json!({"id": self.id, "title": self.title, "idempotency_key": self.idempotency_key})
    }

    fn from_json(id: u64, text: &str) -> Result<Ticket, BoxError> {
        let v: Value = serde_json::from_str(text)?;
        Ok(Ticket {
            id,
            idempotency_key: v["idempotency_key"].as_str().unwrap_or_default().to_owned(),
            title: v["title"].as_str().unwrap_or_default().to_owned(),
        })
    }
}

/// The ticket table: a redb file of its own, unique on the idempotency key.
#[derive(Clone)]
pub struct Tickets(Arc<Database>);

impl Tickets {
    /// Opens (or creates) the ticket file.
    pub fn open(path: &Path) -> Result<Tickets, BoxError> {
        let db = Database::create(path)?;
        let txn = db.begin_write()?;
        txn.open_table(BY_KEY)?;
        txn.open_table(TICKETS)?;
        txn.commit()?;
        Ok(Tickets(Arc::new(db)))
    }

    /// The ticket created under `key`, if any.
    pub fn find(&self, key: &str) -> Result<Option<Ticket>, BoxError> {
        let txn = self.0.begin_read()?;
        let Some(id) = txn.open_table(BY_KEY)?.get(key)?.map(|v| v.value()) else {
            return Ok(None);
        };
        let tickets = txn.open_table(TICKETS)?;
        let text = tickets
            .get(id)?
            .ok_or("ticket index names a missing ticket")?;
        Ticket::from_json(id, text.value()).map(Some)
    }

    /// Creates a ticket under `key`, or returns the one that exists: one
    /// durable write transaction, so the uniqueness holds whoever races.
    pub fn create(&self, key: &str, title: &str) -> Result<Ticket, BoxError> {
        let txn = self.0.begin_write()?;
        let ticket = {
            let mut by_key = txn.open_table(BY_KEY)?;
            let mut tickets = txn.open_table(TICKETS)?;
            let existing = by_key.get(key)?.map(|v| v.value());
            if let Some(id) = existing {
                let text = tickets
                    .get(id)?
                    .ok_or("ticket index names a missing ticket")?;
                return Ticket::from_json(id, text.value());
            }
            let id = tickets.last()?.map_or(1, |(k, _)| k.value() + 1);
            let ticket = Ticket {
                id,
                idempotency_key: key.to_owned(),
                title: title.to_owned(),
            };
            tickets.insert(id, ticket.to_json().to_string().as_str())?;
            by_key.insert(key, id)?;
            ticket
        };
        txn.commit()?;
        Ok(ticket)
    }

    /// The ticket with `id`, if any.
    pub fn get(&self, id: u64) -> Result<Option<Ticket>, BoxError> {
        let txn = self.0.begin_read()?;
        let tickets = txn.open_table(TICKETS)?;
        match tickets.get(id)? {
            Some(text) => Ticket::from_json(id, text.value()).map(Some),
            None => Ok(None),
        }
    }

    /// How many tickets exist.
    pub fn count(&self) -> Result<u64, BoxError> {
        Ok(self.0.begin_read()?.open_table(TICKETS)?.len()?)
    }

    /// Every ticket, by id.
    #[allow(dead_code)] // Used by tests/http_e2e.rs, not by the example.
    pub fn all(&self) -> Result<Vec<Ticket>, BoxError> {
        let txn = self.0.begin_read()?;
        let tickets = txn.open_table(TICKETS)?;
        let mut out = Vec::new();
        for entry in tickets.iter()? {
            let (id, text) = entry?;
            out.push(Ticket::from_json(id.value(), text.value())?);
        }
        Ok(out)
    }
}

/// The ticket table of a fleet: `"<schema>".tickets` in the database of
/// the idempotency store, `UNIQUE` on the idempotency key, shared by every
/// replica.
#[cfg(feature = "postgres")]
pub struct PgTickets {
    url: String,
    table: String,
    /// The connection (opened again when it breaks).
    client: tokio::sync::Mutex<Arc<tokio_postgres::Client>>,
}

#[cfg(feature = "postgres")]
use idemstore::postgres::tokio_postgres;

#[cfg(feature = "postgres")]
impl PgTickets {
    /// Connects and creates the table if it is missing (under an advisory
    /// lock, so that replicas starting together do not race).
    pub async fn connect(target: &PgTarget) -> Result<PgTickets, BoxError> {
        let table = format!("\"{}\".tickets", target.schema);
        let client = Self::open(&target.url).await?;
        client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock(hashtext('ticket_service.ddl')); \
                 CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, \
                 idempotency_key text NOT NULL UNIQUE, title text NOT NULL); COMMIT;"
            ))
            .await?;
        Ok(PgTickets {
            url: target.url.clone(),
            table,
            client: tokio::sync::Mutex::new(Arc::new(client)),
        })
    }

    async fn open(url: &str) -> Result<tokio_postgres::Client, BoxError> {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "tickets connection ended");
            }
        });
        Ok(client)
    }

    /// The connection, opened again if the last one broke.
    async fn client(&self) -> Result<Arc<tokio_postgres::Client>, BoxError> {
        let mut held = self.client.lock().await;
        if held.is_closed() {
            *held = Arc::new(Self::open(&self.url).await?);
        }
        Ok(held.clone())
    }

    fn ticket(row: &tokio_postgres::Row) -> Result<Ticket, BoxError> {
        Ok(Ticket {
            id: u64::try_from(row.try_get::<_, i64>(0)?)?,
            idempotency_key: row.try_get(1)?,
            title: row.try_get(2)?,
        })
    }

    /// The ticket created under `key`, if any.
    pub async fn find(&self, key: &str) -> Result<Option<Ticket>, BoxError> {
        let c = self.client().await?;
        let sql = format!(
            "SELECT id, idempotency_key, title FROM {} WHERE idempotency_key = $1",
            self.table
        );
        c.query_opt(&sql, &[&key])
            .await?
            .as_ref()
            .map(Self::ticket)
            .transpose()
    }

    /// Creates a ticket under `key`, or returns the one that exists: the
    /// insert does nothing on a conflict (it waits for a racing insert of
    /// the same key to commit or roll back), and a second statement, with
    /// a snapshot of its own, reads the winner.
    pub async fn create(&self, key: &str, title: &str) -> Result<Ticket, BoxError> {
        let c = self.client().await?;
        let sql = format!(
            "INSERT INTO {} (idempotency_key, title) VALUES ($1, $2) \
             ON CONFLICT (idempotency_key) DO NOTHING RETURNING id, idempotency_key, title",
            self.table
        );
        if let Some(row) = c.query_opt(&sql, &[&key, &title]).await? {
            return Self::ticket(&row);
        }
        self.find(key)
            .await?
            .ok_or_else(|| "the conflicting ticket is gone".into())
    }

    /// The ticket with `id`, if any.
    pub async fn get(&self, id: u64) -> Result<Option<Ticket>, BoxError> {
        let c = self.client().await?;
        let sql = format!(
            "SELECT id, idempotency_key, title FROM {} WHERE id = $1",
            self.table
        );
        c.query_opt(&sql, &[&i64::try_from(id)?])
            .await?
            .as_ref()
            .map(Self::ticket)
            .transpose()
    }

    /// How many tickets exist.
    pub async fn count(&self) -> Result<u64, BoxError> {
        let c = self.client().await?;
        let n: i64 = c
            .query_one(&format!("SELECT count(*) FROM {}", self.table), &[])
            .await?
            .try_get(0)?;
        Ok(u64::try_from(n)?)
    }

    /// Every ticket, by id.
    #[allow(dead_code)] // Used by tests/fleet_http.rs, not by the example.
    pub async fn all(&self) -> Result<Vec<Ticket>, BoxError> {
        let c = self.client().await?;
        let sql = format!(
            "SELECT id, idempotency_key, title FROM {} ORDER BY id",
            self.table
        );
        c.query(&sql, &[]).await?.iter().map(Self::ticket).collect()
    }
}

/// The ticket table of either mode.
#[derive(Clone)]
enum Table {
    /// A redb file (one replica).
    File(Tickets),
    /// A table of the fleet's database.
    #[cfg(feature = "postgres")]
    Postgres(Arc<PgTickets>),
}

impl Table {
    async fn find(&self, key: String) -> Result<Option<Ticket>, BoxError> {
        match self {
            Table::File(t) => {
                let t = t.clone();
                blocking(move || t.find(&key)).await
            }
            #[cfg(feature = "postgres")]
            Table::Postgres(t) => t.find(&key).await,
        }
    }

    async fn create(&self, key: String, title: String) -> Result<Ticket, BoxError> {
        match self {
            Table::File(t) => {
                let t = t.clone();
                blocking(move || t.create(&key, &title)).await
            }
            #[cfg(feature = "postgres")]
            Table::Postgres(t) => t.create(&key, &title).await,
        }
    }

    async fn get(&self, id: u64) -> Result<Option<Ticket>, BoxError> {
        match self {
            Table::File(t) => {
                let t = t.clone();
                blocking(move || t.get(id)).await
            }
            #[cfg(feature = "postgres")]
            Table::Postgres(t) => t.get(id).await,
        }
    }

    async fn count(&self) -> Result<u64, BoxError> {
        match self {
            Table::File(t) => {
                let t = t.clone();
                blocking(move || t.count()).await
            }
            #[cfg(feature = "postgres")]
            Table::Postgres(t) => t.count().await,
        }
    }
}

#[derive(Clone)]
struct App {
    store: Arc<Store>,
    tickets: Table,
    work: Duration,
    stream_interval: Duration,
}

/// Runs a blocking ticket-table call off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BoxError> + Send + 'static,
) -> Result<T, BoxError> {
    tokio::task::spawn_blocking(f).await?
}

fn created(ticket: &Ticket) -> Response {
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/tickets/{}", ticket.id))],
        Json(ticket.to_json()),
    )
        .into_response()
}

/// The ticket table failed: nothing was created that a retry would not
/// find by its key, so the key is released ([`IdempotencyOutcome::NoEffect`]).
fn unavailable(error: &BoxError) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Extension(IdempotencyOutcome::NoEffect),
        Json(json!({"error": error.to_string()})),
    )
        .into_response()
}

/// `POST /tickets` with `{"title": "..."}` and an `Idempotency-Key` header.
async fn create_ticket(
    State(app): State<App>,
    Extension(ctx): Extension<IdempotencyContext>,
    body: Bytes,
) -> Response {
    match ensure_ticket(&app, &ctx, &body).await {
        Ok(ticket) => created(&ticket),
        Err(response) => response,
    }
}

/// `POST /tickets/triage` with `{"title": "..."}` and an `Idempotency-Key`
/// header: creates the ticket as `POST /tickets` does, then answers 201
/// with a `text/event-stream` body that streams [`TRIAGE_STEPS`] progress
/// events, `stream_interval` apart, and then the ticket: a handler that
/// returns at once with a body that streams for longer than the lease, as
/// a model streaming tokens does. The layer holds the key until the last
/// event is sent, then stores the whole stream for replay.
async fn triage_ticket(
    State(app): State<App>,
    Extension(ctx): Extension<IdempotencyContext>,
    body: Bytes,
) -> Response {
    let ticket = match ensure_ticket(&app, &ctx, &body).await {
        Ok(ticket) => ticket,
        Err(response) => return response,
    };
    let interval = app.stream_interval;
    let last = format!("event: ticket\ndata: {}\n\n", ticket.to_json());
    let events = futures_lite::stream::unfold(0u32, move |step| {
        let last = last.clone();
        async move {
            if step > TRIAGE_STEPS {
                return None;
            }
            if step > 0 {
                tokio::time::sleep(interval).await;
            }
            let event = if step < TRIAGE_STEPS {
                format!("event: progress\ndata: step {}\n\n", step + 1)
            } else {
                last
            };
            Some((Ok::<_, std::io::Error>(Bytes::from(event)), step + 1))
        }
    });
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/tickets/{}", ticket.id)),
            (header::CONTENT_TYPE, "text/event-stream".to_owned()),
        ],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// The ticket of this key: found (a takeover whose earlier attempt created
/// it) or created; or the response that refuses the request.
async fn ensure_ticket(
    app: &App,
    ctx: &IdempotencyContext,
    body: &[u8],
) -> Result<Ticket, Response> {
    let title = match serde_json::from_slice::<Value>(body) {
        Ok(v) => match v["title"].as_str() {
            Some(t) if !t.is_empty() => t.to_owned(),
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    Json(json!({"error": "a ticket needs a non-empty \"title\""})),
                )
                    .into_response());
            }
        },
        Err(e) => {
            return Err((
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("the body is not JSON: {e}")})),
            )
                .into_response());
        }
    };
    // The key's reference, unique per key: its printed form may be another
    // route's key too (`POST /tickets` + `triage/k1`, `POST /tickets/triage` + `k1`).
    let key = ctx.key().reference();

    // An earlier attempt may have created the ticket and died before its
    // response was stored: query instead of acting again.
    if ctx.is_takeover() {
        match app.tickets.find(key.clone()).await {
            Ok(Some(ticket)) => return Ok(ticket),
            Ok(None) => {}
            Err(e) => return Err(unavailable(&e)),
        }
    }

    tokio::time::sleep(app.work / 2).await;
    // Unique on the key: even a race that slipped past the lookup above
    // finds the existing ticket instead of creating a second one.
    let ticket = match app.tickets.create(key, title).await {
        Ok(ticket) => ticket,
        Err(e) => return Err(unavailable(&e)),
    };
    tokio::time::sleep(app.work / 2).await;
    Ok(ticket)
}

async fn get_ticket(State(app): State<App>, UrlPath(id): UrlPath<u64>) -> Response {
    match app.tickets.get(id).await {
        Ok(Some(ticket)) => Json(ticket.to_json()).into_response(),
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

async fn count_tickets(State(app): State<App>) -> Response {
    match app.tickets.count().await {
        Ok(n) => Json(json!({"count": n})).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

/// `GET /idempotency/stats`: [`Store::stats`] as JSON.
async fn idempotency_stats(State(app): State<App>) -> Response {
    let stats = match blocking(move || Ok(app.store.stats()?)).await {
        Ok(stats) => stats,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    };
    let (r, c) = (stats.records, stats.counters);
    Json(json!({
        "now_ms": stats.now_ms,
        "file_bytes": stats.file_bytes,
        "records": {
            "total": r.total(),
            "live": r.live(),
            "processing": r.processing,
            "lapsed": r.lapsed,
            "succeeded": r.succeeded,
            "failed": r.failed,
            "failed_retryable": r.failed_retryable,
            "expired": r.expired,
            "corrupt": r.corrupt,
        },
        "oldest_processing_age_ms": stats.oldest_processing_age_ms,
        "since_open": {
            "claims": c.claims,
            "acquired": c.acquired,
            "replays": c.replays,
            "in_progress": c.in_progress,
            "fingerprint_mismatches": c.fingerprint_mismatches,
            "business_key_conflicts": c.business_key_conflicts,
            "stale_lease_rejections": c.stale_lease_rejections,
            "takeovers": c.takeovers,
            "evictions": c.evictions,
        },
    }))
    .into_response()
}

/// `GET /metrics`: the store's gauges, refreshed now, and every counter and
/// histogram, in Prometheus text format. When the gauges cannot be read
/// (the store is failing), the failure is logged and the counters are
/// still served, with the gauges as last published: they matter most then.
async fn metrics(
    State(app): State<App>,
    Extension(handle): Extension<PrometheusHandle>,
) -> Response {
    if let Err(e) = blocking(move || Ok(app.store.publish_gauges()?)).await {
        tracing::warn!(error = %e, "publish_gauges failed; serving the counters with stale gauges");
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}

/// The service's routes over an open store and ticket table.
fn router(store: Arc<Store>, tickets: Table, options: &Options) -> Router {
    let idempotency = IdempotencyLayer::new(store.clone())
        .lease(options.lease)
        // One ticket per alert: a second key for the same `alert_id` is
        // answered 409 naming the key that holds it.
        .business_key(|_, body| {
            let v: Value = serde_json::from_slice(body).ok()?;
            v.get("alert_id")?.as_str().map(str::to_owned)
        })
        // Scope keys by route template rather than by concrete path.
        .route(|parts| match parts.extensions.get::<MatchedPath>() {
            Some(path) => path.as_str().to_owned(),
            None => parts.uri.path().to_owned(),
        });
    let mut router = Router::new();
    if let Some(handle) = options.metrics.clone() {
        router = router.route("/metrics", get(metrics).layer(Extension(handle)));
    }
    router
        .route("/tickets", post(create_ticket))
        .route("/tickets/triage", post(triage_ticket))
        .route("/tickets/count", get(count_tickets))
        .route("/tickets/{id}", get(get_ticket))
        .route("/idempotency/stats", get(idempotency_stats))
        .layer(idempotency)
        .with_state(App {
            store,
            tickets,
            work: options.work,
            stream_interval: options.stream_interval,
        })
}

/// Opens the files (or connects to the database), listens on
/// `options.addr`, and serves until `shutdown` completes.
///
/// # Errors
/// When a file cannot be opened, the database cannot be reached, or the
/// address cannot be bound.
pub async fn serve(
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind(options.addr).await?;
    serve_on(listener, options, shutdown).await
}

/// Opens the files (or connects to the database) and serves on `listener`
/// (`options.addr` is not used)
/// until `shutdown` completes.
///
/// # Errors
/// When a file cannot be opened or the database cannot be reached.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BoxError> {
    let config = Config::new().lease(options.lease);
    let (store, tickets) = match &options.postgres {
        None => (
            Store::open_with(&options.store, config)?,
            Table::File(Tickets::open(&options.tickets)?),
        ),
        #[cfg(feature = "postgres")]
        Some(target) => {
            // Creates the schema (and the store's tables) on first use.
            let (url, schema) = (target.url.clone(), target.schema.clone());
            let store = tokio::task::spawn_blocking(move || {
                Store::connect(&url, config.postgres_schema(schema))
            })
            .await??;
            let tickets = PgTickets::connect(target).await?;
            (store, Table::Postgres(Arc::new(tickets)))
        }
        #[cfg(not(feature = "postgres"))]
        Some(target) => {
            let _ = (&target.url, &target.schema);
            return Err(
                "this build has no PostgreSQL support: build with --features postgres".into(),
            );
        }
    };
    let app = router(Arc::new(store), tickets, &options);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
