//! The wire between agent and edge (see ARCHITECTURE.md, "The wire"):
//!
//! ```text
//! agent ──TCP──▶ (HTTP CONNECT proxy) ──▶ edge:443, TLS 1.3,
//!   WebSocket upgrade on /_culvert/v1/connect with the tunnel key,
//!   binary messages carrying one byte stream ([`ws::WsStream`]),
//!   HTTP/2 over it: the edge is the h2 client, the agent the h2 server.
//! ```
//!
//! One public HTTP request is one h2 stream; one public TCP connection is one
//! full-duplex h2 stream whose request and response bodies carry the bytes;
//! one public UDP flow is one full-duplex stream of framed datagrams
//! ([`datagram`]).

/// `AsyncWrite` for a read-side wrapper `$ty<S>` that writes straight to its
/// `inner` stream, vectored writes included (a write of several slices stays
/// one system call).
macro_rules! write_through_inner {
    ($ty:ident) => {
        impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $ty<S> {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.inner.is_write_vectored()
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
            }
        }
    };
}
pub(crate) use write_through_inner;

pub(crate) mod backoff;
pub(crate) mod body;
pub(crate) mod budget;
pub mod client;
pub mod connect;
pub mod datagram;
pub(crate) mod handshake;
pub mod head;
pub mod mux;
pub(crate) mod proxy;
pub mod server;
pub mod stream;
pub mod tls;
pub(crate) mod ws;

/// What carries a tunnel connection's streams, chosen by the protocol
/// version of its handshake: h2 (version 1) or the multiplexer (version 2,
/// [`mux`], with [`head`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    H2,
    Mux,
}

impl Wire {
    /// Both, for tests that hold for either.
    pub const ALL: [Wire; 2] = [Wire::H2, Wire::Mux];

    pub fn of_version(version: u32) -> Wire {
        if version >= 2 { Wire::Mux } else { Wire::H2 }
    }
}

/// The multiplexer's settings on a tunnel connection (protocol version 2),
/// both ends: h2's stream window, and as many streams.
pub(crate) fn mux_config() -> mux::Config {
    use crate::constants::{H2_MAX_STREAMS, H2_STREAM_WINDOW};
    mux::Config { window: H2_STREAM_WINDOW, max_streams: H2_MAX_STREAMS as usize }
}

/// Points `slices` at the first buffers of `bufs`, for a vectored write;
/// how many it took.
pub(crate) fn io_slices<'a>(
    bufs: &'a std::collections::VecDeque<bytes::Bytes>,
    slices: &mut [std::io::IoSlice<'a>],
) -> usize {
    slices.iter_mut().zip(bufs).map(|(slice, b)| *slice = std::io::IoSlice::new(b)).count()
}

/// Drops the first `n` bytes of `bufs`: what a vectored write took.
pub(crate) fn advance(bufs: &mut std::collections::VecDeque<bytes::Bytes>, mut n: usize) {
    use bytes::Buf;
    while n > 0 {
        let front = bufs.front_mut().expect("wrote what was there");
        let k = front.len().min(n);
        front.advance(k);
        n -= k;
        if front.is_empty() {
            bufs.pop_front();
        }
    }
}

/// What a tunnelled stream is, from the `culvert-stream` header: a stream
/// without one is a plain HTTP request (the edge sends none for those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// A plain HTTP request.
    Http,
    /// An HTTP upgrade (WebSocket...): request head, then raw bytes both ways.
    Upgrade,
    /// Raw bytes of one public TCP (or TLS passthrough) connection.
    Tcp,
    /// The datagrams of one public UDP flow, framed by [`datagram`].
    Udp,
}

impl StreamKind {
    pub fn header_value(self) -> &'static str {
        match self {
            StreamKind::Http => "http",
            StreamKind::Upgrade => "upgrade",
            StreamKind::Tcp => "tcp",
            StreamKind::Udp => "udp",
        }
    }

    pub fn of<B>(req: &http::Request<B>) -> StreamKind {
        match req.headers().get(&crate::constants::names::STREAM).map(|v| v.as_bytes()) {
            Some(b"tcp") => StreamKind::Tcp,
            Some(b"udp") => StreamKind::Udp,
            Some(b"upgrade") => StreamKind::Upgrade,
            _ => StreamKind::Http,
        }
    }
}
