//! The status document, version [`STATUS_VERSION`]: what `GET /status/json`
//! (admin port), `GET /_culvert/status/json` (public path), the control API's
//! `GET status` and every Server-Sent Event carry, and what
//! `culvert admin status` prints. JSON in camelCase.
//!
//! Compatibility: within a version fields are only added, never renamed,
//! removed or given another meaning; readers ignore fields they do not know.

use serde::{Deserialize, Serialize};

use crate::api::{CertificateState, Labels, Protocol, ReservationKind};

/// Version of the status document (`statusVersion`).
pub const STATUS_VERSION: u32 = 1;

/// The whole document.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// [`STATUS_VERSION`].
    pub status_version: u32,
    /// RFC 3339 UTC time the document was made.
    pub generated_at: String,
    /// The edge itself.
    pub edge: EdgeStatus,
    /// Reservations in the store.
    pub tunnels_total: usize,
    /// Reservations listed in `tunnels` (at most the `limit` asked for):
    /// those with agents first, then the busiest, then by name.
    pub tunnels_shown: usize,
    /// One entry per reservation shown.
    pub tunnels: Vec<TunnelStatus>,
}

/// The edge process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EdgeStatus {
    /// culvert's version.
    pub version: String,
    /// The tunnel protocol version the edge speaks.
    pub protocol_version: u32,
    /// `--domain`.
    pub domain: String,
    /// RFC 3339 UTC time the edge started.
    pub started_at: String,
    /// Seconds since the start.
    pub uptime_seconds: u64,
    /// The edge is draining (SIGTERM): no new public connections.
    pub draining: bool,
    /// Where the edge listens: `https`, `http`, `admin`.
    pub listeners: Vec<Listener>,
    /// TCP reservation listeners open (one per reserved port).
    pub tcp_listeners: usize,
    /// Open file descriptors against the process's soft limit.
    pub fds: Usage,
    /// Resident memory (bytes) against the cgroup's memory limit, if any.
    pub memory: Usage,
    /// Agent connections open.
    pub agents_connected: u64,
    /// Streams open on all tunnels.
    pub streams_open: u64,
    /// The store.
    pub store: StoreHealth,
    /// ACME, when `--acme` is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acme: Option<AcmeStatus>,
    /// Server-Sent Event subscribers and the events skipped for slow ones.
    pub events: EventsStatus,
}

/// One listening socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    /// `https` (public traffic, tunnels, control API), `http` or `admin`.
    pub name: String,
    /// The bound address.
    pub address: String,
}

/// A resource in use against its budget.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// In use now (`null` when it cannot be read on this system).
    pub used: Option<u64>,
    /// The budget (`null` when there is none).
    pub budget: Option<u64>,
}

/// The result of a cheap query on the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreHealth {
    /// `sqlite`.
    pub engine: String,
    /// The query succeeded.
    pub ok: bool,
    /// How long it took, milliseconds.
    pub latency_ms: f64,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// ACME orders.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcmeStatus {
    /// Host names whose DNS check or order runs now.
    pub in_flight: Vec<String>,
    /// Host names whose last attempt failed, with the error (at most 20).
    pub errors: Vec<AcmeError>,
}

/// A failed certificate attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcmeError {
    /// The host name.
    pub hostname: String,
    /// What went wrong.
    pub error: String,
    /// RFC 3339 UTC time of the next attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<String>,
}

/// Live-update stream subscribers.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventsStatus {
    /// Open streams now.
    pub subscribers: u64,
    /// Most streams served at once; more are refused with 503.
    pub max_subscribers: u64,
    /// Updates not sent because a subscriber did not read in time (a slow
    /// reader gets the latest state when it reads again, never a queue).
    pub skipped: u64,
    /// Bytes of events handed to subscriber connections since the start.
    pub bytes_sent: u64,
}

/// One reservation and what flows through it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TunnelStatus {
    /// Reservation id (`rs_…`).
    pub id: String,
    /// Host name, or `:PORT` for TCP, `udp:PORT` for UDP.
    pub name: String,
    /// Subdomain, custom domain or TCP port.
    pub kind: ReservationKind,
    /// Public URL.
    pub url: String,
    /// Id of the API key that holds the reservation.
    pub owner: String,
    /// The reservation's labels.
    pub labels: Labels,
    /// The ACME certificate (custom domains on edges with `--acme`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<CertificateState>,
    /// Agent connections serving it.
    pub agents_connected: usize,
    /// Those connections (at most 20).
    pub agents: Vec<AgentStatus>,
    /// Streams open on those.
    pub streams_open: u64,
    /// Counts since the edge started.
    pub totals: Totals,
    /// Per second, over the last history interval.
    pub rates: Rates,
    /// The rolling history, oldest first.
    pub history: History,
}

/// One agent connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// The agent's own id (`culvert-agent-id`), `-` when it sent none.
    pub agent_id: String,
    /// The edge's number for this connection.
    pub connection: u64,
    /// The agent's address as the edge sees it.
    pub address: String,
    /// RFC 3339 UTC time it connected.
    pub since: String,
    /// The tunnel protocol version it spoke.
    pub protocol_version: u32,
    /// The TLS cipher suite agreed, e.g. `TLS13_CHACHA20_POLY1305_SHA256`.
    #[serde(default)]
    pub cipher: String,
    /// What its key publishes.
    pub protocol: Protocol,
    /// The tunnel key it connected with (`tk_…`).
    pub key_id: String,
    /// Streams open on it.
    pub streams_open: u64,
}

/// Counters since the edge started. HTTP: requests; TCP and TLS
/// passthrough: connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Totals {
    /// Requests (HTTP) or connections (TCP, TLS).
    pub requests: u64,
    /// Bytes public to agent.
    pub bytes_in: u64,
    /// Bytes agent to public.
    pub bytes_out: u64,
    /// Answers 400–499.
    pub errors4xx: u64,
    /// Answers 500–599 other than `offline` (backend errors, failed tunnels).
    pub errors5xx: u64,
    /// 502 "tunnel offline": no agent was connected (TCP: connections closed for that reason).
    pub offline: u64,
}

/// Rates per second.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rates {
    /// Requests (connections) per second.
    pub requests: f64,
    /// Bytes per second, public to agent.
    pub bytes_in: f64,
    /// Bytes per second, agent to public.
    pub bytes_out: f64,
    /// Errors (4xx, 5xx, offline) per second.
    pub errors: f64,
}

/// Per-interval counts, oldest first; at most `points` entries each.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct History {
    /// Seconds per entry.
    pub interval_seconds: u64,
    /// Entries kept at most (the window is `points × intervalSeconds`).
    pub points: usize,
    /// Requests (connections) per interval.
    pub requests: Vec<u64>,
    /// Bytes in per interval.
    pub bytes_in: Vec<u64>,
    /// Bytes out per interval.
    pub bytes_out: Vec<u64>,
    /// Errors per interval.
    pub errors: Vec<u64>,
}
