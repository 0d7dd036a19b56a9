//! The routing index: public host name or TCP port → reservation. Built
//! whole from the store at a (re)load, then changed one entry at a time as
//! the control API reserves and releases; tested without IO.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use crate::api::{DEFAULT_HOST, PortProtocol, Reservation, ReservationKind};

/// One change of the index: what a reserve or a release did.
#[derive(Debug, Clone)]
pub enum RouteChange {
    /// A new reservation (replaces what held its name or port).
    Insert(Reservation),
    /// A released reservation (removed only if its name or port still
    /// points at this id).
    Remove(Reservation),
}

/// Cheap to clone: the reservations are shared.
#[derive(Debug, Default, Clone)]
pub struct RouteIndex {
    by_host: HashMap<String, Arc<Reservation>>,
    by_port: HashMap<u16, Arc<Reservation>>,
    by_udp_port: HashMap<u16, Arc<Reservation>>,
    ids: std::collections::HashSet<String>,
}

/// Where a reservation is found in the index.
enum Slot {
    Host(String),
    Port(u16),
    UdpPort(u16),
}

fn slot(r: &Reservation) -> Option<Slot> {
    match (r.kind, &r.hostname, r.port) {
        (ReservationKind::Tcp, _, Some(port)) if r.protocol == PortProtocol::Udp => Some(Slot::UdpPort(port)),
        (ReservationKind::Tcp, _, Some(port)) => Some(Slot::Port(port)),
        (ReservationKind::Subdomain | ReservationKind::Custom, Some(host), _) => {
            Some(Slot::Host(host.to_ascii_lowercase()))
        }
        _ => None,
    }
}

impl RouteIndex {
    pub fn build(reservations: impl IntoIterator<Item = Reservation>) -> Self {
        let mut index = RouteIndex::default();
        for r in reservations {
            index.insert(r);
        }
        index
    }

    /// Applies one change.
    pub fn apply(&mut self, change: &RouteChange) {
        match change {
            RouteChange::Insert(r) => self.insert(r.clone()),
            RouteChange::Remove(r) => self.remove(r),
        }
    }

    fn insert(&mut self, r: Reservation) {
        let id = r.id.clone();
        let replaced = match slot(&r) {
            Some(Slot::Port(port)) => self.by_port.insert(port, Arc::new(r)),
            Some(Slot::UdpPort(port)) => self.by_udp_port.insert(port, Arc::new(r)),
            Some(Slot::Host(host)) => self.by_host.insert(host, Arc::new(r)),
            None => return,
        };
        if let Some(old) = replaced {
            self.ids.remove(&old.id);
        }
        self.ids.insert(id);
    }

    fn remove(&mut self, r: &Reservation) {
        let held = |held: Option<&Arc<Reservation>>| held.is_some_and(|held| held.id == r.id);
        match slot(r) {
            Some(Slot::Port(port)) if held(self.by_port.get(&port)) => {
                self.by_port.remove(&port);
                self.ids.remove(&r.id);
            }
            Some(Slot::UdpPort(port)) if held(self.by_udp_port.get(&port)) => {
                self.by_udp_port.remove(&port);
                self.ids.remove(&r.id);
            }
            Some(Slot::Host(host)) if held(self.by_host.get(&host)) => {
                self.by_host.remove(&host);
                self.ids.remove(&r.id);
            }
            _ => {}
        }
    }

    /// The reservation serving `host` (a Host header or :authority: any case,
    /// with or without port or trailing dot).
    pub fn host(&self, host: &str) -> Option<&Reservation> {
        self.by_host.get(&*normalize_host(host)).map(|r| &**r)
    }

    /// The edge's default host: the reservation of [`DEFAULT_HOST`], if any.
    pub fn default_host(&self) -> Option<&Reservation> {
        self.by_host.get(DEFAULT_HOST).map(|r| &**r)
    }

    /// The reservation serving `host`, else the default host for a `host`
    /// that is not the edge's own name `edge_domain` (a name no reservation
    /// holds, or an IP literal such as the edge's own address). An empty
    /// host (HTTP/1.0 without `Host`) has none.
    pub fn host_or_default(&self, host: &str, edge_domain: &str) -> Option<&Reservation> {
        let name = normalize_host(host);
        if let Some(r) = self.by_host.get(&*name) {
            return Some(r);
        }
        if name.is_empty() || name == edge_domain || default_host_name(host).is_none() {
            return None;
        }
        self.default_host()
    }

    pub fn port(&self, port: u16) -> Option<&Reservation> {
        self.by_port.get(&port).map(|r| &**r)
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.by_port.keys().copied()
    }

    /// The reservation of a UDP port.
    pub fn udp_port(&self, port: u16) -> Option<&Reservation> {
        self.by_udp_port.get(&port).map(|r| &**r)
    }

    pub fn udp_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.by_udp_port.keys().copied()
    }

    /// Every reservation.
    pub fn all(&self) -> impl Iterator<Item = &Reservation> + '_ {
        self.by_host.values().chain(self.by_port.values()).chain(self.by_udp_port.values()).map(|r| &**r)
    }

    /// How many reservations the index holds.
    pub fn len(&self) -> usize {
        self.by_host.len() + self.by_port.len() + self.by_udp_port.len()
    }

    /// The names the byte counters of each reservation are kept under
    /// (host names; `:PORT` for TCP ports, `udp:PORT` for UDP ports).
    pub fn metric_names(&self) -> impl Iterator<Item = String> + '_ {
        self.by_host
            .keys()
            .cloned()
            .chain(self.by_port.keys().map(|p| format!(":{p}")))
            .chain(self.by_udp_port.keys().map(|p| udp_metric_name(*p)))
    }

    pub fn contains_id(&self, id: &str) -> bool {
        self.ids.contains(id)
    }
}

/// The name the byte counters of `r` are kept under (see [`RouteIndex::metric_names`]).
pub fn metric_name(r: &Reservation) -> Option<String> {
    match slot(r)? {
        Slot::Host(host) => Some(host),
        Slot::Port(port) => Some(format!(":{port}")),
        Slot::UdpPort(port) => Some(udp_metric_name(port)),
    }
}

/// The name a UDP port's counters are kept under.
pub fn udp_metric_name(port: u16) -> String {
    format!("udp:{port}")
}

/// The host a request for the default host is forwarded with: the
/// request's host, lower case, no trailing dot, its port kept, an IPv6
/// literal in brackets; `None` for anything that is not a host name or an
/// IP literal (such a request is not forwarded).
pub fn default_host_name(host: &str) -> Option<String> {
    let name = normalize_host(host);
    let port = match host.trim().rsplit_once(':') {
        Some((h, p)) if (h.ends_with(']') || !h.contains(':')) && !p.is_empty() => {
            Some(p.parse::<u16>().ok()?)
        }
        _ => None,
    };
    let name = if name.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{name}]")
    } else if !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        name.into_owned()
    } else {
        return None;
    };
    Some(match port {
        Some(port) => format!("{name}:{port}"),
        None => name,
    })
}

/// Lower case, no port, no trailing dot.
pub fn normalize_host(host: &str) -> Cow<'_, str> {
    let host = host.trim();
    let host = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        match host.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') && p.chars().all(|c| c.is_ascii_digit()) => h,
            _ => host,
        }
    };
    let host = host.trim_end_matches('.');
    // Most hosts come lowercase: looked up without a copy.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(id: &str, kind: ReservationKind, host: Option<&str>, port: Option<u16>) -> Reservation {
        Reservation {
            id: id.into(),
            kind,
            hostname: host.map(Into::into),
            port,
            protocol: Default::default(),
            labels: Default::default(),
            owner: String::new(),
            created_at: String::new(),
            url: None,
            certificate: None,
            idle_timeout_seconds: None,
        }
    }

    #[test]
    fn routes_hosts_and_ports() {
        let index = RouteIndex::build([
            res("a", ReservationKind::Subdomain, Some("blog.edge.test"), None),
            res("b", ReservationKind::Custom, Some("App.Example.org"), None),
            res("c", ReservationKind::Tcp, None, Some(20017)),
        ]);
        assert_eq!(index.host("blog.edge.test").unwrap().id, "a");
        assert_eq!(index.host("BLOG.edge.test:443").unwrap().id, "a");
        assert_eq!(index.host("blog.edge.test.").unwrap().id, "a");
        assert_eq!(index.host("app.example.org").unwrap().id, "b");
        assert!(index.host("edge.test").is_none());
        assert!(index.host("evil.blog.edge.test").is_none());
        assert_eq!(index.port(20017).unwrap().id, "c");
        assert!(index.port(20018).is_none());
        assert!(index.contains_id("c") && !index.contains_id("z"));
    }

    /// A reserve or a release changes one entry; a stale release (of an id
    /// that no longer holds the name) changes nothing.
    #[test]
    fn changes_one_entry_at_a_time() {
        let a = res("a", ReservationKind::Subdomain, Some("blog.edge.test"), None);
        let p = res("p", ReservationKind::Tcp, None, Some(20017));
        let mut index = RouteIndex::build([a.clone()]);
        index.apply(&RouteChange::Insert(p.clone()));
        assert_eq!((index.len(), index.port(20017).unwrap().id.as_str()), (2, "p"));
        index.apply(&RouteChange::Remove(a.clone()));
        assert!(index.host("blog.edge.test").is_none() && !index.contains_id("a"));
        // The name again, for another reservation: the old id's release leaves it.
        let b = res("b", ReservationKind::Subdomain, Some("Blog.edge.test"), None);
        index.apply(&RouteChange::Insert(b.clone()));
        index.apply(&RouteChange::Remove(a));
        assert_eq!(index.host("blog.edge.test").unwrap().id, "b");
        // Inserting over a name replaces its id.
        index.apply(&RouteChange::Insert(res("c", ReservationKind::Subdomain, Some("blog.edge.test"), None)));
        assert!(index.contains_id("c") && !index.contains_id("b"));
        index.apply(&RouteChange::Remove(p));
        assert_eq!(index.len(), 1);
        assert_eq!(index.ports().count(), 0);
        assert_eq!(metric_name(&b).as_deref(), Some("blog.edge.test"));
    }

    /// The default host (`*`) takes every host no reservation holds, not the
    /// edge's own name; it comes and goes with its reserve and release.
    #[test]
    fn the_default_host_takes_unknown_hosts() {
        let named = res("a", ReservationKind::Subdomain, Some("blog.edge.test"), None);
        let any = res("d", ReservationKind::Custom, Some("*"), None);
        let mut index = RouteIndex::build([named.clone()]);
        assert!(index.host_or_default("203.0.113.7", "edge.test").is_none(), "no default host: as before");
        index.apply(&RouteChange::Insert(any.clone()));
        let of =
            |index: &RouteIndex, host: &str| index.host_or_default(host, "edge.test").map(|r| r.id.clone());
        for host in
            ["203.0.113.7", "203.0.113.7:80", "[2001:db8::1]:443", "Unknown.Example.org.", "x.edge.test"]
        {
            assert_eq!(of(&index, host).as_deref(), Some("d"), "{host}");
        }
        assert_eq!(of(&index, "BLOG.edge.test:443").as_deref(), Some("a"), "a reservation comes first");
        for host in ["edge.test", "EDGE.test:8443", "", "bad host", "a/b"] {
            assert_eq!(of(&index, host), None, "{host:?}");
        }
        assert_eq!(index.default_host().map(|r| r.id.as_str()), Some("d"));
        assert_eq!(metric_name(&any).as_deref(), Some("*"));
        // Another holder's stale release leaves it; its own release removes it.
        index.apply(&RouteChange::Remove(res("old", ReservationKind::Custom, Some("*"), None)));
        assert_eq!(of(&index, "10.0.0.1").as_deref(), Some("d"));
        index.apply(&RouteChange::Remove(any));
        assert_eq!(of(&index, "10.0.0.1"), None);
        assert_eq!(of(&index, "blog.edge.test").as_deref(), Some("a"));
    }

    #[test]
    fn default_host_names_keep_the_port() {
        assert_eq!(default_host_name("Shop.Example.org.:8080").as_deref(), Some("shop.example.org:8080"));
        assert_eq!(default_host_name("10.0.0.1").as_deref(), Some("10.0.0.1"));
        assert_eq!(default_host_name("[2001:DB8::1]:80").as_deref(), Some("[2001:db8::1]:80"));
        assert_eq!(default_host_name("2001:db8::1").as_deref(), Some("[2001:db8::1]"));
        for bad in ["", "*", "a b", "user@host", "host:99999", "host:x", "a/b"] {
            assert_eq!(default_host_name(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn normalizes_hosts() {
        assert_eq!(normalize_host("A.b:8443"), "a.b");
        assert_eq!(normalize_host("[::1]:443"), "::1");
        assert_eq!(normalize_host("127.0.0.1"), "127.0.0.1");
    }
}
