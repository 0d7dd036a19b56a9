//! culvert: publish services of a cluster with no public address through an
//! outbound tunnel to an edge you run yourself.
//!
//! One binary, several roles (see `ARCHITECTURE.md`): [`edge`] is the public
//! side, [`agent`] the side next to the services, [`operator`] the Kubernetes
//! controllers and in-cluster agent, [`tunnel`] the wire between edge and
//! agents, [`admin`] the command line of the control API.

pub mod admin;
pub mod agent;
pub mod api;
pub(crate) mod api_client;
pub(crate) mod constants;
pub mod crd;
pub mod edge;
/// Entry points of the fuzz targets in `fuzz/` (not an interface).
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod http;
pub mod memory;
pub mod operator;
pub mod probe;
pub mod runtime;
pub mod secret;
pub mod telemetry;
pub mod tls;
pub mod tunnel;

/// The error type carried by streamed bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The system's random number generator failed.
#[derive(Debug, thiserror::Error)]
#[error("the system random number generator failed")]
pub(crate) struct RandomError;

/// `N` bytes from the system's random source (the one place that fills them).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], RandomError> {
    let mut buf = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut buf).map_err(|_| RandomError)?;
    Ok(buf)
}

/// Cancels `token` on SIGINT or SIGTERM.
pub async fn shutdown_on_signal(token: tokio_util::sync::CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    token.cancel();
}
