//! A real PostgreSQL for tests: `initdb` in a temporary directory (as
//! `nobody` when the tests run as root: PostgreSQL refuses to run as root),
//! listening on 127.0.0.1 on a free port only (no Unix socket), started with
//! `pg_ctl start -w` (returns once the server accepts connections) and
//! stopped when dropped, or by a watchdog when the test process ends
//! without dropping it (the shared instance lives in a static).
//!
//! No PostgreSQL on the machine: the test is skipped with a message on
//! stderr, or fails when `CI` is set. `scripts/deps` installs it.
//!
//! ```ignore
//! mod support;
//! use support::postgres;
//! let pg = postgres::Postgres::shared().unwrap(); // None: skipped
//! let url = pg.fresh_database();
//! ```
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// Superuser made by `initdb` (trust authentication on 127.0.0.1).
pub const USER: &str = "culvert";

/// One PostgreSQL server.
pub struct Postgres {
    /// Holds `data/` and the server log.
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// `nobody` when running as root.
    run_as: Option<&'static str>,
    pub port: u16,
}

impl Postgres {
    /// A server for this test process, started on first use and shared by
    /// its tests (each takes its own database with [`Postgres::fresh_database`]).
    pub fn shared() -> Option<&'static Postgres> {
        static SHARED: OnceLock<Option<Postgres>> = OnceLock::new();
        SHARED.get_or_init(Postgres::start).as_ref()
    }

    /// A server of one's own (to stop and start again), stopped when dropped.
    pub fn start() -> Option<Postgres> {
        Postgres::start_with(None, None)
    }

    /// [`Postgres::start`] with TLS on (`ssl = on`), serving this PEM chain and key.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Option<Postgres> {
        Postgres::start_with(Some((cert_pem, key_pem)), None)
    }

    /// [`Postgres::start_tls`] accepting only TLS connections with a client
    /// certificate from `client_ca_pem` whose common name is the user
    /// (`hostssl … clientcert=verify-full` in `pg_hba.conf`).
    pub fn start_tls_client_auth(cert_pem: &str, key_pem: &str, client_ca_pem: &str) -> Option<Postgres> {
        Postgres::start_with(Some((cert_pem, key_pem)), Some(client_ca_pem))
    }

    fn start_with(tls: Option<(&str, &str)>, client_ca: Option<&str>) -> Option<Postgres> {
        match Postgres::try_start(tls, client_ca) {
            Ok(pg) => Some(pg),
            Err(e) if std::env::var_os("CI").is_some() => {
                panic!("PostgreSQL for the tests could not be started: {e} (scripts/deps installs it)")
            }
            Err(e) => {
                eprintln!(
                    "SKIPPED: PostgreSQL for the tests could not be started: {e} (scripts/deps installs it; with CI set this fails)"
                );
                None
            }
        }
    }

    fn try_start(tls: Option<(&str, &str)>, client_ca: Option<&str>) -> Result<Postgres, String> {
        let bin = bin_dir()
            .ok_or("no initdb and pg_ctl found in /usr/lib/postgresql/*/bin (or $CULVERT_PG_BIN)")?;
        let dir = tempfile::Builder::new().prefix("culvert-pg-").tempdir().map_err(|e| e.to_string())?;
        let run_as = is_root().then_some("nobody");
        if let Some(user) = run_as {
            let uid = id(user, "-u")?;
            let gid = id(user, "-g")?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        }
        let port = free_port()?;
        let pg = Postgres { dir, bin, run_as, port };
        let data = pg.data();
        pg.run(
            "initdb",
            &[
                "-D".as_ref(),
                data.as_os_str(),
                "-U".as_ref(),
                USER.as_ref(),
                "--auth=trust".as_ref(),
                "--encoding=UTF8".as_ref(),
                "--locale=C".as_ref(),
                "--no-sync".as_ref(),
            ],
        )?;
        let mut conf = String::new();
        if let Some((cert, key)) = tls {
            use std::os::unix::fs::PermissionsExt;
            let mut files = vec![("server.crt", cert, 0o644), ("server.key", key, 0o600)];
            if let Some(ca) = client_ca {
                files.push(("client-ca.crt", ca, 0o644));
                conf.push_str("\nssl_ca_file = 'client-ca.crt'\n");
                // Existing file: its owner stays.
                std::fs::write(
                    data.join("pg_hba.conf"),
                    "hostssl all all 127.0.0.1/32 trust clientcert=verify-full\n",
                )
                .map_err(|e| format!("pg_hba.conf: {e}"))?;
            }
            for (name, pem, mode) in files {
                let path = data.join(name);
                std::fs::write(&path, pem).map_err(|e| format!("{name}: {e}"))?;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| e.to_string())?;
                if let Some(user) = pg.run_as {
                    std::os::unix::fs::chown(&path, Some(id(user, "-u")?), Some(id(user, "-g")?))
                        .map_err(|e| format!("chown {name}: {e}"))?;
                }
            }
            conf.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        }
        let conf = conf
            + &format!(
                "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = ''\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
            );
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(|e| format!("postgresql.conf: {e}"))?;
        pg.start_again()?;
        pg.watchdog();
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server log (to show when a test fails).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
        let path = self.bin.join(program);
        let mut cmd = match self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.arg("-u").arg(user).arg("--").arg(&path);
                c
            }
            None => Command::new(&path),
        };
        let out = cmd
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{program} failed ({}): {}{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log()
            ))
        }
    }

    /// Starts the server (again, after [`Postgres::stop`]) on the same port;
    /// returns once it accepts connections.
    pub fn start_again(&self) -> Result<(), String> {
        let data = self.data();
        let log = self.dir.path().join("server.log");
        self.run(
            "pg_ctl",
            &[
                "start".as_ref(),
                "-w".as_ref(),
                "-t".as_ref(),
                "120".as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
                "-l".as_ref(),
                log.as_os_str(),
            ],
        )
    }

    /// Stops the server (fast shutdown: open connections are cut); returns
    /// once it is down.
    pub fn stop(&self) {
        let data = self.data();
        if let Err(e) = self.run(
            "pg_ctl",
            &[
                "stop".as_ref(),
                "-w".as_ref(),
                "-m".as_ref(),
                "fast".as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
            ],
        ) {
            eprintln!("pg_ctl stop: {e}");
        }
    }

    /// The URL of database `db` (no TLS).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/{db}?sslmode=disable", self.port)
    }

    /// A new, empty database; its URL.
    pub fn fresh_database(&self) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!("t{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        self.sql("postgres", &format!("CREATE DATABASE {name}"));
        self.url(&name)
    }

    /// Runs SQL statements in database `db` (from any thread, async tests included).
    pub fn sql(&self, db: &str, statements: &str) {
        let url = self.url(db);
        // The blocking client runs its own runtime: not on an async test's thread.
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut c = postgres::Client::connect(&url, postgres::NoTls)
                    .unwrap_or_else(|e| panic!("connecting to the test PostgreSQL: {e}\n{}", self.log()));
                c.batch_execute(statements).unwrap_or_else(|e| panic!("{statements}: {e}"));
            })
            .join()
            .unwrap()
        })
    }

    /// Stops the server and removes its directory once this process is
    /// gone, whether it dropped the server or not.
    fn watchdog(&self) {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
             if [ -f '{data}/postmaster.pid' ]; then kill -QUIT \"$(head -1 '{data}/postmaster.pid')\" 2>/dev/null; sleep 1; fi; \
             rm -rf '{dir}'",
            pid = std::process::id(),
            data = self.data().display(),
            dir = self.dir.path().display(),
        );
        let _ = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self.run(
            "pg_ctl",
            &[
                "stop".as_ref(),
                "-w".as_ref(),
                "-m".as_ref(),
                "immediate".as_ref(),
                "-D".as_ref(),
                data.as_os_str(),
            ],
        );
    }
}

fn bin_dir() -> Option<PathBuf> {
    let has = |d: &Path| d.join("initdb").is_file() && d.join("pg_ctl").is_file();
    if let Some(d) = std::env::var_os("CULVERT_PG_BIN").map(PathBuf::from) {
        return has(&d).then_some(d);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| has(d))
        .collect();
    // The newest version.
    found.sort_by_key(|d| {
        d.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    found.pop()
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

fn id(user: &str, flag: &str) -> Result<u32, String> {
    let out = Command::new("id").arg(flag).arg(user).output().map_err(|e| format!("id: {e}"))?;
    String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| format!("no user {user}"))
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}
