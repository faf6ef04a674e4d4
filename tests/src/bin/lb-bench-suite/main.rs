//! `lb-bench-suite`: the benchmark behind `cargo xtask bench` (issue 6).
//!
//! Every arm gets its own client namespace wired to one backend namespace
//! (a bridge in a switch namespace, as the integration tests build it). The
//! client has no default route, only a route for the Service CIDR onto that
//! bridge. Arms: direct to the backend; ours (agent + socket programs, the
//! client in the child cgroup they attach to); kube-proxy's iptables shape
//! through `iptables-nft-restore` and `iptables-legacy-restore`; its
//! nftables shape through `nft -f`; IPVS is skipped when the kernel lacks it.
//! Rules are loaded only inside the client namespaces made here, and go with
//! them. Runs are interleaved: each round runs every arm in a new shuffled
//! order, so drift of the machine hits all arms alike.
//!
//! Writes `BENCHMARKS.md`, the chart and `target/bench/results.json`.
mod floor;
mod nodeport;
mod report;
mod rules;
mod schedulers;

use std::{
    fs,
    io::{BufRead as _, BufReader},
    net::{Ipv4Addr, Ipv6Addr, SocketAddrV4},
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use clap::Parser;
use integration_tests::{cgroup::CgroupGuard, cleanup, cmd, Agent, AgentOpts, Topology};
use serde::{Deserialize, Serialize};

use rules::{Scenario, BACKEND_PORT, SERVICE_CIDR, TARGET_PORT, TARGET_VIP};

#[derive(Parser, Clone)]
#[command(about = "Runs the load-balancer benchmark (root; namespaces only)")]
pub struct Opts {
    /// Small scale points, few rounds, short runs: a few minutes.
    #[arg(long)]
    pub quick: bool,
    /// Workspace root (BENCHMARKS.md, docs/bench.png, target/).
    #[arg(long, default_value = ".")]
    pub root: PathBuf,
    /// Override the scale points (Services).
    #[arg(long, value_delimiter = ',')]
    pub points: Option<Vec<usize>>,
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Skip the control-plane experiment.
    #[arg(long)]
    pub no_control_plane: bool,
    /// Skip the datapath experiment.
    #[arg(long)]
    pub no_datapath: bool,
    /// Skip the NodePort (tc path) experiment.
    #[arg(long)]
    pub no_nodeport: bool,
    /// Skip the schedulers experiment (connect4's cost per algorithm, the
    /// spread of long-lived connections).
    #[arg(long)]
    pub no_schedulers: bool,
    /// Override the NodePort experiment's scale points (Services).
    #[arg(long, value_delimiter = ',')]
    pub nodeport_points: Option<Vec<usize>>,
    /// Give up loading one ruleset after this long (seconds).
    #[arg(long, default_value_t = 240)]
    pub load_timeout: u64,
    /// Only rewrite BENCHMARKS.md and the chart from target/bench/results.json.
    #[arg(long)]
    pub report_only: bool,
    /// Ours only, without the rule loads of the other arms: in the control
    /// plane (a quick A/B of the agent's first sync and memory), and in the
    /// ClusterIP experiment (ours and direct, e.g. the agent's RSS at
    /// 100 000 Services with `--points 100000`). With `--root <scratch>`,
    /// as the report then shows the others as not run.
    #[arg(long)]
    pub only_ours: bool,
    /// Endpoints of the target Service (addresses 10.244.1.1..=N of the backend).
    #[arg(long, default_value_t = 4)]
    pub target_endpoints: u8,
}

/// Test durations (ms) for cc, crr, rr, udp.
fn durations(quick: bool) -> [(Mode, u64); 4] {
    if quick {
        [
            (Mode::Cc, 600),
            (Mode::Crr, 500),
            (Mode::Rr, 300),
            (Mode::Udp, 300),
        ]
    } else {
        [
            (Mode::Cc, 2000),
            (Mode::Crr, 1500),
            (Mode::Rr, 1000),
            (Mode::Udp, 1000),
        ]
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Cc,
    Crr,
    Rr,
    Udp,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Cc => "cc",
            Mode::Crr => "crr",
            Mode::Rr => "rr",
            Mode::Udp => "udp",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum ArmKind {
    Direct,
    /// `Direct` again, as a second arm of the same rounds: the A/A control
    /// of the connect-rate ratios (only in [`NoiseFloor`]).
    DirectAgain,
    /// Direct from ours' own client namespace, outside its cgroup (so no
    /// program of ours runs), to the backend's addresses: the A/A
    /// control's comparison without a second topology (only in
    /// [`NoiseFloor`]).
    DirectBeside,
    Ours,
    /// Ours with its XDP stage (`--acceleration=native`) on a test bed
    /// made ready for it: only in the NodePort experiment, the tc path's.
    OursXdp,
    IptablesNft,
    IptablesLegacy,
    Nftables,
}

impl ArmKind {
    pub const ALL: [ArmKind; 5] = [
        ArmKind::Direct,
        ArmKind::Ours,
        ArmKind::IptablesNft,
        ArmKind::IptablesLegacy,
        ArmKind::Nftables,
    ];

    /// The NodePort experiment's arms: [`ALL`](Self::ALL) and ours with
    /// its XDP stage, in the report's order.
    pub const NODEPORT: [ArmKind; 6] = [
        ArmKind::Direct,
        ArmKind::Ours,
        ArmKind::OursXdp,
        ArmKind::IptablesNft,
        ArmKind::IptablesLegacy,
        ArmKind::Nftables,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ArmKind::Direct => "direct",
            ArmKind::DirectAgain => "direct (again)",
            ArmKind::DirectBeside => "direct (ours' namespaces)",
            ArmKind::Ours => "lb (ours)",
            ArmKind::OursXdp => "lb (ours, XDP)",
            ArmKind::IptablesNft => "iptables (nft)",
            ArmKind::IptablesLegacy => "iptables (legacy)",
            ArmKind::Nftables => "nftables",
        }
    }

    fn short(self) -> &'static str {
        match self {
            ArmKind::Direct => "direct",
            ArmKind::DirectAgain => "direct2",
            ArmKind::DirectBeside => "direct-o",
            ArmKind::Ours => "ours",
            ArmKind::OursXdp => "oursx",
            ArmKind::IptablesNft => "iptnft",
            ArmKind::IptablesLegacy => "iptleg",
            ArmKind::Nftables => "nft",
        }
    }
}

/// One `lb-bench client` run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Run {
    pub mode: String,
    pub ops: u64,
    pub errors: u64,
    pub elapsed_s: f64,
    pub rate: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    #[serde(default)]
    pub first_error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub services: usize,
    pub round: usize,
    pub arm: ArmKind,
    pub mode: Mode,
    pub run: Run,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cost {
    pub services: usize,
    pub round: usize,
    pub run_cnt: u64,
    pub run_time_ns: u64,
    /// The same for an empty connect4 program attached beside ours during
    /// the run (`floor`): what the statistics charge a program that does
    /// nothing.
    #[serde(default)]
    pub floor_run_cnt: u64,
    #[serde(default)]
    pub floor_run_time_ns: u64,
}

/// What the arms of a scale point are set up from.
pub struct ArmCtx<'a> {
    pub opts: &'a Opts,
    pub scenario: &'a Scenario,
    pub cache: &'a Path,
    pub bench_bin: &'a Path,
}

impl<'a> ArmCtx<'a> {
    pub fn new(
        opts: &'a Opts,
        scenario: &'a Scenario,
        cache: &'a Path,
        bench_bin: &'a Path,
    ) -> Self {
        ArmCtx {
            opts,
            scenario,
            cache,
            bench_bin,
        }
    }
}

/// How an arm fared at one scale point before any traffic.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Setup {
    pub services: usize,
    pub arm: ArmKind,
    /// Time to load the rules (or start the agent until /readyz).
    pub load_s: Option<f64>,
    /// Why the arm did not run at this point.
    pub skipped: Option<String>,
    /// Ours: the agent's peak RSS (VmHWM), MiB.
    pub rss_mib: Option<f64>,
}

/// Why an arm is left out of the larger scale points.
pub const SKIPPED_EARLIER: &str =
    "skipped: did not load at the previous scale point within the time limit";

impl Setup {
    /// Nothing measured yet.
    pub fn new(services: usize, arm: ArmKind) -> Self {
        Setup {
            services,
            arm,
            load_s: None,
            skipped: None,
            rss_mib: None,
        }
    }

    pub fn skipped_earlier(services: usize, arm: ArmKind) -> Self {
        Setup {
            skipped: Some(SKIPPED_EARLIER.into()),
            ..Setup::new(services, arm)
        }
    }

    /// The outcome of [`load_rules`]: how long it took, or why it failed.
    pub fn loaded(&mut self, r: Result<f64, String>) {
        match r {
            Ok(s) => self.load_s = Some(s),
            Err(e) => self.skipped = Some(e),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControlPlane {
    pub services: usize,
    pub endpoints: usize,
    /// Agent started → /readyz 200 (load + verify + attach + parse + sync).
    pub ours_ready_s: Option<f64>,
    /// The first sync alone (read the manifests, translate, write the
    /// maps), from the agent's log: the median of three starts from empty
    /// maps (`ours_sync_runs_ms`), with that start's parts and start time.
    pub ours_sync_ms: Option<f64>,
    /// Every start's first sync, in order.
    #[serde(default)]
    pub ours_sync_runs_ms: Vec<f64>,
    /// Its parts: reading + translating, and the map writes.
    #[serde(default)]
    pub ours_read_translate_ms: Option<f64>,
    #[serde(default)]
    pub ours_apply_ms: Option<f64>,
    /// `lb_frontends_programmed` once ready, and what it should be.
    pub ours_frontends: Option<(u64, u64)>,
    pub ours_rss_mib: Option<f64>,
    /// Endpoint change: file renamed → first connection to the new backend.
    pub change_ms: Vec<f64>,
    /// The agent's sync for each change, from its log.
    pub change_sync_ms: Vec<f64>,
    /// The map writes of each change's sync.
    #[serde(default)]
    pub change_apply_ms: Vec<f64>,
    pub iptables_nft_s: Result<f64, String>,
    pub iptables_legacy_s: Result<f64, String>,
    pub nft_s: Result<f64, String>,
    pub notes: Vec<String>,
    /// The same objects through the list/watch fixture (cluster mode).
    #[serde(default)]
    pub cluster: Option<ClusterStart>,
}

/// Cluster mode's start on the control-plane scenario: the agent lists the
/// objects from the API server fixture in pages of 500 (kube-rs's watcher
/// default) and programs them.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClusterStart {
    /// Agent started → /readyz 200.
    pub ready_s: Option<f64>,
    /// Watches started → the first sync of every listed object done
    /// (lists, decoding, translation, map writes).
    pub input_to_maps_ms: Option<f64>,
    /// That first sync alone, and its parts.
    pub sync_ms: Option<f64>,
    pub read_translate_ms: Option<f64>,
    pub apply_ms: Option<f64>,
    /// Each kind's list: (kind, objects, ms).
    pub lists: Vec<(String, u64, f64)>,
    pub frontends: Option<(u64, u64)>,
    pub rss_mib: Option<f64>,
    /// The agent's CPU time (user and system, every thread) and minor page
    /// faults from its start until ready: the work done, which the wall
    /// times above show only through a machine's noise.
    #[serde(default)]
    pub cpu_ms: Option<f64>,
    #[serde(default)]
    pub minor_faults: Option<u64>,
    /// Input to maps of every start (this one is the median).
    #[serde(default)]
    pub runs_ms: Vec<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub date: String,
    pub commit: String,
    pub iptables: String,
    pub nft: String,
    /// `/sys/devices/system/cpu/vulnerabilities/spec_rstack_overflow`:
    /// with "Mitigation: Safe RET" every return in the kernel goes through
    /// a thunk, and each helper and map call of the programs costs more.
    #[serde(default)]
    pub srso: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub machine: Machine,
    pub quick: bool,
    pub points: Vec<usize>,
    pub rounds: usize,
    pub durations_ms: Vec<(Mode, u64)>,
    pub target_endpoints: usize,
    pub filler_endpoints: usize,
    pub ipvs: String,
    pub setups: Vec<Setup>,
    pub samples: Vec<Sample>,
    pub costs: Vec<Cost>,
    pub control: Option<ControlPlane>,
    /// The NodePort (tc path) experiment.
    #[serde(default)]
    pub nodeport: Option<nodeport::NodePortResults>,
    /// The connect rate's A/A control, at every point.
    #[serde(default)]
    pub noise_floors: Vec<NoiseFloor>,
    /// Results saved before `noise_floors`: the A/A control at the
    /// smallest point only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_floor: Option<NoiseFloor>,
    /// The schedulers experiment (issue 39).
    #[serde(default)]
    pub schedulers: Option<schedulers::SchedulerResults>,
    pub elapsed_s: f64,
}

impl Results {
    /// The A/A controls measured, by point.
    pub fn noise_floors(&self) -> impl Iterator<Item = &NoiseFloor> {
        self.noise_floors.iter().chain(&self.noise_floor)
    }
}

/// Connect+close only, at a ClusterIP point, in more rounds than the main
/// experiment: direct, direct again (a second backend namespace,
/// the same test) and ours, shuffled each round. Direct again ÷ direct is
/// what the machine's noise alone does to a ratio that should be 1.000;
/// ours ÷ direct beside it says whether our gap can be told from it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NoiseFloor {
    pub services: usize,
    pub rounds: usize,
    pub cc_ms: u64,
    pub samples: Vec<Sample>,
}

/// Rounds of the A/A control (quick: a few).
fn noise_floor_rounds(quick: bool) -> usize {
    if quick {
        3
    } else {
        21
    }
}

/// Endpoints of every filler Service at the datapath scale points.
const FILLER_ENDPOINTS: usize = 2;

fn main() {
    let opts = Opts::parse();
    if let Err(e) = cleanup::teardown_on_ctrl_c("\ninterrupted: tearing down", || {}) {
        eprintln!("warning: no Ctrl-C handler: {e}");
    }
    let r = run(&opts);
    cleanup::run_all();
    if let Err(e) = r {
        eprintln!("lb-bench-suite: error: {e:#}");
        std::process::exit(1);
    }
}

fn say(msg: impl AsRef<str>) {
    println!("bench: {}", msg.as_ref());
}

fn run(opts: &Opts) -> Result<()> {
    if opts.report_only {
        let root = fs::canonicalize(&opts.root).context("--root")?;
        let path = root.join("target/bench/results.json");
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let results: Results = serde_json::from_str(&text)?;
        report::write(&root, &results)?;
        say("rewrote BENCHMARKS.md and docs/bench.png from the saved results");
        return Ok(());
    }
    if !integration_tests::is_root() {
        bail!("the benchmark needs root (network namespaces, cgroups, eBPF)");
    }
    let started = Instant::now();
    let root = fs::canonicalize(&opts.root).context("--root")?;
    let cache = root.join("target/bench-cache");
    let out_dir = root.join("target/bench");
    fs::create_dir_all(&out_dir)?;
    for tool in [
        "iptables-nft-restore",
        "iptables-legacy-restore",
        "nft",
        "bpftool",
    ] {
        if which(tool).is_none() {
            bail!(
                "{tool} not found; run `cargo xtask setup` (installs iptables, nftables, bpftool)"
            );
        }
    }
    let bench_bin = sibling_bin("lb-bench")?;
    let points = opts.points.clone().unwrap_or_else(|| {
        if opts.quick {
            vec![1, 1000]
        } else {
            vec![1, 1000, 10_000, 100_000]
        }
    });
    let rounds = opts.rounds.unwrap_or(if opts.quick { 3 } else { 7 });
    let ipvs = ipvs_status();
    say(format!("IPVS arm: {ipvs}"));
    let mut results = Results {
        machine: machine(&root),
        quick: opts.quick,
        points: points.clone(),
        rounds,
        durations_ms: durations(opts.quick).to_vec(),
        target_endpoints: opts.target_endpoints as usize,
        filler_endpoints: FILLER_ENDPOINTS,
        ipvs,
        setups: Vec::new(),
        samples: Vec::new(),
        costs: Vec::new(),
        control: None,
        nodeport: None,
        noise_floors: Vec::new(),
        noise_floor: None,
        schedulers: None,
        elapsed_s: 0.0,
    };
    let json_path = out_dir.join("results.json");
    if !opts.no_datapath {
        let mut seed = seed();
        let mut skip_next: Vec<ArmKind> = if opts.only_ours {
            vec![
                ArmKind::IptablesNft,
                ArmKind::IptablesLegacy,
                ArmKind::Nftables,
            ]
        } else {
            Vec::new()
        };
        for &n in &points {
            datapath_point(
                opts,
                &bench_bin,
                &cache,
                n,
                rounds,
                &mut seed,
                &mut skip_next,
                &mut results,
            )?;
            fs::write(&json_path, serde_json::to_string_pretty(&results)?)?;
        }
    }
    if !opts.no_schedulers {
        let mut seed = seed();
        results.schedulers = Some(schedulers::run(opts, &bench_bin, &mut seed)?);
        fs::write(&json_path, serde_json::to_string_pretty(&results)?)?;
    }
    if !opts.no_nodeport {
        let mut np = nodeport::NodePortResults {
            points: nodeport::points(opts),
            rounds,
            durations_ms: nodeport::durations(opts.quick).to_vec(),
            node_port: nodeport::NODE_PORT,
            setups: Vec::new(),
            samples: Vec::new(),
            costs: Vec::new(),
            rr_costs: Vec::new(),
            ours_stats: Vec::new(),
            xdp_tallies: Vec::new(),
            notes: Vec::new(),
        };
        let mut seed = seed();
        let mut save = |np: &nodeport::NodePortResults| -> Result<()> {
            results.nodeport = Some(np.clone());
            fs::write(&json_path, serde_json::to_string_pretty(&results)?)?;
            Ok(())
        };
        nodeport::run(opts, &bench_bin, &cache, &mut seed, &mut np, &mut save)?;
        results.nodeport = Some(np);
    }
    if !opts.no_control_plane {
        let n = if opts.quick { 1000 } else { 10_000 };
        results.control = Some(control_plane(opts, &bench_bin, &cache, n)?);
    }
    results.elapsed_s = started.elapsed().as_secs_f64();
    fs::write(&json_path, serde_json::to_string_pretty(&results)?)?;
    say(format!("results: {}", json_path.display()));
    report::write(&root, &results)?;
    say(format!(
        "wrote {} and {} in {:.0} s",
        root.join("BENCHMARKS.md").display(),
        root.join("docs/bench.png").display(),
        results.elapsed_s
    ));
    Ok(())
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1
}

fn next_rand(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn shuffle<T>(v: &mut [T], s: &mut u64) {
    for i in (1..v.len()).rev() {
        let j = (next_rand(s) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// A binary built next to this one (target/release).
fn sibling_bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.with_file_name(name);
    if p.is_file() {
        Ok(p)
    } else {
        bail!("{} not found; run `cargo xtask build`", p.display())
    }
}

fn ipvs_status() -> String {
    if Path::new("/proc/net/ip_vs").exists() {
        return "skipped: the kernel has IP_VS, but this suite has no IPVS arm yet".into();
    }
    let config = Command::new("sh")
        .args([
            "-c",
            "zcat /proc/config.gz 2>/dev/null | grep -E '^(# )?CONFIG_IP_VS[ =]'",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let detail = if config.is_empty() {
        "no /proc/net/ip_vs".to_string()
    } else {
        format!("no /proc/net/ip_vs; /proc/config.gz: `{config}`")
    };
    format!("skipped: this kernel has no IPVS ({detail})")
}

fn read_trim(path: &str) -> String {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn first_line(cmd: &mut Command) -> String {
    cmd.output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

fn machine(root: &Path) -> Machine {
    let cpuinfo = read_trim("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "?".into());
    let memory = read_trim("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<f64>().ok())
        .map(|kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0))
        .unwrap_or_default();
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory,
        kernel: read_trim("/proc/sys/kernel/osrelease"),
        date: first_line(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])),
        commit: first_line(Command::new("git").current_dir(root).args([
            "rev-parse",
            "--short",
            "HEAD",
        ])),
        iptables: first_line(Command::new("iptables-legacy").arg("--version")),
        nft: first_line(Command::new("nft").arg("--version")),
        srso: read_trim("/sys/devices/system/cpu/vulnerabilities/spec_rstack_overflow"),
    }
}

/// A child that is killed when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One arm at one scale point: its namespaces, server, rules or agent.
struct Arm {
    kind: ArmKind,
    // Drop order: agent (detaches), server, namespaces, cgroup.
    agent: Option<Agent>,
    _server: KillOnDrop,
    topo: Topology,
    cgroup: Option<CgroupGuard>,
    _dir: Option<tempfile::TempDir>,
    tcp: SocketAddrV4,
    udp: SocketAddrV4,
    /// Direct: every endpoint, picked at random per connection.
    direct: Vec<SocketAddrV4>,
    /// Ours: the connect4 program's id, for its run-time statistics.
    connect4: Option<u32>,
}

impl Arm {
    fn client_ns(&self) -> &str {
        self.topo.client_netns()
    }
}

/// Client and backend namespaces on a bridge; the backend holds the
/// target's endpoint addresses and runs `lb-bench server` on core 1; the
/// client has a route for the Service CIDR only.
fn testbed(tag: &str, bench_bin: &Path, endpoints: u8) -> Result<(Topology, KillOnDrop)> {
    let mut topo = Topology::new(tag)?;
    topo.add_host(
        "backend",
        Ipv4Addr::new(10, 244, 1, 1),
        Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 1),
    )?;
    topo.add_host(
        "client",
        Ipv4Addr::new(10, 244, 1, 100),
        Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x100),
    )?;
    let backend = topo.host("backend").netns.clone();
    for a in rules::target_endpoints(endpoints.max(2)).iter().skip(1) {
        cmd::ip(&[
            "-n",
            &backend,
            "addr",
            "add",
            &format!("{a}/24"),
            "dev",
            "eth0",
        ])?;
    }
    let client = topo.client_netns().to_string();
    cmd::ip(&["-n", &client, "route", "add", SERVICE_CIDR, "dev", "eth0"])?;
    let server = spawn_server(bench_bin, &backend)?;
    Ok((topo, server))
}

fn spawn_server(bench_bin: &Path, netns: &str) -> Result<KillOnDrop> {
    let mut c = Command::new(bench_bin);
    c.args(["server", "--netns", netns, "--cpu", "1"])
        .args(["--port", &BACKEND_PORT.to_string()]);
    let line = cmd::display(&c);
    let mut child = cmd::die_with_parent(&mut c, libc::SIGKILL)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    let stdout = child.stdout.take().expect("piped");
    let child = KillOnDrop(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = BufReader::new(stdout).read_line(&mut l);
        let _ = tx.send(l);
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(l) if l.contains("listening") => Ok(child),
        other => bail!("`{line}` did not start: {other:?}"),
    }
}

/// Runs `cmd` with stdin from `input`, killing it after `timeout`; the
/// wall time on success.
fn timed(cmd: &mut Command, input: Option<&Path>, timeout: Duration) -> Result<f64, String> {
    let line = cmd::display(cmd);
    if let Some(f) = input {
        let file = fs::File::open(f).map_err(|e| format!("{}: {e}", f.display()))?;
        cmd.stdin(file);
    } else {
        cmd.stdin(Stdio::null());
    }
    let t0 = Instant::now();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("`{line}`: {e}"))?;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => {
                let took = t0.elapsed().as_secs_f64();
                if st.success() {
                    return Ok(took);
                }
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read as _;
                    let _ = e.read_to_string(&mut err);
                }
                let err: String = err.chars().take(400).collect();
                return Err(format!("`{line}` failed ({st}): {}", err.trim()));
            }
            Ok(None) if t0.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "not loaded within {} s (killed)",
                    timeout.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn netns_cmd(netns: &str, prog: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", netns, prog]).args(args);
    c
}

/// `(file, command)` that loads an arm's ruleset into `netns`.
fn load_rules(kind: ArmKind, netns: &str, file: &Path, timeout: Duration) -> Result<f64, String> {
    match kind {
        ArmKind::IptablesNft => timed(
            &mut netns_cmd(netns, "iptables-nft-restore", &[]),
            Some(file),
            timeout,
        ),
        ArmKind::IptablesLegacy => timed(
            &mut netns_cmd(netns, "iptables-legacy-restore", &[]),
            Some(file),
            timeout,
        ),
        ArmKind::Nftables => timed(
            &mut netns_cmd(netns, "nft", &["-f", &file.to_string_lossy()]),
            None,
            timeout,
        ),
        _ => Err("no ruleset".into()),
    }
}

fn ruleset_file(kind: ArmKind, scenario: &Scenario, cache: &Path) -> Result<PathBuf> {
    match kind {
        ArmKind::IptablesNft | ArmKind::IptablesLegacy => {
            scenario.cached(cache, "iptables", |s| Ok(s.iptables()))
        }
        ArmKind::Nftables => scenario.cached(cache, "nft", |s| Ok(s.nft())),
        _ => bail!("no ruleset for {kind:?}"),
    }
}

fn filler_file(scenario: &Scenario, cache: &Path) -> Result<PathBuf> {
    scenario.cached(cache, "json", |s| {
        Ok(serde_json::to_string(&s.filler_manifests())?)
    })
}

/// Map capacities for `services` Services of `endpoints` endpoints.
fn capacity_args(services: usize, endpoints: usize) -> Vec<String> {
    let need = |n: usize| -> u32 { (n.next_power_of_two() as u32).max(1024) };
    let frontends = services + 8;
    let backends = services * endpoints + 64;
    vec![
        "--max-services".into(),
        need(2 * frontends).max(lb_default_services()).to_string(),
        "--max-backends".into(),
        need(backends).max(262_144).to_string(),
        "--max-slots".into(),
        need(2 * backends).max(524_288).to_string(),
    ]
}

fn lb_default_services() -> u32 {
    65_536
}

fn start_ours(
    topo_tag: &str,
    scenario: &Scenario,
    cache: &Path,
    extra: &[&str],
    ready_timeout: Duration,
) -> Result<(CgroupGuard, tempfile::TempDir, Agent, f64)> {
    let cgroup = CgroupGuard::create(topo_tag)?;
    let dir = tempfile::Builder::new()
        .prefix(&integration_tests::unique_name(topo_tag))
        .tempdir()?;
    let manifests = dir.path().join("manifests");
    fs::create_dir_all(&manifests)?;
    if scenario.services > 1 {
        fs::copy(
            filler_file(scenario, cache)?,
            manifests.join("fillers.json"),
        )?;
    }
    write_target(&manifests, &scenario.target)?;
    let mut extra_args = capacity_args(scenario.services, scenario.endpoints);
    extra_args.extend(extra.iter().map(|s| s.to_string()));
    let opts = AgentOpts {
        ready_timeout,
        log_file: Some(dir.path().join("agent.log")),
        extra_args,
        ..Default::default()
    };
    let t0 = Instant::now();
    let agent = Agent::start(&manifests, cgroup.path(), opts)?;
    let took = t0.elapsed().as_secs_f64();
    Ok((cgroup, dir, agent, took))
}

fn write_target(manifests: &Path, target: &[Ipv4Addr]) -> Result<()> {
    let tmp = manifests.join(".target.json.tmp");
    fs::write(
        &tmp,
        serde_json::to_string(&Scenario::target_manifests(target))?,
    )?;
    fs::rename(&tmp, manifests.join("target.json"))?;
    Ok(())
}

/// The middle one of `items` by `key`, those without a key counted as
/// slowest: the start a first-sync figure is judged on.
fn median_by<T: Clone>(items: &[T], key: impl Fn(&T) -> Option<f64>) -> Option<T> {
    let mut sorted: Vec<&T> = items.iter().collect();
    sorted.sort_by(|a, b| {
        let k = |x: &T| key(x).unwrap_or(f64::INFINITY);
        k(a).total_cmp(&k(b))
    });
    sorted.get(sorted.len() / 2).map(|m| (*m).clone())
}

/// [`wait_for_quiet`] up to 30 s before `what`, saying when it waited.
fn quiet(what: &str) {
    match wait_for_quiet(Duration::from_secs(30)) {
        Some(t) if t > Duration::from_millis(500) => say(format!(
            "waited {:.1} s for a quiet machine before {what}",
            t.as_secs_f64()
        )),
        Some(_) => {}
        None => say(format!(
            "the machine was not quiet within 30 s before {what}"
        )),
    }
}

/// Waits until the machine's CPUs were at least 90 % idle over 200 ms, for
/// at most `max`: the kernel finishes an earlier experiment's teardown
/// (network namespaces, rule tables, maps of 100 000 Services) in its own
/// workers, and a start of a few hundred milliseconds measured beside that
/// measures it too. How long it waited, or `None` when it never was quiet.
fn wait_for_quiet(max: Duration) -> Option<Duration> {
    // (idle and iowait, all) jiffies of the "cpu" line.
    let sample = || -> Option<(u64, u64)> {
        let s = fs::read_to_string("/proc/stat").ok()?;
        let f: Vec<u64> = s
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        Some((f.get(3)? + f.get(4)?, f.iter().take(8).sum()))
    };
    let t0 = Instant::now();
    while t0.elapsed() < max {
        let a = sample()?;
        std::thread::sleep(Duration::from_millis(200));
        let b = sample()?;
        // iowait may go backwards (proc(5)).
        let (idle, all) = (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1));
        if all > 0 && idle * 10 >= all * 9 {
            return Some(t0.elapsed());
        }
    }
    None
}

/// A process's CPU time (ms, user and system, every thread) and minor page
/// faults so far, from `/proc/<pid>/stat`.
fn cpu_and_faults(pid: u32) -> Option<(f64, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command, which may hold spaces, in parentheses.
    let rest: Vec<&str> = s.get(s.rfind(')')? + 2..)?.split_whitespace().collect();
    // proc(5) numbers them from 1 with the pid: minflt is 10, utime 14,
    // stime 15; `rest` starts at field 3.
    let field = |n: usize| rest.get(n - 3)?.parse::<u64>().ok();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = field(14)? + field(15)?;
    Some((ticks as f64 * 1000.0 / hz, field(10)?))
}

fn vm_hwm_mib(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The id of the `connect4` program attached to `cgroup`.
fn connect4_id(cgroup: &Path) -> Result<u32> {
    let out = cmd::run(
        Command::new("bpftool")
            .args(["cgroup", "show"])
            .arg(cgroup)
            .arg("-j"),
    )?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v.as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"].as_str() == Some("connect4"))
        .and_then(|p| p["id"].as_u64())
        .map(|id| id as u32)
        .ok_or_else(|| anyhow!("no connect4 program on {}: {out}", cgroup.display()))
}

/// (run_time_ns, run_cnt) of program `id`.
fn prog_stats(id: u32) -> Result<(u64, u64)> {
    let out =
        cmd::run(Command::new("bpftool").args(["prog", "show", "id", &id.to_string(), "-j"]))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    Ok((
        v["run_time_ns"].as_u64().unwrap_or(0),
        v["run_cnt"].as_u64().unwrap_or(0),
    ))
}

/// BPF_ENABLE_STATS: run-time statistics for as long as the fd is open,
/// without touching the `kernel.bpf_stats_enabled` sysctl.
fn enable_bpf_stats() -> Result<OwnedFd> {
    #[repr(C)]
    struct Attr {
        kind: u32,
    }
    let mut attr = Attr { kind: 0 }; // BPF_STATS_RUN_TIME
                                     // SAFETY: BPF_ENABLE_STATS (32) reads a u32 and returns a new fd.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            32 as libc::c_long,
            &mut attr as *mut Attr as *mut libc::c_void,
            std::mem::size_of::<Attr>() as libc::c_uint,
        )
    };
    if fd < 0 {
        bail!("BPF_ENABLE_STATS: {}", std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn client_cmd(
    bench_bin: &Path,
    arm: &Arm,
    mode: &str,
    target: SocketAddrV4,
    duration_ms: u64,
) -> Command {
    let mut c = Command::new(bench_bin);
    c.args(["client", "--netns", arm.client_ns(), "--cpu", "0"])
        .args(["--target", &target.to_string(), "--mode", mode])
        .args(["--duration-ms", &duration_ms.to_string()])
        .args(["--timeout-ms", "1000"]);
    if let Some(cg) = &arm.cgroup {
        c.arg("--cgroup").arg(cg.path());
    }
    c
}

fn run_client(bench_bin: &Path, arm: &Arm, mode: Mode, duration_ms: u64) -> Result<Run> {
    let target = if mode == Mode::Udp { arm.udp } else { arm.tcp };
    let mut targets = vec![target];
    if matches!(mode, Mode::Cc | Mode::Crr) {
        targets.extend(arm.direct.iter().skip(1));
    }
    run_bench_client(
        bench_bin,
        arm.client_ns(),
        arm.cgroup.as_ref().map(|c| c.path()),
        &targets,
        mode,
        duration_ms,
    )
}

/// One `lb-bench client` run in `netns` (in `cgroup` if given) at
/// `targets` (cc and crr pick one per connection; the others use the
/// first), pinned to core 0.
fn run_bench_client(
    bench_bin: &Path,
    netns: &str,
    cgroup: Option<&Path>,
    targets: &[SocketAddrV4],
    mode: Mode,
    duration_ms: u64,
) -> Result<Run> {
    let mut c = Command::new(bench_bin);
    c.args(["client", "--netns", netns, "--cpu", "0"])
        .args(["--mode", mode.as_str()])
        .args(["--duration-ms", &duration_ms.to_string()])
        .args(["--timeout-ms", "1000"]);
    for t in targets {
        c.args(["--target", &t.to_string()]);
    }
    if let Some(cg) = cgroup {
        c.arg("--cgroup").arg(cg);
    }
    let line = cmd::display(&c);
    let mut child = cmd::die_with_parent(&mut c, libc::SIGKILL)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    // Bounded: the client stops itself at its duration; this is the backstop.
    let deadline = Instant::now() + Duration::from_millis(duration_ms) + Duration::from_secs(15);
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{line}` did not finish in time; killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "`{line}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "`{line}` printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn setup_arm(at: &ArmCtx, kind: ArmKind) -> Result<(Arm, Setup)> {
    let tag = format!("b{}-{}", at.scenario.services, kind.short());
    let (topo, server) = testbed(&tag, at.bench_bin, at.opts.target_endpoints)?;
    let vip_tcp = SocketAddrV4::new(TARGET_VIP, TARGET_PORT);
    let mut setup = Setup::new(at.scenario.services, kind);
    let mut arm = Arm {
        kind,
        agent: None,
        _server: server,
        topo,
        cgroup: None,
        _dir: None,
        tcp: vip_tcp,
        udp: vip_tcp,
        direct: Vec::new(),
        connect4: None,
    };
    match kind {
        ArmKind::DirectBeside => bail!("direct (ours' namespaces) is a view of ours, not an arm"),
        ArmKind::OursXdp => bail!("ours with XDP is an arm of the NodePort experiment only"),
        ArmKind::Direct | ArmKind::DirectAgain => {
            let b = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 1), BACKEND_PORT);
            arm.tcp = b;
            arm.udp = b;
            arm.direct = at.scenario.backends();
        }
        ArmKind::Ours => {
            let (cg, dir, agent, took) = start_ours(
                &tag,
                at.scenario,
                at.cache,
                &[],
                Duration::from_secs(at.opts.load_timeout),
            )?;
            setup.load_s = Some(took);
            setup.rss_mib = vm_hwm_mib(agent.pid());
            arm.connect4 = Some(connect4_id(cg.path())?);
            arm.agent = Some(agent);
            arm.cgroup = Some(cg);
            arm._dir = Some(dir);
        }
        _ => {
            let file = ruleset_file(kind, at.scenario, at.cache)?;
            setup.loaded(load_rules(
                kind,
                arm.client_ns(),
                &file,
                Duration::from_secs(at.opts.load_timeout),
            ));
        }
    }
    Ok((arm, setup))
}

/// One CRR and one UDP exchange must work before an arm is measured.
fn sanity(bench_bin: &Path, arm: &impl Measured) -> Result<()> {
    for mode in [Mode::Crr, Mode::Udp] {
        check_sanity(arm.kind(), mode, arm.measure(bench_bin, mode, 200)?)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn datapath_point(
    opts: &Opts,
    bench_bin: &Path,
    cache: &Path,
    services: usize,
    rounds: usize,
    seed: &mut u64,
    skip: &mut Vec<ArmKind>,
    results: &mut Results,
) -> Result<()> {
    say(format!("=== {services} Services ==="));
    let scenario = Scenario::new(
        services,
        FILLER_ENDPOINTS,
        rules::target_endpoints(opts.target_endpoints),
    );
    let at = ArmCtx::new(opts, &scenario, cache, bench_bin);
    let mut arms = set_up_arms(
        "",
        &ArmKind::ALL,
        services,
        bench_bin,
        skip,
        &mut results.setups,
        |kind| setup_arm(&at, kind),
    )?;
    // The datapath needs no agent (programs and maps are pinned). Paused,
    // its periodic full resync of the manifests directory (seconds of CPU
    // at 100 000 Services) cannot take one of the two cores from whichever
    // arm is being measured.
    let paused: Vec<u32> = arms.iter().flat_map(Measured::agent_pids).collect();
    let measured = while_paused(&paused, || {
        measure_rounds(
            "",
            &durations(opts.quick),
            bench_bin,
            services,
            rounds,
            &mut arms,
            seed,
            &mut results.samples,
            |round, arms| {
                // The programs' cost, in a run of its own: run-time statistics
                // cost time themselves, so they are off during the measured runs.
                if let Some(ours) = arms.iter().find(|a| a.kind == ArmKind::Ours) {
                    let id = ours.connect4.expect("ours has connect4");
                    let cgroup = ours.cgroup.as_ref().expect("ours has a cgroup");
                    let floor = floor::FloorProgram::attach(cgroup.path())
                        .map_err(|e| say(format!("no floor program: {e:#}")))
                        .ok();
                    let ids: Vec<u32> = [id]
                        .into_iter()
                        .chain(floor.as_ref().map(|f| f.id))
                        .collect();
                    let (spent, _) = with_bpf_stats(&ids, || {
                        ours.measure(bench_bin, Mode::Cc, cost_run_ms(opts))
                    })?;
                    drop(floor);
                    let (floor_run_time_ns, floor_run_cnt) =
                        spent.get(1).copied().unwrap_or((0, 0));
                    results.costs.push(Cost {
                        services,
                        round,
                        run_cnt: spent[0].1,
                        run_time_ns: spent[0].0,
                        floor_run_cnt,
                        floor_run_time_ns,
                    });
                }
                Ok(())
            },
        )
    });
    measured?;
    if let Some(ours) = arms.iter().find(|a| a.kind == ArmKind::Ours) {
        if let (Some(agent), Some(s)) = (
            &ours.agent,
            results
                .setups
                .iter_mut()
                .rev()
                .find(|s| s.arm == ArmKind::Ours),
        ) {
            s.rss_mib = vm_hwm_mib(agent.pid()).or(s.rss_mib);
        }
    }
    arms.retain(|a| matches!(a.kind, ArmKind::Direct | ArmKind::Ours));
    let nf = noise_floor(opts, &at, bench_bin, services, seed, arms)?;
    results.noise_floors.push(nf);
    Ok(())
}

/// The A/A control ([`NoiseFloor`]) with the point's direct and ours arms
/// (the others torn down first), a second direct arm, and direct from
/// ours' own namespaces ([`ArmKind::DirectBeside`]).
fn noise_floor(
    opts: &Opts,
    at: &ArmCtx,
    bench_bin: &Path,
    services: usize,
    seed: &mut u64,
    mut arms: Vec<Arm>,
) -> Result<NoiseFloor> {
    let (again, _) = setup_arm(at, ArmKind::DirectAgain).context("setting up direct (again)")?;
    again.sanity(bench_bin)?;
    arms.push(again);
    let mut views: Vec<ControlArm> = arms.iter().map(ControlArm::Arm).collect();
    if let Some(ours) = arms.iter().find(|a| a.kind == ArmKind::Ours) {
        let beside = ControlArm::Beside {
            ours,
            targets: at.scenario.backends(),
        };
        beside.sanity(bench_bin)?;
        views.push(beside);
    }
    let rounds = noise_floor_rounds(opts.quick);
    let cc_ms = durations(opts.quick)
        .into_iter()
        .find_map(|(mode, ms)| (mode == Mode::Cc).then_some(ms))
        .context("no connect+close duration")?;
    say(format!(
        "=== connect+close A/A control at {services} Services: {rounds} rounds ==="
    ));
    let mut samples = Vec::new();
    let paused: Vec<u32> = arms.iter().flat_map(Measured::agent_pids).collect();
    while_paused(&paused, || {
        measure_rounds(
            "A/A ",
            &[(Mode::Cc, cc_ms)],
            bench_bin,
            services,
            rounds,
            &mut views,
            seed,
            &mut samples,
            |_, _| Ok(()),
        )
    })?;
    drop(views);
    say(format!("tearing down the {services}-Service arms"));
    drop(arms);
    Ok(NoiseFloor {
        services,
        rounds,
        cc_ms,
        samples,
    })
}

/// An arm of the A/A control: an arm as set up, or direct from ours'
/// namespaces.
enum ControlArm<'a> {
    Arm(&'a Arm),
    /// The client in ours' client namespace, not in its cgroup, connecting
    /// to the backend's addresses as the direct arm does: the same
    /// namespaces, bridge and server as ours, without our programs. Two
    /// topologies set up alike still differ by up to ~1 % in the A/A
    /// control (direct again ÷ direct), as much as the gap being measured.
    Beside {
        ours: &'a Arm,
        targets: Vec<SocketAddrV4>,
    },
}

impl Measured for ControlArm<'_> {
    fn kind(&self) -> ArmKind {
        match self {
            ControlArm::Arm(a) => a.kind,
            ControlArm::Beside { .. } => ArmKind::DirectBeside,
        }
    }

    fn measure(&self, bench_bin: &Path, mode: Mode, ms: u64) -> Result<Run> {
        match self {
            ControlArm::Arm(a) => a.measure(bench_bin, mode, ms),
            ControlArm::Beside { ours, targets } => {
                let targets = match mode {
                    Mode::Cc | Mode::Crr => &targets[..],
                    _ => &targets[..1],
                };
                run_bench_client(bench_bin, ours.client_ns(), None, targets, mode, ms)
            }
        }
    }

    fn sanity(&self, bench_bin: &Path) -> Result<()> {
        match self {
            ControlArm::Arm(a) => a.sanity(bench_bin),
            ControlArm::Beside { .. } => sanity(bench_bin, self),
        }
    }

    fn agent_pids(&self) -> Vec<u32> {
        match self {
            ControlArm::Arm(a) => a.agent_pids(),
            ControlArm::Beside { .. } => Vec::new(),
        }
    }
}

/// An arm as a round runs it.
pub trait Measured {
    fn kind(&self) -> ArmKind;
    fn measure(&self, bench_bin: &Path, mode: Mode, ms: u64) -> Result<Run>;
    /// A short run that must work before the arm is measured.
    fn sanity(&self, bench_bin: &Path) -> Result<()>;
    /// The pids of the arm's agents (paused while it is measured).
    fn agent_pids(&self) -> Vec<u32>;
}

impl Measured for Arm {
    fn kind(&self) -> ArmKind {
        self.kind
    }

    fn measure(&self, bench_bin: &Path, mode: Mode, ms: u64) -> Result<Run> {
        run_client(bench_bin, self, mode, ms)
    }

    fn sanity(&self, bench_bin: &Path) -> Result<()> {
        sanity(bench_bin, self)
    }

    fn agent_pids(&self) -> Vec<u32> {
        self.agent.iter().map(|ag| ag.pid()).collect()
    }
}

/// Where in the run a sample was taken.
#[derive(Clone, Copy)]
pub struct Point {
    pub services: usize,
    pub round: usize,
    pub rounds: usize,
}

/// One round: the arms in a new shuffled order, each through every test.
/// `label` prefixes the log lines ("NodePort ", or nothing).
pub fn measure_round<A: Measured>(
    label: &str,
    tests: &[(Mode, u64)],
    bench_bin: &Path,
    at: Point,
    arms: &mut [A],
    seed: &mut u64,
    samples: &mut Vec<Sample>,
) -> Result<()> {
    shuffle(arms, seed);
    let order: Vec<&str> = arms.iter().map(|a| a.kind().short()).collect();
    say(format!(
        "{label}round {}/{}: {}",
        at.round + 1,
        at.rounds,
        order.join(" ")
    ));
    for arm in arms.iter() {
        for &(mode, ms) in tests {
            let run = arm.measure(bench_bin, mode, ms)?;
            if run.errors > 0 {
                say(format!(
                    "  {label}{} {}: {} errors (first: {})",
                    arm.kind().label(),
                    mode.as_str(),
                    run.errors,
                    run.first_error.clone().unwrap_or_default()
                ));
            }
            samples.push(Sample {
                services: at.services,
                round: at.round,
                arm: arm.kind(),
                mode,
                run,
            });
        }
    }
    Ok(())
}

/// `rounds` rounds of [`measure_round`] at `services`; after each,
/// `cost(round, arms)` (the programs' cost, in a run of its own), then the
/// round's rates are logged.
#[allow(clippy::too_many_arguments)]
pub fn measure_rounds<A: Measured>(
    label: &str,
    tests: &[(Mode, u64)],
    bench_bin: &Path,
    services: usize,
    rounds: usize,
    arms: &mut [A],
    seed: &mut u64,
    samples: &mut Vec<Sample>,
    mut cost: impl FnMut(usize, &[A]) -> Result<()>,
) -> Result<()> {
    for round in 0..rounds {
        let at = Point {
            services,
            round,
            rounds,
        };
        measure_round(label, tests, bench_bin, at, arms, seed, samples)?;
        cost(round, arms)?;
        say_rates(label, arms, samples, services);
    }
    Ok(())
}

/// Runs `f` with the processes `pids` stopped (SIGSTOP), and resumes them
/// (SIGCONT) whatever `f` returns, so that teardown can stop them cleanly.
pub fn while_paused<R>(pids: &[u32], f: impl FnOnce() -> R) -> R {
    for pid in pids {
        cmd::signal(*pid, libc::SIGSTOP);
    }
    let r = f();
    for pid in pids {
        cmd::signal(*pid, libc::SIGCONT);
    }
    r
}

/// An error naming `kind` and `mode` when `r` (a sanity run) had no
/// successful operation or any error.
pub fn check_sanity(kind: ArmKind, mode: Mode, r: Run) -> Result<()> {
    if r.ops == 0 || r.errors > 0 {
        bail!(
            "{} {}: {} ok, {} errors (first: {})",
            kind.label(),
            mode.as_str(),
            r.ops,
            r.errors,
            r.first_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// Sets up every arm of a scale point but those that did not load at a
/// smaller one (`skip`, which grows by the ones that do not load now); each
/// arm that loaded must pass its [`sanity`](Measured::sanity) run before it
/// is measured.
pub fn set_up_arms<A: Measured>(
    label: &str,
    kinds: &[ArmKind],
    services: usize,
    bench_bin: &Path,
    skip: &mut Vec<ArmKind>,
    setups: &mut Vec<Setup>,
    mut set_up: impl FnMut(ArmKind) -> Result<(A, Setup)>,
) -> Result<Vec<A>> {
    let mut arms = Vec::new();
    for &kind in kinds {
        if skip.contains(&kind) {
            say(format!("{label}{}: {SKIPPED_EARLIER}", kind.label()));
            setups.push(Setup::skipped_earlier(services, kind));
            continue;
        }
        let t0 = Instant::now();
        let (arm, setup) = set_up(kind).with_context(|| {
            format!("setting up {label}{} at {services} Services", kind.label())
        })?;
        match (&setup.skipped, setup.load_s) {
            (Some(why), _) => {
                say(format!("{label}{}: {why}", kind.label()));
                skip.push(kind);
            }
            (None, Some(s)) => say(format!(
                "{label}{}: loaded in {s:.2} s (set-up {:.1} s){}",
                kind.label(),
                t0.elapsed().as_secs_f64(),
                setup
                    .rss_mib
                    .map(|m| format!(", agent peak RSS {m:.1} MiB"))
                    .unwrap_or_default()
            )),
            _ => {}
        }
        let ok = setup.skipped.is_none();
        setups.push(setup);
        if ok {
            arm.sanity(bench_bin)
                .with_context(|| format!("{label}{} at {services} Services", kind.label()))?;
            arms.push(arm);
        }
    }
    Ok(arms)
}

/// The length of the connect+close run that measures our programs' cost.
pub fn cost_run_ms(opts: &Opts) -> u64 {
    if opts.quick {
        300
    } else {
        500
    }
}

/// Runs `f` with BPF run-time statistics on; returns, per program id, the
/// (run_time_ns, run_cnt) it added, and `f`'s result.
pub fn with_bpf_stats<R>(
    ids: &[u32],
    f: impl FnOnce() -> Result<R>,
) -> Result<(Vec<(u64, u64)>, R)> {
    let stats = enable_bpf_stats()?;
    let before: Vec<(u64, u64)> = ids
        .iter()
        .map(|id| prog_stats(*id))
        .collect::<Result<_>>()?;
    let out = f()?;
    let after: Vec<(u64, u64)> = ids
        .iter()
        .map(|id| prog_stats(*id))
        .collect::<Result<_>>()?;
    drop(stats);
    let spent = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a.0.saturating_sub(b.0), a.1.saturating_sub(b.1)))
        .collect();
    Ok((spent, out))
}

/// Logs each arm's connect+close rate of the round just measured.
pub fn say_rates<A: Measured>(label: &str, arms: &[A], samples: &[Sample], services: usize) {
    let line: Vec<String> = arms
        .iter()
        .filter_map(|a| {
            samples
                .iter()
                .rev()
                .find(|s| s.arm == a.kind() && s.mode == Mode::Cc && s.services == services)
                .map(|s| format!("{} {:.0}/s", a.kind().short(), s.run.rate))
        })
        .collect();
    say(format!("  {label}connect+close: {}", line.join(", ")));
}

/// `field` (`elapsed_ms`, `apply_ms`, ...) of the agent's `synced` log
/// lines, after `skip` of them.
fn sync_field(log: &str, field: &str, skip: usize) -> Option<f64> {
    let key = format!(" {field}=");
    log.lines()
        .filter(|l| l.contains("synced") && l.contains(" elapsed_ms="))
        .nth(skip)
        .and_then(|l| {
            let i = l.find(&key)?;
            l[i + key.len()..].split_whitespace().next()?.parse().ok()
        })
}

fn sync_ms(log: &str, skip: usize) -> Option<f64> {
    sync_field(log, "elapsed_ms", skip)
}

fn metric(agent: &Agent, name: &str) -> Option<u64> {
    let (_, body) = agent.metrics().ok()?;
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map(|v| v as u64)
}

fn control_plane(
    opts: &Opts,
    bench_bin: &Path,
    cache: &Path,
    services: usize,
) -> Result<ControlPlane> {
    const ENDPOINTS: usize = 10;
    say(format!(
        "=== control plane: {services} Services x {ENDPOINTS} endpoints ==="
    ));
    let first = vec![Ipv4Addr::new(10, 244, 1, 1)];
    let scenario = Scenario::new(services, ENDPOINTS, first.clone());
    let mut cp = ControlPlane {
        services,
        endpoints: ENDPOINTS,
        ours_ready_s: None,
        ours_sync_ms: None,
        ours_sync_runs_ms: Vec::new(),
        ours_read_translate_ms: None,
        ours_apply_ms: None,
        ours_frontends: None,
        ours_rss_mib: None,
        change_ms: Vec::new(),
        change_sync_ms: Vec::new(),
        change_apply_ms: Vec::new(),
        iptables_nft_s: Err("not run".into()),
        iptables_legacy_s: Err("not run".into()),
        nft_s: Err("not run".into()),
        notes: Vec::new(),
        cluster: None,
    };
    let timeout = Duration::from_secs(opts.load_timeout.max(300));
    // Generate (or find) the files before any clock starts.
    let fillers = filler_file(&scenario, cache)?;
    let ipt = ruleset_file(ArmKind::IptablesNft, &scenario, cache)?;
    let nft = ruleset_file(ArmKind::Nftables, &scenario, cache)?;
    say(format!(
        "inputs: {} ({:.1} MB), {} ({:.1} MB), {} ({:.1} MB)",
        fillers.display(),
        mb(&fillers),
        ipt.display(),
        mb(&ipt),
        nft.display(),
        mb(&nft)
    ));
    {
        // A first sync is one run of a few hundred milliseconds, which a
        // moment's noise of a shared 2-core machine can double: two more
        // starts from empty maps (each its own pins, removed after), and
        // the goal is judged on the median start.
        // (start to /readyz in s; first sync, read + translate, map writes in ms)
        type Start = (f64, Option<f64>, Option<f64>, Option<f64>);
        let start = || {
            quiet("a start from manifests");
            start_ours(
                "cp-ours",
                &scenario,
                cache,
                &["--sync-debounce", "0s"],
                timeout,
            )
        };
        let first_sync = |took: f64, log: &str| -> Start {
            (
                took,
                sync_ms(log, 0),
                sync_field(log, "read_translate_ms", 0),
                sync_field(log, "apply_ms", 0),
            )
        };
        let mut starts: Vec<Start> = Vec::new();
        for _ in 0..2 {
            let (_cgroup, _dir, agent, took) = start()?;
            starts.push(first_sync(took, &agent.log()));
        }
        let (topo, _server) = testbed("cp-ours", bench_bin, 2)?;
        let (cgroup, dir, agent, took) = start()?;
        let manifests = dir.path().join("manifests");
        let log = agent.log();
        starts.push(first_sync(took, &log));
        cp.ours_sync_runs_ms = starts.iter().filter_map(|s| s.1).collect();
        let median = median_by(&starts, |s| s.1).expect("three starts");
        cp.ours_ready_s = Some(median.0);
        cp.ours_sync_ms = median.1;
        cp.ours_read_translate_ms = median.2;
        cp.ours_apply_ms = median.3;
        let want = (services - 1 + 2) as u64;
        cp.ours_frontends = metric(&agent, "lb_frontends_programmed").map(|got| (got, want));
        say(format!(
            "ours: /readyz after {took:.3} s, first syncs {:?} ms; the median {:?} ms (read + translate {:?} ms, map writes {:?} ms), frontends {:?}",
            cp.ours_sync_runs_ms, cp.ours_sync_ms, cp.ours_read_translate_ms, cp.ours_apply_ms, cp.ours_frontends
        ));
        // One endpoint change at a time, alternating between two backends
        // of the target: renamed into place, then connections until one
        // lands on the new endpoint.
        let arm = Arm {
            kind: ArmKind::Ours,
            agent: None,
            _server: KillOnDrop(Command::new("true").spawn()?),
            topo,
            cgroup: Some(cgroup),
            _dir: None,
            tcp: SocketAddrV4::new(TARGET_VIP, TARGET_PORT),
            udp: SocketAddrV4::new(TARGET_VIP, TARGET_PORT),
            direct: Vec::new(),
            connect4: None,
        };
        let changes = if opts.quick { 3 } else { 7 };
        let mut syncs_seen = log.matches(" elapsed_ms=").count();
        for k in 0..changes {
            let to = Ipv4Addr::new(10, 244, 1, if k % 2 == 0 { 2 } else { 1 });
            match endpoint_change(bench_bin, &arm, &manifests, to) {
                Ok(ms) => {
                    cp.change_ms.push(ms);
                    // Wait for the agent's log line of this sync.
                    let _ = integration_tests::wait_until(
                        Duration::from_secs(10),
                        Duration::from_millis(20),
                        || agent.log().matches(" elapsed_ms=").count() > syncs_seen,
                    );
                    let log = agent.log();
                    if let Some(s) = sync_ms(&log, syncs_seen) {
                        cp.change_sync_ms.push(s);
                    }
                    if let Some(s) = sync_field(&log, "apply_ms", syncs_seen) {
                        cp.change_apply_ms.push(s);
                    }
                    syncs_seen = log.matches(" elapsed_ms=").count();
                    say(format!(
                        "endpoint change {}: effective after {ms:.2} ms",
                        k + 1
                    ));
                }
                Err(e) => cp.notes.push(format!("endpoint change {}: {e:#}", k + 1)),
            }
        }
        cp.ours_rss_mib = vm_hwm_mib(agent.pid());
        say(format!("ours: peak RSS {:?} MiB", cp.ours_rss_mib));
        drop(agent);
        drop(arm);
    }
    // Three starts, as from manifests; the median by input to maps.
    let mut starts: Vec<ClusterStart> = Vec::new();
    for _ in 0..3 {
        quiet("a start in cluster mode");
        match cluster_start(&scenario, &fillers, timeout) {
            Ok(c) => starts.push(c),
            Err(e) => cp.notes.push(format!("cluster mode: {e:#}")),
        }
    }
    if let Some(mut median) = median_by(&starts, |c| c.input_to_maps_ms) {
        median.runs_ms = starts.iter().filter_map(|c| c.input_to_maps_ms).collect();
        cp.cluster = Some(median);
    }
    let others = [
        (ArmKind::IptablesNft, &mut cp.iptables_nft_s),
        (ArmKind::IptablesLegacy, &mut cp.iptables_legacy_s),
        (ArmKind::Nftables, &mut cp.nft_s),
    ];
    for (kind, slot) in others.into_iter().filter(|_| !opts.only_ours) {
        let mut topo = Topology::new(&format!("cp-{}", kind.short()))?;
        topo.add_host(
            "client",
            Ipv4Addr::new(10, 244, 1, 100),
            Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x100),
        )?;
        let file = if kind == ArmKind::Nftables {
            &nft
        } else {
            &ipt
        };
        say(format!("{}: loading {} ...", kind.label(), file.display()));
        *slot = load_rules(kind, topo.client_netns(), file, timeout);
        say(format!("{}: {:?}", kind.label(), slot));
        drop(topo);
    }
    Ok(cp)
}

/// `field` of the first agent log line with `message`.
fn log_field(log: &str, message: &str, field: &str) -> Option<f64> {
    let key = format!(" {field}=");
    let line = log.lines().find(|l| l.contains(message))?;
    let i = line.find(&key)?;
    line[i + key.len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Starts the agent in cluster mode on the control-plane scenario, served
/// by the list/watch fixture: how long until its objects are in the maps,
/// and the agent's peak RSS.
fn cluster_start(scenario: &Scenario, fillers: &Path, timeout: Duration) -> Result<ClusterStart> {
    use integration_tests::{agent::Source, apiserver::ApiServer};
    let api = ApiServer::try_start()?;
    let fillers: serde_json::Value = serde_json::from_slice(&fs::read(fillers)?)?;
    let target = Scenario::target_manifests(&scenario.target);
    for list in [&fillers, &target] {
        for item in list["items"].as_array().into_iter().flatten() {
            api.apply(item)?;
        }
    }
    let cgroup = CgroupGuard::create("cp-cluster")?;
    let dir = tempfile::Builder::new()
        .prefix(&integration_tests::unique_name("cp-cluster"))
        .tempdir()?;
    let mut extra_args = capacity_args(scenario.services, scenario.endpoints);
    extra_args.extend(["--sync-debounce".into(), "0s".into(), "--no-tc".into()]);
    let opts = AgentOpts {
        ready_timeout: timeout,
        log_file: Some(dir.path().join("agent.log")),
        extra_args,
        ..Default::default()
    };
    let url = api.url();
    let t0 = Instant::now();
    let agent = Agent::start_cluster(Source::ApiServer(&url), cgroup.path(), opts)?;
    let ready_s = t0.elapsed().as_secs_f64();
    let work = cpu_and_faults(agent.pid());
    let log = agent.log();
    // The agent's log lives in a temporary directory: kept on request for
    // a look at its timeline (lists, programs attached, sync).
    if let Ok(keep) = std::env::var("LB_BENCH_KEEP_LOG") {
        fs::write(&keep, &log).with_context(|| format!("LB_BENCH_KEEP_LOG={keep}"))?;
    }
    let lists = log
        .lines()
        .filter(|l| l.contains(" listed "))
        .filter_map(|l| {
            let field = |f: &str| {
                let key = format!(" {f}=");
                let i = l.find(&key)?;
                Some(l[i + key.len()..].split_whitespace().next()?.to_string())
            };
            Some((
                field("kind")?.trim_matches('"').to_string(),
                field("objects")?.parse().ok()?,
                field("list_ms")?.parse().ok()?,
            ))
        })
        .collect();
    let want = (scenario.services - 1 + 2) as u64;
    let c = ClusterStart {
        ready_s: Some(ready_s),
        input_to_maps_ms: log_field(
            &log,
            "first complete picture programmed",
            "input_to_maps_ms",
        ),
        sync_ms: sync_ms(&log, 0),
        read_translate_ms: sync_field(&log, "read_translate_ms", 0),
        apply_ms: sync_field(&log, "apply_ms", 0),
        lists,
        frontends: metric(&agent, "lb_frontends_programmed").map(|got| (got, want)),
        rss_mib: vm_hwm_mib(agent.pid()),
        cpu_ms: work.map(|w| w.0),
        minor_faults: work.map(|w| w.1),
        runs_ms: Vec::new(),
    };
    say(format!("ours (cluster mode): {c:?}"));
    Ok(c)
}

fn mb(p: &Path) -> f64 {
    fs::metadata(p).map(|m| m.len() as f64 / 1e6).unwrap_or(0.0)
}

/// Rewrites the target's endpoints to `to` and measures until a connection
/// lands there (CLOCK_MONOTONIC in both processes).
fn endpoint_change(bench_bin: &Path, arm: &Arm, manifests: &Path, to: Ipv4Addr) -> Result<f64> {
    let expect = SocketAddrV4::new(to, BACKEND_PORT);
    let mut c = client_cmd(bench_bin, arm, "until", arm.tcp, 20_000);
    c.args(["--expect", &expect.to_string(), "--max-ops", "2000000"]);
    let line = cmd::display(&c);
    let mut child = KillOnDrop(
        cmd::die_with_parent(&mut c, libc::SIGKILL)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run `{line}`"))?,
    );
    let stdout = child.0.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let ready = rx
        .recv_timeout(Duration::from_secs(10))
        .with_context(|| format!("`{line}`: no first reply"))?;
    if !ready.contains("ready") {
        bail!("`{line}`: {ready}");
    }
    let t0 = monotonic_ns();
    write_target(manifests, &[to])?;
    let mut changed = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) if l.contains("changed") => {
                let v: serde_json::Value = serde_json::from_str(&l)?;
                changed = v["changed"].as_u64();
                break;
            }
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => break,
        }
    }
    let t1 = changed.ok_or_else(|| anyhow!("`{line}`: the change never took effect"))?;
    Ok(t1.saturating_sub(t0) as f64 / 1e6)
}

fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the timespec we pass.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::median_by;

    /// The first-sync figures are judged on this median: a start that
    /// gave no figure must count as the slowest, never as the fastest
    /// (`f64` has no order of its own, and `None < Some` in Rust's).
    #[test]
    fn median_by_counts_a_start_without_a_figure_as_slowest() {
        let ms = |x: &Option<f64>| *x;
        assert_eq!(
            median_by(&[Some(301.0), Some(349.0), Some(334.0)], ms),
            Some(Some(334.0))
        );
        assert_eq!(
            median_by(&[None, Some(240.0), Some(250.0)], ms),
            Some(Some(250.0))
        );
        assert_eq!(median_by(&[None, None, Some(240.0)], ms), Some(None));
        // Even counts take the upper middle: the slower of the two.
        assert_eq!(median_by(&[Some(2.0), Some(1.0)], ms), Some(Some(2.0)));
        assert_eq!(median_by::<Option<f64>>(&[], ms), None);
    }
}
