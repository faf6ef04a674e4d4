//! kube-proxy's health on a running agent: `/healthz` and `/livez` with
//! their JSON, the Node being deleted (deletionTimestamp, the Cluster
//! Autoscaler's taint) from a manifest and from the API, a change that
//! cannot be programmed making the agent unhealthy after
//! `--healthz-timeout` (health-check node ports included), and `/metrics`
//! on its own address.
mod common;

use std::time::Duration;

use common::{api_and_env, web, web_env};
use integration_tests::{
    nodes::{node_v4, Cluster},
    require_root, wait_until, Agent, AgentOpts, Env,
};
use serde_json::{json, Value};

const TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// GET `path`: the status and the body as JSON.
fn json_get(agent: &Agent, path: &str) -> (u16, Value) {
    let (code, body) = agent.get(path).unwrap();
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body:?}"));
    (code, v)
}

/// An RFC 3339 UTC time, as the agent writes them.
fn is_time(v: &Value) -> bool {
    v.as_str().is_some_and(|s| {
        s.len() >= 20 && s.ends_with('Z') && s.as_bytes()[4] == b'-' && s.as_bytes()[10] == b'T'
    })
}

/// Polls `path` until it answers `code`; the last body.
fn until_code(agent: &Agent, path: &str, code: u16, within: Duration) -> Value {
    let mut last = (0, Value::Null);
    let ok = wait_until(within, Duration::from_millis(100), || {
        last = json_get(agent, path);
        last.0 == code
    });
    assert!(
        ok,
        "{path} never answered {code}; last {} {}\n{}",
        last.0,
        last.1,
        agent.log()
    );
    last.1
}

fn node(name: &str, deleting: bool, taints: &[&str]) -> Value {
    let mut n = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    if deleting {
        n["metadata"]["deletionTimestamp"] = json!("2024-01-01T00:00:00Z");
        n["metadata"]["finalizers"] = json!(["example.com/hold"]);
    }
    if !taints.is_empty() {
        n["spec"] = json!({"taints": taints.iter()
            .map(|k| json!({"key": k, "effect": "NoSchedule"})).collect::<Vec<_>>()});
    }
    n
}

/// `/healthz` and `/livez` in kube-proxy's JSON, with its headers; the
/// Node manifest being deleted turns `/healthz` (not `/livez`) to 503;
/// `/metrics` is on the metrics address, not the health address.
#[test]
fn healthz_livez_and_the_node_being_deleted_from_a_manifest() {
    require_root!();
    let env = web_env("hlth", 1);
    let agent = env.agent();
    let (code, v) = json_get(agent, "/healthz");
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["nodeEligible"], true, "{v}");
    assert!(
        is_time(&v["lastUpdated"]) && is_time(&v["currentTime"]),
        "{v}"
    );
    let (code, v) = json_get(agent, "/livez");
    assert_eq!(code, 200, "{v}");
    assert!(
        is_time(&v["lastUpdated"]) && is_time(&v["currentTime"]),
        "{v}"
    );
    assert!(v.get("nodeEligible").is_none(), "{v}");
    // kube-proxy's headers.
    let raw = {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(agent.health_addr()).unwrap();
        s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.to_ascii_lowercase()
    };
    assert!(raw.contains("content-type: application/json\r\n"), "{raw}");
    assert!(raw.contains("x-content-type-options: nosniff\r\n"), "{raw}");

    // Metrics apart.
    assert_eq!(agent.get("/metrics").unwrap().0, 404);
    let (code, m) = agent.metrics().unwrap();
    assert_eq!(code, 200);
    assert!(m.contains("lb_sync_duration_seconds_count"), "{m}");
    assert_ne!(agent.metrics_addr(), agent.health_addr());

    for (what, n) in [
        (
            "the autoscaler's taint",
            node("node-1", false, &["other", TAINT]),
        ),
        ("a deletionTimestamp", node("node-1", true, &[])),
    ] {
        env.manifests.write("node.yaml", &[n]).unwrap();
        let v = until_code(agent, "/healthz", 503, Duration::from_secs(10));
        assert_eq!(v["nodeEligible"], false, "{what}: {v}");
        let (code, v) = json_get(agent, "/livez");
        assert_eq!(code, 200, "{what}: /livez ignores the Node: {v}");
        // A plain Node again.
        env.manifests
            .write("node.yaml", &[node("node-1", false, &["other"])])
            .unwrap();
        let v = until_code(agent, "/healthz", 200, Duration::from_secs(10));
        assert_eq!(v["nodeEligible"], true, "{what}: {v}");
    }
}

/// Cluster mode: the watched Node gets the taint, then a
/// deletionTimestamp, through the API.
#[test]
fn node_being_deleted_through_the_api() {
    require_root!();
    let (api, mut env) = api_and_env("hlthapi", 1);
    api.apply(&node("node-1", false, &[])).unwrap();
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    let agent = env.agent();
    let (code, v) = json_get(agent, "/healthz");
    assert_eq!((code, &v["nodeEligible"]), (200, &json!(true)), "{v}");
    api.apply(&node("node-1", false, &[TAINT])).unwrap();
    let v = until_code(agent, "/healthz", 503, Duration::from_secs(10));
    assert_eq!(v["nodeEligible"], false, "{v}");
    assert_eq!(json_get(agent, "/livez").0, 200);
    api.apply(&node("node-1", false, &[])).unwrap();
    until_code(agent, "/healthz", 200, Duration::from_secs(10));
    api.apply(&node("node-1", true, &[])).unwrap();
    let v = until_code(agent, "/healthz", 503, Duration::from_secs(10));
    assert_eq!(v["nodeEligible"], false, "{v}");
    assert_eq!(json_get(agent, "/livez").0, 200);
    drop(env);
    drop(api);
}

const HEALTH_PORT: u16 = 32000;

fn local_lb(c: &Cluster) -> Vec<Value> {
    let pod = c.pod("n1p0").clone();
    vec![
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "local", "namespace": "demo"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11"],
                "externalTrafficPolicy": "Local", "healthCheckNodePort": HEALTH_PORT,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30081}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}}),
        c.slice("local", &[&pod], false, "TCP"),
    ]
}

/// Services beyond `--max-services`: their writes fail, the change stays
/// pending, and after `--healthz-timeout` `/healthz`, `/livez` and the
/// health-check node port (`serviceProxyHealthy`) answer 503; once the
/// change can be programmed they recover.
#[test]
fn a_change_that_cannot_be_programmed_turns_unhealthy_after_the_timeout() {
    require_root!();
    let mut c = Cluster::new("hlthto", &[1]).expect("topology");
    c.serve_all().unwrap();
    let mut docs = c.node_objects();
    docs.extend(local_lb(&c));
    c.manifests.write("cluster.yaml", &docs).unwrap();
    c.start_agents(&["--max-services", "16", "--healthz-timeout", "2s"])
        .unwrap();
    let agent = &c.agents[0];
    let hc = || {
        let (code, body) = c.health_check(1, HEALTH_PORT).unwrap();
        (code, serde_json::from_str::<Value>(&body).unwrap())
    };
    let (code, v) = hc();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["serviceProxyHealthy"], true, "{v}");
    assert_eq!(v["localEndpoints"], 1, "{v}");
    assert_eq!(json_get(agent, "/healthz").0, 200);

    let many: Vec<Value> = (1..=40)
        .map(|i| {
            json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("s{i}"), "namespace": "demo"},
                "spec": {"clusterIP": format!("10.96.1.{i}"),
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
        })
        .collect();
    c.manifests.write("many.yaml", &many).unwrap();
    let failed = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        agent.log().contains("map write failed")
    });
    assert!(failed, "the map never filled:\n{}", agent.log());
    // Not late yet right after the failure.
    let (code, v) = json_get(agent, "/healthz");
    assert_eq!(code, 200, "before the timeout: {v}");
    let v = until_code(agent, "/healthz", 503, Duration::from_secs(5));
    assert_eq!(v["nodeEligible"], true, "{v}");
    assert!(is_time(&v["lastUpdated"]), "{v}");
    assert_ne!(
        v["lastUpdated"], v["currentTime"],
        "the last sync's time: {v}"
    );
    assert_eq!(json_get(agent, "/livez").0, 503);
    let (code, v) = hc();
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["serviceProxyHealthy"], false, "{v}");
    assert_eq!(v["localEndpoints"], 1, "{v}");
    // Still served meanwhile: the last good state stays programmed.
    let target = format!("{}:30081", node_v4(1));
    let a = c.from_client("tcp", &target, 3);
    assert!(a.iter().all(|a| a.ok), "{a:?}");

    c.manifests.remove("many.yaml").unwrap();
    until_code(agent, "/healthz", 200, Duration::from_secs(10));
    assert_eq!(json_get(agent, "/livez").0, 200);
    let (code, v) = hc();
    assert_eq!(
        (code, &v["serviceProxyHealthy"]),
        (200, &json!(true)),
        "{v}"
    );
}

/// With `--nodeport-addresses`, the health-check node port listens on the
/// node addresses within those prefixes only.
#[test]
fn health_check_node_ports_bind_the_node_addresses() {
    require_root!();
    let mut c = Cluster::new("hlthbind", &[1]).expect("topology");
    c.serve_all().unwrap();
    let mut docs = c.node_objects();
    docs.extend(local_lb(&c));
    c.manifests.write("cluster.yaml", &docs).unwrap();
    c.start_agents(&["--nodeport-addresses", &format!("{}/32", node_v4(1))])
        .unwrap();
    let (code, body) = c.health_check(1, HEALTH_PORT).unwrap();
    assert_eq!(code, 200, "{body}");
    // Loopback inside the node is not a node address.
    let ns = c.nodes[0].netns.clone();
    let r = integration_tests::agent::http_get_in(
        Some(&ns),
        (std::net::Ipv4Addr::LOCALHOST, HEALTH_PORT).into(),
        "/",
    );
    assert!(r.is_err(), "answered on 127.0.0.1: {r:?}");
}

/// A datapath part that was asked for and cannot be attached is no silent
/// half-start: with a `--devices` entry that does not exist, `/readyz`
/// answers 503 naming it and what it lacks, `lb_tc_attach_failing` is 1 and
/// `lb_device_attach_failing` 1 for each of its hooks (0 for `eth0`'s), and
/// `lb-agent inspect tc` gives the reason per hook, while the socket path
/// serves and the device that exists (`eth0`) has its programs; once the
/// device appears, a later sweep attaches the tc programs (logged and
/// counted as a re-attach) and the agent turns ready. On either attach
/// path (`mode`).
fn unattached_device_keeps_the_agent_unready(tag: &str, mode: &str) {
    let mut env = Env::new(tag, 2).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    let netns = env.topo.client_netns().to_string();
    env.start_agent_with(AgentOpts {
        netns: Some(netns.clone()),
        extra_args: vec![
            "--devices".into(),
            "lbmissing0,eth0".into(),
            "--tc-attach".into(),
            mode.into(),
            "--sweep-interval".into(),
            "500ms".into(),
        ],
        no_ready_wait: true,
        ..Default::default()
    })
    .unwrap();
    let agent = env.agent();
    let mut last = (0, String::new());
    let unready = wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
        last = agent.get("/readyz").unwrap_or((0, String::new()));
        last.0 == 503
            && last
                .1
                .contains("lbmissing0 (absent): tc_ingress, tc_egress")
    });
    assert!(unready, "/readyz: {last:?}\n{}", agent.log());
    assert!(!last.1.contains("eth0"), "{last:?}");
    let (_, m) = agent.metrics().unwrap();
    assert!(m.contains("lb_tc_attach_failing 1"), "{m}");
    let failing = |m: &str, dev: &str, v: u8| {
        ["tc_ingress", "tc_egress"].iter().all(|hook| {
            m.contains(&format!(
                "lb_device_attach_failing{{device=\"{dev}\",hook=\"{hook}\"}} {v}"
            ))
        })
    };
    assert!(
        failing(&m, "lbmissing0", 1) && failing(&m, "eth0", 0),
        "{m}"
    );
    let shown = |agent: &Agent| -> Vec<(String, String)> {
        agent
            .inspect_tc()
            .unwrap()
            .iter()
            .map(|v| match v["reason"].as_str() {
                Some(r) => (
                    format!("reason {}", v["device"].as_str().unwrap()),
                    r.to_owned(),
                ),
                None => (
                    v["device"].as_str().unwrap().to_owned(),
                    format!("{} {}", v["mode"].as_str().unwrap(), v["direction"]),
                ),
            })
            .collect()
    };
    let views = shown(agent);
    assert!(
        views
            .iter()
            .filter(|(k, r)| k == "reason lbmissing0" && r == "device absent")
            .count()
            == 2,
        "{views:?}"
    );
    // The device that exists is served meanwhile.
    let on = |views: &[(String, String)], dev: &str| {
        views
            .iter()
            .filter(|(d, m)| d == dev && m.starts_with(mode))
            .count()
    };
    assert_eq!(on(&views, "eth0"), 2, "{views:?}");
    integration_tests::cmd::ip(&[
        "-n",
        &netns,
        "link",
        "add",
        "lbmissing0",
        "type",
        "veth",
        "peer",
        "name",
        "lbmissing1",
    ])
    .unwrap();
    integration_tests::cmd::ip(&["-n", &netns, "link", "set", "lbmissing0", "up"]).unwrap();
    let ready = wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
        last = agent.get("/readyz").unwrap_or((0, String::new()));
        last.0 == 200
    });
    assert!(ready, "/readyz: {last:?}\n{}", agent.log());
    let (_, m) = agent.metrics().unwrap();
    assert!(m.contains("lb_tc_attach_failing 0"), "{m}");
    assert!(
        failing(&m, "lbmissing0", 0) && failing(&m, "eth0", 0),
        "{m}"
    );
    assert!(
        m.contains("lb_device_reattachments_total{device=\"lbmissing0\"} 1"),
        "{m}"
    );
    assert!(agent.log().contains("appeared"), "{}", agent.log());
    let views = shown(agent);
    assert!(
        views.iter().all(|(k, _)| !k.starts_with("reason")),
        "{views:?}"
    );
    assert_eq!(on(&views, "lbmissing0"), 2, "{views:?}");
    assert_eq!(on(&views, "eth0"), 2, "{views:?}");
}

#[test]
fn a_device_the_tc_programs_cannot_attach_to_keeps_the_agent_unready() {
    require_root!();
    unattached_device_keeps_the_agent_unready("tcdev", "tcx");
}

/// The same on the clsact path (issue 15: kernels without TCX).
#[test]
fn a_device_the_clsact_filters_cannot_attach_to_keeps_the_agent_unready() {
    require_root!();
    unattached_device_keeps_the_agent_unready("tcnl", "netlink");
}

/// Idle and slowloris connections to the health address are closed after
/// the header timeout (5 s), connections from one address beyond its cap
/// (16) at once, and the server answers afterwards. Before, all were kept open forever: that
/// is how an open health port ran the agent out of file descriptors.
#[test]
fn the_health_server_closes_idle_slow_and_excess_connections() {
    use std::io::{Read as _, Write as _};
    require_root!();
    let env = web_env("hlimits", 1);
    let agent = env.agent();
    let (cap, opened) = (16, 200);
    // First, so that it has a place: sends its head a byte at a time,
    // never its end.
    let mut slow = std::net::TcpStream::connect(agent.health_addr()).unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let idle: Vec<std::net::TcpStream> = (1..opened)
        .map(|_| std::net::TcpStream::connect(agent.health_addr()).unwrap())
        .collect();
    let closed = |mut s: &std::net::TcpStream| {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    };
    // Well within the header timeout: only those beyond the cap are closed.
    std::thread::sleep(Duration::from_millis(1500));
    let early = idle.iter().filter(|s| closed(s)).count();
    assert_eq!(
        early,
        opened - cap,
        "connections closed at once (beyond the per-source cap of {cap})"
    );
    // Then everything, the slowloris one included, once its header time
    // is up.
    let slow_writer = std::thread::spawn(move || {
        for _ in 0..100 {
            if slow.write_all(b"X").is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    });
    let all = wait_until(Duration::from_secs(20), Duration::from_millis(200), || {
        idle.iter().all(closed)
    });
    let open = idle.iter().filter(|s| !closed(s)).count();
    assert!(
        all,
        "{open} of {opened} idle connections still open after 20 s"
    );
    assert!(
        slow_writer.join().unwrap(),
        "a connection sending its header a byte every 200 ms was kept 20 s"
    );
    assert_eq!(agent.get("/healthz").unwrap().0, 200);
    assert_eq!(agent.get("/readyz").unwrap().0, 200);
}
