//! The tc path's XDP stage (`--acceleration`, issue 42): a NodePort whose
//! backend is on the other node, served by n1 (no pods) to n2's pod, with
//! XDP in native mode on every node's `eth0` (veth; the test bed made
//! ready for it, `Cluster::accelerate`).
//!
//! What XDP does is counted apart (`xdp_translated`): each test checks that
//! it carried the flows' established packets, and that every byte still
//! arrived as sent (`tcpflow`).
use std::time::{Duration, Instant};

use integration_tests::{
    cluster::metric,
    cmd,
    nodes::{node_v4, Cluster, POD_PORT},
    require_root,
    tcpflow::{problems, run_clients, ClientReport, ClientRun, StreamServers},
};
use serde_json::{json, Value};

const REMOTE: u16 = 30092;
const MIB: u64 = 1 << 20;
const NATIVE: &str = "--acceleration=native";

fn target() -> String {
    format!("{}:{REMOTE}", node_v4(1))
}

/// The servers go before the cluster (fields drop in order).
struct Bed {
    servers: StreamServers,
    c: Cluster,
}

/// n1 without pods, n2 with one; NodePort `REMOTE` to n2's pod; agents
/// with `agent_args`. Returns once the NodePort answers through n1.
fn setup(tag: &str, agent_args: &[&str]) -> Bed {
    let mut c = Cluster::new(tag, &[0, 1]).expect("topology");
    let servers = StreamServers::start(&c.pods, POD_PORT, &[0, 1]).expect("servers");
    let n2p0 = c.pod("n2p0").clone();
    let mut docs = c.node_objects();
    docs.extend([
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "remote", "namespace": "demo"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.92", "clusterIPs": ["10.96.0.92"],
                "ipFamilyPolicy": "SingleStack", "externalTrafficPolicy": "Cluster",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": POD_PORT, "nodePort": REMOTE}]},
        }),
        c.slice("remote", &[&n2p0], false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    c.start_agents(agent_args).expect("agents");
    let bad = c.with_default_route();
    assert!(bad.is_empty(), "namespaces with a default route: {bad:?}");
    let bed = Bed { servers, c };
    assert!(
        answers(&bed.c, Duration::from_secs(20)),
        "NodePort {REMOTE} never answered\n{}",
        bed.c.agent_logs()
    );
    bed
}

/// Whether a short connection through n1 gets its answer within `within`.
fn answers(c: &Cluster, within: Duration) -> bool {
    let ns = c.client_netns.clone();
    Cluster::eventually(within, || {
        let run = ClientRun::new(&ns, &target(), "ready", "crr")
            .arg("--down-bytes", 16)
            .arg("--connect-timeout-ms", 1000);
        run_clients(&[run.args()], Duration::from_secs(10))
            .map(|r| !r.is_empty() && r.iter().all(|c| c.error.is_none()))
            .unwrap_or(false)
    })
}

/// n1's counters of the packets translated in XDP and in tc.
fn translated(c: &Cluster) -> (f64, f64) {
    let (_, text) = c.agents[0].metrics().expect("n1's metrics");
    let event = |e: &str| {
        metric(&text, &format!("lb_datapath_events_total{{event=\"{e}\"}}")).unwrap_or(0.0)
    };
    (event("xdp_translated"), event("tc_translated"))
}

/// Bulk (4 MiB each way, round after round) and streaming connections
/// from both clients on both CPUs, for `ms`.
fn traffic(c: &Cluster, ms: u64) -> (Vec<Vec<String>>, Vec<String>) {
    let clients = [c.client_netns.clone(), c.client2_netns.clone()];
    let mut runs = Vec::new();
    let mut expected = Vec::new();
    for i in 0..2 {
        runs.push(
            ClientRun::new(&clients[i], &target(), &format!("bulk{i}"), "bulk")
                .cpu(Some(i))
                .arg("--up-bytes", 4 * MIB)
                .arg("--down-bytes", 4 * MIB)
                .arg("--rounds", 100)
                .arg("--until-ms", ms)
                .arg("--connect-timeout-ms", 10_000)
                .args(),
        );
        expected.push(format!("bulk{i}.0"));
        runs.push(
            ClientRun::new(&clients[1 - i], &target(), &format!("stream{i}"), "stream")
                .cpu(Some(1 - i))
                .arg("--duration-ms", ms)
                .arg("--connect-timeout-ms", 10_000)
                .args(),
        );
        expected.push(format!("stream{i}"));
    }
    (runs, expected)
}

/// What went wrong with the connections `reports` (client side) joined
/// with the servers' reports.
fn broken(bed: &Bed, reports: &[ClientReport], expected: &[String]) -> Vec<String> {
    let ids: Vec<String> = reports.iter().map(|r| r.id.clone()).collect();
    let servers = bed.servers.wait_for(&ids, Duration::from_secs(10));
    problems(reports, &servers, expected)
}

/// The hooks n1's `inspect tc` shows attached on `eth0`: (hook, mode,
/// ifindex).
fn hooks_on_eth0(c: &Cluster) -> Vec<(String, String, u64)> {
    let views = c.agents[0].inspect_tc().expect("inspect tc");
    views
        .iter()
        .filter(|v| v["device"] == "eth0" && v["attached"] == true)
        .map(|v| {
            (
                v["hook"].as_str().unwrap_or_default().to_owned(),
                v["mode"].as_str().unwrap_or_default().to_owned(),
                v["ifindex"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

/// The XDP program id on n1's `eth0`, as `ip link` shows it.
fn xdp_on_eth0(c: &Cluster) -> Option<u64> {
    let out = cmd::ip(&["-n", &c.nodes[0].netns, "-j", "-d", "link", "show", "eth0"]).ok()?;
    let v: Value = serde_json::from_str(&out).ok()?;
    v[0]["xdp"]["prog"]["id"].as_u64()
}

#[test]
fn established_flows_to_another_node_are_sent_on_from_xdp() {
    require_root!();
    let bed = setup("xdpflow", &[NATIVE]);
    let c = &bed.c;
    let hooks = hooks_on_eth0(c);
    assert!(
        hooks.iter().any(|(h, m, _)| h == "lb_xdp" && m == "native"),
        "inspect tc shows no XDP on eth0: {hooks:?}"
    );
    assert!(
        xdp_on_eth0(c).is_some(),
        "ip link shows no XDP on n1's eth0"
    );
    let before = translated(c);
    let (runs, expected) = traffic(c, 4000);
    let reports = run_clients(&runs, Duration::from_secs(60)).expect("clients");
    let after = translated(c);
    let bad = broken(&bed, &reports, &expected);
    let (xdp, tc) = (after.0 - before.0, after.1 - before.1);
    println!(
        "{} connections, {} broken; packets translated by n1: {xdp} in XDP, {tc} in tc",
        reports.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "broken connections: {bad:#?}");
    // Bulk rounds of 4 MiB each way are thousands of segments and ACKs;
    // tc translates the setup and end of each connection and the first
    // packet of each direction in each second (the cached hop's life).
    assert!(xdp > 10_000.0, "only {xdp} packets translated in XDP");
    assert!(
        xdp > 5.0 * tc,
        "XDP translated {xdp} packets, tc {tc}: the established packets did not stay in XDP"
    );
}

/// Without `--acceleration` nothing runs in XDP (the control for the test
/// above: the counter is XDP's alone).
#[test]
fn without_acceleration_nothing_is_translated_in_xdp() {
    require_root!();
    let bed = setup("xdpoff", &["--acceleration=off"]);
    let c = &bed.c;
    assert_eq!(
        xdp_on_eth0(c),
        None,
        "XDP on n1's eth0 without --acceleration"
    );
    let (runs, expected) = traffic(c, 1500);
    let reports = run_clients(&runs, Duration::from_secs(60)).expect("clients");
    let bad = broken(&bed, &reports, &expected);
    assert!(bad.is_empty(), "broken connections: {bad:#?}");
    let (xdp, tc) = translated(c);
    assert_eq!(xdp, 0.0, "XDP translated without acceleration");
    assert!(tc > 1000.0, "tc translated only {tc}");
}

/// Restarts of n1's agent while bulk and streaming flows run: with the
/// same acceleration (the XDP program swapped in place in its link),
/// then without it (the XDP link removed: tc alone serves the flows),
/// then with it again. No flow breaks; XDP is on `eth0` exactly when
/// asked, and carries the flows again after the last restart.
#[test]
fn restarts_and_acceleration_switched_under_load_keep_every_flow() {
    require_root!();
    let mut bed = setup("xdpswitch", &[NATIVE]);
    let first = xdp_on_eth0(&bed.c).expect("XDP on n1's eth0");
    // Long enough for three restarts (each verifies the programs again,
    // ~10 s here) and a few seconds after the last.
    const RUN_MS: u64 = 75_000;
    let (runs, expected) = traffic(&bed.c, RUN_MS);
    let began = Instant::now();
    let mut seen = Vec::new();
    let mut after_last = (0.0, 0.0);
    let reports = std::thread::scope(|s| {
        let traffic = s.spawn(|| run_clients(&runs, Duration::from_secs(150)));
        let restart = |bed: &mut Bed, change: &dyn Fn(&mut integration_tests::Agent)| {
            std::thread::sleep(Duration::from_secs(2));
            let agent = &mut bed.c.agents[0];
            agent.kill().expect("SIGKILL n1's agent");
            change(agent);
            agent
                .restart(Duration::from_secs(30))
                .expect("restart n1's agent");
        };
        restart(&mut bed, &|_| ());
        seen.push(("restarted, accelerated", xdp_on_eth0(&bed.c)));
        restart(&mut bed, &|a| a.remove_arg(NATIVE));
        seen.push(("restarted without acceleration", xdp_on_eth0(&bed.c)));
        restart(&mut bed, &|a| a.add_args(&[NATIVE]));
        seen.push(("restarted accelerated again", xdp_on_eth0(&bed.c)));
        after_last = translated(&bed.c);
        traffic.join().expect("clients")
    })
    .expect("clients");
    let end = translated(&bed.c);
    let bad = broken(&bed, &reports, &expected);
    println!(
        "XDP on n1's eth0: at start {first}, then {seen:?}; {} broken; the last restart {:.1} s in",
        bad.len(),
        began.elapsed().as_secs_f64()
    );
    assert!(bad.is_empty(), "broken connections: {bad:#?}");
    let ids: Vec<Option<u64>> = seen.iter().map(|(_, id)| *id).collect();
    assert!(
        matches!(ids[..], [Some(a), None, Some(_)] if a != first),
        "XDP programs on eth0 across the restarts: {seen:?} (first {first})"
    );
    let xdp = end.0 - after_last.0;
    assert!(
        xdp > 1000.0,
        "only {xdp} packets in XDP since the last restart"
    );
}

/// n1's `eth0` deleted and created again under the agent (a NIC reset):
/// within a sweep it has its XDP program again, on the new ifindex, and
/// established packets go through XDP again.
#[test]
fn a_re_created_device_gets_its_xdp_program_again() {
    require_root!();
    let bed = setup("xdpplug", &[NATIVE, "--sweep-interval=1s"]);
    let c = &bed.c;
    let before: Vec<u64> = hooks_on_eth0(c)
        .into_iter()
        .filter(|(h, _, _)| h == "lb_xdp")
        .map(|(_, _, i)| i)
        .collect();
    assert_eq!(before.len(), 1, "{before:?}");
    let mac = c.unplug_node(1).expect("unplug n1");
    c.replug_node(1, &mac).expect("replug n1");
    let back = Cluster::eventually(Duration::from_secs(10), || {
        hooks_on_eth0(c)
            .iter()
            .any(|(h, m, i)| h == "lb_xdp" && m == "native" && *i != before[0])
    });
    assert!(
        back,
        "no XDP on the new eth0: {:?}\n{}",
        hooks_on_eth0(c),
        c.agent_logs()
    );
    assert!(
        xdp_on_eth0(c).is_some(),
        "ip link shows no XDP on n1's new eth0"
    );
    assert!(
        answers(c, Duration::from_secs(20)),
        "NodePort not served again"
    );
    let start = translated(c).0;
    let (runs, expected) = traffic(c, 2000);
    let reports = run_clients(&runs, Duration::from_secs(60)).expect("clients");
    let bad = broken(&bed, &reports, &expected);
    assert!(bad.is_empty(), "broken connections: {bad:#?}");
    let xdp = translated(c).0 - start;
    assert!(xdp > 1000.0, "only {xdp} packets in XDP on the new eth0");
}

/// A device whose driver has no native XDP (a bridge): with `native` it
/// lacks its XDP program and `/readyz` says so, naming it; with
/// `best-effort` the tc programs serve it alone and the agent is ready,
/// the device shown unaccelerated; eth0 is accelerated either way.
#[test]
fn a_device_without_native_xdp_fails_native_and_passes_best_effort() {
    require_root!();
    let mut c = Cluster::new("xdpbridge", &[0, 1]).expect("topology");
    let n1 = c.nodes[0].netns.clone();
    cmd::ip(&["-n", &n1, "link", "add", "ext0", "type", "bridge"]).expect("ext0");
    cmd::ip(&["-n", &n1, "link", "set", "ext0", "up"]).expect("ext0 up");
    let docs = c.node_objects();
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    c.start_agent_on(
        1,
        &[
            "--devices=eth0,ext0".into(),
            "--acceleration=best-effort".into(),
        ],
        Duration::from_secs(20),
    )
    .expect("best-effort: ready");
    let views = c.agents[0].inspect_tc().expect("inspect tc");
    let xdp = |dev: &str| {
        views
            .iter()
            .find(|v| v["device"] == dev && v["hook"] == "lb_xdp")
            .cloned()
            .unwrap_or(Value::Null)
    };
    assert_eq!(xdp("eth0")["attached"], true, "{views:#?}");
    assert_eq!(xdp("ext0")["attached"], false, "{views:#?}");
    let why = xdp("ext0")["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(why.contains("best-effort"), "{why}");
    let (code, _) = c.agents[0].get("/readyz").expect("readyz");
    assert_eq!(code, 200);

    let agent = &mut c.agents[0];
    agent.kill().expect("kill");
    agent.remove_arg("--acceleration=best-effort");
    agent.add_args(&[NATIVE]);
    agent.respawn().expect("respawn");
    let named = Cluster::eventually(Duration::from_secs(20), || {
        c.agents[0].get("/readyz").is_ok_and(|(code, body)| {
            code == 503 && body.contains("ext0") && body.contains("lb_xdp")
        })
    });
    let readyz = c.agents[0].get("/readyz");
    assert!(named, "native: /readyz {readyz:?}");
    assert!(xdp_on_eth0(&c).is_some(), "native: no XDP on eth0");
}
