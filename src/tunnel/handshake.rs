//! The tunnel handshake is the WebSocket upgrade request itself: it carries
//! the tunnel key (`Authorization: Bearer`) and the protocol version. A
//! refusal is an HTTP status with a JSON body that says why.

use hyper::StatusCode;

use crate::api::ErrorBody;
use crate::constants::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};

/// `Sec-WebSocket-Accept` for a `Sec-WebSocket-Key` (RFC 6455 section 4.2.2):
/// base64 of the SHA-1 of the key and the protocol's GUID.
pub(crate) fn accept_key(key: &[u8]) -> String {
    use base64::Engine;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key);
    ctx.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    base64::engine::general_purpose::STANDARD.encode(ctx.finish())
}

/// Why the edge refused a tunnel connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    MissingKey,
    UnknownKey,
    RevokedKey,
    NotATunnelKey,
    MissingVersion,
    VersionTooOld {
        got: u32,
    },
    VersionTooNew {
        got: u32,
    },
    NotWebSocket,
    TooManyAgents {
        max: usize,
    },
    WrongProtocol {
        key: &'static str,
        agent: String,
    },
    /// This source address had too many handshakes refused lately.
    TooManyRefusals {
        retry_in_seconds: u64,
    },
    Internal,
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::MissingKey | Refusal::UnknownKey => StatusCode::UNAUTHORIZED,
            Refusal::RevokedKey | Refusal::NotATunnelKey | Refusal::WrongProtocol { .. } => {
                StatusCode::FORBIDDEN
            }
            Refusal::MissingVersion | Refusal::VersionTooOld { .. } | Refusal::VersionTooNew { .. } => {
                StatusCode::UPGRADE_REQUIRED
            }
            Refusal::NotWebSocket => StatusCode::BAD_REQUEST,
            Refusal::TooManyAgents { .. } | Refusal::TooManyRefusals { .. } => StatusCode::TOO_MANY_REQUESTS,
            Refusal::Internal => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Static code: the JSON `code` and the metric label.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::MissingKey => "missing_key",
            Refusal::UnknownKey => "unknown_key",
            Refusal::RevokedKey => "key_revoked",
            Refusal::NotATunnelKey => "not_a_tunnel_key",
            Refusal::MissingVersion => "missing_version",
            Refusal::VersionTooOld { .. } => "version_too_old",
            Refusal::VersionTooNew { .. } => "version_too_new",
            Refusal::NotWebSocket => "not_websocket",
            Refusal::TooManyAgents { .. } => "too_many_agents",
            Refusal::WrongProtocol { .. } => "wrong_protocol",
            Refusal::TooManyRefusals { .. } => "too_many_refusals",
            Refusal::Internal => "internal",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Refusal::MissingKey => "no tunnel key: send `Authorization: Bearer <tunnel key>`".into(),
            Refusal::UnknownKey => {
                "unknown tunnel key: create one with `culvert admin tunnel-key create`".into()
            }
            Refusal::RevokedKey => "this tunnel key was revoked: create a new one".into(),
            Refusal::NotATunnelKey => "this is an API key, which cannot open tunnels: \
                 use a tunnel key from `culvert admin tunnel-key create`"
                .into(),
            Refusal::MissingVersion => format!(
                "missing protocol version: this edge speaks versions \
                 {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}; upgrade the agent"
            ),
            Refusal::VersionTooOld { got } => format!(
                "protocol version {got} is too old: this edge speaks \
                 {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}; upgrade the agent"
            ),
            Refusal::VersionTooNew { got } => format!(
                "protocol version {got} is newer than this edge \
                 ({MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}); upgrade the edge"
            ),
            Refusal::NotWebSocket => "the tunnel endpoint takes a WebSocket upgrade".into(),
            Refusal::TooManyAgents { max } => {
                format!("{max} agents are already connected with this key")
            }
            Refusal::WrongProtocol { key, agent } => format!(
                "this key publishes {key}, but the agent asked for {agent}: use `culvert {key}` (or a key made with --protocol {agent})"
            ),
            Refusal::TooManyRefusals { retry_in_seconds } => format!(
                "too many refused tunnel handshakes from this address: check the agent's key and retry in {retry_in_seconds} s"
            ),
            Refusal::Internal => "the edge could not check the key; retry".into(),
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.code(), self.message())
    }

    /// Checks the agent's protocol version header.
    pub fn check_version(value: Option<&str>) -> Result<u32, Refusal> {
        let got: u32 = value.and_then(|v| v.trim().parse().ok()).ok_or(Refusal::MissingVersion)?;
        if got < MIN_PROTOCOL_VERSION {
            Err(Refusal::VersionTooOld { got })
        } else if got > PROTOCOL_VERSION {
            Err(Refusal::VersionTooNew { got })
        } else {
            Ok(got)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_keys_are_rfc_6455() {
        // The example of RFC 6455 section 1.3, and tungstenite's answer.
        assert_eq!(accept_key(b"dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        let key = b"x3JJHMbDL1EzLkh9GBhXDw==";
        assert_eq!(accept_key(key), tokio_tungstenite::tungstenite::handshake::derive_accept_key(key));
    }

    #[test]
    fn versions() {
        assert_eq!(Refusal::check_version(Some("1")), Ok(1));
        assert_eq!(Refusal::check_version(None), Err(Refusal::MissingVersion));
        assert_eq!(Refusal::check_version(Some("x")), Err(Refusal::MissingVersion));
        assert_eq!(Refusal::check_version(Some("0")), Err(Refusal::VersionTooOld { got: 0 }));
        assert_eq!(Refusal::check_version(Some("99")), Err(Refusal::VersionTooNew { got: 99 }));
        assert_eq!(Refusal::VersionTooOld { got: 0 }.status(), StatusCode::UPGRADE_REQUIRED);
    }
}
