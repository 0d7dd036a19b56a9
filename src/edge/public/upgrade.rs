//! HTTP/1.1 upgrades (WebSocket...) through the tunnel: the request goes out
//! as an upgrade stream whose body is fed later, and once the backend switched
//! protocols the upgraded public connection is spliced to the stream.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tracing::{Instrument, debug};

use super::head::clean_response;
use crate::constants::UPGRADE_HEADER;
use crate::edge::registry::StreamGuard;
use crate::tunnel::body::{self, BoxBody, ChannelBody, Counted};

/// The public request is an HTTP/1.1 upgrade (WebSocket...).
pub(super) fn upgrade_of<B>(req: &Request<B>) -> Option<HeaderValue> {
    let connection_upgrade = req
        .headers()
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if connection_upgrade { req.headers().get(header::UPGRADE).cloned() } else { None }
}

/// The body of an upgrade stream: fed later, from the upgraded public
/// connection, through the sender.
pub(super) fn request_body(bytes_in: Counter) -> (BoxBody, mpsc::Sender<Bytes>) {
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    (body::boxed(Counted::new(ChannelBody(rx), bytes_in)), tx)
}

/// The backend switched protocols: answers the client 101 and splices the
/// upgraded public connection to the stream (the client's bytes into `tx`,
/// the stream's body `down` to the client), holding the stream's `guard`
/// until both directions have ended.
pub(super) fn switch(
    mut rparts: http::response::Parts,
    down: Counted<Incoming>,
    asked: Option<HeaderValue>,
    on_upgrade: OnUpgrade,
    tx: mpsc::Sender<Bytes>,
    guard: StreamGuard,
) -> Response<BoxBody> {
    let upgrade_to = rparts.headers.get(UPGRADE_HEADER).cloned().or(asked);
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
            let _guard = guard;
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => return debug!(error = %e, "public upgrade failed"),
            };
            let (read, write) = tokio::io::split(TokioIo::new(upgraded));
            let up = body::copy_to_channel(read, tx);
            let down = body::copy_body(down, write);
            let (up, down) = tokio::join!(up, down);
            debug!(?up, ?down, "upgraded stream ended");
        }
        .in_current_span(),
    );
    out
}
