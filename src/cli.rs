//! Command line of the one `culvert` binary: every role's flags, with `env`
//! fallbacks and typed defaults.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::constants;

#[derive(Debug, Parser)]
#[command(
    name = "culvert",
    version,
    about = "Publish services of a cluster with no public address through your own edge"
)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, env = "CULVERT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the public edge: public HTTPS, the tunnel endpoint and the control API.
    Edge(EdgeArgs),
    /// Publish a local HTTP port through the edge (like `ngrok http 8080`).
    Http(AgentArgs),
    /// Publish a local TCP port through the edge.
    Tcp(AgentArgs),
    /// Manage API keys, domains, ports and tunnel keys on an edge.
    Admin(crate::admin::AdminArgs),
    /// Run the Kubernetes operator and in-cluster agent.
    Operator(crate::operator::OperatorArgs),
    /// Print the CustomResourceDefinitions (YAML) to apply before the operator.
    Crd,
    /// GET an http:// URL until it answers 2xx (the chart's `helm test`; the image has no curl).
    Probe(crate::probe::ProbeArgs),
}

#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// Base domain: reservations are published as `<name>.<domain>`.
    #[arg(long, env = "CULVERT_DOMAIN")]
    pub domain: String,

    /// Directory for the SQLite store, the admin key and (with --self-signed) the CA.
    #[arg(long, env = "CULVERT_DATA_DIR", default_value = "/var/lib/culvert")]
    pub data_dir: PathBuf,

    /// PEM certificate chain for `<domain>` and `*.<domain>`.
    #[arg(long, env = "CULVERT_TLS_CERT", requires = "tls_key", conflicts_with = "self_signed")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key for --tls-cert.
    #[arg(long, env = "CULVERT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Make a private CA and a certificate for the domain (kept in --data-dir); for trials.
    #[arg(long, env = "CULVERT_SELF_SIGNED", value_parser = clap::builder::BoolishValueParser::new())]
    pub self_signed: bool,

    /// Public HTTPS and tunnel endpoint.
    #[arg(long, env = "CULVERT_HTTPS_ADDR", default_value = "0.0.0.0:443")]
    pub https_addr: SocketAddr,

    /// Plain HTTP: redirects to HTTPS.
    #[arg(long, env = "CULVERT_HTTP_ADDR", default_value = "0.0.0.0:80")]
    pub http_addr: SocketAddr,

    /// Metrics, /healthz and /readyz.
    #[arg(long, env = "CULVERT_ADMIN_ADDR", default_value = "127.0.0.1:9090")]
    pub admin_addr: SocketAddr,

    /// Ports handed out to TCP reservations, `FIRST-LAST`.
    #[arg(long, env = "CULVERT_TCP_PORTS", default_value = constants::DEFAULT_TCP_PORTS, value_parser = parse_port_range)]
    pub tcp_ports: PortRange,

    /// Address the TCP reservation listeners bind to.
    #[arg(long, env = "CULVERT_TCP_BIND", default_value = "0.0.0.0")]
    pub tcp_bind: std::net::IpAddr,

    /// Host name (or IP) that public TCP addresses are reported with; defaults to --domain.
    #[arg(long, env = "CULVERT_PUBLIC_HOST")]
    pub public_host: Option<String>,

    /// Agents that may be connected at once with one tunnel key.
    #[arg(long, env = "CULVERT_MAX_AGENTS_PER_KEY", default_value_t = constants::DEFAULT_MAX_AGENTS_PER_KEY)]
    pub max_agents_per_key: usize,

    /// On SIGTERM: seconds to let open public connections finish (new ones
    /// are refused) before the tunnels are closed.
    #[arg(long, env = "CULVERT_DRAIN_SECONDS", default_value_t = constants::DEFAULT_DRAIN_SECONDS)]
    pub drain_seconds: u64,

    /// Also serve published HTTP hosts over plain HTTP on --http-addr, instead
    /// of redirecting them to HTTPS (other hosts are still redirected).
    #[arg(long, env = "CULVERT_PLAIN_HTTP", value_parser = clap::builder::BoolishValueParser::new())]
    pub plain_http: bool,

    #[command(flatten)]
    pub acme: AcmeArgs,
}

/// Certificates for custom domains from an ACME CA (Let's Encrypt by default).
#[derive(Debug, Clone, Args)]
pub struct AcmeArgs {
    /// Order certificates for custom domains by ACME (RFC 8555).
    #[arg(long = "acme", env = "CULVERT_ACME")]
    pub enabled: bool,

    /// ACME directory URL.
    #[arg(long = "acme-directory", env = "CULVERT_ACME_DIRECTORY", default_value = constants::DEFAULT_ACME_DIRECTORY)]
    pub directory: String,

    /// Contact e-mail for the ACME account (expiry notices from the CA).
    #[arg(long = "acme-email", env = "CULVERT_ACME_EMAIL")]
    pub email: Option<String>,

    /// Trust this PEM CA for the ACME directory instead of the built-in roots (test CAs).
    #[arg(long = "acme-ca-file", env = "CULVERT_ACME_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// How the CA validates a name: `tls-alpn-01` on the HTTPS port, or `http-01` on the HTTP port.
    #[arg(long = "acme-challenge", env = "CULVERT_ACME_CHALLENGE", value_enum, default_value_t = AcmeChallenge::TlsAlpn01)]
    pub challenge: AcmeChallenge,

    /// Certificate orders that may run at once.
    #[arg(long = "acme-max-concurrent-orders", env = "CULVERT_ACME_MAX_CONCURRENT_ORDERS", default_value_t = constants::DEFAULT_ACME_CONCURRENT_ORDERS)]
    pub max_concurrent_orders: usize,

    /// DNS server (`IP:PORT`) for the check that a custom domain points at the
    /// edge, instead of the system resolver.
    #[arg(long = "acme-dns-server", env = "CULVERT_ACME_DNS_SERVER")]
    pub dns_server: Option<SocketAddr>,
}

impl Default for AcmeArgs {
    fn default() -> Self {
        AcmeArgs {
            enabled: false,
            directory: constants::DEFAULT_ACME_DIRECTORY.into(),
            email: None,
            ca_file: None,
            challenge: AcmeChallenge::TlsAlpn01,
            max_concurrent_orders: constants::DEFAULT_ACME_CONCURRENT_ORDERS,
            dns_server: None,
        }
    }
}

/// The ACME challenge type the edge answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AcmeChallenge {
    /// TLS-ALPN-01 (RFC 8737) on the HTTPS port: works with only 443 open.
    #[value(name = "tls-alpn-01")]
    TlsAlpn01,
    /// HTTP-01 on the HTTP port (80).
    #[value(name = "http-01")]
    Http01,
}

#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// What to publish: `PORT`, `HOST:PORT` or (http) `http://HOST:PORT`.
    pub target: String,

    /// The edge's URL, e.g. https://edge.example.com.
    #[arg(long, env = "CULVERT_EDGE")]
    pub edge: String,

    /// The tunnel key (made by `culvert admin tunnel-key create`).
    #[arg(long, env = "CULVERT_KEY", hide_env_values = true)]
    pub key: String,

    /// Trust this PEM CA instead of the built-in Mozilla roots (for --self-signed edges).
    #[arg(long, env = "CULVERT_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}

/// An inclusive range of TCP ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

pub fn parse_port_range(s: &str) -> Result<PortRange, String> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let port = |p: &str| -> Result<u16, String> {
        match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("`{p}` is not a port (1-65535)")),
            Ok(n) => Ok(n),
        }
    };
    let (first, last) = (port(a)?, port(b)?);
    if first > last {
        return Err(format!("port range `{s}` is empty: write FIRST-LAST with FIRST <= LAST"));
    }
    Ok(PortRange { first, last })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn port_ranges() {
        assert_eq!(parse_port_range("20000-20999").unwrap(), PortRange { first: 20000, last: 20999 });
        assert_eq!(parse_port_range("8080").unwrap(), PortRange { first: 8080, last: 8080 });
        assert!(parse_port_range("0-10").is_err());
        assert!(parse_port_range("10-5").is_err());
        assert!(parse_port_range("70000").is_err());
    }
}
