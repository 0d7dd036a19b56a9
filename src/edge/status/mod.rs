//! The status page: what the edge publishes, who is connected and what
//! traffic flows, for the person who runs it.
//!
//! - On the admin port (127.0.0.1 by default, beside `/metrics`), without a
//!   key: `/status` (the page), `/status/json` (the [`model::Status`]
//!   document), `/status/events` (Server-Sent Events, one document per
//!   [`EVENT_INTERVAL`]), `/status/page.js`, `/status/page.css`.
//! - With `--public-status`, the same under `/_culvert/status` on the public
//!   port of the edge's own domain, behind an admin key: a login form sets a
//!   session cookie ([`session`]); the login and logout posts are refused from
//!   other origins.
//! - The control API serves the document as `GET status` (admin keys), for
//!   `culvert admin status`.
//!
//! Bounded: a document lists at most `limit` tunnels ([`DEFAULT_LIMIT`],
//! at most [`MAX_LIMIT`]); an event stream makes its next document only when
//! the connection took the last one (a client that does not read costs one
//! document, never a queue), and at most [`MAX_SUBSCRIBERS`] streams are
//! served at once. The assets are compiled in (no CDN, no build step).

pub mod model;
pub(crate) mod page;
pub(crate) mod session;
pub(crate) mod traffic;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Edge;
use super::store::{ApiKeyAuth, CertificateRecord, rfc3339, unix_now};
use crate::BoxError;
use crate::api::{ApiKeyScope, Reservation, ReservationKind};
use crate::constants::{API_BODY_TIMEOUT, PROTOCOL_VERSION};
use crate::tunnel::body::{self, BoxBody};
use model::{
    AcmeError, AcmeStatus, AgentStatus, EdgeStatus, EventsStatus, Listener, STATUS_VERSION, Status,
    StoreHealth, TunnelStatus, Usage,
};

/// Tunnels listed when no `limit` is asked for.
pub const DEFAULT_LIMIT: usize = 100;
/// Most tunnels a document lists.
pub const MAX_LIMIT: usize = 1000;
/// Agents listed per tunnel at most.
pub const MAX_AGENTS_LISTED: usize = 20;
/// Time between two events of a stream.
pub const EVENT_INTERVAL: Duration = Duration::from_secs(1);
/// Event streams served at once.
pub const MAX_SUBSCRIBERS: usize = 16;
/// Path prefix of the page on the admin port.
pub const ADMIN_BASE: &str = "/status";
/// Path prefix of the page on the public port.
pub const PUBLIC_BASE: &str = "/_culvert/status";
/// Largest login form.
const MAX_FORM: usize = 4096;

const PAGE_JS: &str = include_str!("page.js");
const PAGE_CSS: &str = include_str!("page.css");

/// The status page's state in the running edge.
pub struct Monitor {
    started: Instant,
    started_at: String,
    listeners: Vec<Listener>,
    /// The rolling per-tunnel history.
    pub histories: traffic::Histories,
    /// Logins on the public path.
    pub sessions: session::Sessions,
    /// Served on the public port (`--public-status`).
    pub public: bool,
    subscribers: Arc<Semaphore>,
    skipped: AtomicU64,
    bytes_sent: AtomicU64,
    /// What the page shows of the store, read by [`sample`] (a document
    /// never waits for the store: with PostgreSQL that is the network).
    store_view: RwLock<Arc<StoreView>>,
}

/// The store as last read by [`refresh_store`].
#[derive(Default)]
struct StoreView {
    certificates: Vec<CertificateRecord>,
    health: Option<StoreHealth>,
}

impl Monitor {
    pub fn new(listeners: Vec<Listener>, public: bool) -> Monitor {
        Monitor {
            started: Instant::now(),
            started_at: rfc3339(unix_now()),
            listeners,
            histories: traffic::Histories::default(),
            sessions: session::Sessions::default(),
            public,
            subscribers: Arc::new(Semaphore::new(MAX_SUBSCRIBERS)),
            skipped: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            store_view: RwLock::default(),
        }
    }

    /// Event streams open now.
    pub fn events_open(&self) -> u64 {
        (MAX_SUBSCRIBERS - self.subscribers.available_permits()) as u64
    }

    /// Bytes of events made for subscribers since the start.
    pub fn events_bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn events(&self) -> EventsStatus {
        EventsStatus {
            subscribers: (MAX_SUBSCRIBERS - self.subscribers.available_permits()) as u64,
            max_subscribers: MAX_SUBSCRIBERS as u64,
            skipped: self.skipped.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
        }
    }
}

/// The public name of a reservation, as the traffic counters know it.
fn name_of(r: &Reservation) -> String {
    match (&r.hostname, r.port) {
        (Some(h), _) => h.clone(),
        (None, Some(p)) if r.protocol == crate::api::PortProtocol::Udp => {
            crate::edge::routes::udp_metric_name(p)
        }
        (None, Some(p)) => format!(":{p}"),
        (None, None) => r.id.clone(),
    }
}

/// The status document, listing at most `limit` tunnels.
pub fn snapshot(edge: &Edge, limit: usize) -> Status {
    let limit = limit.min(MAX_LIMIT);
    let monitor = &edge.monitor;
    let routes = edge.routes();
    let conns = edge.registry.connections();
    let mut all: Vec<(bool, (u64, u64), String, &Reservation)> = routes
        .all()
        .map(|r| {
            let name = name_of(r);
            let ever = edge.metrics.tunnel(&name).map_or(0, |c| {
                c.tunnel
                    .totals(0, 0)
                    .requests
                    .saturating_add(c.inbound.get())
                    .saturating_add(c.outbound.get())
            });
            (conns.contains_key(&r.id), (monitor.histories.weight(&name), ever), name, r)
        })
        .collect();
    let total = all.len();
    // Connected first, then the busiest (in the window, then since the start), then by name.
    all.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then_with(|| a.2.cmp(&b.2)));
    all.truncate(limit);

    let now = unix_now();
    let view = monitor.store_view.read().expect("poisoned").clone();
    let certificates = &view.certificates;
    let cert_by_host: HashMap<&str, _> = certificates.iter().map(|c| (c.hostname.as_str(), c)).collect();

    let tunnels = all
        .into_iter()
        .map(|(_, _, name, r)| {
            let agents = conns.get(&r.id).map(Vec::as_slice).unwrap_or_default();
            let totals = edge
                .metrics
                .tunnel(&name)
                .map(|c| c.tunnel.totals(c.inbound.get(), c.outbound.get()))
                .unwrap_or_default();
            let (history, rates) = monitor.histories.of(&name);
            let certificate = match (&edge.acme, r.kind, &r.hostname) {
                (Some(_), ReservationKind::Custom, Some(h)) if !r.is_default_host() => Some(
                    cert_by_host
                        .get(h.as_str())
                        .map(|c| c.state(now))
                        .unwrap_or_else(|| super::store::CertificateRecord::pending(h).state(now)),
                ),
                _ => None,
            };
            TunnelStatus {
                id: r.id.clone(),
                url: edge.public_url(r),
                name,
                kind: r.kind,
                owner: r.owner.clone(),
                labels: r.labels.clone(),
                certificate,
                agents_connected: agents.len(),
                agents: agents
                    .iter()
                    .take(MAX_AGENTS_LISTED)
                    .map(|c| AgentStatus {
                        agent_id: c.origin.agent_id.clone(),
                        connection: c.id,
                        address: c.origin.peer.to_string(),
                        since: rfc3339(c.origin.since),
                        protocol_version: c.origin.protocol_version,
                        cipher: c.origin.cipher.to_string(),
                        protocol: c.protocol,
                        key_id: c.key_id.clone(),
                        streams_open: c.streams() as u64,
                    })
                    .collect(),
                streams_open: agents.iter().map(|c| c.streams() as u64).sum(),
                totals,
                rates,
                history,
            }
        })
        .collect::<Vec<_>>();

    let acme = edge.acme.as_ref().map(|acme| {
        let mut in_flight = acme.in_flight();
        in_flight.truncate(50);
        let errors = certificates
            .iter()
            .filter_map(|c| {
                Some(AcmeError {
                    hostname: c.hostname.clone(),
                    error: c.last_error.clone()?,
                    next_attempt_at: (c.next_attempt > 0).then(|| rfc3339(c.next_attempt)),
                })
            })
            .take(20)
            .collect();
        AcmeStatus { in_flight, errors }
    });

    let store = view.health.clone().unwrap_or_else(|| StoreHealth {
        engine: edge.store.kind().into(),
        ok: false,
        latency_ms: 0.0,
        error: Some("not read yet".into()),
    });

    Status {
        status_version: STATUS_VERSION,
        generated_at: rfc3339(now),
        edge: EdgeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            protocol_version: PROTOCOL_VERSION,
            domain: edge.domain.clone(),
            started_at: monitor.started_at.clone(),
            uptime_seconds: monitor.started.elapsed().as_secs(),
            draining: edge.shutdown.is_cancelled(),
            listeners: monitor.listeners.clone(),
            tcp_listeners: edge.tcp.len(),
            fds: proc::fds(),
            memory: proc::memory(),
            agents_connected: edge.metrics.tunnels_connected.get().max(0) as u64,
            streams_open: edge.metrics.streams_open.get().max(0) as u64,
            store,
            acme,
            events: monitor.events(),
        },
        tunnels_total: total,
        tunnels_shown: tunnels.len(),
        tunnels,
    }
}

/// Reads of the process's own resource use from /proc.
mod proc {
    use super::Usage;

    /// Open file descriptors against the soft `RLIMIT_NOFILE`.
    pub fn fds() -> Usage {
        let used = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as u64);
        let budget = std::fs::read_to_string("/proc/self/limits").ok().and_then(|l| {
            let line = l.lines().find(|l| l.starts_with("Max open files"))?;
            line.trim_start_matches("Max open files").split_whitespace().next()?.parse().ok()
        });
        Usage { used, budget }
    }

    /// Resident memory (bytes) against the cgroup's `memory.max`.
    pub fn memory() -> Usage {
        let used = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
            let kib: u64 =
                s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
            Some(kib * 1024)
        });
        // cgroup v2: "0::/path".
        let budget = std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|c| {
            let path = c.lines().find_map(|l| l.strip_prefix("0::"))?;
            let max =
                std::fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim_end())).ok()?;
            max.trim().parse().ok()
        });
        Usage { used, budget }
    }
}

/// Reads what the page shows of the store: its health (a query timed) and,
/// with ACME, the certificates' state.
pub async fn refresh_store(edge: &Edge) {
    let started = Instant::now();
    let version = edge.store.run(|e| e.schema_version()).await;
    let health = StoreHealth {
        engine: edge.store.kind().into(),
        ok: version.is_ok(),
        latency_ms: started.elapsed().as_secs_f64() * 1000.0,
        error: version.err().map(|e| e.to_string()),
    };
    let certificates = match &edge.acme {
        Some(_) => match edge.store.certificates().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "status: failed to read the certificates");
                edge.monitor.store_view.read().expect("poisoned").certificates.clone()
            }
        },
        None => Vec::new(),
    };
    *edge.monitor.store_view.write().expect("poisoned") =
        Arc::new(StoreView { certificates, health: Some(health) });
}

/// Ends the sessions of keys that are no live admin keys any more (after
/// every change of the store, and periodically); a store that cannot be
/// read keeps them.
pub async fn recheck_sessions(edge: &Edge) {
    for id in edge.monitor.sessions.key_ids() {
        match edge.store.api_key(&id).await {
            Ok(Some(k)) if k.revoked_at.is_none() && k.scope == ApiKeyScope::Admin => {}
            Ok(_) => edge.monitor.sessions.close_key(&id),
            Err(e) => tracing::warn!(error = %e, "status: failed to check a session's key"),
        }
    }
}

/// Samples every tunnel's counters into the history until the edge stops;
/// reads the store's view ([`refresh_store`]) and checks the sessions.
pub async fn sample(edge: Arc<Edge>) {
    let mut tick = tokio::time::interval(traffic::INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = edge.stopped.cancelled() => return,
        }
        let totals = edge
            .metrics
            .tunnels()
            .into_iter()
            .map(|(name, c)| (name.to_string(), c.tunnel.totals(c.inbound.get(), c.outbound.get())));
        edge.monitor.histories.sample(totals);
        refresh_store(&edge).await;
        recheck_sessions(&edge).await;
    }
}

/// An event stream: the next document is made when the connection asks for
/// the next chunk and the interval has passed.
struct Events {
    edge: Arc<Edge>,
    limit: usize,
    tick: tokio::time::Interval,
    last: Option<Instant>,
    seq: u64,
    /// The public path: the request's cookie, checked before every event
    /// (a logout or a revoked key ends the stream).
    session: Option<HeaderMap>,
    _permit: OwnedSemaphorePermit,
}

impl Body for Events {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.edge.stopped.is_cancelled() {
            return Poll::Ready(None);
        }
        if this.tick.poll_tick(cx).is_pending() {
            return Poll::Pending;
        }
        if let Some(headers) = &this.session
            && session_key(&this.edge, headers).is_none()
        {
            return Poll::Ready(None);
        }
        let now = Instant::now();
        if let Some(last) = this.last {
            // Ticks that passed while the connection could not take more.
            let missed =
                (now.duration_since(last).as_millis() / EVENT_INTERVAL.as_millis()).saturating_sub(1);
            this.edge.monitor.skipped.fetch_add(missed as u64, Ordering::Relaxed);
        }
        this.last = Some(now);
        this.seq += 1;
        let doc = serde_json::to_string(&snapshot(&this.edge, this.limit)).expect("serializable");
        let event = format!("id: {}\nevent: status\ndata: {doc}\n\n", this.seq);
        this.edge.monitor.bytes_sent.fetch_add(event.len() as u64, Ordering::Relaxed);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }
}

/// Where a request for the page came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The admin port: no key.
    Admin,
    /// The public port: an admin key's session.
    Public,
}

impl Side {
    fn base(self) -> &'static str {
        match self {
            Side::Admin => ADMIN_BASE,
            Side::Public => PUBLIC_BASE,
        }
    }
}

/// Headers every answer of the page carries: no caching, no framing, only
/// the page's own scripts and styles.
fn harden(mut r: Response<BoxBody>) -> Response<BoxBody> {
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not no-referrer: with it, browsers send `Origin: null` on the login post.
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    r
}

fn respond(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<BoxBody> {
    let mut r = Response::new(body::full(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    harden(r)
}

const HTML: &str = "text/html; charset=utf-8";
const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";

/// The `limit` query parameter; the error says what to send instead.
pub fn limit_of(query: Option<&str>) -> Result<usize, String> {
    let mut limit = DEFAULT_LIMIT;
    for kv in query.unwrap_or_default().split('&').filter(|kv| !kv.is_empty()) {
        match kv.split_once('=') {
            Some(("limit", v)) => limit = parse_limit(v)?,
            _ => return Err(format!("unknown query {kv:?}; the only parameter is limit (1 to {MAX_LIMIT})")),
        }
    }
    Ok(limit)
}

/// A `limit` value: tunnels to list, clamped to 1..=[`MAX_LIMIT`].
pub fn parse_limit(v: &str) -> Result<usize, String> {
    let n: usize =
        v.trim().parse().map_err(|_| format!("limit must be a number of tunnels, 1 to {MAX_LIMIT}"))?;
    Ok(n.clamp(1, MAX_LIMIT))
}

/// The status document as JSON (also the control API's `GET status`).
pub fn json(edge: &Edge, limit: usize) -> Vec<u8> {
    serde_json::to_vec_pretty(&snapshot(edge, limit)).expect("serializable")
}

/// The pages, the document, the events and the assets under `side`'s base;
/// `rest` is the path after the base.
fn serve_view(edge: &Arc<Edge>, req: &Request<Incoming>, side: Side, rest: &str) -> Response<BoxBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = respond(StatusCode::METHOD_NOT_ALLOWED, TEXT, "use GET\n");
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let limit = match limit_of(req.uri().query()) {
        Ok(l) => l,
        Err(e) => return respond(StatusCode::BAD_REQUEST, TEXT, format!("{e}\n")),
    };
    match rest {
        "" | "/" => {
            let status = snapshot(edge, limit);
            respond(StatusCode::OK, HTML, page::render(&status, side.base(), side == Side::Public))
        }
        "/json" => respond(StatusCode::OK, JSON, json(edge, limit)),
        "/events" => {
            let Ok(permit) = edge.monitor.subscribers.clone().try_acquire_owned() else {
                return respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    format!(
                        "{MAX_SUBSCRIBERS} live views are open already; close one, or poll {}/json\n",
                        side.base()
                    ),
                );
            };
            let mut tick = tokio::time::interval(EVENT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let session = (side == Side::Public).then(|| {
                let mut h = HeaderMap::new();
                for v in req.headers().get_all(header::COOKIE) {
                    h.append(header::COOKIE, v.clone());
                }
                h
            });
            let events =
                Events { edge: edge.clone(), limit, tick, last: None, seq: 0, session, _permit: permit };
            let mut r = Response::new(body::boxed(events));
            r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            harden(r)
        }
        "/page.js" => respond(StatusCode::OK, "text/javascript; charset=utf-8", PAGE_JS),
        "/page.css" => respond(StatusCode::OK, "text/css; charset=utf-8", PAGE_CSS),
        _ => respond(
            StatusCode::NOT_FOUND,
            TEXT,
            format!("not found: the status page is {0}, its document {0}/json\n", side.base()),
        ),
    }
}

/// The admin port's status paths (`/status…`); `None` for other paths.
pub fn serve_admin(edge: &Arc<Edge>, req: &Request<Incoming>) -> Option<Response<BoxBody>> {
    let path = req.uri().path();
    if path == "/" {
        let mut r = respond(StatusCode::SEE_OTHER, TEXT, "see /status\n");
        r.headers_mut().insert(header::LOCATION, HeaderValue::from_static(ADMIN_BASE));
        return Some(r);
    }
    let rest = path.strip_prefix(ADMIN_BASE)?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None;
    }
    Some(serve_view(edge, req, Side::Admin, rest))
}

/// The admin key id of the request's session, if it is open. Sessions of
/// keys revoked (or no admin keys any more) are closed by
/// [`recheck_sessions`], after every change of the store.
fn session_key(edge: &Edge, headers: &HeaderMap) -> Option<String> {
    edge.monitor.sessions.key_of(headers)
}

/// A post from the page itself: not from another site's page (CSRF).
fn same_origin(req: &Request<Incoming>) -> bool {
    let h = req.headers();
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site")
        && !matches!(site, "same-origin" | "none")
    {
        return false;
    }
    let host = req.uri().authority().map(|a| a.as_str()).or_else(|| get("host"));
    match (get("origin"), host) {
        (Some(origin), Some(host)) => origin.eq_ignore_ascii_case(&format!("https://{host}")),
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// The login form's `key`.
async fn read_key(req: Request<Incoming>) -> Result<String, Response<BoxBody>> {
    let form = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !form {
        return Err(respond(StatusCode::UNSUPPORTED_MEDIA_TYPE, TEXT, "send the login form\n"));
    }
    let limited = http_body_util::Limited::new(req.into_body(), MAX_FORM);
    let body = match tokio::time::timeout(API_BODY_TIMEOUT, limited.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(_)) => return Err(respond(StatusCode::PAYLOAD_TOO_LARGE, TEXT, "the form is too large\n")),
        Err(_) => {
            return Err(respond(StatusCode::REQUEST_TIMEOUT, TEXT, "the form did not arrive in time\n"));
        }
    };
    let body = String::from_utf8_lossy(&body);
    let key = body
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == "key")
        .map(|(_, v)| crate::http::percent_decode_lossy(&v.replace('+', " ")))
        .unwrap_or_default();
    Ok(key.trim().to_string())
}

fn login_page(status: StatusCode, message: Option<&str>) -> Response<BoxBody> {
    respond(status, HTML, page::login(PUBLIC_BASE, message))
}

fn see_page(set_cookie: String) -> Response<BoxBody> {
    let mut r = respond(StatusCode::SEE_OTHER, TEXT, format!("see {PUBLIC_BASE}\n"));
    r.headers_mut().insert(header::LOCATION, HeaderValue::from_static(PUBLIC_BASE));
    if let Ok(v) = HeaderValue::from_str(&set_cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// Is `path` the status page's on the public port (`/_culvert/status…`)?
pub fn is_public_path(path: &str) -> bool {
    path.strip_prefix(PUBLIC_BASE).is_some_and(|r| r.is_empty() || r.starts_with('/'))
}

/// `/_culvert/status…` on the public port of the edge's own domain.
pub async fn serve_public(edge: Arc<Edge>, req: Request<Incoming>) -> Response<BoxBody> {
    let path = req.uri().path().to_string();
    let Some(rest) = path.strip_prefix(PUBLIC_BASE).filter(|r| r.is_empty() || r.starts_with('/')) else {
        return respond(StatusCode::NOT_FOUND, TEXT, "not found\n");
    };
    if !edge.monitor.public {
        return respond(
            StatusCode::NOT_FOUND,
            TEXT,
            "the status page is not served on the public port: open it on the edge's admin port \
             (http://ADMIN_ADDR/status), or start the edge with --public-status\n",
        );
    }
    match rest {
        "/login" if req.method() == Method::POST => {
            if !same_origin(&req) {
                return respond(
                    StatusCode::FORBIDDEN,
                    TEXT,
                    "refused: the login form was sent from another site\n",
                );
            }
            let key = match read_key(req).await {
                Ok(k) => k,
                Err(r) => return r,
            };
            let refused = |status, msg: &str| {
                tracing::info!(reason = msg, "status page login refused");
                login_page(status, Some(msg))
            };
            if key.is_empty() {
                return refused(StatusCode::UNAUTHORIZED, "Enter the edge's admin key.");
            }
            match edge.store.authenticate_api_key(&key).await {
                Ok(ApiKeyAuth::Valid(k)) if k.scope == ApiKeyScope::Admin => {
                    tracing::info!(key = %k.id, "status page login");
                    see_page(session::set_cookie(&edge.monitor.sessions.open(&k.id)))
                }
                Ok(ApiKeyAuth::Valid(_)) => refused(
                    StatusCode::FORBIDDEN,
                    "This is an endpoints key: the status page needs an admin key.",
                ),
                Ok(ApiKeyAuth::TunnelKey) => refused(
                    StatusCode::FORBIDDEN,
                    "This is a tunnel key: the status page needs an admin key.",
                ),
                Ok(ApiKeyAuth::Revoked(_)) => refused(StatusCode::UNAUTHORIZED, "This key was revoked."),
                Ok(ApiKeyAuth::Unknown) => {
                    refused(StatusCode::UNAUTHORIZED, "Wrong key: the edge does not know it.")
                }
                Err(e) => {
                    tracing::error!(error = %e, "status page login: store failed");
                    refused(StatusCode::INTERNAL_SERVER_ERROR, "The edge's store failed; see its log.")
                }
            }
        }
        "/logout" if req.method() == Method::POST => {
            if !same_origin(&req) {
                return respond(
                    StatusCode::FORBIDDEN,
                    TEXT,
                    "refused: the logout was sent from another site\n",
                );
            }
            edge.monitor.sessions.close(req.headers());
            see_page(session::clear_cookie())
        }
        "/login" | "/logout" => {
            let mut r = respond(StatusCode::METHOD_NOT_ALLOWED, TEXT, "use the form (POST)\n");
            r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
            r
        }
        // The assets hold nothing secret (the login page uses the style).
        "/page.js" | "/page.css" => serve_view(&edge, &req, Side::Public, rest),
        _ if session_key(&edge, req.headers()).is_some() => serve_view(&edge, &req, Side::Public, rest),
        "" | "/" => login_page(StatusCode::UNAUTHORIZED, None),
        _ => respond(StatusCode::UNAUTHORIZED, TEXT, format!("log in first: {PUBLIC_BASE}\n")),
    }
}
