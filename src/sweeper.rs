//! The background sweeper: a thread that evicts records past retention
//! every interval, for any engine.

use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::Result;

/// The background sweeper: a thread that calls `sweep` every interval until
/// the store is dropped.
pub(crate) struct Sweeper {
    stop: Option<Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl Sweeper {
    /// Starts a sweeper over `target`; it holds only a weak reference, so
    /// dropping the store ends it.
    pub(crate) fn start<T, F>(target: &Arc<T>, interval: Duration, sweep: F) -> Result<Sweeper>
    where
        T: Send + Sync + 'static,
        F: Fn(&T) -> Result<usize> + Send + 'static,
    {
        let (stop, stopped) = channel::<()>();
        let weak: Weak<T> = Arc::downgrade(target);
        let handle = std::thread::Builder::new()
            .name("idemstore-sweeper".into())
            .spawn(move || {
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let Some(target) = weak.upgrade() else { return };
                    match sweep(&target) {
                        Ok(n) if n > 0 => tracing::debug!(evicted = n, "sweep"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(error = %err, "background sweep failed"),
                    }
                }
            })
            .map_err(crate::error::Error::storage)?;
        Ok(Sweeper {
            stop: Some(stop),
            handle: Some(handle),
        })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.stop = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
