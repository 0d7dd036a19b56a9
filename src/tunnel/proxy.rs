//! Dialing the edge, directly or through an HTTP proxy (`HTTPS_PROXY`,
//! `NO_PROXY`) with `CONNECT`, and basic auth when the proxy URL has
//! credentials.

use std::io;

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest proxy response head we read.
const MAX_PROXY_RESPONSE: usize = 16 * 1024;

/// An HTTP proxy from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proxy {
    pub host: String,
    pub port: u16,
    /// `user:password`, percent-decoded.
    pub credentials: Option<String>,
}

impl Proxy {
    /// Parses `http://[user:pass@]host[:port]` (the scheme may be omitted).
    pub fn parse(url: &str) -> Result<Proxy, String> {
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some((scheme, _)) => {
                return Err(format!("proxy URL `{url}`: scheme `{scheme}` is not supported, use http://"));
            }
            None => url,
        };
        let authority = rest.split('/').next().unwrap_or_default();
        let (credentials, hostport) = match authority.rsplit_once('@') {
            Some((userinfo, hostport)) => (Some(crate::http::percent_decode_lossy(userinfo)), hostport),
            None => (None, authority),
        };
        let (host, port) = split_host_port(hostport, 80)
            .ok_or_else(|| format!("proxy URL `{url}` has no valid host:port"))?;
        Ok(Proxy { host, port, credentials })
    }

    /// The proxy for `host` from `HTTPS_PROXY`/`https_proxy` unless `NO_PROXY`
    /// excludes it.
    pub fn from_env(host: &str) -> Result<Option<Proxy>, String> {
        let var = |names: &[&str]| {
            names.iter().find_map(|n| std::env::var(n).ok().filter(|v| !v.trim().is_empty()))
        };
        let Some(url) = var(&["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]) else {
            return Ok(None);
        };
        if let Some(no_proxy) = var(&["NO_PROXY", "no_proxy"])
            && no_proxy_matches(&no_proxy, host)
        {
            return Ok(None);
        }
        Proxy::parse(url.trim()).map(Some)
    }
}

/// `NO_PROXY` rules: `*`, exact names, `.suffix` / `suffix` domain matches,
/// IP literals. Ports in entries are ignored.
pub fn no_proxy_matches(no_proxy: &str, host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    no_proxy.split(',').map(str::trim).filter(|e| !e.is_empty()).any(|entry| {
        if entry == "*" {
            return true;
        }
        let entry = entry.to_ascii_lowercase();
        let entry = entry.trim_start_matches('[');
        let entry = match entry.rsplit_once(':') {
            Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.contains(':') => h,
            _ => entry,
        }
        .trim_end_matches(']');
        let bare = entry.trim_start_matches("*.").trim_start_matches('.');
        host == bare || host.ends_with(&format!(".{bare}"))
    })
}

/// Splits `host[:port]` (IPv6 in brackets), defaulting the port.
pub fn split_host_port(s: &str, default_port: u16) -> Option<(String, u16)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None if after.is_empty() => default_port,
            None => return None,
        };
        return Some((host.to_string(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => Some((h.to_string(), p.parse().ok()?)),
        Some(_) => Some((s.to_string(), default_port)), // bare IPv6
        None if s.is_empty() => None,
        None => Some((s.to_string(), default_port)),
    }
}

/// Opens a TCP connection to `host:port`, through `proxy` if given.
pub async fn dial(host: &str, port: u16, proxy: Option<&Proxy>) -> io::Result<TcpStream> {
    let Some(proxy) = proxy else {
        let s = TcpStream::connect((host, port)).await?;
        s.set_nodelay(true)?;
        return Ok(s);
    };
    let mut s = TcpStream::connect((proxy.host.as_str(), proxy.port)).await.map_err(|e| {
        io::Error::new(e.kind(), format!("proxy {}:{} unreachable: {e}", proxy.host, proxy.port))
    })?;
    s.set_nodelay(true)?;
    let target = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
    if let Some(creds) = &proxy.credentials {
        let token = base64::engine::general_purpose::STANDARD.encode(creds);
        head.push_str(&format!("Proxy-Authorization: Basic {token}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await?;

    // Read the response head byte by byte-ish: nothing after it may be consumed,
    // since the TLS handshake follows on the same socket.
    let mut resp = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !resp.ends_with(b"\r\n\r\n") {
        if resp.len() >= MAX_PROXY_RESPONSE {
            return Err(io::Error::other("proxy response head too large"));
        }
        if s.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "proxy closed the connection during CONNECT",
            ));
        }
        resp.push(byte[0]);
    }
    let status_line = String::from_utf8_lossy(resp.split(|b| *b == b'\n').next().unwrap_or_default());
    let status = status_line.split_whitespace().nth(1).unwrap_or_default();
    match status {
        "200" => Ok(s),
        "407" => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "proxy {}:{} wants authentication: put user:password in the proxy URL ({})",
                proxy.host,
                proxy.port,
                status_line.trim()
            ),
        )),
        _ => Err(io::Error::other(format!(
            "proxy {}:{} refused CONNECT {target}: {}",
            proxy.host,
            proxy.port,
            status_line.trim()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proxy_urls() {
        assert_eq!(
            Proxy::parse("http://u%40x:p%3Aw@proxy.local:3128/").unwrap(),
            Proxy { host: "proxy.local".into(), port: 3128, credentials: Some("u@x:p:w".into()) }
        );
        assert_eq!(Proxy::parse("127.0.0.1:8888").unwrap().port, 8888);
        assert_eq!(Proxy::parse("http://proxy").unwrap().port, 80);
        assert!(Proxy::parse("socks5://x:1").is_err());
    }

    #[test]
    fn no_proxy_rules() {
        assert!(no_proxy_matches("*", "a.b"));
        assert!(no_proxy_matches("example.com", "edge.example.com"));
        assert!(no_proxy_matches(".example.com", "edge.example.com"));
        assert!(no_proxy_matches("localhost,127.0.0.1:443", "127.0.0.1"));
        assert!(!no_proxy_matches("example.com", "example.org"));
        assert!(!no_proxy_matches("ample.com", "example.com"));
    }

    #[test]
    fn host_ports() {
        assert_eq!(split_host_port("a:1", 2), Some(("a".into(), 1)));
        assert_eq!(split_host_port("a", 2), Some(("a".into(), 2)));
        assert_eq!(split_host_port("[::1]:5", 2), Some(("::1".into(), 5)));
        assert_eq!(split_host_port("a:x", 2), None);
    }
}
