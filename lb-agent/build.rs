//! Embeds the kernel programs in the agent.
//!
//! `LB_EBPF_OBJECT` names an object that `cargo xtask build-ebpf` already
//! built, so `cargo xtask build` compiles the kernel side once. Without it,
//! aya-build compiles `lb-ebpf` here, as aya-template does, so that a plain
//! `cargo build -p lb-agent` works too.
use std::{env, fs, path::PathBuf};

use anyhow::{anyhow, Context as _};

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=LB_EBPF_OBJECT");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    if let Some(object) = env::var_os("LB_EBPF_OBJECT") {
        let object = PathBuf::from(object);
        println!("cargo:rerun-if-changed={}", object.display());
        fs::copy(&object, out_dir.join("lb"))
            .with_context(|| format!("copying LB_EBPF_OBJECT={}", object.display()))?;
        return Ok(());
    }
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    // aya-build watches lb-ebpf's own directory only; the programs also
    // compile lb-common (map layouts, conntrack timeouts, checks), whose
    // changes must rebuild the embedded object too.
    let common = packages
        .iter()
        .find(|p| p.name.as_str() == "lb-common")
        .ok_or_else(|| anyhow!("lb-common package not found in the workspace"))?;
    if let Some(dir) = common.manifest_path.parent() {
        println!("cargo:rerun-if-changed={dir}");
    }
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "lb-ebpf")
        .ok_or_else(|| anyhow!("lb-ebpf package not found in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("lb-ebpf manifest has no parent directory"))?
        .as_str()
        .to_owned();
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: &root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
