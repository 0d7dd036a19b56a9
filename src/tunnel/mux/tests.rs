//! Both ends of a connection over an in-memory pipe, each driven by its
//! own task. Paused time: "does not move" is a timeout that fires once
//! every task is idle, not a wait.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

use super::frame::{self, Frame};
use super::*;

const SMALL: Config = Config { window: 64 * 1024, max_streams: 8 };

struct Pair {
    edge: Handle,
    agent: Incoming,
    edge_incoming: Option<Incoming>,
    edge_conn: JoinHandle<io::Result<()>>,
    agent_conn: JoinHandle<io::Result<()>>,
    agent_handle: Handle,
}

fn pair(config: Config) -> Pair {
    pair_of(config, config)
}

/// A pair whose ends do not agree.
fn pair_of(edge_config: Config, agent_config: Config) -> Pair {
    let (a, b) = tokio::io::duplex(256 * 1024);
    let (edge, edge_incoming, edge_conn) = new(a, Side::Edge, edge_config);
    let (agent_handle, agent, agent_conn) = new(b, Side::Agent, agent_config);
    Pair {
        edge,
        agent,
        edge_incoming: Some(edge_incoming),
        edge_conn: tokio::spawn(edge_conn),
        agent_conn: tokio::spawn(agent_conn),
        agent_handle,
    }
}

/// A pattern whose every offset is telling.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// Runs a test's body; a body that hangs fails (paused time: at once).
async fn within<F: Future<Output = ()>>(body: F) {
    tokio::time::timeout(Duration::from_secs(600), body).await.expect("the test hung");
}

async fn stalls<F: Future>(f: F) -> bool {
    tokio::time::timeout(Duration::from_secs(5), f).await.is_err()
}

/// Bytes both ways, in order, then a half-close each way: each side reads
/// the end and can still write until its own shutdown.
#[tokio::test(start_paused = true)]
async fn a_stream_carries_bytes_both_ways_and_half_closes() {
    within(async {
        let mut p = pair(Config::default());
        let mut out = p.edge.open(Bytes::from_static(b"tcp 127.0.0.1:80")).await.unwrap();
        let up = pattern(1 << 20, 1);
        let writer = tokio::spawn({
            let up = up.clone();
            async move {
                out.write_all(&up).await.unwrap();
                out.shutdown().await.unwrap();
                let mut down = Vec::new();
                out.read_to_end(&mut down).await.unwrap();
                down
            }
        });
        let mut inc = p.agent.accept().await.unwrap();
        assert_eq!(inc.header(), &Bytes::from_static(b"tcp 127.0.0.1:80"));
        assert_eq!(inc.id() % 2, 1, "the edge opens odd streams");
        let mut got = Vec::new();
        inc.read_to_end(&mut got).await.unwrap();
        assert!(got == up, "the upload arrived whole and in order");
        // Half-closed by the edge: the agent still answers.
        let down = pattern(300_000, 7);
        inc.write_all(&down).await.unwrap();
        inc.shutdown().await.unwrap();
        assert!(writer.await.unwrap() == down);
        drop(inc);
        assert_eq!(p.edge.streams(), 0, "a stream closed both ways and dropped is gone");
    })
    .await;
}

/// `send` and `recv` carry buffers as they lie, cut into frames by credit:
/// the same bytes arrive as through `write_all` and `read`, and a spent
/// credit waits.
#[tokio::test(start_paused = true)]
async fn send_carries_buffers_without_a_copy() {
    within(async {
        let mut p = pair(SMALL);
        let mut s = p.edge.open(Bytes::new()).await.unwrap();
        let mut inc = p.agent.accept().await.unwrap();
        let data = Bytes::from(pattern(3 << 20, 9));
        let (sent, got) = tokio::join!(
            async {
                s.send(data.slice(..1000)).await.unwrap();
                s.send(data.slice(1000..)).await.unwrap();
                s.shutdown().await.unwrap();
            },
            async {
                let mut got = Vec::new();
                while let Some(chunk) = inc.recv().await.unwrap() {
                    assert!(chunk.len() <= frame::MAX_PAYLOAD);
                    got.extend_from_slice(&chunk);
                }
                got
            }
        );
        let () = sent;
        assert!(got == data, "the bytes arrived whole and in order");
        let mut held = p.edge.open(Bytes::new()).await.unwrap();
        let _unread = p.agent.accept().await.unwrap();
        held.send(Bytes::from(vec![0; SMALL.window as usize])).await.unwrap();
        assert!(stalls(held.send(Bytes::from_static(b"x"))).await, "no more than the credit");
    })
    .await;
}

/// Many streams at once, written in small pieces that interleave on the
/// wire: each arrives whole, in its own order.
#[tokio::test(start_paused = true)]
async fn interleaved_streams_keep_their_order() {
    within(async {
        let mut p = pair(Config::default());
        let mut writers = Vec::new();
        for i in 0..20u8 {
            let mut s = p.edge.open(Bytes::from(vec![i])).await.unwrap();
            writers.push(tokio::spawn(async move {
                for chunk in pattern(200_000, i).chunks(1000 + i as usize * 37) {
                    s.write_all(chunk).await.unwrap();
                    tokio::task::yield_now().await;
                }
                s.shutdown().await.unwrap();
                let mut rest = Vec::new();
                s.read_to_end(&mut rest).await.unwrap();
            }));
        }
        let mut readers = Vec::new();
        for _ in 0..20 {
            let mut s = p.agent.accept().await.unwrap();
            readers.push(tokio::spawn(async move {
                let i = s.header()[0];
                let mut got = Vec::new();
                s.read_to_end(&mut got).await.unwrap();
                s.shutdown().await.unwrap();
                assert!(got == pattern(200_000, i), "stream {i} arrived whole and in order");
            }));
        }
        for t in writers.into_iter().chain(readers) {
            t.await.unwrap();
        }
    })
    .await;
}

/// An `io` that counts the writes made on it.
struct Counted {
    io: DuplexStream,
    writes: Arc<std::sync::atomic::AtomicUsize>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Streams whose tasks write at the same moment (requests of many public
/// connections, read in one turn of the runtime) go out together: the
/// driver, woken by the first, lets the others queue theirs before it
/// writes ([`Gather`]), where tokio's LIFO slot used to run it after each
/// one, a write per frame. On one worker thread, as a busy runtime runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn frames_queued_in_one_turn_go_out_in_one_write() {
    const STREAMS: usize = 8;
    const ROUNDS: usize = 3 * Gather::PROBE as usize;
    let writes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (a, b) = tokio::io::duplex(1 << 20);
    let (edge, _edge_incoming, edge_conn) =
        new(Counted { io: a, writes: writes.clone() }, Side::Edge, Config::default());
    let (_agent_handle, mut agent, agent_conn) = new(b, Side::Agent, Config::default());
    tokio::spawn(edge_conn);
    tokio::spawn(agent_conn);
    let (go, _) = tokio::sync::broadcast::channel::<()>(1);
    let (arrived, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..STREAMS {
        let mut s = edge.open(Bytes::new()).await.unwrap();
        let mut go = go.subscribe();
        tokio::spawn(async move {
            while go.recv().await.is_ok() {
                s.send(Bytes::from_static(b"a request")).await.unwrap();
            }
        });
        let mut inc = agent.accept().await.unwrap();
        let arrived = arrived.clone();
        tokio::spawn(async move {
            while let Some(chunk) = inc.recv().await.unwrap() {
                arrived.send(chunk.len()).unwrap();
            }
        });
    }
    // The rounds are started from the worker thread itself, as a task that
    // read requests would: all eight streams are woken before any runs. (From
    // the test's own thread, the worker could run the first before the
    // others were woken whenever the machine was busy.)
    let per_round = tokio::spawn(async move {
        let mut per_round = Vec::new();
        for _ in 0..ROUNDS {
            let before = writes.load(std::sync::atomic::Ordering::Relaxed);
            go.send(()).unwrap();
            let mut bytes = 0;
            while bytes < STREAMS * b"a request".len() {
                bytes += arrivals.recv().await.unwrap();
            }
            per_round.push(writes.load(std::sync::atomic::Ordering::Relaxed) - before);
        }
        per_round
    })
    .await
    .unwrap();
    // Once the driver has found that waiting gathers frames, it waits.
    let late = &per_round[ROUNDS - Gather::PROBE as usize..];
    assert!(
        late.iter().sum::<usize>() <= late.len() * 2,
        "{STREAMS} streams' frames of one turn took these writes a round: {per_round:?}"
    );
}

/// The hole h2's connection window left: streams whose readers stop hold
/// back only themselves; another stream on the connection moves 8 MiB.
#[tokio::test(start_paused = true)]
async fn a_reader_that_stops_holds_back_only_its_stream() {
    within(async {
        let mut p = pair(SMALL);
        let mut stuck = Vec::new();
        for _ in 0..5 {
            let mut s = p.edge.open(Bytes::new()).await.unwrap();
            let held = p.agent.accept().await.unwrap(); // never read
            // The stream's credit goes in, then its writes wait.
            s.write_all(&vec![0; SMALL.window as usize]).await.unwrap();
            assert!(stalls(s.write_all(b"one byte more")).await, "a stream writes no more than its credit");
            stuck.push((s, held));
        }
        let mut s = p.edge.open(Bytes::new()).await.unwrap();
        let mut other = p.agent.accept().await.unwrap();
        let data = pattern(8 << 20, 3);
        let (sent, got) = tokio::join!(
            async {
                s.write_all(&data).await.unwrap();
                s.shutdown().await.unwrap();
            },
            async {
                let mut got = Vec::new();
                other.read_to_end(&mut got).await.unwrap();
                got
            }
        );
        let () = sent;
        assert!(got == data);
        // What the stuck streams hold is their window each, no more.
        let held: usize = {
            let shared = lock(&p.agent.shared);
            shared.streams.values().map(|slot| slot.recv.iter().map(Chunk::len).sum::<usize>()).sum()
        };
        assert_eq!(held, 5 * SMALL.window as usize);
        // The held streams still work once read.
        let (mut s, mut held) = stuck.pop().unwrap();
        let mut buf = vec![0; SMALL.window as usize];
        held.read_exact(&mut buf).await.unwrap();
        s.write_all(b"more").await.unwrap();
        let mut more = [0; 4];
        held.read_exact(&mut more).await.unwrap();
        assert_eq!(&more, b"more");
    })
    .await;
}

/// Dropping a stream before it finished resets it: the other end's reads
/// and writes fail (a cancelled request, a closed public connection).
#[tokio::test(start_paused = true)]
async fn dropping_an_unfinished_stream_resets_it() {
    within(async {
        let mut p = pair(Config::default());
        let mut s = p.edge.open(Bytes::new()).await.unwrap();
        s.write_all(b"part of a request").await.unwrap();
        let mut inc = p.agent.accept().await.unwrap();
        let mut buf = [0; 17];
        inc.read_exact(&mut buf).await.unwrap();
        drop(s);
        let e = inc.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        assert!(e.to_string().contains("cancelled"), "{e}");
        let e = inc.write_all(b"answer").await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        drop(inc);
        tokio::task::yield_now().await;
        assert_eq!(p.edge.streams(), 0);
    })
    .await;
}

/// A side that accepts nothing refuses the streams opened to it; more
/// streams than it allows (from a peer that allows itself more) are refused
/// too.
#[tokio::test(start_paused = true)]
async fn streams_nobody_takes_are_refused() {
    within(async {
        let mut p = pair_of(Config { max_streams: SMALL.max_streams + 1, ..SMALL }, SMALL);
        // The agent opens a stream to the edge, whose incoming side is gone.
        drop(p.edge_incoming.take());
        let mut s = p.agent_handle.open(Bytes::new()).await.unwrap();
        assert_eq!(s.id() % 2, 0, "the agent opens even streams");
        let e = s.read(&mut [0; 1]).await.unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        drop(s);

        let mut open = Vec::new();
        for _ in 0..SMALL.max_streams {
            open.push(p.edge.open(Bytes::new()).await.unwrap());
        }
        let mut over = p.edge.open(Bytes::new()).await.unwrap();
        let e = over.read(&mut [0; 1]).await.unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        assert_eq!(p.agent.accept().await.unwrap().id(), 1, "the ones within the limit are taken");
    })
    .await;
}

/// An opener waits while its side holds as many streams as the peer takes,
/// and opens once one of them ends: the peer refuses none.
#[tokio::test(start_paused = true)]
async fn an_opener_waits_for_a_stream_to_end_at_the_limit() {
    within(async {
        let mut p = pair(SMALL);
        let mut open = Vec::new();
        for _ in 0..SMALL.max_streams {
            open.push(p.edge.open(Bytes::new()).await.unwrap());
        }
        let mut next = std::pin::pin!(p.edge.open(Bytes::from_static(b"next")));
        assert!(stalls(next.as_mut()).await, "a stream over the limit waits");
        drop(open.remove(0));
        let mut s = next.await.unwrap();
        s.write_all(b"hello").await.unwrap();
        let mut ids = Vec::new();
        for _ in 0..=SMALL.max_streams {
            ids.push(p.agent.accept().await.unwrap());
        }
        let last = ids.pop().unwrap();
        assert_eq!((last.id(), &last.header()[..]), (17, &b"next"[..]));
        let mut got = [0; 5];
        let mut last = last;
        last.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello", "taken, not refused");
        // An opener waiting when the peer goes away is told so.
        drop(ids);
        let mut more = std::pin::pin!(p.edge.open(Bytes::new()));
        assert!(stalls(more.as_mut()).await);
        p.agent_handle.go_away();
        let e = more.await.err().expect("no stream once the peer goes away");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    })
    .await;
}

/// A drain: after `go_away` the streams open go on, the peer can open no
/// more (its open fails at once; one already on the wire is refused).
#[tokio::test(start_paused = true)]
async fn going_away_finishes_what_is_open_and_takes_nothing_new() {
    within(async {
        let mut p = pair(Config::default());
        let mut open = p.agent_handle.open(Bytes::new()).await.unwrap();
        let mut edge_incoming = p.edge_incoming.take().unwrap();
        let mut taken = edge_incoming.accept().await.unwrap();
        p.edge.go_away();
        // Sent before the GoAway arrived: refused, not lost silently.
        let mut raced = p.agent_handle.open(Bytes::new()).await.unwrap();
        let e = raced.read(&mut [0; 1]).await.unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        let e = p.agent_handle.open(Bytes::new()).await.err().expect("no new stream after GoAway");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        // The stream open before goes on, both ways.
        open.write_all(b"still here").await.unwrap();
        open.shutdown().await.unwrap();
        let mut got = Vec::new();
        taken.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"still here");
        taken.write_all(b"and answered").await.unwrap();
        taken.shutdown().await.unwrap();
        let mut back = Vec::new();
        open.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"and answered");
    })
    .await;
}

/// The connection ending fails what waits on it, with why; nothing hangs.
#[tokio::test(start_paused = true)]
async fn the_connection_ending_fails_its_streams() {
    within(async {
        let mut p = pair(Config::default());
        let mut s = p.edge.open(Bytes::new()).await.unwrap();
        let _inc = p.agent.accept().await.unwrap();
        p.agent_conn.abort();
        let _ = (&mut p.agent_conn).await;
        let e = s.read(&mut [0; 1]).await.unwrap_err();
        assert!(e.to_string().contains("the tunnel connection ended"), "{e}");
        assert!(p.edge_conn.await.unwrap().is_ok(), "the peer went away: the connection ends, cleanly");
        assert!(p.edge.open(Bytes::new()).await.is_err());
        assert!(p.edge_incoming.as_mut().unwrap().accept().await.is_none());
    })
    .await;
}

/// A connection dropped without being driven to its end (the edge cutting
/// a revoked key's tunnel drops it): what waits on it fails at once, nothing
/// opens on it, nothing hangs.
#[tokio::test(start_paused = true)]
async fn dropping_the_connection_fails_its_streams() {
    within(async {
        let mut p = pair(Config::default());
        let mut s = p.edge.open(Bytes::new()).await.unwrap();
        let _inc = p.agent.accept().await.unwrap();
        assert!(!p.edge.is_closed());
        p.edge_conn.abort();
        let _ = (&mut p.edge_conn).await;
        assert!(p.edge.is_closed());
        let e = s.read(&mut [0; 1]).await.unwrap_err();
        assert!(e.to_string().contains("the tunnel connection ended"), "{e}");
        assert!(p.edge.open(Bytes::new()).await.is_err());
        assert!(p.edge_incoming.as_mut().unwrap().accept().await.is_none());
    })
    .await;
}

/// A connection nothing uses anymore writes what it queued and ends.
#[tokio::test(start_paused = true)]
async fn a_connection_nothing_uses_ends() {
    within(async {
        let Pair { edge, agent, edge_incoming, edge_conn, agent_conn, agent_handle } =
            pair(Config::default());
        let mut s = edge.open(Bytes::new()).await.unwrap();
        s.write_all(b"last words").await.unwrap();
        s.shutdown().await.unwrap();
        let mut agent = agent;
        let mut inc = agent.accept().await.unwrap();
        drop((edge, edge_incoming, s));
        let mut got = Vec::new();
        inc.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");
        assert!(edge_conn.await.unwrap().is_ok());
        drop((inc, agent, agent_handle));
        assert!(agent_conn.await.unwrap().is_ok());
    })
    .await;
}

/// A peer that breaks the protocol ends the connection with why.
#[tokio::test(start_paused = true)]
async fn a_peer_that_breaks_the_protocol_is_dropped() {
    within(async {
        let cases: Vec<(Vec<Frame>, &str)> = vec![
            (
                vec![
                    Frame::Open { stream: 1, fin: false, header: Bytes::new() },
                    Frame::Data { stream: 1, fin: false, payload: Bytes::from(vec![0; 40_000]) },
                    Frame::Data { stream: 1, fin: false, payload: Bytes::from(vec![0; 30_000]) },
                ],
                "over its credit",
            ),
            (vec![Frame::Open { stream: 2, fin: false, header: Bytes::new() }], "out of order"),
            (
                vec![
                    Frame::Open { stream: 3, fin: false, header: Bytes::new() },
                    Frame::Open { stream: 1, fin: false, header: Bytes::new() },
                ],
                "out of order",
            ),
            (
                vec![
                    Frame::Open { stream: 1, fin: false, header: Bytes::new() },
                    Frame::Data { stream: 1, fin: true, payload: Bytes::new() },
                    Frame::Data { stream: 1, fin: false, payload: Bytes::from_static(b"x") },
                ],
                "after its end",
            ),
        ];
        for (frames, why) in cases {
            let (mut raw, b) = tokio::io::duplex(1 << 20);
            let (_h, _incoming, conn) = new(b, Side::Agent, SMALL);
            let conn = tokio::spawn(conn);
            let mut wire = BytesMut::new();
            frames.iter().for_each(|f| f.encode(&mut wire));
            raw.write_all(&wire).await.unwrap();
            let e = conn.await.unwrap().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
            assert!(e.to_string().contains(why), "{e} (expected {why})");
        }
        // Not frames at all.
        let (mut raw, b) = tokio::io::duplex(1024);
        let (_h, _incoming, conn) = new(b, Side::Agent, SMALL);
        let conn = tokio::spawn(conn);
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let e = conn.await.unwrap().unwrap_err();
        assert!(e.to_string().contains("unknown frame type"), "{e}");
    })
    .await;
}

/// Pings are answered; credit is granted as the reader consumes, in
/// frames of a quarter of the window, not one per read.
#[tokio::test(start_paused = true)]
async fn pings_are_answered_and_credit_comes_in_quarters() {
    within(async {
        let (mut raw, b): (DuplexStream, DuplexStream) = tokio::io::duplex(1 << 20);
        let (_h, mut incoming, conn) = new(b, Side::Agent, SMALL);
        let _conn = tokio::spawn(conn);
        let mut wire = BytesMut::new();
        Frame::Ping { ack: false, opaque: 42 }.encode(&mut wire);
        Frame::Open { stream: 1, fin: false, header: Bytes::new() }.encode(&mut wire);
        Frame::Data { stream: 1, fin: false, payload: Bytes::from(vec![1; 50_000]) }.encode(&mut wire);
        raw.write_all(&wire).await.unwrap();
        let mut s = incoming.accept().await.unwrap();
        let mut buf = vec![0; 1000];
        for _ in 0..50 {
            s.read_exact(&mut buf).await.unwrap();
        }
        let mut got = BytesMut::new();
        let mut frames = Vec::new();
        while frames.len() < 3 {
            raw.read_buf(&mut got).await.unwrap();
            while let Some(f) = Frame::decode(&mut got).unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(
            frames,
            vec![
                Frame::Ping { ack: true, opaque: 42 },
                Frame::Credit { stream: 1, bytes: 17_000 },
                Frame::Credit { stream: 1, bytes: 17_000 }
            ],
            "a credit frame each time a quarter of the window was read"
        );
        assert!(stalls(raw.read_buf(&mut got)).await, "and no other frame");
        let _ = frame::HEADER;
    })
    .await;
}

/// Header blocks arrive whole and in their place among the bytes; a
/// stream split in two ends when both halves are dropped.
#[tokio::test(start_paused = true)]
async fn header_blocks_and_halves() {
    within(async {
        let mut p = pair(Config::default());
        let (mut r, mut w) =
            p.edge.open(Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n")).await.unwrap().split();
        w.send(Bytes::from_static(b"request body")).await.unwrap();
        w.shutdown().await.unwrap();
        drop(w);
        let mut inc = p.agent.accept().await.unwrap();
        assert_eq!(inc.recv().await.unwrap().unwrap(), Bytes::from_static(b"request body"));
        assert_eq!(inc.recv().await.unwrap(), None);
        inc.send_head(Bytes::from_static(b"HTTP/1.1 200 \r\n\r\n"), false).await.unwrap();
        inc.send(Bytes::from_static(b"answer")).await.unwrap();
        inc.send_head(Bytes::from_static(b"grpc-status: 0\r\n\r\n"), true).await.unwrap();
        assert_eq!(
            r.recv_chunk().await.unwrap(),
            Some(Chunk::Head(Bytes::from_static(b"HTTP/1.1 200 \r\n\r\n")))
        );
        assert_eq!(r.recv_chunk().await.unwrap(), Some(Chunk::Data(Bytes::from_static(b"answer"))));
        // Bytes are what `recv` and `read` take; a header block is not.
        assert_eq!(r.recv().await.unwrap_err().kind(), io::ErrorKind::InvalidData);
        assert_eq!(r.recv_chunk().await.unwrap(), None);
        drop((r, inc));
        while p.edge.streams() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// A side that sent all it had and drops the stream before reading the
/// peer's end resets it with `NO_ERROR`: the peer still reads what was
/// sent, to its end, and its writes stop.
#[tokio::test(start_paused = true)]
async fn an_answer_sent_whole_stands_when_the_rest_is_not_needed() {
    within(async {
        let mut p = pair(Config::default());
        let (mut r, mut w) = p.edge.open(Bytes::new()).await.unwrap().split();
        w.send(Bytes::from(vec![1; 1000])).await.unwrap();
        let mut inc = p.agent.accept().await.unwrap();
        inc.send_head(Bytes::from_static(b"HTTP/1.1 413 \r\n\r\n"), false).await.unwrap();
        inc.send(Bytes::from_static(b"too large")).await.unwrap();
        inc.shutdown().await.unwrap();
        drop(inc);
        assert!(matches!(r.recv_chunk().await.unwrap(), Some(Chunk::Head(_))));
        assert_eq!(r.recv().await.unwrap().unwrap(), Bytes::from_static(b"too large"));
        assert_eq!(r.recv().await.unwrap(), None);
        let refused = loop {
            match w.send(Bytes::from(vec![1; 1000])).await {
                Ok(()) => tokio::task::yield_now().await,
                Err(e) => break e,
            }
        };
        assert_eq!(refused.kind(), io::ErrorKind::ConnectionReset);
        assert!(refused.to_string().contains("needs no more"), "{refused}");
        assert_eq!(std::future::poll_fn(|cx| r.poll_reset(cx)).await, code::NO_ERROR);
    })
    .await;
}

/// Ids an opener gives (ascending, every other) and ids a peer could aim
/// (multiples of a large power of two) spread over a table's buckets, as
/// random hashes would: ~632 of 1024 buckets for 1024 keys.
#[test]
fn stream_ids_spread_over_the_buckets() {
    let hash = IdHash::new();
    let ids = |f: fn(u32) -> u32| (0..1024_u32).map(f).collect::<Vec<u32>>();
    for (what, ids) in
        [("odd", ids(|k| 2 * k + 1)), ("even", ids(|k| 2 * k + 2)), ("sparse", ids(|k| k << 20))]
    {
        let buckets: std::collections::HashSet<u64> =
            ids.iter().map(|&id| hash.hash_one(id) & 1023).collect();
        let n = buckets.len();
        assert!(n > 550, "{what} ids fill {n} of 1024 buckets");
    }
}
