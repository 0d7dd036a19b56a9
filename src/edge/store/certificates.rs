//! The ACME account and the certificates of custom domains.

use rusqlite::{OptionalExtension, Row, TransactionBehavior, params};

use super::{Sqlite, StoreError, invalid, now_rfc3339, rfc3339, unix_now};
use crate::api::{CertificateState, CertificateStatus};
use crate::constants::RENEW_BEFORE_EXPIRY;

/// The ACME account and the certificates of custom domains.
pub trait Certificates {
    /// The stored ACME account credentials (JSON) for a directory URL.
    fn acme_account(&self, directory: &str) -> Result<Option<String>, StoreError>;

    /// Keeps the ACME account credentials (JSON) for a directory URL,
    /// unless an account is stored already (another edge registered one
    /// meanwhile); returns the credentials stored, the first ones.
    fn put_acme_account(&self, directory: &str, credentials: &str) -> Result<String, StoreError>;

    /// Every certificate record, by host name.
    fn certificates(&self) -> Result<Vec<CertificateRecord>, StoreError>;

    /// The certificate record of one host name.
    fn certificate(&self, hostname: &str) -> Result<Option<CertificateRecord>, StoreError>;

    /// Writes a certificate record, but only while its host name is a
    /// reserved custom domain (an order that finishes after the release
    /// stores nothing), or for the edge's own wildcard `*.<domain>`.
    /// Returns whether it was written.
    fn put_certificate(&self, c: &CertificateRecord) -> Result<bool, StoreError>;

    /// Forgets the certificate of a host name (idempotent).
    fn delete_certificate(&self, hostname: &str) -> Result<(), StoreError>;

    /// Keeps the answer to a pending ACME challenge until `expires_at`
    /// (unix seconds), so that every edge can answer the CA's validation,
    /// whichever edge placed the order. Expired answers are dropped.
    fn put_challenge(&self, c: &Challenge) -> Result<(), StoreError>;

    /// The answer to a pending challenge, unless it has expired.
    fn challenge(&self, kind: ChallengeKind, name: &str) -> Result<Option<String>, StoreError>;

    /// Forgets a challenge (its order ended; idempotent).
    fn delete_challenge(&self, kind: ChallengeKind, name: &str) -> Result<(), StoreError>;
}

/// The two challenges answered by the edge's listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChallengeKind {
    /// `name` is the token, `value` the key authorization.
    Http01,
    /// `name` is the host name, `value` the SHA-256 of the key authorization, hex.
    TlsAlpn01,
}

impl ChallengeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChallengeKind::Http01 => "http-01",
            ChallengeKind::TlsAlpn01 => "tls-alpn-01",
        }
    }
}

/// A pending ACME challenge's answer, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub kind: ChallengeKind,
    pub name: String,
    pub value: String,
    /// Unix seconds.
    pub expires_at: u64,
}

impl Certificates for Sqlite {
    fn acme_account(&self, directory: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .lock()
            .query_row("SELECT credentials FROM acme_accounts WHERE directory = ?1", [directory], |r| {
                r.get(0)
            })
            .optional()?)
    }

    fn put_acme_account(&self, directory: &str, credentials: &str) -> Result<String, StoreError> {
        let conn = self.lock();
        conn.execute(
            "INSERT INTO acme_accounts (directory, credentials, created_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (directory) DO NOTHING",
            params![directory, credentials, now_rfc3339()],
        )?;
        Ok(conn.query_row(
            "SELECT credentials FROM acme_accounts WHERE directory = ?1",
            [directory],
            |r| r.get(0),
        )?)
    }

    fn certificates(&self) -> Result<Vec<CertificateRecord>, StoreError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare(&format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates ORDER BY hostname"))?;
        let all = stmt.query_map([], certificate_from_row)?.collect::<Result<_, _>>()?;
        Ok(all)
    }

    fn certificate(&self, hostname: &str) -> Result<Option<CertificateRecord>, StoreError> {
        Ok(self
            .lock()
            .query_row(
                &format!("SELECT {CERTIFICATE_COLUMNS} FROM certificates WHERE hostname = ?1"),
                [hostname],
                certificate_from_row,
            )
            .optional()?)
    }

    fn put_certificate(&self, c: &CertificateRecord) -> Result<bool, StoreError> {
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

    fn delete_certificate(&self, hostname: &str) -> Result<(), StoreError> {
        self.lock().execute("DELETE FROM certificates WHERE hostname = ?1", [hostname])?;
        Ok(())
    }

    fn put_challenge(&self, c: &Challenge) -> Result<(), StoreError> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute("DELETE FROM acme_challenges WHERE expires_at <= ?1", [unix_now() as i64])?;
        tx.execute(
            "INSERT INTO acme_challenges (kind, name, value, expires_at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (kind, name) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at",
            params![c.kind.as_str(), c.name, c.value, c.expires_at as i64],
        )?;
        tx.commit()?;
        Ok(())
    }

    fn challenge(&self, kind: ChallengeKind, name: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .lock()
            .query_row(
                "SELECT value FROM acme_challenges WHERE kind = ?1 AND name = ?2 AND expires_at > ?3",
                params![kind.as_str(), name, unix_now() as i64],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn delete_challenge(&self, kind: ChallengeKind, name: &str) -> Result<(), StoreError> {
        self.lock().execute(
            "DELETE FROM acme_challenges WHERE kind = ?1 AND name = ?2",
            params![kind.as_str(), name],
        )?;
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

pub(super) const CERTIFICATE_COLUMNS: &str = "hostname, status, chain_pem, key_pem, not_before, not_after, last_error, failures, next_attempt, updated_at";

pub(super) fn certificate_from_row(row: &Row<'_>) -> rusqlite::Result<CertificateRecord> {
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

#[cfg(test)]
mod tests {
    use super::super::testing::{TestStore, both_engines};
    use super::super::tests::admin;
    use crate::api::{Labels, ReservationKind};

    use super::*;

    both_engines!(certificates_live_and_die_with_their_custom_domain);

    fn certificates_live_and_die_with_their_custom_domain(t: &TestStore) {
        let store = &*t.store;
        store.ensure_admin_key().unwrap();
        let owner = admin(store).id;
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
        // Another connection (a restart, another edge) reads what was committed.
        let store = &*t.reopen().unwrap();
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
        assert_eq!(store.put_acme_account("https://ca/dir", "{\"id\":1}").unwrap(), "{\"id\":1}");
        // Another edge registered too: the first account stays, and is what it gets back.
        assert_eq!(store.put_acme_account("https://ca/dir", "{\"id\":2}").unwrap(), "{\"id\":1}");
        assert_eq!(store.acme_account("https://ca/dir").unwrap().as_deref(), Some("{\"id\":1}"));
    }

    both_engines!(challenges_are_shared_until_removed_or_expired);

    fn challenges_are_shared_until_removed_or_expired(t: &TestStore) {
        let a = &*t.store;
        let b = t.reopen().unwrap();
        let in_a_minute = unix_now() + 60;
        let http = |name: &str, value: &str, expires_at| Challenge {
            kind: ChallengeKind::Http01,
            name: name.into(),
            value: value.into(),
            expires_at,
        };
        a.put_challenge(&http("tok1", "tok1.thumb", in_a_minute)).unwrap();
        a.put_challenge(&Challenge {
            kind: ChallengeKind::TlsAlpn01,
            name: "app.example.org".into(),
            value: "ab01".into(),
            expires_at: in_a_minute,
        })
        .unwrap();
        // Another edge (another connection) reads them.
        assert_eq!(b.challenge(ChallengeKind::Http01, "tok1").unwrap().as_deref(), Some("tok1.thumb"));
        assert_eq!(
            b.challenge(ChallengeKind::TlsAlpn01, "app.example.org").unwrap().as_deref(),
            Some("ab01")
        );
        assert_eq!(b.challenge(ChallengeKind::Http01, "app.example.org").unwrap(), None, "kinds are apart");
        assert_eq!(b.challenge(ChallengeKind::Http01, "tok2").unwrap(), None);
        // An expired one is not answered, and goes with the next put.
        a.put_challenge(&http("old", "old.thumb", unix_now() - 1)).unwrap();
        assert_eq!(b.challenge(ChallengeKind::Http01, "old").unwrap(), None);
        a.put_challenge(&http("tok2", "tok2.thumb", in_a_minute)).unwrap();
        assert_eq!(b.challenge(ChallengeKind::Http01, "tok2").unwrap().as_deref(), Some("tok2.thumb"));
        // The order ended.
        a.delete_challenge(ChallengeKind::Http01, "tok1").unwrap();
        a.delete_challenge(ChallengeKind::Http01, "tok1").unwrap();
        assert_eq!(b.challenge(ChallengeKind::Http01, "tok1").unwrap(), None);
        assert_eq!(
            b.challenge(ChallengeKind::TlsAlpn01, "app.example.org").unwrap().as_deref(),
            Some("ab01")
        );
    }
}
