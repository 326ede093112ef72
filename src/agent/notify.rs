//! In-process wake-ups for [`Store::execute`](crate::Store::execute) callers
//! that wait on a key another caller of the same `Store` holds.
//!
//! The registry maps a key to an [`Event`] while somebody waits on it.
//! `execute` signals the key after its own `complete`, `fail` or `release`
//! has returned, so a waiter in the same process wakes at once instead of at
//! its next poll. The store's writer knows nothing of it: a holder in
//! another process, or one that finishes with plain
//! [`Store::complete`](crate::Store::complete), is seen at the waiter's next
//! poll.

use std::collections::HashMap;
use std::sync::Arc;

use event_listener::{Event, EventListener};
use parking_lot::Mutex;

use crate::key::Key;

/// Keys that somebody in this process waits on.
#[derive(Default)]
pub(crate) struct Waiters {
    keys: Mutex<HashMap<Key, Arc<Event>>>,
}

impl std::fmt::Debug for Waiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("keys", &self.keys.lock().len())
            .finish()
    }
}

impl Waiters {
    /// Registers interest in `key` until the returned watch is dropped.
    pub(crate) fn watch(&self, key: &Key) -> Watch<'_> {
        let event = self
            .keys
            .lock()
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Event::new()))
            .clone();
        Watch {
            waiters: self,
            key: key.clone(),
            event,
        }
    }

    /// Wakes every waiter of `key` (a no-op when nobody waits).
    pub(crate) fn notify(&self, key: &Key) {
        if let Some(event) = self.keys.lock().get(key) {
            event.notify(usize::MAX);
        }
    }
}

/// Interest in one key; the registry entry goes when its last watch does.
pub(crate) struct Watch<'a> {
    waiters: &'a Waiters,
    key: Key,
    event: Arc<Event>,
}

impl Watch<'_> {
    /// A listener for the next notification. Take it *before* looking at the
    /// record, so that a notification sent in between is not missed.
    pub(crate) fn listen(&self) -> EventListener {
        self.event.listen()
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let mut keys = self.waiters.keys.lock();
        // Two references: the registry's and ours. New watches clone under
        // the same lock, so the count cannot grow behind our back.
        if Arc::strong_count(&self.event) == 2 {
            keys.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use event_listener::Listener;
    use std::time::Duration;

    #[test]
    fn notify_wakes_a_listener_and_entries_go_with_the_last_watch() {
        let waiters = Waiters::default();
        let key = Key::new("s", "k").unwrap();
        let a = waiters.watch(&key);
        let b = waiters.watch(&key);
        let listener = a.listen();
        waiters.notify(&key);
        assert!(listener.wait_timeout(Duration::ZERO).is_some());
        drop(a);
        assert_eq!(waiters.keys.lock().len(), 1);
        drop(b);
        assert!(waiters.keys.lock().is_empty());
        // Nobody waits: nothing to wake, nothing registered.
        waiters.notify(&key);
        assert!(waiters.keys.lock().is_empty());
    }
}
