//! Leader election with a `coordination.k8s.io/v1` Lease: one replica
//! reconciles, all of them carry traffic. A leader that stops renewing loses
//! the lease after its duration; one that shuts down releases it at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::names::LEASE;

pub struct Elector {
    api: Api<Lease>,
    identity: String,
    duration: Duration,
}

impl Elector {
    pub fn new(client: Client, namespace: &str, identity: String, duration: Duration) -> Self {
        Elector { api: Api::namespaced(client, namespace), identity, duration }
    }

    fn retry(&self) -> Duration {
        self.duration / 3
    }

    /// Waits until this replica holds the lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_take(false).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => warn!(error = %e, "leader election: cannot read or write the Lease"),
            }
            tokio::time::sleep(self.retry()).await;
        }
    }

    /// Renews the lease until `stop`; resolves if the lease is lost.
    pub async fn hold(&self, stop: CancellationToken) {
        let mut last_renewed = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.retry()) => {}
                _ = stop.cancelled() => return std::future::pending().await,
            }
            match self.try_take(true).await {
                Ok(true) => last_renewed = tokio::time::Instant::now(),
                Ok(false) => return,
                Err(e) => {
                    warn!(error = %e, "leader election: renewal failed");
                    if last_renewed.elapsed() >= self.duration {
                        return;
                    }
                }
            }
        }
    }

    /// Gives the lease up so another replica takes over without waiting.
    pub async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(LEASE).await {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() == Some(&self.identity) {
                spec.holder_identity = None;
                spec.renew_time = None;
                let _ = self.api.replace(LEASE, &PostParams::default(), &lease).await;
            }
        }
    }

    /// Takes or renews the lease; `renew_only` fails if someone else holds it.
    async fn try_take(&self, renew_only: bool) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let seconds = self.duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(LEASE).await? else {
            if renew_only {
                return Ok(false);
            }
            let lease = Lease {
                metadata: ObjectMeta { name: Some(LEASE.into()), ..Default::default() },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let mine = spec.holder_identity.as_deref() == Some(&self.identity);
        let expired = match (&spec.holder_identity, &spec.renew_time) {
            (None, _) | (_, None) => true,
            (Some(_), Some(MicroTime(renewed))) => {
                let held = SignedDuration::from_secs(spec.lease_duration_seconds.unwrap_or(seconds) as i64);
                renewed.checked_add(held).map(|until| until < now).unwrap_or(true)
            }
        };
        if !mine && (renew_only || !expired) {
            debug!(holder = ?spec.holder_identity, "lease held by another replica");
            return Ok(false);
        }
        if !mine {
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(MicroTime(now));
        // The resourceVersion from the read makes this a compare-and-swap.
        match self.api.replace(LEASE, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}
