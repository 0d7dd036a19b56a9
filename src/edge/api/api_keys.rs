//! API keys (`api-keys`, admin only): list, create, read, change the quota
//! and custom domains, revoke.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::{ApiContext, ApiError, json_response};
use crate::api::{
    ApiKey, ApiKeyScope, CreateApiKeyRequest, CreatedApiKey, List, QuotaUpdate, UpdateApiKeyRequest,
};

/// Longest API key name.
pub const MAX_KEY_NAME: usize = 100;

/// `GET api-keys`.
pub(super) async fn list(ctx: &ApiContext) -> Result<Response<Full<Bytes>>, ApiError> {
    Ok(json_response(StatusCode::OK, &List { items: ctx.store.api_keys().await? }))
}

/// `POST api-keys`.
pub(super) async fn create(
    ctx: &ApiContext,
    caller: &ApiKey,
    request: CreateApiKeyRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let name = request.name.trim();
    if name.is_empty() || name.chars().count() > MAX_KEY_NAME || name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "invalid_name",
            format!("an API key name is 1-{MAX_KEY_NAME} printable characters, e.g. \"operator cluster-a\""),
        ));
    }
    let custom_domains = custom_domains(request.scope, &request.custom_domains)?;
    check_quota(request.scope, &request.quota)?;
    let (key, secret) = ctx.store.create_api_key(name, request.scope, &custom_domains, request.quota).await?;
    tracing::info!(key = %key.id, scope = %key.scope, by = %caller.id, "api key created");
    Ok(json_response(StatusCode::CREATED, &CreatedApiKey { key, secret }))
}

/// The custom domains given for a key of `scope`, normalized.
fn custom_domains(scope: ApiKeyScope, given: &[String]) -> Result<Vec<String>, ApiError> {
    let mut custom_domains = Vec::new();
    for d in given {
        let d = d.trim().trim_end_matches('.').to_ascii_lowercase();
        if d == "*" {
            custom_domains.push(d);
            continue;
        }
        custom_domains.push(super::names::normalize_hostname(&d).map_err(|_| {
            ApiError::invalid(
                "invalid_custom_domains",
                format!(
                    "customDomains entry `{d}` is not a domain: give names like example.org (it and every name under it), or `*` for any"
                ),
            )
        })?);
    }
    if scope == ApiKeyScope::Admin && !custom_domains.is_empty() {
        return Err(ApiError::invalid(
            "invalid_custom_domains",
            "customDomains is for endpoints keys: an admin key may reserve any domain".to_string(),
        ));
    }
    Ok(custom_domains)
}

/// `GET api-keys/{id}`.
pub(super) async fn get(ctx: &ApiContext, id: &str) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = ctx
        .store
        .api_key(id)
        .await?
        .ok_or_else(|| ApiError::NotFound { message: format!("api key {id} does not exist") })?;
    Ok(json_response(StatusCode::OK, &key))
}

/// An admin key has no quota; values must be within [`crate::api::Quota::MAX`].
fn check_quota(scope: ApiKeyScope, quota: &QuotaUpdate) -> Result<(), ApiError> {
    if scope == ApiKeyScope::Admin && !quota.is_empty() {
        return Err(ApiError::invalid(
            "invalid_quota",
            "quota is for endpoints keys: an admin key has no limits".to_string(),
        ));
    }
    quota.validate().map_err(|m| ApiError::invalid("invalid_quota", m))
}

/// `PATCH api-keys/{id}`: changes an endpoints key's quota (what is given).
pub(super) async fn update(
    ctx: &ApiContext,
    caller: &ApiKey,
    id: &str,
    request: UpdateApiKeyRequest,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = ctx
        .store
        .api_key(id)
        .await?
        .ok_or_else(|| ApiError::NotFound { message: format!("api key {id} does not exist") })?;
    if request.quota.is_empty() && request.custom_domains.is_none() {
        return Err(ApiError::invalid(
            "invalid_request",
            "nothing to change: give quota.reservations, quota.labels, quota.labelBytes or customDomains"
                .to_string(),
        ));
    }
    check_quota(key.scope, &request.quota)?;
    let domains = request.custom_domains.as_deref().map(|d| custom_domains(key.scope, d)).transpose()?;
    let mut key = key;
    if !request.quota.is_empty() {
        key = ctx.store.update_api_key_quota(id, request.quota).await?;
        tracing::info!(key = %key.id, quota = ?key.quota, by = %caller.id, "api key quota changed");
    }
    if let Some(domains) = domains {
        key = ctx.store.set_api_key_custom_domains(id, domains).await?;
        tracing::info!(key = %key.id, custom_domains = ?key.custom_domains, by = %caller.id, "api key custom domains changed");
    }
    Ok(json_response(StatusCode::OK, &key))
}

/// `DELETE api-keys/{id}`: refused for the last admin key.
pub(super) async fn revoke(
    ctx: &ApiContext,
    caller: &ApiKey,
    id: &str,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = ctx.store.revoke_api_key(id).await?;
    tracing::info!(key = %key.id, by = %caller.id, "api key revoked");
    ctx.hooks.state_changed().await;
    Ok(json_response(StatusCode::OK, &key))
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};

    /// Quotas per endpoints key (issue 18 item 7): reservations, labels and
    /// label bytes, with defaults, set at creation and changed by PATCH; a
    /// refusal says the limit and how to raise it.
    #[tokio::test]
    async fn quotas_per_key() {
        let e = edge();
        let (status, v) = e
            .call(
                "POST",
                "api-keys",
                Some(&e.admin),
                Some(json!({"name": "t", "scope": "endpoints", "quota": {"reservations": 2, "labels": 2}})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        assert_eq!(v["quota"], json!({"reservations": 2, "labels": 2, "labelBytes": 4096}));
        let (key, id) = (v["secret"].as_str().unwrap().to_string(), v["id"].as_str().unwrap().to_string());
        let reserve = |name: &str, labels: serde_json::Value| {
            let (e, key, name) = (&e, key.clone(), name.to_string());
            async move {
                e.call("POST", "domains", Some(&key), Some(json!({"name": name, "labels": labels}))).await
            }
        };
        assert_eq!(reserve("a", json!({"k1": "v", "k2": "v"})).await.0, StatusCode::CREATED);
        // Labels over the quota.
        let (status, v) = reserve("b", json!({"k1": "v", "k2": "v", "k3": "v"})).await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "quota_exceeded"), "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("2 labels per record")
                && message.contains(&format!("api-key update {id} --max-labels 3")),
            "{message}"
        );
        let (status, v) = reserve("b", json!({"k": "x".repeat(200)})).await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        // Reservations over the quota; the port too.
        let (status, v) = reserve("c", json!({})).await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "quota_exceeded"), "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("holds 2 reservations")
                && message.contains(&format!("api-key update {id} --max-reservations")),
            "{message}"
        );
        let (status, v) = e.call("POST", "ports", Some(&key), None).await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "quota_exceeded"), "{v}");
        // Tunnel keys' labels count too.
        let (status, v) = e
            .call(
                "POST",
                "tunnel-keys",
                Some(&key),
                Some(json!({"domain": "a", "labels": {"a": "1", "b": "2", "c": "3"}})),
            )
            .await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "quota_exceeded"), "{v}");

        // The admin raises it: what is given changes, the rest stays.
        let (status, v) = e
            .call(
                "PATCH",
                &format!("api-keys/{id}"),
                Some(&e.admin),
                Some(json!({"quota": {"reservations": 3, "labelBytes": 100}})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v["quota"], json!({"reservations": 3, "labels": 2, "labelBytes": 100}));
        assert_eq!(reserve("c", json!({})).await.0, StatusCode::CREATED);
        let (status, v) = reserve("d", json!({})).await;
        assert_eq!(code(&v), "quota_exceeded", "{status}");
        let (status, v) = e
            .call(
                "POST",
                "tunnel-keys",
                Some(&key),
                Some(json!({"domain": "a", "labels": {"k": "x".repeat(100)}})),
            )
            .await;
        assert_eq!((status, code(&v)), (StatusCode::FORBIDDEN, "quota_exceeded"), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("--max-label-bytes 101"), "{v}");

        // Defaults for a key made without a quota; none for admin keys.
        let plain = e.endpoints_key("plain").await;
        let (_, info) = e.call("GET", "info", Some(&plain), None).await;
        assert_eq!(info["caller"]["quota"], json!({"reservations": 1000, "labels": 32, "labelBytes": 4096}));
        let (_, info) = e.call("GET", "info", Some(&e.admin), None).await;
        assert!(info["caller"].get("quota").is_none(), "{info}");
        let admin_id = info["caller"]["id"].as_str().unwrap().to_string();

        // What cannot be given.
        for (path, method, body, want) in [
            (
                "api-keys".to_string(),
                "POST",
                json!({"name": "x", "scope": "admin", "quota": {"labels": 1}}),
                "invalid_quota",
            ),
            (
                "api-keys".to_string(),
                "POST",
                json!({"name": "x", "scope": "endpoints", "quota": {"labels": 65}}),
                "invalid_quota",
            ),
            (format!("api-keys/{admin_id}"), "PATCH", json!({"quota": {"reservations": 1}}), "invalid_quota"),
            (
                format!("api-keys/{id}"),
                "PATCH",
                json!({"quota": {"reservations": 1_000_001}}),
                "invalid_quota",
            ),
            (format!("api-keys/{id}"), "PATCH", json!({}), "invalid_request"),
        ] {
            let (status, v) = e.call(method, &path, Some(&e.admin), Some(body.clone())).await;
            assert_eq!((status, code(&v)), (StatusCode::UNPROCESSABLE_ENTITY, want), "{body}: {v}");
        }
        let (status, v) = e
            .call("PATCH", "api-keys/ak_000000000000", Some(&e.admin), Some(json!({"quota": {"labels": 1}})))
            .await;
        assert_eq!((status, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
        let (status, v) = e
            .call("PATCH", &format!("api-keys/{id}"), Some(&plain), Some(json!({"quota": {"labels": 1}})))
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
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
}
