//! Smoke tests against the real control plane from `scripts/kube-env` (see tests/support/kube.rs):
//! CRD + structural schema, status subresource with server-side apply, owner-reference garbage
//! collection, namespace deletion. Skipped (with a message) when no harness is configured, unless
//! `CI` is set.

mod support;
use support::kube as kube_env;

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ObjectMeta, Patch, PatchParams,
    PostParams,
};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::json;

const MANAGER: &str = "culvert-smoke";

fn widget_crd() -> serde_json::Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.smoke.culvert.dev" },
        "spec": {
            "group": "smoke.culvert.dev",
            "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": { "status": {} },
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": { "type": "object", "properties": { "size": { "type": "integer" } } },
                        "status": { "type": "object", "properties": {
                            "phase": { "type": "string" },
                            "observedSize": { "type": "integer" }
                        } }
                    }
                } }
            }]
        }
    })
}

#[tokio::test]
async fn crd_status_subresource_server_side_apply() -> anyhow::Result<()> {
    let Some(env) = kube_env::connect().await else { return Ok(()) };

    // 1. CRD, applied server-side (idempotent across runs), then wait for Established.
    let crds = Api::<CustomResourceDefinition>::all(env.client.clone());
    let crd_name = "widgets.smoke.culvert.dev";
    crds.patch(crd_name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(widget_crd()))
        .await
        .context("applying the CRD")?;
    tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(crds, crd_name, conditions::is_crd_established()),
    )
    .await
    .context("CRD not Established within 30s")??;

    let ns = env.namespace("smoke-crd").await?;
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("smoke.culvert.dev", "v1", "Widget"),
        "widgets",
    );
    let widgets: Api<DynamicObject> = Api::namespaced_with(env.client.clone(), &ns.name, &ar);

    // 2. Custom object. Retried briefly: the new API can take a moment to be served everywhere.
    let widget = DynamicObject::new("w1", &ar).within(&ns.name).data(json!({ "spec": { "size": 3 } }));
    let created = kube_env::wait_until("creating widget w1", Duration::from_secs(20), || {
        let (widgets, widget) = (widgets.clone(), widget.clone());
        async move { Ok(Some(widgets.create(&PostParams::default(), &widget).await?)) }
    })
    .await?;
    assert_eq!(created.data["spec"]["size"], 3);

    // The structural schema is enforced: a string where an integer belongs is rejected.
    let bad = DynamicObject::new("bad", &ar).within(&ns.name).data(json!({ "spec": { "size": "three" } }));
    match widgets.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 422, "unexpected rejection: {status:?}"),
        other => panic!("schema violation was not rejected: {other:?}"),
    }

    // 3. Status through the status subresource, server-side apply.
    let status_patch = json!({
        "apiVersion": "smoke.culvert.dev/v1",
        "kind": "Widget",
        "metadata": { "name": "w1" },
        "status": { "phase": "Ready", "observedSize": 3 }
    });
    widgets
        .patch_status("w1", &PatchParams::apply(MANAGER), &Patch::Apply(&status_patch))
        .await
        .context("server-side apply of the status")?;

    // 4. Read back.
    let got = widgets.get("w1").await?;
    assert_eq!(got.data["status"]["phase"], "Ready");
    assert_eq!(got.data["status"]["observedSize"], 3);
    assert_eq!(got.data["spec"]["size"], 3, "status apply must not touch spec");
    let managed = got.metadata.managed_fields.unwrap_or_default();
    assert!(
        managed.iter().any(|m| m.manager.as_deref() == Some(MANAGER)
            && m.operation.as_deref() == Some("Apply")
            && m.subresource.as_deref() == Some("status")),
        "no Apply entry for {MANAGER} on the status subresource: {managed:?}"
    );

    // A status subresource ignores spec changes sent to it.
    widgets
        .patch_status("w1", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "size": 99 } })))
        .await?;
    assert_eq!(widgets.get("w1").await?.data["spec"]["size"], 3);

    // 5. The namespace (with the custom object in it) is finalized by the namespace controller.
    ns.delete_and_wait().await
}

#[tokio::test]
async fn owner_reference_garbage_collection() -> anyhow::Result<()> {
    let Some(env) = kube_env::connect().await else { return Ok(()) };
    let ns = env.namespace("smoke-gc").await?;
    let cms: Api<ConfigMap> = ns.api();

    let cm = |name: &str, owner: Option<OwnerReference>| ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        data: Some([("k".to_string(), name.to_string())].into()),
        ..Default::default()
    };
    let owner = cms.create(&PostParams::default(), &cm("owner", None)).await?;
    let owner_ref = OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "owner".into(),
        uid: owner.metadata.uid.clone().context("owner has no uid")?,
        block_owner_deletion: Some(true),
        controller: Some(true),
    };
    let owned = cms.create(&PostParams::default(), &cm("owned", Some(owner_ref))).await?;
    assert_eq!(owned.metadata.owner_references.as_ref().map(Vec::len), Some(1));

    cms.delete("owner", &DeleteParams::background()).await?;
    kube_env::wait_until("the owned ConfigMap to be garbage-collected", Duration::from_secs(60), || {
        let cms = cms.clone();
        async move { Ok(cms.get_opt("owned").await?.is_none().then_some(())) }
    })
    .await?;
    assert!(cms.get_opt("owner").await?.is_none(), "owner still exists");

    ns.delete_and_wait().await
}
