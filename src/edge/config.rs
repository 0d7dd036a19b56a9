//! The edge's command line (`culvert edge`): every flag, with `env`
//! fallbacks and typed defaults.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::acme::dns01::TsigAlgorithm;
use crate::api::PortRange;
use crate::constants;

#[derive(Debug, Clone, Args)]
pub struct EdgeArgs {
    /// Base domain: reservations are published as `<name>.<domain>`.
    #[arg(long, env = "CULVERT_DOMAIN")]
    pub domain: String,

    /// Directory for the SQLite store, the admin key and (with --self-signed) the CA.
    #[arg(long, env = "CULVERT_DATA_DIR", default_value = "/var/lib/culvert")]
    pub data_dir: PathBuf,

    /// The store: a PostgreSQL URL shared by several edges
    /// (`postgres://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=verify-full`), or
    /// `sqlite` (the default: `culvert.db` in --data-dir). Better given in
    /// the environment than on the command line (it may hold a password).
    #[arg(long, env = "CULVERT_STORE", hide_env_values = true)]
    pub store: Option<String>,

    /// PEM certificate chain for `<domain>` and `*.<domain>`.
    #[arg(long, env = "CULVERT_TLS_CERT", requires = "tls_key", conflicts_with = "self_signed")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key for --tls-cert.
    #[arg(long, env = "CULVERT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Seconds between checks of --tls-cert/--tls-key for a new version
    /// (certbot renewal), served without a restart; 0: only on SIGHUP.
    #[arg(long, env = "CULVERT_TLS_WATCH_SECONDS", default_value_t = constants::DEFAULT_TLS_WATCH_SECONDS)]
    pub tls_watch_seconds: u64,

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
    #[arg(long, env = "CULVERT_TCP_PORTS", default_value = constants::DEFAULT_TCP_PORTS, value_parser = PortRange::parse)]
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

    /// Also serve the status page on the public port, under /_culvert/status
    /// of --domain, behind a login with an admin key (it is always on the
    /// admin port, at /status).
    #[arg(long, env = "CULVERT_PUBLIC_STATUS", value_parser = clap::builder::BoolishValueParser::new())]
    pub public_status: bool,
    /// A TCP reservation's connection with no byte either way for this long
    /// is closed (seconds).
    #[arg(long, env = "CULVERT_TCP_IDLE_TIMEOUT_SECONDS", default_value_t = constants::DEFAULT_TCP_IDLE_TIMEOUT_SECONDS, value_parser = clap::value_parser!(u64).range(1..))]
    pub tcp_idle_timeout_seconds: u64,

    /// A UDP flow (one public client address and port on a UDP reservation)
    /// with no datagram either way for this long ends (seconds); its next
    /// datagram starts a new flow.
    #[arg(long, env = "CULVERT_UDP_IDLE_TIMEOUT_SECONDS", default_value_t = constants::DEFAULT_UDP_IDLE_TIMEOUT_SECONDS, value_parser = clap::value_parser!(u64).range(1..))]
    pub udp_idle_timeout_seconds: u64,

    /// UDP flows one UDP reservation may have at once; datagrams of new
    /// clients beyond it are dropped (counted in culvert_edge_udp_flows_refused).
    #[arg(long, env = "CULVERT_MAX_UDP_FLOWS_PER_PORT", default_value_t = constants::DEFAULT_MAX_UDP_FLOWS_PER_PORT, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_udp_flows_per_port: u64,

    /// UDP flows the edge carries at once over every UDP reservation.
    #[arg(long, env = "CULVERT_MAX_UDP_FLOWS", default_value_t = constants::DEFAULT_MAX_UDP_FLOWS, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_udp_flows: u64,

    /// A spliced connection (TCP reservation, TLS passthrough, HTTP upgrade)
    /// that one side has half-closed is closed once silent for this long
    /// (seconds): a peer that ignores the half-close cannot hold it open.
    #[arg(long, env = "CULVERT_HALF_CLOSE_TIMEOUT_SECONDS", default_value_t = constants::DEFAULT_HALF_CLOSE_TIMEOUT_SECONDS, value_parser = clap::value_parser!(u64).range(1..))]
    pub half_close_timeout_seconds: u64,

    /// Public HTTPS connections served at once (also capped at half the
    /// open file limit); more are closed on accept.
    #[arg(long, env = "CULVERT_MAX_PUBLIC_CONNECTIONS", default_value_t = constants::MAX_PUBLIC_CONNECTIONS)]
    pub max_public_connections: usize,

    /// Tunnel streams open at once, all tunnels together: each may hold one
    /// 256 KiB stream window of response data its public client has not
    /// read, so this bounds the edge's download buffering (default 4096:
    /// 1.25 GiB). More requests wait for a stream to end (503 after 10 s).
    #[arg(long, env = "CULVERT_MAX_TUNNEL_STREAMS", default_value_t = constants::DEFAULT_MAX_TUNNEL_STREAMS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_tunnel_streams: usize,

    /// Connections one TCP reservation may hold at once (all TCP
    /// reservations together get a fifth of the open file limit).
    #[arg(long, env = "CULVERT_MAX_CONNECTIONS_PER_TCP_PORT", default_value_t = constants::DEFAULT_MAX_CONNECTIONS_PER_TCP_PORT)]
    pub max_connections_per_tcp_port: usize,

    /// An HTTP/1.1 `Upgrade` protocol passed through to backends
    /// (repeatable). Requests asking for any other (`h2c`, ...) are forwarded
    /// as plain requests without their `Upgrade` header: a client cannot
    /// switch to a protocol that bypasses the edge's header clean-up.
    #[arg(
        long = "allow-upgrade",
        env = "CULVERT_ALLOW_UPGRADE",
        value_delimiter = ',',
        default_value = "websocket"
    )]
    pub allow_upgrade: Vec<String>,

    /// Subdomain labels of --domain only an admin key may reserve
    /// (comma-separated; an empty value reserves none): names that look like
    /// the edge operator's own.
    #[arg(
        long = "reserved-names",
        env = "CULVERT_RESERVED_NAMES",
        value_delimiter = ',',
        default_value = "admin,api,edge,status,www"
    )]
    pub reserved_names: Vec<String>,

    #[command(flatten)]
    pub acme: AcmeArgs,
}

/// `culvert migrate-store`: copy an SQLite edge's store into PostgreSQL.
#[derive(Debug, Clone, Args)]
pub struct MigrateStoreArgs {
    /// The SQLite edge's --data-dir (holds culvert.db).
    #[arg(long)]
    pub from: PathBuf,

    /// The PostgreSQL URL the edges will use as --store; its database must
    /// not hold culvert data yet.
    #[arg(long, env = "CULVERT_STORE", hide_env_values = true)]
    pub to: String,
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

    /// Obtain and renew the edge's own certificate for `<domain>` and
    /// `*.<domain>` by DNS-01, with `rfc2136` (dynamic DNS update with TSIG)
    /// or `hook` (a program you give); instead of --tls-cert/--tls-key.
    #[arg(long = "acme-dns01", env = "CULVERT_ACME_DNS01", value_enum, requires = "enabled")]
    pub dns01: Option<Dns01Kind>,

    /// rfc2136: the zone's primary DNS server, `IP` or `IP:PORT` (port 53 by default).
    #[arg(long = "acme-dns01-server", env = "CULVERT_ACME_DNS01_SERVER", value_parser = parse_dns_server)]
    pub dns01_server: Option<SocketAddr>,

    /// rfc2136: the zone that holds `_acme-challenge.<domain>` (default: the domain itself).
    #[arg(long = "acme-dns01-zone", env = "CULVERT_ACME_DNS01_ZONE")]
    pub dns01_zone: Option<String>,

    /// rfc2136: name of the TSIG key that may update the zone.
    #[arg(long = "acme-dns01-tsig-key", env = "CULVERT_ACME_DNS01_TSIG_KEY")]
    pub dns01_tsig_key: Option<String>,

    /// rfc2136: the TSIG key's secret, base64 (as `tsig-keygen` prints it);
    /// better given in the environment than on the command line.
    #[arg(long = "acme-dns01-tsig-secret", env = "CULVERT_ACME_DNS01_TSIG_SECRET", hide_env_values = true)]
    pub dns01_tsig_secret: Option<String>,

    /// rfc2136: read the TSIG secret from this file instead (wins over --acme-dns01-tsig-secret).
    #[arg(long = "acme-dns01-tsig-secret-file", env = "CULVERT_ACME_DNS01_TSIG_SECRET_FILE")]
    pub dns01_tsig_secret_file: Option<PathBuf>,

    /// rfc2136: the TSIG key's algorithm.
    #[arg(long = "acme-dns01-tsig-algorithm", env = "CULVERT_ACME_DNS01_TSIG_ALGORITHM", value_enum, default_value_t = TsigAlgorithm::HmacSha256)]
    pub dns01_tsig_algorithm: TsigAlgorithm,

    /// hook: program run as `HOOK set FQDN VALUE` and `HOOK unset FQDN VALUE`
    /// (FQDN is `_acme-challenge.<domain>`; `set` adds a TXT record next to
    /// any there, `unset` removes that one record).
    #[arg(long = "acme-dns01-hook", env = "CULVERT_ACME_DNS01_HOOK")]
    pub dns01_hook: Option<PathBuf>,

    /// Seconds to wait after the TXT records are set before the CA is asked
    /// to check them (DNS providers whose secondaries lag).
    #[arg(
        long = "acme-dns01-propagation-seconds",
        env = "CULVERT_ACME_DNS01_PROPAGATION_SECONDS",
        default_value_t = 0
    )]
    pub dns01_propagation_seconds: u64,
}

/// How DNS-01 records are set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dns01Kind {
    /// RFC 2136 dynamic updates (BIND, Knot, PowerDNS, many hosted DNS services).
    Rfc2136,
    /// An exec hook (any provider's tool).
    Hook,
}

fn parse_dns_server(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| format!("{s:?} is not IP or IP:PORT"))
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
            dns01: None,
            dns01_server: None,
            dns01_zone: None,
            dns01_tsig_key: None,
            dns01_tsig_secret: None,
            dns01_tsig_secret_file: None,
            dns01_tsig_algorithm: TsigAlgorithm::HmacSha256,
            dns01_hook: None,
            dns01_propagation_seconds: 0,
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::EdgeArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        edge: EdgeArgs,
    }

    fn parse(args: &[&str]) -> EdgeArgs {
        Cli::try_parse_from([&["edge", "--domain", "edge.test"], args].concat()).unwrap().edge
    }

    #[test]
    fn reserved_names() {
        assert_eq!(parse(&[]).reserved_names, ["admin", "api", "edge", "status", "www"]);
        assert_eq!(parse(&["--reserved-names", "shop,billing"]).reserved_names, ["shop", "billing"]);
        assert!(parse(&["--reserved-names", ""]).reserved_names.iter().all(|n| n.is_empty()));
    }
}
