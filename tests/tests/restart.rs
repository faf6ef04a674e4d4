//! Restarts without disruption: the agent is SIGKILLed while a client
//! connects in a loop, restarted on the same pins, and no connect fails; the
//! restarted agent adopts what is programmed and rewrites only what changed
//! while it was down.
mod common;

use std::time::{Duration, Instant};

use common::*;
use integration_tests::{
    agent::default_ready_timeout,
    apiserver::ApiServer,
    cluster::{paced_client, poll_tcp, ready_slice},
    manifests::Service,
    require_root, AgentOpts, Env, Proto, Spread,
};
use serde_json::{json, Value};

fn slice(env: &Env, service: &str, ports: &[(&str, u16, &str)], hosts: &[&str]) -> Value {
    ready_slice(env, service, &format!("{service}-1"), ports, hosts)
}

/// The slice of `web` (both ports) on `hosts`.
fn web_slice(env: &Env, hosts: &[&str]) -> Value {
    slice(env, "web", &WEB_PORTS, hosts)
}

/// An API server with `web` on `hosts`, and `Env::new(tag, backends)` with
/// an agent watching it.
fn web_cluster(tag: &str, backends: u8, hosts: &[&str]) -> (ApiServer, Env) {
    let (api, mut env) = api_and_env(tag, backends);
    api.apply(&web_service().to_value()).unwrap();
    api.apply(&web_slice(&env, hosts)).unwrap();
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    (api, env)
}

#[test]
fn sigkill_and_restart_fail_no_connect_and_rewrite_only_changes() {
    require_root!();
    let (api, mut env) = api_and_env("restart", 3);
    let svc = |name: &str, ip: &str| http_service(name, ip).to_value();
    for o in [
        web_service().to_value(),
        web_slice(&env, &["b1", "b2", "b3"]),
        svc("api", "10.96.0.11"),
        slice(&env, "api", &[("http", 8080, "TCP")], &["b1"]),
        svc("db", "10.96.0.13"),
        slice(&env, "db", &[("http", 8080, "TCP")], &["b2"]),
    ] {
        api.apply(&o).unwrap();
    }
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    assert_all_ok("before", &env.tcp("10.96.0.10:80", 20));
    assert_all_ok("before", &env.tcp("10.96.0.11:80", 5));

    // Twice: a crash with nothing changed meanwhile, then one with a change.
    // Where starting takes long (LB_TEST_READY_TIMEOUT_S, a VM without
    // KVM), the client is paced slower so that it still runs when the
    // restarted agent is ready: the restart must fall inside its run.
    let slow = (default_ready_timeout().as_secs() / 20).max(1);
    let interval_us = if slow > 1 { 3000 * slow } else { 1500 };
    for round in 0..2 {
        let count = 2000;
        let client = paced_client(&env, Proto::Tcp, "10.96.0.10:80", count, interval_us).unwrap();
        let t = Instant::now();
        // Let the client get going, then crash the agent under it.
        std::thread::sleep(Duration::from_millis(500));
        let agent = env.agent.as_mut().unwrap();
        let offset = agent.log().len();
        let status = agent.kill().unwrap();
        let killed_at = t.elapsed();
        if round == 1 {
            // While the agent is down: api moves from b1 to b3, db goes.
            api.apply(&slice(&env, "api", &[("http", 8080, "TCP")], &["b3"]))
                .unwrap();
            api.delete(integration_tests::apiserver::Kind::Service, "demo", "db")
                .unwrap();
        }
        let agent = env.agent.as_mut().unwrap();
        agent.restart(default_ready_timeout()).unwrap();
        let ready_at = t.elapsed();
        let attempts = client.join().expect("client thread");
        let took = t.elapsed();
        eprintln!(
            "round {round}: agent killed ({status}) at {killed_at:?}, ready again at {ready_at:?}; \
             {count} connects over {took:?}:\n{}",
            Spread::of(&attempts)
        );
        assert_eq!(attempts.len(), count);
        assert_all_ok(
            &format!("round {round}: connects across SIGKILL and restart"),
            &attempts,
        );
        assert!(
            killed_at < took && ready_at < took,
            "the restart was not inside the client's run"
        );

        let log = env.agent().log_since(offset);
        let (written, adopted, removed) = synced_counts(&log)
            .unwrap_or_else(|| panic!("no synced line after the restart:\n{log}"));
        eprintln!(
            "round {round}: first sync after the restart: written={written} adopted={adopted} removed={removed}"
        );
        // Frontends: web 80/TCP and 53/UDP, api 80/TCP, db 80/TCP; in
        // round 1, api rewritten and db removed.
        let want = if round == 1 { (1, 2, 1) } else { (0, 4, 0) };
        assert_eq!(
            (written, adopted, removed),
            want,
            "the restarted agent rewrote more than what changed:\n{log}"
        );
    }
    // The change made while the agent was down is in force.
    let took = poll_tcp(&env, "10.96.0.11:80", 10, Duration::from_secs(5), |s| {
        s.count("b3") == s.total
    })
    .unwrap_or_else(|s| panic!("api is not on b3 after the restart:\n{s}"));
    eprintln!("api on b3 after {took:?}");
    assert_all_fail(
        "db, deleted while the agent was down",
        &env.tcp("10.96.0.13:80", 3),
        "ENETUNREACH",
    );
}

#[test]
fn restart_while_the_api_server_is_away_keeps_the_pinned_state() {
    require_root!();
    let (api, mut env) = web_cluster("restart-away", 3, &["b1", "b2"]);
    assert_all_ok("before", &env.tcp("10.96.0.10:80", 10));

    // The agent crashes, and comes back while the API server is away: it
    // cannot list, so it must leave the adopted maps alone (an early sync
    // from an empty store would delete every Service).
    let moved = web_slice(&env, &["b3"]);
    let agent = env.agent.as_mut().unwrap();
    let offset = agent.log().len();
    agent.kill().unwrap();
    api.go_away();
    api.apply(&moved).unwrap();
    agent.respawn().unwrap();
    let t = Instant::now();
    let mut during = Vec::new();
    while t.elapsed() < Duration::from_secs(2) {
        during.extend(env.tcp("10.96.0.10:80", 10));
        std::thread::sleep(Duration::from_millis(100));
    }
    let agent = env.agent();
    assert!(agent.is_running(), "the agent died:\n{}", agent.log());
    assert_all_ok("restarted without an API server", &during);
    let s = Spread::of(&during);
    eprintln!("restarted while the API server is away:\n{s}");
    assert_eq!(s.count("b3"), 0);
    let (code, _) = agent.get("/readyz").unwrap();
    assert_ne!(code, 200, "ready without having listed the API");
    assert!(
        !agent.log_since(offset).contains(" synced"),
        "synced without the API:\n{}",
        agent.log_since(offset)
    );

    api.come_back();
    agent.wait_ready(default_ready_timeout()).unwrap();
    let took = poll_tcp(&env, "10.96.0.10:80", 10, Duration::from_secs(10), |s| {
        s.count("b3") == s.total
    })
    .unwrap_or_else(|s| panic!("the change made while away was not applied:\n{s}"));
    eprintln!("after the API came back: on b3 after {took:?}");
    let log = agent.log_since(offset);
    let (written, adopted, removed) = synced_counts(&log).expect("a synced line");
    eprintln!("first sync: written={written} adopted={adopted} removed={removed}");
    assert_eq!((written, adopted, removed), (2, 0, 0), "{log}");
}

#[test]
fn udp_sockets_of_backends_that_left_while_the_agent_was_down_are_destroyed() {
    require_root!();
    let (api, mut env) = api_and_env("restart-udp", 3);
    let ports = [("dns", 8080, "UDP")];
    let all = ["b1", "b2", "b3"];
    api.apply(
        &Service::new("demo", "dns")
            .cluster_ip("10.96.0.53")
            .port("dns", 53, "UDP", json!(8080))
            .to_value(),
    )
    .unwrap();
    api.apply(&slice(&env, "dns", &ports, &all)).unwrap();
    env.start_cluster_agent(&api.url(), AgentOpts::default())
        .unwrap();
    let probe = integration_tests::cluster::hold_udp(&env, "10.96.0.53:53", 100, 30_000).unwrap();
    let next = || probe.next_attempt(Duration::from_secs(5)).unwrap();
    let a = next();
    assert!(a.ok, "{a:?}");
    let gone = a.backend.unwrap();
    let rest: Vec<&str> = all.into_iter().filter(|b| *b != gone).collect();

    let agent = env.agent.as_mut().unwrap();
    agent.kill().unwrap();
    api.apply(&slice(&env, "dns", &ports, &rest)).unwrap();
    // Nobody destroys the socket while the agent is down: it keeps its backend.
    for _ in 0..3 {
        let a = next();
        assert_eq!(a.backend.as_deref(), Some(gone.as_str()), "{a:?}");
    }
    env.agent
        .as_mut()
        .unwrap()
        .restart(default_ready_timeout())
        .unwrap();
    let (err, _) = probe.until_error(100).unwrap_or_else(|e| {
        panic!(
            "the socket to {gone} survived the restart: {e:#}\n{}",
            env.agent().log()
        )
    });
    eprintln!("{gone} left while the agent was down; after the restart: {err:?}");
    assert_eq!(err.error.as_deref(), Some("ECONNABORTED"), "{err:?}");
    let a = next();
    assert!(a.ok, "{a:?}");
    assert!(rest.contains(&a.backend.as_deref().unwrap()), "{a:?}");
}

#[test]
fn a_restart_that_recreates_the_maps_fails_no_connect() {
    require_root!();
    // A new version whose maps differ (here: another --max-services) must
    // recreate them, and they start empty: the old programs have to keep
    // serving from the old maps until the new ones are filled.
    let (api, mut env) = web_cluster("restart-layout", 2, &["b1", "b2"]);
    assert_all_ok("before", &env.tcp("10.96.0.10:80", 5));
    let client = paced_client(&env, Proto::Tcp, "10.96.0.10:80", 1500, 1000).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // A slow API server makes the first sync come late.
    api.set_delay(Duration::from_millis(400));
    let agent = env.agent.as_mut().unwrap();
    let offset = agent.log().len();
    agent.kill().unwrap();
    agent.add_args(&["--max-services", "4096"]);
    let t = Instant::now();
    agent.restart(default_ready_timeout()).unwrap();
    eprintln!("upgraded agent ready after {:?}", t.elapsed());
    let attempts = client.join().expect("client");
    eprintln!("connects across the upgrade:\n{}", Spread::of(&attempts));
    let log = env.agent().log_since(offset);
    assert!(
        log.contains("recreated"),
        "the layout change was not reported:\n{log}"
    );
    assert_all_ok(
        "connects across a restart that recreated the maps",
        &attempts,
    );
    api.set_delay(Duration::ZERO);
    assert_all_ok("after", &env.tcp("10.96.0.10:80", 10));
}
