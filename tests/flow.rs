//! Flow control and memory bounds of the tunnel's data path, end to end over
//! real sockets on 127.0.0.1: public clients that stop reading cannot stall
//! the other requests of a tunnel, and an agent that floods the edge with
//! control frames or stops reading cannot make the edge's memory grow without
//! bound.

mod support;
use support::net;
use support::watch::{self, Bounds, Proc, Watch};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use culvert::agent::Target;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use net::{TestAgent, TestEdge};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The tests measure this process's memory: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn published() -> (TestEdge, String, TestAgent) {
    let edge = TestEdge::start().await;
    let backend = net::http_backend().await;
    let (host, key) = edge.http_tunnel_key("app").await;
    let agent = TestAgent::start(&edge, &key, Target::http(backend.to_string())).await;
    (edge, host, agent)
}

/// GETs `n` bytes on a fresh connection; `None` if it did not finish within `limit`.
async fn download(edge: &TestEdge, host: &str, n: u64, h2: bool, limit: Duration) -> Option<u64> {
    let client = edge.client();
    let host = host.to_string();
    tokio::time::timeout(limit, async move {
        let req = Request::get(format!("/bytes?n={n}")).body(Full::new(Bytes::new())).unwrap();
        let resp = client.send(&host, req, h2).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.into_body().collect().await.unwrap().to_bytes().len() as u64
    })
    .await
    .ok()
}

/// Issue 18 item 1: response data for public clients that do not read used
/// to fill the tunnel's single HTTP/2 connection window, after which every
/// other request to the name got its headers and then no body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_reading_do_not_stall_the_tunnel() {
    let _serial = SERIAL.lock().await;
    const BIG: u64 = 1 << 30;
    let (edge, host, _agent) = published().await;
    let client = edge.client();
    let (bystander, _bystander) = watch::bystander(&edge, "bystander").await;
    let watch = Watch::start("clients that stop reading", &client, &bystander, Proc::This).await;

    // One h2 connection that never opens its stream windows, ten downloads.
    let tls = client.connect(&host, true).await;
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(0)
        .initial_connection_window_size(65_535)
        .handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut held = Vec::new();
    for _ in 0..10 {
        let mut sender = sender.clone();
        let req =
            Request::get(format!("https://{host}/bytes?n={BIG}")).body(Full::new(Bytes::new())).unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        held.push(resp);
    }
    // Twenty HTTP/1.1 downloads whose clients read the first bytes, then stop.
    let mut stalled = Vec::new();
    for _ in 0..20 {
        let mut tls = client.connect(&host, false).await;
        let head = format!("GET /bytes?n={BIG} HTTP/1.1\r\nhost: {host}\r\n\r\n");
        tls.write_all(head.as_bytes()).await.unwrap();
        let mut first = [0u8; 12];
        tls.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        stalled.push(tls);
    }

    // Every other request keeps getting its whole body, promptly.
    for i in 0..10 {
        let t = std::time::Instant::now();
        let got = download(&edge, &host, 1 << 20, i % 2 == 1, Duration::from_secs(10)).await;
        assert_eq!(got, Some(1 << 20), "request {i} stalled behind the clients that do not read");
        eprintln!("probe {i}: {:?}", t.elapsed());
    }
    // The test's own 31 connections count in this process too (both ends).
    watch.check(Bounds { latency: Duration::from_secs(1), rss_mib: 128, fds: 128 }).await;
    drop((held, stalled));
}

/// Issue 17: what the edge buffers of responses has an edge-wide bound. Each
/// tunnel stream holds at most its stream window for a public client that
/// does not read, and the edge opens at most `--max-tunnel-streams` streams
/// at once: more requests wait (their clients unread) and go through as
/// soon as a stream ends.
#[tokio::test]
async fn the_edge_opens_at_most_its_stream_limit_and_further_requests_wait_for_one() {
    let _serial = SERIAL.lock().await;
    const BIG: u64 = 1 << 30;
    const LIMIT: usize = 4;
    let edge = TestEdge::start_with(|a| a.max_tunnel_streams = LIMIT).await;
    let backend = net::http_backend().await;
    let (host, key) = edge.http_tunnel_key("app").await;
    let _agent = TestAgent::start(&edge, &key, Target::http(backend.to_string())).await;
    let client = edge.client();

    // LIMIT downloads whose clients read the first bytes, then stop.
    let mut stalled = Vec::new();
    for _ in 0..LIMIT {
        let mut tls = client.connect(&host, false).await;
        let head = format!("GET /bytes?n={BIG} HTTP/1.1\r\nhost: {host}\r\n\r\n");
        tls.write_all(head.as_bytes()).await.unwrap();
        let mut first = [0u8; 12];
        tls.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        stalled.push(tls);
    }
    // Every stream is taken: the next request waits for one.
    let edge = Arc::new(edge);
    let (e, h) = (edge.clone(), host.clone());
    let mut waiting =
        tokio::spawn(async move { download(&e, &h, 1 << 20, false, Duration::from_secs(9)).await });
    let early = tokio::time::timeout(Duration::from_secs(1), &mut waiting).await;
    assert!(early.is_err(), "a request got a stream beyond the limit: {early:?}");
    // One download ends: its stream goes to the waiting request.
    drop(stalled.pop());
    let got = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("served").unwrap();
    assert_eq!(got, Some(1 << 20), "the waiting request got the stream that ended");
    drop(stalled);
}

/// A malicious agent: the WebSocket upgrade with a valid tunnel key, then
/// whatever bytes the test writes to the raw TLS stream.
async fn raw_agent(edge: &TestEdge, key: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let tls = edge.client().connect("edge.test", false).await;
    let mut req = "wss://edge.test/_culvert/v1/connect".into_client_request().unwrap();
    let h = req.headers_mut();
    h.insert("authorization", format!("Bearer {key}").parse().unwrap());
    h.insert("culvert-protocol-version", "1".parse().unwrap());
    let (ws, resp) = tokio_tungstenite::client_async(req, tls).await.expect("tunnel handshake");
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    ws.into_inner()
}

/// A masked WebSocket frame, as an agent (a WebSocket client) sends it.
fn client_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 126);
    let mask = [1, 2, 3, 4];
    let mut f = vec![0x80 | opcode, 0x80 | payload.len() as u8];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Issue 18 item 9: every ping queued a pong and every `goodbye` an ack,
/// with no limit when the agent stops reading (2 M pings added 245 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_floods_pings_and_never_reads_leaves_edge_memory_flat() {
    let _serial = SERIAL.lock().await;
    const PINGS: usize = 500_000;
    let edge = TestEdge::start().await;
    let (_host, key) = edge.http_tunnel_key("app").await;
    let (bystander, _bystander) = watch::bystander(&edge, "bystander").await;
    let watch = Watch::start("a ping flood", &edge.client(), &bystander, Proc::This).await;
    let mut agent = raw_agent(&edge, &key).await;
    let mut burst = Vec::new();
    for i in 0..1000 {
        burst.extend(client_frame(0x9, &[i as u8; 125]));
        if i % 100 == 0 {
            burst.extend(client_frame(0x1, b"goodbye"));
        }
    }
    let before = net::rss_kib();
    for _ in 0..PINGS / 1000 {
        agent.write_all(&burst).await.unwrap();
    }
    agent.flush().await.unwrap();
    let grown_mib = net::rss_kib().saturating_sub(before) / 1024;
    eprintln!("edge grew by {grown_mib} MiB after {PINGS} pings");
    assert!(grown_mib < 24, "{PINGS} unanswered pings grew the edge by {grown_mib} MiB");
    watch.check(Bounds { latency: Duration::from_secs(1), rss_mib: 32, fds: 16 }).await;
    drop(agent);
}

/// Reads until `stop` is set, then never again (writes go through).
struct StopReading<S> {
    inner: S,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StopReading<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.stop.load(Ordering::Relaxed) {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StopReading<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Issue 18 item 10: an agent that announces huge HTTP/2 windows and stops
/// reading made the edge hold ~125 KB per upload stream and ~1.5 MiB per
/// upgraded stream, with no overall limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_stops_reading_cannot_make_the_edge_buffer_uploads_without_bound() {
    greedy_agent_cannot_make_the_edge_buffer_uploads_without_bound(1).await;
}

/// The same on the multiplexer (protocol version 2): the agent grants each
/// stream 2 GiB of `Credit` and stops reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_grants_huge_credit_and_stops_reading_cannot_make_the_edge_buffer_uploads() {
    greedy_agent_cannot_make_the_edge_buffer_uploads_without_bound(2).await;
}

/// The largest credit a greedy agent grants: h2's largest window.
const GREEDY: u32 = (1 << 31) - 1;

/// Serves the streams of `io` as a greedy agent of protocol version 1: an
/// HTTP/2 server with the largest windows that answers upgrades with 101
/// and stops reading (sets `stop`) once `total` streams arrived (`all_in`).
fn greedy_h2_agent<S>(io: StopReading<S>, total: usize, all_in: Arc<tokio::sync::Notify>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (stop, arrived) = (io.stop.clone(), Arc::new(AtomicUsize::new(0)));
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let upgrade = req.headers().get("culvert-stream").is_some_and(|v| v == "upgrade");
        if arrived.fetch_add(1, Ordering::SeqCst) + 1 == total {
            stop.store(true, Ordering::SeqCst);
            all_in.notify_one();
        }
        async move {
            let _body = req.into_body();
            if !upgrade {
                std::future::pending::<()>().await;
            }
            let never = http_body_util::StreamBody::new(futures_util::stream::pending::<
                Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
            >());
            let resp = http::Response::builder().header("culvert-status", "101").body(never).unwrap();
            Ok::<_, std::convert::Infallible>(resp)
        }
    });
    tokio::spawn(
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(GREEDY)
            .initial_connection_window_size(GREEDY)
            .max_concurrent_streams(10_000)
            .serve_connection(TokioIo::new(io), service),
    );
}

/// The same as [`greedy_h2_agent`] on the multiplexer (protocol version 2),
/// in raw frames: each stream the edge opens gets [`GREEDY`] bytes of
/// `Credit`, and an upgrade its 101 head.
fn greedy_mux_agent<S>(io: StopReading<S>, total: usize, all_in: Arc<tokio::sync::Notify>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    use culvert::tunnel::{head, mux::frame::Frame};
    let stop = io.stop.clone();
    let (mut rd, mut wr) = tokio::io::split(io);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Frame>();
    tokio::spawn(async move {
        let (mut buf, mut arrived) = (bytes::BytesMut::new(), 0);
        while rd.read_buf(&mut buf).await.is_ok_and(|n| n > 0) {
            while let Some(frame) = Frame::decode(&mut buf).expect("the edge speaks the protocol") {
                let Frame::Open { stream, header, .. } = frame else { continue };
                let req = head::decode_request(&header).expect("a request head");
                tx.send(Frame::Credit { stream, bytes: GREEDY }).unwrap();
                if req.headers.get("culvert-stream").is_some_and(|v| v == "upgrade") {
                    let (ok, ()) = http::Response::builder()
                        .header("culvert-status", "101")
                        .body(())
                        .unwrap()
                        .into_parts();
                    tx.send(Frame::Head { stream, fin: false, block: head::encode_response(&ok) }).unwrap();
                }
                arrived += 1;
                if arrived == total {
                    stop.store(true, Ordering::SeqCst);
                    all_in.notify_one();
                }
            }
        }
    });
    tokio::spawn(async move {
        let mut out = bytes::BytesMut::new();
        while let Some(frame) = rx.recv().await {
            frame.encode(&mut out);
            if wr.write_all(&out.split()).await.is_err() {
                return;
            }
        }
        std::future::pending::<()>().await
    });
}

async fn greedy_agent_cannot_make_the_edge_buffer_uploads_without_bound(version: u32) {
    let _serial = SERIAL.lock().await;
    const UPLOADS: usize = 100;
    const UPGRADES: usize = 300;
    let edge = TestEdge::start().await;
    let (host, key) = edge.http_tunnel_key("app").await;
    let (bystander, _bystander) = watch::bystander(&edge, "bystander").await;

    // The agent: a real handshake, then a server that grants the most it
    // can, answers upgrades with 101 and stops reading once every stream
    // arrived.
    let dialer = culvert::tunnel::connect::Dialer { agent_id: "greedy".into(), version, ..edge.dialer(&key) };
    let connected = dialer.connect().await.expect("tunnel handshake");
    assert_eq!(connected.wire, culvert::tunnel::Wire::of_version(version));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let all_in = Arc::new(tokio::sync::Notify::new());
    let io = StopReading { inner: connected.stream, stop };
    match version {
        1 => greedy_h2_agent(io, UPLOADS + UPGRADES, all_in.clone()),
        _ => greedy_mux_agent(io, UPLOADS + UPGRADES, all_in.clone()),
    }
    connected.control.ready().await;

    // Every client connects and sends its head, then waits for `go`.
    let written = Arc::new(AtomicU64::new(0));
    let client = edge.client();
    let chunk = Bytes::from(vec![b'u'; 16 * 1024]);
    let (go_tx, go) = tokio::sync::watch::channel(false);
    for i in 0..UPLOADS + UPGRADES {
        let (client, host, chunk, written) = (client.clone(), host.clone(), chunk.clone(), written.clone());
        let mut go = go.clone();
        tokio::spawn(async move {
            // The clients' own TLS and socket buffers stay small: the edge's
            // are measured.
            let mut tls = client.connect_with_send_buffer(&host, 64 * 1024).await;
            tls.get_mut().1.set_buffer_limit(Some(16 * 1024));
            if i < UPLOADS {
                let head =
                    format!("POST /upload HTTP/1.1\r\nhost: {host}\r\ncontent-length: 1073741824\r\n\r\n");
                tls.write_all(head.as_bytes()).await.unwrap();
            } else {
                let head = format!(
                    "GET /ws HTTP/1.1\r\nhost: {host}\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
                );
                tls.write_all(head.as_bytes()).await.unwrap();
                let mut first = [0u8; 12];
                tls.read_exact(&mut first).await.unwrap();
                assert_eq!(&first, b"HTTP/1.1 101");
            }
            let _ = go.wait_for(|go| *go).await;
            while tls.write_all(&chunk).await.is_ok() {
                written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        });
    }
    tokio::time::timeout(Duration::from_secs(60), all_in.notified())
        .await
        .expect("every stream reached the agent");
    // From here the agent holds every stream and reads nothing, and the
    // clients write what they can.
    let watch = Watch::start("an agent that stops reading", &edge.client(), &bystander, Proc::This).await;
    let before = net::rss_kib();
    go_tx.send(true).unwrap();
    // Until the clients' writes stop moving: the edge holds what it holds.
    let mut last = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = written.load(Ordering::Relaxed);
        if now == last {
            break;
        }
        last = now;
    }
    let grown_mib = net::rss_kib().saturating_sub(before) / 1024;
    let held = edge.edge().registry.upload_bytes_held() >> 20;
    eprintln!("edge grew by {grown_mib} MiB; the clients wrote {} MiB; budgets hold {held} MiB", last >> 20);
    // Pre-fix: ~125 KB per upload and ~1.5 MiB per upgrade, without limit.
    // Now: the tunnel's budget, and what each public connection costs
    // anyway (TLS and HTTP/1.1 read buffers, one chunk waiting for budget).
    assert!(
        grown_mib < 16 + (UPLOADS + UPGRADES) as u64 / 4,
        "{UPLOADS} uploads and {UPGRADES} upgrades grew the edge by {grown_mib} MiB"
    );
    // The 400 public clients are in this process: they encrypt ~1.5 GB into
    // the loopback sockets' buffers on the same two threads as the edge
    // (debug build), which slows the other tunnel to 3-4 s at worst here; the
    // edge's own share is what the budgets hold.
    let fds = 64;
    watch.check(Bounds { latency: Duration::from_secs(8), rss_mib: 16 + 400 / 4 + 32, fds }).await;
}
