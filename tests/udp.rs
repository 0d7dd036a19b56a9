//! UDP through the tunnel: real UDP sockets on 127.0.0.1, an in-process edge,
//! agents in-process and as `culvert udp`, a real DNS server (BIND) and
//! client (dig).

mod support;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use culvert::agent::Target;
use serde_json::json;
use support::bind::{self, Bind};
use support::net::{self, TestAgent, TestEdge};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::UdpSocket;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");

/// A UDP echo on 127.0.0.1:0: every datagram goes back to its sender.
async fn udp_echo() -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let _ = socket.send_to(&buf[..n], peer).await;
        }
    });
    addr
}

/// Reserves a UDP port and mints a udp tunnel key; returns (port, secret).
async fn udp_tunnel_key(edge: &TestEdge) -> (u16, String) {
    let (s, r) = edge.api("POST", "ports", Some(json!({"protocol": "udp"}))).await;
    assert!(s.is_success(), "reserve udp port: {s} {r}");
    assert_eq!(r["protocol"], "udp", "{r}");
    let port = r["port"].as_u64().unwrap() as u16;
    assert_eq!(r["url"], format!("udp://127.0.0.1:{port}"));
    let (s, k) = edge.api("POST", "tunnel-keys", Some(json!({"port": port, "protocol": "udp"}))).await;
    assert!(s.is_success(), "tunnel key: {s} {k}");
    (port, k["secret"].as_str().unwrap().to_string())
}

/// A client socket connected to the edge's UDP `port`.
async fn client(port: u16) -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    s.connect(("127.0.0.1", port)).await.unwrap();
    s
}

/// Sends `payload` and waits (5 s) for one datagram back.
async fn round_trip(socket: &UdpSocket, payload: &[u8]) -> Vec<u8> {
    socket.send(payload).await.unwrap();
    let mut buf = vec![0u8; 65536];
    let n = tokio::time::timeout(Duration::from_secs(5), socket.recv(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("no answer to a datagram of {} bytes", payload.len()))
        .unwrap();
    buf.truncate(n);
    buf
}

/// Sends `payload` every 50 ms, as a client that never pauses does, until a
/// datagram comes back (`None` if none within `limit`).
async fn keep_sending_until_answered(socket: &UdpSocket, payload: &[u8], limit: Duration) -> Option<Vec<u8>> {
    let answered = async {
        let mut buf = [0u8; 64];
        loop {
            socket.send(payload).await.unwrap();
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(50), socket.recv(&mut buf)).await {
                return buf[..n].to_vec();
            }
        }
    };
    tokio::time::timeout(limit, answered).await.ok()
}

/// The value of an unlabelled (or the first matching) edge metric.
fn metric(edge: &TestEdge, line_start: &str) -> f64 {
    edge.edge()
        .metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with(line_start))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn udp_echo_through_the_tunnel_up_to_the_path_limit() {
    let edge = TestEdge::start().await;
    let echo = udp_echo().await;
    let (port, key) = udp_tunnel_key(&edge).await;
    let _agent = TestAgent::start(&edge, &key, Target::Udp { addr: echo.to_string(), proxy: None }).await;
    let c = client(port).await;
    for size in [1usize, 1400, 8192, 65_507] {
        let payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        assert_eq!(round_trip(&c, &payload).await, payload, "a datagram of {size} bytes");
    }
    // Order and boundaries hold within a flow: ten datagrams, ten answers.
    for i in 0..10u8 {
        c.send(&[i; 100]).await.unwrap();
    }
    let mut buf = [0u8; 200];
    for i in 0..10u8 {
        let n = tokio::time::timeout(Duration::from_secs(5), c.recv(&mut buf)).await.unwrap().unwrap();
        assert_eq!(&buf[..n], &[i; 100]);
    }
    // Larger than IPv4 allows cannot be sent; the edge's flows never saw one.
    assert_eq!(metric(&edge, "culvert_edge_udp_datagrams_dropped_total{"), 0.0);
    assert_eq!(metric(&edge, "culvert_edge_udp_flows "), 1.0);
}

/// TCP and UDP ports are separate spaces: UDP N and TCP N may be held by
/// different keys, each answered and released on its own.
#[tokio::test]
async fn udp_and_tcp_ports_are_separate_reservations() {
    let edge = TestEdge::start().await;
    let key = |name: &'static str| {
        let edge = &edge;
        async move {
            let (s, v) =
                edge.api("POST", "api-keys", Some(json!({"name": name, "scope": "endpoints"}))).await;
            assert!(s.is_success(), "{v}");
            v["secret"].as_str().unwrap().to_string()
        }
    };
    let (a, b) = (key("a").await, key("b").await);
    let port = edge.tcp_ports.first;
    let (s, udp) = edge.api_as(&a, "POST", "ports", Some(json!({"port": port, "protocol": "udp"}))).await;
    assert_eq!(s, 201, "{udp}");
    let (s, tcp) = edge.api_as(&b, "POST", "ports", Some(json!({"port": port}))).await;
    assert_eq!(s, 201, "{tcp}");
    assert!(tcp.get("protocol").is_none(), "tcp is the default and left out: {tcp}");
    let (s, again) = edge.api_as(&b, "POST", "ports", Some(json!({"port": port, "protocol": "udp"}))).await;
    assert_eq!((s.as_u16(), again["error"]["code"].as_str()), (409, Some("already_reserved")), "{again}");
    let (s, v) = edge.api_as(&a, "GET", &format!("ports/{port}?protocol=udp"), None).await;
    assert_eq!((s.as_u16(), &v["id"]), (200, &udp["id"]));
    let (s, _) = edge.api_as(&a, "GET", &format!("ports/{port}"), None).await;
    assert_eq!(s, 403, "the TCP port is b's");
    let (s, list) = edge.api("GET", "ports?protocol=udp", None).await;
    assert_eq!((s.as_u16(), list["items"].as_array().unwrap().len()), (200, 1), "{list}");
    // A udp key needs the UDP reservation; a tcp key the TCP one.
    let (s, k) = edge.api_as(&a, "POST", "tunnel-keys", Some(json!({"port": port, "protocol": "udp"}))).await;
    assert_eq!(s, 201, "{k}");
    assert_eq!(k["reservation"]["protocol"], "udp");
    let (s, _) = edge.api_as(&a, "POST", "tunnel-keys", Some(json!({"port": port, "protocol": "tcp"}))).await;
    assert_eq!(s, 403);
    let (s, v) = edge.api_as(&a, "DELETE", &format!("ports/{port}?protocol=udp"), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["revokedTunnelKeys"].as_array().unwrap().len(), 1);
    let (s, v) = edge.api_as(&b, "GET", &format!("ports/{port}"), None).await;
    assert_eq!(s, 200, "the TCP reservation stays: {v}");
    let (s, v) = edge.api("GET", "ports?protocol=sctp", None).await;
    assert_eq!((s.as_u16(), v["error"]["code"].as_str()), (400, Some("invalid_protocol")));
}

/// Each of many concurrent flows gets its own answers (one backend socket
/// per flow at the agent).
#[tokio::test]
async fn many_flows_at_once_each_get_their_own_answers() {
    let edge = TestEdge::start().await;
    let echo = udp_echo().await;
    let (port, key) = udp_tunnel_key(&edge).await;
    let _agent = TestAgent::start(&edge, &key, Target::Udp { addr: echo.to_string(), proxy: None }).await;
    let flows = 200;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..flows {
        tasks.spawn(async move {
            let c = client(port).await;
            for round in 0..3 {
                let msg = format!("flow {i} round {round}");
                assert_eq!(round_trip(&c, msg.as_bytes()).await, msg.as_bytes());
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert_eq!(metric(&edge, "culvert_edge_udp_flows_started_total"), flows as f64);
}

/// A real DNS exchange: dig asks BIND through the edge and the tunnel.
#[tokio::test]
async fn a_dns_query_through_the_tunnel() {
    let edge = TestEdge::start().await;
    let bind = start_bind().await;
    let (port, key) = udp_tunnel_key(&edge).await;
    let _agent =
        TestAgent::start(&edge, &key, Target::Udp { addr: bind.addr.to_string(), proxy: None }).await;
    let dig = |name: &'static str, kind: &'static str| async move {
        let out = tokio::process::Command::new("dig")
            .args(["+short", "+notcp", "+ignore", "+bufsize=4096", "+tries=1", "+time=5"])
            .args(["-p", &port.to_string(), "@127.0.0.1", name, kind])
            .output()
            .await
            .expect("dig runs (scripts/deps installs dnsutils)");
        assert!(out.status.success(), "dig: {}", String::from_utf8_lossy(&out.stdout));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(dig("www.udp.test", "A").await, "192.0.2.10");
    assert_eq!(dig("udp.test", "TXT").await, "\"through the tunnel\"");
    // Many TXT records: an answer of about 2 KB (EDNS), still one datagram
    // (+ignore: a truncated answer would not be retried over TCP).
    let big = dig("big.udp.test", "TXT").await;
    assert_eq!(big.lines().count(), 40, "{big}");
}

/// A flood of flows and datagrams at a backend that never answers, and an
/// agent that cannot keep up (`culvert udp`, its own process, stopped with
/// SIGSTOP for the second half of the flood): the edge drops what does not
/// fit its queues (counted as `queue_full`), the memory of the edge and the
/// agent stays bounded, and another tunnel keeps answering meanwhile. After
/// it, a reply larger than the tunnel carries (IPv6 allows 65 527 bytes) is
/// dropped by the agent and counted in its `/metrics` (`--metrics-addr`).
#[tokio::test]
async fn a_flood_is_dropped_within_bounded_memory_and_other_tunnels_keep_working() {
    let edge = TestEdge::start().await;
    // Never reads: its receive buffer fills and the kernel drops the rest.
    // On IPv6 loopback where there is one (its datagrams may be larger).
    let sink =
        std::net::UdpSocket::bind("[::1]:0").or_else(|_| std::net::UdpSocket::bind("127.0.0.1:0")).unwrap();
    let (port, key) = udp_tunnel_key(&edge).await;
    let metrics = SocketAddr::from(([127, 0, 0, 1], net::free_port_range(1).first));
    let mut agent = tokio::process::Command::new(BIN)
        .args(["udp", &sink.local_addr().unwrap().to_string(), "--edge", &edge.url()])
        .args(["--metrics-addr", &metrics.to_string()])
        .env("CULVERT_KEY", &key)
        .env("CULVERT_CA_FILE", &edge.ca_file)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("culvert runs");
    let mut lines = BufReader::new(agent.stdout.take().unwrap()).lines();
    let ready = net::line_starting(&mut lines, "Forwarding udp://", Duration::from_secs(30)).await;
    assert!(ready.contains(&format!(":{port} -> udp://")), "{ready}");
    let agent_pid = agent.id().unwrap();
    // The other tunnel: a UDP echo on another reservation.
    let echo = udp_echo().await;
    let (other_port, other_key) = udp_tunnel_key(&edge).await;
    let _other =
        TestAgent::start(&edge, &other_key, Target::Udp { addr: echo.to_string(), proxy: None }).await;
    let other = client(other_port).await;
    assert_eq!(round_trip(&other, b"before").await, b"before");

    let edge_before = net::rss_kib();
    let flows: u32 = 300;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..flows {
        let (stop, sent) = (stop.clone(), sent.clone());
        flood.spawn(async move {
            let c = client(port).await;
            let payload = vec![0x5a; 1400];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..16 {
                    let _ = c.send(&payload).await;
                }
                sent.fetch_add(16, std::sync::atomic::Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        });
    }
    // While the flood runs: the other tunnel answers, memory stays bounded.
    let mut edge_peak = 0;
    let mut agent_peak = 0;
    let mut answered = 0;
    while answered < 60 {
        if answered == 20 {
            // The agent stops reading: its tunnel's windows, the edge's
            // upload budget and then the flows' queues fill.
            // SAFETY: kill(2) on the pid of a child this test spawned.
            assert_eq!(unsafe { libc::kill(agent_pid as i32, libc::SIGSTOP) }, 0);
        }
        let msg = format!("during {answered}");
        // A datagram may be lost on a loaded loopback; five tries.
        let mut ok = false;
        for _ in 0..5 {
            other.send(msg.as_bytes()).await.unwrap();
            let mut buf = [0u8; 64];
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), other.recv(&mut buf)).await
                && &buf[..n] == msg.as_bytes()
            {
                ok = true;
                break;
            }
        }
        assert!(ok, "the other tunnel stopped answering during the flood");
        answered += 1;
        edge_peak = edge_peak.max(net::rss_kib());
        agent_peak = agent_peak.max(rss_of(agent_pid));
    }
    let queued_while_stopped = edge.edge().udp.queued_bytes();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    while let Some(r) = flood.join_next().await {
        r.unwrap();
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(agent_pid as i32, libc::SIGCONT) }, 0);
    let dropped = metric(&edge, "culvert_edge_udp_datagrams_dropped_total{");
    let queue_full =
        metric(&edge, "culvert_edge_udp_datagrams_dropped_total{direction=\"in\",reason=\"queue_full\"}");
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "flood: {sent} datagrams of 1400 bytes in {flows} flows; edge dropped {dropped}; \
         edge RSS {edge_before} -> peak {edge_peak} KiB; agent RSS peak {agent_peak} KiB; \
         other tunnel answered {answered} times; edge queues held {queued_while_stopped} bytes with the \
         agent stopped ({queue_full} dropped as queue_full)",
    );
    assert!(queue_full > 0.0, "a stopped agent fills the flows' queues: the edge drops");
    assert!(queued_while_stopped <= 32 << 20);
    // Bounds: the edge holds at most the tunnel connection's upload budget
    // (16 MiB) and 32 MiB of queues over every flow, plus buffers; the
    // agent one stream window per flow and its own 32 MiB of replies.
    assert!(edge_peak < edge_before + 128 * 1024, "edge RSS grew from {edge_before} to {edge_peak} KiB");
    assert!(agent_peak < 128 * 1024, "agent RSS reached {agent_peak} KiB");
    // Most of the flood never reaches the edge (its socket's buffer is full:
    // the kernel drops); what does starts flows, at most one per client.
    assert!(metric(&edge, "culvert_edge_udp_flows_started_total") <= f64::from(flows + 1));
    assert!(edge.edge().udp.queued_bytes() <= 32 << 20);
    assert_eq!(round_trip(&other, b"after").await, b"after");
    // The agent resumed, catches up within its bound, and its tunnel works:
    // a new flow's datagram reaches the sink.
    let mut buf = [0u8; 8];
    let probe = client(port).await;
    sink.set_nonblocking(true).unwrap();
    let drain = |sink: &std::net::UdpSocket, buf: &mut [u8]| {
        let mut last = None;
        while let Ok((_, from)) = sink.recv_from(buf) {
            last = Some(from);
        }
        last
    };
    drain(&sink, &mut buf);
    let flow = net::wait_for("the resumed agent to carry a new flow", Duration::from_secs(30), || {
        let _ = probe.try_send(b"probe");
        let from = drain(&sink, &mut buf);
        (buf[..5] == *b"probe").then_some(from).flatten()
    })
    .await;
    assert!(rss_of(agent_pid) < 128 * 1024, "agent RSS after catching up: {} KiB", rss_of(agent_pid));
    assert!(agent.try_wait().unwrap().is_none(), "the agent is still running");

    // The agent's drops are exported: during the flood the backend never
    // answered (nothing to drop) ...
    let agent_dropped = |reason: &str| {
        scrape(metrics).lines().find_map(|l| {
            l.strip_prefix(&format!("culvert_agent_udp_replies_dropped_total{{reason=\"{reason}\"}} "))?
                .parse::<f64>()
                .ok()
        })
    };
    assert_eq!(agent_dropped("oversize"), Some(0.0), "exported, nothing dropped yet");
    if flow.is_ipv6() {
        // ... then a reply larger than the tunnel carries is dropped and
        // counted, and the next one reaches the client.
        sink.send_to(&vec![7u8; 65_527], flow).unwrap();
        sink.send_to(b"reply", flow).unwrap();
        let mut got = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), probe.recv(&mut got)).await.unwrap().unwrap();
        assert_eq!(&got[..n], b"reply", "the oversize reply never reaches the client");
        assert_eq!(agent_dropped("oversize"), Some(1.0));
    } else {
        eprintln!("no IPv6 loopback: the agent's oversize drop is not exercised");
    }
    assert_eq!(agent_dropped("queue_full"), Some(0.0), "the backend never answered the flood");
}

/// `GET /metrics` of the standalone agent's `--metrics-addr`.
fn scrape(addr: SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(addr).expect("the agent serves --metrics-addr");
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    tcp.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

/// Resident memory of process `pid` in KiB.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A flow silent for `--udp-idle-timeout-seconds` ends (the metric says
/// `idle`), and the client's next datagram starts a new one.
#[tokio::test]
async fn idle_flows_expire() {
    let edge = TestEdge::start_with(|a| a.udp_idle_timeout_seconds = 1).await;
    let echo = udp_echo().await;
    let (port, key) = udp_tunnel_key(&edge).await;
    let _agent = TestAgent::start(&edge, &key, Target::Udp { addr: echo.to_string(), proxy: None }).await;
    let c = client(port).await;
    assert_eq!(round_trip(&c, b"one").await, b"one");
    assert_eq!(metric(&edge, "culvert_edge_udp_flows "), 1.0);
    net::wait_for("the idle flow to end", Duration::from_secs(20), || {
        (metric(&edge, "culvert_edge_udp_flows_ended_total{reason=\"idle\"}") == 1.0).then_some(())
    })
    .await;
    assert_eq!(metric(&edge, "culvert_edge_udp_flows "), 0.0);
    assert_eq!(round_trip(&c, b"two").await, b"two");
    assert_eq!(metric(&edge, "culvert_edge_udp_flows_started_total"), 2.0);
}

/// A client that starts sending while its tunnel's agent is away, and never
/// pauses (a resolver retrying), is served once the agent is back. It used to
/// stay cut off: its flow, held without an agent, went idle only after a
/// pause of the idle timeout.
#[tokio::test]
async fn a_client_that_never_pauses_is_served_once_the_agent_is_back() {
    let edge = TestEdge::start().await;
    let echo = udp_echo().await;
    let (port, key) = udp_tunnel_key(&edge).await;
    let target = || Target::Udp { addr: echo.to_string(), proxy: None };
    let first = TestAgent::start(&edge, &key, target()).await;
    first.shutdown.cancel();
    let _ = first.task.await;
    net::wait_for("the agent's connection gone", Duration::from_secs(10), || {
        edge.edge().registry.connections().values().all(Vec::is_empty).then_some(())
    })
    .await;
    let c = client(port).await;
    c.send(b"early").await.unwrap();
    net::wait_for("a flow held without an agent", Duration::from_secs(10), || {
        (metric(&edge, "culvert_edge_udp_flows ") == 1.0).then_some(())
    })
    .await;
    let _agent = TestAgent::start(&edge, &key, target()).await;
    let answer = keep_sending_until_answered(&c, b"ping", Duration::from_secs(10)).await;
    assert_eq!(answer.expect("an answer while the client keeps sending"), b"ping");
}

/// A tunnel key rotated under a client that keeps sending (a game, a VoIP
/// call): the old key revoked, its flow ends with its tunnel, and the next
/// datagrams go through the new key's agent. On the multiplexer the flow
/// used to stay on the cut tunnel, its datagrams lost, for as long as the
/// client kept sending.
#[tokio::test]
async fn an_active_flow_moves_to_the_new_key_when_the_old_one_is_revoked() {
    let edge = TestEdge::start().await;
    let echo = udp_echo().await;
    let (port, old_key) = udp_tunnel_key(&edge).await;
    let target = || Target::Udp { addr: echo.to_string(), proxy: None };
    let old = TestAgent::start(&edge, &old_key, target()).await;
    let c = client(port).await;
    assert_eq!(round_trip(&c, b"before").await, b"before");
    let (s, new_key) = edge.api("POST", "tunnel-keys", Some(json!({"port": port, "protocol": "udp"}))).await;
    assert!(s.is_success(), "{new_key}");
    let _new = TestAgent::start(&edge, new_key["secret"].as_str().unwrap(), target()).await;
    let old_id = edge.tunnel_key_id(|k| k["id"] != new_key["id"]).await;
    let (s, body) = edge.api("DELETE", &format!("tunnel-keys/{old_id}"), None).await;
    assert!(s.is_success(), "{body}");
    let answer = keep_sending_until_answered(&c, b"after", Duration::from_secs(5)).await;
    assert_eq!(answer.expect("an answer through the new key while the client keeps sending"), b"after");
    old.stop().await;
}

/// PROXY protocol v2 for UDP: every datagram reaches the backend after a
/// v2 header with the UDP-over-IPv4 protocol byte and the public client's
/// address.
#[tokio::test]
async fn proxy_protocol_v2_before_every_datagram() {
    let edge = TestEdge::start().await;
    let backend = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let (port, key) = udp_tunnel_key(&edge).await;
    let proxy = Some(culvert::agent::ProxyHeader::V2);
    let _agent =
        TestAgent::start(&edge, &key, Target::Udp { addr: backend.local_addr().unwrap().to_string(), proxy })
            .await;
    let c = client(port).await;
    let me = c.local_addr().unwrap();
    let SocketAddr::V4(me4) = me else { panic!("v4") };
    for payload in [&b"first"[..], &b"second"[..]] {
        c.send(payload).await.unwrap();
        let mut buf = [0u8; 256];
        let (n, from) =
            tokio::time::timeout(Duration::from_secs(5), backend.recv_from(&mut buf)).await.unwrap().unwrap();
        let got = &buf[..n];
        assert_eq!(&got[..12], b"\r\n\r\n\0\r\nQUIT\n");
        assert_eq!(&got[12..16], &[0x21, 0x12, 0, 12], "PROXY, UDP over IPv4, 12 address bytes");
        assert_eq!(&got[16..20], &me4.ip().octets());
        assert_eq!(&got[20..24], &[127, 0, 0, 1]);
        assert_eq!(u16::from_be_bytes([got[24], got[25]]), me.port());
        assert_eq!(u16::from_be_bytes([got[26], got[27]]), port);
        assert_eq!(&got[28..], payload);
        // The reply carries no header.
        backend.send_to(b"reply", from).await.unwrap();
        let mut r = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), c.recv(&mut r)).await.unwrap().unwrap();
        assert_eq!(&r[..n], b"reply");
    }
}

/// A real BIND (`named`, Debian's bind9) on 127.0.0.1, authoritative for
/// `udp.test`, with a TXT set (`big`) too large for one 512-byte answer.
async fn start_bind() -> Bind {
    let mut records = String::from("www IN A 192.0.2.10\n@ IN TXT \"through the tunnel\"\n");
    for i in 0..40 {
        records.push_str(&format!("big IN TXT \"record {i:02} padding padding padding\"\n"));
    }
    let zone = bind::Zone {
        name: "udp.test",
        records: &records,
        options: "    max-udp-size 4096;\n    edns-udp-size 4096;",
        statements: "",
        zone: "",
    };
    Bind::start(&zone, ("www.udp.test", "A", "192.0.2.10")).await
}
