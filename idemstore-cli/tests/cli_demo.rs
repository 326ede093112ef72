//! `idemstore demo`, run as a user runs it: the built binary in a fresh
//! working directory.
//!
//! The runs are small (4 agents x 10 intents, 2 ms service latency) so the
//! whole file takes seconds. Why the naive phase is certain to duplicate:
//! with `--drop-rate 0.5 --late-rate 0.1 --crash-rate 0.05`, an intent's
//! first attempt is lost, late or crashed with probability 0.65, and in each
//! case the service created a ticket (late requests are served and counted
//! before the phase ends) while the agent retries until a further attempt
//! is answered, which creates a second ticket. An intent escapes a
//! duplicate only when its first attempt is answered, p = 0.35, so all 40
//! escape with p = 0.35^40 < 1e-18. With a fixed `--seed` each agent's
//! fates are drawn from the same sequence on every run besides.
//!
//! The lease (1 s) is hundreds of times the work (1-3 ms), so a holder is
//! only taken over after a simulated crash, never while it works, even on a
//! loaded machine.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn idemstore(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("the idemstore binary runs")
}

const SMALL: &[&str] = &[
    "demo",
    "--agents",
    "4",
    "--intents",
    "10",
    "--seed",
    "7",
    "--drop-rate",
    "0.5",
    "--late-rate",
    "0.1",
    "--crash-rate",
    "0.05",
    "--latency-ms",
    "2",
    "--timeout-ms",
    "40",
    "--lease-ms",
    "1000",
    "--max-attempts",
    "1000",
];

fn small_run(dir: &Path, extra: &[&str]) -> Output {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    idemstore(dir, &args)
}

fn json_run(dir: &Path, run_id: &str) -> Value {
    let out = small_run(dir, &["--run-id", run_id, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

fn n(v: &Value, phase: &str, field: &str) -> u64 {
    v[phase][field]
        .as_u64()
        .unwrap_or_else(|| panic!("{phase}.{field} missing in {v}"))
}

#[test]
fn idemstore_phase_creates_no_duplicate_and_a_second_run_replays_everything() {
    let dir = tempfile::tempdir().unwrap();
    let intents = 40;

    let first = json_run(dir.path(), "test-run");
    assert!(
        dir.path().join("idemstore-demo.redb").exists(),
        "the store is ./idemstore-demo.redb in the working directory"
    );
    for phase in ["naive", "idemstore"] {
        assert_eq!(n(&first, phase, "intents"), intents);
        assert_eq!(n(&first, phase, "gave_up"), 0, "{first}");
        // Duplicates are counted as tickets minus intents that got one.
        assert_eq!(
            n(&first, phase, "duplicates"),
            n(&first, phase, "tickets_created") - intents,
            "{first}"
        );
    }
    assert!(n(&first, "naive", "duplicates") > 0, "{first}");
    assert_eq!(n(&first, "naive", "replays"), 0, "{first}");
    assert_eq!(n(&first, "idemstore", "duplicates"), 0, "{first}");
    assert_eq!(n(&first, "idemstore", "tickets_created"), intents);
    // Half the responses are lost: their retries are answered by replay.
    assert!(n(&first, "idemstore", "replays") > 0, "{first}");
    // A takeover follows a crashed worker, whose ticket it finds by key.
    assert_eq!(
        n(&first, "idemstore", "takeovers"),
        n(&first, "idemstore", "found_by_lookup"),
        "{first}"
    );
    assert_eq!(first["duplicates"]["idemstore"], 0);

    // Same keys, same file, new process: the file remembers.
    let second = json_run(dir.path(), "test-run");
    assert_eq!(n(&second, "idemstore", "tickets_created"), 0, "{second}");
    assert_eq!(
        n(&second, "idemstore", "replayed_intents"),
        intents,
        "{second}"
    );
    assert!(n(&second, "idemstore", "replays") >= intents, "{second}");
    assert_eq!(n(&second, "idemstore", "duplicates"), 0, "{second}");
    assert!(n(&second, "naive", "duplicates") > 0, "{second}");
}

#[test]
fn the_table_ends_with_the_duplicates_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = small_run(dir.path(), &["--file", "store.redb"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        dir.path().join("store.redb").exists(),
        "--file names the store"
    );
    let last = stdout.lines().last().expect("the demo prints a table");
    let (naive, idem) = last
        .strip_prefix("duplicates: naive=")
        .and_then(|rest| rest.split_once(" idemstore="))
        .unwrap_or_else(|| panic!("last line is {last:?}"));
    let naive: u64 = naive.parse().unwrap();
    assert!(naive > 0, "{stdout}");
    assert_eq!(idem, "0", "{stdout}");
    assert!(stdout.contains("tickets created"), "{stdout}");
}

/// Every figure of the table has a legend line, the bracketed takeover
/// figure is explained, and so is the difference in attempts.
#[test]
fn every_row_of_the_table_has_a_legend_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = small_run(dir.path(), &["--file", "store.redb"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.trim_start().starts_with("naive") && l.contains("idemstore"))
        .unwrap_or_else(|| panic!("no table header: {stdout}"));
    // The table's rows: label, then the two phases' figures.
    let labels: Vec<&str> = lines[header + 1..]
        .iter()
        .take_while(|l| !l.is_empty())
        .map(|l| l[..26].trim_end())
        .collect();
    assert_eq!(labels.len(), 11, "{stdout}");
    let legend_at = lines
        .iter()
        .position(|l| *l == "What each row counts:")
        .unwrap_or_else(|| panic!("no legend: {stdout}"));
    let legend = &lines[legend_at + 1..];
    for label in &labels {
        let line = legend
            .iter()
            .find(|l| l.starts_with(&format!("  {label:<26}")))
            .unwrap_or_else(|| panic!("no legend line for {label:?}: {stdout}"));
        assert!(line.len() > 30, "an empty legend line for {label:?}");
    }
    assert!(
        stdout.contains("N (M): N claims took over a dead worker's lapsed lease; M of them"),
        "{stdout}"
    );
    let attempts = |phase: usize| -> u64 {
        let row = lines[header + 1..]
            .iter()
            .find(|l| l.starts_with("attempts "))
            .unwrap();
        row.split_whitespace().nth(phase).unwrap().parse().unwrap()
    };
    let (naive, idem) = (attempts(1), attempts(2));
    let why = if idem > naive {
        format!("Why idemstore needs more attempts ({idem} vs {naive})")
    } else if idem < naive {
        format!("Why idemstore needs fewer attempts ({idem} vs {naive})")
    } else {
        format!("Both phases made {idem} attempts.")
    };
    assert!(stdout.contains(&why), "{stdout}");
}

/// Exit code 2, nothing on stdout, exactly one line on stderr:
/// `idemstore: ...` mentioning `mentions`.
fn assert_one_error_line(out: &Output, mentions: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr}");
    assert!(stderr.starts_with("idemstore: "), "stderr: {stderr}");
    assert!(stderr.contains(mentions), "stderr: {stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_bad_option_exits_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| idemstore(dir.path(), args);
    assert_one_error_line(&run(&["demo", "--no-such-option"]), "--no-such-option");
    assert_one_error_line(&run(&["demo", "--drop-rate", "1.5"]), "--drop-rate");
    assert_one_error_line(&run(&["demo", "--agents", "0"]), "--agents");
    assert_one_error_line(
        &run(&["demo", "--drop-rate", "0.6", "--late-rate", "0.6"]),
        "more than 1",
    );
    assert_one_error_line(&run(&["frobnicate"]), "frobnicate");
    assert!(
        !dir.path().join("idemstore-demo.redb").exists(),
        "a refused command line creates no store"
    );
}

#[test]
fn a_store_that_cannot_be_opened_exits_2_with_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let out = idemstore(dir.path(), &["demo", "--file", "no-such-dir/demo.redb"]);
    assert_one_error_line(&out, "cannot open the store no-such-dir/demo.redb: ");
}

/// Every other worker dies after creating its ticket and before recording
/// it. After the lease lapses the retry takes the key over and, asking the
/// ticket service by key first ("query instead of replay"), finds the
/// ticket instead of creating a second one. Each of the 20 first attempts
/// crashes with p = 0.5, so no crash at all has p = 0.5^20 < 1e-6.
#[test]
fn a_takeover_after_a_crash_finds_the_ticket_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = idemstore(
        dir.path(),
        &[
            "demo",
            "--json",
            "--agents",
            "4",
            "--intents",
            "5",
            "--seed",
            "11",
            "--drop-rate",
            "0",
            "--late-rate",
            "0",
            "--crash-rate",
            "0.5",
            "--latency-ms",
            "2",
            "--timeout-ms",
            "40",
            "--lease-ms",
            "500",
            "--max-attempts",
            "1000",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(n(&v, "naive", "duplicates") > 0, "{v}");
    assert!(n(&v, "idemstore", "takeovers") > 0, "{v}");
    assert_eq!(
        n(&v, "idemstore", "found_by_lookup"),
        n(&v, "idemstore", "takeovers"),
        "{v}"
    );
    assert_eq!(n(&v, "idemstore", "tickets_created"), 20, "{v}");
    assert_eq!(n(&v, "idemstore", "duplicates"), 0, "{v}");
}

/// A lease shorter than the work (1 ms against 10-30 ms) is a
/// misconfiguration the store cannot make up for: a retry takes the key
/// over while the first holder still works, finds no ticket yet, and
/// creates one; the holder then creates its own. The demo must count
/// those duplicates and exit 1. A retry outruns the holder when its start
/// plus its own work is shorter than the holder's work, about one intent
/// in ten here (measured: 3 to 8 of 64 over six seeds); with 192 intents
/// no duplicate at all has p < 1e-4 even at half that rate.
#[test]
fn a_lease_shorter_than_the_work_lets_duplicates_through_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let out = idemstore(
        dir.path(),
        &[
            "demo",
            "--json",
            "--agents",
            "16",
            "--intents",
            "12",
            "--seed",
            "3",
            "--drop-rate",
            "0",
            "--late-rate",
            "0",
            "--crash-rate",
            "0",
            "--latency-ms",
            "20",
            "--timeout-ms",
            "2",
            "--lease-ms",
            "1",
            "--max-attempts",
            "10",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(n(&v, "idemstore", "duplicates") > 0, "{v}");
    assert!(n(&v, "idemstore", "takeovers") > 0, "{v}");
}
