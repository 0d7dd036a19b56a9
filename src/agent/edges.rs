//! The edges an agent is connected to: one tunnel connection to every edge of
//! a set, as cloudflared keeps connections to several data centres.
//!
//! Each `--edge` URL is an edge; a URL whose host is a name that resolves to
//! several addresses is one edge per address (the name stays for TLS and the
//! Host header), resolved again every [`EDGE_RESOLVE_INTERVAL`] so that a new
//! address gets a connection and a removed one is drained. Every connection
//! runs its own [`run_tunnel`] loop: it is retried on its own, the others
//! keep serving.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};

use super::{Resolver, TunnelOptions, run_tunnel};
use crate::constants::EDGE_RESOLVE_INTERVAL;
use crate::tunnel::connect::{ConnectError, Dialer, EdgeUrl};
use crate::tunnel::proxy::Proxy;

/// The edge URLs an agent connects to (at least one, no duplicates).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeSet {
    urls: Vec<EdgeUrl>,
}

impl EdgeSet {
    /// Parses `--edge` values; each may be a comma-separated list (the form
    /// of `CULVERT_EDGE`).
    pub fn parse<S: AsRef<str>>(values: &[S]) -> Result<EdgeSet, ConnectError> {
        let mut urls: Vec<EdgeUrl> = Vec::new();
        for part in values.iter().flat_map(|v| v.as_ref().split(',')).map(str::trim).filter(|p| !p.is_empty())
        {
            let url = EdgeUrl::parse(part)?;
            if !urls.contains(&url) {
                urls.push(url);
            }
        }
        if urls.is_empty() {
            return Err(ConnectError::BadUrl {
                url: String::new(),
                why: "no edge given: pass --edge https://HOST[:PORT] (repeat it, or separate URLs with commas, for several edges)".into(),
            });
        }
        Ok(EdgeSet { urls })
    }

    pub fn urls(&self) -> &[EdgeUrl] {
        &self.urls
    }

    /// The first URL (the operator's control API calls go there).
    pub fn first(&self) -> &EdgeUrl {
        &self.urls[0]
    }
}

impl std::fmt::Display for EdgeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list: Vec<String> = self.urls.iter().map(EdgeUrl::authority).collect();
        f.write_str(&list.join(","))
    }
}

/// What the connections of a run share.
#[derive(Clone)]
struct Shared {
    dialer: Dialer,
    resolver: Resolver,
    options: TunnelOptions,
    /// Cancelled on shutdown, or when a connection met a permanent refusal
    /// (with `stop_on_permanent_error`): every connection drains.
    stop: CancellationToken,
    failed: Arc<Mutex<Option<ConnectError>>>,
}

impl Shared {
    /// One connection to `edge`, until `stop`.
    async fn connection(self, edge: EdgeUrl, stop: CancellationToken) {
        let dialer = Dialer { edge: edge.clone(), ..self.dialer.clone() };
        let span = tracing::info_span!("edge", edge = %edge);
        if let Err(e) =
            run_tunnel(dialer, self.resolver.clone(), self.options.clone(), stop).instrument(span).await
        {
            // Edges share one store: a key one refuses for good, all refuse.
            warn!(edge = %edge, error = %e, "the edge refused the tunnel for good; stopping every connection");
            self.failed.lock().expect("poisoned").get_or_insert(e);
            self.stop.cancel();
        }
    }

    /// One connection per address of `url`'s name, following its changes.
    async fn follow_name(self, url: EdgeUrl) {
        let mut links: BTreeMap<Option<SocketAddr>, CancellationToken> = BTreeMap::new();
        let mut tasks = JoinSet::new();
        loop {
            let lookup = tokio::net::lookup_host((url.host.as_str(), url.port));
            let resolved = tokio::select! {
                r = lookup => r.map(|addrs| addrs.collect::<Vec<_>>()),
                _ = self.stop.cancelled() => break,
            };
            let want = match resolved {
                Ok(addrs) if !addrs.is_empty() => one_family(addrs).into_iter().map(Some).collect(),
                result => {
                    let why = result.err().map_or("no address".to_string(), |e| e.to_string());
                    if links.is_empty() {
                        // Nothing known yet: dial the name itself (retried and
                        // logged by its loop), until it resolves here.
                        warn!(edge = %url.authority(), error = %why, "cannot resolve the edge's name; dialing it by name");
                        vec![None]
                    } else {
                        warn!(edge = %url.authority(), error = %why, "cannot resolve the edge's name again; keeping its connections");
                        links.keys().copied().collect()
                    }
                }
            };
            let (add, remove) = plan(links.keys().copied(), &want);
            for addr in remove {
                if let Some(stop) = links.remove(&addr) {
                    info!(edge = %url.authority(), addr = ?addr, "address gone from the edge's name; draining its connection");
                    stop.cancel();
                }
            }
            for addr in add {
                let edge = match addr {
                    Some(a) => url.pinned(a),
                    None => url.clone(),
                };
                info!(edge = %edge, "connecting to the edge");
                let stop = self.stop.child_token();
                links.insert(addr, stop.clone());
                tasks.spawn(self.clone().connection(edge, stop));
            }
            tokio::select! {
                _ = tokio::time::sleep(EDGE_RESOLVE_INTERVAL) => {}
                _ = self.stop.cancelled() => break,
            }
            // Reap the connections that ended (drained addresses).
            while tasks.try_join_next().is_some() {}
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// The IPv4 addresses of a name, or its IPv6 ones when it has none: an edge
/// with both A and AAAA records is one edge, not two.
fn one_family(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let v4 = addrs.iter().any(SocketAddr::is_ipv4);
    addrs.into_iter().filter(|a| a.is_ipv4() == v4).collect()
}

/// Which connections to open (`add`) and drain (`remove`) to go from `have` to `want`.
fn plan(
    have: impl Iterator<Item = Option<SocketAddr>>,
    want: &[Option<SocketAddr>],
) -> (Vec<Option<SocketAddr>>, Vec<Option<SocketAddr>>) {
    let have: Vec<_> = have.collect();
    let add = want.iter().filter(|a| !have.contains(a)).copied().collect::<Vec<_>>();
    let mut add_unique = Vec::new();
    for a in add {
        if !add_unique.contains(&a) {
            add_unique.push(a);
        }
    }
    let remove = have.into_iter().filter(|a| !want.contains(a)).collect();
    (add_unique, remove)
}

/// Keeps one tunnel connection to every edge of `edges` (the dialer's own
/// `edge` is replaced) until `shutdown`, then drains them all. Ends early
/// with the error when a connection was refused for good and
/// `options.stop_on_permanent_error` is set.
pub async fn run_edges(
    dialer: Dialer,
    edges: &EdgeSet,
    resolver: Resolver,
    options: TunnelOptions,
    shutdown: CancellationToken,
) -> Result<(), ConnectError> {
    let shared = Shared {
        dialer,
        resolver,
        options,
        stop: shutdown.child_token(),
        failed: Arc::new(Mutex::new(None)),
    };
    let mut tasks = JoinSet::new();
    for url in edges.urls() {
        // Through a proxy the proxy resolves the name: one connection by name.
        let proxied = matches!(Proxy::from_env(&url.host), Ok(Some(_)));
        if url.is_name() && !proxied {
            tasks.spawn(shared.clone().follow_name(url.clone()));
        } else {
            tasks.spawn(shared.clone().connection(url.clone(), shared.stop.clone()));
        }
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    match shared.failed.lock().expect("poisoned").take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_sets_from_flags_and_comma_lists() {
        let set =
            EdgeSet::parse(&["https://a.example:8443, https://b.example", "https://a.example:8443"]).unwrap();
        let shown: Vec<String> = set.urls().iter().map(EdgeUrl::authority).collect();
        assert_eq!(shown, ["a.example:8443", "b.example"], "split, trimmed, deduplicated");
        assert_eq!(set.to_string(), "a.example:8443,b.example");
        assert_eq!(set.first().host, "a.example");
        assert_eq!(EdgeSet::parse(&["https://one"]).unwrap().urls().len(), 1);
        let err = EdgeSet::parse(&[" , "]).unwrap_err();
        assert!(err.to_string().contains("--edge"), "{err}");
        assert!(EdgeSet::parse(&["https://a", "http://b"]).is_err(), "a bad URL in the list");
    }

    #[test]
    fn resolved_addresses_become_connections() {
        let a: SocketAddr = "192.0.2.1:443".parse().unwrap();
        let b: SocketAddr = "192.0.2.2:443".parse().unwrap();
        // First resolution.
        assert_eq!(plan([].into_iter(), &[Some(a), Some(b), Some(a)]), (vec![Some(a), Some(b)], vec![]));
        // A new A record gets a connection; a removed one is drained.
        let c: SocketAddr = "192.0.2.3:443".parse().unwrap();
        assert_eq!(plan([Some(a), Some(b)].into_iter(), &[Some(b), Some(c)]), (vec![Some(c)], vec![Some(a)]));
        // The by-name fallback gives way once the name resolves.
        assert_eq!(plan([None].into_iter(), &[Some(a)]), (vec![Some(a)], vec![None]));
        // A and AAAA records of one edge: one connection.
        let v6: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        assert_eq!(one_family(vec![v6, a]), [a]);
        assert_eq!(one_family(vec![v6]), [v6]);
    }
}
