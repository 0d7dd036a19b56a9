//! The in-cluster agent: every replica keeps one tunnel connection per ready
//! Tunnel, with that Tunnel's own key (from its Secret), and forwards streams
//! to the backends the leader resolved into the Tunnel's status. Backend
//! changes apply without reconnecting; a new key reconnects.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use super::OperatorArgs;
use super::names::{LABEL_TUNNEL, SECRET_KEY};
use super::routes::{Rule, Table};
use super::status::Metrics;
use super::tunnel::{auth_copy_key, auth_secret_name};
use crate::agent::EdgeSet;
use crate::agent::backend::{Access, RouteOptions, Scheme};
use crate::agent::guard;
use crate::agent::pipe::ProxyHeader;
use crate::agent::{self, Resolver, Target, TunnelOptions};
use crate::constants::BACKEND_CONNECT_TIMEOUT;
use crate::crd::{BackendProtocol, HttpOptions, ProxyProtocol, Tunnel, TunnelProtocol, TunnelStatus};
use crate::tunnel::connect::{Dialer, TunnelInfo};

struct Running {
    key: String,
    routing: Arc<RwLock<Routing>>,
    stop: CancellationToken,
}

/// The backends of a route and how to forward to them.
#[derive(Debug, Clone, PartialEq)]
struct Backends {
    addrs: Vec<String>,
    options: Arc<RouteOptions>,
}

/// How the streams of one Tunnel are routed; behind a lock, so changes apply
/// without reconnecting.
#[derive(Debug, Clone, Default, PartialEq)]
struct Routing {
    /// HTTP: paths to backends; TCP: only the default backends.
    table: Table<Backends>,
    /// PROXY protocol header for TCP streams.
    proxy: Option<ProxyHeader>,
}

/// The agent's form of a route's options; credentials come from the
/// Tunnel's auth copy (`auth`: its data), and are refused (503) when missing.
fn route_options(o: &HttpOptions, auth: Option<&BTreeMap<String, ByteString>>) -> RouteOptions {
    let scheme = match o.backend_protocol.unwrap_or_default() {
        BackendProtocol::Http => Scheme::Http,
        BackendProtocol::H2c => Scheme::H2c,
        BackendProtocol::Https => Scheme::Https { verify: o.backend_tls_verify.unwrap_or(true) },
    };
    let access = match &o.auth_secret {
        None => Access::Open,
        Some(name) => {
            let text = |key: &str| {
                auth.and_then(|d| d.get(&auth_copy_key(name, key)))
                    .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            };
            let (a, t) = (text(guard::AUTH_KEY), text(guard::TOKEN_KEY));
            if a.is_none() && t.is_none() {
                Access::Unavailable(format!("the credentials of Secret {name} are not loaded yet"))
            } else {
                match guard::Credentials::parse(a.as_deref(), t.as_deref()) {
                    Ok(c) => Access::Credentials(Arc::new(c)),
                    Err(e) => Access::Unavailable(format!("the credentials of Secret {name}: {e}")),
                }
            }
        }
    };
    RouteOptions {
        scheme,
        connect_timeout: o
            .connect_timeout_seconds
            .map_or(BACKEND_CONNECT_TIMEOUT, |s| Duration::from_secs(s.into())),
        read_timeout: o.read_timeout_seconds.map(|s| Duration::from_secs(s.into())),
        max_body: o.max_body_size.as_deref().and_then(|s| guard::parse_size(s).ok().flatten()),
        access,
    }
}

impl Routing {
    fn of(t: &Tunnel, status: &TunnelStatus, auth: Option<&BTreeMap<String, ByteString>>) -> Routing {
        let backends = |addrs: &Vec<String>, o: &HttpOptions| Backends {
            addrs: addrs.clone(),
            options: Arc::new(route_options(o, auth)),
        };
        let rules = status
            .routes
            .iter()
            .map(|r| Rule::new(r.path.clone(), r.path_type, backends(&r.backends, &r.options)))
            .collect();
        let default = (!status.backends.is_empty()).then(|| backends(&status.backends, &status.options));
        let proxy = t.spec.proxy_protocol.map(|p| match p {
            ProxyProtocol::V1 => ProxyHeader::V1,
            ProxyProtocol::V2 => ProxyHeader::V2,
        });
        Routing { table: Table::new(rules, default), proxy }
    }
}

/// What one Tunnel needs to be carried.
struct Desired {
    name: String,
    key: String,
    protocol: TunnelProtocol,
    routing: Routing,
}

fn desired(tunnels: &Store<Tunnel>, secrets: &Store<Secret>) -> HashMap<String, Desired> {
    let mut out = HashMap::new();
    for t in tunnels.state() {
        let Some(status) = &t.status else { continue };
        // Agents connect once the Tunnel is published (Ready needs them connected).
        if !super::tunnel::is_published(&status.conditions)
            || (status.backends.is_empty() && status.routes.is_empty())
        {
            continue;
        }
        let Some(secret_name) = &status.key_secret else { continue };
        let secret_ref =
            reflector::ObjectRef::<Secret>::new(secret_name).within(&t.namespace().unwrap_or_default());
        let Some(secret) = secrets.get(&secret_ref) else { continue };
        let Some(key) = secret.data.as_ref().and_then(|d| d.get(SECRET_KEY)) else { continue };
        let auth_ref = reflector::ObjectRef::<Secret>::new(&auth_secret_name(&t.name_any()))
            .within(&t.namespace().unwrap_or_default());
        let auth = secrets.get(&auth_ref);
        out.insert(
            t.uid().unwrap_or_default(),
            Desired {
                name: format!("{}/{}", t.namespace().unwrap_or_default(), t.name_any()),
                key: String::from_utf8_lossy(&key.0).into_owned(),
                protocol: t.spec.protocol,
                routing: Routing::of(&t, status, auth.as_ref().and_then(|s| s.data.as_ref())),
            },
        );
    }
    out
}

/// Picks a backend by path (http) or the default backends (tcp), round robin.
fn resolver(protocol: TunnelProtocol, routing: Arc<RwLock<Routing>>) -> Resolver {
    let next = AtomicUsize::new(0);
    Arc::new(move |parts| {
        let routing = routing.read().expect("poisoned");
        let backends = match protocol {
            TunnelProtocol::Http => routing.table.lookup(parts.uri.path())?,
            TunnelProtocol::Tcp | TunnelProtocol::Tls | TunnelProtocol::Udp => {
                routing.table.default_backend()?
            }
        };
        let list = &backends.addrs;
        if list.is_empty() {
            return None;
        }
        let addr = list[next.fetch_add(1, Ordering::Relaxed) % list.len()].clone();
        Some(match protocol {
            TunnelProtocol::Http => Target::Http { authority: addr, options: backends.options.clone() },
            TunnelProtocol::Tcp | TunnelProtocol::Tls => Target::Tcp { addr, proxy: routing.proxy },
            TunnelProtocol::Udp => return None,
        })
    })
}

/// Runs until `shutdown`, then drains every tunnel connection.
pub async fn run(client: Client, args: OperatorArgs, metrics: Metrics, shutdown: CancellationToken) {
    let tls = match crate::tls::tunnel_client_config(args.ca_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return tracing::error!(error = %e, "agents cannot start"),
    };
    let edges = match EdgeSet::parse(&args.edge) {
        Ok(e) => Arc::new(e),
        Err(e) => return tracing::error!(error = %e, "agents cannot start"),
    };
    let (tunnels, tw) = reflector::store();
    let (secrets, sw) = reflector::store();
    let tunnel_events = watcher(
        super::watched::<Tunnel>(&client, args.watch_namespace.as_deref()),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(tw)
    .map(|_| ());
    let secret_events = watcher(
        super::watched::<Secret>(&client, args.watch_namespace.as_deref()),
        watcher::Config::default().labels(LABEL_TUNNEL).any_semantic(),
    )
    .default_backoff()
    .reflect(sw)
    .map(|_| ());
    let mut events = std::pin::pin!(futures_util::stream::select(tunnel_events, secret_events));
    // Ready once both caches have their first full list (the streams below fill them).
    let (t, s, m) = (tunnels.clone(), secrets.clone(), metrics.clone());
    tokio::spawn(async move {
        let _ = tokio::join!(t.wait_until_ready(), s.wait_until_ready());
        m.set_ready();
    });

    let mut running: HashMap<String, Running> = HashMap::new();
    loop {
        let want = desired(&tunnels, &secrets);
        let gone: HashSet<String> = running
            .iter()
            .filter(|(uid, r)| want.get(*uid).is_none_or(|d| d.key != r.key))
            .map(|(u, _)| u.clone())
            .collect();
        for uid in gone {
            if let Some(r) = running.remove(&uid) {
                r.stop.cancel();
                metrics.tunnels_connected.dec();
            }
        }
        for (uid, d) in want {
            if let Some(r) = running.get(&uid) {
                let mut routing = r.routing.write().expect("poisoned");
                if *routing != d.routing {
                    info!(tunnel = %d.name, routing = ?d.routing, "routes or backends changed; the tunnel stays connected");
                    *routing = d.routing;
                }
                continue;
            }
            let routing = Arc::new(RwLock::new(d.routing));
            let stop = shutdown.child_token();
            let protocol = super::tunnel::wire_protocol(d.protocol);
            let dialer = Dialer {
                edge: edges.first().clone(),
                key: d.key.clone(),
                agent_id: agent::agent_id(),
                tls: tls.clone(),
                protocol: Some(protocol),
            };
            let name = d.name.clone();
            let (up, down) = (metrics.edge_connections.clone(), metrics.edge_connections.clone());
            let options = TunnelOptions {
                stop_on_permanent_error: false,
                on_ready: Some(Arc::new(move |info: &TunnelInfo| {
                    up.get_or_create(&vec![("edge", info.edge.clone())]).inc();
                    info!(tunnel = %name, url = info.public_url.as_deref().unwrap_or(""), edge = %info.edge, "tunnel ready");
                })),
                on_lost: Some(Arc::new(move |info: &TunnelInfo| {
                    down.get_or_create(&vec![("edge", info.edge.clone())]).dec();
                })),
            };
            let span = tracing::info_span!("tunnel", tunnel = %d.name);
            let (edges, resolve, stop_run) =
                (edges.clone(), resolver(d.protocol, routing.clone()), stop.clone());
            tokio::spawn(
                async move { agent::run_edges(dialer, &edges, resolve, options, stop_run).await }
                    .instrument(span),
            );
            metrics.tunnels_connected.inc();
            running.insert(uid, Running { key: d.key, routing, stop });
        }
        tokio::select! {
            e = events.next() => if e.is_none() { break },
            _ = shutdown.cancelled() => break,
        }
    }
    for (_, r) in running {
        r.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector::store::Writer;
    use serde_json::json;

    use super::*;

    fn tunnel(name: &str, uid: &str, spec: serde_json::Value, status: serde_json::Value) -> Tunnel {
        serde_json::from_value(json!({
            "apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel",
            "metadata": {"name": name, "namespace": "web", "uid": uid},
            "spec": spec, "status": status,
        }))
        .unwrap()
    }

    fn secret(name: &str, data: serde_json::Value) -> Secret {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": "web"}, "data": data,
        }))
        .unwrap()
    }

    fn b64(s: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn stores(tunnels: Vec<Tunnel>, secrets: Vec<Secret>) -> (Store<Tunnel>, Store<Secret>) {
        let (mut tw, mut sw) = (Writer::<Tunnel>::default(), Writer::<Secret>::default());
        for t in tunnels {
            tw.apply_watcher_event(&watcher::Event::Apply(t));
        }
        for s in secrets {
            sw.apply_watcher_event(&watcher::Event::Apply(s));
        }
        (tw.as_reader(), sw.as_reader())
    }

    fn published(extra: serde_json::Value) -> serde_json::Value {
        let mut status = json!({
            "keySecret": "t-culvert-key",
            "backends": ["10.0.0.1:80"],
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "NoAgent", "message": ""},
                {"type": "Published", "status": "True", "reason": "Published", "message": ""},
            ],
        });
        status.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        status
    }

    #[test]
    fn agents_carry_published_tunnels_that_have_a_key() {
        let spec = json!({"service": {"name": "web", "port": 80}, "domain": "web"});
        let key = |name: &str| secret(name, json!({"key": b64("culvert_t_1"), "keyId": b64("tk_1")}));
        // (tunnel status, secrets, carried)
        let table = [
            (published(json!({})), vec![key("t-culvert-key")], true),
            // Published, even before an agent connects (Ready needs the agents).
            (
                published(
                    json!({"conditions": [{"type": "Ready", "status": "True", "reason": "Published", "message": ""}]}),
                ),
                vec![key("t-culvert-key")],
                true,
            ),
            (
                published(
                    json!({"conditions": [{"type": "Published", "status": "False", "reason": "Waiting", "message": ""}]}),
                ),
                vec![key("t-culvert-key")],
                false,
            ),
            (published(json!({"backends": []})), vec![key("t-culvert-key")], false),
            (
                published(
                    json!({"backends": [], "routes": [{"path": "/", "pathType": "Prefix", "backends": ["10.0.0.2:80"]}]}),
                ),
                vec![key("t-culvert-key")],
                true,
            ),
            (published(json!({})), vec![], false),
            (published(json!({})), vec![key("other-secret")], false),
            (published(json!({})), vec![secret("t-culvert-key", json!({"keyId": b64("tk_1")}))], false),
            (json!({}), vec![key("t-culvert-key")], false),
        ];
        for (status, secrets, carried) in table {
            let (tunnels, secrets) = stores(vec![tunnel("t", "u1", spec.clone(), status.clone())], secrets);
            let want = desired(&tunnels, &secrets);
            assert_eq!(want.contains_key("u1"), carried, "{status}");
            if let Some(d) = want.get("u1") {
                assert_eq!((d.name.as_str(), d.key.as_str()), ("web/t", "culvert_t_1"));
            }
        }
    }

    #[test]
    fn routes_get_their_options_and_credentials() {
        let spec = json!({"domain": "web", "routes": [
            {"path": "/api", "pathType": "Prefix", "service": {"name": "api", "port": 80}},
            {"path": "/admin", "pathType": "Prefix", "service": {"name": "admin", "port": 80},
             "options": {"authSecret": "creds"}},
        ]});
        let status = published(json!({"backends": [], "routes": [
            {"path": "/api", "pathType": "Prefix", "backends": ["10.0.0.2:80", "10.0.0.3:80"],
             "options": {"readTimeoutSeconds": 5}},
            {"path": "/admin", "pathType": "Prefix", "backends": ["10.0.0.4:80"], "options": {"authSecret": "creds"}},
        ]}));
        let key = secret("t-culvert-key", json!({"key": b64("culvert_t_1")}));
        let lookup = |routing: &Routing, path: &str| routing.table.lookup(path).map(|b| b.options.clone());

        // No auth copy yet: the guarded route is refused, never open.
        let (tunnels, secrets) =
            stores(vec![tunnel("t", "u1", spec.clone(), status.clone())], vec![key.clone()]);
        let d = desired(&tunnels, &secrets).remove("u1").unwrap();
        let admin = lookup(&d.routing, "/admin/x").unwrap();
        assert!(
            matches!(&admin.access, Access::Unavailable(why) if why.contains("not loaded yet")),
            "{admin:?}"
        );
        let api = lookup(&d.routing, "/api/v1").unwrap();
        assert_eq!(api.read_timeout, Some(Duration::from_secs(5)));
        assert!(matches!(api.access, Access::Open));
        assert!(lookup(&d.routing, "/other").is_none());

        // With the copy: credentials.
        let copy =
            secret("t-culvert-auth", json!({auth_copy_key("creds", guard::TOKEN_KEY): b64("s3cret\n")}));
        let (tunnels, secrets) = stores(vec![tunnel("t", "u1", spec, status)], vec![key, copy]);
        let d = desired(&tunnels, &secrets).remove("u1").unwrap();
        assert!(matches!(lookup(&d.routing, "/admin").unwrap().access, Access::Credentials(_)));

        // The resolver picks by path, round robin, with the route's options.
        let resolve = resolver(TunnelProtocol::Http, Arc::new(RwLock::new(d.routing)));
        let parts = |path: &str| http::Request::get(path).body(()).unwrap().into_parts().0;
        let picked: Vec<String> = (0..3)
            .map(|_| match resolve(&parts("/api/x")) {
                Some(Target::Http { authority, options }) => {
                    assert_eq!(options.read_timeout, Some(Duration::from_secs(5)));
                    authority
                }
                _ => panic!("not an HTTP route"),
            })
            .collect();
        assert_eq!(picked, ["10.0.0.2:80", "10.0.0.3:80", "10.0.0.2:80"]);
        assert!(resolve(&parts("/nothing")).is_none());
    }

    #[test]
    fn tcp_tunnels_use_the_default_backends_and_proxy_protocol() {
        let spec = json!({"service": {"name": "db", "port": 5432}, "protocol": "tcp", "tcpPort": "db",
            "proxyProtocol": "v2"});
        let status = published(json!({"backends": ["10.0.0.5:5432"]}));
        let key = secret("t-culvert-key", json!({"key": b64("culvert_t_1")}));
        let (tunnels, secrets) = stores(vec![tunnel("t", "u1", spec, status)], vec![key]);
        let d = desired(&tunnels, &secrets).remove("u1").unwrap();
        assert_eq!(d.protocol, TunnelProtocol::Tcp);
        let resolve = resolver(d.protocol, Arc::new(RwLock::new(d.routing)));
        let parts = http::Request::get("/any").body(()).unwrap().into_parts().0;
        match resolve(&parts) {
            Some(Target::Tcp { addr, proxy }) => {
                assert_eq!((addr.as_str(), proxy), ("10.0.0.5:5432", Some(ProxyHeader::V2)))
            }
            _ => panic!("not a TCP target"),
        }
    }

    #[test]
    fn plain_routes_take_the_default_http_path() {
        let spec = json!({"service": {"name": "web", "port": 80}, "domain": "web"});
        let key = secret("t-culvert-key", json!({"key": b64("culvert_t_1")}));
        let (tunnels, secrets) = stores(vec![tunnel("t", "u1", spec, published(json!({})))], vec![key]);
        let d = desired(&tunnels, &secrets).remove("u1").unwrap();
        let resolve = resolver(d.protocol, Arc::new(RwLock::new(d.routing)));
        let parts = http::Request::get("/").body(()).unwrap().into_parts().0;
        assert_eq!(resolve(&parts), Some(Target::http("10.0.0.1:80")), "the default options");
    }
}
