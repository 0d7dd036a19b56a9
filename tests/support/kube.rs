//! Test support: a real Kubernetes control plane (the kube-env harness) for integration tests.
//!
//! Start the harness once, then run the tests:
//!
//! ```sh
//! scripts/kube-env start .kube-env            # builds tools/kube-env on first use (cached afterwards)
//! export CULVERT_KUBECONFIG=$PWD/.kube-env/kubeconfig
//! cargo test -j2
//! scripts/kube-env stop .kube-env
//! ```
//!
//! Use it from a test file with
//!
//! ```ignore
//! mod support;
//! use support::kube as kube_env;
//!
//! #[tokio::test]
//! async fn my_test() -> anyhow::Result<()> {
//!     let Some(env) = kube_env::connect().await else { return Ok(()) }; // skipped: no harness
//!     let ns = env.namespace("my-test").await?;      // fresh namespace "my-test-<random>"
//!     // ... use env.client / ns.name ...
//!     ns.delete_and_wait().await                     // asserts the namespace really goes away
//! }
//! ```
//!
//! Kubeconfig lookup, first match wins:
//! 1. `CULVERT_KUBECONFIG` (must exist and answer, otherwise the test fails);
//! 2. `KUBECONFIG`, but only if it is a kube-env kubeconfig (current context `kube-env`), so these
//!    tests never create and delete namespaces in some other cluster you happen to point at;
//! 3. `<crate root>/.kube-env/kubeconfig`, the default `scripts/kube-env start .kube-env` location.
//!
//! If none is found: with `CI` set the test panics (CI must run these tests); otherwise it prints a
//! "skipping" message (visible with `--nocapture`) and `connect()` returns `None`.
//!
//! Each test gets its own namespace. `TestNamespace::delete_and_wait` deletes it and waits until the
//! namespace controller has finished; if a test panics first, `Drop` still deletes the namespace
//! (best effort, without waiting).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// The name of the context the harness writes into its kubeconfig.
pub const CONTEXT: &str = "kube-env";

/// A connection to the harness.
pub struct KubeEnv {
    pub client: Client,
    pub kubeconfig: PathBuf,
}

/// Finds the harness kubeconfig and connects; `None` means "skip this test" (never in CI).
pub async fn connect() -> Option<KubeEnv> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let Some(path) = find_kubeconfig() else {
        let hint = "start the harness with `scripts/kube-env start .kube-env` and \
                    export CULVERT_KUBECONFIG=$PWD/.kube-env/kubeconfig";
        if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
            panic!(
                "kube-env: no Kubernetes harness configured, but CI is set and these tests must run: {hint}"
            );
        }
        eprintln!("skipping: no Kubernetes harness configured; {hint}");
        return None;
    };
    let client = client_for(&path)
        .await
        .unwrap_or_else(|e| panic!("kube-env: cannot use the harness kubeconfig {}: {e:#}", path.display()));
    match client.apiserver_version().await {
        Ok(_) => Some(KubeEnv { client, kubeconfig: path }),
        Err(e) => panic!(
            "kube-env: the apiserver in {} does not answer ({e}); is the harness still running? \
             `scripts/kube-env start .kube-env`",
            path.display()
        ),
    }
}

fn find_kubeconfig() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CULVERT_KUBECONFIG").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "CULVERT_KUBECONFIG={} does not exist (harness not started or stopped?)",
            p.display()
        );
        return Some(p);
    }
    if let Some(p) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()).map(PathBuf::from)
        && is_kube_env(&p)
    {
        return Some(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".kube-env/kubeconfig");
    is_kube_env(&p).then_some(p)
}

fn is_kube_env(path: &Path) -> bool {
    Kubeconfig::read_from(path).is_ok_and(|kc| kc.current_context.as_deref() == Some(CONTEXT))
}

/// Builds a fresh client from a kubeconfig file.
pub async fn client_for(path: &Path) -> anyhow::Result<Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = Kubeconfig::read_from(path)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

impl KubeEnv {
    /// Creates a namespace named `<prefix>-<random>` (labelled `culvert.dev/test=true`).
    pub async fn namespace(&self, prefix: &str) -> anyhow::Result<TestNamespace> {
        let name = format!("{}-{}", &prefix[..prefix.len().min(50)], random_suffix());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([("culvert.dev/test".to_string(), "true".to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(TestNamespace {
            name,
            client: self.client.clone(),
            kubeconfig: self.kubeconfig.clone(),
            deleted: false,
        })
    }
}

/// A namespace owned by one test. Delete it with [`TestNamespace::delete_and_wait`]; dropping it
/// without doing so (e.g. on panic) still deletes it, without waiting.
pub struct TestNamespace {
    pub name: String,
    client: Client,
    kubeconfig: PathBuf,
    deleted: bool,
}

impl TestNamespace {
    /// `Api<K>` scoped to this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Deletes the namespace and waits (up to 90 s) until it is gone, i.e. until the namespace
    /// controller has removed its contents and its finalizer.
    pub async fn delete_and_wait(mut self) -> anyhow::Result<()> {
        self.deleted = true;
        let api = Api::<Namespace>::all(self.client.clone());
        api.delete(&self.name, &DeleteParams::default()).await?;
        let name = self.name.clone();
        wait_until(&format!("namespace {name} to be deleted"), Duration::from_secs(90), || {
            let api = api.clone();
            let name = name.clone();
            async move { Ok(api.get_opt(&name).await?.is_none().then_some(())) }
        })
        .await
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        // The test's runtime may be gone or blocked here, and `self.client` is bound to it, so use a
        // fresh runtime and client on a helper thread.
        let (name, path) = (self.name.clone(), self.kubeconfig.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let client = client_for(&path).await?;
                Api::<Namespace>::all(client).delete(&name, &DeleteParams::default()).await?;
                anyhow::Ok(())
            })
        })
        .join();
    }
}

/// Polls `check` every 200 ms until it yields `Some(value)` or `timeout` passes. Errors from
/// `check` are retried until the deadline, then reported.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if start.elapsed() > timeout {
            match last_err {
                Some(e) => bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}"),
                None => return Err(anyhow!("timed out after {timeout:?} waiting for {what}")),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn random_suffix() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 5];
    ring::rand::SystemRandom::new().fill(&mut b).expect("system randomness");
    // 8 characters of [a-z0-9]
    let mut n = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], 0, 0, 0]);
    (0..8)
        .map(|_| {
            let c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(n % 36) as usize] as char;
            n /= 36;
            c
        })
        .collect()
}

/// Applies `crds/culvert.yaml` (server-side) and waits until every CRD is Established.
pub async fn install_culvert_crds(client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::ResourceExt;
    use kube::api::{Patch, PatchParams};
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for doc in include_str!("../../crds/culvert.yaml").split("---\n").filter(|d| !d.trim().is_empty()) {
        let crd: CustomResourceDefinition = serde_saphyr::from_str(doc).unwrap();
        api.patch(&crd.name_any(), &PatchParams::apply("culvert-tests").force(), &Patch::Apply(&crd))
            .await
            .unwrap();
    }
    for name in ["domains.culvert.dev", "tcpports.culvert.dev", "udpports.culvert.dev", "tunnels.culvert.dev"]
    {
        wait_until("CRD established", Duration::from_secs(60), || async {
            let c = api.get(name).await?;
            let conditions = c.status.and_then(|s| s.conditions).unwrap_or_default();
            Ok(conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(()))
        })
        .await
        .unwrap();
    }
}

/// Applies the upstream Gateway API CRDs (the standard channel of the
/// release `scripts/gateway-api-crds` fetches through the Go module proxy;
/// never vendored here) and waits until each is Established.
pub async fn install_gateway_api_crds(client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::ResourceExt;
    use kube::api::{Patch, PatchParams};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(root.join("scripts/gateway-api-crds"))
        .arg("standard")
        .output()
        .expect("scripts/gateway-api-crds runs");
    assert!(out.status.success(), "scripts/gateway-api-crds: {}", String::from_utf8_lossy(&out.stderr));
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let mut names = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("gateway.networking.k8s.io_") && n.ends_with(".yaml") && !n.contains("_vap_")
        })
        .collect();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in text.split("\n---").filter(|d| d.contains("kind: CustomResourceDefinition")) {
            let crd: CustomResourceDefinition = serde_saphyr::from_str(doc).unwrap();
            api.patch(&crd.name_any(), &PatchParams::apply("culvert-tests").force(), &Patch::Apply(&crd))
                .await
                .unwrap_or_else(|e| panic!("applying {}: {e}", file.display()));
            names.push(crd.name_any());
        }
    }
    for name in names {
        wait_until("Gateway API CRD established", Duration::from_secs(60), || async {
            let c = api.get(&name).await?;
            let conditions = c.status.and_then(|s| s.conditions).unwrap_or_default();
            Ok(conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(()))
        })
        .await
        .unwrap();
    }
}
