//! TLS material: PEM loading, the edge's certificate resolver, the private CA
//! of `--self-signed`, and the client configuration of agents and the admin client.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::crypto::ring as provider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN protocols the edge offers to public clients.
pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP11: &[u8] = b"http/1.1";
/// ALPN of ACME TLS-ALPN-01 validation (RFC 8737): the CA's only protocol.
pub const ALPN_ACME_TLS: &[u8] = b"acme-tls/1";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("failed to read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)")]
    NoCertificate { path: PathBuf },
    #[error("{path} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoKey { path: PathBuf },
    #[error("{path}: {message}")]
    BadPem { path: PathBuf, message: String },
    #[error("the private key does not fit the certificate or is unsupported: {0}")]
    Key(#[source] rustls::Error),
    #[error("failed to build TLS configuration: {0}")]
    Config(#[source] rustls::Error),
    #[error("failed to generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

impl TlsError {
    /// Static category for metrics and events.
    pub fn category(&self) -> &'static str {
        match self {
            TlsError::Read { .. } | TlsError::Write { .. } => "io",
            TlsError::NoCertificate { .. } | TlsError::NoKey { .. } | TlsError::BadPem { .. } => "bad_pem",
            TlsError::Key(_) | TlsError::Config(_) => "config",
            TlsError::Generate(_) => "generate",
        }
    }
}

/// A PEM error in words (a cut-off file is the common case: half written).
fn pem_error(path: &Path, e: rustls_pki_types::pem::Error) -> TlsError {
    let message = match e {
        rustls_pki_types::pem::Error::MissingSectionEnd { .. } => {
            "a PEM section has no END line: the file is cut off (still being written?)".to_string()
        }
        e => e.to_string(),
    };
    TlsError::BadPem { path: path.into(), message }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.into(), source })
}

/// Every certificate of a PEM file, in order.
pub fn load_pem_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { path: path.into() });
    }
    Ok(certs)
}

/// The first private key of a PEM file.
pub fn load_pem_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoKey { path: path.into() },
        e => pem_error(path, e),
    })
}

/// A certificate chain and its key, ready to serve.
pub fn certified_key(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, TlsError> {
    CertifiedKey::from_der(certs, key, &provider::default_provider()).map(Arc::new).map_err(TlsError::Key)
}

/// A certificate and key made in memory (PEM), ready to serve.
pub(crate) fn certified_key_from_pem(cert_pem: &str, key_pem: &str) -> Result<Arc<CertifiedKey>, TlsError> {
    let path = Path::new("(generated)");
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| pem_error(path, e))?;
    certified_key(certs, key)
}

/// Picks the certificate by SNI: exact names first (custom domains), then
/// the default (the edge's own `<domain>` and `*.<domain>` certificate).
/// Certificates can be swapped without a restart. A ClientHello offering
/// ALPN `acme-tls/1` gets only a TLS-ALPN-01 challenge certificate.
#[derive(Debug)]
pub struct CertResolver {
    default: RwLock<Arc<CertifiedKey>>,
    by_name: RwLock<HashMap<String, Arc<CertifiedKey>>>,
    acme_challenges: RwLock<HashMap<String, Arc<CertifiedKey>>>,
}

impl CertResolver {
    pub fn new(default: Arc<CertifiedKey>) -> Self {
        CertResolver {
            default: RwLock::new(default),
            by_name: RwLock::default(),
            acme_challenges: RwLock::default(),
        }
    }

    /// Serves `key` for the exact host name `name` (lower case).
    pub(crate) fn set(&self, name: &str, key: Arc<CertifiedKey>) {
        self.by_name.write().expect("poisoned").insert(name.to_ascii_lowercase(), key);
    }

    pub(crate) fn remove(&self, name: &str) {
        self.by_name.write().expect("poisoned").remove(&name.to_ascii_lowercase());
    }

    /// Replaces the certificate served when no name matches (reloads).
    pub(crate) fn set_default(&self, key: Arc<CertifiedKey>) {
        *self.default.write().expect("poisoned") = key;
    }

    /// The certificate served for `name` by SNI (tests, diagnostics).
    pub fn get(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        self.by_name.read().expect("poisoned").get(&name.to_ascii_lowercase()).cloned()
    }

    /// Answers TLS-ALPN-01 validation of `name` with `key` (until removed).
    pub(crate) fn set_acme_challenge(&self, name: &str, key: Arc<CertifiedKey>) {
        self.acme_challenges.write().expect("poisoned").insert(name.to_ascii_lowercase(), key);
    }

    pub(crate) fn remove_acme_challenge(&self, name: &str) {
        self.acme_challenges.write().expect("poisoned").remove(&name.to_ascii_lowercase());
    }

    /// Whether this edge answers TLS-ALPN-01 validation of `name` itself.
    pub(crate) fn has_acme_challenge(&self, name: &str) -> bool {
        self.acme_challenges.read().expect("poisoned").contains_key(&name.to_ascii_lowercase())
    }
}

/// The server configuration of one TLS-ALPN-01 answer (an order placed by
/// another edge): only ALPN `acme-tls/1`, only the challenge certificate.
pub(crate) fn acme_challenge_config(key: Arc<CertifiedKey>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    #[derive(Debug)]
    struct One(Arc<CertifiedKey>);
    impl ResolvesServerCert for One {
        fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
            Some(self.0.clone())
        }
    }
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(One(key)));
    config.alpn_protocols = vec![ALPN_ACME_TLS.to_vec()];
    Ok(Arc::new(config))
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if hello.alpn().is_some_and(|mut offered| offered.any(|p| p == ALPN_ACME_TLS)) {
            // TLS-ALPN-01: a challenge certificate or no handshake at all.
            let name = hello.server_name()?.to_ascii_lowercase();
            return self.acme_challenges.read().expect("poisoned").get(&name).cloned();
        }
        if let Some(name) = hello.server_name() {
            let by_name = self.by_name.read().expect("poisoned");
            if let Some(key) = by_name.get(&name.to_ascii_lowercase()) {
                return Some(key.clone());
            }
        }
        Some(self.default.read().expect("poisoned").clone())
    }
}

/// The edge's TLS server configuration: TLS 1.2 and 1.3, ALPN h2 and
/// http/1.1 (and `acme-tls/1`, which only ACME validation offers).
pub fn server_config(resolver: Arc<CertResolver>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    server_config_on(resolver, aes_hardware())
}

/// [`server_config`] on a CPU with (`aes_hardware`) or without AES
/// instructions. With them the client's order decides, so an agent or a
/// phone without them gets the ChaCha20-Poly1305 it asks for; without
/// them the edge's own order decides, ChaCha20-Poly1305 first, for what
/// the edge pays per byte (Go's rule).
fn server_config_on(
    resolver: Arc<CertResolver>,
    aes_hardware: bool,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut provider = provider::default_provider();
    prefer(&mut provider, aes_hardware);
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.ignore_client_order = !aes_hardware;
    config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec(), ALPN_ACME_TLS.to_vec()];
    // TLS 1.3 records after the handshake are ours (`tunnel::tls`).
    config.enable_secret_extraction = true;
    // Stateless session tickets (ChaCha20-Poly1305 under keys of this
    // process, rotated every 6 hours), as nginx has by default. rustls'
    // default keeps sessions in a cache of 256 entries, two per TLS 1.3
    // connection: beyond ~128 clients at once almost none resumed (16 of
    // 300), and every reconnect paid a full handshake's signature. A
    // resumed TLS 1.3 handshake still agrees a fresh key (psk_dhe_ke).
    config.ticketer = provider::Ticketer::new().map_err(TlsError::Config)?;
    Ok(Arc::new(config))
}

/// Root certificates: the PEM CA file if given (and only it), else the
/// Mozilla roots compiled into the binary (a scratch image has no system store).
pub fn root_store(ca_file: Option<&Path>) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in load_pem_certs(path)? {
                roots.add(cert).map_err(|e| TlsError::BadPem {
                    path: path.into(),
                    message: format!("not a usable CA certificate: {e}"),
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}

/// The AEAD a tunnel's records are sealed with: what the agent offers
/// first (`--tunnel-cipher`); the edge takes the agent's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TunnelCipher {
    /// AES-128-GCM on a CPU with AES instructions (x86 AES-NI with
    /// PCLMULQDQ, the ARMv8 Cryptography Extension), ChaCha20-Poly1305
    /// on one without (a Raspberry Pi 3 or 4, any 32-bit ARM build).
    #[default]
    Auto,
    #[value(name = "aes-128-gcm")]
    Aes128Gcm,
    #[value(name = "chacha20-poly1305")]
    Chacha20Poly1305,
}

impl TunnelCipher {
    /// Whether AES-GCM comes first: the choice `Auto` makes by this CPU.
    pub fn aes_first(self) -> bool {
        match self {
            TunnelCipher::Auto => aes_hardware(),
            TunnelCipher::Aes128Gcm => true,
            TunnelCipher::Chacha20Poly1305 => false,
        }
    }
}

/// Whether ring seals AES-GCM with instructions made for it on this CPU.
/// Without them AES runs in constant-time software, several times the
/// cost of ChaCha20-Poly1305 per byte; Go, BoringSSL and s2n pick
/// ChaCha20 there for the same reason. ring uses AES instructions on
/// x86_64 and aarch64 only (its 32-bit ARM AES is NEON software).
pub fn aes_hardware() -> bool {
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    // Rust's `aes` on aarch64 is FEAT_AES with FEAT_PMULL (GHASH).
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "x86", target_arch = "aarch64")))]
    {
        false
    }
}

/// Puts AES-128-GCM first (`aes_first`: TLS 1.3's mandatory suite, as Go
/// and BoringSSL prefer it, and 10 AES rounds to AES-256's 14 on every
/// byte the tunnel moves, its largest user-space cost in bulk: ~2.6 of
/// ~3.9 instructions a byte on each side) or the ChaCha20-Poly1305 suites
/// first; the order of the rest is kept.
fn prefer(provider: &mut rustls::crypto::CryptoProvider, aes_first: bool) {
    use rustls::CipherSuite::*;
    provider.cipher_suites.sort_by_key(|s| match (s.suite(), aes_first) {
        (TLS13_AES_128_GCM_SHA256, true) => 0,
        (TLS13_CHACHA20_POLY1305_SHA256, false) => 0,
        (
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 | TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            false,
        ) => 1,
        _ => 2,
    });
}

/// The tunnel client's configuration: TLS 1.3 only, ALPN http/1.1 (the
/// WebSocket upgrade is an HTTP/1.1 request), `cipher` offered first.
pub fn tunnel_client_config(
    ca_file: Option<&Path>,
    cipher: TunnelCipher,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut provider = provider::default_provider();
    // The edge takes the agent's order: the agent's CPU decides, the side
    // of the tunnel most likely to be short of it.
    prefer(&mut provider, cipher.aes_first());
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TlsError::Config)?
        .with_root_certificates(root_store(ca_file)?)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    config.enable_secret_extraction = true;
    Ok(Arc::new(config))
}

/// Files of the private CA made by `culvert edge --self-signed`.
pub(crate) struct SelfSignedFiles {
    /// The CA certificate agents and clients trust (`--ca-file`).
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Makes (on first use) and loads a private CA and a serving certificate for
/// `domain`, `*.domain`, `localhost`, 127.0.0.1 and ::1, kept in `dir` so a
/// restart serves the same chain. The CA's key is not kept.
pub(crate) fn self_signed(dir: &Path, domain: &str) -> Result<SelfSignedFiles, TlsError> {
    let files = SelfSignedFiles {
        ca_cert: dir.join("ca.pem"),
        cert: dir.join("self-signed-cert.pem"),
        key: dir.join("self-signed-key.pem"),
    };
    if files.ca_cert.exists() && files.cert.exists() && files.key.exists() {
        return Ok(files);
    }
    let pki = generate_pki(&[
        domain.to_string(),
        format!("*.{domain}"),
        "localhost".into(),
        "127.0.0.1".into(),
        "::1".into(),
    ])?;
    write_file(&files.ca_cert, pki.ca_pem.as_bytes(), 0o644)?;
    write_file(&files.cert, format!("{}{}", pki.cert_pem, pki.ca_pem).as_bytes(), 0o644)?;
    write_file(&files.key, pki.key_pem.as_bytes(), 0o600)?;
    Ok(files)
}

/// A CA and one serving certificate signed by it (PEM).
pub struct GeneratedPki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Generates a CA and a serving certificate for `names` (IP literals become IP SANs).
pub fn generate_pki(names: &[String]) -> Result<GeneratedPki, TlsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.distinguished_name.push(DnType::CommonName, "culvert self-signed CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut params = CertificateParams::new(names.to_vec())?;
    params.distinguished_name.push(DnType::CommonName, names.first().cloned().unwrap_or_default());
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(GeneratedPki { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// Writes a file with the given Unix mode, creating it only readable as asked.
pub(crate) fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let write = || -> std::io::Result<()> {
        let mut f =
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(path)?;
        f.write_all(contents)?;
        f.sync_all()
    };
    write().map_err(|source| TlsError::Write { path: path.into(), source })
}

/// Accepts any server certificate, still checking handshake signatures: a
/// backend with `culvert.dev/backend-tls-verify: "false"`, PostgreSQL with
/// `sslmode=prefer|require` (libpq's meaning).
#[derive(Debug)]
pub(crate) struct AnyCertificate(pub(crate) Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::CipherSuite::{self, *};

    fn offered(config: &rustls::ClientConfig) -> Vec<CipherSuite> {
        config.crypto_provider().cipher_suites.iter().map(|s| s.suite()).collect()
    }

    /// The agent offers the cipher asked for first and every other suite
    /// after it; `auto` follows this CPU.
    #[test]
    fn the_tunnel_offers_its_cipher_first_and_the_rest_after_it() {
        for (cipher, first) in [
            (TunnelCipher::Aes128Gcm, TLS13_AES_128_GCM_SHA256),
            (TunnelCipher::Chacha20Poly1305, TLS13_CHACHA20_POLY1305_SHA256),
            (
                TunnelCipher::Auto,
                if aes_hardware() { TLS13_AES_128_GCM_SHA256 } else { TLS13_CHACHA20_POLY1305_SHA256 },
            ),
        ] {
            let offered = offered(&tunnel_client_config(None, cipher).unwrap());
            assert_eq!(offered[0], first, "{cipher:?}: {offered:?}");
            for suite in [TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256]
            {
                assert!(offered.contains(&suite), "{cipher:?}: {offered:?}");
            }
        }
    }

    /// This machine's CPU, as std sees it, is what `auto` goes by.
    #[test]
    fn aes_hardware_is_what_the_cpu_says() {
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            aes_hardware(),
            std::fs::read_to_string("/proc/cpuinfo")
                .map(|c| c.split_whitespace().any(|f| f == "aes")
                    && c.split_whitespace().any(|f| f == "pclmulqdq"))
                .unwrap_or(aes_hardware())
        );
    }

    /// Which suite a handshake of a client offering `cipher` first with
    /// an edge (`aes_hardware` or not) agrees on, in memory.
    fn agreed(cipher: TunnelCipher, edge_has_aes: bool, tls12: bool) -> CipherSuite {
        let pki = generate_pki(&["edge.test".to_string()]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pki.ca_pem).unwrap();
        let key = certified_key_from_pem(&pki.cert_pem, &pki.key_pem).unwrap();
        let server = server_config_on(Arc::new(CertResolver::new(key)), edge_has_aes).unwrap();
        let client = if tls12 {
            // A TLS 1.2 public client with this preference.
            let mut provider = provider::default_provider();
            prefer(&mut provider, cipher.aes_first());
            Arc::new(
                rustls::ClientConfig::builder_with_provider(Arc::new(provider))
                    .with_protocol_versions(&[&rustls::version::TLS12])
                    .unwrap()
                    .with_root_certificates(root_store(Some(&ca)).unwrap())
                    .with_no_client_auth(),
            )
        } else {
            tunnel_client_config(Some(&ca), cipher).unwrap()
        };
        let mut c = rustls::ClientConnection::new(client, "edge.test".try_into().unwrap()).unwrap();
        let mut s = rustls::ServerConnection::new(server).unwrap();
        while c.is_handshaking() || s.is_handshaking() {
            let mut wire = Vec::new();
            c.write_tls(&mut wire).unwrap();
            s.read_tls(&mut wire.as_slice()).unwrap();
            s.process_new_packets().unwrap();
            wire.clear();
            s.write_tls(&mut wire).unwrap();
            c.read_tls(&mut wire.as_slice()).unwrap();
            c.process_new_packets().unwrap();
        }
        let (cs, ss) =
            (c.negotiated_cipher_suite().unwrap().suite(), s.negotiated_cipher_suite().unwrap().suite());
        assert_eq!(cs, ss);
        cs
    }

    /// An edge with AES instructions gives each client the suite it asks
    /// for first (a Raspberry Pi's agent gets ChaCha20-Poly1305); an edge
    /// without them prefers ChaCha20-Poly1305 whatever the client's order,
    /// in TLS 1.3 and 1.2.
    #[test]
    fn the_edge_takes_the_clients_order_unless_it_lacks_aes_instructions() {
        use TunnelCipher::*;
        for (cipher, edge_has_aes, tls12, want) in [
            (Aes128Gcm, true, false, TLS13_AES_128_GCM_SHA256),
            (Chacha20Poly1305, true, false, TLS13_CHACHA20_POLY1305_SHA256),
            (Aes128Gcm, false, false, TLS13_CHACHA20_POLY1305_SHA256),
            (Chacha20Poly1305, false, false, TLS13_CHACHA20_POLY1305_SHA256),
            (Chacha20Poly1305, true, true, TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256),
            (Aes128Gcm, false, true, TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256),
        ] {
            assert_eq!(
                agreed(cipher, edge_has_aes, tls12),
                want,
                "{cipher:?}, edge AES {edge_has_aes}, TLS 1.2 {tls12}"
            );
        }
    }
}
