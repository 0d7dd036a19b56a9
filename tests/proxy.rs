//! The agent reaches the edge only through a real HTTP proxy (Debian's
//! tinyproxy, started here on 127.0.0.1), with basic auth. Its own test
//! binary: it sets `HTTPS_PROXY` for the whole process.

mod support;
use support::net;

use std::process::Stdio;
use std::time::Duration;

use culvert::agent::Target;
use http::StatusCode;
use net::{TestAgent, TestEdge};
use tokio::io::{AsyncBufReadExt, BufReader};

/// Starts tinyproxy on a free port; returns the child and its port.
async fn tinyproxy(dir: &std::path::Path) -> Option<(tokio::process::Child, u16)> {
    let bin =
        ["/usr/bin/tinyproxy", "/usr/sbin/tinyproxy"].into_iter().find(|p| std::path::Path::new(p).exists());
    let Some(bin) = bin else {
        assert!(
            std::env::var_os("CI").is_none(),
            "tinyproxy is missing: `.ci/run` installs it (apt-get install tinyproxy)"
        );
        eprintln!("skipping: tinyproxy is not installed (apt-get install tinyproxy)");
        return None;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let conf = dir.join("tinyproxy.conf");
    std::fs::write(
        &conf,
        format!(
            "Port {port}\nListen 127.0.0.1\nTimeout 600\nMaxClients 100\nAllow 127.0.0.1\n\
             LogLevel Info\nBasicAuth culvert pass-w0rd\n"
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(bin)
        .arg("-d")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("tinyproxy starts");
    // In the foreground it logs to stdout; ready when it logs that it accepts
    // connections (it exits if it cannot listen, saying why on stderr).
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let ready = tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(l)) = lines.next_line().await {
            let ready = l.contains("Accepting connections");
            seen.push(l);
            if ready {
                return true;
            }
        }
        false
    })
    .await;
    if !matches!(ready, Ok(true)) {
        use tokio::io::AsyncReadExt;
        let mut err = String::new();
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            child.stderr.take().unwrap().read_to_string(&mut err),
        )
        .await;
        panic!("tinyproxy did not start ({:?}): {err}\n{}", child.try_wait(), seen.join("\n"));
    }
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("tinyproxy: {l}");
        }
    });
    Some((child, port))
}

#[tokio::test]
async fn agent_reaches_the_edge_only_through_an_http_proxy() {
    let edge = TestEdge::start().await;
    let dir = tempfile::tempdir().unwrap();
    let Some((mut proxy, port)) = tinyproxy(dir.path()).await else { return };
    let backend = net::http_backend().await;
    let (host, key) = edge.http_tunnel_key("proxied").await;

    // Wrong credentials: the agent says the proxy wants authentication.
    // SAFETY: this test binary has one test; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("HTTPS_PROXY", format!("http://culvert:wrong@127.0.0.1:{port}")) };
    let dialer = edge.dialer(&key);
    let err = dialer.connect().await.err().expect("refused by the proxy");
    assert!(err.to_string().contains("proxy"), "{err}");

    // NO_PROXY would bypass it: make sure it does not match.
    unsafe {
        std::env::set_var("HTTPS_PROXY", format!("http://culvert:pass%2Dw0rd@127.0.0.1:{port}"));
        std::env::set_var("NO_PROXY", "example.com");
    }
    let agent = tokio::time::timeout(
        Duration::from_secs(30),
        TestAgent::start(&edge, &key, Target::http(backend.to_string())),
    )
    .await
    .expect("agent connects through the proxy");
    let (status, body) = edge.client().get(&host, "/").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "hello from backend"));

    // The tunnel really runs through the proxy: stop the proxy, the tunnel drops.
    proxy.kill().await.unwrap();
    net::eventually("the tunnel went down with the proxy", Duration::from_secs(40), || async {
        match edge.edge().registry.count_for_key(&edge.tunnel_key_id(|_| true).await) {
            0 => Ok(()),
            n => Err(format!("{n} tunnels still up")),
        }
    })
    .await;
    agent.stop().await;
}
