//! The listeners of port reservations, TCP or UDP alike: which ports are
//! open, and the one retry pending for those that could not be bound.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use super::Edge;

/// How often a reserved port the edge could not bind is tried again.
pub const LISTEN_RETRY: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct PortListeners {
    running: Mutex<HashMap<u16, CancellationToken>>,
    /// A retry of ports that failed to bind is scheduled.
    retrying: AtomicBool,
}

impl PortListeners {
    /// Listens on exactly `ports`: stops the released, and calls
    /// `start(port, token)` for each missing one, which binds it and spawns
    /// its loop under `token` (false: it could not bind). True when a port
    /// could not be bound.
    pub fn reconcile(
        &self,
        what: &'static str,
        edge: &Arc<Edge>,
        ports: HashSet<u16>,
        mut start: impl FnMut(u16, CancellationToken) -> bool,
    ) -> bool {
        let mut running = self.running.lock().expect("poisoned");
        running.retain(|port, token| {
            let keep = ports.contains(port) && !token.is_cancelled();
            if !keep {
                token.cancel();
                info!(port, "stopped {what} listener");
            }
            keep
        });
        let mut failed = false;
        for port in ports {
            if running.contains_key(&port) {
                continue;
            }
            let token = edge.shutdown.child_token();
            if start(port, token.clone()) {
                running.insert(port, token);
            } else {
                failed = true;
            }
        }
        failed
    }

    /// Listeners open now.
    pub fn len(&self) -> usize {
        self.running.lock().expect("poisoned").len()
    }

    /// Calls `again` in [`LISTEN_RETRY`] (one retry pending at a time; none
    /// once the edge stops). `again` reaches these listeners through the edge.
    pub fn retry_later(&self, edge: &Arc<Edge>, again: fn(&Arc<Edge>)) {
        if self.retrying.swap(true, Ordering::AcqRel) {
            return;
        }
        let edge = edge.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(LISTEN_RETRY) => {}
                _ = edge.shutdown.cancelled() => return,
            }
            again(&edge);
        });
    }

    /// The pending retry has run: a later failure schedules another.
    pub fn retried(&self) {
        self.retrying.store(false, Ordering::Release);
    }
}
