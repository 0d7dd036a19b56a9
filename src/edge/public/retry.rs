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
use crate::tunnel::head::Fields;
use crate::tunnel::stream::RecvBody;

/// Attempts to place one request on a connection before answering 502.
const MAX_ATTEMPTS: usize = 3;

/// What [`send`] places on a tunnel connection. An enum, not a trait with a
/// sending method per kind: that method's future, nested in this loop's,
/// cost every request ~400 instructions of moves (callgrind, HTTP/2 and the
/// HTTP/1.1 fast path alike). Not boxed either: it is moved once per
/// request, an allocation would cost more.
#[allow(clippy::large_enum_variant)]
pub(super) enum Outgoing<'a> {
    /// A request as hyper read it, with the forwarding fields its head
    /// carries after its own.
    Request(Request<BoxBody>, &'a Fields),
    /// A bodiless request's head as the tunnel's text (the HTTP/1.1 fast
    /// path, [`super::h1`]), answered as text too
    /// ([`Sender::send_head`](crate::tunnel::client::Sender::send_head)).
    Text(Bytes),
}

/// What an [`Outgoing`] got back: a response, or (for `Text`) its head as
/// text and its body.
pub(super) enum Answer {
    Response(Response<RecvBody>),
    Text(Bytes, RecvBody),
}

/// Sends `outgoing` on the connection of `reservation`'s HTTP agents with the
/// fewest open streams. A connection that refuses it (an agent draining at
/// that very moment) is skipped and what it gives back placed on another, up
/// to [`MAX_ATTEMPTS`]. A request's body charges the `budget` of the
/// connection it is placed on. Fails with the 502 page to answer (counted in
/// `tunnel`).
pub(super) async fn send(
    edge: &Edge,
    reservation: &Reservation,
    host: &str,
    mut outgoing: Outgoing<'_>,
    tunnel: &TunnelCounters,
    budget: &BudgetSlot,
) -> Result<(Answer, StreamGuard), Response<BoxBody>> {
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
        let sender = &guard.conn().sender;
        // A request goes again with what the connection hands back, or else,
        // without a body, built again from the head it sent
        // ([`SendError::take_replay`]); a text head as it was.
        let sent = match outgoing {
            Outgoing::Request(request, forwarding) => match sender.send_with(request, forwarding).await {
                Ok(response) => Ok(Answer::Response(response)),
                Err(mut e) => {
                    let again = e.take_message().or_else(|| {
                        let head = e.take_replay()?;
                        Some(Request::from_parts(head, body::empty()))
                    });
                    Err((e, again.map(|request| Outgoing::Request(request, forwarding))))
                }
            },
            Outgoing::Text(head) => match sender.send_head(head.clone()).await {
                Ok((block, body)) => Ok(Answer::Text(block, body)),
                Err(e) => {
                    let again = e.may_send_again().then_some(Outgoing::Text(head));
                    Err((e, again))
                }
            },
        };
        match sent {
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
