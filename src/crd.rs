//! The custom resources of `culvert.dev/v1alpha1`: `Domain`, `TcpPort`,
//! `UdpPort` and `Tunnel`. The YAML in `crds/` is generated from these types by
//! `culvert crd` and checked for drift by a test.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What happens to the reservation at the edge when the object is deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimPolicy {
    /// Release the reservation at the edge.
    #[default]
    Delete,
    /// Keep the reservation; an object created again adopts it.
    Retain,
}

/// A status condition (the Kubernetes API conventions' shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type, e.g. `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word saying why.
    pub reason: String,
    /// What happened and what to do about it.
    pub message: String,
    /// When the status last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// The generation this condition was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A reserved public host name on the edge: a subdomain of the edge's domain
/// (`spec.name`) or a custom domain pointed at the edge by CNAME (`spec.fqdn`).
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "culvert.dev",
    version = "v1alpha1",
    kind = "Domain",
    namespaced,
    status = "DomainStatus",
    shortname = "cdomain",
    category = "culvert",
    doc = "A public host name reserved on the edge for this namespace: a subdomain of the edge's domain, or your own domain pointed at the edge by CNAME. Tunnels of the namespace publish on it.",
    printcolumn = r#"{"name":"Host","type":"string","jsonPath":".status.hostname"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Certificate","type":"string","jsonPath":".status.conditions[?(@.type==\"CertificateReady\")].reason"}"#,
    printcolumn = r#"{"name":"Reclaim","type":"string","priority":1,"jsonPath":".spec.reclaimPolicy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct DomainSpec {
    /// A subdomain label: `podinfo` publishes `podinfo.<edge domain>`. Give
    /// this or `fqdn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A custom domain, e.g. `app.example.org`, pointed at the edge by CNAME.
    /// Give this or `name`. `*` is the edge's default host: every request
    /// whose host no reservation holds (the edge's own address, names
    /// nobody reserved); one per edge, for a key the edge's admin allowed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fqdn: Option<String>,
    /// `Delete` (default) releases the reservation with the object; `Retain`
    /// keeps it for the next object that asks for the same name.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
}

/// Observed state of a Domain.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DomainStatus {
    /// The generation last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` with reason and message; for a custom domain also
    /// `CertificateReady` (the edge's ACME certificate for it).
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// For a custom domain: when the certificate the edge serves expires (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate_expiry: Option<String>,
    /// The reserved public host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The public URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// For a custom domain: the CNAME target to set at your DNS provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cname_target: Option<String>,
    /// Id of the reservation at the edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
}

/// A reserved TCP port on the edge.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "culvert.dev",
    version = "v1alpha1",
    kind = "TcpPort",
    namespaced,
    status = "TcpPortStatus",
    shortname = "ctcpport",
    category = "culvert",
    doc = "A public TCP port reserved on the edge for this namespace (the address is in status.address). A Tunnel of protocol tcp publishes a Service on it.",
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".status.address"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Reclaim","type":"string","priority":1,"jsonPath":".spec.reclaimPolicy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TcpPortSpec {
    /// The port to reserve; empty takes any free port of the edge's range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 65535))]
    pub port: Option<u16>,
    /// Close the port's public connections after this many seconds with no
    /// byte either way (1 to 2592000); empty: the edge's
    /// `--tcp-idle-timeout-seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 2592000))]
    pub idle_timeout_seconds: Option<u64>,
    /// `Delete` (default) or `Retain`, as for Domain.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
}

/// Observed state of a TcpPort.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TcpPortStatus {
    /// The generation last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` with reason and message.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The reserved port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>")]
    pub port: Option<u16>,
    /// The public address, `host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Id of the reservation at the edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
}

/// A reserved UDP port on the edge. UDP and TCP ports are separate spaces:
/// UDP 5353 and TCP 5353 are two reservations.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "culvert.dev",
    version = "v1alpha1",
    kind = "UdpPort",
    namespaced,
    status = "UdpPortStatus",
    shortname = "cudpport",
    category = "culvert",
    doc = "A public UDP port reserved on the edge for this namespace (the address is in status.address). A Tunnel of protocol udp publishes a Service on it.",
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".status.address"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Reclaim","type":"string","priority":1,"jsonPath":".spec.reclaimPolicy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct UdpPortSpec {
    /// The UDP port to reserve; empty takes any free UDP port of the edge's range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 65535))]
    pub port: Option<u16>,
    /// `Delete` (default) or `Retain`, as for Domain.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
}

/// Observed state of a UdpPort: the same fields as a TcpPort's (the
/// address is `host:port` of the UDP port).
pub type UdpPortStatus = TcpPortStatus;

/// How a Tunnel publishes its Service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TunnelProtocol {
    /// HTTP(S) on a Domain; TLS is terminated at the edge.
    #[default]
    Http,
    /// Raw TCP on a TcpPort.
    Tcp,
    /// TLS passthrough on a Domain: the backend terminates TLS.
    Tls,
    /// UDP datagrams on a UdpPort.
    Udp,
}

/// PROXY protocol header sent to the backend with the public client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProxyProtocol {
    V1,
    V2,
}

/// The Service a Tunnel sends traffic to: always in the Tunnel's namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRef {
    /// Name of a Service in the Tunnel's own namespace (not ExternalName).
    pub name: String,
    /// The Service port, by number or by name.
    #[schemars(schema_with = "int_or_string")]
    pub port: IntOrString,
}

fn int_or_string(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"x-kubernetes-int-or-string": true})
}

/// How a route's path matches the request path (the Ingress path types;
/// `ImplementationSpecific` is read as `Prefix`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum PathType {
    /// The request path equals `path` exactly (case-sensitive).
    Exact,
    /// `path` is an element-wise prefix of the request path: `/foo` matches
    /// `/foo`, `/foo/` and `/foo/bar`, not `/foobar`.
    #[default]
    Prefix,
}

/// How the agent speaks to an HTTP backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendProtocol {
    /// HTTP/1.1 without TLS.
    #[default]
    Http,
    /// HTTP/2 without TLS, with prior knowledge (gRPC servers and others
    /// that speak HTTP/2 in clear text).
    H2c,
    /// HTTPS (HTTP/2 or HTTP/1.1 by ALPN); the certificate is verified
    /// against the public host name unless `backendTlsVerify` is false.
    Https,
}

/// Options of an HTTP route (or of the default backend), applied by the
/// agent that forwards to the backend. Changing them never reconnects the
/// tunnel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpOptions {
    /// `http` (default), `h2c` or `https`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_protocol: Option<BackendProtocol>,
    /// With `https`: `false` accepts any certificate (a self-signed one, for
    /// example). Default `true`: verified against the Mozilla roots, for the
    /// public host name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_tls_verify: Option<bool>,
    /// Seconds to wait for a connection to the backend (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 3600))]
    pub connect_timeout_seconds: Option<u32>,
    /// Seconds the backend may take to send the response headers, and the
    /// longest pause between two reads of the response body; slower answers
    /// 504 (default: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 86400))]
    pub read_timeout_seconds: Option<u32>,
    /// Largest request body: bytes, or with a unit `k`, `m`, `g` (powers of
    /// 1024; `10m` is 10 MiB); larger answers 413. `0` or unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]{1,15}[kKmMgG]?$"))]
    pub max_body_size: Option<String>,
    /// Name of a Secret of this namespace whose credentials every request
    /// must present: `auth` holds htpasswd lines for HTTP Basic auth, each
    /// `user:{SHA}...` (`htpasswd -nbs user password`), `user:{SSHA}...`
    /// (`slappasswd`) or `user:{PLAIN}password`; bcrypt, MD5 and crypt
    /// hashes and bare `user:password` lines are refused. `token` holds
    /// bearer tokens, one a line. Others get 401.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_secret: Option<String>,
}

impl HttpOptions {
    pub fn is_default(&self) -> bool {
        *self == HttpOptions::default()
    }
}

/// A backend of a weighted split: a Service of the Tunnel's namespace and
/// its share of the route's requests (Gateway API `backendRefs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WeightedServiceRef {
    /// Name of a Service in the Tunnel's own namespace (not ExternalName).
    pub name: String,
    /// The Service port, by number or by name.
    #[schemars(schema_with = "int_or_string")]
    pub port: IntOrString,
    /// Share of the route's requests: this weight over the sum of the
    /// route's weights (default 1; `0` never gets a request).
    #[serde(default = "default_weight")]
    #[schemars(with = "i32", range(min = 0, max = 1_000_000))]
    pub weight: u32,
    /// A Service of another namespace (the Gateway API controller writes
    /// this for a granted cross-namespace backendRef, and for a route of
    /// that namespace on the default host of a Gateway of the Tunnel's): used
    /// only while a ReferenceGrant of that namespace lets Gateway API routes
    /// of the Tunnel's namespace refer to the Service, or a route of that
    /// namespace attached to a Gateway of the Tunnel's namespace sends to
    /// it; otherwise this share answers 500.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Why this share cannot be used, when the Gateway API controller
    /// refuses its backendRef (a kind other than Service, a Service of
    /// another namespace without a ReferenceGrant, no port): its requests
    /// answer 500, as Gateway API asks, and `name` and `port` are not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

fn default_weight() -> u32 {
    1
}

/// How a header or query parameter match compares the value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum MatchType {
    /// The value equals `value` exactly (case-sensitive).
    #[default]
    Exact,
    /// `value` is a regular expression (Rust `regex` syntax) that must match
    /// the whole value.
    RegularExpression,
}

/// One header or query parameter a request must carry for a route to match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValueMatch {
    /// The header name (compared case-insensitively) or the query
    /// parameter name (compared exactly).
    pub name: String,
    /// The value to compare with (see `type`).
    pub value: String,
    /// `Exact` (default) or `RegularExpression`.
    #[serde(rename = "type", default)]
    pub type_: MatchType,
}

/// What a route filter does (Gateway API `HTTPRouteFilter` types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RouteFilterType {
    /// Changes the request's headers before it goes to the backend
    /// (`requestHeaderModifier`).
    RequestHeaderModifier,
    /// Changes the response's headers before they go to the client
    /// (`responseHeaderModifier`).
    ResponseHeaderModifier,
    /// Answers with a redirect instead of forwarding (`requestRedirect`).
    RequestRedirect,
    /// Changes the Host header and/or the path sent to the backend
    /// (`urlRewrite`).
    #[serde(rename = "URLRewrite")]
    UrlRewrite,
}

/// A header name and value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HttpHeader {
    /// The header name (case-insensitive).
    pub name: String,
    /// The header value.
    pub value: String,
}

/// Header changes (Gateway API `HTTPHeaderFilter`), applied in the order
/// `set`, `add`, `remove`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderModifier {
    /// Headers to set, replacing any value they had.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<HttpHeader>,
    /// Headers to add to the values they already have.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<HttpHeader>,
    /// Names of headers to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

/// How a redirect or a rewrite changes the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum PathModifierType {
    /// The whole path becomes `replaceFullPath`.
    ReplaceFullPath,
    /// The part of the path the route's `Prefix` path matched becomes
    /// `replacePrefixMatch`; the rest of the path is kept.
    ReplacePrefixMatch,
}

/// A path change of a redirect or a rewrite (Gateway API `HTTPPathModifier`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PathModifier {
    /// `ReplaceFullPath` or `ReplacePrefixMatch`.
    #[serde(rename = "type")]
    pub type_: PathModifierType,
    /// With `ReplaceFullPath`: the new path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_full_path: Option<String>,
    /// With `ReplacePrefixMatch`: what replaces the matched prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_prefix_match: Option<String>,
}

/// A redirect the agent answers itself (Gateway API `HTTPRequestRedirectFilter`).
/// What is not given is kept from the request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RequestRedirect {
    /// `http` or `https`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    /// The host name of the Location.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// How the path changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathModifier>,
    /// The port of the Location; without it, the default port of the scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>", range(min = 1, max = 65535))]
    pub port: Option<u16>,
    /// `301`, `302` (default), `303`, `307` or `308`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<i32>")]
    pub status_code: Option<u16>,
}

/// A rewrite of what the backend receives (Gateway API `HTTPURLRewriteFilter`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UrlRewrite {
    /// The Host header the backend receives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// How the path the backend receives changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathModifier>,
}

/// A filter of a route, in Gateway API's `HTTPRouteFilter` shape: `type`
/// and the field of that type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteFilter {
    /// `RequestHeaderModifier`, `ResponseHeaderModifier`, `RequestRedirect`
    /// or `URLRewrite`.
    #[serde(rename = "type")]
    pub type_: RouteFilterType,
    /// With `RequestHeaderModifier`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderModifier>,
    /// With `ResponseHeaderModifier`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderModifier>,
    /// With `RequestRedirect`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_redirect: Option<RequestRedirect>,
    /// With `URLRewrite`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_rewrite: Option<UrlRewrite>,
}

/// One HTTP route of a Tunnel: requests that match its path (and its
/// method, headers and query parameters, if given) go to its Service or
/// its weighted `backends`, through its filters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelRoute {
    /// The path, starting with `/`.
    pub path: String,
    /// `Exact` or `Prefix` (default).
    #[serde(default)]
    pub path_type: PathType,
    /// The backend Service and port. Give this, or `backends`, or neither
    /// (then only a `RequestRedirect` filter answers; otherwise 500).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRef>,
    /// Services sharing the route's requests by weight.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<WeightedServiceRef>,
    /// The HTTP method the request must have (upper case, e.g. `GET`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Headers the request must carry, each matching.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<ValueMatch>,
    /// Query parameters the request must carry, each matching.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query_params: Vec<ValueMatch>,
    /// The request's host must be one of these: a name (`app.example.com`)
    /// or a wildcard (`*.example.com`: one label or more before it), case
    /// insensitive, the port not counted. None: any host. A rule naming the
    /// host exactly wins over a wildcard, a wildcard over a rule without hosts
    /// (useful on the default host, `defaultHost`, which gets many hosts).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Filters applied to the requests of this route, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<RouteFilter>,
    /// How requests of this route are forwarded.
    #[serde(default, skip_serializing_if = "HttpOptions::is_default")]
    pub options: HttpOptions,
}

/// The resolved addresses of one of a route's weighted `backends`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WeightedBackends {
    /// The share's weight.
    #[schemars(with = "i32")]
    pub weight: u32,
    /// Backend addresses (`ip:port`); empty when the Service cannot be used
    /// (the Ready condition says why): this share's requests answer 500.
    #[serde(default)]
    pub backends: Vec<String>,
}

/// A route with the addresses the operator resolved for it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResolvedRoute {
    /// The path, starting with `/`.
    pub path: String,
    /// `Exact` or `Prefix`.
    pub path_type: PathType,
    /// Backend addresses (`ip:port`) of `service`; empty when the Service
    /// cannot be used (the Ready condition says why) and the path answers 503.
    #[serde(default)]
    pub backends: Vec<String>,
    /// The route's weighted `backends`, resolved, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weighted: Vec<WeightedBackends>,
    /// The method the request must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Headers the request must carry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<ValueMatch>,
    /// Query parameters the request must carry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query_params: Vec<ValueMatch>,
    /// The hosts the request must be for (none: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// The route's filters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<RouteFilter>,
    /// The route's options, as the agents apply them.
    #[serde(default, skip_serializing_if = "HttpOptions::is_default")]
    pub options: HttpOptions,
}

/// Publishes one port of a Service on a Domain (http, tls), a TcpPort (tcp)
/// or a UdpPort (udp) of the same namespace, without an Ingress.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "culvert.dev",
    version = "v1alpha1",
    kind = "Tunnel",
    namespaced,
    status = "TunnelStatus",
    shortname = "ctunnel",
    category = "culvert",
    doc = "Publishes a Service of this namespace on the internet through the edge: on a Domain (protocol http or tls), a TcpPort (tcp) or a UdpPort (udp). Ready means published and an agent connected, that is, reachable.",
    printcolumn = r#"{"name":"Service","type":"string","jsonPath":".spec.service.name"}"#,
    printcolumn = r#"{"name":"URL","type":"string","jsonPath":".status.url"}"#,
    printcolumn = r#"{"name":"Agents","type":"integer","jsonPath":".status.agents"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Protocol","type":"string","priority":1,"jsonPath":".spec.protocol"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TunnelSpec {
    /// The backend Service and port. With `routes`: the default backend of
    /// requests no route matches (optional; without it they get 404).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRef>,
    /// HTTP routes (protocol http only). Of the routes a request matches,
    /// an `Exact` path wins, then the longest path, then a route with a
    /// `method`, then the most `headers`, then the most `queryParams`, then
    /// the first listed. The Ingress and Gateway API controllers write
    /// these; changing them never reconnects the tunnel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<TunnelRoute>,
    /// `http` (default), `tcp`, `tls` (passthrough) or `udp`.
    #[serde(default)]
    pub protocol: TunnelProtocol,
    /// Name of a Domain in this namespace (http and tls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Name of a TcpPort in this namespace (tcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_port: Option<String>,
    /// Name of a UdpPort in this namespace (udp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_port: Option<String>,
    /// Send a PROXY protocol header (tcp, tls; udp: `v2` only, one before
    /// every datagram) with the public client address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_protocol: Option<ProxyProtocol>,
    /// How requests to `service` are forwarded (protocol http; each route
    /// has its own `options`).
    #[serde(default, skip_serializing_if = "HttpOptions::is_default")]
    pub options: HttpOptions,
}

impl TunnelSpec {
    /// Names of every Service the Tunnel sends traffic to.
    pub fn services(&self) -> impl Iterator<Item = &str> {
        self.service.iter().map(|s| s.name.as_str()).chain(self.routes.iter().flat_map(|r| {
            r.service
                .iter()
                .map(|s| s.name.as_str())
                .chain(r.backends.iter().filter(|b| b.refused.is_none()).map(|b| b.name.as_str()))
        }))
    }

    /// Names of the Secrets the options name for auth.
    pub fn auth_secrets(&self) -> impl Iterator<Item = &str> {
        std::iter::once(&self.options)
            .chain(self.routes.iter().map(|r| &r.options))
            .filter_map(|o| o.auth_secret.as_deref())
    }
}

/// Observed state of a Tunnel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelStatus {
    /// The generation last reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (published and an agent connected: reachable), `Published`
    /// (the address and key are live at the edge) and `Connected` (an agent
    /// is connected at the edge), each with reason and message.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The public URL or address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Agents connected at the edge with this Tunnel's key.
    #[serde(default)]
    #[schemars(with = "i32")]
    pub agents: u32,
    /// Backend addresses (`ip:port`) the agents dial, as resolved by the operator
    /// (with routes: those of the default backend).
    #[serde(default)]
    pub backends: Vec<String>,
    /// The routes with their resolved backend addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<ResolvedRoute>,
    /// The options of `backends`, as the agents apply them.
    #[serde(default, skip_serializing_if = "HttpOptions::is_default")]
    pub options: HttpOptions,
    /// The Secret holding this Tunnel's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret: Option<String>,
}

/// Every CRD of culvert as one multi-document YAML.
pub fn crds_yaml() -> String {
    use kube::CustomResourceExt;
    [Domain::crd(), TcpPort::crd(), UdpPort::crd(), Tunnel::crd()]
        .iter()
        .map(|crd| format!("---\n{}", serde_saphyr::to_string(crd).expect("CRDs serialize")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_crds_match_the_types() {
        let committed = include_str!("../crds/culvert.yaml");
        assert!(
            committed == crds_yaml(),
            "crds/culvert.yaml is stale: run `cargo run -- crd > crds/culvert.yaml`"
        );
    }

    #[test]
    fn tunnel_accepts_port_by_number_or_name() {
        let t: TunnelSpec = serde_json::from_value(serde_json::json!({
            "service": {"name": "podinfo", "port": 9898}, "domain": "podinfo"
        }))
        .unwrap();
        assert_eq!(t.service.as_ref().unwrap().port, IntOrString::Int(9898));
        assert_eq!(t.protocol, TunnelProtocol::Http);
        let t: TunnelSpec = serde_json::from_value(serde_json::json!({
            "service": {"name": "db", "port": "postgres"}, "protocol": "tcp", "tcpPort": "db"
        }))
        .unwrap();
        assert_eq!(t.service.unwrap().port, IntOrString::String("postgres".into()));
        let t: TunnelSpec = serde_json::from_value(serde_json::json!({
            "service": {"name": "dns", "port": 53}, "protocol": "udp", "udpPort": "dns"
        }))
        .unwrap();
        assert_eq!((t.protocol, t.udp_port.as_deref()), (TunnelProtocol::Udp, Some("dns")));
    }

    #[test]
    fn route_reads_gateway_api_shapes_and_old_routes_stay_the_same() {
        let old = serde_json::json!({
            "path": "/api", "pathType": "Prefix", "service": {"name": "api", "port": 80}
        });
        let r: TunnelRoute = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), old, "an Ingress route serializes as before");
        let r: TunnelRoute = serde_json::from_value(serde_json::json!({
            "path": "/", "backends": [{"name": "a", "port": 80, "weight": 80}, {"name": "b", "port": "http"}],
            "method": "GET",
            "headers": [{"name": "x-env", "value": "canary"}, {"name": "x-v", "value": "^v[0-9]+$", "type": "RegularExpression"}],
            "queryParams": [{"name": "q", "value": "1"}],
            "filters": [
                {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "a", "value": "1"}], "remove": ["b"]}},
                {"type": "URLRewrite", "urlRewrite": {"hostname": "h", "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/v2"}}},
                {"type": "RequestRedirect", "requestRedirect": {"scheme": "https", "port": 8443, "statusCode": 301}}
            ]
        }))
        .unwrap();
        assert_eq!(r.service, None);
        assert_eq!(r.backends[0].weight, 80);
        assert_eq!(r.backends[1].weight, 1, "weight defaults to 1");
        assert_eq!(r.headers[0].type_, MatchType::Exact);
        assert_eq!(r.headers[1].type_, MatchType::RegularExpression);
        assert_eq!(r.filters[1].type_, RouteFilterType::UrlRewrite);
        assert_eq!(
            r.filters[1].url_rewrite.as_ref().unwrap().path.as_ref().unwrap().type_,
            PathModifierType::ReplacePrefixMatch
        );
        assert_eq!(r.filters[2].request_redirect.as_ref().unwrap().status_code, Some(301));
        let back = serde_json::to_value(&r.filters[1]).unwrap();
        assert_eq!(back["type"], "URLRewrite");
    }
}
