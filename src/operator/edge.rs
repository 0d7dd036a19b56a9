//! The operator's client of the edge's control API: the blocking admin
//! client, run on the blocking pool.

use std::path::Path;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::admin::{AdminError, Client};
use crate::api::Info;

#[derive(Clone)]
pub struct EdgeClient(Arc<Client>);

impl EdgeClient {
    pub fn new(edge: &str, key: &str, ca_file: Option<&Path>) -> Result<Self, AdminError> {
        Ok(EdgeClient(Arc::new(Client::new(edge, key, ca_file, true)?)))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Client) -> Result<T, AdminError> + Send + 'static,
    ) -> Result<T, AdminError> {
        let client = self.0.clone();
        tokio::task::spawn_blocking(move || f(&client)).await.expect("edge API call panicked")
    }

    /// Checks the key and learns the edge's domain.
    pub async fn check(&self) -> Result<Info, AdminError> {
        let v = self.blocking(|c| c.get("info", &[])).await?;
        decode(v)
    }

    /// `GET path`; `None` when the edge answers 404.
    pub async fn get<T: DeserializeOwned>(&self, path: String) -> Result<Option<T>, AdminError> {
        match self.blocking(move |c| c.get(&path, &[])).await {
            Ok(v) => decode(v).map(Some),
            Err(AdminError::Refused { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Lists `path` (`domains`, `tunnel-keys`...) with a label selector.
    pub async fn list<T: DeserializeOwned>(
        &self,
        path: &'static str,
        selector: String,
    ) -> Result<Vec<T>, AdminError> {
        let v = self.blocking(move |c| c.get(path, &[("selector", &selector)])).await?;
        let list: crate::api::List<T> = decode(v)?;
        Ok(list.items)
    }

    pub async fn post<T: DeserializeOwned>(&self, path: &'static str, body: Value) -> Result<T, AdminError> {
        let (v, _) = self.blocking(move |c| c.post(path, &body)).await?;
        decode(v)
    }

    /// `DELETE path`; `false` when it was already gone.
    pub async fn delete(&self, path: String) -> Result<bool, AdminError> {
        match self.blocking(move |c| c.delete(&path)).await {
            Ok(_) => Ok(true),
            Err(AdminError::Refused { status: 404, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn decode<T: DeserializeOwned>(v: Value) -> Result<T, AdminError> {
    serde_json::from_value(v).map_err(|e| AdminError::UnexpectedAnswer {
        url: "the edge".into(),
        status: 200,
        detail: format!("unexpected JSON: {e}"),
    })
}
