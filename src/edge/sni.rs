//! TLS passthrough by SNI: the edge reads the ClientHello, and a host whose
//! agents publish `tls` gets the raw bytes (the backend terminates TLS);
//! every other connection is terminated here as usual, the bytes read so far
//! being the start of the TLS stream's input ([`crate::tunnel::tls::accept`]);
//! a passthrough connection replays them to the backend ([`Prefixed`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

/// Largest ClientHello record read before deciding.
const MAX_HELLO: usize = 16 * 1024 + 5;

/// A stream that first yields `prefix`, then reads from `inner`.
pub struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Bytes, inner: S) -> Self {
        Prefixed { prefix, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

crate::tunnel::write_through_inner!(Prefixed);

/// Reads the first TLS record (the ClientHello) and returns the bytes read
/// and the SNI host name, if any. Not-TLS input returns what was read and `None`.
pub async fn read_client_hello<S: AsyncRead + Unpin>(io: &mut S) -> io::Result<(Bytes, Option<String>)> {
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        if buf.len() >= 5 {
            if buf[0] != 0x16 {
                return Ok((buf.freeze(), None));
            }
            let need = 5 + u16::from_be_bytes([buf[3], buf[4]]) as usize;
            if buf.len() >= need || need > MAX_HELLO {
                let sni = server_name(&buf[5..need.min(buf.len())]);
                return Ok((buf.freeze(), sni));
            }
        }
        if io.read_buf(&mut buf).await? == 0 {
            return Ok((buf.freeze(), None));
        }
    }
}

/// The `server_name` extension of a ClientHello handshake message.
pub fn server_name(hs: &[u8]) -> Option<String> {
    let mut d = Reader(extension(hs, 0)?);
    let list = d.u16()? as usize;
    let mut names = Reader(d.take(list)?);
    while let Some(kind) = names.u8() {
        let n = names.u16()? as usize;
        let name = names.take(n)?;
        if kind == 0 {
            return std::str::from_utf8(name).ok().map(|s| s.to_ascii_lowercase());
        }
    }
    None
}

/// Whether a ClientHello handshake message offers the ALPN protocol `protocol`.
pub fn offers_alpn(hs: &[u8], protocol: &[u8]) -> bool {
    let offered = || -> Option<bool> {
        let mut d = Reader(extension(hs, 16)?);
        let list = d.u16()? as usize;
        let mut protocols = Reader(d.take(list)?);
        while let Some(n) = protocols.u8() {
            if protocols.take(n as usize)? == protocol {
                return Some(true);
            }
        }
        Some(false)
    };
    offered().unwrap_or(false)
}

/// The data of the extension of type `wanted` in a ClientHello handshake message.
fn extension(hs: &[u8], wanted: u16) -> Option<&[u8]> {
    let mut r = Reader(hs);
    if r.u8()? != 0x01 {
        return None; // not a ClientHello
    }
    r.skip(3)?; // handshake length
    r.skip(2 + 32)?; // version, random
    let sid = r.u8()? as usize;
    r.skip(sid)?;
    let suites = r.u16()? as usize;
    r.skip(suites)?;
    let comp = r.u8()? as usize;
    r.skip(comp)?;
    let ext_len = r.u16()? as usize;
    let mut exts = Reader(r.take(ext_len)?);
    while let (Some(ty), Some(len)) = (exts.u16(), exts.u16()) {
        let data = exts.take(len as usize)?;
        if ty == wanted {
            return Some(data);
        }
    }
    None
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A real ClientHello from rustls, captured through a duplex pipe.
    async fn hello_for(name: &str) -> Bytes {
        hello_with_alpn(name, Vec::new()).await
    }

    async fn hello_with_alpn(name: &str, alpn: Vec<Vec<u8>>) -> Bytes {
        let roots = rustls::RootCertStore::empty();
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = alpn;
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let name = rustls_pki_types::ServerName::try_from(name.to_string()).unwrap();
        tokio::spawn(async move {
            let _ = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, client).await;
        });
        let (bytes, _) = read_client_hello(&mut server).await.unwrap();
        bytes
    }

    #[tokio::test]
    async fn finds_the_server_name_of_a_real_client_hello() {
        let hello = hello_for("Secure.Example.org").await;
        assert_eq!(server_name(&hello[5..]).as_deref(), Some("secure.example.org"));
        let mut replay = Prefixed::new(hello.clone(), tokio::io::empty());
        let mut got = Vec::new();
        replay.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, hello.to_vec());
        assert!(!offers_alpn(&hello[5..], b"acme-tls/1"));
    }

    #[tokio::test]
    async fn finds_the_alpn_protocols_offered() {
        let hello = hello_with_alpn("a.example", vec![b"h2".to_vec(), b"acme-tls/1".to_vec()]).await;
        assert!(offers_alpn(&hello[5..], b"acme-tls/1"));
        assert!(offers_alpn(&hello[5..], b"h2"));
        assert!(!offers_alpn(&hello[5..], b"http/1.1"));
        assert!(!offers_alpn(&hello[5..], b"acme-tls"));
        assert_eq!(server_name(&hello[5..]).as_deref(), Some("a.example"));
        assert!(!offers_alpn(&[], b"h2"));
    }

    #[tokio::test]
    async fn not_tls_and_truncated_input_have_no_name() {
        let (bytes, sni) = read_client_hello(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).await.unwrap();
        assert_eq!((sni, &bytes[..4]), (None, &b"GET "[..]));
        assert_eq!(server_name(&[0x01, 0, 0]), None);
        assert_eq!(server_name(&[]), None);
    }
}
