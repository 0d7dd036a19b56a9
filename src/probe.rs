//! `culvert probe URL`: one HTTP GET that must answer 2xx, retried until a deadline.
//!
//! The image is `FROM scratch` with only `/culvert` (no shell, no curl, no wget), so the chart's
//! `helm test` Pod runs this against the operator's admin port (`/readyz`). Plain `http://` only:
//! the admin port speaks nothing else. Blocking std I/O, no runtime.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use clap::Args;

/// Arguments of `culvert probe`.
#[derive(Debug, Clone, Args)]
pub struct ProbeArgs {
    /// The URL to GET, e.g. http://culvert-test:9090/readyz (plain HTTP).
    pub url: String,

    /// Keep trying until this many seconds have passed (0: one attempt).
    #[arg(long, default_value_t = 60)]
    pub timeout_seconds: u64,
}

/// Errors of `culvert probe`.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("probe: {0:?} is not an http:// URL with a host (e.g. http://culvert-test:9090/readyz)")]
    BadUrl(String),
    #[error("probe: {url}: {last} (gave up after {seconds} s)")]
    Failed { url: String, last: String, seconds: u64 },
}

impl ProbeError {
    /// Static category for logs.
    pub fn category(&self) -> &'static str {
        match self {
            ProbeError::BadUrl(_) => "usage",
            ProbeError::Failed { .. } => "failed",
        }
    }
}

/// Time between attempts, and the limit of one attempt.
const RETRY_EVERY: Duration = Duration::from_secs(1);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);

/// Runs the probe: prints `probe ok: URL STATUS` on success.
pub fn run(args: ProbeArgs) -> Result<(), ProbeError> {
    let status = probe(&args.url, Duration::from_secs(args.timeout_seconds), RETRY_EVERY)?;
    println!("probe ok: {} {status}", args.url);
    Ok(())
}

/// GETs `url` until it answers 2xx or `deadline` has passed; returns the status code.
pub fn probe(url: &str, deadline: Duration, retry_every: Duration) -> Result<u16, ProbeError> {
    let (host, port, path) = parse(url).ok_or_else(|| ProbeError::BadUrl(url.to_string()))?;
    let start = Instant::now();
    loop {
        let last = match attempt(&host, port, &path) {
            Ok(code) if (200..300).contains(&code) => return Ok(code),
            Ok(code) => format!("answered {code}"),
            Err(e) => e.to_string(),
        };
        if start.elapsed() + retry_every > deadline {
            return Err(ProbeError::Failed { url: url.to_string(), last, seconds: deadline.as_secs() });
        }
        std::thread::sleep(retry_every);
    }
}

/// `http://HOST[:PORT][/PATH]` -> (host, port, path). IPv6 hosts in brackets.
fn parse(url: &str) -> Option<(String, u16, String)> {
    let rest = url.strip_prefix("http://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !p.contains(']') => (h, p.parse().ok()?),
        _ => (authority, 80),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| (host.to_string(), port, path))
}

/// One GET; the status code of the answer.
fn attempt(host: &str, port: u16, path: &str) -> std::io::Result<u16> {
    let addr = (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{host} has no address")))?;
    let mut conn = TcpStream::connect_timeout(&addr, ATTEMPT_TIMEOUT)?;
    conn.set_read_timeout(Some(ATTEMPT_TIMEOUT))?;
    conn.set_write_timeout(Some(ATTEMPT_TIMEOUT))?;
    let host_header = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: culvert-probe\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes())?;
    // The status line is all we need: "HTTP/1.1 200 OK".
    let mut head = Vec::new();
    let mut buf = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 4096 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let line = line.lines().next().unwrap_or("");
    line.strip_prefix("HTTP/1.")
        .and_then(|r| r.get(2..5))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {line:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A real server on 127.0.0.1 that answers the given statuses in turn, one per connection.
    fn server(statuses: Vec<u16>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for status in statuses {
                let (mut conn, _) = listener.accept().unwrap();
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.ends_with(b"\r\n\r\n") {
                    let n = conn.read(&mut buf).unwrap();
                    assert!(n > 0, "the probe closed before its request head ended");
                    req.extend_from_slice(&buf[..n]);
                }
                assert!(String::from_utf8_lossy(&req).starts_with("GET /readyz HTTP/1.1\r\n"));
                write!(conn, "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .unwrap();
            }
        });
        format!("http://{addr}/readyz")
    }

    #[test]
    fn retries_until_ready() {
        let url = server(vec![503, 503, 200]);
        let code = probe(&url, Duration::from_secs(10), Duration::from_millis(10)).unwrap();
        assert_eq!(code, 200);
    }

    #[test]
    fn gives_up_with_the_last_answer() {
        let url = server(vec![503; 100]);
        let err = probe(&url, Duration::from_millis(50), Duration::from_millis(10)).unwrap_err();
        assert_eq!(err.category(), "failed");
        assert!(err.to_string().contains("answered 503"), "{err}");
    }

    #[test]
    fn connection_refused_fails() {
        // A port that was just free: nothing listens there.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let err =
            probe(&format!("http://127.0.0.1:{port}/readyz"), Duration::ZERO, Duration::from_millis(10))
                .unwrap_err();
        assert!(err.to_string().contains("refused"), "{err}");
    }

    #[test]
    fn urls() {
        assert_eq!(parse("http://a:9090/readyz"), Some(("a".into(), 9090, "/readyz".into())));
        assert_eq!(parse("http://a"), Some(("a".into(), 80, "/".into())));
        assert_eq!(parse("http://[::1]:8080/x"), Some(("::1".into(), 8080, "/x".into())));
        for bad in ["https://a/", "a:80", "http://", "http://u@a/"] {
            assert!(
                matches!(probe(bad, Duration::ZERO, Duration::ZERO), Err(ProbeError::BadUrl(_))),
                "{bad}"
            );
        }
    }
}
