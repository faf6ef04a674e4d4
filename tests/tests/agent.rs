//! The agent's process contract: health endpoints, pins, inspect, and what
//! SIGTERM does: by default the datapath stays pinned and keeps serving (a
//! restarted agent adopts it; `lb-agent cleanup` removes it); with
//! `--cleanup-on-exit` the agent detaches and removes its pins.
mod common;

use std::process::Command;

use common::*;
use integration_tests::{cmd, require_root, Env};

/// Programs attached to `cgroup`, as `bpftool cgroup show` lists them.
fn attached(cgroup: &std::path::Path) -> Vec<String> {
    let out = cmd::run(
        Command::new("bpftool")
            .arg("cgroup")
            .arg("show")
            .arg(cgroup),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    out.lines()
        .skip_while(|l| !l.trim_start().starts_with("ID"))
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// Nothing is attached to the cgroup any more (`when`), and the VIP is an
/// unrouted address (`what`).
fn assert_detached(env: &Env, when: &str, what: &str) {
    let progs = attached(env.cgroup.path());
    assert!(progs.is_empty(), "still attached {when}: {progs:?}");
    assert_all_fail(what, &env.tcp("10.96.0.10:80", 3), "ENETUNREACH");
}

/// SIGTERM to the agent; it exits 0.
fn stop_with_exit_0(env: &mut Env) {
    let status = env.agent.as_mut().unwrap().stop().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "exit status after SIGTERM: {status}"
    );
}

#[test]
fn health_pins_inspect_and_clean_shutdown() {
    require_root!();
    let mut env = Env::new("life", 2).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    let mut opts = integration_tests::AgentOpts::default();
    opts.extra_args.push("--cleanup-on-exit".into());
    env.start_agent_with(opts).unwrap();
    let agent = env.agent();

    assert_eq!(agent.get("/healthz").unwrap().0, 200, "/healthz");
    assert_eq!(agent.get("/readyz").unwrap().0, 200, "/readyz");
    let pins = agent.pin_dir().to_path_buf();
    assert!(
        pins.join("LB_SERVICES").exists(),
        "no LB_SERVICES pin in {}: {:?}",
        pins.display(),
        std::fs::read_dir(&pins).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    let progs = attached(env.cgroup.path());
    eprintln!(
        "attached to {}:\n{}",
        env.cgroup.path().display(),
        progs.join("\n")
    );
    assert!(
        progs.len() >= 8,
        "expected the 8 sock_addr programs, got {progs:?}"
    );

    let inspect = agent.inspect_services().unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("inspect services --json:\n{inspect:#}");
    let text = inspect.to_string();
    assert!(
        text.contains("10.96.0.10"),
        "the VIP is not in the inspect output"
    );

    assert_all_ok("TCP via the agent", &env.tcp("10.96.0.10:80", 20));

    stop_with_exit_0(&mut env);
    assert!(
        !pins.exists(),
        "the agent left {} behind: the contract (and README) says SIGTERM detaches \
         the programs and removes the pin directory",
        pins.display()
    );
    // Detached: the VIP is an unrouted address again.
    assert_detached(&env, "after exit", "TCP after the agent stopped");
}

#[test]
fn sigterm_keeps_the_datapath_serving_until_cleanup() {
    require_root!();
    let mut env = web_env("keep", 2);
    let pins = env.agent().pin_dir().to_path_buf();
    assert_all_ok("TCP via the agent", &env.tcp("10.96.0.10:80", 10));

    stop_with_exit_0(&mut env);
    assert!(
        pins.join("LB_SERVICES").exists(),
        "pins removed on a plain SIGTERM"
    );
    assert!(
        pins.join("links").join("connect4").exists(),
        "link pins removed"
    );
    assert!(
        attached(env.cgroup.path()).len() >= 8,
        "programs detached on a plain SIGTERM"
    );
    // No agent runs, yet the pinned datapath still serves the ClusterIP.
    assert_all_ok("TCP with the agent stopped", &env.tcp("10.96.0.10:80", 20));

    let agent_bin = integration_tests::agent_bin().unwrap();
    let out = cmd::run(
        Command::new(&agent_bin)
            .arg("cleanup")
            .arg("--bpffs")
            .arg(&pins),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("cleanup: {out}");
    assert!(!pins.exists(), "cleanup left {}", pins.display());
    assert_detached(&env, "after cleanup", "TCP after cleanup");
}
