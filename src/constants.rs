//! The timeouts, limits, header names and paths of the wire protocol and the
//! roles, in one place. Limits private to one module live beside their code
//! (`edge::public`'s retry attempts, `tunnel::proxy`'s proxy answer size,
//! `api_client`'s answer size, `operator::reservation`'s certificate recheck).

use std::time::Duration;

/// Version of the tunnel wire protocol. The agent sends it in [`VERSION_HEADER`];
/// the edge refuses versions it does not speak with 426, and says the one it
/// took in the 101. 1: HTTP/2 carries the streams; 2: the multiplexer
/// (`tunnel::mux`, `tunnel::Wire`).
pub const PROTOCOL_VERSION: u32 = 2;
/// Oldest agent protocol version the edge still accepts.
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// Path of the tunnel endpoint (a WebSocket upgrade).
pub const CONNECT_PATH: &str = "/_culvert/v1/connect";
/// Prefix of the control API.
pub const API_PREFIX: &str = "/_culvert/v1/api/";
/// Prefix reserved for culvert itself on the edge's own host names.
pub const RESERVED_PREFIX: &str = "/_culvert/";

/// Request header: the agent's protocol version.
pub const VERSION_HEADER: &str = "culvert-protocol-version";
/// Request header: a random id of the agent process (for logs and metrics).
pub const AGENT_ID_HEADER: &str = "culvert-agent-id";
/// Response header on the 101: what the key publishes (`http`, `tcp`, `tls`).
pub const TUNNEL_PROTOCOL_HEADER: &str = "culvert-tunnel-protocol";
/// Response header on the 101: the public URL of the reservation.
pub const PUBLIC_URL_HEADER: &str = "culvert-public-url";

/// Header on a tunnelled request: the stream is raw bytes (`tcp`), or an
/// HTTP upgrade whose `Upgrade` value follows (`upgrade`).
pub const STREAM_HEADER: &str = "culvert-stream";
/// Header on a tunnelled upgrade request: the public client's `Upgrade` value.
pub const UPGRADE_HEADER: &str = "culvert-upgrade";
/// Header on a tunnelled response: the backend's real status (101 for upgrades).
pub const STATUS_HEADER: &str = "culvert-status";
/// Header on a tunnelled stream: the public client's address (`ip:port`).
pub const CLIENT_ADDR_HEADER: &str = "culvert-client-addr";
/// Header on a tunnelled stream: the edge address the client connected to.
pub const SERVER_ADDR_HEADER: &str = "culvert-server-addr";
/// Header on a response the agent made itself (backend unreachable...).
pub const ERROR_HEADER: &str = "culvert-error";

/// The wire headers every request and response carries, as header names:
/// a `&str` name is parsed again at every use.
pub mod names {
    use http::header::HeaderName;

    pub static STREAM: HeaderName = HeaderName::from_static(super::STREAM_HEADER);
    pub static STATUS: HeaderName = HeaderName::from_static(super::STATUS_HEADER);
    pub static ERROR: HeaderName = HeaderName::from_static(super::ERROR_HEADER);
    pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
    pub static X_FORWARDED_PORT: HeaderName = HeaderName::from_static("x-forwarded-port");

    /// The names the edge puts on every tunnelled request, and those of the
    /// wire: parsed back from a head, they are these statics (no copy of
    /// the name for each request, as a name outside the standard ones gets).
    /// And the standard names most heads carry, spelled as they come: lower
    /// case (the edge writes names so) or as servers write them; any other
    /// spelling goes through `HeaderName::from_bytes` (~160 instructions a
    /// name, which lowers its case). A `match`: its length switch rules most
    /// names out at once, where a scan of the statics took ~100 instructions
    /// a field.
    pub fn known(name: &[u8]) -> Option<HeaderName> {
        use http::header as h;
        Some(match name {
            b"x-forwarded-for" => X_FORWARDED_FOR.clone(),
            b"x-forwarded-proto" => X_FORWARDED_PROTO.clone(),
            b"x-forwarded-host" => X_FORWARDED_HOST.clone(),
            b"x-forwarded-port" => X_FORWARDED_PORT.clone(),
            b"culvert-stream" => STREAM.clone(),
            b"culvert-status" => STATUS.clone(),
            b"culvert-error" => ERROR.clone(),
            b"accept" | b"Accept" => h::ACCEPT,
            b"accept-encoding" | b"Accept-Encoding" => h::ACCEPT_ENCODING,
            b"accept-language" | b"Accept-Language" => h::ACCEPT_LANGUAGE,
            b"accept-ranges" | b"Accept-Ranges" => h::ACCEPT_RANGES,
            b"authorization" | b"Authorization" => h::AUTHORIZATION,
            b"cache-control" | b"Cache-Control" => h::CACHE_CONTROL,
            b"content-encoding" | b"Content-Encoding" => h::CONTENT_ENCODING,
            b"content-length" | b"Content-Length" => h::CONTENT_LENGTH,
            b"content-type" | b"Content-Type" => h::CONTENT_TYPE,
            b"cookie" | b"Cookie" => h::COOKIE,
            b"date" | b"Date" => h::DATE,
            b"etag" | b"ETag" | b"Etag" => h::ETAG,
            b"expires" | b"Expires" => h::EXPIRES,
            b"if-modified-since" | b"If-Modified-Since" => h::IF_MODIFIED_SINCE,
            b"if-none-match" | b"If-None-Match" => h::IF_NONE_MATCH,
            b"last-modified" | b"Last-Modified" => h::LAST_MODIFIED,
            b"location" | b"Location" => h::LOCATION,
            b"origin" | b"Origin" => h::ORIGIN,
            b"referer" | b"Referer" => h::REFERER,
            b"server" | b"Server" => h::SERVER,
            b"set-cookie" | b"Set-Cookie" => h::SET_COOKIE,
            b"user-agent" | b"User-Agent" => h::USER_AGENT,
            b"vary" | b"Vary" => h::VARY,
            _ => return None,
        })
    }

    #[cfg(test)]
    static KNOWN: [&HeaderName; 7] = [
        &X_FORWARDED_FOR,
        &X_FORWARDED_PROTO,
        &X_FORWARDED_HOST,
        &X_FORWARDED_PORT,
        &STREAM,
        &STATUS,
        &ERROR,
    ];

    #[cfg(test)]
    #[test]
    fn every_known_name_is_found() {
        for name in KNOWN {
            assert_eq!(known(name.as_str().as_bytes()).as_ref(), Some(name), "{name}");
        }
        assert_eq!(known(b"x-forwarded-other"), None);
        assert_eq!(known(b"X-Forwarded-For"), None, "the wire's own names are lower case");
        // Each standard name in lower case and in title case (`ETag` too).
        use http::header as h;
        let standard = [
            h::ACCEPT,
            h::ACCEPT_ENCODING,
            h::ACCEPT_LANGUAGE,
            h::ACCEPT_RANGES,
            h::AUTHORIZATION,
            h::CACHE_CONTROL,
            h::CONTENT_ENCODING,
            h::CONTENT_LENGTH,
            h::CONTENT_TYPE,
            h::COOKIE,
            h::DATE,
            h::ETAG,
            h::EXPIRES,
            h::IF_MODIFIED_SINCE,
            h::IF_NONE_MATCH,
            h::LAST_MODIFIED,
            h::LOCATION,
            h::ORIGIN,
            h::REFERER,
            h::SERVER,
            h::SET_COOKIE,
            h::USER_AGENT,
            h::VARY,
        ];
        for name in standard {
            let lower = name.as_str();
            let title: String =
                lower.split('-').map(|w| w[..1].to_ascii_uppercase() + &w[1..]).collect::<Vec<_>>().join("-");
            for spelling in [lower, &title] {
                assert_eq!(known(spelling.as_bytes()), Some(name.clone()), "{spelling}");
            }
        }
        assert_eq!(known(b"ETag"), Some(h::ETAG));
        assert_eq!(known(b"CONTENT-TYPE"), None, "other spellings are parsed");
    }
}

/// WebSocket text message: the agent will take no new streams (draining).
pub const MSG_GOODBYE: &str = "goodbye";
/// WebSocket text message: the edge has stopped routing new streams here.
pub const MSG_GOODBYE_ACK: &str = "goodbye-ack";
/// WebSocket text message: the edge routes streams to this connection now.
pub const MSG_READY: &str = "ready";

/// An agent's TCP connect to an edge (without a proxy) must succeed within
/// this; an edge whose machine is gone (no answer at all) is then probed
/// again soon instead of after the kernel's SYN retries.
pub const EDGE_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// TLS handshake plus WebSocket upgrade must finish within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Public clients must send a complete request head within this (slowloris).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A public connection with no byte either way for this long is closed.
pub const PUBLIC_IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Largest request head a public client may send.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Public connections served at once (default of `--max-public-connections`;
/// also capped by the open file limit, see `edge::limits`).
pub const MAX_PUBLIC_CONNECTIONS: usize = 10_000;
/// Connections one TCP reservation may hold (default of `--max-connections-per-tcp-port`).
pub const DEFAULT_MAX_CONNECTIONS_PER_TCP_PORT: usize = 1_000;
/// A TCP reservation's connection silent this long is closed (default of `--tcp-idle-timeout-seconds`).
pub const DEFAULT_TCP_IDLE_TIMEOUT_SECONDS: u64 = 3600;

/// Largest UDP payload carried: the path's limit over IPv4 (65535 bytes of
/// IP packet, less 20 of IP header and 8 of UDP header). Larger datagrams
/// (possible only over IPv6) are dropped and counted as `oversize`.
pub const MAX_DATAGRAM: usize = 65_507;
/// A UDP flow with no datagram either way for this long ends (seconds).
pub const DEFAULT_UDP_IDLE_TIMEOUT_SECONDS: u64 = 60;
/// Flows one UDP reservation may have at once (new clients beyond are dropped).
pub const DEFAULT_MAX_UDP_FLOWS_PER_PORT: u64 = 1_000;
/// Flows the edge carries at once over every UDP reservation.
pub const DEFAULT_MAX_UDP_FLOWS: u64 = 10_000;
/// Bytes of datagrams one UDP flow may queue each way (at the edge toward
/// the agent, at the agent toward the edge) before new ones are dropped.
pub const UDP_FLOW_QUEUE_BYTES: usize = 256 * 1024;
/// Bytes of datagrams queued over every flow together, at the edge and at
/// each agent.
pub const UDP_QUEUE_TOTAL_BYTES: usize = 32 * 1024 * 1024;
/// A half-closed spliced connection silent this long is closed (default of `--half-close-timeout-seconds`).
pub const DEFAULT_HALF_CLOSE_TIMEOUT_SECONDS: u64 = 60;
/// Refused tunnel handshakes (bad or revoked keys, not WebSocket...) one
/// source address may have per [`REFUSED_HANDSHAKES_WINDOW`]; more are
/// refused with 429 before any key lookup until the window ends.
pub const MAX_REFUSED_HANDSHAKES: u32 = 30;
pub const REFUSED_HANDSHAKES_WINDOW: Duration = Duration::from_secs(10);
/// Agents connected at once with one tunnel key (default of `--max-agents-per-key`).
pub const DEFAULT_MAX_AGENTS_PER_KEY: usize = 4;

/// WebSocket ping interval on the tunnel, both sides.
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
/// A tunnel that received nothing (not even a pong) for this long is dead.
pub const DEAD_PEER_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest WebSocket message the byte-stream adapter writes: pending bytes are
/// coalesced up to this, so a small response is never stuck behind a bulk one.
pub const WS_MAX_BATCH: usize = 64 * 1024;

/// HTTP/2 stream window on the tunnel (fixed: the adaptive window is off, see
/// `tunnel::client::handshake`): what one stream may have in flight, and the most a
/// stream whose public client stops reading leaves buffered at the edge.
pub const H2_STREAM_WINDOW: u32 = 256 * 1024;
/// Concurrent streams one tunnel connection carries (the agent announces it;
/// more requests wait for a stream to end).
pub const H2_MAX_STREAMS: u32 = 4096;
/// HTTP/2 connection window on the tunnel (fixed): every stream's window
/// together, so that the connection window is never what stops a stream.
/// With a smaller one, streams whose public clients stop reading fill it and
/// every other stream of the tunnel stalls (issue 18, item 1). It is also
/// the bound of what one tunnel connection buffers for slow readers: 1 GiB.
pub const H2_CONN_WINDOW: u32 = H2_STREAM_WINDOW * H2_MAX_STREAMS;
const _: () = assert!(H2_CONN_WINDOW < 1 << 31, "HTTP/2 windows are at most 2^31-1");
/// Public clients' upload bytes (request bodies, upgraded and TCP streams)
/// the edge holds at once for one tunnel connection, and for all of them
/// together: more waits, unread, in the clients' sockets (`tunnel::budget`).
pub const TUNNEL_UPLOAD_BUDGET: usize = 16 * 1024 * 1024;
pub const EDGE_UPLOAD_BUDGET: usize = 256 * 1024 * 1024;
/// HTTP/2 max frame size on the tunnel.
pub const H2_MAX_FRAME: u32 = 64 * 1024;
/// Tunnel streams the edge keeps open at once, all tunnels together
/// (`--max-tunnel-streams`). Each may hold one stream window of response
/// data its public client has not read, plus the chunk being written to it:
/// this bounds what the edge buffers for downloads (4 096 × 320 KiB =
/// 1.25 GiB). More requests wait, their clients unread, for a stream to end.
pub const DEFAULT_MAX_TUNNEL_STREAMS: usize = 4096;
/// How long a request waits for one of those streams before a 503.
pub const TUNNEL_STREAM_WAIT: Duration = Duration::from_secs(10);

/// Reconnect backoff: first delay and cap (each delay is drawn from the upper half of its step).
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A connection that stayed up this long resets the backoff.
pub const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(30);
/// While nothing answers at an edge's address (connection refused, timed
/// out), the agent probes it this often (jittered by a third either way)
/// instead of backing off: it is back within one interval of the edge.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(150);
/// After this long without an answer, probes slow down to [`PROBE_SLOW_INTERVAL`].
pub const PROBE_SLOW_AFTER: Duration = Duration::from_secs(300);
pub const PROBE_SLOW_INTERVAL: Duration = Duration::from_secs(2);
/// Longest `Retry-After` an agent honours.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);
/// How often an agent resolves an edge's name again (one connection per address).
pub const EDGE_RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// An agent that says goodbye waits this long for the edge's ack.
pub const GOODBYE_ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// After the ack, streams the edge opened just before it may still arrive.
pub const DRAIN_GRACE: Duration = Duration::from_millis(200);
/// Longest time a draining agent waits for open streams to finish.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// For this long after an edge starts, a request for a host whose agents have
/// not reconnected yet waits for them instead of failing (502).
pub const AGENT_RETURN_GRACE: Duration = Duration::from_secs(3);

/// A public connection accepted before a drain began gets this long for its
/// first request before it is closed.
pub const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// Dialing a backend must succeed within this.
pub const BACKEND_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A kept-alive backend connection unused this long is closed (with its
/// buffers: about 30 KiB each, hundreds of them after a burst of requests).
pub const BACKEND_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Timeout of one control API call made by `culvert admin` and the operator.
pub const API_CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Default TCP port range for TCP reservations.
pub const DEFAULT_TCP_PORTS: &str = "20000-20999";

/// Largest control API request body; larger ones get 413.
pub const API_MAX_BODY: usize = 64 * 1024;
/// A control API request body must arrive completely within this.
pub const API_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// ACME: a certificate is renewed this long before it expires (or a third of
/// its lifetime before, for short-lived certificates).
pub const RENEW_BEFORE_EXPIRY: Duration = Duration::from_secs(30 * 24 * 3600);
/// ACME: certificate orders running at once (default of `--acme-max-concurrent-orders`).
pub const DEFAULT_ACME_CONCURRENT_ORDERS: usize = 2;
/// ACME: one order (challenge, validation, finalization, download) must finish within this.
pub const ACME_ORDER_TIMEOUT: Duration = Duration::from_secs(180);
/// ACME: backoff after a failed order: first delay and cap (doubling in between).
/// Five minutes keeps a name under Let's Encrypt's 5 failed validations per hour.
pub const ACME_ORDER_BACKOFF_INITIAL: Duration = Duration::from_secs(300);
pub const ACME_ORDER_BACKOFF_MAX: Duration = Duration::from_secs(6 * 3600);
/// ACME: a failure of the CA or of the way to it (unreachable, 5xx, bad
/// nonces) is retried after this, doubling up to `ACME_ORDER_BACKOFF_INITIAL`:
/// the CA judged nothing, so no validation was spent.
pub const ACME_TRANSIENT_RETRY_INITIAL: Duration = Duration::from_secs(5);
/// ACME: a name whose DNS does not point at the edge is checked again after
/// this (doubling up to the cap). DNS checks cost the CA nothing.
pub const ACME_DNS_RECHECK_INITIAL: Duration = Duration::from_secs(5);
pub const ACME_DNS_RECHECK_MAX: Duration = Duration::from_secs(60);
/// How often the edge checks its certificate files for a new version.
pub const DEFAULT_TLS_WATCH_SECONDS: u64 = 5;
/// ACME: one DNS query (with `--acme-dns-server`) waits this long for an answer.
pub const DNS_QUERY_TIMEOUT: Duration = Duration::from_secs(3);
/// ACME DNS-01: one RFC 2136 update (connect, send, answer) takes at most this.
pub const DNS01_UPDATE_TIMEOUT: Duration = Duration::from_secs(10);
/// ACME DNS-01: the exec hook may run this long (it may wait for propagation).
pub const ACME_DNS01_HOOK_TIMEOUT: Duration = Duration::from_secs(300);
/// Several edges on one PostgreSQL: besides the change feed (LISTEN/NOTIFY),
/// every edge re-reads the store this often (the safety net).
pub const STORE_RESYNC_INTERVAL: Duration = Duration::from_secs(10);
/// ACME: the certificate scan runs at least this often (it also runs on every change).
pub const ACME_SCAN_INTERVAL: Duration = Duration::from_secs(3600);
/// Default ACME directory: Let's Encrypt production.
pub const DEFAULT_ACME_DIRECTORY: &str = "https://acme-v02.api.letsencrypt.org/directory";

/// How long the edge lets open public connections finish on SIGTERM (under
/// Kubernetes' default 30 s termination grace period).
pub const DEFAULT_DRAIN_SECONDS: u64 = 25;
