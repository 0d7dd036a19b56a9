//! Domain (`domains`) and port (`ports`) reservations: list, reserve, read,
//! release.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::auth::{may_use, not_owner};
use super::names::{custom_or_subdomain, lookup_hostname, subdomain};
use super::{ApiContext, ApiError, edge_domain, json_response};
use crate::api::{
    ApiKey, List, ReleaseResponse, Reservation, ReservationKind, ReserveDomainRequest, ReservePortRequest,
    Selector, validate_labels,
};
use crate::edge::store::{CertificateRecord, unix_now};

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

/// `GET domains` or `GET ports`: the caller's reservations (every one for an
/// admin) of that kind matching the selector.
pub(super) fn list(
    ctx: &ApiContext,
    caller: &ApiKey,
    selector: &Selector,
    ports: bool,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let items: Vec<Reservation> = ctx
        .store
        .reservations()?
        .into_iter()
        .filter(|r| (r.kind == ReservationKind::Tcp) == ports)
        .filter(|r| may_use(caller, &r.owner) && selector.matches(&r.labels))
        .map(|r| with_url(ctx, r))
        .collect();
    Ok(json_response(StatusCode::OK, &List { items }))
}

/// `GET domains/{host}` or `GET ports/{port}`.
pub(super) fn get(ctx: &ApiContext, reservation: Reservation) -> Response<Full<Bytes>> {
    json_response(StatusCode::OK, &with_url(ctx, reservation))
}

/// `POST domains`: a subdomain (`name`) or a custom domain (`fqdn`); the same
/// call again by the holder answers 200.
pub(super) fn reserve_domain(
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

/// `POST ports`: the port asked for, or a free one of the range.
pub(super) fn reserve_port(
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

/// `DELETE domains/{host}` or `DELETE ports/{port}`: revokes the reservation's tunnel keys too.
pub(super) fn release(
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

/// The domain reservation a path segment names, if the caller may use it.
pub(super) fn domain_of(ctx: &ApiContext, caller: &ApiKey, host: &str) -> Result<Reservation, ApiError> {
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

/// The port reservation a path segment names, if the caller may use it.
pub(super) fn port_of(ctx: &ApiContext, caller: &ApiKey, port: &str) -> Result<Reservation, ApiError> {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};

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
}
