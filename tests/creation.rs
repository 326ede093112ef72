//! Creating a store is atomic: a crash at any point of creating a store
//! file leaves either no store or a store that opens (README, "Files";
//! `docs/design.md` 2.8).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use idemstore::{Config, Store};

const KILLED_CREATION: &str = "a_creation_killed_at_any_moment_leaves_no_store_or_one_that_opens";

fn config() -> Config {
    Config::new().sweep_interval(None).max_log_bytes(64 * 1024)
}

/// Every file in `dir` whose name ends in `.redb`.
fn stores_in(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "redb"))
        .collect();
    found.sort();
    found
}

/// Reproduction 6 of issue 10: a child process creates one new store after
/// another and is killed (SIGKILL) at a random moment, often while a store
/// file is being created. Every store file the kills left behind must open,
/// and the names the next creation uses must be creatable.
#[test]
fn a_creation_killed_at_any_moment_leaves_no_store_or_one_that_opens() {
    if child_role(KILLED_CREATION) {
        let dir = PathBuf::from(child_var("DIR"));
        let start: u64 = child_var_parsed("START");
        std::thread::spawn(move || {
            for n in start.. {
                let store =
                    Store::open_with(dir.join(format!("s{n}.redb")), config()).expect("create");
                drop(store);
            }
        });
        ready_and_wait();
    }
    let dir = TestDir::new();
    let cycles = count_from_env("IDEMSTORE_CREATION_KILLS", 40);
    let mut rng = Rng::new(seed_from_env("IDEMSTORE_CREATION_SEED", 6));
    let mut unopenable = Vec::new();
    for cycle in 0..cycles {
        let start = (cycle as u64) * 1_000_000;
        let mut child = spawn_child(
            KILLED_CREATION,
            &[
                ("DIR", path_var(dir.dir.path())),
                ("START", start.to_string()),
            ],
        );
        child.wait_ready();
        // A random moment into the child's run of creations.
        std::thread::sleep(ms(5 + rng.below(60)));
        child.assert_running();
        child.kill();
        for path in stores_in(dir.dir.path()) {
            match Store::open_existing(&path, config()) {
                Ok(store) => drop(store),
                Err(e) => {
                    unopenable.push(format!("{}: {e}", path.display()));
                    // Out of the way of the next cycles.
                    std::fs::remove_file(&path).expect("remove");
                }
            }
        }
    }
    assert!(
        unopenable.is_empty(),
        "stores left unopenable by a killed creation: {unopenable:#?}"
    );
}
