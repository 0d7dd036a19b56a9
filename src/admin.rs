//! `culvert admin`: a small blocking client of the control API (ureq).
//!
//! Tables for humans on stdout; `-o json` prints the edge's JSON answer as is.
//! Commands that make a secret (`tunnel-key create`, `api-key create`) print
//! only the secret in table mode, so `KEY=$(culvert admin ...)` works; what
//! was made is told on stderr.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::api::{
    ApiKey, ApiKeyScope, CreatedApiKey, CreatedTunnelKey, ErrorBody, Info, Labels, List, Protocol,
    ReleaseResponse, Reservation, TunnelKey, parse_label,
};
use crate::constants::{API_CLIENT_TIMEOUT, API_PREFIX};

/// `culvert admin`: manage API keys, domains, ports and tunnel keys on an edge.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The edge's URL, e.g. https://edge.example.com.
    #[arg(long, global = true, env = "CULVERT_EDGE")]
    pub edge: Option<String>,

    /// An admin or endpoints API key (falls back to CULVERT_KEY).
    #[arg(long, global = true, env = "CULVERT_ADMIN_KEY", hide_env_values = true)]
    pub key: Option<String>,

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
        /// A full host name pointed at the edge by CNAME.
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
    /// Reserve a TCP port (the lowest free one unless given); prints the port.
    Reserve {
        /// A port within the edge's range.
        port: Option<u16>,
        /// A label to store with the reservation (repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// List reserved ports.
    List {
        /// Only those whose labels match, e.g. `k=v,k2!=v2`.
        #[arg(long, short = 'l')]
        selector: Option<String>,
    },
    /// Show one port.
    Show {
        /// The port.
        port: u16,
    },
    /// Release a port; its tunnel keys are revoked.
    Release {
        /// The port.
        port: u16,
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
        /// A reserved TCP port (tcp).
        #[arg(long)]
        port: Option<u16>,
        /// What the key publishes [default: http for --domain, tcp for --port].
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

/// Errors of `culvert admin`.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No `--edge`.
    #[error("no edge given: pass --edge https://EDGE or set CULVERT_EDGE")]
    NoEdge,
    /// No `--key`.
    #[error("no API key given: pass --key or set CULVERT_ADMIN_KEY (or CULVERT_KEY)")]
    NoKey,
    /// `--edge` is not a URL we can use.
    #[error("--edge `{0}` is not a URL like https://edge.example.com")]
    BadEdge(String),
    /// `--ca-file` could not be loaded.
    #[error("failed to load --ca-file: {0}")]
    CaFile(#[source] crate::tls::TlsError),
    /// The request did not get an answer.
    #[error("failed to reach {url}: {source}{hint}")]
    Connect {
        /// The URL asked for.
        url: String,
        /// Why.
        #[source]
        source: ureq::Error,
        /// What to try, if we can tell.
        hint: &'static str,
    },
    /// The edge answered with a culvert error.
    #[error("edge refused: {code}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The error code, e.g. `already_reserved`.
        code: String,
        /// The edge's message.
        message: String,
    },
    /// The answer is not what a culvert edge sends.
    #[error(
        "{url} answered {status} with something that is not a culvert answer ({detail}); is --edge the URL of a culvert edge?"
    )]
    UnexpectedAnswer {
        /// The URL asked for.
        url: String,
        /// HTTP status.
        status: u16,
        /// What was wrong with it.
        detail: String,
    },
    /// Writing to stdout failed.
    #[error("failed to write the output: {0}")]
    Output(#[from] std::io::Error),
}

impl AdminError {
    /// Static category for logs.
    pub fn category(&self) -> &'static str {
        match self {
            AdminError::NoEdge | AdminError::NoKey | AdminError::BadEdge(_) => "usage",
            AdminError::CaFile(_) => "ca_file",
            AdminError::Connect { .. } => "connect",
            AdminError::Refused { .. } => "refused",
            AdminError::UnexpectedAnswer { .. } => "unexpected_answer",
            AdminError::Output(_) => "output",
        }
    }
}

/// Runs one `culvert admin` command against the edge, printing to stdout.
pub fn run(args: AdminArgs) -> Result<(), AdminError> {
    let key = args
        .key
        .clone()
        .or_else(|| std::env::var("CULVERT_KEY").ok())
        .filter(|k| !k.trim().is_empty())
        .ok_or(AdminError::NoKey)?;
    let edge = args.edge.as_deref().filter(|e| !e.trim().is_empty()).ok_or(AdminError::NoEdge)?;
    let client = Client::new(edge, key.trim(), args.ca_file.as_deref(), true)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    execute(&client, &args.command, args.output, &mut out)?;
    out.flush()?;
    Ok(())
}

/// A blocking client of one edge's control API.
pub struct Client {
    agent: ureq::Agent,
    base: String,
    key: String,
}

impl Client {
    /// A client of the edge at `edge` (`https://host[:port]`; `https://` is
    /// assumed when no scheme is given) using `key`. `ca_file` replaces the
    /// built-in Mozilla roots; `proxy_from_env` honours `HTTPS_PROXY`/`NO_PROXY`.
    pub fn new(
        edge: &str,
        key: &str,
        ca_file: Option<&std::path::Path>,
        proxy_from_env: bool,
    ) -> Result<Client, AdminError> {
        let given = edge.trim();
        let (scheme, authority) = given.split_once("://").unwrap_or(("https", given));
        let authority = authority.trim_end_matches('/');
        if !matches!(scheme, "https" | "http")
            || authority.is_empty()
            || authority.contains(['/', '?', '#', ' ', '@'])
        {
            return Err(AdminError::BadEdge(given.to_string()));
        }
        let edge = format!("{scheme}://{authority}");
        let roots = match ca_file {
            Some(path) => {
                let certs = crate::tls::load_pem_certs(path).map_err(AdminError::CaFile)?;
                let certs: Vec<ureq::tls::Certificate<'static>> =
                    certs.iter().map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned()).collect();
                ureq::tls::RootCerts::new_with_certs(&certs)
            }
            None => ureq::tls::RootCerts::WebPki,
        };
        let tls = ureq::tls::TlsConfig::builder().root_certs(roots).build();
        let mut config = ureq::Agent::config_builder()
            .tls_config(tls)
            .http_status_as_error(false)
            .timeout_global(Some(API_CLIENT_TIMEOUT))
            .user_agent(format!("culvert-admin/{}", env!("CARGO_PKG_VERSION")));
        if !proxy_from_env {
            config = config.proxy(None);
        }
        let agent = ureq::Agent::new_with_config(config.build());
        Ok(Client { agent, base: format!("{edge}{API_PREFIX}"), key: key.to_string() })
    }

    /// `GET <path>` with query parameters; the JSON answer.
    pub fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, AdminError> {
        let url = self.url(path);
        let mut request = self.agent.get(&url).header("authorization", self.bearer());
        for (k, v) in query {
            request = request.query(*k, *v);
        }
        self.answer(&url, request.call())
    }

    /// `POST <path>` with a JSON body; the JSON answer and whether it was 201.
    pub fn post(&self, path: &str, body: &impl Serialize) -> Result<(Value, bool), AdminError> {
        let url = self.url(path);
        let result = self.agent.post(&url).header("authorization", self.bearer()).send_json(body);
        let created = matches!(&result, Ok(r) if r.status().as_u16() == 201);
        Ok((self.answer(&url, result)?, created))
    }

    /// `DELETE <path>`; the JSON answer.
    pub fn delete(&self, path: &str) -> Result<Value, AdminError> {
        let url = self.url(path);
        let result = self.agent.delete(&url).header("authorization", self.bearer()).call();
        self.answer(&url, result)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.key)
    }

    fn answer(
        &self,
        url: &str,
        result: Result<http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, AdminError> {
        let mut response = result.map_err(|source| {
            let hint = if is_tls_error(&source) {
                "; if the edge uses a self-signed certificate (culvert edge --self-signed), pass --ca-file with its CA (DATA_DIR/ca.pem)"
            } else {
                ""
            };
            AdminError::Connect { url: url.to_string(), source, hint }
        })?;
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().map_err(|source| AdminError::Connect {
            url: url.to_string(),
            source,
            hint: "",
        })?;
        let unexpected =
            |detail: String| AdminError::UnexpectedAnswer { url: url.to_string(), status, detail };
        if status >= 400 {
            let body: ErrorBody = serde_json::from_str(&text).map_err(|_| unexpected(snippet(&text)))?;
            return Err(AdminError::Refused { status, code: body.error.code, message: body.error.message });
        }
        if !(200..300).contains(&status) {
            return Err(unexpected(snippet(&text)));
        }
        serde_json::from_str(&text).map_err(|e| unexpected(format!("not JSON: {e}")))
    }
}

fn snippet(text: &str) -> String {
    let t: String = text.trim().chars().take(80).collect();
    if t.is_empty() { "an empty body".into() } else { format!("body starts with {t:?}") }
}

pub(crate) fn is_tls_error(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) | ureq::Error::Pem(_) => true,
        ureq::Error::Io(io) => {
            io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>())
                || io.to_string().to_ascii_lowercase().contains("certificate")
        }
        _ => false,
    }
}

/// Escapes a path segment (host names and ids never need it; stray input must not change the path).
fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.trim().bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn labels_of(pairs: &[(String, String)]) -> Labels {
    pairs.iter().cloned().collect()
}

fn decode<T: DeserializeOwned>(value: Value) -> Result<T, AdminError> {
    serde_json::from_value(value).map_err(|e| AdminError::UnexpectedAnswer {
        url: "the edge".into(),
        status: 200,
        detail: format!("unexpected JSON: {e}"),
    })
}

/// Runs one command with `client`, writing what it prints to `out`.
pub fn execute(
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
    match command {
        AdminCommand::Info => {
            let v = client.get("info", &[])?;
            if json_mode {
                return print_json(out, &v);
            }
            write!(out, "{}", info_table(&decode(v)?))?;
        }
        AdminCommand::Domain(cmd) => match cmd {
            DomainCommand::Reserve { name, fqdn, labels } => {
                let body = json!({"name": name, "fqdn": fqdn, "labels": labels_of(labels)});
                let body = strip_nulls(body);
                let (v, created) = client.post("domains", &body)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let r: Reservation = decode(v)?;
                if !created {
                    eprintln!("note: this key already holds {}", r.target());
                }
                writeln!(out, "{}", r.target())?;
            }
            DomainCommand::List { selector } => {
                let query: Vec<(&str, &str)> = selector.iter().map(|s| ("selector", s.as_str())).collect();
                let v = client.get("domains", &query)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let list: List<Reservation> = decode(v)?;
                write!(out, "{}", domains_table(&list.items))?;
            }
            DomainCommand::Show { host } => {
                let v = client.get(&format!("domains/{}", segment(host)), &[])?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", domains_table(&[decode(v)?]))?;
            }
            DomainCommand::Release { host } => {
                let v = client.delete(&format!("domains/{}", segment(host)))?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", released(&decode(v)?))?;
            }
        },
        AdminCommand::Port(cmd) => match cmd {
            PortCommand::Reserve { port, labels } => {
                let body = strip_nulls(json!({"port": port, "labels": labels_of(labels)}));
                let (v, created) = client.post("ports", &body)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let r: Reservation = decode(v)?;
                if !created {
                    eprintln!("note: this key already holds {}", r.target());
                }
                writeln!(out, "{}", r.port.map(|p| p.to_string()).unwrap_or_default())?;
            }
            PortCommand::List { selector } => {
                let query: Vec<(&str, &str)> = selector.iter().map(|s| ("selector", s.as_str())).collect();
                let v = client.get("ports", &query)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let list: List<Reservation> = decode(v)?;
                write!(out, "{}", ports_table(&list.items))?;
            }
            PortCommand::Show { port } => {
                let v = client.get(&format!("ports/{port}"), &[])?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", ports_table(&[decode(v)?]))?;
            }
            PortCommand::Release { port } => {
                let v = client.delete(&format!("ports/{port}"))?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", released(&decode(v)?))?;
            }
        },
        AdminCommand::TunnelKey(cmd) => match cmd {
            TunnelKeyCommand::Create { domain, port, protocol, labels } => {
                let body = strip_nulls(json!({
                    "domain": domain,
                    "port": port,
                    "protocol": protocol,
                    "labels": labels_of(labels),
                }));
                let (v, _) = client.post("tunnel-keys", &body)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let made: CreatedTunnelKey = decode(v)?;
                eprintln!(
                    "tunnel key {} publishes {} ({}); the key is shown only once",
                    made.key.id, made.url, made.key.protocol
                );
                writeln!(out, "{}", made.secret)?;
            }
            TunnelKeyCommand::List { selector, all } => {
                let mut query: Vec<(&str, &str)> =
                    selector.iter().map(|s| ("selector", s.as_str())).collect();
                if *all {
                    query.push(("revoked", "true"));
                }
                let v = client.get("tunnel-keys", &query)?;
                if json_mode {
                    return print_json(out, &v);
                }
                let list: List<TunnelKey> = decode(v)?;
                write!(out, "{}", tunnel_keys_table(&list.items, *all))?;
            }
            TunnelKeyCommand::Show { id } => {
                let v = client.get(&format!("tunnel-keys/{}", segment(id)), &[])?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", tunnel_keys_table(&[decode(v)?], true))?;
            }
            TunnelKeyCommand::Revoke { id } => {
                let v = client.delete(&format!("tunnel-keys/{}", segment(id)))?;
                if json_mode {
                    return print_json(out, &v);
                }
                let key: TunnelKey = decode(v)?;
                writeln!(out, "revoked tunnel key {} ({})", key.id, key.reservation.target())?;
            }
        },
        AdminCommand::ApiKey(cmd) => match cmd {
            ApiKeyCommand::Create { name, scope } => {
                let (v, _) = client.post("api-keys", &json!({"name": name, "scope": scope}))?;
                if json_mode {
                    return print_json(out, &v);
                }
                let made: CreatedApiKey = decode(v)?;
                eprintln!(
                    "{} key {} ({}); the key is shown only once",
                    made.key.scope, made.key.id, made.key.name
                );
                writeln!(out, "{}", made.secret)?;
            }
            ApiKeyCommand::List => {
                let v = client.get("api-keys", &[])?;
                if json_mode {
                    return print_json(out, &v);
                }
                let list: List<ApiKey> = decode(v)?;
                write!(out, "{}", api_keys_table(&list.items))?;
            }
            ApiKeyCommand::Show { id } => {
                let v = client.get(&format!("api-keys/{}", segment(id)), &[])?;
                if json_mode {
                    return print_json(out, &v);
                }
                write!(out, "{}", api_keys_table(&[decode(v)?]))?;
            }
            ApiKeyCommand::Revoke { id } => {
                let v = client.delete(&format!("api-keys/{}", segment(id)))?;
                if json_mode {
                    return print_json(out, &v);
                }
                let key: ApiKey = decode(v)?;
                writeln!(out, "revoked api key {} ({})", key.id, key.name)?;
            }
        },
    }
    Ok(())
}

/// Drops `null` members and empty `labels` so the request says only what was given.
fn strip_nulls(mut v: Value) -> Value {
    if let Value::Object(map) = &mut v {
        let empty_labels = |k: &str, v: &Value| k == "labels" && v.as_object().is_some_and(|m| m.is_empty());
        map.retain(|k, v| !(v.is_null() || empty_labels(k, v)));
    }
    v
}

/// Renders aligned columns: a header row, then one line per row; columns are
/// separated by two spaces and the last one is not padded.
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
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
                r.kind.to_string(),
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

fn ports_table(items: &[Reservation]) -> String {
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|r| {
            vec![
                r.port.map(|p| p.to_string()).unwrap_or_default(),
                r.url.clone().unwrap_or_default(),
                r.owner.clone(),
                labels_cell(&r.labels),
                r.created_at.clone(),
            ]
        })
        .collect();
    render_table(&["PORT", "ADDRESS", "OWNER", "LABELS", "CREATED"], &rows)
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
                k.created_at.clone(),
                k.revoked_at.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    render_table(&["ID", "NAME", "SCOPE", "CREATED", "REVOKED"], &rows)
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
                labels: Labels::new(),
                owner: "ak_1".into(),
                created_at: "x".into(),
                url: None,
                certificate: None,
            },
            revoked_tunnel_keys: vec!["tk_1".into()],
        });
        assert_eq!(released, "released blog.example.com; revoked 1 tunnel key\n");
    }

    #[test]
    fn request_bodies_and_paths() {
        assert_eq!(strip_nulls(json!({"name": "a", "fqdn": null, "labels": {}})), json!({"name": "a"}));
        assert_eq!(segment("blog.example.com"), "blog.example.com");
        assert_eq!(segment("../x?y"), "..%2Fx%3Fy");
        for bad in ["https://", "ftp://x", "https://x/path", ""] {
            assert!(matches!(Client::new(bad, "k", None, false), Err(AdminError::BadEdge(_))), "{bad}");
        }
        let c = Client::new("edge.example.com/", "k", None, false).unwrap();
        assert_eq!(c.base, "https://edge.example.com/_culvert/v1/api/");
    }

    #[test]
    fn error_messages() {
        let e = AdminError::Refused {
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
        fn state_changed(&self) {}
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
        let admin = store.ensure_admin_key().unwrap().unwrap();
        let ctx = ApiContext {
            store,
            domain: "edge.test".into(),
            public_host: "edge.test".into(),
            public_https_port: 443,
            tcp_ports: PortRange { first: 20000, last: 20009 },
            acme: true,
            hooks: Arc::new(Hooks),
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
        execute(client, &parsed.admin.command, parsed.admin.output, &mut out)?;
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
            matches!(&err, AdminError::Refused { status: 403, code, .. } if code == "admin_required"),
            "{err}"
        );
        let tunnel_client = Client::new(&edge, secret.trim(), None, false).unwrap();
        let err = run(&tunnel_client, &["info"]).unwrap_err();
        assert!(
            matches!(&err, AdminError::Refused { code, .. } if code == "tunnel_key_not_allowed"),
            "{err}"
        );
        assert_eq!(
            run(&admin_client, &["domain", "release", "blog"]).unwrap(),
            "released blog.edge.test; revoked 1 tunnel key\n"
        );

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
            Err(AdminError::CaFile(_))
        ));
        runtime.shutdown_background();
    }
}
