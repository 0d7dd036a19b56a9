//! DNS-01 records for the edge's own wildcard certificate: `_acme-challenge`
//! TXT records set and removed by an RFC 2136 dynamic update signed with
//! TSIG (RFC 8945, HMAC-SHA256/512, over TCP), or by an exec hook that runs
//! any provider's tool as `HOOK set|unset FQDN VALUE`.
//!
//! The update adds one TXT record (it never replaces the RRset: the CA
//! checks `DOMAIN` and `*.DOMAIN` with two values at the same name) and
//! deletes exactly that record afterwards. The server's signed answer is
//! verified with the same key.

use std::net::SocketAddr;
use std::path::PathBuf;

use ring::hmac;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::dns::{CLASS_IN, skip_name};
use crate::constants::{ACME_DNS01_HOOK_TIMEOUT, DNS01_UPDATE_TIMEOUT};

const TYPE_SOA: u16 = 6;
const TYPE_TXT: u16 = 16;
const TYPE_TSIG: u16 = 250;
const CLASS_NONE: u16 = 254;
const CLASS_ANY: u16 = 255;
/// TTL of the TXT records (short: they live for one validation).
const TXT_TTL: u32 = 60;
/// TSIG fudge: the allowed clock difference, seconds (RFC 8945 recommends 300).
const FUDGE: u16 = 300;

#[derive(Debug, thiserror::Error)]
pub enum Dns01Error {
    #[error("{0}")]
    Config(String),
    #[error("failed to reach the DNS server {server} for the update: {source}")]
    Connect {
        server: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the DNS server {server} did not answer the update within {}s", DNS01_UPDATE_TIMEOUT.as_secs())]
    Timeout { server: SocketAddr },
    #[error("the DNS server {server} sent an unreadable answer to the update: {detail}")]
    Malformed { server: SocketAddr, detail: &'static str },
    #[error("the DNS server {server} refused the update of {fqdn} ({rcode}): {hint}")]
    Refused { server: SocketAddr, fqdn: String, rcode: String, hint: String },
    #[error("the answer of {server} is not signed with the TSIG key {key}: {detail}")]
    BadAnswerSignature { server: SocketAddr, key: String, detail: &'static str },
    #[error("failed to run the DNS-01 hook {program}: {source}")]
    HookSpawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the DNS-01 hook `{program} {action} {fqdn} ...` failed ({status}): {stderr}")]
    HookFailed { program: PathBuf, action: &'static str, fqdn: String, status: String, stderr: String },
    #[error("the DNS-01 hook `{program} {action} {fqdn} ...` did not finish within {}s", ACME_DNS01_HOOK_TIMEOUT.as_secs())]
    HookTimeout { program: PathBuf, action: &'static str, fqdn: String },
}

impl Dns01Error {
    pub fn category(&self) -> &'static str {
        match self {
            Dns01Error::Config(_) => "dns01_config",
            Dns01Error::Connect { .. } | Dns01Error::Timeout { .. } => "dns01_unreachable",
            Dns01Error::Malformed { .. } | Dns01Error::BadAnswerSignature { .. } => "dns01_bad_answer",
            Dns01Error::Refused { .. } => "dns01_refused",
            Dns01Error::HookSpawn { .. } | Dns01Error::HookFailed { .. } | Dns01Error::HookTimeout { .. } => {
                "dns01_hook"
            }
        }
    }
}

/// A TSIG key: its name, algorithm and secret.
#[derive(Clone)]
pub struct TsigKey {
    pub name: String,
    pub algorithm: TsigAlgorithm,
    secret: Vec<u8>,
}

impl std::fmt::Debug for TsigKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        f.debug_struct("TsigKey").field("name", &self.name).field("algorithm", &self.algorithm).finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TsigAlgorithm {
    #[value(name = "hmac-sha256")]
    HmacSha256,
    #[value(name = "hmac-sha512")]
    HmacSha512,
}

impl TsigAlgorithm {
    fn wire_name(self) -> &'static str {
        match self {
            TsigAlgorithm::HmacSha256 => "hmac-sha256",
            TsigAlgorithm::HmacSha512 => "hmac-sha512",
        }
    }

    fn ring(self) -> hmac::Algorithm {
        match self {
            TsigAlgorithm::HmacSha256 => hmac::HMAC_SHA256,
            TsigAlgorithm::HmacSha512 => hmac::HMAC_SHA512,
        }
    }
}

impl TsigKey {
    /// A key from its name and base64 secret (as `tsig-keygen` prints it).
    pub fn new(name: &str, algorithm: TsigAlgorithm, secret_base64: &str) -> Result<TsigKey, Dns01Error> {
        use base64::Engine;
        let secret = base64::engine::general_purpose::STANDARD.decode(secret_base64.trim()).map_err(|e| {
            Dns01Error::Config(format!(
                "--acme-dns01-tsig-secret is not base64 ({e}): give the `secret` of the key as tsig-keygen prints it"
            ))
        })?;
        if secret.is_empty() {
            return Err(Dns01Error::Config("--acme-dns01-tsig-secret is empty".into()));
        }
        let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
        if wire_name(&name).is_none() {
            return Err(Dns01Error::Config(format!(
                "--acme-dns01-tsig-key {name:?} is not a valid key name"
            )));
        }
        Ok(TsigKey { name, algorithm, secret })
    }

    fn sign(&self, data: &[u8]) -> Vec<u8> {
        hmac::sign(&hmac::Key::new(self.algorithm.ring(), &self.secret), data).as_ref().to_vec()
    }

    fn verify(&self, data: &[u8], mac: &[u8]) -> bool {
        hmac::verify(&hmac::Key::new(self.algorithm.ring(), &self.secret), data, mac).is_ok()
    }
}

/// Where the TXT records are set.
#[derive(Debug, Clone)]
pub enum Dns01Provider {
    /// RFC 2136 UPDATE to the zone's primary server.
    Rfc2136 { server: SocketAddr, zone: String, key: Option<TsigKey> },
    /// `HOOK set|unset FQDN VALUE`.
    Hook { program: PathBuf },
}

impl Dns01Provider {
    /// Adds the TXT record `fqdn` = `value` (next to any others there).
    pub async fn set(&self, fqdn: &str, value: &str) -> Result<(), Dns01Error> {
        self.change(true, fqdn, value).await
    }

    /// Removes exactly the TXT record `fqdn` = `value`.
    pub async fn unset(&self, fqdn: &str, value: &str) -> Result<(), Dns01Error> {
        self.change(false, fqdn, value).await
    }

    async fn change(&self, add: bool, fqdn: &str, value: &str) -> Result<(), Dns01Error> {
        match self {
            Dns01Provider::Rfc2136 { server, zone, key } => {
                update(*server, zone, key.as_ref(), add, fqdn, value).await
            }
            Dns01Provider::Hook { program } => {
                hook(program, if add { "set" } else { "unset" }, fqdn, value).await
            }
        }
    }
}

async fn hook(program: &PathBuf, action: &'static str, fqdn: &str, value: &str) -> Result<(), Dns01Error> {
    let child = tokio::process::Command::new(program)
        .args([action, fqdn, value])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| Dns01Error::HookSpawn { program: program.clone(), source })?;
    let out = tokio::time::timeout(ACME_DNS01_HOOK_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| Dns01Error::HookTimeout { program: program.clone(), action, fqdn: fqdn.into() })?
        .map_err(|source| Dns01Error::HookSpawn { program: program.clone(), source })?;
    if out.status.success() {
        return Ok(());
    }
    let text =
        String::from_utf8_lossy(if out.stderr.is_empty() { &out.stdout } else { &out.stderr }).into_owned();
    let text = text.trim();
    // The end of the output says most; keep the error one line long.
    let tail: String = text.chars().rev().take(400).collect::<Vec<_>>().into_iter().rev().collect();
    Err(Dns01Error::HookFailed {
        program: program.clone(),
        action,
        fqdn: fqdn.into(),
        status: out.status.to_string(),
        stderr: if tail.is_empty() { "no output".into() } else { tail.replace('\n', " / ") },
    })
}

/// One RFC 2136 UPDATE over TCP: add (or delete) one TXT record.
async fn update(
    server: SocketAddr,
    zone: &str,
    key: Option<&TsigKey>,
    add: bool,
    fqdn: &str,
    value: &str,
) -> Result<(), Dns01Error> {
    let id = u16::from_be_bytes(crate::random_bytes().map_err(|e| Dns01Error::Config(e.to_string()))?);
    let now = super::super::store::unix_now();
    let (message, request_mac) = encode_update(id, zone, fqdn, value, add, key, now)?;
    let exchange = async {
        let connect = |source| Dns01Error::Connect { server, source };
        let mut tcp = TcpStream::connect(server).await.map_err(connect)?;
        let mut framed = (message.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&message);
        tcp.write_all(&framed).await.map_err(connect)?;
        let mut len = [0u8; 2];
        tcp.read_exact(&mut len).await.map_err(connect)?;
        let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
        tcp.read_exact(&mut answer).await.map_err(connect)?;
        Ok::<_, Dns01Error>(answer)
    };
    let answer = tokio::time::timeout(DNS01_UPDATE_TIMEOUT, exchange)
        .await
        .map_err(|_| Dns01Error::Timeout { server })??;
    check_answer(server, &answer, id, zone, fqdn, key, request_mac.as_deref())
}

/// A name in uncompressed, lower-case wire format (the canonical form TSIG signs).
fn wire_name(name: &str) -> Option<Vec<u8>> {
    let name = name.trim_end_matches('.');
    let mut out = Vec::with_capacity(name.len() + 2);
    if !name.is_empty() {
        for label in name.split('.') {
            if label.is_empty() || label.len() > 63 {
                return None;
            }
            out.push(label.len() as u8);
            out.extend(label.bytes().map(|b| b.to_ascii_lowercase()));
        }
    }
    out.push(0);
    (out.len() <= 255).then_some(out)
}

/// The UPDATE message (signed when `key` is given) and the request MAC.
fn encode_update(
    id: u16,
    zone: &str,
    fqdn: &str,
    value: &str,
    add: bool,
    key: Option<&TsigKey>,
    now: u64,
) -> Result<(Vec<u8>, Option<Vec<u8>>), Dns01Error> {
    let bad = |what: &str| Dns01Error::Config(format!("cannot put {what:?} in a DNS update"));
    let zone_wire = wire_name(zone).ok_or_else(|| bad(zone))?;
    let name_wire = wire_name(fqdn).ok_or_else(|| bad(fqdn))?;
    if value.len() > 255 {
        return Err(bad(value));
    }
    let mut m = Vec::with_capacity(128);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x28, 0x00]); // opcode UPDATE
    m.extend_from_slice(&[0, 1, 0, 0, 0, 1, 0, 0]); // one zone, no prerequisite, one update, no additional
    m.extend_from_slice(&zone_wire);
    m.extend_from_slice(&TYPE_SOA.to_be_bytes());
    m.extend_from_slice(&CLASS_IN.to_be_bytes());
    // Add: class IN with a TTL; delete one RR: class NONE, TTL 0 (RFC 2136 2.5.1, 2.5.4).
    m.extend_from_slice(&name_wire);
    m.extend_from_slice(&TYPE_TXT.to_be_bytes());
    m.extend_from_slice(&(if add { CLASS_IN } else { CLASS_NONE }).to_be_bytes());
    m.extend_from_slice(&(if add { TXT_TTL } else { 0 }).to_be_bytes());
    m.extend_from_slice(&(value.len() as u16 + 1).to_be_bytes());
    m.push(value.len() as u8);
    m.extend_from_slice(value.as_bytes());
    let Some(key) = key else { return Ok((m, None)) };

    let key_wire = wire_name(&key.name).ok_or_else(|| bad(&key.name))?;
    let alg_wire = wire_name(key.algorithm.wire_name()).expect("valid name");
    let time = now.to_be_bytes();
    let time48 = &time[2..8];
    // MAC over the message and the TSIG variables (RFC 8945 4.3.3).
    let mut signed = m.clone();
    push_tsig_variables(&mut signed, &key_wire, &alg_wire, time48, 0);
    let mac = key.sign(&signed);
    // The TSIG record.
    m.extend_from_slice(&key_wire);
    m.extend_from_slice(&TYPE_TSIG.to_be_bytes());
    m.extend_from_slice(&CLASS_ANY.to_be_bytes());
    m.extend_from_slice(&0u32.to_be_bytes());
    let rdlen = alg_wire.len() + 6 + 2 + 2 + mac.len() + 2 + 2 + 2;
    m.extend_from_slice(&(rdlen as u16).to_be_bytes());
    m.extend_from_slice(&alg_wire);
    m.extend_from_slice(time48);
    m.extend_from_slice(&FUDGE.to_be_bytes());
    m.extend_from_slice(&(mac.len() as u16).to_be_bytes());
    m.extend_from_slice(&mac);
    m.extend_from_slice(&id.to_be_bytes()); // original id
    m.extend_from_slice(&[0, 0, 0, 0]); // error 0, other len 0
    m[11] = 1; // ARCOUNT
    Ok((m, Some(mac)))
}

fn push_tsig_variables(out: &mut Vec<u8>, key_wire: &[u8], alg_wire: &[u8], time48: &[u8], error: u16) {
    out.extend_from_slice(key_wire);
    out.extend_from_slice(&CLASS_ANY.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(alg_wire);
    out.extend_from_slice(time48);
    out.extend_from_slice(&FUDGE.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes()); // other len
}

/// The TSIG record of an answer: where it starts, its error and MAC.
struct AnswerTsig {
    start: usize,
    time48: [u8; 6],
    error: u16,
    mac: Vec<u8>,
    original_id: u16,
}

/// Finds the TSIG record (the last additional record), if any.
fn answer_tsig(m: &[u8]) -> Result<Option<AnswerTsig>, &'static str> {
    let count = |i: usize| usize::from(u16::from_be_bytes([m[i], m[i + 1]]));
    let (zones, prereq, updates, additional) = (count(4), count(6), count(8), count(10));
    let mut at = 12;
    for _ in 0..zones {
        at = skip_name(m, at).ok_or("zone section")? + 4;
    }
    let mut last = None;
    for i in 0..prereq + updates + additional {
        let start = at;
        let end = skip_name(m, at).ok_or("record name")?;
        let fixed = m.get(end..end + 10).ok_or("record header")?;
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let len = usize::from(u16::from_be_bytes([fixed[8], fixed[9]]));
        let rdata = m.get(end + 10..end + 10 + len).ok_or("record data")?;
        if i + 1 == prereq + updates + additional && rtype == TYPE_TSIG {
            last = Some((start, rdata));
        }
        at = end + 10 + len;
    }
    let Some((start, rdata)) = last else { return Ok(None) };
    let alg_end = skip_name(rdata, 0).ok_or("TSIG algorithm")?;
    let f = rdata.get(alg_end..alg_end + 10).ok_or("TSIG fields")?;
    let time48: [u8; 6] = f[..6].try_into().expect("6 bytes");
    let mac_len = usize::from(u16::from_be_bytes([f[8], f[9]]));
    let mac = rdata.get(alg_end + 10..alg_end + 10 + mac_len).ok_or("TSIG MAC")?.to_vec();
    let rest = rdata.get(alg_end + 10 + mac_len..alg_end + 10 + mac_len + 4).ok_or("TSIG error")?;
    Ok(Some(AnswerTsig {
        start,
        time48,
        original_id: u16::from_be_bytes([rest[0], rest[1]]),
        error: u16::from_be_bytes([rest[2], rest[3]]),
        mac,
    }))
}

fn rcode_name(rcode: u8) -> String {
    match rcode {
        1 => "FORMERR".into(),
        2 => "SERVFAIL".into(),
        3 => "NXDOMAIN".into(),
        4 => "NOTIMP".into(),
        5 => "REFUSED".into(),
        9 => "NOTAUTH".into(),
        10 => "NOTZONE".into(),
        n => format!("rcode {n}"),
    }
}

fn check_answer(
    server: SocketAddr,
    m: &[u8],
    id: u16,
    zone: &str,
    fqdn: &str,
    key: Option<&TsigKey>,
    request_mac: Option<&[u8]>,
) -> Result<(), Dns01Error> {
    let malformed = |detail| Dns01Error::Malformed { server, detail };
    if m.len() < 12 {
        return Err(malformed("too short"));
    }
    if u16::from_be_bytes([m[0], m[1]]) != id || m[2] & 0x80 == 0 {
        return Err(malformed("not an answer to the update"));
    }
    let rcode = m[3] & 0x0f;
    let tsig = answer_tsig(m).map_err(malformed)?;
    let key_name = key.map(|k| k.name.as_str()).unwrap_or_default();
    if rcode != 0 {
        let tsig_error = tsig.as_ref().map_or(0, |t| t.error);
        let hint = match (rcode, tsig_error) {
            (_, 16) => {
                format!("BADSIG: the TSIG secret of key {key_name} is wrong; check --acme-dns01-tsig-secret")
            }
            (_, 17) => format!(
                "BADKEY: the server has no key {key_name} with this algorithm; check --acme-dns01-tsig-key and --acme-dns01-tsig-algorithm"
            ),
            (_, 18) => {
                "BADTIME: this machine's clock and the DNS server's differ by more than 5 minutes".into()
            }
            (9, _) if key.is_none() => {
                "the server wants a signed update: give --acme-dns01-tsig-key and --acme-dns01-tsig-secret"
                    .into()
            }
            (9 | 10, _) => format!(
                "the server is not the primary for zone {zone}: set --acme-dns01-zone to the zone that holds {fqdn} and --acme-dns01-server to its primary"
            ),
            (5, _) => format!(
                "the key {key_name} may not change {fqdn} TXT: allow it in the zone's update-policy (BIND: grant {key_name} name {fqdn}. TXT;)"
            ),
            _ => "see the DNS server's log".into(),
        };
        return Err(Dns01Error::Refused { server, fqdn: fqdn.into(), rcode: rcode_name(rcode), hint });
    }
    let (Some(key), Some(request_mac)) = (key, request_mac) else { return Ok(()) };
    let bad = |detail| Dns01Error::BadAnswerSignature { server, key: key.name.clone(), detail };
    let tsig = tsig.ok_or_else(|| bad("the answer has no TSIG record"))?;
    // MAC over the request MAC, the answer without its TSIG (ARCOUNT one
    // less, the original id) and the answer's TSIG variables.
    let mut signed = Vec::with_capacity(m.len() + 64);
    signed.extend_from_slice(&(request_mac.len() as u16).to_be_bytes());
    signed.extend_from_slice(request_mac);
    let mut body = m[..tsig.start].to_vec();
    body[..2].copy_from_slice(&tsig.original_id.to_be_bytes());
    let arcount = u16::from_be_bytes([body[10], body[11]]).saturating_sub(1);
    body[10..12].copy_from_slice(&arcount.to_be_bytes());
    signed.extend_from_slice(&body);
    let key_wire = wire_name(&key.name).expect("checked when the key was made");
    let alg_wire = wire_name(key.algorithm.wire_name()).expect("valid name");
    push_tsig_variables(&mut signed, &key_wire, &alg_wire, &tsig.time48, tsig.error);
    if !key.verify(&signed, &tsig.mac) {
        return Err(bad("the MAC does not verify"));
    }
    Ok(())
}

/// `_acme-challenge.NAME`: where the CA looks for NAME's (and `*.NAME`'s) TXT record.
pub fn challenge_name(name: &str) -> String {
    format!("_acme-challenge.{}", name.trim_start_matches("*.").trim_end_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_update_layout_and_answer_check() {
        use base64::Engine;
        let secret = base64::engine::general_purpose::STANDARD.encode([9u8; 32]);
        let key = TsigKey::new("Culvert.", TsigAlgorithm::HmacSha256, &secret).unwrap();
        let (m, mac) = encode_update(
            0x1234,
            "edge.test",
            "_acme-challenge.edge.test",
            "abc",
            true,
            Some(&key),
            1_700_000_000,
        )
        .unwrap();
        let mac = mac.unwrap();
        assert_eq!(&m[..4], &[0x12, 0x34, 0x28, 0x00]);
        assert_eq!(&m[4..12], &[0, 1, 0, 0, 0, 1, 0, 1]);
        assert_eq!(mac.len(), 32);
        assert!(m.windows(mac.len()).any(|w| w == mac));
        // The MAC covers the unsigned message and the TSIG variables.
        let (unsigned, _) =
            encode_update(0x1234, "edge.test", "_acme-challenge.edge.test", "abc", true, None, 0).unwrap();
        let mut signed = unsigned.clone();
        let time = 1_700_000_000u64.to_be_bytes();
        push_tsig_variables(
            &mut signed,
            &wire_name("culvert").unwrap(),
            &wire_name("hmac-sha256").unwrap(),
            &time[2..],
            0,
        );
        assert!(key.verify(&signed, &mac));

        // A refusal names the cause.
        let server: SocketAddr = "127.0.0.1:53".parse().unwrap();
        let mut refused = unsigned.clone();
        refused[2] |= 0x80;
        refused[3] = 5;
        let e = check_answer(
            server,
            &refused,
            0x1234,
            "edge.test",
            "_acme-challenge.edge.test",
            Some(&key),
            Some(&mac),
        )
        .unwrap_err();
        assert!(e.to_string().contains("update-policy"), "{e}");
        assert_eq!(e.category(), "dns01_refused");
        // An unsigned NOERROR answer to a signed update is not trusted.
        let mut ok = unsigned;
        ok[2] |= 0x80;
        let e = check_answer(server, &ok, 0x1234, "edge.test", "x", Some(&key), Some(&mac)).unwrap_err();
        assert_eq!(e.category(), "dns01_bad_answer");
        assert!(check_answer(server, &ok, 0x1234, "edge.test", "x", None, None).is_ok());
        assert!(TsigKey::new("k", TsigAlgorithm::HmacSha256, "not base64!").is_err());
        assert_eq!(challenge_name("*.edge.test"), "_acme-challenge.edge.test");
    }
}
