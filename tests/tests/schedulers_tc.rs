//! The ipvs mode's schedulers on the tc path: NodePorts reached from an
//! external client, through a node without endpoints and through one
//! with, to endpoints on both nodes. Each backend answers with its name.
use std::{collections::BTreeMap, time::Duration};

use integration_tests::{
    cluster::{with_annotation, HeldTcp},
    nodes::{node_v4, Cluster},
    require_root, wait_until,
};
use serde_json::{json, Value};

const RR_NODEPORT: u16 = 30180;
const LC_NODEPORT: u16 = 30181;
const SH_NODEPORT: u16 = 30182;

/// Service `demo/{name}`, NodePort `node_port` (80/TCP to 8080), with the
/// scheduler `algorithm`.
fn service(name: &str, cluster_ip: &str, node_port: u16, algorithm: &str) -> Value {
    with_annotation(
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "demo"},
            "spec": {"type": "NodePort", "clusterIP": cluster_ip,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                    "nodePort": node_port}]},
        }),
        "lb-agent.dev/lb-algorithm",
        algorithm,
    )
}

/// Pods n1p0 and n1p1 on node 1, n2p0 on node 2, node 3 without any;
/// an rr, an lc and an sh NodePort over all three.
fn cluster(tag: &str) -> Cluster {
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
        service("rr", "10.96.0.30", RR_NODEPORT, "rr"),
        c.slice("rr", &all, false, "TCP"),
        service("lc", "10.96.0.31", LC_NODEPORT, "lc"),
        c.slice("lc", &all, false, "TCP"),
        service("sh", "10.96.0.32", SH_NODEPORT, "sh"),
        c.slice("sh", &all, false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    // Closed flows leave the conntrack (and the counts) within a second
    // or two: the backends close first (`serve` writes its name and
    // closes), so their flows wait out the TIME_WAIT timeout.
    c.start_agents(&[
        "--conntrack-tcp-close-timeout",
        "1s",
        "--conntrack-tcp-time-wait-timeout",
        "1s",
        "--sweep-interval",
        "500ms",
    ])
    .expect("agents");
    c
}

#[test]
fn rr_through_a_node_port_takes_the_backends_in_turn() {
    require_root!();
    let c = cluster("rr-np");
    for node in [3u8, 1] {
        let target = format!("{}:{RR_NODEPORT}", node_v4(node));
        let a = c.from_client("tcp", &target, 30);
        let seq: Vec<String> = a
            .iter()
            .map(|x| {
                x.backend
                    .clone()
                    .unwrap_or_else(|| panic!("{target}: {x:?}"))
            })
            .collect();
        eprintln!("rr through node {node}: {seq:?}");
        let mut first = seq[..3].to_vec();
        first.sort();
        assert_eq!(
            first,
            ["n1p0", "n1p1", "n2p0"],
            "through node {node}: {seq:?}"
        );
        for (i, b) in seq.iter().enumerate().skip(3) {
            assert_eq!(b, &seq[i - 3], "through node {node}, turn {i}: {seq:?}");
        }
    }
}

/// Open connections per backend address, as `inspect services` of
/// `agent` shows them for the lc NodePort.
fn open_per_backend(c: &Cluster, agent: usize) -> BTreeMap<String, u64> {
    let all = c.agents[agent].inspect_services().unwrap();
    let f = all
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["port"] == LC_NODEPORT && f["scope"] == "External")
        .unwrap_or_else(|| panic!("no external frontend on {LC_NODEPORT}: {all}"));
    assert_eq!(f["algorithm"], "lc", "{f}");
    f["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["addr"].as_str().unwrap().to_string(),
                b["open"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn lc_through_a_node_port_balances_held_flows_and_refills_an_emptied_backend() {
    require_root!();
    let c = cluster("lc-np");
    let target = format!("{}:{LC_NODEPORT}", node_v4(3));
    let mut held = HeldTcp::open_from(None, &c.client_netns, &target, 30).unwrap();
    let per = held.per_backend();
    eprintln!("lc through node 3, 30 held: {per:?}");
    // Each forward entry says it counts.
    let counted = c.agents[2]
        .inspect_conntrack()
        .unwrap()
        .iter()
        .filter(|e| e["direction"] == "forward")
        .filter(|e| {
            e["flags"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f == "counted")
        })
        .count();
    assert_eq!(counted, 30);
    assert_eq!(
        per.values().copied().collect::<Vec<_>>(),
        [10, 10, 10],
        "{per:?}"
    );

    assert_eq!(held.close_to("n1p0").unwrap(), 10);
    let n1p0 = c.pod("n1p0").ipv4.to_string();
    let mut open = BTreeMap::new();
    assert!(
        wait_until(Duration::from_secs(15), Duration::from_millis(200), || {
            open = open_per_backend(&c, 2);
            open.get(&n1p0) == Some(&0)
        }),
        "n1p0's closed flows still count: {open:?}; node 3's flows: {:#?}\n{}",
        c.agents[2].inspect_conntrack().unwrap(),
        c.agents[2].metrics().map(|m| m.1).unwrap_or_default()
    );
    assert_eq!(open.values().filter(|n| **n == 10).count(), 2, "{open:?}");

    let next = HeldTcp::open_from(None, &c.client_netns, &target, 6).unwrap();
    assert_eq!(
        next.per_backend(),
        BTreeMap::from([("n1p0".to_string(), 6)]),
        "after n1p0's flows closed"
    );
    held.close().unwrap();
    next.close().unwrap();
}

#[test]
fn sh_through_node_ports_keeps_a_client_on_one_backend_whichever_node() {
    require_root!();
    let c = cluster("sh-np");
    let mut chosen = Vec::new();
    for (netns, node) in [
        (&c.client_netns, 1u8),
        (&c.client_netns, 2),
        (&c.client_netns, 3),
    ]
    .into_iter()
    .chain([(&c.client2_netns, 1), (&c.client2_netns, 3)])
    {
        let target = format!("{}:{SH_NODEPORT}", node_v4(node));
        let a = c.from_netns(netns, "tcp", &target, 12);
        let backends: std::collections::BTreeSet<String> = a
            .iter()
            .map(|x| {
                x.backend
                    .clone()
                    .unwrap_or_else(|| panic!("{target}: {x:?}"))
            })
            .collect();
        assert_eq!(
            backends.len(),
            1,
            "{netns} through node {node}: {backends:?}"
        );
        chosen.push((netns.clone(), node, backends.into_iter().next().unwrap()));
    }
    eprintln!("sh: {chosen:?}");
    for client in [&c.client_netns, &c.client2_netns] {
        let of: std::collections::BTreeSet<&String> = chosen
            .iter()
            .filter(|(n, _, _)| n == client)
            .map(|(_, _, b)| b)
            .collect();
        assert_eq!(
            of.len(),
            1,
            "{client} reaches another backend through another node: {chosen:?}"
        );
    }
}
