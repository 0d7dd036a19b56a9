//! Control API under `/_culvert/v1/api/`: JSON in camelCase, bearer API keys.
//!
//! | method | path | who |
//! |---|---|---|
//! | GET | `info` | any API key |
//! | GET, POST | `domains` | admin, endpoints |
//! | GET, DELETE | `domains/{hostname or label}` | admin, endpoints (own) |
//! | GET, POST | `ports` | admin, endpoints |
//! | GET, DELETE | `ports/{port}` | admin, endpoints (own) |
//! | GET, POST | `tunnel-keys` | admin, endpoints |
//! | GET, DELETE | `tunnel-keys/{id}` | admin, endpoints (own) |
//! | GET, POST | `api-keys` | admin |
//! | GET, DELETE | `api-keys/{id}` | admin |
//!
//! An endpoints key sees and changes only what it holds (reservations it made
//! and the tunnel keys of those); an admin key sees and changes everything.
//! Tunnel keys get 403 `tunnel_key_not_allowed`. Every error is
//! `{"error": {"code": "...", "message": "..."}}` with a message that says
//! what to do.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::store::{ApiKeyAuth, CertificateRecord, Store, StoreError, unix_now};
use crate::api::PortRange;
use crate::api::{
    ApiKey, ApiKeyScope, CreateApiKeyRequest, CreateTunnelKeyRequest, CreatedApiKey, CreatedTunnelKey,
    ErrorBody, Info, List, Protocol, ReleaseResponse, Reservation, ReservationKind, ReserveDomainRequest,
    ReservePortRequest, Selector, TunnelKey, validate_labels,
};
use crate::constants::{API_BODY_TIMEOUT, API_MAX_BODY, API_PREFIX, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use crate::http::percent_decode;

/// What the control API needs from the running edge.
pub trait EdgeHooks: Send + Sync + 'static {
    /// Reservations or tunnel keys were added, released or revoked: the edge
    /// reloads its routes and TCP listeners and closes connections of keys
    /// that are no longer valid (within a second).
    fn state_changed(&self);
    /// Agents connected now with this tunnel key.
    fn connections_for_key(&self, key_id: &str) -> usize;
    /// Can the edge listen on this TCP port (no other program holds it)?
    fn port_usable(&self, _port: u16) -> bool {
        true
    }
}

/// Everything the API handler needs.
#[derive(Clone)]
pub struct ApiContext {
    /// The edge's database.
    pub store: Store,
    /// The edge's base domain (`--domain`).
    pub domain: String,
    /// Host name public TCP addresses are reported with.
    pub public_host: String,
    /// Port of public HTTPS (443 unless `--https-addr` says otherwise); used in public URLs.
    pub public_https_port: u16,
    /// Ports handed out to TCP reservations.
    pub tcp_ports: PortRange,
    /// The edge orders certificates for custom domains (`--acme`).
    pub acme: bool,
    /// Callbacks into the running edge.
    pub hooks: Arc<dyn EdgeHooks>,
}

/// Longest API key name.
pub const MAX_KEY_NAME: usize = 100;

/// Why an API call failed; each maps to an HTTP status and a stable `code`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 401: no key, unknown key, revoked key.
    #[error("{message}")]
    Unauthenticated {
        /// Stable code.
        code: &'static str,
        /// What to do.
        message: String,
    },
    /// 403: the key may not do this.
    #[error("{message}")]
    Forbidden {
        /// Stable code.
        code: &'static str,
        /// What to do.
        message: String,
    },
    /// 404: no such route or record.
    #[error("{message}")]
    NotFound {
        /// What is missing.
        message: String,
    },
    /// 405: the route exists, the method does not.
    #[error("{method} is not allowed on {path}; use {allowed}")]
    MethodNotAllowed {
        /// The method used.
        method: Method,
        /// The path asked for.
        path: String,
        /// Methods the route takes, comma-separated.
        allowed: &'static str,
    },
    /// 400: the request cannot be read (bad JSON, bad query, bad path).
    #[error("{message}")]
    BadRequest {
        /// Stable code.
        code: &'static str,
        /// What is wrong.
        message: String,
    },
    /// 413: the body is larger than [`API_MAX_BODY`].
    #[error("the request body is larger than {API_MAX_BODY} bytes")]
    TooLarge,
    /// 422: the request is well-formed but its values are not acceptable.
    #[error("{message}")]
    Invalid {
        /// Stable code.
        code: &'static str,
        /// What is wrong and what to send instead.
        message: String,
    },
    /// 409: the request conflicts with the edge's state.
    #[error("{message}")]
    Conflict {
        /// Stable code.
        code: &'static str,
        /// What is in the way.
        message: String,
    },
    /// 408: the body did not arrive in time.
    #[error("the request body did not arrive within {}s", API_BODY_TIMEOUT.as_secs())]
    BodyTimeout,
    /// 500: the store failed.
    #[error("the edge's store failed: {0}")]
    Store(#[source] StoreError),
}

impl ApiError {
    /// Static category (the error `code`), for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            ApiError::Unauthenticated { code, .. }
            | ApiError::Forbidden { code, .. }
            | ApiError::BadRequest { code, .. }
            | ApiError::Invalid { code, .. }
            | ApiError::Conflict { code, .. } => code,
            ApiError::NotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::TooLarge => "body_too_large",
            ApiError::BodyTimeout => "body_timeout",
            ApiError::Store(_) => "internal",
        }
    }

    /// The HTTP status of the error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthenticated { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ApiError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let status = self.status();
        let message = match &self {
            ApiError::Store(e) => {
                tracing::error!(error = %e, category = e.category(), "control API: store failed");
                format!("{self}; the edge's log has details")
            }
            _ => self.to_string(),
        };
        let mut response = json_response(status, &ErrorBody::new(self.category(), message));
        match &self {
            ApiError::Unauthenticated { .. } => {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"culvert\""));
            }
            ApiError::MethodNotAllowed { allowed, .. } => {
                response.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allowed));
            }
            _ => {}
        }
        response
    }

    fn invalid(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::Invalid { code, message: message.into() }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::AlreadyReserved { target, .. } if target.starts_with("port ") => ApiError::Conflict {
                code: "already_reserved",
                message: format!(
                    "{target} is held by another key; reserve another port, or omit the port to get a free one"
                ),
            },
            StoreError::AlreadyReserved { target, .. } => ApiError::Conflict {
                code: "already_reserved",
                message: format!("domain {target} is held by another key; reserve another name"),
            },
            StoreError::PortOutOfRange { port, range } => ApiError::invalid(
                "port_out_of_range",
                format!(
                    "port {port} is outside the edge's TCP port range {range}; pick a port inside it, or omit the port to get a free one"
                ),
            ),
            StoreError::PortInUse { port } => ApiError::Conflict {
                code: "port_in_use",
                message: format!(
                    "port {port} is in use on the edge's host by another program; reserve another port, or omit the port to get a free one"
                ),
            },
            StoreError::NoFreePort { range } => ApiError::Conflict {
                code: "no_free_port",
                message: format!(
                    "every port of the edge's TCP port range {range} is reserved; release one (culvert admin port release PORT) or widen the edge's --tcp-ports"
                ),
            },
            StoreError::NotFound { what } => ApiError::NotFound { message: format!("{what} does not exist") },
            StoreError::LastAdminKey { id } => ApiError::Conflict {
                code: "last_admin_key",
                message: format!(
                    "{id} is the last admin key and cannot be revoked; create another admin key first (culvert admin api-key create --scope admin)"
                ),
            },
            e => ApiError::Store(e),
        }
    }
}

/// Serves one request whose path starts with [`crate::constants::API_PREFIX`].
/// Generic over the body so unit tests can call it with `Full<Bytes>`.
pub async fn handle<B>(ctx: &ApiContext, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    match serve(ctx, req).await {
        Ok(response) => response,
        Err(e) => {
            tracing::debug!(code = e.category(), error = %e, "control API call refused");
            e.into_response()
        }
    }
}

/// One routed call: the path segments after the prefix.
enum Route {
    Info,
    Domains,
    Domain(String),
    Ports,
    Port(String),
    TunnelKeys,
    TunnelKey(String),
    ApiKeys,
    ApiKey(String),
}

impl Route {
    fn parse(path: &str) -> Option<Route> {
        let rest =
            path.strip_prefix(API_PREFIX).or_else(|| path.strip_prefix(API_PREFIX.trim_end_matches('/')))?;
        let rest = rest.trim_start_matches('/').trim_end_matches('/');
        let segments: Vec<&str> = rest.split('/').collect();
        let item = |s: &str| percent_decode(s).filter(|s| !s.is_empty());
        Some(match segments.as_slice() {
            ["info"] => Route::Info,
            ["domains"] => Route::Domains,
            ["domains", host] => Route::Domain(item(host)?),
            ["ports"] => Route::Ports,
            ["ports", port] => Route::Port(item(port)?),
            ["tunnel-keys"] => Route::TunnelKeys,
            ["tunnel-keys", id] => Route::TunnelKey(item(id)?),
            ["api-keys"] => Route::ApiKeys,
            ["api-keys", id] => Route::ApiKey(item(id)?),
            _ => return None,
        })
    }

    fn allowed(&self) -> &'static str {
        match self {
            Route::Info => "GET",
            Route::Domains | Route::Ports | Route::TunnelKeys | Route::ApiKeys => "GET, POST",
            Route::Domain(_) | Route::Port(_) | Route::TunnelKey(_) | Route::ApiKey(_) => "GET, DELETE",
        }
    }
}

async fn serve<B>(ctx: &ApiContext, req: Request<B>) -> Result<Response<Full<Bytes>>, ApiError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let path = req.uri().path().to_string();
    let query = Query::parse(req.uri().query())?;
    let caller = authenticate(&ctx.store, req.headers())?;
    let route = Route::parse(&path).ok_or_else(|| ApiError::NotFound {
        message: format!(
            "no API route {path}; routes are info, domains, ports, tunnel-keys and api-keys under {API_PREFIX}"
        ),
    })?;
    let method = req.method().clone();
    let not_allowed = || ApiError::MethodNotAllowed {
        method: method.clone(),
        path: path.clone(),
        allowed: route.allowed(),
    };
    if matches!(route, Route::ApiKeys | Route::ApiKey(_)) && caller.scope != ApiKeyScope::Admin {
        return Err(ApiError::Forbidden {
            code: "admin_required",
            message: format!(
                "managing API keys needs an admin key; {} is an {} key",
                caller.id, caller.scope
            ),
        });
    }
    let headers = req.headers().clone();
    let body = req.into_body();
    match (&route, &method) {
        (Route::Info, &Method::GET) => {
            query.only(&[])?;
            Ok(json_response(StatusCode::OK, &info(ctx, caller)))
        }
        (Route::Domains, &Method::GET) => {
            query.only(&["selector"])?;
            let selector = query.selector()?;
            let items = visible_reservations(ctx, &caller, &selector, false)?;
            Ok(json_response(StatusCode::OK, &List { items }))
        }
        (Route::Domains, &Method::POST) => {
            query.only(&[])?;
            let request: ReserveDomainRequest = read_json(body, &headers).await?;
            reserve_domain(ctx, &caller, request)
        }
        (Route::Domain(host), &Method::GET) => {
            query.only(&[])?;
            let reservation = domain_of(ctx, &caller, host)?;
            Ok(json_response(StatusCode::OK, &with_url(ctx, reservation)))
        }
        (Route::Domain(host), &Method::DELETE) => {
            query.only(&[])?;
            let reservation = domain_of(ctx, &caller, host)?;
            release(ctx, &caller, reservation)
        }
        (Route::Ports, &Method::GET) => {
            query.only(&["selector"])?;
            let selector = query.selector()?;
            let items = visible_reservations(ctx, &caller, &selector, true)?;
            Ok(json_response(StatusCode::OK, &List { items }))
        }
        (Route::Ports, &Method::POST) => {
            query.only(&[])?;
            let request: ReservePortRequest = read_json(body, &headers).await?;
            reserve_port(ctx, &caller, request)
        }
        (Route::Port(port), &Method::GET) => {
            query.only(&[])?;
            let reservation = port_of(ctx, &caller, port)?;
            Ok(json_response(StatusCode::OK, &with_url(ctx, reservation)))
        }
        (Route::Port(port), &Method::DELETE) => {
            query.only(&[])?;
            let reservation = port_of(ctx, &caller, port)?;
            release(ctx, &caller, reservation)
        }
        (Route::TunnelKeys, &Method::GET) => {
            query.only(&["selector", "revoked"])?;
            let selector = query.selector()?;
            let include_revoked = query.flag("revoked")?;
            let items: Vec<TunnelKey> = ctx
                .store
                .tunnel_keys(include_revoked)?
                .into_iter()
                .filter(|k| may_use(&caller, &k.owner) && selector.matches(&k.labels))
                .map(|k| with_connections(ctx, k))
                .collect();
            Ok(json_response(StatusCode::OK, &List { items }))
        }
        (Route::TunnelKeys, &Method::POST) => {
            query.only(&[])?;
            let request: CreateTunnelKeyRequest = read_json(body, &headers).await?;
            create_tunnel_key(ctx, &caller, request)
        }
        (Route::TunnelKey(id), &Method::GET) => {
            query.only(&[])?;
            let key = tunnel_key_of(ctx, &caller, id)?;
            Ok(json_response(StatusCode::OK, &with_connections(ctx, key)))
        }
        (Route::TunnelKey(id), &Method::DELETE) => {
            query.only(&[])?;
            tunnel_key_of(ctx, &caller, id)?;
            let key = ctx.store.revoke_tunnel_key(id)?;
            tracing::info!(key = %key.id, by = %caller.id, "tunnel key revoked");
            ctx.hooks.state_changed();
            Ok(json_response(StatusCode::OK, &with_connections(ctx, key)))
        }
        (Route::ApiKeys, &Method::GET) => {
            query.only(&[])?;
            Ok(json_response(StatusCode::OK, &List { items: ctx.store.api_keys()? }))
        }
        (Route::ApiKeys, &Method::POST) => {
            query.only(&[])?;
            let request: CreateApiKeyRequest = read_json(body, &headers).await?;
            let name = request.name.trim();
            if name.is_empty() || name.chars().count() > MAX_KEY_NAME || name.chars().any(char::is_control) {
                return Err(ApiError::invalid(
                    "invalid_name",
                    format!(
                        "an API key name is 1-{MAX_KEY_NAME} printable characters, e.g. \"operator cluster-a\""
                    ),
                ));
            }
            let (key, secret) = ctx.store.create_api_key(name, request.scope)?;
            tracing::info!(key = %key.id, scope = %key.scope, by = %caller.id, "api key created");
            Ok(json_response(StatusCode::CREATED, &CreatedApiKey { key, secret }))
        }
        (Route::ApiKey(id), &Method::GET) => {
            query.only(&[])?;
            let key = ctx
                .store
                .api_key(id)?
                .ok_or_else(|| ApiError::NotFound { message: format!("api key {id} does not exist") })?;
            Ok(json_response(StatusCode::OK, &key))
        }
        (Route::ApiKey(id), &Method::DELETE) => {
            query.only(&[])?;
            let key = ctx.store.revoke_api_key(id)?;
            tracing::info!(key = %key.id, by = %caller.id, "api key revoked");
            ctx.hooks.state_changed();
            Ok(json_response(StatusCode::OK, &key))
        }
        _ => Err(not_allowed()),
    }
}

fn authenticate(store: &Store, headers: &HeaderMap) -> Result<ApiKey, ApiError> {
    let missing = || {
        ApiError::Unauthenticated {
        code: "missing_key",
        message: "send an API key as `Authorization: Bearer <key>` (the first admin key is in the edge's data directory, admin.key)".into(),
    }
    };
    let value = headers.get(header::AUTHORIZATION).ok_or_else(missing)?;
    let value = value.to_str().map_err(|_| missing())?.trim();
    let (scheme, secret) = value.split_once(' ').ok_or_else(missing)?;
    if !scheme.eq_ignore_ascii_case("bearer") || secret.trim().is_empty() {
        return Err(missing());
    }
    match store.authenticate_api_key(secret.trim())? {
        ApiKeyAuth::Valid(key) => Ok(key),
        ApiKeyAuth::TunnelKey => Err(ApiError::Forbidden {
            code: "tunnel_key_not_allowed",
            message: "tunnel keys cannot use the API; use an admin or endpoints API key".into(),
        }),
        ApiKeyAuth::Unknown => Err(ApiError::Unauthenticated {
            code: "unknown_key",
            message: "this API key is not known to the edge; check --key (or CULVERT_ADMIN_KEY)".into(),
        }),
        ApiKeyAuth::Revoked(key) => Err(ApiError::Unauthenticated {
            code: "key_revoked",
            message: format!(
                "API key {} was revoked at {}; ask the edge's admin for a new key",
                key.id,
                key.revoked_at.as_deref().unwrap_or("an earlier time")
            ),
        }),
    }
}

/// An admin may use anything; an endpoints key only what it holds.
fn may_use(caller: &ApiKey, owner: &str) -> bool {
    caller.scope == ApiKeyScope::Admin || caller.id == owner
}

fn not_owner(what: &str) -> ApiError {
    ApiError::Forbidden {
        code: "not_owner",
        message: format!(
            "{what} is held by another key; an endpoints key can only use what it reserved itself"
        ),
    }
}

fn info(ctx: &ApiContext, caller: ApiKey) -> Info {
    Info {
        domain: edge_domain(ctx),
        version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: PROTOCOL_VERSION,
        min_protocol_version: MIN_PROTOCOL_VERSION,
        tcp_ports: ctx.tcp_ports,
        public_host: ctx.public_host.clone(),
        public_https_port: ctx.public_https_port,
        caller,
    }
}

fn with_url(ctx: &ApiContext, mut r: Reservation) -> Reservation {
    r.url = Some(r.public_url(ctx.public_https_port, &ctx.public_host));
    if ctx.acme
        && r.kind == ReservationKind::Custom
        && let Some(host) = &r.hostname
    {
        let record = match ctx.store.certificate(host) {
            Ok(record) => record,
            Err(e) => {
                tracing::warn!(error = %e, host = %host, "failed to read the certificate state");
                None
            }
        };
        // Not scanned yet: about to be ordered.
        let record = record.unwrap_or_else(|| CertificateRecord::pending(host));
        r.certificate = Some(Box::new(record.state(unix_now())));
    }
    r
}

fn with_connections(ctx: &ApiContext, mut k: TunnelKey) -> TunnelKey {
    k.connections = if k.revoked_at.is_some() { 0 } else { ctx.hooks.connections_for_key(&k.id) };
    k
}

fn visible_reservations(
    ctx: &ApiContext,
    caller: &ApiKey,
    selector: &Selector,
    ports: bool,
) -> Result<Vec<Reservation>, ApiError> {
    Ok(ctx
        .store
        .reservations()?
        .into_iter()
        .filter(|r| (r.kind == ReservationKind::Tcp) == ports)
        .filter(|r| may_use(caller, &r.owner) && selector.matches(&r.labels))
        .map(|r| with_url(ctx, r))
        .collect())
}

fn reserve_domain(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: ReserveDomainRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    validate_labels(&request.labels).map_err(|m| ApiError::invalid("invalid_labels", m))?;
    let domain = edge_domain(ctx);
    let (kind, hostname) = match (request.name.as_deref(), request.fqdn.as_deref()) {
        (Some(name), None) => (ReservationKind::Subdomain, subdomain(name, &domain)?),
        (None, Some(fqdn)) => custom_or_subdomain(fqdn, &domain)?,
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                format!(
                    "give exactly one of name (a label: reserves <name>.{domain}) and fqdn (a custom domain)"
                ),
            ));
        }
    };
    let (reservation, created) = ctx.store.reserve_domain(kind, &hostname, &caller.id, &request.labels)?;
    if created {
        tracing::info!(hostname = %hostname, kind = %kind, by = %caller.id, "domain reserved");
        ctx.hooks.state_changed();
    }
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(json_response(status, &with_url(ctx, reservation)))
}

fn reserve_port(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: ReservePortRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    validate_labels(&request.labels).map_err(|m| ApiError::invalid("invalid_labels", m))?;
    if request.port == Some(0) {
        return Err(ApiError::invalid(
            "port_out_of_range",
            format!(
                "port 0 is not a port; pick one in the edge's TCP port range {}, or omit the port to get a free one",
                ctx.tcp_ports
            ),
        ));
    }
    let (reservation, created) =
        ctx.store.reserve_usable_port(request.port, ctx.tcp_ports, &caller.id, &request.labels, |p| {
            ctx.hooks.port_usable(p)
        })?;
    if created {
        tracing::info!(port = ?reservation.port, by = %caller.id, "port reserved");
        ctx.hooks.state_changed();
    }
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(json_response(status, &with_url(ctx, reservation)))
}

fn release(
    ctx: &ApiContext,
    caller: &ApiKey,
    reservation: Reservation,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let (reservation, revoked_tunnel_keys) = ctx.store.release_reservation(&reservation.id)?;
    tracing::info!(
        reservation = %reservation.target(),
        revoked_keys = revoked_tunnel_keys.len(),
        by = %caller.id,
        "reservation released"
    );
    ctx.hooks.state_changed();
    let reservation = with_url(ctx, reservation);
    Ok(json_response(StatusCode::OK, &ReleaseResponse { reservation, revoked_tunnel_keys }))
}

fn domain_of(ctx: &ApiContext, caller: &ApiKey, host: &str) -> Result<Reservation, ApiError> {
    let hostname = lookup_hostname(host, &edge_domain(ctx))?;
    let reservation = ctx
        .store
        .reservation_by_hostname(&hostname)?
        .ok_or_else(|| ApiError::NotFound { message: format!("domain {hostname} is not reserved") })?;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&format!("domain {hostname}")));
    }
    Ok(reservation)
}

fn port_of(ctx: &ApiContext, caller: &ApiKey, port: &str) -> Result<Reservation, ApiError> {
    let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| ApiError::BadRequest {
        code: "invalid_port",
        message: format!("`{port}` is not a port number (1-65535)"),
    })?;
    let reservation = ctx
        .store
        .reservation_by_port(port)?
        .ok_or_else(|| ApiError::NotFound { message: format!("port {port} is not reserved") })?;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&format!("port {port}")));
    }
    Ok(reservation)
}

fn tunnel_key_of(ctx: &ApiContext, caller: &ApiKey, id: &str) -> Result<TunnelKey, ApiError> {
    let key = ctx
        .store
        .tunnel_key(id)?
        .ok_or_else(|| ApiError::NotFound { message: format!("tunnel key {id} does not exist") })?;
    if !may_use(caller, &key.owner) {
        return Err(not_owner(&format!("tunnel key {id}")));
    }
    Ok(key)
}

fn create_tunnel_key(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: CreateTunnelKeyRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    validate_labels(&request.labels).map_err(|m| ApiError::invalid("invalid_labels", m))?;
    let domain = edge_domain(ctx);
    let reservation = match (request.domain.as_deref(), request.port) {
        (Some(host), None) => {
            let protocol = request.protocol.unwrap_or(Protocol::Http);
            if protocol == Protocol::Tcp {
                return Err(ApiError::invalid(
                    "protocol_mismatch",
                    "tcp tunnels need a port reservation: give port instead of domain (for TLS passthrough on a host name, use protocol tls)",
                ));
            }
            let hostname = lookup_hostname(host, &domain)?;
            let reservation =
                ctx.store.reservation_by_hostname(&hostname)?.ok_or_else(|| ApiError::NotFound {
                    message: format!(
                        "domain {hostname} is not reserved; reserve it first (culvert admin domain reserve)"
                    ),
                })?;
            (reservation, protocol)
        }
        (None, Some(port)) => {
            let protocol = request.protocol.unwrap_or(Protocol::Tcp);
            if protocol != Protocol::Tcp {
                return Err(ApiError::invalid(
                    "protocol_mismatch",
                    format!("{protocol} tunnels need a domain reservation: give domain instead of port"),
                ));
            }
            let reservation = ctx.store.reservation_by_port(port)?.ok_or_else(|| ApiError::NotFound {
                message: format!(
                    "port {port} is not reserved; reserve it first (culvert admin port reserve {port})"
                ),
            })?;
            (reservation, protocol)
        }
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give exactly one of domain (for http and tls tunnels) and port (for tcp tunnels)",
            ));
        }
    };
    let (reservation, protocol) = reservation;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&reservation.target()));
    }
    let (key, secret) =
        ctx.store.create_tunnel_key(&reservation.id, protocol, &request.labels, &caller.id)?;
    tracing::info!(key = %key.id, reservation = %reservation.target(), %protocol, by = %caller.id, "tunnel key created");
    ctx.hooks.state_changed();
    let url = reservation.public_url(ctx.public_https_port, &ctx.public_host);
    Ok(json_response(StatusCode::CREATED, &CreatedTunnelKey { key, secret, url }))
}

/// The edge's base domain, lower case without a trailing dot.
fn edge_domain(ctx: &ApiContext) -> String {
    ctx.domain.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// Whether `s` is a DNS label: 1-63 of `a-z 0-9 -`, not starting or ending with `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `<name>.<domain>` for a subdomain label (upper case is folded to lower case).
pub fn subdomain(name: &str, domain: &str) -> Result<String, ApiError> {
    let label = name.trim().to_ascii_lowercase();
    if label.contains('.') {
        return Err(ApiError::invalid(
            "invalid_name",
            format!(
                "`{name}` is not a DNS label; give only the first label (it becomes <name>.{domain}), or reserve a full host name as fqdn (culvert admin domain reserve --fqdn HOST)"
            ),
        ));
    }
    if !is_dns_label(&label) {
        return Err(ApiError::invalid(
            "invalid_name",
            format!(
                "`{name}` is not a DNS label: use 1-63 characters of a-z, 0-9 and `-`, not starting or ending with `-`"
            ),
        ));
    }
    let hostname = format!("{label}.{domain}");
    if hostname.len() > 253 {
        return Err(ApiError::invalid(
            "invalid_name",
            format!("{hostname} is longer than 253 characters; use a shorter name"),
        ));
    }
    Ok(hostname)
}

/// Validates a full host name: lower-cased, trailing dot dropped, at most 253
/// characters, two or more DNS labels, not an IP address.
pub fn normalize_hostname(host: &str) -> Result<String, ApiError> {
    let h = host.trim().to_ascii_lowercase();
    let h = h.strip_suffix('.').unwrap_or(&h).to_string();
    let bad = |why: &str| {
        ApiError::invalid("invalid_domain", format!("`{host}` is not a valid domain name: {why}"))
    };
    if h.parse::<std::net::IpAddr>().is_ok() {
        return Err(bad("IP addresses cannot be reserved, only names"));
    }
    if h.len() > 253 {
        return Err(bad("it is longer than 253 characters"));
    }
    let labels: Vec<&str> = h.split('.').collect();
    if labels.len() < 2 {
        return Err(bad("it needs at least two labels, like app.example.com"));
    }
    if let Some(label) = labels.iter().find(|l| !is_dns_label(l)) {
        return Err(bad(&format!(
            "label `{label}` is not a DNS label (1-63 characters of a-z, 0-9 and `-`, not starting or ending with `-`)"
        )));
    }
    if labels.last().is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit())) {
        return Err(bad("the last label cannot be all digits"));
    }
    Ok(h)
}

/// Classifies an `fqdn`: a name one label under the edge's domain is a
/// subdomain (normalised); deeper names under it are refused (the wildcard
/// certificate covers one level); the edge's own name is refused; anything
/// else is a custom domain.
pub fn custom_or_subdomain(fqdn: &str, domain: &str) -> Result<(ReservationKind, String), ApiError> {
    let host = normalize_hostname(fqdn)?;
    if host == domain {
        return Err(ApiError::invalid(
            "reserved_name",
            format!(
                "{domain} is the edge's own name and cannot be reserved; reserve <name>.{domain} instead"
            ),
        ));
    }
    match host.strip_suffix(domain).and_then(|p| p.strip_suffix('.')) {
        Some(label) if !label.contains('.') => Ok((ReservationKind::Subdomain, host)),
        Some(_) => Err(ApiError::invalid(
            "invalid_domain",
            format!(
                "{host} is more than one level under the edge's domain {domain}; the edge serves <name>.{domain} only: reserve a single label, or a domain outside {domain}"
            ),
        )),
        None => Ok((ReservationKind::Custom, host)),
    }
}

/// The host name a path segment or `domain` field means: a bare label is
/// `<label>.<domain>`, anything with a dot is a full host name.
fn lookup_hostname(host: &str, domain: &str) -> Result<String, ApiError> {
    if host.contains('.') { normalize_hostname(host) } else { subdomain(host, domain) }
}

/// Reads a JSON body of at most [`API_MAX_BODY`] bytes within
/// [`API_BODY_TIMEOUT`]; an empty body reads as `{}`.
async fn read_json<T: DeserializeOwned, B>(body: B, headers: &HeaderMap) -> Result<T, ApiError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > API_MAX_BODY as u64) {
        return Err(ApiError::TooLarge);
    }
    let collect = async {
        let mut body = std::pin::pin!(body);
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BadRequest {
                code: "body_error",
                message: format!("failed to read the request body: {e}"),
            })?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > API_MAX_BODY {
                    return Err(ApiError::TooLarge);
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(buf.freeze())
    };
    let bytes =
        tokio::time::timeout(API_BODY_TIMEOUT, collect).await.map_err(|_| ApiError::BodyTimeout)??;
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
    serde_json::from_slice(bytes).map_err(|e| ApiError::BadRequest {
        code: "invalid_json",
        message: format!("the request body is not valid for this call: {e}"),
    })
}

fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<Full<Bytes>> {
    let (status, mut body) = match serde_json::to_vec(value) {
        Ok(body) => (status, body),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(r#"{{"error":{{"code":"internal","message":"failed to encode the answer: {e}"}}}}"#)
                .into_bytes(),
        ),
    };
    body.push(b'\n');
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Decoded query parameters.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(query: Option<&str>) -> Result<Query, ApiError> {
        let mut pairs = Vec::new();
        for part in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            let decode = |s: &str| {
                percent_decode(&s.replace('+', " ")).ok_or_else(|| ApiError::BadRequest {
                    code: "invalid_query",
                    message: format!("query parameter `{part}` is not valid percent-encoded UTF-8"),
                })
            };
            pairs.push((decode(k)?, decode(v)?));
        }
        Ok(Query(pairs))
    }

    fn only(&self, allowed: &[&str]) -> Result<(), ApiError> {
        match self.0.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
            None => Ok(()),
            Some((k, _)) if allowed.is_empty() => Err(ApiError::BadRequest {
                code: "invalid_query",
                message: format!("unknown query parameter `{k}`; this call takes none"),
            }),
            Some((k, _)) => Err(ApiError::BadRequest {
                code: "invalid_query",
                message: format!("unknown query parameter `{k}`; this call takes {}", allowed.join(", ")),
            }),
        }
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    fn selector(&self) -> Result<Selector, ApiError> {
        Selector::parse(self.get("selector").unwrap_or(""))
            .map_err(|message| ApiError::BadRequest { code: "invalid_selector", message })
    }

    fn flag(&self, key: &str) -> Result<bool, ApiError> {
        match self.get(key) {
            None | Some("false") | Some("0") => Ok(false),
            Some("") | Some("true") | Some("1") => Ok(true),
            Some(other) => Err(ApiError::BadRequest {
                code: "invalid_query",
                message: format!("`{key}={other}`: use {key}=true or {key}=false"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::{Value, json};

    use super::*;

    #[derive(Default)]
    struct FakeHooks {
        changes: AtomicUsize,
        connections: Mutex<HashMap<String, usize>>,
    }

    impl EdgeHooks for FakeHooks {
        fn state_changed(&self) {
            self.changes.fetch_add(1, Ordering::SeqCst);
        }
        fn connections_for_key(&self, key_id: &str) -> usize {
            self.connections.lock().unwrap().get(key_id).copied().unwrap_or(0)
        }
    }

    struct Edge {
        ctx: ApiContext,
        hooks: Arc<FakeHooks>,
        admin: String,
        _dir: tempfile::TempDir,
    }

    fn edge() -> Edge {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let admin = store.ensure_admin_key().unwrap().unwrap();
        let hooks = Arc::new(FakeHooks::default());
        let ctx = ApiContext {
            store,
            domain: "Edge.Example.com.".into(),
            public_host: "edge.example.com".into(),
            public_https_port: 443,
            tcp_ports: PortRange { first: 20000, last: 20002 },
            acme: false,
            hooks: hooks.clone(),
        };
        Edge { ctx, hooks, admin, _dir: dir }
    }

    impl Edge {
        async fn call(
            &self,
            method: &str,
            path: &str,
            key: Option<&str>,
            body: Option<Value>,
        ) -> (StatusCode, Value) {
            let mut req = Request::builder().method(method).uri(format!("{API_PREFIX}{path}"));
            if let Some(key) = key {
                req = req.header("authorization", format!("Bearer {key}"));
            }
            let body = body.map(|b| b.to_string()).unwrap_or_default();
            let response = handle(&self.ctx, req.body(Full::new(Bytes::from(body))).unwrap()).await;
            let status = response.status();
            assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            let value: Value = serde_json::from_slice(&bytes).unwrap();
            if !status.is_success() {
                // Every error has exactly this shape.
                let error = value["error"].as_object().unwrap_or_else(|| panic!("{value}"));
                assert!(error["code"].is_string() && error["message"].is_string(), "{value}");
                assert_eq!(error.len(), 2, "{value}");
                assert_eq!(value.as_object().unwrap().len(), 1, "{value}");
            }
            (status, value)
        }

        async fn endpoints_key(&self, name: &str) -> String {
            let (status, v) = self
                .call(
                    "POST",
                    "api-keys",
                    Some(&self.admin),
                    Some(json!({"name": name, "scope": "endpoints"})),
                )
                .await;
            assert_eq!(status, StatusCode::CREATED, "{v}");
            v["secret"].as_str().unwrap().to_string()
        }
    }

    fn code(v: &Value) -> &str {
        v["error"]["code"].as_str().unwrap_or("")
    }

    #[test]
    fn handler_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let e = edge();
        let fut = handle(&e.ctx, Request::new(Full::new(Bytes::new())));
        assert_send(&fut);
    }

    #[tokio::test]
    async fn info_and_auth_errors() {
        let e = edge();
        let (status, v) = e.call("GET", "info", Some(&e.admin), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["domain"], "edge.example.com");
        assert_eq!(v["tcpPorts"], "20000-20002");
        assert_eq!(v["protocolVersion"], PROTOCOL_VERSION);
        assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(v["publicHost"], "edge.example.com");
        assert_eq!(v["caller"]["scope"], "admin");

        let (status, v) = e.call("GET", "info", None, None).await;
        assert_eq!((status, code(&v)), (StatusCode::UNAUTHORIZED, "missing_key"));
        let (status, v) = e.call("GET", "info", Some("culvert_a_0000"), None).await;
        assert_eq!((status, code(&v)), (StatusCode::UNAUTHORIZED, "unknown_key"));
        let (status, v) = e.call("GET", "nope", Some(&e.admin), None).await;
        assert_eq!((status, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
        let (status, v) = e.call("PUT", "domains", Some(&e.admin), None).await;
        assert_eq!((status, code(&v)), (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"));
        let (status, v) = e.call("GET", "info?x=1", Some(&e.admin), None).await;
        assert_eq!((status, code(&v)), (StatusCode::BAD_REQUEST, "invalid_query"));
    }

    #[tokio::test]
    async fn tunnel_keys_cannot_use_the_api() {
        let e = edge();
        e.call("POST", "domains", Some(&e.admin), Some(json!({"name": "blog"}))).await;
        let (status, v) =
            e.call("POST", "tunnel-keys", Some(&e.admin), Some(json!({"domain": "blog"}))).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        let tunnel = v["secret"].as_str().unwrap().to_string();
        assert!(tunnel.starts_with("culvert_t_"));
        for (method, path) in [("GET", "info"), ("GET", "domains"), ("POST", "api-keys")] {
            let (status, v) = e.call(method, path, Some(&tunnel), None).await;
            assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "tunnel_key_not_allowed"), "{path}");
            assert_eq!(
                v["error"]["message"],
                "tunnel keys cannot use the API; use an admin or endpoints API key"
            );
        }
    }

    #[tokio::test]
    async fn endpoints_keys_cannot_manage_api_keys() {
        let e = edge();
        let ep = e.endpoints_key("operator").await;
        assert!(ep.starts_with("culvert_e_"));
        for (method, path, body) in [
            ("GET", "api-keys", None),
            ("POST", "api-keys", Some(json!({"name": "x", "scope": "admin"}))),
            ("DELETE", "api-keys/ak_000000000000", None),
        ] {
            let (status, v) = e.call(method, path, Some(&ep), body).await;
            assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "admin_required"), "{method} {path}");
        }
        // But it may reserve, mint and read info.
        let (status, _) = e.call("GET", "info", Some(&ep), None).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = e.call("POST", "ports", Some(&ep), None).await;
        assert_eq!(status, StatusCode::CREATED);
    }

    #[tokio::test]
    async fn domain_reservations() {
        let e = edge();
        let ep = e.endpoints_key("a").await;
        let other = e.endpoints_key("b").await;
        let (status, v) = e
            .call("POST", "domains", Some(&ep), Some(json!({"name": "Blog", "labels": {"ns": "web"}})))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!(v["hostname"], "blog.edge.example.com");
        assert_eq!(v["kind"], "subdomain");
        assert_eq!(v["url"], "https://blog.edge.example.com");
        assert_eq!(v["labels"], json!({"ns": "web"}));
        assert_eq!(e.hooks.changes.load(Ordering::SeqCst), 1);

        // Idempotent for the same key, also when given as fqdn.
        let (status, again) =
            e.call("POST", "domains", Some(&ep), Some(json!({"fqdn": "blog.edge.example.com."}))).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(again, v);
        let (status, err) = e.call("POST", "domains", Some(&other), Some(json!({"name": "blog"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::CONFLICT, "already_reserved"));
        assert_eq!(
            err["error"]["message"],
            "domain blog.edge.example.com is held by another key; reserve another name"
        );

        // Custom domains.
        let (status, c) =
            e.call("POST", "domains", Some(&ep), Some(json!({"fqdn": "App.Example.org"}))).await;
        assert_eq!(status, StatusCode::CREATED, "{c}");
        assert_eq!((c["kind"].as_str(), c["hostname"].as_str()), (Some("custom"), Some("app.example.org")));

        // Lists show only what the caller holds (admin sees all).
        let (_, list) = e.call("GET", "domains", Some(&ep), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 2);
        let (_, list) = e.call("GET", "domains?selector=ns%3Dweb", Some(&ep), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 1);
        let (_, list) = e.call("GET", "domains", Some(&other), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 0);
        let (_, list) = e.call("GET", "domains", Some(&e.admin), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 2);

        let (status, got) = e.call("GET", "domains/blog", Some(&ep), None).await;
        assert_eq!((status, &got), (StatusCode::OK, &v));
        let (status, err) = e.call("DELETE", "domains/blog.edge.example.com", Some(&other), None).await;
        assert_eq!((status, code(&err)), (StatusCode::FORBIDDEN, "not_owner"));
        let (status, released) = e.call("DELETE", "domains/blog.edge.example.com", Some(&ep), None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(released["reservation"]["hostname"], "blog.edge.example.com");
        let (status, err) = e.call("DELETE", "domains/blog", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::NOT_FOUND, "not_found"));
    }

    #[tokio::test]
    async fn domain_validation() {
        let e = edge();
        let k = Some(e.admin.as_str());
        for (body, want) in [
            (json!({"name": "-bad"}), "invalid_name"),
            (json!({"name": "bad_label"}), "invalid_name"),
            (json!({"name": "a.b"}), "invalid_name"),
            (json!({"name": ""}), "invalid_name"),
            (json!({"name": "x".repeat(64)}), "invalid_name"),
            (json!({"fqdn": "localhost"}), "invalid_domain"),
            (json!({"fqdn": "10.0.0.1"}), "invalid_domain"),
            (json!({"fqdn": "a..example.com"}), "invalid_domain"),
            (json!({"fqdn": "*.example.com"}), "invalid_domain"),
            (json!({"fqdn": "a.b.edge.example.com"}), "invalid_domain"),
            (json!({"fqdn": "edge.example.com"}), "reserved_name"),
            (json!({"name": "a", "fqdn": "a.example.org"}), "invalid_request"),
            (json!({}), "invalid_request"),
            (json!({"name": "ok", "labels": {"bad key": "v"}}), "invalid_labels"),
        ] {
            let (status, v) = e.call("POST", "domains", k, Some(body.clone())).await;
            assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, want), "{body}: {v}");
        }
        let (status, v) = e.call("POST", "domains", k, Some(json!({"nmae": "x"}))).await;
        assert_eq!((status, code(&v)), (StatusCode::BAD_REQUEST, "invalid_json"));
        assert!(v["error"]["message"].as_str().unwrap().contains("unknown field `nmae`"), "{v}");
        let (status, v) = e.call("POST", "domains", k, Some(json!("x".repeat(70_000)))).await;
        assert_eq!((status, code(&v)), (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"));
        assert_eq!(e.hooks.changes.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn port_reservations() {
        let e = edge();
        let ep = e.endpoints_key("a").await;
        let other = e.endpoints_key("b").await;
        let (status, v) = e.call("POST", "ports", Some(&ep), Some(json!({"port": 20001}))).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!(v["url"], "tcp://edge.example.com:20001");
        let (status, _) = e.call("POST", "ports", Some(&ep), Some(json!({"port": 20001}))).await;
        assert_eq!(status, StatusCode::OK);
        let (status, err) = e.call("POST", "ports", Some(&other), Some(json!({"port": 20001}))).await;
        assert_eq!((status, code(&err)), (StatusCode::CONFLICT, "already_reserved"));
        for port in [json!(80), json!(0), json!(20003)] {
            let (status, err) = e.call("POST", "ports", Some(&ep), Some(json!({"port": port}))).await;
            assert_eq!(
                (status, code(&err)),
                (StatusCode::UNPROCESSABLE_ENTITY, "port_out_of_range"),
                "{port}"
            );
            assert!(err["error"]["message"].as_str().unwrap().contains("20000-20002"), "{err}");
        }
        let (status, err) = e.call("POST", "ports", Some(&ep), Some(json!({"port": 70000}))).await;
        assert_eq!((status, code(&err)), (StatusCode::BAD_REQUEST, "invalid_json"));
        let (_, a) = e.call("POST", "ports", Some(&other), None).await;
        let (_, b) = e.call("POST", "ports", Some(&other), Some(json!({}))).await;
        assert_eq!((a["port"].as_u64(), b["port"].as_u64()), (Some(20000), Some(20002)));
        let (status, err) = e.call("POST", "ports", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::CONFLICT, "no_free_port"));
        let (_, list) = e.call("GET", "ports", Some(&other), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 2);
        let (status, err) = e.call("GET", "ports/abc", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::BAD_REQUEST, "invalid_port"));
        let (status, err) = e.call("DELETE", "ports/20000", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::FORBIDDEN, "not_owner"));
        let (status, _) = e.call("DELETE", "ports/20000", Some(&e.admin), None).await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn tunnel_key_lifecycle() {
        let e = edge();
        let ep = e.endpoints_key("a").await;
        let other = e.endpoints_key("b").await;
        e.call("POST", "domains", Some(&ep), Some(json!({"name": "blog"}))).await;
        let (_, port) = e.call("POST", "ports", Some(&ep), None).await;
        let port = port["port"].as_u64().unwrap();

        let (status, err) = e.call("POST", "tunnel-keys", Some(&ep), Some(json!({"domain": "nope"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::NOT_FOUND, "not_found"));
        let (status, err) = e
            .call("POST", "tunnel-keys", Some(&ep), Some(json!({"domain": "blog", "protocol": "tcp"})))
            .await;
        assert_eq!((status, code(&err)), (StatusCode::UNPROCESSABLE_ENTITY, "protocol_mismatch"));
        let (status, err) =
            e.call("POST", "tunnel-keys", Some(&ep), Some(json!({"port": port, "protocol": "http"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::UNPROCESSABLE_ENTITY, "protocol_mismatch"));
        let (status, err) = e.call("POST", "tunnel-keys", Some(&ep), Some(json!({"protocol": "http"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request"));
        let (status, err) =
            e.call("POST", "tunnel-keys", Some(&other), Some(json!({"domain": "blog"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::FORBIDDEN, "not_owner"));

        let changes = e.hooks.changes.load(Ordering::SeqCst);
        let (status, http_key) = e
            .call(
                "POST",
                "tunnel-keys",
                Some(&ep),
                Some(json!({"domain": "blog.edge.example.com", "protocol": "http", "labels": {"cluster": "c1", "uid": "u1"}})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{http_key}");
        assert_eq!(http_key["protocol"], "http");
        assert_eq!(http_key["reservation"]["hostname"], "blog.edge.example.com");
        assert_eq!(http_key["url"], "https://blog.edge.example.com");
        assert!(http_key["createdAt"].is_string());
        assert_eq!(e.hooks.changes.load(Ordering::SeqCst), changes + 1);
        let (status, tcp_key) = e
            .call("POST", "tunnel-keys", Some(&ep), Some(json!({"port": port, "labels": {"cluster": "c2"}})))
            .await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(tcp_key["protocol"], "tcp");
        // Admin may mint for any reservation; the key belongs to the reservation's owner.
        let (status, admin_key) = e
            .call("POST", "tunnel-keys", Some(&e.admin), Some(json!({"domain": "blog", "protocol": "tls"})))
            .await;
        assert_eq!(status, StatusCode::CREATED);
        let http_id = http_key["id"].as_str().unwrap().to_string();
        e.hooks.connections.lock().unwrap().insert(http_id.clone(), 2);

        let (_, list) = e.call("GET", "tunnel-keys?selector=cluster=c1", Some(&ep), None).await;
        let items = list["items"].as_array().unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0]["id"], http_id);
        assert_eq!(items[0]["connections"], 2);
        assert!(items[0].get("secret").is_none());
        let (_, list) = e.call("GET", "tunnel-keys", Some(&ep), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 3);
        let (_, list) = e.call("GET", "tunnel-keys", Some(&other), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 0);
        let (status, err) = e.call("GET", "tunnel-keys?selector=a%20b", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::BAD_REQUEST, "invalid_selector"));

        let (status, err) = e.call("DELETE", &format!("tunnel-keys/{http_id}"), Some(&other), None).await;
        assert_eq!((status, code(&err)), (StatusCode::FORBIDDEN, "not_owner"));
        let (status, revoked) = e.call("DELETE", &format!("tunnel-keys/{http_id}"), Some(&ep), None).await;
        assert_eq!(status, StatusCode::OK);
        assert!(revoked["revokedAt"].is_string());
        assert_eq!(revoked["connections"], 0);
        let (_, list) = e.call("GET", "tunnel-keys", Some(&ep), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 2);
        let (_, list) = e.call("GET", "tunnel-keys?revoked=true", Some(&ep), None).await;
        assert_eq!(list["items"].as_array().unwrap().len(), 3);

        // Releasing the domain revokes its remaining key.
        let (_, released) = e.call("DELETE", "domains/blog", Some(&ep), None).await;
        assert_eq!(released["revokedTunnelKeys"], json!([admin_key["id"]]));
        let secret = admin_key["secret"].as_str().unwrap();
        assert!(matches!(
            e.ctx.store.authenticate_tunnel_key(secret).unwrap(),
            crate::edge::store::TunnelKeyAuth::Revoked
        ));
    }

    #[tokio::test]
    async fn api_key_management() {
        let e = edge();
        let (status, v) = e
            .call("POST", "api-keys", Some(&e.admin), Some(json!({"name": "second", "scope": "admin"})))
            .await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(v["secret"].as_str().unwrap().starts_with("culvert_a_"));
        let second = v["id"].as_str().unwrap().to_string();
        let (status, err) = e
            .call("POST", "api-keys", Some(&e.admin), Some(json!({"name": " ", "scope": "endpoints"})))
            .await;
        assert_eq!((status, code(&err)), (StatusCode::UNPROCESSABLE_ENTITY, "invalid_name"));
        let (status, err) =
            e.call("POST", "api-keys", Some(&e.admin), Some(json!({"name": "x", "scope": "tunnel"}))).await;
        assert_eq!((status, code(&err)), (StatusCode::BAD_REQUEST, "invalid_json"));
        let (_, list) = e.call("GET", "api-keys", Some(&e.admin), None).await;
        let first = list["items"][0]["id"].as_str().unwrap().to_string();
        assert!(list["items"].as_array().unwrap().iter().all(|k| k.get("secret").is_none()));

        let (status, _) = e.call("DELETE", &format!("api-keys/{second}"), Some(&e.admin), None).await;
        assert_eq!(status, StatusCode::OK);
        let (status, err) = e.call("DELETE", &format!("api-keys/{first}"), Some(&e.admin), None).await;
        assert_eq!((status, code(&err)), (StatusCode::CONFLICT, "last_admin_key"));
        let (status, err) = e.call("DELETE", "api-keys/ak_nope", Some(&e.admin), None).await;
        assert_eq!((status, code(&err)), (StatusCode::NOT_FOUND, "not_found"));

        // A revoked key is told so.
        let ep = e.endpoints_key("ep").await;
        let (_, info) = e.call("GET", "info", Some(&ep), None).await;
        let ep_id = info["caller"]["id"].as_str().unwrap().to_string();
        e.call("DELETE", &format!("api-keys/{ep_id}"), Some(&e.admin), None).await;
        let (status, err) = e.call("GET", "info", Some(&ep), None).await;
        assert_eq!((status, code(&err)), (StatusCode::UNAUTHORIZED, "key_revoked"));
    }

    #[test]
    fn names() {
        assert!(is_dns_label("a") && is_dns_label("a-1") && is_dns_label(&"a".repeat(63)));
        assert!(!is_dns_label("") && !is_dns_label("-a") && !is_dns_label("a-") && !is_dns_label("A"));
        assert_eq!(
            custom_or_subdomain("x.edge.example.com", "edge.example.com").unwrap(),
            (ReservationKind::Subdomain, "x.edge.example.com".to_string())
        );
        assert_eq!(
            custom_or_subdomain("shop.example.com", "edge.example.com").unwrap(),
            (ReservationKind::Custom, "shop.example.com".to_string())
        );
        // A suffix match on a label boundary only.
        assert_eq!(
            custom_or_subdomain("myedge.example.com", "edge.example.com").unwrap().0,
            ReservationKind::Custom
        );
        assert_eq!(percent_decode("a%3Db%2Cc").as_deref(), Some("a=b,c"));
        assert_eq!(percent_decode("%zz"), None);
    }
}
