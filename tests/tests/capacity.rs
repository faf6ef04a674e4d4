//! Many Services, and maps too small for them: every Maglev Service is
//! served however many there are (each table is an array of its own in
//! `LB_MAGLEV`), and a frontend that cannot be programmed is never left
//! half-programmed: its previous state keeps serving, a new one gets
//! nothing (not even its VIP marker), the failure is logged with its
//! Service, counted in `/metrics`, shown by `inspect`, and retried as soon
//! as room is made.
mod common;

use std::{process::Command, time::Duration};

use common::*;
use integration_tests::manifests::Service;
use integration_tests::{
    cluster::{frontend_backends, metric, metric_sum, ready_slice},
    cmd, require_root, wait_until, Agent, AgentOpts, Env,
};
use serde_json::{json, Value};

/// How many entries `LB_MAGLEV` holds: one per Maglev table.
fn maglev_tables(agent: &Agent) -> usize {
    let out = cmd::run(
        Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(agent.pin_dir().join("LB_MAGLEV")),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let entries: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    entries.len()
}

/// `inspect services --json`: the frontends of a Maglev table of `size`
/// positions over 3 backends.
fn frontends_with_tables(agent: &Agent, size: u64) -> usize {
    let v = agent.inspect_services().unwrap_or_else(|e| panic!("{e:#}"));
    v.as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["maglev"]["size"].as_u64() == Some(size)
                && f["maglev"]["positions"].as_object().map(|p| p.len()) == Some(3)
        })
        .count()
}

/// `n` ClusterIP Services `demo/mNNN`, each with port `http` 80/TCP on
/// b1..b3, under `--algorithm maglev` at the default sizes, with the
/// agent started (`ready`: how long it may take); the VIP of each.
fn maglev_services(n: usize, ready: Duration) -> (Env, Vec<String>) {
    let mut env = Env::new("mgscale", 3).unwrap();
    let vips: Vec<String> = (0..n)
        .map(|i| format!("10.96.{}.{}", 1 + i / 250, i % 250 + 1))
        .collect();
    let mut docs = Vec::new();
    for (i, vip) in vips.iter().enumerate() {
        let name = format!("m{i:05}");
        docs.push(http_service(&name, vip).to_value());
        docs.push(ready_slice(
            &env,
            &name,
            &format!("{name}-1"),
            &[("http", 8080, "TCP")],
            &HOSTS,
        ));
    }
    env.manifests.write("many.yaml", &docs).unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: vec!["--algorithm".into(), "maglev".into()],
        ready_timeout: ready,
        ..Default::default()
    })
    .unwrap();
    (env, vips)
}

const HOSTS: [&str; 3] = ["b1", "b2", "b3"];

/// Every Service of `maglev_services` programmed: none unprogrammed, one
/// table each; the first and the last five (created after the ones that
/// used to fill `LB_SLOTS`) served, the last with its table's spread.
fn assert_all_served(env: &Env, vips: &[String]) {
    let agent = env.agent();
    let (_, metrics) = agent.metrics().unwrap();
    assert_eq!(
        metric_sum(&metrics, "lb_frontends_unprogrammed"),
        0.0,
        "{metrics}"
    );
    let n = vips.len();
    for i in [0, n - 5, n - 4, n - 3, n - 2, n - 1] {
        let target = format!("{}:80", vips[i]);
        assert_all_ok(&target, &env.tcp(&target, 10));
    }
    let last = format!("{}:80", vips[n - 1]);
    assert_spread(&last, &env.tcp(&last, 300), &HOSTS, 0.20);
    assert_eq!(frontends_with_tables(agent, 16381), n);
    assert_eq!(maglev_tables(agent), n);
}

/// With the default table size, about 31 Maglev frontends used to fill
/// `LB_SLOTS`; later ones were refused. 250 ClusterIP Services under
/// `--algorithm maglev`, at the default sizes: the last ones created are
/// served like the first, with the table's spread; a restart adopts every
/// table as it is, and one with another table size replaces each
/// (leaving no old table behind).
#[test]
fn every_maglev_service_is_served_at_default_sizes() {
    require_root!();
    const N: usize = 250;
    let (mut env, vips) = maglev_services(N, Duration::from_secs(20));
    assert_all_served(&env, &vips);

    // A restart adopts every table, after reading it back: nothing written.
    let agent = env.agent.as_mut().unwrap();
    agent.stop().unwrap();
    let offset = agent.log().len();
    agent.restart(Duration::from_secs(30)).unwrap();
    let log = agent.log_since(offset);
    assert_eq!(synced_counts(&log), Some((0, N, 0)), "{log}");
    assert_eq!(maglev_tables(agent), N);

    // Another table size: every table differs, and is replaced.
    agent.stop().unwrap();
    let offset = agent.log().len();
    agent.add_args(&["--maglev-table-size", "251"]);
    agent.restart(Duration::from_secs(30)).unwrap();
    let log = agent.log_since(offset);
    assert_eq!(synced_counts(&log), Some((N, 0, 0)), "{log}");
    let agent = env.agent();
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            maglev_tables(agent) == N
        }),
        "{} tables in LB_MAGLEV, {N} frontends",
        maglev_tables(agent)
    );
    assert_eq!(frontends_with_tables(agent, 251), N);
    let last = format!("{}:80", vips[N - 1]);
    assert_all_ok(&last, &env.tcp(&last, 10));
}

/// The figure for real: 10 000 Maglev Services at the default
/// sizes, tables of 16 381 positions (≈ 625 MiB of kernel memory), all
/// programmed and the last ones served. (In seconds: a sync's tables go
/// into `LB_MAGLEV` 256 at a time, since every write to a map of maps waits
/// for an RCU grace period; one by one, this took minutes.)
#[test]
fn ten_thousand_maglev_services_at_default_sizes() {
    require_root!();
    let started = std::time::Instant::now();
    let (env, vips) = maglev_services(10_000, Duration::from_secs(600));
    eprintln!(
        "10 000 Maglev Services programmed in {:?}",
        started.elapsed()
    );
    assert_all_served(&env, &vips);
}

/// `demo/{name}` at `ip`, port `http` 80/TCP, on `hosts`.
fn service(env: &Env, name: &str, ip: &str, hosts: &[&str]) -> Vec<Value> {
    vec![
        http_service(name, ip).to_value(),
        ready_slice(
            env,
            name,
            &format!("{name}-1"),
            &[("http", 8080, "TCP")],
            hosts,
        ),
    ]
}

/// `lb_frontends_unprogrammed{reason="slots_full"}`, 0 when absent.
fn slots_full(agent: &Agent) -> f64 {
    let (_, text) = agent.metrics().unwrap();
    metric(&text, "lb_frontends_unprogrammed{reason=\"slots_full\"}").unwrap_or(0.0)
}

/// The `inspect services --json` entry of `addr`:`port`.
fn inspected(agent: &Agent, addr: &str, port: u16) -> Option<Value> {
    let v = agent.inspect_services().unwrap_or_else(|e| panic!("{e:#}"));
    v.as_array()?
        .iter()
        .find(|f| f["addr"].as_str() == Some(addr) && f["port"].as_u64() == Some(port as u64))
        .cloned()
}

/// In the client's namespace, a route for the Service range to a sink
/// (`lbsink`, one end of a veth pair whose other end is in the same
/// namespace, without addresses: what it is given is counted and
/// dropped there), as a node's default route would take a connect that
/// is not rewritten.
fn route_services_to_a_sink(env: &Env) {
    let ns = env.topo.client_netns();
    cmd::ip(&[
        "-n",
        ns,
        "link",
        "add",
        "lbsink",
        "type",
        "veth",
        "peer",
        "name",
        "lbsink-peer",
    ])
    .unwrap();
    cmd::ip(&["-n", ns, "link", "set", "lbsink", "arp", "off", "up"]).unwrap();
    cmd::ip(&["-n", ns, "link", "set", "lbsink-peer", "up"]).unwrap();
    cmd::ip(&["-n", ns, "route", "add", "10.96.0.0/16", "dev", "lbsink"]).unwrap();
}

/// Packets the client's namespace sent to `lbsink`.
fn sink_packets(env: &Env) -> u64 {
    let out = cmd::ip(&[
        "-n",
        env.topo.client_netns(),
        "-j",
        "-s",
        "link",
        "show",
        "lbsink",
    ])
    .unwrap();
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    v[0]["stats64"]["tx"]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("{out}"))
}

/// A Service port that does not fit `LB_SERVICES` fails closed too:
/// three Services of four ports each (12 frontends, 3 VIP markers) in a
/// map of 11 entries (`--max-services`). Room is kept for the three
/// markers, so 8 ports are served and the other 4 are refused by their
/// VIP's marker, reported full, and send nothing out of the client;
/// before, frontends took every entry and a port left over went out
/// unrewritten.
#[test]
fn a_service_port_that_does_not_fit_the_services_map_is_refused() {
    require_root!();
    let mut env = Env::new("nofit-svc", 1).unwrap();
    let ips: Vec<String> = (0..3).map(|i| format!("10.96.0.{}", 10 + i)).collect();
    let ports: Vec<String> = (0..4).map(|p| format!("p{p}")).collect();
    for (i, ip) in ips.iter().enumerate() {
        let name = format!("s{i}");
        let mut svc = Service::new("demo", &name).cluster_ip(ip);
        for (p, port) in ports.iter().enumerate() {
            svc = svc.port(port, 80 + p as u32, "TCP", json!(8080));
        }
        let slice_ports: Vec<(&str, u16, &str)> =
            ports.iter().map(|p| (p.as_str(), 8080, "TCP")).collect();
        env.manifests
            .write(
                &format!("{name}.yaml"),
                &vec![
                    svc.to_value(),
                    ready_slice(&env, &name, &format!("{name}-1"), &slice_ports, &["b1"]),
                ],
            )
            .unwrap();
    }
    env.start_agent_with(AgentOpts {
        extra_args: vec!["--max-services".into(), "11".into()],
        ..Default::default()
    })
    .unwrap();
    route_services_to_a_sink(&env);
    let agent = env.agent();
    let mut full = None;
    wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        let (_, text) = agent.metrics().unwrap();
        full = metric(&text, "lb_frontends_unprogrammed{reason=\"services_full\"}");
        full == Some(4.0)
    });
    assert_eq!(full, Some(4.0), "{}", agent.metrics().unwrap().1);
    let sent_before = sink_packets(&env);
    let (mut served, mut refused) = (0, 0);
    for ip in &ips {
        for p in 0..4u16 {
            let target = format!("{ip}:{}", 80 + p);
            let a = env.tcp(&target, 2);
            if a.iter().all(|a| a.ok) {
                served += 1;
                continue;
            }
            for a in &a {
                assert!(
                    !a.ok && matches!(a.error.as_deref(), Some("ECONNREFUSED" | "EPERM")),
                    "{target}: served or refused, got {a:?}"
                );
                assert!(a.elapsed_ms < 500.0, "refused at once: {a:?}");
            }
            refused += 1;
        }
    }
    assert_eq!((served, refused), (8, 4));
    assert_eq!(sink_packets(&env), sent_before, "connects left unrewritten");
}

/// `LB_SLOTS` of 6 entries (`--max-slots`): a new Service that does not
/// fit gets nothing but its VIP marker, which refuses it; an existing Service changed
/// so that it no longer fits keeps serving from its old backends; both are
/// logged with their Service, counted in `/metrics` and shown by
/// `inspect`; when a Service goes, its slots are freed a moment later and
/// both are programmed then, without waiting for the periodic resync.
#[test]
fn a_frontend_that_does_not_fit_keeps_its_previous_state() {
    require_root!();
    let mut env = Env::new("nofit", 4).unwrap();
    // 1 + 3 of the 6 slots.
    env.manifests
        .write("a.yaml", &service(&env, "a", "10.96.0.10", &["b1"]))
        .unwrap();
    env.manifests
        .write(
            "filler.yaml",
            &service(&env, "filler", "10.96.0.30", &["b1", "b2", "b3"]),
        )
        .unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: vec!["--max-slots".into(), "6".into()],
        ..Default::default()
    })
    .unwrap();
    route_services_to_a_sink(&env);
    assert_ok_spread("a", &env.tcp("10.96.0.10:80", 20), &["b1"], 1.0);
    assert_all_ok("filler", &env.tcp("10.96.0.30:80", 10));

    // A new Service needing 3 slots: 2 are free.
    env.manifests
        .write(
            "b.yaml",
            &service(&env, "b", "10.96.0.20", &["b2", "b3", "b4"]),
        )
        .unwrap();
    let agent = env.agent();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            agent.log().contains("10.96.0.20:80/TCP")
        }),
        "no failure logged for b:\n{}",
        agent.log()
    );
    // Failed closed: its VIP marker refuses its connects at once, and
    // nothing leaves the client toward the Service address, which a
    // node's default route would carry out of the node (here a route to
    // a sink in the client's namespace).
    let sent_before = sink_packets(&env);
    let refused = env.tcp("10.96.0.20:80", 3);
    for a in &refused {
        assert!(
            !a.ok && matches!(a.error.as_deref(), Some("ECONNREFUSED" | "EPERM")),
            "b, not programmed: refused, got {a:?}"
        );
        assert!(a.elapsed_ms < 500.0, "refused at once: {a:?}");
    }
    assert_eq!(
        sink_packets(&env),
        sent_before,
        "b's connects left unrewritten"
    );
    assert_eq!(slots_full(agent), 1.0, "{}", agent.metrics().unwrap().1);
    assert!(
        inspected(agent, "10.96.0.20", 0).is_some(),
        "no VIP marker for b"
    );
    let b = inspected(agent, "10.96.0.20", 80).expect("inspect lists b");
    assert_eq!(b["service_id"], 0, "{b:#}");
    assert_eq!(b["unprogrammed"]["service"], "demo/b", "{b:#}");
    assert_eq!(b["unprogrammed"]["reason"], "slots_full", "{b:#}");
    let text = agent.inspect_services_raw(false).unwrap();
    eprintln!("inspect services:\n{text}");
    assert!(
        text.contains("NOT PROGRAMMED for Service demo/b port http: LB_SLOTS is full"),
        "{text}"
    );
    let log = agent.log();
    assert!(
        log.contains("Service demo/b port http, frontend 10.96.0.20:80/TCP")
            && log.contains("LB_SLOTS is full"),
        "{log}"
    );
    // Still ready (everything else is served), but says what is not.
    let (code, body) = agent.get("/readyz").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("degraded: 1 frontends not programmed (1 slots_full)"),
        "/readyz: {body}"
    );

    // `a` grows to 3 backends: 3 more slots, 2 free.
    env.manifests
        .write(
            "a.yaml",
            &service(&env, "a", "10.96.0.10", &["b1", "b2", "b3"]),
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            slots_full(agent) == 2.0
        }),
        "a not counted as unprogrammed:\n{}",
        agent.metrics().unwrap().1
    );
    assert_ok_spread("a, as before", &env.tcp("10.96.0.10:80", 30), &["b1"], 1.0);
    let a = inspected(agent, "10.96.0.10", 80).unwrap();
    assert_ne!(a["service_id"], 0, "{a:#}");
    assert_eq!(a["unprogrammed"]["service"], "demo/a", "{a:#}");
    assert_eq!(a["backends"].as_array().unwrap().len(), 1, "{a:#}");
    assert_all_ok("filler, untouched", &env.tcp("10.96.0.30:80", 10));

    // Room: `filler` goes. Its slots are free once retired, and both are
    // programmed then, long before the periodic resync (30 s).
    env.manifests.remove("filler.yaml").unwrap();
    let mut last = None;
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            last = frontend_backends(agent, "10.96.0.20", 80, Some("TCP")).unwrap();
            slots_full(agent) == 0.0 && last.as_ref().is_some_and(|b| b.len() == 3)
        }),
        "not programmed once room was made: b {last:?}\n{}",
        agent.metrics().unwrap().1
    );
    assert_ok_spread(
        "a",
        &env.tcp("10.96.0.10:80", 150),
        &["b1", "b2", "b3"],
        0.15,
    );
    assert_ok_spread(
        "b",
        &env.tcp("10.96.0.20:80", 150),
        &["b2", "b3", "b4"],
        0.15,
    );
    assert!(inspected(agent, "10.96.0.10", 80).unwrap()["unprogrammed"].is_null());
    assert_eq!(agent.get("/readyz").unwrap(), (200, "ready\n".to_owned()));
}
