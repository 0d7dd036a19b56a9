//! The TLS 1.3 record layer after the handshake (RFC 8446 §5): rustls did
//! the handshake and keeps the key schedule ([`KernelConnection`]); records
//! are sealed and opened in place here with ring's AEADs, so that a byte is
//! copied once on each side (into the record it goes out in, out of the
//! record it came in). Post-handshake messages: KeyUpdate (both ways) and
//! NewSessionTicket (to rustls' session store); alerts end the connection.

use std::io;

use ring::aead::{AES_128_GCM, AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;
use rustls::kernel::KernelConnection;

/// Most plaintext in one record.
pub const RECORD: usize = 16 * 1024;
/// Largest protected record body TLS 1.3 allows (RFC 8446 §5.2).
pub const MAX_BODY: usize = RECORD + 256;
/// AEAD tag length (all three TLS 1.3 AEADs of ring).
const TAG: usize = 16;
/// Records sealed under one key before it is updated: RFC 8446 §5.5 limits
/// AES-GCM to 2^24.5 records per key; well below it (tests: every 64).
const KEY_UPDATE_AT: u64 = if cfg!(test) { 64 } else { 1 << 23 };

const APPLICATION_DATA: u8 = 23;
const HANDSHAKE: u8 = 22;
const ALERT: u8 = 21;
const KEY_UPDATE: u8 = 24;
const NEW_SESSION_TICKET: u8 = 4;

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// One direction's key, IV and sequence number.
pub struct Keys {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Keys {
    pub fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> io::Result<Keys> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err(io::Error::other("TLS: an AEAD this record layer does not have")),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| io::Error::other("TLS: bad traffic key"))?;
        let iv: [u8; 12] = iv.as_ref().try_into().map_err(|_| io::Error::other("TLS: bad IV"))?;
        Ok(Keys { key: LessSafeKey::new(key), iv, seq })
    }

    /// The per-record nonce: the IV XOR the sequence number, and the next one.
    fn next_nonce(&mut self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(n)
    }
}

/// Bytes on the wire of a record of `n` plaintext bytes.
pub const fn sealed_len(n: usize) -> usize {
    5 + n + 1 + TAG
}

/// Seals one record of `n` plaintext bytes of type `typ` into `out` (at
/// least [`sealed_len`]`(n)` long); `fill` writes the plaintext.
pub fn seal(
    keys: &mut Keys,
    typ: u8,
    n: usize,
    out: &mut [u8],
    fill: impl FnOnce(&mut [u8]),
) -> io::Result<usize> {
    debug_assert!(n <= RECORD);
    let body = n + 1 + TAG;
    let header = [APPLICATION_DATA, 3, 3, (body >> 8) as u8, body as u8];
    out[..5].copy_from_slice(&header);
    fill(&mut out[5..5 + n]);
    out[5 + n] = typ;
    let nonce = keys.next_nonce();
    let tag = keys
        .key
        .seal_in_place_separate_tag(nonce, Aad::from(header), &mut out[5..5 + n + 1])
        .map_err(|_| io::Error::other("TLS: sealing failed"))?;
    out[5 + n + 1..5 + body].copy_from_slice(tag.as_ref());
    Ok(5 + body)
}

/// What one received record was.
pub enum Opened {
    /// Application data at this range of the buffer given to [`open`].
    Data(std::ops::Range<usize>),
    /// Handshake or alert content (handled), nothing for the reader.
    Nothing,
    /// close_notify.
    Closed,
}

/// The state after the handshake.
pub struct Own<D> {
    pub kernel: KernelConnection<D>,
    pub tx: Keys,
    pub rx: Keys,
    /// A post-handshake message whose end is in a later record.
    hs: Vec<u8>,
    /// Our KeyUpdate answer to the peer's request is due.
    pub update_due: bool,
}

/// Hands a NewSessionTicket to rustls (clients) or refuses it (servers).
pub trait Tickets<D> {
    fn ticket(kernel: &mut KernelConnection<D>, payload: &[u8]) -> Result<(), rustls::Error>;
}

impl<D> Own<D> {
    pub fn new(secrets: rustls::ExtractedSecrets, kernel: KernelConnection<D>) -> io::Result<Own<D>> {
        let (tx_seq, tx) = secrets.tx;
        let (rx_seq, rx) = secrets.rx;
        Ok(Own {
            kernel,
            tx: Keys::new(tx_seq, tx)?,
            rx: Keys::new(rx_seq, rx)?,
            hs: Vec::new(),
            update_due: false,
        })
    }

    /// The key update due before the next record is sealed: one asked by the
    /// peer, or ours when the key has sealed enough.
    pub fn wants_key_update(&self) -> bool {
        self.update_due || self.tx.seq >= KEY_UPDATE_AT
    }

    /// Seals a KeyUpdate (update_not_requested) into `out` with the current
    /// key, then moves to the next one.
    pub fn seal_key_update(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let n = seal(&mut self.tx, HANDSHAKE, 5, out, |b| b.copy_from_slice(&[KEY_UPDATE, 0, 0, 1, 0]))?;
        let (seq, secrets) = self.kernel.update_tx_secret().map_err(crate::tunnel::tls::tls_error)?;
        self.tx = Keys::new(seq, secrets)?;
        self.update_due = false;
        Ok(n)
    }

    /// A close_notify alert record into `out`.
    pub fn seal_close_notify(&mut self, out: &mut [u8]) -> io::Result<usize> {
        seal(&mut self.tx, ALERT, 2, out, |b| b.copy_from_slice(&[1, 0]))
    }

    /// Opens the record `rec` (header included) in place.
    pub fn open<T: Tickets<D>>(&mut self, rec: &mut [u8]) -> io::Result<Opened> {
        let header: [u8; 5] = rec[..5].try_into().expect("a record header");
        if header[0] != APPLICATION_DATA {
            return Err(bad(format!("TLS: unexpected record type {} after the handshake", header[0])));
        }
        let body = &mut rec[5..];
        if body.len() > MAX_BODY || body.len() < TAG + 1 {
            return Err(bad(format!("TLS: a record of {} bytes", body.len())));
        }
        let nonce = self.rx.next_nonce();
        let plain =
            self.rx.key.open_in_place(nonce, Aad::from(header), body).map_err(|_| {
                bad("received corrupt message of type ApplicationData (decrypt error)".into())
            })?;
        // The content type is the last non-zero byte; zeros after it are padding.
        let Some(end) = plain.iter().rposition(|&b| b != 0) else {
            return Err(bad("TLS: a record without a content type".into()));
        };
        let (typ, len) = (plain[end], end);
        match typ {
            APPLICATION_DATA if self.hs.is_empty() => Ok(Opened::Data(5..5 + len)),
            HANDSHAKE => {
                self.hs.extend_from_slice(&plain[..len]);
                self.handshake::<T>()?;
                Ok(Opened::Nothing)
            }
            ALERT if len == 2 && plain[1] == 0 => Ok(Opened::Closed),
            // user_canceled is a warning (RFC 8446 §6.1); close_notify follows.
            ALERT if len == 2 && plain[1] == 90 => Ok(Opened::Nothing),
            ALERT if len == 2 => {
                Err(bad(format!("received fatal alert: {:?}", rustls::AlertDescription::from(plain[1]))))
            }
            _ => Err(bad(format!("TLS: unexpected content type {typ} after the handshake"))),
        }
    }

    /// The complete post-handshake messages in `hs`.
    fn handshake<T: Tickets<D>>(&mut self) -> io::Result<()> {
        let mut at = 0;
        while self.hs.len() - at >= 4 {
            let m = &self.hs[at..];
            let len = u32::from_be_bytes([0, m[1], m[2], m[3]]) as usize;
            if len > 64 * 1024 {
                return Err(bad(format!("TLS: a post-handshake message of {len} bytes")));
            }
            if m.len() < 4 + len {
                break;
            }
            let body = &m[4..4 + len];
            match m[0] {
                NEW_SESSION_TICKET => {
                    T::ticket(&mut self.kernel, body).map_err(crate::tunnel::tls::tls_error)?
                }
                KEY_UPDATE if len == 1 && body[0] <= 1 => {
                    // A key change must end its record (RFC 8446 §5.1).
                    if at + 4 + len != self.hs.len() {
                        return Err(bad("TLS: data after a KeyUpdate in its record".into()));
                    }
                    let requested = body[0] == 1;
                    let (seq, secrets) =
                        self.kernel.update_rx_secret().map_err(crate::tunnel::tls::tls_error)?;
                    self.rx = Keys::new(seq, secrets)?;
                    self.update_due |= requested;
                }
                t => return Err(bad(format!("TLS: unexpected handshake message {t} after the handshake"))),
            }
            at += 4 + len;
        }
        self.hs.drain(..at);
        Ok(())
    }
}
