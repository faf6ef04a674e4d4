//! Least privilege, for real: the agent run with exactly the capabilities
//! `deploy/daemonset.yaml` grants its container does its work (load,
//! attach, serve, destroy stale UDP sockets), and without the ones the
//! file says a part needs, that part fails.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{
    cluster::hold_udp,
    manifests::{Endpoint, EndpointSlice},
    require_root, workspace_root, AgentOpts, Env,
};
use serde_yaml::Value;

/// The DaemonSet's pod spec.
fn pod_spec() -> Value {
    let path = workspace_root().join("deploy/daemonset.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let ds: Value = serde_yaml::from_str(&text).unwrap();
    ds["spec"]["template"]["spec"].clone()
}

fn container<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_sequence()
        .and_then(|s| s.iter().find(|c| c["name"].as_str() == Some(name)))
        .unwrap_or_else(|| panic!("no container {name} in deploy/daemonset.yaml"))
}

/// `capabilities.add` of a container.
fn added(c: &Value) -> Vec<String> {
    c["securityContext"]["capabilities"]["add"]
        .as_sequence()
        .unwrap_or_else(|| panic!("{:?} adds no capabilities", c["name"]))
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

/// `capabilities.add` of the agent's container.
fn granted() -> Vec<String> {
    added(container(&pod_spec()["containers"], "lb-agent"))
}

/// Not privileged, no privilege escalation, a read-only root, the
/// runtime's seccomp profile, every capability dropped but those added.
fn assert_restricted(c: &Value) {
    let sc = &c["securityContext"];
    assert_ne!(sc["privileged"].as_bool(), Some(true), "{sc:?}");
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(
        sc["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault")
    );
    let drop: Vec<&str> = sc["capabilities"]["drop"]
        .as_sequence()
        .map(|d| d.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert_eq!(drop, ["ALL"]);
}

#[test]
fn the_agent_container_is_not_privileged() {
    let spec = pod_spec();
    let agent = container(&spec["containers"], "lb-agent");
    assert_restricted(agent);
    // Kubernetes allows Bidirectional propagation in privileged
    // containers only: the agent's container takes the host's bpffs as it
    // is, the init container mounts one if there is none.
    for m in agent["volumeMounts"].as_sequence().unwrap() {
        assert_ne!(
            m["mountPropagation"].as_str(),
            Some("Bidirectional"),
            "{m:?}"
        );
    }
    let init = container(&spec["initContainers"], "mount-bpffs");
    assert_eq!(init["securityContext"]["privileged"].as_bool(), Some(true));
}

/// `web` with every backend but `gone`, in the slice `web-abcde`.
fn web_without(env: &Env, gone: &str) -> Vec<serde_json::Value> {
    let mut s = EndpointSlice::new("demo", "web-abcde", "web");
    for (name, port, proto) in WEB_PORTS {
        s = s.port(name, port, proto);
    }
    let rest = env.topo.backends().filter(|h| h.name != gone);
    vec![
        web_service().to_value(),
        s.endpoints(rest.map(|h| Endpoint::ready(h.ipv4.into())))
            .to_value(),
    ]
}

/// An agent with `caps` serving `web`; a connected UDP socket to it, then
/// its backend leaves. Whether the agent destroyed the socket, and what the
/// probe and the agent said.
fn udp_socket_destroyed_with(tag: &str, caps: Vec<String>) -> (bool, String) {
    let mut env = Env::new(tag, 2).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    env.start_agent_with(AgentOpts {
        capabilities: Some(caps),
        ..Default::default()
    })
    .unwrap();
    let a = env.tcp(&format!("{VIP}:80"), 20);
    assert_all_ok("TCP to the ClusterIP", &a);
    let probe = hold_udp(&env, &format!("{VIP}:53"), 100, 20_000).unwrap();
    let first = probe.next_attempt(Duration::from_secs(5)).unwrap();
    assert!(first.ok, "{first:?}");
    let on = first.backend.clone().unwrap();
    env.manifests
        .write("web.yaml", &web_without(&env, &on))
        .unwrap();
    // With the right capabilities the socket is destroyed within a sync;
    // 50 attempts at 100 ms are 5 s.
    let (destroyed, seen) = match probe.until_error(50) {
        Ok((a, _)) => (a.error.as_deref() == Some("ECONNABORTED"), format!("{a:?}")),
        Err(e) => (false, format!("{e:#}")),
    };
    (
        destroyed,
        format!("probe: {seen}\nagent:\n{}", env.agent().log()),
    )
}

#[test]
fn the_daemonsets_capabilities_are_enough() {
    require_root!();
    let caps = granted();
    let (destroyed, log) = udp_socket_destroyed_with("capsall", caps.clone());
    assert!(
        destroyed,
        "with {caps:?} the stale UDP socket stays:\n{log}"
    );
}

/// SYS_ADMIN is for `setns(2)` into a pod's network namespace, NET_ADMIN
/// for `SOCK_DESTROY`; without either a stale UDP socket is not destroyed
/// and the log says why. (With neither BPF, PERFMON nor SYS_ADMIN nothing
/// loads at all; SYS_ADMIN implies the other two.)
#[test]
fn without_sys_admin_or_net_admin_stale_udp_sockets_stay() {
    require_root!();
    for (tag, missing) in [("capsnosa", "SYS_ADMIN"), ("capsnona", "NET_ADMIN")] {
        let caps: Vec<String> = granted().into_iter().filter(|c| c != missing).collect();
        assert_ne!(caps.len(), granted().len(), "{missing} is granted");
        let (destroyed, log) = udp_socket_destroyed_with(tag, caps);
        assert!(!destroyed, "destroyed without {missing}:\n{log}");
        assert!(
            log.contains("destroying stale UDP sockets"),
            "no error logged without {missing}:\n{log}"
        );
    }
}

fn stdout_and_stderr(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `lb-agent check` with only `caps`, as the init container runs it: its
/// exit status and output.
fn check_with(caps: &[String], args: &[String]) -> (bool, String) {
    let argv = integration_tests::agent::setpriv(caps);
    let out = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .arg(integration_tests::agent_bin().unwrap())
        .args(args)
        .output()
        .expect("running setpriv");
    let text = stdout_and_stderr(&out);
    (out.status.success(), text)
}

/// The init container `check-kernel` runs `lb-agent check` as restricted
/// as the agent's container, with fewer capabilities: with those it passes
/// here (every program verified), and without any one of them it fails,
/// so each is needed and none is missing.
#[test]
fn the_check_init_container_passes_with_its_capabilities_and_needs_each() {
    require_root!();
    let spec = pod_spec();
    let init = container(&spec["initContainers"], "check-kernel");
    assert_restricted(init);
    assert_eq!(
        init["image"],
        container(&spec["containers"], "lb-agent")["image"]
    );
    let args: Vec<String> = init["args"]
        .as_sequence()
        .expect("check-kernel has args")
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(args.first().map(String::as_str), Some("check"), "{args:?}");
    let caps = added(init);
    let agent_caps = granted();
    assert!(caps.iter().all(|c| agent_caps.contains(c)), "{caps:?}");
    let (ok, out) = check_with(&caps, &args);
    assert!(ok, "with {caps:?}:\n{out}");
    assert!(out.contains("result: lb-agent run can start"), "{out}");
    assert!(!out.contains("REJECTED"), "{out}");
    for missing in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let (ok, out) = check_with(&fewer, &args);
        assert!(!ok, "passes without {missing}:\n{out}");
        assert!(out.contains("cannot start here"), "{out}");
    }
}

/// Every manifest in `deploy/` against the Kubernetes 1.34 schema, strict
/// (no unknown fields), offline (`cargo xtask setup` installs the tool).
#[test]
fn the_deployment_validates_against_kubernetes_1_34() {
    let root = workspace_root().join("deploy");
    let files: Vec<std::path::PathBuf> = ["daemonset.yaml", "rbac.yaml", "configmap.yaml"]
        .iter()
        .map(|f| root.join(f))
        .chain([root.join("migrate/kube-proxy-cleanup.yaml")])
        .collect();
    let out = std::process::Command::new("kubernetes-validate")
        .args(["--kubernetes-version", "1.34.0", "--strict"])
        .args(&files)
        .output()
        .expect("kubernetes-validate is not installed: run `cargo xtask setup`");
    let text = stdout_and_stderr(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("daemonset/lb-agent against version 1.34"),
        "{text}"
    );
}
