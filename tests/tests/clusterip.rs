//! ClusterIP load balancing through the agent, IPv4.
mod common;

use common::*;
use integration_tests::{
    cluster::flows,
    manifests::{Endpoint, EndpointSlice, Service},
    netns::pod_v4,
    require_root, AgentOpts, Attempt, Env, Proto, Spread,
};
use serde_json::json;

#[test]
fn tcp_reaches_every_backend_evenly_and_shows_the_vip() {
    require_root!();
    let env = web_env("tcp", 3);

    let a = env.tcp("10.96.0.10:80", 300);
    assert_all_ok("TCP 10.96.0.10:80", &a);
    // Fair share 33%; 20% is ~5 standard deviations below it for 300 draws.
    assert_spread("TCP 10.96.0.10:80", &a, &["b1", "b2", "b3"], 0.20);
    assert_peer("TCP getpeername", &a, "10.96.0.10:80");
}

#[test]
fn udp_sockets_spread_keep_their_backend_and_answer_from_the_vip() {
    require_root!();
    let env = web_env("udp", 3);

    // A new unconnected socket per datagram: the sockets spread.
    let a = env.attempts(Proto::Udp, "10.96.0.10:53", 300);
    assert_all_ok("UDP sendto/recvfrom", &a);
    assert_spread(
        "UDP unconnected, one socket each",
        &a,
        &["b1", "b2", "b3"],
        0.20,
    );
    assert_peer("UDP recvfrom source", &a, "10.96.0.10:53");

    // Many datagrams of each of 30 unconnected sockets: all of a socket's
    // go to one backend (QUIC, DTLS, SIP rely on it), the sockets spread
    // (each backend is missed with probability 3 * (2/3)^30 ~ 1e-5).
    let mut f = flows(&env, "10.96.0.10:53", 30).unwrap();
    let on = backend_per_socket("UDP unconnected", &flow_rounds(&mut f, 10));
    let per_backend = sockets_per_backend(&on);
    eprintln!("UDP unconnected, 30 sockets x 10 datagrams: {per_backend:?}");
    assert_eq!(
        per_backend.keys().copied().collect::<Vec<_>>(),
        ["b1", "b2", "b3"],
        "the sockets do not spread: {per_backend:?}"
    );

    let a = env.attempts(Proto::UdpConnected, "10.96.0.10:53", 300);
    assert_ok_spread("UDP connected", &a, &["b1", "b2", "b3"], 0.20);
    assert_peer("UDP connected getpeername", &a, "10.96.0.10:53");
    for x in &a {
        assert_eq!(
            x.source_addr(),
            Some(sa("10.96.0.10:53")),
            "recvfrom source: {x:?}"
        );
    }
}

/// A Service with a port but no EndpointSlice, and one whose slice has
/// no endpoints, with an agent started with `extra_args`.
fn without_endpoints_env(name: &str, extra_args: &[&str]) -> Env {
    let mut env = Env::new(name, 1).unwrap();
    env.manifests
        .write(
            "empty.yaml",
            &[http_service("empty", "10.96.0.20")
                .port("dns", 53, "UDP", json!(8080))
                .to_value()],
        )
        .unwrap();
    // A slice that exists but has no endpoints at all.
    env.manifests
        .write(
            "hollow.yaml",
            &[
                http_service("hollow", "10.96.0.21").to_value(),
                EndpointSlice::new("demo", "hollow-1", "hollow")
                    .address_type("IPv4")
                    .port("http", 8080, "TCP")
                    .to_value(),
            ],
        )
        .unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    env
}

/// Every way to address a Service without endpoints fails with `errno`;
/// the attempts, by target.
fn assert_refused_with(env: &Env, errno: &str) -> Vec<(String, Vec<Attempt>)> {
    let mut all = Vec::new();
    for (proto, target) in [
        (Proto::Tcp, "10.96.0.20:80"),
        (Proto::UdpConnected, "10.96.0.20:53"),
        (Proto::Udp, "10.96.0.20:53"),
        (Proto::Tcp, "10.96.0.21:80"),
    ] {
        let a = env
            .client()
            .proto(proto)
            .timeout_ms(2000)
            .run(target, 5)
            .unwrap();
        let what = format!("{proto:?} {target}");
        assert_all_fail(&what, &a, errno);
        all.push((what, a));
    }
    all
}

/// The agent's `lb_refusal_errno` gauge.
fn refusal_errno_metric(env: &Env) -> String {
    let (_, text) = env.agent().metrics().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("lb_refusal_errno "))
        .unwrap_or_else(|| panic!("no lb_refusal_errno in /metrics:\n{text}"))
        .to_owned()
}

#[test]
fn service_without_endpoints_is_refused_at_once() {
    require_root!();
    let env = without_endpoints_env("noep", &[]);
    for (what, a) in assert_refused_with(&env, "ECONNREFUSED") {
        let worst = a.iter().map(|x| x.elapsed_ms).fold(0.0, f64::max);
        eprintln!("{what}: ECONNREFUSED, slowest attempt {worst:.3} ms");
        assert!(worst < 1000.0, "{what}: refusal took {worst} ms");
    }
    assert_eq!(refusal_errno_metric(&env), "111");
}

/// The programs for kernels without `bpf_set_retval` in sock_addr hooks
/// (before 6.1), forced here: the hook's own rejection, EPERM, and the
/// agent says so in its log and metrics.
#[test]
fn service_without_endpoints_is_refused_with_eperm_by_the_programs_for_older_kernels() {
    require_root!();
    let env = without_endpoints_env("noepperm", &["--refusal", "eperm"]);
    assert_refused_with(&env, "EPERM");
    assert_eq!(refusal_errno_metric(&env), "1");
    let log = env.agent().log();
    assert!(
        log.contains("to a Service without endpoints fail with EPERM"),
        "{log}"
    );
}

#[test]
fn port_the_service_does_not_have_is_refused() {
    require_root!();
    let env = web_env("noport", 2);

    // The Service works ...
    assert_all_ok("TCP 10.96.0.10:80", &env.tcp("10.96.0.10:80", 10));
    // ... other ports of its ClusterIP are refused, not routed.
    for target in ["10.96.0.10:8080", "10.96.0.10:443", "10.96.0.10:53"] {
        let a = env.tcp(target, 3);
        assert_all_fail(&format!("TCP {target}"), &a, "ECONNREFUSED");
    }
    let a = env.attempts(Proto::UdpConnected, "10.96.0.10:80", 3);
    assert_all_fail(
        "UDP 10.96.0.10:80 (the Service has 80/TCP only)",
        &a,
        "ECONNREFUSED",
    );
}

#[test]
fn named_target_ports_of_a_multi_port_service() {
    require_root!();
    // Every backend serves 8080 and 9090 and says which one was hit.
    let mut env = Env::with_serve("named", 3, &[8080, 9090], true).unwrap();
    let svc = Service::new("demo", "multi")
        .cluster_ip("10.96.0.12")
        .port("http", 80, "TCP", json!("web"))
        .port("metrics", 9100, "TCP", json!("prom"))
        .port("metrics-udp", 9100, "UDP", json!("prom"));
    // Listed in another order than the Service's, to show matching by name.
    let slice = env.slice(
        "multi",
        &[
            ("metrics", 9090, "TCP"),
            ("http", 8080, "TCP"),
            ("metrics-udp", 9090, "UDP"),
        ],
    );
    env.manifests
        .write("multi.yaml", &[svc.to_value(), slice.to_value()])
        .unwrap();
    env.start_agent().unwrap();

    for (proto, target, port) in [
        (Proto::Tcp, "10.96.0.12:80", 8080),
        (Proto::Tcp, "10.96.0.12:9100", 9090),
        (Proto::Udp, "10.96.0.12:9100", 9090),
    ] {
        let a = env.attempts(proto, target, 90);
        let what = format!("{proto:?} {target}");
        assert_all_ok(&what, &a);
        for x in &a {
            assert_eq!(
                x.backend_port,
                Some(port),
                "{what} must reach target port {port}: {x:?}"
            );
        }
        assert_spread(&what, &a, &["b1", "b2", "b3"], 0.10);
        assert_peer(&what, &a, target);
    }
}

#[test]
fn unready_endpoints_are_never_chosen() {
    require_root!();
    let mut env = Env::new("unready", 3).unwrap();
    let slice = env.slice_of("web", &[("http", 8080, "TCP"), ("dns", 8080, "UDP")], |h| {
        let ip = std::net::IpAddr::V4(h.ipv4);
        match h.name.as_str() {
            "b1" => Endpoint::ready(ip),
            "b2" => Endpoint::unready(ip),
            _ => Endpoint::unknown(ip), // no `ready` condition: counts as ready
        }
    });
    let down = http_service("down", "10.96.0.11");
    let down_slice = EndpointSlice::new("demo", "down-1", "down")
        .port("http", 8080, "TCP")
        .endpoint(Endpoint::unready(pod_v4(2).into()));
    env.manifests
        .write(
            "web.yaml",
            &[
                web_service().to_value(),
                slice.to_value(),
                down.to_value(),
                down_slice.to_value(),
            ],
        )
        .unwrap();
    env.start_agent().unwrap();

    let a = env.tcp("10.96.0.10:80", 200);
    assert_all_ok("TCP", &a);
    assert_spread("TCP with b2 unready", &a, &["b1", "b3"], 0.25);
    let a = env.attempts(Proto::Udp, "10.96.0.10:53", 100);
    assert_all_ok("UDP", &a);
    assert_spread("UDP with b2 unready", &a, &["b1", "b3"], 0.20);
    // Only unready endpoints: as good as none.
    let a = env.tcp("10.96.0.11:80", 5);
    assert_all_fail(
        "TCP to a Service whose only endpoint is unready",
        &a,
        "ECONNREFUSED",
    );
}

#[test]
fn pod_to_pod_traffic_is_untouched() {
    require_root!();
    let env = web_env("direct", 3);

    for (proto, target, backend) in [
        (Proto::Tcp, "10.244.1.2:8080", "b2"),
        (Proto::Udp, "10.244.1.3:8080", "b3"),
        (Proto::UdpConnected, "10.244.1.1:8080", "b1"),
        (Proto::Tcp, "[fd00:244:1::2]:8080", "b2"),
    ] {
        let what = format!("{proto:?} {target}");
        let a = env.attempts(proto, target, 30);
        assert_all_ok(&what, &a);
        let s = Spread::of(&a);
        assert_eq!(
            s.count(backend),
            30,
            "{what} must reach exactly {backend}\n{s}"
        );
        assert_peer(&what, &a, target);
    }
}

#[test]
fn vip_without_service_is_unreachable_from_the_client() {
    require_root!();
    let env = web_env("novip", 1);

    // The agent is live (10.96.0.10 works), yet an address no Service has is
    // not translated, and the client namespace has no route for it: the
    // safety net that keeps test traffic on this machine.
    assert_all_ok("TCP 10.96.0.10:80", &env.tcp("10.96.0.10:80", 5));
    for (proto, target) in [
        (Proto::Tcp, "10.96.0.99:80"),
        (Proto::Udp, "10.96.0.99:53"),
        (Proto::Tcp, "[fd00:96::99]:80"),
    ] {
        let a = env.attempts(proto, target, 3);
        assert_all_fail(&format!("{proto:?} {target}"), &a, "ENETUNREACH");
    }
}
