//! Placing one request on a connection of the tunnel, and again on another
//! connection when the first refused it.

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

/// Sends `request` on the connection of `reservation`'s HTTP agents with the
/// fewest open streams. A connection that refuses it (an agent draining at
/// that very moment) is skipped and the request placed on another, up to
/// [`MAX_ATTEMPTS`]: with the request the connection hands back, or else, for
/// a request without a body, one built again from the head it sent
/// ([`SendError::take_replay`](crate::tunnel::client::SendError::take_replay)).
/// Its head carries the `forwarding` fields after its own. The request's body
/// charges the `budget` of the connection it is placed on.
/// Fails with the 502 page to answer (counted in `tunnel`).
pub(super) async fn send(
    edge: &Edge,
    reservation: &Reservation,
    host: &str,
    mut request: Request<BoxBody>,
    forwarding: &Fields,
    tunnel: &TunnelCounters,
    budget: &BudgetSlot,
) -> Result<(Response<RecvBody>, StreamGuard), Response<BoxBody>> {
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
        match guard.conn().sender.send_with(request, forwarding).await {
            Ok(resp) => return Ok((resp, guard.with_slot(slot.take().expect("taken once")))),
            Err(mut e) => {
                failed = error_chain(e.error());
                debug!(error = %failed, conn = guard.conn().id, "stream failed");
                let again = e.take_message().or_else(|| {
                    let head = e.take_replay()?;
                    Some(Request::from_parts(head, body::empty()))
                });
                match again {
                    Some(r) if attempts < MAX_ATTEMPTS => request = r,
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
