//! `cargo xtask chaos [--quick]`: setup, build, then `lb-chaos`, which
//! injects faults under load and writes `RELIABILITY.md`.
use std::{
    path::Path,
    process::{Command, ExitCode, ExitStatus},
};

use anyhow::{bail, Result};

use crate::{build, exit_code, is_root, run_status, setup, target_dir};

pub fn chaos(root: &Path, quick: bool) -> Result<ExitCode> {
    if !is_root() {
        bail!(
            "the chaos run creates network namespaces and cgroups and loads eBPF programs; \
             rerun as root, e.g. `sudo -E cargo xtask chaos{}`",
            if quick { " --quick" } else { "" }
        );
    }
    setup::setup()?;
    build::build(root)?;
    Ok(exit_code(run(root, quick, None)?))
}

/// Runs the built `lb-chaos` (`cargo xtask build` first), its report to
/// `output` (default `RELIABILITY.md`); `cargo xtask test` runs the quick
/// mode after the integration tests, its report under `target/chaos`.
pub fn run(root: &Path, quick: bool, output: Option<&Path>) -> Result<ExitStatus> {
    let release = target_dir(root).join("release");
    let mut cmd = Command::new(release.join("lb-chaos"));
    cmd.current_dir(root)
        .arg("--root")
        .arg(root)
        .env("LB_AGENT_BIN", release.join("lb-agent"))
        .env("LB_BIN_DIR", &release);
    if quick {
        cmd.arg("--quick");
    }
    if let Some(o) = output {
        cmd.arg("--output").arg(o);
    }
    run_status(
        "running the chaos suite",
        &mut cmd,
        "check that `cargo xtask build` built lb-chaos",
    )
}
