//! `cargo xtask kernels`: the smoke test on each kernel of a matrix, in a
//! VM, and the table of what works where (KERNELS.md).
//!
//! Kernels are Debian's, by package name, fetched with `apt-get download`
//! into `<target>/kernels` and unpacked there (never installed). Each boots
//! under virtme-ng (qemu, TCG: no KVM) over this machine's root filesystem,
//! read-only, without a network; inside, the smoke test is the real
//! binaries: `lb-agent check`, then integration tests of the `tests` crate,
//! which make their own namespaces, cgroups and pins and remove them. This
//! machine's own kernel runs the same tests without a VM.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{build, output, run, run_status, step, target_dir};

/// The matrix: Debian's kernels by release, newest ABI of each.
const MATRIX: [Kernel; 2] = [
    Kernel {
        suite: "bullseye",
        package_prefix: "linux-image-5.10.0-",
    },
    Kernel {
        suite: "bookworm",
        package_prefix: "linux-image-6.1.0-",
    },
];

struct Kernel {
    suite: &'static str,
    /// The package is `<prefix><abi>-amd64-unsigned`.
    package_prefix: &'static str,
}

/// One column of the table: an integration test, by file and name.
struct Check {
    column: &'static str,
    file: &'static str,
    test: &'static str,
}

/// The test that asks for kube-proxy's ECONNREFUSED (the agent's choice
/// where the kernel allows it).
const ECONNREFUSED_TEST: &str = "service_without_endpoints_is_refused_at_once";

const CHECKS: [Check; 7] = [
    Check {
        column: "ClusterIP TCP + getpeername",
        file: "clusterip",
        test: "tcp_reaches_every_backend_evenly_and_shows_the_vip",
    },
    Check {
        column: "ClusterIP UDP",
        file: "clusterip",
        test: "udp_sockets_spread_keep_their_backend_and_answer_from_the_vip",
    },
    Check {
        column: "no endpoints: ECONNREFUSED",
        file: "clusterip",
        test: ECONNREFUSED_TEST,
    },
    Check {
        column: "no endpoints: EPERM programs",
        file: "clusterip",
        test: "service_without_endpoints_is_refused_with_eperm_by_the_programs_for_older_kernels",
    },
    Check {
        column: "NodePort (tc)",
        file: "nodeport",
        test: "nodeport_cluster_policy_every_node_every_endpoint",
    },
    Check {
        column: "restart adoption",
        file: "restart",
        test: "sigkill_and_restart_fail_no_connect_and_rewrite_only_changes",
    },
    Check {
        column: "SCTP: reported, connects left alone",
        file: "sctp",
        test: "sctp_ports_are_reported_not_served_and_their_connects_left_alone",
    },
];

pub fn kernels(root: &Path, table_only: bool, check_only: bool) -> Result<()> {
    let cache = target_dir(root).join("kernels");
    if table_only {
        return write_table(root, &cache);
    }
    for tool in ["vng", "qemu-system-x86_64", "depmod", "busybox"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map_or(true, |o| !o.status.success())
        {
            bail!(
                "{tool} is missing: pip install virtme-ng; apt-get install qemu-system-x86 kmod busybox-static"
            );
        }
    }
    let object = build::build_ebpf(root, false)?;
    // Each package on its own, as `cargo test -p` builds it, so that cargo
    // does not build every dependency twice over for two feature sets.
    run(
        "building lb-agent",
        Command::new("cargo")
            .current_dir(root)
            .args(["build", "--release", "-p", "lb-agent"])
            .env("LB_EBPF_OBJECT", &object),
        "fix the errors above",
    )?;
    let tests = if check_only {
        Vec::new()
    } else {
        test_binaries(root, &object)?
    };
    fs::create_dir_all(&cache)?;
    let release = target_dir(root).join("release");
    // The check-only runs keep their results apart from the table's.
    let results = cache.join(if check_only { "out-check" } else { "out" });

    let out = results.join("host");
    step!("smoke test on this machine's kernel");
    run(
        "smoke test",
        Command::new("sh").arg(smoke_script(&out, &release, &object, &tests)?),
        "see the output above",
    )?;

    let mut versions = vec![("host".to_owned(), out)];
    for k in &MATRIX {
        let (version, dir) = fetch(k, &cache)?;
        let out = results.join(&version);
        versions.push((version.clone(), out.clone()));
        let script = smoke_script(&out, &release, &object, &tests)?;
        let kimg = dir.join("boot").join(format!("vmlinuz-{version}"));
        step!("booting {version} (TCG: a minute or more) for the smoke test");
        // No --net: the guest has loopback only; the tests make namespaces.
        // vng's exit status is not the script's: the results are in `out`.
        let status = run_status(
            "virtme-ng",
            Command::new("vng")
                .arg("--run")
                .arg(&kimg)
                .args(["--disable-kvm", "-m", "2G", "-p", "2"])
                .arg("--rwdir")
                .arg(&out)
                .arg("--exec")
                .arg(format!("sh {}", script.display())),
            "pip install virtme-ng; apt-get install qemu-system-x86",
        )?;
        step!("{version}: virtme-ng exited with {status}");
    }
    if check_only {
        let mut failed = Vec::new();
        for (version, out) in &versions {
            let rc = fs::read_to_string(out.join("check.rc")).unwrap_or_default();
            let text = fs::read_to_string(out.join("check.txt")).unwrap_or_default();
            step!(
                "{version}: lb-agent check exited with {:?}:\n{text}",
                rc.trim()
            );
            if rc.trim() != "0" {
                failed.push(version.as_str());
            }
        }
        if !failed.is_empty() {
            bail!("lb-agent check failed on {}", failed.join(", "));
        }
        return Ok(());
    }
    write_table(root, &cache)
}

/// KERNELS.md from the results in `cache/out`: this machine's, then each
/// kernel of the matrix that was booted.
fn write_table(root: &Path, cache: &Path) -> Result<()> {
    let out = cache.join("out");
    let host = fs::read_to_string(out.join("host").join("kernel")).unwrap_or_default();
    let mut rows = vec![Row::read(
        &format!("{} (this machine, no VM)", host.trim()),
        &out.join("host"),
    )?];
    for k in &MATRIX {
        let mut booted: Vec<String> = fs::read_dir(&out)?
            .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.starts_with(&k.package_prefix["linux-image-".len()..]))
            .collect();
        booted.sort_by_key(|v| abi(&format!("linux-image-{v}"), k.package_prefix));
        if let Some(version) = booted.last() {
            let label = format!("{version} (Debian {})", k.suite);
            rows.push(Row::read(&label, &out.join(version))?);
        }
    }
    let table = render(&rows);
    print!("{table}");
    fs::write(root.join("KERNELS.md"), table)?;
    step!("wrote KERNELS.md");
    Ok(())
}

/// Builds the integration tests (and their helper binaries) and returns
/// the test executables by file name (`clusterip`, ...).
fn test_binaries(root: &Path, object: &Path) -> Result<Vec<(String, PathBuf)>> {
    let json = output(
        Command::new("cargo")
            .current_dir(root)
            .args(["test", "--release", "-p", "integration-tests", "--no-run"])
            .args(["--message-format=json"])
            .env("LB_EBPF_OBJECT", object),
        "fix the build errors",
    )?;
    let mut found = Vec::new();
    for check in &CHECKS {
        if found.iter().any(|(f, _)| f == check.file) {
            continue;
        }
        let name = format!("\"name\":\"{}\",\"src_path\"", check.file);
        let exe = json
            .lines()
            .filter(|l| l.contains(&name) && l.contains("\"kind\":[\"test\"]"))
            .find_map(|l| {
                let at = l.find("\"executable\":\"")? + "\"executable\":\"".len();
                Some(l[at..].split('"').next()?.to_owned())
            })
            .with_context(|| format!("no test executable for tests/{}.rs", check.file))?;
        found.push((check.file.to_owned(), PathBuf::from(exe)));
    }
    Ok(found)
}

/// Fetches the newest `<prefix><abi>-amd64-unsigned` of `k.suite` into
/// `cache` and unpacks it; returns its version (`5.10.0-32-amd64`) and
/// where it is unpacked.
fn fetch(k: &Kernel, cache: &Path) -> Result<(String, PathBuf)> {
    ensure_suite(k.suite)?;
    let pattern = format!(
        "^{}[0-9]+-amd64-unsigned$",
        k.package_prefix.replace('.', "\\.")
    );
    let list = output(
        Command::new("apt-cache").args(["search", "--names-only", &pattern]),
        "apt-get update",
    )?;
    let package = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .max_by_key(|p| abi(p, k.package_prefix))
        .with_context(|| format!("no package matches {pattern}; apt-get update?"))?
        .to_owned();
    let version = package
        .strip_prefix("linux-image-")
        .and_then(|p| p.strip_suffix("-unsigned"))
        .context("unexpected package name")?
        .to_owned();
    let dir = cache.join(&version);
    if !dir
        .join("boot")
        .join(format!("vmlinuz-{version}"))
        .is_file()
    {
        run(
            "fetching the kernel",
            Command::new("apt-get")
                .current_dir(cache)
                .args(["download", &package]),
            "check the apt sources",
        )?;
        let deb = fs::read_dir(cache)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
            })
            .context("the downloaded package is missing")?;
        run(
            "unpacking it (not installing)",
            Command::new("dpkg").arg("-x").arg(&deb).arg(&dir),
            "check the download",
        )?;
    }
    Ok((version, dir))
}

fn abi(package: &str, prefix: &str) -> u32 {
    package
        .strip_prefix(prefix)
        .and_then(|r| r.split('-').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Adds Debian `suite` to apt's sources (the mirror apt already uses) when
/// apt knows no kernel of it yet.
fn ensure_suite(suite: &str) -> Result<()> {
    let policy = output(Command::new("apt-cache").arg("policy"), "apt-get update")?;
    if policy.contains(&format!("n={suite},")) {
        return Ok(());
    }
    let list = PathBuf::from(format!("/etc/apt/sources.list.d/lb-kernels-{suite}.list"));
    step!(
        "adding {suite} to {} (kernels are downloaded, never installed)",
        list.display()
    );
    fs::write(
        &list,
        format!("deb http://deb.debian.org/debian {suite} main\n"),
    )
    .with_context(|| format!("writing {}", list.display()))?;
    run(
        "apt-get update",
        Command::new("apt-get").arg("update"),
        "check the network",
    )
}

/// Writes the guest's script to `out/smoke.sh`: each step's result into a
/// file of `out`, which [`Row::read`] reads.
fn smoke_script(
    out: &Path,
    release: &Path,
    object: &Path,
    tests: &[(String, PathBuf)],
) -> Result<PathBuf> {
    let _ = fs::remove_dir_all(out);
    fs::create_dir_all(out)?;
    let o = out.display();
    let mut s = format!(
        "#!/bin/sh\n\
         export LB_AGENT_BIN={agent} LB_BIN_DIR={bin} LB_EBPF_OBJECT={object}\n\
         export LB_TEST_READY_TIMEOUT_S=300\n\
         uname -r > {o}/kernel\n\
         modprobe -q sctp || true\n\
         {agent} check > {o}/check.txt 2>&1; echo $? > {o}/check.rc\n",
        agent = release.join("lb-agent").display(),
        bin = release.display(),
        object = object.display(),
    );
    // Without test executables (`--check-only`), `lb-agent check` alone.
    for (i, c) in CHECKS.iter().enumerate() {
        let Some((_, exe)) = tests.iter().find(|(f, _)| f == c.file) else {
            continue;
        };
        s += &format!(
            "{} --exact {} --test-threads=1 > {o}/test{i}.txt 2>&1; echo $? > {o}/test{i}.rc\n",
            exe.display(),
            c.test
        );
    }
    let path = out.join("smoke.sh");
    fs::write(&path, s)?;
    Ok(path)
}

/// One kernel's results.
struct Row {
    kernel: String,
    agent_starts: String,
    refusal: String,
    tc_attach: String,
    checks: Vec<String>,
}

impl Row {
    fn read(kernel: &str, out: &Path) -> Result<Self> {
        let read = |name: &str| fs::read_to_string(out.join(name)).unwrap_or_default();
        let check = read("check.txt");
        let booted = !read("kernel").is_empty();
        let result = |i: usize| match read(&format!("test{i}.rc")).trim() {
            "" => "not run".to_owned(),
            "0" => "pass".to_owned(),
            _ => "FAIL".to_owned(),
        };
        let agent_starts = if !booted {
            "no: did not boot".to_owned()
        } else if read("check.rc").trim() == "0" {
            "yes".to_owned()
        } else {
            format!("no: {}", check.lines().last().unwrap_or("").trim())
        };
        let refusal = if check.contains("with ECONNREFUSED") {
            "ECONNREFUSED"
        } else if check.contains("with EPERM") {
            "EPERM"
        } else {
            "?"
        };
        let tc_attach = if check.contains("the verifier rejects the tc programs") {
            let why = check
                .lines()
                .find(|l| l.contains("tc_") && l.contains("REJECTED"))
                .and_then(|l| l.split("): ").nth(1))
                .unwrap_or("");
            format!("no: tc program rejected ({why})")
        } else if check.contains("tcx                   yes") {
            "TCX".to_owned()
        } else {
            "clsact filters (no TCX before 6.6)".to_owned()
        };
        // A kernel without bpf_set_retval in sock_addr hooks (before 6.1)
        // refuses with EPERM, as the agent chose: the ECONNREFUSED test
        // fails there by design, which the cell says when its output
        // shows exactly that.
        let econnrefused_by_design = |i: usize| {
            let text = read(&format!("test{i}.txt"));
            CHECKS[i].test == ECONNREFUSED_TEST
                && refusal == "EPERM"
                && text.contains("expected ECONNREFUSED, got")
                && text.contains("error: Some(\"EPERM\")")
        };
        let checks = (0..CHECKS.len())
            .map(|i| match result(i) {
                _ if !booted => "—".to_owned(),
                r if r == "FAIL" && econnrefused_by_design(i) => {
                    "EPERM (this kernel's refusal; ECONNREFUSED needs 6.1)".to_owned()
                }
                r => r,
            })
            .collect();
        Ok(Self {
            kernel: kernel.to_owned(),
            agent_starts,
            refusal: refusal.to_owned(),
            tc_attach,
            checks,
        })
    }
}

fn render(rows: &[Row]) -> String {
    let mut s = String::from(
        "# Kernels\n\n\
         Written by `cargo xtask kernels`: Debian's kernels booted in a VM (virtme-ng, qemu\n\
         TCG) over this machine's root filesystem, each running `lb-agent check` and the\n\
         integration tests named below (real packets in namespaces of the guest). The\n\
         refusal is what `lb-agent check` says the agent does for a Service without\n\
         endpoints. \"no endpoints: ECONNREFUSED\" runs the agent as it chooses and asks\n\
         for kube-proxy's ECONNREFUSED, which needs 6.1; \"no endpoints: EPERM programs\"\n\
         forces the programs for older kernels.\n\n",
    );
    let mut head = vec!["kernel", "agent starts", "refusal", "tc attach"];
    head.extend(CHECKS.iter().map(|c| c.column));
    s += &format!("| {} |\n", head.join(" | "));
    s += &format!("|{}\n", "---|".repeat(head.len()));
    for r in rows {
        let mut cells = vec![
            r.kernel.clone(),
            r.agent_starts.clone(),
            r.refusal.clone(),
            r.tc_attach.clone(),
        ];
        cells.extend(r.checks.iter().cloned());
        s += &format!("| {} |\n", cells.join(" | "));
    }
    s += "\nTests: ";
    s += &CHECKS
        .iter()
        .map(|c| format!("{}: `tests/tests/{}.rs` `{}`", c.column, c.file, c.test))
        .collect::<Vec<_>>()
        .join("; ");
    s += ".\n";
    s
}
