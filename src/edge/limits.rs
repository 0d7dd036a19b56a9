//! File descriptor budget: the soft `RLIMIT_NOFILE` is raised to the hard
//! limit at start, and the descriptors are shared out per class of
//! connection, each class with its own semaphore, so that one class at its
//! limit (public HTTPS clients, or the clients of one TCP reservation) never
//! leaves the others (agents, the control API) without a descriptor.
//!
//! Every connection holds one permit of its class for as long as its socket
//! is open. A connection on the HTTPS port starts in the `handshakes` class
//! (TLS handshake and first request head, bounded in time), then moves to
//! the class its first request belongs to.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{info, warn};

/// Descriptors kept for everything that is not a connection: the store,
/// listeners, certificate files, the ACME client, logs.
pub const RESERVED_FDS: u64 = 64;

/// Raises the soft limit of open files to the hard limit; returns the soft
/// limit now in force.
#[allow(clippy::unnecessary_cast)] // rlim_t is not u64 on every libc.
pub fn raise_nofile() -> u64 {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            warn!(error = %std::io::Error::last_os_error(), "cannot read RLIMIT_NOFILE; assuming 1024");
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                info!(from = lim.rlim_cur as u64, to = lim.rlim_max as u64, "raised the open file limit");
                return lim.rlim_max as u64;
            }
            warn!(error = %std::io::Error::last_os_error(), soft = lim.rlim_cur as u64, "cannot raise RLIMIT_NOFILE");
        }
        lim.rlim_cur as u64
    }
}

/// The class of a connection, for its share of descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// On the HTTPS port, before its first request head is read.
    Handshake,
    /// A public HTTPS (or plain HTTP) client of a published host.
    Public,
    /// A client of a TCP reservation (all ports together; each port also has its own cap).
    Tcp,
    /// An agent's tunnel connection.
    Agent,
    /// A control API client.
    Control,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Handshake => "handshake",
            Class::Public => "public",
            Class::Tcp => "tcp",
            Class::Agent => "agent",
            Class::Control => "control",
        }
    }
}

/// The descriptors of each class (see the module docs).
#[derive(Debug)]
pub struct FdBudget {
    handshake: Arc<Semaphore>,
    public: Arc<Semaphore>,
    tcp: Arc<Semaphore>,
    agent: Arc<Semaphore>,
    control: Arc<Semaphore>,
    /// Connections one TCP reservation may hold at once.
    pub tcp_per_port: usize,
    sizes: [usize; 5],
}

impl FdBudget {
    /// Shares `nofile` (less [`RESERVED_FDS`]): public 50 %, TCP 20 %,
    /// handshakes, agents and the control API 10 % each; public HTTPS at most
    /// `max_public`, one TCP port at most `max_per_port`.
    pub fn new(nofile: u64, max_public: usize, max_per_port: usize) -> FdBudget {
        let usable = nofile.saturating_sub(RESERVED_FDS).max(50) as usize;
        let share = |percent: usize| (usable * percent / 100).max(1);
        let (handshake, public, tcp, agent, control) =
            (share(10), share(50).min(max_public.max(1)), share(20), share(10), share(10));
        let tcp_per_port = max_per_port.clamp(1, tcp);
        FdBudget {
            handshake: Arc::new(Semaphore::new(handshake)),
            public: Arc::new(Semaphore::new(public)),
            tcp: Arc::new(Semaphore::new(tcp)),
            agent: Arc::new(Semaphore::new(agent)),
            control: Arc::new(Semaphore::new(control)),
            tcp_per_port,
            sizes: [handshake, public, tcp, agent, control],
        }
    }

    fn semaphore(&self, class: Class) -> &Arc<Semaphore> {
        match class {
            Class::Handshake => &self.handshake,
            Class::Public => &self.public,
            Class::Tcp => &self.tcp,
            Class::Agent => &self.agent,
            Class::Control => &self.control,
        }
    }

    /// A descriptor of `class`, if it has one left.
    pub fn try_acquire(&self, class: Class) -> Option<OwnedSemaphorePermit> {
        self.semaphore(class).clone().try_acquire_owned().ok()
    }

    /// How many descriptors `class` has in all.
    pub fn size(&self, class: Class) -> usize {
        let i = [Class::Handshake, Class::Public, Class::Tcp, Class::Agent, Class::Control]
            .iter()
            .position(|c| *c == class)
            .expect("every class is listed");
        self.sizes[i]
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        format!(
            "handshake={} public={} tcp={} (per port {}) agent={} control={}",
            self.sizes[0], self.sizes[1], self.sizes[2], self.tcp_per_port, self.sizes[3], self.sizes[4]
        )
    }
}

/// At most one log line per [`LOG_EVERY`] for a repeated event (refused
/// connections, refused handshakes): an attacker cannot flood the log.
pub const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Counts a repeated event and says when to write a line about it.
#[derive(Debug, Default)]
pub struct LogEvery {
    last: Option<tokio::time::Instant>,
    since: u64,
}

impl LogEvery {
    /// Counts one event; `Some(n)`: write a line now, `n` events went unlogged since the last one.
    pub fn tick(&mut self) -> Option<u64> {
        let now = tokio::time::Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            self.since += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

/// Refused tunnel handshakes per source address: after `max` in one
/// `window`, the address is refused at once (no key lookup) until the window ends.
#[derive(Debug)]
pub struct PerAddress {
    window: std::time::Duration,
    max: u32,
    seen: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, (tokio::time::Instant, u32)>>,
}

/// Addresses remembered at most (expired ones are dropped first).
const MAX_ADDRESSES: usize = 16_384;

impl PerAddress {
    pub fn new(max: u32, window: std::time::Duration) -> PerAddress {
        PerAddress { window, max: max.max(1), seen: Default::default() }
    }

    /// `Some(time left)` while `ip` is over its limit.
    pub fn blocked(&self, ip: std::net::IpAddr) -> Option<std::time::Duration> {
        let seen = self.seen.lock().expect("poisoned");
        let (start, n) = seen.get(&ip)?;
        let left = self.window.checked_sub(start.elapsed())?;
        (*n >= self.max && !left.is_zero()).then_some(left)
    }

    /// Counts one refusal of `ip`.
    pub fn refused(&self, ip: std::net::IpAddr) {
        let now = tokio::time::Instant::now();
        let mut seen = self.seen.lock().expect("poisoned");
        if seen.len() >= MAX_ADDRESSES {
            seen.retain(|_, (start, _)| now.duration_since(*start) < self.window);
            if seen.len() >= MAX_ADDRESSES {
                seen.clear();
            }
        }
        let entry = seen.entry(ip).or_insert((now, 0));
        if now.duration_since(entry.0) >= self.window {
            *entry = (now, 0);
        }
        entry.1 = entry.1.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_of_a_small_and_a_large_limit() {
        let b = FdBudget::new(1024, 10_000, 1_000);
        assert_eq!(b.size(Class::Public), 480);
        assert_eq!(b.size(Class::Tcp), 192);
        assert_eq!(b.tcp_per_port, 192);
        assert_eq!(b.size(Class::Agent), 96);
        let total: usize = [Class::Handshake, Class::Public, Class::Tcp, Class::Agent, Class::Control]
            .iter()
            .map(|c| b.size(*c))
            .sum();
        assert!(total as u64 <= 1024 - RESERVED_FDS, "{total}");
        let b = FdBudget::new(1 << 20, 10_000, 1_000);
        assert_eq!(b.size(Class::Public), 10_000);
        assert_eq!(b.tcp_per_port, 1_000);
        let one = b.try_acquire(Class::Agent).unwrap();
        drop(one);
    }

    #[tokio::test(start_paused = true)]
    async fn an_address_over_its_refusals_waits_for_the_window() {
        let limit = PerAddress::new(3, std::time::Duration::from_secs(10));
        let (a, b) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        for _ in 0..3 {
            assert_eq!(limit.blocked(a), None);
            limit.refused(a);
        }
        assert!(limit.blocked(a).is_some());
        assert_eq!(limit.blocked(b), None, "other addresses are not held back");
        tokio::time::advance(std::time::Duration::from_secs(10)).await;
        assert_eq!(limit.blocked(a), None);
    }

    #[tokio::test(start_paused = true)]
    async fn one_line_per_period() {
        let mut log = LogEvery::default();
        assert_eq!(log.tick(), Some(0));
        assert_eq!((log.tick(), log.tick()), (None, None));
        tokio::time::advance(LOG_EVERY).await;
        assert_eq!(log.tick(), Some(2));
    }
}
