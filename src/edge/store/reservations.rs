//! Reservations: host names and TCP ports, each held by one owner.

use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};

use super::{
    Sqlite, StoreError, held_by, insert_with_fresh_id, invalid, labels_column, labels_to_json, now_rfc3339,
    port_column,
};
use crate::api::PortRange;
use crate::api::{Labels, Reservation, ReservationKind};

/// Reservations: host names and TCP ports, each held by one owner.
pub trait Reservations {
    /// Reserves a host name for `owner`. Idempotent: if `owner` already holds
    /// it, answers the existing record (labels unchanged) and `false`.
    fn reserve_domain(
        &self,
        kind: ReservationKind,
        hostname: &str,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError>;

    /// Reserves a TCP port for `owner`: `port` if given (it must be in
    /// `range`), else the lowest free one. Reserving a port `owner` already
    /// holds answers the existing record and `false`.
    fn reserve_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
    ) -> Result<(Reservation, bool), StoreError> {
        self.reserve_usable_port(port, range, owner, labels, &|_| true)
    }

    /// [`Reservations::reserve_port`] among the ports `usable` accepts (those
    /// the edge can listen on): a new reservation of an unusable port is
    /// `PortInUse`; a free port is taken only if it is usable.
    fn reserve_usable_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
        usable: &dyn Fn(u16) -> bool,
    ) -> Result<(Reservation, bool), StoreError>;

    /// Every reservation: domains by host name, then ports in order.
    fn reservations(&self) -> Result<Vec<Reservation>, StoreError>;

    /// The reservation of a host name.
    fn reservation_by_hostname(&self, hostname: &str) -> Result<Option<Reservation>, StoreError>;

    /// The reservation of a TCP port.
    fn reservation_by_port(&self, port: u16) -> Result<Option<Reservation>, StoreError>;

    /// A reservation by id.
    fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError>;

    /// Releases a reservation: deletes it, revokes its live tunnel keys and
    /// forgets its certificate, in one transaction. Returns the released
    /// record and the revoked key ids.
    fn release_reservation(&self, id: &str) -> Result<(Reservation, Vec<String>), StoreError>;
}

impl Reservations for Sqlite {
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
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Some(existing) = select_reservation(&tx, "hostname = ?1", &hostname)? {
            return held_by(existing, owner);
        }
        let reservation = insert_reservation(&tx, kind, Some(hostname), None, owner, labels)?;
        tx.commit()?;
        Ok((reservation, true))
    }

    fn reserve_usable_port(
        &self,
        port: Option<u16>,
        range: PortRange,
        owner: &str,
        labels: &Labels,
        usable: &dyn Fn(u16) -> bool,
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

    fn reservations(&self) -> Result<Vec<Reservation>, StoreError> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare(&format!("SELECT {RESERVATION_COLUMNS} FROM reservations ORDER BY port, hostname"))?;
        let all = stmt.query_map([], reservation_from_row)?.collect::<Result<_, _>>()?;
        Ok(all)
    }

    fn reservation_by_hostname(&self, hostname: &str) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "hostname = ?1", &hostname)
    }

    fn reservation_by_port(&self, port: u16) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "port = ?1", &i64::from(port))
    }

    fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "id = ?1", &id)
    }

    fn release_reservation(&self, id: &str) -> Result<(Reservation, Vec<String>), StoreError> {
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
}

fn lowest_free_port(
    conn: &Connection,
    range: PortRange,
    usable: &dyn Fn(u16) -> bool,
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
        protocol: crate::api::PortProtocol::Tcp,
        url: None,
        certificate: None,
    })
}

pub(super) fn select_reservation(
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

pub(super) const RESERVATION_COLUMNS: &str = "id, kind, hostname, port, owner, labels, created_at";

pub(super) fn reservation_from_row(row: &Row<'_>) -> rusqlite::Result<Reservation> {
    let kind: String = row.get(1)?;
    Ok(Reservation {
        id: row.get(0)?,
        kind: ReservationKind::parse(&kind).ok_or_else(|| invalid(1, format!("unknown kind {kind:?}")))?,
        hostname: row.get(2)?,
        port: port_column(row, 3)?,
        owner: row.get(4)?,
        labels: labels_column(row, 5)?,
        created_at: row.get(6)?,
        protocol: crate::api::PortProtocol::Tcp,
        url: None,
        certificate: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{TestStore, both_engines};
    use super::super::tests::{labels, range};
    use crate::api::ApiKeyScope;

    use super::*;

    both_engines!(idempotent_reservations_and_conflicts, port_allocation_stays_in_range);

    fn idempotent_reservations_and_conflicts(t: &TestStore) {
        let store = &*t.store;
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

    fn port_allocation_stays_in_range(t: &TestStore) {
        let store = &*t.store;
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
        assert_eq!(store.reserve_usable_port(None, r, &a.id, &none, &busy).unwrap().0.port, Some(30007));
        let err = store.reserve_usable_port(Some(30006), r, &a.id, &none, &busy).unwrap_err();
        assert!(matches!(err, StoreError::PortInUse { port: 30006 }), "{err:?}");
        // A port already held answers the reservation whatever the check says.
        assert!(!store.reserve_usable_port(Some(30007), r, &a.id, &none, &|_| false).unwrap().1);
    }
}
