//! Developer tasks: `cargo xtask <command>` (alias in `.cargo/config.toml`).
mod bench;
mod build;
mod chaos;
mod demo;
mod fuzz;
mod kernels;
mod setup;
mod test;

use std::{
    env,
    path::{Path, PathBuf},
    process::{Command, ExitCode, ExitStatus},
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

/// Prints one `xtask: ...` progress line.
macro_rules! step {
    ($($arg:tt)*) => { println!("xtask: {}", format_args!($($arg)*)) };
}
pub(crate) use step;

#[derive(Parser)]
#[command(about = "Developer tasks for the eBPF load balancer")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need (rust-src, bpf-linker, bpftool, ...)
    Setup,
    /// Build the kernel programs (lb-ebpf) for bpfel-unknown-none
    BuildEbpf {
        /// Use the dev profile instead of release
        #[arg(long)]
        debug: bool,
    },
    /// Build the kernel programs, lb-agent and the integration test helpers
    Build,
    /// Run setup, build, unit tests and (as root) the integration tests
    Test {
        /// Extra arguments for the integration test binary
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run the fuzz targets (manifests, translation and reconciler; HTTP
    /// servers; tc programs, as root) longer than `cargo xtask test` does
    Fuzz {
        /// Each target's short case count times 40 (minutes)
        #[arg(long, conflicts_with = "cases")]
        long: bool,
        /// This many cases for every target
        #[arg(long)]
        cases: Option<u32>,
        /// Repeat rounds of fresh cases until this many seconds have passed
        #[arg(long, value_name = "SECONDS")]
        time: Option<u64>,
    },
    /// Run setup, build, then the lb-demo binary
    Demo,
    /// Boot Debian's 5.10 and 6.1 kernels in VMs (virtme-ng, TCG) and run the smoke test in
    /// each, and on this machine's kernel; writes KERNELS.md (as root, minutes per kernel)
    Kernels {
        /// Only write KERNELS.md from the results of the last run
        #[arg(long)]
        table_only: bool,
        /// Only `lb-agent check` on each kernel (every program loaded and
        /// verified, minutes instead of most of an hour per kernel); prints
        /// its output and leaves KERNELS.md alone
        #[arg(long, conflicts_with = "table_only")]
        check_only: bool,
    },
    /// Run setup, build, then the benchmark (as root); writes BENCHMARKS.md and docs/bench.png
    Bench {
        /// Small scale points, few rounds, short runs: a few minutes
        #[arg(long)]
        quick: bool,
    },
    /// Run setup, build, then the chaos suite (as root): faults under load, ~10 minutes;
    /// writes RELIABILITY.md
    Chaos {
        /// Short phases: about two minutes (what `cargo xtask test` runs)
        #[arg(long)]
        quick: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Cmd::Setup => setup::setup().map(|()| ExitCode::SUCCESS),
        Cmd::BuildEbpf { debug } => build::build_ebpf(&root, debug).map(|_| ExitCode::SUCCESS),
        Cmd::Build => build::build(&root).map(|_| ExitCode::SUCCESS),
        Cmd::Test { args } => test::test(&root, &args),
        Cmd::Fuzz { long, cases, time } => fuzz::fuzz(&root, fuzz::Budget { long, cases, time }),
        Cmd::Demo => demo::demo(&root),
        Cmd::Kernels {
            table_only,
            check_only,
        } => kernels::kernels(&root, table_only, check_only).map(|()| ExitCode::SUCCESS),
        Cmd::Bench { quick } => bench::bench(&root, quick),
        Cmd::Chaos { quick } => chaos::chaos(&root, quick),
    };
    result.unwrap_or_else(|err| {
        eprintln!("xtask: error: {err:#}");
        ExitCode::FAILURE
    })
}

/// The workspace root: the parent of xtask's own directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, else `<root>/target`).
pub fn target_dir(root: &Path) -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// Prints `xtask: <what>: <command line>`, runs `cmd` with inherited stdio and
/// fails, naming the command line and `fix`, unless it exits successfully.
pub fn run(what: &str, cmd: &mut Command, fix: &str) -> Result<()> {
    let status = run_status(what, cmd, fix)?;
    if !status.success() {
        bail!("`{}` failed ({status}); {fix}", cmdline(cmd));
    }
    Ok(())
}

/// Like [`run`], but returns the exit status instead of failing on it.
pub fn run_status(what: &str, cmd: &mut Command, fix: &str) -> Result<ExitStatus> {
    step!("{what}: {}", cmdline(cmd));
    cmd.status()
        .with_context(|| format!("could not start `{}`; {fix}", cmdline(cmd)))
}

/// `run_status` with `cmd`'s stdout passed through line by line, and the
/// panic messages of the tests that failed in it kept (the test's name,
/// the `panicked at` line and up to 15 lines of message after it): CI
/// shows the head and tail of a long log, and these go at its tail.
pub fn run_teed(what: &str, cmd: &mut Command, fix: &str) -> Result<(ExitStatus, Vec<String>)> {
    use std::io::{BufRead as _, Write as _};
    step!("{what}: {}", cmdline(cmd));
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{}`; {fix}", cmdline(cmd)))?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let mut failures = Vec::new();
    let mut test = String::new();
    let mut taking = 0;
    let mut out = std::io::stdout();
    for line in std::io::BufReader::new(stdout).split(b'\n') {
        let line = line?;
        out.write_all(&line)?;
        out.write_all(b"\n")?;
        let line = String::from_utf8_lossy(&line).into_owned();
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|l| l.strip_suffix(" stdout ----"))
        {
            test = name.to_string();
        } else if line.starts_with("thread '") && line.contains(" panicked at ") {
            failures.push(format!("{test}: {line}"));
            taking = 15;
        } else if taking > 0 {
            if line.starts_with("stack backtrace:") || line.starts_with("note: ") {
                taking = 0;
            } else {
                failures.push(format!("    {line}"));
                taking -= 1;
            }
        }
    }
    out.flush()?;
    Ok((child.wait()?, failures))
}

/// Runs `cmd` quietly and returns its stdout, or fails with its stderr and `fix`.
pub fn output(cmd: &mut Command, fix: &str) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{}`; {fix}", cmdline(cmd)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}; {fix}",
            cmdline(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `cmd` as a shell command line, with the environment variables it sets.
pub fn cmdline(cmd: &Command) -> String {
    let envs = cmd.get_envs().filter_map(|(k, v)| {
        Some(format!(
            "{}={}",
            k.to_string_lossy(),
            quote(&v?.to_string_lossy())
        ))
    });
    let args = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| quote(&a.to_string_lossy()));
    envs.chain(args).collect::<Vec<_>>().join(" ")
}

/// Quotes `s` for bash when needed (`$'...'` if it has control characters).
fn quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=+,:@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_owned()
    } else if s.chars().any(char::is_control) {
        let escaped: String = s
            .chars()
            .map(|c| match c {
                '\'' | '\\' => format!("\\{c}"),
                c if c.is_control() => format!("\\x{:02x}", c as u32),
                c => c.to_string(),
            })
            .collect();
        format!("$'{escaped}'")
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The exit code to pass on for a child's `status` (128 + signal if killed).
pub fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt as _;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Whether the effective user id is 0 (read from `/proc/self/status`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let uids = s.lines().find_map(|l| l.strip_prefix("Uid:"))?.to_owned();
            uids.split_whitespace().nth(1).map(|euid| euid == "0")
        })
        .unwrap_or(false)
}
