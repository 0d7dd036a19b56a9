//! The agent: keeps a tunnel connection to the edge open and serves the
//! streams the edge opens on it by dialing backends.
//!
//! [`run_tunnel`] is the reconnect loop shared by the standalone agent
//! (`culvert http|tcp`) and the operator (`operator::agents`); `serve`
//! answers streams.

pub(crate) mod backend;
mod config;
pub(crate) mod dispatch;
pub mod edges;
pub(crate) mod filters;
pub(crate) mod forward;
pub(crate) mod guard;
pub(crate) mod h1;
pub mod metrics;
pub(crate) mod pipe;
mod pool;
pub(crate) mod serve;

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::api::Protocol;
use crate::constants::{DRAIN_GRACE, DRAIN_TIMEOUT, GOODBYE_ACK_TIMEOUT, MSG_GOODBYE, PROBE_INTERVAL};
use crate::tls;
use crate::tunnel::backoff::Pace;
use crate::tunnel::connect::{ConnectError, Connected, Dialer, TunnelInfo};
pub use config::AgentArgs;
pub use edges::{EdgeSet, run_edges};
pub use pipe::ProxyHeader;
pub use serve::{Resolver, Target, fixed};

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("bad target `{target}`: {why}")]
    BadTarget { target: String, why: String },
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    KeyFile(#[from] crate::secret::SecretError),
    #[error("no tunnel key given: pass --key-file FILE or set CULVERT_KEY")]
    NoKey,
    #[error("cannot listen on --metrics-addr {addr}: {source}")]
    MetricsAddr { addr: std::net::SocketAddr, source: std::io::Error },
}

impl AgentError {
    pub fn category(&self) -> &'static str {
        match self {
            AgentError::BadTarget { .. } => "bad_target",
            AgentError::Tls(e) => e.category(),
            AgentError::Connect(e) => e.category(),
            AgentError::KeyFile(e) => e.category(),
            AgentError::NoKey => "usage",
            AgentError::MetricsAddr { .. } => "bind",
        }
    }
}

/// Called when a connection is ready (the edge routes to it) with what the edge said.
pub type OnReady = Arc<dyn Fn(&TunnelInfo) + Send + Sync>;

/// Options of one tunnel's reconnect loop.
#[derive(Clone, Default)]
pub struct TunnelOptions {
    /// Give up on refusals retrying cannot fix (standalone agent), or keep
    /// retrying (operator: the key may be re-created).
    pub stop_on_permanent_error: bool,
    pub on_ready: Option<OnReady>,
    /// Called when a connection that was ready ends.
    pub on_lost: Option<OnReady>,
}

/// Keeps one tunnel connection up until `shutdown`; then drains it (goodbye,
/// no new streams, open streams finish within [`DRAIN_TIMEOUT`]). Retries at
/// the pace of [`Pace`]: fast probes while the edge does not answer, the
/// backoff when it refuses. Runs in the span of the edge it dials
/// ([`edges`] makes it).
pub async fn run_tunnel(
    dialer: Dialer,
    resolver: Resolver,
    options: TunnelOptions,
    shutdown: CancellationToken,
) -> Result<(), ConnectError> {
    let mut pace = Pace::default();
    let edge = dialer.edge.to_string();
    // While the edge does not answer: a warning now and then, not one per probe.
    let mut warned_at: Option<Instant> = None;
    loop {
        let connected = tokio::select! {
            r = dialer.connect() => r,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let delay = match connected {
            Ok(c) => {
                let started = Instant::now();
                warned_at = None;
                // In the caller's `edge` span: a second span naming the same
                // edge was entered and left on every poll of the connection,
                // a few hundred instructions each time.
                let reason = serve_connection(c, resolver.clone(), &options, &shutdown).await;
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                let delay = pace.lost(started.elapsed());
                warn!(%edge, reason = %reason, retry_in = ?delay, "tunnel connection lost; reconnecting");
                delay
            }
            Err(e) if e.is_permanent() && options.stop_on_permanent_error => return Err(e),
            Err(e) => {
                let retry = pace.failed(&e);
                if !retry.probe {
                    warned_at = None;
                    warn!(%edge, error = %e, category = e.category(), retry_in = ?retry.delay, "cannot open tunnel; retrying");
                } else if retry.first || warned_at.is_none_or(|t| t.elapsed() >= UNREACHABLE_WARN_EVERY) {
                    warned_at = Some(Instant::now());
                    warn!(%edge, error = %e, category = e.category(), probe_every = ?PROBE_INTERVAL,
                        "the edge does not answer; probing until it does");
                } else {
                    debug!(%edge, error = %e, retry_in = ?retry.delay, "the edge still does not answer");
                }
                retry.delay
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
    }
}

/// How often "the edge does not answer" is logged while probing.
const UNREACHABLE_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves one connection until it ends or `shutdown`; returns why it ended.
async fn serve_connection(
    c: Connected,
    resolver: Resolver,
    options: &TunnelOptions,
    shutdown: &CancellationToken,
) -> String {
    let Connected { stream, control, info, wire } = c;
    // Calls `on_lost` on every way out, once the connection was ready.
    let lost = LostGuard { info: info.clone(), on_lost: options.on_lost.clone(), ready: Default::default() };
    let service = |req| serve::answer(&resolver, req);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let conn = crate::tunnel::server::serve_wire(stream, wire, service, async {
        let _ = stopped.await;
    });
    tokio::pin!(conn);

    let ready = async {
        control.ready().await;
        info!(edge = %info.edge, cipher = info.cipher, "tunnel connection ready");
        lost.ready.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(f) = &options.on_ready {
            f(&info);
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        r = &mut conn => return describe_end(r),
        _ = ready => unreachable!(),
        _ = shutdown.cancelled() => {}
    }

    // Drain: say goodbye, wait for the edge to stop routing here (its ack),
    // give streams it opened just before a moment to arrive, then GOAWAY and
    // let open streams finish.
    info!("draining tunnel connection");
    let drain = async {
        control.send(MSG_GOODBYE);
        let _ = tokio::time::timeout(GOODBYE_ACK_TIMEOUT, control.acked()).await;
        tokio::time::sleep(DRAIN_GRACE).await;
    };
    tokio::select! {
        r = &mut conn => return describe_end(r),
        _ = drain => {}
    }
    let _ = stop.send(());
    match tokio::time::timeout(DRAIN_TIMEOUT, conn).await {
        Ok(r) => describe_end(r),
        Err(_) => format!("drain timed out after {DRAIN_TIMEOUT:?}; open streams were cut"),
    }
}

struct LostGuard {
    info: TunnelInfo,
    on_lost: Option<OnReady>,
    ready: std::sync::atomic::AtomicBool,
}

impl Drop for LostGuard {
    fn drop(&mut self) {
        if let (Some(f), true) = (&self.on_lost, *self.ready.get_mut()) {
            f(&self.info);
        }
    }
}

fn describe_end(r: Result<(), crate::tunnel::stream::StreamError>) -> String {
    match r {
        Ok(()) => "closed by the edge".into(),
        Err(e) => crate::http::error_chain(&e),
    }
}

/// A random id for this agent process (logs and metrics at the edge).
pub fn agent_id() -> String {
    // Only tells agents apart in logs: zeros if the source fails.
    let b: [u8; 6] = crate::random_bytes().unwrap_or_default();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `culvert http|tcp|udp`: publish one local port (`protocol` is `Http`,
/// `Tcp` or `Udp`) until SIGINT/SIGTERM.
pub async fn run_standalone(args: AgentArgs, protocol: Protocol) -> Result<(), AgentError> {
    let proxy = args.proxy_protocol;
    let target = match (protocol, proxy) {
        (Protocol::Udp, Some(ProxyHeader::V1)) => {
            Err("PROXY protocol v1 has no UDP form: use --proxy-protocol v2".to_string())
        }
        (Protocol::Http, Some(_)) => Err("--proxy-protocol applies to tcp and udp".to_string()),
        (Protocol::Tcp, _) => Target::parse_tcp(&args.target).map(|t| match t {
            Target::Tcp { addr, .. } => Target::Tcp { addr, proxy },
            t => t,
        }),
        (Protocol::Udp, _) => Target::parse_udp(&args.target).map(|t| match t {
            Target::Udp { addr, .. } => Target::Udp { addr, proxy },
            t => t,
        }),
        (Protocol::Http, None) => Target::parse_http(&args.target),
        (Protocol::Tls, _) => Err("the standalone agent publishes http, tcp or udp".to_string()),
    }
    .map_err(|why| AgentError::BadTarget { target: args.target.clone(), why })?;
    let edges = EdgeSet::parse(&args.edge)?;
    let dialer = Dialer {
        edge: edges.first().clone(),
        key: crate::secret::key_from(args.key.as_deref(), args.key_file.as_deref(), "--key-file")?
            .ok_or(AgentError::NoKey)?,
        agent_id: agent_id(),
        tls: tls::tunnel_client_config(args.ca_file.as_deref(), args.tunnel_cipher)?,
        protocol: Some(protocol),
        version: args.protocol_version,
    };
    let shutdown = CancellationToken::new();
    if let Some(addr) = args.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| AgentError::MetricsAddr { addr, source })?;
        tokio::spawn(metrics::serve(listener, shutdown.clone()));
    }
    tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));
    let shown = target.to_string();
    let on_ready: OnReady = Arc::new(move |info: &TunnelInfo| {
        let url = info.public_url.as_deref().unwrap_or("(the edge did not say)");
        info!(public = url, backend = %shown, edge = %info.edge, "tunnel ready");
        // One line on stdout for people and scripts.
        println!("Forwarding {url} -> {shown}");
    });
    let options = TunnelOptions { stop_on_permanent_error: true, on_ready: Some(on_ready), on_lost: None };
    // On a worker thread, not in `block_on`: the connection's task then runs
    // where its streams' tasks and the I/O driver run, instead of waking the
    // main thread (a futex round trip) for every frame.
    let tunnel =
        tokio::spawn(async move { run_edges(dialer, &edges, serve::fixed(target), options, shutdown).await });
    tunnel.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))?;
    Ok(())
}
