//! Issue 41: no client can starve the health endpoints. From one address
//! (127.0.0.1 in the test's own network namespace, where the agent runs),
//! 10 000 idle connections and 2 000 slowloris ones (a byte every 2 s),
//! reopened as the agent closes them, spread over the health address, the
//! metrics address and a health-check node port; meanwhile another address
//! of that namespace (127.0.0.2) probes `/readyz`, `/healthz`, `/livez`,
//! `/metrics` and the node port, 20 times each over more than the 5 s
//! header timeout. Every probe must be answered, none reset or refused,
//! each within 100 ms: the criterion of availability (a probe
//! stuck behind a full server waits for a slot or a SYN retry, a second
//! or more; one served at all takes a few milliseconds), not a speed goal.
//! The agent's open descriptors and RSS must stay within what its limits
//! allow this one flooding source.
mod common;

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use common::web;
use integration_tests::{netns::enter_netns, require_root, AgentOpts, Env};
use serde_json::json;
use socket2::{Domain, Socket, Type};

const IDLE: usize = 10_000;
const SLOW: usize = 2_000;
const PROBES: usize = 20;
const ANSWER_WITHIN: Duration = Duration::from_millis(100);
/// Between probe rounds: 20 rounds span 6 s, past the 5 s header timeout.
const PROBE_EVERY: Duration = Duration::from_millis(300);
/// The flood reopens at most this many closed connections a second: a
/// steady attack, bounded so that the test's ephemeral ports (28 000 per
/// target, each closed one in TIME_WAIT for 60 s) last.
const REOPEN_PER_SEC: usize = 1_500;
/// How long the flood may run at most, whatever happens.
const FLOOD_AT_MOST: Duration = Duration::from_secs(90);
const HEALTH_CHECK_PORT: u16 = 32000;
/// The agent's per-source limit (`health::PER_SOURCE`), on each of its
/// three servers.
const PER_SOURCE: usize = 16;

const FLOODER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const PROBER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Raises this process's soft open-file limit to at least `want`.
fn raise_open_files(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        assert!(
            lim.rlim_max >= want,
            "this test holds {want} sockets: raise the hard open-file limit (now {})",
            lim.rlim_max
        );
        if lim.rlim_cur < want {
            lim.rlim_cur = want;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// A socket from `from`, connected to `to`.
fn connect_from(from: Ipv4Addr, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    s.bind(&SocketAddr::from((from, 0)).into())?;
    s.connect_timeout(&to.into(), timeout)?;
    Ok(s.into())
}

/// Closed by the agent (EOF, reset), without blocking.
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 64];
    match (&*s).read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// The flooding threads; stopped and joined on drop (also when the test
/// fails), which closes their sockets.
struct Flood {
    stop: Arc<AtomicBool>,
    idle_open: Arc<AtomicUsize>,
    slow_open: Arc<AtomicUsize>,
    opened: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Flood {
    /// `idle` idle and `slow` slowloris connections from [`FLOODER`] in
    /// namespace `netns`, spread over `targets`, reopened as they close.
    fn start(netns: &str, targets: &[SocketAddr], idle: usize, slow: usize) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let idle_open = Arc::new(AtomicUsize::new(0));
        let slow_open = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut threads = Vec::new();
        for (count, slowloris, open) in [
            (idle, false, idle_open.clone()),
            (slow, true, slow_open.clone()),
        ] {
            let (ns, targets, stop, opened) = (
                netns.to_owned(),
                targets.to_vec(),
                stop.clone(),
                opened.clone(),
            );
            threads.push(std::thread::spawn(move || {
                enter_netns(&ns).expect("entering the test namespace");
                let connect = |i: usize| {
                    let s =
                        connect_from(FLOODER, targets[i % targets.len()], Duration::from_secs(1))
                            .ok()?;
                    s.set_nonblocking(true).ok()?;
                    opened.fetch_add(1, Ordering::Relaxed);
                    if slowloris {
                        // The start of a head, never its end.
                        let _ = (&s).write_all(b"GET /readyz HTTP/1.1\r\n");
                    }
                    Some(s)
                };
                let mut socks: Vec<Option<TcpStream>> = (0..count).map(connect).collect();
                let running = || !stop.load(Ordering::Relaxed) && started.elapsed() < FLOOD_AT_MOST;
                // Slowloris: one byte per connection every 2 s, spread.
                let sweep = if slowloris {
                    Duration::from_secs(2)
                } else {
                    Duration::from_millis(250)
                };
                let reopen_per_sweep = (REOPEN_PER_SEC as f64 * sweep.as_secs_f64()) as usize;
                while running() {
                    let t0 = Instant::now();
                    let mut reopened = 0;
                    let per_sock = sweep / count.max(1) as u32;
                    for (i, slot) in socks.iter_mut().enumerate() {
                        if !running() {
                            break;
                        }
                        let gone = match slot {
                            Some(s) if slowloris => (&*s).write_all(b"X").is_err() || closed(s),
                            Some(s) => closed(s),
                            None => true,
                        };
                        if gone && reopened < reopen_per_sweep {
                            reopened += 1;
                            *slot = connect(i);
                        }
                        if slowloris {
                            std::thread::sleep(per_sock);
                        }
                    }
                    open.store(socks.iter().flatten().count(), Ordering::Relaxed);
                    if let Some(rest) = sweep.checked_sub(t0.elapsed()) {
                        std::thread::sleep(rest);
                    }
                }
            }));
        }
        Flood {
            stop,
            idle_open,
            slow_open,
            opened,
            threads,
        }
    }
}

/// GET `path` on `to` from [`PROBER`]: the status and how long the whole
/// exchange took, or what went wrong.
fn probe(to: SocketAddr, path: &str) -> Result<(u16, Duration), String> {
    let t0 = Instant::now();
    let mut s =
        connect_from(PROBER, to, Duration::from_secs(3)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).map_err(|e| format!("read: {e}"))?;
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&out);
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not HTTP: {text:?}"))?;
    Ok((code, took))
}

/// The agent's open descriptors and resident memory (KiB).
fn fds_and_rss(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (fds, rss)
}

#[test]
fn one_address_cannot_starve_the_health_endpoints() {
    require_root!();
    raise_open_files((IDLE + SLOW + 1_000) as u64);
    let mut env = Env::new("hstarve", 1).unwrap();
    let mut docs = web(&env);
    // A Local LoadBalancer Service: its health-check node port.
    docs.push(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "local", "namespace": "demo"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11"],
            "externalTrafficPolicy": "Local", "healthCheckNodePort": HEALTH_CHECK_PORT,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30081}]}}));
    env.manifests.write("web.yaml", &docs).unwrap();
    // In the test's client namespace: the flood and the probes reach the
    // agent there only, on that namespace's loopback addresses.
    let netns = env.topo.client_netns().to_string();
    integration_tests::cmd::ip(&[
        "netns",
        "exec",
        &netns,
        "sysctl",
        "-qw",
        "net.ipv4.ip_local_port_range=10000 65000",
    ])
    .unwrap();
    env.start_agent_with(AgentOpts {
        netns: Some(netns.clone()),
        ..Default::default()
    })
    .unwrap();
    let agent = env.agent();
    let health = agent.health_addr();
    let metrics = agent.metrics_addr();
    let node_port = SocketAddr::from((Ipv4Addr::LOCALHOST, HEALTH_CHECK_PORT));
    let checks: [(SocketAddr, &str); 5] = [
        (health, "/readyz"),
        (health, "/healthz"),
        (health, "/livez"),
        (metrics, "/metrics"),
        (node_port, "/"),
    ];
    // Every endpoint answers before the flood (the node port once the
    // Service is synced).
    let ns = netns.clone();
    let ready = integration_tests::netns::in_netns(&ns, move || {
        integration_tests::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            checks.iter().all(|&(to, path)| probe(to, path).is_ok())
        })
    })
    .unwrap();
    assert!(
        ready,
        "not every endpoint answers before the flood\n{}",
        agent.log()
    );
    let pid = agent.pid();
    let (fds_before, rss_before) = fds_and_rss(pid);

    let flood = Flood::start(&netns, &[health, metrics, node_port], IDLE, SLOW);
    // Until the flood's first connections are all made.
    let made =
        integration_tests::wait_until(Duration::from_secs(60), Duration::from_millis(100), || {
            flood.opened.load(Ordering::Relaxed) >= IDLE + SLOW
        });
    assert!(
        made,
        "the flood made only {} connections in 60 s",
        flood.opened.load(Ordering::Relaxed)
    );

    let results = integration_tests::netns::in_netns(&netns, move || {
        let mut results = Vec::new();
        for round in 0..PROBES {
            for &(to, path) in &checks {
                results.push((round, to, path, probe(to, path)));
            }
            std::thread::sleep(PROBE_EVERY);
        }
        results
    })
    .unwrap();
    let (fds_during, rss_during) = fds_and_rss(pid);
    let opened = flood.opened.load(Ordering::Relaxed);
    let (idle_open, slow_open) = (
        flood.idle_open.load(Ordering::Relaxed),
        flood.slow_open.load(Ordering::Relaxed),
    );
    drop(flood);

    let bad: Vec<String> = results
        .iter()
        .filter_map(|(round, to, path, r)| match r {
            Ok((code, took)) if *code != 0 && *took <= ANSWER_WITHIN => None,
            Ok((code, took)) => Some(format!("round {round}: {to}{path}: {code} after {took:?}")),
            Err(e) => Some(format!("round {round}: {to}{path}: {e}")),
        })
        .collect();
    let slowest = results
        .iter()
        .filter_map(|(_, _, _, r)| r.as_ref().ok().map(|(_, t)| *t))
        .max();
    eprintln!(
        "flood: {opened} connections made, {idle_open} idle and {slow_open} slowloris held by the \
         flooder at the end (most closed by the agent); probes: {} of {}, the slowest {slowest:?}; \
         agent: {fds_before} -> {fds_during} descriptors, {rss_before} -> {rss_during} KiB",
        results.len() - bad.len(),
        results.len()
    );
    assert!(
        bad.is_empty(),
        "{} of {} probes from another address failed or took over {ANSWER_WITHIN:?}:\n{}",
        bad.len(),
        results.len(),
        bad.join("\n")
    );
    for (_, _, path, r) in &results {
        let code = r.as_ref().unwrap().0;
        let want: &[u16] = if *path == "/" { &[200, 503] } else { &[200] };
        assert!(want.contains(&code), "{path} answered {code}");
    }
    // This source's share: per-source on each of the three servers, and
    // the probes' own (closed by now, a few may linger).
    let fd_bound = fds_before + 3 * PER_SOURCE + 8;
    assert!(
        fds_during <= fd_bound,
        "the agent holds {fds_during} descriptors under the flood (before {fds_before}; bound {fd_bound})"
    );
    // 48 connections of at most ~24 KiB, and the runtime's slack.
    let rss_bound = rss_before + 16 * 1024;
    assert!(
        rss_during <= rss_bound,
        "the agent's RSS is {rss_during} KiB under the flood (before {rss_before}; bound {rss_bound})"
    );
    // Afterwards, from the flooding address too.
    assert_eq!(agent.get("/readyz").unwrap().0, 200);
}
