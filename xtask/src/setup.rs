//! `cargo xtask setup`: install what is missing; a fast no-op otherwise.
use std::{
    env, fs,
    os::unix::fs::{symlink, PermissionsExt as _},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{is_root, output, run, step};

/// Commands the integration tests use, and the Debian package providing each.
const COMMANDS: &[(&str, &str)] = &[
    ("bpftool", "bpftool"),
    ("ip", "iproute2"),
    ("bridge", "iproute2"),
    ("ps", "procps"),
    ("sysctl", "procps"),
    // Agents inside node namespaces (tests/tests/nodeport.rs).
    ("nsenter", "util-linux"),
    // kube-proxy's rules during a migration (tests/tests/flows.rs).
    ("iptables", "iptables"),
    // The agent with the DaemonSet's capabilities only (tests/tests/privilege.rs).
    ("setpriv", "util-linux"),
    // The XDP stage on veth: GRO on a peer, checksum offload off
    // (tests/src/nodes.rs, `Cluster::accelerate`).
    ("ethtool", "ethtool"),
    // pip, for the PyPI tools below.
    ("python3", "python3"),
];

/// Tools from PyPI the tests use, pinned, and the command each provides.
/// kubernetes-validate 1.35.0 is the first release with the 1.34 schemas
/// (tests/tests/privilege.rs validates deploy/ against them, offline).
const PYPI: &[(&str, &str)] = &[("kubernetes-validate", "kubernetes-validate==1.35.0")];

pub fn setup() -> Result<()> {
    rust_src()?;
    bpf_linker()?;
    packages()?;
    pypi()?;
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    bpffs(&mounts)?;
    cgroup2(&mounts)
}

fn rust_src() -> Result<()> {
    let out = Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .context("could not run rustup; install it from https://rustup.rs")?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("not installed") {
            bail!("the nightly toolchain is not installed; run `rustup toolchain install nightly`");
        }
        bail!(
            "`rustup component list --toolchain nightly --installed` failed: {}; \
             check that `rustup toolchain install nightly` works",
            stderr.trim()
        );
    }
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == "rust-src")
    {
        step!("rust-src for nightly: already installed");
        return Ok(());
    }
    run(
        "installing rust-src for nightly",
        Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]),
        "run `rustup component add rust-src --toolchain nightly` by hand",
    )
}

fn bpf_linker() -> Result<()> {
    if let Ok(out) = Command::new("bpf-linker").arg("--version").output() {
        if out.status.success() {
            let version = String::from_utf8_lossy(&out.stdout);
            step!("bpf-linker: already installed ({})", version.trim());
            return Ok(());
        }
    }
    // Build bpf-linker against the nightly toolchain's own libLLVM, through a
    // prefix that outlives the build: the binary's rpath points into it.
    let fix = "see https://github.com/aya-rs/bpf-linker#installation";
    let sysroot = output(
        Command::new("rustc").args(["+nightly", "--print", "sysroot"]),
        fix,
    )?;
    let libdir = Path::new(sysroot.trim()).join("lib");
    let (libllvm, major) = find_libllvm(&libdir)?;
    let name = libllvm.file_name().expect("a file");
    let prefix = cargo_home()?.join("bpf-linker-llvm");
    step!(
        "bpf-linker: linking {} into {}/lib",
        libllvm.display(),
        prefix.display()
    );
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib)
        .with_context(|| format!("creating {}; {fix}", prefix_lib.display()))?;
    for link in [Path::new("libLLVM.so"), Path::new(name)] {
        let link = prefix_lib.join(link);
        if link.symlink_metadata().is_ok() {
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        symlink(&libllvm, &link)
            .with_context(|| format!("symlinking {} to {}", link.display(), libllvm.display()))?;
    }
    let feature = format!("llvm-{major}");
    run(
        "bpf-linker: building against the nightly toolchain's LLVM",
        Command::new("cargo")
            .args(["install", "bpf-linker", "--no-default-features", "--features", &feature])
            .env("LLVM_PREFIX", &prefix),
        &format!(
            "run `LLVM_PREFIX={} cargo install bpf-linker --no-default-features --features {feature}` \
             by hand, or see https://github.com/aya-rs/bpf-linker#installation",
            prefix.display()
        ),
    )?;
    if !Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
    {
        bail!("bpf-linker was installed but does not run from PATH; add cargo's bin directory (e.g. ~/.cargo/bin) to PATH");
    }
    Ok(())
}

/// Finds `libLLVM.so.<major>.<minor>-rust-*` in `libdir`; returns it and `<major>`.
fn find_libllvm(libdir: &Path) -> Result<(PathBuf, u32)> {
    let names: Vec<String> = fs::read_dir(libdir)
        .with_context(|| format!("listing {}", libdir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    for name in &names {
        let Some(version) = name.strip_prefix("libLLVM.so.") else {
            continue;
        };
        if !version.contains("-rust-") {
            continue;
        }
        if let Some(Ok(major)) = version.split('.').next().map(str::parse) {
            return Ok((libdir.join(name), major));
        }
    }
    bail!(
        "no libLLVM.so.<version>-rust-* in {} (it has: {}); install bpf-linker by hand, \
         see https://github.com/aya-rs/bpf-linker#installation",
        libdir.display(),
        names.join(", ")
    )
}

fn cargo_home() -> Result<PathBuf> {
    if let Some(home) = env::var_os("CARGO_HOME") {
        return Ok(PathBuf::from(home));
    }
    let home = env::var_os("HOME").context("neither CARGO_HOME nor HOME is set; set CARGO_HOME")?;
    Ok(PathBuf::from(home).join(".cargo"))
}

fn packages() -> Result<()> {
    let mut missing: Vec<&str> = Vec::new();
    for &(command, package) in COMMANDS {
        if find_command(command).is_none() && !missing.contains(&package) {
            missing.push(package);
        }
    }
    let commands: Vec<&str> = COMMANDS.iter().map(|(c, _)| *c).collect();
    if missing.is_empty() {
        step!("{}: found", commands.join(", "));
        return Ok(());
    }
    let install = format!("apt-get install -y {}", missing.join(" "));
    if !is_root() || !Path::new("/etc/debian_version").exists() {
        step!(
            "missing packages {} (not root on Debian, so not installing them); \
             install them by hand, e.g. `{install}`",
            missing.join(" ")
        );
        return Ok(());
    }
    let fix = format!("run `apt-get update && {install}` by hand");
    run(
        "updating the apt package lists",
        Command::new("apt-get").arg("update"),
        &fix,
    )?;
    run(
        &format!("installing {}", missing.join(" ")),
        Command::new("apt-get")
            .args(["install", "-y"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &fix,
    )
}

/// Installs what `PYPI` lists that is not on PATH, with pip.
fn pypi() -> Result<()> {
    for &(command, requirement) in PYPI {
        if find_command(command).is_some() {
            step!("{command}: found");
            continue;
        }
        run(
            &format!("installing {requirement} from PyPI"),
            Command::new("python3").args(["-m", "pip", "install", "--quiet", requirement]),
            &format!("run `python3 -m pip install {requirement}` by hand"),
        )?;
    }
    Ok(())
}

/// Looks `command` up like `which`, in PATH plus /usr/sbin and /sbin.
fn find_command(command: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(command))
        .find(|file| {
            file.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Mount points of file systems of type `fstype` in `/proc/mounts` text.
fn mount_points<'a>(mounts: &'a str, fstype: &'a str) -> impl Iterator<Item = &'a str> {
    mounts.lines().filter_map(move |line| {
        let mut fields = line.split_whitespace();
        let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
        (kind == fstype).then_some(point)
    })
}

fn bpffs(mounts: &str) -> Result<()> {
    const BPFFS: &str = "/sys/fs/bpf";
    if mount_points(mounts, "bpf").any(|p| p == BPFFS) {
        step!("bpffs: mounted at {BPFFS}");
        return Ok(());
    }
    let mount = format!("mount -t bpf bpf {BPFFS}");
    if !is_root() {
        step!(
            "bpffs: not mounted at {BPFFS} (not root, so not mounting it); run `{mount}` as root"
        );
        return Ok(());
    }
    run(
        "bpffs: mounting",
        Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]),
        &format!("run `{mount}` by hand"),
    )
}

fn cgroup2(mounts: &str) -> Result<()> {
    match mount_points(mounts, "cgroup2").next() {
        Some(point) => {
            step!("cgroup v2: mounted at {point}");
            Ok(())
        }
        None => bail!(
            "no cgroup v2 hierarchy is mounted; mount one by hand, e.g. \
             `mkdir -p /sys/fs/cgroup/unified && mount -t cgroup2 none /sys/fs/cgroup/unified`"
        ),
    }
}
