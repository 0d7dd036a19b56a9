//! The Gateway API controller (`gateway.networking.k8s.io`): GatewayClasses
//! of controller `culvert.dev/gateway-controller`, their Gateways, and the
//! HTTPRoutes, GRPCRoutes, TLSRoutes, TCPRoutes and UDPRoutes attached to
//! them become `Domain`, `TcpPort`, `UdpPort` and `Tunnel` objects in the
//! routes' namespaces, as the Ingress controller does for Ingresses; the
//! statuses of the classes, Gateways and routes say what is served and why not.
//!
//! It starts only when the Gateway API CRDs are served (discovery; checked
//! again every minute while they are not), so the operator runs without them.
//!
//! One reconcile covers every Gateway API object the operator watches: a
//! Gateway in one namespace carries routes of others, and one host's Tunnel
//! merges several routes. Any change to a watched object (debounced) or the
//! resync runs it. Phases: observe (fresh lists) → plan (pure, `plan.rs`) →
//! execute (Domains, TcpPorts, Tunnels, then deletions) → statuses.

pub mod default_host;
pub mod plan;
pub mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};

use super::names::{ANNOTATION_HOST, FIELD_MANAGER, LABEL_MANAGED_BY};
use super::{Context, Error};
use crate::crd::{Domain, TcpPort, Tunnel, UdpPort};
use plan::{Child, Kind, MANAGED_BY, Observed, Plan, Route, Settings};
use types::*;

/// Which Gateway API kinds the API server serves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served {
    /// GatewayClass, Gateway and HTTPRoute (v1): without them the controller is off.
    pub core: bool,
    pub routes: BTreeSet<Kind>,
    /// ReferenceGrant v1beta1.
    pub grants: bool,
}

/// Asks the API server which Gateway API kinds it serves.
pub async fn discover(client: &Client) -> Result<Served, kube::Error> {
    let group = match kube::discovery::group(client, GROUP).await {
        Ok(g) => g,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Served::default()),
        Err(e) => return Err(e),
    };
    let kinds = |version: &str| -> BTreeSet<String> {
        group.versioned_resources(version).into_iter().map(|(ar, _)| ar.kind).collect()
    };
    let v1 = kinds("v1");
    let has = |k: &str| v1.contains(k);
    let mut routes = BTreeSet::new();
    for k in [Kind::Http, Kind::Grpc, Kind::Tls, Kind::Tcp, Kind::Udp] {
        if has(k.name()) {
            routes.insert(k);
        }
    }
    Ok(Served {
        core: has("GatewayClass") && has("Gateway") && has("HTTPRoute"),
        routes,
        grants: kinds("v1beta1").contains("ReferenceGrant"),
    })
}

/// Runs the controller until `stop`, once the CRDs are served.
pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let mut said_off = false;
    let served = loop {
        match discover(&ctx.client).await {
            Ok(s) if s.core => break s,
            Ok(_) => {
                if !said_off {
                    info!(
                        "Gateway API is off: its CRDs (gateway.networking.k8s.io GatewayClass, Gateway, HTTPRoute v1) \
                         are not installed; install the upstream standard-install.yaml (v1.6) to turn it on \
                         (checked again every minute)"
                    );
                    said_off = true;
                }
            }
            Err(e) => warn!(error = %e, "cannot discover the Gateway API CRDs; trying again in a minute"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(60)) => {}
        }
    };
    let kinds: Vec<&str> = served.routes.iter().map(|k| k.name()).collect();
    info!(routes = %kinds.join(","), reference_grants = served.grants, "Gateway API is on");
    let mut triggers = triggers(&ctx, &served);
    let mut next = Duration::ZERO;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            t = triggers.next() => if t.is_none() { next = ctx.resync; continue },
            _ = tokio::time::sleep(next) => {}
        }
        // Let a burst of changes settle into one reconcile.
        let settle = tokio::time::sleep(Duration::from_millis(100));
        tokio::pin!(settle);
        loop {
            tokio::select! {
                _ = &mut settle => break,
                _ = triggers.next() => {}
            }
        }
        let started = Instant::now();
        let span = tracing::info_span!("reconcile", kind = "Gateway API");
        let result = reconcile(&ctx, &served).instrument(span).await;
        ctx.metrics.reconciled(
            "GatewayAPI",
            started.elapsed().as_secs_f64(),
            result.as_ref().map(|_| ()).map_err(Error::category),
        );
        next = match result {
            Ok(()) => ctx.resync,
            Err(e) => {
                warn!(error = %e, category = e.category(), "Gateway API reconcile failed; retrying");
                Duration::from_secs(5)
            }
        };
    }
}

fn watch<K>(api: Api<K>, config: watcher::Config) -> BoxStream<'static, ()>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(api, config).default_backoff().map(|_| ()).boxed()
}

/// One stream that yields on every change of what the plan reads.
fn triggers(ctx: &Context, served: &Served) -> impl Stream<Item = ()> + Unpin + use<> {
    let c = &ctx.client;
    let ns = ctx.watch_namespace.as_deref();
    let any = watcher::Config::default;
    let managed = || any().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    let mut streams = vec![
        watch(Api::<GatewayClass>::all(c.clone()), any()),
        watch(super::watched::<Gateway>(c, ns), any()),
        watch(super::watched::<Domain>(c, ns), any()),
        watch(super::watched::<Tunnel>(c, ns), managed()),
        watch(super::watched::<TcpPort>(c, ns), managed()),
        watch(super::watched::<UdpPort>(c, ns), managed()),
        watch(super::watched::<Service>(c, ns), any()),
    ];
    for k in &served.routes {
        streams.push(match k {
            Kind::Http => watch(super::watched::<HTTPRoute>(c, ns), any()),
            Kind::Grpc => watch(super::watched::<GRPCRoute>(c, ns), any()),
            Kind::Tls => watch(super::watched::<TLSRoute>(c, ns), any()),
            Kind::Tcp => watch(super::watched::<TCPRoute>(c, ns), any()),
            Kind::Udp => watch(super::watched::<UDPRoute>(c, ns), any()),
        });
    }
    if served.grants {
        streams.push(watch(super::watched::<ReferenceGrant>(c, ns), any()));
    }
    futures_util::stream::select_all(streams)
}

async fn list<K>(api: Api<K>, lp: &ListParams) -> Result<Vec<K>, Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    Ok(api.list(lp).await?.items)
}

/// Fresh lists of everything the plan reads.
async fn observe(ctx: &Context, served: &Served) -> Result<Observed, Error> {
    let c = &ctx.client;
    let ns = ctx.watch_namespace.as_deref();
    let lp = ListParams::default();
    let managed = ListParams::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    let mut routes: Vec<Route> = Vec::new();
    for k in &served.routes {
        match k {
            Kind::Http => {
                routes.extend(list(super::watched::<HTTPRoute>(c, ns), &lp).await?.iter().map(Route::from))
            }
            Kind::Grpc => {
                routes.extend(list(super::watched::<GRPCRoute>(c, ns), &lp).await?.iter().map(Route::from))
            }
            Kind::Tls => {
                routes.extend(list(super::watched::<TLSRoute>(c, ns), &lp).await?.iter().map(Route::from))
            }
            Kind::Tcp => {
                routes.extend(list(super::watched::<TCPRoute>(c, ns), &lp).await?.iter().map(Route::from))
            }
            Kind::Udp => {
                routes.extend(list(super::watched::<UDPRoute>(c, ns), &lp).await?.iter().map(Route::from))
            }
        }
    }
    let gateways = list(super::watched::<Gateway>(c, ns), &lp).await?;
    let selects = gateways.iter().flat_map(|g| &g.spec.listeners).any(|l| {
        l.allowed_routes.as_ref().and_then(|a| a.namespaces.as_ref()).and_then(|n| n.from.as_deref())
            == Some("Selector")
    });
    let namespaces = if selects {
        list(Api::<Namespace>::all(c.clone()), &lp)
            .await?
            .into_iter()
            .map(|n| (n.name_any(), n.labels().clone()))
            .collect()
    } else {
        Default::default()
    };
    let bundle_version = match Api::<CustomResourceDefinition>::all(c.clone())
        .get_opt(&format!("gateways.{GROUP}"))
        .await
    {
        Ok(crd) => crd.and_then(|c| c.annotations().get("gateway.networking.k8s.io/bundle-version").cloned()),
        // Without the right to read CRDs the version is not known; assume it fits.
        Err(_) => None,
    };
    let mut grants =
        if served.grants { list(super::watched::<ReferenceGrant>(c, ns), &lp).await? } else { Vec::new() };
    let mut services: BTreeSet<(String, String)> = list(super::watched::<Service>(c, ns), &lp)
        .await?
        .into_iter()
        .map(|s| (s.namespace().unwrap_or_default(), s.name_any()))
        .collect();
    // Namespaces outside the watched one that backendRefs name: their
    // ReferenceGrants and Services. Without the right to read them (the chart
    // binds the operator to the watched namespace only) nothing is granted.
    if let Some(watched) = ns {
        let targets: BTreeSet<String> = routes
            .iter()
            .flat_map(|r| r.backend_refs().into_iter().filter_map(|b| b.namespace.clone()))
            .filter(|n| n != watched)
            .collect();
        let fatal =
            |e: &Error| !matches!(e, Error::Kube(kube::Error::Api(s)) if [403, 404].contains(&s.code));
        for target in targets {
            if served.grants {
                match list(Api::<ReferenceGrant>::namespaced(c.clone(), &target), &lp).await {
                    Ok(g) => grants.extend(g),
                    Err(e) if fatal(&e) => return Err(e),
                    Err(_) => continue,
                }
            }
            match list(Api::<Service>::namespaced(c.clone(), &target), &lp).await {
                Ok(list) => services.extend(list.into_iter().map(|s| (target.clone(), s.name_any()))),
                Err(e) if fatal(&e) => return Err(e),
                Err(_) => {}
            }
        }
    }
    let cert_secrets = cert_secrets(c, &gateways).await?;
    Ok(Observed {
        cert_secrets,
        classes: list(Api::<GatewayClass>::all(c.clone()), &lp).await?,
        gateways,
        routes,
        grants,
        domains: list(super::watched::<Domain>(c, ns), &lp).await?,
        tunnels: list(super::watched::<Tunnel>(c, ns), &managed).await?,
        tcp_ports: list(super::watched::<TcpPort>(c, ns), &managed).await?,
        udp_ports: list(super::watched::<UdpPort>(c, ns), &managed).await?,
        services,
        namespaces,
        served: served.routes.clone(),
        bundle_version,
    })
}

/// The Secrets HTTPS listeners' certificateRefs name (one GET each): does each
/// exist, and does it hold a PEM certificate and key? A Secret that cannot be
/// read (403) counts as missing.
async fn cert_secrets(c: &Client, gateways: &[Gateway]) -> Result<BTreeMap<(String, String), bool>, Error> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let mut out = BTreeMap::new();
    for g in gateways {
        let gw_ns = g.namespace().unwrap_or_default();
        // Collected first: an iterator of closures held across the awaits
        // below makes the operator's future not `Send` for every lifetime.
        let refs: Vec<(String, String)> =
            g.spec.listeners.iter().flat_map(|l| plan::certificate_refs(l, &gw_ns)).flatten().collect();
        for (ns, name) in refs {
            if name.is_empty() || out.contains_key(&(ns.clone(), name.clone())) {
                continue;
            }
            let secret = match Api::<Secret>::namespaced(c.clone(), &ns).get_opt(&name).await {
                Ok(s) => s,
                Err(kube::Error::Api(s)) if s.code == 403 => None,
                Err(e) => return Err(e.into()),
            };
            if let Some(secret) = secret {
                let data = secret.data.unwrap_or_default();
                let field = |k: &str| data.get(k).map(|b| b.0.as_slice()).unwrap_or_default();
                let certs = CertificateDer::pem_slice_iter(field("tls.crt")).collect::<Result<Vec<_>, _>>();
                let ok = certs.is_ok_and(|c| !c.is_empty())
                    && PrivateKeyDer::from_pem_slice(field("tls.key")).is_ok();
                out.insert((ns, name), ok);
            }
        }
    }
    Ok(out)
}

async fn reconcile(ctx: &Context, served: &Served) -> Result<(), Error> {
    let observed = observe(ctx, served).await?;
    let info = &ctx.edge_info;
    let settings = Settings {
        edge_domain: &info.domain,
        public_host: &info.public_host,
        https_port: info.public_https_port,
        tcp_ports: (info.tcp_ports.first, info.tcp_ports.last),
        domain_policy: ctx.domain_policy,
    };
    let plan = plan::plan(&observed, settings);
    execute(ctx, &observed, &plan).await
}

/// Applies a child object (server-side, our one field manager).
async fn apply_child<S: Serialize, K>(kind: &str, c: &Child<S>, api: Api<K>) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let body = json!({
        "apiVersion": "culvert.dev/v1alpha1",
        "kind": kind,
        "metadata": {
            "name": c.name,
            "namespace": c.namespace,
            "labels": { LABEL_MANAGED_BY: MANAGED_BY },
            "annotations": { ANNOTATION_HOST: c.serves },
            "ownerReferences": c.owners,
        },
        "spec": c.spec,
    });
    api.patch(&c.name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&body)).await?;
    Ok(())
}

/// Server-side applies a status when it differs from `old`.
async fn write_status<K, S>(api: Api<K>, name: &str, old: Option<&S>, status: &S) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + PartialEq,
{
    if old == Some(status) {
        return Ok(());
    }
    let patch = json!({ "apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status });
    match api.patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch)).await {
        Ok(_) => Ok(()),
        // Deleted meanwhile: its deletion brings the next reconcile.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Carries out the plan: the children first (Domains, TcpPorts, Tunnels),
/// then what is no longer needed, then the statuses.
async fn execute(ctx: &Context, o: &Observed, p: &Plan) -> Result<(), Error> {
    let c = &ctx.client;
    for d in &p.domains {
        apply_child("Domain", d, Api::<Domain>::namespaced(c.clone(), &d.namespace)).await?;
    }
    for t in &p.tcp_ports {
        apply_child("TcpPort", t, Api::<TcpPort>::namespaced(c.clone(), &t.namespace)).await?;
    }
    for u in &p.udp_ports {
        apply_child("UdpPort", u, Api::<UdpPort>::namespaced(c.clone(), &u.namespace)).await?;
    }
    for t in &p.tunnels {
        apply_child("Tunnel", t, Api::<Tunnel>::namespaced(c.clone(), &t.namespace)).await?;
    }
    let dp = DeleteParams::background();
    let gone = |r: Result<_, kube::Error>| match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(Error::Kube(e)),
    };
    for (ns, name) in &p.delete_tunnels {
        gone(Api::<Tunnel>::namespaced(c.clone(), ns).delete(name, &dp).await.map(|_| ()))?;
        info!(namespace = %ns, tunnel = %name, "no route publishes it any more: deleted the Tunnel");
    }
    for (ns, name) in &p.delete_domains {
        gone(Api::<Domain>::namespaced(c.clone(), ns).delete(name, &dp).await.map(|_| ()))?;
        info!(namespace = %ns, domain = %name, "deleted the Domain made for a route's host");
    }
    for (ns, name) in &p.delete_tcp_ports {
        gone(Api::<TcpPort>::namespaced(c.clone(), ns).delete(name, &dp).await.map(|_| ()))?;
        info!(namespace = %ns, tcp_port = %name, "deleted the TcpPort made for a TCP listener");
    }
    for (ns, name) in &p.delete_udp_ports {
        gone(Api::<UdpPort>::namespaced(c.clone(), ns).delete(name, &dp).await.map(|_| ()))?;
        info!(namespace = %ns, udp_port = %name, "deleted the UdpPort made for a UDP listener");
    }
    for (name, status) in &p.class_status {
        let old = o.classes.iter().find(|x| x.name_any() == *name).and_then(|x| x.status.as_ref());
        write_status(Api::<GatewayClass>::all(c.clone()), name, old, status).await?;
    }
    for (ns, name, status) in &p.gateway_status {
        let old = o
            .gateways
            .iter()
            .find(|g| g.namespace().as_deref() == Some(ns.as_str()) && g.name_any() == *name)
            .and_then(|g| g.status.as_ref());
        write_status(Api::<Gateway>::namespaced(c.clone(), ns), name, old, status).await?;
    }
    for (kind, ns, name, status) in &p.route_status {
        let old = o
            .routes
            .iter()
            .find(|r| r.kind == *kind && r.namespace == *ns && r.name == *name)
            .map(|r| &r.status);
        match kind {
            Kind::Http => {
                write_status(Api::<HTTPRoute>::namespaced(c.clone(), ns), name, old, status).await?
            }
            Kind::Grpc => {
                write_status(Api::<GRPCRoute>::namespaced(c.clone(), ns), name, old, status).await?
            }
            Kind::Tls => write_status(Api::<TLSRoute>::namespaced(c.clone(), ns), name, old, status).await?,
            Kind::Tcp => write_status(Api::<TCPRoute>::namespaced(c.clone(), ns), name, old, status).await?,
            Kind::Udp => write_status(Api::<UDPRoute>::namespaced(c.clone(), ns), name, old, status).await?,
        }
    }
    Ok(())
}
