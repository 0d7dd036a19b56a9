//! Tunnel keys (`tunnel-keys`): list, mint for a reservation, read, revoke.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::auth::{may_use, not_owner};
use super::names::lookup_hostname;
use super::{ApiContext, ApiError, edge_domain, json_response};
use crate::api::{
    ApiKey, CreateTunnelKeyRequest, CreatedTunnelKey, List, PortProtocol, Protocol, Selector, TunnelKey,
};

fn with_connections(ctx: &ApiContext, mut k: TunnelKey) -> TunnelKey {
    k.connections = if k.revoked_at.is_some() { 0 } else { ctx.hooks.connections_for_key(&k.id) };
    k
}

async fn tunnel_key_of(ctx: &ApiContext, caller: &ApiKey, id: &str) -> Result<TunnelKey, ApiError> {
    let key = ctx
        .store
        .tunnel_key(id)
        .await?
        .ok_or_else(|| ApiError::NotFound { message: format!("tunnel key {id} does not exist") })?;
    if !may_use(caller, &key.owner) {
        return Err(not_owner(&format!("tunnel key {id}")));
    }
    Ok(key)
}

/// `GET tunnel-keys`: the caller's keys (every key for an admin) matching the selector.
pub(super) async fn list(
    ctx: &ApiContext,
    caller: &ApiKey,
    selector: &Selector,
    include_revoked: bool,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let items: Vec<TunnelKey> = ctx
        .store
        .tunnel_keys(include_revoked)
        .await?
        .into_iter()
        .filter(|k| may_use(caller, &k.owner) && selector.matches(&k.labels))
        .map(|k| with_connections(ctx, k))
        .collect();
    Ok(json_response(StatusCode::OK, &List { items }))
}

/// `GET tunnel-keys/{id}`.
pub(super) async fn get(
    ctx: &ApiContext,
    caller: &ApiKey,
    id: &str,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = tunnel_key_of(ctx, caller, id).await?;
    Ok(json_response(StatusCode::OK, &with_connections(ctx, key)))
}

/// `DELETE tunnel-keys/{id}`: the edge closes the key's connections.
pub(super) async fn revoke(
    ctx: &ApiContext,
    caller: &ApiKey,
    id: &str,
) -> Result<Response<Full<Bytes>>, ApiError> {
    tunnel_key_of(ctx, caller, id).await?;
    let key = ctx.store.revoke_tunnel_key(id).await?;
    tracing::info!(key = %key.id, by = %caller.id, "tunnel key revoked");
    ctx.hooks.changed(super::Change::KeyRevoked(key.id.clone())).await;
    Ok(json_response(StatusCode::OK, &with_connections(ctx, key)))
}

/// `POST tunnel-keys`: a key for one of the caller's reservations.
pub(super) async fn create(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: CreateTunnelKeyRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    super::reservations::check_labels(caller, &request.labels)?;
    let domain = edge_domain(ctx);
    let reservation = match (request.domain.as_deref(), request.port) {
        (Some(host), None) => {
            let protocol = request.protocol.unwrap_or(Protocol::Http);
            if matches!(protocol, Protocol::Tcp | Protocol::Udp) {
                return Err(ApiError::invalid(
                    "protocol_mismatch",
                    format!(
                        "{protocol} tunnels need a port reservation: give port instead of domain (for TLS passthrough on a host name, use protocol tls)"
                    ),
                ));
            }
            let hostname = lookup_hostname(host, &domain)?;
            if hostname == crate::api::DEFAULT_HOST && protocol == Protocol::Tls {
                return Err(ApiError::invalid(
                    "protocol_mismatch",
                    "the default host `*` carries HTTP(S) only (TLS passthrough needs a named host): use protocol http",
                ));
            }
            let reservation =
                ctx.store.reservation_by_hostname(&hostname).await?.ok_or_else(|| ApiError::NotFound {
                    message: format!(
                        "domain {hostname} is not reserved; reserve it first (culvert admin domain reserve)"
                    ),
                })?;
            (reservation, protocol)
        }
        (None, Some(port)) => {
            let protocol = request.protocol.unwrap_or(Protocol::Tcp);
            let transport = match protocol {
                Protocol::Tcp => PortProtocol::Tcp,
                Protocol::Udp => PortProtocol::Udp,
                _ => {
                    return Err(ApiError::invalid(
                        "protocol_mismatch",
                        format!("{protocol} tunnels need a domain reservation: give domain instead of port"),
                    ));
                }
            };
            let reservation =
                ctx.store.reservation_by_port_of(port, transport).await?.ok_or_else(|| ApiError::NotFound {
                    message: match transport {
                        PortProtocol::Tcp => format!(
                            "port {port} is not reserved; reserve it first (culvert admin port reserve {port})"
                        ),
                        PortProtocol::Udp => format!(
                            "UDP port {port} is not reserved; reserve it first (culvert admin port reserve --protocol udp {port})"
                        ),
                    },
                })?;
            (reservation, protocol)
        }
        _ => {
            return Err(ApiError::invalid(
                "invalid_request",
                "give exactly one of domain (for http and tls tunnels) and port (for tcp and udp tunnels)",
            ));
        }
    };
    let (reservation, protocol) = reservation;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&reservation.target()));
    }
    let (key, secret) =
        ctx.store.create_tunnel_key(&reservation.id, protocol, &request.labels, &caller.id).await?;
    // A new key changes no route: the edge looks keys up as agents connect.
    tracing::info!(key = %key.id, reservation = %reservation.target(), %protocol, by = %caller.id, "tunnel key created");
    let url = reservation.public_url(ctx.public_https_port, &ctx.public_host);
    Ok(json_response(StatusCode::CREATED, &CreatedTunnelKey { key, secret, url }))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};

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
        assert_eq!(e.hooks.changes.load(Ordering::SeqCst), changes, "a new key changes no route");
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
            e.ctx.store.engine().authenticate_tunnel_key(secret).unwrap(),
            crate::edge::store::TunnelKeyAuth::Revoked
        ));
    }
}
