//! A TCP proxy in front of the test server, for fault injection: it
//! forwards bytes both ways until told otherwise.
//!
//! - [`Proxy::pause`] stops forwarding in both directions without closing
//!   anything (a half-open connection: the peer's bytes are read and held,
//!   nothing is answered) until [`Proxy::resume`];
//! - [`Proxy::lose_answer_after`] lets the client's next message after one
//!   that contains a pattern reach the server, and then drops whatever the
//!   server answers and closes the client's side: the request was applied,
//!   its answer lost; [`Proxy::lose_answer_to`] does the same from the
//!   message that contains the pattern itself (a statement sent whole, in
//!   one flight);
//! - [`Proxy::pause_existing`] does what a pause does to the connections
//!   open at the call only (a NAT or load-balancer entry dropped: those go
//!   half-open, while new connections work);
//! - [`Proxy::hold_answers_after`] forwards everything the client sends,
//!   and from the client chunk that contains a pattern on holds the
//!   server's answers (nothing closed) until [`Proxy::resume`];
//! - [`Proxy::half_open_after`] lets the client chunk that contains a
//!   pattern reach the server, then forwards nothing more on that
//!   connection, either way, and never closes its server side: the server
//!   is never told the client went (a session left inside a transaction
//!   keeps its row locks).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What every connection of a proxy shares.
#[derive(Debug, Default)]
struct State {
    /// Whether forwarding is paused (guarded for the condition variable).
    paused: Mutex<bool>,
    /// Woken when `paused` changes.
    wake: Condvar,
    /// The pattern that arms [`Proxy::lose_answer_after`], once set.
    pattern: Mutex<Option<Vec<u8>>>,
    /// Whether the chunk that contains `pattern` is the one after which
    /// answers are lost ([`Proxy::lose_answer_to`]), not the next one.
    cut_on_pattern: AtomicBool,
    /// Set once the armed pattern was seen and the next client chunk sent:
    /// the server's answers are dropped from then on.
    cut: AtomicBool,
    /// The first byte of the client chunk sent before the cut (the
    /// message type: `B` for a Bind).
    cut_chunk_type: Mutex<Option<u8>>,
    /// The pattern after which the server's answers are held.
    hold_pattern: Mutex<Option<Vec<u8>>>,
    /// Whether the server's answers are held.
    holding: Mutex<bool>,
    /// Whether the last bytes forwarded went to the server (`true`) or to
    /// the client, and how many times the direction turned from the
    /// server's way to the client's: round trips (one connection at a
    /// time).
    turns: Mutex<(bool, u64)>,
    /// Connections accepted so far (each one's number is its order).
    accepted: AtomicU64,
    /// Connections numbered below this are paused for good.
    dead_below: AtomicU64,
    /// The pattern of [`Proxy::half_open_after`], until it is seen.
    half_open_pattern: Mutex<Option<Vec<u8>>>,
    /// The connection [`Proxy::half_open_after`] left half-open, once it
    /// did (its number).
    half_open: Mutex<Option<u64>>,
    /// The server sides of half-open connections, kept open for good.
    kept: Mutex<Vec<TcpStream>>,
}

impl State {
    /// Blocks while forwarding is paused, and for good on connection `id`
    /// once [`Proxy::pause_existing`] covered it.
    fn wait_unpaused(&self, id: u64) {
        let mut paused = self.paused.lock().expect("proxy lock");
        while *paused || id < self.dead_below.load(Ordering::SeqCst) {
            paused = self.wake.wait(paused).expect("proxy lock");
        }
    }
}

/// A proxy listening on a local port, forwarding to `upstream`.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
}

impl Proxy {
    /// Starts a proxy to `upstream` (host:port of the server).
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let state = Arc::new(State::default());
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
                spawn_pumps(client, server, Arc::clone(&shared), id);
            }
        });
        Proxy { addr, state }
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Stops forwarding (both ways) without closing any connection.
    pub fn pause(&self) {
        *self.state.paused.lock().expect("proxy lock") = true;
    }

    /// Stops forwarding (both ways, for good) on every connection open
    /// now, without closing any; connections opened later are forwarded.
    pub fn pause_existing(&self) {
        let open = self.state.accepted.load(Ordering::SeqCst);
        self.state.dead_below.store(open, Ordering::SeqCst);
    }

    /// Forwards again what was held and what comes (ends a pause and a
    /// hold).
    pub fn resume(&self) {
        *self.state.hold_pattern.lock().expect("proxy lock") = None;
        *self.state.holding.lock().expect("proxy lock") = false;
        *self.state.paused.lock().expect("proxy lock") = false;
        self.state.wake.notify_all();
    }

    /// Holds the server's answers from the client chunk that contains
    /// `pattern` on (that chunk and later ones still reach the server),
    /// until [`Proxy::resume`].
    pub fn hold_answers_after(&self, pattern: &[u8]) {
        *self.state.hold_pattern.lock().expect("proxy lock") = Some(pattern.to_vec());
    }

    /// Round trips since the last call: how many times bytes went to the
    /// client after bytes went to the server (meaningful with one
    /// connection busy at a time).
    pub fn take_round_trips(&self) -> u64 {
        std::mem::take(&mut self.state.turns.lock().expect("proxy lock").1)
    }

    /// Arms the half-open fault: the next client chunk that contains
    /// `pattern` reaches the server, then its connection forwards nothing
    /// more either way and its server side is never closed.
    pub fn half_open_after(&self, pattern: &[u8]) {
        *self.state.half_open_pattern.lock().expect("proxy lock") = Some(pattern.to_vec());
    }

    /// Whether the half-open fault fired.
    pub fn went_half_open(&self) -> bool {
        self.state.half_open.lock().expect("proxy lock").is_some()
    }

    /// Whether answers are being held.
    pub fn holding(&self) -> bool {
        *self.state.holding.lock().expect("proxy lock")
    }

    /// Arms the lost-answer fault: after a client chunk containing
    /// `pattern`, the next client chunk is sent, then the server's answers
    /// are dropped and the client's connection closed.
    pub fn lose_answer_after(&self, pattern: &[u8]) {
        *self.state.pattern.lock().expect("proxy lock") = Some(pattern.to_vec());
    }

    /// Arms the lost-answer fault on the client chunk that contains
    /// `pattern` itself: it reaches the server, then the server's answers
    /// are dropped and the client's connection closed.
    pub fn lose_answer_to(&self, pattern: &[u8]) {
        self.state.cut_on_pattern.store(true, Ordering::SeqCst);
        *self.state.pattern.lock().expect("proxy lock") = Some(pattern.to_vec());
    }

    /// The first byte of the client chunk after which answers were lost
    /// (`None` before the fault fired).
    pub fn cut_chunk_type(&self) -> Option<u8> {
        *self.state.cut_chunk_type.lock().expect("proxy lock")
    }
}

fn spawn_pumps(client: TcpStream, server: TcpStream, state: Arc<State>, id: u64) {
    let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let up = Arc::clone(&state);
    std::thread::spawn(move || client_to_server(client, server, &up, id));
    std::thread::spawn(move || server_to_client(s2, c2, &state, id));
}

fn client_to_server(mut client: TcpStream, mut server: TcpStream, state: &State, id: u64) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut armed_seen = false;
    loop {
        let n = match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        state.wait_unpaused(id);
        let chunk = &buf[..n];
        if armed_seen && !state.cut.load(Ordering::SeqCst) {
            *state.cut_chunk_type.lock().expect("proxy lock") = chunk.first().copied();
            state.cut.store(true, Ordering::SeqCst);
        } else if let Some(p) = state.pattern.lock().expect("proxy lock").as_ref()
            && chunk.windows(p.len()).any(|w| w == p.as_slice())
        {
            armed_seen = true;
            if state.cut_on_pattern.load(Ordering::SeqCst) && !state.cut.load(Ordering::SeqCst) {
                *state.cut_chunk_type.lock().expect("proxy lock") = chunk.first().copied();
                state.cut.store(true, Ordering::SeqCst);
            }
        }
        // Held before the chunk leaves, so that no answer to it slips by.
        let hold = state
            .hold_pattern
            .lock()
            .expect("proxy lock")
            .as_ref()
            .is_some_and(|p| chunk.windows(p.len()).any(|w| w == p.as_slice()));
        if hold {
            *state.holding.lock().expect("proxy lock") = true;
        }
        if *state.half_open.lock().expect("proxy lock") == Some(id) {
            continue;
        }
        state.turns.lock().expect("proxy lock").0 = true;
        if server.write_all(chunk).is_err() {
            break;
        }
        let mut pattern = state.half_open_pattern.lock().expect("proxy lock");
        if pattern
            .as_ref()
            .is_some_and(|p| chunk.windows(p.len()).any(|w| w == p.as_slice()))
        {
            *pattern = None;
            *state.half_open.lock().expect("proxy lock") = Some(id);
        }
    }
    if *state.half_open.lock().expect("proxy lock") == Some(id) {
        // The server is never told.
        state.kept.lock().expect("proxy lock").push(server);
        return;
    }
    let _ = server.shutdown(Shutdown::Write);
}

fn server_to_client(mut server: TcpStream, mut client: TcpStream, state: &State, id: u64) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        state.wait_unpaused(id);
        while *state.holding.lock().expect("proxy lock") {
            std::thread::sleep(Duration::from_millis(5));
        }
        if *state.half_open.lock().expect("proxy lock") == Some(id) {
            continue;
        }
        if state.cut.load(Ordering::SeqCst) {
            // The answer is lost: the client sees its connection end.
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        {
            let mut turns = state.turns.lock().expect("proxy lock");
            if turns.0 {
                *turns = (false, turns.1 + 1);
            }
        }
        if client.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
}

/// The server's address (first host and port of `url`), for a proxy.
pub fn upstream_of(url: &str) -> SocketAddr {
    use idemstore::postgres::tokio_postgres::config::{Config, Host};
    let config: Config = url.parse().expect("a PostgreSQL URL");
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let addr = format!("{host}:{port}");
    std::net::ToSocketAddrs::to_socket_addrs(&addr)
        .expect("resolving the server")
        .next()
        .expect("an address")
}

/// `url` with its host and port replaced by the proxy's, as a key=value
/// connection string (user, password and database kept).
pub fn via(url: &str, proxy: &Proxy) -> String {
    use idemstore::postgres::tokio_postgres::config::Config;
    let config: Config = url.parse().expect("a PostgreSQL URL");
    let mut out = format!("host=127.0.0.1 port={}", proxy.port());
    if let Some(user) = config.get_user() {
        out.push_str(&format!(" user={user}"));
    }
    if let Some(pw) = config.get_password() {
        out.push_str(&format!(" password={}", String::from_utf8_lossy(pw)));
    }
    if let Some(db) = config.get_dbname() {
        out.push_str(&format!(" dbname={db}"));
    }
    out
}

/// How long a test waits for something that must happen (a hang guard).
pub const HANG_GUARD: Duration = Duration::from_secs(60);
