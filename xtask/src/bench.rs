//! `cargo xtask bench [--quick]`: setup, the benchmark's own packages
//! (iptables with both backends, nftables, a TTF font for the chart), build,
//! then `lb-bench-suite`, which writes `BENCHMARKS.md` and `docs/bench.png`.
use std::{
    path::Path,
    process::{Command, ExitCode},
};

use anyhow::{bail, Result};

use crate::{build, exit_code, is_root, run, run_status, setup, step, target_dir};

/// What the bench needs beyond `setup`: (file that proves it, Debian package).
const NEEDS: &[(&str, &str)] = &[
    ("/usr/sbin/iptables-nft-restore", "iptables"),
    ("/usr/sbin/iptables-legacy-restore", "iptables"),
    ("/usr/sbin/nft", "nftables"),
    (
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "fonts-dejavu-core",
    ),
];

fn bench_packages() -> Result<()> {
    let mut missing: Vec<&str> = Vec::new();
    for &(file, package) in NEEDS {
        if !Path::new(file).exists() && !missing.contains(&package) {
            missing.push(package);
        }
    }
    if missing.is_empty() {
        step!("bench packages (iptables, nftables, fonts-dejavu-core): found");
        return Ok(());
    }
    if !Path::new("/etc/debian_version").exists() {
        bail!(
            "the benchmark needs {}; install them by hand",
            missing.join(" ")
        );
    }
    let fix = format!(
        "run `apt-get update && apt-get install -y {}` by hand",
        missing.join(" ")
    );
    run(
        "updating the apt package lists",
        Command::new("apt-get").arg("update"),
        &fix,
    )?;
    run(
        &format!("installing {}", missing.join(" ")),
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &fix,
    )
}

pub fn bench(root: &Path, quick: bool) -> Result<ExitCode> {
    if !is_root() {
        bail!(
            "the benchmark creates network namespaces and cgroups and loads eBPF programs; \
             rerun as root, e.g. `sudo -E cargo xtask bench{}`",
            if quick { " --quick" } else { "" }
        );
    }
    setup::setup()?;
    bench_packages()?;
    build::build(root)?;
    let release = target_dir(root).join("release");
    // A private copy: a build running meanwhile (cargo xtask test in another
    // shell) must not swap the binaries under a run that lasts half an hour.
    let bin = target_dir(root).join("bench").join("bin");
    std::fs::create_dir_all(&bin)?;
    for name in ["lb-bench-suite", "lb-bench", "lb-agent"] {
        std::fs::copy(release.join(name), bin.join(name))
            .map_err(|e| anyhow::anyhow!("copying {name} into {}: {e}", bin.display()))?;
    }
    let mut cmd = Command::new(bin.join("lb-bench-suite"));
    cmd.current_dir(root)
        .arg("--root")
        .arg(root)
        .env("LB_AGENT_BIN", bin.join("lb-agent"))
        .env("LB_BIN_DIR", &bin);
    if quick {
        cmd.arg("--quick");
    }
    let status = run_status(
        "running the benchmark",
        &mut cmd,
        "check that `cargo xtask build` built lb-bench-suite",
    )?;
    Ok(exit_code(status))
}
