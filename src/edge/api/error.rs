//! [`ApiError`]: why a call failed, its HTTP status, its stable `code` and the
//! JSON error body.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, StatusCode};
use http_body_util::Full;
use hyper::Response;

use super::json_response;
use crate::api::ErrorBody;
use crate::constants::{API_BODY_TIMEOUT, API_MAX_BODY};
use crate::edge::store::StoreError;

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
    /// 503: the store (PostgreSQL) cannot be reached; the edge keeps serving
    /// what it knows, changes wait until it is back.
    #[error(
        "the store is unavailable: {0}; the edge keeps serving the tunnels and names it knows, try this change again when the database is back"
    )]
    Unavailable(String),
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
            ApiError::Unavailable(_) => "store_unavailable",
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
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub(super) fn into_response(self) -> Response<Full<Bytes>> {
        let status = self.status();
        let message = match &self {
            ApiError::Store(e) => {
                tracing::error!(error = %e, category = e.category(), "control API: store failed");
                format!("{self}; the edge's log has details")
            }
            ApiError::Unavailable(e) => {
                tracing::warn!(error = %e, "control API: the store is unavailable");
                self.to_string()
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
            ApiError::Unavailable(_) => {
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            }
            ApiError::MethodNotAllowed { allowed, .. } => {
                response.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allowed));
            }
            _ => {}
        }
        response
    }

    pub(super) fn invalid(code: &'static str, message: impl Into<String>) -> ApiError {
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
            StoreError::AlreadyReserved { target, .. } if target == crate::api::DEFAULT_HOST => ApiError::Conflict {
                code: "already_reserved",
                message: "the edge's default host `*` is held by another key (one holder per edge); the edge's admin sees which (culvert admin domain list) and may release it".to_string(),
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
            StoreError::QuotaExceeded { owner, limit } => ApiError::Forbidden {
                code: "quota_exceeded",
                message: format!(
                    "this key holds {limit} reservations, its quota: release one (culvert admin domain|port release), or ask the edge's admin to raise it (culvert admin api-key update {owner} --max-reservations N)"
                ),
            },
            StoreError::NotFound { what } => ApiError::NotFound { message: format!("{what} does not exist") },
            StoreError::LastAdminKey { id } => ApiError::Conflict {
                code: "last_admin_key",
                message: format!(
                    "{id} is the last admin key and cannot be revoked; create another admin key first (culvert admin api-key create --scope admin)"
                ),
            },
            StoreError::Unavailable(message) => ApiError::Unavailable(message),
            e => ApiError::Store(e),
        }
    }
}
