//! Listeners without `hostname` on the edge's default host (the reservation
//! of `*`, which gets every request whose host no reservation holds): the
//! routes of every culvert Gateway of one namespace that reach such a
//! listener without a host of their own Domain become one Tunnel in the
//! Gateway's namespace, on a Domain of fqdn `*`. Each rule keeps the hosts
//! it was for (`hosts`, matched by the agents: an exact host before a
//! wildcard before none); a rule of a route without hostnames has none.
//!
//! The edge has one default host, so one namespace holds it: that of the
//! oldest Gateway with such a listener. The same listeners of Gateways in
//! other namespaces are `Conflicted` (and not programmed), with what to do.
//!
//! A route of another namespace `N` keeps its backends in `N`: the Tunnel's
//! rule names them with `namespace: N`, and the Tunnel controller lets a
//! Tunnel use a Service of `N` only if a ReferenceGrant says so, or a
//! Gateway API route of `N` itself attaches to a Gateway of the Tunnel's
//! namespace and sends to that Service (`routed_by_a_route_of`, in
//! `operator::tunnel`); ARCHITECTURE.md says why that is safe.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;

use super::types::{GROUP, Gateway, Listener};
use crate::crd::{TunnelRoute, WeightedServiceRef};

/// The host of the default host's Domain.
pub const HOST: &str = crate::api::DEFAULT_HOST;

/// Does this listener serve the default host: HTTP or HTTPS, no hostname?
pub fn is_default_listener(l: &Listener) -> bool {
    l.hostname.as_deref().is_none_or(str::is_empty) && matches!(l.protocol.as_str(), "HTTP" | "HTTPS")
}

/// The namespace whose Gateways hold the default host: that of the oldest
/// of `gateways` (creation time, then namespace and name) with a usable
/// default listener (`usable(gateway, listener index)`).
pub fn holder<'a>(gateways: &[&'a Gateway], usable: impl Fn(&Gateway, usize) -> bool) -> Option<&'a Gateway> {
    gateways
        .iter()
        .filter(|g| g.spec.listeners.iter().enumerate().any(|(i, l)| is_default_listener(l) && usable(g, i)))
        .min_by_key(|g| (g.metadata.creation_timestamp.clone().map(|t| t.0), g.namespace(), g.name_any()))
        .copied()
}

/// Why a default listener of another namespace is not served.
pub fn conflict_message(listener: &str, holder: &Gateway) -> String {
    format!(
        "listener {listener} has no hostname, so it would be served on the edge's default host, which Gateway {}/{} \
         (the oldest with such a listener) holds: give this listener a hostname, or attach its routes to that Gateway",
        holder.namespace().unwrap_or_default(),
        holder.name_any()
    )
}

/// The owner of the default host's objects: a Gateway of its namespace.
pub fn gateway_owner(g: &Gateway) -> OwnerReference {
    OwnerReference {
        api_version: format!("{GROUP}/v1"),
        kind: "Gateway".into(),
        name: g.name_any(),
        uid: g.uid().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: None,
    }
}

/// A route's Tunnel rules for the default host of namespace `gw_ns`: only
/// for `hosts` (none: any host), and with the backends of a route of
/// another namespace named in that namespace.
pub fn rules_for(routes: &[TunnelRoute], hosts: &[String], route_ns: &str, gw_ns: &str) -> Vec<TunnelRoute> {
    routes
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.hosts = hosts.to_vec();
            if route_ns != gw_ns {
                if let Some(s) = r.service.take() {
                    r.backends = vec![WeightedServiceRef {
                        name: s.name,
                        namespace: None,
                        port: s.port,
                        weight: 1,
                        refused: None,
                    }];
                }
                for b in &mut r.backends {
                    b.namespace = match b.namespace.take() {
                        None => Some(route_ns.to_string()),
                        Some(ns) if ns == gw_ns => None,
                        other => other,
                    };
                }
            }
            r
        })
        .collect()
}

/// The rules a Gateway namespace's default host is given, oldest route first.
pub type DefaultRoutes = BTreeMap<String, Vec<TunnelRoute>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ServiceRef;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    #[test]
    fn rules_of_another_namespace_keep_their_backends_there() {
        let r = TunnelRoute {
            path: "/".into(),
            service: Some(ServiceRef { name: "web".into(), port: IntOrString::Int(80) }),
            ..Default::default()
        };
        let same = rules_for(std::slice::from_ref(&r), &[], "infra", "infra");
        assert_eq!(same[0].service.as_ref().unwrap().name, "web");
        let other = rules_for(&[r], &["a.example.com".into()], "apps", "infra");
        assert!(other[0].service.is_none());
        assert_eq!(other[0].backends[0].namespace.as_deref(), Some("apps"));
        assert_eq!(other[0].hosts, vec!["a.example.com".to_string()]);
        let weighted = TunnelRoute {
            path: "/".into(),
            backends: vec![
                WeightedServiceRef {
                    name: "a".into(),
                    namespace: None,
                    port: IntOrString::Int(80),
                    weight: 1,
                    refused: None,
                },
                WeightedServiceRef {
                    name: "b".into(),
                    namespace: Some("infra".into()),
                    port: IntOrString::Int(80),
                    weight: 1,
                    refused: None,
                },
            ],
            ..Default::default()
        };
        let out = rules_for(&[weighted], &[], "apps", "infra");
        assert_eq!(out[0].backends[0].namespace.as_deref(), Some("apps"));
        assert_eq!(out[0].backends[1].namespace, None, "a Service of the Gateway's namespace");
    }
}
