//! The group-commit writer.
//!
//! One thread owns every state change. Callers queue a request on a bounded
//! channel (a full queue makes them wait: backpressure) and receive a
//! one-shot completion. The writer takes everything waiting, decides it in
//! arrival order inside one write transaction (a later request sees the
//! earlier ones), makes the whole batch durable with one commit, and only
//! then wakes every caller with its own outcome. A lone caller is never held
//! back: the writer commits as soon as the queue is empty.
//!
//! A failed commit fails every request of its batch with the storage error
//! and poisons the store: no later write is attempted until reopen
//! (DESIGN.md guarantee 6). If the writer thread is gone, every waiting and
//! later call gets [`Error::Closed`]; nothing hangs.

use std::future::{Future, IntoFuture};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use redb::{Database, Durability, ReadableTable, WriteTransaction};

use crate::audit::{self, Event};
use crate::clock::MonotonicClock;
use crate::codec;
use crate::error::{Error, Result};
use crate::expiry;
use crate::key::Key;
use crate::record::{ClaimOutcome, Ctx, Effect, Op, Record, Reply, transition};
use crate::schema::{self, BUSINESS, EXPIRY, RECORDS, guard, map_err};
use crate::stats::LiveCounters;

/// The most requests decided in one batch.
const MAX_BATCH: usize = 1024;
/// The most requests waiting for the writer before callers block.
pub(crate) const QUEUE_BOUND: usize = 4096;

/// A state change for the writer.
pub(crate) enum Command {
    /// A transition of one key.
    Op { key: Key, op: Op },
    /// Evict up to `max` expired records.
    Sweep { max: usize },
    /// Restore records from an export, all in one write, and raise the
    /// token counter to at least `token_floor`.
    Import {
        ops: Vec<(Key, Op)>,
        token_floor: u64,
    },
}

/// The writer's answer to one command.
pub(crate) enum Answer {
    Reply(Reply),
    Evicted(usize),
    /// One reply per imported record, in order.
    Imported(Vec<Result<Reply>>),
}

struct Request {
    cmd: Command,
    reply: oneshot::Sender<Result<Answer>>,
}

/// A pending answer: block on it with [`Completion::wait`] or `.await` it.
pub(crate) enum Completion {
    Ready(Result<Answer>),
    Pending(oneshot::Receiver<Result<Answer>>),
}

impl Completion {
    /// Blocks the calling thread until the writer answers.
    pub(crate) fn wait(self) -> Result<Answer> {
        match self {
            Completion::Ready(r) => r,
            Completion::Pending(rx) => rx.recv().unwrap_or(Err(Error::Closed)),
        }
    }
}

/// The future of a [`Completion`]: no runtime needed, woken by the writer.
pub(crate) enum CompletionFuture {
    Ready(Option<Result<Answer>>),
    Pending(oneshot::AsyncReceiver<Result<Answer>>),
}

impl IntoFuture for Completion {
    type Output = Result<Answer>;
    type IntoFuture = CompletionFuture;

    fn into_future(self) -> CompletionFuture {
        match self {
            Completion::Ready(r) => CompletionFuture::Ready(Some(r)),
            Completion::Pending(rx) => CompletionFuture::Pending(rx.into_future()),
        }
    }
}

impl Future for CompletionFuture {
    type Output = Result<Answer>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            CompletionFuture::Ready(r) => Poll::Ready(r.take().unwrap_or(Err(Error::Closed))),
            CompletionFuture::Pending(rx) => match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(r)) => Poll::Ready(r),
                Poll::Ready(Err(_)) => Poll::Ready(Err(Error::Closed)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// State shared by the writer and the store.
pub(crate) struct Shared {
    pub db: Arc<Database>,
    pub path: PathBuf,
    pub clock: MonotonicClock,
    pub retention_ms: u64,
    pub poisoned: AtomicBool,
    /// Counters behind `Store::stats`, bumped as audit events are published.
    pub counters: LiveCounters,
}

/// The handle to the writer thread.
pub(crate) struct Writer {
    tx: Option<SyncSender<Request>>,
    handle: Option<JoinHandle<()>>,
}

impl Writer {
    pub(crate) fn start(shared: Arc<Shared>, next_token: u64) -> Result<Writer> {
        let (tx, rx) = sync_channel(QUEUE_BOUND);
        // Read before any caller can advance it: what the file holds.
        let persisted_hwm = shared.clock.high_water_ms();
        let handle = std::thread::Builder::new()
            .name("idemstore-writer".into())
            .spawn(move || run(&shared, next_token, persisted_hwm, &rx))
            .map_err(Error::storage)?;
        Ok(Writer {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Queues `cmd`; waits while the queue is full.
    pub(crate) fn submit(&self, cmd: Command) -> Completion {
        let Some(tx) = &self.tx else {
            return Completion::Ready(Err(Error::Closed));
        };
        let (reply, rx) = oneshot::channel();
        let req = Request { cmd, reply };
        let sent = match tx.try_send(req) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(req)) => tx.send(req).map_err(|_| ()),
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        match sent {
            Ok(()) => Completion::Pending(rx),
            Err(()) => Completion::Ready(Err(Error::Closed)),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the channel lets the writer drain what is queued and stop.
        self.tx = None;
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

fn run(shared: &Shared, mut next_token: u64, mut persisted_hwm: u64, rx: &Receiver<Request>) {
    let mut batch: Vec<Request> = Vec::with_capacity(MAX_BATCH);
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(req) => batch.push(req),
                Err(_) => break,
            }
        }
        if shared.poisoned.load(Ordering::SeqCst) {
            for req in batch.drain(..) {
                let _ = req.reply.send(Err(Error::Poisoned));
            }
            continue;
        }
        let cmds: Vec<&Command> = batch.iter().map(|r| &r.cmd).collect();
        let outcome = guard(&shared.path, || {
            commit_batch(shared, &mut next_token, &cmds)
        });
        match outcome {
            Ok((answers, now)) => {
                persisted_hwm = now;
                for (req, answer) in batch.drain(..).zip(answers) {
                    let _ = req.reply.send(answer);
                }
            }
            Err(err) => {
                // Nothing of this batch is reported as done; whether it
                // reached the disk is for the reopen to find out.
                shared.poisoned.store(true, Ordering::SeqCst);
                tracing::error!(path = %shared.path.display(), error = %err, "durable write failed; store refuses writes until reopened");
                let msg = err.to_string();
                for req in batch.drain(..) {
                    let e = match &err {
                        Error::CorruptFile { path, detail } => Error::CorruptFile {
                            path: path.clone(),
                            detail: detail.clone(),
                        },
                        _ => Error::Storage(msg.clone()),
                    };
                    let _ = req.reply.send(Err(e));
                }
            }
        }
    }
    // Closing: reads may have advanced the clock's high-water mark past the
    // last commit; persist it so that a clock that stepped back cannot
    // revive a record that readers already saw expire.
    if !shared.poisoned.load(Ordering::SeqCst)
        && shared.clock.high_water_ms() > persisted_hwm
        && let Err(err) = guard(&shared.path, || commit_batch(shared, &mut next_token, &[]))
    {
        tracing::warn!(path = %shared.path.display(), error = %err, "could not persist the clock on close");
    }
}

/// Decides and commits one batch, and returns the answers and the time it
/// persisted. The outer `Err` is a storage failure of the whole batch; inner
/// errors are per request and change nothing.
fn commit_batch(
    shared: &Shared,
    next_token: &mut u64,
    cmds: &[&Command],
) -> Result<(Vec<Result<Answer>>, u64)> {
    let path = &shared.path;
    let now = shared.clock.now_ms();
    let mut txn = shared.db.begin_write().map_err(|e| map_err(path, e))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| map_err(path, e))?;
    let mut token = *next_token;
    let mut answers = Vec::with_capacity(cmds.len());
    let mut events = Vec::new();
    for cmd in cmds {
        let answer = match cmd {
            Command::Op { key, op } => {
                apply_op(shared, &txn, key, op, now, &mut token, &mut events)?
            }
            Command::Sweep { max } => Ok(Answer::Evicted(expiry::evict(
                path,
                &txn,
                now,
                *max,
                &mut events,
            )?)),
            Command::Import { ops, token_floor } => apply_import(
                shared,
                &txn,
                ops,
                *token_floor,
                now,
                &mut token,
                &mut events,
            )?,
        };
        answers.push(answer);
    }
    schema::write_counters(path, &txn, token, now)?;
    txn.commit().map_err(|e| map_err(path, e))?;
    *next_token = token;
    // Audit events and counters only for what is now durable.
    audit::publish(&shared.counters, events);
    Ok((answers, now))
}

/// Applies every record of an import in `txn` and raises the token counter
/// above every imported token. Outer `Err`: storage failure.
fn apply_import(
    shared: &Shared,
    txn: &WriteTransaction,
    ops: &[(Key, Op)],
    token_floor: u64,
    now: u64,
    next_token: &mut u64,
    events: &mut Vec<Event>,
) -> Result<Result<Answer>> {
    *next_token = (*next_token).max(token_floor);
    let mut replies = Vec::with_capacity(ops.len());
    for (key, op) in ops {
        let reply = match apply_op(shared, txn, key, op, now, next_token, events)? {
            Ok(Answer::Reply(reply)) => Ok(reply),
            Ok(_) => Err(Error::Storage("import answered with another reply".into())),
            Err(e) => Err(e),
        };
        replies.push(reply);
    }
    Ok(Ok(Answer::Imported(replies)))
}

/// Applies one transition inside `txn`, with its business-key binding and
/// expiry index entry in the same write, and collects its audit event.
/// Outer `Err`: storage failure.
fn apply_op(
    shared: &Shared,
    txn: &WriteTransaction,
    key: &Key,
    op: &Op,
    now: u64,
    next_token: &mut u64,
    events: &mut Vec<Event>,
) -> Result<Result<Answer>> {
    let path = &shared.path;
    let kb = key.to_bytes();
    let mut records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    let stored = match read_record(path, &records, &kb)? {
        Ok(r) => r,
        Err(e) => return Ok(Err(rejected(key, e, events))),
    };
    // The business-key rule needs the binding's holder, read in this write.
    let fresh = stored.as_ref().is_none_or(|r| r.is_expired_at(now));
    let holder = match op_business_key(op).filter(|_| fresh) {
        Some(bk) => match business_holder(path, txn, &records, key, bk)? {
            Ok(h) => h,
            Err(e) => return Ok(Err(rejected(key, e, events))),
        },
        None => None,
    };
    let ctx = Ctx {
        now_ms: now,
        retention_ms: shared.retention_ms,
        next_token: *next_token,
        business_holder: holder.as_ref(),
    };
    let (effect, reply) = match transition(key, stored.as_ref(), op, &ctx) {
        Ok(x) => x,
        Err(e) => return Ok(Err(rejected(key, e, events))),
    };
    let mut expiry_index = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    match &effect {
        Effect::None => {}
        Effect::Put(new) => {
            if let Some(old) = &stored
                && old.expires_ms != new.expires_ms
            {
                expiry_index
                    .remove((old.expires_ms, kb.as_slice()))
                    .map_err(|e| map_err(path, e))?;
            }
            expiry_index
                .insert((new.expires_ms, kb.as_slice()), ())
                .map_err(|e| map_err(path, e))?;
            records
                .insert(kb.as_slice(), codec::encode_record(&kb, new).as_slice())
                .map_err(|e| map_err(path, e))?;
            rebind(path, txn, key, stored.as_ref(), new, fresh)?;
            if matches!(reply, Reply::Claim(ClaimOutcome::Acquired(_))) {
                *next_token += 1;
            }
        }
        Effect::Delete => {
            if let Some(old) = &stored {
                expiry_index
                    .remove((old.expires_ms, kb.as_slice()))
                    .map_err(|e| map_err(path, e))?;
                if let Some(bk) = &old.business_key {
                    unbind(path, txn, &key.business_binding(bk), &kb)?;
                }
            }
            records
                .remove(kb.as_slice())
                .map_err(|e| map_err(path, e))?;
        }
    }
    events.extend(Event::of_transition(
        key,
        stored.as_ref(),
        op,
        &effect,
        &reply,
        now,
    ));
    Ok(Ok(Answer::Reply(reply)))
}

/// Notes the audit event of a refused request and hands the error back.
fn rejected(key: &Key, err: Error, events: &mut Vec<Event>) -> Error {
    events.extend(Event::of_error(key, &err));
    err
}

/// Reads and decodes the record stored under `kb`. Outer `Err`: storage
/// failure; inner: a corrupt record.
fn read_record(
    path: &std::path::Path,
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    kb: &[u8],
) -> Result<Result<Option<Record>>> {
    Ok(match records.get(kb).map_err(|e| map_err(path, e))? {
        Some(v) => codec::decode_record(kb, v.value()).map(Some),
        None => Ok(None),
    })
}

/// The business key a request would bind, if any.
fn op_business_key(op: &Op) -> Option<&str> {
    match op {
        Op::Claim { business_key, .. } => business_key.as_deref(),
        Op::Import { record } => record.business_key.as_deref(),
        _ => None,
    }
}

/// The record that the binding of `business_key` in `key`'s scope names,
/// if any (live or not: the transition judges). Outer `Err`: storage
/// failure; inner: the holder's record is corrupt.
fn business_holder(
    path: &std::path::Path,
    txn: &WriteTransaction,
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    key: &Key,
    business_key: &str,
) -> Result<Result<Option<Record>>> {
    let bindings = txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
    let holder_kb = bindings
        .get(key.business_binding(business_key).as_slice())
        .map_err(|e| map_err(path, e))?
        .map(|v| v.value().to_vec());
    match holder_kb {
        Some(hkb) if hkb != key.to_bytes() => read_record(path, records, &hkb),
        _ => Ok(Ok(None)),
    }
}

/// Keeps the business-key binding in step with a put of `new` over `old`:
/// a record that appears (or replaces one past retention) binds its
/// business key; a replaced record's other business key is unbound.
fn rebind(
    path: &std::path::Path,
    txn: &WriteTransaction,
    key: &Key,
    old: Option<&Record>,
    new: &Record,
    fresh: bool,
) -> Result<()> {
    let old_bk = old.and_then(|o| o.business_key.as_deref());
    let new_bk = new.business_key.as_deref();
    let kb = key.to_bytes();
    if let Some(ob) = old_bk.filter(|ob| Some(*ob) != new_bk) {
        unbind(path, txn, &key.business_binding(ob), &kb)?;
    }
    if let Some(nb) = new_bk.filter(|nb| fresh || old_bk != Some(*nb)) {
        let mut bindings = txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
        bindings
            .insert(key.business_binding(nb).as_slice(), kb.as_slice())
            .map_err(|e| map_err(path, e))?;
    }
    Ok(())
}

/// Removes the binding `binding` if it still names the record `kb` (a
/// binding taken over by another key after this record's retention ended
/// is left alone).
pub(crate) fn unbind(
    path: &std::path::Path,
    txn: &WriteTransaction,
    binding: &[u8],
    kb: &[u8],
) -> Result<()> {
    let mut bindings = txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
    let ours = bindings
        .get(binding)
        .map_err(|e| map_err(path, e))?
        .is_some_and(|v| v.value() == kb);
    if ours {
        bindings.remove(binding).map_err(|e| map_err(path, e))?;
    }
    Ok(())
}
