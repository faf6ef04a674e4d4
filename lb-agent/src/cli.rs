//! Command line of `lb-agent`.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::datapath::{
    features::KernelFeatures,
    loader::{Capacity, Refusal},
};

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/lb";

#[derive(Debug, Parser)]
#[command(
    name = "lb-agent",
    version,
    about = "eBPF service load balancer for Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load the programs, attach them, and keep the maps in sync.
    Run(Box<RunArgs>),
    /// Read the pinned maps and show what the datapath does.
    Inspect {
        #[command(subcommand)]
        what: InspectWhat,
    },
    /// Say what this kernel supports and what `run` would do with it,
    /// changing nothing. Exits 0 when `run` can start here (also when it
    /// would only do less: tc programs rejected, EPERM refusals), 1 when
    /// something it needs is missing (BTF, cgroup v2, the maps, a socket
    /// program): the DaemonSet's init container.
    Check(CheckArgs),
    /// Detach the programs (links and clsact filters) and remove every pin.
    Cleanup {
        #[arg(long, default_value = DEFAULT_BPFFS)]
        bpffs: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Standalone mode: read Services, EndpointSlices and Endpoints from this
    /// directory (*.yaml, *.yml, *.json) and follow its changes. Without it,
    /// the agent watches the Kubernetes API.
    #[arg(long, conflicts_with_all = ["kubeconfig", "k8s_api_server"])]
    pub manifests: Option<PathBuf>,
    /// Standalone mode: a manifest file larger than this many bytes is not
    /// read (its objects are rejected, naming the file): decoding takes
    /// about three times a file's size in memory.
    #[arg(long, default_value_t = crate::input::manifest::DEFAULT_MAX_FILE_BYTES)]
    pub max_manifest_bytes: u64,
    /// Cluster mode: kubeconfig to use (default: in-cluster config, then
    /// $KUBECONFIG / ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Cluster mode: the API server URL, for kube-proxy-free clusters where
    /// the `kubernetes` Service cannot be reached before this agent runs.
    #[arg(long, env = "K8S_API_SERVER")]
    pub k8s_api_server: Option<String>,
    /// On exit, detach the programs and remove the pins. By default the
    /// datapath stays pinned and keeps serving until the agent restarts
    /// (and adopts it) or `lb-agent cleanup` removes it.
    #[arg(long)]
    pub cleanup_on_exit: bool,
    /// The cgroup v2 directory the socket programs attach to (default: the
    /// cgroup v2 root, found in /proc/mounts).
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// bpffs directory holding the pinned maps and links.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// This node's name: decides which endpoints are local.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Address of /healthz, /livez and /readyz, like kube-proxy's
    /// --healthz-bind-address: every address by default, for cloud load
    /// balancers that probe the nodes (0.0.0.0 includes IPv6).
    #[arg(
        long,
        visible_alias = "healthz-bind-address",
        default_value = "0.0.0.0:10256"
    )]
    pub health_addr: SocketAddr,
    /// /healthz and /livez answer 503 once a received change has waited
    /// this long for a successful sync (kube-proxy: twice its sync period).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub healthz_timeout: Duration,
    /// Address of /metrics, like kube-proxy's --metrics-bind-address.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Coalesce bursts of changes for this long before a sync.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub sync_debounce: Duration,
    /// Backend selection for Services without the
    /// `lb-agent.dev/lb-algorithm` annotation.
    #[arg(long, value_enum, default_value_t = AlgorithmArg::Random)]
    pub algorithm: AlgorithmArg,
    /// Length of each Maglev lookup table: a prime, one of
    /// 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521.
    #[arg(long, default_value_t = crate::semantics::maglev::DEFAULT_TABLE_SIZE, value_parser = maglev_size)]
    pub maglev_table_size: u16,
    /// Outlier detection: a backend whose TCP connects fail
    /// (`--outlier-consecutive-failures` in a row) is quarantined. `on`:
    /// new flows avoid quarantined backends; `dry-run`: detected and
    /// reported only; `off`: nothing. A Service's
    /// `lb-agent.dev/outlier-detection` annotation may turn it down, never
    /// up.
    #[arg(long, value_enum, default_value_t = OutlierDetectionArg::On)]
    pub outlier_detection: OutlierDetectionArg,
    /// Failed TCP connects in a row that quarantine a backend (at least 1).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 3,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub outlier_consecutive_failures: u32,
    /// How long a backend's first quarantine lasts; the nth in a row (no
    /// successful connect in between) lasts n times as long, at most
    /// `--outlier-max-ejection`. At least 1ms.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = ejection_duration)]
    pub outlier_base_ejection: Duration,
    /// The longest quarantine. At least 1ms.
    #[arg(long, value_name = "DURATION", default_value = "300s", value_parser = ejection_duration)]
    pub outlier_max_ejection: Duration,
    /// The most of a frontend's backends quarantined at once, in percent
    /// (0..=100); never its last one.
    #[arg(
        long,
        value_name = "PERCENT",
        default_value_t = 50,
        value_parser = clap::value_parser!(u32).range(0..=100)
    )]
    pub outlier_max_ejection_percent: u32,
    #[arg(long, value_enum, default_value_t = RefusalArg::Auto, help = REFUSAL_HELP)]
    pub refusal: RefusalArg,
    /// The Service CIDRs (comma-separated, both families), as the API
    /// server's flag of that name: a connect or datagram from the node to
    /// an address of them that no Service holds is refused at once, and a
    /// packet from outside dropped, as kube-proxy's nftables mode does.
    /// In cluster mode joined with the `ServiceCIDR` objects' CIDRs.
    #[arg(long, value_delimiter = ',', value_name = "CIDRS",
          value_parser = crate::semantics::service_cidr::parse_range)]
    pub service_cluster_ip_range: Vec<crate::semantics::model::Cidr>,
    #[command(flatten)]
    pub capacity: Capacity,
    #[command(flatten)]
    pub north_south: NorthSouthArgs,
}

impl RunArgs {
    /// `--outlier-consecutive-failures`, `--outlier-base-ejection`,
    /// `--outlier-max-ejection` and `--outlier-max-ejection-percent`, as
    /// `LB_TC_CONFIG` carries them.
    pub fn outlier_settings(&self) -> crate::datapath::tc::OutlierSettings {
        crate::datapath::tc::OutlierSettings {
            consecutive_failures: self.outlier_consecutive_failures,
            base_ejection: self.outlier_base_ejection,
            max_ejection: self.outlier_max_ejection,
            max_ejection_percent: self.outlier_max_ejection_percent,
        }
    }
}

const REFUSAL_HELP: &str = "How a connect or datagram to a Service without endpoints fails: \
    auto is ECONNREFUSED, as under kube-proxy, where the kernel lets the socket programs \
    set it (bpf_set_retval, Linux 6.1), else EPERM";

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[arg(long, value_enum, default_value_t = RefusalArg::Auto, help = REFUSAL_HELP)]
    pub refusal: RefusalArg,
    /// Print the verifier's whole log of each program it rejects.
    #[arg(long)]
    pub verifier_logs: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RefusalArg {
    Auto,
    Econnrefused,
    Eperm,
}

impl RefusalArg {
    pub fn resolve(self, kernel: &KernelFeatures) -> Refusal {
        match self {
            Self::Auto => Refusal::for_kernel(kernel),
            Self::Econnrefused => Refusal::Econnrefused,
            Self::Eperm => Refusal::Eperm,
        }
    }
}

/// The tc path: NodePorts, LoadBalancer IPs and externalIPs from outside.
#[derive(Debug, Clone, Args)]
pub struct NorthSouthArgs {
    /// Network devices that get the tc programs (comma-separated). Default:
    /// the devices carrying the Node's InternalIP and ExternalIP addresses;
    /// without a Node object (standalone mode) none, unless listed here.
    #[arg(long, value_delimiter = ',')]
    pub devices: Vec<String>,
    /// No tc path: the tc programs are attached to no device (NodePorts,
    /// LoadBalancer IPs and externalIPs are then served to pods and host
    /// processes only, by the socket path). An explicit opt-out, not a
    /// failure: /readyz does not wait for it.
    #[arg(long, conflicts_with_all = ["devices", "tc_attach"])]
    pub no_tc: bool,
    /// How the tc programs attach: `tcx` links (Linux 6.6), `netlink`
    /// filters of a clsact qdisc (older kernels), or `auto`: tcx where the
    /// kernel has it (probed at start), else netlink.
    #[arg(long, value_enum, default_value_t = TcAttachArg::Auto)]
    pub tc_attach: TcAttachArg,
    /// The XDP stage on the same devices: packets of established flows
    /// that leave the node again (to a backend on another node, and its
    /// replies) are translated and sent on from the driver; everything
    /// else goes to the tc programs as before. `native`: a device whose
    /// driver refuses native XDP is not ready; `best-effort`: it is served
    /// by tc alone, said in the log and `lb-agent inspect tc`.
    #[arg(long, value_enum, default_value_t = crate::datapath::devices::Acceleration::Off)]
    pub acceleration: crate::datapath::devices::Acceleration,
    /// Serve NodePorts only on node addresses within these prefixes
    /// (comma-separated), like kube-proxy's --nodeport-addresses.
    #[arg(long, value_delimiter = ',')]
    pub nodeport_addresses: Vec<crate::semantics::model::Cidr>,
    /// Opt-in CVE-2020-8554 mitigation: externalIPs outside these prefixes
    /// are refused, with a warning naming the Service.
    #[arg(long, value_delimiter = ',')]
    pub allowed_external_ip_cidrs: Vec<crate::semantics::model::Cidr>,
    /// Serve ClusterIPs to clients outside the node too (a Service CIDR
    /// routed or advertised to the nodes), as kube-proxy does; off by
    /// default, as Cilium's --bpf-lb-external-clusterip. Off, such packets
    /// pass the tc programs untouched.
    #[arg(long)]
    pub external_clusterip: bool,
    /// Idle lifetime of a TCP flow in the tc path's conntrack.
    #[arg(long, default_value = "6h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout: Duration,
    /// Lifetime of a TCP flow whose handshake is not complete (after
    /// its SYN): what a spoofed SYN costs.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_syn_timeout: Duration,
    /// Lifetime of a TCP flow after FIN or RST.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_close_timeout: Duration,
    /// Least lifetime after the close of a TCP flow whose backend sent the
    /// first FIN: the backend's TIME_WAIT (60 s on Linux), during which the
    /// flow's port toward it (a SNAT port) must not serve another client.
    /// 0s: the close timeout alone.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_time_wait_timeout: Duration,
    /// Idle lifetime of a UDP flow: in the tc path's conntrack, and of a
    /// UDP socket's flow to a frontend on the socket path, which keeps the
    /// socket's datagrams on one backend while it sends within this time
    /// (whole seconds, at least one).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout: Duration,
    /// How often expired conntrack, sessionAffinity and datagram flow
    /// entries are deleted (the kernel ignores them from their timeout on;
    /// this bounds how long they take room in the maps).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,
}

impl NorthSouthArgs {
    pub fn timeouts(&self) -> crate::datapath::tc::Timeouts {
        crate::datapath::tc::Timeouts {
            tcp: self.conntrack_tcp_timeout,
            tcp_syn: self.conntrack_tcp_syn_timeout,
            tcp_close: self.conntrack_tcp_close_timeout,
            tcp_time_wait: self.conntrack_tcp_time_wait_timeout,
            udp: self.conntrack_udp_timeout,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttachArg {
    Auto,
    Tcx,
    Netlink,
}

impl NorthSouthArgs {
    /// How the tc programs attach, `None` with `--no-tc`; `auto` probes
    /// the kernel ([`tcx_supported`](crate::datapath::features::tcx_supported)).
    pub fn tc_attach_mode(&self) -> Option<crate::datapath::devices::AttachMode> {
        use crate::datapath::devices::AttachMode;
        if self.no_tc {
            return None;
        }
        Some(match self.tc_attach {
            TcAttachArg::Tcx => AttachMode::Tcx,
            TcAttachArg::Netlink => AttachMode::Netlink,
            TcAttachArg::Auto if crate::datapath::features::tcx_supported() => AttachMode::Tcx,
            TcAttachArg::Auto => AttachMode::Netlink,
        })
    }
}

/// `--algorithm`: the node's default scheduler (kube-proxy's
/// `--ipvs-scheduler` for the ipvs ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AlgorithmArg {
    /// Uniformly at random, as kube-proxy's iptables and nftables modes.
    Random,
    /// Maglev consistent hashing of the flow.
    Maglev,
    /// Round-robin (ipvs rr).
    Rr,
    /// Least connection (ipvs lc).
    Lc,
    /// Destination hashing (ipvs dh): one backend per frontend.
    Dh,
    /// Source hashing (ipvs sh): one backend per client.
    Sh,
    /// Shortest expected delay (ipvs sed).
    Sed,
    /// Never queue (ipvs nq).
    Nq,
}

impl From<AlgorithmArg> for crate::semantics::model::Algorithm {
    fn from(a: AlgorithmArg) -> Self {
        use crate::semantics::model::Algorithm;
        match a {
            AlgorithmArg::Random => Algorithm::Random,
            AlgorithmArg::Maglev => Algorithm::Maglev,
            AlgorithmArg::Rr => Algorithm::Rr,
            AlgorithmArg::Lc => Algorithm::Lc,
            AlgorithmArg::Dh => Algorithm::Dh,
            AlgorithmArg::Sh => Algorithm::Sh,
            AlgorithmArg::Sed => Algorithm::Sed,
            AlgorithmArg::Nq => Algorithm::Nq,
        }
    }
}

/// `--outlier-detection`: the node's outlier detection, the most a
/// Service's annotation can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutlierDetectionArg {
    /// Detect, and avoid quarantined backends.
    On,
    /// Detect and report only.
    DryRun,
    /// Nothing.
    Off,
}

impl From<OutlierDetectionArg> for crate::semantics::model::OutlierMode {
    fn from(a: OutlierDetectionArg) -> Self {
        use crate::semantics::model::OutlierMode;
        match a {
            OutlierDetectionArg::On => OutlierMode::On,
            OutlierDetectionArg::DryRun => OutlierMode::DryRun,
            OutlierDetectionArg::Off => OutlierMode::Off,
        }
    }
}

/// A quarantine's length: a duration of at least a millisecond (the
/// kernel counts in ms).
fn ejection_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if d < Duration::from_millis(1) {
        return Err(format!("{s:?} is shorter than 1ms"));
    }
    Ok(d)
}

fn maglev_size(s: &str) -> Result<u16, String> {
    let n: u16 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if crate::semantics::maglev::TABLE_SIZES.contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "{n} is not one of the supported primes {:?}",
            crate::semantics::maglev::TABLE_SIZES
        ))
    }
}

#[derive(Debug, Subcommand)]
pub enum InspectWhat {
    /// Every frontend with its backends, like `ipvsadm -Ln`.
    Services(InspectArgs),
    /// Live sessionAffinity entries: client, Service, backend and age.
    Affinity(InspectArgs),
    /// Flows of UDP sockets to frontends: the backend every datagram of
    /// the socket goes to, and how long it has been idle.
    DatagramFlows(InspectArgs),
    /// Flows of the tc path (NodePort, LoadBalancer, externalIP): both
    /// directions, their translation and idle time.
    Conntrack(InspectArgs),
    /// Where the tc programs are attached in this network namespace (TCX
    /// links as the kernel lists them, clsact filters as recorded), and
    /// why the agent could not attach them where asked, while it cannot.
    Tc(InspectArgs),
    /// The ports the tc path looks at beyond its first check: those local
    /// backends serve on (`LB_LOCAL_PORTS`, for tc_egress) and those its
    /// frontends listen on (`LB_FRONTEND_PORTS`, for tc_ingress). Marks
    /// stay while the pins last.
    Ports(InspectArgs),
    /// The guarded Service CIDRs (`LB_TC_CONFIG`): an address of them
    /// that no Service holds is refused (socket path) or dropped (tc).
    ServiceCidrs(InspectArgs),
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let cli = Cli::try_parse_from([&["lb-agent", "run"], args].concat()).unwrap();
        match cli.command {
            Command::Run(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    /// kube-proxy's defaults: health on every address at 10256 (cloud
    /// load balancers probe it), metrics on loopback at 10249 apart.
    #[test]
    fn health_and_metrics_defaults_like_kube_proxy() {
        let a = run_args(&[]);
        assert_eq!(a.health_addr, "0.0.0.0:10256".parse().unwrap());
        assert_eq!(a.metrics_bind_address, "127.0.0.1:10249".parse().unwrap());
        assert_eq!(a.healthz_timeout, Duration::from_secs(60));
        let a = run_args(&[
            "--healthz-bind-address=127.0.0.1:1",
            "--metrics-bind-address=127.0.0.1:2",
            "--healthz-timeout=1500ms",
        ]);
        assert_eq!(a.health_addr.port(), 1);
        assert_eq!(a.metrics_bind_address.port(), 2);
        assert_eq!(a.healthz_timeout, Duration::from_millis(1500));
    }

    #[test]
    fn outlier_detection_options() {
        use crate::semantics::model::OutlierMode;
        let a = run_args(&[]);
        assert_eq!(a.outlier_detection, OutlierDetectionArg::On);
        assert_eq!(OutlierMode::from(a.outlier_detection), OutlierMode::On);
        assert_eq!(
            a.outlier_settings(),
            crate::datapath::tc::OutlierSettings {
                consecutive_failures: 3,
                base_ejection: Duration::from_secs(10),
                max_ejection: Duration::from_secs(300),
                max_ejection_percent: 50,
            }
        );
        let a = run_args(&[
            "--outlier-detection=dry-run",
            "--outlier-consecutive-failures=1",
            "--outlier-base-ejection=1500ms",
            "--outlier-max-ejection=1h",
            "--outlier-max-ejection-percent=0",
        ]);
        assert_eq!(OutlierMode::from(a.outlier_detection), OutlierMode::DryRun);
        assert_eq!(a.outlier_consecutive_failures, 1);
        assert_eq!(a.outlier_base_ejection, Duration::from_millis(1500));
        assert_eq!(a.outlier_max_ejection, Duration::from_secs(3600));
        assert_eq!(a.outlier_max_ejection_percent, 0);
        let a = run_args(&[
            "--outlier-detection",
            "off",
            "--outlier-max-ejection-percent",
            "100",
        ]);
        assert_eq!(OutlierMode::from(a.outlier_detection), OutlierMode::Off);
        assert_eq!(a.outlier_max_ejection_percent, 100);
        for (bad, flag) in [
            ("--outlier-detection=maybe", "--outlier-detection"),
            ("--outlier-detection=dry_run", "--outlier-detection"),
            (
                "--outlier-consecutive-failures=0",
                "--outlier-consecutive-failures",
            ),
            (
                "--outlier-consecutive-failures=-1",
                "--outlier-consecutive-failures",
            ),
            ("--outlier-base-ejection=0s", "--outlier-base-ejection"),
            ("--outlier-base-ejection=soon", "--outlier-base-ejection"),
            ("--outlier-max-ejection=0ms", "--outlier-max-ejection"),
            (
                "--outlier-max-ejection-percent=101",
                "--outlier-max-ejection-percent",
            ),
        ] {
            let err = Cli::try_parse_from(["lb-agent", "run", bad]).unwrap_err();
            use clap::error::ErrorKind;
            assert!(
                matches!(
                    err.kind(),
                    ErrorKind::ValueValidation | ErrorKind::InvalidValue
                ),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(flag), "{bad}: {err}");
        }
    }

    #[test]
    fn the_tc_path_is_opted_out_explicitly_and_its_attach_mode_chosen() {
        use crate::datapath::devices::AttachMode;
        let a = run_args(&["--tc-attach", "netlink"]);
        assert_eq!(a.north_south.tc_attach_mode(), Some(AttachMode::Netlink));
        let a = run_args(&["--tc-attach=tcx", "--devices", "eth0"]);
        assert_eq!(a.north_south.tc_attach_mode(), Some(AttachMode::Tcx));
        assert_eq!(run_args(&[]).north_south.tc_attach, TcAttachArg::Auto);
        assert_eq!(run_args(&["--no-tc"]).north_south.tc_attach_mode(), None);
        for bad in [
            &["--no-tc", "--devices", "eth0"][..],
            &["--no-tc", "--tc-attach", "netlink"],
            &["--tc-attach", "xdp"],
        ] {
            let args = [&["lb-agent", "run"][..], bad].concat();
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }
}
