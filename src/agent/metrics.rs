//! The agent's own metrics: the UDP replies it drops. One set per process,
//! shared by every tunnel it carries; the operator registers them in its
//! registry (`culvert_operator_udp_replies_dropped_total`), the standalone
//! agent serves them with `--metrics-addr`
//! (`culvert_agent_udp_replies_dropped_total`).

use std::sync::LazyLock;

use http::{Response, StatusCode};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::tunnel::body;

type Labels = Vec<(&'static str, String)>;

/// UDP replies of a backend dropped by this process, by reason:
/// `queue_full` (the flow's queue toward the edge, or every flow's, is
/// full: the tunnel does not keep up) and `oversize` (larger than a
/// datagram the tunnel carries).
static UDP_REPLIES_DROPPED: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);

/// One reply dropped.
pub fn udp_reply_dropped(reason: &'static str) {
    UDP_REPLIES_DROPPED.get_or_create(&vec![("reason", reason.to_string())]).inc();
}

/// Registers the agent's metrics in `registry` (each reason shown from 0).
pub fn register(registry: &mut Registry) {
    for reason in ["queue_full", "oversize"] {
        let _ = UDP_REPLIES_DROPPED.get_or_create(&vec![("reason", reason.to_string())]);
    }
    registry.register(
        "udp_replies_dropped",
        "UDP replies of backends the agent dropped, by reason: queue_full (the tunnel does not keep up), oversize",
        UDP_REPLIES_DROPPED.clone(),
    );
}

/// Serves `/metrics` (prefix `culvert_agent`) until `stop`.
pub async fn serve(listener: tokio::net::TcpListener, stop: CancellationToken) {
    let mut registry = Registry::with_prefix("culvert_agent");
    register(&mut registry);
    let registry = std::sync::Arc::new(registry);
    loop {
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
            _ = stop.cancelled() => return,
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let (status, text) = match req.uri().path() {
                    "/metrics" => {
                        let mut out = String::new();
                        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
                        (StatusCode::OK, out)
                    }
                    _ => (StatusCode::NOT_FOUND, "try /metrics\n".to_string()),
                };
                let mut r = Response::new(body::full(text));
                *r.status_mut() = status;
                std::future::ready(Ok::<_, std::convert::Infallible>(r))
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .http1_only()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}
