//! Byte pipes: TCP streams to their backend (with a PROXY protocol header
//! if asked), and upgraded HTTP streams once the backend switched protocols.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpStream, UdpSocket};
use tracing::{Instrument, debug, warn};

use super::backend::{RouteOptions, Scheme};
use super::forward::{self, agent_error, backend_request};
use crate::constants::{
    BACKEND_CONNECT_TIMEOUT, MAX_DATAGRAM, STATUS_HEADER, UDP_FLOW_QUEUE_BYTES, UPGRADE_HEADER,
};
use crate::http::strip_hop_by_hop;
use crate::tunnel::body::{self, BoxBody, ReadBody};
use crate::tunnel::datagram;
use crate::tunnel::stream::RecvBody;

/// A PROXY protocol header (HAProxy's, versions 1 and 2) written to a TCP
/// backend before the stream's bytes, so it learns the public client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProxyHeader {
    /// The text form: `PROXY TCP4 <client> <edge> <client port> <edge port>\r\n`.
    V1,
    /// The binary form.
    V2,
}

/// The 12 bytes every PROXY protocol v2 header starts with.
pub const PROXY_V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

impl ProxyHeader {
    /// The header for a connection from `client` to `server` (the address at
    /// the edge it reached). Without both, v1 says `UNKNOWN` and v2 `LOCAL`;
    /// mixed families are both sent as IPv6 (v4-mapped).
    pub fn encode(self, client: Option<SocketAddr>, server: Option<SocketAddr>) -> Vec<u8> {
        self.encode_for(false, client, server)
    }

    /// The v2 header of a UDP flow, sent before every datagram to the backend
    /// (a datagram transport has no stream to start with one): the protocol
    /// byte says UDP (`\x12` over IPv4, `\x22` over IPv6). v1 has no UDP form;
    /// it is refused before a flow gets here, and sends `UNKNOWN` if it does.
    pub fn encode_datagram(self, client: Option<SocketAddr>, server: Option<SocketAddr>) -> Vec<u8> {
        self.encode_for(true, client, server)
    }

    fn encode_for(self, datagram: bool, client: Option<SocketAddr>, server: Option<SocketAddr>) -> Vec<u8> {
        // The transport nibble of v2's protocol byte: 1 stream, 2 datagram.
        let transport = if datagram { 0x02 } else { 0x01 };
        let v6 = |a: SocketAddr| match a {
            SocketAddr::V4(v4) => SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port()),
            a => a,
        };
        let pair = match (client, server) {
            (Some(c), Some(s)) if c.is_ipv4() == s.is_ipv4() => Some((c, s)),
            (Some(c), Some(s)) => Some((v6(c), v6(s))),
            _ => None,
        };
        match (self, pair) {
            (ProxyHeader::V1, Some(_)) if datagram => b"PROXY UNKNOWN\r\n".to_vec(),
            (ProxyHeader::V1, Some((c, s))) => {
                let family = if c.is_ipv4() { "TCP4" } else { "TCP6" };
                format!("PROXY {family} {} {} {} {}\r\n", c.ip(), s.ip(), c.port(), s.port()).into_bytes()
            }
            (ProxyHeader::V1, None) => b"PROXY UNKNOWN\r\n".to_vec(),
            (ProxyHeader::V2, pair) => {
                let mut out = PROXY_V2_SIGNATURE.to_vec();
                let mut addrs = Vec::with_capacity(36);
                let (command, family) = match pair {
                    Some((SocketAddr::V4(c), SocketAddr::V4(s))) => {
                        addrs.extend(c.ip().octets());
                        addrs.extend(s.ip().octets());
                        (0x21, 0x10 | transport) // PROXY, TCP (UDP) over IPv4
                    }
                    Some((c, s)) => {
                        for a in [c, s] {
                            if let SocketAddr::V6(a) = v6(a) {
                                addrs.extend(a.ip().octets());
                            }
                        }
                        (0x21, 0x20 | transport) // PROXY, TCP (UDP) over IPv6
                    }
                    None => (0x20, 0x00), // LOCAL, unspecified
                };
                if let Some((c, s)) = pair {
                    addrs.extend(c.port().to_be_bytes());
                    addrs.extend(s.port().to_be_bytes());
                }
                out.extend([command, family]);
                out.extend((addrs.len() as u16).to_be_bytes());
                out.extend(addrs);
                out
            }
        }
    }
}

/// An `ip:port` the edge put in a stream header.
pub fn header_addr(parts: &http::request::Parts, name: &str) -> Option<SocketAddr> {
    parts.headers.get(name)?.to_str().ok()?.parse().ok()
}

async fn dial(addr: &str) -> Result<TcpStream, String> {
    dial_within(addr, BACKEND_CONNECT_TIMEOUT).await
}

async fn dial_within(addr: &str, limit: std::time::Duration) -> Result<TcpStream, String> {
    match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(format!("backend {addr} unreachable: {e}")),
        Err(_) => Err(format!("backend {addr} did not accept within {limit:?}")),
    }
}

/// Carries one UDP flow: a connected UDP socket to `addr`, datagrams from
/// the stream's body sent on it (each after `proxy_header`, if any), and its
/// replies queued into the response body. The queue toward the edge is
/// bounded: a reply that does not fit is dropped and counted
/// ([`super::metrics::udp_reply_dropped`]).
pub async fn udp(addr: String, proxy_header: Option<Vec<u8>>, body: RecvBody) -> Response<BoxBody> {
    let socket = match udp_connect(&addr).await {
        Ok(s) => Arc::new(s),
        Err(e) => {
            warn!(error = %e, "udp flow refused");
            return agent_error(StatusCode::BAD_GATEWAY, &e);
        }
    };
    let (queue, replies) = datagram::queue(UDP_FLOW_QUEUE_BYTES, UDP_QUEUED.clone());
    let ended = tokio_util::sync::CancellationToken::new();
    let up = socket.clone();
    let up_ended = ended.clone();
    tokio::spawn(
        async move {
            let _end = up_ended.drop_guard();
            let mut body = body;
            let mut decoder = datagram::Decoder::default();
            let mut out = Vec::new();
            while let Some(frame) = body.frame().await {
                let Ok(data) = frame.map_err(|e| debug!(error = %e, "udp flow: the edge's side ended"))
                else {
                    return;
                };
                let Ok(data) = data.into_data() else { continue };
                decoder.push(&data);
                loop {
                    let dg = match decoder.next_datagram() {
                        Ok(Some(dg)) => dg,
                        Ok(None) => break,
                        Err(e) => return warn!(error = %e, "udp flow: broken frame from the edge"),
                    };
                    let sent = match &proxy_header {
                        Some(h) => {
                            out.clear();
                            out.extend_from_slice(h);
                            out.extend_from_slice(&dg);
                            up.send(&out).await
                        }
                        None => up.send(&dg).await,
                    };
                    if let Err(e) = sent {
                        // ECONNREFUSED of an earlier datagram (nothing listens): keep going.
                        debug!(error = %e, "udp flow: send to the backend failed");
                    }
                }
            }
        }
        .in_current_span(),
    );
    tokio::spawn(
        async move {
            let mut buf = vec![0u8; MAX_DATAGRAM + 1];
            loop {
                let n = tokio::select! {
                    _ = ended.cancelled() => return,
                    _ = queue.closed() => return,
                    r = socket.recv(&mut buf) => match r {
                        Ok(n) => n,
                        Err(e) => {
                            debug!(error = %e, "udp flow: receive from the backend failed");
                            continue;
                        }
                    },
                };
                let Some(frame) = datagram::encode(&buf[..n.min(MAX_DATAGRAM + 1)]) else {
                    super::metrics::udp_reply_dropped("oversize");
                    continue;
                };
                if queue.offer(frame).is_err() {
                    super::metrics::udp_reply_dropped("queue_full");
                }
            }
        }
        .in_current_span(),
    );
    Response::new(body::boxed(replies))
}

/// Replies queued toward the edge over every flow of this process.
static UDP_QUEUED: LazyLock<Arc<datagram::Tally>> =
    LazyLock::new(|| datagram::Tally::new(crate::constants::UDP_QUEUE_TOTAL_BYTES));

async fn udp_connect(addr: &str) -> Result<UdpSocket, String> {
    let target = tokio::net::lookup_host(addr)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("backend {addr} does not resolve"))?;
    let any: SocketAddr = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("literal");
    let socket = UdpSocket::bind(any).await.map_err(|e| format!("udp socket for {addr}: {e}"))?;
    socket.connect(target).await.map_err(|e| format!("backend {addr} unreachable: {e}"))?;
    // A burst of replies waits here while the flow's task is busy.
    datagram::set_socket_buffers(&socket, UDP_FLOW_QUEUE_BYTES * 2);
    Ok(socket)
}

/// Pipes a TCP stream to `addr`, after the PROXY protocol header if any.
pub async fn tcp(addr: String, proxy_header: Option<Vec<u8>>, body: RecvBody) -> Response<BoxBody> {
    let mut stream = match dial(&addr).await {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "tcp stream refused");
            return agent_error(StatusCode::BAD_GATEWAY, &e);
        }
    };
    if let Some(header) = proxy_header
        && let Err(e) = tokio::io::AsyncWriteExt::write_all(&mut stream, &header).await
    {
        return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {addr}: {e}"));
    }
    let (read, write) = stream.into_split();
    tokio::spawn(
        async move {
            if let Err(e) = body::copy_body(body, write).await {
                debug!(error = %e, "tcp stream: client to backend ended");
            }
        }
        .in_current_span(),
    );
    Response::new(body::boxed(ReadBody::new(read)))
}

/// Forwards an upgrade (WebSocket) request to `authority` on a connection
/// of its own and, once the backend switches protocols, pipes the bytes
/// both ways. The caller has admitted the request.
pub async fn upgrade(
    parts: http::request::Parts,
    body: RecvBody,
    authority: &str,
    options: &RouteOptions,
) -> Response<BoxBody> {
    let mut parts = parts;
    if let Err(e) = options.filters.rewrite_request(&mut parts) {
        return agent_error(StatusCode::BAD_REQUEST, &e);
    }
    let server_name = parts.uri.host().map(str::to_string);
    let upgrade_to = parts.headers.get(UPGRADE_HEADER).cloned();
    let mut parts = backend_request(parts);
    let Some(upgrade_to) = upgrade_to else {
        return agent_error(StatusCode::BAD_REQUEST, "upgrade stream without culvert-upgrade");
    };
    options.filters.edit_request(&mut parts.headers);
    parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    parts.headers.insert(header::UPGRADE, upgrade_to);
    let stream = match dial_within(authority, options.connect_timeout).await {
        Ok(s) => s,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &e),
    };
    let handshake = match options.scheme {
        Scheme::Https { verify } => {
            match forward::tls_connect(stream, verify, server_name.as_deref(), authority).await {
                Ok(tls) => http1_handshake(tls).await,
                Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &e),
            }
        }
        _ => http1_handshake(stream).await,
    };
    let mut sender = match handshake {
        Ok(s) => s,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {authority}: {e}")),
    };
    let resp = match sender.send_request(Request::from_parts(parts, body::empty())).await {
        Ok(r) => r,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {authority}: {e}")),
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        let (mut parts, b) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        options.filters.edit_response(&mut parts.headers);
        return Response::from_parts(parts, body::boxed(b));
    }
    let mut headers = resp.headers().clone();
    let upgraded = match hyper::upgrade::on(resp).await {
        Ok(u) => u,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("upgrade failed: {e}")),
    };
    let upgraded_to = headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut headers);
    options.filters.edit_response(&mut headers);
    let (read, write) = tokio::io::split(TokioIo::new(upgraded));
    tokio::spawn(
        async move {
            if let Err(e) = body::copy_body(body, write).await {
                debug!(error = %e, "upgraded stream: client to backend ended");
            }
        }
        .in_current_span(),
    );
    let mut out = Response::new(body::boxed(ReadBody::new(read)));
    *out.headers_mut() = headers;
    out.headers_mut().insert(STATUS_HEADER, HeaderValue::from_static("101"));
    if let Some(v) = upgraded_to {
        out.headers_mut().insert(UPGRADE_HEADER, v);
    }
    out
}

/// An HTTP/1.1 client connection (with upgrades) over `io`, driven by its own task.
async fn http1_handshake<T>(io: T) -> Result<hyper::client::conn::http1::SendRequest<BoxBody>, hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_protocol_headers() {
        let c: SocketAddr = "203.0.113.7:51234".parse().unwrap();
        let s: SocketAddr = "192.0.2.1:20001".parse().unwrap();
        assert_eq!(
            ProxyHeader::V1.encode(Some(c), Some(s)),
            b"PROXY TCP4 203.0.113.7 192.0.2.1 51234 20001\r\n"
        );
        assert_eq!(ProxyHeader::V1.encode(None, Some(s)), b"PROXY UNKNOWN\r\n");
        let c6: SocketAddr = "[2001:db8::1]:4000".parse().unwrap();
        assert_eq!(
            ProxyHeader::V1.encode(Some(c6), Some(s)),
            b"PROXY TCP6 2001:db8::1 ::ffff:192.0.2.1 4000 20001\r\n"
        );
        let v2 = ProxyHeader::V2.encode(Some(c), Some(s));
        assert_eq!(&v2[..12], &PROXY_V2_SIGNATURE);
        assert_eq!(&v2[12..16], &[0x21, 0x11, 0, 12]);
        assert_eq!(&v2[16..], &[203, 0, 113, 7, 192, 0, 2, 1, 0xc8, 0x22, 0x4e, 0x21]);
        let v2 = ProxyHeader::V2.encode(Some(c6), Some(s));
        assert_eq!(&v2[12..16], &[0x21, 0x21, 0, 36]);
        assert_eq!(v2.len(), 16 + 36);
        assert_eq!(&ProxyHeader::V2.encode(None, None)[12..], &[0x20, 0x00, 0, 0]);
        // UDP: the same addresses, the datagram transport (\x12, \x22).
        let v2 = ProxyHeader::V2.encode_datagram(Some(c), Some(s));
        assert_eq!(&v2[12..16], &[0x21, 0x12, 0, 12]);
        assert_eq!(&v2[16..], &[203, 0, 113, 7, 192, 0, 2, 1, 0xc8, 0x22, 0x4e, 0x21]);
        assert_eq!(&ProxyHeader::V2.encode_datagram(Some(c6), Some(s))[12..14], &[0x21, 0x22]);
        assert_eq!(ProxyHeader::V1.encode_datagram(Some(c), Some(s)), b"PROXY UNKNOWN\r\n");
    }
}
