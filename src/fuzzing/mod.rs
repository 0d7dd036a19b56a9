//! One entry point per fuzz target of `fuzz/` (see CONTRIBUTING.md,
//! "Fuzzing"), each taking the raw input bytes: they run the parser on it and
//! panic when a property the parser promises does not hold. The same
//! functions replay the kept corpus in `cargo test` (`corpus_replays`), and
//! the property tests (`props`) check the same parsers with generated input.
//!
//! Not part of culvert's interface: hidden from the docs and kept to what
//! the targets need.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, header};
use http_body_util::{BodyExt, Full};

use crate::agent::guard::Credentials;
use crate::agent::pipe::ProxyHeader;
use crate::api::{self, ApiKeyScope, PortRange};
use crate::constants::API_PREFIX;
use crate::edge::api::{ApiContext, EdgeHooks, names};
use crate::edge::store::Store;

mod oracle;
#[cfg(test)]
mod props;
#[cfg(test)]
mod replay;

thread_local! {
    /// A runtime for the async parsers (timers on: the WebSocket adapter
    /// and the API's body timeout use them).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| rt.block_on(f))
}

/// Target `client_hello`: the SNI parser on a record body, and the
/// ClientHello reader on the whole input (delivered in one piece).
pub fn client_hello(data: &[u8]) {
    if let Some(name) = crate::edge::sni::server_name(data) {
        assert_eq!(name, name.to_ascii_lowercase(), "the name is lower-cased");
    }
    let mut input = data;
    let (read, sni) = block_on(crate::edge::sni::read_client_hello(&mut input)).expect("a slice never fails");
    assert!(data.starts_with(&read), "the bytes read are replayed unchanged");
    if let Some(name) = sni {
        // The name comes from the first record, which was read completely.
        let len = 5 + u16::from_be_bytes([read[3], read[4]]) as usize;
        let record = &read[5..len.min(read.len())];
        assert_eq!(crate::edge::sni::server_name(record).as_deref(), Some(name.as_str()));
    }
}

/// Target `proxy_header`: addresses taken from the input, encoded as v1 and
/// v2, decoded again by the spec's rules ([`oracle::decode_proxy_header`]);
/// the input itself is decoded too (never a panic).
pub fn proxy_header(data: &[u8]) {
    let _ = oracle::decode_proxy_header(data);
    let mut bytes = data.iter().copied().chain(std::iter::repeat(0));
    let mut take = |n: usize| -> Vec<u8> { bytes.by_ref().take(n).collect() };
    let flags = take(1)[0];
    let mut addr = |present: bool, v6: bool| -> Option<SocketAddr> {
        present.then(|| {
            let ip: std::net::IpAddr = if v6 {
                <[u8; 16]>::try_from(take(16)).expect("16 bytes").into()
            } else {
                <[u8; 4]>::try_from(take(4)).expect("4 bytes").into()
            };
            let port = take(2);
            SocketAddr::new(ip, u16::from_be_bytes([port[0], port[1]]))
        })
    };
    let client = addr(flags & 1 != 0, flags & 2 != 0);
    let server = addr(flags & 4 != 0, flags & 8 != 0);
    proxy_round_trip(client, server);
}

/// Encodes both versions for these addresses and checks what a spec
/// decoder reads back.
pub fn proxy_round_trip(client: Option<SocketAddr>, server: Option<SocketAddr>) {
    let expected = match (client, server) {
        (Some(c), Some(s)) if c.is_ipv4() == s.is_ipv4() => Some((c, s)),
        (Some(c), Some(s)) => Some((oracle::v4_mapped(c), oracle::v4_mapped(s))),
        _ => None,
    };
    for (version, header) in [(1, ProxyHeader::V1), (2, ProxyHeader::V2)] {
        let mut wire = header.encode(client, server);
        let len = wire.len();
        wire.extend_from_slice(b"payload after the header");
        let decoded = oracle::decode_proxy_header(&wire)
            .unwrap_or_else(|e| panic!("v{version} header {:?} does not decode: {e}", &wire[..len]));
        assert_eq!(decoded.len, len, "v{version}: the header's length");
        assert_eq!(decoded.version, version);
        assert_eq!(decoded.addrs, expected, "v{version} for {client:?} -> {server:?}");
        if version == 1 {
            assert!(len <= 107, "a v1 line is at most 107 bytes");
        }
    }
}

/// A byte stream handed out in pieces whose sizes come from a script; a
/// zero in the script is a `Pending` (with a wake-up), then one byte.
/// Writes are counted and dropped.
pub(crate) struct Scripted<'a> {
    data: &'a [u8],
    sizes: &'a [u8],
    next: usize,
    pended: bool,
    written: &'a std::cell::Cell<usize>,
}

impl<'a> Scripted<'a> {
    pub(crate) fn new(data: &'a [u8], sizes: &'a [u8], written: &'a std::cell::Cell<usize>) -> Self {
        Scripted { data, sizes, next: 0, pended: false, written }
    }

    /// The next piece's size; 0: answer `Pending` first.
    fn size(&mut self) -> usize {
        let s = self.sizes.get(self.next % self.sizes.len().max(1)).copied().unwrap_or(255);
        if s == 0 && !self.pended {
            self.pended = true;
            return 0;
        }
        self.pended = false;
        self.next += 1;
        (s as usize).max(1)
    }
}

impl tokio::io::AsyncRead for Scripted<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let size = self.size();
        if size == 0 {
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        let n = size.min(buf.remaining()).min(self.data.len());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Scripted<'_> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.written.set(self.written.get() + buf.len());
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// What the WebSocket adapter made of a byte stream.
#[derive(Debug)]
pub struct WsOutcome {
    /// The binary payload bytes read, in order.
    pub data: Vec<u8>,
    /// The read error that ended the stream, if any (else a clean end).
    pub error: Option<std::io::Error>,
    /// Bytes the adapter wrote back (pongs, close replies).
    pub written: usize,
}

/// Reads `stream` through the tunnel's WebSocket adapter as `role`, in
/// pieces sized by `sizes` (see [`Scripted`]), with reads of `read_size`.
pub fn ws_read(stream: &[u8], role: crate::tunnel::ws::Role, sizes: &[u8], read_size: usize) -> WsOutcome {
    use tokio::io::AsyncReadExt;
    block_on(async {
        let written = std::cell::Cell::new(0);
        let io = Scripted::new(stream, sizes, &written);
        let mut ws = crate::tunnel::ws::WsStream::new(io, role, Arc::default());
        let mut data = Vec::new();
        let mut buf = vec![0u8; read_size.max(1)];
        let error = loop {
            match ws.read(&mut buf).await {
                Ok(0) => break None,
                Ok(n) => data.extend_from_slice(&buf[..n]),
                Err(e) => break Some(e),
            }
        };
        drop(ws);
        WsOutcome { data, error, written: written.get() }
    })
}

/// Target `ws_frames`: the first byte picks the role (bit 0: server or
/// client) and the read size, the next 8 the sizes of the pieces the
/// stream arrives in (0: not ready yet), the rest is the stream. What is
/// read does not depend on the pieces.
pub fn ws_frames(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else { return };
    let (sizes, stream) = rest.split_at(rest.len().min(8));
    let role = if first & 1 == 0 { crate::tunnel::ws::Role::Server } else { crate::tunnel::ws::Role::Client };
    let out = ws_read(stream, role, sizes, (first >> 1) as usize + 1);
    assert!(out.data.len() <= stream.len(), "no more payload than input");
    // A pong echoes its ping's payload; the smallest ping (2 bytes, from
    // the edge) gets a masked 6-byte pong: at most 3 times the input.
    assert!(out.written <= 3 * stream.len() + 16, "{} bytes written for {} read", out.written, stream.len());
    let whole = ws_read(stream, role, &[255], 4096);
    assert!(whole.data == out.data, "the payload depends on how the stream was split");
    assert_eq!(whole.error.map(|e| e.kind()), out.error.map(|e| e.kind()));
}

/// Target `mux_frames`: the tunnel multiplexer (`tunnel::mux`) fed the
/// input as its peer's bytes. The first byte picks the side (bit 0) and the
/// size of the decoder's pieces, the next 8 the sizes the connection reads
/// the input in. The frames decoded, and the error that stops them, do not
/// depend on the pieces; encoding those frames again gives the bytes they
/// came from; a connection driven with the input ends (cleanly, or with an
/// `InvalidData` error saying why) and its streams never read more than
/// the input carried.
pub fn mux_frames(data: &[u8]) {
    use crate::tunnel::mux::{self, frame::Frame};
    let Some((&first, rest)) = data.split_first() else { return };
    let (sizes, stream) = rest.split_at(rest.len().min(8));
    let decode = |piece: usize| {
        let (mut buf, mut frames, mut fed) = (bytes::BytesMut::new(), Vec::new(), 0);
        loop {
            match Frame::decode(&mut buf) {
                Ok(Some(f)) => frames.push(f),
                Err(e) => return (frames, Some(e)),
                Ok(None) if fed == stream.len() => return (frames, None),
                Ok(None) => {
                    let n = piece.min(stream.len() - fed);
                    buf.extend_from_slice(&stream[fed..fed + n]);
                    fed += n;
                }
            }
        }
    };
    let whole = decode(stream.len().max(1));
    assert_eq!(whole, decode((first >> 1) as usize + 1), "the frames depend on how the input was split");
    let mut again = bytes::BytesMut::new();
    whole.0.iter().for_each(|f| f.encode(&mut again));
    assert_eq!(&again[..], &stream[..again.len()], "a frame encodes back to other bytes");

    let side = if first & 1 == 0 { mux::Side::Agent } else { mux::Side::Edge };
    let config = mux::Config { window: 64 * 1024, max_streams: 16 };
    block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut peer, io) = tokio::io::duplex(64 * 1024);
        let (handle, mut incoming, conn) = mux::new(io, side, config);
        drop(handle);
        let conn = tokio::spawn(conn);
        let readers = tokio::spawn(async move {
            let mut streams = Vec::new();
            while let Some(mut s) = incoming.accept().await {
                streams.push(tokio::spawn(async move {
                    let mut got = 0;
                    while let Ok(Some(chunk)) = s.recv_chunk().await {
                        got += match chunk {
                            mux::Chunk::Data(b) | mux::Chunk::Head(b) => b.len(),
                        };
                    }
                    got
                }));
            }
            let mut total = 0;
            for s in streams {
                total += s.await.expect("a stream reader");
            }
            total
        });
        let (mut read_half, mut write_half) = tokio::io::split(&mut peer);
        let drain = async {
            let mut sink = Vec::new();
            let _ = read_half.read_to_end(&mut sink).await;
        };
        let feed = async {
            let mut at = 0;
            for &size in sizes.iter().cycle() {
                if at == stream.len() {
                    break;
                }
                let n = (size as usize).max(1).min(stream.len() - at);
                if write_half.write_all(&stream[at..at + n]).await.is_err() {
                    break;
                }
                at += n;
                tokio::task::yield_now().await;
            }
            let _ = write_half.shutdown().await;
        };
        tokio::join!(drain, feed);
        match conn.await.expect("the connection's task") {
            Ok(()) => {}
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}"),
        }
        let read = readers.await.expect("the readers");
        assert!(read <= stream.len(), "streams read {read} bytes of a {}-byte input", stream.len());
    });
}

/// Target `h1_response`: what a plain-HTTP backend answers the agent
/// (`agent::h1`). The first byte's bit 0 says whether the request was a
/// `HEAD`, the next 8 are the sizes of the pieces the answer arrives in, the
/// rest is the answer (the connection ends after it). The head, the body's
/// bytes and trailers and how it ends do not depend on the pieces, and the
/// body is never longer than the input.
pub fn h1_response(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else { return };
    let (sizes, stream) = rest.split_at(rest.len().min(8));
    let head_request = first & 1 == 1;
    let pieces = crate::agent::h1::decode(stream, sizes, head_request);
    assert!(pieces.data.len() <= stream.len(), "more body than input");
    let whole = crate::agent::h1::decode(stream, &[], head_request);
    assert_eq!(pieces, whole, "the answer depends on how it arrived");
}

/// Headers the edge never passes on from a client: hop-by-hop ones and the
/// forwarding headers it writes itself (plus, below, whatever `Connection`
/// names and every `culvert-` header but the two the edge sets).
const NEVER_FROM_CLIENT: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    "host",
    "x-real-ip",
    "forwarded",
    "true-client-ip",
    "x-client-ip",
    "cf-connecting-ip",
    "x-original-forwarded-for",
];

/// The edge's part of a public request's head: the host it asked for, the
/// upgrade, and the head rewritten for the tunnel, checked against what
/// `edge::public::head` promises. The reservation's host is the asked-for
/// name when it is a valid one.
fn check_public_head<B>(req: Request<B>) {
    use crate::constants::{STREAM_HEADER, UPGRADE_HEADER};
    use crate::edge::public::{head, upgrade};
    let asked = head::request_host(&req).unwrap_or_default();
    let name = crate::edge::routes::normalize_host(asked);
    assert_eq!(name, name.to_ascii_lowercase());
    let host = names::normalize_hostname(&name).unwrap_or_else(|_| "app.example.com".into());
    let upgrade = upgrade::upgrade_of(&req, &["websocket".to_string()]);
    let (mut parts, _) = req.into_parts();
    let pq = parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into());
    let listed: Vec<String> = parts
        .headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    let peer: SocketAddr = "203.0.113.9:40000".parse().expect("an address");
    let Ok(forwarding) = head::rewrite_request(&mut parts, &host, peer, "https", 443, upgrade.as_ref())
    else {
        return; // answered 400
    };
    // What the agent gets: the head as the multiplexer carries it, read back.
    let block = crate::tunnel::head::encode_request(&parts, &forwarding);
    let parts = crate::tunnel::head::decode_request(&block).expect("the edge's head parses");
    assert_eq!(parts.uri.scheme_str(), Some("https"));
    assert_eq!(parts.uri.authority().map(|a| a.as_str()), Some(host.as_str()));
    assert_eq!(parts.uri.path_and_query().map(|p| p.as_str()), Some(pq.as_str()));
    assert_eq!(parts.version, http::Version::HTTP_2);
    let h = &parts.headers;
    let all = |name: &str| h.get_all(name).iter().map(|v| v.as_bytes().to_vec()).collect::<Vec<_>>();
    assert_eq!(all("x-forwarded-for"), [b"203.0.113.9".to_vec()]);
    assert_eq!(all("x-forwarded-proto"), [b"https".to_vec()]);
    assert_eq!(all("x-forwarded-host"), [host.as_bytes().to_vec()]);
    assert_eq!(all("x-forwarded-port"), [b"443".to_vec()]);
    let kind = upgrade.as_ref().map(|_| b"upgrade".to_vec());
    assert_eq!(all(STREAM_HEADER), kind.into_iter().collect::<Vec<_>>());
    assert_eq!(all(UPGRADE_HEADER), upgrade.iter().map(|u| u.as_bytes().to_vec()).collect::<Vec<_>>());
    let ours = [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-forwarded-port",
        STREAM_HEADER,
        UPGRADE_HEADER,
    ];
    for name in h.keys().map(|k| k.as_str()) {
        assert!(!NEVER_FROM_CLIENT.contains(&name), "{name} reaches the agent");
        assert!(ours.contains(&name) || !name.starts_with("culvert-"), "{name} reaches the agent");
        assert!(
            ours.contains(&name) || !listed.iter().any(|t| t == name),
            "{name} (in Connection) reaches the agent"
        );
    }
}

/// Target `http_head`: the input is what a client sends on a public
/// connection (HTTP/1.1, or h2 after its preface), served by hyper as the
/// edge serves it; every request head goes through the edge's head
/// handling ([`check_public_head`]). The edge's HTTP/1.1 fast path reads it
/// too, and as an agent's response head (`edge::public::h1::check_heads`).
pub fn http_head(data: &[u8]) {
    crate::edge::public::h1::check_heads(data);
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // h2 streams are served in tasks of their own, whose panics tokio
    // catches: a failed check is kept and raised here.
    let failed = Arc::new(std::sync::Mutex::new(None::<String>));
    block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
            let failed = failed.clone();
            async move {
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_public_head(req)))
                {
                    let what = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
                    *failed.lock().expect("not poisoned") = Some(what.unwrap_or_default());
                }
                Ok::<_, std::convert::Infallible>(hyper::Response::new(http_body_util::Empty::<Bytes>::new()))
            }
        });
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).max_buf_size(crate::constants::MAX_HEADER_BYTES);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(crate::constants::MAX_HEADER_BYTES as u32);
        let serve = builder.serve_connection_with_upgrades(TokioIo::new(server), service);
        let talk = async {
            let _ = client.write_all(data).await;
            let _ = client.shutdown().await;
            let mut answer = Vec::new();
            let _ = client.read_to_end(&mut answer).await;
        };
        let (_, ()) = tokio::join!(serve, talk);
    });
    if let Some(what) = failed.lock().expect("not poisoned").take() {
        panic!("the edge's head handling: {what}");
    }
}

/// Target `htpasswd`: the input is `auth` text, a NUL, `token` text, a NUL,
/// and an `Authorization` value.
pub fn htpasswd(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\0');
    let (auth, token, authorization) = (parts.next(), parts.next(), parts.next());
    let Ok(credentials) = Credentials::parse(auth, token) else { return };
    assert!(!credentials.challenges().is_empty(), "parsed credentials hold something");
    if let Some(v) = authorization.and_then(|a| HeaderValue::from_str(a).ok()) {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, v);
        let _ = credentials.allows(&headers);
    }
}

/// Target `api_json`: every body type of the control API from the input;
/// what parses serialises and parses back to the same value. The other
/// text parsers of the API (selectors, port ranges, labels, host names) run
/// on the input as well.
pub fn api_json(data: &[u8]) {
    fn round_trip<T>(data: &[u8])
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        if let Ok(v) = serde_json::from_slice::<T>(data) {
            let json = serde_json::to_vec(&v).expect("serialises");
            let back: T = serde_json::from_slice(&json).expect("parses what it wrote");
            assert_eq!(back, v, "{}", String::from_utf8_lossy(&json));
        }
    }
    round_trip::<api::ReserveDomainRequest>(data);
    round_trip::<api::ReservePortRequest>(data);
    round_trip::<api::CreateTunnelKeyRequest>(data);
    round_trip::<api::CreateApiKeyRequest>(data);
    round_trip::<api::UpdateApiKeyRequest>(data);
    round_trip::<api::Reservation>(data);
    round_trip::<api::TunnelKey>(data);
    round_trip::<api::ApiKey>(data);
    round_trip::<api::Info>(data);
    round_trip::<api::List<api::Reservation>>(data);
    round_trip::<api::ReleaseResponse>(data);
    round_trip::<api::CreatedTunnelKey>(data);
    round_trip::<api::CreatedApiKey>(data);
    if let Ok(e) = serde_json::from_slice::<api::ErrorBody>(data) {
        let back: api::ErrorBody = serde_json::from_slice(&serde_json::to_vec(&e).unwrap()).unwrap();
        assert_eq!((back.error.code, back.error.message), (e.error.code, e.error.message));
    }
    let text = String::from_utf8_lossy(data);
    names(&text);
}

/// The text parsers behind the API and the CLIs, with the properties each
/// promises.
pub fn names(text: &str) {
    let _ = api::Selector::parse(text);
    if let Ok(r) = PortRange::parse(text) {
        assert!(r.first >= 1 && r.first <= r.last);
        assert_eq!(PortRange::parse(&r.to_string()), Ok(r));
    }
    if let Ok((k, v)) = api::parse_label(text) {
        assert_eq!((k.trim(), v.trim()), (k.as_str(), v.as_str()));
        let labels = api::Labels::from([(k, v)]);
        if api::validate_labels(&labels).is_ok() {
            let (k, v) = labels.into_iter().next().expect("one label");
            let selector = api::Selector::parse(&format!("{k}={v}")).expect("a valid label selects");
            assert!(selector.matches(&api::Labels::from([(k, v)])));
        }
    }
    if let Ok(host) = names::normalize_hostname(text) {
        assert!(host.len() <= 253);
        assert_eq!(names::normalize_hostname(&host).ok().as_deref(), Some(host.as_str()));
        assert_eq!(crate::edge::routes::normalize_host(&host), host);
    }
    let domain = "edge.example.com";
    if let Ok(host) = names::subdomain(text, domain) {
        assert_eq!(names::custom_or_subdomain(&host, domain).ok().map(|(_, h)| h), Some(host));
    }
    let _ = names::custom_or_subdomain(text, domain);
    let _ = crate::edge::routes::normalize_host(text);
    let _ = crate::agent::guard::parse_size(text);
    if let Some(decoded) = crate::http::percent_decode(text) {
        assert_eq!(crate::http::percent_decode_lossy(text), decoded);
    }
}

struct NoHooks;

impl EdgeHooks for NoHooks {
    fn state_changed(&self) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
    fn connections_for_key(&self, _: &str) -> usize {
        0
    }
}

/// The control API with a store of its own: an admin key and an endpoints
/// key, whose secrets replace `$ADMIN` and `$ENDPOINTS` in requests.
pub struct ApiFuzz {
    ctx: ApiContext,
    admin: String,
    endpoints: String,
}

impl ApiFuzz {
    /// Opens (or creates) the store in `dir`.
    pub fn open(dir: &Path) -> ApiFuzz {
        let store = Store::open(dir).expect("a store in a fresh directory");
        let admin = match store.engine().ensure_admin_key().expect("admin key") {
            Some(secret) => secret,
            None => store.engine().create_api_key("fuzz admin", ApiKeyScope::Admin).expect("admin key").1,
        };
        let (_, endpoints) =
            store.engine().create_api_key("fuzz", ApiKeyScope::Endpoints).expect("endpoints key");
        let ctx = ApiContext {
            store,
            domain: "edge.example.com".into(),
            public_host: "edge.example.com".into(),
            public_https_port: 443,
            tcp_ports: PortRange { first: 20000, last: 20031 },
            acme: false,
            hooks: Arc::new(NoHooks),
            reserved_names: crate::edge::api::RESERVED_NAMES.iter().map(|n| n.to_string()).collect(),
            serial: Default::default(),
        };
        ApiFuzz { ctx, admin, endpoints }
    }

    /// Target `api_request`: the input is a request head as text (`METHOD
    /// path-under-the-API-prefix?query`, then `name: value` lines), a blank
    /// line and the body. Every answer is JSON; errors have the one error
    /// shape; nothing is a 500.
    pub fn request(&self, data: &[u8]) {
        let text = String::from_utf8_lossy(data);
        let (head, body) = text.split_once("\n\n").unwrap_or((&text, ""));
        let mut lines = head.lines();
        let Some((method, target)) = lines.next().and_then(|l| l.split_once(' ')) else { return };
        let mut req = Request::builder().method(method).uri(format!("{API_PREFIX}{target}"));
        for line in lines {
            let Some((name, value)) = line.split_once(':') else { continue };
            let value = value.trim().replace("$ADMIN", &self.admin).replace("$ENDPOINTS", &self.endpoints);
            req = req.header(name.trim(), value);
        }
        let Ok(req) = req.body(Full::new(Bytes::from(body.to_string()))) else { return };
        let (status, json) = block_on(async {
            let response = crate::edge::api::handle(&self.ctx, req).await;
            let status = response.status();
            (status, response.into_body().collect().await.expect("a full body").to_bytes())
        });
        let value: serde_json::Value = serde_json::from_slice(&json).expect("every answer is JSON");
        assert_ne!(status, http::StatusCode::INTERNAL_SERVER_ERROR, "{value}");
        if !status.is_success() {
            let error = serde_json::from_value::<api::ErrorBody>(value.clone())
                .unwrap_or_else(|_| panic!("{status}: not the error shape: {value}"));
            assert!(!error.error.code.is_empty() && !error.error.message.is_empty(), "{value}");
        }
    }
}

/// The store directory of the `api_request` target: `$CULVERT_FUZZ_STORE`
/// (`scripts/fuzz` makes one and removes it), else one per process under
/// the temporary directory.
fn api_fuzz_dir() -> std::path::PathBuf {
    match std::env::var_os("CULVERT_FUZZ_STORE") {
        Some(dir) => dir.into(),
        None => std::env::temp_dir().join(format!("culvert-fuzz-api-{}", std::process::id())),
    }
}

thread_local! {
    static API: RefCell<Option<ApiFuzz>> = const { RefCell::new(None) };
}

/// [`ApiFuzz::request`] on a per-thread store made at the first call.
pub fn api_request(data: &[u8]) {
    API.with(|api| {
        let mut api = api.borrow_mut();
        api.get_or_insert_with(|| ApiFuzz::open(&api_fuzz_dir())).request(data);
    });
}
