//! Several edge processes on one PostgreSQL (started by the test): what is
//! changed on one edge is seen by the other within a bound, through the
//! store's change feed (LISTEN/NOTIFY).
//!
//! - a name reserved on edge A is routed by edge B, to an agent connected to B;
//! - a tunnel key revoked on A cuts the live tunnel on B within 1 s;
//! - a TCP port reserved on A listens on B; released on A, B closes it;
//! - PostgreSQL stopped under load: the edge keeps serving (and lets in an
//!   agent that reconnects with a key it knows), changes are refused with
//!   503, and succeed once it is back;
//! - `culvert migrate-store`: an SQLite edge's data served from PostgreSQL.

mod support;
use support::net::{self, Proc, field};
use support::postgres;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use culvert::agent::Target;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use net::{HttpsClient, TestAgent};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");
/// Changes on one edge reach the others within this (README: "Several edges").
const BOUND: Duration = Duration::from_secs(1);

/// An edge process with its own data dir (CA, admin key file) on the shared store.
struct EdgeProc {
    /// Killed when dropped; its stdout stays open, so that it never breaks.
    proc: Proc,
    dir: tempfile::TempDir,
    https: SocketAddr,
    ca_file: PathBuf,
    admin_key_file: PathBuf,
}

impl EdgeProc {
    async fn start(store: &str, tcp_bind: &str, tcp_ports: &str) -> EdgeProc {
        EdgeProc::start_in(tempfile::tempdir().unwrap(), store, tcp_bind, tcp_ports).await
    }

    async fn start_in(dir: tempfile::TempDir, store: &str, tcp_bind: &str, tcp_ports: &str) -> EdgeProc {
        let mut cmd = Proc::edge_command(dir.path(), "127.0.0.1:0", tcp_bind, tcp_ports);
        let mut proc = Proc::spawn(cmd.env("CULVERT_STORE", store));
        let ready = proc.line_within("culvert edge ready", Duration::from_secs(60)).await;
        EdgeProc {
            https: field(&ready, "https").parse().unwrap(),
            ca_file: field(&ready, "ca_file").into(),
            admin_key_file: field(&ready, "admin_key_file").into(),
            proc,
            dir,
        }
    }

    /// SIGKILL; the data dir stays.
    async fn kill(mut self) -> tempfile::TempDir {
        self.proc.child.start_kill().unwrap();
        self.proc.child.wait().await.unwrap();
        self.dir
    }

    fn client(&self) -> HttpsClient {
        HttpsClient { addr: self.https, ca_file: self.ca_file.clone() }
    }

    fn url(&self) -> String {
        format!("https://{}", self.https)
    }

    async fn api(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let req = Request::builder()
            .method(method)
            .uri(format!("/_culvert/v1/api/{path}"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.map(|b| b.to_string()).unwrap_or_default())))
            .unwrap();
        let resp = self.client().send("127.0.0.1", req, false).await.expect("api call");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into())),
        )
    }
}

/// Polls `probe` until it holds; returns how long that took, failing after
/// `limit` (a probe still waiting then fails too).
async fn within<F: std::future::Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut probe: impl FnMut() -> F,
) -> Duration {
    let start = Instant::now();
    loop {
        // A probe that hangs fails too, when the time is up.
        let left = limit.saturating_sub(start.elapsed());
        if tokio::time::timeout(left, probe()).await == Ok(true) {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_on_one_edge_reach_the_other() {
    net::init();
    let Some(pg) = postgres::Postgres::shared() else { return };
    let store = pg.fresh_database();
    let range = net::free_port_range(4);
    // Both edges on one host: their TCP listeners on two loopback addresses.
    let a = EdgeProc::start(&store, "127.0.0.1", &range.to_string()).await;
    let b = EdgeProc::start(&store, "127.0.0.2", &range.to_string()).await;
    let key = std::fs::read_to_string(&a.admin_key_file).unwrap().trim().to_string();
    assert!(!b.admin_key_file.exists(), "the second edge finds the admin key in the store");
    let (s, info) = b.api(&key, "GET", "domains", None).await;
    assert_eq!(s, StatusCode::OK, "A's admin key works on B: {info}");

    // A name reserved on A, an agent on B: B routes it.
    let (s, r) = a.api(&key, "POST", "domains", Some(json!({"name": "blog"}))).await;
    assert!(s.is_success(), "{r}");
    let host = r["hostname"].as_str().unwrap().to_string();
    let (s, k) = a.api(&key, "POST", "tunnel-keys", Some(json!({"domain": host, "protocol": "http"}))).await;
    assert!(s.is_success(), "{k}");
    let (secret, key_id) = (k["secret"].as_str().unwrap().to_string(), k["id"].as_str().unwrap().to_string());
    let backend = net::http_backend().await;
    let agent = TestAgent::start_at(&b.url(), &b.ca_file, &secret, Target::http(backend.to_string())).await;
    let b_client = b.client();
    let took = within("B serves the name reserved on A", BOUND, || async {
        b_client.get(&host, "/").await == (StatusCode::OK, "hello from backend".into())
    })
    .await;
    eprintln!("reserved on A, served by B after {took:?} (from the agent's connection)");

    // Revoked on A: the live tunnel on B is cut.
    let (s, body) = a.api(&key, "DELETE", &format!("tunnel-keys/{key_id}"), None).await;
    assert!(s.is_success(), "{body}");
    let took = within("the tunnel on B is cut after the revocation on A", BOUND, || async {
        // A response whose head crossed the tunnel just before the cut, and
        // its body not, ends its connection: that request is asked again.
        let req = Request::get("/").body(Full::new(Bytes::new())).unwrap();
        b_client.send(&host, req, false).await.is_ok_and(|r| r.status() == StatusCode::BAD_GATEWAY)
    })
    .await;
    eprintln!("revoked on A, cut on B after {took:?}");
    agent.stop().await;

    // A TCP port reserved on A listens on B (its own address), for an agent on B.
    let (s, r) = a.api(&key, "POST", "ports", Some(json!({}))).await;
    assert!(s.is_success(), "{r}");
    let (port, port_id) = (r["port"].as_u64().unwrap() as u16, r["id"].as_str().unwrap().to_string());
    let (s, k) = a.api(&key, "POST", "tunnel-keys", Some(json!({"port": port, "protocol": "tcp"}))).await;
    assert!(s.is_success(), "{k}");
    let echo = net::tcp_echo().await;
    let tcp_agent = TestAgent::start_at(
        &b.url(),
        &b.ca_file,
        k["secret"].as_str().unwrap(),
        Target::Tcp { addr: echo.to_string(), proxy: None },
    )
    .await;
    let on_b: SocketAddr = format!("127.0.0.2:{port}").parse().unwrap();
    let took = within("B listens on the port reserved on A", BOUND, || async {
        let Ok(mut s) = tokio::net::TcpStream::connect(on_b).await else { return false };
        let mut buf = [0u8; 5];
        s.write_all(b"hello").await.is_ok() && s.read_exact(&mut buf).await.is_ok() && &buf == b"hello"
    })
    .await;
    eprintln!("port reserved on A, echoing through B after {took:?}");

    // Released on A: B stops listening.
    let (s, body) = a.api(&key, "DELETE", &format!("ports/{port}"), None).await;
    assert!(s.is_success(), "{body} ({port_id})");
    let took = within("B closes the port released on A", BOUND, || async {
        tokio::net::TcpStream::connect(on_b).await.is_err()
    })
    .await;
    eprintln!("port released on A, closed on B after {took:?}");
    tcp_agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_the_edge_serves_what_it_knows_and_refuses_changes() {
    net::init();
    let Some(pg) = postgres::Postgres::start() else { return };
    let pg = std::sync::Arc::new(pg);
    let store = pg.fresh_database();
    let edge = EdgeProc::start(&store, "127.0.0.1", &net::free_port_range(2).to_string()).await;
    let key = std::fs::read_to_string(&edge.admin_key_file).unwrap().trim().to_string();
    let (s, r) = edge.api(&key, "POST", "domains", Some(json!({"name": "blog"}))).await;
    assert!(s.is_success(), "{r}");
    let host = r["hostname"].as_str().unwrap().to_string();
    let (s, k) =
        edge.api(&key, "POST", "tunnel-keys", Some(json!({"domain": host, "protocol": "http"}))).await;
    assert!(s.is_success(), "{k}");
    let backend = net::http_backend().await;
    let secret = k["secret"].as_str().unwrap().to_string();
    let agent =
        TestAgent::start_at(&edge.url(), &edge.ca_file, &secret, Target::http(backend.to_string())).await;
    let client = edge.client();
    assert_eq!(client.get(&host, "/").await.0, StatusCode::OK);

    // Bounded load for the whole outage: requests one after the other.
    let stop = tokio_util::sync::CancellationToken::new();
    let load = tokio::spawn({
        let (client, host, stop) = (client.clone(), host.clone(), stop.clone());
        async move {
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.is_cancelled() {
                match client.get(&host, "/").await {
                    (StatusCode::OK, body) if body == "hello from backend" => ok += 1,
                    _ => failed += 1,
                }
            }
            (ok, failed)
        }
    });

    let down = pg.clone();
    tokio::task::spawn_blocking(move || down.stop()).await.unwrap();
    let (s, err) = edge.api(&key, "POST", "domains", Some(json!({"name": "other"}))).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{err}");
    assert_eq!(err["error"]["code"], "store_unavailable", "{err}");
    assert!(err["error"]["message"].as_str().unwrap().starts_with("the store is unavailable: "), "{err}");
    assert_eq!(client.get(&host, "/").await.0, StatusCode::OK, "still served with PostgreSQL down");
    // An agent that reconnects meanwhile with a key this edge knows is let in.
    let again =
        TestAgent::start_at(&edge.url(), &edge.ca_file, &secret, Target::http(backend.to_string())).await;

    let up = pg.clone();
    tokio::task::spawn_blocking(move || up.start_again()).await.unwrap().unwrap();
    let (s, r) = edge.api(&key, "POST", "domains", Some(json!({"name": "other"}))).await;
    assert_eq!(s, StatusCode::CREATED, "the first change after PostgreSQL is back: {r}");
    stop.cancel();
    let (ok, failed) = load.await.unwrap();
    eprintln!("PostgreSQL stopped and started under load: {ok} requests served, {failed} failed");
    assert_eq!(failed, 0);
    assert!(ok > 0);
    // Nothing acknowledged is lost.
    let (_, list) = edge.api(&key, "GET", "domains", None).await;
    let names: Vec<&str> =
        list["items"].as_array().unwrap().iter().map(|r| r["hostname"].as_str().unwrap()).collect();
    assert_eq!(names, ["blog.edge.test", "other.edge.test"], "{list}");
    again.stop().await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_store_moves_an_sqlite_edge_to_postgres() {
    net::init();
    let Some(pg) = postgres::Postgres::shared() else { return };
    let store = pg.fresh_database();
    let ports = net::free_port_range(2).to_string();
    let sqlite = EdgeProc::start("sqlite", "127.0.0.1", &ports).await;
    let key = std::fs::read_to_string(&sqlite.admin_key_file).unwrap().trim().to_string();
    let (s, r) =
        sqlite.api(&key, "POST", "domains", Some(json!({"name": "blog", "labels": {"ns": "web"}}))).await;
    assert!(s.is_success(), "{r}");
    let (s, k) =
        sqlite.api(&key, "POST", "tunnel-keys", Some(json!({"domain": "blog", "protocol": "http"}))).await;
    assert!(s.is_success(), "{k}");
    let secret = k["secret"].as_str().unwrap().to_string();
    let (s, r) = sqlite.api(&key, "POST", "ports", Some(json!({}))).await;
    assert!(s.is_success(), "{r}");
    let data = sqlite.kill().await;

    let migrate = |to: String| {
        let from = data.path().to_path_buf();
        async move {
            let out = Command::new(BIN)
                .args(["migrate-store", "--from"])
                .arg(from)
                .args(["--to", &to])
                .output()
                .await
                .unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        }
    };
    let (ok, out, err) = migrate(store.clone()).await;
    assert!(ok, "{out} {err}");
    assert!(out.contains("copied 1 API keys, 2 reservations, 1 tunnel keys"), "{out}");
    // Into a database that already holds data: refused.
    let (ok, _, err) = migrate(store.clone()).await;
    assert!(!ok);
    assert!(err.contains("already holds culvert data"), "{err}");

    // An edge on PostgreSQL (a new data dir): the old keys work, the data is there.
    let edge = EdgeProc::start(&store, "127.0.0.1", &ports).await;
    assert!(!edge.admin_key_file.exists(), "the migrated admin key is used, no new one");
    let (s, list) = edge.api(&key, "GET", "domains", None).await;
    assert_eq!(s, StatusCode::OK, "{list}");
    assert_eq!(list["items"][0]["hostname"], "blog.edge.test", "{list}");
    assert_eq!(list["items"][0]["labels"]["ns"], "web", "{list}");
    let (_, ports_list) = edge.api(&key, "GET", "ports", None).await;
    assert_eq!(ports_list["items"].as_array().unwrap().len(), 1, "{ports_list}");
    let backend = net::http_backend().await;
    let agent =
        TestAgent::start_at(&edge.url(), &edge.ca_file, &secret, Target::http(backend.to_string())).await;
    assert_eq!(edge.client().get("blog.edge.test", "/").await, (StatusCode::OK, "hello from backend".into()));
    agent.stop().await;
}
