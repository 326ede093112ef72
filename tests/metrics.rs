//! The store's metrics as an operator scrapes them: the ticket service of
//! `examples/ticket_service` on a real loopback connection, with the
//! Prometheus exporter's recorder installed before the store opens, runs a
//! fixed set of requests whose outcomes are known, and `GET /metrics` must
//! count exactly those (no timeouts, no kills, no lease that lapses).

// This test serves on a listener of its own: `serve` and `Options::addr`
// are the example's.
#[allow(dead_code)]
#[path = "../examples/ticket_service/service.rs"]
mod service;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn send(client: &HttpClient, req: http::Request<Full<Bytes>>) -> (http::StatusCode, Bytes) {
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

fn post(
    addr: std::net::SocketAddr,
    path: &str,
    key: &str,
    body: &'static str,
) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// The samples of a Prometheus text exposition: `name{labels}` → value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn metrics_count_the_known_outcomes_of_a_run() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder of this test binary");

    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let options = service::Options {
        addr,
        store: dir.path().join("idempotency.redb"),
        tickets: dir.path().join("tickets.redb"),
        lease: Duration::from_secs(60),
        work: Duration::ZERO,
        stream_interval: Duration::from_millis(50),
        metrics: Some(handle),
        postgres: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(service::serve_on(listener, options, async {
        let _ = stopped.await;
    }));
    let text = runtime.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
        let ok = http::StatusCode::CREATED;
        // Acquired, then a replay, then the same key with another payload.
        assert_eq!(
            send(&client, post(addr, "/tickets", "k1", r#"{"title":"a"}"#))
                .await
                .0,
            ok
        );
        assert_eq!(
            send(&client, post(addr, "/tickets", "k1", r#"{"title":"a"}"#))
                .await
                .0,
            ok
        );
        assert_eq!(
            send(&client, post(addr, "/tickets", "k1", r#"{"title":"x"}"#))
                .await
                .0,
            422
        );
        // A business key taken by another idempotency key.
        let alert = r#"{"title":"b","alert_id":"A-1"}"#;
        assert_eq!(
            send(&client, post(addr, "/tickets", "k2", alert)).await.0,
            ok
        );
        assert_eq!(
            send(&client, post(addr, "/tickets", "k3", alert)).await.0,
            409
        );
        // A retry while the first request streams: in progress; then a replay.
        let triage = r#"{"title":"c"}"#;
        let mut first = client
            .request(post(addr, "/tickets/triage", "k4", triage))
            .await
            .unwrap();
        let event = first.body_mut().frame().await.unwrap().unwrap();
        assert!(event.is_data());
        assert_eq!(
            send(&client, post(addr, "/tickets/triage", "k4", triage))
                .await
                .0,
            409
        );
        first.into_body().collect().await.unwrap();
        assert_eq!(
            send(&client, post(addr, "/tickets/triage", "k4", triage))
                .await
                .0,
            ok
        );

        let metrics = http::Request::get(format!("http://{addr}/metrics"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (status, body) = send(&client, metrics).await;
        assert_eq!(status, http::StatusCode::OK);
        String::from_utf8(body.to_vec()).unwrap()
    });
    let _ = stop.send(());
    runtime.block_on(server).unwrap().unwrap();

    let got = samples(&text);
    let value = |name: &str| {
        got.get(name)
            .copied()
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    let claims = |outcome: &str| value(&format!("idemstore_claims_total{{outcome=\"{outcome}\"}}"));
    assert_eq!(claims("acquired"), 3.0);
    assert_eq!(claims("replay"), 2.0);
    assert_eq!(claims("fingerprint_mismatch"), 1.0);
    assert_eq!(claims("business_key_conflict"), 1.0);
    assert_eq!(claims("in_progress"), 1.0);
    assert_eq!(claims("takeover"), 0.0);
    assert_eq!(value("idemstore_stale_lease_rejections_total"), 0.0);
    assert_eq!(value("idemstore_evictions_total"), 0.0);
    assert_eq!(value("idemstore_records{state=\"succeeded\"}"), 3.0);
    assert_eq!(value("idemstore_records{state=\"processing\"}"), 0.0);
    assert_eq!(value("idemstore_in_progress_lapsed_records"), 0.0);
    assert_eq!(value("idemstore_oldest_in_progress_age_seconds"), 0.0);
    // Three acquisitions and three completions were made durable, in at
    // least one group commit each way (more with lease extensions).
    assert!(value("idemstore_commit_batch_size_sum") >= 6.0, "{text}");
    assert!(value("idemstore_commit_batch_size_count") >= 1.0, "{text}");
    assert!(
        value("idemstore_commit_duration_seconds_count") >= 1.0,
        "{text}"
    );
    // No label carries a key, an id or a scope.
    for name in got.keys() {
        assert!(!name.contains("k1") && !name.contains("/tickets"), "{name}");
    }
}
