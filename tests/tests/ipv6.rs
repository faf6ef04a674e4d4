//! IPv6 ClusterIPs and IPv4-mapped IPv6 on AF_INET6 sockets.
mod common;

use std::net::IpAddr;

use common::*;
use integration_tests::{
    cluster::flows,
    manifests::{Endpoint, Service},
    require_root, Env, Family, Proto,
};
use serde_json::json;

fn web6() -> Service {
    Service::new("demo", "web6")
        .cluster_ip("fd00:96::10")
        .port("http", 80, "TCP", json!(8080))
        .port("dns", 53, "UDP", json!(8080))
}

fn v6_slice(env: &Env, service: &str) -> integration_tests::manifests::EndpointSlice {
    env.slice_of(
        service,
        &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
        |h| Endpoint::ready(IpAddr::V6(h.ipv6)),
    )
    .address_type("IPv6")
}

#[test]
fn ipv6_clusterip_with_ipv6_pods() {
    require_root!();
    let mut env = Env::new("v6", 3).unwrap();
    let slice = v6_slice(&env, "web6");
    env.manifests
        .write("web6.yaml", &[web6().to_value(), slice.to_value()])
        .unwrap();
    env.start_agent().unwrap();

    let a = env.tcp("[fd00:96::10]:80", 150);
    assert_ok_spread("TCP [fd00:96::10]:80", &a, &["b1", "b2", "b3"], 0.15);
    assert_peer("TCP getpeername", &a, "[fd00:96::10]:80");

    for proto in [Proto::Udp, Proto::UdpConnected] {
        let what = format!("{proto:?} [fd00:96::10]:53");
        let a = env.attempts(proto, "[fd00:96::10]:53", 90);
        assert_ok_spread(&what, &a, &["b1", "b2", "b3"], 0.10);
        assert_peer(&what, &a, "[fd00:96::10]:53");
    }
    // Each unconnected socket keeps one backend for all its datagrams.
    let mut f = flows(&env, "[fd00:96::10]:53", 20).unwrap();
    let on = backend_per_socket("UDP [fd00:96::10]:53", &flow_rounds(&mut f, 8));
    let per_backend = sockets_per_backend(&on);
    assert!(
        per_backend.len() >= 2,
        "the sockets do not spread: {per_backend:?}"
    );
}

#[test]
fn ipv4_mapped_on_an_inet6_socket_is_balanced_like_ipv4() {
    require_root!();
    let env = web_env("mapped", 3);

    for (proto, target) in [
        (Proto::Tcp, "10.96.0.10:80"),
        (Proto::Udp, "10.96.0.10:53"),
        (Proto::UdpConnected, "10.96.0.10:53"),
    ] {
        let what = format!("{proto:?} [::ffff:{target}]");
        let a = env
            .client()
            .proto(proto)
            .family(Family::V4Mapped)
            .run(target, 120)
            .unwrap();
        assert_ok_spread(&what, &a, &["b1", "b2", "b3"], 0.12);
        // The socket is AF_INET6: it sees the VIP in its mapped form.
        let mapped = format!("[::ffff:{}]:{}", sa(target).ip(), sa(target).port());
        for x in &a {
            assert_eq!(x.peer.as_deref(), Some(mapped.as_str()), "{what}: {x:?}");
        }
    }
}

#[test]
fn dual_stack_service_serves_both_families() {
    require_root!();
    let mut env = Env::new("dual", 2).unwrap();
    let svc = Service::new("demo", "dual")
        .cluster_ip("10.96.0.10")
        .cluster_ip("fd00:96::10")
        .port("http", 80, "TCP", json!(8080))
        .port("dns", 53, "UDP", json!(8080));
    let mut s4 = env.slice("dual", &[("http", 8080, "TCP"), ("dns", 8080, "UDP")]);
    s4.name = "dual-v4".into();
    let mut s6 = v6_slice(&env, "dual");
    s6.name = "dual-v6".into();
    env.manifests
        .write("dual.yaml", &[svc.to_value(), s4.to_value(), s6.to_value()])
        .unwrap();
    env.start_agent().unwrap();

    for target in ["10.96.0.10:80", "[fd00:96::10]:80"] {
        let a = env.tcp(target, 60);
        assert_ok_spread(target, &a, &["b1", "b2"], 0.2);
        assert_peer(target, &a, target);
    }
}
