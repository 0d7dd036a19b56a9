//! The operator's client of the edge's control API: the shared async client
//! ([`crate::api_client`]) behind a cheap clone, with 404 read as "absent".
//! With several edges (`--edge` repeated, chart `edge.urls`) a call fails
//! over to the next edge when one does not answer.

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::{
    CreateTunnelKeyRequest, CreatedTunnelKey, Info, Reservation, ReserveDomainRequest, ReservePortRequest,
};
use crate::api_client::{Client, ClientError};

#[derive(Clone)]
pub struct EdgeClient(Arc<Client>);

impl EdgeClient {
    /// A client of the edges of `--edge` (sharing one store), tried in this order.
    pub fn with_edges<S: AsRef<str>>(
        edges: &[S],
        key: &str,
        ca_file: Option<&Path>,
    ) -> Result<Self, ClientError> {
        Ok(EdgeClient(Arc::new(Client::with_edges(edges, key, ca_file, true)?)))
    }

    /// The base URL of the edge that answered last.
    pub fn current_edge(&self) -> String {
        self.0.current_edge().trim_end_matches(crate::constants::API_PREFIX).to_string()
    }

    /// Checks the key and learns the edge's domain.
    pub async fn check(&self) -> Result<Info, ClientError> {
        self.0.info().await
    }

    /// `GET path`; `None` when the edge answers 404.
    pub async fn get<T: DeserializeOwned>(&self, path: String) -> Result<Option<T>, ClientError> {
        absent_as_none(self.0.get(&path, &[]).await)?.map(|a| a.decode()).transpose()
    }

    /// Lists `path` (`domains`, `tunnel-keys`...) with a label selector.
    pub async fn list<T: DeserializeOwned>(
        &self,
        path: &'static str,
        selector: String,
    ) -> Result<Vec<T>, ClientError> {
        self.0.list(path, &selector).await
    }

    /// Lists `path` with a label selector and more query parameters.
    pub async fn list_with<T: DeserializeOwned>(
        &self,
        path: &'static str,
        selector: String,
        more: &[(&str, &str)],
    ) -> Result<Vec<T>, ClientError> {
        let mut query = vec![("selector", selector.as_str())];
        query.extend_from_slice(more);
        let list: crate::api::List<T> = self.0.get(path, &query).await?.decode()?;
        Ok(list.items)
    }

    /// `POST path` with a JSON body (one of the request types of [`crate::api`]).
    pub async fn post<T: DeserializeOwned>(
        &self,
        path: &'static str,
        body: impl Serialize,
    ) -> Result<T, ClientError> {
        self.0.post(path, &body).await?.decode()
    }

    /// `POST domains`; the reservation and whether it is new.
    pub async fn reserve_domain(&self, r: &ReserveDomainRequest) -> Result<(Reservation, bool), ClientError> {
        self.0.reserve_domain(r).await
    }

    /// `POST ports`; the reservation and whether it is new.
    pub async fn reserve_port(&self, r: &ReservePortRequest) -> Result<(Reservation, bool), ClientError> {
        self.0.reserve_port(r).await
    }

    /// `POST tunnel-keys`: a new key and its secret.
    pub async fn create_tunnel_key(
        &self,
        r: &CreateTunnelKeyRequest,
    ) -> Result<CreatedTunnelKey, ClientError> {
        self.0.create_tunnel_key(r).await
    }

    /// `DELETE path`; `false` when it was already gone.
    pub async fn delete(&self, path: String) -> Result<bool, ClientError> {
        Ok(absent_as_none(self.0.delete(&path).await)?.is_some())
    }
}

fn absent_as_none<T>(r: Result<T, ClientError>) -> Result<Option<T>, ClientError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(ClientError::Refused { status: 404, .. }) => Ok(None),
        Err(e) => Err(e),
    }
}
