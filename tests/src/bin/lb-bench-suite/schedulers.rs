//! The schedulers experiment (issue 39): one agent, one Service per
//! algorithm (annotated `lb-agent.dev/lb-algorithm`), each on the same ten
//! backend addresses, and
//! - connect4's cost per algorithm: `run_time_ns / run_cnt` under
//!   `BPF_ENABLE_STATS` in a connect+close run at that Service alone;
//! - for random, rr and lc, how evenly long-lived connections spread:
//!   `lb-bench client --mode hold` keeps [`OPEN`] connections open and,
//!   step by step, closes one at random and opens another; after each
//!   open, the largest backend's open connections over the mean.
//!
//! Rounds run the algorithms in a new shuffled order, lc and random side
//! by side (their difference is the goal's figure, and drift between two
//! adjacent runs is least); the agent is paused meanwhile (the programs
//! and maps need none), as in the ClusterIP experiment. Throughout,
//! [`BUSY_PER_BACKEND`] connections per backend are held open (opened
//! through rr's Service, so exactly that many each): every backend is
//! busy, so lc, sed and nq scan all ten on every connect, as they do
//! under real load, rather than stop at the first idle one.
use std::{
    collections::BTreeMap,
    fs,
    io::BufRead as _,
    net::SocketAddrV4,
    path::Path,
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, Result};
use integration_tests::{cgroup::CgroupGuard, cmd, Agent, AgentOpts};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{
    connect4_id, cost_run_ms, rules, say, shuffle, testbed, while_paused, with_bpf_stats, Mode,
    Opts,
};

/// The algorithms measured, as the annotation names them.
pub const ALGORITHMS: &[&str] = &["random", "maglev", "rr", "lc", "sed", "nq", "sh", "dh"];
/// Those whose spread of long-lived connections is measured.
pub const BALANCED: &[&str] = &["random", "rr", "lc"];
pub const BACKENDS: u8 = 10;
/// `lb-bench server`'s greeting port: every connection is told the
/// backend address it reached, and held open.
const GREET_PORT: u16 = rules::BACKEND_PORT + 1;
/// Connections held open at once in the spread runs (10 a backend).
pub const OPEN: usize = 100;
/// Connections held open to each backend through every run.
pub const BUSY_PER_BACKEND: usize = 2;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SchedulerResults {
    pub backends: usize,
    pub open: usize,
    pub steps: u64,
    /// Rounds of cost runs; the first `spread_rounds` also ran the spread.
    pub rounds: usize,
    #[serde(default)]
    pub spread_rounds: usize,
    pub costs: Vec<AlgorithmCost>,
    pub spreads: Vec<Spread>,
    /// Connections held open to each backend throughout (0: none, as
    /// before this was measured so).
    #[serde(default)]
    pub busy_per_backend: usize,
}

/// connect4's run time at one algorithm's Service, in one round.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AlgorithmCost {
    pub algorithm: String,
    pub round: usize,
    pub run_time_ns: u64,
    pub run_cnt: u64,
}

impl AlgorithmCost {
    pub fn per_run(&self) -> f64 {
        self.run_time_ns as f64 / self.run_cnt.max(1) as f64
    }
}

/// One spread run (`lb-bench client --mode hold`'s report).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spread {
    pub algorithm: String,
    pub round: usize,
    pub steps: u64,
    pub mean_ratio: f64,
    pub p99_ratio: f64,
    pub max_ratio: f64,
    pub errors: u64,
    /// Open connections per backend at the end.
    pub backends: BTreeMap<String, usize>,
}

fn vip(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(10, 96, 0, 20 + i as u8)
}

/// The manifests: Service `sched-ALG` at `10.96.0.(20+i)`:80 per algorithm.
fn manifests() -> serde_json::Value {
    let eps: Vec<_> = rules::target_endpoints(BACKENDS)
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}}))
        .collect();
    let mut items = Vec::new();
    for (i, alg) in ALGORITHMS.iter().enumerate() {
        let name = format!("sched-{alg}");
        items.push(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "bench",
                         "annotations": {"lb-agent.dev/lb-algorithm": alg}},
            "spec": {"type": "ClusterIP", "clusterIP": vip(i).to_string(),
                     "clusterIPs": [vip(i).to_string()],
                     "ports": [{"name": "tcp", "port": rules::TARGET_PORT, "protocol": "TCP",
                                "targetPort": GREET_PORT}]}}));
        items.push(
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{name}-1"), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "tcp", "port": GREET_PORT, "protocol": "TCP"}],
            "endpoints": eps}),
        );
    }
    json!({"apiVersion": "v1", "kind": "List", "items": items})
}

pub fn steps(quick: bool) -> u64 {
    if quick {
        1000
    } else {
        4000
    }
}

/// Rounds of cost runs, and how many of them (the first) also run the
/// spread: a cost run's figure moves by tens of percent between runs on
/// a shared 2-core VM (more with the SRSO thunk), and the goal compares
/// two algorithms to within 100 ns, so costs get three times the rounds.
fn rounds(opts: &Opts) -> (usize, usize) {
    let spread = opts.rounds.unwrap_or(if opts.quick { 2 } else { 5 });
    (3 * spread, spread)
}

pub fn run(opts: &Opts, bench_bin: &Path, seed: &mut u64) -> Result<SchedulerResults> {
    let (rounds, spread_rounds) = rounds(opts);
    say(format!(
        "=== schedulers: {} algorithms over {BACKENDS} backends, {rounds} rounds \
         ({spread_rounds} with the spread) ===",
        ALGORITHMS.len()
    ));
    let (topo, _server) = testbed("sched", bench_bin, BACKENDS)?;
    let cgroup = CgroupGuard::create("sched")?;
    let dir = tempfile::Builder::new()
        .prefix(&integration_tests::unique_name("sched"))
        .tempdir()?;
    let dir_manifests = dir.path().join("manifests");
    fs::create_dir_all(&dir_manifests)?;
    fs::write(
        dir_manifests.join("sched.json"),
        serde_json::to_string(&manifests())?,
    )?;
    let agent = Agent::start(
        &dir_manifests,
        cgroup.path(),
        AgentOpts {
            log_file: Some(dir.path().join("agent.log")),
            ..Default::default()
        },
    )?;
    let connect4 = connect4_id(cgroup.path())?;
    let client_ns = topo.client_netns().to_string();
    let mut out = SchedulerResults {
        backends: BACKENDS as usize,
        open: OPEN,
        steps: steps(opts.quick),
        rounds,
        spread_rounds,
        ..Default::default()
    };
    let rr = ALGORITHMS.iter().position(|a| *a == "rr").unwrap_or(0);
    let _busy = Keeper::start(
        bench_bin,
        &client_ns,
        cgroup.path(),
        SocketAddrV4::new(vip(rr), rules::TARGET_PORT),
    )?;
    out.busy_per_backend = BUSY_PER_BACKEND;
    let pids = [agent.pid()];
    let r = while_paused(&pids, || -> Result<()> {
        for round in 0..rounds {
            for i in round_order(round, seed) {
                let alg = ALGORITHMS[i];
                let target = SocketAddrV4::new(vip(i), rules::TARGET_PORT);
                let (spent, run) = with_bpf_stats(&[connect4], || {
                    crate::run_bench_client(
                        bench_bin,
                        &client_ns,
                        Some(cgroup.path()),
                        &[target],
                        Mode::Cc,
                        cost_run_ms(opts),
                    )
                })?;
                if run.errors > 0 {
                    anyhow::bail!(
                        "connect+close at {alg}'s Service {target}: {} errors ({:?})",
                        run.errors,
                        run.first_error
                    );
                }
                out.costs.push(AlgorithmCost {
                    algorithm: alg.into(),
                    round,
                    run_time_ns: spent[0].0,
                    run_cnt: spent[0].1,
                });
                if round < spread_rounds && BALANCED.contains(&alg) {
                    let s = hold(bench_bin, &client_ns, cgroup.path(), target, opts.quick)
                        .with_context(|| format!("the spread run of {alg}"))?;
                    out.spreads.push(Spread {
                        algorithm: alg.into(),
                        round,
                        ..s
                    });
                }
            }
            let line: Vec<String> = ALGORITHMS
                .iter()
                .map(|a| {
                    let c = out
                        .costs
                        .iter()
                        .rev()
                        .find(|c| c.algorithm == *a)
                        .map_or(0.0, AlgorithmCost::per_run);
                    let s = out
                        .spreads
                        .iter()
                        .rev()
                        .find(|s| s.algorithm == *a)
                        .map_or(String::new(), |s| {
                            format!(", largest/mean {:.2}", s.mean_ratio)
                        });
                    format!("{a} {c:.0} ns{s}")
                })
                .collect();
            say(format!("  round {}: {}", round + 1, line.join("; ")));
        }
        Ok(())
    });
    drop(agent);
    r?;
    Ok(out)
}

/// A round's order: the algorithms shuffled, lc and random side by side
/// (lc first in odd rounds) at a shuffled place.
fn round_order(round: usize, seed: &mut u64) -> Vec<usize> {
    let at = |name: &str| ALGORITHMS.iter().position(|a| *a == name).unwrap_or(0);
    let (random, lc) = (at("random"), at("lc"));
    let mut order: Vec<usize> = (0..ALGORITHMS.len())
        .filter(|&i| i != random && i != lc)
        .collect();
    // A placeholder for the pair, shuffled with the rest.
    order.push(usize::MAX);
    shuffle(&mut order, seed);
    let pair = if round.is_multiple_of(2) {
        [random, lc]
    } else {
        [lc, random]
    };
    order
        .into_iter()
        .flat_map(|i| {
            if i == usize::MAX {
                pair.to_vec()
            } else {
                vec![i]
            }
        })
        .collect()
}

/// `lb-bench client --mode keep` holding [`BUSY_PER_BACKEND`] connections
/// to every backend through `target` (an rr Service) until dropped.
struct Keeper(Child);

impl Keeper {
    fn start(bench_bin: &Path, netns: &str, cgroup: &Path, target: SocketAddrV4) -> Result<Self> {
        let open = BUSY_PER_BACKEND * BACKENDS as usize;
        let mut c = Command::new(bench_bin);
        c.args(["client", "--netns", netns, "--mode", "keep"])
            .args(["--target", &target.to_string()])
            .args(["--open", &open.to_string()])
            // Bounded: killed when dropped, and with this process.
            .args(["--duration-ms", "7200000", "--timeout-ms", "1000"])
            .arg("--cgroup")
            .arg(cgroup);
        let line = cmd::display(&c);
        let mut child = Keeper(
            cmd::die_with_parent(&mut c, libc::SIGKILL)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .with_context(|| format!("cannot run `{line}`"))?,
        );
        let stdout = child.0.stdout.take().context("keeper's stdout")?;
        let mut first = String::new();
        std::io::BufReader::new(stdout).read_line(&mut first)?;
        let per: BTreeMap<String, usize> = serde_json::from_str(first.trim())
            .with_context(|| format!("`{line}` printed {first:?}"))?;
        if per.len() != BACKENDS as usize || per.values().any(|&n| n != BUSY_PER_BACKEND) {
            anyhow::bail!("`{line}`: not {BUSY_PER_BACKEND} a backend: {per:?}");
        }
        Ok(child)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One `lb-bench client --mode hold` run at `target`.
fn hold(
    bench_bin: &Path,
    netns: &str,
    cgroup: &Path,
    target: SocketAddrV4,
    quick: bool,
) -> Result<Spread> {
    let mut c = Command::new(bench_bin);
    c.args(["client", "--netns", netns, "--cpu", "0", "--mode", "hold"])
        .args(["--target", &target.to_string()])
        .args(["--open", &OPEN.to_string()])
        .args(["--backends", &BACKENDS.to_string()])
        .args(["--max-ops", &steps(quick).to_string()])
        .args(["--duration-ms", "60000", "--timeout-ms", "1000"])
        .arg("--cgroup")
        .arg(cgroup);
    let text = cmd::run(&mut c)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("hold printed {text:?}"))?;
    if v["errors"].as_u64().unwrap_or(0) > 0 {
        anyhow::bail!("hold at {target}: {text}");
    }
    Ok(Spread {
        algorithm: String::new(),
        round: 0,
        steps: v["steps"].as_u64().unwrap_or(0),
        mean_ratio: v["mean_ratio"].as_f64().unwrap_or(f64::NAN),
        p99_ratio: v["p99_ratio"].as_f64().unwrap_or(f64::NAN),
        max_ratio: v["max_ratio"].as_f64().unwrap_or(f64::NAN),
        errors: 0,
        backends: serde_json::from_value(v["backends"].clone()).unwrap_or_default(),
    })
}
