//! Outlier detection on the socket path: a backend whose connects fail
//! (refused with an RST: its server died; or unanswered: its link is
//! down) is quarantined after `--outlier-consecutive-failures` (3) in a
//! row, and new connections avoid it until its time is up. Each backend
//! answers with its name, so a connection's backend is what its server
//! wrote, not what our maps say.
mod common;

use std::{collections::BTreeMap, time::Duration};

use common::*;
use integration_tests::{
    cluster::{metric, with_annotation, HeldTcp},
    probe::{Attempt, Spread},
    require_root, wait_until, AgentOpts, Env,
};
use serde_json::Value;

const TARGET: &str = "10.96.0.10:80";

/// `Env::new(tag, backends)` serving `web` (annotated with `annotations`),
/// the agent started with `args`.
fn env_with(tag: &str, backends: u8, annotations: &[(&str, &str)], args: &[&str]) -> Env {
    let mut env = Env::new(tag, backends).unwrap();
    let mut objects = web(&env);
    for (k, v) in annotations {
        objects[0] = with_annotation(objects[0].clone(), k, v);
    }
    env.manifests.write("web.yaml", &objects).unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    env
}

/// The frontend `VIP:80` of `lb-agent inspect services --json`.
fn web_frontend(env: &Env) -> Value {
    let all = env.agent().inspect_services().unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|f| f["addr"] == VIP && f["port"] == 80)
        .cloned()
        .unwrap_or_else(|| panic!("no frontend {VIP}:80 in {all}"))
}

/// The quarantine of each backend that has one, by address.
fn quarantines(env: &Env) -> BTreeMap<String, Value> {
    web_frontend(env)["backends"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| !b["quarantine"].is_null())
        .map(|b| {
            (
                b["addr"].as_str().unwrap().to_string(),
                b["quarantine"].clone(),
            )
        })
        .collect()
}

fn failures(attempts: &[Attempt]) -> Vec<usize> {
    attempts
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.ok)
        .map(|(i, _)| i)
        .collect()
}

fn b(i: u8) -> String {
    integration_tests::netns::pod_v4(i).to_string()
}

/// `name` in `/metrics`, once it reads `want` (the quarantine watch runs
/// every 250 ms).
fn wait_for_metric(env: &Env, name: &str, want: f64) -> Option<f64> {
    let mut last = None;
    wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        last = env
            .agent()
            .metrics()
            .ok()
            .and_then(|(_, text)| metric(&text, name));
        last == Some(want)
    });
    last
}

#[test]
fn a_refusing_backend_is_quarantined_after_three_failures_and_avoided() {
    require_root!();
    let env = env_with("outl-rst", 3, &[], &[]);
    env.topo.stop_server("b2").unwrap();

    let attempts = env.tcp(TARGET, 120);
    let failed = failures(&attempts);
    eprintln!("120 connects, one backend refusing: failed at {failed:?}");
    assert_eq!(failed.len(), 3, "{failed:?}");
    for i in failed {
        assert_eq!(
            attempts[i].error.as_deref(),
            Some("ECONNREFUSED"),
            "{:?}",
            attempts[i]
        );
    }
    let answered = Spread::of(&attempts);
    assert_eq!(answered.count("b2"), 0, "{answered:?}");
    assert!(
        answered.count("b1") > 20 && answered.count("b3") > 20,
        "{answered:?}"
    );

    let q = quarantines(&env);
    assert_eq!(q.keys().collect::<Vec<_>>(), [&b(2)], "{q:?}");
    let q = &q[&b(2)];
    assert_eq!(q["reason"], "refused", "{q}");
    assert_eq!(q["avoided"], true, "{q}");
    assert_eq!(q["ejections"], 1, "{q}");
    let left = q["left_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 10_000, "{q}");
    assert_eq!(web_frontend(&env)["outlier_detection"], "on");

    assert_eq!(
        wait_for_metric(&env, "lb_backends_quarantined", 1.0),
        Some(1.0)
    );
    let (_, text) = env.agent().metrics().unwrap();
    assert_eq!(
        metric(&text, "lb_outlier_ejections_total{reason=\"refused\"}"),
        Some(1.0),
        "{text}"
    );
    let log = env.agent().log();
    assert!(
        log.contains("backend quarantined by outlier detection") && log.contains("demo/web"),
        "{log}"
    );
}

#[test]
fn lc_sends_nothing_more_to_a_quarantined_backend() {
    require_root!();
    // A refusing backend holds no connection, so lc alone would send it
    // every new one; quarantined, it is passed over and lc balances the
    // others (a substitute drawn at random would not: 60 connections
    // over three backends at random split this evenly in about one run of 70).
    let env = env_with("outl-lc", 4, &[("lb-agent.dev/lb-algorithm", "lc")], &[]);
    env.topo.stop_server("b2").unwrap();

    let held = HeldTcp::open(&env, TARGET, 63).unwrap();
    let failed = held.peers.iter().filter(|p| p.is_err()).count();
    let per = held.per_backend();
    eprintln!("lc, 63 connections held, b2 refusing: {per:?}, {failed} failed");
    assert_eq!(failed, 3, "{:?}", held.peers);
    assert_eq!(per.get("b2"), None, "{per:?}");
    let counts = ["b1", "b3", "b4"].map(|b| per.get(b).copied().unwrap_or(0));
    assert_eq!(counts.iter().sum::<usize>(), 60, "{per:?}");
    let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(max - min <= 1, "lc over the answering backends: {per:?}");
    held.close().unwrap();
}

#[test]
fn a_backend_whose_link_is_down_is_avoided_after_its_timeouts() {
    require_root!();
    let env = env_with("outl-link", 3, &[], &[]);
    env.topo
        .exec("b2", &["ip", "link", "set", "dev", "eth0", "down"])
        .unwrap();

    // The SYN's first retransmission (1 s) is the failure; the client
    // gives up at 1.5 s.
    let attempts = env.client().timeout_ms(1500).run(TARGET, 40).unwrap();
    let failed = failures(&attempts);
    eprintln!("40 connects, one backend's link down: failed at {failed:?}");
    for i in &failed {
        eprintln!("  {:?}", attempts[*i]);
    }
    let (_, text) = env.agent().metrics().unwrap();
    for l in text
        .lines()
        .filter(|l| l.contains("connect_") || l.contains("eject"))
    {
        eprintln!("  {l}");
    }
    // Unanswered SYNs, or the neighbour's resolution failing (ARP gives
    // up after 3 s, and later connects fail at once, host unreachable).
    assert_eq!(failed.len(), 3, "{failed:?}");
    for i in &failed {
        let e = attempts[*i].error.as_deref();
        assert!(
            matches!(e, Some("ETIMEDOUT" | "EHOSTUNREACH")),
            "{:?}",
            attempts[*i]
        );
    }
    let q = quarantines(&env);
    assert_eq!(q.keys().collect::<Vec<_>>(), [&b(2)], "{q:?}");
    let reason = q[&b(2)]["reason"].as_str().unwrap();
    assert!(reason == "timeout" || reason == "unreachable", "{q:?}");
}

#[test]
fn a_server_back_is_chosen_again_after_its_quarantine() {
    require_root!();
    let env = env_with("outl-back", 3, &[], &["--outlier-base-ejection", "1s"]);
    env.topo.stop_server("b2").unwrap();
    let failed = failures(&env.tcp(TARGET, 60));
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert_eq!(quarantines(&env).len(), 1);

    env.topo.serve("b2", "b2", &[8080], false).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
            quarantines(&env).is_empty()
        }),
        "still quarantined: {:?}",
        quarantines(&env)
    );
    let attempts = env.tcp(TARGET, 60);
    assert!(failures(&attempts).is_empty(), "{attempts:?}");
    let answered = Spread::of(&attempts);
    assert!(answered.count("b2") > 5, "b2 chosen again: {answered:?}");
    // The release is reported.
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
            env.agent()
                .log()
                .contains("backend released from quarantine")
        }),
        "{}",
        env.agent().log()
    );
}

#[test]
fn two_refusing_backends_are_never_both_quarantined() {
    require_root!();
    let env = env_with("outl-two", 2, &[], &[]);
    env.topo.stop_server("b1").unwrap();
    env.topo.stop_server("b2").unwrap();

    let attempts = env.tcp(TARGET, 40);
    assert_eq!(failures(&attempts).len(), 40);
    for a in &attempts {
        assert_eq!(a.error.as_deref(), Some("ECONNREFUSED"), "{a:?}");
        assert!(a.elapsed_ms < 500.0, "refused at once: {a:?}");
    }
    let q = quarantines(&env);
    assert_eq!(q.len(), 1, "at most 50% of two backends: {q:?}");
    // The refused quarantine the cap kept from the second (the counters
    // reach /metrics within the quarantine watch's 250 ms).
    let mut capped = None;
    wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        capped = env.agent().metrics().ok().and_then(|(_, text)| {
            metric(&text, "lb_datapath_events_total{event=\"ejection_capped\"}")
        });
        capped.unwrap_or(0.0) > 0.0
    });
    assert!(capped.unwrap_or(0.0) > 0.0, "{capped:?}");
}

#[test]
fn dry_run_reports_and_off_ignores_and_neither_avoids() {
    require_root!();
    for (mode, annotations, args) in [
        ("dry-run", vec![], vec!["--outlier-detection", "dry-run"]),
        ("off", vec![], vec!["--outlier-detection", "off"]),
        (
            "off",
            vec![("lb-agent.dev/outlier-detection", "off")],
            vec![],
        ),
    ] {
        let env = env_with("outl-mode", 3, &annotations, &args);
        env.topo.stop_server("b2").unwrap();
        let failed = failures(&env.tcp(TARGET, 120));
        eprintln!(
            "{mode} ({annotations:?} {args:?}): {} of 120 failed",
            failed.len()
        );
        assert!(failed.len() > 15, "{mode}: b2 still chosen: {failed:?}");
        assert_eq!(web_frontend(&env)["outlier_detection"], mode);
        let q = quarantines(&env);
        if mode == "dry-run" {
            assert_eq!(q.keys().collect::<Vec<_>>(), [&b(2)], "{q:?}");
            assert_eq!(q[&b(2)]["avoided"], false, "{q:?}");
        } else {
            assert!(q.is_empty(), "{mode}: {q:?}");
        }
    }
}
