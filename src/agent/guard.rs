//! What the agent checks and limits on an HTTP route before and while a
//! request reaches its backend: credentials (HTTP Basic from htpasswd lines,
//! bearer tokens), the request body size, and how long the backend may stay
//! silent. Free of IO; `route` applies them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::HeaderMap;
use http::header::{self, HeaderValue};
use hyper::body::{Body, Frame, SizeHint};
use ring::digest;

use crate::BoxError;

/// Keys of an auth Secret.
pub const AUTH_KEY: &str = "auth";
pub const TOKEN_KEY: &str = "token";

/// How one htpasswd password is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Password {
    /// `{SHA}base64(sha1(password))` (`htpasswd -s`).
    Sha1(Vec<u8>),
    /// `{SSHA}base64(sha1(password + salt) + salt)` (`slappasswd`).
    SaltedSha1 { digest: Vec<u8>, salt: Vec<u8> },
    /// `{PLAIN}password`, kept as its SHA-256.
    Plain(Vec<u8>),
}

/// The credentials a route accepts: users with passwords (HTTP Basic) and
/// bearer tokens (kept as SHA-256 digests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    users: Vec<(String, Password)>,
    tokens: Vec<Vec<u8>>,
}

fn sha256(b: &[u8]) -> Vec<u8> {
    digest::digest(&digest::SHA256, b).as_ref().to_vec()
}

fn sha1(parts: &[&[u8]]) -> Vec<u8> {
    let mut ctx = digest::Context::new(&digest::SHA1_FOR_LEGACY_USE_ONLY);
    for p in parts {
        ctx.update(p);
    }
    ctx.finish().as_ref().to_vec()
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Credentials {
    /// Parses the `auth` (htpasswd lines) and `token` (one bearer token a
    /// line) values of an auth Secret; blank lines and `#` comments are skipped.
    pub fn parse(auth: Option<&str>, token: Option<&str>) -> Result<Credentials, String> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut out = Credentials::default();
        let lines = |s: Option<&str>| {
            s.unwrap_or("")
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect::<Vec<_>>()
        };
        for (n, line) in lines(auth).iter().enumerate() {
            let n = n + 1;
            let Some((user, secret)) = line.split_once(':') else {
                return Err(format!("`{AUTH_KEY}` line {n}: expected user:password-hash"));
            };
            if user.is_empty() {
                return Err(format!("`{AUTH_KEY}` line {n}: the user name is empty"));
            }
            let password = if let Some(h) = secret.strip_prefix("{SHA}") {
                let d = b64.decode(h).ok().filter(|d| d.len() == 20);
                Password::Sha1(
                    d.ok_or_else(|| format!("`{AUTH_KEY}` line {n}: {{SHA}} is not base64 of 20 bytes"))?,
                )
            } else if let Some(h) = secret.strip_prefix("{SSHA}") {
                let d = b64.decode(h).ok().filter(|d| d.len() > 20);
                let d = d.ok_or_else(|| {
                    format!("`{AUTH_KEY}` line {n}: {{SSHA}} is not base64 of a digest and a salt")
                })?;
                Password::SaltedSha1 { digest: d[..20].to_vec(), salt: d[20..].to_vec() }
            } else if let Some(p) = secret.strip_prefix("{PLAIN}") {
                Password::Plain(sha256(p.as_bytes()))
            } else {
                return Err(format!(
                    "`{AUTH_KEY}` line {n} (user {user}): unsupported password scheme; \
                     use {{SHA}} (`htpasswd -nbs user password`), {{SSHA}} or {{PLAIN}}password \
                     (bcrypt, MD5 and crypt hashes are not supported)"
                ));
            };
            out.users.push((user.to_string(), password));
        }
        for t in lines(token) {
            out.tokens.push(sha256(t.as_bytes()));
        }
        if out.users.is_empty() && out.tokens.is_empty() {
            return Err(format!("holds no credentials: give `{AUTH_KEY}` (htpasswd lines) or `{TOKEN_KEY}`"));
        }
        Ok(out)
    }

    /// Do the request's headers carry accepted credentials?
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let (scheme, rest) = value.trim().split_once(' ').unwrap_or((value, ""));
        let rest = rest.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            let given = sha256(rest.as_bytes());
            return self.tokens.iter().fold(false, |ok, t| ok | same(t, &given));
        }
        if !scheme.eq_ignore_ascii_case("basic") {
            return false;
        }
        let Some(decoded) = base64::engine::general_purpose::STANDARD.decode(rest).ok() else {
            return false;
        };
        let Some((user, password)) = std::str::from_utf8(&decoded).ok().and_then(|s| s.split_once(':'))
        else {
            return false;
        };
        let password = password.as_bytes();
        self.users.iter().filter(|(u, _)| u == user).any(|(_, p)| match p {
            Password::Sha1(d) => same(d, &sha1(&[password])),
            Password::SaltedSha1 { digest, salt } => same(digest, &sha1(&[password, salt])),
            Password::Plain(d) => same(d, &sha256(password)),
        })
    }

    /// `WWW-Authenticate` values of a 401.
    pub fn challenges(&self) -> Vec<HeaderValue> {
        let mut out = Vec::new();
        if !self.users.is_empty() {
            out.push(HeaderValue::from_static("Basic realm=\"culvert\", charset=\"UTF-8\""));
        }
        if !self.tokens.is_empty() {
            out.push(HeaderValue::from_static("Bearer realm=\"culvert\""));
        }
        out
    }
}

/// A body size: bytes, or with a unit `k`, `m`, `g` (powers of 1024). `0`
/// means no limit (`None`).
pub fn parse_size(s: &str) -> Result<Option<u64>, String> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c.to_ascii_lowercase()),
        _ => (s, ' '),
    };
    let shift = match unit {
        ' ' => 0,
        'k' => 10,
        'm' => 20,
        'g' => 30,
        _ => return Err(format!("`{s}`: the unit must be k, m or g")),
    };
    let n: u64 = digits.parse().map_err(|_| format!("`{s}` is not a size like 1048576, 512k, 10m or 1g"))?;
    let bytes = n.checked_mul(1 << shift).ok_or_else(|| format!("`{s}` is too large"))?;
    Ok((bytes > 0).then_some(bytes))
}

/// A request body that fails once more than `limit` bytes went through; the
/// flag says it did (the answer is then 413).
pub struct LimitedBody<B> {
    inner: B,
    left: u64,
    tripped: Arc<AtomicBool>,
}

impl<B> LimitedBody<B> {
    pub fn new(inner: B, limit: u64) -> (Self, Arc<AtomicBool>) {
        let tripped = Arc::new(AtomicBool::new(false));
        (LimitedBody { inner, left: limit, tripped: tripped.clone() }, tripped)
    }
}

impl<B> Body for LimitedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                if n > this.left {
                    this.tripped.store(true, Ordering::Relaxed);
                    return Poll::Ready(Some(Err("the request body is larger than the route allows".into())));
                }
                this.left -= n;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            other => other.map(|o| o.map(|r| r.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that fails when the backend sends nothing for `idle`.
pub struct IdleTimeoutBody<B> {
    inner: B,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<B> IdleTimeoutBody<B> {
    pub fn new(inner: B, idle: Duration) -> Self {
        IdleTimeoutBody { inner, idle, timer: Box::pin(tokio::time::sleep(idle)) }
    }
}

impl<B> Body for IdleTimeoutBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => {
                let deadline = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(deadline);
                Poll::Ready(r.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                    "the backend sent nothing for {:?} (the route's read timeout)",
                    this.idle
                )
                .into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user: &str, password: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Basic {v}")).unwrap());
        h
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).unwrap());
        h
    }

    #[test]
    fn htpasswd_lines_and_tokens() {
        // `htpasswd -nbs alice wonderland`; {SSHA} of "s3cret" with salt "salt".
        let ssha = {
            let mut d = sha1(&[b"s3cret", b"salt"]);
            d.extend(b"salt");
            base64::engine::general_purpose::STANDARD.encode(d)
        };
        let auth = format!(
            "# users\nalice:{{SHA}}tiY7sUhYKUwI5L3866kDY+ENcrQ=\n\nbob:{{PLAIN}}builder\ncarol:{{SSHA}}{ssha}\n"
        );
        let c = Credentials::parse(Some(&auth), Some("tok-1\n tok-2 \n")).unwrap();
        assert_eq!(c.users.len(), 3);
        assert!(c.allows(&basic("alice", "wonderland")));
        assert!(!c.allows(&basic("alice", "wonderlan")));
        assert!(c.allows(&basic("bob", "builder")));
        assert!(!c.allows(&basic("alice", "builder")), "another user's password");
        assert!(c.allows(&basic("carol", "s3cret")));
        assert!(!c.allows(&basic("mallory", "")));
        assert!(c.allows(&bearer("tok-2")));
        assert!(!c.allows(&bearer("tok-3")));
        assert!(!c.allows(&HeaderMap::new()));
        assert_eq!(c.challenges().len(), 2);
        let tokens_only = Credentials::parse(None, Some("t")).unwrap();
        assert!(!tokens_only.allows(&basic("t", "t")));
        assert_eq!(tokens_only.challenges(), [HeaderValue::from_static("Bearer realm=\"culvert\"")]);
    }

    #[test]
    fn unsupported_or_empty_credentials_are_refused() {
        for (auth, needle) in [
            ("alice:$2y$05$abcdefghijklmnopqrstuu", "unsupported password scheme"),
            ("alice:$apr1$x$y", "unsupported"),
            ("alice:plain", "unsupported"),
            ("no colon", "expected user:password-hash"),
            (":{PLAIN}x", "user name is empty"),
            ("a:{SHA}short", "20 bytes"),
            ("# only a comment", "no credentials"),
        ] {
            let e = Credentials::parse(Some(auth), None).unwrap_err();
            assert!(e.contains(needle), "{auth}: {e}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(Some(1 << 20)));
        assert_eq!(parse_size("512k"), Ok(Some(512 << 10)));
        assert_eq!(parse_size("10m"), Ok(Some(10 << 20)));
        assert_eq!(parse_size("10M"), Ok(Some(10 << 20)));
        assert_eq!(parse_size("1g"), Ok(Some(1 << 30)));
        assert_eq!(parse_size("0"), Ok(None));
        assert!(parse_size("10x").is_err());
        assert!(parse_size("m").is_err());
        assert!(parse_size("99999999999999999g").is_err());
    }
}
