use clap::Parser as _;
use lb_agent::cli::Cli;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    println!("{cli:?}");
    Ok(())
}
