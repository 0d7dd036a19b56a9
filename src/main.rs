//! `culvert`: parse the command line, set up TLS and logging, start a role.

use std::process::ExitCode;

mod cli;

/// musl's allocator serializes every allocation; the static builds use mimalloc.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use cli::{Cli, Command};
use culvert::api::Protocol;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The message, then each cause that it does not already say.
            eprintln!("error: {e}");
            let mut said = e.to_string();
            for cause in e.chain().skip(1) {
                let cause = cause.to_string();
                if !said.contains(&cause) {
                    eprintln!("  caused by: {cause}");
                    said.push_str(&cause);
                }
            }
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    culvert::telemetry::init(cli.log_format);
    match cli.command {
        Command::Admin(args) => culvert::admin::run(args)?,
        Command::Crd => print!("{}", culvert::crd::crds_yaml()),
        Command::Probe(args) => culvert::probe::run(args)?,
        command => {
            let runtime = culvert::runtime::build(cli.worker_threads)?;
            runtime.block_on(async move {
                culvert::memory::spawn_trimmer();
                match command {
                    Command::Edge(args) => culvert::edge::run(*args).await.map_err(anyhow::Error::from),
                    Command::MigrateStore(args) => {
                        culvert::edge::migrate_store(args).await.map_err(anyhow::Error::from)
                    }
                    Command::Http(args) => {
                        culvert::agent::run_standalone(args, Protocol::Http).await.map_err(Into::into)
                    }
                    Command::Operator(args) => culvert::operator::run(args).await,
                    Command::Tcp(args) => {
                        culvert::agent::run_standalone(args, Protocol::Tcp).await.map_err(Into::into)
                    }
                    Command::Udp(args) => {
                        culvert::agent::run_standalone(args, Protocol::Udp).await.map_err(Into::into)
                    }
                    Command::Admin(_) | Command::Crd | Command::Probe(_) => unreachable!("handled above"),
                }
            })?;
        }
    }
    Ok(())
}
