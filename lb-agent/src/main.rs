use anyhow::Context as _;
use clap::Parser as _;
use lb_agent::{
    check,
    cli::{Cli, Command},
    datapath::loader,
    inspect, run,
};
use tracing_subscriber::EnvFilter;

/// glibc's allocator, set for a daemon whose largest allocations are a
/// sync's temporary vectors and the pages of a list. Blocks of 4 MiB or
/// more are mapped apart and go back to the kernel when freed (the default
/// threshold rises to the largest block freed, up to 32 MiB, and the heap
/// then keeps them); up to 16 MiB free at the heap's top is kept rather
/// than trimmed, so the list pages (~275 KiB each at 500 objects) and a
/// sync's vectors reuse memory instead of faulting fresh pages in for each
/// one. Two arenas, one a core, keep the parallel decoding of a large
/// input from leaving free memory behind in an arena per thread.
///
/// Measured with `lb-bench-suite --only-ours` at 10 000 Services x 10
/// endpoints, alternated: a threshold of 128 KiB (trimming at the default
/// 128 KiB) against this, first sync in cluster mode (input to maps)
/// medians 274 -> 238 ms (8 rounds each) and 307 -> 286 ms (7), peak RSS
/// 54.8 -> 57.3 MiB (manifests 56.6 -> 58.7); at 100 000 Services peak RSS
/// 314.8 and 314.6 MiB. glibc's own dynamic threshold was as fast and took
/// 323.9 MiB there.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called first thing in `main`, before any other thread runs
    // or allocates much.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 16 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn main() -> anyhow::Result<()> {
    tune_allocator();
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
            let (filters, elsewhere) = lb_agent::datapath::clsact::detach_filters(&bpffs)?;
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
