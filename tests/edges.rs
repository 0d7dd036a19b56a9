//! Several edges with real processes on 127.0.0.1: edges sharing one data
//! directory (one SQLite store in WAL mode, or one PostgreSQL started by the
//! test, the CA and admin key file in the directory) and an agent connected
//! to all of them. How fast an agent is back after an edge outage; a load that loses no
//! request while one edge is killed (SIGKILL) and another restarted (SIGTERM);
//! one edge name resolving to several addresses.

mod support;
use support::net::{self, Proc, field};
use support::postgres;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use culvert::agent::{self, EdgeSet, OnReady, Target, TunnelOptions};
use culvert::tunnel::connect::Dialer;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");

/// An edge process on `dir` (shared by every edge of a test: one store, one CA).
struct Edge {
    proc: Proc,
    dir: PathBuf,
    https: SocketAddr,
    drain_seconds: u64,
    /// `--store` (PostgreSQL), else the SQLite file in `dir`.
    store: Option<String>,
}

impl Edge {
    async fn start(dir: &Path, https: SocketAddr, drain_seconds: u64) -> Edge {
        Edge::start_on(dir, https, drain_seconds, None).await
    }

    async fn start_on(dir: &Path, https: SocketAddr, drain_seconds: u64, store: Option<&str>) -> Edge {
        let mut cmd = Proc::edge_command(dir, &https.to_string(), "127.0.0.1", "");
        cmd.args(["--drain-seconds", &drain_seconds.to_string()]);
        if let Some(url) = store {
            cmd.args(["--store", url]);
        }
        let mut proc = Proc::spawn(&mut cmd);
        let ready = proc.line("culvert edge ready").await;
        let https = field(&ready, "https").parse().unwrap();
        Edge { proc, dir: dir.to_path_buf(), https, drain_seconds, store: store.map(str::to_string) }
    }

    fn url(&self) -> String {
        format!("https://{}", self.https)
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Starts again on the same port and data dir (after it exited).
    async fn restart(&mut self) {
        let store = self.store.clone();
        *self = Edge::start_on(&self.dir.clone(), self.https, self.drain_seconds, store.as_deref()).await;
    }
}

/// `culvert admin ARGS` against `edge`; the output on success.
async fn admin(edge: &Edge, args: &[&str]) -> String {
    let key = std::fs::read_to_string(edge.dir.join("admin.key")).unwrap();
    let out = Command::new(BIN)
        .args(["admin", "--edge", &edge.url(), "--key", key.trim(), "--ca-file"])
        .arg(edge.ca())
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "admin {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Reserves `<name>.edge.test` and makes an http tunnel key; (host, key).
async fn publish(edge: &Edge, name: &str) -> (String, String) {
    let host = admin(edge, &["domain", "reserve", name]).await;
    let key = admin(edge, &["tunnel-key", "create", "--domain", name, "--protocol", "http"]).await;
    (host, key)
}

/// How long after the edge was back (its readiness line) the agent was: after
/// an outage of over a second, in which it probes instead of backing off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_is_back_within_300ms_of_the_edge() {
    net::init();
    // Over the 300 ms asked for: room for a loaded 2-core CI machine running a
    // debug build (the probe interval is at most 200 ms, the handshake on
    // loopback a few ms).
    const SLACK: Duration = Duration::from_millis(150);
    const OUTAGE: Duration = Duration::from_millis(1200);
    let dir = tempfile::tempdir().unwrap();
    // Port 0 first; the restarts bind the port it got.
    let mut edge = Edge::start(dir.path(), "127.0.0.1:0".parse().unwrap(), 0).await;
    let (host, key) = publish(&edge, "back").await;
    let backend = net::http_backend().await;

    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let on_ready: OnReady = Arc::new(move |_| {
        let _ = ready_tx.send(Instant::now());
    });
    let edges = EdgeSet::parse(&[edge.url()]).unwrap();
    let dialer = Dialer {
        edge: edges.first().clone(),
        key,
        agent_id: agent::agent_id(),
        tls: culvert::tls::tunnel_client_config(Some(&edge.ca()), culvert::tls::TunnelCipher::Auto).unwrap(),
        protocol: None,
        version: culvert::tunnel::connect::PROTOCOL_VERSION,
    };
    let shutdown = CancellationToken::new();
    let options = TunnelOptions { stop_on_permanent_error: true, on_ready: Some(on_ready), on_lost: None };
    let target = Target::http(backend.to_string());
    let agent = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { agent::run_edges(dialer, &edges, agent::fixed(target), options, shutdown).await }
    });
    tokio::time::timeout(Duration::from_secs(20), ready_rx.recv()).await.expect("agent connected");

    let mut delays = Vec::new();
    for sig in ["-KILL", "-TERM", "-KILL"] {
        edge.proc.signal(sig);
        edge.proc.exited().await;
        // The outage itself (not a wait for anything): the edge stays down this long.
        tokio::time::sleep(OUTAGE).await;
        while ready_rx.try_recv().is_ok() {}
        edge.restart().await;
        let back = Instant::now();
        let agent_ready = tokio::time::timeout(Duration::from_secs(10), ready_rx.recv())
            .await
            .expect("agent is back")
            .unwrap();
        let delay = agent_ready.saturating_duration_since(back);
        println!("edge down {OUTAGE:?} ({sig}): agent back {delay:?} after the edge's readiness line");
        delays.push(delay);
        let (status, body) = net::HttpsClient { addr: edge.https, ca_file: edge.ca() }.get(&host, "/").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "hello from backend"));
    }
    for d in &delays {
        assert!(*d < Duration::from_millis(300) + SLACK, "agent back only after {d:?}: {delays:?}");
    }
    shutdown.cancel();
    agent.await.unwrap().unwrap();
}

/// Counts of the load.
#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Tried the next edge after a refused connection (the edge was down).
    next_after_refused: AtomicU64,
    /// Tried the next edge after a connection that broke before any response
    /// byte (the edge was killed with the request in flight).
    next_after_reset: AtomicU64,
    /// Answered by edge A, B, C.
    by_edge: [AtomicU64; 3],
    /// Why connections broke (printed).
    resets: std::sync::Mutex<Vec<String>>,
}

impl Counts {
    fn show(&self) -> String {
        let by: Vec<u64> = self.by_edge.iter().map(|n| n.load(Ordering::Relaxed)).collect();
        format!(
            "ok={} failed={} next-edge-after-refused={} next-edge-after-reset={} answered-by-A/B/C={by:?}",
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.next_after_refused.load(Ordering::Relaxed),
            self.next_after_reset.load(Ordering::Relaxed)
        )
    }
}

/// One GET as a client with several A records does it: a new connection to
/// one edge's address, the next address when that one refuses the
/// connection, or breaks before any response byte (a GET is idempotent: RFC
/// 9110 9.2.2 lets clients retry it; browsers do). Each address at most once.
async fn get_via_any(
    addrs: &[SocketAddr],
    first: usize,
    tls: &Arc<rustls::ClientConfig>,
    host: &str,
    counts: &Counts,
) -> Result<(), String> {
    let mut last = String::new();
    for i in 0..addrs.len() {
        let index = (first + i) % addrs.len();
        let addr = addrs[index];
        let tcp = match tokio::net::TcpStream::connect(addr).await {
            Ok(t) => t,
            Err(e) => {
                counts.next_after_refused.fetch_add(1, Ordering::Relaxed);
                last = format!("{addr}: {e}");
                continue;
            }
        };
        let attempt = async {
            let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
            let tls = tokio_rustls::TlsConnector::from(tls.clone()).connect(name, tcp).await?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
            tokio::spawn(conn);
            let req = Request::get("/delay?ms=20").header("host", host).body(Empty::<bytes::Bytes>::new())?;
            let resp = sender.send_request(req).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(resp)
        };
        let resp = match tokio::time::timeout(Duration::from_secs(10), attempt).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                counts.next_after_reset.fetch_add(1, Ordering::Relaxed);
                last = format!("{addr}: {e:?}");
                counts.resets.lock().unwrap().push(last.clone());
                continue;
            }
            Err(_) => return Err(format!("{addr}: no answer in 10 s")),
        };
        // From here on the answer counts: no retry after a response began.
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| format!("{addr}: body: {e}"))?.to_bytes();
        return match status {
            StatusCode::OK => {
                counts.by_edge[index].fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            s => Err(format!("{addr}: {s} {}", String::from_utf8_lossy(&body))),
        };
    }
    Err(format!("every edge failed; last: {last}"))
}

/// Three edges on one store, one agent process connected to all of them, a
/// client spreading GETs over the edges' addresses at a bounded rate: not one
/// request fails while edge A is killed (SIGKILL) and edge B is restarted
/// with SIGTERM (it drains: requests in flight finish, new connections are
/// refused and go to another edge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_fails_while_edges_are_killed_and_restarted() {
    no_request_fails(None).await;
}

/// The same on one PostgreSQL: the name is reserved on edge A once all three
/// run, and B and C serve it from the change feed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_fails_while_edges_are_killed_and_restarted_on_postgres() {
    net::init();
    let Some(pg) = postgres::Postgres::shared() else { return };
    no_request_fails(Some(pg.fresh_database())).await;
}

async fn no_request_fails(store: Option<String>) {
    net::init();
    let dir = tempfile::tempdir().unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let store = store.as_deref();
    let mut a = Edge::start_on(dir.path(), any, 5, store).await;
    // SQLite: B and C read the reservation at their start; PostgreSQL: made
    // on A with B and C running, they learn it from the change feed.
    let published = if store.is_none() { Some(publish(&a, "ha").await) } else { None };
    let mut b = Edge::start_on(dir.path(), any, 5, store).await;
    let c = Edge::start_on(dir.path(), any, 5, store).await;
    let (host, key) = match published {
        Some(p) => p,
        None => publish(&a, "ha").await,
    };
    let backend = net::http_backend().await;

    // Several edges both ways: a repeated flag and a comma list.
    let mut cmd = Command::new(BIN);
    cmd.args(["http", &backend.to_string(), "--edge", &a.url(), "--edge"])
        .arg(format!("{},{}", b.url(), c.url()))
        .args(["--key", &key, "--ca-file"])
        .arg(a.ca());
    let mut agent = Proc::spawn(&mut cmd);
    for _ in 0..3 {
        agent.line("Forwarding").await;
    }

    let addrs = [a.https, b.https, c.https];
    let tls = net::HttpsClient { addr: a.https, ca_file: a.ca() }.tls_config(false);
    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    const WORKERS: usize = 6;
    // Each worker: one request at a time, at most every 25 ms (a bounded load).
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..WORKERS {
        let (tls, host, counts, stop, errors) =
            (tls.clone(), host.clone(), counts.clone(), stop.clone(), errors.clone());
        workers.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            let mut n = w;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                n += 1;
                match get_via_any(&addrs, n % addrs.len(), &tls, &host, &counts).await {
                    Ok(()) => counts.ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        errors.lock().unwrap().push(e);
                        counts.failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        });
    }
    let served = |n: u64| {
        let counts = counts.clone();
        async move {
            net::wait_for("requests served", Duration::from_secs(30), || {
                (counts.ok.load(Ordering::Relaxed) >= n).then_some(())
            })
            .await
        }
    };
    served(50).await;
    println!("before: {}", counts.show());
    // Every edge serves the name (B and C too, where it was not reserved).
    net::wait_for("every edge answered", Duration::from_secs(30), || {
        counts.by_edge.iter().all(|n| n.load(Ordering::Relaxed) > 0).then_some(())
    })
    .await;

    // A dies at once, with requests in flight.
    a.proc.signal("-KILL");
    a.proc.exited().await;
    let after_kill = counts.ok.load(Ordering::Relaxed);
    served(after_kill + 100).await;
    println!("after SIGKILL of edge A: {}", counts.show());

    // B drains and comes back on its port; the agent reconnects to it.
    let broken_before_term = counts.next_after_reset.load(Ordering::Relaxed);
    b.proc.signal("-TERM");
    b.proc.exited().await;
    let broken_by_term = counts.next_after_reset.load(Ordering::Relaxed) - broken_before_term;
    b.restart().await;
    agent.line("Forwarding").await;
    let (after_restart, b_before) =
        (counts.ok.load(Ordering::Relaxed), counts.by_edge[1].load(Ordering::Relaxed));
    served(after_restart + 100).await;
    stop.store(true, Ordering::Relaxed);
    while workers.join_next().await.is_some() {}
    println!("after SIGTERM and restart of edge B: {}", counts.show());
    println!("broken connections (retried on the next edge): {:?}", counts.resets.lock().unwrap());

    let errors = errors.lock().unwrap();
    assert_eq!(counts.failed.load(Ordering::Relaxed), 0, "failed requests: {errors:?}");
    assert!(counts.next_after_refused.load(Ordering::Relaxed) > 0, "the client met the dead edge");
    assert!(counts.by_edge[1].load(Ordering::Relaxed) > b_before, "B serves again after its restart");
    // The drain closed no connection unanswered: the requests B had accepted
    // (in flight, on their way, in its listen backlog) were served.
    assert_eq!(broken_by_term, 0, "connections B's drain broke: {:?}", counts.resets.lock().unwrap());
    drop(c);
}

/// One edge name with several addresses (a private /etc/hosts in a mount
/// namespace of the agent process: `edge.test` is 127.0.0.2 and 127.0.0.3,
/// where two edges listen on one port): one connection to each address, the
/// name kept for TLS. Needs root and unshare(1); skipped elsewhere (not in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_name_with_two_addresses_is_two_edges() {
    net::init();
    let probe = std::process::Command::new("unshare").args(["-m", "true"]).status();
    if !probe.is_ok_and(|s| s.success()) {
        assert!(std::env::var_os("CI").is_none(), "unshare -m is needed in CI");
        return eprintln!("skipping: cannot create a mount namespace (needs root and unshare)");
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.2:0").unwrap().local_addr().unwrap().port();
    // The control API on 127.0.0.1 (the self-signed certificate has that
    // address, not 127.0.0.2 and .3); the two edges of the name share its store.
    let api = Edge::start(dir.path(), "127.0.0.1:0".parse().unwrap(), 0).await;
    let (host, key) = publish(&api, "named").await;
    let a = Edge::start(dir.path(), SocketAddr::from(([127, 0, 0, 2], port)), 0).await;
    let b = Edge::start(dir.path(), SocketAddr::from(([127, 0, 0, 3], port)), 0).await;
    let backend = net::http_backend().await;

    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, format!("127.0.0.2 {0}\n127.0.0.3 {0}\n", net::DOMAIN)).unwrap();
    let script = format!(
        "mount --bind {} /etc/hosts && exec {BIN} http {backend} --edge https://{}:{port} --key {key} --ca-file {}",
        hosts.display(),
        net::DOMAIN,
        a.ca().display()
    );
    let mut agent = Proc::spawn(Command::new("unshare").args(["-m", "sh", "-c", &script]));
    agent.line("Forwarding").await;
    agent.line("Forwarding").await;
    // Both edges of the name route to it; the third has no connection.
    for edge in [&a, &b] {
        let (status, body) = net::HttpsClient { addr: edge.https, ca_file: edge.ca() }.get(&host, "/").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "hello from backend"), "via {}", edge.https);
    }
}

/// The control-API client of the operator (and of `culvert admin`) with
/// several edges: while the first edge answers it is used; killed, every
/// call (reserving a domain and a port, a tunnel key, a list, a release)
/// goes to the next edge, which has the same store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_calls_fail_over_to_the_next_edge() {
    net::init();
    let dir = tempfile::tempdir().unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut a = Edge::start(dir.path(), any, 0).await;
    let mut b = Edge::start(dir.path(), any, 0).await;
    let key = std::fs::read_to_string(dir.path().join("admin.key")).unwrap();
    let both = format!("{},{}", a.url(), b.url());
    let ca = a.ca();
    let admin = |args: &'static [&'static str]| {
        let (both, key, ca) = (both.clone(), key.clone(), ca.clone());
        async move {
            Command::new(BIN)
                .args(["admin", "--edge", &both, "--key", key.trim(), "--ca-file"])
                .arg(ca)
                .args(args)
                .output()
                .await
                .unwrap()
        }
    };
    let ok = |out: std::process::Output| {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let first = ok(admin(&["domain", "reserve", "over1"]).await);

    a.proc.signal("-KILL");
    a.proc.exited().await;
    let second = ok(admin(&["domain", "reserve", "over2"]).await);
    ok(admin(&["tunnel-key", "create", "--domain", "over2", "--protocol", "http"]).await);
    let port = ok(admin(&["port", "reserve"]).await);
    let listed = ok(admin(&["domain", "list"]).await);
    assert!(listed.contains(&first) && listed.contains(&second), "{listed}");
    let port = port.rsplit(':').next().unwrap().to_string();
    let release = Command::new(BIN)
        .args(["admin", "--edge", &both, "--key", key.trim(), "--ca-file"])
        .arg(&ca)
        .args(["port", "release", &port])
        .output()
        .await
        .unwrap();
    ok(release);

    // Every edge down: the error says it could not reach them.
    b.proc.signal("-KILL");
    b.proc.exited().await;
    let out = admin(&["domain", "reserve", "over3"]).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed to reach"), "{err}");
}
