//! `culvert admin`: the command line and the tables over the control API
//! client ([`crate::api_client`]).
//!
//! Tables for humans on stdout; `-o json` prints the edge's JSON answer as is.
//! Commands that make a secret (`tunnel-key create`, `api-key create`) print
//! only the secret in table mode, so `KEY=$(culvert admin ...)` works; what
//! was made is told on stderr.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use serde_json::Value;

use crate::api::{
    ApiKey, ApiKeyScope, CreateApiKeyRequest, CreateTunnelKeyRequest, CreatedApiKey, CreatedTunnelKey, Info,
    Labels, List, PortProtocol, Protocol, QuotaUpdate, ReleaseResponse, Reservation, ReserveDomainRequest,
    ReservePortRequest, TunnelKey, UpdateApiKeyRequest, parse_label,
};
use crate::api_client::{Client, ClientError, segment};

/// `culvert admin`: manage API keys, domains, ports and tunnel keys on an edge.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The edge's URL, e.g. https://edge.example.com; several edges sharing
    /// one store as a comma list (a call goes to the next when one is down).
    #[arg(long, global = true, env = "CULVERT_EDGE")]
    pub edge: Option<String>,

    /// An admin or endpoints API key (falls back to CULVERT_KEY). Prefer
    /// --key-file or the environment: a flag is visible to every local user.
    #[arg(long, global = true, env = "CULVERT_ADMIN_KEY", hide_env_values = true)]
    pub key: Option<String>,

    /// Read the API key from this file (e.g. the edge's DATA_DIR/admin.key); wins over --key.
    #[arg(long, global = true, env = "CULVERT_ADMIN_KEY_FILE")]
    pub key_file: Option<PathBuf>,

    /// Trust this PEM CA instead of the built-in Mozilla roots (for --self-signed edges: DATA_DIR/ca.pem).
    #[arg(long, global = true, env = "CULVERT_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    /// What to do.
    #[command(subcommand)]
    pub command: AdminCommand,
}

/// Output format of `culvert admin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for humans (creating commands print only the secret).
    Table,
    /// The edge's JSON answer, pretty-printed.
    Json,
}

/// Subcommands of `culvert admin`.
#[derive(Debug, Clone, Subcommand)]
pub enum AdminCommand {
    /// Show the edge's domain, version, TCP port range and the key you use.
    Info,
    /// Show the edge's status: the edge, its tunnels, agents and traffic (admin key).
    Status {
        /// List at most this many tunnels (those with agents first, then the busiest).
        #[arg(long, default_value_t = crate::edge::status::DEFAULT_LIMIT)]
        limit: usize,
    },
    /// Reserve, list and release domains (`<name>.<edge domain>` or custom).
    #[command(subcommand)]
    Domain(DomainCommand),
    /// Reserve, list and release TCP ports.
    #[command(subcommand)]
    Port(PortCommand),
    /// Create, list and revoke tunnel keys (what agents connect with).
    #[command(subcommand)]
    TunnelKey(TunnelKeyCommand),
    /// Create, list and revoke API keys (admin key only).
    #[command(subcommand)]
    ApiKey(ApiKeyCommand),
}

/// `culvert admin domain ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum DomainCommand {
    /// Reserve `<NAME>.<edge domain>`, or a custom domain with --fqdn; prints the host name.
    Reserve {
        /// A DNS label (a-z, 0-9, `-`).
        #[arg(required_unless_present = "fqdn", conflicts_with = "fqdn")]
        name: Option<String>,
        /// A full host name pointed at the edge by CNAME; `*` for the edge's
        /// default host (every request whose host no reservation holds).
        #[arg(long)]
        fqdn: Option<String>,
        /// A label to store with the reservation (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// List reserved domains.
    List {
        /// Only those whose labels match, e.g. `k=v,k2!=v2`.
        #[arg(long, short = 'l')]
        selector: Option<String>,
    },
    /// Show one domain.
    Show {
        /// Host name or subdomain label.
        host: String,
    },
    /// Release a domain; its tunnel keys are revoked.
    Release {
        /// Host name or subdomain label.
        host: String,
    },
}

/// `culvert admin port ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum PortCommand {
    /// Reserve a TCP or UDP port (the lowest free one unless given); prints the port.
    Reserve {
        /// A port within the edge's range.
        port: Option<u16>,
        /// `tcp` or `udp`: TCP and UDP ports are separate (UDP 5353 and TCP
        /// 5353 are two reservations).
        #[arg(long, value_enum, default_value_t = PortProtocol::Tcp)]
        protocol: PortProtocol,
        /// A label to store with the reservation (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Close the port's connections after this many seconds with no byte
        /// either way [default: the edge's --tcp-idle-timeout-seconds]; given
        /// for a port you hold, it replaces the one it had.
        #[arg(long, value_name = "SECONDS")]
        idle_timeout_seconds: Option<u64>,
    },
    /// List reserved ports (TCP and UDP).
    List {
        /// Only those whose labels match, e.g. `k=v,k2!=v2`.
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Only `tcp` or `udp` ports.
        #[arg(long, value_enum)]
        protocol: Option<PortProtocol>,
    },
    /// Show one port.
    Show {
        /// The port.
        port: u16,
        /// `tcp` or `udp`.
        #[arg(long, value_enum, default_value_t = PortProtocol::Tcp)]
        protocol: PortProtocol,
    },
    /// Release a port; its tunnel keys are revoked.
    Release {
        /// The port.
        port: u16,
        /// `tcp` or `udp`.
        #[arg(long, value_enum, default_value_t = PortProtocol::Tcp)]
        protocol: PortProtocol,
    },
}

/// `culvert admin tunnel-key ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum TunnelKeyCommand {
    /// Make a tunnel key for a reserved domain or port; prints only the key.
    Create {
        /// Host name or subdomain label of a reserved domain (http, tls).
        #[arg(long, required_unless_present = "port", conflicts_with = "port")]
        domain: Option<String>,
        /// A reserved port (tcp; udp with `--protocol udp`).
        #[arg(long)]
        port: Option<u16>,
        /// What the key publishes [default: http for --domain, tcp for
        /// --port]; `udp` binds the key to the UDP reservation of --port.
        #[arg(long, value_enum)]
        protocol: Option<Protocol>,
        /// A label to store with the key (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// List tunnel keys.
    List {
        /// Only those whose labels match, e.g. `k=v,k2!=v2`.
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Include revoked keys.
        #[arg(long)]
        all: bool,
    },
    /// Show one tunnel key.
    Show {
        /// The key's id (`tk_…`).
        id: String,
    },
    /// Revoke a tunnel key; its live connections are closed.
    Revoke {
        /// The key's id (`tk_…`).
        id: String,
    },
}

/// `culvert admin api-key ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum ApiKeyCommand {
    /// Make an API key; prints only the key.
    Create {
        /// What the key is for, e.g. "operator cluster-a".
        #[arg(long)]
        name: String,
        /// What the key may do.
        #[arg(long, value_enum)]
        scope: ApiKeyScope,
        /// A custom domain the (endpoints) key may reserve: that name and every
        /// name under it; `*` for any, and the edge's default host (repeatable).
        /// None: subdomains of the edge only.
        #[arg(long = "custom-domain")]
        custom_domains: Vec<String>,
        /// What the (endpoints) key may hold.
        #[command(flatten)]
        quota: QuotaArgs,
    },
    /// Change an endpoints key's quota (the limits given; the others stay) or
    /// its custom domains.
    Update {
        /// The key's id (`ak_…`).
        id: String,
        /// The limits to change.
        #[command(flatten)]
        quota: QuotaArgs,
        /// The custom domains the key may reserve, replacing its list
        /// (repeatable); `*` for any, and the edge's default host.
        #[arg(long = "custom-domain", conflicts_with = "no_custom_domains")]
        custom_domains: Vec<String>,
        /// Take every custom domain away from the key.
        #[arg(long)]
        no_custom_domains: bool,
    },
    /// List API keys.
    List,
    /// Show one API key.
    Show {
        /// The key's id (`ak_…`).
        id: String,
    },
    /// Revoke an API key (not the last admin key).
    Revoke {
        /// The key's id (`ak_…`).
        id: String,
    },
}

/// The quota of an endpoints key (`api-key create`, `api-key update`).
#[derive(Debug, Clone, Default, Args)]
pub struct QuotaArgs {
    /// Reservations (domains and ports together) the key may hold [default: 1000].
    #[arg(long, value_name = "N")]
    pub max_reservations: Option<u32>,
    /// Labels on one of its reservations or tunnel keys [default: 32].
    #[arg(long, value_name = "N")]
    pub max_labels: Option<u32>,
    /// Bytes of one record's labels, keys and values together [default: 4096].
    #[arg(long, value_name = "BYTES")]
    pub max_label_bytes: Option<u32>,
}

impl QuotaArgs {
    fn update(&self) -> QuotaUpdate {
        QuotaUpdate {
            reservations: self.max_reservations,
            labels: self.max_labels,
            label_bytes: self.max_label_bytes,
        }
    }
}

/// Errors of `culvert admin`.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No `--edge`.
    #[error("no edge given: pass --edge https://EDGE or set CULVERT_EDGE")]
    NoEdge,
    /// No `--key`.
    #[error("no API key given: pass --key-file FILE or set CULVERT_ADMIN_KEY (or CULVERT_KEY)")]
    NoKey,
    /// `--key-file` could not be read.
    #[error(transparent)]
    KeyFile(#[from] crate::secret::SecretError),
    /// The call of the control API failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Writing to stdout failed.
    #[error("failed to write the output: {0}")]
    Output(#[from] std::io::Error),
}

impl AdminError {
    /// Static category for logs.
    pub fn category(&self) -> &'static str {
        match self {
            AdminError::NoEdge | AdminError::NoKey => "usage",
            AdminError::KeyFile(e) => e.category(),
            AdminError::Client(e) => e.category(),
            AdminError::Output(_) => "output",
        }
    }
}

/// Runs one `culvert admin` command against the edge, printing to stdout.
pub fn run(args: AdminArgs) -> Result<(), AdminError> {
    let given = args.key.clone().or_else(|| std::env::var("CULVERT_KEY").ok());
    let key = crate::secret::key_from(given.as_deref(), args.key_file.as_deref(), "--key-file")?
        .ok_or(AdminError::NoKey)?;
    let edges: Vec<&str> = args
        .edge
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    if edges.is_empty() {
        return Err(AdminError::NoEdge);
    }
    let client = Client::with_edges(&edges, key.trim(), args.ca_file.as_deref(), true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    runtime.block_on(execute(&client, &args.command, args.output, &mut out))?;
    out.flush()?;
    Ok(())
}

fn labels_of(pairs: &[(String, String)]) -> Labels {
    pairs.iter().cloned().collect()
}

/// Runs one command with `client`, writing what it prints to `out`.
pub(crate) async fn execute(
    client: &Client,
    command: &AdminCommand,
    output: Output,
    out: &mut dyn Write,
) -> Result<(), AdminError> {
    let json_mode = output == Output::Json;
    let print_json = |out: &mut dyn Write, v: &Value| -> Result<(), AdminError> {
        writeln!(out, "{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()))?;
        Ok(())
    };
    let selector = |s: &Option<String>| -> Vec<(&'static str, String)> {
        s.iter().map(|s| ("selector", s.clone())).collect()
    };
    macro_rules! answer {
        ($call:expr) => {{
            let answer = $call.await?;
            if json_mode {
                return print_json(out, &answer.value);
            }
            answer
        }};
    }
    let get = |path: String, q: Vec<(&'static str, String)>| async move {
        let q: Vec<(&str, &str)> = q.iter().map(|(k, v)| (*k, v.as_str())).collect();
        client.get(&path, &q).await
    };
    match command {
        AdminCommand::Info => {
            let a = answer!(get("info".into(), vec![]));
            write!(out, "{}", info_table(&a.decode()?))?;
        }
        AdminCommand::Status { limit } => {
            let a = answer!(get("status".into(), vec![("limit", limit.to_string())]));
            write!(out, "{}", status_table(&a.decode()?))?;
        }
        AdminCommand::Domain(cmd) => match cmd {
            DomainCommand::Reserve { name, fqdn, labels } => {
                let request = ReserveDomainRequest {
                    name: name.clone(),
                    fqdn: fqdn.clone(),
                    labels: labels_of(labels),
                };
                let a = answer!(client.post("domains", &request));
                let created = a.created;
                let r: Reservation = a.decode()?;
                if !created {
                    eprintln!("note: this key already holds {}", r.target());
                }
                writeln!(out, "{}", r.target())?;
            }
            DomainCommand::List { selector: s } => {
                let a = answer!(get("domains".into(), selector(s)));
                let list: List<Reservation> = a.decode()?;
                write!(out, "{}", domains_table(&list.items))?;
            }
            DomainCommand::Show { host } => {
                let a = answer!(get(format!("domains/{}", segment(host)), vec![]));
                write!(out, "{}", domains_table(&[a.decode()?]))?;
            }
            DomainCommand::Release { host } => {
                let a = answer!(client.delete(&format!("domains/{}", segment(host))));
                write!(out, "{}", released(&a.decode()?))?;
            }
        },
        AdminCommand::Port(cmd) => match cmd {
            PortCommand::Reserve { port, protocol, labels, idle_timeout_seconds } => {
                let request = ReservePortRequest {
                    port: *port,
                    protocol: *protocol,
                    labels: labels_of(labels),
                    idle_timeout_seconds: *idle_timeout_seconds,
                };
                let a = answer!(client.post("ports", &request));
                let created = a.created;
                let r: Reservation = a.decode()?;
                if !created {
                    eprintln!("note: this key already holds {}", r.target());
                }
                writeln!(out, "{}", r.port.map(|p| p.to_string()).unwrap_or_default())?;
            }
            PortCommand::List { selector: s, protocol } => {
                let mut query = selector(s);
                if let Some(p) = protocol {
                    query.push(("protocol", p.as_str().to_string()));
                }
                let a = answer!(get("ports".into(), query));
                let list: List<Reservation> = a.decode()?;
                write!(out, "{}", ports_table(&list.items))?;
            }
            PortCommand::Show { port, protocol } => {
                let a = answer!(get(format!("ports/{port}"), protocol_query(*protocol)));
                write!(out, "{}", ports_table(&[a.decode()?]))?;
            }
            PortCommand::Release { port, protocol } => {
                let path = match protocol {
                    PortProtocol::Tcp => format!("ports/{port}"),
                    PortProtocol::Udp => format!("ports/{port}?protocol=udp"),
                };
                let a = answer!(client.delete(&path));
                write!(out, "{}", released(&a.decode()?))?;
            }
        },
        AdminCommand::TunnelKey(cmd) => match cmd {
            TunnelKeyCommand::Create { domain, port, protocol, labels } => {
                let request = CreateTunnelKeyRequest {
                    domain: domain.clone(),
                    port: *port,
                    protocol: *protocol,
                    labels: labels_of(labels),
                };
                let a = answer!(client.post("tunnel-keys", &request));
                let made: CreatedTunnelKey = a.decode()?;
                eprintln!(
                    "tunnel key {} publishes {} ({}); the key is shown only once",
                    made.key.id, made.url, made.key.protocol
                );
                writeln!(out, "{}", made.secret)?;
            }
            TunnelKeyCommand::List { selector: s, all } => {
                let mut q = selector(s);
                if *all {
                    q.push(("revoked", "true".into()));
                }
                let a = answer!(get("tunnel-keys".into(), q));
                let list: List<TunnelKey> = a.decode()?;
                write!(out, "{}", tunnel_keys_table(&list.items, *all))?;
            }
            TunnelKeyCommand::Show { id } => {
                let a = answer!(get(format!("tunnel-keys/{}", segment(id)), vec![]));
                write!(out, "{}", tunnel_keys_table(&[a.decode()?], true))?;
            }
            TunnelKeyCommand::Revoke { id } => {
                let a = answer!(client.delete(&format!("tunnel-keys/{}", segment(id))));
                let key: TunnelKey = a.decode()?;
                writeln!(out, "revoked tunnel key {} ({})", key.id, key.reservation.target())?;
            }
        },
        AdminCommand::ApiKey(cmd) => match cmd {
            ApiKeyCommand::Create { name, scope, custom_domains, quota } => {
                let request = CreateApiKeyRequest {
                    name: name.clone(),
                    scope: *scope,
                    custom_domains: custom_domains.clone(),
                    quota: quota.update(),
                };
                let a = answer!(client.post("api-keys", &request));
                let made: CreatedApiKey = a.decode()?;
                eprintln!(
                    "{} key {} ({}); the key is shown only once",
                    made.key.scope, made.key.id, made.key.name
                );
                writeln!(out, "{}", made.secret)?;
            }
            ApiKeyCommand::Update { id, quota, custom_domains, no_custom_domains } => {
                let custom_domains =
                    (*no_custom_domains || !custom_domains.is_empty()).then(|| custom_domains.clone());
                let request = UpdateApiKeyRequest { quota: quota.update(), custom_domains };
                let a = answer!(client.patch(&format!("api-keys/{}", segment(id)), &request));
                write!(out, "{}", api_keys_table(&[a.decode()?]))?;
            }
            ApiKeyCommand::List => {
                let a = answer!(get("api-keys".into(), vec![]));
                let list: List<ApiKey> = a.decode()?;
                write!(out, "{}", api_keys_table(&list.items))?;
            }
            ApiKeyCommand::Show { id } => {
                let a = answer!(get(format!("api-keys/{}", segment(id)), vec![]));
                write!(out, "{}", api_keys_table(&[a.decode()?]))?;
            }
            ApiKeyCommand::Revoke { id } => {
                let a = answer!(client.delete(&format!("api-keys/{}", segment(id))));
                let key: ApiKey = a.decode()?;
                writeln!(out, "revoked api key {} ({})", key.id, key.name)?;
            }
        },
    }
    Ok(())
}

/// Renders aligned columns: a header row, then one line per row; columns are
/// separated by two spaces and the last one is not padded.
pub(crate) fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate().take(widths.len()) {
            if i + 1 == widths.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn labels_cell(labels: &Labels) -> String {
    if labels.is_empty() {
        return "-".into();
    }
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// The status document as two tables: the edge, then one line per tunnel.
fn status_table(s: &crate::edge::status::model::Status) -> String {
    use crate::edge::status::page::{bytes, duration};
    let e = &s.edge;
    let usage = |u: &crate::edge::status::model::Usage, f: &dyn Fn(u64) -> String| match (u.used, u.budget) {
        (Some(used), Some(budget)) => format!("{} of {}", f(used), f(budget)),
        (Some(used), None) => format!("{} (no limit)", f(used)),
        (None, _) => "unknown".into(),
    };
    let mut listeners: Vec<String> =
        e.listeners.iter().map(|l| format!("{} {}", l.name, l.address)).collect();
    listeners.push(format!("{} tcp", e.tcp_listeners));
    let store = match &e.store.error {
        None => format!("{} ok ({:.1} ms)", e.store.engine, e.store.latency_ms),
        Some(err) => format!("{} FAILING: {err}", e.store.engine),
    };
    let mut rows = vec![
        vec!["domain".into(), e.domain.clone()],
        vec!["version".into(), format!("{} (tunnel protocol {})", e.version, e.protocol_version)],
        vec![
            "uptime".into(),
            format!(
                "{} since {}{}",
                duration(e.uptime_seconds),
                e.started_at,
                if e.draining { " (draining)" } else { "" }
            ),
        ],
        vec!["listeners".into(), listeners.join(", ")],
        vec!["open files".into(), usage(&e.fds, &|n| n.to_string())],
        vec!["memory".into(), usage(&e.memory, &|n| bytes(n as f64))],
        vec!["store".into(), store],
        vec!["agents".into(), format!("{} connected, {} streams open", e.agents_connected, e.streams_open)],
    ];
    if let Some(acme) = &e.acme {
        rows.push(vec!["acme in flight".into(), format!("{}", acme.in_flight.len())]);
        for err in &acme.errors {
            rows.push(vec!["acme error".into(), format!("{}: {}", err.hostname, err.error)]);
        }
    }
    let mut out = render_table(&["EDGE", "VALUE"], &rows);
    out.push('\n');
    let tunnels: Vec<Vec<String>> = s
        .tunnels
        .iter()
        .map(|t| {
            let x = &t.totals;
            vec![
                t.name.clone(),
                t.kind.to_string(),
                t.agents_connected.to_string(),
                t.streams_open.to_string(),
                x.requests.to_string(),
                format!("{:.1}", t.rates.requests),
                bytes(x.bytes_in as f64),
                bytes(x.bytes_out as f64),
                format!("{}/{}/{}", x.errors4xx, x.errors5xx, x.offline),
                t.certificate.as_ref().map(|c| c.status.to_string()).unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    out.push_str(&render_table(
        &[
            "TUNNEL",
            "KIND",
            "AGENTS",
            "STREAMS",
            "REQUESTS",
            "REQ/S",
            "IN",
            "OUT",
            "4XX/5XX/OFFLINE",
            "CERTIFICATE",
        ],
        &tunnels,
    ));
    if s.tunnels_shown < s.tunnels_total {
        out.push_str(&format!(
            "({} of {} tunnels shown; --limit shows more)\n",
            s.tunnels_shown, s.tunnels_total
        ));
    }
    out
}

fn info_table(info: &Info) -> String {
    let rows = vec![
        vec!["domain".into(), info.domain.clone()],
        vec!["version".into(), info.version.clone()],
        vec![
            "protocol".into(),
            format!("{} (accepts agents from {})", info.protocol_version, info.min_protocol_version),
        ],
        vec!["tcp ports".into(), info.tcp_ports.to_string()],
        vec!["public host".into(), info.public_host.clone()],
        vec!["https port".into(), info.public_https_port.to_string()],
        vec!["your key".into(), format!("{} ({}, {})", info.caller.id, info.caller.scope, info.caller.name)],
    ];
    render_table(&["FIELD", "VALUE"], &rows)
}

/// Domains; with certificate status, expiry and last error when the edge
/// orders certificates (`--acme`).
fn domains_table(items: &[Reservation]) -> String {
    let certificates = items.iter().any(|r| r.certificate.is_some());
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|r| {
            let mut row = vec![
                r.hostname.clone().unwrap_or_default(),
                if r.is_default_host() { "default host".into() } else { r.kind.to_string() },
                r.owner.clone(),
                labels_cell(&r.labels),
                r.created_at.clone(),
            ];
            if certificates {
                let c = r.certificate.as_ref();
                row.push(c.map_or("-".into(), |c| c.status.to_string()));
                row.push(c.and_then(|c| c.not_after.clone()).unwrap_or_else(|| "-".into()));
                row.push(c.and_then(|c| c.last_error.clone()).unwrap_or_else(|| "-".into()));
            }
            row
        })
        .collect();
    let mut headers = vec!["HOSTNAME", "KIND", "OWNER", "LABELS", "CREATED"];
    if certificates {
        headers.extend(["CERTIFICATE", "EXPIRES", "LAST ERROR"]);
    }
    render_table(&headers, &rows)
}

/// `?protocol=udp` for a UDP port, nothing for TCP (what older edges know).
fn protocol_query(protocol: PortProtocol) -> Vec<(&'static str, String)> {
    match protocol {
        PortProtocol::Tcp => vec![],
        PortProtocol::Udp => vec![("protocol", "udp".to_string())],
    }
}

fn ports_table(items: &[Reservation]) -> String {
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|r| {
            vec![
                r.port.map(|p| p.to_string()).unwrap_or_default(),
                r.protocol.to_string(),
                r.url.clone().unwrap_or_default(),
                r.owner.clone(),
                r.idle_timeout_seconds.map_or_else(|| "-".into(), |s| format!("{s}s")),
                labels_cell(&r.labels),
                r.created_at.clone(),
            ]
        })
        .collect();
    render_table(&["PORT", "PROTOCOL", "ADDRESS", "OWNER", "IDLE TIMEOUT", "LABELS", "CREATED"], &rows)
}

fn tunnel_keys_table(items: &[TunnelKey], with_revoked: bool) -> String {
    let mut headers = vec!["ID", "PROTOCOL", "RESERVATION", "CONNECTIONS", "LABELS", "CREATED"];
    if with_revoked {
        headers.push("REVOKED");
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|k| {
            let mut row = vec![
                k.id.clone(),
                k.protocol.to_string(),
                k.reservation.target(),
                k.connections.to_string(),
                labels_cell(&k.labels),
                k.created_at.clone(),
            ];
            if with_revoked {
                row.push(k.revoked_at.clone().unwrap_or_else(|| "-".into()));
            }
            row
        })
        .collect();
    render_table(&headers, &rows)
}

fn api_keys_table(items: &[ApiKey]) -> String {
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|k| {
            vec![
                k.id.clone(),
                k.name.clone(),
                k.scope.to_string(),
                k.quota.map_or_else(
                    || "-".into(),
                    |q| {
                        format!(
                            "{} reservations, {} labels, {} label bytes",
                            q.reservations, q.labels, q.label_bytes
                        )
                    },
                ),
                if k.custom_domains.is_empty() { "-".into() } else { k.custom_domains.join(",") },
                k.created_at.clone(),
                k.revoked_at.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    render_table(&["ID", "NAME", "SCOPE", "QUOTA", "CUSTOM DOMAINS", "CREATED", "REVOKED"], &rows)
}

fn released(r: &ReleaseResponse) -> String {
    let n = r.revoked_tunnel_keys.len();
    let keys = match n {
        0 => "no tunnel keys".to_string(),
        1 => "1 tunnel key".to_string(),
        n => format!("{n} tunnel keys"),
    };
    format!("released {}; revoked {keys}\n", r.reservation.target())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ReservationKind, ReservationRef};

    #[test]
    fn tables_are_aligned() {
        let t = render_table(
            &["ID", "NAME", "SCOPE"],
            &[
                vec!["ak_1".into(), "initial admin key".into(), "admin".into()],
                vec!["ak_22".into(), "op".into(), "endpoints".into()],
            ],
        );
        assert_eq!(
            t,
            "ID     NAME               SCOPE\n\
             ak_1   initial admin key  admin\n\
             ak_22  op                 endpoints\n"
        );
        assert_eq!(render_table(&["A", "B"], &[]), "A  B\n");
        // Trailing empty cells leave no trailing spaces.
        assert_eq!(render_table(&["A", "B"], &[vec!["x".into(), String::new()]]), "A  B\nx\n");
    }

    #[test]
    fn record_tables() {
        let key = TunnelKey {
            id: "tk_0123456789ab".into(),
            protocol: Protocol::Tcp,
            reservation: ReservationRef {
                id: "rs_1".into(),
                kind: ReservationKind::Tcp,
                hostname: None,
                port: Some(20017),
                protocol: Default::default(),
            },
            labels: [("cluster".to_string(), "c1".to_string())].into(),
            owner: "ak_1".into(),
            created_at: "2025-01-01T00:00:00Z".into(),
            revoked_at: None,
            connections: 2,
        };
        let t = tunnel_keys_table(&[key], false);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "ID               PROTOCOL  RESERVATION  CONNECTIONS  LABELS      CREATED");
        assert_eq!(
            lines[1],
            "tk_0123456789ab  tcp       port 20017   2            cluster=c1  2025-01-01T00:00:00Z"
        );
        let released = released(&ReleaseResponse {
            reservation: Reservation {
                id: "rs_1".into(),
                kind: ReservationKind::Subdomain,
                hostname: Some("blog.example.com".into()),
                port: None,
                protocol: Default::default(),
                labels: Labels::new(),
                owner: "ak_1".into(),
                created_at: "x".into(),
                url: None,
                certificate: None,
                idle_timeout_seconds: None,
            },
            revoked_tunnel_keys: vec!["tk_1".into()],
        });
        assert_eq!(released, "released blog.example.com; revoked 1 tunnel key\n");
    }

    #[test]
    fn request_bodies_say_only_what_was_given() {
        use serde_json::json;
        let domain = ReserveDomainRequest { name: Some("a".into()), ..Default::default() };
        assert_eq!(body(&domain), json!({"name": "a"}));
        let port =
            ReservePortRequest { labels: labels_of(&[("k".into(), "v".into())]), ..Default::default() };
        assert_eq!(body(&port), json!({"labels": {"k": "v"}}));
        let key =
            CreateTunnelKeyRequest { port: Some(20000), protocol: Some(Protocol::Tcp), ..Default::default() };
        assert_eq!(body(&key), json!({"port": 20000, "protocol": "tcp"}));
    }

    fn body(request: &impl serde::Serialize) -> Value {
        serde_json::to_value(request).unwrap()
    }

    #[test]
    fn error_messages() {
        let e = ClientError::Refused {
            status: 409,
            code: "already_reserved".into(),
            message: "domain blog.example.com is held by another key; reserve another name".into(),
        };
        assert_eq!(
            e.to_string(),
            "edge refused: already_reserved: domain blog.example.com is held by another key; reserve another name"
        );
    }

    struct Hooks;
    impl crate::edge::api::EdgeHooks for Hooks {
        fn state_changed(&self) -> futures_util::future::BoxFuture<'_, ()> {
            Box::pin(std::future::ready(()))
        }
        fn connections_for_key(&self, _: &str) -> usize {
            0
        }
    }

    /// Serves the real API handler on 127.0.0.1 (plain HTTP, or TLS with
    /// `tls`); returns its address, the first admin key and the runtime.
    fn serve_api(
        tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    ) -> (std::net::SocketAddr, String, tokio::runtime::Runtime, tempfile::TempDir) {
        use std::sync::Arc;

        use hyper::server::conn::http1;
        use hyper::service::service_fn;
        use hyper_util::rt::TokioIo;

        use crate::api::PortRange;
        use crate::edge::api::ApiContext;
        use crate::edge::store::Store;

        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let admin = store.engine().ensure_admin_key().unwrap().unwrap();
        let ctx = ApiContext {
            store,
            domain: "edge.test".into(),
            public_host: "edge.test".into(),
            public_https_port: 443,
            tcp_ports: PortRange { first: 20000, last: 20009 },
            acme: true,
            hooks: Arc::new(Hooks),
            reserved_names: crate::edge::api::RESERVED_NAMES.iter().map(|n| n.to_string()).collect(),
            serial: Default::default(),
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let ctx = ctx.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let ctx = ctx.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                crate::edge::api::handle(&ctx, req).await,
                            )
                        }
                    });
                    match acceptor {
                        None => {
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                    }
                });
            }
        });
        (addr, admin, runtime, dir)
    }

    /// Parses `culvert admin ARGS` and runs it, returning stdout.
    fn run_args(client: &Client, args: &[&str]) -> Result<String, AdminError> {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            admin: AdminArgs,
        }
        let parsed = T::try_parse_from(std::iter::once("admin").chain(args.iter().copied())).unwrap();
        let mut out = Vec::new();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(execute(client, &parsed.admin.command, parsed.admin.output, &mut out))?;
        Ok(String::from_utf8(out).unwrap())
    }

    /// The client against the real handler, over plain HTTP on 127.0.0.1.
    #[test]
    fn end_to_end_over_http() {
        let (addr, admin, runtime, _dir) = serve_api(None);
        let edge = format!("http://{addr}");
        let admin_client = Client::new(&edge, &admin, None, false).unwrap();
        let run = run_args;

        assert!(run(&admin_client, &["info"]).unwrap().contains("edge.test"));
        assert_eq!(
            run(&admin_client, &["domain", "reserve", "blog", "--label", "a=b"]).unwrap(),
            "blog.edge.test\n"
        );
        assert_eq!(run(&admin_client, &["domain", "reserve", "blog"]).unwrap(), "blog.edge.test\n");
        // This edge runs with ACME: custom domains show their certificate.
        assert_eq!(
            run(&admin_client, &["domain", "reserve", "--fqdn", "app.example.org"]).unwrap(),
            "app.example.org\n"
        );
        let list = run(&admin_client, &["domain", "list"]).unwrap();
        let lines: Vec<&str> = list.lines().collect();
        let cells = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(cells(lines[0])[5..], ["CERTIFICATE", "EXPIRES", "LAST", "ERROR"], "{list}");
        let app = cells(lines.iter().find(|l| l.starts_with("app.example.org")).expect("listed"));
        assert_eq!((app[1].as_str(), &app[5..]), ("custom", &["pending", "-", "-"].map(String::from)[..]));
        let blog = cells(lines.iter().find(|l| l.starts_with("blog.edge.test")).expect("listed"));
        assert_eq!(blog[5..], ["-", "-", "-"], "{list}");
        assert_eq!(run(&admin_client, &["port", "reserve"]).unwrap(), "20000\n");
        let secret =
            run(&admin_client, &["tunnel-key", "create", "--domain", "blog", "--protocol", "http"]).unwrap();
        assert!(secret.starts_with("culvert_t_") && secret.lines().count() == 1, "{secret}");
        let json_out =
            run(&admin_client, &["-o", "json", "tunnel-key", "create", "--port", "20000"]).unwrap();
        let v: Value = serde_json::from_str(&json_out).unwrap();
        assert_eq!(v["protocol"], "tcp");
        // UDP 20000 is a reservation of its own, with its own key.
        assert_eq!(
            run(&admin_client, &["port", "reserve", "--protocol", "udp", "20000"]).unwrap(),
            "20000\n"
        );
        let json_out = run(
            &admin_client,
            &["-o", "json", "tunnel-key", "create", "--port", "20000", "--protocol", "udp"],
        )
        .unwrap();
        let v: Value = serde_json::from_str(&json_out).unwrap();
        assert_eq!(
            (&v["protocol"], &v["reservation"]["protocol"]),
            (&serde_json::json!("udp"), &serde_json::json!("udp"))
        );
        let ports = run(&admin_client, &["port", "list"]).unwrap();
        let rows: Vec<Vec<&str>> = ports.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(rows[0][..3], ["PORT", "PROTOCOL", "ADDRESS"], "{ports}");
        assert_eq!(rows[1..].iter().map(|r| r[1]).collect::<Vec<_>>(), ["tcp", "udp"], "{ports}");
        let udp = run(&admin_client, &["port", "list", "--protocol", "udp"]).unwrap();
        assert_eq!(udp.lines().count(), 2, "{udp}");
        assert!(
            run(&admin_client, &["port", "show", "20000", "--protocol", "udp"]).unwrap().contains("udp://")
        );
        assert!(
            run(&admin_client, &["port", "release", "20000", "--protocol", "udp"])
                .unwrap()
                .contains("udp port 20000")
        );
        let list = run(&admin_client, &["tunnel-key", "list", "--all"]).unwrap();
        assert_eq!(list.lines().count(), 4, "{list}");
        let list = run(&admin_client, &["tunnel-key", "list"]).unwrap();
        assert_eq!(list.lines().count(), 3, "{list}");
        assert!(list.lines().next().unwrap().starts_with("ID "));
        let list = run(&admin_client, &["tunnel-key", "list", "--selector", "nope"]).unwrap();
        assert_eq!(list.lines().count(), 1, "{list}");
        let ep = run(&admin_client, &["api-key", "create", "--name", "op", "--scope", "endpoints"]).unwrap();
        let ep_client = Client::new(&edge, ep.trim(), None, false).unwrap();
        let err = run(&ep_client, &["domain", "reserve", "blog"]).unwrap_err();
        assert_eq!(err.category(), "refused");
        assert!(
            err.to_string()
                .starts_with("edge refused: already_reserved: domain blog.edge.test is held by another key"),
            "{err}"
        );
        let err = run(&ep_client, &["api-key", "list"]).unwrap_err();
        assert!(
            matches!(&err, AdminError::Client(ClientError::Refused { status: 403, code, .. }) if code == "admin_required"),
            "{err}"
        );
        let tunnel_client = Client::new(&edge, secret.trim(), None, false).unwrap();
        let err = run(&tunnel_client, &["info"]).unwrap_err();
        assert!(
            matches!(&err, AdminError::Client(ClientError::Refused { code, .. }) if code == "tunnel_key_not_allowed"),
            "{err}"
        );
        assert_eq!(
            run(&admin_client, &["domain", "release", "blog"]).unwrap(),
            "released blog.edge.test; revoked 1 tunnel key\n"
        );

        // Quotas (issue 18 item 7) and a port's own idle timeout (item 2).
        let tenant = run(
            &admin_client,
            &["api-key", "create", "--name", "t", "--scope", "endpoints", "--max-reservations", "1"],
        )
        .unwrap();
        let tenant = Client::new(&edge, tenant.trim(), None, false).unwrap();
        let info = run(&tenant, &["-o", "json", "info"]).unwrap();
        let info: Value = serde_json::from_str(&info).unwrap();
        let id = info["caller"]["id"].as_str().unwrap().to_string();
        assert_eq!(info["caller"]["quota"]["reservations"], 1);
        assert_eq!(run(&tenant, &["port", "reserve", "--idle-timeout-seconds", "90"]).unwrap(), "20001\n");
        let ports = run(&tenant, &["port", "list"]).unwrap();
        assert!(ports.lines().next().unwrap().contains("IDLE TIMEOUT") && ports.contains(" 90s "), "{ports}");
        let err = run(&tenant, &["domain", "reserve", "more"]).unwrap_err();
        assert!(
            err.to_string().contains("quota_exceeded") && err.to_string().contains("--max-reservations"),
            "{err}"
        );
        let updated =
            run(&admin_client, &["api-key", "update", &id, "--max-reservations", "2", "--max-labels", "3"])
                .unwrap();
        assert!(updated.contains("2 reservations, 3 labels, 4096 label bytes"), "{updated}");
        assert_eq!(run(&tenant, &["domain", "reserve", "more"]).unwrap(), "more.edge.test\n");

        // Nothing listening: the error names the URL.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let nobody = Client::new(&format!("http://{closed_addr}"), &admin, None, false).unwrap();
        let err = run(&nobody, &["info"]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("failed to reach http://{closed_addr}/_culvert/v1/api/info")),
            "{err}"
        );
        runtime.shutdown_background();
    }

    /// A self-signed edge: refused without --ca-file (with a hint), trusted with it.
    #[test]
    fn self_signed_edge_needs_ca_file() {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};

        let pki = crate::tls::generate_pki(&["127.0.0.1".to_string()]).unwrap();
        let certs =
            CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap();
        let key = PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let (addr, admin, runtime, dir) = serve_api(Some(std::sync::Arc::new(config)));
        let edge = format!("https://{addr}");

        let untrusted = Client::new(&edge, &admin, None, false).unwrap();
        let err = run_args(&untrusted, &["info"]).unwrap_err();
        assert_eq!(err.category(), "connect");
        let message = err.to_string();
        assert!(message.starts_with(&format!("failed to reach {edge}/_culvert/v1/api/info")), "{message}");
        assert!(message.contains("--ca-file"), "{message}");

        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        let trusted = Client::new(&edge, &admin, Some(&ca), false).unwrap();
        assert!(run_args(&trusted, &["info"]).unwrap().contains("edge.test"));
        assert!(matches!(
            Client::new(&edge, &admin, Some(&dir.path().join("missing.pem")), false),
            Err(ClientError::CaFile(_))
        ));
        runtime.shutdown_background();
    }
}
