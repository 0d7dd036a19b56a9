//! The standalone agent's command line (`culvert http|tcp|udp`).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// What to publish: `PORT`, `HOST:PORT` or (http) `http://HOST:PORT`.
    pub target: String,

    /// tcp and udp: tell the backend each public client's address with a
    /// PROXY protocol header, `v1` or `v2` (tcp: once per connection; udp:
    /// `v2` only, before every datagram).
    #[arg(long, env = "CULVERT_PROXY_PROTOCOL", value_enum)]
    pub proxy_protocol: Option<super::pipe::ProxyHeader>,

    /// The edge's URL, e.g. https://edge.example.com. Several edges: repeat
    /// the flag or separate URLs with commas; the agent keeps one connection
    /// to each, and to each address of a name that resolves to several.
    #[arg(long, env = "CULVERT_EDGE", value_delimiter = ',', required = true)]
    pub edge: Vec<String>,

    /// The tunnel key (made by `culvert admin tunnel-key create`). Prefer
    /// --key-file or CULVERT_KEY: a flag is visible to every local user.
    #[arg(long, env = "CULVERT_KEY", hide_env_values = true, required_unless_present = "key_file")]
    pub key: Option<String>,

    /// Read the tunnel key from this file; wins over --key.
    #[arg(long, env = "CULVERT_KEY_FILE")]
    pub key_file: Option<PathBuf>,

    /// Trust this PEM CA instead of the built-in Mozilla roots (for --self-signed edges).
    #[arg(long, env = "CULVERT_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// The cipher the tunnel's TLS offers first: `auto` (AES-128-GCM on a
    /// CPU with AES instructions, ChaCha20-Poly1305 on one without, such
    /// as a Raspberry Pi 3 or 4), `aes-128-gcm` or `chacha20-poly1305`.
    #[arg(long, env = "CULVERT_TUNNEL_CIPHER", value_enum, default_value_t)]
    pub tunnel_cipher: crate::tls::TunnelCipher,

    /// The tunnel protocol version to offer: 2 (the multiplexer) or 1
    /// (HTTP/2 carries the streams). An edge that speaks only 1 is asked
    /// again with 1 by itself; set 1 only to rule the multiplexer out.
    #[arg(long, env = "CULVERT_PROTOCOL_VERSION", default_value_t = crate::constants::PROTOCOL_VERSION,
          value_parser = clap::value_parser!(u32).range(crate::constants::MIN_PROTOCOL_VERSION as i64..=crate::constants::PROTOCOL_VERSION as i64))]
    pub protocol_version: u32,

    /// Serve `/metrics` (plain HTTP; what the agent drops) on this address,
    /// e.g. 127.0.0.1:9091. Off by default.
    #[arg(long, env = "CULVERT_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}
