//! A stream multiplexer for the tunnel, leaner than HTTP/2 (ARCHITECTURE.md,
//! "Next: a multiplexer of our own"): 8-byte frame headers ([`frame`]),
//! streams opened without a round trip, and flow control per stream only.
//!
//! Each stream starts with [`Config::window`] bytes of credit each way; a
//! reader grants the bytes it has consumed back once they reach a quarter
//! of the window (at half, a bulk writer waited for credit often enough to
//! show as twice h2's context switches per GB). There is no connection-wide window: a stream whose reader stops
//! holds back only itself, and what a connection buffers is at most its open
//! streams × the window.
//!
//! One task drives the connection ([`Connection`], a future): it writes the
//! frames the streams queue, vectored, in the order they were queued (a
//! stream queues at most its credit, at most [`frame::MAX_PAYLOAD`] per
//! frame, so none holds the others back by size) and reads the peer's
//! frames into the streams' buffers. [`Stream`] is `AsyncRead + AsyncWrite`:
//! `shutdown` half-closes, dropping it before both halves closed resets it.

pub mod frame;

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use frame::{Frame, MAX_PAYLOAD};

/// `Reset` codes: HTTP/2's error codes, so that a reason passes through
/// both unchanged.
pub mod code {
    /// The sender is done with the stream and needs none of the peer's
    /// remaining bytes; what the sender sent before stands (an answer sent
    /// whole before the request's body was read).
    pub const NO_ERROR: u32 = 0;
    /// The sender failed (a body that broke off).
    pub const INTERNAL: u32 = 2;
    /// The receiver did not take the stream (no acceptor, too many
    /// streams, or the peer is going away); it may be opened again elsewhere.
    pub const REFUSED: u32 = 7;
    /// The stream's owner dropped it before it finished.
    pub const CANCEL: u32 = 8;
}

/// Which stream ids a side opens: the edge's are odd, the agent's even.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Edge,
    Agent,
}

#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Each stream's credit each way, and what a reader buffers at most.
    pub window: u32,
    /// Streams the peer may hold open at once; more are refused.
    pub max_streams: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config { window: 256 * 1024, max_streams: 4096 }
    }
}

/// Opens streams.
pub struct Handle {
    shared: Arc<Mutex<Shared>>,
}

/// The streams the peer opens.
pub struct Incoming {
    shared: Arc<Mutex<Shared>>,
}

/// One stream.
pub struct Stream {
    id: u32,
    header: Bytes,
    shared: Arc<Mutex<Shared>>,
}

/// The future that drives a connection; it ends when the peer closes it
/// (`Ok`), on an error, or once nothing uses it anymore (every [`Handle`],
/// [`Incoming`] and [`Stream`] dropped, what they queued written).
pub struct Connection<T> {
    io: T,
    shared: Arc<Mutex<Shared>>,
    read: BytesMut,
    /// A `Data` frame whose payload is being read: its stream, the bytes
    /// still to come, its `FIN`.
    data: Option<(u32, usize, bool)>,
    /// Frames taken from the queue, not yet (entirely) written.
    writing: VecDeque<Bytes>,
    flushed: bool,
    gather: Gather,
}

/// A multiplexed connection over `io`.
pub fn new<T>(io: T, side: Side, config: Config) -> (Handle, Incoming, Connection<T>)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let shared = Arc::new(Mutex::new(Shared {
        streams: HashMap::with_hasher(IdHash::new()),
        out: VecDeque::new(),
        scratch: BytesMut::new(),
        driver: None,
        next_id: if side == Side::Edge { 1 } else { 2 },
        side,
        last_peer_id: 0,
        accepted: VecDeque::new(),
        acceptor: None,
        accepting: true,
        closed: None,
        going_away: false,
        config,
        users: 2,
        peer_streams: 0,
        own_streams: 0,
        openers: Vec::new(),
        woken: Woken::default(),
        last_queued: 0,
        queue_switches: 0,
    }));
    let connection = Connection {
        io,
        shared: shared.clone(),
        read: BytesMut::new(),
        data: None,
        writing: VecDeque::new(),
        flushed: true,
        gather: Gather::default(),
    };
    (Handle { shared: shared.clone() }, Incoming { shared }, connection)
}

/// Stream ids hashed with splitmix64's two multiplications: std's SipHash was ~70
/// instructions a lookup, and a request looks its stream up ten times on
/// either end. Keyed once per process, so that a peer that picks its ids
/// (ascending, as it must) cannot aim them at one bucket without knowing the key.
#[derive(Debug, Clone, Copy)]
struct IdHash(u64);

impl IdHash {
    fn new() -> IdHash {
        static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        IdHash(*KEY.get_or_init(|| std::hash::RandomState::new().hash_one(0x6375_6c76_u64)))
    }
}

impl BuildHasher for IdHash {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher(self.0)
    }
}

#[derive(Debug)]
struct IdHasher(u64);

impl IdHasher {
    fn mix(&mut self, n: u64) {
        let z = self.0 ^ n;
        let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        self.0 = z ^ (z >> 31);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&b| self.mix(u64::from(b)));
    }

    fn write_u32(&mut self, id: u32) {
        self.mix(u64::from(id));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

struct Shared {
    streams: HashMap<u32, Slot, IdHash>,
    /// Encoded frames for the connection's task to write.
    out: VecDeque<Bytes>,
    scratch: BytesMut,
    driver: Option<Waker>,
    next_id: u32,
    side: Side,
    last_peer_id: u32,
    accepted: VecDeque<(u32, Bytes)>,
    acceptor: Option<Waker>,
    accepting: bool,
    /// Why the connection ended.
    closed: Option<Arc<str>>,
    /// The peer takes no new streams.
    going_away: bool,
    config: Config,
    /// Handles, the incoming side and streams alive.
    users: usize,
    /// Streams the peer opened, held here.
    peer_streams: usize,
    /// Streams opened here, held here: at most the peer's
    /// [`Config::max_streams`] (both ends share one config), so that the
    /// peer refuses none for being too many.
    own_streams: usize,
    /// [`Handle::open`]s waiting for one of those to end.
    openers: Vec<Waker>,
    /// Woken when the lock is let go ([`Locked`]).
    woken: Woken,
    /// The stream of the frame queued last, and how many times the queue
    /// went from one stream's frames to another's ([`Gather`]).
    last_queued: u32,
    queue_switches: u32,
}

/// What a stream carries: bytes, or a header block sent whole
/// ([`Stream::send_head`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Data(Bytes),
    Head(Bytes),
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Chunk::Data(b) | Chunk::Head(b) => b.len(),
        }
    }
}

struct Slot {
    recv: VecDeque<Chunk>,
    recv_fin: bool,
    /// Bytes the peer may still send.
    recv_window: u32,
    /// Bytes read and not yet granted back.
    consumed: u32,
    send_credit: u32,
    send_fin: bool,
    reset: Option<u32>,
    reader: Option<Waker>,
    writer: Option<Waker>,
    /// [`Stream`]s of this stream alive ([`Stream::split`]).
    handles: u8,
}

impl Slot {
    fn new(window: u32) -> Slot {
        Slot {
            recv: VecDeque::new(),
            recv_fin: false,
            recv_window: window,
            consumed: 0,
            send_credit: window,
            send_fin: false,
            reset: None,
            reader: None,
            writer: None,
            handles: 1,
        }
    }

    fn wake(&mut self, woken: &mut Woken) {
        wake(woken, &mut self.reader);
        wake(woken, &mut self.writer);
    }
}

/// Takes `waker` to be woken once the lock is let go ([`Locked`]): a task
/// woken on another worker while the lock is still held would block on it
/// at once (a profile of bulk transfer showed those context switches).
fn wake(woken: &mut Woken, waker: &mut Option<Waker>) {
    if let Some(w) = waker.take() {
        woken.push(w);
    }
}

/// Wakers to wake once the lock is let go: a few without an allocation.
#[derive(Default)]
struct Woken {
    first: [Option<Waker>; 4],
    more: Vec<Waker>,
}

impl Woken {
    fn push(&mut self, w: Waker) {
        match self.first.iter_mut().find(|slot| slot.is_none()) {
            Some(slot) => *slot = Some(w),
            None => self.more.push(w),
        }
    }

    fn is_empty(&self) -> bool {
        self.first[0].is_none()
    }

    fn wake_all(self) {
        self.first.into_iter().flatten().chain(self.more).for_each(Waker::wake);
    }
}

/// The peer broke the protocol; the connection ends.
fn violation(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

impl Shared {
    fn queue(&mut self, frame: Frame) {
        // Frame heads are cut from one allocation, not one each.
        if self.scratch.capacity() < frame::HEADER + 8 {
            self.scratch.reserve(4096);
        }
        frame.encode_head(&mut self.scratch);
        self.out.push_back(self.scratch.split().freeze());
        if frame.stream() != self.last_queued {
            self.last_queued = frame.stream();
            self.queue_switches = self.queue_switches.wrapping_add(1);
        }
        if let Some(p) = frame.payload().filter(|p| !p.is_empty()) {
            self.out.push_back(p.clone());
        }
        wake(&mut self.woken, &mut self.driver);
    }

    fn remove(&mut self, id: u32) -> Option<Slot> {
        let slot = self.streams.remove(&id)?;
        if self.peer_opens(id) {
            self.peer_streams -= 1;
        } else {
            self.own_streams -= 1;
            self.wake_openers();
        }
        Some(slot)
    }

    fn wake_openers(&mut self) {
        for w in self.openers.drain(..) {
            self.woken.push(w);
        }
    }

    fn release(&mut self) {
        self.users -= 1;
        if self.users == 0 {
            wake(&mut self.woken, &mut self.driver);
        }
    }

    fn close(&mut self, why: &str) {
        if self.closed.is_none() {
            self.closed = Some(why.into());
        }
        self.streams.values_mut().for_each(|slot| slot.wake(&mut self.woken));
        wake(&mut self.woken, &mut self.acceptor);
        self.wake_openers();
    }

    fn closed_error(&self, kind: io::ErrorKind) -> io::Error {
        let why = self.closed.as_deref().unwrap_or("closed");
        io::Error::new(kind, format!("the tunnel connection ended: {why}"))
    }

    /// The peer's streams held here that the peer may still count as open:
    /// not those it reset or that ended both ways, which the peer lets go of
    /// as soon as its own handles drop, maybe before this side's do (the
    /// peer then opens another one at its limit). Counted only at the limit.
    fn peer_streams_live(&self) -> usize {
        if self.peer_streams < self.config.max_streams {
            return self.peer_streams;
        }
        let done = |slot: &Slot| slot.reset.is_some() || (slot.send_fin && slot.recv_fin);
        self.streams.iter().filter(|&(&id, slot)| self.peer_opens(id) && !done(slot)).count()
    }

    /// Whether `id` is one the peer opens.
    fn peer_opens(&self, id: u32) -> bool {
        (id % 2 == 1) == (self.side == Side::Agent)
    }

    fn receive(&mut self, frame: Frame) -> io::Result<()> {
        match frame {
            Frame::Open { stream, fin, header } => {
                if !self.peer_opens(stream) || stream <= self.last_peer_id {
                    return Err(violation(format!("stream {stream} opened out of order")));
                }
                self.last_peer_id = stream;
                if !self.accepting || self.peer_streams_live() >= self.config.max_streams {
                    self.queue(Frame::Reset { stream, code: code::REFUSED });
                    return Ok(());
                }
                let mut slot = Slot::new(self.config.window);
                slot.recv_fin = fin;
                self.streams.insert(stream, slot);
                self.peer_streams += 1;
                self.accepted.push_back((stream, header));
                wake(&mut self.woken, &mut self.acceptor);
            }
            Frame::Data { stream, fin, payload } => self.receive_chunk(stream, fin, Chunk::Data(payload))?,
            Frame::Head { stream, fin, block } => self.receive_chunk(stream, fin, Chunk::Head(block))?,
            Frame::Credit { stream, bytes } => {
                let Some(slot) = self.streams.get_mut(&stream) else { return Ok(()) };
                slot.send_credit = slot
                    .send_credit
                    .checked_add(bytes)
                    .ok_or_else(|| violation(format!("credit of stream {stream} overflows")))?;
                wake(&mut self.woken, &mut slot.writer);
            }
            Frame::Reset { stream, code } => {
                if let Some(slot) = self.streams.get_mut(&stream) {
                    slot.reset = Some(code);
                    // `NO_ERROR`: what arrived is still read; otherwise the stream is gone.
                    if code != code::NO_ERROR {
                        slot.recv.clear();
                    }
                    slot.wake(&mut self.woken);
                }
            }
            Frame::Ping { ack: false, opaque } => self.queue(Frame::Ping { ack: true, opaque }),
            Frame::Ping { ack: true, .. } => {}
            Frame::GoAway { last } => {
                self.going_away = true;
                self.wake_openers();
                let side = self.side;
                for (id, slot) in &mut self.streams {
                    // Ours that the peer did not take: refused, to be opened elsewhere.
                    if (id % 2 == 1) == (side == Side::Edge) && *id > last {
                        slot.reset = Some(code::REFUSED);
                        slot.wake(&mut self.woken);
                    }
                }
            }
        }
        Ok(())
    }

    fn receive_chunk(&mut self, stream: u32, fin: bool, chunk: Chunk) -> io::Result<()> {
        // A stream dropped here: what was in flight is discarded.
        let Some(slot) = self.streams.get_mut(&stream) else { return Ok(()) };
        if slot.recv_fin {
            return Err(violation(format!("data on stream {stream} after its end")));
        }
        let len = chunk.len() as u32;
        if len > slot.recv_window {
            return Err(violation(format!("stream {stream} sent {len} bytes over its credit")));
        }
        slot.recv_window -= len;
        if (len > 0 || matches!(chunk, Chunk::Head(_))) && slot.reset.is_none() {
            slot.recv.push_back(chunk);
        }
        slot.recv_fin = fin;
        wake(&mut self.woken, &mut slot.reader);
        Ok(())
    }
}

/// The connection's state, locked; what was woken under the lock is woken
/// when it is let go.
struct Locked<'a>(Option<MutexGuard<'a, Shared>>);

impl std::ops::Deref for Locked<'_> {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        self.0.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Shared {
        self.0.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.0.take() else { return };
        if guard.woken.is_empty() {
            return;
        }
        let woken = std::mem::take(&mut guard.woken);
        drop(guard);
        woken.wake_all();
    }
}

fn lock(shared: &Mutex<Shared>) -> Locked<'_> {
    Locked(Some(shared.lock().expect("poisoned")))
}

impl Handle {
    /// Opens a stream that carries `header` (what it is for) to the peer.
    /// No round trip: bytes may be written at once. While this side holds
    /// [`Config::max_streams`] streams open, waits for one to end (as an
    /// HTTP/2 client waits for the server's concurrency limit).
    pub async fn open(&self, header: Bytes) -> io::Result<Stream> {
        self.open_with(header, false).await
    }

    /// [`Handle::open`]; `fin`: nothing follows the header from this side
    /// (the stream is half-closed as it opens).
    pub async fn open_with(&self, header: Bytes, fin: bool) -> io::Result<Stream> {
        if header.len() > MAX_PAYLOAD {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "stream header over 64 KiB"));
        }
        let mut header = Some(header);
        std::future::poll_fn(|cx| {
            let mut s = lock(&self.shared);
            if s.closed.is_some() {
                return Poll::Ready(Err(s.closed_error(io::ErrorKind::NotConnected)));
            }
            if s.going_away {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "the peer is going away",
                )));
            }
            if s.own_streams >= s.config.max_streams {
                if !s.openers.iter().any(|w| w.will_wake(cx.waker())) {
                    s.openers.push(cx.waker().clone());
                }
                return Poll::Pending;
            }
            let id = s.next_id;
            let Some(next) = id.checked_add(2) else {
                return Poll::Ready(Err(io::Error::other("stream ids exhausted; reconnect")));
            };
            s.next_id = next;
            let mut slot = Slot::new(s.config.window);
            slot.send_fin = fin;
            s.streams.insert(id, slot);
            s.own_streams += 1;
            let header = header.take().expect("opened once");
            s.queue(Frame::Open { stream: id, fin, header });
            s.users += 1;
            Poll::Ready(Ok(Stream { id, header: Bytes::new(), shared: self.shared.clone() }))
        })
        .await
    }

    /// Takes no more streams from the peer (they are refused, to be opened
    /// on another connection) and tells it so; the streams open go on. For a
    /// drain: the connection ends once they are done and nothing uses it.
    pub fn go_away(&self) {
        let mut s = lock(&self.shared);
        if s.accepting && s.closed.is_none() {
            s.accepting = false;
            let last = s.last_peer_id;
            s.queue(Frame::GoAway { last });
        }
    }

    /// Streams open now, both sides'.
    pub fn streams(&self) -> usize {
        lock(&self.shared).streams.len()
    }

    /// The connection has ended (or is ending): no stream can be opened.
    pub fn is_closed(&self) -> bool {
        let s = lock(&self.shared);
        s.closed.is_some() || s.going_away
    }
}

impl Clone for Handle {
    fn clone(&self) -> Self {
        lock(&self.shared).users += 1;
        Handle { shared: self.shared.clone() }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        lock(&self.shared).release();
    }
}

impl Incoming {
    /// The next stream the peer opens; `None` once the connection ended,
    /// or once [`Handle::go_away`] was called and the streams opened before
    /// it were taken.
    pub async fn accept(&mut self) -> Option<Stream> {
        std::future::poll_fn(|cx| {
            let mut s = lock(&self.shared);
            if let Some((id, header)) = s.accepted.pop_front() {
                s.users += 1;
                return Poll::Ready(Some(Stream { id, header, shared: self.shared.clone() }));
            }
            if s.closed.is_some() || !s.accepting {
                return Poll::Ready(None);
            }
            s.acceptor = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.accepting = false;
        while let Some((stream, _)) = s.accepted.pop_front() {
            s.remove(stream);
            s.queue(Frame::Reset { stream, code: code::REFUSED });
        }
        s.release();
    }
}

impl Stream {
    pub fn id(&self) -> u32 {
        self.id
    }

    /// What the peer opened the stream for (empty for the streams opened here).
    pub fn header(&self) -> &Bytes {
        &self.header
    }

    /// Everything the peer sent was read, to its end.
    pub fn is_end(&self) -> bool {
        let s = lock(&self.shared);
        s.streams
            .get(&self.id)
            .is_none_or(|slot| slot.recv.is_empty() && (slot.recv_fin || slot.reset.is_some()))
    }

    /// The code the peer reset the stream with, if it did.
    pub fn reset_code(&self) -> Option<u32> {
        lock(&self.shared).streams.get(&self.id).and_then(|slot| slot.reset)
    }

    /// Sends `data` as it lies, without a copy: a frame per 64 KiB, as the
    /// stream's credit allows (waits for more when it is spent).
    pub async fn send(&mut self, mut data: Bytes) -> io::Result<()> {
        while !data.is_empty() {
            std::future::poll_fn(|cx| {
                let d = &mut data;
                self.poll_data(cx, d.len(), |n| d.split_to(n))
            })
            .await?;
        }
        Ok(())
    }

    fn write_slices(&self, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        self.poll_data(cx, total, |n| {
            let mut payload = BytesMut::with_capacity(n);
            for b in bufs {
                let take = b.len().min(n - payload.len());
                payload.extend_from_slice(&b[..take]);
                if payload.len() == n {
                    break;
                }
            }
            payload.freeze()
        })
    }

    /// Queues a `Data` frame of the first bytes of `total` (as many as the
    /// credit and a frame allow; `payload(n)` makes them) or waits for
    /// credit.
    fn poll_data(
        &self,
        cx: &mut Context<'_>,
        total: usize,
        payload: impl FnOnce(usize) -> Bytes,
    ) -> Poll<io::Result<usize>> {
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        let mut s = lock(&self.shared);
        let s = &mut *s;
        let slot = match writable(s, self.id) {
            Ok(slot) => slot,
            Err(e) => return Poll::Ready(Err(e)),
        };
        if slot.send_credit == 0 {
            slot.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = total.min(slot.send_credit as usize).min(MAX_PAYLOAD);
        slot.send_credit -= n as u32;
        s.queue(Frame::Data { stream: self.id, fin: false, payload: payload(n) });
        Poll::Ready(Ok(n))
    }
}

/// The slot of stream `id` if it may still be written.
fn writable(s: &mut Shared, id: u32) -> io::Result<&mut Slot> {
    if s.closed.is_some() {
        return Err(s.closed_error(io::ErrorKind::BrokenPipe));
    }
    let slot = s.streams.get_mut(&id).ok_or(io::ErrorKind::NotConnected)?;
    if let Some(code) = slot.reset {
        return Err(reset_error(code));
    }
    if slot.send_fin {
        return Err(io::Error::new(io::ErrorKind::BrokenPipe, "write after shutdown"));
    }
    Ok(slot)
}

/// A header block where bytes were expected.
fn head_error() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "a header block where the stream's bytes were expected")
}

fn reset_error(code: u32) -> io::Error {
    let why = match code {
        code::NO_ERROR => "the other end needs no more of the stream".to_string(),
        code::CANCEL => "the stream was reset by the other end (cancelled)".to_string(),
        code::REFUSED => "the stream was refused by the other end".to_string(),
        other => format!("the stream was reset by the other end (code {other})"),
    };
    io::Error::new(io::ErrorKind::ConnectionReset, why)
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.poll_take(cx, |recv| {
            let mut read = 0;
            while buf.remaining() > 0
                && let Some(Chunk::Data(front)) = recv.front_mut()
            {
                let n = front.len().min(buf.remaining());
                buf.put_slice(&front[..n]);
                front.advance(n);
                read += n;
                if front.is_empty() {
                    recv.pop_front();
                }
            }
            if read == 0 && buf.remaining() > 0 {
                return Err(head_error());
            }
            Ok(read)
        })
        .map_ok(|_| ())
    }
}

impl Stream {
    /// The next bytes the peer sent, as they arrived (no copy); `None` at
    /// the end of the stream.
    pub async fn recv(&mut self) -> io::Result<Option<Bytes>> {
        match self.recv_chunk().await? {
            Some(Chunk::Data(b)) => Ok(Some(b)),
            Some(Chunk::Head(_)) => Err(head_error()),
            None => Ok(None),
        }
    }

    /// The next bytes or header block the peer sent; `None` at the end of
    /// the stream.
    pub async fn recv_chunk(&mut self) -> io::Result<Option<Chunk>> {
        std::future::poll_fn(|cx| self.poll_chunk(cx)).await
    }

    /// [`Stream::recv_chunk`], polled.
    pub fn poll_chunk(&self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Chunk>>> {
        let mut chunk = None;
        let more = std::task::ready!(self.poll_take(cx, |recv| {
            let front = recv.pop_front().expect("taken only when there is data");
            let n = front.len();
            chunk = Some(front);
            Ok(n)
        }))?;
        Poll::Ready(Ok(chunk.filter(|_| more)))
    }

    /// Sends a header block whole, in one frame (so at most 64 KiB), once
    /// the stream's credit takes it; `fin`: the last thing sent.
    pub async fn send_head(&mut self, block: Bytes, fin: bool) -> io::Result<()> {
        if block.len() > MAX_PAYLOAD {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "header block over 64 KiB"));
        }
        let mut block = Some(block);
        std::future::poll_fn(|cx| {
            let mut s = lock(&self.shared);
            let s = &mut *s;
            let slot = match writable(s, self.id) {
                Ok(slot) => slot,
                Err(e) => return Poll::Ready(Err(e)),
            };
            let len = block.as_ref().map_or(0, Bytes::len);
            if (slot.send_credit as usize) < len {
                slot.writer = Some(cx.waker().clone());
                return Poll::Pending;
            }
            slot.send_credit -= len as u32;
            slot.send_fin = fin;
            let block = block.take().expect("sent once");
            s.queue(Frame::Head { stream: self.id, fin, block });
            Poll::Ready(Ok(()))
        })
        .await
    }

    /// Ready with the reset code once the peer reset the stream (or the
    /// connection ended: [`code::CANCEL`]). Shares its wake-up with the
    /// writes: for the task that writes the stream, or nothing.
    pub fn poll_reset(&self, cx: &mut Context<'_>) -> Poll<u32> {
        let mut s = lock(&self.shared);
        let closed = s.closed.is_some();
        match s.streams.get_mut(&self.id) {
            Some(slot) if slot.reset.is_some() => Poll::Ready(slot.reset.unwrap_or(code::CANCEL)),
            Some(_) if closed => Poll::Ready(code::CANCEL),
            Some(slot) => {
                slot.writer = Some(cx.waker().clone());
                Poll::Pending
            }
            None => Poll::Ready(code::CANCEL),
        }
    }

    /// Abandons the stream both ways, telling the peer `code`.
    pub fn reset(&self, code: u32) {
        let mut s = lock(&self.shared);
        let s = &mut *s;
        let closed = s.closed.is_some();
        if let Some(slot) = s.streams.get_mut(&self.id)
            && slot.reset.is_none()
        {
            slot.reset = Some(code);
            slot.recv.clear();
            slot.wake(&mut s.woken);
            if !closed {
                s.queue(Frame::Reset { stream: self.id, code });
            }
        }
    }

    /// Two handles of this stream, for a reader and a writer in different
    /// tasks; the stream ends (see [`Drop`]) when both are dropped.
    pub fn split(self) -> (Stream, Stream) {
        let mut s = lock(&self.shared);
        // A stream already gone stays gone for both (its `Drop` counts no handle).
        if let Some(slot) = s.streams.get_mut(&self.id) {
            slot.handles += 1;
        }
        s.users += 1;
        drop(s);
        let other = Stream { id: self.id, header: Bytes::new(), shared: self.shared.clone() };
        (self, other)
    }

    /// Takes received bytes with `take` (which says how many it took) and
    /// grants them back as credit; `Ready(Ok(false))` at the end of the
    /// stream, without calling `take`.
    fn poll_take(
        &self,
        cx: &mut Context<'_>,
        take: impl FnOnce(&mut VecDeque<Chunk>) -> io::Result<usize>,
    ) -> Poll<io::Result<bool>> {
        let id = self.id;
        let mut s = lock(&self.shared);
        let s = &mut *s;
        let Some(slot) = s.streams.get_mut(&id) else {
            return Poll::Ready(Err(io::ErrorKind::NotConnected.into()));
        };
        if let Some(code) = slot.reset.filter(|&c| c != code::NO_ERROR) {
            return Poll::Ready(Err(reset_error(code)));
        }
        if slot.recv.is_empty() {
            if slot.recv_fin || slot.reset.is_some() {
                return Poll::Ready(Ok(false));
            }
            if s.closed.is_some() {
                return Poll::Ready(Err(s.closed_error(io::ErrorKind::UnexpectedEof)));
            }
            slot.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        slot.consumed += take(&mut slot.recv)? as u32;
        if !slot.recv_fin && slot.reset.is_none() && slot.consumed >= s.config.window / 4 {
            let bytes = std::mem::take(&mut slot.consumed);
            slot.recv_window += bytes;
            s.queue(Frame::Credit { stream: id, bytes });
        }
        Poll::Ready(Ok(true))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.write_slices(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.write_slices(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// What was written is queued for the connection's task, which writes
    /// as soon as it runs: nothing to wait for.
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// Half-closes: the peer reads the end; this side can still read.
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = lock(&self.shared);
        let Some(slot) = s.streams.get_mut(&self.id) else { return Poll::Ready(Ok(())) };
        if slot.send_fin || slot.reset.is_some() {
            return Poll::Ready(Ok(()));
        }
        slot.send_fin = true;
        s.queue(Frame::Data { stream: self.id, fin: true, payload: Bytes::new() });
        Poll::Ready(Ok(()))
    }
}

impl Drop for Stream {
    /// The last handle of a stream that did not finish both ways resets it:
    /// [`code::NO_ERROR`] when this side sent all it had (the peer's rest is
    /// not needed; what was sent stands), else [`code::CANCEL`].
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        let last = s.streams.get_mut(&self.id).is_none_or(|slot| {
            slot.handles -= 1;
            slot.handles == 0
        });
        if last
            && let Some(slot) = s.remove(self.id)
            && !(slot.send_fin && slot.recv_fin)
            && slot.reset.is_none()
            && s.closed.is_none()
        {
            let code = if slot.send_fin { code::NO_ERROR } else { code::CANCEL };
            s.queue(Frame::Reset { stream: self.id, code });
        }
        s.release();
    }
}

/// Frames taken off the queue per vectored write.
const MAX_SLICES: usize = 64;
/// The room the read buffer has before a read (and below which reading
/// stops, to hand on what was read).
const READ_AT_LEAST: usize = 16 * 1024;
/// What the read buffer grows by when it has less. The payloads are split
/// off it without a copy, so it is shared and grows by a new allocation that
/// would take the partial frame at its end along: a `Data` frame the buffer
/// has no room to finish is handed on in pieces instead, so what moves is at
/// most a header (a profile of bulk transfer showed 3.5 % of the receiving
/// agent copying partial frames). The buffer is read into until it is full
/// or the socket has nothing more, and only then are the frames handed on:
/// a reader is woken once for up to this much, not once per TLS record
/// (which made the receiving side write its TCP socket in 20 KB pieces).
const READ_BUFFER: usize = 64 * 1024;
/// Rounds of writing and reading before the task yields to others.
const ROUNDS: usize = 32;

/// Whether the driver lets the tasks that are ready run before it writes
/// frames queued while it had nothing to write, so that one write carries
/// theirs too.
///
/// A stream's task wakes the driver as it queues a frame, and tokio runs a
/// task woken that way next (its LIFO slot): under load every request went
/// out in a write of its own, ~0.8 writes per request on each side of the
/// tunnel (`bench/counts --mode syscalls`), each a trip through the kernel's
/// loopback into the other process. Waiting one turn of the run queue
/// (waking itself puts the driver behind the tasks already there) makes
/// that ~0.2, and a request's CPU at 50 connections 12–17 % less.
///
/// A turn that gathers nothing is not free: the driver's wake-up tells
/// tokio to wake an idle worker thread (two `futex` calls), and one request
/// at a time lost up to a tenth of its rate to it, and one bulk stream
/// (beside iperf3's idle control stream) an eighth. So the driver waits
/// only on a connection with other streams open, only while waiting gathers
/// frames of other streams, stops after [`Gather::MISSES`] turns in a row
/// that gathered none, and tries again every [`Gather::PROBE`] batches that
/// followed other streams' frames.
#[derive(Debug, Default)]
struct Gather {
    on: bool,
    /// Turns in a row that gathered nothing.
    misses: u8,
    /// Batches written at once since the last try.
    since_probe: u8,
    /// The driver is waiting its turn; the queue's stream switches then.
    waiting: Option<u32>,
    /// The queue's stream switches at the last fresh batch.
    last_switches: u32,
}

impl Gather {
    const MISSES: u8 = 8;
    const PROBE: u8 = 32;

    /// Whether the driver waits a turn before it writes now, `idle` when
    /// it has nothing of its own left to write; ends a turn it waited.
    fn waits_turn(&mut self, s: &Shared, idle: bool) -> bool {
        if self.waiting.is_some() {
            self.turned(s.queue_switches);
            return false;
        }
        idle && !s.out.is_empty() && s.streams.len() > 1 && self.waits(s.queue_switches)
    }

    /// Frames were queued while nothing was being written: wait a turn?
    fn waits(&mut self, switches: u32) -> bool {
        // Only other streams' frames since the last batch make a try worth
        // it: one stream's bulk bytes are written as they come.
        let others = std::mem::replace(&mut self.last_switches, switches) != switches;
        let wait = self.on
            || others && {
                self.since_probe += 1;
                self.since_probe >= Self::PROBE
            };
        if wait {
            self.since_probe = 0;
            self.waiting = Some(switches);
        }
        wait
    }

    /// The turn is over: did other streams queue frames meanwhile? (The
    /// stream that woke the driver queuing more of its own, as a response's
    /// body after its head, does not count: it would have before the driver
    /// ran anyway.)
    fn turned(&mut self, switches: u32) {
        if self.waiting.take() != Some(switches) {
            (self.on, self.misses) = (true, 0);
        } else if self.on {
            self.misses += 1;
            if self.misses >= Self::MISSES {
                (self.on, self.misses) = (false, 0);
            }
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> Connection<T> {
    fn fail(&mut self, e: io::Error) -> Poll<io::Result<()>> {
        lock(&self.shared).close(&e.to_string());
        self.writing.clear();
        Poll::Ready(Err(e))
    }

    /// Writes what is queued; `Ok(true)` when it wrote something.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> io::Result<bool> {
        let mut wrote = false;
        while !self.writing.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let n = super::io_slices(&self.writing, &mut slices);
            match Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..n]) {
                Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    wrote = true;
                    self.flushed = false;
                    super::advance(&mut self.writing, n);
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => return Ok(wrote),
            }
        }
        if !self.flushed {
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.flushed = true,
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => {}
            }
        }
        Ok(wrote)
    }

    /// Hands the frames read on to their streams.
    fn receive_frames(&mut self) -> io::Result<()> {
        let mut s = lock(&self.shared);
        loop {
            let frame = if let Some((stream, left, fin)) = self.data {
                // A payload's bytes as they come: the read buffer never
                // carries a partial payload over to its next allocation.
                if self.read.is_empty() {
                    break;
                }
                let n = left.min(self.read.len());
                let payload = self.read.split_to(n).freeze();
                self.data = (n < left).then_some((stream, left - n, fin));
                Frame::Data { stream, fin: fin && n == left, payload }
            } else {
                match Frame::decode(&mut self.read) {
                    Ok(Some(frame)) => frame,
                    Ok(None) => {
                        // A `Data` frame begun (its header checked by
                        // `decode`) that the buffer has no room to
                        // finish: what came of its payload is taken
                        // now, the rest as it comes.
                        let room = self.read.capacity() - self.read.len();
                        match frame::data_begun(&self.read) {
                            Some(begun)
                                if self.read.len() > frame::HEADER && room < frame::missing(&self.read) =>
                            {
                                self.read.advance(frame::HEADER);
                                self.data = Some(begun);
                                continue;
                            }
                            _ => break,
                        }
                    }
                    Err(e) => return Err(violation(e.to_string())),
                }
            };
            s.receive(frame)?;
        }
        Ok(())
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> Future for Connection<T> {
    type Output = io::Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // The socket had nothing more to read in this poll (and will wake it).
        let mut drained = false;
        for round in 0..ROUNDS {
            let unused = {
                let mut s = lock(&this.shared);
                if !s.driver.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.driver = Some(cx.waker().clone());
                }
                if round == 0 && this.gather.waits_turn(&s, this.writing.is_empty()) {
                    drop(s);
                    // Behind the tasks that are ready (its waker is the
                    // driver's, for what they queue).
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                this.writing.extend(s.out.drain(..));
                s.users == 0
            };
            let wrote = match this.poll_write_out(cx) {
                Ok(wrote) => wrote,
                Err(e) => return this.fail(e),
            };
            if unused && this.writing.is_empty() {
                let r = std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx));
                lock(&this.shared).close("closed by this end");
                return Poll::Ready(r);
            }
            // Room for the frame begun, and for more.
            let begun = if this.data.is_some() { 0 } else { frame::missing(&this.read) };
            if !drained && this.read.capacity() - this.read.len() < begun.max(READ_AT_LEAST) {
                this.read.reserve(begun.max(READ_BUFFER));
            }
            // Read until the buffer is full or nothing more is there, then
            // hand the frames on: a reader is woken once for all of it, not
            // once per TLS record.
            let (mut read, mut eof) = (false, false);
            while !drained {
                match tokio_util::io::poll_read_buf(Pin::new(&mut this.io), cx, &mut this.read) {
                    Poll::Ready(Ok(0)) => eof = true,
                    Poll::Ready(Ok(_)) => {
                        read = true;
                        if this.read.capacity() - this.read.len() >= READ_AT_LEAST {
                            continue;
                        }
                    }
                    Poll::Ready(Err(e)) => return this.fail(e),
                    Poll::Pending => drained = true,
                }
                break;
            }
            if read && let Err(e) = this.receive_frames() {
                return this.fail(e);
            }
            if eof {
                lock(&this.shared).close("closed by the other end");
                return Poll::Ready(Ok(()));
            }
            if !wrote && !read && lock(&this.shared).out.is_empty() {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<T> Connection<T> {
    /// Ends the connection here, for `why` (a key revoked): every stream,
    /// opener and acceptor waiting on it fails now, with `why` in its error.
    /// The driver is then dropped; nothing more is written.
    pub fn close(&mut self, why: &str) {
        lock(&self.shared).close(why);
    }
}

/// Dropped before it ended (the edge cutting a revoked key's tunnel drops
/// it): nothing can cross anymore, so what waits on it fails now, with why,
/// instead of waiting forever.
impl<T> Drop for Connection<T> {
    fn drop(&mut self) {
        lock(&self.shared).close("the connection was closed by this end");
    }
}

#[cfg(test)]
mod tests;
