//! `GET status`: the status page's document ([`crate::edge::status::model`]),
//! for `culvert admin status`; admin keys only.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::Response;

use super::{ApiContext, ApiError, json_response};
use crate::api::{ApiKey, ApiKeyScope};
use crate::edge::status::{DEFAULT_LIMIT, parse_limit};

/// The answer to `GET status?limit=N`.
pub(super) async fn get(
    ctx: &ApiContext,
    caller: &ApiKey,
    limit: Option<&str>,
) -> Result<Response<Full<Bytes>>, ApiError> {
    if caller.scope != ApiKeyScope::Admin {
        return Err(ApiError::Forbidden {
            code: "admin_required",
            message: format!(
                "the edge's status needs an admin key; {} is an {} key",
                caller.id, caller.scope
            ),
        });
    }
    let limit = match limit {
        None => DEFAULT_LIMIT,
        Some(v) => {
            parse_limit(v).map_err(|message| ApiError::BadRequest { code: "invalid_query", message })?
        }
    };
    let status = ctx
        .hooks
        .status(limit)
        .await
        .ok_or_else(|| ApiError::NotFound { message: "the edge is shutting down".into() })?;
    Ok(json_response(StatusCode::OK, &status))
}
