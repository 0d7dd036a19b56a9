//! A backend host in a network namespace this test creates (veth pair,
//! addresses from 10.213.0.0/16), for Services whose endpoints must not be
//! loopback addresses. Root and `ip` (iproute2) are needed.

use std::process::{Command, Stdio};

pub struct NetnsHost {
    pub name: String,
    veth: String,
    /// The address inside the namespace.
    pub ip: String,
    server: Option<std::process::Child>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl NetnsHost {
    /// Creates the namespace; `None` (with a message) where that is not possible outside CI.
    pub fn create() -> Option<NetnsHost> {
        let n: u16 = (std::process::id() as u16 ^ rand16()) % 16000;
        let (third, fourth) = (n / 64, (n % 64) * 4);
        let name = format!("culvert-t{n}");
        let veth = format!("cvt{n}a");
        let peer = format!("cvt{n}b");
        let host_ip = format!("10.213.{third}.{}", fourth + 1);
        let ns_ip = format!("10.213.{third}.{}", fourth + 2);
        let setup = || -> Result<(), String> {
            ip(&["netns", "add", &name])?;
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer])?;
            ip(&["link", "set", &peer, "netns", &name])?;
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &veth])?;
            ip(&["link", "set", &veth, "up"])?;
            ip(&["-n", &name, "addr", "add", &format!("{ns_ip}/30"), "dev", &peer])?;
            ip(&["-n", &name, "link", "set", &peer, "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])
        };
        let result = setup();
        let host = NetnsHost { name: name.clone(), veth: veth.clone(), ip: ns_ip.clone(), server: None };
        match result {
            Ok(()) => Some(host),
            Err(e) => {
                drop(host);
                assert!(std::env::var_os("CI").is_none(), "cannot create a network namespace: {e}");
                eprintln!("skipping: cannot create a network namespace (needs root and iproute2): {e}");
                None
            }
        }
    }

    /// Serves `dir` over HTTP on `port` inside the namespace (python3 http.server).
    pub fn serve_http(&mut self, dir: &std::path::Path, port: u16) {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name, "python3", "-m", "http.server"])
            .arg(port.to_string())
            .args(["--bind", &self.ip, "--directory"])
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs");
        self.server = Some(child);
    }
}

fn rand16() -> u16 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 2];
    ring::rand::SystemRandom::new().fill(&mut b).unwrap();
    u16::from_le_bytes(b)
}

impl Drop for NetnsHost {
    fn drop(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
