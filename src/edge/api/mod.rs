//! Control API under `/_culvert/v1/api/`: JSON in camelCase, bearer API keys.
//!
//! | method | path | who |
//! |---|---|---|
//! | GET | `info` | any API key |
//! | GET | `status` (`?limit=N`) | admin |
//! | GET, POST | `domains` | admin, endpoints |
//! | GET, DELETE | `domains/{hostname or label}` | admin, endpoints (own) |
//! | GET, POST | `ports` (GET: `?protocol=tcp\|udp`, default both) | admin, endpoints |
//! | GET, DELETE | `ports/{port}` (`?protocol=udp` for a UDP port) | admin, endpoints (own) |
//! | GET, POST | `tunnel-keys` | admin, endpoints |
//! | GET, DELETE | `tunnel-keys/{id}` | admin, endpoints (own) |
//! | GET, POST | `api-keys` | admin |
//! | GET, PATCH, DELETE | `api-keys/{id}` | admin |
//!
//! An endpoints key sees and changes only what it holds (reservations it made
//! and the tunnel keys of those); an admin key sees and changes everything.
//! Tunnel keys get 403 `tunnel_key_not_allowed`. Every error is
//! `{"error": {"code": "...", "message": "..."}}` with a message that says
//! what to do.
//!
//! The router (this module) parses the path, the query and the JSON body and
//! calls one handler per resource: [`info`], [`status`], [`reservations`]
//! (domains and ports), [`tunnel_keys`], [`api_keys`]. [`auth`] finds the caller's key and
//! its scope, [`names`] checks host names, [`error`] maps failures to
//! responses.

mod api_keys;
mod auth;
mod error;
mod info;
pub(crate) mod names;
mod reservations;
mod status;
#[cfg(test)]
mod test_support;
mod tunnel_keys;

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::store::Store;
use crate::api::{PortRange, Selector};
use crate::constants::{API_BODY_TIMEOUT, API_MAX_BODY, API_PREFIX};
use crate::http::percent_decode;
pub use error::ApiError;
pub use reservations::RESERVED_NAMES;

/// What one control API call changed at the edge (already stored).
#[derive(Debug, Clone)]
pub enum Change {
    /// A new reservation.
    Reserved(crate::api::Reservation),
    /// A released reservation, and the tunnel keys revoked with it.
    Released { reservation: crate::api::Reservation, revoked_keys: Vec<String> },
    /// A revoked tunnel key.
    KeyRevoked(String),
}

/// What the control API needs from the running edge.
pub trait EdgeHooks: Send + Sync + 'static {
    /// Keys were revoked (or anything else changed): the edge reloads its
    /// routes and TCP listeners from the store and closes connections of
    /// keys that are no longer valid. Done when the edge has reloaded (its
    /// reads run off the request threads).
    fn state_changed(&self) -> futures_util::future::BoxFuture<'_, ()>;
    /// One reservation or tunnel key changed: the edge changes that route
    /// entry (and listener, and connections) alone, without reading the
    /// store. Without an edge of its own, as [`state_changed`](Self::state_changed).
    fn changed(&self, change: Change) -> futures_util::future::BoxFuture<'_, ()> {
        let _ = change;
        self.state_changed()
    }
    /// Agents connected now with this tunnel key.
    fn connections_for_key(&self, key_id: &str) -> usize;
    /// The status document listing at most `limit` tunnels (`None`: the edge is gone).
    /// Made off the request threads: the snapshot reads the store.
    fn status(
        &self,
        _limit: usize,
    ) -> futures_util::future::BoxFuture<'_, Option<crate::edge::status::model::Status>> {
        Box::pin(std::future::ready(None))
    }
    /// Can the edge listen on this TCP (or UDP) port (no other program holds it)?
    fn port_usable(&self, _port: u16, _protocol: crate::api::PortProtocol) -> bool {
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
    /// Names under the edge's domain only an admin key may reserve (`--reserved-names`).
    pub reserved_names: Vec<String>,
    /// Held from a reserve's or release's store write until the edge has
    /// applied it, so the edge applies this edge's changes in the order they
    /// were stored.
    pub serial: Arc<tokio::sync::Mutex<()>>,
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
    Status,
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
            ["status"] => Route::Status,
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
            Route::Info | Route::Status => "GET",
            Route::Domains | Route::Ports | Route::TunnelKeys | Route::ApiKeys => "GET, POST",
            Route::Domain(_) | Route::Port(_) | Route::TunnelKey(_) => "GET, DELETE",
            Route::ApiKey(_) => "GET, PATCH, DELETE",
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
    let caller = auth::authenticate(&ctx.store, req.headers()).await?;
    let route = Route::parse(&path).ok_or_else(|| ApiError::NotFound {
        message: format!(
            "no API route {path}; routes are info, status, domains, ports, tunnel-keys and api-keys under {API_PREFIX}"
        ),
    })?;
    let method = req.method().clone();
    let not_allowed = || ApiError::MethodNotAllowed {
        method: method.clone(),
        path: path.clone(),
        allowed: route.allowed(),
    };
    if matches!(route, Route::ApiKeys | Route::ApiKey(_)) {
        auth::require_admin(&caller)?;
    }
    let headers = req.headers().clone();
    let body = req.into_body();
    match (&route, &method) {
        (Route::Info, &Method::GET) => {
            query.only(&[])?;
            Ok(json_response(StatusCode::OK, &info::info(ctx, caller)))
        }
        (Route::Status, &Method::GET) => {
            query.only(&["limit"])?;
            status::get(ctx, &caller, query.get("limit")).await
        }
        (Route::Domains, &Method::GET) => {
            query.only(&["selector"])?;
            reservations::list(ctx, &caller, &query.selector()?, false).await
        }
        (Route::Domains, &Method::POST) => {
            query.only(&[])?;
            reservations::reserve_domain(ctx, &caller, read_json(body, &headers).await?).await
        }
        (Route::Domain(host), &Method::GET) => {
            query.only(&[])?;
            let reservation = reservations::domain_of(ctx, &caller, host).await?;
            Ok(reservations::get(ctx, reservation).await)
        }
        (Route::Domain(host), &Method::DELETE) => {
            query.only(&[])?;
            let reservation = reservations::domain_of(ctx, &caller, host).await?;
            reservations::release(ctx, &caller, reservation).await
        }
        (Route::Ports, &Method::GET) => {
            query.only(&["selector", "protocol"])?;
            let only = query.get("protocol").map(reservations::port_protocol).transpose()?;
            reservations::list_ports(ctx, &caller, &query.selector()?, only).await
        }
        (Route::Ports, &Method::POST) => {
            query.only(&[])?;
            reservations::reserve_port(ctx, &caller, read_json(body, &headers).await?).await
        }
        (Route::Port(port), &Method::GET) => {
            query.only(&["protocol"])?;
            let protocol = query.get("protocol").map(reservations::port_protocol).transpose()?;
            let reservation = reservations::port_of(ctx, &caller, port, protocol.unwrap_or_default()).await?;
            Ok(reservations::get(ctx, reservation).await)
        }
        (Route::Port(port), &Method::DELETE) => {
            query.only(&["protocol"])?;
            let protocol = query.get("protocol").map(reservations::port_protocol).transpose()?;
            let reservation = reservations::port_of(ctx, &caller, port, protocol.unwrap_or_default()).await?;
            reservations::release(ctx, &caller, reservation).await
        }
        (Route::TunnelKeys, &Method::GET) => {
            query.only(&["selector", "revoked"])?;
            let selector = query.selector()?;
            let include_revoked = query.flag("revoked")?;
            tunnel_keys::list(ctx, &caller, &selector, include_revoked).await
        }
        (Route::TunnelKeys, &Method::POST) => {
            query.only(&[])?;
            tunnel_keys::create(ctx, &caller, read_json(body, &headers).await?).await
        }
        (Route::TunnelKey(id), &Method::GET) => {
            query.only(&[])?;
            tunnel_keys::get(ctx, &caller, id).await
        }
        (Route::TunnelKey(id), &Method::DELETE) => {
            query.only(&[])?;
            tunnel_keys::revoke(ctx, &caller, id).await
        }
        (Route::ApiKeys, &Method::GET) => {
            query.only(&[])?;
            api_keys::list(ctx).await
        }
        (Route::ApiKeys, &Method::POST) => {
            query.only(&[])?;
            api_keys::create(ctx, &caller, read_json(body, &headers).await?).await
        }
        (Route::ApiKey(id), &Method::GET) => {
            query.only(&[])?;
            api_keys::get(ctx, id).await
        }
        (Route::ApiKey(id), &Method::PATCH) => {
            query.only(&[])?;
            api_keys::update(ctx, &caller, id, read_json(body, &headers).await?).await
        }
        (Route::ApiKey(id), &Method::DELETE) => {
            query.only(&[])?;
            api_keys::revoke(ctx, &caller, id).await
        }
        _ => Err(not_allowed()),
    }
}

/// The edge's base domain, lower case without a trailing dot.
pub(super) fn edge_domain(ctx: &ApiContext) -> String {
    ctx.domain.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// Reads a JSON body of at most [`API_MAX_BODY`] bytes within
/// [`API_BODY_TIMEOUT`]; an empty body reads as `{}`.
pub(super) async fn read_json<T: DeserializeOwned, B>(body: B, headers: &HeaderMap) -> Result<T, ApiError>
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

pub(super) fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<Full<Bytes>> {
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
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper::Request;

    use super::handle;
    use super::test_support::edge;

    #[test]
    fn handler_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let e = edge();
        let fut = handle(&e.ctx, Request::new(Full::new(Bytes::new())));
        assert_send(&fut);
    }
}
