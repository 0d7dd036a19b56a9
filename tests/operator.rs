//! The operator against a real kube-apiserver (the kube-env harness) and a
//! real edge, each test in its own namespace with its own operator
//! (`--watch-namespace`), traffic to real backend processes.

mod support;
use support::{kube as kube_env, net, netns, operator as fixture};

use std::time::Duration;

use culvert::crd::{Domain, TcpPort, Tunnel, UdpPort};
use fixture::{Fixture, WAIT, service_with_endpoints};
use http::StatusCode;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::networking::v1::Ingress;
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

/// A UdpPort and a Tunnel of protocol udp to a Service's UDP port (beside a
/// TCP port of the same number): the UDP reservation at the edge, the
/// printer columns, a datagram echoed through the edge, and the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_port_and_udp_tunnel() {
    let Some(f) = Fixture::new("op-udp").await else { return };
    let Some(host) = netns::NetnsHost::create() else { return };
    let echo = fixture::udp_in(&host, 5300);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 2048];
        while let Ok((n, peer)) = echo.recv_from(&mut buf).await {
            let _ = echo.send_to(&buf[..n], peer).await;
        }
    });
    // DNS-like: TCP 53 and UDP 53; the udp Tunnel must pick the UDP one.
    service_with_endpoints(
        &f,
        "dns",
        &host.ip,
        json!({}),
        &[("tcp", 53, 5301, "TCP"), ("udp", 53, 5300, "UDP")],
    )
    .await;
    let (stop, task) = f.operator();
    let port = f.edge.tcp_ports.first;
    f.create::<UdpPort>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "UdpPort", "metadata": {"name": "dns"},
        "spec": {"port": port}}),
    )
    .await;
    let p = f.wait_reason::<UdpPort>("dns", "Reserved").await;
    assert_eq!(p["status"]["address"], format!("127.0.0.1:{port}"), "{p}");
    let (s, r) = f.edge.api("GET", &format!("ports/{port}?protocol=udp"), None).await;
    assert_eq!((s, &r["protocol"]), (StatusCode::OK, &json!("udp")), "{r}");
    assert_eq!(
        f.edge.api("GET", &format!("ports/{port}"), None).await.0,
        StatusCode::NOT_FOUND,
        "no TCP port"
    );
    f.create::<Tunnel>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "dns"},
        "spec": {"protocol": "udp", "udpPort": "dns", "service": {"name": "dns", "port": 53}}}),
    )
    .await;
    let t = f.wait_reason::<Tunnel>("dns", "Published").await;
    assert_eq!(t["status"]["url"], format!("udp://127.0.0.1:{port}"), "{t}");
    assert_eq!(t["status"]["backends"], json!([format!("{}:5300", host.ip)]), "the Service's UDP port: {t}");
    let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.connect(("127.0.0.1", port)).await.unwrap();
    wait_until("a datagram echoed through the edge", WAIT, || async {
        c.send(b"query").await?;
        let mut buf = [0u8; 16];
        let got = tokio::time::timeout(Duration::from_secs(2), c.recv(&mut buf)).await;
        Ok(got.ok().and_then(Result::ok).filter(|n| buf[..*n] == *b"query").map(|_| ()))
    })
    .await
    .unwrap();
    let (columns, rows) = table(&f, "udpports").await;
    assert_eq!(columns, ["Name", "Address", "Ready", "Reason", "Reclaim (wide)", "Age"]);
    assert_eq!(rows[0][1..4], [json!(format!("127.0.0.1:{port}")), json!("True"), json!("Reserved")]);
    // An invalid udp Tunnel is a condition.
    f.create::<Tunnel>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "bad"},
        "spec": {"protocol": "udp", "udpPort": "dns", "proxyProtocol": "v1", "service": {"name": "dns", "port": 53}}}))
    .await;
    let bad = f.wait_reason::<Tunnel>("bad", "InvalidSpec").await;
    assert!(
        condition(&bad, "Ready").unwrap()["message"].as_str().unwrap().contains("v1 has no UDP form"),
        "{bad}"
    );
    f.api::<Tunnel>().delete("bad", &DeleteParams::default()).await.unwrap();
    f.api::<Tunnel>().delete("dns", &DeleteParams::default()).await.unwrap();
    f.api::<UdpPort>().delete("dns", &DeleteParams::default()).await.unwrap();
    wait_until("UDP port released", WAIT, || async {
        let gone =
            f.edge.api("GET", &format!("ports/{port}?protocol=udp"), None).await.0 == StatusCode::NOT_FOUND;
        Ok(gone.then_some(()))
    })
    .await
    .unwrap();
    f.finish(stop, task).await;
}

/// The apiserver's table of `resource` in the test namespace, as `kubectl
/// get -o wide` prints it: the column names (`(wide)` after those of
/// priority > 0) and the rows' cells.
async fn table(f: &Fixture, resource: &str) -> (Vec<String>, Vec<Vec<Value>>) {
    let req = http::Request::get(format!("/apis/culvert.dev/v1alpha1/namespaces/{}/{resource}", f.ns.name))
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())
        .unwrap();
    let t: Value = serde_json::from_str(&f.client.request_text(req).await.unwrap()).unwrap();
    let columns = t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap();
            if c["priority"].as_i64().unwrap_or(0) > 0 { format!("{name} (wide)") } else { name.to_string() }
        })
        .collect();
    let rows = t["rows"].as_array().unwrap().iter().map(|r| r["cells"].as_array().unwrap().clone()).collect();
    (columns, rows)
}

fn condition(v: &Value, ty: &str) -> Option<Value> {
    v["status"]["conditions"].as_array().into_iter().flatten().find(|c| c["type"] == ty).cloned()
}

/// Takes the key Secrets away from the agents (they carry the Tunnels whose
/// Secret is labelled `culvert.dev/tunnel`), or gives them back.
async fn agents_see_keys(f: &Fixture, secrets: &[(&str, &str)], visible: bool) {
    for (secret, tunnel) in secrets {
        let label = if visible { json!(tunnel) } else { Value::Null };
        f.patch::<Secret>(secret, json!({"metadata": {"labels": {"culvert.dev/tunnel": label}}})).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_is_ready_only_while_an_agent_is_connected() {
    let Some(f) = Fixture::new("op-noagent").await else { return };
    let Some(mut host) = netns::NetnsHost::create() else { return };
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "hello").unwrap();
    host.serve_http(site.path(), 8000);
    service_with_endpoints(&f, "web", &host.ip, json!({}), &[("http", 80, 8000, "TCP")]).await;
    service_with_endpoints(
        &f,
        "lb",
        &host.ip,
        json!({"type": "LoadBalancer", "loadBalancerClass": "culvert.dev/tunnel"}),
        &[("tcp", 5432, 8000, "TCP")],
    )
    .await;
    let (stop, task) = f.operator();
    f.create::<Domain>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "web"},
        "spec": {"name": format!("n{}", f.suffix())}}),
    )
    .await;
    f.create::<Tunnel>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "web"},
        "spec": {"service": {"name": "web", "port": 80}, "domain": "web"}}),
    )
    .await;
    let tunnel_state = |want: &'static str| {
        let f = &f;
        async move {
            wait_until(&format!("Tunnel Ready {want}"), WAIT, || async {
                let v = serde_json::to_value(f.api::<Tunnel>().get("web").await?)?;
                Ok(condition(&v, "Ready").is_some_and(|c| c["status"] == want).then_some(v))
            })
            .await
            .unwrap()
        }
    };
    let service_state = |want: &'static str| {
        let f = &f;
        async move {
            wait_until(&format!("Service culvert.dev/Connected {want}"), WAIT, || async {
                let v = serde_json::to_value(f.api::<Service>().get("lb").await?)?;
                Ok(condition(&v, "culvert.dev/Connected").is_some_and(|c| c["status"] == want).then_some(v))
            })
            .await
            .unwrap()
        }
    };
    // And an Ingress for a host of the edge's domain.
    let host = format!("i{}.edge.test", f.suffix());
    f.create::<Ingress>(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "site"},
        "spec": {"ingressClassName": "culvert", "rules": [{"host": host, "http": {"paths": [{"path": "/",
            "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}}),
    )
    .await;
    let ingress_tunnel = culvert::operator::ingress::object_name(&host);
    let ingress_port = |connected: bool| {
        let f = &f;
        async move {
            wait_until(&format!("Ingress status, connected: {connected}"), WAIT, || async {
                let v = serde_json::to_value(f.api::<Ingress>().get("site").await?)?;
                let entry = &v["status"]["loadBalancer"]["ingress"][0];
                let port = &entry["ports"][0];
                let shown = entry["hostname"].is_string() && port["port"] == f.edge.https.port();
                Ok((shown && (port.get("error").is_none() == connected)).then_some(v))
            })
            .await
            .unwrap()
        }
    };
    tunnel_state("True").await;
    service_state("True").await;
    let v = ingress_port(true).await;
    assert_eq!(v["status"]["loadBalancer"]["ingress"][0]["hostname"], host.as_str());

    // No agent can get the keys (as when the agents cannot reach the edge): not Ready, and why.
    let ingress_key = format!("{ingress_tunnel}-culvert-key");
    let keys = [
        ("web-culvert-key", "web"),
        ("lb-lb-5432-culvert-key", "lb-lb-5432"),
        (ingress_key.as_str(), ingress_tunnel.as_str()),
    ];
    agents_see_keys(&f, &keys, false).await;
    let v = tunnel_state("False").await;
    let ready = condition(&v, "Ready").unwrap();
    assert_eq!(ready["reason"], "NoAgent", "{v}");
    let message = ready["message"].as_str().unwrap();
    assert!(message.contains("no agent is connected") && message.contains("edge.caBundle"), "{message}");
    let connected = condition(&v, "Connected").unwrap();
    assert_eq!((&connected["status"], &connected["reason"]), (&json!("False"), &json!("NoAgent")));
    assert_eq!(condition(&v, "Published").unwrap()["status"], "True", "still published: {v}");
    assert_eq!(v["status"]["agents"], 0);
    let events = f.events_for("web").await;
    assert!(events.iter().any(|(t, r, _)| t == "Normal" && r == "NoAgent"), "{events:?}");
    assert!(
        !events.iter().any(|(t, r, _)| t == "Warning" && r == "NoAgent"),
        "waiting for an agent is no warning: {events:?}"
    );
    // The printer columns say so.
    let (columns, rows) = table(&f, "tunnels").await;
    assert_eq!(columns, ["Name", "Service", "URL", "Agents", "Ready", "Reason", "Protocol (wide)", "Age"]);
    let row = rows.iter().find(|r| r[0] == "web").unwrap();
    assert_eq!(
        row[1..6],
        [json!("web"), v["status"]["url"].clone(), json!(0), json!("False"), json!("NoAgent")]
    );
    // The LoadBalancer Service too: the address stays, its port has an error, the condition says why.
    let svc = service_state("False").await;
    let c = condition(&svc, "culvert.dev/Connected").unwrap();
    assert_eq!(c["reason"], "NoAgent", "{svc}");
    assert!(c["message"].as_str().unwrap().contains("5432 (public "), "{c}");
    let port = &svc["status"]["loadBalancer"]["ingress"][0]["ports"][0];
    assert_eq!(port["error"], "culvert.dev/NoAgent", "{svc}");
    assert!(port["port"].as_u64().is_some());

    // The Ingress keeps its address (no flapping for external-dns), with the port error, and an event.
    let v = ingress_port(false).await;
    assert_eq!(v["status"]["loadBalancer"]["ingress"][0]["ports"][0]["error"], "culvert.dev/NoAgent");
    let events = f.events_for("site").await;
    assert!(events.iter().any(|(t, r, _)| t == "Normal" && r == "NoAgent"), "{events:?}");

    // The agents get the keys back: Ready again.
    agents_see_keys(&f, &keys, true).await;
    let v = tunnel_state("True").await;
    assert_eq!(condition(&v, "Connected").unwrap()["reason"], "AgentsConnected");
    let svc = service_state("True").await;
    assert!(svc["status"]["loadBalancer"]["ingress"][0]["ports"][0].get("error").is_none(), "{svc}");
    ingress_port(true).await;

    let (columns, rows) = table(&f, "domains").await;
    assert_eq!(columns, ["Name", "Host", "Ready", "Reason", "Certificate", "Reclaim (wide)", "Age"]);
    assert_eq!(rows[0][2..4], [json!("True"), json!("Reserved")]);
    assert_eq!(rows[0][5], "Delete");
    let (columns, rows) = table(&f, "tcpports").await;
    assert_eq!(columns, ["Name", "Address", "Ready", "Reason", "Reclaim (wide)", "Age"]);
    assert_eq!(rows[0][2..4], [json!("True"), json!("Reserved")]);
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
    // Every status the Tunnel goes through, from its creation on: Ready only
    // once an agent is connected (the first published status cannot have one:
    // the key was minted in that same reconcile).
    let seen = {
        use futures_util::{StreamExt, TryStreamExt};
        let wp = kube::api::WatchParams::default().fields("metadata.name=web");
        let mut events = f.api::<Tunnel>().watch(&wp, &t.resource_version().unwrap()).await.unwrap().boxed();
        let mut seen = Vec::new();
        let ready = tokio::time::timeout(WAIT, async {
            while let Some(ev) = events.try_next().await.unwrap() {
                let kube::api::WatchEvent::Modified(t) = ev else { continue };
                let status = t.status.unwrap_or_default();
                let of = |ty: &str| {
                    status
                        .conditions
                        .iter()
                        .find(|c| c.type_ == ty)
                        .map(|c| (c.status.clone(), c.reason.clone()))
                };
                let (ready, published, connected) = (of("Ready"), of("Published"), of("Connected"));
                seen.push((ready.clone(), published, connected, status.agents));
                if ready.is_some_and(|r| r.0 == "True") {
                    return;
                }
            }
        })
        .await;
        assert!(ready.is_ok(), "never Ready: {seen:?}");
        seen
    };
    let p = |s: &str, r: &str| Some((s.to_string(), r.to_string()));
    let first_published = seen.iter().position(|s| s.1 == p("True", "Published")).expect("published");
    assert_eq!(
        seen[first_published],
        (p("False", "NoAgent"), p("True", "Published"), p("False", "NoAgent"), 0),
        "published without an agent is not Ready: {seen:?}"
    );
    let last = seen.last().unwrap();
    assert_eq!((&last.0, &last.2), (&p("True", "Published"), &p("True", "AgentsConnected")), "{seen:?}");
    assert!(last.3 >= 1, "{seen:?}");
    assert!(
        seen.iter().all(|s| s.0.as_ref().is_none_or(|r| r.0 != "True") || s.3 >= 1),
        "never Ready without an agent: {seen:?}"
    );
    let status = wait_until("Tunnel published with an agent", WAIT, || async {
        let v = serde_json::to_value(f.api::<Tunnel>().get("web").await?)?;
        Ok((v["status"]["conditions"][0]["reason"] == "Published"
            && v["status"]["agents"].as_u64() >= Some(1))
        .then_some(v))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}", f.edge.edge().registry.count_for_key("x")));
    let public = format!("{label}.edge.test");
    let url = format!("https://{public}:{}", f.edge.https.port());
    assert_eq!(status["status"]["url"], url);
    // `kubectl get tunnels -o wide`: the apiserver's table of the printer columns.
    let (columns, rows) = table(&f, "tunnels").await;
    assert_eq!(columns, ["Name", "Service", "URL", "Agents", "Ready", "Reason", "Protocol (wide)", "Age"]);
    assert_eq!(
        rows[0][..6],
        [json!("web"), json!("web"), json!(url), json!(1), json!("True"), json!("Published")]
    );
    assert_eq!(rows[0][6], "http");
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

/// The in-cluster agent keeps a connection to every edge of `--edge`: edge B
/// (same store as A) is down when the operator starts, comes back on its
/// port, and serves the Tunnel as soon as the agents' probes find it; A keeps
/// serving when B goes again. (Both edges read the reservation from the store
/// when they start; telling running edges about changes is the change feed's
/// job, not tested here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_connect_to_every_edge() {
    let Some(f) = Fixture::new("op-edges").await else { return };
    let Some(mut host) = netns::NetnsHost::create() else { return };
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "hello from the cluster").unwrap();
    host.serve_http(site.path(), 8000);
    service_with_endpoints(&f, "web", &host.ip, json!({}), &[("http", 80, 8000, "TCP")]).await;

    // Edge B on A's data dir: started once for a port, then down.
    let mut b_args = f.edge.args.clone();
    b_args.https_addr = "127.0.0.1:0".parse().unwrap();
    b_args.tcp_ports = net::free_port_range(4);
    let b = culvert::edge::start(b_args.clone()).await.expect("edge B starts");
    b_args.https_addr = b.https_addr;
    b.stop().await;
    let mut args = f.args("solo");
    args.edge.push(format!("https://{}", b_args.https_addr));
    let (stop, task) = f.operator_with(args);

    let label = format!("t{}", f.suffix());
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "web"}, "spec": {"name": label}})).await;
    f.create::<Tunnel>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "web"},
        "spec": {"service": {"name": "web", "port": "http"}, "domain": "web"}}),
    )
    .await;
    let public = format!("{label}.edge.test");
    let via_a = wait_until("request through edge A", WAIT, || async {
        let (s, b) = f.edge.client().get(&public, "/").await;
        Ok((s == StatusCode::OK).then_some(b))
    })
    .await
    .unwrap();
    assert_eq!(via_a, "hello from the cluster");

    // B comes back: the agents were probing it; it holds the request until they are there.
    let b = culvert::edge::start(b_args.clone()).await.expect("edge B restarts");
    let client_b = net::HttpsClient { addr: b.https_addr, ca_file: f.edge.ca_file.clone() };
    let (status, body) = client_b.get(&public, "/").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "hello from the cluster"), "via edge B");
    assert_eq!(
        b.edge.registry.count_for_key(&f.edge.tunnel_key_id(|_| true).await),
        1,
        "one connection at B"
    );

    // B goes again: A serves on.
    b.stop().await;
    let (status, body) = f.edge.client().get(&public, "/").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "hello from the cluster"), "via edge A");
    f.finish(stop, task).await;
}

/// The operator's control-API calls fail over: edge B shares A's store and
/// is the second `--edge`; with A (the first) stopped, a Domain and a
/// TcpPort are reserved through B, and their release at the end too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciles_go_to_the_next_edge_when_the_first_is_down() {
    let Some(mut f) = Fixture::new("op-failover").await else { return };
    let mut b_args = f.edge.args.clone();
    b_args.https_addr = "127.0.0.1:0".parse().unwrap();
    b_args.tcp_ports = net::free_port_range(4);
    let b = culvert::edge::start(b_args.clone()).await.expect("edge B starts");
    let mut args = f.args("solo");
    args.edge.push(format!("https://{}", b.https_addr));
    let (stop, task) = f.operator_with(args);
    let client_b = net::HttpsClient { addr: b.https_addr, ca_file: f.edge.ca_file.clone() };
    let admin_key = f.edge.admin_key.clone();
    let on_b = |path: String| {
        let (client_b, key) = (client_b.clone(), admin_key.clone());
        async move {
            let req = http::Request::get(format!("/_culvert/v1/api/{path}"))
                .header("authorization", format!("Bearer {key}"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap();
            client_b.send("127.0.0.1", req, false).await.unwrap().status()
        }
    };

    let one = format!("a{}", f.suffix());
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "one"}, "spec": {"name": one}})).await;
    f.wait_reason::<Domain>("one", "Reserved").await;

    // A goes: the next calls go to B.
    f.edge.stop().await;
    let two = format!("b{}", f.suffix());
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "two"}, "spec": {"name": two}})).await;
    f.create::<TcpPort>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "TcpPort", "metadata": {"name": "db"}, "spec": {}})).await;
    f.wait_reason::<Domain>("two", "Reserved").await;
    let p = f.wait_reason::<TcpPort>("db", "Reserved").await;
    let port = p["status"]["port"].as_u64().unwrap() as u16;
    assert!(b_args.tcp_ports.contains(port), "B's range: {p}");
    assert_eq!(on_b(format!("domains/{two}.edge.test")).await, StatusCode::OK);
    assert_eq!(on_b(format!("ports/{port}")).await, StatusCode::OK);

    // The releases at the end go to B too.
    f.api::<Domain>().delete("two", &DeleteParams::default()).await.unwrap();
    wait_until("domain released through B", WAIT, || async {
        Ok((on_b(format!("domains/{two}.edge.test")).await == StatusCode::NOT_FOUND).then_some(()))
    })
    .await
    .unwrap();
    f.finish(stop, task).await;
    b.stop().await;
}
