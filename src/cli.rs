//! Command line of the one `culvert` binary: the global flags and one
//! subcommand per role. Each role owns its flags (`edge::config`,
//! `agent::config`, `operator::OperatorArgs`, `admin::AdminArgs`); this module
//! belongs to `main.rs` alone and nothing in the library depends on it.

use clap::{Parser, Subcommand};
use culvert::agent::AgentArgs;
use culvert::edge::EdgeArgs;
use culvert::telemetry::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "culvert",
    version,
    about = "Publish services of a cluster with no public address through your own edge"
)]
pub(crate) struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, env = "CULVERT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Worker threads of the edge, an agent or the operator. Default: one
    /// when the process may use two CPUs or fewer (its cgroup's CPU limit
    /// counts), one per CPU above.
    #[arg(long, global = true, env = "CULVERT_WORKER_THREADS", value_name = "N")]
    pub worker_threads: Option<std::num::NonZeroUsize>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the public edge: public HTTPS, the tunnel endpoint and the control API.
    Edge(Box<EdgeArgs>),
    /// Copy an SQLite edge's store (API keys, reservations, tunnel keys, ACME
    /// account, certificates) into an empty PostgreSQL database for several
    /// edges; every key keeps working. Stop the edge first.
    MigrateStore(culvert::edge::MigrateStoreArgs),
    /// Publish a local HTTP port through the edge (like `ngrok http 8080`).
    Http(AgentArgs),
    /// Publish a local TCP port through the edge.
    Tcp(AgentArgs),
    /// Publish a local UDP port through the edge (with a key of a UDP port
    /// reservation: `culvert admin tunnel-key create --port N --protocol udp`).
    Udp(AgentArgs),
    /// Manage API keys, domains, ports and tunnel keys on an edge.
    Admin(culvert::admin::AdminArgs),
    /// Run the Kubernetes operator and in-cluster agent.
    Operator(culvert::operator::OperatorArgs),
    /// Print the CustomResourceDefinitions (YAML) to apply before the operator.
    Crd,
    /// GET an http:// URL until it answers 2xx (the chart's `helm test`; the image has no curl).
    Probe(culvert::probe::ProbeArgs),
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn worker_threads_is_a_positive_count_on_any_command() {
        let cli = Cli::try_parse_from(["culvert", "crd", "--worker-threads", "3"]).unwrap();
        assert_eq!(cli.worker_threads.map(|n| n.get()), Some(3));
        assert!(Cli::try_parse_from(["culvert", "crd"]).unwrap().worker_threads.is_none());
        let zero = Cli::try_parse_from(["culvert", "--worker-threads", "0", "crd"]).unwrap_err();
        assert!(zero.to_string().contains("--worker-threads"), "{zero}");
    }
}
