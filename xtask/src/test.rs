//! `cargo xtask test`: setup, build, unit tests, then the integration tests
//! and the quick chaos run. The unit tests include the fuzz targets' short
//! runs (`fuzz_*`, see `cargo xtask fuzz` for longer ones).
use std::{
    path::Path,
    process::{Command, ExitCode},
};

use anyhow::Result;

use crate::{build, chaos, is_root, run_status, run_teed, setup, step, target_dir};

pub fn test(root: &Path, args: &[String]) -> Result<ExitCode> {
    setup::setup()?;
    let object = build::build(root)?;
    let release = target_dir(root).join("release");

    let unit = run_status(
        "unit tests",
        Command::new("cargo")
            .current_dir(root)
            .args([
                "test",
                "--release",
                "--package",
                "lb-common",
                "--package",
                "lb-agent",
            ])
            .env("LB_EBPF_OBJECT", &object),
        "fix the errors above",
    )?
    .success();

    let mut failures = Vec::new();
    let integration = if is_root() {
        // `cargo test` of the integration tests: `tests` (`--test NAME`
        // each, none for all), with `env` set too.
        let integration_run = |what: &str, tests: &[&str], env: &[(&str, &str)]| {
            let mut c = Command::new("cargo");
            c.current_dir(root).args([
                "test",
                "--release",
                "--no-fail-fast",
                "--package",
                "integration-tests",
            ]);
            for t in tests {
                c.args(["--test", t]);
            }
            c.arg("--")
                .arg("--test-threads=2")
                .args(args)
                .envs(env.iter().copied())
                .env("LB_AGENT_BIN", release.join("lb-agent"))
                .env("LB_BIN_DIR", &release)
                .env("LB_EBPF_OBJECT", &object);
            run_teed(what, &mut c, "fix the errors above")
        };
        let (status, failed) = integration_run("integration tests", &[], &[])?;
        failures = failed;
        // The XDP stage (`--acceleration`) on the tc path's flow-integrity
        // and device tests again: every agent of their clusters with it,
        // on test beds made ready for it (`Cluster::accelerate`).
        // tests/tests/xdp.rs is in the run above.
        let (accelerated, failed) = integration_run(
            "integration tests with acceleration (flows, devices)",
            &["flows", "devices"],
            &[("LB_TEST_ACCELERATION", "native")],
        )?;
        failures.extend(failed.into_iter().map(|l| format!("(accelerated) {l}")));
        Some(status.success() && accelerated.success())
    } else {
        eprintln!(
            "xtask: error: the integration tests load eBPF programs and need root; \
             rerun as root, e.g. `sudo -E cargo xtask test`"
        );
        None
    };

    // The quick chaos run (about two minutes): faults under load. Its
    // report goes under target/, RELIABILITY.md is the full run's.
    let chaos = if is_root() {
        let report = target_dir(root).join("chaos").join("RELIABILITY-quick.md");
        std::fs::create_dir_all(target_dir(root).join("chaos"))?;
        Some(chaos::run(root, true, Some(report.as_path()))?.success())
    } else {
        None
    };

    if !failures.is_empty() {
        step!("the integration tests' failures, in brief:");
        for l in &failures {
            println!("{l}");
        }
    }
    let word = |ok: bool| if ok { "passed" } else { "FAILED" };
    step!(
        "summary: unit tests {}, integration tests {}, chaos --quick {}",
        word(unit),
        integration.map_or("not run (need root)", word),
        chaos.map_or("not run (need root)", word)
    );
    Ok(
        if unit && integration == Some(true) && chaos == Some(true) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}
