//! Cluster mode end to end: the agent's kube-rs watchers against the fake
//! API server (`integration_tests::apiserver`), checked with real
//! connections between network namespaces.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{
    apiserver::{ApiServer, Kind},
    cluster::{metric, metric_sum, poll_tcp, ready_slice, with_conditions, with_label},
    manifests::{Endpoint, EndpointSlice, Service},
    require_root, wait_until, AgentOpts, Env, Proto, Spread,
};
use serde_json::{json, Value};

const POLL: Duration = Duration::from_secs(10);

/// Slice `name` of Service `service` with the named backends ready.
fn apply(api: &ApiServer, objs: &[Value]) {
    for o in objs {
        api.apply(o)
            .unwrap_or_else(|e| panic!("apply: {e:#}\n{o:#}"));
    }
}

/// Applies `objs`, then starts the agent against `api`.
fn start_with(api: &ApiServer, objs: &[Value], env: &mut Env) {
    apply(api, objs);
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
}

/// Polls until a batch at `target` reaches exactly `backends` (all of them,
/// nothing else, no failure).
fn until_backends(env: &Env, what: &str, target: &str, backends: &[&str]) {
    let took = poll_tcp(env, target, 40, POLL, |s| {
        s.ok() == s.total
            && s.backends.len() == backends.len()
            && backends.iter().all(|b| s.count(b) > 0)
    })
    .unwrap_or_else(|s| panic!("{what}: {target} never reached exactly {backends:?}:\n{s}"));
    eprintln!("{what}: {target} -> {backends:?} after {took:?}");
}

/// Polls until every attempt at `target` fails with `error`.
fn until_error(env: &Env, what: &str, target: &str, error: &str) {
    let took = poll_tcp(env, target, 3, POLL, |s| {
        s.errors.get(error).copied() == Some(s.total)
    })
    .unwrap_or_else(|s| panic!("{what}: {target} does not fail with {error}:\n{s}"));
    eprintln!("{what}: {target} fails with {error} after {took:?}");
}

/// A connected UDP socket's attempt that met the agent's SOCK_DESTROY: its
/// pending ECONNABORTED, read by the recv that waited, or reported by the
/// send that came first (the destroy disconnects the socket, so that send
/// fails and the probe reads the pending error).
fn assert_destroyed(what: &str, a: &integration_tests::probe::Attempt) {
    assert!(
        a.error.as_deref() == Some("ECONNABORTED")
            && matches!(a.stage.as_deref(), Some("recv" | "send")),
        "{what}: {a:?}"
    );
}

fn metrics(env: &Env) -> String {
    let (code, body) = env.agent().metrics().unwrap();
    assert_eq!(code, 200, "/metrics: {body}");
    body
}

#[test]
fn services_and_slices_follow_the_api() {
    require_root!();
    let api = ApiServer::start();
    let mut env = Env::with_serve("clapi", 3, &[8080, 9090], true).unwrap();
    let web = || {
        Service::new("demo", "web")
            .cluster_ip(VIP)
            .port("http", 80, "TCP", json!("web"))
            .port("dns", 53, "UDP", json!("web"))
    };
    let ports = [("http", 8080, "TCP"), ("dns", 8080, "UDP")];
    start_with(
        &api,
        &[
            web().to_value(),
            ready_slice(&env, "web", "web-1", &ports, &["b1", "b2"]),
            // Another proxy's Service: never ours.
            with_label(
                http_service("theirs", "10.96.0.12").to_value(),
                "service.kubernetes.io/service-proxy-name",
                "other-proxy",
            ),
            ready_slice(
                &env,
                "theirs",
                "theirs-1",
                &[("http", 8080, "TCP")],
                &["b1"],
            ),
        ],
        &mut env,
    );

    // Created: both ports, only the endpoints listed.
    let a = env.tcp("10.96.0.10:80", 60);
    assert_ok_spread("TCP after the first list", &a, &["b1", "b2"], 0.2);
    assert_peer("TCP after the first list", &a, "10.96.0.10:80");
    let a = env.attempts(Proto::Udp, "10.96.0.10:53", 40);
    assert_ok_spread("UDP after the first list", &a, &["b1", "b2"], 0.2);
    assert_all_fail(
        "a Service labelled service-proxy-name",
        &env.tcp("10.96.0.12:80", 3),
        "ENETUNREACH",
    );

    // Scaled up, then down.
    apply(
        &api,
        &[ready_slice(
            &env,
            "web",
            "web-1",
            &ports,
            &["b1", "b2", "b3"],
        )],
    );
    until_backends(&env, "scaled up", "10.96.0.10:80", &["b1", "b2", "b3"]);
    apply(&api, &[ready_slice(&env, "web", "web-1", &ports, &["b3"])]);
    until_backends(&env, "scaled down", "10.96.0.10:80", &["b3"]);
    // A second slice of the same Service is merged in.
    apply(&api, &[ready_slice(&env, "web", "web-2", &ports, &["b1"])]);
    until_backends(&env, "second slice", "10.96.0.10:80", &["b1", "b3"]);

    // The named target port moves to 9090 in the slices.
    let ports9090 = [("http", 9090, "TCP"), ("dns", 9090, "UDP")];
    apply(
        &api,
        &[
            ready_slice(&env, "web", "web-1", &ports9090, &["b3"]),
            ready_slice(&env, "web", "web-2", &ports9090, &["b1"]),
        ],
    );
    assert!(
        wait_until(POLL, Duration::from_millis(50), || {
            env.tcp("10.96.0.10:80", 20)
                .iter()
                .all(|a| a.ok && a.backend_port == Some(9090))
        }),
        "the named port did not follow the slices to 9090"
    );
    let a = env.attempts(Proto::Udp, "10.96.0.10:53", 20);
    assert_all_ok("UDP on the new target port", &a);
    assert!(a.iter().all(|x| x.backend_port == Some(9090)), "{a:?}");

    // The Service port changes 80 -> 81: the old port is refused (a live
    // VIP on a port it does not serve), the new one served.
    let web81 = Service::new("demo", "web")
        .cluster_ip(VIP)
        .port("http", 81, "TCP", json!("web"))
        .port("dns", 53, "UDP", json!("web"));
    apply(&api, &[web81.to_value()]);
    until_backends(&env, "port 81", "10.96.0.10:81", &["b1", "b3"]);
    until_error(&env, "old port 80", "10.96.0.10:80", "ECONNREFUSED");

    // The other proxy lets go of its Service: now it is ours.
    apply(&api, &[http_service("theirs", "10.96.0.12").to_value()]);
    until_backends(&env, "label removed", "10.96.0.12:80", &["b1"]);

    // Deleted: one slice, then all, then the Service.
    api.delete(Kind::EndpointSlice, "demo", "web-2").unwrap();
    until_backends(&env, "slice web-2 deleted", "10.96.0.10:81", &["b3"]);
    api.delete(Kind::EndpointSlice, "demo", "web-1").unwrap();
    until_error(&env, "no slices left", "10.96.0.10:81", "ECONNREFUSED");
    api.delete(Kind::Service, "demo", "web").unwrap();
    until_error(&env, "Service deleted", "10.96.0.10:81", "ENETUNREACH");
    assert_all_ok("the other Service", &env.tcp("10.96.0.12:80", 10));
}

#[test]
fn metrics_of_a_cluster_mode_agent() {
    require_root!();
    let (api, mut env) = api_and_env("clmet", 2);
    start_with(
        &api,
        &[
            web_service().to_value(),
            ready_slice(
                &env,
                "web",
                "web-1",
                &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
                &["b1", "b2"],
            ),
            // Rejected: not an IP.
            http_service("bad", "10.96.0.999").to_value(),
        ],
        &mut env,
    );
    assert_all_ok("TCP", &env.tcp("10.96.0.10:80", 10));
    let m = metrics(&env);
    eprintln!("/metrics:\n{m}");
    for name in [
        "lb_sync_duration_seconds_count",
        "lb_last_successful_sync_timestamp_seconds",
        "lb_frontends_programmed",
        "lb_backends_programmed",
        "lb_map_fill_ratio{map=\"LB_SERVICES\"}",
        "lb_map_fill_ratio{map=\"LB_BACKENDS\"}",
        "lb_map_fill_ratio{map=\"LB_SLOTS\"}",
    ] {
        assert!(metric(&m, name).is_some(), "{name} missing from /metrics");
    }
    assert!(metric(&m, "lb_sync_duration_seconds_count").unwrap() >= 1.0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let last = metric(&m, "lb_last_successful_sync_timestamp_seconds").unwrap();
    assert!((now - last).abs() < 60.0, "last sync {last}, now {now}");
    // 80/TCP and 53/UDP; two backend addresses, each TCP and UDP.
    assert_eq!(metric(&m, "lb_frontends_programmed"), Some(2.0));
    assert_eq!(metric(&m, "lb_backends_programmed"), Some(4.0));
    assert!(metric(&m, "lb_map_fill_ratio{map=\"LB_SERVICES\"}").unwrap() > 0.0);
    assert!(
        metric_sum(&m, "lb_objects_rejected") >= 1.0,
        "the bad Service is not counted in lb_objects_rejected"
    );
    // Exposed from the start, at zero.
    for kind in ["Service", "EndpointSlice", "Node"] {
        let v = metric(&m, &format!("lb_watch_restarts_total{{kind=\"{kind}\"}}"));
        assert_eq!(
            v,
            Some(0.0),
            "lb_watch_restarts_total of {kind} before any restart"
        );
    }

    // A watch expiry is a restart, counted per kind.
    api.expire_watches();
    assert!(
        wait_until(POLL, Duration::from_millis(50), || {
            metric_sum(&metrics(&env), "lb_watch_restarts_total") >= 3.0
        }),
        "lb_watch_restarts_total did not count the relists:\n{}",
        metrics(&env)
    );
    let m = metrics(&env);
    for kind in ["Service", "EndpointSlice", "Node"] {
        let v = metric(&m, &format!("lb_watch_restarts_total{{kind=\"{kind}\"}}"));
        assert!(v >= Some(1.0), "{kind}: {v:?}");
    }
}

#[test]
fn watch_expiry_compaction_dropped_connections_and_slowness() {
    require_root!();
    let (api, mut env) = api_and_env("clwatch", 3);
    let ports = [("http", 8080, "TCP")];
    let svc = |name: &str, ip: &str| http_service(name, ip).to_value();
    start_with(
        &api,
        &[
            svc("a", "10.96.0.10"),
            ready_slice(&env, "a", "a-1", &ports, &["b1", "b2"]),
            svc("b", "10.96.0.11"),
            ready_slice(&env, "b", "b-1", &ports, &["b3"]),
        ],
        &mut env,
    );
    until_backends(&env, "start", "10.96.0.10:80", &["b1", "b2"]);
    until_backends(&env, "start", "10.96.0.11:80", &["b3"]);
    let restarts = || metric_sum(&metrics(&env), "lb_watch_restarts_total");
    let lists = |k| api.list_count(k);

    // 0. A relist that finds nothing new rewrites nothing: the full
    // reconcile leaves good entries untouched.
    let synced = |env: &Env| -> Vec<String> {
        env.agent()
            .log()
            .lines()
            .filter(|l| l.contains(" synced"))
            .map(str::to_string)
            .collect()
    };
    let n0 = synced(&env).len();
    let listed: Vec<u64> = Kind::ALL.iter().map(|k| lists(*k)).collect();
    api.expire_watches();
    assert!(
        wait_until(POLL, Duration::from_millis(50), || {
            Kind::ALL.iter().zip(&listed).all(|(k, n)| lists(*k) > *n) && synced(&env).len() > n0
        }),
        "no relist and sync after expire_watches"
    );
    // Let the syncs of the three relists (each debounced) land.
    std::thread::sleep(Duration::from_millis(400));
    let after_relist = synced(&env)[n0..].to_vec();
    eprintln!(
        "syncs after a relist without changes:\n{}",
        after_relist.join("\n")
    );
    for l in &after_relist {
        for field in [" written=0", " removed=0", " backends_written=0"] {
            assert!(
                l.contains(field),
                "a relist without changes rewrote entries: {l}"
            );
        }
    }

    // 1. 410 inside the watch streams: relist, and a change made right
    // after is still applied.
    let before = lists(Kind::Service);
    api.expire_watches();
    apply(
        &api,
        &[ready_slice(&env, "a", "a-1", &ports, &["b1", "b2", "b3"])],
    );
    until_backends(&env, "after 410", "10.96.0.10:80", &["b1", "b2", "b3"]);
    assert!(
        wait_until(POLL, Duration::from_millis(50), || lists(Kind::Service)
            > before),
        "no relist after expire_watches"
    );
    let r1 = restarts();
    assert!(r1 >= 1.0, "lb_watch_restarts_total {r1}");

    // 2. Connections dropped mid-stream: a re-watch from the last version
    // replays what happened meanwhile.
    api.drop_connections();
    apply(&api, &[ready_slice(&env, "a", "a-1", &ports, &["b1"])]);
    until_backends(&env, "after dropped connections", "10.96.0.10:80", &["b1"]);

    // 3. Broken watch, history compacted, objects deleted meanwhile, slow
    // responses: the re-watch gets 410, the relist (slow) no longer has b,
    // and the full reconcile removes it.
    api.set_delay(Duration::from_millis(700));
    api.drop_connections();
    api.delete(Kind::Service, "demo", "b").unwrap();
    api.delete(Kind::EndpointSlice, "demo", "b-1").unwrap();
    apply(&api, &[ready_slice(&env, "a", "a-1", &ports, &["b2"])]);
    api.compact();
    // Meanwhile, the last good state keeps serving.
    assert_all_ok("a while the watch is broken", &env.tcp("10.96.0.10:80", 5));
    until_error(
        &env,
        "b deleted while the watch was broken",
        "10.96.0.11:80",
        "ENETUNREACH",
    );
    until_backends(&env, "after the relist", "10.96.0.10:80", &["b2"]);
    assert!(
        wait_until(POLL, Duration::from_millis(50), || restarts() > r1),
        "lb_watch_restarts_total did not go up after the compaction ({r1})"
    );
    api.set_delay(Duration::ZERO);
    let expired: u64 = Kind::ALL.iter().map(|k| api.stats(*k).expired).sum();
    eprintln!(
        "410s sent: {expired}; lists: services {}, slices {}; watch restarts {}",
        lists(Kind::Service),
        lists(Kind::EndpointSlice),
        restarts()
    );
    assert!(
        expired >= 2,
        "the compaction did not make a re-watch expire"
    );
    assert!(env.agent().is_running());
}

#[test]
fn api_server_outage_loses_nothing() {
    require_root!();
    let (api, mut env) = api_and_env("clgone", 3);
    let ports = [("http", 8080, "TCP")];
    start_with(
        &api,
        &[
            web_service().to_value(),
            ready_slice(&env, "web", "web-1", &ports, &["b1", "b2"]),
            http_service("old", "10.96.0.11").to_value(),
            ready_slice(&env, "old", "old-1", &ports, &["b1"]),
        ],
        &mut env,
    );
    until_backends(&env, "start", "10.96.0.10:80", &["b1", "b2"]);

    api.go_away();
    // Changes while the API server is away (the store behind it changes;
    // nobody can watch it).
    apply(
        &api,
        &[
            ready_slice(&env, "web", "web-1", &ports, &["b3"]),
            http_service("new", "10.96.0.12").to_value(),
            ready_slice(&env, "new", "new-1", &ports, &["b2"]),
        ],
    );
    api.delete(Kind::Service, "demo", "old").unwrap();
    // The last good state keeps serving throughout the outage.
    let mut during = Vec::new();
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        during.extend(env.tcp("10.96.0.10:80", 10));
        during.extend(env.tcp("10.96.0.11:80", 2));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_all_ok("during the outage", &during);
    let s = Spread::of(&during);
    eprintln!("during the outage:\n{s}");
    assert_eq!(s.count("b3"), 0, "changed before the API came back?");
    assert!(
        env.agent().is_running(),
        "the agent died with the API server"
    );
    assert_eq!(env.agent().get("/readyz").unwrap().0, 200);

    api.come_back();
    until_backends(&env, "after the outage", "10.96.0.10:80", &["b3"]);
    until_backends(&env, "created during the outage", "10.96.0.12:80", &["b2"]);
    until_error(
        &env,
        "deleted during the outage",
        "10.96.0.11:80",
        "ENETUNREACH",
    );
    let m = metrics(&env);
    eprintln!(
        "watch errors during the outage: {}",
        metric_sum(&m, "lb_watch_errors_total")
    );
    assert!(metric_sum(&m, "lb_watch_errors_total") >= 1.0);
}

#[test]
fn terminating_endpoints_serve_until_a_ready_one_appears() {
    require_root!();
    let (api, mut env) = api_and_env("clkep", 3);
    let ports = [("http", 8080, "TCP")];
    let b = |h: &str| -> std::net::IpAddr {
        integration_tests::netns::pod_v4(h[1..].parse().unwrap()).into()
    };
    // b1 and b2 serving and terminating; b3 neither ready nor serving.
    let s = ready_slice(&env, "web", "web-1", &ports, &["b1", "b2", "b3"]);
    let s = with_conditions(s, &[b("b1"), b("b2")], false, true, true);
    let s = with_conditions(s, &[b("b3")], false, false, true);
    start_with(&api, &[web_service().to_value(), s], &mut env);
    let a = env.tcp("10.96.0.10:80", 80);
    assert_all_ok("only serving-terminating endpoints", &a);
    assert_spread(
        "only serving-terminating endpoints",
        &a,
        &["b1", "b2"],
        0.25,
    );

    // A ready endpoint appears: only it gets new connections.
    let s = ready_slice(&env, "web", "web-1", &ports, &["b1", "b2", "b3"]);
    let s = with_conditions(s, &[b("b1"), b("b2")], false, true, true);
    apply(&api, &[web_service().to_value(), s]);
    until_backends(&env, "a ready endpoint", "10.96.0.10:80", &["b3"]);
    let a = env.tcp("10.96.0.10:80", 60);
    assert_all_ok("with a ready endpoint", &a);
    assert_eq!(Spread::of(&a).count("b3"), 60);

    // It goes away: back to the terminating ones.
    let s = ready_slice(&env, "web", "web-1", &ports, &["b1", "b2"]);
    let s = with_conditions(s, &[b("b1"), b("b2")], false, true, true);
    apply(&api, &[s]);
    until_backends(&env, "ready one gone", "10.96.0.10:80", &["b1", "b2"]);
}

#[test]
fn connected_udp_socket_to_a_departed_backend_is_destroyed() {
    require_root!();
    let (api, mut env) = api_and_env("cludp", 3);
    let ports = [("dns", 8080, "UDP")];
    start_with(
        &api,
        &[
            dns_service("Cluster"),
            ready_slice(&env, "dns", "dns-1", &ports, &["b1", "b2", "b3"]),
        ],
        &mut env,
    );

    let probe = integration_tests::cluster::hold_udp(&env, "10.96.0.53:53", 100, 30_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    // The socket's backend, from a few replies.
    let mut first = None;
    for _ in 0..3 {
        let a = next();
        assert!(a.ok, "before the change: {a:?}");
        assert_eq!(a.source_addr(), Some(sa("10.96.0.53:53")), "{a:?}");
        let b = a.backend.clone().unwrap();
        assert!(
            first.get_or_insert(b.clone()) == &b,
            "a connected socket changed backend"
        );
    }
    let gone = first.unwrap();
    let rest: Vec<&str> = ["b1", "b2", "b3"]
        .into_iter()
        .filter(|b| *b != gone)
        .collect();
    eprintln!("the socket talks to {gone}; removing it from the Service");
    // The backend leaves the Service (its pod still answers, as a
    // terminating pod would: without the destroy the socket would keep
    // talking to it).
    apply(&api, &[ready_slice(&env, "dns", "dns-1", &ports, &rest)]);
    let (aborted, replies) = probe
        .until_error(100)
        .unwrap_or_else(|e| panic!("the socket was not destroyed after its backend left: {e:#}"));
    eprintln!(
        "after {} more replies from {gone}: {aborted:?}",
        replies.len()
    );
    assert_destroyed("the socket whose backend left", &aborted);
    // The reconnected socket reaches a live backend, and stays there.
    let mut after = None;
    for _ in 0..5 {
        let a = next();
        assert!(a.ok, "after the reconnect: {a:?}");
        let b = a.backend.clone().unwrap();
        assert!(rest.contains(&b.as_str()), "reconnected to {b}, which left");
        assert!(after.get_or_insert(b.clone()) == &b);
    }
    let after = after.unwrap();
    eprintln!("reconnected to {after}");
    let m = metrics(&env);
    assert!(
        metric(&m, "lb_udp_sockets_destroyed_total") >= Some(1.0),
        "{m}"
    );
    // The whole Service goes. kube-proxy leaves the flows of a deleted
    // Service alone (`CleanStaleEntries` only looks at Service ports that
    // exist), and so does the agent: the socket keeps its backend, which
    // still answers, while a new connect finds no Service.
    api.delete(Kind::Service, "demo", "dns").unwrap();
    let gone = wait_until(POLL, Duration::from_millis(50), || {
        env.attempts(Proto::UdpConnected, "10.96.0.53:53", 1)
            .iter()
            .all(|a| a.error.as_deref() == Some("ENETUNREACH"))
    });
    assert!(gone, "the deleted Service is still served");
    for _ in 0..10 {
        let a = next();
        assert!(a.ok, "after the Service was deleted: {a:?}");
        assert_eq!(a.backend.as_deref(), Some(after.as_str()), "{a:?}");
    }
}

/// `demo/dns` at 10.96.0.53, `dns` 53/UDP to 8080, with
/// `internalTrafficPolicy: policy`.
fn dns_service(policy: &str) -> Value {
    let mut svc = Service::new("demo", "dns")
        .cluster_ip("10.96.0.53")
        .port("dns", 53, "UDP", json!(8080))
        .to_value();
    svc["spec"]["internalTrafficPolicy"] = json!(policy);
    svc
}

#[test]
fn connected_udp_socket_keeps_a_backend_a_traffic_policy_excludes_while_it_serves() {
    require_root!();
    // kube-proxy's rule: a UDP flow is cleared when its endpoint stops
    // serving, not when a traffic policy or topology stops choosing it.
    let (api, mut env) = api_and_env("cludpitp", 2);
    // b1 runs on the agent's node (node-1), b2 on another.
    let slice = |env: &Env, hosts: &[&str]| {
        EndpointSlice::new("demo", "dns-1", "dns")
            .port("dns", 8080, "UDP")
            .endpoints(hosts.iter().map(|h| Endpoint {
                node_name: Some(if *h == "b1" { "node-1" } else { "node-2" }.into()),
                ..Endpoint::ready(env.topo.host(h).ipv4.into())
            }))
            .to_value()
    };
    start_with(
        &api,
        &[dns_service("Cluster"), slice(&env, &["b2"])],
        &mut env,
    );
    let probe = integration_tests::cluster::hold_udp(&env, "10.96.0.53:53", 100, 60_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    let a = next();
    assert_eq!(a.backend.as_deref(), Some("b2"), "{a:?}");

    // internalTrafficPolicy: Local, and b1 here: new connects go to b1
    // only, while b2 still serves the Service.
    apply(&api, &[dns_service("Local"), slice(&env, &["b1", "b2"])]);
    let local = wait_until(POLL, Duration::from_millis(50), || {
        env.attempts(Proto::UdpConnected, "10.96.0.53:53", 5)
            .iter()
            .all(|a| a.backend.as_deref() == Some("b1"))
    });
    assert!(local, "internalTrafficPolicy: Local was not applied");
    // The held socket keeps its backend and works on.
    for _ in 0..20 {
        let a = next();
        assert!(
            a.ok,
            "the socket to b2 broke when only the policy changed: {a:?}"
        );
        assert_eq!(a.backend.as_deref(), Some("b2"), "{a:?}");
    }
    assert_eq!(
        metric(&metrics(&env), "lb_udp_sockets_destroyed_total"),
        Some(0.0)
    );

    // b2 leaves the Service: now the socket is stale, and the reconnect
    // lands on b1, the one the policy selects.
    apply(&api, &[slice(&env, &["b1"])]);
    let (aborted, _) = probe
        .until_error(100)
        .unwrap_or_else(|e| panic!("the socket was not destroyed after b2 left: {e:#}"));
    assert_destroyed("the stale socket", &aborted);
    let a = next();
    assert_eq!(a.backend.as_deref(), Some("b1"), "{a:?}");
}

#[test]
fn connected_udp_socket_is_destroyed_without_its_lb_rev_sock_entry() {
    require_root!();
    let (api, mut env) = api_and_env("cludprev", 3);
    let ports = [("dns", 8080, "UDP")];
    start_with(
        &api,
        &[
            dns_service("Cluster"),
            ready_slice(&env, "dns", "dns-1", &ports, &["b1", "b2", "b3"]),
        ],
        &mut env,
    );
    let probe = integration_tests::cluster::hold_udp(&env, "10.96.0.53:53", 100, 30_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    let a = next();
    assert!(a.ok, "{a:?}");
    let gone = a.backend.unwrap();
    // The socket's entry goes, as the LRU would evict it under load.
    let cleared = env.agent().clear_map("LB_REV_SOCK").unwrap();
    assert!(cleared >= 1, "no LB_REV_SOCK entry to delete");
    let a = next();
    assert_eq!(a.backend.as_deref(), Some(gone.as_str()), "{a:?}");

    let rest: Vec<&str> = ["b1", "b2", "b3"]
        .into_iter()
        .filter(|b| *b != gone)
        .collect();
    apply(&api, &[ready_slice(&env, "dns", "dns-1", &ports, &rest)]);
    let (aborted, _) = probe.until_error(100).unwrap_or_else(|e| {
        panic!("the socket to {gone}, whose LB_REV_SOCK entry was gone, was not destroyed: {e:#}")
    });
    assert_destroyed("the stale socket", &aborted);
    let a = next();
    assert!(a.ok, "after the reconnect: {a:?}");
    assert!(rest.contains(&a.backend.as_deref().unwrap()), "{a:?}");
}

#[test]
fn udp_socket_connected_to_the_vip_before_the_service_is_destroyed_once_it_serves() {
    require_root!();
    let (api, mut env) = api_and_env("cludpvip", 2);
    start_with(&api, &[], &mut env);
    // Without a Service, the hook leaves a connect to 10.96.0.53 alone.
    // A route lets it succeed (as on a node with a route for the Service
    // CIDR): to a veth pair whose both ends are in the client's namespace,
    // with a static neighbour, so that the datagrams end at the other end
    // (addressed to another MAC) without an ARP failure's ICMP error.
    for cmd in [
        &[
            "ip", "link", "add", "vip0", "type", "veth", "peer", "name", "vip1",
        ][..],
        &["ip", "link", "set", "vip0", "up"],
        &["ip", "link", "set", "vip1", "up"],
        &["ip", "route", "add", "10.96.0.53/32", "dev", "vip0"],
        &[
            "ip",
            "neigh",
            "add",
            "10.96.0.53",
            "lladdr",
            "02:00:00:00:00:53",
            "dev",
            "vip0",
            "nud",
            "permanent",
        ],
    ] {
        env.topo.exec("client", cmd).unwrap();
    }
    let probe = integration_tests::cluster::hold_udp(&env, "10.96.0.53:53", 100, 30_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    let a = next();
    assert_eq!(
        (a.stage.as_deref(), a.error.as_deref()),
        (Some("recv"), Some("ETIMEDOUT")),
        "connected around the hook, unanswered: {a:?}"
    );

    let ports = [("dns", 8080, "UDP")];
    apply(
        &api,
        &[
            dns_service("Cluster"),
            ready_slice(&env, "dns", "dns-1", &ports, &["b1", "b2"]),
        ],
    );
    // Unanswered until the agent destroys the socket; then the reconnect
    // goes through the hook to a backend.
    let mut unanswered = 0;
    let aborted = loop {
        let a = next();
        match a.error.as_deref() {
            Some("ETIMEDOUT") if unanswered < 100 => unanswered += 1,
            _ => break a,
        }
    };
    assert_destroyed(
        "the socket connected before the Service was not destroyed",
        &aborted,
    );
    let a = next();
    assert!(a.ok, "after the reconnect: {a:?}");
    assert!(
        ["b1", "b2"].contains(&a.backend.as_deref().unwrap()),
        "{a:?}"
    );
    assert_eq!(a.peer_addr(), Some(sa("10.96.0.53:53")), "{a:?}");
}

#[test]
fn backend_sets_change_atomically_under_load() {
    require_root!();
    // Connects in a loop while the API flips each Service between backend
    // sets every 100 ms: a connect that met a half-written set would be
    // refused or go nowhere. One random Service, one Maglev.
    let (api, mut env) = api_and_env("clchurn", 4);
    let ports = [("http", 8080, "TCP"), ("dns", 8080, "UDP")];
    let svc = |name: &str, ip: &str| {
        Service::new("demo", name)
            .cluster_ip(ip)
            .port("http", 80, "TCP", json!(8080))
            .port("dns", 53, "UDP", json!(8080))
            .to_value()
    };
    let sets: [&[&str]; 4] = [&["b1", "b2"], &["b2", "b3", "b4"], &["b4"], &["b1", "b3"]];
    start_with(
        &api,
        &[
            svc("rand", "10.96.0.10"),
            ready_slice(&env, "rand", "rand-1", &ports, sets[0]),
            integration_tests::cluster::with_maglev(svc("mag", "10.96.0.11")),
            ready_slice(&env, "mag", "mag-1", &ports, sets[0]),
        ],
        &mut env,
    );
    use integration_tests::cluster::paced_client;
    let clients = [
        paced_client(&env, Proto::Tcp, "10.96.0.10:80", 1500, 2000).unwrap(),
        paced_client(&env, Proto::Tcp, "10.96.0.11:80", 1500, 2000).unwrap(),
        paced_client(&env, Proto::Udp, "10.96.0.10:53", 1500, 2000).unwrap(),
        paced_client(&env, Proto::Udp, "10.96.0.11:53", 1500, 2000).unwrap(),
    ];
    let t = std::time::Instant::now();
    let mut flips = 0;
    while t.elapsed() < Duration::from_millis(2800) {
        flips += 1;
        let set = sets[flips % sets.len()];
        apply(
            &api,
            &[
                ready_slice(&env, "rand", "rand-1", &ports, set),
                ready_slice(&env, "mag", "mag-1", &ports, set),
            ],
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for (c, what) in
        clients
            .into_iter()
            .zip(["random TCP", "Maglev TCP", "random UDP", "Maglev UDP"])
    {
        let a = c.join().expect("client");
        eprintln!(
            "{what} during {flips} backend-set flips:\n{}",
            Spread::of(&a)
        );
        assert_all_ok(&format!("{what} during backend-set flips"), &a);
    }
    let log = env.agent().log();
    let syncs = log.lines().filter(|l| l.contains(" synced")).count();
    eprintln!("{syncs} syncs for {flips} flips");
    assert!(syncs >= 5, "the flips were not applied one by one:\n{log}");
}

#[test]
fn connected_udp6_socket_to_a_departed_backend_is_destroyed() {
    require_root!();
    let (api, mut env) = api_and_env("cludp6", 2);
    let slice6 = |env: &Env, hosts: &[&str]| {
        EndpointSlice::new("demo", "dns6-1", "dns6")
            .address_type("IPv6")
            .port("dns", 8080, "UDP")
            .endpoints(
                hosts
                    .iter()
                    .map(|h| Endpoint::ready(env.topo.host(h).ipv6.into())),
            )
            .to_value()
    };
    start_with(
        &api,
        &[
            Service::new("demo", "dns6")
                .cluster_ip("fd00:96::53")
                .port("dns", 53, "UDP", json!(8080))
                .to_value(),
            slice6(&env, &["b1", "b2"]),
        ],
        &mut env,
    );
    let probe =
        integration_tests::cluster::hold_udp(&env, "[fd00:96::53]:53", 100, 30_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    let a = next();
    assert!(a.ok, "{a:?}");
    assert_eq!(a.peer_addr(), Some(sa("[fd00:96::53]:53")), "{a:?}");
    let gone = a.backend.clone().unwrap();
    let stay = if gone == "b1" { "b2" } else { "b1" };
    apply(&api, &[slice6(&env, &[stay])]);
    let (err, _) = probe
        .until_error(100)
        .unwrap_or_else(|e| panic!("the IPv6 socket was not destroyed: {e:#}"));
    eprintln!("IPv6: {gone} left: {err:?}");
    assert_eq!(err.error.as_deref(), Some("ECONNABORTED"), "{err:?}");
    let a = next();
    assert_eq!(a.backend.as_deref(), Some(stay), "{a:?}");
}

#[test]
fn a_large_list_is_programmed_whole_and_relisted_without_rewrites() {
    require_root!();
    let (api, mut env) = api_and_env("cllarge", 2);
    const N: usize = 1200;
    let vip = |i: usize| format!("10.96.{}.{}", 10 + i / 250, 1 + i % 250);
    for i in 0..N {
        let name = format!("s{i}");
        apply(
            &api,
            &[
                Service::new("demo", &name)
                    .cluster_ip(&vip(i))
                    .port("http", 80, "TCP", json!(8080))
                    .to_value(),
                ready_slice(
                    &env,
                    &name,
                    &format!("{name}-1"),
                    &[("http", 8080, "TCP")],
                    if i % 2 == 0 { &["b1"] } else { &["b2"] },
                ),
            ],
        );
    }
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    let paged = api
        .requests()
        .iter()
        .filter(|r| r.contains("limit=") && !r.contains("watch=true"))
        .count();
    eprintln!("{paged} LIST requests with a limit for {} objects", 2 * N);
    let m = metrics(&env);
    assert_eq!(metric(&m, "lb_frontends_programmed"), Some(N as f64));
    for i in [0, 1, N / 2, N - 2, N - 1] {
        let want = if i % 2 == 0 { "b1" } else { "b2" };
        let a = env.tcp(&format!("{}:80", vip(i)), 3);
        assert_all_ok(&vip(i), &a);
        assert_eq!(Spread::of(&a).count(want), 3, "{}: {a:?}", vip(i));
    }
    // A relist of all of it changes nothing.
    let before = metric(&m, "lb_sync_duration_seconds_count").unwrap();
    api.expire_watches();
    assert!(
        wait_until(POLL, Duration::from_millis(50), || {
            metric(&metrics(&env), "lb_sync_duration_seconds_count").unwrap() > before
                && metric_sum(&metrics(&env), "lb_watch_restarts_total") >= 2.0
        }),
        "no sync after the relist"
    );
    std::thread::sleep(Duration::from_millis(300));
    let log = env.agent().log();
    let last = log.lines().rfind(|l| l.contains(" synced")).unwrap();
    eprintln!("after the relist: {last}");
    assert!(
        last.contains(" written=0") && last.contains(" removed=0"),
        "{last}"
    );
    assert_eq!(
        metric(&metrics(&env), "lb_frontends_programmed"),
        Some(N as f64)
    );
}
