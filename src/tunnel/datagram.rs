//! UDP datagrams inside a tunnel stream (`StreamKind::Udp`): one public flow
//! (client address and port on one reservation) is one full-duplex stream,
//! and each datagram is framed in it as a 2-byte big-endian length and the
//! payload. The stream's flow control and the edge's upload budgets
//! (`tunnel::budget`) apply as to any other stream.
//!
//! Each direction has a [`Queue`] bounded in bytes (and by a parent tally,
//! the edge's or the agent's total): a datagram that does not fit is
//! dropped and counted, never buffered without bound. UDP may drop; memory
//! may not grow.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

use crate::constants::MAX_DATAGRAM;

/// The frame of one datagram: its length (2 bytes, big-endian), then it.
/// `None` for a payload larger than [`MAX_DATAGRAM`] (dropped by callers).
pub fn encode(payload: &[u8]) -> Option<Bytes> {
    if payload.len() > MAX_DATAGRAM {
        return None;
    }
    let mut out = BytesMut::with_capacity(2 + payload.len());
    out.put_u16(payload.len() as u16);
    out.put_slice(payload);
    Some(out.freeze())
}

/// A frame whose length says more than [`MAX_DATAGRAM`]: the peer is broken
/// (culvert never sends one), and the stream ends.
#[derive(Debug, thiserror::Error)]
#[error("a datagram frame of {0} bytes is larger than the {MAX_DATAGRAM}-byte limit")]
pub struct Oversize(pub usize);

/// Splits the bytes of a stream back into datagrams.
#[derive(Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    /// Adds bytes read from the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole datagram, if one is buffered.
    pub fn next_datagram(&mut self) -> Result<Option<Bytes>, Oversize> {
        if self.buf.len() < 2 {
            return Ok(None);
        }
        let len = usize::from(u16::from_be_bytes([self.buf[0], self.buf[1]]));
        if len > MAX_DATAGRAM {
            return Err(Oversize(len));
        }
        if self.buf.len() < 2 + len {
            return Ok(None);
        }
        self.buf.advance(2);
        Ok(Some(self.buf.split_to(len).freeze()))
    }
}

/// Bytes queued in several queues together, with a limit (the edge's or the
/// agent's share of memory for datagrams in flight).
#[derive(Debug)]
pub struct Tally {
    limit: usize,
    held: AtomicUsize,
}

impl Tally {
    pub fn new(limit: usize) -> Arc<Tally> {
        Arc::new(Tally { limit, held: AtomicUsize::new(0) })
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn try_take(&self, n: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| (h + n <= self.limit).then_some(h + n))
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }
}

/// The sending side of a flow's queue; see [`queue`].
#[derive(Clone)]
pub struct Queue {
    tx: mpsc::UnboundedSender<Bytes>,
    own: Arc<Tally>,
    total: Arc<Tally>,
}

/// The receiving side: a body of the queued frames, ending when every
/// [`Queue`] is dropped. What it still holds is given back when dropped.
pub struct QueueBody {
    rx: mpsc::UnboundedReceiver<Bytes>,
    own: Arc<Tally>,
    total: Arc<Tally>,
}

/// A queue of at most `limit` bytes of frames, also charged to `total`.
pub fn queue(limit: usize, total: Arc<Tally>) -> (Queue, QueueBody) {
    let (tx, rx) = mpsc::unbounded_channel();
    let own = Tally::new(limit);
    (Queue { tx, own: own.clone(), total: total.clone() }, QueueBody { rx, own, total })
}

/// Why a datagram was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The flow's queue, or every flow's together, is full: dropped.
    Full,
    /// The other end is gone.
    Closed,
}

impl Queue {
    /// Queues one frame, or refuses it (the caller counts the drop).
    pub fn offer(&self, frame: Bytes) -> Result<(), Refused> {
        if self.tx.is_closed() {
            return Err(Refused::Closed);
        }
        let n = frame.len();
        if !self.own.try_take(n) {
            return Err(Refused::Full);
        }
        if !self.total.try_take(n) {
            self.own.give_back(n);
            return Err(Refused::Full);
        }
        if self.tx.send(frame).is_err() {
            self.own.give_back(n);
            self.total.give_back(n);
            return Err(Refused::Closed);
        }
        Ok(())
    }

    /// Resolves when the receiving side is gone.
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl Body for QueueBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match this.rx.poll_recv(cx) {
            Poll::Ready(Some(frame)) => {
                this.own.give_back(frame.len());
                this.total.give_back(frame.len());
                Poll::Ready(Some(Ok(Frame::data(frame))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for QueueBody {
    fn drop(&mut self) {
        self.rx.close();
        while let Ok(frame) = self.rx.try_recv() {
            self.own.give_back(frame.len());
            self.total.give_back(frame.len());
        }
    }
}

/// Asks the kernel for socket buffers of `bytes` each way (capped by
/// `net.core.rmem_max`/`wmem_max`): datagrams arrive and leave in bursts
/// (a tunnel stream delivers several at once), and a UDP socket whose
/// buffer is full drops. Best effort: a refusal keeps the defaults.
pub fn set_socket_buffers(socket: &tokio::net::UdpSocket, bytes: usize) {
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            // SAFETY: setsockopt on a socket this process owns, with a c_int value of the right size.
            let _ = unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    option,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn frames_round_trip_whatever_the_chunking() {
        let sizes = [0usize, 1, 1400, 8192, MAX_DATAGRAM];
        let mut wire = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            wire.extend_from_slice(&encode(&vec![i as u8; *n]).unwrap());
        }
        assert!(encode(&vec![0; MAX_DATAGRAM + 1]).is_none(), "larger than the path allows");
        for chunk in [1usize, 3, 1000, wire.len()] {
            let mut d = Decoder::default();
            let mut got = Vec::new();
            for piece in wire.chunks(chunk) {
                d.push(piece);
                while let Some(dg) = d.next_datagram().unwrap() {
                    got.push(dg);
                }
            }
            assert_eq!(got.iter().map(Bytes::len).collect::<Vec<_>>(), sizes, "chunks of {chunk}");
            assert!(got.iter().enumerate().all(|(i, d)| d.iter().all(|b| *b == i as u8)));
        }
        let mut d = Decoder::default();
        d.push(&[0xff, 0xff, 1, 2]);
        assert!(d.next_datagram().is_err(), "a length over the limit ends the stream");
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_gives_back_what_it_held() {
        let total = Tally::new(250);
        let (a, mut body_a) = queue(200, total.clone());
        let (b, body_b) = queue(200, total.clone());
        let frame = Bytes::from(vec![0u8; 100]);
        assert_eq!(a.offer(frame.clone()), Ok(()));
        assert_eq!(a.offer(frame.clone()), Ok(()));
        assert_eq!(a.offer(frame.clone()), Err(Refused::Full), "the flow's own limit");
        assert_eq!(b.offer(frame.clone()), Err(Refused::Full), "every flow's together");
        assert_eq!(total.held(), 200);
        assert_eq!(body_a.frame().await.unwrap().unwrap().into_data().unwrap().len(), 100);
        assert_eq!(total.held(), 100, "read frames are given back");
        assert_eq!(b.offer(frame.clone()), Ok(()));
        drop(body_b);
        assert_eq!(total.held(), 100, "a dropped body gives back what it still held");
        assert_eq!(b.offer(frame), Err(Refused::Closed));
        drop(a);
        assert_eq!(body_a.frame().await.unwrap().unwrap().into_data().unwrap().len(), 100);
        assert!(body_a.frame().await.is_none(), "ends when the senders are gone");
        assert_eq!(total.held(), 0);
    }
}
