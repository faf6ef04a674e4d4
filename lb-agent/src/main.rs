use anyhow::Context as _;
use clap::Parser as _;
use lb_agent::{
    cli::{Cli, Command, InspectWhat},
    datapath, inspect, run,
};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the runtime")?
            .block_on(run::run(*args)),
        Command::Inspect { what } => match what {
            InspectWhat::Services { bpffs, json } => {
                let views = inspect::read_services(&bpffs)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&views)?);
                } else {
                    print!("{}", inspect::render_services(&views));
                }
                Ok(())
            }
            InspectWhat::Conntrack { bpffs, json } => {
                let views = lb_agent::tc::read_conntrack(&bpffs)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&views)?);
                } else {
                    print!("{}", lb_agent::tc::render_conntrack(&views));
                }
                Ok(())
            }
            InspectWhat::Affinity { bpffs, json } => {
                let views = inspect::read_affinity(&bpffs)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&views)?);
                } else {
                    print!("{}", inspect::render_affinity(&views));
                }
                Ok(())
            }
        },
        Command::Cleanup { bpffs } => {
            let links = datapath::detach_pinned_links(&bpffs)?;
            datapath::remove_pins(&bpffs)?;
            eprintln!(
                "detached {links} program links and removed {}",
                bpffs.display()
            );
            Ok(())
        }
    }
}
