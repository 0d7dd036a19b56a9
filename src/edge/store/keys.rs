//! API keys and tunnel keys.

use std::collections::HashSet;

use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};

use super::reservations::{RESERVATION_COLUMNS, reservation_from_row, select_reservation};
use super::{
    ADMIN_KEY_PREFIX, ENDPOINTS_KEY_PREFIX, INITIAL_ADMIN_KEY_NAME, Sqlite, StoreError, TUNNEL_KEY_PREFIX,
    hash_secret, insert_with_fresh_id, invalid, labels_column, labels_to_json, new_secret, now_rfc3339,
    port_column,
};
use crate::api::{
    ApiKey, ApiKeyScope, Labels, Protocol, Quota, QuotaUpdate, Reservation, ReservationKind, ReservationRef,
    TunnelKey,
};

/// Result of presenting a tunnel key to the edge.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one short-lived value per handshake
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
/// API keys and tunnel keys.
pub trait Keys {
    /// Creates an admin key if there is no live one (the first start) and
    /// returns its secret, once. `None` when an admin key already exists.
    fn ensure_admin_key(&self) -> Result<Option<String>, StoreError>;

    /// Makes an API key with the custom domains it may reserve (suffixes, or
    /// `*`; endpoints keys only) and its quota (what is not given is the
    /// default); returns it and its secret (shown once).
    fn create_api_key_with(
        &self,
        name: &str,
        scope: ApiKeyScope,
        custom_domains: &[String],
        quota: &QuotaUpdate,
    ) -> Result<(ApiKey, String), StoreError>;

    /// [`create_api_key_with`](Self::create_api_key_with) with no custom
    /// domains and the default quota.
    fn create_api_key(&self, name: &str, scope: ApiKeyScope) -> Result<(ApiKey, String), StoreError> {
        self.create_api_key_with(name, scope, &[], &QuotaUpdate::default())
    }

    /// Changes what `quota` gives of an API key's quota; answers the key.
    fn update_api_key_quota(&self, id: &str, quota: &QuotaUpdate) -> Result<ApiKey, StoreError>;

    /// Replaces the custom domains an API key may reserve; answers the key.
    fn set_api_key_custom_domains(&self, id: &str, custom_domains: &[String]) -> Result<ApiKey, StoreError>;

    /// Every API key, revoked ones included, oldest first.
    fn api_keys(&self) -> Result<Vec<ApiKey>, StoreError>;

    /// One API key by id.
    fn api_key(&self, id: &str) -> Result<Option<ApiKey>, StoreError>;

    /// Revokes an API key (idempotent). The last live admin key cannot be
    /// revoked. Revoking an `endpoints` key also revokes the tunnel keys it
    /// made and those of its reservations.
    fn revoke_api_key(&self, id: &str) -> Result<ApiKey, StoreError>;

    /// Looks an API key up by its secret.
    fn authenticate_api_key(&self, secret: &str) -> Result<ApiKeyAuth, StoreError>;

    /// Looks a tunnel key up by its secret: what it may open, or why not.
    /// An admin or endpoints key (by prefix or by hash) is `NotATunnelKey`.
    fn authenticate_tunnel_key(&self, secret: &str) -> Result<TunnelKeyAuth, StoreError>;

    /// Mints a tunnel key for a reservation; returns it and its secret (shown
    /// once). The key's owner is the reservation's owner; `created_by` is the
    /// API key that asked. Checking that the protocol fits the reservation is
    /// the caller's job.
    fn create_tunnel_key(
        &self,
        reservation_id: &str,
        protocol: Protocol,
        labels: &Labels,
        created_by: &str,
    ) -> Result<(TunnelKey, String), StoreError>;

    /// Tunnel keys, oldest first; revoked ones only if asked.
    fn tunnel_keys(&self, include_revoked: bool) -> Result<Vec<TunnelKey>, StoreError>;

    /// One tunnel key by id.
    fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, StoreError>;

    /// Revokes a tunnel key (idempotent: revoking a revoked key answers it unchanged).
    fn revoke_tunnel_key(&self, id: &str) -> Result<TunnelKey, StoreError>;

    /// Ids of all tunnel keys that are not revoked.
    fn live_tunnel_key_ids(&self) -> Result<HashSet<String>, StoreError>;
}

impl Keys for Sqlite {
    fn ensure_admin_key(&self) -> Result<Option<String>, StoreError> {
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
        let (_, secret) = insert_api_key(&tx, INITIAL_ADMIN_KEY_NAME, ApiKeyScope::Admin, &[])?;
        tx.commit()?;
        Ok(Some(secret))
    }

    fn create_api_key_with(
        &self,
        name: &str,
        scope: ApiKeyScope,
        custom_domains: &[String],
        quota: &QuotaUpdate,
    ) -> Result<(ApiKey, String), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (key, secret) = insert_api_key(&tx, name, scope, custom_domains)?;
        let key = if quota.is_empty() { key } else { set_quota(&tx, &key.id, quota)? };
        tx.commit()?;
        Ok((key, secret))
    }

    fn update_api_key_quota(&self, id: &str, quota: &QuotaUpdate) -> Result<ApiKey, StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let key = set_quota(&tx, id, quota)?;
        tx.commit()?;
        Ok(key)
    }

    fn set_api_key_custom_domains(&self, id: &str, custom_domains: &[String]) -> Result<ApiKey, StoreError> {
        let conn = self.lock();
        let domains_json = serde_json::to_string(custom_domains).expect("strings serialize");
        let changed =
            conn.execute("UPDATE api_keys SET custom_domains = ?2 WHERE id = ?1", params![id, domains_json])?;
        updated_api_key(&conn, id, changed)
    }

    fn api_keys(&self) -> Result<Vec<ApiKey>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys ORDER BY rowid"))?;
        let keys = stmt.query_map([], api_key_from_row)?.collect::<Result<_, _>>()?;
        Ok(keys)
    }

    fn api_key(&self, id: &str) -> Result<Option<ApiKey>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"),
                [id],
                api_key_from_row,
            )
            .optional()?)
    }

    fn revoke_api_key(&self, id: &str) -> Result<ApiKey, StoreError> {
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
        if key.scope == ApiKeyScope::Endpoints {
            // A tenant's key is gone: so are the tunnel keys it made and those of its reservations.
            tx.execute(
                "UPDATE tunnel_keys SET revoked_at = ?2 WHERE (created_by = ?1 OR owner = ?1) AND revoked_at IS NULL",
                params![id, now],
            )?;
        }
        tx.commit()?;
        Ok(ApiKey { revoked_at: Some(now), ..key })
    }

    fn authenticate_api_key(&self, secret: &str) -> Result<ApiKeyAuth, StoreError> {
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

    fn authenticate_tunnel_key(&self, secret: &str) -> Result<TunnelKeyAuth, StoreError> {
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

    fn create_tunnel_key(
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

    fn tunnel_keys(&self, include_revoked: bool) -> Result<Vec<TunnelKey>, StoreError> {
        let conn = self.lock();
        let filter = if include_revoked { "" } else { "WHERE revoked_at IS NULL" };
        let mut stmt =
            conn.prepare(&format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys {filter} ORDER BY rowid"))?;
        let keys = stmt.query_map([], tunnel_key_from_row)?.collect::<Result<_, _>>()?;
        Ok(keys)
    }

    fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                &format!("SELECT {TUNNEL_KEY_COLUMNS} FROM tunnel_keys WHERE id = ?1"),
                [id],
                tunnel_key_from_row,
            )
            .optional()?)
    }

    fn revoke_tunnel_key(&self, id: &str) -> Result<TunnelKey, StoreError> {
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

    fn live_tunnel_key_ids(&self) -> Result<HashSet<String>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT id FROM tunnel_keys WHERE revoked_at IS NULL")?;
        let ids = stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
        Ok(ids)
    }
}

fn insert_api_key(
    conn: &Connection,
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
    let id = insert_with_fresh_id("ak_", |id| {
        conn.execute(
            "INSERT INTO api_keys (id, name, scope, secret_hash, created_at, custom_domains) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![id, name, scope.as_str(), hash_secret(&secret), created_at, domains_json],
        )
    })?;
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
fn set_quota(conn: &Connection, id: &str, quota: &QuotaUpdate) -> Result<ApiKey, StoreError> {
    let changed = conn.execute(
        "UPDATE api_keys SET max_reservations = coalesce(?2, max_reservations),
             max_labels = coalesce(?3, max_labels), max_label_bytes = coalesce(?4, max_label_bytes)
         WHERE id = ?1",
        params![id, quota.reservations, quota.labels, quota.label_bytes],
    )?;
    updated_api_key(conn, id, changed)
}

/// The key `id` after an UPDATE that changed `changed` rows (0: no such key).
fn updated_api_key(conn: &Connection, id: &str, changed: usize) -> Result<ApiKey, StoreError> {
    if changed == 0 {
        return Err(StoreError::NotFound { what: format!("api key {id}") });
    }
    Ok(conn.query_row(
        &format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"),
        [id],
        api_key_from_row,
    )?)
}

/// Refuses a new reservation for `owner` when it holds its quota's worth.
pub(super) fn check_reservation_quota(conn: &Connection, owner: &str) -> Result<(), StoreError> {
    let key: Option<(String, Option<i64>)> = conn
        .query_row("SELECT scope, max_reservations FROM api_keys WHERE id = ?1", [owner], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    let Some((_, max)) = key.filter(|(scope, _)| scope == ApiKeyScope::Endpoints.as_str()) else {
        return Ok(()); // admin keys have no quota (an unknown owner fails on insert)
    };
    let limit = max.map_or(Quota::DEFAULT.reservations, |m| m.clamp(0, i64::from(u32::MAX)) as u32);
    let held: i64 =
        conn.query_row("SELECT count(*) FROM reservations WHERE owner = ?1", [owner], |r| r.get(0))?;
    if held >= i64::from(limit) {
        return Err(StoreError::QuotaExceeded { owner: owner.to_string(), limit });
    }
    Ok(())
}

/// The quota of a key's row: the values set, else the defaults; none for admin keys.
pub(crate) fn quota_of(scope: ApiKeyScope, set: [Option<i64>; 3]) -> Option<Quota> {
    let v = |i: usize| set[i].map(|v| v.clamp(0, i64::from(u32::MAX)) as u32);
    (scope == ApiKeyScope::Endpoints)
        .then(|| Quota::DEFAULT.with(&QuotaUpdate { reservations: v(0), labels: v(1), label_bytes: v(2) }))
}

pub(super) const API_KEY_COLUMNS: &str =
    "id, name, scope, created_at, revoked_at, custom_domains, max_reservations, max_labels, max_label_bytes";
pub(super) const TUNNEL_KEY_COLUMNS: &str =
    "id, protocol, reservation_id, kind, hostname, port, owner, labels, created_at, revoked_at";

pub(super) fn api_key_from_row(row: &Row<'_>) -> rusqlite::Result<ApiKey> {
    let scope: String = row.get(2)?;
    let scope = ApiKeyScope::parse(&scope).ok_or_else(|| invalid(2, format!("unknown scope {scope:?}")))?;
    Ok(ApiKey {
        id: row.get(0)?,
        name: row.get(1)?,
        scope,
        quota: quota_of(scope, [row.get(6)?, row.get(7)?, row.get(8)?]),
        created_at: row.get(3)?,
        revoked_at: row.get(4)?,
        custom_domains: serde_json::from_str(&row.get::<_, String>(5)?)
            .map_err(|e| invalid(5, format!("custom_domains is not a JSON list: {e}")))?,
    })
}

pub(super) fn tunnel_key_from_row(row: &Row<'_>) -> rusqlite::Result<TunnelKey> {
    let protocol: String = row.get(1)?;
    let kind: String = row.get(3)?;
    let protocol =
        Protocol::parse(&protocol).ok_or_else(|| invalid(1, format!("unknown protocol {protocol:?}")))?;
    Ok(TunnelKey {
        id: row.get(0)?,
        protocol,
        reservation: ReservationRef {
            // A udp key is only ever minted for a UDP port.
            protocol: crate::api::PortProtocol::of_key(protocol),
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

#[cfg(test)]
mod tests {
    use super::super::testing::{TestStore, both_engines};
    use super::super::tests::admin;
    use super::*;

    both_engines!(key_prefixes_and_hashing, revocation, api_keys_and_the_last_admin, custom_domains_change);

    /// An admin changes the custom domains of a key (`*` also allows the
    /// default host); the default host is one reservation of `*`.
    fn custom_domains_change(t: &TestStore) {
        let store = &*t.store;
        let (ep, _) = store.create_api_key("operator", ApiKeyScope::Endpoints).unwrap();
        assert!(!ep.may_reserve_custom(crate::api::DEFAULT_HOST));
        let star = vec!["*".to_string()];
        let changed = store.set_api_key_custom_domains(&ep.id, &star).unwrap();
        assert_eq!(changed.custom_domains, star);
        let read = store.api_key(&ep.id).unwrap().unwrap();
        assert!(read.may_reserve_custom(crate::api::DEFAULT_HOST), "{read:?}");
        assert_eq!(
            store.set_api_key_custom_domains(&ep.id, &[]).unwrap().custom_domains,
            Vec::<String>::new()
        );
        assert!(matches!(
            store.set_api_key_custom_domains("ak_000000000000", &star),
            Err(StoreError::NotFound { .. })
        ));
        let (other, _) = store.create_api_key("other", ApiKeyScope::Endpoints).unwrap();
        store.reserve_domain(ReservationKind::Custom, "*", &ep.id, &Labels::new()).unwrap();
        let err = store.reserve_domain(ReservationKind::Custom, "*", &other.id, &Labels::new()).unwrap_err();
        assert_eq!(err.category(), "already_reserved");
    }

    fn key_prefixes_and_hashing(t: &TestStore) {
        let store = &*t.store;
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
        let raw = t.raw();
        assert!(!raw.is_empty());
        for secret in [&admin_secret, &ep_secret, &tk_secret] {
            let needle = &secret.as_bytes()[10..];
            assert!(!raw.windows(needle.len()).any(|w| w == needle));
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

    fn revocation(t: &TestStore) {
        let store = &*t.store;
        store.ensure_admin_key().unwrap();
        let owner = admin(store).id;
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

    fn api_keys_and_the_last_admin(t: &TestStore) {
        let store = &*t.store;
        store.ensure_admin_key().unwrap();
        let first = admin(store);
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
