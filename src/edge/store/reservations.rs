//! Reservations: host names and TCP ports, each held by one owner.

use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};

use super::{
    Sqlite, StoreError, held_by, insert_with_fresh_id, invalid, labels_column, labels_to_json, now_rfc3339,
    port_column,
};
use crate::api::PortRange;
use crate::api::{Labels, PortProtocol, Reservation, ReservationKind};

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
        self.reserve_usable_port(port, PortProtocol::Tcp, range, owner, labels, &|_| true)
    }

    /// [`Reservations::reserve_port`] of `protocol` (TCP and UDP ports are
    /// separate spaces) among the ports `usable` accepts (those the edge can
    /// listen on): a new reservation of an unusable port is `PortInUse`; a
    /// free port is taken only if it is usable.
    fn reserve_usable_port(
        &self,
        port: Option<u16>,
        protocol: PortProtocol,
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
    fn reservation_by_port(&self, port: u16) -> Result<Option<Reservation>, StoreError> {
        self.reservation_by_port_of(port, PortProtocol::Tcp)
    }

    /// The reservation of a port of `protocol`.
    fn reservation_by_port_of(
        &self,
        port: u16,
        protocol: PortProtocol,
    ) -> Result<Option<Reservation>, StoreError>;

    /// A reservation by id.
    fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError>;

    /// Sets a reservation's own TCP idle timeout (None: the edge's); answers it.
    fn set_idle_timeout(&self, id: &str, seconds: Option<u64>) -> Result<Reservation, StoreError>;

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
        let reservation =
            insert_reservation(&tx, kind, Some(hostname), None, PortProtocol::Tcp, owner, labels)?;
        tx.commit()?;
        Ok((reservation, true))
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
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let port = match port {
            Some(port) => {
                if !range.contains(port) {
                    return Err(StoreError::PortOutOfRange { port, range });
                }
                if let Some(existing) = select_reservation(&tx, &port_is(protocol), &i64::from(port))? {
                    return held_by(existing, owner);
                }
                if !usable(port) {
                    return Err(StoreError::PortInUse { port });
                }
                port
            }
            None => {
                lowest_free_port(&tx, protocol, range, usable)?.ok_or(StoreError::NoFreePort { range })?
            }
        };
        let reservation =
            insert_reservation(&tx, ReservationKind::Tcp, None, Some(port), protocol, owner, labels)?;
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

    fn reservation_by_port_of(
        &self,
        port: u16,
        protocol: PortProtocol,
    ) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), &port_is(protocol), &i64::from(port))
    }

    fn reservation(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        select_reservation(&self.lock(), "id = ?1", &id)
    }

    fn set_idle_timeout(&self, id: &str, seconds: Option<u64>) -> Result<Reservation, StoreError> {
        let conn = self.lock();
        let seconds = seconds.map(|s| s.min(i64::MAX as u64) as i64);
        conn.execute(
            "UPDATE reservations SET idle_timeout_seconds = ?2 WHERE id = ?1",
            params![id, seconds],
        )?;
        select_reservation(&conn, "id = ?1", &id)?
            .ok_or_else(|| StoreError::NotFound { what: format!("reservation {id}") })
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

/// The condition of a port of `protocol` (a fixed word, not input).
fn port_is(protocol: PortProtocol) -> String {
    format!("port = ?1 AND protocol = '{}'", protocol.as_str())
}

fn lowest_free_port(
    conn: &Connection,
    protocol: PortProtocol,
    range: PortRange,
    usable: &dyn Fn(u16) -> bool,
) -> Result<Option<u16>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT port FROM reservations WHERE port BETWEEN ?1 AND ?2 AND protocol = ?3 ORDER BY port",
    )?;
    let taken = stmt
        .query_map(params![i64::from(range.first), i64::from(range.last), protocol.as_str()], |r| {
            r.get::<_, i64>(0)
        })?
        .collect::<Result<std::collections::HashSet<i64>, _>>()?;
    Ok((range.first..=range.last).find(|&p| !taken.contains(&i64::from(p)) && usable(p)))
}

fn insert_reservation(
    conn: &Connection,
    kind: ReservationKind,
    hostname: Option<&str>,
    port: Option<u16>,
    protocol: PortProtocol,
    owner: &str,
    labels: &Labels,
) -> Result<Reservation, StoreError> {
    super::keys::check_reservation_quota(conn, owner)?;
    let labels_json = labels_to_json(labels)?;
    let created_at = now_rfc3339();
    let id = insert_with_fresh_id("rs_", |id| {
        conn.execute(
            "INSERT INTO reservations (id, kind, hostname, port, owner, labels, created_at, protocol)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                id,
                kind.as_str(),
                hostname,
                port.map(i64::from),
                owner,
                labels_json,
                created_at,
                protocol.as_str()
            ],
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
        protocol,
        url: None,
        certificate: None,
        idle_timeout_seconds: None,
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

pub(super) const RESERVATION_COLUMNS: &str =
    "id, kind, hostname, port, owner, labels, created_at, protocol, idle_timeout_seconds";

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
        protocol: {
            let p: String = row.get(7)?;
            PortProtocol::parse(&p).ok_or_else(|| invalid(7, format!("unknown port protocol {p:?}")))?
        },
        url: None,
        certificate: None,
        idle_timeout_seconds: row.get::<_, Option<i64>>(8)?.map(|s| s.max(0) as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{TestStore, both_engines};
    use super::super::tests::{labels, range};
    use crate::api::ApiKeyScope;

    use super::*;

    both_engines!(
        idempotent_reservations_and_conflicts,
        port_allocation_stays_in_range,
        quotas_and_idle_timeouts,
        udp_and_tcp_ports_are_separate_spaces
    );

    fn udp_and_tcp_ports_are_separate_spaces(t: &TestStore) {
        use crate::api::Protocol;
        let store = &*t.store;
        let (a, _) = store.create_api_key("a", ApiKeyScope::Endpoints).unwrap();
        let (b, _) = store.create_api_key("b", ApiKeyScope::Endpoints).unwrap();
        let (r, none, yes) = (range(40000, 40001), Labels::new(), &|_| true);
        let (udp, created) =
            store.reserve_usable_port(Some(40000), PortProtocol::Udp, r, &a.id, &none, yes).unwrap();
        assert!(created);
        assert_eq!((udp.protocol, udp.port), (PortProtocol::Udp, Some(40000)));
        // The same number over TCP is free, for another key.
        let (tcp, created) = store.reserve_port(Some(40000), r, &b.id, &none).unwrap();
        assert!(created);
        assert_eq!(tcp.protocol, PortProtocol::Tcp);
        let err =
            store.reserve_usable_port(Some(40000), PortProtocol::Udp, r, &b.id, &none, yes).unwrap_err();
        assert_eq!(err.category(), "already_reserved");
        assert_eq!(err.to_string(), format!("udp port 40000 is held by another key ({})", a.id));
        // Lookups and the lowest free port are per protocol.
        assert_eq!(store.reservation_by_port_of(40000, PortProtocol::Udp).unwrap(), Some(udp.clone()));
        assert_eq!(store.reservation_by_port(40000).unwrap(), Some(tcp.clone()));
        let (next, _) = store.reserve_usable_port(None, PortProtocol::Udp, r, &a.id, &none, yes).unwrap();
        assert_eq!(next.port, Some(40001));
        assert_eq!(store.reserve_port(None, r, &a.id, &none).unwrap().0.port, Some(40001));
        assert!(store.reservations().unwrap().contains(&udp), "the protocol survives a read");
        // A udp key names its UDP reservation.
        let (key, _) = store.create_tunnel_key(&udp.id, Protocol::Udp, &none, &a.id).unwrap();
        assert_eq!(key.reservation.protocol, PortProtocol::Udp);
        assert_eq!(key.reservation.target(), "udp port 40000");
        let (released, revoked) = store.release_reservation(&udp.id).unwrap();
        assert_eq!((released.protocol, revoked), (PortProtocol::Udp, vec![key.id]));
        assert_eq!(store.reservation_by_port(40000).unwrap(), Some(tcp), "the TCP port stays");
    }

    /// An endpoints key holds at most its quota of reservations (checked in
    /// the reserving transaction); admin keys have none. A port keeps its
    /// own idle timeout.
    fn quotas_and_idle_timeouts(t: &TestStore) {
        use crate::api::{Quota, QuotaUpdate};
        let store = &*t.store;
        store.ensure_admin_key().unwrap();
        let admin = super::super::tests::admin(store);
        assert_eq!(admin.quota, None);
        let two = QuotaUpdate { reservations: Some(2), ..Default::default() };
        let (a, _) = store.create_api_key_with("a", ApiKeyScope::Endpoints, &[], &two).unwrap();
        assert_eq!(a.quota, Some(Quota { reservations: 2, ..Quota::DEFAULT }));
        let none = Labels::new();
        store.reserve_domain(ReservationKind::Subdomain, "a1.example.com", &a.id, &none).unwrap();
        let (p, _) = store.reserve_port(None, range(20000, 20010), &a.id, &none).unwrap();
        let err =
            store.reserve_domain(ReservationKind::Subdomain, "a3.example.com", &a.id, &none).unwrap_err();
        assert!(matches!(&err, StoreError::QuotaExceeded { limit: 2, owner } if *owner == a.id), "{err:?}");
        let err = store.reserve_port(None, range(20000, 20010), &a.id, &none).unwrap_err();
        assert_eq!(err.category(), "quota_exceeded");
        // What it holds already is still answered.
        assert!(!store.reserve_port(p.port, range(20000, 20010), &a.id, &none).unwrap().1);
        // Raised: one more; the other values stay.
        let raised = store
            .update_api_key_quota(
                &a.id,
                &QuotaUpdate { reservations: Some(3), labels: Some(5), ..Default::default() },
            )
            .unwrap();
        assert_eq!(raised.quota, Some(Quota { reservations: 3, labels: 5, ..Quota::DEFAULT }));
        assert_eq!(store.api_key(&a.id).unwrap().unwrap().quota, raised.quota);
        store.reserve_domain(ReservationKind::Subdomain, "a3.example.com", &a.id, &none).unwrap();
        assert!(store.reserve_domain(ReservationKind::Subdomain, "a4.example.com", &a.id, &none).is_err());
        // A release frees one.
        store.release_reservation(&p.id).unwrap();
        store.reserve_domain(ReservationKind::Subdomain, "a4.example.com", &a.id, &none).unwrap();
        // The admin key has no quota.
        for i in 0..5 {
            store
                .reserve_domain(
                    ReservationKind::Subdomain,
                    &format!("admin{i}.example.com"),
                    &admin.id,
                    &none,
                )
                .unwrap();
        }
        assert!(matches!(
            store.update_api_key_quota("ak_000000000000", &two).unwrap_err(),
            StoreError::NotFound { .. }
        ));

        // Idle timeouts: none by default, set, read back, cleared.
        let (port, _) = store.reserve_port(None, range(20000, 20010), &admin.id, &none).unwrap();
        assert_eq!(port.idle_timeout_seconds, None);
        let set = store.set_idle_timeout(&port.id, Some(90)).unwrap();
        assert_eq!(set.idle_timeout_seconds, Some(90));
        assert_eq!(store.reservation_by_port(port.port.unwrap()).unwrap().unwrap(), set);
        assert!(store.reservations().unwrap().contains(&set));
        assert_eq!(store.set_idle_timeout(&port.id, None).unwrap().idle_timeout_seconds, None);
        assert!(matches!(
            store.set_idle_timeout("rs_000000000000", Some(1)).unwrap_err(),
            StoreError::NotFound { .. }
        ));
    }

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
        assert_eq!(
            store.reserve_usable_port(None, PortProtocol::Tcp, r, &a.id, &none, &busy).unwrap().0.port,
            Some(30007)
        );
        let err =
            store.reserve_usable_port(Some(30006), PortProtocol::Tcp, r, &a.id, &none, &busy).unwrap_err();
        assert!(matches!(err, StoreError::PortInUse { port: 30006 }), "{err:?}");
        // A port already held answers the reservation whatever the check says.
        assert!(
            !store
                .reserve_usable_port(Some(30007), PortProtocol::Tcp, r, &a.id, &none, &|_| false)
                .unwrap()
                .1
        );
    }
}
