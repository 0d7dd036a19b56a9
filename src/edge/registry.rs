//! Live agent connections, grouped by the reservation they serve. Streams go
//! to the connection with the fewest open streams that is not draining.
//!
//! A freshly started edge (a restart, one edge of several coming back) has
//! no agent yet: for [`AGENT_RETURN_GRACE`] after the start, a stream for a
//! reservation no agent has connected to since waits for one
//! ([`Registry::pick_or_wait`]) instead of failing, as agents reconnect
//! within a fraction of a second.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use crate::api::Protocol;
use crate::constants::{
    AGENT_RETURN_GRACE, DEFAULT_MAX_TUNNEL_STREAMS, EDGE_UPLOAD_BUDGET, TUNNEL_STREAM_WAIT,
    TUNNEL_UPLOAD_BUDGET,
};
use crate::tunnel::budget::Budget;
use crate::tunnel::client::Sender;
use crate::tunnel::ws::Control;

/// Who an agent connection is and where it comes from (for the status page).
#[derive(Debug, Clone)]
pub struct Origin {
    /// The agent's own id (`culvert-agent-id`), `-` when it sent none.
    pub agent_id: String,
    /// The agent's address as the edge sees it.
    pub peer: SocketAddr,
    /// The tunnel protocol version it spoke.
    pub protocol_version: u32,
    /// The TLS cipher suite agreed (`TLS13_AES_128_GCM_SHA256`, …).
    pub cipher: &'static str,
    /// Unix seconds of the connection.
    pub since: u64,
}

/// One agent connection.
pub struct AgentConn {
    pub id: u64,
    pub key_id: String,
    pub reservation_id: String,
    pub origin: Origin,
    /// What the connection's key publishes.
    pub protocol: Protocol,
    pub sender: Sender,
    pub control: Arc<Control>,
    /// What the connection may hold of public clients' uploads.
    pub budget: Arc<Budget>,
    /// Cancelled to close the connection (key revoked, reservation released).
    pub cancel: CancellationToken,
    open_streams: AtomicUsize,
}

impl AgentConn {
    pub fn usable(&self) -> bool {
        !self.control.peer_is_draining() && !self.sender.is_closed() && !self.cancel.is_cancelled()
    }

    /// Streams open on this connection.
    pub fn streams(&self) -> usize {
        self.open_streams.load(Ordering::Relaxed)
    }
}

/// The moving parts of a connection: its HTTP/2 sender, its control
/// messages, its upload budget.
pub struct Link {
    pub sender: Sender,
    pub control: Arc<Control>,
    pub budget: Arc<Budget>,
}

/// Held while a stream is open on a connection.
pub struct StreamGuard {
    conn: Arc<AgentConn>,
    gauge: Gauge,
    /// The edge-wide stream slot ([`Registry::stream_slot`]), if it holds one.
    slot: Option<StreamSlot>,
}

impl StreamGuard {
    pub fn conn(&self) -> &Arc<AgentConn> {
        &self.conn
    }

    /// Holds `slot` until the stream ends.
    pub fn with_slot(mut self, slot: StreamSlot) -> Self {
        self.slot = Some(slot);
        self
    }
}

/// One of the edge's tunnel streams ([`Registry::stream_slot`]).
pub struct StreamSlot(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.conn.open_streams.fetch_sub(1, Ordering::Relaxed) == 1 {
            // No stream open: whatever HTTP/2 dropped unsent is not held.
            self.conn.budget.release_all();
        }
        self.gauge.dec();
    }
}

pub struct Registry {
    by_reservation: Mutex<HashMap<String, Vec<Arc<AgentConn>>>>,
    /// Handshakes accepted but not registered yet, per key (so the per-key
    /// limit holds for agents that connect at the same moment).
    pending: Arc<Mutex<HashMap<String, usize>>>,
    next_id: AtomicU64,
    /// Streams open across all connections.
    streams_open: Gauge,
    /// What the edge may hold of public clients' uploads, all tunnels together.
    budget: Arc<Budget>,
    /// When the edge started, and the reservations an agent connected for
    /// since (the grace of [`Registry::pick_or_wait`]).
    started: Instant,
    seen: Mutex<HashSet<String>>,
    /// Woken on every new connection.
    arrived: tokio::sync::Notify,
    /// Tunnel streams the edge may open now, all tunnels together.
    slots: Arc<tokio::sync::Semaphore>,
}

impl Registry {
    pub fn new(streams_open: Gauge) -> Self {
        Registry {
            by_reservation: Mutex::default(),
            pending: Arc::default(),
            next_id: AtomicU64::new(0),
            streams_open,
            budget: Budget::new(EDGE_UPLOAD_BUDGET, None),
            started: Instant::now(),
            seen: Mutex::default(),
            arrived: tokio::sync::Notify::new(),
            slots: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_TUNNEL_STREAMS)),
        }
    }

    /// At most `max` tunnel streams open at once, all tunnels together.
    pub fn with_stream_limit(mut self, max: usize) -> Self {
        self.slots = Arc::new(tokio::sync::Semaphore::new(max.max(1)));
        self
    }

    /// One of the edge's tunnel streams, waiting for one to end while all are
    /// open (the request waits, its client unread), for at most
    /// [`TUNNEL_STREAM_WAIT`]. This bounds what the edge buffers of
    /// responses: a stream window for each stream, no more.
    pub async fn stream_slot(&self) -> Option<StreamSlot> {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Some(StreamSlot(p));
        }
        tracing::debug!("every tunnel stream of the edge is open; waiting for one to end");
        match tokio::time::timeout(TUNNEL_STREAM_WAIT, self.slots.clone().acquire_owned()).await {
            Ok(Ok(p)) => Some(StreamSlot(p)),
            _ => None,
        }
    }

    /// A new tunnel connection's upload budget (part of the edge's).
    pub fn tunnel_budget(&self) -> Arc<Budget> {
        Budget::new(TUNNEL_UPLOAD_BUDGET, Some(self.budget.clone()))
    }

    /// Upload bytes the edge holds now, all tunnels together.
    pub fn upload_bytes_held(&self) -> usize {
        self.budget.held()
    }

    /// Registers a connection and returns it.
    pub fn add(
        &self,
        key_id: String,
        reservation_id: String,
        origin: Origin,
        protocol: Protocol,
        link: Link,
    ) -> Arc<AgentConn> {
        let Link { sender, control, budget } = link;
        let conn = Arc::new(AgentConn {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key_id,
            reservation_id: reservation_id.clone(),
            origin,
            protocol,
            sender,
            control,
            budget,
            cancel: CancellationToken::new(),
            open_streams: AtomicUsize::new(0),
        });
        self.seen.lock().expect("poisoned").insert(reservation_id.clone());
        self.by_reservation.lock().expect("poisoned").entry(reservation_id).or_default().push(conn.clone());
        self.arrived.notify_waiters();
        conn
    }

    pub fn remove(&self, conn: &AgentConn) {
        let mut map = self.by_reservation.lock().expect("poisoned");
        if let Some(list) = map.get_mut(&conn.reservation_id) {
            list.retain(|c| c.id != conn.id);
            if list.is_empty() {
                map.remove(&conn.reservation_id);
            }
        }
    }

    /// Picks a connection of `protocol` for a new stream of `reservation_id`,
    /// skipping `tried`.
    pub fn pick(&self, reservation_id: &str, protocol: Protocol, tried: &[u64]) -> Option<StreamGuard> {
        let map = self.by_reservation.lock().expect("poisoned");
        let conn = map
            .get(reservation_id)?
            .iter()
            .filter(|c| c.protocol == protocol && c.usable() && !tried.contains(&c.id))
            .min_by_key(|c| c.open_streams.load(Ordering::Relaxed))?
            .clone();
        conn.open_streams.fetch_add(1, Ordering::Relaxed);
        self.streams_open.inc();
        Some(StreamGuard { conn, gauge: self.streams_open.clone(), slot: None })
    }

    /// Every connection, by reservation id.
    pub fn connections(&self) -> HashMap<String, Vec<Arc<AgentConn>>> {
        self.by_reservation.lock().expect("poisoned").clone()
    }

    /// Resolves when the next agent connection is added (any reservation's);
    /// `enable` it before looking, so an arrival in between is not missed.
    pub fn arrival(&self) -> tokio::sync::futures::Notified<'_> {
        self.arrived.notified()
    }

    /// [`Registry::pick`]; but on an edge that started less than
    /// [`AGENT_RETURN_GRACE`] ago, for a reservation no agent connected for
    /// since, first waits for one until the grace is over.
    pub async fn pick_or_wait(
        &self,
        reservation_id: &str,
        protocol: Protocol,
        tried: &[u64],
    ) -> Option<StreamGuard> {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the check: an agent that arrives in between wakes us.
            arrived.as_mut().enable();
            if let Some(guard) = self.pick(reservation_id, protocol, tried) {
                return Some(guard);
            }
            let left = AGENT_RETURN_GRACE.saturating_sub(self.started.elapsed());
            if left.is_zero()
                || !tried.is_empty()
                || self.seen.lock().expect("poisoned").contains(reservation_id)
            {
                return None;
            }
            tokio::time::timeout(left, arrived).await.ok()?;
        }
    }

    /// Connections open with this tunnel key.
    pub fn count_for_key(&self, key_id: &str) -> usize {
        let map = self.by_reservation.lock().expect("poisoned");
        map.values().flatten().filter(|c| c.key_id == key_id && !c.cancel.is_cancelled()).count()
    }

    /// Holds one of `max` connection slots of a key until the connection is
    /// registered (or fails); `None` when all are taken.
    pub fn reserve_slot(&self, key_id: &str, max: usize) -> Option<PendingSlot> {
        let mut pending = self.pending.lock().expect("poisoned");
        let waiting = pending.get(key_id).copied().unwrap_or(0);
        if self.count_for_key(key_id) + waiting >= max {
            return None;
        }
        *pending.entry(key_id.to_string()).or_default() += 1;
        Some(PendingSlot { pending: self.pending.clone(), key_id: key_id.to_string() })
    }

    /// Closes every connection whose key is not live or whose reservation is gone.
    pub fn close_invalid(&self, live_keys: &HashSet<String>, reservation_exists: impl Fn(&str) -> bool) {
        let map = self.by_reservation.lock().expect("poisoned");
        for conn in map.values().flatten() {
            if !live_keys.contains(&conn.key_id) || !reservation_exists(&conn.reservation_id) {
                tracing::info!(key = %conn.key_id, conn = conn.id, "closing tunnel connection: key revoked or reservation released");
                conn.cancel.cancel();
            }
        }
    }

    /// Closes every connection `closing` picks (a revoked key, a released reservation).
    pub fn close_where(&self, closing: impl Fn(&AgentConn) -> bool) {
        let map = self.by_reservation.lock().expect("poisoned");
        for conn in map.values().flatten() {
            if closing(conn) {
                tracing::info!(key = %conn.key_id, conn = conn.id, "closing tunnel connection: key revoked or reservation released");
                conn.cancel.cancel();
            }
        }
    }

    /// Whether a usable connection of `protocol` serves `reservation_id`.
    pub fn serves(&self, reservation_id: &str, protocol: Protocol) -> bool {
        let map = self.by_reservation.lock().expect("poisoned");
        map.get(reservation_id).is_some_and(|l| l.iter().any(|c| c.protocol == protocol && c.usable()))
    }

    /// Closes everything (shutdown).
    pub fn close_all(&self) {
        for conn in self.by_reservation.lock().expect("poisoned").values().flatten() {
            conn.cancel.cancel();
        }
    }
}

/// A connection slot held between the handshake and the registration.
pub struct PendingSlot {
    pending: Arc<Mutex<HashMap<String, usize>>>,
    key_id: String,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut pending = self.pending.lock().expect("poisoned");
        if let Some(n) = pending.get_mut(&self.key_id) {
            *n -= 1;
            if *n == 0 {
                pending.remove(&self.key_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use hyper_util::rt::{TokioExecutor, TokioIo};

    use super::*;

    /// The client half of a real HTTP/2 connection over an in-memory pipe;
    /// the server answers every request with 200.
    async fn sender() -> Sender {
        let (client, server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(|_req| async {
                Ok::<_, Infallible>(hyper::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
            });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(server), svc)
                .await;
        });
        let (send, conn) = crate::tunnel::client::handshake(client).await.unwrap();
        tokio::spawn(conn);
        send
    }

    async fn add(r: &Registry, key: &str, reservation: &str, protocol: Protocol) -> Arc<AgentConn> {
        let origin = Origin {
            agent_id: "agent".into(),
            peer: "127.0.0.1:1".parse().unwrap(),
            protocol_version: 1,
            cipher: "TLS13_AES_128_GCM_SHA256",
            since: 0,
        };
        let link = Link { sender: sender().await, control: Arc::default(), budget: r.tunnel_budget() };
        r.add(key.into(), reservation.into(), origin, protocol, link)
    }

    #[tokio::test]
    async fn streams_go_to_the_least_loaded_usable_connection() {
        let gauge = Gauge::default();
        let r = Registry::new(gauge.clone());
        let a = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        let b = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        let tls = add(&r, "tk_2", "rs_1", Protocol::Tls).await;
        let pick = |tried: &[u64]| r.pick("rs_1", Protocol::Http, tried);
        let id = |g: &Option<StreamGuard>| g.as_ref().map(|g| g.conn().id);

        let first = pick(&[]);
        assert_eq!(id(&first), Some(a.id));
        let second = pick(&[]);
        assert_eq!(id(&second), Some(b.id), "a has a stream open, b none");
        let third = pick(&[]);
        assert_eq!(id(&third), Some(a.id), "a tie goes to the first");
        assert_eq!(gauge.get(), 3);
        drop((first, third));
        assert_eq!(gauge.get(), 1);
        assert_eq!(id(&pick(&[])), Some(a.id), "a is idle again");
        // A retry skips the connections tried already.
        assert_eq!(id(&pick(&[a.id])), Some(b.id));
        assert_eq!(id(&pick(&[a.id, b.id])), None);
        // By protocol: the tls key's connection serves tls only.
        assert_eq!(r.pick("rs_1", Protocol::Tls, &[]).map(|g| g.conn().id), Some(tls.id));
        assert!(r.pick("rs_2", Protocol::Http, &[]).is_none());
        assert!(r.serves("rs_1", Protocol::Http) && r.serves("rs_1", Protocol::Tls));
        assert!(!r.serves("rs_1", Protocol::Tcp));
    }

    #[tokio::test]
    async fn a_fresh_edge_waits_for_agents_that_were_never_there() {
        let r = Arc::new(Registry::new(Gauge::default()));
        // Nothing yet: the stream waits, and goes to the agent once it is there.
        let waiting = tokio::spawn({
            let r = r.clone();
            async move { r.pick_or_wait("rs_1", Protocol::Http, &[]).await.map(|g| g.conn().id) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        let a = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        assert_eq!(waiting.await.unwrap(), Some(a.id));
        // An agent was there and left: no waiting, the tunnel is offline.
        r.remove(&a);
        let t0 = Instant::now();
        assert!(r.pick_or_wait("rs_1", Protocol::Http, &[]).await.is_none());
        assert!(t0.elapsed() < AGENT_RETURN_GRACE / 2);
        // After the grace: no waiting either.
        let mut old = Registry::new(Gauge::default());
        if let Some(before) = old.started.checked_sub(AGENT_RETURN_GRACE) {
            old.started = before;
            assert!(old.pick_or_wait("rs_2", Protocol::Http, &[]).await.is_none());
        }
    }

    #[tokio::test]
    async fn closing_connections_take_no_new_streams() {
        let r = Registry::new(Gauge::default());
        let a = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        let b = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        a.cancel.cancel();
        assert_eq!(r.pick("rs_1", Protocol::Http, &[]).map(|g| g.conn().id), Some(b.id));
        assert_eq!(r.count_for_key("tk_1"), 1, "a closing connection holds no slot");
        r.remove(&b);
        assert!(r.pick("rs_1", Protocol::Http, &[]).is_none());
        assert!(!r.serves("rs_1", Protocol::Http));
        r.remove(&a);
        assert!(r.by_reservation.lock().unwrap().is_empty(), "no empty lists are kept");
    }

    #[tokio::test]
    async fn revoked_keys_and_released_reservations_close_their_connections() {
        let r = Registry::new(Gauge::default());
        let live = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        let revoked = add(&r, "tk_2", "rs_1", Protocol::Http).await;
        let released = add(&r, "tk_3", "rs_2", Protocol::Tcp).await;
        let keys: HashSet<String> = ["tk_1".to_string(), "tk_3".to_string()].into();
        r.close_invalid(&keys, |id| id == "rs_1");
        let closed = |c: &AgentConn| c.cancel.is_cancelled();
        assert_eq!((closed(&live), closed(&revoked), closed(&released)), (false, true, true));
        r.close_all();
        assert!(closed(&live));
    }

    #[tokio::test]
    async fn each_key_has_a_fixed_number_of_slots() {
        let r = Registry::new(Gauge::default());
        let one = r.reserve_slot("tk_1", 2).expect("a free slot");
        let two = r.reserve_slot("tk_1", 2).expect("a second slot");
        assert!(r.reserve_slot("tk_1", 2).is_none(), "two handshakes pending");
        assert!(r.reserve_slot("tk_2", 2).is_some(), "slots are per key");
        // Registered: the slot is released, the connection holds it instead.
        let conn = add(&r, "tk_1", "rs_1", Protocol::Http).await;
        drop(one);
        assert!(r.reserve_slot("tk_1", 2).is_none(), "one connected, one pending");
        drop(two);
        let three = r.reserve_slot("tk_1", 2);
        assert!(three.is_some());
        assert!(r.reserve_slot("tk_1", 2).is_none());
        drop(three);
        r.remove(&conn);
        assert!(r.pending.lock().unwrap().is_empty());
        assert!(r.reserve_slot("tk_1", 2).is_some());
    }
}
