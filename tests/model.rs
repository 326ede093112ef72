//! Model-based property test: random operation sequences run against a real
//! [`Store`] on a temporary file and against the reference model in
//! `tests/reference/mod.rs` (written from DESIGN.md alone), comparing every
//! answer and the whole store after every step.
//!
//! 256 cases of up to 100 steps by default; `IDEMSTORE_PROPTEST_CASES=N`
//! runs N cases (see docs/testing.md).
//!
//! With the feature `postgres` the same model runs against a PostgreSQL
//! store too (a schema of its own per case, on the throwaway server of
//! `tests/pg`), with every operation but `StepBack`: the PostgreSQL
//! engine's time is the database clock's, kept monotonic per process only
//! (a clock that steps back makes time stand still, and a new process
//! starts from the clock), which the model's file-store clock does not
//! describe. Its clock rules are tested in the engine's own tests.

#[cfg(all(feature = "postgres", feature = "conformance"))]
mod pg;
mod reference;

use std::path::PathBuf;

use idemstore::Store;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::Config as ProptestConfig;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use tempfile::TempDir;

use reference::{
    FINGERPRINT_COUNT, ForgedToken, Harness, KEY_COUNT, LeaseRef, MAX_LEASE_MS, MAX_VALUE_BYTES,
    Model, Op,
};

/// The proptest side of the model: generates operations that fit the model
/// state (leases it handed out, current or stale, and forged ones).
struct Reference;

fn lease_ref(handed: usize) -> BoxedStrategy<LeaseRef> {
    let forged_token = if handed == 0 {
        prop_oneof![
            (1u8..=3).prop_map(ForgedToken::Ahead),
            Just(ForgedToken::Max)
        ]
        .boxed()
    } else {
        prop_oneof![
            (1u8..=3).prop_map(ForgedToken::Ahead),
            Just(ForgedToken::Max),
            (0..handed).prop_map(ForgedToken::Borrowed),
        ]
        .boxed()
    };
    let forged = (0..KEY_COUNT, forged_token)
        .prop_map(|(key, token)| LeaseRef::Forged { key, token })
        .boxed();
    if handed == 0 {
        return forged;
    }
    let rebuilt = prop::bool::weighted(0.25);
    prop_oneof![
        // Mostly one of the latest leases (likely current), sometimes any
        // lease handed out (likely stale), sometimes a forged one.
        6 => (handed.saturating_sub(4)..handed, rebuilt)
            .prop_map(|(index, rebuilt)| LeaseRef::Handed { index, rebuilt }),
        3 => (0..handed, rebuilt).prop_map(|(index, rebuilt)| LeaseRef::Handed { index, rebuilt }),
        1 => forged,
    ]
    .boxed()
}

fn value() -> impl Strategy<Value = Vec<u8>> + Clone {
    // Up to two bytes over the limit, so that some are refused.
    prop::collection::vec(any::<u8>(), 0..=MAX_VALUE_BYTES + 2)
}

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::new()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        let lease = lease_ref(state.leases.len());
        let lease_ms = prop_oneof![
            2 => Just(None),
            8 => select(vec![1u64, 10, 500, 5_000, 20_000, 30_000, 90_000]).prop_map(Some),
            1 => select(vec![0u64, MAX_LEASE_MS + 1]).prop_map(Some),
        ];
        let extend_ms = prop_oneof![
            8 => select(vec![1u64, 100, 5_000, 30_000, 120_000]),
            1 => select(vec![0u64, MAX_LEASE_MS + 1]),
        ];
        let advance_ms = prop_oneof![
            2 => 1u64..=1_000,
            1 => select(vec![1u64, 20_000, 30_000, 59_999, 60_000, 90_000, 150_000]),
        ];
        prop_oneof![
            24 => (0..KEY_COUNT, 0..FINGERPRINT_COUNT, lease_ms)
                .prop_map(|(key, fp, lease_ms)| Op::Claim { key, fp, lease_ms }),
            9 => (lease.clone(), value()).prop_map(|(lease, result)| Op::Complete { lease, result }),
            8 => (lease.clone(), value(), any::<bool>()).prop_map(|(lease, failure, retryable)| {
                Op::Fail { lease, failure, retryable }
            }),
            3 => lease.clone().prop_map(|lease| Op::Release { lease }),
            5 => (lease.clone(), extend_ms).prop_map(|(lease, ms)| Op::Extend { lease, ms }),
            5 => (lease, value()).prop_map(|(lease, bytes)| Op::SetRecoveryPoint { lease, bytes }),
            4 => (0..KEY_COUNT).prop_map(|key| Op::Get { key }),
            12 => advance_ms.prop_map(|ms| Op::Advance { ms }),
            3 => (1u64..=120_000).prop_map(|ms| Op::StepBack { ms }),
            4 => select(vec![1usize, 2, 1_000]).prop_map(|max| Op::Sweep { max }),
            // Reopen costs fsyncs: keep it about 1 step in 80.
            1 => Just(Op::Reopen),
        ]
        .boxed()
    }

    fn preconditions(state: &Model, op: &Op) -> bool {
        state.admits(op)
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        state.step(op);
        state
    }
}

/// The system under test: the harness and the directory of its file.
struct Sut {
    harness: Harness,
    _dir: TempDir,
}

struct StoreTest;

impl StateMachineTest for StoreTest {
    type SystemUnderTest = Sut;
    type Reference = Reference;

    fn init_test(_model: &Model) -> Sut {
        let dir = test_dir();
        let path: PathBuf = dir.path().join("model.redb");
        let harness = Harness::new(Box::new(move |config| {
            Store::open_with(&path, config).expect("open the store")
        }));
        Sut { harness, _dir: dir }
    }

    fn apply(mut sut: Sut, model: &Model, op: Op) -> Sut {
        sut.harness.apply(&op, model);
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        sut.harness.check(model);
    }
}

/// A temporary directory for a store file: under `IDEMSTORE_TEST_DIR` when
/// set, else in `/dev/shm` when there is one, else the system's temporary
/// directory. The model checks what the store answers, not the disk (the
/// crash tests do that): on a RAM-backed directory an fsync costs
/// microseconds instead of milliseconds, so the default cases run in about a
/// second instead of about a minute.
fn test_dir() -> TempDir {
    let base = std::env::var_os("IDEMSTORE_TEST_DIR")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|p| p.is_dir()));
    match base {
        Some(base) => tempfile::tempdir_in(base),
        None => tempfile::tempdir(),
    }
    .expect("temporary directory")
}

fn cases() -> u32 {
    std::env::var("IDEMSTORE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 8_192,
        ..ProptestConfig::default()
    })]

    /// The store answers every operation as the reference model does.
    #[test]
    fn store_matches_reference_model(sequential 1..100 => StoreTest);
}

/// The operations of [`Reference`] but `StepBack`, for the PostgreSQL
/// engine (see the module docs).
#[cfg(all(feature = "postgres", feature = "conformance"))]
struct ReferenceNoStepBack;

#[cfg(all(feature = "postgres", feature = "conformance"))]
impl ReferenceStateMachine for ReferenceNoStepBack {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Reference::init_state()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        Reference::transitions(state)
            .prop_filter("no clock step back", |op| {
                !matches!(op, Op::StepBack { .. })
            })
            .boxed()
    }

    fn preconditions(state: &Model, op: &Op) -> bool {
        Reference::preconditions(state, op)
    }

    fn apply(state: Model, op: &Op) -> Model {
        Reference::apply(state, op)
    }
}

/// The system under test on PostgreSQL: `None` when the PostgreSQL tests
/// are skipped (`IDEMSTORE_SKIP_POSTGRES=1`).
#[cfg(all(feature = "postgres", feature = "conformance"))]
struct PgSut(Option<Harness>);

#[cfg(all(feature = "postgres", feature = "conformance"))]
struct PostgresTest;

#[cfg(all(feature = "postgres", feature = "conformance"))]
impl StateMachineTest for PostgresTest {
    type SystemUnderTest = PgSut;
    type Reference = ReferenceNoStepBack;

    fn init_test(_model: &Model) -> PgSut {
        let Some(url) = pg::url() else {
            return PgSut(None);
        };
        let schema = pg::schema("model");
        PgSut(Some(Harness::new(Box::new(move |config| {
            let config = config
                .postgres_schema(schema.clone())
                .postgres_connections(2);
            Store::connect(&url, config).expect("connect the store")
        }))))
    }

    fn apply(mut sut: PgSut, model: &Model, op: Op) -> PgSut {
        if let Some(harness) = &mut sut.0 {
            harness.apply(&op, model);
        }
        sut
    }

    fn check_invariants(sut: &PgSut, model: &Model) {
        if let Some(harness) = &sut.0 {
            harness.check(model);
        }
    }
}

#[cfg(all(feature = "postgres", feature = "conformance"))]
fn pg_cases() -> u32 {
    std::env::var("IDEMSTORE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

#[cfg(all(feature = "postgres", feature = "conformance"))]
prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: pg_cases(),
        max_shrink_iters: 2_048,
        ..ProptestConfig::default()
    })]

    /// A PostgreSQL store answers every operation as the reference model
    /// does (64 cases by default: each step is a round trip to the server).
    #[test]
    fn postgres_store_matches_reference_model(sequential 1..100 => PostgresTest);
}

/// Found by the model: the clock's high-water mark was persisted only with
/// writes, so a record that reads had already seen expire came back after a
/// reopen with a clock that had stepped back (DESIGN.md: the store's clock
/// "can never revive an expired record").
#[test]
fn clock_step_back_across_reopen_does_not_revive_an_expired_record() {
    use idemstore::{ClaimOptions, ClaimOutcome, ManualClock};
    use std::time::Duration;

    let dir = test_dir();
    let path = dir.path().join("clock.redb");
    let clock = ManualClock::new(reference::T0_MS);
    let open = || Store::open_with(&path, reference::config(&clock)).expect("open");
    let key = reference::key(0);
    let fp = reference::fingerprint(0);

    let store = open();
    let ClaimOutcome::Acquired(lease) =
        store.claim(&key, &fp, &ClaimOptions::new()).expect("claim")
    else {
        panic!("a fresh key is acquired");
    };
    store.complete(&lease, b"done").expect("complete");
    // Past retention: only reads happen, and they see the record gone.
    clock.advance(Duration::from_millis(reference::RETENTION_MS + 1_000));
    assert_eq!(store.get(&key).expect("get"), None);
    let seen = store.now_ms();
    // The system clock steps back to before the expiry, and the process
    // restarts.
    clock.step_back(Duration::from_millis(reference::RETENTION_MS));
    drop(store);
    let store = open();
    assert_eq!(store.now_ms(), seen, "the store's time went back");
    assert_eq!(
        store.get(&key).expect("get"),
        None,
        "an expired record came back"
    );
}
