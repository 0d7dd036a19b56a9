//! The edge's state: API keys, reservations (domains, TCP ports), tunnel
//! keys, ACME accounts and certificates, behind one interface ([`Engine`])
//! with two implementations:
//!
//! - [`Sqlite`]: one embedded SQLite file, `<data dir>/culvert.db` (the
//!   default; one edge).
//! - [`pg::Postgres`]: a PostgreSQL database shared by several edges
//!   (`--store postgres://…`), with a change feed (LISTEN/NOTIFY) so every
//!   edge sees what another one changed.
//!
//! Common to both:
//! - Versioned schemas, migrated at open; a database from a newer culvert is
//!   refused rather than guessed at.
//! - Secrets are 32 random bytes shown once, rendered as a type prefix
//!   ([`ADMIN_KEY_PREFIX`], [`ENDPOINTS_KEY_PREFIX`], [`TUNNEL_KEY_PREFIX`])
//!   plus 64 hex digits; only their SHA-256 is stored and keys are looked up
//!   by that hash. Every key also has a short public id (`ak_…`, `tk_…`) to
//!   list and revoke it by.
//! - Revoked keys keep their row (marked `revoked_at`), so the edge can tell
//!   "revoked" from "unknown". Releasing a reservation deletes it (the name is
//!   free again) and revokes its tunnel keys.
//! - Every check-then-write (a name or port already held, the last admin
//!   key) is one transaction, so two edges racing on one database cannot both
//!   win.
//!
//! Engine calls are synchronous; [`Store`] is a cheap `Clone` that runs them
//! off the request threads ([`Store::run`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::types::Type;
use rusqlite::{Connection, Row, TransactionBehavior, params};
use tokio_util::sync::CancellationToken;

use crate::api::PortRange;
use std::collections::HashSet;

use crate::api::{
    ApiKey, ApiKeyScope, Labels, Protocol, QuotaUpdate, Reservation, ReservationKind, TunnelKey,
};

mod certificates;
mod keys;
pub mod pg;
mod reservations;

pub use certificates::{CertificateRecord, Certificates, Challenge, ChallengeKind, StoredCertificateStatus};
pub use keys::{ApiKeyAuth, Keys, TunnelGrant, TunnelKeyAuth};
pub use reservations::Reservations;

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "culvert.db";
/// Prefix of admin API keys.
pub const ADMIN_KEY_PREFIX: &str = "culvert_a_";
/// Prefix of `endpoints` API keys.
pub const ENDPOINTS_KEY_PREFIX: &str = "culvert_e_";
/// Prefix of tunnel keys.
pub const TUNNEL_KEY_PREFIX: &str = "culvert_t_";
/// Name of the admin key made at the first start.
pub const INITIAL_ADMIN_KEY_NAME: &str = "initial admin key";
/// How long a call waits for a lock held by another connection.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Schema migrations; migration `i` brings `user_version` from `i` to `i + 1`.
/// Append only: never edit one that has shipped.
pub const MIGRATIONS: &[&str] = &[
    // 1: keys and reservations.
    r#"
    CREATE TABLE api_keys (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        scope       TEXT NOT NULL CHECK (scope IN ('admin', 'endpoints')),
        secret_hash TEXT NOT NULL UNIQUE,
        created_at  TEXT NOT NULL,
        revoked_at  TEXT
    ) STRICT;

    CREATE TABLE reservations (
        id         TEXT PRIMARY KEY,
        kind       TEXT NOT NULL CHECK (kind IN ('subdomain', 'custom', 'tcp')),
        hostname   TEXT UNIQUE,
        port       INTEGER UNIQUE CHECK (port BETWEEN 1 AND 65535),
        owner      TEXT NOT NULL REFERENCES api_keys (id),
        labels     TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL,
        CHECK ((kind = 'tcp' AND port IS NOT NULL AND hostname IS NULL)
            OR (kind <> 'tcp' AND hostname IS NOT NULL AND port IS NULL))
    ) STRICT;

    CREATE TABLE tunnel_keys (
        id             TEXT PRIMARY KEY,
        secret_hash    TEXT NOT NULL UNIQUE,
        protocol       TEXT NOT NULL CHECK (protocol IN ('http', 'tcp', 'tls')),
        -- The reservation, copied so a key of a released one still says what it was for.
        reservation_id TEXT NOT NULL,
        kind           TEXT NOT NULL,
        hostname       TEXT,
        port           INTEGER,
        -- Owner of the reservation when the key was made; created_by may be an admin.
        owner          TEXT NOT NULL REFERENCES api_keys (id),
        created_by     TEXT NOT NULL REFERENCES api_keys (id),
        labels         TEXT NOT NULL DEFAULT '{}',
        created_at     TEXT NOT NULL,
        revoked_at     TEXT
    ) STRICT;

    CREATE INDEX tunnel_keys_by_reservation ON tunnel_keys (reservation_id);
    "#,
    // 2: ACME accounts (one per directory URL) and custom domain certificates.
    r#"
    CREATE TABLE acme_accounts (
        directory   TEXT PRIMARY KEY,
        -- instant-acme's AccountCredentials as JSON (holds the account's private key).
        credentials TEXT NOT NULL,
        created_at  TEXT NOT NULL
    ) STRICT;

    CREATE TABLE certificates (
        hostname     TEXT PRIMARY KEY,
        status       TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'dns_mismatch', 'failed')),
        -- PEM chain and PKCS#8 key of the certificate served (NULL until the first one).
        chain_pem    TEXT,
        key_pem      TEXT,
        not_before   INTEGER,
        not_after    INTEGER,
        last_error   TEXT,
        -- Consecutive failures, for the backoff; unix seconds of the next try.
        failures     INTEGER NOT NULL DEFAULT 0,
        next_attempt INTEGER NOT NULL DEFAULT 0,
        updated_at   TEXT NOT NULL,
        CHECK ((chain_pem IS NULL) = (key_pem IS NULL))
    ) STRICT;
    "#,
    // 3: leases (one ACME order per name at a time; trivial with one edge).
    r#"
    CREATE TABLE leases (
        name       TEXT PRIMARY KEY,
        holder     TEXT NOT NULL,
        expires_at INTEGER NOT NULL
    ) STRICT;
    "#,
    // 4: the custom domains an endpoints key may reserve (a JSON array of
    // suffixes; keys made before may reserve none).
    r#"
    ALTER TABLE api_keys ADD COLUMN custom_domains TEXT NOT NULL DEFAULT '[]';
    "#,
    // 5: answers to pending ACME challenges, so that any edge answers the
    // CA's validation (one edge: the order's own memory would do).
    r#"
    CREATE TABLE acme_challenges (
        kind       TEXT NOT NULL CHECK (kind IN ('http-01', 'tls-alpn-01')),
        -- HTTP-01: the token; TLS-ALPN-01: the host name.
        name       TEXT NOT NULL,
        -- HTTP-01: the key authorization; TLS-ALPN-01: its SHA-256, hex.
        value      TEXT NOT NULL,
        expires_at INTEGER NOT NULL,
        PRIMARY KEY (kind, name)
    ) STRICT;
    "#,
    // 6: UDP ports: a port reservation's transport (TCP and UDP ports are
    // separate spaces, so the port is unique per protocol) and tunnel keys
    // of protocol udp. SQLite changes a constraint by rebuilding the table;
    // rowids are kept (tunnel keys are listed in rowid order).
    r#"
    CREATE TABLE reservations_new (
        id         TEXT PRIMARY KEY,
        kind       TEXT NOT NULL CHECK (kind IN ('subdomain', 'custom', 'tcp')),
        hostname   TEXT UNIQUE,
        port       INTEGER CHECK (port BETWEEN 1 AND 65535),
        owner      TEXT NOT NULL REFERENCES api_keys (id),
        labels     TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL,
        protocol   TEXT NOT NULL DEFAULT 'tcp' CHECK (protocol IN ('tcp', 'udp')),
        UNIQUE (port, protocol),
        CHECK ((kind = 'tcp' AND port IS NOT NULL AND hostname IS NULL)
            OR (kind <> 'tcp' AND hostname IS NOT NULL AND port IS NULL AND protocol = 'tcp'))
    ) STRICT;
    INSERT INTO reservations_new (rowid, id, kind, hostname, port, owner, labels, created_at)
        SELECT rowid, id, kind, hostname, port, owner, labels, created_at FROM reservations;
    DROP TABLE reservations;
    ALTER TABLE reservations_new RENAME TO reservations;

    CREATE TABLE tunnel_keys_new (
        id             TEXT PRIMARY KEY,
        secret_hash    TEXT NOT NULL UNIQUE,
        protocol       TEXT NOT NULL CHECK (protocol IN ('http', 'tcp', 'tls', 'udp')),
        reservation_id TEXT NOT NULL,
        kind           TEXT NOT NULL,
        hostname       TEXT,
        port           INTEGER,
        owner          TEXT NOT NULL REFERENCES api_keys (id),
        created_by     TEXT NOT NULL REFERENCES api_keys (id),
        labels         TEXT NOT NULL DEFAULT '{}',
        created_at     TEXT NOT NULL,
        revoked_at     TEXT
    ) STRICT;
    INSERT INTO tunnel_keys_new (rowid, id, secret_hash, protocol, reservation_id, kind, hostname, port, owner, created_by, labels, created_at, revoked_at)
        SELECT rowid, id, secret_hash, protocol, reservation_id, kind, hostname, port, owner, created_by, labels, created_at, revoked_at FROM tunnel_keys;
    DROP TABLE tunnel_keys;
    ALTER TABLE tunnel_keys_new RENAME TO tunnel_keys;
    CREATE INDEX tunnel_keys_by_reservation ON tunnel_keys (reservation_id);
    "#,
    // 7: the quota of an endpoints key (NULL: `Quota::DEFAULT`'s value) and a
    // TCP port's own idle timeout (NULL: the edge's flag).
    r#"
    ALTER TABLE api_keys ADD COLUMN max_reservations INTEGER;
    ALTER TABLE api_keys ADD COLUMN max_labels INTEGER;
    ALTER TABLE api_keys ADD COLUMN max_label_bytes INTEGER;
    ALTER TABLE reservations ADD COLUMN idle_timeout_seconds INTEGER;
    CREATE INDEX reservations_by_owner ON reservations (owner);
    "#,
];

/// Errors of the store. Conflicts and lookups that find nothing are errors
/// too, so the API can map each to its status and code.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The data directory could not be prepared.
    #[error("failed to prepare data directory {path}: {source}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The database was written by a newer culvert.
    #[error(
        "the database {path} has schema version {found}, this culvert knows up to {supported}: run a newer culvert (or restore a backup)"
    )]
    NewerSchema {
        /// The database file.
        path: PathBuf,
        /// `user_version` found.
        found: u32,
        /// Highest version this binary knows.
        supported: u32,
    },
    /// The PostgreSQL schema was written by a newer culvert.
    #[error(
        "the PostgreSQL database has schema version {found}, this culvert knows up to {supported}: run a newer culvert on every edge"
    )]
    NewerPostgresSchema {
        /// Version found.
        found: u32,
        /// Highest version this binary knows.
        supported: u32,
    },
    /// The system random generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// A row holds something this binary cannot read.
    #[error("the database holds an invalid record: {0}")]
    Corrupt(String),
    /// The owner holds as many reservations as its quota allows.
    #[error("{owner} holds {limit} reservations, its quota")]
    QuotaExceeded {
        /// The API key id.
        owner: String,
        /// Its quota of reservations.
        limit: u32,
    },
    /// The name or port is held by another API key.
    #[error("{target} is held by another key ({owner})")]
    AlreadyReserved {
        /// Host name or `port N`.
        target: String,
        /// The API key id that holds it.
        owner: String,
    },
    /// The port is outside the edge's TCP range.
    #[error("port {port} is outside the edge's TCP port range {range}")]
    PortOutOfRange {
        /// The port asked for.
        port: u16,
        /// The edge's range.
        range: PortRange,
    },
    /// Another program of the edge's host listens on the port.
    #[error("port {port} is in use on the edge's host by another program")]
    PortInUse {
        /// The port asked for.
        port: u16,
    },
    /// Every port of the range is reserved.
    #[error("every port of the edge's TCP port range {range} is reserved")]
    NoFreePort {
        /// The edge's range.
        range: PortRange,
    },
    /// PostgreSQL answered with an error.
    #[error("database error: {0}")]
    Postgres(String),
    /// The database cannot be reached (PostgreSQL down, network, TLS).
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// `--store` (or a migration's target) is not usable as given.
    #[error("{0}")]
    BadLocation(String),
    /// A transaction met a concurrent one (PostgreSQL); tried again by the engine.
    #[error("conflict with a concurrent change: {0}")]
    Retry(String),
    /// Nothing with this id, name or port.
    #[error("{what} does not exist")]
    NotFound {
        /// What was looked for, e.g. `tunnel key tk_0123456789ab`.
        what: String,
    },
    /// Revoking this key would leave the edge without an admin key.
    #[error("{id} is the last admin key")]
    LastAdminKey {
        /// The key's id.
        id: String,
    },
}

impl StoreError {
    /// Static category for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            StoreError::Sqlite(_) => "sqlite",
            StoreError::Io { .. } => "io",
            StoreError::NewerSchema { .. } | StoreError::NewerPostgresSchema { .. } => "newer_schema",
            StoreError::Random => "random",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::AlreadyReserved { .. } => "already_reserved",
            StoreError::QuotaExceeded { .. } => "quota_exceeded",
            StoreError::PortOutOfRange { .. } => "port_out_of_range",
            StoreError::PortInUse { .. } => "port_in_use",
            StoreError::NoFreePort { .. } => "no_free_port",
            StoreError::Postgres(_) => "postgres",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Retry(_) => "conflict",
            StoreError::BadLocation(_) => "bad_location",
            StoreError::NotFound { .. } => "not_found",
            StoreError::LastAdminKey { .. } => "last_admin_key",
        }
    }
}

/// What every engine does; the three concerns are [`Keys`], [`Reservations`]
/// and [`Certificates`]. Calls are synchronous and may block (on a lock, a
/// disk or the network): the edge makes them through [`Store`], which runs
/// them on tokio's blocking pool, never on the threads that serve requests.
pub trait Engine: Keys + Reservations + Certificates + Send + Sync + 'static {
    /// `sqlite` or `postgres`.
    fn kind(&self) -> &'static str;

    /// Schema version of the open database.
    fn schema_version(&self) -> Result<u32, StoreError>;

    /// Calls `on_change` whenever another process (edge) changed the store,
    /// and once after each (re)connection, until `stop`. Engines of one edge
    /// only (SQLite) have no feed and never call it.
    fn watch(&self, _on_change: ChangeCallback, _stop: CancellationToken) {}

    /// Takes (or renews) the lease `name` for `holder` until `now + ttl`;
    /// `false` while another holder's lease has not expired.
    fn try_lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError>;

    /// Gives the lease up, if `holder` has it.
    fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError>;

    /// Every row, secret hashes included (for `culvert edge migrate-store`).
    fn export(&self) -> Result<Snapshot, StoreError>;

    /// Writes a snapshot into an empty store, in one transaction.
    fn import(&self, snapshot: &Snapshot) -> Result<(), StoreError>;
}

/// Called by an engine's change feed (from its own thread).
pub type ChangeCallback = Arc<dyn Fn() + Send + Sync>;

/// Every row of a store, as [`Engine::export`] reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub api_keys: Vec<ApiKeyRow>,
    pub reservations: Vec<Reservation>,
    pub tunnel_keys: Vec<TunnelKeyRow>,
    /// `(directory, credentials JSON, created_at)`.
    pub acme_accounts: Vec<(String, String, String)>,
    pub certificates: Vec<CertificateRecord>,
}

/// An API key with its secret hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyRow {
    pub key: ApiKey,
    pub secret_hash: String,
}

/// A tunnel key with its secret hash and creator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelKeyRow {
    pub key: TunnelKey,
    pub secret_hash: String,
    pub created_by: String,
}

/// Where the store lives: `--store`, or the SQLite file of `--data-dir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// `<data dir>/culvert.db`.
    Sqlite(PathBuf),
    /// A PostgreSQL URL (`postgres://…`).
    Postgres(String),
}

impl Location {
    /// `--store` if given (a `postgres://` or `postgresql://` URL, or
    /// `sqlite` for the default), else the SQLite file of `data_dir`.
    pub fn parse(store: Option<&str>, data_dir: &Path) -> Result<Location, StoreError> {
        match store.map(str::trim) {
            None | Some("") | Some("sqlite") => Ok(Location::Sqlite(data_dir.to_path_buf())),
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Ok(Location::Postgres(url.to_string()))
            }
            Some(other) => Err(StoreError::BadLocation(format!(
                "--store {:?} is neither sqlite nor a postgres:// URL; give postgres://USER:PASSWORD@HOST:PORT/DATABASE (or leave it out for the SQLite file in --data-dir)",
                pg::redact(other)
            ))),
        }
    }
}

/// The edge's store: one [`Engine`] behind a cheap `Clone`. The `async`
/// methods run the engine's call on tokio's blocking pool; the engine itself
/// ([`Store::engine`]) is for code that is already off the runtime.
#[derive(Clone)]
pub struct Store {
    engine: Arc<dyn Engine>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("engine", &self.engine.kind()).finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating if needed) `<dir>/culvert.db`.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        Ok(Store { engine: Arc::new(Sqlite::open(dir)?) })
    }

    /// Opens the store at `location`, applying pending migrations.
    pub fn open_location(location: &Location) -> Result<Store, StoreError> {
        Ok(match location {
            Location::Sqlite(dir) => Store::open(dir)?,
            Location::Postgres(url) => Store { engine: Arc::new(pg::Postgres::open(url)?) },
        })
    }

    /// The engine, for synchronous callers that are not on a runtime thread.
    pub fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    /// Runs `call` on the blocking pool.
    pub async fn run<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Engine) -> Result<T, StoreError> + Send + 'static,
    {
        let engine = self.engine.clone();
        match tokio::task::spawn_blocking(move || call(&*engine)).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(StoreError::Unavailable(format!("the store call was cancelled: {e}"))),
        }
    }

    /// `sqlite` or `postgres`.
    pub fn kind(&self) -> &'static str {
        self.engine.kind()
    }

    /// Starts the engine's change feed (see [`Engine::watch`]).
    pub fn watch(&self, on_change: ChangeCallback, stop: CancellationToken) {
        self.engine.watch(on_change, stop)
    }

    /// [`Reservations::reserve_usable_port`] off the runtime threads.
    pub async fn reserve_usable_port(
        &self,
        port: Option<u16>,
        protocol: crate::api::PortProtocol,
        range: PortRange,
        owner: &str,
        labels: &Labels,
        usable: impl Fn(u16) -> bool + Send + 'static,
    ) -> Result<(Reservation, bool), StoreError> {
        let (owner, labels) = (owner.to_string(), labels.clone());
        self.run(move |e| e.reserve_usable_port(port, protocol, range, &owner, &labels, &usable)).await
    }
}

/// The engine's calls, each run on the blocking pool (see the traits for what they do).
impl Store {
    // Keys
    pub async fn ensure_admin_key(&self) -> Result<Option<String>, StoreError> {
        self.run(move |e| e.ensure_admin_key()).await
    }

    pub async fn create_api_key(
        &self,
        name: &str,
        scope: ApiKeyScope,
        custom_domains: &[String],
        quota: QuotaUpdate,
    ) -> Result<(ApiKey, String), StoreError> {
        let name = name.to_string();
        let custom_domains = custom_domains.to_vec();
        self.run(move |e| e.create_api_key_with(&name, scope, &custom_domains, &quota)).await
    }

    pub async fn update_api_key_quota(&self, id: &str, quota: QuotaUpdate) -> Result<ApiKey, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.update_api_key_quota(&id, &quota)).await
    }

    pub async fn set_api_key_custom_domains(
        &self,
        id: &str,
        custom_domains: Vec<String>,
    ) -> Result<ApiKey, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.set_api_key_custom_domains(&id, &custom_domains)).await
    }

    pub async fn api_keys(&self) -> Result<Vec<ApiKey>, StoreError> {
        self.run(move |e| e.api_keys()).await
    }

    pub async fn api_key(&self, id: &str) -> Result<Option<ApiKey>, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.api_key(&id)).await
    }

    pub async fn revoke_api_key(&self, id: &str) -> Result<ApiKey, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.revoke_api_key(&id)).await
    }

    pub async fn authenticate_api_key(&self, secret: &str) -> Result<ApiKeyAuth, StoreError> {
        let secret = secret.to_string();
        self.run(move |e| e.authenticate_api_key(&secret)).await
    }

    pub async fn authenticate_tunnel_key(&self, secret: &str) -> Result<TunnelKeyAuth, StoreError> {
        let secret = secret.to_string();
        self.run(move |e| e.authenticate_tunnel_key(&secret)).await
    }

    pub async fn create_tunnel_key(
        &self,
        reservation_id: &str,
        protocol: Protocol,
        labels: &Labels,
        created_by: &str,
    ) -> Result<(TunnelKey, String), StoreError> {
        let reservation_id = reservation_id.to_string();
        let labels = labels.clone();
        let created_by = created_by.to_string();
        self.run(move |e| e.create_tunnel_key(&reservation_id, protocol, &labels, &created_by)).await
    }

    pub async fn tunnel_keys(&self, include_revoked: bool) -> Result<Vec<TunnelKey>, StoreError> {
        self.run(move |e| e.tunnel_keys(include_revoked)).await
    }

    pub async fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.tunnel_key(&id)).await
    }

    pub async fn revoke_tunnel_key(&self, id: &str) -> Result<TunnelKey, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.revoke_tunnel_key(&id)).await
    }

    pub async fn live_tunnel_key_ids(&self) -> Result<HashSet<String>, StoreError> {
        self.run(move |e| e.live_tunnel_key_ids()).await
    }

    // Reservations
    pub async fn reserve_domain(
        &self,
        kind: ReservationKind,
        hostname: &str,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        let hostname = hostname.to_string();
        let owner = owner.to_string();
        let labels = labels.clone();
        self.run(move |e| e.reserve_domain(kind, &hostname, &owner, &labels)).await
    }

    pub async fn reserve_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        let owner = owner.to_string();
        let labels = labels.clone();
        self.run(move |e| e.reserve_port(port, range, &owner, &labels)).await
    }

    pub async fn reservations(&self) -> Result<Vec<Reservation>, StoreError> {
        self.run(move |e| e.reservations()).await
    }

    pub async fn reservation_by_hostname(&self, hostname: &str) -> Result<Option<Reservation>, StoreError> {
        let hostname = hostname.to_string();
        self.run(move |e| e.reservation_by_hostname(&hostname)).await
    }

    pub async fn reservation_by_port(&self, port: u16) -> Result<Option<Reservation>, StoreError> {
        self.run(move |e| e.reservation_by_port(port)).await
    }

    pub async fn reservation_by_port_of(
        &self,
        port: u16,
        protocol: crate::api::PortProtocol,
    ) -> Result<Option<Reservation>, StoreError> {
        self.run(move |e| e.reservation_by_port_of(port, protocol)).await
    }

    pub async fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.reservation(&id)).await
    }

    pub async fn set_idle_timeout(&self, id: &str, seconds: Option<u64>) -> Result<Reservation, StoreError> {
        let id = id.to_string();
        self.run(move |e| e.set_idle_timeout(&id, seconds)).await
    }

    pub async fn release_reservation(&self, id: &str) -> Result<(Reservation, Vec<String>), StoreError> {
        let id = id.to_string();
        self.run(move |e| e.release_reservation(&id)).await
    }

    // Certificates
    pub async fn acme_account(&self, directory: &str) -> Result<Option<String>, StoreError> {
        let directory = directory.to_string();
        self.run(move |e| e.acme_account(&directory)).await
    }

    pub async fn put_acme_account(&self, directory: &str, credentials: &str) -> Result<String, StoreError> {
        let directory = directory.to_string();
        let credentials = credentials.to_string();
        self.run(move |e| e.put_acme_account(&directory, &credentials)).await
    }

    pub async fn certificates(&self) -> Result<Vec<CertificateRecord>, StoreError> {
        self.run(move |e| e.certificates()).await
    }

    pub async fn certificate(&self, hostname: &str) -> Result<Option<CertificateRecord>, StoreError> {
        let hostname = hostname.to_string();
        self.run(move |e| e.certificate(&hostname)).await
    }

    pub async fn put_certificate(&self, c: &CertificateRecord) -> Result<bool, StoreError> {
        let c = c.clone();
        self.run(move |e| e.put_certificate(&c)).await
    }

    pub async fn delete_certificate(&self, hostname: &str) -> Result<(), StoreError> {
        let hostname = hostname.to_string();
        self.run(move |e| e.delete_certificate(&hostname)).await
    }

    pub async fn put_challenge(&self, c: &Challenge) -> Result<(), StoreError> {
        let c = c.clone();
        self.run(move |e| e.put_challenge(&c)).await
    }

    pub async fn challenge(&self, kind: ChallengeKind, name: &str) -> Result<Option<String>, StoreError> {
        let name = name.to_string();
        self.run(move |e| e.challenge(kind, &name)).await
    }

    pub async fn delete_challenge(&self, kind: ChallengeKind, name: &str) -> Result<(), StoreError> {
        let name = name.to_string();
        self.run(move |e| e.delete_challenge(kind, &name)).await
    }

    // Engine
    pub async fn try_lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let name = name.to_string();
        let holder = holder.to_string();
        self.run(move |e| e.try_lease(&name, &holder, ttl)).await
    }

    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        let name = name.to_string();
        let holder = holder.to_string();
        self.run(move |e| e.release_lease(&name, &holder)).await
    }
}

/// The embedded engine: one SQLite connection behind a mutex.
///
/// - WAL journal with `synchronous=FULL`: every committed change survives a
///   `kill -9` or a power cut (control-plane writes are rare, so the extra
///   fsync is cheap).
/// - The schema is versioned with `PRAGMA user_version`; [`MIGRATIONS`] are
///   applied in order at open, each in its own transaction. A database from a
///   newer culvert is refused rather than guessed at.
pub struct Sqlite {
    conn: Mutex<Connection>,
}

impl Sqlite {
    /// Opens (creating if needed) `<dir>/culvert.db`, switches it to WAL and
    /// applies pending migrations. The directory is created if missing.
    pub fn open(dir: &Path) -> Result<Sqlite, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.into(), source })?;
        let path = dir.join(DB_FILE);
        let mut conn = Connection::open(&path)?;
        restrict_permissions(&path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt(format!(
                "{} cannot use write-ahead logging (journal mode is {mode})",
                path.display()
            )));
        }
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn, &path)?;
        Ok(Sqlite { conn: Mutex::new(conn) })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock rolled its transaction back on
        // unwind; the connection itself is still usable.
        self.conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Engine for Sqlite {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn schema_version(&self) -> Result<u32, StoreError> {
        Ok(self.lock().query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    fn try_lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let now = unix_now() as i64;
        let changed = self.lock().execute(
            "INSERT INTO leases (name, holder, expires_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
             WHERE leases.holder = excluded.holder OR leases.expires_at <= ?4",
            params![name, holder, now + ttl.as_secs() as i64, now],
        )?;
        Ok(changed == 1)
    }

    fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        self.lock().execute("DELETE FROM leases WHERE name = ?1 AND holder = ?2", params![name, holder])?;
        Ok(())
    }

    fn export(&self) -> Result<Snapshot, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let snapshot = sqlite_export(&tx)?;
        tx.commit()?;
        Ok(snapshot)
    }

    fn import(&self, _snapshot: &Snapshot) -> Result<(), StoreError> {
        Err(StoreError::BadLocation("importing into SQLite is not supported: migrate to PostgreSQL".into()))
    }
}

fn sqlite_export(tx: &rusqlite::Transaction<'_>) -> Result<Snapshot, StoreError> {
    let mut s = Snapshot::default();
    {
        let mut stmt = tx.prepare(&format!(
            "SELECT {}, secret_hash FROM api_keys ORDER BY rowid",
            keys::API_KEY_COLUMNS
        ))?;
        s.api_keys = stmt
            .query_map([], |r| Ok(ApiKeyRow { key: keys::api_key_from_row(r)?, secret_hash: r.get(9)? }))?
            .collect::<Result<_, _>>()?;
        let mut stmt = tx.prepare(&format!(
            "SELECT {} FROM reservations ORDER BY rowid",
            reservations::RESERVATION_COLUMNS
        ))?;
        s.reservations = stmt.query_map([], reservations::reservation_from_row)?.collect::<Result<_, _>>()?;
        let mut stmt = tx.prepare(&format!(
            "SELECT {}, secret_hash, created_by FROM tunnel_keys ORDER BY rowid",
            keys::TUNNEL_KEY_COLUMNS
        ))?;
        s.tunnel_keys = stmt
            .query_map([], |r| {
                Ok(TunnelKeyRow {
                    key: keys::tunnel_key_from_row(r)?,
                    secret_hash: r.get(10)?,
                    created_by: r.get(11)?,
                })
            })?
            .collect::<Result<_, _>>()?;
        let mut stmt =
            tx.prepare("SELECT directory, credentials, created_at FROM acme_accounts ORDER BY directory")?;
        s.acme_accounts =
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect::<Result<_, _>>()?;
        let mut stmt = tx.prepare(&format!(
            "SELECT {} FROM certificates ORDER BY hostname",
            certificates::CERTIFICATE_COLUMNS
        ))?;
        s.certificates = stmt.query_map([], certificates::certificate_from_row)?.collect::<Result<_, _>>()?;
    }
    Ok(s)
}

fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let supported = MIGRATIONS.len() as u32;
    loop {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Exclusive)?;
        let version: u32 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > supported {
            return Err(StoreError::NewerSchema { path: path.into(), found: version, supported });
        }
        let Some(sql) = MIGRATIONS.get(version as usize) else {
            return Ok(());
        };
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", version + 1)?;
        tx.commit()?;
        tracing::info!(version = version + 1, "store schema migrated");
    }
}

fn restrict_permissions(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|source| StoreError::Io { path: path.into(), source })
}

/// Runs `insert` with fresh `<prefix><12 hex>` ids until one is not taken
/// (48 random bits: a retry is already unlikely).
fn insert_with_fresh_id(
    prefix: &str,
    insert: impl Fn(&str) -> rusqlite::Result<usize>,
) -> Result<String, StoreError> {
    let mut last = None;
    for _ in 0..8 {
        let id = fresh_id(prefix)?;
        match insert(&id) {
            Ok(_) => return Ok(id),
            Err(e) if is_primary_key_conflict(&e) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last.map(StoreError::from).unwrap_or(StoreError::Random))
}

/// `<prefix><12 hex>`: 48 random bits.
fn fresh_id(prefix: &str) -> Result<String, StoreError> {
    Ok(format!("{prefix}{}", hex(&random_bytes::<6>()?)))
}

/// The owner of an existing reservation asking again gets it back
/// (`false`: not created); anyone else is refused.
fn held_by(existing: Reservation, owner: &str) -> Result<(Reservation, bool), StoreError> {
    if existing.owner == owner {
        Ok((existing, false))
    } else {
        Err(StoreError::AlreadyReserved { target: existing.target(), owner: existing.owner })
    }
}

fn is_primary_key_conflict(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(f, _)
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY
    )
}

fn invalid(column: usize, message: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(column, Type::Text, message.into())
}

fn port_column(row: &Row<'_>, column: usize) -> rusqlite::Result<Option<u16>> {
    match row.get::<_, Option<i64>>(column)? {
        None => Ok(None),
        Some(p) => u16::try_from(p).map(Some).map_err(|_| invalid(column, format!("port {p} out of range"))),
    }
}

fn labels_column(row: &Row<'_>, column: usize) -> rusqlite::Result<Labels> {
    let json: String = row.get(column)?;
    serde_json::from_str(&json).map_err(|e| invalid(column, format!("labels are not a JSON object: {e}")))
}

fn labels_to_json(labels: &Labels) -> Result<String, StoreError> {
    serde_json::to_string(labels).map_err(|e| StoreError::Corrupt(format!("labels: {e}")))
}

fn random_bytes<const N: usize>() -> Result<[u8; N], StoreError> {
    crate::random_bytes().map_err(|_| StoreError::Random)
}

/// A new secret: `prefix` + 64 hex digits of 32 random bytes.
fn new_secret(prefix: &str) -> Result<String, StoreError> {
    Ok(format!("{prefix}{}", hex(&random_bytes::<32>()?)))
}

/// What the edge keeps in memory to recognise a secret it has seen (the
/// same SHA-256 as the store's).
pub fn secret_digest(secret: &str) -> String {
    hash_secret(secret.trim())
}

/// SHA-256 of the whole secret (prefix included), hex.
fn hash_secret(secret: &str) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, secret.as_bytes()).as_ref())
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The current time as RFC 3339 UTC with seconds, e.g. `2025-01-31T12:00:00Z`.
pub fn now_rfc3339() -> String {
    rfc3339(unix_now())
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// RFC 3339 UTC with seconds, e.g. `2025-01-31T12:00:00Z`. Past the year
/// 9999 (beyond jiff's range) it reads as `9999-12-31T23:59:59Z`.
pub fn rfc3339(unix_secs: u64) -> String {
    // Civil time rather than `Timestamp`: its range ends a day early.
    let at = i64::try_from(unix_secs)
        .ok()
        .and_then(|s| {
            jiff::civil::DateTime::constant(1970, 1, 1, 0, 0, 0, 0)
                .checked_add(jiff::SignedDuration::from_secs(s))
                .ok()
        })
        .unwrap_or(jiff::civil::DateTime::MAX);
    at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A real PostgreSQL for the store suite (shared with the integration tests).
#[cfg(test)]
#[path = "../../../tests/support/postgres.rs"]
pub(crate) mod test_postgres;

/// The store suite runs every test against both engines: [`both_engines!`]
/// makes `<test>::sqlite` and `<test>::postgres` of a `fn <test>(&TestStore)`.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// An engine under test, and how to open its database again.
    pub struct TestStore {
        pub store: Box<dyn Engine>,
        place: Place,
    }

    enum Place {
        Sqlite(tempfile::TempDir),
        Postgres(String),
    }

    impl TestStore {
        pub fn sqlite() -> TestStore {
            let dir = tempfile::tempdir().unwrap();
            TestStore { store: Box::new(Sqlite::open(dir.path()).unwrap()), place: Place::Sqlite(dir) }
        }

        /// `None` (skipped, said on stderr) without PostgreSQL, unless `CI` is set.
        pub fn postgres() -> Option<TestStore> {
            let url = super::test_postgres::Postgres::shared()?.fresh_database();
            Some(TestStore {
                store: Box::new(pg::Postgres::open(&url).unwrap()),
                place: Place::Postgres(url),
            })
        }

        /// The same database, opened again (a restart).
        pub fn reopen(&self) -> Result<Box<dyn Engine>, StoreError> {
            Ok(match &self.place {
                Place::Sqlite(dir) => Box::new(Sqlite::open(dir.path())?),
                Place::Postgres(url) => Box::new(pg::Postgres::open(url)?),
            })
        }

        /// Every byte the database holds, as far as a test can see it.
        pub fn raw(&self) -> Vec<u8> {
            match &self.place {
                Place::Sqlite(dir) => {
                    let mut all = std::fs::read(dir.path().join(DB_FILE)).unwrap_or_default();
                    all.extend(std::fs::read(dir.path().join(format!("{DB_FILE}-wal"))).unwrap_or_default());
                    all
                }
                Place::Postgres(url) => {
                    let mut c = ::postgres::Client::connect(url, ::postgres::NoTls).unwrap();
                    let mut all = Vec::new();
                    for table in ["api_keys", "reservations", "tunnel_keys", "acme_accounts", "certificates"]
                    {
                        for row in
                            c.query(&format!("SELECT row_to_json(t)::text FROM {table} t"), &[]).unwrap()
                        {
                            all.extend(row.get::<_, String>(0).into_bytes());
                        }
                    }
                    all
                }
            }
        }

        /// Pretends a newer culvert wrote the database.
        pub fn set_schema_version(&self, version: u32) {
            match &self.place {
                Place::Sqlite(dir) => {
                    let conn = Connection::open(dir.path().join(DB_FILE)).unwrap();
                    conn.pragma_update(None, "user_version", version).unwrap();
                }
                Place::Postgres(url) => {
                    let mut c = ::postgres::Client::connect(url, ::postgres::NoTls).unwrap();
                    c.execute("UPDATE culvert_schema SET version = $1", &[&(version as i32)]).unwrap();
                }
            }
        }
    }

    macro_rules! both_engines {
        ($($name:ident),* $(,)?) => {$(
            mod $name {
                #[test]
                fn sqlite() {
                    super::$name(&$crate::edge::store::testing::TestStore::sqlite());
                }

                #[test]
                fn postgres() {
                    if let Some(t) = $crate::edge::store::testing::TestStore::postgres() {
                        super::$name(&t);
                    }
                }
            }
        )*};
    }
    pub(crate) use both_engines;
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::testing::{TestStore, both_engines};
    use super::*;
    use crate::api::{ApiKey, ApiKeyScope, Protocol, ReservationKind};

    pub(super) fn range(first: u16, last: u16) -> PortRange {
        PortRange { first, last }
    }

    pub(super) fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    pub(super) fn admin(store: &dyn Engine) -> ApiKey {
        store.api_keys().unwrap().into_iter().find(|k| k.scope == ApiKeyScope::Admin).unwrap()
    }

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_735_689_599), "2024-12-31T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
        // What the hand-written calendar (replaced by jiff) answered.
        assert_eq!(rfc3339(86_399), "1970-01-01T23:59:59Z");
        assert_eq!(rfc3339(951_868_799), "2000-02-29T23:59:59Z");
        assert_eq!(rfc3339(1_000_000_000), "2001-09-09T01:46:40Z");
        assert_eq!(rfc3339(1_709_164_800), "2024-02-29T00:00:00Z");
        assert_eq!(rfc3339(2_147_483_647), "2038-01-19T03:14:07Z");
        assert_eq!(rfc3339(4_102_444_800), "2100-01-01T00:00:00Z");
        assert_eq!(rfc3339(253_402_300_799), "9999-12-31T23:59:59Z");
        // Past jiff's range.
        assert_eq!(rfc3339(253_402_300_800), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59Z");
    }

    both_engines!(
        migrates_and_refuses_newer_schema,
        durable_across_reopen,
        leases_expire_and_exclude,
        two_edges_race_and_one_wins
    );

    /// The UDP migration rebuilds SQLite's reservations and tunnel keys:
    /// every row stays, TCP as before, and the UDP port of the same number is free.
    #[test]
    fn sqlite_keeps_every_row_through_the_udp_migration() {
        use crate::api::PortProtocol;
        let dir = tempfile::tempdir().unwrap();
        {
            let conn = Connection::open(dir.path().join("culvert.db")).unwrap();
            // Every migration before the UDP one (the sixth).
            let before = 5;
            for sql in &MIGRATIONS[..before] {
                conn.execute_batch(sql).unwrap();
            }
            conn.pragma_update(None, "user_version", before as u32).unwrap();
            conn.execute_batch(
                "INSERT INTO api_keys (id, name, scope, secret_hash, created_at) VALUES ('ak_1', 'a', 'endpoints', 'h1', 't');
                 INSERT INTO reservations (id, kind, port, owner, created_at) VALUES ('rs_1', 'tcp', 20000, 'ak_1', 't');
                 INSERT INTO reservations (id, kind, hostname, owner, created_at) VALUES ('rs_2', 'subdomain', 'a.example.com', 'ak_1', 't');
                 INSERT INTO tunnel_keys (id, secret_hash, protocol, reservation_id, kind, port, owner, created_by, created_at)
                     VALUES ('tk_1', 'h2', 'tcp', 'rs_1', 'tcp', 20000, 'ak_1', 'ak_1', 't');",
            )
            .unwrap();
        }
        let store = Sqlite::open(dir.path()).unwrap();
        assert_eq!(store.schema_version().unwrap(), MIGRATIONS.len() as u32);
        let r = store.reservation_by_port(20000).unwrap().unwrap();
        assert_eq!((r.id.as_str(), r.protocol), ("rs_1", PortProtocol::Tcp));
        assert!(store.reservation_by_hostname("a.example.com").unwrap().is_some());
        let keys = store.tunnel_keys(false).unwrap();
        assert_eq!(keys.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(), ["tk_1"]);
        let range = PortRange { first: 20000, last: 20000 };
        let (udp, created) = store
            .reserve_usable_port(Some(20000), PortProtocol::Udp, range, "ak_1", &Labels::new(), &|_| true)
            .unwrap();
        assert!(created && udp.protocol == PortProtocol::Udp);
    }

    fn migrates_and_refuses_newer_schema(t: &TestStore) {
        let supported = match t.store.kind() {
            "sqlite" => MIGRATIONS.len() as u32,
            _ => pg::MIGRATIONS.len() as u32,
        };
        assert_eq!(t.store.schema_version().unwrap(), supported);
        // Opening again applies nothing and keeps the version.
        assert_eq!(t.reopen().unwrap().schema_version().unwrap(), supported);
        t.set_schema_version(99);
        let err = t.reopen().err().unwrap();
        assert_eq!(err.category(), "newer_schema", "{err}");
        assert!(err.to_string().contains("newer culvert"), "{err}");
    }

    fn durable_across_reopen(t: &TestStore) {
        let store = &*t.store;
        let admin_secret = store.ensure_admin_key().unwrap().unwrap();
        let owner = admin(store).id;
        let (d, _) = store
            .reserve_domain(ReservationKind::Custom, "app.example.org", &owner, &labels(&[("ns", "web")]))
            .unwrap();
        let (p, _) = store.reserve_port(None, range(20000, 20010), &owner, &Labels::new()).unwrap();
        let (tk, tk_secret) =
            store.create_tunnel_key(&p.id, Protocol::Tcp, &labels(&[("uid", "1")]), &owner).unwrap();
        let (gone, gone_secret) =
            store.create_tunnel_key(&d.id, Protocol::Http, &Labels::new(), &owner).unwrap();
        store.revoke_tunnel_key(&gone.id).unwrap();
        // SQLite: like kill -9, the connection is never closed, the WAL never
        // checkpointed. PostgreSQL: another edge opens the same database.
        let store = t.reopen().unwrap();
        assert_eq!(store.ensure_admin_key().unwrap(), None);
        assert!(matches!(store.authenticate_api_key(&admin_secret).unwrap(), ApiKeyAuth::Valid(_)));
        assert_eq!(store.reservations().unwrap(), vec![d.clone(), p.clone()]);
        assert!(
            matches!(store.authenticate_tunnel_key(&tk_secret).unwrap(), TunnelKeyAuth::Valid(g) if g.reservation == p)
        );
        assert!(matches!(store.authenticate_tunnel_key(&gone_secret).unwrap(), TunnelKeyAuth::Revoked));
        assert_eq!(store.live_tunnel_key_ids().unwrap(), HashSet::from([tk.id.clone()]));
        assert_eq!(store.tunnel_key(&tk.id).unwrap().unwrap().labels, labels(&[("uid", "1")]));
    }

    fn leases_expire_and_exclude(t: &TestStore) {
        let store = &*t.store;
        let ttl = Duration::from_secs(60);
        assert!(store.try_lease("acme:app.example.org", "edge-a", ttl).unwrap());
        assert!(!store.try_lease("acme:app.example.org", "edge-b", ttl).unwrap(), "held by edge-a");
        assert!(store.try_lease("acme:app.example.org", "edge-a", ttl).unwrap(), "the holder renews");
        assert!(store.try_lease("acme:other.example.org", "edge-b", ttl).unwrap(), "one lease per name");
        store.release_lease("acme:app.example.org", "edge-b").unwrap();
        assert!(!store.try_lease("acme:app.example.org", "edge-b", ttl).unwrap(), "only the holder releases");
        store.release_lease("acme:app.example.org", "edge-a").unwrap();
        assert!(store.try_lease("acme:app.example.org", "edge-b", ttl).unwrap());
        // An expired lease is anyone's.
        assert!(store.try_lease("acme:x", "edge-a", Duration::ZERO).unwrap());
        assert!(store.try_lease("acme:x", "edge-b", ttl).unwrap());
    }

    /// Two connections (two edges) race for the same things, many times:
    /// exactly one wins each race.
    fn two_edges_race_and_one_wins(t: &TestStore) {
        let (a, b) = (t.reopen().unwrap(), t.reopen().unwrap());
        a.ensure_admin_key().unwrap();
        let (ka, _) = a.create_api_key("a", ApiKeyScope::Endpoints).unwrap();
        let (kb, _) = b.create_api_key("b", ApiKeyScope::Endpoints).unwrap();
        let none = Labels::new();
        type Reserve<'a> = &'a (dyn Fn(&dyn Engine) -> Result<(Reservation, bool), StoreError> + Sync);
        let race = |fa: Reserve<'_>, fb: Reserve<'_>| {
            let barrier = std::sync::Barrier::new(2);
            let (ra, rb) = std::thread::scope(|s| {
                let ha = s.spawn(|| {
                    barrier.wait();
                    fa(&*a)
                });
                let hb = s.spawn(|| {
                    barrier.wait();
                    fb(&*b)
                });
                (ha.join().unwrap(), hb.join().unwrap())
            });
            let wins = [&ra, &rb].iter().filter(|r| matches!(r, Ok((_, true)))).count();
            assert_eq!(wins, 1, "exactly one wins: {ra:?} / {rb:?}");
            let loser = if ra.is_ok() { rb } else { ra };
            loser.unwrap_err().category()
        };
        for round in 0..10 {
            let name = format!("race{round}.example.com");
            let lost = race(&|e| e.reserve_domain(ReservationKind::Subdomain, &name, &ka.id, &none), &|e| {
                e.reserve_domain(ReservationKind::Subdomain, &name, &kb.id, &none)
            });
            assert_eq!(lost, "already_reserved");
            let port = 21000 + round;
            let lost = race(&|e| e.reserve_port(Some(port), range(21000, 21100), &ka.id, &none), &|e| {
                e.reserve_port(Some(port), range(21000, 21100), &kb.id, &none)
            });
            assert_eq!(lost, "already_reserved");
            // The last free port of a range: one gets it, the other finds none.
            let last = 22000 + round;
            let lost = race(&|e| e.reserve_port(None, range(last, last), &ka.id, &none), &|e| {
                e.reserve_port(None, range(last, last), &kb.id, &none)
            });
            assert_eq!(lost, "no_free_port");
        }
        let ports: Vec<u16> = a.reservations().unwrap().iter().filter_map(|r| r.port).collect();
        assert_eq!(ports.len(), 20, "{ports:?}");

        // Two admin keys, each edge revokes one at the same time: one stays.
        for _ in 0..5 {
            let (x, _) = a.create_api_key("x", ApiKeyScope::Admin).unwrap();
            for k in a.api_keys().unwrap() {
                if k.scope == ApiKeyScope::Admin && k.id != x.id && k.revoked_at.is_none() {
                    let y = k.id;
                    let barrier = std::sync::Barrier::new(2);
                    let (ra, rb) = std::thread::scope(|s| {
                        let ha = s.spawn(|| {
                            barrier.wait();
                            a.revoke_api_key(&x.id)
                        });
                        let hb = s.spawn(|| {
                            barrier.wait();
                            b.revoke_api_key(&y)
                        });
                        (ha.join().unwrap(), hb.join().unwrap())
                    });
                    assert_eq!(ra.is_ok() as u8 + rb.is_ok() as u8, 1, "{ra:?} / {rb:?}");
                    let err = ra.err().or(rb.err()).unwrap();
                    assert_eq!(err.category(), "last_admin_key", "{err}");
                    break;
                }
            }
            let live = a
                .api_keys()
                .unwrap()
                .iter()
                .filter(|k| k.scope == ApiKeyScope::Admin && k.revoked_at.is_none())
                .count();
            assert_eq!(live, 1);
        }
    }
}
