//! The test bed itself, without the agent: the pod network, the probe, the
//! safety net (no route out) and the cleanup.
use std::{net::SocketAddr, path::Path, time::Instant};

use integration_tests::{
    cgroup, netns::pod_v4, netns::pod_v6, require_root, CgroupGuard, Client, Family, Proto, Spread,
    Topology,
};

fn bed(name: &str) -> (Topology, CgroupGuard) {
    let cg = CgroupGuard::create(name).expect("cgroup");
    let topo = Topology::pods(name, 2).expect("topology");
    topo.serve_all(&[8080, 9090], true).expect("servers");
    (topo, cg)
}

#[test]
fn pod_to_pod_reaches_exactly_that_pod() {
    require_root!();
    let (topo, cg) = bed("p2p");
    for (proto, family, target) in [
        (Proto::Tcp, None, "10.244.1.2:8080"),
        (Proto::Tcp, None, "[fd00:244:1::2]:8080"),
        (Proto::Tcp, Some(Family::V4Mapped), "10.244.1.2:8080"),
        (Proto::Udp, None, "10.244.1.2:9090"),
        (Proto::Udp, None, "[fd00:244:1::2]:9090"),
        (Proto::UdpConnected, None, "10.244.1.2:8080"),
        (
            Proto::UdpConnected,
            Some(Family::V4Mapped),
            "10.244.1.2:9090",
        ),
    ] {
        let mut c = Client::new(&topo, &cg).proto(proto);
        if let Some(f) = family {
            c = c.family(f);
        }
        let attempts = c.run(target, 5).expect("client");
        let want: SocketAddr = target.parse().unwrap();
        for a in &attempts {
            assert!(a.ok, "{proto:?} {target}: {a:?}");
            assert_eq!(a.backend.as_deref(), Some("b2"), "{a:?}");
            assert_eq!(a.backend_port, Some(want.port()), "{a:?}");
            assert_eq!(
                a.peer_addr(),
                Some(want),
                "{proto:?} {family:?} {target}: {a:?}"
            );
            if proto == Proto::UdpConnected {
                assert_eq!(a.source_addr(), Some(want), "{a:?}");
            }
        }
    }
}

#[test]
fn client_ns_has_no_route_out() {
    require_root!();
    let (topo, cg) = bed("noroute");
    // No agent: a VIP is just an address nobody routes.
    for (proto, target) in [
        (Proto::Tcp, "10.96.0.10:80"),
        (Proto::Udp, "10.96.0.10:53"),
        (Proto::UdpConnected, "10.96.0.10:53"),
        (Proto::Tcp, "[fd00:96::10]:80"),
        (Proto::Udp, "[fd00:96::10]:53"),
    ] {
        let attempts = Client::new(&topo, &cg).proto(proto).run(target, 3).unwrap();
        for a in &attempts {
            assert!(!a.ok, "{a:?}");
            assert_eq!(
                a.error.as_deref(),
                Some("ENETUNREACH"),
                "{proto:?} {target}: {a:?}"
            );
        }
    }
    let routes = topo
        .exec("client", &["ip", "route", "show", "default"])
        .unwrap();
    assert!(
        routes.trim().is_empty(),
        "client has a default route: {routes}"
    );
    let routes6 = topo
        .exec("client", &["ip", "-6", "route", "show", "default"])
        .unwrap();
    assert!(
        routes6.trim().is_empty(),
        "client has a default route: {routes6}"
    );
}

#[test]
fn probe_reports_refused_ports() {
    require_root!();
    let (topo, cg) = bed("refused");
    let a = Client::new(&topo, &cg).run("10.244.1.1:7777", 3).unwrap();
    assert!(
        a.iter().all(|a| a.error.as_deref() == Some("ECONNREFUSED")),
        "{a:?}"
    );
    // Connected UDP learns of the ICMP port unreachable on receive.
    let a = Client::new(&topo, &cg)
        .proto(Proto::UdpConnected)
        .run("10.244.1.1:7777", 1)
        .unwrap();
    assert_eq!(a[0].error.as_deref(), Some("ECONNREFUSED"), "{a:?}");
    // Unconnected UDP does not: it times out.
    let a = Client::new(&topo, &cg)
        .proto(Proto::Udp)
        .timeout_ms(200)
        .run("10.244.1.1:7777", 1)
        .unwrap();
    assert_eq!(a[0].error.as_deref(), Some("ETIMEDOUT"), "{a:?}");
}

#[test]
fn the_client_runs_in_the_cgroup_and_is_fast() {
    require_root!();
    let (topo, cg) = bed("fast");
    let t = Instant::now();
    let a = Client::new(&topo, &cg).run("10.244.1.1:8080", 300).unwrap();
    let took = t.elapsed();
    let s = Spread::of(&a);
    assert_eq!(s.count("b1"), 300, "{s}");
    eprintln!("300 direct TCP connects took {took:?}");
    // The probe exited, so the cgroup is empty again.
    assert!(cg.procs().is_empty(), "{:?}", cg.procs());
}

#[test]
fn everything_is_removed_after_a_panic() {
    require_root!();
    let recorded = std::sync::Mutex::new(None);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (topo, cg) = bed("panic");
        // A process left in the cgroup must be killed by the guard.
        let mut sleeper = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        std::fs::write(cg.path().join("cgroup.procs"), sleeper.id().to_string()).unwrap();
        *recorded.lock().unwrap() = Some((
            topo.netns_names(),
            cg.path().to_path_buf(),
            topo.server_pids(),
            sleeper.id(),
        ));
        std::thread::spawn(move || {
            let _ = sleeper.wait();
        });
        assert_eq!(topo.server_pids().len(), 2);
        panic!("deliberate panic with a live topology");
    }));
    assert!(r.is_err());
    let (netns, cgroup_dir, pids, sleeper) = recorded.lock().unwrap().take().unwrap();
    let listed = integration_tests::cmd::ip(&["netns", "list"]).unwrap();
    for ns in &netns {
        assert!(
            !Path::new("/run/netns").join(ns).exists(),
            "{ns} left behind"
        );
        assert!(
            !listed.contains(ns.as_str()),
            "{ns} still listed:\n{listed}"
        );
    }
    assert!(!cgroup_dir.exists(), "{} left behind", cgroup_dir.display());
    assert!(
        integration_tests::wait_until(
            std::time::Duration::from_secs(2),
            std::time::Duration::from_millis(20),
            || pids.iter().chain([&sleeper]).all(|p| !alive(*p))
        ),
        "processes survived: {pids:?} {sleeper}"
    );
    assert!(cgroup::cgroup2_root().unwrap().is_dir());
}

/// Alive and not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

#[test]
fn addresses_are_as_documented() {
    assert_eq!(pod_v4(100).to_string(), "10.244.1.100");
    assert_eq!(pod_v6(100).to_string(), "fd00:244:1::100");
    assert_eq!(pod_v6(3).to_string(), "fd00:244:1::3");
}
