//! Outlier detection on the tc path: a NodePort reached from an external
//! client through node 3, which has no pods, so that every backend is on
//! another node. A backend that refuses (its server died: the backend's
//! RST to the SYN) or does not answer (its link is down: the client's SYN
//! sent again a second later) is quarantined after three failures and
//! new flows avoid it. Each backend answers with its name. One test goes
//! through node 1 to its own refusing pod (the RST leaves through
//! tc_egress).
use serde_json::Value;

use integration_tests::{
    nodes::{node_v4, Cluster},
    probe::{Attempt, Spread},
    require_root,
};

const NODEPORT: u16 = 30190;

/// Pods n1p0 and n1p1 on node 1, n2p0 on node 2, node 3 without any; a
/// NodePort over all three.
fn cluster(tag: &str) -> Cluster {
    cluster_with(tag, &[])
}

/// The same, the agents started with `args`.
fn cluster_with(tag: &str, args: &[&str]) -> Cluster {
    let mut c = Cluster::new(tag, &[2, 1, 0]).expect("topology");
    c.serve_all().expect("servers");
    let pods = [
        c.pod("n1p0").clone(),
        c.pod("n1p1").clone(),
        c.pod("n2p0").clone(),
    ];
    let all: Vec<_> = pods.iter().collect();
    let mut docs = c.node_objects();
    docs.extend([
        Cluster::node_port_service("web", "10.96.0.40", NODEPORT),
        c.slice("web", &all, false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    c.start_agents(args).expect("agents");
    c
}

fn failures(attempts: &[Attempt]) -> Vec<usize> {
    attempts
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.ok)
        .map(|(i, _)| i)
        .collect()
}

/// The quarantines node 3's agent shows on the NodePort's frontends, by
/// backend address.
fn quarantines(c: &Cluster) -> Vec<(String, Value)> {
    quarantines_on(c, 2)
}

/// The same, of the agent of node `agent + 1`.
fn quarantines_on(c: &Cluster, agent: usize) -> Vec<(String, Value)> {
    let all = c.agents[agent].inspect_services().unwrap();
    let mut out: Vec<(String, Value)> = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["port"] == NODEPORT && f["scope"] == "External")
        .flat_map(|f| f["backends"].as_array().unwrap().clone())
        .filter(|b| !b["quarantine"].is_null())
        .map(|b| {
            (
                b["addr"].as_str().unwrap().to_string(),
                b["quarantine"].clone(),
            )
        })
        .collect();
    out.dedup_by(|a, b| a.0 == b.0);
    out
}

#[test]
fn a_refusing_backend_behind_a_node_port_is_quarantined_and_avoided() {
    refusing_n1p1_is_quarantined_through("outl-np-rst", 3);
}

/// A local backend's RST leaves the node through tc_egress, not
/// tc_ingress: it is counted there. Node 1's NodePort, whose refusing
/// backend n1p1 is its own pod.
#[test]
fn a_refusing_local_backend_behind_a_node_port_is_quarantined_and_avoided() {
    refusing_n1p1_is_quarantined_through("outl-np-local", 1);
}

/// 120 connects through node `node`'s NodePort while n1p1 refuses: three
/// fail (refused at once), then n1p1 is quarantined on that node and the
/// others answer.
fn refusing_n1p1_is_quarantined_through(tag: &str, node: u8) {
    require_root!();
    let c = cluster(tag);
    c.stop_server("n1p1").unwrap();
    let target = format!("{}:{NODEPORT}", node_v4(node));
    let attempts = c.from_client("tcp", &target, 120);
    let failed = failures(&attempts);
    eprintln!("120 connects through node {node}, n1p1 refusing: failed at {failed:?}");
    assert_eq!(failed.len(), 3, "{failed:?}");
    for i in failed {
        assert_eq!(
            attempts[i].error.as_deref(),
            Some("ECONNREFUSED"),
            "{:?}",
            attempts[i]
        );
    }
    let answered = Spread::of(&attempts);
    assert!(
        answered.count("n1p0") > 20 && answered.count("n2p0") > 20,
        "{answered:?}"
    );
    let q = quarantines_on(&c, usize::from(node) - 1);
    let n1p1 = c.pod("n1p1").ipv4.to_string();
    assert_eq!(q.len(), 1, "{q:?}");
    assert_eq!(q[0].0, n1p1, "{q:?}");
    assert_eq!(q[0].1["reason"], "refused", "{q:?}");
}

/// The frontend's cap holds on the tc path too: with two of three
/// backends refusing, at most 50% of three (one) is quarantined, and the
/// other refusing backend keeps taking its share of connects, each
/// refused at once.
#[test]
fn two_refusing_backends_behind_a_node_port_are_never_both_quarantined() {
    require_root!();
    let c = cluster("outl-np-two");
    c.stop_server("n1p0").unwrap();
    c.stop_server("n1p1").unwrap();
    let target = format!("{}:{NODEPORT}", node_v4(3));
    let attempts = c.from_client("tcp", &target, 60);
    let failed = failures(&attempts);
    eprintln!("60 connects through node 3, n1p0 and n1p1 refusing: failed at {failed:?}");
    for i in &failed {
        let a = &attempts[*i];
        assert_eq!(a.error.as_deref(), Some("ECONNREFUSED"), "{a:?}");
        assert!(a.elapsed_ms < 500.0, "refused at once: {a:?}");
    }
    let q = quarantines(&c);
    assert_eq!(q.len(), 1, "at most 50% of three backends: {q:?}");
    // The one left selectable still refuses: failures go on to the end.
    assert!(
        failed.iter().filter(|&&i| i >= 30).count() >= 5,
        "the second refusing backend was avoided too: {failed:?}"
    );
    // The refused quarantine the cap kept from the second (the counters
    // reach /metrics within the quarantine watch's 250 ms).
    let mut capped = None;
    integration_tests::wait_until(
        std::time::Duration::from_secs(5),
        std::time::Duration::from_millis(100),
        || {
            capped = c.agents[2].metrics().ok().and_then(|(_, text)| {
                integration_tests::cluster::metric(
                    &text,
                    "lb_datapath_events_total{event=\"ejection_capped\"}",
                )
            });
            capped.unwrap_or(0.0) > 0.0
        },
    );
    assert!(capped.unwrap_or(0.0) > 0.0, "{capped:?}");
}

#[test]
fn a_backend_behind_a_node_port_whose_link_is_down_is_avoided_after_its_timeouts() {
    require_root!();
    let c = cluster("outl-np-link");
    let pod = c.pod("n2p0").clone();
    integration_tests::cmd::ip(&["-n", &pod.netns, "link", "set", "dev", "eth0", "down"]).unwrap();
    let target = format!("{}:{NODEPORT}", node_v4(3));
    // The SYN sent again after 1 s is the failure; the client gives up at
    // 1.5 s. ICMP errors from the backend side reach no client (see
    // `tc.rs`), so every failure is a timeout.
    let attempts = c.from_netns_with(
        &c.client_netns.clone(),
        "tcp",
        &target,
        40,
        &["--timeout-ms", "1500"],
    );
    let failed = failures(&attempts);
    eprintln!("40 connects through node 3, n2p0's link down: failed at {failed:?}");
    assert_eq!(failed.len(), 3, "{failed:?}");
    for i in &failed {
        assert_eq!(
            attempts[*i].error.as_deref(),
            Some("ETIMEDOUT"),
            "{:?}",
            attempts[*i]
        );
    }
    let q = quarantines(&c);
    assert_eq!(q.len(), 1, "{q:?}");
    assert_eq!(q[0].0, pod.ipv4.to_string(), "{q:?}");
    assert_eq!(q[0].1["reason"], "timeout", "{q:?}");
}

/// A client that gives up on an unanswered connect and connects again from
/// the same port sends a new SYN (another sequence number) on the first
/// one's tuple, whose flow still waits in `LB_CT_SYN`: it gets a fresh
/// choice instead of following the flow to the dead backend for as long as
/// the SYN timeout (with detection off, so that no quarantine hides it).
#[test]
fn a_client_port_taken_again_after_an_unanswered_connect_gets_a_fresh_choice() {
    require_root!();
    let c = cluster_with("outl-np-port", &["--outlier-detection", "off"]);
    let pod = c.pod("n2p0").clone();
    integration_tests::cmd::ip(&["-n", &pod.netns, "link", "set", "dev", "eth0", "down"]).unwrap();
    let target = format!("{}:{NODEPORT}", node_v4(3));
    let client = c.client_netns.clone();
    let one = || {
        c.from_netns_with(
            &client,
            "tcp",
            &target,
            1,
            &["--source-port", "31500", "--timeout-ms", "1500"],
        )
        .remove(0)
    };
    // From one port until a connect meets the dead backend (one in three).
    let first = (0..40).find(|_| !one().ok);
    assert!(first.is_some(), "none of 40 connects chose n2p0");
    let next: Vec<Attempt> = (0..10).map(|_| one()).collect();
    let answered: Vec<&str> = next
        .iter()
        .filter(|a| a.ok)
        .filter_map(|a| a.backend.as_deref())
        .collect();
    eprintln!("the port's 10 connects after its unanswered one: answered by {answered:?}");
    assert!(
        !answered.is_empty(),
        "every connect from the port followed its unanswered flow to n2p0: {next:?}"
    );
    assert!(!answered.contains(&"n2p0"), "{answered:?}");
}
