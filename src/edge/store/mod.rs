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

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::types::Type;
use rusqlite::{Connection, Row, TransactionBehavior};

use crate::api::Labels;
use crate::api::PortRange;

mod certificates;
mod keys;
mod reservations;

pub use certificates::{CertificateRecord, StoredCertificateStatus};
pub use keys::{ApiKeyAuth, TunnelKeyAuth};

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
    // 3: the custom domains an endpoints key may reserve (a JSON array of
    // suffixes; keys made before may reserve none).
    r#"
    ALTER TABLE api_keys ADD COLUMN custom_domains TEXT NOT NULL DEFAULT '[]';
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::api::{ApiKey, ApiKeyScope, Protocol, ReservationKind};

    pub(super) fn range(first: u16, last: u16) -> PortRange {
        PortRange { first, last }
    }

    pub(super) fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    pub(super) fn admin(store: &Store) -> ApiKey {
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
}
