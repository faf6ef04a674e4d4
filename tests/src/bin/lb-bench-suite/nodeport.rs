//! The NodePort experiment: the tc path (issue 6, item 5).
//!
//! An external client reaches a NodePort on a node namespace, which
//! forwards to a backend pod behind a second node (a remote endpoint:
//! DNAT + SNAT, `externalTrafficPolicy: Cluster`), built with
//! `integration_tests::nodes::Cluster`:
//!
//! ```text
//!   client 192.168.77.100 (no default route)
//!     |  bridge 192.168.77.0/24 (switch namespace)
//!   n1 eth0 192.168.77.1  <- the node under test: agent, or rules
//!   n2 eth0 192.168.77.2 -> cbr0 -> pod n2p0 10.244.2.10..13 (lb-bench server)
//! ```
//!
//! Arms: direct (the client routes the pod addresses via n1: the same two
//! forwarding hops, no load balancer), ours (`lb-agent run` in n1 with its
//! tc programs on n1's `eth0`), ours with its XDP stage
//! (`--acceleration=native`: established packets that leave n1 again are
//! translated and sent back out in XDP), kube-proxy's iptables NodePort
//! shape through iptables-nft and iptables-legacy, its nftables shape; all
//! rules go into n1 only. Every arm has its own namespaces, torn down with
//! it, and every arm's test bed is made ready for XDP
//! ([`Cluster::accelerate`]: a pass program on the switch ports, checksum
//! offload off on the senders), so that the arms differ only in n1.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use integration_tests::{
    cmd,
    nodes::{node_v4, Cluster},
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{
    capacity_args, check_sanity, cost_run_ms, filler_file, floor::TcFloor, load_rules,
    measure_rounds, rules, rules::Scenario, run_bench_client, say, set_up_arms, spawn_server,
    vm_hwm_mib, while_paused, with_bpf_stats, ArmCtx, ArmKind, KillOnDrop, Measured, Mode, Opts,
    Run, Sample, Setup, FILLER_ENDPOINTS,
};

/// The target's node port.
pub const NODE_PORT: u16 = 30080;

/// `TcCost::prog` of the empty programs measured beside ours.
pub const FLOOR_INGRESS: &str = "empty_tc_ingress_eth0";
pub const FLOOR_EGRESS: &str = "empty_tc_egress_eth0";

/// Results of the NodePort experiment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodePortResults {
    pub points: Vec<usize>,
    pub rounds: usize,
    pub durations_ms: Vec<(Mode, u64)>,
    pub node_port: u16,
    pub setups: Vec<Setup>,
    pub samples: Vec<Sample>,
    pub costs: Vec<TcCost>,
    /// The same in a request/response run on one connection: packets of an
    /// established flow only (`conns` counts its transactions).
    #[serde(default)]
    pub rr_costs: Vec<TcCost>,
    /// Ours, per point: `LB_STATS` counters summed over CPUs after the
    /// rounds (and the sanity run): (services, packets translated, new
    /// flows dropped for want of a free SNAT port).
    #[serde(default)]
    pub ours_stats: Vec<(usize, u64, u64)>,
    /// Ours with XDP: what translated its packets, per point and test,
    /// summed over the rounds' runs (`LB_STATS` read around each run).
    #[serde(default)]
    pub xdp_tallies: Vec<XdpTally>,
    pub notes: Vec<String>,
}

/// Packets of the XDP arm's runs in one test at one point, over all
/// rounds: how many the XDP stage translated and how many tc did, beside
/// the operations (connections or transactions) the runs made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct XdpTally {
    pub services: usize,
    pub mode: Mode,
    pub ops: u64,
    pub xdp_translated: u64,
    pub tc_translated: u64,
}

/// One tc program's run-time statistics over one run (connect+close, or
/// request/response in `NodePortResults::rr_costs`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TcCost {
    pub services: usize,
    pub round: usize,
    /// The pinned link's name (`tc_ingress_eth0`, `tc_egress_eth0`).
    pub prog: String,
    pub run_cnt: u64,
    pub run_time_ns: u64,
    /// Connections made during the measurement.
    pub conns: u64,
}

/// Test durations (ms): connect+close, TCP_CRR, and the rr control.
pub fn durations(quick: bool) -> [(Mode, u64); 3] {
    if quick {
        [(Mode::Cc, 600), (Mode::Crr, 500), (Mode::Rr, 300)]
    } else {
        [(Mode::Cc, 2000), (Mode::Crr, 1500), (Mode::Rr, 1000)]
    }
}

/// Scale points: 1 and 10 000 Services (`--quick`: 1 000).
pub fn points(opts: &Opts) -> Vec<usize> {
    opts.nodeport_points.clone().unwrap_or_else(|| {
        if opts.quick {
            vec![1000]
        } else {
            vec![1, 10_000]
        }
    })
}

/// The target's endpoints: addresses of pod `n2p0` on node n2.
fn endpoints(n: u8) -> Vec<Ipv4Addr> {
    (0..n.max(1))
        .map(|i| Ipv4Addr::new(10, 244, 2, 10 + i))
        .collect()
}

/// One arm: its cluster of namespaces, server, and agent or rules.
struct NpArm {
    kind: ArmKind,
    // Drop order: server, then the cluster (its agents first, then the
    // namespaces, then the agents' cgroups).
    _server: KillOnDrop,
    cluster: Cluster,
    /// Connections go to the first; cc and crr pick among all of them.
    targets: Vec<SocketAddrV4>,
    /// Ours: (pinned link name, program id) of the tc programs.
    tc_progs: Vec<(String, u32)>,
    /// Ours with XDP: its packets per test so far at this point.
    xdp_tallies: Option<Mutex<Vec<XdpTally>>>,
}

impl NpArm {
    fn client_ns(&self) -> &str {
        &self.cluster.client_netns
    }
}

impl Measured for NpArm {
    fn kind(&self) -> ArmKind {
        self.kind
    }

    fn measure(&self, bench_bin: &Path, mode: Mode, ms: u64) -> Result<Run> {
        let targets = if matches!(mode, Mode::Cc | Mode::Crr) {
            &self.targets[..]
        } else {
            &self.targets[..1]
        };
        let Some(tallies) = &self.xdp_tallies else {
            return run_bench_client(bench_bin, self.client_ns(), None, targets, mode, ms);
        };
        // Read outside the timed run: bpftool takes a few ms.
        let pins = self.cluster.agents[0].pin_dir();
        let before = translated(pins)?;
        let run = run_bench_client(bench_bin, self.client_ns(), None, targets, mode, ms)?;
        let after = translated(pins)?;
        let mut tallies = tallies.lock().unwrap_or_else(|e| e.into_inner());
        let t = match tallies.iter().position(|t| t.mode == mode) {
            Some(i) => &mut tallies[i],
            None => {
                // `services` is set when the point's rounds are over.
                tallies.push(XdpTally {
                    services: 0,
                    mode,
                    ops: 0,
                    xdp_translated: 0,
                    tc_translated: 0,
                });
                tallies.last_mut().expect("just pushed")
            }
        };
        t.ops += run.ops;
        t.xdp_translated += after.0.saturating_sub(before.0);
        t.tc_translated += after.1.saturating_sub(before.1);
        Ok(run)
    }

    fn sanity(&self, bench_bin: &Path) -> Result<()> {
        sanity(bench_bin, self)
    }

    fn agent_pids(&self) -> Vec<u32> {
        self.cluster.agents.iter().map(|ag| ag.pid()).collect()
    }
}

fn ruleset_file(kind: ArmKind, scenario: &Scenario, cache: &Path) -> Result<PathBuf> {
    match kind {
        ArmKind::IptablesNft | ArmKind::IptablesLegacy => {
            scenario.cached(cache, "npipt", |s| Ok(s.iptables_nodeport(NODE_PORT)))
        }
        ArmKind::Nftables => scenario.cached(cache, "npnft", |s| Ok(s.nft_nodeport(NODE_PORT))),
        _ => Err(anyhow!("no ruleset for {kind:?}")),
    }
}

/// `lb_common::stat` indices (this crate does not depend on lb-common).
const STAT_TC_TRANSLATED: u32 = 4;
const STAT_TC_DROP_SNAT_EXHAUSTED: u32 = 6;
const STAT_XDP_TRANSLATED: u32 = 45;

/// (packets translated in XDP, in tc) so far.
fn translated(pin_dir: &Path) -> Result<(u64, u64)> {
    Ok((
        lb_stat(pin_dir, STAT_XDP_TRANSLATED)?,
        lb_stat(pin_dir, STAT_TC_TRANSLATED)?,
    ))
}

/// Counter `index` of the pinned per-CPU `LB_STATS`, summed over CPUs.
fn lb_stat(pin_dir: &Path, index: u32) -> Result<u64> {
    let text = cmd::run(
        Command::new("bpftool")
            .args(["map", "lookup", "pinned"])
            .arg(pin_dir.join("LB_STATS"))
            .arg("key")
            .args(index.to_le_bytes().map(|b| b.to_string()))
            .arg("-j"),
    )?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    // With BTF: {"formatted": {"values": [{"cpu": 0, "value": N}, ...]}};
    // without: {"values": [{"cpu": 0, "value": ["0x01", ...]}, ...]}.
    let sum = |vals: &serde_json::Value| -> Option<u64> {
        vals.as_array()?
            .iter()
            .map(|c| {
                let x = &c["value"];
                x.as_u64().or_else(|| {
                    let bytes: Vec<u8> = x
                        .as_array()?
                        .iter()
                        .filter_map(|b| {
                            u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok()
                        })
                        .collect();
                    let mut a = [0u8; 8];
                    a.copy_from_slice(bytes.get(..8)?);
                    Some(u64::from_le_bytes(a))
                })
            })
            .sum()
    };
    sum(&v["formatted"]["values"])
        .or_else(|| sum(&v["values"]))
        .ok_or_else(|| anyhow!("LB_STATS[{index}]: unexpected {text}"))
}

/// `(link name, program id)` of the tc links pinned under `pin_dir/links`.
fn tc_programs(pin_dir: &Path) -> Result<Vec<(String, u32)>> {
    let mut out = Vec::new();
    let dir = pin_dir.join("links");
    for e in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with("tc_") {
            continue;
        }
        let text = cmd::run(
            Command::new("bpftool")
                .args(["link", "show", "pinned"])
                .arg(e.path())
                .arg("-j"),
        )?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let id = v["prog_id"]
            .as_u64()
            .ok_or_else(|| anyhow!("no prog_id for link {name}: {text}"))?;
        out.push((name, id as u32));
    }
    out.sort();
    if out.is_empty() {
        return Err(anyhow!("no tc links pinned in {}", dir.display()));
    }
    Ok(out)
}

fn setup_arm(at: &ArmCtx, kind: ArmKind) -> Result<(NpArm, Setup)> {
    let tag = format!("np{}-{}", at.scenario.services, kind.short());
    // n1: the node under test, no pods; n2: one pod holding the endpoints.
    let mut cluster = Cluster::new(&tag, &[0, 1])?;
    // Every arm on the test bed the XDP arm needs (a pass program on the
    // switch ports, checksum offload off on the senders, GSO off on the
    // switch ports): it changes what every sender and n1 do per packet, so
    // the arms compare only when they share it.
    cluster.accelerate()?;
    for a in at.scenario.target.iter().skip(1) {
        cluster.add_pod_address("n2p0", *a)?;
    }
    let n1 = cluster.nodes[0].netns.clone();
    let n2 = cluster.nodes[1].netns.clone();
    // n1 forwards back out of the device it received on: no ICMP
    // redirects (the client or n2 would otherwise learn to bypass it).
    cluster.sysctl(
        &n1,
        &[
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.default.send_redirects=0",
            "net.ipv4.conf.eth0.send_redirects=0",
        ],
    )?;
    // Replies to the client go back through n1 too (direct arm; the
    // others' replies go to n1's address anyway).
    let client = node_v4(integration_tests::nodes::CLIENT_INDEX);
    cmd::ip(&[
        "-n",
        &n2,
        "route",
        "add",
        &format!("{client}/32"),
        "via",
        &node_v4(1).to_string(),
    ])?;
    let server = spawn_server(at.bench_bin, &cluster.pod("n2p0").netns.clone())?;
    let mut setup = Setup::new(at.scenario.services, kind);
    let node_port = SocketAddrV4::new(node_v4(1), NODE_PORT);
    let mut arm = NpArm {
        kind,
        _server: server,
        cluster,
        targets: vec![node_port],
        tc_progs: Vec::new(),
        xdp_tallies: None,
    };
    match kind {
        ArmKind::Direct => {
            let client_ns = arm.cluster.client_netns.clone();
            arm.cluster.route_via(&client_ns, "10.244.2.0/24", 1)?;
            arm.targets = at.scenario.backends();
        }
        ArmKind::Ours | ArmKind::OursXdp => {
            // The same filler manifests as the ClusterIP experiment (cached
            // under its scenario), a Node object for n1, the NodePort target.
            let clusterip = Scenario::new(
                at.scenario.services,
                at.scenario.endpoints,
                rules::target_endpoints(at.opts.target_endpoints),
            );
            let dir = arm.cluster.manifests_dir().to_path_buf();
            if at.scenario.services > 1 {
                fs::copy(filler_file(&clusterip, at.cache)?, dir.join("fillers.json"))?;
            }
            let nodes =
                json!({"apiVersion": "v1", "kind": "List", "items": arm.cluster.node_objects()});
            arm.cluster.manifests.write_json("nodes.json", &nodes)?;
            arm.cluster.manifests.write_json(
                "target.json",
                &Scenario::target_nodeport_manifests(&at.scenario.target, NODE_PORT, "n2"),
            )?;
            let mut extra = capacity_args(at.scenario.services, at.scenario.endpoints);
            extra.extend(["--devices".to_string(), "eth0".to_string()]);
            if kind == ArmKind::OursXdp {
                extra.push("--acceleration=native".to_string());
            }
            let t0 = Instant::now();
            arm.cluster
                .start_agent_on(1, &extra, Duration::from_secs(at.opts.load_timeout))?;
            setup.load_s = Some(t0.elapsed().as_secs_f64());
            let agent = &arm.cluster.agents[0];
            setup.rss_mib = vm_hwm_mib(agent.pid());
            arm.tc_progs = tc_programs(agent.pin_dir())?;
            if kind == ArmKind::OursXdp {
                arm.xdp_tallies = Some(Mutex::new(Vec::new()));
            }
        }
        _ => {
            let file = ruleset_file(kind, at.scenario, at.cache)?;
            setup.loaded(load_rules(
                kind,
                &n1,
                &file,
                Duration::from_secs(at.opts.load_timeout),
            ));
        }
    }
    Ok((arm, setup))
}

/// One CRR run must work without errors before an arm is measured; the
/// direct arm's packets must cross n1 (the pass programs on the switch
/// ports must not change the client's route via n1).
fn sanity(bench_bin: &Path, arm: &NpArm) -> Result<()> {
    let n1 = &arm.cluster.nodes[0].netns;
    let before = rx_packets(n1)?;
    let run = arm.measure(bench_bin, Mode::Crr, 200)?;
    let crossed = rx_packets(n1)?.saturating_sub(before);
    let ops = run.ops;
    check_sanity(arm.kind, Mode::Crr, run)?;
    // A transaction is at least a SYN, an ACK, a request and a FIN from
    // the client, each through n1.
    if arm.kind == ArmKind::Direct && crossed < 4 * ops {
        bail!("direct: {crossed} packets received by n1's eth0 for {ops} transactions");
    }
    Ok(())
}

/// Packets received by `netns`'s `eth0` so far.
fn rx_packets(netns: &str) -> Result<u64> {
    let text =
        cmd::run(Command::new("ip").args(["-n", netns, "-s", "-j", "link", "show", "eth0"]))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    v[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .ok_or_else(|| anyhow!("no rx packets for eth0 in {netns}: {text}"))
}

/// Runs the experiment at every point into `np`.
pub fn run(
    opts: &Opts,
    bench_bin: &Path,
    cache: &Path,
    seed: &mut u64,
    np: &mut NodePortResults,
    save: &mut dyn FnMut(&NodePortResults) -> Result<()>,
) -> Result<()> {
    let mut skip: Vec<ArmKind> = Vec::new();
    for n in np.points.clone() {
        point(opts, bench_bin, cache, n, seed, &mut skip, np)?;
        save(np)?;
    }
    Ok(())
}

fn point(
    opts: &Opts,
    bench_bin: &Path,
    cache: &Path,
    services: usize,
    seed: &mut u64,
    skip: &mut Vec<ArmKind>,
    np: &mut NodePortResults,
) -> Result<()> {
    say(format!("=== NodePort: {services} Services ==="));
    let scenario = Scenario::new(services, FILLER_ENDPOINTS, endpoints(opts.target_endpoints));
    let at = ArmCtx::new(opts, &scenario, cache, bench_bin);
    let mut arms = set_up_arms(
        "NodePort ",
        &ArmKind::NODEPORT,
        services,
        bench_bin,
        skip,
        &mut np.setups,
        |kind| setup_arm(&at, kind),
    )?;
    // As in the ClusterIP experiment: the datapath needs no agent, and its
    // periodic resync would take a core from whichever arm runs. Paused, it
    // does not sweep conntrack either: LB_CONNTRACK is an LRU map.
    let paused: Vec<u32> = arms.iter().flat_map(Measured::agent_pids).collect();
    // The XDP arm's packets of the rounds only, not of its sanity run.
    let xdp_tallies = |arms: &[NpArm]| {
        arms.iter()
            .filter_map(|a| a.xdp_tallies.as_ref())
            .flat_map(|t| std::mem::take(&mut *t.lock().unwrap_or_else(|e| e.into_inner())))
            .collect::<Vec<XdpTally>>()
    };
    xdp_tallies(&arms);
    while_paused(&paused, || {
        rounds(opts, bench_bin, services, seed, &mut arms, np)
    })?;
    for mut t in xdp_tallies(&arms) {
        t.services = services;
        say(format!(
            "NodePort lb (ours, XDP) {}: {} packets translated in XDP, {} in tc, {} operations",
            t.mode.as_str(),
            t.xdp_translated,
            t.tc_translated,
            t.ops
        ));
        np.xdp_tallies.push(t);
    }
    if let Some(ours) = arms.iter().find(|a| a.kind == ArmKind::Ours) {
        let pins = ours.cluster.agents[0].pin_dir();
        match (
            lb_stat(pins, STAT_TC_TRANSLATED),
            lb_stat(pins, STAT_TC_DROP_SNAT_EXHAUSTED),
        ) {
            (Ok(t), Ok(f)) => {
                say(format!(
                    "NodePort lb (ours): {t} packets translated, {f} new flows dropped (no free SNAT port)"
                ));
                np.ours_stats.push((services, t, f));
            }
            (Err(e), _) | (_, Err(e)) => np
                .notes
                .push(format!("{services} Services: LB_STATS not read: {e}")),
        }
    }
    say(format!("tearing down the {services}-Service NodePort arms"));
    drop(arms);
    Ok(())
}

fn rounds(
    opts: &Opts,
    bench_bin: &Path,
    services: usize,
    seed: &mut u64,
    arms: &mut [NpArm],
    np: &mut NodePortResults,
) -> Result<()> {
    measure_rounds(
        "NodePort ",
        &durations(opts.quick),
        bench_bin,
        services,
        np.rounds,
        arms,
        seed,
        &mut np.samples,
        |round, arms| {
            // The tc programs' cost, in a connect+close run of its own.
            if let Some(ours) = arms.iter().find(|a| a.kind == ArmKind::Ours) {
                // The floor: an empty program before ours on each side of
                // n1's eth0, on the same packets.
                let n1 = &ours.cluster.nodes[0].netns;
                let floors: Vec<(String, TcFloor)> = [(true, FLOOR_INGRESS), (false, FLOOR_EGRESS)]
                    .into_iter()
                    .filter_map(
                        |(ingress, name)| match TcFloor::attach(n1, "eth0", ingress) {
                            Ok(f) => Some((name.to_string(), f)),
                            Err(e) => {
                                let note = format!("no empty tc program beside ours: {e:#}");
                                if !np.notes.contains(&note) {
                                    np.notes.push(note);
                                }
                                None
                            }
                        },
                    )
                    .collect();
                let progs: Vec<(String, u32)> = ours
                    .tc_progs
                    .iter()
                    .cloned()
                    .chain(floors.iter().map(|(name, f)| (name.clone(), f.id)))
                    .collect();
                let ids: Vec<u32> = progs.iter().map(|(_, id)| *id).collect();
                // connect+close (the goal's figure: every packet of short
                // flows), then request/response (established packets only).
                for (mode, costs) in [(Mode::Cc, &mut np.costs), (Mode::Rr, &mut np.rr_costs)] {
                    let (spent, run) =
                        with_bpf_stats(&ids, || ours.measure(bench_bin, mode, cost_run_ms(opts)))?;
                    for ((name, _), (run_time_ns, run_cnt)) in progs.iter().zip(spent) {
                        costs.push(TcCost {
                            services,
                            round,
                            prog: name.clone(),
                            run_cnt,
                            run_time_ns,
                            conns: run.ops,
                        });
                    }
                }
                drop(floors);
            }
            Ok(())
        },
    )
}
