//! The one accept loop of the edge's listeners: public HTTPS, the HTTP
//! redirect port, the admin port and the TCP reservation ports.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Pause after a failed accept (out of file descriptors and the like).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Accepts on `listener` until `stop` is cancelled and hands every connection
/// to `on_accept`, which must not wait on the client (it spawns a task); the
/// loop never waits on a client. A failed accept backs off briefly.
pub(crate) async fn accept_loop<F>(listener: &TcpListener, stop: &CancellationToken, mut on_accept: F)
where
    F: FnMut(TcpStream, SocketAddr),
{
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    let addr = listener.local_addr().ok();
                    warn!(?addr, error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        on_accept(tcp, peer);
    }
}
