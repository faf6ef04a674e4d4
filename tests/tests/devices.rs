//! Devices come and go (issue 42): a device the tc programs are asked for
//! that is deleted and created again (a NIC reset, a bond or VLAN
//! re-created, a veth renamed) gets its programs back within a sweep, and
//! a device that lacks them is named, with what it lacks, in `/readyz`,
//! `/metrics` and `lb-agent inspect tc`.
//!
//! One node (`n1`, pod `n1p0`) of the `integration_tests::nodes` topology
//! serves a NodePort to the external client; its `eth0` (a veth to the
//! switch namespace) is deleted and created again with the same name, MAC
//! address and addresses, inside the test's namespaces.
use std::{process::Command, time::Duration};

use serde_json::Value;

use integration_tests::{
    nodes::{acceleration_from_env, node_v4, Cluster},
    probe::Attempt,
    require_root, wait_until,
};

const NODEPORT: u16 = 30280;
/// The agents' `--sweep-interval`.
const SWEEP: &str = "500ms";
/// "Within a few sweeps": 500 ms each, and the client's own attempts.
const WITHIN: Duration = Duration::from_secs(8);

/// Node 1 with pod n1p0 behind NodePort `web`; the agent started with
/// `--devices eth0 --tc-attach MODE` and a short sweep.
fn node_port(tag: &str, mode: &str) -> Cluster {
    let mut c = Cluster::new(tag, &[1]).expect("topology");
    c.serve_all().expect("servers");
    let pod = c.pod("n1p0").clone();
    let mut docs = c.node_objects();
    docs.extend([
        Cluster::node_port_service("web", "10.96.0.50", NODEPORT),
        c.slice("web", &[&pod], false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    c.start_agents(&[
        "--devices",
        "eth0",
        "--tc-attach",
        mode,
        "--sweep-interval",
        SWEEP,
    ])
    .expect("agents");
    c
}

fn target() -> String {
    format!("{}:{NODEPORT}", node_v4(1))
}

fn all_ok(a: &[Attempt]) -> bool {
    !a.is_empty() && a.iter().all(|a| a.ok)
}

/// Connects through the NodePort succeed again within [`WITHIN`].
fn served_again(c: &Cluster) -> bool {
    wait_until(WITHIN, Duration::from_millis(200), || {
        all_ok(&c.from_client("tcp", &target(), 3))
    })
}

fn metrics(c: &Cluster) -> String {
    c.agents[0].metrics().expect("metrics").1
}

/// `lb_device_attach_failing` is `v` for both of `eth0`'s hooks.
fn eth0_failing(metrics: &str, v: u8) -> bool {
    ["tc_ingress", "tc_egress"].iter().all(|hook| {
        metrics.contains(&format!(
            "lb_device_attach_failing{{device=\"eth0\",hook=\"{hook}\"}} {v}"
        ))
    })
}

/// `lb-agent inspect tc`'s rows for `eth0`: (hook, attached, mode).
fn eth0_rows(c: &Cluster) -> Vec<(String, bool, String)> {
    let mut out: Vec<_> = c.agents[0]
        .inspect_tc()
        .expect("inspect tc")
        .iter()
        .filter(|v| v["device"] == "eth0")
        .map(|v| {
            (
                v["hook"].as_str().unwrap_or_default().to_owned(),
                v["attached"] == Value::Bool(true),
                v["mode"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Every hook of `eth0` attached: both tc programs, in `mode`, and with
/// `LB_TEST_ACCELERATION` the XDP stage too (sorted as `eth0_rows`).
fn both_attached(mode: &str) -> Vec<(String, bool, String)> {
    let xdp = acceleration_from_env().map(|_| ("lb_xdp".to_owned(), true, "native".to_owned()));
    xdp.into_iter()
        .chain([
            ("tc_egress".to_owned(), true, mode.to_owned()),
            ("tc_ingress".to_owned(), true, mode.to_owned()),
        ])
        .collect()
}

/// The ifindex `lb-agent inspect tc` shows for `eth0`.
fn shown_ifindex(c: &Cluster) -> Option<u64> {
    c.agents[0]
        .inspect_tc()
        .expect("inspect tc")
        .iter()
        .find(|v| v["device"] == "eth0")
        .and_then(|v| v["ifindex"].as_u64())
}

fn ifindex(c: &Cluster) -> u64 {
    let out = integration_tests::cmd::ip(&["-n", &c.nodes[0].netns, "-o", "link", "show", "eth0"])
        .expect("ip link show");
    out.split(':').next().unwrap().trim().parse().unwrap()
}

fn reattached_line(log: &str) -> Option<&str> {
    log.lines()
        .find(|l| l.contains("re-attached") && l.contains("eth0"))
}

/// The required case: with the agent serving a NodePort over `eth0`, the
/// device is deleted and created again; within a few sweeps connects
/// through the NodePort work again, the re-attach is logged once naming
/// the device and why (its new ifindex), counted per device, and
/// `/readyz`, `/metrics` and `lb-agent inspect tc` show it whole again.
fn re_created_device_gets_its_programs_back(tag: &str, mode: &str) -> Cluster {
    let c = node_port(tag, mode);
    assert!(
        all_ok(&c.from_client("tcp", &target(), 10)),
        "{}",
        c.agent_logs()
    );
    let before = ifindex(&c);
    let log_before = c.agents[0].log().len();
    let mac = c.unplug_node(1).expect("unplug");
    c.replug_node(1, &mac).expect("replug");
    let now = ifindex(&c);
    assert_ne!(before, now, "eth0 was not re-created");
    assert!(
        served_again(&c),
        "NodePort not served again within {WITHIN:?} of re-creating eth0\n{}",
        c.agent_logs()
    );
    // The NodePort may answer as soon as the programs are attached, a
    // moment before the agent writes the line that says so.
    wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        reattached_line(&c.agents[0].log_since(log_before)).is_some()
    });
    let log = c.agents[0].log_since(log_before);
    let line = reattached_line(&log).unwrap_or_else(|| panic!("no re-attach logged:\n{log}"));
    assert!(line.contains(&format!("{now}")), "{line}");
    assert_eq!(
        log.lines().filter(|l| l.contains("re-attached")).count(),
        1,
        "{log}"
    );
    let m = metrics(&c);
    assert!(eth0_failing(&m, 0), "{m}");
    assert!(
        m.contains("lb_device_reattachments_total{device=\"eth0\"} 1"),
        "{m}"
    );
    assert!(m.contains("lb_tc_attach_failing 0"), "{m}");
    let ready = c.agents[0].get("/readyz").expect("readyz");
    assert_eq!(ready.0, 200, "{ready:?}");
    assert_eq!(eth0_rows(&c), both_attached(mode));
    assert_eq!(shown_ifindex(&c), Some(now));
    c
}

#[test]
fn a_re_created_device_gets_its_tcx_links_back() {
    require_root!();
    re_created_device_gets_its_programs_back("recrtcx", "tcx");
}

/// The same through clsact filters; and a filter removed from a device
/// that stays (its clsact qdisc deleted by hand) comes back too.
#[test]
fn a_re_created_device_gets_its_clsact_filters_back() {
    require_root!();
    let c = re_created_device_gets_its_programs_back("recrnl", "netlink");
    let log_before = c.agents[0].log().len();
    integration_tests::cmd::run(Command::new("tc").args([
        "-n",
        &c.nodes[0].netns,
        "qdisc",
        "del",
        "dev",
        "eth0",
        "clsact",
    ]))
    .expect("tc qdisc del");
    assert!(
        served_again(&c),
        "NodePort not served again within {WITHIN:?} of deleting the clsact qdisc\n{}",
        c.agent_logs()
    );
    // The NodePort may answer as soon as the programs are attached, a
    // moment before the agent writes the line that says so.
    wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        reattached_line(&c.agents[0].log_since(log_before)).is_some()
    });
    let log = c.agents[0].log_since(log_before);
    let line = reattached_line(&log).unwrap_or_else(|| panic!("no re-attach logged:\n{log}"));
    assert!(line.contains("missing"), "{line}");
    let m = metrics(&c);
    assert!(
        m.contains("lb_device_reattachments_total{device=\"eth0\"} 2"),
        "{m}"
    );
    assert_eq!(eth0_rows(&c), both_attached("netlink"));
}

/// While the device is gone the agent keeps running and names it: `/readyz`
/// 503 saying `eth0` is absent and what it lacks, the per-hook gauges 1,
/// `lb-agent inspect tc` the reason; once it is back, everything is served
/// and ready again.
#[test]
fn an_absent_device_is_reported_per_device_until_it_is_back() {
    require_root!();
    let c = node_port("absent", "tcx");
    assert!(all_ok(&c.from_client("tcp", &target(), 5)));
    let mac = c.unplug_node(1).expect("unplug");
    let mut last = (0, String::new());
    let reported = wait_until(WITHIN, Duration::from_millis(100), || {
        last = c.agents[0].get("/readyz").unwrap_or_default();
        last.0 == 503 && last.1.contains("eth0") && last.1.contains("absent")
    });
    assert!(reported, "/readyz: {last:?}\n{}", c.agent_logs());
    assert!(
        last.1.contains("tc_ingress") && last.1.contains("tc_egress"),
        "{last:?}"
    );
    let m = metrics(&c);
    assert!(eth0_failing(&m, 1), "{m}");
    assert!(m.contains("lb_tc_attach_failing 1"), "{m}");
    let rows = c.agents[0].inspect_tc().expect("inspect tc");
    let eth0: Vec<&Value> = rows.iter().filter(|v| v["device"] == "eth0").collect();
    assert_eq!(eth0.len(), both_attached("tcx").len(), "{rows:?}");
    assert!(
        eth0.iter().all(|v| v["attached"] == Value::Bool(false)
            && v["ifindex"].is_null()
            && v["reason"].as_str().is_some_and(|r| r.contains("absent"))),
        "{rows:?}"
    );
    assert!(c.agents[0].is_running(), "{}", c.agent_logs());

    c.replug_node(1, &mac).expect("replug");
    assert!(served_again(&c), "{}", c.agent_logs());
    let ready = wait_until(WITHIN, Duration::from_millis(100), || {
        last = c.agents[0].get("/readyz").unwrap_or_default();
        last.0 == 200
    });
    assert!(ready, "/readyz: {last:?}");
    assert!(eth0_failing(&metrics(&c), 0));
    assert_eq!(eth0_rows(&c), both_attached("tcx"));
}
