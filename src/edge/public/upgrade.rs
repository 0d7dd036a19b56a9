//! HTTP/1.1 upgrades (WebSocket...) through the tunnel: the request goes out
//! as an upgrade stream whose body is fed later, and once the backend switched
//! protocols the upgraded public connection is spliced to the stream.

use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::ReadHalf;
use tokio::sync::oneshot;
use tracing::{Instrument, debug};

use super::head::clean_response;
use crate::constants::{PUBLIC_IDLE_TIMEOUT, UPGRADE_HEADER};
use crate::edge::idle::Tracked;
use crate::edge::registry::StreamGuard;
use crate::tunnel::body::{self, BoxBody, Counted, Late, LateReadBody};
use crate::tunnel::budget::{BudgetSlot, Budgeted};
use crate::tunnel::stream::RecvBody;

/// The public request is an HTTP/1.1 upgrade to protocols that are all in
/// `allowed` (WebSocket by default). Any other upgrade (`h2c`...) is not one:
/// the request goes on as a plain request, its `Upgrade` dropped with the
/// other hop-by-hop headers.
pub(crate) fn upgrade_of<B>(req: &Request<B>, allowed: &[String]) -> Option<HeaderValue> {
    // `Upgrade` first: most requests have none, and need no other lookup.
    let mut values = req.headers().get_all(header::UPGRADE).iter();
    let (value, None) = (values.next()?, values.next()) else { return None };
    let connection_upgrade = req
        .headers()
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    let all_allowed = value.to_str().ok()?.split(',').map(str::trim).all(|t| is_allowed(t, allowed));
    (connection_upgrade && all_allowed).then(|| value.clone())
}

fn is_allowed(token: &str, allowed: &[String]) -> bool {
    !token.is_empty() && allowed.iter().any(|a| a.eq_ignore_ascii_case(token))
}

/// The upgraded public connection's reading half, once there is one.
pub(super) type UpgradeReader = oneshot::Sender<Late<ReadHalf<Tracked<TokioIo<Upgraded>>>>>;

/// The body of an upgrade stream: it reads the upgraded public connection
/// once the sender hands it over, one chunk at a time, each charged to the
/// `budget` of the stream's connection.
pub(super) fn request_body(bytes_in: Counter, budget: BudgetSlot) -> (BoxBody, UpgradeReader) {
    let (late, tx) = LateReadBody::new();
    (body::boxed(Budgeted::new(Counted::new(late, bytes_in), budget)), tx)
}

/// The backend switched protocols: answers the client 101 and splices the
/// upgraded public connection to the stream (its reading half to the request body through `tx`,
/// the stream's body `down` to the client), holding the stream's `guard`
/// until both directions have ended.
pub(super) fn switch(
    mut rparts: http::response::Parts,
    down: Counted<RecvBody>,
    asked: Option<HeaderValue>,
    on_upgrade: OnUpgrade,
    tx: UpgradeReader,
    guard: StreamGuard,
    edge: &crate::edge::Edge,
) -> Response<BoxBody> {
    let (allowed, half_close) = (&edge.upgrades, edge.half_close_timeout);
    let upgrade_to = rparts.headers.get(UPGRADE_HEADER).cloned().or(asked);
    // The backend may only switch to what the client asked for (and the edge allows).
    if let Some(to) = &upgrade_to
        && !to.to_str().is_ok_and(|t| t.split(',').map(str::trim).all(|t| is_allowed(t, allowed)))
    {
        debug!(upgrade = ?to, "the backend switched to a protocol the edge does not pass");
        return crate::http::error_page(
            StatusCode::BAD_GATEWAY,
            "",
            "the backend switched to a protocol the edge does not pass through",
        );
    }
    clean_response(&mut rparts.headers);
    let mut out = Response::new(body::empty());
    *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *out.headers_mut() = rparts.headers;
    out.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    if let Some(u) = upgrade_to {
        out.headers_mut().insert(header::UPGRADE, u);
    }
    tokio::spawn(
        async move {
            // Held until both directions have ended.
            let guard = Arc::new(guard);
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => return debug!(error = %e, "public upgrade failed"),
            };
            // Bounded whether or not anything reads: idle, or half-closed and silent.
            let activity = crate::edge::idle::Activity::default();
            let (read, write) = tokio::io::split(activity.track(TokioIo::new(upgraded)));
            let _ = tx.send((read, Box::new(guard.clone())));
            tokio::select! {
                down = body::copy_body(down, write) => match down {
                    Ok(bytes) => debug!(bytes, "upgraded stream: backend to client ended"),
                    Err(e) => {
                        debug!(error = %e, "upgraded stream: backend to client failed; closing it");
                        return activity.close();
                    }
                },
                why = activity.expired(PUBLIC_IDLE_TIMEOUT, half_close) => {
                    debug!(why, "closing the upgraded stream");
                    return activity.close();
                }
            }
            // The client's bytes still flow through the request body: the same bounds hold.
            let why = activity.expired(PUBLIC_IDLE_TIMEOUT, half_close).await;
            debug!(why, "upgraded stream ended");
            activity.close();
        }
        .in_current_span(),
    );
    out
}
