//! sessionAffinity ClientIP per Service port (issue 11, item 4): as
//! kube-proxy keeps one decision per Service port "without regard to which
//! service IP was used", a client alternating between the ClusterIP, an
//! externalIP, a LoadBalancer IP and the node's NodePort lands on one
//! backend: through the socket path (pods) and through the tc path
//! (external clients), on the multi-node topology of `integration_tests::nodes`.
//!
//! Pods: n1p0, n1p1 on n1; n2p0, n2p1 on n2.
use std::collections::{BTreeMap, BTreeSet};

use integration_tests::{
    nodes::{node_v4, Cluster},
    require_root, Attempt,
};
use serde_json::{json, Value};

const CLUSTER_IP: &str = "10.96.0.20";
const NODEPORT: u16 = 30090;
const EXTERNAL_IP: &str = "203.0.113.40";
const LB_IP: &str = "203.0.113.41";
const LOCAL_CLUSTER_IP: &str = "10.96.0.21";
const LOCAL_NODEPORT: u16 = 30091;
const LOCAL_LB_IP: &str = "203.0.113.42";

/// A LoadBalancer Service `name` with sessionAffinity ClientIP (300 s), an
/// externalIP (if any), an ingress IP and `policy` as externalTrafficPolicy.
fn sticky_service(
    name: &str,
    cluster_ip: &str,
    node_port: u16,
    external_ips: &[&str],
    lb_ip: &str,
    policy: &str,
) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": cluster_ip,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": node_port}],
            "externalIPs": external_ips,
            "externalTrafficPolicy": policy,
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 300}},
        },
        "status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}},
    })
}

fn setup(tag: &str) -> Cluster {
    let mut c = Cluster::new(tag, &[2, 2]).expect("topology");
    c.serve_all().expect("servers");
    let pods: Vec<_> = c.pods.clone();
    let all: Vec<_> = pods.iter().collect();
    let mut docs = c.node_objects();
    docs.extend([
        sticky_service(
            "sticky",
            CLUSTER_IP,
            NODEPORT,
            &[EXTERNAL_IP],
            LB_IP,
            "Cluster",
        ),
        c.slice("sticky", &all, false, "TCP"),
        sticky_service(
            "sticky-local",
            LOCAL_CLUSTER_IP,
            LOCAL_NODEPORT,
            &[],
            LOCAL_LB_IP,
            "Local",
        ),
        c.slice("sticky-local", &all, false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs).expect("manifests");
    c.start_agents(&["--allowed-external-ip-cidrs", "203.0.113.0/24"])
        .expect("agents");
    c
}

fn show(a: &[Attempt]) -> String {
    a.iter()
        .map(|a| serde_json::to_string(a).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The datapath's event counters of every agent that are not 0
/// (`lb_datapath_events_total`: translations, drops by reason), to say
/// where a failed attempt's packets went.
fn datapath_events(c: &Cluster) -> String {
    c.agents
        .iter()
        .enumerate()
        .map(|(i, a)| match a.metrics() {
            Ok((_, text)) => text
                .lines()
                .filter(|l| l.starts_with("lb_datapath_events_total") && !l.ends_with(" 0"))
                .map(|l| format!("agent {i}: {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
            Err(e) => format!("agent {i}: metrics not read: {e:#}"),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `attempt(target)` for every target, round after round, and
/// returns the backends reached through each target; every attempt must
/// succeed (a failure's message ends with the datapath's counters).
fn alternate(
    c: &Cluster,
    what: &str,
    targets: &[String],
    rounds: usize,
    mut attempt: impl FnMut(&str) -> Vec<Attempt>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut seen: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for _ in 0..rounds {
        for t in targets {
            let a = attempt(t);
            assert!(
                !a.is_empty() && a.iter().all(|a| a.ok && a.backend.is_some()),
                "{what} -> {t}: {}\n{}",
                show(&a),
                datapath_events(c)
            );
            seen.entry(t.clone())
                .or_default()
                .extend(a.iter().filter_map(|a| a.backend.clone()));
        }
    }
    seen
}

/// The one backend of all of `seen`; panics naming the frontends when a
/// client reached more than one.
fn one_backend(what: &str, seen: &BTreeMap<String, BTreeSet<String>>) -> String {
    let all: BTreeSet<&String> = seen.values().flatten().collect();
    assert_eq!(
        all.len(),
        1,
        "{what} reached several backends through the frontends of one Service port \
         (backends by frontend): {seen:#?}"
    );
    all.into_iter().next().unwrap().clone()
}

/// Pods alternating between the ClusterIP, the externalIP, the LB IP and
/// their node's NodePort (all translated at connect by the socket hooks)
/// stick to one backend.
#[test]
fn a_pod_keeps_its_backend_across_the_service_ips_of_one_port() {
    require_root!();
    let c = setup("afsock");
    let mut chosen = BTreeMap::new();
    for pod in c.pods.clone() {
        let targets = [
            format!("{CLUSTER_IP}:80"),
            format!("{EXTERNAL_IP}:80"),
            format!("{LB_IP}:80"),
            format!("{}:{NODEPORT}", node_v4(pod.node)),
        ];
        let seen = alternate(&c, &pod.name, &targets, 3, |t| {
            c.from_pod(pod.node, &pod.netns, "tcp", t, 2)
        });
        let b = one_backend(&pod.name, &seen);
        eprintln!("{} -> {b} through {targets:?}", pod.name);
        chosen.insert(pod.name.clone(), b);
    }
    eprintln!("chosen: {chosen:?}");
}

/// External clients alternating between n1's NodePort, the LB IP and the
/// externalIP (both routed to n1) stick to one backend (tc path); with
/// externalTrafficPolicy Local, NodePort and LB IP share one decision
/// among n1's endpoints.
#[test]
fn an_external_client_keeps_its_backend_across_nodeport_lb_ip_and_external_ip() {
    require_root!();
    let c = setup("aftc");
    let mut clients = vec![c.client_netns.clone(), c.client2_netns.clone()];
    clients.push(c.add_external("x3", 102).expect("client"));
    clients.push(c.add_external("x4", 103).expect("client"));
    for ns in &clients {
        c.route_via(ns, "203.0.113.0/24", 1).unwrap();
    }
    let targets = [
        format!("{}:{NODEPORT}", node_v4(1)),
        format!("{LB_IP}:80"),
        format!("{EXTERNAL_IP}:80"),
    ];
    let local_targets = [
        format!("{}:{LOCAL_NODEPORT}", node_v4(1)),
        format!("{LOCAL_LB_IP}:80"),
    ];
    let mut chosen = BTreeMap::new();
    for (i, ns) in clients.iter().enumerate() {
        let what = format!("external client {i}");
        let seen = alternate(&c, &what, &targets, 3, |t| c.from_netns(ns, "tcp", t, 2));
        let b = one_backend(&what, &seen);
        let seen = alternate(&c, &what, &local_targets, 3, |t| {
            c.from_netns(ns, "tcp", t, 2)
        });
        let local = one_backend(&format!("{what} (Local)"), &seen);
        assert!(
            ["n1p0", "n1p1"].contains(&local.as_str()),
            "Local policy through n1 reached {local}"
        );
        eprintln!("{what} -> {b}, Local -> {local}");
        chosen.insert(i, (b, local));
    }
    eprintln!("chosen: {chosen:?}");
}
