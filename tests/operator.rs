//! The operator against a real kube-apiserver (the kube-env harness) and a
//! real edge, each test in its own namespace with its own operator
//! (`--watch-namespace`), traffic to real backend processes.

#[path = "support/operator.rs"]
mod fixture;
#[path = "support/kube.rs"]
mod kube_env;
#[path = "support/net.rs"]
mod net;
#[path = "support/netns.rs"]
mod netns;

use std::time::Duration;

use culvert::crd::{Domain, TcpPort, Tunnel};
use fixture::{Fixture, WAIT, service_with_endpoints};
use http::StatusCode;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube_env::wait_until;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domains_reserve_release_retain_adopt_and_recreate() {
    let Some(f) = Fixture::new("op-domain").await else { return };
    let (stop, task) = f.operator();
    let name = format!("w{}", &f.ns.name[f.ns.name.len() - 8..]);

    // Reserve.
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "web"}, "spec": {"name": name}})).await;
    let d = f.wait_reason::<Domain>("web", "Reserved").await;
    let host = d["status"]["hostname"].as_str().unwrap().to_string();
    assert_eq!(host, format!("{name}.edge.test"));
    let (s, r) = f.edge.api("GET", &format!("domains/{host}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(r["labels"]["culvert.dev/namespace"], f.ns.name.as_str());

    // Deleted out-of-band at the edge: re-created at the next resync, with an event.
    let (s, _) = f.edge.api("DELETE", &format!("domains/{host}"), None).await;
    assert!(s.is_success());
    wait_until("reservation re-created", WAIT, || async {
        Ok((f.edge.api("GET", &format!("domains/{host}"), None).await.0 == StatusCode::OK).then_some(()))
    })
    .await
    .unwrap();
    wait_until("Recreated event", WAIT, || async {
        Ok(f.events_for("web").await.iter().any(|(t, r, _)| t == "Normal" && r == "Recreated").then_some(()))
    })
    .await
    .unwrap();

    // Delete (reclaimPolicy Delete): released at the edge.
    f.api::<Domain>().delete("web", &DeleteParams::default()).await.unwrap();
    wait_until("reservation released", WAIT, || async {
        Ok((f.edge.api("GET", &format!("domains/{host}"), None).await.0 == StatusCode::NOT_FOUND)
            .then_some(()))
    })
    .await
    .unwrap();

    // Retain: kept after delete, adopted by the object created again.
    let retained = json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "kept"}, "spec": {"name": format!("{name}k"), "reclaimPolicy": "Retain"}});
    f.create::<Domain>(retained.clone()).await;
    f.wait_reason::<Domain>("kept", "Reserved").await;
    f.api::<Domain>().delete("kept", &DeleteParams::default()).await.unwrap();
    wait_until("Domain gone", WAIT, || async {
        Ok(f.api::<Domain>().get_opt("kept").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let kept_host = format!("{name}k.edge.test");
    assert_eq!(f.edge.api("GET", &format!("domains/{kept_host}"), None).await.0, StatusCode::OK, "retained");
    f.create::<Domain>(retained).await;
    f.wait_reason::<Domain>("kept", "Reserved").await;
    wait_until("Adopted event", WAIT, || async {
        Ok(f.events_for("kept").await.iter().any(|(t, r, _)| t == "Normal" && r == "Adopted").then_some(()))
    })
    .await
    .unwrap();

    // Held by someone else (the admin key here): a Conflict, never taken over.
    let (s, _) = f.edge.api("POST", "domains", Some(json!({"name": format!("{name}x")}))).await;
    assert!(s.is_success());
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "taken"}, "spec": {"name": format!("{name}x")}})).await;
    let d = f.wait_reason::<Domain>("taken", "Conflict").await;
    assert_eq!(d["status"]["conditions"][0]["status"], "False");
    wait_until("Warning event", WAIT, || async {
        Ok(f.events_for("taken")
            .await
            .iter()
            .any(|(t, r, _)| t == "Warning" && r == "Conflict")
            .then_some(()))
    })
    .await
    .unwrap();

    // A TcpPort: any free port of the range.
    f.create::<TcpPort>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "TcpPort", "metadata": {"name": "db"}, "spec": {}})).await;
    let p = f.wait_reason::<TcpPort>("db", "Reserved").await;
    let port = p["status"]["port"].as_u64().unwrap() as u16;
    assert!(f.edge.tcp_ports.contains(port));
    assert_eq!(p["status"]["address"], format!("127.0.0.1:{port}"));
    f.api::<TcpPort>().delete("db", &DeleteParams::default()).await.unwrap();
    wait_until("port released", WAIT, || async {
        Ok((f.edge.api("GET", &format!("ports/{port}"), None).await.0 == StatusCode::NOT_FOUND).then_some(()))
    })
    .await
    .unwrap();

    f.finish(stop, task).await;
}

async fn tunnel_keys(f: &Fixture, uid: &str) -> Vec<Value> {
    let (_, keys) =
        f.edge.api("GET", &format!("tunnel-keys?selector=culvert.dev/uid={uid}&revoked=true"), None).await;
    keys["items"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_end_to_end_and_keys_never_leak() {
    let Some(f) = Fixture::new("op-tunnel").await else { return };
    let Some(mut host) = netns::NetnsHost::create() else { return };
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "hello from the cluster").unwrap();
    host.serve_http(site.path(), 8000);
    service_with_endpoints(&f, "web", &host.ip, json!({}), &[("http", 80, 8000, "TCP")]).await;

    let (stop, task) = f.operator();
    let label = format!("t{}", &f.ns.name[f.ns.name.len() - 8..]);
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "web"}, "spec": {"name": label}})).await;
    let t: Tunnel = f
        .create(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "web"},
            "spec": {"service": {"name": "web", "port": "http"}, "domain": "web"}}))
        .await;
    let uid = t.uid().unwrap();
    let status = wait_until("Tunnel published with an agent", WAIT, || async {
        let v = serde_json::to_value(f.api::<Tunnel>().get("web").await?)?;
        Ok((v["status"]["conditions"][0]["reason"] == "Published"
            && v["status"]["agents"].as_u64() >= Some(1))
        .then_some(v))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}", f.edge.edge().registry.count_for_key("x")));
    let public = format!("{label}.edge.test");
    assert_eq!(status["status"]["url"], format!("https://{public}:{}", f.edge.https.port()));
    assert_eq!(status["status"]["backends"][0], format!("{}:8000", host.ip));

    // A real HTTP request through the edge reaches the backend in the network namespace.
    let body = wait_until("request through the tunnel", WAIT, || async {
        let (s, b) = f.edge.client().get(&public, "/").await;
        Ok((s == StatusCode::OK).then_some(b))
    })
    .await
    .unwrap();
    assert_eq!(body, "hello from the cluster");

    // The key lives in a Secret owned by the Tunnel; the operator's key cannot carry traffic.
    let secret = f.api::<Secret>().get("web-culvert-key").await.unwrap();
    assert_eq!(secret.owner_references()[0].uid, uid);
    let keys = tunnel_keys(&f, &uid).await;
    assert_eq!(keys.len(), 1);
    assert!(keys[0]["revokedAt"].is_null());

    // Deleting the Tunnel revokes its key.
    f.api::<Tunnel>().delete("web", &DeleteParams::default()).await.unwrap();
    wait_until("key revoked", WAIT, || async {
        Ok(tunnel_keys(&f, &uid).await.iter().all(|k| !k["revokedAt"].is_null()).then_some(()))
    })
    .await
    .unwrap();

    // A Tunnel deleted while the operator is down: its key is revoked at the next start.
    let t: Tunnel = f
        .create(
            json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "orphan"},
            "spec": {"service": {"name": "web", "port": 80}, "domain": "web"}}),
        )
        .await;
    let orphan_uid = t.uid().unwrap();
    wait_until("orphan key minted", WAIT, || async {
        Ok((!tunnel_keys(&f, &orphan_uid).await.is_empty()).then_some(()))
    })
    .await
    .unwrap();
    stop.cancel();
    task.await.unwrap();
    let api = f.api::<Tunnel>();
    api.patch("orphan", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"finalizers": null}})))
        .await
        .unwrap();
    api.delete("orphan", &DeleteParams::default()).await.unwrap();
    wait_until("orphan gone", WAIT, || async { Ok(api.get_opt("orphan").await?.is_none().then_some(())) })
        .await
        .unwrap();
    assert!(
        tunnel_keys(&f, &orphan_uid).await.iter().all(|k| k["revokedAt"].is_null()),
        "still live while no operator runs"
    );
    let (stop, task) = f.operator();
    wait_until("orphan key revoked at start", WAIT, || async {
        Ok(tunnel_keys(&f, &orphan_uid).await.iter().all(|k| !k["revokedAt"].is_null()).then_some(()))
    })
    .await
    .unwrap();

    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_rejections_are_conditions_and_warnings() {
    let Some(f) = Fixture::new("op-isolation").await else { return };
    let (stop, task) = f.operator();
    f.create::<Service>(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ext"},
        "spec": {"type": "ExternalName", "externalName": "example.com"}}))
        .await;
    let label = format!("i{}", &f.ns.name[f.ns.name.len() - 8..]);
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "d"}, "spec": {"name": label}})).await;
    f.wait_reason::<Domain>("d", "Reserved").await;
    let cases = [
        ("ip", json!({"service": {"name": "10.0.0.1", "port": 80}, "domain": "d"}), "InvalidSpec"),
        (
            "other-ns",
            json!({"service": {"name": "web.kube-system", "port": 80}, "domain": "d"}),
            "InvalidSpec",
        ),
        ("external", json!({"service": {"name": "ext", "port": 80}, "domain": "d"}), "InvalidSpec"),
        ("foreign-domain", json!({"service": {"name": "ext", "port": 80}, "domain": "not-here"}), "Waiting"),
    ];
    for (name, spec, _) in &cases {
        f.create::<Tunnel>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": name}, "spec": spec})).await;
    }
    for (name, _, reason) in &cases {
        let t = f.wait_reason::<Tunnel>(name, reason).await;
        assert_eq!(t["status"]["conditions"][0]["status"], "False", "{name}: {t}");
        wait_until("Warning event", WAIT, || async {
            Ok(f.events_for(name).await.iter().any(|(t, r, _)| t == "Warning" && r == reason).then_some(()))
        })
        .await
        .unwrap();
    }
    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_hands_over_when_the_leader_dies() {
    use k8s_openapi::api::coordination::v1::Lease;
    let Some(f) = Fixture::new("op-leader").await else { return };
    let (stop_a, task_a) = f.operator_as("replica-a");
    let leases = f.api::<Lease>();
    let holder = || async {
        leases.get_opt("culvert-operator-leader").await.ok().flatten().and_then(|l| l.spec?.holder_identity)
    };
    wait_until("replica-a leads", WAIT, || async {
        Ok((holder().await.as_deref() == Some("replica-a")).then_some(()))
    })
    .await
    .unwrap();
    let (stop_b, task_b) = f.operator_as("replica-b");
    // Kill the leader without a goodbye: the lease (2 s) must run out.
    task_a.abort();
    let _ = task_a.await;
    let killed = std::time::Instant::now();
    wait_until("replica-b takes over", Duration::from_secs(20), || async {
        Ok((holder().await.as_deref() == Some("replica-b")).then_some(()))
    })
    .await
    .unwrap();
    eprintln!("handed over {:?} after the leader died", killed.elapsed());
    assert!(killed.elapsed() < Duration::from_secs(8));
    // The new leader reconciles.
    let label = format!("l{}", &f.ns.name[f.ns.name.len() - 8..]);
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "d"}, "spec": {"name": label}})).await;
    f.wait_reason::<Domain>("d", "Reserved").await;
    stop_a.cancel();
    f.finish(stop_b, task_b).await;
}

/// A DNS server on 127.0.0.1:0 that knows no name (NXDOMAIN to everything).
async fn empty_dns() -> std::net::SocketAddr {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 1500];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            if n >= 12 {
                let mut m = buf[..n].to_vec();
                m[2] |= 0x80; // a response
                m[3] = 0x80 | 3; // NXDOMAIN
                let _ = socket.send_to(&m, peer).await;
            }
        }
    });
    addr
}

/// A custom domain's certificate state reaches the Domain: the edge (with
/// ACME) finds that the name does not point at it, which the operator shows
/// as `CertificateReady=False, DnsMismatch` with a Warning event. No CA is
/// contacted: the DNS check comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_domain_certificate_condition() {
    let dns = empty_dns().await;
    let Some(f) = Fixture::new_with("op-cert", |args| {
        args.acme.enabled = true;
        args.acme.directory = "https://127.0.0.1:9/directory".into();
        args.acme.dns_server = Some(dns);
    })
    .await
    else {
        return;
    };
    let (stop, task) = f.operator();
    let fqdn = format!("app-{}.example.org", &f.ns.name[f.ns.name.len() - 8..]);
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "app"}, "spec": {"fqdn": fqdn}})).await;
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "sub"}, "spec": {"name": format!("s{}", &f.ns.name[f.ns.name.len() - 8..])}})).await;
    f.wait_reason::<Domain>("app", "Reserved").await;
    let api = f.api::<Domain>();
    let d = wait_until("CertificateReady DnsMismatch", WAIT, || async {
        let v = serde_json::to_value(api.get("app").await?)?;
        let c = v["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "CertificateReady"))
            .cloned();
        Ok(c.filter(|c| c["reason"] == "DnsMismatch").map(|_| v))
    })
    .await
    .unwrap();
    let c = &d["status"]["conditions"][1];
    assert_eq!(c["status"], "False", "{d}");
    let message = c["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("{fqdn} has no A/AAAA record")) && message.contains("CNAME"),
        "{message}"
    );
    assert_eq!(d["status"]["cnameTarget"], "edge.test");
    assert!(d["status"].get("certificateExpiry").is_none(), "{d}");
    wait_until("Warning event", WAIT, || async {
        Ok(f.events_for("app")
            .await
            .iter()
            .any(|(t, r, _)| t == "Warning" && r == "CertificateDnsMismatch")
            .then_some(()))
    })
    .await
    .unwrap();
    // The edge reports the same to `culvert admin domain list`.
    let (_, r) = f.edge.api("GET", &format!("domains/{fqdn}"), None).await;
    assert_eq!(r["certificate"]["status"], "dns_mismatch", "{r}");
    // A subdomain has no certificate condition (the edge's own certificate covers it).
    let sub = f.wait_reason::<Domain>("sub", "Reserved").await;
    assert_eq!(sub["status"]["conditions"].as_array().unwrap().len(), 1, "{sub}");
    f.finish(stop, task).await;
}
