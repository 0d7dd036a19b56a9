//! The edge's own certificate from files (`--tls-cert`, `--tls-key`),
//! reloaded without a restart when the files change (certbot's renewal
//! replaces them) or on SIGHUP.
//!
//! The files are polled (`--tls-watch-seconds`): device, inode, size and
//! modification time of both (symlinks followed, so certbot's
//! `live/` links to a new `archive/` file count as a change). A change is
//! loaded in full and checked (the chain parses, the key fits the
//! certificate) before it is served; until then the previous certificate
//! stays in place, so established tunnels and public connections are never
//! touched (TLS is only consulted on new handshakes). A bad pair (half
//! written, a key that does not match) is logged once per change and tried
//! again on every poll, so a writer that finishes later is picked up.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls::sign::CertifiedKey;
use tracing::{error, info};

use super::acme::x509;
use crate::tls::{self, TlsError};

type Labels = Vec<(&'static str, String)>;

/// What identifies one version of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

type PairStamp = (Option<FileStamp>, Option<FileStamp>);

/// The outcome of one check.
#[derive(Debug)]
pub enum Reload {
    /// The files are the ones served.
    Unchanged,
    /// A new certificate is served; its expiry (Unix seconds) if readable.
    Reloaded { not_after: Option<u64> },
    /// The files changed (or a reload was asked for) but cannot be served.
    Failed(TlsError),
}

#[derive(Debug, Default)]
struct State {
    /// The stamps of the pair served now.
    served: Option<PairStamp>,
    /// The stamps and error of the last failed attempt (logged once).
    failed: Option<(PairStamp, String)>,
}

/// The certificate and key files and what of them is served.
#[derive(Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    state: Mutex<State>,
    /// Reloads by result (`reloaded`, `failed`).
    results: Family<Labels, Counter>,
}

impl CertFiles {
    /// Loads the pair for the first time (an error here stops the start).
    pub fn load(
        cert: PathBuf,
        key: PathBuf,
        results: Family<Labels, Counter>,
    ) -> Result<(CertFiles, Arc<CertifiedKey>), TlsError> {
        let stamps = (stamp(&cert), stamp(&key));
        let certified = load_pair(&cert, &key)?;
        let files =
            CertFiles { cert, key, state: Mutex::new(State { served: Some(stamps), failed: None }), results };
        Ok((files, certified))
    }

    /// Loads the pair if it changed since it was served (or always, with
    /// `force`); the new certificate goes to `install`. Logs the outcome.
    pub fn check(&self, force: bool, install: impl FnOnce(Arc<CertifiedKey>)) -> Reload {
        // Stamps before reading: a change while reading is seen next time.
        let stamps = (stamp(&self.cert), stamp(&self.key));
        let mut state = self.state.lock().expect("poisoned");
        if !force && state.served == Some(stamps) {
            return Reload::Unchanged;
        }
        match load_pair(&self.cert, &self.key) {
            Ok(certified) => {
                let not_after =
                    certified.cert.first().and_then(|c| x509::validity(c)).map(|(_, until)| until);
                install(certified);
                state.served = Some(stamps);
                state.failed = None;
                self.count("reloaded");
                info!(
                    cert = %self.cert.display(),
                    not_after = not_after.map(super::store::rfc3339).unwrap_or_default(),
                    "reloaded the TLS certificate from its files"
                );
                Reload::Reloaded { not_after }
            }
            Err(e) => {
                let message = e.to_string();
                let again = state.failed.as_ref().is_some_and(|(s, m)| *s == stamps && *m == message);
                if force || !again {
                    self.count("failed");
                    error!(
                        cert = %self.cert.display(), key = %self.key.display(), error = %message,
                        category = e.category(),
                        "the TLS certificate files are unusable; still serving the previous certificate \
                         (tried again when the files change, and on SIGHUP)"
                    );
                }
                state.failed = Some((stamps, message));
                // Not marked as served: every poll tries the changed pair again.
                Reload::Failed(e)
            }
        }
    }

    fn count(&self, result: &'static str) {
        self.results.get_or_create(&vec![("result", result.to_string())]).inc();
    }
}

fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    tls::certified_key(tls::load_pem_certs(cert)?, tls::load_pem_key(key)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> (String, String) {
        let pki = tls::generate_pki(&[name.to_string()]).unwrap();
        std::fs::write(dir.join("cert.pem"), &pki.cert_pem).unwrap();
        std::fs::write(dir.join("key.pem"), &pki.key_pem).unwrap();
        (pki.cert_pem, pki.key_pem)
    }

    #[test]
    fn reloads_changes_keeps_the_old_pair_on_errors_and_retries() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_a, _) = write_pair(dir.path(), "a.test");
        let results = Family::<Labels, Counter>::default();
        let (files, first) =
            CertFiles::load(dir.path().join("cert.pem"), dir.path().join("key.pem"), results.clone())
                .unwrap();
        let served = Mutex::new(first);
        let install = |k| *served.lock().unwrap() = k;
        assert!(matches!(files.check(false, install), Reload::Unchanged));

        // A half-written certificate: refused, the old one stays, retried.
        std::fs::write(dir.path().join("cert.pem"), &cert_a[..cert_a.len() / 2]).unwrap();
        let before = served.lock().unwrap().clone();
        assert!(matches!(files.check(false, |_| panic!("not installed")), Reload::Failed(_)));
        assert!(matches!(files.check(false, |_| panic!("not installed")), Reload::Failed(_)));
        assert!(Arc::ptr_eq(&before, &served.lock().unwrap()));
        let failed = results.get_or_create(&vec![("result", "failed".to_string())]).get();
        assert_eq!(failed, 1, "the same failure is counted and logged once");

        // A new certificate whose key is not written yet: refused.
        let pki = tls::generate_pki(&["b.test".to_string()]).unwrap();
        std::fs::write(dir.path().join("cert.pem"), &pki.cert_pem).unwrap();
        assert!(matches!(files.check(false, |_| panic!("not installed")), Reload::Failed(TlsError::Key(_))));
        // The key follows: served.
        std::fs::write(dir.path().join("key.pem"), &pki.key_pem).unwrap();
        assert!(matches!(files.check(false, install), Reload::Reloaded { not_after: Some(_) }));
        assert!(!Arc::ptr_eq(&before, &served.lock().unwrap()));
        assert!(matches!(files.check(false, |_| panic!("unchanged")), Reload::Unchanged));
        // Forced (SIGHUP): loaded again even when unchanged.
        assert!(matches!(files.check(true, |_| {}), Reload::Reloaded { .. }));
    }
}
