//! The PostgreSQL engine: the store of several edges sharing one database.
//!
//! - Client: the synchronous `postgres` crate (tokio-postgres underneath).
//!   [`super::Store`] already runs every engine call on the blocking pool,
//!   so a blocking client keeps the engine one straight-line function per
//!   call, like the SQLite one; a handful of idle connections are kept for
//!   reuse (no pool crate: control-plane calls are few and short).
//! - TLS: rustls (ring), as everywhere else; `sslmode` is honoured
//!   (`disable`, `prefer` (the default), `require`: no certificate check,
//!   like libpq; `verify-ca`: the chain; `verify-full`: the chain and the
//!   host name), against `sslrootcert` (a PEM file) or the built-in roots;
//!   a client certificate with `sslcert` and `sslkey` (PEM files, as libpq;
//!   for `clientcert=verify-ca|verify-full` in `pg_hba.conf`).
//! - Every write is one SERIALIZABLE transaction, retried on a
//!   serialization failure or a unique violation, so a check-then-write (a
//!   name already held, the last admin key, the lowest free port) stays
//!   right when two edges race; each commits a `NOTIFY culvert_changes`.
//! - The change feed ([`Engine::watch`]): one more connection per edge
//!   LISTENs and calls back on every notification, and after every
//!   reconnection (what changed while it was away).
//! - Versioned migrations in [`MIGRATIONS`], applied under an advisory lock
//!   so edges starting together do not race.
//! - The database cannot be reached: [`StoreError::Unavailable`].

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use postgres::error::SqlState;
use postgres::fallible_iterator::FallibleIterator;
use postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use postgres::{Client, IsolationLevel, Row, Socket, Transaction};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{
    ADMIN_KEY_PREFIX, ApiKeyAuth, ApiKeyRow, CertificateRecord, Certificates, Challenge, ChallengeKind,
    ChangeCallback, ENDPOINTS_KEY_PREFIX, Engine, INITIAL_ADMIN_KEY_NAME, Keys, Reservations, Snapshot,
    StoreError, StoredCertificateStatus, TUNNEL_KEY_PREFIX, TunnelKeyAuth, TunnelKeyRow, fresh_id,
    hash_secret, held_by, labels_to_json, new_secret, now_rfc3339, unix_now,
};
use crate::api::{
    ApiKey, ApiKeyScope, Labels, PortProtocol, PortRange, Protocol, Quota, QuotaUpdate, Reservation,
    ReservationKind, ReservationRef, TunnelKey,
};
use crate::edge::store::keys::TunnelGrant;

/// The channel of the change feed.
pub const CHANNEL: &str = "culvert_changes";
/// Idle connections kept for reuse.
const MAX_IDLE: usize = 4;
/// A write transaction is tried this often before its conflict is reported.
const MAX_ATTEMPTS: usize = 16;
/// Connect timeout when the URL gives none.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the change feed waits before reconnecting, at most.
const FEED_MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often the change feed checks that it should still run.
const FEED_TICK: Duration = Duration::from_millis(250);
/// Key of the advisory lock taken while migrating.
const MIGRATION_LOCK: i64 = 0x6375_6c76_6572_7401;

/// Schema migrations; migration `i` brings the version from `i` to `i + 1`.
/// Append only: never edit one that has shipped. Version 1 is SQLite's 4.
pub const MIGRATIONS: &[&str] = &[
    r#"
    CREATE TABLE api_keys (
        seq         BIGSERIAL NOT NULL,
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        scope       TEXT NOT NULL CHECK (scope IN ('admin', 'endpoints')),
        secret_hash TEXT NOT NULL UNIQUE,
        created_at  TEXT NOT NULL,
        revoked_at  TEXT,
        -- The custom domains an endpoints key may reserve (a JSON array of suffixes).
        custom_domains TEXT NOT NULL DEFAULT '[]'
    );

    CREATE TABLE reservations (
        seq        BIGSERIAL NOT NULL,
        id         TEXT PRIMARY KEY,
        kind       TEXT NOT NULL CHECK (kind IN ('subdomain', 'custom', 'tcp')),
        hostname   TEXT UNIQUE,
        port       BIGINT UNIQUE CHECK (port BETWEEN 1 AND 65535),
        owner      TEXT NOT NULL REFERENCES api_keys (id),
        labels     TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL,
        CHECK ((kind = 'tcp' AND port IS NOT NULL AND hostname IS NULL)
            OR (kind <> 'tcp' AND hostname IS NOT NULL AND port IS NULL))
    );

    CREATE TABLE tunnel_keys (
        seq            BIGSERIAL NOT NULL,
        id             TEXT PRIMARY KEY,
        secret_hash    TEXT NOT NULL UNIQUE,
        protocol       TEXT NOT NULL CHECK (protocol IN ('http', 'tcp', 'tls')),
        reservation_id TEXT NOT NULL,
        kind           TEXT NOT NULL,
        hostname       TEXT,
        port           BIGINT,
        owner          TEXT NOT NULL REFERENCES api_keys (id),
        created_by     TEXT NOT NULL REFERENCES api_keys (id),
        labels         TEXT NOT NULL DEFAULT '{}',
        created_at     TEXT NOT NULL,
        revoked_at     TEXT
    );

    CREATE INDEX tunnel_keys_by_reservation ON tunnel_keys (reservation_id);

    CREATE TABLE acme_accounts (
        directory   TEXT PRIMARY KEY,
        credentials TEXT NOT NULL,
        created_at  TEXT NOT NULL
    );

    CREATE TABLE certificates (
        hostname     TEXT PRIMARY KEY,
        status       TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'dns_mismatch', 'failed')),
        chain_pem    TEXT,
        key_pem      TEXT,
        not_before   BIGINT,
        not_after    BIGINT,
        last_error   TEXT,
        failures     BIGINT NOT NULL DEFAULT 0,
        next_attempt BIGINT NOT NULL DEFAULT 0,
        updated_at   TEXT NOT NULL,
        CHECK ((chain_pem IS NULL) = (key_pem IS NULL))
    );

    CREATE TABLE leases (
        name       TEXT PRIMARY KEY,
        holder     TEXT NOT NULL,
        expires_at BIGINT NOT NULL
    );
    "#,
    // 2 (SQLite's 5): answers to pending ACME challenges, so that any edge
    // answers the CA's validation, whichever edge placed the order.
    r#"
    CREATE TABLE acme_challenges (
        kind       TEXT NOT NULL CHECK (kind IN ('http-01', 'tls-alpn-01')),
        -- HTTP-01: the token; TLS-ALPN-01: the host name.
        name       TEXT NOT NULL,
        -- HTTP-01: the key authorization; TLS-ALPN-01: its SHA-256, hex.
        value      TEXT NOT NULL,
        expires_at BIGINT NOT NULL,
        PRIMARY KEY (kind, name)
    );
    "#,
    // 3 (SQLite's 6): UDP ports: a port reservation's transport (TCP and
    // UDP ports are separate spaces, so the port is unique per protocol) and
    // tunnel keys of protocol udp.
    r#"
    ALTER TABLE reservations ADD COLUMN protocol TEXT NOT NULL DEFAULT 'tcp'
        CHECK (protocol IN ('tcp', 'udp'));
    ALTER TABLE reservations DROP CONSTRAINT reservations_port_key;
    ALTER TABLE reservations ADD CONSTRAINT reservations_port_protocol_key UNIQUE (port, protocol);
    ALTER TABLE tunnel_keys DROP CONSTRAINT tunnel_keys_protocol_check;
    ALTER TABLE tunnel_keys ADD CONSTRAINT tunnel_keys_protocol_check
        CHECK (protocol IN ('http', 'tcp', 'tls', 'udp'));
    "#,
    // 4 (SQLite's 7): the quota of an endpoints key (NULL: `Quota::DEFAULT`'s value) and a
    // TCP port's own idle timeout (NULL: the edge's flag).
    r#"
    ALTER TABLE api_keys ADD COLUMN max_reservations BIGINT;
    ALTER TABLE api_keys ADD COLUMN max_labels BIGINT;
    ALTER TABLE api_keys ADD COLUMN max_label_bytes BIGINT;
    ALTER TABLE reservations ADD COLUMN idle_timeout_seconds BIGINT;
    CREATE INDEX reservations_by_owner ON reservations (owner);
    "#,
];

/// `url` with its password replaced by `***`, for messages and logs.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// `sslmode` as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// What culvert reads of a URL itself: `sslmode`, `sslrootcert`, `sslcert`, `sslkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TlsParams {
    mode: SslMode,
    root: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

/// A `postgres://` URL split into what the `postgres` crate parses and what
/// culvert handles itself ([`TlsParams`]).
fn parse_url(url: &str) -> Result<(postgres::Config, TlsParams), StoreError> {
    let bad = |what: String| {
        StoreError::BadLocation(format!(
            "--store {}: {what}; expected postgres://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=verify-full",
            redact(url)
        ))
    };
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut mode, mut root, mut cert, mut key) = (SslMode::Prefer, None, None, None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sslmode" => {
                mode = match v {
                    "disable" => SslMode::Disable,
                    "allow" | "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(bad(format!(
                            "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
                        )));
                    }
                }
            }
            "sslrootcert" => root = Some(PathBuf::from(percent_decode(v))),
            "sslcert" => cert = Some(PathBuf::from(percent_decode(v))),
            "sslkey" => key = Some(PathBuf::from(percent_decode(v))),
            _ => kept.push(pair),
        }
    }
    let rebuilt = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    let mut config = postgres::Config::from_str(&rebuilt).map_err(|e| bad(e.to_string()))?;
    config.ssl_mode(match mode {
        SslMode::Disable => postgres::config::SslMode::Disable,
        SslMode::Prefer => postgres::config::SslMode::Prefer,
        _ => postgres::config::SslMode::Require,
    });
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("culvert-edge");
    }
    if cert.is_some() != key.is_some() {
        return Err(bad(
            "give both sslcert and sslkey (the client certificate and its key), or neither".into()
        ));
    }
    if cert.is_some() && mode == SslMode::Disable {
        return Err(bad("sslcert with sslmode=disable: a client certificate needs TLS".into()));
    }
    Ok((config, TlsParams { mode, root, cert, key }))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The engine.
pub struct Postgres {
    config: postgres::Config,
    tls: Tls,
    idle: Mutex<Vec<Client>>,
    /// The URL without its password.
    display: String,
}

impl Postgres {
    /// Connects, applies pending migrations and keeps the connection.
    pub fn open(url: &str) -> Result<Postgres, StoreError> {
        let (config, params) = parse_url(url)?;
        let tls = Tls::new(params)?;
        let pg = Postgres { config, tls, idle: Mutex::new(Vec::new()), display: redact(url) };
        let mut client = pg.connect()?;
        migrate(&mut client)?;
        info!(store = %pg.display, "PostgreSQL store ready");
        pg.idle.lock().unwrap_or_else(|p| p.into_inner()).push(client);
        Ok(pg)
    }

    fn connect(&self) -> Result<Client, StoreError> {
        self.config.connect(self.tls.clone()).map_err(|e| StoreError::Unavailable(describe(&e)))
    }

    /// An idle connection (`true`: reused), or a new one; back to the idle
    /// list when dropped.
    fn client(&self) -> Result<(Pooled<'_>, bool), StoreError> {
        let reused = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            std::iter::from_fn(|| idle.pop()).find(|c| !c.is_closed())
        };
        let was_reused = reused.is_some();
        let client = match reused {
            Some(c) => c,
            None => self.connect()?,
        };
        Ok((Pooled { pg: self, client: Some(client) }, was_reused))
    }

    /// Runs `f` on a connection. A reused connection that turns out dead
    /// (the server restarted since it was last used) is dropped with the
    /// other idle ones, and `f` runs once more on a new connection: the
    /// first call after PostgreSQL is back succeeds.
    fn with_client<T>(
        &self,
        mut f: impl FnMut(&mut Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (mut pooled, reused) = self.client()?;
        match f(pooled.get()) {
            Err(StoreError::Unavailable(_)) if reused => {
                pooled.client = None;
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
                let (mut fresh, _) = self.client()?;
                f(fresh.get())
            }
            Err(e @ StoreError::Unavailable(_)) => {
                pooled.client = None;
                Err(e)
            }
            other => other,
        }
    }

    /// Runs a read.
    fn read<T>(&self, f: impl FnMut(&mut Client) -> Result<T, StoreError>) -> Result<T, StoreError> {
        self.with_client(f)
    }

    /// Runs `f` in a SERIALIZABLE transaction that notifies the change feed
    /// on commit; again (from the start) on a conflict with a concurrent one.
    fn write<T>(
        &self,
        mut f: impl FnMut(&mut Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.with_client(|client| {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let result = (|| {
                    let mut tx =
                        client.build_transaction().isolation_level(IsolationLevel::Serializable).start()?;
                    let value = f(&mut tx)?;
                    tx.execute("SELECT pg_notify($1, '')", &[&CHANNEL])?;
                    tx.commit()?;
                    Ok(value)
                })();
                match result {
                    Err(StoreError::Retry(_)) if attempt < MAX_ATTEMPTS => {
                        std::thread::sleep(Duration::from_millis(attempt as u64 * 2));
                    }
                    Err(StoreError::Retry(message)) => return Err(StoreError::Postgres(message)),
                    other => return other,
                }
            }
        })
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // The blocking client's drop blocks on its own runtime, which panics
        // on a thread of tokio's (an edge dropped in a task): drop them elsewhere.
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        if !idle.is_empty() && tokio::runtime::Handle::try_current().is_ok() {
            let spawned =
                std::thread::Builder::new().name("culvert-store-close".into()).spawn(move || drop(idle));
            if let Err(e) = spawned {
                warn!(error = %e, "could not close the store's idle connections");
            }
        }
    }
}

struct Pooled<'a> {
    pg: &'a Postgres,
    client: Option<Client>,
}

impl Pooled<'_> {
    fn get(&mut self) -> &mut Client {
        self.client.as_mut().expect("present until dropped")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take()
            && !client.is_closed()
        {
            let mut idle = self.pg.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < MAX_IDLE {
                idle.push(client);
            }
        }
    }
}

/// The error and its causes, one line.
fn describe(e: &postgres::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let s_text = s.to_string();
        if !message.contains(&s_text) {
            message = format!("{message}: {s_text}");
        }
        source = s.source();
    }
    message
}

impl From<postgres::Error> for StoreError {
    fn from(e: postgres::Error) -> StoreError {
        let message = describe(&e);
        match e.code() {
            // The connection went away, or the server is shutting down or starting.
            None => StoreError::Unavailable(message),
            Some(code) if code.code().starts_with("08") || code.code().starts_with("57P") => {
                StoreError::Unavailable(message)
            }
            Some(code)
                if *code == SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == SqlState::T_R_DEADLOCK_DETECTED
                    || *code == SqlState::UNIQUE_VIOLATION =>
            {
                StoreError::Retry(message)
            }
            Some(_) => StoreError::Postgres(message),
        }
    }
}

fn migrate(client: &mut Client) -> Result<(), StoreError> {
    let supported = MIGRATIONS.len() as u32;
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS culvert_schema (version INTEGER NOT NULL)")?;
    let found: Option<i32> = tx.query_opt("SELECT version FROM culvert_schema", &[])?.map(|r| r.get(0));
    let mut version = match found {
        Some(v) => v.max(0) as u32,
        None => {
            tx.execute("INSERT INTO culvert_schema (version) VALUES (0)", &[])?;
            0
        }
    };
    if version > supported {
        return Err(StoreError::NewerPostgresSchema { found: version, supported });
    }
    while let Some(sql) = MIGRATIONS.get(version as usize) {
        tx.batch_execute(sql)?;
        version += 1;
        tx.execute("UPDATE culvert_schema SET version = $1", &[&(version as i32)])?;
        info!(version, "store schema migrated");
    }
    tx.commit()?;
    Ok(())
}

const API_KEY_COLUMNS: &str =
    "id, name, scope, created_at, revoked_at, custom_domains, max_reservations, max_labels, max_label_bytes";
const TUNNEL_KEY_COLUMNS: &str =
    "id, protocol, reservation_id, kind, hostname, port, owner, labels, created_at, revoked_at";
const RESERVATION_COLUMNS: &str =
    "id, kind, hostname, port, owner, labels, created_at, protocol, idle_timeout_seconds";
const CERTIFICATE_COLUMNS: &str = "hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at";

fn corrupt(message: String) -> StoreError {
    StoreError::Corrupt(message)
}

fn get<T: for<'a> postgres::types::FromSql<'a>>(row: &Row, i: usize) -> Result<T, StoreError> {
    row.try_get(i).map_err(|e| corrupt(format!("column {i}: {e}")))
}

fn port(row: &Row, i: usize) -> Result<Option<u16>, StoreError> {
    match get::<Option<i64>>(row, i)? {
        None => Ok(None),
        Some(p) => u16::try_from(p).map(Some).map_err(|_| corrupt(format!("port {p} out of range"))),
    }
}

fn labels(row: &Row, i: usize) -> Result<Labels, StoreError> {
    let json: String = get(row, i)?;
    serde_json::from_str(&json).map_err(|e| corrupt(format!("labels are not a JSON object: {e}")))
}

fn api_key_from_row(row: &Row) -> Result<ApiKey, StoreError> {
    let scope: String = get(row, 2)?;
    let scope = ApiKeyScope::parse(&scope).ok_or_else(|| corrupt(format!("unknown scope {scope:?}")))?;
    Ok(ApiKey {
        id: get(row, 0)?,
        name: get(row, 1)?,
        scope,
        quota: super::keys::quota_of(scope, [get(row, 6)?, get(row, 7)?, get(row, 8)?]),
        created_at: get(row, 3)?,
        revoked_at: get(row, 4)?,
        custom_domains: serde_json::from_str(&get::<String>(row, 5)?)
            .map_err(|e| corrupt(format!("custom_domains is not a JSON list: {e}")))?,
    })
}

fn tunnel_key_from_row(row: &Row) -> Result<TunnelKey, StoreError> {
    let protocol: String = get(row, 1)?;
    let kind: String = get(row, 3)?;
    let protocol =
        Protocol::parse(&protocol).ok_or_else(|| corrupt(format!("unknown protocol {protocol:?}")))?;
    Ok(TunnelKey {
        id: get(row, 0)?,
        protocol,
        reservation: ReservationRef {
            // A udp key is only ever minted for a UDP port.
            protocol: crate::api::PortProtocol::of_key(protocol),
            id: get(row, 2)?,
            kind: ReservationKind::parse(&kind).ok_or_else(|| corrupt(format!("unknown kind {kind:?}")))?,
            hostname: get(row, 4)?,
            port: port(row, 5)?,
        },
        owner: get(row, 6)?,
        labels: labels(row, 7)?,
        created_at: get(row, 8)?,
        revoked_at: get(row, 9)?,
        connections: 0,
    })
}

/// The condition of a port of `protocol` (a fixed word, not input).
fn port_is(protocol: PortProtocol) -> String {
    format!("port = $1 AND protocol = '{}'", protocol.as_str())
}

fn reservation_from_row(row: &Row) -> Result<Reservation, StoreError> {
    let kind: String = get(row, 1)?;
    Ok(Reservation {
        id: get(row, 0)?,
        kind: ReservationKind::parse(&kind).ok_or_else(|| corrupt(format!("unknown kind {kind:?}")))?,
        hostname: get(row, 2)?,
        port: port(row, 3)?,
        owner: get(row, 4)?,
        labels: labels(row, 5)?,
        created_at: get(row, 6)?,
        protocol: {
            let p: String = get(row, 7)?;
            PortProtocol::parse(&p).ok_or_else(|| corrupt(format!("unknown port protocol {p:?}")))?
        },
        url: None,
        certificate: None,
        idle_timeout_seconds: get::<Option<i64>>(row, 8)?.map(|s| s.max(0) as u64),
    })
}

fn certificate_from_row(row: &Row) -> Result<CertificateRecord, StoreError> {
    let status: String = get(row, 1)?;
    let status = match status.as_str() {
        "pending" => StoredCertificateStatus::Pending,
        "ready" => StoredCertificateStatus::Ready,
        "dns_mismatch" => StoredCertificateStatus::DnsMismatch,
        "failed" => StoredCertificateStatus::Failed,
        other => return Err(corrupt(format!("unknown certificate status {other:?}"))),
    };
    let secs = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(get::<Option<i64>>(row, i)?.map(|v| v.max(0) as u64))
    };
    Ok(CertificateRecord {
        hostname: get(row, 0)?,
        status,
        chain_pem: get(row, 2)?,
        key_pem: get(row, 3)?,
        not_before: secs(4)?,
        not_after: secs(5)?,
        last_error: get(row, 6)?,
        failures: u32::try_from(get::<i64>(row, 7)?.max(0)).unwrap_or(u32::MAX),
        next_attempt: secs(8)?.unwrap_or(0),
        updated_at: get(row, 9)?,
    })
}

fn status_str(s: StoredCertificateStatus) -> &'static str {
    match s {
        StoredCertificateStatus::Pending => "pending",
        StoredCertificateStatus::Ready => "ready",
        StoredCertificateStatus::DnsMismatch => "dns_mismatch",
        StoredCertificateStatus::Failed => "failed",
    }
}

fn select_reservation(
    c: &mut impl postgres::GenericClient,
    condition: &str,
    value: &(dyn postgres::types::ToSql + Sync),
) -> Result<Option<Reservation>, StoreError> {
    c.query_opt(&format!("SELECT {RESERVATION_COLUMNS} FROM reservations WHERE {condition}"), &[value])?
        .map(|r| reservation_from_row(&r))
        .transpose()
}

fn insert_api_key(
    tx: &mut Transaction<'_>,
    name: &str,
    scope: ApiKeyScope,
    custom_domains: &[String],
) -> Result<(ApiKey, String), StoreError> {
    let domains_json = serde_json::to_string(custom_domains).expect("strings serialize");
    let prefix = match scope {
        ApiKeyScope::Admin => ADMIN_KEY_PREFIX,
        ApiKeyScope::Endpoints => ENDPOINTS_KEY_PREFIX,
    };
    let secret = new_secret(prefix)?;
    let created_at = now_rfc3339();
    // A taken id is a unique violation: the whole transaction is tried again.
    let id = fresh_id("ak_")?;
    tx.execute(
        "INSERT INTO api_keys (id, name, scope, secret_hash, created_at, custom_domains) VALUES ($1, $2, $3, $4, $5, $6)",
        &[&id, &name, &scope.as_str(), &hash_secret(&secret), &created_at, &domains_json],
    )?;
    let key = ApiKey {
        id,
        name: name.to_string(),
        scope,
        created_at,
        revoked_at: None,
        custom_domains: custom_domains.to_vec(),
        quota: (scope == ApiKeyScope::Endpoints).then_some(Quota::DEFAULT),
    };
    Ok((key, secret))
}

/// Sets what `quota` gives of a key's quota; the key as it is now.
fn set_quota(tx: &mut Transaction<'_>, id: &str, quota: &QuotaUpdate) -> Result<ApiKey, StoreError> {
    let v = |v: Option<u32>| v.map(i64::from);
    tx.query_opt(
        &format!(
            "UPDATE api_keys SET max_reservations = coalesce($2, max_reservations),
                 max_labels = coalesce($3, max_labels), max_label_bytes = coalesce($4, max_label_bytes)
             WHERE id = $1 RETURNING {API_KEY_COLUMNS}"
        ),
        &[&id, &v(quota.reservations), &v(quota.labels), &v(quota.label_bytes)],
    )?
    .map(|r| api_key_from_row(&r))
    .transpose()?
    .ok_or_else(|| StoreError::NotFound { what: format!("api key {id}") })
}

/// Refuses a new reservation for `owner` when it holds its quota's worth.
fn check_reservation_quota(tx: &mut Transaction<'_>, owner: &str) -> Result<(), StoreError> {
    let key = tx.query_opt("SELECT scope, max_reservations FROM api_keys WHERE id = $1", &[&owner])?;
    let Some(key) = key.filter(|r| r.get::<_, String>(0) == ApiKeyScope::Endpoints.as_str()) else {
        return Ok(()); // admin keys have no quota (an unknown owner fails on insert)
    };
    let limit = get::<Option<i64>>(&key, 1)?
        .map_or(Quota::DEFAULT.reservations, |m| m.clamp(0, i64::from(u32::MAX)) as u32);
    let held: i64 = tx.query_one("SELECT count(*) FROM reservations WHERE owner = $1", &[&owner])?.get(0);
    if held >= i64::from(limit) {
        return Err(StoreError::QuotaExceeded { owner: owner.to_string(), limit });
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn insert_reservation(
    tx: &mut Transaction<'_>,
    kind: ReservationKind,
    hostname: Option<&str>,
    port: Option<u16>,
    protocol: PortProtocol,
    owner: &str,
    labels: &Labels,
) -> Result<Reservation, StoreError> {
    check_reservation_quota(tx, owner)?;
    let created_at = now_rfc3339();
    let id = fresh_id("rs_")?;
    tx.execute(
        "INSERT INTO reservations (id, kind, hostname, port, owner, labels, created_at, protocol)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &id,
            &kind.as_str(),
            &hostname,
            &port.map(i64::from),
            &owner,
            &labels_to_json(labels)?,
            &created_at,
            &protocol.as_str(),
        ],
    )?;
    Ok(Reservation {
        id,
        kind,
        hostname: hostname.map(str::to_string),
        port,
        labels: labels.clone(),
        owner: owner.to_string(),
        created_at,
        protocol,
        url: None,
        certificate: None,
        idle_timeout_seconds: None,
    })
}

impl Keys for Postgres {
    fn ensure_admin_key(&self) -> Result<Option<String>, StoreError> {
        self.write(|tx| {
            let live: i64 = tx
                .query_one("SELECT count(*) FROM api_keys WHERE scope = 'admin' AND revoked_at IS NULL", &[])?
                .get(0);
            if live > 0 {
                return Ok(None);
            }
            Ok(Some(insert_api_key(tx, INITIAL_ADMIN_KEY_NAME, ApiKeyScope::Admin, &[])?.1))
        })
    }

    fn create_api_key_with(
        &self,
        name: &str,
        scope: ApiKeyScope,
        custom_domains: &[String],
        quota: &QuotaUpdate,
    ) -> Result<(ApiKey, String), StoreError> {
        self.write(|tx| {
            let (key, secret) = insert_api_key(tx, name, scope, custom_domains)?;
            let key = if quota.is_empty() { key } else { set_quota(tx, &key.id, quota)? };
            Ok((key, secret))
        })
    }

    fn update_api_key_quota(&self, id: &str, quota: &QuotaUpdate) -> Result<ApiKey, StoreError> {
        self.write(|tx| set_quota(tx, id, quota))
    }

    fn set_api_key_custom_domains(&self, id: &str, custom_domains: &[String]) -> Result<ApiKey, StoreError> {
        let domains_json = serde_json::to_string(custom_domains).expect("strings serialize");
        self.write(|tx| {
            tx.query_opt(
                &format!("UPDATE api_keys SET custom_domains = $2 WHERE id = $1 RETURNING {API_KEY_COLUMNS}"),
                &[&id, &domains_json],
            )?
            .map(|r| api_key_from_row(&r))
            .transpose()?
            .ok_or_else(|| StoreError::NotFound { what: format!("api key {id}") })
        })
    }

    fn api_keys(&self) -> Result<Vec<ApiKey>, StoreError> {
        self.read(|c| {
            c.query(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys ORDER BY seq"), &[])?
                .iter()
                .map(api_key_from_row)
                .collect()
        })
    }

    fn api_key(&self, id: &str) -> Result<Option<ApiKey>, StoreError> {
        self.read(|c| {
            c.query_opt(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = $1"), &[&id])?
                .map(|r| api_key_from_row(&r))
                .transpose()
        })
    }

    fn revoke_api_key(&self, id: &str) -> Result<ApiKey, StoreError> {
        self.write(|tx| {
            let key = tx
                .query_opt(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = $1"), &[&id])?
                .map(|r| api_key_from_row(&r))
                .transpose()?
                .ok_or_else(|| StoreError::NotFound { what: format!("api key {id}") })?;
            if key.revoked_at.is_some() {
                return Ok(key);
            }
            if key.scope == ApiKeyScope::Admin {
                let others: i64 = tx
                    .query_one(
                        "SELECT count(*) FROM api_keys WHERE scope = 'admin' AND revoked_at IS NULL AND id <> $1",
                        &[&id],
                    )?
                    .get(0);
                if others == 0 {
                    return Err(StoreError::LastAdminKey { id: id.to_string() });
                }
            }
            let now = now_rfc3339();
            tx.execute("UPDATE api_keys SET revoked_at = $2 WHERE id = $1", &[&id, &now])?;
            if key.scope == ApiKeyScope::Endpoints {
                // A tenant's key is gone: so are the tunnel keys it made and those of its reservations.
                tx.execute(
                    "UPDATE tunnel_keys SET revoked_at = $2 WHERE (created_by = $1 OR owner = $1) AND revoked_at IS NULL",
                    &[&id, &now],
                )?;
            }
            Ok(ApiKey { revoked_at: Some(now), ..key })
        })
    }

    fn authenticate_api_key(&self, secret: &str) -> Result<ApiKeyAuth, StoreError> {
        let secret = secret.trim();
        if secret.starts_with(TUNNEL_KEY_PREFIX) {
            return Ok(ApiKeyAuth::TunnelKey);
        }
        let hash = hash_secret(secret);
        self.read(|c| {
            let key = c
                .query_opt(
                    &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE secret_hash = $1"),
                    &[&hash],
                )?
                .map(|r| api_key_from_row(&r))
                .transpose()?;
            Ok(match key {
                Some(key) if key.revoked_at.is_some() => ApiKeyAuth::Revoked(key),
                Some(key) => ApiKeyAuth::Valid(key),
                None => match c.query_opt("SELECT id FROM tunnel_keys WHERE secret_hash = $1", &[&hash])? {
                    Some(_) => ApiKeyAuth::TunnelKey,
                    None => ApiKeyAuth::Unknown,
                },
            })
        })
    }

    fn authenticate_tunnel_key(&self, secret: &str) -> Result<TunnelKeyAuth, StoreError> {
        let secret = secret.trim();
        if secret.starts_with(ADMIN_KEY_PREFIX) || secret.starts_with(ENDPOINTS_KEY_PREFIX) {
            return Ok(TunnelKeyAuth::NotATunnelKey);
        }
        let hash = hash_secret(secret);
        self.read(|c| {
            let found = c.query_opt(
                "SELECT id, protocol, reservation_id, revoked_at FROM tunnel_keys WHERE secret_hash = $1",
                &[&hash],
            )?;
            let Some(row) = found else {
                return Ok(
                    match c.query_opt("SELECT id FROM api_keys WHERE secret_hash = $1", &[&hash])? {
                        Some(_) => TunnelKeyAuth::NotATunnelKey,
                        None => TunnelKeyAuth::Unknown,
                    },
                );
            };
            let (key_id, protocol, reservation_id, revoked_at): (String, String, String, Option<String>) =
                (get(&row, 0)?, get(&row, 1)?, get(&row, 2)?, get(&row, 3)?);
            if revoked_at.is_some() {
                return Ok(TunnelKeyAuth::Revoked);
            }
            let protocol = Protocol::parse(&protocol)
                .ok_or_else(|| corrupt(format!("tunnel key {key_id} has protocol {protocol:?}")))?;
            Ok(match select_reservation(c, "id = $1", &reservation_id)? {
                Some(reservation) => TunnelKeyAuth::Valid(TunnelGrant { key_id, protocol, reservation }),
                None => TunnelKeyAuth::Revoked,
            })
        })
    }

    fn create_tunnel_key(
        &self,
        reservation_id: &str,
        protocol: Protocol,
        labels: &Labels,
        created_by: &str,
    ) -> Result<(TunnelKey, String), StoreError> {
        let labels_json = labels_to_json(labels)?;
        self.write(|tx| {
            let reservation = select_reservation(tx, "id = $1", &reservation_id)?
                .ok_or_else(|| StoreError::NotFound { what: format!("reservation {reservation_id}") })?;
            let secret = new_secret(TUNNEL_KEY_PREFIX)?;
            let created_at = now_rfc3339();
            let id = fresh_id("tk_")?;
            tx.execute(
                "INSERT INTO tunnel_keys (id, secret_hash, protocol, reservation_id, kind, hostname, port, owner, created_by, labels, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                &[
                    &id,
                    &hash_secret(&secret),
                    &protocol.as_str(),
                    &reservation.id,
                    &reservation.kind.as_str(),
                    &reservation.hostname,
                    &reservation.port.map(i64::from),
                    &reservation.owner,
                    &created_by,
                    &labels_json,
                    &created_at,
                ],
            )?;
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
        })
    }

    fn tunnel_keys(&self, include_revoked: bool) -> Result<Vec<TunnelKey>, StoreError> {
        let filter = if include_revoked { "" } else { "WHERE revoked_at IS NULL" };
        self.read(|c| {
            c.query(&format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys {filter} ORDER BY seq"), &[])?
                .iter()
                .map(tunnel_key_from_row)
                .collect()
        })
    }

    fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, StoreError> {
        self.read(|c| {
            c.query_opt(&format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys WHERE id = $1"), &[&id])?
                .map(|r| tunnel_key_from_row(&r))
                .transpose()
        })
    }

    fn revoke_tunnel_key(&self, id: &str) -> Result<TunnelKey, StoreError> {
        self.write(|tx| {
            let key = tx
                .query_opt(&format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys WHERE id = $1"), &[&id])?
                .map(|r| tunnel_key_from_row(&r))
                .transpose()?
                .ok_or_else(|| StoreError::NotFound { what: format!("tunnel key {id}") })?;
            if key.revoked_at.is_some() {
                return Ok(key);
            }
            let now = now_rfc3339();
            tx.execute("UPDATE tunnel_keys SET revoked_at = $2 WHERE id = $1", &[&id, &now])?;
            Ok(TunnelKey { revoked_at: Some(now), ..key })
        })
    }

    fn live_tunnel_key_ids(&self) -> Result<HashSet<String>, StoreError> {
        self.read(|c| {
            c.query("SELECT id FROM tunnel_keys WHERE revoked_at IS NULL", &[])?
                .iter()
                .map(|r| get(r, 0))
                .collect()
        })
    }
}

impl Reservations for Postgres {
    fn reserve_domain(
        &self,
        kind: ReservationKind,
        hostname: &str,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        if kind == ReservationKind::Tcp {
            return Err(StoreError::Corrupt("a tcp reservation has no host name".into()));
        }
        self.write(|tx| {
            if let Some(existing) = select_reservation(tx, "hostname = $1", &hostname)? {
                return held_by(existing, owner);
            }
            Ok((insert_reservation(tx, kind, Some(hostname), None, PortProtocol::Tcp, owner, labels)?, true))
        })
    }

    fn reserve_usable_port(
        &self,
        port: Option<u16>,
        protocol: PortProtocol,
        range: PortRange,
        owner: &str,
        labels: &Labels,
        usable: &dyn Fn(u16) -> bool,
    ) -> Result<(Reservation, bool), StoreError> {
        self.write(|tx| {
            let port = match port {
                Some(port) => {
                    if !range.contains(port) {
                        return Err(StoreError::PortOutOfRange { port, range });
                    }
                    if let Some(existing) = select_reservation(tx, &port_is(protocol), &i64::from(port))? {
                        return held_by(existing, owner);
                    }
                    if !usable(port) {
                        return Err(StoreError::PortInUse { port });
                    }
                    port
                }
                None => {
                    let taken: HashSet<i64> = tx
                        .query(
                            "SELECT port FROM reservations WHERE port BETWEEN $1 AND $2 AND protocol = $3",
                            &[&i64::from(range.first), &i64::from(range.last), &protocol.as_str()],
                        )?
                        .iter()
                        .map(|r| get(r, 0))
                        .collect::<Result<_, _>>()?;
                    (range.first..=range.last)
                        .find(|&p| !taken.contains(&i64::from(p)) && usable(p))
                        .ok_or(StoreError::NoFreePort { range })?
                }
            };
            Ok((
                insert_reservation(tx, ReservationKind::Tcp, None, Some(port), protocol, owner, labels)?,
                true,
            ))
        })
    }

    fn reservations(&self) -> Result<Vec<Reservation>, StoreError> {
        self.read(|c| {
            c.query(
                &format!(
                    "SELECT {RESERVATION_COLUMNS} FROM reservations ORDER BY port NULLS FIRST, hostname"
                ),
                &[],
            )?
            .iter()
            .map(reservation_from_row)
            .collect()
        })
    }

    fn reservation_by_hostname(&self, hostname: &str) -> Result<Option<Reservation>, StoreError> {
        self.read(|c| select_reservation(c, "hostname = $1", &hostname))
    }

    fn reservation_by_port_of(
        &self,
        port: u16,
        protocol: PortProtocol,
    ) -> Result<Option<Reservation>, StoreError> {
        self.read(|c| select_reservation(c, &port_is(protocol), &i64::from(port)))
    }

    fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        self.read(|c| select_reservation(c, "id = $1", &id))
    }

    fn set_idle_timeout(&self, id: &str, seconds: Option<u64>) -> Result<Reservation, StoreError> {
        let seconds = seconds.map(|s| s.min(i64::MAX as u64) as i64);
        self.write(|tx| {
            tx.query_opt(
                &format!(
                    "UPDATE reservations SET idle_timeout_seconds = $2 WHERE id = $1 RETURNING {RESERVATION_COLUMNS}"
                ),
                &[&id, &seconds],
            )?
            .map(|r| reservation_from_row(&r))
            .transpose()?
            .ok_or_else(|| StoreError::NotFound { what: format!("reservation {id}") })
        })
    }

    fn release_reservation(&self, id: &str) -> Result<(Reservation, Vec<String>), StoreError> {
        self.write(|tx| {
            let reservation = select_reservation(tx, "id = $1", &id)?
                .ok_or_else(|| StoreError::NotFound { what: format!("reservation {id}") })?;
            let revoked: Vec<String> = tx
                .query(
                    "UPDATE tunnel_keys SET revoked_at = $2 WHERE reservation_id = $1 AND revoked_at IS NULL
                     RETURNING id, seq",
                    &[&id, &now_rfc3339()],
                )?
                .iter()
                .map(|r| Ok((get::<i64>(r, 1)?, get::<String>(r, 0)?)))
                .collect::<Result<std::collections::BTreeMap<_, _>, StoreError>>()?
                .into_values()
                .collect();
            tx.execute("DELETE FROM reservations WHERE id = $1", &[&id])?;
            if let Some(hostname) = &reservation.hostname {
                tx.execute("DELETE FROM certificates WHERE hostname = $1", &[hostname])?;
            }
            Ok((reservation, revoked))
        })
    }
}

impl Certificates for Postgres {
    fn acme_account(&self, directory: &str) -> Result<Option<String>, StoreError> {
        self.read(|c| {
            c.query_opt("SELECT credentials FROM acme_accounts WHERE directory = $1", &[&directory])?
                .map(|r| get(&r, 0))
                .transpose()
        })
    }

    fn put_acme_account(&self, directory: &str, credentials: &str) -> Result<String, StoreError> {
        self.write(|tx| {
            tx.execute(
                "INSERT INTO acme_accounts (directory, credentials, created_at) VALUES ($1, $2, $3)
                 ON CONFLICT (directory) DO NOTHING",
                &[&directory, &credentials, &now_rfc3339()],
            )?;
            get(
                &tx.query_one("SELECT credentials FROM acme_accounts WHERE directory = $1", &[&directory])?,
                0,
            )
        })
    }

    fn certificates(&self) -> Result<Vec<CertificateRecord>, StoreError> {
        self.read(|c| {
            c.query(&format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates ORDER BY hostname"), &[])?
                .iter()
                .map(certificate_from_row)
                .collect()
        })
    }

    fn certificate(&self, hostname: &str) -> Result<Option<CertificateRecord>, StoreError> {
        self.read(|c| {
            c.query_opt(
                &format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates WHERE hostname = $1"),
                &[&hostname],
            )?
            .map(|r| certificate_from_row(&r))
            .transpose()
        })
    }

    fn put_certificate(&self, c: &CertificateRecord) -> Result<bool, StoreError> {
        let own = c.hostname.starts_with("*.");
        let secs = |v: Option<u64>| v.map(|v| v as i64);
        self.write(|tx| {
            let reserved: i64 = tx
                .query_one(
                    "SELECT count(*) FROM reservations WHERE hostname = $1 AND kind = 'custom'",
                    &[&c.hostname],
                )?
                .get(0);
            if reserved == 0 && !own {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO certificates (hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
                 ON CONFLICT (hostname) DO UPDATE SET status = excluded.status, chain_pem = excluded.chain_pem,
                     key_pem = excluded.key_pem, not_before = excluded.not_before, not_after = excluded.not_after,
                     last_error = excluded.last_error, failures = excluded.failures,
                     next_attempt = excluded.next_attempt, updated_at = excluded.updated_at",
                &[
                    &c.hostname,
                    &status_str(c.status),
                    &c.chain_pem,
                    &c.key_pem,
                    &secs(c.not_before),
                    &secs(c.not_after),
                    &c.last_error,
                    &i64::from(c.failures),
                    &(c.next_attempt as i64),
                    &now_rfc3339(),
                ],
            )?;
            Ok(true)
        })
    }

    fn delete_certificate(&self, hostname: &str) -> Result<(), StoreError> {
        self.write(|tx| {
            tx.execute("DELETE FROM certificates WHERE hostname = $1", &[&hostname])?;
            Ok(())
        })
    }

    // Single statements, no NOTIFY: the other edges read challenges when
    // the CA asks them (nothing to reload).
    fn put_challenge(&self, c: &Challenge) -> Result<(), StoreError> {
        let now = unix_now() as i64;
        self.with_client(|client| {
            client.execute("DELETE FROM acme_challenges WHERE expires_at <= $1", &[&now])?;
            let upsert = client.execute(
                "INSERT INTO acme_challenges (kind, name, value, expires_at) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (kind, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at",
                &[&c.kind.as_str(), &c.name, &c.value, &(c.expires_at as i64)],
            );
            match upsert {
                Ok(_) => Ok(()),
                // Two first inserts at once (one order's answer twice): the same row.
                Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn challenge(&self, kind: ChallengeKind, name: &str) -> Result<Option<String>, StoreError> {
        let now = unix_now() as i64;
        self.read(|c| {
            c.query_opt(
                "SELECT value FROM acme_challenges WHERE kind = $1 AND name = $2 AND expires_at > $3",
                &[&kind.as_str(), &name, &now],
            )?
            .map(|r| get(&r, 0))
            .transpose()
        })
    }

    fn delete_challenge(&self, kind: ChallengeKind, name: &str) -> Result<(), StoreError> {
        self.read(|c| {
            c.execute("DELETE FROM acme_challenges WHERE kind = $1 AND name = $2", &[&kind.as_str(), &name])?;
            Ok(())
        })
    }
}

impl Engine for Postgres {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn schema_version(&self) -> Result<u32, StoreError> {
        self.read(|c| {
            Ok(c.query_one("SELECT version FROM culvert_schema", &[])?.get::<_, i32>(0).max(0) as u32)
        })
    }

    fn watch(&self, on_change: ChangeCallback, stop: CancellationToken) {
        let (config, tls, display) = (self.config.clone(), self.tls.clone(), self.display.clone());
        let spawned = std::thread::Builder::new().name("culvert-store-feed".into()).spawn(move || {
            feed(&config, &tls, &display, &*on_change, &stop);
        });
        if let Err(e) = spawned {
            warn!(error = %e, "could not start the store's change feed; changes by other edges are seen by the periodic re-read only");
        }
    }

    fn try_lease(&self, name: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        let now = unix_now() as i64;
        let until = now + ttl.as_secs() as i64;
        // One statement: atomic without a transaction of our own, and no NOTIFY.
        self.with_client(|c| {
            let changed = c.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3)
                 ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at
                 WHERE leases.holder = excluded.holder OR leases.expires_at <= $4",
                &[&name, &holder, &until, &now],
            );
            match changed {
                Ok(n) => Ok(n == 1),
                // Two first inserts of one name at once: the other one has it.
                Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => Ok(false),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        self.read(|c| {
            c.execute("DELETE FROM leases WHERE name = $1 AND holder = $2", &[&name, &holder])?;
            Ok(())
        })
    }

    fn export(&self) -> Result<Snapshot, StoreError> {
        self.read(|c| {
            let mut tx = c
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()?;
            let mut s = Snapshot::default();
            for r in
                tx.query(&format!("SELECT {API_KEY_COLUMNS}, secret_hash FROM api_keys ORDER BY seq"), &[])?
            {
                s.api_keys.push(ApiKeyRow { key: api_key_from_row(&r)?, secret_hash: get(&r, 9)? });
            }
            for r in tx.query(&format!("SELECT {RESERVATION_COLUMNS} FROM reservations ORDER BY seq"), &[])? {
                s.reservations.push(reservation_from_row(&r)?);
            }
            for r in tx.query(
                &format!(
                    "SELECT {TUNNEL_KEY_COLUMNS}, secret_hash, created_by FROM tunnel_keys ORDER BY seq"
                ),
                &[],
            )? {
                s.tunnel_keys.push(TunnelKeyRow {
                    key: tunnel_key_from_row(&r)?,
                    secret_hash: get(&r, 10)?,
                    created_by: get(&r, 11)?,
                });
            }
            for r in tx.query(
                "SELECT directory, credentials, created_at FROM acme_accounts ORDER BY directory",
                &[],
            )? {
                s.acme_accounts.push((get(&r, 0)?, get(&r, 1)?, get(&r, 2)?));
            }
            for r in
                tx.query(&format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates ORDER BY hostname"), &[])?
            {
                s.certificates.push(certificate_from_row(&r)?);
            }
            tx.commit()?;
            Ok(s)
        })
    }

    fn import(&self, s: &Snapshot) -> Result<(), StoreError> {
        self.write(|tx| {
            let rows: i64 = tx
                .query_one(
                    "SELECT (SELECT count(*) FROM api_keys) + (SELECT count(*) FROM reservations)
                          + (SELECT count(*) FROM tunnel_keys) + (SELECT count(*) FROM certificates)",
                    &[],
                )?
                .get(0);
            if rows > 0 {
                return Err(StoreError::BadLocation(
                    "the PostgreSQL database already holds culvert data; migrate into an empty database".into(),
                ));
            }
            for k in &s.api_keys {
                let quota = |f: fn(&Quota) -> u32| k.key.quota.as_ref().map(|q| i64::from(f(q)));
                tx.execute(
                    "INSERT INTO api_keys (id, name, scope, secret_hash, created_at, revoked_at, custom_domains, max_reservations, max_labels, max_label_bytes)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                    &[
                        &k.key.id,
                        &k.key.name,
                        &k.key.scope.as_str(),
                        &k.secret_hash,
                        &k.key.created_at,
                        &k.key.revoked_at,
                        &serde_json::to_string(&k.key.custom_domains).expect("strings serialize"),
                        &quota(|q| q.reservations),
                        &quota(|q| q.labels),
                        &quota(|q| q.label_bytes),
                    ],
                )?;
            }
            for r in &s.reservations {
                tx.execute(
                    "INSERT INTO reservations (id, kind, hostname, port, owner, labels, created_at, protocol, idle_timeout_seconds) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                    &[&r.id, &r.kind.as_str(), &r.hostname, &r.port.map(i64::from), &r.owner, &labels_to_json(&r.labels)?, &r.created_at, &r.protocol.as_str(), &r.idle_timeout_seconds.map(|s| s.min(i64::MAX as u64) as i64)],
                )?;
            }
            for t in &s.tunnel_keys {
                let k = &t.key;
                tx.execute(
                    "INSERT INTO tunnel_keys (id, secret_hash, protocol, reservation_id, kind, hostname, port, owner, created_by, labels, created_at, revoked_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                    &[
                        &k.id,
                        &t.secret_hash,
                        &k.protocol.as_str(),
                        &k.reservation.id,
                        &k.reservation.kind.as_str(),
                        &k.reservation.hostname,
                        &k.reservation.port.map(i64::from),
                        &k.owner,
                        &t.created_by,
                        &labels_to_json(&k.labels)?,
                        &k.created_at,
                        &k.revoked_at,
                    ],
                )?;
            }
            for (directory, credentials, created_at) in &s.acme_accounts {
                tx.execute(
                    "INSERT INTO acme_accounts (directory, credentials, created_at) VALUES ($1, $2, $3)",
                    &[directory, credentials, created_at],
                )?;
            }
            let secs = |v: Option<u64>| v.map(|v| v as i64);
            for c in &s.certificates {
                tx.execute(
                    "INSERT INTO certificates (hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                    &[
                        &c.hostname,
                        &status_str(c.status),
                        &c.chain_pem,
                        &c.key_pem,
                        &secs(c.not_before),
                        &secs(c.not_after),
                        &c.last_error,
                        &i64::from(c.failures),
                        &(c.next_attempt as i64),
                        &c.updated_at,
                    ],
                )?;
            }
            Ok(())
        })
    }
}

/// The change feed: LISTEN on its own connection, call back on every
/// notification and after every (re)connection, reconnect with a short
/// backoff, until `stop`.
fn feed(
    config: &postgres::Config,
    tls: &Tls,
    url: &str,
    on_change: &(dyn Fn() + Send + Sync),
    stop: &CancellationToken,
) {
    let mut backoff = Duration::from_millis(50);
    let mut was_down = false;
    while !stop.is_cancelled() {
        let mut client = match config.connect(tls.clone()) {
            Ok(c) => c,
            Err(e) => {
                if !was_down {
                    warn!(store = %url, error = %describe(&e), "store change feed: PostgreSQL unreachable; retrying");
                    was_down = true;
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(FEED_MAX_BACKOFF);
                continue;
            }
        };
        if let Err(e) = client.batch_execute(&format!("LISTEN {CHANNEL}")) {
            warn!(error = %describe(&e), "store change feed: LISTEN failed; retrying");
            std::thread::sleep(backoff);
            continue;
        }
        if was_down {
            info!(store = %url, "store change feed: PostgreSQL reachable again; catching up");
            was_down = false;
        }
        backoff = Duration::from_millis(50);
        // What changed while the feed was away (or before it started).
        on_change();
        loop {
            if stop.is_cancelled() {
                return;
            }
            let next = {
                let mut notifications = client.notifications();
                let next = notifications.timeout_iter(FEED_TICK).next();
                if let Ok(Some(_)) = next {
                    // Coalesce a burst into one call.
                    while let Ok(Some(_)) = notifications.iter().next() {}
                }
                next.map(|n| n.is_some())
            };
            match next {
                Ok(true) => on_change(),
                Ok(false) if client.is_closed() => break,
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %describe(&e), "store change feed: connection lost; reconnecting");
                    was_down = true;
                    break;
                }
            }
        }
    }
}

/// rustls for the database connection, after `sslmode`.
#[derive(Clone)]
pub struct Tls {
    config: Option<Arc<rustls::ClientConfig>>,
}

impl Tls {
    fn new(params: TlsParams) -> Result<Tls, StoreError> {
        let TlsParams { mode, root, cert, key } = params;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::BadLocation(format!("TLS for the store: {e}")))?;
        let roots = || {
            crate::tls::root_store(root.as_deref())
                .map(Arc::new)
                .map_err(|e| StoreError::BadLocation(format!("sslrootcert: {e}")))
        };
        let verifier = |roots| {
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| StoreError::BadLocation(format!("TLS for the store: {e}")))
        };
        let builder = match mode {
            SslMode::Disable => return Ok(Tls { config: None }),
            SslMode::Prefer | SslMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(crate::tls::AnyCertificate(provider.clone()))),
            SslMode::VerifyCa => {
                builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly(verifier(roots()?)?)))
            }
            SslMode::VerifyFull => builder.with_webpki_verifier(verifier(roots()?)?),
        };
        let config = match (cert, key) {
            (Some(cert), Some(key)) => {
                let bad = |what: &str, e: String| StoreError::BadLocation(format!("{what}: {e}"));
                let chain = crate::tls::load_pem_certs(&cert).map_err(|e| bad("sslcert", e.to_string()))?;
                let key = crate::tls::load_pem_key(&key).map_err(|e| bad("sslkey", e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| bad("sslcert and sslkey", e.to_string()))?
            }
            _ => builder.with_no_client_auth(),
        };
        Ok(Tls { config: Some(Arc::new(config)) })
    }
}

/// `sslmode=verify-ca`: the chain must lead to a trusted root; the name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

impl MakeTlsConnect<Socket> for Tls {
    type Stream = TlsStream;
    type TlsConnect = TlsConnector;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<TlsConnector, io::Error> {
        let name = ServerName::try_from(domain.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{domain}: {e}")))?;
        Ok(TlsConnector { config: self.config.clone(), name })
    }
}

/// One TLS handshake (`None`: `sslmode=disable`, never asked to).
pub struct TlsConnector {
    config: Option<Arc<rustls::ClientConfig>>,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for TlsConnector {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let config = self.config.ok_or_else(|| {
                io::Error::new(io::ErrorKind::Unsupported, "TLS is disabled (sslmode=disable)")
            })?;
            let tls = tokio_rustls::TlsConnector::from(config).connect(self.name, stream).await?;
            Ok(TlsStream(Box::new(tls)))
        })
    }
}

/// A TLS connection to the database.
pub struct TlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted_and_sslmode_parsed() {
        assert_eq!(
            redact("postgres://u:secret@db:5432/c?sslmode=require"),
            "postgres://u:***@db:5432/c?sslmode=require"
        );
        assert_eq!(redact("postgres://u@db/c"), "postgres://u@db/c");
        let (config, params) = parse_url(
            "postgres://u:p@db.example:6543/culvert?sslmode=verify-full&sslrootcert=/etc/ca%20x.pem&sslcert=/c.pem&sslkey=/k.pem",
        )
        .unwrap();
        assert_eq!(params.mode, SslMode::VerifyFull);
        assert_eq!(params.root, Some(PathBuf::from("/etc/ca x.pem")));
        assert_eq!((params.cert, params.key), (Some(PathBuf::from("/c.pem")), Some(PathBuf::from("/k.pem"))));
        assert_eq!(config.get_ports(), &[6543]);
        assert_eq!(config.get_dbname(), Some("culvert"));
        assert_eq!(config.get_ssl_mode(), postgres::config::SslMode::Require);
        assert_eq!(parse_url("postgres://u@db/c").unwrap().1.mode, SslMode::Prefer);
        let err = parse_url("postgres://u@db/c?sslcert=/c.pem").unwrap_err();
        assert!(err.to_string().contains("give both sslcert and sslkey"), "{err}");
        let err = parse_url("postgres://u@db/c?sslmode=disable&sslcert=/c.pem&sslkey=/k.pem").unwrap_err();
        assert!(err.to_string().contains("needs TLS"), "{err}");
        let err = parse_url("postgres://u:hunter2@db/c?sslmode=always").unwrap_err();
        assert!(err.to_string().contains("sslmode=always is not one of"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    /// TLS to a real PostgreSQL with `ssl = on` and a certificate for
    /// `db.example` from a test CA, after each `sslmode`.
    #[test]
    fn tls_after_sslmode() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pki = crate::tls::generate_pki(&["db.example".to_string()]).unwrap();
        let Some(server) = super::super::test_postgres::Postgres::start_tls(&pki.cert_pem, &pki.key_pem)
        else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        let other = dir.path().join("other-ca.pem");
        std::fs::write(&other, crate::tls::generate_pki(&["db.example".to_string()]).unwrap().ca_pem)
            .unwrap();
        let port = server.port;
        // The TLS name is the URL's host; hostaddr says where to connect.
        let url = |host: &str, query: &str| {
            format!("postgres://culvert@{host}:{port}/postgres?hostaddr=127.0.0.1&{query}")
        };
        let open = |u: String| Postgres::open(&u).map(|_| ()).map_err(|e| e.to_string());
        let ca = ca.display();
        open(url("db.example", &format!("sslmode=verify-full&sslrootcert={ca}")))
            .expect("verify-full with the CA");
        open(url("db.example", "sslmode=require")).expect("require: encrypted, not checked");
        open(url("db.example", "sslmode=prefer")).expect("prefer");
        // The name does not match: verify-full refuses, verify-ca (the chain only) accepts.
        let err = open(url("127.0.0.1", &format!("sslmode=verify-full&sslrootcert={ca}"))).unwrap_err();
        assert!(err.contains("the store is unavailable") && err.contains("certificate"), "{err}");
        open(url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}")))
            .expect("verify-ca ignores the name");
        // Another CA, or the built-in roots: refused.
        let err = open(url("db.example", &format!("sslmode=verify-ca&sslrootcert={}", other.display())))
            .unwrap_err();
        assert!(err.contains("certificate"), "{err}");
        let err = open(url("db.example", "sslmode=verify-full")).unwrap_err();
        assert!(err.contains("certificate"), "{err}");
        let err = open(url("db.example", "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")).unwrap_err();
        assert!(err.contains("sslrootcert"), "{err}");
    }

    /// A client certificate (`sslcert`, `sslkey`) against a real PostgreSQL
    /// that takes only TLS with a certificate from its client CA whose name
    /// is the user (`clientcert=verify-full`).
    #[test]
    fn client_certificate_for_clientcert_verify_full() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pki = crate::tls::generate_pki(&["db.example".to_string()]).unwrap();
        let client_ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            (cert.pem(), Issuer::new(params, key))
        };
        let (ca_pem, ca) = client_ca("client CA");
        let (_, other_ca) = client_ca("another client CA");
        let client = |user: &str, issuer: &Issuer<'_, KeyPair>| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, user);
            let key = KeyPair::generate().unwrap();
            (params.signed_by(&key, issuer).unwrap().pem(), key.serialize_pem())
        };
        let Some(server) = super::super::test_postgres::Postgres::start_tls_client_auth(
            &pki.cert_pem,
            &pki.key_pem,
            &ca_pem,
        ) else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, body).unwrap();
            path.display().to_string()
        };
        let root = write("ca.pem", &pki.ca_pem);
        let (cert, key) = client(super::super::test_postgres::USER, &ca);
        let (cert, key) = (write("client.pem", &cert), write("client.key", &key));
        let (wrong_cert, wrong_key) = client("somebody-else", &ca);
        let (wrong_cert, wrong_key) = (write("wrong.pem", &wrong_cert), write("wrong.key", &wrong_key));
        let (foreign_cert, foreign_key) = client(super::super::test_postgres::USER, &other_ca);
        let (foreign_cert, foreign_key) =
            (write("foreign.pem", &foreign_cert), write("foreign.key", &foreign_key));
        let port = server.port;
        let url = |query: &str| {
            format!(
                "postgres://culvert@db.example:{port}/postgres?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={root}{query}"
            )
        };
        let open = |u: String| Postgres::open(&u).map(|_| ()).map_err(|e| e.to_string());
        open(url(&format!("&sslcert={cert}&sslkey={key}"))).expect("the client certificate is accepted");
        let refused = [
            ("no client certificate", url("")),
            ("another user's certificate", url(&format!("&sslcert={wrong_cert}&sslkey={wrong_key}"))),
            ("another CA's certificate", url(&format!("&sslcert={foreign_cert}&sslkey={foreign_key}"))),
        ];
        for (what, u) in refused {
            let err = open(u).expect_err(what);
            assert!(err.contains("the store is unavailable"), "{what}: {err}");
        }
        // A file that is not there: said at once; a key that is not the certificate's: refused.
        let err = open(url(&format!("&sslcert=/nonexistent.pem&sslkey={key}"))).unwrap_err();
        assert!(err.contains("sslcert"), "{err}");
        let err = open(url(&format!("&sslcert={cert}&sslkey={wrong_key}"))).unwrap_err();
        assert!(err.contains("sslcert and sslkey") || err.contains("the store is unavailable"), "{err}");
    }
}
