//! Helpers shared by the agent tests.
#![allow(dead_code)]

use std::{collections::BTreeMap, net::SocketAddr};

use integration_tests::{
    apiserver::ApiServer,
    cluster::Flows,
    manifests::{Endpoint, EndpointSlice, Service},
    netns::pod_v4,
    Attempt, Env, Spread,
};
use serde_json::{json, Value};

pub const VIP: &str = "10.96.0.10";

/// The target ports of `web_service()`: (name, port, protocol).
pub const WEB_PORTS: [(&str, u16, &str); 2] = [("http", 8080, "TCP"), ("dns", 8080, "UDP")];

/// Service `demo/web`: ClusterIP 10.96.0.10, `http` 80/TCP and `dns`
/// 53/UDP, both to target port 8080.
pub fn web_service() -> Service {
    Service::new("demo", "web")
        .cluster_ip(VIP)
        .port("http", 80, "TCP", json!(8080))
        .port("dns", 53, "UDP", json!(8080))
}

/// Service `demo/{name}` at ClusterIP `ip`, `http` 80/TCP to target port
/// 8080.
pub fn http_service(name: &str, ip: &str) -> Service {
    Service::new("demo", name)
        .cluster_ip(ip)
        .port("http", 80, "TCP", json!(8080))
}

/// `http_service(name, ip)` and its slice `{name}-1` with the one ready
/// endpoint [`pod_v4`]`(pod)`.
pub fn one_pod_http(name: &str, ip: &str, pod: u8) -> Vec<Value> {
    vec![
        http_service(name, ip).to_value(),
        EndpointSlice::new("demo", &format!("{name}-1"), name)
            .port("http", 8080, "TCP")
            .endpoint(Endpoint::ready(pod_v4(pod).into()))
            .to_value(),
    ]
}

/// `web_service()` and a slice with every backend ready.
pub fn web(env: &Env) -> Vec<Value> {
    vec![
        web_service().to_value(),
        env.slice("web", &WEB_PORTS).to_value(),
    ]
}

/// `Env::new(tag, backends)` serving `web(env)` from `web.yaml`, with the
/// agent started.
pub fn web_env(tag: &str, backends: u8) -> Env {
    let mut env = Env::new(tag, backends).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    env.start_agent().unwrap();
    env
}

/// A fake API server, then `Env::new(tag, backends)`.
pub fn api_and_env(tag: &str, backends: u8) -> (ApiServer, Env) {
    let api = ApiServer::start();
    (api, Env::new(tag, backends).unwrap())
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// Every attempt succeeded.
pub fn assert_all_ok(what: &str, attempts: &[Attempt]) {
    let bad: Vec<&Attempt> = attempts.iter().filter(|a| !a.ok).collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} attempts failed, e.g. {:?}\n{}",
        bad.len(),
        attempts.len(),
        bad.first(),
        Spread::of(attempts)
    );
}

/// Every attempt failed with `error`.
pub fn assert_all_fail(what: &str, attempts: &[Attempt], error: &str) {
    for a in attempts {
        assert!(
            !a.ok && a.error.as_deref() == Some(error),
            "{what}: expected {error}, got {a:?}"
        );
    }
}

/// Every successful attempt saw `peer` (after unmapping `::ffff:a.b.c.d`).
pub fn assert_peer(what: &str, attempts: &[Attempt], peer: &str) {
    let want = sa(peer);
    for a in attempts.iter().filter(|a| a.ok) {
        assert_eq!(
            a.peer_addr(),
            Some(want),
            "{what}: the application must see the frontend, not a backend: {a:?}"
        );
    }
}

/// Every attempt succeeded, and they spread as [`assert_spread`] checks.
pub fn assert_ok_spread(what: &str, attempts: &[Attempt], backends: &[&str], min_share: f64) {
    assert_all_ok(what, attempts);
    assert_spread(what, attempts, backends, min_share);
}

/// Each of `backends` got at least `min_share` of the attempts, and nothing
/// else answered.
pub fn assert_spread(what: &str, attempts: &[Attempt], backends: &[&str], min_share: f64) {
    let s = Spread::of(attempts);
    eprintln!("{what}:\n{s}");
    for b in backends {
        assert!(
            s.share(b) >= min_share,
            "{what}: {b} got {:.1}% (< {:.0}%)\n{s}",
            s.share(b) * 100.0,
            min_share * 100.0
        );
    }
    for b in s.backends.keys() {
        assert!(
            backends.contains(&b.as_str()),
            "{what}: unexpected backend {b}\n{s}"
        );
    }
}

/// `n` rounds of `lb-probe flows`: per round, the backend each socket's
/// datagram was answered by.
pub fn flow_rounds(f: &mut Flows, n: usize) -> Vec<Vec<Option<String>>> {
    (0..n)
        .map(|_| f.round().unwrap_or_else(|e| panic!("flows round: {e:#}")))
        .collect()
}

/// The one backend each socket's datagrams went to in `rounds` (every
/// datagram answered, every answer of a socket from one backend).
pub fn backend_per_socket(what: &str, rounds: &[Vec<Option<String>>]) -> Vec<String> {
    let sockets = rounds.first().map_or(0, Vec::len);
    (0..sockets)
        .map(|s| {
            let seen: Vec<Option<&str>> = rounds.iter().map(|r| r[s].as_deref()).collect();
            let first = seen[0].unwrap_or_else(|| panic!("{what}: socket {s} unanswered"));
            assert!(
                seen.iter().all(|b| *b == Some(first)),
                "{what}: socket {s}'s datagrams went to more than one backend: {seen:?}"
            );
            first.to_string()
        })
        .collect()
}

/// How many sockets each backend of [`backend_per_socket`] has.
pub fn sockets_per_backend(on: &[String]) -> BTreeMap<&str, usize> {
    let mut m = BTreeMap::new();
    for b in on {
        *m.entry(b.as_str()).or_default() += 1;
    }
    m
}

/// The `written=`, `adopted=` and `removed=` fields of the first "synced"
/// line of an agent's `log`.
pub fn synced_counts(log: &str) -> Option<(usize, usize, usize)> {
    let line = log.lines().find(|l| l.contains(" synced"))?;
    let field = |k: &str| -> Option<usize> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))?
            .parse()
            .ok()
    };
    Some((field("written")?, field("adopted")?, field("removed")?))
}
