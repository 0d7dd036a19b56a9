//! The public edge: public HTTPS (and the tunnel endpoint) on one port, the
//! HTTP redirect port, TCP reservation listeners, the control API and the
//! admin port, all state in the store (SQLite, or PostgreSQL shared by
//! several edges, whose changes reach every edge by the store's change feed).

mod accept;
pub mod acme;
pub(crate) mod agents;
pub(crate) mod api;
pub(crate) mod certfile;
mod config;
pub(crate) mod idle;
pub(crate) mod limits;
pub(crate) mod metrics;
pub(crate) mod ports;
pub(crate) mod public;
pub(crate) mod registry;
pub(crate) mod routes;
pub(crate) mod sni;
pub mod status;
mod stop;
pub(crate) mod store;
pub(crate) mod tcp;
pub(crate) mod udp;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::api::PortRange;
use crate::api::{Reservation, ReservationKind};
use crate::tls::{self, CertResolver, TlsError};
use api::{ApiContext, EdgeHooks};
pub use config::{AcmeArgs, AcmeChallenge, Dns01Kind, EdgeArgs, MigrateStoreArgs};
use metrics::Metrics;
use registry::Registry;
use routes::{RouteChange, RouteIndex};
use store::{Location, Store, StoreError};

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error(
        "no certificate: give --tls-cert and --tls-key, --acme with --acme-dns01 (the edge obtains its own), or --self-signed for a trial"
    )]
    NoCertificate,
    #[error("{0}: give only one way to the edge's own certificate")]
    TwoCertificates(&'static str),
    #[error(transparent)]
    Dns01(#[from] acme::dns01::Dns01Error),
    #[error("failed to create data dir {path}: {source}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to listen on {addr} ({what}): {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to handle SIGHUP: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl EdgeError {
    pub fn category(&self) -> &'static str {
        match self {
            EdgeError::NoCertificate => "no_certificate",
            EdgeError::TwoCertificates(_) => "two_certificates",
            EdgeError::Dns01(e) => e.category(),
            EdgeError::DataDir { .. } => "data_dir",
            EdgeError::Bind { .. } => "bind",
            EdgeError::Signal(_) => "signal",
            EdgeError::Tls(e) => e.category(),
            EdgeError::Store(_) => "store",
        }
    }
}

/// The running edge's shared state.
pub struct Edge {
    pub domain: String,
    /// Host name public TCP addresses are reported with.
    pub public_host: String,
    /// Port of the public HTTPS listener (as bound).
    pub https_port: u16,
    /// Port of the plain HTTP listener (as bound).
    pub http_port: u16,
    pub tcp_bind: IpAddr,
    pub max_agents_per_key: usize,
    /// Published HTTP hosts are also served on the plain HTTP port.
    pub plain_http: bool,
    pub store: Store,
    pub registry: Registry,
    pub metrics: Metrics,
    pub api: ApiContext,
    pub certs: Arc<CertResolver>,
    /// The `--tls-cert`/`--tls-key` files, reloaded when they change.
    pub cert_files: Option<certfile::CertFiles>,
    /// ACME for custom domains (`--acme`).
    pub acme: Option<Arc<acme::Acme>>,
    /// The status page: history, sessions, live views.
    pub monitor: status::Monitor,
    routes: RwLock<Routes>,
    /// Reloads are numbered; one reads the store, then applies what it read
    /// unless a later one already did (the applied number is kept here).
    reloads: AtomicU64,
    reloaded: AtomicU64,
    /// Tunnel keys this edge accepted, by the SHA-256 of their secret: when
    /// the store is unavailable, an agent that reconnects with one is still
    /// let in. Forgotten when a reload no longer finds the key live.
    pub(crate) known_grants: std::sync::Mutex<std::collections::HashMap<String, store::TunnelGrant>>,
    tcp: tcp::TcpListeners,
    /// UDP reservations' sockets and flows.
    pub udp: udp::UdpListeners,
    /// Cancelled when the edge stops accepting public connections (SIGTERM:
    /// the drain begins).
    pub shutdown: CancellationToken,
    /// Cancelled when the edge has stopped (after the drain).
    pub stopped: CancellationToken,
    /// Public connections (HTTP and TCP), waited for while draining, and the
    /// public listeners' accept loops (each holds a token until it has handed
    /// over its backlog: a drain that begins before they ran waits for them).
    pub connections: TaskTracker,
    /// File descriptors per class of connection.
    pub fds: limits::FdBudget,
    /// Idle bound of a TCP reservation's connection.
    pub tcp_idle_timeout: Duration,
    /// Bound of a half-closed spliced connection's silence.
    pub half_close_timeout: Duration,
    /// Refused tunnel handshakes per source address, and their log.
    pub refusals: agents::Refusals,
    /// `Upgrade` protocols passed through (lower case; `--allow-upgrade`).
    pub upgrades: Vec<String>,
}

impl Edge {
    pub fn routes(&self) -> Arc<RouteIndex> {
        self.routes.read().expect("poisoned").index.clone()
    }

    /// Serves a new version of the certificate files, if they changed (or
    /// always, with `force`: SIGHUP). `None` without certificate files.
    pub fn reload_certificate(&self, force: bool) -> Option<certfile::Reload> {
        let files = self.cert_files.as_ref()?;
        Some(files.check(force, |key| self.certs.set_default(key)))
    }

    /// The public URL of a reservation.
    pub fn public_url(&self, r: &Reservation) -> String {
        r.public_url(self.https_port, &self.public_host)
    }

    /// Reloads routes and TCP listeners from the store and closes
    /// connections of revoked keys and released reservations. The reads run
    /// on the blocking pool. Changes the control API made while the read
    /// ran are applied again on top of what it read.
    pub async fn reload(self: &Arc<Self>) {
        let ticket = self.reloads.fetch_add(1, Ordering::AcqRel) + 1;
        let since = self.routes.read().expect("poisoned").seq;
        let read = self.store.run(|s| Ok((s.reservations()?, s.live_tunnel_key_ids()))).await;
        self.apply(ticket, since, read);
        status::recheck_sessions(self).await;
    }

    #[allow(clippy::type_complexity)]
    fn apply(
        self: &Arc<Self>,
        ticket: u64,
        since: u64,
        read: Result<(Vec<Reservation>, Result<std::collections::HashSet<String>, StoreError>), StoreError>,
    ) {
        let (reservations, live) = match read {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "failed to load reservations; keeping the current routes");
                return;
            }
        };
        let mut index = RouteIndex::build(reservations);
        let (index, old) = {
            let mut routes = self.routes.write().expect("poisoned");
            if self.reloaded.load(Ordering::Acquire) > ticket {
                return; // a later read is already applied
            }
            if routes.seq > since && routes.log.front().is_none_or(|(seq, _)| *seq > since + 1) {
                // More changes than the log keeps ran during the read: read again.
                drop(routes);
                warn!("routes changed too often during a reload; reloading again");
                let edge = self.clone();
                tokio::spawn(async move { edge.reload().await });
                return;
            }
            for (_, change) in routes.log.iter().filter(|(seq, _)| *seq > since) {
                index.apply(change);
            }
            let index = Arc::new(index);
            self.reloaded.store(ticket, Ordering::Release);
            (index.clone(), std::mem::replace(&mut routes.index, index))
        };
        // Released reservations: their metrics go with them.
        let now: std::collections::HashSet<String> = index.metric_names().collect();
        for name in old.metric_names().filter(|n| !now.contains(n)) {
            self.metrics.forget(&name);
        }
        self.tcp.reconcile(self, index.ports().collect());
        self.udp.reconcile(self, index.udp_ports().collect());
        match live {
            Ok(live) => {
                self.known_grants
                    .lock()
                    .expect("poisoned")
                    .retain(|_, g| live.contains(&g.key_id) && index.contains_id(&g.reservation.id));
                self.registry.close_invalid(&live, |id| index.contains_id(id))
            }
            Err(e) => error!(error = %e, "failed to list tunnel keys"),
        }
        if let Some(acme) = &self.acme {
            acme.wake();
        }
    }

    /// Applies what one control API call changed, without reading the
    /// store: one route entry, its TCP or UDP listener, the connections of what was
    /// revoked. (The change is stored already; a reload finds it too.)
    pub(crate) fn change(self: &Arc<Self>, change: api::Change) {
        let wake_acme = match &change {
            api::Change::Reserved(r) => r.kind == ReservationKind::Custom,
            api::Change::Released { reservation, .. } => reservation.kind == ReservationKind::Custom,
            api::Change::KeyRevoked(_) => false,
        };
        match change {
            api::Change::Reserved(r) => self.change_route(RouteChange::Insert(r)),
            api::Change::Released { reservation, revoked_keys } => {
                let id = reservation.id.clone();
                if let Some(name) = routes::metric_name(&reservation) {
                    self.metrics.forget(&name);
                }
                self.change_route(RouteChange::Remove(reservation));
                self.known_grants
                    .lock()
                    .expect("poisoned")
                    .retain(|_, g| g.reservation.id != id && !revoked_keys.contains(&g.key_id));
                self.registry.close_where(|c| c.reservation_id == id || revoked_keys.contains(&c.key_id));
            }
            api::Change::KeyRevoked(key) => {
                self.known_grants.lock().expect("poisoned").retain(|_, g| g.key_id != key);
                self.registry.close_where(|c| c.key_id == key);
            }
        }
        if wake_acme && let Some(acme) = &self.acme {
            acme.wake();
        }
    }

    fn change_route(self: &Arc<Self>, change: RouteChange) {
        let (port, protocol) = match &change {
            RouteChange::Insert(r) | RouteChange::Remove(r) => (r.port, r.protocol),
        };
        let index = {
            let mut routes = self.routes.write().expect("poisoned");
            routes.seq += 1;
            let seq = routes.seq;
            Arc::make_mut(&mut routes.index).apply(&change);
            routes.log.push_back((seq, change));
            if routes.log.len() > ROUTE_LOG {
                routes.log.pop_front();
            }
            routes.index.clone()
        };
        match (port, protocol) {
            (Some(_), crate::api::PortProtocol::Udp) => self.udp.reconcile(self, index.udp_ports().collect()),
            (Some(_), crate::api::PortProtocol::Tcp) => self.tcp.reconcile(self, index.ports().collect()),
            (None, _) => {}
        }
    }
}

/// Changes kept for the reloads in flight (a reload whose read began more
/// changes ago reads again).
const ROUTE_LOG: usize = 1024;

/// The route index, and the latest changes made to it one at a time.
#[derive(Default)]
struct Routes {
    index: Arc<RouteIndex>,
    /// Number of the last change.
    seq: u64,
    log: std::collections::VecDeque<(u64, RouteChange)>,
}

/// The API's view of the edge (a weak reference: the edge owns the API context).
struct Hooks(Weak<Edge>);

impl EdgeHooks for Hooks {
    fn state_changed(&self) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(edge) = self.0.upgrade() {
                edge.reload().await;
            }
        })
    }

    fn changed(&self, change: api::Change) -> futures_util::future::BoxFuture<'_, ()> {
        if let Some(edge) = self.0.upgrade() {
            edge.change(change);
        }
        Box::pin(std::future::ready(()))
    }

    fn connections_for_key(&self, key_id: &str) -> usize {
        self.0.upgrade().map_or(0, |e| e.registry.count_for_key(key_id))
    }

    fn status(&self, limit: usize) -> futures_util::future::BoxFuture<'_, Option<status::model::Status>> {
        let edge = self.0.upgrade();
        Box::pin(async move {
            let edge = edge?;
            // The snapshot reads the store (certificates, its health): on the blocking pool.
            tokio::task::spawn_blocking(move || status::snapshot(&edge, limit)).await.ok()
        })
    }

    fn port_usable(&self, port: u16, protocol: crate::api::PortProtocol) -> bool {
        self.0.upgrade().is_none_or(|e| match protocol {
            crate::api::PortProtocol::Tcp => tcp::can_listen(SocketAddr::new(e.tcp_bind, port)),
            crate::api::PortProtocol::Udp => udp::can_listen(SocketAddr::new(e.tcp_bind, port)),
        })
    }
}

/// A started edge: where it listens and how to stop it.
pub struct EdgeHandle {
    pub edge: Arc<Edge>,
    pub https_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The admin key, when this start created it (also in `admin.key`).
    pub new_admin_key: Option<String>,
    pub admin_key_file: PathBuf,
    /// The CA to trust, with --self-signed.
    pub ca_file: Option<PathBuf>,
    pub tasks: tokio::task::JoinSet<()>,
}

impl EdgeHandle {
    /// Stops at once: stops accepting, closes tunnels and waits for the
    /// listeners to end.
    pub async fn stop(self) {
        self.drain(Duration::ZERO).await;
    }

    /// Stops gracefully: refuses new public connections, lets open ones
    /// finish their requests for up to `grace`, then closes the tunnels
    /// (which ends what is still open) and waits for the listeners to end.
    pub async fn drain(mut self, grace: Duration) {
        let edge = &self.edge;
        edge.shutdown.cancel();
        edge.connections.close();
        if !grace.is_zero() && !edge.connections.is_empty() {
            info!(connections = edge.connections.len(), grace = ?grace, "draining public connections");
            if tokio::time::timeout(grace, edge.connections.wait()).await.is_err() {
                warn!(connections = edge.connections.len(), "drain time is up; closing what is still open");
            }
        }
        edge.stopped.cancel();
        edge.registry.close_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, EdgeError> {
    accept::listen(addr).map_err(|source| EdgeError::Bind { what, addr, source })
}

/// Starts every listener and returns once they are bound.
pub async fn start(args: EdgeArgs) -> Result<EdgeHandle, EdgeError> {
    let domain = args.domain.trim().trim_end_matches('.').to_ascii_lowercase();
    // The certificate first: a missing or bad one is reported before anything is created.
    let metrics = Metrics::default();
    let dns01 = args.acme.enabled && args.acme.dns01.is_some();
    let acme_config = match args.acme.enabled {
        true => {
            Some(acme::AcmeConfig::new(&args.acme, &domain, args.public_host.as_deref().unwrap_or(&domain))?)
        }
        false => None,
    };
    let given = match (&args.tls_cert, &args.tls_key, args.self_signed) {
        (Some(_), _, _) if dns01 => return Err(EdgeError::TwoCertificates("--tls-cert and --acme-dns01")),
        (_, _, true) if dns01 => return Err(EdgeError::TwoCertificates("--self-signed and --acme-dns01")),
        (Some(c), Some(k), _) => Given::Files(Box::new(certfile::CertFiles::load(
            c.clone(),
            k.clone(),
            metrics.tls_reloads.clone(),
        )?)),
        (_, _, true) => Given::SelfSigned,
        _ if dns01 => Given::Acme,
        _ => return Err(EdgeError::NoCertificate),
    };
    let nofile = limits::raise_nofile();
    let fds = limits::FdBudget::new(nofile, args.max_public_connections, args.max_connections_per_tcp_port);
    info!(open_files = nofile, budget = %fds.describe(), "file descriptors per class of connection");
    create_private_dir(&args.data_dir)?;
    let location = Location::parse(args.store.as_deref(), &args.data_dir)?;
    let store = tokio::task::spawn_blocking(move || Store::open_location(&location))
        .await
        .map_err(|e| StoreError::Unavailable(format!("opening the store failed: {e}")))??;
    let admin_key_file = args.data_dir.join("admin.key");
    let new_admin_key = store.run(|s| s.ensure_admin_key()).await?;
    if let Some(key) = &new_admin_key {
        tls::write_file(&admin_key_file, format!("{key}\n").as_bytes(), 0o600)?;
        info!(file = %admin_key_file.display(), "created the admin key (shown once; keep the file safe)");
    }

    let (certified, ca_file, cert_files) = match given {
        Given::Files(given) => {
            let (files, certified) = *given;
            (certified, None, Some(files))
        }
        // Until the first certificate is issued (a stored one replaces it in Acme::new).
        Given::Acme => {
            let pki = tls::generate_pki(&[domain.clone(), format!("*.{domain}")])?;
            (tls::certified_key_from_pem(&pki.cert_pem, &pki.key_pem)?, None, None)
        }
        Given::SelfSigned => {
            let files = tls::self_signed(&args.data_dir, &domain)?;
            info!(ca = %files.ca_cert.display(), "serving a self-signed certificate; agents need --ca-file with this CA");
            let certified =
                tls::certified_key(tls::load_pem_certs(&files.cert)?, tls::load_pem_key(&files.key)?)?;
            (certified, Some(files.ca_cert), None)
        }
    };
    let certs = Arc::new(CertResolver::new(certified));
    let tls_config = tls::server_config(certs.clone())?;

    let https = bind("https", args.https_addr).await?;
    let http = bind("http", args.http_addr).await?;
    let admin = bind("admin", args.admin_addr).await?;
    let local = |l: &TcpListener| l.local_addr().expect("bound socket has an address");
    let (https_addr, http_addr, admin_addr) = (local(&https), local(&http), local(&admin));

    let public_host = args.public_host.clone().unwrap_or_else(|| domain.clone());
    let shutdown = CancellationToken::new();
    let acme = match acme_config {
        Some(config) => Some(
            acme::Acme::new(
                config,
                store.clone(),
                certs.clone(),
                metrics.acme_orders.clone(),
                shutdown.clone(),
            )
            .await?,
        ),
        None => None,
    };
    let edge = Arc::new_cyclic(|weak: &Weak<Edge>| Edge {
        api: ApiContext {
            store: store.clone(),
            domain: domain.clone(),
            public_host: public_host.clone(),
            public_https_port: https_addr.port(),
            tcp_ports: args.tcp_ports,
            acme: args.acme.enabled,
            hooks: Arc::new(Hooks(weak.clone())),
            reserved_names: args
                .reserved_names
                .iter()
                .map(|n| n.trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|n| !n.is_empty())
                .collect(),
            serial: Default::default(),
        },
        domain,
        public_host,
        https_port: https_addr.port(),
        http_port: http_addr.port(),
        tcp_bind: args.tcp_bind,
        max_agents_per_key: args.max_agents_per_key.max(1),
        plain_http: args.plain_http,
        store,
        registry: Registry::new(metrics.streams_open.clone()).with_stream_limit(args.max_tunnel_streams),
        metrics,
        certs,
        cert_files,
        acme: acme.clone(),
        monitor: status::Monitor::new(
            [("https", https_addr), ("http", http_addr), ("admin", admin_addr)]
                .map(|(name, a)| status::model::Listener { name: name.into(), address: a.to_string() })
                .into(),
            args.public_status,
        ),
        routes: RwLock::default(),
        reloads: AtomicU64::new(0),
        reloaded: AtomicU64::new(0),
        known_grants: Default::default(),
        tcp: tcp::TcpListeners::default(),
        udp: udp::UdpListeners::new(
            Duration::from_secs(args.udp_idle_timeout_seconds),
            usize::try_from(args.max_udp_flows_per_port).unwrap_or(usize::MAX),
            usize::try_from(args.max_udp_flows).unwrap_or(usize::MAX),
        ),
        shutdown,
        stopped: CancellationToken::new(),
        connections: TaskTracker::new(),
        fds,
        tcp_idle_timeout: Duration::from_secs(args.tcp_idle_timeout_seconds),
        half_close_timeout: Duration::from_secs(args.half_close_timeout_seconds),
        refusals: Default::default(),
        upgrades: args
            .allow_upgrade
            .iter()
            .map(|u| u.trim().to_ascii_lowercase())
            .filter(|u| !u.is_empty())
            .collect(),
    });
    edge.reload().await;
    status::refresh_store(&edge).await;

    let mut tasks = tokio::task::JoinSet::new();
    if edge.store.kind() != "sqlite" {
        // Other edges change the store too: follow them.
        let changed = Arc::new(tokio::sync::Notify::new());
        let notify = changed.clone();
        edge.store.watch(Arc::new(move || notify.notify_one()), edge.stopped.clone());
        tasks.spawn(follow_store(edge.clone(), changed));
    }
    tasks.spawn(public::serve_https(edge.clone(), https, tls_config));
    tasks.spawn(public::serve_redirect(edge.clone(), http));
    tasks.spawn(public::serve_admin(edge.clone(), admin));
    tasks.spawn(status::sample(edge.clone()));
    if let Some(acme) = acme {
        tasks.spawn(acme.run());
    }
    if edge.cert_files.is_some() && args.tls_watch_seconds > 0 {
        tasks.spawn(watch_certificate(edge.clone(), Duration::from_secs(args.tls_watch_seconds)));
    }
    Ok(EdgeHandle { edge, https_addr, http_addr, admin_addr, new_admin_key, admin_key_file, ca_file, tasks })
}

/// Where the edge's own certificate comes from.
enum Given {
    Files(Box<(certfile::CertFiles, Arc<rustls::sign::CertifiedKey>)>),
    SelfSigned,
    /// ACME DNS-01 (`--acme-dns01`).
    Acme,
}

/// Reloads on every change the store's feed reports, and every
/// [`STORE_RESYNC_INTERVAL`](crate::constants::STORE_RESYNC_INTERVAL) in
/// case a notification was lost, until the edge stops.
async fn follow_store(edge: Arc<Edge>, changed: Arc<tokio::sync::Notify>) {
    let mut tick = tokio::time::interval(crate::constants::STORE_RESYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = changed.notified() => {}
            _ = tick.tick() => {}
            _ = edge.stopped.cancelled() => return,
        }
        edge.reload().await;
    }
}

/// Polls the certificate files until the edge stops.
async fn watch_certificate(edge: Arc<Edge>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = edge.stopped.cancelled() => return,
        }
        edge.reload_certificate(false);
    }
}

/// Creates the data dir with mode 0700, or tightens an existing one to 0700
/// (it holds the admin key and the store).
fn create_private_dir(path: &std::path::Path) -> Result<(), EdgeError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let err = |source| EdgeError::DataDir { path: path.into(), source };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(err)?;
    let mode = std::fs::metadata(path).map_err(err)?.permissions().mode() & 0o777;
    if mode != 0o700 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(err)?;
        warn!(dir = %path.display(), was = format!("{mode:o}"), "tightened the data dir to mode 700");
    }
    Ok(())
}

/// `culvert migrate-store`: copies the SQLite store of `--from` into
/// the empty PostgreSQL database of `--to`, in one transaction.
pub async fn migrate_store(args: MigrateStoreArgs) -> Result<(), EdgeError> {
    let file = args.from.join(store::DB_FILE);
    if !file.is_file() {
        return Err(EdgeError::Store(StoreError::BadLocation(format!(
            "--from {}: there is no {} in it; give the SQLite edge's --data-dir",
            args.from.display(),
            store::DB_FILE
        ))));
    }
    let to = match Location::parse(Some(&args.to), &args.from)? {
        Location::Postgres(url) => url,
        Location::Sqlite(_) => {
            return Err(EdgeError::Store(StoreError::BadLocation(
                "--to must be a postgres:// URL (the store the edges will share)".into(),
            )));
        }
    };
    let summary = tokio::task::spawn_blocking(move || -> Result<String, StoreError> {
        let snapshot = store::Engine::export(&store::Sqlite::open(&args.from)?)?;
        let target = store::pg::Postgres::open(&to)?;
        store::Engine::import(&target, &snapshot)?;
        Ok(format!(
            "copied {} API keys, {} reservations, {} tunnel keys, {} ACME accounts and {} certificates to {}",
            snapshot.api_keys.len(),
            snapshot.reservations.len(),
            snapshot.tunnel_keys.len(),
            snapshot.acme_accounts.len(),
            snapshot.certificates.len(),
            store::pg::redact(&to)
        ))
    })
    .await
    .map_err(|e| StoreError::Unavailable(format!("the migration stopped: {e}")))??;
    info!("{summary}");
    println!("{summary}; start the edges with --store (CULVERT_STORE) set to it");
    Ok(())
}

/// `culvert edge`: runs until SIGINT/SIGTERM; SIGHUP reloads the certificate files.
pub async fn run(args: EdgeArgs) -> Result<(), EdgeError> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tcp_ports, drain_seconds): (PortRange, u64) = (args.tcp_ports, args.drain_seconds);
    // Before anything else: from here on SIGHUP never ends the process.
    let mut hangup = signal(SignalKind::hangup()).map_err(EdgeError::Signal)?;
    let handle = start(args).await?;
    let edge = handle.edge.clone();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            // Logged by the reload.
            let files = edge.reload_certificate(true).is_some();
            let mut own = false;
            if let Some(acme) = &edge.acme {
                // A failed DNS-01 order of the edge's own certificate is tried again now.
                own = acme.retry_own_now().await;
                acme.wake();
            }
            if !files && !own {
                info!("SIGHUP: no certificate files to reload and no failed order to retry");
            }
        }
    });
    info!(
        https = %handle.https_addr, http = %handle.http_addr, admin = %handle.admin_addr,
        domain = %handle.edge.domain, tcp_ports = %tcp_ports, "edge ready"
    );
    // One machine-readable line on stdout: the readiness signal for scripts.
    println!(
        "culvert edge ready https={} http={} admin={} admin_key_file={}{}",
        handle.https_addr,
        handle.http_addr,
        handle.admin_addr,
        handle.admin_key_file.display(),
        handle.ca_file.as_ref().map(|c| format!(" ca_file={}", c.display())).unwrap_or_default()
    );
    let signal = CancellationToken::new();
    crate::shutdown_on_signal(signal.clone()).await;
    warn!(drain_seconds, "shutting down: new connections are refused, open ones may finish");
    // A second SIGINT/SIGTERM ends the drain at once.
    let again = CancellationToken::new();
    tokio::select! {
        _ = handle.drain(Duration::from_secs(drain_seconds)) => {}
        _ = crate::shutdown_on_signal(again) => warn!("second signal: stopping now"),
    }
    Ok(())
}
