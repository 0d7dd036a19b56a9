//! Kept-alive HTTP/1.1 connections to plain-HTTP backends, the most common
//! kind, without hyper-util's general client in the way: a request takes an
//! idle connection to its backend (or opens one), is written there as it is
//! (origin form, its own `Host`) by its own task ([`super::h1`]: no
//! connection task), and the connection goes back once the response body
//! has ended. h2c and HTTPS backends keep hyper-util's client
//! ([`super::backend::client`]).
//!
//! A backend that closed an idle connection just as a request took it gets
//! the request again on a new connection: always when the request was not
//! written yet (a closed idle connection is seen before anything is written
//! to it), and when it was written but nothing
//! came back if it can safely be sent twice (as Go's `net/http` does): a
//! GET, HEAD, OPTIONS or TRACE, or any request with an `Idempotency-Key`,
//! without a body, on a connection idle long enough for a backend's
//! keep-alive timeout to have closed it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Body;
use tokio::net::TcpStream;
use tracing::debug;

use super::h1::{self, Conn};
use crate::tunnel::body::BoxBody;

/// How long the newest [`WARM_PER_BACKEND`] idle connections of a backend
/// are kept (hyper-util's client keeps every one this long).
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle connections of a backend kept for [`IDLE_TIMEOUT`]; the others (a
/// burst's) close after [`BURST_IDLE_TIMEOUT`] unused.
const WARM_PER_BACKEND: usize = 16;
const BURST_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections kept per backend at most (as many as were busy at once,
/// up to this); more are closed.
const MAX_IDLE_PER_BACKEND: usize = 1024;
/// How often idle connections are looked at while there are any.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A connection idle at least this long may have met its backend's
/// keep-alive timeout (2 s for gunicorn, 5 s for Node.js and Apache) as a
/// request went out on it; a request that can be sent twice is kept for
/// that (a busy connection's requests are not: no copy on the hot path).
const REPLAY_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Why a request did not get a response head from its backend.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    // The sources follow in error chains (`http::error_chain`): not repeated here.
    #[error("tcp connect error")]
    Connect(#[source] std::io::Error),
    #[error("tcp connect error: no connection within {0:?} (the route's connect timeout)")]
    ConnectTimeout(Duration),
    #[error("request failed")]
    Request(#[source] h1::Error),
}

impl PoolError {
    /// The backend could not be reached at all (no connection).
    pub fn is_connect(&self) -> bool {
        matches!(self, PoolError::Connect(_) | PoolError::ConnectTimeout(_))
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

impl Idle {
    /// Still worth keeping: not idle longer than its place in the list
    /// (`newer` idle connections of the same backend after it) allows.
    fn usable(&self, now: Instant, newer: usize) -> bool {
        let limit = if newer < WARM_PER_BACKEND { IDLE_TIMEOUT } else { BURST_IDLE_TIMEOUT };
        now.duration_since(self.since) < limit
    }
}

/// Drops what is no longer worth keeping of one backend's idle connections
/// (oldest first), closing them.
fn sweep(conns: &mut Vec<Idle>, now: Instant) {
    let len = conns.len();
    let mut at = 0;
    conns.retain(|c| {
        at += 1;
        c.usable(now, len - at)
    });
}

/// Whether a sweeper task runs (it ends when no idle connection is left,
/// or with its runtime).
static SWEEPING: AtomicBool = AtomicBool::new(false);

struct Sweeping;

impl Drop for Sweeping {
    fn drop(&mut self) {
        SWEEPING.store(false, Ordering::Release);
    }
}

/// Closes idle connections as they expire, even when no request comes to
/// take them (after a burst, hundreds of connections would otherwise stay
/// open until their backends close them).
fn start_sweeper() {
    if SWEEPING.swap(true, Ordering::AcqRel) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        SWEEPING.store(false, Ordering::Release);
        return;
    };
    runtime.spawn(async {
        let _running = Sweeping;
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            let mut idle = idle().lock().expect("poisoned");
            let now = Instant::now();
            for (_, conns) in idle.iter_mut() {
                sweep(conns, now);
            }
            idle.retain(|(_, conns)| !conns.is_empty());
            if idle.is_empty() {
                return;
            }
        }
    });
}

/// Idle connections by backend (few backends: a list), each backend's
/// oldest first.
type IdleList = Vec<(String, Vec<Idle>)>;

fn idle() -> &'static Mutex<IdleList> {
    static IDLE: OnceLock<Mutex<IdleList>> = OnceLock::new();
    IDLE.get_or_init(Mutex::default)
}

/// The newest idle connection to `authority` and how long it was idle;
/// closed and expired ones met on the way are dropped.
fn checkout(authority: &str) -> Option<(Conn, Duration)> {
    let now = Instant::now();
    loop {
        let c = {
            let mut idle = idle().lock().expect("poisoned");
            idle.iter_mut().find(|(a, _)| a == authority)?.1.pop()?
        };
        // Out of the lock: the check is a system call.
        if c.usable(now, 0) && c.conn.is_open() {
            return Some((c.conn, now.duration_since(c.since)));
        }
    }
}

/// The head of a request that may be sent again after its connection closed
/// with nothing read (RFC 9110 9.2.2; Go's `isReplayable`): no body, and a
/// safe method or an idempotency key.
fn replayable(req: &Request<BoxBody>) -> Option<http::request::Parts> {
    use http::Method;
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE);
    let keyed =
        || req.headers().contains_key("idempotency-key") || req.headers().contains_key("x-idempotency-key");
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    if !req.body().is_end_stream() || upgrade || !(safe || keyed()) {
        return None;
    }
    let mut head = Request::new(());
    *head.method_mut() = req.method().clone();
    *head.uri_mut() = req.uri().clone();
    *head.version_mut() = req.version();
    *head.headers_mut() = req.headers().clone();
    Some(head.into_parts().0)
}

/// A connection whose last response has ended goes back to the idle list.
fn checkin(authority: String, conn: Conn) {
    let mut idle = idle().lock().expect("poisoned");
    let conns = match idle.iter().position(|(a, _)| *a == authority) {
        Some(at) => &mut idle[at].1,
        None => {
            idle.push((authority, Vec::new()));
            &mut idle.last_mut().expect("just pushed").1
        }
    };
    let now = Instant::now();
    if conns.len() < MAX_IDLE_PER_BACKEND {
        conns.push(Idle { conn, since: now });
    }
    drop(idle);
    start_sweeper();
}

async fn connect(authority: &str, timeout: Duration) -> Result<Conn, PoolError> {
    let tcp = match tokio::time::timeout(timeout, TcpStream::connect(authority)).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return Err(PoolError::Connect(e)),
        Err(_) => return Err(PoolError::ConnectTimeout(timeout)),
    };
    let _ = tcp.set_nodelay(true);
    Ok(Conn::new(tcp))
}

/// Sends `req` (its URI in origin form, its `Host` set) to the plain-HTTP
/// backend at `authority` on a kept-alive connection, and waits for the
/// response head.
pub async fn send(
    authority: &str,
    connect_timeout: Duration,
    mut req: Request<BoxBody>,
) -> Result<Response<BoxBody>, PoolError> {
    let mut reused = checkout(authority);
    loop {
        let fresh = reused.is_none();
        let (conn, idle_for) = match reused.take() {
            Some(reused) => reused,
            // Boxed: the rarely taken path would size every stream's future.
            None => (Box::pin(connect(authority, connect_timeout)).await?, Duration::ZERO),
        };
        let replay = if idle_for >= REPLAY_AFTER_IDLE { replayable(&req) } else { None };
        let back = authority.to_string();
        match h1::exchange(conn, req, Box::new(move |conn| checkin(back, conn))).await {
            Ok(resp) => return Ok(resp.map(crate::tunnel::body::boxed)),
            Err(h1::Failed { error, request }) => match (request, replay) {
                // Not written: the backend had closed this idle connection.
                (Some(again), _) if !fresh => req = again,
                // Written as the backend closed it: nothing was done twice.
                (None, Some(head)) if !fresh && error.closed_before_response() => {
                    debug!(%error, "the backend closed an idle connection as the request went out; sending it again");
                    req = Request::from_parts(head, crate::tunnel::body::empty());
                }
                _ => return Err(PoolError::Request(error)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::tunnel::body;

    const CONNECT: Duration = Duration::from_secs(5);

    /// A kept-alive HTTP/1.1 backend on 127.0.0.1 that counts the
    /// connections it accepted; `HEAD` gets no body, the rest `ok`.
    async fn backend() -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let body = if req.method() == http::Method::HEAD { "" } else { "ok" };
                    Ok::<_, Infallible>(Response::new(http_body_util::Full::new(Bytes::from_static(
                        body.as_bytes(),
                    ))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
                );
            }
        });
        (addr, accepted)
    }

    fn request(method: http::Method, addr: &str) -> Request<BoxBody> {
        let mut r = Request::new(body::empty());
        *r.method_mut() = method;
        *r.uri_mut() = http::Uri::from_static("/x");
        r.headers_mut().insert(http::header::HOST, addr.parse().unwrap());
        r
    }

    #[tokio::test]
    async fn requests_one_after_another_share_one_connection() {
        let (addr, accepted) = backend().await;
        for _ in 0..5 {
            let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
        }
        // A HEAD answer has no body to read: its connection is reused too.
        for _ in 0..3 {
            let resp = send(&addr, CONNECT, request(http::Method::HEAD, &addr)).await.unwrap();
            drop(resp);
        }
        send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn as_many_connections_as_requests_at_once_and_all_kept() {
        let (addr, accepted) = backend().await;
        for _ in 0..3 {
            let all = (0..20).map(|_| async {
                let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
                resp.into_body().collect().await.unwrap().to_bytes()
            });
            let bodies = futures_util::future::join_all(all).await;
            assert!(bodies.iter().all(|b| b == "ok"));
        }
        // Twenty at once the first time; the rounds after reuse them.
        assert!(accepted.load(Ordering::SeqCst) <= 20, "{}", accepted.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_bursts_extra_connections_close_once_idle_and_the_warm_ones_stay() {
        let (addr, accepted) = backend().await;
        let all = (0..40).map(|_| async {
            let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
            resp.into_body().collect().await.unwrap().to_bytes()
        });
        futures_util::future::join_all(all).await;
        let idle_now = || {
            let idle = idle().lock().unwrap();
            idle.iter().find(|(a, _)| *a == addr).map_or(0, |(_, c)| c.len())
        };
        assert_eq!(idle_now(), 40);
        // What the sweeper finds once they were unused for BURST_IDLE_TIMEOUT
        // (and later, for IDLE_TIMEOUT), without waiting for it.
        let sweep_at = |later: Duration| {
            let mut idle = idle().lock().unwrap();
            let (_, conns) = idle.iter_mut().find(|(a, _)| *a == addr).unwrap();
            sweep(conns, Instant::now() + later);
        };
        sweep_at(Duration::ZERO);
        assert_eq!(idle_now(), 40, "nothing expired yet");
        sweep_at(BURST_IDLE_TIMEOUT + Duration::from_secs(1));
        assert_eq!(idle_now(), WARM_PER_BACKEND, "all but the warm ones closed");
        let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
        resp.into_body().collect().await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 40, "a warm one was reused");
        sweep_at(IDLE_TIMEOUT + Duration::from_secs(1));
        assert_eq!(idle_now(), 0, "the warm ones close after IDLE_TIMEOUT");
    }

    #[tokio::test]
    async fn a_body_not_read_to_its_end_does_not_give_its_connection_back() {
        let (addr, accepted) = backend().await;
        let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
        drop(resp);
        let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_the_backend_closed_is_replaced() {
        // One response per connection, then the backend closes it without saying so.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = tcp.read(&mut buf).await;
                let _ = tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
            }
        });
        for _ in 0..3 {
            let resp = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap();
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
            // Until the backend's close reached the idle connection.
            let seen = async {
                let open =
                    |(a, conns): &(String, Vec<Idle>)| *a == addr && conns.iter().any(|c| c.conn.is_open());
                while idle().lock().unwrap().iter().any(open) {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(5), seen).await.unwrap();
        }
    }

    /// A backend whose first connection answers one request, then closes
    /// on the next one without answering (its keep-alive timeout met the
    /// request on the way); later connections answer everything. Returns
    /// its address and how many requests it read.
    async fn closes_the_first_connection_on_its_second_request() -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(AtomicUsize::new(0));
        let count = requests.clone();
        tokio::spawn(async move {
            for n in 0.. {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let count = count.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    for i in 0.. {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => count.fetch_add(1, Ordering::SeqCst),
                        };
                        if n == 0 && i == 1 {
                            return; // closed with the request read, nothing answered
                        }
                        let _ = tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                    }
                });
            }
        });
        (addr, requests)
    }

    /// Makes the idle connections of `addr` look idle for `age`.
    fn age_idle(addr: &str, age: Duration) {
        let mut idle = idle().lock().unwrap();
        for c in &mut idle.iter_mut().find(|(a, _)| a == addr).unwrap().1 {
            c.since = Instant::now().checked_sub(age).unwrap();
        }
    }

    /// A GET to `addr` answered `ok`, its connection back in the pool.
    async fn get_ok(addr: &str) {
        let resp = send(addr, CONNECT, request(http::Method::GET, addr)).await.unwrap();
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
    }

    #[tokio::test]
    async fn a_get_the_backend_closed_on_after_it_went_out_is_sent_again() {
        let (addr, requests) = closes_the_first_connection_on_its_second_request().await;
        get_ok(&addr).await;
        age_idle(&addr, REPLAY_AFTER_IDLE);
        get_ok(&addr).await;
        assert_eq!(requests.load(Ordering::SeqCst), 3, "the second GET was read twice: once unanswered");
    }

    #[tokio::test]
    async fn a_post_or_a_busy_connections_request_is_not_sent_twice() {
        // A POST (even without a body) may have been acted on: its error goes back.
        let (addr, requests) = closes_the_first_connection_on_its_second_request().await;
        get_ok(&addr).await;
        age_idle(&addr, REPLAY_AFTER_IDLE);
        let e = send(&addr, CONNECT, request(http::Method::POST, &addr)).await.unwrap_err();
        assert!(!e.is_connect(), "{e}");
        assert_eq!(requests.load(Ordering::SeqCst), 2);

        // A GET on a connection idle for less than a keep-alive timeout: not kept, not sent twice.
        let (addr, requests) = closes_the_first_connection_on_its_second_request().await;
        get_ok(&addr).await;
        send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap_err();
        assert_eq!(requests.load(Ordering::SeqCst), 2);

        // A PUT with an idempotency key is sent again.
        let (addr, requests) = closes_the_first_connection_on_its_second_request().await;
        get_ok(&addr).await;
        age_idle(&addr, REPLAY_AFTER_IDLE);
        let mut put = request(http::Method::PUT, &addr);
        put.headers_mut().insert("idempotency-key", "8e03978e".parse().unwrap());
        send(&addr, CONNECT, put).await.unwrap();
        assert_eq!(requests.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_unreachable_backend_is_a_connect_error() {
        // A port nobody listens on: bound, then closed.
        let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let e = send(&addr, CONNECT, request(http::Method::GET, &addr)).await.unwrap_err();
        assert!(e.is_connect(), "{e}");
        let chain = crate::http::error_chain(&e);
        assert!(chain.starts_with("tcp connect error: Connection refused"), "{chain}");
        assert_eq!(chain.matches("Connection refused").count(), 1, "said once: {chain}");
    }
}
