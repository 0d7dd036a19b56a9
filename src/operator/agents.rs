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
use super::routes::{Conditions, RequestHead, Rule, Table};
use super::status::Metrics;
use super::tunnel::{auth_copy_key, auth_secret_name};
use crate::agent::EdgeSet;
use crate::agent::backend::{Access, RouteOptions, Scheme};
use crate::agent::filters::Filters;
use crate::agent::guard;
use crate::agent::pipe::ProxyHeader;
use crate::agent::{self, Resolver, Target, TunnelOptions};
use crate::constants::BACKEND_CONNECT_TIMEOUT;
use crate::crd::{
    BackendProtocol, HttpOptions, ProxyProtocol, ResolvedRoute, Tunnel, TunnelProtocol, TunnelStatus,
};
use crate::tunnel::connect::{Dialer, TunnelInfo};

struct Running {
    key: String,
    routing: Arc<RwLock<Routing>>,
    stop: CancellationToken,
}

/// One share of a weighted split: its weight and its addresses (none: the
/// share answers 500).
#[derive(Debug, Clone, PartialEq)]
struct Share {
    weight: u32,
    addrs: Vec<String>,
}

/// The backends of a route and how to forward to them.
#[derive(Debug, Clone, PartialEq)]
struct Backends {
    /// The route's `service` (or the default backend): round robin.
    addrs: Vec<String>,
    /// The route's weighted `backends`: a share picked by weight, then
    /// round robin among its addresses.
    weighted: Vec<Share>,
    options: Arc<RouteOptions>,
}

/// The share a random number `r` picks, by weight (weight 0 never);
/// `None` when every weight is 0.
fn pick(shares: &[Share], r: u64) -> Option<&Share> {
    let total: u64 = shares.iter().map(|s| u64::from(s.weight)).sum();
    if total == 0 {
        return None;
    }
    let mut x = r % total;
    shares.iter().find(|s| {
        let w = u64::from(s.weight);
        if x < w {
            true
        } else {
            x -= w;
            false
        }
    })
}

/// A cheap random number per request: SipHash, keyed at random once per
/// process, of a counter.
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = KEY.get_or_init(Default::default).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
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
        filters: Filters::default(),
        scheme,
        connect_timeout: o
            .connect_timeout_seconds
            .map_or(BACKEND_CONNECT_TIMEOUT, |s| Duration::from_secs(s.into())),
        read_timeout: o.read_timeout_seconds.map(|s| Duration::from_secs(s.into())),
        max_body: o.max_body_size.as_deref().and_then(|s| guard::parse_size(s).ok().flatten()),
        access,
    }
}

/// The agent's rule of a resolved route; `None` (left out, with a warning)
/// when its matches or filters do not compile, which the operator's
/// validation keeps from happening.
fn rule(r: &ResolvedRoute, auth: Option<&BTreeMap<String, ByteString>>) -> Option<Rule<Backends>> {
    let compiled = Conditions::compile(r.method.as_deref(), &r.headers, &r.query_params)
        .and_then(|when| when.with_hosts(&r.hosts))
        .and_then(|when| Ok((when, Filters::compile(&r.filters, &r.path, r.path_type)?)));
    let (when, filters) = match compiled {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(path = %r.path, error = %e, "route left out");
            return None;
        }
    };
    let mut options = route_options(&r.options, auth);
    options.filters = filters;
    let weighted = r.weighted.iter().map(|w| Share { weight: w.weight, addrs: w.backends.clone() }).collect();
    let backends = Backends { addrs: r.backends.clone(), weighted, options: Arc::new(options) };
    Some(Rule::new(r.path.clone(), r.path_type, backends).when(when))
}

impl Routing {
    fn of(t: &Tunnel, status: &TunnelStatus, auth: Option<&BTreeMap<String, ByteString>>) -> Routing {
        let rules = status.routes.iter().filter_map(|r| rule(r, auth)).collect();
        let default = (!status.backends.is_empty()).then(|| Backends {
            addrs: status.backends.clone(),
            weighted: Vec::new(),
            options: Arc::new(route_options(&status.options, auth)),
        });
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

/// Picks a route by path, method, headers and query (http) or the default
/// backends (tcp); a route's redirect is answered by the agent; a weighted
/// route picks a share by weight; addresses round robin.
fn resolver(protocol: TunnelProtocol, routing: Arc<RwLock<Routing>>) -> Resolver {
    let next = AtomicUsize::new(0);
    Arc::new(move |parts| {
        let routing = routing.read().expect("poisoned");
        let backends = match protocol {
            TunnelProtocol::Http => routing.table.lookup_request(&RequestHead::from(parts))?,
            TunnelProtocol::Tcp | TunnelProtocol::Tls | TunnelProtocol::Udp => {
                routing.table.default_backend()?
            }
        };
        let answer = |status, location, message: &str| {
            Some(Target::Answer {
                status,
                location,
                message: message.into(),
                options: backends.options.clone(),
            })
        };
        if let Some(r) = &backends.options.filters.redirect {
            return answer(r.status, Some(r.location(parts)), "");
        }
        let list = if backends.weighted.is_empty() {
            &backends.addrs
        } else {
            let error = http::StatusCode::INTERNAL_SERVER_ERROR;
            match pick(&backends.weighted, random()) {
                None => return answer(error, None, "every backend of this route has weight 0"),
                Some(s) if s.addrs.is_empty() => {
                    return answer(
                        error,
                        None,
                        "this backend of the route cannot be used (see the Tunnel's status)",
                    );
                }
                Some(s) => &s.addrs,
            }
        };
        if list.is_empty() {
            // A route whose Service cannot be used (missing, no ready
            // endpoints, its auth Secret unusable: the Tunnel's status says
            // which): 503, as Gateway API asks of a backend without
            // endpoints; never 404, which would say the path is not routed.
            return answer(
                http::StatusCode::SERVICE_UNAVAILABLE,
                None,
                "the backend of this route cannot be used (see the Tunnel's status)",
            );
        }
        let addr = list[next.fetch_add(1, Ordering::Relaxed) % list.len()].clone();
        Some(match protocol {
            TunnelProtocol::Http => Target::Http { authority: addr, options: backends.options.clone() },
            TunnelProtocol::Tcp | TunnelProtocol::Tls => Target::Tcp { addr, proxy: routing.proxy },
            TunnelProtocol::Udp => Target::Udp { addr, proxy: routing.proxy },
        })
    })
}

/// Runs until `shutdown`, then drains every tunnel connection.
pub async fn run(client: Client, args: OperatorArgs, metrics: Metrics, shutdown: CancellationToken) {
    let tls = match crate::tls::tunnel_client_config(args.ca_file.as_deref(), args.tunnel_cipher) {
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
                    info!(
                        tunnel = %d.name,
                        routes = d.routing.table.len(),
                        default_backend = d.routing.table.default_backend().is_some(),
                        "routes or backends changed; the tunnel stays connected"
                    );
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
                version: crate::constants::PROTOCOL_VERSION,
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
    fn weights_split_and_zero_is_never_picked() {
        let shares = |w: &[u32]| {
            w.iter()
                .enumerate()
                .map(|(i, w)| Share { weight: *w, addrs: vec![format!("10.0.0.{i}:80")] })
                .collect::<Vec<_>>()
        };
        let s = shares(&[3, 0, 1]);
        // Every r picks by its place in the weights: 0..3 the first, 3 the last, never weight 0.
        let picked: Vec<u32> = (0..8).map(|r| pick(&s, r).unwrap().weight).collect();
        assert_eq!(picked, [3, 3, 3, 1, 3, 3, 3, 1]);
        assert!(pick(&shares(&[0, 0]), 7).is_none(), "all weights 0: none (500)");
        assert!(pick(&[], 7).is_none());
        // 1000 random picks of 80/20 land within 800 +- 60 (more than 4.7 standard deviations).
        let s = shares(&[80, 20]);
        let first = (0..1000).filter(|_| pick(&s, random()).unwrap().weight == 80).count();
        assert!((740..=860).contains(&first), "80/20 split gave {first}/1000");
    }

    #[test]
    fn gateway_routes_match_answer_and_pick_by_weight() {
        let spec =
            json!({"domain": "web", "routes": [{"path": "/", "service": {"name": "web", "port": 80}}]});
        let status = published(json!({"backends": [], "routes": [
            {"path": "/", "pathType": "Prefix", "backends": ["10.0.0.9:80"]},
            {"path": "/old", "pathType": "Prefix", "filters": [{"type": "RequestRedirect",
                "requestRedirect": {"hostname": "new.example", "statusCode": 301}}]},
            {"path": "/", "pathType": "Prefix", "headers": [{"name": "x-canary", "value": "1"}],
             "weighted": [{"weight": 1, "backends": ["10.0.0.1:80"]}, {"weight": 0, "backends": ["10.0.0.2:80"]}]},
            {"path": "/none", "pathType": "Prefix", "weighted": [{"weight": 1, "backends": []}]},
            {"path": "/zero", "pathType": "Prefix", "weighted": [{"weight": 0, "backends": ["10.0.0.3:80"]}]},
            {"path": "/bad", "pathType": "Prefix", "headers": [{"name": "x", "value": "(", "type": "RegularExpression"}],
             "backends": ["10.0.0.4:80"]},
        ]}));
        let key = secret("t-culvert-key", json!({"key": b64("culvert_t_1")}));
        let (tunnels, secrets) = stores(vec![tunnel("t", "u1", spec, status)], vec![key]);
        let d = desired(&tunnels, &secrets).remove("u1").unwrap();
        let resolve = resolver(TunnelProtocol::Http, Arc::new(RwLock::new(d.routing)));
        let get = |uri: &str, headers: &[(&str, &str)]| {
            let mut b = http::Request::get(uri)
                .header("x-forwarded-proto", "https")
                .header("x-forwarded-port", "443");
            for (n, v) in headers {
                b = b.header(*n, *v);
            }
            resolve(&b.body(()).unwrap().into_parts().0)
        };
        let authority = |t: Option<Target>| match t {
            Some(Target::Http { authority, .. }) => authority,
            t => panic!("not forwarded: {t:?}"),
        };
        assert_eq!(authority(get("https://a.example/x", &[])), "10.0.0.9:80");
        for _ in 0..20 {
            assert_eq!(
                authority(get("https://a.example/x", &[("x-canary", "1")])),
                "10.0.0.1:80",
                "weight 0 never"
            );
        }
        match get("https://a.example/old/page?x=1", &[]) {
            Some(Target::Answer { status, location, .. }) => {
                assert_eq!(status, http::StatusCode::MOVED_PERMANENTLY);
                assert_eq!(location.as_deref(), Some("https://new.example/old/page?x=1"));
            }
            t => panic!("not a redirect: {t:?}"),
        }
        for path in ["/none", "/zero"] {
            match get(&format!("https://a.example{path}"), &[]) {
                Some(Target::Answer { status, location: None, .. }) => assert_eq!(status, 500, "{path}"),
                t => panic!("{path}: not a 500: {t:?}"),
            }
        }
        // A route whose matches do not compile is left out (the next route serves).
        assert_eq!(authority(get("https://a.example/bad", &[("x", "(")])), "10.0.0.9:80");
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
