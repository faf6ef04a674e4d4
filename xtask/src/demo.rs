//! `cargo xtask demo`: setup, build, then run the lb-demo binary.
use std::{
    path::Path,
    process::{Command, ExitCode},
};

use anyhow::Result;

use crate::{build, exit_code, run_status, setup, target_dir};

pub fn demo(root: &Path) -> Result<ExitCode> {
    setup::setup()?;
    build::build(root)?;
    let release = target_dir(root).join("release");
    let status = run_status(
        "running the demo",
        Command::new(release.join("lb-demo"))
            .current_dir(root)
            .env("LB_AGENT_BIN", release.join("lb-agent"))
            .env("LB_BIN_DIR", &release),
        "check that the integration-tests package has an `lb-demo` binary and that `cargo xtask build` built it",
    )?;
    Ok(exit_code(status))
}
