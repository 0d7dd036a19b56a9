//! How the edge's listeners are bound, and their one accept loop: public
//! HTTPS, the HTTP redirect port, the admin port and the TCP reservation
//! ports.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Most connections taken from a stopped listener's backlog.
const MAX_BACKLOG_TAKEN: usize = 4096;

/// Pause after a failed accept (out of file descriptors and the like).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Connections the kernel completes ahead of the accept loop (the listen
/// backlog; `net.core.somaxconn` may lower it). tokio's `TcpListener::bind`
/// and the standard library's both ask for 128: a burst of more clients
/// than that at once (a load balancer's reconnect, 500 `wrk` connections)
/// had SYNs dropped and waited a second for the retransmit. nginx asks for
/// 511, Go for `somaxconn`.
pub(crate) const LISTEN_BACKLOG: u32 = 1024;

/// Listens on `addr` now (no await: the caller reconciles listeners in one
/// pass) with [`LISTEN_BACKLOG`] and `SO_REUSEADDR`, as tokio's bind does.
pub(crate) fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket =
        if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Accepts on `listener` until `stop` is cancelled and hands every connection
/// to `on_accept`, which must not wait on the client (it spawns a task); the
/// loop never waits on a client. A failed accept backs off briefly. When
/// stopped, the connections the kernel completed already (the listen
/// backlog) are taken too: closing the listener would reset them, failing
/// clients that connected while the edge was still accepting.
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
            _ = stop.cancelled() => break,
        };
        on_accept(tcp, peer);
    }
    for (tcp, peer) in backlog(listener) {
        on_accept(tcp, peer);
    }
}

/// The connections waiting in `listener`'s backlog, taken without waiting
/// (a non-blocking accept on a duplicate of the socket, which does not
/// depend on the runtime having seen their readiness yet).
fn backlog(listener: &TcpListener) -> Vec<(TcpStream, SocketAddr)> {
    use std::os::fd::AsFd;
    let Ok(fd) = listener.as_fd().try_clone_to_owned() else { return Vec::new() };
    let dup = std::net::TcpListener::from(fd);
    let mut out = Vec::new();
    // The socket is non-blocking (shared with the original): WouldBlock ends it.
    // Bounded: clients may keep connecting until the listener is closed.
    while let (true, Ok((tcp, peer))) = (out.len() < MAX_BACKLOG_TAKEN, dup.accept()) {
        let tokio = tcp.set_nonblocking(true).and_then(|()| TcpStream::from_std(tcp));
        match tokio {
            Ok(t) => out.push((t, peer)),
            Err(e) => warn!(error = %e, "taking a connection of the backlog failed"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_burst_of_clients_beyond_128_is_completed_by_the_kernel() {
        // Nothing accepts: every connect below completes only if the
        // backlog holds it (a full one drops the SYN, and the client waits
        // a second for the retransmit).
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let connects =
            (0..300).map(|_| tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr)));
        let done = futures_util::future::join_all(connects).await;
        let ok = done.iter().filter(|r| matches!(r, Ok(Ok(_)))).count();
        assert_eq!(ok, 300, "connections completed without an accept");
        assert_eq!(backlog(&listener).len(), 300);
    }

    #[tokio::test]
    async fn a_stopped_loop_takes_the_connections_of_the_backlog() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Connected (the kernel completed the handshakes), never accepted.
        let clients: Vec<_> = (0..3).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        let stop = CancellationToken::new();
        stop.cancel();
        let mut taken = Vec::new();
        accept_loop(&listener, &stop, |_, peer| taken.push(peer)).await;
        let mut want: Vec<_> = clients.iter().map(|c| c.local_addr().unwrap()).collect();
        taken.sort();
        want.sort();
        assert_eq!(taken, want);
        assert!(backlog(&listener).is_empty(), "nothing left");
    }
}
