//! What the controllers ask of the edge, as typed methods: the seam that
//! lets `execute()` run against [`fake::FakeEdge`] in unit tests and against
//! the control API ([`EdgeClient`]) in the operator.

use std::future::Future;

use crate::api::{
    CreateTunnelKeyRequest, CreatedTunnelKey, Reservation, ReserveDomainRequest, ReservePortRequest,
    TunnelKey,
};

use super::edge::EdgeClient;

/// The error of every call to the edge: the control-API client's.
pub type EdgeError = crate::api_client::ClientError;

/// The kinds of reservation, by their collection at the edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collection {
    Domains,
    /// TCP ports.
    Ports,
    /// UDP ports: `ports` with `protocol=udp`.
    UdpPorts,
}

impl Collection {
    /// The path segment: `domains` or `ports`.
    pub fn as_str(self) -> &'static str {
        match self {
            Collection::Domains => "domains",
            Collection::Ports | Collection::UdpPorts => "ports",
        }
    }

    /// The query that selects this collection's protocol (none for TCP,
    /// which edges without UDP answer too).
    pub fn query(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Collection::UdpPorts => &[("protocol", "udp")],
            _ => &[],
        }
    }

    /// `collection/key` with the protocol query.
    fn item(self, key: &str) -> String {
        match self {
            Collection::UdpPorts => format!("ports/{key}?protocol=udp"),
            _ => format!("{}/{key}", self.as_str()),
        }
    }
}

/// A reservation request of either kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveRequest {
    Domain(ReserveDomainRequest),
    Port(ReservePortRequest),
}

/// The edge's control API as the controllers use it. Lookups answer `None`
/// for 404; removals answer `false` when the thing was already gone.
pub trait EdgeApi: Send + Sync {
    /// `GET domains/{host}` or `GET ports/{port}`.
    fn reservation(
        &self,
        collection: Collection,
        key: &str,
    ) -> impl Future<Output = Result<Option<Reservation>, EdgeError>> + Send;
    /// Reservations of a collection that carry the labels of `selector` (`k=v,...`).
    fn reservations(
        &self,
        collection: Collection,
        selector: &str,
    ) -> impl Future<Output = Result<Vec<Reservation>, EdgeError>> + Send;
    /// `POST domains`.
    fn reserve_domain(
        &self,
        request: &ReserveDomainRequest,
    ) -> impl Future<Output = Result<Reservation, EdgeError>> + Send;
    /// `POST ports`.
    fn reserve_port(
        &self,
        request: &ReservePortRequest,
    ) -> impl Future<Output = Result<Reservation, EdgeError>> + Send;
    /// `DELETE domains/{host}` or `DELETE ports/{port}`.
    fn release(
        &self,
        collection: Collection,
        key: &str,
    ) -> impl Future<Output = Result<bool, EdgeError>> + Send;
    /// `GET tunnel-keys/{id}`.
    fn tunnel_key(&self, id: &str) -> impl Future<Output = Result<Option<TunnelKey>, EdgeError>> + Send;
    /// Tunnel keys that carry the labels of `selector`.
    fn tunnel_keys(&self, selector: &str) -> impl Future<Output = Result<Vec<TunnelKey>, EdgeError>> + Send;
    /// `POST tunnel-keys`.
    fn create_tunnel_key(
        &self,
        request: &CreateTunnelKeyRequest,
    ) -> impl Future<Output = Result<CreatedTunnelKey, EdgeError>> + Send;
    /// `DELETE tunnel-keys/{id}`.
    fn revoke_tunnel_key(&self, id: &str) -> impl Future<Output = Result<bool, EdgeError>> + Send;

    /// Either kind of reservation request.
    fn reserve(
        &self,
        request: &ReserveRequest,
    ) -> impl Future<Output = Result<Reservation, EdgeError>> + Send {
        async move {
            match request {
                ReserveRequest::Domain(r) => self.reserve_domain(r).await,
                ReserveRequest::Port(r) => self.reserve_port(r).await,
            }
        }
    }
}

fn body(request: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(request).expect("request types serialize")
}

impl EdgeApi for EdgeClient {
    async fn reservation(&self, collection: Collection, key: &str) -> Result<Option<Reservation>, EdgeError> {
        self.get(collection.item(key)).await
    }

    async fn reservations(
        &self,
        collection: Collection,
        selector: &str,
    ) -> Result<Vec<Reservation>, EdgeError> {
        let protocol = match collection {
            Collection::UdpPorts => crate::api::PortProtocol::Udp,
            _ => crate::api::PortProtocol::Tcp,
        };
        let all: Vec<Reservation> =
            self.list_with(collection.as_str(), selector.to_string(), collection.query()).await?;
        // An edge answers `ports` with both protocols.
        Ok(all.into_iter().filter(|r| r.port.is_none() || r.protocol == protocol).collect())
    }

    async fn reserve_domain(&self, request: &ReserveDomainRequest) -> Result<Reservation, EdgeError> {
        self.post("domains", body(request)).await
    }

    async fn reserve_port(&self, request: &ReservePortRequest) -> Result<Reservation, EdgeError> {
        self.post("ports", body(request)).await
    }

    async fn release(&self, collection: Collection, key: &str) -> Result<bool, EdgeError> {
        self.delete(collection.item(key)).await
    }

    async fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, EdgeError> {
        self.get(format!("tunnel-keys/{id}")).await
    }

    async fn tunnel_keys(&self, selector: &str) -> Result<Vec<TunnelKey>, EdgeError> {
        self.list("tunnel-keys", selector.to_string()).await
    }

    async fn create_tunnel_key(
        &self,
        request: &CreateTunnelKeyRequest,
    ) -> Result<CreatedTunnelKey, EdgeError> {
        self.post("tunnel-keys", body(request)).await
    }

    async fn revoke_tunnel_key(&self, id: &str) -> Result<bool, EdgeError> {
        self.delete(format!("tunnel-keys/{id}")).await
    }
}

/// An in-memory edge for unit tests of `execute()`: one API key, the domain
/// `edge.test`, and a journal of the writes it was asked for.
#[cfg(test)]
pub mod fake {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;
    use crate::api::{Labels, Protocol, ReservationKind, ReservationRef};

    pub const DOMAIN: &str = "edge.test";

    #[derive(Default)]
    pub struct State {
        /// By host name or port.
        pub reservations: BTreeMap<String, Reservation>,
        pub keys: BTreeMap<String, TunnelKey>,
        /// Host names (or ports) held by another API key: reserving them is refused.
        pub foreign: Vec<String>,
        /// Every call fails as if the edge were down.
        pub down: bool,
        /// The writes, in order: `reserve blog.edge.test`, `revoke tk_1`...
        pub journal: Vec<String>,
        next: u32,
    }

    #[derive(Default)]
    pub struct FakeEdge(pub Mutex<State>);

    fn refused(status: u16, code: &str, message: String) -> EdgeError {
        EdgeError::Refused { status, code: code.into(), message }
    }

    fn matches(labels: &Labels, selector: &str) -> bool {
        selector.split(',').filter(|s| !s.is_empty()).all(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            labels.get(k).map(String::as_str) == Some(v)
        })
    }

    impl FakeEdge {
        pub fn state(&self) -> std::sync::MutexGuard<'_, State> {
            self.0.lock().expect("poisoned")
        }

        /// The state, or the error of an edge that is down.
        fn up(&self) -> Result<std::sync::MutexGuard<'_, State>, EdgeError> {
            let s = self.state();
            if s.down {
                return Err(EdgeError::UnexpectedAnswer {
                    url: "the edge".into(),
                    status: 503,
                    detail: "down".into(),
                });
            }
            Ok(s)
        }

        fn hold(
            &self,
            key: String,
            kind: ReservationKind,
            port: Option<u16>,
            labels: &Labels,
        ) -> Result<Reservation, EdgeError> {
            let mut s = self.up()?;
            if s.foreign.contains(&key) {
                return Err(refused(409, "already_reserved", format!("{key} is held by another key")));
            }
            if let Some(r) = s.reservations.get(&key) {
                return Ok(r.clone());
            }
            s.next += 1;
            let r = Reservation {
                id: format!("rs_{:012}", s.next),
                kind,
                hostname: port.is_none().then(|| key.clone()),
                port,
                protocol: Default::default(),
                labels: labels.clone(),
                owner: "ak_1".into(),
                created_at: "2026-12-01T00:00:00Z".into(),
                url: Some(match port {
                    Some(p) => format!("tcp://{DOMAIN}:{p}"),
                    None => format!("https://{key}"),
                }),
                certificate: None,
                idle_timeout_seconds: None,
            };
            s.journal.push(format!("reserve {key}"));
            s.reservations.insert(key, r.clone());
            Ok(r)
        }
    }

    /// The fake's key of a UDP port: `udp:PORT` (TCP ports are `PORT`).
    fn fake_key(collection: Collection, key: &str) -> String {
        match collection {
            Collection::UdpPorts => format!("udp:{key}"),
            _ => key.to_string(),
        }
    }

    impl EdgeApi for FakeEdge {
        async fn reservation(
            &self,
            collection: Collection,
            key: &str,
        ) -> Result<Option<Reservation>, EdgeError> {
            let key = &fake_key(collection, key);
            let s = self.up()?;
            if s.foreign.iter().any(|f| f == key) {
                return Err(refused(403, "forbidden", format!("{key} is held by another key")));
            }
            // A subdomain by its label, as the edge does.
            let full = format!("{key}.{DOMAIN}");
            Ok(s.reservations.get(key).or_else(|| s.reservations.get(&full)).cloned())
        }

        async fn reservations(
            &self,
            collection: Collection,
            selector: &str,
        ) -> Result<Vec<Reservation>, EdgeError> {
            let s = self.up()?;
            let port = collection != Collection::Domains;
            let udp = collection == Collection::UdpPorts;
            Ok(s.reservations
                .values()
                .filter(|r| r.port.is_some() == port && matches(&r.labels, selector))
                .filter(|r| (r.protocol == crate::api::PortProtocol::Udp) == udp)
                .cloned()
                .collect())
        }

        async fn reserve_domain(&self, request: &ReserveDomainRequest) -> Result<Reservation, EdgeError> {
            let (host, kind) = match (&request.name, &request.fqdn) {
                (Some(name), None) => (format!("{name}.{DOMAIN}"), ReservationKind::Subdomain),
                (None, Some(fqdn)) => (fqdn.clone(), ReservationKind::Custom),
                _ => return Err(refused(422, "invalid_request", "give one of name and fqdn".into())),
            };
            self.hold(host, kind, None, &request.labels)
        }

        async fn reserve_port(&self, request: &ReservePortRequest) -> Result<Reservation, EdgeError> {
            let udp = request.protocol == crate::api::PortProtocol::Udp;
            let collection = if udp { Collection::UdpPorts } else { Collection::Ports };
            let port = request.port.unwrap_or_else(|| {
                (20000..)
                    .find(|p: &u16| {
                        !self.state().reservations.contains_key(&fake_key(collection, &p.to_string()))
                    })
                    .expect("free")
            });
            let mut r = self.hold(
                fake_key(collection, &port.to_string()),
                ReservationKind::Subdomain,
                Some(port),
                &request.labels,
            )?;
            if udp {
                r.protocol = crate::api::PortProtocol::Udp;
                r.url = Some(format!("udp://{DOMAIN}:{port}"));
                self.state().reservations.insert(fake_key(collection, &port.to_string()), r.clone());
            }
            if let Some(s) = request.idle_timeout_seconds {
                r.idle_timeout_seconds = (s > 0).then_some(s);
                self.up()?.reservations.insert(fake_key(collection, &port.to_string()), r.clone());
            }
            Ok(r)
        }

        async fn release(&self, collection: Collection, key: &str) -> Result<bool, EdgeError> {
            let key = &fake_key(collection, key);
            let mut s = self.up()?;
            s.journal.push(format!("release {key}"));
            Ok(s.reservations.remove(key).is_some())
        }

        async fn tunnel_key(&self, id: &str) -> Result<Option<TunnelKey>, EdgeError> {
            Ok(self.up()?.keys.get(id).cloned())
        }

        async fn tunnel_keys(&self, selector: &str) -> Result<Vec<TunnelKey>, EdgeError> {
            let s = self.up()?;
            Ok(s.keys
                .values()
                .filter(|k| k.revoked_at.is_none() && matches(&k.labels, selector))
                .cloned()
                .collect())
        }

        async fn create_tunnel_key(
            &self,
            request: &CreateTunnelKeyRequest,
        ) -> Result<CreatedTunnelKey, EdgeError> {
            let mut s = self.up()?;
            let target = match (&request.domain, request.port) {
                (Some(d), None) => d.clone(),
                (None, Some(p)) if request.protocol == Some(Protocol::Udp) => format!("udp:{p}"),
                (None, Some(p)) => p.to_string(),
                _ => return Err(refused(422, "invalid_request", "give one of domain and port".into())),
            };
            let Some(r) = s.reservations.get(&target).cloned() else {
                return Err(refused(404, "not_found", format!("no reservation {target}")));
            };
            s.next += 1;
            let key = TunnelKey {
                id: format!("tk_{:012}", s.next),
                protocol: request.protocol.unwrap_or(if r.port.is_some() {
                    Protocol::Tcp
                } else {
                    Protocol::Http
                }),
                reservation: ReservationRef::from(&r),
                labels: request.labels.clone(),
                owner: "ak_1".into(),
                created_at: "2026-12-01T00:00:00Z".into(),
                revoked_at: None,
                connections: 0,
            };
            s.journal.push(format!("create {} for {target}", key.id));
            s.keys.insert(key.id.clone(), key.clone());
            let secret = format!("culvert_t_{}", key.id);
            Ok(CreatedTunnelKey { key, secret, url: r.url.unwrap_or_default() })
        }

        async fn revoke_tunnel_key(&self, id: &str) -> Result<bool, EdgeError> {
            let mut s = self.up()?;
            s.journal.push(format!("revoke {id}"));
            Ok(match s.keys.get_mut(id) {
                Some(k) if k.revoked_at.is_none() => {
                    k.revoked_at = Some("2026-12-01T00:00:01Z".into());
                    true
                }
                _ => false,
            })
        }
    }
}
