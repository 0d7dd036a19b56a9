//! Listeners of TCP reservations: each public connection becomes one
//! full-duplex stream to an agent.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use http::header::HeaderValue;
use http::{Request, StatusCode};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, warn};

use super::Edge;
use super::ports::{LISTEN_RETRY, PortListeners};
use crate::api::{Protocol, Reservation};
use crate::constants::{CLIENT_ADDR_HEADER, SERVER_ADDR_HEADER, STREAM_HEADER};
use crate::tunnel::StreamKind;
use crate::tunnel::body::{self, Counted, ReadBody};
use crate::tunnel::budget::{BudgetSlot, Budgeted};
use tokio::io::{AsyncRead, AsyncWrite};

#[derive(Default)]
pub struct TcpListeners {
    ports: PortListeners,
}

impl TcpListeners {
    /// Listens on exactly `ports`: starts the missing, stops the released.
    pub fn reconcile(&self, edge: &Arc<Edge>, ports: HashSet<u16>) {
        let failed = self.ports.reconcile("TCP", edge, ports, |port, token| {
            let addr = SocketAddr::new(edge.tcp_bind, port);
            let listener = match super::accept::listen(addr) {
                Ok(l) => l,
                Err(e) => {
                    error!(
                        %addr, error = %e, retry_in = ?LISTEN_RETRY,
                        "cannot listen for a TCP reservation: another program holds the port? \
                         Stop it, or release the reservation and reserve another port"
                    );
                    return false;
                }
            };
            info!(%addr, "listening for a TCP reservation");
            tokio::spawn(accept_loop(edge.clone(), listener, port, token));
            true
        });
        if failed {
            self.ports.retry_later(edge, |edge| {
                edge.tcp.ports.retried();
                edge.tcp.reconcile(edge, edge.routes().ports().collect());
            });
        }
    }

    /// Listeners open now.
    pub fn len(&self) -> usize {
        self.ports.len()
    }
}

/// Is `addr` free to listen on? (The edge binds it for real once the
/// reservation is stored; a program that takes it in between is reported
/// then, and the listener retried.)
pub fn can_listen(addr: SocketAddr) -> bool {
    std::net::TcpListener::bind(addr).is_ok()
}

async fn accept_loop(edge: Arc<Edge>, listener: TcpListener, port: u16, token: CancellationToken) {
    let _listening = edge.connections.token();
    // This port's own share: one reservation's clients cannot take every TCP descriptor.
    let own = Arc::new(tokio::sync::Semaphore::new(edge.fds.tcp_per_port));
    let mut refused = super::limits::LogEvery::default();
    super::accept::accept_loop(&listener, &token, |tcp, peer| {
        let permits = own
            .clone()
            .try_acquire_owned()
            .ok()
            .and_then(|p| Some((p, edge.fds.try_acquire(super::limits::Class::Tcp)?)));
        let Some(permits) = permits else {
            edge.metrics.connection_refused(super::limits::Class::Tcp);
            if let Some(more) = refused.tick() {
                warn!(port, %peer, refused_since_last_line = more, "TCP reservation at its connection limit; closing new connections");
            }
            return;
        };
        let span = tracing::debug_span!("tcp", port, %peer);
        let edge2 = edge.clone();
        edge.connections.spawn(
            async move {
                let _permits = permits;
                serve(edge2, tcp, port, peer).await
            }
            .instrument(span),
        );
    })
    .await
}
async fn serve(edge: Arc<Edge>, tcp: TcpStream, port: u16, peer: SocketAddr) {
    let _ = tcp.set_nodelay(true);
    let local = tcp.local_addr().ok();
    let Some(reservation) = edge.routes().port(port).cloned() else {
        return debug!("no reservation for this port any more");
    };
    forward(&edge, tcp, &reservation, Protocol::Tcp, &format!(":{port}"), peer, local).await;
}

/// Carries one public byte stream (a TCP connection, or a TLS connection
/// passed through by SNI) to an agent of `reservation` serving `protocol`.
pub async fn forward<S>(
    edge: &Arc<Edge>,
    io: S,
    reservation: &Reservation,
    protocol: Protocol,
    name: &str,
    peer: SocketAddr,
    local: Option<SocketAddr>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = super::idle::Activity::default();
    // Whatever ends this (the stream, a bound), the public reads still
    // pending in the tunnel stream's request body end too.
    let _close = CloseOnDrop(activity.clone());
    let (read, write) = tokio::io::split(activity.track(io));
    let mut tried = Vec::new();
    let counters = edge.metrics.bytes(name);
    counters.tunnel.request();
    let slot = BudgetSlot::default();
    let upload = Budgeted::new(Counted::new(ReadBody::charged(read), counters.inbound), slot.clone());
    let mut body = Some(body::boxed(upload));
    let Some(_slot) = edge.registry.stream_slot().await else {
        counters.tunnel.answered(StatusCode::SERVICE_UNAVAILABLE);
        return warn!("every tunnel stream of the edge is in use; closing the connection");
    };
    while let Some(guard) = edge.registry.pick_or_wait(&reservation.id, protocol, &tried).await {
        tried.push(guard.conn().id);
        slot.set(guard.conn().budget.clone());
        let mut req = Request::new(body.take().expect("body is put back on retry"));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = http::Uri::from_static("https://tcp.culvert.invalid/");
        *req.version_mut() = http::Version::HTTP_2;
        let h = req.headers_mut();
        h.insert(STREAM_HEADER, HeaderValue::from_static(StreamKind::Tcp.header_value()));
        h.insert(CLIENT_ADDR_HEADER, HeaderValue::from_str(&peer.to_string()).expect("ascii"));
        if let Some(local) = local {
            h.insert(SERVER_ADDR_HEADER, HeaderValue::from_str(&local.to_string()).expect("ascii"));
        }
        match guard.conn().sender.send(req).await {
            Ok(resp) if resp.status() == StatusCode::OK => {
                let down = Counted::new(resp.into_body(), counters.outbound);
                // The reservation's own idle timeout, else the edge's.
                let idle = reservation
                    .idle_timeout_seconds
                    .map_or(edge.tcp_idle_timeout, std::time::Duration::from_secs);
                let bound = activity.expired(idle, edge.half_close_timeout);
                let mut bound = std::pin::pin!(bound);
                tokio::select! {
                    r = body::copy_body(down, write) => match r {
                        Ok(bytes) => debug!(bytes, "agent to client ended"),
                        // The stream was reset, or the client is gone: nothing
                        // more can pass, so no bound is waited for.
                        Err(e) => return debug!(error = %e, "agent to client failed; closing the connection"),
                    },
                    why = bound.as_mut() => return debug!(why, "closing the connection"),
                }
                // The client may still send: until it closes too, or the bound.
                let why = bound.await;
                drop(guard);
                return debug!(why, "stream ended");
            }
            Ok(resp) => {
                let why = resp.headers().get(crate::constants::ERROR_HEADER).cloned();
                counters.tunnel.answered(resp.status());
                return warn!(status = %resp.status(), reason = ?why, "agent refused the stream");
            }
            Err(mut e) => match e.take_message() {
                Some(r) if tried.len() < 3 => body = Some(r.into_body()),
                _ => {
                    counters.tunnel.answered(StatusCode::BAD_GATEWAY);
                    return warn!(error = %e.error(), "tunnel failed for a stream");
                }
            },
        }
    }
    if tried.is_empty() {
        counters.tunnel.offline();
    } else {
        counters.tunnel.answered(StatusCode::BAD_GATEWAY);
    }
    debug!("no agent connected for this reservation; closing");
}

struct CloseOnDrop(super::idle::Activity);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}
