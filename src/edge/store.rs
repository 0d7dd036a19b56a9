//! The edge's state: API keys, reservations (domains, TCP ports) and tunnel
//! keys in one embedded SQLite database, `<data dir>/culvert.db`.
//!
//! - WAL journal with `synchronous=FULL`: every committed change survives a
//!   `kill -9` or a power cut (control-plane writes are rare, so the extra
//!   fsync is cheap).
//! - The schema is versioned with `PRAGMA user_version`; [`MIGRATIONS`] are
//!   applied in order at open, each in its own transaction. A database from a
//!   newer culvert is refused rather than guessed at.
//! - Secrets are 32 random bytes shown once, rendered as a type prefix
//!   ([`ADMIN_KEY_PREFIX`], [`ENDPOINTS_KEY_PREFIX`], [`TUNNEL_KEY_PREFIX`])
//!   plus 64 hex digits; only their SHA-256 is stored and keys are looked up
//!   by that hash. Every key also has a short public id (`ak_…`, `tk_…`) to
//!   list and revoke it by.
//! - Revoked keys keep their row (marked `revoked_at`), so the edge can tell
//!   "revoked" from "unknown". Releasing a reservation deletes it (the name is
//!   free again) and revokes its tunnel keys.
//!
//! Calls are short and synchronous; [`Store`] is a cheap `Clone` around one
//! connection behind a mutex.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::types::Type;
use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};

use crate::api::PortRange;
use crate::api::{
    ApiKey, ApiKeyScope, CertificateState, CertificateStatus, Labels, Protocol, Reservation, ReservationKind,
    ReservationRef, TunnelKey,
};
use crate::constants::RENEW_BEFORE_EXPIRY;

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
    /// The system random generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// A row holds something this binary cannot read.
    #[error("the database holds an invalid record: {0}")]
    Corrupt(String),
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
            StoreError::NewerSchema { .. } => "newer_schema",
            StoreError::Random => "random",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::AlreadyReserved { .. } => "already_reserved",
            StoreError::PortOutOfRange { .. } => "port_out_of_range",
            StoreError::PortInUse { .. } => "port_in_use",
            StoreError::NoFreePort { .. } => "no_free_port",
            StoreError::NotFound { .. } => "not_found",
            StoreError::LastAdminKey { .. } => "last_admin_key",
        }
    }
}

/// Result of presenting a tunnel key to the edge.
#[derive(Debug, Clone)]
pub enum TunnelKeyAuth {
    /// A live key of an existing reservation.
    Valid(TunnelGrant),
    /// No such key.
    Unknown,
    /// The key was revoked (or its reservation released).
    Revoked,
    /// The secret is an API key (admin or endpoints), which cannot carry traffic.
    NotATunnelKey,
}

/// What a valid tunnel key may open.
#[derive(Debug, Clone)]
pub struct TunnelGrant {
    /// The tunnel key's public id (`tk_…`).
    pub key_id: String,
    /// What the key publishes.
    pub protocol: Protocol,
    /// The reservation it publishes.
    pub reservation: Reservation,
}

/// Result of presenting an API key to the control API.
#[derive(Debug, Clone)]
pub enum ApiKeyAuth {
    /// A live API key.
    Valid(ApiKey),
    /// No such key.
    Unknown,
    /// The key was revoked.
    Revoked(ApiKey),
    /// The secret is a tunnel key, which has no API access.
    TunnelKey,
}

/// The edge's database. Cheap to clone; calls are short and synchronous.
#[derive(Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating if needed) `<dir>/culvert.db`, switches it to WAL and
    /// applies pending migrations. The directory is created if missing.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
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
        Ok(Store { conn: Arc::new(Mutex::new(conn)) })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock rolled its transaction back on
        // unwind; the connection itself is still usable.
        self.conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Schema version of the open database.
    pub fn schema_version(&self) -> Result<u32, StoreError> {
        Ok(self.lock().query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    /// Creates an admin key if there is no live one (the first start) and
    /// returns its secret, once. `None` when an admin key already exists.
    pub fn ensure_admin_key(&self) -> Result<Option<String>, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let live: i64 = tx.query_row(
            "SELECT count(*) FROM api_keys WHERE scope = 'admin' AND revoked_at IS NULL",
            [],
            |r| r.get(0),
        )?;
        if live > 0 {
            return Ok(None);
        }
        let (_, secret) = insert_api_key(&tx, INITIAL_ADMIN_KEY_NAME, ApiKeyScope::Admin)?;
        tx.commit()?;
        Ok(Some(secret))
    }

    /// Makes an API key; returns it and its secret (shown once).
    pub fn create_api_key(&self, name: &str, scope: ApiKeyScope) -> Result<(ApiKey, String), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let made = insert_api_key(&tx, name, scope)?;
        tx.commit()?;
        Ok(made)
    }

    /// Every API key, revoked ones included, oldest first.
    pub fn api_keys(&self) -> Result<Vec<ApiKey>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys ORDER BY rowid"))?;
        let keys = stmt.query_map([], api_key_from_row)?.collect::<Result<_, _>>()?;
        Ok(keys)
    }

    /// One API key by id.
    pub fn api_key(&self, id: &str) -> Result<Option<ApiKey>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"),
                [id],
                api_key_from_row,
            )
            .optional()?)
    }

    /// Revokes an API key (idempotent). The last live admin key cannot be revoked.
    pub fn revoke_api_key(&self, id: &str) -> Result<ApiKey, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let key = tx
            .query_row(
                &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"),
                [id],
                api_key_from_row,
            )
            .optional()?
            .ok_or_else(|| StoreError::NotFound { what: format!("api key {id}") })?;
        if key.revoked_at.is_some() {
            return Ok(key);
        }
        if key.scope == ApiKeyScope::Admin {
            let others: i64 = tx.query_row(
                "SELECT count(*) FROM api_keys WHERE scope = 'admin' AND revoked_at IS NULL AND id <> ?1",
                [id],
                |r| r.get(0),
            )?;
            if others == 0 {
                return Err(StoreError::LastAdminKey { id: id.to_string() });
            }
        }
        let now = now_rfc3339();
        tx.execute("UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1", params![id, now])?;
        tx.commit()?;
        Ok(ApiKey { revoked_at: Some(now), ..key })
    }

    /// Looks an API key up by its secret.
    pub fn authenticate_api_key(&self, secret: &str) -> Result<ApiKeyAuth, StoreError> {
        let secret = secret.trim();
        if secret.starts_with(TUNNEL_KEY_PREFIX) {
            return Ok(ApiKeyAuth::TunnelKey);
        }
        let hash = hash_secret(secret);
        let conn = self.lock();
        let key = conn
            .query_row(
                &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE secret_hash = ?1"),
                [&hash],
                api_key_from_row,
            )
            .optional()?;
        Ok(match key {
            Some(key) if key.revoked_at.is_some() => ApiKeyAuth::Revoked(key),
            Some(key) => ApiKeyAuth::Valid(key),
            None => {
                let tunnel: Option<String> = conn
                    .query_row("SELECT id FROM tunnel_keys WHERE secret_hash = ?1", [&hash], |r| r.get(0))
                    .optional()?;
                if tunnel.is_some() { ApiKeyAuth::TunnelKey } else { ApiKeyAuth::Unknown }
            }
        })
    }

    /// Looks a tunnel key up by its secret: what it may open, or why not.
    /// An admin or endpoints key (by prefix or by hash) is `NotATunnelKey`.
    pub fn authenticate_tunnel_key(&self, secret: &str) -> Result<TunnelKeyAuth, StoreError> {
        let secret = secret.trim();
        if secret.starts_with(ADMIN_KEY_PREFIX) || secret.starts_with(ENDPOINTS_KEY_PREFIX) {
            return Ok(TunnelKeyAuth::NotATunnelKey);
        }
        let hash = hash_secret(secret);
        let conn = self.lock();
        let found = conn
            .query_row(
                "SELECT id, protocol, reservation_id, revoked_at FROM tunnel_keys WHERE secret_hash = ?1",
                [&hash],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, Option<String>>(3)?,
                    ))
                },
            )
            .optional()?;
        let Some((key_id, protocol, reservation_id, revoked_at)) = found else {
            let api: Option<String> = conn
                .query_row("SELECT id FROM api_keys WHERE secret_hash = ?1", [&hash], |r| r.get(0))
                .optional()?;
            return Ok(if api.is_some() { TunnelKeyAuth::NotATunnelKey } else { TunnelKeyAuth::Unknown });
        };
        if revoked_at.is_some() {
            return Ok(TunnelKeyAuth::Revoked);
        }
        let protocol = Protocol::parse(&protocol)
            .ok_or_else(|| StoreError::Corrupt(format!("tunnel key {key_id} has protocol {protocol:?}")))?;
        let reservation = conn
            .query_row(
                &format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = ?1"),
                [&reservation_id],
                reservation_from_row,
            )
            .optional()?;
        Ok(match reservation {
            Some(reservation) => TunnelKeyAuth::Valid(TunnelGrant { key_id, protocol, reservation }),
            // Releasing revokes the keys in the same transaction; treat a
            // stray one the same way.
            None => TunnelKeyAuth::Revoked,
        })
    }

    /// Reserves a host name for `owner`. Idempotent: if `owner` already holds
    /// it, answers the existing record (labels unchanged) and `false`.
    pub fn reserve_domain(
        &self,
        kind: ReservationKind,
        hostname: &str,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        if kind == ReservationKind::Tcp {
            return Err(StoreError::Corrupt("a tcp reservation has no host name".into()));
        }
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(existing) = select_reservation(&tx, "hostname = ?1", &hostname)? {
            return held_by(existing, owner);
        }
        let reservation = insert_reservation(&tx, kind, Some(hostname), None, owner, labels)?;
        tx.commit()?;
        Ok((reservation, true))
    }

    /// Reserves a TCP port for `owner`: `port` if given (it must be in
    /// `range`), else the lowest free one. Reserving a port `owner` already
    /// holds answers the existing record and `false`.
    pub fn reserve_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        self.reserve_usable_port(port, range, owner, labels, |_| true)
    }

    /// [`Store::reserve_port`] among the ports `usable` accepts (those the
    /// edge can listen on): a new reservation of an unusable port is
    /// `PortInUse`; a free port is taken only if it is usable.
    pub fn reserve_usable_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
        usable: impl Fn(u16) -> bool,
    ) -> Result<(Reservation, bool), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let port = match port {
            Some(port) => {
                if !range.contains(port) {
                    return Err(StoreError::PortOutOfRange { port, range });
                }
                if let Some(existing) = select_reservation(&tx, "port = ?1", &i64::from(port))? {
                    return held_by(existing, owner);
                }
                if !usable(port) {
                    return Err(StoreError::PortInUse { port });
                }
                port
            }
            None => lowest_free_port(&tx, range, usable)?.ok_or(StoreError::NoFreePort { range })?,
        };
        let reservation = insert_reservation(&tx, ReservationKind::Tcp, None, Some(port), owner, labels)?;
        tx.commit()?;
        Ok((reservation, true))
    }

    /// Every reservation: domains by host name, then ports in order.
    pub fn reservations(&self) -> Result<Vec<Reservation>, StoreError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare(&format!("SELECT {RESERVATION_COLUMNS} FROM reservations ORDER BY port, hostname"))?;
        let all = stmt.query_map([], reservation_from_row)?.collect::<Result<_, _>>()?;
        Ok(all)
    }

    /// The reservation of a host name.
    pub fn reservation_by_hostname(&self, hostname: &str) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "hostname = ?1", &hostname)
    }

    /// The reservation of a TCP port.
    pub fn reservation_by_port(&self, port: u16) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "port = ?1", &i64::from(port))
    }

    /// A reservation by id.
    pub fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "id = ?1", &id)
    }

    /// Releases a reservation: deletes it and revokes its live tunnel keys, in
    /// one transaction. Returns the released record and the revoked key ids.
    pub fn release_reservation(&self, id: &str) -> Result<(Reservation, Vec<String>), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let reservation = select_reservation(&tx, "id = ?1", &id)?
            .ok_or_else(|| StoreError::NotFound { what: format!("reservation {id}") })?;
        let revoked: Vec<String> = {
            let mut stmt = tx.prepare(
                "SELECT id FROM tunnel_keys WHERE reservation_id = ?1 AND revoked_at IS NULL ORDER BY rowid",
            )?;
            stmt.query_map([id], |r| r.get(0))?.collect::<Result<_, _>>()?
        };
        tx.execute(
            "UPDATE tunnel_keys SET revoked_at = ?2 WHERE reservation_id = ?1 AND revoked_at IS NULL",
            params![id, now_rfc3339()],
        )?;
        tx.execute("DELETE FROM reservations WHERE id = ?1", [id])?;
        // Releasing a custom domain stops its renewal and forgets its certificate.
        if let Some(hostname) = &reservation.hostname {
            tx.execute("DELETE FROM certificates WHERE hostname = ?1", [hostname])?;
        }
        tx.commit()?;
        Ok((reservation, revoked))
    }

    /// Mints a tunnel key for a reservation; returns it and its secret (shown
    /// once). The key's owner is the reservation's owner; `created_by` is the
    /// API key that asked. Checking that the protocol fits the reservation is
    /// the caller's job.
    pub fn create_tunnel_key(
        &self,
        reservation_id: &str,
        protocol: Protocol,
        labels: &Labels,
        created_by: &str,
    ) -> Result<(TunnelKey, String), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let reservation = select_reservation(&tx, "id = ?1", &reservation_id)?
            .ok_or_else(|| StoreError::NotFound { what: format!("reservation {reservation_id}") })?;
        let secret = new_secret(TUNNEL_KEY_PREFIX)?;
        let labels_json = labels_to_json(labels)?;
        let created_at = now_rfc3339();
        let id = insert_with_fresh_id("tk_", |id| {
            tx.execute(
                "INSERT INTO tunnel_keys (id, secret_hash, protocol, reservation_id, kind, hostname, port, owner, created_by, labels, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    id,
                    hash_secret(&secret),
                    protocol.as_str(),
                    reservation.id,
                    reservation.kind.as_str(),
                    reservation.hostname,
                    reservation.port.map(i64::from),
                    reservation.owner,
                    created_by,
                    labels_json,
                    created_at,
                ],
            )
        })?;
        tx.commit()?;
        let key = TunnelKey {
            id,
            protocol,
            reservation: ReservationRef::from(&reservation),
            labels: labels.clone(),
            owner: reservation.owner.clone(),
            created_at,
            revoked_at: None,
            connections: 0,
        };
        Ok((key, secret))
    }

    /// Tunnel keys, oldest first; revoked ones only if asked.
    pub fn tunnel_keys(&self, include_revoked: bool) -> Result<Vec<TunnelKey>, StoreError> {
        let conn = self.lock();
        let filter = if include_revoked { "" } else { "WHERE revoked_at IS NULL" };
        let mut stmt =
            conn.prepare(&format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys {filter} ORDER BY rowid"))?;
        let keys = stmt.query_map([], tunnel_key_from_row)?.collect::<Result<_, _>>()?;
        Ok(keys)
    }

    /// One tunnel key by id.
    pub fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                &format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys WHERE id = ?1"),
                [id],
                tunnel_key_from_row,
            )
            .optional()?)
    }

    /// Revokes a tunnel key (idempotent: revoking a revoked key answers it unchanged).
    pub fn revoke_tunnel_key(&self, id: &str) -> Result<TunnelKey, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let key = tx
            .query_row(
                &format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys WHERE id = ?1"),
                [id],
                tunnel_key_from_row,
            )
            .optional()?
            .ok_or_else(|| StoreError::NotFound { what: format!("tunnel key {id}") })?;
        if key.revoked_at.is_some() {
            return Ok(key);
        }
        let now = now_rfc3339();
        tx.execute("UPDATE tunnel_keys SET revoked_at = ?2 WHERE id = ?1", params![id, now])?;
        tx.commit()?;
        Ok(TunnelKey { revoked_at: Some(now), ..key })
    }

    /// Ids of all tunnel keys that are not revoked.
    pub fn live_tunnel_key_ids(&self) -> Result<HashSet<String>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT id FROM tunnel_keys WHERE revoked_at IS NULL")?;
        let ids = stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
        Ok(ids)
    }

    /// The stored ACME account credentials (JSON) for a directory URL.
    pub fn acme_account(&self, directory: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .lock()
            .query_row("SELECT credentials FROM acme_accounts WHERE directory = ?1", [directory], |r| {
                r.get(0)
            })
            .optional()?)
    }

    /// Keeps the ACME account credentials (JSON) for a directory URL.
    pub fn put_acme_account(&self, directory: &str, credentials: &str) -> Result<(), StoreError> {
        self.lock().execute(
            "INSERT INTO acme_accounts (directory, credentials, created_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (directory) DO UPDATE SET credentials = excluded.credentials",
            params![directory, credentials, now_rfc3339()],
        )?;
        Ok(())
    }

    /// Every certificate record, by host name.
    pub fn certificates(&self) -> Result<Vec<CertificateRecord>, StoreError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare(&format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates ORDER BY hostname"))?;
        let all = stmt.query_map([], certificate_from_row)?.collect::<Result<_, _>>()?;
        Ok(all)
    }

    /// The certificate record of one host name.
    pub fn certificate(&self, hostname: &str) -> Result<Option<CertificateRecord>, StoreError> {
        Ok(self
            .lock()
            .query_row(
                &format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates WHERE hostname = ?1"),
                [hostname],
                certificate_from_row,
            )
            .optional()?)
    }

    /// Writes a certificate record, but only while its host name is a
    /// reserved custom domain (an order that finishes after the release
    /// stores nothing), or for the edge's own wildcard `*.<domain>`.
    /// Returns whether it was written.
    pub fn put_certificate(&self, c: &CertificateRecord) -> Result<bool, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        // The edge's own wildcard (`*.<domain>`, DNS-01) is no reservation.
        let own = c.hostname.starts_with("*.");
        let reserved: i64 = tx.query_row(
            "SELECT count(*) FROM reservations WHERE hostname = ?1 AND kind = 'custom'",
            [&c.hostname],
            |r| r.get(0),
        )?;
        if reserved == 0 && !own {
            return Ok(false);
        }
        let status = match c.status {
            StoredCertificateStatus::Pending => "pending",
            StoredCertificateStatus::Ready => "ready",
            StoredCertificateStatus::DnsMismatch => "dns_mismatch",
            StoredCertificateStatus::Failed => "failed",
        };
        let secs = |v: Option<u64>| v.map(|v| v as i64);
        tx.execute(
            "INSERT INTO certificates (hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
             ON CONFLICT (hostname) DO UPDATE SET status = excluded.status, chain_pem = excluded.chain_pem,
                 key_pem = excluded.key_pem, not_before = excluded.not_before, not_after = excluded.not_after,
                 last_error = excluded.last_error, failures = excluded.failures,
                 next_attempt = excluded.next_attempt, updated_at = excluded.updated_at",
            params![
                c.hostname,
                status,
                c.chain_pem,
                c.key_pem,
                secs(c.not_before),
                secs(c.not_after),
                c.last_error,
                i64::from(c.failures),
                c.next_attempt as i64,
                now_rfc3339(),
            ],
        )?;
        tx.commit()?;
        Ok(true)
    }

    /// Forgets the certificate of a host name (idempotent).
    pub fn delete_certificate(&self, hostname: &str) -> Result<(), StoreError> {
        self.lock().execute("DELETE FROM certificates WHERE hostname = ?1", [hostname])?;
        Ok(())
    }
}

/// Where a certificate stands, as stored (`expired` is derived on reading).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredCertificateStatus {
    Pending,
    Ready,
    DnsMismatch,
    Failed,
}

/// The certificate of a custom domain, as the store keeps it.
#[derive(Clone, PartialEq, Eq)]
pub struct CertificateRecord {
    pub hostname: String,
    pub status: StoredCertificateStatus,
    /// PEM chain served (leaf first) and its PEM private key.
    pub chain_pem: Option<String>,
    pub key_pem: Option<String>,
    /// Validity of the certificate served, unix seconds.
    pub not_before: Option<u64>,
    pub not_after: Option<u64>,
    pub last_error: Option<String>,
    /// Consecutive failures (for the backoff).
    pub failures: u32,
    /// Unix seconds of the next try after a failure (0: none scheduled).
    pub next_attempt: u64,
    pub updated_at: String,
}

impl std::fmt::Debug for CertificateRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the private key.
        f.debug_struct("CertificateRecord")
            .field("hostname", &self.hostname)
            .field("status", &self.status)
            .field("not_after", &self.not_after)
            .field("last_error", &self.last_error)
            .field("failures", &self.failures)
            .field("next_attempt", &self.next_attempt)
            .finish_non_exhaustive()
    }
}

impl CertificateRecord {
    /// A record with nothing ordered yet.
    pub fn pending(hostname: &str) -> CertificateRecord {
        CertificateRecord {
            hostname: hostname.to_string(),
            status: StoredCertificateStatus::Pending,
            chain_pem: None,
            key_pem: None,
            not_before: None,
            not_after: None,
            last_error: None,
            failures: 0,
            next_attempt: 0,
            updated_at: now_rfc3339(),
        }
    }

    /// When a served certificate is renewed: 30 days before expiry, or a
    /// third of its lifetime before it for short-lived ones.
    pub fn renew_at(&self) -> Option<u64> {
        let (from, until) = (self.not_before?, self.not_after?);
        let lifetime = until.saturating_sub(from);
        Some(until.saturating_sub((lifetime / 3).min(RENEW_BEFORE_EXPIRY.as_secs())))
    }

    /// The API's view at unix time `now`.
    pub fn state(&self, now: u64) -> CertificateState {
        let has_cert = self.chain_pem.is_some();
        let status = match self.status {
            _ if has_cert && self.not_after.is_some_and(|t| t <= now) => CertificateStatus::Expired,
            // A failed renewal still serves the current certificate.
            _ if has_cert => CertificateStatus::Ready,
            StoredCertificateStatus::Pending | StoredCertificateStatus::Ready => CertificateStatus::Pending,
            StoredCertificateStatus::DnsMismatch => CertificateStatus::DnsMismatch,
            StoredCertificateStatus::Failed => CertificateStatus::Failed,
        };
        CertificateState {
            status,
            not_after: self.not_after.map(rfc3339),
            renew_at: if has_cert { self.renew_at().map(rfc3339) } else { None },
            next_attempt_at: (self.next_attempt > 0 && self.last_error.is_some())
                .then(|| rfc3339(self.next_attempt)),
            last_error: self.last_error.clone(),
            updated_at: self.updated_at.clone(),
        }
    }
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

fn held_by(existing: Reservation, owner: &str) -> Result<(Reservation, bool), StoreError> {
    if existing.owner == owner {
        Ok((existing, false))
    } else {
        Err(StoreError::AlreadyReserved { target: existing.target(), owner: existing.owner })
    }
}

fn lowest_free_port(
    conn: &Connection,
    range: PortRange,
    usable: impl Fn(u16) -> bool,
) -> Result<Option<u16>, StoreError> {
    let mut stmt =
        conn.prepare("SELECT port FROM reservations WHERE port BETWEEN ?1 AND ?2 ORDER BY port")?;
    let taken = stmt
        .query_map(params![i64::from(range.first), i64::from(range.last)], |r| r.get::<_, i64>(0))?
        .collect::<Result<std::collections::HashSet<i64>, _>>()?;
    Ok((range.first..=range.last).find(|&p| !taken.contains(&i64::from(p)) && usable(p)))
}

fn insert_reservation(
    conn: &Connection,
    kind: ReservationKind,
    hostname: Option<&str>,
    port: Option<u16>,
    owner: &str,
    labels: &Labels,
) -> Result<Reservation, StoreError> {
    let labels_json = labels_to_json(labels)?;
    let created_at = now_rfc3339();
    let id = insert_with_fresh_id("rs_", |id| {
        conn.execute(
            "INSERT INTO reservations (id, kind, hostname, port, owner, labels, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![id, kind.as_str(), hostname, port.map(i64::from), owner, labels_json, created_at],
        )
    })?;
    Ok(Reservation {
        id,
        kind,
        hostname: hostname.map(str::to_string),
        port,
        labels: labels.clone(),
        owner: owner.to_string(),
        created_at,
        url: None,
        certificate: None,
    })
}

fn insert_api_key(conn: &Connection, name: &str, scope: ApiKeyScope) -> Result<(ApiKey, String), StoreError> {
    let prefix = match scope {
        ApiKeyScope::Admin => ADMIN_KEY_PREFIX,
        ApiKeyScope::Endpoints => ENDPOINTS_KEY_PREFIX,
    };
    let secret = new_secret(prefix)?;
    let created_at = now_rfc3339();
    let id = insert_with_fresh_id("ak_", |id| {
        conn.execute(
            "INSERT INTO api_keys (id, name, scope, secret_hash, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, name, scope.as_str(), hash_secret(&secret), created_at],
        )
    })?;
    let key = ApiKey { id, name: name.to_string(), scope, created_at, revoked_at: None };
    Ok((key, secret))
}

/// Runs `insert` with fresh `<prefix><12 hex>` ids until one is not taken
/// (48 random bits: a retry is already unlikely).
fn insert_with_fresh_id(
    prefix: &str,
    insert: impl Fn(&str) -> rusqlite::Result<usize>,
) -> Result<String, StoreError> {
    let mut last = None;
    for _ in 0..8 {
        let id = format!("{prefix}{}", hex(&random_bytes::<6>()?));
        match insert(&id) {
            Ok(_) => return Ok(id),
            Err(e) if is_primary_key_conflict(&e) => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last.map(StoreError::from).unwrap_or(StoreError::Random))
}

fn is_primary_key_conflict(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(f, _)
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY
    )
}

fn select_reservation(
    conn: &Connection,
    condition: &str,
    value: &dyn rusqlite::ToSql,
) -> Result<Option<Reservation>, StoreError> {
    Ok(conn
        .query_row(
            &format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE {condition}"),
            [value],
            reservation_from_row,
        )
        .optional()?)
}

const CERTIFICATE_COLUMNS: &str = "hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at";

fn certificate_from_row(row: &Row<'_>) -> rusqlite::Result<CertificateRecord> {
    let status: String = row.get(1)?;
    let status = match status.as_str() {
        "pending" => StoredCertificateStatus::Pending,
        "ready" => StoredCertificateStatus::Ready,
        "dns_mismatch" => StoredCertificateStatus::DnsMismatch,
        "failed" => StoredCertificateStatus::Failed,
        other => return Err(invalid(1, format!("unknown certificate status {other:?}"))),
    };
    let secs = |column: usize| -> rusqlite::Result<Option<u64>> {
        Ok(row.get::<_, Option<i64>>(column)?.map(|v| v.max(0) as u64))
    };
    Ok(CertificateRecord {
        hostname: row.get(0)?,
        status,
        chain_pem: row.get(2)?,
        key_pem: row.get(3)?,
        not_before: secs(4)?,
        not_after: secs(5)?,
        last_error: row.get(6)?,
        failures: u32::try_from(row.get::<_, i64>(7)?.max(0)).unwrap_or(u32::MAX),
        next_attempt: secs(8)?.unwrap_or(0),
        updated_at: row.get(9)?,
    })
}

const API_KEY_COLUMNS: &str = "id, name, scope, created_at, revoked_at";
const RESERVATION_COLUMNS: &str = "id, kind, hostname, port, owner, labels, created_at";
const TUNNEL_KEY_COLUMNS: &str =
    "id, protocol, reservation_id, kind, hostname, port, owner, labels, created_at, revoked_at";

fn invalid(column: usize, message: String) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(column, Type::Text, message.into())
}

fn api_key_from_row(row: &Row<'_>) -> rusqlite::Result<ApiKey> {
    let scope: String = row.get(2)?;
    Ok(ApiKey {
        id: row.get(0)?,
        name: row.get(1)?,
        scope: ApiKeyScope::parse(&scope).ok_or_else(|| invalid(2, format!("unknown scope {scope:?}")))?,
        created_at: row.get(3)?,
        revoked_at: row.get(4)?,
    })
}

fn reservation_from_row(row: &Row<'_>) -> rusqlite::Result<Reservation> {
    let kind: String = row.get(1)?;
    Ok(Reservation {
        id: row.get(0)?,
        kind: ReservationKind::parse(&kind).ok_or_else(|| invalid(1, format!("unknown kind {kind:?}")))?,
        hostname: row.get(2)?,
        port: port_column(row, 3)?,
        owner: row.get(4)?,
        labels: labels_column(row, 5)?,
        created_at: row.get(6)?,
        url: None,
        certificate: None,
    })
}

fn tunnel_key_from_row(row: &Row<'_>) -> rusqlite::Result<TunnelKey> {
    let protocol: String = row.get(1)?;
    let kind: String = row.get(3)?;
    Ok(TunnelKey {
        id: row.get(0)?,
        protocol: Protocol::parse(&protocol)
            .ok_or_else(|| invalid(1, format!("unknown protocol {protocol:?}")))?,
        reservation: ReservationRef {
            id: row.get(2)?,
            kind: ReservationKind::parse(&kind)
                .ok_or_else(|| invalid(3, format!("unknown kind {kind:?}")))?,
            hostname: row.get(4)?,
            port: port_column(row, 5)?,
        },
        owner: row.get(6)?,
        labels: labels_column(row, 7)?,
        created_at: row.get(8)?,
        revoked_at: row.get(9)?,
        connections: 0,
    })
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

pub fn rfc3339(unix_secs: u64) -> String {
    let (days, rem) = (unix_secs / 86_400, unix_secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u16, last: u16) -> PortRange {
        PortRange { first, last }
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn admin(store: &Store) -> ApiKey {
        store.api_keys().unwrap().into_iter().find(|k| k.scope == ApiKeyScope::Admin).unwrap()
    }

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_735_689_599), "2024-12-31T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn migrates_and_refuses_newer_schema() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.schema_version().unwrap(), MIGRATIONS.len() as u32);
        drop(store);
        // Opening again applies nothing and keeps the version.
        assert_eq!(Store::open(dir.path()).unwrap().schema_version().unwrap(), MIGRATIONS.len() as u32);
        let conn = Connection::open(dir.path().join(DB_FILE)).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        let err = Store::open(dir.path()).unwrap_err();
        assert_eq!(err.category(), "newer_schema", "{err}");
        assert!(err.to_string().contains("newer culvert"), "{err}");
    }

    #[test]
    fn key_prefixes_and_hashing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let admin_secret = store.ensure_admin_key().unwrap().expect("first start makes a key");
        assert!(admin_secret.starts_with(ADMIN_KEY_PREFIX));
        assert_eq!(admin_secret.len(), ADMIN_KEY_PREFIX.len() + 64);
        assert_eq!(store.ensure_admin_key().unwrap(), None, "only on the first start");
        let (ep, ep_secret) = store.create_api_key("operator", ApiKeyScope::Endpoints).unwrap();
        assert!(ep_secret.starts_with(ENDPOINTS_KEY_PREFIX));
        assert!(ep.id.starts_with("ak_") && ep.id.len() == 15, "{}", ep.id);

        let (r, _) = store
            .reserve_domain(ReservationKind::Subdomain, "blog.example.com", &ep.id, &Labels::new())
            .unwrap();
        let (tk, tk_secret) = store.create_tunnel_key(&r.id, Protocol::Http, &Labels::new(), &ep.id).unwrap();
        assert!(tk_secret.starts_with(TUNNEL_KEY_PREFIX));
        assert!(tk.id.starts_with("tk_") && tk.id.len() == 15, "{}", tk.id);

        // Nothing stores a secret in clear.
        let raw = std::fs::read(dir.path().join(DB_FILE)).unwrap_or_default();
        let wal = std::fs::read(dir.path().join(format!("{DB_FILE}-wal"))).unwrap_or_default();
        for secret in [&admin_secret, &ep_secret, &tk_secret] {
            let needle = &secret.as_bytes()[10..];
            assert!(!raw.windows(needle.len()).any(|w| w == needle));
            assert!(!wal.windows(needle.len()).any(|w| w == needle));
        }

        assert!(
            matches!(store.authenticate_api_key(&admin_secret).unwrap(), ApiKeyAuth::Valid(k) if k.scope == ApiKeyScope::Admin)
        );
        assert!(
            matches!(store.authenticate_api_key(&ep_secret).unwrap(), ApiKeyAuth::Valid(k) if k.id == ep.id)
        );
        assert!(matches!(store.authenticate_api_key(&tk_secret).unwrap(), ApiKeyAuth::TunnelKey));
        assert!(matches!(store.authenticate_api_key("culvert_a_nope").unwrap(), ApiKeyAuth::Unknown));

        match store.authenticate_tunnel_key(&tk_secret).unwrap() {
            TunnelKeyAuth::Valid(g) => {
                assert_eq!(g.key_id, tk.id);
                assert_eq!(g.protocol, Protocol::Http);
                assert_eq!(g.reservation, r);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(store.authenticate_tunnel_key(&ep_secret).unwrap(), TunnelKeyAuth::NotATunnelKey));
        assert!(matches!(
            store.authenticate_tunnel_key(&admin_secret).unwrap(),
            TunnelKeyAuth::NotATunnelKey
        ));
        assert!(matches!(store.authenticate_tunnel_key("culvert_t_00").unwrap(), TunnelKeyAuth::Unknown));
        assert!(matches!(store.authenticate_tunnel_key("").unwrap(), TunnelKeyAuth::Unknown));
    }

    #[test]
    fn durable_across_reopen_without_clean_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let admin_secret = store.ensure_admin_key().unwrap().unwrap();
        let owner = admin(&store).id;
        let (d, _) = store
            .reserve_domain(ReservationKind::Custom, "app.example.org", &owner, &labels(&[("ns", "web")]))
            .unwrap();
        let (p, _) = store.reserve_port(None, range(20000, 20010), &owner, &Labels::new()).unwrap();
        let (tk, tk_secret) =
            store.create_tunnel_key(&p.id, Protocol::Tcp, &labels(&[("uid", "1")]), &owner).unwrap();
        let (gone, gone_secret) =
            store.create_tunnel_key(&d.id, Protocol::Http, &Labels::new(), &owner).unwrap();
        store.revoke_tunnel_key(&gone.id).unwrap();
        // Like kill -9: the connection is never closed, the WAL never checkpointed.
        std::mem::forget(store);

        let store = Store::open(dir.path()).unwrap();
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

    #[test]
    fn idempotent_reservations_and_conflicts() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let (a, _) = store.create_api_key("a", ApiKeyScope::Endpoints).unwrap();
        let (b, _) = store.create_api_key("b", ApiKeyScope::Endpoints).unwrap();
        let (first, created) = store
            .reserve_domain(ReservationKind::Subdomain, "blog.example.com", &a.id, &labels(&[("x", "1")]))
            .unwrap();
        assert!(created);
        let (again, created) = store
            .reserve_domain(ReservationKind::Subdomain, "blog.example.com", &a.id, &Labels::new())
            .unwrap();
        assert!(!created);
        assert_eq!(again, first, "the existing record, labels unchanged");
        let err = store
            .reserve_domain(ReservationKind::Subdomain, "blog.example.com", &b.id, &Labels::new())
            .unwrap_err();
        assert!(matches!(&err, StoreError::AlreadyReserved { owner, .. } if *owner == a.id), "{err}");

        let (p, created) =
            store.reserve_port(Some(20005), range(20000, 20010), &a.id, &Labels::new()).unwrap();
        assert!(created);
        let (p2, created) =
            store.reserve_port(Some(20005), range(20000, 20010), &a.id, &Labels::new()).unwrap();
        assert!(!created);
        assert_eq!(p, p2);
        let err = store.reserve_port(Some(20005), range(20000, 20010), &b.id, &Labels::new()).unwrap_err();
        assert_eq!(err.category(), "already_reserved");
        assert_eq!(err.to_string(), format!("port 20005 is held by another key ({})", a.id));

        // Released names are free again, for anyone.
        store.release_reservation(&first.id).unwrap();
        let (taken, created) = store
            .reserve_domain(ReservationKind::Subdomain, "blog.example.com", &b.id, &Labels::new())
            .unwrap();
        assert!(created);
        assert_ne!(taken.id, first.id);
        assert!(matches!(store.release_reservation(&first.id).unwrap_err(), StoreError::NotFound { .. }));
    }

    #[test]
    fn port_allocation_stays_in_range() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let (a, _) = store.create_api_key("a", ApiKeyScope::Endpoints).unwrap();
        let r = range(30000, 30003);
        let none = Labels::new();
        store.reserve_port(Some(30001), r, &a.id, &none).unwrap();
        let got: Vec<u16> =
            (0..3).map(|_| store.reserve_port(None, r, &a.id, &none).unwrap().0.port.unwrap()).collect();
        assert_eq!(got, vec![30000, 30002, 30003]);
        assert!(matches!(
            store.reserve_port(None, r, &a.id, &none).unwrap_err(),
            StoreError::NoFreePort { .. }
        ));
        let err = store.reserve_port(Some(80), r, &a.id, &none).unwrap_err();
        assert!(matches!(err, StoreError::PortOutOfRange { port: 80, .. }));
        // A freed port in the middle is handed out next.
        let mid = store.reservation_by_port(30002).unwrap().unwrap();
        store.release_reservation(&mid.id).unwrap();
        assert_eq!(store.reserve_port(None, r, &a.id, &none).unwrap().0.port, Some(30002));
        // Ports reserved outside a (since narrowed) range do not block allocation.
        assert_eq!(store.reserve_port(None, range(30003, 30005), &a.id, &none).unwrap().0.port, Some(30004));
        // Ports the edge cannot listen on: skipped when free ones are picked, refused when asked for.
        let busy = |p: u16| p != 30005 && p != 30006;
        let r = range(30003, 30008);
        assert_eq!(store.reserve_usable_port(None, r, &a.id, &none, busy).unwrap().0.port, Some(30007));
        let err = store.reserve_usable_port(Some(30006), r, &a.id, &none, busy).unwrap_err();
        assert!(matches!(err, StoreError::PortInUse { port: 30006 }), "{err:?}");
        // A port already held answers the reservation whatever the check says.
        assert!(!store.reserve_usable_port(Some(30007), r, &a.id, &none, |_| false).unwrap().1);
    }

    #[test]
    fn revocation() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.ensure_admin_key().unwrap();
        let owner = admin(&store).id;
        let (r, _) = store
            .reserve_domain(ReservationKind::Subdomain, "x.example.com", &owner, &Labels::new())
            .unwrap();
        let (k1, s1) = store.create_tunnel_key(&r.id, Protocol::Http, &Labels::new(), &owner).unwrap();
        let (k2, s2) = store.create_tunnel_key(&r.id, Protocol::Tls, &Labels::new(), &owner).unwrap();
        let revoked = store.revoke_tunnel_key(&k1.id).unwrap();
        assert!(revoked.revoked_at.is_some());
        assert_eq!(store.revoke_tunnel_key(&k1.id).unwrap(), revoked, "idempotent");
        assert!(matches!(store.authenticate_tunnel_key(&s1).unwrap(), TunnelKeyAuth::Revoked));
        assert!(matches!(store.authenticate_tunnel_key(&s2).unwrap(), TunnelKeyAuth::Valid(_)));
        assert_eq!(store.tunnel_keys(false).unwrap().len(), 1);
        assert_eq!(store.tunnel_keys(true).unwrap().len(), 2);

        // Releasing the reservation revokes the rest.
        let (released, keys) = store.release_reservation(&r.id).unwrap();
        assert_eq!(released.id, r.id);
        assert_eq!(keys, vec![k2.id.clone()]);
        assert!(matches!(store.authenticate_tunnel_key(&s2).unwrap(), TunnelKeyAuth::Revoked));
        assert!(store.live_tunnel_key_ids().unwrap().is_empty());
        let listed = store.tunnel_key(&k2.id).unwrap().unwrap();
        assert_eq!(
            listed.reservation.hostname.as_deref(),
            Some("x.example.com"),
            "still says what it was for"
        );
        assert!(matches!(
            store.revoke_tunnel_key("tk_000000000000").unwrap_err(),
            StoreError::NotFound { .. }
        ));
    }

    #[test]
    fn certificates_live_and_die_with_their_custom_domain() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.ensure_admin_key().unwrap();
        let owner = admin(&store).id;
        let none = Labels::new();
        // Only a reserved custom domain gets a record.
        assert!(!store.put_certificate(&CertificateRecord::pending("app.example.org")).unwrap());
        let (sub, _) =
            store.reserve_domain(ReservationKind::Subdomain, "x.edge.test", &owner, &none).unwrap();
        assert!(!store.put_certificate(&CertificateRecord::pending("x.edge.test")).unwrap());
        let (app, _) =
            store.reserve_domain(ReservationKind::Custom, "app.example.org", &owner, &none).unwrap();
        let mut record = CertificateRecord::pending("app.example.org");
        assert!(store.put_certificate(&record).unwrap());
        assert_eq!(
            store.certificate("app.example.org").unwrap().unwrap().state(0).status,
            CertificateStatus::Pending
        );

        record.status = StoredCertificateStatus::Ready;
        record.chain_pem = Some("chain".into());
        record.key_pem = Some("key".into());
        (record.not_before, record.not_after) = (Some(1_000), Some(1_090));
        record.last_error = Some("renewal failed".into());
        record.next_attempt = 1_070;
        assert!(store.put_certificate(&record).unwrap());
        // Like kill -9: the record survives without a clean shutdown.
        std::mem::forget(store);
        let store = Store::open(dir.path()).unwrap();
        let stored = store.certificate("app.example.org").unwrap().unwrap();
        assert!(stored == CertificateRecord { updated_at: stored.updated_at.clone(), ..record.clone() });
        let state = stored.state(1_050);
        assert_eq!(state.status, CertificateStatus::Ready, "a failed renewal still serves");
        assert_eq!(state.not_after.as_deref(), Some("1970-01-01T00:18:10Z"));
        assert_eq!(state.renew_at.as_deref(), Some("1970-01-01T00:17:40Z"));
        assert_eq!(state.next_attempt_at.as_deref(), Some("1970-01-01T00:17:50Z"));
        assert_eq!(stored.state(1_090).status, CertificateStatus::Expired);
        assert!(!format!("{stored:?}").contains("key"), "Debug never shows the private key");

        // Releasing deletes the certificate in the same transaction; others stay.
        store.release_reservation(&sub.id).unwrap();
        assert_eq!(store.certificates().unwrap().len(), 1);
        store.release_reservation(&app.id).unwrap();
        assert!(store.certificate("app.example.org").unwrap().is_none());
        assert!(
            !store.put_certificate(&record).unwrap(),
            "an order finishing after the release stores nothing"
        );

        assert_eq!(store.acme_account("https://ca/dir").unwrap(), None);
        store.put_acme_account("https://ca/dir", "{\"id\":1}").unwrap();
        store.put_acme_account("https://ca/dir", "{\"id\":2}").unwrap();
        assert_eq!(store.acme_account("https://ca/dir").unwrap().as_deref(), Some("{\"id\":2}"));
    }

    #[test]
    fn api_keys_and_the_last_admin() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.ensure_admin_key().unwrap();
        let first = admin(&store);
        assert_eq!(first.name, INITIAL_ADMIN_KEY_NAME);
        assert!(matches!(store.revoke_api_key(&first.id).unwrap_err(), StoreError::LastAdminKey { .. }));
        let (second, second_secret) = store.create_api_key("second", ApiKeyScope::Admin).unwrap();
        store.revoke_api_key(&first.id).unwrap();
        assert!(matches!(store.revoke_api_key(&second.id).unwrap_err(), StoreError::LastAdminKey { .. }));
        let (ep, ep_secret) = store.create_api_key("ep", ApiKeyScope::Endpoints).unwrap();
        store.revoke_api_key(&ep.id).unwrap();
        assert!(matches!(store.authenticate_api_key(&ep_secret).unwrap(), ApiKeyAuth::Revoked(_)));
        assert!(matches!(store.authenticate_api_key(&second_secret).unwrap(), ApiKeyAuth::Valid(_)));
        assert_eq!(store.api_keys().unwrap().len(), 3);
        assert_eq!(store.ensure_admin_key().unwrap(), None, "a live admin key exists");
    }
}
