//! Helpers shared by the agent tests.
#![allow(dead_code)]

use std::net::SocketAddr;

use integration_tests::{manifests::Service, Attempt, Env, Spread};
use serde_json::{json, Value};

pub const VIP: &str = "10.96.0.10";

/// Service `demo/web`: ClusterIP 10.96.0.10, `http` 80/TCP and `dns`
/// 53/UDP, both to target port 8080.
pub fn web_service() -> Service {
    Service::new("demo", "web")
        .cluster_ip(VIP)
        .port("http", 80, "TCP", json!(8080))
        .port("dns", 53, "UDP", json!(8080))
}

/// `web_service()` and a slice with every backend ready.
pub fn web(env: &Env) -> Vec<Value> {
    vec![
        web_service().to_value(),
        env.slice("web", &[("http", 8080, "TCP"), ("dns", 8080, "UDP")])
            .to_value(),
    ]
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
