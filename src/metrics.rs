//! What a store publishes through the [`metrics`](https://docs.rs/metrics)
//! facade (cargo feature `metrics`): the names, units and labels an
//! operator scrapes, with a Prometheus or OpenTelemetry exporter installed
//! by the application.
//!
//! Counter and histogram handles are registered once, when the store is
//! opened, with the recorder installed at that moment: install the
//! exporter's recorder (for example
//! `metrics_exporter_prometheus::PrometheusBuilder::install_recorder`)
//! **before** opening the store, or its numbers go nowhere. The gauges are
//! set by [`Store::publish_gauges`](crate::Store::publish_gauges) in the
//! recorder installed when it is called (normally the same, global one).
//! No label carries a key, an id or a scope (scopes hold tenants: their
//! number has no bound); the only labels are the fixed sets below.
//!
//! | name | kind | unit | labels | what |
//! |---|---|---|---|---|
//! | `idemstore_claims_total` | counter | claims | `outcome` = `acquired`, `takeover`, `replay`, `in_progress`, `fingerprint_mismatch`, `business_key_conflict` | every claim answered, once, by its outcome (a `takeover` is an acquisition of a lapsed lease) |
//! | `idemstore_stale_lease_rejections_total` | counter | writes | – | complete, fail, release, extend, recovery point or resolve refused because the lease was no longer current |
//! | `idemstore_evictions_total` | counter | records | – | records removed after retention |
//! | `idemstore_commit_duration_seconds` | histogram | seconds | – | how long one group commit took to become durable (the log's fsync; on PostgreSQL the batch's statements or transaction), for each commit `idemstore_commit_batch_size` observes |
//! | `idemstore_commit_batch_size` | histogram | requests | – | how many requests' writes one group commit made durable: acquisitions, completions, failures, releases, extensions, recovery points, resolves and amends, imported records (each transition of `claim_many` or an import batch counts); not an answer that wrote nothing (a replay, "in progress", a refusal), nor one whose commit's answer was lost (`OutcomeUnknown`); a commit that made no request's write durable (evictions only, a checkpoint) is not observed. With `Durability::Buffered`, a write counts in the fsync that makes it durable, after its answer |
//! | `idemstore_records` | gauge | records | `state` = `processing`, `succeeded`, `failed`, `failed_retryable`, `expired`, `corrupt` | stored records by state, set by [`Store::publish_gauges`](crate::Store::publish_gauges) |
//! | `idemstore_in_progress_lapsed_records` | gauge | records | – | Processing records whose lease has lapsed (abandoned work), same |
//! | `idemstore_oldest_in_progress_age_seconds` | gauge | seconds | – | age of the oldest Processing record, measured from its key's **first** acquisition (`created_ms`, kept when the key is taken over or re-acquired after a retryable failure), as [`Stats::oldest_processing_age_ms`](crate::Stats::oldest_processing_age_ms); 0 when none; same |
//!
//! The counters count the same events as [`Counters`](crate::Counters), at
//! the same moment (a write once it is durable), split differently:
//! `outcome="acquired"` counts fresh acquisitions *excluding* takeovers, so
//! `acquired + takeover` equals [`Counters::acquired`](crate::Counters::acquired)
//! and `takeover` equals `Counters::takeovers`; every other outcome and
//! counter equals its `Counters` field (`replay` = `replays`, `in_progress`,
//! `fingerprint_mismatch`, `business_key_conflict`,
//! `stale_lease_rejections_total`, `evictions_total`), and the sum over
//! outcomes equals `Counters::claims`. But `Counters` start at zero with
//! each opened store, while the metrics series belong to the process: they
//! do not reset when a store is closed and reopened, two stores open in one
//! process add into the same series, and one store's `publish_gauges`
//! overwrites the other's gauges. Run one store per process, or read the
//! series as sums over the stores (and publish the gauges of one only).
//! `tests/metrics_counters.rs` checks every counter and gauge against
//! [`Store::stats`](crate::Store::stats).
//!
//! The gauges come from [`Store::stats`](crate::Store::stats) (kept counts
//! on the file engine, a scan on PostgreSQL): call `publish_gauges` when
//! the exporter is scraped or on a timer, not per request.
//!
//! With `metrics-exporter-prometheus`, the two histograms are rendered as
//! Prometheus *summaries* (quantiles) unless buckets are configured, for
//! example `PrometheusBuilder::new().set_buckets(&[...])` (or
//! `set_buckets_for_metric` per name). Its recorder keeps histogram samples
//! until they are drained: `PrometheusBuilder::install` and `build` spawn an
//! upkeep task that does it; with `install_recorder` or `build_recorder`,
//! an application that never scrapes (or seldom does) must call
//! `PrometheusHandle::run_upkeep` on a timer, or memory grows.
//!
//! The alerts operators of idempotency layers use, as Prometheus rules
//! (README, "Metrics"): duplicates prevented and the hit rate from
//! `idemstore_claims_total`, work stuck in progress from
//! `idemstore_records{state="processing"}` and
//! `idemstore_oldest_in_progress_age_seconds`, and takeovers (work that may
//! have run twice unless the handler asked first) from
//! `idemstore_claims_total{outcome="takeover"}`. That outcome counts only
//! takeovers of a lapsed lease; a re-acquisition after a retryable failure,
//! which [`Lease::is_takeover`](crate::Lease::is_takeover) also flags,
//! counts as `acquired`.

use std::time::Duration;

use metrics::{Counter, Histogram};

use crate::stats::Stats;

/// `idemstore_claims_total`, labelled by `outcome`.
pub const CLAIMS_TOTAL: &str = "idemstore_claims_total";
/// `idemstore_stale_lease_rejections_total`.
pub const STALE_LEASE_REJECTIONS_TOTAL: &str = "idemstore_stale_lease_rejections_total";
/// `idemstore_evictions_total`.
pub const EVICTIONS_TOTAL: &str = "idemstore_evictions_total";
/// `idemstore_commit_duration_seconds`.
pub const COMMIT_DURATION_SECONDS: &str = "idemstore_commit_duration_seconds";
/// `idemstore_commit_batch_size`.
pub const COMMIT_BATCH_SIZE: &str = "idemstore_commit_batch_size";
/// `idemstore_records`, labelled by `state`.
pub const RECORDS: &str = "idemstore_records";
/// `idemstore_in_progress_lapsed_records`.
pub const IN_PROGRESS_LAPSED_RECORDS: &str = "idemstore_in_progress_lapsed_records";
/// `idemstore_oldest_in_progress_age_seconds`.
pub const OLDEST_IN_PROGRESS_AGE_SECONDS: &str = "idemstore_oldest_in_progress_age_seconds";

/// The handles of one store, registered once at open.
#[derive(Debug)]
pub(crate) struct Handles {
    pub(crate) acquired: Counter,
    pub(crate) takeover: Counter,
    pub(crate) replay: Counter,
    pub(crate) in_progress: Counter,
    pub(crate) fingerprint_mismatch: Counter,
    pub(crate) business_key_conflict: Counter,
    pub(crate) stale_lease: Counter,
    pub(crate) evictions: Counter,
    commit_duration: Histogram,
    batch_size: Histogram,
}

impl Handles {
    /// Registers every counter and histogram with the recorder installed
    /// now, and describes them and the gauges.
    pub(crate) fn register() -> Handles {
        metrics::describe_counter!(
            CLAIMS_TOTAL,
            metrics::Unit::Count,
            "Claims answered, by outcome"
        );
        metrics::describe_counter!(
            STALE_LEASE_REJECTIONS_TOTAL,
            metrics::Unit::Count,
            "Writes refused because the lease was no longer current"
        );
        metrics::describe_counter!(
            EVICTIONS_TOTAL,
            metrics::Unit::Count,
            "Records removed after retention"
        );
        metrics::describe_histogram!(
            COMMIT_DURATION_SECONDS,
            metrics::Unit::Seconds,
            "Time for one group commit to become durable"
        );
        metrics::describe_histogram!(
            COMMIT_BATCH_SIZE,
            metrics::Unit::Count,
            "Requests made durable by one group commit"
        );
        metrics::describe_gauge!(
            RECORDS,
            metrics::Unit::Count,
            "Stored records by state, set by Store::publish_gauges"
        );
        metrics::describe_gauge!(
            IN_PROGRESS_LAPSED_RECORDS,
            metrics::Unit::Count,
            "Processing records whose lease has lapsed, set by Store::publish_gauges"
        );
        metrics::describe_gauge!(
            OLDEST_IN_PROGRESS_AGE_SECONDS,
            metrics::Unit::Seconds,
            "Age of the oldest Processing record since its key was first acquired, set by Store::publish_gauges"
        );
        let claims = |outcome: &'static str| metrics::counter!(CLAIMS_TOTAL, "outcome" => outcome);
        Handles {
            acquired: claims("acquired"),
            takeover: claims("takeover"),
            replay: claims("replay"),
            in_progress: claims("in_progress"),
            fingerprint_mismatch: claims("fingerprint_mismatch"),
            business_key_conflict: claims("business_key_conflict"),
            stale_lease: metrics::counter!(STALE_LEASE_REJECTIONS_TOTAL),
            evictions: metrics::counter!(EVICTIONS_TOTAL),
            commit_duration: metrics::histogram!(COMMIT_DURATION_SECONDS),
            batch_size: metrics::histogram!(COMMIT_BATCH_SIZE),
        }
    }

    /// One group commit of `requests` requests took `took` to be durable.
    pub(crate) fn group_commit(&self, took: Duration, requests: usize) {
        self.commit_duration.record(took.as_secs_f64());
        #[allow(clippy::cast_precision_loss)] // a batch is far below 2^52
        self.batch_size.record(requests as f64);
    }
}

/// Sets the gauges from `stats`.
pub(crate) fn set_gauges(stats: &Stats) {
    let r = &stats.records;
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    let set = |state: &'static str, n: u64| {
        metrics::gauge!(RECORDS, "state" => state).set(n as f64);
    };
    set("processing", r.processing);
    set("succeeded", r.succeeded);
    set("failed", r.failed);
    set("failed_retryable", r.failed_retryable);
    set("expired", r.expired);
    set("corrupt", r.corrupt);
    #[allow(clippy::cast_precision_loss)]
    metrics::gauge!(IN_PROGRESS_LAPSED_RECORDS).set(r.lapsed as f64);
    let age = Duration::from_millis(stats.oldest_processing_age_ms.unwrap_or(0));
    metrics::gauge!(OLDEST_IN_PROGRESS_AGE_SECONDS).set(age.as_secs_f64());
}
