//! The edge's Prometheus metrics, one registry.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::status::traffic::TunnelCounters;

pub type Labels = Vec<(&'static str, String)>;

pub struct Metrics {
    registry: Registry,
    pub tunnels_connected: Gauge,
    pub streams_open: Gauge,
    bytes: Family<Labels, Counter>,
    handshake_failures: Family<Labels, Counter>,
    pub public_connections_rejected: Counter,
    /// Connections closed because their class had no file descriptor left.
    connections_refused: Family<Labels, Counter>,
    /// ACME certificate jobs by result (`issued`, `failed`, `transient`, `dns_mismatch`).
    pub acme_orders: Family<Labels, Counter>,
    /// Reloads of the edge's own certificate files by result (`reloaded`, `failed`).
    pub tls_reloads: Family<Labels, Counter>,
    /// UDP flows open now.
    pub udp_flows: Gauge,
    /// UDP flows started, and ended by reason (`idle`, `agent`, `released`).
    pub udp_flows_started: Counter,
    pub udp_flows_ended: Family<Labels, Counter>,
    /// New UDP flows refused by a cap (`port`, `edge`).
    pub udp_flows_refused: Family<Labels, Counter>,
    /// UDP datagrams dropped by direction (`in` toward the agent, `out`
    /// toward the client) and reason (`queue_full`, `oversize`, `no_agent`,
    /// `socket_full`).
    pub udp_datagrams_dropped: Family<Labels, Counter>,
    /// The `bytes` counters by reservation name: looked up on every stream,
    /// without building the label set each time.
    byte_counters: RwLock<HashMap<Arc<str>, ByteCounters>>,
}

/// The two `bytes` counters of one reservation, and its request counters
/// (for the status page; not exported).
#[derive(Clone)]
pub struct ByteCounters {
    /// Public to agent.
    pub inbound: Counter,
    /// Agent to public.
    pub outbound: Counter,
    /// Requests and their outcome.
    pub tunnel: Arc<TunnelCounters>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("culvert_edge");
        let tunnels_connected = Gauge::default();
        registry.register("tunnels_connected", "Agent connections currently open", tunnels_connected.clone());
        let streams_open = Gauge::default();
        registry.register("streams_open", "Streams currently open on tunnels", streams_open.clone());
        let bytes = Family::<Labels, Counter>::default();
        registry.register(
            "bytes",
            "Bytes carried per reservation; direction in = public to agent, out = agent to public",
            bytes.clone(),
        );
        let handshake_failures = Family::<Labels, Counter>::default();
        registry.register(
            "handshake_failures",
            "Refused or failed tunnel handshakes by reason",
            handshake_failures.clone(),
        );
        let public_connections_rejected = Counter::default();
        registry.register(
            "public_connections_rejected",
            "Public connections closed on accept because the limit was reached",
            public_connections_rejected.clone(),
        );
        let connections_refused = Family::<Labels, Counter>::default();
        registry.register(
            "connections_refused",
            "Connections closed because their class (handshake, public, tcp, agent, control) had no file descriptor left",
            connections_refused.clone(),
        );
        let acme_orders = Family::<Labels, Counter>::default();
        registry.register(
            "acme_orders",
            "ACME certificate jobs (DNS check and order) by result: issued, failed, transient, dns_mismatch",
            acme_orders.clone(),
        );
        let tls_reloads = Family::<Labels, Counter>::default();
        registry.register(
            "tls_certificate_reloads",
            "Reloads of the --tls-cert/--tls-key files by result: reloaded, failed (the previous certificate is kept)",
            tls_reloads.clone(),
        );
        let udp_flows = Gauge::default();
        registry.register("udp_flows", "UDP flows open now", udp_flows.clone());
        let udp_flows_started = Counter::default();
        registry.register("udp_flows_started", "UDP flows started", udp_flows_started.clone());
        let udp_flows_ended = Family::<Labels, Counter>::default();
        registry.register(
            "udp_flows_ended",
            "UDP flows ended by reason: idle, agent (the agent or its backend ended it), released, no_agent",
            udp_flows_ended.clone(),
        );
        let udp_flows_refused = Family::<Labels, Counter>::default();
        registry.register(
            "udp_flows_refused",
            "New UDP flows refused by a cap: port (--max-udp-flows-per-port), edge (--max-udp-flows)",
            udp_flows_refused.clone(),
        );
        let udp_datagrams_dropped = Family::<Labels, Counter>::default();
        registry.register(
            "udp_datagrams_dropped",
            "UDP datagrams dropped by direction (in = toward the agent, out = toward the client) and reason: queue_full, oversize, refused (no flow), socket_full",
            udp_datagrams_dropped.clone(),
        );
        Metrics {
            udp_flows,
            udp_flows_started,
            udp_flows_ended,
            udp_flows_refused,
            udp_datagrams_dropped,
            registry,
            acme_orders,
            tls_reloads,
            tunnels_connected,
            streams_open,
            bytes,
            handshake_failures,
            public_connections_rejected,
            connections_refused,
            byte_counters: RwLock::default(),
        }
    }
}

impl Metrics {
    /// The byte counters of one reservation (by its public name).
    pub fn bytes(&self, reservation: &str) -> ByteCounters {
        if let Some(c) = self.byte_counters.read().expect("poisoned").get(reservation) {
            return c.clone();
        }
        let family = |direction: &str| {
            self.bytes
                .get_or_create(&vec![
                    ("reservation", reservation.to_string()),
                    ("direction", direction.into()),
                ])
                .clone()
        };
        let counters =
            ByteCounters { inbound: family("in"), outbound: family("out"), tunnel: Arc::default() };
        let mut map = self.byte_counters.write().expect("poisoned");
        map.entry(Arc::from(reservation)).or_insert(counters).clone()
    }

    /// The counters of a reservation that carried traffic, if it did.
    pub fn tunnel(&self, reservation: &str) -> Option<ByteCounters> {
        self.byte_counters.read().expect("poisoned").get(reservation).cloned()
    }

    /// The counters of every reservation that carried traffic.
    pub fn tunnels(&self) -> Vec<(Arc<str>, ByteCounters)> {
        let map = self.byte_counters.read().expect("poisoned");
        map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    pub fn connection_refused(&self, class: super::limits::Class) {
        self.connections_refused.get_or_create(&vec![("class", class.name().to_string())]).inc();
    }

    /// Drops the counters of a released reservation.
    pub fn forget(&self, reservation: &str) {
        if self.byte_counters.write().expect("poisoned").remove(reservation).is_some() {
            for direction in ["in", "out"] {
                self.bytes
                    .remove(&vec![("reservation", reservation.to_string()), ("direction", direction.into())]);
            }
        }
    }

    /// One UDP datagram dropped.
    pub fn udp_dropped(&self, direction: &'static str, reason: &'static str) {
        self.udp_datagrams_dropped
            .get_or_create(&vec![("direction", direction.to_string()), ("reason", reason.to_string())])
            .inc();
    }

    pub fn handshake_failed(&self, reason: &'static str) {
        self.handshake_failures.get_or_create(&vec![("reason", reason.to_string())]).inc();
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
