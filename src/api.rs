//! Control API types, shared by the edge, the operator and `culvert admin`.
//!
//! Everything is JSON in camelCase under [`crate::constants::API_PREFIX`]; the
//! routes are served by `edge::api` and called by [`crate::api_client`]. Lists are
//! wrapped as `{"items": [...]}` so they can grow fields later.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `as_str`, `parse` and `Display` of an enum from one table of its wire
/// and JSON spellings, so that the three cannot disagree (serde's
/// `rename_all` must give the same: `tests::spellings_match_serde`).
macro_rules! spelled {
    ($ty:ident { $($variant:ident => $s:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value, in the table's order.
            pub const ALL: &[$ty] = &[$($ty::$variant),+];

            /// The wire and JSON spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $s),+
                }
            }

            /// Parses the wire and JSON spelling.
            pub fn parse(s: &str) -> Option<$ty> {
                match s {
                    $($s => Some($ty::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// Free-form labels (`key=value`) on tunnel keys and reservations.
pub type Labels = BTreeMap<String, String>;

/// What a tunnel key publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// HTTP(S) by host name: the edge terminates TLS and routes by `Host`.
    Http,
    /// Raw TCP on a reserved port.
    Tcp,
    /// TLS passthrough by SNI on a reserved host name.
    Tls,
    /// Raw UDP datagrams on a reserved UDP port.
    Udp,
}

spelled!(Protocol { Http => "http", Tcp => "tcp", Tls => "tls", Udp => "udp" });

/// The transport of a port reservation: TCP and UDP ports are separate
/// spaces (UDP 5353 and TCP 5353 may be held by different keys).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    /// A TCP port (the default: absent means tcp).
    #[default]
    Tcp,
    /// A UDP port.
    Udp,
}

spelled!(PortProtocol { Tcp => "tcp", Udp => "udp" });

impl PortProtocol {
    /// Whether this is TCP (the default, left out of JSON).
    pub fn is_tcp(&self) -> bool {
        *self == PortProtocol::Tcp
    }

    /// The transport of the port a tunnel key of `protocol` publishes on.
    pub fn of_key(protocol: Protocol) -> PortProtocol {
        match protocol {
            Protocol::Udp => PortProtocol::Udp,
            _ => PortProtocol::Tcp,
        }
    }

    /// The tunnel key protocol that publishes a port of this transport.
    pub fn tunnel_protocol(self) -> Protocol {
        match self {
            PortProtocol::Tcp => Protocol::Tcp,
            PortProtocol::Udp => Protocol::Udp,
        }
    }
}

/// An inclusive range of ports (TCP and UDP reservations share it); `FIRST-LAST` (or one `PORT`) in flags and JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// Parses `FIRST-LAST` or `PORT` (`--tcp-ports`, `Info.tcpPorts`).
    pub fn parse(s: &str) -> Result<PortRange, String> {
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
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        PortRange::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The host name of the edge's default host: a custom domain reservation of
/// `*` receives every HTTP(S) request whose host no reservation holds (an
/// unknown name, or an IP literal such as the edge's own address; never the
/// edge's own name). One holder per edge; an admin key, or an endpoints key
/// allowed any custom domain (`customDomains: ["*"]`), may reserve it.
pub const DEFAULT_HOST: &str = "*";

/// What a reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReservationKind {
    /// `<name>.<edge domain>`.
    Subdomain,
    /// A custom domain pointed at the edge by CNAME.
    Custom,
    /// A port on the edge: TCP, or UDP (see [`Reservation::protocol`]).
    /// The spelling `tcp` predates UDP and stays for compatibility.
    Tcp,
}

spelled!(ReservationKind { Subdomain => "subdomain", Custom => "custom", Tcp => "tcp" });

/// A reserved domain or TCP port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reservation {
    /// Public id, `rs_` + 12 hex digits.
    pub id: String,
    /// Subdomain, custom domain or TCP port.
    pub kind: ReservationKind,
    /// Full host name (subdomain and custom kinds), lower case, no trailing dot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Port (tcp kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The transport of a port reservation: `tcp` (absent) or `udp`.
    #[serde(default, skip_serializing_if = "PortProtocol::is_tcp")]
    pub protocol: PortProtocol,
    /// Free-form labels (the operator keeps its cluster id and namespace here).
    #[serde(default)]
    pub labels: Labels,
    /// Id of the API key that holds the reservation.
    #[serde(default)]
    pub owner: String,
    /// RFC 3339 UTC time of creation.
    pub created_at: String,
    /// Public address: `https://host[:port]`, `tcp://public-host:port` or
    /// `udp://public-host:port`.
    /// Filled in by the API (the store does not know the edge's addresses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The ACME certificate of a custom domain (edges with `--acme`); filled
    /// in by the API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<Box<CertificateState>>,
    /// A TCP port's own idle timeout (seconds): its connections with no byte
    /// either way for this long are closed. None: the edge's
    /// `--tcp-idle-timeout-seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
}

/// Where a custom domain's certificate stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CertificateStatus {
    /// No certificate yet: the edge is checking DNS or ordering one.
    Pending,
    /// A valid certificate is served (a failed renewal shows in `lastError`).
    Ready,
    /// The name does not resolve to the edge: point a CNAME at the edge's
    /// domain; the edge checks again on its own (nothing is asked of the CA).
    DnsMismatch,
    /// Ordering failed; the edge retries with backoff (`nextAttemptAt`).
    Failed,
    /// The certificate expired and could not be renewed.
    Expired,
}

spelled!(CertificateStatus {
    Pending => "pending",
    Ready => "ready",
    DnsMismatch => "dns_mismatch",
    Failed => "failed",
    Expired => "expired",
});

/// The certificate state of a custom domain, as the edge reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateState {
    /// Where it stands.
    pub status: CertificateStatus,
    /// RFC 3339 UTC expiry of the certificate served, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after: Option<String>,
    /// RFC 3339 UTC time the edge renews the certificate (status `ready`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_at: Option<String>,
    /// RFC 3339 UTC time of the next check or order after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<String>,
    /// What went wrong last (cleared by a successful order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// RFC 3339 UTC time of the last change.
    pub updated_at: String,
}

impl Reservation {
    /// The public address of the reservation: `https://<hostname>` (with
    /// `:<https_port>` unless 443) for domains, `tcp://<public_host>:<port>`
    /// (`udp://...`) for ports. TLS passthrough uses the same host and port as HTTPS.
    pub fn public_url(&self, https_port: u16, public_host: &str) -> String {
        match (self.kind, &self.hostname, self.port) {
            (ReservationKind::Tcp, _, Some(port)) => format!("{}://{public_host}:{port}", self.protocol),
            (_, Some(host), _) if https_port == 443 => format!("https://{host}"),
            (_, Some(host), _) => format!("https://{host}:{https_port}"),
            // Unreachable for records made by the store; say something useful anyway.
            _ => format!("reservation {}", self.id),
        }
    }

    /// Whether this is the edge's default host ([`DEFAULT_HOST`]).
    pub fn is_default_host(&self) -> bool {
        self.hostname.as_deref() == Some(DEFAULT_HOST)
    }

    /// What the reservation holds, for messages and tables: the host name or
    /// the port (`port N`, `udp port N`).
    pub fn target(&self) -> String {
        port_target(&self.hostname, self.port, self.protocol, &self.id)
    }
}

fn port_target(hostname: &Option<String>, port: Option<u16>, protocol: PortProtocol, id: &str) -> String {
    match (hostname, port) {
        (Some(host), _) => host.clone(),
        (None, Some(port)) if protocol == PortProtocol::Udp => format!("udp port {port}"),
        (None, Some(port)) => format!("port {port}"),
        (None, None) => id.to_string(),
    }
}

/// Which reservation a tunnel key belongs to. Kept with the key, so a key of
/// a released reservation still says what it was for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReservationRef {
    /// Id of the reservation (`rs_…`).
    pub id: String,
    /// Subdomain, custom domain or TCP port.
    pub kind: ReservationKind,
    /// Host name (domain kinds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Port (tcp kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The transport of a port: `tcp` (absent) or `udp`.
    #[serde(default, skip_serializing_if = "PortProtocol::is_tcp")]
    pub protocol: PortProtocol,
}

impl ReservationRef {
    /// The host name or `port N` (`udp port N`), for messages and tables.
    pub fn target(&self) -> String {
        port_target(&self.hostname, self.port, self.protocol, &self.id)
    }
}

impl From<&Reservation> for ReservationRef {
    fn from(r: &Reservation) -> Self {
        ReservationRef {
            id: r.id.clone(),
            kind: r.kind,
            hostname: r.hostname.clone(),
            port: r.port,
            protocol: r.protocol,
        }
    }
}

/// Scope of an API key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ApiKeyScope {
    /// Everything, including API key management.
    Admin,
    /// Reserve/release domains and ports, mint/list/revoke tunnel keys, read info.
    Endpoints,
}

spelled!(ApiKeyScope { Admin => "admin", Endpoints => "endpoints" });

/// An API key as listed (never with its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiKey {
    /// Public id, `ak_` + 12 hex digits.
    pub id: String,
    /// What the key is for (free text given at creation).
    pub name: String,
    /// What the key may do.
    pub scope: ApiKeyScope,
    /// RFC 3339 UTC time of creation.
    pub created_at: String,
    /// RFC 3339 UTC time of revocation, if revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
    /// Custom domains an `endpoints` key may reserve: each entry allows that
    /// name and every name under it; `*` allows any, and the edge's default
    /// host ([`DEFAULT_HOST`]). Empty: none (admin keys may reserve any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub custom_domains: Vec<String>,
    /// What an `endpoints` key may hold (admin keys: none, no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<Quota>,
}

/// The limits of an `endpoints` key: each is [`Quota::DEFAULT`]'s unless an
/// admin set it for the key (`culvert admin api-key create|update --max-…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Quota {
    /// Reservations (domains and ports together) the key may hold.
    pub reservations: u32,
    /// Labels on one of its reservations or tunnel keys.
    pub labels: u32,
    /// Bytes of one record's labels, keys and values together.
    pub label_bytes: u32,
}

impl Quota {
    /// What an endpoints key may hold unless an admin says otherwise.
    pub const DEFAULT: Quota = Quota { reservations: 1000, labels: 32, label_bytes: 4096 };
    /// The largest values an admin may set.
    pub const MAX: Quota = Quota {
        reservations: 1_000_000,
        labels: MAX_LABELS as u32,
        label_bytes: (MAX_LABELS * (MAX_LABEL_KEY + MAX_LABEL_VALUE)) as u32,
    };

    /// `self` with what `update` gives.
    pub fn with(self, update: &QuotaUpdate) -> Quota {
        Quota {
            reservations: update.reservations.unwrap_or(self.reservations),
            labels: update.labels.unwrap_or(self.labels),
            label_bytes: update.label_bytes.unwrap_or(self.label_bytes),
        }
    }

    /// Checks labels against the key's label quota; the message says the
    /// limit and how to raise it.
    pub fn check_labels(&self, labels: &Labels, key_id: &str) -> Result<(), String> {
        let raise = |flag: &str, value: usize| {
            format!("ask the edge's admin to raise it (culvert admin api-key update {key_id} {flag} {value})")
        };
        if labels.len() > self.labels as usize {
            return Err(format!(
                "{} labels given; this key's quota is {} labels per record: drop some, or {}",
                labels.len(),
                self.labels,
                raise("--max-labels", labels.len())
            ));
        }
        let bytes: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > self.label_bytes as usize {
            return Err(format!(
                "the labels take {bytes} bytes (keys and values); this key's quota is {} bytes per record: shorten them, or {}",
                self.label_bytes,
                raise("--max-label-bytes", bytes)
            ));
        }
        Ok(())
    }
}

/// A change of an `endpoints` key's quota: what is given replaces the key's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaUpdate {
    /// See [`Quota::reservations`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservations: Option<u32>,
    /// See [`Quota::labels`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<u32>,
    /// See [`Quota::label_bytes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_bytes: Option<u32>,
}

impl QuotaUpdate {
    /// Whether nothing is given.
    pub fn is_empty(&self) -> bool {
        *self == QuotaUpdate::default()
    }

    /// Checks each value given against [`Quota::MAX`].
    pub fn validate(&self) -> Result<(), String> {
        for (name, value, max) in [
            ("reservations", self.reservations, Quota::MAX.reservations),
            ("labels", self.labels, Quota::MAX.labels),
            ("labelBytes", self.label_bytes, Quota::MAX.label_bytes),
        ] {
            if let Some(v) = value.filter(|v| *v > max) {
                return Err(format!("quota.{name} {v} is above the largest allowed, {max}"));
            }
        }
        Ok(())
    }
}

impl ApiKey {
    /// Whether this key may reserve the custom domain `host` (lower case, no trailing dot).
    pub fn may_reserve_custom(&self, host: &str) -> bool {
        self.scope == ApiKeyScope::Admin
            || self.custom_domains.iter().any(|suffix| {
                suffix == "*"
                    || host == suffix
                    || host.strip_suffix(suffix.as_str()).is_some_and(|head| head.ends_with('.'))
            })
    }
}

/// A tunnel key as listed (never with its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TunnelKey {
    /// Public id, `tk_` + 12 hex digits.
    pub id: String,
    /// What the key publishes.
    pub protocol: Protocol,
    /// The reservation the key opens connections for.
    pub reservation: ReservationRef,
    /// Free-form labels (the operator keeps its cluster id and object uid here).
    #[serde(default)]
    pub labels: Labels,
    /// Id of the API key that holds the key's reservation.
    #[serde(default)]
    pub owner: String,
    /// RFC 3339 UTC time of creation.
    pub created_at: String,
    /// RFC 3339 UTC time of revocation, if revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
    /// Agents connected with this key right now (filled in by the API).
    #[serde(default)]
    pub connections: usize,
}

/// `GET info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Info {
    /// The edge's base domain.
    pub domain: String,
    /// The edge's culvert version.
    pub version: String,
    /// Tunnel wire protocol version the edge speaks.
    pub protocol_version: u32,
    /// Oldest agent protocol version the edge accepts.
    pub min_protocol_version: u32,
    /// Port range for port reservations (TCP and UDP), `FIRST-LAST` on the wire.
    pub tcp_ports: PortRange,
    /// Host name public TCP addresses are reported with.
    pub public_host: String,
    /// Port of public HTTPS (and the tunnel endpoint).
    pub public_https_port: u16,
    /// The API key that made this call.
    pub caller: ApiKey,
}

/// `POST domains`: give exactly one of `name` and `fqdn`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReserveDomainRequest {
    /// A DNS label: reserves `<name>.<edge domain>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A full host name (custom domain). One label under the edge's domain is
    /// treated as `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fqdn: Option<String>,
    /// Labels stored with a new reservation (an existing one keeps its own).
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
}

/// `POST ports`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservePortRequest {
    /// A port within the edge's range; none picks the lowest free one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `tcp` (default) or `udp`: TCP and UDP ports are separate spaces.
    #[serde(default, skip_serializing_if = "PortProtocol::is_tcp")]
    pub protocol: PortProtocol,
    /// Labels stored with a new reservation (an existing one keeps its own).
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    /// The port's own idle timeout in seconds (1 to [`MAX_IDLE_TIMEOUT_SECONDS`]),
    /// instead of the edge's `--tcp-idle-timeout-seconds` (0: the edge's
    /// again); given for a port the caller holds already, it replaces the
    /// one it had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
}

/// The longest idle timeout a port reservation may ask for (30 days).
pub const MAX_IDLE_TIMEOUT_SECONDS: u64 = 30 * 24 * 3600;

/// `DELETE domains/{host}` and `DELETE ports/{port}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseResponse {
    /// The reservation that no longer exists.
    pub reservation: Reservation,
    /// Ids of the tunnel keys revoked with it.
    pub revoked_tunnel_keys: Vec<String>,
}

/// `POST tunnel-keys`: give exactly one of `domain` and `port`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateTunnelKeyRequest {
    /// Host name or subdomain label of a domain reservation (http, tls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Port of a port reservation (tcp, or udp for a UDP port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// What the key publishes; defaults to `http` for a domain, `tcp` for a
    /// port. `udp` binds the key to the UDP reservation of `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    /// Free-form labels.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
}

/// `POST tunnel-keys` answer: the key and its secret, shown only here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedTunnelKey {
    /// The key as it will be listed.
    #[serde(flatten)]
    pub key: TunnelKey,
    /// The secret (`culvert_t_…`); the edge keeps only its hash.
    pub secret: String,
    /// Public address the key publishes.
    pub url: String,
}

/// `POST api-keys`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateApiKeyRequest {
    /// What the key is for (1-100 characters).
    pub name: String,
    /// What the key may do.
    pub scope: ApiKeyScope,
    /// Custom domains an `endpoints` key may reserve (see [`ApiKey::custom_domains`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub custom_domains: Vec<String>,
    /// An `endpoints` key's limits; what is not given is [`Quota::DEFAULT`]'s.
    #[serde(default, skip_serializing_if = "QuotaUpdate::is_empty")]
    pub quota: QuotaUpdate,
}

/// `PATCH api-keys/{id}`: what changes (an `endpoints` key's quota, its custom domains).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateApiKeyRequest {
    /// The values of the quota to change; the others stay.
    #[serde(default)]
    pub quota: QuotaUpdate,
    /// The custom domains an `endpoints` key may reserve, replacing its list
    /// (see [`ApiKey::custom_domains`]; `[]` takes every one away; `*` also
    /// allows the default host, [`DEFAULT_HOST`]). Absent: unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_domains: Option<Vec<String>>,
}

/// `POST api-keys` answer: the key and its secret, shown only here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedApiKey {
    /// The key as it will be listed.
    #[serde(flatten)]
    pub key: ApiKey,
    /// The secret (`culvert_a_…` or `culvert_e_…`); the edge keeps only its hash.
    pub secret: String,
}

/// Every list answer: `{"items": [...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct List<T> {
    /// The listed records.
    pub items: Vec<T>,
}

/// Body of every API error: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of [`ErrorBody`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable machine-readable code, e.g. `already_reserved`.
    pub code: String,
    /// What went wrong and what to do about it.
    pub message: String,
}

impl ErrorBody {
    /// An error body with this code and message.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ErrorBody { error: ErrorDetail { code: code.into(), message: message.into() } }
    }
}

/// A label selector: comma-separated `key=value`, `key!=value`, `key` (has
/// the label) and `!key` (lacks it); all must hold. Empty selects everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    terms: Vec<SelectorTerm>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SelectorTerm {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    Absent(String),
}

impl Selector {
    /// Parses `k=v,k2!=v2,k3,!k4` (`==` is accepted for `=`).
    pub fn parse(s: &str) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for raw in s.split(',') {
            let term = raw.trim();
            if term.is_empty() {
                continue;
            }
            let parsed = if let Some((k, v)) = term.split_once("!=") {
                SelectorTerm::Ne(check_selector_key(k.trim(), term)?, v.trim().to_string())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                SelectorTerm::Eq(check_selector_key(k.trim(), term)?, v.trim().to_string())
            } else if let Some(k) = term.strip_prefix('!') {
                SelectorTerm::Absent(check_selector_key(k.trim(), term)?)
            } else {
                SelectorTerm::Exists(check_selector_key(term, term)?)
            };
            terms.push(parsed);
        }
        Ok(Selector { terms })
    }

    /// Whether the labels satisfy every term.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.terms.iter().all(|t| match t {
            SelectorTerm::Eq(k, v) => labels.get(k) == Some(v),
            SelectorTerm::Ne(k, v) => labels.get(k) != Some(v),
            SelectorTerm::Exists(k) => labels.contains_key(k),
            SelectorTerm::Absent(k) => !labels.contains_key(k),
        })
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}

fn check_selector_key(key: &str, term: &str) -> Result<String, String> {
    if key.is_empty() || key.contains(['=', '!', ',']) || key.chars().any(char::is_whitespace) {
        return Err(format!("selector term `{term}` is not `key=value`, `key!=value`, `key` or `!key`"));
    }
    Ok(key.to_string())
}

/// Longest label key.
pub const MAX_LABEL_KEY: usize = 253;
/// Longest label value.
pub const MAX_LABEL_VALUE: usize = 253;
/// Most labels on one record.
pub const MAX_LABELS: usize = 64;

/// Checks labels: at most [`MAX_LABELS`]; keys 1-253 characters of
/// `A-Z a-z 0-9 . _ - /`; values up to 253 characters without `,` or `=`
/// (so a selector can match them) and without control characters.
pub fn validate_labels(labels: &Labels) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!("{} labels given; at most {MAX_LABELS} are allowed", labels.len()));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= MAX_LABEL_KEY
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
        if !key_ok {
            return Err(format!(
                "label key `{k}` is invalid: use 1-{MAX_LABEL_KEY} characters of A-Z, a-z, 0-9, `.`, `_`, `-`, `/`"
            ));
        }
        let value_ok =
            v.len() <= MAX_LABEL_VALUE && !v.contains([',', '=']) && !v.chars().any(char::is_control);
        if !value_ok {
            return Err(format!(
                "label `{k}` has an invalid value: use at most {MAX_LABEL_VALUE} characters, without `,`, `=` or control characters"
            ));
        }
    }
    Ok(())
}

/// Parses `key=value` (a `--label` flag).
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("label `{s}` is not `key=value`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each spelled enum's `as_str` is what serde writes and reads, and
    /// `parse` takes it back; nothing else parses.
    #[test]
    fn spellings_match_serde() {
        fn check<T>(all: &[T], as_str: fn(T) -> &'static str, parse: fn(&str) -> Option<T>)
        where
            T: Copy
                + PartialEq
                + std::fmt::Debug
                + std::fmt::Display
                + Serialize
                + serde::de::DeserializeOwned,
        {
            for &v in all {
                let s = as_str(v);
                assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{s}\""), "{v:?}");
                assert_eq!(serde_json::from_str::<T>(&format!("\"{s}\"")).unwrap(), v);
                assert_eq!(parse(s), Some(v));
                assert_eq!(v.to_string(), s);
                assert_eq!(parse(&s.to_uppercase()), None, "{s} is case-sensitive");
            }
            assert_eq!(parse(""), None);
        }
        check(Protocol::ALL, Protocol::as_str, Protocol::parse);
        check(PortProtocol::ALL, PortProtocol::as_str, PortProtocol::parse);
        check(ReservationKind::ALL, ReservationKind::as_str, ReservationKind::parse);
        check(CertificateStatus::ALL, CertificateStatus::as_str, CertificateStatus::parse);
        check(ApiKeyScope::ALL, ApiKeyScope::as_str, ApiKeyScope::parse);
        assert_eq!(Protocol::ALL.len(), 4);
        assert_eq!(CertificateStatus::ALL.len(), 5);
    }

    #[test]
    fn port_ranges() {
        assert_eq!(PortRange::parse("20000-20999").unwrap(), PortRange { first: 20000, last: 20999 });
        assert_eq!(PortRange::parse("8080").unwrap(), PortRange { first: 8080, last: 8080 });
        assert!(PortRange::parse("0-10").is_err());
        assert!(PortRange::parse("10-5").is_err());
        assert!(PortRange::parse("70000").is_err());
        let range = PortRange { first: 20000, last: 20009 };
        assert_eq!(serde_json::to_string(&range).unwrap(), "\"20000-20009\"");
        assert_eq!(serde_json::from_str::<PortRange>("\"20000-20009\"").unwrap(), range);
        assert!(serde_json::from_str::<PortRange>("\"x\"").is_err());
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn selectors() {
        let l = labels(&[("cluster", "a"), ("ns", "default")]);
        assert!(Selector::parse("").unwrap().matches(&l));
        assert!(Selector::parse("cluster=a").unwrap().matches(&l));
        assert!(Selector::parse("cluster==a, ns=default").unwrap().matches(&l));
        assert!(!Selector::parse("cluster=a,ns=kube-system").unwrap().matches(&l));
        assert!(Selector::parse("cluster!=b").unwrap().matches(&l));
        assert!(Selector::parse("ns,!uid").unwrap().matches(&l));
        assert!(!Selector::parse("uid").unwrap().matches(&l));
        assert!(Selector::parse("=a").is_err());
        assert!(Selector::parse("a b=c").is_err());
    }

    #[test]
    fn label_rules() {
        assert!(validate_labels(&labels(&[("culvert.dev/cluster", "x-1_2")])).is_ok());
        assert!(validate_labels(&labels(&[("", "x")])).is_err());
        assert!(validate_labels(&labels(&[("a b", "x")])).is_err());
        assert!(validate_labels(&labels(&[("a", "x,y")])).is_err());
        assert_eq!(parse_label("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert!(parse_label("novalue").is_err());
    }

    #[test]
    fn json_shapes() {
        let r = Reservation {
            id: "rs_0123456789ab".into(),
            kind: ReservationKind::Subdomain,
            hostname: Some("blog.example.com".into()),
            port: None,
            protocol: PortProtocol::Tcp,
            labels: Labels::new(),
            owner: "ak_0123456789ab".into(),
            created_at: "2025-01-01T00:00:00Z".into(),
            url: None,
            certificate: None,
            idle_timeout_seconds: None,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["createdAt"], "2025-01-01T00:00:00Z");
        assert_eq!(v["kind"], "subdomain");
        assert!(v.get("port").is_none());
        assert_eq!(r.public_url(443, "x"), "https://blog.example.com");
        assert_eq!(r.public_url(8443, "x"), "https://blog.example.com:8443");
        assert!(v.get("protocol").is_none(), "tcp (and domains) leave protocol out");
        let udp = Reservation {
            kind: ReservationKind::Tcp,
            hostname: None,
            port: Some(5353),
            protocol: PortProtocol::Udp,
            ..r.clone()
        };
        let v = serde_json::to_value(&udp).unwrap();
        assert_eq!(v["protocol"], "udp");
        assert_eq!(udp.public_url(443, "edge.example.com"), "udp://edge.example.com:5353");
        assert_eq!(udp.target(), "udp port 5353");
        let back: Reservation = serde_json::from_value(v).unwrap();
        assert_eq!(back, udp);
        let req: ReservePortRequest = serde_json::from_str(r#"{"port": 53}"#).unwrap();
        assert_eq!(req.protocol, PortProtocol::Tcp, "absent is tcp");
        let req: ReservePortRequest = serde_json::from_str(r#"{"protocol": "udp"}"#).unwrap();
        assert_eq!(req.protocol, PortProtocol::Udp);
        let e = serde_json::to_value(ErrorBody::new("c", "m")).unwrap();
        assert_eq!(e, serde_json::json!({"error": {"code": "c", "message": "m"}}));
        let bad = serde_json::from_str::<ReserveDomainRequest>(r#"{"nmae":"x"}"#);
        assert!(bad.is_err());
    }
}
