//! A throwaway PostgreSQL server for tests: `initdb` into a fresh
//! temporary directory, `pg_ctl start` on a free port, `pg_ctl stop -m
//! immediate` and removal of the directory on drop.
//!
//! `initdb` and `pg_ctl` refuse to run as root, so when the tests run as
//! root they are run as the `postgres` user (`runuser -u postgres --`), and
//! the directory is handed to that user. When the environment variable
//! `IDEMSTORE_PG_URL` is set, that server is used instead and nothing is
//! started (each test then works in a schema of its own).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where the PostgreSQL binaries are looked for.
const BIN_DIRS: &[&str] = &[
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/15/bin",
];

/// The environment variable naming an existing server to test against.
pub const URL_ENV: &str = "IDEMSTORE_PG_URL";

/// A PostgreSQL server for one test binary (or one test): started in a
/// temporary directory, stopped and removed on drop; or an existing server
/// named by `IDEMSTORE_PG_URL`.
#[derive(Debug)]
pub struct TestServer {
    url: String,
    owned: Option<Owned>,
}

/// A server this process started.
#[derive(Debug)]
struct Owned {
    bin: PathBuf,
    dir: PathBuf,
    data: PathBuf,
    as_postgres: bool,
    /// The server options given to `pg_ctl -o`.
    opts: String,
}

/// How a throwaway server is started.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerOptions {
    /// Keep `fsync` on (for crash tests); off by default, which is fine for
    /// functional tests and several times faster.
    pub fsync: bool,
    /// Serve TLS with a certificate for `localhost` and `127.0.0.1`,
    /// issued by a throwaway CA ([`TestServer::root_cert`]); needs the
    /// `openssl` command.
    pub tls: bool,
    /// Load `pg_stat_statements` (`shared_preload_libraries`), for tests
    /// that count the statements the engine sends; the test creates the
    /// extension.
    pub stat_statements: bool,
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn find_bin() -> Result<PathBuf, String> {
    BIN_DIRS
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
        .ok_or_else(|| {
            format!(
                "the PostgreSQL server binaries (initdb, pg_ctl) were not found in {BIN_DIRS:?}: \
                 install them with `apt-get install postgresql`, or set {URL_ENV} to the URL \
                 of a server to test against"
            )
        })
}

/// Makes a CA and a server certificate for `localhost` and `127.0.0.1`
/// in `dir` with the `openssl` command.
fn make_certs(dir: &Path) -> Result<(), String> {
    let run = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("running openssl (needed for a TLS test server): {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(describe("openssl", &out))
        }
    };
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .map_err(|e| format!("writing ext.cnf: {e}"))?;
    run(&[
        "req",
        "-new",
        "-x509",
        "-days",
        "2",
        "-nodes",
        "-newkey",
        "rsa:2048",
        "-subj",
        "/CN=idemstore-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ])?;
    run(&[
        "req",
        "-new",
        "-nodes",
        "-newkey",
        "rsa:2048",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ])?;
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.crt",
        "-extfile",
        "ext.cnf",
    ])?;
    // The server refuses a key others can read.
    let out = Command::new("chmod")
        .args(["600", "server.key"])
        .current_dir(dir)
        .output()
        .map_err(|e| format!("running chmod: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(describe("chmod", &out))
    }
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("finding a free port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

fn describe(what: &str, out: &Output) -> String {
    format!(
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Owned {
    /// Runs a server binary, as `postgres` when this process is root.
    fn run(&self, tool: &str, args: &[&str]) -> Result<Output, String> {
        let bin = self.bin.join(tool);
        let out = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&bin)
                .args(args)
                .output()
        } else {
            Command::new(&bin).args(args).output()
        };
        out.map_err(|e| format!("running {}: {e}", bin.display()))
    }

    /// Starts a watchdog that stops the server and removes its directory
    /// once process `pid` has exited.
    fn watch(&self, pid: u32) -> Result<(), String> {
        let data = Owned::path(&self.data)?;
        let dir = Owned::path(&self.dir)?;
        let pg_ctl = self.bin.join("pg_ctl");
        let pg_ctl = Owned::path(&pg_ctl)?;
        let as_user = if self.as_postgres {
            "runuser -u postgres -- "
        } else {
            ""
        };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
             {as_user}'{pg_ctl}' -D '{data}' -m immediate -w stop >/dev/null 2>&1; \
             rm -rf '{dir}'"
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map(drop)
            .map_err(|e| format!("starting the server's watchdog: {e}"))
    }

    fn path(p: &Path) -> Result<&str, String> {
        p.to_str()
            .ok_or_else(|| format!("{} is not UTF-8", p.display()))
    }
}

impl TestServer {
    /// A functional-test server (`fsync` off), or the one named by
    /// `IDEMSTORE_PG_URL`.
    ///
    /// # Errors
    /// A message naming `apt-get install postgresql` when the binaries are
    /// missing, or what failed while starting the server.
    pub fn start() -> Result<TestServer, String> {
        if let Ok(url) = std::env::var(URL_ENV)
            && !url.is_empty()
        {
            return Ok(TestServer { url, owned: None });
        }
        TestServer::start_own(ServerOptions::default())
    }

    /// A server of its own (never `IDEMSTORE_PG_URL`), with `options`.
    ///
    /// # Errors
    /// As [`TestServer::start`].
    pub fn start_own(options: ServerOptions) -> Result<TestServer, String> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let bin = find_bin()?;
        let as_postgres = running_as_root();
        let dir = std::env::temp_dir().join(format!(
            "idemstore-pg-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let port = free_port()?;
        let mut opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync={} \
             -c synchronous_commit=on -c max_connections=300 -c shared_buffers=64MB",
            if options.fsync { "on" } else { "off" },
            sock = dir.display(),
        );
        if options.stat_statements {
            opts.push_str(" -c shared_preload_libraries=pg_stat_statements");
        }
        if options.tls {
            make_certs(&dir)?;
            opts.push_str(&format!(
                " -c ssl=on -c ssl_cert_file={d}/server.crt -c ssl_key_file={d}/server.key",
                d = dir.display()
            ));
        }
        let owned = Owned {
            data: dir.join("data"),
            bin,
            dir,
            as_postgres,
            opts,
        };
        // From here on, drop cleans up.
        let server = TestServer {
            url: format!("postgresql://postgres@127.0.0.1:{port}/postgres"),
            owned: Some(owned),
        };
        let owned = server.owned.as_ref().ok_or("no server")?;
        if as_postgres {
            let out = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&owned.dir)
                .output()
                .map_err(|e| format!("running chown: {e}"))?;
            if !out.status.success() {
                return Err(describe("chown", &out));
            }
        }
        let data = Owned::path(&owned.data)?;
        let out = owned.run(
            "initdb",
            &[
                "-D",
                data,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        )?;
        if !out.status.success() {
            return Err(describe("initdb", &out));
        }
        let opts = owned.opts.as_str();
        let log = owned.dir.join("server.log");
        let log = Owned::path(&log)?;
        let out = owned.run(
            "pg_ctl",
            &["-D", data, "-l", log, "-o", opts, "-w", "start"],
        )?;
        if !out.status.success() {
            let server_log =
                std::fs::read_to_string(owned.dir.join("server.log")).unwrap_or_default();
            return Err(format!("{}\n{server_log}", describe("pg_ctl start", &out)));
        }
        // Wait until it accepts TCP connections.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("the server on port {port} did not come up"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    /// The server shared by every test of this process: started on first
    /// use (or `IDEMSTORE_PG_URL`), stopped and removed by a watchdog
    /// process once this process has exited (statics are never dropped).
    ///
    /// # Errors
    /// As [`TestServer::start`] (the same message for every caller).
    pub fn shared() -> Result<&'static TestServer, String> {
        static SHARED: std::sync::OnceLock<Result<TestServer, String>> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| {
                let server = TestServer::start()?;
                if let Some(owned) = &server.owned {
                    owned.watch(std::process::id())?;
                }
                Ok(server)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The throwaway CA that issued the server's certificate (a server
    /// started with [`ServerOptions::tls`]).
    pub fn root_cert(&self) -> Option<PathBuf> {
        self.owned
            .as_ref()
            .map(|o| o.dir.join("ca.crt"))
            .filter(|p| p.is_file())
    }

    /// The connection URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: no shutdown
    /// checkpoint, as a crash), keeping its data directory.
    ///
    /// # Errors
    /// When this server was not started here, or `pg_ctl` fails.
    pub fn kill(&self) -> Result<(), String> {
        let owned = self.owned.as_ref().ok_or("not a server of this process")?;
        let data = Owned::path(&owned.data)?;
        let out = owned.run("pg_ctl", &["-D", data, "-m", "immediate", "-w", "stop"])?;
        if out.status.success() {
            Ok(())
        } else {
            Err(describe("pg_ctl stop", &out))
        }
    }

    /// Starts a server stopped by [`TestServer::kill`] again on the same
    /// port and data.
    ///
    /// # Errors
    /// When this server was not started here, or `pg_ctl` fails.
    pub fn restart(&self) -> Result<(), String> {
        let owned = self.owned.as_ref().ok_or("not a server of this process")?;
        let data = Owned::path(&owned.data)?;
        let log = owned.dir.join("server.log");
        let log = Owned::path(&log)?;
        let out = owned.run(
            "pg_ctl",
            &["-D", data, "-l", log, "-o", &owned.opts, "-w", "start"],
        )?;
        if !out.status.success() {
            return Err(describe("pg_ctl start", &out));
        }
        Ok(())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(owned) = &self.owned {
            if let Ok(data) = Owned::path(&owned.data) {
                let _ = owned.run("pg_ctl", &["-D", data, "-m", "immediate", "-w", "stop"]);
            }
            let _ = std::fs::remove_dir_all(&owned.dir);
        }
    }
}
