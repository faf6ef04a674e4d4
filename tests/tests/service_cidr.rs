//! The guarded Service CIDRs (issue 41, part 3): an address of them that
//! no Service holds is refused at once on the socket path (no packet
//! leaves the client) and dropped on the tc path, as kube-proxy's nftables
//! mode does (`cluster-ips-check`); the CIDRs come from
//! `--service-cluster-ip-range` and, in cluster mode, the `ServiceCIDR`
//! objects.
//!
//! Every client runs in a namespace without a default route. Where a test
//! needs the Service CIDR routed (so that an unrefused connect does send
//! its packet, which the capture must then see), the route points at a
//! test namespace (a backend, or a node of the test topology), never out
//! of the machine.
mod common;

use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use common::*;
use integration_tests::{
    apiserver::{ApiServer, Kind},
    cmd,
    netns::{in_netns, pod_v4},
    nodes::Cluster,
    require_root, wait_until, AgentOpts, Attempt, Env, Proto,
};
use serde_json::json;

/// An address of 10.96.0.0/16 that no Service holds.
const UNALLOCATED: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);

/// A raw capture of the packets on `eth0` of a namespace: opened there,
/// read from anywhere.
struct Capture(OwnedFd);

impl Capture {
    fn open(netns: &str) -> Capture {
        let fd = in_netns(netns, || {
            // SAFETY: plain socket calls; the descriptor is owned at once.
            unsafe {
                let fd = libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    (libc::ETH_P_ALL as u16).to_be() as i32,
                );
                assert!(
                    fd >= 0,
                    "AF_PACKET socket: {}",
                    std::io::Error::last_os_error()
                );
                let fd = OwnedFd::from_raw_fd(fd);
                let ifindex = libc::if_nametoindex(c"eth0".as_ptr());
                assert!(ifindex > 0, "no eth0 in {}", "the namespace");
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
                sll.sll_ifindex = ifindex as i32;
                let r = libc::bind(
                    fd.as_raw_fd(),
                    &sll as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                );
                assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
                fd
            }
        })
        .unwrap();
        Capture(fd)
    }

    /// The IPv4 packets captured so far that are addressed to `dst`
    /// (read until the socket has nothing more: bounded).
    fn packets_to(&self, dst: Ipv4Addr) -> usize {
        let mut n = 0;
        let mut buf = [0u8; 2048];
        loop {
            // SAFETY: a read into our own buffer, non-blocking.
            let len = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if len <= 0 {
                return n;
            }
            let f = &buf[..len as usize];
            if f.len() >= 34 && f[12..14] == [0x08, 0x00] && f[30..34] == dst.octets() {
                n += 1;
            }
        }
    }
}

/// Routes the Service CIDR from the client's namespace via backend `b1`
/// (a test namespace, which drops what is not its own): a connect the
/// agent does not refuse then sends its packet out of `eth0`, where the
/// capture sees it.
fn route_service_cidr_via_b1(env: &Env) {
    cmd::netns_exec(
        env.topo.client_netns(),
        &[
            "ip",
            "route",
            "replace",
            "10.96.0.0/16",
            "via",
            &pod_v4(1).to_string(),
        ],
    )
    .unwrap();
}

/// `count` attempts with `proto` at `target`, `timeout_ms` each.
fn attempts(env: &Env, proto: Proto, target: &str, count: usize, timeout_ms: u64) -> Vec<Attempt> {
    env.client()
        .proto(proto)
        .timeout_ms(timeout_ms)
        .run(target, count)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Every way to address `UNALLOCATED` is refused at once
/// (`ECONNREFUSED`, or `EPERM` on kernels before 6.1), with no packet to
/// it on the client's `eth0`.
fn assert_unallocated_refused(env: &Env, what: &str) {
    let capture = Capture::open(env.topo.client_netns());
    for (proto, port) in [
        (Proto::Tcp, 80),
        (Proto::Udp, 53),
        (Proto::UdpConnected, 53),
    ] {
        let target = format!("{UNALLOCATED}:{port}");
        let a = attempts(env, proto, &target, 3, 1000);
        for x in &a {
            assert!(
                !x.ok && matches!(x.error.as_deref(), Some("ECONNREFUSED" | "EPERM")),
                "{what}: {proto:?} {target}: refused at once expected, got {x:?}\n{}",
                env.agent().log()
            );
            assert!(
                x.elapsed_ms < 500.0,
                "{what}: {proto:?} {target}: slow: {x:?}"
            );
        }
    }
    // Anything sent would be on eth0 by now (the route is on-link to b1).
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        capture.packets_to(UNALLOCATED),
        0,
        "{what}: packets to {UNALLOCATED} left the client"
    );
}

/// The agent's `lb_datapath_events_total{event}` once it reaches `at_least`
/// (the counters reach /metrics at the agent's sweep), or its last value
/// after 12 s.
fn datapath_event(agent: &integration_tests::agent::Agent, event: &str, at_least: f64) -> f64 {
    let prefix = format!("lb_datapath_events_total{{event=\"{event}\"}} ");
    let read = || {
        agent
            .metrics()
            .ok()
            .and_then(|(_, t)| {
                t.lines()
                    .find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
            })
            .unwrap_or(0.0)
    };
    wait_until(Duration::from_secs(12), Duration::from_millis(200), || {
        read() >= at_least
    });
    read()
}

/// What `inspect service-cidrs` shows.
fn guarded(agent: &integration_tests::agent::Agent) -> Vec<String> {
    agent
        .inspect_service_cidrs()
        .unwrap()
        .iter()
        .map(|v| v["cidr"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn flag_guards_unallocated_cluster_ips_of_pods() {
    require_root!();
    let mut env = Env::new("cidrflag", 1).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: vec![
            "--service-cluster-ip-range".into(),
            "10.96.0.0/16,fd00:10:96::/112".into(),
        ],
        ..Default::default()
    })
    .unwrap();
    route_service_cidr_via_b1(&env);
    assert_eq!(guarded(env.agent()), ["10.96.0.0/16", "fd00:10:96::/112"]);
    assert_unallocated_refused(&env, "with --service-cluster-ip-range");
    // 3 TCP, 3 unconnected and 3 connected UDP.
    assert!(
        datapath_event(env.agent(), "sock_refused_unallocated", 9.0) >= 9.0,
        "sock_refused_unallocated not counted"
    );

    // A Service's address still works, and an address outside the range
    // (a pod's, straight) is untouched.
    assert_all_ok("TCP to the Service", &env.tcp(&format!("{VIP}:80"), 20));
    assert_all_ok(
        "UDP to the Service",
        &env.attempts(Proto::Udp, &format!("{VIP}:53"), 20),
    );
    assert_all_ok(
        "TCP to a pod outside the range",
        &env.tcp(&format!("{}:8080", pod_v4(1)), 5),
    );
    // A live ClusterIP's other port: refused as before (not counted as
    // unallocated).
    let a = attempts(&env, Proto::Tcp, &format!("{VIP}:81"), 2, 1000);
    assert_all_fail("TCP to the Service's other port", &a, "ECONNREFUSED");
}

/// Without a range nothing changes: the connect to the same address goes
/// out (the capture sees it, so that the test above speaks of the guard),
/// and times out at b1.
#[test]
fn without_a_range_an_unallocated_address_is_left_alone() {
    require_root!();
    let env = web_env("cidrnone", 1);
    route_service_cidr_via_b1(&env);
    assert_eq!(guarded(env.agent()), Vec::<String>::new());
    let capture = Capture::open(env.topo.client_netns());
    let a = attempts(&env, Proto::Tcp, &format!("{UNALLOCATED}:80"), 1, 300);
    assert!(
        !a[0].ok && a[0].error.as_deref() != Some("ECONNREFUSED"),
        "{a:?}"
    );
    assert!(
        capture.packets_to(UNALLOCATED) >= 1,
        "the SYN to {UNALLOCATED} was not seen on the client's eth0"
    );
    assert_all_ok("TCP to the Service", &env.tcp(&format!("{VIP}:80"), 5));
}

fn service_cidr(name: &str, cidrs: &[&str]) -> serde_json::Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": cidrs},
    })
}

/// The Service `web` (10.96.0.10) and its slice on the API server.
fn apply_web(api: &ApiServer, env: &Env) {
    for doc in web(env) {
        api.apply(&doc).unwrap();
    }
}

/// Whether a TCP connect to `UNALLOCATED` is refused at once now.
fn refused_now(env: &Env) -> bool {
    let a = attempts(env, Proto::Tcp, &format!("{UNALLOCATED}:80"), 1, 300);
    matches!(a[0].error.as_deref(), Some("ECONNREFUSED" | "EPERM"))
}

#[test]
fn cluster_mode_follows_service_cidr_objects() {
    require_root!();
    let (api, mut env) = api_and_env("cidrapi", 1);
    api.serve_service_cidrs(true);
    apply_web(&api, &env);
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    route_service_cidr_via_b1(&env);
    assert_eq!(guarded(env.agent()), Vec::<String>::new());
    assert!(!refused_now(&env), "refused before any ServiceCIDR");

    api.apply(&service_cidr(
        "kubernetes",
        &["10.96.0.0/16", "fd00:10:96::/112"],
    ))
    .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            guarded(env.agent()) == ["10.96.0.0/16", "fd00:10:96::/112"]
        }),
        "guarded: {:?}\n{}",
        guarded(env.agent()),
        env.agent().log()
    );
    assert_unallocated_refused(&env, "ServiceCIDR kubernetes");
    assert_all_ok("TCP to the Service", &env.tcp(&format!("{VIP}:80"), 10));

    // A second object is joined with the first; removing the first leaves
    // the second's range alone guarded.
    api.apply(&service_cidr("extra", &["10.97.0.0/16"]))
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            guarded(env.agent()) == ["10.96.0.0/15", "fd00:10:96::/112"]
        }),
        "sibling ranges joined: {:?}",
        guarded(env.agent())
    );
    api.delete(Kind::ServiceCIDR, "", "kubernetes").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            guarded(env.agent()) == ["10.97.0.0/16"]
        }),
        "after the delete: {:?}",
        guarded(env.agent())
    );
    assert!(
        !refused_now(&env),
        "still refused after its ServiceCIDR went"
    );
    api.delete(Kind::ServiceCIDR, "", "extra").unwrap();
    assert!(wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || guarded(env.agent()).is_empty()
    ));
    let log = env.agent().log();
    assert_eq!(service_cidr_troubles(&log), Vec::<&str>::new(), "{log}");
}

/// The log lines that warn of or fail on ServiceCIDRs.
fn service_cidr_troubles(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("ServiceCIDR") && (l.contains("WARN") || l.contains("ERROR")))
        .collect()
}

/// The default fixture serves no ServiceCIDR (an API server before 1.33):
/// no error, one list and one info line (not a loop), and the flag's
/// range is guarded.
#[test]
fn an_api_without_service_cidrs_is_no_error() {
    require_root!();
    let (api, mut env) = api_and_env("cidr404", 1);
    apply_web(&api, &env);
    env.start_cluster_agent(
        &api.url(),
        AgentOpts {
            extra_args: vec!["--service-cluster-ip-range".into(), "10.96.0.0/16".into()],
            ..Default::default()
        },
    )
    .unwrap();
    route_service_cidr_via_b1(&env);
    assert_unallocated_refused(&env, "the flag, API without ServiceCIDRs");
    assert_all_ok("TCP to the Service", &env.tcp(&format!("{VIP}:80"), 10));
    std::thread::sleep(Duration::from_secs(3));
    let asked = api
        .requests()
        .iter()
        .filter(|r| r.contains("/servicecidrs"))
        .count();
    assert_eq!(
        asked, 1,
        "the ServiceCIDR list was asked {asked} times in a few seconds"
    );
    let log = env.agent().log();
    assert_eq!(
        log.matches("serves no networking.k8s.io/v1 ServiceCIDR")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(service_cidr_troubles(&log), Vec::<&str>::new(), "{log}");
    let (_, metrics) = env.agent().metrics().unwrap();
    assert!(
        metrics.contains("lb_watch_errors_total{kind=\"ServiceCIDR\"} 0"),
        "{metrics}"
    );
}

/// The tc path: a SYN from outside to an unallocated address of the range,
/// routed to n1 (as a router with a routed Service CIDR would), is dropped
/// and counted; before, n1 answered it with its own "no route".
#[test]
fn tc_drops_syns_from_outside_to_unallocated_cluster_ips() {
    require_root!();
    let mut c = Cluster::new("cidrtc", &[1]).expect("topology");
    c.serve_all().unwrap();
    let n1p0 = c.pod("n1p0").clone();
    let mut docs = c.node_objects();
    docs.extend([
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                    "nodePort": 30080}]}}),
        c.slice("web", &[&n1p0], false, "TCP"),
    ]);
    c.manifests.write("web.yaml", &docs).unwrap();
    c.route_via(&c.client_netns.clone(), "10.96.0.0/16", 1)
        .unwrap();
    c.start_agents(&[
        "--service-cluster-ip-range",
        "10.96.0.0/16",
        "--sweep-interval",
        "1s",
    ])
    .unwrap();
    let target = format!("{UNALLOCATED}:80");
    let a = c.from_netns_with(
        &c.client_netns.clone(),
        "tcp",
        &target,
        3,
        &["--timeout-ms", "500"],
    );
    for x in &a {
        assert_eq!(
            x.error.as_deref(),
            Some("ETIMEDOUT"),
            "dropped without an answer: {x:?}\n{}",
            c.agent_logs()
        );
    }
    let dropped = datapath_event(&c.agents[0], "tc_drop_unallocated", 3.0);
    assert!(dropped >= 3.0, "tc_drop_unallocated {dropped}");
    // The NodePort is served as before.
    let np = format!("{}:30080", integration_tests::nodes::node_v4(1));
    let a = c.from_client("tcp", &np, 5);
    assert!(a.iter().all(|x| x.ok), "{a:?}");
}
