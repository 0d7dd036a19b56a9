//! API keys (`api-keys`, admin only): list, create, read, revoke.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::{ApiContext, ApiError, json_response};
use crate::api::{ApiKey, CreateApiKeyRequest, CreatedApiKey, List};

/// Longest API key name.
pub const MAX_KEY_NAME: usize = 100;

/// `GET api-keys`.
pub(super) fn list(ctx: &ApiContext) -> Result<Response<Full<Bytes>>, ApiError> {
    Ok(json_response(StatusCode::OK, &List { items: ctx.store.api_keys()? }))
}

/// `POST api-keys`.
pub(super) fn create(
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
    let (key, secret) = ctx.store.create_api_key(name, request.scope)?;
    tracing::info!(key = %key.id, scope = %key.scope, by = %caller.id, "api key created");
    Ok(json_response(StatusCode::CREATED, &CreatedApiKey { key, secret }))
}

/// `GET api-keys/{id}`.
pub(super) fn get(ctx: &ApiContext, id: &str) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = ctx
        .store
        .api_key(id)?
        .ok_or_else(|| ApiError::NotFound { message: format!("api key {id} does not exist") })?;
    Ok(json_response(StatusCode::OK, &key))
}

/// `DELETE api-keys/{id}`: refused for the last admin key.
pub(super) fn revoke(ctx: &ApiContext, caller: &ApiKey, id: &str) -> Result<Response<Full<Bytes>>, ApiError> {
    let key = ctx.store.revoke_api_key(id)?;
    tracing::info!(key = %key.id, by = %caller.id, "api key revoked");
    ctx.hooks.state_changed();
    Ok(json_response(StatusCode::OK, &key))
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};

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
