//! A real BIND (`named`, Debian's bind9) on 127.0.0.1, primary for one zone.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use super::net;

/// What a test's named serves.
pub struct Zone<'a> {
    /// The zone's name, without the trailing dot.
    pub name: &'a str,
    /// The zone file's records after its SOA and NS (`ns.<name>`, at 127.0.0.1).
    pub records: &'a str,
    /// More lines for the `options` block.
    pub options: &'a str,
    /// More statements at the top of named.conf (a `key`).
    pub statements: &'a str,
    /// More lines for the zone's own block (an `update-policy`).
    pub zone: &'a str,
}

pub struct Bind {
    pub addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Bind {
    /// Starts named for `zone`, once it answers `name` `rtype` (over UDP)
    /// with `answer`. named cannot listen on port 0: a port free for UDP and
    /// TCP now, released just before; if another process takes it first,
    /// named runs without it, which that first query shows, and another
    /// port is tried.
    pub async fn start(zone: &Zone<'_>, (name, rtype, answer): (&str, &str, &str)) -> Bind {
        for _ in 0..5 {
            let bind = Bind::try_start(zone).await;
            if bind.dig(name, rtype, false).await.is_ok_and(|out| out.trim() == answer) {
                return bind;
            }
            eprintln!("named did not get port {}; trying another", bind.addr.port());
        }
        panic!("named did not get a free port in 5 tries");
    }

    async fn try_start(zone: &Zone<'_>) -> Bind {
        let dir = tempfile::tempdir().unwrap();
        let port = loop {
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let port = udp.local_addr().unwrap().port();
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                break port;
            }
        };
        let d = dir.path().display();
        let Zone { name, records, options, statements, zone } = zone;
        let conf = format!(
            r#"options {{
    directory "{d}";
    pid-file "{d}/named.pid";
    session-keyfile "{d}/session.key";
    managed-keys-directory "{d}";
    listen-on port {port} {{ 127.0.0.1; }};
    listen-on-v6 {{ none; }};
    recursion no;
    dnssec-validation no;
    notify no;
    allow-query {{ any; }};
{options}
}};
controls {{ }};
{statements}
zone "{name}" {{
    type primary;
    file "{d}/zone.db";
{zone}
}};
"#
        );
        let zone_file = format!(
            "$TTL 60\n@ IN SOA ns.{name}. hostmaster.{name}. 1 60 60 600 60\n@ IN NS ns.{name}.\nns IN A 127.0.0.1\n{records}"
        );
        std::fs::write(dir.path().join("named.conf"), conf).unwrap();
        std::fs::write(dir.path().join("zone.db"), zone_file).unwrap();
        let mut child = tokio::process::Command::new("named")
            .args(["-g", "-4", "-n", "1", "-c"])
            .arg(dir.path().join("named.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("named runs (scripts/deps installs bind9)");
        // named's log goes to the test's stderr (shown when a test fails).
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let running = |l: &str| {
            eprintln!("named: {l}");
            l.ends_with("running")
        };
        net::line_where(&mut lines, "named's `running`", Duration::from_secs(20), running).await;
        tokio::spawn(async move {
            while let Ok(Some(l)) = lines.next_line().await {
                eprintln!("named: {l}");
            }
        });
        Bind { addr: ([127, 0, 0, 1], port).into(), _child: child, _dir: dir }
    }

    /// `dig +short` of `name` `rtype` at this named, over TCP with `tcp`:
    /// one answer a line, or dig's complaint.
    pub async fn dig(&self, name: &str, rtype: &str, tcp: bool) -> Result<String, String> {
        let out = tokio::process::Command::new("dig")
            .args(["+short", "+tries=1", "+time=2", if tcp { "+tcp" } else { "+notcp" }])
            .args(["-p", &self.addr.port().to_string(), "@127.0.0.1", name, rtype])
            .output()
            .await
            .expect("dig runs (scripts/deps installs dnsutils)");
        if !out.status.success() {
            return Err(format!(
                "dig: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
