//! The byte-stream adapter: one tunnel connection's HTTP/2 bytes carried in
//! binary WebSocket messages (RFC 6455 framing, written here rather than
//! with a general WebSocket library so that the bytes are copied as little as
//! possible).
//!
//! Reads go straight from the TLS stream into HTTP/2's buffer: a frame
//! header is parsed, then its payload is read (and unmasked) in place; no
//! intermediate message buffer, no zero-filled read buffer.
//!
//! The agent (the WebSocket client) masks its frames with an all-zero key: a
//! well-formed masked frame for the TLS-inspecting proxies on the way, and no
//! XOR over the payload on either end. Frames from other clients are
//! unmasked as RFC 6455 says.
//!
//! Small writes are coalesced: bytes accumulate until HTTP/2 flushes or
//! [`WS_MAX_BATCH`] is reached, then go out as one binary frame. Small frames
//! flushed one by one cap a connection near 1 Gbit/s; batches reach several
//! times that. The cap keeps a small response from waiting behind a bulk one.
//! A large write (an HTTP/2 DATA frame with its header) becomes a frame of
//! its own, written with its WebSocket header in one vectored write, so the
//! TLS layer seals it straight from HTTP/2's buffers: no copy on the way.
//!
//! The adapter also keeps the tunnel alive (WebSocket pings every
//! [`PING_INTERVAL`], a peer silent for [`DEAD_PEER_TIMEOUT`] is dead),
//! answers pings and close frames, and carries the drain handshake as text
//! messages ([`Control`]).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Interval, Sleep};

use crate::constants::{
    DEAD_PEER_TIMEOUT, MSG_GOODBYE, MSG_GOODBYE_ACK, MSG_READY, PING_INTERVAL, WS_MAX_BATCH,
};

/// Which end of the WebSocket connection this is: clients mask what they send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Server,
}

/// Largest text message (control messages are a few bytes).
const MAX_TEXT: usize = 4096;
/// Largest control frame payload (RFC 6455 5.5).
const MAX_CONTROL: u64 = 125;

const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xA;

/// Shared between a tunnel connection's adapter and whoever manages it: the
/// drain handshake and out-of-band text messages.
#[derive(Default)]
pub struct Control {
    outgoing: Mutex<VecDeque<&'static str>>,
    /// Something is in `outgoing` (checked without the lock on every read).
    queued: AtomicBool,
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
    /// Queues a text message; the connection's task sends it promptly. A
    /// message already waiting is not queued twice, so the queue holds at
    /// most one of each message however often the peer asks for an answer.
    pub fn send(&self, msg: &'static str) {
        let mut outgoing = self.outgoing.lock().expect("poisoned");
        if outgoing.contains(&msg) {
            return;
        }
        outgoing.push_back(msg);
        drop(outgoing);
        self.queued.store(true, Ordering::Release);
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

    fn take_outgoing(&self) -> Vec<&'static str> {
        if !self.queued.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        self.outgoing.lock().expect("poisoned").drain(..).collect()
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

/// What the frame being read carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Payload {
    /// Tunnel bytes: handed to the reader as they arrive.
    Data,
    /// A text message (fragment): collected.
    Text,
    /// A control frame: collected, then acted on.
    Control(u8),
}

/// The frame being read.
struct Frame {
    payload: Payload,
    fin: bool,
    left: u64,
    mask: Option<[u8; 4]>,
    /// Payload bytes already read (the mask's phase).
    offset: usize,
}

/// Room kept in front of a batch for its frame header (the longest: 8-byte
/// length and a mask), so that header and payload go out as one write and
/// one TLS record.
const HEAD_ROOM: usize = 14;

/// Writes of at least this much go straight to the socket as a frame of
/// their own ([`WsStream::poll_write_direct`]); smaller ones are coalesced.
const DIRECT_MIN: usize = 4 * 1024;
/// Largest direct frame: one HTTP/2 frame, header included.
const DIRECT_MAX: usize = crate::constants::H2_MAX_FRAME as usize + 9;
/// Most slices of one direct write (the frame header and payload pieces).
const DIRECT_SLICES: usize = 16;

/// A binary frame on its way out, and how much of it was written.
struct Outgoing {
    frame: Bytes,
    written: usize,
}

/// `AsyncRead + AsyncWrite` over a WebSocket: see the module docs.
pub struct WsStream<S> {
    io: S,
    role: Role,
    control: Arc<Control>,
    // Reading.
    head: [u8; 14],
    head_len: usize,
    frame: Option<Frame>,
    /// The message being continued by continuation frames is text.
    in_text: bool,
    /// A binary message is being continued by continuation frames.
    binary_open: bool,
    collected: Vec<u8>,
    text: Vec<u8>,
    eof: bool,
    // Writing.
    /// [`HEAD_ROOM`] bytes, then the payload of the next binary frame.
    batch: BytesMut,
    out: Option<Outgoing>,
    /// Payload bytes of a direct frame whose header is out and whose payload
    /// is not yet: the next bytes written are that payload, written as they
    /// come, and nothing else goes out until it is complete.
    direct_left: usize,
    /// Encoded control frames, sent between binary frames. Refilled only
    /// once empty, so a peer that does not read cannot make it grow.
    control_out: BytesMut,
    /// The payload of the latest ping not answered yet: pongs are coalesced
    /// (RFC 6455 5.5.3 allows answering only the most recent ping).
    pong: Option<Vec<u8>>,
    /// A ping of ours is due.
    ping_due: bool,
    /// Since when output has been waiting for a socket that takes nothing.
    stalled_since: Option<Instant>,
    /// Given back what goes out (the edge's upload budget).
    budget: Option<Arc<super::budget::Budget>>,
    close_sent: bool,
    // Keepalive.
    ping: Interval,
    dead_after: Pin<Box<Sleep>>,
    last_seen: Instant,
}

impl<S> WsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    /// Wraps a stream on which the WebSocket handshake is done.
    pub fn new(io: S, role: Role, control: Arc<Control>) -> Self {
        let mut ping = tokio::time::interval_at(Instant::now() + PING_INTERVAL, PING_INTERVAL);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        WsStream {
            io,
            role,
            control,
            head: [0; 14],
            head_len: 0,
            frame: None,
            in_text: false,
            binary_open: false,
            collected: Vec::new(),
            text: Vec::new(),
            eof: false,
            batch: BytesMut::new(),
            out: None,
            direct_left: 0,
            control_out: BytesMut::new(),
            pong: None,
            ping_due: false,
            stalled_since: None,
            budget: None,
            close_sent: false,
            ping,
            dead_after: Box::pin(tokio::time::sleep(DEAD_PEER_TIMEOUT)),
            last_seen: Instant::now(),
        }
    }

    /// Gives `budget` back the bytes written to the socket.
    pub fn with_budget(mut self, budget: Arc<super::budget::Budget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Header of a frame (masked if we are the client); returns it and its length.
    fn frame_head(&self, opcode: u8, len: usize) -> ([u8; 14], usize) {
        let mut head = [0u8; 14];
        head[0] = 0x80 | opcode;
        let mut n = 2;
        if len < 126 {
            head[1] = len as u8;
        } else if len <= u16::MAX as usize {
            head[1] = 126;
            head[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            n = 4;
        } else {
            head[1] = 127;
            head[2..10].copy_from_slice(&(len as u64).to_be_bytes());
            n = 10;
        }
        // A client's frames are masked, with an all-zero key: still a
        // well-formed frame for the proxies that inspect them, and no XOR
        // over every payload byte on either end (masking inside TLS between
        // our own two ends protects nothing).
        if self.role == Role::Client {
            head[1] |= 0x80;
            n += 4;
        }
        (head, n)
    }

    /// Queues a control or text frame (sent before the next binary frame).
    fn queue_control(&mut self, opcode: u8, payload: &[u8]) {
        let (head, n) = self.frame_head(opcode, payload.len());
        self.control_out.extend_from_slice(&head[..n]);
        self.control_out.extend_from_slice(payload);
    }

    /// Moves what waits (text messages, the coalesced pong, a due ping) into
    /// `control_out` once it is empty: it never holds more than one of each.
    fn refill_control(&mut self) {
        if !self.control_out.is_empty() || self.close_sent {
            return;
        }
        for msg in self.control.take_outgoing() {
            self.queue_control(OP_TEXT, msg.as_bytes());
        }
        if let Some(payload) = self.pong.take() {
            self.queue_control(OP_PONG, &payload);
        }
        if std::mem::take(&mut self.ping_due) {
            self.queue_control(OP_PING, b"");
        }
    }

    /// One write to the socket, noting when the socket stopped taking bytes.
    fn poll_io_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, data) {
            Poll::Ready(Ok(0)) => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => {
                self.stalled_since = None;
                if let Some(b) = &self.budget {
                    b.release(n);
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending => {
                self.stalled_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
            other => other,
        }
    }

    /// Writes the binary frame in flight and the queued control frames.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if self.direct_left > 0 && self.out.is_none() {
                // In the middle of a direct frame: its payload comes first.
                return Poll::Ready(Ok(()));
            }
            // A binary frame that started going out is finished first (and
            // the start of a direct frame before anything else).
            if let Some(out) = &mut self.out
                && (out.written > 0 || self.control_out.is_empty() || self.direct_left > 0)
            {
                let frame = out.frame.clone();
                let mut written = out.written;
                while written < frame.len() {
                    let polled = self.poll_io_write(cx, &frame[written..]);
                    if let Poll::Ready(Ok(n)) = polled {
                        written += n;
                        continue;
                    }
                    self.out.as_mut().expect("a frame is going out").written = written;
                    return polled.map_ok(|_| ());
                }
                self.out = None;
                continue;
            }
            if !self.control_out.is_empty() {
                let control = std::mem::take(&mut self.control_out);
                let polled = self.poll_io_write(cx, &control);
                self.control_out = control;
                let n = ready!(polled)?;
                let _ = self.control_out.split_to(n);
                if self.control_out.is_empty() {
                    self.refill_control();
                }
                continue;
            }
            return Poll::Ready(Ok(()));
        }
    }

    /// Turns the batch into a binary frame and starts writing it. Ready once
    /// the batch is taken (its bytes may still be on their way out).
    fn poll_send_batch(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.batch.is_empty() {
            return Poll::Ready(Ok(()));
        }
        if self.out.is_some() {
            ready!(self.poll_write_out(cx))?;
        }
        let (head, head_len) = self.frame_head(OP_BINARY, self.batch.len() - HEAD_ROOM);
        self.batch[HEAD_ROOM - head_len..HEAD_ROOM].copy_from_slice(&head[..head_len]);
        let mut frame = self.batch.split().freeze();
        frame.advance(HEAD_ROOM - head_len);
        self.out = Some(Outgoing { frame, written: 0 });
        if let Poll::Ready(Err(e)) = self.poll_write_out(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(()))
    }

    /// Writes `bufs` (up to [`DIRECT_MAX`] of them) as one binary frame
    /// straight to the socket, frame header and payload in one vectored
    /// write: the TLS layer seals them into its records without a copy into
    /// the batch first. When the socket takes only part of it, the rest of
    /// the payload is whatever is written next ([`Self::poll_write_more`]),
    /// still without a copy.
    fn poll_write_direct(&mut self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        // What was coalesced before, and any frame still going out, first.
        ready!(self.poll_send_batch(cx))?;
        ready!(self.poll_write_out(cx))?;
        let mut slices = [IoSlice::new(&[]); DIRECT_SLICES];
        let (mut count, mut len) = (1, 0);
        for b in bufs {
            if len == DIRECT_MAX || count == DIRECT_SLICES {
                break;
            }
            let n = b.len().min(DIRECT_MAX - len);
            slices[count] = IoSlice::new(&b[..n]);
            count += 1;
            len += n;
        }
        let (head, head_len) = self.frame_head(OP_BINARY, len);
        slices[0] = IoSlice::new(&head[..head_len]);
        let n = ready!(self.poll_io_write_vectored(cx, &slices[..count]))?;
        if n > head_len {
            self.direct_left = len - (n - head_len);
            return Poll::Ready(Ok(n - head_len));
        }
        // Only (part of) the header went out: the rest of it, and one payload
        // byte so that the caller sees progress, go out next.
        let mut rest = BytesMut::with_capacity(head_len - n + 1);
        rest.put_slice(&head[n..head_len]);
        let first = bufs.iter().find(|b| !b.is_empty()).expect("wanted > 0");
        rest.put_u8(first[0]);
        self.out = Some(Outgoing { frame: rest.freeze(), written: 0 });
        self.direct_left = len - 1;
        Poll::Ready(Ok(1))
    }

    /// Writes the next bytes of the direct frame whose payload is not
    /// complete yet, straight to the socket.
    fn poll_write_more(&mut self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if self.out.is_some() {
            ready!(self.poll_write_out(cx))?;
        }
        let mut slices = [IoSlice::new(&[]); DIRECT_SLICES];
        let (mut count, mut len) = (0, 0);
        for b in bufs {
            if len == self.direct_left || count == DIRECT_SLICES {
                break;
            }
            let n = b.len().min(self.direct_left - len);
            slices[count] = IoSlice::new(&b[..n]);
            count += 1;
            len += n;
        }
        let n = ready!(self.poll_io_write_vectored(cx, &slices[..count]))?;
        self.direct_left -= n;
        Poll::Ready(Ok(n))
    }

    /// One vectored write to the socket, noting when the socket stopped
    /// taking bytes.
    fn poll_io_write_vectored(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(0)) => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => {
                self.stalled_since = None;
                if let Some(b) = &self.budget {
                    b.release(n);
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending => {
                self.stalled_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
            other => other,
        }
    }

    /// Sends queued control messages and due pings; checks that the peer is
    /// alive. Called from `poll_read`, which the connection task polls all
    /// the time.
    fn poll_housekeeping(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        self.control.waker.register(cx.waker());
        while self.ping.poll_tick(cx).is_ready() {
            self.ping_due = true;
        }
        self.refill_control();
        if !self.control_out.is_empty() || self.out.is_some() {
            // Pending is fine: the socket's readiness wakes this task again.
            if let Poll::Ready(Err(e)) = self.poll_write_out(cx) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Waits for the dead-peer deadline; an error once the peer was silent
    /// for [`DEAD_PEER_TIMEOUT`], or took none of our bytes for as long (a
    /// peer that talks but does not read is dropped too).
    fn poll_dead_peer(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.dead_after.as_mut().poll(cx).is_ready() {
            let stalled = self.stalled_since.filter(|s| *s < self.last_seen);
            let deadline = stalled.unwrap_or(self.last_seen) + DEAD_PEER_TIMEOUT;
            if deadline <= Instant::now() {
                let what = if stalled.is_some() { "did not read" } else { "silent" };
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("tunnel peer {what} for {DEAD_PEER_TIMEOUT:?}"),
                ));
            }
            self.dead_after.as_mut().reset(deadline);
        }
        Ok(())
    }

    /// Reads and parses the next frame header. Ready(None) at a clean EOF.
    fn poll_frame_head(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Frame>>> {
        let mut need = 2;
        loop {
            if self.head_len >= 2 {
                let masked = self.head[1] & 0x80 != 0;
                let ext = match self.head[1] & 0x7F {
                    126 => 2,
                    127 => 8,
                    _ => 0,
                };
                need = 2 + ext + if masked { 4 } else { 0 };
            }
            if self.head_len >= need {
                break;
            }
            let mut rb = ReadBuf::new(&mut self.head[self.head_len..need]);
            ready!(Pin::new(&mut self.io).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                if self.head_len == 0 {
                    return Poll::Ready(Ok(None));
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "tunnel closed mid-frame",
                )));
            }
            self.head_len += n;
        }
        self.head_len = 0;
        self.last_seen = Instant::now();
        let h = &self.head;
        let (fin, opcode) = (h[0] & 0x80 != 0, h[0] & 0x0F);
        if h[0] & 0x70 != 0 {
            return Poll::Ready(Err(protocol_error("reserved bits set")));
        }
        let masked = h[1] & 0x80 != 0;
        let (len, at) = match h[1] & 0x7F {
            126 => (u16::from_be_bytes([h[2], h[3]]) as u64, 4),
            127 => (u64::from_be_bytes(h[2..10].try_into().expect("8 bytes")), 10),
            n => (n as u64, 2),
        };
        let mask = masked.then(|| [h[at], h[at + 1], h[at + 2], h[at + 3]]);
        if self.role == Role::Server && mask.is_none() {
            return Poll::Ready(Err(protocol_error("unmasked frame from the client")));
        }
        // An all-zero key (our agents') changes nothing: skip the XOR.
        let mask = mask.filter(|m| *m != [0; 4]);
        let payload = match opcode {
            OP_BINARY if !self.in_text_or_fragment() => Payload::Data,
            OP_TEXT if !self.in_text_or_fragment() => Payload::Text,
            OP_CONTINUATION if self.in_text => Payload::Text,
            OP_CONTINUATION if self.continuing_binary() => Payload::Data,
            OP_CLOSE | OP_PING | OP_PONG if fin && len <= MAX_CONTROL => Payload::Control(opcode),
            _ => return Poll::Ready(Err(protocol_error(&format!("unexpected frame (opcode {opcode})")))),
        };
        // Saturating: a 64-bit length near u64::MAX must not wrap past the cap.
        if payload == Payload::Text && (self.text.len() as u64).saturating_add(len) > MAX_TEXT as u64 {
            return Poll::Ready(Err(protocol_error("text message too large")));
        }
        Poll::Ready(Ok(Some(Frame { payload, fin, left: len, mask, offset: 0 })))
    }

    /// A fragmented message is in progress (text, or binary without FIN).
    fn in_text_or_fragment(&self) -> bool {
        self.in_text || self.continuing_binary()
    }

    fn continuing_binary(&self) -> bool {
        self.binary_open
    }

    /// Acts on a frame whose payload was read completely.
    fn finish_frame(&mut self, frame: Frame) {
        match frame.payload {
            Payload::Data => self.binary_open = !frame.fin,
            Payload::Text => {
                self.text.append(&mut self.collected);
                self.in_text = !frame.fin;
                if frame.fin {
                    match std::str::from_utf8(&self.text) {
                        Ok(text) => self.control.on_text(text),
                        Err(_) => tracing::debug!("ignoring a text message that is not UTF-8"),
                    }
                    self.text.clear();
                }
            }
            Payload::Control(OP_PING) => {
                if !self.close_sent {
                    self.pong = Some(std::mem::take(&mut self.collected));
                    self.refill_control();
                }
            }
            Payload::Control(OP_CLOSE) => {
                if !self.close_sent {
                    // Echo the status code (RFC 6455 5.5.1).
                    let code = self.collected.get(..2).map(<[u8]>::to_vec).unwrap_or_default();
                    self.queue_control(OP_CLOSE, &code);
                    self.close_sent = true;
                }
                self.eof = true;
            }
            Payload::Control(_) => {} // pong: its arrival was the point
        }
        self.collected.clear();
    }
}

fn protocol_error(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("tunnel WebSocket protocol error: {what}"))
}

/// XORs `data` with the masking key; `offset` is the position of `data[0]`
/// in the frame's payload.
fn apply_mask(data: &mut [u8], mask: [u8; 4], offset: usize) {
    let key: [u8; 4] = std::array::from_fn(|i| mask[(offset + i) % 4]);
    let wide = u64::from_ne_bytes([key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3]]);
    let mut chunks = data.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let v = u64::from_ne_bytes((&*chunk).try_into().expect("8 bytes")) ^ wide;
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= key[i % 4];
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
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let Some(frame) = &mut this.frame else {
                match this.poll_frame_head(cx) {
                    Poll::Ready(Ok(Some(frame))) => this.frame = Some(frame),
                    Poll::Ready(Ok(None)) => this.eof = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        this.poll_dead_peer(cx)?;
                        return Poll::Pending;
                    }
                }
                continue;
            };
            if frame.left == 0 {
                let frame = this.frame.take().expect("a frame is being read");
                this.finish_frame(frame);
                if !this.control_out.is_empty()
                    && let Poll::Ready(Err(e)) = this.poll_write_out(cx)
                {
                    return Poll::Ready(Err(e));
                }
                continue;
            }
            let polled = if frame.payload == Payload::Data {
                if buf.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                if buf.remaining() as u64 <= frame.left {
                    // The whole space fits in the frame: read straight into it.
                    let before = buf.filled().len();
                    match Pin::new(&mut this.io).poll_read(cx, buf) {
                        Poll::Ready(Ok(())) => {
                            if let Some(m) = frame.mask {
                                apply_mask(&mut buf.filled_mut()[before..], m, frame.offset);
                            }
                            Poll::Ready(Ok(buf.filled().len() - before))
                        }
                        other => other.map_ok(|()| 0),
                    }
                } else {
                    // The frame ends inside the space: read into the part of
                    // it the frame fills, left uninitialized (zeroing it
                    // first cost a memset of every read).
                    let mut rb = buf.take(frame.left as usize);
                    match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
                        Poll::Ready(Ok(())) => {
                            let n = rb.filled().len();
                            if let Some(m) = frame.mask {
                                apply_mask(rb.filled_mut(), m, frame.offset);
                            }
                            // SAFETY: `rb` is a view of `buf`'s unfilled part,
                            // whose first `n` bytes the read just initialized.
                            unsafe { buf.assume_init(n) };
                            buf.advance(n);
                            Poll::Ready(Ok(n))
                        }
                        other => other.map_ok(|()| 0),
                    }
                }
            } else {
                let start = this.collected.len();
                this.collected.resize(start + frame.left as usize, 0);
                let mut rb = ReadBuf::new(&mut this.collected[start..]);
                let polled = Pin::new(&mut this.io).poll_read(cx, &mut rb);
                let n = rb.filled().len();
                this.collected.truncate(start + n);
                if let Some(m) = frame.mask {
                    apply_mask(&mut this.collected[start..], m, frame.offset);
                }
                polled.map_ok(|()| n)
            };
            match polled {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "tunnel closed mid-frame",
                    )));
                }
                Poll::Ready(Ok(n)) => {
                    frame.left -= n as u64;
                    frame.offset += n;
                    if frame.payload == Payload::Data {
                        return Poll::Ready(Ok(()));
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    this.poll_dead_peer(cx)?;
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
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let wanted = bufs.iter().map(|b| b.len()).sum::<usize>();
        if wanted == 0 {
            return Poll::Ready(Ok(0));
        }
        if this.direct_left > 0 {
            return this.poll_write_more(cx, bufs);
        }
        if this.batch.len() >= HEAD_ROOM + WS_MAX_BATCH {
            ready!(this.poll_send_batch(cx))?;
        }
        if wanted >= DIRECT_MIN && this.io.is_write_vectored() {
            return this.poll_write_direct(cx, bufs);
        }
        if this.batch.is_empty() {
            this.batch.reserve(HEAD_ROOM + wanted.min(WS_MAX_BATCH));
            this.batch.put_bytes(0, HEAD_ROOM);
        }
        let room = HEAD_ROOM + WS_MAX_BATCH - this.batch.len();
        let len = wanted.min(room);
        this.batch.reserve(len);
        let mut left = len;
        for b in bufs {
            if left == 0 {
                break;
            }
            let n = b.len().min(left);
            this.batch.put_slice(&b[..n]);
            left -= n;
        }
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // In the middle of a direct frame, the batch is empty and stays so
        // until the frame is complete; what went out is flushed.
        ready!(this.poll_send_batch(cx))?;
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send_batch(cx))?;
        if this.direct_left > 0 {
            // A frame cut short: no close frame can follow it.
            this.close_sent = true;
        }
        if !this.close_sent {
            this.queue_control(OP_CLOSE, &1000u16.to_be_bytes());
            this.close_sent = true;
        }
        ready!(this.poll_write_out(cx))?;
        match ready!(Pin::new(&mut this.io).poll_shutdown(cx)) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::protocol::Role as TRole;

    fn pair() -> (WsStream<tokio::io::DuplexStream>, WsStream<tokio::io::DuplexStream>) {
        let (a, b) = tokio::io::duplex(256 * 1024);
        (WsStream::new(a, Role::Client, Arc::default()), WsStream::new(b, Role::Server, Arc::default()))
    }

    fn test_data(n: u32) -> Vec<u8> {
        (0..n).map(|i| (i % 251) as u8).collect()
    }

    #[tokio::test]
    async fn carries_bytes_both_ways_in_order() {
        let (mut a, mut b) = pair();
        let data = test_data(1_000_000);
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
        // Odd-sized reads: payloads are split at arbitrary points (mask phase).
        let mut buf = [0u8; 999];
        loop {
            let n = b.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got.len(), expect.len());
        assert!(got == expect);
        writer.await.unwrap();
    }

    /// A socket that takes vectored writes, at most `max` bytes each (as TLS
    /// does when its buffer is nearly full).
    struct Trickle<S> {
        inner: S,
        max: usize,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Trickle<S> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Trickle<S> {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let n = buf.len().min(this.max);
            Pin::new(&mut this.inner).poll_write(cx, &buf[..n])
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let mut joined = Vec::new();
            for b in bufs {
                joined.extend_from_slice(&b[..b.len().min(this.max - joined.len())]);
                if joined.len() == this.max {
                    break;
                }
            }
            Pin::new(&mut this.inner).poll_write(cx, &joined)
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    #[tokio::test]
    async fn direct_frames_cut_anywhere_by_the_socket_stay_well_formed() {
        // Large writes go straight to the socket as frames of their own; a
        // socket that takes a few bytes at a time cuts them (and their
        // headers) anywhere, with pings to answer in between: tungstenite's
        // server end must still read well-formed frames, bytes in order.
        for max in [1, 5, 13, 1000, 4099, 70_000] {
            let (a, b) = tokio::io::duplex(8 * 1024);
            let mut ours = WsStream::new(Trickle { inner: a, max }, Role::Client, Arc::default());
            let mut theirs = WebSocketStream::from_raw_socket(b, TRole::Server, None).await;
            let data = test_data(400_000);
            let sizes = [3usize, 5000, 100, 70_000, 4096, 65_545, 1, 200_000];
            let expect: Vec<u8> = {
                let mut v = Vec::new();
                let mut at = 0;
                for n in sizes {
                    v.extend_from_slice(&data[at..at + n]);
                    at += n;
                }
                v
            };
            let writer = tokio::spawn(async move {
                let mut at = 0;
                for n in sizes {
                    ours.write_all(&data[at..at + n]).await.unwrap();
                    ours.flush().await.unwrap();
                    at += n;
                    // Reads answer pings (pongs go out between frames).
                    let mut none = [0u8; 1];
                    let _ =
                        tokio::time::timeout(std::time::Duration::from_millis(1), ours.read(&mut none)).await;
                }
                ours
            });
            let mut got = Vec::new();
            let mut pings = 0;
            while got.len() < expect.len() {
                if pings < 20 {
                    theirs.send(Message::Ping(Bytes::from_static(b"p"))).await.unwrap();
                    pings += 1;
                }
                match theirs.next().await.unwrap().unwrap() {
                    Message::Binary(b) => got.extend_from_slice(&b),
                    Message::Pong(_) => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(got == expect, "bytes in order with max {max}");
            writer.await.unwrap();
        }
    }

    #[test]
    fn masking_at_any_offset_matches_byte_by_byte() {
        let mask = [0x12, 0x34, 0x56, 0x78];
        let data = test_data(103);
        for offset in 0..8 {
            let mut fast = data.clone();
            apply_mask(&mut fast, mask, offset);
            let slow: Vec<u8> = data.iter().enumerate().map(|(i, b)| b ^ mask[(offset + i) % 4]).collect();
            assert_eq!(fast, slow, "offset {offset}");
        }
    }

    #[tokio::test]
    async fn speaks_websocket_with_a_standard_server() {
        // Our client end against tungstenite's server end: masked binary
        // frames of every length form, pings answered, text delivered.
        let (a, b) = tokio::io::duplex(1 << 20);
        let control = Arc::new(Control::default());
        let mut ours = WsStream::new(a, Role::Client, control.clone());
        let mut theirs = WebSocketStream::from_raw_socket(b, TRole::Server, None).await;
        let sizes = [0usize, 1, 125, 126, 65_535, 65_536, 70_000];
        let data = test_data(300_000);
        let mut sent = Vec::new();
        for &n in &sizes {
            ours.write_all(&data[..n]).await.unwrap();
            ours.flush().await.unwrap();
            sent.extend_from_slice(&data[..n]);
        }
        let mut got = Vec::new();
        while got.len() < sent.len() {
            match theirs.next().await.unwrap().unwrap() {
                Message::Binary(b) => got.extend_from_slice(&b),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(got == sent);

        // Server to client: binary (fragment-free), a ping, a text control message.
        theirs.send(Message::Binary(Bytes::from(data[..70_000].to_vec()))).await.unwrap();
        theirs.send(Message::Ping(Bytes::from_static(b"hi"))).await.unwrap();
        theirs.send(Message::text(MSG_READY)).await.unwrap();
        let mut got = vec![0u8; 70_000];
        ours.read_exact(&mut got).await.unwrap();
        assert!(got[..] == data[..70_000]);
        // The text arrives after the binary bytes; read until it was handled.
        let waited = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            let mut one = [0u8; 1];
            tokio::select! {
                _ = control.ready() => {}
                _ = ours.read(&mut one) => panic!("no more bytes expected"),
            }
        });
        waited.await.expect("text message handled");
        // Our pong answers their ping.
        let mut one = [0u8; 1];
        let _ = tokio::time::timeout(std::time::Duration::from_millis(50), ours.read(&mut one)).await;
        match tokio::time::timeout(std::time::Duration::from_secs(5), theirs.next()).await.unwrap() {
            Some(Ok(Message::Pong(p))) => assert_eq!(&p[..], b"hi"),
            other => panic!("expected a pong, got {other:?}"),
        }
        // Close: ours answers theirs and reads EOF.
        theirs.close(None).await.unwrap();
        let mut rest = Vec::new();
        ours.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn speaks_websocket_with_a_standard_client() {
        // tungstenite's client (masked frames, fragmented message) to our server end.
        let (a, b) = tokio::io::duplex(1 << 20);
        let mut ours = WsStream::new(b, Role::Server, Arc::default());
        let mut theirs = WebSocketStream::from_raw_socket(a, TRole::Client, None).await;
        let data = test_data(200_000);
        theirs.send(Message::Binary(Bytes::from(data.clone()))).await.unwrap();
        let frag = |d: &[u8], op, fin| {
            use tokio_tungstenite::tungstenite::protocol::frame::Frame;
            let mut f = Frame::message(Bytes::from(d.to_vec()), op, fin);
            f.header_mut().mask = Some([1, 2, 3, 4]);
            Message::Frame(f)
        };
        use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
        theirs.send(frag(&data[..10], OpCode::Data(Data::Binary), false)).await.unwrap();
        theirs.send(frag(&data[10..20], OpCode::Data(Data::Continue), true)).await.unwrap();
        let mut got = vec![0u8; data.len() + 20];
        ours.read_exact(&mut got).await.unwrap();
        assert!(got[..data.len()] == data[..]);
        assert!(got[data.len()..] == data[..20]);
        ours.write_all(b"back").await.unwrap();
        ours.flush().await.unwrap();
        match theirs.next().await.unwrap().unwrap() {
            Message::Binary(b) => assert_eq!(&b[..], b"back"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_unmasked_frame_from_a_client_is_refused() {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut ours = WsStream::new(b, Role::Server, Arc::default());
        a.write_all(&[0x82, 0x02, b'h', b'i']).await.unwrap();
        let mut buf = [0u8; 8];
        let err = ours.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn client_frames_carry_the_mask_bit_and_an_all_zero_key() {
        // On the wire: a masked frame (as RFC 6455 and inspecting proxies
        // want) whose key is zero, so the payload is the plain bytes.
        let (a, mut peer) = tokio::io::duplex(1024);
        let mut ours = WsStream::new(a, Role::Client, Arc::default());
        ours.write_all(b"hello").await.unwrap();
        ours.flush().await.unwrap();
        let mut wire = [0u8; 11];
        peer.read_exact(&mut wire).await.unwrap();
        assert_eq!(wire, [0x82, 0x80 | 5, 0, 0, 0, 0, b'h', b'e', b'l', b'l', b'o']);
    }

    #[tokio::test]
    async fn a_server_reads_zero_key_and_keyed_frames_alike() {
        // Our agents' zero-key frames and another client's keyed frames, in
        // one connection, split at every point the socket may cut them.
        let (mut peer, b) = tokio::io::duplex(1024);
        let mut ours = WsStream::new(b, Role::Server, Arc::default());
        let mut wire = vec![0x82, 0x80 | 4, 0, 0, 0, 0, b'z', b'e', b'r', b'o'];
        wire.extend(client_frame(OP_BINARY, b"keyed"));
        let writer = tokio::spawn(async move {
            for byte in wire {
                peer.write_all(&[byte]).await.unwrap();
                peer.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            peer
        });
        let mut got = [0u8; 9];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"zerokeyed");
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn a_text_continuation_with_a_huge_length_is_refused() {
        // Found by the ws_frames fuzz target: the length check added the
        // 64-bit length to the text so far and overflowed.
        let (mut a, b) = tokio::io::duplex(1024);
        let mut ours = WsStream::new(b, Role::Client, Arc::default());
        a.write_all(&[0x01, 0x01, b'a', 0x80, 0x7F]).await.unwrap();
        a.write_all(&u64::MAX.to_be_bytes()).await.unwrap();
        let mut buf = [0u8; 8];
        let err = ours.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn goodbye_is_acknowledged() {
        let (mut agent, mut edge) = pair();
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

    /// A masked (client) frame of `opcode` with `payload`.
    fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [9, 8, 7, 6];
        let mut f = vec![0x80 | opcode, 0x80 | payload.len() as u8];
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    #[tokio::test]
    async fn a_peer_that_pings_and_never_reads_gets_one_pong_queued() {
        // Issue 18 item 9: every ping used to queue a pong, every goodbye an
        // ack, without limit while the peer did not read.
        let (mut peer, b) = tokio::io::duplex(16 * 1024);
        let mut ours = WsStream::new(b, Role::Server, Arc::default());
        let control = ours.control.clone();
        let mut burst = Vec::new();
        for i in 0..100u32 {
            burst.extend(client_frame(OP_PING, &[i as u8; 125]));
            burst.extend(client_frame(OP_TEXT, MSG_GOODBYE.as_bytes()));
        }
        let mut flood = tokio::spawn(async move {
            for _ in 0..200 {
                peer.write_all(&burst).await.unwrap();
            }
            peer
        });
        let mut buf = [0u8; 64];
        let peer = tokio::select! {
            r = ours.read(&mut buf) => panic!("no data expected: {r:?}"),
            peer = &mut flood => peer.unwrap(),
        };
        // 20 000 pings and goodbyes were read and answered as far as the
        // peer took them: one pong and one ack at most wait.
        assert!(ours.control_out.len() <= 2 * (MAX_CONTROL as usize + 14), "{}", ours.control_out.len());
        assert!(control.outgoing.lock().unwrap().len() <= 1);
        assert!(ours.pong.is_some());
        drop(peer);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_talks_but_never_reads_is_dropped() {
        let (mut peer, b) = tokio::io::duplex(1024);
        let mut ours = WsStream::new(b, Role::Server, Arc::default());
        let talker = tokio::spawn(async move {
            loop {
                peer.write_all(&client_frame(OP_PING, &[1; 125])).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 8];
        let err = ours.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("did not read"), "{err}");
        assert!(started.elapsed() <= DEAD_PEER_TIMEOUT * 3, "{:?}", started.elapsed());
        talker.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_detected_as_dead() {
        // The peer never reads or answers pings: after DEAD_PEER_TIMEOUT reads fail.
        let (a, _silent) = tokio::io::duplex(1 << 20);
        let mut stream = WsStream::new(a, Role::Client, Arc::default());
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 8];
        let err = stream.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= DEAD_PEER_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_talks_is_not_dead() {
        // Pings every PING_INTERVAL keep both ends alive well past the timeout.
        let (mut a, mut b) = pair();
        let t = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            b.read(&mut buf).await
        });
        let mut buf = [0u8; 8];
        let r = tokio::time::timeout(DEAD_PEER_TIMEOUT * 3, a.read(&mut buf)).await;
        assert!(r.is_err(), "still waiting for data, not dead: {r:?}");
        t.abort();
    }
}
