//! Listeners of UDP reservations. One UDP socket per reserved port; each
//! public client address and port on it is a flow, and each flow is one
//! full-duplex tunnel stream of kind `udp` whose datagrams are framed by
//! `tunnel::datagram`.
//!
//! Every bound is a drop, never a buffer: a flow's queue toward the agent
//! holds at most `UDP_FLOW_QUEUE_BYTES` (and all flows together
//! `UDP_QUEUE_TOTAL_BYTES`); toward the client a datagram the socket cannot
//! take at once is dropped. A flow ends after `--udp-idle-timeout-seconds`
//! without a datagram either way; a reservation has at most
//! `--max-udp-flows-per-port` flows and the edge `--max-udp-flows`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::header::HeaderValue;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tokio::net::UdpSocket;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, warn};

use super::Edge;
use super::ports::{LISTEN_RETRY, PortListeners};
use crate::api::{Protocol, Reservation};
use crate::constants::{
    CLIENT_ADDR_HEADER, MAX_DATAGRAM, SERVER_ADDR_HEADER, STREAM_HEADER, UDP_FLOW_QUEUE_BYTES,
    UDP_QUEUE_TOTAL_BYTES,
};
use crate::tunnel::StreamKind;
use crate::tunnel::body::{self, Counted};
use crate::tunnel::budget::{BudgetSlot, Budgeted};
use crate::tunnel::datagram::{self, Decoder, Queue, Refused, Tally};

/// Socket buffers of a UDP reservation's socket, each way: every flow of the
/// port shares it.
const UDP_PORT_SOCKET_BUFFER: usize = 4 << 20;

/// The UDP side of the edge: its sockets and its bounds.
pub struct UdpListeners {
    ports: PortListeners,
    /// A flow silent this long ends.
    pub idle_timeout: Duration,
    /// Flows per reservation.
    pub per_port: usize,
    /// Flows of the whole edge.
    flows: Arc<Semaphore>,
    /// Bytes queued toward agents over every flow.
    queued: Arc<Tally>,
}

impl UdpListeners {
    pub fn new(idle_timeout: Duration, per_port: usize, max_flows: usize) -> UdpListeners {
        UdpListeners {
            ports: PortListeners::default(),
            idle_timeout,
            per_port: per_port.max(1),
            flows: Arc::new(Semaphore::new(max_flows.clamp(1, Semaphore::MAX_PERMITS))),
            queued: Tally::new(UDP_QUEUE_TOTAL_BYTES),
        }
    }

    /// Bytes of datagrams queued toward agents now.
    pub fn queued_bytes(&self) -> usize {
        self.queued.held()
    }

    /// Listens on exactly `ports`: binds the missing, closes the released.
    pub fn reconcile(&self, edge: &Arc<Edge>, ports: HashSet<u16>) {
        let failed = self.ports.reconcile("UDP", edge, ports, |port, token| {
            let addr = SocketAddr::new(edge.tcp_bind, port);
            let socket = match std::net::UdpSocket::bind(addr)
                .and_then(|s| s.set_nonblocking(true).map(|_| s))
                .and_then(UdpSocket::from_std)
            {
                Ok(s) => s,
                Err(e) => {
                    error!(
                        %addr, error = %e, retry_in = ?LISTEN_RETRY,
                        "cannot bind a UDP reservation's port: another program holds it? \
                         Stop it, or release the reservation and reserve another port"
                    );
                    return false;
                }
            };
            datagram::set_socket_buffers(&socket, UDP_PORT_SOCKET_BUFFER);
            info!(%addr, "listening for a UDP reservation");
            let span = tracing::debug_span!("udp", port);
            tokio::spawn(recv_loop(edge.clone(), Arc::new(socket), port, token).instrument(span));
            true
        });
        if failed {
            self.ports.retry_later(edge, |edge| {
                edge.udp.ports.retried();
                edge.udp.reconcile(edge, edge.routes().udp_ports().collect());
            });
        }
    }

    /// Sockets open now.
    pub fn len(&self) -> usize {
        self.ports.len()
    }
}

/// Is UDP `addr` free to bind?
pub fn can_listen(addr: SocketAddr) -> bool {
    std::net::UdpSocket::bind(addr).is_ok()
}

/// One flow as the receive loop knows it.
struct FlowEntry {
    queue: Queue,
    state: Arc<FlowState>,
}

/// What the receive loop and the flow's task share.
struct FlowState {
    /// Cancelled when the flow ends (either side).
    ended: CancellationToken,
    start: Instant,
    /// Milliseconds since `start` of the last datagram either way.
    last: AtomicU64,
}

impl FlowState {
    fn touch(&self) {
        self.last.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Resolves once no datagram went either way for `idle`.
    async fn idle(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
            let due = self.start + last + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

async fn recv_loop(edge: Arc<Edge>, socket: Arc<UdpSocket>, port: u16, token: CancellationToken) {
    let local = socket.local_addr().ok();
    let mut flows: HashMap<SocketAddr, FlowEntry> = HashMap::new();
    let mut refused = super::limits::LogEvery::default();
    // One byte more than the largest datagram carried: a longer one is seen
    // as truncated, and dropped.
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    loop {
        let (n, peer) = tokio::select! {
            _ = token.cancelled() => break,
            r = socket.recv_from(&mut buf) => match r {
                Ok(got) => got,
                Err(e) => {
                    // ICMP errors of earlier sends show up here on some systems.
                    debug!(error = %e, "UDP receive failed");
                    continue;
                }
            },
        };
        if n > MAX_DATAGRAM {
            edge.metrics.udp_dropped("in", "oversize");
            continue;
        }
        let Some(frame) = datagram::encode(&buf[..n]) else { continue };
        if let Some(flow) = flows.get(&peer) {
            if !flow.state.ended.is_cancelled() {
                flow.state.touch();
                match flow.queue.offer(frame) {
                    Ok(()) => {}
                    Err(Refused::Full) => edge.metrics.udp_dropped("in", "queue_full"),
                    Err(Refused::Closed) => edge.metrics.udp_dropped("in", "refused"),
                }
                continue;
            }
            flows.remove(&peer);
        }
        if flows.len() >= edge.udp.per_port {
            flows.retain(|_, f| !f.state.ended.is_cancelled());
        }
        let permit = (flows.len() < edge.udp.per_port)
            .then(|| edge.udp.flows.clone().try_acquire_owned().ok())
            .flatten();
        let Some(permit) = permit else {
            let cap = if flows.len() >= edge.udp.per_port { "port" } else { "edge" };
            edge.metrics.udp_flows_refused.get_or_create(&vec![("cap", cap.to_string())]).inc();
            edge.metrics.udp_dropped("in", "refused");
            if let Some(more) = refused.tick() {
                warn!(port, %peer, cap, refused_since_last_line = more, "UDP reservation at its flow limit; dropping datagrams of new clients");
            }
            continue;
        };
        let Some(reservation) = edge.routes().udp_port(port).cloned() else {
            debug!("no reservation for this UDP port any more");
            continue;
        };
        let (queue, body) = datagram::queue(UDP_FLOW_QUEUE_BYTES, edge.udp.queued.clone());
        let state = Arc::new(FlowState {
            ended: token.child_token(),
            start: Instant::now(),
            last: AtomicU64::new(0),
        });
        let _ = queue.offer(frame);
        flows.insert(peer, FlowEntry { queue, state: state.clone() });
        let span = tracing::debug_span!("flow", %peer);
        tokio::spawn(
            flow(edge.clone(), socket.clone(), reservation, peer, local, body, state, permit)
                .instrument(span),
        );
    }
}

#[allow(clippy::too_many_arguments)]
async fn flow(
    edge: Arc<Edge>,
    socket: Arc<UdpSocket>,
    reservation: Reservation,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    upload: datagram::QueueBody,
    state: Arc<FlowState>,
    _permit: OwnedSemaphorePermit,
) {
    edge.metrics.udp_flows.inc();
    edge.metrics.udp_flows_started.inc();
    let why = carry(&edge, &socket, &reservation, peer, local, upload, &state).await;
    state.ended.cancel();
    edge.metrics.udp_flows.dec();
    edge.metrics.udp_flows_ended.get_or_create(&vec![("reason", why.to_string())]).inc();
    debug!(why, "UDP flow ended");
}

/// Carries one flow until it ends; returns why.
async fn carry(
    edge: &Arc<Edge>,
    socket: &UdpSocket,
    reservation: &Reservation,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    upload: datagram::QueueBody,
    state: &FlowState,
) -> &'static str {
    let counters = edge.metrics.bytes(&super::routes::udp_metric_name(reservation.port.unwrap_or(0)));
    counters.tunnel.request();
    let slot = BudgetSlot::default();
    let upload = Budgeted::new(Counted::new(upload, counters.inbound.clone()), slot.clone());
    let mut body = Some(body::boxed(upload));
    let mut tried = Vec::new();
    let idle = edge.udp.idle_timeout;
    let resp = loop {
        let arrival = edge.registry.arrival();
        tokio::pin!(arrival);
        arrival.as_mut().enable();
        let pick = tokio::select! {
            g = edge.registry.pick_or_wait(&reservation.id, Protocol::Udp, &tried) => g,
            _ = state.ended.cancelled() => return "released",
        };
        let Some(guard) = pick else {
            drop(body);
            if tried.is_empty() {
                counters.tunnel.offline();
            } else {
                counters.tunnel.answered(StatusCode::BAD_GATEWAY);
            }
            // Held until idle: datagrams of this client are dropped, not
            // each one a new search for an agent. An agent that connects
            // ends the hold: the client's next datagram starts a new flow,
            // which finds it (a client that never pauses would otherwise
            // stay cut off).
            tokio::select! {
                _ = state.idle(idle) => {}
                _ = arrival => {}
            }
            return "no_agent";
        };
        tried.push(guard.conn().id);
        slot.set(guard.conn().budget.clone());
        let mut req = Request::new(body.take().expect("body is put back on retry"));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = http::Uri::from_static("https://udp.culvert.invalid/");
        *req.version_mut() = http::Version::HTTP_2;
        let h = req.headers_mut();
        h.insert(STREAM_HEADER, HeaderValue::from_static(StreamKind::Udp.header_value()));
        h.insert(CLIENT_ADDR_HEADER, HeaderValue::from_str(&peer.to_string()).expect("ascii"));
        if let Some(local) = local {
            h.insert(SERVER_ADDR_HEADER, HeaderValue::from_str(&local.to_string()).expect("ascii"));
        }
        match guard.conn().sender.send(req).await {
            Ok(resp) if resp.status() == StatusCode::OK => break (resp, guard),
            Ok(resp) => {
                let why = resp.headers().get(crate::constants::ERROR_HEADER).cloned();
                counters.tunnel.answered(resp.status());
                warn!(status = %resp.status(), reason = ?why, "agent refused the UDP flow");
                state.idle(idle).await;
                return "agent";
            }
            Err(mut e) => match e.take_message() {
                Some(r) if tried.len() < 3 => body = Some(r.into_body()),
                _ => {
                    counters.tunnel.answered(StatusCode::BAD_GATEWAY);
                    warn!(error = %e.error(), "tunnel failed for a UDP flow");
                    return "agent";
                }
            },
        }
    };
    let (resp, _guard) = resp;
    let mut down = Counted::new(resp.into_body(), counters.outbound.clone());
    let mut decoder = Decoder::default();
    let idle_bound = state.idle(idle);
    let mut idle_bound = std::pin::pin!(idle_bound);
    loop {
        let frame = tokio::select! {
            f = down.frame() => f,
            _ = idle_bound.as_mut() => return "idle",
            _ = state.ended.cancelled() => return "released",
        };
        let data = match frame {
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
            Some(Err(e)) => {
                debug!(error = %e, "agent's side of the flow failed");
                return "agent";
            }
            None => return "agent",
        };
        decoder.push(&data);
        loop {
            match decoder.next_datagram() {
                Ok(Some(dg)) => {
                    state.touch();
                    match socket.try_send_to(&dg, peer) {
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            edge.metrics.udp_dropped("out", "socket_full")
                        }
                        Err(e) => debug!(error = %e, "UDP send to the client failed"),
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    warn!(error = %e, "agent sent a broken datagram frame; ending the flow");
                    return "agent";
                }
            }
        }
    }
}
