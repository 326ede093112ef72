//! The conformance suite (`idemstore::conformance`) against every engine:
//! the embedded engine on files in a temporary directory and, with the
//! feature `postgres`, the PostgreSQL engine on a throwaway server (one
//! schema per store), one test per guarantee and engine.
//!
//! The PostgreSQL tests start their server with the PostgreSQL 15 binaries
//! (`apt-get install postgresql`; as root they run as the `postgres` user),
//! or use the server named by `IDEMSTORE_PG_URL`. Without either they fail,
//! naming how to install them, unless `IDEMSTORE_SKIP_POSTGRES=1` says to
//! skip them (they then print why and pass). CI never skips them.

#[cfg(feature = "postgres")]
mod pg;

use idemstore::conformance::{self, Harness};
use idemstore::{Config, Store};

/// Stores on files in one temporary directory.
struct Files(tempfile::TempDir);

impl Harness for Files {
    fn open(&self, name: &str, config: Config) -> Store {
        Store::open_with(self.0.path().join(format!("{name}.redb")), config).unwrap()
    }

    fn reopen(&self, store: Store, config: Config) -> Store {
        let path = store.path().to_path_buf();
        drop(store);
        Store::open_with(path, config).unwrap()
    }
}

fn files() -> Files {
    Files(tempfile::tempdir().unwrap())
}

macro_rules! embedded {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(#[test]
            fn $name() {
                super::conformance::$name(&super::files());
            })*
        }
    };
}

embedded!(
    claim_outcomes,
    fencing,
    fingerprints,
    retention,
    recovery_points,
    business_keys,
    sweep,
    resolve,
    scan,
    stats,
    export_import,
    claim_many,
    reopen,
    holder_finishes,
    abandoned_claims,
);

#[cfg(feature = "postgres")]
mod postgres {
    use idemstore::conformance::{self, Harness};
    use idemstore::{Config, Store};

    /// Stores on one PostgreSQL server, each in a schema of its own.
    pub(crate) struct Schemas {
        url: String,
    }

    impl Harness for Schemas {
        fn open(&self, name: &str, config: Config) -> Store {
            let schema = super::pg::schema(&format!("c_{name}"));
            Store::connect(&self.url, config.postgres_schema(schema)).unwrap()
        }

        fn reopen(&self, store: Store, config: Config) -> Store {
            // The store names its schema in its path (`…?schema=name`).
            let schema = super::pg::schema_of(&store);
            drop(store);
            Store::connect(&self.url, config.postgres_schema(schema)).unwrap()
        }
    }

    /// The harness, or `None` when the tests are to be skipped.
    pub(crate) fn schemas() -> Option<Schemas> {
        Some(Schemas {
            url: super::pg::url()?,
        })
    }

    macro_rules! postgres {
        ($($name:ident),* $(,)?) => {
            $(#[test]
            fn $name() {
                if let Some(h) = schemas() {
                    conformance::$name(&h);
                }
            })*
        };
    }

    postgres!(
        claim_outcomes,
        fencing,
        fingerprints,
        retention,
        recovery_points,
        business_keys,
        sweep,
        resolve,
        scan,
        stats,
        export_import,
        claim_many,
        reopen,
        holder_finishes,
        abandoned_claims,
    );

    /// An export of a file store imports into a PostgreSQL store and back:
    /// the migration path both ways.
    #[test]
    fn export_moves_between_engines_both_ways() {
        let Some(h) = schemas() else { return };
        let clock = idemstore::ManualClock::starting_now();
        let config = || Config::new().clock(clock.clone()).sweep_interval(None);
        let dir = tempfile::tempdir().unwrap();
        let file = Store::open_with(dir.path().join("from.redb"), config()).unwrap();
        let fp = idemstore::Fingerprint::of(b"p");
        let mut leases = Vec::new();
        for i in 0..50 {
            let key = idemstore::Key::new("migrate", format!("k{i}")).unwrap();
            let idemstore::ClaimOutcome::Acquired(lease) = file
                .claim(&key, &fp, &idemstore::ClaimOptions::new())
                .unwrap()
            else {
                panic!("fresh key");
            };
            if i % 3 == 0 {
                file.complete(&lease, format!("r{i}").as_bytes()).unwrap();
            }
            leases.push(lease);
        }
        let mut stream = Vec::new();
        file.export(&mut stream, |_| {}).unwrap();
        let pg = h.open("migrate", config());
        let summary = pg
            .import_with(stream.as_slice(), &idemstore::ImportOptions::new(), |_| {})
            .unwrap();
        assert_eq!(summary.imported, 50);
        for lease in &leases {
            assert_eq!(file.get(lease.key()).unwrap(), pg.get(lease.key()).unwrap());
        }
        // A holder from the file store finishes its work on PostgreSQL.
        pg.complete(&leases[1], b"finished after the move").unwrap();
        // And back: PostgreSQL to a new file.
        let mut back = Vec::new();
        pg.export(&mut back, |_| {}).unwrap();
        let file2 = Store::open_with(dir.path().join("back.redb"), config()).unwrap();
        let summary = file2
            .import_with(back.as_slice(), &idemstore::ImportOptions::new(), |_| {})
            .unwrap();
        assert_eq!(summary.imported, 50);
        for lease in &leases {
            assert_eq!(
                pg.get(lease.key()).unwrap(),
                file2.get(lease.key()).unwrap()
            );
        }
        assert!(summary.next_token > leases.iter().map(|l| l.token()).max().unwrap());
    }
}

#[test]
fn the_suite_lists_every_test() {
    // `conformance::ALL` is what an engine outside this crate runs; it
    // must hold every function the macro above runs.
    assert_eq!(conformance::ALL.len(), 15);
}

#[test]
fn scans_can_move_between_threads_and_be_shared() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<idemstore::Records>();
    send_sync::<Store>();
}
