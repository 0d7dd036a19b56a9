//! Test support shared by the integration test crates, as one module tree.
//! Each crate declares it once and picks what it uses:
//!
//! ```ignore
//! mod support;
//! use support::net;                                   // edge, agents, backends, clients
//! use support::{kube as kube_env, netns, operator as fixture}; // the operator suites
//! ```
//!
//! A crate uses only part of it, hence `dead_code` is allowed here once.

#![allow(dead_code)]

/// A real BIND (`named`) on 127.0.0.1, primary for one zone.
pub mod bind;
/// A real Kubernetes control plane (the kube-env harness).
pub mod kube;
/// An in-process edge on 127.0.0.1, agents, backends and HTTPS clients.
pub mod net;
/// A backend host in a network namespace the test creates.
pub mod netns;
/// The operator fixture (needs `kube`, `net` and `netns`).
pub mod operator;
/// A real PostgreSQL from Debian on 127.0.0.1 (also used by the store suite in the lib).
pub mod postgres;
/// The abuse suite's bounds: another tunnel's latency, the edge's memory and descriptors.
pub mod watch;
