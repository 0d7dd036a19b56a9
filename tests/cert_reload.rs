//! The edge's own certificate files replaced under a running edge (certbot
//! renewal): new handshakes get the new certificate, tunnels and open
//! public connections are kept, bad files keep the old certificate; SIGHUP
//! on a real `culvert edge` process reloads and never stops it.

mod support;
use support::net;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use culvert::agent::Target;
use culvert::tls::GeneratedPki;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use net::{TestAgent, TestEdge};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");
const LIMIT: Duration = Duration::from_secs(20);

/// A CA and a certificate for the edge's names, signed by it.
fn pki() -> GeneratedPki {
    culvert::tls::generate_pki(&[
        net::DOMAIN.to_string(),
        format!("*.{}", net::DOMAIN),
        "127.0.0.1".to_string(),
    ])
    .unwrap()
}

/// Writes `body` to `path` the way certbot does: a new file renamed over the old.
fn replace(path: &Path, body: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn client_config(ca_pem: &str) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut c = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}

/// A new TLS connection to `addr` with SNI `host`, trusting only `ca_pem`.
async fn tls(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
    tokio_rustls::TlsConnector::from(client_config(ca_pem)).connect(name, tcp).await
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn http1(stream: tokio_rustls::client::TlsStream<TcpStream>) -> Sender {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    sender
}

async fn get(sender: &mut Sender, host: &str) -> (u16, String) {
    let req = http::Request::get("/").header("host", host).body(Empty::new()).unwrap();
    let resp = sender.send_request(req).await.expect("request on the connection");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn reloads(edge: &TestEdge, result: &str) -> u64 {
    let prefix = format!("culvert_edge_tls_certificate_reloads_total{{result=\"{result}\"}} ");
    edge.edge().metrics.encode().lines().find_map(|l| l.strip_prefix(&prefix)?.parse().ok()).unwrap_or(0)
}

/// Waits until `cond` holds (see [`net::wait_for`]).
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    net::wait_for(what, LIMIT, || cond().then_some(())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_certificate_files_are_served_and_tunnels_kept() {
    let files = tempfile::tempdir().unwrap();
    let (cert, key) = (files.path().join("fullchain.pem"), files.path().join("privkey.pem"));
    let (a, b) = (pki(), pki());
    std::fs::write(&cert, format!("{}{}", a.cert_pem, a.ca_pem)).unwrap();
    std::fs::write(&key, &a.key_pem).unwrap();
    let ca_a = files.path().join("ca-a.pem");
    std::fs::write(&ca_a, &a.ca_pem).unwrap();
    let mut edge = TestEdge::start_with(|args| {
        args.self_signed = false;
        args.tls_cert = Some(cert.clone());
        args.tls_key = Some(key.clone());
        args.tls_watch_seconds = 1;
    })
    .await;
    edge.ca_file = ca_a.clone();

    // A tunnel (its agent trusts only CA A, so it could not reconnect after
    // the switch) and an open keep-alive public connection.
    let backend = net::http_backend().await;
    let (host, secret) = edge.http_tunnel_key("app").await;
    let agent = TestAgent::start(&edge, &secret, Target::http(backend.to_string())).await;
    let mut open = http1(tls(edge.https, &host, &a.ca_pem).await.expect("A is served")).await;
    assert_eq!(get(&mut open, &host).await, (200, "hello from backend".into()));

    // Half written: refused, A stays.
    std::fs::write(&cert, &b.cert_pem[..b.cert_pem.len() / 2]).unwrap();
    wait_for("the half-written certificate is refused", || reloads(&edge, "failed") >= 1).await;
    tls(edge.https, &host, &a.ca_pem).await.expect("still A after a bad file");
    // B's certificate with A's key (the key is not replaced yet): refused, A stays.
    let failed = reloads(&edge, "failed");
    replace(&cert, &format!("{}{}", b.cert_pem, b.ca_pem));
    wait_for("the mismatched key is refused", || reloads(&edge, "failed") > failed).await;
    tls(edge.https, &host, &a.ca_pem).await.expect("still A with a mismatched key");
    assert_eq!(reloads(&edge, "reloaded"), 0);

    // The key follows: B is served to new handshakes, without a restart.
    replace(&key, &b.key_pem);
    wait_for("the new pair is served", || reloads(&edge, "reloaded") == 1).await;
    let mut fresh = http1(tls(edge.https, &host, &b.ca_pem).await.expect("B is served")).await;
    assert!(tls(edge.https, &host, &a.ca_pem).await.is_err(), "A is no longer served");
    // Through the same tunnel, on a new connection and on the one opened before.
    assert_eq!(get(&mut fresh, &host).await, (200, "hello from backend".into()));
    assert_eq!(get(&mut open, &host).await, (200, "hello from backend".into()));
    assert!(!agent.task.is_finished(), "the agent's tunnel was kept");
    let tunnels = edge.edge().metrics.encode();
    assert!(tunnels.lines().any(|l| l == "culvert_edge_tunnels_connected 1"), "{tunnels}");

    // A restart loads the files as they are now.
    edge.restart().await;
    tls(edge.https, &host, &b.ca_pem).await.expect("B after a restart");
    agent.stop().await;
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

async fn served_by(addr: std::net::SocketAddr, ca_pem: &str) -> bool {
    tls(addr, net::DOMAIN, ca_pem).await.is_ok()
}

/// A real `culvert edge` with `--tls-watch-seconds 0`: only SIGHUP reloads;
/// a SIGHUP with bad files keeps the old certificate; the edge never exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_real_edge_and_never_stops_it() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let (cert, key): (PathBuf, PathBuf) = (files.path().join("cert.pem"), files.path().join("key.pem"));
    let (a, b) = (pki(), pki());
    std::fs::write(&cert, format!("{}{}", a.cert_pem, a.ca_pem)).unwrap();
    std::fs::write(&key, &a.key_pem).unwrap();
    let ports = net::free_port_range(2).to_string();
    let mut child = tokio::process::Command::new(BIN)
        .args(["edge", "--domain", net::DOMAIN, "--data-dir", dir.path().to_str().unwrap()])
        .args(["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()])
        .args(["--tls-watch-seconds", "0", "--https-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0", "--tcp-ports", &ports, "--tcp-bind", "127.0.0.1"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("culvert runs");
    let pid = child.id().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(LIMIT, async {
        loop {
            match stdout.next_line().await.unwrap() {
                Some(l) if l.starts_with("culvert edge ready") => return l,
                Some(_) => continue,
                None => panic!("the edge ended before it was ready"),
            }
        }
    })
    .await
    .expect("ready line");
    let https: std::net::SocketAddr =
        ready.split_whitespace().find_map(|w| w.strip_prefix("https=")).unwrap().parse().unwrap();
    // stderr (the log) is collected line by line for the assertions below.
    let (log_tx, mut log) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    tokio::spawn(async move {
        while let Ok(Some(line)) = stderr.next_line().await {
            eprintln!("edge: {line}");
            let _ = log_tx.send(line);
        }
    });
    let mut wait_log = async |needle: &str| {
        tokio::time::timeout(LIMIT, async {
            while let Some(line) = log.recv().await {
                if line.contains(needle) {
                    return line;
                }
            }
            panic!("the edge's log ended before `{needle}`");
        })
        .await
        .unwrap_or_else(|_| panic!("`{needle}` not logged within {LIMIT:?}"))
    };
    let hup = || {
        // SAFETY: sends SIGHUP to the child this test started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    };
    assert!(served_by(https, &a.ca_pem).await);

    // Files replaced: nothing happens until SIGHUP (no polling with 0).
    replace(&cert, &format!("{}{}", b.cert_pem, b.ca_pem));
    replace(&key, &b.key_pem);
    assert!(served_by(https, &a.ca_pem).await);
    hup();
    wait_log("reloaded the TLS certificate").await;
    assert!(served_by(https, &b.ca_pem).await, "B after SIGHUP");
    assert!(!served_by(https, &a.ca_pem).await);

    // A bad key with SIGHUP: an error is logged, B stays, the edge lives.
    replace(&key, "-----BEGIN PRIVATE KEY-----\nnot a key\n");
    hup();
    let line = wait_log("still serving the previous certificate").await;
    assert!(line.contains("key.pem"), "{line}");
    assert!(served_by(https, &b.ca_pem).await, "B after a bad reload");
    // Several SIGHUPs in a row: still running, still serving.
    hup();
    hup();
    wait_log("still serving the previous certificate").await;
    assert!(pid_alive(pid) && child.try_wait().unwrap().is_none(), "SIGHUP must never stop the edge");
    assert!(served_by(https, &b.ca_pem).await);

    // SIGTERM still stops it, cleanly.
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(LIMIT, child.wait()).await.expect("exits on SIGTERM").unwrap();
    assert!(status.success(), "{status}");
}
