//! Placing one request on a connection of the tunnel, and again on another
//! connection when the first refused it.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tracing::debug;

use crate::api::{Protocol, Reservation};
use crate::edge::Edge;
use crate::edge::registry::StreamGuard;
use crate::edge::status::traffic::TunnelCounters;
use crate::http::{error_chain, error_page};
use crate::tunnel::body::{self, BoxBody};
use crate::tunnel::budget::BudgetSlot;
use crate::tunnel::client::{SendError, Sender};
use crate::tunnel::head::Fields;
use crate::tunnel::stream::RecvBody;

/// Attempts to place one request on a connection before answering 502.
const MAX_ATTEMPTS: usize = 3;

/// What [`send`] places on a tunnel connection.
pub(super) trait Outgoing: Sized {
    type Answer;

    /// Sends on `sender`; a failure says why, and gives back what may be
    /// placed on another connection.
    fn send_on(
        self,
        sender: &Sender,
    ) -> impl Future<Output = Result<Self::Answer, (SendError, Option<Self>)>> + Send;
}

/// A request as hyper read it, with the `forwarding` fields its head carries
/// after its own.
pub(super) struct Proxied<'a> {
    pub request: Request<BoxBody>,
    pub forwarding: &'a Fields,
}

impl Outgoing for Proxied<'_> {
    type Answer = Response<RecvBody>;

    /// Placed again with the request the connection hands back, or else, for
    /// a request without a body, one built again from the head it sent
    /// ([`SendError::take_replay`]).
    async fn send_on(self, sender: &Sender) -> Result<Response<RecvBody>, (SendError, Option<Self>)> {
        let forwarding = self.forwarding;
        sender.send_with(self.request, forwarding).await.map_err(|mut e| {
            let again = e.take_message().or_else(|| {
                let head = e.take_replay()?;
                Some(Request::from_parts(head, body::empty()))
            });
            (e, again.map(|request| Proxied { request, forwarding }))
        })
    }
}

/// A bodiless request's head as the tunnel's text (the HTTP/1.1 fast path,
/// [`super::h1`]), answered as text too ([`Sender::send_head`]).
pub(super) struct TextHead(pub Bytes);

impl Outgoing for TextHead {
    type Answer = (Bytes, RecvBody);

    async fn send_on(self, sender: &Sender) -> Result<(Bytes, RecvBody), (SendError, Option<Self>)> {
        sender.send_head(self.0.clone()).await.map_err(|e| {
            let again = e.may_send_again().then_some(self);
            (e, again)
        })
    }
}

/// Sends `outgoing` on the connection of `reservation`'s HTTP agents with the
/// fewest open streams. A connection that refuses it (an agent draining at
/// that very moment) is skipped and what it gives back placed on another, up
/// to [`MAX_ATTEMPTS`]. A request's body charges the `budget` of the
/// connection it is placed on. Fails with the 502 page to answer (counted in
/// `tunnel`).
pub(super) async fn send<O: Outgoing>(
    edge: &Edge,
    reservation: &Reservation,
    host: &str,
    mut outgoing: O,
    tunnel: &TunnelCounters,
    budget: &BudgetSlot,
) -> Result<(O::Answer, StreamGuard), Response<BoxBody>> {
    let Some(slot) = edge.registry.stream_slot().await else {
        tunnel.answered(StatusCode::SERVICE_UNAVAILABLE);
        let reason = "the edge has every tunnel stream it may open in use; try again shortly";
        return Err(error_page(StatusCode::SERVICE_UNAVAILABLE, host, reason));
    };
    let mut slot = Some(slot);
    // The connections tried, on the stack: a request is placed at most
    // MAX_ATTEMPTS times.
    let (mut tried, mut attempts) = ([0u64; MAX_ATTEMPTS], 0);
    // Why the last connection tried failed, for the page when no other is left.
    let mut failed = String::new();
    loop {
        let Some(guard) =
            edge.registry.pick_or_wait(&reservation.id, Protocol::Http, &tried[..attempts]).await
        else {
            let reason = if attempts == 0 {
                tunnel.offline();
                "the tunnel is offline: no agent is connected for this host".to_string()
            } else {
                tunnel.answered(StatusCode::BAD_GATEWAY);
                format!("every agent connection of this tunnel failed: {failed}")
            };
            return Err(error_page(StatusCode::BAD_GATEWAY, host, &reason));
        };
        tried[attempts] = guard.conn().id;
        attempts += 1;
        budget.set(guard.conn().budget.clone());
        match outgoing.send_on(&guard.conn().sender).await {
            Ok(answer) => return Ok((answer, guard.with_slot(slot.take().expect("taken once")))),
            Err((e, again)) => {
                failed = error_chain(e.error());
                debug!(error = %failed, conn = guard.conn().id, "stream failed");
                match again {
                    Some(o) if attempts < MAX_ATTEMPTS => outgoing = o,
                    _ => {
                        tunnel.answered(StatusCode::BAD_GATEWAY);
                        let reason = format!("the tunnel failed: {failed}");
                        return Err(error_page(StatusCode::BAD_GATEWAY, host, &reason));
                    }
                }
            }
        }
    }
}
