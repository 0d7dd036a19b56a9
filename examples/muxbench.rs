//! Ad hoc: CPU per GB of one stream over loopback TCP, mux against h2.
use bytes::Bytes;
use culvert::tunnel::mux;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const TOTAL: usize = 2 << 30;
const CHUNK: usize = 256 * 1024;

/// CPU seconds of this process so far, user and system.
fn cpu() -> f64 {
    // SAFETY: rusage is plain data; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage of this process.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

async fn sockets() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (b, _) = l.accept().await.unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

async fn run_mux() {
    let (a, b) = sockets().await;
    let (edge, _ei, c1) = mux::new(a, mux::Side::Edge, mux::Config::default());
    let (_ah, mut agent, c2) = mux::new(b, mux::Side::Agent, mux::Config::default());
    tokio::spawn(c1);
    tokio::spawn(c2);
    let mut s = edge.open(Bytes::new()).unwrap();
    let copy = std::env::args().any(|a| a == "--copy");
    let w = tokio::spawn(async move {
        let buf = Bytes::from(vec![1u8; CHUNK]);
        let mut sent = 0;
        while sent < TOTAL {
            if copy {
                s.write_all(&buf).await.unwrap();
            } else {
                s.send(buf.clone()).await.unwrap();
            }
            sent += CHUNK;
        }
        s.shutdown().await.unwrap();
        s
    });
    let mut r = agent.accept().await.unwrap();
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got += n;
    }
    assert_eq!(got, TOTAL);
    drop(w.await.unwrap());
}

async fn run_h2() {
    let (a, b) = sockets().await;
    let server = tokio::spawn(async move {
        let mut conn = h2::server::Builder::new()
            .initial_window_size(256 * 1024)
            .initial_connection_window_size(1 << 30)
            .max_frame_size(64 * 1024 - 1)
            .handshake::<_, Bytes>(b)
            .await
            .unwrap();
        let (req, mut respond) = conn.accept().await.unwrap().unwrap();
        tokio::spawn(async move { while conn.accept().await.is_some() {} });
        let mut body = req.into_body();
        let mut got = 0;
        while let Some(d) = body.data().await {
            let d = d.unwrap();
            got += d.len();
            body.flow_control().release_capacity(d.len()).unwrap();
        }
        assert_eq!(got, TOTAL);
        respond.send_response(http::Response::new(()), true).unwrap();
    });
    let (mut client, conn) = h2::client::Builder::new()
        .initial_window_size(256 * 1024)
        .initial_connection_window_size(1 << 30)
        .max_frame_size(64 * 1024 - 1)
        .handshake::<_, Bytes>(a)
        .await
        .unwrap();
    tokio::spawn(conn);
    let (resp, mut send) =
        client.send_request(http::Request::post("http://x/").body(()).unwrap(), false).unwrap();
    let chunk = Bytes::from(vec![1u8; CHUNK]);
    let mut sent = 0;
    while sent < TOTAL {
        send.reserve_capacity(CHUNK);
        std::future::poll_fn(|cx| send.poll_capacity(cx)).await.unwrap().unwrap();
        let cap = send.capacity().min(CHUNK).min(TOTAL - sent);
        send.send_data(chunk.slice(..cap), false).unwrap();
        sent += cap;
    }
    send.send_data(Bytes::new(), true).unwrap();
    resp.await.unwrap();
    server.await.unwrap();
}

const RR: usize = 100_000;
const CONC: usize = 50;

/// Request/response: a stream per request, 50 at once; the request a
/// 300-byte head, the response a 500-byte one (HTTP/1.1 bytes).
async fn rr_mux() {
    let (a, b) = sockets().await;
    let (edge, _ei, c1) = mux::new(a, mux::Side::Edge, mux::Config::default());
    let (_ah, mut agent, c2) = mux::new(b, mux::Side::Agent, mux::Config::default());
    tokio::spawn(c1);
    tokio::spawn(c2);
    tokio::spawn(async move {
        while let Some(mut s) = agent.accept().await {
            tokio::spawn(async move {
                let mut req = Vec::with_capacity(512);
                s.read_to_end(&mut req).await.unwrap();
                s.write_all(&[b'r'; 500]).await.unwrap();
                s.shutdown().await.unwrap();
            });
        }
    });
    let mut tasks = Vec::new();
    for _ in 0..CONC {
        let edge = edge.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..RR / CONC {
                let mut s = edge.open(Bytes::from_static(b"http")).unwrap();
                s.write_all(&[b'q'; 300]).await.unwrap();
                s.shutdown().await.unwrap();
                let mut resp = Vec::with_capacity(512);
                s.read_to_end(&mut resp).await.unwrap();
                assert_eq!(resp.len(), 500);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// The same over h2 as the tunnel uses it: a head of a few fields, the
/// body as DATA.
async fn rr_h2() {
    let (a, b) = sockets().await;
    tokio::spawn(async move {
        let mut conn = h2::server::Builder::new()
            .initial_window_size(256 * 1024)
            .initial_connection_window_size(1 << 30)
            .max_concurrent_streams(4096)
            .handshake::<_, Bytes>(b)
            .await
            .unwrap();
        while let Some(r) = conn.accept().await {
            let (req, mut respond) = r.unwrap();
            tokio::spawn(async move {
                let mut body = req.into_body();
                while let Some(d) = body.data().await {
                    let d = d.unwrap();
                    body.flow_control().release_capacity(d.len()).unwrap();
                }
                let resp = http::Response::builder()
                    .status(200)
                    .header("content-type", "text/html")
                    .header("content-length", "500")
                    .header("server", "nginx")
                    .header("date", "Sat, 05 Dec 2026 22:00:00 GMT")
                    .body(())
                    .unwrap();
                let mut send = respond.send_response(resp, false).unwrap();
                send.send_data(Bytes::from_static(&[b'r'; 500]), true).unwrap();
            });
        }
    });
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(256 * 1024)
        .initial_connection_window_size(1 << 30)
        .handshake::<_, Bytes>(a)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut tasks = Vec::new();
    for _ in 0..CONC {
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..RR / CONC {
                client = client.ready().await.unwrap();
                let req = http::Request::get("https://app.example.com/index.html")
                    .header("user-agent", "wrk")
                    .header("x-forwarded-for", "127.0.0.1")
                    .header("x-forwarded-proto", "https")
                    .header("x-forwarded-host", "app.example.com")
                    .header("culvert-stream", "http")
                    .body(())
                    .unwrap();
                let (resp, mut send) = client.send_request(req, false).unwrap();
                send.send_data(Bytes::from_static(&[b'q'; 100]), true).unwrap();
                let mut body = resp.await.unwrap().into_body();
                let mut n = 0;
                while let Some(d) = body.data().await {
                    let d = d.unwrap();
                    n += d.len();
                    body.flow_control().release_capacity(d.len()).unwrap();
                }
                assert_eq!(n, 500);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or("mux".into());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for _ in 0..3 {
        let (t, c) = (Instant::now(), cpu());
        rt.block_on(async {
            match which.as_str() {
                "h2" => run_h2().await,
                "mux" => run_mux().await,
                "rr-h2" => rr_h2().await,
                _ => rr_mux().await,
            }
        });
        let (wall, cpu_s) = (t.elapsed().as_secs_f64(), cpu() - c);
        if which.starts_with("rr") {
            println!("{which}: {:.0} req/s, {:.2} CPU µs/req", RR as f64 / wall, cpu_s * 1e6 / RR as f64);
            continue;
        }
        let gb = TOTAL as f64 / 1e9;
        println!("{which}: {:.2} Gbit/s, {:.3} CPU s/GB", gb * 8.0 / wall, cpu_s / gb);
    }
}
