//! The standalone agent's command line (`culvert http|tcp`).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// What to publish: `PORT`, `HOST:PORT` or (http) `http://HOST:PORT`.
    pub target: String,

    /// The edge's URL, e.g. https://edge.example.com. Several edges: repeat
    /// the flag or separate URLs with commas; the agent keeps one connection
    /// to each, and to each address of a name that resolves to several.
    #[arg(long, env = "CULVERT_EDGE", value_delimiter = ',', required = true)]
    pub edge: Vec<String>,

    /// The tunnel key (made by `culvert admin tunnel-key create`).
    #[arg(long, env = "CULVERT_KEY", hide_env_values = true)]
    pub key: String,

    /// Trust this PEM CA instead of the built-in Mozilla roots (for --self-signed edges).
    #[arg(long, env = "CULVERT_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}
