//! The byte-stream adapter: one tunnel connection's HTTP/2 bytes carried in
//! binary WebSocket messages.
//!
//! Writes are coalesced: bytes accumulate until HTTP/2 flushes or
//! [`WS_MAX_BATCH`] is reached, then go out as one message. Small messages
//! flushed one by one cap a connection near 1 Gbit/s; batches reach several
//! times that. The cap keeps a small response from waiting behind a bulk one.
//!
//! The adapter also keeps the tunnel alive (WebSocket pings every
//! [`PING_INTERVAL`], a peer silent for [`DEAD_PEER_TIMEOUT`] is dead) and
//! carries the drain handshake as text messages ([`Control`]).

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use futures_util::task::AtomicWaker;
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Interval, Sleep};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use crate::constants::{
    DEAD_PEER_TIMEOUT, MSG_GOODBYE, MSG_GOODBYE_ACK, MSG_READY, PING_INTERVAL, WS_MAX_BATCH, WS_MAX_MESSAGE,
};

/// WebSocket settings of both tunnel ends.
pub fn ws_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(WS_MAX_MESSAGE))
        .max_frame_size(Some(WS_MAX_MESSAGE))
        .write_buffer_size(WS_MAX_BATCH)
        // tungstenite zero-fills its whole read buffer before each socket read.
        .read_buffer_size(16 * 1024)
}

/// Shared between a tunnel connection's adapter and whoever manages it: the
/// drain handshake and out-of-band text messages.
#[derive(Default)]
pub struct Control {
    outgoing: Mutex<VecDeque<&'static str>>,
    waker: AtomicWaker,
    /// The peer said goodbye (edge side: stop routing new streams here).
    peer_goodbye: AtomicBool,
    /// The edge acknowledged our goodbye (agent side).
    acked: AtomicBool,
    /// The edge routes streams to this connection (agent side).
    ready: AtomicBool,
    changed: Notify,
}

impl Control {
    /// Queues a text message; the connection's task sends it promptly.
    pub fn send(&self, msg: &'static str) {
        self.outgoing.lock().expect("poisoned").push_back(msg);
        self.waker.wake();
    }

    /// Whether the peer said it is draining.
    pub fn peer_is_draining(&self) -> bool {
        self.peer_goodbye.load(Ordering::Acquire)
    }

    /// Waits until the edge acknowledged our goodbye.
    pub async fn acked(&self) {
        self.wait_for(&self.acked).await
    }

    /// Waits until the edge said it routes streams here.
    pub async fn ready(&self) {
        self.wait_for(&self.ready).await
    }

    async fn wait_for(&self, flag: &AtomicBool) {
        loop {
            let notified = self.changed.notified();
            if flag.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn on_text(&self, text: &str) {
        match text {
            MSG_GOODBYE => {
                self.peer_goodbye.store(true, Ordering::Release);
                self.send(MSG_GOODBYE_ACK);
            }
            MSG_GOODBYE_ACK => self.acked.store(true, Ordering::Release),
            MSG_READY => self.ready.store(true, Ordering::Release),
            other => tracing::debug!(message = other, "ignoring unknown control message"),
        }
        self.changed.notify_waiters();
    }
}

/// `AsyncRead + AsyncWrite` over a WebSocket: see the module docs.
pub struct WsStream<S> {
    ws: WebSocketStream<S>,
    control: std::sync::Arc<Control>,
    read_buf: Bytes,
    write_buf: BytesMut,
    ping: Interval,
    dead_after: Pin<Box<Sleep>>,
    eof: bool,
}

impl<S> WsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    pub fn new(ws: WebSocketStream<S>, control: std::sync::Arc<Control>) -> Self {
        let mut ping = tokio::time::interval_at(Instant::now() + PING_INTERVAL, PING_INTERVAL);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        WsStream {
            ws,
            control,
            read_buf: Bytes::new(),
            write_buf: BytesMut::with_capacity(WS_MAX_BATCH),
            ping,
            dead_after: Box::pin(tokio::time::sleep(DEAD_PEER_TIMEOUT)),
            eof: false,
        }
    }

    /// Sends what is batched as one binary message (does not flush the socket).
    fn poll_send_batch(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_buf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(ws_to_io)?;
        let batch = self.write_buf.split().freeze();
        Pin::new(&mut self.ws).start_send(Message::Binary(batch)).map_err(ws_to_io)?;
        Poll::Ready(Ok(()))
    }

    /// Sends queued control messages and due pings. Called from `poll_read`,
    /// which the connection task polls all the time.
    fn poll_housekeeping(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        self.control.waker.register(cx.waker());
        let mut sent = false;
        loop {
            let next = self.control.outgoing.lock().expect("poisoned").front().copied();
            let Some(msg) = next else { break };
            match Pin::new(&mut self.ws).poll_ready(cx) {
                Poll::Ready(r) => r.map_err(ws_to_io)?,
                Poll::Pending => return Ok(()),
            }
            Pin::new(&mut self.ws).start_send(Message::text(msg)).map_err(ws_to_io)?;
            self.control.outgoing.lock().expect("poisoned").pop_front();
            sent = true;
        }
        while self.ping.poll_tick(cx).is_ready() {
            match Pin::new(&mut self.ws).poll_ready(cx) {
                Poll::Ready(r) => r.map_err(ws_to_io)?,
                Poll::Pending => return Ok(()),
            }
            Pin::new(&mut self.ws).start_send(Message::Ping(Bytes::new())).map_err(ws_to_io)?;
            sent = true;
        }
        if sent {
            // Pending is fine: the socket's readiness wakes this task again.
            if let Poll::Ready(r) = Pin::new(&mut self.ws).poll_flush(cx) {
                r.map_err(ws_to_io)?;
            }
        }
        Ok(())
    }
}

fn ws_to_io(e: WsError) -> io::Error {
    match e {
        WsError::Io(e) => e,
        WsError::ConnectionClosed | WsError::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "tunnel closed")
        }
        e => io::Error::other(e),
    }
}

impl<S> AsyncRead for WsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.poll_housekeeping(cx)?;
        loop {
            if !this.read_buf.is_empty() {
                let n = this.read_buf.len().min(buf.remaining());
                buf.put_slice(&this.read_buf.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            match Pin::new(&mut this.ws).poll_next(cx) {
                Poll::Ready(Some(Ok(msg))) => {
                    this.dead_after.as_mut().reset(Instant::now() + DEAD_PEER_TIMEOUT);
                    match msg {
                        Message::Binary(data) => this.read_buf = data,
                        Message::Text(text) => this.control.on_text(text.as_str()),
                        Message::Close(_) => this.eof = true,
                        // Pongs are answered by tungstenite; both count as life.
                        Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
                    }
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(ws_to_io(e))),
                Poll::Ready(None) => this.eof = true,
                Poll::Pending => {
                    if this.dead_after.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("tunnel peer silent for {DEAD_PEER_TIMEOUT:?}"),
                        )));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<S> AsyncWrite for WsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write_buf.len() >= WS_MAX_BATCH {
            ready!(this.poll_send_batch(cx))?;
        }
        let n = buf.len().min(WS_MAX_BATCH - this.write_buf.len());
        this.write_buf.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_batch(cx))?;
        Pin::new(&mut this.ws).poll_flush(cx).map_err(ws_to_io)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_batch(cx))?;
        match ready!(Pin::new(&mut this.ws).poll_close(cx)) {
            Ok(()) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(ws_to_io(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::tungstenite::protocol::Role;

    async fn pair() -> (WsStream<tokio::io::DuplexStream>, WsStream<tokio::io::DuplexStream>) {
        let (a, b) = tokio::io::duplex(256 * 1024);
        let a = WebSocketStream::from_raw_socket(a, Role::Client, Some(ws_config())).await;
        let b = WebSocketStream::from_raw_socket(b, Role::Server, Some(ws_config())).await;
        (WsStream::new(a, Arc::default()), WsStream::new(b, Arc::default()))
    }

    #[tokio::test]
    async fn carries_bytes_both_ways_in_order() {
        let (mut a, mut b) = pair().await;
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let expect = data.clone();
        let writer = tokio::spawn(async move {
            for chunk in data.chunks(7_000) {
                a.write_all(chunk).await.unwrap();
            }
            a.flush().await.unwrap();
            a.shutdown().await.unwrap();
            a
        });
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), expect.len());
        assert!(got == expect);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn goodbye_is_acknowledged() {
        let (mut agent, mut edge) = pair().await;
        let (agent_ctl, edge_ctl) = (agent.control.clone(), edge.control.clone());
        // Both sides must be polled for control messages to flow.
        let edge_task = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            let _ = edge.read(&mut buf).await;
        });
        let agent_task = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            let _ = agent.read(&mut buf).await;
        });
        agent_ctl.send(MSG_GOODBYE);
        tokio::time::timeout(std::time::Duration::from_secs(5), agent_ctl.acked())
            .await
            .expect("goodbye acknowledged");
        assert!(edge_ctl.peer_is_draining());
        edge_task.abort();
        agent_task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_detected_as_dead() {
        // The peer never reads or answers pings: after DEAD_PEER_TIMEOUT reads fail.
        let (a, _silent) = tokio::io::duplex(1 << 20);
        let ws = WebSocketStream::from_raw_socket(a, Role::Client, Some(ws_config())).await;
        let mut stream = WsStream::new(ws, Arc::default());
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 8];
        let err = stream.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= DEAD_PEER_TIMEOUT);
    }
}
