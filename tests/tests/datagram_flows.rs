//! Unconnected UDP on the socket path: the datagrams of one socket to one
//! frontend keep their backend (`LB_DGRAM_FLOWS`) while it stays in the
//! Service and the socket keeps sending within `--conntrack-udp-timeout`,
//! as kube-proxy's conntrack pins such a flow.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{
    cluster::{flows, frontend_backends, ready_slice},
    require_root, wait_until, AgentOpts, Env,
};
use serde_json::Value;

const TARGET: &str = "10.96.0.10:53";

fn web_on(env: &Env, hosts: &[&str]) -> Vec<Value> {
    vec![
        web_service().to_value(),
        ready_slice(env, "web", "web-abcde", &WEB_PORTS, hosts),
    ]
}

/// `Env::new(tag, backends)` serving `web_on(hosts)`, the agent started
/// with `args`.
fn env_with(tag: &str, backends: u8, hosts: &[&str], args: &[&str]) -> Env {
    let mut env = Env::new(tag, backends).unwrap();
    env.manifests
        .write("web.yaml", &web_on(&env, hosts))
        .unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    env
}

/// The backend addresses (`IP:PORT`) of the UDP frontend, once it has them.
fn udp_backends(env: &Env) -> Vec<String> {
    frontend_backends(env.agent(), "10.96.0.10", 53, Some("UDP"))
        .unwrap()
        .unwrap_or_default()
}

fn backend_addr(env: &Env, host: &str) -> String {
    format!("{}:8080", env.topo.host(host).ipv4)
}

/// `lb-agent inspect datagram-flows --json`.
fn datagram_flows(env: &Env) -> Vec<Value> {
    env.agent().inspect_datagram_flows().unwrap()
}

#[test]
fn a_socket_keeps_its_backend_until_that_backend_leaves() {
    require_root!();
    let hosts = ["b1", "b2", "b3"];
    let env = env_with("dgleave", 3, &hosts, &[]);
    let mut f = flows(&env, TARGET, 24).unwrap();
    let before = backend_per_socket("before", &flow_rounds(&mut f, 6));
    let spread = sockets_per_backend(&before);
    assert!(spread.len() >= 2, "the sockets do not spread: {spread:?}");

    // The record of each socket, with the backend it answered from.
    let records = datagram_flows(&env);
    assert_eq!(records.len(), 24, "one record per socket: {records:#?}");
    for r in &records {
        assert_eq!(r["frontend"], TARGET, "{r}");
    }

    // The Service loses the backend of the first socket.
    let removed = before[0].clone();
    let rest: Vec<&str> = hosts.iter().copied().filter(|h| *h != removed).collect();
    env.manifests
        .write("web.yaml", &web_on(&env, &rest))
        .unwrap();
    let gone = backend_addr(&env, &removed);
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            let b = udp_backends(&env);
            !b.is_empty() && !b.contains(&gone)
        }),
        "{removed} still a backend: {:?}",
        udp_backends(&env)
    );
    // The agent deletes the records of the departed backend right after
    // publishing the new set (the backend still answers: only the records
    // stand between its sockets and it).
    let mut left = Vec::new();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            left = datagram_flows(&env)
                .into_iter()
                .filter(|r| r["backend"] == gone.as_str())
                .collect();
            left.is_empty()
        }),
        "records of {gone} left: {left:#?}"
    );

    let after = backend_per_socket("after", &flow_rounds(&mut f, 6));
    for (s, (was, is)) in before.iter().zip(&after).enumerate() {
        if *was == removed {
            assert_ne!(is, &removed, "socket {s} still on {removed}");
        } else {
            assert_eq!(is, was, "socket {s} moved although {was} stayed");
        }
    }
}

#[test]
fn a_flow_idle_past_the_udp_timeout_chooses_afresh() {
    require_root!();
    let env = env_with(
        "dgidle",
        3,
        &["b1", "b2", "b3"],
        &["--conntrack-udp-timeout", "1s", "--sweep-interval", "200ms"],
    );
    const SOCKETS: usize = 30;
    let mut f = flows(&env, TARGET, SOCKETS).unwrap();
    let first = backend_per_socket("active", &flow_rounds(&mut f, 5));
    assert_eq!(datagram_flows(&env).len(), SOCKETS);

    // Idle past the timeout: the sweep deletes the records.
    std::thread::sleep(Duration::from_millis(2500));
    let mut records = Vec::new();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            records = datagram_flows(&env);
            records.is_empty()
        }),
        "expired records were not swept: {records:#?}"
    );

    // Each socket chooses again (and sticks to the new choice): with 3
    // backends about 2/3 of them land elsewhere; fewer than a quarter is
    // more than 5 standard deviations off.
    let second = backend_per_socket("active again", &flow_rounds(&mut f, 5));
    let moved = first.iter().zip(&second).filter(|(a, b)| a != b).count();
    eprintln!("after the timeout, {moved} of {SOCKETS} sockets landed on another backend");
    assert!(
        moved > SOCKETS / 4,
        "{moved} of {SOCKETS} sockets chose another backend"
    );
}

#[test]
fn active_flows_never_move_while_the_sweep_runs_and_the_set_changes() {
    require_root!();
    // The sweep every 100 ms, flows idle at most ~200 ms of their 2 s.
    let env = env_with(
        "dgsweep",
        4,
        &["b1", "b2", "b3"],
        &["--conntrack-udp-timeout", "2s", "--sweep-interval", "100ms"],
    );
    let mut f = flows(&env, TARGET, 20).unwrap();
    let mut rounds = Vec::new();
    let mut paced = |f: &mut integration_tests::cluster::Flows, n: usize| {
        for _ in 0..n {
            rounds.extend(flow_rounds(f, 1));
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    paced(&mut f, 10);
    // A backend joins: the frontend gets a new set, and the agent sweeps
    // after publishing it.
    env.manifests
        .write("web.yaml", &web_on(&env, &["b1", "b2", "b3", "b4"]))
        .unwrap();
    let joined = backend_addr(&env, "b4");
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            udp_backends(&env).contains(&joined)
        }),
        "b4 never joined: {:?}",
        udp_backends(&env)
    );
    paced(&mut f, 15);
    let on = backend_per_socket("through sweeps and a set change", &rounds);
    assert!(
        !on.iter().any(|b| b == "b4"),
        "an existing flow moved to the new backend: {on:?}"
    );
    // New sockets do use the new backend.
    let mut fresh = flows(&env, TARGET, 40).unwrap();
    let fresh_on = backend_per_socket("new sockets", &flow_rounds(&mut fresh, 2));
    assert!(
        fresh_on.iter().any(|b| b == "b4"),
        "no new socket reached b4: {:?}",
        sockets_per_backend(&fresh_on)
    );
}
