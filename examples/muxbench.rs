//! `tunnel::mux` against the tunnel's HTTP/2 ends (`tunnel::client`,
//! `tunnel::server`), both ends in this process over a loopback TCP
//! connection (no TLS, no WebSocket: the multiplexers alone). Prints the
//! CPU of the whole process per GB or per request, three runs each:
//!
//! ```sh
//! cargo run -j2 --release --example muxbench -- mux     # one bulk stream, 2 GiB, `send`/`recv`
//! cargo run -j2 --release --example muxbench -- mux --copy  # the same through `write_all`/`read`
//! cargo run -j2 --release --example muxbench -- h2
//! cargo run -j2 --release --example muxbench -- rr-mux  # a stream per request, 50 at once
//! cargo run -j2 --release --example muxbench -- rr-h2
//! cargo run -j2 --release --example muxbench -- rr-h1   # HTTP/1.1 by hyper on a mux stream per connection
//! cargo run -j2 --release --example muxbench -- rr-head # a stream per request, heads as HTTP/1.1 text (httparse)
//! ```

use bytes::Bytes;
use culvert::tunnel::stream::RecvBody;
use culvert::tunnel::{client, mux, server};
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::Frame;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Body = UnsyncBoxBody<Bytes, culvert::BoxError>;

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

/// Both ends of a multiplexed connection over `sockets()`, driven: the
/// edge's handle and the agent's incoming streams.
async fn mux_ends() -> (mux::Handle, mux::Incoming) {
    let (a, b) = sockets().await;
    let (edge, _, c1) = mux::new(a, mux::Side::Edge, mux::Config::default());
    let (_, agent, c2) = mux::new(b, mux::Side::Agent, mux::Config::default());
    tokio::spawn(c1);
    tokio::spawn(c2);
    (edge, agent)
}

/// The request of the request/response modes (`with_host`: as HTTP/1 sends
/// it, the authority in `host`).
fn request(with_host: bool) -> http::request::Builder {
    let b = if with_host {
        Request::post("/index.html").header("host", "app.example.com")
    } else {
        Request::post("https://app.example.com/index.html")
    };
    b.header("user-agent", "wrk")
        .header("x-forwarded-for", "127.0.0.1")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "app.example.com")
}

/// The answer of the request/response modes: 500 bytes after this head.
fn answer() -> http::response::Builder {
    Response::builder()
        .header("content-type", "text/html")
        .header("server", "nginx")
        .header("date", "Sat, 05 Dec 2026 22:00:00 GMT")
}

static ANSWER: [u8; 500] = [b'r'; 500];

async fn run_mux() {
    let (edge, mut agent) = mux_ends().await;
    let mut s = edge.open(Bytes::new()).await.unwrap();
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
        let n = if copy {
            r.read(&mut buf).await.unwrap()
        } else {
            // As the h2 mode's reader: the bytes as they arrived.
            r.recv().await.unwrap().map_or(0, |b| b.len())
        };
        if n == 0 {
            break;
        }
        got += n;
    }
    assert_eq!(got, TOTAL);
    drop(w.await.unwrap());
}

/// The tunnel's own HTTP/2 ends, the edge's (`tunnel::client`) and the
/// agent's (`tunnel::server`, answering with `service`), over `sockets()`.
async fn h2_ends<S, F>(service: S) -> client::Sender
where
    S: FnMut(Request<RecvBody>) -> F + Send + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let (a, b) = sockets().await;
    tokio::spawn(async move { server::serve(b, service, std::future::pending()).await.unwrap() });
    let (sender, conn) = client::handshake(a).await.unwrap();
    tokio::spawn(conn);
    sender
}

/// The data bytes of a body, read to its end.
async fn drain(mut body: impl hyper::body::Body<Data = Bytes, Error: std::fmt::Debug> + Unpin) -> usize {
    let mut n = 0;
    while let Some(frame) = body.frame().await {
        n += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    n
}

fn full(data: &'static [u8]) -> Body {
    Full::new(Bytes::from_static(data)).map_err(|never| match never {}).boxed_unsync()
}

async fn run_h2() {
    let sender = h2_ends(|req: Request<RecvBody>| async move {
        assert_eq!(drain(req.into_body()).await, TOTAL);
        Response::new(full(b""))
    })
    .await;
    let chunk = Bytes::from(vec![1u8; CHUNK]);
    let chunks = futures_util::stream::iter((0..TOTAL / CHUNK).map(move |_| Ok(Frame::data(chunk.clone()))));
    let body = StreamBody::new(chunks).boxed_unsync();
    let resp = sender.send(Request::post("https://app.example.com/").body(body).unwrap()).await.unwrap();
    drain(resp.into_body()).await;
}

const RR: usize = 100_000;
const CONC: usize = 50;

/// Request/response: a stream per request, 50 at once; the request a
/// 300-byte head, the response a 500-byte one (HTTP/1.1 bytes).
async fn rr_mux() {
    let (edge, mut agent) = mux_ends().await;
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
                let mut s = edge.open(Bytes::from_static(b"http")).await.unwrap();
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

/// The same through the tunnel's HTTP/2 ends: a head of a few fields, the
/// body as DATA.
async fn rr_h2() {
    let sender = h2_ends(|req: Request<RecvBody>| async move {
        drain(req.into_body()).await;
        answer().body(full(&ANSWER)).unwrap()
    })
    .await;
    let sender = std::sync::Arc::new(sender);
    let mut tasks = Vec::new();
    for _ in 0..CONC {
        let sender = sender.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..RR / CONC {
                let req = request(false).header("culvert-stream", "http").body(full(&[b'q'; 100])).unwrap();
                let resp = sender.send(req).await.unwrap();
                assert_eq!(drain(resp.into_body()).await, 500);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// HTTP/1.1 on the mux: a stream per connection (50), hyper's HTTP/1
/// client on the edge's end and its server on the agent's, the requests and
/// answers of `rr_h2`: what carrying HTTP as bytes would cost on the streams,
/// before any hand-written parsing.
async fn rr_h1() {
    use hyper_util::rt::TokioIo;
    let (edge, mut agent) = mux_ends().await;
    tokio::spawn(async move {
        while let Some(s) = agent.accept().await {
            let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                drain(req.into_body()).await;
                answer().body(full(&ANSWER))
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(s), service),
            );
        }
    });
    let mut tasks = Vec::new();
    for _ in 0..CONC {
        let s = edge.open(Bytes::from_static(b"http")).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await.unwrap();
            tokio::spawn(conn);
            for _ in 0..RR / CONC {
                let req = request(true).body(full(&[b'q'; 100])).unwrap();
                sender.ready().await.unwrap();
                let resp = sender.send_request(req).await.unwrap();
                assert_eq!(drain(resp.into_body()).await, 500);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// HTTP on the mux as protocol version 2 carries it, a stream per request:
/// the request head as HTTP/1.1 text in the stream's `Open`, the response
/// head in a `Head` frame (both by `tunnel::head`, parsed into `http` parts
/// by httparse), the bodies as the stream's bytes.
async fn rr_head() {
    use culvert::tunnel::head;
    let (edge, mut agent) = mux_ends().await;
    tokio::spawn(async move {
        while let Some(mut s) = agent.accept().await {
            tokio::spawn(async move {
                let req = head::decode_request(s.header()).unwrap();
                assert_eq!(req.uri.path(), "/index.html");
                let mut n = 0;
                while let Some(b) = s.recv().await.unwrap() {
                    n += b.len();
                }
                assert_eq!(n, 100);
                let (resp, ()) = answer().header("content-length", "500").body(()).unwrap().into_parts();
                s.send_head(head::encode_response(&resp), false).await.unwrap();
                s.send(Bytes::from_static(&ANSWER)).await.unwrap();
                s.shutdown().await.unwrap();
            });
        }
    });
    let mut tasks = Vec::new();
    for _ in 0..CONC {
        let edge = edge.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..RR / CONC {
                let (req, ()) = request(false).header("content-length", "100").body(()).unwrap().into_parts();
                let mut s = edge.open(head::encode_request(&req, &head::Fields::default())).await.unwrap();
                s.send(Bytes::from_static(&[b'q'; 100])).await.unwrap();
                s.shutdown().await.unwrap();
                let Some(mux::Chunk::Head(block)) = s.recv_chunk().await.unwrap() else { panic!("no head") };
                assert_eq!(head::decode_response(&block).unwrap().headers.len(), 4);
                let mut n = 0;
                while let Some(b) = s.recv().await.unwrap() {
                    n += b.len();
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
        // On a worker, as the edge's and agent's tasks are: a future that
        // `block_on` runs itself is woken across threads.
        let mode = which.clone();
        rt.block_on(async move {
            tokio::spawn(async move {
                match mode.as_str() {
                    "h2" => run_h2().await,
                    "mux" => run_mux().await,
                    "rr-h2" => rr_h2().await,
                    "rr-h1" => rr_h1().await,
                    "rr-head" => rr_head().await,
                    _ => rr_mux().await,
                }
            })
            .await
            .unwrap()
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
