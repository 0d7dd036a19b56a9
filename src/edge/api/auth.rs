//! Who is calling: the bearer API key, and what its scope may touch.

use http::header::{self, HeaderMap};

use super::ApiError;
use crate::api::{ApiKey, ApiKeyScope};
use crate::edge::store::{ApiKeyAuth, Store};

pub(super) fn authenticate(store: &Store, headers: &HeaderMap) -> Result<ApiKey, ApiError> {
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

/// Managing API keys needs an admin key.
pub(super) fn require_admin(caller: &ApiKey) -> Result<(), ApiError> {
    if caller.scope != ApiKeyScope::Admin {
        return Err(ApiError::Forbidden {
            code: "admin_required",
            message: format!(
                "managing API keys needs an admin key; {} is an {} key",
                caller.id, caller.scope
            ),
        });
    }
    Ok(())
}

/// An admin may use anything; an endpoints key only what it holds.
pub(super) fn may_use(caller: &ApiKey, owner: &str) -> bool {
    caller.scope == ApiKeyScope::Admin || caller.id == owner
}

pub(super) fn not_owner(what: &str) -> ApiError {
    ApiError::Forbidden {
        code: "not_owner",
        message: format!(
            "{what} is held by another key; an endpoints key can only use what it reserved itself"
        ),
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use serde_json::json;

    use super::super::test_support::{code, edge};
    use crate::constants::PROTOCOL_VERSION;

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
}
