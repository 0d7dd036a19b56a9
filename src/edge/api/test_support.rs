//! The unit tests' edge: a real store in a temporary directory, hooks that
//! count, and a `call` that checks the shape of every error.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use super::{ApiContext, EdgeHooks, handle};
use crate::api::PortRange;
use crate::constants::API_PREFIX;
use crate::edge::store::Store;

#[derive(Default)]
pub(super) struct FakeHooks {
    pub(super) changes: AtomicUsize,
    pub(super) connections: Mutex<HashMap<String, usize>>,
}

impl EdgeHooks for FakeHooks {
    fn state_changed(&self) -> futures_util::future::BoxFuture<'_, ()> {
        self.changes.fetch_add(1, Ordering::SeqCst);
        Box::pin(std::future::ready(()))
    }
    fn connections_for_key(&self, key_id: &str) -> usize {
        self.connections.lock().unwrap().get(key_id).copied().unwrap_or(0)
    }
}

pub(super) struct Edge {
    pub(super) ctx: ApiContext,
    pub(super) hooks: Arc<FakeHooks>,
    pub(super) admin: String,
    _dir: tempfile::TempDir,
}

pub(super) fn edge() -> Edge {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let admin = store.engine().ensure_admin_key().unwrap().unwrap();
    let hooks = Arc::new(FakeHooks::default());
    let ctx = ApiContext {
        store,
        domain: "Edge.Example.com.".into(),
        public_host: "edge.example.com".into(),
        public_https_port: 443,
        tcp_ports: PortRange { first: 20000, last: 20002 },
        acme: false,
        hooks: hooks.clone(),
        reserved_names: super::RESERVED_NAMES.iter().map(|n| n.to_string()).collect(),
        serial: Default::default(),
    };
    Edge { ctx, hooks, admin, _dir: dir }
}

impl Edge {
    pub(super) async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = Request::builder().method(method).uri(format!("{API_PREFIX}{path}"));
        if let Some(key) = key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let response = handle(&self.ctx, req.body(Full::new(Bytes::from(body))).unwrap()).await;
        let status = response.status();
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let value: Value = serde_json::from_slice(&bytes).unwrap();
        if !status.is_success() {
            // Every error has exactly this shape.
            let error = value["error"].as_object().unwrap_or_else(|| panic!("{value}"));
            assert!(error["code"].is_string() && error["message"].is_string(), "{value}");
            assert_eq!(error.len(), 2, "{value}");
            assert_eq!(value.as_object().unwrap().len(), 1, "{value}");
        }
        (status, value)
    }

    pub(super) async fn endpoints_key(&self, name: &str) -> String {
        let (status, v) = self
            .call(
                "POST",
                "api-keys",
                Some(&self.admin),
                Some(json!({"name": name, "scope": "endpoints", "customDomains": ["*"]})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{v}");
        v["secret"].as_str().unwrap().to_string()
    }
}

pub(super) fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}
