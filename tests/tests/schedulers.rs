//! The ipvs mode's schedulers on the socket path (`lb-agent.dev/lb-algorithm`
//! and `--algorithm`: rr, lc, sed, nq, sh, dh), and the per-node random
//! draw. Each backend answers with its name, so a connection's backend is
//! what its server wrote, not what our maps say.
mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Stdio,
    time::Duration,
};

use common::*;
use integration_tests::{
    cluster::{flows, ready_slice, with_annotation, HeldTcp},
    netns::{pod_v4, pod_v6},
    probe::{parse_attempts, Attempt},
    require_root, AgentOpts, Env,
};
use serde_json::Value;

const TARGET: &str = "10.96.0.10:80";

/// `web(env)` with the Service annotated for `algorithm` (none: `None`).
fn web_with(env: &Env, algorithm: Option<&str>) -> Vec<Value> {
    let mut objects = web(env);
    if let Some(a) = algorithm {
        objects[0] = with_annotation(objects[0].clone(), "lb-agent.dev/lb-algorithm", a);
    }
    objects
}

/// `Env::new(tag, backends)` serving `web_with(algorithm)`, agent started
/// with `args`.
fn env_with(tag: &str, backends: u8, algorithm: Option<&str>, args: &[&str]) -> Env {
    let mut env = Env::new(tag, backends).unwrap();
    env.manifests
        .write("web.yaml", &web_with(&env, algorithm))
        .unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    env
}

/// `count` TCP connects, one after another, from host netns `netns`,
/// pinned to `cpu`: each one's backend, in order.
fn connects(env: &Env, netns: &str, cpu: usize, count: usize) -> std::process::Child {
    let mut client = env.client();
    client.netns = netns.to_string();
    let mut c = client.command(TARGET, count).unwrap();
    c.args(["--cpu", &cpu.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn backends_of(child: std::process::Child, count: usize) -> Vec<String> {
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "lb-probe client: {}", out.status);
    let attempts: Vec<Attempt> = parse_attempts(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(attempts.len(), count);
    attempts
        .into_iter()
        .map(|a| {
            assert!(a.ok, "{a:?}");
            a.backend.unwrap()
        })
        .collect()
}

fn sequence(env: &Env, netns: &str, cpu: usize, count: usize) -> Vec<String> {
    backends_of(connects(env, netns, cpu, count), count)
}

fn tally<'a>(names: impl IntoIterator<Item = &'a String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in names {
        *m.entry(n.clone()).or_default() += 1;
    }
    m
}

/// The frontend `addr:port` of `lb-agent inspect services --json`.
fn frontend(env: &Env, addr: &str, port: u64) -> Value {
    let all = env.agent().inspect_services().unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|f| f["addr"] == addr && f["port"] == port)
        .cloned()
        .unwrap_or_else(|| panic!("no frontend {addr}:{port} in {all}"))
}

/// Open connections per backend address as `inspect services` shows them.
fn open_per_backend(env: &Env) -> BTreeMap<String, u64> {
    frontend(env, VIP, 80)["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["addr"].as_str().unwrap().to_string(),
                b["open"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn rr_takes_the_backends_in_turn_on_one_cpu_and_on_both() {
    require_root!();
    let env = env_with("rr", 3, Some("rr"), &[]);
    let client = env.topo.client_netns().to_string();

    let seq = sequence(&env, &client, 0, 30);
    eprintln!("rr from one client on CPU 0: {seq:?}");
    let first: BTreeSet<&String> = seq[..3].iter().collect();
    assert_eq!(
        first.len(),
        3,
        "the first three turns repeat a backend: {seq:?}"
    );
    for (i, b) in seq.iter().enumerate().skip(3) {
        assert_eq!(b, &seq[i - 3], "turn {i} is out of order: {seq:?}");
    }

    // Four clients, two on each CPU, at once: the turns of one cursor,
    // shared. Each turn goes to exactly one connect, so 6000 turns over
    // three backends are exactly 2000 each; a cursor read and stepped
    // without its lock gave two CPUs one turn now and then (202/200/198).
    let clients: Vec<_> = [0, 1, 0, 1]
        .into_iter()
        .map(|cpu| connects(&env, &client, cpu, 1500))
        .collect();
    let all: Vec<String> = clients
        .into_iter()
        .flat_map(|c| backends_of(c, 1500))
        .collect();
    let counts = tally(&all);
    eprintln!("rr from both CPUs, 6000 connects: {counts:?}");
    assert_eq!(counts.len(), 3, "{counts:?}");
    for (backend, n) in &counts {
        assert_eq!(*n, 2000, "{backend}: {n} of 6000 turns: {counts:?}");
    }
    let f = frontend(&env, VIP, 80);
    assert_eq!(f["algorithm"], "rr", "{f}");
}

#[test]
fn lc_balances_open_connections_and_counts_survive_a_sigkill() {
    require_root!();
    let mut env = env_with("lc", 3, Some("lc"), &[]);

    let mut held = HeldTcp::open(&env, TARGET, 30).unwrap();
    let per = held.per_backend();
    eprintln!("lc, 30 connections held open: {per:?}");
    assert_eq!(
        per.values().copied().collect::<Vec<_>>(),
        [10, 10, 10],
        "{per:?}"
    );
    assert_eq!(held.close_to("b1").unwrap(), 10);
    let open = open_per_backend(&env);
    eprintln!("after closing b1's: {open:?}");
    let b1 = pod_v4(1).to_string();
    assert_eq!(open[&b1], 0, "{open:?}");
    assert!(open.values().filter(|n| **n == 10).count() == 2, "{open:?}");

    // A crash and a restart keep the counts (pinned, adopted).
    let agent = env.agent.as_mut().unwrap();
    agent.kill().unwrap();
    agent.restart(Duration::from_secs(30)).unwrap();

    // b1 holds nothing, the others 10 each: the next ones all go to b1.
    let next = HeldTcp::open(&env, TARGET, 6).unwrap();
    assert_eq!(
        next.per_backend(),
        BTreeMap::from([("b1".to_string(), 6)]),
        "after b1's connections closed (and a restart)"
    );
    assert_eq!(open_per_backend(&env)[&b1], 6);
    held.close().unwrap();
    next.close().unwrap();
    let open = open_per_backend(&env);
    assert!(open.values().all(|n| *n == 0), "all closed: {open:?}");
}

#[test]
fn sed_and_nq_take_idle_backends_first() {
    require_root!();
    for algorithm in ["sed", "nq"] {
        let env = env_with(algorithm, 3, Some(algorithm), &[]);
        // One connection after another, each held: every backend gets one
        // before any gets a second, and a second before any a third.
        let held: Vec<HeldTcp> = (0..6)
            .map(|_| HeldTcp::open(&env, TARGET, 1).unwrap())
            .collect();
        let order: Vec<String> = held
            .iter()
            .flat_map(|h| h.backends.iter().flatten().cloned())
            .collect();
        let first: BTreeSet<&String> = order[..3].iter().collect();
        assert_eq!(first.len(), 3, "{algorithm}: {order:?}");
        let counts = tally(&order);
        assert_eq!(
            counts.values().copied().collect::<Vec<_>>(),
            [2, 2, 2],
            "{algorithm}: {order:?}"
        );
    }
}

#[test]
fn sh_keeps_each_client_on_one_backend_and_spreads_clients() {
    require_root!();
    let mut env = env_with("sh", 3, Some("sh"), &[]);
    let mut clients = vec![env.topo.client_netns().to_string()];
    for i in 0..8u8 {
        let host = env
            .topo
            .add_host(&format!("c{i}"), pod_v4(110 + i), pod_v6(110 + i))
            .unwrap();
        clients.push(host.netns.clone());
    }
    let mut chosen = BTreeMap::new();
    for netns in &clients {
        let seq = sequence(&env, netns, 0, 10);
        let distinct: BTreeSet<&String> = seq.iter().collect();
        assert_eq!(distinct.len(), 1, "client {netns} moved: {seq:?}");
        chosen.insert(netns.clone(), seq[0].clone());
    }
    eprintln!("sh, one backend per client: {chosen:?}");
    let spread: BTreeSet<&String> = chosen.values().collect();
    assert!(spread.len() >= 2, "every client on one backend: {chosen:?}");
}

#[test]
fn dh_sends_a_frontend_to_one_backend_and_the_default_applies_to_others() {
    require_root!();
    // dh as the node's default; one Service annotated random beside.
    let mut env = Env::new("dh", 3).unwrap();
    let mut objects = web_with(&env, None);
    objects.extend(with_random_api(&env));
    env.manifests.write("web.yaml", &objects).unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: vec!["--algorithm".into(), "dh".into()],
        ..Default::default()
    })
    .unwrap();
    let seq = sequence(&env, env.topo.client_netns(), 1, 20);
    let distinct: BTreeSet<&String> = seq.iter().collect();
    assert_eq!(distinct.len(), 1, "dh: {seq:?}");
    assert_eq!(frontend(&env, VIP, 80)["algorithm"], "dh");
    assert_eq!(frontend(&env, "10.96.0.11", 80)["algorithm"], "random");
    let log = env.agent().log();
    assert!(
        log.contains("demo/web") && log.contains("dh"),
        "no warning names the dh Service: {log}"
    );
}

/// Service `demo/api` at 10.96.0.11 annotated random, with every backend.
fn with_random_api(env: &Env) -> Vec<Value> {
    vec![
        with_annotation(
            http_service("api", "10.96.0.11").to_value(),
            "lb-agent.dev/lb-algorithm",
            "random",
        ),
        env.slice("api", &[("http", 8080, "TCP")]).to_value(),
    ]
}

#[test]
fn an_unknown_algorithm_is_named_and_served_with_the_default() {
    require_root!();
    let env = env_with("alg-unknown", 3, Some("wlc"), &["--algorithm", "rr"]);
    let seq = sequence(&env, env.topo.client_netns(), 0, 9);
    for (i, b) in seq.iter().enumerate().skip(3) {
        assert_eq!(b, &seq[i - 3], "not served with the default rr: {seq:?}");
    }
    let log = env.agent().log();
    assert!(
        log.contains("demo/web")
            && log.contains("lb-agent.dev/lb-algorithm")
            && log.contains("\"wlc\""),
        "the unknown value is not named: {log}"
    );
}

#[test]
fn two_fresh_agents_draw_different_sequences() {
    require_root!();
    let mut runs = Vec::new();
    for i in 0..2 {
        let env = env_with(&format!("draw{i}"), 3, None, &[]);
        runs.push(sequence(&env, env.topo.client_netns(), 0, 40));
    }
    eprintln!("random, first 40 connects of two fresh agents: {runs:?}");
    assert_ne!(runs[0], runs[1], "two nodes draw the same sequence");
}

/// lc's counts under load: clients on both CPUs connect and close as fast
/// as they can while the backend set changes (b5 joins and leaves) and 30
/// connections are opened and held meanwhile. Once the clients are done
/// every backend counts exactly the held connections it has, and nothing
/// once those close: no count lost or doubled by two CPUs, a socket's
/// release, or a set replaced under them.
#[test]
fn lc_counts_stay_exact_under_churn_from_both_cpus() {
    require_root!();
    let mut env = Env::new("lc-stress", 5).unwrap();
    let all: Vec<String> = (1..=5).map(|i| format!("b{i}")).collect();
    let write = |env: &Env, hosts: &[String]| {
        let svc = with_annotation(web_service().to_value(), "lb-agent.dev/lb-algorithm", "lc");
        env.manifests
            .write(
                "web.yaml",
                &[svc, ready_slice(env, "web", "web-abcde", &WEB_PORTS, hosts)],
            )
            .unwrap();
    };
    write(&env, &all);
    env.start_agent().unwrap();
    let client = env.topo.client_netns().to_string();
    const EACH: usize = 2000;
    let (a, b) = (
        connects(&env, &client, 0, EACH),
        connects(&env, &client, 1, EACH),
    );
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (held, changes) = std::thread::scope(|scope| {
        let churn = scope.spawn(|| {
            let mut changes = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                write(&env, if changes % 2 == 0 { &all[..4] } else { &all });
                changes += 1;
                std::thread::sleep(Duration::from_millis(60));
            }
            write(&env, &all);
            changes
        });
        std::thread::sleep(Duration::from_millis(300));
        let held = HeldTcp::open(&env, TARGET, 30).unwrap();
        let (a, b) = (backends_of(a, EACH), backends_of(b, EACH));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        eprintln!("churn clients: {:?}", tally(a.iter().chain(&b)));
        (held, churn.join().unwrap())
    });
    let per = held.per_backend();
    eprintln!("{changes} set changes; 30 held: {per:?}");
    assert!(changes >= 10, "the set changed {changes} times only");
    // The last set (all five) is programmed: every backend is shown.
    let mut open = BTreeMap::new();
    let want: BTreeMap<String, u64> = (1..=5u8)
        .map(|i| {
            let name = format!("b{i}");
            (
                pod_v4(i).to_string(),
                per.get(&name).copied().unwrap_or(0) as u64,
            )
        })
        .collect();
    assert!(
        integration_tests::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            open = open_per_backend(&env);
            open.len() == 5
        }),
        "{open:?}"
    );
    assert_eq!(
        open, want,
        "counts after the churn, against the held connections"
    );
    held.close().unwrap();
    let open = open_per_backend(&env);
    assert!(open.values().all(|n| *n == 0), "all closed: {open:?}");
    drop(env.agent.take());
}

/// lc over UDP: each socket's flow (`LB_DGRAM_FLOWS`) counts for its
/// backend while it lives, so 30 sockets spread 10/10/10; once they idle
/// past the UDP timeout the sweep takes the counts back.
#[test]
fn lc_counts_udp_flows_while_they_live() {
    require_root!();
    let env = env_with(
        "lc-udp",
        3,
        Some("lc"),
        &["--conntrack-udp-timeout", "2s", "--sweep-interval", "500ms"],
    );
    let mut f = flows(&env, "10.96.0.10:53", 30).unwrap();
    let round = f.round().unwrap();
    let names: Vec<String> = round.into_iter().map(|b| b.expect("an answer")).collect();
    let per = tally(&names);
    eprintln!("lc, 30 UDP sockets: {per:?}");
    assert_eq!(
        per.values().copied().collect::<Vec<_>>(),
        [10, 10, 10],
        "{per:?}"
    );
    let open_udp = |env: &Env| -> Vec<u64> {
        frontend(env, VIP, 53)["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["open"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(open_udp(&env), [10, 10, 10]);
    let mut open = Vec::new();
    assert!(
        integration_tests::wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
            open = open_udp(&env);
            open.iter().all(|n| *n == 0)
        }),
        "idle flows still count: {open:?}"
    );
}
