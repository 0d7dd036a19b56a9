//! TLS streams for both ends of the tunnel: the agent's connection to the
//! edge ([`connect`]) and the edge's public HTTPS listener ([`accept`]),
//! which the tunnel is an upgrade of.
//!
//! rustls' unbuffered API does the handshake. After a TLS 1.3 handshake, when
//! the config allows secret extraction (the edge's and the tunnel client's
//! do), [`record`] protects the records: rustls keeps the key schedule
//! (its kernel API) and the records are sealed and opened in place here.
//! rustls 0.23's unbuffered API would copy each record into a `Vec` of its
//! own both ways; TLS 1.2 (public clients only) and configs without secret
//! extraction still go through it.
//!
//! Receiving: the socket is read into one buffer of ours (no zero-filling,
//! 64 KiB and a record while bulk data flows, one record's worth otherwise,
//! none while idle). Our record layer opens a record where it lies and the
//! plaintext waits there (`pt_start..pt_end`, before the records not opened
//! yet) until the reader takes it: one copy. Through rustls, what the reader
//! has no room for waits in `plain`, which is always served first.
//!
//! Sending: our record layer copies a vectored write once, into records of
//! 16 KiB whatever the slices. Through rustls, slices of 4 KiB and more are
//! sealed straight from the caller's buffers and small ones (a WebSocket and
//! an HTTP/2 frame header) are staged with the start of what follows. The
//! sealed records go to the socket in one write; past [`TX_HIGH`] unsent
//! bytes a write is `Pending` until the socket takes them.
//!
//! Closing: `poll_shutdown` sends close_notify and shuts the transport down;
//! a peer's close_notify is EOF; a transport EOF without close_notify is an
//! `UnexpectedEof` error, as with tokio-rustls.

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, EncryptError, InsufficientSizeError, UnbufferedStatus, WriteTraffic,
};
use rustls_pki_types::ServerName;

mod record;
use record::{Opened, Own};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most plaintext in one record.
const RECORD: usize = 16 * 1024;
/// Largest record a peer may send (TLS 1.2 allows 2048 bytes of expansion).
const MAX_WIRE: usize = 5 + RECORD + 2048;
/// Sealing overhead of one record, rounded up (header, nonce, tag, type).
const OVERHEAD: usize = 40;
/// Receive buffer while bulk data flows.
const RX_BIG: usize = 64 * 1024 + MAX_WIRE;
/// Receive buffer otherwise.
const RX_SMALL: usize = MAX_WIRE;
/// A read of at least this much means bulk data flows.
const RX_BUSY: usize = 8 * 1024;
/// A reader's buffer at least this large is read into directly while
/// traffic is small (our record layer).
const DIRECT_READ: usize = 1024;
/// Waits for input without bulk data after which large buffers go.
const QUIET: u8 = 4;
/// Unsent sealed bytes past which a write waits for the socket.
pub const TX_HIGH: usize = 64 * 1024;
/// Most plaintext one write takes: a WebSocket frame of a 64 KiB HTTP/2
/// frame with both headers, so that its records stay whole.
const MAX_TAKE: usize = 64 * 1024 + 64;
/// Slices at least this long are sealed straight from the caller's buffer.
const DIRECT_MIN: usize = 4 * 1024;

/// The two kinds of rustls unbuffered connections.
pub trait Endpoint: record::Tickets<Self::Data> + Unpin + Send + 'static {
    type Data: Send + 'static;
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn common(&self) -> &rustls::CommonState;
    fn into_kernel(self) -> Result<(rustls::ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error>;
}

/// Both rustls connection types have the same methods under the same names.
macro_rules! endpoint {
    ($conn:ty, $data:ty) => {
        impl Endpoint for $conn {
            type Data = $data;
            fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn common(&self) -> &rustls::CommonState {
                self
            }
            fn into_kernel(
                self,
            ) -> Result<(rustls::ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error> {
                self.dangerous_into_kernel_connection()
            }
        }
    };
}

endpoint!(UnbufferedClientConnection, ClientConnectionData);
endpoint!(UnbufferedServerConnection, ServerConnectionData);

impl record::Tickets<ClientConnectionData> for UnbufferedClientConnection {
    fn ticket(
        kernel: &mut KernelConnection<ClientConnectionData>,
        payload: &[u8],
    ) -> Result<(), rustls::Error> {
        kernel.handle_new_session_ticket(payload)
    }
}

impl record::Tickets<ServerConnectionData> for UnbufferedServerConnection {
    fn ticket(_: &mut KernelConnection<ServerConnectionData>, _: &[u8]) -> Result<(), rustls::Error> {
        Err(rustls::Error::General("a client sent a NewSessionTicket".into()))
    }
}

/// The agent's end of a tunnel connection.
pub type ClientTls<IO> = TlsStream<IO, UnbufferedClientConnection>;
/// The edge's end of a public HTTPS connection.
pub type ServerTls<IO> = TlsStream<IO, UnbufferedServerConnection>;

/// Opens TLS as a client on `io`; the error of a failed handshake is the
/// rustls error (`InvalidData`), as with tokio-rustls.
pub async fn connect<IO: AsyncRead + AsyncWrite + Unpin>(
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
    io: IO,
) -> io::Result<ClientTls<IO>> {
    let extract = config.enable_secret_extraction;
    let conn = UnbufferedClientConnection::new(config, name).map_err(tls_error)?;
    let mut tls = TlsStream::new(io, conn, &[], extract);
    // Only the agent connects: to an edge, for a tunnel connection.
    tls.b.keep.keep();
    poll_fn(|cx| tls.poll_handshake(cx)).await?;
    Ok(tls)
}

/// Accepts TLS as a server on `io`, whose first bytes (the ClientHello,
/// already read to look at it) are `prefix`.
pub async fn accept<IO: AsyncRead + AsyncWrite + Unpin>(
    config: Arc<rustls::ServerConfig>,
    io: IO,
    prefix: &[u8],
) -> io::Result<ServerTls<IO>> {
    let extract = config.enable_secret_extraction;
    let conn = UnbufferedServerConnection::new(config).map_err(tls_error)?;
    let mut tls = TlsStream::new(io, conn, prefix, extract);
    poll_fn(|cx| tls.poll_handshake(cx)).await?;
    Ok(tls)
}

pub(crate) fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A TLS connection over `IO`.
pub struct TlsStream<IO, C: Endpoint> {
    io: IO,
    conn: Conn<C>,
    b: Buffers,
    alpn: Option<Vec<u8>>,
    version: Option<rustls::ProtocolVersion>,
    suite: Option<rustls::CipherSuite>,
    /// The config lets rustls hand the traffic secrets over.
    extract: bool,
}

/// Who protects the records.
enum Conn<C: Endpoint> {
    /// rustls (the handshake; TLS 1.2; configs without secret extraction).
    Rustls(C),
    /// Our record layer, after a TLS 1.3 handshake.
    Own(Box<Own<C::Data>>),
    /// A conversion failed.
    Gone,
}

/// Sealed bytes on their way to the socket: `buf[head..tail]`. `buf` is
/// initialized up to its length (its high-water mark) so that sealing into
/// it needs no zero-filling.
#[derive(Default)]
struct TxBuf {
    buf: Vec<u8>,
    head: usize,
    tail: usize,
}

impl TxBuf {
    fn pending(&self) -> usize {
        self.tail - self.head
    }

    /// At least `need` bytes of room after what is pending. What is pending
    /// moves to the front when that copies less than what went out before
    /// it; the buffer grows otherwise (zero-filled once: sealing needs
    /// initialized bytes).
    fn room(&mut self, need: usize) -> &mut [u8] {
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
        if self.buf.len() - self.tail < need {
            if self.head > 0 && self.pending() <= self.head {
                self.buf.copy_within(self.head..self.tail, 0);
                self.tail -= self.head;
                self.head = 0;
            }
            if self.buf.len() - self.tail < need {
                let len = (self.tail + need).max(self.buf.len() * 2);
                self.buf.resize(len, 0);
            }
        }
        &mut self.buf[self.tail..]
    }
}

/// Tells a connection to keep its small buffers while it waits
/// ([`TlsStream::keep_buffers`]): it carries a tunnel. A handle, because the
/// edge learns that only once the connection went into hyper (an upgrade).
#[derive(Debug, Clone, Default)]
pub struct KeepBuffers(Arc<AtomicBool>);

impl KeepBuffers {
    pub fn keep(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Buffers {
    /// TLS bytes read: `rx[rx_start..]` are not discarded yet.
    rx: Vec<u8>,
    rx_start: usize,
    /// Bulk data came in: `rx` is the large size.
    rx_big: bool,
    /// Waits for input since the last large read.
    rx_quiet: u8,
    /// rustls holds no part of a handshake message in `rx` (the last record
    /// it processed was application data, or `rx` is empty): the records
    /// still in `rx` can wait while a write asks rustls to seal.
    aligned: bool,
    /// The transport is at EOF.
    eof: bool,
    /// The peer sent close_notify.
    peer_closed: bool,
    /// Decrypted bytes the reader had no room for: `plain[plain_pos..]`.
    plain: Vec<u8>,
    plain_pos: usize,
    /// Our record layer: decrypted bytes the reader has not taken yet,
    /// `rx[pt_start..pt_end]`, before the records from `rx_start` on.
    pt_start: usize,
    pt_end: usize,
    tx: TxBuf,
    /// Bulk data went out: `tx` grew large.
    tx_big: bool,
    /// Waits for input since the last large write.
    tx_quiet: u8,
    /// Small slices coalesced into one record.
    stage: Vec<u8>,
    /// The small buffers stay while the connection waits: it carries a
    /// tunnel, which is never idle for long, where releasing them after
    /// every burst allocated them again at the next (~1.3 k instructions a
    /// proxied request with glibc's allocator).
    keep: KeepBuffers,
    close_queued: bool,
}

/// Why processing stopped.
#[derive(Debug, PartialEq)]
enum Stop {
    /// rustls needs more bytes from the peer (or has nothing more to give).
    NeedInput,
    /// The reader's buffer is full.
    Full,
}

impl Buffers {
    /// Releases the buffers of a connection waiting for input: small ones at
    /// once (thousands of idle keep-alive connections hold none) unless it
    /// [keeps](KeepBuffers) them, large ones after [`QUIET`] waits
    /// without bulk data (bulk data that pauses keeps them rather than
    /// allocating and zero-filling them again).
    fn release_idle(&mut self) {
        let keep = self.keep.0.load(Ordering::Relaxed);
        let goes = |big: bool, quiet: u8| if big { quiet >= QUIET } else { !keep };
        self.rx_quiet = self.rx_quiet.saturating_add(1);
        if goes(self.rx_big, self.rx_quiet) && self.rx_start == self.rx.len() && self.pt_start == self.pt_end
        {
            self.rx = Vec::new();
            self.rx_start = 0;
            self.pt_start = 0;
            self.pt_end = 0;
            self.rx_big = false;
        }
        if self.plain_pos == self.plain.len() {
            self.plain = Vec::new();
            self.plain_pos = 0;
        }
        self.tx_quiet = self.tx_quiet.saturating_add(1);
        if goes(self.tx_big, self.tx_quiet) && self.tx.pending() == 0 {
            self.tx = TxBuf::default();
            self.stage = Vec::new();
            self.tx_big = false;
        }
    }
}

/// Runs rustls over the received bytes until it needs more of them (or the
/// reader's buffer is full): decrypted data goes to `out` (then `plain`),
/// handshake and alert messages to `tx`. `for_write`: only what must come
/// before sealing (records that can wait stay in `rx`).
fn drive<C: Endpoint>(
    conn: &mut C,
    b: &mut Buffers,
    mut out: Option<&mut ReadBuf<'_>>,
    for_write: bool,
) -> io::Result<Stop> {
    loop {
        let empty = for_write && b.aligned;
        let input: &mut [u8] = if empty { &mut [] } else { &mut b.rx[b.rx_start..] };
        let UnbufferedStatus { mut discard, state } = conn.process(input);
        let mut stop = None;
        let mut app_data = false;
        match state {
            Err(e) => {
                b.rx_start += discard;
                b.aligned = false;
                last_gasp(conn, b);
                return Err(tls_error(e));
            }
            Ok(ConnectionState::ReadTraffic(mut traffic)) => {
                while let Some(record) = traffic.next_record() {
                    let record = record.map_err(tls_error)?;
                    discard += record.discard;
                    // `b` is not borrowed by `traffic` (it borrows `conn` and `input`).
                    let payload = record.payload;
                    if let Some(o) = out.as_deref_mut() {
                        let n = o.remaining().min(payload.len());
                        if b.plain.len() == b.plain_pos {
                            o.put_slice(&payload[..n]);
                            b.plain.extend_from_slice(&payload[n..]);
                        } else {
                            b.plain.extend_from_slice(payload);
                        }
                    } else {
                        b.plain.extend_from_slice(payload);
                    }
                }
                app_data = true;
                if out.as_ref().is_some_and(|o| o.remaining() == 0 || b.plain_pos < b.plain.len()) {
                    stop = Some(Stop::Full);
                }
            }
            Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                let mut need = MAX_WIRE;
                loop {
                    match encode.encode(b.tx.room(need)) {
                        Ok(n) => {
                            b.tx.tail += n;
                            break;
                        }
                        Err(EncodeError::InsufficientSize(InsufficientSizeError { required_size })) => {
                            need = required_size.max(need + 1);
                        }
                        Err(EncodeError::AlreadyEncoded) => break,
                    }
                }
            }
            // The encoded bytes are in `tx`, which goes out before anything sealed later.
            Ok(ConnectionState::TransmitTlsData(transmit)) => transmit.done(),
            Ok(ConnectionState::BlockedHandshake) | Ok(ConnectionState::WriteTraffic(_)) => {
                stop = Some(Stop::NeedInput);
            }
            Ok(ConnectionState::PeerClosed) => b.peer_closed = true,
            Ok(ConnectionState::Closed) => {
                b.peer_closed = true;
                stop = Some(Stop::NeedInput);
            }
            Ok(ConnectionState::ReadEarlyData(_)) => {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "TLS early data is not accepted"));
            }
            Ok(other) => {
                return Err(io::Error::other(format!("unexpected TLS state {other:?}")));
            }
        }
        b.rx_start += discard;
        if !empty {
            b.aligned = app_data || b.rx_start == b.rx.len();
        }
        if let Some(stop) = stop {
            return Ok(stop);
        }
    }
}

/// After an error, the alert rustls queued for the peer, into `tx`.
fn last_gasp<C: Endpoint>(conn: &mut C, b: &mut Buffers) {
    let UnbufferedStatus { state, .. } = conn.process(&mut b.rx[b.rx_start..]);
    if let Ok(ConnectionState::EncodeTlsData(mut encode)) = state
        && let Ok(n) = encode.encode(b.tx.room(MAX_WIRE))
    {
        b.tx.tail += n;
    }
}

/// The sealing state: whatever must be processed first is.
fn write_traffic<'c, C: Endpoint>(conn: &'c mut C, b: &mut Buffers) -> io::Result<WriteTraffic<'c, C::Data>> {
    drive(conn, b, None, true)?;
    // The same input again: rustls answers WriteTraffic without processing anything.
    let input: &mut [u8] = if b.aligned { &mut [] } else { &mut b.rx[b.rx_start..] };
    let UnbufferedStatus { discard, state } = conn.process(input);
    b.rx_start += discard;
    match state {
        Ok(ConnectionState::WriteTraffic(traffic)) => Ok(traffic),
        Ok(ConnectionState::Closed) => {
            Err(io::Error::new(io::ErrorKind::BrokenPipe, "the TLS connection is closed"))
        }
        Ok(other) => Err(io::Error::other(format!("TLS: cannot send in state {other:?}"))),
        Err(e) => Err(tls_error(e)),
    }
}

/// Seals `data` into `tx` (several records when longer than one).
fn seal<D>(traffic: &mut WriteTraffic<'_, D>, data: &[u8], tx: &mut TxBuf) -> io::Result<()> {
    let mut need = data.len() + data.len().div_ceil(RECORD) * OVERHEAD + MAX_WIRE;
    loop {
        match traffic.encrypt(data, tx.room(need)) {
            Ok(n) => {
                tx.tail += n;
                return Ok(());
            }
            Err(EncryptError::InsufficientSize(InsufficientSizeError { required_size })) => {
                need = required_size.max(need + 1);
            }
            Err(EncryptError::EncryptExhausted) => {
                return Err(io::Error::other("TLS: the traffic keys are exhausted"));
            }
        }
    }
}

/// Seals up to `budget` bytes of `bufs`; returns how many.
fn seal_slices<D>(
    traffic: &mut WriteTraffic<'_, D>,
    bufs: &[IoSlice<'_>],
    budget: usize,
    tx: &mut TxBuf,
    stage: &mut Vec<u8>,
) -> io::Result<usize> {
    let mut taken = 0;
    'slices: for b in bufs {
        let mut s: &[u8] = b;
        while !s.is_empty() {
            let room = budget - taken;
            if room == 0 {
                break 'slices;
            }
            let n;
            if stage.is_empty() && s.len() >= DIRECT_MIN {
                // Whole records straight from the caller's buffer.
                n = if s.len() >= RECORD && room >= RECORD {
                    s.len().min(room) / RECORD * RECORD
                } else {
                    s.len().min(room)
                };
                seal(traffic, &s[..n], tx)?;
            } else if !stage.is_empty() && s.len() >= DIRECT_MIN {
                // The staged bytes with the start of this slice, so that
                // the rest of it is whole records.
                n = (s.len() % RECORD).min(RECORD - stage.len()).min(room);
                stage.extend_from_slice(&s[..n]);
                seal(traffic, stage, tx)?;
                stage.clear();
            } else {
                n = s.len().min(RECORD - stage.len()).min(room);
                if stage.capacity() == 0 {
                    stage.reserve_exact(RECORD);
                }
                stage.extend_from_slice(&s[..n]);
                if stage.len() == RECORD {
                    seal(traffic, stage, tx)?;
                    stage.clear();
                }
            }
            taken += n;
            s = &s[n..];
        }
    }
    if !stage.is_empty() {
        seal(traffic, stage, tx)?;
        stage.clear();
    }
    Ok(taken)
}

impl<IO, C: Endpoint> TlsStream<IO, C> {
    fn new(io: IO, conn: C, prefix: &[u8], extract: bool) -> Self {
        let mut b = Buffers::default();
        b.rx.reserve(RX_SMALL.max(prefix.len()));
        b.rx.extend_from_slice(prefix);
        TlsStream { io, conn: Conn::Rustls(conn), b, alpn: None, version: None, suite: None, extract }
    }

    /// A handle that makes this connection keep its small buffers while
    /// it waits, from then on.
    pub fn keep_buffers(&self) -> KeepBuffers {
        self.b.keep.clone()
    }

    /// The protocol agreed by ALPN.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        self.alpn.as_deref()
    }

    /// The TLS version agreed.
    pub fn protocol_version(&self) -> Option<rustls::ProtocolVersion> {
        self.version
    }

    /// The cipher suite agreed.
    pub fn cipher_suite(&self) -> Option<rustls::CipherSuite> {
        self.suite
    }

    /// Its name for logs and the status page (`TLS13_AES_128_GCM_SHA256`).
    pub fn cipher_name(&self) -> &'static str {
        self.suite.and_then(|s| s.as_str()).unwrap_or("unknown")
    }

    /// Our record layer protects the records (TLS 1.3, the config allowing
    /// secret extraction); otherwise rustls does.
    pub fn own_records(&self) -> bool {
        matches!(self.conn, Conn::Own(_))
    }

    /// The transport.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// The handshake is done: our record layer takes over when it can.
    fn finish_handshake(&mut self) -> io::Result<()> {
        let Conn::Rustls(c) = &self.conn else { return Ok(()) };
        let common = c.common();
        self.alpn = common.alpn_protocol().map(<[u8]>::to_vec);
        self.version = common.protocol_version();
        self.suite = common.negotiated_cipher_suite().map(|s| s.suite());
        if !self.extract || self.version != Some(rustls::ProtocolVersion::TLSv1_3) {
            return Ok(());
        }
        let Conn::Rustls(c) = std::mem::replace(&mut self.conn, Conn::Gone) else { unreachable!() };
        // rustls processed every complete record (the handshake loop ran
        // until it needed input): what is left in `rx` is for our layer.
        let (secrets, kernel) = c.into_kernel().map_err(tls_error)?;
        self.conn = Conn::Own(Box::new(Own::new(secrets, kernel)?));
        self.b.pt_start = self.b.rx_start;
        self.b.pt_end = self.b.rx_start;
        Ok(())
    }
}

/// Copies the next `out.len()` bytes of `bufs` from `at` (slice, offset) on.
fn gather(bufs: &[IoSlice<'_>], at: &mut (usize, usize), out: &mut [u8]) {
    let mut filled = 0;
    while filled < out.len() {
        let s = &bufs[at.0][at.1..];
        let n = s.len().min(out.len() - filled);
        out[filled..filled + n].copy_from_slice(&s[..n]);
        filled += n;
        at.1 += n;
        if at.1 == bufs[at.0].len() {
            *at = (at.0 + 1, 0);
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin, C: Endpoint> TlsStream<IO, C> {
    fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let Conn::Rustls(c) = &mut self.conn else { unreachable!("handshake done") };
            let processed = drive(c, &mut self.b, None, false);
            // What rustls has to say (an alert too) goes out first.
            let sent = self.poll_send(cx, 0);
            processed?;
            ready!(sent)?;
            let Conn::Rustls(c) = &self.conn else { unreachable!() };
            if !c.common().is_handshaking() {
                self.finish_handshake()?;
                return Pin::new(&mut self.io).poll_flush(cx);
            }
            if self.b.eof {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "tls handshake eof")));
            }
            ready!(self.poll_fill(cx))?;
        }
    }

    /// [`Self::poll_fill`]; while nothing comes, no read buffer is held.
    fn poll_fill_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let filled = self.poll_fill(cx);
        if filled.is_pending() {
            self.b.release_idle();
        }
        filled
    }

    /// Reads from the transport into `rx` (what was there moved to the
    /// front when room runs out; no decrypted bytes are waiting).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let b = &mut self.b;
        debug_assert_eq!(b.pt_start, b.pt_end);
        if b.rx_start == b.rx.len() {
            b.rx.clear();
            b.rx_start = 0;
        }
        let want = if b.rx_big { RX_BIG } else { RX_SMALL };
        if b.rx.capacity() - b.rx.len() < want / 4 || b.rx.capacity() < want {
            if b.rx_start > 0 {
                // What is left is the start of a record (or of a handshake
                // message rustls is joining): it moves to the front.
                b.rx.copy_within(b.rx_start.., 0);
                b.rx.truncate(b.rx.len() - b.rx_start);
                b.rx_start = 0;
            }
            let spare = b.rx.capacity() - b.rx.len();
            if spare < want / 4 || b.rx.capacity() < want {
                b.rx.reserve_exact((want - b.rx.len()).max(want / 4));
            }
        }
        b.pt_start = b.rx_start;
        b.pt_end = b.rx_start;
        let mut rb = ReadBuf::uninit(b.rx.spare_capacity_mut());
        ready!(Pin::new(&mut self.io).poll_read(cx, &mut rb))?;
        let n = rb.filled().len();
        // SAFETY: the read initialized the first `n` bytes of the spare capacity.
        unsafe { b.rx.set_len(b.rx.len() + n) };
        if n == 0 {
            b.eof = true;
        } else if n >= RX_BUSY {
            b.rx_big = true;
            b.rx_quiet = 0;
        }
        Poll::Ready(Ok(()))
    }

    /// Writes sealed bytes until at most `keep` are left.
    fn poll_send(&mut self, cx: &mut Context<'_>, keep: usize) -> Poll<io::Result<()>> {
        while self.b.tx.pending() > keep {
            let tx = &mut self.b.tx;
            match ready!(Pin::new(&mut self.io).poll_write(cx, &tx.buf[tx.head..tx.tail]))? {
                0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                n => tx.head += n,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Reads through rustls.
    fn poll_read_rustls(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let start = buf.filled().len();
        loop {
            let b = &mut self.b;
            if b.plain_pos < b.plain.len() {
                let n = buf.remaining().min(b.plain.len() - b.plain_pos);
                buf.put_slice(&b.plain[b.plain_pos..b.plain_pos + n]);
                b.plain_pos += n;
                if b.plain_pos == b.plain.len() {
                    b.plain.clear();
                    b.plain_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if buf.remaining() == 0 || buf.filled().len() > start {
                return Poll::Ready(Ok(()));
            }
            let Conn::Rustls(c) = &mut self.conn else { unreachable!() };
            if let Err(e) = drive(c, &mut self.b, Some(buf), false) {
                // The alert rustls queued, if the socket takes it now.
                let _ = self.poll_send(cx, 0);
                return Poll::Ready(Err(e));
            }
            if buf.filled().len() > start || self.b.plain_pos < self.b.plain.len() {
                continue;
            }
            if self.b.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if self.b.eof {
                return Poll::Ready(Err(unexpected_eof()));
            }
            ready!(self.poll_fill_idle(cx))?;
        }
    }

    /// Reads through our record layer: records are opened in place in `rx`
    /// and their plaintext copied once, into `buf`.
    fn poll_read_own(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let start = buf.filled().len();
        loop {
            let b = &mut self.b;
            if b.pt_start < b.pt_end {
                let n = buf.remaining().min(b.pt_end - b.pt_start);
                buf.put_slice(&b.rx[b.pt_start..b.pt_start + n]);
                b.pt_start += n;
                if buf.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            let Conn::Own(own) = &mut self.conn else { unreachable!() };
            let avail = b.rx.len() - b.rx_start;
            if !b.peer_closed && avail >= 5 {
                let at = b.rx_start;
                let len = u16::from_be_bytes([b.rx[at + 3], b.rx[at + 4]]) as usize;
                if len > record::MAX_BODY {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("TLS: a record of {len} bytes"),
                    )));
                }
                if avail >= 5 + len {
                    b.rx_start += 5 + len;
                    match own.open::<C>(&mut b.rx[at..at + 5 + len])? {
                        Opened::Data(r) => (b.pt_start, b.pt_end) = (at + r.start, at + r.end),
                        Opened::Nothing => {}
                        Opened::Closed => b.peer_closed = true,
                    }
                    if own.update_due {
                        // Goes out with the next write or flush, before what it seals.
                        let n = own.seal_key_update(b.tx.room(record::sealed_len(5)))?;
                        b.tx.tail += n;
                    }
                    continue;
                }
            }
            if buf.filled().len() > start || b.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if b.eof {
                return Poll::Ready(Err(unexpected_eof()));
            }
            if !b.rx_big && b.rx_start == b.rx.len() && buf.remaining() >= DIRECT_READ {
                // Small traffic: no buffer of ours at all.
                match self.poll_read_direct(cx, buf) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        self.b.release_idle();
                        return Poll::Pending;
                    }
                }
            }
            ready!(self.poll_fill_idle(cx))?;
        }
    }

    /// Reads straight into the reader's buffer and opens the records there,
    /// each one's plaintext moved to where the reader's data goes on; the
    /// start of a record that did not arrive whole goes to `rx`. A large read
    /// that fills the reader's buffer says bulk data comes: `rx` from then on.
    fn poll_read_direct(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let room = buf.remaining();
        let mut sub = buf.take(room);
        ready!(Pin::new(&mut self.io).poll_read(cx, &mut sub))?;
        let n = sub.filled().len();
        let b = &mut self.b;
        if n == 0 {
            b.eof = true;
            return Poll::Ready(Ok(()));
        }
        if n == room && n >= RX_BUSY {
            b.rx_big = true;
            b.rx_quiet = 0;
        }
        // SAFETY: the read initialized the first `n` bytes of the unfilled part.
        unsafe { buf.assume_init(n) };
        let filled = buf.filled().len();
        let region = &mut buf.initialized_mut()[filled..filled + n];
        let Conn::Own(own) = &mut self.conn else { unreachable!() };
        let (mut at, mut out) = (0, 0);
        while !b.peer_closed && n - at >= 5 {
            let len = u16::from_be_bytes([region[at + 3], region[at + 4]]) as usize;
            if len > record::MAX_BODY {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("TLS: a record of {len} bytes"),
                )));
            }
            if n - at < 5 + len {
                break;
            }
            match own.open::<C>(&mut region[at..at + 5 + len])? {
                Opened::Data(r) => {
                    region.copy_within(at + r.start..at + r.end, out);
                    out += r.len();
                }
                Opened::Nothing => {}
                Opened::Closed => b.peer_closed = true,
            }
            if own.update_due {
                let k = own.seal_key_update(b.tx.room(record::sealed_len(5)))?;
                b.tx.tail += k;
            }
            at += 5 + len;
        }
        if !b.peer_closed && at < n {
            b.rx.clear();
            b.rx_start = 0;
            b.rx.reserve(RX_SMALL);
            b.rx.extend_from_slice(&region[at..]);
        }
        buf.advance(out);
        Poll::Ready(Ok(()))
    }

    /// Seals `budget` bytes of `bufs` with our record layer: each byte is
    /// copied once, into the record it goes out in, records cut at 16 KiB
    /// whatever the slices.
    fn seal_own(&mut self, bufs: &[IoSlice<'_>], budget: usize) -> io::Result<usize> {
        let Conn::Own(own) = &mut self.conn else { unreachable!() };
        let tx = &mut self.b.tx;
        let mut at = (0, 0);
        let mut taken = 0;
        while taken < budget {
            if own.wants_key_update() {
                let n = own.seal_key_update(tx.room(record::sealed_len(5)))?;
                tx.tail += n;
            }
            let n = (budget - taken).min(RECORD);
            let room = tx.room(record::sealed_len(n));
            tx.tail += record::seal(&mut own.tx, 23, n, room, |out| gather(bufs, &mut at, out))?;
            taken += n;
        }
        Ok(taken)
    }
}

fn unexpected_eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed connection without sending TLS close_notify")
}

impl<IO: AsyncRead + AsyncWrite + Unpin, C: Endpoint> AsyncRead for TlsStream<IO, C> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.conn {
            Conn::Rustls(_) => this.poll_read_rustls(cx, buf),
            // What rustls decrypted after the handshake comes first.
            Conn::Own(_) if this.b.plain_pos < this.b.plain.len() => this.poll_read_rustls(cx, buf),
            Conn::Own(_) => this.poll_read_own(cx, buf),
            Conn::Gone => Poll::Ready(Err(io::Error::other("TLS: the connection failed"))),
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin, C: Endpoint> AsyncWrite for TlsStream<IO, C> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        if this.b.close_queued {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "TLS close_notify was sent")));
        }
        if this.b.tx.pending() >= TX_HIGH {
            ready!(this.poll_send(cx, TX_HIGH - 1))?;
        }
        let budget = total.min(MAX_TAKE);
        let taken = match &mut this.conn {
            Conn::Own(_) => this.seal_own(bufs, budget)?,
            Conn::Rustls(c) => {
                let mut traffic = write_traffic(c, &mut this.b)?;
                let b = &mut this.b;
                seal_slices(&mut traffic, bufs, budget, &mut b.tx, &mut b.stage)?
            }
            Conn::Gone => return Poll::Ready(Err(io::Error::other("TLS: the connection failed"))),
        };
        if taken >= RECORD {
            this.b.tx_big = true;
            this.b.tx_quiet = 0;
        }
        // The bytes are taken: the socket not taking them now is fine.
        if let Poll::Ready(Err(e)) = this.poll_send(cx, 0) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_send(cx, 0))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.b.close_queued {
            this.b.close_queued = true;
            let tx = &mut this.b.tx;
            match &mut this.conn {
                Conn::Own(own) => {
                    if let Ok(n) = own.seal_close_notify(tx.room(record::sealed_len(2))) {
                        tx.tail += n;
                    }
                }
                // A connection already closed or failed just shuts the transport.
                Conn::Rustls(c) => {
                    if let Ok(mut traffic) = write_traffic(c, &mut this.b) {
                        let tx = &mut this.b.tx;
                        if let Ok(n) = traffic.queue_close_notify(tx.room(MAX_WIRE)) {
                            tx.tail += n;
                        }
                    }
                }
                Conn::Gone => {}
            }
        }
        ready!(this.poll_send(cx, 0))?;
        match ready!(Pin::new(&mut this.io).poll_shutdown(cx)) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    const NAME: &str = "edge.test";

    struct Pki {
        server: Arc<rustls::ServerConfig>,
        roots: Arc<rustls::RootCertStore>,
        _dir: tempfile::TempDir,
    }

    fn pki() -> Pki {
        let pki = crate::tls::generate_pki(&[NAME.to_string()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = (dir.path().join("ca.pem"), dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        std::fs::write(&cert, &pki.cert_pem).unwrap();
        std::fs::write(&key, &pki.key_pem).unwrap();
        let certified = crate::tls::certified_key(
            crate::tls::load_pem_certs(&cert).unwrap(),
            crate::tls::load_pem_key(&key).unwrap(),
        )
        .unwrap();
        let server = crate::tls::server_config(Arc::new(crate::tls::CertResolver::new(certified))).unwrap();
        let roots = Arc::new(crate::tls::root_store(Some(&ca)).unwrap());
        Pki { server, roots, _dir: dir }
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// TLS 1.2 (rustls protects the records), TLS 1.3 with rustls or with
    /// our record layer after the handshake.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Mode {
        Tls12,
        Tls13,
        Own,
    }
    use Mode::*;
    const MODES: [Mode; 3] = [Tls12, Tls13, Own];

    fn server_config(pki: &Pki, mode: Mode) -> Arc<rustls::ServerConfig> {
        let mut config = (*pki.server).clone();
        config.enable_secret_extraction = mode == Own;
        Arc::new(config)
    }

    fn client_config(pki: &Pki, mode: Mode) -> Arc<rustls::ClientConfig> {
        client_config_on(pki, mode, provider())
    }

    /// [`client_config`] offering only `provider`'s suites.
    fn client_config_on(
        pki: &Pki,
        mode: Mode,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Arc<rustls::ClientConfig> {
        let versions: &[&rustls::SupportedProtocolVersion] =
            if mode == Tls12 { &[&rustls::version::TLS12] } else { &[&rustls::version::TLS13] };
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(pki.roots.clone())
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config.enable_secret_extraction = mode == Own;
        Arc::new(config)
    }

    fn name() -> ServerName<'static> {
        ServerName::try_from(NAME).unwrap()
    }

    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.unwrap(), server.unwrap().0)
    }

    /// Ours on both ends, over a fresh TCP connection.
    async fn pair(pki: &Pki, mode: Mode) -> (ClientTls<TcpStream>, ServerTls<TcpStream>) {
        let (c, s) = tcp_pair().await;
        let (client, server) = tokio::join!(
            connect(client_config(pki, mode), name(), c),
            accept(server_config(pki, mode), s, &[])
        );
        let (client, server) = (client.unwrap(), server.unwrap());
        assert_eq!((client.own_records(), server.own_records()), (mode == Own, mode == Own));
        (client, server)
    }

    /// Deterministic bytes that differ everywhere.
    fn random(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A ping both ways and ALPN, whatever the two ends are.
    async fn ping<A, B>(mut a: A, mut b: B)
    where
        A: AsyncRead + AsyncWrite + Unpin,
        B: AsyncRead + AsyncWrite + Unpin,
    {
        a.write_all(b"ping").await.unwrap();
        a.flush().await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        b.write_all(b"pong!").await.unwrap();
        b.flush().await.unwrap();
        let mut got = [0u8; 5];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong!");
    }

    #[tokio::test]
    async fn handshakes_with_itself_and_with_tokio_rustls_in_tls12_and_tls13() {
        let pki = pki();
        for mode in MODES {
            // Ours on both ends.
            let (c, s) = pair(&pki, mode).await;
            assert_eq!(c.alpn_protocol(), Some(&b"h2"[..]));
            assert_eq!(s.alpn_protocol(), Some(&b"h2"[..]));
            let version = c.protocol_version();
            assert_eq!(
                version,
                Some(if mode == Tls12 {
                    rustls::ProtocolVersion::TLSv1_2
                } else {
                    rustls::ProtocolVersion::TLSv1_3
                })
            );
            ping(c, s).await;

            // Ours as the client, tokio-rustls as the server.
            let (c, s) = tcp_pair().await;
            let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&pki, mode));
            let (c, s) = tokio::join!(connect(client_config(&pki, mode), name(), c), acceptor.accept(s));
            let (c, s) = (c.unwrap(), s.unwrap());
            assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
            ping(c, s).await;

            // tokio-rustls as the client, ours as the server (with the
            // ClientHello read before, as the edge does).
            let (c, mut s) = tcp_pair().await;
            let connector = tokio_rustls::TlsConnector::from(client_config(&pki, mode));
            let server = async {
                // The first record, the ClientHello, read before.
                let mut hello = vec![0u8; 5];
                s.read_exact(&mut hello).await.unwrap();
                assert_eq!(hello[0], 22, "a handshake record");
                let len = u16::from_be_bytes([hello[3], hello[4]]) as usize;
                hello.resize(5 + len, 0);
                s.read_exact(&mut hello[5..]).await.unwrap();
                accept(server_config(&pki, mode), s, &hello).await
            };
            let (c, s) = tokio::join!(connector.connect(name(), c), server);
            let (c, s) = (c.unwrap(), s.unwrap());
            assert_eq!(s.alpn_protocol(), Some(&b"h2"[..]));
            ping(c, s).await;
        }
    }

    #[tokio::test]
    async fn an_unknown_ca_fails_the_handshake_with_the_rustls_error_on_both_ends() {
        let pki = pki();
        let other = self::pki();
        let (c, s) = tcp_pair().await;
        let (c, s) =
            tokio::join!(connect(client_config(&other, Own), name(), c), accept(pki.server.clone(), s, &[]));
        let c = c.err().expect("the client refuses the certificate");
        assert_eq!(c.kind(), io::ErrorKind::InvalidData);
        // (Both CAs have the same name: the signature is what does not match.)
        assert!(c.to_string().contains("invalid peer certificate: BadSignature"), "{c}");
        // The client told the server why (its alert went out).
        let s = s.err().expect("the server sees the alert");
        assert!(s.to_string().contains("received fatal alert: DecryptError"), "{s}");
    }

    /// Writes `data` in slices of varied sizes, a small "header" before a
    /// large "payload" now and then, as vectored writes.
    async fn write_varied<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8], seed: u64) {
        let sizes = random(4096, seed);
        let mut pos = 0;
        let mut i = 0;
        while pos < data.len() {
            let pick = |k: usize| sizes[k % sizes.len()] as usize;
            let head = (pick(i) % 24 + 1).min(data.len() - pos);
            let body = match pick(i + 1) % 4 {
                0 => pick(i + 2) * 7,
                1 => 16 * 1024 + pick(i + 2),
                2 => 64 * 1024,
                _ => 4096 * (pick(i + 2) % 20),
            }
            .min(data.len() - pos - head);
            i += 3;
            let (h, b) = data[pos..pos + head + body].split_at(head);
            let mut bufs = [IoSlice::new(h), IoSlice::new(b)];
            let mut bufs = &mut bufs[..];
            let mut left = head + body;
            while left > 0 {
                let n = w.write_vectored(bufs).await.unwrap();
                left -= n;
                IoSlice::advance_slices(&mut bufs, n);
            }
            pos += head + body;
        }
        w.flush().await.unwrap();
    }

    /// Reads everything to EOF with reads of varied sizes (some tiny).
    async fn read_varied<R: AsyncRead + Unpin>(r: &mut R, seed: u64) -> Vec<u8> {
        let sizes = random(4096, seed);
        let mut got = Vec::new();
        let mut buf = vec![0u8; 100_000];
        for i in 0.. {
            let n = match sizes[i % sizes.len()] % 5 {
                0 => 1 + sizes[(i + 1) % sizes.len()] as usize % 7,
                1 => 100_000,
                _ => 1 + sizes[(i + 1) % sizes.len()] as usize * 97,
            };
            let read = r.read(&mut buf[..n]).await.unwrap();
            if read == 0 {
                return got;
            }
            got.extend_from_slice(&buf[..read]);
        }
        unreachable!()
    }

    /// `up` from the client and `down` from the server at once, each in
    /// writes of varied sizes then a shutdown (seeds from `seed`): what
    /// each end read.
    async fn exchange<A, B>(c: A, s: B, up: &[u8], down: &[u8], seed: u64) -> (Vec<u8>, Vec<u8>)
    where
        A: AsyncRead + AsyncWrite + Unpin,
        B: AsyncRead + AsyncWrite + Unpin,
    {
        let (mut cr, mut cw) = tokio::io::split(c);
        let (mut sr, mut sw) = tokio::io::split(s);
        let (_, _, got_up, got_down) = tokio::join!(
            async {
                write_varied(&mut cw, up, seed).await;
                cw.shutdown().await.unwrap();
            },
            async {
                write_varied(&mut sw, down, seed + 1).await;
                sw.shutdown().await.unwrap();
            },
            read_varied(&mut sr, seed + 2),
            read_varied(&mut cr, seed + 3),
        );
        (got_up, got_down)
    }

    #[tokio::test]
    async fn large_transfers_both_ways_at_once_arrive_intact() {
        let pki = pki();
        for mode in MODES {
            let (c, s) = pair(&pki, mode).await;
            let up = random(5 * 1024 * 1024 + 12_345, 1);
            let down = random(3 * 1024 * 1024 + 777, 2);
            let (got_up, got_down) = exchange(c, s, &up, &down, 3).await;
            assert!(got_up == up, "upload: {} of {} bytes, or different", got_up.len(), up.len());
            assert!(got_down == down, "download: {} of {} bytes, or different", got_down.len(), down.len());
        }
    }

    #[tokio::test]
    async fn a_transport_that_takes_a_few_bytes_at_a_time_applies_backpressure() {
        let pki = pki();
        for mode in MODES {
            // A 1 KiB pipe: writes are Pending most of the time.
            let (c, s) = tokio::io::duplex(1024);
            let (c, s) = tokio::join!(
                connect(client_config(&pki, mode), name(), c),
                accept(server_config(&pki, mode), s, &[])
            );
            let (mut c, mut s) = (c.unwrap(), s.unwrap());
            let data = random(1024 * 1024 + 3, 7);
            let (_, got) = tokio::join!(
                async {
                    write_varied(&mut c, &data, 8).await;
                    assert!(c.b.tx.pending() == 0);
                    c.shutdown().await.unwrap();
                },
                read_varied(&mut s, 9),
            );
            assert!(got == data, "{mode:?}");
        }
    }

    /// A transport that keeps a copy of what was written.
    struct Tap<S> {
        inner: S,
        log: Arc<Mutex<Vec<u8>>>,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let r = Pin::new(&mut this.inner).poll_write(cx, buf);
            if let Poll::Ready(Ok(n)) = r {
                this.log.lock().unwrap().extend_from_slice(&buf[..n]);
            }
            r
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    /// The plaintext length of each TLS 1.3 record in `wire`.
    fn record_sizes(wire: &[u8]) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut rest = wire;
        while rest.len() >= 5 {
            let len = u16::from_be_bytes([rest[3], rest[4]]) as usize;
            assert_eq!(rest[0], 23, "application data");
            sizes.push(len - 17);
            rest = &rest[5 + len..];
        }
        assert!(rest.is_empty());
        sizes
    }

    #[tokio::test]
    async fn vectored_writes_seal_headers_with_their_payload_in_full_records() {
        let pki = pki();
        for mode in [Tls13, Own] {
            let (c, s) = tcp_pair().await;
            let log = Arc::new(Mutex::new(Vec::new()));
            let c = Tap { inner: c, log: log.clone() };
            let (c, s) = tokio::join!(
                connect(client_config(&pki, mode), name(), c),
                accept(server_config(&pki, mode), s, &[])
            );
            let (mut c, mut s) = (c.unwrap(), s.unwrap());
            let mut sent = Vec::new();
            let mut write = async |bufs: &[&[u8]]| {
                log.lock().unwrap().clear();
                let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
                let n = c.write_vectored(&slices).await.unwrap();
                assert_eq!(n, bufs.iter().map(|b| b.len()).sum::<usize>());
                c.flush().await.unwrap();
                bufs.iter().for_each(|b| sent.extend_from_slice(b));
                record_sizes(&log.lock().unwrap())
            };
            let payload = random(64 * 1024, 10);
            // A WebSocket header and an h2 frame header before a 10 KiB frame: one record.
            assert_eq!(write(&[&[1; 4], &[2; 9], &payload[..10240]]).await, [10253]);
            let big = write(&[&[1; 14], &[2; 9], &payload]).await;
            let odd = write(&[&[3; 4], &payload[..20000]]).await;
            if mode == Own {
                // Each byte is copied once into its record: records are cut at 16 KiB.
                assert_eq!(big, [16384, 16384, 16384, 16384, 23]);
                assert_eq!(odd, [16384, 3620]);
            } else {
                // rustls seals one slice at a time: the headers make the one
                // record beyond four full ones (five are needed anyway), the
                // payload is sealed where it is.
                assert_eq!(big, [23, 16384, 16384, 16384, 16384]);
                // The headers go with the first 3616 bytes, the rest is a full record.
                assert_eq!(odd, [3620, 16384]);
            }
            // Many small slices coalesce.
            let small: Vec<&[u8]> = (0..100).map(|i| &payload[i * 10..i * 10 + 10]).collect();
            assert_eq!(write(&small).await, [1000]);
            let mut got = vec![0u8; sent.len()];
            s.read_exact(&mut got).await.unwrap();
            assert!(got == sent);
        }
    }

    #[tokio::test]
    async fn close_notify_both_ways_and_half_close() {
        let pki = pki();
        for mode in MODES {
            let (mut c, mut s) = pair(&pki, mode).await;
            c.write_all(b"last words").await.unwrap();
            c.shutdown().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, b"last words", "close_notify is EOF");
            // The other direction still works after the peer's close_notify.
            s.write_all(b"an answer").await.unwrap();
            s.shutdown().await.unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).await.unwrap();
            assert_eq!(got, b"an answer");
            assert!(c.write_all(b"more").await.is_err(), "no writes after close_notify");
        }
    }

    #[tokio::test]
    async fn a_transport_eof_without_close_notify_is_an_unexpected_eof() {
        let pki = pki();
        for mode in MODES {
            let (c, s) = tcp_pair().await;
            let (c, s) = tokio::join!(
                connect(client_config(&pki, mode), name(), c),
                tokio_rustls::TlsAcceptor::from(server_config(&pki, mode)).accept(s)
            );
            let (mut c, mut s) = (c.unwrap(), s.unwrap());
            s.write_all(b"some").await.unwrap();
            s.flush().await.unwrap();
            let (mut tcp, _) = s.into_inner();
            tcp.shutdown().await.unwrap(); // TCP FIN, no close_notify
            let mut buf = [0u8; 10];
            assert_eq!(c.read(&mut buf).await.unwrap(), 4);
            let err = c.read(&mut buf).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{mode:?}");
        }

        // And in the handshake.
        let (c, mut s) = tcp_pair().await;
        s.shutdown().await.unwrap();
        let err = connect(client_config(&pki, Own), name(), c).await.err().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn garbage_is_an_error_not_a_hang() {
        let pki = pki();
        let junk = random(40_000, 11);
        // Instead of a ClientHello.
        let (mut c, s) = tcp_pair().await;
        c.write_all(&junk).await.unwrap();
        let err = tokio::time::timeout(Duration::from_secs(5), accept(pki.server.clone(), s, &[]))
            .await
            .expect("no hang")
            .err()
            .expect("an error");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        // After the handshake: a record header and junk that does not
        // decrypt, or a record too long, or a record of another type.
        for mode in MODES {
            for record in [&[23, 3, 3, 0x10, 0][..], &[23, 3, 3, 0x48, 0], &[99, 3, 3, 0x10, 0]] {
                let (c, s) = tcp_pair().await;
                let (c, s) = tokio::join!(
                    connect(client_config(&pki, mode), name(), c),
                    tokio_rustls::TlsAcceptor::from(server_config(&pki, mode)).accept(s)
                );
                let (mut c, s) = (c.unwrap(), s.unwrap());
                let (mut tcp, _) = s.into_inner();
                let mut record = record.to_vec();
                record.extend_from_slice(&junk[..0x4800]);
                tcp.write_all(&record).await.unwrap();
                let mut buf = [0u8; 100];
                let err = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
                    .await
                    .expect("no hang")
                    .unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{mode:?} {err}");
            }
        }
    }

    #[tokio::test]
    async fn key_updates_from_the_peer_are_followed_both_ways() {
        let pki = pki();
        for mode in [Tls13, Own] {
            let (c, s) = tcp_pair().await;
            let (c, s) = tokio::join!(
                connect(client_config(&pki, mode), name(), c),
                tokio_rustls::TlsAcceptor::from(server_config(&pki, mode)).accept(s)
            );
            let (mut c, mut s) = (c.unwrap(), s.unwrap());
            assert_eq!(c.own_records(), mode == Own);
            for round in 0..3u8 {
                // The peer updates its keys and asks for ours to be updated too.
                s.get_mut().1.refresh_traffic_keys().unwrap();
                let data = random(100_000, round as u64);
                s.write_all(&data).await.unwrap();
                s.flush().await.unwrap();
                let mut got = vec![0u8; data.len()];
                c.read_exact(&mut got).await.unwrap();
                assert!(got == data);
                // Our answer (a KeyUpdate of ours) goes before what we send next.
                c.write_all(&data).await.unwrap();
                c.flush().await.unwrap();
                s.read_exact(&mut got).await.unwrap();
                assert!(got == data);
            }
            // Our own updates (every 64 records in tests) when a key has sealed enough.
            let data = random(3 * 1024 * 1024 + 5, 20);
            let (_, got) = tokio::join!(
                async {
                    c.write_all(&data).await.unwrap();
                    c.flush().await.unwrap();
                },
                async {
                    let mut got = vec![0u8; data.len()];
                    s.read_exact(&mut got).await.unwrap();
                    got
                }
            );
            assert!(got == data, "{mode:?}");
        }
    }

    /// Every TLS 1.3 suite (AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305,
    /// what `--tunnel-cipher` can pick) seals and opens our records, both
    /// ways at once, across our own key updates.
    #[tokio::test]
    async fn every_tls13_suite_carries_both_ways_across_key_updates_on_our_records() {
        use rustls::CipherSuite::*;
        let pki = pki();
        for suite in [TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256] {
            let mut provider = rustls::crypto::ring::default_provider();
            provider.cipher_suites.retain(|s| s.suite() == suite);
            let config = client_config_on(&pki, Own, Arc::new(provider));
            let (c, s) = tcp_pair().await;
            let (c, s) = tokio::join!(connect(config, name(), c), accept(server_config(&pki, Own), s, &[]));
            let (c, s) = (c.unwrap(), s.unwrap());
            assert!(c.own_records() && s.own_records());
            assert_eq!((c.cipher_suite(), s.cipher_suite()), (Some(suite), Some(suite)));
            // 2 MiB each way: 128 records, two key updates (every 64 in tests).
            let (up, down) = (random(2 << 20, 7), random((2 << 20) + 3, 8));
            let (got_up, got_down) = exchange(c, s, &up, &down, 9).await;
            assert!(
                got_up == up && got_down == down,
                "{suite:?}: {} / {} bytes",
                got_up.len(),
                got_down.len()
            );
        }
    }

    /// The edge's end of a public connection (the server here) releases its
    /// buffers while idle; the agent's end of a tunnel (the client) keeps
    /// its small ones. Both let the large ones go.
    #[tokio::test]
    async fn an_idle_connection_holds_no_buffers() {
        let pki = pki();
        for mode in MODES {
            // Request and response: the server's buffers go at the first
            // wait, the client's stay (the same ones, as traffic goes on).
            let (mut c, mut s) = pair(&pki, mode).await;
            c.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            c.flush().await.unwrap();
            let mut req = [0u8; 18];
            s.read_exact(&mut req).await.unwrap();
            s.write_all(&random(3000, 13)).await.unwrap();
            s.flush().await.unwrap();
            let mut resp = [0u8; 3000];
            c.read_exact(&mut resp).await.unwrap();
            let mut one = [0u8; 1];
            for end in [&mut c as &mut (dyn AsyncRead + Unpin), &mut s] {
                let pending = tokio::time::timeout(Duration::from_millis(20), end.read(&mut one)).await;
                assert!(pending.is_err());
            }
            let b = &s.b;
            assert_eq!((b.rx.capacity(), b.plain.capacity(), b.tx.buf.capacity()), (0, 0, 0), "{mode:?}");
            let kept = (c.b.rx.as_ptr(), c.b.rx.capacity(), c.b.tx.buf.as_ptr(), c.b.tx.buf.capacity());
            assert!(kept.1 > 0 && kept.3 > 0, "{mode:?}");
            assert_eq!(c.b.plain.capacity(), 0, "{mode:?}");

            // Our record layer reads small traffic straight into the reader's
            // buffer: no buffer of its own at all.
            for _ in 0..3 {
                c.write_all(b"a small request").await.unwrap();
                c.flush().await.unwrap();
                let mut big = vec![0u8; 65536];
                let n = s.read(&mut big).await.unwrap();
                assert_eq!(&big[..n], b"a small request");
                if mode == Own {
                    assert_eq!(s.b.rx.capacity(), 0);
                }
                let pending = tokio::time::timeout(Duration::from_millis(20), c.read(&mut one)).await;
                assert!(pending.is_err());
            }
            let now = (c.b.rx.as_ptr(), c.b.rx.capacity(), c.b.tx.buf.as_ptr(), c.b.tx.buf.capacity());
            assert_eq!(now, kept, "{mode:?}: the client's buffers are the same ones");
            // A server told through its handle (the edge, once a connection
            // turned out to carry a tunnel) keeps them from then on.
            s.keep_buffers().keep();
            s.write_all(b"a small response").await.unwrap();
            s.flush().await.unwrap();
            c.read_exact(&mut [0u8; 16]).await.unwrap();
            let pending = tokio::time::timeout(Duration::from_millis(20), s.read(&mut one)).await;
            assert!(pending.is_err());
            assert!(s.b.tx.buf.capacity() > 0, "{mode:?}: the server keeps its send buffer");

            // Bulk data, then waits.
            let (mut c, mut s) = pair(&pki, mode).await;
            let data = random(1024 * 1024, 12);
            let (_, got) = tokio::join!(
                async {
                    c.write_all(&data).await.unwrap();
                    c.flush().await.unwrap();
                },
                async {
                    let mut got = vec![0u8; data.len()];
                    s.read_exact(&mut got).await.unwrap();
                    got
                }
            );
            assert!(got == data);
            // A small exchange ends the bulk phase, then both ends wait for more.
            c.write_all(b"x").await.unwrap();
            c.flush().await.unwrap();

            s.read_exact(&mut one).await.unwrap();
            s.write_all(b"y").await.unwrap();
            s.flush().await.unwrap();
            c.read_exact(&mut one).await.unwrap();
            // Large buffers go after a few waits without bulk data.
            for _ in 0..QUIET {
                let pending = tokio::time::timeout(Duration::from_millis(20), s.read(&mut one)).await;
                assert!(pending.is_err());
                let pending = tokio::time::timeout(Duration::from_millis(20), c.read(&mut one)).await;
                assert!(pending.is_err());
            }
            // The client read no bulk data: its receive buffer is at most
            // the small one it keeps.
            assert!(c.b.rx.capacity() <= RX_SMALL, "{mode:?}");
            assert_eq!(s.b.rx.capacity(), 0, "{mode:?}");
            for b in [&c.b, &s.b] {
                assert_eq!(
                    (b.plain.capacity(), b.tx.buf.capacity(), b.stage.capacity()),
                    (0, 0, 0),
                    "{mode:?}"
                );
            }
        }
    }
}
