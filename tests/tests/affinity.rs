//! sessionAffinity ClientIP on the socket path: the client is its network
//! namespace (a pod), so each test's clients are namespaces of their own.
mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use common::*;
use integration_tests::{
    cluster::{metric, poll_tcp, ready_slice, with_client_ip_affinity},
    netns::{pod_v4, pod_v6},
    require_root, wait_until, Attempt, Client, Env, Proto, Spread,
};
use serde_json::Value;

/// `web` with sessionAffinity ClientIP and `timeout` seconds, on `hosts`.
fn sticky_web(env: &Env, timeout: u32, hosts: &[&str]) -> Vec<Value> {
    vec![
        with_client_ip_affinity(web_service().to_value(), timeout),
        ready_slice(env, "web", "web-abcde", &WEB_PORTS, hosts),
    ]
}

/// `Env::new(tag, backends)` with `sticky_web(timeout, hosts)` and the
/// agent started.
fn sticky_env(tag: &str, backends: u8, timeout: u32, hosts: &[&str]) -> Env {
    let mut env = Env::new(tag, backends).unwrap();
    env.manifests
        .write("web.yaml", &sticky_web(&env, timeout, hosts))
        .unwrap();
    env.start_agent().unwrap();
    env
}

/// `sticky_env(tag, 3, timeout, b1..b3)` and `clients_and_client(n)`.
fn sticky_clients(tag: &str, timeout: u32, n: u8) -> (Env, Vec<String>) {
    let mut env = sticky_env(tag, 3, timeout, &["b1", "b2", "b3"]);
    let clients = clients_and_client(&mut env, n);
    (env, clients)
}

/// `n` client hosts `c{i}` from 10.244.1.101 on, and `client`.
fn clients_and_client(env: &mut Env, n: u8) -> Vec<String> {
    let mut clients = add_clients(env, "c", 101, n);
    clients.push("client".into());
    clients
}

/// After `idle_ms` of idleness, a [`round`], and how many clients it found
/// on another backend than in `first`.
fn round_after(
    env: &Env,
    clients: &[String],
    first: &[String],
    idle_ms: u64,
) -> (Vec<String>, usize) {
    std::thread::sleep(Duration::from_millis(idle_ms));
    let after = round(env, clients);
    let changed = first.iter().zip(&after).filter(|(a, b)| a != b).count();
    (after, changed)
}

/// The backend each of `clients` sticks to over 3 TCP connects.
fn round(env: &Env, clients: &[String]) -> Vec<String> {
    clients
        .iter()
        .map(|c| single_backend(c, &tcp_from(env, c, 3)))
        .collect()
}

/// Adds client hosts `name{i}` at 10.244.1.{first+i}, i in 0..n.
fn add_clients(env: &mut Env, prefix: &str, first: u8, n: u8) -> Vec<String> {
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            env.topo
                .add_host(&name, pod_v4(first + i), pod_v6(first + i))
                .unwrap_or_else(|e| panic!("{e:#}"));
            name
        })
        .collect()
}

/// A client running in `host`'s namespace (and the test's cgroup).
fn client_in(env: &Env, host: &str) -> Client {
    Client {
        netns: env.topo.host(host).netns.clone(),
        ..env.client()
    }
}

fn tcp_from(env: &Env, host: &str, count: usize) -> Vec<Attempt> {
    client_in(env, host)
        .run("10.96.0.10:80", count)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The one backend all of `attempts` reached; panics if they failed or
/// went to more than one.
fn single_backend(what: &str, attempts: &[Attempt]) -> String {
    assert_all_ok(what, attempts);
    let s = Spread::of(attempts);
    assert_eq!(
        s.backends.len(),
        1,
        "{what}: a sticky client reached several backends:\n{s}"
    );
    s.backends.keys().next().unwrap().clone()
}

fn affinity_entries(env: &Env) -> usize {
    env.agent()
        .inspect_affinity()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .len()
}

#[test]
fn a_client_sticks_and_clients_spread() {
    require_root!();
    let mut env = sticky_env("affst", 3, 60, &["b1", "b2", "b3"]);

    let b = single_backend("client, TCP", &env.tcp("10.96.0.10:80", 50));
    let u = single_backend(
        "client, UDP",
        &env.attempts(Proto::Udp, "10.96.0.10:53", 30),
    );
    let uc = single_backend(
        "client, connected UDP",
        &env.attempts(Proto::UdpConnected, "10.96.0.10:53", 30),
    );
    assert_eq!(
        u, uc,
        "UDP and connected UDP share the UDP frontend's entry"
    );
    eprintln!("client sticks: TCP -> {b}, UDP -> {u}");

    // Other pods choose for themselves: over 12 clients, more than one
    // backend (all 12 on one of 3 has probability 3^-11).
    let clients = add_clients(&mut env, "c", 101, 11);
    let mut chosen: BTreeMap<String, usize> = BTreeMap::from([(b, 1)]);
    for c in &clients {
        let b = single_backend(&format!("{c}, TCP"), &tcp_from(&env, c, 10));
        *chosen.entry(b).or_default() += 1;
    }
    eprintln!("12 client namespaces over the backends: {chosen:?}");
    assert!(
        chosen.len() >= 2,
        "every client namespace got the same backend: {chosen:?}"
    );
    let entries = env.agent().inspect_affinity().unwrap();
    eprintln!("inspect affinity: {} entries", entries.len());
    // One per client and frontend: 12 TCP, 1 UDP.
    assert_eq!(entries.len(), 13, "{entries:#?}");
    assert!(entries
        .iter()
        .all(|e| e["client"].as_str().unwrap_or("").starts_with("netns:")));
}

#[test]
fn the_choice_is_fresh_after_the_timeout_and_never_within() {
    require_root!();
    let (env, clients) = sticky_clients("afftm", 2, 9);
    // Within the timeout, refreshed by each use: 1.5 s apart, twice (3 s
    // after the first choice, which a use 1.5 s in kept alive).
    let first = round(&env, &clients);
    let mut last_round = Instant::now();
    for gap in [1.5, 1.5] {
        std::thread::sleep(Duration::from_secs_f64(gap).saturating_sub(last_round.elapsed()));
        let again = round(&env, &clients);
        last_round = Instant::now();
        assert_eq!(
            first, again,
            "a client changed backend within the 2 s timeout ({gap} s after its last use)"
        );
    }
    // Past the timeout: a fresh choice each; over 10 clients with 3
    // backends, at least one differs (all keep theirs with probability 3^-10).
    let (after, changed) = round_after(&env, &clients, &first, 2600);
    eprintln!(
        "before the timeout: {first:?}\nafter 2.6 s idle:   {after:?}\n{changed} of {} clients changed backend",
        clients.len()
    );
    assert!(
        changed >= 1,
        "no client got a fresh choice after the timeout"
    );
    // ... and the fresh choice sticks again.
    assert_eq!(after, round(&env, &clients));
}

#[test]
fn removing_the_sticky_backend_moves_the_client_which_then_sticks() {
    require_root!();
    let all = ["b1", "b2", "b3"];
    let env = sticky_env("affrm", 3, 60, &all);
    let sticky = single_backend("before", &env.tcp("10.96.0.10:80", 20));
    let rest: Vec<&str> = all.into_iter().filter(|b| *b != sticky).collect();
    env.manifests
        .write("web.yaml", &sticky_web(&env, 60, &rest))
        .unwrap();
    let took = poll_tcp(&env, "10.96.0.10:80", 5, Duration::from_secs(10), |s| {
        s.ok() == s.total && s.count(&sticky) == 0
    })
    .unwrap_or_else(|s| panic!("the client still reaches {sticky}, which left:\n{s}"));
    let moved = single_backend("after", &env.tcp("10.96.0.10:80", 30));
    eprintln!("{sticky} left; the client moved to {moved} after {took:?}, and sticks there");
    assert!(rest.contains(&moved.as_str()));
    // Still there a little later.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        moved,
        single_backend("later", &env.tcp("10.96.0.10:80", 10))
    );
    let entries = env.agent().inspect_affinity().unwrap();
    assert_eq!(entries.len(), 1, "{entries:#?}");
    let want = format!("{}:8080", env.topo.host(&moved).ipv4);
    assert_eq!(entries[0]["backend"].as_str(), Some(want.as_str()));
    // The sweeper's work on /metrics: the entry bound to the backend that
    // left was swept.
    let (_, m) = env.agent().metrics().unwrap();
    assert!(
        metric(&m, "lb_affinity_swept_total") >= Some(1.0),
        "lb_affinity_swept_total: {m}"
    );
}

#[test]
fn the_sweeper_keeps_the_affinity_map_bounded_under_client_churn() {
    require_root!();
    let mut env = sticky_env("affsw", 2, 1, &["b1", "b2"]);
    const WAVE: u8 = 10;
    let mut sizes = Vec::new();
    let mut total = 0usize;
    let t = Instant::now();
    let mut swept_at = None;
    // A wave of pods a second that connect once and go away, until a wave
    // after the sweeper's first run (it runs every 5 s).
    for wave in 0..12u8 {
        std::thread::sleep(Duration::from_secs(wave as u64).saturating_sub(t.elapsed()));
        let clients = add_clients(&mut env, &format!("w{wave}c"), 101 + wave * WAVE, WAVE);
        for c in &clients {
            assert_all_ok(c, &tcp_from(&env, c, 1));
        }
        total += clients.len();
        for c in &clients {
            integration_tests::netns::delete_netns(&env.topo.host(c).netns);
        }
        let n = affinity_entries(&env);
        let (_, m) = env.agent().metrics().unwrap();
        let expired = metric(&m, "lb_affinity_expired_total").unwrap_or(0.0);
        eprintln!(
            "{:>5.1} s: wave {wave}: {total} clients so far, {n} affinity entries, {expired} expired by the sweeper",
            t.elapsed().as_secs_f64()
        );
        sizes.push(n);
        if expired > 0.0 && swept_at.is_none() {
            swept_at = Some(wave);
        } else if swept_at.is_some() {
            break;
        }
    }
    let peak = *sizes.iter().max().unwrap();
    assert!(
        peak < total,
        "the map kept every client that ever connected: sizes {sizes:?}, {total} clients"
    );
    let before = affinity_entries(&env);
    let t = Instant::now();
    assert!(
        wait_until(Duration::from_secs(12), Duration::from_millis(200), || {
            affinity_entries(&env) == 0
        }),
        "expired entries of departed clients are not swept: {} left",
        affinity_entries(&env)
    );
    eprintln!(
        "affinity map: {before} entries before the sweep, 0 after ({:?} later); \
         sizes after each wave {sizes:?}, {total} clients in all",
        t.elapsed()
    );
    let (_, m) = env.agent().metrics().unwrap();
    assert_eq!(metric(&m, "lb_affinity_entries"), Some(0.0), "{m}");
    assert!(
        metric(&m, "lb_affinity_expired_total").unwrap_or(0.0) >= total as f64 - 1.0,
        "{m}"
    );
}

/// The `affinity_timeout` of the web frontend 10.96.0.10:80, per inspect
/// (None: no affinity).
fn inspected_timeout(env: &Env) -> Option<u64> {
    let v = env.agent().inspect_services().unwrap();
    let list = v.as_array().cloned().unwrap_or_default();
    list.iter()
        .find(|f| {
            let s = f.to_string();
            s.contains("10.96.0.10") && f["port"].as_u64() == Some(80)
        })
        .and_then(|f| f["affinity_timeout"].as_u64())
}

#[test]
fn timeout_changes_and_switching_off_apply_on_the_next_sync() {
    require_root!();
    let all = ["b1", "b2", "b3"];
    let (env, clients) = sticky_clients("affcfg", 3600, 9);
    let first = round(&env, &clients);
    assert_eq!(affinity_entries(&env), clients.len());

    // 3600 s -> 1 s: the kernel applies the new timeout to existing entries.
    env.manifests
        .write("web.yaml", &sticky_web(&env, 1, &all))
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            inspected_timeout(&env) == Some(1)
        }),
        "timeoutSeconds 1 not programmed: {:?}",
        inspected_timeout(&env)
    );
    let (_, changed) = round_after(&env, &clients, &first, 1500);
    eprintln!(
        "timeout cut to 1 s, 1.5 s idle: {changed} of {} clients changed backend",
        clients.len()
    );
    assert!(
        changed >= 1,
        "the shorter timeout did not apply to existing entries"
    );

    // Off: entries are swept at once and connections spread again.
    let mut off = sticky_web(&env, 1, &all);
    off[0]["spec"]["sessionAffinity"] = serde_json::json!("None");
    off[0]["spec"]
        .as_object_mut()
        .unwrap()
        .remove("sessionAffinityConfig");
    env.manifests.write("web.yaml", &off).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            inspected_timeout(&env).is_none()
        }),
        "affinity still programmed"
    );
    let a = env.tcp("10.96.0.10:80", 60);
    assert_spread("affinity off", &a, &all, 0.1);
    assert_eq!(
        affinity_entries(&env),
        0,
        "entries left after affinity was switched off"
    );
}

#[test]
fn clients_stick_to_serving_terminating_endpoints_too() {
    require_root!();
    // KEP-1669 with affinity: with no ready endpoint, the client sticks to
    // one of the serving-terminating ones like to a ready one, and the
    // sweeper must not take that for a backend that left.
    let mut env = Env::new("affterm", 3).unwrap();
    let all = ["b1", "b2", "b3"];
    let terminating = |env: &Env| {
        let mut docs = sticky_web(env, 3600, &all);
        let addrs: Vec<std::net::IpAddr> = (1..=3).map(|i| pod_v4(i).into()).collect();
        docs[1] =
            integration_tests::cluster::with_conditions(docs[1].clone(), &addrs, false, true, true);
        docs
    };
    env.manifests.write("web.yaml", &terminating(&env)).unwrap();
    env.start_agent().unwrap();
    let sticky = single_backend("terminating only", &env.tcp("10.96.0.10:80", 20));
    assert_eq!(affinity_entries(&env), 1);
    // Any sync that writes a frontend sweeps: add an unrelated Service.
    env.manifests
        .write("other.yaml", &one_pod_http("other", "10.96.0.11", 1))
        .unwrap();
    poll_tcp(&env, "10.96.0.11:80", 3, Duration::from_secs(5), |s| {
        s.ok() == s.total
    })
    .unwrap_or_else(|s| panic!("other not served:\n{s}"));
    let entries = env.agent().inspect_affinity().unwrap();
    eprintln!("after a sweeping sync: {entries:?}");
    assert_eq!(
        entries.len(),
        1,
        "the sweeper deleted the entry of a client on a serving-terminating endpoint"
    );
    assert_eq!(
        sticky,
        single_backend("after the sweep", &env.tcp("10.96.0.10:80", 20))
    );
}

#[test]
fn stickiness_survives_an_agent_restart() {
    require_root!();
    let (mut env, clients) = sticky_clients("affrs", 3600, 5);
    let before = round(&env, &clients);
    let agent = env.agent.as_mut().unwrap();
    agent.kill().unwrap();
    agent.restart(Duration::from_secs(20)).unwrap();
    let after = round(&env, &clients);
    assert_eq!(
        before, after,
        "clients lost their backends across a restart"
    );
    assert_eq!(affinity_entries(&env), clients.len());
}
