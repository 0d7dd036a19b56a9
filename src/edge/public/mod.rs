//! The public listeners: HTTPS (public traffic, the tunnel endpoint and the
//! control API on one port), the HTTP redirect, and the admin port.
//!
//! [`proxy`] carries one public request to an agent: [`head`] rewrites the
//! head, [`retry`] places it on a tunnel connection, [`upgrade`] splices an
//! upgraded connection. [`h1`] serves the HTTP/1.1 requests that need only
//! forwarding without hyper, and hands hyper the rest. Every listener accepts with
//! [`accept_loop`](super::accept::accept_loop).

pub(crate) mod h1;
pub(crate) mod head;
mod retry;
pub(crate) mod upgrade;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tracing::{Instrument, debug, warn};

use super::accept::accept_loop;
use super::agents::AgentTls;
use super::limits::Class;
use super::routes::default_host_name;
use super::stop::Cancelled;
use super::{Edge, sni};
use crate::BoxError;
use crate::api::{Protocol, Reservation, ReservationKind};
use crate::constants::{
    API_PREFIX, CONNECT_PATH, FIRST_REQUEST_GRACE, HANDSHAKE_TIMEOUT, HEADER_READ_TIMEOUT, MAX_HEADER_BYTES,
    RESERVED_PREFIX, names,
};
use crate::http::{error_page, text};
use crate::tunnel::body::{self, BoxBody, Counted};
use crate::tunnel::budget::{BudgetSlot, Budgeted};
use head::request_host;

// hyper's own builders rather than hyper-util's `auto`: the protocol is
// known (ALPN, or the plain port) and each is given the service shape it
// serves fastest (see the h2 branch of `serve_tls`).
fn http1_builder() -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT).max_buf_size(MAX_HEADER_BYTES);
    b
}

fn http2_builder() -> http2::Builder<TokioExecutor> {
    let mut b = http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new()).max_header_list_size(MAX_HEADER_BYTES as u32);
    b
}

/// Accepts public TLS connections. Each handshake runs in its own task under
/// a timeout; the loop never waits on a client.
pub async fn serve_https(edge: Arc<Edge>, listener: TcpListener, tls: Arc<rustls::ServerConfig>) {
    let _listening = edge.connections.token();
    let mut refused = super::limits::LogEvery::default();
    accept_loop(&listener, &edge.shutdown, |tcp, peer| {
        // Until its first request says what it is, a connection holds a handshake descriptor.
        let Some(permit) = edge.fds.try_acquire(Class::Handshake) else {
            edge.metrics.public_connections_rejected.inc();
            edge.metrics.connection_refused(Class::Handshake);
            if let Some(unlogged) = refused.tick() {
                warn!(%peer, unlogged, "too many connections in their TLS handshake; closing new ones");
            }
            return;
        };
        let _ = tcp.set_nodelay(true);
        let span = tracing::debug_span!("public", %peer);
        let serve = serve_tls(edge.clone(), tls.clone(), tcp, peer, permit);
        edge.connections.spawn(serve.instrument(span));
    })
    .await
}

/// One public TLS connection: passed through by SNI, or TLS ended here and
/// HTTP served.
async fn serve_tls(
    edge: Arc<Edge>,
    config: Arc<rustls::ServerConfig>,
    mut tcp: TcpStream,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let _permit = permit;
    let (hello, sni) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, sni::read_client_hello(&mut tcp)).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return debug!(error = %e, "reading the ClientHello failed"),
        Err(_) => return debug!("no ClientHello in time"),
    };
    // TLS passthrough: the host's agents publish `tls`; the backend terminates TLS.
    if let Some(reservation) = sni.as_deref().and_then(|h| edge.routes().host(h).cloned())
        && edge.registry.serves(&reservation.id, Protocol::Tls)
    {
        let Some(_public) = edge.fds.try_acquire(Class::Public) else {
            return edge.metrics.connection_refused(Class::Public);
        };
        drop(_permit);
        let local = tcp.local_addr().ok();
        let name = reservation.hostname.clone().unwrap_or_default();
        let io = sni::Prefixed::new(hello, tcp);
        return super::tcp::forward(&edge, io, &reservation, Protocol::Tls, &name, peer, local).await;
    }
    // TLS-ALPN-01 validation of an order placed by another edge (for a
    // reserved custom domain): its answer from the store.
    let config = match (&edge.acme, sni.as_deref()) {
        (Some(acme), Some(host))
            if hello.len() > 5
                && sni::offers_alpn(&hello[5..], crate::tls::ALPN_ACME_TLS)
                && edge.routes().host(host).is_some_and(|r| r.kind == ReservationKind::Custom) =>
        {
            acme.tls_alpn01_config(host).await.unwrap_or(config)
        }
        _ => config,
    };
    let accept = crate::tunnel::tls::accept(config, tcp, &hello);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return debug!(error = %e, "TLS handshake failed"),
        Err(_) => return debug!("TLS handshake timed out"),
    };
    if tls.alpn_protocol() == Some(crate::tls::ALPN_ACME_TLS) {
        // TLS-ALPN-01: the handshake itself was the answer.
        return debug!("answered an ACME TLS-ALPN-01 validation");
    }
    let h2 = tls.alpn_protocol() == Some(crate::tls::ALPN_H2);
    // For an agent's upgrade: a tunnel keeps its buffers while it waits.
    let keep = tls.keep_buffers();
    let cipher = tls.cipher_name();
    let slot = Arc::new(std::sync::Mutex::new(Slot { handshake: Some(_permit), class: None }));
    let first = Arc::new(FirstRequest::default());
    let io = super::idle::IdleTimeout::new(tls);
    // HTTP/1.1: the fast path first, hyper for what it does not serve.
    let io = if h2 {
        Io::Whole(io)
    } else {
        let at = h1::Public { edge: &edge, peer, scheme: "https", first: &first };
        let fast = h1::serve(at, io, || take_class(&edge, &slot, Class::Public));
        match until_stopped(&edge, fast).await {
            Some(h1::Served::Rest(io)) => Io::Rest(io),
            _ => return,
        }
    };
    let serve = {
        let (edge, first) = (edge.clone(), first.clone());
        move |req: Request<Incoming>| {
            first.arrived();
            let edge = edge.clone();
            let slot = slot.clone();
            let keep = keep.clone();
            async move {
                if let Some(refused) = take_slot(&edge, &slot, &req) {
                    return Ok::<_, Infallible>(refused);
                }
                Ok::<_, Infallible>(handle(edge, req, peer, AgentTls { keep, cipher }).await)
            }
        }
    };
    let ended = match io {
        Io::Whole(io) => {
            // Boxed: a request's future is ~4 KiB and hyper's h2 server moves it
            // several times into the task it spawns per stream; a box moves as a
            // pointer (-4% instructions per h2 request). HTTP/1 polls it in place.
            let service = service_fn(move |req| Box::pin(serve(req)));
            drain_on_shutdown(&edge, http2_builder().serve_connection(TokioIo::new(io), service), &first)
                .await
        }
        Io::Rest(io) => {
            let conn = http1_builder().serve_connection(TokioIo::new(io), service_fn(serve)).with_upgrades();
            drain_on_shutdown(&edge, conn, &first).await
        }
    };
    if let Err(e) = ended {
        debug!(error = %e, "public connection ended");
    }
}

/// A public connection for hyper: whole (HTTP/2), or what the HTTP/1.1 fast
/// path left of it.
enum Io<IO> {
    Whole(IO),
    Rest(sni::Prefixed<IO>),
}

/// `serve` until it ends, or nothing once the edge has stopped (its drain
/// time is up).
async fn until_stopped<T>(edge: &Edge, serve: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        served = serve => Some(served),
        () = Cancelled::new(&edge.stopped) => None,
    }
}

/// The descriptor a public HTTPS connection holds: a handshake one until its
/// first request, then one of the class its requests belong to.
struct Slot {
    handshake: Option<OwnedSemaphorePermit>,
    class: Option<(Class, OwnedSemaphorePermit)>,
}

/// What a request on the HTTPS port is: a tenant's (public), the tunnel
/// endpoint (agent) or the control API (control).
fn class_of<B>(edge: &Edge, req: &Request<B>) -> Class {
    let by_path = match req.uri().path() {
        CONNECT_PATH => Class::Agent,
        p if p.starts_with(API_PREFIX) => Class::Control,
        // Public whatever the host: no lookup for the common case.
        _ => return Class::Public,
    };
    let host = request_host(req).unwrap_or_default();
    if edge.routes().host(host).is_some() { Class::Public } else { by_path }
}

/// Moves the connection to the class of `req` (once, or when its requests
/// change class); `Some(503)` when that class has no descriptor left: the
/// connection is closed, other classes are not held back.
fn take_slot<B>(edge: &Edge, slot: &std::sync::Mutex<Slot>, req: &Request<B>) -> Option<Response<BoxBody>> {
    take_class(edge, slot, class_of(edge, req))
}

/// [`take_slot`] for a request of `class`.
fn take_class(edge: &Edge, slot: &std::sync::Mutex<Slot>, class: Class) -> Option<Response<BoxBody>> {
    let mut slot = slot.lock().expect("poisoned");
    if slot.class.as_ref().is_some_and(|(c, _)| *c == class) {
        return None;
    }
    match edge.fds.try_acquire(class) {
        Some(permit) => {
            slot.class = Some((class, permit));
            slot.handshake = None;
            None
        }
        None => {
            edge.metrics.connection_refused(class);
            let mut r = text(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the edge is at its limit of {} connections; retry later\n", class.name()),
            );
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            Some(r)
        }
    }
}

/// Whether a connection's first request has arrived.
#[derive(Default)]
struct FirstRequest {
    seen: AtomicBool,
    notify: Notify,
}

impl FirstRequest {
    fn arrived(&self) {
        if !self.seen.swap(true, Ordering::Relaxed) {
            // Stores a permit when nobody waits yet.
            self.notify.notify_one();
        }
    }

    async fn wait(&self) {
        if !self.seen.load(Ordering::Relaxed) {
            self.notify.notified().await;
        }
    }
}

/// Serves one public HTTP connection; when the edge starts draining, it
/// finishes the requests in flight and closes (HTTP/1.1: after the current
/// response; HTTP/2: GOAWAY), or is dropped when the drain time is up. A
/// connection accepted before the drain that has not sent its first request
/// yet (the client is in its TLS handshake, or its request is on the wire)
/// gets [`FIRST_REQUEST_GRACE`] for it: closing it unanswered would fail a
/// request the client sent to an edge that was still accepting.
async fn drain_on_shutdown<C>(edge: &Edge, conn: C, first: &FirstRequest) -> Result<(), hyper::Error>
where
    C: Future<Output = Result<(), hyper::Error>> + GracefulConnection,
{
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => return r,
        () = Cancelled::new(&edge.shutdown) => {}
    }
    tokio::select! {
        r = conn.as_mut() => return r,
        _ = first.wait() => {}
        _ = tokio::time::sleep(FIRST_REQUEST_GRACE) => {}
        _ = edge.stopped.cancelled() => return Ok(()),
    }
    conn.as_mut().graceful_shutdown();
    tokio::select! {
        r = conn => r,
        // The drain time is up: drop the connection.
        _ = edge.stopped.cancelled() => Ok(()),
    }
}

/// hyper's connections that can finish gracefully.
trait GracefulConnection {
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S> GracefulConnection for http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = BoxBody>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        http1::UpgradeableConnection::graceful_shutdown(self)
    }
}

impl<I, S, E> GracefulConnection for http2::Connection<I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = BoxBody>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, BoxBody>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        http2::Connection::graceful_shutdown(self)
    }
}

/// The plain HTTP port: ACME HTTP-01 answers, and redirects to HTTPS; with
/// `--plain-http`, published HTTP hosts are proxied here too.
pub async fn serve_redirect(edge: Arc<Edge>, listener: TcpListener) {
    serve_plain(edge, listener, true, |edge, req, peer| async move {
        // Another edge's order is looked up in the store only for a reserved custom domain.
        let custom = |host: &str| edge.routes().host(host).is_some_and(|r| r.kind == ReservationKind::Custom);
        if let Some(acme) = &edge.acme
            && let Some(key_authorization) =
                acme.http01_response(req.uri().path(), request_host(&req).is_some_and(custom)).await
        {
            return Ok(text(StatusCode::OK, &key_authorization));
        }
        if let Some((status, why)) = head::refuse_head(&req) {
            return Ok(text(status, &format!("{why}\n")));
        }
        if edge.plain_http {
            let host = request_host(&req).unwrap_or_default();
            let routes = edge.routes();
            if let Some(reservation) = routes.host_or_default(host, &edge.domain)
                && reservation.kind != ReservationKind::Tcp
            {
                return Ok(proxy(edge.clone(), req, peer, reservation, "http").await);
            }
        }
        Ok(redirect(&edge, &req))
    })
    .await
}

/// The admin port: `/metrics`, `/healthz`, `/readyz` (503 while draining),
/// the status page (`/status`, [`super::status`]).
/// It serves until the edge has stopped, draining included.
pub async fn serve_admin(edge: Arc<Edge>, listener: TcpListener) {
    serve_plain(edge, listener, false, |edge, req, _| async move {
        if let Some(r) = super::status::serve_admin(&edge, &req) {
            return Ok(r);
        }
        Ok(match req.uri().path() {
            "/metrics" => {
                let mut r = Response::new(body::full(edge.metrics.encode()));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                );
                r
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" if edge.shutdown.is_cancelled() => {
                text(StatusCode::SERVICE_UNAVAILABLE, "draining: shutting down\n")
            }
            "/readyz" => match edge.store.reservations().await {
                Ok(_) => text(StatusCode::OK, "ok\n"),
                // Several edges: PostgreSQL down, this edge still serves what it knows.
                Err(e) if edge.store.kind() != "sqlite" => {
                    text(StatusCode::OK, &format!("ok, serving what this edge knows; {e}\n"))
                }
                Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("store: {e}\n")),
            },
            _ => text(StatusCode::NOT_FOUND, "not found: try /status, /metrics, /healthz or /readyz\n"),
        })
    })
    .await
}

/// Serves plain HTTP/1.1 on `listener`: `public` connections stop with the
/// edge's public listeners and are drained; the others (the admin port)
/// serve until the edge has stopped.
async fn serve_plain<F, Fut>(edge: Arc<Edge>, listener: TcpListener, public: bool, f: F)
where
    F: Fn(Arc<Edge>, Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<BoxBody>, Infallible>> + Send + 'static,
{
    let stop = if public { edge.shutdown.clone() } else { edge.stopped.clone() };
    let _listening = public.then(|| edge.connections.token());
    accept_loop(&listener, &stop, |tcp, peer| {
        let _ = tcp.set_nodelay(true);
        let (edge, f) = (edge.clone(), f.clone());
        let tracker = edge.connections.clone();
        let serve = async move {
            let first = FirstRequest::default();
            let io = super::idle::IdleTimeout::new(tcp);
            // Published hosts (`--plain-http`): the HTTP/1.1 fast path first.
            let io = if public && edge.plain_http {
                let at = h1::Public { edge: &edge, peer, scheme: "http", first: &first };
                match until_stopped(&edge, h1::serve(at, io, || None)).await {
                    Some(h1::Served::Rest(io)) => io,
                    _ => return,
                }
            } else {
                sni::Prefixed::new(bytes::Bytes::new(), io)
            };
            let service = service_fn({
                let edge = edge.clone();
                let first = &first;
                move |req| {
                    first.arrived();
                    f(edge.clone(), req, peer)
                }
            });
            let conn = http1_builder().serve_connection(TokioIo::new(io), service).with_upgrades();
            // Public connections finish when the edge drains; the admin port's keep serving.
            let _ = if public { drain_on_shutdown(&edge, conn, &first).await } else { conn.await };
        };
        if public {
            tracker.spawn(serve);
        } else {
            tokio::spawn(serve);
        }
    })
    .await
}

fn redirect(edge: &Edge, req: &Request<Incoming>) -> Response<BoxBody> {
    let Some(host) = request_host(req) else {
        return text(StatusCode::BAD_REQUEST, "missing Host header\n");
    };
    let host = super::routes::normalize_host(host);
    let port = if edge.https_port == 443 { String::new() } else { format!(":{}", edge.https_port) };
    let pq = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let location = format!("https://{host}{port}{pq}");
    let mut r = text(StatusCode::PERMANENT_REDIRECT, &format!("see {location}\n"));
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

async fn handle(
    edge: Arc<Edge>,
    req: Request<Incoming>,
    peer: SocketAddr,
    tls: AgentTls,
) -> Response<BoxBody> {
    if let Some((status, why)) = head::refuse_head(&req) {
        return text(status, &format!("{why}\n"));
    }
    let host = request_host(&req).unwrap_or_default();
    let routes = edge.routes();
    if let Some(reservation) = routes.host(host)
        && reservation.kind != ReservationKind::Tcp
    {
        return proxy(edge, req, peer, reservation, "https").await;
    }
    let path = req.uri().path();
    if path == CONNECT_PATH {
        return super::agents::accept(edge, req, peer, tls).await;
    }
    if path.starts_with(API_PREFIX) {
        let resp = super::api::handle(&edge.api, req).await;
        return resp.map(|b| body::boxed(b.map_err(|never| match never {})));
    }
    let name = super::routes::normalize_host(host);
    if name == edge.domain && super::status::is_public_path(path) {
        return super::status::serve_public(edge, req).await;
    }
    if name == edge.domain && !path.starts_with(RESERVED_PREFIX) {
        return text(StatusCode::OK, "culvert edge\n");
    }
    // The default host: any other host (after the tunnel endpoint and the API).
    if let Some(reservation) = routes.host_or_default(host, &edge.domain) {
        return proxy(edge.clone(), req, peer, reservation, "https").await;
    }
    error_page(StatusCode::BAD_GATEWAY, &name, "no tunnel is registered for this host")
}

// Debug level: an enabled span costs a few allocations per request.
#[tracing::instrument(level = "debug", skip_all, fields(host = reservation.hostname.as_deref().unwrap_or(""), method = %req.method()))]
async fn proxy(
    edge: Arc<Edge>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    reservation: &Reservation,
    scheme: &'static str,
) -> Response<BoxBody> {
    let name = reservation.hostname.as_deref().unwrap_or_default();
    // The default host forwards the request's own host (its agent matches on it).
    let asked = reservation.is_default_host().then(|| request_host(&req).and_then(default_host_name));
    let host = match &asked {
        Some(Some(asked)) => asked.as_str(),
        Some(None) => {
            return error_page(StatusCode::BAD_REQUEST, name, "the request's host is not a host name");
        }
        None => name,
    };
    if reservation.kind == ReservationKind::Tcp {
        return error_page(StatusCode::BAD_GATEWAY, host, "this reservation is a TCP port");
    }
    // The edge's own paths are never a tenant's, whatever the Host.
    if req.uri().path().starts_with(RESERVED_PREFIX) {
        return error_page(
            StatusCode::NOT_FOUND,
            host,
            &format!("{RESERVED_PREFIX} is the edge's own; use https://{}{RESERVED_PREFIX}…", edge.domain),
        );
    }
    let upgrade = upgrade::upgrade_of(&req, &edge.upgrades);
    // An upgrade's body would be the new protocol's bytes: one announced
    // before the switch is refused rather than waited for.
    if upgrade.is_some() && !req.body().is_end_stream() {
        return error_page(StatusCode::BAD_REQUEST, host, "an upgrade request cannot have a body");
    }
    let on_upgrade = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
    let (mut parts, incoming) = req.into_parts();
    let port = if scheme == "https" { edge.https_port } else { edge.http_port };
    let Ok(forwarding) = head::rewrite_request(&mut parts, host, peer, scheme, port, upgrade.as_ref()) else {
        return error_page(StatusCode::BAD_REQUEST, host, "invalid request target");
    };

    // Counted under the reservation's name (`*` for every host of the default host).
    let counters = edge.metrics.bytes(name);
    let tunnel = counters.tunnel;
    tunnel.request();
    let (bytes_in, bytes_out) = (counters.inbound, counters.outbound);
    // A request without a body can be placed again on another connection if
    // the first one refused it (an agent draining at that very moment): the
    // tunnel's sender keeps its head (`retry::send`). An upgrade gets its
    // request back from a refusal (its body is fed later).
    // What the client uploads is charged to the tunnel connection's budget.
    let slot = BudgetSlot::default();
    let (tunnel_body, upgrade_tx) = if upgrade.is_some() {
        let (body, tx) = upgrade::request_body(bytes_in, slot.clone());
        (body, Some(tx))
    } else if incoming.is_end_stream() {
        (body::boxed(Counted::new(incoming, bytes_in)), None)
    } else {
        (body::boxed(Budgeted::new(Counted::new(incoming, bytes_in), slot.clone())), None)
    };
    let request = Request::from_parts(parts, tunnel_body);
    let outgoing = retry::Outgoing::Request(request, &forwarding);
    let (resp, guard) = match retry::send(&edge, reservation, host, outgoing, &tunnel, &slot).await {
        Ok((retry::Answer::Response(resp), guard)) => (resp, guard),
        Ok((retry::Answer::Text(..), _)) => unreachable!("a request is answered with a response"),
        Err(page) => return page,
    };

    let switched = resp.headers().get(&names::STATUS).is_some_and(|v| v == "101");
    let (mut rparts, rbody) = resp.into_parts();
    tunnel.answered(rparts.status);
    if let Some(err) = rparts.headers.get(&names::ERROR) {
        debug!(error = ?err, "agent answered with an error");
    }
    let down = Counted::new(rbody, bytes_out);
    if let (true, Some(on_upgrade), Some(tx)) = (switched, on_upgrade, upgrade_tx) {
        return upgrade::switch(rparts, down, upgrade, on_upgrade, tx, guard, &edge);
    }
    head::clean_response(&mut rparts.headers);
    Response::from_parts(rparts, body::boxed(down.hold(guard)))
}
