//! "Does this name point at the edge?": A/AAAA lookups with the system
//! resolver, or with a given DNS server (`--acme-dns-server`) over UDP.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::UdpSocket;

use crate::constants::DNS_QUERY_TIMEOUT;

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
pub(super) const CLASS_IN: u16 = 1;
const RCODE_NXDOMAIN: u8 = 3;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("failed to look up {name}: {source}")]
    Lookup {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the DNS server {server} did not answer for {name} within {}s", DNS_QUERY_TIMEOUT.as_secs())]
    Timeout { server: SocketAddr, name: String },
    #[error("the DNS server {server} answered {name} with an unreadable message")]
    Malformed { server: SocketAddr, name: String },
    #[error("the DNS server {server} answered {name} with error code {rcode}")]
    Rcode { server: SocketAddr, name: String, rcode: u8 },
}

/// Where names are looked up.
#[derive(Debug, Clone, Copy)]
pub enum Resolver {
    /// The system's resolver (getaddrinfo: /etc/hosts, /etc/resolv.conf).
    System,
    /// One DNS server, asked directly over UDP.
    Server(SocketAddr),
}

impl Resolver {
    /// The A and AAAA addresses of `name` (CNAMEs followed). With a DNS
    /// server, a name that does not exist has no addresses; the system
    /// resolver reports it as an error.
    pub async fn lookup(&self, name: &str) -> Result<BTreeSet<IpAddr>, DnsError> {
        if let Ok(ip) = name.parse::<IpAddr>() {
            return Ok(BTreeSet::from([ip]));
        }
        match *self {
            Resolver::System => match tokio::net::lookup_host((name, 0)).await {
                Ok(addrs) => Ok(addrs.map(|a| a.ip()).collect()),
                Err(source) => Err(DnsError::Lookup { name: name.into(), source }),
            },
            Resolver::Server(server) => {
                let mut all = query(server, name, TYPE_A).await?;
                all.extend(query(server, name, TYPE_AAAA).await?);
                Ok(all)
            }
        }
    }
}

async fn query(server: SocketAddr, name: &str, qtype: u16) -> Result<BTreeSet<IpAddr>, DnsError> {
    let lookup = |source| DnsError::Lookup { name: name.into(), source };
    let bind: SocketAddr =
        if server.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = UdpSocket::bind(bind).await.map_err(lookup)?;
    socket.connect(server).await.map_err(lookup)?;
    let id = u16::from_be_bytes(crate::random_bytes().map_err(|e| lookup(std::io::Error::other(e)))?);
    let message =
        encode_query(id, name, qtype).ok_or_else(|| DnsError::Malformed { server, name: name.into() })?;
    socket.send(&message).await.map_err(lookup)?;
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + DNS_QUERY_TIMEOUT;
    loop {
        let n = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .map_err(|_| DnsError::Timeout { server, name: name.into() })?
            .map_err(lookup)?;
        // Answers to other ids (late, spoofed) are ignored.
        match decode_answer(&buf[..n], id) {
            Answer::OtherId => continue,
            Answer::Malformed => return Err(DnsError::Malformed { server, name: name.into() }),
            Answer::Rcode(RCODE_NXDOMAIN) => return Ok(BTreeSet::new()),
            Answer::Rcode(rcode) => return Err(DnsError::Rcode { server, name: name.into(), rcode }),
            Answer::Addresses(ips) => return Ok(ips),
        }
    }
}

/// A standard query with recursion desired.
pub fn encode_query(id: u16, name: &str, qtype: u16) -> Option<Vec<u8>> {
    let mut m = Vec::with_capacity(32 + name.len());
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return None;
        }
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&CLASS_IN.to_be_bytes());
    Some(m)
}

#[derive(Debug, PartialEq)]
enum Answer {
    OtherId,
    Malformed,
    Rcode(u8),
    Addresses(BTreeSet<IpAddr>),
}

/// Every A/AAAA record of the answer section (a CNAME chain's records come
/// with the answer from a recursive resolver).
fn decode_answer(m: &[u8], id: u16) -> Answer {
    if m.len() < 12 {
        return Answer::Malformed;
    }
    if u16::from_be_bytes([m[0], m[1]]) != id || m[2] & 0x80 == 0 {
        return Answer::OtherId;
    }
    let rcode = m[3] & 0x0f;
    if rcode != 0 {
        return Answer::Rcode(rcode);
    }
    let count = |i: usize| usize::from(u16::from_be_bytes([m[i], m[i + 1]]));
    let (questions, answers) = (count(4), count(6));
    let mut at = 12;
    for _ in 0..questions {
        let Some(end) = skip_name(m, at) else { return Answer::Malformed };
        at = end + 4;
    }
    let mut ips = BTreeSet::new();
    for _ in 0..answers {
        let Some(end) = skip_name(m, at) else { return Answer::Malformed };
        let Some(fixed) = m.get(end..end + 10) else { return Answer::Malformed };
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let len = usize::from(u16::from_be_bytes([fixed[8], fixed[9]]));
        let Some(data) = m.get(end + 10..end + 10 + len) else { return Answer::Malformed };
        match (rtype, len) {
            (TYPE_A, 4) => {
                ips.insert(IpAddr::from(<[u8; 4]>::try_from(data).expect("4 bytes")));
            }
            (TYPE_AAAA, 16) => {
                ips.insert(IpAddr::from(<[u8; 16]>::try_from(data).expect("16 bytes")));
            }
            _ => {}
        }
        at = end + 10 + len;
    }
    Answer::Addresses(ips)
}

/// The offset after a (possibly compressed) name.
pub(super) fn skip_name(m: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *m.get(at)?;
        match len {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => return m.get(at + 1).map(|_| at + 2),
            l if l < 64 => at += 1 + usize::from(l),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(id: u16, rcode: u8, records: &[(u16, &[u8])]) -> Vec<u8> {
        let q = encode_query(id, "app.example.org", TYPE_A).unwrap();
        let mut m = q.clone();
        m[2] = 0x81;
        m[3] = 0x80 | rcode;
        m[6..8].copy_from_slice(&(records.len() as u16).to_be_bytes());
        for (rtype, data) in records {
            m.extend_from_slice(&[0xc0, 12]);
            m.extend_from_slice(&rtype.to_be_bytes());
            m.extend_from_slice(&CLASS_IN.to_be_bytes());
            m.extend_from_slice(&60u32.to_be_bytes());
            m.extend_from_slice(&(data.len() as u16).to_be_bytes());
            m.extend_from_slice(data);
        }
        m
    }

    #[test]
    fn decodes_answers() {
        let cname = [3, b'e', b'd', b'g', b'e', 0];
        let m = answer(7, 0, &[(5, &cname), (TYPE_A, &[192, 0, 2, 1]), (TYPE_AAAA, &[0; 16])]);
        let want: BTreeSet<IpAddr> = ["192.0.2.1".parse().unwrap(), "::".parse().unwrap()].into();
        assert_eq!(decode_answer(&m, 7), Answer::Addresses(want));
        assert_eq!(decode_answer(&m, 8), Answer::OtherId);
        assert_eq!(decode_answer(&answer(7, 3, &[]), 7), Answer::Rcode(3));
        assert_eq!(decode_answer(&m[..m.len() - 3], 7), Answer::Malformed);
        assert!(encode_query(1, "a..b", TYPE_A).is_none());
    }
}
