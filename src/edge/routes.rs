//! The routing index: public host name or TCP port → reservation. Rebuilt
//! from the store on every change and swapped in whole; tested without IO.

use std::collections::HashMap;

use crate::api::{Reservation, ReservationKind};

#[derive(Debug, Default)]
pub struct RouteIndex {
    by_host: HashMap<String, Reservation>,
    by_port: HashMap<u16, Reservation>,
}

impl RouteIndex {
    pub fn build(reservations: impl IntoIterator<Item = Reservation>) -> Self {
        let mut index = RouteIndex::default();
        for r in reservations {
            match (r.kind, &r.hostname, r.port) {
                (ReservationKind::Tcp, _, Some(port)) => {
                    index.by_port.insert(port, r);
                }
                (ReservationKind::Subdomain | ReservationKind::Custom, Some(host), _) => {
                    index.by_host.insert(host.to_ascii_lowercase(), r);
                }
                _ => {}
            }
        }
        index
    }

    /// The reservation serving `host` (a Host header or :authority: any case,
    /// with or without port or trailing dot).
    pub fn host(&self, host: &str) -> Option<&Reservation> {
        self.by_host.get(&normalize_host(host))
    }

    pub fn port(&self, port: u16) -> Option<&Reservation> {
        self.by_port.get(&port)
    }

    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.by_port.keys().copied()
    }

    /// Every reservation.
    pub fn all(&self) -> impl Iterator<Item = &Reservation> + '_ {
        self.by_host.values().chain(self.by_port.values())
    }

    /// The names the byte counters of each reservation are kept under
    /// (host names; `:PORT` for TCP ports).
    pub fn metric_names(&self) -> impl Iterator<Item = String> + '_ {
        self.by_host.keys().cloned().chain(self.by_port.keys().map(|p| format!(":{p}")))
    }

    pub fn contains_id(&self, id: &str) -> bool {
        self.by_host.values().chain(self.by_port.values()).any(|r| r.id == id)
    }
}

/// Lower case, no port, no trailing dot.
pub fn normalize_host(host: &str) -> String {
    let host = host.trim();
    let host = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        match host.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') && p.chars().all(|c| c.is_ascii_digit()) => h,
            _ => host,
        }
    };
    host.trim_end_matches('.').to_ascii_lowercase()
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

    #[test]
    fn normalizes_hosts() {
        assert_eq!(normalize_host("A.b:8443"), "a.b");
        assert_eq!(normalize_host("[::1]:443"), "::1");
        assert_eq!(normalize_host("127.0.0.1"), "127.0.0.1");
    }
}
