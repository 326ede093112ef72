//! The conformance suite (`idemstore::conformance`) against every engine:
//! the embedded engine on files in a temporary directory, one test per
//! guarantee.

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
);

#[test]
fn the_suite_lists_every_test() {
    // `conformance::ALL` is what an engine outside this crate runs; it
    // must hold every function the macro above runs.
    assert_eq!(conformance::ALL.len(), 13);
}
