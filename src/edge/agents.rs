//! The tunnel endpoint: authenticates an agent's WebSocket upgrade, then
//! runs HTTP/2 (edge = client) over it and registers the connection.

use std::net::SocketAddr;
use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tracing::{Instrument, info, warn};

use super::Edge;
use super::store::{StoreError, TunnelKeyAuth};
use crate::constants::{
    AGENT_ID_HEADER, MSG_READY, PUBLIC_URL_HEADER, TUNNEL_PROTOCOL_HEADER, VERSION_HEADER,
};
use crate::tunnel::body::{self, BoxBody};
use crate::tunnel::handshake::Refusal;
use crate::tunnel::tls::KeepBuffers;
use crate::tunnel::ws::{self, Control, WsStream};

/// What an agent's tunnel connection takes from the public TLS connection
/// its upgrade came on.
pub struct AgentTls {
    /// Makes the connection keep its small buffers while it waits.
    pub keep: KeepBuffers,
    /// The cipher suite agreed (the agent's choice, `--tunnel-cipher`).
    pub cipher: &'static str,
}

/// Refused handshakes: counted per source address, and logged at most once
/// per [`LOG_EVERY`](super::limits::LOG_EVERY) (with how many went unlogged).
pub struct Refusals {
    per_address: super::limits::PerAddress,
    log: std::sync::Mutex<super::limits::LogEvery>,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals {
            per_address: super::limits::PerAddress::new(
                crate::constants::MAX_REFUSED_HANDSHAKES,
                crate::constants::REFUSED_HANDSHAKES_WINDOW,
            ),
            log: Default::default(),
        }
    }
}

fn refuse(edge: &Edge, refusal: Refusal, peer: SocketAddr) -> Response<BoxBody> {
    edge.metrics.handshake_failed(refusal.code());
    // A full slot or a store failure is not the agent's doing.
    if !matches!(refusal, Refusal::TooManyAgents { .. } | Refusal::Internal | Refusal::TooManyRefusals { .. })
    {
        edge.refusals.per_address.refused(peer.ip());
    }
    if let Some(unlogged) = edge.refusals.log.lock().expect("poisoned").tick() {
        warn!(%peer, code = refusal.code(), unlogged, "tunnel refused: {}", refusal.message());
    }
    let json = serde_json::to_vec(&refusal.body()).expect("serializable");
    let mut r = Response::new(body::full(json));
    *r.status_mut() = refusal.status();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn header<B>(req: &Request<B>, name: impl header::AsHeaderName) -> Option<&str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Answers `GET /_culvert/v1/connect`.
pub async fn accept(
    edge: Arc<Edge>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    tls: AgentTls,
) -> Response<BoxBody> {
    if let Some(left) = edge.refusals.per_address.blocked(peer.ip()) {
        return refuse(&edge, Refusal::TooManyRefusals { retry_in_seconds: left.as_secs().max(1) }, peer);
    }
    let ws_key = match (
        header(&req, header::UPGRADE).map(|u| u.eq_ignore_ascii_case("websocket")),
        header(&req, header::SEC_WEBSOCKET_KEY),
        header(&req, header::SEC_WEBSOCKET_VERSION),
    ) {
        (Some(true), Some(key), Some("13")) => key.to_string(),
        _ => return refuse(&edge, Refusal::NotWebSocket, peer),
    };
    let protocol_version = match Refusal::check_version(header(&req, VERSION_HEADER)) {
        Ok(v) => v,
        Err(r) => return refuse(&edge, r, peer),
    };
    let Some(secret) = header(&req, header::AUTHORIZATION)
        .and_then(|a| a.strip_prefix("Bearer ").or_else(|| a.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|s| !s.is_empty())
    else {
        return refuse(&edge, Refusal::MissingKey, peer);
    };
    let digest = crate::edge::store::secret_digest(secret);
    let secret = secret.to_string();
    let grant = match edge.store.run(move |s| s.authenticate_tunnel_key(&secret)).await {
        Ok(TunnelKeyAuth::Valid(grant)) => {
            edge.known_grants.lock().expect("poisoned").insert(digest, grant.clone());
            grant
        }
        // PostgreSQL down: a key this edge accepted before (and no reload
        // has found revoked since) still opens its tunnel.
        Err(StoreError::Unavailable(e))
            if edge.known_grants.lock().expect("poisoned").contains_key(&digest) =>
        {
            warn!(error = %e, "the store is unavailable; accepting a tunnel key this edge knows");
            edge.known_grants.lock().expect("poisoned")[&digest].clone()
        }
        Ok(TunnelKeyAuth::Unknown) => return refuse(&edge, Refusal::UnknownKey, peer),
        Ok(TunnelKeyAuth::Revoked) => return refuse(&edge, Refusal::RevokedKey, peer),
        Ok(TunnelKeyAuth::NotATunnelKey) => return refuse(&edge, Refusal::NotATunnelKey, peer),
        Err(e) => {
            warn!(error = %e, "store failed during a tunnel handshake");
            return refuse(&edge, Refusal::Internal, peer);
        }
    };
    if let Some(wanted) = header(&req, TUNNEL_PROTOCOL_HEADER)
        && wanted != grant.protocol.as_str()
    {
        let refusal =
            Refusal::WrongProtocol { key: grant.protocol.as_str(), agent: wanted.chars().take(16).collect() };
        return refuse(&edge, refusal, peer);
    }
    let Some(slot) = edge.registry.reserve_slot(&grant.key_id, edge.max_agents_per_key) else {
        return refuse(&edge, Refusal::TooManyAgents { max: edge.max_agents_per_key }, peer);
    };
    let agent_id = header(&req, AGENT_ID_HEADER).unwrap_or("-").chars().take(64).collect::<String>();
    let public_url = edge.public_url(&grant.reservation);
    let protocol = grant.protocol;

    let on_upgrade = hyper::upgrade::on(&mut req);
    let span = tracing::info_span!(
        "agent", %peer, agent = %agent_id, key = %grant.key_id,
        reservation = %public_url, protocol = %grant.protocol
    );
    let task_edge = edge.clone();
    let url = public_url.clone();
    tokio::spawn(
        async move {
            let edge = task_edge;
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => return warn!(error = %e, "agent upgrade failed"),
            };
            tls.keep.keep();
            let control = Arc::new(Control::default());
            let budget = edge.registry.tunnel_budget();
            let stream = WsStream::new(TokioIo::new(upgraded), ws::Role::Server, control.clone())
                .with_budget(budget.clone());
            let wire = crate::tunnel::Wire::of_version(protocol_version);
            let (sender, mut conn) = match crate::tunnel::client::start(stream, wire).await {
                Ok(x) => x,
                Err(e) => return warn!(error = %e, ?wire, "starting the tunnel's wire with the agent failed"),
            };
            let registered = edge.registry.add(
                grant.key_id.clone(),
                grant.reservation.id.clone(),
                super::registry::Origin {
                    agent_id,
                    peer,
                    protocol_version,
                    cipher: tls.cipher,
                    since: super::store::unix_now(),
                },
                grant.protocol,
                super::registry::Link { sender, control: control.clone(), budget },
            );
            drop(slot);
            edge.metrics.tunnels_connected.inc();
            // Revoked while we were setting up? Then close right away.
            let live = edge.store.run(|s| s.live_tunnel_key_ids()).await;
            if !live.map(|l| l.contains(&grant.key_id)).unwrap_or(true) {
                registered.cancel.cancel();
            }
            control.send(MSG_READY);
            info!(url = %url, cipher = tls.cipher, "agent connected");
            const SHUTTING_DOWN: &str = "the edge is shutting down";
            let cut = tokio::select! {
                r = &mut conn => Err(match r {
                    Ok(()) => "closed".to_string(),
                    Err(e) => crate::http::error_chain(&e),
                }),
                _ = registered.cancel.cancelled() => Ok(if edge.shutdown.is_cancelled() {
                    SHUTTING_DOWN
                } else {
                    "the edge closed it: its tunnel key was revoked or its reservation released"
                }),
                // Not at the start of the drain: requests of public
                // connections still open may need this tunnel until it ends.
                _ = edge.stopped.cancelled() => Ok(SHUTTING_DOWN),
            };
            // Cut here: what waits on the connection fails now, with why.
            let reason = match cut {
                Ok(why) => {
                    conn.close(why);
                    why.to_string()
                }
                Err(ended) => ended,
            };
            drop(conn);
            edge.registry.remove(&registered);
            edge.metrics.tunnels_connected.dec();
            info!(reason = %reason, "agent disconnected");
        }
        .instrument(span),
    );

    let mut r = Response::new(body::empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&crate::tunnel::handshake::accept_key(ws_key.as_bytes()))
            .expect("base64 is ascii"),
    );
    h.insert(TUNNEL_PROTOCOL_HEADER, HeaderValue::from_static(protocol.as_str()));
    h.insert(VERSION_HEADER, HeaderValue::from(protocol_version));
    if let Ok(v) = HeaderValue::from_str(&public_url) {
        h.insert(PUBLIC_URL_HEADER, v);
    }
    r
}
