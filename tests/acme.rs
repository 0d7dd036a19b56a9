//! Custom domain certificates by ACME against a real ACME server: Debian's
//! `pebble` (scripts/deps installs it), everything on 127.0.0.1.
//!
//! The test runs a tiny DNS server (UDP, port 0) that answers the test's
//! names; pebble validates through it (`-dnsserver`) and the edge checks
//! "does this name point at me" with it (`--acme-dns-server`). The edge is
//! started first (port 0) so pebble can be told the edge's HTTP and HTTPS
//! ports; pebble itself listens on port 0 and its ports are read from
//! /proc; the edge reaches pebble's directory through a forwarder the test
//! bound before the edge started.
//!
//! DNS-01 for the edge's own wildcard runs against a real BIND (`named`,
//! scripts/deps installs bind9 and dnsutils) that pebble resolves through.
//!
//! Two edges on one PostgreSQL (started by the test): pebble validates
//! through a router of the test that sends each validation connection to
//! the edge that did not place the order, which answers it from the store.

mod support;
use support::bind::{self, Bind};
use support::{net, postgres};

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use culvert::agent::Target;
use culvert::edge::acme::dns01::{Dns01Provider, TsigAlgorithm, TsigKey};
use culvert::edge::{AcmeChallenge, Dns01Kind, EdgeArgs};
use net::{HttpsClient, TestAgent, TestEdge};
use rustls_pki_types::CertificateDer;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// Longest wait for an issued certificate (pebble validates at once).
const ISSUE_TIMEOUT: Duration = Duration::from_secs(60);

/// A DNS server on 127.0.0.1:0 answering A queries from a table the test
/// can change; AAAA and other types get an empty answer, unknown names NXDOMAIN.
struct Dns {
    addr: SocketAddr,
    names: Arc<Mutex<HashMap<String, Ipv4Addr>>>,
}

impl Dns {
    async fn start() -> Dns {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let names: Arc<Mutex<HashMap<String, Ipv4Addr>>> = Arc::default();
        names.lock().unwrap().insert(net::DOMAIN.into(), Ipv4Addr::LOCALHOST);
        let table = names.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, peer)) = socket.recv_from(&mut buf).await else { return };
                let reply = answer(&buf[..n], &table.lock().unwrap());
                if let Some(answer) = reply {
                    let _ = socket.send_to(&answer, peer).await;
                }
            }
        });
        Dns { addr, names }
    }

    fn set(&self, name: &str, ip: Ipv4Addr) {
        self.names.lock().unwrap().insert(name.into(), ip);
    }
}

fn answer(q: &[u8], names: &HashMap<String, Ipv4Addr>) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*q.get(at)?, *q.get(at + 1)?]);
    let question_end = at + 4;
    let name = labels.join(".");
    let mut m = q[..question_end].to_vec();
    m[2] = 0x84 | (q[2] & 0x01); // response, authoritative, RD copied
    m[3] = 0x80; // RA, NOERROR
    m[4..12].copy_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    match names.get(&name) {
        None => m[3] |= 3, // NXDOMAIN
        Some(ip) if qtype == 1 => {
            m[7] = 1;
            m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4]);
            m.extend_from_slice(&ip.octets());
        }
        Some(_) => {}
    }
    Some(m)
}

/// A running pebble and what the edge and the test need of it.
struct Pebble {
    _child: tokio::process::Child,
    /// The directory URL the edge uses (through the forwarder).
    directory: String,
    /// CA of pebble's own HTTPS listeners (the edge's `--acme-ca-file`).
    listener_ca: PathBuf,
    /// Pebble's issuing root, PEM (what public clients trust in the test).
    root_pem: String,
    /// While set, the forwarder to the ACME port drops every new
    /// connection: the CA is unreachable.
    outage: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

impl Pebble {
    /// Starts pebble validating against the edge's ports, with certificates
    /// valid for `validity`; `forwarder` was bound before the edge started
    /// and now forwards to pebble's ACME port.
    async fn start(edge: &TestEdge, dns: &Dns, forwarder: TcpListener, validity: Duration) -> Pebble {
        let http_port = edge.handle.as_ref().unwrap().http_addr.port();
        Pebble::start_at(http_port, edge.https.port(), dns.addr, forwarder, validity).await
    }

    /// Starts pebble validating HTTP-01 and TLS-ALPN-01 on these ports and
    /// resolving through `dns_server` (also for DNS-01).
    async fn start_at(
        http_port: u16,
        tls_port: u16,
        dns_server: SocketAddr,
        forwarder: TcpListener,
        validity: Duration,
    ) -> Pebble {
        let dir = tempfile::tempdir().unwrap();
        let pki = culvert::tls::generate_pki(&["127.0.0.1".into(), "localhost".into()]).unwrap();
        let write = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, body).unwrap();
            path
        };
        let listener_ca = write("ca.pem", &pki.ca_pem);
        let cert = write("cert.pem", &pki.cert_pem);
        let key = write("key.pem", &pki.key_pem);
        let config = json!({"pebble": {
            "listenAddress": "127.0.0.1:0",
            "managementListenAddress": "127.0.0.1:0",
            "certificate": cert,
            "privateKey": key,
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
            "certificateValidityPeriod": validity.as_secs(),
        }});
        let config_file = write("pebble.json", &config.to_string());
        let mut child = tokio::process::Command::new("pebble")
            .arg("-config")
            .arg(&config_file)
            .arg("-dnsserver")
            .arg(dns_server.to_string())
            .env("PEBBLE_VA_NOSLEEP", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("pebble runs (scripts/deps installs it)");
        let pid = child.id().unwrap();
        // Pebble logs to stdout.
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = |l: &str| l.contains("ACME directory available");
        net::line_where(&mut lines, "pebble's `ACME directory available`", Duration::from_secs(20), ready)
            .await;
        net::drain(lines);

        // Pebble logs before it binds: wait for both listening sockets.
        let ports = net::wait_for("pebble listening", Duration::from_secs(10), || {
            let ports = listening_ports(pid);
            (ports.len() >= 2).then_some(ports)
        })
        .await;
        let mut acme_port = None;
        let mut management_port = None;
        for port in ports {
            let client = HttpsClient { addr: ([127, 0, 0, 1], port).into(), ca_file: listener_ca.clone() };
            match client.get("127.0.0.1", "/dir").await.0.as_u16() {
                200 => acme_port = Some(port),
                _ => management_port = Some(port),
            }
        }
        let (acme_port, management_port) = (acme_port.unwrap(), management_port.unwrap());
        let directory = format!("https://127.0.0.1:{}/dir", forwarder.local_addr().unwrap().port());
        let outage = Arc::new(AtomicBool::new(false));
        tokio::spawn(forward(forwarder, ([127, 0, 0, 1], acme_port).into(), outage.clone()));

        let management =
            HttpsClient { addr: ([127, 0, 0, 1], management_port).into(), ca_file: listener_ca.clone() };
        let (status, root_pem) = management.get("127.0.0.1", "/roots/0").await;
        assert_eq!(status, 200, "{root_pem}");
        Pebble { _child: child, directory, listener_ca, root_pem, outage, _dir: dir }
    }
}

/// TCP ports `pid` listens on (its socket inodes in /proc/net/tcp).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| Some(l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let listening = f.get(3) == Some(&"0A") && inodes.contains(*f.get(9)?);
            let port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            listening.then_some(port)
        })
        .collect()
}

async fn forward(listener: TcpListener, to: SocketAddr, outage: Arc<AtomicBool>) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else { return };
        if outage.load(Ordering::SeqCst) {
            continue;
        }
        tokio::spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect(to).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// An edge with ACME against a fresh pebble, and the DNS both use.
struct World {
    edge: TestEdge,
    pebble: Pebble,
    dns: Dns,
    _ca_dir: tempfile::TempDir,
}

impl World {
    async fn start(challenge: AcmeChallenge, validity: Duration) -> World {
        net::init();
        let dns = Dns::start().await;
        let forwarder = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let directory = format!("https://127.0.0.1:{}/dir", forwarder.local_addr().unwrap().port());
        // The CA file is only read when the first order starts, after pebble is up.
        let ca_dir = tempfile::tempdir().unwrap();
        let ca_file = ca_dir.path().join("pebble-listener-ca.pem");
        let edge = TestEdge::start_with(|args| {
            args.acme.enabled = true;
            args.acme.directory = directory;
            args.acme.ca_file = Some(ca_file.clone());
            args.acme.challenge = challenge;
            args.acme.dns_server = Some(dns.addr);
            args.acme.email = Some("ops@example.org".into());
        })
        .await;
        let pebble = Pebble::start(&edge, &dns, forwarder, validity).await;
        std::fs::copy(&pebble.listener_ca, &ca_file).unwrap();
        assert_eq!(pebble.directory, edge.args.acme.directory);
        World { edge, pebble, dns, _ca_dir: ca_dir }
    }

    async fn reserve(&self, fqdn: &str) -> Value {
        let (status, r) = self.edge.api("POST", "domains", Some(json!({"fqdn": fqdn}))).await;
        assert_eq!(status, 201, "{r}");
        assert_eq!(r["kind"], "custom", "{r}");
        r
    }

    async fn certificate(&self, fqdn: &str) -> Value {
        let (status, r) = self.edge.api("GET", &format!("domains/{fqdn}"), None).await;
        assert_eq!(status, 200, "{r}");
        r["certificate"].clone()
    }

    /// Waits until the edge reports `status` for the domain's certificate.
    async fn wait_status(&self, fqdn: &str, status: &str) -> Value {
        net::eventually(&format!("{fqdn}: certificate {status}"), ISSUE_TIMEOUT, || async move {
            let c = self.certificate(fqdn).await;
            if c["status"] == status { Ok(c) } else { Err(c) }
        })
        .await
    }

    /// TLS to the edge with SNI `host`, trusting only pebble's root: the
    /// served leaf, or the handshake error.
    async fn served_leaf(&self, host: &str) -> Result<CertificateDer<'static>, std::io::Error> {
        let tls = self.public_tls(host).await?;
        Ok(tls.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned())
    }

    async fn public_tls(
        &self,
        host: &str,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, std::io::Error> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pki_types::pem::PemObject::pem_slice_iter(self.pebble.root_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut config = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = TcpStream::connect(self.edge.https).await?;
        let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await
    }

    /// The edge's ACME job counter for `result`.
    fn jobs(&self, result: &str) -> u64 {
        let metrics = self.edge.edge().metrics.encode();
        let prefix = format!("culvert_edge_acme_orders_total{{result=\"{result}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(&prefix)?.parse().ok()).unwrap_or(0)
    }
}

/// A GET over `tls` (HTTP/1.1): status and body.
async fn get(tls: tokio_rustls::client::TlsStream<TcpStream>, host: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("/")
        .header("host", host)
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// HTTP-01 on the edge's HTTP port; a public HTTPS request through a tunnel
/// validates against pebble's root; a restart serves the stored certificate
/// and orders nothing for it; releasing removes the certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http01_issue_serve_restart_release() {
    let mut w = World::start(AcmeChallenge::Http01, Duration::from_secs(90 * 86_400)).await;
    let host = "app.http01.test";
    w.dns.set(host, Ipv4Addr::LOCALHOST);
    let r = w.reserve(host).await;
    assert!(r["certificate"]["status"] == "pending", "{r}");
    let c = w.wait_status(host, "ready").await;
    assert!(c["notAfter"].is_string() && c["renewAt"].is_string() && c.get("lastError").is_none(), "{c}");

    // The user's app, through a tunnel, over HTTPS with the issued chain.
    let backend = net::http_backend().await;
    let (s, k) = w.edge.api("POST", "tunnel-keys", Some(json!({"domain": host, "protocol": "http"}))).await;
    assert!(s.is_success(), "{k}");
    let agent =
        TestAgent::start(&w.edge, k["secret"].as_str().unwrap(), Target::http(backend.to_string())).await;
    let tls = w.public_tls(host).await.expect("the issued chain validates against pebble's root");
    assert_eq!(get(tls, host).await, (200, "hello from backend".to_string()));
    // The edge's own name still gets the edge's certificate (not pebble's).
    assert!(w.served_leaf(net::DOMAIN).await.is_err());
    let issued = w.served_leaf(host).await.unwrap();
    assert_eq!(w.jobs("issued"), 1);
    agent.stop().await;

    // Restart: the stored certificate is served at once, nothing is ordered for it.
    w.edge.restart().await;
    assert_eq!(w.served_leaf(host).await.unwrap(), issued, "served from the store right after the restart");
    let second = "two.http01.test";
    w.dns.set(second, Ipv4Addr::LOCALHOST);
    w.reserve(second).await;
    w.wait_status(second, "ready").await;
    assert_eq!(w.jobs("issued"), 1, "only the new domain was ordered after the restart");
    assert_eq!(w.served_leaf(host).await.unwrap(), issued);
    assert_eq!(w.certificate(host).await["notAfter"], c["notAfter"]);

    // Release: the certificate is no longer served, and not kept.
    let (s, v) = w.edge.api("DELETE", &format!("domains/{host}"), None).await;
    assert_eq!(s, 200, "{v}");
    net::wait_for("the released certificate no longer served", Duration::from_secs(10), || {
        w.edge.edge().certs.get(host).is_none().then_some(())
    })
    .await;
    assert!(w.served_leaf(host).await.is_err(), "the default certificate is not pebble's");
    assert!(w.edge.edge().store.engine().certificate(host).unwrap().is_none());
    assert!(w.edge.edge().store.engine().certificate(second).unwrap().is_some());
}

/// TLS-ALPN-01 on the HTTPS port (no HTTP port needed), and renewal of
/// short-lived certificates without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_alpn01_issue_and_renew() {
    let w = World::start(AcmeChallenge::TlsAlpn01, Duration::from_secs(24)).await;
    let host = "app.alpn.test";
    w.dns.set(host, Ipv4Addr::LOCALHOST);
    w.reserve(host).await;
    let first = w.wait_status(host, "ready").await;
    let leaf = w.served_leaf(host).await.expect("valid against pebble's root");

    // 24 s certificates renew a third of their lifetime before expiry.
    let renewed = net::eventually("renewed", ISSUE_TIMEOUT, || async {
        let now = w.served_leaf(host).await.expect("always a valid certificate");
        if now != leaf { Ok(now) } else { Err("the first certificate is still served") }
    })
    .await;
    assert_ne!(renewed, leaf);
    let after = w.certificate(host).await;
    assert_eq!(after["status"], "ready", "{after}");
    assert!(after["notAfter"].as_str() > first["notAfter"].as_str(), "{first} -> {after}");
    assert!(w.jobs("issued") >= 2);
    assert_eq!(w.jobs("failed"), 0);
}

/// A name whose DNS does not point at the edge is reported, nothing is
/// asked of the CA; once DNS is fixed the certificate follows on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_dns_is_reported_then_fixed() {
    let w = World::start(AcmeChallenge::TlsAlpn01, Duration::from_secs(90 * 86_400)).await;
    let host = "app.wrong.test";
    w.dns.set(host, Ipv4Addr::new(127, 0, 0, 2));
    w.reserve(host).await;
    let c = w.wait_status(host, "dns_mismatch").await;
    let error = c["lastError"].as_str().unwrap();
    assert!(error.contains("resolves to 127.0.0.2") && error.contains("CNAME"), "{error}");
    assert!(c["nextAttemptAt"].is_string(), "{c}");
    assert!(w.jobs("dns_mismatch") >= 1);
    assert_eq!(w.jobs("issued") + w.jobs("failed"), 0, "nothing was ordered");

    // Unknown names are reported the same way.
    let missing = "nothing.wrong.test";
    w.reserve(missing).await;
    let c = w.wait_status(missing, "dns_mismatch").await;
    assert!(c["lastError"].as_str().unwrap().contains("no A/AAAA record"), "{c}");

    // The user fixes the CNAME: the next check (seconds later) orders.
    w.dns.set(host, Ipv4Addr::LOCALHOST);
    let c = w.wait_status(host, "ready").await;
    assert!(c.get("lastError").is_none(), "{c}");
    w.served_leaf(host).await.expect("valid against pebble's root");
}

/// The CA cannot be reached for a while: the order is retried within
/// seconds (not after the 5 min a failed validation waits) and the
/// certificate follows by itself once the CA is back. Pebble also rejects
/// 5 % of nonces at random, which takes the same path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ca_is_retried_within_seconds() {
    let w = World::start(AcmeChallenge::TlsAlpn01, Duration::from_secs(90 * 86_400)).await;
    w.pebble.outage.store(true, Ordering::SeqCst);
    let host = "app.outage.test";
    w.dns.set(host, Ipv4Addr::LOCALHOST);
    w.reserve(host).await;
    let c = w.wait_status(host, "failed").await;
    let error = c["lastError"].as_str().unwrap();
    assert!(error.contains("ACME account"), "{c}");
    let record = w.edge.edge().store.engine().certificate(host).unwrap().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let retry_in = record.next_attempt.saturating_sub(now);
    assert!(retry_in <= 10, "retried in {retry_in}s, not after the backoff of a judged order: {c}");
    assert!(w.jobs("transient") >= 1, "counted as transient");
    assert_eq!(w.jobs("failed"), 0);

    w.pebble.outage.store(false, Ordering::SeqCst);
    let c = w.wait_status(host, "ready").await;
    assert!(c.get("lastError").is_none(), "{c}");
    w.served_leaf(host).await.expect("valid against pebble's root");
}

/// Name of the TSIG key the test's BIND accepts updates with.
const TSIG_KEY: &str = "culvert-test";

/// A real BIND (`named`, Debian's bind9) on 127.0.0.1, primary for the
/// edge's domain, that lets `TSIG_KEY` update `_acme-challenge.<domain>` TXT.
struct Dns01Bind {
    bind: Bind,
    /// The key's secret, base64.
    secret: String,
}

impl std::ops::Deref for Dns01Bind {
    type Target = Bind;
    fn deref(&self) -> &Bind {
        &self.bind
    }
}

impl Dns01Bind {
    async fn start() -> Dns01Bind {
        use base64::Engine;
        use ring::rand::SecureRandom;
        let mut raw = [0u8; 32];
        ring::rand::SystemRandom::new().fill(&mut raw).unwrap();
        let secret = base64::engine::general_purpose::STANDARD.encode(raw);
        let domain = net::DOMAIN;
        let zone = bind::Zone {
            name: domain,
            // `id` tells this named from another on the same port.
            records: &format!("@ IN A 127.0.0.1\n* IN A 127.0.0.1\nid IN TXT \"{secret}\"\n"),
            options: "",
            statements: &format!("key \"{TSIG_KEY}\" {{ algorithm hmac-sha256; secret \"{secret}\"; }};"),
            zone: &format!("    update-policy {{ grant {TSIG_KEY} name _acme-challenge.{domain}. TXT; }};"),
        };
        let bind = Bind::start(&zone, (&format!("id.{domain}"), "TXT", &format!("\"{secret}\""))).await;
        Dns01Bind { bind, secret }
    }

    /// The TXT values of `name`, as BIND serves them now (dig over TCP).
    async fn txt(&self, name: &str) -> Vec<String> {
        let out = self.dig(name, "TXT", true).await.unwrap();
        let mut values: Vec<String> = out.lines().map(|l| l.trim_matches('"').to_string()).collect();
        values.sort();
        values
    }

    fn provider(&self, key: &str, secret: &str) -> Dns01Provider {
        Dns01Provider::Rfc2136 {
            server: self.addr,
            zone: net::DOMAIN.into(),
            key: Some(TsigKey::new(key, TsigAlgorithm::HmacSha256, secret).unwrap()),
        }
    }
}

impl World {
    /// Pebble (resolving through `bind`) and then an edge whose own
    /// certificate is ordered by DNS-01 as `configure` sets it up.
    async fn start_dns01(
        bind: &Dns01Bind,
        validity: Duration,
        configure: impl FnOnce(&mut EdgeArgs),
    ) -> World {
        net::init();
        let dns = Dns::start().await;
        let forwarder = TcpListener::bind("127.0.0.1:0").await.unwrap();
        // DNS-01 needs none of the edge's ports: pebble is up before the edge orders.
        let pebble = Pebble::start_at(1, 1, bind.addr, forwarder, validity).await;
        let edge = TestEdge::start_with(|args| {
            args.self_signed = false;
            args.acme.enabled = true;
            args.acme.directory = pebble.directory.clone();
            args.acme.ca_file = Some(pebble.listener_ca.clone());
            args.acme.email = Some("ops@example.org".into());
            configure(args);
        })
        .await;
        World { edge, pebble, dns, _ca_dir: tempfile::tempdir().unwrap() }
    }

    /// Waits until the edge's own name is served with a chain pebble issued.
    async fn wait_own_certificate(&self) -> CertificateDer<'static> {
        net::eventually("a certificate for the edge", ISSUE_TIMEOUT, || self.served_leaf(net::DOMAIN)).await
    }
}

/// The RFC 2136 provider against a real BIND: two values side by side at
/// one name, exactly one removed; a wrong secret, an unknown key and a name
/// the key may not change are refused with what to fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rfc2136_updates_a_real_bind() {
    let bind = Dns01Bind::start().await;
    let name = format!("_acme-challenge.{}", net::DOMAIN);
    let p = bind.provider(TSIG_KEY, &bind.secret);
    p.set(&name, "first-value").await.unwrap();
    p.set(&name, "second-value").await.unwrap();
    assert_eq!(bind.txt(&name).await, ["first-value", "second-value"]);
    p.unset(&name, "first-value").await.unwrap();
    assert_eq!(bind.txt(&name).await, ["second-value"]);
    p.unset(&name, "second-value").await.unwrap();
    assert!(bind.txt(&name).await.is_empty());

    use base64::Engine;
    let wrong = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
    let e = bind.provider(TSIG_KEY, &wrong).set(&name, "x").await.unwrap_err();
    assert!(e.to_string().contains("BADSIG") && e.to_string().contains("--acme-dns01-tsig-secret"), "{e}");
    let e = bind.provider("other-key", &bind.secret).set(&name, "x").await.unwrap_err();
    assert!(e.to_string().contains("BADKEY"), "{e}");
    let e = p.set(&format!("www.{}", net::DOMAIN), "x").await.unwrap_err();
    assert!(e.to_string().contains("REFUSED") && e.to_string().contains("update-policy"), "{e}");
    assert_eq!(e.category(), "dns01_refused");
    assert!(bind.txt(&name).await.is_empty());
}

/// `--acme-dns01 rfc2136`: a wrong TSIG secret is reported and, once fixed,
/// tried again at the restart (not after the backoff); the edge obtains its
/// own `<domain>` + `*.<domain>` certificate from pebble through a real
/// BIND, removes the records, and serves the stored certificate at once
/// after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns01_rfc2136_issues_the_edges_own_wildcard() {
    use base64::Engine;
    let bind = Dns01Bind::start().await;
    let wrong = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
    let mut w = World::start_dns01(&bind, Duration::from_secs(90 * 86_400), |args| {
        args.acme.dns01 = Some(Dns01Kind::Rfc2136);
        args.acme.dns01_server = Some(bind.addr);
        args.acme.dns01_tsig_key = Some(TSIG_KEY.into());
        args.acme.dns01_tsig_secret = Some(wrong);
    })
    .await;
    let own = format!("*.{}", net::DOMAIN);
    let error = net::wait_for("an order error stored", ISSUE_TIMEOUT, || {
        let record = w.edge.edge().store.engine().certificate(&own).unwrap()?;
        record.last_error
    })
    .await;
    assert!(error.contains("BADSIG") && error.contains("--acme-dns01-tsig-secret"), "{error}");
    assert!(w.served_leaf(net::DOMAIN).await.is_err(), "a temporary certificate until issued");

    // Fixed and restarted: ordered at once (the backoff is minutes).
    w.edge.args.acme.dns01_tsig_secret = Some(bind.secret.clone());
    w.edge.restart().await;
    let leaf = w.wait_own_certificate().await;
    // One certificate for the domain and any name under it.
    assert_eq!(w.served_leaf("app.edge.test").await.unwrap(), leaf);
    let tls = w.public_tls("nothing.edge.test").await.unwrap();
    // HTTP over the issued certificate: the edge's answer for a name nothing is published on.
    let (status, body) = get(tls, "nothing.edge.test").await;
    assert!(status >= 400 && !body.is_empty(), "{status} {body}");
    assert_eq!(w.jobs("issued"), 1);
    assert!(bind.txt(&format!("_acme-challenge.{}", net::DOMAIN)).await.is_empty(), "records removed");

    // Restart: served from the store at once.
    w.edge.restart().await;
    assert_eq!(
        w.served_leaf(net::DOMAIN).await.unwrap(),
        leaf,
        "served from the store right after the restart"
    );
}

/// `--acme-dns01 hook`: a hook script (here: nsupdate into a real BIND)
/// sets and removes the records; a short-lived certificate is renewed
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns01_hook_issues_and_renews() {
    let bind = Dns01Bind::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (hook, calls) = (dir.path().join("hook.sh"), dir.path().join("calls.log"));
    let script = format!(
        r#"#!/bin/sh
set -eu
echo "$1 $2" >> '{calls}'
case "$1" in set) op=add ;; unset) op=delete ;; *) echo "unknown action $1" >&2; exit 2 ;; esac
nsupdate -y 'hmac-sha256:{TSIG_KEY}:{secret}' <<EOF
server 127.0.0.1 {port}
zone {domain}
update $op $2. 60 TXT "$3"
send
EOF
"#,
        calls = calls.display(),
        secret = bind.secret,
        port = bind.addr.port(),
        domain = net::DOMAIN,
    );
    std::fs::write(&hook, script).unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let w = World::start_dns01(&bind, Duration::from_secs(24), |args| {
        args.acme.dns01 = Some(Dns01Kind::Hook);
        args.acme.dns01_hook = Some(hook.clone());
    })
    .await;
    let first = w.wait_own_certificate().await;
    assert_eq!(w.served_leaf("app.edge.test").await.unwrap(), first);
    let name = format!("_acme-challenge.{}", net::DOMAIN);
    let log = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(log.lines().filter(|l| *l == format!("set {name}")).count(), 2, "{log}");

    // 24 s certificates renew a third of their lifetime before expiry.
    net::eventually("renewed", ISSUE_TIMEOUT, || async {
        let now = w.served_leaf(net::DOMAIN).await.expect("always a valid certificate");
        if now != first { Ok(()) } else { Err("the first certificate is still served") }
    })
    .await;
    assert!(w.jobs("issued") >= 2);
    assert_eq!(w.jobs("failed"), 0);
    net::wait_for("every DNS-01 record removed", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(&calls).unwrap();
        let count = |a: &str| log.lines().filter(|l| *l == format!("{a} {name}")).count();
        // The renewal may reuse still valid authorizations (fewer records): every record set is removed.
        (count("set") >= 2 && count("unset") == count("set")).then_some(())
    })
    .await;
    assert!(bind.txt(&name).await.is_empty(), "records removed");
}

/// Sends each connection to the edge that is not ordering `host` (the
/// other edge placed the order); counts where they went (`[to A, to B]`).
async fn route_to_the_other_edge(
    front: TcpListener,
    host: &'static str,
    edges: [(Arc<culvert::edge::Edge>, SocketAddr); 2],
    routed: Arc<Mutex<[u32; 2]>>,
) {
    loop {
        let Ok((mut inbound, _)) = front.accept().await else { return };
        let ordering = |i: usize| edges[i].0.acme.as_ref().unwrap().in_flight().iter().any(|h| h == host);
        // The edge that lost the order's lease drops the name from its jobs at once.
        let mut to = None;
        for _ in 0..100 {
            to = match (ordering(0), ordering(1)) {
                (true, false) => Some(1),
                (false, true) => Some(0),
                _ => None,
            };
            if to.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let Some(to) = to else {
            eprintln!("validation of {host} while no single edge orders it: refused");
            continue;
        };
        routed.lock().unwrap()[to] += 1;
        let addr = edges[to].1;
        tokio::spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect(addr).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// The leaf served by the edge at `addr` for SNI `host`, validated against `root_pem`.
async fn served_leaf_at(
    addr: SocketAddr,
    root_pem: &str,
    host: &str,
) -> Result<CertificateDer<'static>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::pem::PemObject::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    Ok(tls.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned())
}

/// Rows of `table` in the test database at `url`.
async fn count_rows(url: &str, table: &str) -> i64 {
    let (url, query) = (url.to_string(), format!("SELECT count(*) FROM {table}"));
    // The blocking client runs a runtime of its own: on a thread outside tokio's.
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut c = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
        let _ = tx.send(c.query_one(&query, &[]).unwrap().get::<_, i64>(0));
    });
    rx.await.expect("the count query ran")
}

/// Two edges on one PostgreSQL behind one name. Both need the ACME account
/// at the same moment: one registers it, the other waits and uses it (one
/// account at the CA). The order for a custom domain runs on one edge (the
/// name's lease) and the CA's validation reaches the other edge, which
/// answers from the store; the certificate is then served by both, and the
/// challenge answers leave the store.
async fn two_edges_on_one_store(challenge: AcmeChallenge, host: &'static str) {
    net::init();
    let Some(pg) = postgres::Postgres::shared() else { return };
    let store = pg.fresh_database();
    let dns = Dns::start().await;
    dns.set(host, Ipv4Addr::LOCALHOST);
    let forwarder = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let directory = format!("https://127.0.0.1:{}/dir", forwarder.local_addr().unwrap().port());
    let ca_dir = tempfile::tempdir().unwrap();
    let ca_file = ca_dir.path().join("pebble-listener-ca.pem");
    let configure = |args: &mut EdgeArgs| {
        args.store = Some(store.clone());
        args.acme.enabled = true;
        args.acme.directory = directory.clone();
        args.acme.ca_file = Some(ca_file.clone());
        args.acme.challenge = challenge;
        args.acme.dns_server = Some(dns.addr);
    };
    let a = TestEdge::start_with(configure).await;
    let b = TestEdge::join(&a, configure).await;

    // Pebble validates on the router's ports, which pick the edge.
    let (http_front, tls_front) =
        (TcpListener::bind("127.0.0.1:0").await.unwrap(), TcpListener::bind("127.0.0.1:0").await.unwrap());
    let (http_port, tls_port) =
        (http_front.local_addr().unwrap().port(), tls_front.local_addr().unwrap().port());
    let pebble =
        Pebble::start_at(http_port, tls_port, dns.addr, forwarder, Duration::from_secs(90 * 86_400)).await;
    std::fs::copy(&pebble.listener_ca, &ca_file).unwrap();
    let routed: Arc<Mutex<[u32; 2]>> = Arc::default();
    let edge_of = |e: &TestEdge, port: fn(&culvert::edge::EdgeHandle) -> SocketAddr| {
        (e.edge().clone(), port(e.handle.as_ref().unwrap()))
    };
    let front = match challenge {
        AcmeChallenge::Http01 => http_front,
        AcmeChallenge::TlsAlpn01 => tls_front,
    };
    let port: fn(&culvert::edge::EdgeHandle) -> SocketAddr = match challenge {
        AcmeChallenge::Http01 => |h| h.http_addr,
        AcmeChallenge::TlsAlpn01 => |h| h.https_addr,
    };
    tokio::spawn(route_to_the_other_edge(
        front,
        host,
        [edge_of(&a, port), edge_of(&b, port)],
        routed.clone(),
    ));

    // The account, asked for by both edges at once: one registration.
    let (acme_a, acme_b) = (a.edge().acme.clone().unwrap(), b.edge().acme.clone().unwrap());
    let (id_a, id_b) = tokio::join!(acme_a.account_id(), acme_b.account_id());
    let (id_a, id_b) = (id_a.expect("account on A"), id_b.expect("account on B"));
    assert_eq!(id_a, id_b, "both edges use the one account");
    assert_eq!(count_rows(&store, "acme_accounts").await, 1);

    let (status, r) = a.api("POST", "domains", Some(json!({"fqdn": host}))).await;
    assert_eq!(status, 201, "{r}");
    net::eventually(&format!("{host}: certificate ready on the other edge"), ISSUE_TIMEOUT, || async {
        let (_, r) = b.api("GET", &format!("domains/{host}"), None).await;
        if r["certificate"]["status"] == "ready" { Ok(()) } else { Err(r) }
    })
    .await;
    let routed = *routed.lock().unwrap();
    let issued = |e: &TestEdge| {
        let prefix = "culvert_edge_acme_orders_total{result=\"issued\"} ";
        e.edge()
            .metrics
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix(prefix)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (by_a, by_b) = (issued(&a), issued(&b));
    println!("{challenge:?}: ordered by A/B {by_a}/{by_b}, validation connections to A/B {routed:?}");
    assert_eq!(by_a + by_b, 1, "one order");
    let orderer = if by_a == 1 { 0 } else { 1 };
    assert_eq!(routed[orderer], 0, "no validation reached the ordering edge: {routed:?}");
    assert!(routed[1 - orderer] > 0, "the CA validated on the other edge: {routed:?}");

    // Served by both: the orderer at once, the other once it read the store.
    for e in [&a, &b] {
        let what = format!("{} serves the certificate", e.https);
        net::eventually(&what, Duration::from_secs(20), || served_leaf_at(e.https, &pebble.root_pem, host))
            .await;
    }
    assert_eq!(
        served_leaf_at(a.https, &pebble.root_pem, host).await.unwrap(),
        served_leaf_at(b.https, &pebble.root_pem, host).await.unwrap()
    );
    // The order ended: its answers left the store.
    net::eventually("the challenge answers left the store", Duration::from_secs(10), || async {
        match count_rows(&store, "acme_challenges").await {
            0 => Ok(()),
            n => Err(format!("{n} rows")),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_http01_validated_on_the_other_edge() {
    two_edges_on_one_store(AcmeChallenge::Http01, "app.two-http.test").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_tls_alpn01_validated_on_the_other_edge() {
    two_edges_on_one_store(AcmeChallenge::TlsAlpn01, "app.two-alpn.test").await;
}
