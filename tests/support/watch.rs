//! The abuse suite's bounds (issue 18): while an attack runs, another tunnel
//! keeps answering within a stated latency, and the edge's resident memory
//! and open file descriptors stay under stated bounds.
//!
//! ```ignore
//! let watch = Watch::start("pings", &edge.client(), &bystander, Proc::This).await;
//! // ... the attack ...
//! watch.check(Bounds { latency: Duration::from_secs(1), rss_mib: 64, fds: 64 }).await;
//! ```
//!
//! The other tunnel is probed with `GET /` every 50 ms on one kept-alive
//! HTTP/1.1 connection opened before the attack (an attack may rightly fill
//! the public side's share of descriptors: what was open keeps working).
//! An in-process edge is measured as this process (the test's own clients
//! and agents count too: bounds say so), a `culvert edge` child by its pid.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;

use super::net::HttpsClient;

/// What an attack may cost while it runs.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The slowest answer of the other tunnel.
    pub latency: Duration,
    /// Growth of the edge's resident memory over the baseline, MiB.
    pub rss_mib: u64,
    /// Growth of the edge's open file descriptors over the baseline.
    pub fds: usize,
}

/// Which process the edge is.
#[derive(Debug, Clone, Copy)]
pub enum Proc {
    /// In this process (`TestEdge`).
    This,
    /// A `culvert edge` child.
    Pid(u32),
}

impl Proc {
    fn dir(self) -> String {
        match self {
            Proc::This => "/proc/self".into(),
            Proc::Pid(pid) => format!("/proc/{pid}"),
        }
    }

    /// Resident memory, KiB.
    pub fn rss_kib(self) -> u64 {
        std::fs::read_to_string(format!("{}/status", self.dir()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Open file descriptors.
    pub fn fds(self) -> usize {
        std::fs::read_dir(format!("{}/fd", self.dir())).map(|d| d.count()).unwrap_or(0)
    }
}

#[derive(Default)]
struct Seen {
    latencies: Vec<Duration>,
    failures: Vec<String>,
    rss_max: u64,
    fds_max: usize,
}

/// A running watch: see the module.
pub struct Watch {
    what: String,
    proc_: Proc,
    rss0: u64,
    fds0: usize,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Seen>,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn open(client: &HttpsClient, host: &str) -> Sender {
    let tls = client.connect(host, false).await;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.expect("HTTP/1.1");
    tokio::spawn(conn);
    sender
}

/// One `GET /`: how long the whole answer took, or why it failed.
async fn probe(sender: &mut Sender, host: &str) -> Result<Duration, String> {
    let started = tokio::time::Instant::now();
    let exchange = async {
        sender.ready().await.map_err(|e| format!("connection: {e}"))?;
        let req = Request::get("/").header("host", host).body(Full::new(Bytes::new())).unwrap();
        let resp = sender.send_request(req).await.map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|e| format!("body: {e}"))?.to_bytes();
        match status {
            StatusCode::OK if body.starts_with(b"hello from backend") => Ok(()),
            s => Err(format!("{s}: {}", String::from_utf8_lossy(&body))),
        }
    };
    match tokio::time::timeout(Duration::from_secs(10), exchange).await {
        Ok(Ok(())) => Ok(started.elapsed()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("no answer within 10 s".into()),
    }
}

impl Watch {
    /// Opens the connection to `host` (a tunnel to [`super::net::http_backend`]),
    /// takes the baseline, and probes and samples until [`Watch::check`].
    pub async fn start(what: &str, client: &HttpsClient, host: &str, proc_: Proc) -> Watch {
        let mut sender = open(client, host).await;
        probe(&mut sender, host).await.unwrap_or_else(|e| panic!("{what}: the other tunnel before: {e}"));
        let (rss0, fds0) = (proc_.rss_kib(), proc_.fds());
        let stop = CancellationToken::new();
        let (client, host, stopped) = (client.clone(), host.to_string(), stop.clone());
        let task = tokio::spawn(async move {
            let mut seen = Seen::default();
            loop {
                seen.rss_max = seen.rss_max.max(proc_.rss_kib());
                seen.fds_max = seen.fds_max.max(proc_.fds());
                match probe(&mut sender, &host).await {
                    Ok(took) => seen.latencies.push(took),
                    Err(e) => {
                        seen.failures.push(e);
                        sender = open(&client, &host).await;
                    }
                }
                if stopped.is_cancelled() {
                    return seen; // the last probe ran after the attack
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = stopped.cancelled() => {}
                }
            }
        });
        Watch { what: what.into(), proc_, rss0, fds0, stop, task }
    }

    /// Stops and asserts: every probe answered, the slowest within
    /// `bounds.latency`, memory and descriptors within their growth bounds.
    pub async fn check(self, bounds: Bounds) {
        self.stop.cancel();
        let mut seen = self.task.await.expect("the watch ran");
        seen.rss_max = seen.rss_max.max(self.proc_.rss_kib());
        seen.fds_max = seen.fds_max.max(self.proc_.fds());
        seen.latencies.sort();
        let n = seen.latencies.len();
        let median = seen.latencies.get(n / 2).copied().unwrap_or_default();
        let worst = seen.latencies.last().copied().unwrap_or_default();
        let rss_mib = seen.rss_max.saturating_sub(self.rss0) / 1024;
        let fds = seen.fds_max.saturating_sub(self.fds0);
        let what = &self.what;
        eprintln!(
            "{what}: the other tunnel answered {n} probes (median {median:?}, slowest {worst:?}); \
             the edge grew by {rss_mib} MiB and {fds} descriptors (from {} MiB, {} fds)",
            self.rss0 / 1024,
            self.fds0
        );
        assert!(seen.failures.is_empty(), "{what}: the other tunnel failed: {:?}", seen.failures);
        assert!(n >= 2, "{what}: the other tunnel was probed {n} times");
        assert!(
            worst <= bounds.latency,
            "{what}: the other tunnel took {worst:?} (bound {:?})",
            bounds.latency
        );
        assert!(
            rss_mib <= bounds.rss_mib,
            "{what}: the edge grew by {rss_mib} MiB (bound {})",
            bounds.rss_mib
        );
        assert!(fds <= bounds.fds, "{what}: the edge opened {fds} more descriptors (bound {})", bounds.fds);
    }
}

/// A tunnel of its own to watch: reserves `<name>.edge.test`, starts a
/// backend and an agent; (host, agent).
pub async fn bystander(edge: &super::net::TestEdge, name: &str) -> (String, super::net::TestAgent) {
    let backend = super::net::http_backend().await;
    let (host, key) = edge.http_tunnel_key(name).await;
    let agent =
        super::net::TestAgent::start(edge, &key, culvert::agent::Target::http(backend.to_string())).await;
    (host, agent)
}
