//! `cargo xtask build-ebpf` and `cargo xtask build`.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Result};

use crate::{run, step, target_dir};

const EBPF_TARGET: &str = "bpfel-unknown-none";

/// Builds `lb-ebpf` the way aya-build 0.2.0 does and returns the object's path.
pub fn build_ebpf(root: &Path, debug: bool) -> Result<PathBuf> {
    // aya-build takes CARGO_CFG_TARGET_ARCH, folding riscv64* into riscv64.
    let arch = std::env::consts::ARCH;
    let arch = if arch.starts_with("riscv64") {
        "riscv64"
    } else {
        arch
    };
    let cfg = format!("--cfg=bpf_target_arch=\"{arch}\"");
    let rustflags = [cfg.as_str(), "-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f");

    let mut cmd = Command::new("cargo");
    cmd.current_dir(root)
        .args(["+nightly", "build", "--package", "lb-ebpf", "--bins"])
        .args(["--target", EBPF_TARGET, "-Z", "build-std=core"])
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags);
    if !debug {
        cmd.arg("--release");
    }
    // The nightly toolchain must build this, whatever toolchain runs xtask.
    for key in ["RUSTC", "RUSTC_WORKSPACE_WRAPPER", "RUSTUP_TOOLCHAIN"] {
        cmd.env_remove(key);
    }
    run(
        "building the kernel programs (lb-ebpf)",
        &mut cmd,
        "fix the errors above; if the toolchain or linker is missing, run `cargo xtask setup`",
    )?;

    let profile = if debug { "debug" } else { "release" };
    let object = target_dir(root).join(EBPF_TARGET).join(profile).join("lb");
    if !object.is_file() {
        bail!(
            "the build succeeded but {} is missing; check the [[bin]] name in lb-ebpf/Cargo.toml",
            object.display()
        );
    }
    step!("kernel object: {}", object.display());
    Ok(object)
}

/// Builds the kernel programs, then lb-agent (embedding that object) and the
/// integration tests' helper binaries. Returns the kernel object's path.
pub fn build(root: &Path) -> Result<PathBuf> {
    let object = build_ebpf(root, false)?;
    run(
        "building lb-agent and the integration test binaries",
        Command::new("cargo")
            .current_dir(root)
            .args(["build", "--release", "--package", "lb-agent"])
            .args(["--package", "integration-tests", "--bins"])
            .env("LB_EBPF_OBJECT", &object),
        "fix the errors above, then rerun `cargo xtask build`",
    )?;
    step!(
        "agent: {}",
        target_dir(root).join("release").join("lb-agent").display()
    );
    Ok(object)
}
