//! The store's time: it moves forward at the rate of a monotonic clock when
//! the wall clock steps back, follows the wall clock when it steps forward,
//! and never runs backwards, across crashes too (README, "The store's
//! time"; `src/clock.rs`).

mod common;

use std::time::Duration;

use common::*;
use idemstore::{ClaimOptions, ClaimOutcome, Config, ManualClock, Store};

const RETENTION: Duration = Duration::from_secs(3600);

fn config(clock: &ManualClock) -> Config {
    Config::new()
        .clock(clock.clone())
        .retention(RETENTION)
        .sweep_interval(None)
}

const KILLED_READ: &str = "an_expiry_seen_only_by_a_read_survives_a_kill_and_a_clock_step_back";

/// Reproduction 4 of issue 10: `get` reports a record expired; the process
/// is killed; the wall clock steps back; after reopen the same record must
/// still be expired (the time the read's answer was based on survived the
/// crash although nothing was written at that time).
#[test]
fn an_expiry_seen_only_by_a_read_survives_a_kill_and_a_clock_step_back() {
    if child_role(KILLED_READ) {
        let path = child_var("STORE");
        let t0: u64 = child_var_parsed("T0");
        let clock = ManualClock::new(t0);
        let store = Store::open_with(&path, config(&clock)).expect("open");
        let k = key("read-only-expiry");
        let lease = acquired(
            store
                .claim(&k, &fp("p"), &ClaimOptions::new())
                .expect("claim"),
        );
        store.complete(&lease, b"done").expect("complete");
        // Past retention: only a read sees it.
        clock.advance(RETENTION + secs(5));
        assert_eq!(store.get(&k).expect("get"), None, "expired");
        report("seen", store.now_ms());
        ready_and_wait();
    }
    let dir = TestDir::new();
    let t0 = dir.now_ms();
    let mut child = spawn_child(
        KILLED_READ,
        &[("STORE", path_var(&dir.path)), ("T0", t0.to_string())],
    );
    let reports = child.wait_ready();
    let seen: u64 = reports["seen"].parse().expect("seen");
    child.kill();
    // The wall clock stepped back to before the record's expiry.
    let clock = ManualClock::new(t0 + RETENTION.as_millis() as u64 - 1_000);
    let store = Store::open_with(&dir.path, config(&clock)).expect("reopen");
    assert!(store.now_ms() >= seen, "the store's time went back");
    assert_eq!(
        store.get(&key("read-only-expiry")).expect("get"),
        None,
        "a record that a read had seen expire came back after the crash"
    );
}

/// Reproduction 5 of issue 10: the wall clock steps forward two days (the
/// store follows) and back again; a 30 s lease taken then lapses after 30 s
/// of monotonic time, not two days later.
#[test]
fn a_lease_lapses_on_monotonic_time_after_the_clock_steps_forward_and_back() {
    let dir = TestDir::new();
    let clock = dir.clock.clone();
    let store = dir.open_with(config(&clock));
    let t0 = dir.now_ms();
    let two_days = 2 * 24 * 3600 * 1000;
    clock.set_ms(t0 + two_days);
    assert!(
        store.now_ms() >= t0 + two_days,
        "the store follows a step forward"
    );
    clock.set_ms(t0);
    let k = key("lease-after-steps");
    let lease = acquired(
        store
            .claim(&k, &fp("p"), &lease_of(secs(30)))
            .expect("claim"),
    );
    clock.advance(secs(29));
    assert!(matches!(
        store
            .claim(&k, &fp("p"), &ClaimOptions::new())
            .expect("claim"),
        ClaimOutcome::InProgress { .. }
    ));
    clock.advance(secs(1));
    let taken = store
        .claim(&k, &fp("p"), &ClaimOptions::new())
        .expect("claim");
    let ClaimOutcome::Acquired(next) = taken else {
        panic!("the 30 s lease did not lapse after 30 s: {taken:?}");
    };
    assert!(next.token() > lease.token());
}

const DRIFT: &str = "the_store_time_stays_within_the_reservation_across_many_crashes";

/// Crashes in a row (SIGKILL of a child that claims, completes, reads and
/// lets time pass, at a random moment): after each unclean open the store's
/// time is never below a time the previous child reported, and never more
/// than [`TIME_RESERVATION`] ahead of the wall clock, however many crashes
/// came before (reservations do not add up).
#[test]
fn the_store_time_stays_within_the_reservation_across_many_crashes() {
    if child_role(DRIFT) {
        let path = child_var("STORE");
        let wall: u64 = child_var_parsed("WALL");
        let seed: u64 = child_var_parsed("SEED");
        let clock = ManualClock::new(wall);
        let store = Store::open_with(&path, config(&clock)).expect("open");
        report("start", store.now_ms());
        let mut rng = Rng::new(seed);
        let mut advanced = 0;
        for i in 0..(1 + rng.below(30)) {
            let step = rng.below(400);
            clock.advance(ms(step));
            advanced += step;
            let k = key(&format!("s{seed}-{i}"));
            if rng.one_in(2) {
                let lease = acquired(
                    store
                        .claim(&k, &fp("p"), &ClaimOptions::new())
                        .expect("claim"),
                );
                if rng.one_in(2) {
                    store.complete(&lease, b"r").expect("complete");
                }
            } else {
                store.get(&k).expect("get");
            }
        }
        report("advanced", advanced);
        report("last", store.now_ms());
        ready_and_wait();
    }
    let dir = TestDir::new();
    let mut wall = dir.now_ms();
    let reservation = idemstore::TIME_RESERVATION.as_millis() as u64;
    let mut rng = Rng::new(seed_from_env("IDEMSTORE_DRIFT_SEED", 10));
    let mut last_seen = 0;
    let mut max_drift = 0;
    let cycles = count_from_env("IDEMSTORE_DRIFT_CRASHES", 40);
    for cycle in 0..cycles {
        let mut child = spawn_child(
            DRIFT,
            &[
                ("STORE", path_var(&dir.path)),
                ("WALL", wall.to_string()),
                ("SEED", rng.next_u64().to_string()),
            ],
        );
        let reports = child.wait_ready();
        child.kill();
        let value = |name: &str| -> u64 { reports[name].parse().expect("number") };
        let start = value("start");
        assert!(
            start >= last_seen,
            "cycle {cycle}: the store's time went back from {last_seen} to {start}"
        );
        let drift = start.saturating_sub(wall);
        assert!(
            drift <= reservation,
            "cycle {cycle}: {drift} ms ahead of the wall clock after {cycle} crashes"
        );
        max_drift = max_drift.max(drift);
        last_seen = value("last");
        // The wall time that passed in the child, and sometimes a restart
        // that takes no (manual) time at all.
        wall += value("advanced") + rng.below(3) * rng.below(200);
    }
    // The crashes did put the store ahead (the bound is not vacuous).
    assert!(max_drift > 0, "no crash left the store ahead");
}

/// A store opened read-only under a wall clock ahead (an operator's
/// `idemstore get` on a host whose clock is wrong) reads as of that clock,
/// and persists none of it: the service, back on its own clock, finds its
/// records live and its time where it was, after a checkpoint and a clean
/// close of the read-only store, and after a read-only open killed.
#[test]
fn a_read_only_open_under_a_clock_ahead_persists_no_time() {
    if child_role(HELD_READ) {
        let path = child_var("STORE");
        let at: u64 = child_var_parsed("AT");
        let clock = ManualClock::new(at);
        let store = Store::open_existing(&path, config(&clock).read_only(true)).expect("open");
        assert_eq!(
            store.get(&key("kept")).expect("get"),
            None,
            "read as of its clock"
        );
        ready_and_wait();
    }
    let dir = TestDir::new();
    let t0 = dir.now_ms();
    let retention_ms = RETENTION.as_millis() as u64;
    let kept = {
        let store = Store::open_with(&dir.path, config(&ManualClock::new(t0))).expect("open");
        let lease = acquired(
            store
                .claim(&key("kept"), &fp("p"), &ClaimOptions::new())
                .expect("claim"),
        );
        store.complete(&lease, b"done").expect("complete")
    };
    let ahead = t0 + 2 * retention_ms;
    {
        let store =
            Store::open_existing(&dir.path, config(&ManualClock::new(ahead)).read_only(true))
                .expect("read-only open");
        assert_eq!(
            store.get(&key("kept")).expect("get"),
            None,
            "read as of its clock"
        );
        assert!(store.now_ms() >= ahead);
        store.checkpoint().expect("checkpoint");
    }
    let mut child = spawn_child(
        HELD_READ,
        &[("STORE", path_var(&dir.path)), ("AT", ahead.to_string())],
    );
    child.wait_ready();
    child.kill();
    let back = t0 + 60_000;
    let store = Store::open_with(&dir.path, config(&ManualClock::new(back))).expect("reopen");
    assert!(
        store.now_ms() < t0 + retention_ms,
        "the read-only opens moved the store's time to {} ms past the writes",
        store.now_ms() - t0
    );
    assert_eq!(
        store.get(&key("kept")).expect("get"),
        Some(kept),
        "a live record read as past retention after a read-only open"
    );
}

const HELD_READ: &str = "a_read_only_open_under_a_clock_ahead_persists_no_time";
