//! Domain (`domains`) and port (`ports`) reservations: list, reserve, read,
//! release.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::auth::{may_use, not_owner};
use super::names::{custom_or_subdomain, lookup_hostname, subdomain};
use super::{ApiContext, ApiError, Change, edge_domain, json_response};
use crate::api::{
    ApiKey, DEFAULT_HOST, List, MAX_IDLE_TIMEOUT_SECONDS, PortProtocol, ReleaseResponse, Reservation,
    ReservationKind, ReserveDomainRequest, ReservePortRequest, Selector, validate_labels,
};
use crate::edge::store::{CertificateRecord, unix_now};

async fn with_url(ctx: &ApiContext, mut r: Reservation) -> Reservation {
    r.url = Some(r.public_url(ctx.public_https_port, &ctx.public_host));
    if ctx.acme
        && r.kind == ReservationKind::Custom
        && !r.is_default_host()
        && let Some(host) = &r.hostname
    {
        let record = match ctx.store.certificate(host).await {
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
pub(super) async fn list(
    ctx: &ApiContext,
    caller: &ApiKey,
    selector: &Selector,
    ports: bool,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let mut items: Vec<Reservation> = Vec::new();
    for r in ctx.store.reservations().await? {
        if (r.kind == ReservationKind::Tcp) == ports
            && may_use(caller, &r.owner)
            && selector.matches(&r.labels)
        {
            items.push(with_url(ctx, r).await);
        }
    }
    Ok(json_response(StatusCode::OK, &List { items }))
}

/// `GET ports`: the caller's port reservations (`only` one protocol, or both)
/// matching the selector.
pub(super) async fn list_ports(
    ctx: &ApiContext,
    caller: &ApiKey,
    selector: &Selector,
    only: Option<PortProtocol>,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let mut items: Vec<Reservation> = Vec::new();
    for r in ctx.store.reservations().await? {
        if r.kind == ReservationKind::Tcp
            && only.is_none_or(|p| p == r.protocol)
            && may_use(caller, &r.owner)
            && selector.matches(&r.labels)
        {
            items.push(with_url(ctx, r).await);
        }
    }
    Ok(json_response(StatusCode::OK, &List { items }))
}

/// The `protocol` query parameter of the port routes.
pub(super) fn port_protocol(s: &str) -> Result<PortProtocol, ApiError> {
    PortProtocol::parse(s).ok_or_else(|| ApiError::BadRequest {
        code: "invalid_protocol",
        message: format!("protocol `{s}` is not a port protocol: use tcp or udp"),
    })
}

/// `GET domains/{host}` or `GET ports/{port}`.
pub(super) async fn get(ctx: &ApiContext, reservation: Reservation) -> Response<Full<Bytes>> {
    json_response(StatusCode::OK, &with_url(ctx, reservation).await)
}

/// `POST domains`: a subdomain (`name`) or a custom domain (`fqdn`); the same
/// call again by the holder answers 200.
pub(super) async fn reserve_domain(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: ReserveDomainRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    check_labels(caller, &request.labels)?;
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
    if kind == ReservationKind::Subdomain
        && caller.scope != crate::api::ApiKeyScope::Admin
        && let Some(label) = hostname.split('.').next().filter(|l| ctx.reserved_names.iter().any(|n| n == l))
    {
        return Err(ApiError::invalid(
            "reserved_name",
            format!(
                "{label}.{domain} is kept for the edge's operator (reserved names: {}, set by the edge's --reserved-names); pick another name",
                ctx.reserved_names.join(", ")
            ),
        ));
    }
    if hostname == DEFAULT_HOST
        && !caller.may_reserve_custom(&hostname)
        && !holds(ctx, caller, &hostname).await?
    {
        return Err(ApiError::Forbidden {
            code: "default_host_not_allowed",
            message: format!(
                "this key may not hold the edge's default host `*` (every request whose host no reservation holds): ask the edge's admin to allow it (culvert admin api-key update {} --custom-domain '*'), or reserve a name (<name>.{domain})",
                caller.id
            ),
        });
    }
    if kind == ReservationKind::Custom
        && !caller.may_reserve_custom(&hostname)
        && !holds(ctx, caller, &hostname).await?
    {
        return Err(ApiError::Forbidden {
            code: "custom_domain_not_allowed",
            message: format!(
                "this key may not reserve the custom domain {hostname}: an admin allows custom domains per key (culvert admin api-key create --custom-domain {hostname} ...), or reserve <name>.{domain}"
            ),
        });
    }
    let (reservation, created) = {
        let _serial = ctx.serial.lock().await;
        let (reservation, created) =
            ctx.store.reserve_domain(kind, &hostname, &caller.id, &request.labels).await?;
        if created {
            ctx.hooks.changed(Change::Reserved(reservation.clone())).await;
        }
        (reservation, created)
    };
    if created {
        tracing::info!(hostname = %hostname, kind = %kind, by = %caller.id, "domain reserved");
    }
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(json_response(status, &with_url(ctx, reservation).await))
}

/// Labels that are well-formed (422 `invalid_labels`) and within the
/// caller's quota (403 `quota_exceeded`).
pub(super) fn check_labels(caller: &ApiKey, labels: &crate::api::Labels) -> Result<(), ApiError> {
    validate_labels(labels).map_err(|m| ApiError::invalid("invalid_labels", m))?;
    match &caller.quota {
        Some(quota) => quota
            .check_labels(labels, &caller.id)
            .map_err(|message| ApiError::Forbidden { code: "quota_exceeded", message }),
        None => Ok(()),
    }
}

/// Names under the edge's domain only an admin key may reserve by default
/// (`--reserved-names`): they look like the operator's own (phishing, or a
/// tenant posing as the edge).
pub const RESERVED_NAMES: &[&str] = &["admin", "api", "edge", "status", "www"];

/// The caller already holds `hostname` (asking again is answered as before).
async fn holds(ctx: &ApiContext, caller: &ApiKey, hostname: &str) -> Result<bool, ApiError> {
    Ok(ctx
        .store
        .reservation_by_hostname(hostname)
        .await?
        .iter()
        .any(|r| r.owner == caller.id && r.hostname.as_deref() == Some(hostname)))
}

/// `POST ports`: the port asked for, or a free one of the range.
pub(super) async fn reserve_port(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: ReservePortRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    check_labels(caller, &request.labels)?;
    if request.port == Some(0) {
        return Err(ApiError::invalid(
            "port_out_of_range",
            format!(
                "port 0 is not a port; pick one in the edge's TCP port range {}, or omit the port to get a free one",
                ctx.tcp_ports
            ),
        ));
    }
    let protocol = request.protocol;
    if protocol == PortProtocol::Udp && request.idle_timeout_seconds.is_some_and(|s| s > 0) {
        return Err(ApiError::invalid(
            "invalid_idle_timeout",
            "idleTimeoutSeconds is for TCP ports; UDP flows end after the edge's --udp-idle-timeout-seconds",
        ));
    }
    if let Some(secs) = request.idle_timeout_seconds.filter(|s| *s > MAX_IDLE_TIMEOUT_SECONDS) {
        return Err(ApiError::invalid(
            "invalid_idle_timeout",
            format!(
                "idleTimeoutSeconds {secs} is more than {MAX_IDLE_TIMEOUT_SECONDS} (30 days); give 1 to {MAX_IDLE_TIMEOUT_SECONDS}, or 0 (or nothing, for a new port) for the edge's --tcp-idle-timeout-seconds"
            ),
        ));
    }
    let (reservation, created) = {
        let _serial = ctx.serial.lock().await;
        let hooks = ctx.hooks.clone();
        let (mut reservation, created) = ctx
            .store
            .reserve_usable_port(
                request.port,
                protocol,
                ctx.tcp_ports,
                &caller.id,
                &request.labels,
                move |p| hooks.port_usable(p, protocol),
            )
            .await?;
        if created {
            ctx.hooks.changed(Change::Reserved(reservation.clone())).await;
        }
        // 0: the edge's own again.
        if let Some(wanted) = request.idle_timeout_seconds.map(|s| (s > 0).then_some(s))
            && reservation.idle_timeout_seconds != wanted
        {
            reservation = ctx.store.set_idle_timeout(&reservation.id, wanted).await?;
            tracing::info!(port = ?reservation.port, idle_timeout_seconds = ?wanted, by = %caller.id, "port idle timeout set");
            ctx.hooks.changed(Change::Reserved(reservation.clone())).await;
        }
        (reservation, created)
    };
    if created {
        tracing::info!(port = ?reservation.port, %protocol, by = %caller.id, "port reserved");
    }
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok(json_response(status, &with_url(ctx, reservation).await))
}

/// `DELETE domains/{host}` or `DELETE ports/{port}`: revokes the reservation's tunnel keys too.
pub(super) async fn release(
    ctx: &ApiContext,
    caller: &ApiKey,
    reservation: Reservation,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let (reservation, revoked_tunnel_keys) = {
        let _serial = ctx.serial.lock().await;
        let (reservation, revoked) = ctx.store.release_reservation(&reservation.id).await?;
        let change = Change::Released { reservation: reservation.clone(), revoked_keys: revoked.clone() };
        ctx.hooks.changed(change).await;
        (reservation, revoked)
    };
    tracing::info!(
        reservation = %reservation.target(),
        revoked_keys = revoked_tunnel_keys.len(),
        by = %caller.id,
        "reservation released"
    );
    let reservation = with_url(ctx, reservation).await;
    Ok(json_response(StatusCode::OK, &ReleaseResponse { reservation, revoked_tunnel_keys }))
}

/// The domain reservation a path segment names, if the caller may use it.
pub(super) async fn domain_of(
    ctx: &ApiContext,
    caller: &ApiKey,
    host: &str,
) -> Result<Reservation, ApiError> {
    let hostname = lookup_hostname(host, &edge_domain(ctx))?;
    let reservation = ctx
        .store
        .reservation_by_hostname(&hostname)
        .await?
        .ok_or_else(|| ApiError::NotFound { message: format!("domain {hostname} is not reserved") })?;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&format!("domain {hostname}")));
    }
    Ok(reservation)
}

/// The port reservation of `protocol` a path segment names, if the caller may use it.
pub(super) async fn port_of(
    ctx: &ApiContext,
    caller: &ApiKey,
    port: &str,
    protocol: PortProtocol,
) -> Result<Reservation, ApiError> {
    let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| ApiError::BadRequest {
        code: "invalid_port",
        message: format!("`{port}` is not a port number (1-65535)"),
    })?;
    let reservation =
        ctx.store.reservation_by_port_of(port, protocol).await?.ok_or_else(|| ApiError::NotFound {
            message: match protocol {
                PortProtocol::Tcp => format!("port {port} is not reserved"),
                PortProtocol::Udp => format!("UDP port {port} is not reserved"),
            },
        })?;
    if !may_use(caller, &reservation.owner) {
        return Err(not_owner(&reservation.target()));
    }
    Ok(reservation)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};

    /// Custom domains are scoped per endpoints key (issue 18 item 6).
    #[tokio::test]
    async fn custom_domains_only_within_what_the_key_is_allowed() {
        let e = edge();
        let key = |body: serde_json::Value| {
            let e = &e;
            async move {
                let (status, v) = e.call("POST", "api-keys", Some(&e.admin), Some(body)).await;
                assert_eq!(status, StatusCode::CREATED, "{v}");
                (v["secret"].as_str().unwrap().to_string(), v["id"].as_str().unwrap().to_string())
            }
        };
        let (plain, plain_id) = key(json!({"name": "plain", "scope": "endpoints"})).await;
        let (scoped, _) =
            key(json!({"name": "scoped", "scope": "endpoints", "customDomains": ["Example.ORG."]})).await;
        let reserve = |k: &str, fqdn: &str| {
            let (e, k, fqdn) = (&e, k.to_string(), fqdn.to_string());
            async move {
                let (status, v) = e.call("POST", "domains", Some(&k), Some(json!({"fqdn": fqdn}))).await;
                (status, code(&v).to_string())
            }
        };
        // A key without the permission: no custom domain, subdomains as before.
        assert_eq!(
            reserve(&plain, "example.org").await,
            (StatusCode::FORBIDDEN, "custom_domain_not_allowed".into())
        );
        assert_eq!(reserve(&plain, "x.edge.example.com").await.0, StatusCode::CREATED);
        // A scoped key: its suffix and names under it, nothing else.
        assert_eq!(reserve(&scoped, "example.org").await.0, StatusCode::CREATED);
        assert_eq!(reserve(&scoped, "shop.example.org").await.0, StatusCode::CREATED);
        for other in ["notexample.org", "example.org.evil.com", "edge.test.evil.com"] {
            assert_eq!(
                reserve(&scoped, other).await,
                (StatusCode::FORBIDDEN, "custom_domain_not_allowed".into()),
                "{other}"
            );
        }
        // The admin may reserve any.
        assert_eq!(reserve(&e.admin, "evil.com").await.0, StatusCode::CREATED);
        // Names that look like the edge's own are kept for the admin (item 8).
        for name in ["api", "admin", "www", "edge"] {
            let (status, v) = e.call("POST", "domains", Some(&plain), Some(json!({"name": name}))).await;
            assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, "reserved_name"), "{name}");
        }
        assert_eq!(
            reserve(&plain, "www.edge.example.com").await,
            (StatusCode::UNPROCESSABLE_ENTITY, "reserved_name".into())
        );
        assert_eq!(reserve(&e.admin, "www.edge.example.com").await.0, StatusCode::CREATED);
        // A custom domain held from before the permissions existed is still answered.
        e.ctx
            .store
            .reserve_domain(
                crate::api::ReservationKind::Custom,
                "old.example.net",
                &plain_id,
                &Default::default(),
            )
            .await
            .unwrap();
        assert_eq!(reserve(&plain, "old.example.net").await.0, StatusCode::OK);
        // What can be given.
        let (status, v) = e
            .call(
                "POST",
                "api-keys",
                Some(&e.admin),
                Some(json!({"name": "x", "scope": "endpoints", "customDomains": ["bad..name"]})),
            )
            .await;
        assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, "invalid_custom_domains"));
        let (_, v) = e.call("GET", &format!("api-keys/{plain_id}"), Some(&e.admin), None).await;
        assert!(v.get("customDomains").is_none(), "{v}");
    }

    /// The default host `*`: one holder per edge, for an admin or a key the
    /// admin allowed any custom domain (`*`, also given later by PATCH).
    #[tokio::test]
    async fn the_default_host_is_for_keys_allowed_it() {
        let e = edge();
        let (status, v) = e
            .call("POST", "api-keys", Some(&e.admin), Some(json!({"name": "p", "scope": "endpoints"})))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        let (plain, plain_id) =
            (v["secret"].as_str().unwrap().to_string(), v["id"].as_str().unwrap().to_string());
        let other = e.endpoints_key("other").await;
        let reserve = |k: &str| {
            let (e, k) = (&e, k.to_string());
            async move { e.call("POST", "domains", Some(&k), Some(json!({"fqdn": "*"}))).await }
        };
        let (status, v) = reserve(&plain).await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "default_host_not_allowed"), "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("culvert admin api-key update {plain_id} --custom-domain '*'")),
            "{message}"
        );
        // A key allowed some domains is not allowed the default host.
        let (_, v) = e
            .call(
                "PATCH",
                &format!("api-keys/{plain_id}"),
                Some(&e.admin),
                Some(json!({"customDomains": ["example.org"]})),
            )
            .await;
        assert_eq!(v["customDomains"], json!(["example.org"]), "{v}");
        assert_eq!(code(&reserve(&plain).await.1), "default_host_not_allowed");
        let (status, v) = e
            .call(
                "PATCH",
                &format!("api-keys/{plain_id}"),
                Some(&e.admin),
                Some(json!({"customDomains": ["*"]})),
            )
            .await;
        assert_eq!((status, v["customDomains"].clone()), (StatusCode::OK, json!(["*"])), "{v}");
        let (status, v) = reserve(&plain).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!((v["kind"].as_str(), v["hostname"].as_str()), (Some("custom"), Some("*")));
        assert_eq!(reserve(&plain).await.0, StatusCode::OK, "the holder asks again");
        // One holder per edge, the admin included.
        let (status, v) = reserve(&e.admin).await;
        assert_eq!((status, code(&v)), (StatusCode::CONFLICT, "already_reserved"), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("default host"), "{v}");
        assert_eq!(code(&reserve(&other).await.1), "already_reserved", "another key allowed `*`");
        // Its tunnel key carries HTTP(S), not TLS passthrough.
        let (status, v) = e
            .call("POST", "tunnel-keys", Some(&plain), Some(json!({"domain": "*", "protocol": "tls"})))
            .await;
        assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, "protocol_mismatch"), "{v}");
        let (status, v) = e.call("POST", "tunnel-keys", Some(&plain), Some(json!({"domain": "*"}))).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        // Read and released by its segment `*`.
        let (status, v) = e.call("GET", "domains/*", Some(&plain), None).await;
        assert_eq!((status, v["hostname"].as_str()), (StatusCode::OK, Some("*")), "{v}");
        let (status, _) = e.call("DELETE", "domains/*", Some(&plain), None).await;
        assert_eq!(status, StatusCode::OK);
        // Taken away again; the admin may hold it.
        let (status, v) = e
            .call(
                "PATCH",
                &format!("api-keys/{plain_id}"),
                Some(&e.admin),
                Some(json!({"customDomains": []})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert!(v.get("customDomains").is_none(), "{v}");
        assert_eq!(code(&reserve(&plain).await.1), "default_host_not_allowed");
        assert_eq!(reserve(&e.admin).await.0, StatusCode::CREATED);
    }

    /// The deny-list is the edge's `--reserved-names` (issue 18 item 8).
    #[tokio::test]
    async fn reserved_names_are_configurable() {
        let mut e = edge();
        e.ctx.reserved_names = vec!["shop".into(), "billing".into()];
        let ep = e.endpoints_key("a").await;
        for name in ["shop", "Billing"] {
            let (status, v) = e.call("POST", "domains", Some(&ep), Some(json!({"name": name}))).await;
            assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, "reserved_name"), "{name}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.contains("shop, billing") && message.contains("--reserved-names"), "{message}");
        }
        // The defaults are no longer kept; the admin still may take a kept name.
        let (status, _) = e.call("POST", "domains", Some(&ep), Some(json!({"name": "www"}))).await;
        assert_eq!(status, StatusCode::CREATED);
        let (status, _) = e.call("POST", "domains", Some(&e.admin), Some(json!({"name": "shop"}))).await;
        assert_eq!(status, StatusCode::CREATED);
        // None kept at all.
        e.ctx.reserved_names.clear();
        let (status, _) = e.call("POST", "domains", Some(&ep), Some(json!({"name": "billing"}))).await;
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

        // A port's own idle timeout: set on reserving, replaced when given again.
        let changes = e.hooks.changes.load(Ordering::SeqCst);
        let (status, v) = e.call("POST", "ports", Some(&ep), Some(json!({"idleTimeoutSeconds": 90}))).await;
        assert_eq!((status, v["idleTimeoutSeconds"].as_u64()), (StatusCode::CREATED, Some(90)), "{v}");
        let port = v["port"].as_u64().unwrap();
        let (status, v) =
            e.call("POST", "ports", Some(&ep), Some(json!({"port": port, "idleTimeoutSeconds": 30}))).await;
        assert_eq!((status, v["idleTimeoutSeconds"].as_u64()), (StatusCode::OK, Some(30)), "{v}");
        let (_, v) = e.call("GET", &format!("ports/{port}"), Some(&ep), None).await;
        assert_eq!(v["idleTimeoutSeconds"], 30);
        let (_, v) = e.call("POST", "ports", Some(&ep), Some(json!({"port": port}))).await;
        assert_eq!(v["idleTimeoutSeconds"], 30, "not given: kept");
        assert!(e.hooks.changes.load(Ordering::SeqCst) >= changes + 2, "the edge is told of each change");
        // 0: the edge's own again.
        let (_, v) =
            e.call("POST", "ports", Some(&ep), Some(json!({"port": port, "idleTimeoutSeconds": 0}))).await;
        assert!(v.get("idleTimeoutSeconds").is_none(), "{v}");
        let (status, v) =
            e.call("POST", "ports", Some(&ep), Some(json!({"idleTimeoutSeconds": 2_592_001}))).await;
        assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, "invalid_idle_timeout"), "{v}");
    }
}
