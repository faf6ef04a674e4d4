//! `cargo xtask fuzz [--long | --cases N] [--time S]`: the fuzz targets
//! (tests named `fuzz_*`: manifests through translation and reconciler,
//! the HTTP servers, the tc programs through `BPF_PROG_TEST_RUN`) with more
//! cases than the bounded run inside `cargo xtask test`. They are ordinary
//! proptest tests, so this builds nothing beyond the unit tests; a failure
//! is kept in `lb-agent/proptest-regressions/` (commit it with the fix)
//! and replayed first by every later run.
use std::{
    path::Path,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{build, exit_code, is_root, run_status, setup, step};

/// Each target's short case count is multiplied by this with `--long`.
const LONG_SCALE: u32 = 40;

/// How many cases: each target's own short count times `scale`, or `cases`
/// for every target. With `time`, rounds of fresh cases are run until
/// that long has passed.
pub struct Budget {
    pub long: bool,
    pub cases: Option<u32>,
    pub time: Option<u64>,
}

pub fn fuzz(root: &Path, budget: Budget) -> Result<ExitCode> {
    setup::setup()?;
    // The tc target loads the kernel object; lb-agent embeds it too.
    let object = build::build_ebpf(root, false)?;
    if !is_root() {
        eprintln!(
            "xtask: warning: not root: the tc programs' target is SKIPPED \
             (rerun as root, e.g. `sudo -E cargo xtask fuzz`)"
        );
    }
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root)
        .args(["test", "--release", "--package", "lb-agent"])
        .args(["--lib", "--test", "tc_frames", "--", "fuzz_"])
        .env("LB_EBPF_OBJECT", &object);
    if let Some(n) = budget.cases {
        cmd.env("LB_FUZZ_CASES", n.to_string());
    } else if budget.long {
        cmd.env("LB_FUZZ_SCALE", LONG_SCALE.to_string());
    }
    let until = budget.time.map(Duration::from_secs);
    let started = Instant::now();
    let mut round = 1;
    loop {
        let status = run_status(
            &format!("fuzz round {round}"),
            &mut cmd,
            "fix the errors above",
        )?;
        if !status.success() {
            step!("fuzz: round {round} FAILED; the failing input is in lb-agent/proptest-regressions/");
            return Ok(exit_code(status));
        }
        match until {
            Some(until) if started.elapsed() < until => round += 1,
            _ => break,
        }
    }
    step!("fuzz: {round} round(s) passed in {:.0?}", started.elapsed());
    Ok(ExitCode::SUCCESS)
}
