//! Certificates for custom domains by ACME (RFC 8555), off the request path.
//!
//! One background task ([`Acme::run`]) scans the reserved custom domains on
//! every change and on a timer, and starts a job for each name that is due:
//! never ordered, up for renewal (30 days before expiry, or a third of the
//! lifetime for short-lived certificates), or due again after a failure.
//! Jobs run under a semaphore (`--acme-max-concurrent-orders`). Each job
//! first checks that the name resolves to the edge, so a wrong CNAME is
//! reported (`dns_mismatch`) and checked again cheaply instead of being
//! retried into the CA's rate limits; then it orders the certificate,
//! answering the CA's TLS-ALPN-01 (on the HTTPS port, see
//! [`crate::tls::CertResolver`]) or HTTP-01 challenge (on the HTTP port, see
//! [`Acme::http01_response`]). Failures back off exponentially: from
//! seconds when the CA was not reached, from minutes when it judged the order.
//!
//! Several edges on one store: an order runs on one edge at a time (a
//! lease per name in the store), and the challenge answers it publishes go
//! to the store too, so whichever edge the CA's validation reaches (DNS
//! round robin, a load balancer) answers it: an edge that does not know a
//! token or a TLS-ALPN-01 name reads it from the store ([`Acme::remote`],
//! cached for a few seconds, a miss for one). The account is registered by
//! one edge (a lease) and reused by the others.
//!
//! The account (one per directory URL), the certificates and their state
//! live in the edge's store, so a restart serves the stored certificates at
//! once and orders nothing new. Issued certificates are served by SNI
//! without a restart. Releasing a custom domain deletes its certificate
//! (in the store's release transaction) and the next scan stops serving it.

pub(crate) mod dns;
pub mod dns01;
pub(crate) mod x509;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, BodyWrapper, BytesResponse, ChallengeType, HttpClient,
    Identifier, NewAccount, NewOrder, Order, OrderStatus, RetryPolicy,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use super::config::{AcmeArgs, AcmeChallenge, Dns01Kind};
use super::store::{
    CertificateRecord, Challenge, ChallengeKind, Store, StoreError, StoredCertificateStatus, unix_now,
};
use crate::api::ReservationKind;
use crate::constants::{
    ACME_DNS_RECHECK_INITIAL, ACME_DNS_RECHECK_MAX, ACME_DNS01_HOOK_TIMEOUT, ACME_ORDER_BACKOFF_INITIAL,
    ACME_ORDER_BACKOFF_MAX, ACME_ORDER_TIMEOUT, ACME_SCAN_INTERVAL, ACME_TRANSIENT_RETRY_INITIAL,
    API_CLIENT_TIMEOUT,
};
use crate::tls::{self, CertResolver, TlsError};
use dns01::{Dns01Error, Dns01Provider};

/// Path prefix of HTTP-01 challenge responses on the HTTP port.
pub const HTTP01_PREFIX: &str = "/.well-known/acme-challenge/";
/// A challenge answer read from the store is kept this long.
const REMOTE_HIT_TTL: Duration = Duration::from_secs(10);
/// A challenge the store does not hold is asked for again after this.
const REMOTE_MISS_TTL: Duration = Duration::from_secs(1);
/// Challenge answers (and misses) kept from the store, at most.
const REMOTE_CACHE_MAX: usize = 1024;
/// The account's registration lease (one edge registers; the others wait
/// for it this long at most).
const ACCOUNT_LEASE: Duration = Duration::from_secs(60);
/// How often an edge waiting for another's registration looks again.
const ACCOUNT_POLL: Duration = Duration::from_millis(200);
/// How long the store keeps a challenge answer when its order never
/// removes it (the edge died).
const CHALLENGE_TTL: Duration = Duration::from_secs(ACME_ORDER_TIMEOUT.as_secs() + 60);

/// Why a certificate job failed.
#[derive(Debug, thiserror::Error)]
pub enum AcmeError {
    /// The name does not resolve to the edge (or cannot be resolved).
    #[error("{0}")]
    DnsMismatch(String),
    #[error("failed to register or load the ACME account")]
    Account(#[source] instant_acme::Error),
    #[error("the ACME order failed")]
    Protocol(#[from] instant_acme::Error),
    #[error("the CA did not validate {host}: {detail}")]
    Invalid { host: String, detail: String },
    #[error("the CA offers no {challenge} challenge for {host}; try --acme-challenge {other}")]
    NoChallenge { host: String, challenge: &'static str, other: &'static str },
    #[error("the order did not finish within {}s", ACME_ORDER_TIMEOUT.as_secs())]
    Timeout,
    #[error("the CA issued an unusable certificate: {0}")]
    BadCertificate(String),
    #[error(transparent)]
    Dns01(#[from] Dns01Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl AcmeError {
    /// Static category for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            AcmeError::DnsMismatch(_) => "dns_mismatch",
            AcmeError::Account(_) => "account",
            AcmeError::Protocol(_) => "protocol",
            AcmeError::Invalid { .. } => "invalid",
            AcmeError::NoChallenge { .. } => "no_challenge",
            AcmeError::Timeout => "timeout",
            AcmeError::BadCertificate(_) => "bad_certificate",
            AcmeError::Dns01(e) => e.category(),
            AcmeError::Tls(_) => "tls",
            AcmeError::Store(_) => "store",
        }
    }

    /// Whether the CA (or the way to it) failed for a moment, before it
    /// judged the order: the ACME server could not be reached or did not
    /// answer in time, answered 5xx, or kept rejecting nonces (instant-acme
    /// already retried those). Such a failure costs no validation at the
    /// CA, so it is retried within seconds instead of after the backoff
    /// that keeps a name under the CA's failed-validation limit.
    pub fn transient(&self) -> bool {
        let (AcmeError::Account(e) | AcmeError::Protocol(e)) = self else { return false };
        match e {
            instant_acme::Error::Other(_) => true,
            instant_acme::Error::Api(problem) => {
                let kind =
                    problem.r#type.as_deref().and_then(|t| t.strip_prefix("urn:ietf:params:acme:error:"));
                matches!(kind, Some("badNonce" | "serverInternal"))
                    || problem.status.is_some_and(|s| (500..600).contains(&s))
            }
            _ => false,
        }
    }

    /// How long after its `failures`-th failure in a row a name is tried again.
    pub fn retry_in(&self, failures: u32) -> Duration {
        let (initial, max) = if matches!(self, AcmeError::DnsMismatch(_)) {
            (ACME_DNS_RECHECK_INITIAL, ACME_DNS_RECHECK_MAX)
        } else if self.transient() {
            (ACME_TRANSIENT_RETRY_INITIAL, ACME_ORDER_BACKOFF_INITIAL)
        } else {
            (ACME_ORDER_BACKOFF_INITIAL, ACME_ORDER_BACKOFF_MAX)
        };
        backoff(failures, initial, max)
    }
}

/// What the ACME task needs to know about the edge.
#[derive(Debug, Clone)]
pub struct AcmeConfig {
    pub directory: String,
    pub email: Option<String>,
    pub ca_file: Option<PathBuf>,
    pub challenge: AcmeChallenge,
    pub max_concurrent_orders: usize,
    pub resolver: dns::Resolver,
    /// Names (or IPs) whose addresses are the edge's: its domain and public host.
    pub edge_names: Vec<String>,
    /// The edge's own `<domain>` + `*.<domain>` certificate by DNS-01.
    pub own: Option<OwnCertificate>,
}

/// The edge's own wildcard certificate, ordered by DNS-01.
#[derive(Debug, Clone)]
pub struct OwnCertificate {
    pub domain: String,
    pub provider: Dns01Provider,
    /// Wait between setting the records and asking the CA to check them.
    pub propagation: Duration,
}

impl OwnCertificate {
    /// Its key in the store (never a custom domain: those have no `*`).
    pub fn record_key(&self) -> String {
        format!("*.{}", self.domain)
    }

    fn from_args(args: &AcmeArgs, domain: &str) -> Result<Option<OwnCertificate>, Dns01Error> {
        let config = |m: String| Dns01Error::Config(m);
        let Some(kind) = args.dns01 else { return Ok(None) };
        let provider = match kind {
            Dns01Kind::Rfc2136 => {
                let server = args.dns01_server.ok_or_else(|| {
                    config("--acme-dns01 rfc2136 needs --acme-dns01-server: the IP (and port) of the zone's primary DNS server".into())
                })?;
                let secret = crate::secret::key_from(
                    args.dns01_tsig_secret.as_deref(),
                    args.dns01_tsig_secret_file.as_deref(),
                    "--acme-dns01-tsig-secret-file",
                )
                .map_err(|e| config(e.to_string()))?;
                let key = match (&args.dns01_tsig_key, &secret) {
                    (Some(name), Some(secret)) => {
                        Some(dns01::TsigKey::new(name, args.dns01_tsig_algorithm, secret)?)
                    }
                    (None, None) => None,
                    _ => {
                        return Err(config(
                            "give both --acme-dns01-tsig-key and --acme-dns01-tsig-secret (or neither, for a server that accepts unsigned updates from this address)".into(),
                        ));
                    }
                };
                let zone = args
                    .dns01_zone
                    .as_deref()
                    .unwrap_or(domain)
                    .trim()
                    .trim_end_matches('.')
                    .to_ascii_lowercase();
                if !(domain == zone || domain.ends_with(&format!(".{zone}"))) {
                    return Err(config(format!(
                        "--acme-dns01-zone {zone} does not hold _acme-challenge.{domain}: give {domain} or the parent zone it is in"
                    )));
                }
                Dns01Provider::Rfc2136 { server, zone, key }
            }
            Dns01Kind::Hook => {
                let program = args.dns01_hook.clone().ok_or_else(|| {
                    config("--acme-dns01 hook needs --acme-dns01-hook /path/to/program (run as `program set|unset FQDN VALUE`)".into())
                })?;
                use std::os::unix::fs::PermissionsExt;
                match std::fs::metadata(&program) {
                    Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
                    Ok(_) => {
                        return Err(config(format!(
                            "--acme-dns01-hook {}: not an executable file (chmod +x it)",
                            program.display()
                        )));
                    }
                    Err(e) => return Err(config(format!("--acme-dns01-hook {}: {e}", program.display()))),
                }
                Dns01Provider::Hook { program }
            }
        };
        Ok(Some(OwnCertificate {
            domain: domain.to_string(),
            provider,
            propagation: Duration::from_secs(args.dns01_propagation_seconds),
        }))
    }

    /// The longest an order may take (the records' setting included).
    fn order_timeout(&self) -> Duration {
        let hook = match self.provider {
            Dns01Provider::Hook { .. } => ACME_DNS01_HOOK_TIMEOUT * 2,
            Dns01Provider::Rfc2136 { .. } => Duration::ZERO,
        };
        ACME_ORDER_TIMEOUT + self.propagation * 2 + hook
    }
}

impl AcmeConfig {
    pub fn new(args: &AcmeArgs, domain: &str, public_host: &str) -> Result<AcmeConfig, Dns01Error> {
        let mut edge_names = vec![domain.to_string()];
        if public_host != domain {
            edge_names.push(public_host.to_string());
        }
        Ok(AcmeConfig {
            own: OwnCertificate::from_args(args, domain)?,
            directory: args.directory.clone(),
            email: args.email.clone().filter(|e| !e.trim().is_empty()),
            ca_file: args.ca_file.clone(),
            challenge: args.challenge,
            max_concurrent_orders: args.max_concurrent_orders.max(1),
            resolver: args.dns_server.map_or(dns::Resolver::System, dns::Resolver::Server),
            edge_names,
        })
    }
}

type Labels = Vec<(&'static str, String)>;

/// The edge's ACME state: challenge responses, the account, the job set.
pub struct Acme {
    config: AcmeConfig,
    store: Store,
    certs: Arc<CertResolver>,
    /// HTTP-01: token to key authorization.
    http01: RwLock<HashMap<String, String>>,
    /// Challenge answers of other edges' orders, read from the store, with
    /// when they are to be read again (`None`: the store has none).
    remote: Mutex<RemoteCache>,
    account: tokio::sync::Mutex<Option<Account>>,
    orders: Semaphore,
    in_flight: Mutex<HashSet<String>>,
    /// Names whose certificate the resolver serves now, with its `not_after`
    /// (a newer one stored by another edge is loaded by the next scan).
    served: Mutex<HashMap<String, Option<u64>>>,
    /// Who this edge is in the store's leases (one order per name at a time
    /// across edges).
    holder: String,
    /// `not_after` of the edge's own certificate served now (DNS-01).
    own_served: Mutex<Option<u64>>,
    wake: Notify,
    results: Family<Labels, Counter>,
    shutdown: CancellationToken,
}

impl Acme {
    /// Loads the stored certificates into `certs` (served at once, nothing is
    /// ordered for them) and returns the ACME state; [`Acme::run`] starts the work.
    pub async fn new(
        config: AcmeConfig,
        store: Store,
        certs: Arc<CertResolver>,
        results: Family<Labels, Counter>,
        shutdown: CancellationToken,
    ) -> Result<Arc<Acme>, StoreError> {
        let acme = Arc::new(Acme {
            orders: Semaphore::new(config.max_concurrent_orders),
            config,
            store,
            certs,
            http01: RwLock::default(),
            remote: Mutex::default(),
            account: tokio::sync::Mutex::new(None),
            in_flight: Mutex::default(),
            served: Mutex::default(),
            own_served: Mutex::default(),
            holder: format!("edge-{}", std::process::id()) + &random_suffix(),
            wake: Notify::new(),
            results,
            shutdown,
        });
        let mut loaded = 0;
        let mut own_loaded = false;
        for record in acme.store.certificates().await? {
            match serving_key(&record) {
                Some(Ok(key)) => {
                    if acme.is_own(&record.hostname) {
                        own_loaded = true;
                        info!(
                            not_after = record.not_after.map(super::store::rfc3339).unwrap_or_default(),
                            "serving the edge's own certificate from the store"
                        );
                    }
                    acme.serve(&record.hostname, key, record.not_after);
                    loaded += 1;
                }
                Some(Err(e)) => {
                    warn!(host = %record.hostname, error = %e, "stored certificate unusable; ordering again")
                }
                None => {}
            }
        }
        if acme.config.own.is_some() && !own_loaded {
            info!(
                "the edge's own certificate is not issued yet: serving a temporary self-signed one until DNS-01 succeeds"
            );
        }
        // A restart (after fixing the DNS-01 settings, say) tries again at once.
        acme.retry_own_now().await;
        info!(certificates = loaded, dns01 = acme.config.own.is_some(), directory = %acme.config.directory, challenge = ?acme.config.challenge, "ACME enabled");
        Ok(acme)
    }

    /// The edge's own certificate, when its last order failed: due now
    /// instead of after the backoff (start, SIGHUP). Returns whether it was.
    pub async fn retry_own_now(&self) -> bool {
        let Some(own) = &self.config.own else { return false };
        let Ok(Some(mut record)) = self.store.certificate(&own.record_key()).await else { return false };
        if record.last_error.is_none() || record.next_attempt == 0 {
            return false;
        }
        record.next_attempt = 0;
        if let Err(e) = self.store.put_certificate(&record).await {
            warn!(error = %e, "failed to store the certificate state");
            return false;
        }
        info!("retrying the edge's own certificate now");
        self.wake();
        true
    }

    /// Whether `host` is the store key of the edge's own certificate.
    fn is_own(&self, host: &str) -> bool {
        self.config.own.as_ref().is_some_and(|o| o.record_key() == host)
    }

    /// Host names whose DNS check or order runs now, sorted.
    pub fn in_flight(&self) -> Vec<String> {
        let mut names: Vec<String> = self.in_flight.lock().expect("poisoned").iter().cloned().collect();
        names.sort();
        names
    }

    /// Something changed (a reservation was made or released): scan now.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// The HTTP-01 key authorization for a request path on the HTTP port:
    /// of an order of this edge, or else (`ask_store`: the request is for a
    /// reserved custom domain) of another edge's, from the store.
    pub async fn http01_response(&self, path: &str, ask_store: bool) -> Option<String> {
        let token = path.strip_prefix(HTTP01_PREFIX)?;
        if let Some(answer) = self.http01.read().expect("poisoned").get(token).cloned() {
            return Some(answer);
        }
        // Tokens are base64url (RFC 8555 8.1); anything else is never asked of the store.
        let plausible = ask_store
            && (16..=128).contains(&token.len())
            && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plausible {
            return None;
        }
        match self.remote(ChallengeKind::Http01, token).await? {
            RemoteAnswer::Http(answer) => Some(answer),
            RemoteAnswer::Alpn(_) => None,
        }
    }

    /// The TLS configuration that answers TLS-ALPN-01 validation of `host`
    /// for an order of another edge (from the store); `None` when this edge
    /// placed the order (its resolver answers) or nobody did.
    pub async fn tls_alpn01_config(&self, host: &str) -> Option<Arc<rustls::ServerConfig>> {
        if self.certs.has_acme_challenge(host) || host.len() > 253 {
            return None;
        }
        match self.remote(ChallengeKind::TlsAlpn01, &host.to_ascii_lowercase()).await? {
            RemoteAnswer::Alpn(key) => match tls::acme_challenge_config(key) {
                Ok(config) => Some(config),
                Err(e) => {
                    warn!(host = %host, error = %e, "cannot answer a TLS-ALPN-01 validation");
                    None
                }
            },
            RemoteAnswer::Http(_) => None,
        }
    }

    /// A challenge answer another edge stored: from the cache, or read
    /// from the store (a miss is cached for [`REMOTE_MISS_TTL`]).
    async fn remote(&self, kind: ChallengeKind, name: &str) -> Option<RemoteAnswer> {
        let key = (kind, name.to_string());
        let now = Instant::now();
        if let Some((until, answer)) = self.remote.lock().expect("poisoned").get(&key)
            && *until > now
        {
            return answer.clone();
        }
        let value = match self.store.challenge(kind, name).await {
            Ok(v) => v,
            Err(e) => {
                warn!(challenge = kind.as_str(), error = %e, "cannot read a challenge answer from the store");
                return None;
            }
        };
        let answer = match (kind, value) {
            (_, None) => None,
            (ChallengeKind::Http01, Some(v)) => Some(RemoteAnswer::Http(v)),
            (ChallengeKind::TlsAlpn01, Some(v)) => match from_hex(&v).map(|d| alpn_challenge_key(name, &d)) {
                Some(Ok(key)) => Some(RemoteAnswer::Alpn(key)),
                Some(Err(e)) => {
                    warn!(host = %name, error = %e, "cannot make the TLS-ALPN-01 answer");
                    None
                }
                None => {
                    warn!(host = %name, "the store holds an invalid TLS-ALPN-01 answer");
                    None
                }
            },
        };
        let ttl = if answer.is_some() { REMOTE_HIT_TTL } else { REMOTE_MISS_TTL };
        let mut cache = self.remote.lock().expect("poisoned");
        if cache.len() >= REMOTE_CACHE_MAX {
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= REMOTE_CACHE_MAX {
                cache.clear();
            }
        }
        if answer.is_some() {
            debug!(challenge = kind.as_str(), "answering a challenge of another edge's order");
        }
        cache.insert(key, (now + ttl, answer.clone()));
        answer
    }

    /// The background task: scan, start due jobs, sleep until the next is due.
    pub async fn run(self: Arc<Self>) {
        loop {
            let next = match self.scan().await {
                Ok(next) => next,
                Err(e) => {
                    warn!(error = %e, "certificate scan failed");
                    Some(unix_now() + 30)
                }
            };
            let wait = next.map_or(ACME_SCAN_INTERVAL, |at| {
                Duration::from_secs(at.saturating_sub(unix_now())).min(ACME_SCAN_INTERVAL)
            });
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(wait.max(Duration::from_millis(200))) => {}
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    /// One pass: forget released names, start jobs for due ones. Returns
    /// when the next one is due (Unix seconds).
    async fn scan(self: &Arc<Self>) -> Result<Option<u64>, StoreError> {
        let now = unix_now();
        let mut custom: HashSet<String> = self
            .store
            .reservations()
            .await?
            .into_iter()
            .filter(|r| r.kind == ReservationKind::Custom && !r.is_default_host())
            .filter_map(|r| r.hostname)
            .collect();
        // The edge's own certificate (DNS-01) is scheduled like a custom domain's.
        if let Some(own) = &self.config.own {
            custom.insert(own.record_key());
        }
        let records: HashMap<String, CertificateRecord> =
            self.store.certificates().await?.into_iter().map(|c| (c.hostname.clone(), c)).collect();

        // Released: stop serving, forget (the release already deleted the row).
        let stale: Vec<String> =
            self.served.lock().expect("poisoned").keys().filter(|h| !custom.contains(*h)).cloned().collect();
        for host in stale {
            self.certs.remove(&host);
            self.served.lock().expect("poisoned").remove(&host);
            info!(host = %host, "custom domain released: certificate removed");
        }
        // A stored own certificate is kept while DNS-01 is off (no new order when it is on again).
        for host in records.keys().filter(|h| !custom.contains(*h) && !h.starts_with("*.")) {
            self.store.delete_certificate(host).await?;
        }

        // Stored by another edge (or renewed there): served here too.
        for (host, record) in records.iter().filter(|(h, _)| custom.contains(*h)) {
            let known = self.served.lock().expect("poisoned").get(host).copied();
            let own_known = self.is_own(host)
                && self.own_served.lock().expect("poisoned").is_some_and(|n| Some(n) == record.not_after);
            if known == Some(record.not_after) || own_known {
                continue;
            }
            if let Some(Ok(key)) = serving_key(record) {
                info!(host = %host, "serving the certificate found in the store");
                self.serve(host, key, record.not_after);
            }
        }

        let mut next: Option<u64> = None;
        for host in &custom {
            let due = match records.get(host) {
                None => {
                    self.store.put_certificate(&CertificateRecord::pending(host)).await?;
                    now
                }
                Some(r) => due_at(r),
            };
            if due > now {
                next = Some(next.map_or(due, |n| n.min(due)));
                continue;
            }
            // Looked at again in a minute: the order may run on another edge,
            // which can fail without this one hearing of it.
            next = Some(next.map_or(now + 60, |n| n.min(now + 60)));
            if !self.in_flight.lock().expect("poisoned").insert(host.clone()) {
                continue; // already running; it wakes the scan when done
            }
            let (acme, host) = (self.clone(), host.clone());
            let span = tracing::info_span!("certificate", host = %host);
            tokio::spawn(
                async move {
                    let ran = tokio::select! {
                        ran = acme.job(&host) => ran,
                        _ = acme.shutdown.cancelled() => false,
                    };
                    acme.in_flight.lock().expect("poisoned").remove(&host);
                    if ran {
                        acme.wake();
                    }
                }
                .instrument(span),
            );
        }
        Ok(next)
    }

    /// Checks DNS and orders (or renews) one name's certificate; records the
    /// outcome. Returns whether it ran (`false`: not due any more, or another
    /// edge holds the name's lease and orders it).
    async fn job(&self, host: &str) -> bool {
        let Ok(_permit) = self.orders.acquire().await else { return false };
        let ttl = match &self.config.own {
            Some(own) if self.is_own(host) => own.order_timeout(),
            _ => ACME_ORDER_TIMEOUT,
        } + Duration::from_secs(60);
        let lease = format!("acme:{host}");
        match self.store.try_lease(&lease, &self.holder, ttl).await {
            Ok(true) => {}
            Ok(false) => {
                info!("another edge is ordering this certificate");
                return false;
            }
            Err(e) => {
                warn!(error = %e, "could not take the order's lease; trying later");
                return false;
            }
        }
        let ran = self.job_leased(host).await;
        if let Err(e) = self.store.release_lease(&lease, &self.holder).await {
            warn!(error = %e, "could not give the order's lease up (it expires)");
        }
        ran
    }

    async fn job_leased(&self, host: &str) -> bool {
        let Ok(Some(mut record)) = self.store.certificate(host).await else { return false };
        if due_at(&record) > unix_now() {
            return false; // done meanwhile (here or on another edge)
        }
        let outcome = match &self.config.own {
            // Bounded inside, so that the records are always removed.
            Some(own) if self.is_own(host) => self.order_own(own).await,
            _ => match tokio::time::timeout(ACME_ORDER_TIMEOUT, self.order(host)).await {
                Ok(r) => r,
                Err(_) => Err(AcmeError::Timeout),
            },
        };
        let now = unix_now();
        match outcome {
            Ok(issued) => {
                record.status = StoredCertificateStatus::Ready;
                record.chain_pem = Some(issued.chain_pem);
                record.key_pem = Some(issued.key_pem);
                record.not_before = Some(issued.not_before);
                record.not_after = Some(issued.not_after);
                record.last_error = None;
                record.failures = 0;
                record.next_attempt = 0;
                self.count("issued");
                match self.store.put_certificate(&record).await {
                    Ok(true) => {
                        self.serve(host, issued.key, Some(issued.not_after));
                        info!(not_after = %super::store::rfc3339(issued.not_after), "certificate issued");
                    }
                    Ok(false) => info!("released while ordering: certificate discarded"),
                    Err(e) => warn!(error = %e, "failed to store the certificate"),
                }
            }
            Err(e) => {
                let dns = matches!(e, AcmeError::DnsMismatch(_));
                record.failures = record.failures.saturating_add(1);
                let delay = e.retry_in(record.failures);
                record.next_attempt = now + delay.as_secs();
                record.last_error = Some(crate::http::error_chain(&e));
                // A name that still has a valid certificate keeps serving it.
                if record.chain_pem.is_none() {
                    record.status = if dns {
                        StoredCertificateStatus::DnsMismatch
                    } else {
                        StoredCertificateStatus::Failed
                    };
                }
                warn!(error = %record.last_error.as_deref().unwrap_or_default(), category = e.category(), retry_in_s = delay.as_secs(), "certificate not obtained");
                self.count(if dns {
                    "dns_mismatch"
                } else if e.transient() {
                    "transient"
                } else {
                    "failed"
                });
                if let Err(e) = self.store.put_certificate(&record).await {
                    warn!(error = %e, "failed to store the certificate state");
                }
            }
        }
        true
    }

    /// Counts a finished job (before its outcome is stored and visible).
    fn count(&self, result: &'static str) {
        self.results.get_or_create(&vec![("result", result.to_string())]).inc();
    }

    fn serve(&self, host: &str, key: Arc<CertifiedKey>, not_after: Option<u64>) {
        if self.is_own(host) {
            self.certs.set_default(key);
            *self.own_served.lock().expect("poisoned") = not_after;
            return;
        }
        self.certs.set(host, key);
        self.served.lock().expect("poisoned").insert(host.to_string(), not_after);
    }

    /// The name must resolve to (one of) the edge's addresses.
    async fn check_dns(&self, host: &str) -> Result<(), AcmeError> {
        let resolver = self.config.resolver;
        let mut mine = std::collections::BTreeSet::new();
        for name in &self.config.edge_names {
            match resolver.lookup(name).await {
                Ok(ips) => mine.extend(ips),
                Err(e) => debug!(name = %name, error = %e, "the edge's own name does not resolve"),
            }
        }
        let edge = &self.config.edge_names[0];
        if mine.is_empty() {
            return Err(AcmeError::DnsMismatch(format!(
                "the edge's own name {} does not resolve, so it cannot tell whether {host} points at it: fix the DNS of {edge}",
                self.config.edge_names.join(" / ")
            )));
        }
        let theirs = resolver.lookup(host).await.map_err(|e| {
            AcmeError::DnsMismatch(format!("{e}: add a CNAME record {host} -> {edge} at your DNS provider"))
        })?;
        if theirs.is_empty() {
            return Err(AcmeError::DnsMismatch(format!(
                "{host} has no A/AAAA record: add a CNAME record {host} -> {edge} at your DNS provider"
            )));
        }
        if theirs.is_disjoint(&mine) {
            let list = |s: &std::collections::BTreeSet<std::net::IpAddr>| {
                s.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            };
            return Err(AcmeError::DnsMismatch(format!(
                "{host} resolves to {}, not to this edge ({edge}: {}): set a CNAME record {host} -> {edge}",
                list(&theirs),
                list(&mine)
            )));
        }
        Ok(())
    }

    /// The account for the directory: from the store, or registered once.
    /// Edges sharing a store register one account: the one holding the
    /// account's lease registers it, the others wait for it and load it.
    async fn account(&self) -> Result<Account, AcmeError> {
        let mut slot = self.account.lock().await;
        if let Some(account) = &*slot {
            return Ok(account.clone());
        }
        let directory = &self.config.directory;
        let lease = format!("acme-account:{directory}");
        let waiting_since = Instant::now();
        let account = loop {
            if let Some(json) = self.store.acme_account(directory).await? {
                break self.load_account(&json).await?;
            }
            if self.store.try_lease(&lease, &self.holder, ACCOUNT_LEASE).await? {
                let registered = self.register_account().await;
                if let Err(e) = self.store.release_lease(&lease, &self.holder).await {
                    warn!(error = %e, "could not give the account's lease up (it expires)");
                }
                break registered?;
            }
            if waiting_since.elapsed() > ACCOUNT_LEASE {
                return Err(AcmeError::Account(instant_acme::Error::Str(
                    "another edge holds the ACME account's lease and has registered no account",
                )));
            }
            debug!("another edge is registering the ACME account; waiting for it");
            tokio::time::sleep(ACCOUNT_POLL).await;
        };
        *slot = Some(account.clone());
        Ok(account)
    }

    /// Registers the account, unless one is stored (another edge was
    /// faster); the account stored is the one used.
    async fn register_account(&self) -> Result<Account, AcmeError> {
        let directory = &self.config.directory;
        if let Some(json) = self.store.acme_account(directory).await? {
            return self.load_account(&json).await;
        }
        let contact = self.config.email.as_ref().map(|e| format!("mailto:{e}"));
        let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
        let new =
            NewAccount { contact: &contacts, terms_of_service_agreed: true, only_return_existing: false };
        let (account, credentials) = Account::builder_with_http(self.http()?)
            .create(&new, directory.clone(), None)
            .await
            .map_err(AcmeError::Account)?;
        let json = serde_json::to_string(&credentials)
            .map_err(|e| AcmeError::Account(instant_acme::Error::Json(e)))?;
        let stored = self.store.put_acme_account(directory, &json).await?;
        if stored != json {
            warn!(account = %account.id(), "another edge stored an ACME account first: using it instead");
            return self.load_account(&stored).await;
        }
        info!(account = %account.id(), directory = %directory, "ACME account registered");
        Ok(account)
    }

    async fn load_account(&self, json: &str) -> Result<Account, AcmeError> {
        let credentials: AccountCredentials =
            serde_json::from_str(json).map_err(|e| AcmeError::Account(instant_acme::Error::Json(e)))?;
        Account::builder_with_http(self.http()?)
            .from_credentials(credentials)
            .await
            .map_err(AcmeError::Account)
    }

    fn http(&self) -> Result<Box<dyn HttpClient>, AcmeError> {
        Ok(Box::new(AcmeHttp::new(&self.config)?))
    }

    /// The ACME account's URL at the CA (registered or loaded now if needed).
    pub async fn account_id(&self) -> Result<String, AcmeError> {
        Ok(self.account().await?.id().to_string())
    }

    /// One order: DNS check, challenge, finalize, download.
    async fn order(&self, host: &str) -> Result<Issued, AcmeError> {
        self.check_dns(host).await?;
        let account = self.account().await?;
        let identifiers = [Identifier::Dns(host.to_string())];
        let mut order = account.new_order(&NewOrder::new(&identifiers)).await?;
        let (kind, name, other) = match self.config.challenge {
            AcmeChallenge::TlsAlpn01 => (ChallengeType::TlsAlpn01, "tls-alpn-01", "http-01"),
            AcmeChallenge::Http01 => (ChallengeType::Http01, "http-01", "tls-alpn-01"),
        };
        let mut published = Published { acme: self, tokens: Vec::new(), alpn: Vec::new() };
        let expires_at = unix_now() + CHALLENGE_TTL.as_secs();
        {
            let mut authorizations = order.authorizations();
            while let Some(authorization) = authorizations.next().await {
                let mut authorization = authorization?;
                if !needs_challenge(&authorization.status, host)? {
                    continue;
                }
                let mut challenge = authorization
                    .challenge(kind.clone())
                    .ok_or_else(|| AcmeError::NoChallenge { host: host.into(), challenge: name, other })?;
                let key_authorization = challenge.key_authorization();
                match self.config.challenge {
                    AcmeChallenge::Http01 => {
                        published.token(&challenge.token, key_authorization.as_str(), expires_at).await?;
                    }
                    AcmeChallenge::TlsAlpn01 => {
                        published.alpn(host, key_authorization.digest().as_ref(), expires_at).await?;
                    }
                }
                debug!(challenge = name, "challenge published");
                challenge.set_ready().await?;
            }
        }
        let issued = finish_order(&mut order, host).await;
        drop(published);
        issued
    }
}

impl Acme {
    /// The edge's own `<domain>` + `*.<domain>` certificate by DNS-01: sets
    /// the TXT records, lets the CA check them, and removes them again
    /// (also when the order fails or times out).
    async fn order_own(&self, own: &OwnCertificate) -> Result<Issued, AcmeError> {
        let mut records: Vec<(String, String)> = Vec::new();
        let outcome =
            match tokio::time::timeout(own.order_timeout(), self.order_own_inner(own, &mut records)).await {
                Ok(r) => r,
                Err(_) => Err(AcmeError::Timeout),
            };
        for (fqdn, value) in records {
            match own.provider.unset(&fqdn, &value).await {
                Ok(()) => debug!(fqdn = %fqdn, "DNS-01 record removed"),
                Err(e) => {
                    warn!(fqdn = %fqdn, error = %e, category = e.category(), "failed to remove a DNS-01 record; remove it by hand")
                }
            }
        }
        outcome
    }

    async fn order_own_inner(
        &self,
        own: &OwnCertificate,
        records: &mut Vec<(String, String)>,
    ) -> Result<Issued, AcmeError> {
        let account = self.account().await?;
        let identifiers = [Identifier::Dns(own.domain.clone()), Identifier::Dns(format!("*.{}", own.domain))];
        let mut order = account.new_order(&NewOrder::new(&identifiers)).await?;
        let host = own.record_key();
        {
            let mut authorizations = order.authorizations();
            while let Some(authorization) = authorizations.next().await {
                let mut authorization = authorization?;
                if !needs_challenge(&authorization.status, &host)? {
                    continue;
                }
                let mut challenge =
                    authorization.challenge(ChallengeType::Dns01).ok_or_else(|| AcmeError::NoChallenge {
                        host: host.clone(),
                        challenge: "dns-01",
                        other: "tls-alpn-01 (with --tls-cert files for the edge's own name)",
                    })?;
                let name = match &challenge.identifier().identifier {
                    Identifier::Dns(name) => name.clone(),
                    _ => own.domain.clone(),
                };
                let fqdn = dns01::challenge_name(&name);
                let value = challenge.key_authorization().dns_value();
                own.provider.set(&fqdn, &value).await?;
                records.push((fqdn.clone(), value));
                info!(fqdn = %fqdn, for_name = %challenge.identifier(), "DNS-01 record set");
                if !own.propagation.is_zero() {
                    tokio::time::sleep(own.propagation).await;
                }
                challenge.set_ready().await?;
            }
        }
        finish_order(&mut order, &host).await
    }
}

/// Whether an authorization still needs its challenge answered (`Pending`),
/// is done already (`Valid`), or failed the order (anything else).
fn needs_challenge(status: &AuthorizationStatus, host: &str) -> Result<bool, AcmeError> {
    match status {
        AuthorizationStatus::Pending => Ok(true),
        AuthorizationStatus::Valid => Ok(false),
        status => {
            Err(AcmeError::Invalid { host: host.into(), detail: format!("the authorization is {status:?}") })
        }
    }
}

/// Waits until the CA has checked every challenge of `order`, then
/// finalizes it and downloads the certificate. A refused order is
/// `Invalid` with the CA's reason.
async fn finish_order(order: &mut Order, host: &str) -> Result<Issued, AcmeError> {
    let retries = RetryPolicy::new().timeout(ACME_ORDER_TIMEOUT / 2);
    let status = order.poll_ready(&retries).await?;
    if status != OrderStatus::Ready {
        let mut detail = format!("the order is {status:?}");
        let mut authorizations = order.authorizations();
        while let Some(Ok(mut authorization)) = authorizations.next().await {
            if let Ok(state) = authorization.refresh().await
                && let Some(problem) = state.challenges.iter().find_map(|c| c.error.as_ref())
            {
                detail = problem.to_string();
            }
        }
        return Err(AcmeError::Invalid { host: host.into(), detail });
    }
    let key_pem = order.finalize().await?;
    let chain_pem = order.poll_certificate(&retries).await?;
    Issued::parse(chain_pem, key_pem)
}

/// When a record is due for work (Unix seconds).
/// `-` and 8 random hex digits.
fn random_suffix() -> String {
    let b: [u8; 4] = crate::random_bytes().unwrap_or_default();
    format!("-{:08x}", u32::from_le_bytes(b))
}

fn due_at(r: &CertificateRecord) -> u64 {
    match r.renew_at() {
        Some(renew) if r.chain_pem.is_some() => renew.max(r.next_attempt),
        _ => r.next_attempt,
    }
}

/// `initial * 2^(failures-1)`, capped.
pub fn backoff(failures: u32, initial: Duration, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
    initial.saturating_mul(factor).min(max)
}

/// The served key of a stored record, if it has a certificate.
fn serving_key(r: &CertificateRecord) -> Option<Result<Arc<CertifiedKey>, AcmeError>> {
    let (chain, key) = (r.chain_pem.as_deref()?, r.key_pem.as_deref()?);
    Some(Issued::parse(chain.to_string(), key.to_string()).map(|i| i.key))
}

/// An issued certificate, ready to serve and to store.
struct Issued {
    chain_pem: String,
    key_pem: String,
    not_before: u64,
    not_after: u64,
    key: Arc<CertifiedKey>,
}

impl Issued {
    fn parse(chain_pem: String, key_pem: String) -> Result<Issued, AcmeError> {
        let bad = |m: String| AcmeError::BadCertificate(m);
        let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(format!("certificate chain: {e}")))?;
        let leaf = chain.first().ok_or_else(|| bad("empty certificate chain".into()))?;
        let (not_before, not_after) =
            x509::validity(leaf).ok_or_else(|| bad("cannot read the certificate's validity".into()))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| bad(format!("private key: {e}")))?;
        let key = tls::certified_key(chain, key)?;
        Ok(Issued { chain_pem, key_pem, not_before, not_after, key })
    }
}

/// A self-signed certificate for `host` with the acmeIdentifier extension
/// (RFC 8737): the TLS-ALPN-01 answer.
fn alpn_challenge_key(host: &str, digest: &[u8]) -> Result<Arc<CertifiedKey>, AcmeError> {
    let mut params = rcgen::CertificateParams::new(vec![host.to_string()]).map_err(TlsError::from)?;
    params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(digest)];
    let key = rcgen::KeyPair::generate().map_err(TlsError::from)?;
    let cert = params.self_signed(&key).map_err(TlsError::from)?;
    let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    // Not `CertifiedKey::from_der`: its key check parses the certificate,
    // and the critical acmeIdentifier extension is unknown to the parser.
    let signer =
        rustls::crypto::ring::default_provider().key_provider.load_private_key(der).map_err(TlsError::Key)?;
    Ok(Arc::new(CertifiedKey::new(vec![cert.der().clone()], signer)))
}

/// Challenge answers read from the store: until when each holds, and the answer.
type RemoteCache = HashMap<(ChallengeKind, String), (Instant, Option<RemoteAnswer>)>;

/// A challenge answer of another edge's order, ready to serve.
#[derive(Clone)]
enum RemoteAnswer {
    /// HTTP-01: the key authorization.
    Http(String),
    /// TLS-ALPN-01: the challenge certificate.
    Alpn(Arc<CertifiedKey>),
}

/// Challenge responses of one order, in this edge's memory and in the
/// store (for the other edges); withdrawn from both when dropped.
struct Published<'a> {
    acme: &'a Acme,
    tokens: Vec<String>,
    alpn: Vec<String>,
}

impl Published<'_> {
    async fn token(
        &mut self,
        token: &str,
        key_authorization: &str,
        expires_at: u64,
    ) -> Result<(), AcmeError> {
        self.acme.http01.write().expect("poisoned").insert(token.to_string(), key_authorization.to_string());
        self.tokens.push(token.to_string());
        let c = Challenge {
            kind: ChallengeKind::Http01,
            name: token.to_string(),
            value: key_authorization.to_string(),
            expires_at,
        };
        Ok(self.acme.store.put_challenge(&c).await?)
    }

    async fn alpn(&mut self, host: &str, digest: &[u8], expires_at: u64) -> Result<(), AcmeError> {
        self.acme.certs.set_acme_challenge(host, alpn_challenge_key(host, digest)?);
        self.alpn.push(host.to_string());
        let c = Challenge {
            kind: ChallengeKind::TlsAlpn01,
            name: host.to_ascii_lowercase(),
            value: to_hex(digest),
            expires_at,
        };
        Ok(self.acme.store.put_challenge(&c).await?)
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let mut tokens = self.acme.http01.write().expect("poisoned");
        for t in &self.tokens {
            tokens.remove(t);
        }
        for host in &self.alpn {
            self.acme.certs.remove_acme_challenge(host);
        }
        let stored: Vec<(ChallengeKind, String)> = (self.tokens.iter())
            .map(|t| (ChallengeKind::Http01, t.clone()))
            .chain(self.alpn.iter().map(|h| (ChallengeKind::TlsAlpn01, h.to_ascii_lowercase())))
            .collect();
        if stored.is_empty() {
            return;
        }
        // Dropped in a task of the runtime; the answers expire in the store anyway.
        let store = self.acme.store.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for (kind, name) in stored {
                    if let Err(e) = store.delete_challenge(kind, &name).await {
                        debug!(challenge = kind.as_str(), error = %e, "could not remove a challenge answer from the store (it expires)");
                    }
                }
            });
        }
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// instant-acme's HTTP client: hyper over rustls (ring), trusting the
/// built-in roots or `--acme-ca-file`, every call under a timeout.
struct AcmeHttp(HyperClient<hyper_rustls::HttpsConnector<HttpConnector>, BodyWrapper<Bytes>>);

impl AcmeHttp {
    fn new(config: &AcmeConfig) -> Result<AcmeHttp, AcmeError> {
        let tls =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(TlsError::Config)?
                .with_root_certificates(tls::root_store(config.ca_file.as_deref())?)
                .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .enable_http2()
            .build();
        Ok(AcmeHttp(HyperClient::builder(TokioExecutor::new()).build(connector)))
    }
}

impl HttpClient for AcmeHttp {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        let fut = self.0.request(req);
        Box::pin(async move {
            match tokio::time::timeout(API_CLIENT_TIMEOUT, fut).await {
                Ok(Ok(response)) => Ok(BytesResponse::from(response)),
                Ok(Err(e)) => Err(instant_acme::Error::Other(Box::new(e))),
                Err(_) => Err(instant_acme::Error::Other(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the ACME server did not answer within {}s", API_CLIENT_TIMEOUT.as_secs()),
                )))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let (i, m) = (Duration::from_secs(60), Duration::from_secs(3600));
        assert_eq!(backoff(1, i, m), Duration::from_secs(60));
        assert_eq!(backoff(2, i, m), Duration::from_secs(120));
        assert_eq!(backoff(4, i, m), Duration::from_secs(480));
        assert_eq!(backoff(7, i, m), m);
        assert_eq!(backoff(u32::MAX, i, m), m);
    }

    #[test]
    fn a_failing_ca_is_retried_within_seconds_a_judged_order_after_minutes() {
        let problem =
            |json: &str| AcmeError::Protocol(instant_acme::Error::Api(serde_json::from_str(json).unwrap()));
        let nonce = problem(r#"{"type":"urn:ietf:params:acme:error:badNonce","status":400}"#);
        let down = problem(r#"{"type":"urn:ietf:params:acme:error:serverInternal","status":500}"#);
        let gateway = problem(r#"{"detail":"bad gateway","status":502}"#);
        let unreachable = AcmeError::Account(instant_acme::Error::Other(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        ))));
        for e in [&nonce, &down, &gateway, &unreachable] {
            assert!(e.transient(), "{e:?}");
            assert_eq!(e.retry_in(1), ACME_TRANSIENT_RETRY_INITIAL);
            assert_eq!(e.retry_in(2), 2 * ACME_TRANSIENT_RETRY_INITIAL);
            assert_eq!(
                e.retry_in(30),
                ACME_ORDER_BACKOFF_INITIAL,
                "capped at the judged order's first delay"
            );
        }
        let judged = [
            problem(r#"{"type":"urn:ietf:params:acme:error:rateLimited","status":429}"#),
            problem(r#"{"type":"urn:ietf:params:acme:error:rejectedIdentifier","status":400}"#),
            AcmeError::Invalid { host: "a.example".into(), detail: "connection refused".into() },
            AcmeError::Timeout,
        ];
        for e in &judged {
            assert!(!e.transient(), "{e:?}");
            assert_eq!(e.retry_in(1), ACME_ORDER_BACKOFF_INITIAL);
            assert_eq!(e.retry_in(30), ACME_ORDER_BACKOFF_MAX);
        }
        let dns = AcmeError::DnsMismatch("no A/AAAA record".into());
        assert!(!dns.transient());
        assert_eq!(dns.retry_in(1), ACME_DNS_RECHECK_INITIAL);
    }

    #[test]
    fn renewal_is_due_30_days_before_expiry_or_a_third_of_short_lifetimes() {
        let mut r = CertificateRecord::pending("a.example");
        assert_eq!(due_at(&r), 0, "never ordered: due now");
        let day = 86_400;
        r.chain_pem = Some(String::new());
        r.key_pem = Some(String::new());
        r.not_before = Some(1_000 * day);
        r.not_after = Some(1_090 * day);
        assert_eq!(due_at(&r), 1_060 * day, "90-day certificate: 30 days before");
        r.not_after = Some(1_000 * day + 60);
        assert_eq!(due_at(&r), 1_000 * day + 40, "60 s certificate: after 40 s");
        r.next_attempt = 1_000 * day + 100;
        assert_eq!(due_at(&r), 1_000 * day + 100, "a failed renewal waits for its backoff");
    }

    #[test]
    fn challenge_certificate_carries_the_acme_identifier() {
        let digest = [7u8; 32];
        let key = alpn_challenge_key("app.example.org", &digest).unwrap();
        let der = key.cert[0].as_ref();
        // id-pe-acmeIdentifier 1.3.6.1.5.5.7.1.31, critical, OCTET STRING { OCTET STRING (32) }.
        let oid = [0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x01, 0x1f];
        let at = der.windows(oid.len()).position(|w| w == oid).expect("extension present");
        assert!(der[at..].windows(34).any(|w| w[0] == 0x04 && w[1] == 32 && w[2..] == digest));
    }
}
