//! Property tests of the parsers (proptest, in the normal `cargo test`):
//! generated valid input is read as meant, whatever the split of the byte
//! stream; any input is refused without a panic. Case counts are kept
//! small so the suite stays fast; `PROPTEST_CASES` raises them.

use std::net::{IpAddr, SocketAddr};

use base64::Engine;
use http::{HeaderMap, HeaderValue, header};
use proptest::prelude::*;

use super::oracle::ws_frame;
use super::{Scripted, block_on, ws_read};
use crate::agent::guard::Credentials;
use crate::api::{self, PortRange};
use crate::tunnel::ws::Role;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

// --- ClientHello / SNI -------------------------------------------------------------------------

fn host_name() -> impl Strategy<Value = String> {
    prop::collection::vec("[a-zA-Z0-9]([a-zA-Z0-9-]{0,18}[a-zA-Z0-9])?", 1..5).prop_map(|l| l.join("."))
}

/// A ClientHello record (TLS 1.2 layout, what TLS 1.3 clients send too)
/// with `name` in a `server_name` extension among other extensions.
fn client_hello(
    name: &str,
    session_id: &[u8],
    suites: &[u16],
    before: &[(u16, Vec<u8>)],
    after: &[(u16, Vec<u8>)],
) -> Vec<u8> {
    fn u16be(out: &mut Vec<u8>, n: usize) {
        out.extend_from_slice(&(n as u16).to_be_bytes());
    }
    let mut sni = Vec::new();
    u16be(&mut sni, name.len() + 3);
    sni.push(0); // host_name
    u16be(&mut sni, name.len());
    sni.extend_from_slice(name.as_bytes());
    let mut exts = Vec::new();
    for (ty, data) in before.iter().chain([(0u16, sni)].iter()).chain(after) {
        u16be(&mut exts, *ty as usize);
        u16be(&mut exts, data.len());
        exts.extend_from_slice(data);
    }
    let mut body = vec![0x03, 0x03];
    body.extend([7u8; 32]); // random
    body.push(session_id.len() as u8);
    body.extend_from_slice(session_id);
    u16be(&mut body, suites.len() * 2);
    suites.iter().for_each(|s| body.extend_from_slice(&s.to_be_bytes()));
    body.extend([1, 0]); // one compression method: null
    u16be(&mut body, exts.len());
    body.extend(exts);
    let mut hs = vec![0x01];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend(body);
    let mut record = vec![0x16, 0x03, 0x01];
    u16be(&mut record, hs.len());
    record.extend(hs);
    record
}

fn other_extensions() -> impl Strategy<Value = Vec<(u16, Vec<u8>)>> {
    prop::collection::vec((1u16..=0xFFFF, prop::collection::vec(any::<u8>(), 0..40)), 0..6)
}

fn read_hello_in_pieces(data: &[u8], sizes: &[u8]) -> (bytes::Bytes, Option<String>) {
    let written = std::cell::Cell::new(0);
    let mut io = Scripted::new(data, sizes, &written);
    block_on(crate::edge::sni::read_client_hello(&mut io)).expect("the script never fails")
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn sni_is_found_in_generated_client_hellos(
        name in host_name(),
        session_id in prop::collection::vec(any::<u8>(), 0..=32),
        suites in prop::collection::vec(any::<u16>(), 1..30),
        before in other_extensions(),
        after in other_extensions(),
        sizes in prop::collection::vec(any::<u8>(), 1..8),
        trailing in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let hello = client_hello(&name, &session_id, &suites, &before, &after);
        let lower = name.to_ascii_lowercase();
        prop_assert_eq!(crate::edge::sni::server_name(&hello[5..]), Some(lower.clone()));
        // Delivered in any pieces, with the client's next bytes behind it.
        let mut stream = hello.clone();
        stream.extend(&trailing);
        let (read, sni) = read_hello_in_pieces(&stream, &sizes);
        prop_assert_eq!(sni, Some(lower));
        prop_assert!(read.len() >= hello.len() && stream.starts_with(&read));
        // Cut anywhere inside, the message has no name and nothing panics.
        for cut in [5, 6, 10, 43, hello.len() / 2, hello.len() - 1] {
            if cut < hello.len() && cut >= 5 {
                prop_assert_eq!(crate::edge::sni::server_name(&hello[5..cut]), None);
            }
        }
    }

    #[test]
    fn sni_parser_takes_any_bytes(data in prop::collection::vec(any::<u8>(), 0..600)) {
        super::client_hello(&data);
        let mut record = vec![0x16, 0x03, 0x01];
        record.extend_from_slice(&(data.len() as u16).to_be_bytes());
        record.extend(&data);
        super::client_hello(&record);
    }
}

// --- PROXY protocol ----------------------------------------------------------------------------

fn socket_addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<std::net::Ipv4Addr>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::new(IpAddr::V4(ip), p)),
        (any::<std::net::Ipv6Addr>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::new(IpAddr::V6(ip), p)),
    ]
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn proxy_headers_round_trip(client in prop::option::of(socket_addr()), server in prop::option::of(socket_addr())) {
        super::proxy_round_trip(client, server);
    }

    #[test]
    fn proxy_decoder_takes_any_bytes(data in prop::collection::vec(any::<u8>(), 0..120)) {
        super::proxy_header(&data);
    }
}

// --- WebSocket framing -------------------------------------------------------------------------

/// One thing on the wire between binary fragments.
#[derive(Debug, Clone)]
enum Interleaved {
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    /// A text message (control message; unknown ones are ignored), in fragments.
    Text(Vec<String>),
}

fn interleaved() -> impl Strategy<Value = Interleaved> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..=125).prop_map(Interleaved::Ping),
        prop::collection::vec(any::<u8>(), 0..=125).prop_map(Interleaved::Pong),
        prop::collection::vec("[a-z ]{0,20}", 1..4).prop_map(Interleaved::Text),
    ]
}

/// A binary message as fragments, each followed by control frames.
type Message = Vec<(Vec<u8>, Vec<Interleaved>)>;

fn message() -> impl Strategy<Value = Message> {
    prop::collection::vec(
        (prop::collection::vec(any::<u8>(), 0..300), prop::collection::vec(interleaved(), 0..2)),
        1..4,
    )
}

/// Encodes messages as a client would (masked), control frames between
/// fragments; text messages only between whole messages (RFC 6455 5.4).
fn encode_stream(messages: &[Message], masks: &[[u8; 4]], long_len: bool, close: bool) -> (Vec<u8>, Vec<u8>) {
    let mut wire = Vec::new();
    let mut data = Vec::new();
    let mut k = 0;
    let mut mask = || {
        k += 1;
        Some(masks[k % masks.len()])
    };
    for message in messages {
        let mut texts = Vec::new();
        for (i, (payload, extra)) in message.iter().enumerate() {
            let opcode = if i == 0 { 0x2 } else { 0x0 };
            ws_frame(&mut wire, i + 1 == message.len(), opcode, payload, mask(), long_len);
            data.extend_from_slice(payload);
            for x in extra {
                match x {
                    Interleaved::Ping(p) => ws_frame(&mut wire, true, 0x9, p, mask(), false),
                    Interleaved::Pong(p) => ws_frame(&mut wire, true, 0xA, p, mask(), false),
                    Interleaved::Text(t) => texts.push(t.clone()),
                }
            }
        }
        for fragments in texts {
            for (i, f) in fragments.iter().enumerate() {
                let opcode = if i == 0 { 0x1 } else { 0x0 };
                ws_frame(&mut wire, i + 1 == fragments.len(), opcode, f.as_bytes(), mask(), false);
            }
        }
    }
    if close {
        ws_frame(&mut wire, true, 0x8, &1000u16.to_be_bytes(), mask(), false);
    }
    (wire, data)
}

/// What the adapter writes for `chunks` written with a flush after each
/// chunk whose flag is set (and at the end).
fn adapter_writes(chunks: &[(Vec<u8>, bool)]) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    block_on(async {
        let (a, mut b) = tokio::io::duplex(8 << 20);
        let mut ws = crate::tunnel::ws::WsStream::new(a, Role::Client, Default::default());
        for (chunk, flush) in chunks {
            ws.write_all(chunk).await.unwrap();
            if *flush {
                ws.flush().await.unwrap();
            }
        }
        ws.shutdown().await.unwrap();
        drop(ws);
        let mut wire = Vec::new();
        b.read_to_end(&mut wire).await.unwrap();
        wire
    })
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn ws_fragmented_messages_arrive_whole_in_any_pieces(
        messages in prop::collection::vec(message(), 0..4),
        masks in prop::collection::vec(any::<[u8; 4]>(), 1..4),
        long_len in any::<bool>(),
        close in any::<bool>(),
        sizes in prop::collection::vec(any::<u8>(), 1..10),
        read_size in 1usize..2000,
    ) {
        let (wire, data) = encode_stream(&messages, &masks, long_len, close);
        let out = ws_read(&wire, Role::Server, &sizes, read_size);
        prop_assert!(out.error.is_none(), "{:?}", out.error);
        prop_assert!(out.data == data, "{} bytes read, {} sent", out.data.len(), data.len());
    }

    #[test]
    fn ws_adapter_output_reads_back_in_any_pieces(
        chunks in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..5000), any::<bool>()), 0..12),
        sizes in prop::collection::vec(any::<u8>(), 1..10),
        read_size in 1usize..5000,
    ) {
        let wire = adapter_writes(&chunks);
        let data: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.iter().copied()).collect();
        let out = ws_read(&wire, Role::Server, &sizes, read_size);
        prop_assert!(out.error.is_none(), "{:?}", out.error);
        prop_assert!(out.data == data, "{} bytes read, {} written", out.data.len(), data.len());
    }

    #[test]
    fn ws_any_bytes_read_the_same_in_any_pieces(
        stream in prop::collection::vec(any::<u8>(), 0..400),
        client in any::<bool>(),
        sizes in prop::collection::vec(any::<u8>(), 1..10),
    ) {
        let role = if client { Role::Client } else { Role::Server };
        let whole = ws_read(&stream, role, &[255], 4096);
        let pieces = ws_read(&stream, role, &sizes, 7);
        prop_assert_eq!(&whole.data, &pieces.data);
        prop_assert_eq!(whole.error.map(|e| e.kind()), pieces.error.map(|e| e.kind()));
    }
}

// --- htpasswd ----------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Scheme {
    Sha,
    Ssha(Vec<u8>),
    Plain,
}

fn scheme() -> impl Strategy<Value = Scheme> {
    prop_oneof![
        Just(Scheme::Sha),
        prop::collection::vec(any::<u8>(), 1..16).prop_map(Scheme::Ssha),
        Just(Scheme::Plain),
    ]
}

fn sha1(parts: &[&[u8]]) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    parts.iter().for_each(|p| ctx.update(p));
    ctx.finish().as_ref().to_vec()
}

fn basic(user: &str, password: &str) -> HeaderMap {
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut h = HeaderMap::new();
    h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Basic {b64}")).unwrap());
    h
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn htpasswd_lines_accept_their_passwords_only(
        users in prop::collection::btree_map("[a-zA-Z0-9._-]{1,12}", ("[!-~]([ -~]{0,14}[!-~])?", scheme()), 1..5),
        // A line starting with `#` is a comment, in `token` too.
        tokens in prop::collection::vec("[!-\"$-~][!-~]{0,19}", 0..3),
        comments in prop::collection::vec("# [ -~]{0,20}", 0..3),
    ) {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut auth = comments.join("\n\n");
        for (user, (password, scheme)) in &users {
            let hash = match scheme {
                Scheme::Sha => format!("{{SHA}}{}", b64.encode(sha1(&[password.as_bytes()]))),
                Scheme::Ssha(salt) => {
                    let mut d = sha1(&[password.as_bytes(), salt]);
                    d.extend(salt);
                    format!("{{SSHA}}{}", b64.encode(d))
                }
                Scheme::Plain => format!("{{PLAIN}}{password}"),
            };
            auth.push_str(&format!("\n  {user}:{hash}\r\n"));
        }
        let c = Credentials::parse(Some(&auth), Some(&tokens.join("\n"))).unwrap();
        for (user, (password, _)) in &users {
            prop_assert!(c.allows(&basic(user, password)), "{user}");
            let wrong = format!("{password}x");
            prop_assert!(!c.allows(&basic(user, &wrong)), "{user}: wrong password");
        }
        for t in &tokens {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {t}")).unwrap());
            prop_assert!(c.allows(&h));
        }
        prop_assert!(!c.allows(&HeaderMap::new()));
    }

    #[test]
    fn htpasswd_parser_takes_any_text(auth in "[ -~\n:{}]{0,200}", token in prop::option::of("[ -~\n]{0,40}")) {
        let _ = Credentials::parse(Some(&auth), token.as_deref());
    }
}

// --- names, ranges, labels, selectors, queries ------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn port_ranges_round_trip(a in 1u16.., b in 1u16..) {
        let r = PortRange { first: a.min(b), last: a.max(b) };
        prop_assert_eq!(PortRange::parse(&r.to_string()), Ok(r));
        let json = serde_json::to_string(&r).unwrap();
        prop_assert_eq!(serde_json::from_str::<PortRange>(&json).unwrap(), r);
        if a != b {
            let reversed = format!("{}-{}", a.max(b), a.min(b));
            prop_assert!(PortRange::parse(&reversed).is_err(), "{}", reversed);
        }
    }

    #[test]
    fn host_names_normalise_once(name in host_name(), dot in any::<bool>()) {
        let given = if dot { format!("{name}.") } else { name.clone() };
        if let Ok(host) = crate::edge::api::names::normalize_hostname(&given) {
            prop_assert_eq!(&host, &name.to_ascii_lowercase());
            prop_assert_eq!(crate::edge::api::names::normalize_hostname(&host).unwrap(), host.clone());
            let with_port = format!("{given}:443");
            prop_assert_eq!(crate::edge::routes::normalize_host(&with_port), host);
        } else {
            // Only one label, or an all-digit last label, is refused here.
            let last = name.rsplit('.').next().unwrap();
            prop_assert!(!name.contains('.') || last.bytes().all(|b| b.is_ascii_digit()), "{name}");
        }
    }

    #[test]
    fn text_parsers_take_any_text(text in "\\PC{0,80}") {
        super::names(&text);
    }

    #[test]
    fn valid_labels_are_selected_by_themselves(
        labels in prop::collection::btree_map("[A-Za-z0-9._/-]{1,30}", "[ -+\\--<>-~]{0,30}", 0..6),
    ) {
        prop_assert!(api::validate_labels(&labels).is_ok());
        let terms: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={}", v.trim())).collect();
        let trimmed: api::Labels = labels.iter().map(|(k, v)| (k.clone(), v.trim().to_string())).collect();
        prop_assert!(api::Selector::parse(&terms.join(",")).unwrap().matches(&trimmed));
        for k in labels.keys() {
            let absent = format!("!{k}");
            prop_assert!(!api::Selector::parse(&absent).unwrap().matches(&trimmed), "{}", absent);
        }
    }

    #[test]
    fn percent_encoding_decodes_back(text in "\\PC{0,40}") {
        let encoded: String = text.bytes().map(|b| format!("%{b:02X}")).collect();
        prop_assert_eq!(crate::http::percent_decode(&encoded), Some(text.clone()));
    }
}

// --- A backend's HTTP/1.1 answer (agent::h1) ----------------------------------------------------

/// A response whose body is framed by `content-length`, chunked (with
/// trailers) or the connection's end, and the body it carries.
fn backend_answer() -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    let chunks = prop::collection::vec(prop::collection::vec(any::<u8>(), 1..40), 0..6);
    (0..3u8, chunks, any::<bool>()).prop_map(|(framing, chunks, interim)| {
        let body: Vec<u8> = chunks.concat();
        let mut out = Vec::new();
        if interim {
            out.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\nServer: proptest\r\n");
        match framing {
            0 => {
                out.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
                out.extend_from_slice(&body);
            }
            1 => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for c in &chunks {
                    out.extend_from_slice(format!("{:X};x=y\r\n", c.len()).as_bytes());
                    out.extend_from_slice(c);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\nx-checksum: 1\r\n\r\n");
            }
            _ => {
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&body);
            }
        }
        (out, body)
    })
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn a_backend_answer_decodes_the_same_in_any_pieces(
        (answer, body) in backend_answer(),
        sizes in prop::collection::vec(any::<u8>(), 1..8),
    ) {
        let got = crate::agent::h1::decode(&answer, &sizes, false);
        prop_assert_eq!(got.status, Some(200));
        prop_assert_eq!(&got.data, &body);
        prop_assert_eq!(&got.end, "end");
        prop_assert_eq!(got, crate::agent::h1::decode(&answer, &[], false));
    }

    #[test]
    fn any_backend_answer_is_read_or_refused_without_a_panic(
        (answer, _) in backend_answer(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        sizes in prop::collection::vec(any::<u8>(), 0..8),
        head in any::<bool>(),
    ) {
        let mut answer = answer;
        for (at, byte) in edits {
            let i = at.index(answer.len());
            answer[i] = byte;
        }
        let mut input = vec![u8::from(head)];
        input.extend_from_slice(&sizes);
        input.resize(1 + 8, 1);
        input.extend_from_slice(&answer);
        super::h1_response(&input);
    }
}
