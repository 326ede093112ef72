//! The ticket service example (`examples/ticket_service`) as a child
//! process of an HTTP test, and a real HTTP client to call it: shared by
//! `tests/http_e2e.rs` and `tests/fleet_http.rs`. A test crate that uses
//! it declares `mod common;` and the example's `mod service;` at its root.
#![allow(dead_code)] // Each test crate uses a different part of this module.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::{common, service};

/// In the child: serve `options` on a runtime of two threads, report READY
/// once the port accepts connections, and serve until killed.
pub fn serve(options: service::Options) -> ! {
    let addr = options.addr;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let serving = runtime.spawn(service::serve(options, std::future::pending()));
    let start = Instant::now();
    while std::net::TcpStream::connect(addr).is_err() {
        if serving.is_finished() {
            let result = runtime.block_on(serving).expect("serve task");
            panic!("the ticket service stopped: {result:?}");
        }
        assert!(
            start.elapsed() < common::CHILD_REPORT_TIMEOUT,
            "the ticket service did not listen on {addr}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The runtime's threads serve; this thread waits to be killed.
    common::ready_and_wait()
}

/// The ticket service as a child process of the test `test`.
pub struct Server {
    pub test: &'static str,
    pub vars: Vec<(&'static str, String)>,
    pub child: Option<common::ChildProc>,
}

impl Server {
    /// Starts the child and waits until it listens.
    pub fn start(&mut self) {
        let mut child = common::spawn_child(self.test, &self.vars);
        child.wait_ready();
        self.child = Some(child);
    }

    /// SIGKILL, then reap, so the file locks are gone before a restart.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.assert_running();
            child.kill();
        }
    }
}

/// The HTTP client of the tests (hyper).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Sends `req` and reads the whole answer, within `timeout`.
pub async fn request(
    client: &HttpClient,
    req: http::Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<(http::StatusCode, http::HeaderMap, Bytes), String> {
    let exchange = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| e.to_string())?;
        Ok((parts.status, parts.headers, bytes.to_bytes()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| "client timeout".to_owned())?
}
