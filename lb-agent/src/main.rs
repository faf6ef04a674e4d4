use anyhow::Context as _;
use clap::Parser as _;
use lb_agent::{
    check,
    cli::{Cli, Command},
    datapath::loader,
    inspect, run,
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
        Command::Inspect { what } => {
            print!("{}", inspect::show_what(&what)?);
            Ok(())
        }
        Command::Check(args) => check::check(&args),
        Command::Cleanup { bpffs } => {
            let links = loader::detach_pinned_links(&bpffs)?;
            let (filters, elsewhere) = lb_agent::datapath::tc::detach_filters(&bpffs)?;
            if !elsewhere.is_empty() {
                eprintln!(
                    "warning: clsact filters recorded on {elsewhere:?}, devices not in this \
                     network namespace: run `lb-agent cleanup` in the agent's namespace, or \
                     `tc filter del dev DEV ingress|egress pref 1 handle 0x4c42 bpf`"
                );
            }
            loader::remove_pins(&bpffs)?;
            eprintln!(
                "detached {links} program links and {filters} clsact filters and removed {}",
                bpffs.display()
            );
            Ok(())
        }
    }
}
