//! The quickstart with real processes: `culvert edge --self-signed`,
//! `culvert admin`, `culvert http|tcp`, curl; the edge killed with SIGKILL and
//! restarted keeps every key and reservation.

mod support;
use support::net::{self, Proc, field};

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");

/// `culvert http BACKEND` to the edge at `url`.
fn http_agent(backend: &str, url: &str, key: &str, ca: &Path) -> Proc {
    Proc::culvert(&["http", backend, "--edge", url, "--key", key, "--ca-file", ca.to_str().unwrap()])
}

fn edge(dir: &Path, https: &str, ports: &str) -> Proc {
    Proc::spawn(&mut Proc::edge_command(dir, https, "127.0.0.1", ports))
}

async fn admin(url: &str, key: &str, ca: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(["admin", "--edge", url, "--key", key, "--ca-file", ca.to_str().unwrap()])
        .args(args)
        .output()
        .await
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

async fn curl(ca: &Path, host: &str, port: u16) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--fail", "--max-time", "10", "--cacert", ca.to_str().unwrap(), "--resolve"])
        .arg(format!("{host}:{port}:127.0.0.1"))
        .arg(format!("https://{host}:{port}/"))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_with_real_processes_survives_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let range = net::free_port_range(3);
    let ports = range.to_string();
    let mut e = edge(dir.path(), "127.0.0.1:0", &ports);
    let ready = e.line("culvert edge ready").await;
    let https = field(&ready, "https").to_string();
    let port: u16 = https.rsplit(':').next().unwrap().parse().unwrap();
    let url = format!("https://{https}");
    let key = std::fs::read_to_string(field(&ready, "admin_key_file")).unwrap().trim().to_string();
    assert!(key.starts_with("culvert_a_"));

    let (ok, host, err) = admin(&url, &key, &ca, &["domain", "reserve", "blog"]).await;
    assert!(ok, "{err}");
    assert_eq!(host, "blog.edge.test");
    let (ok, secret, err) =
        admin(&url, &key, &ca, &["tunnel-key", "create", "--domain", "blog", "--protocol", "http"]).await;
    assert!(ok && secret.starts_with("culvert_t_"), "{secret} {err}");
    let (ok, tcp_port, err) = admin(&url, &key, &ca, &["port", "reserve"]).await;
    assert!(ok, "{err}");
    let (ok, tcp_secret, err) =
        admin(&url, &key, &ca, &["tunnel-key", "create", "--port", &tcp_port, "--protocol", "tcp"]).await;
    assert!(ok, "{err}");
    // Without --ca-file the self-signed edge is not trusted, and the error says what to do.
    let out =
        Command::new(BIN).args(["admin", "--edge", &url, "--key", &key, "info"]).output().await.unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ca-file"));

    net::init();
    let backend = net::http_backend().await.port().to_string();
    let mut agent = http_agent(&backend, &url, &secret, &ca);
    let fwd = agent.line("Forwarding").await;
    assert!(fwd.contains(&format!("https://blog.edge.test:{port}")), "{fwd}");
    assert_eq!(curl(&ca, "blog.edge.test", port).await, "hello from backend");

    let echo = net::tcp_echo().await.port().to_string();
    // As on a CPU without AES instructions (a Raspberry Pi 4).
    let mut tcp_agent = Proc::culvert(&[
        "tcp",
        &echo,
        "--edge",
        &url,
        "--key",
        &tcp_secret,
        "--ca-file",
        ca.to_str().unwrap(),
        "--tunnel-cipher",
        "chacha20-poly1305",
    ]);
    tcp_agent.line("Forwarding tcp://").await;
    let mut s =
        tokio::net::TcpStream::connect(("127.0.0.1", tcp_port.parse::<u16>().unwrap())).await.unwrap();
    s.write_all(b"over tcp").await.unwrap();
    let mut buf = [0u8; 8];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"over tcp");

    // kill -9 and restart on the same port: state kept, agents come back.
    e.child.start_kill().unwrap();
    e.child.wait().await.unwrap();
    let mut e = edge(dir.path(), &https, &ports);
    e.line("culvert edge ready").await;
    agent.line("Forwarding").await;
    tcp_agent.line("Forwarding").await;
    assert_eq!(curl(&ca, "blog.edge.test", port).await, "hello from backend");
    let (ok, list, _) = admin(&url, &key, &ca, &["-o", "json", "tunnel-key", "list"]).await;
    assert!(ok);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 2, "{list}");

    // SIGTERM: the agent drains and exits cleanly.
    agent.signal("-TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), agent.child.wait()).await.unwrap().unwrap();
    assert!(status.success(), "{status}");

    // A wrong key: the agent stops with a clear message instead of retrying forever.
    let out = Command::new(BIN)
        .args([
            "http",
            &backend,
            "--edge",
            &url,
            "--key",
            "culvert_t_nope",
            "--ca-file",
            ca.to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown tunnel key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The default host with real processes: the admin allows an endpoints key
/// the default host (`api-key update --custom-domain '*'`), the key reserves
/// it (`domain reserve --fqdn '*'`, listed as `default host`), `culvert http`
/// publishes on it and a request to the edge's address reaches the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_host_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let ports = net::free_port_range(2).to_string();
    let mut e = edge(dir.path(), "127.0.0.1:0", &ports);
    let ready = e.line("culvert edge ready").await;
    let https = field(&ready, "https").to_string();
    let url = format!("https://{https}");
    let admin_key = std::fs::read_to_string(field(&ready, "admin_key_file")).unwrap().trim().to_string();
    let (ok, key, err) =
        admin(&url, &admin_key, &ca, &["api-key", "create", "--name", "lb", "--scope", "endpoints"]).await;
    assert!(ok, "{err}");
    let (_, list, _) = admin(&url, &admin_key, &ca, &["-o", "json", "api-key", "list"]).await;
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let id = list["items"].as_array().unwrap().iter().find(|k| k["name"] == "lb").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();

    let (ok, _, err) = admin(&url, &key, &ca, &["domain", "reserve", "--fqdn", "*"]).await;
    assert!(!ok);
    assert!(err.contains(&format!("culvert admin api-key update {id} --custom-domain '*'")), "{err}");
    let (ok, table, err) =
        admin(&url, &admin_key, &ca, &["api-key", "update", &id, "--custom-domain", "*"]).await;
    assert!(ok, "{err}");
    assert!(table.contains("CUSTOM DOMAINS") && table.contains(" * "), "{table}");
    let (ok, host, err) = admin(&url, &key, &ca, &["domain", "reserve", "--fqdn", "*"]).await;
    assert!(ok && host == "*", "{host} {err}");
    let (_, table, _) = admin(&url, &key, &ca, &["domain", "list"]).await;
    assert!(table.contains("default host"), "{table}");
    let (ok, secret, err) = admin(&url, &key, &ca, &["tunnel-key", "create", "--domain", "*"]).await;
    assert!(ok, "{err}");

    net::init();
    let backend = net::http_backend().await.port().to_string();
    let mut agent = http_agent(&backend, &url, &secret, &ca);
    agent.line("Forwarding").await;
    let out = Command::new("curl")
        .args(["-sS", "--fail", "--max-time", "10", "--cacert", ca.to_str().unwrap()])
        .arg(format!("https://{https}/"))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from backend");
    // Taken away: the key's next reservation of it is refused (what it holds stays).
    let (ok, _, err) = admin(&url, &admin_key, &ca, &["api-key", "update", &id, "--no-custom-domains"]).await;
    assert!(ok, "{err}");
    let (ok, _, _) = admin(&url, &key, &ca, &["domain", "release", "*"]).await;
    assert!(ok);
    let (ok, _, err) = admin(&url, &key, &ca, &["domain", "reserve", "--fqdn", "*"]).await;
    assert!(!ok && err.contains("may not hold the edge's default host"), "{err}");
}
