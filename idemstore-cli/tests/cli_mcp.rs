//! `idemstore mcp-proxy` in front of a real stdio MCP server (the
//! library's `mcp_append_server` example, whose `append` tool writes a
//! line to a file), driven by the `rmcp` client over the proxy's stdin and
//! stdout, and over streamable HTTP (`--listen`).
//!
//! The tool holds a call open on two FIFOs: it writes to `started` once its
//! line is written and reads `release` before it answers, so a test cuts
//! the connection or kills the proxy exactly while a call is in progress.
//! The lease lapsing is shown by running a proxy under libfaketime two
//! hours ahead, not by waiting. Linux only: libfaketime, `/proc`, and
//! FIFOs opened read-write.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use idemstore::Key;
use idemstore::mcp::{IN_DOUBT, IN_PROGRESS, KEY_CONFLICT, announces_idempotency, attach_key};
use rmcp::model::{CallToolRequestParams, CallToolResult, ErrorData};
use rmcp::service::{RoleClient, RunningService, ServiceError, ServiceExt};
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};

/// The example server, built for this test's profile and target directory.
fn append_server() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/cli_mcp-<hash>
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let target_dir = profile_dir.parent().unwrap();
    // The profile is named by its directory, except `dev` (`debug`).
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build.args(["build", "--quiet", "--example", "mcp_append_server"]);
    // The variables cargo sets for this test (the package's name, manifest
    // and binaries) would reach build scripts that watch the environment
    // and make cargo rebuild them, and then rebuild them again for the
    // next `cargo test`.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_the_test = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"]
            .iter()
            .any(|p| name.starts_with(p))
            || [
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref());
        if set_for_the_test {
            build.env_remove(name.as_ref());
        }
    }
    // Under `cargo test --all-features` (as .ci/run runs it), ask for the
    // same packages and features, so that cargo finds the example it has
    // just built fresh instead of compiling the library again with another
    // feature set (about two minutes on two cores). Any other way the test
    // was built asks for the feature the example needs; either builds the
    // current source.
    if cfg!(all(feature = "postgres", feature = "mcp")) {
        build.args(["--all-features", "-p", "idemstore", "-p", "idemstore-cli"]);
    } else {
        build.args(["--features", "mcp"]);
    }
    build
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    build.args(["--profile", &profile]);
    assert!(
        build.status().unwrap().success(),
        "building mcp_append_server failed"
    );
    profile_dir.join("examples").join("mcp_append_server")
}

/// Where libfaketime's preload library is (Debian's paths).
fn faketime_lib() -> String {
    for dir in [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ] {
        let lib = format!("{dir}/libfaketime.so.1");
        if Path::new(&lib).exists() {
            return lib;
        }
    }
    panic!("libfaketime.so.1 not found: install faketime (.ci/run does)");
}

struct Setup {
    dir: tempfile::TempDir,
    server: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        Setup {
            dir: tempfile::tempdir().unwrap(),
            server: append_server(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("lines.txt"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn fifo(&self, name: &str) -> PathBuf {
        let path = self.path(name);
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo failed");
        path
    }

    /// `idemstore mcp-proxy --store DIR/STORE OPTIONS -- mcp_append_server
    /// DIR/lines.txt`, killed when dropped.
    fn proxy_command(&self, store: &str, options: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idemstore"));
        command
            .arg("mcp-proxy")
            .arg("--store")
            .arg(self.path(store))
            .args(options)
            .arg("--")
            .arg(&self.server)
            .arg(self.path("lines.txt"))
            .kill_on_drop(true);
        command
    }

    /// Starts a proxy (`ahead`: its wall clock two hours ahead) and
    /// connects the rmcp client to its stdin and stdout.
    async fn proxy(&self, ahead: bool) -> (Child, RunningService<RoleClient, ()>) {
        self.proxy_with(ahead, &[]).await
    }

    /// [`Setup::proxy`] with more options.
    async fn proxy_with(
        &self,
        ahead: bool,
        options: &[&str],
    ) -> (Child, RunningService<RoleClient, ()>) {
        let mut all = vec!["--lease", "1h"];
        all.extend_from_slice(options);
        let mut command = self.proxy_command("proxy.redb", &all);
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if ahead {
            command
                .env("LD_PRELOAD", faketime_lib())
                .env("FAKETIME", "+2h")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let mut child = command.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let client = ().serve((stdout, stdin)).await.unwrap();
        (child, client)
    }
}

impl Setup {
    /// Starts a proxy serving streamable HTTP on a port the system picks
    /// (`--listen 127.0.0.1:0`), and returns it with its URL, read from the
    /// line it prints on stderr once it listens. `--wait 1h`: a call that
    /// finds its key in progress waits for the outcome and replays it.
    async fn http_proxy(&self) -> (Child, String) {
        let options = ["--lease", "1h", "--wait", "1h", "--listen", "127.0.0.1:0"];
        let mut command = self.proxy_command("http.redb", &options);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut proxy = command.spawn().unwrap();
        let mut stderr = BufReader::new(proxy.stderr.take().unwrap()).lines();
        let url = loop {
            let line = stderr
                .next_line()
                .await
                .unwrap()
                .expect("the proxy ended before it listened");
            eprintln!("{line}");
            if let Some(url) = line.strip_prefix("idemstore mcp-proxy: listening on ") {
                break url.to_string();
            }
        };
        // Keep reading its stderr (its server's too), so neither blocks on
        // a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                eprintln!("{line}");
            }
        });
        (proxy, url)
    }
}

/// A new rmcp client over streamable HTTP: a new connection and session.
async fn http_client(url: &str) -> RunningService<RoleClient, ()> {
    ().serve(StreamableHttpClientTransport::from_uri(url.to_string()))
        .await
        .unwrap()
}

fn append(line: &str, key: Option<&str>, hold: Option<(&Path, &Path)>) -> CallToolRequestParams {
    let mut arguments = json!({ "line": line });
    if let Some((started, release)) = hold {
        arguments["started"] = json!(started);
        arguments["release"] = json!(release);
    }
    let params = CallToolRequestParams::new("append")
        .with_arguments(arguments.as_object().cloned().unwrap());
    match key {
        Some(key) => attach_key(params, &Key::new("agent", key).unwrap()),
        None => params,
    }
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

fn rpc_error(error: ServiceError) -> ErrorData {
    match error {
        ServiceError::McpError(e) => e,
        other => panic!("expected a JSON-RPC error, got {other}"),
    }
}

/// Hang guard only: how long a test waits for the held tool to start or
/// to wait for its release (the proxy or its server may have died first).
const HELD_TOOL_WAIT: Duration = Duration::from_secs(60);

/// Waits until the held tool has written its line. The FIFO is opened
/// read-write, so the open never waits for the tool and the read waits
/// on the runtime, bounded: a blocking open on a runtime thread, if the
/// tool never starts, held the runtime's shutdown (and the test) for ever.
async fn wait_started(started: &Path) {
    let mut fifo = pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(started)
        .unwrap();
    let mut byte = [0u8; 1];
    tokio::time::timeout(HELD_TOOL_WAIT, fifo.read_exact(&mut byte))
        .await
        .expect("the held tool never started")
        .unwrap();
    assert_eq!(&byte, b"1");
}

/// Lets the held tool answer: opens its FIFO for writing once the tool has
/// it open for reading (a non-blocking open is refused with ENXIO until
/// then), and closes it. Bounded, as [`wait_started`].
async fn release(release: &Path) {
    const ENXIO: i32 = 6;
    let deadline = tokio::time::Instant::now() + HELD_TOOL_WAIT;
    loop {
        match pipe::OpenOptions::new().open_sender(release) {
            Ok(sender) => return drop(sender),
            Err(e) if e.raw_os_error() == Some(ENXIO) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the held tool never waited for its release"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("opening the release FIFO: {e}"),
        }
    }
}

/// Sends `call` (a held call) on `client`, waits until the tool has written
/// its line, then cuts the connection (drops the client): the answer is
/// lost.
async fn cut_while_running(
    client: RunningService<RoleClient, ()>,
    call: &CallToolRequestParams,
    started: &Path,
) {
    let peer = client.peer().clone();
    let sent = tokio::spawn({
        let call = call.clone();
        async move { peer.call_tool(call).await }
    });
    wait_started(started).await;
    drop(client);
    assert!(sent.await.unwrap().is_err(), "the answer is lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_cut_connection_runs_the_tool_once() {
    let s = Setup::new();
    let (started, released) = (s.fifo("started"), s.fifo("release"));
    let (mut proxy, client) = s.proxy(false).await;
    assert!(announces_idempotency(
        &client.peer_info().unwrap().capabilities
    ));

    let held = append("hello", Some("task-1:call-1"), Some((&started, &released)));
    // The connection is cut: the proxy's stdin closes.
    cut_while_running(client, &held, &started).await;
    release(&released).await;
    // The proxy lets the call finish and record before it exits.
    assert!(proxy.wait().await.unwrap().success());

    let (_proxy, client) = s.proxy(false).await;
    let retry = client.call_tool(held.clone()).await.unwrap();
    assert_eq!(text_of(&retry), "appended line 1");
    assert_eq!(client.call_tool(held).await.unwrap(), retry);
    assert_eq!(s.lines(), vec!["hello"]);

    // A call without a key passes through unchanged: it runs every time.
    client.call_tool(append("plain", None, None)).await.unwrap();
    client.call_tool(append("plain", None, None)).await.unwrap();
    assert_eq!(s.lines(), vec!["hello", "plain", "plain"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_during_a_call_answers_in_progress_then_in_doubt() {
    let s = Setup::new();
    let (started, released) = (s.fifo("started"), s.fifo("release"));
    let (mut proxy, client) = s.proxy(false).await;
    let held = append("charge", Some("task-2:call-1"), Some((&started, &released)));
    let peer = client.peer().clone();
    let sent = tokio::spawn({
        let held = held.clone();
        async move { peer.call_tool(held).await }
    });
    wait_started(&started).await;
    proxy.kill().await.unwrap(); // SIGKILL during the call
    assert!(sent.await.unwrap().is_err());

    // Restarted within the lease: the key is in progress.
    let (mut proxy, client) = s.proxy(false).await;
    let busy = rpc_error(client.call_tool(held.clone()).await.unwrap_err());
    assert_eq!(busy.code.0, IN_PROGRESS);
    assert!(busy.data.unwrap()["retryAfterMs"].as_u64().unwrap() > 1000);
    drop(client); // the proxy exits and lets go of the store file
    assert!(proxy.wait().await.unwrap().success());

    // Restarted after the lease (its clock two hours on): the holder left
    // no outcome, so the call is in doubt and is not run again.
    let (_proxy, client) = s.proxy(true).await;
    let doubt = rpc_error(client.call_tool(held.clone()).await.unwrap_err());
    assert_eq!(doubt.code.0, IN_DOUBT);
    assert_eq!(doubt.data.unwrap()["idempotencyKey"], "task-2:call-1");
    assert_eq!(s.lines(), vec!["charge"], "the tool ran once");

    // Let the orphaned server of the killed proxy finish.
    release(&released).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_streamable_http_a_retry_in_a_new_session_runs_the_tool_once() {
    let s = Setup::new();
    let (started, released) = (s.fifo("started"), s.fifo("release"));
    let (mut proxy, url) = s.http_proxy().await;
    let client = http_client(&url).await;
    assert!(announces_idempotency(
        &client.peer_info().unwrap().capabilities
    ));

    let held = append("hello", Some("task-3:call-1"), Some((&started, &released)));
    cut_while_running(client, &held, &started).await;

    // A new client, so a new connection and a new session: the retry finds
    // the call running (it waits for the outcome) or finished (replayed);
    // either way the tool does not run again.
    let client = http_client(&url).await;
    let retry = tokio::spawn({
        let peer = client.peer().clone();
        let held = held.clone();
        async move { peer.call_tool(held).await }
    });
    release(&released).await;
    let retry = retry.await.unwrap().unwrap();
    assert_eq!(text_of(&retry), "appended line 1");
    assert_eq!(client.call_tool(held).await.unwrap(), retry);
    assert_eq!(s.lines(), vec!["hello"]);

    // The same key with other arguments: the conflict error; nothing runs.
    let other = rpc_error(
        client
            .call_tool(append("goodbye", Some("task-3:call-1"), None))
            .await
            .unwrap_err(),
    );
    assert_eq!(other.code.0, KEY_CONFLICT);
    assert_eq!(other.data.unwrap()["idempotencyKey"], "task-3:call-1");
    assert_eq!(s.lines(), vec!["hello"]);

    // A call without a key passes through.
    client.call_tool(append("plain", None, None)).await.unwrap();
    assert_eq!(s.lines(), vec!["hello", "plain"]);

    // SIGTERM ends the proxy cleanly.
    drop(client);
    let term = std::process::Command::new("kill")
        .args(["-TERM", &proxy.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(proxy.wait().await.unwrap().success());
}

/// The MCP server behind the proxy dies during a call, after its tool
/// wrote its line: the proxy cannot tell whether the tool acted, so it
/// records nothing (and ends with its server: its client sees the call
/// cut, or answered [`IN_DOUBT`]), and a retry through a new proxy finds
/// the key in progress (then in doubt once the lease lapses), not free:
/// the tool does not run again. (A lost answer could be recorded as a
/// JSON-RPC error, a retryable failure, and the retry ran the tool a second
/// time; and the proxy never ended while its client kept stdin open.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_dies_during_a_call_leaves_the_key_in_doubt() {
    let s = Setup::new();
    let (started, released) = (s.fifo("started"), s.fifo("release"));
    let (mut proxy, client) = s.proxy(false).await;
    let held = append("refund", Some("task-4:call-1"), Some((&started, &released)));
    let peer = client.peer().clone();
    let sent = tokio::spawn({
        let held = held.clone();
        async move { peer.call_tool(held).await }
    });
    wait_started(&started).await;
    // SIGKILL to the proxy's child, the MCP server, mid-call.
    let pid = proxy.id().unwrap();
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let server = children
        .split_whitespace()
        .next()
        .expect("the proxy's server");
    let kill = std::process::Command::new("kill")
        .args(["-KILL", server])
        .status()
        .unwrap();
    assert!(kill.success());
    // The proxy ends with its server (whether it answered the call in
    // flight IN_DOUBT first or not), and records nothing for the call.
    let answer = tokio::time::timeout(Duration::from_secs(60), sent)
        .await
        .expect("no answer and no end of the proxy after its server died");
    match answer.unwrap() {
        Err(ServiceError::McpError(lost)) => assert_eq!(lost.code.0, IN_DOUBT, "{lost:?}"),
        Err(_closed) => {}
        Ok(answer) => panic!("an answer from a dead server: {answer:?}"),
    }
    drop(client);
    let ended = tokio::time::timeout(Duration::from_secs(60), proxy.wait()).await;
    assert!(
        ended
            .expect("the proxy did not end with its server")
            .unwrap()
            .success()
    );

    retry_is_in_progress(&s, &held, "refund").await;
}

/// Retries `held` through a new proxy: the key is in progress, and the
/// tool ran once, writing `line`. A run of the tool would wait on its
/// FIFO: the bound fails the test instead of hanging it.
async fn retry_is_in_progress(s: &Setup, held: &CallToolRequestParams, line: &str) {
    let (_proxy, client) = s.proxy(false).await;
    let retry = tokio::time::timeout(Duration::from_secs(60), client.call_tool(held.clone()))
        .await
        .expect("the retry ran the tool again (it waits on its FIFO)");
    let busy = rpc_error(retry.unwrap_err());
    assert_eq!(busy.code.0, IN_PROGRESS, "{busy:?}");
    assert_eq!(s.lines(), vec![line], "the tool ran once");
}

/// A call the server does not answer within `--call-timeout` (here a tool
/// held on its FIFO; as well a server whose answer rmcp drops, being
/// neither a result nor an error) is answered IN_DOUBT and cancelled at
/// the server, and its key stays in progress: the retry does not run the
/// tool again. The proxy then ends once its client leaves, instead of
/// waiting for that answer for ever with the store held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_not_answered_within_the_call_timeout_is_in_doubt() {
    let s = Setup::new();
    let (started, released) = (s.fifo("started"), s.fifo("release"));
    let (mut proxy, client) = s.proxy_with(false, &["--call-timeout", "5s"]).await;
    let held = append("charge", Some("task-5:call-1"), Some((&started, &released)));
    let peer = client.peer().clone();
    let sent = tokio::spawn({
        let held = held.clone();
        async move { peer.call_tool(held).await }
    });
    wait_started(&started).await;
    let answer = tokio::time::timeout(Duration::from_secs(60), sent)
        .await
        .expect("no answer 60 s after the call was sent: the proxy waits for ever");
    let lost = rpc_error(answer.unwrap().unwrap_err());
    assert_eq!(lost.code.0, IN_DOUBT, "{lost:?}");
    drop(client);
    let ended = tokio::time::timeout(Duration::from_secs(60), proxy.wait()).await;
    assert!(
        ended
            .expect("the proxy did not end once its client left")
            .unwrap()
            .success()
    );
    // Its server, still running the tool, was stopped with it.
    let pid = proxy.id();
    assert!(pid.is_none(), "the proxy was reaped");
    let lines = s.path("lines.txt").to_string_lossy().into_owned();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| std::fs::read(entry.ok()?.path().join("cmdline")).ok())
        .map(|cmdline| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        .filter(|cmdline| cmdline.contains(&lines))
        .collect();
    assert!(left.is_empty(), "the proxy's server outlived it: {left:?}");

    retry_is_in_progress(&s, &held, "charge").await;
}

/// `--max-value-bytes` sets the store's limits: under it, an answer goes
/// back but is not recorded, so a retry finds the key in progress (the
/// tool does not run again); the flag did not exist, and a large answer
/// could not be recorded at all (over the library's 1 MiB default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_value_limit_is_the_flags() {
    let s = Setup::new();
    let (mut proxy, client) = s.proxy_with(false, &["--max-value-bytes", "16"]).await;
    let call = append("big", Some("task-5:call-1"), None);
    let answer = client.call_tool(call.clone()).await.unwrap();
    assert_eq!(text_of(&answer), "appended line 1");
    drop(client);
    assert!(proxy.wait().await.unwrap().success());

    let (_proxy, client) = s.proxy(false).await;
    let busy = rpc_error(client.call_tool(call).await.unwrap_err());
    assert_eq!(busy.code.0, IN_PROGRESS, "{busy:?}");
    assert_eq!(s.lines(), vec!["big"], "the tool ran once");
}

/// `--lease` under 100 ms (too short to renew by durable writes) is the
/// flag's error, before the proxy starts its server or opens the store.
#[tokio::test]
async fn a_lease_too_short_to_renew_is_refused_at_the_flag() {
    let s = Setup::new();
    let out = s
        .proxy_command("short.redb", &["--lease", "50ms"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a lease is 100ms to"), "{err}");
    assert!(!s.path("short.redb").exists());
}
