//! `GET info`: the edge's domain, versions, TCP ports and the caller's key.

use super::{ApiContext, edge_domain};
use crate::api::{ApiKey, Info};
use crate::constants::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};

/// The answer to `GET info`.
pub(super) fn info(ctx: &ApiContext, caller: ApiKey) -> Info {
    Info {
        domain: edge_domain(ctx),
        version: env!("CARGO_PKG_VERSION").to_string(),
        protocol_version: PROTOCOL_VERSION,
        min_protocol_version: MIN_PROTOCOL_VERSION,
        tcp_ports: ctx.tcp_ports,
        public_host: ctx.public_host.clone(),
        public_https_port: ctx.public_https_port,
        caller,
    }
}
