//! The frames of [`super`]: an 8-byte header (stream id, type, flags,
//! payload length) and the payload.
//!
//! ```text
//! 0        4      5       6        8
//! | stream | type | flags | length | payload (length bytes) |
//! ```
//!
//! Types: 0 `Open`, 1 `Data`, 2 `Credit`, 3 `Reset`, 4 `Ping`, 5 `GoAway`,
//! 6 `Head`. All integers are big-endian. Stream 0 is the connection's own
//! (`Ping`, `GoAway`); every other frame names a stream.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The header's length.
pub const HEADER: usize = 8;
/// The largest payload of one frame.
pub const MAX_PAYLOAD: usize = u16::MAX as usize;

/// `Data` with this flag is the sender's last (half-close).
pub const FIN: u8 = 0x1;
/// `Ping` with this flag answers one.
pub const ACK: u8 = 0x1;

/// What a frame says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A new stream, with what it is for (opaque here, at most
    /// [`MAX_PAYLOAD`] bytes); `fin`: nothing more comes from the opener.
    Open { stream: u32, fin: bool, header: Bytes },
    /// Bytes of a stream; `fin`: the sender sends no more.
    Data { stream: u32, fin: bool, payload: Bytes },
    /// A header block of a stream (an HTTP response head, trailers),
    /// whole in one frame; `fin` as for `Data`.
    Head { stream: u32, fin: bool, block: Bytes },
    /// The receiver has room for this many more bytes of the stream.
    Credit { stream: u32, bytes: u32 },
    /// The stream is abandoned, both ways.
    Reset { stream: u32, code: u32 },
    /// A liveness probe (or its answer, `ack`).
    Ping { ack: bool, opaque: u64 },
    /// No new streams from the sender's peer; `last`: the highest stream
    /// the sender took.
    GoAway { last: u32 },
}

const OPEN: u8 = 0;
const DATA: u8 = 1;
const CREDIT: u8 = 2;
const RESET: u8 = 3;
const PING: u8 = 4;
const GOAWAY: u8 = 5;
const HEAD: u8 = 6;

/// A frame that cannot be: the peer does not speak this protocol, or
/// breaks it. The connection ends.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("frame type {kind} with a {len}-byte payload (expected {expected})")]
    Length { kind: u8, len: usize, expected: usize },
    #[error("frame type {kind} on stream {stream}")]
    Stream { kind: u8, stream: u32 },
    #[error("frame type {kind} with unknown flags {flags:#04x}")]
    Flags { kind: u8, flags: u8 },
}

/// Writes the header of a frame whose payload follows separately (a
/// `Data` frame's payload is written as it lies, not copied here).
pub fn header(buf: &mut impl BufMut, stream: u32, kind: u8, flags: u8, len: usize) {
    debug_assert!(len <= MAX_PAYLOAD);
    buf.put_u32(stream);
    buf.put_u8(kind);
    buf.put_u8(flags);
    buf.put_u16(len as u16);
}

/// The stream, payload length and `FIN` of the `Data` frame `buf` begins
/// with, once its header is whole (checked by [`Frame::decode`] first).
pub fn data_begun(buf: &[u8]) -> Option<(u32, usize, bool)> {
    let mut h = buf.get(..HEADER)?;
    let (stream, kind, flags, len) = (h.get_u32(), h.get_u8(), h.get_u8(), h.get_u16() as usize);
    (kind == DATA).then_some((stream, len, flags & FIN != 0))
}

/// The bytes `buf` lacks of the frame it begins with (0 before its header
/// is whole).
pub fn missing(buf: &[u8]) -> usize {
    match buf.get(6..8) {
        Some(len) => (HEADER + u16::from_be_bytes([len[0], len[1]]) as usize).saturating_sub(buf.len()),
        None => 0,
    }
}

impl Frame {
    /// The frame's header and, for the frames that are not `Open` or
    /// `Data`, its payload; those two carry theirs in [`Frame::payload`].
    pub fn encode_head(&self, buf: &mut BytesMut) {
        match self {
            Frame::Open { stream, fin, header: h } => {
                header(buf, *stream, OPEN, if *fin { FIN } else { 0 }, h.len())
            }
            Frame::Data { stream, fin, payload } => {
                header(buf, *stream, DATA, if *fin { FIN } else { 0 }, payload.len())
            }
            Frame::Head { stream, fin, block } => {
                header(buf, *stream, HEAD, if *fin { FIN } else { 0 }, block.len())
            }
            Frame::Credit { stream, bytes } => {
                header(buf, *stream, CREDIT, 0, 4);
                buf.put_u32(*bytes);
            }
            Frame::Reset { stream, code } => {
                header(buf, *stream, RESET, 0, 4);
                buf.put_u32(*code);
            }
            Frame::Ping { ack, opaque } => {
                header(buf, 0, PING, if *ack { ACK } else { 0 }, 8);
                buf.put_u64(*opaque);
            }
            Frame::GoAway { last } => {
                header(buf, 0, GOAWAY, 0, 4);
                buf.put_u32(*last);
            }
        }
    }

    /// The stream the frame is for; 0 for the connection's own (`Ping`,
    /// `GoAway`).
    pub fn stream(&self) -> u32 {
        match self {
            Frame::Open { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::Head { stream, .. }
            | Frame::Credit { stream, .. }
            | Frame::Reset { stream, .. } => *stream,
            Frame::Ping { .. } | Frame::GoAway { .. } => 0,
        }
    }

    /// The payload [`Frame::encode_head`] leaves out.
    pub fn payload(&self) -> Option<&Bytes> {
        match self {
            Frame::Open { header, .. } => Some(header),
            Frame::Data { payload, .. } => Some(payload),
            Frame::Head { block, .. } => Some(block),
            _ => None,
        }
    }

    /// The whole frame in one buffer.
    pub fn encode(&self, buf: &mut BytesMut) {
        self.encode_head(buf);
        if let Some(p) = self.payload() {
            buf.extend_from_slice(p);
        }
    }

    /// Takes one frame off the front of `buf`; `None` until it is whole.
    /// A payload is split off `buf` without a copy.
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let mut h = &buf[..HEADER];
        let (stream, kind, flags, len) = (h.get_u32(), h.get_u8(), h.get_u8(), h.get_u16() as usize);
        let (fixed, known_flags) = match kind {
            OPEN | DATA | HEAD => (None, FIN),
            CREDIT | RESET | GOAWAY => (Some(4), 0),
            PING => (Some(8), ACK),
            other => return Err(FrameError::UnknownType(other)),
        };
        if flags & !known_flags != 0 {
            return Err(FrameError::Flags { kind, flags });
        }
        if let Some(expected) = fixed.filter(|&e| e != len) {
            return Err(FrameError::Length { kind, len, expected });
        }
        let connection_frame = matches!(kind, PING | GOAWAY);
        if connection_frame != (stream == 0) {
            return Err(FrameError::Stream { kind, stream });
        }
        if buf.len() < HEADER + len {
            return Ok(None);
        }
        buf.advance(HEADER);
        let mut payload = buf.split_to(len);
        Ok(Some(match kind {
            OPEN => Frame::Open { stream, fin: flags & FIN != 0, header: payload.freeze() },
            DATA => Frame::Data { stream, fin: flags & FIN != 0, payload: payload.freeze() },
            HEAD => Frame::Head { stream, fin: flags & FIN != 0, block: payload.freeze() },
            CREDIT => Frame::Credit { stream, bytes: payload.get_u32() },
            RESET => Frame::Reset { stream, code: payload.get_u32() },
            PING => Frame::Ping { ack: flags & ACK != 0, opaque: payload.get_u64() },
            _ => Frame::GoAway { last: payload.get_u32() },
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Frame> {
        vec![
            Frame::Open { stream: 1, fin: false, header: Bytes::from_static(b"tcp") },
            Frame::Open { stream: 3, fin: true, header: Bytes::new() },
            Frame::Data { stream: 1, fin: false, payload: Bytes::from(vec![7; MAX_PAYLOAD]) },
            Frame::Data { stream: 1, fin: true, payload: Bytes::new() },
            Frame::Head { stream: 2, fin: false, block: Bytes::from_static(b"HTTP/1.1 200 \r\n\r\n") },
            Frame::Head { stream: 2, fin: true, block: Bytes::from_static(b"grpc-status: 0\r\n\r\n") },
            Frame::Credit { stream: 2, bytes: u32::MAX },
            Frame::Reset { stream: 5, code: 8 },
            Frame::Ping { ack: true, opaque: 0x0102030405060708 },
            Frame::Ping { ack: false, opaque: 0 },
            Frame::GoAway { last: 41 },
        ]
    }

    /// Every frame comes back as it went, whole or fed a byte at a time.
    #[test]
    fn frames_round_trip() {
        let mut wire = BytesMut::new();
        for f in all() {
            f.encode(&mut wire);
        }
        let whole = wire.clone();
        let mut got = Vec::new();
        while let Some(f) = Frame::decode(&mut wire).unwrap() {
            got.push(f);
        }
        assert_eq!(got, all());
        assert!(wire.is_empty());

        let (mut fed, mut got) = (BytesMut::new(), Vec::new());
        for b in whole {
            fed.extend_from_slice(&[b]);
            while let Some(f) = Frame::decode(&mut fed).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, all());
    }

    #[test]
    fn frames_that_cannot_be_are_refused() {
        let decode = |bytes: &[u8]| Frame::decode(&mut BytesMut::from(bytes));
        assert_eq!(decode(&[0, 0, 0, 1, 9, 0, 0, 0]), Err(FrameError::UnknownType(9)));
        assert_eq!(
            decode(&[0, 0, 0, 1, CREDIT, 0, 0, 3, 1, 2, 3]),
            Err(FrameError::Length { kind: CREDIT, len: 3, expected: 4 })
        );
        assert_eq!(decode(&[0, 0, 0, 0, DATA, 0, 0, 0]), Err(FrameError::Stream { kind: DATA, stream: 0 }));
        assert_eq!(
            decode(&[0, 0, 0, 2, PING, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(FrameError::Stream { kind: PING, stream: 2 })
        );
        assert_eq!(decode(&[0, 0, 0, 1, OPEN, 2, 0, 0]), Err(FrameError::Flags { kind: OPEN, flags: 2 }));
        assert_eq!(
            decode(&[0, 0, 0, 1, DATA, 0x80, 0, 0]),
            Err(FrameError::Flags { kind: DATA, flags: 0x80 })
        );
        // A header alone is not a frame yet; it is not an error either.
        assert_eq!(decode(&[0, 0, 0, 1, DATA, 0, 0, 5, 1]), Ok(None));
    }
}
