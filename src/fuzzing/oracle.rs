//! Reference codecs written from the specifications, independent of the
//! code they check: a PROXY protocol decoder (HAProxy's proxy-protocol.txt,
//! versions 1 and 2) and a WebSocket frame encoder (RFC 6455 section 5).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The 12 bytes a v2 header starts with (spec section 2.2).
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// Longest v1 line, CRLF included (spec section 2.1).
const V1_MAX: usize = 107;

/// A decoded PROXY header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// 1 or 2.
    pub version: u8,
    /// Bytes the header took (the stream's payload starts after them).
    pub len: usize,
    /// Source and destination; `None` for `UNKNOWN` (v1) and `LOCAL` or an
    /// unspecified family (v2).
    pub addrs: Option<(SocketAddr, SocketAddr)>,
}

/// Decodes the PROXY header at the start of `buf`.
pub fn decode_proxy_header(buf: &[u8]) -> Result<Decoded, String> {
    if buf.starts_with(V2_SIGNATURE) {
        return decode_v2(buf);
    }
    if buf.starts_with(b"PROXY ") {
        return decode_v1(buf);
    }
    Err("no PROXY header".into())
}

fn decode_v1(buf: &[u8]) -> Result<Decoded, String> {
    let window = &buf[..buf.len().min(V1_MAX)];
    let end = window.windows(2).position(|w| w == b"\r\n").ok_or("no CRLF within 107 bytes")?;
    let line = std::str::from_utf8(&window[..end]).map_err(|_| "not ASCII")?;
    let fields: Vec<&str> = line.split(' ').collect();
    let addrs = match fields.as_slice() {
        ["PROXY", "UNKNOWN", ..] => None,
        ["PROXY", family @ ("TCP4" | "TCP6"), src, dst, sport, dport] => {
            let ip = |s: &str| -> Result<IpAddr, String> {
                let ip: IpAddr = if *family == "TCP4" {
                    s.parse::<Ipv4Addr>().map_err(|e| format!("{s}: {e}"))?.into()
                } else {
                    s.parse::<Ipv6Addr>().map_err(|e| format!("{s}: {e}"))?.into()
                };
                Ok(ip)
            };
            // Ports are 0-65535 written without leading zeros.
            let port = |s: &str| -> Result<u16, String> {
                if s.is_empty()
                    || (s.len() > 1 && s.starts_with('0'))
                    || !s.bytes().all(|b| b.is_ascii_digit())
                {
                    return Err(format!("port `{s}`"));
                }
                s.parse().map_err(|e| format!("port `{s}`: {e}"))
            };
            Some((SocketAddr::new(ip(src)?, port(sport)?), SocketAddr::new(ip(dst)?, port(dport)?)))
        }
        _ => return Err(format!("bad v1 line {line:?}")),
    };
    Ok(Decoded { version: 1, len: end + 2, addrs })
}

fn decode_v2(buf: &[u8]) -> Result<Decoded, String> {
    let head = buf.get(..16).ok_or("short v2 header")?;
    if head[12] >> 4 != 2 {
        return Err(format!("version {} in a v2 header", head[12] >> 4));
    }
    let len = u16::from_be_bytes([head[14], head[15]]) as usize;
    let body = buf.get(16..16 + len).ok_or("v2 addresses cut short")?;
    let addrs = match (head[12] & 0x0f, head[13]) {
        (0, _) => None, // LOCAL: the addresses, if any, are ignored
        (1, 0x00) => None,
        (1, 0x11) => {
            let b = body.get(..12).ok_or("short IPv4 block")?;
            let ip = |o: usize| IpAddr::from([b[o], b[o + 1], b[o + 2], b[o + 3]]);
            let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
            Some((SocketAddr::new(ip(0), port(8)), SocketAddr::new(ip(4), port(10))))
        }
        (1, 0x21) => {
            let b = body.get(..36).ok_or("short IPv6 block")?;
            let ip = |o: usize| IpAddr::from(<[u8; 16]>::try_from(&b[o..o + 16]).expect("16 bytes"));
            let port = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
            Some((SocketAddr::new(ip(0), port(32)), SocketAddr::new(ip(16), port(34))))
        }
        (1, fam) => return Err(format!("family/protocol {fam:#04x} not handled")),
        (cmd, _) => return Err(format!("command {cmd}")),
    };
    Ok(Decoded { version: 2, len: 16 + len, addrs })
}

/// An IPv4 address as IPv6 (v4-mapped); IPv6 as it is.
pub fn v4_mapped(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(v4) => SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port()),
        a => a,
    }
}

/// Appends one WebSocket frame: FIN bit, opcode, payload, masked with
/// `mask` when given, with the shortest length form unless `long_len`
/// asks for the 8-byte one.
#[cfg(test)]
pub fn ws_frame(
    out: &mut Vec<u8>,
    fin: bool,
    opcode: u8,
    payload: &[u8],
    mask: Option<[u8; 4]>,
    long_len: bool,
) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    let m = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 && !long_len => out.push(m | n as u8),
        n if n <= 0xFFFF && !long_len => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(k) => {
            out.extend_from_slice(&k);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
        }
        None => out.extend_from_slice(payload),
    }
}
